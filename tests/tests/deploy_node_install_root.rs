//! deploy/node-install.sh, the microvm-deploy DaemonSet's container, run the way the DaemonSet runs
//! it, against a node that is an overlay of this host's root (so the host itself is never
//! touched): the image's files are staged by `deploy/build-image.sh --context` (what the image
//! holds under /opt/microvm-deploy), the node's root is at `MICROVM_DEPLOY_HOST` as the pod's
//! `/host` mount, and the node has a containerd config of an operator's (a comment, a runc
//! handler). The script must install (the handler in the config, the files under /opt/microvm,
//! the shim on PATH, the readiness file), keep running, and on SIGTERM (the pod's deletion)
//! uninstall: the config byte for byte as before and nothing of ours left on the node.
//! Needs root (mounts in a private mount namespace made by `unshare`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use microvm_tests::microvm_pods::{repo, require_root, shim_bin_dir};

/// The operator's containerd config on the node (config v2, as Debian 12's containerd 1.6 reads).
const OPERATORS_CONFIG: &str = r#"# The operator's own config: comments and other handlers must survive.
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    # SystemdCgroup as the operator set it.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
"#;

/// Makes the node (tmpfs upper layer over this host's `/`, with /proc, /sys, /dev bound and a
/// fresh /run and /tmp as a real node has) in a new private mount namespace, puts the operator's
/// config in, runs node-install.sh in the background, records its pid and, when it ends, its
/// status; then keeps the namespace alive (`sleep`) so the test can look into the node after the
/// uninstall through /proc/<pid>/root. The namespace and its mounts end with this process.
const NODE_SCRIPT: &str = r#"
set -eu
t=$1
mount -t tmpfs -o size=1g microvm-node-layer "$t/layer"
mkdir "$t/layer/upper" "$t/layer/work"
mount -t overlay microvm-node -o "lowerdir=/,upperdir=$t/layer/upper,workdir=$t/layer/work" "$t/node"
for d in proc sys dev; do mount --rbind "/$d" "$t/node/$d"; done
mount -t tmpfs tmpfs "$t/node/run"
mount -t tmpfs tmpfs "$t/node/tmp"
mkdir -p "$t/node/etc/containerd"
cp "$t/config.toml" "$t/node/etc/containerd/config.toml"
MICROVM_DEPLOY_HOST="$t/node" MICROVM_DEPLOY_ARTIFACTS="$t/image" MICROVM_DEPLOY_READY="$t/ready" \
  MICROVM_ALLOW_SOFTWARE_EMULATION=true sh "$t/image/node-install.sh" >"$t/log" 2>&1 &
echo $! >"$t/pid"
set +e
wait $!
echo $? >"$t/rc"
exec sleep 3600
"#;

/// The namespace's process; killed (and with it the node's mounts) when dropped.
struct Node {
    child: Child,
    dir: PathBuf,
}

impl Node {
    /// A path inside the node, seen from the host through the namespace's root.
    fn path(&self, inside: &str) -> PathBuf {
        let node = self.dir.join("node");
        PathBuf::from(format!(
            "/proc/{}/root{}{}",
            self.child.id(),
            node.display(),
            inside
        ))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// node-install.sh's exit status, once it has ended.
    fn status(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("rc"))
            .ok()
            .filter(|s| s.ends_with('\n'))
            .map(|s| s.trim().to_string())
    }

