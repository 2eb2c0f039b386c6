//! The filters compile for every role, and a process that installed one dies of SIGSYS at the
//! first call outside it while calls inside it work. Each check runs in a forked child (the
//! filter is irrevocable): the child makes raw system calls only, and reports by its exit.

use super::filters::{self, KVM_RUN, KVM_SET_USER_MEMORY_REGION};
use super::*;

const NEEDS: [Needs; 4] = [
    Needs {
        vfio: false,
        shared_fs: false,
    },
    Needs {
        vfio: true,
        shared_fs: false,
    },
    Needs {
        vfio: false,
        shared_fs: true,
    },
    Needs {
        vfio: true,
        shared_fs: true,
    },
];

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The child exited with this code (the call was let through).
    Exited(i32),
    /// The child was killed by this signal.
    Killed(i32),
}

const KILLED: Outcome = Outcome::Killed(libc::SIGSYS);

/// Forks a child that installs `filter`, runs `call` (raw system calls only, no allocation:
/// the parent has other threads) and exits with what `call` returns, or 0 if it returns
/// non-negative, 1 otherwise.
fn in_child(filter: &ThreadFilter, call: impl Fn() -> i64) -> Outcome {
    let program = filter.program();
    // SAFETY: the child only makes raw system calls (prctl, seccomp, the call under test,
    // exit) on memory that fork copied; it never returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match install_raw(program) {
            Err(_) => 99,
            Ok(()) => {
                if call() >= 0 {
                    0
                } else {
                    1
                }
            }
        };
        // SAFETY: ends this (single-threaded) child; `SYS_exit` is in every role's list.
        unsafe { libc::syscall(libc::SYS_exit, code) };
        unreachable!();
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
    if libc::WIFSIGNALED(status) {
        Outcome::Killed(libc::WTERMSIG(status))
    } else {
        let code = libc::WEXITSTATUS(status);
        assert_ne!(code, 99, "the child could not install the filter");
        Outcome::Exited(code)
    }
}

// The calls the tests make, raw (no allocation in the child).

fn open_host_file() -> i64 {
    // SAFETY: a NUL-terminated path literal; the descriptor (if any) dies with the child.
    unsafe {
        libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            c"/etc/passwd".as_ptr(),
            libc::O_RDONLY,
        )
    }
}

fn exec_true() -> i64 {
    let argv = [c"/bin/true".as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null::<libc::c_char>()];
    // SAFETY: NUL-terminated argv and envp arrays of valid C strings.
    unsafe {
        libc::syscall(
            libc::SYS_execve,
            c"/bin/true".as_ptr(),
            argv.as_ptr(),
            envp.as_ptr(),
        )
    }
}

fn socket(domain: i32) -> i64 {
    // SAFETY: plain syscall with integer arguments.
    unsafe { libc::syscall(libc::SYS_socket, domain, libc::SOCK_STREAM, 0) }
}

fn ptrace_parent() -> i64 {
    // SAFETY: plain syscall with integer arguments (PTRACE_ATTACH to the parent).
    unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_ATTACH, libc::getppid(), 0, 0) }
}

fn ioctl(request: u64) -> i64 {
    // SAFETY: on fd -1 the kernel fails with EBADF before looking at the argument.
    let r = unsafe { libc::syscall(libc::SYS_ioctl, -1, request, 0) };
    if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EBADF) {
        0
    } else {
        -1
    }
}

fn mmap(prot: i32, flags: i32) -> i64 {
    // SAFETY: a fresh anonymous mapping (or a fixed one over a page this call maps first).
    unsafe {
        libc::syscall(
            libc::SYS_mmap,
            std::ptr::null::<u8>(),
            4096,
            prot,
            flags,
            -1,
            0,
        )
    }
}

fn fcntl(cmd: i32) -> i64 {
    // SAFETY: fcntl on stdin with an integer argument (F_SETOWN to ourselves).
    unsafe { libc::syscall(libc::SYS_fcntl, 0, cmd, 0) }
}

