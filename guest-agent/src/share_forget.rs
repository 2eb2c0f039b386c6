//! Letting go of a removed container's files in the shared directory.
//!
//! The host serves the shared directory over virtio-fs holding one file (an `O_PATH` fd) for
//! every inode the guest kernel knows, until the guest sends FORGET for it (virtiofsd and the
//! embedded VMM's device alike). The kernel forgets an inode only when it evicts it, and it keeps
//! unused dentries and inodes cached until memory runs short: so after a container was removed
//! (the shim takes its rootfs out of the share right after RemoveContainer) the host went on
//! holding a file for each of its files the guest had looked up, and with them the container's
//! unmounted overlay, about two dozen files per busybox container, without end in a pod whose
//! containers come and go (the soak test saw virtiofsd's fds grow by 24 a cycle).
//!
//! So the agent looks each removed container's directory up again once the host has removed
//! it (and the directory of each volume with propagation no container uses any more, which the
//! host shares at `.volumes/<key>`, [`crate::volumes`]): FUSE revalidates the cached dentry (its entry timeout passed), the host answers ENOENT,
//! the kernel invalidates the dentry and prunes the subtree under it, evicting its unused
//! inodes, and FORGETs them; the host closes their files. A thread does it every
//! [`INTERVAL`] for the directories still pending, at most [`MAX_PENDING`] of them, each for at
//! most [`GIVE_UP`].

use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agent_protocol::GUEST_SHARED_DIR;

/// How often pending directories are looked up again (above virtio-fs's entry timeouts).
const INTERVAL: Duration = Duration::from_secs(2);
/// Directories waiting at most; the oldest is dropped for a new one beyond.
const MAX_PENDING: usize = 1024;
/// How long a directory the host has not removed is looked up before the agent gives up.
const GIVE_UP: Duration = Duration::from_secs(600);

static PENDING: Mutex<VecDeque<(PathBuf, Instant)>> = Mutex::new(VecDeque::new());

/// Container `id` was removed: its directory in the share is to be forgotten once the host
/// removed it.
pub fn removed(id: &str) {
    unused(PathBuf::from(GUEST_SHARED_DIR).join(id));
}

/// Directory `dir` of the share is no longer used: it is to be forgotten once the host removed
/// it. A path outside the share is none of this module's business.
pub fn unused(dir: PathBuf) {
    if !dir.starts_with(GUEST_SHARED_DIR) {
        return;
    }
    let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    if pending.len() >= MAX_PENDING {
        pending.pop_front();
    }
    pending.push_back((dir, Instant::now()));
}

/// Starts the thread that looks pending directories up again.
pub fn spawn() -> io::Result<()> {
    std::thread::Builder::new()
        .name("share-forget".into())
        .spawn(|| loop {
            std::thread::sleep(INTERVAL);
            look_again();
        })
        .map(|_| ())
}

/// One round: every pending directory looked up; the gone ones (and those past [`GIVE_UP`])
/// leave the list.
fn look_again() {
    let due: Vec<(PathBuf, Instant)> = PENDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
        .collect();
    let mut kept = Vec::new();
    for (dir, since) in due {
        match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                log::debug!("{}: gone from the share, forgotten", dir.display());
            }
            Err(e) => log::debug!("{}: {e}; not looked up again", dir.display()),
            Ok(_) if since.elapsed() > GIVE_UP => {
                log::info!("{}: still in the share after {GIVE_UP:?}", dir.display());
            }
            Ok(_) => kept.push((dir, since)),
        }
    }
    let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    for entry in kept.into_iter().rev() {
        pending.push_front(entry);
    }
    while pending.len() > MAX_PENDING {
        pending.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pending_list_is_bounded_and_a_missing_directory_leaves_it() {
        for i in 0..(MAX_PENDING + 10) {
            removed(&format!("c{i}"));
        }
        // Only the share's directories are looked up again.
        unused(PathBuf::from("/etc"));
        let len = PENDING.lock().unwrap().len();
        assert_eq!(len, MAX_PENDING);
        // No share here: every directory is missing, so one round empties the list.
        look_again();
        assert!(PENDING.lock().unwrap().is_empty());
    }
}
