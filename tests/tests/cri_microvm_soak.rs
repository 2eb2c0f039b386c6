//! Soak: a pod that lives through many containers, and pods that come and go, measured as they
//! go (docs/benchmarks.md, "Soak"). `make test` runs the short version (a few dozen cycles,
//! enough to catch a leak of one fd or one mount per cycle); `make soak` the long one
//! (MICROVM_SOAK_CONTAINER_CYCLES=1000, MICROVM_SOAK_POD_CYCLES=300) and writes the samples as
//! CSV to MICROVM_SOAK_OUT for the curves. The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by
//! default; the embedded VMM in the nested lane).
//!
//! Container cycles, in one pod with a long-lived `watch` container: create (a hostPath
//! volume, read-only every third cycle; a tty every other cycle; stdin open), start, exec
//! (reads the volume), exec (lets the container end), wait for its exit (code 0), remove. After each
//! cycle one sample: the pod's host cgroup usage, the shim's and the VM's processes' RSS and
//! open fds, the guest's MemAvailable, the cycle's time. Bounds, after a warm-up (the first
//! fifth of the cycles, at least 3), last sample against the warm-up's end:
//!
//! - open fds of the shim and of the VM's processes: at most [`FD_SLACK`] more (a leak of one
//!   per cycle shows within a few cycles);
//! - the shim's RSS: at most [`SHIM_RSS_SLACK_MIB`] more (the shim's own heap: it holds nothing
//!   per ended container);
//! - the guest's MemAvailable: at most [`GUEST_AVAILABLE_SLACK_MIB`] less (what the agent and the
//!   guest kernel keep per ended container: state, mounts, cgroups);
//! - the host cgroup: never at its limit (no OOM), at most [`CGROUP_SLACK_MIB`] more (the VM's
//!   RSS grows as the guest first touches its RAM, up to the VM's size, so this bound is wider).
//!
//! Any failed step fails the run, and nothing may be left after the pod is removed.
//!
//! Pod cycles: run a pod, start a container, exec in it, stop and remove the pod, and check
//! that nothing of it is left (processes, state directory, mounts, socket, netns, cgroups);
//! containerd's own open fds are sampled too (a shim connection leaked per pod shows there),
//! bound by [`FD_SLACK`] likewise.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_cri::v1::Mount;
use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::host_cgroup::HostCgroup;
use microvm_tests::lifecycle::{pod_leftovers, pod_processes, wait_pod_gone, MICROVM_STATE_ROOT};
use microvm_tests::microvm_pods::*;

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const FD_SLACK: i64 = 4;
const SHIM_RSS_SLACK_MIB: i64 = 16;
const GUEST_AVAILABLE_SLACK_MIB: i64 = 24;
const CGROUP_SLACK_MIB: i64 = 96;
const MIB: i64 = 1 << 20;
/// The pause before the two samples the bounds compare.
const QUIET: Duration = Duration::from_secs(6);
/// Bound on one step of a cycle (TCG, and nested TCG in the lane, are slow).
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

fn cycles(var: &str, short: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(short)
}

/// Where the samples go as CSV, if anywhere.
fn out_dir() -> Option<PathBuf> {
    std::env::var_os("MICROVM_SOAK_OUT").map(PathBuf::from)
}

fn write_csv(name: &str, header: &str, rows: &[String]) {
    let Some(dir) = out_dir() else { return };
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-{}.csv", test_hypervisor()));
    let mut text = format!("{header}\n");
    for r in rows {
        text.push_str(r);
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    eprintln!("soak: samples in {}", path.display());
}

fn rss_bytes(pid: i32) -> i64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<i64>()
                    .ok()
            })
        })
        .map_or(0, |kib| kib * 1024)
}

fn open_fds(pid: i32) -> i64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as i64)
}

/// One sample of a pod.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    cycle: usize,
    cycle_ms: u128,
    cgroup_usage: i64,
    cgroup_limit: i64,
    shim_rss: i64,
    shim_fds: i64,
    vm_rss: i64,
    vm_fds: i64,
    guest_available: i64,
}

impl Sample {
    const HEADER: &'static str = "cycle,cycle_ms,cgroup_usage_bytes,cgroup_limit_bytes,shim_rss_bytes,shim_fds,vm_rss_bytes,vm_fds,guest_available_bytes";

    fn row(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{},{}",
            self.cycle,
            self.cycle_ms,
            self.cgroup_usage,
            self.cgroup_limit,
            self.shim_rss,
            self.shim_fds,
            self.vm_rss,
            self.vm_fds,
            self.guest_available
        )
    }
}

