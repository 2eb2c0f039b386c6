//! The density part of `make bench` (`BENCH_ONLY=density`): many idle pods at once.
//!
//! `BENCH_DENSITY` (default 10) idle pods per handler, started together through CRI (all
//! requested at once, RunPodSandbox + CreateContainer + StartContainer of a busybox `sleep` and
//! ExecSync `uname -r` in each, at most `BENCH_DENSITY_PARALLEL` (default: the CPU count) in
//! flight), first the `microvm` handler's, then runc's, on the private containerd of the pod
//! part. With all of a handler's pods running and idle (`BENCH_DENSITY_SETTLE` seconds,
//! default 5, after the last exec), each pod's host memory is read: the PSS
//! (`/proc/<pid>/smaps_rollup`) of the pod's shim and all its descendants. That is the pod's
//! whole host side for both handlers (`microvm`: the shim holding the embedded VMM and its guest
//! RAM, or QEMU, virtiofsd and vhost-device-vsock under it; runc: its shim, pause and the
//! container), and it is per pod even with many pods running, where the pod cgroups would miss
//! runc's shim (it stays outside them) and miss what our shim allocated before it moved into its
//! cgroup. PSS splits shared pages (the shim binary, the boot files mapped into guest RAM) among
//! the pods that map them, so the sum over the pods is what they cost together.
//!
//! Lines: `pod_density_pss_median_mib` and `pod_density_pss_total_mib`, `ours=… runc=… ratio=…`
//! with the backend and accelerator, and MemAvailable before and with the pods, for comparison.
//! Every pod is removed at the end and must leave nothing.
//!
//! The long run (documented, not in `make bench`): `BENCH_DENSITY_MAX=500` (`make
//! bench-density`) starts `microvm` pods one after another, each checked with ExecSync, until
//! that many run, the host's MemAvailable falls below a reserve (`BENCH_DENSITY_RESERVE_MIB`,
//! default the larger of 1 GiB and a tenth of MemTotal), or a pod fails; then checks ExecSync in
//! every pod again, measures them as above, prints where it stopped and why, and removes them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use k8s_cri::v1::PodSandboxConfig;
use microvm_tests::cri::{container_config, CriClient};
use microvm_tests::lifecycle::{
    guest_ram_holder, guest_ram_split_of, pod_processes, pss_bytes, vm_accel, wait_pod_gone,
    GuestRamSplit,
};

use crate::knobs::positive_knob;
use crate::report::{met, mib};
use crate::setup::{with_log, PodSetup};

/// Idle pods per handler (`BENCH_DENSITY`).
const DENSITY_PODS: usize = 10;
/// Seconds the pods idle before they are measured (`BENCH_DENSITY_SETTLE`).
const DENSITY_SETTLE_S: u64 = 5;
/// Issue 12's target: an idle pod on the embedded VMM at most this (PSS) with 10 running.
const DENSITY_TARGET_EMBEDDED_MIB: f64 = 20.0;
/// Pods starting at once (`BENCH_DENSITY_PARALLEL`): the host's CPUs. The shim waits 60 s for
/// a guest's agent; ten guests booting at once on the nested lane's one emulated vCPU take
/// longer than that, so pods are asked for all at once but boot this many at a time.
fn default_parallel() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pods started or stopped at once in the long run's checks and teardown.
const LONG_RUN_PARALLEL: usize = 8;

/// One running pod of the density part.
struct DensityPod {
    pod_id: String,
    container_id: String,
    netns: Option<PathBuf>,
}

/// What starting a pod gave: its id as soon as RunPodSandbox answered (so a failed pod is still
/// removed), and the pod or why it failed.
type StartResult = (Option<String>, Result<DensityPod, String>);

