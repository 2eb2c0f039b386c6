//! The virtio-fs device: a high-priority queue and [`NUM_REQUEST_QUEUES`] request queues served
//! by one FUSE server over a passthrough file system.
//!
//! Each pass over a queue handles at most one queue's worth of chains, then re-signals itself,
//! so a guest that keeps the queue full cannot hold the event loop.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuse_backend_rs::api::filesystem::FileSystem;
use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::passthrough::{Config, PassthroughFs};

use super::policy::{self, HostPolicy};
use super::request::{handle_request, FsServer};
use super::{validate_tag, FsError, CONFIG_SIZE, NUM_REQUEST_QUEUES, QUEUE_SIZE, TAG_MAX_LEN};
use crate::virtio::device_state::DeviceState;
use crate::virtio::read_config_bytes;
use crate::virtio::{device_type, VirtioDevice, VIRTIO_F_VERSION_1};

/// Number of queues: the high-priority queue plus the request queues.
const NUM_QUEUES: usize = 1 + NUM_REQUEST_QUEUES as usize;
const QUEUE_SIZES: [u16; NUM_QUEUES] = [QUEUE_SIZE; NUM_QUEUES];

/// Counters of what the device did (for tests and diagnostics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    /// Requests served by the FUSE server (including its error replies).
    pub served: u64,
    /// Requests rejected before the server, answered with `EINVAL`.
    pub rejected_answered: u64,
    /// Requests returned unanswered (unusable chain, or the server could not reply).
    pub dropped: u64,
    /// Requests the host-safety policy refused with `EPERM` (counted in `served` too: they
    /// got a reply). See [`policy`].
    pub refused_by_policy: u64,
}

/// The virtio-fs device sharing one host directory.
pub struct VirtioFs {
    tag: String,
    host_dir: PathBuf,
    config: [u8; CONFIG_SIZE],
    state: DeviceState,
    /// The file server, once [`VirtioFs::open_backend`] made it (its root and `/proc/self/fd`
    /// are opened then, by path: in a jailed VMM, after the jail, so that every descriptor it
    /// holds lies inside the process's root).
    backend: Option<Backend>,
    stats: FsStats,
}

struct Backend {
    fs: Arc<HostPolicy<PassthroughFs<()>>>,
    server: FsServer,
}

impl VirtioFs {
    /// A device exporting `host_dir` under `tag` (what the guest passes to `mount -t virtiofs`),
    /// its file server opened at once.
    pub fn new(tag: &str, host_dir: &Path) -> Result<Self, FsError> {
        let mut dev = Self::without_backend(tag, host_dir)?;
        dev.open_backend()?;
        Ok(dev)
    }

    /// A device exporting `host_dir` under `tag` whose file server is not opened yet: the
    /// embedder calls [`VirtioFs::open_backend`] before any thread can serve a queue (a jailed
    /// VMM after its jail, where `host_dir` is the share's path inside its root). `host_dir` is
    /// checked here; until then, requests are left unanswered.
    pub fn without_backend(tag: &str, host_dir: &Path) -> Result<Self, FsError> {
        validate_tag(tag)?;
        let host_err = |reason: String| FsError::HostDir {
            path: host_dir.to_owned(),
            reason,
        };
        let meta = std::fs::metadata(host_dir).map_err(|e| host_err(e.to_string()))?;
        if !meta.is_dir() {
            return Err(host_err("not a directory".into()));
        }
        std::fs::read_dir(host_dir).map_err(|e| host_err(format!("cannot be read: {e}")))?;
        host_dir
            .to_str()
            .filter(|s| !s.contains('\0'))
            .ok_or_else(|| host_err("the path is not valid UTF-8".into()))?;
        let state = DeviceState::new(
            "virtio-fs",
            device_type::FS,
            1 << VIRTIO_F_VERSION_1,
            &QUEUE_SIZES,
        )
        .map_err(FsError::EventFd)?;
        let mut config = [0u8; CONFIG_SIZE];
        config[..tag.len()].copy_from_slice(tag.as_bytes());
        config[TAG_MAX_LEN..].copy_from_slice(&NUM_REQUEST_QUEUES.to_le_bytes());
        Ok(Self {
            tag: tag.to_owned(),
            host_dir: host_dir.to_owned(),
            config,
            state,
            backend: None,
            stats: FsStats::default(),
        })
    }

    /// Makes the file server (once; again is a no-op): it opens `/proc/self/fd` now, from the
    /// procfs this process sees now, and the root (`host_dir`, by path) at the guest's INIT.
    pub fn open_backend(&mut self) -> Result<(), FsError> {
        if self.backend.is_some() {
            return Ok(());
        }
        let backend_err = |source| FsError::Backend {
            path: self.host_dir.clone(),
            source,
        };
        let root_dir = self
            .host_dir
            .to_str()
            .ok_or_else(|| backend_err(std::io::Error::other("the path is not valid UTF-8")))?
            .to_owned();
        let cfg = Config {
            root_dir,
            // The root inode is imported by the guest's INIT (and again after a reset).
            do_import: true,
            xattr: false,
            ..Default::default()
        };
        let passthrough = PassthroughFs::<()>::new(cfg).map_err(backend_err)?;
        let fs = Arc::new(HostPolicy::new(passthrough));
        let server = Server::new(fs.clone());
        self.backend = Some(Backend { fs, server });
        Ok(())
    }

    /// The tag the guest mounts.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The shared host directory.
    pub fn host_dir(&self) -> &Path {
        &self.host_dir
    }

    /// What the device has done so far.
    pub fn stats(&self) -> FsStats {
        FsStats {
            refused_by_policy: self.backend.as_ref().map_or(0, |b| b.fs.refused()),
            ..self.stats
        }
    }

    /// Serves the available chains of `queue` (at most one queue's worth per call). The first
    /// call on a thread gives the thread a umask of its own and drops its capabilities to make
    /// device nodes, file capabilities and kept set-ID bits (see
    /// [`policy::confine_serving_thread`]).
    pub fn process_queue(&mut self, queue: usize) {
        if let Err(e) = policy::confine_serving_thread() {
            log::warn!("virtio-fs: {e}");
        }
        let Some(backend) = &self.backend else {
            log::warn!("virtio-fs: queue {queue} served before the file server was opened");
            return;
        };
        let (server, stats) = (&backend.server, &mut self.stats);
        self.state.serve_queue(queue, |mem, chain| {
            let head = chain.head_index();
            let outcome = handle_request(server, mem, chain);
            match &outcome.rejected {
                None => stats.served += 1,
                Some(e) => {
                    log::debug!("virtio-fs: queue {queue} request {head}: {e}");
                    if outcome.used_len > 0 {
                        stats.rejected_answered += 1;
                    } else {
                        stats.dropped += 1;
                    }
                }
            }
            outcome.used_len
        });
    }

    /// The queue eventfd of `queue` was signalled: consume it and serve the queue.
    pub fn process_queue_event(&mut self, queue: usize) {
        if self.state.consume_queue_event(queue) {
            self.process_queue(queue);
        }
    }
}

impl VirtioDevice for VirtioFs {
    fn state(&self) -> &DeviceState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn on_reset(&mut self) {
        // Forget the guest's inodes and open handles; the next INIT starts afresh.
        if let Some(b) = &self.backend {
            b.fs.destroy();
        }
    }
}
