//! A private containerd for the tests: its own root, state, socket, config, CNI network and pod
//! cgroup parent under a temporary directory; never the system service.
//!
//! Configured with the CRI plugin (sandbox image = the locally built pause image, overlayfs,
//! `restrict_oom_score_adj`, cgroupfs), a CNI bridge private to the instance, and two runtime
//! handlers: `runc` (io.containerd.runc.v2) and `microvm` (io.containerd.microvm.v1, whose
//! `containerd-shim-microvm-v1` containerd finds on its PATH: see [`ContainerdOptions::extra_path`]).
//!
//! Dropping it stops containerd (SIGTERM, then SIGKILL), kills what the instance's pods left
//! running, unmounts everything under its directory, and removes its cgroups, bridge and files.

use crate::cri::{self, v1::PodSandboxConfig, CriClient};
use crate::images::{self, LocalImage};
use crate::lifecycle::MICROVM_STATE_ROOT;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The containerd namespace CRI uses.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Where Debian's containernetworking-plugins installs the CNI plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, thiserror::Error)]
pub enum ContainerdError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("containerd not found on PATH: install Debian's containerd (scripts/install-deps.sh)")]
    NotInstalled,
    #[error("containerd exited during startup ({status}); its log:\n{log}")]
    Exited { status: String, log: String },
    #[error("containerd's socket {socket} did not answer within {timeout:?}; its log:\n{log}")]
    Timeout {
        socket: PathBuf,
        timeout: Duration,
        log: String,
    },
    #[error("no free test network (all 10.88.100-249 bridges in use)")]
    NoFreeNetwork,
    #[error(transparent)]
    Image(#[from] images::ImageError),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ContainerdError {
    let what = what.into();
    move |source| ContainerdError::Io { what, source }
}

/// How to start a [`PrivateContainerd`].
#[derive(Debug, Clone)]
pub struct ContainerdOptions {
    /// Directories put before the inherited PATH of containerd (and so of the shims it starts):
    /// where `containerd-shim-microvm-v1` is found.
    pub extra_path: Vec<PathBuf>,
    /// `ConfigPath` in the `microvm` handler's runtime options (none: the shim's default).
    pub microvm_config: Option<PathBuf>,
    /// containerd's log level.
    pub log_level: String,
    /// Bound on the wait for containerd's socket.
    pub start_timeout: Duration,
    /// Import the busybox and pause images (the pause image is the sandbox image).
    pub import_images: bool,
    /// Where the image tarballs are built and cached.
    pub image_dir: PathBuf,
    /// What the pods' CNI network adds to the plain IPv4 bridge.
    pub cni: CniOptions,
    /// The folder of the containerd to run (its `containerd`, `ctr` and runc shim); none: the
    /// one on PATH (Debian 12's 1.6). [`ContainerdOptions::default`] takes
    /// `MICROVM_TEST_CONTAINERD_BIN` (e.g. scripts/install-containerd.sh's answer).
    pub bin_dir: Option<PathBuf>,
    /// Whether the harness writes the `microvm` handler into the config (else a test adds it,
    /// e.g. with `microvm install`, through [`PrivateContainerd::start_after`]).
    pub microvm_handler: bool,
    /// The `microvm` handler's `sandboxer` (containerd 2.x only): `Some("shim")` creates its
    /// pods through the shim's Sandbox API instead of a pause container; none: containerd's
    /// default (`podsandbox`).
    pub microvm_sandboxer: Option<String>,
    /// containerd's `io.containerd.timeout.shim.cleanup`: how long it lets `<shim> delete` run
    /// after a shim died before it kills it (none: containerd's default, 5 s).
    pub shim_cleanup_timeout: Option<Duration>,
}

/// The environment variable naming the folder of the containerd the tests run.
pub const CONTAINERD_BIN_ENV: &str = "MICROVM_TEST_CONTAINERD_BIN";

/// The containerd release line a binary belongs to, which decides its config format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerdLine {
    /// 1.6 and 1.7: config version 2, CRI under `io.containerd.grpc.v1.cri`.
    V1,
    /// 2.x: config version 3, CRI split into `io.containerd.cri.v1.{images,runtime}`.
    V2,
}

/// What `containerd --version` prints: `containerd github.com/containerd/containerd 1.7.24~ds1 …`
/// or `containerd github.com/containerd/containerd/v2 2.1.9+unknown …`; the version field's
/// major number decides.
pub fn containerd_line(version_output: &str) -> Option<(ContainerdLine, String)> {
    let version = version_output.split_whitespace().nth(2)?;
    let major: u32 = version
        .trim_start_matches('v')
        .split('.')
        .next()?
        .parse()
        .ok()?;
    let line = match major {
        1 => ContainerdLine::V1,
        2 => ContainerdLine::V2,
        _ => return None,
    };
    Some((line, version.to_string()))
}

/// The pods' CNI network beyond the default (an IPv4 bridge with host-local IPAM): what the
/// network tests need, as a cluster's CNI config would have it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniOptions {
    /// The MTU the bridge plugin gives the bridge and the pods' interfaces (none: the default).
    pub mtu: Option<u32>,
    /// A second, IPv6 range (`fd00:88:<index>::/64`): dual-stack pods.
    pub ipv6: bool,
    /// The portmap plugin in the chain (hostPort).
    pub portmap: bool,
    /// The bandwidth plugin in the chain (the `kubernetes.io/{ingress,egress}-bandwidth`
    /// annotations).
    pub bandwidth: bool,
}