#[test]
fn ioctl_numbers_are_the_kernels() {
    // linux/kvm.h: KVM_RUN = _IO(KVMIO, 0x80), KVM_SET_USER_MEMORY_REGION =
    // _IOW(KVMIO, 0x46, struct kvm_userspace_memory_region) with a 32-byte struct.
    assert_eq!(KVM_RUN() as u64, 0xae80);
    assert_eq!(KVM_SET_USER_MEMORY_REGION() as u64, 0x4020_ae46);
    assert_eq!(filters::BLKDISCARD, 0x1277);
    assert_eq!(filters::BLKZEROOUT, 0x127f);
}

#[test]
fn every_role_compiles_for_every_vm_shape() {
    for role in Role::ALL {
        for needs in NEEDS {
            let f = ThreadFilter::new(role, needs).unwrap();
            assert!(f.syscalls() > 10, "{role:?} {needs:?}");
            // A classic BPF program is at most 4096 instructions.
            assert!(f.instructions() < 4096, "{role:?}: {}", f.instructions());
            for name in allowed_names(role, needs).unwrap() {
                assert_ne!(name, "?", "{role:?} allows a call the name table lacks");
            }
        }
    }
}

/// The table docs/security.md shows (`cargo test -p vmm --lib jail -- --nocapture`).
#[test]
fn print_the_allowed_counts() {
    let plain = Needs::default();
    let fs = Needs {
        shared_fs: true,
        ..plain
    };
    let vfio = Needs {
        vfio: true,
        ..plain
    };
    println!("| role | system calls allowed | |");
    println!("|---|---|---|");
    for role in Role::ALL {
        let n = ThreadFilter::new(role, plain).unwrap().syscalls();
        let extra = match role {
            Role::Vcpu => format!(
                "{} with VFIO",
                ThreadFilter::new(role, vfio).unwrap().syscalls()
            ),
            Role::DeviceLoop => format!(
                "{} when it also serves virtio-fs",
                ThreadFilter::new(role, fs).unwrap().syscalls()
            ),
            _ => String::new(),
        };
        println!(
            "| {} | {n} | {extra} | {}",
            role.name(),
            allowed_names(role, plain).unwrap().join(" ")
        );
    }
    // The vCPU's list is the narrowest; the figures docs/security.md quotes.
    assert_eq!(ThreadFilter::new(Role::Vcpu, plain).unwrap().syscalls(), 28);
}

#[test]
fn no_role_may_exec_open_network_sockets_or_ptrace() {
    for role in Role::ALL {
        let f = ThreadFilter::new(role, Needs::default()).unwrap();
        assert_eq!(in_child(&f, exec_true), KILLED, "{role:?}: execve");
        assert_eq!(
            in_child(&f, || socket(libc::AF_INET)),
            KILLED,
            "{role:?}: socket(AF_INET)"
        );
        assert_eq!(
            in_child(&f, || socket(libc::AF_NETLINK)),
            KILLED,
            "{role:?}: socket(AF_NETLINK)"
        );
        assert_eq!(in_child(&f, ptrace_parent), KILLED, "{role:?}: ptrace");
        // Executable memory: never.
        assert_eq!(
            in_child(&f, || mmap(
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS
            )),
            KILLED,
            "{role:?}: mmap PROT_EXEC"
        );
        // Anonymous private memory (the allocator): always.
        assert_eq!(
            in_child(&f, || mmap(
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS
            )),
            Outcome::Exited(0),
            "{role:?}: mmap of anonymous memory"
        );
    }
}

#[test]
fn only_the_file_roles_open_paths() {
    for role in Role::ALL {
        let f = ThreadFilter::new(role, Needs::default()).unwrap();
        let expected = match role {
            Role::FsWorker | Role::PageSharing => Outcome::Exited(0),
            _ => KILLED,
        };
        assert_eq!(in_child(&f, open_host_file), expected, "{role:?}: openat");
    }
    // The device loop opens files only when it serves a shared directory.
    let f = ThreadFilter::new(
        Role::DeviceLoop,
        Needs {
            shared_fs: true,
            vfio: false,
        },
    )
    .unwrap();
    assert_eq!(in_child(&f, open_host_file), Outcome::Exited(0));
}

