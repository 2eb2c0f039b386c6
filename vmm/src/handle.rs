//! The running VM as its owner sees it: wait for the end, stop it, read facts about it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_devices::bus::lock;
use vmm_devices::virtio::balloon::Balloon;
use vmm_devices::virtio::block::Block;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::Killable;

use crate::kick::kick_signal;
use crate::kvm_vm::KvmVm;
use crate::memory::GuestMemory;
use crate::page_sharing::{PageSharingError, SharingReport, VmSharing};
use crate::pause::PauseGate;
use crate::{VmExit, VmmError};

/// How long a sharing pass waits for the VM's threads to pause.
const SHARING_PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long teardown keeps kicking a vCPU thread before giving up on it (it is then detached).
const KICK_LIMIT: Duration = Duration::from_secs(5);
const KICK_INTERVAL: Duration = Duration::from_millis(2);

/// State shared by the handle, the vCPU threads and the event loop.
pub(crate) struct Shared {
    stop: AtomicBool,
    outcome: Mutex<Outcome>,
    ended: Condvar,
    /// Wakes the event loop when the VM ends (and when a pause is asked for).
    pub(crate) exit_evt: EventFd,
    /// Where the VM's threads park during [`VmHandle::with_paused`].
    pub(crate) pause: PauseGate,
}

enum Outcome {
    Running,
    Ended(Result<VmExit, VmmError>),
    Taken,
}

impl Shared {
    pub(crate) fn new() -> Result<Self, VmmError> {
        Ok(Self {
            stop: AtomicBool::new(false),
            outcome: Mutex::new(Outcome::Running),
            ended: Condvar::new(),
            exit_evt: EventFd::new(libc::EFD_NONBLOCK)
                .map_err(VmmError::io("create an eventfd"))?,
            pause: PauseGate::new(),
        })
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Records how the VM ended (the first reason wins) and asks every thread to stop.
    pub(crate) fn finish(&self, result: Result<VmExit, VmmError>) {
        {
            let mut o = lock(&self.outcome);
            if matches!(*o, Outcome::Running) {
                *o = Outcome::Ended(result);
            }
        }
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.exit_evt.write(1) {
            log::warn!("cannot wake the event loop: {e}");
        }
        self.pause.wake_all();
        self.ended.notify_all();
    }

    /// The pause point of a VM thread (vCPU or device loop): parks it while a pause is asked
    /// for and the VM is not stopping. True if it parked.
    pub(crate) fn pause_point(&self) -> bool {
        if !self.pause.requested() {
            return false;
        }
        self.pause.park(|| self.stopping());
        true
    }

    fn is_ended(&self) -> bool {
        !matches!(*lock(&self.outcome), Outcome::Running)
    }
}

/// The threads and resources of a running VM, released by teardown.
pub(crate) struct Running {
    pub(crate) vcpu_threads: Vec<JoinHandle<()>>,
    pub(crate) event_thread: Option<JoinHandle<()>>,
    /// Kept alive until the threads are gone (memory slots point into `mem`).
    pub(crate) vm: Option<KvmVm>,
    pub(crate) mem: Option<GuestMemory>,
}

impl Running {
    /// Ends every thread (kicking vCPUs out of KVM_RUN), joins them, closes the VM.
    fn teardown(mut self, shared: &Shared) {
        shared.stop.store(true, Ordering::SeqCst);
        let _ = shared.exit_evt.write(1);
        shared.pause.wake_all();
        for t in self.vcpu_threads.drain(..) {
            let started = Instant::now();
            while !t.is_finished() {
                if started.elapsed() > KICK_LIMIT {
                    log::error!("a vCPU thread does not stop; leaving it detached");
                    break;
                }
                if let Err(e) = t.kill(kick_signal()) {
                    log::debug!("kick failed: {e}");
                }
                std::thread::sleep(KICK_INTERVAL);
            }
            if t.is_finished() && t.join().is_err() {
                log::error!("a vCPU thread panicked");
            }
        }
        if let Some(t) = self.event_thread.take() {
            if t.join().is_err() {
                log::error!("the device event-loop thread panicked");
            }
        }
        // vCPU fds are closed by their threads; now the VM and its memory (the devices go
        // right after, in VmHandle::teardown).
        drop(self.vm.take());
        drop(self.mem.take());
    }
}

/// The devices a [`VmHandle`] works on after the start.
pub(crate) struct HandleDevices {
    /// The disk slots, in `VmConfig::blocks` order.
    pub(crate) blocks: Vec<Arc<Mutex<Block>>>,
    /// The balloon, if the VM has one.
    pub(crate) balloon: Option<Arc<Mutex<Balloon>>>,
    /// Page sharing, if on.
    pub(crate) page_sharing: Option<Mutex<VmSharing>>,
    /// With the jail on: the filter a sharing pass's own thread installs.
    pub(crate) sharing_filter: Option<crate::jail::ThreadFilter>,
    /// Set by [`VmHandle::keep_devices_after_end`]: the buses stay until the handle drops.
    pub(crate) keep_buses: std::sync::atomic::AtomicBool,
    /// The port and MMIO buses, which hold every device: their last references, dropped by
    /// teardown after the VM's threads are joined, so that no device is dropped on a confined
    /// thread (a vsock device removes its socket file when dropped).
    pub(crate) buses: Mutex<Vec<Arc<vmm_devices::bus::Bus>>>,
}

/// A running VM. Dropping it stops the VM and releases everything.
pub struct VmHandle {
    pub(crate) shared: Arc<Shared>,
    pub(crate) running: Mutex<Option<Running>>,
    // Boxed slices rather than Vec/String/PathBuf: the shim keeps the handle inline in an enum
    // (clippy's large_enum_variant), so the handle stays at its old size.
    pub(crate) vsock_uds_path: Option<Box<Path>>,
    /// The devices the handle reaches while the VM runs (one pointer, for the same reason).
    pub(crate) devices: Box<HandleDevices>,
    pub(crate) boot_time: Duration,
    pub(crate) started_at: Instant,
    pub(crate) vcpus: u8,
    pub(crate) memory_mib: u64,
    pub(crate) cmdline: Box<str>,
    pub(crate) entry: crate::regs::EntryMode,
}

impl VmHandle {
    /// Blocks until the VM has ended and every thread is joined and fd closed; returns how it
    /// ended. A second call returns [`VmmError::AlreadyWaited`].
    pub fn wait(&self) -> Result<VmExit, VmmError> {
        {
            let mut o = lock(&self.shared.outcome);
            while matches!(*o, Outcome::Running) {
                o = self.shared.ended.wait(o).unwrap_or_else(|e| e.into_inner());
            }
        }
        self.reap()
    }

