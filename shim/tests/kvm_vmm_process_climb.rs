//! The pod's share in a VMM process of its own (vmm::jail::split), attacked from inside: a
//! thread of the confined process, under the device loop's real filter with the virtio-fs
//! server's list (what a guest that takes over the file server holds), tries `openat(fd,
//! "../../…/<marker>")` from every directory descriptor of the process (the file server's
//! `/proc/self/fd` among them) and from the share's root opened by the path the file server
//! opens it by, to reach a marker file on the host outside the share. Then the share's
//! propagation: a container's rootfs the shim mounts under the share after the VM started
//! appears in the VMM's root and goes when the shim unmounts it, and a mount namespace made on
//! the host while the pod lives (a slave, as systemd's services are) keeps none of the pod's
//! mounts after the pod is gone. Needs root, /dev/kvm and the built test guests.
//!
//! Second test: each thread role that makes a call outside its filter's list (`openat` of a
//! host path, `socket(AF_INET)`, `execve`, `ptrace`) ends its VMM process by `SIGSYS`, with the
//! jail's report line (thread and system call) on the process's standard error, which is the
//! shim's log, and "killed by its seccomp filter" as the VM's end (the pod's exit reason).
//!
//! `harness = false`: this executable is also the VMM process (`<exe> __vmm <fd> <work>`), so
//! that the attacking thread runs in it ([`vmm::jail::split::serve_with`]); the product binary
//! has no such thread.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod common;
use common::guest;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use shim::resources::storage::{PodShare, RootfsMount};
use shim::state::StateDir;
use vmm::jail::split::{
    HostFiles, SharedFsDescription, SplitError, VmDescription, VmmProcess, VsockDescription,
};
use vmm::jail::{Needs, Role, ThreadFilter};

/// The marker file the attacker wants (an absolute host path), given to the VMM process.
const MARKER_ENV: &str = "MICROVM_TEST_CLIMB_MARKER";
/// The share's path, which the file server opens its root by.
const SHARE_ENV: &str = "MICROVM_TEST_CLIMB_SHARE";
/// Which attack the VMM process's extra thread makes: `climb`, or `sigsys:<n>` (the n-th of
/// [`FORBIDDEN`]).
const ATTACK_ENV: &str = "MICROVM_TEST_ATTACK";
/// A role and a call outside its list: (role, the call's name, its number).
const FORBIDDEN: [(Role, &str, libc::c_long); 5] = [
    (Role::Vcpu, "openat", libc::SYS_openat),
    (Role::DeviceLoop, "socket", libc::SYS_socket),
    (Role::FsWorker, "execve", libc::SYS_execve),
    (Role::Control, "ptrace", libc::SYS_ptrace),
    (Role::PageSharing, "socket", libc::SYS_socket),
];
/// What the attacking thread found, in the work folder.
const RESULT: &str = "climb.txt";
const MARKER_TEXT: &str = "a host file outside the share";

// ---- In the VMM process ----

/// The attacker: install the file server's filter, then climb from every directory descriptor
/// and from the share's root, and write what each attempt gave to `<work>/climb.txt`.
fn climb(work: PathBuf, marker: PathBuf, share: PathBuf) {
    let mut out = String::new();
    let filter = ThreadFilter::new(
        Role::DeviceLoop,
        Needs {
            vfio: false,
            shared_fs: true,
        },
    );
    match filter.map(|f| f.install()) {
        Ok(Ok(())) => {}
        other => {
            let _ = std::fs::write(work.join(RESULT), format!("filter {other:?}\n"));
            return;
        }
    }
    let up = "../".repeat(64);
    let target = format!("{up}{}", marker.strip_prefix("/").unwrap().display());
    let try_from = |fd: BorrowedFd<'_>, label: &str, out: &mut String| {
        let kind = match rustix::fs::fstatfs(fd) {
            Ok(s) if s.f_type == libc::PROC_SUPER_MAGIC => "proc",
            Ok(_) => "dir",
            Err(e) => {
                out.push_str(&format!("{label} fstatfs {e}\n"));
                return;
            }
        };
        match rustix::fs::openat(
            fd,
            target.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            Ok(f) => {
                let mut buf = [0u8; 64];
                let n = rustix::io::read(&f, &mut buf).unwrap_or(0);
                out.push_str(&format!(
                    "{label} {kind} reached {}\n",
                    String::from_utf8_lossy(&buf[..n])
                ));
            }
            Err(e) => out.push_str(&format!("{label} {kind} refused {e}\n")),
        }
    };
    for n in 0..1024 {
        // SAFETY: only fstat through a borrowed number; a closed number gives EBADF.
        let fd = unsafe { BorrowedFd::borrow_raw(n) };
        match rustix::fs::fstat(fd) {
            Ok(st) if rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir() => {
                try_from(fd, &format!("fd{n}"), &mut out)
            }
            _ => {}
        }
    }
    // The file server's root: it opens the share by this path at the guest's INIT.
    match rustix::fs::openat(
        rustix::fs::CWD,
        &share,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) {
        Ok(root) => try_from(root.as_fd(), "share-root", &mut out),
        Err(e) => out.push_str(&format!("share-root open {e}\n")),
    }
    out.push_str("done\n");
    let _ = std::fs::write(work.join(RESULT), out);
}