impl Default for ContainerdOptions {
    fn default() -> Self {
        ContainerdOptions {
            extra_path: Vec::new(),
            microvm_config: None,
            log_level: "info".into(),
            start_timeout: Duration::from_secs(30),
            import_images: true,
            image_dir: images::default_image_dir(),
            cni: CniOptions::default(),
            bin_dir: std::env::var_os(CONTAINERD_BIN_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            microvm_handler: true,
            microvm_sandboxer: None,
            shim_cleanup_timeout: None,
        }
    }
}

/// A process that is still running, found by the leak checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftoverProcess {
    pub pid: i32,
    pub cmdline: String,
}

/// A running private containerd. See the module documentation.
pub struct PrivateContainerd {
    child: Option<Child>,
    /// How it was started, for a restart.
    launch: Launch,
    dir: Option<tempfile::TempDir>,
    socket: PathBuf,
    net_index: u8,
    _net_lock: File,
    net_lock_path: PathBuf,
    cgroup_parent: String,
    /// Where containerd finds `containerd-shim-microvm-v1` (before its inherited PATH).
    shim_dirs: Vec<PathBuf>,
    /// The folder of the containerd run (none: PATH's).
    bin_dir: Option<PathBuf>,
    line: ContainerdLine,
    version: String,
    busybox: Option<LocalImage>,
    started_in: Duration,
}

impl PrivateContainerd {
    /// Writes the configuration, starts containerd, waits (bounded) for its socket, and imports
    /// the local images.
    pub fn start(opts: ContainerdOptions) -> Result<Self, ContainerdError> {
        Self::start_after(opts, |_, _| Ok(()))
    }

    /// Like [`PrivateContainerd::start`], with `edit` given the written config file (and the
    /// containerd binary) before containerd starts: a test that installs a handler itself.
    pub fn start_after(
        opts: ContainerdOptions,
        edit: impl FnOnce(&Path, &Path) -> Result<(), String>,
    ) -> Result<Self, ContainerdError> {
        let began = Instant::now();
        let containerd = match &opts.bin_dir {
            Some(dir) => Some(dir.join("containerd")).filter(|p| p.is_file()),
            None => which::which("containerd").ok(),
        }
        .ok_or(ContainerdError::NotInstalled)?;
        let version = Command::new(&containerd)
            .arg("--version")
            .output()
            .map_err(io_err(format!("run {} --version", containerd.display())))?;
        let version = String::from_utf8_lossy(&version.stdout).into_owned();
        let (line, version) = containerd_line(&version).ok_or_else(|| {
            io_err("read containerd's version")(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: {version:?}", containerd.display()),
            ))
        })?;
        let pause = if opts.import_images {
            Some(images::pause_image(&opts.image_dir)?)
        } else {
            None
        };
        let busybox = if opts.import_images {
            Some(images::busybox_image(&opts.image_dir)?)
        } else {
            None
        };

        let dir = tempfile::Builder::new()
            .prefix("microvm-ctrd-")
            .tempdir_in("/tmp")
            .map_err(io_err("create the containerd temp dir"))?;
        let (net_index, net_lock, net_lock_path) = reserve_network()?;
        let root = dir.path();
        let socket = root.join("containerd.sock");
        let cgroup_parent = format!(
            "/microvm-test-{}",
            root.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        );
        for sub in ["root", "state", "opt", "cni/net.d", "cni/ipam", "pod-logs"] {
            std::fs::create_dir_all(root.join(sub)).map_err(io_err(format!("create {sub}")))?;
        }
        std::fs::write(
            root.join("cni/net.d/10-microvm-test.conflist"),
            cni_config(root, net_index, &opts.cni),
        )
        .map_err(io_err("write the CNI config"))?;
        let config_path = root.join("config.toml");
        std::fs::write(
            &config_path,
            containerd_config(line, root, &socket, &opts, pause.as_ref().map(|p| p.name)),
        )
        .map_err(io_err("write config.toml"))?;
        edit(&config_path, &containerd)
            .map_err(|e| io_err("edit config.toml")(io::Error::other(e)))?;

