//! Where the pod's host cgroup goes: the parent of the sandbox spec's `linux.cgroupsPath` (the
//! pod cgroup kubelet sized), in either driver's form.
//!
//! - cgroupfs driver: an absolute path, `/kubepods/burstable/pod<uid>/<sandbox id>`; the pod
//!   cgroup is its parent directory.
//! - systemd driver (`SystemdCgroup = true`): `<slice>:<prefix>:<name>`, e.g.
//!   `kubepods-burstable-pod<uid>.slice:cri-containerd:<id>`; the pod cgroup is the slice, whose
//!   path systemd builds from the dashes in its name:
//!   `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice`.
//!
//! The form is told from the text: a systemd path has exactly two colons and no slash.

/// Which cgroup driver's form a `cgroupsPath` has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Cgroupfs,
    Systemd,
}

impl std::fmt::Display for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Driver::Cgroupfs => "cgroupfs",
            Driver::Systemd => "systemd",
        })
    }
}

/// The pod cgroup a sandbox's `cgroupsPath` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCgroup {
    pub driver: Driver,
    /// The pod cgroup, relative to the hierarchy's root (no leading slash; empty for the root).
    pub parent: String,
}

impl PodCgroup {
    /// The pod's host cgroup: `<pod cgroup>/microvm-<id>`, relative to the hierarchy's root.
    pub fn host_cgroup(&self, sandbox_id: &str) -> String {
        let leaf = format!("microvm-{sandbox_id}");
        if self.parent.is_empty() {
            leaf
        } else {
            format!("{}/{leaf}", self.parent)
        }
    }
}

/// Parses a sandbox's `linux.cgroupsPath`; the message says what is wrong with it.
pub fn parse_cgroups_path(text: &str) -> Result<PodCgroup, String> {
    if text.contains(':') && !text.contains('/') {
        let parts: Vec<&str> = text.split(':').collect();
        let [slice, _prefix, name] = parts[..] else {
            return Err(format!(
                "cgroupsPath {text:?}: a systemd cgroup path is <slice>:<prefix>:<name>"
            ));
        };
        if name.is_empty() {
            return Err(format!("cgroupsPath {text:?}: the unit name is empty"));
        }
        // An empty slice is systemd's default for a unit without one.
        let slice = if slice.is_empty() {
            "system.slice"
        } else {
            slice
        };
        let parent = expand_slice(slice).map_err(|e| format!("cgroupsPath {text:?}: {e}"))?;
        return Ok(PodCgroup {
            driver: Driver::Systemd,
            parent: parent.trim_start_matches('/').to_string(),
        });
    }
    if !text.starts_with('/') {
        return Err(format!(
            "cgroupsPath {text:?} is neither an absolute cgroupfs path nor a systemd \
             <slice>:<prefix>:<name>"
        ));
    }
    let components: Vec<&str> = text.split('/').filter(|c| !c.is_empty()).collect();
    if components.iter().any(|c| *c == "." || *c == "..") {
        return Err(format!("cgroupsPath {text:?} has . or .. in it"));
    }
    let Some((_, parent)) = components.split_last() else {
        return Err(format!("cgroupsPath {text:?} names the root cgroup"));
    };
    Ok(PodCgroup {
        driver: Driver::Cgroupfs,
        parent: parent.join("/"),
    })
}

/// A systemd slice name as its cgroup path: `a-b-c.slice` -> `/a.slice/a-b.slice/a-b-c.slice`
/// (systemd's rule: every dash-separated prefix is a parent slice; `-.slice` is the root).
pub fn expand_slice(slice: &str) -> Result<String, String> {
    let Some(stem) = slice.strip_suffix(".slice") else {
        return Err(format!(
            "{slice:?} is not a systemd slice (no .slice suffix)"
        ));
    };
    if slice.contains('/') {
        return Err(format!("slice {slice:?} has a slash in it"));
    }
    if stem == "-" {
        return Ok("/".to_string());
    }
    if stem.is_empty() || stem.starts_with('-') || stem.ends_with('-') || stem.contains("--") {
        return Err(format!("slice {slice:?} is not a valid slice name"));
    }
    let mut path = String::new();
    let mut prefix = String::new();
    for (i, part) in stem.split('-').enumerate() {
        if i > 0 {
            prefix.push('-');
        }
        prefix.push_str(part);
        path.push('/');
        path.push_str(&prefix);
        path.push_str(".slice");
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroupfs_paths_name_their_parent() {
        let p = parse_cgroups_path("/kubepods/burstable/pod1234/abcd").unwrap();
        assert_eq!(p.driver, Driver::Cgroupfs);
        assert_eq!(p.parent, "kubepods/burstable/pod1234");
        assert_eq!(
            p.host_cgroup("abcd"),
            "kubepods/burstable/pod1234/microvm-abcd"
        );
        // ctr run's default, /<namespace>/<id>.
        let p = parse_cgroups_path("/default/c1").unwrap();
        assert_eq!(p.parent, "default");
        // A container directly under the root: the host cgroup goes under the root too.
        let p = parse_cgroups_path("/c1").unwrap();
        assert_eq!(p.parent, "");
        assert_eq!(p.host_cgroup("c1"), "microvm-c1");
        assert_eq!(
            parse_cgroups_path("//kubepods//pod1/c/").unwrap().parent,
            "kubepods/pod1"
        );
        for bad in ["/", "", "relative/path", "/kubepods/../etc/c", "/a/./c"] {
            assert!(parse_cgroups_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn systemd_paths_expand_their_slice() {
        let p = parse_cgroups_path("kubepods-burstable-pod1234.slice:cri-containerd:abcd").unwrap();
        assert_eq!(p.driver, Driver::Systemd);
        assert_eq!(
            p.parent,
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice"
        );
        assert_eq!(
            p.host_cgroup("abcd"),
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/\
             microvm-abcd"
        );
        // A guaranteed pod's slice sits right under kubepods.slice.
        assert_eq!(
            parse_cgroups_path("kubepods-pod9.slice:cri-containerd:x")
                .unwrap()
                .parent,
            "kubepods.slice/kubepods-pod9.slice"
        );
        assert_eq!(
            parse_cgroups_path(":cri-containerd:x").unwrap().parent,
            "system.slice"
        );
        assert_eq!(parse_cgroups_path("-.slice:p:x").unwrap().parent, "");
        for bad in [
            "kubepods.slice:x",
            "a:b:c:d",
            "kubepods:cri:x",
            "kube--pods.slice:p:x",
            "-kube.slice:p:x",
            "kube-.slice:p:x",
            "kubepods.slice:p:",
        ] {
            assert!(parse_cgroups_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn slice_expansion_follows_systemd() {
        assert_eq!(expand_slice("a.slice").unwrap(), "/a.slice");
        assert_eq!(
            expand_slice("a-b-c.slice").unwrap(),
            "/a.slice/a-b.slice/a-b-c.slice"
        );
        assert_eq!(expand_slice("-.slice").unwrap(), "/");
        assert!(expand_slice("a-b").is_err());
    }
}
