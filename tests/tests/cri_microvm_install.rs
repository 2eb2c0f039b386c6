//! `microvm install` on each containerd an operator runs: Debian 12's 1.6 (on PATH), trixie's 1.7
//! and sid's 2.1 (unpacked privately by scripts/install-containerd.sh). For each: the harness
//! writes containerd's config without our handler, `microvm install` adds it (config v2 or v3),
//! that containerd runs a microvm pod through CRI on the backend install chose, and
//! `microvm uninstall` leaves the config byte for byte as it was and nothing of ours behind.
//! Needs root and the network to Debian's mirror on the first run (the packages are cached).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use microvm_tests::containerd::{ContainerdOptions, PrivateContainerd};
use microvm_tests::cri::{container_config, CriClient};
use microvm_tests::microvm_pods::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The folder of a suite's containerd: PATH's for bookworm, else unpacked into the cache.
fn containerd_bin(suite: &str) -> Option<PathBuf> {
    if suite == "bookworm" {
        return None;
    }
    let out = Command::new(repo().join("scripts/install-containerd.sh"))
        .arg(suite)
        .output()
        .expect("run scripts/install-containerd.sh");
    assert!(
        out.status.success(),
        "scripts/install-containerd.sh {suite}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn microvm() -> PathBuf {
    shim_bin_dir().join("microvm")
}

struct Layout {
    prefix: PathBuf,
    links: PathBuf,
}

impl Layout {
    fn in_dir(dir: &Path) -> Self {
        Layout {
            prefix: dir.join("opt/microvm"),
            links: dir.join("usr/local/bin"),
        }
    }

    fn install_args(&self, config: &Path, containerd: &Path) -> Vec<String> {
        let build = repo().join("build");
        vec![
            "install".into(),
            "--prefix".into(),
            self.prefix.display().to_string(),
            "--containerd-config".into(),
            config.display().to_string(),
            "--shim-link-dir".into(),
            self.links.display().to_string(),
            "--containerd".into(),
            containerd.display().to_string(),
            "--kernel".into(),
            build.join("vmlinux").display().to_string(),
            "--initrd".into(),
            build.join("initrd.cpio").display().to_string(),
            // Pods here may run on QEMU's TCG (kvm-pvm cannot boot our guest), which install
            // refuses without the opt-in.
            "--allow-software-emulation".into(),
        ]
    }
}

async fn install_run_uninstall(suite: &str) {
    let _serial = SERIAL.lock().await;
    require_root();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let layout = Layout::in_dir(dir.path());
    let before = dir.path().join("config-before.toml");
    let config_file = dir.path().join("config-path");
    let opts = ContainerdOptions {
        extra_path: vec![layout.links.clone()],
        bin_dir: containerd_bin(suite),
        microvm_handler: false,
        ..ContainerdOptions::default()
    };
    let installed = std::sync::Mutex::new(String::new());
    let ctrd = PrivateContainerd::start_after(opts, |config, containerd| {
        std::fs::copy(config, &before).map_err(|e| e.to_string())?;
        std::fs::write(&config_file, config.as_os_str().as_encoded_bytes())
            .map_err(|e| e.to_string())?;
        let out = Command::new(microvm())
            .args(layout.install_args(config, containerd))
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "microvm install failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        *installed.lock().unwrap() = text;
        Ok(())
    })
    .unwrap_or_else(|e| panic!("starting containerd ({suite}) after microvm install: {e}"));
    let installed = installed.into_inner().unwrap();
    let config = PathBuf::from(std::fs::read_to_string(&config_file).unwrap());
    eprintln!(
        "containerd {} ({suite}); microvm install said:\n{installed}",
        ctrd.version()
    );
    let version = if ctrd.version().starts_with('2') {
        3
    } else {
        2
    };
    assert!(
        installed.contains(&format!("(config version {version})")),
        "containerd {} has config version {version}; install said:\n{installed}",
        ctrd.version()
    );
    assert!(layout.links.join("containerd-shim-microvm-v1").exists());

    let cri = CriClient::connect(ctrd.socket(), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.wait_ready(&[ctrd.busybox_image()], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let pod = cri
        .run_pod_sandbox(
            ctrd.pod_config("installed", Default::default()).unwrap(),
            "microvm",
        )
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let id = cri
        .create_container(
            &pod,
            container_config("app", ctrd.busybox_image(), &["sleep", "600"]),
        )
        .await
        .unwrap();
    cri.start_container(&id).await.unwrap();
    let out = cri.exec_sync(&id, &["uname", "-r"], 30).await.unwrap();
    let host = String::from_utf8_lossy(&Command::new("uname").arg("-r").output().unwrap().stdout)
        .trim()
        .to_string();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_ne!(
        out.stdout.trim(),
        host,
        "the container runs on the host's kernel"
    );
    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    drop(cri);

    let out = Command::new(microvm())
        .args(["uninstall", "--prefix"])
        .arg(&layout.prefix)
        .output()
        .unwrap();
    assert!(out.status.success(), "microvm uninstall: {out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("restored as it was"), "{said}");
    assert_eq!(
        std::fs::read(&config).unwrap(),
        std::fs::read(&before).unwrap(),
        "containerd's config after uninstall differs from before install"
    );
    drop(ctrd);
    assert!(
        !layout.prefix.exists(),
        "{} is left",
        layout.prefix.display()
    );
    assert!(
        !layout.links.join("containerd-shim-microvm-v1").exists(),
        "the shim link is left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_runs_a_pod_and_uninstall_restores_containerd_1_6() {
    install_run_uninstall("bookworm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_runs_a_pod_and_uninstall_restores_containerd_1_7() {
    install_run_uninstall("trixie").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_runs_a_pod_and_uninstall_restores_containerd_2_1() {
    install_run_uninstall("sid").await;
}

#[test]
fn install_on_a_host_that_cannot_run_pods_says_why_and_changes_nothing() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout::in_dir(dir.path());
    let config = dir.path().join("config.toml");
    let original = "# the operator's\nversion = 2\n";
    std::fs::write(&config, original).unwrap();
    // A kernel that cannot boot under the embedded VMM, and a QEMU backend without its
    // vhost-device-vsock: neither backend can run a pod.
    let not_a_kernel = dir.path().join("vmlinux");
    std::fs::write(&not_a_kernel, b"not an ELF").unwrap();
    let mut args = layout.install_args(&config, Path::new("containerd"));
    let k = args.iter().position(|a| a == "--kernel").unwrap();
    args[k + 1] = not_a_kernel.display().to_string();
    let out = Command::new(microvm())
        .args(&args)
        .env(
            "MICROVM_VHOST_VSOCK",
            dir.path().join("no-vhost-device-vsock"),
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "install went ahead: {out:?}");
    assert!(
        stderr.contains("this host cannot run microvm pods")
            && stderr.contains("vhost-device-vsock"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), original);
    assert!(!layout.prefix.exists());
    assert!(!layout.links.exists());
}