        // Its own runc shim first (a containerd finds its shims on PATH).
        let mut path = opts.extra_path.clone();
        path.extend(opts.bin_dir.iter().cloned());
        path.extend(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
        ));
        let path = std::env::join_paths(path).map_err(|e| {
            io_err("PATH")(io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))
        })?;
        // A `sandboxer = "shim"` handler has no `options` table (containerd 2.1 cannot start its
        // pods' tasks with one, docs/testing-containerd.md): its shims find their config in
        // containerd's environment instead.
        let launch = Launch {
            containerd: containerd.clone(),
            config: config_path.clone(),
            path,
            microvm_config: match (&opts.microvm_config, &opts.microvm_sandboxer) {
                (Some(path), Some(_)) => Some(path.clone()),
                _ => None,
            },
            log: root.join("containerd.log"),
        };
        let child = launch.spawn(false)?;

        eprintln!(
            "private containerd {version} ({}) in {}",
            containerd.display(),
            root.display()
        );
        let mut me = PrivateContainerd {
            child: Some(child),
            launch,
            dir: Some(dir),
            socket,
            net_index,
            _net_lock: net_lock,
            net_lock_path,
            cgroup_parent,
            shim_dirs: opts.extra_path.clone(),
            bin_dir: opts.bin_dir.clone(),
            line,
            version,
            busybox,
            started_in: Duration::ZERO,
        };
        me.wait_for_socket(opts.start_timeout)?;
        for image in pause.iter().chain(me.busybox.iter()) {
            images::import(me.ctr_command(), image)?;
        }
        me.started_in = began.elapsed();
        Ok(me)
    }

    fn wait_for_socket(&mut self, timeout: Duration) -> Result<(), ContainerdError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait().map_err(io_err("wait containerd"))? {
                    self.child = None;
                    return Err(ContainerdError::Exited {
                        status: status.to_string(),
                        log: self.log_tail(),
                    });
                }
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ContainerdError::Timeout {
                    socket: self.socket.clone(),
                    timeout,
                    log: self.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The instance's directory (root, state, config, CNI config, logs).
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .map(|d| d.path())
            .unwrap_or(Path::new("/"))
    }

    /// containerd's gRPC socket (CRI and the containerd API).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The cgroup parent to give pods (`linux.cgroup_parent`), so that the instance finds and
    /// removes everything its pods left in the cgroup hierarchies.
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// A directory for pods' CRI log directories.
    pub fn pod_log_root(&self) -> PathBuf {
        self.dir().join("pod-logs")
    }

    /// Runs `ctr` against this instance in the CRI namespace, bounded by `timeout` (killed
    /// after it); returns its output.
    pub fn ctr(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> Result<std::process::Output, ContainerdError> {
        let mut child = self
            .ctr_command()
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_err("spawn ctr"))?;
        // Drain the pipes on threads so that a chatty ctr cannot block on a full pipe.
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let out_reader = std::thread::spawn(move || read_all(stdout.as_mut()));
        let err_reader = std::thread::spawn(move || read_all(stderr.as_mut()));
        if !wait_child(&mut child, timeout) {
            // SAFETY: kill(2) on our own, not yet reaped child.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        }
        let status = child.wait().map_err(io_err("wait ctr"))?;
        Ok(std::process::Output {
            status,
            stdout: out_reader.join().unwrap_or_default(),
            stderr: err_reader.join().unwrap_or_default(),
        })
    }

    /// `ctr run --rm` of `image` as container `id` with a runtime (`io.containerd.runc.v2`,
    /// `io.containerd.microvm.v1`), its cgroup under the instance's parent and its FIFOs in the
    /// instance's directory, so nothing lands outside the instance.
    pub fn ctr_run(
        &self,
        runtime: &str,
        image: &str,
        id: &str,
        command: &[&str],
        timeout: Duration,
    ) -> Result<std::process::Output, ContainerdError> {
        self.ctr_run_with_config(runtime, None, image, id, command, timeout)
    }

    /// [`Self::ctr_run`] with `--runtime-config-path` (the shim's `ConfigPath`) when given.
    pub fn ctr_run_with_config(
        &self,
        runtime: &str,
        runtime_config: Option<&Path>,
        image: &str,
        id: &str,
        command: &[&str],
        timeout: Duration,
    ) -> Result<std::process::Output, ContainerdError> {
        let config = runtime_config.map(|p| p.to_string_lossy().into_owned());
        let fifo_dir = self.dir().join("ctr-fifo");
        std::fs::create_dir_all(&fifo_dir).map_err(io_err("create the ctr fifo dir"))?;
        let cgroup = format!("{}/{id}", self.cgroup_parent);
        let fifo_dir = fifo_dir.to_string_lossy().into_owned();
        let mut args = vec![
            "run",
            "--rm",
            "--runtime",
            runtime,
            "--cgroup",
            &cgroup,
            "--fifo-dir",
            &fifo_dir,
        ];
        if let Some(config) = &config {
            args.extend(["--runtime-config-path", config.as_str()]);
        }
        args.extend([image, id]);
        args.extend_from_slice(command);
        self.ctr(&args, timeout)
    }

    /// A pod config for this instance: its cgroup parent, and a fresh log directory under
    /// [`Self::pod_log_root`].
    pub fn pod_config(
        &self,
        name: &str,
        annotations: HashMap<String, String>,
    ) -> Result<PodSandboxConfig, ContainerdError> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let logs = self
            .pod_log_root()
            .join(format!("{name}-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&logs).map_err(io_err(format!("create {}", logs.display())))?;
        Ok(cri::pod_config(
            name,
            &logs,
            &self.cgroup_parent,
            annotations,
        ))
    }

    /// Stops and removes every pod through CRI, bounded; run from its own thread and runtime
    /// so that it works from a drop inside async code too.
    fn remove_pods_through_cri(&self, timeout: Duration) -> Result<(), String> {
        let socket = self.socket.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async move {
                let work = async {
                    let client = CriClient::connect(&socket, Duration::from_secs(30)).await?;
                    client.remove_all_pods().await
                };
                match tokio::time::timeout(timeout, work).await {
                    Ok(result) => result.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("not done within {timeout:?}")),
                }
            })
        })
        .join()
        .map_err(|_| "the cleanup thread panicked".to_string())?
    }

    /// The containerd version this instance runs (e.g. `1.6.20~ds1`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Its release line (config format).
    pub fn line(&self) -> ContainerdLine {
        self.line
    }

    /// The imported busybox image's name.
    pub fn busybox_image(&self) -> &str {
        self.busybox
            .as_ref()
            .map(|i| i.name)
            .unwrap_or(images::BUSYBOX_IMAGE)
    }

    /// The CNI bridge of this instance (created by the bridge plugin with the first pod).
    pub fn bridge_name(&self) -> String {
        format!("mvt{}", self.net_index)
    }

    /// The pods' subnet.
    pub fn subnet(&self) -> String {
        format!("10.88.{}.0/24", self.net_index)
    }

    /// Time from `start` to a serving containerd with the images imported.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The last lines of containerd's log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir().join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Mount points under the instance's directory (rootfs, shm, snapshots still mounted).
    pub fn mounts(&self) -> Vec<PathBuf> {
        mounts_under(self.dir())
    }

    /// Processes of this instance other than containerd: shims started with its address, and
    /// anything in its pods' cgroups.
    pub fn leftover_processes(&self) -> Vec<LeftoverProcess> {
        let mut pids = shim_pids(&self.socket);
        pids.extend(cgroup_pids(&self.cgroup_parent));
        pids.sort_unstable();
        pids.dedup();
        let own = std::process::id() as i32;
        let containerd = self.child.as_ref().map(|c| c.id() as i32);
        pids.into_iter()
            .filter(|&pid| pid != own && Some(pid) != containerd && pid_alive(pid))
            .filter_map(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                Some(LeftoverProcess {
                    pid,
                    cmdline: cmdline.trim().to_string(),
                })
            })
            .collect()
    }

    /// Pids in the cgroups below the instance's cgroup parent (pods' processes, and whatever
    /// a runtime moved there).
    pub fn pod_cgroup_pids(&self) -> Vec<i32> {
        cgroup_pids(&self.cgroup_parent)
    }

    /// Cgroups still present below the instance's cgroup parent, in any hierarchy.
    pub fn leftover_cgroups(&self) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for hierarchy in cgroup_hierarchies() {
            let parent = hierarchy.join(self.cgroup_parent.trim_start_matches('/'));
            if let Ok(entries) = std::fs::read_dir(&parent) {
                found.extend(
                    entries
                        .flatten()
                        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                        .map(|e| e.path()),
                );
            }
        }
        found
    }

    /// The shim socket containerd 1.6 derives for a container or sandbox id:
    /// `/run/containerd/s/<sha256(<address>/<namespace>/<id>)>`.
    pub fn shim_socket(&self, id: &str) -> PathBuf {
        use sha2::{Digest, Sha256};
        let key = self.socket.join(CRI_NAMESPACE).join(id);
        let digest = Sha256::digest(key.as_os_str().as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        Path::new("/run/containerd/s").join(hex)
    }

    /// `ctr` of this instance's containerd release (a client of another release may not speak
    /// its API), talking to its socket in the CRI namespace.
    pub fn ctr_command(&self) -> Command {
        let ctr = match &self.bin_dir {
            Some(dir) => dir.join("ctr"),
            None => PathBuf::from("ctr"),
        };
        let mut cmd = Command::new(ctr);
        cmd.arg("-a").arg(&self.socket).args(["-n", CRI_NAMESPACE]);
        cmd
    }

    /// The containerd process's pid, while it runs.
    pub fn containerd_pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) containerd: while stopped it runs no
    /// cleanup of its own, so a test sees what the kernel alone does.
    pub fn freeze(&self, frozen: bool) {
        if let Some(child) = self.child.as_ref() {
            let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: kill(2) on our own child, which has not been reaped yet (we hold it).
            unsafe { libc::kill(child.id() as i32, sig) };
        }
    }

    /// Kills containerd (SIGKILL), as a crash would: its pods, shims and VMs stay, and dropping
    /// the instance must clean them up without containerd's help.
    pub fn kill_containerd(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child, which has not been reaped yet.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
        }
    }

    /// Restarts containerd as `systemctl restart containerd` does: SIGTERM (its shims, VMs and
    /// containers keep running), then the same binary and config again, waiting (bounded) for
    /// its socket. Its log goes on in the same file.
    pub fn restart_containerd(&mut self, down_for: Duration) -> Result<(), ContainerdError> {
        self.stop_containerd();
        std::thread::sleep(down_for);
        self.child = Some(self.launch.spawn(true)?);
        self.wait_for_socket(Duration::from_secs(60))
    }

    fn stop_containerd(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id() as i32;
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        if wait_child(&mut child, Duration::from_secs(10)) {
            return;
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let _ = child.wait();
    }
}

