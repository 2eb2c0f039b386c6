//! A pod's on-disk state: `/run/microvm/<pod-id>/` (root overridable with `MICROVM_STATE_ROOT`).
//!
//! It holds what a cleanup needs when the shim is gone (`kill -9`): the shim's pid, the pids of
//! the VM's host processes (each with its start time, so a recycled pid is never killed), the
//! VM's work folder (sockets, console log) and the pod's shared folder
//! ([`crate::resources::storage`]). `containerd-shim-microvm-v1 delete` runs
//! [`StateDir::cleanup`] from these files alone. The mounts to undo are whatever the kernel's
//! mount table shows under the directory; each is reached from the directory's descriptor
//! without following a symlink ([`crate::host_fs`]), so nothing a guest planted in its share
//! can turn an unmount or a removal towards the rest of the host.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::host_fs;

/// Environment variable that moves the state root (tests use it).
pub const STATE_ROOT_ENV: &str = "MICROVM_STATE_ROOT";
/// Where pods' state lives by default.
pub const DEFAULT_STATE_ROOT: &str = "/run/microvm";

const SHIM_PID_FILE: &str = "shim.pid";
const VM_PIDS_FILE: &str = "vm.pids";
const SOCKET_FILE: &str = "socket";
/// The block slot record of resources/devices, in the pod's directory.
pub const DEVICES_RECORD_FILE: &str = "devices.json";
/// How long a cleanup waits for a killed process to go.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How many passes over the mount table a cleanup makes (a pass detaches what it finds; the
/// pod's share goes with every mount under it in one).
const UNMOUNT_PASSES: usize = 4;

/// Why an undo record (the host resources' `network.json`, `cgroup.json`, `devices.json`) could
/// not be read, written or removed; names the file.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{action} undo record {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("undo record {}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// Reads the undo record at `path` (JSON); `None` when there is none.
pub fn read_record<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, RecordError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(RecordError::Io {
                action: "reading",
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| RecordError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// Writes the undo record at `path`: whole to `<path>.tmp`, synced, then renamed, so a crash
/// leaves the old record or the new one, never half of one.
pub fn write_record<T: serde::Serialize>(path: &Path, record: &T) -> Result<(), RecordError> {
    let io_err = |source| RecordError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source,
    };
    let json = serde_json::to_vec_pretty(record).map_err(|source| RecordError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = fs::File::create(&tmp).map_err(io_err)?;
        f.write_all(&json).map_err(io_err)?;
        f.sync_all().map_err(io_err)?;
    }
    fs::rename(&tmp, path).map_err(io_err)
}

/// Removes the undo record at `path`; one that is already gone is fine.
pub fn remove_record(path: &Path) -> Result<(), RecordError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RecordError::Io {
            action: "removing",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The state root: `MICROVM_STATE_ROOT`, else `/run/microvm`.
pub fn state_root() -> PathBuf {
    std::env::var_os(STATE_ROOT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_ROOT))
}

/// Errors of the state directory; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("invalid pod id {0:?} for a state directory")]
    BadId(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a cleanup did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Recorded VM processes that were still running and got SIGKILL.
    pub killed: Vec<u32>,
    /// Mount points unmounted.
    pub unmounted: Vec<PathBuf>,
    /// Whether the directory existed and was removed.
    pub removed: bool,
}

/// A state directory's reclaim lock, held until dropped (the kernel drops it with the process).
#[derive(Debug)]
pub struct StateLock {
    _dir: fs::File,
}

/// One pod's state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    path: PathBuf,
}

