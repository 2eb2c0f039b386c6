//! A pod's boot, every step in order ([`Sandbox::boot`]):
//!
//! 1. the VM backend: the config's choice, checked against one probe of this host
//!    (`vm::choose_pod_backend`, off the async threads); QEMU's software emulation only where
//!    the config allows it, with a warning;
//! 2. the VM's size, from the pod's annotations ([`spec::vm_size`]);
//! 3. the pod's state directory, which records the shim's pid (crash cleanup starts here);
//! 4. the host cgroup: `<pod cgroup>/microvm-<id>` under the parent of the spec's
//!    `linux.cgroupsPath`, limited to the VM's size plus the pod's overhead, with this whole
//!    process moved in so every thread and helper that follows is inside
//!    (`resources::cgroup`, recorded in the state directory before it is made; skipped with an
//!    info log when the spec has no `cgroupsPath` or the config disables it);
//! 5. the network: a tap per CNI interface in the pod netns the sandbox spec names, redirected
//!    both ways (`resources::network`, recorded in the state directory before anything is made),
//!    and the netns's loopback caught for port-forward (`resources::network::loopback`: a
//!    listening socket and a BPF program that live as long as the shim's fds, nothing to
//!    record; a host that cannot do it gets a warn line and a pod without port-forward);
//! 6. storage: the pod's shared folder, exported to the guest over virtio-fs: a small tmpfs of
//!    its own, read-only to the guest, which only the shim can write through a detached mount of
//!    its own (`resources::storage`);
//! 7. devices: kubelet's PodResources API says which device plugins' devices the pod holds;
//!    their block nodes become cold-plugged disks, their VFIO devices the VM's PCI devices, and
//!    empty block slots are reserved for hot-plug (`resources::devices`, recorded in the state
//!    directory);
//! 8. the guest spec (kernel, initrd, size, hostname, log level, share, NICs, disks, VFIO
//!    devices, QEMU programs);
//! 9. the VM, on its own thread: started, its host processes recorded, then the agent's ready
//!    event awaited (`vm::ready`);
//! 10. the agent: connected and checked;
//! 11. the guest's network: ConfigureNetwork gives its NICs the CNI interfaces' names, MTU,
//!     addresses and routes;
//! 12. the pod's sysctls, written in the guest before any container exists;
//! 13. port-forward served: the caught loopback's connections carried to the guest
//!     ([`super::port_forward`]).
//!
//! The boot is one transaction: each host resource is recorded in the state directory before
//! it is made, and a step that fails has one undo ([`undo_boot`]: the VM stopped if it started,
//! then everything recorded released in reverse by [`release_host_resources`], the same records
//! a teardown and the reclaim of a dead pod read); the error says which step failed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::{AgentClient, AgentError};
use crate::config::Config;
use crate::resources::cgroup::overhead::{Amounts, Defaults};
use crate::resources::cgroup::{self, CgroupError, HostCgroup, SetupRequest};
use crate::resources::{devices, network, storage};
use crate::state::{state_root, StateDir};
use crate::vm::qemu::Accel;
use crate::vm::thread::{BootError, VmThread};
use crate::vm::{
    Backend, BackendChoice, DiskBacking, GuestDisk, GuestNic, GuestSpec, QemuPrograms, SharedDir,
};

use super::port_forward::PortForward;
use super::{release_host_resources, spec, Sandbox, SandboxError};
use crate::resources::network::loopback::LoopbackListener;

/// How long connecting to a ready agent may take.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The status a VM stopped after a failed boot step reports.
const DISCARDED_STATUS: u32 = 137;
/// Console lines quoted in errors.
const TAIL_LINES: usize = 20;

/// What a pod's boot needs.
pub struct BootRequest<'a> {
    /// The pod's id.
    pub id: &'a str,
    /// The socket this shim serves the pod on (recorded in the state directory for
    /// `<shim> delete` and the sweep after a crash); `None` outside a serving shim.
    pub shim_socket: Option<&'a str>,
    /// The pod's (or standalone container's) OCI spec.
    pub spec: &'a crate::oci::Spec,
    /// The spec's annotations.
    pub annotations: &'a HashMap<String, String>,
    /// The shim's config for this pod.
    pub config: Config,
    /// The pod's sysctls (name -> value), already checked ([`spec::pod_sysctls`]).
    pub sysctls: HashMap<String, String>,
    /// The RuntimeClass overhead when containerd gave it typed (Sandbox API:
    /// [`super::pod_config`]); empty on the pause-container path.
    pub overhead: Amounts,
}

