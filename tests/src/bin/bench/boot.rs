//! The boot part (`BENCH_ONLY=boot`): our VMM against QEMU's `microvm` machine booting the
//! same test guest on this host's `/dev/kvm`, interleaved run by run, with the lines
//! `vmm_start_to_first_serial_byte`, `vmm_start_to_exit` and `vmm_peak_rss` (see main.rs).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::measure::{measure, Sample};
use crate::paths::{bin_dir, repo_root};
use crate::report::median;

/// QEMU's CPU models for the boot comparison, in order of preference: the host's CPU as KVM
/// offers it, then the same without IA32_ARCH_CAPABILITIES (MSR 0x10a), which kvm-pvm refuses
/// to set (QEMU 7.2 then aborts: `failed to set MSR 0x10a to 0x69`); our VMM does not set that
/// MSR either.
const QEMU_CPU_MODELS: &[&str] = &["host", "host,-arch-capabilities"];

/// The first `n` lines of an error chain (without blank lines and `measure`'s `stderr:`
/// heading), joined, for one-line reports.
fn first_lines(e: &anyhow::Error, n: usize) -> String {
    format!("{e:#}")
        .lines()
        .filter(|l| !l.trim().is_empty() && l.trim() != "stderr:")
        .take(n)
        .collect::<Vec<_>>()
        .join(" | ")
}

pub(crate) fn vmm_boot_bench() -> Result<()> {
    let root = repo_root();
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let guest = std::env::var_os("BENCH_GUEST")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("build/guests/hello.elf"));
    let microvm = bin_dir()?.join("microvm");
    let qemu = "qemu-system-x86_64";
    let memory_mib = 128;
    for (p, what) in [
        (&guest, "test guest (make guests)"),
        (&microvm, "microvm (make build)"),
    ] {
        if !p.exists() {
            bail!("{} is missing: build the {what}", p.display());
        }
    }

    let ours_cmd = || {
        let mut c = Command::new(&microvm);
        c.args(["boot", "--backend", "kvm", "--vcpus", "1"])
            .args(["--memory-mib", &memory_mib.to_string()])
            .arg("--kernel")
            .arg(&guest);
        c
    };
    let qemu_cmd = |cpu: &str| {
        let mut c = Command::new(qemu);
        c.args(["-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on"])
            .args(["-enable-kvm", "-cpu", cpu, "-smp", "1"])
            .args(["-m", &format!("{memory_mib}M")])
            .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
            .args(["-serial", "stdio", "-display", "none"])
            // microvm has no i8042 of its own; the guest resets through one, as on ours.
            .args(["-device", "i8042"])
            .arg("-kernel")
            .arg(&guest);
        c
    };

    let timeout = Duration::from_secs(60);
    // One warm-up of each, not counted: page cache, lazy binding. The warm-up also picks QEMU's
    // CPU model: the first of QEMU_CPU_MODELS (or $BENCH_QEMU_CPU) that boots the guest here.
    measure(ours_cmd(), "microvm (warm-up)", timeout)?;
    let candidates: Vec<String> = match std::env::var("BENCH_QEMU_CPU") {
        Ok(cpu) if !cpu.is_empty() => vec![cpu],
        _ => QEMU_CPU_MODELS.iter().map(|c| c.to_string()).collect(),
    };
    let mut refused = Vec::new();
    let mut cpu = None;
    for candidate in &candidates {
        match measure(qemu_cmd(candidate), "qemu (warm-up)", timeout) {
            Ok(_) => {
                cpu = Some(candidate.clone());
                break;
            }
            Err(e) => refused.push(format!("-cpu {candidate}: {}", first_lines(&e, 3))),
        }
    }
    let Some(cpu) = cpu else {
        bail!(
            "QEMU cannot boot the test guest on this /dev/kvm with any CPU model tried, so there \
             is nothing to compare with:\n  {}",
            refused.join("\n  ")
        );
    };

    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..runs {
        // Interleaved, alternating who goes first.
        if i % 2 == 0 {
            ours.push(measure(ours_cmd(), "microvm", timeout)?);
            theirs.push(measure(qemu_cmd(&cpu), "qemu", timeout)?);
        } else {
            theirs.push(measure(qemu_cmd(&cpu), "qemu", timeout)?);
            ours.push(measure(ours_cmd(), "microvm", timeout)?);
        }
    }

    let ms = |v: &[Sample], f: fn(&Sample) -> Duration| {
        median(v.iter().map(|s| f(s).as_secs_f64() * 1000.0).collect())
    };
    let mib = |v: &[Sample], f: fn(&Sample) -> u64| {
        median(v.iter().map(|s| f(s) as f64 / 1024.0).collect())
    };
    let line = |name: &str, unit: &str, o: f64, q: f64| {
        println!(
            "{name} ours={o:.1}{unit} qemu={q:.1}{unit} ratio={:.2}",
            o / q
        );
    };
    println!(
        "# {runs} runs each, interleaved, medians; guest {} ({memory_mib} MiB, 1 vCPU) on /dev/kvm",
        guest.display()
    );
    println!(
        "# qemu: -M microvm -enable-kvm -cpu {cpu}{}",
        if refused.is_empty() {
            String::new()
        } else {
            format!(" (refused here: {})", refused.join("; "))
        }
    );
    line(
        "vmm_start_to_first_serial_byte",
        "ms",
        ms(&ours, |s| s.first_byte),
        ms(&theirs, |s| s.first_byte),
    );
    line(
        "vmm_start_to_exit",
        "ms",
        ms(&ours, |s| s.exit),
        ms(&theirs, |s| s.exit),
    );
    line(
        "vmm_peak_rss",
        "MiB",
        mib(&ours, |s| s.peak_rss_kib),
        mib(&theirs, |s| s.peak_rss_kib),
    );
    println!(
        "# peak RSS is each VMM process's VmHWM at its exit; wait4's ru_maxrss, which also \
         counts this bench's own peak RSS at the spawn: ours={:.1}MiB qemu={:.1}MiB",
        mib(&ours, |s| s.wait4_maxrss_kib),
        mib(&theirs, |s| s.wait4_maxrss_kib)
    );
    println!(
        "# RSS at the exit: anonymous (heap, stacks, guest pages touched; what each VMM process \
         adds) ours={:.1}MiB qemu={:.1}MiB; mapped from files (the binary and its shared \
         libraries, page cache shared by every process of the same binary) ours={:.1}MiB \
         qemu={:.1}MiB",
        mib(&ours, |s| s.exit_rss.anon_kib),
        mib(&theirs, |s| s.exit_rss.anon_kib),
        mib(&ours, |s| s.exit_rss.mapped_kib),
        mib(&theirs, |s| s.exit_rss.mapped_kib)
    );
    println!("# targets: start ratio <= 0.5; VMM overhead beyond guest memory <= 4 MiB");
    Ok(())
}
