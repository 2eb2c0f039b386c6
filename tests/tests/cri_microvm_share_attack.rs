//! The attacker suite of the pod's shared directory (docs/security.md), through CRI on a private
//! containerd, on the backend `MICROVM_TEST_HYPERVISOR` names (QEMU here; the embedded VMM in
//! the nested lane). Needs root, and what the other cri_microvm suites need.
//!
//! A container that owns the guest (CAP_SYS_ADMIN in the guest, enough to mount the pod's
//! virtio-fs share; and a privileged container, with every capability and device of the guest)
//! runs `tests/images/share-attack.c`: it polls the share and, as fast
//! as it can, replaces each container's `mounts` and `rootfs` folders by symlinks to a host
//! canary directory, plants `mounts/<n>` symlinks before the shim creates those names, plants
//! symlinks at the share's root, fills the share, and creates a device node, a setuid file and
//! directories in it. Meanwhile the test creates, runs and removes one container after another
//! in the same pod, each with a host volume, a file mount and CRI's own mounts (hosts,
//! resolv.conf, hostname, /dev/shm): every creation is another try of the race that an older
//! shim lost (it created and mounted by path inside a share the guest could write).
//!
//! Then, from the host's side alone: the canary directory is byte for byte as it was, no mount
//! appeared in it or anywhere outside the test's own folders, the pod's state directory grew on /run by no more than its records, the
//! attacker's every write to the share was refused (its own counts, and at least one EROFS
//! seen), the victims ran with their volume or failed naming the cause (the attacker can hurt
//! its own pod), a second pod is untouched, and the attacked pod leaves nothing behind.
//!
//! Against the shim before the read-only skeleton (commit 5c9e26a), this test fails at its
//! first check: the first victim's volume, data file, hosts, resolv.conf, hostname and /dev/shm
//! were bind-mounted into the canary directory on the host and left there.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use microvm_tests::cri::container_config;
use microvm_tests::cri::read_cri_log;
use microvm_tests::cri::v1::{
    Capability, LinuxContainerConfig, LinuxContainerSecurityContext, Mount,
};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Containers created, run and removed while the attack runs: each one a try of the race.
const VICTIMS: usize = 12;
/// How much of /run the attacked pod's state directory may take while the attack runs (its
/// console ring is 2 MiB at most, the rest is small records); the attacker writes up to 64 MiB
/// into the share when it can.
const STATE_BYTES_LIMIT: u64 = 16 << 20;

/// Every file and directory under `dir` (symlinks not followed), with its kind, mode, size and
/// content: what "unchanged" means for the canary.
fn manifest(dir: &Path) -> BTreeMap<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(dir).unwrap().to_path_buf();
            let what = if meta.is_dir() {
                todo.push(path.clone());
                format!("dir {:o}", meta.mode())
            } else if meta.file_type().is_symlink() {
                format!(
                    "symlink -> {}",
                    std::fs::read_link(&path).unwrap().display()
                )
            } else if meta.is_file() {
                format!(
                    "file {:o} {:?}",
                    meta.mode(),
                    String::from_utf8_lossy(&std::fs::read(&path).unwrap())
                )
            } else {
                format!("other {:o} rdev {}", meta.mode(), meta.rdev())
            };
            out.insert(rel, what);
        }
    }
    out
}

/// The mount points of this process's mount namespace.
fn mount_points() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .collect()
}

/// Mount points outside the places tests and their pods make mounts of their own (the private
/// containerds, pods' state, network namespaces): where a mount must never appear or vanish.
fn foreign_mount_points() -> Vec<PathBuf> {
    let own = [
        "/tmp/",
        "/run/microvm",
        "/run/netns",
        "/run/containerd",
        "/var/run/netns",
    ];
    let mut m: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|p| !own.iter().any(|o| p.to_string_lossy().starts_with(o)))
        .collect();
    m.sort();
    m
}

