//! A privileged container in the guest: every device of the guest, as runc gives a privileged
//! container every device of the host.
//!
//! The shim marks the spec of a privileged container with [`PRIVILEGED_ANNOTATION`] after it
//! left the host's devices out of it (only the pod's disks and the guest's own character devices
//! stay, `shim::resources::devices`). Here the guest's `/dev` is walked the way containerd walks
//! the host's for runc (`oci.HostDevices`): every block and character node, not the
//! directories `pts`, `shm`, `fd`, `mqueue`, `.lxc`, `.lxd-mounts`, `.udev`, not `console`,
//! no symbolic link, FIFO or other file; each becomes a `linux.devices` entry with its numbers,
//! mode, owner and group, unless the spec already has an entry at that path (the pod's disks,
//! which the block device step gave the guest's numbers). The spec's rule allowing every
//! device stays, so the container's cgroup allows them all. libcontainer then makes the nodes
//! in the container's `/dev`.
//!
//! The capabilities, /sys, /proc and the rest of the spec are libcontainer's as for any
//! container; a capability the guest kernel does not know is refused
//! ([`check_capabilities`]), never silently left out.

use std::collections::HashSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use agent_protocol::PRIVILEGED_ANNOTATION;
use serde_json::{json, Value};

/// Directories of `/dev` containerd's walk skips (and with it runc's privileged containers).
const SKIPPED_DIRS: &[&str] = &["pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"];
/// Nodes it skips.
const SKIPPED_NODES: &[&str] = &["console"];
/// The most device nodes taken from the guest's `/dev`, and the deepest folder walked: bounds
/// on what the walk may add to the spec.
const MAX_NODES: usize = 4096;
const MAX_DEPTH: usize = 8;

/// Why the guest's devices cannot be given.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegedError {
    #[error("walking the guest's devices, {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the guest's /dev has more than {MAX_NODES} device nodes")]
    TooMany,
    #[error("linux.devices is not an array")]
    Spec,
    #[error(
        "capability {name} (number {number}) is not known to the guest kernel, whose last is \
         {last}: the VM cannot give it"
    )]
    UnknownCapability { name: String, number: u8, last: u8 },
    #[error("reading the guest kernel's last capability ({path}): {detail}")]
    LastCap { path: &'static str, detail: String },
}

/// Whether the shim marked `spec` privileged.
pub fn is_privileged(spec: &Value) -> bool {
    spec.pointer("/annotations")
        .and_then(|a| a.get(PRIVILEGED_ANNOTATION))
        .and_then(Value::as_str)
        == Some("true")
}

/// Adds every device node under `dev` (the guest's `/dev`) to `spec`'s `linux.devices`, at the
/// same path under `/dev`, except where the spec has an entry at that path already. Returns how
/// many were added.
pub fn add_guest_devices(spec: &mut Value, dev: &Path) -> Result<usize, PrivilegedError> {
    let mut found = Vec::new();
    walk(dev, Path::new("/dev"), 0, &mut found)?;
    let linux = spec
        .as_object_mut()
        .ok_or(PrivilegedError::Spec)?
        .entry("linux")
        .or_insert_with(|| json!({}));
    let list = linux
        .as_object_mut()
        .ok_or(PrivilegedError::Spec)?
        .entry("devices")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or(PrivilegedError::Spec)?;
    let mut taken: HashSet<String> = list
        .iter()
        .filter_map(|d| d["path"].as_str().map(str::to_string))
        .collect();
    let mut added = 0;
    for node in found {
        if taken.insert(node["path"].as_str().unwrap_or_default().to_string()) {
            list.push(node);
            added += 1;
        }
    }
    Ok(added)
}

/// Collects the device nodes under `dir` (whose path in the container is `at`).
fn walk(dir: &Path, at: &Path, depth: usize, out: &mut Vec<Value>) -> Result<(), PrivilegedError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PrivilegedError::Io { path, source }
    };
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    // The same order on every run.
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let name_str = name.to_string_lossy();
        let path = e.path();
        // lstat: a symbolic link is no device (containerd's walk lstats too).
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            // Gone since the listing (a hot-unplugged disk): not there to give.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
            Err(err) => return Err(io(&path)(err)),
        };
        let ft = meta.file_type();
        if ft.is_dir() {
            if SKIPPED_DIRS.contains(&name_str.as_ref()) || depth + 1 >= MAX_DEPTH {
                continue;
            }
            walk(&path, &at.join(&name), depth + 1, out)?;
            continue;
        }
        if SKIPPED_NODES.contains(&name_str.as_ref()) {
            continue;
        }
        let typ = if ft.is_block_device() {
            "b"
        } else if ft.is_char_device() {
            "c"
        } else {
            continue;
        };
        if out.len() >= MAX_NODES {
            return Err(PrivilegedError::TooMany);
        }
        let rdev = meta.rdev();
        out.push(json!({
            "path": at.join(&name).to_string_lossy(),
            "type": typ,
            "major": libc::major(rdev),
            "minor": libc::minor(rdev),
            "fileMode": meta.mode() & 0o7777,
            "uid": meta.uid(),
            "gid": meta.gid(),
        }));
    }
    Ok(())
}

/// Where the guest kernel says its last capability.
const CAP_LAST_CAP: &str = "/proc/sys/kernel/cap_last_cap";

