//! Holding every thread that runs guest work (the vCPUs and the device event loop) at a pause
//! point, running something on guest memory, then letting them continue.
//!
//! A vCPU thread checks the gate before every KVM_RUN and the device thread before every epoll
//! wait; the pauser raises the gate and kicks them (the vCPU kick signal, which makes KVM_RUN
//! return EINTR, and the event loop's wake-up eventfd) until every one of them is parked, for at
//! most a bounded time. Nothing of the VM's state is touched: a parked vCPU is simply not in
//! KVM_RUN, as between two exits. A VM that ends meanwhile ends the wait (its threads leave
//! instead of parking) with [`PauseError::Ended`]; a thread that does not park in time gives
//! [`PauseError::TimedOut`]. Either way the gate is lowered again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_devices::bus::lock;

/// How often the pauser repeats its kicks while it waits (a kick can land just before a thread
/// enters KVM_RUN, where it is lost: the next one gets it out).
const KICK_INTERVAL: Duration = Duration::from_millis(2);
/// How long a parked thread sleeps between checks of the stop flag (the stop also wakes it).
const PARK_RECHECK: Duration = Duration::from_millis(100);

/// Why a pause did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("the VM ended before its threads paused")]
    Ended,
    #[error("only {parked} of {threads} VM threads paused within {timeout:?}")]
    TimedOut {
        parked: usize,
        threads: usize,
        timeout: Duration,
    },
    #[error("another pause is in progress")]
    Busy,
}

struct GateState {
    requested: bool,
    parked: usize,
}

/// The pause gate of one VM (in its shared state).
pub(crate) struct PauseGate {
    requested: AtomicBool,
    state: Mutex<GateState>,
    cv: Condvar,
}

impl PauseGate {
    pub(crate) fn new() -> Self {
        Self {
            requested: AtomicBool::new(false),
            state: Mutex::new(GateState {
                requested: false,
                parked: 0,
            }),
            cv: Condvar::new(),
        }
    }

