//! The VM's threads run confined (vmm::jail): every vCPU thread and the device event-loop
//! thread of a running VM have a seccomp filter and no_new_privs, the embedder's own threads
//! have neither, and a VM thread that makes a call outside its role's list takes the process
//! down with SIGSYS (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use std::io::{self, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::{SerialSink, Vm, VmExit};

/// Held by each test that runs a VM in this process: the thread checks read every `vmm-`
/// thread of the process, so a VM of another test running beside them would be counted (a
/// CI run saw the page-sharing test's threads in `with_the_jail_off_no_thread_is_filtered`).
static ONE_VM_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_vm_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    // A test that failed holding it poisons it; the next test's VM is still alone.
    ONE_VM_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `Seccomp:` and `NoNewPrivs:` of every thread of this process whose name starts with
/// `prefix`: (name, seccomp mode, no_new_privs).
fn thread_confinement(prefix: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = entry.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let comm = comm.trim().to_string();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((comm, field("Seccomp:"), field("NoNewPrivs:")));
    }
    out.sort();
    out
}

fn wait_for(cap: &Capture, needle: &str) {
    let deadline = Instant::now() + GUEST_TIMEOUT;
    while !cap.text().contains(needle) {
        assert!(Instant::now() < deadline, "no {needle:?}: {}", cap.text());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn every_vm_thread_runs_under_its_filter_and_the_embedders_do_not() {
    let _alone = one_vm_at_a_time();
    let (cfg, cap) = config("idle", 2, 64);
    let h = Vm::start(cfg).unwrap();
    wait_for(&cap, "halting forever");
    let threads = thread_confinement("vmm-");
    let names: Vec<&str> = threads.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names,
        ["vmm-devices", "vmm-vcpu0", "vmm-vcpu1"],
        "{threads:?}"
    );
    for (name, seccomp, nnp) in &threads {
        assert_eq!(seccomp, "2", "{name} runs without a seccomp filter");
        assert_eq!(nnp, "1", "{name} has no no_new_privs");
    }
    // The embedder's thread (this test's) is untouched.
    let me = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    assert!(me.contains("Seccomp:\t0"), "{me}");
    h.stop();
    assert_eq!(h.wait().unwrap(), VmExit::Stopped);
}

#[test]
fn with_the_jail_off_no_thread_is_filtered() {
    let _alone = one_vm_at_a_time();
    let (mut cfg, cap) = config("idle", 1, 64);
    cfg.jail = false;
    let h = Vm::start(cfg).unwrap();
    wait_for(&cap, "halting forever");
    let threads = thread_confinement("vmm-");
    assert_eq!(threads.len(), 2, "{threads:?}");
    for (name, seccomp, _) in &threads {
        assert_eq!(seccomp, "0", "{name}");
    }
    h.stop();
    assert_eq!(h.wait().unwrap(), VmExit::Stopped);
}

/// A serial sink that, on the guest's first byte, does what a guest that took over the vCPU
/// thread would try: open a host file. It runs on the vCPU thread, as all serial output does.
struct Escape;

impl Write for Escape {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        let f = std::fs::File::open("/etc/passwd");
        // Reached only when the call was let through.
        println!("ESCAPED: opened a host file: {}", f.is_ok());
        std::process::exit(if f.is_ok() { 0 } else { 3 })
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The child half of the tests below: boots the hello guest with the escaping sink.
#[test]
fn child_escape_attempt() {
    let Ok(jail) = std::env::var("VMM_JAIL_CHILD") else {
        return; // Only as the child of the tests below.
    };
    let (mut cfg, _cap) = config("hello", 1, 64);
    cfg.jail = jail == "on";
    cfg.serial = SerialSink::Writer(Box::new(Escape));
    let h = Vm::start(cfg).unwrap();
    let _ = h.wait_timeout(GUEST_TIMEOUT);
    // The guest printed nothing?
    std::process::exit(4);
}

fn run_child(jail: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_escape_attempt",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("VMM_JAIL_CHILD", jail)
        .output()
        .unwrap()
}

#[test]
fn a_vcpu_thread_that_opens_a_host_file_kills_the_process_with_sigsys() {
    let out = run_child("on");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "the confined vCPU thread's openat was not stopped: {:?}\n{stderr}",
        out.status
    );
    // The reason, written before the end: which call (openat is 257 on x86_64).
    assert!(
        stderr.contains(" made system call 257, which its seccomp filter forbids"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ESCAPED"));
    // The same without the jail: the open works (what the filter prevents).
    let out = run_child("off");
    assert_eq!(out.status.code(), Some(0), "{:?}", out.status);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ESCAPED: opened a host file: true"));
}

/// A newc cpio archive holding one file `name` of `data`.
fn newc(name: &str, data: &[u8]) -> Vec<u8> {
    testkit::cpio::newc_archive(&[(name, 0o100644, data)])
}

/// A page sharing pass runs on its own confined thread: with an initrd (its template is made
/// from the initrd's descriptor on the first VM, taken from the template folder on the
/// second) and the kernel text captured, nothing it does is outside its filter.
#[test]
fn sharing_passes_with_an_initrd_run_under_the_page_sharing_filter() {
    let _alone = one_vm_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..5 * 4096u32).map(|i| (i % 251) as u8).collect();
    let initrd = dir.path().join("initrd.cpio");
    std::fs::write(&initrd, newc("payload", &data)).unwrap();
    let templates = dir.path().join("templates");
    for round in 0..2 {
        let (mut cfg, cap) = config("idle", 1, 64);
        cfg.initrd = Some((&initrd).into());
        cfg.page_sharing = Some(vmm::PageSharingConfig {
            template_dir: templates.clone(),
            // A test guest that saw no pod input: it may capture the kernel text.
            capture_kernel_text: true,
            ..Default::default()
        });
        let h = Vm::start(cfg).unwrap();
        wait_for(&cap, "halting forever");
        let report = h.share_pages().expect("a sharing pass");
        assert!(
            report
                .templates
                .iter()
                .any(|t| t.starts_with("initrd-files-")),
            "round {round}: {report}"
        );
        assert_eq!(report.captured_kernel_text, round == 0, "{report}");
        h.stop();
        assert_eq!(h.wait().unwrap(), VmExit::Stopped);
    }
}
