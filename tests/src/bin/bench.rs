//! `make bench`: our embedded VMM against QEMU's `microvm` machine, side by side in one run.
//!
//! Both boot the same test guest ELF (`hello`, which prints on COM1 and resets through the
//! i8042) on this host's `/dev/kvm`, interleaved run by run so that machine noise hits both
//! alike. QEMU runs with the first CPU model of [`QEMU_CPU_MODELS`] (or `$BENCH_QEMU_CPU`) that
//! boots the guest here, and the report names it. Measured per run, from spawning the VMM
//! process:
//! - `start_to_first_serial_byte`: until the first byte of the guest's console reaches us;
//! - `start_to_exit`: until the VMM process has exited after the guest's reset;
//! - `vmm_peak_rss`: the process's peak RSS (`VmHWM` at its exit, see [`measure`]); the guest
//!   touches a few pages only, so it is close to what the VMM itself costs on the host beyond
//!   guest memory. A `#` line splits the RSS at the exit into anonymous memory (heap, stacks,
//!   the pages the guest touched: what each VMM process adds) and pages mapped from files (the
//!   binary's code and data, the shared libraries: page cache that every process running the
//!   same binary shares).
//!
//! Prints one line per metric, `NAME ours=… qemu=… ratio=…` (medians; ratio = ours / qemu),
//! and the targets the issue sets. Timing assertions do not belong in tests on a noisy 2-core
//! machine: this is where the numbers are checked, by reading them.
//!
//! Then pods through CRI (needs root; see `pod_bench`): a private containerd with the `runc` and
//! `microvm` handlers, `BENCH_PODS` (default 10) timed pod lifecycles each, interleaved, and the
//! host memory of each idle pod; lines `NAME ours=… runc=… ratio=…` with the VM backend and
//! accelerator, and the targets; on the embedded VMM also the idle pod's guest RAM and
//! the shim's own memory. `BENCH_IDLE_SECS` (default 1) is how long after StartContainer the
//! idle memory is read; `BENCH_FREE_PAGE_REPORTING=0` gives the pods no balloon
//! (docs/virtio-balloon.md), to measure what it gives back; `BENCH_PAGE_SHARING=namespace|node|off` sets
//! the shim's `page_sharing` (docs/page-sharing.md). The backend is the one `microvm check-host` picks, or
//! `BENCH_HYPERVISOR=kvm|qemu` (kvm where check-host says it cannot boot is an error).
//!
//! Then the pod network (needs root; see `net_bench`): a `microvm` and a `runc` pod on another
//! private containerd, each serving busybox httpd and two `nc` servers, and from the host through
//! each pod's IP, interleaved: TCP throughput pod -> host and host -> pod, and the latency of
//! small HTTP requests (median and p99); the same line format. Knobs: `BENCH_NET_RUNS` (10),
//! `BENCH_NET_MIB` (32 per transfer), `BENCH_NET_REQUESTS` (100 per run).
//!
//! Then pod density (needs root; see `density.rs`): `BENCH_DENSITY` (default 10) idle pods per
//! handler running at once, the median and total PSS per pod; `BENCH_DENSITY_MAX=N` instead
//! starts `microvm` pods until N run or the host's memory is nearly used (the long run).
//!
//! `BENCH_ONLY` runs some parts only: a comma-separated list of `boot`, `pods`, `net`,
//! `density`.
//!
//! A comparison that cannot run, or a number that cannot be had, fails the benchmark (exit 1,
//! the reason on stderr) instead of printing n/a. docs/benchmarks.md has the numbers of this host
//! and what dominates them.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use microvm_tests::containerd::{ContainerdOptions, PrivateContainerd};
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::images::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use microvm_tests::lifecycle::{
    choose_vm_backend, pod_processes, timed_pod_lifecycle_with, vm_accel, wait_pod_gone,
    write_shim_config, LifecycleOptions, LifecycleOutcome, LifecycleTimings, PodMemory, VmBackend,
};
use microvm_tests::pod_net::{
    download, http_get, mib_per_s, percentile, pod_ip, server_script, upload, wait_servers,
    PodNetError, PodServers, ServerSpec, POD_PORTS,
};
use std::collections::HashMap;

#[path = "bench/density.rs"]
mod density;

/// One measured boot.
#[derive(Debug, Clone, Copy)]
struct Sample {
    first_byte: Duration,
    exit: Duration,
    /// The VMM process's own peak RSS: `VmHWM` of /proc/<pid>/status at its exit.
    peak_rss_kib: u64,
    /// `ru_maxrss` as wait4 reports it, which is never below this bench's own peak RSS when it
    /// spawned the VMM (see [`measure`]); kept for comparison with older reports.
    wait4_maxrss_kib: u64,
    /// The RSS at the exit split (`/proc/<pid>/smaps_rollup`, read at the same stop).
    exit_rss: RssSplit,
}

/// A process's resident memory split by what backs it, in KiB.
#[derive(Debug, Clone, Copy)]
struct RssSplit {
    /// Anonymous pages: heap, stacks, guest memory the guest touched.
    anon_kib: u64,
    /// Everything else resident: pages mapped from files (the binary, the shared libraries)
    /// and shared memory.
    mapped_kib: u64,
}

fn repo_root() -> PathBuf {
    // tests/ is one level below the workspace root.
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Where the shim and the `microvm` tool are: next to this binary (`make build` builds them all
/// into the same target folder).
fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the bench binary")?;
    Ok(exe
        .parent()
        .context("the bench binary has no folder")?
        .to_path_buf())
}

/// Spawns `cmd`, times its first stdout byte and its exit, and reads its peak RSS.
///
/// The peak RSS is `VmHWM` of /proc/<pid>/status, read while the process stops at its exit
/// (traced with PTRACE_SEIZE and PTRACE_O_TRACEEXIT; the stop comes before its memory is
/// released). Not wait4's `ru_maxrss`: Linux keeps a process's maxrss across execve and folds
/// into it the high-water mark of the address space execve replaced, which for a spawned child
/// is its parent's (posix_spawn shares it, fork copies it). So `ru_maxrss` of a VMM spawned from
/// here is never below this bench's own peak RSS (about 4 MiB), whatever the VMM uses.
fn measure(mut cmd: Command, what: &str, timeout: Duration) -> Result<Sample> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let start = Instant::now();
    // spawn returns once the child has exec'd the VMM (or failed to).
    let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    let mut stdout = child.stdout.take().context("no stdout pipe")?;
    let pid = child.id() as libc::pid_t;
    // SAFETY: PTRACE_SEIZE attaches to our own child without stopping it; the data argument is
    // the option bits, no memory is passed.
    let seized = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            libc::PTRACE_O_TRACEEXIT as usize as *mut libc::c_void,
        )
    };
    if seized != 0 {
        let e = std::io::Error::last_os_error();
        kill_and_reap(pid);
        bail!("PTRACE_SEIZE of {what} (pid {pid}): {e}");
    }

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
    let mut peak_rss_kib = None;
    let mut exit_rss = None;
    let exit = loop {
        // SAFETY: pid is our own child; status and usage point to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid && libc::WIFSTOPPED(status) {
            // A ptrace stop: at the exit, read the peak RSS; pass any signal on.
            let event = (status >> 16) & 0xff;
            let signal = if event == libc::PTRACE_EVENT_EXIT {
                peak_rss_kib = vm_hwm_kib(pid);
                exit_rss = rss_split(pid);
                0
            } else if event == 0 {
                libc::WSTOPSIG(status)
            } else {
                0
            };
            resume(pid, signal).with_context(|| format!("resuming {what}"))?;
            continue;
        }
        if r == pid {
            break start.elapsed();
        }
        if r < 0 {
            bail!("wait4 on {what}: {}", std::io::Error::last_os_error());
        }
        if Instant::now() > deadline {
            kill_and_reap(pid);
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
    let peak_rss_kib = peak_rss_kib.with_context(|| {
        format!("{what} exited without the exit stop where its peak RSS is read")
    })?;
    let exit_rss = exit_rss.with_context(|| {
        format!("{what}: no smaps_rollup at the exit stop where its RSS is split")
    })?;
    Ok(Sample {
        first_byte,
        exit,
        peak_rss_kib,
        wait4_maxrss_kib: usage.ru_maxrss as u64,
        exit_rss,
    })
}

