//! The VMM process boots the files the embedder opened, never what is at their paths: the test,
//! as the shim does, opens a kernel, an initrd and /dev/kvm (`HostFiles`), then replaces the
//! files at both paths by renaming other ones over them before it starts the VMM process. The
//! VM must run the kernel that was opened (the idle guest, which prints one line and halts),
//! not the one now at the path (the hello guest, which prints and resets); the initrd in guest
//! memory and the one page sharing makes its template from must both be the initrd that was
//! opened; and the VMM process's KVM must be the very open file of /dev/kvm the test made
//! (kcmp). Needs root, /dev/kvm and the built test
//! guests (build/guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod common;
use common::{exe, guest, wait_for_console};
use std::path::Path;
use std::time::Duration;

use vmm::jail::channel::EndKind;
use vmm::jail::split::{HostFiles, PageSharingDescription, VmDescription, VmmProcess};

/// A newc cpio archive holding one file `name` of `data`.
fn newc(name: &str, data: &[u8]) -> Vec<u8> {
    testkit::cpio::newc_archive(&[(name, 0o100644, data)])
}

/// An initrd of one file of 3 pages of `byte`, its data page-aligned in the archive (the name
/// fills the first page), so that the pages the VMM loads equal the template's.
fn initrd_of(byte: u8) -> Vec<u8> {
    const HEADER: usize = 110;
    let name = "p".repeat(4096 - HEADER - 1);
    let archive = newc(&name, &[byte; 3 * 4096]);
    assert_eq!(
        &archive[4096..4096 + 4],
        &[byte; 4],
        "the data starts at a page"
    );
    archive
}

/// Puts `bytes` at `path` as a new file renamed over whatever is there.
fn replace(path: &Path, bytes: &[u8]) {
    let new = path.with_extension("new");
    std::fs::write(&new, bytes).unwrap();
    std::fs::rename(&new, path).unwrap();
}

/// The name of the initrd template page sharing makes from `initrd`.
fn template_name(initrd: &[u8], scratch: &Path) -> String {
    let p = scratch.join("sum-of");
    std::fs::write(&p, initrd).unwrap();
    let sum = vmm::page_sharing::file_sha256(&mut std::fs::File::open(&p).unwrap()).unwrap();
    std::fs::remove_file(&p).unwrap();
    vmm::page_sharing::initrd_template_name(&sum)
}

/// Whether descriptor `theirs` of process `pid` is the same open file as our `ours`
/// (`kcmp(KCMP_FILE)`).
fn same_open_file(ours: i32, pid: u32, theirs: i32) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp compares two processes' descriptors by number; it touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            libc::c_long::from(std::process::id() as i32),
            libc::c_long::from(pid as i32),
            KCMP_FILE,
            libc::c_long::from(ours),
            libc::c_long::from(theirs),
        )
    };
    assert!(r >= 0, "kcmp: {}", std::io::Error::last_os_error());
    r == 0
}

#[test]
fn the_vmm_process_boots_the_files_the_embedder_opened_not_what_is_at_their_paths_by_then() {
    let boot = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let kernel = boot.path().join("vmlinux");
    let initrd = boot.path().join("initrd.cpio");
    let opened_initrd = initrd_of(0x11);
    let later_initrd = initrd_of(0x22);
    replace(&kernel, &std::fs::read(guest("idle")).unwrap());
    replace(&initrd, &opened_initrd);

    let files = HostFiles::open(&kernel, Some(&initrd)).unwrap();
    // Between the shim's open and the VMM process's start, other files take both paths.
    replace(&kernel, &std::fs::read(guest("hello")).unwrap());
    replace(&initrd, &later_initrd);

    let templates = work.path().join("templates");
    let desc = VmDescription {
        vcpus: 1,
        memory_mib: 64,
        kernel: files.kernel(),
        initrd: files.initrd(),
        kvm_fd: files.kvm_fd(),
        // Copied into guest RAM, the initrd's pages are the guest's own, which a sharing pass
        // compares with the template (mapped from the file, they would be the page cache's).
        copy_boot_files: true,
        console_log: work.path().join("console.log"),
        console_log_bytes: 1 << 20,
        work_dir: work.path().to_path_buf(),
        page_sharing: Some(PageSharingDescription {
            template_dir: templates.clone(),
            domain: "node".into(),
            capture_kernel_text: false,
        }),
        ..VmDescription::default()
    };
    assert_eq!(desc.kernel.name, kernel, "the path names the file");
    // The VMM process's log (the shim's log in a pod) says what a sharing pass shared.
    let log_path = work.path().join("vmm.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut vmm = VmmProcess::spawn(
        exe(),
        &desc,
        Some(std::os::fd::AsFd::as_fd(&log)),
        Duration::from_secs(30),
    )
    .unwrap();
    let pid = vmm.pid();

    // Its KVM is the test's open file of /dev/kvm, not one it opened itself.
    let kvm_fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let target = std::fs::read_link(e.path()).ok()?;
            (target == Path::new("/dev/kvm"))
                .then(|| e.file_name().to_string_lossy().parse().unwrap())
        })
        .collect();
    assert!(!kvm_fds.is_empty(), "the VMM process holds no /dev/kvm");
    assert!(
        kvm_fds
            .iter()
            .all(|&fd| same_open_file(files.kvm_fd(), pid, fd)),
        "a /dev/kvm of the VMM process ({kvm_fds:?}) is not the one the test opened"
    );
    // The shim closes its copies once the process runs.
    drop(files);

    // The kernel that was opened runs: idle's line, no hello, and no reset.
    let text = wait_for_console(&desc.console_log, "idle: halting forever");
    assert!(
        vmm.wait_timeout(Duration::from_millis(500)).is_none(),
        "the VM ended: the kernel now at the path ran ({text:?})"
    );
    let text = std::fs::read_to_string(&desc.console_log).unwrap();
    assert!(!text.contains("hello from the guest"), "{text}");

    // Page sharing read the initrd that was opened, and the guest's memory holds it: its 3
    // pages of file data equal the template's.
    vmm.share_pages(Duration::from_secs(30)).unwrap();
    let said = std::fs::read_to_string(&log_path).unwrap();
    assert!(said.contains("(initrd-files 3)"), "{said}");
    let made: Vec<String> = std::fs::read_dir(templates.join("node"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let opened = template_name(&opened_initrd, boot.path());
    let later = template_name(&later_initrd, boot.path());
    assert!(
        made.contains(&opened) && !made.contains(&later),
        "templates {made:?}: the opened initrd's is {opened}, the later one's {later}"
    );
    let template = std::fs::read(templates.join("node").join(&opened)).unwrap();
    assert_eq!(
        template,
        vmm::page_sharing::initrd_template(&opened_initrd).unwrap()
    );

    let end = vmm.stop(Duration::from_secs(10));
    assert_eq!(end.exit, Ok(0), "{end:?}");
    assert!(matches!(end.said, Some((EndKind::Stopped, _))), "{end:?}");
}
