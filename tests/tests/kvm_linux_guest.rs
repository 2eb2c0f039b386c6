//! Our Linux guest (kernel-config/ kernel, initrd with the agent as PID 1) under the EMBEDDED VMM
//! on /dev/kvm: the agent answers over vsock, and (without the initrd) the kernel's virtio_blk
//! driver sees our virtio-blk disks and a hot attach/detach.
//!
//! These need a host whose KVM can boot a Linux guest (hardware VMX/SVM, or kvm-pvm with a PVM
//! guest kernel). `make test` runs them only where `microvm check-host` says so; elsewhere it
//! prints check-host's reason and counts them as skipped. They are `#[ignore]`d so that a plain
//! `cargo test` on such a host does not report them as passed; run them with `--include-ignored`.
//! Each test also re-checks the host itself and fails (never passes) if it cannot boot the guest.

use std::path::PathBuf;
use std::time::Duration;

use microvm_tests::guest_console::Console;
use shim::agent::AgentClient;
use shim::vm::{new_work_dir, Backend, GuestSpec, GuestVm};
use shim::{artifacts, host_check};

fn kernel_release(kernel: &std::path::Path) -> String {
    let real = std::fs::canonicalize(kernel).expect("the kernel path resolves");
    let file = real.with_file_name("release");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e} (make kernel writes it)", file.display()))
        .trim()
        .to_string()
}

fn artifacts_or_fail() -> (PathBuf, PathBuf) {
    let kernel = artifacts::default_kernel();
    let initrd = artifacts::default_initrd();
    assert!(
        kernel.exists(),
        "{} is missing: run `make kernel`",
        kernel.display()
    );
    assert!(
        initrd.exists(),
        "{} is missing: run `make initrd`",
        initrd.display()
    );
    let report = host_check::probe(Some(&kernel));
    if let Some(why) = report.linux_guest_blocker() {
        panic!("this host cannot boot a Linux guest under the embedded VMM: {why}");
    }
    (kernel, initrd)
}

/// The private writable mappings of `file` in this process (the embedded VMM maps the boot files
/// over guest RAM so: vmm/src/boot_files.rs), with the no-dump mark of guest RAM: how many.
fn guest_ram_mappings_of(file: &std::path::Path) -> usize {
    let real = std::fs::canonicalize(file).expect("the file resolves");
    let real = real.to_string_lossy();
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("own smaps");
    let mut count = 0;
    let mut current_is_file = false;
    for line in smaps.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() >= 5 && words[0].contains('-') && words[1].len() == 4 {
            current_is_file = words[1] == "rw-p" && words.get(5) == Some(&&*real);
        } else if current_is_file && line.starts_with("VmFlags:") {
            if words.contains(&"dd") {
                count += 1;
            }
            current_is_file = false;
        }
    }
    count
}

fn boot_and_check(vcpus: u8, memory_mib: u64) {
    boot_and_check_with(vcpus, memory_mib, vmm::BootFiles::Map);
}

fn boot_and_check_with(vcpus: u8, memory_mib: u64, boot_files: vmm::BootFiles) {
    let (kernel, initrd) = artifacts_or_fail();
    let mut spec = GuestSpec::new(
        kernel.clone(),
        initrd.clone(),
        vcpus,
        memory_mib,
        new_work_dir("kvm-linux-test"),
    );
    spec.boot_files = boot_files;
    let mut vm = GuestVm::start(Backend::Kvm, &spec).expect("the embedded VMM starts the guest");
    if boot_files == vmm::BootFiles::Map {
        // The kernel's segments and the initrd are mapped from their files (shared page cache),
        // not copied; the guest boots from them all the same.
        assert!(
            guest_ram_mappings_of(&kernel) >= 1,
            "no private mapping of {} over guest RAM",
            kernel.display()
        );
        assert!(
            guest_ram_mappings_of(&initrd) >= 1,
            "no private mapping of {} over guest RAM",
            initrd.display()
        );
    }
    vm.wait_agent_ready(Duration::from_secs(60))
        .expect("the agent comes up");
    // The agent client is async (ttrpc's tokio client).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let client = rt
        .block_on(AgentClient::connect(
            vm.agent_socket(),
            agent_protocol::AGENT_VSOCK_PORT,
            Duration::from_secs(60),
        ))
        .unwrap_or_else(|e| panic!("agent unreachable: {e}\nconsole:\n{}", vm.console_tail(30)));
    let check = rt.block_on(client.check()).expect("Check answers");
    assert_eq!(check.online_vcpus, u32::from(vcpus));
    assert_eq!(check.kernel_release, kernel_release(&kernel));
    let mem_mib = check.mem_total_kib / 1024;
    assert!(
        mem_mib <= memory_mib && mem_mib + 64 >= memory_mib,
        "MemTotal {mem_mib} MiB for a {memory_mib} MiB guest"
    );
    rt.block_on(client.shutdown()).expect("Shutdown answers");
    drop(client);
    assert!(
        vm.wait_timeout(Duration::from_secs(30))
            .expect("clean exit")
            .is_some(),
        "the VM did not end after Shutdown; console:\n{}",
        vm.console_tail(30)
    );
    let work_dir = spec.work_dir.clone();
    drop(vm);
    assert!(!work_dir.exists(), "the VM's work folder was left behind");
}

