//! Volumes with mount propagation shared by the pod's containers inside the guest.
//!
//! With runc, the containers of a pod that mount one host volume with propagation see one
//! another's mounts through the host: a privileged container's mount under a Bidirectional
//! volume goes to the host source and from there into every HostToContainer mount of it. In the
//! VM the volume is a folder of the shared filesystem, whose mount in the guest is no shared
//! mount the containers' binds could propagate through; and no mount made in the guest may
//! reach the host. So the guest holds one: the shim marks each
//! such bind mount with [`VOLUME_KEY_OPTION`] and the volume's key, and here the first
//! container of a key bind-mounts its share at `<root>/<key>` in the agent's mount namespace
//! and makes that mount shared; every container of that key then binds its mount from there.
//! libcontainer clones the bind from the shared mount, so a container whose root is shared
//! (`rootfsPropagation` rshared: Bidirectional) is a peer of it and one whose root is a slave
//! (rslave: HostToContainer) a slave: mounts go from the first to the others, and never back.
//! The point is unmounted (with whatever was mounted under it) when the last container of its
//! key is removed.
//!
//! The point is bound from the first container's source, which the shim makes the pod's one
//! share of the volume (`.volumes/<key>` in the shared directory, kept on the host while any
//! container of the pod uses the volume), not a folder of that container's: the mounts made
//! under the point live on the dentries of that source, and the dentries of a removed
//! container's folder go (with every mount on them) once the agent looks the folder up again
//! ([`crate::share_forget`]). Mounts the host makes later under the volume's source reach the
//! point through the shared filesystem. Once no container uses the point, its source is left to
//! [`crate::share_forget`] too.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use agent_protocol::VOLUME_KEY_OPTION;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use serde_json::Value;

/// Where the points are, in the agent's mount namespace.
pub const VOLUMES_ROOT: &str = "/run/microvm-volumes";
/// The longest key the shim writes (hex).
const KEY_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("mount {index}: volume key {key:?} is not 1 to {KEY_MAX} hex digits")]
    BadKey { index: usize, key: String },
    #[error("mount {index} has no source")]
    NoSource { index: usize },
    #[error("the volume shared at {}: {what}: {source}", point.display())]
    Mount {
        point: PathBuf,
        what: &'static str,
        source: nix::Error,
    },
    #[error("creating {}: {source}", path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
}

struct Point {
    path: PathBuf,
    /// What it is bound from.
    source: PathBuf,
    users: HashSet<String>,
}

/// The pod's shared volume mounts, by key.
pub struct Volumes {
    root: PathBuf,
    points: Mutex<HashMap<String, Point>>,
}

impl Volumes {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            points: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Point>> {
        self.points.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rewrites container `cid`'s marked mounts in `spec` to bind from their volume's point
    /// (made from the mount's own source when the key is new) and removes the marks. On error
    /// what this call made is undone.
    pub fn attach(&self, cid: &str, spec: &mut Value) -> Result<(), VolumeError> {
        let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
            return Ok(());
        };
        let mut points = self.lock();
        let result = (|| {
            for (index, m) in mounts.iter_mut().enumerate() {
                let Some(options) = m.get_mut("options").and_then(Value::as_array_mut) else {
                    continue;
                };
                let mut key = None;
                options.retain(|o| {
                    match o.as_str().and_then(|o| o.strip_prefix(VOLUME_KEY_OPTION)) {
                        Some(k) => {
                            key = Some(k.to_string());
                            false
                        }
                        None => true,
                    }
                });
                let Some(key) = key else { continue };
                if key.is_empty()
                    || key.len() > KEY_MAX
                    || !key.bytes().all(|b| b.is_ascii_hexdigit())
                {
                    return Err(VolumeError::BadKey { index, key });
                }
                let point = match points.entry(key) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => {
                        let source = m["source"]
                            .as_str()
                            .ok_or(VolumeError::NoSource { index })?;
                        let path = self.root.join(e.key());
                        make_point(Path::new(source), &path)?;
                        log::info!(
                            "container {cid}: volume {} shared in the guest from {source}",
                            e.key()
                        );
                        e.insert(Point {
                            path,
                            source: PathBuf::from(source),
                            users: HashSet::new(),
                        })
                    }
                };
                point.users.insert(cid.to_string());
                m["source"] = Value::String(point.path.to_string_lossy().into_owned());
            }
            Ok(())
        })();
        if result.is_err() {
            // `cid` is new: every point it is in, it joined in this call.
            release_in(&mut points, cid);
        }
        result
    }

    /// Container `cid` is gone: the points nobody uses any more are unmounted.
    pub fn release(&self, cid: &str) {
        release_in(&mut self.lock(), cid);
    }
}

