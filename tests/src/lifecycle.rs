//! The timed CRI pod lifecycle shared by the CRI tests, the benchmark and the demo, for any
//! runtime handler: RunPodSandbox, CreateContainer + StartContainer of a busybox `sleep`, ExecSync
//! `uname -r`, StopPodSandbox, RemovePodSandbox; the host memory charged to idle pods; the
//! processes of one pod on the host (its shim and everything the shim started: for `microvm`
//! the VM's QEMU, virtiofsd and vhost-device-vsock, for `runc` pause and the containers) and what
//! a removed pod left behind; and the VM backend `microvm check-host` picks for this host.

use crate::containerd::{ContainerdError, PrivateContainerd};
use crate::cri::{container_config, CriClient, CriError};
use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error(transparent)]
    Containerd(#[from] ContainerdError),
    #[error("ExecSync `uname -r` exited {exit_code}: {stderr}")]
    Exec { exit_code: i32, stderr: String },
    #[error("ExecSync `uname -r` failed: {0}")]
    ExecCall(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the guest RAM in /proc/{pid}/smaps: {reason}")]
    GuestRam { pid: i32, reason: String },
    #[error("`{command}` exited {status} (expected 0: usable, or 2: a Linux guest cannot boot under the embedded VMM):\n{output}")]
    CheckHost {
        command: String,
        status: String,
        output: String,
    },
}

/// Wall time of each lifecycle step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifecycleTimings {
    pub run: Duration,
    pub create: Duration,
    pub start: Duration,
    pub exec: Duration,
    pub stop: Duration,
    pub remove: Duration,
}

impl LifecycleTimings {
    pub fn total(&self) -> Duration {
        self.run + self.create + self.start + self.exec + self.stop + self.remove
    }

    /// `(step name, duration)` for every step and the total.
    pub fn steps(&self) -> [(&'static str, Duration); 7] {
        [
            ("run", self.run),
            ("create", self.create),
            ("start", self.start),
            ("exec", self.exec),
            ("stop", self.stop),
            ("remove", self.remove),
            ("total", self.total()),
        ]
    }

    /// The per-step medians of several runs (each step's median on its own).
    pub fn median(runs: &[LifecycleTimings]) -> LifecycleTimings {
        let pick =
            |f: fn(&LifecycleTimings) -> Duration| median(&runs.iter().map(f).collect::<Vec<_>>());
        LifecycleTimings {
            run: pick(|t| t.run),
            create: pick(|t| t.create),
            start: pick(|t| t.start),
            exec: pick(|t| t.exec),
            stop: pick(|t| t.stop),
            remove: pick(|t| t.remove),
        }
    }
}

/// What one lifecycle saw.
#[derive(Debug, Clone)]
pub struct LifecycleOutcome {
    pub timings: LifecycleTimings,
    pub pod_id: String,
    /// `uname -r` inside the container.
    pub kernel_release: String,
    /// The pod's network namespace path while it ran.
    pub netns: Option<PathBuf>,
    /// With [`LifecycleOptions::tolerate_exec_failure`]: why ExecSync failed (the lifecycle
    /// went on with stop and remove; `timings.exec` is then the time until the failure).
    pub exec_error: Option<String>,
    /// With [`LifecycleOptions::idle_memory_after`]: the pod's host memory while its container
    /// slept, measured after start and before exec (not part of the timings).
    pub idle_memory: Option<PodMemory>,
    /// The accelerator the pod's VM ran with, from the VM process' command line (`TCG`, `KVM`;
    /// `None` for a pod that is no VM, e.g. runc).
    pub accel: Option<String>,
}

/// Extras of [`timed_pod_lifecycle_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LifecycleOptions {
    /// Measure the pod's host memory this long after StartContainer (before ExecSync).
    pub idle_memory_after: Option<Duration>,
    /// A failed ExecSync is recorded in [`LifecycleOutcome::exec_error`] instead of ending the
    /// lifecycle early.
    pub tolerate_exec_failure: bool,
    /// For pods on the embedded VMM: the VM's guest memory in bytes. The idle memory then also
    /// splits the memory of the process holding the VM (the VMM's process, or the shim) into
    /// the guest RAM the guest touched and the rest ([`PodMemory::vm_split`]); a guest RAM
    /// mapping not found is an error.
    pub split_guest_ram_of: Option<u64>,
}

/// Runs one timed pod lifecycle with `handler`. On an error the pod is left for the harness's
/// cleanup (dropping the [`PrivateContainerd`] removes it).
pub async fn timed_pod_lifecycle(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    handler: &str,
    name: &str,
    annotations: HashMap<String, String>,
) -> Result<LifecycleOutcome, LifecycleError> {
    timed_pod_lifecycle_with(
        ctrd,
        cri,
        handler,
        name,
        annotations,
        LifecycleOptions::default(),
    )
    .await
}

