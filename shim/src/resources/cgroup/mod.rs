//! The pod's host cgroup: `<pod cgroup>/microvm-<sandbox id>` (cgroups-rs, v1 or v2 as the host
//! has it), holding the whole shim process (its VMM threads, vCPUs, device threads) and every
//! helper it starts afterwards (QEMU, vhost-device-vsock, ...), limited to the VM's size plus
//! the pod's overhead ([`overhead`]). The pod cgroup is the parent of the sandbox spec's
//! `linux.cgroupsPath` ([`path`]).
//!
//! [`setup`] records the cgroup (path, version, where the shim was) in the state directory
//! before it creates anything; [`release`] reads that record, so it works in this process and
//! in `<shim> delete` after a crash: it moves this process back where it was if it is inside,
//! kills what else is still inside (only the pod's processes can be there), logs the pod's
//! host-side peak against the declared overhead, removes the cgroup on every controller and
//! then the record.

pub mod oom;
pub mod overhead;
pub mod path;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::cpuacct::CpuAcctController;
use cgroups_rs::fs::memory::MemController;
use cgroups_rs::fs::Controller;
use cgroups_rs::fs::{hierarchies, Cgroup};
use cgroups_rs::CgroupPid;
use serde::{Deserialize, Serialize};

use crate::state;
use oom::HostOom;
use overhead::{Amounts, Defaults, Limits, Overhead};
use path::PodCgroup;

/// How long release waits for killed processes to leave the cgroup.
const EMPTY_WAIT: Duration = Duration::from_secs(15);
/// A v1 memory limit at or above this is "unlimited" (the kernel shows PAGE_COUNTER_MAX pages).
const V1_UNLIMITED: u64 = 1 << 62;

/// Why the host cgroup could not be made, changed or removed; each names the cgroup or file.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0}")]
    BadPath(String),
    #[error("{0}")]
    Overhead(String),
    #[error("{path} exists: this pod already has a host cgroup recorded")]
    RecordExists { path: PathBuf },
    #[error(transparent)]
    Record(#[from] crate::state::RecordError),
    #[error("{what} (cgroup {cgroup}): {source}")]
    Cgroup {
        what: &'static str,
        cgroup: String,
        source: cgroups_rs::fs::error::Error,
    },
    #[error("cgroup {cgroup} has no {controller} controller here")]
    NoController {
        cgroup: String,
        controller: &'static str,
    },
    #[error("cgroup {cgroup} still holds processes {pids:?} after they were killed")]
    Busy { cgroup: String, pids: Vec<u64> },
}

/// Which cgroup hierarchy the host has (cgroups-rs picks: v2 when /sys/fs/cgroup is cgroup2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    V1,
    V2,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        })
    }
}

/// The undo record (`cgroup.json` in the state directory), written before the cgroup is made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupRecord {
    /// The host cgroup, relative to each hierarchy's root.
    pub path: String,
    pub version: Version,
    /// The shim's pid when it moved in.
    pub shim_pid: u32,
    /// Where the shim was before, per controller (`/proc/self/cgroup`; v2's key is "").
    pub previous: BTreeMap<String, String>,
    /// The guest's memory and the memory overhead, in bytes, for the teardown log.
    pub vm_memory_bytes: u64,
    pub overhead_memory_bytes: u64,
}

/// What setup needs.
pub struct SetupRequest<'a> {
    pub sandbox_id: &'a str,
    /// The sandbox spec's `linux.cgroupsPath`.
    pub cgroups_path: &'a str,
    pub annotations: &'a HashMap<String, String>,
    /// The containers' sum from the `io.kubernetes.cri.sandbox-*` annotations.
    pub containers: Amounts,
    /// The RuntimeClass overhead given typed (Sandbox API), empty otherwise.
    pub typed_overhead: Amounts,
    pub vm_memory_bytes: u64,
    pub vcpus: u8,
    pub defaults: Defaults,
    /// Where the undo record goes (`StateDir::cgroup_record`).
    pub record: &'a Path,
}

