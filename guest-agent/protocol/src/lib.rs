//! The shim <-> guest agent API: protobuf messages and the ttrpc `Agent` service, generated at
//! build time from `agent.proto` (package `microvm.agent.v1`).
//!
//! - [`agent`]: the messages (`CheckRequest`, `CheckResponse`, `ShutdownRequest`, ...).
//! - [`agent_ttrpc`]: the service: the `Agent` server trait with `create_agent`, and the
//!   synchronous `AgentClient`.
//! - `agent_ttrpc_async` (feature `async`): the same service's async client, on tokio.

include!(concat!(env!("OUT_DIR"), "/mod.rs"));

/// The vsock port the agent listens on inside the guest.
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// The vsock port of the agent's stdio streams (see [`stdio`]).
pub const AGENT_STDIO_PORT: u32 = 1025;

/// The host vsock port (CID 2) the agent connects to once its server is up, to say so: the
/// agent writes its ready line there and closes. Under hybrid vsock (our VMM and
/// vhost-device-vsock alike) the guest's connection reaches the host's Unix socket
/// `<uds_path>_1026`, where the shim waits: readiness is an event, no knocking on a booting
/// guest.
pub const AGENT_READY_PORT: u32 = 1026;

/// The vsock port of the agent's port-forward streams (see [`forward`]): one connection per
/// TCP connection containerd's PortForward makes to the pod's loopback on the host.
pub const AGENT_FORWARD_PORT: u32 = 1027;

/// What the agent's ready line starts with (on the console and on [`AGENT_READY_PORT`]).
pub const AGENT_READY_PREFIX: &str = "microvm-agent: ready";

/// The virtio-fs tag under which the host exports the pod's shared directory (container rootfs
/// and bind-mount sources).
pub const SHARED_FS_TAG: &str = "microvm-shared";

/// Where the agent mounts the pod's shared directory inside the guest. A container's rootfs is
/// `<GUEST_SHARED_DIR>/<container id>/rootfs`.
pub const GUEST_SHARED_DIR: &str = "/run/microvm-shared";

/// The namespace path, in a container's spec, that means "the pod's shared PID namespace": the
/// shim writes it for the sandbox's `/proc/<pid>/ns/pid`, the agent resolves it to its pod PID
/// namespace.
pub const POD_PID_NAMESPACE: &str = "pod:pid";

/// A mount option the shim adds to a container's bind mount with mount propagation
/// (`rslave`/`rshared`: HostToContainer, Bidirectional), followed by a key that names the host
/// volume (a hash of its host source and read-only flag). The agent makes one shared mount per
/// key in the guest and binds every container's mount of that volume from it, so mounts a
/// container makes under a Bidirectional volume reach the pod's other containers of the same
/// volume, as they would through the host with runc. The agent removes the option before
/// libcontainer sees the spec.
pub const VOLUME_KEY_OPTION: &str = "x-microvm-volume=";

/// The annotation the shim sets (to `true`) on the spec of a privileged container (every device
/// allowed, every capability: containerd's `securityContext.privileged`), and removes from every
/// other spec. The agent gives such a container every device of the guest, as runc gives a
/// privileged container every device of the host.
pub const PRIVILEGED_ANNOTATION: &str = "microvm.io/privileged";

pub mod forward;
pub mod stdio;

/// Longest hostname Linux accepts (HOST_NAME_MAX).
pub const HOST_NAME_MAX: usize = 64;

/// Whether `name` is a hostname the guest takes from `microvm.hostname=` on its kernel command
/// line: 1 to [`HOST_NAME_MAX`] bytes of ASCII letters, digits, `-` and `.` (so it can never
/// add a word or an option to the command line). The shim checks before passing one; the agent
/// checks what it reads.
pub fn is_valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= HOST_NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::agent::{CheckResponse, ShutdownResponse};
    use protobuf::Message;

    #[test]
    fn check_response_round_trips() {
        let resp = CheckResponse {
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0".into(),
            online_vcpus: 2,
            mem_total_kib: 262_144,
            boot_id: "f3a8c0de-0000-4000-8000-000000000000".into(),
            ..Default::default()
        };
        let bytes = resp.write_to_bytes().expect("encode");
        let back = CheckResponse::parse_from_bytes(&bytes).expect("decode");
        assert_eq!(back, resp);
    }

    #[test]
    fn service_methods_have_the_package_paths() {
        let methods = super::agent_ttrpc::create_agent(std::sync::Arc::new(Unimplemented));
        let mut paths: Vec<&str> = methods.keys().map(String::as_str).collect();
        paths.sort_unstable();
        assert_eq!(
            paths,
            [
                "/microvm.agent.v1.Agent/Check",
                "/microvm.agent.v1.Agent/CloseStdin",
                "/microvm.agent.v1.Agent/ConfigureNetwork",
                "/microvm.agent.v1.Agent/CreateContainer",
                "/microvm.agent.v1.Agent/ExecProcess",
                "/microvm.agent.v1.Agent/GetOomEvent",
                "/microvm.agent.v1.Agent/ListPids",
                "/microvm.agent.v1.Agent/PauseContainer",
                "/microvm.agent.v1.Agent/RemoveContainer",
                "/microvm.agent.v1.Agent/RemoveExec",
                "/microvm.agent.v1.Agent/ResizePty",
                "/microvm.agent.v1.Agent/ResumeContainer",
                "/microvm.agent.v1.Agent/SetSysctls",
                "/microvm.agent.v1.Agent/Shutdown",
                "/microvm.agent.v1.Agent/SignalProcess",
                "/microvm.agent.v1.Agent/StartContainer",
                "/microvm.agent.v1.Agent/StartExec",
                "/microvm.agent.v1.Agent/Stats",
                "/microvm.agent.v1.Agent/UpdateContainer",
                "/microvm.agent.v1.Agent/WaitProcess",
            ]
        );
        assert_eq!(ShutdownResponse::new().compute_size(), 0);
    }

    struct Unimplemented;
    impl super::agent_ttrpc::Agent for Unimplemented {}
}
