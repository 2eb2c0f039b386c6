//! Host side of the pod's shared directory (docs/security.md, docs/virtio-fs.md): what the guest
//! sees at [`GUEST_SHARED_DIR`](crate::sandbox::spec::GUEST_SHARED_DIR), and how the shim puts
//! each app container's files there without ever letting the guest steer it.
//!
//! **The skeleton.** At boot ([`PodShare::create`]) the pod gets a small tmpfs of its own
//! ([`SKELETON_SIZE`], [`SKELETON_INODES`]) at `<state>/shared`, the directory the VM's virtio-fs
//! device exports. That mount is **read-only**: the guest, even as root with its own kernel,
//! cannot create, rename, replace or fill anything in it. The shim keeps a second, writable
//! mount of the same tmpfs that exists only as a file descriptor of its own process (a detached
//! clone: in no mount namespace, so nobody else can reach it), and creates the directories and
//! files of the skeleton through it: `<cid>/rootfs` and `<cid>/mounts/<n>`.
//!
//! **Container files.** A container's rootfs (the mounts containerd passes in
//! CreateTaskRequest.rootfs, usually one overlay) is mounted at `<cid>/rootfs`, each of the spec's
//! bind sources (volumes, /etc/hosts, resolv.conf, termination log, /dev/shm) at
//! `<cid>/mounts/<n>` ([`crate::sandbox::spec`]). These mounts carry their own flags, so the
//! guest writes inside them (its rootfs and read-write volumes) but never in the directories
//! that hold them. All of them are `nosuid,nodev` on the host; a read-only volume is read-only
//! with every mount under it (`mount_setattr(AT_RECURSIVE)`).
//!
//! **Volumes with propagation.** A bind with propagation (HostToContainer, Bidirectional) is not
//! a container's own: the pod shares each such volume once, at [`VOLUMES`]`/<key>` (the key of
//! [`crate::sandbox::spec::volume_key`]), for as long as any container of the pod uses it. The
//! guest binds every container's mount of it from one shared mount of that folder (the agent's
//! `volumes` module), and what a privileged container mounts there lives on dentries under it:
//! in a container's own folder, they would go when that container goes (the guest drops the
//! removed container's folder, and with its dentries the mounts on them, in every container),
//! and the host's later mounts under the volume would stop reaching the others.
//!
//! **No path is resolved twice.** Every create, mount and unmount goes through [`host_fs`]:
//! `openat2` beneath the skeleton's descriptors without symlinks, `O_EXCL` creation, binds cloned
//! with `open_tree` and attached with `move_mount` to a descriptor, unmounts through a
//! descriptor checked to be a mount's root. Teardown of the whole pod is one `MNT_DETACH` of
//! `<state>/shared` ([`crate::state::StateDir::cleanup`]), which takes every container's mounts
//! with it.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rustix::fs::{fstat, FileType, OFlags};
use rustix::mount::MountAttrFlags;

use crate::host_fs::{self, Propagation};
use crate::state::StateDir;

/// A host path to bind-mount into the shared directory, at `shared/<relative>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareBind {
    /// The host source of the spec's mount.
    pub host_source: PathBuf,
    /// Where under the pod's shared directory it goes: `<cid>/mounts/<n>`, or
    /// [`VOLUMES`]`/<key>` ([`volume_relative`]) for a bind with propagation.
    pub relative: PathBuf,
    /// Whether the spec asks for it read-only.
    pub readonly: bool,
    /// Whether the spec asks for mounts made under the host source later to show inside
    /// (`rslave`/`rshared`: Kubernetes' HostToContainer and Bidirectional propagation).
    pub from_host: bool,
}

/// The skeleton tmpfs's size. It holds only empty directories and files (mount points), which
/// take no data pages; the bound is there so that nothing, the shim included, can grow it.
pub const SKELETON_SIZE: &str = "1m";
/// The skeleton tmpfs's inode bound: each container takes 3 plus one per bind mount.
pub const SKELETON_INODES: &str = "16384";
/// The state directory's entry the skeleton is mounted on.
const SHARED: &str = "shared";
/// The skeleton's folder of the pod's volumes with propagation (module doc). No container's
/// folder: containerd's ids begin with a letter or a digit, and [`container_folder`] refuses it.
pub const VOLUMES: &str = ".volumes";
/// The longest volume key (hex digits) a place under [`VOLUMES`] takes.
const VOLUME_KEY_MAX: usize = 64;

