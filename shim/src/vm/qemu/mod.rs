//! The QEMU backend: boots our guest kernel and initrd under Debian's `qemu-system-x86_64`
//! (`-M microvm`), with the guest's vsock device served by `vhost-device-vsock` over vhost-user.
//!
//! vhost-device-vsock speaks the same hybrid-vsock protocol as our VMM on its host Unix socket
//! ([`QemuVm::vsock_uds_path`]): connect, write `CONNECT <port>\n`, read `OK <port>\n`; guest
//! connections to host port P go to `<uds>_<P>`. So the agent is reached exactly as under our VMM.
//! This is how Linux guests run on hosts whose KVM cannot boot them (kvm-pvm, no KVM): QEMU's
//! software emulation (TCG). See docs/qemu-backend.md for the command line and timings.
//!
//! Start-up order: vhost-device-vsock first (QEMU connects to its vhost-user socket while it
//! realizes the device, so the socket must exist), then QEMU. [`QemuVm::start`] returns once the
//! guest has written to its serial console, i.e. the kernel runs. Every child is killed and reaped
//! and every file this module created is removed on every path: failed start, [`QemuVm::stop`],
//! and drop. The children run in a PID namespace of the VM's own whose init ([`init`], the
//! running binary's `__pod-init`) gets SIGKILL from the kernel when the thread that started it
//! exits (`PR_SET_PDEATHSIG` is tied to the spawning *thread*): then the kernel kills every
//! process of the namespace, whatever its uid. Start a VM from a thread that outlives it.
//!
//! The folder:
//! - [`QemuVm`] (`launch.rs`): the VM's processes started in order, watched and stopped;
//! - [`QemuConfig`] and [`Accel`] (`config.rs`): what to boot and how, checked before anything
//!   starts; the accelerator is what `vm::backend` chose for this host (nothing here probes it);
//! - `cmdline.rs`: QEMU's command line and the guest kernel's;
//! - `paths.rs`: the VM's files in its work dir ([`vsock_uds_in`]);
//! - `process.rs`: the children: fds passed, confined, tied to the spawning thread, terminated;
//!   the console's copy into its bounded log;
//! - `virtiofsd.rs`: the Rust virtiofsd's command line and capabilities;
//! - `backend_jail.rs`: vhost-device-vsock's jail (its root, id and seccomp filter);
//! - [`init`]: the VM's PID namespace init (`__pod-init`);
//! - [`QemuError`] (`error.rs`).
//!
//! The `[qemu]` defaults (binaries, the jail id range) are the config's (`config::qemu`),
//! re-exported here for the backend's users.

mod backend_jail;
mod cmdline;
mod config;
mod error;
pub mod init;
mod launch;
mod paths;
mod process;
#[cfg(test)]
mod test_support;
mod virtiofsd;

pub use backend_jail::BackendJailError;
pub use cmdline::{host_tsc_khz, QEMU_SANDBOX};
pub use config::{
    disk_fd, Accel, QemuConfig, QemuDisk, QemuNic, QemuSharedFs, CONSOLE_FD, MAX_DISKS, MAX_NICS,
    NIC_FD_BASE,
};
pub use error::QemuError;
pub use launch::QemuVm;
pub use paths::vsock_uds_in;
pub use virtiofsd::{virtiofsd_args, VIRTIOFSD_KEPT_CAPS, VIRTIOFSD_MODCAPS};
