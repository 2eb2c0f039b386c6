//! Devices a pod's containers get from device plugins (docs/devices.md).
//!
//! - At boot ([`cold_plug`], in `cold_plug.rs`): kubelet's PodResources API ([`podresources`]) says which devices
//!   the pod holds; CDI specs ([`cdi`]) or a PCI address with an IOMMU group turn each into host
//!   nodes. Block nodes become the VM's cold-plugged virtio-blk disks, VFIO groups the VM's PCI
//!   devices. Empty virtio-blk slots are reserved beside them for hot-plug.
//! - At CreateContainer ([`DeviceTable::prepare`]): each `linux.devices` entry of the spec
//!   ([`oci`]) is placed: a block device on its cold disk or in a free slot of its read-only mode
//!   (its host node from `/sys/dev/block`, [`host`]), a guest-own character device as it is, a
//!   VFIO node dropped (the device is the VM's), anything else refused naming the device.
//!   The guest agent gets `container path -> disk serial` and makes the node from the guest's
//!   own numbers. A privileged container's spec lists the host's whole `/dev`: of it only the
//!   pod's disks and the guest's own character devices stay, nothing is refused
//!   ([`DeviceTable::prepare`]'s privileged branch), and the agent gives it the guest's devices.
//! - Which slot holds which container's device is recorded in the state directory
//!   (`devices.json`) after every change; the disks' host files are only fds of this process,
//!   so nothing on the host outlives it.

pub mod cdi;
mod cold_plug;
pub mod host;
pub mod oci;
pub mod podresources;

pub use cold_plug::{cold_plug, ColdDisk, ColdPlug};

use std::fs::File;
use std::path::PathBuf;
use std::sync::Mutex;

use serde::Serialize;

use crate::oci::Spec;
use oci::{Access, DeviceClass, NodeKind, SpecDevice};

/// The sandbox annotations that name the pod for the PodResources API.
pub const POD_NAME_ANNOTATION: &str = "io.kubernetes.cri.sandbox-name";
pub const POD_NAMESPACE_ANNOTATION: &str = "io.kubernetes.cri.sandbox-namespace";

/// The record's file name in the pod's state directory (the state directory names its files).
pub use crate::state::DEVICES_RECORD_FILE as RECORD_FILE;

/// Why a device could not be given; the message is what the CRI user reads.
#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    #[error("OCI spec: {0}")]
    Spec(String),
    #[error("device {device} cannot be given to a container in a microVM: {why}")]
    Refused { device: String, why: String },
    #[error("{what}: {}: {source}", path.display())]
    HostNode {
        what: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {why}")]
    NoHostNode { what: String, why: String },
    #[error("CDI: {0}")]
    Cdi(String),
    #[error("kubelet's PodResources API on {}: {detail}", socket.display())]
    PodResources { socket: PathBuf, detail: String },
    #[error(
        "device {device}: all {count} {mode} block slots of this pod's VM are in use \
         (devices.block_slots{key} in the microvm config)"
    )]
    SlotsFull {
        device: String,
        mode: &'static str,
        key: &'static str,
        count: usize,
    },
    #[error(
        "device {device} was not among the pod's devices at boot (kubelet's PodResources API) \
         and the {backend} backend cannot hot-plug block devices"
    )]
    NoHotplug {
        device: String,
        backend: &'static str,
    },
    #[error("device {device}: attaching it to the VM: {detail}")]
    Attach { device: String, detail: String },
    #[error("VFIO device {0}")]
    Vfio(String),
    #[error("recording the pod's devices: {0}")]
    Record(#[from] crate::state::RecordError),
}

impl DevicesError {
    /// Whether the request itself cannot be served (as opposed to the host failing).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            DevicesError::Spec(_)
                | DevicesError::Refused { .. }
                | DevicesError::SlotsFull { .. }
                | DevicesError::NoHotplug { .. }
        )
    }
}

/// Whether empty slots can be filled while the VM runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hotplug {
    Supported,
    /// This backend cannot (its name, for the error).
    Unsupported(&'static str),
}

/// A virtio-blk disk of the VM as the guest spec lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskLayout {
    /// A cold-plugged disk: `cold[i]` of the [`ColdPlug`].
    Cold { serial: String, cold: usize },
    /// An empty slot.
    Empty { serial: String, read_only: bool },
}

