//! Containers inside the guest, run with youki's `libcontainer` from their OCI spec.
//!
//! State: libcontainer's under `<state>/containers/<id>`, our bundles (the spec as config.json,
//! exec process files) under `<state>/bundles/<id>`. Each container's cgroup is
//! `/sys/fs/cgroup/microvm/<id>` whatever the spec says (the host's cgroup paths mean nothing in
//! the guest). Every process the agent starts is registered with the reaper under its lock (see
//! [`crate::reaper`]), so exit statuses are exact.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_protocol::stdio::valid_id;
use libcontainer::container::Container;
use oci_spec::runtime::{
    LinuxDeviceCgroup, LinuxNamespaceType, LinuxResources, LinuxSeccomp, Process, Spec,
};

use crate::build_process::{self, BuildKind, BuildRequest};
use crate::executor::ExecSeccomp;
use crate::pod_namespace::POD_PID_NAMESPACE;
use crate::reaper::{self, ExitCell};
use crate::stdio::{StreamLookup, Streams};

/// Where container cgroups live, under the cgroup2 root.
const CGROUP_PARENT: &str = "/microvm";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Time for libcontainer's init to hand over the pty master.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("invalid id {0:?}")]
    BadId(String),
    #[error("container {0} already exists")]
    Exists(String),
    #[error("no container {0}")]
    NoContainer(String),
    #[error("no exec {exec_id:?} in container {container_id}")]
    NoExec {
        container_id: String,
        exec_id: String,
    },
    #[error("exec {0:?} already exists")]
    ExecExists(String),
    #[error("process {0:?} was already started")]
    AlreadyStarted(String),
    #[error("process {0:?} has not been started")]
    NotStarted(String),
    #[error("process {0:?} is still running")]
    StillRunning(String),
    #[error("invalid {what} JSON: {source}")]
    Json {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("invalid spec: {0}")]
    Spec(String),
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("{0}")]
    Stdio(#[from] crate::stdio::StdioError),
    #[error("{what}: {}", crate::runtime_log::error_chain(.source))]
    Runtime {
        what: &'static str,
        source: libcontainer::error::LibcontainerError,
    },
    /// A failed build of a container or exec (in the build process, see [`crate::build_process`]).
    #[error("{what}: {source}")]
    Build {
        what: &'static str,
        source: crate::build_process::BuildError,
    },
    #[error("updating cgroup: {0}")]
    Cgroup(String),
    #[error("sending signal {signal}: {source}")]
    Signal { signal: u32, source: io::Error },
    #[error("the process has no terminal")]
    NoTerminal,
    #[error("container rootfs {path}: {reason}")]
    Rootfs { path: PathBuf, reason: String },
    #[error("creating the working directory {path} (process.cwd) in the rootfs: {reason}")]
    Cwd { path: PathBuf, reason: String },
    #[error("privileged container: {0}")]
    Privileged(#[from] crate::privileged::PrivilegedError),
    #[error("{0}")]
    Volume(#[from] crate::volumes::VolumeError),
}

/// The spec's root must be an existing directory in the guest (the shim's share of it): say which
/// path is missing rather than libcontainer's generic error later.
fn check_rootfs(spec: &Spec) -> Result<(), ContainerError> {
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| ContainerError::Spec("no root".into()))?;
    let path = root.path().clone();
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(ContainerError::Rootfs {
            path,
            reason: "not a directory".into(),
        }),
        Err(err) => Err(ContainerError::Rootfs {
            path,
            reason: format!("{err} (is the pod's shared filesystem mounted?)"),
        }),
    }
}

/// runc creates a missing `process.cwd` (MkdirAll, 0755, as root, inside the container's root
/// after its mounts); libcontainer 0.7 fails the container. The agent creates it in the rootfs
/// before the build, resolving the path inside the rootfs (libpathrs: no symlink or `..` leads
/// out of it). A working directory under one of the spec's mount destinations is left alone:
/// runc would create it in the mounted volume, which is not there yet.
fn ensure_cwd(spec: &Spec) -> Result<(), ContainerError> {
    let Some(cwd) = spec.process().as_ref().map(|p| p.cwd().clone()) else {
        return Ok(());
    };
    if !cwd.is_absolute() || cwd == Path::new("/") {
        return Ok(());
    }
    let under_a_mount = spec.mounts().iter().flatten().any(|m| {
        let dest = m.destination();
        dest != Path::new("/") && cwd.starts_with(dest)
    });
    if under_a_mount {
        return Ok(());
    }
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| ContainerError::Spec("no root".into()))?
        .path()
        .clone();
    let fail = |reason: String| ContainerError::Cwd {
        path: cwd.clone(),
        reason,
    };
    let root = pathrs::Root::open(&root).map_err(|e| fail(e.to_string()))?;
    let relative = cwd.strip_prefix("/").unwrap_or(&cwd);
    use std::os::unix::fs::PermissionsExt;
    root.mkdir_all(relative, &std::fs::Permissions::from_mode(0o755))
        .map_err(|e| fail(e.to_string()))?;
    Ok(())
}

