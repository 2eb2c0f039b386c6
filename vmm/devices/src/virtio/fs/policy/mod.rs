//! What the guest may plant on the host's disk through the share: a [`FileSystem`] wrapper that
//! refuses device nodes, set-user-ID / set-group-ID files and file capabilities, and the
//! serving thread's capability drop behind it.
//!
//! The passthrough file system runs as host root and does what the guest asks inside the shared
//! directory. A file it creates is a real host file: a character device with `/dev/mem`'s
//! numbers, a set-user-ID-root shell or a `security.capability` xattr would work on the host
//! for anyone who reaches the file there (a hostPath volume, a host process that walks the
//! share), whatever mount options the guest's view had. [`HostPolicy`] wraps the file system
//! and checks every request that can create such a file or give an existing one such a bit;
//! everything else is delegated unchanged. A refused request gets `EPERM`. The checks read the
//! decoded request and the host inode (its type from `getattr`), never the guest's idea of it,
//! so no phrasing gets around them: a mode's file-type bits, the umask and the open flags are
//! all looked at as the host would apply them.
//!
//! | request | refused (`EPERM`) | allowed |
//! |---|---|---|
//! | MKNOD | character devices other than 0:0, block devices, any other type than the allowed ones, any mode with `S_ISUID` or `S_ISGID` | regular files, FIFOs, sockets, the overlayfs whiteout (character device 0:0) |
//! | CREATE | a mode with `S_ISUID` or `S_ISGID`; `O_TMPFILE` | everything else |
//! | MKDIR | a mode with `S_ISUID` | `S_ISGID` (the kernel ignores both in `mkdir(2)` and a new directory inherits its parent's `S_ISGID`) |
//! | SETATTR (mode) | `S_ISUID` on anything; `S_ISGID` on anything but a directory | `S_ISGID` on a directory, the sticky bit, any permission bits |
//! | SETXATTR | `security.capability` | other names (xattrs are off in this device today: `ENOSYS` for all) |
//! | OPEN, OPENDIR | `O_CREAT`, `O_TMPFILE` (Linux never sends them: creation is CREATE) | everything else |
//!
//! Why these:
//! - **Device nodes.** A character or block device on the host's disk is access to the host's
//!   memory or disks for whoever opens it. The one character device a guest needs is the
//!   whiteout (0:0): overlayfs in the guest creates it on an upper directory, which may live on
//!   the share (a volume), to hide a lower file; it is no device (opening it fails: no driver
//!   has 0:0). FIFOs and sockets are in-memory objects of the host kernel: no privilege.
//! - **Set-user-ID and set-group-ID files.** A set-user-ID-root file is root for whoever runs it
//!   on the host; a set-group-ID file owned by group root (or `shadow`, `disk`) is that group.
//!   Both are refused wherever they come from (CREATE, MKNOD, SETATTR). A set-group-ID
//!   *directory* is allowed: it only makes new entries inherit its group (and new
//!   subdirectories the bit), which grants nothing the creator could not set by `chown` anyway,
//!   and images and workloads use it (Debian's `/var/local`, `/var/mail`, shared project
//!   directories). `S_ISUID` on a directory means nothing on Linux; it is refused to keep the
//!   rule simple ("no new `S_ISUID` anywhere"). The cost: a guest cannot install a set-ID
//!   program into the share (`chmod u+s`, `dpkg` unpacking `sudo`, `install -m 4755` get
//!   `EPERM`); set-ID files that came with the container image keep their bits.
//! - **File capabilities.** `security.capability` is a set-user-ID with finer grain: refused.
//! - **Writing an existing set-ID file** (one from the image): an OPEN or CREATE that can
//!   write (`O_WRONLY`, `O_RDWR`, `O_TRUNC`) and a SETATTR that changes the size first clear
//!   `S_ISUID`, and `S_ISGID` when group-execute is set, as the kernel does on a write by an
//!   unprivileged process. Otherwise the guest could put its own code into a set-user-ID-root
//!   binary (the host's root keeps the bits on write). Writes need a handle, and handles that
//!   can write come only from those requests.
//!
//! Left to the kernel, and checked by the tests: `chown` of a set-ID file clears the bits (for
//! every caller); a hard link (LINK) names an inode the guest already reached inside the share
//! and cannot cross to another mount (`EXDEV`), and adds no bit; RENAME (with `RENAME_EXCHANGE`
//! or `RENAME_WHITEOUT`, which makes a 0:0 whiteout) moves names inside the share only; the
//! `umask` can only remove bits. Nothing here changes owners: guest root creates root-owned
//! files, which is why the bits matter.
//!
//! **The umask stays on the serving thread.** The passthrough clears the umask (`umask(0)`)
//! when the guest sends FUSE INIT, so that it can apply the guest's own umask exactly. A umask
//! belongs to the whole process unless a thread has a file-system context of its own: the
//! serving thread takes one first (`unshare(CLONE_FS)` in [`confine_serving_thread`]), or a
//! guest would clear the umask of the shim (which embeds the VMM) at a moment of its choosing,
//! and every file and directory the shim made afterwards would be writable by everyone. Found by
//! the virtio_fs fuzz target (docs/fuzzing.md).
//!
//! **The kernel as last line.** The thread that serves the requests gives up `CAP_MKNOD`,
//! `CAP_SETFCAP` and `CAP_FSETID` from its effective, permitted and inheritable sets
//! ([`confine_serving_thread`], called by the device before its first request on a thread).
//! Linux capabilities are per thread, so this touches only that thread (the VMM's device
//! thread). Without `CAP_MKNOD` the host kernel refuses every device node but the whiteout;
//! without `CAP_SETFCAP` it refuses `security.capability`; without `CAP_FSETID` it clears
//! set-ID bits on every write, truncate and `fallocate`, also through overlayfs. They are
//! dropped from the permitted set, not only the effective one, because the passthrough switches
//! its effective uid per request (`setresuid`), and returning to uid 0 refills the effective
//! set from the permitted one. The passthrough's own `CAP_FSETID` juggling is used only with
//! `FUSE_HANDLE_KILLPRIV_V2`, which this device does not enable.
//!
//! Files: `rules.rs` (the rules as pure functions of the request's values), `host_policy.rs`
//! ([`HostPolicy`]'s state and shared steps), `filesystem.rs` (its [`FileSystem`] requests:
//! checked or delegated), `confine.rs` ([`confine_serving_thread`]).
//!
//! [`FileSystem`]: fuse_backend_rs::api::filesystem::FileSystem

mod confine;
mod filesystem;
mod host_policy;
mod rules;

pub use confine::{confine_serving_thread, ConfineError, DROPPED_CAPABILITIES};
pub use host_policy::HostPolicy;
pub use rules::{
    bits_killed_by_write, mknod_allowed, mode_allowed, open_flags_allowed, XATTR_CAPABILITY,
};