/// [`timed_pod_lifecycle`] with the extras of `opts`.
pub async fn timed_pod_lifecycle_with(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    handler: &str,
    name: &str,
    annotations: HashMap<String, String>,
    opts: LifecycleOptions,
) -> Result<LifecycleOutcome, LifecycleError> {
    let mut timings = LifecycleTimings::default();
    let config = ctrd.pod_config(name, annotations)?;

    let t = Instant::now();
    let pod = cri.run_pod_sandbox(config, handler).await?;
    timings.run = t.elapsed();
    let netns = cri.pod_netns_path(&pod.id).await?;

    let t = Instant::now();
    let id = cri
        .create_container(
            &pod,
            container_config("sleeper", ctrd.busybox_image(), &["sleep", "3600"]),
        )
        .await?;
    timings.create = t.elapsed();

    let t = Instant::now();
    cri.start_container(&id).await?;
    timings.start = t.elapsed();

    let processes = pod_processes(ctrd, &pod.id);
    let accel = vm_accel(&processes);
    let idle_memory = match opts.idle_memory_after {
        Some(settle) => {
            tokio::time::sleep(settle).await;
            let mut memory = pod_host_memory(ctrd, &pod.id);
            if let Some(guest_bytes) = opts.split_guest_ram_of {
                memory.vm_split = Some(vm_guest_ram_split(&processes, guest_bytes)?);
            }
            Some(memory)
        }
        None => None,
    };

    let t = Instant::now();
    let exec = cri.exec_sync(&id, &["uname", "-r"], 30).await;
    timings.exec = t.elapsed();
    let (kernel_release, exec_error) = match exec {
        Ok(out) if out.exit_code == 0 => (out.stdout.trim().to_string(), None),
        Ok(out) => {
            let err = LifecycleError::Exec {
                exit_code: out.exit_code,
                stderr: out.stderr,
            };
            if !opts.tolerate_exec_failure {
                return Err(err);
            }
            (String::new(), Some(err.to_string()))
        }
        Err(e) => {
            if !opts.tolerate_exec_failure {
                return Err(e.into());
            }
            (String::new(), Some(e.to_string()))
        }
    };

    let t = Instant::now();
    cri.stop_pod_sandbox(&pod.id).await?;
    timings.stop = t.elapsed();

    let t = Instant::now();
    cri.remove_pod_sandbox(&pod.id).await?;
    timings.remove = t.elapsed();

    Ok(LifecycleOutcome {
        timings,
        pod_id: pod.id,
        kernel_release,
        netns,
        exec_error,
        idle_memory,
        accel,
    })
}

/// The median of durations (the lower middle one for an even count; zero for none).
pub fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    match sorted.len() {
        0 => Duration::ZERO,
        n => sorted[(n - 1) / 2],
    }
}

/// Host memory charged to the instance's pods, in bytes: the memory cgroup usage of its cgroup
/// parent (every pod's containers, and whatever a runtime moved into the pod cgroups) plus the
/// proportional set size of its shims that live outside those cgroups (runc's shim does).
pub fn pods_host_memory(ctrd: &PrivateContainerd) -> u64 {
    let parent = ctrd.cgroup_parent().trim_start_matches('/');
    let v1 = Path::new("/sys/fs/cgroup/memory")
        .join(parent)
        .join("memory.usage_in_bytes");
    let v2_unified = Path::new("/sys/fs/cgroup/unified")
        .join(parent)
        .join("memory.current");
    let v2 = Path::new("/sys/fs/cgroup")
        .join(parent)
        .join("memory.current");
    let cgroup = [v1, v2_unified, v2]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let in_pod_cgroups = ctrd.pod_cgroup_pids();
    let shims: u64 = ctrd
        .leftover_processes()
        .iter()
        .filter(|p| !in_pod_cgroups.contains(&p.pid))
        .map(|p| pss_bytes(p.pid))
        .sum();
    cgroup + shims
}

/// A process's proportional set size (`Pss` of /proc/<pid>/smaps_rollup), 0 if gone.
pub fn pss_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// The pod state directory root of the `microvm` shim.
pub const MICROVM_STATE_ROOT: &str = "/run/microvm";

/// One host process of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodProcess {
    pub pid: i32,
    /// `/proc/<pid>/comm`.
    pub name: String,
    pub cmdline: String,
}

/// The name [`PodMemory`] gives the embedded VMM's process of a pod (its `comm` is the shim's,
/// `containerd-shim`, since it runs the same binary), so the shim and its VMM count apart.
pub const VMM_PROCESS_NAME: &str = "vmm process";

impl PodProcess {
    /// Whether this is the embedded VMM's process of a pod (`vmm_process = true`, the
    /// default): the shim's binary run as `<shim> __vmm …`.
    pub fn is_vmm_process(&self) -> bool {
        self.cmdline.split(' ').nth(1) == Some("__vmm")
    }

    /// The name to count this process's memory under: [`VMM_PROCESS_NAME`] for the VMM's
    /// process, else its `comm`.
    pub fn memory_name(&self) -> String {
        if self.is_vmm_process() {
            VMM_PROCESS_NAME.to_string()
        } else {
            self.name.clone()
        }
    }
}

/// The process of a pod that holds its guest RAM on the embedded VMM: the VMM's own process
/// when it runs in one, else the shim (the first of [`pod_processes`], parents first).
pub fn guest_ram_holder(processes: &[PodProcess]) -> Option<&PodProcess> {
    processes
        .iter()
        .find(|p| p.is_vmm_process())
        .or_else(|| processes.first())
}

