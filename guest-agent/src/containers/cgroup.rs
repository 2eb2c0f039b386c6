//! Where a container's cgroup is in the guest and the figures read from cgroup v2 files: a
//! container's ([`read_stats`]) and the whole guest's, for the pod's sandbox ([`guest_stats`]).
//! Plain reading, nothing written: applying resources is [`super::resources`].

use std::path::{Path, PathBuf};

/// Where container cgroups live, under the cgroup2 root.
pub(super) const CGROUP_PARENT: &str = "/microvm";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

pub fn cgroup_dir(container_id: &str) -> PathBuf {
    Path::new(CGROUP_ROOT)
        .join(CGROUP_PARENT.trim_start_matches('/'))
        .join(container_id)
}

/// Cgroup v2 figures of one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub cpu_usage_usec: u64,
    pub cpu_user_usec: u64,
    pub cpu_system_usec: u64,
    pub memory_usage_bytes: u64,
    pub memory_limit_bytes: u64,
    pub pids_current: u64,
    pub oom_kills: u64,
}

fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reads a cgroup v2 directory; absent controllers give 0.
pub fn read_stats(dir: &Path) -> Stats {
    let cpu = std::fs::read_to_string(dir.join("cpu.stat")).unwrap_or_default();
    let events = std::fs::read_to_string(dir.join("memory.events")).unwrap_or_default();
    Stats {
        cpu_usage_usec: keyed(&cpu, "usage_usec").unwrap_or(0),
        cpu_user_usec: keyed(&cpu, "user_usec").unwrap_or(0),
        cpu_system_usec: keyed(&cpu, "system_usec").unwrap_or(0),
        memory_usage_bytes: read_u64(&dir.join("memory.current")).unwrap_or(0),
        memory_limit_bytes: read_u64(&dir.join("memory.max")).unwrap_or(0),
        pids_current: read_u64(&dir.join("pids.current")).unwrap_or(0),
        oom_kills: keyed(&events, "oom_kill").unwrap_or(0),
    }
}

/// The whole guest's figures, for the pod's sandbox (its VM): CPU from the root cgroup's
/// cpu.stat, memory in use (MemTotal - MemAvailable) and MemTotal as the limit, the number of
/// processes, and the OOM kills since boot (/proc/vmstat).
pub fn guest_stats() -> Stats {
    let cpu = std::fs::read_to_string(Path::new(CGROUP_ROOT).join("cpu.stat")).unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    let processes = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0);
    guest_stats_from(&cpu, &meminfo, &vmstat, processes as u64)
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

fn guest_stats_from(cpu: &str, meminfo: &str, vmstat: &str, processes: u64) -> Stats {
    let total = meminfo_kib(meminfo, "MemTotal").unwrap_or(0);
    let available = meminfo_kib(meminfo, "MemAvailable").unwrap_or(total);
    Stats {
        cpu_usage_usec: keyed(cpu, "usage_usec").unwrap_or(0),
        cpu_user_usec: keyed(cpu, "user_usec").unwrap_or(0),
        cpu_system_usec: keyed(cpu, "system_usec").unwrap_or(0),
        memory_usage_bytes: total.saturating_sub(available).saturating_mul(1024),
        memory_limit_bytes: total.saturating_mul(1024),
        pids_current: processes,
        oom_kills: keyed(vmstat, "oom_kill").unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_stats_from_proc_files() {
        let stats = guest_stats_from(
            "usage_usec 900\nuser_usec 600\nsystem_usec 300\nnr_periods 0\n",
            "MemTotal:         262144 kB\nMemFree:          200000 kB\nMemAvailable:     225280 kB\n",
            "nr_free_pages 5\noom_kill 2\n",
            7,
        );
        assert_eq!(
            stats,
            Stats {
                cpu_usage_usec: 900,
                cpu_user_usec: 600,
                cpu_system_usec: 300,
                memory_usage_bytes: (262144 - 225280) * 1024,
                memory_limit_bytes: 262144 * 1024,
                pids_current: 7,
                oom_kills: 2,
            }
        );
        // Garbage gives zeros, never a panic.
        assert_eq!(
            guest_stats_from("x", "MemTotal: lots", "", 0),
            Stats::default()
        );
    }

    #[test]
    fn stats_from_cgroup_files() {
        let dir = std::env::temp_dir().join(format!("agent-stats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
        )
        .expect("write");
        std::fs::write(dir.join("memory.current"), "4096\n").expect("write");
        std::fs::write(dir.join("memory.max"), "max\n").expect("write");
        std::fs::write(dir.join("memory.events"), "low 0\noom 2\noom_kill 1\n").expect("write");
        assert_eq!(
            read_stats(&dir),
            Stats {
                cpu_usage_usec: 1500,
                cpu_user_usec: 1000,
                cpu_system_usec: 500,
                memory_usage_bytes: 4096,
                memory_limit_bytes: 0,
                pids_current: 0,
                oom_kills: 1,
            }
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
