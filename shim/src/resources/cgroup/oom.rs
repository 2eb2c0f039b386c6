//! The host OOM killer in a pod's host cgroup: whether it killed anything there (the kernel's
//! count, `oom_kill` in v2's `memory.events` or v1's `memory.oom_control`), and the message
//! that tells an operator which limit the pod reached and what to raise.
//!
//! The cgroup is the pod's alone and made at its boot, so any kill counted there was one of the
//! pod's host processes (the VM's process, as the largest); the count is the kernel's, not the
//! guest's word.

use std::fmt;
use std::path::Path;

use super::{parse_flat_keyed, Version};

/// The host OOM killer ended processes of a pod: it outgrew its host cgroup's memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOom {
    /// The host cgroup, relative to the hierarchy's root.
    pub cgroup: String,
    /// How many processes the kernel killed there.
    pub kills: u64,
    /// The cgroup's memory limit (`u64::MAX` where unlimited), its peak (0 where the kernel
    /// keeps none), and the two parts the limit was made of.
    pub limit_bytes: u64,
    pub peak_bytes: u64,
    pub vm_memory_bytes: u64,
    pub overhead_bytes: u64,
}

impl fmt::Display for HostOom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the host's OOM killer killed {} process{} of the pod (its VM) in host cgroup {}: \
             the pod reached its host memory limit of ",
            self.kills,
            if self.kills == 1 { "" } else { "es" },
            self.cgroup
        )?;
        if self.limit_bytes == u64::MAX {
            f.write_str("(none set: the node's memory)")?;
        } else {
            write!(f, "{} MiB", self.limit_bytes >> 20)?;
        }
        write!(
            f,
            " (VM {} MiB + overhead {} MiB)",
            self.vm_memory_bytes >> 20,
            self.overhead_bytes >> 20
        )?;
        if self.peak_bytes > 0 {
            write!(f, ", peak {} MiB", self.peak_bytes >> 20)?;
        }
        f.write_str(
            "; raise the pod's memory overhead: the RuntimeClass's overhead.podFixed.memory, \
             the microvm.io/overhead-memory annotation where the config allows it, or the \
             config's [cgroup] overhead_memory_mib",
        )
    }
}

/// The kernel's count of OOM kills in the cgroup whose memory controller's folder is `dir`;
/// 0 where the file is missing or says nothing (a v1 kernel before 4.13).
pub fn kills_in(dir: &Path, version: Version) -> u64 {
    let file = match version {
        Version::V2 => "memory.events",
        Version::V1 => "memory.oom_control",
    };
    std::fs::read_to_string(dir.join(file))
        .map(|text| kills_from(&text))
        .unwrap_or(0)
}

/// `oom_kill` of a flat-keyed file (v2's memory.events, v1's memory.oom_control).
fn kills_from(text: &str) -> u64 {
    parse_flat_keyed(text).get("oom_kill").copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_read_from_either_version_s_file() {
        let v2 = "low 0\nhigh 0\nmax 412\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(kills_from(v2), 2);
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n";
        assert_eq!(kills_from(v1), 1);
        assert_eq!(kills_from("oom_kill_disable 0\nunder_oom 0\n"), 0);
        assert_eq!(kills_from(""), 0);
    }

    #[test]
    fn a_missing_file_counts_no_kill() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(kills_in(dir.path(), Version::V2), 0);
        std::fs::write(dir.path().join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
        assert_eq!(kills_in(dir.path(), Version::V2), 1);
    }

    #[test]
    fn the_message_names_the_limit_its_parts_the_peak_and_what_to_raise() {
        let oom = HostOom {
            cgroup: "kubepods/pod1/microvm-abc".into(),
            kills: 1,
            limit_bytes: 416 << 20,
            peak_bytes: 416 << 20,
            vm_memory_bytes: 256 << 20,
            overhead_bytes: 160 << 20,
        };
        let text = oom.to_string();
        for part in [
            "killed 1 process of the pod",
            "kubepods/pod1/microvm-abc",
            "limit of 416 MiB (VM 256 MiB + overhead 160 MiB), peak 416 MiB",
            "overhead.podFixed.memory",
            "microvm.io/overhead-memory",
            "overhead_memory_mib",
        ] {
            assert!(text.contains(part), "{part:?} in {text}");
        }
    }
}