/// The host processes of pod `pod_id` of this containerd: its shim (started with the
/// instance's address and the pod id) and all of the shim's descendants, parents first.
pub fn pod_processes(ctrd: &PrivateContainerd, pod_id: &str) -> Vec<PodProcess> {
    let socket = ctrd.socket().as_os_str().as_bytes().to_vec();
    let table = process_table();
    let mut found: Vec<i32> = table
        .iter()
        .filter(|p| {
            p.argv.contains(&socket) && p.argv.iter().any(|a| a.as_slice() == pod_id.as_bytes())
        })
        .map(|p| p.pid)
        .collect();
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        for p in &table {
            if p.ppid == parent && !found.contains(&p.pid) {
                found.push(p.pid);
            }
        }
        i += 1;
    }
    found
        .into_iter()
        .filter_map(|pid| table.iter().find(|p| p.pid == pid))
        .map(|p| PodProcess {
            pid: p.pid,
            name: p.name.clone(),
            cmdline: p
                .argv
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" "),
        })
        .collect()
}

struct ProcEntry {
    pid: i32,
    ppid: i32,
    name: String,
    argv: Vec<Vec<u8>>,
}

/// Every live process: pid, parent, name, argv.
fn process_table() -> Vec<ProcEntry> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = shim::state::ProcStat::read(u32::try_from(pid).ok()?)?;
            if !stat.is_live() {
                return None;
            }
            let ppid = i32::try_from(stat.ppid).ok()?;
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let argv = cmdline
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| a.to_vec())
                .collect();
            Some(ProcEntry {
                pid,
                ppid,
                name,
                argv,
            })
        })
        .collect()
}

/// Host memory of one pod: the proportional set size of each of its processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodMemory {
    /// `(pid, process name, PSS bytes)` of every process of the pod.
    pub processes: Vec<(i32, String, u64)>,
    /// With [`LifecycleOptions::split_guest_ram_of`]: the process that holds the guest RAM
    /// ([`guest_ram_holder`]: the VMM's own process, or the shim when the VMM runs in it) split
    /// into guest RAM and the rest, read right after `processes`.
    pub vm_split: Option<GuestRamSplit>,
    /// Whether the VMM ran in a process of its own ([`VMM_PROCESS_NAME`] in `processes`), so
    /// `vm_split`'s own part is the VMM's alone and the shim counts apart.
    pub vmm_in_own_process: bool,
    /// The pod's host cgroup (`microvm` pods; read right after `processes`).
    pub host_cgroup: Option<crate::host_cgroup::HostCgroup>,
}

impl PodMemory {
    pub fn total(&self) -> u64 {
        self.processes.iter().map(|(_, _, b)| b).sum()
    }

    /// The PSS of the processes named `name` (e.g. `containerd-shim`, [`VMM_PROCESS_NAME`]).
    pub fn named(&self, name: &str) -> u64 {
        self.processes
            .iter()
            .filter(|(_, n, _)| n == name)
            .map(|(_, _, b)| b)
            .sum()
    }

    /// PSS summed per process name, largest first: `[("qemu-system-x86", bytes), …]`.
    pub fn by_name(&self) -> Vec<(String, u64)> {
        let mut sums: Vec<(String, u64)> = Vec::new();
        for (_, name, bytes) in &self.processes {
            match sums.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => *sum += bytes,
                None => sums.push((name.clone(), *bytes)),
            }
        }
        sums.sort_by_key(|s| std::cmp::Reverse(s.1));
        sums
    }
}

/// Everything pod `pod_id` costs the host in memory, as PSS: its shim and the shim's descendants
/// (for `microvm`: QEMU with the guest's touched memory, virtiofsd, vhost-device-vsock; for
/// `runc`: pause and the containers), plus any other process in the instance's pod cgroups.
/// Meant for an instance running this one pod.
pub fn pod_host_memory(ctrd: &PrivateContainerd, pod_id: &str) -> PodMemory {
    let mut processes: Vec<(i32, String, u64)> = pod_processes(ctrd, pod_id)
        .into_iter()
        .map(|p| (p.pid, p.memory_name(), pss_bytes(p.pid)))
        .collect();
    for pid in ctrd.pod_cgroup_pids() {
        if !processes.iter().any(|(p, _, _)| *p == pid) {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default();
            processes.push((pid, name, pss_bytes(pid)));
        }
    }
    let vmm_in_own_process = processes.iter().any(|(_, n, _)| n == VMM_PROCESS_NAME);
    PodMemory {
        processes,
        vm_split: None,
        vmm_in_own_process,
        host_cgroup: crate::host_cgroup::HostCgroup::of_pod(ctrd.cgroup_parent(), pod_id),
    }
}

/// The name the embedded VMM gives its guest RAM mappings (`vmm::memory::GUEST_RAM_VMA_NAME`),
/// shown as `[anon:microvm-guest-ram]` on kernels with CONFIG_ANON_VMA_NAME.
pub const GUEST_RAM_VMA_NAME: &str = "microvm-guest-ram";

