//! The process-wide half of the jail, for a VMM that runs in a process of its own (the
//! embedder starts it and hands it file descriptors: docs/security.md, "The VMM's
//! confinement"): resource limits, `no_new_privs`, new namespaces, an empty root that holds
//! only the shared directory, and the capabilities the virtio-fs server keeps.
//!
//! Order matters and is the caller's: open every host resource first (the VM's devices are
//! built from descriptors; the virtio-fs server, which opens `/proc/self/fd` and its root by
//! path, is opened after the jail, so that its descriptors lie inside the new root),
//! then [`enter_namespaces`], [`pivot_to_empty_root`], [`set_limits`], [`keep_capabilities`]
//! and [`set_no_new_privs`], all on the main thread before any other thread exists (threads
//! inherit all of it), and only then start the VM's threads, which add their seccomp filters.
//! Each step needs the capability it is about to give up: namespaces and mounts need
//! `CAP_SYS_ADMIN`, so capabilities go last but one.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use caps::{CapSet, Capability, CapsHashSet};
use rustix::fs::Mode;
use rustix::mount::{
    mount, mount_change, move_mount, open_tree, unmount, MountFlags, MountPropagationFlags,
    MoveMountFlags, OpenTreeFlags, UnmountFlags,
};
use rustix::process::{Resource, Rlimit};
use rustix::thread::UnshareFlags;

/// Why a step of the process jail failed (each names the step).
#[derive(Debug, thiserror::Error)]
pub enum ProcessJailError {
    #[error("{step}: {source}")]
    Sys {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Caps {
        step: &'static str,
        #[source]
        source: caps::errors::CapsError,
    },
}

fn sys(step: &'static str) -> impl Fn(rustix::io::Errno) -> ProcessJailError {
    move |e| ProcessJailError::Sys {
        step,
        source: e.into(),
    }
}

/// The resource limits of a VMM process (each applied as both soft and hard limit, so the
/// process cannot raise it again; a limit above the process's hard limit is lowered to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_NOFILE`: descriptors. The virtio-fs server holds one per inode the guest looked
    /// up, vsock one per connection (at most 128), each disk one.
    pub open_files: u64,
    /// `RLIMIT_NPROC`: processes and threads of the VMM's user (not enforced for root with
    /// `CAP_SYS_RESOURCE` or `CAP_SYS_ADMIN`, which the jail drops). vCPUs plus a few.
    pub processes: u64,
    /// `RLIMIT_FSIZE`: the largest file the process may write. `None` when it serves a shared
    /// directory (the guest's files are written by it); else the console log's bound.
    pub file_size: Option<u64>,
    /// `RLIMIT_MEMLOCK`: locked memory. Only VFIO pins guest memory (its own accounting).
    pub locked_memory: u64,
}

impl Limits {
    /// The limits for a VM of `vcpus` that serves a shared directory or not.
    pub fn for_vm(vcpus: u8, serves_fs: bool) -> Self {
        Limits {
            open_files: if serves_fs { 65_536 } else { 1_024 },
            processes: u64::from(vcpus) + 8,
            file_size: if serves_fs {
                None
            } else {
                Some(crate::console_log::DEFAULT_CONSOLE_LOG_BYTES)
            },
            locked_memory: 0,
        }
    }
}

/// Sets `resource` to `value` (soft and hard), never above the hard limit the process has
/// (raising it needs `CAP_SYS_RESOURCE`, which a VMM has no business with).
fn limit(
    resource: Resource,
    value: Option<u64>,
    step: &'static str,
) -> Result<(), ProcessJailError> {
    let value = match (value, rustix::process::getrlimit(resource).maximum) {
        (Some(v), Some(max)) => Some(v.min(max)),
        (None, max) => max,
        (v, None) => v,
    };
    rustix::process::setrlimit(
        resource,
        Rlimit {
            current: value,
            maximum: value,
        },
    )
    .map_err(sys(step))
}