fn vmm_main(args: &[String]) -> i32 {
    let (Some(fd), Some(work)) = (args.get(2), args.get(3)) else {
        return 2;
    };
    let attack = std::env::var(ATTACK_ENV).unwrap_or_default();
    if let Some(n) = attack.strip_prefix("sigsys:") {
        let (role, _, nr) = FORBIDDEN[n.parse::<usize>().expect("a FORBIDDEN index")];
        return vmm::jail::split::serve_with(fd, Some(Box::new(move || forbidden(role, nr))));
    }
    let marker = PathBuf::from(std::env::var_os(MARKER_ENV).expect("the marker"));
    let share = PathBuf::from(std::env::var_os(SHARE_ENV).expect("the share"));
    let work = PathBuf::from(work);
    vmm::jail::split::serve_with(fd, Some(Box::new(move || climb(work, marker, share))))
}

/// A hijacked thread of `role`: its filter, then the call `nr`, which the filter forbids. The
/// process must die of it; if it returns, the thread says so on standard error and stops.
fn forbidden(role: Role, nr: libc::c_long) {
    let needs = Needs {
        vfio: false,
        shared_fs: false,
    };
    if let Err(e) = ThreadFilter::new(role, needs).and_then(|f| f.install()) {
        eprintln!("attack: the {} filter: {e}", role.name());
        return;
    }
    let path = c"/etc/hostname";
    let argv = [path.as_ptr(), std::ptr::null()];
    // SAFETY: each call takes only these valid, NUL-terminated pointers or plain numbers; the
    // filter traps it before the kernel runs it (and were it let through: openat of a host
    // file read-only, a socket, an exec of a non-executable file, PTRACE_TRACEME; none touches
    // this process's memory).
    let ret = unsafe {
        match nr {
            libc::SYS_openat => libc::syscall(nr, libc::AT_FDCWD, path.as_ptr(), libc::O_RDONLY),
            libc::SYS_socket => libc::syscall(nr, libc::AF_INET, libc::SOCK_STREAM, 0),
            libc::SYS_execve => libc::syscall(nr, path.as_ptr(), argv.as_ptr(), argv.as_ptr()),
            _ => libc::syscall(nr, libc::PTRACE_TRACEME, 0, 0, 0),
        }
    };
    eprintln!(
        "attack: system call {nr} on the {} thread returned {ret}",
        role.name()
    );
}

// ---- The test ----

/// The idle guest's kernel and /dev/kvm, opened as the shim opens them.
fn idle_files() -> HostFiles {
    HostFiles::open(&guest("idle"), None).unwrap()
}

fn description(work: &Path, share: &Path, files: &HostFiles) -> VmDescription {
    VmDescription {
        vcpus: 1,
        memory_mib: 64,
        kernel: files.kernel(),
        kvm_fd: files.kvm_fd(),
        console_log: work.join("console.log"),
        console_log_bytes: 1 << 20,
        work_dir: work.to_path_buf(),
        vsock: Some(VsockDescription {
            guest_cid: 3,
            uds_path: work.join("vsock.sock"),
        }),
        shared_fs: Some(SharedFsDescription {
            tag: "share".into(),
            host_dir: share.to_path_buf(),
        }),
        ..VmDescription::default()
    }
}

fn mounts_of(pid: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A state root that is a shared mount (as `/run` is on a systemd host), so that the pod's
/// share, mounted in it, is unmounted from namespaces made later too. Unmounted on drop.
struct SharedRoot(tempfile::TempDir);

impl SharedRoot {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        rustix::mount::mount_bind(p, p).unwrap();
        rustix::mount::mount_change(p, rustix::mount::MountPropagationFlags::SHARED).unwrap();
        SharedRoot(dir)
    }
}

