//! The pod's host cgroup through CRI (docs/overhead.md): with a pod cgroup made
//! as kubelet makes it (sized to the containers plus an overhead) given as
//! `linux.cgroup_parent`, the shim makes `<pod cgroup>/microvm-<id>`, every process of the pod
//! (the shim with all its threads, QEMU and its helpers; the shim alone on the embedded VMM) is
//! in it, its limits follow the rule (VM + overhead, capped by the pod cgroup) with the overhead
//! from each source once (the pod cgroup, an annotation, the config), a memory hog in the guest
//! is OOM-killed in the guest while the VMM lives on, the sandbox's Stats show the host cgroup
//! next to the guest, Update resizes it, memory the guest frees leaves it again (free page
//! reporting), a pod that outgrows its host cgroup is ended by the host's OOM killer and told
//! as such (OOMKilled containers, the shim's warn line), and nothing is left after removal,
//! after kill -9 of the shim, or after a boot that failed.
//!
//! The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by default; the nested lane runs it on the
//! embedded VMM: docs/nested-lane.md). Needs root, containerd, QEMU and vhost-device-vsock
//! (scripts/install-deps.sh), and `make kernel initrd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_cri::v1::LinuxContainerResources;
use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::lifecycle::pod_processes;
use microvm_tests::microvm_pods::*;

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MI: u64 = 1 << 20;
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The test config's guest base memory (MiB), the VM's memory beyond the containers' sum.
const GUEST_BASE_MIB: u64 = 128;
/// The test config's default overhead.
const CONFIG_OVERHEAD_MIB: u64 = 96;
const CONFIG_OVERHEAD_CPU_MILLIS: u64 = 300;

/// Whether the host has one cgroup v2 hierarchy at /sys/fs/cgroup.
fn unified() -> bool {
    Path::new(CGROUP_ROOT).join("cgroup.controllers").exists()
}

/// Every cgroup hierarchy's mount point (v1: one per controller set; v2: the one).
fn hierarchies() -> Vec<PathBuf> {
    if unified() {
        return vec![PathBuf::from(CGROUP_ROOT)];
    }
    std::fs::read_dir(CGROUP_ROOT)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .collect()
}