/// One mapping of `/proc/<pid>/smaps` (sizes in bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SmapsEntry {
    pub start: u64,
    pub end: u64,
    /// `rw-p` and the like.
    pub perms: String,
    pub inode: u64,
    /// The path or pseudo-name (`[heap]`, `[anon:name]`); empty for a plain anonymous mapping.
    pub name: String,
    pub size: u64,
    pub rss: u64,
    pub pss: u64,
    /// The `VmFlags` two-letter codes (`rd`, `wr`, `dd`, ...).
    pub flags: Vec<String>,
}

impl SmapsEntry {
    fn is_plain_anonymous(&self) -> bool {
        self.inode == 0 && self.name.is_empty()
    }

    /// A boot file the embedded VMM mapped over part of guest RAM (`vmm::boot_files`): a
    /// private writable file mapping with the VMM's no-dump flag.
    fn is_guest_file_range(&self) -> bool {
        self.inode != 0 && self.perms == "rw-p" && self.flags.iter().any(|f| f == "dd")
    }
}

/// Parses the text of `/proc/<pid>/smaps`. Lines it does not know are skipped.
pub fn parse_smaps(text: &str) -> Vec<SmapsEntry> {
    let mut entries: Vec<SmapsEntry> = Vec::new();
    for line in text.lines() {
        if let Some(entry) = parse_smaps_header(line) {
            entries.push(entry);
            continue;
        }
        let Some(current) = entries.last_mut() else {
            continue;
        };
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        if key == "VmFlags" {
            current.flags = value.split_whitespace().map(str::to_string).collect();
            continue;
        }
        let kib = |v: &str| -> Option<u64> {
            let mut words = v.split_whitespace();
            let n = words.next()?.parse::<u64>().ok()?;
            (words.next() == Some("kB")).then_some(n * 1024)
        };
        match key {
            "Size" => current.size = kib(value).unwrap_or(0),
            "Rss" => current.rss = kib(value).unwrap_or(0),
            "Pss" => current.pss = kib(value).unwrap_or(0),
            _ => {}
        }
    }
    entries
}

/// `start-end perms offset dev inode [name]`, or `None` for any other line.
fn parse_smaps_header(line: &str) -> Option<SmapsEntry> {
    let mut rest = line;
    let mut field = || -> Option<&str> {
        let trimmed = rest.trim_start();
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        let (word, tail) = trimmed.split_at(end);
        rest = tail;
        (!word.is_empty()).then_some(word)
    };
    let (start, end) = field()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = field()?;
    if perms.len() != 4 {
        return None;
    }
    let perms = perms.to_string();
    u64::from_str_radix(field()?, 16).ok()?; // offset
    field()?.split_once(':')?; // device
    let inode = field()?.parse().ok()?;
    Some(SmapsEntry {
        start,
        end,
        perms,
        inode,
        name: rest.trim().to_string(),
        ..SmapsEntry::default()
    })
}

/// How the guest RAM mappings were told apart from the VMM's own memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestRamMatch {
    /// Named `[anon:microvm-guest-ram]` (kernels with CONFIG_ANON_VMA_NAME).
    Name,
    /// Anonymous with the `dd` (MADV_DONTDUMP) flag the VMM sets, adding up to the guest size.
    NoDumpFlagAndSize,
    /// The one anonymous mapping of exactly the guest size (a VMM that marks nothing).
    Size,
}

impl std::fmt::Display for GuestRamMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GuestRamMatch::Name => "by its name",
            GuestRamMatch::NoDumpFlagAndSize => "by its no-dump flag and size",
            GuestRamMatch::Size => "by its size",
        })
    }
}

/// A VMM process's memory split into guest RAM and the rest (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRamSplit {
    /// The guest memory size (the guest RAM mappings' total size).
    pub guest_size: u64,
    /// Guest pages present in host memory (touched by the guest or the VMM's loader).
    pub guest_rss: u64,
    /// Their proportional share (equal to the RSS unless pages are shared: the boot files'
    /// pages the guest has not written are shared with every VM mapping the same files).
    pub guest_pss: u64,
    /// Of the guest RAM, the part mapped from the boot files (kernel, initrd; `vmm::boot_files`):
    /// its RSS (file pages still shared, and pages the guest wrote, now its own) and PSS.
    pub file_rss: u64,
    pub file_pss: u64,
    /// The whole process's PSS, from the same reading.
    pub process_pss: u64,
    /// How the guest RAM was found.
    pub matched: GuestRamMatch,
}

impl GuestRamSplit {
    /// The process's PSS beyond guest RAM: the VMM, its devices, and whatever else the process
    /// is (the shim, for pods).
    pub fn own_pss(&self) -> u64 {
        self.process_pss.saturating_sub(self.guest_pss)
    }
}

