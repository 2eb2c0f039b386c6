//! The OCI runtime spec as containerd hands it to the shim: read from a bundle's
//! `config.json` once, and the few facts every layer reads from it (its annotations, the CRI
//! annotation names, the pod's network namespace). Below [`crate::task`] and [`crate::sandbox`],
//! which both read specs; how a spec is rewritten for the guest is [`crate::sandbox::spec`]'s.

use std::collections::HashMap;
use std::path::Path;

/// Annotation: `sandbox` for the pod's sandbox (pause) container, `container` for the others.
pub const ANN_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// Annotation: the id of the pod sandbox a container belongs to.
pub const ANN_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

/// Why a bundle's spec could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not an OCI spec: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
}

/// The OCI spec of a bundle as JSON, kept whole (it is rewritten and forwarded, never re-modelled).
pub fn read_spec(bundle: &Path) -> Result<serde_json::Value, BundleError> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path).map_err(|source| BundleError::Read {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| BundleError::Parse {
        path: path.display().to_string(),
        source,
    })
}

/// The path of the pod's network namespace in a sandbox's OCI spec (`linux.namespaces`, the
/// `network` entry's `path`: where containerd ran CNI); `None` without one.
pub fn network_namespace(spec: &serde_json::Value) -> Option<std::path::PathBuf> {
    spec.pointer("/linux/namespaces")?
        .as_array()?
        .iter()
        .find(|ns| ns["type"] == "network")?
        .get("path")?
        .as_str()
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
}

/// The spec's `annotations` (string values only).
pub fn annotations(spec: &serde_json::Value) -> HashMap<String, String> {
    spec.get("annotations")
        .and_then(|a| a.as_object())
        .map(|map| {
            map.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    use testkit::string_map as ann;

    #[test]
    fn reads_annotations_from_a_bundle() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","annotations":{"a":"b","n":1}}"#,
        )
        .unwrap();
        let spec = read_spec(dir.path()).unwrap();
        assert_eq!(annotations(&spec), ann(&[("a", "b")]));
        std::fs::write(dir.path().join("config.json"), "{").unwrap();
        let e = read_spec(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        assert!(read_spec(&dir.path().join("nope")).is_err());
    }

    #[test]
    fn the_network_namespace_is_the_path_of_the_network_entry() {
        let spec = serde_json::json!({"linux": {"namespaces": [
            {"type": "pid"},
            {"type": "network", "path": "/var/run/netns/cni-1234"},
            {"type": "ipc"}
        ]}});
        assert_eq!(
            network_namespace(&spec),
            Some(std::path::PathBuf::from("/var/run/netns/cni-1234"))
        );
        let no_path = serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}});
        assert_eq!(network_namespace(&no_path), None);
        assert_eq!(network_namespace(&serde_json::json!({})), None);
    }
}