    /// Waits until `done` holds, failing with the script's log if it ends first or `limit` passes.
    fn wait_for(&self, what: &str, limit: Duration, done: impl Fn(&Node) -> bool) {
        let start = Instant::now();
        while !done(self) {
            if let Some(rc) = self.status() {
                if !done(self) {
                    panic!(
                        "node-install.sh ended (status {rc}) before {what}:\n{}",
                        self.log()
                    );
                }
            }
            assert!(
                start.elapsed() < limit,
                "no {what} after {limit:?}; node-install.sh said:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                // SAFETY: kill(2) with a pid read from the file the script wrote; no memory is touched.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `path` (seen through the namespace, i.e. through the overlay, where a removed file of
/// the lower layer is a whiteout that reads as absent) names nothing on the node.
fn absent(path: &Path) -> bool {
    matches!(std::fs::symlink_metadata(path), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

fn mounts_naming(dir: &Path) -> Vec<String> {
    let needle = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&needle))
        .map(str::to_string)
        .collect()
}

#[test]
fn node_install_installs_on_the_node_and_its_sigterm_uninstalls_leaving_the_config_as_it_was() {
    require_root();
    let host_config_before = std::fs::read("/etc/containerd/config.toml").ok();
    let host_had_prefix = Path::new("/opt/microvm").exists();

    let dir = tempfile::tempdir().expect("a temporary folder");
    let t = dir.path();
    for d in ["layer", "node", "image"] {
        std::fs::create_dir(t.join(d)).unwrap();
    }
    std::fs::write(t.join("config.toml"), OPERATORS_CONFIG).unwrap();

    // The image's contents, staged by the same script that builds the image.
    let staged = Command::new(repo().join("deploy/build-image.sh"))
        .arg("--context")
        .arg(t.join("image"))
        .env("MICROVM_BIN_DIR", shim_bin_dir())
        .output()
        .expect("run deploy/build-image.sh --context");
    assert!(
        staged.status.success(),
        "deploy/build-image.sh --context: {}",
        String::from_utf8_lossy(&staged.stderr)
    );

    let child = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "bash",
            "-c",
            NODE_SCRIPT,
            "node",
        ])
        .arg(t)
        .stdin(Stdio::null())
        .spawn()
        .expect("run unshare");
    let node = Node {
        child,
        dir: t.to_path_buf(),
    };

    // Installed: the readiness probe's file, the handler in the config, the files, the shim on PATH.
    node.wait_for("the readiness file", Duration::from_secs(180), |n| {
        n.dir.join("ready").exists()
    });
    let log = node.log();
    assert!(
        log.contains("installed; waiting"),
        "node-install.sh said:\n{log}"
    );
    assert!(
        log.contains("restart it yourself"),
        "the node has no systemd containerd, and the script must say so:\n{log}"
    );
    let config = std::fs::read_to_string(node.path("/etc/containerd/config.toml")).unwrap();
    assert!(
        config.contains(r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.microvm]"#)
            && config.contains("io.containerd.microvm.v1"),
        "no microvm handler in the node's config after install:\n{config}"
    );
    assert!(
        config.contains("# The operator's own config")
            && config.contains("# SystemdCgroup as the operator set it.")
            && config.contains("SystemdCgroup = true"),
        "install lost the operator's comments or runc handler:\n{config}"
    );
    for f in [
        "/opt/microvm/bin/microvm",
        "/opt/microvm/bin/containerd-shim-microvm-v1",
    ] {
        assert!(
            node.path(f).exists(),
            "{f} missing on the node after install"
        );
    }
    // The link is absolute on the node, so read it rather than follow it from the host.
    let link = "/usr/local/bin/containerd-shim-microvm-v1";
    assert_eq!(
        std::fs::read_link(node.path(link)).ok(),
        Some(PathBuf::from("/opt/microvm/bin/containerd-shim-microvm-v1")),
        "the shim is not on the node's PATH ({link}) after install:\n{log}"
    );
    assert!(
        node.path("/opt/microvm-staging").exists(),
        "the staging folder is where the script stages the files"
    );

    // The pod's deletion: SIGTERM uninstalls and the script ends with 0.
    let pid: i32 = std::fs::read_to_string(t.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) of the script's pid, which is still running (no status yet); no memory is touched.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    node.wait_for(
        "the script's end after SIGTERM",
        Duration::from_secs(120),
        |n| n.status().is_some(),
    );
    assert_eq!(
        node.status().as_deref(),
        Some("0"),
        "node-install.sh after SIGTERM:\n{}",
        node.log()
    );
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/containerd/config.toml")).unwrap(),
        OPERATORS_CONFIG,
        "the node's containerd config after uninstall differs from the operator's"
    );
    for f in [
        "/opt/microvm",
        "/opt/microvm-staging",
        "/usr/local/bin/containerd-shim-microvm-v1",
        "/usr/bin/containerd-shim-microvm-v1",
    ] {
        assert!(
            absent(&node.path(f)),
            "{f} is still on the node after uninstall"
        );
    }
    assert!(
        !t.join("ready").exists(),
        "the readiness file outlived the uninstall"
    );

    // The host itself was never touched, and the node's mounts end with the namespace.
    drop(node);
    assert_eq!(
        std::fs::read("/etc/containerd/config.toml").ok(),
        host_config_before,
        "the host's own containerd config changed"
    );
    assert_eq!(Path::new("/opt/microvm").exists(), host_had_prefix);
    assert_eq!(
        mounts_naming(t),
        Vec::<String>::new(),
        "mounts of the node left on the host"
    );
}
