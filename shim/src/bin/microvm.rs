//! `microvm`: the command-line tool of the microvm host side.
//!
//! - `check-host`: what this host can run, and why (exit 0: Linux guests boot under the embedded
//!   VMM; 2: they cannot; 1: the check failed).
//! - `boot`: boots a VM. With `--check`, our Linux guest: waits for the agent, calls `Check`,
//!   prints one JSON object, shuts the guest down. Without it, any ELF kernel (a test guest) with
//!   its console on stdout, until the VM ends.
//!
//! - `install` / `uninstall`: microvm on a node (shim, tool, guest kernel and initrd, config,
//!   containerd's `microvm` handler), and exactly that taken off again (docs/operators.md).
//!
//! The C test guests run with `microvm-test-guest` (tests crate).
//!
//! Every failure exits non-zero with one message naming what failed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use shim::agent::AgentClient;
use shim::artifacts;
use shim::config::Hypervisor;
use shim::host_check::{self, HostReport};
use shim::vm::{choose_backend, new_work_dir, BackendChoice, GuestSpec, GuestVm};

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
    /// QEMU -M microvm (on KVM where QEMU can use it; TCG only with
    /// --allow-software-emulation).
    Qemu,
    /// The embedded VMM where check-host says the guest boots under it, otherwise QEMU as for
    /// `qemu`.
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
        /// Let the QEMU backend run the guest under software emulation (TCG) where this host's
        /// KVM cannot (the config's `allow_software_emulation`).
        #[arg(long)]
        allow_software_emulation: bool,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// Installs microvm on this node (as root): check-host's verdict picks the backend; the
    /// binaries, guest kernel and initrd go under the prefix; containerd gets the `microvm`
    /// runtime handler in its config (comments and other handlers kept).
    Install {
        #[command(flatten)]
        paths: InstallPaths,
        /// The guest kernel to install [default: build/vmlinux or $MICROVM_KERNEL].
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// The initrd to install [default: build/initrd.cpio or $MICROVM_INITRD].
        #[arg(long)]
        initrd: Option<PathBuf>,
        /// The containerd whose version decides the format of a new config file.
        #[arg(long, default_value = "containerd")]
        containerd: PathBuf,
        /// Print what would change, with the diff of containerd's config; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Install where pods can only run under QEMU's software emulation (TCG), which is no
        /// security boundary: the config gets `allow_software_emulation = true`.
        #[arg(long)]
        allow_software_emulation: bool,
    },
    /// Undoes what `microvm install` recorded under the prefix; containerd's config is put back
    /// as it was (byte for byte when nobody changed it since).
    Uninstall {
        /// Where microvm was installed.
        #[arg(long, default_value = "/opt/microvm")]
        prefix: PathBuf,
        /// Print what would change; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(clap::Args)]
struct InstallPaths {
    /// Where microvm's files go.
    #[arg(long, default_value = "/opt/microvm")]
    prefix: PathBuf,
    /// containerd's config file.
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    containerd_config: PathBuf,
    /// A folder on containerd's PATH, where the shim is linked.
    #[arg(long, default_value = "/usr/local/bin")]
    shim_link_dir: PathBuf,
}

fn main() -> ExitCode {
    // A QEMU VM's init (shim::vm::qemu::init), started by this binary when it boots one.
    if std::env::args().nth(1).as_deref() == Some(shim::vm::qemu::init::SUBCOMMAND) {
        std::process::exit(shim::vm::qemu::init::pod_init_main());
    }
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
            allow_software_emulation,
            timeout_secs,
        } => {
            let timeout = Duration::from_secs(timeout_secs);
            let kernel = kernel.unwrap_or_else(artifacts::default_kernel);
            if check {
                let initrd = initrd.unwrap_or_else(artifacts::default_initrd);
                let size = (vcpus, memory_mib);
                boot_check(
                    kernel,
                    initrd,
                    size,
                    backend,
                    allow_software_emulation,
                    timeout,
                )
            } else {
                boot_console(kernel, initrd, vcpus, memory_mib, backend, timeout)
            }
        }
        Command::Install {
            paths,
            kernel,
            initrd,
            containerd,
            dry_run,
            allow_software_emulation,
        } => install(
            paths,
            (kernel, initrd),
            containerd,
            dry_run,
            allow_software_emulation,
        ),
        Command::Uninstall { prefix, dry_run } => shim::install::uninstall(&prefix, dry_run)
            .map(|lines| {
                for line in lines {
                    println!("{line}");
                }
                ExitCode::SUCCESS
            })
            .map_err(Into::into),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("microvm: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn install(
    paths: InstallPaths,
    (kernel, initrd): (Option<PathBuf>, Option<PathBuf>),
    containerd: PathBuf,
    dry_run: bool,
    allow_software_emulation: bool,
) -> Result<ExitCode> {
    let kernel = kernel.unwrap_or_else(artifacts::default_kernel);
    let bin_source = std::env::current_exe()
        .context("finding the running microvm binary")?
        .parent()
        .map(PathBuf::from)
        .ok_or_else(|| anyhow!("the running microvm binary has no folder"))?;
    let report = shim::install::host_report(&kernel);
    for line in report.lines() {
        println!("check-host: {line}");
    }
    let opts = shim::install::InstallOptions {
        prefix: paths.prefix,
        containerd_config: paths.containerd_config,
        containerd,
        shim_link_dir: paths.shim_link_dir,
        bin_source,
        kernel,
        initrd: initrd.unwrap_or_else(artifacts::default_initrd),
        vhost_vsock: shim::config::qemu::default_vhost_vsock_binary(),
        virtiofsd: shim::config::qemu::default_virtiofsd_binary(),
        qemu: PathBuf::from(shim::config::qemu::DEFAULT_QEMU),
        dry_run,
        allow_software_emulation,
    };
    let done = shim::install::install(&opts, &report)?;
    for line in done.lines {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
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

/// The backend `--backend` asks for, by the shim's own rule (`vm::choose_backend`, as
/// for the config's `hypervisor`): `kvm` refused, fast and with the reason, where the host
/// cannot boot the guest under the embedded VMM; QEMU's software emulation refused unless
/// `--allow-software-emulation`.
fn backend_for(
    backend: BackendArg,
    allow_software_emulation: bool,
    report: &HostReport,
) -> Result<BackendChoice> {
    let hypervisor = match backend {
        BackendArg::Qemu => Hypervisor::Qemu,
        BackendArg::Auto => Hypervisor::Auto,
        BackendArg::Kvm => Hypervisor::Kvm,
    };
    let choice = choose_backend(report, hypervisor, allow_software_emulation).map_err(|e| {
        anyhow!("{e} (microvm check-host says more; the flag here is --allow-software-emulation)")
    })?;
    if backend == BackendArg::Auto || choice.software_emulation() {
        eprintln!("microvm: backend -> {choice}");
    }
    Ok(choice)
}

fn boot_check(
    kernel: PathBuf,
    initrd: PathBuf,
    (vcpus, memory_mib): (u8, u64),
    backend: BackendArg,
    allow_software_emulation: bool,
    timeout: Duration,
) -> Result<ExitCode> {
    let report = host_check::probe(Some(&kernel));
    let choice = backend_for(backend, allow_software_emulation, &report)?;
    let backend = choice.backend;
    let mut spec = GuestSpec::new(kernel, initrd, vcpus, memory_mib, new_work_dir("boot"));
    if let Some(accel) = choice.qemu_accel {
        spec.qemu.accel = accel;
    }
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
    let cfg = vmm::VmConfig {
        initrd: initrd.map(Into::into),
        vcpus,
        memory_mib,
        serial: vmm::SerialSink::Stdout,
        ..vmm::VmConfig::new(kernel)
    };
    let handle = vmm::Vm::start(cfg)?;
    let exit = handle.wait_or_stop(timeout)?;
    eprintln!("microvm: the VM ended: {exit:?}");
    Ok(ExitCode::SUCCESS)
}
