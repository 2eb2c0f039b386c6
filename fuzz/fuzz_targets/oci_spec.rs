//! OCI specs and the CRI annotations in them, and CreateSandbox's `PodSandboxConfig`, as the
//! shim reads them: containerd writes them, from what the pod's author put in the pod (names,
//! mounts, devices, sysctls, annotations), so every field is the author's to choose.
//!
//! A JSON spec (typed by `shim::oci::parse_spec`, as `shim::oci::read_spec` does) goes through the shim's readers
//! in a pod's order: the role from the annotations, the network namespace, the host namespaces
//! refused, the VM size and the containers' sums, the pod's sysctls, the devices and their
//! classes, TARGET PID namespaces, and the rewrite for the guest. Or, with the first tape bit,
//! the bytes are a protobuf `PodSandboxConfig` in CreateSandbox's options
//! (`shim::sandbox::pod_config::PodConfig::from_request`), whose pod spec then takes the same
//! way. Checked on a rewrite: the rootfs is the container's in the share, no hooks are left,
//! every bind lands under the container's own mounts folder (or, with propagation, at the pod's
//! place for that volume, named by the hash of its source), and the JSON the agent gets types
//! again to the same spec.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::tape::Tape;
use protobuf::well_known_types::any::Any;
use shim::config::Config;
use shim::oci::Spec;
use shim::resources::devices::oci;
use shim::resources::storage;
use shim::sandbox::pod_config::{PodConfig, POD_SANDBOX_CONFIG_TYPE};
use shim::sandbox::spec;
use shim::task::bundle;

fn walk_spec(config: &Config, mut value: Spec, cid: &str, sandbox_pid: u32) {
    let annotations = shim::oci::annotations(&value);
    let role = bundle::Role::from_annotations(cid, &annotations);
    let _ = role.pod_id(cid);
    let _ = shim::oci::network_namespace(&value);
    let _ = spec::host_namespaces(&value);
    let _ = spec::refuse_host_namespaces(&value);
    if let Ok(size) = spec::vm_size(config, &annotations) {
        assert!(size.vcpus >= 1 && size.vcpus <= config.max_vcpus.max(config.default_vcpus));
        assert!(size.memory_mib <= config.max_memory_mib.max(config.default_memory_mib));
    }
    let _ = spec::containers_sum(&annotations);
    let _ = spec::pod_sysctls(&value);
    if let Ok(devices) = oci::spec_devices(&value) {
        for d in &devices {
            let _ = oci::classify(d, cid.len().is_multiple_of(2));
        }
        oci::remove_devices(&mut value, &devices[..devices.len() / 2]);
    }
    let targets: HashMap<u32, String> = [(sandbox_pid, "target".to_string())].into();
    spec::resolve_target_pid_namespace(&mut value, &targets);
    if let Ok(binds) = spec::rewrite_for_guest(&mut value, cid, sandbox_pid) {
        assert_eq!(
            value.root().as_ref().and_then(|r| r.path().to_str()),
            Some(spec::guest_rootfs(cid).as_str())
        );
        assert!(value.hooks().is_none());
        let json = serde_json::to_vec(&value).expect("a typed spec serializes");
        let again = shim::oci::parse_spec(&json).expect("the agent's JSON types again");
        assert_eq!(
            serde_json::to_value(&again).expect("a typed spec serializes"),
            serde_json::to_value(&value).expect("a typed spec serializes"),
            "the agent reads what the shim wrote"
        );
        let own = std::path::Path::new(cid).join("mounts");
        for b in binds {
            if b.from_host {
                // A volume with propagation: the pod's one place for it, named by the shim's
                // hash of its source, never by anything else in the spec.
                let key = spec::volume_key(&b.host_source, b.readonly);
                assert_eq!(b.relative, storage::volume_relative(&key));
            } else {
                assert!(
                    b.relative.starts_with(&own),
                    "{:?} leaves {own:?}",
                    b.relative
                );
            }
            assert!(b.host_source.is_absolute());
        }
    }
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::oci_spec);
    },
    |data: &[u8]| {
        let config = Config::default();
        let mut t = Tape::new(data);
        let cri = t.bool();
        let cid_len = usize::from(t.u8() % 80);
        let cid = String::from_utf8_lossy(t.bytes(cid_len)).into_owned();
        let sandbox_pid = t.u32();
        let body = t.rest();
        if cri {
            let any = Any {
                type_url: format!("type.googleapis.com/{POD_SANDBOX_CONFIG_TYPE}"),
                value: body.to_vec(),
                ..Default::default()
            };
            let netns = if cid.is_empty() { "" } else { "/var/run/netns/cni-1" };
            if let Ok(pod) = PodConfig::from_request(&cid, Some(&any), netns) {
                walk_spec(&config, pod.spec, &cid, sandbox_pid);
            }
        } else if let Ok(spec) = shim::oci::parse_spec(body) {
            walk_spec(&config, spec, &cid, sandbox_pid);
        }
    }
);
