//! containerd 2.x's Sandbox API: the `microvm` handler with `sandboxer = "shim"`, so containerd
//! creates each pod through the shim's `containerd.runtime.sandbox.v1.Sandbox` service
//! (CreateSandbox, StartSandbox, ... ShutdownSandbox) instead of a pause container's task
//! (docs/testing-containerd.md). On the [`test_hypervisor`] backend (QEMU by default), through
//! CRI on a private containerd 2.x: `MICROVM_TEST_CONTAINERD_BIN` when it names one, else
//! Debian sid's, unpacked privately by scripts/install-containerd.sh (the network to Debian's
//! mirror on the first run; cached). Needs root, QEMU, `make kernel initrd`.
//!
//! The test names start with `shim_sandboxer_`: scripts/run-tests.sh runs them in its
//! containerd 2.1 section only (`--skip shim_sandboxer_` elsewhere).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use microvm_tests::containerd::{
    ContainerdLine, ContainerdOptions, PrivateContainerd, CONTAINERD_BIN_ENV,
};
use microvm_tests::cri::{container_config, v1, CriClient};
use microvm_tests::host_cgroup::HostCgroup;
use microvm_tests::images::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use microvm_tests::microvm_pods::*;
use microvm_tests::pod_net;

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A containerd 2.x folder: the harness's when it is 2.x, else sid's from the cache.
fn containerd_2x_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os(CONTAINERD_BIN_ENV).filter(|d| !d.is_empty()) {
        let out = Command::new(PathBuf::from(&dir).join("containerd"))
            .arg("--version")
            .output()
            .expect("containerd --version");
        let version = String::from_utf8_lossy(&out.stdout);
        if matches!(
            microvm_tests::containerd::containerd_line(&version),
            Some((ContainerdLine::V2, _))
        ) {
            return PathBuf::from(dir);
        }
    }
    let out = Command::new(repo().join("scripts/install-containerd.sh"))
        .arg("sid")
        .output()
        .expect("run scripts/install-containerd.sh");
    assert!(
        out.status.success(),
        "scripts/install-containerd.sh sid: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A private containerd 2.x whose `microvm` handler has `sandboxer = "shim"`, with busybox.
async fn start_shim_sandboxer() -> (tempfile::TempDir, PrivateContainerd, CriClient) {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), None);
    let ctrd = PrivateContainerd::start(ContainerdOptions {
        extra_path: vec![shim_bin_dir()],
        microvm_config: Some(config),
        bin_dir: Some(containerd_2x_bin()),
        microvm_sandboxer: Some("shim".into()),
        ..ContainerdOptions::default()
    })
    .unwrap_or_else(|e| panic!("starting the private containerd: {e}"));
    assert_eq!(ctrd.line(), ContainerdLine::V2);
    let cri = CriClient::connect(ctrd.socket(), CALL_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.wait_ready(&[PAUSE_IMAGE, BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (dir, ctrd, cri)
}

fn containerd_log(ctrd: &PrivateContainerd) -> String {
    std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default()
}

/// The containers containerd knows (`ctr containers ls -q`).
fn containerd_containers(ctrd: &PrivateContainerd) -> Vec<String> {
    let out = ctrd
        .ctr(&["containers", "ls", "-q"], Duration::from_secs(30))
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A pod with 96 MiB and 250m of RuntimeClass overhead in its PodSandboxConfig.
fn pod_with_overhead(ctrd: &PrivateContainerd, name: &str) -> v1::PodSandboxConfig {
    let mut config = ctrd.pod_config(name, HashMap::new()).unwrap();
    let linux = config.linux.get_or_insert_with(Default::default);
    linux.overhead = Some(v1::LinuxContainerResources {
        cpu_period: 100_000,
        cpu_quota: 25_000,
        memory_limit_in_bytes: 96 << 20,
        ..Default::default()
    });
    config
}

/// A whole pod through the Sandbox API: no pause container; the VM boots at StartSandbox with
/// the typed overhead on its host cgroup; app containers run in it with their output and exit
/// code; exec; the pod's IP from CNI is the guest's and serves the host; StopPodSandbox ends
/// the VM (NOTREADY, exit 0); RemovePodSandbox's ShutdownSandbox ends the shim; nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shim_sandboxer_pod_runs_in_a_vm_without_a_pause_container_and_leaves_nothing() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_shim_sandboxer().await;

    let t = Instant::now();
    let config = pod_with_overhead(&ctrd, "sandbox-api");
    let pod = cri
        .run_pod_sandbox(config, "microvm")
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let run = t.elapsed();
    let status = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
    assert_eq!(
        status.status.as_ref().map(|s| s.state),
        Some(0),
        "pod not SANDBOX_READY: {status:?}"
    );
    // No pause container: the pod is no containerd container, and the shim created it through
    // the Sandbox API.
    assert!(
        !containerd_containers(&ctrd).contains(&pod.id),
        "the pod is a containerd container (a pause container?)"
    );
    let log = containerd_log(&ctrd);
    assert!(
        log.contains(&format!(
            "sandbox {}: created through the Sandbox API",
            pod.id
        )),
        "no CreateSandbox in the shim's log:\n{}",
        ctrd.log_tail()
    );
    assert_eq!(shim_pids(&ctrd, &pod.id).len(), 1, "one shim for the pod");
    // The typed overhead sized the pod's host cgroup.
    assert!(
        log.contains("overhead 96 MiB (RuntimeClass overhead in the PodSandboxConfig)")
            && log.contains("overhead 250m (RuntimeClass overhead in the PodSandboxConfig)"),
        "the typed overhead is not the host cgroup's:\n{}",
        ctrd.log_tail()
    );
    let cg = HostCgroup::of_pod(ctrd.cgroup_parent(), &pod.id).expect("the pod's host cgroup");
    assert_eq!(cg.cpu_limit_millis.map(|m| m % 1000), Some(250), "{cg:?}");

    // An app container with output and exit code.
    let exited = run_container_to_exit(
        &ctrd,
        &cri,
        &pod,
        container_config("exit3", BUSYBOX_IMAGE, &["sh", "-c", "echo hello; exit 3"]),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(exited.status.exit_code, 3, "{:?}", exited.status);
    assert_eq!(exited.stdout(), ["hello"], "{:?}", exited.log);
    cri.remove_container(&exited.id).await.unwrap();

    // A server in the pod, reached from the host at the pod's IP, which is the guest's.
    let web = cri
        .create_container(
            &pod,
            container_config(
                "web",
                BUSYBOX_IMAGE,
                &[
                    "sh",
                    "-c",
                    "mkdir -p /www && echo sandbox-api > /www/index.html && \
                     exec httpd -f -p 8080 -h /www",
                ],
            ),
        )
        .await
        .unwrap();
    cri.start_container(&web).await.unwrap();
    let ip = pod_net::pod_ip(&cri, &pod.id).await.unwrap();
    let addrs = cri
        .exec_sync(&web, &["ip", "-4", "addr"], 30)
        .await
        .unwrap();
    assert_eq!(addrs.exit_code, 0, "{addrs:?}");
    assert!(
        addrs.stdout.contains(&format!("inet {ip}/")),
        "the pod IP {ip} is not the guest's: {}",
        addrs.stdout
    );
    pod_net::wait_page(
        SocketAddr::new(ip, 8080),
        "sandbox-api",
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("the pod's server from the host: {e}"));
    // Exec: output, stderr and exit code.
    let out = cri
        .exec_sync(
            &web,
            &["sh", "-c", "cat /www/index.html; echo oops >&2; exit 7"],
            30,
        )
        .await
        .unwrap();
    assert_eq!(
        (out.stdout.trim(), out.stderr.trim(), out.exit_code),
        ("sandbox-api", "oops", 7)
    );

    let t = Instant::now();
    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    let stop = t.elapsed();
    let status = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
    assert_eq!(status.status.map(|s| s.state), Some(1), "SANDBOX_NOTREADY");
    // The shim's log reaches containerd's through a fifo: wait (bounded) for the line.
    let ended = format!("sandbox {}: VM ended, exit status 0", pod.id);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !containerd_log(&ctrd).contains(&ended) {
        assert!(
            Instant::now() < deadline,
            "StopSandbox did not end the VM:\n{}",
            ctrd.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = Instant::now();
    cri.remove_container(&web).await.unwrap();
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    let remove = t.elapsed();
    assert_pod_gone(&ctrd, &pod.id, Duration::from_secs(20));
    assert!(HostCgroup::of_pod(ctrd.cgroup_parent(), &pod.id).is_none());
    eprintln!(
        "sandbox API pod ({} backend): run {run:?}, stop {stop:?}, remove {remove:?}",
        test_hypervisor()
    );
}

/// A pod that asks for the host's PID namespace is refused at CreateSandbox, before any VM,
/// naming the field; nothing is left. (Not hostNetwork: containerd 2.1.9 itself crashes on a
/// hostNetwork pod with `sandboxer = "shim"`, a nil spec in its `NewBundle`, before any shim
/// runs: docs/testing-containerd.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shim_sandboxer_refuses_a_host_pid_pod_naming_it_and_leaks_nothing() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_shim_sandboxer().await;
    let before = state_entries();
    let mut config = ctrd
        .pod_config("sandbox-api-hostpid", HashMap::new())
        .unwrap();
    let linux = config.linux.get_or_insert_with(Default::default);
    linux
        .security_context
        .get_or_insert_with(Default::default)
        .namespace_options
        .get_or_insert_with(Default::default)
        .pid = v1::NamespaceMode::Node as i32;
    let err = cri
        .run_pod_sandbox(config, "microvm")
        .await
        .expect_err("a hostPID pod must be refused")
        .to_string();
    assert!(err.contains("hostPID"), "{err}");
    assert!(err.contains("runc"), "the refusal names no way out: {err}");
    assert_nothing_new(&ctrd, &before);
    assert!(cri.list_pod_ids().await.unwrap().is_empty());
}
