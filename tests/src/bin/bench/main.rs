//! `make bench`: our embedded VMM against QEMU's `microvm` machine, side by side in one run.
//!
//! Both boot the same test guest ELF (`hello`, which prints on COM1 and resets through the
//! i8042) on this host's `/dev/kvm`, interleaved run by run so that machine noise hits both
//! alike. QEMU runs with the first CPU model of [`boot::QEMU_CPU_MODELS`] (or
//! `$BENCH_QEMU_CPU`) that boots the guest here, and the report names it. Measured per run, from
//! spawning the VMM process:
//! - `start_to_first_serial_byte`: until the first byte of the guest's console reaches us;
//! - `start_to_exit`: until the VMM process has exited after the guest's reset;
//! - `vmm_peak_rss`: the process's peak RSS (`VmHWM` at its exit, see [`measure::measure`]);
//!   the guest touches a few pages only, so it is close to what the VMM itself costs on the host
//!   beyond guest memory. A `#` line splits the RSS at the exit into anonymous memory (heap,
//!   stacks, the pages the guest touched: what each VMM process adds) and pages mapped from files
//!   (the binary's code and data, the shared libraries: page cache that every process running
//!   the same binary shares).
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
//!
//! This file picks the parts (`BENCH_ONLY`) and runs them; each part is a module beside it:
//! `boot` (with `measure`, how one VMM process is timed and its memory read), `pods`, `net` and
//! `density`. The pod parts share `setup` (backend, shim config, private containerd) and
//! `knobs`; every part's lines share `report`'s helpers; `paths` finds the repository and the
//! built binaries.

mod boot;
mod density;
mod knobs;
mod measure;
mod net;
mod paths;
mod pods;
mod report;
mod setup;

use std::process::ExitCode;

use anyhow::Context;

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
            Part::Boot => boot::vmm_boot_bench(),
            Part::Pods => runtime().and_then(|r| r.block_on(pods::pod_bench())),
            Part::Net => runtime().and_then(|r| r.block_on(net::net_bench())),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
