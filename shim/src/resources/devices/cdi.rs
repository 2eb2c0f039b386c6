//! Container Device Interface specs (github.com/cncf-tags/container-device-interface SPEC.md):
//! the device nodes of a fully qualified CDI device `vendor.com/class=name`, from the `*.json`
//! and `*.yaml` spec files in the configured folders. A later folder overrides an earlier one
//! (the spec's precedence: `/var/run/cdi` over `/etc/cdi`). Only `deviceNodes` matter here;
//! the rest of a CDI edit (env, mounts, hooks) reaches the container through containerd.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::DevicesError;

/// The largest spec file read.
const MAX_SPEC_BYTES: u64 = 1 << 20;
/// The most spec files read per folder.
const MAX_SPECS: usize = 1024;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    kind: String,
    #[serde(default)]
    devices: Vec<Device>,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Edits {
    #[serde(default)]
    device_nodes: Vec<DeviceNode>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeviceNode {
    path: String,
    #[serde(default)]
    host_path: Option<String>,
    #[serde(default)]
    permissions: Option<String>,
}

/// A device node a CDI device gives a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiNode {
    /// The node on the host (`hostPath`, else `path`).
    pub host_path: PathBuf,
    /// The path in the container.
    pub container_path: String,
    /// Whether the spec lets the container write (`permissions` has `w`; default `rwm`).
    pub writable: bool,
}

/// The nodes of CDI device `qualified` (`kind=name`), or `None` when no spec names it.
pub fn device_nodes(
    dirs: &[PathBuf],
    qualified: &str,
) -> Result<Option<Vec<CdiNode>>, DevicesError> {
    let Some((kind, name)) = qualified.split_once('=') else {
        return Err(DevicesError::Cdi(format!(
            "{qualified:?} is not a qualified CDI device name (vendor.com/class=name)"
        )));
    };
    let mut found = None;
    for dir in dirs {
        for (path, spec) in specs_in(dir)? {
            if spec.kind != kind {
                continue;
            }
            if let Some(d) = spec.devices.iter().find(|d| d.name == name) {
                let nodes = d
                    .container_edits
                    .device_nodes
                    .iter()
                    .chain(&spec.container_edits.device_nodes)
                    .map(|n| CdiNode {
                        host_path: PathBuf::from(n.host_path.as_deref().unwrap_or(&n.path)),
                        container_path: n.path.clone(),
                        writable: n.permissions.as_deref().is_none_or(|p| p.contains('w')),
                    })
                    .collect();
                log::debug!("CDI device {qualified} from {}", path.display());
                found = Some(nodes);
            }
        }
    }
    Ok(found)
}

/// The parsed specs of `dir`, sorted by file name; a missing folder has none, a file that does
/// not parse is skipped with a warning (as the CDI library does).
fn specs_in(dir: &Path) -> Result<Vec<(PathBuf, Spec)>, DevicesError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DevicesError::Cdi(format!("{}: {e}", dir.display()))),
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("json" | "yaml" | "yml")
            )
        })
        .take(MAX_SPECS)
        .collect();
    paths.sort();
    let mut specs = Vec::new();
    for path in paths {
        match read_spec(&path) {
            Ok(spec) => specs.push((path, spec)),
            Err(e) => log::warn!("CDI spec {}: {e}", path.display()),
        }
    }
    Ok(specs)
}

fn read_spec(path: &Path) -> Result<Spec, String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_SPEC_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_SPEC_BYTES {
        return Err(format!("larger than {MAX_SPEC_BYTES} bytes"));
    }
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        serde_saphyr::from_str(&text).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nodes_with_later_folders_first() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::write(
            a.path().join("disk.json"),
            r#"{"cdiVersion": "0.6.0", "kind": "example.com/disk",
                "devices": [{"name": "d0", "containerEdits": {"deviceNodes": [
                    {"path": "/dev/xvda", "hostPath": "/dev/loop3", "permissions": "r"}]}}]}"#,
        )
        .unwrap();
        std::fs::write(a.path().join("broken.json"), "{").unwrap();
        std::fs::write(
            b.path().join("vfio.yaml"),
            "cdiVersion: 0.6.0\nkind: example.com/nic\ndevices:\n- name: \"0000:00:01.0\"\n  \
             containerEdits:\n    deviceNodes:\n    - path: /dev/vfio/1\ncontainerEdits:\n  \
             deviceNodes:\n  - path: /dev/vfio/vfio\n",
        )
        .unwrap();
        let dirs = vec![a.path().to_path_buf(), b.path().to_path_buf()];
        let nodes = device_nodes(&dirs, "example.com/disk=d0").unwrap().unwrap();
        assert_eq!(
            nodes,
            vec![CdiNode {
                host_path: "/dev/loop3".into(),
                container_path: "/dev/xvda".into(),
                writable: false
            }]
        );
        let nodes = device_nodes(&dirs, "example.com/nic=0000:00:01.0")
            .unwrap()
            .unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].host_path, PathBuf::from("/dev/vfio/vfio"));
        assert!(nodes[0].writable);
        assert_eq!(device_nodes(&dirs, "example.com/disk=d9").unwrap(), None);
        assert!(device_nodes(&dirs, "no-equals").is_err());
        assert_eq!(
            device_nodes(&[PathBuf::from("/nonexistent")], "a.b/c=d").unwrap(),
            None
        );
    }
}