/// The VM's disks: the cold ones, then `rw` read-write and `ro` read-only empty slots.
pub fn disk_layout(cold: &ColdPlug, rw: usize, ro: usize) -> Vec<DiskLayout> {
    let mut out: Vec<DiskLayout> = (0..cold.disks.len())
        .map(|i| DiskLayout::Cold {
            serial: format!("microvm-cold{i}"),
            cold: i,
        })
        .collect();
    for i in 0..rw + ro {
        out.push(DiskLayout::Empty {
            serial: format!("microvm-slot{i}"),
            read_only: i >= rw,
        });
    }
    out
}

/// How a container reaches a disk in the guest: the agent makes `container_path` from the disk
/// whose serial is `serial`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestBlock {
    pub container_path: String,
    pub serial: String,
    pub read_only: bool,
}

/// A slot to fill before the container is created.
#[derive(Debug)]
pub struct Attach {
    pub index: usize,
    pub serial: String,
    pub file: File,
    pub device: String,
}

/// What a container's devices need: the guest's mapping, the slots to fill, the spec entries
/// to drop (VFIO nodes).
#[derive(Debug, Default)]
pub struct Prepared {
    pub blocks: Vec<GuestBlock>,
    pub attach: Vec<Attach>,
    pub removed: Vec<SpecDevice>,
}

#[derive(Debug, Clone, Serialize)]
struct ColdEntry {
    index: usize,
    serial: String,
    host: PathBuf,
    rdev: (u32, u32),
    read_only: bool,
}

#[derive(Debug, Clone, Serialize)]
struct Holder {
    serial: String,
    host: PathBuf,
    rdev: (u32, u32),
    containers: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct Slot {
    index: usize,
    read_only: bool,
    holder: Option<Holder>,
}

#[derive(Debug, Serialize)]
struct Table {
    cold: Vec<ColdEntry>,
    slots: Vec<Slot>,
    vfio: Vec<PathBuf>,
    #[serde(skip)]
    generation: u64,
}

/// The pod's disks and who holds them.
#[derive(Debug)]
pub struct DeviceTable {
    record: PathBuf,
    hotplug: Hotplug,
    sysfs: PathBuf,
    table: Mutex<Table>,
}

impl DeviceTable {
    /// The table of a VM booted with `layout` (of `cold`) and `vfio`; writes its first record.
    pub fn new(
        record: PathBuf,
        hotplug: Hotplug,
        layout: &[DiskLayout],
        cold: &ColdPlug,
        vfio: Vec<PathBuf>,
    ) -> Result<DeviceTable, DevicesError> {
        let mut t = Table {
            cold: Vec::new(),
            slots: Vec::new(),
            vfio,
            generation: 0,
        };
        for (index, d) in layout.iter().enumerate() {
            match d {
                DiskLayout::Cold { serial, cold: i } => {
                    if let Some(c) = cold.disks.get(*i) {
                        t.cold.push(ColdEntry {
                            index,
                            serial: serial.clone(),
                            host: c.host.clone(),
                            rdev: c.rdev,
                            read_only: c.access == Access::ReadOnly,
                        });
                    }
                }
                DiskLayout::Empty { read_only, .. } => t.slots.push(Slot {
                    index,
                    read_only: *read_only,
                    holder: None,
                }),
            }
        }
        let table = DeviceTable {
            record,
            hotplug,
            sysfs: PathBuf::from("/sys"),
            table: Mutex::new(t),
        };
        table.write(&table.lock())?;
        Ok(table)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, t: &Table) -> Result<(), DevicesError> {
        Ok(crate::state::write_record(&self.record, t)?)
    }