/// RunPodSandbox, CreateContainer + StartContainer of a busybox `sleep`, ExecSync `uname -r`.
async fn start_pod(
    cri: CriClient,
    config: PodSandboxConfig,
    image: String,
    handler: &'static str,
) -> StartResult {
    let pod = match cri.run_pod_sandbox(config, handler).await {
        Ok(pod) => pod,
        Err(e) => return (None, Err(format!("RunPodSandbox: {e}"))),
    };
    let id = Some(pod.id.clone());
    let result = async {
        let netns = cri
            .pod_netns_path(&pod.id)
            .await
            .map_err(|e| format!("PodSandboxStatus: {e}"))?;
        let container_id = cri
            .create_container(
                &pod,
                container_config("sleeper", &image, &["sleep", "3600"]),
            )
            .await
            .map_err(|e| format!("CreateContainer: {e}"))?;
        cri.start_container(&container_id)
            .await
            .map_err(|e| format!("StartContainer: {e}"))?;
        exec_check(&cri, &container_id).await?;
        Ok::<DensityPod, String>(DensityPod {
            pod_id: pod.id.clone(),
            container_id,
            netns,
        })
    }
    .await;
    (id, result)
}

/// ExecSync `uname -r` must answer with exit 0.
async fn exec_check(cri: &CriClient, container_id: &str) -> Result<(), String> {
    match cri.exec_sync(container_id, &["uname", "-r"], 60).await {
        Ok(out) if out.exit_code == 0 => Ok(()),
        Ok(out) => Err(format!(
            "ExecSync uname -r: exit {}: {}",
            out.exit_code,
            out.stderr.trim()
        )),
        Err(e) => Err(format!("ExecSync uname -r: {e}")),
    }
}

/// The host's MemAvailable and MemTotal in bytes.
fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("MemAvailable:"), field("MemTotal:"))
}

/// A pod's host memory: the PSS of its shim and all the shim's descendants, and, on the
/// embedded VMM, the guest RAM split of the process holding the VM (its VMM process, or the
/// shim with the VMM in it).
struct PodPss {
    pss: u64,
    split: Option<GuestRamSplit>,
    /// The VMM ran in a process of its own: `split`'s own part is the VMM's, the shim apart.
    vmm_in_own_process: bool,
    /// The accelerator of the pod's QEMU (QEMU backend).
    accel: Option<String>,
}

fn measure_pod(
    ctrd: &microvm_tests::containerd::PrivateContainerd,
    pod_id: &str,
    guest_bytes: Option<u64>,
) -> Result<PodPss> {
    let processes = pod_processes(ctrd, pod_id);
    let Some(holder) = guest_ram_holder(&processes) else {
        bail!("pod {pod_id} has no shim process");
    };
    let pss = processes.iter().map(|p| pss_bytes(p.pid)).sum();
    let split = match guest_bytes {
        Some(bytes) => Some(guest_ram_split_of(holder.pid, bytes)?),
        None => None,
    };
    Ok(PodPss {
        pss,
        split,
        vmm_in_own_process: holder.is_vmm_process(),
        accel: vm_accel(&processes),
    })
}

/// Stops and removes `ids` (at most [`LONG_RUN_PARALLEL`] at once), then waits until each has
/// left nothing; returns what is left or failed.
/// The pods `ids` (every pod started, running or not) with the netns of those that ran, for
/// [`remove_pods`].
fn removal_list(pods: &[DensityPod], ids: Vec<String>) -> Vec<(String, Option<PathBuf>)> {
    let netns: HashMap<&str, &Option<PathBuf>> =
        pods.iter().map(|p| (p.pod_id.as_str(), &p.netns)).collect();
    ids.into_iter()
        .map(|id| {
            let ns = netns.get(id.as_str()).and_then(|ns| (*ns).clone());
            (id, ns)
        })
        .collect()
}

async fn remove_pods(setup: &PodSetup, pods: Vec<(String, Option<PathBuf>)>) -> Vec<String> {
    let mut problems = Vec::new();
    for chunk in pods.chunks(LONG_RUN_PARALLEL) {
        let mut set = tokio::task::JoinSet::new();
        for (id, _) in chunk {
            let cri = setup.cri.clone();
            let id = id.clone();
            set.spawn(async move {
                let r = cri
                    .stop_and_remove_pod_retrying(&id, Duration::from_secs(60))
                    .await;
                (id, r)
            });
        }
        while let Some(done) = set.join_next().await {
            match done {
                Ok((_, Ok(_))) => {}
                Ok((id, Err(e))) => problems.push(format!("removing pod {id}: {e}")),
                Err(e) => problems.push(format!("a removal task failed: {e}")),
            }
        }
    }
    for (id, netns) in &pods {
        let left = wait_pod_gone(&setup.ctrd, id, netns.as_deref(), Duration::from_secs(60));
        if !left.is_empty() {
            problems.push(format!("pod {id} left: {}", left.join("; ")));
        }
    }
    problems
}

