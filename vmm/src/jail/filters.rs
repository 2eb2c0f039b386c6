//! The system calls of each thread role, with their argument checks.
//!
//! Found by reading each role's code paths (vmm/src, vmm/devices, and the crates under them:
//! vm-memory, event-manager, fuse-backend-rs, the C library's thread and malloc code) and by
//! tracing the VMM's tests on /dev/kvm with `strace -f`, thread by thread (docs/security.md
//! says how to redo that). What a thread does before it installs its filter (its stack, its
//! signal stack, its name) needs no entry; what it does when it ends (unmapping them) does.
//!
//! Conventions: a syscall with no rule is allowed whatever its arguments; a syscall with
//! rules is allowed when one of its rules matches, a rule matching when all its conditions
//! hold. `ioctl` requests are compared on their low 32 bits (the kernel's `unsigned int cmd`).

use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition, SeccompRule};

use super::{JailError, Needs, Role};

/// One allowed system call: its number and the rules of which one must match (none: any
/// arguments).
pub type Allowed = (i64, Vec<SeccompRule>);

macro_rules! syscalls {
    ($($name:ident),* $(,)?) => {
        /// The system calls the filters name, with their names (for tables and messages).
        const NAMES: &[(i64, &str)] = &[$((libc::$name, strip(stringify!($name)))),*];
    };
}

const fn strip(s: &'static str) -> &'static str {
    // "SYS_read" -> "read"
    let (_, rest) = s.as_bytes().split_at(4);
    match std::str::from_utf8(rest) {
        Ok(r) => r,
        Err(_) => s,
    }
}

syscalls!(
    SYS_accept4,
    SYS_brk,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_close,
    SYS_connect,
    SYS_copy_file_range,
    SYS_dup,
    SYS_epoll_ctl,
    SYS_epoll_pwait,
    SYS_epoll_wait,
    SYS_exit,
    SYS_exit_group,
    SYS_fallocate,
    SYS_fchmod,
    SYS_fchmodat,
    SYS_fchownat,
    SYS_fcntl,
    SYS_fdatasync,
    SYS_flock,
    SYS_fstat,
    SYS_fstatfs,
    SYS_fsync,
    SYS_ftruncate,
    SYS_futex,
    SYS_getdents64,
    SYS_getegid,
    SYS_geteuid,
    SYS_getgid,
    SYS_getpid,
    SYS_getrandom,
    SYS_gettid,
    SYS_getuid,
    SYS_ioctl,
    SYS_linkat,
    SYS_lseek,
    SYS_madvise,
    SYS_mkdir,
    SYS_mkdirat,
    SYS_mknodat,
    SYS_mmap,
    SYS_mprotect,
    SYS_mremap,
    SYS_munmap,
    SYS_name_to_handle_at,
    SYS_nanosleep,
    SYS_newfstatat,
    SYS_openat,
    SYS_ppoll,
    SYS_prctl,
    SYS_pread64,
    SYS_preadv,
    SYS_pwrite64,
    SYS_pwritev,
    SYS_read,
    SYS_readlinkat,
    SYS_readv,
    SYS_recvfrom,
    SYS_recvmsg,
    SYS_rename,
    SYS_renameat2,
    SYS_restart_syscall,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sched_getaffinity,
    SYS_sched_yield,
    SYS_sendfile,
    SYS_sendmsg,
    SYS_sendto,
    SYS_setresgid,
    SYS_setresuid,
    SYS_shutdown,
    SYS_sigaltstack,
    SYS_socket,
    SYS_statfs,
    SYS_statx,
    SYS_symlinkat,
    SYS_tgkill,
    SYS_timerfd_settime,
    SYS_umask,
    SYS_unlink,
    SYS_unlinkat,
    SYS_utimensat,
    SYS_write,
    SYS_writev,
);

/// The name of system call `nr` (or its number, for one the table lacks).
pub fn name_of(nr: i64) -> &'static str {
    NAMES
        .iter()
        .find(|(n, _)| *n == nr)
        .map(|(_, name)| *name)
        .unwrap_or("?")
}

