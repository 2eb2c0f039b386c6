//! The guest facts behind the Check RPC: kernel release, online vCPUs, total memory, boot id.

use std::io::{self, Read};
use std::path::Path;

const CPU_ONLINE: &str = "/sys/devices/system/cpu/online";
const MEMINFO: &str = "/proc/meminfo";
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// Bound on what is read from any of the files above (all are far smaller).
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Highest CPU number accepted in a CPU list (Linux's NR_CPUS ceiling).
const MAX_CPU: u32 = 8192;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestFacts {
    pub kernel_release: String,
    pub online_vcpus: u32,
    pub mem_total_kib: u64,
    pub boot_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("reading {path}: {source}")]
    Read {
        path: &'static str,
        source: io::Error,
    },
    #[error("uname: {0}")]
    Uname(io::Error),
    #[error("bad CPU list {0:?}")]
    CpuList(String),
    #[error("no MemTotal line in {MEMINFO}")]
    NoMemTotal,
    #[error("bad MemTotal line {0:?}")]
    MemTotal(String),
    #[error("bad boot id {0:?}")]
    BootId(String),
}

/// Reads all facts.
pub fn gather() -> Result<GuestFacts, CheckError> {
    Ok(GuestFacts {
        kernel_release: kernel_release()?,
        online_vcpus: online_vcpus()?,
        mem_total_kib: parse_mem_total(&read_small(MEMINFO)?)?,
        boot_id: parse_boot_id(&read_small(BOOT_ID)?)?,
    })
}

fn read_small(path: &'static str) -> Result<String, CheckError> {
    let mut text = String::new();
    std::fs::File::open(Path::new(path))
        .and_then(|f| f.take(MAX_FILE_BYTES).read_to_string(&mut text))
        .map_err(|source| CheckError::Read { path, source })?;
    Ok(text)
}

fn kernel_release() -> Result<String, CheckError> {
    let mut uts = std::mem::MaybeUninit::<libc::utsname>::uninit();
    // SAFETY: uname fills the whole struct on success; it is only read after success.
    if unsafe { libc::uname(uts.as_mut_ptr()) } != 0 {
        return Err(CheckError::Uname(io::Error::last_os_error()));
    }
    // SAFETY: initialised by the successful uname above.
    let uts = unsafe { uts.assume_init() };
    let bytes: Vec<u8> = uts
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Online vCPUs from sysfs; `sysconf(_SC_NPROCESSORS_ONLN)` if sysfs is unreadable.
fn online_vcpus() -> Result<u32, CheckError> {
    match read_small(CPU_ONLINE) {
        Ok(list) => count_cpu_list(&list),
        Err(err) => {
            // SAFETY: sysconf has no memory-safety preconditions.
            let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
            u32::try_from(n).ok().filter(|&n| n > 0).ok_or(err)
        }
    }
}

/// Counts the CPUs in a kernel CPU list such as `0-3,5,7-8`.
pub fn count_cpu_list(list: &str) -> Result<u32, CheckError> {
    let bad = || CheckError::CpuList(list.chars().take(128).collect());
    let list = list.trim();
    if list.is_empty() {
        return Err(bad());
    }
    let mut count: u32 = 0;
    for range in list.split(',') {
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (a, b),
            None => (range, range),
        };
        let first: u32 = first.parse().map_err(|_| bad())?;
        let last: u32 = last.parse().map_err(|_| bad())?;
        if first > last || last > MAX_CPU {
            return Err(bad());
        }
        count = count
            .checked_add(last - first + 1)
            .filter(|&c| c <= MAX_CPU + 1)
            .ok_or_else(bad)?;
    }
    Ok(count)
}

/// `MemTotal:` from /proc/meminfo, in KiB.
pub fn parse_mem_total(meminfo: &str) -> Result<u64, CheckError> {
    let line = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .ok_or(CheckError::NoMemTotal)?;
    let bad = || CheckError::MemTotal(line.chars().take(128).collect());
    let mut words = line["MemTotal:".len()..].split_ascii_whitespace();
    let value: u64 = words.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    match (words.next(), words.next()) {
        (Some("kB"), None) => Ok(value),
        _ => Err(bad()),
    }
}

/// The boot id: a 36-character UUID.
pub fn parse_boot_id(text: &str) -> Result<String, CheckError> {
    let id = text.trim();
    let is_uuid = id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        });
    if is_uuid {
        Ok(id.to_owned())
    } else {
        Err(CheckError::BootId(id.chars().take(64).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cpu_lists() {
        assert_eq!(count_cpu_list("0\n").unwrap(), 1);
        assert_eq!(count_cpu_list("0-3\n").unwrap(), 4);
        assert_eq!(count_cpu_list("0-3,5,7-8").unwrap(), 7);
        for bad in ["", "\n", "a", "3-1", "0-", "-1", "0,,1", "0-99999", "1 2"] {
            assert!(count_cpu_list(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_mem_total() {
        let meminfo = "MemTotal:         251288 kB\nMemFree:          230000 kB\n";
        assert_eq!(parse_mem_total(meminfo).unwrap(), 251_288);
        assert!(matches!(
            parse_mem_total("MemFree: 1 kB\n"),
            Err(CheckError::NoMemTotal)
        ));
        assert!(parse_mem_total("MemTotal: lots kB\n").is_err());
        assert!(parse_mem_total("MemTotal: 5 MB\n").is_err());
        assert!(parse_mem_total("MemTotal: 99999999999999999999999 kB\n").is_err());
    }

    #[test]
    fn parses_boot_id() {
        let id = "0b5f5c3e-1d2a-4c39-9a0e-6f1d2e3c4b5a";
        assert_eq!(parse_boot_id(&format!("{id}\n")).unwrap(), id);
        assert!(parse_boot_id("not-a-uuid").is_err());
        assert!(parse_boot_id("0b5f5c3e11d2a-4c39-9a0e-6f1d2e3c4b5a").is_err());
    }

    #[test]
    fn gathers_this_machines_facts() {
        // Runs on the host (Linux): the same files exist there.
        let facts = gather().expect("gather");
        assert!(!facts.kernel_release.is_empty());
        assert!(facts.online_vcpus >= 1);
        assert!(facts.mem_total_kib > 0);
        assert_eq!(facts.boot_id.len(), 36);
    }
}
