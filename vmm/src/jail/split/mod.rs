//! The process split: a VM in a process of its own, started by the embedder from its own
//! binary (a hidden subcommand, [`SUBCOMMAND`]), jailed before any thread of the VM exists,
//! driven over the control [`Channel`](super::channel::Channel) (docs/security.md, "The VMM's
//! confinement").
//!
//! The embedder's half is [`VmmProcess`]: it makes the channel, starts the process with
//! `clone(CLONE_NEWPID | CLONE_PIDFD)` then `execve` (the VMM is PID 1 of a PID namespace of its
//! own; the pidfd says when it died, without a race on the pid), hands it the VM's
//! [`VmDescription`] in `Start` and the descriptors the description names, and sends the
//! requests of a running VM. The embedder opens every host resource that lies outside the VM's
//! work folder and gives it as a descriptor: the kernel and the initrd (read-only) and
//! `/dev/kvm` ([`HostFiles`]), the taps, the disk files. The VMM process's half is [`serve`]: it
//! takes the descriptors the description names and closes every other, boots the kernel and
//! initrd it was given (whatever is at their paths by then: it never opens them, nor
//! `/dev/kvm`), opens what stays a path (the console log and the vsock socket in the work
//! folder, VFIO devices by the sysfs paths the embedder names) and builds its devices, then,
//! still before any thread of the VM exists ([`crate::Vm::start_then`]): new mount, IPC, UTS
//! and network namespaces, `pivot_root` into an empty read-only tmpfs that holds only the VM's
//! work folder (vsock's guest-to-host sockets), the page templates' folder and its own slave
//! copy of the shared directory, each at its own path, the limits, the capabilities the
//! virtio-fs server needs (none without a shared directory), `no_new_privs`; the virtio-fs
//! server is opened then, inside that root. Then the VM's threads start under their filters, a
//! page sharing thread installs its filter, and the main thread installs the control filter
//! and serves the channel until the VM ends; it then says how (`Ended`) and exits.
//!
//! The descriptors of the start are inherited through `execve`, named by number in the
//! description, rather than sent over the channel with `SCM_RIGHTS` (as a disk attached later
//! is): every descriptor of the embedder stays close-on-exec in the embedder, and only the
//! child, between `clone` and `execve`, clears the flag on its own copies of the named ones,
//! so no other process the embedder starts meanwhile inherits them; they are in place before
//! the VMM process reads its first message, and the description and its descriptors cannot
//! part (one `Start`, whatever the count, within the channel's limit of descriptors per
//! message or not).
//!
//! The folder, from the bottom up (no file imports this one):
//! - `description.rs`: what the VMM process is given, [`VmDescription`] (sent as JSON in
//!   `Start`), and the host files the embedder opens for it ([`HostFiles`]);
//! - `wait.rs`: waiting for the channel or the process's pidfd to be readable, which both
//!   halves do;
//! - `serve.rs`: the VMM process's half ([`serve`]): the descriptors taken, the jail, the VM
//!   started and the channel served until the VM ends;
//! - `vmm_process.rs`: the embedder's half ([`VmmProcess`]): the process started, the requests
//!   of a running VM, how it ended ([`VmmEnd`]).

mod description;
mod serve;
mod vmm_process;
mod wait;

pub use description::{
    BlockDescription, FileDescription, HostFiles, NetDescription, PageSharingDescription,
    SharedFsDescription, VmDescription, VsockDescription,
};
pub use serve::{serve, serve_with, ExtraThread, ServeError, SUBCOMMAND};
pub use vmm_process::{SplitError, VmmEnd, VmmProcess};