/// Starts `n` pods of `handler` at once; every pod that RunPodSandbox created is returned for
/// removal, with the first failure if any.
async fn start_together(
    setup: &PodSetup,
    handler: &'static str,
    n: usize,
) -> Result<(Vec<DensityPod>, Vec<String>, Option<String>)> {
    let parallel = positive_knob("BENCH_DENSITY_PARALLEL", default_parallel())?;
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let config = setup
            .ctrd
            .pod_config(&format!("density-{handler}-{i}"), HashMap::new())?;
        let start = start_pod(
            setup.cri.clone(),
            config,
            setup.ctrd.busybox_image().to_string(),
            handler,
        );
        let permits = permits.clone();
        set.spawn(async move {
            let _permit = permits.acquire_owned().await;
            start.await
        });
    }
    let (mut pods, mut ids, mut failure) = (Vec::new(), Vec::new(), None);
    while let Some(done) = set.join_next().await {
        match done {
            Ok((id, Ok(pod))) => {
                ids.extend(id);
                pods.push(pod);
            }
            Ok((id, Err(e))) => {
                ids.extend(id);
                failure.get_or_insert(e);
            }
            Err(e) => {
                failure.get_or_insert(format!("a start task failed: {e}"));
            }
        }
    }
    Ok((pods, ids, failure))
}

/// What one handler's group of pods measured.
struct Group {
    /// Per pod, sorted by PSS.
    pods: Vec<PodPss>,
    started_in: Duration,
    mem_available_before: u64,
    mem_available_with: u64,
}

impl Group {
    fn median(&self) -> &PodPss {
        &self.pods[(self.pods.len() - 1) / 2]
    }

    fn total(&self) -> u64 {
        self.pods.iter().map(|p| p.pss).sum()
    }
}

