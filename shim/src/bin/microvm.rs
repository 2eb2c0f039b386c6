//! `microvm`: the command-line tool of the microvm host side.
//!
//! - `check-host`: what this host can run, and why (exit 0: Linux guests boot under the embedded
//!   VMM; 2: they cannot; 1: the check failed).
//! - `boot`: boots a VM. With `--check`, our Linux guest: waits for the agent, calls `Check`,
//!   prints one JSON object, shuts the guest down. Without it, any ELF kernel (a test guest) with
//!   its console on stdout, until the VM ends.
//! - `run-test-guest NAME`: boots one of our test guests and exits 0 only if it reported success.
//!
//! Every failure exits non-zero with one message naming what failed.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use shim::agent::AgentClient;
use shim::host_check::{self, HostReport};
use shim::vm::{new_work_dir, Backend, GuestSpec, GuestVm};
use shim::{artifacts, test_guest_peer};

#[derive(Parser)]
#[command(name = "microvm", version, about = "microvm: pods in KVM microVMs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// The embedded VMM on /dev/kvm.
    Kvm,
    /// QEMU -M microvm (TCG where KVM cannot boot a Linux guest).
    Qemu,
    /// The embedded VMM where check-host says the guest boots under it, otherwise QEMU.
    Auto,
}

#[derive(Subcommand)]
enum Command {
    /// Says what this host can run: KVM kind, capabilities, whether the guest kernel can boot.
    CheckHost {
        /// The guest kernel to judge [default: build/vmlinux or $MICROVM_KERNEL].
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Boots a VM.
    Boot {
        /// Kernel ELF [default: build/vmlinux or $MICROVM_KERNEL].
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// Initramfs [default with --check: build/initrd.cpio or $MICROVM_INITRD].
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long, default_value_t = 256)]
        memory_mib: u64,
        #[arg(long, value_enum, default_value_t = BackendArg::Kvm)]
        backend: BackendArg,
        /// Boot our Linux guest, call the agent's Check, print it as JSON, shut down.
        #[arg(long)]
        check: bool,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// Boots one of our test guests (hello, smp, vsock-echo, ...) on /dev/kvm.
    RunTestGuest {
        name: String,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long, default_value_t = 64)]
        memory_mib: u64,
        /// Folder of test guest ELFs [default: build/guests or $MICROVM_GUEST_DIR].
        #[arg(long)]
        guest_dir: Option<PathBuf>,
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::CheckHost { kernel, json } => check_host(kernel, json),
        Command::Boot {
            kernel,
            initrd,
            vcpus,
            memory_mib,
            backend,
            check,
            timeout_secs,
        } => {
            let timeout = Duration::from_secs(timeout_secs);
            let kernel = kernel.unwrap_or_else(artifacts::default_kernel);
            if check {
                let initrd = initrd.unwrap_or_else(artifacts::default_initrd);
                boot_check(kernel, initrd, vcpus, memory_mib, backend, timeout)
            } else {
                boot_console(kernel, initrd, vcpus, memory_mib, backend, timeout)
            }
        }
        Command::RunTestGuest {
            name,
            vcpus,
            memory_mib,
            guest_dir,
            timeout_secs,
        } => run_test_guest(
            &name,
            vcpus,
            memory_mib,
            guest_dir.unwrap_or_else(artifacts::default_guest_dir),
            Duration::from_secs(timeout_secs),
        ),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("microvm: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn check_host(kernel: Option<PathBuf>, json: bool) -> Result<ExitCode> {
    let kernel = kernel.unwrap_or_else(artifacts::default_kernel);
    let report = host_check::probe(Some(&kernel));
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    Ok(ExitCode::from(if report.linux_guest_bootable() {
        0
    } else {
        2
    }))
}

/// The backend `--backend` asks for: `auto` resolved by check-host's own rule
/// (`host_check::choose_backend`, as the shim does for `hypervisor = "auto"`); `kvm` refused,
/// fast and with the reason, where the host cannot boot the guest under the embedded VMM.
fn backend_for(backend: BackendArg, report: &HostReport) -> Result<Backend> {
    match backend {
        BackendArg::Qemu => Ok(Backend::Qemu),
        BackendArg::Auto => {
            let choice = host_check::choose_backend(report);
            eprintln!("microvm: backend auto -> {choice}");
            Ok(choice.backend)
        }
        BackendArg::Kvm => match report.linux_guest_blocker() {
            None => Ok(Backend::Kvm),
            Some(why) => bail!(
                "this host cannot boot the guest kernel under the embedded VMM: {why} \
                 (microvm check-host says more; --backend qemu runs it under QEMU)"
            ),
        },
    }
}

