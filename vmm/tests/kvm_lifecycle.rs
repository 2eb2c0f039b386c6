//! Lifecycle: stop, bad input, several VMs at once, no leaks over many boots
//! (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use std::time::{Duration, Instant};
use vmm::{Vm, VmConfig, VmExit, VmmError};

fn wait_for_output(cap: &Capture, needle: &str) {
    let deadline = Instant::now() + GUEST_TIMEOUT;
    while !cap.text().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} on the console: {}",
            cap.text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The idle guest halts forever with interrupts off: its vCPU sits inside KVM_RUN until the
/// VMM kicks it. stop() must end the VM within a second, with every vCPU thread joined.
#[test]
fn stop_of_a_halted_guest_is_prompt() {
    for vcpus in [1, 2] {
        let (cfg, cap) = config("idle", vcpus, 64);
        let h = Vm::start(cfg).unwrap();
        wait_for_output(&cap, "halting forever");
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            h.wait_timeout(Duration::from_millis(10)).is_none(),
            "idle must not end alone"
        );
        let t = Instant::now();
        h.stop();
        let r = h
            .wait_timeout(Duration::from_secs(10))
            .expect("stop ends the VM");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "stop took {:?}",
            t.elapsed()
        );
        assert_eq!(r.unwrap(), VmExit::Stopped);
        assert!(matches!(h.wait(), Err(VmmError::AlreadyWaited)));
    }
}

/// Dropping the handle of a running VM stops it and returns promptly.
#[test]
fn drop_stops_the_vm() {
    let (cfg, cap) = config("idle", 1, 64);
    let h = Vm::start(cfg).unwrap();
    wait_for_output(&cap, "halting forever");
    let t = Instant::now();
    drop(h);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        t.elapsed()
    );
}

#[test]
fn bad_input_gives_clear_errors() {
    let e = Vm::start(VmConfig::new("/nonexistent/kernel.elf"))
        .err()
        .unwrap();
    assert!(matches!(e, VmmError::Kernel { .. }), "{e:?}");
    assert!(e.to_string().contains("/nonexistent/kernel.elf"), "{e}");

    let not_elf = std::env::temp_dir().join(format!("vmm-not-elf-{}", std::process::id()));
    std::fs::write(&not_elf, b"this is not an ELF file at all, just text").unwrap();
    let e = Vm::start(VmConfig::new(&not_elf)).err().unwrap();
    let _ = std::fs::remove_file(&not_elf);
    assert!(matches!(e, VmmError::Kernel { .. }), "{e:?}");
    assert!(e.to_string().contains("not a loadable ELF"), "{e}");

    let (mut cfg, _) = config("hello", 1, 64);
    cfg.vcpus = 0;
    assert!(Vm::start(cfg)
        .err()
        .unwrap()
        .to_string()
        .contains("at least 1 vCPU"));
    let (mut cfg, _) = config("hello", 1, 0);
    cfg.memory_mib = 0;
    assert!(Vm::start(cfg).err().unwrap().to_string().contains("0 MiB"));
    let (cfg, _) = config("hello", 1, 1 << 40);
    assert!(Vm::start(cfg)
        .err()
        .unwrap()
        .to_string()
        .contains("exceeds"));

    let (mut cfg, _) = config("hello", 1, 64);
    cfg.initrd = Some("/nonexistent/initrd".into());
    let e = Vm::start(cfg).err().unwrap();
    assert!(
        matches!(e, VmmError::Initrd { .. }) && e.to_string().contains("/nonexistent/initrd"),
        "{e}"
    );

    // An initrd larger than the guest's memory.
    let big = std::env::temp_dir().join(format!("vmm-big-initrd-{}", std::process::id()));
    std::fs::File::create(&big)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let (mut cfg, _) = config("hello", 1, 4);
    cfg.initrd = Some((&big).into());
    let e = Vm::start(cfg).err().unwrap();
    let _ = std::fs::remove_file(&big);
    assert!(e.to_string().contains("does not fit"), "{e}");

    // PVH forced on a kernel without the note is refused (a non-PVH ELF: the test binary itself
    // is not loadable either way, so check the error names the kernel).
}

#[test]
fn hello_with_an_initrd() {
    let initrd = std::env::temp_dir().join(format!("vmm-initrd-{}", std::process::id()));
    std::fs::write(&initrd, vec![0x5a; 100_000]).unwrap();
    let (mut cfg, cap) = config("hello", 1, 64);
    cfg.initrd = Some((&initrd).into());
    let r = run(cfg, &cap);
    let _ = std::fs::remove_file(&initrd);
    assert_eq!(r.unwrap(), VmExit::Reset);
    assert!(result_line(&cap.text())
        .unwrap()
        .starts_with("RESULT: PASS"));
}

