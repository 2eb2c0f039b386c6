//! The signal that kicks a vCPU thread out of `KVM_RUN` (vcpu.rs: to stop or pause it): its
//! number, and its handler, which does nothing, so that `KVM_RUN` returns `EINTR`. Apart from the
//! vCPU code because the handle that kicks and the jail's filters that allow the signal need it
//! too.

use std::sync::Once;

use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::VmmError;

/// Offset from SIGRTMIN of the signal that kicks vCPU threads out of KVM_RUN.
const KICK_SIGNAL_OFFSET: i32 = 2;

/// The signal number used to kick vCPU threads.
pub fn kick_signal() -> i32 {
    SIGRTMIN() + KICK_SIGNAL_OFFSET
}

/// Installs the (no-op) kick signal handler once per process.
pub fn install_kick_handler() -> Result<(), VmmError> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
        result = register_signal_handler(kick_signal(), on_kick).map_err(|e| VmmError::Io {
            op: "install the vCPU kick signal handler".into(),
            source: e.into(),
        });
    });
    result
}