/// The directory of cgroup `rel` of a controller (`memory`, `cpu`).
fn controller_dir(controller: &str, rel: &str) -> PathBuf {
    if unified() {
        Path::new(CGROUP_ROOT).join(rel)
    } else {
        Path::new(CGROUP_ROOT).join(controller).join(rel)
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_string()
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{} <- {value}: {e}", path.display()));
}

/// A pod cgroup as kubelet makes it: `<instance parent>/pod<n>` on every hierarchy, with a
/// memory limit and a CPU quota (per 100 ms) where given. Removed on drop.
struct PodCgroup {
    rel: String,
    driver: Driver,
}

/// kubelet's cgroup driver, which decides the form of `linux.cgroup_parent`.
#[derive(Clone, Copy, PartialEq)]
enum Driver {
    /// A path: `/<parent>/pod<uid>`.
    Cgroupfs,
    /// A slice name, `kubepods-burstable-pod<uid>.slice`, which containerd turns into the
    /// `slice:cri-containerd:<id>` cgroupsPath and systemd places at
    /// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice`.
    Systemd,
}

impl PodCgroup {
    fn create(ctrd: &PrivateContainerd, name: &str, memory: Option<u64>, cpu: Option<u64>) -> Self {
        let rel = format!(
            "{}/pod-{name}",
            ctrd.cgroup_parent().trim_start_matches('/')
        );
        Self::make(rel, Driver::Cgroupfs, memory, cpu)
    }

    /// The pod cgroup of kubelet's systemd driver, made as systemd would make the slices (here
    /// by hand: the shim writes cgroupfs directly in both forms). A unique pod uid keeps it apart
    /// from anything else on the host.
    fn create_systemd(memory: Option<u64>, cpu: Option<u64>) -> Self {
        let uid = format!(
            "{}x{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let rel =
            format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice");
        Self::make(rel, Driver::Systemd, memory, cpu)
    }

    fn make(rel: String, driver: Driver, memory: Option<u64>, cpu: Option<u64>) -> Self {
        if unified() {
            // Each ancestor hands memory and cpu down, as systemd / kubelet set it up.
            let mut dir = PathBuf::from(CGROUP_ROOT);
            for part in rel.split('/') {
                let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+memory +cpu");
                dir.push(part);
                std::fs::create_dir_all(&dir).unwrap();
            }
        } else {
            for h in hierarchies() {
                std::fs::create_dir_all(h.join(&rel)).unwrap();
            }
        }
        let pc = PodCgroup { rel, driver };
        pc.set_limits(memory, cpu);
        pc
    }

    /// Sets (or lifts, `None`) the pod cgroup's limits, as kubelet does on a resize.
    fn set_limits(&self, memory: Option<u64>, cpu_millis: Option<u64>) {
        let mem = controller_dir("memory", &self.rel);
        let cpu = controller_dir("cpu", &self.rel);
        if unified() {
            let m = memory.map_or("max".to_string(), |b| b.to_string());
            write(&mem.join("memory.max"), &m);
            let c = cpu_millis.map_or("max 100000".to_string(), |c| format!("{} 100000", c * 100));
            write(&cpu.join("cpu.max"), &c);
        } else {
            let m = memory.map_or("-1".to_string(), |b| b.to_string());
            write(&mem.join("memory.limit_in_bytes"), &m);
            write(&cpu.join("cpu.cfs_period_us"), "100000");
            let c = cpu_millis.map_or("-1".to_string(), |c| (c * 100).to_string());
            write(&cpu.join("cpu.cfs_quota_us"), &c);
        }
    }

    /// `linux.cgroup_parent` for the pod, in its driver's form.
    fn parent(&self) -> String {
        match self.driver {
            Driver::Cgroupfs => format!("/{}", self.rel),
            Driver::Systemd => self.rel.rsplit('/').next().unwrap().to_string(),
        }
    }

    /// The pod's host cgroup, relative to the roots.
    fn host_cgroup(&self, pod_id: &str) -> String {
        format!("{}/microvm-{pod_id}", self.rel)
    }

    /// The host cgroup's directories still present on any hierarchy.
    fn host_cgroup_dirs(&self, pod_id: &str) -> Vec<PathBuf> {
        let rel = self.host_cgroup(pod_id);
        hierarchies()
            .into_iter()
            .map(|h| h.join(&rel))
            .filter(|d| d.exists())
            .collect()
    }

    /// Any `microvm-*` below the pod cgroup on any hierarchy.
    fn any_microvm_dirs(&self) -> Vec<PathBuf> {
        hierarchies()
            .into_iter()
            .filter_map(|h| std::fs::read_dir(h.join(&self.rel)).ok())
            .flat_map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .filter(|p| {
                p.is_dir()
                    && p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("microvm-"))
            })
            .collect()
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for h in hierarchies() {
            let _ = std::fs::remove_dir(h.join(&self.rel));
            if self.driver == Driver::Systemd {
                // The QoS and kubepods slices, where this test made them (busy ones stay).
                let _ = std::fs::remove_dir(h.join("kubepods.slice/kubepods-burstable.slice"));
                let _ = std::fs::remove_dir(h.join("kubepods.slice"));
            }
        }
    }
}

/// The host cgroup's limits: memory bytes and CPU millicores.
fn host_limits(rel: &str) -> (u64, u64) {
    if unified() {
        let mem = read(&controller_dir("memory", rel).join("memory.max"));
        let cpu = read(&controller_dir("cpu", rel).join("cpu.max"));
        let (q, p) = cpu.split_once(' ').unwrap();
        (
            mem.parse().unwrap(),
            q.parse::<u64>().unwrap() * 1000 / p.parse::<u64>().unwrap(),
        )
    } else {
        let mem = read(&controller_dir("memory", rel).join("memory.limit_in_bytes"));
        let d = controller_dir("cpu", rel);
        let q: u64 = read(&d.join("cpu.cfs_quota_us")).parse().unwrap();
        let p: u64 = read(&d.join("cpu.cfs_period_us")).parse().unwrap();
        (mem.parse().unwrap(), q * 1000 / p)
    }
}

/// OOM kills the host kernel made in cgroup `rel`.
fn host_oom_kills(rel: &str) -> u64 {
    let (file, key) = if unified() {
        ("memory.events", "oom_kill")
    } else {
        ("memory.oom_control", "oom_kill")
    };
    read(&controller_dir("memory", rel).join(file))
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Threads of process `pid` whose cgroup (on any hierarchy) is not `/<rel>`.
fn threads_outside(pid: i32, rel: &str) -> Vec<String> {
    let want = format!("/{rel}");
    let mut outside = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return outside;
    };
    for t in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(t.path().join("cgroup")) else {
            continue;
        };
        for line in text.lines() {
            let mut it = line.splitn(3, ':');
            let (id, controllers, path) = (it.next(), it.next(), it.next().unwrap_or(""));
            // A v1 host's unified hierarchy (0::) has no controllers: the shim leaves it alone.
            if !unified() && id == Some("0") && controllers == Some("") {
                continue;
            }
            if path != want {
                outside.push(format!("{pid}/task/{:?}: {line}", t.file_name()));
            }
        }
    }
    outside
}

