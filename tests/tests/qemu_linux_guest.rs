//! Our Linux guest under QEMU's software emulation (TCG): our kernel (kernel-config/, `make
//! kernel` -> build/vmlinux) and initrd (the agent as /init, `make initrd` -> build/initrd.cpio)
//! boot on `-M microvm`, the agent answers `Check` over hybrid vsock (vhost-device-vsock, the
//! same protocol as our VMM) with the configured vCPUs, memory and our kernel's release, and
//! `Shutdown` makes QEMU exit by itself. Nothing is left behind: no process, socket or file.
//!
//! Missing artifacts fail the tests with the `make` target that builds them: never a silent skip.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_protocol::AGENT_VSOCK_PORT;
use microvm_tests::microvm_pods::build_artifact;
use shim::agent::AgentClient;
use shim::config::qemu::default_vhost_vsock_binary;
use shim::vm::qemu::{Accel, QemuConfig, QemuError, QemuVm};

/// Generous: two TCG guests may boot at once on two loaded cores.
const AGENT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long QEMU may take to exit after `Shutdown` was answered.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);
const MEMORY_MIB: u32 = 256;
/// The agent's ready line on the console (guest-agent prints it once it listens on vsock).
const AGENT_READY: &str = "microvm-agent: ready";

fn kernel() -> PathBuf {
    build_artifact("MICROVM_KERNEL", "vmlinux", "kernel")
}

fn initrd() -> PathBuf {
    build_artifact("MICROVM_INITRD", "initrd.cpio", "initrd")
}

fn vhost_vsock() -> PathBuf {
    let bin = default_vhost_vsock_binary();
    assert!(
        bin.exists(),
        "{} does not exist: install it with `make deps` (scripts/install-vhost-device-vsock.sh)",
        bin.display()
    );
    bin
}

/// The release kernel-config/build.sh recorded beside the real vmlinux.
fn kernel_release(kernel: &Path) -> String {
    let real = fs::canonicalize(kernel).expect("canonicalize kernel path");
    let file = real.with_file_name("release");
    fs::read_to_string(&file)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}: rebuild the kernel with `make kernel`",
                file.display()
            )
        })
        .trim()
        .to_string()
}

/// A short, unique work dir (Unix socket paths hold at most 107 bytes).
fn work_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mvq-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn config(vcpus: u32, tag: &str) -> QemuConfig {
    let mut cfg = QemuConfig::new(kernel(), initrd(), vhost_vsock(), work_dir(tag));
    // The VM's init (`__pod-init`) is the shim's: this test binary is not one.
    cfg.init_binary =
        microvm_tests::microvm_pods::shim_bin_dir().join(microvm_tests::microvm_pods::SHIM);
    cfg.vcpus = vcpus;
    cfg.memory_mib = MEMORY_MIB;
    cfg.accel = Accel::Tcg;
    cfg
}

