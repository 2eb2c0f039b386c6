//! `make bench`: our embedded VMM against QEMU's `microvm` machine, side by side in one run.
//!
//! Both boot the same test guest ELF (`hello`, which prints on COM1 and resets through the
//! i8042) on this host's `/dev/kvm`, interleaved run by run so that machine noise hits both
//! alike. Measured per run, from spawning the VMM process:
//! - `start_to_first_serial_byte`: until the first byte of the guest's console reaches us;
//! - `start_to_exit`: until the VMM process has exited after the guest's reset;
//! - `vmm_peak_rss`: the process's peak RSS (`ru_maxrss` from wait4) less the guest memory
//!   the guest touched, which for this guest is a few pages: so it is close to what the VMM
//!   itself costs on the host beyond guest memory.
//!
//! Prints one line per metric, `NAME ours=… qemu=… ratio=…` (medians; ratio = ours / qemu),
//! and the targets the issue sets. Timing assertions do not belong in tests on a noisy 2-core
//! machine: this is where the numbers are checked, by reading them.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// One measured boot.
#[derive(Debug, Clone, Copy)]
struct Sample {
    first_byte: Duration,
    exit: Duration,
    maxrss_kib: u64,
}

fn repo_root() -> PathBuf {
    // tests/ is one level below the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Spawns `cmd`, times its first stdout byte and its exit, and reads its peak RSS.
fn measure(mut cmd: Command, what: &str, timeout: Duration) -> Result<Sample> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    let mut stdout = child.stdout.take().context("no stdout pipe")?;
    let pid = child.id() as libc::pid_t;

    // Read the console on a thread so the timing of the first byte does not wait on the exit.
    let reader = std::thread::spawn(move || {
        let mut first = None;
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if first.is_none() {
                        first = Some(start.elapsed());
                    }
                    if all.len() < 1 << 20 {
                        all.extend_from_slice(&buf[..n]);
                    }
                }
            }
        }
        (first, all)
    });

    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let deadline = start + timeout;
    let exit = loop {
        // SAFETY: pid is our own child; status and usage point to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break start.elapsed();
        }
        if r < 0 {
            bail!("wait4 on {what}: {}", std::io::Error::last_os_error());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    let (first, console) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let exit_status = std::process::ExitStatus::from_raw(status);
    let console = String::from_utf8_lossy(&console);
    if !console.contains("RESULT: PASS") {
        bail!(
            "{what} did not report RESULT: PASS (exit {exit_status}); console:\n{console}\nstderr:\n{err}"
        );
    }
    let first_byte = first.context("no console output")?;
    Ok(Sample {
        first_byte,
        exit,
        maxrss_kib: usage.ru_maxrss as u64,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> Result<()> {
    let root = repo_root();
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let guest = std::env::var_os("BENCH_GUEST")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("build/guests/hello.elf"));
    let microvm = root.join("target/release/microvm");
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
    let qemu_cmd = || {
        let mut c = Command::new(qemu);
        c.args(["-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on"])
            .args(["-enable-kvm", "-cpu", "host", "-smp", "1"])
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
    // One warm-up of each, not counted: page cache, lazy binding.
    measure(ours_cmd(), "microvm (warm-up)", timeout)?;
    let qemu_ok = match measure(qemu_cmd(), "qemu (warm-up)", timeout) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("bench: QEMU cannot boot the test guest here, comparing nothing: {e:#}");
            false
        }
    };

    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..runs {
        // Interleaved, alternating who goes first.
        if i % 2 == 0 {
            ours.push(measure(ours_cmd(), "microvm", timeout)?);
            if qemu_ok {
                theirs.push(measure(qemu_cmd(), "qemu", timeout)?);
            }
        } else {
            if qemu_ok {
                theirs.push(measure(qemu_cmd(), "qemu", timeout)?);
            }
            ours.push(measure(ours_cmd(), "microvm", timeout)?);
        }
    }

    let ms = |v: &[Sample], f: fn(&Sample) -> Duration| {
        median(v.iter().map(|s| f(s).as_secs_f64() * 1000.0).collect())
    };
    let mib = |v: &[Sample]| median(v.iter().map(|s| s.maxrss_kib as f64 / 1024.0).collect());
    let line = |name: &str, unit: &str, o: f64, q: f64| {
        if qemu_ok {
            println!(
                "{name} ours={o:.1}{unit} qemu={q:.1}{unit} ratio={:.2}",
                o / q
            );
        } else {
            println!("{name} ours={o:.1}{unit} qemu=n/a ratio=n/a");
        }
    };
    println!(
        "# {runs} runs each, interleaved, medians; guest {} ({memory_mib} MiB, 1 vCPU) on /dev/kvm",
        guest.display()
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
    line("vmm_peak_rss", "MiB", mib(&ours), mib(&theirs));
    println!("# targets: start ratio <= 0.5; VMM overhead beyond guest memory <= 4 MiB");
    Ok(())
}
