//! `microvm-test-guest NAME`: boots one of our C test guests (tests/guests/, docs/test-guests.md:
//! hello, smp, vsock-echo, ...) on /dev/kvm under the embedded VMM and exits 0 only if it
//! reported success (its `RESULT: PASS` console line, and for vsock-echo the host side of both
//! echoes). Options: `--vcpus N` (1), `--memory-mib M` (64), `--guest-dir DIR` (build/guests or
//! `$MICROVM_GUEST_DIR`), `--timeout-secs S` (60).
//!
//! Every failure exits non-zero with one message naming what failed.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use microvm_tests::vsock_peer;
use shim::artifacts;
use shim::vm::new_work_dir;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    match parse(std::env::args().skip(1))
        .and_then(|a| run_test_guest(&a.name, a.vcpus, a.memory_mib, a.guest_dir, a.timeout))
    {
        Ok(code) => code,
        Err(e) => {
            eprintln!("microvm-test-guest: {e:#}");
            ExitCode::from(1)
        }
    }
}

struct Args {
    name: String,
    vcpus: u8,
    memory_mib: u64,
    guest_dir: PathBuf,
    timeout: Duration,
}

fn parse(args: impl Iterator<Item = String>) -> Result<Args> {
    let mut name = None;
    let (mut vcpus, mut memory_mib, mut timeout_secs) = (1u8, 64u64, 60u64);
    let mut guest_dir = None;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |what: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| anyhow!("{what} needs a value"))
        };
        match flag.as_str() {
            "--vcpus" => vcpus = value("--vcpus")?.parse().context("--vcpus")?,
            "--memory-mib" => {
                memory_mib = value("--memory-mib")?.parse().context("--memory-mib")?
            }
            "--timeout-secs" => {
                timeout_secs = value("--timeout-secs")?.parse().context("--timeout-secs")?
            }
            "--guest-dir" => guest_dir = Some(PathBuf::from(value("--guest-dir")?)),
            f if f.starts_with('-') => bail!("unknown option {f}"),
            _ if name.is_none() => name = Some(arg),
            _ => bail!("one test guest at a time: {arg:?}"),
        }
    }
    Ok(Args {
        name: name.ok_or_else(|| {
            anyhow!("usage: microvm-test-guest NAME [--vcpus N] [--memory-mib M] [--guest-dir DIR] [--timeout-secs S]")
        })?,
        vcpus,
        memory_mib,
        guest_dir: guest_dir.unwrap_or_else(artifacts::default_guest_dir),
        timeout: Duration::from_secs(timeout_secs),
    })
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
    let mut cfg = vmm::VmConfig {
        vcpus,
        memory_mib,
        serial: vmm::SerialSink::Writer(Box::new(console.clone())),
        ..vmm::VmConfig::new(elf)
    };
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
        let server = vsock_peer::GuestEchoServer::bind(&uds, ECHO_HOST_PORT)?;
        peers.push(std::thread::spawn(move || {
            server
                .serve(timeout)
                .map(|r| format!("guest-initiated echo: {} bytes", r.bytes))
                .map_err(|e| anyhow!("guest-initiated echo: {e}"))
        }));
        let uds_host = uds.clone();
        peers.push(std::thread::spawn(move || {
            vsock_peer::host_initiated_echo(&uds_host, ECHO_GUEST_PORT, ECHO_BYTES, timeout)
                .map(|r| format!("host-initiated echo: {} bytes", r.bytes))
                .map_err(|e| anyhow!("host-initiated echo: {e}"))
        }));
    }
    let started = Instant::now();
    let result = run_and_judge(cfg, &console, timeout, peers);
    let _ = std::fs::remove_dir_all(&work_dir);
    let summary = result?;
    eprintln!(
        "microvm-test-guest: {name} passed in {} ms: {summary}",
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
    let exit = handle.wait_or_stop(timeout);
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