// KVM and VFIO ioctl numbers (linux/kvm.h, linux/vfio.h), from the same encodings the
// kernel uses; the unit tests check them against the values the kernel headers give.
vmm_sys_util::ioctl_io_nr!(KVM_RUN, kvm_bindings::KVMIO, 0x80);
vmm_sys_util::ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    kvm_bindings::KVMIO,
    0x46,
    kvm_bindings::kvm_userspace_memory_region
);
/// `BLKDISCARD` = `_IO(0x12, 119)` and `BLKZEROOUT` = `_IO(0x12, 127)` (linux/fs.h).
pub const BLKDISCARD: u64 = 0x1277;
pub const BLKZEROOUT: u64 = 0x127f;

/// The kick signal of the vCPU threads (`crate::kick::kick_signal`).
fn kick_signal() -> u64 {
    crate::kick::kick_signal() as u64
}

struct Builder {
    role: Role,
    list: Vec<Allowed>,
}

impl Builder {
    fn new(role: Role) -> Self {
        Self {
            role,
            list: Vec::new(),
        }
    }

    fn err(&self) -> impl Fn(seccompiler::BackendError) -> JailError {
        let role = self.role.name();
        move |source| JailError::Build { role, source }
    }

    /// Allows `nr` with any arguments.
    fn any(&mut self, nrs: &[i64]) {
        for &nr in nrs {
            self.merge(nr, Vec::new());
        }
    }

    /// Allows `nr` when one of `rules` (each a list of `(arg, len, op, value)`) matches.
    fn when(&mut self, nr: i64, rules: &[&[(u8, Len, Op, u64)]]) -> Result<(), JailError> {
        let mut built = Vec::with_capacity(rules.len());
        for conds in rules {
            let mut cs = Vec::with_capacity(conds.len());
            for (arg, len, op, value) in conds.iter().cloned() {
                cs.push(SeccompCondition::new(arg, len, op, value).map_err(self.err())?);
            }
            built.push(SeccompRule::new(cs).map_err(self.err())?);
        }
        self.merge(nr, built);
        Ok(())
    }

    /// Adds rules for `nr`; an unconditional entry absorbs any rules.
    fn merge(&mut self, nr: i64, rules: Vec<SeccompRule>) {
        match self.list.iter_mut().find(|(n, _)| *n == nr) {
            Some((_, existing)) => {
                if existing.is_empty() || rules.is_empty() {
                    existing.clear();
                } else {
                    existing.extend(rules);
                }
            }
            None => self.list.push((nr, rules)),
        }
    }

    /// Allows `ioctl` with one of `requests`.
    fn ioctls(&mut self, requests: &[u64]) -> Result<(), JailError> {
        let rules: Vec<[(u8, Len, Op, u64); 1]> = requests
            .iter()
            .map(|&r| [(1, Len::Dword, Op::Eq, r)])
            .collect();
        let refs: Vec<&[(u8, Len, Op, u64)]> = rules.iter().map(|r| &r[..]).collect();
        self.when(libc::SYS_ioctl, &refs)
    }

    /// Allows `fcntl` with one of `commands`.
    fn fcntls(&mut self, commands: &[i32]) -> Result<(), JailError> {
        let rules: Vec<[(u8, Len, Op, u64); 1]> = commands
            .iter()
            .map(|&c| [(1, Len::Dword, Op::Eq, c as u64)])
            .collect();
        let refs: Vec<&[(u8, Len, Op, u64)]> = rules.iter().map(|r| &r[..]).collect();
        self.when(libc::SYS_fcntl, &refs)
    }

    /// Allows `tgkill` to a thread of process `pid` with one of `signals`.
    fn tgkill(&mut self, pid: u32, signals: &[u64]) -> Result<(), JailError> {
        let rules: Vec<[(u8, Len, Op, u64); 2]> = signals
            .iter()
            .map(|&s| {
                [
                    (0, Len::Dword, Op::Eq, u64::from(pid)),
                    (2, Len::Dword, Op::Eq, s),
                ]
            })
            .collect();
        let refs: Vec<&[(u8, Len, Op, u64)]> = rules.iter().map(|r| &r[..]).collect();
        self.when(libc::SYS_tgkill, &refs)
    }

