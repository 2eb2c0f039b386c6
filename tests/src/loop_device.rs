//! A device plugin's block devices, for the pod tests: loop devices on files of the test's
//! folder, and the CDI spec that names them as a device plugin's devices (the shim resolves the
//! devices kubelet's PodResources API says a pod holds through it, docs/devices.md).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A loop device on a 4 MiB file of the test's folder whose first bytes are a marker; detached
/// when dropped.
pub struct LoopDevice {
    dev: PathBuf,
    file: PathBuf,
}

impl LoopDevice {
    /// A loop device on `<dir>/<name>.img`, which starts with `marker`.
    pub fn new(dir: &Path, name: &str, marker: &[u8]) -> LoopDevice {
        let file = dir.join(format!("{name}.img"));
        let mut f = std::fs::File::create(&file).unwrap();
        f.write_all(marker).unwrap();
        f.set_len(4 << 20).unwrap();
        drop(f);
        // A host without a loop device yet (the nested lane's L1) gets the module first; so
        // for /dev/fuse, which containerd stats on the host to write the spec.
        for (node, module) in [("/dev/loop-control", "loop"), ("/dev/fuse", "fuse")] {
            if !Path::new(node).exists() {
                let _ = Command::new("modprobe").arg(module).status();
            }
        }
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&file)
            .output()
            .expect("running losetup");
        assert!(out.status.success(), "losetup: {out:?}");
        let dev = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        LoopDevice { dev, file }
    }

    /// The first `n` bytes of the backing file (after the loop device's writes reached it).
    pub fn head(&self, n: usize) -> Vec<u8> {
        let _ = Command::new("blockdev")
            .arg("--flushbufs")
            .arg(&self.dev)
            .status();
        let mut f = std::fs::File::open(&self.file).unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut buf = vec![0; n];
        f.read_exact(&mut buf).unwrap();
        buf
    }

    /// The host node, `/dev/loopN`.
    pub fn path(&self) -> String {
        self.dev.display().to_string()
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// Writes a CDI spec of kind `kind` (a device plugin's resource name) into `dir`: each
/// `(id, container path, loop device, permissions)` is device `id`.
pub fn write_cdi(dir: &Path, kind: &str, devices: &[(&str, &str, &LoopDevice, &str)]) {
    let devices: Vec<serde_json::Value> = devices
        .iter()
        .map(|(id, container_path, host, permissions)| {
            serde_json::json!({"name": id, "containerEdits": {"deviceNodes": [
                {"path": container_path, "hostPath": host.path(), "permissions": permissions}]}})
        })
        .collect();
    let spec = serde_json::json!({"cdiVersion": "0.6.0", "kind": kind, "devices": devices});
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("microvm-test.json"),
        serde_json::to_vec(&spec).unwrap(),
    )
    .unwrap();
}
