//! A VM in a VMM process of its own (vmm::jail::split), started from the shim's binary with
//! its hidden `__vmm` subcommand and driven over the control channel, checked from /proc:
//! every thread of the process is under a seccomp filter with no_new_privs, holds no
//! capability (no shared directory), and the process has its own mount, PID, network, IPC and
//! UTS namespaces and a root that holds only its work folder; a disk file and a tap-less VM's
//! empty disk slot get attached through the channel; stop ends it, and kill -9 is reported as
//! such. Needs root, /dev/kvm and the built test guests (build/guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod common;
use common::{exe, guest, wait_for_console};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::jail::channel::EndKind;
use vmm::jail::split::{
    BlockDescription, FileDescription, HostFiles, VmDescription, VmmProcess, VsockDescription,
};

fn field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

fn ns(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Test guest `name`'s kernel and /dev/kvm, opened as the shim opens them.
fn files(name: &str) -> HostFiles {
    HostFiles::open(&guest(name), None).unwrap()
}

fn description(work: &Path, files: &HostFiles, disk: Option<&std::fs::File>) -> VmDescription {
    VmDescription {
        vcpus: 2,
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
        blocks: vec![
            BlockDescription {
                serial: "cold".into(),
                read_only: false,
                fd: disk.map(|f| f.as_raw_fd()),
            },
            BlockDescription {
                serial: "empty".into(),
                read_only: false,
                fd: None,
            },
        ],
        ..VmDescription::default()
    }
}

#[test]
fn the_vmm_process_is_jailed_every_thread_filtered_and_driven_over_the_channel() {
    let work = tempfile::tempdir().unwrap();
    let mut disk = tempfile::tempfile().unwrap();
    disk.write_all(&[7u8; 1 << 20]).unwrap();
    let files = files("idle");
    let desc = description(work.path(), &files, Some(&disk));
    let started = Instant::now();
    let mut vmm = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30)).unwrap();
    eprintln!(
        "VMM process {} running in {:?}: {}",
        vmm.pid(),
        started.elapsed(),
        vmm.detail()
    );
    wait_for_console(&desc.console_log, "halting forever");
    let pid = vmm.pid().to_string();

    // Every thread: filtered, no_new_privs, no capability.
    let mut names = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = entry.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap();
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let name = comm.trim().to_string();
        assert_eq!(field(&status, "Seccomp:"), "2", "{name}: {status}");
        assert_eq!(field(&status, "NoNewPrivs:"), "1", "{name}");
        assert_eq!(field(&status, "CapEff:"), "0000000000000000", "{name}");
        assert_eq!(field(&status, "CapPrm:"), "0000000000000000", "{name}");
        assert_eq!(field(&status, "CapBnd:"), "0000000000000000", "{name}");
        names.push(name);
    }
    names.sort();
    // KVM's own worker (the NX huge page recovery thread) runs in the VM process's thread
    // group: it was checked above like the others.
    names.retain(|n| n != "kvm-nx-lpage-re");
    assert_eq!(
        names,
        ["containerd-shim", "vmm-devices", "vmm-vcpu0", "vmm-vcpu1"],
        "the VMM process's threads"
    );
    // Its own namespaces, PID 1 in its PID namespace.
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(ns(&pid, kind), ns("self", kind), "{kind} namespace");
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(
        field(&status, "NSpid:").split_whitespace().last(),
        Some("1"),
        "PID 1 of its namespace: {status}"
    );
    // Its root holds the work folder at its own path and nothing else.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let top: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let first = work
        .path()
        .components()
        .nth(1)
        .unwrap()
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    assert_eq!(top, [first], "the VMM's root");
    let inside = root.join(work.path().strip_prefix("/").unwrap());
    assert!(inside.join("vsock.sock").exists(), "its work folder");
    for host in ["etc", "proc", "dev", "sys", "usr"] {
        assert!(!root.join(host).exists(), "/{host} is reachable");
    }
    // Its descriptors: standard I/O, the channel, the disk, /dev/kvm (the test's, as the
    // shim's: kvm_vmm_process_files), and what the VM opened itself (KVM's VM and vCPUs,
    // eventfds, epoll, the console log, the vsock socket): no other descriptor of the test's.
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let target = std::fs::read_link(fd.unwrap().path()).unwrap();
        let t = target.display().to_string();
        assert!(
            !t.contains("kvm_vmm_process_root") && !t.ends_with("/deps"),
            "a descriptor of the test leaked: {t}"
        );
    }

    // Disk slot 1 (empty) filled and emptied over the channel.
    let extra = tempfile::tempfile().unwrap();
    extra.set_len(4 << 20).unwrap();
    vmm.attach_block(1, "hot".into(), &extra, Duration::from_secs(10))
        .unwrap();
    vmm.detach_block(1, Duration::from_secs(10)).unwrap();
    let err = vmm
        .detach_block(9, Duration::from_secs(10))
        .unwrap_err()
        .to_string();
    assert!(err.contains("slot 9"), "{err}");
    // No page sharing in this VM: a clear refusal, not a death.
    assert!(vmm.share_pages(Duration::from_secs(10)).is_err());
    assert!(vmm.wait_timeout(Duration::ZERO).is_none(), "still running");

    let end = vmm.stop(Duration::from_secs(10));
    assert_eq!(end.exit, Ok(0), "{end:?}");
    assert!(matches!(end.said, Some((EndKind::Stopped, _))), "{end:?}");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "reaped");
}

