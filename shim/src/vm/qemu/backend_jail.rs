//! vhost-device-vsock's jail: the vsock backend parses the guest's vsock rings, so it runs with
//! nothing of the host's but its own sockets.
//!
//! Before the fork the shim opens the binary (the file that is checked is the file that runs),
//! refuses one that needs a dynamic loader ([`check_static`]: its root has none), prepares the
//! argument vector and compiles the seccomp filter ([`BackendJail::new`]). In the child, while
//! still root ([`BackendJail::enter`]): new mount, network, IPC and UTS namespaces, its mounts
//! private, the vsock folder bind-mounted on itself (nosuid, nodev, noexec) and made its root
//! with `pivot_root` (the host's root unmounted from its namespace), `chdir("/")`, the drop to
//! the VM's jail id and `no_new_privs`. Last ([`BackendJail::exec_last`], after the
//! parent-death signal): the filter is loaded and the binary is executed through its descriptor
//! (`execveat(fd, "", .., AT_EMPTY_PATH)`), with an empty environment.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

/// Bytes of the binary read for its ELF and program headers (they come first in any linker's
/// output; a file whose headers lie further is refused).
const HEADERS_READ: usize = 64 << 10;

/// At most this many arguments (with `argv[0]`); the pre-exec code builds its pointer vector on
/// its stack.
const MAX_ARGS: usize = 16;

/// Why the vsock backend could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum BackendJailError {
    #[error("cannot open {binary}: {source}")]
    Open { binary: PathBuf, source: io::Error },
    #[error("{binary} cannot run in vhost-device-vsock's jail: {reason}. The QEMU backend runs it chrooted into the pod's vsock folder, which holds no dynamic loader or library: install the static build with scripts/install-vhost-device-vsock.sh")]
    NotStatic { binary: PathBuf, reason: String },
    #[error("vhost-device-vsock's argument {0:?} holds a NUL byte")]
    Argument(PathBuf),
    #[error("vhost-device-vsock takes at most {MAX_ARGS} arguments")]
    TooManyArguments,
    #[error("building vhost-device-vsock's seccomp filter: {0}")]
    Filter(String),
}

/// Checks that `file` is an x86-64 ELF executable that needs no program interpreter (no
/// `PT_INTERP`: a static executable or static PIE), reading only its headers.
pub fn check_static(file: &File) -> Result<(), String> {
    use object::elf::{FileHeader64, EM_X86_64, ET_DYN, ET_EXEC, PT_INTERP};
    use object::read::elf::{FileHeader, ProgramHeader};
    use object::LittleEndian;
    let mut buf = vec![0u8; HEADERS_READ];
    let mut len = 0;
    while len < buf.len() {
        match file.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading it: {e}")),
        }
    }
    let data = &buf[..len];
    if !data.starts_with(b"\x7fELF") {
        return Err(if data.starts_with(b"#!") {
            "it is a script (its interpreter is not in the jail)".into()
        } else {
            "it is not an ELF executable".into()
        });
    }
    let header = FileHeader64::<LittleEndian>::parse(data)
        .map_err(|e| format!("not a 64-bit little-endian ELF file: {e}"))?;
    let endian = header
        .endian()
        .map_err(|e| format!("bad ELF header: {e}"))?;
    if header.e_machine(endian) != EM_X86_64 {
        return Err("it is not an x86-64 executable".into());
    }
    if !matches!(header.e_type(endian), ET_EXEC | ET_DYN) {
        return Err("it is not an ELF executable".into());
    }
    let phdrs = header
        .program_headers(endian, data)
        .map_err(|e| format!("its program headers are unreadable: {e}"))?;
    if let Some(interp) = phdrs.iter().find(|p| p.p_type(endian) == PT_INTERP) {
        let name = interp
            .data(endian, data)
            .ok()
            .map(|d| String::from_utf8_lossy(d.split(|b| *b == 0).next().unwrap_or(d)).into_owned())
            .unwrap_or_else(|| "?".into());
        return Err(format!(
            "it is dynamically linked (its program interpreter is {name})"
        ));
    }
    Ok(())
}

/// What the vsock backend's child needs, all made before the fork.
#[derive(Debug)]
pub struct BackendJail {
    binary: File,
    root: CString,
    args: Vec<CString>,
    id: u32,
    /// Loaded first: `clone3` fails with `ENOSYS`, so that the C library creates its threads
    /// with `clone`, whose flags the main filter checks.
    no_clone3: BpfProgram,
    filter: BpfProgram,
}