/// The page sharing of pod `id` (docs/page-sharing.md): its trust domain from the config and
/// the sandbox's namespace annotation (set by containerd's CRI from the pod's metadata). In
/// `namespace` mode a pod without a namespace shares with nobody.
fn page_sharing(
    id: &str,
    config: &Config,
    annotations: &HashMap<String, String>,
) -> Option<vmm::PageSharingConfig> {
    use crate::config::PageSharing;
    let domain = match config.page_sharing {
        PageSharing::Off => return None,
        PageSharing::Node => vmm::page_sharing::NODE_DOMAIN.to_string(),
        PageSharing::Namespace => {
            match annotations
                .get(devices::POD_NAMESPACE_ANNOTATION)
                .filter(|ns| !ns.is_empty())
            {
                Some(ns) => vmm::page_sharing::namespace_domain(ns),
                None => {
                    log::info!(
                        "sandbox {id}: no {} annotation: page sharing is off for this pod \
                         (page_sharing = \"namespace\")",
                        devices::POD_NAMESPACE_ANNOTATION
                    );
                    return None;
                }
            }
        }
    };
    Some(vmm::PageSharingConfig {
        template_dir: config.page_templates_dir.clone(),
        domain,
        capture_kernel_text: false,
    })
}

impl Sandbox {
    /// Boots pod `req.id`: the steps of this module's doc, in order, as one transaction. Each
    /// host resource is recorded in the pod's state directory before it is made (the records
    /// [`release_host_resources`] reads), so a failure at any step has one undo
    /// ([`undo_boot`]): the VM stopped if it started, then the host side released in reverse
    /// from those records, the same undo a pod's teardown and the reclaim of a dead pod run.
    pub async fn boot(req: BootRequest<'_>) -> Result<Sandbox, SandboxError> {
        let id = req.id;
        let config = &req.config;
        // 1. The backend (the host probed once, off the async threads), and 2. the size:
        // nothing is acquired yet.
        let choice = crate::vm::choose_pod_backend(id, config).await?;
        let size = spec::vm_size(config, req.annotations).map_err(SandboxError::Size)?;
        // 3. The state directory: from here on, every step's failure is undone by `undo_boot`.
        let state = StateDir::new(&state_root(), id).map_err(SandboxError::StateName)?;
        state
            .create(std::process::id())
            .map_err(SandboxError::State)?;
        // 4.-8. The host side and the guest spec.
        let host = match HostSide::acquire(&req, &choice, size, &state).await {
            Ok(host) => host,
            Err(e) => return Err(undo_boot(id, &state, None, e).await),
        };
        log::info!(
            "sandbox {id}: booting a {} VM with {} vCPUs, {} MiB",
            choice.backend,
            size.vcpus,
            size.memory_mib
        );
        // 9. The VM, up to the agent's ready event; its host processes recorded as they start.
        let record_in = state.clone();
        let record = Box::new(move |pids: &[u32]| {
            record_in
                .record_vm_processes(pids)
                .map_err(|e| e.to_string())
        });
        let vm = match VmThread::boot(choice.backend, host.guest, record).await {
            Ok(vm) => vm,
            Err(e) => return Err(undo_boot(id, &state, None, e.into()).await),
        };
        // 10.-12. The agent, the guest's network, the pod's sysctls.
        let (agent, info) = match ready_guest(id, &vm, host.network_request, req.sysctls).await {
            Ok(ready) => ready,
            Err(e) => return Err(undo_boot(id, &state, Some(&vm), e).await),
        };
        // 13. Port-forward.
        let port_forward = host.loopback.and_then(|loopback| {
            PortForward::start(id, loopback, vm.agent_socket().to_path_buf())
                .map_err(|e| log::warn!("sandbox {id}: port-forward is unavailable: {e}"))
                .ok()
        });
        Ok(Sandbox {
            id: id.to_string(),
            state,
            share: host.share,
            host_cgroup: std::sync::Mutex::new(host.cgroup),
            vm,
            agent,
            info,
            devices: host.devices,
            app_started: Default::default(),
            port_forward,
        })
    }
}

