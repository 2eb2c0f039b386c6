//! How the boot part measures one VMM process: spawned with its console on a pipe, the time to
//! its first console byte and to its exit, and its memory read at the exit stop (ptrace), where
//! the peak RSS (`VmHWM`) and the RSS split into anonymous and file-mapped pages are still there.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// One measured boot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) first_byte: Duration,
    pub(crate) exit: Duration,
    /// The VMM process's own peak RSS: `VmHWM` of /proc/<pid>/status at its exit.
    pub(crate) peak_rss_kib: u64,
    /// `ru_maxrss` as wait4 reports it, which is never below this bench's own peak RSS when it
    /// spawned the VMM (see [`measure`]); kept for comparison with older reports.
    pub(crate) wait4_maxrss_kib: u64,
    /// The RSS at the exit split (`/proc/<pid>/smaps_rollup`, read at the same stop).
    pub(crate) exit_rss: RssSplit,
}

/// A process's resident memory split by what backs it, in KiB.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RssSplit {
    /// Anonymous pages: heap, stacks, guest memory the guest touched.
    pub(crate) anon_kib: u64,
    /// Everything else resident: pages mapped from files (the binary, the shared libraries)
    /// and shared memory.
    pub(crate) mapped_kib: u64,
}
/// Spawns `cmd`, times its first stdout byte and its exit, and reads its peak RSS.
///
/// The peak RSS is `VmHWM` of /proc/<pid>/status, read while the process stops at its exit
/// (traced with PTRACE_SEIZE and PTRACE_O_TRACEEXIT; the stop comes before its memory is
/// released). Not wait4's `ru_maxrss`: Linux keeps a process's maxrss across execve and folds
/// into it the high-water mark of the address space execve replaced, which for a spawned child
/// is its parent's (posix_spawn shares it, fork copies it). So `ru_maxrss` of a VMM spawned from
/// here is never below this bench's own peak RSS (about 4 MiB), whatever the VMM uses.
pub(crate) fn measure(mut cmd: Command, what: &str, timeout: Duration) -> Result<Sample> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let start = Instant::now();
    // spawn returns once the child has exec'd the VMM (or failed to).
    let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    let mut stdout = child.stdout.take().context("no stdout pipe")?;
    let pid = child.id() as libc::pid_t;
    // SAFETY: PTRACE_SEIZE attaches to our own child without stopping it; the data argument is
    // the option bits, no memory is passed.
    let seized = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            libc::PTRACE_O_TRACEEXIT as usize as *mut libc::c_void,
        )
    };
    if seized != 0 {
        let e = std::io::Error::last_os_error();
        kill_and_reap(pid);
        bail!("PTRACE_SEIZE of {what} (pid {pid}): {e}");
    }

    // Read the console on a thread so the timing of the first byte does not wait on the exit.
    let reader = std::thread::spawn(move || {
        let mut first = None;
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if first.is_none() {
                        first = Some(start.elapsed());
                    }
                    if all.len() < 1 << 20 {
                        all.extend_from_slice(&buf[..n]);
                    }
                }
            }
        }
        (first, all)
    });

    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let deadline = start + timeout;
    let mut peak_rss_kib = None;
    let mut exit_rss = None;
    let exit = loop {
        // SAFETY: pid is our own child; status and usage point to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid && libc::WIFSTOPPED(status) {
            // A ptrace stop: at the exit, read the peak RSS; pass any signal on.
            let event = (status >> 16) & 0xff;
            let signal = if event == libc::PTRACE_EVENT_EXIT {
                peak_rss_kib = vm_hwm_kib(pid);
                exit_rss = rss_split(pid);
                0
            } else if event == 0 {
                libc::WSTOPSIG(status)
            } else {
                0
            };
            resume(pid, signal).with_context(|| format!("resuming {what}"))?;
            continue;
        }
        if r == pid {
            break start.elapsed();
        }
        if r < 0 {
            bail!("wait4 on {what}: {}", std::io::Error::last_os_error());
        }
        if Instant::now() > deadline {
            kill_and_reap(pid);
            bail!("{what} did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    let (first, console) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let exit_status = std::process::ExitStatus::from_raw(status);
    let console = String::from_utf8_lossy(&console);
    if !console.contains("RESULT: PASS") {
        bail!(
            "{what} did not report RESULT: PASS (exit {exit_status}); console:\n{console}\nstderr:\n{err}"
        );
    }
    let first_byte = first.context("no console output")?;
    let peak_rss_kib = peak_rss_kib.with_context(|| {
        format!("{what} exited without the exit stop where its peak RSS is read")
    })?;
    let exit_rss = exit_rss.with_context(|| {
        format!("{what}: no smaps_rollup at the exit stop where its RSS is split")
    })?;
    Ok(Sample {
        first_byte,
        exit,
        peak_rss_kib,
        wait4_maxrss_kib: usage.ru_maxrss as u64,
        exit_rss,
    })
}
/// The resident memory of `pid` split into anonymous and mapped from files
/// (`/proc/<pid>/smaps_rollup`: `Rss` and `Anonymous`, both KiB).
fn rss_split(pid: libc::pid_t) -> Option<RssSplit> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    parse_rss_split(&rollup)
}

fn parse_rss_split(rollup: &str) -> Option<RssSplit> {
    let field = |name: &str| -> Option<u64> {
        rollup
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let rss = field("Rss")?;
    let anon_kib = field("Anonymous")?;
    Some(RssSplit {
        anon_kib,
        mapped_kib: rss.checked_sub(anon_kib)?,
    })
}

/// `VmHWM` (peak RSS, KiB) of /proc/<pid>/status.
fn vm_hwm_kib(pid: libc::pid_t) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Resumes our stopped tracee `pid`, delivering `signal` (0: none).
fn resume(pid: libc::pid_t, signal: libc::c_int) -> std::io::Result<()> {
    // SAFETY: PTRACE_CONT on our own stopped tracee; the data argument is a signal number, no
    // memory is passed.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_CONT,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            signal as usize as *mut libc::c_void,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Kills our child `pid` (traced or not) and reaps it, resuming it from any ptrace stop on the
/// way (a traced process stops at its exit even when killed).
fn kill_and_reap(pid: libc::pid_t) {
    // SAFETY: kill(2) of our own child, which is not reaped yet (so the pid is still ours).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: pid is our own child; status points to a live local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r != pid || !libc::WIFSTOPPED(status) {
            return;
        }
        let _ = resume(pid, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rss_at_exit_splits_into_anonymous_and_mapped() {
        // A smaps_rollup as Linux 6.18 prints it (abridged): `Rss` sums anonymous, file and
        // shared memory pages; `Pss_Anon` and friends must not be taken for `Anonymous`.
        let rollup = "555555554000-7ffffffff000 ---p 00000000 00:00 0  [rollup]\n\
                      Rss:                4668 kB\n\
                      Pss:                2827 kB\n\
                      Pss_Anon:            376 kB\n\
                      Pss_File:           2451 kB\n\
                      Anonymous:           376 kB\n\
                      AnonHugePages:         0 kB\n";
        let split = parse_rss_split(rollup).unwrap();
        assert_eq!((split.anon_kib, split.mapped_kib), (376, 4292));
        assert!(parse_rss_split("Rss: 10 kB\n").is_none());
        assert!(parse_rss_split("Rss: 10 kB\nAnonymous: 11 kB\n").is_none());
    }
}