async fn start_cgroup_containerd(
    kernel: Option<&Path>,
) -> (tempfile::TempDir, PrivateContainerd, CriClient) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let config = write_config(dir.path(), kernel);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!(
        "guest_base_memory_mib = {GUEST_BASE_MIB}\n[cgroup]\noverhead_memory_mib = \
         {CONFIG_OVERHEAD_MIB}\noverhead_cpu_millis = {CONFIG_OVERHEAD_CPU_MILLIS}\n"
    ));
    std::fs::write(&config, text).unwrap();
    let (ctrd, cri) = start(&config).await;
    cri.wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (dir, ctrd, cri)
}

/// RunPodSandbox under `pod_cgroup` with the containers' sum `memory` / `cpu_millis` (what
/// kubelet passes as the pod's resources; containerd turns it into the sandbox-* annotations).
async fn run_pod_in(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    name: &str,
    pod_cgroup: &PodCgroup,
    resources: Option<(u64, u64)>,
    annotations: HashMap<String, String>,
) -> Result<Pod, String> {
    let mut config = ctrd.pod_config(name, annotations).unwrap();
    let linux = config.linux.get_or_insert_with(Default::default);
    linux.cgroup_parent = pod_cgroup.parent();
    if let Some((memory, cpu_millis)) = resources {
        linux.resources = Some(LinuxContainerResources {
            memory_limit_in_bytes: memory as i64,
            cpu_period: 100_000,
            cpu_quota: (cpu_millis * 100) as i64,
            ..Default::default()
        });
    }
    cri.run_pod_sandbox(config, "microvm")
        .await
        .map_err(|e| format!("RunPodSandbox {name}: {e}"))
}

/// Every host process of the pod (the shim and its descendants) has all its threads in the
/// pod's host cgroup; returns their pids and names.
fn assert_pod_processes_inside(
    ctrd: &PrivateContainerd,
    pod: &Pod,
    rel: &str,
) -> Vec<(i32, String)> {
    let procs = pod_processes(ctrd, &pod.id);
    assert!(!procs.is_empty(), "no host process of pod {}", pod.id);
    let mut outside = Vec::new();
    for p in &procs {
        outside.extend(threads_outside(p.pid, rel));
    }
    assert!(
        outside.is_empty(),
        "threads of pod {} outside {rel}:\n{}",
        pod.id,
        outside.join("\n")
    );
    if test_hypervisor() == "qemu" {
        assert!(
            procs.iter().any(|p| p.name.starts_with("qemu")),
            "no QEMU among the pod's processes: {procs:?}"
        );
    }
    procs.into_iter().map(|p| (p.pid, p.name)).collect()
}