    /// Like [`VmHandle::wait`], but gives up after `timeout` (returning `None`; the VM keeps
    /// running).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<VmExit, VmmError>> {
        let deadline = Instant::now() + timeout;
        {
            let mut o = lock(&self.shared.outcome);
            while matches!(*o, Outcome::Running) {
                let now = Instant::now();
                if now >= deadline {
                    return None;
                }
                o = self
                    .shared
                    .ended
                    .wait_timeout(o, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Some(self.reap())
    }

    /// Waits up to `timeout` for the VM to end; past it, stops the VM, collects it and returns
    /// [`VmmError::TimedOut`].
    pub fn wait_or_stop(&self, timeout: Duration) -> Result<VmExit, VmmError> {
        match self.wait_timeout(timeout) {
            Some(r) => r,
            None => {
                self.stop();
                let _ = self.wait();
                Err(VmmError::TimedOut(timeout))
            }
        }
    }

    /// Asks the VM to end; [`VmHandle::wait`] then returns [`VmExit::Stopped`] (unless it had
    /// already ended another way).
    pub fn stop(&self) {
        self.shared.finish(Ok(VmExit::Stopped));
    }

    /// Whether the VM has ended (its result may not have been collected yet).
    pub fn has_ended(&self) -> bool {
        self.shared.is_ended()
    }

    /// The host Unix socket of the hybrid vsock device, if the VM has one.
    pub fn vsock_uds_path(&self) -> Option<&Path> {
        self.vsock_uds_path.as_deref()
    }

    /// Fills empty slot `index` (of `VmConfig::blocks`) with `file`: the capacity and serial
    /// change and the guest gets a config-change interrupt (it sees the new size). The slot
    /// keeps its boot-time read-only mode; open `file` O_RDONLY for a read-only slot.
    ///
    /// The device's lock is taken between two batches of requests of the device thread, so the
    /// change never lands in the middle of a request; it blocks while a batch runs (synchronous
    /// disk I/O): from async code, call it on a blocking thread (`spawn_blocking`).
    pub fn attach_block(
        &self,
        index: usize,
        serial: String,
        file: std::fs::File,
    ) -> Result<(), VmmError> {
        lock(self.block(index)?)
            .attach(serial, file)
            .map_err(|source| VmmError::Block { index, source })
    }

    /// Empties slot `index` (capacity 0, config change); in-flight requests finish first, and
    /// the file's data is made durable (fdatasync) before it is closed.
    pub fn detach_block(&self, index: usize) -> Result<(), VmmError> {
        lock(self.block(index)?)
            .detach()
            .map_err(|source| VmmError::Block { index, source })
    }

    /// The capacity of disk slot `index` in 512-byte sectors (0 when empty).
    pub fn block_capacity(&self, index: usize) -> Result<u64, VmmError> {
        Ok(lock(self.block(index)?).capacity())
    }

    /// What disk slot `index` did so far (requests, bytes, errors).
    pub fn block_stats(&self, index: usize) -> Result<crate::BlockStats, VmmError> {
        Ok(lock(self.block(index)?).stats())
    }

    /// What the balloon did so far (free page reports and the bytes dropped), if the VM has one.
    pub fn balloon_stats(&self) -> Option<crate::BalloonStats> {
        self.devices
            .balloon
            .as_ref()
            .map(|b| lock(b.as_ref()).stats())
    }

    fn block(&self, index: usize) -> Result<&Mutex<Block>, VmmError> {
        self.devices
            .blocks
            .get(index)
            .map(|b| &**b)
            .ok_or(VmmError::NoBlockSlot {
                index,
                count: self.devices.blocks.len(),
            })
    }

    /// Holds every vCPU outside KVM_RUN and the device thread between two batches of work
    /// (vmm/src/pause.rs), runs `f` on guest memory, then lets them continue. The VM's state is
    /// not touched. Waits at most `timeout` for the threads to park; a VM that ends meanwhile
    /// gives an error, never a hang. Teardown waits for `f` to return.
    pub fn with_paused<R>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&GuestMemory) -> R,
    ) -> Result<R, VmmError> {
        let running = lock(&self.running);
        let Some(r) = running.as_ref() else {
            return Err(VmmError::Pause(crate::pause::PauseError::Ended));
        };
        let Some(mem) = r.mem.as_ref() else {
            return Err(VmmError::Pause(crate::pause::PauseError::Ended));
        };
        let threads = r.vcpu_threads.len() + usize::from(r.event_thread.is_some());
        let kick = || {
            for t in &r.vcpu_threads {
                if !t.is_finished() {
                    if let Err(e) = t.kill(kick_signal()) {
                        log::debug!("pause: kick failed: {e}");
                    }
                }
            }
            if let Err(e) = self.shared.exit_evt.write(1) {
                log::debug!("pause: cannot wake the event loop: {e}");
            }
        };
        let _paused = self
            .shared
            .pause
            .pause(threads, kick, || self.shared.stopping(), timeout)?;
        Ok(f(mem))
    }