/// What steps 4 to 8 acquired on the host, and the guest spec that hands it to the VM.
struct HostSide {
    cgroup: Option<HostCgroup>,
    share: Arc<storage::PodShare>,
    devices: devices::DeviceTable,
    guest: GuestSpec,
    /// The guest side of the pod network (step 11), when the pod has one.
    network_request: Option<agent_protocol::agent::ConfigureNetworkRequest>,
    /// The pod netns's loopback, for port-forward (step 13).
    loopback: Option<LoopbackListener>,
}

impl HostSide {
    /// Steps 4 to 8, each recorded in `state` before it acts; the caller undoes them all on an
    /// error.
    async fn acquire(
        req: &BootRequest<'_>,
        choice: &BackendChoice,
        size: spec::VmSize,
        state: &StateDir,
    ) -> Result<HostSide, SandboxError> {
        let (id, config) = (req.id, &req.config);
        // The shim's socket, for `<shim> delete` and the sweep after a crash.
        if let Some(socket) = req.shim_socket {
            state.record_socket(socket).map_err(SandboxError::State)?;
        }
        // 4. The host cgroup, before anything that spawns a process or thread for the pod.
        let cgroup = host_cgroup(id, config, req, size, state)?;
        // 5. The network, in the pod netns containerd ran CNI in.
        let (nics, network_request, loopback) = match crate::oci::network_namespace(req.spec) {
            Some(netns) => {
                let n = network::setup(&netns, &state.network_record()).await?;
                let loopback = catch_loopback(id, netns.clone()).await;
                let request = network::configure_network_request(n.guest_interfaces());
                let nics = n.nics.into_iter().map(|nic| GuestNic {
                    mac: nic.guest.mac.0,
                    // The kernel's MTU of a CNI interface is at most 65535.
                    mtu: u16::try_from(nic.guest.mtu).unwrap_or(u16::MAX),
                    tap: Arc::new(nic.tap.into_owned_fd()),
                });
                (nics.collect(), Some(request), loopback)
            }
            None => (Vec::new(), None, None),
        };
        // 6. Storage: the shared folder.
        let share = Arc::new(storage::PodShare::create(state)?);
        // 7. Devices: what the pod holds at boot, and the empty slots beside them.
        let cold = devices::cold_plug(&config.devices, req.annotations).await?;
        let (hotplug, rw_slots, ro_slots) = match choice.backend {
            // QEMU's virtio-blk-device cannot be filled at runtime without QMP (docs/devices.md).
            Backend::Qemu => (devices::Hotplug::Unsupported("qemu"), 0, 0),
            Backend::Kvm => (
                devices::Hotplug::Supported,
                usize::from(config.devices.block_slots),
                usize::from(config.devices.block_slots_read_only),
            ),
        };
        let layout = devices::disk_layout(&cold, rw_slots, ro_slots);
        let device_table = devices::DeviceTable::new(
            state.devices_record(),
            hotplug,
            &layout,
            &cold,
            cold.vfio.clone(),
        )?;
        if !cold.disks.is_empty() || !cold.vfio.is_empty() {
            log::info!(
                "sandbox {id}: cold-plugging {} disks ({}) and {} VFIO devices",
                cold.disks.len(),
                cold.disks
                    .iter()
                    .map(|d| d.host.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                cold.vfio.len()
            );
        }
        // 8. The guest spec.
        let mut guest = GuestSpec::new(
            config.kernel.clone(),
            config.initrd.clone(),
            size.vcpus,
            size.memory_mib,
            state.vm_dir(),
        );
        guest.agent_log_level = Some(config.log_level.clone());
        guest.boot_files = match config.boot_files {
            crate::config::BootFiles::Map => vmm::BootFiles::Map,
            crate::config::BootFiles::Copy => vmm::BootFiles::Copy,
        };
        guest.hostname = req.spec.hostname().clone();
        guest.shared = Some(SharedDir {
            tag: spec::SHARED_FS_TAG.to_string(),
            host_dir: share.path().to_path_buf(),
        });
        guest.nics = nics;
        guest.vfio = cold.vfio.clone();
        guest.free_page_reporting = config.free_page_reporting;
        guest.page_sharing = page_sharing(id, config, req.annotations);
        guest.vmm_process = config.vmm_process;
        let mut cold_files: Vec<Option<std::fs::File>> =
            cold.disks.into_iter().map(|d| Some(d.file)).collect();
        for d in &layout {
            let (serial, backing) = match d {
                devices::DiskLayout::Cold { serial, cold: i } => {
                    let read_only = device_table.cold_read_only(*i);
                    let Some(file) = cold_files.get_mut(*i).and_then(Option::take) else {
                        continue;
                    };
                    let file = Arc::new(file);
                    (serial, DiskBacking::File { file, read_only })
                }
                devices::DiskLayout::Empty { serial, read_only } => (
                    serial,
                    DiskBacking::Empty {
                        read_only: *read_only,
                    },
                ),
            };
            guest.disks.push(GuestDisk {
                serial: serial.clone(),
                backing,
            });
        }
        guest.qemu = QemuPrograms {
            qemu: config.qemu.binary.clone(),
            vhost_vsock: config.qemu.vhost_vsock_binary.clone(),
            virtiofsd: config.qemu.virtiofsd_binary.clone(),
            accel: choice.qemu_accel.unwrap_or(Accel::Kvm),
            // Checked by Config::validate.
            jail_id: crate::config::qemu::jail_id(config.qemu.jail_id_base).unwrap_or(u32::MAX),
        };
        Ok(HostSide {
            cgroup,
            share,
            devices: device_table,
            guest,
            network_request,
            loopback,
        })
    }
}

/// Step 5's loopback for port-forward, off the async threads; a host that cannot (no BPF
/// sk_lookup) gets a warn line naming why, and the pod runs without port-forward.
async fn catch_loopback(id: &str, netns: std::path::PathBuf) -> Option<LoopbackListener> {
    let caught = tokio::task::spawn_blocking(move || network::loopback::catch_loopback(&netns))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    caught
        .map_err(|e| log::warn!("sandbox {id}: port-forward is unavailable: {e}"))
        .ok()
}

/// Steps 10 to 12, on the VM that reported ready: the agent connected and checked, the guest's
/// NICs given the CNI interfaces' names, MTU, addresses and routes, the pod's sysctls set.
async fn ready_guest(
    id: &str,
    vm: &VmThread,
    network_request: Option<agent_protocol::agent::ConfigureNetworkRequest>,
    sysctls: HashMap<String, String>,
) -> Result<(AgentClient, crate::agent::AgentInfo), SandboxError> {
    // 10. The agent.
    let (agent, info) = connect_agent(vm.agent_socket()).await.map_err(|e| {
        let tail = vm.console_tail(TAIL_LINES);
        SandboxError::Boot(BootError::Agent(format!("{e}; console ends with:\n{tail}")))
    })?;
    log::info!(
        "sandbox {id}: VM ready ({}), guest kernel {}, boot id {}",
        vm.detail(),
        info.kernel_release,
        info.boot_id
    );
    // 11. The guest's NICs.
    if let Some(request) = network_request {
        agent
            .configure_network(request)
            .await
            .map_err(|source| SandboxError::Agent {
                what: format!("sandbox {id}: configuring the pod network in the guest"),
                source,
            })?;
    }
    // 12. The pod's sysctls go to the VM's namespaces, which its containers share, before any
    // container exists; a sysctl the guest refuses fails the pod, naming it.
    if !sysctls.is_empty() {
        agent
            .set_sysctls(sysctls)
            .await
            .map_err(|source| SandboxError::Agent {
                what: format!("sandbox {id}: setting the pod's sysctls in the guest"),
                source,
            })?;
    }
    Ok((agent, info))
}

/// The one undo of a failed boot: the VM stopped if it started (it reports
/// [`DISCARDED_STATUS`]), then the host side released in reverse from the state directory's
/// records ([`release_host_resources`]: network, VM processes, host cgroup, shared folder
/// mounts, the directory). Returns `error`, the step's failure, for the caller.
async fn undo_boot(
    id: &str,
    state: &StateDir,
    vm: Option<&VmThread>,
    error: SandboxError,
) -> SandboxError {
    log::warn!("sandbox {id}: boot failed, undoing it: {error}");
    if let Some(vm) = vm {
        vm.stop(DISCARDED_STATUS);
        vm.wait().await;
    }
    if let Err(c) = release_host_resources(state).await {
        log::warn!("sandbox {id}: undoing the failed boot: {c}");
    }
    error
}

/// Step 4: the pod's host cgroup, or none (no `cgroupsPath` in the spec, or disabled).
fn host_cgroup(
    id: &str,
    config: &Config,
    req: &BootRequest<'_>,
    size: spec::VmSize,
    state: &StateDir,
) -> Result<Option<HostCgroup>, CgroupError> {
    if !config.cgroup.enabled {
        log::info!("sandbox {id}: no host cgroup ([cgroup] enabled = false in the config)");
        return Ok(None);
    }
    let (spec, annotations) = (req.spec, req.annotations);
    let cgroups_path = spec
        .linux()
        .as_ref()
        .and_then(|l| l.cgroups_path().as_deref())
        .and_then(Path::to_str)
        .unwrap_or_default();
    if cgroups_path.is_empty() {
        log::info!(
            "sandbox {id}: no host cgroup (the spec names no linux.cgroupsPath, so there is no \
             pod cgroup to put it in); the shim stays in containerd's cgroup"
        );
        return Ok(None);
    }
    let defaults = Defaults {
        memory_bytes: config.cgroup.overhead_memory_mib.saturating_mul(1 << 20),
        cpu_millis: config.cgroup.overhead_cpu_millis,
        annotations_allowed: config.cgroup.overhead_annotations,
    };
    let cg = cgroup::setup(SetupRequest {
        sandbox_id: id,
        cgroups_path,
        annotations,
        containers: spec::containers_sum(annotations),
        typed_overhead: req.overhead,
        vm_memory_bytes: size.memory_mib.saturating_mul(1 << 20),
        vcpus: size.vcpus,
        defaults,
        record: &state.cgroup_record(),
    })?;
    log::info!("sandbox {id}: {}", cg.describe());
    Ok(Some(cg))
}

/// Step 10: the agent, reachable now that it reported ready, answers Check.
async fn connect_agent(
    socket: &Path,
) -> Result<(AgentClient, crate::agent::AgentInfo), AgentError> {
    let agent = AgentClient::connect(
        socket,
        agent_protocol::AGENT_VSOCK_PORT,
        AGENT_CONNECT_TIMEOUT,
    )
    .await?;
    let info = agent.check().await?;
    Ok((agent, info))
}

#[cfg(test)]
mod page_sharing_tests {
    use super::*;
    use crate::config::PageSharing;