/// What tells why a step of `pod` failed: the end of its guest console (a guest panic or OOM
/// shows there) and of containerd's log (the shim's lines, e.g. "VM ended").
fn why(ctrd: &PrivateContainerd, pod: &Pod) -> String {
    let console = std::fs::read_to_string(
        Path::new(MICROVM_STATE_ROOT)
            .join(&pod.id)
            .join("vm")
            .join("console.log"),
    )
    .map(|text| {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    })
    .unwrap_or_else(|e| format!("(no console log: {e})"));
    format!(
        "the guest's console, its end:\n{console}\ncontainerd log:\n{}",
        ctrd.log_tail()
    )
}

/// Fails the run at cycle `cycle` with `what` went wrong, the samples so far (also as CSV, when
/// asked for) and [`why`].
fn fail_at(ctrd: &PrivateContainerd, pod: &Pod, cycle: usize, what: &str, samples: &[Sample]) -> ! {
    write_csv(
        "container-cycles",
        Sample::HEADER,
        &samples.iter().map(Sample::row).collect::<Vec<_>>(),
    );
    let so_far = if samples.is_empty() {
        "no samples yet".to_string()
    } else {
        summary(samples)
    };
    panic!(
        "cycle {cycle}: {what}\nso far: {so_far}\n{}",
        why(ctrd, pod)
    )
}

/// The pod's host-side figures now, and the guest's MemAvailable read in `watch`; an error when
/// that exec fails.
async fn sample(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    watch: &str,
) -> Result<Sample, String> {
    let processes = pod_processes(ctrd, &pod.id);
    let shim = processes.first().expect("the pod's shim runs");
    let (mut vm_rss, mut vm_fds) = (0, 0);
    for p in &processes[1..] {
        vm_rss += rss_bytes(p.pid);
        vm_fds += open_fds(p.pid);
    }
    let cgroup = HostCgroup::of_pod(ctrd.cgroup_parent(), &pod.id);
    let meminfo = cri
        .exec_sync(watch, &["cat", "/proc/meminfo"], 30)
        .await
        .map_err(|e| format!("reading the guest's /proc/meminfo: {e}"))?;
    let guest_available = meminfo
        .stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemAvailable:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<i64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no MemAvailable in the guest: {meminfo:?}"))
        * 1024;
    Ok(Sample {
        cgroup_usage: cgroup.as_ref().map_or(0, |c| c.memory_usage as i64),
        cgroup_limit: cgroup
            .as_ref()
            .and_then(|c| c.memory_limit)
            .map_or(0, |l| l as i64),
        shim_rss: rss_bytes(shim.pid),
        shim_fds: open_fds(shim.pid),
        vm_rss,
        vm_fds,
        guest_available,
        ..Sample::default()
    })
}

/// A sample after [`QUIET`] without cycles: what the pod holds once the guest has let go of
/// the removed containers' files (the agent looks removed directories up every 2 s).
async fn quiet_sample(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    watch: &str,
    cycle: usize,
    samples: &[Sample],
) -> Sample {
    tokio::time::sleep(QUIET).await;
    let mut s = sample(ctrd, cri, pod, watch)
        .await
        .unwrap_or_else(|e| fail_at(ctrd, pod, cycle, &e, samples));
    s.cycle = cycle;
    s
}

/// Checks the last sample against the warm-up's: every bound of the module doc; the failures
/// as lines.
fn growth_beyond_bounds(base: &Sample, last: &Sample, samples: &[Sample]) -> Vec<String> {
    let mut bad = Vec::new();
    let mut check = |what: &str, grew: i64, slack: i64, unit: i64| {
        if grew > slack * unit {
            bad.push(format!(
                "{what} grew by {} (bound {slack})",
                if unit == 1 {
                    grew.to_string()
                } else {
                    format!("{:.1} MiB", grew as f64 / MIB as f64)
                }
            ));
        }
    };
    check(
        "the shim's open fds",
        last.shim_fds - base.shim_fds,
        FD_SLACK,
        1,
    );
    check(
        "the VM processes' open fds",
        last.vm_fds - base.vm_fds,
        FD_SLACK,
        1,
    );
    check(
        "the shim's RSS",
        last.shim_rss - base.shim_rss,
        SHIM_RSS_SLACK_MIB,
        MIB,
    );
    check(
        "the guest's used memory (MemAvailable's drop)",
        base.guest_available - last.guest_available,
        GUEST_AVAILABLE_SLACK_MIB,
        MIB,
    );
    check(
        "the host cgroup's usage",
        last.cgroup_usage - base.cgroup_usage,
        CGROUP_SLACK_MIB,
        MIB,
    );
    for s in samples {
        if s.cgroup_limit > 0 && s.cgroup_usage >= s.cgroup_limit {
            bad.push(format!("cycle {}: the host cgroup at its limit", s.cycle));
        }
    }
    bad
}

