//! The `vsock-echo` test guest under our VMM on the real /dev/kvm: the guest's virtio-mmio
//! driver against our virtio-vsock device and hybrid-vsock Unix socket, both directions, with
//! payloads several times larger than the guest's RX buffers (16 x 4 KiB) and its advertised
//! receive window (64 KiB), so credit flow control has to work.
//!
//! Needs the guest built (`make guests`, or `make -C tests/guests`; `MICROVM_GUEST_DIR`
//! overrides where it is looked for) and /dev/kvm; without them the tests fail with the reason.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use microvm_tests::guest_console::{test_guest_elf, Console};
use microvm_tests::vsock_peer::{host_initiated_echo, EchoReport, GuestEchoServer};
use vmm::{BootProtocol, SerialSink, Vm, VmConfig, VmExit, VsockConfig};

/// Bound for one guest run and for each host-side peer (kvm-pvm emulates kernel-mode code).
const TIMEOUT: Duration = Duration::from_secs(120);
const GUEST_PORT: u32 = 1234;
const HOST_PORT: u32 = 5678;

/// A work dir for one VM's sockets, removed on drop.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("microvm-vsock-echo-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the work dir");
        Self(dir)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Outcome {
    exit: VmExit,
    console: String,
    host_initiated: Option<Result<EchoReport, String>>,
    guest_initiated: Option<Result<EchoReport, String>>,
}

impl Outcome {
    fn result_line(&self) -> &str {
        self.console
            .lines()
            .rev()
            .find(|l| l.starts_with("RESULT: "))
            .unwrap_or_else(|| panic!("no RESULT line; console:\n{}", self.console))
    }
}

struct Run<'a> {
    name: &'a str,
    cmdline: String,
    boot: BootProtocol,
    /// Bytes the host sends in the host-initiated phase; `None`: no host-initiated peer.
    host_bytes: Option<usize>,
    /// Whether to serve the guest-initiated phase.
    serve_guest: bool,
    vcpus: u8,
    memory_mib: u64,
}

fn run(r: Run<'_>) -> Outcome {
    let work = WorkDir::new(r.name);
    let uds = work.0.join("vsock.sock");
    let console = Console::default();
    let mut cfg = VmConfig::new(test_guest_elf("vsock-echo.elf"));
    cfg.cmdline = r.cmdline;
    cfg.boot_protocol = r.boot;
    cfg.vcpus = r.vcpus;
    cfg.memory_mib = r.memory_mib;
    cfg.serial = SerialSink::Writer(Box::new(console.clone()));
    cfg.vsock = Some(VsockConfig {
        guest_cid: 3,
        uds_path: uds.clone(),
    });

    // Listen before the guest can connect.
    let server = r
        .serve_guest
        .then(|| GuestEchoServer::bind(&uds, HOST_PORT).expect("bind the guest-initiated socket"));
    let handle = Vm::start(cfg).expect("the VM starts");
    let guest_peer = server.map(|s| thread::spawn(move || s.serve(TIMEOUT)));
    let host_peer = r.host_bytes.map(|n| {
        let uds = uds.clone();
        thread::spawn(move || host_initiated_echo(&uds, GUEST_PORT, n, TIMEOUT))
    });
    let exit = match handle.wait_timeout(TIMEOUT) {
        Some(r) => r.expect("the VM ends without a VMM error"),
        None => {
            handle.stop();
            panic!(
                "{}: the guest did not finish within {TIMEOUT:?}; console:\n{}",
                r.name,
                console.text()
            );
        }
    };
    let join = |h: thread::JoinHandle<Result<EchoReport, _>>| {
        h.join()
            .expect("peer thread")
            .map_err(|e: microvm_tests::vsock_peer::VsockPeerError| e.to_string())
    };
    Outcome {
        exit,
        console: console.text(),
        host_initiated: host_peer.map(join),
        guest_initiated: guest_peer.map(join),
    }
}