    /// Allows `madvise` with one of `advice`.
    fn madvise(&mut self, advice: &[i32]) -> Result<(), JailError> {
        let rules: Vec<[(u8, Len, Op, u64); 1]> = advice
            .iter()
            .map(|&a| [(2, Len::Dword, Op::Eq, a as u64)])
            .collect();
        let refs: Vec<&[(u8, Len, Op, u64)]> = rules.iter().map(|r| &r[..]).collect();
        self.when(libc::SYS_madvise, &refs)
    }
}

const PROT_EXEC: u64 = libc::PROT_EXEC as u64;
/// The `mmap` flag bits a rule pins: the mapping type, anonymous, fixed, and the flags that
/// would replace or grow something (`MAP_FIXED_NOREPLACE`, `MAP_GROWSDOWN`).
const MAP_PINNED: u64 = (libc::MAP_TYPE
    | libc::MAP_ANONYMOUS
    | libc::MAP_FIXED
    | libc::MAP_FIXED_NOREPLACE
    | libc::MAP_GROWSDOWN) as u64;
const MAP_PRIVATE_ANON: u64 = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;

/// What every thread of the VMM needs: memory (the allocator: anonymous private mappings,
/// never executable), locks, signal return, its own end, time, random seeds, and the abort
/// of a failed assertion (SIGABRT to this process only).
fn base(b: &mut Builder, pid: u32) -> Result<(), JailError> {
    b.any(&[
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_close,
        libc::SYS_futex,
        libc::SYS_munmap,
        libc::SYS_brk,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_exit,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_clock_gettime,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_restart_syscall,
        libc::SYS_getrandom,
        libc::SYS_gettid,
        libc::SYS_getpid,
    ]);
    // mmap: anonymous private memory, never executable.
    b.when(
        libc::SYS_mmap,
        &[&[
            (2, Len::Dword, Op::MaskedEq(PROT_EXEC), 0),
            (3, Len::Dword, Op::MaskedEq(MAP_PINNED), MAP_PRIVATE_ANON),
        ]],
    )?;
    b.when(
        libc::SYS_mprotect,
        &[&[(2, Len::Dword, Op::MaskedEq(PROT_EXEC), 0)]],
    )?;
    // realloc of a large block: move or grow in place, never MREMAP_FIXED onto another range.
    b.when(
        libc::SYS_mremap,
        &[
            &[(3, Len::Dword, Op::Eq, 0)],
            &[(3, Len::Dword, Op::Eq, libc::MREMAP_MAYMOVE as u64)],
        ],
    )?;
    // The allocator and the C library's thread exit give memory back.
    b.madvise(&[libc::MADV_DONTNEED])?;
    b.tgkill(pid, &[libc::SIGABRT as u64])?;
    Ok(())
}

/// vCPU: KVM_RUN, and the device registers its exits reach (eventfds, the serial's sink,
/// the console log's rotation by descriptor). With VFIO: memory slots for BARs and the
/// config space and trapped BAR accesses.
fn vcpu(b: &mut Builder, needs: Needs) -> Result<(), JailError> {
    // The console log (vmm::console_log) rotates through its two descriptors.
    b.any(&[libc::SYS_ftruncate, libc::SYS_lseek]);
    // A device reset by the guest (status 0) drops the device's backend connections: vsock
    // takes them out of its epoll set.
    b.when(
        libc::SYS_epoll_ctl,
        &[&[(1, Len::Dword, Op::Eq, libc::EPOLL_CTL_DEL as u64)]],
    )?;
    let mut ioctls = vec![KVM_RUN() as u64];
    if needs.vfio {
        // BARs move as the guest programs them; config space and trapped BAR accesses are
        // reads and writes of the device's regions at their offsets.
        ioctls.push(KVM_SET_USER_MEMORY_REGION() as u64);
        b.any(&[libc::SYS_pread64, libc::SYS_pwrite64]);
    }
    b.ioctls(&ioctls)
}

