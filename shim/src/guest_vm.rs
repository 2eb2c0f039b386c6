//! The seam between the host side and a VM backend: boot a Linux guest from a spec, reach its
//! agent socket, wait for it, stop it. Kept narrow on purpose (design.md 4): two backends, the
//! embedded VMM (the product's default) and QEMU (for hosts whose KVM cannot boot a Linux guest).

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::qemu::{self, Accel, QemuConfig, QemuVm};

/// Which VM backend runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The VMM embedded in this process, on /dev/kvm.
    Kvm,
    /// Debian's QEMU (`-M microvm`) with vhost-device-vsock; KVM if it can, else TCG.
    Qemu,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Kvm => "kvm",
            Backend::Qemu => "qemu",
        })
    }
}

/// Guest CID of every VM (each VM has its own vsock device, so they need not differ).
pub const GUEST_CID: u32 = 3;

/// What to boot.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// The guest kernel (uncompressed vmlinux ELF).
    pub kernel: PathBuf,
    /// The initramfs with the agent as /init.
    pub initrd: PathBuf,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Private folder for this VM's sockets and console log; created, and removed on drop.
    pub work_dir: PathBuf,
    /// The guest agent's log level (error, warn, info, debug, trace), passed on the kernel
    /// command line as `MICROVM_AGENT_LOG=`; `None` keeps the agent's default (info).
    pub agent_log_level: Option<String>,
    /// The guest's hostname (the pod's, from the sandbox spec), passed as `microvm.hostname=`;
    /// containers share the VM's UTS namespace. A name that is not a valid hostname is dropped.
    pub hostname: Option<String>,
    /// Network cards (virtio-net on taps in the pod netns), eth0 first.
    pub nics: Vec<GuestNic>,
}

/// A network card of the guest: a tap opened in the pod netns (`IFF_TAP | IFF_NO_PI |
/// IFF_VNET_HDR`) and the MAC and MTU the guest NIC gets (the CNI interface's).
#[derive(Debug, Clone)]
pub struct GuestNic {
    pub tap: Arc<OwnedFd>,
    pub mac: [u8; 6],
    pub mtu: u16,
}

impl GuestSpec {
    /// Words this spec adds to the kernel command line.
    fn cmdline_extra(&self) -> String {
        let mut words = Vec::new();
        // Only plain level names and hostnames: nothing a config or a pod spec can smuggle onto
        // the command line.
        if let Some(level) = &self.agent_log_level {
            if !level.is_empty() && level.bytes().all(|b| b.is_ascii_alphabetic()) {
                words.push(format!("MICROVM_AGENT_LOG={level}"));
            }
        }
        if let Some(name) = &self.hostname {
            if agent_protocol::is_valid_hostname(name) {
                words.push(format!("microvm.hostname={name}"));
            }
        }
        words.join(" ")
    }
}

/// A host directory exported to the guest over virtio-fs: the embedded VMM's own device, or
/// virtiofsd under QEMU. The guest mounts it with `mount -t virtiofs <tag> <dir>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDir {
    /// The virtio-fs tag (1 to 36 bytes).
    pub tag: String,
    /// The host directory.
    pub host_dir: PathBuf,
}

