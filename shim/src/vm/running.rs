//! [`Vm`]: the running VM of either backend (the embedded VMM in this process or in a process of
//! its own, or QEMU), each request turned into that backend's call, and its end into an
//! [`EndReason`].

use std::fs::File;
use std::time::Duration;

use super::end::EndReason;
use super::error::GuestVmError;
use super::qemu::QemuVm;

/// A running VM of either backend. The QEMU variant is boxed: it is twice the size of the
/// embedded VMM's handle.
pub enum Vm {
    Embedded(vmm::VmHandle),
    /// The embedded VMM in a process of its own.
    Process(Box<std::sync::Mutex<vmm::jail::split::VmmProcess>>),
    Qemu(Box<QemuVm>),
}

impl Vm {
    /// Waits up to `timeout` for the guest to end by itself; why, once it has.
    pub(super) fn wait_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<EndReason>, GuestVmError> {
        match self {
            Vm::Embedded(h) => match h.wait_timeout(timeout) {
                None => Ok(None),
                Some(Ok(vmm::VmExit::Reset)) => Ok(Some(EndReason::GuestReset)),
                Some(Ok(vmm::VmExit::Stopped)) => Ok(Some(EndReason::Stopped)),
                Some(Err(vmm::VmmError::AlreadyWaited)) => Ok(Some(EndReason::Stopped)),
                Some(Err(e)) => Err(e.into()),
            },
            Vm::Process(p) => Ok(lock(p).wait_timeout(timeout).map(|end| process_end(&end))),
            Vm::Qemu(vm) => Ok(vm.wait_timeout(timeout)?.map(|s| {
                if s.success() {
                    EndReason::GuestReset
                } else {
                    EndReason::BackendExited(s)
                }
            })),
        }
    }

    /// Fills empty disk slot `index` with `file` (embedded VMM only: QEMU has no runtime
    /// virtio-blk change here, docs/devices.md).
    pub(super) fn attach_block(
        &self,
        index: usize,
        serial: String,
        file: File,
    ) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.attach_block(index, serial, file)?),
            Vm::Process(p) => lock(p)
                .attach_block(index, serial, &file, REQUEST_TIMEOUT)
                .map_err(|e| GuestVmError::Process(e.to_string())),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "block hot-plug on the QEMU backend",
            )),
        }
    }

    /// Empties disk slot `index`.
    pub(super) fn detach_block(&self, index: usize) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.detach_block(index)?),
            Vm::Process(p) => lock(p)
                .detach_block(index, REQUEST_TIMEOUT)
                .map_err(|e| GuestVmError::Process(e.to_string())),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "block hot-plug on the QEMU backend",
            )),
        }
    }

    /// One page sharing pass (embedded VMM with page sharing on; `None` otherwise).
    pub(super) fn share_pages(&self) -> Option<Result<(), GuestVmError>> {
        match self {
            Vm::Embedded(h) => match h.share_pages() {
                Err(vmm::VmmError::PageSharing(vmm::page_sharing::PageSharingError::Off)) => None,
                r => Some(r.map(drop).map_err(Into::into)),
            },
            Vm::Process(p) => {
                let mut p = lock(p);
                if !p.shares_pages() {
                    return None;
                }
                Some(
                    p.share_pages(SHARING_TIMEOUT)
                        .map_err(|e| GuestVmError::Process(e.to_string())),
                )
            }
            Vm::Qemu(_) => None,
        }
    }

    /// Whether the VM's kernel text template is still to be captured (embedded VMM with page
    /// sharing on; `None` otherwise).
    pub(super) fn kernel_text_template_missing(&self) -> Option<Result<bool, GuestVmError>> {
        match self {
            Vm::Embedded(h) => match h.kernel_text_template_missing() {
                Err(vmm::VmmError::PageSharing(vmm::page_sharing::PageSharingError::Off)) => None,
                r => Some(r.map_err(Into::into)),
            },
            Vm::Process(p) => {
                let mut p = lock(p);
                if !p.shares_pages() {
                    return None;
                }
                Some(
                    p.kernel_text_template_missing(REQUEST_TIMEOUT)
                        .map_err(|e| GuestVmError::Process(e.to_string())),
                )
            }
            Vm::Qemu(_) => None,
        }
    }

    /// Captures the kernel text template from this VM (one that saw no pod input).
    pub(super) fn capture_kernel_text(&self) -> Result<bool, GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.capture_kernel_text()?),
            Vm::Process(_) => Err(GuestVmError::Unsupported(
                "capturing the kernel text in a VMM process (the capture VM runs in the shim)",
            )),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "page sharing on the QEMU backend",
            )),
        }
    }

    /// Stops the guest (bounded) and waits for it to end.
    pub(super) fn stop(&mut self) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => {
                h.stop();
                match h.wait() {
                    Ok(_) | Err(vmm::VmmError::AlreadyWaited) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            Vm::Process(p) => {
                let end = lock(p).stop(STOP_TIMEOUT);
                if end.said.is_none() && end.exit != Err(libc::SIGKILL) {
                    log::warn!("stopping the VMM process: {}", end.describe());
                }
                Ok(())
            }
            Vm::Qemu(vm) => vm.stop().map(drop).map_err(Into::into),
        }
    }
}

/// How long a request to a VMM process (disk attach, detach) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a page sharing pass in a VMM process may take.
const SHARING_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a VMM process may take to stop before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a VMM process's VM ended. A seccomp kill is logged as the doc says (the line of the
/// VMM's report handler is in the log just before).
fn process_end(end: &vmm::jail::split::VmmEnd) -> EndReason {
    use vmm::jail::channel::EndKind;
    if end.by_seccomp() {
        log::error!("{}", end.describe());
    }
    match (&end.said, end.exit) {
        (Some((EndKind::Reset, _)), Ok(_)) => EndReason::GuestReset,
        (Some((EndKind::Stopped, _)), Ok(_)) => EndReason::Stopped,
        _ => EndReason::Lost(end.describe()),
    }
}
