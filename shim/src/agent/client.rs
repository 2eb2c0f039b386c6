//! [`AgentClient`]: the agent's ttrpc service through ttrpc's async client. Every call goes
//! through one helper ([`AgentClient::call`]) that bounds it in time and names the method in its
//! error; each typed method below builds its request and checks its reply.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use agent_protocol::agent::{self as pb, CheckResponse};
use agent_protocol::agent_ttrpc_async::AgentClient as Rpc;
use ttrpc::context::{self, Context};

use super::{agent_text, bounded_rpc_error, connection, guest_pid, is_timeout, AgentError};

/// Timeout of one RPC unless [`AgentClient::set_call_timeout`] changes it.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of CreateContainer and StartExec: the agent bounds its libcontainer build at 20 s
/// (guest-agent/src/build_process.rs `BUILD_TIMEOUT`) and says why it gave up; this leaves room
/// for that answer and the rest of the call.
pub const BUILD_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Slack on top of a call's own deadline before the helper gives up on ttrpc itself.
const CALL_SLACK: Duration = Duration::from_secs(1);

/// Bounds on the strings of a Check reply.
const MAX_VERSION_LEN: usize = 64;
const MAX_KERNEL_RELEASE_LEN: usize = 256;
const MAX_BOOT_ID_LEN: usize = 64;
/// Most pids a ListPids reply may carry.
const MAX_PIDS: usize = 65_536;

/// What Check reports about the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentInfo {
    pub agent_version: String,
    pub kernel_release: String,
    pub online_vcpus: u32,
    pub mem_total_kib: u64,
    pub boot_id: String,
}

/// A connected agent. Cheap to clone: clones share one connection, whose calls run
/// concurrently (a long poll does not hold up other calls).
#[derive(Clone)]
pub struct AgentClient {
    rpc: Rpc,
    call_timeout: Duration,
}

