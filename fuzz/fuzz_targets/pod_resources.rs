//! kubelet's PodResources answers (`shim::resources::devices::podresources`): the bytes of a
//! `Get` or `List` answer decoded with the shim's generated v1 types (prost, what tonic does
//! with the gRPC body) and turned into the pod's devices by the shim's own code. Checked: each
//! device once, and as many as the answer names at most.
#![no_main]

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::tape::Tape;
use prost::Message;
use shim::resources::devices::podresources::{held_devices, v1};

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::pod_resources);
    },
    |data: &[u8]| {
        let mut t = Tape::new(data);
        let list = t.bool();
        let body = t.rest();
        let pods: Vec<v1::PodResources> = if list {
            match v1::ListPodResourcesResponse::decode(body) {
                Ok(l) => l.pod_resources,
                Err(_) => return,
            }
        } else {
            match v1::GetPodResourcesResponse::decode(body) {
                Ok(g) => g.pod_resources.into_iter().collect(),
                Err(_) => return,
            }
        };
        for pod in &pods {
            let held = held_devices(pod);
            let named: usize = pod
                .containers
                .iter()
                .map(|c| {
                    c.devices.iter().map(|d| d.device_ids.len()).sum::<usize>()
                        + c.dynamic_resources
                            .iter()
                            .flat_map(|r| &r.claim_resources)
                            .map(|cl| cl.cdi_devices.len())
                            .sum::<usize>()
                })
                .sum();
            assert!(held.len() <= named);
            for (i, d) in held.iter().enumerate() {
                assert!(!held[..i].contains(d), "{d:?} twice");
                let _ = d.cdi_name();
            }
        }
    }
);