fn boot_check(
    kernel: PathBuf,
    initrd: PathBuf,
    vcpus: u8,
    memory_mib: u64,
    backend: BackendArg,
    timeout: Duration,
) -> Result<ExitCode> {
    let report = host_check::probe(Some(&kernel));
    let backend = backend_for(backend, &report)?;
    let spec = GuestSpec::new(kernel, initrd, vcpus, memory_mib, new_work_dir("boot"));
    let mut vm = GuestVm::start(backend, &spec)?;
    vm.wait_agent_ready(timeout)?;
    // The agent client is async (ttrpc's tokio client): a small runtime for these calls.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a tokio runtime")?;
    let socket = vm.agent_socket().to_path_buf();
    let client = runtime
        .block_on(AgentClient::connect(
            &socket,
            agent_protocol::AGENT_VSOCK_PORT,
            timeout,
        ))
        .map_err(|e| {
            anyhow!(
                "the guest agent did not answer: {e}; last console lines:\n{}",
                vm.console_tail(15)
            )
        })?;
    let boot_ms = vm.started_at().elapsed().as_millis();
    let check = runtime.block_on(client.check()).context("agent Check")?;
    runtime
        .block_on(client.shutdown())
        .context("agent Shutdown")?;
    drop(client);
    drop(runtime);
    if vm.wait_timeout(Duration::from_secs(30))?.is_none() {
        bail!(
            "the guest did not power off within 30 s after Shutdown; last console lines:\n{}",
            vm.console_tail(15)
        );
    }
    let out = serde_json::json!({
        "kernel_release": check.kernel_release,
        "vcpus": check.online_vcpus,
        "memory_mib": check.mem_total_kib / 1024,
        "boot_ms": boot_ms,
        "agent_version": check.agent_version,
        "boot_id": check.boot_id,
        "backend": backend,
        "vm": vm.detail(),
    });
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

/// A console sink that copies the guest's serial output to stdout and keeps it for inspection.
#[derive(Clone, Default)]
struct ConsoleTee(Arc<Mutex<Vec<u8>>>);

/// The most console output kept for inspection; the guest can print forever.
const CONSOLE_KEEP: usize = 1 << 20;

impl Write for ConsoleTee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut out = std::io::stdout().lock();
        out.write_all(buf)?;
        out.flush()?;
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < CONSOLE_KEEP {
            let n = buf.len().min(CONSOLE_KEEP - kept.len());
            kept.extend_from_slice(&buf[..n]);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stdout().lock().flush()
    }
}

