//! The QEMU backend's processes run confined (docs/security.md, docs/qemu-backend.md), checked on
//! a running pod through CRI on a private containerd with `hypervisor = "qemu"` (on TCG here,
//! allowed by the test config). Needs root, Debian's containerd, QEMU, the Rust virtiofsd and
//! vhost-device-vsock (scripts/install-deps.sh), and `make kernel initrd`.
//!
//! For every thread of the pod's QEMU: seccomp filter mode (`Seccomp: 2`), `NoNewPrivs: 1`, no
//! capability, the pod's jail id (`jail_id_base` + the shim's pid) as every uid and gid and its
//! only group, and a root directory that is the VM's empty `qemu-root`. vhost-device-vsock: the
//! jail id, no capability, `NoNewPrivs: 1`, every thread under its seccomp filter, network, IPC,
//! UTS and mount namespaces of its own, and as its root the pod's vsock folder, which holds
//! nothing but its sockets, the only mount of its namespace.
//! virtiofsd (root: it serves the guest's files as their owners): every thread under its own
//! seccomp filter with `NoNewPrivs: 1` and no capability but the five it keeps (no `sys_chroot`
//! in any set), its root the pod's shared folder, and its own network, IPC and UTS namespaces.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use microvm_tests::microvm_pods::*;

/// `/proc/<pid>/task/<tid>/status` fields of every thread of `pid`.
fn thread_statuses(pid: i32) -> Vec<(String, String)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .flatten()
        .map(|t| {
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            (t.file_name().to_string_lossy().into_owned(), status)
        })
        .collect()
}

fn field<'a>(status: &'a str, name: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} in:\n{status}"))
}