/// The device event loop: epoll, virtqueue backends (vsock's Unix sockets, the tap, disk
/// files and block devices, the balloon's drops, vsock's timer).
fn device_loop(b: &mut Builder) -> Result<(), JailError> {
    b.any(&[
        libc::SYS_epoll_wait,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_ctl,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_preadv,
        libc::SYS_pwritev,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_fallocate,
        libc::SYS_fstat,
        libc::SYS_statx,
        // vsock: the host's connections (accept), the guest's connections (connect to the
        // host's `<uds>_<port>`), their traffic and half-close, the connect timeout.
        libc::SYS_accept4,
        libc::SYS_connect,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_shutdown,
        libc::SYS_timerfd_settime,
    ]);
    // Unix sockets only: no network socket from this thread.
    b.when(
        libc::SYS_socket,
        &[&[(0, Len::Dword, Op::Eq, libc::AF_UNIX as u64)]],
    )?;
    b.fcntls(&[
        libc::F_GETFL,
        libc::F_SETFL,
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_DUPFD_CLOEXEC,
    ])?;
    // Disk slots on block devices: discard and write-zeroes; accepted vsock streams are made
    // non-blocking (the standard library's `set_nonblocking` is `FIONBIO`).
    b.ioctls(&[BLKDISCARD, BLKZEROOUT, libc::FIONBIO])?;
    // The balloon drops the pages the guest reported free.
    b.madvise(&[libc::MADV_DONTNEED])
}

/// The virtio-fs server (fuse-backend-rs passthrough under our `HostPolicy`): file system
/// calls relative to descriptors of the share, its per-request credentials (`setresuid`,
/// `setresgid` on the calling thread only). Its capability drop happens before the filter
/// (`confine_serving_thread`), so `capset` is not in the list. Not allowed, among others: `open_by_handle_at` (opens any inode of the file system by handle, past the
/// share), `mount`, `chroot`, `pivot_root`, xattr calls (off in this device), `ioctl`.
fn fs_worker(b: &mut Builder) -> Result<(), JailError> {
    b.any(&[
        libc::SYS_openat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_fstat,
        libc::SYS_fstatfs,
        libc::SYS_statfs,
        libc::SYS_getdents64,
        libc::SYS_readlinkat,
        libc::SYS_mkdirat,
        libc::SYS_mknodat,
        libc::SYS_unlinkat,
        libc::SYS_renameat2,
        libc::SYS_linkat,
        libc::SYS_symlinkat,
        libc::SYS_fchmod,
        libc::SYS_fchmodat,
        libc::SYS_fchownat,
        libc::SYS_utimensat,
        libc::SYS_ftruncate,
        libc::SYS_fallocate,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_lseek,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_preadv,
        libc::SYS_pwritev,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_dup,
        libc::SYS_flock,
        libc::SYS_name_to_handle_at,
        libc::SYS_setresuid,
        libc::SYS_setresgid,
        libc::SYS_getuid,
        libc::SYS_getgid,
        libc::SYS_geteuid,
        libc::SYS_getegid,
        libc::SYS_umask,
    ]);
    b.fcntls(&[
        libc::F_GETFL,
        libc::F_SETFL,
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_DUPFD_CLOEXEC,
        libc::F_OFD_GETLK,
        libc::F_OFD_SETLK,
        libc::F_OFD_SETLKW,
        libc::F_GETLK,
        libc::F_SETLK,
        libc::F_SETLKW,
    ])
}

/// The control thread: the embedder's requests on a running VM (kicking vCPUs for a stop or
/// pause, waking the device loop), disk attach and detach (the file arrives as a descriptor;
/// the detached one is synced), the control socket's messages with their descriptors, and
/// the end (joining the threads, unmapping guest memory).
fn control(b: &mut Builder, pid: u32) -> Result<(), JailError> {
    b.any(&[
        libc::SYS_recvmsg,
        libc::SYS_sendmsg,
        libc::SYS_ppoll,
        libc::SYS_fdatasync,
        libc::SYS_fsync,
        libc::SYS_fstat,
        libc::SYS_statx,
        libc::SYS_lseek,
        libc::SYS_exit_group,
    ]);
    b.fcntls(&[libc::F_GETFD, libc::F_SETFD, libc::F_DUPFD_CLOEXEC])?;
    b.tgkill(pid, &[kick_signal()])
}