/// Where the pod shares the volume of `key`, under its shared directory.
pub fn volume_relative(key: &str) -> PathBuf {
    Path::new(VOLUMES).join(key)
}

/// One rootfs mount as containerd passes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootfsMount {
    pub fs_type: String,
    pub source: String,
    pub options: Vec<String>,
}

/// Errors of the pod's share; each names what it was doing and where.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mounting the rootfs at {}: {message}", path.display())]
    Rootfs { path: PathBuf, message: String },
    #[error("container id {0:?} cannot name a folder of the pod's shared directory")]
    BadId(String),
    #[error("bind mount path {} is not <container id>/mounts/<n>, nor {VOLUMES}/<key> for a bind with propagation", .0.display())]
    BadBind(PathBuf),
}

fn io_err(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> ShareError {
    let path = path.into();
    move |source| ShareError::Io { what, path, source }
}

/// The pod's shared directory: the read-only skeleton the guest sees, and this process's own
/// writable view of it (module doc).
#[derive(Debug)]
pub struct PodShare {
    /// `<state>/shared`, for messages.
    path: PathBuf,
    /// The root of the exported (read-only) mount: containers' files are mounted under it.
    export: OwnedFd,
    /// The root of the detached writable clone: the skeleton is created through it.
    writable: OwnedFd,
    /// The containers that use each volume shared at [`VOLUMES`]`/<key>`, by key.
    volumes: Mutex<HashMap<OsString, HashSet<String>>>,
}

/// Where one bind of a container goes.
enum Place {
    /// `<cid>/mounts/<n>`: the container's own.
    Own(OsString),
    /// [`VOLUMES`]`/<key>`: the pod's, shared with the volume's other containers.
    Volume(OsString),
}

impl PodShare {
    /// Mounts the pod's skeleton tmpfs at `<state>/shared` read-only and keeps a writable
    /// detached clone of it. `state` must exist. On error nothing stays mounted.
    pub fn create(state: &StateDir) -> Result<PodShare, ShareError> {
        let path = state.shared_dir();
        let state_fd =
            host_fs::open_root_dir(state.path()).map_err(io_err("opening", state.path()))?;
        let dir = state_fd.as_fd();
        host_fs::mkdir_beneath(dir, Path::new(SHARED), 0o755).map_err(io_err("creating", &path))?;
        let tmpfs = host_fs::new_tmpfs(
            &[
                ("size", SKELETON_SIZE),
                ("nr_inodes", SKELETON_INODES),
                ("mode", "0755"),
            ],
            MountAttrFlags::MOUNT_ATTR_NOSUID
                | MountAttrFlags::MOUNT_ATTR_NODEV
                | MountAttrFlags::MOUNT_ATTR_NOEXEC,
        )
        .map_err(io_err("creating the skeleton tmpfs for", &path))?;
        let target =
            host_fs::open_beneath(dir, Path::new(SHARED), OFlags::PATH | OFlags::DIRECTORY)
                .map_err(io_err("opening", &path))?;
        host_fs::attach(tmpfs.as_fd(), target.as_fd())
            .map_err(io_err("mounting the skeleton tmpfs on", &path))?;
        let made = Self::finish(dir, &path);
        if made.is_err() {
            if let Err(e) = host_fs::unmount_beneath(dir, Path::new(SHARED)) {
                log::warn!("unmounting {} after a failed setup: {e}", path.display());
            }
        }
        made
    }

    /// The steps after the tmpfs is mounted: private, cloned writable, then read-only.
    fn finish(state_dir: std::os::fd::BorrowedFd<'_>, path: &Path) -> Result<PodShare, ShareError> {
        let export = host_fs::open_beneath(
            state_dir,
            Path::new(SHARED),
            OFlags::PATH | OFlags::DIRECTORY,
        )
        .map_err(io_err("opening", path))?;
        if !host_fs::is_mount_root(export.as_fd()).map_err(io_err("checking", path))? {
            return Err(ShareError::Io {
                what: "checking",
                path: path.to_path_buf(),
                source: io::Error::other("the skeleton tmpfs is not mounted there"),
            });
        }
        // Private first: out of the peer group of its parent (on a host whose root is a
        // shared mount, the new mount joined it), so nothing mounted elsewhere on the host
        // reaches the share and nothing mounted under it spreads to the host's other mounts.
        host_fs::set_mount_attrs(
            export.as_fd(),
            MountAttrFlags::empty(),
            Some(Propagation::Private),
            false,
        )
        .map_err(io_err("making private", path))?;
        // The writable clone stays private: nothing mounted under the export reaches it.
        let writable = host_fs::clone_mount(export.as_fd())
            .map_err(io_err("cloning the skeleton of", path))?;
        // Then shared, this mount only: a peer group of its own, with no peer yet. A VMM
        // process's copy of it (made a slave in its own mount namespace and mounted in its
        // root: vmm::jail::split) gets what the shim mounts under it later (containers' files)
        // and their unmounts; and a mount namespace made on the host while the pod lives (and
        // made a slave, as systemd's services are) loses the pod's mounts when the shim
        // unmounts them, so it never pins them (docs/security.md, "The share in the VMM
        // process").
        host_fs::set_mount_attrs(
            export.as_fd(),
            MountAttrFlags::empty(),
            Some(Propagation::Shared),
            false,
        )
        .map_err(io_err("making shared", path))?;
        host_fs::set_mount_attrs(
            export.as_fd(),
            MountAttrFlags::MOUNT_ATTR_RDONLY,
            None,
            false,
        )
        .map_err(io_err("making read-only", path))?;
        Ok(PodShare {
            path: path.to_path_buf(),
            export,
            writable,
            volumes: Mutex::new(HashMap::new()),
        })
    }

    /// The host directory the VM exports.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mounts container `cid`'s rootfs and bind sources into the share. With no rootfs mounts
    /// (the bundle's `rootfs` is already the root), `bundle_rootfs` is bind-mounted. On error
    /// what was made is undone.
    pub fn share_container(
        &self,
        cid: &str,
        rootfs: &[RootfsMount],
        bundle_rootfs: &Path,
        binds: &[ShareBind],
    ) -> Result<(), ShareError> {
        let result = self.share_inner(cid, rootfs, bundle_rootfs, binds);
        if result.is_err() {
            if let Err(e) = self.unshare_container(cid) {
                log::warn!("undoing the share of container {cid}: {e}");
            }
        }
        result
    }

    fn share_inner(
        &self,
        cid: &str,
        rootfs: &[RootfsMount],
        bundle_rootfs: &Path,
        binds: &[ShareBind],
    ) -> Result<(), ShareError> {
        let cid_dir = container_folder(cid)?;
        // Check every bind's place before anything is made.
        let places = binds
            .iter()
            .map(|b| place_of(cid, b))
            .collect::<Result<Vec<_>, _>>()?;
        let rw = self.writable.as_fd();
        let rootfs_rel = cid_dir.join("rootfs");
        let mounts_rel = cid_dir.join("mounts");
        for d in [&cid_dir, &rootfs_rel, &mounts_rel] {
            host_fs::mkdir_beneath(rw, d, 0o755).map_err(io_err("creating", self.path.join(d)))?;
        }
        let target = self.open_export_dir(&rootfs_rel)?;
        if rootfs.is_empty() {
            let tree = host_fs::clone_tree(bundle_rootfs)
                .map_err(io_err("opening the bundle rootfs", bundle_rootfs))?;
            self.attach_bind(tree, &target, &rootfs_rel, false, false)?;
        }
        for m in rootfs {
            let source = (!m.source.is_empty()).then_some(m.source.as_str());
            // nosuid, nodev: nothing in the image or written by the guest is a setuid program
            // or a device on the host. The target is the descriptor opened above, named by its
            // own /proc/self/fd link, so the mount lands exactly there.
            let mut options = m.options.clone();
            options.extend(["nosuid".to_string(), "nodev".to_string()]);
            containerd_shim::mount::mount_rootfs(
                Some(&m.fs_type),
                source,
                &options,
                host_fs::fd_path(target.as_fd()),
            )
            .map_err(|e| ShareError::Rootfs {
                path: self.path.join(&rootfs_rel),
                message: format!("{} mount of {}: {e}", m.fs_type, m.source),
            })?;
        }
        for (b, place) in binds.iter().zip(places) {
            match place {
                Place::Own(n) => self.bind(b, &mounts_rel.join(n))?,
                Place::Volume(key) => self.use_volume(cid, &key, b)?,
            }
        }
        Ok(())
    }

    /// Bind-mounts `b`'s host source at `rel` (made for it: a directory or a file, as the
    /// source is).
    fn bind(&self, b: &ShareBind, rel: &Path) -> Result<(), ShareError> {
        let tree = host_fs::clone_tree(&b.host_source)
            .map_err(io_err("opening the bind source", &b.host_source))?;
        let is_dir = fstat(&tree)
            .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)
            .map_err(|e| io_err("inspecting the bind source", &b.host_source)(e.into()))?;
        let rw = self.writable.as_fd();
        let host = self.path.join(rel);
        if is_dir {
            host_fs::mkdir_beneath(rw, rel, 0o755).map_err(io_err("creating", &host))?;
        } else {
            host_fs::create_file_beneath(rw, rel, 0o444).map_err(io_err("creating", &host))?;
        }
        let target = host_fs::open_beneath(self.export.as_fd(), rel, OFlags::PATH)
            .map_err(io_err("opening", &host))?;
        self.attach_bind(tree, &target, rel, b.readonly, b.from_host)
    }

    fn lock_volumes(&self) -> MutexGuard<'_, HashMap<OsString, HashSet<String>>> {
        self.volumes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Container `cid` uses the volume of `key`: shared from `b`'s source when it is the
    /// first. On error the place made for it is removed again.
    fn use_volume(&self, cid: &str, key: &OsStr, b: &ShareBind) -> Result<(), ShareError> {
        let mut volumes = self.lock_volumes();
        if let Some(users) = volumes.get_mut(key) {
            users.insert(cid.to_string());
            return Ok(());
        }
        let rw = self.writable.as_fd();
        host_fs::mkdir_beneath(rw, Path::new(VOLUMES), 0o755)
            .map_err(io_err("creating", self.path.join(VOLUMES)))?;
        let rel = Path::new(VOLUMES).join(key);
        if let Err(e) = self.bind(b, &rel) {
            self.drop_volume(&rel);
            return Err(e);
        }
        volumes.insert(key.to_os_string(), HashSet::from([cid.to_string()]));
        Ok(())
    }

    /// Container `cid` no longer uses its volumes: those nobody uses any more are unmounted
    /// and their places removed.
    fn release_volumes(&self, cid: &str) {
        self.lock_volumes().retain(|key, users| {
            users.remove(cid);
            if !users.is_empty() {
                return true;
            }
            self.drop_volume(&Path::new(VOLUMES).join(key));
            false
        });
    }

    /// Unmounts the volume shared at `rel` and removes its place (what there is of them).
    fn drop_volume(&self, rel: &Path) {
        let host = self.path.join(rel);
        if let Err(e) = host_fs::unmount_beneath(self.export.as_fd(), rel) {
            log::warn!("unmounting {}: {e}", host.display());
        } else if let Err(e) = host_fs::remove_tree_beneath(self.writable.as_fd(), rel) {
            log::warn!("removing {}: {e}", host.display());
        }
    }

    /// Opens directory `rel` of the exported mount, as a mount target.
    fn open_export_dir(&self, rel: &Path) -> Result<OwnedFd, ShareError> {
        host_fs::open_beneath(self.export.as_fd(), rel, OFlags::PATH | OFlags::DIRECTORY)
            .map_err(io_err("opening", self.path.join(rel)))
    }

    /// Gives a cloned tree its flags (nosuid, nodev, read-only if asked, recursively) and
    /// propagation (private, or slave of the host source: mounts made later under a shared
    /// source on the host appear in the share, hence in the guest, while nothing mounted under
    /// the share goes back: HostToContainer and Bidirectional volumes), then attaches it.
    fn attach_bind(
        &self,
        tree: OwnedFd,
        target: &OwnedFd,
        rel: &Path,
        readonly: bool,
        from_host: bool,
    ) -> Result<(), ShareError> {
        let host = self.path.join(rel);
        let mut attrs = MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV;
        if readonly {
            attrs |= MountAttrFlags::MOUNT_ATTR_RDONLY;
        }
        let propagation = if from_host {
            Propagation::Slave
        } else {
            Propagation::Private
        };
        host_fs::set_mount_attrs(tree.as_fd(), attrs, Some(propagation), true)
            .map_err(io_err("setting the flags of the bind for", &host))?;
        host_fs::attach(tree.as_fd(), target.as_fd()).map_err(io_err("bind-mounting onto", &host))
    }

    /// Unmounts everything of container `cid` in the share and removes its folder, and the
    /// volumes only it still used. Harmless if nothing is there.
    pub fn unshare_container(&self, cid: &str) -> Result<(), ShareError> {
        let cid_dir = container_folder(cid)?;
        self.release_volumes(cid);
        let rw = self.writable.as_fd();
        let mounts_rel = cid_dir.join("mounts");
        let names: Vec<OsString> = match host_fs::list_beneath(rw, &mounts_rel) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_err("listing", self.path.join(&mounts_rel))(e)),
        };
        for name in names {
            let rel = mounts_rel.join(name);
            host_fs::unmount_beneath(self.export.as_fd(), &rel)
                .map_err(io_err("unmounting", self.path.join(&rel)))?;
        }
        let rootfs_rel = cid_dir.join("rootfs");
        host_fs::unmount_beneath(self.export.as_fd(), &rootfs_rel)
            .map_err(io_err("unmounting", self.path.join(&rootfs_rel)))?;
        host_fs::remove_tree_beneath(rw, &cid_dir)
            .map_err(io_err("removing", self.path.join(&cid_dir)))
    }
}