#[test]
fn vcpu_ioctls_are_checked() {
    let plain = ThreadFilter::new(Role::Vcpu, Needs::default()).unwrap();
    assert_eq!(
        in_child(&plain, || ioctl(KVM_RUN() as u64)),
        Outcome::Exited(0)
    );
    // Memory slots move only for VFIO BARs.
    assert_eq!(
        in_child(&plain, || ioctl(KVM_SET_USER_MEMORY_REGION() as u64)),
        KILLED
    );
    // Another KVM ioctl (KVM_CREATE_VM), a terminal ioctl, a tap ioctl: killed.
    for request in [0xae01, libc::TIOCSTI, libc::TUNSETIFF] {
        assert_eq!(in_child(&plain, || ioctl(request)), KILLED, "{request:#x}");
    }
    let vfio = ThreadFilter::new(
        Role::Vcpu,
        Needs {
            vfio: true,
            shared_fs: false,
        },
    )
    .unwrap();
    assert_eq!(
        in_child(&vfio, || ioctl(KVM_SET_USER_MEMORY_REGION() as u64)),
        Outcome::Exited(0)
    );
}

#[test]
fn device_loop_arguments_are_checked() {
    let f = ThreadFilter::new(Role::DeviceLoop, Needs::default()).unwrap();
    assert_eq!(in_child(&f, || socket(libc::AF_UNIX)), Outcome::Exited(0));
    assert_eq!(
        in_child(&f, || ioctl(filters::BLKDISCARD)),
        Outcome::Exited(0)
    );
    assert_eq!(in_child(&f, || ioctl(KVM_RUN() as u64)), KILLED);
    assert_eq!(in_child(&f, || fcntl(libc::F_GETFL)), Outcome::Exited(0));
    assert_eq!(in_child(&f, || fcntl(libc::F_SETOWN)), KILLED);
    // A fixed or shared mapping (over guest memory, of a file): not from this thread.
    assert_eq!(
        in_child(&f, || mmap(
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS
        )),
        KILLED
    );
}

#[test]
fn signals_go_only_to_this_process() {
    let pid = std::process::id() as i64;
    let f = ThreadFilter::new(Role::Control, Needs::default()).unwrap();
    let kick = i64::from(crate::kick::kick_signal());
    // The kick to a thread of the process the filter was built for (no such thread: ESRCH,
    // but the call is let through).
    let tgkill = |tgid: i64| {
        // SAFETY: plain syscall with integer arguments; thread id 0x3fff_fff0 does not exist.
        let r = unsafe { libc::syscall(libc::SYS_tgkill, tgid, 0x3fff_fff0_i64, kick) };
        let esrch = std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if r < 0 && esrch {
            0
        } else {
            -1
        }
    };
    assert_eq!(in_child(&f, || tgkill(pid)), Outcome::Exited(0));
    // To any other process (here the child itself, which the filter does not name): killed.
    assert_eq!(
        in_child(&f, || {
            // SAFETY: getpid has no arguments.
            let me = unsafe { libc::getpid() };
            tgkill(me.into())
        }),
        KILLED
    );
    // kill(2) is no role's.
    assert_eq!(
        // SAFETY: signal 0 to the parent only checks that it exists.
        in_child(&f, || unsafe { libc::syscall(libc::SYS_kill, pid, 0) }),
        KILLED
    );
}

#[test]
fn page_sharing_maps_templates_read_only() {
    let f = ThreadFilter::new(Role::PageSharing, Needs::default()).unwrap();
    // A template file is mapped shared and read-only (anonymous here: the flags are what the
    // filter checks), never writable or executable.
    let shared = libc::MAP_SHARED | libc::MAP_ANONYMOUS;
    assert_eq!(in_child(&f, || mmap(libc::PROT_READ, shared)), KILLED);
    assert_eq!(
        in_child(&f, || mmap(libc::PROT_READ, libc::MAP_SHARED)),
        Outcome::Exited(1),
        "a shared read-only file mapping is let through (here it fails: no file)"
    );
    assert_eq!(
        in_child(&f, || mmap(
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED
        )),
        KILLED
    );
    // Only the mapping name of prctl.
    // SAFETY: PR_SET_DUMPABLE with an integer argument.
    let dumpable = || unsafe { libc::syscall(libc::SYS_prctl, libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
    assert_eq!(in_child(&f, dumpable), KILLED);
}