impl ContainerError {
    /// The ttrpc code that fits.
    pub fn code(&self) -> ttrpc::Code {
        match self {
            Self::BadId(_) | Self::Json { .. } | Self::Spec(_) | Self::NoTerminal => {
                ttrpc::Code::INVALID_ARGUMENT
            }
            Self::Exists(_) | Self::ExecExists(_) => ttrpc::Code::ALREADY_EXISTS,
            Self::NoContainer(_) | Self::NoExec { .. } => ttrpc::Code::NOT_FOUND,
            Self::AlreadyStarted(_) | Self::NotStarted(_) | Self::StillRunning(_) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            _ => ttrpc::Code::INTERNAL,
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ContainerError {
    let what = what.into();
    move |source| ContainerError::Io { what, source }
}

/// Which stdio streams the host will attach.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdioRequest {
    pub terminal: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// One process: the init or an exec.
pub struct Proc {
    pub streams: Arc<Streams>,
    pub exit: Arc<ExitCell>,
    pid: Mutex<Option<libc::pid_t>>,
    terminal: bool,
    /// Exec only: the OCI process and its child stdio, until StartExec.
    pending: Mutex<Option<(Process, Option<crate::stdio::ChildStdio>)>>,
}

impl Proc {
    pub fn pid(&self) -> Option<libc::pid_t> {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether a container's init has a PID namespace of its own. The kernel ends every process of
/// a namespace when its init exits; an init that shares one (the pod's, another container's, the
/// agent's) leaves its children running, holding the container's output open. Those are killed
/// when the init exits, as runc's shim does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PidNamespace {
    Own,
    Shared,
}

impl PidNamespace {
    /// A `pid` entry without a path makes a new namespace; a path joins one; no entry at all
    /// stays in the agent's.
    fn of(spec: &Spec) -> Self {
        let own = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .is_some_and(|namespaces| {
                namespaces.iter().any(|ns| {
                    ns.typ() == LinuxNamespaceType::Pid
                        && ns.path().as_ref().is_none_or(|p| p.as_os_str().is_empty())
                })
            });
        if own {
            Self::Own
        } else {
            Self::Shared
        }
    }
}

struct Entry {
    runtime: Mutex<Container>,
    init: Arc<Proc>,
    pid_namespace: PidNamespace,
    execs: Mutex<HashMap<String, Arc<Proc>>>,
    bundle: PathBuf,
    /// The container's seccomp filter, for its execs.
    seccomp: Option<LinuxSeccomp>,
    /// The container's device rules as created (with the guest's numbers), for its updates.
    device_rules: Option<Vec<LinuxDeviceCgroup>>,
}

/// Cgroup v2 figures of one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub cpu_usage_usec: u64,
    pub cpu_user_usec: u64,
    pub cpu_system_usec: u64,
    pub memory_usage_bytes: u64,
    pub memory_limit_bytes: u64,
    pub pids_current: u64,
    pub oom_kills: u64,
}

pub struct Containers {
    state_root: PathBuf,
    bundle_root: PathBuf,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    volumes: crate::volumes::Volumes,
}

fn check_id(id: &str) -> Result<(), ContainerError> {
    if valid_id(id) {
        Ok(())
    } else {
        Err(ContainerError::BadId(id.to_owned()))
    }
}

pub fn cgroup_dir(container_id: &str) -> PathBuf {
    Path::new(CGROUP_ROOT)
        .join(CGROUP_PARENT.trim_start_matches('/'))
        .join(container_id)
}

fn ns_file(kind: LinuxNamespaceType) -> &'static str {
    match kind {
        LinuxNamespaceType::Mount => "mnt",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Time => "time",
    }
}

/// `rootfsPropagation` as libcontainer 0.7 knows it. runc accepts the recursive spellings too,
/// and containerd writes them (`rshared` for a Bidirectional volume, `rslave` for
/// HostToContainer); libcontainer knows only `shared`, `slave`, `private` and `unbindable`, and
/// makes the root's propagation recursive (MS_REC) for each anyway.
fn rootfs_propagation(value: &str) -> Result<&'static str, ContainerError> {
    match value {
        "shared" | "rshared" => Ok("shared"),
        "slave" | "rslave" => Ok("slave"),
        "private" | "rprivate" => Ok("private"),
        "unbindable" | "runbindable" => Ok("unbindable"),
        other => Err(ContainerError::Spec(format!(
            "linux.rootfsPropagation {other:?}: not one of shared, slave, private, unbindable \
             (or their r- forms)"
        ))),
    }
}

/// libcgroups raises RLIMIT_MEMLOCK to 128 MiB (soft and hard) in libcontainer's intermediate
/// process before it loads a container's device program, and the container's init, forked from
/// there, inherits it (runc's init keeps runc's own; the container's execs keep the agent's).
/// Unless the spec sets RLIMIT_MEMLOCK itself, the init (waiting for Start, its program not yet
/// run) gets the agent's limit back.
fn restore_memlock(pid: libc::pid_t, spec: &Spec) -> Result<(), ContainerError> {
    use oci_spec::runtime::PosixRlimitType;
    let set_by_spec = spec
        .process()
        .as_ref()
        .and_then(|p| p.rlimits().as_ref())
        .is_some_and(|r| r.iter().any(|l| l.typ() == PosixRlimitType::RlimitMemlock));
    if set_by_spec {
        return Ok(());
    }
    let mut own = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one rlimit into `own`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut own) } != 0 {
        return Err(io_err("reading the agent's RLIMIT_MEMLOCK")(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: prlimit(2) reads `own`, alive for the call, and writes nothing back. `pid` is the
    // container's init, which the caller holds the reaper's lock for: not reaped, not reused.
    if unsafe { libc::prlimit(pid, libc::RLIMIT_MEMLOCK, &own, std::ptr::null_mut()) } != 0 {
        return Err(io_err("setting the container init's RLIMIT_MEMLOCK")(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Binds a console socket, runs `build`, then receives the pty master libcontainer's init sends.
fn with_console<T>(
    dir: &Path,
    build: impl FnOnce(Option<&Path>) -> Result<T, ContainerError>,
    terminal: bool,
) -> Result<(T, Option<File>), ContainerError> {
    if !terminal {
        return build(None).map(|t| (t, None));
    }
    let path = dir.join(format!("console-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(io_err("binding the console socket"))?;
    let built = build(Some(&path));
    let _ = std::fs::remove_file(&path);
    let built = built?;
    let master = receive_fd(&listener).map_err(io_err("receiving the pty master"))?;
    Ok((built, Some(File::from(master))))
}

fn receive_fd(listener: &UnixListener) -> io::Result<OwnedFd> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + CONSOLE_TIMEOUT;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(CONSOLE_TIMEOUT))?;
    let mut buf = [0u8; 4096];
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = nix::sys::socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = cmsg {
            let owned: Vec<OwnedFd> = fds
                .into_iter()
                .map(|fd| {
                    // SAFETY: SCM_RIGHTS delivered these fds to us; nobody else owns them.
                    unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
                })
                .collect();
            if let Some(first) = owned.into_iter().next() {
                return Ok(first);
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "no fd in the console message",
    ))
}

impl Containers {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            state_root: state_dir.join("containers"),
            bundle_root: state_dir.join("bundles"),
            entries: Mutex::new(HashMap::new()),
            volumes: crate::volumes::Volumes::new(Path::new(crate::volumes::VOLUMES_ROOT)),
        }
    }

    fn entry(&self, id: &str) -> Result<Arc<Entry>, ContainerError> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| ContainerError::NoContainer(id.to_owned()))
    }

    fn process(&self, id: &str, exec_id: &str) -> Result<(Arc<Entry>, Arc<Proc>), ContainerError> {
        let entry = self.entry(id)?;
        if exec_id.is_empty() {
            let init = entry.init.clone();
            return Ok((entry, init));
        }
        let proc = entry
            .execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(exec_id)
            .cloned()
            .ok_or_else(|| ContainerError::NoExec {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            })?;
        Ok((entry, proc))
    }

    /// Resolves `container:<id>` namespace paths, sets the agent's cgroup path and spells
    /// `rootfsPropagation` as libcontainer knows it.
    fn rewrite_spec(&self, id: &str, spec: &mut Spec) -> Result<(), ContainerError> {
        let mut linux = spec.linux().clone().unwrap_or_default();
        linux.set_cgroups_path(Some(PathBuf::from(format!("{CGROUP_PARENT}/{id}"))));
        if let Some(p) = linux.rootfs_propagation().clone() {
            linux.set_rootfs_propagation(Some(rootfs_propagation(&p)?.to_owned()));
        }
        if let Some(namespaces) = linux.namespaces().clone() {
            let mut out = Vec::with_capacity(namespaces.len());
            for mut ns in namespaces {
                let path = ns
                    .path()
                    .as_ref()
                    .and_then(|p| p.to_str())
                    .map(str::to_owned);
                let resolved = match path.as_deref() {
                    Some(POD_PID_NAMESPACE) => {
                        if ns.typ() != LinuxNamespaceType::Pid {
                            return Err(ContainerError::Spec(format!(
                                "namespace path {POD_PID_NAMESPACE} is only for the pid namespace"
                            )));
                        }
                        Some(
                            crate::pod_namespace::pid_namespace_path()
                                .map_err(io_err("starting the pod's PID namespace"))?,
                        )
                    }
                    Some(p) => match p.strip_prefix("container:") {
                        Some(other) => {
                            let pid = self
                                .entry(other)
                                .ok()
                                .and_then(|e| e.init.pid())
                                .ok_or_else(|| {
                                    ContainerError::Spec(format!(
                                        "namespace path container:{other}: no such running container"
                                    ))
                                })?;
                            Some(PathBuf::from(format!(
                                "/proc/{pid}/ns/{}",
                                ns_file(ns.typ())
                            )))
                        }
                        None => None,
                    },
                    None => None,
                };
                if let Some(resolved) = resolved {
                    ns.set_path(Some(resolved));
                }
                out.push(ns);
            }
            linux.set_namespaces(Some(out));
        }
        spec.set_linux(Some(linux));
        Ok(())
    }

    pub fn create(
        &self,
        id: &str,
        spec_json: &[u8],
        stdio: StdioRequest,
        blocks: &[crate::blockdev::BlockRequest],
    ) -> Result<u32, ContainerError> {
        check_id(id)?;
        if self.entry(id).is_ok() {
            return Err(ContainerError::Exists(id.to_owned()));
        }
        let mut value: serde_json::Value =
            serde_json::from_slice(spec_json).map_err(|source| ContainerError::Json {
                what: "OCI spec",
                source,
            })?;
        if !blocks.is_empty() {
            crate::blockdev::apply(
                &mut value,
                blocks,
                Path::new("/sys/block"),
                Path::new("/dev"),
            )
            .map_err(|e| ContainerError::Spec(format!("block device: {e}")))?;
        }
        if crate::privileged::is_privileged(&value) {
            let added = crate::privileged::add_guest_devices(&mut value, Path::new("/dev"))?;
            log::info!("container {id}: privileged: the guest's {added} other devices are given");
        }
        self.volumes.attach(id, &mut value)?;
        let result = self.create_parsed(id, value, stdio);
        if result.is_err() {
            self.volumes.release(id);
        }
        result
    }

    /// [`Containers::create`] from the spec the agent rewrote.
    fn create_parsed(
        &self,
        id: &str,
        value: serde_json::Value,
        stdio: StdioRequest,
    ) -> Result<u32, ContainerError> {
        let mut spec: Spec =
            serde_json::from_value(value).map_err(|source| ContainerError::Json {
                what: "OCI spec",
                source,
            })?;
        log::info!("container {id}: creating");
        self.rewrite_spec(id, &mut spec)?;
        if let Some(caps) = spec
            .process()
            .as_ref()
            .and_then(|p| p.capabilities().as_ref())
        {
            crate::privileged::check_capabilities(caps, crate::privileged::last_cap()?)?;
        }
        check_rootfs(&spec)?;
        log::debug!("container {id}: rootfs present");
        ensure_cwd(&spec)?;
        let mut process = spec
            .process()
            .clone()
            .ok_or_else(|| ContainerError::Spec("no process".into()))?;
        process.set_terminal(Some(stdio.terminal));
        spec.set_process(Some(process));

        let bundle = self.bundle_root.join(id);
        std::fs::create_dir_all(&bundle).map_err(io_err("creating the bundle"))?;
        std::fs::create_dir_all(&self.state_root).map_err(io_err("creating the state root"))?;
        let result = self.create_in(id, &bundle, &spec, stdio);
        if result.is_err() {
            // A build cut off (or created but not loadable) may have left an init waiting for
            // Start: libcontainer's forced delete kills it and removes its cgroup.
            if let Ok(mut partial) = Container::load(self.state_root.join(id)) {
                let _ = partial.delete(true);
            }
            let _ = std::fs::remove_dir_all(&bundle);
            let _ = std::fs::remove_dir_all(self.state_root.join(id));
            let _ = std::fs::remove_dir(cgroup_dir(id));
        }
        result
    }

    fn create_in(
        &self,
        id: &str,
        bundle: &Path,
        spec: &Spec,
        stdio: StdioRequest,
    ) -> Result<u32, ContainerError> {
        spec.save(bundle.join("config.json"))
            .map_err(|e| ContainerError::Spec(e.to_string()))?;
        let (streams, child) =
            Streams::new(stdio.terminal, stdio.stdin, stdio.stdout, stdio.stderr)?;
        let exit = Arc::new(ExitCell::default());
        let ((container, pid), master) = with_console(
            bundle,
            |console| {
                let request = BuildRequest {
                    id: id.to_owned(),
                    state_root: self.state_root.clone(),
                    console_socket: console.map(Path::to_owned),
                    stdio: child.is_some(),
                    kind: BuildKind::Init {
                        bundle: bundle.to_owned(),
                    },
                };
                let mut table = reaper::processes();
                log::debug!("container {id}: building from {}", bundle.display());
                let pid = build_process::build(&request, child).map_err(|source| {
                    ContainerError::Build {
                        what: "creating the container",
                        source,
                    }
                })?;
                table.insert(pid, exit.clone());
                // Under the reaper's lock: the pid cannot be reaped and reused meanwhile.
                let restored = restore_memlock(pid, spec);
                drop(table);
                restored?;
                let container = Container::load(self.state_root.join(id)).map_err(|source| {
                    ContainerError::Runtime {
                        what: "loading the created container's state",
                        source,
                    }
                })?;
                log::info!("container {id}: created, init pid {pid}");
                Ok((container, pid))
            },
            stdio.terminal,
        )?;
        if let Some(master) = master {
            streams
                .set_pty(master)
                .map_err(io_err("sharing the pty master"))?;
        }
        let init = Arc::new(Proc {
            streams,
            exit,
            pid: Mutex::new(Some(pid)),
            terminal: stdio.terminal,
            pending: Mutex::new(None),
        });
        let entry = Arc::new(Entry {
            runtime: Mutex::new(container),
            init,
            pid_namespace: PidNamespace::of(spec),
            execs: Mutex::new(HashMap::new()),
            bundle: bundle.to_owned(),
            seccomp: spec.linux().as_ref().and_then(|l| l.seccomp().clone()),
            device_rules: spec
                .linux()
                .as_ref()
                .and_then(|l| l.resources().as_ref())
                .and_then(|r| r.devices().clone()),
        });
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), entry);
        u32::try_from(pid).map_err(|_| ContainerError::Spec("negative pid".into()))
    }

    pub fn start(&self, id: &str) -> Result<u32, ContainerError> {
        let entry = self.entry(id)?;
        entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .start()
            .map_err(|source| ContainerError::Runtime {
                what: "starting the container",
                source,
            })?;
        let pid = entry.init.pid().unwrap_or(0);
        Ok(u32::try_from(pid).unwrap_or(0))
    }

    pub fn add_exec(
        &self,
        id: &str,
        exec_id: &str,
        process_json: &[u8],
        stdio: StdioRequest,
    ) -> Result<(), ContainerError> {
        check_id(exec_id)?;
        let entry = self.entry(id)?;
        let mut process: Process =
            serde_json::from_slice(process_json).map_err(|source| ContainerError::Json {
                what: "OCI process",
                source,
            })?;
        process.set_terminal(Some(stdio.terminal));
        let mut execs = entry.execs.lock().unwrap_or_else(|e| e.into_inner());
        if execs.contains_key(exec_id) {
            return Err(ContainerError::ExecExists(exec_id.to_owned()));
        }
        let (streams, child) =
            Streams::new(stdio.terminal, stdio.stdin, stdio.stdout, stdio.stderr)?;
        execs.insert(
            exec_id.to_owned(),
            Arc::new(Proc {
                streams,
                exit: Arc::new(ExitCell::default()),
                pid: Mutex::new(None),
                terminal: stdio.terminal,
                pending: Mutex::new(Some((process, child))),
            }),
        );
        Ok(())
    }

    pub fn start_exec(&self, id: &str, exec_id: &str) -> Result<u32, ContainerError> {
        check_id(exec_id)?;
        let (entry, proc) = self.process(id, exec_id)?;
        let (process, child) = proc
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| ContainerError::AlreadyStarted(exec_id.to_owned()))?;
        let forget = || {
            // A failed exec is forgotten, so that the shim can report it and retry cleanly.
            entry
                .execs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(exec_id);
        };
        let (process, seccomp) = ExecSeccomp::plan(entry.seccomp.as_ref(), process)
            .map_err(|e| ContainerError::Spec(e.to_string()))
            .inspect_err(|_| forget())?;
        let process_path = entry.bundle.join(format!("exec-{exec_id}.json"));
        let text = serde_json::to_vec(&process).map_err(|source| ContainerError::Json {
            what: "OCI process",
            source,
        })?;
        std::fs::write(&process_path, text).map_err(io_err("writing the exec process"))?;
        let result = with_console(
            &entry.bundle,
            |console| {
                let request = BuildRequest {
                    id: id.to_owned(),
                    state_root: self.state_root.clone(),
                    console_socket: console.map(Path::to_owned),
                    stdio: child.is_some(),
                    kind: BuildKind::Exec {
                        process: process_path.clone(),
                        seccomp: seccomp.map(Box::new),
                    },
                };
                let mut table = reaper::processes();
                let pid = build_process::build(&request, child).map_err(|source| {
                    ContainerError::Build {
                        what: "starting the exec process",
                        source,
                    }
                })?;
                table.insert(pid, proc.exit.clone());
                *proc.pid.lock().unwrap_or_else(|e| e.into_inner()) = Some(pid);
                Ok(pid)
            },
            proc.terminal,
        );
        let _ = std::fs::remove_file(&process_path);
        let (pid, master) = result.inspect_err(|_| forget())?;
        if let Some(master) = master {
            proc.streams
                .set_pty(master)
                .map_err(io_err("sharing the pty master"))?;
        }
        Ok(u32::try_from(pid).unwrap_or(0))
    }

    /// Forgets exec `exec_id` of container `id` once it has exited or if it never started.
    pub fn remove_exec(&self, id: &str, exec_id: &str) -> Result<(), ContainerError> {
        check_id(exec_id)?;
        let (entry, proc) = self.process(id, exec_id)?;
        let started = proc.pid().is_some();
        if started && proc.exit.get().is_none() {
            return Err(ContainerError::StillRunning(exec_id.to_owned()));
        }
        // A never-started exec still holds its stdio: close stdin so that nothing waits on it.
        proc.streams.close_stdin();
        entry
            .execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(exec_id);
        Ok(())
    }

    pub fn signal(
        &self,
        id: &str,
        exec_id: &str,
        signal: u32,
        all: bool,
    ) -> Result<(), ContainerError> {
        let (entry, proc) = self.process(id, exec_id)?;
        let signo = libc::c_int::try_from(signal)
            .ok()
            .filter(|s| (1..=64).contains(s))
            .ok_or_else(|| ContainerError::Spec(format!("no signal {signal}")))?;
        if all && exec_id.is_empty() {
            let sig = nix::sys::signal::Signal::try_from(signo)
                .map_err(|_| ContainerError::Spec(format!("no signal {signal}")))?;
            return entry
                .runtime
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .kill(sig, true)
                .map_err(|source| ContainerError::Runtime {
                    what: "signalling the container",
                    source,
                });
        }
        // Holding the reaper's lock: an unreaped pid cannot be reused under us.
        let _table = reaper::processes();
        if proc.exit.get().is_some() {
            return Ok(());
        }
        let pid = proc
            .pid()
            .ok_or_else(|| ContainerError::NotStarted(exec_id.to_owned()))?;
        // SAFETY: kill(2) on a live (unreaped) child of ours.
        if unsafe { libc::kill(pid, signo) } != 0 {
            return Err(ContainerError::Signal {
                signal,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// The process's exit cell, once it was started.
    pub fn exit_cell(&self, id: &str, exec_id: &str) -> Result<Arc<ExitCell>, ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        if proc.pid().is_none() {
            return Err(ContainerError::NotStarted(exec_id.to_owned()));
        }
        Ok(proc.exit.clone())
    }

    pub fn resize(
        &self,
        id: &str,
        exec_id: &str,
        width: u32,
        height: u32,
    ) -> Result<(), ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        let clamp = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
        match proc.streams.resize(clamp(width), clamp(height)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(ContainerError::NoTerminal),
            Err(e) => Err(io_err("resizing the pty")(e)),
        }
    }

    pub fn close_stdin(&self, id: &str, exec_id: &str) -> Result<(), ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        proc.streams.close_stdin();
        Ok(())
    }

    pub fn pids(&self, id: &str) -> Result<Vec<u32>, ContainerError> {
        self.entry(id)?;
        let procs = std::fs::read_to_string(cgroup_dir(id).join("cgroup.procs"))
            .map_err(io_err("reading cgroup.procs"))?;
        Ok(procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    pub fn stats(&self, id: &str) -> Result<Stats, ContainerError> {
        self.entry(id)?;
        Ok(read_stats(&cgroup_dir(id)))
    }

    /// Applies `resources_json` (OCI `LinuxResources`) to container `id`'s cgroup. The device
    /// rules stay the container's own: an update cannot change them through CRI, and the ones
    /// containerd sends name the host's numbers (its spec's), where the container's have the
    /// guest's; applying those would take the container's disks away.
    pub fn update(&self, id: &str, resources_json: &[u8]) -> Result<(), ContainerError> {
        let entry = self.entry(id)?;
        let mut resources: LinuxResources =
            serde_json::from_slice(resources_json).map_err(|source| ContainerError::Json {
                what: "OCI resources",
                source,
            })?;
        resources.set_devices(entry.device_rules.clone());
        use libcgroups::common::CgroupManager;
        let manager = libcgroups::common::create_cgroup_manager(libcgroups::common::CgroupConfig {
            cgroup_path: PathBuf::from(format!("{CGROUP_PARENT}/{id}")),
            systemd_cgroup: false,
            container_name: id.to_owned(),
        })
        .map_err(|e| ContainerError::Cgroup(e.to_string()))?;
        manager
            .apply(&libcgroups::common::ControllerOpt {
                resources: &resources,
                disable_oom_killer: false,
                oom_score_adj: None,
                freezer_state: None,
            })
            .map_err(|e| ContainerError::Cgroup(e.to_string()))
    }

    pub fn pause(&self, id: &str) -> Result<(), ContainerError> {
        self.entry(id)?
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pause()
            .map_err(|source| ContainerError::Runtime {
                what: "pausing",
                source,
            })
    }

    pub fn resume(&self, id: &str) -> Result<(), ContainerError> {
        self.entry(id)?
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .resume()
            .map_err(|source| ContainerError::Runtime {
                what: "resuming",
                source,
            })
    }

    /// Container `id`'s init has exited (its exit was reaped). If it shared its PID namespace,
    /// what it left running in the container is killed, so that the container's output streams
    /// end and nothing outlives it.
    pub fn init_exited(&self, id: &str) {
        let Ok(entry) = self.entry(id) else {
            return;
        };
        if entry.pid_namespace == PidNamespace::Own {
            return;
        }
        let killed = entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kill(nix::sys::signal::Signal::SIGKILL, true);
        match killed {
            Ok(()) => log::info!(
                "container {id}: its init shared a PID namespace and exited; the processes it left \
                 were killed"
            ),
            Err(e) => log::warn!("container {id}: killing what its init left running: {e}"),
        }
    }

    pub fn remove(&self, id: &str) -> Result<(), ContainerError> {
        let entry = self.entry(id)?;
        entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .delete(true)
            .map_err(|source| ContainerError::Runtime {
                what: "removing the container",
                source,
            })?;
        let _ = std::fs::remove_dir_all(&entry.bundle);
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        self.volumes.release(id);
        Ok(())
    }

    /// The ids of the containers, for the OOM watcher.
    pub fn ids(&self) -> Vec<String> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

impl StreamLookup for Containers {
    fn streams(&self, container_id: &str, exec_id: &str) -> Option<Arc<Streams>> {
        self.process(container_id, exec_id)
            .ok()
            .map(|(_, p)| p.streams.clone())
    }
}

fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reads a cgroup v2 directory; absent controllers give 0.
pub fn read_stats(dir: &Path) -> Stats {
    let cpu = std::fs::read_to_string(dir.join("cpu.stat")).unwrap_or_default();
    let events = std::fs::read_to_string(dir.join("memory.events")).unwrap_or_default();
    Stats {
        cpu_usage_usec: keyed(&cpu, "usage_usec").unwrap_or(0),
        cpu_user_usec: keyed(&cpu, "user_usec").unwrap_or(0),
        cpu_system_usec: keyed(&cpu, "system_usec").unwrap_or(0),
        memory_usage_bytes: read_u64(&dir.join("memory.current")).unwrap_or(0),
        memory_limit_bytes: read_u64(&dir.join("memory.max")).unwrap_or(0),
        pids_current: read_u64(&dir.join("pids.current")).unwrap_or(0),
        oom_kills: keyed(&events, "oom_kill").unwrap_or(0),
    }
}

/// The whole guest's figures, for the pod's sandbox (its VM): CPU from the root cgroup's
/// cpu.stat, memory in use (MemTotal - MemAvailable) and MemTotal as the limit, the number of
/// processes, and the OOM kills since boot (/proc/vmstat).
pub fn guest_stats() -> Stats {
    let cpu = std::fs::read_to_string(Path::new(CGROUP_ROOT).join("cpu.stat")).unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    let processes = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0);
    guest_stats_from(&cpu, &meminfo, &vmstat, processes as u64)
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.trim().trim_end_matches("kB").trim().parse().ok()
    })
}