impl PrivateContainerd {
    /// What pods whose removal through CRI failed (a test that panicked mid-pod, a hung shim)
    /// left once their processes are killed: for each task bundle still in containerd's state,
    /// the microvm shim's crash cleanup (`<shim> delete`, as containerd runs it after a shim
    /// died: the pod network's undo, the state directory) and the pod's network namespace,
    /// which containerd's CRI made and would have removed.
    fn release_unremoved_pods(&self) {
        let tasks = self.dir().join("state/io.containerd.runtime.v2.task");
        let shim = self
            .shim_dirs
            .iter()
            .map(|d| d.join("containerd-shim-microvm-v1"))
            .find(|p| p.is_file());
        for namespace in read_dir_paths(&tasks) {
            for bundle in read_dir_paths(&namespace) {
                let Some(id) = bundle.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                    continue;
                };
                let spec: serde_json::Value = std::fs::read(bundle.join("config.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default();
                if let Some(shim) = &shim {
                    if Path::new(MICROVM_STATE_ROOT).join(&id).exists() {
                        eprintln!("private containerd: pod {id} was not removed; its shim's delete cleans up");
                        let ns = namespace.file_name().unwrap_or_default();
                        // The environment containerd gives a shim it runs.
                        let mut ttrpc = self.socket.clone().into_os_string();
                        ttrpc.push(".ttrpc");
                        let _ = Command::new(shim)
                            .current_dir(&bundle)
                            .env("GRPC_ADDRESS", &self.socket)
                            .env("TTRPC_ADDRESS", ttrpc)
                            .env("NAMESPACE", ns)
                            .arg("-namespace")
                            .arg(ns)
                            .arg("-address")
                            .arg(&self.socket)
                            .args(["-id", &id, "delete"])
                            .stdin(Stdio::null())
                            .stdout(Stdio::null())
                            .status();
                    }
                }
                let netns = spec["linux"]["namespaces"]
                    .as_array()
                    .and_then(|n| n.iter().find(|ns| ns["type"] == "network"))
                    .and_then(|ns| ns["path"].as_str())
                    .map(PathBuf::from);
                if let Some(netns) =
                    netns.filter(|p| p.starts_with("/var/run/netns") || p.starts_with("/run/netns"))
                {
                    if netns.exists() {
                        eprintln!(
                            "private containerd: removing the netns {} of pod {id}",
                            netns.display()
                        );
                        unmount_lazy(&netns);
                        let _ = std::fs::remove_file(&netns);
                    }
                }
            }
        }
    }
}

/// What starts a private containerd (again, for a restart).
struct Launch {
    containerd: PathBuf,
    config: PathBuf,
    /// Its PATH: the test's shim folders first.
    path: std::ffi::OsString,
    /// `MICROVM_CONFIG_PATH` in its environment (a `sandboxer = "shim"` handler's shims).
    microvm_config: Option<PathBuf>,
    log: PathBuf,
}

impl Launch {
    /// Starts containerd, its output to the log (appended to with `append`).
    fn spawn(&self, append: bool) -> Result<Child, ContainerdError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&self.log)
            .map_err(io_err("open containerd.log"))?;
        let log_err = log.try_clone().map_err(io_err("dup containerd.log"))?;
        let mut cmd = Command::new(&self.containerd);
        match &self.microvm_config {
            Some(path) => cmd.env("MICROVM_CONFIG_PATH", path),
            None => cmd.env_remove("MICROVM_CONFIG_PATH"),
        };
        cmd.arg("--config")
            .arg(&self.config)
            .env("PATH", &self.path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(io_err("spawn containerd"))
    }
}

