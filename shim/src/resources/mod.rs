//! The host resources a pod's VM uses, one module each; each records its undo in the pod's state
//! directory ([`crate::state`]) before it acts, so a cleanup after a crash finds it.
//!
//! - [`storage`]: container rootfs and volume sources in the pod's shared folder (virtio-fs).
//! - [`network`]: the pod network's host side (a tap per CNI interface, tc redirects both ways,
//!   in the pod netns), recorded in `network.json`.
//! - [`cgroup`]: the pod's host cgroup `<pod cgroup>/microvm-<id>` holding the shim and its
//!   helpers, limited to the VM's size plus the overhead, recorded in `cgroup.json`.
//! - [`devices`]: device plugins' devices (cold-plugged from kubelet's PodResources API, block
//!   devices hot-plugged into reserved slots), recorded in `devices.json`.

pub mod cgroup;
pub mod devices;
pub mod network;
pub mod storage;
