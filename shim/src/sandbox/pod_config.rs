//! A pod created through containerd 2.x's Sandbox API (`sandboxer = "shim"`): CreateSandbox
//! carries no OCI spec, but the pod's CRI `PodSandboxConfig` (typed, in `options`) and the
//! netns path containerd ran CNI in. [`PodConfig::from_request`] turns them into what a pod's
//! boot reads from a pause container's spec on the other path, built the way containerd's
//! podsandbox controller builds that spec (internal/cri/server/podsandbox/sandbox_run_linux.go),
//! so both paths boot the same VM:
//!
//! - `linux.cgroupsPath`: `<cgroup_parent>/<id>`, or `<slice>:cri-containerd:<id>` under a
//!   systemd slice;
//! - `linux.namespaces`: network (with the netns path), pid and ipc, each left out when the pod
//!   asks for the node's (then refused: [`super::spec::refuse_host_namespaces`]);
//! - `linux.sysctl`, `hostname`;
//! - annotations: the `io.kubernetes.cri.sandbox-*` sizes from `linux.resources` (the
//!   containers' sum), the pod's name and namespace, and the pod's own `microvm.io/*`
//!   annotations (the handler's `pod_annotations` of the other path);
//! - the RuntimeClass overhead, typed from `linux.overhead` (no annotation needed).

use std::collections::HashMap;

use containerd_shim_protos::protobuf::well_known_types::any::Any;
use k8s_cri::v1::{NamespaceMode, PodSandboxConfig};
use oci_spec::runtime::{LinuxNamespace, LinuxNamespaceType};
use prost::Message;

use crate::oci::{Spec, ANN_CONTAINER_TYPE, ANN_SANDBOX_ID};
use crate::resources::cgroup::overhead::{self, Amounts};
use crate::resources::devices::{POD_NAMESPACE_ANNOTATION, POD_NAME_ANNOTATION};

use super::spec::{ANN_CPU_PERIOD, ANN_CPU_QUOTA, ANN_MEMORY};

/// The type containerd marshals CreateSandbox's options as (typeurl of the CRI message).
pub const POD_SANDBOX_CONFIG_TYPE: &str = "runtime.v1.PodSandboxConfig";
/// The pod annotations passed on to the shim (the handler's `pod_annotations` on the other
/// path, `microvm install`'s default).
const POD_ANNOTATION_PREFIX: &str = "microvm.io/";
/// The largest options message read (a PodSandboxConfig is a few KiB).
const MAX_OPTIONS_BYTES: usize = 1 << 20;

/// Why CreateSandbox's request cannot describe a pod.
#[derive(Debug, thiserror::Error)]
pub enum PodConfigError {
    #[error("CreateSandbox options of type {0:?}: expected {POD_SANDBOX_CONFIG_TYPE}")]
    WrongType(String),
    #[error("CreateSandbox options of {0} bytes: more than {MAX_OPTIONS_BYTES}")]
    TooLarge(usize),
    #[error("decoding the PodSandboxConfig in CreateSandbox's options: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// A pod as its boot reads it: the spec and annotations a pause container's spec would have
/// had, and the typed overhead.
#[derive(Debug, Clone, PartialEq)]
pub struct PodConfig {
    /// An OCI spec with the fields a pod's boot reads (see the module doc).
    pub spec: Spec,
    /// The spec's annotations.
    pub annotations: HashMap<String, String>,
    /// The RuntimeClass overhead from `linux.overhead` (none set: empty).
    pub overhead: Amounts,
}

impl PodConfig {
    /// Pod `id` from CreateSandbox's `options` (None: containerd sent none, a pod with the
    /// config's defaults) and `netns_path` ("" when the pod asks for the host's network).
    pub fn from_request(
        id: &str,
        options: Option<&Any>,
        netns_path: &str,
    ) -> Result<PodConfig, PodConfigError> {
        let config = match options {
            Some(any) if !any.type_url.is_empty() || !any.value.is_empty() => {
                let name = any.type_url.rsplit('/').next().unwrap_or_default();
                if name != POD_SANDBOX_CONFIG_TYPE {
                    return Err(PodConfigError::WrongType(any.type_url.clone()));
                }
                if any.value.len() > MAX_OPTIONS_BYTES {
                    return Err(PodConfigError::TooLarge(any.value.len()));
                }
                PodSandboxConfig::decode(any.value.as_slice())?
            }
            _ => PodSandboxConfig::default(),
        };
        Ok(Self::from_config(id, &config, netns_path))
    }