/// The entries of directory `dir` (none if it cannot be read).
fn read_dir_paths(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

impl Drop for PrivateContainerd {
    fn drop(&mut self) {
        // Gracefully first: containerd removes what it made for its pods (netns, shims, mounts).
        if self.child.is_some() {
            if let Err(e) = self.remove_pods_through_cri(Duration::from_secs(60)) {
                eprintln!("private containerd: removing the pods through CRI failed: {e}");
            }
        }
        self.stop_containerd();
        // Shims exit by themselves shortly after their last container is deleted.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.leftover_processes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // What the pods left: shims (SIGKILL-ed runc shims leave their containers, which the
        // cgroup sweep catches) and container processes.
        for _ in 0..3 {
            let left = self.leftover_processes();
            if left.is_empty() {
                break;
            }
            for p in &left {
                // SAFETY: kill(2) on a pid this instance's containerd started (a shim with our
                // address or a process in our pods' cgroups).
                unsafe { libc::kill(p.pid, libc::SIGKILL) };
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while left.iter().any(|p| pid_alive(p.pid)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.release_unremoved_pods();
        let dir = self.dir().to_path_buf();
        for _ in 0..3 {
            let mounts = mounts_under(&dir);
            if mounts.is_empty() {
                break;
            }
            for m in mounts {
                unmount_lazy(&m);
            }
        }
        remove_cgroups(&self.cgroup_parent);
        let bridge = self.bridge_name();
        if Path::new("/sys/class/net").join(&bridge).exists() {
            let _ = Command::new("ip")
                .args(["link", "del", &bridge])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("MICROVM_KEEP_CONTAINERD_DIR").is_some() {
                let kept = dir.keep();
                eprintln!("kept the containerd dir {}", kept.display());
            } else {
                let _ = dir.close();
            }
        }
        let _ = std::fs::remove_file(&self.net_lock_path);
    }
}

fn containerd_config(
    line: ContainerdLine,
    root: &Path,
    socket: &Path,
    opts: &ContainerdOptions,
    sandbox_image: Option<&str>,
) -> String {
    // Where the CRI settings live: 1.x has them all in the grpc CRI plugin; 2.x moves images and
    // runtimes into their own plugins and keeps only the stream server there.
    let (version, images, runtime) = match line {
        ContainerdLine::V1 => (
            2,
            r#"plugins."io.containerd.grpc.v1.cri""#,
            r#"plugins."io.containerd.grpc.v1.cri""#,
        ),
        ContainerdLine::V2 => (
            3,
            r#"plugins."io.containerd.cri.v1.images""#,
            r#"plugins."io.containerd.cri.v1.runtime""#,
        ),
    };
    let cri = r#"plugins."io.containerd.grpc.v1.cri""#;
    // 2.x starts NRI by default on the node-wide /var/run/nri/nri.sock: a second private
    // containerd beside the first (or a socket left by one) then fails to start with "address
    // already in use". Each gets its own socket in its own folder.
    let nri_section = match line {
        ContainerdLine::V1 => String::new(),
        ContainerdLine::V2 => format!(
            "[plugins.\"io.containerd.nri.v1.nri\"]\n  socket_path = {}\n",
            toml_str(&root.join("nri.sock").to_string_lossy())
        ),
    };
    let sandbox_image = toml_str(sandbox_image.unwrap_or(images::PAUSE_IMAGE));
    // `sandboxer` is a 2.x key: 1.x has no Sandbox API (and would reject nothing, but ignore it).
    let sandboxer = match (&opts.microvm_sandboxer, line) {
        (Some(s), ContainerdLine::V2) => format!("  sandboxer = {}\n", toml_str(s)),
        _ => String::new(),
    };
    let microvm_handler = if opts.microvm_handler {
        format!(
            r#"[{runtime}.containerd.runtimes.microvm]
  runtime_type = "io.containerd.microvm.v1"
  pod_annotations = ["microvm.io/*"]
{sandboxer}"#
        )
    } else {
        String::new()
    };
    let microvm_options = match &opts.microvm_config {
        Some(path) if opts.microvm_handler && sandboxer.is_empty() => format!(
            "\n[{runtime}.containerd.runtimes.microvm.options]\n  ConfigPath = {}\n",
            toml_str(&path.to_string_lossy())
        ),
        _ => String::new(),
    };
    let (cri_section, images_section) = match line {
        ContainerdLine::V1 => (
            format!(
                r#"[{cri}]
  sandbox_image = {sandbox_image}
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#
            ),
            // 1.x: the snapshotter is a key of the runtime's `containerd` table, below.
            String::new(),
        ),
        ContainerdLine::V2 => (
            format!(
                r#"[{cri}]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{runtime}]
  restrict_oom_score_adj = true
  disable_apparmor = true
"#
            ),
            format!(
                r#"[{images}]
  snapshotter = "overlayfs"

[{images}.pinned_images]
  sandbox = {sandbox_image}
"#
            ),
        ),
    };
    format!(
        r#"# Written by microvm-tests (tests/src/containerd.rs): a private containerd for one test.
version = {version}
root = {root}
state = {state}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = {socket}

[ttrpc]
  address = {ttrpc}

[debug]
  level = {level}
{timeouts}
[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

{nri_section}
{cri_section}
{images_section}
[{runtime}.containerd]
{snapshotter}  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.containerd.runtimes.runc.options]
  SystemdCgroup = false

{microvm_handler}{microvm_options}
[{runtime}.cni]
  {cni_bin}
  conf_dir = {cni_conf}
  max_conf_num = 1
"#,
        root = toml_str(&root.join("root").to_string_lossy()),
        state = toml_str(&root.join("state").to_string_lossy()),
        socket = toml_str(&socket.to_string_lossy()),
        ttrpc = toml_str(&format!("{}.ttrpc", socket.to_string_lossy())),
        level = toml_str(&opts.log_level),
        timeouts = match opts.shim_cleanup_timeout {
            Some(t) => format!(
                "\n[timeouts]\n  \"io.containerd.timeout.shim.cleanup\" = \"{}ms\"\n",
                t.as_millis()
            ),
            None => String::new(),
        },
        opt = toml_str(&root.join("opt").to_string_lossy()),
        // 2.1 deprecates `bin_dir` (CRI then reports a deprecation warning, not ready).
        cni_bin = match line {
            ContainerdLine::V1 => format!("bin_dir = {}", toml_str(CNI_BIN_DIR)),
            ContainerdLine::V2 => format!("bin_dirs = [{}]", toml_str(CNI_BIN_DIR)),
        },
        cni_conf = toml_str(&root.join("cni/net.d").to_string_lossy()),
        snapshotter = match line {
            ContainerdLine::V1 => "  snapshotter = \"overlayfs\"\n",
            ContainerdLine::V2 => "",
        },
    )
}

fn cni_config(root: &Path, index: u8, opts: &CniOptions) -> String {
    let mut ranges = vec![serde_json::json!([{ "subnet": format!("10.88.{index}.0/24") }])];
    let mut routes = vec![serde_json::json!({ "dst": "0.0.0.0/0" })];
    if opts.ipv6 {
        ranges.push(serde_json::json!([{ "subnet": format!("fd00:88:{index}::/64") }]));
        routes.push(serde_json::json!({ "dst": "::/0" }));
    }
    let mut bridge = serde_json::json!({
        "type": "bridge",
        "bridge": format!("mvt{index}"),
        "isGateway": true,
        // No masquerading: nothing is added to the host's iptables.
        "ipMasq": false,
        "hairpinMode": true,
        "ipam": {
            "type": "host-local",
            "ranges": ranges,
            "routes": routes,
            "dataDir": root.join("cni/ipam").to_string_lossy(),
        },
    });
    if let Some(mtu) = opts.mtu {
        bridge["mtu"] = mtu.into();
    }
    let mut plugins = vec![bridge];
    if opts.portmap {
        // hostPort: DNAT rules in the host's iptables, removed with the pod.
        plugins.push(serde_json::json!({
            "type": "portmap",
            "capabilities": { "portMappings": true },
        }));
    }
    if opts.bandwidth {
        plugins.push(serde_json::json!({
            "type": "bandwidth",
            "capabilities": { "bandwidth": true },
        }));
    }
    serde_json::to_string_pretty(&serde_json::json!({
        "cniVersion": "0.4.0",
        "name": format!("microvm-test-{index}"),
        "plugins": plugins,
    }))
    .unwrap_or_default()
}

/// A TOML basic string (JSON string escaping is valid TOML for these values).
fn toml_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// Picks a bridge index whose name is unused on the host and whose lock file (held open for the
/// instance's lifetime, released by the kernel if the process dies) no other instance holds.
fn reserve_network() -> Result<(u8, File, PathBuf), ContainerdError> {
    let start = (std::process::id() % 150) as u8;
    for i in 0..150u8 {
        let index = 100 + (start + i) % 150;
        if Path::new(&format!("/sys/class/net/mvt{index}")).exists() {
            continue;
        }
        let path = PathBuf::from(format!("/tmp/microvm-test-net-{index}.lock"));
        let file = File::create(&path).map_err(io_err(format!("create {}", path.display())))?;
        // SAFETY: flock(2) on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok((index, file, path));
        }
    }
    Err(ContainerdError::NoFreeNetwork)
}

fn read_all(pipe: Option<&mut impl io::Read>) -> Vec<u8> {
    let mut data = Vec::new();
    if let Some(pipe) = pipe {
        let _ = pipe.read_to_end(&mut data);
    }
    data
}

fn wait_child(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return true,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    false
}

/// Mount points at or below `dir` in this mount namespace, deepest first, each once (the
/// shim's reading of /proc/self/mountinfo, sorted for unmounting).
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = shim::state::mounts_under(dir);
    // Longest first; equal paths next to each other, so that dedup sees them.
    found.sort_by(|a, b| {
        b.as_os_str()
            .len()
            .cmp(&a.as_os_str().len())
            .then_with(|| a.cmp(b))
    });
    found.dedup();
    found
}

fn unmount_lazy(path: &Path) {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: umount2(2) with a valid NUL-terminated path; failure is harmless here.
    unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
}

/// Whether `pid` is a live process (not gone, not a zombie waiting for its parent).
pub fn pid_alive(pid: i32) -> bool {
    u32::try_from(pid)
        .ok()
        .and_then(shim::state::ProcStat::read)
        .is_some_and(|stat| stat.is_live())
}

/// Pids whose argv holds `socket` as an argument (shims get `-address <socket>`).
fn shim_pids(socket: &Path) -> Vec<i32> {
    let needle = socket.as_os_str().as_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.split(|&b| b == 0).any(|arg| arg == needle))
                .unwrap_or(false)
        })
        .collect()
}

