//! The shim's configuration: one typed struct with defaults in code, overridden by a small TOML
//! file (`ConfigPath` in the runtime options, else `/etc/microvm/config.toml`). Unknown keys are
//! errors, so a typo fails the pod with a message instead of being silently ignored.
//!
//! How a pod's VM is sized from it and the pod's annotations is `sandbox::spec::vm_size`. The
//! `[qemu]` table and its defaults are [`qemu`]'s; the config imports nothing of `vm`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub mod qemu;

pub use qemu::QemuSettings;

/// Where the config is read from when the runtime options name none.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/microvm/config.toml";

/// The most empty block slots a VM reserves (each is a virtio-mmio device with an IRQ line).
pub const MAX_BLOCK_SLOTS: usize = 8;

/// Which VM backend runs the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Hypervisor {
    /// The embedded VMM where `microvm check-host` says the guest kernel boots under this
    /// host's KVM; elsewhere the QEMU backend where QEMU can use KVM, or on software emulation
    /// (TCG) only with `allow_software_emulation`; else the pod fails with check-host's reason
    /// (`vm::choose_backend`; the default).
    #[default]
    Auto,
    /// The embedded VMM on /dev/kvm; a host that cannot boot the guest under it fails the pod
    /// at once with check-host's reason.
    Kvm,
    /// Debian's QEMU `-M microvm` with vhost-device-vsock, on KVM where QEMU can use it; on
    /// software emulation (TCG) only with `allow_software_emulation`.
    Qemu,
}

/// How the embedded VMM puts the kernel and initrd into guest RAM (`vmm::BootFiles`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BootFiles {
    /// Mapped from the files, copy-on-write: one copy in the host's page cache for all pods.
    #[default]
    Map,
    /// Copied into each VM's memory.
    Copy,
}

/// Between which pods the embedded VMM shares guest pages (docs/page-sharing.md). What is
/// shared is the same in each case: pages equal to public templates (the initrd's files, the
/// kernel text as a guest that saw no pod input patched it) are mapped from template files and
/// zero pages dropped, once the agent answered; never pages equal to what another pod holds.
/// Sharing a page lets pods time each other's use of it (Flush+Reload): the setting says whose
/// pods may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PageSharing {
    /// Only pods of the same Kubernetes namespace (the sandbox's
    /// `io.kubernetes.cri.sandbox-namespace`) map the same template files. A pod without a
    /// namespace shares with nobody.
    #[default]
    Namespace,
    /// Every pod of the node maps the same template files (`public` is the old name of this).
    #[serde(alias = "public")]
    Node,
    /// Nothing is shared.
    Off,
}

/// The shim's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The VM backend.
    pub hypervisor: Hypervisor,
    /// Whether a pod may run under QEMU's software emulation (TCG) where this host's KVM
    /// cannot run the guest. TCG is no security boundary (QEMU's own security policy), so it
    /// is never chosen without this; each pod that runs on it logs a warning.
    pub allow_software_emulation: bool,
    /// The guest kernel (uncompressed vmlinux).
    pub kernel: PathBuf,
    /// The initramfs with the agent as /init.
    pub initrd: PathBuf,
    /// Embedded VMM: the kernel and initrd mapped into guest RAM from their files (`map`, the
    /// default; replace the files by renaming, never in place) or copied (`copy`).
    pub boot_files: BootFiles,
    /// vCPUs of a pod that sets no CPU limit.
    pub default_vcpus: u8,
    /// The most vCPUs a pod's VM gets, whatever its limit says.
    pub max_vcpus: u8,
    /// Guest memory (MiB) of a pod that sets no memory limit.
    pub default_memory_mib: u64,
    /// What the guest kernel and agent need on top of the pod's memory limit (MiB).
    pub guest_base_memory_mib: u64,
    /// The most guest memory (MiB) a pod's VM gets.
    pub max_memory_mib: u64,
    /// The shim's log level (error, warn, info, debug, trace).
    pub log_level: String,
    /// QEMU backend settings.
    pub qemu: QemuSettings,
    /// The pod's host cgroup and its overhead (docs/overhead.md).
    pub cgroup: CgroupSettings,
    /// Device plugins' devices (docs/devices.md).
    pub devices: DevicesSettings,
    /// Whether each pod's VM gets a virtio-balloon on which the guest reports the memory it
    /// frees, so the host takes those pages back (docs/virtio-balloon.md). Pods with VFIO
    /// devices never get it.
    pub free_page_reporting: bool,
    /// Embedded VMM: share guest pages equal to public templates between pods of one
    /// namespace (`namespace`, the default), of the node (`node`), or not (`off`). Pods with
    /// VFIO devices never do.
    pub page_sharing: PageSharing,
    /// Where the page templates are kept (root-owned, 0700, a directory per trust domain;
    /// emptied by a host reboot).
    pub page_templates_dir: PathBuf,
    /// Embedded VMM: run each pod's VMM in a process of its own, jailed (new namespaces, an
    /// empty root, limits, capabilities, `no_new_privs`, a seccomp filter per thread), instead
    /// of as threads of the shim (docs/security.md, "The VMM's confinement"). On by default;
    /// `false` keeps the VMM in the shim (one process less, no process boundary).
    pub vmm_process: bool,
}

