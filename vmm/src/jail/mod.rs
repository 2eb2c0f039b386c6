//! Confinement of the threads that read guest data: one seccomp filter per thread role.
//!
//! Every thread of the VMM that touches guest memory or a device backend installs, as its
//! first act, the filter of its role ([`Role`]) and from then on can make only the system
//! calls that role needs, most with their arguments checked (which `ioctl` requests, `mmap`
//! and `mprotect` without `PROT_EXEC`, only anonymous private mappings, `socket` only for
//! `AF_UNIX`, a short list of `fcntl` commands, `tgkill` only to this process). Anything else
//! kills the whole process: a guest that took over a thread's code gets no second try, and the
//! embedder learns of it as the death of the process by `SIGSYS` (docs/security.md, "The
//! VMM's confinement"). The call traps (`SECCOMP_RET_TRAP`) so that a handler can first write
//! one line naming the thread and the call ([`report_violations_to`]); the handler then
//! makes the kernel end the process (`report.rs` says how, and why a hijacked thread cannot
//! use it to survive).
//!
//! The filters are built at run time with rust-vmm's `seccompiler` from the tables in
//! [`filters`]: they depend on what the VM has ([`Needs`]: VFIO devices add the memory-slot
//! ioctl and the region reads to the vCPUs, a shared directory adds the file server's calls
//! to the thread that serves it) and on this process's id (the `tgkill` check). A filter is
//! installed on the calling thread only (not `TSYNC`): each role's thread installs its own,
//! and the embedder's other threads stay as they were. Installing sets the thread's
//! `no_new_privs` bit, as the kernel requires for an unprivileged filter.
//!
//! [`VmConfig::jail`](crate::VmConfig::jail) turns the filters on or off (on by default).

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub mod channel;
pub mod filters;
pub mod process;
mod report;
pub mod split;

pub use report::{report_fd, report_violations_to};

/// What a thread of the VMM does, hence which system calls it may make.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Runs `KVM_RUN` for one vCPU and the port and MMIO exits on the buses (device
    /// registers, the serial's output, queue notifications, VFIO config space).
    Vcpu,
    /// The device event loop: virtqueues and backends (vsock sockets, the tap, disk files,
    /// the balloon's page drops). Without a separate file-server thread it also serves
    /// virtio-fs, and its filter then adds [`Role::FsWorker`]'s calls.
    DeviceLoop,
    /// The virtio-fs server: requests on the shared directory (passthrough file system).
    FsWorker,
    /// The thread that runs the embedder's requests on a running VM: stop, pause and resume,
    /// disk attach and detach, balloon statistics, the VM's end.
    Control,
    /// A page sharing pass: pauses the VM, reads the page map, maps template files over
    /// guest memory (docs/page-sharing.md).
    PageSharing,
}

impl Role {
    /// Every role, in a stable order (tables, tests).
    pub const ALL: [Role; 5] = [
        Role::Vcpu,
        Role::DeviceLoop,
        Role::FsWorker,
        Role::Control,
        Role::PageSharing,
    ];

    /// The role's name in tables and logs.
    pub fn name(self) -> &'static str {
        match self {
            Role::Vcpu => "vcpu",
            Role::DeviceLoop => "device-loop",
            Role::FsWorker => "fs-worker",
            Role::Control => "control",
            Role::PageSharing => "page-sharing",
        }
    }
}

/// What the VM has that changes a role's filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// VFIO devices: the vCPUs move BAR memory slots and read and write config space.
    pub vfio: bool,
    /// A shared directory served on the device loop (adds [`Role::FsWorker`]'s calls to
    /// [`Role::DeviceLoop`]).
    pub shared_fs: bool,
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("building the seccomp filter of the {role} thread: {source}")]
    Build {
        role: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("compiling the seccomp filter of the {role} thread: {source}")]
    Compile {
        role: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("installing the seccomp filter of the {role} thread: {source}")]
    Install {
        role: &'static str,
        #[source]
        source: seccompiler::Error,
    },
    #[error("installing the SIGSYS handler for the {role} thread's filter: {source}")]
    Handler {
        role: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("this architecture has no VMM seccomp filters (x86_64 only)")]
    Arch,
}

/// A role's filter, compiled and ready to install on the thread that takes the role.
#[derive(Debug, Clone)]
pub struct ThreadFilter {
    role: Role,
    program: BpfProgram,
    syscalls: usize,
}

impl ThreadFilter {
    /// Builds and compiles the filter of `role` for a VM with `needs`, for threads of the
    /// calling process (the `tgkill` check names this process).
    pub fn new(role: Role, needs: Needs) -> Result<Self, JailError> {
        let arch = target_arch()?;
        let rules = filters::rules(role, needs, std::process::id())?;
        let syscalls = rules.len();
        let filter = SeccompFilter::new(
            rules.into_iter().collect::<BTreeMap<_, _>>(),
            SeccompAction::Trap,
            SeccompAction::Allow,
            arch,
        )
        .map_err(|source| JailError::Build {
            role: role.name(),
            source,
        })?;
        let program = BpfProgram::try_from(filter).map_err(|source| JailError::Compile {
            role: role.name(),
            source,
        })?;
        Ok(Self {
            role,
            program,
            syscalls,
        })
    }

    /// The role this filter is for.
    pub fn role(&self) -> Role {
        self.role
    }

    /// How many system calls the filter lets through (with or without argument checks).
    pub fn syscalls(&self) -> usize {
        self.syscalls
    }

    /// The BPF instructions (for size checks and tests).
    pub fn instructions(&self) -> usize {
        self.program.len()
    }

    /// Installs the filter on the calling thread (and sets its `no_new_privs`). Irrevocable:
    /// from here on every call outside the role's list kills the process.
    pub fn install(&self) -> Result<(), JailError> {
        // The C library sets up a thread's malloc arena on the thread's first allocation,
        // reading /sys (openat) to size it: do that now, while it is still allowed.
        drop(std::hint::black_box(Vec::<u8>::with_capacity(64)));
        report::install_handler().map_err(|source| JailError::Handler {
            role: self.role.name(),
            source,
        })?;
        seccompiler::apply_filter(&self.program).map_err(|source| JailError::Install {
            role: self.role.name(),
            source,
        })
    }

    /// The filter's raw program, for installing in a process that has nothing else to
    /// allocate with (a forked child). See [`install_raw`].
    pub fn program(&self) -> &[seccompiler::sock_filter] {
        &self.program
    }
}

/// Installs a compiled program on the calling thread without allocating (for a child between
/// `fork` and `exec`/`exit`, where allocating is not safe).
pub fn install_raw(program: &[seccompiler::sock_filter]) -> Result<(), seccompiler::Error> {
    seccompiler::apply_filter(program)
}

fn target_arch() -> Result<TargetArch, JailError> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else {
        Err(JailError::Arch)
    }
}

/// The system calls each role allows (names, sorted), for the table in docs/security.md.
pub fn allowed_names(role: Role, needs: Needs) -> Result<Vec<&'static str>, JailError> {
    let mut names: Vec<&'static str> = filters::rules(role, needs, std::process::id())?
        .into_iter()
        .map(|(nr, _)| filters::name_of(nr))
        .collect();
    names.sort_unstable();
    Ok(names)
}

#[cfg(test)]
mod tests;