fn release_in(points: &mut HashMap<String, Point>, cid: &str) {
    points.retain(|key, p| {
        p.users.remove(cid);
        if !p.users.is_empty() {
            return true;
        }
        // MNT_DETACH takes whatever the containers mounted under it along.
        if let Err(e) = umount2(&p.path, MntFlags::MNT_DETACH) {
            log::warn!("volume {key}: unmounting {}: {e}", p.path.display());
        }
        let _ = std::fs::remove_dir(&p.path);
        crate::share_forget::unused(std::mem::take(&mut p.source));
        log::info!("volume {key}: no container uses it any more");
        false
    });
}

/// Bind-mounts `source` at `point` and makes the mount shared.
fn make_point(source: &Path, point: &Path) -> Result<(), VolumeError> {
    std::fs::create_dir_all(point).map_err(|source| VolumeError::Create {
        path: point.to_path_buf(),
        source,
    })?;
    let fail = |what: &'static str| {
        move |source| VolumeError::Mount {
            point: point.to_path_buf(),
            what,
            source,
        }
    };
    let bound = mount(
        Some(source),
        point,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(fail("bind-mounting the container's share"));
    if let Err(e) = bound {
        let _ = std::fs::remove_dir(point);
        return Err(e);
    }
    if let Err(e) = mount(
        None::<&str>,
        point,
        None::<&str>,
        MsFlags::MS_SHARED | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(fail("making it shared"))
    {
        let _ = umount2(point, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(point);
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn marked(source: &str, key: &str) -> Value {
        json!({"destination": "/vol", "type": "bind", "source": source,
               "options": ["rbind", "rshared", format!("{VOLUME_KEY_OPTION}{key}")]})
    }

    #[test]
    fn a_bad_key_is_refused_and_unmarked_mounts_are_left_alone() {
        let root = tempfile::tempdir().unwrap();
        let v = Volumes::new(root.path());
        let mut spec = json!({"mounts": [
            {"destination": "/etc/hosts", "type": "bind", "source": "/x", "options": ["rbind"]},
            marked("/y", "../../etc")]});
        let e = v.attach("c1", &mut spec).unwrap_err().to_string();
        assert!(e.contains("mount 1"), "{e}");
        let mut plain = json!({"mounts": [
            {"destination": "/etc/hosts", "type": "bind", "source": "/x", "options": ["rbind"]}]});
        let before = plain.clone();
        v.attach("c1", &mut plain).unwrap();
        assert_eq!(plain, before);
        assert!(v.lock().is_empty());
    }

    /// Needs root (mounts, in a mount namespace of the test's own).
    #[test]
    fn containers_of_one_key_share_one_point_until_the_last_goes() {
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "this test mounts: it needs root, as CI runs it");
        // A thread of its own in a mount namespace of its own, so nothing reaches the host.
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).unwrap();
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_PRIVATE | MsFlags::MS_REC,
                None::<&str>,
            )
            .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = (dir.path().join("a"), dir.path().join("b"));
            std::fs::create_dir_all(&a).unwrap();
            std::fs::create_dir_all(&b).unwrap();
            std::fs::write(a.join("from-a"), "").unwrap();
            let v = Volumes::new(&dir.path().join("points"));
            let key = "00ff";
            let mut s1 = json!({"mounts": [marked(a.to_str().unwrap(), key)]});
            let mut s2 = json!({"mounts": [marked(b.to_str().unwrap(), key)]});
            v.attach("c1", &mut s1).unwrap();
            v.attach("c2", &mut s2).unwrap();
            let point = dir.path().join("points").join(key);
            for s in [&s1, &s2] {
                assert_eq!(s["mounts"][0]["source"], point.to_str().unwrap());
                assert_eq!(s["mounts"][0]["options"], json!(["rbind", "rshared"]));
            }
            // The point is the first container's share, and shared.
            assert!(point.join("from-a").exists());
            let info = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
            let line = info
                .lines()
                .find(|l| l.split(' ').nth(4) == Some(point.to_str().unwrap()))
                .unwrap_or_else(|| panic!("no mount at the point:\n{info}"));
            assert!(line.contains(" shared:"), "{line}");
            v.release("c1");
            assert!(point.join("from-a").exists(), "c2 still uses it");
            v.release("c2");
            assert!(!point.exists());
            assert!(v.lock().is_empty());
        })
        .join()
        .unwrap();
    }
}