/// The bytes the pod's state directory `/run/microvm/<pod>` takes on the filesystem that holds
/// /run: its files and folders there, not what is mounted under it (container rootfs and
/// volumes are the containers' own, and the share's skeleton is a tmpfs of its own of 1 MiB).
/// A guest that could write the share's skeleton (the old design: a plain folder on /run)
/// would fill this.
fn state_bytes_on_run(pod_id: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fn walk(dir: &Path, dev: u64, total: &mut u64) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.dev() != dev {
                continue;
            }
            *total += meta.blocks() * 512;
            if meta.is_dir() {
                walk(&entry.path(), dev, total);
            }
        }
    }
    let dir = Path::new("/run/microvm").join(pod_id);
    let Ok(root) = dir.symlink_metadata() else {
        return 0;
    };
    let mut total = root.blocks() * 512;
    walk(&dir, root.dev(), &mut total);
    total
}

/// `tests/images/share-attack.c`, compiled static into `dir`.
fn build_attack(dir: &Path) -> PathBuf {
    let source = repo().join("tests/images/share-attack.c");
    let out = dir.join("share-attack");
    let status = std::process::Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&out)
        .arg(&source)
        .status()
        .expect("running gcc");
    assert!(status.success(), "gcc -static {}", source.display());
    out
}