    /// Places container `cid`'s devices (module doc). Slots it takes are reserved for it now:
    /// on any later failure [`DeviceTable::release`] gives them back.
    pub fn prepare(&self, cid: &str, spec: &Spec) -> Result<Prepared, DevicesError> {
        let devices = oci::spec_devices(spec)?;
        if oci::is_privileged(spec) {
            return self.prepare_privileged(cid, devices);
        }
        let mut t = self.lock();
        let has_vfio = !t.vfio.is_empty();
        let mut out = Prepared::default();
        let result = (|| {
            for d in devices {
                match oci::classify(&d, has_vfio)? {
                    DeviceClass::GuestOwn(name) => {
                        log::debug!("container {cid}: {d} is the guest's own {name}");
                    }
                    DeviceClass::Vfio => out.removed.push(d),
                    DeviceClass::Block => {
                        let block = self.place_block(&mut t, cid, &d, &mut out.attach)?;
                        out.blocks.push(block);
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            release_in(&mut t, cid);
            return Err(e);
        }
        self.write(&t)?;
        Ok(out)
    }

    /// A privileged container's devices ([`oci::is_privileged`]). containerd lists the host's
    /// whole `/dev` after the devices CRI asked for, and which entry came from where cannot be
    /// told from the spec alone; so only what the pod holds reaches the VM: a block device that
    /// is one of the pod's disks (cold-plugged at boot from kubelet's PodResources API, or in a
    /// slot another container of the pod filled) goes to the container at the entry's path, a
    /// character device the guest has itself stays; every other entry (the host's disks,
    /// `/dev/kvm`, `/dev/mem`, VFIO nodes, ...) leaves the spec, and nothing is refused. The
    /// first entry at a path wins (CRI's come first). In the guest the container gets every
    /// device of the guest besides (the agent walks the guest's `/dev`).
    fn prepare_privileged(
        &self,
        cid: &str,
        devices: Vec<SpecDevice>,
    ) -> Result<Prepared, DevicesError> {
        let mut t = self.lock();
        let mut out = Prepared::default();
        let mut paths = std::collections::HashSet::new();
        let total = devices.len();
        for d in devices {
            let first_at_path = paths.insert(d.path.clone());
            let keep = first_at_path
                && !oci::is_vfio(&d)
                && match d.kind {
                    NodeKind::Char => oci::guest_own_char(&d).is_some(),
                    NodeKind::Block => match pod_disk(&mut t, cid, &d) {
                        Some(block) => {
                            out.blocks.push(block);
                            true
                        }
                        None => false,
                    },
                };
            if keep {
                log::debug!("container {cid} (privileged): {d} stays");
            } else {
                log::debug!("container {cid} (privileged): {d} is not the pod's: left out");
                out.removed.push(d);
            }
        }
        log::info!(
            "container {cid} is privileged: {} of the {total} devices of its spec are the \
             pod's disks or the guest's own and stay, the {} others (the host's) are left out; \
             the guest's devices are given in the VM",
            total - out.removed.len(),
            out.removed.len()
        );
        self.write(&t)?;
        Ok(out)
    }

    fn place_block(
        &self,
        t: &mut Table,
        cid: &str,
        d: &SpecDevice,
        attach: &mut Vec<Attach>,
    ) -> Result<GuestBlock, DevicesError> {
        debug_assert_eq!(d.kind, NodeKind::Block);
        let read_only = d.access == Access::ReadOnly;
        let guest = |serial: &str, ro: bool| GuestBlock {
            container_path: d.path.clone(),
            serial: serial.to_string(),
            read_only: read_only || ro,
        };
        if let Some(c) = t.cold.iter().find(|c| c.rdev == (d.major, d.minor)) {
            if c.read_only && !read_only {
                return Err(DevicesError::Refused {
                    device: d.to_string(),
                    why: "the pod's device was cold-plugged read-only (its CDI permissions)".into(),
                });
            }
            return Ok(guest(&c.serial, c.read_only));
        }
        // Already in a slot of this pod (another container holds it): share it.
        for s in &mut t.slots {
            if let Some(h) = &mut s.holder {
                if h.rdev == (d.major, d.minor) && s.read_only == read_only {
                    if !h.containers.iter().any(|c| c == cid) {
                        h.containers.push(cid.to_string());
                    }
                    return Ok(guest(&h.serial, s.read_only));
                }
            }
        }
        if let Hotplug::Unsupported(backend) = self.hotplug {
            return Err(DevicesError::NoHotplug {
                device: d.to_string(),
                backend,
            });
        }
        let count = t.slots.iter().filter(|s| s.read_only == read_only).count();
        let Some(slot) = t
            .slots
            .iter()
            .position(|s| s.read_only == read_only && s.holder.is_none())
        else {
            return Err(DevicesError::SlotsFull {
                device: d.to_string(),
                mode: if read_only { "read-only" } else { "read-write" },
                key: if read_only { "_read_only" } else { "" },
                count,
            });
        };
        let host = host::block_node(&self.sysfs, d.major, d.minor)?;
        let file = host::open(&host, d.access)?;
        t.generation = t.generation.wrapping_add(1);
        let serial = format!("microvm-hp{}", t.generation);
        let s = &mut t.slots[slot];
        s.holder = Some(Holder {
            serial: serial.clone(),
            host,
            rdev: (d.major, d.minor),
            containers: vec![cid.to_string()],
        });
        attach.push(Attach {
            index: s.index,
            serial: serial.clone(),
            file,
            device: d.to_string(),
        });
        Ok(guest(&serial, s.read_only))
    }

    /// Container `cid` no longer holds its devices: the slots nobody holds any more, to empty.
    pub fn release(&self, cid: &str) -> Vec<usize> {
        let mut t = self.lock();
        let freed = release_in(&mut t, cid);
        if let Err(e) = self.write(&t) {
            log::warn!("{e}");
        }
        freed
    }

    /// Whether cold disk `i` of the [`ColdPlug`] is read-only.
    pub fn cold_read_only(&self, i: usize) -> bool {
        self.lock().cold.get(i).is_some_and(|c| c.read_only)
    }

    /// Whether the pod has VFIO devices.
    pub fn has_vfio(&self) -> bool {
        !self.lock().vfio.is_empty()
    }
}

/// The guest disk of block device `d` if it is one of the pod's disks: cold-plugged, or in a
/// slot (then `cid` holds the slot too, until it is released).
fn pod_disk(t: &mut Table, cid: &str, d: &SpecDevice) -> Option<GuestBlock> {
    let wants_ro = d.access == Access::ReadOnly;
    let guest = |serial: &str, ro: bool| GuestBlock {
        container_path: d.path.clone(),
        serial: serial.to_string(),
        read_only: wants_ro || ro,
    };
    if let Some(c) = t.cold.iter().find(|c| c.rdev == (d.major, d.minor)) {
        return Some(guest(&c.serial, c.read_only));
    }
    for s in &mut t.slots {
        let read_only = s.read_only;
        if let Some(h) = &mut s.holder {
            if h.rdev == (d.major, d.minor) {
                if !h.containers.iter().any(|c| c == cid) {
                    h.containers.push(cid.to_string());
                }
                return Some(guest(&h.serial, read_only));
            }
        }
    }
    None
}

fn release_in(t: &mut Table, cid: &str) -> Vec<usize> {
    let mut freed = Vec::new();
    for s in &mut t.slots {
        let Some(h) = &mut s.holder else { continue };
        h.containers.retain(|c| c != cid);
        if h.containers.is_empty() {
            s.holder = None;
            freed.push(s.index);
        }
    }
    freed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::test_json::{json as untyped, spec as typed};
    use serde_json::{json, Value};
    use std::path::Path;

    fn table(dir: &Path, rw: usize, ro: usize, hotplug: Hotplug, sysfs: &Path) -> DeviceTable {
        let cold = ColdPlug::default();
        let layout = disk_layout(&cold, rw, ro);
        let mut t =
            DeviceTable::new(dir.join(RECORD_FILE), hotplug, &layout, &cold, Vec::new()).unwrap();
        t.sysfs = sysfs.to_path_buf();
        t
    }

    /// A spec with one block device and its allow rule.
    fn spec(path: &str, major: u32, minor: u32, access: &str) -> Spec {
        typed(json!({"linux": {
            "devices": [{"path": path, "type": "b", "major": major, "minor": minor}],
            "resources": {"devices": [{"allow": true, "type": "b", "major": major,
                                       "minor": minor, "access": access}]}}}))
    }

    /// The first block device of this host that opens read-only (as root, as CI runs these
    /// tests, there is one: a disk, or an unbound loop device).
    fn host_block() -> (u32, u32) {
        let found = std::fs::read_dir("/sys/dev/block")
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let (ma, mi) = name.split_once(':')?;
                let (ma, mi) = (ma.parse().ok()?, mi.parse().ok()?);
                let node = host::block_node(Path::new("/sys"), ma, mi).ok()?;
                host::open(&node, Access::ReadOnly).ok().map(|_| (ma, mi))
            });
        found.expect("no block device of this host opens read-only: these tests need root")
    }

    #[test]
    fn layout_puts_cold_disks_first_then_slots() {
        let l = disk_layout(&ColdPlug::default(), 2, 1);
        assert_eq!(
            l,
            vec![
                DiskLayout::Empty {
                    serial: "microvm-slot0".into(),
                    read_only: false
                },
                DiskLayout::Empty {
                    serial: "microvm-slot1".into(),
                    read_only: false
                },
                DiskLayout::Empty {
                    serial: "microvm-slot2".into(),
                    read_only: true
                },
            ]
        );
        assert!(l.iter().all(|d| match d {
            DiskLayout::Empty { serial, .. } | DiskLayout::Cold { serial, .. } =>
                serial.len() <= 20,
        }));
    }

    #[test]
    fn refusals_name_the_device_and_leave_nothing_held() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path(), 1, 0, Hotplug::Supported, Path::new("/sys"));
        let s = typed(json!({"linux": {"devices": [
            {"path": "/dev/net/tun", "type": "c", "major": 10, "minor": 200}]}}));
        let e = t.prepare("c1", &s).unwrap_err();
        assert!(e.is_refusal());
        assert!(e.to_string().contains("/dev/net/tun (c 10:200)"), "{e}");
        // No read-only slot at all.
        let e = t
            .prepare("c1", &spec("/dev/xvda", 7, 0, "r"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("all 0 read-only block slots"), "{e}");
        assert!(e.contains("/dev/xvda (b 7:0)"), "{e}");
        let q = table(
            dir.path(),
            1,
            0,
            Hotplug::Unsupported("qemu"),
            Path::new("/sys"),
        );
        let e = q
            .prepare("c1", &spec("/dev/xvda", 7, 0, "rw"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("qemu backend cannot hot-plug"), "{e}");
        let record: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(RECORD_FILE)).unwrap()).unwrap();
        assert!(record["slots"][0]["holder"].is_null(), "{record}");
    }

