//! What a container's OCI spec asks for: its `linux.devices` with the access the
//! `linux.resources.devices` rules give each, classified by what the VM can do with it
//! ([`DeviceClass`]), whether the container is privileged ([`is_privileged`]), and the spec
//! edits that follow (VFIO nodes, and a privileged container's host devices, leave the
//! container's spec).

use oci_spec::runtime::{Capability, LinuxDeviceCgroup, LinuxDeviceType};

use super::DevicesError;
use crate::oci::Spec;

/// Block or character device (`type` `b`, or `c`/`u`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    Block,
    Char,
}

impl NodeKind {
    fn letter(self) -> &'static str {
        match self {
            NodeKind::Block => "b",
            NodeKind::Char => "c",
        }
    }
}

/// Whether the container may write to a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// One `linux.devices` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecDevice {
    /// Its position in `linux.devices`.
    pub index: usize,
    /// The path in the container.
    pub path: String,
    pub kind: NodeKind,
    pub major: u32,
    pub minor: u32,
    /// From the allow rules (`w` in the access of the rules that match, in order).
    pub access: Access,
}

impl std::fmt::Display for SpecDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} {}:{})",
            self.path,
            self.kind.letter(),
            self.major,
            self.minor
        )
    }
}

/// What the VM does with a device (docs/devices.md has the policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceClass {
    /// A block device: its host node goes to the VM as a virtio-blk disk.
    Block,
    /// A character device the guest kernel has itself (null, zero, fuse, ...): the container
    /// gets the guest's own node, whose numbers are the same Linux-wide fixed ones.
    GuestOwn(&'static str),
    /// `/dev/vfio/*`: the pod's VFIO devices are PCI devices of the VM, cold-plugged at boot;
    /// the node leaves the container's spec.
    Vfio,
}

/// The character devices the guest kernel has, by their fixed numbers (Documentation/
/// admin-guide/devices.txt) and our kernel's config (kernel-config/fragments).
const GUEST_OWN: &[(u32, u32, &str)] = &[
    (1, 3, "null"),
    (1, 5, "zero"),
    (1, 7, "full"),
    (1, 8, "random"),
    (1, 9, "urandom"),
    (5, 0, "tty"),
    (5, 2, "ptmx"),
    (10, 229, "fuse"),
];

/// The first part of the path of VFIO nodes.
const VFIO_DIR: &str = "/dev/vfio/";

/// The devices of `spec`, with their access.
pub fn spec_devices(spec: &Spec) -> Result<Vec<SpecDevice>, DevicesError> {
    let Some(linux) = spec.linux() else {
        return Ok(Vec::new());
    };
    let Some(list) = linux.devices() else {
        return Ok(Vec::new());
    };
    let rules = device_rules(spec);
    list.iter()
        .enumerate()
        .map(|(index, d)| {
            let path = d
                .path()
                .to_str()
                .filter(|p| p.starts_with('/'))
                .ok_or_else(|| {
                    DevicesError::Spec(format!("device without an absolute path: {:?}", d.path()))
                })?
                .to_string();
            let kind = match d.typ() {
                LinuxDeviceType::B => NodeKind::Block,
                LinuxDeviceType::C | LinuxDeviceType::U => NodeKind::Char,
                other => {
                    return Err(DevicesError::Spec(format!(
                        "device {path}: type {:?} is not b, c or u",
                        type_letter(other)
                    )))
                }
            };
            let number = |field: &str, n: i64| {
                u32::try_from(n)
                    .map_err(|_| DevicesError::Spec(format!("device {path}: no {field} number")))
            };
            let (major, minor) = (number("major", d.major())?, number("minor", d.minor())?);
            let access = access(rules, kind, major, minor);
            Ok(SpecDevice {
                index,
                path,
                kind,
                major,
                minor,
                access,
            })
        })
        .collect()
}

/// The `linux.resources.devices` rules of `spec` (none: empty).
fn device_rules(spec: &Spec) -> &[LinuxDeviceCgroup] {
    spec.linux()
        .as_ref()
        .and_then(|l| l.resources().as_ref())
        .and_then(|r| r.devices().as_deref())
        .unwrap_or_default()
}

/// The letter of a device type in the spec (`LinuxDeviceType::as_str`, for as long as the
/// spec is needed).
fn type_letter(t: LinuxDeviceType) -> &'static str {
    match t {
        LinuxDeviceType::A => "a",
        LinuxDeviceType::B => "b",
        LinuxDeviceType::C => "c",
        LinuxDeviceType::U => "u",
        LinuxDeviceType::P => "p",
    }
}

/// Whether a rule's `major` or `minor` matches `n`: absent or -1 matches every number.
fn number_matches(rule: Option<i64>, n: u32) -> bool {
    match rule {
        None | Some(-1) => true,
        Some(v) => v == i64::from(n),
    }
}

