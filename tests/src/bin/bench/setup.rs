//! What the pod, network and density parts share: the `microvm` handler's backend (check-host's
//! choice or `BENCH_HYPERVISOR`) and accelerator, its shim config, and a private containerd with
//! the `runc` and `microvm` handlers.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use microvm_tests::containerd::{ContainerdOptions, PrivateContainerd};
use microvm_tests::cri::CriClient;
use microvm_tests::images::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use microvm_tests::lifecycle::{choose_vm_backend, write_shim_config, VmBackend};

use crate::paths::bin_dir;

/// An error of a step, followed by the last lines of containerd's log (where the shim logs).
pub(crate) fn with_log(
    ctrd: &PrivateContainerd,
    what: &str,
    e: impl std::fmt::Display,
) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: {e}\n--- the last lines of containerd's log ---\n{}",
        ctrd.log_tail()
    )
}
/// How the `microvm` handler's VMs run in this benchmark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodBackend {
    /// The shim config's `hypervisor`: `kvm` (the embedded VMM) or `qemu`.
    pub(crate) hypervisor: &'static str,
    /// Why: check-host's verdict, or the BENCH_HYPERVISOR override.
    pub(crate) why: String,
}

impl PodBackend {
    pub(crate) fn embedded(&self) -> bool {
        self.hypervisor == "kvm"
    }

    /// The name on the report lines.
    pub(crate) fn label(&self) -> &'static str {
        if self.embedded() {
            "embedded"
        } else {
            "qemu"
        }
    }
}

/// The backend: check-host's choice (`exit 0`: the embedded VMM, `2`: QEMU), unless
/// `BENCH_HYPERVISOR` (`kvm` or `qemu`) forces one; forcing `kvm` where check-host says our guest
/// cannot boot under the embedded VMM is an error with check-host's report.
fn pick_backend(check: &VmBackend, forced: Option<&str>) -> Result<PodBackend> {
    let verdict = format!("check-host: {}", check.reason);
    match forced.unwrap_or("") {
        "" | "auto" => Ok(PodBackend {
            hypervisor: check.hypervisor,
            why: verdict,
        }),
        "kvm" if check.hypervisor == "kvm" => Ok(PodBackend {
            hypervisor: "kvm",
            why: format!("BENCH_HYPERVISOR=kvm; {verdict}"),
        }),
        "kvm" => bail!(
            "BENCH_HYPERVISOR=kvm, but the embedded VMM cannot boot our guest here \
             ({verdict}); check-host's report:\n{}",
            check.report.trim_end()
        ),
        "qemu" => Ok(PodBackend {
            hypervisor: "qemu",
            why: format!("BENCH_HYPERVISOR=qemu; {verdict}"),
        }),
        other => bail!("BENCH_HYPERVISOR={other:?}: expected kvm, qemu or auto"),
    }
}

/// The accelerator of the embedded VMM, from check-host's KVM kind (`kvm_kind` of
/// `check-host --json`): `kvm` on hardware virtualization, `nested-kvm` on VMX/SVM from an outer
/// hypervisor, `nested-svm-tcg` on SVM emulated by QEMU's TCG (the nested lane, docs/nested-lane.md),
/// `kvm-pvm` on kvm-pvm (JSON `pvm`), and the kind itself for any other.
fn embedded_accel(kvm_kind: &str) -> String {
    match kvm_kind {
        "hardware" => "kvm".to_string(),
        "nested" => "nested-kvm".to_string(),
        "svm-emulated-by-qemu-tcg" => "nested-svm-tcg".to_string(),
        "pvm" | "kvm-pvm" => "kvm-pvm".to_string(),
        other => other.to_string(),
    }
}

/// `kvm_kind` of `<microvm> check-host --json --kernel <kernel>`.
fn check_host_kvm_kind(microvm: &Path, kernel: &Path) -> Result<String> {
    let out = Command::new(microvm)
        .args(["check-host", "--json", "--kernel"])
        .arg(kernel)
        .output()
        .with_context(|| format!("running {} check-host --json", microvm.display()))?;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "check-host --json (exit {}) printed no JSON: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    report["kvm_kind"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("check-host --json has no kvm_kind: {report}"))
}

/// What the pod and network parts share: the backend of the `microvm` handler, its shim config
/// and a private containerd with both handlers, the images imported.
pub(crate) struct PodSetup {
    pub(crate) backend: PodBackend,
    /// On the embedded VMM, its accelerator from check-host (QEMU's is read from each pod's QEMU
    /// command line).
    pub(crate) embedded_accel: Option<String>,
    /// The VM size the shim gives a pod without limits (ours set none).
    pub(crate) vm_size: shim::sandbox::spec::VmSize,
    /// The shim's `guest_base_memory_mib`: what a VM holds beyond its containers' limits.
    pub(crate) guest_base_mib: u64,
    /// The shim's `boot_files` (`BENCH_BOOT_FILES`).
    pub(crate) boot_files: shim::config::BootFiles,
    /// The shim's `free_page_reporting` (the balloon, docs/virtio-balloon.md).
    pub(crate) free_page_reporting: bool,
    /// The shim's `page_sharing` (`BENCH_PAGE_SHARING`, docs/page-sharing.md).
    pub(crate) page_sharing: shim::config::PageSharing,
    // Fields drop in order: the CRI client before its containerd.
    pub(crate) cri: CriClient,
    pub(crate) ctrd: PrivateContainerd,
    /// Holds the shim config for the life of the containerd.
    pub(crate) config_dir: tempfile::TempDir,
}

