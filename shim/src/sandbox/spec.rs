//! The one place that knows both the OCI spec and the VM: the VM's size from the pod's
//! annotations ([`vm_size`]), what a pod may not ask of a VM ([`refuse_host_namespaces`]), its
//! sysctls, and an app container's spec rewritten for the guest.
//!
//! Rewriting an app container's OCI spec ([`Spec`], typed once by [`crate::oci::read_spec`])
//! from host paths to guest paths, before it goes to the agent's CreateContainer (serialized as
//! JSON, which the agent types with the same `oci-spec` crate).
//!
//! The pod's shared directory (`<state>/shared` on the host) is the guest's
//! [`GUEST_SHARED_DIR`], exported under [`SHARED_FS_TAG`]. A container's rootfs is mounted on the
//! host at `shared/<cid>/rootfs`; each bind mount's host source (volumes, /etc/hosts,
//! /etc/resolv.conf, /etc/hostname, /dev/shm, termination-log) is bind-mounted at
//! `shared/<cid>/mounts/<n>`. Then in the spec:
//!
//! - `root.path` becomes the guest path of the rootfs;
//! - each bind mount's `source` becomes the guest path of its share;
//! - namespaces with a host path (`/proc/<pause-pid>/ns/*`): `network`, `ipc` and `uts` entries
//!   are dropped (the container joins the VM's, which are the pod's); the sandbox's `pid` becomes
//!   [`POD_PID_NAMESPACE`] (the agent's pod PID namespace); others lose the path (new
//!   namespace);
//! - `linux.cgroupsPath` and `hooks` are removed (host cgroups and host binaries mean nothing in
//!   the guest; the agent picks the cgroup);
//! - a privileged container ([`crate::resources::devices::oci::is_privileged`]) gets
//!   [`PRIVILEGED_ANNOTATION`], which no other spec keeps: the agent then gives it the guest's
//!   devices (its host devices were left out before, `resources::devices`);
//! - a bind mount with propagation (`rslave`/`rshared`) gets [`VOLUME_KEY_OPTION`] with the key
//!   of its host volume ([`volume_key`]), and its source is the pod's one share of that volume,
//!   `.volumes/<key>` ([`storage::volume_relative`]), not a folder of the container's: the agent
//!   binds every container's mount of one volume from one shared mount of it in the guest, so
//!   what a privileged container mounts under a Bidirectional volume reaches the pod's other
//!   containers of that volume, and stays for them when that container is removed (mounts on
//!   the dentries of a removed container's folder go with it in the guest).

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use oci_spec::runtime::{LinuxNamespace, LinuxNamespaceType, Mount, Root};

use crate::oci::Spec;

use crate::config::Config;
use crate::resources::cgroup::overhead::{self, Amounts};

use crate::resources::storage::{self, ShareBind};
pub use agent_protocol::{
    GUEST_SHARED_DIR, POD_PID_NAMESPACE, PRIVILEGED_ANNOTATION, SHARED_FS_TAG, VOLUME_KEY_OPTION,
};

/// Why a spec cannot be rewritten.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("OCI spec: {0}")]
    Invalid(String),
}

