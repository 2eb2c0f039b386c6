//! A container's block devices in the guest. The shim names, for each `linux.devices` entry of
//! type `b`, the VM disk that holds it by its virtio-blk serial; here the disk is found
//! (`/sys/block/*/serial`), the entry and the allow rules that name the host's numbers get the
//! guest disk's, and the disk is made read-only (BLKROSET) when asked. libcontainer then makes
//! the node at the entry's path with the spec's mode, uid and gid.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

/// One block device of a CreateContainer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRequest {
    pub container_path: String,
    pub serial: String,
    pub read_only: bool,
}

/// Why a block device cannot be given.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("no disk with serial {serial:?} appeared within {waited:?}")]
    NoDisk { serial: String, waited: Duration },
    #[error("the spec has no block device at {0}")]
    NoEntry(String),
    #[error("disk {disk}: {what}: {source}")]
    Io {
        disk: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("disk {disk}: unreadable device number {text:?}")]
    Number { disk: String, text: String },
}

/// How long a hot-plugged disk may take to show its serial.
const DISK_WAIT: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(50);
/// The most bytes read of a sysfs attribute.
const ATTR_MAX: u64 = 64;

/// `_IO(0x12, 93)`: set a block device read-only.
const BLKROSET: libc::c_ulong = 0x125d;

/// Rewrites `spec` for `requests` with the disks under `sys_block` (`/sys/block`) and their
/// nodes under `dev` (`/dev`).
pub fn apply(
    spec: &mut Value,
    requests: &[BlockRequest],
    sys_block: &Path,
    dev: &Path,
) -> Result<(), BlockError> {
    for r in requests {
        let disk = find_disk(sys_block, &r.serial, DISK_WAIT)?;
        let (major, minor) = disk_numbers(sys_block, &disk)?;
        if r.read_only {
            set_read_only(&dev.join(&disk), &disk)?;
        }
        rewrite(spec, &r.container_path, major, minor)?;
        log::info!(
            "block device {} is disk {disk} ({major}:{minor}{})",
            r.container_path,
            if r.read_only { ", read-only" } else { "" }
        );
    }
    Ok(())
}

/// The disk (`vda`, ...) whose serial is `serial`, waiting up to `wait` for it.
fn find_disk(sys_block: &Path, serial: &str, wait: Duration) -> Result<String, BlockError> {
    let start = Instant::now();
    loop {
        if let Ok(entries) = std::fs::read_dir(sys_block) {
            for e in entries.flatten() {
                if read_attr(&e.path().join("serial")).is_some_and(|s| s == serial) {
                    if let Ok(name) = e.file_name().into_string() {
                        return Ok(name);
                    }
                }
            }
        }
        if start.elapsed() >= wait {
            return Err(BlockError::NoDisk {
                serial: serial.to_string(),
                waited: wait,
            });
        }
        std::thread::sleep(POLL);
    }
}

fn read_attr(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut s = String::new();
    File::open(path)
        .ok()?
        .take(ATTR_MAX)
        .read_to_string(&mut s)
        .ok()?;
    Some(s.trim().to_string())
}

fn disk_numbers(sys_block: &Path, disk: &str) -> Result<(i64, i64), BlockError> {
    let text = read_attr(&sys_block.join(disk).join("dev")).unwrap_or_default();
    text.split_once(':')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or_else(|| BlockError::Number {
            disk: disk.to_string(),
            text,
        })
}

fn set_read_only(node: &PathBuf, disk: &str) -> Result<(), BlockError> {
    let f = File::open(node).map_err(|source| BlockError::Io {
        disk: disk.to_string(),
        what: "opening",
        source,
    })?;
    let on: libc::c_int = 1;
    // SAFETY: BLKROSET reads one int from the pointer, which points at `on`, alive for the
    // call; the fd is open.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKROSET as _, &on) };
    if rc != 0 {
        return Err(BlockError::Io {
            disk: disk.to_string(),
            what: "BLKROSET",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Sets the numbers of the `b` entry at `path` and of the allow rules naming its old numbers.
fn rewrite(spec: &mut Value, path: &str, major: i64, minor: i64) -> Result<(), BlockError> {
    let linux = &mut spec["linux"];
    let entry = linux["devices"]
        .as_array_mut()
        .and_then(|ds| {
            ds.iter_mut()
                .find(|d| d["path"].as_str() == Some(path) && d["type"].as_str() == Some("b"))
        })
        .ok_or_else(|| BlockError::NoEntry(path.to_string()))?;
    let old = (entry["major"].as_i64(), entry["minor"].as_i64());
    entry["major"] = major.into();
    entry["minor"] = minor.into();
    if let Some(rules) = linux["resources"]["devices"].as_array_mut() {
        for rule in rules {
            let typ = rule["type"].as_str().unwrap_or("a");
            if typ == "b" && (rule["major"].as_i64(), rule["minor"].as_i64()) == old {
                rule["major"] = major.into();
                rule["minor"] = minor.into();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_the_disk_and_rewrites_the_entry_and_its_rule() {
        let sys = tempfile::tempdir().unwrap();
        for (disk, serial, dev) in [
            ("vda", "microvm-cold0", "254:0"),
            ("vdb", "other", "254:16"),
        ] {
            let d = sys.path().join(disk);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("serial"), format!("{serial}\n")).unwrap();
            std::fs::write(d.join("dev"), format!("{dev}\n")).unwrap();
        }
        let mut spec = json!({"linux": {
            "devices": [{"path": "/dev/xvda", "type": "b", "major": 7, "minor": 3, "fileMode": 438},
                        {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
            "resources": {"devices": [{"allow": false, "access": "rwm"},
                {"allow": true, "type": "b", "major": 7, "minor": 3, "access": "rw"}]}}});
        let req = BlockRequest {
            container_path: "/dev/xvda".into(),
            serial: "microvm-cold0".into(),
            read_only: false,
        };
        apply(
            &mut spec,
            std::slice::from_ref(&req),
            sys.path(),
            Path::new("/dev"),
        )
        .unwrap();
        assert_eq!(spec["linux"]["devices"][0]["major"], 254);
        assert_eq!(spec["linux"]["devices"][0]["minor"], 0);
        assert_eq!(spec["linux"]["devices"][0]["fileMode"], 438);
        assert_eq!(spec["linux"]["devices"][1]["major"], 10);
        assert_eq!(spec["linux"]["resources"]["devices"][1]["major"], 254);
        assert!(spec["linux"]["resources"]["devices"][0]["major"].is_null());
        let missing = BlockRequest {
            container_path: "/dev/nope".into(),
            ..req.clone()
        };
        assert!(matches!(
            apply(&mut spec, &[missing], sys.path(), Path::new("/dev")),
            Err(BlockError::NoEntry(_))
        ));
        let e = find_disk(sys.path(), "absent", Duration::from_millis(120)).unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
    }
}