#[test]
fn hello_with_a_shared_fs() {
    let dir = std::env::temp_dir().join(format!("vmm-shared-fs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut cfg, cap) = config("hello", 1, 64);
    cfg.shared_fs = Some(vmm::SharedFsConfig {
        tag: "pod".into(),
        host_dir: dir.clone(),
    });
    let h = Vm::start(cfg).expect("VM starts");
    // The virtio-fs device took the first virtio-mmio slot.
    assert!(
        h.cmdline().contains("virtio_mmio.device=4K@0xd0000000:5"),
        "{}",
        h.cmdline()
    );
    let r = h.wait_timeout(GUEST_TIMEOUT).expect("guest finishes");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.unwrap(), VmExit::Reset);
    assert!(result_line(&cap.text())
        .unwrap()
        .starts_with("RESULT: PASS"));

    // Bad shared-fs settings are refused before anything starts, naming the problem.
    let (mut cfg, _) = config("hello", 1, 64);
    cfg.shared_fs = Some(vmm::SharedFsConfig {
        tag: "x".repeat(37),
        host_dir: std::env::temp_dir(),
    });
    let e = Vm::start(cfg).err().unwrap().to_string();
    assert!(e.contains("invalid virtio-fs tag"), "{e}");
    let (mut cfg, _) = config("hello", 1, 64);
    cfg.shared_fs = Some(vmm::SharedFsConfig {
        tag: "pod".into(),
        host_dir: "/nonexistent/shared".into(),
    });
    let e = Vm::start(cfg).err().unwrap().to_string();
    assert!(e.contains("/nonexistent/shared"), "{e}");
}

#[test]
fn four_vms_at_once() {
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let (cfg, cap) = config(if i % 2 == 0 { "hello" } else { "smp" }, 2, 64);
            (Vm::start(cfg).unwrap(), cap)
        })
        .collect();
    for (h, cap) in handles {
        let r = h.wait_timeout(GUEST_TIMEOUT).expect("guest finished");
        assert_eq!(r.unwrap(), VmExit::Reset, "{}", cap.text());
        assert!(
            result_line(&cap.text())
                .unwrap()
                .starts_with("RESULT: PASS"),
            "{}",
            cap.text()
        );
    }
}

/// Pausing a running guest (every vCPU halted inside KVM_RUN, so each must be kicked out) holds
/// it for the closure and lets it continue: many times in a row, with 1 and 2 vCPUs; once the
/// VM has ended, a pause is a clear error, not a hang.
#[test]
fn pause_holds_a_halted_guest_and_lets_it_go_again() {
    for vcpus in [1, 2] {
        let (cfg, cap) = config("idle", vcpus, 64);
        let h = Vm::start(cfg).unwrap();
        wait_for_output(&cap, "halting forever");
        for _ in 0..20 {
            let first = h
                .with_paused(Duration::from_secs(10), |mem| {
                    use vm_memory::GuestMemory;
                    mem.num_regions()
                })
                .expect("the pause");
            assert_eq!(first, 1);
        }
        assert!(
            h.wait_timeout(Duration::from_millis(10)).is_none(),
            "the guest runs on after the pauses"
        );
        h.stop();
        assert_eq!(h.wait().unwrap(), VmExit::Stopped);
        assert!(matches!(
            h.with_paused(Duration::from_secs(10), |_| ()),
            Err(VmmError::Pause(vmm::PauseError::Ended))
        ));
    }
}

/// A page sharing pass on our idle test guest: it captures the guest's text template (the
/// first loadable segment) into a private directory and the guest runs on.
#[test]
fn a_sharing_pass_on_a_running_guest() {
    let dir = std::env::temp_dir().join(format!("kvm-page-sharing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut cfg, cap) = config("idle", 1, 64);
    cfg.page_sharing = Some(vmm::PageSharingConfig {
        template_dir: dir.clone(),
        domain: vmm::page_sharing::NODE_DOMAIN.into(),
        // A test guest: it has seen no pod input.
        capture_kernel_text: true,
    });
    let h = Vm::start(cfg).unwrap();
    wait_for_output(&cap, "halting forever");
    let first = h.share_pages().expect("a pass");
    assert!(first.captured_kernel_text, "{first}");
    let second = h.share_pages().expect("a second pass");
    assert!(!second.captured_kernel_text, "{second}");
    assert_eq!(second.templates.len(), 1, "{second}");
    assert!(h.wait_timeout(Duration::from_millis(10)).is_none());
    h.stop();
    assert_eq!(h.wait().unwrap(), VmExit::Stopped);
    std::fs::remove_dir_all(&dir).unwrap();
}