impl StateDir {
    /// The state directory of pod `id` under `root` (not created).
    pub fn new(root: &Path, id: &str) -> Result<StateDir, StateError> {
        let ok = !id.is_empty()
            && id.len() <= 76
            && id != "."
            && id != ".."
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok {
            return Err(StateError::BadId(id.to_string()));
        }
        Ok(StateDir {
            path: root.join(id),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The VM's work folder (its sockets and console log).
    pub fn vm_dir(&self) -> PathBuf {
        self.path.join("vm")
    }

    /// The pod network's undo record (resources/network/record.rs): written before the taps and
    /// filters are made, read by teardown, also from `<shim> delete` after a crash.
    pub fn network_record(&self) -> PathBuf {
        self.path.join("network.json")
    }

    /// The pod's host cgroup's undo record (resources/cgroup): written before the cgroup is
    /// made, read by teardown, also from `<shim> delete` after a crash.
    pub fn cgroup_record(&self) -> PathBuf {
        self.path.join("cgroup.json")
    }

    /// Which block slot holds which container's device (resources/devices): rewritten after
    /// every change.
    pub fn devices_record(&self) -> PathBuf {
        self.path.join(DEVICES_RECORD_FILE)
    }

    /// The folder shared with the guest.
    pub fn shared_dir(&self) -> PathBuf {
        self.path.join("shared")
    }

    /// Creates the directory (mode 0700) and records `shim_pid` as the pod's shim.
    pub fn create(&self, shim_pid: u32) -> Result<(), StateError> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.path)
            .map_err(io_err(&self.path))?;
        let file = self.path.join(SHIM_PID_FILE);
        fs::write(&file, record_line(shim_pid)).map_err(io_err(&file))
    }

    /// Records the shim's ttrpc socket address, for a sweep that finds the pod after its shim
    /// died and nobody ran `<shim> delete` ([`crate::sandbox::reclaim`]).
    pub fn record_socket(&self, address: &str) -> Result<(), StateError> {
        let file = self.path.join(SOCKET_FILE);
        fs::write(&file, address).map_err(io_err(&file))
    }

    /// The shim's socket address as recorded, if any.
    pub fn socket_address(&self) -> Option<String> {
        fs::read_to_string(self.path.join(SOCKET_FILE))
            .ok()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
    }

    /// Whether the directory names its shim (a directory without one is being created).
    pub fn has_shim_record(&self) -> bool {
        !read_records(&self.path.join(SHIM_PID_FILE)).is_empty()
    }

    /// Takes the directory's reclaim lock (an exclusive `flock` on the directory), waiting for
    /// a reclaim already under way; `None` when the directory is gone, before or after the
    /// wait (whoever held the lock cleaned it up).
    pub fn lock(&self) -> Result<Option<StateLock>, StateError> {
        self.lock_with(|f| f.lock().map(|()| true))
    }

    /// As [`lock`](Self::lock), without waiting: `None` also when someone holds it.
    pub fn try_lock(&self) -> Result<Option<StateLock>, StateError> {
        self.lock_with(|f| match f.try_lock() {
            Ok(()) => Ok(true),
            Err(fs::TryLockError::WouldBlock) => Ok(false),
            Err(fs::TryLockError::Error(e)) => Err(e),
        })
    }

    fn lock_with(
        &self,
        take: impl FnOnce(&fs::File) -> io::Result<bool>,
    ) -> Result<Option<StateLock>, StateError> {
        let dir = match fs::File::open(&self.path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&self.path)(e)),
        };
        if !take(&dir).map_err(io_err(&self.path))? || !self.path.exists() {
            return Ok(None);
        }
        Ok(Some(StateLock { _dir: dir }))
    }

    /// Records the VM's host processes (replacing an earlier record).
    pub fn record_vm_processes(&self, pids: &[u32]) -> Result<(), StateError> {
        let file = self.path.join(VM_PIDS_FILE);
        let text: String = pids.iter().map(|&p| record_line(p)).collect();
        fs::write(&file, text).map_err(io_err(&file))
    }

    /// Whether the shim recorded in the directory still runs: a shim that is exiting (killed,
    /// its threads gone or going) does not, even while its listening socket, released last,
    /// still takes connections for some milliseconds.
    pub fn shim_alive(&self) -> bool {
        read_records(&self.path.join(SHIM_PID_FILE))
            .into_iter()
            .any(|(pid, start)| {
                ProcStat::read(pid)
                    .is_some_and(|s| s.is_live() && s.start_time == start && !s.is_exiting())
            })
    }

    /// SIGKILLs the recorded VM processes that still run (a recycled pid is left alone) and
    /// waits (bounded) for each to go; returns the pids killed. The host cgroup's release runs
    /// after this and before [`cleanup`](Self::cleanup), which removes its record.
    pub fn kill_vm_processes(&self) -> Vec<u32> {
        read_records(&self.path.join(VM_PIDS_FILE))
            .into_iter()
            .filter(|&(pid, start)| kill_if_same(pid, start))
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Kills the recorded VM processes that still run, detaches what is mounted under the
    /// directory, and removes the directory. Safe to run twice and on a directory that does not
    /// exist. The directory is removed only once nothing is mounted under it.
    pub fn cleanup(&self) -> Result<CleanupReport, StateError> {
        let mut report = CleanupReport::default();
        if !self.path.exists() {
            return Ok(report);
        }
        report.killed = self.kill_vm_processes();
        report.unmounted = self.unmount_all()?;
        let remaining = mounts_under(&self.path);
        if let Some(m) = remaining.first() {
            return Err(StateError::Io {
                path: m.clone(),
                source: io::Error::other("still mounted after cleanup"),
            });
        }
        // std's remove_dir_all never follows a symlink, and nothing is mounted under it now.
        fs::remove_dir_all(&self.path).map_err(io_err(&self.path))?;
        report.removed = true;
        Ok(report)
    }

    /// Kills the recorded VM processes and detaches what is mounted under the directory, but
    /// keeps the directory and its undo records: for a release whose network or cgroup step
    /// failed, so that the share's mounts are gone at once and a later `<shim> delete` still
    /// finds what it must retry.
    pub fn detach_mounts(&self) -> Result<Vec<PathBuf>, StateError> {
        self.kill_vm_processes();
        self.unmount_all()
    }

    /// Detaches every mount the kernel's mount table shows under the directory, shallowest
    /// first (the pod's share takes every container's mounts with it), each reached from the
    /// directory's descriptor without symlinks and checked to be a mount's root. Returns the
    /// mount points detached.
    fn unmount_all(&self) -> Result<Vec<PathBuf>, StateError> {
        let dir = match host_fs::open_root_dir(&self.path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.path)(e)),
        };
        let mut unmounted = Vec::new();
        for _ in 0..UNMOUNT_PASSES {
            let mut mounts = mounts_under(&self.path);
            mounts.sort_by_key(|m| m.as_os_str().len());
            mounts.dedup();
            let mut detached = false;
            for m in mounts {
                let Ok(rel) = m.strip_prefix(&self.path) else {
                    continue;
                };
                if rel.as_os_str().is_empty() {
                    continue;
                }
                match host_fs::unmount_beneath(dir.as_fd(), rel) {
                    Ok(0) => {}
                    Ok(_) => {
                        unmounted.push(m);
                        detached = true;
                    }
                    Err(e) => log::warn!("unmounting {}: {e}", m.display()),
                }
            }
            if !detached {
                break;
            }
        }
        Ok(unmounted)
    }
}