/// The resident memory of `pid` split into anonymous and mapped from files
/// (`/proc/<pid>/smaps_rollup`: `Rss` and `Anonymous`, both KiB).
fn rss_split(pid: libc::pid_t) -> Option<RssSplit> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    parse_rss_split(&rollup)
}

fn parse_rss_split(rollup: &str) -> Option<RssSplit> {
    let field = |name: &str| -> Option<u64> {
        rollup
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let rss = field("Rss")?;
    let anon_kib = field("Anonymous")?;
    Some(RssSplit {
        anon_kib,
        mapped_kib: rss.checked_sub(anon_kib)?,
    })
}

/// `VmHWM` (peak RSS, KiB) of /proc/<pid>/status.
fn vm_hwm_kib(pid: libc::pid_t) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Resumes our stopped tracee `pid`, delivering `signal` (0: none).
fn resume(pid: libc::pid_t, signal: libc::c_int) -> std::io::Result<()> {
    // SAFETY: PTRACE_CONT on our own stopped tracee; the data argument is a signal number, no
    // memory is passed.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_CONT,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            signal as usize as *mut libc::c_void,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Kills our child `pid` (traced or not) and reaps it, resuming it from any ptrace stop on the
/// way (a traced process stops at its exit even when killed).
fn kill_and_reap(pid: libc::pid_t) {
    // SAFETY: kill(2) of our own child, which is not reaped yet (so the pid is still ours).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: pid is our own child; status points to a live local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r != pid || !libc::WIFSTOPPED(status) {
            return;
        }
        let _ = resume(pid, 0);
    }
}

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

/// A part of the benchmark, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Our VMM against QEMU booting the test guest.
    Boot,
    /// Pod lifecycles and idle memory, `microvm` against `runc`.
    Pods,
    /// The pod network through the pod IP, `microvm` against `runc`.
    Net,
    /// Many idle pods at once, `microvm` against `runc` (bench/density.rs).
    Density,
}

impl Part {
    const ALL: [Part; 4] = [Part::Boot, Part::Pods, Part::Net, Part::Density];

    /// Its name in `BENCH_ONLY`.
    fn name(self) -> &'static str {
        match self {
            Part::Boot => "boot",
            Part::Pods => "pods",
            Part::Net => "net",
            Part::Density => "density",
        }
    }

    /// What the failure message calls it.
    fn what(self) -> &'static str {
        match self {
            Part::Boot => "the boot comparison",
            Part::Pods => "the pod comparison",
            Part::Net => "the pod network comparison",
            Part::Density => "the pod density comparison",
        }
    }
}

/// The parts `BENCH_ONLY` selects: a comma-separated list of part names (unset or empty: all),
/// in the order they run.
fn selected_parts(only: &str) -> Result<Vec<Part>, String> {
    if only.trim().is_empty() {
        return Ok(Part::ALL.to_vec());
    }
    let mut wanted = Vec::new();
    for name in only.split(',').map(str::trim) {
        match Part::ALL.iter().find(|p| p.name() == name) {
            Some(p) => wanted.push(*p),
            None => {
                return Err(format!(
                    "BENCH_ONLY={only:?}: {name:?} is not a part; expected a comma-separated \
                     list of {} (or unset for all)",
                    Part::ALL.map(Part::name).join(", ")
                ))
            }
        }
    }
    Ok(Part::ALL
        .into_iter()
        .filter(|p| wanted.contains(p))
        .collect())
}

/// Runs the selected parts. A part whose comparison cannot run (or that misses a number it
/// was to report) fails the benchmark: the reason goes to stderr and the exit is non-zero. The
/// other parts still run, so one failure does not hide the others' numbers.
fn main() -> ExitCode {
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let parts = match selected_parts(&only) {
        Ok(parts) => parts,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = Vec::new();
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")
    };
    for part in parts {
        let result = match part {
            Part::Boot => vmm_boot_bench(),
            Part::Pods => runtime().and_then(|r| r.block_on(pod_bench())),
            Part::Net => runtime().and_then(|r| r.block_on(net_bench())),
            Part::Density => runtime().and_then(|r| r.block_on(density::density_bench())),
        };
        if let Err(e) = result {
            eprintln!("bench: {} FAILED: {e:#}", part.what());
            failed.push(part.name());
        }
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: FAILED: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}

fn vmm_boot_bench() -> Result<()> {
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

/// An error of a step, followed by the last lines of containerd's log (where the shim logs).
fn with_log(ctrd: &PrivateContainerd, what: &str, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: {e}\n--- the last lines of containerd's log ---\n{}",
        ctrd.log_tail()
    )
}

/// Idle memory targets of the issue, per pod: with the embedded VMM (the shim holds the VM), and
/// with the QEMU backend.
const IDLE_MEMORY_TARGET_EMBEDDED_MIB: f64 = 32.0;
const IDLE_MEMORY_TARGET_QEMU_MIB: f64 = 64.0;
/// Lifecycle target of the issue: ours / runc.
const LIFECYCLE_RATIO_TARGET: f64 = 1.5;
/// Fewer pods per handler than this and the medians say little (the report says so).
const MIN_PODS: usize = 5;

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

/// How the `microvm` handler's VMs run in this benchmark.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodBackend {
    /// The shim config's `hypervisor`: `kvm` (the embedded VMM) or `qemu`.
    hypervisor: &'static str,
    /// Why: check-host's verdict, or the BENCH_HYPERVISOR override.
    why: String,
}

impl PodBackend {
    fn embedded(&self) -> bool {
        self.hypervisor == "kvm"
    }

    /// The name on the report lines.
    fn label(&self) -> &'static str {
        if self.embedded() {
            "embedded"
        } else {
            "qemu"
        }
    }
}