/// Container `cid`'s folder in the share: one plain name, not [`VOLUMES`].
fn container_folder(cid: &str) -> Result<PathBuf, ShareError> {
    let plain = !cid.is_empty()
        && cid != VOLUMES
        && !cid.contains('\0')
        && matches!(
            Path::new(cid).components().collect::<Vec<_>>().as_slice(),
            [Component::Normal(_)]
        );
    if plain {
        Ok(PathBuf::from(cid))
    } else {
        Err(ShareError::BadId(cid.to_string()))
    }
}

/// Where bind `b` of container `cid` goes: [`VOLUMES`]`/<key>` (a hex key) for a bind with
/// propagation, `<cid>/mounts/<n>` for any other.
fn place_of(cid: &str, b: &ShareBind) -> Result<Place, ShareError> {
    if !b.from_host {
        return bind_place(cid, &b.relative).map(Place::Own);
    }
    let c: Vec<Component<'_>> = b.relative.components().collect();
    match c.as_slice() {
        [Component::Normal(v), Component::Normal(key)]
            if *v == VOLUMES
                && (1..=VOLUME_KEY_MAX).contains(&key.len())
                && key.as_encoded_bytes().iter().all(u8::is_ascii_hexdigit) =>
        {
            Ok(Place::Volume(key.to_os_string()))
        }
        _ => Err(ShareError::BadBind(b.relative.clone())),
    }
}

