//! kubelet's PodResources API (v1, `proto/podresources/v1/api.proto`): which devices a pod
//! holds, asked at the pod's boot. `Get` for the one pod, `List` where the kubelet does not
//! implement `Get` (before 1.27, or with its feature gate off). Bounded: one deadline over the
//! connection and the call, and a size limit on the answer.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Endpoint, Uri};

use super::DevicesError;

/// The generated v1 API (client and server; the server is the tests' stand-in kubelet).
pub mod v1 {
    tonic::include_proto!("v1");
}

use v1::pod_resources_lister_client::PodResourcesListerClient;

/// kubelet's socket.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// How long connecting and asking may take together.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read (a `List` of a big node is a few hundred KiB).
pub const MAX_ANSWER_BYTES: usize = 4 << 20;

/// A device the pod holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeldDevice {
    /// A device plugin's device: its resource name and device id.
    Plugin { resource: String, id: String },
    /// A DRA claim's CDI device (`vendor.com/class=name`).
    Cdi(String),
}

impl HeldDevice {
    /// The fully qualified CDI device name (a plugin's device is `<resource>=<id>`).
    pub fn cdi_name(&self) -> String {
        match self {
            HeldDevice::Plugin { resource, id } => format!("{resource}={id}"),
            HeldDevice::Cdi(name) => name.clone(),
        }
    }
}

/// The devices pod `namespace/name` holds, in its containers' order; `None` when `socket` does
/// not exist (no kubelet on this host: no cold-plug).
pub async fn pod_devices(
    socket: &Path,
    name: &str,
    namespace: &str,
) -> Result<Option<Vec<HeldDevice>>, DevicesError> {
    if !socket.exists() {
        return Ok(None);
    }
    let err = |what: &str, e: &dyn std::fmt::Display| DevicesError::PodResources {
        socket: socket.to_path_buf(),
        detail: format!("{what}: {e}"),
    };
    let asked = tokio::time::timeout(TIMEOUT, ask(socket.to_path_buf(), name, namespace)).await;
    let pod = match asked {
        Err(_) => return Err(err("no answer", &format!("within {TIMEOUT:?}"))),
        Ok(Err(e)) => return Err(err("asking", &e)),
        Ok(Ok(pod)) => pod,
    };
    Ok(Some(pod.map(|p| held_devices(&p)).unwrap_or_default()))
}

#[derive(Debug, thiserror::Error)]
enum AskError {
    #[error(transparent)]
    Connect(#[from] tonic::transport::Error),
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
}

async fn ask(
    socket: PathBuf,
    name: &str,
    namespace: &str,
) -> Result<Option<v1::PodResources>, AskError> {
    let channel = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await?;
    let mut client =
        PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES);
    let get = client
        .get(v1::GetPodResourcesRequest {
            pod_name: name.to_string(),
            pod_namespace: namespace.to_string(),
        })
        .await;
    match get {
        Ok(answer) => Ok(answer.into_inner().pod_resources),
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            log::info!("PodResources Get is not served here; asking List");
            let list = client
                .list(v1::ListPodResourcesRequest {})
                .await?
                .into_inner();
            Ok(list
                .pod_resources
                .into_iter()
                .find(|p| p.name == name && p.namespace == namespace))
        }
        Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
        Err(status) => Err(status.into()),
    }
}

/// Every device of the pod's containers, each once, in order. Public for the fuzz target of
/// kubelet's answers (fuzz/fuzz_targets/pod_resources.rs).
pub fn held_devices(pod: &v1::PodResources) -> Vec<HeldDevice> {
    let mut out: Vec<HeldDevice> = Vec::new();
    let mut push = |d: HeldDevice| {
        if !out.contains(&d) {
            out.push(d);
        }
    };
    for c in &pod.containers {
        for d in &c.devices {
            for id in &d.device_ids {
                push(HeldDevice::Plugin {
                    resource: d.resource_name.clone(),
                    id: id.clone(),
                });
            }
        }
        for r in &c.dynamic_resources {
            for claim in &r.claim_resources {
                for cdi in &claim.cdi_devices {
                    push(HeldDevice::Cdi(cdi.name.clone()));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::v1::*;
    use super::*;

    #[test]
    fn lists_each_device_once() {
        let pod = PodResources {
            name: "p".into(),
            namespace: "n".into(),
            containers: vec![
                ContainerResources {
                    name: "a".into(),
                    devices: vec![ContainerDevices {
                        resource_name: "example.com/disk".into(),
                        device_ids: vec!["d0".into(), "d1".into()],
                        topology: None,
                    }],
                    ..Default::default()
                },
                ContainerResources {
                    name: "b".into(),
                    devices: vec![ContainerDevices {
                        resource_name: "example.com/disk".into(),
                        device_ids: vec!["d1".into()],
                        topology: None,
                    }],
                    dynamic_resources: vec![DynamicResource {
                        claim_resources: vec![ClaimResource {
                            cdi_devices: vec![CdiDevice {
                                name: "vendor.com/gpu=g0".into(),
                            }],
                            ..Default::default()
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
        };
        let held = held_devices(&pod);
        let names: Vec<String> = held.iter().map(HeldDevice::cdi_name).collect();
        assert_eq!(
            names,
            [
                "example.com/disk=d0",
                "example.com/disk=d1",
                "vendor.com/gpu=g0"
            ]
        );
    }

    #[tokio::test]
    async fn a_missing_socket_means_no_cold_plug() {
        assert_eq!(
            pod_devices(Path::new("/nonexistent/kubelet.sock"), "p", "n")
                .await
                .unwrap(),
            None
        );
    }
}