/// Settings of the pod's host cgroup (`[cgroup]`; `resources::cgroup`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CgroupSettings {
    /// Whether the shim makes `<pod cgroup>/microvm-<id>` and moves itself in (a pod whose
    /// spec has no `linux.cgroupsPath` gets none either way).
    pub enabled: bool,
    /// Memory overhead (MiB) when neither the pod's annotation nor its pod cgroup gives one.
    pub overhead_memory_mib: u64,
    /// CPU overhead (millicores) when neither the pod's annotation nor its pod cgroup gives one.
    pub overhead_cpu_millis: u64,
    /// Whether a pod may set its own overhead with the `microvm.io/overhead-memory` / `microvm.io/overhead-cpu`
    /// annotations (the allow-list; the pod cgroup still caps what it gets).
    pub overhead_annotations: bool,
}

impl Default for CgroupSettings {
    fn default() -> Self {
        CgroupSettings {
            enabled: true,
            // Measured: 128 MiB guest base + 9 MiB shim on the embedded VMM, plus a margin
            // (docs/overhead.md, `make bench`).
            overhead_memory_mib: 160,
            overhead_cpu_millis: 250,
            overhead_annotations: true,
        }
    }
}

/// Settings of the devices a pod gets from device plugins.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesSettings {
    /// kubelet's PodResources socket, asked at boot which devices the pod holds; a missing
    /// socket means nothing is cold-plugged.
    pub pod_resources_socket: PathBuf,
    /// Folders of CDI specs, in rising precedence.
    pub cdi_dirs: Vec<PathBuf>,
    /// Empty read-write virtio-blk slots each VM reserves for block devices a container brings
    /// that were not known at boot (0: no hot-plug). Embedded VMM only.
    pub block_slots: u8,
    /// Empty read-only slots, likewise.
    pub block_slots_read_only: u8,
}

impl Default for DevicesSettings {
    fn default() -> Self {
        DevicesSettings {
            pod_resources_socket: PathBuf::from(
                crate::resources::devices::podresources::DEFAULT_SOCKET,
            ),
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
            block_slots: 2,
            block_slots_read_only: 1,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            hypervisor: Hypervisor::default(),
            allow_software_emulation: false,
            kernel: PathBuf::from("/usr/share/microvm/vmlinux"),
            initrd: PathBuf::from("/usr/share/microvm/initrd.cpio"),
            boot_files: BootFiles::default(),
            default_vcpus: 1,
            max_vcpus: 16,
            default_memory_mib: 256,
            guest_base_memory_mib: 128,
            max_memory_mib: 64 * 1024,
            log_level: "info".to_string(),
            qemu: QemuSettings::default(),
            cgroup: CgroupSettings::default(),
            devices: DevicesSettings::default(),
            free_page_reporting: true,
            page_sharing: PageSharing::default(),
            page_templates_dir: PathBuf::from(vmm::page_sharing::DEFAULT_TEMPLATE_DIR),
            vmm_process: true,
        }
    }
}