/// Finds the guest RAM of a VM of `guest_bytes` in a VMM process's smaps: by name where the
/// kernel shows it, else the anonymous `dd` mappings adding up to the guest size, else the one
/// anonymous mapping of exactly that size; with the first two, the boot files mapped over parts
/// of it (private writable file mappings with `dd`) count as guest RAM too. Anything else is an
/// error saying what was seen.
pub fn split_guest_ram(entries: &[SmapsEntry], guest_bytes: u64) -> Result<GuestRamSplit, String> {
    let named_as = format!("[anon:{GUEST_RAM_VMA_NAME}]");
    let files: Vec<&SmapsEntry> = entries.iter().filter(|e| e.is_guest_file_range()).collect();
    let named: Vec<&SmapsEntry> = entries
        .iter()
        .filter(|e| {
            e.name == named_as
                || (e.is_guest_file_range() && entries.iter().any(|n| n.name == named_as))
        })
        .collect();
    let no_dump: Vec<&SmapsEntry> = entries
        .iter()
        .filter(|e| {
            (e.is_plain_anonymous() && e.flags.iter().any(|f| f == "dd")) || e.is_guest_file_range()
        })
        .collect();
    let of_size: Vec<&SmapsEntry> = entries
        .iter()
        .filter(|e| e.is_plain_anonymous() && e.size == guest_bytes)
        .collect();
    let total = |v: &[&SmapsEntry]| v.iter().map(|e| e.size).sum::<u64>();
    let (guest, matched) = if !named.is_empty() {
        (named, GuestRamMatch::Name)
    } else if !no_dump.is_empty() && total(&no_dump) == guest_bytes {
        (no_dump, GuestRamMatch::NoDumpFlagAndSize)
    } else if of_size.len() == 1 {
        (of_size, GuestRamMatch::Size)
    } else {
        return Err(format!(
            "no mapping named {named_as}, {} anonymous no-dump mappings of {} bytes in all, {} \
             anonymous mappings of the guest size {guest_bytes} bytes: cannot tell the guest \
             RAM apart",
            no_dump.len(),
            total(&no_dump),
            of_size.len()
        ));
    };
    if total(&guest) != guest_bytes {
        return Err(format!(
            "the mappings named {named_as} hold {} bytes, the guest has {guest_bytes}",
            total(&guest)
        ));
    }
    let (file_rss, file_pss) = if matched == GuestRamMatch::Size {
        (0, 0)
    } else {
        (
            files.iter().map(|e| e.rss).sum(),
            files.iter().map(|e| e.pss).sum(),
        )
    };
    Ok(GuestRamSplit {
        guest_size: guest_bytes,
        guest_rss: guest.iter().map(|e| e.rss).sum(),
        guest_pss: guest.iter().map(|e| e.pss).sum(),
        file_rss,
        file_pss,
        process_pss: entries.iter().map(|e| e.pss).sum(),
        matched,
    })
}

/// [`split_guest_ram`] of the live process `pid`.
pub fn guest_ram_split_of(pid: i32, guest_bytes: u64) -> Result<GuestRamSplit, LifecycleError> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&path).map_err(|source| LifecycleError::Io {
        what: format!("reading {path}"),
        source,
    })?;
    split_guest_ram(&parse_smaps(&text), guest_bytes)
        .map_err(|reason| LifecycleError::GuestRam { pid, reason })
}

/// The split of the pod's process that holds the VM under the embedded VMM
/// ([`guest_ram_holder`]).
fn vm_guest_ram_split(
    processes: &[PodProcess],
    guest_bytes: u64,
) -> Result<GuestRamSplit, LifecycleError> {
    let holder = guest_ram_holder(processes).ok_or_else(|| LifecycleError::GuestRam {
        pid: 0,
        reason: "the pod has no shim process".to_string(),
    })?;
    guest_ram_split_of(holder.pid, guest_bytes)
}

/// The accelerator of a pod's QEMU (`TCG`, `KVM`), from its `-accel` argument; `None` when the
/// pod has no QEMU process.
pub fn vm_accel(processes: &[PodProcess]) -> Option<String> {
    let qemu = processes
        .iter()
        .find(|p| p.cmdline.contains("qemu-system"))?;
    let mut args = qemu.cmdline.split(' ');
    let accel = args
        .by_ref()
        .skip_while(|a| *a != "-accel")
        .nth(1)
        .unwrap_or("tcg");
    Some(accel.split(',').next().unwrap_or(accel).to_uppercase())
}

