//! Our Linux guest (kernel-config/ kernel, initrd with the agent as PID 1) under the EMBEDDED VMM
//! on /dev/kvm: the agent answers over vsock, and (without the initrd) the kernel's virtio_blk
//! driver sees our virtio-blk disks and a hot attach/detach.
//!
//! These need a host whose KVM can boot a Linux guest (hardware VMX/SVM, or kvm-pvm with a PVM
//! guest kernel). `make test` runs them only where `microvm check-host` says so; elsewhere it
//! prints check-host's reason and counts them as skipped. They are `#[ignore]`d so that a plain
//! `cargo test` on such a host does not report them as passed; run them with `--include-ignored`.
//! Each test also re-checks the host itself and fails (never passes) if it cannot boot the guest.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

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

/// An initramfs (newc cpio) of busybox and `/init` = `script`: enough for a guest that runs a
/// shell script, without the agent.
fn busybox_initrd(script: &str) -> tempfile::NamedTempFile {
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (Debian busybox-static)");
    let cpio = testkit::cpio::newc_archive(&[
        ("bin", 0o040755, b""),
        ("dev", 0o040755, b""),
        ("proc", 0o040755, b""),
        ("tmp", 0o040755, b""),
        ("bin/busybox", 0o100755, &busybox),
        ("init", 0o100755, script.as_bytes()),
    ]);
    let f = tempfile::NamedTempFile::new().expect("a temp file");
    std::fs::write(f.path(), &cpio).expect("write the initrd");
    f
}

/// What the guest of the balloon tests fills and frees, in MiB.
const FILL_MIB: u64 = 256;

/// Boots our kernel with a busybox `/init` that fills a tmpfs with [`FILL_MIB`] MiB, says so,
/// waits, removes the file and says so; returns the VM (stopped by the caller), its console and
/// the guest RAM's host RSS once it was filled.
fn boot_fill_and_free(
    balloon: Option<vmm::BalloonConfig>,
) -> (vmm::VmHandle, Console, u64, tempfile::NamedTempFile) {
    let (kernel, _initrd) = artifacts_or_fail();
    let memory_mib = 512;
    let initrd = busybox_initrd(&format!(
        "#!/bin/busybox sh\n\
         B=/bin/busybox\n\
         $B mount -t proc proc /proc\n\
         $B mount -t devtmpfs devtmpfs /dev\n\
         $B mount -t tmpfs -o size=400m tmpfs /tmp\n\
         $B dd if=/dev/zero of=/tmp/fill bs=1M count={FILL_MIB} 2>/dev/null\n\
         $B echo balloon-test: filled $($B grep MemFree /proc/meminfo)\n\
         $B sleep 10\n\
         $B rm /tmp/fill\n\
         $B echo balloon-test: freed $($B grep MemFree /proc/meminfo)\n\
         exec $B sleep 100000\n"
    ));
    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.memory_mib = memory_mib;
    cfg.initrd = Some(initrd.path().into());
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1".into();
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    cfg.balloon = balloon;
    let handle = vmm::Vm::start(cfg).expect("the VM starts");
    wait_for(&console, "balloon-test: filled", Duration::from_secs(180));
    let filled = guest_rss(memory_mib);
    assert!(
        filled >= FILL_MIB << 20,
        "the guest filled {FILL_MIB} MiB but its RAM holds {} MiB on the host; console:\n{}",
        filled >> 20,
        console.text()
    );
    wait_for(&console, "balloon-test: freed", Duration::from_secs(60));
    (handle, console, filled, initrd)
}

/// The host RSS of this process's guest RAM (one VM of `memory_mib`), in bytes.
fn guest_rss(memory_mib: u64) -> u64 {
    microvm_tests::lifecycle::guest_ram_split_of(std::process::id() as i32, memory_mib << 20)
        .expect("the guest RAM in /proc/self/smaps")
        .guest_rss
}