async fn run_group(setup: &PodSetup, handler: &'static str, n: usize) -> Result<Group> {
    let settle = Duration::from_secs(positive_knob("BENCH_DENSITY_SETTLE", DENSITY_SETTLE_S)?);
    let guest_bytes = (handler == "microvm" && setup.backend.embedded())
        .then_some(setup.vm_size.memory_mib << 20);
    let mem_available_before = meminfo().0;
    eprintln!("bench: density: starting {n} {handler} pods together");
    let t = Instant::now();
    let (pods, ids, failure) = start_together(setup, handler, n).await?;
    let started_in = t.elapsed();
    let measured = match failure {
        Some(e) => Err(with_log(
            &setup.ctrd,
            &format!(
                "{handler} pods started together: {} of {n} running",
                pods.len()
            ),
            e,
        )),
        None => {
            tokio::time::sleep(settle).await;
            let mem_available_with = meminfo().0;
            let mut all = Vec::with_capacity(pods.len());
            let mut error = None;
            for p in &pods {
                match measure_pod(&setup.ctrd, &p.pod_id, guest_bytes) {
                    Ok(m) => all.push(m),
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
            match error {
                Some(e) => Err(e),
                None => {
                    all.sort_by_key(|m| m.pss);
                    Ok(Group {
                        pods: all,
                        started_in,
                        mem_available_before,
                        mem_available_with,
                    })
                }
            }
        }
    };
    let to_remove = removal_list(&pods, ids);
    let problems = remove_pods(setup, to_remove).await;
    let group = measured?;
    if !problems.is_empty() {
        bail!("{handler} pods: {}", problems.join("; "));
    }
    Ok(group)
}

/// `(backend=… accel=…)` of the report lines: the embedded VMM's accelerator from check-host, or
/// QEMU's from the measured pods' command lines.
fn tag(setup: &PodSetup, pods: &[PodPss]) -> String {
    let accel = setup
        .embedded_accel
        .clone()
        .or_else(|| pods.iter().find_map(|p| p.accel.clone()))
        .unwrap_or_else(|| "unknown".into());
    format!("(backend={} accel={accel})", setup.backend.label())
}

/// The density part: see the module doc.
pub(super) async fn density_bench() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the density benchmark starts containerd and VMs: run it as root");
    }
    let mut setup = PodSetup::start().await?;
    // Many VMs booting at once on a small machine: RunPodSandbox may take minutes.
    setup.cri.timeout = Duration::from_secs(900);
    if let Ok(max) = std::env::var("BENCH_DENSITY_MAX") {
        let max: usize = max.trim().parse().ok().filter(|m| *m > 0).ok_or_else(|| {
            anyhow::anyhow!("BENCH_DENSITY_MAX={max:?}: expected a positive number")
        })?;
        return long_run(&setup, max).await;
    }
    let n = positive_knob("BENCH_DENSITY", DENSITY_PODS)?;
    let ours = run_group(&setup, "microvm", n).await?;
    let runc = run_group(&setup, "runc", n).await?;
    let tag = tag(&setup, &ours.pods);
    let (o, r) = (mib(ours.median().pss), mib(runc.median().pss));
    let target = if setup.backend.embedded() {
        format!(
            " target ours<={DENSITY_TARGET_EMBEDDED_MIB}MiB: {}",
            met(o <= DENSITY_TARGET_EMBEDDED_MIB)
        )
    } else {
        String::new()
    };
    println!(
        "# density: {n} idle pods per handler started together through CRI, {} booting at a \
         time (ours in {:.1}s, runc in {:.1}s), measured {}s after the last answered ExecSync with all {n} running; \
         PSS per pod = its shim and all the shim's descendants (smaps_rollup); guest {} vCPU \
         {} MiB; boot files {:?}, page sharing {:?} (embedded VMM)",
        positive_knob("BENCH_DENSITY_PARALLEL", default_parallel())?,
        ours.started_in.as_secs_f64(),
        runc.started_in.as_secs_f64(),
        positive_knob("BENCH_DENSITY_SETTLE", DENSITY_SETTLE_S)?,
        setup.vm_size.vcpus,
        setup.vm_size.memory_mib,
        setup.boot_files,
        setup.page_sharing
    );
    println!(
        "pod_density_pss_median_mib ours={o:.1} runc={r:.1} ratio={:.2}{target} {tag} (range: \
         ours {:.1}-{:.1}, runc {:.1}-{:.1})",
        o / r,
        mib(ours.pods[0].pss),
        mib(ours.pods[ours.pods.len() - 1].pss),
        mib(runc.pods[0].pss),
        mib(runc.pods[runc.pods.len() - 1].pss),
    );
    let (ot, rt) = (mib(ours.total()), mib(runc.total()));
    println!(
        "pod_density_pss_total_mib ours={ot:.1} runc={rt:.1} ratio={:.2} ({n} pods each) {tag}",
        ot / rt
    );
    let fell = |g: &Group| mib(g.mem_available_before.saturating_sub(g.mem_available_with));
    println!(
        "# host MemAvailable fell by {:.0} MiB with our {n} pods, {:.0} MiB with runc's (the \
         whole machine: other work moves it too)",
        fell(&ours),
        fell(&runc)
    );
    let median = ours.median();
    if let Some(s) = median.split {
        let own = if median.vmm_in_own_process {
            format!(
                "the shim {:.1} MiB, the VMM process's own {:.1} MiB",
                mib(median.pss.saturating_sub(s.process_pss)),
                mib(s.own_pss())
            )
        } else {
            format!("the shim's own (VMM in it) {:.1} MiB", mib(s.own_pss()))
        };
        println!(
            "# ours median pod: guest RAM {:.1} MiB PSS (RSS {:.1}), of it mapped from the boot \
             files {:.1} MiB PSS (RSS {:.1}, shared by the pods until written); {own}",
            mib(s.guest_pss),
            mib(s.guest_rss),
            mib(s.file_pss),
            mib(s.file_rss),
        );
    }
    print_page_sharing_lines(&setup);
    Ok(())
}

/// The shims' page sharing reports (docs/page-sharing.md) from the containerd log, one `#` line
/// per pass, so that a pod that shared less shows why.
fn print_page_sharing_lines(setup: &PodSetup) {
    let log = std::fs::read_to_string(setup.ctrd.dir().join("containerd.log")).unwrap_or_default();
    for line in log.lines().filter(|l| l.contains("page sharing")) {
        let msg = line
            .find("page sharing")
            .map_or(line, |at| &line[at..])
            .trim_end_matches('"');
        println!("# {}", msg.chars().take(400).collect::<String>());
    }
}