/// The access the allow/deny rules give a device, cgroup style: rules in order, an allow adds
/// its letters, a deny takes them away; a rule without `access` means `rwm`.
fn access(rules: &[LinuxDeviceCgroup], kind: NodeKind, major: u32, minor: u32) -> Access {
    let mut write = false;
    for r in rules {
        let typ = r.typ().map_or("a", type_letter);
        let type_ok = typ == "a" || typ == kind.letter() || (typ == "u" && kind == NodeKind::Char);
        if !(type_ok && number_matches(r.major(), major) && number_matches(r.minor(), minor)) {
            continue;
        }
        let letters = r.access().as_deref().unwrap_or("rwm");
        if letters.contains('w') {
            write = r.allow();
        }
    }
    if write {
        Access::ReadWrite
    } else {
        Access::ReadOnly
    }
}

/// What the VM does with `d`, or why it cannot have it. `pod_has_vfio`: whether the pod's VM
/// got VFIO devices at boot.
pub fn classify(d: &SpecDevice, pod_has_vfio: bool) -> Result<DeviceClass, DevicesError> {
    if is_vfio(d) {
        return if pod_has_vfio {
            Ok(DeviceClass::Vfio)
        } else {
            Err(DevicesError::Refused {
                device: d.to_string(),
                why: "a VFIO node needs the pod's VFIO devices cold-plugged at boot (kubelet's \
                      PodResources API named none for this pod)"
                    .into(),
            })
        };
    }
    match d.kind {
        NodeKind::Block => Ok(DeviceClass::Block),
        NodeKind::Char => {
            guest_own_char(d)
                .map(DeviceClass::GuestOwn)
                .ok_or_else(|| DevicesError::Refused {
                    device: d.to_string(),
                    why: "the guest kernel has no such character device (the guest gives its own \
                      null, zero, full, random, urandom, tty, ptmx and fuse; a host character \
                      device cannot cross into the VM)"
                        .into(),
                })
        }
    }
}

/// The capability containerd's privileged spec has (all of them) and its default one has not.
const SYS_ADMIN: Capability = Capability::SysAdmin;

/// Whether `spec` is a privileged container as containerd writes one. For
/// `securityContext.privileged` its CRI (1.6, 1.7 and 2.x alike) applies `oci.WithPrivileged`
/// (every capability containerd has, no masked or read-only paths, /sys and cgroupfs
/// read-write, no seccomp or AppArmor profile) and then, unless the runtime handler sets
/// `privileged_without_host_devices`, `oci.WithHostDevices` (a `linux.devices` entry for every
/// node of the host's `/dev`, after the ones CRI's `devices` asked for) and
/// `oci.WithAllDevicesAllowed` (one rule allowing every device `rwm`; 1.7 and later also with
/// `privileged_without_host_devices_all_devices_allowed`). What this looks at is what matters
/// for devices: the rules end allowing every device, and the bounding set holds
/// `CAP_SYS_ADMIN`. A privileged container without the allow-all rule
/// (`privileged_without_host_devices` alone) has only the devices CRI asked for, which are
/// handled as any container's.
pub fn is_privileged(spec: &Spec) -> bool {
    let mut all_allowed = false;
    for r in device_rules(spec) {
        let every_device = matches!(r.typ(), None | Some(LinuxDeviceType::A))
            && matches!(r.major(), None | Some(-1))
            && matches!(r.minor(), None | Some(-1));
        if !r.allow() {
            // Any deny after the allow-all rule takes "every device" back.
            all_allowed = false;
        } else if every_device {
            let access = r.access().as_deref().unwrap_or("rwm");
            all_allowed = ['r', 'w', 'm'].iter().all(|c| access.contains(*c));
        }
    }
    let sys_admin = spec
        .process()
        .as_ref()
        .and_then(|p| p.capabilities().as_ref())
        .and_then(|c| c.bounding().as_ref())
        .is_some_and(|caps| caps.contains(&SYS_ADMIN));
    all_allowed && sys_admin
}

/// Whether the guest kernel has character device `d` itself (by its fixed numbers).
pub fn guest_own_char(d: &SpecDevice) -> Option<&'static str> {
    if d.kind != NodeKind::Char {
        return None;
    }
    GUEST_OWN
        .iter()
        .find(|(ma, mi, _)| (*ma, *mi) == (d.major, d.minor))
        .map(|(_, _, name)| *name)
}

/// Whether `d` is a VFIO node (`/dev/vfio/...`).
pub fn is_vfio(d: &SpecDevice) -> bool {
    d.path.starts_with(VFIO_DIR)
}