/// What a removed pod left on the host, as readable lines (empty: nothing): its processes, any
/// process naming its state directory (QEMU, virtiofsd, vhost-device-vsock), its state
/// directory, mounts (under the state directory and the instance's directory), its shim socket,
/// its network namespace, and cgroups below the instance's cgroup parent.
pub fn pod_leftovers(ctrd: &PrivateContainerd, pod_id: &str, netns: Option<&Path>) -> Vec<String> {
    let mut left = Vec::new();
    let state = Path::new(MICROVM_STATE_ROOT).join(pod_id);
    let state_str = state.as_os_str().as_bytes().to_vec();
    let mut pids: Vec<i32> = Vec::new();
    for p in pod_processes(ctrd, pod_id) {
        pids.push(p.pid);
        left.push(format!("process {} ({}): {}", p.pid, p.name, p.cmdline));
    }
    for p in process_table() {
        let mentions_state = p.argv.iter().any(|a| {
            a.windows(state_str.len())
                .any(|w| w == state_str.as_slice())
        });
        if mentions_state && !pids.contains(&p.pid) && p.pid != std::process::id() as i32 {
            pids.push(p.pid);
            left.push(format!("VM process {} ({})", p.pid, p.name));
        }
    }
    for p in ctrd.leftover_processes() {
        if !pids.contains(&p.pid) {
            left.push(format!("process {}: {}", p.pid, p.cmdline));
        }
    }
    if state.exists() {
        left.push(format!("state directory {}", state.display()));
    }
    for m in crate::containerd::mounts_under(&state)
        .into_iter()
        .chain(ctrd.mounts())
    {
        left.push(format!("mount {}", m.display()));
    }
    let socket = ctrd.shim_socket(pod_id);
    if socket.exists() {
        left.push(format!("shim socket {}", socket.display()));
    }
    if let Some(netns) = netns.filter(|n| n.exists()) {
        left.push(format!("network namespace {}", netns.display()));
    }
    for c in ctrd.leftover_cgroups() {
        left.push(format!("cgroup {}", c.display()));
    }
    left
}

/// Waits (bounded) for [`pod_leftovers`] to be empty; returns what is left at the deadline.
pub fn wait_pod_gone(
    ctrd: &PrivateContainerd,
    pod_id: &str,
    netns: Option<&Path>,
    timeout: Duration,
) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = pod_leftovers(ctrd, pod_id, netns);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The VM backend for pods on this host, as `microvm check-host` decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmBackend {
    /// The shim config's `hypervisor`: `kvm` (the embedded VMM) or `qemu`.
    pub hypervisor: &'static str,
    /// check-host's verdict line (why this backend).
    pub reason: String,
    /// check-host's whole report.
    pub report: String,
}

/// Runs `<microvm> check-host --kernel <kernel>`: exit 0 means our guest boots under the
/// embedded VMM here (`kvm`), exit 2 that it cannot (`qemu`, with check-host's reason).
pub fn choose_vm_backend(microvm: &Path, kernel: &Path) -> Result<VmBackend, LifecycleError> {
    let command = format!(
        "{} check-host --kernel {}",
        microvm.display(),
        kernel.display()
    );
    let out = std::process::Command::new(microvm)
        .arg("check-host")
        .arg("--kernel")
        .arg(kernel)
        .output()
        .map_err(|source| LifecycleError::Io {
            what: format!("running {command}"),
            source,
        })?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let reason = report
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("verdict:"))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| report.trim().to_string());
    let hypervisor = match out.status.code() {
        Some(0) => "kvm",
        Some(2) => "qemu",
        _ => {
            return Err(LifecycleError::CheckHost {
                command,
                status: out.status.to_string(),
                output: report,
            })
        }
    };
    Ok(VmBackend {
        hypervisor,
        reason,
        report,
    })
}