    /// One page sharing pass (docs/page-sharing.md): with every vCPU and the device thread
    /// paused, drops the guest's all-zero private pages and maps pages equal to a public
    /// template page from the template file (the first pass after boot of a host also captures
    /// the kernel text template). Call it once the guest is up (the agent answered), before any
    /// workload; it may be called again. Fails for a VM without page sharing.
    ///
    /// With the jail on, the pass runs on a thread of its own under the page sharing filter
    /// ([`crate::jail::Role::PageSharing`]): it reads guest memory, and the caller's thread is
    /// the embedder's, which stays unfiltered.
    pub fn share_pages(&self) -> Result<SharingReport, VmmError> {
        let Some(filter) = self.devices.sharing_filter.as_ref() else {
            return self.sharing_pass();
        };
        std::thread::scope(|scope| {
            let pass = std::thread::Builder::new()
                .name("vmm-sharing".into())
                .spawn_scoped(scope, || {
                    filter.install()?;
                    self.sharing_pass()
                })
                .map_err(VmmError::io("spawn the page sharing thread"))?;
            pass.join().unwrap_or_else(|_| {
                Err(VmmError::Device("the page sharing thread panicked".into()))
            })
        })
    }

    /// The page sharing filter of this VM (with the jail on and page sharing configured), for
    /// a thread that serves page sharing passes only: it installs the filter once and then
    /// calls [`VmHandle::share_pages_on_this_thread`] ([`crate::jail::split`], whose control
    /// thread is filtered and cannot start the pass thread of [`VmHandle::share_pages`]).
    pub fn sharing_filter(&self) -> Option<&crate::jail::ThreadFilter> {
        self.devices.sharing_filter.as_ref()
    }

    /// One page sharing pass on the calling thread, which has installed
    /// [`VmHandle::sharing_filter`] (or is the embedder's own).
    pub fn share_pages_on_this_thread(&self) -> Result<SharingReport, VmmError> {
        self.sharing_pass()
    }