#[test]
fn kill_9_of_the_vmm_process_is_its_end_with_the_signal() {
    let work = tempfile::tempdir().unwrap();
    let files = files("idle");
    let desc = description(work.path(), &files, None);
    let mut vmm = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30)).unwrap();
    wait_for_console(&desc.console_log, "halting forever");
    let pid = vmm.pid();
    // SAFETY: kill(2) of the child this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let end = vmm
        .wait_timeout(Duration::from_secs(10))
        .expect("the end seen through the pidfd");
    assert_eq!(end.exit, Err(libc::SIGKILL));
    assert_eq!(end.describe(), "the VMM process was killed by signal 9");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "reaped");
    // Its mount namespace and mounts died with it: the host has no mount of the work folder.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&work.path().display().to_string()),
        "{mounts}"
    );
}

#[test]
fn a_bad_description_fails_the_start_with_the_reason() {
    let work = tempfile::tempdir().unwrap();
    // The shim opens the kernel: a missing one fails there, naming it, before any process.
    let missing = work.path().join("no-such-kernel");
    let err = HostFiles::open(&missing, None).unwrap_err().to_string();
    assert!(
        err.contains("no-such-kernel") && err.contains("No such file"),
        "{err}"
    );
    let files = files("idle");
    // A descriptor the embedder does not hold is refused before the process starts.
    let mut desc = description(work.path(), &files, None);
    desc.kernel.fd = 1000;
    let err = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30))
        .unwrap_err()
        .to_string();
    assert!(err.contains("descriptor 1000 is not open here"), "{err}");
    // What the VMM process checks of what it was given: a kernel that is a directory, KVM's
    // descriptor that is not /dev/kvm, the same descriptor named twice.
    let dir = std::fs::File::open(work.path()).unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let mut desc = description(work.path(), &files, None);
    desc.kernel = FileDescription {
        fd: dir.as_raw_fd(),
        name: "the-work-folder".into(),
    };
    let mut not_kvm = description(work.path(), &files, None);
    not_kvm.kvm_fd = null.as_raw_fd();
    let mut twice = description(work.path(), &files, None);
    twice.initrd = Some(twice.kernel.clone());
    for (desc, want) in [
        (
            desc,
            "kernel the-work-folder: not a regular file".to_string(),
        ),
        (not_kvm, "the KVM descriptor is not /dev/kvm".to_string()),
        (
            twice,
            format!(
                "descriptor {} is not one the VMM process was given",
                files.kernel().fd
            ),
        ),
    ] {
        let err = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&want), "{err}");
    }
}

#[test]
fn a_guest_that_resets_ends_its_vmm_process_with_the_reset_and_a_triple_fault_with_the_error() {
    for (name, want) in [("hello", EndKind::Reset), ("triple-fault", EndKind::Error)] {
        let work = tempfile::tempdir().unwrap();
        let files = files(name);
        let desc = description(work.path(), &files, None);
        let mut vmm = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30)).unwrap();
        let end = vmm
            .wait_timeout(Duration::from_secs(30))
            .expect("the guest ends by itself");
        assert_eq!(end.exit, Ok(0), "{name}: {end:?}");
        let (how, detail) = end.said.clone().expect("the VMM said how it ended");
        assert_eq!(how, want, "{name}: {detail}");
        if want == EndKind::Error {
            assert!(detail.contains("vCPU"), "{detail}");
            assert!(end.describe().starts_with("the VM failed: vCPU"), "{end:?}");
        }
    }
}