/// Free page reporting: the guest frees 256 MiB it had filled, reports the free blocks on the
/// balloon, and the VMM's guest RAM shrinks on the host by most of it. The poll bound is a
/// liveness bound (the guest reports 2 s after freeing), not a timing target.
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_gives_freed_memory_back_through_the_balloon() {
    let (handle, console, filled, _initrd) = boot_fill_and_free(Some(vmm::BalloonConfig {
        free_page_reporting: true,
    }));
    let want_back = (FILL_MIB * 3 / 4) << 20;
    let end = std::time::Instant::now() + Duration::from_secs(120);
    let mut now = guest_rss(512);
    while filled.saturating_sub(now) < want_back && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(500));
        now = guest_rss(512);
    }
    let stats = handle.balloon_stats().expect("the VM has a balloon");
    eprintln!(
        "balloon: guest RAM RSS {} MiB filled, {} MiB after the free; {stats:?}",
        filled >> 20,
        now >> 20
    );
    assert!(
        filled.saturating_sub(now) >= want_back,
        "guest RAM RSS {} MiB filled, still {} MiB after the guest freed {FILL_MIB} MiB; \
         {stats:?}; console:\n{}",
        filled >> 20,
        now >> 20,
        console.text()
    );
    assert!(stats.reported_bytes >= want_back, "{stats:?}");
    assert_eq!(
        stats.refused, 0,
        "our guest's reports are all valid: {stats:?}"
    );
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}

/// The control: the same guest without the balloon keeps what it freed resident on the host
/// (nothing else gives guest memory back), so the drop above is the balloon's doing.
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_without_balloon_keeps_freed_memory_resident() {
    let (handle, _console, filled, _initrd) = boot_fill_and_free(None);
    assert!(handle.balloon_stats().is_none());
    std::thread::sleep(Duration::from_secs(10));
    let now = guest_rss(512);
    eprintln!(
        "no balloon: guest RAM RSS {} MiB filled, {} MiB 10 s after the free",
        filled >> 20,
        now >> 20
    );
    assert!(
        now + (16 << 20) >= filled,
        "RSS fell from {} to {} MiB without a balloon",
        filled >> 20,
        now >> 20
    );
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}

/// The anonymous (private, not file-backed) bytes of this process's guest RAM mappings (the
/// ones marked no-dump: guest RAM and what the VMM maps over it), from /proc/self/smaps.
fn guest_ram_anonymous() -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("own smaps");
    let (mut total, mut current) = (0u64, 0u64);
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Anonymous:") {
            current = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0)
                << 10;
        } else if let Some(flags) = line.strip_prefix("VmFlags:") {
            if flags.split_whitespace().any(|f| f == "dd") {
                total += current;
            }
            current = 0;
        }
    }
    total
}

fn e_name(p: &std::path::Path) -> String {
    p.file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned()
}

/// What the page sharing guest holds in zero pages (a tmpfs file of zeros), in MiB.
const ZERO_MIB: u64 = 32;