/// The key of a host volume shared with propagation: the same for every container of the pod
/// that mounts `host_source` with the same `readonly` (their shares then come from one host
/// bind mount's view), different otherwise; a hash, so that no host path reaches the guest.
pub fn volume_key(host_source: &std::path::Path, readonly: bool) -> String {
    use sha2::{Digest, Sha256};
    use std::os::unix::ffi::OsStrExt;
    let mut h = Sha256::new();
    h.update(host_source.as_os_str().as_bytes());
    h.update([0, u8::from(readonly)]);
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The guest path of container `cid`'s rootfs.
pub fn guest_rootfs(cid: &str) -> String {
    format!("{GUEST_SHARED_DIR}/{cid}/rootfs")
}

/// Rewrites `spec` for the guest; returns the host paths to share first. `sandbox_pid` is the
/// pid the shim gave containerd for the pod's sandbox: a PID namespace path of
/// `/proc/<sandbox_pid>/ns/pid` means the pod shares one PID namespace
/// (`shareProcessNamespace`), which becomes the guest's pod PID namespace.
pub fn rewrite_for_guest(
    spec: &mut Spec,
    cid: &str,
    sandbox_pid: u32,
) -> Result<Vec<ShareBind>, SpecError> {
    if cid.is_empty() || cid.contains('/') || cid == "." || cid == ".." {
        return Err(SpecError::Invalid(format!("container id {cid:?}")));
    }
    let privileged = crate::resources::devices::oci::is_privileged(spec);
    match spec.annotations_mut() {
        Some(a) => {
            a.remove(PRIVILEGED_ANNOTATION);
            if privileged {
                a.insert(PRIVILEGED_ANNOTATION.into(), "true".into());
            }
        }
        None if privileged => {
            spec.set_annotations(Some(HashMap::from([(
                PRIVILEGED_ANNOTATION.to_string(),
                "true".to_string(),
            )])));
        }
        None => {}
    }
    let readonly = spec.root().as_ref().and_then(Root::readonly);
    let mut root = Root::default();
    root.set_path(PathBuf::from(guest_rootfs(cid)));
    root.set_readonly(readonly);
    spec.set_root(Some(root));
    spec.set_hooks(None);

    let mut binds = Vec::new();
    for (n, m) in spec.mounts_mut().iter_mut().flatten().enumerate() {
        if let Some(bind) = rewrite_mount(m, cid, n)? {
            binds.push(bind);
        }
    }

    if let Some(linux) = spec.linux_mut() {
        linux.set_cgroups_path(None);
        if let Some(nss) = linux.namespaces_mut() {
            nss.retain_mut(|ns| guest_namespace(ns, sandbox_pid));
        }
    }
    Ok(binds)
}

/// Mount `n` of container `cid` for the guest: only the shim's volume keys in its options; a
/// bind's source becomes the guest path of its share (the container's own, or the pod's of a
/// volume with propagation), which is returned.
fn rewrite_mount(m: &mut Mount, cid: &str, n: usize) -> Result<Option<ShareBind>, SpecError> {
    let options: Vec<String> = m.options().clone().unwrap_or_default();
    // Only the shim names volumes for the agent.
    if options.iter().any(|o| o.starts_with(VOLUME_KEY_OPTION)) {
        let kept = options
            .iter()
            .filter(|o| !o.starts_with(VOLUME_KEY_OPTION))
            .cloned()
            .collect();
        m.set_options(Some(kept));
    }
    let is_bind =
        m.typ().as_deref() == Some("bind") || options.iter().any(|o| o == "bind" || o == "rbind");
    if !is_bind {
        return Ok(None);
    }
    let Some(source) = m.source().clone() else {
        return Err(SpecError::Invalid(format!("bind mount {n} has no source")));
    };
    if !source.is_absolute() {
        return Err(SpecError::Invalid(format!(
            "bind mount source {source:?} is not absolute"
        )));
    }
    let readonly = options.iter().any(|o| o == "ro");
    let from_host = options
        .iter()
        .any(|o| matches!(o.as_str(), "rslave" | "slave" | "rshared" | "shared"));
    let relative = if from_host {
        let key = volume_key(&source, readonly);
        let relative = storage::volume_relative(&key);
        if let Some(o) = m.options_mut() {
            o.push(format!("{VOLUME_KEY_OPTION}{key}"));
        }
        relative
    } else {
        PathBuf::from(cid).join("mounts").join(n.to_string())
    };
    let bind = ShareBind {
        host_source: source,
        relative: relative.clone(),
        readonly,
        from_host,
    };
    m.set_source(Some(PathBuf::from(format!(
        "{GUEST_SHARED_DIR}/{}",
        relative.display()
    ))));
    Ok(Some(bind))
}

/// Namespace `ns` for the guest (module doc); `false`: it leaves the spec.
fn guest_namespace(ns: &mut LinuxNamespace, sandbox_pid: u32) -> bool {
    let host_path = ns.path().as_ref().is_some_and(|p| {
        !p.as_os_str().is_empty() && !p.as_os_str().as_bytes().starts_with(b"container:")
    });
    if !host_path {
        return true;
    }
    let kind = ns.typ();
    if matches!(
        kind,
        LinuxNamespaceType::Network | LinuxNamespaceType::Ipc | LinuxNamespaceType::Uts
    ) {
        return false;
    }
    let pod_pid_ns = PathBuf::from(format!("/proc/{sandbox_pid}/ns/pid"));
    if kind == LinuxNamespaceType::Pid && ns.path().as_ref() == Some(&pod_pid_ns) {
        ns.set_path(Some(PathBuf::from(POD_PID_NAMESPACE)));
        return true;
    }
    ns.set_path(None);
    true
}

/// Kubernetes' TARGET PID namespace mode (`kubectl debug --target`, ephemeral containers):
/// containerd names the target container's `/proc/<its task pid>/ns/pid`, and the task pid it
/// knows is the guest pid the agent reported. `targets` maps the pod's app containers' init pids
/// to their ids: such a path becomes `container:<id>`, which the agent resolves to the target's
/// namespace in the guest. Run before [`rewrite_for_guest`], which keeps `container:` paths.
pub fn resolve_target_pid_namespace(spec: &mut Spec, targets: &HashMap<u32, String>) {
    let Some(nss) = spec
        .linux_mut()
        .as_mut()
        .and_then(|l| l.namespaces_mut().as_mut())
    else {
        return;
    };
    for ns in nss {
        if ns.typ() != LinuxNamespaceType::Pid {
            continue;
        }
        let target = ns
            .path()
            .as_ref()
            .and_then(|p| p.to_str())
            .and_then(|p| {
                p.strip_prefix("/proc/")?
                    .strip_suffix("/ns/pid")?
                    .parse::<u32>()
                    .ok()
            })
            .and_then(|pid| targets.get(&pid));
        if let Some(id) = target {
            ns.set_path(Some(PathBuf::from(format!("container:{id}"))));
        }
    }
}

/// The pod's sysctls: the sandbox spec's `linux.sysctl` (containerd puts Kubernetes'
/// `securityContext.sysctls` there only), name -> value. (A value that is not a string is
/// refused with the whole spec: [`crate::oci::read_spec`].)
pub fn pod_sysctls(sandbox_spec: &Spec) -> HashMap<String, String> {
    sandbox_spec
        .linux()
        .as_ref()
        .and_then(|l| l.sysctl().clone())
        .unwrap_or_default()
}

/// A host namespace a pod's sandbox spec asks to share, which a pod in its own VM cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostNamespace {
    Network,
    Ipc,
    Pid,
}