/// Why the config could not be used. Each names the file and the cause: this is the message
/// a user reads in the failed pod's events.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("microvm config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not valid TOML for this config (unknown key, wrong type, ...).
    #[error("microvm config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A value is out of range or a named file is missing.
    #[error("microvm config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Config {
    /// Reads `path` (TOML) over the defaults and checks the result. A missing file at the
    /// default location means "all defaults"; a missing file that was named is an error.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let (path, named) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !named => String::new(),
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        let cfg = Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.clone(),
            message,
        })?;
        cfg.validate()
            .map_err(|message| ConfigError::Invalid { path, message })?;
        Ok(cfg)
    }

    /// Parses TOML text over the defaults (no file checks).
    pub fn parse(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.message().to_string())
    }

    /// Checks ranges and that the kernel and initrd exist.
    pub fn validate(&self) -> Result<(), String> {
        if self.default_vcpus == 0 || self.max_vcpus == 0 {
            return Err("default_vcpus and max_vcpus must be at least 1".to_string());
        }
        if self.default_vcpus > self.max_vcpus {
            return Err(format!(
                "default_vcpus ({}) is larger than max_vcpus ({})",
                self.default_vcpus, self.max_vcpus
            ));
        }
        if self.default_memory_mib < 64 || self.default_memory_mib > self.max_memory_mib {
            return Err(format!(
                "default_memory_mib must be between 64 and max_memory_mib ({}), got {}",
                self.max_memory_mib, self.default_memory_mib
            ));
        }
        if !matches!(
            self.log_level.as_str(),
            "error" | "warn" | "info" | "debug" | "trace"
        ) {
            return Err(format!("log_level {:?} is not a log level", self.log_level));
        }
        let slots =
            usize::from(self.devices.block_slots) + usize::from(self.devices.block_slots_read_only);
        if slots > MAX_BLOCK_SLOTS {
            return Err(format!(
                "devices.block_slots + devices.block_slots_read_only is {slots}, at most \
                 {MAX_BLOCK_SLOTS}"
            ));
        }
        if qemu::jail_id(self.qemu.jail_id_base).is_none() {
            return Err(format!(
                "qemu.jail_id_base {} must be at least 1 and leave room for {} ids below {}",
                self.qemu.jail_id_base,
                qemu::JAIL_ID_RANGE,
                u32::MAX
            ));
        }
        for (what, p) in [("kernel", &self.kernel), ("initrd", &self.initrd)] {
            if let Err(e) = std::fs::metadata(p) {
                return Err(format!("{what} {}: {e}", p.display()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = Config::parse("").unwrap();
        assert_eq!(c, Config::default());
        let c = Config::parse(
            "hypervisor = \"qemu\"\ndefault_vcpus = 2\n[qemu]\nbinary = \"/opt/qemu\"\n",
        )
        .unwrap();
        assert_eq!(c.hypervisor, Hypervisor::Qemu);
        assert_eq!(c.default_vcpus, 2);
        assert_eq!(c.qemu.binary, PathBuf::from("/opt/qemu"));
        assert_eq!(c.default_memory_mib, 256);
        assert!(c.free_page_reporting, "on by default");
        let c = Config::parse("free_page_reporting = false\n").unwrap();
        assert!(!c.free_page_reporting);
    }

    #[test]
    fn page_sharing_is_per_namespace_unless_set() {
        let c = Config::default();
        assert_eq!(c.page_sharing, PageSharing::Namespace);
        assert_eq!(
            c.page_templates_dir,
            PathBuf::from("/run/microvm-page-templates")
        );
        let c = Config::parse("page_sharing = \"off\"\npage_templates_dir = \"/x\"\n").unwrap();
        assert_eq!(c.page_sharing, PageSharing::Off);
        assert_eq!(c.page_templates_dir, PathBuf::from("/x"));
        assert!(Config::parse("page_sharing = \"all\"\n").is_err());
        for (text, want) in [
            ("node", PageSharing::Node),
            ("public", PageSharing::Node),
            ("namespace", PageSharing::Namespace),
        ] {
            let c = Config::parse(&format!("page_sharing = \"{text}\"\n")).unwrap();
            assert_eq!(c.page_sharing, want, "{text}");
        }
        let c = Config::parse("[cgroup]\nenabled = false\noverhead_memory_mib = 64\n").unwrap();
        assert!(!c.cgroup.enabled);
        assert_eq!(c.cgroup.overhead_memory_mib, 64);
        assert_eq!(c.cgroup.overhead_cpu_millis, 250);
        assert!(Config::parse("[cgroup]\noverhead = 1\n").is_err());
        let c = Config::parse("[devices]\nblock_slots = 0\ncdi_dirs = [\"/x\"]\n").unwrap();
        assert_eq!(c.devices.block_slots, 0);
        assert_eq!(c.devices.block_slots_read_only, 1);
        assert_eq!(c.devices.cdi_dirs, vec![PathBuf::from("/x")]);
        assert!(Config::parse("[devices]\nslots = 1\n").is_err());
    }

    #[test]
    fn hypervisor_is_auto_unless_named() {
        assert_eq!(Config::default().hypervisor, Hypervisor::Auto);
        assert_eq!(Config::parse("").unwrap().hypervisor, Hypervisor::Auto);
        for (text, want) in [
            ("auto", Hypervisor::Auto),
            ("kvm", Hypervisor::Kvm),
            ("qemu", Hypervisor::Qemu),
        ] {
            let c = Config::parse(&format!("hypervisor = \"{text}\"\n")).unwrap();
            assert_eq!(c.hypervisor, want, "{text}");
        }
        assert!(Config::parse("hypervisor = \"Auto\"\n").is_err());
    }

    #[test]
    fn jail_id_base_is_checked() {
        assert_eq!(Config::default().qemu.jail_id_base, 2_000_000_000);
        let c = Config::parse("[qemu]\njail_id_base = 300000000\n").unwrap();
        assert_eq!(c.qemu.jail_id_base, 300_000_000);
        for bad in [0, u32::MAX - 10] {
            let c = Config::parse(&format!("[qemu]\njail_id_base = {bad}\n")).unwrap();
            let e = c.validate().unwrap_err();
            assert!(e.contains("jail_id_base"), "{e}");
        }
        assert!(Config::parse("[qemu]\njail_id_base = -1\n").is_err());
    }

    #[test]
    fn software_emulation_needs_the_opt_in() {
        assert!(!Config::default().allow_software_emulation);
        let c = Config::parse("allow_software_emulation = true\n").unwrap();
        assert!(c.allow_software_emulation);
        assert!(Config::parse("allow_software_emulation = \"yes\"\n").is_err());
    }

    #[test]
    fn boot_files_are_mapped_unless_copy_is_named() {
        assert_eq!(Config::default().boot_files, BootFiles::Map);
        let c = Config::parse("boot_files = \"copy\"\n").unwrap();
        assert_eq!(c.boot_files, BootFiles::Copy);
        assert_eq!(
            Config::parse("boot_files = \"map\"\n").unwrap().boot_files,
            BootFiles::Map
        );
        assert!(Config::parse("boot_files = \"mmap\"\n").is_err());
    }

    #[test]
    fn unknown_keys_and_bad_types_are_errors() {
        let e = Config::parse("kernal = \"/x\"\n").unwrap_err();
        assert!(e.contains("kernal"), "{e}");
        let e = Config::parse("[qemu]\nbinarie = \"/x\"\n").unwrap_err();
        assert!(e.contains("binarie"), "{e}");
        assert!(Config::parse("default_vcpus = \"two\"\n").is_err());
        assert!(Config::parse("hypervisor = \"xen\"\n").is_err());
    }

    #[test]
    fn load_names_the_file_and_the_cause() {
        let dir = std::env::temp_dir().join(format!("microvm-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("config.toml");
        std::fs::write(&f, "kernel = \"/nonexistent/vmlinux\"\n").unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains(&f.display().to_string()), "{e}");
        assert!(e.contains("/nonexistent/vmlinux"), "{e}");
        std::fs::write(&f, "bogus = 1\n").unwrap();
        let e = Config::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = Config::load(Some(&dir.join("missing.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.toml"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