    fn sharing_pass(&self) -> Result<SharingReport, VmmError> {
        let started = Instant::now();
        let Some(sharing) = self.devices.page_sharing.as_ref() else {
            return Err(PageSharingError::Off.into());
        };
        let mut sharing = lock(sharing);
        let (capture, missing) = sharing.prepare()?;
        let result = self.with_paused(SHARING_PAUSE_TIMEOUT, |mem| {
            sharing.paused_pass(mem, capture.as_deref(), missing)
        });
        // The templates are unmapped from the VMM between passes (a later pass maps them
        // again): mapped, their pages would count in this process's memory for nothing.
        sharing.index = None;
        let mut report = result??;
        report.took = started.elapsed();
        log::info!("page sharing: {report}");
        Ok(report)
    }

    /// Whether this VM's kernel text template is still to be captured: neither its domain's
    /// template directory nor the captures hold it (docs/page-sharing.md). A pod's VM never
    /// captures it; the caller boots a VM that has seen no pod input and calls
    /// [`VmHandle::capture_kernel_text`] on it.
    pub fn kernel_text_template_missing(&self) -> Result<bool, VmmError> {
        let Some(sharing) = self.devices.page_sharing.as_ref() else {
            return Err(PageSharingError::Off.into());
        };
        Ok(lock(sharing).kernel_text_missing()?)
    }

    /// Captures this VM's kernel text as the template every domain copies, if none was
    /// captured yet, and nothing else (no sharing pass): for a VM started with
    /// `capture_kernel_text` that has seen no pod input, once its guest is up. Returns whether
    /// it captured.
    pub fn capture_kernel_text(&self) -> Result<bool, VmmError> {
        let Some(sharing) = self.devices.page_sharing.as_ref() else {
            return Err(PageSharingError::Off.into());
        };
        let mut sharing = lock(sharing);
        let Some(name) = sharing.capture_name()? else {
            return Ok(false);
        };
        let captured = self.with_paused(SHARING_PAUSE_TIMEOUT, |mem| {
            sharing.capture_kernel_text(mem, &name)
        })??;
        if captured {
            log::info!("page sharing: captured the kernel text template {name}");
        }
        Ok(captured)
    }

    /// How long `Vm::start` took, from its call to the vCPU threads running.
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// When `Vm::start` was called.
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// The number of vCPUs.
    pub fn vcpus(&self) -> u8 {
        self.vcpus
    }

    /// Guest RAM in MiB.
    pub fn memory_mib(&self) -> u64 {
        self.memory_mib
    }

    /// The full kernel command line the guest got (the user's part plus device arguments).
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// "linux64" or "pvh": the entry protocol used.
    pub fn boot_entry(&self) -> &'static str {
        match self.entry {
            crate::regs::EntryMode::Long64 => "linux64",
            crate::regs::EntryMode::Pvh32 => "pvh",
        }
    }

    fn teardown(&self) {
        if let Some(r) = lock(&self.running).take() {
            r.teardown(&self.shared);
        }
        if !self.devices.keep_buses.load(Ordering::SeqCst) {
            lock(&self.devices.buses).clear();
        }
    }

    /// Keeps the devices when the VM is waited for (they go when the handle drops): for an
    /// embedder whose waiting thread is confined (the VMM process's control thread), since a
    /// device dropped may touch the host (a vsock device removes its socket file).
    pub fn keep_devices_after_end(&self) {
        self.devices.keep_buses.store(true, Ordering::SeqCst);
    }

    fn reap(&self) -> Result<VmExit, VmmError> {
        self.teardown();
        let mut o = lock(&self.shared.outcome);
        match std::mem::replace(&mut *o, Outcome::Taken) {
            Outcome::Ended(r) => r,
            Outcome::Taken => Err(VmmError::AlreadyWaited),
            Outcome::Running => unreachable!("reap runs after the VM ended"),
        }
    }
}

impl Drop for VmHandle {
    fn drop(&mut self) {
        self.shared.finish(Ok(VmExit::Stopped));
        self.teardown();
    }
}

/// Builds the handle while the VM is being set up: on an error, dropping it tears down whatever
/// threads were already started.
pub(crate) fn new_running() -> Running {
    Running {
        vcpu_threads: Vec::new(),
        event_thread: None,
        vm: None,
        mem: None,
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Normal teardown drains everything first; this only matters on a failed start.
        if !self.vcpu_threads.is_empty() || self.event_thread.is_some() {
            log::debug!("releasing a partly started VM");
        }
    }
}

/// Tears down a partly started VM (used when `Vm::start` fails half-way).
pub(crate) fn abort_start(running: Running, shared: &Shared, err: VmmError) -> VmmError {
    shared.finish(Err(VmmError::Config("start aborted".into())));
    running.teardown(shared);
    err
}