impl HostNamespace {
    /// The OCI `linux.namespaces` type.
    fn oci_type(self) -> LinuxNamespaceType {
        match self {
            Self::Network => LinuxNamespaceType::Network,
            Self::Ipc => LinuxNamespaceType::Ipc,
            Self::Pid => LinuxNamespaceType::Pid,
        }
    }

    /// The Kubernetes pod field that asks for it.
    pub fn pod_field(self) -> &'static str {
        match self {
            Self::Network => "hostNetwork",
            Self::Ipc => "hostIPC",
            Self::Pid => "hostPID",
        }
    }

    /// The namespace's name in prose.
    pub fn name(self) -> &'static str {
        match self {
            Self::Network => "network",
            Self::Ipc => "IPC",
            Self::Pid => "PID",
        }
    }
}

/// The host namespaces a pod's sandbox spec asks for. containerd (1.6 and later) writes a
/// `network`, `ipc` or `pid` entry in the sandbox's `linux.namespaces` for each namespace of the
/// pod's own, and leaves it out for `hostNetwork`, `hostIPC` and `hostPID` (NamespaceMode
/// NODE): the pause process then runs in the host's. A spec without `linux.namespaces` asks
/// for all three.
pub fn host_namespaces(sandbox_spec: &Spec) -> Vec<HostNamespace> {
    let present: Vec<LinuxNamespaceType> = sandbox_spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .map(|nss| nss.iter().map(LinuxNamespace::typ).collect())
        .unwrap_or_default();
    [
        HostNamespace::Network,
        HostNamespace::Ipc,
        HostNamespace::Pid,
    ]
    .into_iter()
    .filter(|ns| !present.contains(&ns.oci_type()))
    .collect()
}

/// The refusal of a pod that asks for host namespaces, naming them; `None` if it asks for none.
pub fn refuse_host_namespaces(sandbox_spec: &Spec) -> Option<String> {
    let host = host_namespaces(sandbox_spec);
    if host.is_empty() {
        return None;
    }
    let join = |parts: Vec<&str>| match parts.as_slice() {
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
        [] => String::new(),
    };
    let names = join(host.iter().map(|ns| ns.name()).collect());
    let fields = join(host.iter().map(|ns| ns.pod_field()).collect());
    let plural = if host.len() > 1 { "s" } else { "" };
    Some(format!(
        "the pod asks for the host's {names} namespace{plural} ({fields}): the microvm runtime \
         handler runs every pod in its own kernel (a VM) and cannot share the host's {names} \
         namespace{plural}; run this pod with another runtime handler (e.g. runc)"
    ))
}

/// Annotation: the pod's summed CPU quota (microseconds per period).
pub const ANN_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
/// Annotation: the CPU period the quota is measured in (microseconds).
pub const ANN_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";
/// Annotation: the pod's summed memory limit in bytes.
pub const ANN_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";

/// The size of a pod's VM from its sandbox annotations: vCPUs from
/// `io.kubernetes.cri.sandbox-cpu-quota` / `-cpu-period` (rounded up, capped at `max_vcpus`),
/// memory from `io.kubernetes.cri.sandbox-memory` plus the guest's own base (capped at
/// `max_memory_mib`); the config's defaults where the pod sets no limits.
pub fn vm_size(config: &Config, annotations: &HashMap<String, String>) -> Result<VmSize, String> {
    let num = |key: &str| -> Result<Option<i64>, String> {
        annotations
            .get(key)
            .map(|v| {
                v.trim()
                    .parse::<i64>()
                    .map_err(|_| format!("annotation {key}={v:?} is not a number"))
            })
            .transpose()
    };
    let vcpus = match (num(ANN_CPU_QUOTA)?, num(ANN_CPU_PERIOD)?) {
        (Some(quota), Some(period)) if quota > 0 && period > 0 => {
            // ceil(quota / period): a pod limited to 1.5 CPUs gets 2 vCPUs.
            let n = quota.saturating_add(period - 1) / period;
            u8::try_from(n.min(i64::from(config.max_vcpus))).unwrap_or(config.max_vcpus)
        }
        _ => config.default_vcpus,
    };
    let memory_mib = match num(ANN_MEMORY)? {
        Some(bytes) if bytes > 0 => {
            let mib = (bytes as u64).div_ceil(1 << 20);
            mib.saturating_add(config.guest_base_memory_mib)
                .min(config.max_memory_mib)
        }
        _ => config.default_memory_mib,
    };
    Ok(VmSize { vcpus, memory_mib })
}