/// The guest kernel's last capability number.
pub fn last_cap() -> Result<u8, PrivilegedError> {
    let text = std::fs::read_to_string(CAP_LAST_CAP).map_err(|e| PrivilegedError::LastCap {
        path: CAP_LAST_CAP,
        detail: e.to_string(),
    })?;
    text.trim().parse().map_err(|_| PrivilegedError::LastCap {
        path: CAP_LAST_CAP,
        detail: format!("{:?} is not a number", text.trim()),
    })
}

/// Refuses a capability of the spec's process that the guest kernel does not know (`last`:
/// its last capability number). containerd gives a privileged container every capability
/// *its* kernel knows, the host's; a newer host may know one the guest kernel lacks, and
/// libcontainer would fail on it with a bare EPERM or leave it out of the bounding set.
pub fn check_capabilities(
    caps: &oci_spec::runtime::LinuxCapabilities,
    last: u8,
) -> Result<(), PrivilegedError> {
    use libcontainer::capabilities::CapabilityExt;
    let sets = [
        caps.bounding(),
        caps.effective(),
        caps.permitted(),
        caps.inheritable(),
        caps.ambient(),
    ];
    for set in sets.into_iter().flatten() {
        for c in set {
            let number = c.to_cap().index();
            if number > last {
                return Err(PrivilegedError::UnknownCapability {
                    name: c.to_cap().to_string(),
                    number,
                    last,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_annotation_with_true_marks_a_spec_privileged() {
        assert!(is_privileged(
            &json!({"annotations": {PRIVILEGED_ANNOTATION: "true"}})
        ));
        assert!(!is_privileged(
            &json!({"annotations": {PRIVILEGED_ANNOTATION: "yes"}})
        ));
        assert!(!is_privileged(&json!({"annotations": {}})));
        assert!(!is_privileged(&json!({})));
    }

    /// Needs root: mknod in a temporary folder.
    #[test]
    fn walks_a_dev_as_containerd_walks_the_hosts() {
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "this test makes device nodes: it needs root, as CI runs it"
        );
        let dev = tempfile::tempdir().unwrap();
        let d = dev.path();
        let node = |p: &str, kind: SFlag, ma: u64, mi: u64| {
            mknod(
                &d.join(p),
                kind,
                Mode::from_bits_truncate(0o600),
                makedev(ma, mi),
            )
            .unwrap();
        };
        for sub in ["pts", "shm", "mqueue", "net", "deep/a/b/c/d/e/f/g/h"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        node("null", SFlag::S_IFCHR, 1, 3);
        node("vda", SFlag::S_IFBLK, 254, 0);
        node("kmsg", SFlag::S_IFCHR, 1, 11);
        node("console", SFlag::S_IFCHR, 5, 1);
        node("pts/0", SFlag::S_IFCHR, 136, 0);
        node("net/tun", SFlag::S_IFCHR, 10, 200);
        node("deep/a/b/c/d/e/f/g/h/far", SFlag::S_IFCHR, 1, 8);
        nix::unistd::mkfifo(&d.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        std::os::unix::fs::symlink("null", d.join("link")).unwrap();
        std::fs::write(d.join("file"), "").unwrap();
        // The pod's disk is at /dev/vda in the spec already (the guest's numbers).
        let mut spec = json!({"linux": {"devices": [
            {"path": "/dev/vda", "type": "b", "major": 254, "minor": 16}]}});
        let added = add_guest_devices(&mut spec, d).unwrap();
        let got: Vec<(String, String, u64, u64)> = spec["linux"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["path"].as_str().unwrap().to_string(),
                    e["type"].as_str().unwrap().to_string(),
                    e["major"].as_u64().unwrap(),
                    e["minor"].as_u64().unwrap(),
                )
            })
            .collect();
        let want = [
            ("/dev/vda", "b", 254, 16),
            ("/dev/kmsg", "c", 1, 11),
            ("/dev/net/tun", "c", 10, 200),
            ("/dev/null", "c", 1, 3),
        ];
        let want: Vec<(String, String, u64, u64)> = want
            .iter()
            .map(|(p, t, a, b)| (p.to_string(), t.to_string(), *a, *b))
            .collect();
        assert_eq!(got, want);
        assert_eq!(added, 3);
        assert_eq!(spec["linux"]["devices"][1]["fileMode"], 0o600);
        // A spec without devices gets them all.
        let mut empty = json!({});
        assert_eq!(add_guest_devices(&mut empty, d).unwrap(), 4);
    }

    #[test]
    fn a_capability_the_guest_kernel_lacks_is_refused_by_name() {
        use oci_spec::runtime::{Capability, LinuxCapabilitiesBuilder};
        let caps = LinuxCapabilitiesBuilder::default()
            .bounding([Capability::SysAdmin, Capability::CheckpointRestore])
            .build()
            .unwrap();
        check_capabilities(&caps, 40).unwrap();
        let e = check_capabilities(&caps, 39).unwrap_err().to_string();
        assert!(e.contains("CAP_CHECKPOINT_RESTORE"), "{e}");
        assert!(e.contains("number 40"), "{e}");
        let real = last_cap().unwrap();
        assert!(real >= 37, "{real}");
    }
}
