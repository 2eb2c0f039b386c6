//! [`GuestVm`]: a running guest of either backend with what both share: its work folder, console
//! log, agent socket and the agent's ready event. Dropping it stops the VM and removes its work
//! folder.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::backend::Backend;
use super::console::{console_log_in, console_tail};
use super::end::EndReason;
use super::error::GuestVmError;
use super::launch;
use super::qemu;
use super::ready::ReadyListener;
use super::running::{lock, Vm};
use super::spec::{GuestSpec, VSOCK_UDS_NAME};

/// A running guest with its files. Dropping it stops the VM and removes its work folder.
pub struct GuestVm {
    vm: Vm,
    backend: Backend,
    agent_socket: PathBuf,
    console_log: PathBuf,
    work_dir: PathBuf,
    started_at: Instant,
    detail: String,
    /// The host end of the agent's ready port, until the event came: then it is closed, and
    /// later connections of the guest to that port find nobody.
    ready: Option<ReadyListener>,
}

/// Console lines quoted in errors.
const TAIL_LINES: usize = 20;

impl GuestVm {
    /// Boots `spec` with `backend`; the host listens for the agent's ready event before the
    /// guest runs.
    pub fn start(backend: Backend, spec: &GuestSpec) -> Result<GuestVm, GuestVmError> {
        std::fs::create_dir_all(&spec.work_dir).map_err(|source| GuestVmError::WorkDir {
            path: spec.work_dir.clone(),
            source,
        })?;
        let started_at = Instant::now();
        let console_log = console_log_in(&spec.work_dir);
        let uds = match backend {
            Backend::Kvm => spec.work_dir.join(VSOCK_UDS_NAME),
            // In a folder of its own, which the jailed vhost-device-vsock may write.
            Backend::Qemu => qemu::vsock_uds_in(&spec.work_dir),
        };
        if let Some(dir) = uds.parent() {
            std::fs::create_dir_all(dir).map_err(|source| GuestVmError::WorkDir {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let result = ReadyListener::bind(&uds)
            .map_err(|source| GuestVmError::AgentNotReady {
                source,
                tail: String::new(),
            })
            .and_then(|ready| {
                let (vm, detail) = match backend {
                    Backend::Kvm if spec.vmm_process => {
                        launch::start_kvm_process(spec, &console_log, &uds)?
                    }
                    Backend::Kvm => launch::start_kvm(spec, &console_log, &uds)?,
                    Backend::Qemu => launch::start_qemu(spec, &console_log)?,
                };
                Ok((vm, detail, ready))
            });
        match result {
            Ok((vm, detail, ready)) => Ok(GuestVm {
                vm,
                backend,
                agent_socket: uds,
                console_log,
                work_dir: spec.work_dir.clone(),
                started_at,
                detail,
                ready: Some(ready),
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&spec.work_dir);
                Err(e)
            }
        }
    }

    /// The backend running the guest.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// One line on how the guest runs (backend, accelerator, boot entry).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Host processes running this guest besides the current one (QEMU and its helpers; none
    /// for the embedded VMM, which runs in this process). Recorded so that a cleanup after a
    /// crash of this process can find them.
    pub fn pids(&self) -> Vec<u32> {
        match &self.vm {
            Vm::Embedded(_) => Vec::new(),
            Vm::Process(p) => vec![lock(p).pid()],
            Vm::Qemu(vm) => vm.pids(),
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

    /// Waits (bounded) for the agent's ready event ([`ready`]); fails at once if the guest ends
    /// first. Errors carry the console's tail.
    pub fn wait_agent_ready(&mut self, timeout: Duration) -> Result<(), GuestVmError> {
        let GuestVm { vm, ready, .. } = self;
        let Some(listener) = ready.as_ref() else {
            // It came already.
            return Ok(());
        };
        let mut gone = None;
        let waited = listener.wait(timeout, || match vm.wait_timeout(Duration::ZERO) {
            Ok(None) => false,
            Ok(Some(reason)) => {
                gone = Some(reason);
                true
            }
            Err(e) => {
                gone = Some(EndReason::Lost(e.to_string()));
                true
            }
        });
        if let Some(reason) = gone {
            log::warn!("the guest ended before its agent was ready: {reason}");
        }
        if waited.is_ok() {
            *ready = None;
        }
        waited.map_err(|source| GuestVmError::AgentNotReady {
            source,
            tail: self.console_tail(TAIL_LINES),
        })
    }

    /// Waits up to `timeout` for the guest to end by itself; why, once it has.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<EndReason>, GuestVmError> {
        self.vm.wait_timeout(timeout)
    }

    /// Fills empty disk slot `index` (of [`GuestSpec::disks`]) with `file`; blocks while the
    /// device runs a batch of requests.
    pub fn attach_block(
        &self,
        index: usize,
        serial: String,
        file: File,
    ) -> Result<(), GuestVmError> {
        self.vm.attach_block(index, serial, file)
    }

    /// One page sharing pass over the guest's memory (docs/page-sharing.md): `None` when the
    /// VM does not share pages (off, VFIO devices, the QEMU backend).
    pub fn share_pages(&self) -> Option<Result<(), GuestVmError>> {
        self.vm.share_pages()
    }

    /// Whether this VM's kernel text template is still to be captured
    /// ([`GuestSpec::kernel_text_capture`]); `None` when it shares no pages.
    pub fn kernel_text_template_missing(&self) -> Option<Result<bool, GuestVmError>> {
        self.vm.kernel_text_template_missing()
    }

    /// Captures the kernel text template from this VM, which must be one that saw no pod input
    /// (started from [`GuestSpec::kernel_text_capture`]); whether it captured.
    pub fn capture_kernel_text(&self) -> Result<bool, GuestVmError> {
        self.vm.capture_kernel_text()
    }

    /// Empties disk slot `index`.
    pub fn detach_block(&self, index: usize) -> Result<(), GuestVmError> {
        self.vm.detach_block(index)
    }

    /// Stops the guest (bounded) and waits for it to end.
    pub fn stop(&mut self) -> Result<(), GuestVmError> {
        self.vm.stop()
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