/// `"<pid> <start time>\n"` for the running process `pid` (start time 0 if unreadable).
fn record_line(pid: u32) -> String {
    format!("{pid} {}\n", start_time(pid).unwrap_or(0))
}

fn read_records(file: &Path) -> Vec<(u32, u64)> {
    fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}

/// The kernel's flag of a task in `do_exit` (`PF_EXITING`, linux/sched.h): set on every thread
/// of a killed process as it exits, before its descriptors are released.
const PF_EXITING: u64 = 0x4;

/// What this module reads of `/proc/<pid>/stat`, parsed once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// Field 4: the parent's pid.
    pub ppid: u32,
    /// Field 9: the kernel's `PF_*` flags.
    pub flags: u64,
    /// Field 22: the start time in clock ticks since boot.
    pub start_time: u64,
}

impl ProcStat {
    /// The stat of `pid`, or `None` if it is gone (or the file cannot be parsed).
    pub fn read(pid: u32) -> Option<ProcStat> {
        Self::parse(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    fn parse(stat: &str) -> Option<ProcStat> {
        // The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        // After pgrp, session, tty_nr, tpgid (fields 5-8): flags is field 9.
        let flags = fields.nth(4)?.parse().ok()?;
        // Then fields 10-21 (12 of them): start time is field 22.
        let start_time = fields.nth(12)?.parse().ok()?;
        Some(ProcStat {
            state,
            ppid,
            flags,
            start_time,
        })
    }

    /// Neither a zombie nor dead.
    pub fn is_live(&self) -> bool {
        self.state != 'Z' && self.state != 'X'
    }

    /// In `do_exit`: killed or ending, its descriptors about to be released.
    pub fn is_exiting(&self) -> bool {
        self.flags & PF_EXITING != 0
    }
}

/// A live (not zombie) process's start time in clock ticks since boot (`/proc/<pid>/stat`
/// field 22), or `None` if it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    ProcStat::read(pid)
        .filter(ProcStat::is_live)
        .map(|s| s.start_time)
}

/// SIGKILLs `pid` if it is still the process recorded (same start time) and waits (bounded)
/// until it is gone. Returns whether it was killed.
fn kill_if_same(pid: u32, start: u64) -> bool {
    if start == 0 || start_time(pid) != Some(start) {
        return false;
    }
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with a pid checked just above to be the recorded process; no memory
    // is involved.
    unsafe { libc::kill(raw, libc::SIGKILL) };
    let deadline = Instant::now() + KILL_WAIT;
    while start_time(pid) == Some(start) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Mount points at or under `dir`, from /proc/self/mountinfo, in its order (a path mounted on
/// twice is listed twice).
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`; other bytes are the path's
/// own (not necessarily UTF-8).
fn unescape_mountinfo(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn rejects_ids_that_escape_the_root() {
        let root = Path::new("/run/microvm");
        for bad in ["", ".", "..", "a/b", "../x", "a b", &"x".repeat(77)] {
            assert!(StateDir::new(root, bad).is_err(), "{bad:?}");
        }
        let d = StateDir::new(root, &"ab12".repeat(16)).unwrap();
        assert_eq!(d.path(), root.join("ab12".repeat(16)));
        // The longest socket of a VM stays within a Unix socket path.
        for sock in [
            crate::vm::qemu::vsock_uds_in(&d.vm_dir()).with_file_name("vhost-user.sock"),
            crate::vm::qemu::vsock_uds_in(&d.vm_dir()).with_file_name("vsock.sock_1026"),
            d.vm_dir().join("virtiofsd.sock"),
        ] {
            assert!(sock.as_os_str().len() <= 107, "{}", sock.display());
        }
    }

    #[test]
    fn proc_stat_fields_after_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194564 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 50 18446744073709551615";
        let stat = ProcStat::parse(line).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                state: 'S',
                ppid: 1,
                flags: 4194564,
                start_time: 987654
            }
        );
        assert!(stat.is_live() && stat.is_exiting());
        let zombie = ProcStat::parse("1 (x) Z 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 7").unwrap();
        assert!(!zombie.is_live() && !zombie.is_exiting());
        assert_eq!(zombie.start_time, 7);
        assert_eq!(ProcStat::parse("1 (cut short) S 0 0"), None);
    }

    #[test]
    fn start_time_of_live_and_gone_processes() {
        assert!(start_time(std::process::id()).is_some());
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(start_time(pid), None);
        let own = ProcStat::read(std::process::id()).unwrap();
        assert!(own.is_live() && !own.is_exiting());
        assert_eq!(ProcStat::read(pid), None, "a reaped process has no stat");
        assert_eq!(unescape_mountinfo(r"/a\040b\134c"), Path::new("/a b\\c"));
        // A cut escape is kept as it is.
        assert_eq!(unescape_mountinfo(r"/x\04"), Path::new(r"/x\04"));
    }

    #[test]
    fn the_reclaim_lock_is_exclusive_and_absent_once_the_directory_is_gone() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::new(root.path(), "pod1").unwrap();
        assert!(dir.lock().unwrap().is_none(), "no directory, no lock");
        dir.create(std::process::id()).unwrap();
        assert!(dir.has_shim_record());
        assert_eq!(dir.socket_address(), None);
        dir.record_socket("unix:///run/containerd/s/abc\n").unwrap();
        assert_eq!(
            dir.socket_address().as_deref(),
            Some("unix:///run/containerd/s/abc")
        );
        let held = dir
            .lock()
            .unwrap()
            .expect("the lock of an existing directory");
        assert!(
            dir.try_lock().unwrap().is_none(),
            "held by another open file"
        );
        // A waiter gets the lock when the holder is done; the holder removed the directory.
        let waiter = {
            let dir = dir.clone();
            std::thread::spawn(move || dir.lock().unwrap().is_none())
        };
        std::thread::sleep(Duration::from_millis(100));
        dir.cleanup().unwrap();
        drop(held);
        assert!(waiter.join().unwrap(), "the waiter sees the directory gone");
    }

    fn mount_tmpfs(at: &Path) {
        fs::create_dir_all(at).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(at)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "mounting a tmpfs needs root (make test runs as root)"
        );
    }

    fn is_mounted(at: &Path) -> bool {
        mounts_under(at).iter().any(|m| m == at)
    }

    #[test]
    fn cleanup_kills_recorded_processes_unmounts_and_removes() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::new(root.path(), "pod1").unwrap();
        dir.create(std::process::id()).unwrap();
        assert!(dir.shim_alive());
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        dir.record_vm_processes(&[child.id()]).unwrap();
        // Mounts under the directory: one with a mount under it, and another.
        let m1 = dir.shared_dir().join("c1");
        let m2 = dir.path().join("other");
        mount_tmpfs(&m1);
        mount_tmpfs(&m1.join("nested"));
        mount_tmpfs(&m2);
        let report = dir.cleanup().unwrap();
        assert_eq!(report.killed, vec![child.id()]);
        let status = child.wait().unwrap();
        assert!(!status.success());
        // The nested mount went with its parent.
        assert_eq!(report.unmounted, vec![m2, m1], "{report:?}");
        assert!(report.removed);
        assert!(!dir.path().exists());
        // Twice is harmless.
        assert_eq!(dir.cleanup().unwrap(), CleanupReport::default());
    }

    #[test]
    fn detach_mounts_kills_and_unmounts_but_keeps_the_records() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::new(root.path(), "pod2").unwrap();
        dir.create(std::process::id()).unwrap();
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        dir.record_vm_processes(&[child.id()]).unwrap();
        fs::write(dir.network_record(), "{}").unwrap();
        let m = dir.shared_dir();
        mount_tmpfs(&m);
        let unmounted = dir.detach_mounts().unwrap();
        assert_eq!(unmounted, vec![m]);
        assert!(!child.wait().unwrap().success());
        assert!(mounts_under(dir.path()).is_empty());
        // The record a later delete retries from is still there, and a cleanup then ends it.
        assert!(dir.network_record().exists());
        assert!(dir.cleanup().unwrap().removed);
    }

    #[test]
    fn a_symlink_planted_in_the_share_never_turns_the_cleanup_outside() {
        // A share as an older shim left it (writable by the guest), with the guest's plant:
        // `shared/c1/mounts` replaced by a symlink to a host directory that has a mount and a
        // file, and the path through it recorded as the shim's own mount point (the old
        // `mounts` record). The cleanup must neither unmount nor delete anything outside.
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let host_mount = outside.path().join("m");
        mount_tmpfs(&host_mount);
        fs::write(outside.path().join("keep"), "host file").unwrap();
        let dir = StateDir::new(root.path(), "pod3").unwrap();
        dir.create(std::process::id()).unwrap();
        fs::create_dir_all(dir.shared_dir().join("c1")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.shared_dir().join("c1/mounts")).unwrap();
        fs::write(
            dir.path().join("mounts"),
            format!("{}\n", dir.shared_dir().join("c1/mounts/m").display()),
        )
        .unwrap();
        let report = dir.cleanup().unwrap();
        assert!(report.unmounted.is_empty(), "{report:?}");
        assert!(report.removed);
        assert!(
            is_mounted(&host_mount),
            "the host's mount outside the pod stays"
        );
        assert!(outside.path().join("keep").exists());
        assert_eq!(
            crate::host_fs::unmount_beneath(
                crate::host_fs::open_root_dir(outside.path())
                    .unwrap()
                    .as_fd(),
                Path::new("m")
            )
            .unwrap(),
            1
        );
    }

    #[test]
    fn a_recycled_pid_is_not_killed() {
        let root = tempfile::tempdir().unwrap();
        let dir = StateDir::new(root.path(), "pod2").unwrap();
        dir.create(std::process::id()).unwrap();
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        // Same pid, different start time: another process.
        fs::write(dir.path().join(VM_PIDS_FILE), format!("{} 1\n", child.id())).unwrap();
        let report = dir.cleanup().unwrap();
        assert!(report.killed.is_empty());
        assert_eq!(child.try_wait().unwrap(), None);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
