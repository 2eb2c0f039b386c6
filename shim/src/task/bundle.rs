//! What a container is to the shim, read from its bundle's `config.json`: the pod sandbox
//! itself, an app container of a pod, or a container outside any pod (`ctr run`). Decided by
//! the annotations containerd's CRI plugin puts on the OCI spec ([`crate::oci`] reads them).

use std::collections::HashMap;

use crate::oci::{ANN_CONTAINER_TYPE, ANN_SANDBOX_ID};

/// The role of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The pod's sandbox container: its VM.
    Sandbox,
    /// A container of the pod with this sandbox id.
    App { sandbox_id: String },
    /// A container outside any pod: it gets its own VM.
    Standalone,
}

impl Role {
    /// The role of container `id` from its spec's annotations.
    pub fn from_annotations(id: &str, annotations: &HashMap<String, String>) -> Role {
        let sandbox_id = annotations.get(ANN_SANDBOX_ID).filter(|s| !s.is_empty());
        match (
            annotations.get(ANN_CONTAINER_TYPE).map(String::as_str),
            sandbox_id,
        ) {
            (Some("sandbox"), _) => Role::Sandbox,
            (_, Some(sid)) if sid != id => Role::App {
                sandbox_id: sid.clone(),
            },
            (_, Some(_)) => Role::Sandbox,
            (_, None) => Role::Standalone,
        }
    }

    /// The id that names the pod (and so its shim socket and state directory).
    pub fn pod_id<'a>(&'a self, id: &'a str) -> &'a str {
        match self {
            Role::App { sandbox_id } => sandbox_id,
            Role::Sandbox | Role::Standalone => id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use testkit::string_map as ann;

    #[test]
    fn roles_from_cri_annotations() {
        let sandbox = ann(&[(ANN_CONTAINER_TYPE, "sandbox"), (ANN_SANDBOX_ID, "s1")]);
        assert_eq!(Role::from_annotations("s1", &sandbox), Role::Sandbox);
        let app = ann(&[(ANN_CONTAINER_TYPE, "container"), (ANN_SANDBOX_ID, "s1")]);
        let role = Role::from_annotations("c1", &app);
        assert_eq!(
            role,
            Role::App {
                sandbox_id: "s1".into()
            }
        );
        assert_eq!(role.pod_id("c1"), "s1");
        let none = ann(&[]);
        assert_eq!(Role::from_annotations("x", &none), Role::Standalone);
        assert_eq!(Role::Standalone.pod_id("x"), "x");
        let empty = ann(&[(ANN_SANDBOX_ID, "")]);
        assert_eq!(Role::from_annotations("x", &empty), Role::Standalone);
    }
}