/// The `<n>` of a bind's place `<cid>/mounts/<n>`.
fn bind_place(cid: &str, relative: &Path) -> Result<OsString, ShareError> {
    let c: Vec<Component<'_>> = relative.components().collect();
    match c.as_slice() {
        [Component::Normal(id), Component::Normal(m), Component::Normal(n)]
            if *id == cid && *m == "mounts" =>
        {
            Ok(n.to_os_string())
        }
        _ => Err(ShareError::BadBind(relative.to_path_buf())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::mounts_under;
    use std::fs;

    use testkit::require_root;

    /// The mount options /proc/self/mountinfo shows for mount point `at`.
    fn mount_options(at: &Path) -> String {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        info.lines()
            .filter(|l| l.split(' ').nth(4) == Some(at.to_str().unwrap()))
            .filter_map(|l| l.split(' ').nth(5))
            .next_back()
            .unwrap_or_default()
            .to_string()
    }

    struct Pod {
        _tmp: tempfile::TempDir,
        state: StateDir,
        share: PodShare,
    }

    fn pod() -> Pod {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path(), "pod").unwrap();
        state.create(std::process::id()).unwrap();
        let share = PodShare::create(&state).unwrap();
        Pod {
            _tmp: tmp,
            state,
            share,
        }
    }

    #[test]
    fn the_skeleton_is_read_only_to_everyone_but_the_shim_and_bounded() {
        let p = pod();
        let shared = p.state.shared_dir();
        assert_eq!(p.share.path(), shared);
        let opts = mount_options(&shared);
        for o in ["ro", "nosuid", "nodev", "noexec"] {
            assert!(opts.split(',').any(|x| x == o), "{o} in {opts}");
        }
        // Whoever reaches the share by its path (the VM's file server does) cannot write it.
        let err = fs::create_dir(shared.join("c9")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        assert!(std::os::unix::fs::symlink("/etc", shared.join("c9")).is_err());
        assert!(fs::write(shared.join("fill"), vec![0u8; 4096]).is_err());
        p.state.cleanup().unwrap();
    }

    /// The optional fields (`shared:N`, `master:N`) mountinfo shows for mount point `at`.
    fn propagation_of(at: &Path) -> Vec<String> {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = info
            .lines()
            .rfind(|l| l.split(' ').nth(4) == Some(at.to_str().unwrap()))
            .unwrap_or_default()
            .to_string();
        line.split(' ')
            .skip(6)
            .take_while(|f| *f != "-")
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_share_is_a_peer_group_of_its_own_and_its_later_mounts_reach_a_copy_of_it() {
        let tmp = tempfile::tempdir().unwrap();
        // A parent that is itself shared (as / and /run are on a systemd host): the share
        // leaves its group.
        rustix::mount::mount_bind(tmp.path(), tmp.path()).unwrap();
        rustix::mount::mount_change(tmp.path(), rustix::mount::MountPropagationFlags::SHARED)
            .unwrap();
        let parent = propagation_of(tmp.path());
        let state = StateDir::new(tmp.path(), "pod").unwrap();
        state.create(std::process::id()).unwrap();
        let share = PodShare::create(&state).unwrap();
        let own = propagation_of(share.path());
        assert_eq!(own.len(), 1, "{own:?}");
        assert!(own[0].starts_with("shared:"), "{own:?}");
        assert!(
            !parent.contains(&own[0]),
            "{own:?} is its parent's {parent:?}"
        );
        // A copy taken now and made a slave (as a VMM process takes its own and mounts it in
        // its root) gets the mounts made later. (A detached copy, in no namespace, would not.)
        let copy_at = tempfile::tempdir().unwrap();
        let copy_tree = host_fs::clone_tree(share.path()).unwrap();
        host_fs::set_mount_attrs(
            copy_tree.as_fd(),
            MountAttrFlags::empty(),
            Some(Propagation::Slave),
            true,
        )
        .unwrap();
        let copy_target = host_fs::open_root_dir(copy_at.path()).unwrap();
        host_fs::attach(copy_tree.as_fd(), copy_target.as_fd()).unwrap();
        let copy = host_fs::open_root_dir(copy_at.path()).unwrap();
        assert!(propagation_of(copy_at.path())[0].starts_with("master:"));
        share
            .share_container(
                "c1",
                &[RootfsMount {
                    fs_type: "tmpfs".into(),
                    source: "tmpfs".into(),
                    options: vec!["size=64k".into()],
                }],
                Path::new("/nonexistent"),
                &[],
            )
            .unwrap();
        fs::write(share.path().join("c1/rootfs/f"), "x").unwrap();
        let seen = host_fs::open_beneath(copy.as_fd(), Path::new("c1/rootfs/f"), OFlags::RDONLY);
        assert!(seen.is_ok(), "the rootfs did not reach the copy: {seen:?}");
        drop(seen);
        share.unshare_container("c1").unwrap();
        let gone = host_fs::open_beneath(copy.as_fd(), Path::new("c1/rootfs/f"), OFlags::RDONLY);
        assert!(gone.is_err(), "the unmount did not reach the copy");
        drop(copy);
        rustix::mount::unmount(copy_at.path(), rustix::mount::UnmountFlags::DETACH).unwrap();
        drop(share);
        state.cleanup().unwrap();
        rustix::mount::unmount(tmp.path(), rustix::mount::UnmountFlags::DETACH).unwrap();
    }

    #[test]
    fn shares_an_overlay_rootfs_and_binds_then_unshares() {
        let p = pod();
        let tmp = tempfile::tempdir().unwrap();
        let layers = tmp.path().join("layers");
        let (lower, upper, work) = (layers.join("l"), layers.join("u"), layers.join("w"));
        for d in [&lower, &upper, &work] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(lower.join("hello"), "from the image").unwrap();
        let hosts = tmp.path().join("hosts");
        fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
        let vol = tmp.path().join("vol");
        fs::create_dir_all(&vol).unwrap();
        fs::write(vol.join("data"), "volume").unwrap();
        // A read-only volume with a mount under it: read-only all the way down.
        let ro_vol = tmp.path().join("ro-vol");
        fs::create_dir_all(ro_vol.join("sub")).unwrap();
        let sub_src = tmp.path().join("sub-src");
        fs::create_dir_all(&sub_src).unwrap();
        let sub = host_fs::clone_tree(&sub_src).unwrap();
        let sub_target = host_fs::open_root_dir(&ro_vol.join("sub")).unwrap();
        host_fs::attach(sub.as_fd(), sub_target.as_fd()).unwrap();
        let rootfs = [RootfsMount {
            fs_type: "overlay".into(),
            source: "overlay".into(),
            options: vec![
                format!("lowerdir={}", lower.display()),
                format!("upperdir={}", upper.display()),
                format!("workdir={}", work.display()),
            ],
        }];
        let bind = |src: &Path, n: u32, readonly: bool| ShareBind {
            host_source: src.to_path_buf(),
            relative: format!("c1/mounts/{n}").into(),
            readonly,
            from_host: false,
        };
        let binds = [
            bind(&hosts, 1, true),
            bind(&vol, 2, false),
            bind(&ro_vol, 3, true),
        ];
        p.share
            .share_container("c1", &rootfs, Path::new("/nonexistent"), &binds)
            .unwrap();
        let shared = p.state.shared_dir();
        let root = shared.join("c1/rootfs");
        assert_eq!(
            fs::read_to_string(root.join("hello")).unwrap(),
            "from the image"
        );
        fs::write(root.join("new"), "guest write").unwrap();
        assert!(upper.join("new").exists(), "the rootfs is writable");
        for o in ["nosuid", "nodev"] {
            assert!(mount_options(&root).split(',').any(|x| x == o), "{o}");
            assert!(
                mount_options(&shared.join("c1/mounts/2"))
                    .split(',')
                    .any(|x| x == o),
                "{o}"
            );
        }
        assert_eq!(
            fs::read_to_string(shared.join("c1/mounts/1")).unwrap(),
            "127.0.0.1 localhost\n"
        );
        assert!(
            fs::write(shared.join("c1/mounts/1"), "x").is_err(),
            "read-only bind"
        );
        fs::write(shared.join("c1/mounts/2/new"), "w").unwrap();
        assert!(vol.join("new").exists());
        assert!(
            fs::write(shared.join("c1/mounts/3/sub/x"), "w").is_err(),
            "a read-only volume's submounts are read-only too"
        );
        assert!(
            fs::create_dir(shared.join("c1/mounts/9")).is_err(),
            "the skeleton is read-only"
        );
        assert_eq!(mounts_under(&shared.join("c1")).len(), 5);

        p.share.unshare_container("c1").unwrap();
        assert!(mounts_under(&shared.join("c1")).is_empty());
        assert!(!shared.join("c1").exists());
        assert!(lower.join("hello").exists() && hosts.exists() && vol.join("new").exists());
        p.share.unshare_container("c1").unwrap();
        host_fs::unmount_beneath(
            host_fs::open_root_dir(tmp.path()).unwrap().as_fd(),
            Path::new("ro-vol/sub"),
        )
        .unwrap();
        p.state.cleanup().unwrap();
        assert!(mounts_under(p.state.path()).is_empty());
    }

    /// A volume with propagation is the pod's, shared once at `.volumes/<key>` while any of its
    /// containers uses it: it stays when the first container goes, and a mount the host makes
    /// under the source later still reaches it.
    #[test]
    fn a_volume_with_propagation_is_shared_once_until_its_last_container_goes() {
        let p = pod();
        let tmp = tempfile::tempdir().unwrap();
        let vol = tmp.path().join("vol");
        fs::create_dir_all(vol.join("later")).unwrap();
        // The source on a shared mount, as containerd wants it.
        rustix::mount::mount_bind(&vol, &vol).unwrap();
        rustix::mount::mount_change(&vol, rustix::mount::MountPropagationFlags::SHARED).unwrap();
        let image = tmp.path().join("image");
        fs::create_dir_all(&image).unwrap();
        let key = "00ff";
        let bind = ShareBind {
            host_source: vol.clone(),
            relative: volume_relative(key),
            readonly: false,
            from_host: true,
        };
        for cid in ["c1", "c2"] {
            p.share
                .share_container(cid, &[], &image, std::slice::from_ref(&bind))
                .unwrap();
        }
        let shared = p.state.shared_dir();
        let at = shared.join(VOLUMES).join(key);
        assert_eq!(mounts_under(&at).len(), 1, "one share for both");
        assert!(mounts_under(&shared.join("c1/mounts")).is_empty());
        p.share.unshare_container("c1").unwrap();
        assert!(!shared.join("c1").exists());
        // c2 still uses it: in place, and the host's later mounts reach it.
        let later = rustix::mount::fsopen("tmpfs", rustix::mount::FsOpenFlags::empty()).unwrap();
        rustix::mount::fsconfig_create(later.as_fd()).unwrap();
        let later = rustix::mount::fsmount(
            later.as_fd(),
            rustix::mount::FsMountFlags::empty(),
            MountAttrFlags::empty(),
        )
        .unwrap();
        let later_at = host_fs::open_root_dir(&vol.join("later")).unwrap();
        host_fs::attach(later.as_fd(), later_at.as_fd()).unwrap();
        fs::write(vol.join("later/f"), "later").unwrap();
        assert_eq!(fs::read_to_string(at.join("later/f")).unwrap(), "later");
        p.share.unshare_container("c2").unwrap();
        assert!(mounts_under(&shared.join(VOLUMES)).is_empty());
        assert!(!at.exists());
        p.state.cleanup().unwrap();
        rustix::mount::unmount(&vol, rustix::mount::UnmountFlags::DETACH).unwrap();
    }

    #[test]
    fn a_failed_share_undoes_what_it_mounted() {
        let p = pod();
        let tmp = tempfile::tempdir().unwrap();
        let image = tmp.path().join("image");
        fs::create_dir_all(&image).unwrap();
        let binds = [ShareBind {
            host_source: tmp.path().join("missing"),
            relative: "c2/mounts/0".into(),
            readonly: false,
            from_host: false,
        }];
        let err = p
            .share
            .share_container("c2", &[], &image, &binds)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        let shared = p.state.shared_dir();
        assert!(mounts_under(&shared.join("c2")).is_empty());
        assert!(!shared.join("c2").exists());
        p.state.cleanup().unwrap();
    }

    #[test]
    fn ids_and_bind_places_that_could_leave_the_container_folder_are_refused() {
        for bad in ["", ".", "..", "a/b", "/x", "a\0b", VOLUMES] {
            assert!(container_folder(bad).is_err(), "{bad:?}");
        }
        let volume = |relative: &str| ShareBind {
            host_source: "/srv/vol".into(),
            relative: relative.into(),
            readonly: false,
            from_host: true,
        };
        assert!(matches!(
            place_of("c1", &volume(".volumes/00ff")),
            Ok(Place::Volume(_))
        ));
        for bad in [
            ".volumes/xyz",
            ".volumes/",
            ".volumes/00/ff",
            ".volumes/../c2",
            "c1/mounts/0",
            "other/00ff",
        ] {
            assert!(place_of("c1", &volume(bad)).is_err(), "{bad}");
        }
        assert!(bind_place("c1", Path::new("c1/mounts/0")).is_ok());
        for bad in [
            "c2/mounts/0",
            "c1/rootfs/0",
            "c1/mounts/../x",
            "c1/mounts",
            "/c1/mounts/0",
        ] {
            assert!(bind_place("c1", Path::new(bad)).is_err(), "{bad}");
        }
        let p = pod();
        let binds = [ShareBind {
            host_source: "/etc".into(),
            relative: "c1/../../x".into(),
            readonly: true,
            from_host: false,
        }];
        assert!(p
            .share
            .share_container("c1", &[], Path::new("/nonexistent"), &binds)
            .is_err());
        p.state.cleanup().unwrap();
    }
}