impl PodSetup {
    /// Picks the backend (check-host's choice, or `BENCH_HYPERVISOR`), writes the shim config
    /// and starts the private containerd (the default CNI bridge).
    pub(crate) async fn start() -> Result<PodSetup> {
        let bin_dir = bin_dir()?;
        let microvm = bin_dir.join("microvm");
        // `MICROVM_KERNEL` / `MICROVM_INITRD` as for the tests, else the repo's build/.
        let kernel = shim::artifacts::default_kernel();
        let initrd = shim::artifacts::default_initrd();
        for p in [
            &microvm,
            &bin_dir.join("containerd-shim-microvm-v1"),
            &kernel,
            &initrd,
        ] {
            if !p.exists() {
                bail!("{} is missing: make build kernel initrd", p.display());
            }
        }
        let check = choose_vm_backend(&microvm, &kernel)?;
        let backend = pick_backend(&check, std::env::var("BENCH_HYPERVISOR").ok().as_deref())?;
        let embedded_accel = if backend.embedded() {
            Some(embedded_accel(&check_host_kvm_kind(&microvm, &kernel)?))
        } else {
            None
        };
        let config_dir = tempfile::tempdir().context("temp dir for the shim config")?;
        let config = write_shim_config(
            config_dir.path(),
            backend.hypervisor,
            &kernel,
            &initrd,
            "info",
        )?;
        // `BENCH_BOOT_FILES=copy|map`: the shim's `boot_files` (docs/density.md), to measure
        // the embedded VMM's copied boot files against the mapped ones (the default).
        if let Ok(how) = std::env::var("BENCH_BOOT_FILES") {
            if how != "map" && how != "copy" {
                bail!("BENCH_BOOT_FILES={how:?}: expected map or copy");
            }
            let mut text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            text.insert_str(0, &format!("boot_files = \"{how}\"\n"));
            std::fs::write(&config, text)
                .with_context(|| format!("writing {}", config.display()))?;
        }
        // `BENCH_PAGE_SHARING=namespace|node|off`: the shim's `page_sharing`
        // (docs/page-sharing.md; `public` is the old name of `node`).
        if let Ok(how) = std::env::var("BENCH_PAGE_SHARING") {
            if !["namespace", "node", "public", "off"].contains(&how.as_str()) {
                bail!("BENCH_PAGE_SHARING={how:?}: expected namespace, node or off");
            }
            let mut text = std::fs::read_to_string(&config).context("reading the shim config")?;
            text.insert_str(0, &format!("page_sharing = \"{how}\"\n"));
            std::fs::write(&config, text).context("writing the shim config")?;
        }
        if std::env::var("BENCH_FREE_PAGE_REPORTING").as_deref() == Ok("0") {
            let mut text = std::fs::read_to_string(&config).context("reading the shim config")?;
            text.insert_str(0, "free_page_reporting = false\n");
            std::fs::write(&config, text).context("writing the shim config")?;
        }
        let shim_config = shim::config::Config::load(Some(&config))
            .with_context(|| format!("reading back the shim config {}", config.display()))?;
        let vm_size = shim::sandbox::spec::vm_size(&shim_config, &HashMap::new())
            .map_err(|e| anyhow::anyhow!("the VM size of a pod without limits: {e}"))?;
        let ctrd = PrivateContainerd::start(ContainerdOptions {
            extra_path: vec![bin_dir],
            microvm_config: Some(config),
            ..ContainerdOptions::default()
        })
        .context("starting the private containerd")?;
        let cri = CriClient::connect(ctrd.socket(), Duration::from_secs(120))
            .await
            .map_err(|e| with_log(&ctrd, "CRI", e))?;
        cri.wait_ready(&[PAUSE_IMAGE, BUSYBOX_IMAGE], Duration::from_secs(30))
            .await
            .map_err(|e| with_log(&ctrd, "CRI not ready", e))?;
        Ok(PodSetup {
            backend,
            embedded_accel,
            vm_size,
            guest_base_mib: shim_config.guest_base_memory_mib,
            boot_files: shim_config.boot_files,
            free_page_reporting: shim_config.free_page_reporting,
            page_sharing: shim_config.page_sharing,
            cri,
            ctrd,
            config_dir,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(hypervisor: &'static str) -> VmBackend {
        VmBackend {
            hypervisor,
            reason: "linux guests boot under the embedded vmm".into(),
            report: "kvm: hardware (...)\nverdict: ...".into(),
        }
    }

    #[test]
    fn the_backend_follows_check_host_unless_forced() {
        assert_eq!(pick_backend(&check("kvm"), None).unwrap().hypervisor, "kvm");
        assert_eq!(
            pick_backend(&check("qemu"), Some("")).unwrap().label(),
            "qemu"
        );
        assert_eq!(
            pick_backend(&check("kvm"), Some("qemu"))
                .unwrap()
                .hypervisor,
            "qemu"
        );
        let forced = pick_backend(&check("kvm"), Some("kvm")).unwrap();
        assert_eq!((forced.hypervisor, forced.label()), ("kvm", "embedded"));
        let e = pick_backend(&check("qemu"), Some("kvm"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot boot") && e.contains("kvm: hardware"),
            "{e}"
        );
        assert!(pick_backend(&check("kvm"), Some("firecracker")).is_err());
    }

    #[test]
    fn the_embedded_accelerator_follows_the_kvm_kind() {
        assert_eq!(embedded_accel("hardware"), "kvm");
        assert_eq!(embedded_accel("svm-emulated-by-qemu-tcg"), "nested-svm-tcg");
        assert_eq!(embedded_accel("nested"), "nested-kvm");
        assert_eq!(embedded_accel("pvm"), "kvm-pvm");
        assert_eq!(embedded_accel("unknown"), "unknown");
    }
}
