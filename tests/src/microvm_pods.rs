//! Shared set-up of the tests that run `microvm` pods through a private containerd
//! (tests/tests/cri_microvm*.rs): the shim built as `make build` builds it, its config, the
//! containerd with the `microvm` handler, and the checks that nothing of a pod remains.

use crate::containerd::{CniOptions, ContainerdOptions, PrivateContainerd};
use crate::cri::{read_cri_log, CriClient, LogLine, Pod};
use crate::images::PAUSE_IMAGE;
use k8s_cri::v1::{ContainerConfig, ContainerStatus};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Timeout of one CRI call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// The shim's state root (one directory per pod).
pub const STATE_ROOT: &str = "/run/microvm";
/// The shim binary.
pub const SHIM: &str = "containerd-shim-microvm-v1";

pub use testkit::require_root;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `$var`, else `<repo>/build/<name>`; panics naming the make target when it does not exist.
pub fn build_artifact(var: &str, name: &str, make_target: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("build").join(name));
    assert!(
        path.exists(),
        "{} does not exist: build it with `make {make_target}` (or set {var})",
        path.display()
    );
    path
}

/// The folder holding an up-to-date shim binary of this build's profile: built with cargo
/// (a no-op when `make build` already did) into the target folder this test runs from. It
/// builds the workspace's binaries exactly as `make build` does: `-p shim` alone would unify
/// features differently and rebuild half the dependency tree inside the test.
///
/// `MICROVM_BIN_DIR` names a folder of binaries built beforehand instead: the nested lane
/// (docs/nested-lane.md) runs the test executables in an L1 VM where running cargo would only
/// cost minutes of emulated CPU to find nothing to do.
pub fn shim_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MICROVM_BIN_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join(SHIM).is_file(),
            "MICROVM_BIN_DIR={} has no {SHIM}: run `make build`",
            dir.display()
        );
        return dir;
    }
    let exe = std::env::current_exe().unwrap();
    // <target>/<profile>/deps/<test>
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let target = profile_dir.parent().unwrap();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--workspace", "--bins"])
        .env("CARGO_TARGET_DIR", target)
        .current_dir(repo());
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("running cargo build for the shim");
    assert!(status.success(), "building {SHIM} failed");
    assert!(profile_dir.join(SHIM).exists());
    profile_dir
}

/// A shim config for the QEMU backend with our kernel and initrd (or the given kernel).
pub fn write_config(dir: &Path, kernel: Option<&Path>) -> PathBuf {
    write_config_for(dir, kernel, &test_hypervisor())
}

/// The VM backend the pod tests run on: `MICROVM_TEST_HYPERVISOR` (`qemu` or `kvm`, the
/// embedded VMM), default `qemu`. scripts/run-tests.sh runs them a second time with `kvm` where
/// `microvm check-host` says this host can boot our guest, and counts them skipped elsewhere.
pub fn test_hypervisor() -> String {
    std::env::var("MICROVM_TEST_HYPERVISOR")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "qemu".to_string())
}

pub fn write_config_for(dir: &Path, kernel: Option<&Path>, hypervisor: &str) -> PathBuf {
    let initrd = repo().join("build").join("initrd.cpio");
    write_config_with(dir, kernel, &initrd, hypervisor, hypervisor == "qemu")
}

/// A shim config on the [`test_hypervisor`] backend booting `initrd` (e.g. the hostile agent's
/// build/initrd-hostile.cpio) with our kernel.
pub fn write_config_with_initrd(dir: &Path, initrd: &Path) -> PathBuf {
    let hypervisor = test_hypervisor();
    write_config_with(dir, None, initrd, &hypervisor, hypervisor == "qemu")
}

/// A shim config with `hypervisor` and `allow_software_emulation` as given, our kernel and
/// initrd (the tests of the backend choice).
pub fn write_config_choosing(
    dir: &Path,
    hypervisor: &str,
    allow_software_emulation: bool,
) -> PathBuf {
    let initrd = repo().join("build").join("initrd.cpio");
    write_config_with(dir, None, &initrd, hypervisor, allow_software_emulation)
}