    #[test]
    fn slots_are_taken_shared_and_given_back() {
        let (ma, mi) = host_block();
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path(), 1, 1, Hotplug::Supported, Path::new("/sys"));
        let p = t.prepare("c1", &spec("/dev/xvda", ma, mi, "r")).unwrap();
        assert_eq!(p.attach.len(), 1);
        assert_eq!(p.attach[0].index, 1, "the read-only slot");
        assert_eq!(
            p.blocks,
            vec![GuestBlock {
                container_path: "/dev/xvda".into(),
                serial: p.attach[0].serial.clone(),
                read_only: true
            }]
        );
        // A second container of the pod shares the slot; no second attach.
        let p2 = t.prepare("c2", &spec("/dev/disk", ma, mi, "r")).unwrap();
        assert!(p2.attach.is_empty());
        assert_eq!(p2.blocks[0].serial, p.attach[0].serial);
        // Full for a third device of the same mode.
        let other = spec("/dev/other", ma, mi.wrapping_add(1000), "r");
        assert!(matches!(
            t.prepare("c3", &other).unwrap_err(),
            DevicesError::SlotsFull { count: 1, .. }
        ));
        assert!(t.release("c1").is_empty(), "c2 still holds it");
        let record = std::fs::read_to_string(dir.path().join(RECORD_FILE)).unwrap();
        assert!(record.contains("\"c2\""), "{record}");
        assert_eq!(t.release("c2"), vec![1]);
        // The slot is free again, with a new serial.
        let p3 = t.prepare("c4", &spec("/dev/xvda", ma, mi, "r")).unwrap();
        assert_eq!(p3.attach[0].index, 1);
        assert_ne!(p3.attach[0].serial, p.attach[0].serial);
    }