    /// Pod `id` from its CRI config.
    pub fn from_config(id: &str, config: &PodSandboxConfig, netns_path: &str) -> PodConfig {
        let linux = config.linux.clone().unwrap_or_default();
        let ns = linux
            .security_context
            .as_ref()
            .and_then(|s| s.namespace_options.clone())
            .unwrap_or_default();
        let node = NamespaceMode::Node as i32;
        let namespace = |typ: LinuxNamespaceType, path: &str| {
            let mut ns = LinuxNamespace::default();
            ns.set_typ(typ);
            ns.set_path(Some(path.into()).filter(|_| !path.is_empty()));
            ns
        };
        let mut namespaces = Vec::new();
        if ns.network != node {
            namespaces.push(namespace(LinuxNamespaceType::Network, netns_path));
        }
        if ns.pid != node {
            namespaces.push(namespace(LinuxNamespaceType::Pid, ""));
        }
        if ns.ipc != node {
            namespaces.push(namespace(LinuxNamespaceType::Ipc, ""));
        }
        namespaces.push(namespace(LinuxNamespaceType::Uts, ""));
        namespaces.push(namespace(LinuxNamespaceType::Mount, ""));

        let mut annotations: HashMap<String, String> = config
            .annotations
            .iter()
            .filter(|(k, _)| k.starts_with(POD_ANNOTATION_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        annotations.insert(ANN_CONTAINER_TYPE.into(), "sandbox".into());
        annotations.insert(ANN_SANDBOX_ID.into(), id.into());
        if let Some(meta) = &config.metadata {
            annotations.insert(POD_NAME_ANNOTATION.into(), meta.name.clone());
            annotations.insert(POD_NAMESPACE_ANNOTATION.into(), meta.namespace.clone());
        }
        if let Some(res) = &linux.resources {
            annotations.insert(ANN_CPU_PERIOD.into(), res.cpu_period.to_string());
            annotations.insert(ANN_CPU_QUOTA.into(), res.cpu_quota.to_string());
            annotations.insert(ANN_MEMORY.into(), res.memory_limit_in_bytes.to_string());
        }
        let overhead = linux
            .overhead
            .as_ref()
            .map(|o| Amounts {
                memory_bytes: u64::try_from(o.memory_limit_in_bytes)
                    .ok()
                    .filter(|b| *b > 0),
                cpu_millis: match (o.cpu_quota, u64::try_from(o.cpu_period)) {
                    (quota, Ok(period)) if quota > 0 => overhead::quota_millis(quota, period),
                    _ => None,
                },
            })
            .unwrap_or_default();

        let mut spec_linux = crate::oci::empty_linux();
        spec_linux.set_namespaces(Some(namespaces));
        spec_linux.set_sysctl(Some(linux.sysctls.clone()));
        if !linux.cgroup_parent.is_empty() {
            spec_linux.set_cgroups_path(Some(cgroups_path(&linux.cgroup_parent, id).into()));
        }
        let mut spec = crate::oci::empty_spec();
        spec.set_annotations(Some(annotations.clone()));
        spec.set_linux(Some(spec_linux));
        if !config.hostname.is_empty() {
            spec.set_hostname(Some(config.hostname.clone()));
        }
        PodConfig {
            spec,
            annotations,
            overhead,
        }
    }
}

/// The sandbox's `linux.cgroupsPath` under `parent`, as containerd's CRI makes it.
fn cgroups_path(parent: &str, id: &str) -> String {
    let base = parent
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    if base.ends_with(".slice") {
        format!("{base}:cri-containerd:{id}")
    } else {
        format!("{}/{id}", parent.trim_end_matches('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1::{
        LinuxContainerResources, LinuxPodSandboxConfig, LinuxSandboxSecurityContext,
        NamespaceOption, PodSandboxMetadata,
    };

    fn pod() -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: "web".into(),
                namespace: "shop".into(),
                uid: "u1".into(),
                attempt: 0,
            }),
            hostname: "web-0".into(),
            annotations: [
                ("microvm.io/overhead-memory".to_string(), "64Mi".to_string()),
                ("other.io/x".to_string(), "y".to_string()),
            ]
            .into(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: "/kubepods/pod-u1".into(),
                sysctls: [("net.ipv4.ip_forward".to_string(), "1".to_string())].into(),
                resources: Some(LinuxContainerResources {
                    cpu_period: 100_000,
                    cpu_quota: 150_000,
                    memory_limit_in_bytes: 256 << 20,
                    ..Default::default()
                }),
                overhead: Some(LinuxContainerResources {
                    cpu_period: 100_000,
                    cpu_quota: 25_000,
                    memory_limit_in_bytes: 96 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn any(config: &PodSandboxConfig) -> Any {
        Any {
            type_url: POD_SANDBOX_CONFIG_TYPE.into(),
            value: config.encode_to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn a_pod_config_becomes_the_spec_the_pause_path_reads() {
        let p = PodConfig::from_request("sb1", Some(&any(&pod())), "/var/run/netns/cni-1").unwrap();
        let json = crate::oci::test_json::json(&p.spec);
        assert_eq!(json["linux"]["cgroupsPath"], "/kubepods/pod-u1/sb1");
        assert_eq!(
            crate::oci::network_namespace(&p.spec).unwrap(),
            std::path::PathBuf::from("/var/run/netns/cni-1")
        );
        assert!(super::super::spec::refuse_host_namespaces(&p.spec).is_none());
        assert_eq!(
            super::super::spec::pod_sysctls(&p.spec)["net.ipv4.ip_forward"],
            "1"
        );
        assert_eq!(json["hostname"], "web-0");
        assert_eq!(p.annotations[ANN_CPU_QUOTA], "150000");
        assert_eq!(p.annotations[ANN_MEMORY], (256u64 << 20).to_string());
        assert_eq!(p.annotations[POD_NAME_ANNOTATION], "web");
        assert_eq!(p.annotations[POD_NAMESPACE_ANNOTATION], "shop");
        assert_eq!(p.annotations["microvm.io/overhead-memory"], "64Mi");
        assert!(!p.annotations.contains_key("other.io/x"));
        assert_eq!(crate::oci::annotations(&p.spec), p.annotations);
        assert_eq!(
            p.overhead,
            Amounts {
                memory_bytes: Some(96 << 20),
                cpu_millis: Some(250)
            }
        );
    }

    #[test]
    fn host_namespaces_are_left_out_and_so_refused() {
        let mut c = pod();
        c.linux.as_mut().unwrap().security_context = Some(LinuxSandboxSecurityContext {
            namespace_options: Some(NamespaceOption {
                network: NamespaceMode::Node as i32,
                pid: NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        });
        let p = PodConfig::from_config("sb1", &c, "");
        let refusal = super::super::spec::refuse_host_namespaces(&p.spec).unwrap();
        assert!(refusal.contains("hostNetwork and hostPID"), "{refusal}");
    }

    #[test]
    fn systemd_slices_and_missing_options() {
        assert_eq!(
            cgroups_path("/kubepods.slice/kubepods-pod1.slice", "sb"),
            "kubepods-pod1.slice:cri-containerd:sb"
        );
        let p = PodConfig::from_request("sb", None, "/n").unwrap();
        assert!(crate::oci::test_json::json(&p.spec)["linux"]
            .get("cgroupsPath")
            .is_none());
        assert_eq!(p.overhead, Amounts::default());
        assert!(!p.annotations.contains_key(ANN_MEMORY));
    }

    #[test]
    fn bad_options_are_refused() {
        let mut a = any(&pod());
        a.type_url = "types.containerd.io/other".into();
        assert!(matches!(
            PodConfig::from_request("sb", Some(&a), ""),
            Err(PodConfigError::WrongType(_))
        ));
        let a = Any {
            type_url: POD_SANDBOX_CONFIG_TYPE.into(),
            value: vec![0xff; 16],
            ..Default::default()
        };
        assert!(matches!(
            PodConfig::from_request("sb", Some(&a), ""),
            Err(PodConfigError::Decode(_))
        ));
    }
}