impl AgentClient {
    /// Reaches the agent on guest vsock `port` through the VM's hybrid-vsock socket `uds_path`,
    /// retrying while the VM boots, for at most `timeout` in all. Needs a tokio runtime (the
    /// ttrpc connection runs as a task of it).
    pub async fn connect(
        uds_path: &Path,
        port: u32,
        timeout: Duration,
    ) -> Result<Self, AgentError> {
        let stream = connection::connect(uds_path, port, timeout).await?;
        let socket = ttrpc::r#async::transport::Socket::new(stream);
        Ok(Self {
            rpc: Rpc::new(ttrpc::r#async::Client::new(socket)),
            call_timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// Changes the timeout of each later call (long polls take their own).
    pub fn set_call_timeout(&mut self, timeout: Duration) {
        self.call_timeout = timeout;
    }

    /// The one call helper: runs `f` with a context bounded by `timeout`, and bounds the whole
    /// call by that plus a little (the ttrpc client enforces the deadline itself; this makes
    /// sure nothing else it waits on can hold a caller). Failures name `method`, and every
    /// string the agent put in one is bounded here ([`bounded_rpc_error`]), before any caller
    /// sees it.
    async fn call<R, Fut>(
        &self,
        method: &'static str,
        timeout: Duration,
        f: impl FnOnce(Rpc, Context) -> Fut,
    ) -> Result<R, AgentError>
    where
        Fut: Future<Output = ttrpc::Result<R>>,
    {
        let call = f(self.rpc.clone(), context::with_duration(timeout));
        match tokio::time::timeout(timeout.saturating_add(CALL_SLACK), call).await {
            Ok(result) => result.map_err(|source| AgentError::Rpc {
                method,
                source: bounded_rpc_error(source),
            }),
            Err(_) => Err(AgentError::Rpc {
                method,
                source: ttrpc::Error::Others(format!("call timeout after {timeout:?}")),
            }),
        }
    }

    /// [`Self::call`] with the default timeout.
    async fn unary<R, Fut>(
        &self,
        method: &'static str,
        f: impl FnOnce(Rpc, Context) -> Fut,
    ) -> Result<R, AgentError>
    where
        Fut: Future<Output = ttrpc::Result<R>>,
    {
        self.call(method, self.call_timeout, f).await
    }

    /// Asks the agent for the guest's facts.
    pub async fn check(&self) -> Result<AgentInfo, AgentError> {
        let method = "Check";
        let reply = self
            .unary(method, |rpc, ctx| async move {
                rpc.check(ctx, &pb::CheckRequest::new()).await
            })
            .await?;
        info_from_reply(reply).map_err(|reason| AgentError::BadReply { method, reason })
    }

    /// Asks the agent to end the VM. The agent replies, then syncs and resets the VM; a
    /// connection that breaks instead of carrying the reply (the reset won the race) also counts
    /// as done. Callers confirm by waiting for the VM to exit.
    pub async fn shutdown(&self) -> Result<(), AgentError> {
        let done = self
            .unary("Shutdown", |rpc, ctx| async move {
                rpc.shutdown(ctx, &pb::ShutdownRequest::new()).await
            })
            .await;
        match done {
            Ok(_) => Ok(()),
            Err(AgentError::Rpc {
                source:
                    e @ (ttrpc::Error::Socket(_)
                    | ttrpc::Error::LocalClosed
                    | ttrpc::Error::RemoteClosed),
                ..
            }) => {
                log::debug!("agent connection closed during Shutdown: {e}");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub async fn create_container(
        &self,
        req: pb::CreateContainerRequest,
    ) -> Result<u32, AgentError> {
        let timeout = self.call_timeout.max(BUILD_CALL_TIMEOUT);
        let method = "CreateContainer";
        let reply = self
            .call(method, timeout, |rpc, ctx| async move {
                rpc.create_container(ctx, &req).await
            })
            .await?;
        guest_pid(method, reply.pid)
    }

    pub async fn start_container(&self, container_id: &str) -> Result<u32, AgentError> {
        let req = pb::StartContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        let method = "StartContainer";
        let reply = self
            .unary(method, |rpc, ctx| async move {
                rpc.start_container(ctx, &req).await
            })
            .await?;
        guest_pid(method, reply.pid)
    }

    pub async fn exec_process(&self, req: pb::ExecProcessRequest) -> Result<(), AgentError> {
        self.unary("ExecProcess", |rpc, ctx| async move {
            rpc.exec_process(ctx, &req).await
        })
        .await
        .map(drop)
    }

    pub async fn start_exec(&self, container_id: &str, exec_id: &str) -> Result<u32, AgentError> {
        let req = pb::StartExecRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        let timeout = self.call_timeout.max(BUILD_CALL_TIMEOUT);
        let method = "StartExec";
        let reply = self
            .call(method, timeout, |rpc, ctx| async move {
                rpc.start_exec(ctx, &req).await
            })
            .await?;
        guest_pid(method, reply.pid)
    }

    pub async fn signal_process(
        &self,
        container_id: &str,
        exec_id: &str,
        signal: u32,
        all: bool,
    ) -> Result<(), AgentError> {
        let req = pb::SignalProcessRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            signal,
            all,
            ..Default::default()
        };
        self.unary("SignalProcess", |rpc, ctx| async move {
            rpc.signal_process(ctx, &req).await
        })
        .await
        .map(drop)
    }

    /// Exit status (n, or 128+signal) and exit time (Unix ns); DEADLINE_EXCEEDED while the
    /// process still runs after `timeout`.
    pub async fn wait_process(
        &self,
        container_id: &str,
        exec_id: &str,
        timeout: Duration,
    ) -> Result<(u32, u64), AgentError> {
        let req = pb::WaitProcessRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.call("WaitProcess", timeout, |rpc, ctx| async move {
            rpc.wait_process(ctx, &req).await
        })
        .await
        .map(|r| (r.exit_status, r.exited_at_unix_nanos))
    }

    pub async fn resize_pty(
        &self,
        container_id: &str,
        exec_id: &str,
        width: u32,
        height: u32,
    ) -> Result<(), AgentError> {
        let req = pb::ResizePtyRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            width,
            height,
            ..Default::default()
        };
        self.unary("ResizePty", |rpc, ctx| async move {
            rpc.resize_pty(ctx, &req).await
        })
        .await
        .map(drop)
    }

    pub async fn close_stdin(&self, container_id: &str, exec_id: &str) -> Result<(), AgentError> {
        let req = pb::CloseStdinRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.unary("CloseStdin", |rpc, ctx| async move {
            rpc.close_stdin(ctx, &req).await
        })
        .await
        .map(drop)
    }

    pub async fn remove_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = pb::RemoveContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.unary("RemoveContainer", |rpc, ctx| async move {
            rpc.remove_container(ctx, &req).await
        })
        .await
        .map(drop)
    }

    /// The guest pids of the processes in the container's cgroup.
    pub async fn list_pids(&self, container_id: &str) -> Result<Vec<u32>, AgentError> {
        let method = "ListPids";
        let req = pb::ListPidsRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        let reply = self
            .unary(
                method,
                |rpc, ctx| async move { rpc.list_pids(ctx, &req).await },
            )
            .await?;
        if reply.pids.len() > MAX_PIDS {
            return Err(AgentError::BadReply {
                method,
                reason: format!("{} pids (max {MAX_PIDS})", reply.pids.len()),
            });
        }
        reply
            .pids
            .into_iter()
            .map(|pid| guest_pid(method, pid))
            .collect()
    }

    /// The container's cgroup v2 figures ("" = the whole guest).
    pub async fn stats(&self, container_id: &str) -> Result<pb::StatsResponse, AgentError> {
        let req = pb::StatsRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.unary(
            "Stats",
            |rpc, ctx| async move { rpc.stats(ctx, &req).await },
        )
        .await
    }

    /// Applies OCI `LinuxResources` (JSON) to the container's cgroup.
    pub async fn update_container(
        &self,
        container_id: &str,
        resources_json: Vec<u8>,
    ) -> Result<(), AgentError> {
        let req = pb::UpdateContainerRequest {
            container_id: container_id.to_owned(),
            resources_json,
            ..Default::default()
        };
        self.unary("UpdateContainer", |rpc, ctx| async move {
            rpc.update_container(ctx, &req).await
        })
        .await
        .map(drop)
    }

    pub async fn pause_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = pb::PauseContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.unary("PauseContainer", |rpc, ctx| async move {
            rpc.pause_container(ctx, &req).await
        })
        .await
        .map(drop)
    }

    pub async fn resume_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = pb::ResumeContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.unary("ResumeContainer", |rpc, ctx| async move {
            rpc.resume_container(ctx, &req).await
        })
        .await
        .map(drop)
    }

    /// Long poll for the next OOM kill: the container's id, or `None` when none came within
    /// `timeout`.
    pub async fn get_oom_event(&self, timeout: Duration) -> Result<Option<String>, AgentError> {
        let method = "GetOomEvent";
        let polled = self
            .call(method, timeout, |rpc, ctx| async move {
                rpc.get_oom_event(ctx, &pb::GetOomEventRequest::new()).await
            })
            .await;
        match polled {
            Ok(reply) => {
                if !agent_protocol::stdio::valid_id(&reply.container_id) {
                    return Err(AgentError::BadReply {
                        method,
                        reason: format!("container id {:?}", agent_text(&reply.container_id)),
                    });
                }
                Ok(Some(reply.container_id))
            }
            Err(AgentError::Rpc { source, .. }) if is_timeout(&source) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes the pod's sysctls in the guest (name -> value).
    pub async fn set_sysctls(&self, sysctls: HashMap<String, String>) -> Result<(), AgentError> {
        let req = pb::SetSysctlsRequest {
            sysctls,
            ..Default::default()
        };
        self.unary("SetSysctls", |rpc, ctx| async move {
            rpc.set_sysctls(ctx, &req).await
        })
        .await
        .map(drop)
    }

    /// Gives the guest its network: lo up, and each NIC (found by MAC) the CNI interface's
    /// name, MTU, addresses and routes.
    pub async fn configure_network(
        &self,
        req: pb::ConfigureNetworkRequest,
    ) -> Result<(), AgentError> {
        self.unary("ConfigureNetwork", |rpc, ctx| async move {
            rpc.configure_network(ctx, &req).await
        })
        .await
        .map(drop)
    }

    /// Forgets an exec process that has exited (or never started).
    pub async fn remove_exec(&self, container_id: &str, exec_id: &str) -> Result<(), AgentError> {
        let req = pb::RemoveExecRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.unary("RemoveExec", |rpc, ctx| async move {
            rpc.remove_exec(ctx, &req).await
        })
        .await
        .map(drop)
    }
}

fn info_from_reply(reply: CheckResponse) -> Result<AgentInfo, String> {
    let bounded = |name: &str, value: &str, max: usize| {
        if value.len() > max {
            Err(format!("{name} is {} bytes (max {max})", value.len()))
        } else {
            Ok(())
        }
    };
    bounded("agent_version", &reply.agent_version, MAX_VERSION_LEN)?;
    bounded(
        "kernel_release",
        &reply.kernel_release,
        MAX_KERNEL_RELEASE_LEN,
    )?;
    bounded("boot_id", &reply.boot_id, MAX_BOOT_ID_LEN)?;
    if reply.online_vcpus == 0 {
        return Err("online_vcpus is 0".into());
    }
    Ok(AgentInfo {
        agent_version: reply.agent_version,
        kernel_release: reply.kernel_release,
        online_vcpus: reply.online_vcpus,
        mem_total_kib: reply.mem_total_kib,
        boot_id: reply.boot_id,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::sync::Arc;
    use std::thread::JoinHandle;

    use agent_protocol::agent::{CheckRequest, ShutdownRequest, ShutdownResponse};
    use agent_protocol::agent_ttrpc::{self, Agent};

    use super::*;
    use crate::agent::connection::tests::{vmm, TempDir};

    /// A test peer of the client's ttrpc layer, answering with given values.
    struct Peer(CheckResponse);

    impl Agent for Peer {
        fn check(
            &self,
            _ctx: &ttrpc::TtrpcContext,
            _req: CheckRequest,
        ) -> ttrpc::Result<CheckResponse> {
            Ok(self.0.clone())
        }
        fn shutdown(
            &self,
            _ctx: &ttrpc::TtrpcContext,
            _req: ShutdownRequest,
        ) -> ttrpc::Result<ShutdownResponse> {
            Ok(ShutdownResponse::new())
        }
        fn wait_process(
            &self,
            _ctx: &ttrpc::TtrpcContext,
            _req: pb::WaitProcessRequest,
        ) -> ttrpc::Result<pb::WaitProcessResponse> {
            // A process that never exits: the caller's deadline must end the call.
            std::thread::sleep(Duration::from_secs(5));
            Ok(pb::WaitProcessResponse::new())
        }
    }

    /// The VMM side for the ttrpc tests: closes the first connection (agent not up yet), then
    /// answers OK and relays the connection's bytes to a ttrpc server on a second Unix socket,
    /// as a vsock device relays them to the guest.
    fn serve_after_one_refusal(dir: &TempDir, reply: CheckResponse) -> JoinHandle<()> {
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let agent_sock = dir.0.join("agent.sock");
        let address = format!("unix://{}", agent_sock.display());
        let mut server = ttrpc::Server::new()
            .bind(&address)
            .expect("bind agent")
            .register_service(agent_ttrpc::create_agent(Arc::new(Peer(reply))));
        server.start().expect("start agent");
        std::thread::spawn(move || {
            let vmm = vmm(listener, vec![None, Some(b"OK 7\n")]);
            let guest_side = vmm.join().expect("vmm");
            // Relay between the host's stream and the agent's socket, like a vsock device.
            let agent = UnixStream::connect(&agent_sock).expect("connect agent");
            let (mut a_in, mut a_out) = (agent.try_clone().expect("clone"), agent);
            let (mut g_in, mut g_out) = (guest_side.try_clone().expect("clone"), guest_side);
            let up = std::thread::spawn(move || std::io::copy(&mut g_in, &mut a_out));
            let _ = std::io::copy(&mut a_in, &mut g_out);
            let _ = up.join();
            server.shutdown();
        })
    }

    fn sample() -> CheckResponse {
        CheckResponse {
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0-microvm".into(),
            online_vcpus: 2,
            mem_total_kib: 250_000,
            boot_id: "0b5f5c3e-1d2a-4c39-9a0e-6f1d2e3c4b5a".into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn check_and_shutdown_through_handshake_and_ttrpc() {
        let dir = TempDir::new("rpc");
        let _vmm = serve_after_one_refusal(&dir, sample());
        let client = AgentClient::connect(&dir.sock(), 1024, Duration::from_secs(10))
            .await
            .expect("connect after a refusal");
        let info = client.check().await.expect("check");
        assert_eq!(
            info,
            AgentInfo {
                agent_version: "0.1.0".into(),
                kernel_release: "6.1.0-microvm".into(),
                online_vcpus: 2,
                mem_total_kib: 250_000,
                boot_id: "0b5f5c3e-1d2a-4c39-9a0e-6f1d2e3c4b5a".into(),
            }
        );
        // A long poll that does not end in time is a timeout, and other calls go on meanwhile.
        let waiter = client.clone();
        let started = std::time::Instant::now();
        let (waited, checked) = tokio::join!(
            waiter.wait_process("c1", "", Duration::from_millis(300)),
            client.check()
        );
        let err = waited.expect_err("the process never exits");
        assert!(err.is_timeout(), "{err}");
        assert!(started.elapsed() < Duration::from_secs(3));
        checked.expect("check during a long poll");
        client.shutdown().await.expect("shutdown");
    }

    #[tokio::test]
    async fn oversized_reply_fields_are_errors() {
        let dir = TempDir::new("huge");
        let mut reply = sample();
        reply.kernel_release = "x".repeat(100_000);
        let _vmm = serve_after_one_refusal(&dir, reply);
        let client = AgentClient::connect(&dir.sock(), 1024, Duration::from_secs(10))
            .await
            .expect("connect");
        let err = client.check().await.expect_err("too long");
        assert!(
            matches!(
                err,
                AgentError::BadReply {
                    method: "Check",
                    ..
                }
            ),
            "{err}"
        );
    }
}
