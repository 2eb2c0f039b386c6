//! Host device nodes: a block device's node from its numbers (`/sys/dev/block/M:m/uevent`'s
//! `DEVNAME`), opened for the VMM with the access the container has.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::oci::Access;
use super::DevicesError;

/// The most of a uevent file read.
const UEVENT_MAX: u64 = 4096;

/// `major:minor` of a device number.
pub fn split_rdev(rdev: u64) -> (u32, u32) {
    (libc::major(rdev), libc::minor(rdev))
}

/// The host node of block device `major:minor`, found through `sysfs` (a `/sys` root).
pub fn block_node(sysfs: &Path, major: u32, minor: u32) -> Result<PathBuf, DevicesError> {
    let uevent = sysfs.join(format!("dev/block/{major}:{minor}/uevent"));
    let text = read_bounded(&uevent).map_err(|source| DevicesError::HostNode {
        what: format!("block device {major}:{minor}"),
        path: uevent.clone(),
        source,
    })?;
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .filter(|n| !n.is_empty() && !n.split('/').any(|c| c == ".." || c.is_empty()))
        .ok_or_else(|| DevicesError::NoHostNode {
            what: format!("block device {major}:{minor}"),
            why: format!("{} names no DEVNAME", uevent.display()),
        })?;
    let node = Path::new("/dev").join(name);
    check_block(&node, major, minor)?;
    Ok(node)
}

/// Checks that `node` is block device `major:minor`.
pub fn check_block(node: &Path, major: u32, minor: u32) -> Result<(), DevicesError> {
    let meta = std::fs::metadata(node).map_err(|source| DevicesError::HostNode {
        what: format!("block device {major}:{minor}"),
        path: node.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_block_device() || split_rdev(meta.rdev()) != (major, minor) {
        return Err(DevicesError::NoHostNode {
            what: format!("block device {major}:{minor}"),
            why: format!("{} is not that block device", node.display()),
        });
    }
    Ok(())
}

/// Opens `node` for the VMM: read-write, or read-only for [`Access::ReadOnly`].
pub fn open(node: &Path, access: Access) -> Result<File, DevicesError> {
    OpenOptions::new()
        .read(true)
        .write(access == Access::ReadWrite)
        .open(node)
        .map_err(|source| DevicesError::HostNode {
            what: "opening the device".into(),
            path: node.to_path_buf(),
            source,
        })
}

fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    File::open(path)?
        .take(UEVENT_MAX)
        .read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_block_node_from_its_numbers() {
        // /dev/null is a character device: a sysfs that names it is refused.
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev/block/1:3");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("uevent"), "MAJOR=1\nMINOR=3\nDEVNAME=null\n").unwrap();
        let e = block_node(dir.path(), 1, 3).unwrap_err().to_string();
        assert!(e.contains("/dev/null is not that block device"), "{e}");
        let e = block_node(dir.path(), 7, 99).unwrap_err().to_string();
        assert!(e.contains("7:99"), "{e}");
        std::fs::write(dev.join("uevent"), "DEVNAME=../etc/passwd\n").unwrap();
        assert!(block_node(dir.path(), 1, 3).is_err());
        // A real block device of this host, if it has one.
        if let Ok(entries) = std::fs::read_dir("/sys/dev/block") {
            for e in entries.flatten() {
                let name = e.file_name().into_string().unwrap();
                let (ma, mi) = name.split_once(':').unwrap();
                let (ma, mi) = (ma.parse().unwrap(), mi.parse().unwrap());
                if let Ok(node) = block_node(Path::new("/sys"), ma, mi) {
                    check_block(&node, ma, mi).unwrap();
                    return;
                }
            }
        }
    }
}
