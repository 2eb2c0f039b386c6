//! What the agent checks and changes in a container's OCI spec before libcontainer builds it:
//! the rootfs must be there, a missing working directory is made inside it, and [`rewrite`]
//! puts the cgroup under the agent's, resolves the namespace paths that name the pod or another
//! container, and spells `rootfsPropagation` as libcontainer knows it.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxNamespaceType, Spec};

use super::cgroup::CGROUP_PARENT;
use super::error::{io_err, ContainerError};
use crate::pod_namespace::POD_PID_NAMESPACE;

/// The spec's root must be an existing directory in the guest (the shim's share of it): say which
/// path is missing rather than libcontainer's generic error later.
pub(super) fn check_rootfs(spec: &Spec) -> Result<(), ContainerError> {
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| ContainerError::Spec("no root".into()))?;
    let path = root.path().clone();
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(ContainerError::Rootfs {
            path,
            reason: "not a directory".into(),
        }),
        Err(err) => Err(ContainerError::Rootfs {
            path,
            reason: format!("{err} (is the pod's shared filesystem mounted?)"),
        }),
    }
}

/// runc creates a missing `process.cwd` (MkdirAll, 0755, as root, inside the container's root
/// after its mounts); libcontainer 0.7 fails the container. The agent creates it in the rootfs
/// before the build, resolving the path inside the rootfs (libpathrs: no symlink or `..` leads
/// out of it). A working directory under one of the spec's mount destinations is left alone:
/// runc would create it in the mounted volume, which is not there yet.
pub(super) fn ensure_cwd(spec: &Spec) -> Result<(), ContainerError> {
    let Some(cwd) = spec.process().as_ref().map(|p| p.cwd().clone()) else {
        return Ok(());
    };
    if !cwd.is_absolute() || cwd == Path::new("/") {
        return Ok(());
    }
    let under_a_mount = spec.mounts().iter().flatten().any(|m| {
        let dest = m.destination();
        dest != Path::new("/") && cwd.starts_with(dest)
    });
    if under_a_mount {
        return Ok(());
    }
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| ContainerError::Spec("no root".into()))?
        .path()
        .clone();
    let fail = |reason: String| ContainerError::Cwd {
        path: cwd.clone(),
        reason,
    };
    let root = pathrs::Root::open(&root).map_err(|e| fail(e.to_string()))?;
    let relative = cwd.strip_prefix("/").unwrap_or(&cwd);
    use std::os::unix::fs::PermissionsExt;
    root.mkdir_all(relative, &std::fs::Permissions::from_mode(0o755))
        .map_err(|e| fail(e.to_string()))?;
    Ok(())
}

fn ns_file(kind: LinuxNamespaceType) -> &'static str {
    match kind {
        LinuxNamespaceType::Mount => "mnt",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Time => "time",
    }
}

/// `rootfsPropagation` as libcontainer 0.7 knows it. runc accepts the recursive spellings too,
/// and containerd writes them (`rshared` for a Bidirectional volume, `rslave` for
/// HostToContainer); libcontainer knows only `shared`, `slave`, `private` and `unbindable`, and
/// makes the root's propagation recursive (MS_REC) for each anyway.
fn rootfs_propagation(value: &str) -> Result<&'static str, ContainerError> {
    match value {
        "shared" | "rshared" => Ok("shared"),
        "slave" | "rslave" => Ok("slave"),
        "private" | "rprivate" => Ok("private"),
        "unbindable" | "runbindable" => Ok("unbindable"),
        other => Err(ContainerError::Spec(format!(
            "linux.rootfsPropagation {other:?}: not one of shared, slave, private, unbindable \
             (or their r- forms)"
        ))),
    }
}

