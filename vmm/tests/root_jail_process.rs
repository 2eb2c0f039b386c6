//! The process half of the jail (vmm::jail::process), run as root in a child process (it
//! changes the whole process irrevocably): new namespaces, an empty read-only root holding
//! only the share, limits, the virtio-fs server's capabilities and no_new_privs; the host
//! sees none of it (needs root).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use vmm::jail::process::{
    detached_share, enter_namespaces, keep_capabilities, pivot_to_empty_root, set_limits,
    set_no_new_privs, Limits, FS_SERVER_CAPABILITIES,
};

fn ns(kind: &str) -> String {
    std::fs::read_link(format!("/proc/thread-self/ns/{kind}"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Every check the child makes; the first that fails is its exit message.
fn child(share: &Path, mount_point: &Path) -> Result<(), String> {
    let hard_nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .unwrap_or(u64::MAX);
    let before: Vec<String> = ["mnt", "net", "uts", "ipc"].iter().map(|k| ns(k)).collect();
    let share_fd: OwnedFd = rustix::fs::open(
        share,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| format!("open the share: {e}"))?;
    let tree = detached_share(&share_fd).map_err(|e| e.to_string())?;
    enter_namespaces().map_err(|e| e.to_string())?;
    let after: Vec<String> = ["mnt", "net", "uts", "ipc"].iter().map(|k| ns(k)).collect();
    for (i, kind) in ["mnt", "net", "uts", "ipc"].iter().enumerate() {
        if before[i] == after[i] {
            return Err(format!("still in the host's {kind} namespace"));
        }
    }
    rustix::system::sethostname(b"jailed").map_err(|e| format!("sethostname: {e}"))?;
    pivot_to_empty_root(mount_point, Some(("share", &tree))).map_err(|e| e.to_string())?;
    set_limits(&Limits::for_vm(2, true)).map_err(|e| e.to_string())?;
    keep_capabilities(&FS_SERVER_CAPABILITIES).map_err(|e| e.to_string())?;
    set_no_new_privs().map_err(|e| e.to_string())?;

    let root: Vec<String> = std::fs::read_dir("/")
        .map_err(|e| format!("list /: {e}"))?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    if root != ["share"] {
        return Err(format!("the root holds {root:?}"));
    }
    let hello = std::fs::read_to_string("/share/hello").map_err(|e| format!("read: {e}"))?;
    if hello != "hi" {
        return Err(format!("the share holds {hello:?}"));
    }
    // The share stays writable (its own mount flags), the root does not.
    std::fs::write("/share/written", "ok").map_err(|e| format!("write the share: {e}"))?;
    match std::fs::write("/escape", "x") {
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {}
        other => return Err(format!("writing the root: {other:?}")),
    }
    for host in ["/etc/passwd", "/proc/self/status", "/dev/kvm", "/sys"] {
        if Path::new(host).exists() {
            return Err(format!("{host} is reachable"));
        }
    }
    // 65536 wanted; never above the hard limit the process had.
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let want = Some(65_536.min(hard_nofile));
    if nofile.current != want || nofile.maximum != want {
        return Err(format!("RLIMIT_NOFILE {nofile:?}"));
    }
    let nproc = rustix::process::getrlimit(rustix::process::Resource::Nproc);
    if nproc.maximum != Some(10) {
        return Err(format!("RLIMIT_NPROC {nproc:?}"));
    }
    let core = rustix::process::getrlimit(rustix::process::Resource::Core);
    if core.maximum != Some(0) {
        return Err(format!("RLIMIT_CORE {core:?}"));
    }
    if !rustix::thread::no_new_privs().map_err(|e| e.to_string())? {
        return Err("no_new_privs is not set".into());
    }
    let want: caps::CapsHashSet = FS_SERVER_CAPABILITIES.iter().copied().collect();
    for set in [
        caps::CapSet::Effective,
        caps::CapSet::Permitted,
        caps::CapSet::Bounding,
    ] {
        let have = caps::read(None, set).map_err(|e| e.to_string())?;
        if have != want {
            return Err(format!("{set:?}: {have:?}"));
        }
    }
    // Without CAP_MKNOD, no device node; without CAP_SYS_ADMIN, no mount, not even of a
    // tmpfs; no way back to a capability through a new user namespace either.
    let dev = rustix::fs::mknodat(
        rustix::fs::CWD,
        "/share/null",
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    );
    if dev.is_ok() {
        return Err("mknod of a character device worked".into());
    }
    if rustix::mount::mount(
        "none",
        "/share",
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        c"",
    )
    .is_ok()
    {
        return Err("mount worked".into());
    }
    Ok(())
}

#[test]
fn root_jail_process_child() {
    let (Ok(share), Ok(mp)) = (
        std::env::var("VMM_JAIL_SHARE"),
        std::env::var("VMM_JAIL_ROOT"),
    ) else {
        return; // Only as the child of the test below.
    };
    match child(Path::new(&share), Path::new(&mp)) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("JAIL CHECK FAILED: {e}");
            std::process::exit(1)
        }
    }
}

#[test]
fn root_a_jailed_vmm_process_sees_only_its_share_and_keeps_only_the_fs_capabilities() {
    let dir = tempfile::tempdir().unwrap();
    let share: PathBuf = dir.path().join("share");
    let mp: PathBuf = dir.path().join("root");
    std::fs::create_dir(&share).unwrap();
    std::fs::create_dir(&mp).unwrap();
    std::fs::write(share.join("hello"), "hi").unwrap();
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "root_jail_process_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("VMM_JAIL_SHARE", &share)
        .env("VMM_JAIL_ROOT", &mp)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The child wrote through the share; the host kept its hostname and has no mount of the
    // child's (its namespace died with it).
    assert_eq!(
        std::fs::read_to_string(share.join("written")).unwrap(),
        "ok"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        hostname
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(dir.path().to_str().unwrap()),
        "a mount of the child is left on the host"
    );
    assert_eq!(std::fs::read_dir(&mp).unwrap().count(), 0);
}