#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_boots_on_embedded_vmm_1_vcpu() {
    boot_and_check(1, 256);
}

#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_boots_on_embedded_vmm_2_vcpus() {
    boot_and_check(2, 512);
}

#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_boots_with_copied_boot_files() {
    boot_and_check_with(1, 256, vmm::BootFiles::Copy);
}

/// Waits for a console line containing `what`; fails with the console on a timeout.
fn wait_for(console: &Console, what: &str, timeout: Duration) {
    console.wait_until(
        &format!("{what:?}"),
        timeout,
        |t| t.contains(what),
        |_| false,
    );
}

fn disk_file(sectors: u64) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().expect("a temp file");
    f.as_file().set_len(sectors * 512).expect("size the disk");
    f
}

/// Our kernel's virtio_blk driver on our virtio-blk device: two disks at boot (one read-only)
/// and an empty slot, filled and emptied while the guest runs. No initrd: the kernel waits for
/// a root device that never comes (`root=/dev/vdz rootwait`), so it stays up with its drivers.
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_sees_virtio_blk_disks_and_a_hot_attach() {
    let (kernel, _initrd) = artifacts_or_fail();
    let vda = disk_file(4096);
    let vdb = disk_file(2048);
    let hot = disk_file(8192);
    let open_rw = |p: &std::path::Path| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .expect("open the disk")
    };
    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.memory_mib = 256;
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1 root=/dev/vdz rootwait".into();
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    cfg.blocks = vec![
        vmm::BlockConfig {
            serial: "disk-a".into(),
            backing: vmm::BlockBacking::File {
                file: open_rw(vda.path()),
                read_only: false,
            },
        },
        vmm::BlockConfig {
            serial: "disk-b".into(),
            backing: vmm::BlockBacking::File {
                file: std::fs::File::open(vdb.path()).expect("open vdb"),
                read_only: true,
            },
        },
        vmm::BlockConfig {
            serial: String::new(),
            backing: vmm::BlockBacking::Empty { read_only: false },
        },
    ];
    let handle = vmm::Vm::start(cfg).expect("the VM starts");
    let t = Duration::from_secs(180);
    wait_for(
        &console,
        "[vda] 4096 512-byte logical blocks (2.10 MB/2.00 MiB)",
        t,
    );
    wait_for(
        &console,
        "[vdb] 2048 512-byte logical blocks (1.05 MB/1.00 MiB)",
        t,
    );
    wait_for(&console, "[vdc] 0 512-byte logical blocks", t);
    wait_for(&console, "Waiting for root device /dev/vdz", t);
    // The kernel read the partition tables: the device served real reads.
    assert!(handle.block_stats(0).expect("stats").read_bytes > 0);

    handle
        .attach_block(2, "hot".into(), open_rw(hot.path()))
        .expect("attach");
    wait_for(
        &console,
        "[vdc] new size: 8192 512-byte logical blocks (4.19 MB/4.00 MiB)",
        t,
    );
    handle.detach_block(2).expect("detach");
    wait_for(&console, "[vdc] new size: 0 512-byte logical blocks", t);
    let text = console.text();
    assert!(
        text.lines()
            .any(|l| l.contains("[vdb]") && l.contains("logical blocks")),
        "{text}"
    );
    for i in 0..3 {
        let s = handle.block_stats(i).expect("stats");
        assert_eq!(s.errors, 0, "disk {i}: {s:?}; console:\n{text}");
    }
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}