    /// Whether a pause is asked for (cheap: checked before every KVM_RUN).
    pub(crate) fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// The pause point of a VM thread: while a pause is asked for and `stopping()` is false,
    /// waits here (counted as parked).
    pub(crate) fn park(&self, stopping: impl Fn() -> bool) {
        let mut s = lock(&self.state);
        if !s.requested {
            return;
        }
        s.parked += 1;
        self.cv.notify_all();
        while s.requested && !stopping() {
            s = self
                .cv
                .wait_timeout(s, PARK_RECHECK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.parked -= 1;
        self.cv.notify_all();
    }

    /// Wakes parked threads and a waiting pauser to look at the stop flag again (called when
    /// the VM ends).
    pub(crate) fn wake_all(&self) {
        let _s = lock(&self.state);
        self.cv.notify_all();
    }

    /// Raises the gate and waits until `threads` threads are parked, calling `kick` every few
    /// milliseconds, for at most `timeout`. The returned guard lowers the gate when dropped.
    pub(crate) fn pause(
        &self,
        threads: usize,
        kick: impl Fn(),
        stopping: impl Fn() -> bool,
        timeout: Duration,
    ) -> Result<Paused<'_>, PauseError> {
        {
            let mut s = lock(&self.state);
            if s.requested {
                return Err(PauseError::Busy);
            }
            s.requested = true;
            self.requested.store(true, Ordering::SeqCst);
        }
        let guard = Paused { gate: self };
        let deadline = Instant::now() + timeout;
        loop {
            {
                let s = lock(&self.state);
                if s.parked >= threads {
                    return Ok(guard);
                }
                if stopping() {
                    return Err(PauseError::Ended);
                }
                if Instant::now() >= deadline {
                    return Err(PauseError::TimedOut {
                        parked: s.parked,
                        threads,
                        timeout,
                    });
                }
            }
            kick();
            let s = lock(&self.state);
            if s.parked < threads {
                let _ = self
                    .cv
                    .wait_timeout(s, KICK_INTERVAL)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

/// A pause in force; dropping it lets the threads continue.
pub(crate) struct Paused<'a> {
    gate: &'a PauseGate,
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.gate.state);
        s.requested = false;
        self.gate.requested.store(false, Ordering::SeqCst);
        self.gate.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// Threads that count "guest work" in a loop with a pause point, as the vCPU loop does.
    /// Waits (bounded) until the workers count more work than now.
    fn assert_work_resumes(work: &AtomicUsize) {
        let resumed = work.load(Ordering::SeqCst);
        let end = Instant::now() + Duration::from_secs(10);
        while work.load(Ordering::SeqCst) == resumed && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            work.load(Ordering::SeqCst) > resumed,
            "no work after resume"
        );
    }

    fn workers(
        n: usize,
        gate: &Arc<PauseGate>,
        stop: &Arc<AtomicBool>,
        work: &Arc<AtomicUsize>,
    ) -> Vec<std::thread::JoinHandle<()>> {
        (0..n)
            .map(|_| {
                let (gate, stop, work) = (gate.clone(), stop.clone(), work.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        if gate.requested() {
                            gate.park(|| stop.load(Ordering::SeqCst));
                            continue;
                        }
                        work.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(200));
                    }
                })
            })
            .collect()
    }

    #[test]
    fn no_work_happens_while_paused_and_it_resumes_after() {
        let gate = Arc::new(PauseGate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let work = Arc::new(AtomicUsize::new(0));
        let threads = workers(3, &gate, &stop, &work);
        for _ in 0..5 {
            let p = gate
                .pause(3, || {}, || false, Duration::from_secs(10))
                .unwrap();
            let before = work.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(work.load(Ordering::SeqCst), before, "work while paused");
            drop(p);
            assert_work_resumes(&work);
        }
        stop.store(true, Ordering::SeqCst);
        gate.wake_all();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_thread_that_never_parks_times_out_and_the_gate_is_lowered() {
        let gate = Arc::new(PauseGate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let work = Arc::new(AtomicUsize::new(0));
        let threads = workers(1, &gate, &stop, &work);
        let kicks = AtomicUsize::new(0);
        let r = gate.pause(
            2,
            || {
                kicks.fetch_add(1, Ordering::SeqCst);
            },
            || false,
            Duration::from_millis(50),
        );
        assert!(
            matches!(
                r,
                Err(PauseError::TimedOut {
                    parked: 1,
                    threads: 2,
                    ..
                })
            ),
            "{:?}",
            r.err()
        );
        assert!(
            kicks.load(Ordering::SeqCst) > 1,
            "the pauser kicks repeatedly"
        );
        assert!(!gate.requested());
        // The parked worker went back to work.
        assert_work_resumes(&work);
        stop.store(true, Ordering::SeqCst);
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_vm_ending_during_the_wait_ends_the_pause_with_an_error() {
        let gate = Arc::new(PauseGate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let started = Instant::now();
        let r = gate.pause(
            1,
            || s.store(true, Ordering::SeqCst),
            || stop.load(Ordering::SeqCst),
            Duration::from_secs(30),
        );
        assert!(matches!(r, Err(PauseError::Ended)), "{:?}", r.err());
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(!gate.requested());
    }

    #[test]
    fn parked_threads_leave_when_the_vm_stops() {
        let gate = Arc::new(PauseGate::new());
        let stop = Arc::new(AtomicBool::new(false));
        let work = Arc::new(AtomicUsize::new(0));
        let threads = workers(2, &gate, &stop, &work);
        let p = gate
            .pause(2, || {}, || false, Duration::from_secs(10))
            .unwrap();
        assert!(matches!(
            gate.pause(2, || {}, || false, Duration::from_secs(1)),
            Err(PauseError::Busy)
        ));
        stop.store(true, Ordering::SeqCst);
        gate.wake_all();
        for t in threads {
            t.join().unwrap();
        }
        drop(p);
    }
}