/// The pod's host cgroup, made and holding this process.
#[derive(Debug, Clone)]
pub struct HostCgroup {
    pub path: String,
    pub version: Version,
    pub pod: PodCgroup,
    pub overhead: Overhead,
    pub limits: Limits,
    vm_memory_bytes: u64,
    vcpus: u8,
}

/// The host cgroup's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostUsage {
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// The most the cgroup ever held (v1 memory.max_usage_in_bytes, v2 memory.peak; 0 where
    /// the kernel has no memory.peak).
    pub memory_peak_bytes: u64,
    pub cpu_usage_usec: u64,
    pub cpu_user_usec: u64,
    pub cpu_system_usec: u64,
    pub cpu_periods: u64,
    pub cpu_throttled_periods: u64,
    pub cpu_throttled_usec: u64,
}

fn hierarchy_version() -> Version {
    if hierarchies::is_cgroup2_unified_mode() {
        Version::V2
    } else {
        Version::V1
    }
}

fn cg_err<'a>(
    what: &'static str,
    cgroup: &'a str,
) -> impl FnOnce(cgroups_rs::fs::error::Error) -> CgroupError + 'a {
    move |source| CgroupError::Cgroup {
        what,
        cgroup: cgroup.to_string(),
        source,
    }
}

/// Makes the pod's host cgroup, sets its limits and moves this whole process in; the result
/// says where the overhead came from. A failure leaves nothing behind.
pub fn setup(req: SetupRequest<'_>) -> Result<HostCgroup, CgroupError> {
    let pod = path::parse_cgroups_path(req.cgroups_path).map_err(CgroupError::BadPath)?;
    let cg_path = pod.host_cgroup(req.sandbox_id);
    let pod_limits = read_amounts(&pod.parent);
    let overhead = overhead::resolve(
        req.annotations,
        req.defaults,
        req.typed_overhead,
        pod_limits,
        req.containers,
    )
    .map_err(CgroupError::Overhead)?;
    let limits = overhead::limits(req.vm_memory_bytes, req.vcpus, &overhead, pod_limits);
    if req.record.exists() {
        return Err(CgroupError::RecordExists {
            path: req.record.to_path_buf(),
        });
    }
    let previous = cgroups_rs::fs::cgroup::get_cgroups_relative_paths()
        .map_err(cg_err("reading /proc/self/cgroup", &cg_path))?
        .into_iter()
        .collect();
    let record = CgroupRecord {
        path: cg_path.clone(),
        version: hierarchy_version(),
        shim_pid: std::process::id(),
        previous,
        vm_memory_bytes: req.vm_memory_bytes,
        overhead_memory_bytes: overhead.memory_bytes,
    };
    write_record(req.record, &record)?;
    let host = HostCgroup {
        path: cg_path,
        version: record.version,
        pod,
        overhead,
        limits,
        vm_memory_bytes: req.vm_memory_bytes,
        vcpus: req.vcpus,
    };
    if let Err(e) = create_and_enter(&host) {
        if let Err(u) = release(req.record) {
            log::warn!("undoing the host cgroup {}: {u}", host.path);
        }
        return Err(e);
    }
    Ok(host)
}

fn create_and_enter(host: &HostCgroup) -> Result<(), CgroupError> {
    let cg =
        Cgroup::new(hierarchies::auto(), &host.path).map_err(cg_err("creating", &host.path))?;
    apply_limits(&cg, &host.path, &host.limits)?;
    cg.add_task_by_tgid(CgroupPid::from(u64::from(std::process::id())))
        .map_err(cg_err("moving the shim in", &host.path))
}

fn apply_limits(cg: &Cgroup, path: &str, limits: &Limits) -> Result<(), CgroupError> {
    let mem: &MemController = cg.controller_of().ok_or(CgroupError::NoController {
        cgroup: path.to_string(),
        controller: "memory",
    })?;
    let cpu: &CpuController = cg.controller_of().ok_or(CgroupError::NoController {
        cgroup: path.to_string(),
        controller: "cpu",
    })?;
    let bytes = i64::try_from(limits.memory_bytes).unwrap_or(i64::MAX);
    mem.set_limit(bytes)
        .map_err(cg_err("setting the memory limit", path))?;
    cpu.set_cfs_period(limits.cpu_period_us)
        .map_err(cg_err("setting the CPU period", path))?;
    let quota = i64::try_from(limits.cpu_quota_us).unwrap_or(i64::MAX);
    cpu.set_cfs_quota(quota)
        .map_err(cg_err("setting the CPU quota", path))
}

