//! A container's cgroup as the shim sees it: its processes, its figures, and updates of its
//! resources (which keep the container's own device rules).

use std::path::PathBuf;

use oci_spec::runtime::LinuxResources;

use super::cgroup::{cgroup_dir, read_stats, Stats, CGROUP_PARENT};
use super::error::{io_err, ContainerError};
use super::table::Containers;

impl Containers {
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
}