/// Removes the `removed` entries (by their position and path) from `spec`, and the allow rules
/// that name their numbers unless an entry that stays has the same numbers.
pub fn remove_devices(spec: &mut Spec, removed: &[SpecDevice]) {
    if removed.is_empty() {
        return;
    }
    let Some(linux) = spec.linux_mut() else {
        return;
    };
    // A node's numbers as the rules name them (`u` is `c`).
    let numbers = |typ: Option<LinuxDeviceType>, major: Option<i64>, minor: Option<i64>| {
        (
            typ.map(|t| {
                if t == LinuxDeviceType::U {
                    "c"
                } else {
                    type_letter(t)
                }
            }),
            major.and_then(|n| u64::try_from(n).ok()),
            minor.and_then(|n| u64::try_from(n).ok()),
        )
    };
    let mut kept = Vec::new();
    if let Some(list) = linux.devices_mut() {
        let old = std::mem::take(list);
        for (i, d) in old.into_iter().enumerate() {
            let gone = removed
                .iter()
                .any(|r| r.index == i && d.path().to_str() == Some(&r.path));
            if !gone {
                kept.push(numbers(Some(d.typ()), Some(d.major()), Some(d.minor())));
                list.push(d);
            }
        }
    }
    if let Some(rules) = linux
        .resources_mut()
        .as_mut()
        .and_then(|r| r.devices_mut().as_mut())
    {
        rules.retain(|rule| {
            let named = removed.iter().any(|r| {
                rule.major() == Some(i64::from(r.major))
                    && rule.minor() == Some(i64::from(r.minor))
                    && rule.typ().map(type_letter) == Some(r.kind.letter())
            });
            !named || kept.contains(&numbers(rule.typ(), rule.major(), rule.minor()))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::test_json::{json as untyped, spec as typed};
    use serde_json::{json, Value};

    fn spec() -> Spec {
        typed(json!({"linux": {
            "devices": [
                {"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0, "fileMode": 432},
                {"path": "/dev/ro", "type": "b", "major": 7, "minor": 1},
                {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229},
                {"path": "/dev/net/tun", "type": "c", "major": 10, "minor": 200},
                {"path": "/dev/vfio/7", "type": "c", "major": 242, "minor": 0}
            ],
            "resources": {"devices": [
                {"allow": false, "access": "rwm"},
                {"allow": true, "type": "b", "major": 7, "minor": 0, "access": "rwm"},
                {"allow": true, "type": "b", "major": 7, "minor": 1, "access": "r"},
                {"allow": true, "type": "c", "major": 10, "minor": 229, "access": "rwm"}
            ]}
        }}))
    }

    #[test]
    fn reads_devices_with_the_access_of_their_rules() {
        let ds = spec_devices(&spec()).unwrap();
        assert_eq!(ds.len(), 5);
        assert_eq!(ds[0].path, "/dev/xvda");
        assert_eq!(
            (ds[0].kind, ds[0].major, ds[0].minor),
            (NodeKind::Block, 7, 0)
        );
        assert_eq!(ds[0].access, Access::ReadWrite);
        assert_eq!(ds[1].access, Access::ReadOnly);
        // Denied by the first rule and never allowed again.
        assert_eq!(ds[3].access, Access::ReadOnly);
        assert_eq!(ds[0].to_string(), "/dev/xvda (b 7:0)");
        assert!(spec_devices(&typed(json!({}))).unwrap().is_empty());
        // A later deny takes the write back.
        let s = json!({"linux": {"devices": [{"path": "/dev/a", "type": "b", "major": 1, "minor": 2}],
            "resources": {"devices": [{"allow": true, "access": "rwm"},
                {"allow": false, "type": "b", "major": 1, "access": "w"}]}}});
        assert_eq!(spec_devices(&typed(s)).unwrap()[0].access, Access::ReadOnly);
    }

    #[test]
    fn refuses_malformed_entries() {
        // Not a list: refused with the whole spec (crate::oci::read_spec).
        assert!(crate::oci::parse_spec(br#"{"linux": {"devices": {}}}"#).is_err());
        for bad in [
            json!({"linux": {"devices": [{"path": "dev/x", "type": "b", "major": 1, "minor": 1}]}}),
            json!({"linux": {"devices": [{"path": "/dev/x", "type": "p", "major": 1, "minor": 1}]}}),
            json!({"linux": {"devices": [{"path": "/dev/x", "type": "b", "major": -1, "minor": 1}]}}),
        ] {
            assert!(spec_devices(&typed(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn classifies_by_the_policy() {
        let ds = spec_devices(&spec()).unwrap();
        assert_eq!(classify(&ds[0], false).unwrap(), DeviceClass::Block);
        assert_eq!(
            classify(&ds[2], false).unwrap(),
            DeviceClass::GuestOwn("fuse")
        );
        let e = classify(&ds[3], true).unwrap_err().to_string();
        assert!(e.contains("/dev/net/tun (c 10:200)"), "{e}");
        let e = classify(&ds[4], false).unwrap_err().to_string();
        assert!(e.contains("/dev/vfio/7 (c 242:0)"), "{e}");
        assert_eq!(classify(&ds[4], true).unwrap(), DeviceClass::Vfio);
    }

    /// The parts of a privileged spec containerd writes that [`is_privileged`] reads: the
    /// devices CRI asked for first, then the host's /dev; one rule allowing every device.
    fn privileged_spec() -> Value {
        json!({
            "process": {"user": {"uid": 0, "gid": 0}, "cwd": "/", "capabilities": {
                "bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_MKNOD", "CAP_BPF"],
                "effective": ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_MKNOD", "CAP_BPF"],
                "permitted": ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_MKNOD", "CAP_BPF"]}},
            "linux": {
                "devices": [
                    {"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0},
                    {"path": "/dev/autofs", "type": "c", "major": 10, "minor": 235},
                    {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232},
                    {"path": "/dev/null", "type": "c", "major": 1, "minor": 3},
                    {"path": "/dev/loop0", "type": "b", "major": 7, "minor": 0},
                    {"path": "/dev/sda", "type": "b", "major": 8, "minor": 0},
                    {"path": "/dev/vfio/vfio", "type": "c", "major": 10, "minor": 196}
                ],
                "resources": {"devices": [{"allow": true, "access": "rwm"}]}
            }
        })
    }

    #[test]
    fn recognises_privileged_specs_as_containerd_writes_them() {
        let p = privileged_spec();
        assert!(is_privileged(&typed(p.clone())));
        // containerd leaves the numbers out; other writers spell "any" as -1 or null.
        let mut q = p.clone();
        q["linux"]["resources"]["devices"] =
            json!([{"allow": true, "type": "a", "major": -1, "minor": null, "access": "rwm"}]);
        assert!(is_privileged(&typed(q)));
        // The default rules (deny all, allow some): not privileged.
        let mut q = p.clone();
        q["linux"]["resources"]["devices"] = json!([{"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}]);
        assert!(!is_privileged(&typed(q)));
        // A deny after the allow-all, or an allow-all without mknod: not every device.
        let mut q = p.clone();
        q["linux"]["resources"]["devices"] = json!([{"allow": true, "access": "rwm"},
            {"allow": false, "type": "b", "major": 8, "access": "rwm"}]);
        assert!(!is_privileged(&typed(q)));
        let mut q = p.clone();
        q["linux"]["resources"]["devices"] = json!([{"allow": true, "access": "rw"}]);
        assert!(!is_privileged(&typed(q)));
        // Every device allowed but not the capabilities of a privileged container.
        let mut q = p.clone();
        q["process"]["capabilities"]["bounding"] = json!(["CAP_CHOWN", "CAP_MKNOD"]);
        assert!(!is_privileged(&typed(q)));
        assert!(!is_privileged(&typed(json!({}))));
        assert!(!is_privileged(&spec()));
    }

    #[test]
    fn removes_by_position_and_keeps_rules_of_numbers_still_used() {
        let mut s = typed(json!({"linux": {
            "devices": [
                {"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0},
                {"path": "/dev/xvda", "type": "b", "major": 8, "minor": 0},
                {"path": "/dev/loop0", "type": "b", "major": 7, "minor": 0}
            ],
            "resources": {"devices": [
                {"allow": true, "type": "b", "major": 7, "minor": 0, "access": "rwm"},
                {"allow": true, "type": "b", "major": 8, "minor": 0, "access": "rwm"}]}}}));
        let ds = spec_devices(&s).unwrap();
        // The second /dev/xvda and /dev/loop0 go; /dev/xvda (7:0) keeps its rule.
        remove_devices(&mut s, &[ds[1].clone(), ds[2].clone()]);
        let s = untyped(&s);
        assert_eq!(
            s["linux"]["devices"],
            json!([{"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0}])
        );
        assert_eq!(
            s["linux"]["resources"]["devices"],
            json!([{"allow": true, "type": "b", "major": 7, "minor": 0, "access": "rwm"}])
        );
    }

    #[test]
    fn removes_devices_and_their_rules() {
        let mut s = spec();
        let ds = spec_devices(&s).unwrap();
        remove_devices(&mut s, &[ds[1].clone(), ds[4].clone()]);
        let left = spec_devices(&s).unwrap();
        assert_eq!(left.len(), 3);
        let s = untyped(&s);
        assert!(left
            .iter()
            .all(|d| d.path != "/dev/ro" && d.path != "/dev/vfio/7"));
        assert_eq!(
            s["linux"]["resources"]["devices"].as_array().unwrap().len(),
            3
        );
    }
}