fn assert_echo_passes(name: &str, boot: BootProtocol, host_bytes: usize, guest_bytes: usize) {
    assert_echo_passes_on(name, boot, host_bytes, guest_bytes, 1, 128);
}

fn assert_echo_passes_on(
    name: &str,
    boot: BootProtocol,
    host_bytes: usize,
    guest_bytes: usize,
    vcpus: u8,
    memory_mib: u64,
) {
    let out = run(Run {
        name,
        cmdline: format!("vsock_echo.bytes={guest_bytes} vsock_echo.host_bytes={host_bytes}"),
        boot,
        host_bytes: Some(host_bytes),
        serve_guest: true,
        vcpus,
        memory_mib,
    });
    assert_eq!(
        out.result_line(),
        format!("RESULT: PASS host-initiated={host_bytes} guest-initiated={guest_bytes}"),
        "console:\n{}",
        out.console
    );
    assert_eq!(out.exit, VmExit::Reset, "console:\n{}", out.console);
    let host = out.host_initiated.expect("host peer ran");
    assert_eq!(
        host.as_ref().map(|r| r.bytes),
        Ok(host_bytes as u64),
        "{host:?}"
    );
    let guest = out.guest_initiated.expect("guest peer ran");
    assert_eq!(
        guest.as_ref().map(|r| r.bytes),
        Ok(guest_bytes as u64),
        "{guest:?}"
    );
}

#[test]
fn echo_both_directions() {
    assert_echo_passes("auto", BootProtocol::Auto, 300_000, 262_144);
}

#[test]
fn echo_both_directions_pvh_entry() {
    assert_echo_passes("pvh", BootProtocol::Pvh, 100_003, 200_005);
}

#[test]
fn echo_both_directions_linux64_entry() {
    assert_echo_passes("linux64", BootProtocol::Linux64, 100_003, 200_005);
}

#[test]
fn echo_a_megabyte_each_way() {
    assert_echo_passes("mib", BootProtocol::Auto, 1 << 20, 1 << 20);
}

#[test]
fn echo_with_four_vcpus_and_512_mib() {
    assert_echo_passes_on("smp", BootProtocol::Auto, 100_000, 100_000, 4, 512);
}

#[test]
fn four_echo_vms_at_once() {
    let vms: Vec<_> = (0..4)
        .map(|i| {
            thread::spawn(move || {
                let name = format!("parallel-{i}");
                assert_echo_passes(&name, BootProtocol::Auto, 65_536 + i * 1000, 131_072 + i);
            })
        })
        .collect();
    for vm in vms {
        vm.join().expect("VM thread");
    }
}

#[test]
fn guest_reports_a_refused_connection() {
    // Nothing listens on <uds>_5678: the device answers the guest's REQUEST with RST, the guest
    // retries a bounded number of times and then fails with the reason.
    let out = run(Run {
        name: "refused",
        cmdline: "vsock_echo.mode=guest".into(),
        boot: BootProtocol::Auto,
        host_bytes: None,
        serve_guest: false,
        vcpus: 1,
        memory_mib: 64,
    });
    let line = out.result_line();
    assert!(
        line.starts_with("RESULT: FAIL guest-initiated connect: host refused port 5678"),
        "{line}\nconsole:\n{}",
        out.console
    );
    assert_eq!(out.exit, VmExit::Reset);
}

#[test]
fn guest_reports_a_short_host_stream() {
    // The guest expects 50000 bytes but the host sends 1000 and shuts down.
    let out = run(Run {
        name: "short",
        cmdline: "vsock_echo.mode=host vsock_echo.host_bytes=50000".into(),
        boot: BootProtocol::Auto,
        host_bytes: Some(1000),
        serve_guest: false,
        vcpus: 1,
        memory_mib: 64,
    });
    let line = out.result_line();
    assert_eq!(
        line, "RESULT: FAIL host-initiated: host closed after 1000 of vsock_echo.host_bytes=50000",
        "console:\n{}",
        out.console
    );
}
