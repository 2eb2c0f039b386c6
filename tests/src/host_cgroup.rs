//! A microvm pod's host cgroup (`<pod cgroup>/microvm-<sandbox id>`, docs/overhead.md) read from
//! the cgroup files, v1 or v2: what the demo prints and the benchmark measures.

use std::path::{Path, PathBuf};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// One reading of a pod's host cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCgroup {
    /// Relative to the hierarchy roots.
    pub path: String,
    /// `v1` or `v2`.
    pub version: &'static str,
    /// Memory limit in bytes (`None`: unlimited).
    pub memory_limit: Option<u64>,
    /// Memory charged now, in bytes (page cache included, as the kernel counts it).
    pub memory_usage: u64,
    /// The most memory charged so far, in bytes (v2 kernels before 5.19 have no peak).
    pub memory_peak: Option<u64>,
    /// CPU quota in millicores (`None`: unlimited).
    pub cpu_limit_millis: Option<u64>,
    /// CPU time used so far, in microseconds.
    pub cpu_usage_us: u64,
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn read_u64(path: &Path) -> Option<u64> {
    read(path)?.parse().ok()
}

impl HostCgroup {
    /// The host cgroup of pod `pod_id` under the pod cgroup `parent` (the `linux.cgroup_parent`
    /// given, cgroupfs form), or `None` when the shim made none there.
    pub fn of_pod(parent: &str, pod_id: &str) -> Option<Self> {
        let path = format!("{}/microvm-{pod_id}", parent.trim_matches('/'));
        let root = Path::new(CGROUP_ROOT);
        if root.join("cgroup.controllers").exists() {
            let dir = root.join(&path);
            let memory_limit = read(&dir.join("memory.max"))?;
            let cpu_max = read(&dir.join("cpu.max"))?;
            let (quota, period) = cpu_max.split_once(' ')?;
            let cpu_usage_us = read(&dir.join("cpu.stat"))?
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec ")?.parse().ok())?;
            return Some(HostCgroup {
                path,
                version: "v2",
                memory_limit: memory_limit.parse().ok(),
                memory_usage: read_u64(&dir.join("memory.current"))?,
                memory_peak: read_u64(&dir.join("memory.peak")),
                cpu_limit_millis: quota
                    .parse::<u64>()
                    .ok()
                    .zip(period.parse::<u64>().ok().filter(|&p| p > 0))
                    .map(|(q, p)| q * 1000 / p),
                cpu_usage_us,
            });
        }
        let v1 = |controller: &str| -> PathBuf { root.join(controller).join(&path) };
        let mem = v1("memory");
        let cpu = v1("cpu");
        // v1 says "no limit" with a huge page-rounded number.
        let memory_limit = read_u64(&mem.join("memory.limit_in_bytes"))?;
        let cpu_usage_us = read_u64(&v1("cpuacct").join("cpuacct.usage"))? / 1000;
        let quota: i64 = read(&cpu.join("cpu.cfs_quota_us"))?.parse().ok()?;
        let period = read_u64(&cpu.join("cpu.cfs_period_us"))?;
        Some(HostCgroup {
            path,
            version: "v1",
            memory_limit: (memory_limit < (1 << 62)).then_some(memory_limit),
            memory_usage: read_u64(&mem.join("memory.usage_in_bytes"))?,
            memory_peak: read_u64(&mem.join("memory.max_usage_in_bytes")),
            cpu_limit_millis: (quota > 0 && period > 0).then(|| quota as u64 * 1000 / period),
            cpu_usage_us,
        })
    }
}