    #[test]
    fn the_trust_domain_comes_from_the_config_and_the_namespace() {
        let mut config = Config::default();
        let ns = |n: &str| {
            HashMap::from([(devices::POD_NAMESPACE_ANNOTATION.to_string(), n.to_string())])
        };
        let domain = |c: &Config, a: &HashMap<String, String>| {
            page_sharing("p", c, a).map(|s| {
                assert!(!s.capture_kernel_text, "a pod never captures");
                assert_eq!(s.template_dir, c.page_templates_dir);
                s.domain
            })
        };
        // The default: per namespace; a pod without one shares with nobody.
        let shop = domain(&config, &ns("shop")).unwrap();
        assert_eq!(shop, vmm::page_sharing::namespace_domain("shop"));
        assert_ne!(shop, domain(&config, &ns("bank")).unwrap());
        assert_eq!(domain(&config, &HashMap::new()), None);
        assert_eq!(domain(&config, &ns("")), None);
        config.page_sharing = PageSharing::Node;
        assert_eq!(
            domain(&config, &ns("shop")).as_deref(),
            Some(vmm::page_sharing::NODE_DOMAIN)
        );
        assert_eq!(
            domain(&config, &HashMap::new()).as_deref(),
            Some(vmm::page_sharing::NODE_DOMAIN)
        );
        config.page_sharing = PageSharing::Off;
        assert_eq!(domain(&config, &ns("shop")), None);
    }
}