impl BackendJail {
    /// Opens and checks `binary`, and prepares its run with `args` (`args[0]` is its `argv[0]`),
    /// rooted at `root` as the jail id `id`.
    pub fn new(
        binary: &Path,
        root: &Path,
        args: &[&OsStr],
        id: u32,
    ) -> Result<Self, BackendJailError> {
        // Close-on-exec (std's default): the binary's own descriptor closes as it starts.
        let file = File::open(binary).map_err(|source| BackendJailError::Open {
            binary: binary.to_path_buf(),
            source,
        })?;
        check_static(&file).map_err(|reason| BackendJailError::NotStatic {
            binary: binary.to_path_buf(),
            reason,
        })?;
        let rules = filter_rules(file.as_raw_fd())?;
        if args.len() >= MAX_ARGS {
            return Err(BackendJailError::TooManyArguments);
        }
        let c = |s: &OsStr| {
            CString::new(s.as_bytes()).map_err(|_| BackendJailError::Argument(PathBuf::from(s)))
        };
        Ok(BackendJail {
            binary: file,
            root: c(root.as_os_str())?,
            args: args.iter().map(|a| c(a)).collect::<Result<_, _>>()?,
            id,
            no_clone3: compile(
                [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
                SeccompAction::Allow,
                SeccompAction::Errno(libc::ENOSYS as u32),
            )?,
            filter: compile(
                rules.into_iter().collect(),
                SeccompAction::KillProcess,
                SeccompAction::Allow,
            )?,
        })
    }

    /// Registers the first part of the child's confinement (namespaces, root, ids,
    /// `no_new_privs`): before the parent-death signal, which a change of uid clears.
    pub fn enter(&self, cmd: &mut Command) {
        let root = self.root.clone();
        let id = self.id as libc::c_long;
        // SAFETY: the closure runs in the forked child before exec and makes only raw system
        // calls (unshare, mount, chdir, pivot_root, umount2, setgroups, setresgid, setresuid,
        // prctl, write), which are async-signal-safe; it allocates nothing (the path was made
        // before the fork) and takes no lock. The set*id calls are the raw system calls, not
        // glibc's wrappers, which would try to signal the parent's other threads.
        unsafe {
            cmd.pre_exec(move || {
                let fail = |step: &[u8]| {
                    let err = io::Error::last_os_error();
                    // Its stderr is the backend's log file: the step names what failed.
                    libc::write(2, step.as_ptr().cast(), step.len());
                    Err(err)
                };
                let none = std::ptr::null::<libc::c_char>();
                let dot = c".".as_ptr();
                if libc::unshare(
                    libc::CLONE_NEWNS
                        | libc::CLONE_NEWNET
                        | libc::CLONE_NEWIPC
                        | libc::CLONE_NEWUTS,
                ) != 0
                {
                    return fail(b"microvm jail: unshare failed\n");
                }
                // Nothing of what follows reaches the host's mount namespace.
                if libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return fail(b"microvm jail: making the mounts private failed\n");
                }
                // Not recursive: nothing mounted under the folder comes along.
                if libc::mount(
                    root.as_ptr(),
                    root.as_ptr(),
                    none,
                    libc::MS_BIND,
                    std::ptr::null(),
                ) != 0
                    || libc::mount(
                        none,
                        root.as_ptr(),
                        none,
                        libc::MS_REMOUNT
                            | libc::MS_BIND
                            | libc::MS_NOSUID
                            | libc::MS_NODEV
                            | libc::MS_NOEXEC,
                        std::ptr::null(),
                    ) != 0
                {
                    return fail(b"microvm jail: bind-mounting the vsock folder failed\n");
                }
                // pivot_root(".", "."): the old root ends up on top of the new one, and is
                // then detached: the namespace holds the vsock folder and nothing else.
                if libc::chdir(root.as_ptr()) != 0
                    || libc::syscall(libc::SYS_pivot_root, dot, dot) != 0
                    || libc::umount2(dot, libc::MNT_DETACH) != 0
                    || libc::chdir(c"/".as_ptr()) != 0
                {
                    return fail(b"microvm jail: pivot_root into the vsock folder failed\n");
                }
                let no_groups = std::ptr::null::<libc::gid_t>();
                if libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, no_groups) != 0
                    || libc::syscall(libc::SYS_setresgid, id, id, id) != 0
                    || libc::syscall(libc::SYS_setresuid, id, id, id) != 0
                {
                    return fail(b"microvm jail: the drop to the jail id failed\n");
                }
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return fail(b"microvm jail: no_new_privs failed\n");
                }
                Ok(())
            });
        }
    }

    /// Registers the last step of the child: the filters, then the exec through the binary's
    /// descriptor. Register it after every other pre-exec step: it does not return on success
    /// (std's own exec never runs).
    pub fn exec_last(self, cmd: &mut Command) {
        let BackendJail {
            binary,
            args,
            no_clone3,
            filter,
            ..
        } = self;
        // SAFETY: the closure runs in the forked child before exec; it builds its pointer
        // vectors on its stack from strings made before the fork (no allocation), and makes
        // only the seccomp and execveat system calls (async-signal-safe). `binary`, `args` and
        // the programs are owned by the closure, which lives until the child execs or exits.
        unsafe {
            cmd.pre_exec(move || {
                let mut argv = [std::ptr::null::<libc::c_char>(); MAX_ARGS + 1];
                for (slot, arg) in argv.iter_mut().zip(&args) {
                    *slot = arg.as_ptr();
                }
                let envp = [std::ptr::null::<libc::c_char>()];
                for program in [&no_clone3, &filter] {
                    if let Err(e) = seccompiler::apply_filter(program) {
                        let err = match e {
                            seccompiler::Error::Seccomp(e) | seccompiler::Error::Prctl(e) => e,
                            _ => io::Error::from_raw_os_error(libc::EINVAL),
                        };
                        let msg = b"microvm jail: loading the seccomp filter failed\n";
                        libc::write(2, msg.as_ptr().cast(), msg.len());
                        return Err(err);
                    }
                }
                libc::syscall(
                    libc::SYS_execveat,
                    binary.as_raw_fd() as libc::c_long,
                    c"".as_ptr(),
                    argv.as_ptr(),
                    envp.as_ptr(),
                    libc::AT_EMPTY_PATH as libc::c_long,
                );
                Err(io::Error::last_os_error())
            });
        }
    }
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, BackendJailError> {
    let err = |e: &dyn std::fmt::Display| BackendJailError::Filter(e.to_string());
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| err(&e))?;
    let filter = SeccompFilter::new(rules, mismatch, matched, arch).map_err(|e| err(&e))?;
    BpfProgram::try_from(filter).map_err(|e| err(&e))
}