/// Applies `limits`, and no core dumps (a core of the VMM would hold guest memory).
pub fn set_limits(limits: &Limits) -> Result<(), ProcessJailError> {
    limit(Resource::Nofile, Some(limits.open_files), "RLIMIT_NOFILE")?;
    limit(Resource::Nproc, Some(limits.processes), "RLIMIT_NPROC")?;
    limit(Resource::Fsize, limits.file_size, "RLIMIT_FSIZE")?;
    limit(
        Resource::Memlock,
        Some(limits.locked_memory),
        "RLIMIT_MEMLOCK",
    )?;
    limit(Resource::Core, Some(0), "RLIMIT_CORE")
}

/// Sets `no_new_privs` on the calling thread (inherited by threads created after it): no
/// exec can grant privileges again, and seccomp filters can be installed.
pub fn set_no_new_privs() -> Result<(), ProcessJailError> {
    rustix::thread::set_no_new_privs(true).map_err(sys("PR_SET_NO_NEW_PRIVS"))
}

/// Moves the calling process into new mount, IPC, UTS and network namespaces (the network
/// namespace is empty but for a loopback that stays down: the VMM reaches the network only
/// through the tap descriptor it was given). A new PID namespace has to be made by whoever
/// starts the process (`clone` with `CLONE_NEWPID`): `unshare` would put only the children
/// there. Every mount becomes a slave of the host's: the host's later mounts under the
/// share (a container's rootfs, a volume) still appear, nothing made here goes back.
pub fn enter_namespaces() -> Result<(), ProcessJailError> {
    let flags =
        UnshareFlags::NEWNS | UnshareFlags::NEWIPC | UnshareFlags::NEWUTS | UnshareFlags::NEWNET;
    // SAFETY: no CLONE_FILES: the descriptor table stays shared as it was; the caller runs
    // this before starting threads (module doc).
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(sys("unshare"))?;
    mount_change(
        "/",
        MountPropagationFlags::DOWNSTREAM | MountPropagationFlags::REC,
    )
    .map_err(sys("making the mounts slaves of the host's"))
}

