//! Which backend runs a pod's guest: [`Backend`], and the one rule ([`choose_backend`]) that
//! turns `microvm check-host`'s answer (`host_check::HostReport`) and the config's `hypervisor`
//! into a [`BackendChoice`] (the backend and, for QEMU, its accelerator) or a
//! [`BackendRefusal`], for the shim, `microvm boot --backend` and `microvm install`.
//!
//! [`choose_pod_backend`] is a pod's step 1: the host probed once, off the async threads, and
//! the choice logged; the accelerator in it is what the QEMU backend runs with
//! (`QemuPrograms::accel`), so nothing probes the host again for that boot.

use std::fmt;

use crate::config::{Config, Hypervisor};
use crate::host_check::{self, HostReport, KvmKind};

use super::qemu::Accel;

/// Which VM backend runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The VMM embedded in this process, on /dev/kvm.
    Kvm,
    /// Debian's QEMU (`-M microvm`) with vhost-device-vsock; KVM if it can, else TCG.
    Qemu,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Kvm => "kvm",
            Backend::Qemu => "qemu",
        })
    }
}

/// Which VM backend runs Linux guests on this host for the config's `hypervisor` (or
/// `microvm boot --backend`), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend chosen.
    pub backend: Backend,
    /// QEMU's accelerator when `backend` is QEMU ([`qemu_accel_for`] this host's KVM); `None`
    /// for the embedded VMM.
    pub qemu_accel: Option<Accel>,
    /// Why: the KVM kind when the embedded VMM can boot the guest, else check-host's blocker.
    pub reason: String,
}

impl BackendChoice {
    /// Whether the guest runs under QEMU's software emulation (TCG).
    pub fn software_emulation(&self) -> bool {
        self.qemu_accel == Some(Accel::Tcg)
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backend = match self.qemu_accel {
            None => "embedded VMM",
            Some(Accel::Tcg) => "QEMU backend on software emulation (TCG)",
            Some(Accel::Kvm) => "QEMU backend on KVM",
        };
        write!(f, "{backend} ({})", self.reason)
    }
}

/// Why no backend may run the guest here as configured: the message a pod's user reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendRefusal {
    /// `hypervisor = "kvm"` where the embedded VMM cannot boot the guest.
    #[error(
        "this host cannot boot the guest under KVM: {0} (hypervisor = \"qemu\" in the config \
         runs it under QEMU)"
    )]
    KvmUnusable(String),
    /// The only way left is QEMU's software emulation, and the config does not allow it.
    #[error(
        "{why}; QEMU would run the guest under software emulation (TCG), which is no security \
         boundary: set allow_software_emulation = true in the microvm config to run pods on it \
         anyway (docs/qemu-backend.md)"
    )]
    SoftwareEmulation {
        /// check-host's reason why the guest cannot run on hardware virtualization here.
        why: String,
    },
}

/// QEMU's accelerator on a host with this kind of KVM: KVM where it rests on VMX/SVM (on bare
/// metal, nested, or SVM emulated by QEMU's TCG one level down), TCG otherwise: kvm-pvm cannot
/// boot a stock Linux guest.
pub fn qemu_accel_for(kind: KvmKind) -> Accel {
    match kind {
        KvmKind::Hardware | KvmKind::Nested | KvmKind::SvmEmulatedByQemuTcg => Accel::Kvm,
        KvmKind::Pvm | KvmKind::Unknown | KvmKind::None => Accel::Tcg,
    }
}

/// The one rule that turns check-host's answer and the config into a backend:
/// - `kvm`: the embedded VMM, or [`BackendRefusal::KvmUnusable`] with check-host's blocker.
/// - `auto`: the embedded VMM wherever check-host says Linux guests boot under it
///   ([`HostReport::linux_guest_bootable`]); else the QEMU backend where QEMU can use KVM; else
///   QEMU on software emulation only when `allow_software_emulation`, or
///   [`BackendRefusal::SoftwareEmulation`] with check-host's blocker.
/// - `qemu`: the QEMU backend on KVM where it can use it; on TCG only when
///   `allow_software_emulation`, else [`BackendRefusal::SoftwareEmulation`].
pub fn choose_backend(
    report: &HostReport,
    hypervisor: Hypervisor,
    allow_software_emulation: bool,
) -> Result<BackendChoice, BackendRefusal> {
    let blocker = report.linux_guest_blocker();
    let accel = qemu_accel_for(report.kvm_kind);
    let qemu_why = || {
        format!(
            "QEMU cannot use this host's KVM ({}: {})",
            report.kvm_kind,
            report.kvm_kind.description()
        )
    };
    let qemu = |reason: String| -> Result<BackendChoice, BackendRefusal> {
        if accel == Accel::Tcg && !allow_software_emulation {
            return Err(BackendRefusal::SoftwareEmulation { why: reason });
        }
        Ok(BackendChoice {
            backend: Backend::Qemu,
            qemu_accel: Some(accel),
            reason,
        })
    };
    match (hypervisor, blocker) {
        (Hypervisor::Kvm | Hypervisor::Auto, None) => Ok(BackendChoice {
            backend: Backend::Kvm,
            qemu_accel: None,
            reason: format!("kvm: {}, guest kernel can boot", report.kvm_kind),
        }),
        (Hypervisor::Kvm, Some(why)) => Err(BackendRefusal::KvmUnusable(why)),
        (Hypervisor::Auto, Some(why)) => qemu(why),
        (Hypervisor::Qemu, _) => qemu(if accel == Accel::Tcg {
            qemu_why()
        } else {
            format!("hypervisor = \"qemu\", kvm: {}", report.kvm_kind)
        }),
    }
}

