//! microvm-agent: PID 1 inside the microVM.
//!
//! As PID 1 (the initramfs's `/init`): mounts the base filesystems, sets the hostname, reaps orphans, serves the `Agent` ttrpc service on vsock port 1024, prints
//! one ready line, and on Shutdown ends the VM. It never exits or panics on its own: PID 1 exiting
//! panics the guest kernel.
//!
//! Outside PID 1 (debugging, tests) it touches nothing system-wide: it only serves, on
//! `--listen unix:///path` or the default vsock address, and exits 0 after a Shutdown.

mod blockdev;
mod build_process;
mod check;
mod containers;
mod executor;
#[cfg(feature = "hostile-test-hooks")]
mod hostile;
mod init;
mod listener;
mod logger;
mod network;
mod oom;
mod pod_namespace;
mod port_forward;
mod power;
mod privileged;
mod reaper;
mod runtime_log;
mod server;
mod service;
mod share_forget;
mod stdio;
mod sysctl;
mod volumes;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;

use crate::service::AgentService;

/// Time for the Shutdown reply to leave before the VM goes away.
const SHUTDOWN_REPLY_GRACE: Duration = Duration::from_millis(100);

/// Where the agent keeps container state (libcontainer's and the bundles) unless
/// `--state-dir` says otherwise.
const DEFAULT_STATE_DIR: &str = "/run/microvm";

/// The value of `--NAME VALUE` / `--NAME=VALUE`; other arguments are ignored (the kernel passes
/// unknown command-line words to init).
fn option(args: impl IntoIterator<Item = String>, name: &str) -> Option<String> {
    let mut args = args.into_iter();
    let flag = format!("--{name}");
    let with_eq = format!("--{name}=");
    let mut value = None;
    while let Some(arg) = args.next() {
        if arg == flag {
            value = args.next();
        } else if let Some(v) = arg.strip_prefix(&with_eq) {
            value = Some(v.to_owned());
        }
    }
    value
}

/// The stdio address when `--stdio-listen` is not given: vsock port 1025 next to a vsock
/// listener, `unix://<path>.stdio` next to a `unix://<path>` one.
fn stdio_default(listen: &str) -> String {
    match listen.strip_prefix("unix://") {
        Some(path) => format!("unix://{path}.stdio"),
        None => stdio::default_address(),
    }
}

fn forward_default(listen: &str) -> String {
    match listen.strip_prefix("unix://") {
        Some(path) => format!("unix://{path}.forward"),
        None => port_forward::default_address(),
    }
}

/// The ttrpc address from `--listen ADDR`.
fn listen_address(args: impl IntoIterator<Item = String>) -> String {
    option(args, "listen").unwrap_or_else(server::default_address)
}

fn run(pid1: bool) -> anyhow::Result<()> {
    // Before any thread exists, so that every thread inherits the blocked SIGCHLD.
    reaper::block_sigchld()?;
    if pid1 {
        init::setup_system()?;
    } else {
        // The containers' processes are our children (libcontainer clones with CLONE_PARENT);
        // orphans of theirs come to us too, as to PID 1.
        reaper::become_subreaper().context("becoming a child subreaper")?;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let address = listen_address(args.clone());
    let stdio_address =
        option(args.clone(), "stdio-listen").unwrap_or_else(|| stdio_default(&address));
    let forward_address =
        option(args.clone(), "forward-listen").unwrap_or_else(|| forward_default(&address));
    let state_dir =
        PathBuf::from(option(args, "state-dir").unwrap_or_else(|| DEFAULT_STATE_DIR.to_owned()));
    reaper::spawn()?;
    share_forget::spawn().context("starting the share-forget thread")?;
    #[cfg(feature = "hostile-test-hooks")]
    log::warn!("this agent has HOSTILE TEST HOOKS (guest-agent/src/hostile.rs): tests only");
    let containers = Arc::new(containers::Containers::new(&state_dir));
    stdio::serve(&stdio_address, containers.clone())?;
    port_forward::serve(&forward_address)?;
    let oom = Arc::new(oom::OomEvents::default());
    oom.watch(containers.clone())
        .context("starting the OOM watcher")?;
    let (shutdown_tx, shutdown_rx) = mpsc::channel();
    let _server = server::start(&address, AgentService::new(shutdown_tx, containers, oom))?;
    let mut stdout = std::io::stdout().lock();
    let ready = server::ready_line(&address);
    writeln!(stdout, "{ready}").context("printing the ready line")?;
    stdout.flush().context("printing the ready line")?;
    drop(stdout);
    // The shim waits for this event, not for the console line.
    if let Err(e) = server::announce_ready(&address, &ready) {
        log::warn!(
            "telling the host the agent is ready (vsock port {}): {e}",
            agent_protocol::AGENT_READY_PORT
        );
    }

    // Wait for Shutdown. The service holds the sender for the server's whole life, so this only
    // returns on a request.
    shutdown_rx.recv().context("the ttrpc service went away")?;
    std::thread::sleep(SHUTDOWN_REPLY_GRACE);
    Ok(())
}

fn main() {
    logger::init();
    runtime_log::install();
    if std::env::args().nth(1).as_deref() == Some(build_process::ARG) {
        build_process::main();
    }
    let pid1 = init::is_pid1();
    if pid1 {
        std::panic::set_hook(Box::new(|info| log::error!("panic: {info}")));
    }
    let clean = match std::panic::catch_unwind(|| run(pid1)) {
        Ok(Ok(())) => {
            log::info!("stopping");
            true
        }
        Ok(Err(err)) => {
            log::error!("{err:#}");
            false
        }
        Err(_) => {
            log::error!("the agent panicked");
            false
        }
    };
    if !pid1 {
        std::process::exit(if clean { 0 } else { 1 });
    }
    // PID 1 must not exit: end the VM, and if even that fails, idle so the host can see the log.
    let err = power::end_vm();
    log::error!("{err}");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn listen_address_from_arguments() {
        assert_eq!(listen_address(args(&[])), "vsock://-1:1024");
        assert_eq!(
            listen_address(args(&["quiet", "splash"])),
            "vsock://-1:1024"
        );
        assert_eq!(
            listen_address(args(&["--listen", "unix:///tmp/a"])),
            "unix:///tmp/a"
        );
        assert_eq!(listen_address(args(&["--listen=unix:///b"])), "unix:///b");
        assert_eq!(
            option(
                args(&["--listen=a", "--stdio-listen", "unix:///s"]),
                "stdio-listen"
            ),
            Some("unix:///s".to_owned())
        );
        assert_eq!(option(args(&["--listen=a"]), "state-dir"), None);
        assert_eq!(stdio_default("unix:///a/b.sock"), "unix:///a/b.sock.stdio");
        assert_eq!(stdio_default("vsock://-1:1024"), "vsock://-1:1025");
    }
}