/// The backend: check-host's choice (`exit 0`: the embedded VMM, `2`: QEMU), unless
/// `BENCH_HYPERVISOR` (`kvm` or `qemu`) forces one; forcing `kvm` where check-host says our guest
/// cannot boot under the embedded VMM is an error with check-host's report.
fn pick_backend(check: &VmBackend, forced: Option<&str>) -> Result<PodBackend> {
    let verdict = format!("check-host: {}", check.reason);
    match forced.unwrap_or("") {
        "" | "auto" => Ok(PodBackend {
            hypervisor: check.hypervisor,
            why: verdict,
        }),
        "kvm" if check.hypervisor == "kvm" => Ok(PodBackend {
            hypervisor: "kvm",
            why: format!("BENCH_HYPERVISOR=kvm; {verdict}"),
        }),
        "kvm" => bail!(
            "BENCH_HYPERVISOR=kvm, but the embedded VMM cannot boot our guest here \
             ({verdict}); check-host's report:\n{}",
            check.report.trim_end()
        ),
        "qemu" => Ok(PodBackend {
            hypervisor: "qemu",
            why: format!("BENCH_HYPERVISOR=qemu; {verdict}"),
        }),
        other => bail!("BENCH_HYPERVISOR={other:?}: expected kvm, qemu or auto"),
    }
}

/// The accelerator of the embedded VMM, from check-host's KVM kind (`kvm_kind` of
/// `check-host --json`): `kvm` on hardware virtualization, `nested-kvm` on VMX/SVM from an outer
/// hypervisor, `nested-svm-tcg` on SVM emulated by QEMU's TCG (the nested lane, docs/nested-lane.md),
/// `kvm-pvm` on kvm-pvm (JSON `pvm`), and the kind itself for any other.
fn embedded_accel(kvm_kind: &str) -> String {
    match kvm_kind {
        "hardware" => "kvm".to_string(),
        "nested" => "nested-kvm".to_string(),
        "svm-emulated-by-qemu-tcg" => "nested-svm-tcg".to_string(),
        "pvm" | "kvm-pvm" => "kvm-pvm".to_string(),
        other => other.to_string(),
    }
}

/// `kvm_kind` of `<microvm> check-host --json --kernel <kernel>`.
fn check_host_kvm_kind(microvm: &Path, kernel: &Path) -> Result<String> {
    let out = Command::new(microvm)
        .args(["check-host", "--json", "--kernel"])
        .arg(kernel)
        .output()
        .with_context(|| format!("running {} check-host --json", microvm.display()))?;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "check-host --json (exit {}) printed no JSON: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    report["kvm_kind"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("check-host --json has no kvm_kind: {report}"))
}

/// What the pod and network parts share: the backend of the `microvm` handler, its shim config
/// and a private containerd with both handlers, the images imported.
struct PodSetup {
    backend: PodBackend,
    /// On the embedded VMM, its accelerator from check-host (QEMU's is read from each pod's QEMU
    /// command line).
    embedded_accel: Option<String>,
    /// The VM size the shim gives a pod without limits (ours set none).
    vm_size: shim::sandbox::spec::VmSize,
    /// The shim's `guest_base_memory_mib`: what a VM holds beyond its containers' limits.
    guest_base_mib: u64,
    /// The shim's `boot_files` (`BENCH_BOOT_FILES`).
    boot_files: shim::config::BootFiles,
    /// The shim's `free_page_reporting` (the balloon, docs/virtio-balloon.md).
    free_page_reporting: bool,
    /// The shim's `page_sharing` (`BENCH_PAGE_SHARING`, docs/page-sharing.md).
    page_sharing: shim::config::PageSharing,
    // Fields drop in order: the CRI client before its containerd.
    cri: CriClient,
    ctrd: PrivateContainerd,
    /// Holds the shim config for the life of the containerd.
    config_dir: tempfile::TempDir,
}

impl PodSetup {
    /// Picks the backend (check-host's choice, or `BENCH_HYPERVISOR`), writes the shim config
    /// and starts the private containerd (the default CNI bridge).
    async fn start() -> Result<PodSetup> {
        let bin_dir = bin_dir()?;
        let microvm = bin_dir.join("microvm");
        // `MICROVM_KERNEL` / `MICROVM_INITRD` as for the tests, else the repo's build/.
        let kernel = shim::artifacts::default_kernel();
        let initrd = shim::artifacts::default_initrd();
        for p in [
            &microvm,
            &bin_dir.join("containerd-shim-microvm-v1"),
            &kernel,
            &initrd,
        ] {
            if !p.exists() {
                bail!("{} is missing: make build kernel initrd", p.display());
            }
        }
        let check = choose_vm_backend(&microvm, &kernel)?;
        let backend = pick_backend(&check, std::env::var("BENCH_HYPERVISOR").ok().as_deref())?;
        let embedded_accel = if backend.embedded() {
            Some(embedded_accel(&check_host_kvm_kind(&microvm, &kernel)?))
        } else {
            None
        };
        let config_dir = tempfile::tempdir().context("temp dir for the shim config")?;
        let config = write_shim_config(
            config_dir.path(),
            backend.hypervisor,
            &kernel,
            &initrd,
            "info",
        )?;
        // `BENCH_BOOT_FILES=copy|map`: the shim's `boot_files` (docs/density.md), to measure
        // the embedded VMM's copied boot files against the mapped ones (the default).
        if let Ok(how) = std::env::var("BENCH_BOOT_FILES") {
            if how != "map" && how != "copy" {
                bail!("BENCH_BOOT_FILES={how:?}: expected map or copy");
            }
            let mut text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            text.insert_str(0, &format!("boot_files = \"{how}\"\n"));
            std::fs::write(&config, text)
                .with_context(|| format!("writing {}", config.display()))?;
        }
        // `BENCH_PAGE_SHARING=namespace|node|off`: the shim's `page_sharing`
        // (docs/page-sharing.md; `public` is the old name of `node`).
        if let Ok(how) = std::env::var("BENCH_PAGE_SHARING") {
            if !["namespace", "node", "public", "off"].contains(&how.as_str()) {
                bail!("BENCH_PAGE_SHARING={how:?}: expected namespace, node or off");
            }
            let mut text = std::fs::read_to_string(&config).context("reading the shim config")?;
            text.insert_str(0, &format!("page_sharing = \"{how}\"\n"));
            std::fs::write(&config, text).context("writing the shim config")?;
        }
        if std::env::var("BENCH_FREE_PAGE_REPORTING").as_deref() == Ok("0") {
            let mut text = std::fs::read_to_string(&config).context("reading the shim config")?;
            text.insert_str(0, "free_page_reporting = false\n");
            std::fs::write(&config, text).context("writing the shim config")?;
        }
        let shim_config = shim::config::Config::load(Some(&config))
            .with_context(|| format!("reading back the shim config {}", config.display()))?;
        let vm_size = shim::sandbox::spec::vm_size(&shim_config, &HashMap::new())
            .map_err(|e| anyhow::anyhow!("the VM size of a pod without limits: {e}"))?;
        let ctrd = PrivateContainerd::start(ContainerdOptions {
            extra_path: vec![bin_dir],
            microvm_config: Some(config),
            ..ContainerdOptions::default()
        })
        .context("starting the private containerd")?;
        let cri = CriClient::connect(ctrd.socket(), Duration::from_secs(120))
            .await
            .map_err(|e| with_log(&ctrd, "CRI", e))?;
        cri.wait_ready(&[PAUSE_IMAGE, BUSYBOX_IMAGE], Duration::from_secs(30))
            .await
            .map_err(|e| with_log(&ctrd, "CRI not ready", e))?;
        Ok(PodSetup {
            backend,
            embedded_accel,
            vm_size,
            guest_base_mib: shim_config.guest_base_memory_mib,
            boot_files: shim_config.boot_files,
            free_page_reporting: shim_config.free_page_reporting,
            page_sharing: shim_config.page_sharing,
            cri,
            ctrd,
            config_dir,
        })
    }
}