/// The memory and CPU limits of cgroup `path` (relative to the roots; "" is the root, which
/// has none). A limit that cannot be read counts as none.
fn read_amounts(path: &str) -> Amounts {
    if path.is_empty() {
        return Amounts::default();
    }
    let cg = Cgroup::load(hierarchies::auto(), path);
    if !cg.exists() {
        return Amounts::default();
    }
    let memory_bytes = cg.controller_of::<MemController>().and_then(|m| {
        let limit = m.memory_stat().limit_in_bytes;
        u64::try_from(limit)
            .ok()
            .filter(|l| *l > 0 && *l < V1_UNLIMITED)
    });
    let cpu_millis = cg.controller_of::<CpuController>().and_then(|c| {
        let quota = c.cfs_quota().ok()?;
        let period = c.cfs_period().ok()?;
        overhead::quota_millis(quota, period)
    });
    Amounts {
        memory_bytes,
        cpu_millis,
    }
}

impl HostCgroup {
    /// The pod's log line: the cgroup, its limits and where the overhead came from.
    pub fn describe(&self) -> String {
        format!(
            "host cgroup {} ({}, {} driver): memory limit {} MiB = VM {} MiB + overhead {} MiB \
             ({}), CPU {}m = {} vCPUs + overhead {}m ({}){}",
            self.path,
            self.version,
            self.pod.driver,
            self.limits.memory_bytes >> 20,
            self.vm_memory_bytes >> 20,
            self.overhead.memory_bytes >> 20,
            self.overhead.memory_source,
            self.limits.cpu_millis(),
            self.vcpus,
            self.overhead.cpu_millis,
            self.overhead.cpu_source,
            if self.capped() {
                ", capped by the pod cgroup's own limit"
            } else {
                ""
            }
        )
    }

    fn capped(&self) -> bool {
        self.limits.memory_bytes
            < self
                .vm_memory_bytes
                .saturating_add(self.overhead.memory_bytes)
            || self.limits.cpu_millis() < u64::from(self.vcpus) * 1000 + self.overhead.cpu_millis
    }

    /// What the host OOM killer did here, if it killed anything: the pod outgrew its limit
    /// (its VM's process is the one killed, as the largest).
    pub fn oom(&self) -> Option<HostOom> {
        let cg = Cgroup::load(hierarchies::auto(), &self.path);
        let kills = oom_kills(&cg, self.version);
        (kills > 0).then(|| {
            let usage = usage_of(&cg, self.version);
            HostOom {
                cgroup: self.path.clone(),
                kills,
                limit_bytes: self.limits.memory_bytes,
                peak_bytes: usage.memory_peak_bytes,
                vm_memory_bytes: self.vm_memory_bytes,
                overhead_bytes: self.overhead.memory_bytes,
            }
        })
    }

    /// The cgroup's current usage.
    pub fn usage(&self) -> HostUsage {
        usage_of(&Cgroup::load(hierarchies::auto(), &self.path), self.version)
    }

    /// Re-applies the limit rule with the pod cgroup's current limits (kubelet resizes it with
    /// the pod's containers; the VM's own size is fixed at boot). Returns the new limits.
    pub fn resize(&mut self) -> Result<Limits, CgroupError> {
        let pod_limits = read_amounts(&self.pod.parent);
        let limits = overhead::limits(self.vm_memory_bytes, self.vcpus, &self.overhead, pod_limits);
        let cg = Cgroup::load(hierarchies::auto(), &self.path);
        apply_limits(&cg, &self.path, &limits)?;
        self.limits = limits;
        Ok(limits)
    }
}

/// The kernel's count of OOM kills in `cg` (0 without a memory controller).
fn oom_kills(cg: &Cgroup, version: Version) -> u64 {
    cg.controller_of::<MemController>()
        .map_or(0, |m| oom::kills_in(m.path(), version))
}