/// Writes a `microvm` shim config (what `ConfigPath` names) to `<dir>/microvm.toml`. With
/// `hypervisor = "qemu"` it sets `allow_software_emulation = true`: [`choose_vm_backend`] picks
/// QEMU only where the embedded VMM cannot boot our guest, which on the hosts we run on (kvm-pvm,
/// no KVM) means QEMU's TCG; the shim refuses that without the opt-in and warns once per pod
/// with it.
pub fn write_shim_config(
    dir: &Path,
    hypervisor: &str,
    kernel: &Path,
    initrd: &Path,
    log_level: &str,
) -> Result<PathBuf, LifecycleError> {
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let path = dir.join("microvm.toml");
    let mut text = format!(
        "hypervisor = {}\nkernel = {}\ninitrd = {}\nlog_level = {}\n",
        quote(hypervisor),
        quote(&kernel.to_string_lossy()),
        quote(&initrd.to_string_lossy()),
        quote(log_level),
    );
    if hypervisor == "qemu" {
        text.push_str("allow_software_emulation = true\n");
    }
    std::fs::write(&path, text).map_err(|source| LifecycleError::Io {
        what: format!("writing {}", path.display()),
        source,
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_per_step() {
        let ms = Duration::from_millis;
        assert_eq!(median(&[]), Duration::ZERO);
        assert_eq!(median(&[ms(3), ms(1), ms(2)]), ms(2));
        assert_eq!(median(&[ms(4), ms(1), ms(3), ms(2)]), ms(2));
        let a = LifecycleTimings {
            run: ms(10),
            exec: ms(1),
            ..Default::default()
        };
        let b = LifecycleTimings {
            run: ms(30),
            exec: ms(3),
            ..Default::default()
        };
        let c = LifecycleTimings {
            run: ms(20),
            exec: ms(2),
            ..Default::default()
        };
        let m = LifecycleTimings::median(&[a, b, c]);
        assert_eq!((m.run, m.exec, m.total()), (ms(20), ms(2), ms(22)));
        assert_eq!(m.steps()[6], ("total", ms(22)));
    }

    #[test]
    fn pss_of_this_process_is_nonzero() {
        assert!(pss_bytes(std::process::id() as i32) > 0);
        assert_eq!(pss_bytes(i32::MAX), 0);
    }

    #[test]
    fn accel_from_the_qemu_command_line() {
        let p = |cmdline: &str| PodProcess {
            pid: 1,
            name: "x".into(),
            cmdline: cmdline.into(),
        };
        assert_eq!(vm_accel(&[p("/usr/bin/shim -id a")]), None);
        assert_eq!(
            vm_accel(&[
                p("shim"),
                p("qemu-system-x86_64 -M microvm -accel tcg -m 256M")
            ]),
            Some("TCG".into())
        );
        assert_eq!(
            vm_accel(&[p("qemu-system-x86_64 -accel kvm -cpu host")]),
            Some("KVM".into())
        );
    }

    #[test]
    fn the_vmm_process_holds_the_guest_ram_when_there_is_one() {
        let p = |pid, name: &str, cmdline: &str| PodProcess {
            pid,
            name: name.into(),
            cmdline: cmdline.into(),
        };
        let shim = p(
            10,
            "containerd-shim",
            "/usr/bin/containerd-shim-microvm-v1 -namespace k8s.io -id pod1",
        );
        let vmm = p(
            11,
            "containerd-shim",
            "/usr/bin/containerd-shim-microvm-v1 __vmm 5 /run/microvm/pod1",
        );
        let other = p(12, "sh", "sh -c __vmm");
        assert_eq!(guest_ram_holder(std::slice::from_ref(&shim)), Some(&shim));
        assert_eq!(
            guest_ram_holder(&[shim.clone(), other.clone(), vmm.clone()]),
            Some(&vmm)
        );
        assert!(vmm.is_vmm_process() && !shim.is_vmm_process() && !other.is_vmm_process());
        assert_eq!(vmm.memory_name(), VMM_PROCESS_NAME);
        assert_eq!(shim.memory_name(), "containerd-shim");
        assert_eq!(guest_ram_holder(&[]), None);
    }

    #[test]
    fn pod_memory_sums_per_name() {
        let m = PodMemory {
            processes: vec![(1, "a".into(), 5), (2, "b".into(), 7), (3, "a".into(), 4)],
            vm_split: None,
            vmm_in_own_process: false,
            host_cgroup: None,
        };
        assert_eq!(m.total(), 16);
        assert_eq!(m.named("a"), 9);
        assert_eq!(
            m.by_name(),
            vec![("a".to_string(), 9), ("b".to_string(), 7)]
        );
    }

    #[test]
    fn this_process_tree_is_found_in_the_process_table() {
        let own = std::process::id() as i32;
        let table = process_table();
        let me = table.iter().find(|p| p.pid == own).expect("own process");
        assert!(table.iter().any(|p| p.pid == me.ppid));
    }

    /// A shortened /proc/<pid>/smaps of a shim running a 256 MiB VM on the embedded VMM (a
    /// kernel without CONFIG_ANON_VMA_NAME), with an unmarked anonymous mapping of the same
    /// size next to it and a glibc arena.
    const SMAPS: &str = "\
55d0c0a00000-55d0c1200000 r-xp 00000000 fd:01 1311234                    /usr/bin/containerd-shim-microvm-v1
Size:               8192 kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
Rss:                2048 kB
Pss:                2048 kB
Pss_Dirty:             0 kB
VmFlags: rd ex mr mw me
7f0000000000-7f0010000000 rw-p 00000000 00:00 0 
Size:             262144 kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
Rss:               40960 kB
Pss:               40000 kB
Pss_Dirty:         40000 kB
Anonymous:         40960 kB
VmFlags: rd wr mr mw me nr dd
7f0010000000-7f0020000000 rw-p 00000000 00:00 0 
Size:             262144 kB
Rss:                 100 kB
Pss:                 100 kB
VmFlags: rd wr mr mw me ac
7f0020000000-7f0020021000 rw-p 00000000 00:00 0 
Size:                132 kB
Rss:                  12 kB
Pss:                  12 kB
VmFlags: rd wr mr mw me nr
7ffd1c3f0000-7ffd1c411000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  24 kB
Pss:                  24 kB
VmFlags: rd wr mr mw me gd ac
";

    #[test]
    fn smaps_entries_are_parsed() {
        let e = parse_smaps(SMAPS);
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].name, "/usr/bin/containerd-shim-microvm-v1");
        assert_eq!(e[0].inode, 1311234);
        assert_eq!(e[0].perms, "r-xp");
        assert_eq!((e[0].size, e[0].rss), (8192 * 1024, 2048 * 1024));
        assert_eq!(e[1].start, 0x7f00_0000_0000);
        assert_eq!(e[1].end, 0x7f00_1000_0000);
        assert!(e[1].is_plain_anonymous());
        assert_eq!(e[1].pss, 40000 * 1024, "Pss, not Pss_Dirty");
        assert!(e[1].flags.iter().any(|f| f == "dd"));
        assert_eq!(e[4].name, "[stack]");
        assert!(!e[4].is_plain_anonymous());
        assert!(parse_smaps("garbage\nSize: 4 kB\n").is_empty());
    }

    #[test]
    fn guest_ram_is_found_by_its_no_dump_flag_and_size() {
        let guest = 256 << 20;
        let s = split_guest_ram(&parse_smaps(SMAPS), guest).unwrap();
        assert_eq!(s.matched, GuestRamMatch::NoDumpFlagAndSize);
        assert_eq!((s.guest_size, s.guest_rss), (guest, 40960 * 1024));
        assert_eq!(s.guest_pss, 40000 * 1024);
        assert_eq!(s.process_pss, (2048 + 40000 + 100 + 12 + 24) * 1024);
        assert_eq!(s.own_pss(), (2048 + 100 + 12 + 24) * 1024);
    }

    #[test]
    fn guest_ram_is_found_by_name_first() {
        // The kernel names the mapping; the VMM split it in two (e.g. a flag on one part).
        let text = SMAPS
            .replacen(
                "7f0000000000-7f0010000000 rw-p 00000000 00:00 0 ",
                "7f0000000000-7f0008000000 rw-p 00000000 00:00 0   [anon:microvm-guest-ram]\n\
                 Size: 131072 kB\nRss: 1024 kB\nPss: 1024 kB\n\
                 7f0008000000-7f0010000000 rw-p 00000000 00:00 0   [anon:microvm-guest-ram]",
                1,
            )
            .replacen("Size:             262144 kB", "Size: 131072 kB", 1);
        let s = split_guest_ram(&parse_smaps(&text), 256 << 20).unwrap();
        assert_eq!(s.matched, GuestRamMatch::Name);
        assert_eq!(s.guest_rss, (1024 + 40960) * 1024);
        // Named mappings that do not add up to the guest are an error, not a guess.
        let e = split_guest_ram(&parse_smaps(&text), 512 << 20).unwrap_err();
        assert!(e.contains("hold 268435456 bytes"), "{e}");
    }

    #[test]
    fn boot_files_mapped_over_guest_ram_count_as_guest_ram() {
        // The VMM mapped 16 MiB of the kernel over the middle of the guest RAM mapping.
        let text = SMAPS.replacen(
            "7f0000000000-7f0010000000 rw-p 00000000 00:00 0 \n\
             Size:             262144 kB",
            "7f0000000000-7f0001000000 rw-p 00000000 00:00 0 \n\
             Size: 16384 kB\nRss: 100 kB\nPss: 100 kB\nVmFlags: rd wr mr mw me nr dd\n\
             7f0001000000-7f0002000000 rw-p 00200000 08:01 4242   /var/lib/microvm/vmlinux\n\
             Size: 16384 kB\nRss: 16384 kB\nPss: 2048 kB\nVmFlags: rd wr mr mw me nr dd\n\
             7f0002000000-7f0010000000 rw-p 00000000 00:00 0 \n\
             Size:             229376 kB",
            1,
        );
        let e = parse_smaps(&text);
        let s = split_guest_ram(&e, 256 << 20).unwrap();
        assert_eq!(s.matched, GuestRamMatch::NoDumpFlagAndSize);
        assert_eq!(s.guest_rss, (100 + 16384 + 40960) * 1024);
        assert_eq!(s.guest_pss, (100 + 2048 + 40000) * 1024);
        assert_eq!((s.file_rss, s.file_pss), (16384 * 1024, 2048 * 1024));
        // The shim's own binary (no dd, not writable) is not guest RAM.
        assert_eq!(s.own_pss(), (2048 + 100 + 12 + 24) * 1024);
    }

    #[test]
    fn guest_ram_of_an_unmarking_vmm_is_found_by_size_only_if_unique() {
        let unmarked = SMAPS.replace("nr dd", "nr");
        // Two anonymous mappings of 256 MiB: ambiguous.
        let e = split_guest_ram(&parse_smaps(&unmarked), 256 << 20).unwrap_err();
        assert!(e.contains("2 anonymous mappings of the guest size"), "{e}");
        let one = unmarked.replacen(
            "7f0010000000-7f0020000000 rw-p 00000000 00:00 0 ",
            "7f0010000000-7f0020000000 rw-p 00000000 00:00 0   [heap]",
            1,
        );
        let s = split_guest_ram(&parse_smaps(&one), 256 << 20).unwrap();
        assert_eq!(s.matched, GuestRamMatch::Size);
        assert_eq!(s.guest_pss, 40000 * 1024);
        // A guest size nothing matches.
        assert!(split_guest_ram(&parse_smaps(SMAPS), 128 << 20).is_err());
    }

    #[test]
    fn the_guest_ram_name_is_the_vmm_one() {
        assert_eq!(GUEST_RAM_VMA_NAME, vmm::memory::GUEST_RAM_VMA_NAME);
    }

    #[test]
    fn guest_ram_of_a_live_vmm_mapping_is_found() {
        // What the embedded VMM maps, in this process: found by name or by its no-dump flag.
        let guest = 32 << 20;
        let mem = vmm::memory::create_guest_memory(guest).unwrap();
        let s = guest_ram_split_of(std::process::id() as i32, guest).unwrap();
        assert_ne!(s.matched, GuestRamMatch::Size);
        assert!(s.process_pss > s.guest_pss);
        drop(mem);
    }
}