/// Pods through CRI on one private containerd, `runc` and `microvm` handlers interleaved
/// (alternating which goes first), after one uncounted warm-up pod of each:
/// - the lifecycle of `microvm_tests::lifecycle::timed_pod_lifecycle` (RunPodSandbox,
///   CreateContainer + StartContainer of a busybox `sleep`, ExecSync `uname -r`, StopPodSandbox,
///   RemovePodSandbox), per step and total;
/// - the host memory of the idle pod (its container sleeping, 1 s after StartContainer): the PSS
///   of the pod's shim and everything it started (for `microvm` on QEMU: QEMU with the guest's
///   touched memory, virtiofsd, vhost-device-vsock; on the embedded VMM the shim alone, which
///   holds the VM, split into guest RAM and the rest; for `runc` pause and the container).
///
/// The backend is check-host's choice unless `BENCH_HYPERVISOR` forces one (see
/// [`pick_backend`]). Every pod must leave nothing behind before the next starts. A failing
/// ExecSync of the `microvm` handler is reported on its line (the totals then leave exec out)
/// and fails the benchmark once everything is printed; so does any number that is missing.
async fn pod_bench() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the pod benchmark starts containerd and VMs: run it as root (or BENCH_ONLY=boot)");
    }
    let pods: usize = std::env::var("BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    if pods == 0 {
        bail!("BENCH_PODS=0: nothing to compare");
    }
    let PodSetup {
        backend,
        embedded_accel,
        vm_size,
        guest_base_mib,
        free_page_reporting,
        cri,
        ctrd,
        config_dir: _config_dir,
        ..
    } = PodSetup::start().await?;

    let idle_secs: u64 = std::env::var("BENCH_IDLE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let ours_opts = LifecycleOptions {
        idle_memory_after: Some(Duration::from_secs(idle_secs)),
        tolerate_exec_failure: true,
        split_guest_ram_of: backend.embedded().then_some(vm_size.memory_mib << 20),
    };
    let runc_opts = LifecycleOptions {
        split_guest_ram_of: None,
        ..ours_opts
    };
    let run_one = |handler: &'static str, name: String| {
        let ctrd = &ctrd;
        let cri = &cri;
        let opts = if handler == "microvm" {
            ours_opts
        } else {
            runc_opts
        };
        async move {
            let outcome = timed_pod_lifecycle_with(ctrd, cri, handler, &name, HashMap::new(), opts)
                .await
                .map_err(|e| with_log(ctrd, &format!("{handler} pod {name}"), e))?;
            let left = wait_pod_gone(
                ctrd,
                &outcome.pod_id,
                outcome.netns.as_deref(),
                Duration::from_secs(30),
            );
            if !left.is_empty() {
                bail!("{handler} pod {name} left:\n  {}", left.join("\n  "));
            }
            Ok::<LifecycleOutcome, anyhow::Error>(outcome)
        }
    };
    eprintln!(
        "bench: pods: backend {} ({}), warm-up (runc, microvm), then {pods} of each, interleaved",
        backend.label(),
        backend.why
    );
    run_one("runc", "warmup-runc".into()).await?;
    run_one("microvm", "warmup-microvm".into()).await?;
    let mut ours = Vec::new();
    let mut runc = Vec::new();
    for i in 0..pods {
        let order: [&'static str; 2] = if i % 2 == 0 {
            ["microvm", "runc"]
        } else {
            ["runc", "microvm"]
        };
        for handler in order {
            let outcome = run_one(handler, format!("bench-{handler}-{i}")).await?;
            eprintln!(
                "bench: {handler} pod {i}: total {:.2}s, idle memory {:.1} MiB{}",
                outcome.timings.total().as_secs_f64(),
                mib(outcome.idle_memory.as_ref().map(|m| m.total()).unwrap_or(0)),
                outcome
                    .exec_error
                    .as_ref()
                    .map(|e| format!(", exec failed: {e}"))
                    .unwrap_or_default()
            );
            if handler == "microvm" {
                ours.push(outcome);
            } else {
                runc.push(outcome);
            }
        }
    }
    drop(cri);
    drop(ctrd);

    // What fails the benchmark once everything is printed.
    let mut failures: Vec<String> = Vec::new();
    let accel = match &embedded_accel {
        Some(accel) => {
            if let Some(q) = ours.iter().find_map(|o| o.accel.as_deref()) {
                failures.push(format!(
                    "the shim config says the embedded VMM, but a pod ran QEMU (accel {q})"
                ));
            }
            accel.clone()
        }
        None => {
            let seen: Vec<&str> = ours.iter().filter_map(|o| o.accel.as_deref()).collect();
            if seen.len() != ours.len() {
                failures.push(format!(
                    "the QEMU process of {} of {} of our pods was not found (its accelerator is \
                     unknown)",
                    ours.len() - seen.len(),
                    ours.len()
                ));
            }
            let mut kinds = seen.clone();
            kinds.sort_unstable();
            kinds.dedup();
            if kinds.len() > 1 {
                failures.push(format!(
                    "our pods ran QEMU with different accelerators: {kinds:?}"
                ));
            }
            kinds
                .first()
                .map(|a| a.to_string())
                .unwrap_or_else(|| "unknown".into())
        }
    };
    let tag = format!("(backend={} accel={accel})", backend.label());
    let guest_kernel = ours
        .iter()
        .map(|o| o.kernel_release.as_str())
        .find(|k| !k.is_empty())
        .unwrap_or("none (ExecSync failed)");
    let host_kernel = runc
        .iter()
        .map(|o| o.kernel_release.as_str())
        .find(|k| !k.is_empty())
        .unwrap_or("none (ExecSync failed)");
    println!(
        "# pods through CRI on a private containerd: {pods} lifecycles per handler, interleaved, \
         medians; ours = the microvm handler: backend {} accel {accel} ({}), guest {} vCPU \
         {} MiB, free page reporting {}; idle memory read {idle_secs} s after StartContainer; \
         ExecSync uname -r: {guest_kernel} in our pods, {host_kernel} in runc's",
        backend.label(),
        backend.why,
        vm_size.vcpus,
        vm_size.memory_mib,
        if free_page_reporting { "on" } else { "off" }
    );
    if pods < MIN_PODS {
        println!("# only {pods} pods per handler (BENCH_PODS): too few for trustworthy medians (>= {MIN_PODS})");
    }
    let ours_exec_failures: Vec<&str> = ours
        .iter()
        .filter_map(|o| o.exec_error.as_deref())
        .collect();
    if let Some(e) = runc.iter().find_map(|o| o.exec_error.as_deref()) {
        bail!("ExecSync failed in a runc pod: {e}");
    }
    let exec_ok = ours_exec_failures.is_empty();
    if !exec_ok {
        failures.push(format!(
            "{} of {} ExecSync calls in our pods failed: {}",
            ours_exec_failures.len(),
            ours.len(),
            ours_exec_failures[0]
        ));
    }
    // With a failed exec in our pods, both totals leave exec out, so they compare like for like.
    let timings = |v: &[LifecycleOutcome], without_exec: bool| -> Vec<LifecycleTimings> {
        v.iter()
            .map(|o| {
                let mut t = o.timings;
                if without_exec {
                    t.exec = Duration::ZERO;
                }
                t
            })
            .collect()
    };
    let ours_med = LifecycleTimings::median(&timings(&ours, !exec_ok));
    let runc_med = LifecycleTimings::median(&timings(&runc, !exec_ok));
    let runc_exec = LifecycleTimings::median(&timings(&runc, false)).exec;
    for ((step, o), (_, r)) in ours_med.steps().into_iter().zip(runc_med.steps()) {
        let (o, r) = (o.as_secs_f64(), r.as_secs_f64());
        let name = format!("pod_lifecycle_{step}");
        if step == "exec" && !exec_ok {
            println!(
                "{name} ours=FAILED runc={:.3}s ratio=FAILED {tag} ({} of {} ExecSync calls in our pods failed: {})",
                runc_exec.as_secs_f64(),
                ours_exec_failures.len(),
                ours.len(),
                ours_exec_failures[0]
            );
            continue;
        }
        let ratio = o / r;
        let target = if step == "total" {
            format!(
                "target ratio<={LIFECYCLE_RATIO_TARGET}: {}{}",
                met(ratio <= LIFECYCLE_RATIO_TARGET),
                if exec_ok {
                    ""
                } else {
                    " (both totals leave exec out: ours failed)"
                }
            )
        } else {
            "target: on the total".to_string()
        };
        println!("{name} ours={o:.3}s runc={r:.3}s ratio={ratio:.2} {target} {tag}");
    }

    // The median pod by idle memory (the lower middle one for an even count, as for the
    // timings), so that its breakdowns add up to the printed median.
    let measured = |v: &[LifecycleOutcome]| -> Vec<PodMemory> {
        let mut all: Vec<PodMemory> = v.iter().filter_map(|o| o.idle_memory.clone()).collect();
        all.sort_by_key(|m| m.total());
        all
    };
    let (ours_all, runc_all) = (measured(&ours), measured(&runc));
    if ours_all.len() != ours.len() || runc_all.len() != runc.len() {
        bail!("the idle memory of some pods was not measured");
    }
    let median_pod = |all: &[PodMemory]| all[(all.len() - 1) / 2].clone();
    let range = |all: &[PodMemory], f: &dyn Fn(&PodMemory) -> u64| {
        let values = all.iter().map(f);
        let (lo, hi) = (values.clone().min().unwrap_or(0), values.max().unwrap_or(0));
        format!("{:.1}-{:.1}MiB", mib(lo), mib(hi))
    };
    let (ours_mem, runc_mem) = (median_pod(&ours_all), median_pod(&runc_all));
    let (o, r) = (mib(ours_mem.total()), mib(runc_mem.total()));
    let target = if backend.embedded() {
        IDLE_MEMORY_TARGET_EMBEDDED_MIB
    } else {
        IDLE_MEMORY_TARGET_QEMU_MIB
    };
    println!(
        "pod_idle_host_memory ours={o:.1}MiB runc={r:.1}MiB ratio={:.2} target ours<={target}MiB: {} {tag} (range over the pods: ours {}, runc {})",
        o / r,
        met(o <= target),
        range(&ours_all, &|m| m.total()),
        range(&runc_all, &|m| m.total())
    );
    // The pod's host cgroup (docs/overhead.md): what the kernel charges the whole pod, page
    // cache included, and what the RuntimeClass overhead must therefore hold.
    let cgroup = |m: &PodMemory| m.host_cgroup.clone();
    let usage = |m: &PodMemory| cgroup(m).map_or(0, |c| c.memory_usage);
    let peak = |m: &PodMemory| cgroup(m).and_then(|c| c.memory_peak).unwrap_or(0);
    let median_of = |f: &dyn Fn(&PodMemory) -> u64| {
        let mut v: Vec<u64> = ours_all.iter().map(f).collect();
        v.sort_unstable();
        v[(v.len() - 1) / 2]
    };
    let Some(cg) = cgroup(&ours_mem) else {
        bail!(
            "the idle microvm pod had no host cgroup (the shim makes one under its cgroup_parent)"
        );
    };
    let (cg_usage, cg_peak) = (median_of(&usage), median_of(&peak));
    println!(
        "pod_idle_host_cgroup_memory ours={:.1}MiB peak={:.1}MiB limit={} (the pod's host cgroup \
         ({}), page cache included; VM {} MiB) {tag} (range over the pods: usage {}, peak {})",
        mib(cg_usage),
        mib(cg_peak),
        cg.memory_limit
            .map_or("none".to_string(), |l| format!("{:.0}MiB", mib(l))),
        cg.version,
        vm_size.memory_mib,
        range(&ours_all, &usage),
        range(&ours_all, &peak)
    );
    // The overhead a pod cgroup needs beyond its containers' limits: the guest base (a guest
    // that fills its RAM holds the containers' sum plus this) and what the host side holds
    // beyond guest RAM. On the embedded VMM the guest RAM is split out of the cgroup's peak;
    // on QEMU it is not, so the whole idle peak counts as host side (an upper bound).
    // The cgroup charges memory where it was allocated: what the shim allocated before it moved
    // into the pod's cgroup stays charged elsewhere, so its own PSS (with its VMM process's own,
    // when the VMM runs in one) counts where it is larger.
    let (host_side, how) = match ours_mem.vm_split {
        Some(s) => (
            cg_peak
                .saturating_sub(s.guest_rss)
                .max(host_own(&ours_mem, &s)),
            "the larger of the cgroup peak minus the guest RAM resident and the shim's and VMM's own PSS",
        ),
        None => (
            cg_peak,
            "the whole cgroup peak: QEMU's guest RAM is not split out",
        ),
    };
    println!(
        "pod_overhead_needed ours={:.0}MiB = guest base {guest_base_mib}MiB + host side {:.1}MiB \
         ({how}) {tag}",
        guest_base_mib as f64 + mib(host_side),
        mib(host_side)
    );
    let by_process = |mem: &PodMemory| {
        mem.by_name()
            .iter()
            .map(|(n, b)| format!("{n} {:.1}MiB", mib(*b)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if backend.embedded() {
        // The VMM's process (or the shim, with the VMM in it) holds the guest RAM: split it.
        // Every pod was split (or its lifecycle failed), so the median pod has its split.
        let split = |m: &PodMemory| {
            m.vm_split
                .context("an embedded-VMM pod without the guest RAM split")
        };
        let s = split(&ours_mem)?;
        let guest = |m: &PodMemory| m.vm_split.map(|s| s.guest_pss).unwrap_or(0);
        let own = |m: &PodMemory| m.vm_split.map_or(0, |s| host_own(m, &s));
        println!(
            "pod_idle_guest_ram_touched ours={:.1}MiB (PSS; RSS {:.1}MiB of the {:.0}MiB guest \
             RAM mapping, found {}; of it mapped from the boot files: PSS {:.1}MiB, RSS \
             {:.1}MiB) {tag} (range over the pods: {})",
            mib(s.guest_pss),
            mib(s.guest_rss),
            mib(s.guest_size),
            s.matched,
            mib(s.file_pss),
            mib(s.file_rss),
            range(&ours_all, &guest)
        );
        let parts = if ours_mem.vmm_in_own_process {
            format!(
                "the shim {:.1}MiB + the VMM process beyond guest RAM {:.1}MiB: VMM, devices",
                mib(host_own(&ours_mem, &s).saturating_sub(s.own_pss())),
                mib(s.own_pss())
            )
        } else {
            "the shim process beyond guest RAM: shim, VMM, devices".to_string()
        };
        println!(
            "pod_idle_vmm_own_memory ours={:.1}MiB (PSS of the pod's processes beyond guest RAM: \
             {parts}) {tag} (range over the pods: {})",
            mib(host_own(&ours_mem, &s)),
            range(&ours_all, &own)
        );
        println!(
            "# ours idle pod (median) by process, PSS: {}; the {} {:.1}MiB = guest RAM {:.1}MiB + \
             its own {:.1}MiB",
            by_process(&ours_mem),
            if ours_mem.vmm_in_own_process {
                microvm_tests::lifecycle::VMM_PROCESS_NAME
            } else {
                "shim process"
            },
            mib(s.process_pss),
            mib(s.guest_pss),
            mib(s.own_pss())
        );
    } else {
        println!(
            "# ours idle pod (median) by process, PSS: {}",
            by_process(&ours_mem)
        );
    }
    println!(
        "# runc idle pod (median) by process, PSS: {}",
        by_process(&runc_mem)
    );
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(())
}

/// What an embedded-VMM pod's processes hold beyond its guest RAM: the shim, and the VMM
/// process's own part when the VMM runs in one (the pod's whole PSS less the guest RAM's).
fn host_own(mem: &PodMemory, split: &microvm_tests::lifecycle::GuestRamSplit) -> u64 {
    mem.total().saturating_sub(split.guest_pss)
}

/// Runs of the network part per handler (`BENCH_NET_RUNS`).
const NET_RUNS: usize = 10;
/// MiB per transfer and direction (`BENCH_NET_MIB`).
const NET_MIB: u64 = 32;
/// HTTP requests per run (`BENCH_NET_REQUESTS`).
const NET_REQUESTS: usize = 100;
/// Bound on a started pod's servers answering through its IP (with the first, unmeasured
/// transfers): the guest runs under TCG here, emulated twice in the lane.
const NET_REACH_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on each connect, read and write of a measurement.
const NET_IO_TIMEOUT: Duration = Duration::from_secs(60);

/// A metric of the network part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetMetric {
    /// One TCP transfer the pod sends and the host reads to its end.
    PodToHost,
    /// One TCP transfer the host sends, until the pod says it has read it all.
    HostToPod,
    /// Small HTTP requests from the host, one connection each.
    HttpLatency,
}

impl NetMetric {
    const ALL: [NetMetric; 3] = [
        NetMetric::PodToHost,
        NetMetric::HostToPod,
        NetMetric::HttpLatency,
    ];
}

/// What one handler's pod gave for one metric: the samples, or why it could not be measured.
type Measured = Result<Vec<Duration>, String>;

/// One handler's serving pod in the network part.
struct NetSide {
    handler: &'static str,
    /// Its name, also the page `GET /` answers.
    name: String,
    /// Once RunPodSandbox returned: the pod, removed at the end.
    pod: Option<Pod>,
    netns: Option<PathBuf>,
    /// Its servers, reached through the pod IP; or why not.
    servers: Result<PodServers, String>,
    pod_to_host: Measured,
    host_to_pod: Measured,
    latency: Measured,
}

impl NetSide {
    fn measured(&mut self, metric: NetMetric) -> &mut Measured {
        match metric {
            NetMetric::PodToHost => &mut self.pod_to_host,
            NetMetric::HostToPod => &mut self.host_to_pod,
            NetMetric::HttpLatency => &mut self.latency,
        }
    }

    /// The samples of `metric`, or why there are none (the pod's own failure first).
    fn result(&self, metric: NetMetric) -> Result<&[Duration], String> {
        let servers = self.servers.as_ref().map_err(Clone::clone)?;
        let measured = match metric {
            NetMetric::PodToHost => &self.pod_to_host,
            NetMetric::HostToPod => &self.host_to_pod,
            NetMetric::HttpLatency => &self.latency,
        };
        let samples = measured.as_ref().map_err(Clone::clone)?;
        if samples.is_empty() {
            return Err(format!("no samples from {}", servers.ip));
        }
        Ok(samples)
    }
}

/// An error as one line of at most 400 characters, for a report line.
fn one_line(e: impl std::fmt::Display) -> String {
    let text = format!("{e:#}")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    if text.chars().count() > 400 {
        let cut: String = text.chars().take(400).collect();
        format!("{cut}…")
    } else {
        text
    }
}

/// Starts `side`'s pod with one busybox container running [`server_script`], and waits until
/// its servers answer through the pod IP.
async fn start_serving_pod(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    side: &mut NetSide,
    download_bytes: u64,
) -> Result<PodServers, String> {
    let handler = side.handler;
    let config = ctrd
        .pod_config(&side.name, HashMap::new())
        .map_err(|e| format!("the pod config: {e}"))?;
    let pod = cri
        .run_pod_sandbox(config, handler)
        .await
        .map_err(|e| format!("RunPodSandbox: {}", one_line(e)))?;
    side.pod = Some(pod.clone());
    side.netns = cri
        .pod_netns_path(&pod.id)
        .await
        .map_err(|e| format!("the pod's netns: {}", one_line(e)))?;
    let spec = ServerSpec {
        page: side.name.clone(),
        www: "/www".into(),
        ports: POD_PORTS,
        download_bytes,
    };
    let script = server_script(&spec).map_err(|e| e.to_string())?;
    let id = cri
        .create_container(
            &pod,
            container_config("servers", ctrd.busybox_image(), &["sh", "-c", &script]),
        )
        .await
        .map_err(|e| format!("CreateContainer: {}", one_line(e)))?;
    cri.start_container(&id)
        .await
        .map_err(|e| format!("StartContainer: {}", one_line(e)))?;
    let ip = pod_ip(cri, &pod.id)
        .await
        .map_err(|e| format!("the pod IP: {}", one_line(e)))?;
    let servers = PodServers {
        ip,
        ports: POD_PORTS,
    };
    let page = side.name.clone();
    let reached = tokio::task::spawn_blocking(move || {
        wait_servers(&servers, &page, download_bytes, NET_REACH_TIMEOUT)
    })
    .await
    .map_err(|e| format!("the reachability check panicked: {e}"))?;
    match reached {
        Ok(after) => {
            eprintln!(
                "bench: net: the {handler} pod's servers answered at {ip} (ports {} http, {} \
                 upload, {} download) after {:.2}s",
                POD_PORTS.http,
                POD_PORTS.upload,
                POD_PORTS.download,
                after.as_secs_f64()
            );
            Ok(servers)
        }
        Err(e) => Err(format!(
            "its IP {ip} (from CRI) did not serve the host: {}",
            one_line(e)
        )),
    }
}

/// One run of `metric` on `side`; a failure ends that metric for the side, with the reason.
async fn measure_net(
    side: &mut NetSide,
    metric: NetMetric,
    run: usize,
    bytes: u64,
    requests: usize,
) {
    let Ok(servers) = side.servers.clone() else {
        return;
    };
    if side.measured(metric).is_err() {
        return;
    }
    let page = side.name.clone();
    let result = tokio::task::spawn_blocking(move || -> Result<Vec<Duration>, PodNetError> {
        match metric {
            NetMetric::PodToHost => Ok(vec![download(servers.download(), bytes, NET_IO_TIMEOUT)?]),
            NetMetric::HostToPod => Ok(vec![upload(servers.upload(), bytes, NET_IO_TIMEOUT)?]),
            NetMetric::HttpLatency => {
                let mut times = Vec::with_capacity(requests);
                for _ in 0..requests {
                    let (t, body) = http_get(servers.http(), "/", NET_IO_TIMEOUT)?;
                    if String::from_utf8_lossy(&body).trim() != page {
                        return Err(PodNetError::Protocol {
                            addr: servers.http(),
                            detail: format!(
                                "GET / answered {:?}, expected {page:?}",
                                String::from_utf8_lossy(&body[..body.len().min(80)])
                            ),
                        });
                    }
                    times.push(t);
                }
                Ok(times)
            }
        }
    })
    .await;
    let entry = side.measured(metric);
    match result {
        Ok(Ok(samples)) => {
            if let Ok(all) = entry {
                all.extend(samples);
            }
        }
        Ok(Err(e)) => *entry = Err(format!("run {run}: {}", one_line(e))),
        Err(e) => *entry = Err(format!("run {run}: the measuring thread panicked: {e}")),
    }
}

/// A `BENCH_NET_*` knob: a positive number, `default` when unset.
fn positive_knob<T: std::str::FromStr + Default + PartialEq>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<T>() {
            Ok(n) if n != T::default() => Ok(n),
            _ => bail!("{name}={v:?}: expected a positive whole number"),
        },
    }
}

