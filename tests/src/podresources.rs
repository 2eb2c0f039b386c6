//! A stand-in for kubelet's PodResources API: a tonic server speaking the real v1 gRPC API
//! (the shim's generated `podresources::v1`) on a Unix socket, answering for the pods it is
//! given. With [`GetSupport::ListOnly`] it answers `Get` with UNIMPLEMENTED, as kubelets before
//! 1.27 do, so the shim's `List` fallback is exercised.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use shim::resources::devices::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use shim::resources::devices::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use tonic::{Request, Response, Status};

/// Whether the server implements `Get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetSupport {
    Get,
    ListOnly,
}

#[derive(Clone)]
struct Lister {
    pods: Arc<Mutex<Vec<PodResources>>>,
    get: GetSupport,
    calls: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.calls.lock().unwrap().push("List".into());
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: self.pods.lock().unwrap().clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Ok(Response::new(AllocatableResourcesResponse::default()))
    }

    async fn get(
        &self,
        req: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let req = req.into_inner();
        self.calls
            .lock()
            .unwrap()
            .push(format!("Get {}/{}", req.pod_namespace, req.pod_name));
        if self.get == GetSupport::ListOnly {
            return Err(Status::unimplemented("Get is not enabled"));
        }
        let pod = self
            .pods
            .lock()
            .unwrap()
            .iter()
            .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("pod {} not found", req.pod_name)))?;
        Ok(Response::new(GetPodResourcesResponse {
            pod_resources: Some(pod),
        }))
    }
}

/// A running stand-in kubelet; stops when dropped.
pub struct PodResourcesServer {
    socket: PathBuf,
    pods: Arc<Mutex<Vec<PodResources>>>,
    calls: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodResourcesServer {
    /// Serves on `socket` (in the test's temporary folder); call from a tokio runtime.
    pub fn start(socket: &Path, get: GetSupport) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket)?;
        let pods = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let lister = Lister {
            pods: pods.clone(),
            get,
            calls: calls.clone(),
        };
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let task = tokio::spawn(async move {
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(lister))
                .serve_with_incoming(incoming)
                .await
            {
                log::warn!("the test PodResources server ended: {e}");
            }
        });
        Ok(PodResourcesServer {
            socket: socket.to_path_buf(),
            pods,
            calls,
            task,
        })
    }

    /// The socket the shim's config names.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Pod `namespace/name` holds `devices` (resource name, device ids) in one container.
    pub fn add_pod(&self, namespace: &str, name: &str, devices: &[(&str, &[&str])]) {
        self.pods.lock().unwrap().push(PodResources {
            name: name.to_string(),
            namespace: namespace.to_string(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: devices
                    .iter()
                    .map(|(resource, ids)| ContainerDevices {
                        resource_name: resource.to_string(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                        topology: None,
                    })
                    .collect(),
                ..Default::default()
            }],
        });
    }

    /// The calls served so far (`List`, `Get <namespace>/<name>`).
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for PodResourcesServer {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}