fn summary(samples: &[Sample]) -> String {
    let mut ms: Vec<u128> = samples.iter().map(|s| s.cycle_ms).collect();
    ms.sort_unstable();
    let pick = |q: f64| ms[((ms.len() - 1) as f64 * q) as usize];
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    let mut out = String::new();
    let _ = write!(
        out,
        "{} cycles: cycle time median {} ms, p90 {} ms, max {} ms; shim RSS {:.1} -> {:.1} MiB, \
         fds {} -> {}; VM RSS {:.1} -> {:.1} MiB, fds {} -> {}; host cgroup {:.1} -> {:.1} MiB \
         of {:.0}; guest MemAvailable {:.1} -> {:.1} MiB",
        samples.len(),
        pick(0.5),
        pick(0.9),
        pick(1.0),
        first.shim_rss as f64 / MIB as f64,
        last.shim_rss as f64 / MIB as f64,
        first.shim_fds,
        last.shim_fds,
        first.vm_rss as f64 / MIB as f64,
        last.vm_rss as f64 / MIB as f64,
        first.vm_fds,
        last.vm_fds,
        first.cgroup_usage as f64 / MIB as f64,
        last.cgroup_usage as f64 / MIB as f64,
        last.cgroup_limit as f64 / MIB as f64,
        first.guest_available as f64 / MIB as f64,
        last.guest_available as f64 / MIB as f64,
    );
    out
}

async fn started(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    config: k8s_cri::v1::ContainerConfig,
) -> String {
    let name = config
        .metadata
        .as_ref()
        .map(|m| m.name.clone())
        .unwrap_or_default();
    let id = cri
        .create_container(pod, config)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}\n{}", why(ctrd, pod)));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| panic!("StartContainer {name}: {e}\n{}", why(ctrd, pod)));
    id
}