fn ns(pid: i32, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

/// The pod's one process whose program (argv[0]) ends with `what` and whose command line
/// mentions its state dir.
fn pod_process(state: &Path, what: &str) -> i32 {
    let found: Vec<_> = processes_mentioning(&state.display().to_string())
        .into_iter()
        .filter(|(_, c)| c.split(' ').next().is_some_and(|p| p.ends_with(what)))
        .collect();
    assert_eq!(found.len(), 1, "one {what} of the pod: {found:?}");
    found[0].0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_backend_runs_qemu_and_its_helpers_confined() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    // The QEMU backend whatever MICROVM_TEST_HYPERVISOR says: this file is about it.
    let config = write_config_for(dir.path(), None, "qemu");
    let (ctrd, cri) = start(&config).await;
    let pod = run_pod(&ctrd, &cri, "microvm-qemu-jail").await;
    let state = Path::new(STATE_ROOT).join(&pod.id);
    let shims = shim_pids(&ctrd, &pod.id);
    assert_eq!(shims.len(), 1, "{shims:?}");
    let jail = shim::config::qemu::DEFAULT_JAIL_ID_BASE + shims[0] as u32;
    let jail_ids = format!("{jail}\t{jail}\t{jail}\t{jail}");

    // QEMU: every thread filtered, unprivileged, in its empty chroot.
    let qemu = pod_process(&state, "qemu-system-x86_64");
    let threads = thread_statuses(qemu);
    assert!(
        threads.len() > 1,
        "QEMU has its vCPU and I/O threads: {threads:?}"
    );
    for (tid, s) in &threads {
        assert_eq!(field(s, "Seccomp"), "2", "QEMU thread {tid}:\n{s}");
        assert_eq!(field(s, "NoNewPrivs"), "1", "QEMU thread {tid}");
        assert_eq!(field(s, "Uid"), jail_ids, "QEMU thread {tid}");
        assert_eq!(field(s, "Gid"), jail_ids, "QEMU thread {tid}");
        assert_eq!(field(s, "Groups"), jail.to_string(), "QEMU thread {tid}");
        assert_eq!(field(s, "CapEff"), "0000000000000000", "QEMU thread {tid}");
        assert_eq!(field(s, "CapPrm"), "0000000000000000", "QEMU thread {tid}");
    }
    let root = std::fs::read_link(format!("/proc/{qemu}/root")).unwrap();
    assert!(
        root.starts_with(&state) && root.ends_with("qemu-root"),
        "QEMU's root is {}",
        root.display()
    );
    let entries: Vec<_> = std::fs::read_dir(&root).unwrap().flatten().collect();
    assert!(entries.is_empty(), "QEMU's root holds {entries:?}");
    let meta = std::fs::metadata(&root).unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!((meta.uid(), meta.permissions().mode() & 0o7777), (0, 0o555));
    let cwd = std::fs::read_link(format!("/proc/{qemu}/cwd")).unwrap();
    assert_eq!(cwd, root, "QEMU's working directory is its root");

    // vhost-device-vsock: the jail id from its start, filtered, no host network, rooted in
    // its vsock folder.
    let vsock = pod_process(&state, "vhost-device-vsock");
    let vsock_threads = thread_statuses(vsock);
    assert!(
        vsock_threads.len() > 1,
        "vhost-device-vsock serves from threads of its own: {vsock_threads:?}"
    );
    for (tid, s) in vsock_threads {
        assert_eq!(field(&s, "Seccomp"), "2", "vhost-device-vsock thread {tid}");
        assert_eq!(
            field(&s, "Uid"),
            jail_ids,
            "vhost-device-vsock thread {tid}"
        );
        assert_eq!(
            field(&s, "Gid"),
            jail_ids,
            "vhost-device-vsock thread {tid}"
        );
        assert_eq!(field(&s, "CapEff"), "0000000000000000", "thread {tid}");
        assert_eq!(
            field(&s, "NoNewPrivs"),
            "1",
            "vhost-device-vsock thread {tid}"
        );
    }

    // Its root is its vsock folder (argv[0] names it: `<folder>/vhost-device-vsock`), made
    // its root by pivot_root in a mount namespace of its own: the same inode, seen from inside
    // as the root of its only mount, and holding only its sockets.
    let cmdline = std::fs::read(format!("/proc/{vsock}/cmdline")).unwrap();
    let argv0 = {
        use std::os::unix::ffi::OsStrExt;
        PathBuf::from(std::ffi::OsStr::from_bytes(
            cmdline.split(|b| *b == 0).next().unwrap(),
        ))
    };
    let vsock_dir = argv0.parent().unwrap().to_path_buf();
    assert!(vsock_dir.starts_with(&state), "{}", vsock_dir.display());
    let vsock_root = PathBuf::from(format!("/proc/{vsock}/root"));
    let (inside, folder) = (
        std::fs::metadata(&vsock_root).unwrap(),
        std::fs::metadata(&vsock_dir).unwrap(),
    );
    assert_eq!(
        (inside.dev(), inside.ino()),
        (folder.dev(), folder.ino()),
        "vhost-device-vsock's root is not its vsock folder {}",
        vsock_dir.display()
    );
    let names: Vec<String> = std::fs::read_dir(&vsock_root)
        .unwrap()
        .flatten()
        .map(|e| {
            use std::os::unix::fs::FileTypeExt;
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(
                e.file_type().unwrap().is_socket(),
                "{name} in vhost-device-vsock's root is not a socket"
            );
            name
        })
        .collect();
    assert!(
        // Its hybrid-vsock socket, the shim's `<uds>_<port>` listeners, and its vhost-user
        // socket until QEMU has connected.
        names.iter().any(|n| n == "vsock.sock")
            && names
                .iter()
                .all(|n| n == "vhost-user.sock" || n.starts_with("vsock.sock")),
        "vhost-device-vsock's root holds {names:?}"
    );
    assert_eq!(
        std::fs::read_link(&vsock_root).unwrap(),
        Path::new("/"),
        "its root is the root of its mount namespace"
    );
    let mounts = std::fs::read_to_string(format!("/proc/{vsock}/mountinfo")).unwrap();
    assert_eq!(
        mounts.lines().count(),
        1,
        "vhost-device-vsock's namespace holds one mount:\n{mounts}"
    );
    assert_ne!(
        ns(vsock, "mnt"),
        ns(std::process::id() as i32, "mnt"),
        "vhost-device-vsock is in the host's mount namespace"
    );
    let options = mounts.split_whitespace().nth(5).unwrap_or("");
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(options.split(',').any(|o| o == flag), "{flag}: {mounts}");
    }

    // virtiofsd: root, but every thread filtered and holding only the capabilities it keeps to
    // serve files as their owners, in the share. No thread may hold `sys_chroot` (it could leave
    // the chroot), nor anything past the kept five: with the Rust virtiofsd the filter and the
    // capability drop come before its first thread.
    let virtiofsd = pod_process(&state, "virtiofsd");
    let kept = shim::vm::qemu::VIRTIOFSD_KEPT_CAPS;
    // CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_SETGID, CAP_SETUID: written out, so that a
    // wider constant in the shim fails here.
    assert_eq!(kept, (1 << 0) | (1 << 1) | (1 << 3) | (1 << 6) | (1 << 7));
    const CAP_SYS_CHROOT: u64 = 1 << 18;
    let virtiofsd_threads = thread_statuses(virtiofsd);
    for (tid, s) in &virtiofsd_threads {
        let line = format!(
            "virtiofsd thread {tid}: Seccomp {} NoNewPrivs {} CapEff {} CapPrm {} CapInh {} CapBnd {} CapAmb {}",
            field(s, "Seccomp"),
            field(s, "NoNewPrivs"),
            field(s, "CapEff"),
            field(s, "CapPrm"),
            field(s, "CapInh"),
            field(s, "CapBnd"),
            field(s, "CapAmb"),
        );
        eprintln!("{line}");
        assert_eq!(field(s, "Seccomp"), "2", "{line}");
        assert_eq!(field(s, "NoNewPrivs"), "1", "{line}");
        for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
            let caps = u64::from_str_radix(field(s, set), 16).unwrap();
            assert_eq!(caps & !kept, 0, "{set} beyond the kept five: {line}");
            assert_eq!(caps & CAP_SYS_CHROOT, 0, "{set} holds sys_chroot: {line}");
        }
        // It serves files as their owners: the main thread holds the kept five (a serving
        // thread drops them from its effective set while it acts as a guest user).
        if *tid == virtiofsd.to_string() {
            let eff = u64::from_str_radix(field(s, "CapEff"), 16).unwrap();
            assert_eq!(eff, kept, "{line}");
        }
    }
    assert!(
        virtiofsd_threads.len() >= 2,
        "virtiofsd serves the guest's queues from threads of its own: {virtiofsd_threads:?}"
    );
    // Its file limit: at most 1000000, soft and hard alike.
    let limits = std::fs::read_to_string(format!("/proc/{virtiofsd}/limits")).unwrap();
    let files: Vec<u64> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .skip(3)
        .take(2)
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(
        files.len() == 2 && files[0] == files[1] && files[0] <= 1_000_000,
        "{limits}"
    );
    let vroot = std::fs::read_link(format!("/proc/{virtiofsd}/root")).unwrap();
    assert_eq!(
        vroot,
        state.join("shared"),
        "virtiofsd's root is the pod's share"
    );

    for pid in [vsock, virtiofsd] {
        for kind in ["net", "ipc", "uts"] {
            assert_ne!(
                ns(pid, kind),
                ns(std::process::id() as i32, kind),
                "process {pid} is in the host's {kind} namespace"
            );
        }
    }
    eprintln!(
        "pod {}: QEMU {qemu} ({} threads, uid {jail}, root {}), vhost-device-vsock {vsock}, \
         virtiofsd {virtiofsd} (root {})",
        pod.id,
        threads.len(),
        root.display(),
        vroot.display()
    );

    remove_pod(&ctrd, &cri, &pod).await;
    assert_pod_gone(&ctrd, &pod.id, Duration::from_secs(30));
}
