//! VFIO passthrough on the EMBEDDED VMM: a host PCI device bound to vfio-pci is given to a guest
//! on the VMM's PCI root. Our Linux guest enumerates it with its real vendor:device id and the
//! BAR the VMM placed, and routes its INTx pin to the IOAPIC pin the MP table names; the
//! `pci-edu` test guest (tests/guests/pci-edu.c) then drives the edu device itself through its
//! BAR (identification and liveness registers), moves the BAR, takes the device's INTx
//! interrupts (raised through edu's interrupt register, acked, EOI'd, raised again, held back by
//! Interrupt Disable) and turns decoding off, each checked against the device's answers.
//!
//! This needs a host whose KVM boots our guest AND a device bound to vfio-pci behind an IOMMU.
//! `make test` runs it in the nested lane started with `--vfio` (docs/vfio.md): L1 has QEMU's
//! emulated intel-iommu and `edu` device (1234:11e8), and scripts/lane/embedded-vmm-tests.sh
//! binds edu to vfio-pci (scripts/lane/vfio-bind-edu.sh) and names it in
//! `MICROVM_TEST_VFIO_DEVICE` (its sysfs path) with `MICROVM_TEST_VFIO_ID` (vendor:device).
//! The test is `#[ignore]`d so a plain `cargo test` does not count it; without those variables it
//! fails, it never passes vacuously.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shim::{artifacts, host_check};

/// The guest's console, kept for the test to search.
#[derive(Clone, Default)]
struct Console(Arc<Mutex<Vec<u8>>>);

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < (4 << 20) {
            kept.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Console {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// The passed-through device's sysfs path, once checked to be bound to vfio-pci.
fn vfio_device() -> PathBuf {
    let sysfs = PathBuf::from(env("MICROVM_TEST_VFIO_DEVICE"));
    let driver = std::fs::read_link(sysfs.join("driver"))
        .unwrap_or_else(|e| panic!("{}: no driver bound: {e}", sysfs.display()));
    assert!(
        driver.ends_with("vfio-pci"),
        "{} is bound to {}, not vfio-pci",
        sysfs.display(),
        driver.display()
    );
    sysfs
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run this test through scripts/lane/embedded-vmm-tests.sh in a lane started with --vfio (docs/vfio.md)")
    })
}