/// Why a pod gets no backend.
#[derive(Debug, thiserror::Error)]
pub enum PodBackendError {
    /// The config's `hypervisor` cannot run the guest here.
    #[error(transparent)]
    Refused(#[from] BackendRefusal),
    /// The host probe did not finish (it panicked, or the runtime is shutting down).
    #[error("probing the host for the pod's backend failed: {0}")]
    Probe(#[source] tokio::task::JoinError),
}

/// Step 1 of pod `id`'s boot: the config's hypervisor on this host. The host is probed once
/// (`host_check::probe` on the config's kernel), on a blocking thread: it opens /dev/kvm and may
/// read the whole kernel. The choice carries the backend and, for QEMU, its accelerator.
/// Software emulation is logged at warn, once per pod.
pub async fn choose_pod_backend(
    id: &str,
    config: &Config,
) -> Result<BackendChoice, PodBackendError> {
    let kernel = config.kernel.clone();
    let report = tokio::task::spawn_blocking(move || host_check::probe(Some(&kernel)))
        .await
        .map_err(PodBackendError::Probe)?;
    let choice = choose_backend(&report, config.hypervisor, config.allow_software_emulation)?;
    let name = match config.hypervisor {
        Hypervisor::Auto => "auto",
        Hypervisor::Kvm => "kvm",
        Hypervisor::Qemu => "qemu",
    };
    if choice.software_emulation() {
        log::warn!(
            "sandbox {id}: hypervisor {name} -> {choice}: the guest runs under software \
             emulation, which is no security boundary (allowed by allow_software_emulation)"
        );
    } else {
        log::info!("sandbox {id}: hypervisor {name} -> {choice}");
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_check::KernelReport;

    fn report(kind: KvmKind, missing_caps: Vec<&'static str>, kernel: Option<bool>) -> HostReport {
        HostReport {
            kvm_kind: kind,
            kvm_reason: "why".into(),
            api_version: Some(12),
            missing_caps,
            max_vcpus: Some(4),
            kernel: kernel.map(|bootable| KernelReport {
                path: "/k".into(),
                pvm_guest: Some(false),
                bootable,
                reason: if bootable {
                    "boots".into()
                } else {
                    "this host's KVM is kvm-pvm, which boots only PVM kernels".into()
                },
            }),
        }
    }

    #[test]
    fn auto_chooses_the_embedded_vmm_only_where_the_guest_boots() {
        for kind in [
            KvmKind::Hardware,
            KvmKind::Nested,
            KvmKind::SvmEmulatedByQemuTcg,
            KvmKind::Unknown,
        ] {
            let r = report(kind, vec![], Some(true));
            assert!(r.linux_guest_bootable());
            for allow in [false, true] {
                let c = choose_backend(&r, Hypervisor::Auto, allow).unwrap();
                assert_eq!(c.backend, Backend::Kvm, "{kind}");
                assert_eq!(c.qemu_accel, None);
                assert_eq!(c.reason, format!("kvm: {kind}, guest kernel can boot"));
            }
        }
        assert_eq!(
            choose_backend(
                &report(KvmKind::Hardware, vec![], Some(true)),
                Hypervisor::Auto,
                false
            )
            .unwrap()
            .to_string(),
            "embedded VMM (kvm: hardware, guest kernel can boot)"
        );
    }

    #[test]
    fn auto_refuses_software_emulation_without_the_opt_in() {
        let pvm = report(KvmKind::Pvm, vec![], Some(false));
        let e = choose_backend(&pvm, Hypervisor::Auto, false).unwrap_err();
        assert_eq!(
            e,
            BackendRefusal::SoftwareEmulation {
                why: "this host's KVM is kvm-pvm, which boots only PVM kernels".into()
            }
        );
        let msg = e.to_string();
        assert!(msg.starts_with("this host's KVM is kvm-pvm, which boots only PVM kernels; "));
        assert!(msg.contains("allow_software_emulation = true"), "{msg}");
        let c = choose_backend(&pvm, Hypervisor::Auto, true).unwrap();
        assert_eq!(c.backend, Backend::Qemu);
        assert_eq!(c.qemu_accel, Some(Accel::Tcg));
        assert!(c.software_emulation());
        assert_eq!(
            c.to_string(),
            "QEMU backend on software emulation (TCG) (this host's KVM is kvm-pvm, which boots \
             only PVM kernels)"
        );
        let none = report(KvmKind::None, vec![], Some(false));
        assert_eq!(
            choose_backend(&none, Hypervisor::Auto, false),
            Err(BackendRefusal::SoftwareEmulation {
                why: "no usable KVM: why".into()
            })
        );
        assert_eq!(
            choose_backend(&none, Hypervisor::Auto, true)
                .unwrap()
                .reason,
            "no usable KVM: why"
        );
        // Hardware KVM the embedded VMM cannot use: QEMU runs on KVM, no opt-in needed.
        for r in [
            report(KvmKind::Hardware, vec!["KVM_CAP_IRQFD"], Some(true)),
            report(KvmKind::Nested, vec![], None),
        ] {
            let c = choose_backend(&r, Hypervisor::Auto, false).unwrap();
            assert_eq!(c.backend, Backend::Qemu);
            assert_eq!(c.qemu_accel, Some(Accel::Kvm));
            assert!(!c.software_emulation());
            assert_eq!(Some(c.reason), r.linux_guest_blocker());
        }
    }

    #[test]
    fn kvm_is_refused_with_check_hosts_reason() {
        let pvm = report(KvmKind::Pvm, vec![], Some(false));
        for allow in [false, true] {
            assert_eq!(
                choose_backend(&pvm, Hypervisor::Kvm, allow),
                Err(BackendRefusal::KvmUnusable(
                    "this host's KVM is kvm-pvm, which boots only PVM kernels".into()
                ))
            );
        }
        let hw = report(KvmKind::Hardware, vec![], Some(true));
        let c = choose_backend(&hw, Hypervisor::Kvm, false).unwrap();
        assert_eq!((c.backend, c.qemu_accel), (Backend::Kvm, None));
    }

    #[test]
    fn qemu_on_tcg_needs_the_opt_in_and_on_kvm_does_not() {
        for kind in [KvmKind::Pvm, KvmKind::Unknown, KvmKind::None] {
            let r = report(kind, vec![], Some(kind != KvmKind::Pvm));
            let e = choose_backend(&r, Hypervisor::Qemu, false).unwrap_err();
            let BackendRefusal::SoftwareEmulation { why } = &e else {
                panic!("{kind}: {e}");
            };
            assert!(
                why.starts_with(&format!("QEMU cannot use this host's KVM ({kind}: ")),
                "{why}"
            );
            let c = choose_backend(&r, Hypervisor::Qemu, true).unwrap();
            assert_eq!((c.backend, c.qemu_accel), (Backend::Qemu, Some(Accel::Tcg)));
        }
        for kind in [
            KvmKind::Hardware,
            KvmKind::Nested,
            KvmKind::SvmEmulatedByQemuTcg,
        ] {
            let c =
                choose_backend(&report(kind, vec![], Some(true)), Hypervisor::Qemu, false).unwrap();
            assert_eq!((c.backend, c.qemu_accel), (Backend::Qemu, Some(Accel::Kvm)));
            assert_eq!(
                c.to_string(),
                format!("QEMU backend on KVM (hypervisor = \"qemu\", kvm: {kind})")
            );
        }
    }

    #[test]
    fn auto_accel_is_kvm_only_on_real_or_emulated_vmx_svm() {
        for (kind, want) in [
            (KvmKind::Hardware, Accel::Kvm),
            (KvmKind::Nested, Accel::Kvm),
            (KvmKind::SvmEmulatedByQemuTcg, Accel::Kvm),
            (KvmKind::Pvm, Accel::Tcg),
            (KvmKind::Unknown, Accel::Tcg),
            (KvmKind::None, Accel::Tcg),
        ] {
            assert_eq!(qemu_accel_for(kind), want, "{kind}");
        }
    }
}
