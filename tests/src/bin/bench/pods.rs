//! The pod part (`BENCH_ONLY=pods`): pod lifecycles through CRI and each idle pod's host memory,
//! `microvm` against `runc` (see `pod_bench`).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use microvm_tests::lifecycle::{
    timed_pod_lifecycle_with, wait_pod_gone, LifecycleOptions, LifecycleOutcome, LifecycleTimings,
    PodMemory,
};

use crate::report::{met, mib, MIN_PODS};
use crate::setup::{with_log, PodSetup};

/// Idle memory targets of the issue, per pod: with the embedded VMM (the shim holds the VM), and
/// with the QEMU backend.
const IDLE_MEMORY_TARGET_EMBEDDED_MIB: f64 = 32.0;
const IDLE_MEMORY_TARGET_QEMU_MIB: f64 = 64.0;
/// Lifecycle target of the issue: ours / runc.
const LIFECYCLE_RATIO_TARGET: f64 = 1.5;

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
/// [`crate::setup::pick_backend`]). Every pod must leave nothing behind before the next starts.
/// A failing ExecSync of the `microvm` handler is reported on its line (the totals then leave
/// exec out) and fails the benchmark once everything is printed; so does any number that is
/// missing.
pub(crate) async fn pod_bench() -> Result<()> {
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
