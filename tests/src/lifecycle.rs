//! The timed CRI pod lifecycle shared by the CRI tests and the benchmark, for any runtime
//! handler: RunPodSandbox, CreateContainer + StartContainer of a busybox `sleep`, ExecSync
//! `uname -r`, StopPodSandbox, RemovePodSandbox; and the host memory charged to idle pods.

use crate::containerd::{ContainerdError, PrivateContainerd};
use crate::cri::{container_config, CriClient, CriError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error(transparent)]
    Containerd(#[from] ContainerdError),
    #[error("ExecSync `uname -r` exited {exit_code}: {stderr}")]
    Exec { exit_code: i32, stderr: String },
}

/// Wall time of each lifecycle step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifecycleTimings {
    pub run: Duration,
    pub create: Duration,
    pub start: Duration,
    pub exec: Duration,
    pub stop: Duration,
    pub remove: Duration,
}

impl LifecycleTimings {
    pub fn total(&self) -> Duration {
        self.run + self.create + self.start + self.exec + self.stop + self.remove
    }

    /// `(step name, duration)` for every step and the total.
    pub fn steps(&self) -> [(&'static str, Duration); 7] {
        [
            ("run", self.run),
            ("create", self.create),
            ("start", self.start),
            ("exec", self.exec),
            ("stop", self.stop),
            ("remove", self.remove),
            ("total", self.total()),
        ]
    }

    /// The per-step medians of several runs (each step's median on its own).
    pub fn median(runs: &[LifecycleTimings]) -> LifecycleTimings {
        let pick =
            |f: fn(&LifecycleTimings) -> Duration| median(&runs.iter().map(f).collect::<Vec<_>>());
        LifecycleTimings {
            run: pick(|t| t.run),
            create: pick(|t| t.create),
            start: pick(|t| t.start),
            exec: pick(|t| t.exec),
            stop: pick(|t| t.stop),
            remove: pick(|t| t.remove),
        }
    }
}

/// What one lifecycle saw.
#[derive(Debug, Clone)]
pub struct LifecycleOutcome {
    pub timings: LifecycleTimings,
    pub pod_id: String,
    /// `uname -r` inside the container.
    pub kernel_release: String,
    /// The pod's network namespace path while it ran.
    pub netns: Option<PathBuf>,
}

/// Runs one timed pod lifecycle with `handler`. On an error the pod is left for the harness's
/// cleanup (dropping the [`PrivateContainerd`] removes it).
pub async fn timed_pod_lifecycle(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    handler: &str,
    name: &str,
    annotations: HashMap<String, String>,
) -> Result<LifecycleOutcome, LifecycleError> {
    let mut timings = LifecycleTimings::default();
    let config = ctrd.pod_config(name, annotations)?;

    let t = Instant::now();
    let pod = cri.run_pod_sandbox(config, handler).await?;
    timings.run = t.elapsed();
    let netns = cri.pod_netns_path(&pod.id).await?;

    let t = Instant::now();
    let id = cri
        .create_container(
            &pod,
            container_config("sleeper", ctrd.busybox_image(), &["sleep", "3600"]),
        )
        .await?;
    timings.create = t.elapsed();

    let t = Instant::now();
    cri.start_container(&id).await?;
    timings.start = t.elapsed();

    let t = Instant::now();
    let uname = cri.exec_sync(&id, &["uname", "-r"], 30).await?;
    timings.exec = t.elapsed();
    if uname.exit_code != 0 {
        return Err(LifecycleError::Exec {
            exit_code: uname.exit_code,
            stderr: uname.stderr,
        });
    }

    let t = Instant::now();
    cri.stop_pod_sandbox(&pod.id).await?;
    timings.stop = t.elapsed();

    let t = Instant::now();
    cri.remove_pod_sandbox(&pod.id).await?;
    timings.remove = t.elapsed();

    Ok(LifecycleOutcome {
        timings,
        pod_id: pod.id,
        kernel_release: uname.stdout.trim().to_string(),
        netns,
    })
}

/// The median of durations (the lower middle one for an even count; zero for none).
pub fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    match sorted.len() {
        0 => Duration::ZERO,
        n => sorted[(n - 1) / 2],
    }
}

/// Host memory charged to the instance's pods, in bytes: the memory cgroup usage of its cgroup
/// parent (every pod's containers, and whatever a runtime moved into the pod cgroups) plus the
/// proportional set size of its shims that live outside those cgroups (runc's shim does).
pub fn pods_host_memory(ctrd: &PrivateContainerd) -> u64 {
    let parent = ctrd.cgroup_parent().trim_start_matches('/');
    let v1 = Path::new("/sys/fs/cgroup/memory")
        .join(parent)
        .join("memory.usage_in_bytes");
    let v2_unified = Path::new("/sys/fs/cgroup/unified")
        .join(parent)
        .join("memory.current");
    let v2 = Path::new("/sys/fs/cgroup")
        .join(parent)
        .join("memory.current");
    let cgroup = [v1, v2_unified, v2]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let in_pod_cgroups = ctrd.pod_cgroup_pids();
    let shims: u64 = ctrd
        .leftover_processes()
        .iter()
        .filter(|p| !in_pod_cgroups.contains(&p.pid))
        .map(|p| pss_bytes(p.pid))
        .sum();
    cgroup + shims
}

/// A process's proportional set size (`Pss` of /proc/<pid>/smaps_rollup), 0 if gone.
pub fn pss_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_per_step() {
        let ms = Duration::from_millis;
        assert_eq!(median(&[]), Duration::ZERO);
        assert_eq!(median(&[ms(3), ms(1), ms(2)]), ms(2));
        assert_eq!(median(&[ms(4), ms(1), ms(3), ms(2)]), ms(2));
        let a = LifecycleTimings {
            run: ms(10),
            exec: ms(1),
            ..Default::default()
        };
        let b = LifecycleTimings {
            run: ms(30),
            exec: ms(3),
            ..Default::default()
        };
        let c = LifecycleTimings {
            run: ms(20),
            exec: ms(2),
            ..Default::default()
        };
        let m = LifecycleTimings::median(&[a, b, c]);
        assert_eq!((m.run, m.exec, m.total()), (ms(20), ms(2), ms(22)));
        assert_eq!(m.steps()[6], ("total", ms(22)));
    }

    #[test]
    fn pss_of_this_process_is_nonzero() {
        assert!(pss_bytes(std::process::id() as i32) > 0);
        assert_eq!(pss_bytes(i32::MAX), 0);
    }
}