/// Page sharing (docs/page-sharing.md) on a running guest: busybox copied into a tmpfs (the
/// same bytes as the initrd's file) and a file of zeros; the pass drops the zero pages, maps the
/// copy's pages from the initrd template and the patched kernel text from the template it
/// captures, and the guest's private memory on the host falls by at least those. The guest then
/// still works: it runs the shared copy, finds it equal to the original, and writes into shared
/// and dropped pages (which copies them again) and reads its writes back.
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_shares_public_pages_and_still_works() {
    let (kernel, _initrd) = artifacts_or_fail();
    let busybox_len = std::fs::metadata("/bin/busybox").expect("busybox").len();
    let initrd = busybox_initrd(&format!(
        "#!/bin/busybox sh\n\
         B=/bin/busybox\n\
         $B mount -t proc proc /proc\n\
         $B mount -t devtmpfs devtmpfs /dev\n\
         $B mount -t tmpfs -o size=200m tmpfs /tmp\n\
         $B mkdir -p /tmp/share\n\
         $B mount -t virtiofs share /tmp/share || $B echo share-test: no virtiofs\n\
         $B mkdir /tmp/copy\n\
         $B cp /bin/busybox /tmp/copy/busybox\n\
         $B dd if=/dev/zero of=/tmp/zero bs=1M count={ZERO_MIB} 2>/dev/null\n\
         $B echo share-test: ready\n\
         while [ ! -e /tmp/share/go ]; do $B sleep 0.2; done\n\
         /tmp/copy/busybox cmp /tmp/copy/busybox /bin/busybox && \
           $B echo share-test: copy equal\n\
         /tmp/copy/busybox echo share-test: the shared copy runs\n\
         $B dd if=/dev/urandom of=/tmp/rand bs=4096 count=64 2>/dev/null\n\
         $B dd if=/tmp/rand of=/tmp/copy/busybox bs=4096 seek=8 conv=notrunc 2>/dev/null\n\
         $B dd if=/tmp/copy/busybox of=/tmp/part bs=4096 count=64 skip=8 2>/dev/null\n\
         $B cmp /tmp/part /tmp/rand && $B echo share-test: writes to shared pages hold\n\
         $B dd if=/tmp/rand of=/tmp/zero bs=4096 seek=100 conv=notrunc 2>/dev/null\n\
         $B dd if=/tmp/zero of=/tmp/part bs=4096 count=64 skip=100 2>/dev/null\n\
         $B cmp /tmp/part /tmp/rand && $B echo share-test: writes to dropped pages hold\n\
         $B echo share-test: done\n\
         exec $B sleep 100000\n"
    ));
    let templates = tempfile::tempdir().expect("a temp dir");
    let template_dir = templates.path().join("page-templates");
    let share = tempfile::tempdir().expect("a temp dir");
    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.memory_mib = 256;
    cfg.initrd = Some(initrd.path().into());
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1".into();
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    cfg.shared_fs = Some(vmm::SharedFsConfig {
        tag: "share".into(),
        host_dir: share.path().to_path_buf(),
    });
    cfg.page_sharing = Some(vmm::PageSharingConfig {
        template_dir: template_dir.clone(),
        domain: vmm::page_sharing::NODE_DOMAIN.into(),
        // Our busybox guest has seen no pod input: it may capture its kernel text.
        capture_kernel_text: true,
    });
    let handle = vmm::Vm::start(cfg).expect("the VM starts");
    wait_for(&console, "share-test: ready", Duration::from_secs(180));
    let before = guest_ram_anonymous();
    let report = handle.share_pages().expect("the sharing pass");
    let after = guest_ram_anonymous();
    eprintln!(
        "page sharing: guest RAM anonymous {} KiB before, {} KiB after; {report}",
        before >> 10,
        after >> 10
    );
    assert!(report.captured_kernel_text, "{report}");
    assert_eq!(report.templates.len(), 2, "{report}");
    assert!(report.templates[0].starts_with("initrd-files-"), "{report}");
    assert!(report.templates[1].starts_with("kernel-text-"), "{report}");
    let pages = |bytes: u64| bytes / 4096;
    // busybox twice in the guest's page cache (the unpacked initramfs and the copy).
    assert!(
        report.shared[0] >= 2 * pages(busybox_len) * 9 / 10,
        "busybox is {} pages; {report}",
        pages(busybox_len)
    );
    // The boot patches return thunks all over the text: most of its pages are private copies.
    assert!(report.shared[1] >= 256, "{report}");
    assert!(report.zero_dropped >= pages(ZERO_MIB << 20), "{report}");
    let freed = (ZERO_MIB << 20) + 2 * busybox_len * 9 / 10 + (1 << 20);
    assert!(
        before.saturating_sub(after) >= freed,
        "anonymous guest RAM {} KiB -> {} KiB, want at least {} KiB less; {report}",
        before >> 10,
        after >> 10,
        freed >> 10
    );
    let mode = |p: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).expect("stat").permissions().mode() & 0o777
    };
    assert_eq!(mode(&template_dir), 0o700);
    let names_in = |dir: &std::path::Path| {
        assert_eq!(mode(dir), 0o700, "{}", dir.display());
        let mut names = Vec::new();
        for e in std::fs::read_dir(dir).expect("a template dir") {
            let p = e.expect("an entry").path();
            assert_eq!(mode(&p), 0o444, "{}", p.display());
            names.push(e_name(&p));
        }
        names.sort();
        names
    };
    // The domain's two templates, nothing else (no temporary file) ...
    let names = names_in(&template_dir.join(vmm::page_sharing::NODE_DOMAIN));
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names[0].starts_with("initrd-files-"), "{names:?}");
    assert!(names[1].starts_with("kernel-text-"), "{names:?}");
    // ... and the captured kernel text (a file of its own: the domain maps a copy) with the
    // two files' remembered sums.
    let captured = names_in(&template_dir.join(vmm::page_sharing::CAPTURED_DIR));
    assert_eq!(captured.len(), 3, "{captured:?}");
    assert_eq!(captured[0], names[1], "{captured:?}");

    std::fs::write(share.path().join("go"), b"").expect("the go file");
    wait_for(&console, "share-test: done", Duration::from_secs(120));
    let text = console.text();
    for line in [
        "share-test: copy equal",
        "share-test: the shared copy runs",
        "share-test: writes to shared pages hold",
        "share-test: writes to dropped pages hold",
    ] {
        assert!(text.contains(line), "no {line:?} in the console:\n{text}");
    }
    // A second pass finds the kernel template made by the first and captures nothing.
    let again = handle.share_pages().expect("a second pass");
    eprintln!("page sharing, second pass: {again}");
    assert!(!again.captured_kernel_text, "{again}");
    assert_eq!(again.templates.len(), 2, "{again}");
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}