/// A detached copy of the mount tree at `dir` (a descriptor of the shared directory), to be
/// mounted in the empty root by [`pivot_to_empty_root`]. Take it before
/// [`enter_namespaces`]: the kernel clones only mounts of the caller's own namespace. (The
/// embedder may as well take it and pass the descriptor.) No path is looked up again.
pub fn detached_share(dir: &OwnedFd) -> Result<OwnedFd, ProcessJailError> {
    open_tree(
        dir.as_fd(),
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::AT_RECURSIVE
            | OpenTreeFlags::AT_EMPTY_PATH
            | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(sys("cloning the share's mounts"))
}

/// Mounts an empty tmpfs on `mount_point` (an empty directory the embedder made; the mount
/// exists only in this process's mount namespace), mounts the share (a tree from
/// [`detached_share`]) at `/<share_name>` in it, makes it the root (`pivot_root`), detaches the old
/// root, and makes the new root read-only (the share keeps its own flags). After this the
/// process sees `/` = `{<share_name>}` and nothing of the host but what the share holds.
pub fn pivot_to_empty_root(
    mount_point: &Path,
    share: Option<(&str, &OwnedFd)>,
) -> Result<(), ProcessJailError> {
    mount(
        "none",
        mount_point,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"size=64k,nr_inodes=16,mode=0755",
    )
    .map_err(sys("mounting the empty root (tmpfs)"))?;
    if let Some((name, tree)) = share {
        let root = rustix::fs::open(
            mount_point,
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys("opening the empty root"))?;
        rustix::fs::mkdirat(&root, name, Mode::from_raw_mode(0o755))
            .map_err(sys("making the share's mount point"))?;
        move_mount(
            tree.as_fd(),
            "",
            root.as_fd(),
            name,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(sys("mounting the share in the empty root"))?;
    }
    rustix::process::chdir(mount_point).map_err(sys("entering the empty root"))?;
    pivot_into_cwd_read_only()
}

/// A detached copy of the directory at `path` (a bind mount of it, with the mounts under it),
/// to be mounted in the empty root by [`pivot_to_root_holding`]. Taken before
/// [`enter_namespaces`], it copies the host's mounts (a copy of a shared mount is its peer
/// until the new root is made a slave); taken after, this namespace's copies of them, which
/// are slaves of the host's: the share is taken so ([`super::split`]), so that the host's later
/// mounts under it reach the copy and nothing goes back.
pub fn detached_tree(path: &Path) -> Result<OwnedFd, ProcessJailError> {
    open_tree(
        rustix::fs::CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::AT_RECURSIVE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(sys("cloning a folder's mounts"))
}

/// Like [`pivot_to_empty_root`], with each tree of `mounts` (from [`detached_tree`]) mounted
/// at its absolute path in the new root (the folders on the way are made in the empty
/// tmpfs), so that the VMM's paths (the vsock sockets of its work folder, the page templates)
/// stay what they were while nothing else of the host is there. At most 8 trees, paths of at
/// most 8 components.
pub fn pivot_to_root_holding(
    mount_point: &Path,
    mounts: &[(&Path, &OwnedFd)],
    with_proc: bool,
) -> Result<(), ProcessJailError> {
    mount(
        "none",
        mount_point,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"size=64k,nr_inodes=80,mode=0755",
    )
    .map_err(sys("mounting the empty root (tmpfs)"))?;
    if mounts.len() > 8 {
        return Err(ProcessJailError::Sys {
            step: "the trees of the new root",
            source: std::io::Error::other("more than 8"),
        });
    }
    let root = rustix::fs::open(
        mount_point,
        rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys("opening the empty root"))?;
    for (path, tree) in mounts {
        let components: Vec<_> = path
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(n),
                _ => None,
            })
            .collect();
        if components.is_empty() || components.len() > 8 || !path.is_absolute() {
            return Err(ProcessJailError::Sys {
                step: "a tree's place in the new root",
                source: std::io::Error::other(format!(
                    "{} is not a plain absolute path",
                    path.display()
                )),
            });
        }
        let mut rel = std::path::PathBuf::new();
        for c in components {
            rel.push(c);
            match rustix::fs::mkdirat(&root, &rel, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(sys("making a mount point in the new root")(e)),
            }
        }
        move_mount(
            tree.as_fd(),
            "",
            root.as_fd(),
            &rel,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(sys("mounting a tree in the new root"))?;
    }
    if with_proc {
        // The process's own tasks only (`subset=pid`: no /proc/sys, no sysrq-trigger, no
        // host-wide files), of its own PID namespace: the virtio-fs server reaches the share
        // through /proc/self/fd.
        rustix::fs::mkdirat(&root, "proc", Mode::from_raw_mode(0o555))
            .map_err(sys("making /proc in the new root"))?;
        let mut target = mount_point.to_path_buf();
        target.push("proc");
        mount(
            "proc",
            &target,
            "proc",
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
            c"subset=pid",
        )
        .map_err(sys("mounting /proc (subset=pid) in the new root"))?;
    }
    drop(root);
    rustix::process::chdir(mount_point).map_err(sys("entering the empty root"))?;
    enter_new_root()
}

/// Makes the current directory (the empty root, a mount) the root, detaches the old one, and
/// makes the new root read-only.
fn enter_new_root() -> Result<(), ProcessJailError> {
    pivot_into_cwd_read_only()
}

/// The capabilities the virtio-fs server keeps when the VMM serves a shared directory as
/// root: it acts for the guest's users on their files (`CAP_CHOWN`, `CAP_DAC_OVERRIDE`,
/// `CAP_FOWNER`) and switches its effective ids per request (`CAP_SETUID`, `CAP_SETGID`).
/// Not `CAP_MKNOD`, `CAP_SETFCAP`, `CAP_FSETID` (the host policy's drop), nor
/// `CAP_DAC_READ_SEARCH` (`open_by_handle_at` would open any inode of the file system), nor
/// anything of mounts, namespaces, devices or other processes.
pub const FS_SERVER_CAPABILITIES: [Capability; 5] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FOWNER,
    Capability::CAP_SETUID,
    Capability::CAP_SETGID,
];

/// Leaves the calling thread (and threads it starts) with only `keep`: the bounding set is
/// cut first (it needs `CAP_SETPCAP`), then the inheritable, effective and permitted sets;
/// the ambient set is cleared.
pub fn keep_capabilities(keep: &[Capability]) -> Result<(), ProcessJailError> {
    let keep: CapsHashSet = keep.iter().copied().collect();
    let caps_err = |step| move |source| ProcessJailError::Caps { step, source };
    for cap in caps::all() {
        if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap).map_err(caps_err("bounding set"))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(caps_err("ambient set"))?;
    caps::set(None, CapSet::Inheritable, &HashSet::new()).map_err(caps_err("inheritable set"))?;
    caps::set(None, CapSet::Effective, &keep).map_err(caps_err("effective set"))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(caps_err("permitted set"))
}

/// Makes the current directory (a mount point) the root: pivots into it, detaches the old root,
/// keeps the new root a slave of the host's mounts and remounts it read-only, nosuid, nodev,
/// noexec.
fn pivot_into_cwd_read_only() -> Result<(), ProcessJailError> {
    // pivot_root(".", "."): the old root ends up stacked under the new one at "/", and the
    // detach below takes it away (no folder for it is needed).
    rustix::process::pivot_root(".", ".").map_err(sys("pivot_root"))?;
    unmount(".", UnmountFlags::DETACH).map_err(sys("detaching the old root"))?;
    rustix::process::chdir("/").map_err(sys("chdir /"))?;
    mount_change(
        "/",
        MountPropagationFlags::DOWNSTREAM | MountPropagationFlags::REC,
    )
    .map_err(sys("keeping the new root a slave"))?;
    rustix::mount::mount_remount(
        "/",
        MountFlags::BIND
            | MountFlags::RDONLY
            | MountFlags::NOSUID
            | MountFlags::NODEV
            | MountFlags::NOEXEC,
        "",
    )
    .map_err(sys("making the new root read-only"))?;
    Ok(())
}

/// Forks this process (a fork-like `clone`: no new stack, the child runs on a copy of this one)
/// with the child as PID 1 of a new PID namespace, and returns, in the parent, the child's
/// pidfd and its pid in this namespace. The VMM process and the QEMU backend's pod init both
/// start so.
///
/// # Safety
/// `child` runs in the child of a fork of a possibly multi-threaded process: it may make only
/// raw system calls (no allocation, no lock) and should exec or exit (if it returns, the child
/// exits with status 127).
pub unsafe fn clone_into_new_pid_namespace(
    child: impl FnOnce(),
) -> std::io::Result<(std::os::fd::OwnedFd, u32)> {
    use std::os::fd::FromRawFd;
    let mut pidfd: libc::c_int = -1;
    let flags = (libc::CLONE_NEWPID | libc::CLONE_PIDFD | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a fork-like clone; the child only runs `child`, which the caller promises makes
    // raw system calls and execs or exits. The kernel writes the pidfd to `pidfd` (CLONE_PIDFD
    // through clone's parent_tid).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags,
            0usize,
            &mut pidfd as *mut libc::c_int,
            0usize,
            0usize,
        )
    };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if ret == 0 {
        child();
        // SAFETY: `child` should have exec'd or exited; leave at once without running anything
        // of the parent's copy.
        unsafe { libc::_exit(127) }
    }
    // SAFETY: the kernel gave us this new descriptor (CLONE_PIDFD); nothing else owns it.
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd) };
    Ok((pidfd, ret as u32))
}