impl ConsoleTee {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

fn vm_config(
    kernel: PathBuf,
    initrd: Option<PathBuf>,
    vcpus: u8,
    memory_mib: u64,
    serial: vmm::SerialSink,
) -> vmm::VmConfig {
    let mut cfg = vmm::VmConfig::new(kernel);
    cfg.initrd = initrd;
    cfg.vcpus = vcpus;
    cfg.memory_mib = memory_mib;
    cfg.serial = serial;
    cfg
}

/// Waits (bounded) for the VM to end; stops it on timeout.
fn wait_vm(handle: &vmm::VmHandle, timeout: Duration) -> Result<vmm::VmExit> {
    match handle.wait_timeout(timeout) {
        Some(r) => Ok(r?),
        None => {
            handle.stop();
            let _ = handle.wait();
            bail!("the VM did not end within {timeout:?}; stopped it")
        }
    }
}

fn boot_console(
    kernel: PathBuf,
    initrd: Option<PathBuf>,
    vcpus: u8,
    memory_mib: u64,
    backend: BackendArg,
    timeout: Duration,
) -> Result<ExitCode> {
    if backend == BackendArg::Qemu {
        bail!("boot without --check runs the embedded VMM only; use --backend kvm");
    }
    let cfg = vm_config(kernel, initrd, vcpus, memory_mib, vmm::SerialSink::Stdout);
    let handle = vmm::Vm::start(cfg)?;
    let exit = wait_vm(&handle, timeout)?;
    eprintln!("microvm: the VM ended: {exit:?}");
    Ok(ExitCode::SUCCESS)
}

/// The vsock ports of the vsock-echo guest: it listens on the first, and connects to the second.
const ECHO_GUEST_PORT: u32 = 1234;
const ECHO_HOST_PORT: u32 = 5678;
/// Bytes the host sends through the guest (more than the guest's receive buffers hold).
const ECHO_BYTES: usize = 256 * 1024;

fn run_test_guest(
    name: &str,
    vcpus: u8,
    memory_mib: u64,
    guest_dir: PathBuf,
    timeout: Duration,
) -> Result<ExitCode> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        bail!("not a test guest name: {name:?}");
    }
    let elf = guest_dir.join(format!("{name}.elf"));
    if !elf.is_file() {
        bail!(
            "no test guest {} (build the test guests with `make guests`)",
            elf.display()
        );
    }
    let console = ConsoleTee::default();
    let mut cfg = vm_config(
        elf,
        None,
        vcpus,
        memory_mib,
        vmm::SerialSink::Writer(Box::new(console.clone())),
    );
    let work_dir = new_work_dir("test-guest");
    let mut peers = Vec::new();
    if name == "vsock-echo" {
        std::fs::create_dir_all(&work_dir)
            .with_context(|| format!("creating {}", work_dir.display()))?;
        let uds = work_dir.join("vsock.sock");
        cfg.vsock = Some(vmm::VsockConfig {
            guest_cid: shim::vm::GUEST_CID,
            uds_path: uds.clone(),
        });
        cfg.cmdline = format!("vsock_echo.bytes={ECHO_BYTES} vsock_echo.host_bytes={ECHO_BYTES}");
        // The guest-initiated side listens before the guest boots.
        let server = test_guest_peer::GuestEchoServer::bind(&uds, ECHO_HOST_PORT)?;
        peers.push(std::thread::spawn(move || {
            server
                .serve(timeout)
                .map(|r| format!("guest-initiated echo: {} bytes", r.bytes))
                .map_err(|e| anyhow!("guest-initiated echo: {e}"))
        }));
        let uds_host = uds.clone();
        peers.push(std::thread::spawn(move || {
            test_guest_peer::host_initiated_echo(&uds_host, ECHO_GUEST_PORT, ECHO_BYTES, timeout)
                .map(|r| format!("host-initiated echo: {} bytes", r.bytes))
                .map_err(|e| anyhow!("host-initiated echo: {e}"))
        }));
    }
    let started = Instant::now();
    let result = run_and_judge(cfg, &console, timeout, peers);
    let _ = std::fs::remove_dir_all(&work_dir);
    let summary = result?;
    eprintln!(
        "microvm: test guest {name} passed in {} ms: {summary}",
        started.elapsed().as_millis()
    );
    Ok(ExitCode::SUCCESS)
}

type Peer = std::thread::JoinHandle<Result<String>>;

fn run_and_judge(
    cfg: vmm::VmConfig,
    console: &ConsoleTee,
    timeout: Duration,
    peers: Vec<Peer>,
) -> Result<String> {
    let handle = vmm::Vm::start(cfg)?;
    let exit = wait_vm(&handle, timeout);
    let mut notes = Vec::new();
    for peer in peers {
        match peer.join() {
            Ok(Ok(note)) => notes.push(note),
            Ok(Err(e)) => notes.push(format!("FAILED {e:#}")),
            Err(_) => notes.push("FAILED: peer thread panicked".to_string()),
        }
    }
    exit?;
    let text = console.text();
    let result = text
        .lines()
        .rev()
        .find_map(|l| l.trim_end().strip_prefix("RESULT: "))
        .ok_or_else(|| anyhow!("the guest ended without a RESULT line"))?;
    if let Some(failed) = notes.iter().find(|n| n.starts_with("FAILED")) {
        bail!("host side of the test: {failed} (guest said: {result})");
    }
    match result.strip_prefix("PASS") {
        Some(details) => {
            notes.insert(0, details.trim().to_string());
            Ok(notes.join("; "))
        }
        None => bail!("the guest reported {result}"),
    }
}
