//! The OCI runtime spec as containerd hands it to the shim: read from a bundle's
//! `config.json` once and typed ([`Spec`], the `oci-spec` crate the guest agent parses it with
//! too), and the few facts every layer reads from it (its annotations, the CRI annotation
//! names, the pod's network namespace). Below [`crate::task`] and [`crate::sandbox`], which both
//! read specs; how a spec is rewritten for the guest is [`crate::sandbox::spec`]'s.
//!
//! A spec `oci-spec` cannot type is refused whole, naming `config.json` and the cause, with one
//! exception kept from when the shim read specs untyped: annotations that are not strings (or
//! an `annotations` that is not an object) are left out, as the shim always ignored them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use oci_spec::runtime::Spec;
use oci_spec::runtime::{Linux, LinuxNamespaceType};

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

/// The OCI spec of a bundle (its `config.json`), typed.
pub fn read_spec(bundle: &Path) -> Result<Spec, BundleError> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path).map_err(|source| BundleError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_spec(&text).map_err(|source| BundleError::Parse {
        path: path.display().to_string(),
        source,
    })
}

/// An OCI spec from its JSON (module doc: what is refused, what is left out). The error is
/// serde's: with the line and column of what does not fit, or, past annotations left out,
/// naming what else does not.
pub fn parse_spec(json: &[u8]) -> Result<Spec, serde_json::Error> {
    // serde would take a JSON array for the struct too (each field in order).
    if json.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(serde::de::Error::custom("an OCI spec is a JSON object"));
    }
    let strict = match serde_json::from_slice::<Spec>(json) {
        Ok(spec) => return Ok(spec),
        Err(e) => e,
    };
    match without_odd_annotations(json) {
        Some(lenient) => serde_json::from_value(lenient),
        None => Err(strict),
    }
}

/// `json` without its annotations that are not strings, if it had any (`None`: nothing to
/// leave out, or not a JSON object at all).
fn without_odd_annotations(json: &[u8]) -> Option<serde_json::Value> {
    let mut value: serde_json::Value = serde_json::from_slice(json).ok()?;
    let spec = value.as_object_mut()?;
    match spec.get_mut("annotations")? {
        serde_json::Value::Object(map) => {
            let before = map.len();
            map.retain(|k, v| {
                let keep = v.is_string();
                if !keep {
                    log::warn!("OCI spec: annotation {k:?} is not a string: left out");
                }
                keep
            });
            (map.len() != before).then_some(())?;
        }
        serde_json::Value::Null => return None,
        _ => {
            log::warn!("OCI spec: annotations is not an object: left out");
            spec.remove("annotations");
        }
    }
    Some(value)
}

/// A spec with nothing in it (what `{}` parses to; `Spec::default()` is a whole container's).
pub fn empty_spec() -> Spec {
    let mut spec = Spec::default();
    spec.set_version(String::new());
    spec.set_process(None);
    spec.set_root(None);
    spec.set_hostname(None);
    spec.set_mounts(None);
    spec.set_annotations(None);
    spec.set_linux(None);
    spec
}

/// A `linux` section with nothing in it (what `{}` parses to; `Linux::default()` is a whole
/// container's).
pub fn empty_linux() -> Linux {
    let mut linux = Linux::default();
    linux.set_resources(None);
    linux.set_namespaces(None);
    linux.set_masked_paths(None);
    linux.set_readonly_paths(None);
    linux
}

/// The path of the pod's network namespace in a sandbox's OCI spec (`linux.namespaces`, the
/// `network` entry's `path`: where containerd ran CNI); `None` without one.
pub fn network_namespace(spec: &Spec) -> Option<PathBuf> {
    spec.linux()
        .as_ref()?
        .namespaces()
        .as_ref()?
        .iter()
        .find(|ns| ns.typ() == LinuxNamespaceType::Network)?
        .path()
        .clone()
        .filter(|p| !p.as_os_str().is_empty())
}

/// The spec's `annotations`.
pub fn annotations(spec: &Spec) -> HashMap<String, String> {
    spec.annotations().clone().unwrap_or_default()
}

/// Test helpers: a spec from a `json!()` value (the JSON containerd writes), and back.
#[cfg(test)]
pub(crate) mod test_json {
    use super::Spec;

    /// `value` typed, as [`super::parse_spec`] types it.
    pub fn spec(value: serde_json::Value) -> Spec {
        super::parse_spec(&serde_json::to_vec(&value).unwrap()).unwrap()
    }

    /// `spec` as the JSON the agent gets.
    pub fn json(spec: &Spec) -> serde_json::Value {
        serde_json::to_value(spec).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::test_json::spec;
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
    fn a_spec_oci_spec_cannot_type_is_refused_naming_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","linux":{"sysctl":{"a":1}}}"#,
        )
        .unwrap();
        let e = read_spec(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        assert!(e.contains("expected a string"), "{e}");
        assert!(e.contains("line 1"), "{e}");
        // Odd annotations are left out, but not what else is wrong.
        let e = parse_spec(br#"{"annotations":{"n":1},"mounts":{}}"#).unwrap_err();
        assert!(e.to_string().contains("expected a sequence"), "{e}");
        let s = parse_spec(br#"{"annotations":[1]}"#).unwrap();
        assert!(annotations(&s).is_empty());
        assert!(parse_spec(b"[]").is_err());
    }

    #[test]
    fn the_empty_spec_is_what_an_empty_object_parses_to() {
        assert_eq!(empty_spec(), parse_spec(b"{}").unwrap());
        assert_eq!(empty_linux(), serde_json::from_str::<Linux>("{}").unwrap());
    }

    #[test]
    fn the_network_namespace_is_the_path_of_the_network_entry() {
        let s = spec(serde_json::json!({"linux": {"namespaces": [
            {"type": "pid"},
            {"type": "network", "path": "/var/run/netns/cni-1234"},
            {"type": "ipc"}
        ]}}));
        assert_eq!(
            network_namespace(&s),
            Some(std::path::PathBuf::from("/var/run/netns/cni-1234"))
        );
        let no_path = spec(serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}}));
        assert_eq!(network_namespace(&no_path), None);
        assert_eq!(network_namespace(&spec(serde_json::json!({}))), None);
    }
}