fn rollup(pid: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    field(&text, key)
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap()
}

/// What the split costs (printed; performance is not asserted): the time from the start to a
/// running VM, in a VMM process and in this process, and the VMM process's memory with an idle
/// guest. `cargo test --release -p shim --test kvm_vmm_process_root what_the_split_costs --
/// --nocapture`.
#[test]
fn what_the_split_costs() {
    const N: u32 = 10;
    let mut in_process = Duration::ZERO;
    let mut split = Duration::ZERO;
    let mut pss = Vec::new();
    let mut rss = Vec::new();
    for _ in 0..N {
        let work = tempfile::tempdir().unwrap();
        let mut cfg = vmm::VmConfig::new(guest("idle"));
        cfg.vcpus = 2;
        cfg.memory_mib = 64;
        let console_log = work.path().join("console.log");
        cfg.serial = vmm::SerialSink::File {
            path: console_log.clone(),
            max_bytes: 1 << 20,
        };
        cfg.vsock = Some(vmm::VsockConfig {
            guest_cid: 3,
            uds_path: work.path().join("vsock.sock"),
        });
        for serial in ["cold", "empty"] {
            cfg.blocks.push(vmm::BlockConfig {
                serial: serial.into(),
                backing: vmm::BlockBacking::Empty { read_only: false },
            });
        }
        let t = Instant::now();
        let h = vmm::Vm::start(cfg).unwrap();
        in_process += t.elapsed();
        wait_for_console(&console_log, "halting forever");
        h.stop();
        h.wait().unwrap();

        let work = tempfile::tempdir().unwrap();
        // The split's start includes what the shim opens for it.
        let t = Instant::now();
        let files = files("idle");
        let desc = description(work.path(), &files, None);
        let mut p = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30)).unwrap();
        split += t.elapsed();
        drop(files);
        wait_for_console(&desc.console_log, "halting forever");
        let pid = p.pid().to_string();
        pss.push(rollup(&pid, "Pss:"));
        rss.push(rollup(&pid, "Rss:"));
        assert_eq!(p.stop(Duration::from_secs(10)).exit, Ok(0));
    }
    let mean = |v: &[u64]| v.iter().sum::<u64>() / v.len() as u64;
    eprintln!(
        "start to a running VM, mean of {N}: in this process {:?}, in a VMM process {:?} \
         (+{:?}); the VMM process of an idle 64 MiB guest: Pss {} kB, Rss {} kB (means)",
        in_process / N,
        split / N,
        (split / N).saturating_sub(in_process / N),
        mean(&pss),
        mean(&rss)
    );
}

#[test]
fn with_a_share_the_vmm_process_keeps_the_file_servers_five_capabilities_and_a_proc_of_its_own() {
    let work = tempfile::tempdir().unwrap();
    let share = tempfile::tempdir().unwrap();
    let files = files("idle");
    let mut desc = description(work.path(), &files, None);
    desc.shared_fs = Some(vmm::jail::split::SharedFsDescription {
        tag: "share".into(),
        host_dir: share.path().to_path_buf(),
    });
    let mut vmm = VmmProcess::spawn(exe(), &desc, None, Duration::from_secs(30)).unwrap();
    wait_for_console(&desc.console_log, "halting forever");
    let pid = vmm.pid().to_string();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(entry.unwrap().path().join("status")).unwrap();
        assert_eq!(field(&status, "Seccomp:"), "2");
        // CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_SETGID, CAP_SETUID.
        assert_eq!(field(&status, "CapEff:"), "00000000000000cb");
        assert_eq!(field(&status, "CapBnd:"), "00000000000000cb");
    }
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let mut top: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(top, ["proc", "tmp"], "the VMM's root");
    // Its /proc shows its own PID namespace's tasks only, and no host-wide file.
    let procs: Vec<String> = std::fs::read_dir(root.join("proc"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(procs.contains(&"1".to_string()), "{procs:?}");
    for host in ["sys", "sysrq-trigger", "kcore", "2"] {
        assert!(
            !procs.contains(&host.to_string()),
            "/proc/{host}: {procs:?}"
        );
    }
    assert_eq!(vmm.stop(Duration::from_secs(10)).exit, Ok(0));
}
