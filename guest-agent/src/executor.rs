//! What runs in a container's process between libcontainer's setup and the user program
//! ([`AgentExecutor`]), and the seccomp plan of an exec ([`ExecSeccomp`]).

use libcontainer::workload::default::DefaultExecutor;
use libcontainer::workload::{Executor, ExecutorError, ExecutorValidationError};
use oci_spec::runtime::{LinuxCapabilities, LinuxSeccomp, Process, Spec};
use serde::{Deserialize, Serialize};

/// What libcontainer runs in the container's process right before the user program: undoes the
/// agent's own signal state (SIGCHLD blocked for the reaper, SIGPIPE ignored by Rust's runtime),
/// which a clone inherits, then (execs only, see [`ExecSeccomp`]) loads the container's seccomp
/// filter, then execs like libcontainer's default.
#[derive(Clone, Default)]
pub struct AgentExecutor {
    pub seccomp: Option<ExecSeccomp>,
}

/// The container's seccomp filter for an exec. libcontainer 0.7's tenant builder rebuilds the
/// spec's `linux` section for an exec and leaves `seccomp` out, so the exec would run without the
/// filter the container's init runs under. The agent loads it in the exec's process itself, in
/// runc's order (runc's setns_init_linux.go): with `noNewPrivileges` right before exec, after the
/// capabilities were dropped; without it loading needs CAP_SYS_ADMIN, so libcontainer is given
/// the process without `capabilities` (it then keeps the agent's, across the user switch too),
/// and after loading the filter the executor drops them to the process's, as libcontainer would
/// have.
/// Why an exec's seccomp filter cannot be planned (the caller reports it as a spec error).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the container's seccomp profile uses SCMP_ACT_NOTIFY, which execs do not support")]
    NotifyInExec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecSeccomp {
    filter: LinuxSeccomp,
    /// The capabilities to drop to after loading the filter (without `noNewPrivileges`).
    then_capabilities: Option<LinuxCapabilities>,
}

impl ExecSeccomp {
    /// Splits an exec's process for libcontainer and the executor: the process to give the
    /// tenant builder and what the executor must do. No filter: nothing to do.
    pub fn plan(
        container_filter: Option<&LinuxSeccomp>,
        mut process: Process,
    ) -> Result<(Process, Option<Self>), PlanError> {
        let Some(filter) = container_filter else {
            return Ok((process, None));
        };
        if libcontainer::seccomp::is_notify(filter) {
            return Err(PlanError::NotifyInExec);
        }
        let then_capabilities = if process.no_new_privileges() == Some(true) {
            None
        } else {
            let caps = process.capabilities().clone();
            process.set_capabilities(None);
            caps
        };
        Ok((
            process,
            Some(Self {
                filter: filter.clone(),
                then_capabilities,
            }),
        ))
    }

    fn apply(&self) -> Result<(), ExecutorError> {
        libcontainer::seccomp::initialize_seccomp(&self.filter).map_err(|e| {
            ExecutorError::Other(format!("loading the container's seccomp filter: {e}"))
        })?;
        if let Some(caps) = &self.then_capabilities {
            let syscall = libcontainer::syscall::syscall::create_syscall();
            libcontainer::capabilities::drop_privileges(caps, syscall.as_ref()).map_err(|e| {
                ExecutorError::Other(format!("dropping the exec's capabilities: {e}"))
            })?;
        }
        Ok(())
    }
}

impl Executor for AgentExecutor {
    fn exec(&self, spec: &Spec) -> Result<(), ExecutorError> {
        // SAFETY: resetting the mask and SIGPIPE's disposition in the single-threaded child
        // just before exec; the set is initialised by sigemptyset.
        unsafe {
            let mut empty = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
            libc::sigemptyset(empty.as_mut_ptr());
            libc::sigprocmask(libc::SIG_SETMASK, empty.as_ptr(), std::ptr::null_mut());
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
        if let Some(seccomp) = &self.seccomp {
            seccomp.apply()?;
        }
        DefaultExecutor {}.exec(spec)
    }

    fn validate(&self, spec: &Spec) -> Result<(), ExecutorValidationError> {
        DefaultExecutor {}.validate(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(json: &str) -> Process {
        serde_json::from_str(json).expect("process JSON")
    }

    fn filter(action: &str) -> LinuxSeccomp {
        serde_json::from_str(&format!(
            r#"{{"defaultAction":"SCMP_ACT_ERRNO","syscalls":[{{"names":["read"],"action":"{action}"}}]}}"#
        ))
        .expect("seccomp JSON")
    }

    const CAPS: &str = r#""capabilities":{"bounding":["CAP_CHOWN"],"effective":["CAP_CHOWN"],"permitted":["CAP_CHOWN"]}"#;

    #[test]
    fn an_exec_of_a_container_without_seccomp_is_left_to_libcontainer() {
        let p = process(&format!(
            r#"{{"cwd":"/","args":["sh"],"user":{{"uid":0,"gid":0}},{CAPS}}}"#
        ));
        let (out, seccomp) = ExecSeccomp::plan(None, p.clone()).expect("plan");
        assert_eq!(out, p);
        assert!(seccomp.is_none());
    }

    #[test]
    fn with_no_new_privs_the_filter_is_loaded_last_and_caps_stay_with_libcontainer() {
        let p = process(&format!(
            r#"{{"cwd":"/","args":["sh"],"user":{{"uid":0,"gid":0}},"noNewPrivileges":true,{CAPS}}}"#
        ));
        let (out, seccomp) =
            ExecSeccomp::plan(Some(&filter("SCMP_ACT_ALLOW")), p.clone()).expect("plan");
        assert_eq!(out, p);
        let seccomp = seccomp.expect("a filter to load");
        assert_eq!(seccomp.filter, filter("SCMP_ACT_ALLOW"));
        assert!(seccomp.then_capabilities.is_none());
    }

    #[test]
    fn without_no_new_privs_the_caps_are_dropped_after_the_filter_is_loaded() {
        let p = process(&format!(
            r#"{{"cwd":"/","args":["sh"],"user":{{"uid":0,"gid":0}},{CAPS}}}"#
        ));
        let (out, seccomp) =
            ExecSeccomp::plan(Some(&filter("SCMP_ACT_ALLOW")), p.clone()).expect("plan");
        assert!(out.capabilities().is_none(), "{out:?}");
        assert_eq!(out.args(), p.args());
        let seccomp = seccomp.expect("a filter to load");
        assert_eq!(&seccomp.then_capabilities, p.capabilities());
    }

    #[test]
    fn a_notify_profile_is_refused_for_execs() {
        let p = process(r#"{"cwd":"/","args":["sh"],"user":{"uid":0,"gid":0}}"#);
        let err = ExecSeccomp::plan(Some(&filter("SCMP_ACT_NOTIFY")), p).expect_err("refused");
        assert!(err.to_string().contains("SCMP_ACT_NOTIFY"), "{err}");
    }

    #[test]
    fn a_plan_survives_the_trip_to_the_build_process() {
        let p = process(&format!(
            r#"{{"cwd":"/","args":["sh"],"user":{{"uid":0,"gid":0}},{CAPS}}}"#
        ));
        let (_, seccomp) = ExecSeccomp::plan(Some(&filter("SCMP_ACT_ALLOW")), p).expect("plan");
        let seccomp = seccomp.expect("a filter to load");
        let back: ExecSeccomp =
            serde_json::from_slice(&serde_json::to_vec(&seccomp).expect("to JSON"))
                .expect("from JSON");
        assert_eq!(back.filter, seccomp.filter);
        assert_eq!(back.then_capabilities, seccomp.then_capabilities);
    }
}