/// The shim's boot log line about the host cgroup (in containerd's log).
fn cgroup_log_line(ctrd: &PrivateContainerd, pod_id: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default();
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("host cgroup") && l.contains(&format!("microvm-{pod_id}")))
        {
            return line.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no host cgroup line for {pod_id} in containerd's log:\n{}",
            ctrd.log_tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Stops and removes the pod, then checks its host cgroup is gone on every hierarchy and
/// nothing else of it is left.
async fn remove_and_check(ctrd: &PrivateContainerd, cri: &CriClient, pod: &Pod, pc: &PodCgroup) {
    // Retried as kubelet does: after kill -9 of the shim, containerd 1.7 and 2.x report the
    // app container running for a moment (runc pods alike).
    cri.stop_and_remove_pod_retrying(&pod.id, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pc.host_cgroup_dirs(&pod.id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        pc.host_cgroup_dirs(&pod.id),
        Vec::<PathBuf>::new(),
        "host cgroup left\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    assert!(!Path::new(STATE_ROOT).join(&pod.id).exists());
}

/// `ctr task metrics --format json` of the sandbox: the Metrics the shim's Stats returned.
fn sandbox_metrics(ctrd: &PrivateContainerd, pod_id: &str) -> serde_json::Value {
    let out = ctrd
        .ctr(
            &["task", "metrics", "--format", "json", pod_id],
            Duration::from_secs(30),
        )
        .unwrap();
    assert!(
        out.status.success(),
        "ctr task metrics: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "ctr task metrics output: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn num(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_u64().unwrap_or(0)
}

/// The pod cgroup source: limits, processes, Stats, a guest OOM that leaves the VMM alive,
/// Update resizing the host cgroup, and kill -9 of the shim leaving no cgroup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_lives_in_its_host_cgroup_sized_from_the_pod_cgroup() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_cgroup_containerd(None).await;
    // Containers 256 MiB and 1 CPU; the RuntimeClass overhead kubelet added: 256 MiB, 500m.
    let sum = (256 * MI, 1000);
    let pc = PodCgroup::create(&ctrd, "a", Some(512 * MI), Some(1500));
    let pod = run_pod_in(&ctrd, &cri, "cg-pod", &pc, Some(sum), HashMap::new())
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);

    // The rule: VM (256 + 128 MiB, 1 vCPU) + overhead (512 - 256 MiB, 1500m - 1000m), capped
    // by the pod cgroup: 512 MiB and 1500m.
    assert_eq!(host_limits(&rel), (512 * MI, 1500));
    let line = cgroup_log_line(&ctrd, &pod.id);
    assert!(
        line.contains("overhead 256 MiB (pod cgroup limit minus the containers' sum)")
            && line.contains("overhead 500m (pod cgroup limit minus the containers' sum)"),
        "{line}"
    );
    let procs = assert_pod_processes_inside(&ctrd, &pod, &rel);
    eprintln!("pod processes in {rel}: {procs:?}\n{line}");

    // A long-running container, then a hog that eats the guest's memory.
    let sleeper = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&sleeper).await.unwrap();
    let hog = run_container_to_exit(
        &ctrd,
        &cri,
        &pod,
        container_config("hog", BUSYBOX_IMAGE, &["sh", "-c", "tail /dev/zero"]),
        Duration::from_secs(240),
    )
    .await;
    assert_eq!(
        hog.status.exit_code, 137,
        "the hog was killed by the guest's OOM killer: {:?}",
        hog.status
    );
    assert_eq!(
        host_oom_kills(&rel),
        0,
        "the host's OOM killer acted in {rel}"
    );
    for (pid, name) in &procs {
        assert!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "{name} ({pid}) died with the guest's OOM"
        );
    }
    let out = cri
        .exec_sync(&sleeper, &["echo", "alive"], 60)
        .await
        .unwrap();
    assert_eq!(out.stdout.trim(), "alive", "{out:?}");

    // Stats: the host cgroup's memory and CPU, the guest's memory in use and processes.
    let m = sandbox_metrics(&ctrd, &pod.id);
    let host_usage = num(&m, &["memory", "usage"]);
    let guest_used = num(&m, &["memory", "anon"]);
    assert_eq!(num(&m, &["memory", "usage_limit"]), 512 * MI, "{m}");
    assert!(host_usage > guest_used && guest_used > 0, "{m}");
    // (max_usage, the host peak, is in the Metrics too, but containerd 1.6's ctr drops it:
    // its cgroups v2 proto predates the field. The teardown log line carries the peak.)
    assert!(num(&m, &["cpu", "usage_usec"]) > 0, "{m}");
    assert!(num(&m, &["pids", "current"]) > 0, "{m}");
    eprintln!(
        "sandbox metrics: host {} MiB, guest {} MiB",
        host_usage / MI,
        guest_used / MI
    );

    // kubelet resizes the pod cgroup, then updates a container: the host cgroup follows the
    // rule with the new cap (VM 384 + overhead 256 = 640 MiB now fits under 1 GiB).
    pc.set_limits(Some(1024 * MI), Some(2000));
    cri.update_container_resources(
        &sleeper,
        LinuxContainerResources {
            memory_limit_in_bytes: 128 * MI as i64,
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(host_limits(&rel), (640 * MI, 1500));

    // kill -9 of the shim: containerd's `<shim> delete` removes the cgroup (killing QEMU
    // and its helpers first).
    let shims = shim_pids(&ctrd, &pod.id);
    assert_eq!(shims.len(), 1, "{shims:?}");
    // SAFETY: kill(2) on the pod's shim process found above.
    unsafe { libc::kill(shims[0], libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pc.host_cgroup_dirs(&pod.id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        pc.host_cgroup_dirs(&pod.id),
        Vec::<PathBuf>::new(),
        "host cgroup left after kill -9 of the shim\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    for (pid, name) in &procs {
        assert!(
            !microvm_tests::containerd::pid_alive(*pid),
            "{name} ({pid}) outlived its pod"
        );
    }
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
}

/// The host cgroup's memory charge (v2 `memory.current`, v1 `memory.usage_in_bytes`).
fn host_memory(rel: &str) -> u64 {
    let file = if unified() {
        "memory.current"
    } else {
        "memory.usage_in_bytes"
    };
    read(&controller_dir("memory", rel).join(file))
        .parse()
        .unwrap()
}

/// Polls the host cgroup's charge until `done` holds of it; returns the last reading, which
/// the caller checks (the bound is a liveness bound, not a timing target).
/// Starts a container `filler` that holds `bytes` of the guest's memory (busybox tail keeps
/// its whole input until EOF: zeros without a newline, held while the writer sleeps).
async fn start_filler(cri: &CriClient, pod: &Pod, bytes: u64) -> String {
    let filler = cri
        .create_container(
            pod,
            container_config(
                "filler",
                BUSYBOX_IMAGE,
                &[
                    "sh",
                    "-c",
                    &format!("(head -c {bytes} /dev/zero; sleep 3600) | tail"),
                ],
            ),
        )
        .await
        .unwrap();
    cri.start_container(&filler).await.unwrap();
    filler
}

async fn poll_host_memory(rel: &str, bound: Duration, done: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + bound;
    loop {
        let now = host_memory(rel);
        if done(now) || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Free page reporting (docs/virtio-balloon.md): a container holds 160 MiB of the guest's
/// memory, and the pod's host cgroup is charged for most of it; once the container is stopped
/// and its memory freed in the guest, the guest reports the free blocks on the balloon, the
/// backend drops their host pages, and the charge comes back down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_guest_frees_leaves_the_pods_host_cgroup() {
    const FILL: u64 = 160 * MI;
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_cgroup_containerd(None).await;
    let pc = PodCgroup::create(&ctrd, "free", Some(1024 * MI), Some(2000));
    let pod = run_pod_in(
        &ctrd,
        &cri,
        "free-pod",
        &pc,
        Some((256 * MI, 1000)),
        HashMap::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);
    let idle = host_memory(&rel);

    let filler = start_filler(&cri, &pod, FILL).await;
    let held = poll_host_memory(&rel, Duration::from_secs(180), |m| m >= idle + FILL * 3 / 4).await;
    assert!(
        held >= idle + FILL * 3 / 4,
        "the host cgroup holds {} MiB with {} MiB held in the guest (idle: {} MiB)",
        held / MI,
        FILL / MI,
        idle / MI
    );

    cri.stop_container(&filler, 0)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let freed = poll_host_memory(&rel, Duration::from_secs(180), |m| {
        held.saturating_sub(m) >= FILL / 2
    })
    .await;
    eprintln!(
        "host cgroup of {}: idle {} MiB, {} MiB held in the guest: {} MiB, after the free: {} MiB",
        pod.id,
        idle / MI,
        FILL / MI,
        held / MI,
        freed / MI
    );
    assert!(
        held.saturating_sub(freed) >= FILL / 2,
        "the host cgroup still holds {} MiB after the guest freed {} MiB (held: {} MiB)\n\
         containerd log:\n{}",
        freed / MI,
        FILL / MI,
        held / MI,
        ctrd.log_tail()
    );
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
}

/// A pod that outgrows its host cgroup: kubelet lowers the pod cgroup (the shim's resize takes
/// the host cgroup's limit down with it) to a little above what the pod holds, then a container
/// fills 200 MiB of the guest: the host's OOM killer ends the VM's process. It is told as such:
/// the app containers end as OOMKilled with 137 (TaskOOM before their exits), the sandbox is
/// NOTREADY, and the shim's warn line names the host cgroup, the limit, its parts and what to
/// raise; nothing is left after the removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_the_hosts_oom_killer_ends_is_told_as_such() {
    use microvm_tests::cri::v1::PodSandboxState;
    const FILL: u64 = 200 * MI;
    // Room for what the backend's own side still grows by (QEMU's TCG translation cache, up
    // to 64 MiB, fills as the containers start), and no more: the guest's fill is slow in the
    // nested lane.
    let room = if test_hypervisor() == "qemu" {
        128 * MI
    } else {
        48 * MI
    };
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_cgroup_containerd(None).await;
    let pc = PodCgroup::create(&ctrd, "hostoom", Some(1024 * MI), Some(2000));
    let pod = run_pod_in(
        &ctrd,
        &cri,
        "hostoom-pod",
        &pc,
        Some((256 * MI, 1000)),
        HashMap::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);
    let sleeper = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&sleeper).await.unwrap();
    let idle = host_memory(&rel);
    let cap = (idle + room) / 4096 * 4096;
    pc.set_limits(Some(cap), Some(2000));
    cri.update_container_resources(
        &sleeper,
        LinuxContainerResources {
            memory_limit_in_bytes: 128 * MI as i64,
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(
        host_limits(&rel).0,
        cap,
        "the host cgroup follows the pod cgroup"
    );
    assert_eq!(host_oom_kills(&rel), 0);

    let filler = start_filler(&cri, &pod, FILL).await;
    let mut reasons = Vec::new();
    for id in [&filler, &sleeper] {
        let mut status = cri
            .wait_container_exited(id, Duration::from_secs(240))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{e} (host cgroup at {} MiB of {} MiB)\ncontainerd log:\n{}",
                    host_memory(&rel) / MI,
                    cap / MI,
                    ctrd.log_tail()
                )
            });
        // containerd records the reason from TaskOOM, published before the exit.
        let deadline = Instant::now() + Duration::from_secs(10);
        while status.reason != "OOMKilled" && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            status = cri.container_status(id).await.unwrap();
        }
        reasons.push((
            status.metadata.clone().map(|m| m.name),
            status.exit_code,
            status.reason,
        ));
    }
    // The kernel's count itself is gone with the cgroup (containerd deletes the ended
    // sandbox's task at once, and the shim's teardown removes the cgroup): the shim's line
    // below is read from it.
    eprintln!(
        "host OOM in {rel} (limit {} MiB, idle {} MiB): containers {reasons:?}",
        cap / MI,
        idle / MI
    );
    for (name, code, reason) in &reasons {
        assert_eq!(
            (*code, reason.as_str()),
            (137, "OOMKilled"),
            "container {name:?}\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
    }
    // containerd handles the sandbox's exit on its own event: NOTREADY within a bound.
    let deadline = Instant::now() + Duration::from_secs(30);
    let state = loop {
        let sandbox = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
        let state = sandbox.status.map(|s| s.state);
        if state == Some(PodSandboxState::SandboxNotready as i32) || Instant::now() >= deadline {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        state,
        Some(PodSandboxState::SandboxNotready as i32),
        "the pod whose VM the host's OOM killer ended\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    let log = std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default();
    let line = log
        .lines()
        .find(|l| {
            l.contains("the host's OOM killer killed") && l.contains(&format!("microvm-{}", pod.id))
        })
        .unwrap_or_else(|| {
            panic!(
                "no host OOM warn line for {}\ncontainerd log:\n{}",
                pod.id,
                ctrd.log_tail()
            )
        });
    for part in [
        format!("limit of {} MiB", cap / MI),
        "overhead.podFixed.memory".to_string(),
    ] {
        assert!(line.contains(&part), "{part:?} in {line}");
    }
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
}

/// The other two sources, once each: the pod's annotation (under a roomy pod cgroup) and the
/// config default (a pod cgroup without limits, a pod without resources); then a boot that
/// fails after the cgroup step leaves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overhead_from_the_annotation_and_the_config_and_no_cgroup_after_a_failed_boot() {
    let _serial = SERIAL.lock().await;
    let (dir, ctrd, cri) = start_cgroup_containerd(None).await;

    let pc = PodCgroup::create(&ctrd, "b", Some(2048 * MI), Some(4000));
    let annotations: HashMap<String, String> = [
        ("microvm.io/overhead-memory", "100Mi"),
        ("microvm.io/overhead-cpu", "200m"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let pod = run_pod_in(
        &ctrd,
        &cri,
        "cg-ann",
        &pc,
        Some((256 * MI, 1000)),
        annotations,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);
    assert_eq!(host_limits(&rel), ((256 + GUEST_BASE_MIB + 100) * MI, 1200));
    let line = cgroup_log_line(&ctrd, &pod.id);
    assert!(
        line.contains("overhead 100 MiB (pod annotation)")
            && line.contains("overhead 200m (pod annotation)"),
        "{line}"
    );
    assert_pod_processes_inside(&ctrd, &pod, &rel);
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
    drop(pc);

    // No limits anywhere: the config's default overhead on the default VM (256 MiB, 1 vCPU).
    let pc = PodCgroup::create(&ctrd, "c", None, None);
    let pod = run_pod_in(&ctrd, &cri, "cg-config", &pc, None, HashMap::new())
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);
    assert_eq!(
        host_limits(&rel),
        (
            (256 + CONFIG_OVERHEAD_MIB) * MI,
            1000 + CONFIG_OVERHEAD_CPU_MILLIS
        )
    );
    let line = cgroup_log_line(&ctrd, &pod.id);
    assert!(
        line.contains(&format!(
            "overhead {CONFIG_OVERHEAD_MIB} MiB (config default)"
        )),
        "{line}"
    );
    assert_pod_processes_inside(&ctrd, &pod, &rel);
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
    drop(pc);
    drop(cri);
    drop(ctrd);

    // A kernel file that is no kernel: the boot fails at the VM, after the cgroup was made.
    let junk = dir.path().join("not-a-vmlinux");
    std::fs::write(&junk, vec![0x5a_u8; 64 * 1024]).unwrap();
    let (_dir2, ctrd, cri) = start_cgroup_containerd(Some(&junk)).await;
    let before = state_entries();
    let pc = PodCgroup::create(&ctrd, "d", Some(1024 * MI), Some(2000));
    let err = run_pod_in(&ctrd, &cri, "cg-bad-kernel", &pc, None, HashMap::new())
        .await
        .expect_err("a junk kernel fails RunPodSandbox");
    eprintln!("junk kernel: {err}");
    assert_eq!(
        pc.any_microvm_dirs(),
        Vec::<PathBuf>::new(),
        "cgroup left: {err}"
    );
    drop(pc);
    assert_nothing_new(&ctrd, &before);
}

/// kubelet's systemd driver: the pod cgroup is a slice (`kubepods-burstable-pod<uid>.slice`),
/// containerd hands the shim `slice:cri-containerd:<id>`, and the shim finds the pod cgroup where
/// systemd puts the slice and makes its host cgroup there, sized the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_systemd_drivers_slice_is_the_pod_cgroup() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_cgroup_containerd(None).await;
    let pc = PodCgroup::create_systemd(Some(512 * MI), Some(1500));
    let pod = run_pod_in(
        &ctrd,
        &cri,
        "cg-systemd",
        &pc,
        Some((256 * MI, 1000)),
        HashMap::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let rel = pc.host_cgroup(&pod.id);
    assert!(
        !pc.host_cgroup_dirs(&pod.id).is_empty(),
        "no host cgroup at {rel}\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    assert_eq!(host_limits(&rel), (512 * MI, 1500));
    let line = cgroup_log_line(&ctrd, &pod.id);
    assert!(line.contains("systemd driver"), "{line}");
    eprintln!("{line}");
    assert_pod_processes_inside(&ctrd, &pod, &rel);
    remove_and_check(&ctrd, &cri, &pod, &pc).await;
}