/// Writes the config. The other writers give `hypervisor = "qemu"`
/// `allow_software_emulation = true`: the pod tests' QEMU backend runs on TCG on the hosts whose
/// KVM cannot boot our guest (kvm-pvm here), which the shim refuses without the opt-in.
fn write_config_with(
    dir: &Path,
    kernel: Option<&Path>,
    initrd: &Path,
    hypervisor: &str,
    allow_software_emulation: bool,
) -> PathBuf {
    let build = repo().join("build");
    let default_kernel = build.join("vmlinux");
    let kernel = kernel.unwrap_or(&default_kernel);
    for f in [&default_kernel, initrd] {
        assert!(
            f.exists(),
            "{} missing: run `make kernel initrd`",
            f.display()
        );
    }
    let path = dir.join("microvm.toml");
    // Each pod's embedded VMM runs in a process of its own (`vmm_process`, on by default,
    // docs/security.md); MICROVM_TEST_VMM_PROCESS=0 keeps it in the shim, for lane runs of the
    // pod suites with the VMM as threads of the shim.
    let vmm_in_shim = vmm_process_off_for_tests();
    // MICROVM_TEST_LOG_LEVEL=debug turns on the shim's and the guest agent's debug lines.
    let log_level = std::env::var("MICROVM_TEST_LOG_LEVEL").unwrap_or_else(|_| "info".into());
    std::fs::write(
        &path,
        format!(
            "hypervisor = \"{hypervisor}\"\nkernel = \"{}\"\ninitrd = \"{}\"\nlog_level = \"{log_level}\"\n{}{}",
            kernel.display(),
            initrd.display(),
            if allow_software_emulation {
                "allow_software_emulation = true\n"
            } else {
                ""
            },
            if vmm_in_shim {
                "vmm_process = false\n"
            } else {
                ""
            }
        ),
    )
    .unwrap();
    path
}

/// Whether MICROVM_TEST_VMM_PROCESS=0 asks the pod suites to keep the embedded VMM in the
/// shim (`vmm_process = false`) instead of the default process of its own.
pub fn vmm_process_off_for_tests() -> bool {
    std::env::var("MICROVM_TEST_VMM_PROCESS").is_ok_and(|v| v == "0")
}

pub async fn start(config: &Path) -> (PrivateContainerd, CriClient) {
    start_with_cni(config, CniOptions::default()).await
}

/// [`start`] with a CNI network beyond the plain IPv4 bridge (the network tests').
pub async fn start_with_cni(config: &Path, cni: CniOptions) -> (PrivateContainerd, CriClient) {
    start_with_options(
        config,
        ContainerdOptions {
            cni,
            ..ContainerdOptions::default()
        },
    )
    .await
}

/// [`start`] with containerd options of the test's (the shim's directory and `config` are
/// filled in).
pub async fn start_with_options(
    config: &Path,
    opts: ContainerdOptions,
) -> (PrivateContainerd, CriClient) {
    require_root();
    let ctrd = PrivateContainerd::start(ContainerdOptions {
        extra_path: vec![shim_bin_dir()],
        microvm_config: Some(config.to_path_buf()),
        ..opts
    })
    .unwrap_or_else(|e| panic!("starting the private containerd: {e}"));
    let cri = CriClient::connect(ctrd.socket(), CALL_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.wait_ready(&[PAUSE_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (ctrd, cri)
}

/// Processes whose command line mentions `needle` (other than this one).
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let own = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != own)
        .filter_map(|pid| {
            let c = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            c.contains(needle).then_some((pid, c))
        })
        .collect()
}

/// The shim serving `pod_id` of this containerd instance.
pub fn shim_pids(ctrd: &PrivateContainerd, pod_id: &str) -> Vec<i32> {
    processes_mentioning(&ctrd.socket().display().to_string())
        .into_iter()
        .filter(|(_, c)| c.contains(SHIM) && c.contains(pod_id))
        .map(|(pid, _)| pid)
        .collect()
}

/// The processes that run a pod's VM memory: the shim, and its embedded VMM's process when
/// the VMM runs in one (`vmm_process = true`: the shim's child `containerd-shim-microvm-v1
/// __vmm ...`).
pub fn vm_memory_pids(shim_pid: i32) -> Vec<i32> {
    let mut pids = vec![shim_pid];
    pids.extend(vmm_process_pids(shim_pid));
    pids
}

/// The shim's children that are its embedded VMM's processes (`__vmm`).
pub fn vmm_process_pids(shim_pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{shim_pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if cmd.split(|&b| b == 0).nth(1) == Some(b"__vmm") {
                out.push(pid);
            }
        }
    }
    out
}

/// Waits (bounded) until nothing of pod `id` remains: processes, state directory, mounts,
/// shim socket.
pub fn assert_pod_gone(ctrd: &PrivateContainerd, id: &str, timeout: Duration) {
    wait_until_gone(ctrd, id, timeout, OtherPods::Gone);
}

/// [`assert_pod_gone`] while other pods of the instance still run: their processes and
/// cgroups are not counted, only pod `id`'s own (its VM processes, its cgroup).
pub fn assert_pod_gone_while_others_run(ctrd: &PrivateContainerd, id: &str, timeout: Duration) {
    wait_until_gone(ctrd, id, timeout, OtherPods::Running);
}