    /// A privileged container as containerd writes it: CRI's device (the pod's disk, 7:0, at
    /// /dev/xvda) first, then the host's /dev with that disk again at its host path, the host's
    /// own disk and character devices, VFIO nodes; one rule allowing every device.
    fn privileged(extra: &[Value]) -> Value {
        let mut devices = vec![
            json!({"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0}),
            json!({"path": "/dev/autofs", "type": "c", "major": 10, "minor": 235}),
            json!({"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}),
            json!({"path": "/dev/mem", "type": "c", "major": 1, "minor": 1}),
            json!({"path": "/dev/null", "type": "c", "major": 1, "minor": 3}),
            json!({"path": "/dev/net/tun", "type": "c", "major": 10, "minor": 200}),
            json!({"path": "/dev/loop0", "type": "b", "major": 7, "minor": 0}),
            json!({"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}),
            json!({"path": "/dev/sda1", "type": "b", "major": 8, "minor": 1}),
            json!({"path": "/dev/vfio/vfio", "type": "c", "major": 10, "minor": 196}),
        ];
        devices.extend_from_slice(extra);
        json!({
            "process": {"user": {"uid": 0, "gid": 0}, "cwd": "/",
                        "capabilities": {"bounding": ["CAP_SYS_ADMIN", "CAP_MKNOD"]}},
            "linux": {"devices": devices,
                      "resources": {"devices": [{"allow": true, "access": "rwm"}]}}})
    }

    /// A table whose VM has cold disk 7:0 (read-only if `ro`) and `slots` read-write slots.
    fn with_cold_disk(dir: &Path, ro: bool, slots: usize) -> DeviceTable {
        let cold = ColdPlug {
            disks: vec![ColdDisk {
                host: PathBuf::from("/dev/loop0"),
                rdev: (7, 0),
                access: if ro {
                    Access::ReadOnly
                } else {
                    Access::ReadWrite
                },
                file: File::open("/dev/null").unwrap(),
            }],
            vfio: Vec::new(),
        };
        let layout = disk_layout(&cold, slots, 0);
        DeviceTable::new(
            dir.join(RECORD_FILE),
            Hotplug::Supported,
            &layout,
            &cold,
            Vec::new(),
        )
        .unwrap()
    }

    #[test]
    fn a_privileged_container_keeps_the_pods_disks_and_the_guests_devices_only() {
        let dir = tempfile::tempdir().unwrap();
        let t = with_cold_disk(dir.path(), false, 1);
        let mut spec = typed(privileged(&[]));
        let p = t.prepare("c1", &spec).unwrap();
        // The pod's disk at CRI's path and at the host's path (runc's privileged container has
        // both too), nothing attached.
        assert_eq!(
            p.blocks,
            vec![
                GuestBlock {
                    container_path: "/dev/xvda".into(),
                    serial: "microvm-cold0".into(),
                    read_only: false
                },
                GuestBlock {
                    container_path: "/dev/loop0".into(),
                    serial: "microvm-cold0".into(),
                    read_only: false
                }
            ]
        );
        assert!(p.attach.is_empty());
        oci::remove_devices(&mut spec, &p.removed);
        let spec = untyped(&spec);
        let left: Vec<&str> = spec["linux"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["path"].as_str().unwrap())
            .collect();
        assert_eq!(left, ["/dev/xvda", "/dev/null", "/dev/loop0"]);
        assert_eq!(
            spec["linux"]["resources"]["devices"],
            json!([{"allow": true, "access": "rwm"}]),
            "the allow-all rule stays for the guest"
        );
        assert!(t.release("c1").is_empty());
    }

    #[test]
    fn a_privileged_container_gets_read_only_disks_read_only_and_shares_held_slots() {
        let (ma, mi) = host_block();
        let dir = tempfile::tempdir().unwrap();
        let t = with_cold_disk(dir.path(), true, 1);
        // Another container of the pod holds a hot-plugged disk.
        let held = t.prepare("c0", &spec("/dev/hot", ma, mi, "rwm")).unwrap();
        assert_eq!(held.attach.len(), 1);
        let hot = json!({"path": "/dev/hot", "type": "b", "major": ma, "minor": mi});
        let p = t.prepare("c1", &typed(privileged(&[hot]))).unwrap();
        assert!(
            p.attach.is_empty(),
            "no new slot for a privileged container"
        );
        assert_eq!(p.blocks.len(), 3);
        assert!(p.blocks[..2]
            .iter()
            .all(|b| b.read_only && b.serial == "microvm-cold0"));
        assert_eq!(p.blocks[2].serial, held.attach[0].serial);
        // The slot is emptied only when both have let it go.
        assert!(t.release("c0").is_empty());
        assert_eq!(t.release("c1"), vec![1]);
    }

    #[test]
    fn a_spec_that_is_not_privileged_keeps_the_strict_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let t = with_cold_disk(dir.path(), false, 0);
        // Every device allowed, but without the capabilities of a privileged container.
        let mut spec = privileged(&[]);
        spec["process"]["capabilities"]["bounding"] = json!(["CAP_CHOWN"]);
        let e = t.prepare("c1", &typed(spec)).unwrap_err().to_string();
        assert!(e.contains("/dev/autofs (c 10:235) cannot be given"), "{e}");
    }

    #[test]
    fn vfio_nodes_leave_the_spec_only_with_vfio_devices() {
        let dir = tempfile::tempdir().unwrap();
        let cold = ColdPlug::default();
        let s = typed(json!({"linux": {"devices": [
            {"path": "/dev/vfio/vfio", "type": "c", "major": 10, "minor": 196},
            {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]}}));
        let t = DeviceTable::new(
            dir.path().join(RECORD_FILE),
            Hotplug::Supported,
            &[],
            &cold,
            vec![PathBuf::from("/sys/bus/pci/devices/0000:00:01.0")],
        )
        .unwrap();
        let p = t.prepare("c1", &s).unwrap();
        assert_eq!(p.removed.len(), 1);
        assert!(p.blocks.is_empty());
        let t = table(dir.path(), 0, 0, Hotplug::Supported, Path::new("/sys"));
        assert!(t
            .prepare("c1", &s)
            .unwrap_err()
            .to_string()
            .contains("/dev/vfio/vfio"));
    }
}
