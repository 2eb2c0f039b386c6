//! microvm-agent: PID 1 inside the microVM.
//!
//! As PID 1 (the initramfs's `/init`): mounts the base filesystems, sets the hostname, reaps orphans, serves the `Agent` ttrpc service on vsock port 1024, prints
//! one ready line, and on Shutdown ends the VM. It never exits or panics on its own: PID 1 exiting
//! panics the guest kernel.
//!
//! Outside PID 1 (debugging, tests) it touches nothing system-wide: it only serves, on
//! `--listen unix:///path` or the default vsock address, and exits 0 after a Shutdown.

mod check;
mod init;
mod logger;
mod power;
mod reaper;
mod server;
mod service;

use std::io::Write;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context;

use crate::service::AgentService;

/// Time for the Shutdown reply to leave before the VM goes away.
const SHUTDOWN_REPLY_GRACE: Duration = Duration::from_millis(100);

/// The listening address from `--listen ADDR` / `--listen=ADDR`; other arguments are ignored
/// (the kernel passes unknown command-line words to init).
fn listen_address(args: impl IntoIterator<Item = String>) -> String {
    let mut args = args.into_iter();
    let mut address = None;
    while let Some(arg) = args.next() {
        if arg == "--listen" {
            address = args.next();
        } else if let Some(value) = arg.strip_prefix("--listen=") {
            address = Some(value.to_owned());
        }
    }
    address.unwrap_or_else(server::default_address)
}

fn run(pid1: bool) -> anyhow::Result<()> {
    if pid1 {
        // Before any thread exists, so that every thread inherits the blocked SIGCHLD.
        reaper::block_sigchld()?;
        init::setup_system()?;
    }
    let address = listen_address(std::env::args().skip(1));
    let (shutdown_tx, shutdown_rx) = mpsc::channel();
    let _server = server::start(&address, AgentService::new(shutdown_tx))?;
    if pid1 {
        reaper::spawn()?;
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", server::ready_line(&address)).context("printing the ready line")?;
    stdout.flush().context("printing the ready line")?;
    drop(stdout);

    // Wait for Shutdown. The service holds the sender for the server's whole life, so this only
    // returns on a request.
    shutdown_rx.recv().context("the ttrpc service went away")?;
    std::thread::sleep(SHUTDOWN_REPLY_GRACE);
    Ok(())
}

fn main() {
    logger::init();
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
    }
}