/// One container cycle (see the module doc).
async fn container_cycle(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    volume: &Path,
    i: usize,
) {
    let mut config = container_config(
        &format!("cycle-{i}"),
        ctrd.busybox_image(),
        &[
            "sh",
            "-c",
            "while [ ! -e /tmp/done ]; do sleep 0.05; done; echo done",
        ],
    );
    config.tty = i.is_multiple_of(2);
    config.stdin = true;
    config.mounts = vec![Mount {
        container_path: "/vol".into(),
        host_path: volume.display().to_string(),
        readonly: i.is_multiple_of(3),
        ..Default::default()
    }];
    let id = started(ctrd, cri, pod, config).await;
    let out = cri
        .exec_sync(&id, &["cat", "/vol/data"], 60)
        .await
        .unwrap_or_else(|e| panic!("cycle {i}: exec: {e}\n{}", why(ctrd, pod)));
    assert_eq!(
        (out.exit_code, out.stdout.trim()),
        (0, "soak"),
        "cycle {i}: {out:?}"
    );
    // The exec that lets the container end may itself be ended with it (its PID namespace's
    // init exits): 0 or 137.
    let out = cri
        .exec_sync(&id, &["touch", "/tmp/done"], 60)
        .await
        .unwrap_or_else(|e| panic!("cycle {i}: exec: {e}\n{}", why(ctrd, pod)));
    assert!(
        out.exit_code == 0 || out.exit_code == 137,
        "cycle {i}: {out:?}"
    );
    let status = cri
        .wait_container_exited(&id, STEP_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("cycle {i}: {e}\n{}", why(ctrd, pod)));
    assert_eq!(status.exit_code, 0, "cycle {i}: {status:?}");
    cri.remove_container(&id)
        .await
        .unwrap_or_else(|e| panic!("cycle {i}: remove: {e}\n{}", why(ctrd, pod)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_lives_through_container_cycles_without_growth() {
    let _serial = SERIAL.lock().await;
    let n = cycles("MICROVM_SOAK_CONTAINER_CYCLES", 15);
    assert!(
        n >= 5,
        "MICROVM_SOAK_CONTAINER_CYCLES={n}: at least 5 (a warm-up of 3, then 2)"
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), None);
    let (ctrd, cri) = start(&config).await;
    let volume = dir.path().join("volume");
    std::fs::create_dir_all(&volume).unwrap();
    std::fs::write(volume.join("data"), "soak\n").unwrap();
    let pod = cri
        .run_pod_sandbox(
            ctrd.pod_config("soak-containers", Default::default())
                .unwrap(),
            "microvm",
        )
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let watch = started(
        &ctrd,
        &cri,
        &pod,
        container_config("watch", ctrd.busybox_image(), &["sleep", "1000000"]),
    )
    .await;
    let warmup = (n / 5).max(3).min(n.saturating_sub(1));
    let mut samples = Vec::with_capacity(n);
    let mut base = None;
    for i in 0..n {
        let t = Instant::now();
        container_cycle(&ctrd, &cri, &pod, &volume, i).await;
        let cycle_ms = t.elapsed().as_millis();
        let mut s = sample(&ctrd, &cri, &pod, &watch)
            .await
            .unwrap_or_else(|e| fail_at(&ctrd, &pod, i, &e, &samples));
        s.cycle = i;
        s.cycle_ms = cycle_ms;
        samples.push(s);
        if i == warmup {
            base = Some(quiet_sample(&ctrd, &cri, &pod, &watch, i, &samples).await);
        }
    }
    let last = quiet_sample(&ctrd, &cri, &pod, &watch, n - 1, &samples).await;
    write_csv(
        "container-cycles",
        Sample::HEADER,
        &samples.iter().map(Sample::row).collect::<Vec<_>>(),
    );
    eprintln!("soak ({}): {}", test_hypervisor(), summary(&samples));
    let bad = growth_beyond_bounds(&base.unwrap(), &last, &samples);
    let by_process: Vec<String> = pod_processes(&ctrd, &pod.id)
        .iter()
        .map(|p| {
            format!(
                "{} ({}): {} fds, {} KiB RSS",
                p.memory_name(),
                p.pid,
                open_fds(p.pid),
                rss_bytes(p.pid) / 1024
            )
        })
        .collect();
    assert!(
        bad.is_empty(),
        "after {n} container cycles: {bad:#?}\n{}\nby process: {by_process:#?}",
        summary(&samples)
    );

    let netns = cri.pod_netns_path(&pod.id).await.unwrap();
    cri.stop_and_remove_pod_retrying(&pod.id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let left = wait_pod_gone(&ctrd, &pod.id, netns.as_deref(), Duration::from_secs(30));
    assert!(left.is_empty(), "the pod left: {left:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_come_and_go_and_leave_nothing() {
    let _serial = SERIAL.lock().await;
    let n = cycles("MICROVM_SOAK_POD_CYCLES", 4);
    assert!(n >= 2, "MICROVM_SOAK_POD_CYCLES={n}: at least 2");
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), None);
    let (ctrd, cri) = start(&config).await;
    let containerd_pid = ctrd.containerd_pid().expect("containerd runs");
    let mut rows = Vec::with_capacity(n);
    let mut fds = Vec::with_capacity(n);
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let pod = cri
            .run_pod_sandbox(
                ctrd.pod_config(&format!("soak-pod-{i}"), Default::default())
                    .unwrap(),
                "microvm",
            )
            .await
            .unwrap_or_else(|e| panic!("pod cycle {i}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        let id = started(
            &ctrd,
            &cri,
            &pod,
            container_config("app", ctrd.busybox_image(), &["sleep", "1000000"]),
        )
        .await;
        let out = cri.exec_sync(&id, &["echo", "soak"], 60).await.unwrap();
        assert_eq!(
            (out.exit_code, out.stdout.trim()),
            (0, "soak"),
            "pod cycle {i}"
        );
        let netns = cri.pod_netns_path(&pod.id).await.unwrap();
        cri.stop_and_remove_pod_retrying(&pod.id, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("pod cycle {i}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        let left = wait_pod_gone(&ctrd, &pod.id, netns.as_deref(), Duration::from_secs(30));
        assert!(left.is_empty(), "pod cycle {i} left: {left:#?}");
        assert!(pod_leftovers(&ctrd, &pod.id, netns.as_deref()).is_empty());
        let ms = t.elapsed().as_millis();
        let fd = open_fds(containerd_pid);
        rows.push(format!("{i},{ms},{fd},{}", rss_bytes(containerd_pid)));
        fds.push(fd);
        times.push(ms);
    }
    write_csv(
        "pod-cycles",
        "cycle,cycle_ms,containerd_fds,containerd_rss_bytes",
        &rows,
    );
    times.sort_unstable();
    eprintln!(
        "soak ({}): {n} pod cycles: cycle time median {} ms, max {} ms; containerd fds {} -> {}",
        test_hypervisor(),
        times[times.len() / 2],
        times[times.len() - 1],
        fds[0],
        fds[n - 1]
    );
    let warmup = (n / 5).max(1).min(n - 1);
    assert!(
        fds[n - 1] - fds[warmup] <= FD_SLACK,
        "containerd's open fds grew from {} to {} over {n} pod cycles",
        fds[warmup],
        fds[n - 1]
    );
}