fn guest_stats_from(cpu: &str, meminfo: &str, vmstat: &str, processes: u64) -> Stats {
    let total = meminfo_kib(meminfo, "MemTotal").unwrap_or(0);
    let available = meminfo_kib(meminfo, "MemAvailable").unwrap_or(total);
    Stats {
        cpu_usage_usec: keyed(cpu, "usage_usec").unwrap_or(0),
        cpu_user_usec: keyed(cpu, "user_usec").unwrap_or(0),
        cpu_system_usec: keyed(cpu, "system_usec").unwrap_or(0),
        memory_usage_bytes: total.saturating_sub(available).saturating_mul(1024),
        memory_limit_bytes: total.saturating_mul(1024),
        pids_current: processes,
        oom_kills: keyed(vmstat, "oom_kill").unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_working_directory_is_made_inside_the_rootfs_only() {
        let dir = std::env::temp_dir().join(format!("agent-cwd-{}", std::process::id()));
        let root = dir.join("rootfs");
        std::fs::create_dir_all(root.join("etc")).expect("rootfs");
        // A symlink that would lead out of the rootfs stays inside it.
        std::os::unix::fs::symlink("/", root.join("escape")).expect("symlink");
        let spec = |cwd: &str, mounts: &str| -> Spec {
            serde_json::from_str(&format!(
                r#"{{"ociVersion":"1.0.2","root":{{"path":"{}"}},
                    "process":{{"cwd":"{cwd}","args":["sh"],"user":{{"uid":0,"gid":0}}}},
                    "mounts":[{mounts}]}}"#,
                root.display()
            ))
            .expect("spec")
        };
        ensure_cwd(&spec("/work/dir", "")).expect("made");
        assert!(root.join("work/dir").is_dir());
        ensure_cwd(&spec("/escape/agent-cwd-outside", "")).expect("made inside");
        assert!(root.join("agent-cwd-outside").is_dir());
        assert!(!Path::new("/agent-cwd-outside").exists());
        ensure_cwd(&spec(
            "/data/x",
            r#"{"destination":"/data","type":"bind","source":"/s"}"#,
        ))
        .expect("left to the volume");
        assert!(!root.join("data").exists());
        ensure_cwd(&spec("/", "")).expect("root");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_init_owns_its_pid_namespace_only_with_a_pid_entry_without_path() {
        let spec = |namespaces: serde_json::Value| -> Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2",
                "root": {"path": "/r"},
                "linux": {"namespaces": namespaces},
            }))
            .unwrap()
        };
        let own = spec(serde_json::json!([{"type": "mount"}, {"type": "pid"}]));
        assert_eq!(PidNamespace::of(&own), PidNamespace::Own);
        let pod = spec(serde_json::json!([{"type": "pid", "path": "/proc/7/ns/pid"}]));
        assert_eq!(PidNamespace::of(&pod), PidNamespace::Shared);
        let agents = spec(serde_json::json!([{"type": "mount"}]));
        assert_eq!(PidNamespace::of(&agents), PidNamespace::Shared);
    }

    #[test]
    fn rootfs_propagation_accepts_what_runc_accepts() {
        for (given, want) in [
            ("rshared", "shared"),
            ("shared", "shared"),
            ("rslave", "slave"),
            ("slave", "slave"),
            ("rprivate", "private"),
            ("private", "private"),
            ("runbindable", "unbindable"),
            ("unbindable", "unbindable"),
        ] {
            assert_eq!(rootfs_propagation(given).unwrap(), want, "{given}");
        }
        let err = rootfs_propagation("sideways").unwrap_err().to_string();
        assert!(err.contains("\"sideways\""), "{err}");
    }

    #[test]
    fn guest_stats_from_proc_files() {
        let stats = guest_stats_from(
            "usage_usec 900\nuser_usec 600\nsystem_usec 300\nnr_periods 0\n",
            "MemTotal:         262144 kB\nMemFree:          200000 kB\nMemAvailable:     225280 kB\n",
            "nr_free_pages 5\noom_kill 2\n",
            7,
        );
        assert_eq!(
            stats,
            Stats {
                cpu_usage_usec: 900,
                cpu_user_usec: 600,
                cpu_system_usec: 300,
                memory_usage_bytes: (262144 - 225280) * 1024,
                memory_limit_bytes: 262144 * 1024,
                pids_current: 7,
                oom_kills: 2,
            }
        );
        // Garbage gives zeros, never a panic.
        assert_eq!(
            guest_stats_from("x", "MemTotal: lots", "", 0),
            Stats::default()
        );
    }

    #[test]
    fn stats_from_cgroup_files() {
        let dir = std::env::temp_dir().join(format!("agent-stats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
        )
        .expect("write");
        std::fs::write(dir.join("memory.current"), "4096\n").expect("write");
        std::fs::write(dir.join("memory.max"), "max\n").expect("write");
        std::fs::write(dir.join("memory.events"), "low 0\noom 2\noom_kill 1\n").expect("write");
        assert_eq!(
            read_stats(&dir),
            Stats {
                cpu_usage_usec: 1500,
                cpu_user_usec: 1000,
                cpu_system_usec: 500,
                memory_usage_bytes: 4096,
                memory_limit_bytes: 0,
                pids_current: 0,
                oom_kills: 1,
            }
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