/// A VM without page sharing refuses the pass (nothing changes in it).
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_without_page_sharing_refuses_the_pass() {
    let (kernel, _initrd) = artifacts_or_fail();
    let initrd = busybox_initrd("#!/bin/busybox sh\nexec /bin/busybox sleep 100000\n");
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.memory_mib = 128;
    cfg.initrd = Some(initrd.path().into());
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1".into();
    cfg.serial = vmm::SerialSink::Null;
    let handle = vmm::Vm::start(cfg).expect("the VM starts");
    let r = handle.share_pages();
    assert!(
        matches!(
            r,
            Err(vmm::VmmError::PageSharing(
                vmm::page_sharing::PageSharingError::Off
            ))
        ),
        "{r:?}"
    );
    // The pause alone works on a running guest, and the guest keeps running after it.
    let vcpus_paused = handle
        .with_paused(Duration::from_secs(5), |_mem| true)
        .expect("a pause");
    assert!(vcpus_paused);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!handle.has_ended());
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}

/// The guest's local APIC timer runs in TSC-deadline mode (vmm/src/cpuid.rs offers it where the
/// host's KVM emulates it, as x86 KVM does everywhere since Linux 3.x): the kernel says it found it, lists the flag, and every CPU's clock
/// event device is `lapic-deadline`. So it skips the boot-time calibration of the APIC timer, the
/// loop in which a guest of the nested lane once spun for minutes (docs/nested-lane.md). Prints
/// how long the boot took (start to `/init`'s first line), for comparing.
#[test]
#[ignore = "needs a host whose KVM boots a Linux guest; make test runs it where check-host says so"]
fn linux_guest_uses_the_tsc_deadline_timer() {
    let (kernel, _initrd) = artifacts_or_fail();
    let initrd = busybox_initrd(
        "#!/bin/busybox sh\n\
         B=/bin/busybox\n\
         $B echo tscdl-test: init at $($B cat /proc/uptime 2>/dev/null)\n\
         $B mount -t proc proc /proc\n\
         $B mkdir /sys\n\
         $B mount -t sysfs sysfs /sys\n\
         $B echo tscdl-test: uptime $($B cut -d' ' -f1 /proc/uptime)\n\
         $B grep -qw tsc_deadline_timer /proc/cpuinfo && $B echo tscdl-test: flag present\n\
         for d in /sys/devices/system/clockevents/clockevent*; do \
           $B echo tscdl-test: $($B basename $d) $($B cat $d/current_device); done\n\
         $B echo tscdl-test: done\n\
         exec $B sleep 100000\n",
    );
    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.vcpus = 2;
    cfg.memory_mib = 256;
    cfg.initrd = Some(initrd.path().into());
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1".into();
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    let started = std::time::Instant::now();
    let handle = vmm::Vm::start(cfg).expect("the VM starts");
    wait_for(&console, "tscdl-test: uptime", Duration::from_secs(180));
    let boot = started.elapsed();
    wait_for(&console, "tscdl-test: done", Duration::from_secs(60));
    let text = console.text();
    let uptime = text
        .lines()
        .find_map(|l| l.split("tscdl-test: uptime ").nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    eprintln!(
        "tsc-deadline guest: /init after {} ms on the host, guest uptime {uptime} s",
        boot.as_millis()
    );
    assert!(
        text.contains("TSC deadline timer available"),
        "the kernel did not find the TSC-deadline timer; console:\n{text}"
    );
    assert!(
        text.contains("tscdl-test: flag present"),
        "no tsc_deadline_timer in the guest's /proc/cpuinfo; console:\n{text}"
    );
    let devices: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split("tscdl-test: clockevent").nth(1))
        .collect();
    assert_eq!(
        devices.len(),
        2,
        "one clock event device per vCPU; console:\n{text}"
    );
    for d in &devices {
        assert!(
            d.trim_end().ends_with(" lapic-deadline"),
            "clockevent{d}: not the TSC-deadline timer; console:\n{text}"
        );
    }
    handle.stop();
    handle.wait().expect("the VM ends cleanly");
}