/// `__O_TMPFILE` of linux/fcntl.h (`O_TMPFILE` is it with `O_DIRECTORY`).
const O_TMPFILE_BIT: libc::c_int = 0o20000000;

/// One allowed system call and the rules of which one must match (none: any arguments).
type Allowed = (i64, Vec<SeccompRule>);

fn rule(conds: &[(u8, Len, Op, u64)]) -> Result<SeccompRule, BackendJailError> {
    let err = |e: seccompiler::BackendError| BackendJailError::Filter(e.to_string());
    let conds = conds
        .iter()
        .map(|(arg, len, op, value)| {
            SeccompCondition::new(*arg, len.clone(), op.clone(), *value).map_err(err)
        })
        .collect::<Result<Vec<_>, _>>()?;
    SeccompRule::new(conds).map_err(err)
}

/// The system calls vhost-device-vsock 0.3.0 makes, from its exec on, found by tracing it
/// (`strace -f`) through pod runs on the QEMU backend (docs/security.md says how to redo that).
/// `exec_fd` is the binary's descriptor: the one exec it makes is through that, and after it the
/// descriptor is closed (close-on-exec).
fn filter_rules(exec_fd: i32) -> Result<Vec<Allowed>, BackendJailError> {
    let mut list: Vec<Allowed> = [
        // The C library's and std's start: TLS, the main thread's stack limit, its own path
        // (refused: no /proc in its root), the hash seed.
        libc::SYS_arch_prctl,
        libc::SYS_brk,
        libc::SYS_getrandom,
        libc::SYS_prlimit64,
        libc::SYS_readlink,
        libc::SYS_rseq,
        libc::SYS_set_robust_list,
        libc::SYS_set_tid_address,
        libc::SYS_poll,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        // Threads: their creation (clone, below), scheduling, locks and end.
        libc::SYS_clone3,
        libc::SYS_futex,
        libc::SYS_gettid,
        libc::SYS_sched_getaffinity,
        libc::SYS_madvise,
        libc::SYS_munmap,
        libc::SYS_exit,
        libc::SYS_exit_group,
        // Its sockets (in its root), QEMU's vhost-user messages with their descriptors (guest
        // memory, eventfds), the caller's connections and its own to the `<uds>_<port>`
        // listeners.
        libc::SYS_accept4,
        libc::SYS_bind,
        libc::SYS_connect,
        libc::SYS_listen,
        libc::SYS_unlink,
        libc::SYS_recvfrom,
        libc::SYS_recvmsg,
        libc::SYS_sendmsg,
        libc::SYS_sendto,
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_close,
        libc::SYS_dup,
        libc::SYS_lseek,
        // Its event loops.
        libc::SYS_epoll_create1,
        libc::SYS_epoll_ctl,
        libc::SYS_epoll_wait,
        libc::SYS_eventfd2,
    ]
    .into_iter()
    .map(|nr| (nr, Vec::new()))
    .collect();
    let no_exec = libc::PROT_EXEC as u64;
    let ns_flags = (libc::CLONE_NEWNS
        | libc::CLONE_NEWCGROUP
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUSER
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET) as u64;
    let thread = (libc::CLONE_VM | libc::CLONE_THREAD) as u64;
    list.extend([
        // Its own exec through the binary's descriptor, which closes as it starts: no other
        // exec (`execve` is not allowed; the only files it can open, in its noexec root, or
        // none, are not executable).
        (
            libc::SYS_execveat,
            vec![rule(&[
                (0, Len::Dword, Op::Eq, exec_fd as u64),
                (4, Len::Dword, Op::Eq, libc::AT_EMPTY_PATH as u64),
            ])?],
        ),
        // Unix sockets only (its sockets and the caller's listeners): no network socket.
        (
            libc::SYS_socket,
            vec![rule(&[(0, Len::Dword, Op::Eq, libc::AF_UNIX as u64)])?],
        ),
        // Threads only, in its own namespaces: no process, no new (user) namespace.
        (
            libc::SYS_clone,
            vec![rule(&[(
                0,
                Len::Qword,
                Op::MaskedEq(thread | ns_flags),
                thread,
            )])?],
        ),
        // Read-only opens only (std looks for /proc/self/maps, which its root does not have):
        // no file created or written in its root.
        (
            libc::SYS_openat,
            vec![rule(&[(
                2,
                Len::Dword,
                Op::MaskedEq(
                    (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC | O_TMPFILE_BIT) as u64,
                ),
                libc::O_RDONLY as u64,
            )])?],
        ),
        // Non-blocking sockets, and env_logger's "is stderr a terminal".
        (
            libc::SYS_ioctl,
            vec![
                rule(&[(1, Len::Dword, Op::Eq, libc::FIONBIO)])?,
                rule(&[(1, Len::Dword, Op::Eq, libc::TCGETS)])?,
            ],
        ),
        // `try_clone` of a connection's stream.
        (
            libc::SYS_fcntl,
            vec![rule(&[(
                1,
                Len::Dword,
                Op::Eq,
                libc::F_DUPFD_CLOEXEC as u64,
            )])?],
        ),
        // Thread names.
        (
            libc::SYS_prctl,
            vec![rule(&[(0, Len::Dword, Op::Eq, libc::PR_SET_NAME as u64)])?],
        ),
        // Guest memory and its own: nothing executable is mapped after its start.
        (
            libc::SYS_mmap,
            vec![rule(&[(2, Len::Dword, Op::MaskedEq(no_exec), 0)])?],
        ),
        (
            libc::SYS_mprotect,
            vec![rule(&[(2, Len::Dword, Op::MaskedEq(no_exec), 0)])?],
        ),
    ]);
    #[cfg(test)]
    tests::drop_for_test(&mut list);
    Ok(list)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        /// A system call this thread's next filters leave out (an attack test's).
        static WITHOUT: Cell<Option<i64>> = const { Cell::new(None) };
    }

    pub(in super::super) fn leave_out_of_filter(nr: Option<i64>) {
        WITHOUT.with(|w| w.set(nr));
    }

    pub(super) fn drop_for_test(list: &mut Vec<Allowed>) {
        if let Some(nr) = WITHOUT.with(Cell::get) {
            list.retain(|(n, _)| *n != nr);
        }
    }

    #[test]
    fn a_dynamic_executable_or_a_script_is_refused_naming_why() {
        let dynamic = File::open("/bin/true").unwrap();
        let e = check_static(&dynamic).unwrap_err();
        assert!(
            e.contains("dynamically linked") && e.contains("ld-linux"),
            "{e}"
        );
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("s");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        let e = check_static(&File::open(&script).unwrap()).unwrap_err();
        assert!(e.contains("script"), "{e}");
        let empty = d.path().join("e");
        std::fs::write(&empty, "").unwrap();
        let e = check_static(&File::open(&empty).unwrap()).unwrap_err();
        assert!(e.contains("not an ELF"), "{e}");
    }

    #[test]
    fn the_filter_compiles_with_its_argument_checks() {
        let rules = filter_rules(3).unwrap();
        let with_args: Vec<i64> = rules
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(n, _)| *n)
            .collect();
        for nr in [
            libc::SYS_socket,
            libc::SYS_clone,
            libc::SYS_execveat,
            libc::SYS_mmap,
            libc::SYS_mprotect,
        ] {
            assert!(with_args.contains(&nr), "{nr}");
        }
        for nr in [
            libc::SYS_execve,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_ptrace,
            libc::SYS_memfd_create,
        ] {
            assert!(!rules.iter().any(|(n, _)| *n == nr), "{nr} allowed");
        }
        // docs/security.md and docs/qemu-backend.md give this count.
        assert_eq!(rules.len(), 48, "update the docs' count");
        let programs = compile(
            rules.into_iter().collect(),
            SeccompAction::KillProcess,
            SeccompAction::Allow,
        )
        .unwrap();
        assert!(!programs.is_empty());
    }
}