/// Resolves `container:<id>` namespace paths (to the namespaces of that container's init, whose
/// pid `init_pid` gives while it runs), sets the agent's cgroup path and spells
/// `rootfsPropagation` as libcontainer knows it.
pub(super) fn rewrite(
    id: &str,
    spec: &mut Spec,
    init_pid: impl Fn(&str) -> Option<libc::pid_t>,
) -> Result<(), ContainerError> {
    let mut linux = spec.linux().clone().unwrap_or_default();
    linux.set_cgroups_path(Some(PathBuf::from(format!("{CGROUP_PARENT}/{id}"))));
    if let Some(p) = linux.rootfs_propagation().clone() {
        linux.set_rootfs_propagation(Some(rootfs_propagation(&p)?.to_owned()));
    }
    if let Some(namespaces) = linux.namespaces().clone() {
        let mut out = Vec::with_capacity(namespaces.len());
        for mut ns in namespaces {
            let path = ns
                .path()
                .as_ref()
                .and_then(|p| p.to_str())
                .map(str::to_owned);
            let resolved = match path.as_deref() {
                Some(POD_PID_NAMESPACE) => {
                    if ns.typ() != LinuxNamespaceType::Pid {
                        return Err(ContainerError::Spec(format!(
                            "namespace path {POD_PID_NAMESPACE} is only for the pid namespace"
                        )));
                    }
                    Some(
                        crate::pod_namespace::pid_namespace_path()
                            .map_err(io_err("starting the pod's PID namespace"))?,
                    )
                }
                Some(p) => match p.strip_prefix("container:") {
                    Some(other) => {
                        let pid = init_pid(other).ok_or_else(|| {
                            ContainerError::Spec(format!(
                                "namespace path container:{other}: no such running container"
                            ))
                        })?;
                        Some(PathBuf::from(format!(
                            "/proc/{pid}/ns/{}",
                            ns_file(ns.typ())
                        )))
                    }
                    None => None,
                },
                None => None,
            };
            if let Some(resolved) = resolved {
                ns.set_path(Some(resolved));
            }
            out.push(ns);
        }
        linux.set_namespaces(Some(out));
    }
    spec.set_linux(Some(linux));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_working_directory_is_made_inside_the_rootfs_only() {
        let dir = std::env::temp_dir().join(format!("agent-cwd-{}", std::process::id()));
        let root = dir.join("rootfs");
        std::fs::create_dir_all(root.join("etc")).expect("rootfs");
        // A symlink that would lead out of the rootfs stays inside it.
        std::os::unix::fs::symlink("/", root.join("escape")).expect("symlink");
        let spec = |cwd: &str, mounts: &str| -> Spec {
            serde_json::from_str(&format!(
                r#"{{"ociVersion":"1.0.2","root":{{"path":"{}"}},
                    "process":{{"cwd":"{cwd}","args":["sh"],"user":{{"uid":0,"gid":0}}}},
                    "mounts":[{mounts}]}}"#,
                root.display()
            ))
            .expect("spec")
        };
        ensure_cwd(&spec("/work/dir", "")).expect("made");
        assert!(root.join("work/dir").is_dir());
        ensure_cwd(&spec("/escape/agent-cwd-outside", "")).expect("made inside");
        assert!(root.join("agent-cwd-outside").is_dir());
        assert!(!Path::new("/agent-cwd-outside").exists());
        ensure_cwd(&spec(
            "/data/x",
            r#"{"destination":"/data","type":"bind","source":"/s"}"#,
        ))
        .expect("left to the volume");
        assert!(!root.join("data").exists());
        ensure_cwd(&spec("/", "")).expect("root");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rootfs_propagation_accepts_what_runc_accepts() {
        for (given, want) in [
            ("rshared", "shared"),
            ("shared", "shared"),
            ("rslave", "slave"),
            ("slave", "slave"),
            ("rprivate", "private"),
            ("private", "private"),
            ("runbindable", "unbindable"),
            ("unbindable", "unbindable"),
        ] {
            assert_eq!(rootfs_propagation(given).unwrap(), want, "{given}");
        }
        let err = rootfs_propagation("sideways").unwrap_err().to_string();
        assert!(err.contains("\"sideways\""), "{err}");
    }
}