fn cgroup_hierarchies() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(CGROUP_ROOT) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .map(|e| e.path())
        .collect();
    // A pure cgroup v2 host has cgroup.procs at the root itself.
    if Path::new(CGROUP_ROOT).join("cgroup.procs").exists() {
        dirs = vec![PathBuf::from(CGROUP_ROOT)];
    }
    dirs
}

fn cgroup_pids(parent: &str) -> Vec<i32> {
    fn walk(dir: &Path, pids: &mut Vec<i32>) {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(&e.path(), pids);
                }
            }
        }
    }
    let mut pids = Vec::new();
    for hierarchy in cgroup_hierarchies() {
        walk(&hierarchy.join(parent.trim_start_matches('/')), &mut pids);
    }
    pids
}

fn remove_cgroups(parent: &str) {
    fn remove_tree(dir: &Path) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    remove_tree(&e.path());
                }
            }
        }
        // cgroup directories are removed with rmdir even though they list files.
        let _ = std::fs::remove_dir(dir);
    }
    for hierarchy in cgroup_hierarchies() {
        remove_tree(&hierarchy.join(parent.trim_start_matches('/')));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_names_both_handlers_and_private_paths_in_each_lines_format() {
        let opts = ContainerdOptions {
            microvm_config: Some("/etc/microvm/test.toml".into()),
            ..Default::default()
        };
        let root = Path::new("/tmp/microvm-ctrd-x");
        for (line, version, runtime, images) in [
            (
                ContainerdLine::V1,
                2,
                "io.containerd.grpc.v1.cri",
                "io.containerd.grpc.v1.cri",
            ),
            (
                ContainerdLine::V2,
                3,
                "io.containerd.cri.v1.runtime",
                "io.containerd.cri.v1.images",
            ),
        ] {
            let text = containerd_config(
                line,
                root,
                &root.join("containerd.sock"),
                &opts,
                Some("p:1"),
            );
            let config: toml::Table = text
                .parse()
                .unwrap_or_else(|e| panic!("{line:?}: {e}\n{text}"));
            assert_eq!(config["version"].as_integer(), Some(version), "{text}");
            assert_eq!(config["root"].as_str(), Some("/tmp/microvm-ctrd-x/root"));
            assert_eq!(
                config["grpc"]["address"].as_str(),
                Some("/tmp/microvm-ctrd-x/containerd.sock")
            );
            let plugins = &config["plugins"];
            let runtimes = &plugins[runtime]["containerd"]["runtimes"];
            assert_eq!(
                runtimes["runc"]["runtime_type"].as_str(),
                Some("io.containerd.runc.v2")
            );
            let microvm = &runtimes["microvm"];
            assert_eq!(
                microvm["runtime_type"].as_str(),
                Some("io.containerd.microvm.v1")
            );
            assert_eq!(
                microvm["options"]["ConfigPath"].as_str(),
                Some("/etc/microvm/test.toml")
            );
            assert_eq!(microvm["pod_annotations"][0].as_str(), Some("microvm.io/*"));
            assert_eq!(
                plugins[runtime]["cni"]["conf_dir"].as_str(),
                Some("/tmp/microvm-ctrd-x/cni/net.d")
            );
            assert_eq!(
                plugins[runtime]["restrict_oom_score_adj"].as_bool(),
                Some(true)
            );
            let sandbox = match line {
                ContainerdLine::V1 => &plugins[images]["sandbox_image"],
                ContainerdLine::V2 => &plugins[images]["pinned_images"]["sandbox"],
            };
            assert_eq!(sandbox.as_str(), Some("p:1"), "{text}");
            assert_eq!(
                plugins["io.containerd.grpc.v1.cri"]["stream_server_address"].as_str(),
                Some("127.0.0.1")
            );
            assert!(microvm.get("sandboxer").is_none(), "{text}");
        }
    }

    #[test]
    fn the_shim_sandboxer_is_written_for_2x_only() {
        let opts = ContainerdOptions {
            microvm_sandboxer: Some("shim".into()),
            microvm_config: Some("/etc/microvm/test.toml".into()),
            ..Default::default()
        };
        let root = Path::new("/tmp/microvm-ctrd-x");
        for (line, runtime, want) in [
            (ContainerdLine::V1, "io.containerd.grpc.v1.cri", None),
            (
                ContainerdLine::V2,
                "io.containerd.cri.v1.runtime",
                Some("shim"),
            ),
        ] {
            let text = containerd_config(line, root, &root.join("c.sock"), &opts, None);
            let config: toml::Table = text.parse().unwrap();
            let microvm = &config["plugins"][runtime]["containerd"]["runtimes"]["microvm"];
            assert_eq!(
                microvm.get("sandboxer").and_then(|s| s.as_str()),
                want,
                "{text}"
            );
            assert_eq!(
                microvm["runtime_type"].as_str(),
                Some("io.containerd.microvm.v1")
            );
            // 2.x with the shim sandboxer: no options table (ConfigPath goes by environment).
            assert_eq!(microvm.get("options").is_none(), want.is_some(), "{text}");
        }
    }

    #[test]
    fn the_version_output_names_the_line() {
        assert_eq!(
            containerd_line(
                "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1"
            ),
            Some((ContainerdLine::V1, "1.6.20~ds1".to_string()))
        );
        assert_eq!(
            containerd_line("containerd github.com/containerd/containerd/v2 2.1.9+unknown \n"),
            Some((ContainerdLine::V2, "2.1.9+unknown".to_string()))
        );
        assert_eq!(containerd_line("containerd"), None);
        assert_eq!(containerd_line("containerd x 3.0.0"), None);
    }

    #[test]
    fn the_pods_cni_network_is_a_plain_bridge_by_default() {
        let root = Path::new("/tmp/microvm-ctrd-x");
        let cni: serde_json::Value =
            serde_json::from_str(&cni_config(root, 123, &CniOptions::default())).unwrap();
        assert_eq!(cni["plugins"][0]["bridge"], "mvt123");
        assert_eq!(
            cni["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
            "10.88.123.0/24"
        );
        assert_eq!(cni["plugins"].as_array().map(Vec::len), Some(1));
        assert!(cni["plugins"][0].get("mtu").is_none());
    }

    #[test]
    fn the_network_tests_cni_chain_is_dual_stack_with_mtu_portmap_and_bandwidth() {
        let root = Path::new("/tmp/microvm-ctrd-x");
        let opts = CniOptions {
            mtu: Some(1400),
            ipv6: true,
            portmap: true,
            bandwidth: true,
        };
        let cni: serde_json::Value = serde_json::from_str(&cni_config(root, 7, &opts)).unwrap();
        let plugins = cni["plugins"].as_array().unwrap();
        let types: Vec<&str> = plugins
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["bridge", "portmap", "bandwidth"]);
        assert_eq!(plugins[0]["mtu"], 1400);
        assert_eq!(
            plugins[0]["ipam"]["ranges"][1][0]["subnet"],
            "fd00:88:7::/64"
        );
        assert_eq!(plugins[0]["ipam"]["routes"][1]["dst"], "::/0");
        assert_eq!(plugins[1]["capabilities"]["portMappings"], true);
        assert_eq!(plugins[2]["capabilities"]["bandwidth"], true);
    }
}