/// The pod network, `microvm` and `runc` pods side by side on one private containerd (the
/// default CNI bridge): each pod runs one busybox container serving [`server_script`] (httpd, an
/// upload and a download `nc` server), and the bench on the host measures through each pod's
/// IP, interleaved run by run (alternating which handler goes first), `BENCH_NET_RUNS` runs:
/// - `net_tcp_pod_to_host`, `net_tcp_host_to_pod`: one TCP transfer of `BENCH_NET_MIB` MiB per
///   run and direction (MiB/s, the median run);
/// - `net_http_latency_median`, `net_http_latency_p99`: `BENCH_NET_REQUESTS` HTTP/1.0 `GET /`
///   per run, a connection each, over all runs' requests.
///
/// A metric that cannot be measured on one side (the pod does not start, its IP does not serve,
/// a transfer fails or comes short) prints `FAILED` there with the reason, and fails the
/// benchmark once everything is printed; the other side's number is still printed.
async fn net_bench() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the network benchmark starts containerd and VMs: run it as root");
    }
    let runs: usize = positive_knob("BENCH_NET_RUNS", NET_RUNS)?;
    let mib: u64 = positive_knob("BENCH_NET_MIB", NET_MIB)?;
    let requests: usize = positive_knob("BENCH_NET_REQUESTS", NET_REQUESTS)?;
    let bytes = mib
        .checked_mul(1 << 20)
        .context("BENCH_NET_MIB is too large")?;
    let PodSetup {
        backend,
        embedded_accel,
        vm_size,
        cri,
        ctrd,
        config_dir: _config_dir,
        ..
    } = PodSetup::start().await?;
    eprintln!(
        "bench: net: backend {} ({}), a serving pod of each handler, then {runs} runs each, \
         interleaved",
        backend.label(),
        backend.why
    );
    let new_side = |handler: &'static str| NetSide {
        handler,
        name: format!("bench-net-{handler}"),
        pod: None,
        netns: None,
        servers: Err("not started".into()),
        pod_to_host: Ok(Vec::new()),
        host_to_pod: Ok(Vec::new()),
        latency: Ok(Vec::new()),
    };
    let mut sides = [new_side("microvm"), new_side("runc")];
    for side in sides.iter_mut() {
        side.servers = start_serving_pod(&ctrd, &cri, side, bytes).await;
        if let Err(e) = &side.servers {
            eprintln!(
                "bench: net: the {} pod cannot be measured: {e}\n--- the last lines of \
                 containerd's log ---\n{}",
                side.handler,
                ctrd.log_tail()
            );
        }
    }
    for run in 0..runs {
        let order = if run % 2 == 0 { [0, 1] } else { [1, 0] };
        for metric in NetMetric::ALL {
            for k in order {
                measure_net(&mut sides[k], metric, run, bytes, requests).await;
            }
        }
        eprintln!("bench: net: run {} of {runs} done", run + 1);
    }

    let mut failures: Vec<String> = Vec::new();
    // The accelerator of our pods' VMs, while the pod still runs.
    let accel = match (&embedded_accel, &sides[0].pod) {
        (Some(accel), _) => accel.clone(),
        (None, Some(pod)) => match vm_accel(&pod_processes(&ctrd, &pod.id)) {
            Some(accel) => accel,
            None => {
                failures.push("the QEMU process of our pod was not found".into());
                "unknown".into()
            }
        },
        (None, None) => "unknown (our pod did not start)".into(),
    };
    // Remove both pods, then check what each left (the check sees the whole instance).
    let mut removed = Vec::new();
    for side in &mut sides {
        let Some(pod) = side.pod.take() else {
            continue;
        };
        let result = async {
            cri.stop_pod_sandbox(&pod.id).await?;
            cri.remove_pod_sandbox(&pod.id).await
        }
        .await;
        match result {
            Ok(()) => removed.push((side.handler, pod.id, side.netns.clone())),
            Err(e) => failures.push(format!(
                "removing the {} pod: {}",
                side.handler,
                one_line(e)
            )),
        }
    }
    for (handler, id, netns) in removed {
        let left = wait_pod_gone(&ctrd, &id, netns.as_deref(), Duration::from_secs(30));
        if !left.is_empty() {
            failures.push(format!("the {handler} pod left: {}", left.join("; ")));
        }
    }
    drop(cri);
    drop(ctrd);

    let tag = format!("(backend={} accel={accel})", backend.label());
    println!(
        "# the pod network through CRI on a private containerd (the default CNI bridge), from the \
         host through each pod's IP: {runs} runs per handler, interleaved; throughput: one TCP \
         transfer of {mib} MiB per run and direction (busybox nc in the pod, MiB/s of the median \
         run); latency: {requests} HTTP/1.0 GET / per run, a connection each (busybox httpd), \
         over all {} requests; ours = the microvm handler: backend {} accel {accel} ({}), guest {} \
         vCPU {} MiB",
        runs * requests,
        backend.label(),
        backend.why,
        vm_size.vcpus,
        vm_size.memory_mib
    );
    if runs < MIN_PODS {
        println!(
            "# only {runs} runs per handler (BENCH_NET_RUNS): too few for trustworthy medians \
             (>= {MIN_PODS})"
        );
    }
    let [ours, runc] = &sides;
    let mibs = |v: &[Duration]| -> Vec<f64> { v.iter().map(|d| mib_per_s(bytes, *d)).collect() };
    let range = |v: &[f64], unit: &str| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.1}-{hi:.1}{unit}")
    };
    let mut report =
        |name: &str, metric: NetMetric, value: &dyn Fn(&[Duration]) -> (f64, String)| {
            let (o, r) = (ours.result(metric), runc.result(metric));
            let show = |side: &Result<&[Duration], String>| match side {
                Ok(v) => value(v).1,
                Err(_) => "FAILED".to_string(),
            };
            let ratio = match (&o, &r) {
                (Ok(o), Ok(r)) => format!("{:.2}", value(o).0 / value(r).0),
                _ => "FAILED".to_string(),
            };
            let mut why = Vec::new();
            for (who, side) in [("ours", &o), ("runc", &r)] {
                if let Err(e) = side {
                    why.push(format!("{who} not measured: {e}"));
                    failures.push(format!("{name}: {who} not measured"));
                }
            }
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            };
            println!(
                "{name} ours={} runc={} ratio={ratio} {tag}{why}",
                show(&o),
                show(&r)
            );
        };
    for (name, metric) in [
        ("net_tcp_pod_to_host", NetMetric::PodToHost),
        ("net_tcp_host_to_pod", NetMetric::HostToPod),
    ] {
        report(name, metric, &|v| {
            let per_run = mibs(v);
            let m = median(per_run.clone());
            (
                m,
                format!("{m:.1}MiB/s (runs {})", range(&per_run, "MiB/s")),
            )
        });
    }
    for (name, p) in [
        ("net_http_latency_median", 50.0),
        ("net_http_latency_p99", 99.0),
    ] {
        report(name, NetMetric::HttpLatency, &|v| {
            let ms = percentile(v, p).map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
            (ms, format!("{ms:.2}ms"))
        });
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(hypervisor: &'static str) -> VmBackend {
        VmBackend {
            hypervisor,
            reason: "linux guests boot under the embedded vmm".into(),
            report: "kvm: hardware (...)\nverdict: ...".into(),
        }
    }

    #[test]
    fn the_rss_at_exit_splits_into_anonymous_and_mapped() {
        // A smaps_rollup as Linux 6.18 prints it (abridged): `Rss` sums anonymous, file and
        // shared memory pages; `Pss_Anon` and friends must not be taken for `Anonymous`.
        let rollup = "555555554000-7ffffffff000 ---p 00000000 00:00 0  [rollup]\n\
                      Rss:                4668 kB\n\
                      Pss:                2827 kB\n\
                      Pss_Anon:            376 kB\n\
                      Pss_File:           2451 kB\n\
                      Anonymous:           376 kB\n\
                      AnonHugePages:         0 kB\n";
        let split = parse_rss_split(rollup).unwrap();
        assert_eq!((split.anon_kib, split.mapped_kib), (376, 4292));
        assert!(parse_rss_split("Rss: 10 kB\n").is_none());
        assert!(parse_rss_split("Rss: 10 kB\nAnonymous: 11 kB\n").is_none());
    }

    #[test]
    fn the_backend_follows_check_host_unless_forced() {
        assert_eq!(pick_backend(&check("kvm"), None).unwrap().hypervisor, "kvm");
        assert_eq!(
            pick_backend(&check("qemu"), Some("")).unwrap().label(),
            "qemu"
        );
        assert_eq!(
            pick_backend(&check("kvm"), Some("qemu"))
                .unwrap()
                .hypervisor,
            "qemu"
        );
        let forced = pick_backend(&check("kvm"), Some("kvm")).unwrap();
        assert_eq!((forced.hypervisor, forced.label()), ("kvm", "embedded"));
        let e = pick_backend(&check("qemu"), Some("kvm"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot boot") && e.contains("kvm: hardware"),
            "{e}"
        );
        assert!(pick_backend(&check("kvm"), Some("firecracker")).is_err());
    }

    #[test]
    fn bench_only_selects_parts_in_their_order() {
        assert_eq!(selected_parts("").unwrap(), Part::ALL.to_vec());
        assert_eq!(selected_parts("net").unwrap(), vec![Part::Net]);
        assert_eq!(
            selected_parts("net, pods").unwrap(),
            vec![Part::Pods, Part::Net]
        );
        assert_eq!(selected_parts("boot,boot").unwrap(), vec![Part::Boot]);
        let e = selected_parts("pods,network").unwrap_err();
        assert!(
            e.contains("\"network\"") && e.contains("boot, pods, net"),
            "{e}"
        );
        assert!(selected_parts("pods,").is_err());
        assert_eq!(
            selected_parts("density,pods").unwrap(),
            vec![Part::Pods, Part::Density]
        );
    }

    #[test]
    fn net_knobs_are_positive_numbers() {
        std::env::remove_var("BENCH_NET_TEST_UNSET");
        assert_eq!(positive_knob("BENCH_NET_TEST_UNSET", 7usize).unwrap(), 7);
        std::env::set_var("BENCH_NET_TEST_SET", " 12 ");
        assert_eq!(positive_knob("BENCH_NET_TEST_SET", 7usize).unwrap(), 12);
        std::env::set_var("BENCH_NET_TEST_ZERO", "0");
        assert!(positive_knob("BENCH_NET_TEST_ZERO", 7u64).is_err());
        std::env::set_var("BENCH_NET_TEST_WORD", "many");
        assert!(positive_knob("BENCH_NET_TEST_WORD", 7u64).is_err());
    }

    #[test]
    fn an_error_becomes_one_bounded_line() {
        assert_eq!(one_line("a\n\n  b \nc"), "a | b | c");
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), 401);
    }

    #[test]
    fn the_embedded_accelerator_follows_the_kvm_kind() {
        assert_eq!(embedded_accel("hardware"), "kvm");
        assert_eq!(embedded_accel("svm-emulated-by-qemu-tcg"), "nested-svm-tcg");
        assert_eq!(embedded_accel("nested"), "nested-kvm");
        assert_eq!(embedded_accel("pvm"), "kvm-pvm");
        assert_eq!(embedded_accel("unknown"), "unknown");
    }
}
