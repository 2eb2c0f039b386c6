//! Helpers of the QEMU backend's unit tests: a config of stand-in files, the built shim binary
//! as the VM's init, a fresh temporary folder, the installed vhost-device-vsock.

use std::fs;
use std::path::{Path, PathBuf};

use super::config::QemuConfig;
use crate::config::qemu::default_vhost_vsock_binary;

pub(super) fn cfg_in(dir: &Path) -> QemuConfig {
    let kernel = dir.join("k");
    let initrd = dir.join("i");
    fs::write(&kernel, b"x").unwrap();
    fs::write(&initrd, b"x").unwrap();
    let mut cfg = QemuConfig::new(
        kernel,
        initrd,
        "/nonexistent/vhost-device-vsock",
        dir.join("w"),
    );
    cfg.init_binary = shim_binary();
    cfg
}

/// The shim binary of this build (`make build` builds it before the tests): the VM's init
/// (`__pod-init`); this test binary is not one.
pub(super) fn shim_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // <target>/<profile>/deps/<test>
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("containerd-shim-microvm-v1");
    assert!(
        bin.is_file(),
        "{}: build the binaries first (`make build`)",
        bin.display()
    );
    bin
}

/// A fresh temporary folder for test `name`, removed when the value is dropped.
pub(super) fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qemu-unit-{name}-"))
        .tempdir()
        .expect("a temporary folder")
}

/// The static vhost-device-vsock scripts/install-vhost-device-vsock.sh installs (`make
/// deps`): the only kind of vsock backend that runs in its jail.
pub(super) fn real_vsock_backend() -> PathBuf {
    let bin = default_vhost_vsock_binary();
    assert!(
        bin.is_file(),
        "{}: install it with scripts/install-vhost-device-vsock.sh",
        bin.display()
    );
    bin
}