fn usage_of(cg: &Cgroup, version: Version) -> HostUsage {
    let mut u = HostUsage::default();
    if let Some(m) = cg.controller_of::<MemController>() {
        let stat = m.memory_stat();
        u.memory_bytes = stat.usage_in_bytes;
        u.memory_limit_bytes = u64::try_from(stat.limit_in_bytes)
            .ok()
            .filter(|l| *l > 0 && *l < V1_UNLIMITED)
            .unwrap_or(u64::MAX);
        u.memory_peak_bytes = stat.max_usage_in_bytes;
    }
    let cpu_stat = cg
        .controller_of::<CpuController>()
        .map(|c| parse_flat_keyed(&c.cpu().stat))
        .unwrap_or_default();
    let get = |k: &str| cpu_stat.get(k).copied().unwrap_or(0);
    u.cpu_periods = get("nr_periods");
    u.cpu_throttled_periods = get("nr_throttled");
    match version {
        Version::V2 => {
            u.cpu_usage_usec = get("usage_usec");
            u.cpu_user_usec = get("user_usec");
            u.cpu_system_usec = get("system_usec");
            u.cpu_throttled_usec = get("throttled_usec");
        }
        Version::V1 => {
            u.cpu_throttled_usec = get("throttled_time") / 1000;
            if let Some(acct) = cg.controller_of::<CpuAcctController>() {
                let a = acct.cpuacct();
                u.cpu_usage_usec = a.usage / 1000;
                u.cpu_user_usec = a.usage_user / 1000;
                u.cpu_system_usec = a.usage_sys / 1000;
            }
        }
    }
    u
}

/// `key value` lines (cpu.stat) as a map; lines that do not parse are skipped.
fn parse_flat_keyed(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// What [`release`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOutcome {
    NothingRecorded,
    Removed {
        path: String,
        /// Pids of the pod's processes that were still inside and got SIGKILL.
        killed: Vec<u64>,
        /// The host-side peak memory, in bytes (0 where the kernel keeps none).
        peak_bytes: u64,
    },
}

