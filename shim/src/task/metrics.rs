//! An app container's cgroup v2 figures from the agent, as containerd expects them from a
//! shim's Stats: an `Any` holding `io.containerd.cgroups.v2.Metrics` (what runc's shim sends on
//! a cgroup v2 host), which containerd's CRI turns into ContainerStats (`crictl stats`).
//!
//! The sandbox's Stats, when the pod has a host cgroup (`resources::cgroup`), report both sides
//! (docs/overhead.md):
//! - `memory.usage`, `.usage_limit`, `.max_usage` and `cpu.*` are the host cgroup's: what the
//!   pod costs the node against the limit the shim set, as a runc sandbox's metrics are its
//!   cgroup's;
//! - `memory.anon` is the guest's memory in use (the guest's RAM is anonymous memory of the
//!   VMM on the host, so it is a part of `memory.usage`; the rest is the VMM's own overhead);
//! - `pids.current` and `memory_events.oom_kill` are the guest's (its processes, its OOM kills).
//!
//! Without a host cgroup the sandbox reports the guest's figures in `memory` and `cpu`.

use agent_protocol::agent::StatsResponse;

use crate::resources::cgroup::HostUsage;
use containerd_shim_protos::cgroups_v2::metrics::{
    CPUStat, MemoryEvents, MemoryStat, Metrics, PidsStat,
};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::Message;

/// The Any's type URL: the message's full protobuf name, as containerd's typeurl registers it.
pub const METRICS_TYPE_URL: &str = "io.containerd.cgroups.v2.Metrics";

/// The agent's figures as cgroup v2 metrics (absent controllers stay 0).
pub fn metrics_from_stats(stats: &StatsResponse) -> Metrics {
    Metrics {
        pids: Some(PidsStat {
            current: stats.pids_current,
            ..Default::default()
        })
        .into(),
        cpu: Some(CPUStat {
            usage_usec: stats.cpu_usage_usec,
            user_usec: stats.cpu_user_usec,
            system_usec: stats.cpu_system_usec,
            ..Default::default()
        })
        .into(),
        memory: Some(MemoryStat {
            usage: stats.memory_usage_bytes,
            // cgroup v2 says "max" for no limit; containerd reads the largest value as such.
            usage_limit: if stats.memory_limit_bytes == 0 {
                u64::MAX
            } else {
                stats.memory_limit_bytes
            },
            ..Default::default()
        })
        .into(),
        memory_events: Some(MemoryEvents {
            oom_kill: stats.oom_kills,
            ..Default::default()
        })
        .into(),
        ..Default::default()
    }
}

/// The sandbox's metrics: the guest's figures with the host cgroup's usage in `memory` and
/// `cpu` (module doc).
pub fn sandbox_metrics(guest: &StatsResponse, host: &HostUsage) -> Metrics {
    let mut m = metrics_from_stats(guest);
    m.memory = Some(MemoryStat {
        usage: host.memory_bytes,
        usage_limit: host.memory_limit_bytes,
        max_usage: host.memory_peak_bytes,
        anon: guest.memory_usage_bytes,
        ..Default::default()
    })
    .into();
    m.cpu = Some(CPUStat {
        usage_usec: host.cpu_usage_usec,
        user_usec: host.cpu_user_usec,
        system_usec: host.cpu_system_usec,
        nr_periods: host.cpu_periods,
        nr_throttled: host.cpu_throttled_periods,
        throttled_usec: host.cpu_throttled_usec,
        ..Default::default()
    })
    .into();
    m
}

/// The metrics wrapped for a StatsResponse: the guest's, or a sandbox's with its host cgroup.
pub fn metrics_any(stats: &StatsResponse, host: Option<&HostUsage>) -> Result<Any, String> {
    let metrics = match host {
        Some(h) => sandbox_metrics(stats, h),
        None => metrics_from_stats(stats),
    };
    let value = metrics
        .write_to_bytes()
        .map_err(|e| format!("encoding cgroup metrics: {e}"))?;
    Ok(Any {
        type_url: METRICS_TYPE_URL.to_string(),
        value,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::protobuf::MessageFull;

    #[test]
    fn round_trips_as_cgroup_v2_metrics() {
        let stats = StatsResponse {
            cpu_usage_usec: 1500,
            cpu_user_usec: 1000,
            cpu_system_usec: 500,
            memory_usage_bytes: 4 << 20,
            memory_limit_bytes: 0,
            pids_current: 3,
            oom_kills: 1,
            ..Default::default()
        };
        let any = metrics_any(&stats, None).unwrap();
        assert_eq!(any.type_url, "io.containerd.cgroups.v2.Metrics");
        let back = Metrics::parse_from_bytes(&any.value).unwrap();
        assert_eq!(back.memory.usage, 4 << 20);
        assert_eq!(back.memory.usage_limit, u64::MAX);
        assert_eq!(back.cpu.usage_usec, 1500);
        assert_eq!(back.pids.current, 3);
        assert_eq!(back.memory_events.oom_kill, 1);
        // A sandbox with a host cgroup: memory and CPU are the host's, anon the guest's.
        let host = HostUsage {
            memory_bytes: 300 << 20,
            memory_limit_bytes: 500 << 20,
            memory_peak_bytes: 320 << 20,
            cpu_usage_usec: 9000,
            cpu_throttled_periods: 2,
            ..Default::default()
        };
        let any = metrics_any(&stats, Some(&host)).unwrap();
        let back = Metrics::parse_from_bytes(&any.value).unwrap();
        assert_eq!(back.memory.usage, 300 << 20);
        assert_eq!(back.memory.usage_limit, 500 << 20);
        assert_eq!(back.memory.max_usage, 320 << 20);
        assert_eq!(back.memory.anon, 4 << 20);
        assert_eq!(back.cpu.usage_usec, 9000);
        assert_eq!(back.cpu.nr_throttled, 2);
        assert_eq!(back.pids.current, 3);
        assert_eq!(back.memory_events.oom_kill, 1);
        // The name containerd's typeurl uses is the message's own full name.
        assert_eq!(
            Metrics::descriptor().full_name(),
            METRICS_TYPE_URL,
            "type URL"
        );
    }
}