/// The attacker's counts from its last `attack:` line (`key=value` words).
fn last_summary(log: &Path) -> BTreeMap<String, String> {
    let lines = read_cri_log(log).unwrap_or_default();
    let line = lines
        .iter()
        .rev()
        .find(|l| l.text.starts_with("attack: rounds=") || l.text.starts_with("attack done:"))
        .map(|l| l.text.clone())
        .unwrap_or_default();
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn wait_for_line(log: &Path, prefix: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let lines = read_cri_log(log).unwrap_or_default();
        if let Some(l) = lines.iter().find(|l| l.text.starts_with(prefix)) {
            return l.text.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no line starting {prefix:?} in {} within {timeout:?}: {:?}",
            log.display(),
            lines.iter().map(|l| &l.text).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How much of the guest the attacker owns.
#[derive(Clone, Copy, Debug)]
enum Attacker {
    /// CAP_SYS_ADMIN in the guest: enough to mount the share.
    SysAdmin,
    /// A privileged container: every capability and device of the guest.
    Privileged,
}

/// The attacker's container: the attack binary from the host (read-only), attacking for
/// `seconds` towards `canary`.
fn attacker_config(
    attacker: Attacker,
    attack_dir: &Path,
    canary: &Path,
    seconds: u32,
) -> microvm_tests::cri::v1::ContainerConfig {
    let canary = canary.display().to_string();
    let seconds = seconds.to_string();
    let mut config = container_config(
        "attacker",
        BUSYBOX_IMAGE,
        &["/attack/share-attack", &seconds, &canary, "/mnt/share"],
    );
    config.mounts = vec![Mount {
        container_path: "/attack".into(),
        host_path: attack_dir.display().to_string(),
        readonly: true,
        ..Default::default()
    }];
    let security = match attacker {
        Attacker::SysAdmin => LinuxContainerSecurityContext {
            capabilities: Some(Capability {
                add_capabilities: vec!["SYS_ADMIN".into()],
                ..Default::default()
            }),
            ..Default::default()
        },
        Attacker::Privileged => LinuxContainerSecurityContext {
            privileged: true,
            ..Default::default()
        },
    };
    config.linux = Some(LinuxContainerConfig {
        security_context: Some(security),
        ..Default::default()
    });
    config
}

/// The attacked pod: privileged when its attacker is (containerd refuses a privileged
/// container in a pod that is not).
async fn run_attacked_pod(
    ctrd: &microvm_tests::containerd::PrivateContainerd,
    cri: &microvm_tests::cri::CriClient,
    attacker: Attacker,
) -> microvm_tests::cri::Pod {
    let mut config = ctrd
        .pod_config("attacked", std::collections::HashMap::new())
        .unwrap();
    if let Attacker::Privileged = attacker {
        config
            .linux
            .get_or_insert_with(Default::default)
            .security_context = Some(microvm_tests::cri::v1::LinuxSandboxSecurityContext {
            privileged: true,
            ..Default::default()
        });
    }
    cri.run_pod_sandbox(config, "microvm")
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd log:\n{}", ctrd.log_tail()))
}

/// Creates, starts and waits for a victim container, then removes it: its exit code and
/// stdout, or why it failed.
async fn run_victim(
    cri: &microvm_tests::cri::CriClient,
    pod: &microvm_tests::cri::Pod,
    config: microvm_tests::cri::v1::ContainerConfig,
) -> Result<(i32, String), String> {
    let id = cri
        .create_container(pod, config)
        .await
        .map_err(|e| format!("create: {e}"))?;
    let ran: Result<(i32, String), String> = async {
        cri.start_container(&id)
            .await
            .map_err(|e| format!("start: {e}"))?;
        let status = cri
            .wait_container_exited(&id, Duration::from_secs(120))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        let log = read_cri_log(Path::new(&status.log_path)).map_err(|e| format!("log: {e}"))?;
        let stdout: Vec<String> = log
            .iter()
            .filter(|l| l.stream == "stdout")
            .map(|l| l.text.clone())
            .collect();
        Ok((status.exit_code, stdout.join("\n")))
    }
    .await;
    let removed = cri
        .remove_container(&id)
        .await
        .map_err(|e| format!("remove: {e}"));
    let outcome = ran?;
    removed?;
    Ok(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_that_owns_the_guest_cannot_steer_the_share_onto_the_host() {
    attack(Attacker::SysAdmin).await;
}

/// The same attack from a privileged container (every capability and device of the guest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_container_cannot_steer_the_share_onto_the_host() {
    attack(Attacker::Privileged).await;
}

async fn attack(attacker: Attacker) {
    let _serial = SERIAL.lock().await;
    let (dir, _config, ctrd, cri) = start_with_busybox().await;
    let attack_dir = dir.path().join("attack");
    std::fs::create_dir_all(&attack_dir).unwrap();
    build_attack(&attack_dir);

    // The canary: a host directory the attacker points every symlink at.
    let canary = dir.path().join("canary");
    std::fs::create_dir_all(canary.join("sub")).unwrap();
    std::fs::write(canary.join("a"), "host file a\n").unwrap();
    std::fs::write(canary.join("sub/b"), "host file b\n").unwrap();
    let canary_before = manifest(&canary);
    let foreign_before = foreign_mount_points();
    // The victims' host volume and file.
    let vol = dir.path().join("vol");
    std::fs::create_dir_all(&vol).unwrap();
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "host data\n").unwrap();

    // A bystander pod, untouched by all this.
    let bystander = run_pod(&ctrd, &cri, "bystander").await;
    let quiet = cri
        .create_container(
            &bystander,
            container_config("quiet", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&quiet).await.unwrap();

    let pod = run_attacked_pod(&ctrd, &cri, attacker).await;
    let attacker = cri
        .create_container(&pod, attacker_config(attacker, &attack_dir, &canary, 3600))
        .await
        .unwrap_or_else(|e| panic!("attacker: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.start_container(&attacker).await.unwrap();
    let attacker_log = PathBuf::from(cri.container_status(&attacker).await.unwrap().log_path);
    let mounted = wait_for_line(&attacker_log, "attack:", Duration::from_secs(60));
    assert!(
        mounted.starts_with("attack: mounted"),
        "the attacker could not mount the share: {mounted}"
    );
    wait_for_line(&attacker_log, "attack: rounds=", Duration::from_secs(30));

    let mut state_high = state_bytes_on_run(&pod.id);
    // Each victim's outcome; judged after the host's side (what the attack was after).
    let mut victims = Vec::new();
    for i in 0..VICTIMS {
        let script = format!("echo victim {i} > /vol/out-{i} && cat /data.txt");
        let mut config = container_config(
            &format!("victim-{i}"),
            BUSYBOX_IMAGE,
            &["sh", "-c", &script],
        );
        config.mounts = vec![
            Mount {
                container_path: "/vol".into(),
                host_path: vol.display().to_string(),
                ..Default::default()
            },
            Mount {
                container_path: "/data.txt".into(),
                host_path: data.display().to_string(),
                readonly: true,
                ..Default::default()
            },
        ];
        victims.push(run_victim(&cri, &pod, config).await);
        state_high = state_high.max(state_bytes_on_run(&pod.id));
    }
    // A last look while the attacker still runs, then its counts.
    std::thread::sleep(Duration::from_secs(2));
    state_high = state_high.max(state_bytes_on_run(&pod.id));
    let summary = last_summary(&attacker_log);
    cri.stop_container(&attacker, 0).await.unwrap();
    println!("the {attacker:?} attacker's last counts: {summary:?}");

    // The host's side first: this is what the attack was after.
    assert_eq!(
        manifest(&canary),
        canary_before,
        "the canary host directory changed (attacker: {summary:?})"
    );
    assert!(
        mount_points().iter().all(|m| !m.starts_with(&canary)),
        "a mount appeared in the canary directory: {:?}",
        mount_points()
    );
    assert_eq!(
        foreign_mount_points(),
        foreign_before,
        "mounts appeared or vanished outside the test's folders"
    );
    assert!(
        state_high < STATE_BYTES_LIMIT,
        "the attacked pod's state directory took {state_high} bytes of /run while the attack ran"
    );
    // The victims: the attacked pod may fail, with a clear error. One does when the attacker
    // looked up its folder before the shim's mounts were there: the guest's kernel then keeps
    // the folder underneath for a moment (its dentry cache), the agent finds the read-only
    // skeleton instead of the rootfs, and CreateContainer fails naming it. The guest can only
    // hurt its own pod that way.
    let mut ran = Vec::new();
    for (i, outcome) in victims.iter().enumerate() {
        println!("victim {i}: {outcome:?}");
        match outcome {
            Ok((0, out)) if out == "host data" => ran.push(format!("out-{i}")),
            Ok(other) => panic!("victim {i} ran but gave {other:?}"),
            Err(e) => assert!(
                e.contains("creating container") || e.contains("CreateContainer"),
                "victim {i} failed without naming the cause: {e}"
            ),
        }
    }
    assert!(
        !ran.is_empty(),
        "no victim ran under the attack\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    let mut outputs: Vec<String> = std::fs::read_dir(&vol)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    outputs.sort();
    ran.sort();
    assert_eq!(
        outputs, ran,
        "every victim that ran wrote its volume, nothing else did"
    );

    // The attacker's own counts: it ran, and every write was refused by the host.
    let count = |k: &str| -> u64 {
        summary
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in the attacker's summary {summary:?}"))
    };
    assert!(count("rounds") > 10, "{summary:?}");
    for k in ["swapped", "planted", "filled", "mknod", "setuid", "mkdir"] {
        assert_eq!(
            count(k),
            0,
            "{k}: the host let the guest write its share: {summary:?}"
        );
    }
    assert!(
        summary.get("errors").is_some_and(|e| e.contains("EROFS")),
        "the attacker's writes were not refused as a read-only share: {summary:?}"
    );

    // The bystander pod still works.
    let out = cri
        .exec_sync(&quiet, &["cat", "/etc/hostname"], 60)
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.trim()),
        (0, "bystander"),
        "{out:?}"
    );

    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    assert_pod_gone_while_others_run(&ctrd, &pod.id, Duration::from_secs(30));
    remove_pod(&ctrd, &cri, &bystander).await;
}
