//! The QEMU backend's errors ([`QemuError`]): each names the binary or file concerned.

use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use super::backend_jail::BackendJailError;
use super::init::PodInitError;

/// Longest path a Unix socket address holds (`sun_path` is 108 bytes with the NUL).
pub(super) const MAX_SOCKET_PATH: usize = 107;

/// Errors of the QEMU backend; each names the binary or file concerned.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("invalid QEMU VM config: {0}")]
    InvalidConfig(String),
    #[error("cannot read the {what} {path}: {source}")]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot create {path}: {source}")]
    CreateFile { path: PathBuf, source: io::Error },
    #[error("socket path {path} is {len} bytes; a Unix socket path holds at most {MAX_SOCKET_PATH}: use a shorter work dir")]
    SocketPathTooLong { path: PathBuf, len: usize },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: io::Error },
    #[error(transparent)]
    BackendJail(#[from] BackendJailError),
    #[error("cannot start {binary} in its jail: {source}; its stderr ends with:\n{stderr}")]
    BackendJailSpawn {
        binary: PathBuf,
        source: io::Error,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before creating its socket {socket}; its stderr ends with:\n{stderr}")]
    BackendExited {
        binary: PathBuf,
        status: ExitStatus,
        socket: PathBuf,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before creating its socket {socket} (the QEMU backend runs the Rust virtiofsd, scripts/install-virtiofsd.sh; QEMU 7.2's C virtiofsd takes other options and is not supported); its stderr ends with:\n{stderr}")]
    VirtiofsdExited {
        binary: PathBuf,
        status: ExitStatus,
        socket: PathBuf,
        stderr: String,
    },
    #[error("{binary} did not create its socket {socket} within {timeout:?}; its stderr ends with:\n{stderr}")]
    BackendTimeout {
        binary: PathBuf,
        socket: PathBuf,
        timeout: Duration,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before the guest wrote to its console; stderr ends with:\n{stderr}\nconsole ends with:\n{console}")]
    QemuExitedEarly {
        binary: PathBuf,
        status: ExitStatus,
        stderr: String,
        console: String,
    },
    #[error("{binary}: the guest wrote nothing to its console ({console_log}) within {timeout:?}; stderr ends with:\n{stderr}")]
    StartTimeout {
        binary: PathBuf,
        console_log: PathBuf,
        timeout: Duration,
        stderr: String,
    },
    #[error("{binary} exited ({status}) while waiting for {needle:?} on the console; console ends with:\n{console}")]
    ExitedWhileWaiting {
        binary: PathBuf,
        status: ExitStatus,
        needle: String,
        console: String,
    },
    #[error("{needle:?} did not appear on the guest console within {timeout:?}; console ends with:\n{console}")]
    ConsoleTimeout {
        needle: String,
        timeout: Duration,
        console: String,
    },
    #[error("cannot prepare {path} for the VM's jail id {id}: {source}")]
    Jail {
        path: PathBuf,
        id: u32,
        source: io::Error,
    },
    #[error(transparent)]
    Init(#[from] PodInitError),
    #[error("cannot wait for {binary} (pid {pid}): {source}")]
    Wait {
        binary: PathBuf,
        pid: u32,
        source: io::Error,
    },
}