/// Whether the instance's other pods are gone too, or still run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OtherPods {
    Gone,
    Running,
}

fn wait_until_gone(ctrd: &PrivateContainerd, id: &str, timeout: Duration, others: OtherPods) {
    let state = Path::new(STATE_ROOT).join(id);
    let socket = ctrd.shim_socket(id);
    let deadline = Instant::now() + timeout;
    loop {
        let mut left = Vec::new();
        for (pid, cmd) in processes_mentioning(&state.display().to_string()) {
            left.push(format!("VM process {pid}: {cmd}"));
        }
        if others == OtherPods::Gone {
            for p in ctrd.leftover_processes() {
                left.push(format!("process {p:?}"));
            }
        }
        if state.exists() {
            left.push(format!("state directory {}", state.display()));
        }
        for m in crate::containerd::mounts_under(&state) {
            left.push(format!("mount {}", m.display()));
        }
        if socket.exists() {
            left.push(format!("shim socket {}", socket.display()));
        }
        for c in ctrd.leftover_cgroups() {
            if others == OtherPods::Gone || c.to_string_lossy().contains(id) {
                left.push(format!("cgroup {}", c.display()));
            }
        }
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left after {timeout:?}:\n{}\ncontainerd log:\n{}",
            left.join("\n"),
            ctrd.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pod state directories under /run/microvm now.
pub fn state_entries() -> Vec<PathBuf> {
    std::fs::read_dir(STATE_ROOT)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Waits (bounded) until no process of the instance, no pod state directory that was not in
/// `before` and no pod cgroup remains.
pub fn assert_nothing_new(ctrd: &PrivateContainerd, before: &[PathBuf]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = ctrd.leftover_processes();
        let new_state: Vec<_> = state_entries()
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        let cgroups = ctrd.leftover_cgroups();
        if left.is_empty() && new_state.is_empty() && cgroups.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left: {left:?} {new_state:?} {cgroups:?}\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A private containerd with the `microvm` handler on the [`test_hypervisor`] backend (config in a fresh
/// temporary folder, returned so it lives as long as the caller needs it) and the busybox
/// image ready.
pub async fn start_with_busybox() -> (tempfile::TempDir, PathBuf, PrivateContainerd, CriClient) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let config = write_config(dir.path(), None);
    let (ctrd, cri) = start(&config).await;
    cri.wait_ready(&[crate::images::BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (dir, config, ctrd, cri)
}

/// Runs a pod named `name` with the `microvm` handler, panicking with containerd's log on error.
pub async fn run_pod(ctrd: &PrivateContainerd, cri: &CriClient, name: &str) -> Pod {
    cri.run_pod_sandbox(ctrd.pod_config(name, HashMap::new()).unwrap(), "microvm")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RunPodSandbox {name}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        })
}

/// Stops and removes `pod`, then checks nothing of it remains.
pub async fn remove_pod(ctrd: &PrivateContainerd, cri: &CriClient, pod: &Pod) {
    cri.stop_pod_sandbox(&pod.id).await.unwrap();
    cri.remove_pod_sandbox(&pod.id).await.unwrap();
    assert_pod_gone(ctrd, &pod.id, Duration::from_secs(20));
}

/// A container run to its end: its final CRI status and the lines of its CRI log.
pub struct Exited {
    pub id: String,
    pub status: ContainerStatus,
    pub log: Vec<LogLine>,
}

impl Exited {
    /// The text of every log line, stdout and stderr.
    pub fn lines(&self) -> Vec<String> {
        self.log.iter().map(|l| l.text.clone()).collect()
    }

    /// The text of the stdout lines.
    pub fn stdout(&self) -> Vec<String> {
        self.log
            .iter()
            .filter(|l| l.stream == "stdout")
            .map(|l| l.text.clone())
            .collect()
    }
}

/// Creates `config` in `pod`, starts it and waits up to `timeout` for its exit (panicking with
/// containerd's log on a failed call). The container is left for the caller to inspect and remove.
pub async fn run_container_to_exit(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    config: ContainerConfig,
    timeout: Duration,
) -> Exited {
    let name = config
        .metadata
        .as_ref()
        .map(|m| m.name.clone())
        .unwrap_or_default();
    let id = cri.create_container(pod, config).await.unwrap_or_else(|e| {
        panic!(
            "CreateContainer {name}: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    });
    cri.start_container(&id).await.unwrap_or_else(|e| {
        panic!(
            "StartContainer {name}: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    });
    let status = cri
        .wait_container_exited(&id, timeout)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "container {name}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        });
    let log = read_cri_log(Path::new(&status.log_path))
        .unwrap_or_else(|e| panic!("the CRI log of {name}: {e}"));
    Exited { id, status, log }
}