/// Undoes [`setup`] from its record: this process moved back where it was (if inside), the
/// pod's other processes still inside killed, the peak logged, the cgroup removed on every
/// controller, then the record. Safe to run twice and without a record.
pub fn release(record_path: &Path) -> Result<ReleaseOutcome, CgroupError> {
    let Some(record) = read_record(record_path)? else {
        return Ok(ReleaseOutcome::NothingRecorded);
    };
    let cg = Cgroup::load(hierarchies::auto(), &record.path);
    let me = u64::from(std::process::id());
    let mut killed = Vec::new();
    let mut peak_bytes = 0;
    if cg.exists() {
        if cg.procs().iter().any(|p| p.pid == me) {
            move_back(&cg, &record, me)?;
        }
        // Until the deadline: kill what is inside (a process may fork while we look), wait for
        // it to be empty. Killed processes leave only once the kernel has torn them down, which
        // takes seconds for a large VM on a loaded host.
        let deadline = Instant::now() + EMPTY_WAIT;
        loop {
            let procs = cg.procs();
            if procs.is_empty() {
                break;
            }
            for pid in procs {
                if pid.pid != me && kill(pid.pid) && !killed.contains(&pid.pid) {
                    killed.push(pid.pid);
                }
            }
            if Instant::now() >= deadline {
                let left: Vec<u64> = cg.procs().into_iter().map(|p| p.pid).collect();
                return Err(CgroupError::Busy {
                    cgroup: record.path,
                    pids: left,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let usage = usage_of(&cg, record.version);
        peak_bytes = usage.memory_peak_bytes;
        let kills = oom_kills(&cg, record.version);
        if kills > 0 {
            // Said here too, where every path ends (a shim the OOM killer took itself, with
            // its in-process VMM, is reclaimed by `<shim> delete`).
            let oom = HostOom {
                cgroup: record.path.clone(),
                kills,
                limit_bytes: usage.memory_limit_bytes,
                peak_bytes,
                vm_memory_bytes: record.vm_memory_bytes,
                overhead_bytes: record.overhead_memory_bytes,
            };
            log::warn!("{oom}");
        }
        log::info!(
            "host cgroup {}: peak memory {} MiB against VM {} MiB + declared overhead {} MiB{}",
            record.path,
            peak_bytes >> 20,
            record.vm_memory_bytes >> 20,
            record.overhead_memory_bytes >> 20,
            if peak_bytes
                > record
                    .vm_memory_bytes
                    .saturating_add(record.overhead_memory_bytes)
            {
                " (over: the overhead is too small for this pod)"
            } else {
                ""
            }
        );
        // An emptied cgroup can still be busy for a moment (the kernel finishing the exits):
        // removal is retried until the deadline.
        loop {
            match cg.delete() {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    log::debug!("host cgroup {}: removal retried: {e}", record.path);
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(cg_err("removing", &record.path)(e)),
            }
        }
    }
    remove_record(record_path)?;
    Ok(ReleaseOutcome::Removed {
        path: record.path,
        killed,
        peak_bytes,
    })
}

/// Moves process `pid` back to where the record says it was, controller by controller.
fn move_back(cg: &Cgroup, record: &CgroupRecord, pid: u64) -> Result<(), CgroupError> {
    let pid = CgroupPid::from(pid);
    if record.version == Version::V2 {
        let prev = record.previous.get("").map(String::as_str).unwrap_or("/");
        let target = Cgroup::load(hierarchies::auto(), prev.trim_start_matches('/'));
        return target
            .add_task_by_tgid(pid)
            .map_err(cg_err("moving the shim back", &record.path));
    }
    for sub in cg.subsystems() {
        let name = sub.controller_name();
        let prev = record
            .previous
            .get(&name)
            .map(String::as_str)
            .unwrap_or("/");
        let target = Cgroup::load(hierarchies::auto(), prev.trim_start_matches('/'));
        let Some(t) = target
            .subsystems()
            .iter()
            .find(|s| s.controller_name() == name)
        else {
            continue;
        };
        t.to_controller()
            .add_task_by_tgid(&pid)
            .map_err(cg_err("moving the shim back", &record.path))?;
    }
    Ok(())
}

/// SIGKILLs `pid` (a process inside the pod's own cgroup); whether the signal was sent.
fn kill(pid: u64) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    // SAFETY: kill(2) on a positive pid read from the pod's own cgroup.procs: only the pod's
    // processes are there; no memory is involved.
    unsafe { libc::kill(raw, libc::SIGKILL) == 0 }
}

/// Reads the record; `None` when there is none.
pub fn read_record(path: &Path) -> Result<Option<CgroupRecord>, CgroupError> {
    Ok(state::read_record(path)?)
}

fn write_record(path: &Path, record: &CgroupRecord) -> Result<(), CgroupError> {
    Ok(state::write_record(path, record)?)
}

fn remove_record(path: &Path) -> Result<(), CgroupError> {
    Ok(state::remove_record(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_missing_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cgroup.json");
        assert_eq!(read_record(&p).unwrap(), None);
        let r = CgroupRecord {
            path: "kubepods/pod1/microvm-x".into(),
            version: Version::V1,
            shim_pid: 42,
            previous: [("memory".to_string(), "/a".to_string())].into(),
            vm_memory_bytes: 1 << 28,
            overhead_memory_bytes: 1 << 26,
        };
        write_record(&p, &r).unwrap();
        assert_eq!(read_record(&p).unwrap(), Some(r));
        remove_record(&p).unwrap();
        remove_record(&p).unwrap();
        assert_eq!(release(&p).unwrap(), ReleaseOutcome::NothingRecorded);
        std::fs::write(&p, b"{").unwrap();
        assert!(matches!(
            read_record(&p),
            Err(CgroupError::Record(state::RecordError::Json { .. }))
        ));
    }

    #[test]
    fn cpu_stat_parses() {
        let m = parse_flat_keyed("nr_periods 10\nnr_throttled 2\nthrottled_time 5000\nbad\n");
        assert_eq!(m["nr_periods"], 10);
        assert_eq!(m["throttled_time"], 5000);
        assert_eq!(m.len(), 3);
    }
}