/// The containers' summed limits from the sandbox annotations (what kubelet sized the pod
/// cgroup to, minus the RuntimeClass overhead): memory in bytes, CPU in millicores; `None` where
/// the pod sets no limit or an annotation does not parse (the overhead then comes from
/// elsewhere, `resources::cgroup::overhead`).
pub fn containers_sum(annotations: &HashMap<String, String>) -> Amounts {
    let num = |key: &str| annotations.get(key)?.trim().parse::<i64>().ok();
    let memory_bytes = num(ANN_MEMORY)
        .and_then(|b| u64::try_from(b).ok())
        .filter(|b| *b > 0);
    let cpu_millis = match (num(ANN_CPU_QUOTA), num(ANN_CPU_PERIOD)) {
        (Some(quota), Some(period)) => {
            overhead::quota_millis(quota, u64::try_from(period).unwrap_or(0))
        }
        _ => None,
    };
    Amounts {
        memory_bytes,
        cpu_millis,
    }
}

/// How big a pod's VM is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmSize {
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory in MiB.
    pub memory_mib: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::parse_spec;
    use crate::oci::test_json::{json as untyped, spec as typed};
    use serde_json::{json, Value};
    use std::path::Path;

    use testkit::string_map as ann;

    #[test]
    fn containers_sum_from_annotations() {
        let a = ann(&[
            (ANN_MEMORY, "268435456"),
            (ANN_CPU_QUOTA, "150000"),
            (ANN_CPU_PERIOD, "100000"),
        ]);
        let s = containers_sum(&a);
        assert_eq!(s.memory_bytes, Some(256 << 20));
        assert_eq!(s.cpu_millis, Some(1500));
        assert_eq!(containers_sum(&HashMap::new()), Amounts::default());
        let a = ann(&[
            (ANN_MEMORY, "0"),
            (ANN_CPU_QUOTA, "-1"),
            (ANN_CPU_PERIOD, "100000"),
        ]);
        assert_eq!(containers_sum(&a), Amounts::default());
    }

    #[test]
    fn sizes_vm_from_annotations() {
        let c = Config::default();
        let vm_size = |a: &HashMap<String, String>| vm_size(&c, a);
        assert_eq!(
            vm_size(&HashMap::new()).unwrap(),
            VmSize {
                vcpus: 1,
                memory_mib: 256
            }
        );
        let s = vm_size(&ann(&[
            (ANN_CPU_QUOTA, "150000"),
            (ANN_CPU_PERIOD, "100000"),
            (ANN_MEMORY, "268435456"),
        ]))
        .unwrap();
        assert_eq!(
            s,
            VmSize {
                vcpus: 2,
                memory_mib: 256 + 128
            }
        );
        // Unlimited (quota -1, memory 0) means the defaults.
        let s = vm_size(&ann(&[
            (ANN_CPU_QUOTA, "-1"),
            (ANN_CPU_PERIOD, "100000"),
            (ANN_MEMORY, "0"),
        ]))
        .unwrap();
        assert_eq!(s.vcpus, 1);
        assert_eq!(s.memory_mib, 256);
        // Capped at the maxima.
        let s = vm_size(&ann(&[
            (ANN_CPU_QUOTA, "100000000"),
            (ANN_CPU_PERIOD, "1000"),
            (ANN_MEMORY, "9223372036854775807"),
        ]))
        .unwrap();
        assert_eq!(s.vcpus, 16);
        assert_eq!(s.memory_mib, 64 * 1024);
        let e = vm_size(&ann(&[(ANN_MEMORY, "lots")])).unwrap_err();
        assert!(e.contains(ANN_MEMORY), "{e}");
    }

    #[test]
    fn a_target_pid_namespace_becomes_the_target_container_in_the_guest() {
        let targets: std::collections::HashMap<u32, String> = [(7, "c0".to_string())].into();
        let mut spec = typed(json!({"linux": {"namespaces": [
            {"type": "pid", "path": "/proc/7/ns/pid"}, {"type": "ipc", "path": "/proc/7/ns/ipc"}
        ]}}));
        resolve_target_pid_namespace(&mut spec, &targets);
        rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let spec = untyped(&spec);
        assert_eq!(
            spec["linux"]["namespaces"],
            json!([{"type": "pid", "path": "container:c0"}])
        );
        // An unknown pid is not a target: a new PID namespace, as before.
        let mut spec =
            typed(json!({"linux": {"namespaces": [{"type": "pid", "path": "/proc/8/ns/pid"}]}}));
        resolve_target_pid_namespace(&mut spec, &targets);
        rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let spec = untyped(&spec);
        assert_eq!(spec["linux"]["namespaces"], json!([{"type": "pid"}]));
    }

    #[test]
    fn pod_sysctls_come_from_the_sandbox_spec() {
        let spec = typed(json!({"linux": {"sysctl": {"kernel.shm_rmid_forced": "1"}}}));
        let got = pod_sysctls(&spec);
        assert_eq!(got.len(), 1);
        assert_eq!(got["kernel.shm_rmid_forced"], "1");
        assert!(pod_sysctls(&typed(json!({"linux": {}}))).is_empty());
        // What is not a map of strings is refused with the whole spec (crate::oci::read_spec).
        assert!(parse_spec(br#"{"linux": {"sysctl": {"a": 1}}}"#).is_err());
        assert!(parse_spec(br#"{"linux": {"sysctl": []}}"#).is_err());
    }

    #[test]
    fn host_namespaces_are_those_the_sandbox_spec_leaves_out() {
        let own = typed(json!({"linux": {"namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
            {"type": "network", "path": "/var/run/netns/cni-1"}
        ]}}));
        assert!(host_namespaces(&own).is_empty());
        assert_eq!(refuse_host_namespaces(&own), None);
        let host_net = typed(json!({"linux": {"namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}
        ]}}));
        assert_eq!(host_namespaces(&host_net), vec![HostNamespace::Network]);
        let msg = refuse_host_namespaces(&host_net).unwrap();
        assert!(
            msg.contains("host's network namespace (hostNetwork)"),
            "{msg}"
        );
        assert!(msg.contains("own kernel"), "{msg}");
        let all = typed(json!({"linux": {"namespaces": [{"type": "uts"}, {"type": "mount"}]}}));
        assert_eq!(
            host_namespaces(&all),
            vec![
                HostNamespace::Network,
                HostNamespace::Ipc,
                HostNamespace::Pid
            ]
        );
        let msg = refuse_host_namespaces(&all).unwrap();
        assert!(
            msg.contains("network, IPC and PID namespaces (hostNetwork, hostIPC and hostPID)"),
            "{msg}"
        );
        assert_eq!(host_namespaces(&typed(json!({}))).len(), 3);
    }

    fn cri_app_spec() -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {"user": {"uid": 0, "gid": 0}, "args": ["sh"], "cwd": "/"},
            "root": {"path": "rootfs", "readonly": false},
            "hooks": {"createRuntime": [{"path": "/usr/bin/nvidia-hook"}]},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/etc/hosts", "type": "bind",
                 "source": "/var/lib/containerd/sandboxes/s1/hosts", "options": ["rbind", "rprivate", "rw"]},
                {"destination": "/dev/shm", "type": "bind",
                 "source": "/run/containerd/sandboxes/s1/shm", "options": ["rbind", "ro"]},
                {"destination": "/data", "source": "/srv/vol", "options": ["bind"]}
            ],
            "linux": {
                "cgroupsPath": "/kubepods/pod1/c1",
                "namespaces": [
                    {"type": "pid"},
                    {"type": "ipc", "path": "/proc/42/ns/ipc"},
                    {"type": "uts", "path": "/proc/42/ns/uts"},
                    {"type": "mount"},
                    {"type": "network", "path": "/proc/42/ns/net"},
                    {"type": "cgroup", "path": "/proc/42/ns/cgroup"},
                    {"type": "user", "path": "container:c0"}
                ]
            },
            "annotations": {"io.kubernetes.cri.sandbox-id": "s1"}
        })
    }

    #[test]
    fn the_sandboxs_pid_namespace_becomes_the_pods_in_the_guest() {
        let mut spec =
            typed(json!({"linux": {"namespaces": [{"type": "pid", "path": "/proc/42/ns/pid"}]}}));
        rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let spec = untyped(&spec);
        assert_eq!(
            spec["linux"]["namespaces"],
            json!([{"type": "pid", "path": POD_PID_NAMESPACE}])
        );
        // another process's namespace (a target container's pid on the host) is not the pod's
        let mut spec =
            typed(json!({"linux": {"namespaces": [{"type": "pid", "path": "/proc/7/ns/pid"}]}}));
        rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let spec = untyped(&spec);
        assert_eq!(spec["linux"]["namespaces"], json!([{"type": "pid"}]));
    }

    #[test]
    fn rewrites_root_mounts_namespaces_and_drops_host_bits() {
        let mut spec = typed(cri_app_spec());
        let binds = rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let spec = untyped(&spec);
        assert_eq!(spec["root"]["path"], "/run/microvm-shared/c1/rootfs");
        assert_eq!(spec["root"]["readonly"], false);
        assert!(spec.get("hooks").is_none());
        assert!(spec["linux"].get("cgroupsPath").is_none());
        assert_eq!(
            spec["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "mount"}, {"type": "cgroup"},
                   {"type": "user", "path": "container:c0"}])
        );
        assert_eq!(spec["mounts"][0]["source"], "proc");
        assert_eq!(
            spec["mounts"][1]["source"],
            "/run/microvm-shared/c1/mounts/1"
        );
        assert_eq!(
            spec["mounts"][3]["source"],
            "/run/microvm-shared/c1/mounts/3"
        );
        assert_eq!(
            binds,
            vec![
                ShareBind {
                    host_source: "/var/lib/containerd/sandboxes/s1/hosts".into(),
                    relative: "c1/mounts/1".into(),
                    readonly: false,
                    from_host: false
                },
                ShareBind {
                    host_source: "/run/containerd/sandboxes/s1/shm".into(),
                    relative: "c1/mounts/2".into(),
                    readonly: true,
                    from_host: false
                },
                ShareBind {
                    host_source: "/srv/vol".into(),
                    relative: "c1/mounts/3".into(),
                    readonly: false,
                    from_host: false
                },
            ]
        );
        // Untouched parts stay.
        assert_eq!(spec["process"]["args"], json!(["sh"]));
        assert_eq!(spec["annotations"]["io.kubernetes.cri.sandbox-id"], "s1");
    }

    /// What the agent gets: containerd's spec of an app container (1.7's, the seccomp profile
    /// shortened) rewritten on the host, serialized, typed again by `oci-spec` as the agent
    /// types it: the rewritten root, mounts and namespaces, and all else as containerd wrote it.
    #[test]
    fn the_agent_types_the_rewritten_spec_with_all_containerd_wrote() {
        let text = include_bytes!("testdata/containerd-app-spec.json");
        let original: Value = serde_json::from_slice(text).unwrap();
        let mut spec = parse_spec(text).unwrap();
        let binds = rewrite_for_guest(&mut spec, "c1", 42).unwrap();
        let wire = serde_json::to_vec(&spec).unwrap();
        let agent: Spec = serde_json::from_slice(&wire).unwrap();
        assert_eq!(agent, spec);
        let got = untyped(&agent);
        // Rewritten.
        assert_eq!(
            got["root"],
            json!({"path": "/run/microvm-shared/c1/rootfs"})
        );
        assert!(got.get("hooks").is_none());
        assert!(got["linux"].get("cgroupsPath").is_none());
        assert_eq!(
            got["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "mount"}, {"type": "cgroup"}])
        );
        let mounts = got["mounts"].as_array().unwrap();
        let before = original["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), before.len());
        assert_eq!(binds.len(), 7);
        for (n, (m, b)) in mounts.iter().zip(before).enumerate() {
            assert_eq!(m["destination"], b["destination"]);
            if b["type"] != "bind" {
                assert_eq!(m, b);
                continue;
            }
            let mut options = b["options"].as_array().unwrap().clone();
            if options.contains(&json!("rshared")) {
                let key = volume_key(Path::new(b["source"].as_str().unwrap()), false);
                options.push(json!(format!("{VOLUME_KEY_OPTION}{key}")));
                assert_eq!(
                    m["source"].as_str().unwrap(),
                    format!("/run/microvm-shared/.volumes/{key}")
                );
            } else {
                assert_eq!(
                    m["source"].as_str().unwrap(),
                    format!("/run/microvm-shared/c1/mounts/{n}")
                );
            }
            assert_eq!(m["options"], Value::Array(options), "{m}");
        }
        // As containerd wrote it (capabilities are sets: their order is not kept).
        let sorted_caps = |mut v: Value| {
            for set in v["capabilities"].as_object_mut().unwrap().values_mut() {
                set.as_array_mut().unwrap().sort_by_key(|c| c.to_string());
            }
            v
        };
        assert_eq!(
            sorted_caps(got["process"].clone()),
            sorted_caps(original["process"].clone())
        );
        for pointer in [
            "/ociVersion",
            "/hostname",
            "/annotations",
            "/linux/resources",
            "/linux/devices",
            "/linux/sysctl",
            "/linux/seccomp",
            "/linux/maskedPaths",
            "/linux/readonlyPaths",
            "/linux/mountLabel",
        ] {
            assert_eq!(got.pointer(pointer), original.pointer(pointer), "{pointer}");
        }
    }

    #[test]
    fn only_a_privileged_spec_carries_the_privileged_annotation() {
        let mut forged = cri_app_spec();
        forged["annotations"][PRIVILEGED_ANNOTATION] = json!("true");
        let mut forged = typed(forged);
        rewrite_for_guest(&mut forged, "c1", 42).unwrap();
        let forged = untyped(&forged);
        assert!(forged["annotations"].get(PRIVILEGED_ANNOTATION).is_none());
        let mut privileged = typed(json!({
            "process": {"user": {"uid": 0, "gid": 0}, "cwd": "/",
                        "capabilities": {"bounding": ["CAP_SYS_ADMIN"]}},
            "linux": {"resources": {"devices": [{"allow": true, "access": "rwm"}]}}}));
        rewrite_for_guest(&mut privileged, "c1", 42).unwrap();
        let privileged = untyped(&privileged);
        assert_eq!(privileged["annotations"][PRIVILEGED_ANNOTATION], "true");
    }

    #[test]
    fn propagating_binds_carry_their_volumes_key_and_only_the_shims() {
        let spec = |options: Value| {
            typed(json!({"mounts": [
                {"destination": "/vol", "type": "bind", "source": "/srv/vol", "options": options},
                {"destination": "/plain", "type": "bind", "source": "/srv/vol",
                 "options": ["rbind", "rprivate", "x-microvm-volume=forged"]}
            ]}))
        };
        let key = |s: &Spec| -> Vec<String> {
            untyped(s)["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    m["options"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter_map(|o| o.as_str()?.strip_prefix(VOLUME_KEY_OPTION))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .collect()
        };
        let mut bidi = spec(json!(["rbind", "rshared", "rw"]));
        let mut h2c = spec(json!(["rbind", "rslave", "rw"]));
        let mut h2c_ro = spec(json!(["rbind", "rslave", "ro"]));
        let binds = rewrite_for_guest(&mut bidi, "a", 1).unwrap();
        rewrite_for_guest(&mut h2c, "b", 1).unwrap();
        rewrite_for_guest(&mut h2c_ro, "c", 1).unwrap();
        let (a, b, c) = (key(&bidi), key(&h2c), key(&h2c_ro));
        // One key per volume and read-only flag; a forged one is removed, none added.
        assert_eq!(a[0].len(), 32);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[0], c[0]);
        assert_eq!((a[1].as_str(), b[1].as_str()), ("", ""));
        assert_eq!(a[0], volume_key(Path::new("/srv/vol"), false));
        assert_ne!(a[0], volume_key(Path::new("/srv/vol2"), false));
        assert!(binds[0].from_host && !binds[1].from_host);
        // The volume's share is the pod's, one for the containers of a key.
        let volume = format!("{GUEST_SHARED_DIR}/.volumes/{}", a[0]);
        assert_eq!(untyped(&bidi)["mounts"][0]["source"], volume.as_str());
        assert_eq!(untyped(&h2c)["mounts"][0]["source"], volume.as_str());
        assert_eq!(binds[0].relative, storage::volume_relative(&a[0]));
        assert_eq!(binds[1].relative, PathBuf::from("a/mounts/1"));
        assert_eq!(
            untyped(&bidi)["mounts"][1]["options"],
            json!(["rbind", "rprivate"])
        );
    }

    #[test]
    fn rejects_bad_specs_and_ids() {
        for id in ["", "..", "a/b"] {
            assert!(rewrite_for_guest(&mut typed(cri_app_spec()), id, 42).is_err());
        }
        // Not the shapes of a spec: refused with the whole spec (crate::oci::read_spec).
        assert!(parse_spec(b"[]").is_err());
        assert!(parse_spec(br#"{"root": 3}"#).is_err());
        assert!(parse_spec(br#"{"mounts": {}}"#).is_err());
        let mut rel =
            typed(json!({"mounts": [{"destination": "/x", "type": "bind", "source": "x"}]}));
        assert!(rewrite_for_guest(&mut rel, "c", 42).is_err());
        let mut nosrc = typed(json!({"mounts": [{"destination": "/x", "type": "bind"}]}));
        assert!(rewrite_for_guest(&mut nosrc, "c", 42).is_err());
        // A minimal spec gets a root.
        let mut min = typed(json!({}));
        assert!(rewrite_for_guest(&mut min, "c", 42).unwrap().is_empty());
        assert_eq!(
            untyped(&min)["root"]["path"],
            "/run/microvm-shared/c/rootfs"
        );
    }
}

/// Properties of the guest rewrite and the VM's size over any spec the shim may be handed.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::oci::test_json::{json as untyped, spec as typed};
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// A mount: type bind or not, a host source, options (some forged volume keys, some
    /// propagation, `ro`).
    fn mount() -> impl Strategy<Value = Value> {
        (
            any::<bool>(),
            "/[a-z]{1,8}(/[a-z.]{1,8}){0,3}",
            prop::collection::vec(
                prop::sample::select(vec![
                    "rbind",
                    "bind",
                    "ro",
                    "rw",
                    "rslave",
                    "rshared",
                    "private",
                    "nosuid",
                    "x-microvm-volume=00ff",
                    "x-microvm-volume=",
                ]),
                0..5,
            ),
        )
            .prop_map(|(bind, source, options)| {
                json!({
                    "destination": "/mnt",
                    "type": if bind { "bind" } else { "tmpfs" },
                    "source": source,
                    "options": options,
                })
            })
    }

    fn namespace() -> impl Strategy<Value = Value> {
        (
            prop::sample::select(vec!["pid", "network", "ipc", "uts", "mount", "cgroup"]),
            prop::sample::select(vec!["", "/proc/42/ns/x", "/proc/7/ns/pid", "container:c0"]),
        )
            .prop_map(|(kind, path)| {
                // `container:` paths are the shim's own, for PID namespaces only
                // (resolve_target_pid_namespace).
                let path = if kind == "pid"
                    || !(path.ends_with("/pid") || path.starts_with("container:"))
                {
                    path.to_string()
                } else {
                    String::new()
                };
                json!({ "type": kind, "path": path })
            })
    }

    fn spec() -> impl Strategy<Value = Value> {
        (
            prop::collection::vec(mount(), 0..6),
            prop::collection::vec(namespace(), 0..6),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(mounts, nss, privileged, forged)| {
                let mut annotations = serde_json::Map::new();
                if forged {
                    annotations.insert(PRIVILEGED_ANNOTATION.into(), json!("true"));
                }
                let devices = if privileged {
                    json!([{"allow": true, "access": "rwm"}])
                } else {
                    json!([{"allow": false, "access": "rwm"}])
                };
                json!({
                    "root": {"path": "/run/containerd/rootfs"},
                    "annotations": annotations,
                    "hooks": {"prestart": [{"path": "/usr/bin/host-hook"}]},
                    "mounts": mounts,
                    "linux": {
                        "cgroupsPath": "/kubepods/pod1/c1",
                        "namespaces": nss,
                        "resources": {"devices": devices},
                    },
                })
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// After the rewrite no host path is left where the guest would use it: the root and
        /// every bind source are under the container's share (a bind with propagation: the pod's
        /// share of its volume, by its key), each bind is returned with its
        /// host source, volume keys are only the shim's own (one per propagating bind), hooks
        /// and the cgroup path are gone, namespace paths are only the guest's own names, and
        /// the privileged annotation is there exactly for a privileged spec.
        #[test]
        fn the_guest_spec_names_only_guest_paths(original in spec(), sandbox_pid in prop::sample::select(vec![7u32, 8])) {
            let mut s = typed(original.clone());
            let binds = rewrite_for_guest(&mut s, "c1", sandbox_pid)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let s = untyped(&s);
            let root = guest_rootfs("c1");
            prop_assert_eq!(s["root"]["path"].as_str(), Some(root.as_str()));
            prop_assert!(s.get("hooks").is_none());
            prop_assert!(s["linux"].get("cgroupsPath").is_none());
            let before = original["mounts"].as_array().map(Vec::as_slice).unwrap_or_default();
            let after = s["mounts"].as_array().map(Vec::as_slice).unwrap_or_default();
            prop_assert_eq!(before.len(), after.len());
            let mut bind_n = 0;
            for (n, (b, a)) in before.iter().zip(after).enumerate() {
                let options: Vec<&str> = a["options"]
                    .as_array()
                    .map(|o| o.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let keys: Vec<&&str> =
                    options.iter().filter(|o| o.starts_with(VOLUME_KEY_OPTION)).collect();
                let is_bind = b["type"] == "bind"
                    || options.iter().any(|o| *o == "bind" || *o == "rbind");
                if !is_bind {
                    prop_assert!(keys.is_empty(), "no key on a non-bind mount: {a}");
                    prop_assert_eq!(&a["source"], &b["source"]);
                    continue;
                }
                let bind = &binds[bind_n];
                bind_n += 1;
                prop_assert_eq!(Some(bind.host_source.as_path()), b["source"].as_str().map(std::path::Path::new));
                let share = format!("{GUEST_SHARED_DIR}/{}", bind.relative.display());
                prop_assert_eq!(a["source"].as_str(), Some(share.as_str()));
                if bind.from_host {
                    let key = volume_key(&bind.host_source, bind.readonly);
                    prop_assert_eq!(&bind.relative, &storage::volume_relative(&key));
                    let key = format!("{VOLUME_KEY_OPTION}{key}");
                    let want = key.as_str();
                    prop_assert_eq!(keys, vec![&want]);
                } else {
                    prop_assert_eq!(&bind.relative, &std::path::PathBuf::from(format!("c1/mounts/{n}")));
                    prop_assert!(keys.is_empty(), "a forged key is dropped: {a}");
                }
            }
            prop_assert_eq!(bind_n, binds.len());
            for ns in s["linux"]["namespaces"].as_array().map(Vec::as_slice).unwrap_or_default() {
                let path = ns["path"].as_str().unwrap_or_default();
                prop_assert!(
                    path.is_empty() || path == POD_PID_NAMESPACE || path.starts_with("container:"),
                    "{ns}"
                );
                if !path.is_empty() {
                    prop_assert!(!matches!(ns["type"].as_str(), Some("network" | "ipc" | "uts")));
                }
            }
            let privileged = crate::resources::devices::oci::is_privileged(&typed(original.clone()));
            prop_assert_eq!(
                s["annotations"].get(PRIVILEGED_ANNOTATION).is_some(),
                privileged
            );
        }

        /// The VM's size stays within the config's bounds and grows with the pod's limits.
        #[test]
        fn vm_size_is_bounded_and_monotone(
            quota in 1i64..10_000_000,
            period in 1i64..1_000_000,
            memory in 1i64..(1 << 40),
            more in 0i64..(1 << 30),
        ) {
            let c = Config::default();
            let size = |q: i64, m: i64| {
                let a: HashMap<String, String> = [
                    (ANN_CPU_QUOTA, q.to_string()),
                    (ANN_CPU_PERIOD, period.to_string()),
                    (ANN_MEMORY, m.to_string()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                vm_size(&c, &a)
            };
            let s = size(quota, memory).map_err(TestCaseError::fail)?;
            prop_assert!(s.vcpus >= 1 && s.vcpus <= c.max_vcpus);
            prop_assert!(s.memory_mib <= c.max_memory_mib);
            prop_assert!(
                s.memory_mib >= (memory as u64).div_ceil(1 << 20).min(c.max_memory_mib),
                "the pod's memory fits"
            );
            let bigger = size(quota + more, memory + more).map_err(TestCaseError::fail)?;
            prop_assert!(bigger.vcpus >= s.vcpus && bigger.memory_mib >= s.memory_mib);
        }
    }
}
