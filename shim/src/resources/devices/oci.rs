//! What a container's OCI spec asks for: its `linux.devices` with the access the
//! `linux.resources.devices` rules give each, classified by what the VM can do with it
//! ([`DeviceClass`]), and the spec edits that follow (VFIO nodes leave the container's spec).

use serde_json::Value;

use super::DevicesError;

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
pub fn spec_devices(spec: &Value) -> Result<Vec<SpecDevice>, DevicesError> {
    let linux = &spec["linux"];
    let Some(list) = linux.get("devices") else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or_else(|| DevicesError::Spec("linux.devices is not an array".into()))?;
    let rules = linux["resources"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    list.iter()
        .map(|d| {
            let path = d["path"]
                .as_str()
                .filter(|p| p.starts_with('/'))
                .ok_or_else(|| DevicesError::Spec(format!("device without an absolute path: {d}")))?
                .to_string();
            let kind = match d["type"].as_str() {
                Some("b") => NodeKind::Block,
                Some("c" | "u") => NodeKind::Char,
                other => {
                    return Err(DevicesError::Spec(format!(
                        "device {path}: type {other:?} is not b, c or u"
                    )))
                }
            };
            let number = |field: &str| {
                d[field]
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| DevicesError::Spec(format!("device {path}: no {field} number")))
            };
            let (major, minor) = (number("major")?, number("minor")?);
            let access = access(&rules, kind, major, minor);
            Ok(SpecDevice {
                path,
                kind,
                major,
                minor,
                access,
            })
        })
        .collect()
}

/// The access the allow/deny rules give a device, cgroup style: rules in order, an allow adds
/// its letters, a deny takes them away; a rule without `access` means `rwm`.
fn access(rules: &[Value], kind: NodeKind, major: u32, minor: u32) -> Access {
    let mut write = false;
    for r in rules {
        let typ = r["type"].as_str().unwrap_or("a");
        let type_ok = typ == "a" || typ == kind.letter() || (typ == "u" && kind == NodeKind::Char);
        let num_ok = |field: &str, n: u32| match r.get(field) {
            None | Some(Value::Null) => true,
            Some(v) => v.as_i64() == Some(-1) || v.as_u64() == Some(u64::from(n)),
        };
        if !(type_ok && num_ok("major", major) && num_ok("minor", minor)) {
            continue;
        }
        let letters = r["access"].as_str().unwrap_or("rwm");
        if letters.contains('w') {
            write = r["allow"].as_bool().unwrap_or(false);
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
    if d.path.starts_with(VFIO_DIR) {
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
        NodeKind::Char => GUEST_OWN
            .iter()
            .find(|(ma, mi, _)| (*ma, *mi) == (d.major, d.minor))
            .map(|(_, _, name)| DeviceClass::GuestOwn(name))
            .ok_or_else(|| DevicesError::Refused {
                device: d.to_string(),
                why: "the guest kernel has no such character device (the guest gives its own \
                      null, zero, full, random, urandom, tty, ptmx and fuse; a host character \
                      device cannot cross into the VM)"
                    .into(),
            }),
    }
}

/// Removes the devices at `paths` and the allow rules that name their numbers from `spec`.
pub fn remove_devices(spec: &mut Value, removed: &[SpecDevice]) {
    if removed.is_empty() {
        return;
    }
    let Some(linux) = spec.get_mut("linux").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(list) = linux.get_mut("devices").and_then(Value::as_array_mut) {
        list.retain(|d| !removed.iter().any(|r| d["path"].as_str() == Some(&r.path)));
    }
    if let Some(rules) = linux
        .get_mut("resources")
        .and_then(|r| r.get_mut("devices"))
        .and_then(Value::as_array_mut)
    {
        rules.retain(|rule| {
            !removed.iter().any(|r| {
                rule["major"].as_u64() == Some(u64::from(r.major))
                    && rule["minor"].as_u64() == Some(u64::from(r.minor))
                    && rule["type"].as_str() == Some(r.kind.letter())
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> Value {
        json!({"linux": {
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
        }})
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
        assert!(spec_devices(&json!({})).unwrap().is_empty());
        // A later deny takes the write back.
        let s = json!({"linux": {"devices": [{"path": "/dev/a", "type": "b", "major": 1, "minor": 2}],
            "resources": {"devices": [{"allow": true, "access": "rwm"},
                {"allow": false, "type": "b", "major": 1, "access": "w"}]}}});
        assert_eq!(spec_devices(&s).unwrap()[0].access, Access::ReadOnly);
    }

    #[test]
    fn refuses_malformed_entries() {
        for bad in [
            json!({"linux": {"devices": {}}}),
            json!({"linux": {"devices": [{"path": "dev/x", "type": "b", "major": 1, "minor": 1}]}}),
            json!({"linux": {"devices": [{"path": "/dev/x", "type": "p", "major": 1, "minor": 1}]}}),
            json!({"linux": {"devices": [{"path": "/dev/x", "type": "b", "major": -1, "minor": 1}]}}),
        ] {
            assert!(spec_devices(&bad).is_err(), "{bad}");
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

    #[test]
    fn removes_devices_and_their_rules() {
        let mut s = spec();
        let ds = spec_devices(&s).unwrap();
        remove_devices(&mut s, &[ds[1].clone(), ds[4].clone()]);
        let left = spec_devices(&s).unwrap();
        assert_eq!(left.len(), 3);
        assert!(left
            .iter()
            .all(|d| d.path != "/dev/ro" && d.path != "/dev/vfio/7"));
        assert_eq!(
            s["linux"]["resources"]["devices"].as_array().unwrap().len(),
            3
        );
    }
}