impl Drop for SharedRoot {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(self.0.path(), rustix::mount::UnmountFlags::DETACH);
    }
}

/// The process holding the bystander namespace, killed on drop (a failed check included).
struct Bystander(std::process::Child);

impl Drop for Bystander {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn a_hijacked_file_server_cannot_climb_out_of_the_jail_and_the_share_propagates() {
    let root = SharedRoot::new();
    let state = StateDir::new(root.0.path(), "climb-pod").unwrap();
    state.create(std::process::id()).unwrap();
    let share = PodShare::create(&state).unwrap();
    let work = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("marker");
    std::fs::write(&marker, MARKER_TEXT).unwrap();
    // SAFETY: set before any thread of this test exists (the harness is ours); the VMM
    // process inherits the environment.
    std::env::set_var(MARKER_ENV, &marker);
    std::env::set_var(SHARE_ENV, share.path());

    // A namespace made on the host while the pod lives, a slave of the host's mounts.
    let bystander = Bystander(
        Command::new("unshare")
            .args(["--mount", "--propagation", "slave", "sleep", "120"])
            .spawn()
            .unwrap(),
    );
    let by_pid = bystander.0.id().to_string();
    wait_until("the bystander's namespace", || {
        std::fs::read_link(format!("/proc/{by_pid}/ns/mnt")).ok()
            != std::fs::read_link("/proc/self/ns/mnt").ok()
    });

    let files = idle_files();
    let desc = description(work.path(), share.path(), &files);
    let exe = std::env::current_exe().unwrap();
    let mut vmm = VmmProcess::spawn(&exe, &desc, None, Duration::from_secs(30)).unwrap();
    let pid = vmm.pid().to_string();
    let result = work.path().join(RESULT);
    wait_until("the attacker's report", || {
        std::fs::read_to_string(&result).is_ok_and(|t| t.ends_with("done\n"))
            || vmm.wait_timeout(Duration::ZERO).is_some()
    });
    assert!(
        vmm.wait_timeout(Duration::ZERO).is_none(),
        "the VMM process ended (a call outside the file server's filter?)"
    );
    let report = std::fs::read_to_string(&result).unwrap();
    eprintln!("what the confined file server's thread reached:\n{report}");
    assert!(
        report.lines().any(|l| l.contains(" proc ")),
        "the file server's /proc/self/fd was tried: {report}"
    );
    assert!(
        report.lines().any(|l| l.starts_with("share-root ")),
        "{report}"
    );
    assert!(
        !report.contains("reached"),
        "a descriptor of the VMM process leads out of its root to the host: {report}"
    );

    // A container's rootfs mounted under the share after the VM started reaches the VMM's
    // copy; its unmount does too.
    share
        .share_container(
            "c1",
            &[RootfsMount {
                fs_type: "tmpfs".into(),
                source: "tmpfs".into(),
                options: vec!["size=1m".into()],
            }],
            Path::new("/nonexistent"),
            &[],
        )
        .unwrap();
    let rootfs = share.path().join("c1/rootfs");
    std::fs::write(rootfs.join("hello"), "from the host").unwrap();
    let in_vmm = PathBuf::from(format!("/proc/{pid}/root"))
        .join(rootfs.strip_prefix("/").unwrap())
        .join("hello");
    assert_eq!(
        std::fs::read_to_string(&in_vmm).unwrap(),
        "from the host",
        "the container's rootfs in the VMM's root"
    );
    let rootfs_text = rootfs.display().to_string();
    assert!(
        mounts_of(&by_pid).contains(&rootfs_text),
        "the bystander got the rootfs too"
    );
    share.unshare_container("c1").unwrap();
    let c1 = share.path().join("c1").display().to_string();
    wait_until("the rootfs to leave the VMM's namespace", || {
        !mounts_of(&pid).contains(&c1)
    });

