//! Saying why the process died: a filter's forbidden call traps (`SECCOMP_RET_TRAP`, a
//! `SIGSYS`), this handler writes one line naming the thread and the system call to the
//! report descriptor (standard error unless the embedder gave another, such as its log), then
//! makes a call no role allows, which the kernel, finding `SIGSYS` blocked inside its handler,
//! turns into the death of the whole process by `SIGSYS`. The end is the same as
//! `SECCOMP_RET_KILL_PROCESS`; only the line is added.
//!
//! The handler is no way out for a hijacked thread: installing, changing or ignoring a signal
//! handler (`rt_sigaction`) is in no role's list, and a `SIGSYS` that the thread blocked or
//! ignored is delivered by the kernel with the default action (death) all the same. The
//! handler itself makes raw system calls only (`write`, `gettid`, `getpid`, `tgkill`), on a
//! buffer on its stack.

use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

/// Where the handler writes its line (2: standard error).
static REPORT_FD: AtomicI32 = AtomicI32::new(2);

/// `si_code` of a `SIGSYS` raised by seccomp (`SYS_SECCOMP`).
const SYS_SECCOMP: i32 = 1;
/// Where `si_syscall` is in x86_64's `siginfo_t`: after `si_signo`, `si_errno`, `si_code` and
/// padding (16 bytes) and `_sigsys._call_addr` (8 bytes).
const SI_SYSCALL_OFFSET: usize = 24;

/// Makes the handler write to `fd` (kept open for the life of the process) instead of
/// standard error: the embedder's log, so that the reason reaches whoever reads it.
pub fn report_violations_to(fd: OwnedFd) {
    let old = REPORT_FD.swap(fd.into_raw_fd(), Ordering::SeqCst);
    if old != 2 {
        // SAFETY: `old` is a descriptor an earlier call handed over and nothing else uses.
        unsafe { libc::close(old) };
    }
}

/// The descriptor the handler writes to (standard error unless [`report_violations_to`] gave
/// another): a VMM process started by the embedder gets it as its standard error.
pub fn report_fd() -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: the descriptor is kept open for the life of the process (it is only ever
    // replaced by report_violations_to, which embedders call once, at start-up).
    unsafe { std::os::fd::BorrowedFd::borrow_raw(REPORT_FD.load(Ordering::SeqCst)) }
}

/// Installs the handler once per process.
pub(crate) fn install_handler() -> std::io::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; the handler has the SA_SIGINFO signature, and
        // SIGSYS stays blocked while it runs (the default for the signal being handled).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                result = Err(std::io::Error::last_os_error());
            }
        }
    });
    result
}

/// Appends `n` in decimal to `buf` at `*at`.
fn push_num(buf: &mut [u8], at: &mut usize, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    push(buf, at, &digits[i..]);
}

fn push(buf: &mut [u8], at: &mut usize, s: &[u8]) {
    let n = s.len().min(buf.len() - *at);
    buf[*at..*at + n].copy_from_slice(&s[..n]);
    *at += n;
}

/// The report line for a forbidden `syscall` on thread `tid`.
fn line(buf: &mut [u8; 192], tid: u64, syscall: u64) -> usize {
    let mut at = 0;
    push(buf, &mut at, b"vmm jail: thread ");
    push_num(buf, &mut at, tid);
    push(buf, &mut at, b" made system call ");
    push_num(buf, &mut at, syscall);
    push(
        buf,
        &mut at,
        b", which its seccomp filter forbids; the process ends (SIGSYS)\n",
    );
    at
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    if code != SYS_SECCOMP {
        return; // Not a filter's trap (someone sent SIGSYS): nothing to report.
    }
    // SAFETY: for SYS_SECCOMP the kernel fills `_sigsys`, whose `_syscall` is an int at this
    // offset of the siginfo_t it passed.
    let syscall = unsafe { *((info as *const u8).add(SI_SYSCALL_OFFSET) as *const i32) };
    // SAFETY: raw system calls with integer arguments and a buffer on this stack.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid);
        let mut buf = [0u8; 192];
        let n = line(&mut buf, tid as u64, syscall as u64);
        libc::syscall(
            libc::SYS_write,
            REPORT_FD.load(Ordering::Relaxed),
            buf.as_ptr(),
            n,
        );
        // No role lets SIGKILL through tgkill: this traps again with SIGSYS blocked, and the
        // kernel kills the process by SIGSYS. (Were it let through, it would kill it too.)
        let pid = libc::syscall(libc::SYS_getpid);
        libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_thread_and_the_call() {
        let mut buf = [0u8; 192];
        let n = line(&mut buf, 4242, 257);
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            "vmm jail: thread 4242 made system call 257, which its seccomp filter forbids; the process ends (SIGSYS)\n"
        );
        let n = line(&mut buf, u64::MAX, 0);
        assert!(n <= buf.len());
    }
}
