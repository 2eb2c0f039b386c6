//! The containerd test harness proven with runc: a private containerd (needs root, Debian's
//! containerd, runc and CNI plugins: scripts/install-deps.sh) driven through CRI with the `runc`
//! handler. The `microvm` handler's tests reuse the same harness.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use microvm_tests::containerd::{pid_alive, ContainerdOptions, PrivateContainerd};
use microvm_tests::cri::{container_config, read_cri_log, CriClient};
use microvm_tests::images::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use microvm_tests::lifecycle::{pods_host_memory, timed_pod_lifecycle, LifecycleTimings};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use testkit::require_root;

const CALL_TIMEOUT: Duration = Duration::from_secs(60);

async fn start() -> (PrivateContainerd, CriClient) {
    require_root();
    let ctrd = PrivateContainerd::start(ContainerdOptions::default())
        .unwrap_or_else(|e| panic!("starting the private containerd: {e}"));
    let cri = CriClient::connect(ctrd.socket(), CALL_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.wait_ready(&[PAUSE_IMAGE, BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (ctrd, cri)
}

fn host_kernel_release() -> String {
    let out = std::process::Command::new("uname")
        .arg("-r")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Waits (bounded) until the instance has no shim or pod process left.
fn wait_no_processes(ctrd: &PrivateContainerd, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let left = ctrd.leftover_processes();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes left after {timeout:?}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runc_pod_lifecycle_through_cri_leaves_nothing() {
    let (ctrd, cri) = start().await;
    eprintln!(
        "private containerd serving with images imported in {:?}",
        ctrd.started_in()
    );
    let mut steps: Vec<(&str, Duration)> = Vec::new();
    let mut timed = Instant::now();
    let mut step = |name: &'static str| {
        steps.push((name, timed.elapsed()));
        timed = Instant::now();
    };
    let total = Instant::now();

    let pod = cri
        .run_pod_sandbox(
            ctrd.pod_config("runc-lifecycle", HashMap::new()).unwrap(),
            "runc",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    step("run");
    let netns = cri.pod_netns_path(&pod.id).await.unwrap();
    let netns = netns.expect("a CNI pod has a network namespace path");
    let ip = cri
        .pod_sandbox_status(&pod.id, false)
        .await
        .unwrap()
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .unwrap_or_default();
    let subnet_prefix = ctrd.subnet().trim_end_matches("0/24").to_string();
    assert!(
        ip.starts_with(&subnet_prefix),
        "pod IP {ip:?} not in the private subnet {}",
        ctrd.subnet()
    );
    assert!(netns.exists(), "{} missing", netns.display());

    // A short-lived container: output to the CRI log, exit code 3.
    let exits = cri
        .create_container(
            &pod,
            container_config("exit3", BUSYBOX_IMAGE, &["sh", "-c", "echo hello; exit 3"]),
        )
        .await
        .unwrap();
    step("create");
    cri.start_container(&exits).await.unwrap();
    step("start");
    let status = cri
        .wait_container_exited(&exits, Duration::from_secs(30))
        .await
        .unwrap();
    step("exit");
    assert_eq!(status.exit_code, 3, "{status:?}");
    let log = read_cri_log(Path::new(&status.log_path)).unwrap();
    assert!(
        log.iter()
            .any(|l| l.stream == "stdout" && !l.partial && l.text == "hello"),
        "hello not in {}: {log:?}",
        status.log_path
    );

    // A long-running container to exec in.
    let sleeper = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&sleeper).await.unwrap();
    step("create+start sleeper");
    let uname = cri.exec_sync(&sleeper, &["uname", "-r"], 30).await.unwrap();
    step("exec");
    assert_eq!(uname.exit_code, 0, "{uname:?}");
    assert_eq!(
        uname.stdout.trim(),
        host_kernel_release(),
        "runc shares the host kernel"
    );
    let failing = cri
        .exec_sync(&sleeper, &["sh", "-c", "echo oops >&2; exit 7"], 30)
        .await
        .unwrap();
    assert_eq!((failing.exit_code, failing.stderr.trim()), (7, "oops"));
    assert!(
        !ctrd.mounts().is_empty(),
        "running containers have rootfs mounts"
    );

    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    step("stop");
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    step("remove");
    let total = total.elapsed();
    eprintln!(
        "runc pod lifecycle: {} total={total:?}",
        steps
            .iter()
            .map(|(n, d)| format!("{n}={d:?}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Nothing of the pod is left: processes, mounts, cgroups, netns, shim socket.
    wait_no_processes(&ctrd, Duration::from_secs(10));
    assert_eq!(ctrd.mounts(), Vec::<PathBuf>::new(), "mounts left");
    assert_eq!(
        ctrd.leftover_cgroups(),
        Vec::<PathBuf>::new(),
        "cgroups left"
    );
    assert!(!netns.exists(), "netns {} left", netns.display());
    let shim_socket = ctrd.shim_socket(&pod.id);
    assert!(
        !shim_socket.exists(),
        "shim socket {} left",
        shim_socket.display()
    );
    assert!(cri.list_pod_ids().await.unwrap().is_empty());
}

/// Dropping the harness with a pod still running removes it and everything of the instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_harness_with_a_running_pod_leaves_nothing() {
    let (ctrd, cri) = start().await;
    let pod = cri
        .run_pod_sandbox(
            ctrd.pod_config("runc-dropped", HashMap::new()).unwrap(),
            "runc",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let sleeper = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&sleeper).await.unwrap();
    let netns = cri.pod_netns_path(&pod.id).await.unwrap().unwrap();
    // runc's StartContainer returns once `runc start` told the container's init to go on: its
    // process may still be `runc init` for a moment (seen on a loaded host) before it execs.
    let deadline = Instant::now() + Duration::from_secs(10);
    let running = loop {
        let running = ctrd.leftover_processes();
        if running.iter().any(|p| p.cmdline.contains("sleep 3600")) {
            break running;
        }
        assert!(Instant::now() < deadline, "{running:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let dir = ctrd.dir().to_path_buf();
    let socket = ctrd.socket().to_path_buf();
    let bridge = ctrd.bridge_name();
    assert!(Path::new("/sys/class/net").join(&bridge).exists());
    let cgroup_parent = ctrd.cgroup_parent().to_string();
    let shim_socket = ctrd.shim_socket(&pod.id);
    drop(cri);

    drop(ctrd);

    assert!(!dir.exists(), "{} left", dir.display());
    assert!(!netns.exists(), "netns {} left", netns.display());
    assert!(!shim_socket.exists(), "{} left", shim_socket.display());
    assert!(
        !Path::new("/sys/class/net").join(&bridge).exists(),
        "bridge {bridge} left"
    );
    for hierarchy in ["memory", "pids", "cpu", "unified"] {
        let cg = Path::new("/sys/fs/cgroup")
            .join(hierarchy)
            .join(cgroup_parent.trim_start_matches('/'));
        assert!(!cg.exists(), "{} left", cg.display());
    }
    // Reparented processes are reaped by the host's init: allow it a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while running.iter().any(|p| pid_alive(p.pid)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive: Vec<_> = running.iter().filter(|p| pid_alive(p.pid)).collect();
    assert!(alive.is_empty(), "processes left: {alive:?}");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(dir.to_str().unwrap()),
        "mounts left under {}",
        dir.display()
    );
    let argv_holds_socket = std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| {
                c.split(|&b| b == 0)
                    .any(|a| a == socket.as_os_str().as_encoded_bytes())
            })
            .unwrap_or(false)
    });
    assert!(
        !argv_holds_socket,
        "a shim of the dropped containerd still runs"
    );
}

/// The `microvm` handler is configured (containerd tries to start its shim), and while no
/// `containerd-shim-microvm-v1` is on containerd's PATH, RunPodSandbox fails naming it and
/// leaks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_handler_without_its_shim_fails_cleanly() {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let installed: Vec<PathBuf> = std::env::split_paths(&path)
        .map(|d| d.join("containerd-shim-microvm-v1"))
        .filter(|p| p.exists())
        .collect();
    assert!(
        installed.is_empty(),
        "this test needs containerd-shim-microvm-v1 absent from PATH, found {installed:?}"
    );
    let (ctrd, cri) = start().await;
    let err = cri
        .run_pod_sandbox(
            ctrd.pod_config("no-shim", HashMap::new()).unwrap(),
            "microvm",
        )
        .await
        .expect_err("no microvm shim is installed");
    let message = err.to_string();
    eprintln!("RunPodSandbox(microvm) without the shim: {message}");
    assert!(
        message.contains("containerd-shim-microvm-v1"),
        "the error does not name the shim binary: {message}"
    );
    assert!(cri.list_pod_ids().await.unwrap().is_empty());
    wait_no_processes(&ctrd, Duration::from_secs(10));
    assert_eq!(ctrd.mounts(), Vec::<PathBuf>::new(), "mounts left");
    assert_eq!(
        ctrd.leftover_cgroups(),
        Vec::<PathBuf>::new(),
        "cgroups left"
    );
}

/// `ctr run` through the same private containerd (the `ctr run --runtime
/// io.containerd.microvm.v1` test uses this path): output, exit code, nothing left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctr_run_with_runc_runs_a_container() {
    let (ctrd, _cri) = start().await;
    let began = Instant::now();
    let out = ctrd
        .ctr_run(
            "io.containerd.runc.v2",
            BUSYBOX_IMAGE,
            "ctr-run-test",
            &["sh", "-c", "echo from-ctr; exit 0"],
            Duration::from_secs(60),
        )
        .unwrap();
    eprintln!("ctr run --rm (runc): {:?}", began.elapsed());
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "from-ctr");
    let exit = ctrd
        .ctr_run(
            "io.containerd.runc.v2",
            BUSYBOX_IMAGE,
            "ctr-run-exit",
            &["sh", "-c", "exit 5"],
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(exit.status.code(), Some(5));
    let containers = ctrd
        .ctr(&["containers", "ls", "-q"], Duration::from_secs(30))
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&containers.stdout).trim(),
        "",
        "--rm left containers"
    );
    wait_no_processes(&ctrd, Duration::from_secs(10));
    assert_eq!(ctrd.mounts(), Vec::<PathBuf>::new(), "mounts left");
    assert_eq!(
        ctrd.leftover_cgroups(),
        Vec::<PathBuf>::new(),
        "cgroups left"
    );
}