/// The long run: see the module doc.
async fn long_run(setup: &PodSetup, max: usize) -> Result<()> {
    let (_, total) = meminfo();
    let reserve = match std::env::var("BENCH_DENSITY_RESERVE_MIB") {
        Ok(v) => {
            v.trim()
                .parse::<u64>()
                .map_err(|_| anyhow::anyhow!("BENCH_DENSITY_RESERVE_MIB={v:?}: expected MiB"))?
                << 20
        }
        Err(_) => (1u64 << 30).max(total / 10),
    };
    let guest_bytes = setup
        .backend
        .embedded()
        .then_some(setup.vm_size.memory_mib << 20);
    let mut pods: Vec<DensityPod> = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    let t = Instant::now();
    let stopped = loop {
        if pods.len() >= max {
            break format!("reached BENCH_DENSITY_MAX={max}");
        }
        let (available, _) = meminfo();
        if available < reserve {
            break format!(
                "MemAvailable {:.0} MiB fell below the reserve of {:.0} MiB",
                mib(available),
                mib(reserve)
            );
        }
        let i = pods.len();
        let config = setup
            .ctrd
            .pod_config(&format!("density-max-{i}"), HashMap::new())?;
        let (id, r) = start_pod(
            setup.cri.clone(),
            config,
            setup.ctrd.busybox_image().to_string(),
            "microvm",
        )
        .await;
        ids.extend(id);
        match r {
            Ok(p) => pods.push(p),
            Err(e) => break format!("pod {} failed: {e}", i + 1),
        }
        if (i + 1).is_multiple_of(10) {
            eprintln!(
                "bench: density: {} pods running after {:.0}s, MemAvailable {:.0} MiB",
                i + 1,
                t.elapsed().as_secs_f64(),
                mib(meminfo().0)
            );
        }
    };
    let started_in = t.elapsed();
    // Every pod answers once more with all of them running.
    let mut unanswered = Vec::new();
    for chunk in pods.chunks(LONG_RUN_PARALLEL) {
        let mut set = tokio::task::JoinSet::new();
        for p in chunk {
            let cri = setup.cri.clone();
            let (pod, container) = (p.pod_id.clone(), p.container_id.clone());
            set.spawn(async move { (pod, exec_check(&cri, &container).await) });
        }
        while let Some(done) = set.join_next().await {
            match done {
                Ok((_, Ok(()))) => {}
                Ok((pod, Err(e))) => unanswered.push(format!("{pod}: {e}")),
                Err(e) => unanswered.push(format!("a check task failed: {e}")),
            }
        }
    }
    let mut measured: Vec<PodPss> = Vec::new();
    let mut measure_error = None;
    for p in &pods {
        match measure_pod(&setup.ctrd, &p.pod_id, guest_bytes) {
            Ok(m) => measured.push(m),
            Err(e) => {
                measure_error.get_or_insert(e);
            }
        }
    }
    let mut pss: Vec<u64> = measured.iter().map(|m| m.pss).collect();
    pss.sort_unstable();
    let (available, _) = meminfo();
    let tag = tag(setup, &measured);
    let median = pss
        .get(pss.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0);
    println!(
        "pod_density_max ours={} pods running, {} of them answering ExecSync at the end; stopped: \
         {stopped}; started one after another in {:.0}s; PSS per pod median {:.1} MiB, total \
         {:.1} MiB; MemAvailable {:.0} of {:.0} MiB {tag}",
        pods.len(),
        pods.len().saturating_sub(unanswered.len()),
        started_in.as_secs_f64(),
        mib(median),
        mib(pss.iter().sum()),
        mib(available),
        mib(total)
    );
    let to_remove = removal_list(&pods, ids);
    let problems = remove_pods(setup, to_remove).await;
    if let Some(e) = measure_error {
        return Err(e);
    }
    if !unanswered.is_empty() {
        bail!(
            "{} pods did not answer ExecSync at the end: {}",
            unanswered.len(),
            unanswered.join("; ")
        );
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}
