//! The devices a pod holds at boot ([`cold_plug`]): kubelet's PodResources API says which, CDI
//! specs or a PCI address with an IOMMU group resolve each to host nodes (the module doc of
//! `resources::devices` has the whole story).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::oci::Access;
use super::podresources::{self, HeldDevice};
use super::{cdi, host, DevicesError, POD_NAMESPACE_ANNOTATION, POD_NAME_ANNOTATION};
use crate::config::DevicesSettings;

/// A block device cold-plugged at boot: its open host node.
#[derive(Debug)]
pub struct ColdDisk {
    pub host: PathBuf,
    pub rdev: (u32, u32),
    pub access: Access,
    pub file: File,
}

/// What the pod holds at boot, resolved to host nodes.
#[derive(Debug, Default)]
pub struct ColdPlug {
    pub disks: Vec<ColdDisk>,
    /// The host PCI devices (`/sys/bus/pci/devices/<address>`) to pass through with VFIO.
    pub vfio: Vec<PathBuf>,
}

/// Asks kubelet which devices pod `annotations` names holds and resolves them (module doc). No
/// socket, or a sandbox without the pod's name: nothing cold-plugged (an info log).
pub async fn cold_plug(
    settings: &DevicesSettings,
    annotations: &HashMap<String, String>,
) -> Result<ColdPlug, DevicesError> {
    let (Some(name), Some(namespace)) = (
        annotations.get(POD_NAME_ANNOTATION),
        annotations.get(POD_NAMESPACE_ANNOTATION),
    ) else {
        return Ok(ColdPlug::default());
    };
    let socket = &settings.pod_resources_socket;
    let Some(held) = podresources::pod_devices(socket, name, namespace).await? else {
        log::info!(
            "pod {namespace}/{name}: no PodResources socket at {}: no devices cold-plugged",
            socket.display()
        );
        return Ok(ColdPlug::default());
    };
    let dirs = settings.cdi_dirs.clone();
    tokio::task::spawn_blocking(move || resolve(&held, &dirs, Path::new("/sys")))
        .await
        .map_err(|e| DevicesError::Cdi(e.to_string()))?
}

/// Host nodes of `held` (CDI first, then a PCI address with an IOMMU group) under `sysfs`.
fn resolve(
    held: &[HeldDevice],
    cdi_dirs: &[PathBuf],
    sysfs: &Path,
) -> Result<ColdPlug, DevicesError> {
    let mut out = ColdPlug::default();
    for d in held {
        let name = d.cdi_name();
        if let Some(nodes) = cdi::device_nodes(cdi_dirs, &name)? {
            for n in nodes {
                add_node(&mut out, &n, sysfs, &name)?;
            }
            continue;
        }
        if let HeldDevice::Plugin { id, .. } = d {
            let pci = sysfs.join("bus/pci/devices").join(id);
            if is_pci_address(id) && pci.join("iommu_group").exists() {
                push_vfio(&mut out, pci);
                continue;
            }
        }
        log::info!(
            "pod device {name}: no CDI spec names it and it is no PCI device: not cold-plugged"
        );
    }
    Ok(out)
}

fn add_node(
    out: &mut ColdPlug,
    n: &cdi::CdiNode,
    sysfs: &Path,
    name: &str,
) -> Result<(), DevicesError> {
    let meta = std::fs::metadata(&n.host_path).map_err(|source| DevicesError::HostNode {
        what: format!("CDI device {name}"),
        path: n.host_path.clone(),
        source,
    })?;
    let ft = meta.file_type();
    if ft.is_block_device() {
        let rdev = host::split_rdev(meta.rdev());
        if out.disks.iter().any(|d| d.rdev == rdev) {
            return Ok(());
        }
        let access = if n.writable {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        let file = host::open(&n.host_path, access)?;
        out.disks.push(ColdDisk {
            host: n.host_path.clone(),
            rdev,
            access,
            file,
        });
    } else if ft.is_char_device() {
        let group = n
            .host_path
            .strip_prefix("/dev/vfio")
            .ok()
            .and_then(|g| g.to_str())
            .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()));
        if let Some(group) = group {
            let dir = sysfs
                .join("kernel/iommu_groups")
                .join(group)
                .join("devices");
            let entries = std::fs::read_dir(&dir).map_err(|e| {
                DevicesError::Vfio(format!("group {group}: {}: {e}", dir.display()))
            })?;
            for e in entries.flatten() {
                push_vfio(out, sysfs.join("bus/pci/devices").join(e.file_name()));
            }
        }
    }
    Ok(())
}

fn push_vfio(out: &mut ColdPlug, path: PathBuf) {
    if !out.vfio.contains(&path) {
        out.vfio.push(path);
    }
}

/// `dddd:bb:dd.f`.
fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b':',
            10 => *c == b'.',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_vfio_from_a_pci_address_or_a_cdi_group_node() {
        let sys = tempfile::tempdir().unwrap();
        let pci = sys.path().join("bus/pci/devices/0000:00:01.0");
        std::fs::create_dir_all(&pci).unwrap();
        std::fs::write(pci.join("iommu_group"), "").unwrap();
        let held = vec![
            HeldDevice::Plugin {
                resource: "example.com/edu".into(),
                id: "0000:00:01.0".into(),
            },
            HeldDevice::Plugin {
                resource: "example.com/none".into(),
                id: "x".into(),
            },
        ];
        let c = resolve(&held, &[], sys.path()).unwrap();
        assert_eq!(c.vfio, vec![pci]);
        assert!(c.disks.is_empty());
        assert!(is_pci_address("0000:af:1f.7"));
        assert!(!is_pci_address("0000:af:1f"));
        assert!(!is_pci_address("../../../../x"));
    }
}