/// The shared timed lifecycle (what the benchmark runs per handler) with runc, three times, and
/// the host memory of an idle runc pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runc_timed_lifecycles_and_idle_pod_memory() {
    let (ctrd, cri) = start().await;
    let host = host_kernel_release();
    let mut runs = Vec::new();
    for i in 0..3 {
        let outcome =
            timed_pod_lifecycle(&ctrd, &cri, "runc", &format!("timed-{i}"), HashMap::new())
                .await
                .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
        assert_eq!(outcome.kernel_release, host);
        let netns = outcome.netns.expect("a CNI pod has a netns");
        assert!(!netns.exists(), "netns {} left", netns.display());
        wait_no_processes(&ctrd, Duration::from_secs(10));
        assert_eq!(ctrd.mounts(), Vec::<PathBuf>::new(), "mounts left");
        assert_eq!(
            ctrd.leftover_cgroups(),
            Vec::<PathBuf>::new(),
            "cgroups left"
        );
        runs.push(outcome.timings);
    }
    let medians = LifecycleTimings::median(&runs);
    eprintln!(
        "runc timed lifecycle, median of {}: {}",
        runs.len(),
        medians
            .steps()
            .iter()
            .map(|(n, d)| format!("{n}={:.0?}", d))
            .collect::<Vec<_>>()
            .join(" ")
    );

    // An idle pod: pause plus a busybox sleep.
    let before = pods_host_memory(&ctrd);
    let pod = cri
        .run_pod_sandbox(ctrd.pod_config("idle", HashMap::new()).unwrap(), "runc")
        .await
        .unwrap();
    let id = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = pods_host_memory(&ctrd);
    eprintln!(
        "runc idle pod host memory: {:.1} MiB (before the pod: {:.1} MiB)",
        idle as f64 / 1048576.0,
        before as f64 / 1048576.0
    );
    assert!(
        idle > 1 << 20,
        "an idle runc pod charges more than 1 MiB: {idle}"
    );
    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    wait_no_processes(&ctrd, Duration::from_secs(10));
}