/// Errors of starting or running a guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestVmError {
    /// The embedded VMM failed.
    #[error(transparent)]
    Vmm(#[from] vmm::VmmError),
    /// The QEMU backend failed.
    #[error(transparent)]
    Qemu(#[from] qemu::QemuError),
    /// The work folder could not be made.
    #[error("cannot create the VM's work folder {path}: {source}")]
    WorkDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A NIC's tap fd could not be duplicated for the VMM.
    #[error("cannot duplicate a network card's tap fd: {0}")]
    Tap(std::io::Error),
    /// The memory size does not fit the backend.
    #[error("memory of {0} MiB is out of range for this backend")]
    Memory(u64),
    /// The guest did not print the agent's ready line in time.
    #[error("the guest agent was not ready within {waited:?}; last console lines:\n{tail}")]
    AgentNotReady { waited: Duration, tail: String },
    /// The guest ended before its agent was ready.
    #[error("the guest ended before its agent was ready; last console lines:\n{tail}")]
    EndedEarly { tail: String },
}

/// The line the agent prints on the console once it serves (guest-agent/src/main.rs).
pub const AGENT_READY_LINE: &str = "microvm-agent: ready";

/// The QEMU variant is boxed: it is twice the size of the embedded VMM's handle.
enum Running {
    Kvm(vmm::VmHandle),
    Qemu(Box<QemuVm>),
}

/// A running guest. Dropping it stops the VM and removes its work folder.
pub struct GuestVm {
    backend: Backend,
    running: Running,
    agent_socket: PathBuf,
    console_log: PathBuf,
    work_dir: PathBuf,
    started_at: Instant,
    detail: String,
}

/// The console log a VM started from a spec with `work_dir` writes.
pub fn console_log_in(work_dir: &Path) -> PathBuf {
    work_dir.join("console.log")
}

/// The last `lines` of a console log (empty if it cannot be read), for error messages.
pub fn console_tail(console_log: &Path, lines: usize) -> String {
    let text = std::fs::read(console_log).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The kernel command line our Linux guest gets under the embedded VMM (the VMM appends its
/// virtio-mmio devices). `reboot=k` makes the guest's reboot go through the i8042, which ends
/// the VM cleanly.
pub const KVM_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet";

impl GuestVm {
    /// Boots `spec` with `backend`.
    pub fn start(backend: Backend, spec: &GuestSpec) -> Result<GuestVm, GuestVmError> {
        Self::start_with_shared_dir(backend, spec, None)
    }

    /// Boots `spec` with `backend`, exporting `shared` to the guest over virtio-fs.
    pub fn start_with_shared_dir(
        backend: Backend,
        spec: &GuestSpec,
        shared: Option<&SharedDir>,
    ) -> Result<GuestVm, GuestVmError> {
        std::fs::create_dir_all(&spec.work_dir).map_err(|source| GuestVmError::WorkDir {
            path: spec.work_dir.clone(),
            source,
        })?;
        let started_at = Instant::now();
        let console_log = console_log_in(&spec.work_dir);
        let result = match backend {
            Backend::Kvm => Self::start_kvm(spec, &console_log, shared),
            Backend::Qemu => Self::start_qemu(spec, &console_log, shared),
        };
        match result {
            Ok((running, agent_socket, detail)) => Ok(GuestVm {
                backend,
                running,
                agent_socket,
                console_log,
                work_dir: spec.work_dir.clone(),
                started_at,
                detail,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&spec.work_dir);
                Err(e)
            }
        }
    }

    fn start_kvm(
        spec: &GuestSpec,
        console_log: &Path,
        shared: Option<&SharedDir>,
    ) -> Result<(Running, PathBuf, String), GuestVmError> {
        let uds = spec.work_dir.join("vsock.sock");
        let mut cfg = vmm::VmConfig::new(&spec.kernel);
        cfg.vcpus = spec.vcpus;
        cfg.memory_mib = spec.memory_mib;
        cfg.initrd = Some(spec.initrd.clone());
        cfg.cmdline = format!("{KVM_GUEST_CMDLINE} {}", spec.cmdline_extra())
            .trim_end()
            .to_string();
        cfg.serial = vmm::SerialSink::File(console_log.to_path_buf());
        cfg.vsock = Some(vmm::VsockConfig {
            guest_cid: GUEST_CID,
            uds_path: uds.clone(),
        });
        cfg.shared_fs = shared.map(|s| vmm::SharedFsConfig {
            tag: s.tag.clone(),
            host_dir: s.host_dir.clone(),
        });
        for nic in &spec.nics {
            let tap = nic
                .tap
                .as_fd()
                .try_clone_to_owned()
                .map_err(GuestVmError::Tap)?;
            cfg.nets.push(vmm::NetConfig {
                tap,
                mac: nic.mac,
                mtu: Some(nic.mtu),
            });
        }
        let handle = vmm::Vm::start(cfg)?;
        let detail = format!("embedded vmm on /dev/kvm, {} entry", handle.boot_entry());
        Ok((Running::Kvm(handle), uds, detail))
    }

    fn start_qemu(
        spec: &GuestSpec,
        console_log: &Path,
        shared: Option<&SharedDir>,
    ) -> Result<(Running, PathBuf, String), GuestVmError> {
        let memory_mib =
            u32::try_from(spec.memory_mib).map_err(|_| GuestVmError::Memory(spec.memory_mib))?;
        let mut cfg = QemuConfig::new(
            &spec.kernel,
            &spec.initrd,
            qemu::default_vhost_vsock_binary(),
            &spec.work_dir,
        );
        cfg.vcpus = u32::from(spec.vcpus);
        cfg.memory_mib = memory_mib;
        cfg.guest_cid = GUEST_CID;
        cfg.accel = Accel::Auto;
        cfg.console_log = Some(console_log.to_path_buf());
        cfg.cmdline_extra = spec.cmdline_extra();
        cfg.shared_fs = shared.map(|s| qemu::QemuSharedFs {
            tag: s.tag.clone(),
            host_dir: s.host_dir.clone(),
        });
        cfg.nics = spec
            .nics
            .iter()
            .map(|n| qemu::QemuNic {
                tap: n.tap.clone(),
                mac: n.mac,
                mtu: n.mtu,
            })
            .collect();
        let accel = match cfg.accel.resolve() {
            Accel::Kvm => "KVM",
            _ => "TCG (software emulation)",
        };
        let vm = QemuVm::start(cfg)?;
        let uds = vm.vsock_uds_path().to_path_buf();
        let detail = format!("qemu -M microvm, {accel}");
        Ok((Running::Qemu(Box::new(vm)), uds, detail))
    }

    /// The backend running the guest.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// One line on how the guest runs (backend, accelerator, boot entry).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Host processes running this guest besides the current one (QEMU and vhost-device-vsock;
    /// none for the embedded VMM, which runs in this process). Recorded so that a cleanup
    /// after a crash of this process can find them.
    pub fn pids(&self) -> Vec<u32> {
        match &self.running {
            Running::Kvm(_) => Vec::new(),
            Running::Qemu(vm) => vm.pids(),
        }
    }

    /// The hybrid-vsock Unix socket of the guest's vsock device.
    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// The guest's console log.
    pub fn console_log(&self) -> &Path {
        &self.console_log
    }

    /// When the backend was asked to start.
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// The last `lines` of the console, for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(&self.console_log, lines)
    }

    /// Waits (bounded) until the agent's ready line is on the console. Connecting only then
    /// matters for the QEMU backend: vhost-device-vsock 0.3.0 can wedge after connections the
    /// guest refused (docs/qemu-backend.md), so the client must not knock before the agent listens.
    pub fn wait_agent_ready(&mut self, timeout: Duration) -> Result<(), GuestVmError> {
        let deadline = Instant::now() + timeout;
        loop {
            let console = std::fs::read(&self.console_log).unwrap_or_default();
            if console
                .windows(AGENT_READY_LINE.len())
                .any(|w| w == AGENT_READY_LINE.as_bytes())
            {
                return Ok(());
            }
            if self.wait_timeout(Duration::from_millis(20))? {
                return Err(GuestVmError::EndedEarly {
                    tail: self.console_tail(20),
                });
            }
            if Instant::now() >= deadline {
                return Err(GuestVmError::AgentNotReady {
                    waited: timeout,
                    tail: self.console_tail(20),
                });
            }
        }
    }

    /// Waits up to `timeout` for the guest to end by itself. `Ok(true)` once it has ended.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<bool, GuestVmError> {
        match &mut self.running {
            Running::Kvm(h) => match h.wait_timeout(timeout) {
                None => Ok(false),
                Some(Ok(_)) => Ok(true),
                Some(Err(vmm::VmmError::AlreadyWaited)) => Ok(true),
                Some(Err(e)) => Err(e.into()),
            },
            Running::Qemu(vm) => Ok(vm.wait_timeout(timeout)?.is_some()),
        }
    }

    /// Stops the guest (bounded) and waits for it to end.
    pub fn stop(&mut self) -> Result<(), GuestVmError> {
        match &mut self.running {
            Running::Kvm(h) => {
                h.stop();
                match h.wait() {
                    Ok(_) | Err(vmm::VmmError::AlreadyWaited) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            Running::Qemu(vm) => vm.stop().map(|_| ()).map_err(Into::into),
        }
    }
}

impl Drop for GuestVm {
    fn drop(&mut self) {
        let _ = self.stop();
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

/// A fresh private work folder for one VM under the system's temporary folder.
pub fn new_work_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "microvm-{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(level: Option<&str>, hostname: Option<&str>) -> GuestSpec {
        GuestSpec {
            kernel: PathBuf::from("/k"),
            initrd: PathBuf::from("/i"),
            vcpus: 1,
            memory_mib: 128,
            work_dir: PathBuf::from("/w"),
            agent_log_level: level.map(str::to_owned),
            hostname: hostname.map(str::to_owned),
            nics: Vec::new(),
        }
    }

    #[test]
    fn cmdline_extra_passes_only_clean_words() {
        assert_eq!(spec(None, None).cmdline_extra(), "");
        assert_eq!(
            spec(Some("debug"), Some("pod-a.example")).cmdline_extra(),
            "MICROVM_AGENT_LOG=debug microvm.hostname=pod-a.example"
        );
        // Anything that could add words or options to the command line is dropped.
        assert_eq!(
            spec(Some("info init=/bin/sh"), Some("a b")).cmdline_extra(),
            ""
        );
        assert_eq!(spec(None, Some(&"x".repeat(65))).cmdline_extra(), "");
        assert_eq!(spec(None, Some("")).cmdline_extra(), "");
    }
}
