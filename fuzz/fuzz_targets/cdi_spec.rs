//! CDI specs (`shim::resources::devices::cdi`): a spec file of any content, JSON or YAML, in a
//! CDI folder, and a device name looked up in it, as the shim does at a pod's boot with the
//! folders an operator or a device plugin filled. Checked: never a panic, and a device that is
//! found has its nodes (host path non-empty when the spec gave one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use shim::resources::devices::cdi;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::cdi_spec);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("cdi");
        let mut t = Tape::new(data);
        let name = ["spec.json", "spec.yaml", "spec.yml", "other.txt"][usize::from(t.u8() % 4)];
        let qualified = String::from_utf8_lossy(t.blob()).into_owned();
        let second = t.blob().to_vec();
        let spec = t.rest();
        std::fs::write(dir.path().join(name), spec).expect("spec file");
        if !second.is_empty() {
            std::fs::write(dir.path().join("z-later.json"), &second).expect("spec file");
        }
        let dirs = [dir.path().to_path_buf(), dir.path().join("missing")];
        if let Ok(Some(nodes)) = cdi::device_nodes(&dirs, &qualified) {
            for n in nodes {
                let _ = (n.host_path.as_os_str().len(), n.writable, n.container_path.len());
            }
        }
    }
);