/// kill -9 of a runc pod's shim (containerd-shim-runc-v2 serves the whole pod, as ours does)
/// with an app container running: what containerd makes of it, as kubelet would see it —
/// StopPodSandbox, then RemovePodSandbox retried (kubelet retries) until it succeeds. The
/// reference for the same test of the `microvm` handler on each containerd release
/// (docs/testing-containerd.md): how long until the pod can be removed, and whether it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runc_pod_after_kill_9_of_its_shim_is_removed_as_kubelet_retries() {
    let (ctrd, cri) = start().await;
    let pod = cri
        .run_pod_sandbox(
            ctrd.pod_config("runc-kill9", HashMap::new()).unwrap(),
            "runc",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let app = cri
        .create_container(
            &pod,
            container_config("app", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&app).await.unwrap();
    let shims: Vec<i32> = ctrd
        .leftover_processes()
        .into_iter()
        .filter(|p| p.cmdline.contains("containerd-shim-runc-v2"))
        .map(|p| p.pid)
        .collect();
    assert_eq!(shims.len(), 1, "one runc shim for the pod: {shims:?}");
    // SAFETY: kill(2) on the pod's shim process found above.
    unsafe { libc::kill(shims[0], libc::SIGKILL) };
    let killed = Instant::now();
    let attempts = cri
        .stop_and_remove_pod_retrying(&pod.id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the runc pod could not be removed within 60 s of kill -9 of its shim: {e}\n\
                 containerd log:\n{}",
                ctrd.log_tail()
            )
        });
    eprintln!(
        "{}: runc pod removed {:?} after kill -9 of its shim, on attempt {attempts}",
        ctrd.version(),
        killed.elapsed()
    );
    wait_no_processes(&ctrd, Duration::from_secs(30));
    // containerd-shim-runc-v2 killed with -9 leaves its socket in /run/containerd/s (the host's,
    // shared with the system containerd): containerd removes it on no release. Ours is checked
    // by the microvm tests; runc's is removed here so the test leaves nothing.
    let socket = ctrd.shim_socket(&pod.id);
    if socket.exists() {
        eprintln!(
            "runc's shim left {} after kill -9: removed",
            socket.display()
        );
        std::fs::remove_file(&socket).unwrap();
    }
}