    // The pod goes: the VMM, then every mount of the state directory.
    let end = vmm.stop(Duration::from_secs(10));
    assert_eq!(end.exit, Ok(0), "{end:?}");
    drop(share);
    state.cleanup().unwrap();
    let state_text = state.path().display().to_string();
    let host = mounts_of("self");
    assert!(!host.contains(&state_text), "left on the host: {host}");
    let by = mounts_of(&by_pid);
    drop(bystander);
    assert!(
        !by.contains(&state_text),
        "a namespace made while the pod lived still holds its mounts: {by}"
    );
}

fn each_thread_role_that_makes_a_forbidden_call_ends_its_vmm_process_with_the_reason() {
    let share = tempfile::tempdir().unwrap();
    for (n, (role, call, nr)) in FORBIDDEN.iter().enumerate() {
        let work = tempfile::tempdir().unwrap();
        let log_path = work.path().join("stderr.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let files = idle_files();
        let desc = VmDescription {
            shared_fs: None,
            ..description(work.path(), share.path(), &files)
        };
        // SAFETY: the harness is ours and runs one test at a time, single-threaded here; the
        // VMM process inherits the environment.
        std::env::set_var(ATTACK_ENV, format!("sigsys:{n}"));
        let exe = std::env::current_exe().unwrap();
        // The attacking thread starts just before the VMM process answers `Started`: under
        // load it can kill the process before the answer, and the start fails with that end
        // (its description is the one of a SIGSYS end, checked below, so a death by SIGSYS).
        let describe =
            match VmmProcess::spawn(&exe, &desc, Some(log.as_fd()), Duration::from_secs(30)) {
                Ok(mut vmm) => {
                    let end = vmm.wait_timeout(Duration::from_secs(20));
                    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                    let Some(end) = end else {
                        let _ = vmm.stop(Duration::from_secs(5));
                        panic!(
                            "{} thread's {call}: the VMM process lives on\n{text}",
                            role.name()
                        );
                    };
                    assert!(
                        end.by_seccomp(),
                        "{} thread's {call}: {end:?}\n{text}",
                        role.name()
                    );
                    end.describe()
                }
                Err(SplitError::Ended(describe)) => describe,
                Err(e) => panic!("{} thread's {call}: the start: {e}", role.name()),
            };
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        eprintln!("{} thread, {call}: {describe}", role.name());
        assert!(
            describe.contains("killed by its seccomp filter"),
            "{} thread's {call}: {describe}\n{text}",
            role.name()
        );
        let line = format!("made system call {nr}, which its seccomp filter forbids");
        assert!(
            text.lines()
                .any(|l| l.starts_with("vmm jail: thread ") && l.contains(&line)),
            "{} thread's {call}: no report line in the VMM's standard error:\n{text}",
            role.name()
        );
    }
    std::env::remove_var(ATTACK_ENV);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(vmm::jail::split::SUBCOMMAND) {
        std::process::exit(vmm_main(&args));
    }
    const TESTS: [(&str, fn()); 2] = [
        (
            "a_hijacked_file_server_cannot_climb_out_of_the_jail_and_the_share_propagates",
            a_hijacked_file_server_cannot_climb_out_of_the_jail_and_the_share_propagates,
        ),
        (
            "each_thread_role_that_makes_a_forbidden_call_ends_its_vmm_process_with_the_reason",
            each_thread_role_that_makes_a_forbidden_call_ends_its_vmm_process_with_the_reason,
        ),
    ];
    if args.iter().any(|a| a == "--list") {
        for (name, _) in TESTS {
            println!("{name}: test");
        }
        return;
    }
    let filters: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with('-')).collect();
    // `--test-threads N`, `--skip X` take a value: not filters.
    let values: Vec<&String> = args
        .windows(2)
        .filter(|w| w[0] == "--test-threads" || w[0] == "--skip")
        .map(|w| &w[1])
        .collect();
    let filters: Vec<&&String> = filters.iter().filter(|f| !values.contains(f)).collect();
    let chosen: Vec<(&str, fn())> = TESTS
        .into_iter()
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
        .collect();
    // The lines libtest prints, which the CI's count reads.
    println!("running {} tests", chosen.len());
    let (mut passed, mut failed) = (0, 0);
    for (name, test) in &chosen {
        if std::panic::catch_unwind(*test).is_ok() {
            println!("test {name} ... ok");
            passed += 1;
        } else {
            println!("test {name} ... FAILED");
            failed += 1;
        }
    }
    let filtered = TESTS.len() - chosen.len();
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!(
        "test result: {verdict}. {passed} passed; {failed} failed; 0 ignored; 0 measured; {filtered} filtered out"
    );
    if failed > 0 {
        std::process::exit(101);
    }
}