/// Whether `pid` is still a process (running or zombie).
fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn assert_nothing_left(pids: &[u32], work_dir: &Path) {
    for pid in pids {
        assert!(!process_exists(*pid), "process {pid} is still there");
    }
    assert!(
        !work_dir.exists(),
        "{} is still there: {:?}",
        work_dir.display(),
        fs::read_dir(work_dir).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
}

fn boot_check_shutdown(vcpus: u32) {
    let cfg = config(vcpus, &format!("boot{vcpus}"));
    let dir = cfg.work_dir.clone();
    let release = kernel_release(&cfg.kernel);

    let started = Instant::now();
    let mut vm = QemuVm::start(cfg).expect("start QEMU");
    let pids = vm.pids();
    assert_eq!(
        pids.len(),
        3,
        "the VM's init, QEMU and vhost-device-vsock run"
    );
    // The init names itself for ps and top, whatever the binary's file name.
    let init_name = fs::read_to_string(format!("/proc/{}/comm", pids[0])).expect("the init's comm");
    assert_eq!(init_name.trim_end(), "microvm-init");
    let console_at = started.elapsed();
    vm.wait_for_console(AGENT_READY, AGENT_TIMEOUT)
        .expect("the agent's ready line");
    let ready_at = started.elapsed();

    // The agent client is async (ttrpc's tokio client).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let agent = rt
        .block_on(AgentClient::connect(
            vm.vsock_uds_path(),
            AGENT_VSOCK_PORT,
            AGENT_TIMEOUT,
        ))
        .unwrap_or_else(|e| {
            panic!(
                "agent unreachable: {e}\nconsole:\n{}\nqemu stderr:\n{}",
                vm.console_tail(30),
                vm.qemu_stderr_tail(10)
            )
        });
    let check = rt.block_on(agent.check()).expect("Check");
    let agent_at = started.elapsed();

    assert_eq!(check.online_vcpus, vcpus, "online vCPUs");
    let configured_kib = u64::from(MEMORY_MIB) * 1024;
    // MemTotal is RAM less the kernel image, reserved and firmware areas: a little below.
    assert!(
        check.mem_total_kib <= configured_kib && check.mem_total_kib >= configured_kib * 85 / 100,
        "MemTotal {} KiB is not close to the configured {configured_kib} KiB",
        check.mem_total_kib
    );
    assert_eq!(check.kernel_release, release, "kernel release");
    assert!(!check.agent_version.is_empty());
    assert!(!check.boot_id.is_empty());

    rt.block_on(agent.shutdown()).expect("Shutdown");
    let status = vm
        .wait_timeout(EXIT_TIMEOUT)
        .expect("wait for QEMU")
        .unwrap_or_else(|| {
            panic!(
                "QEMU did not exit within {EXIT_TIMEOUT:?} of Shutdown; console:\n{}",
                vm.console_tail(20)
            )
        });
    let exit_at = started.elapsed();
    assert!(
        status.success(),
        "QEMU exited with {status}; stderr:\n{}",
        vm.qemu_stderr_tail(10)
    );
    assert!(
        vm.pids().is_empty(),
        "children still running after exit: {:?}",
        vm.pids()
    );
    drop(agent);
    drop(vm);
    assert_nothing_left(&pids, &dir);
    eprintln!(
        "qemu/tcg {vcpus} vCPU(s): first console output {console_at:?}, agent ready {ready_at:?}, Check answered {agent_at:?}, \
         QEMU exited {exit_at:?} (kernel {release}, MemTotal {} KiB)",
        check.mem_total_kib
    );
}

#[test]
fn linux_guest_one_vcpu_answers_check_and_shuts_down() {
    boot_check_shutdown(1);
}

#[test]
fn linux_guest_two_vcpus_answers_check_and_shuts_down() {
    boot_check_shutdown(2);
}

/// A VM stopped from the host (SIGTERM, then SIGKILL) while its guest boots leaves nothing.
#[test]
fn stop_while_booting_leaves_nothing() {
    let cfg = config(1, "stop");
    let dir = cfg.work_dir.clone();
    let mut vm = QemuVm::start(cfg).expect("start QEMU");
    let pids = vm.pids();
    let began = Instant::now();
    vm.stop().expect("stop");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "stop took {:?}",
        began.elapsed()
    );
    assert!(vm.pids().is_empty());
    drop(vm);
    assert_nothing_left(&pids, &dir);
}

/// QEMU refusing the kernel fails the start with QEMU's own message, and leaves nothing.
#[test]
fn qemu_failing_early_is_an_error_with_its_stderr() {
    let dir = work_dir("bad");
    let not_a_kernel = std::env::temp_dir().join(format!("mvq-notakernel-{}", std::process::id()));
    fs::write(&not_a_kernel, b"this is not a kernel\n").expect("write file");
    // QEMU answers "linux kernel too old to load a ram disk".
    let mut cfg = QemuConfig::new(&not_a_kernel, &not_a_kernel, vhost_vsock(), &dir);
    // The VM's init (`__pod-init`) is the shim's: this test binary is not one.
    cfg.init_binary =
        microvm_tests::microvm_pods::shim_bin_dir().join(microvm_tests::microvm_pods::SHIM);
    cfg.accel = Accel::Tcg;
    let err = QemuVm::start(cfg).expect_err("QEMU cannot boot a text file");
    fs::remove_file(&not_a_kernel).expect("remove file");
    let msg = err.to_string();
    assert!(matches!(err, QemuError::QemuExitedEarly { .. }), "{msg}");
    assert!(msg.contains("qemu-system-x86_64"), "{msg}");
    assert!(
        msg.to_lowercase().contains("kernel"),
        "QEMU's reason is missing: {msg}"
    );
    assert!(!dir.exists(), "{} left behind", dir.display());
}