#[test]
#[ignore = "needs KVM that boots a Linux guest and a device bound to vfio-pci; make test runs it in the nested lane with --vfio"]
fn guest_sees_the_passed_through_pci_device() {
    let sysfs = vfio_device();
    let id = env("MICROVM_TEST_VFIO_ID");
    let kernel = artifacts::default_kernel();
    let initrd = artifacts::default_initrd();
    assert!(
        kernel.exists(),
        "{} is missing: run `make kernel`",
        kernel.display()
    );
    if let Some(why) = host_check::probe(Some(&kernel)).linux_guest_blocker() {
        panic!("this host cannot boot a Linux guest under the embedded VMM: {why}");
    }

    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.initrd = Some(initrd.into());
    cfg.vcpus = 1;
    cfg.memory_mib = 256;
    // No `quiet`: the PCI core's enumeration lines are KERN_INFO. `apic=verbose` prints the MP
    // table's interrupt entries as the kernel parsed them; `pci=routeirq` makes the kernel route
    // every device's INTx at boot (as a driver's pci_enable_device would) and print the result.
    cfg.cmdline = "console=ttyS0 reboot=k panic=-1 apic=verbose pci=routeirq".into();
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    cfg.vfio = vec![vmm::VfioConfig {
        sysfs_path: sysfs.clone(),
    }];
    let vm = vmm::Vm::start(cfg).expect("the VMM starts with the device passed through");

    // Slot 0 is the host bridge; the device is the first one added, in slot 1. Its BAR 0 is
    // the first placement in the PCI window (vmm::layout::PCI_MMIO_START).
    let seen = format!("pci 0000:00:01.0: [{id}]");
    let bridge = "pci 0000:00:00.0: [1b36:0008] type 00 class 0x060000";
    let bar0 = format!(
        "pci 0000:00:01.0: BAR 0 [mem {:#010x}-",
        vmm::layout::PCI_MMIO_START
    );
    // INTx: edu has INTA; the VM has no virtio devices, so its IOAPIC pin is the first one the
    // layout hands to PCI (23). The MP table entry: PCI bus 0, source IRQ slot 1 << 2 | INTA,
    // active low (pol 3), level (trig 3), to the IOAPIC (APIC id = the vCPU count, 1).
    let gsi = vmm::layout::pci_intx_gsis(0)
        .next()
        .expect("an IOAPIC pin for PCI");
    let intx = (id == "1234:11e8").then(|| {
        (
            format!("pci 0000:00:01.0: PCI->APIC IRQ transform: INT A -> IRQ {gsi}"),
            format!("Int: type 0, pol 3, trig 3, bus 00, IRQ 04, APIC ID 1, APIC INT {gsi:02x}"),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    let found = loop {
        let text = console.text();
        if text.contains(&seen)
            && text.contains(bridge)
            && text.contains(&bar0)
            && intx
                .as_ref()
                .is_none_or(|(routed, mp)| text.contains(routed) && text.contains(mp))
        {
            break Some(text);
        }
        if Instant::now() > deadline || vm.wait_timeout(Duration::from_millis(200)).is_some() {
            break None;
        }
    };
    vm.stop();
    let _ = vm.wait_timeout(Duration::from_secs(30));
    let text = found.unwrap_or_else(|| {
        panic!(
            "the guest did not print {seen:?}, {bridge:?}, {bar0:?} and (edu) {intx:?} within 90 s; console:\n{}",
            console.text()
        )
    });
    let pci_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("pci 0000:00:"))
        .collect();
    println!("the guest's PCI lines:\n{}", pci_lines.join("\n"));
    match &intx {
        Some((routed, mp)) => println!("INTx: the kernel parsed {mp:?} and printed {routed:?}"),
        None => println!("INTx not checked: {id} is not QEMU's edu device"),
    }
    assert!(
        pci_lines.iter().any(|l| l.contains(&bar0)),
        "the guest did not see BAR 0 at the VMM's placement ({bar0:?}); PCI lines:\n{}",
        pci_lines.join("\n")
    );
}

#[test]
#[ignore = "needs KVM and QEMU's edu device bound to vfio-pci; make test runs it in the nested lane with --vfio"]
fn test_guest_drives_the_edu_device_through_its_bar() {
    let sysfs = vfio_device();
    assert_eq!(
        env("MICROVM_TEST_VFIO_ID"),
        "1234:11e8",
        "the pci-edu guest speaks to QEMU's edu device only"
    );
    let elf = artifacts::default_guest_dir().join("pci-edu.elf");
    assert!(
        elf.is_file(),
        "{} is missing: run `make guests`",
        elf.display()
    );
    let console = Console::default();
    let mut cfg = vmm::VmConfig::new(elf);
    cfg.vcpus = 1;
    cfg.memory_mib = 64;
    cfg.serial = vmm::SerialSink::Writer(Box::new(console.clone()));
    cfg.vfio = vec![vmm::VfioConfig { sysfs_path: sysfs }];
    let vm = vmm::Vm::start(cfg).expect("the VMM starts with the device passed through");
    // The guest resets the VM (i8042) after its RESULT line.
    let ended = vm.wait_timeout(Duration::from_secs(60));
    if ended.is_none() {
        vm.stop();
        let _ = vm.wait_timeout(Duration::from_secs(30));
    }
    let text = console.text();
    println!("{text}");
    let result = text
        .lines()
        .find(|l| l.starts_with("RESULT: "))
        .unwrap_or_else(|| panic!("the guest printed no RESULT line; console:\n{text}"));
    assert!(
        result.starts_with("RESULT: PASS"),
        "{result}; console:\n{text}"
    );
    assert!(ended.is_some(), "the VM did not end after its RESULT line");
}
