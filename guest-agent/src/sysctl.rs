//! The pod's sysctls. containerd puts them (Kubernetes' `securityContext.sysctls`, safe and
//! unsafe) on the sandbox spec only: under runc the app containers join the pause container's
//! network and IPC namespaces, where they were set. In a microvm pod the containers share the
//! VM's network, IPC and UTS namespaces, which are the agent's: the agent writes each sysctl to
//! its own `/proc/sys` before any container of the pod exists.

use std::io;
use std::path::PathBuf;

const PROC_SYS: &str = "/proc/sys";
/// Bounds on a request: sysctls, name and value lengths.
const MAX_SYSCTLS: usize = 1024;
const MAX_NAME: usize = 256;
const MAX_VALUE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    #[error("too many sysctls ({0}, at most {MAX_SYSCTLS})")]
    TooMany(usize),
    #[error("sysctl {0:?}: not a sysctl name")]
    BadName(String),
    #[error("sysctl {name}: value of {len} bytes (at most {MAX_VALUE})")]
    TooLong { name: String, len: usize },
    #[error("sysctl {name} = {value:?}: writing {}: {source}", path.display())]
    Write {
        name: String,
        value: String,
        path: PathBuf,
        source: io::Error,
    },
}

/// The `/proc/sys` path of a sysctl name: `a.b.c` is `a/b/c`; a name with a `/` is a path
/// already (Kubernetes' form for names whose parts hold dots, e.g. `net/ipv4/conf/eth0.100/...`).
pub fn proc_path(name: &str) -> Result<PathBuf, SysctlError> {
    let bad = || SysctlError::BadName(name.to_owned());
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad());
    }
    let sep = if name.contains('/') { '/' } else { '.' };
    let mut path = PathBuf::from(PROC_SYS);
    for part in name.split(sep) {
        let ok = !part.is_empty()
            && part != "."
            && part != ".."
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if !ok {
            return Err(bad());
        }
        path.push(part);
    }
    Ok(path)
}

/// Writes each sysctl, in name order; stops at the first that fails, naming it.
pub fn apply(sysctls: &std::collections::HashMap<String, String>) -> Result<(), SysctlError> {
    if sysctls.len() > MAX_SYSCTLS {
        return Err(SysctlError::TooMany(sysctls.len()));
    }
    let mut names: Vec<&String> = sysctls.keys().collect();
    names.sort();
    let mut planned = Vec::with_capacity(names.len());
    for name in names {
        let value = &sysctls[name];
        if value.len() > MAX_VALUE {
            return Err(SysctlError::TooLong {
                name: name.clone(),
                len: value.len(),
            });
        }
        planned.push((name, value, proc_path(name)?));
    }
    for (name, value, path) in planned {
        std::fs::write(&path, value.as_bytes()).map_err(|source| SysctlError::Write {
            name: name.clone(),
            value: value.clone(),
            path: path.clone(),
            source,
        })?;
        log::info!("sysctl {name} = {value}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_proc_sys_paths() {
        assert_eq!(
            proc_path("kernel.shm_rmid_forced").unwrap(),
            PathBuf::from("/proc/sys/kernel/shm_rmid_forced")
        );
        assert_eq!(
            proc_path("net/ipv4/conf/eth0.100/forwarding").unwrap(),
            PathBuf::from("/proc/sys/net/ipv4/conf/eth0.100/forwarding")
        );
        for bad in ["", "a..b", "../etc", "a/../b", "a b", "a.b/", "/a", "x\0y"] {
            assert!(proc_path(bad).is_err(), "{bad:?}");
        }
        assert!(proc_path(&"a".repeat(300)).is_err());
    }

    #[test]
    fn a_bad_name_fails_before_anything_is_written() {
        let mut sysctls = std::collections::HashMap::new();
        sysctls.insert("zzz/../../etc/passwd".to_string(), "x".to_string());
        sysctls.insert("aaa.no_such_sysctl_here".to_string(), "1".to_string());
        let err = apply(&sysctls).unwrap_err().to_string();
        assert!(err.contains("zzz/../../etc/passwd"), "{err}");
    }
}