/// A page sharing pass: pause (kicks), the page map, the template files (opened, created
/// once, checked), and the mappings that put template pages or fresh zero pages in place of
/// guest pages (`MAP_FIXED` over guest memory, private; templates read-only shared).
fn page_sharing(b: &mut Builder, pid: u32) -> Result<(), JailError> {
    b.any(&[
        libc::SYS_openat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_fstat,
        // The standard library's create_dir_all and remove_file are mkdir(2) and unlink(2).
        libc::SYS_mkdir,
        libc::SYS_mkdirat,
        libc::SYS_linkat,
        libc::SYS_unlink,
        libc::SYS_unlinkat,
        libc::SYS_fchmod,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_lseek,
        libc::SYS_pread64,
        libc::SYS_getdents64,
        libc::SYS_geteuid,
        // A domain's copy of the captured kernel text (std::io::copy between two files:
        // copy_file_range, sendfile where that is refused): bytes between descriptors it holds.
        libc::SYS_copy_file_range,
        libc::SYS_sendfile,
    ]);
    // The initrd's descriptor is duplicated to map it (F_DUPFD_CLOEXEC).
    b.fcntls(&[
        libc::F_GETFL,
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_DUPFD_CLOEXEC,
    ])?;
    // Pages mapped over guest RAM get guest RAM's marks again (vmm::memory::mark_guest_ram):
    // out of core dumps, and the mapping's name.
    b.madvise(&[libc::MADV_DONTDUMP])?;
    b.when(
        libc::SYS_prctl,
        &[&[
            (0, Len::Dword, Op::Eq, libc::PR_SET_VMA as u64),
            (1, Len::Qword, Op::Eq, libc::PR_SET_VMA_ANON_NAME as u64),
        ]],
    )?;
    let fixed_private = (libc::MAP_PRIVATE | libc::MAP_FIXED) as u64;
    let fixed_private_anon = fixed_private | libc::MAP_ANONYMOUS as u64;
    let shared = libc::MAP_SHARED as u64;
    b.when(
        libc::SYS_mmap,
        &[
            // Template pages over guest memory, private (copy-on-write).
            &[
                (2, Len::Dword, Op::MaskedEq(PROT_EXEC), 0),
                (3, Len::Dword, Op::MaskedEq(MAP_PINNED), fixed_private),
            ],
            // Fresh zero pages over guest memory.
            &[
                (2, Len::Dword, Op::MaskedEq(PROT_EXEC), 0),
                (3, Len::Dword, Op::MaskedEq(MAP_PINNED), fixed_private_anon),
            ],
            // A template file, read-only.
            &[
                (2, Len::Dword, Op::Eq, libc::PROT_READ as u64),
                (3, Len::Dword, Op::MaskedEq(MAP_PINNED), shared),
            ],
        ],
    )?;
    b.tgkill(pid, &[kick_signal()])
}

/// The allowed system calls of `role` for a VM with `needs`, in threads of process `pid`.
pub fn rules(role: Role, needs: Needs, pid: u32) -> Result<Vec<Allowed>, JailError> {
    let mut b = Builder::new(role);
    base(&mut b, pid)?;
    match role {
        Role::Vcpu => vcpu(&mut b, needs)?,
        Role::DeviceLoop => {
            device_loop(&mut b)?;
            if needs.shared_fs {
                fs_worker(&mut b)?;
            }
        }
        Role::FsWorker => fs_worker(&mut b)?,
        Role::Control => control(&mut b, pid)?,
        Role::PageSharing => page_sharing(&mut b, pid)?,
    }
    b.list.sort_by_key(|(nr, _)| *nr);
    Ok(b.list)
}
