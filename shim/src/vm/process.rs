//! The embedded VMM in a process of its own (`vmm_process = true` in the config, the
//! default): the shim's side of `vmm::jail::split` for a [`GuestSpec`], and the hidden
//! subcommand's entry point. The shim opens the kernel, the initrd and `/dev/kvm` and hands
//! them to the process as descriptors, as it does its taps and disk files: the process never
//! opens their paths. docs/security.md, "The VMM's confinement", says what the VMM process gets
//! and what it may do.

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::time::Duration;

use vmm::jail::split::{
    BlockDescription, HostFiles, NetDescription, PageSharingDescription, SharedFsDescription,
    VmDescription, VmmProcess, VsockDescription,
};

use super::console::CONSOLE_LOG_BYTES;
use super::error::GuestVmError;
use super::spec::{DiskBacking, GuestSpec, GUEST_CID};

/// How long the VMM process may take from its start to a running VM.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// `containerd-shim-microvm-v1 __vmm <fd>`: a pod's VMM process. Logs go to standard error,
/// which the shim gave its log (containerd's log fifo). Returns the exit code (a running VM
/// never returns: the process exits when the VM ends).
pub fn vmm_main(channel_fd: String) -> i32 {
    let _ = env_logger::Builder::new()
        .filter_level(log::LevelFilter::Info)
        .parse_env("RUST_LOG")
        .write_style(env_logger::WriteStyle::Never)
        .format_timestamp(None)
        .format_target(false)
        .try_init();
    vmm::jail::split::serve(&channel_fd)
}

/// The description of `spec`'s VM for a VMM process: the numbers of the descriptors the shim
/// holds, which the process inherits (the kernel, the initrd and /dev/kvm in `files`, the
/// taps, the disk files), and the paths in the VM's work folder (the console log, the vsock
/// socket), the share and the VFIO devices' sysfs paths, which the process opens itself.
pub fn describe(
    spec: &GuestSpec,
    files: &HostFiles,
    cmdline: String,
    console_log: &Path,
    uds: &Path,
) -> VmDescription {
    VmDescription {
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        kernel: files.kernel(),
        initrd: files.initrd(),
        kvm_fd: files.kvm_fd(),
        copy_boot_files: spec.boot_files == vmm::BootFiles::Copy,
        cmdline,
        console_log: console_log.to_path_buf(),
        console_log_bytes: CONSOLE_LOG_BYTES,
        work_dir: spec.work_dir.clone(),
        vsock: Some(VsockDescription {
            guest_cid: GUEST_CID,
            uds_path: uds.to_path_buf(),
        }),
        shared_fs: spec.shared.as_ref().map(|s| SharedFsDescription {
            tag: s.tag.clone(),
            host_dir: s.host_dir.clone(),
        }),
        nets: spec
            .nics
            .iter()
            .map(|n| NetDescription {
                fd: n.tap.as_fd().as_raw_fd(),
                mac: n.mac,
                mtu: Some(n.mtu),
            })
            .collect(),
        blocks: spec
            .disks
            .iter()
            .map(|d| BlockDescription {
                serial: d.serial.clone(),
                read_only: d.backing.read_only(),
                fd: match &d.backing {
                    DiskBacking::Empty { .. } => None,
                    DiskBacking::File { file, .. } => Some(file.as_raw_fd()),
                },
            })
            .collect(),
        vfio: spec.vfio.clone(),
        balloon: spec.wants_balloon().then_some(true),
        page_sharing: spec.page_sharing_config().map(|p| PageSharingDescription {
            template_dir: p.template_dir,
            domain: p.domain,
            capture_kernel_text: p.capture_kernel_text,
        }),
    }
}

/// The binary a VMM process runs: the shim's own running binary, through the kernel's link to
/// it, never its path on disk. A shim lives as long as its pod; when `microvm install` (or a
/// package upgrade) puts a new binary at that path meanwhile, a VMM started from the path would
/// be the new binary (whose end of the split's protocol may differ), and one started after an
/// uninstall would find no file at all (`current_exe` then names a path ending in "(deleted)").
/// `/proc/self/exe` is the file this process was started from, replaced or not.
const OWN_BINARY: &str = "/proc/self/exe";

/// What ps shows for a VMM process: the shim's own path (its `argv[0]` as the kernel resolved
/// it), so that it reads as this shim's child and the tests' leak checks find it by name.
/// (Without the " (deleted)" the kernel adds once the file at that path is gone.)
fn own_name() -> std::ffi::OsString {
    match std::env::current_exe() {
        Ok(path) => name_of(&path),
        Err(_) => OWN_BINARY.into(),
    }
}

/// `path` as the kernel gives it for a running binary, less the " (deleted)" it adds.
fn name_of(path: &Path) -> std::ffi::OsString {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let bytes = path.as_os_str().as_bytes();
    let kept = bytes.strip_suffix(b" (deleted)").unwrap_or(bytes);
    std::ffi::OsString::from_vec(kept.to_vec())
}

/// Starts `spec`'s VM in a VMM process of its own, from this binary (the running one:
/// [`OWN_BINARY`]). The shim opens the kernel, the initrd and /dev/kvm here, and closes its
/// copies once the process runs.
pub fn start(
    spec: &GuestSpec,
    cmdline: String,
    console_log: &Path,
    uds: &Path,
) -> Result<VmmProcess, GuestVmError> {
    let files = HostFiles::open(&spec.kernel, Some(&spec.initrd))?;
    let desc = describe(spec, &files, cmdline, console_log, uds);
    let vmm = VmmProcess::spawn_as(
        Path::new(OWN_BINARY),
        &own_name(),
        &desc,
        Some(vmm::jail::report_fd()),
        START_TIMEOUT,
    )
    .map_err(|e| GuestVmError::Process(e.to_string()));
    drop(files);
    vmm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_binary_is_named_by_its_path_alone() {
        let bin = "/usr/local/bin/containerd-shim-microvm-v1";
        assert_eq!(name_of(Path::new(bin)), bin);
        assert_eq!(name_of(Path::new(&format!("{bin} (deleted)"))), bin);
    }
}
