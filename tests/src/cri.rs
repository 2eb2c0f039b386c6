//! A CRI (v1) client for the tests, on the `k8s-cri` crate with tonic over containerd's Unix
//! socket. Every call is bounded by the client's timeout; waits take their own bound.

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatus, ContainerStatusRequest,
    CreateContainerRequest, ExecSyncRequest, ImageSpec, ImageStatusRequest, KeyValue,
    LinuxPodSandboxConfig, ListPodSandboxRequest, PodSandboxConfig, PodSandboxMetadata,
    PodSandboxStatusRequest, PodSandboxStatusResponse, RemoveContainerRequest,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StatusRequest,
    StopContainerRequest, StopPodSandboxRequest,
};
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint, Uri};

pub use k8s_cri::v1;

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("connect to {socket}: {source}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("{call}: {}: {}", .status.code(), .status.message())]
    Rpc {
        call: &'static str,
        status: Box<tonic::Status>,
    },
    #[error("{call}: no answer within {after:?}")]
    Timeout { call: &'static str, after: Duration },
    #[error("{what} not reached within {after:?}: {detail}")]
    WaitTimeout {
        what: String,
        after: Duration,
        detail: String,
    },
    #[error("{call}: the response has no {field}")]
    Missing {
        call: &'static str,
        field: &'static str,
    },
    #[error("read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A pod started with [`CriClient::run_pod_sandbox`]: its id and the config CreateContainer
/// needs again.
#[derive(Debug, Clone)]
pub struct Pod {
    pub id: String,
    pub config: PodSandboxConfig,
    pub handler: String,
}

/// What ExecSync returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

/// One line of a CRI container log file (`<RFC3339 time> <stdout|stderr> <F|P> <text>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub stream: String,
    pub partial: bool,
    pub text: String,
}

/// A pod config with the fields the tests vary: name (also the hostname), log directory, cgroup
/// parent (the private containerd's, so its cleanup finds everything) and annotations.
pub fn pod_config(
    name: &str,
    log_directory: &Path,
    cgroup_parent: &str,
    annotations: HashMap<String, String>,
) -> PodSandboxConfig {
    let uid = format!(
        "{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    );
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.to_string(),
            uid,
            namespace: "microvm-tests".to_string(),
            attempt: 0,
        }),
        hostname: name.to_string(),
        log_directory: log_directory.to_string_lossy().into_owned(),
        annotations,
        linux: Some(LinuxPodSandboxConfig {
            cgroup_parent: cgroup_parent.to_string(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A container config: `command` is the entrypoint (empty: the image's), logs to `<name>.log`
/// in the pod's log directory.
pub fn container_config(name: &str, image: &str, command: &[&str]) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.to_string(),
            ..Default::default()
        }),
        command: command.iter().map(|s| s.to_string()).collect(),
        envs: vec![KeyValue {
            key: "MICROVM_TEST".into(),
            value: "1".into(),
        }],
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

/// The CRI runtime and image services of one containerd. Clones share the connection.
#[derive(Clone)]
pub struct CriClient {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    /// Bound on each call.
    pub timeout: Duration,
}

impl CriClient {
    /// Connects to the CRI services on containerd's socket.
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<Self, CriError> {
        let path = socket.to_path_buf();
        let endpoint = Endpoint::from_static("http://localhost").connect_timeout(timeout);
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|source| CriError::Connect {
                socket: socket.to_path_buf(),
                source,
            })?;
        Ok(CriClient {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            timeout,
        })
    }

    async fn call<T, F>(&self, call: &'static str, fut: F) -> Result<T, CriError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CriError::Rpc {
                call,
                status: Box::new(status),
            }),
            Err(_) => Err(CriError::Timeout {
                call,
                after: self.timeout,
            }),
        }
    }

    /// Waits until CRI reports the runtime and network ready and knows every image in `images`.
    pub async fn wait_ready(&self, images: &[&str], timeout: Duration) -> Result<(), CriError> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self
                .call(
                    "Status",
                    self.runtime
                        .clone()
                        .status(StatusRequest { verbose: false }),
                )
                .await?;
            let not_ready: Vec<String> = status
                .status
                .iter()
                .flat_map(|s| s.conditions.iter())
                .filter(|c| !c.status)
                .map(|c| format!("{}: {} {}", c.r#type, c.reason, c.message))
                .collect();
            let mut missing = Vec::new();
            for image in images {
                let found = self
                    .call(
                        "ImageStatus",
                        self.images.clone().image_status(ImageStatusRequest {
                            image: Some(ImageSpec {
                                image: image.to_string(),
                                ..Default::default()
                            }),
                            verbose: false,
                        }),
                    )
                    .await?;
                if found.image.is_none() {
                    missing.push(format!("image {image}"));
                }
            }
            if status.status.is_some() && not_ready.is_empty() && missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CriError::WaitTimeout {
                    what: "CRI ready".into(),
                    after: timeout,
                    detail: [not_ready, missing].concat().join("; "),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// RunPodSandbox with a runtime handler (`runc`, `microvm`).
    pub async fn run_pod_sandbox(
        &self,
        config: PodSandboxConfig,
        handler: &str,
    ) -> Result<Pod, CriError> {
        let response = self
            .call(
                "RunPodSandbox",
                self.runtime.clone().run_pod_sandbox(RunPodSandboxRequest {
                    config: Some(config.clone()),
                    runtime_handler: handler.to_string(),
                }),
            )
            .await?;
        Ok(Pod {
            id: response.pod_sandbox_id,
            config,
            handler: handler.to_string(),
        })
    }

    /// CreateContainer in a pod; returns the container id.
    pub async fn create_container(
        &self,
        pod: &Pod,
        config: ContainerConfig,
    ) -> Result<String, CriError> {
        let response = self
            .call(
                "CreateContainer",
                self.runtime
                    .clone()
                    .create_container(CreateContainerRequest {
                        pod_sandbox_id: pod.id.clone(),
                        config: Some(config),
                        sandbox_config: Some(pod.config.clone()),
                    }),
            )
            .await?;
        Ok(response.container_id)
    }

    pub async fn start_container(&self, id: &str) -> Result<(), CriError> {
        self.call(
            "StartContainer",
            self.runtime.clone().start_container(StartContainerRequest {
                container_id: id.to_string(),
            }),
        )
        .await
        .map(|_| ())
    }

    pub async fn stop_container(&self, id: &str, grace_seconds: i64) -> Result<(), CriError> {
        self.call(
            "StopContainer",
            self.runtime.clone().stop_container(StopContainerRequest {
                container_id: id.to_string(),
                timeout: grace_seconds,
            }),
        )
        .await
        .map(|_| ())
    }

    pub async fn remove_container(&self, id: &str) -> Result<(), CriError> {
        self.call(
            "RemoveContainer",
            self.runtime
                .clone()
                .remove_container(RemoveContainerRequest {
                    container_id: id.to_string(),
                }),
        )
        .await
        .map(|_| ())
    }

    /// UpdateContainerResources of container `id` with `resources`.
    pub async fn update_container_resources(
        &self,
        id: &str,
        resources: k8s_cri::v1::LinuxContainerResources,
    ) -> Result<(), CriError> {
        self.call(
            "UpdateContainerResources",
            self.runtime.clone().update_container_resources(
                k8s_cri::v1::UpdateContainerResourcesRequest {
                    container_id: id.to_string(),
                    linux: Some(resources),
                    ..Default::default()
                },
            ),
        )
        .await
        .map(|_| ())
    }

    /// ExecSync with a timeout in seconds for the command itself (0: none; the call's own
    /// timeout still bounds it).
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout_seconds: i64,
    ) -> Result<ExecOutput, CriError> {
        let response = self
            .call(
                "ExecSync",
                self.runtime.clone().exec_sync(ExecSyncRequest {
                    container_id: id.to_string(),
                    cmd: cmd.iter().map(|s| s.to_string()).collect(),
                    timeout: timeout_seconds,
                }),
            )
            .await?;
        Ok(ExecOutput {
            stdout: String::from_utf8_lossy(&response.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&response.stderr).into_owned(),
            exit_code: response.exit_code,
        })
    }

    /// PortForward: the streaming URL (containerd's stream server) for `ports` of pod `pod_id`;
    /// `port_forward::PortForwardSession` speaks its protocol.
    pub async fn port_forward(&self, pod_id: &str, ports: &[u16]) -> Result<String, CriError> {
        let response = self
            .call(
                "PortForward",
                self.runtime
                    .clone()
                    .port_forward(k8s_cri::v1::PortForwardRequest {
                        pod_sandbox_id: pod_id.to_string(),
                        port: ports.iter().map(|&p| i32::from(p)).collect(),
                    }),
            )
            .await?;
        Ok(response.url)
    }

    pub async fn container_status(&self, id: &str) -> Result<ContainerStatus, CriError> {
        self.call(
            "ContainerStatus",
            self.runtime
                .clone()
                .container_status(ContainerStatusRequest {
                    container_id: id.to_string(),
                    verbose: false,
                }),
        )
        .await?
        .status
        .ok_or(CriError::Missing {
            call: "ContainerStatus",
            field: "status",
        })
    }

    /// Polls ContainerStatus until the container has exited; returns that status.
    pub async fn wait_container_exited(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<ContainerStatus, CriError> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.container_status(id).await?;
            if status.state == ContainerState::ContainerExited as i32 {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(CriError::WaitTimeout {
                    what: format!("exit of container {id}"),
                    after: timeout,
                    detail: format!("state {}", status.state),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn pod_sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<PodSandboxStatusResponse, CriError> {
        self.call(
            "PodSandboxStatus",
            self.runtime
                .clone()
                .pod_sandbox_status(PodSandboxStatusRequest {
                    pod_sandbox_id: id.to_string(),
                    verbose,
                }),
        )
        .await
    }

    /// The network namespace path containerd made for a pod (from the verbose status' runtime
    /// spec), if it has one.
    pub async fn pod_netns_path(&self, id: &str) -> Result<Option<PathBuf>, CriError> {
        let status = self.pod_sandbox_status(id, true).await?;
        let Some(info) = status.info.get("info") else {
            return Ok(None);
        };
        let info: serde_json::Value = serde_json::from_str(info).unwrap_or_default();
        let namespaces = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        Ok(namespaces
            .iter()
            .find(|ns| ns["type"] == "network")
            .and_then(|ns| ns["path"].as_str())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from))
    }

    pub async fn stop_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        self.call(
            "StopPodSandbox",
            self.runtime
                .clone()
                .stop_pod_sandbox(StopPodSandboxRequest {
                    pod_sandbox_id: id.to_string(),
                }),
        )
        .await
        .map(|_| ())
    }

    pub async fn remove_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        self.call(
            "RemovePodSandbox",
            self.runtime
                .clone()
                .remove_pod_sandbox(RemovePodSandboxRequest {
                    pod_sandbox_id: id.to_string(),
                }),
        )
        .await
        .map(|_| ())
    }

    /// StopPodSandbox then RemovePodSandbox, retried each second as kubelet retries, until both
    /// succeed or `limit` passes (then the last error). After its shim was killed, containerd
    /// 1.7 and 2.x report a pod's app container as still running for about 2 s, for runc pods
    /// as for ours (tests/tests/cri_runc.rs, docs/testing-containerd.md); 1.6 does not.
    /// Returns the attempts it took.
    pub async fn stop_and_remove_pod_retrying(
        &self,
        id: &str,
        limit: std::time::Duration,
    ) -> Result<u32, CriError> {
        let start = std::time::Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = match self.stop_pod_sandbox(id).await {
                Ok(()) => self.remove_pod_sandbox(id).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => return Ok(attempts),
                Err(e) if start.elapsed() >= limit => return Err(e),
                Err(_) => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
            }
        }
    }

    /// Ids of every pod sandbox containerd knows.
    pub async fn list_pod_ids(&self) -> Result<Vec<String>, CriError> {
        Ok(self
            .call(
                "ListPodSandbox",
                self.runtime
                    .clone()
                    .list_pod_sandbox(ListPodSandboxRequest { filter: None }),
            )
            .await?
            .items
            .into_iter()
            .map(|p| p.id)
            .collect())
    }

    /// Stops and removes every pod (a test's cleanup before the harness's forceful one).
    pub async fn remove_all_pods(&self) -> Result<(), CriError> {
        for id in self.list_pod_ids().await? {
            self.stop_pod_sandbox(&id).await?;
            self.remove_pod_sandbox(&id).await?;
        }
        Ok(())
    }
}

/// Reads a CRI container log file.
pub fn read_cri_log(path: &Path) -> Result<Vec<LogLine>, CriError> {
    let text = std::fs::read_to_string(path).map_err(|source| CriError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parse_cri_log(&text))
}

/// Parses CRI log lines; lines that do not have the four fields are skipped.
pub fn parse_cri_log(text: &str) -> Vec<LogLine> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(4, ' ');
            let _time = fields.next()?;
            let stream = fields.next()?;
            let tag = fields.next()?;
            let text = fields.next().unwrap_or("");
            Some(LogLine {
                stream: stream.to_string(),
                partial: tag == "P",
                text: text.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_log_lines_parse() {
        let lines = parse_cri_log(
            "2024-01-01T00:00:00.1Z stdout F hello world\n\
             2024-01-01T00:00:00.2Z stderr P part\n\
             garbage\n",
        );
        assert_eq!(
            lines,
            vec![
                LogLine {
                    stream: "stdout".into(),
                    partial: false,
                    text: "hello world".into()
                },
                LogLine {
                    stream: "stderr".into(),
                    partial: true,
                    text: "part".into()
                },
            ]
        );
    }

    #[test]
    fn pod_config_carries_cgroup_parent_and_annotations() {
        let mut annotations = HashMap::new();
        annotations.insert("microvm.io/vcpus".to_string(), "2".to_string());
        let config = pod_config("p", Path::new("/logs/p"), "/microvm-test-x", annotations);
        assert_eq!(config.linux.unwrap().cgroup_parent, "/microvm-test-x");
        assert_eq!(config.annotations["microvm.io/vcpus"], "2");
        assert_eq!(config.log_directory, "/logs/p");
        let a = pod_config("p", Path::new("/l"), "/c", HashMap::new());
        std::thread::sleep(Duration::from_millis(1));
        let b = pod_config("p", Path::new("/l"), "/c", HashMap::new());
        assert_ne!(a.metadata.unwrap().uid, b.metadata.unwrap().uid);
    }
}
