//! What this host's KVM offers the VMM: its API version, how many vCPUs a VM may have, and which
//! of the capabilities the VMM relies on it lacks. `microvm check-host` and the shim's backend
//! choice read this instead of opening /dev/kvm themselves.

use kvm_ioctls::{Cap, Kvm};

use crate::VmmError;

/// The KVM capabilities the VMM relies on, with their names for messages.
pub const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
    (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
    (Cap::Pit2, "KVM_CAP_PIT2"),
    (Cap::Irqfd, "KVM_CAP_IRQFD"),
    (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
    (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
    (Cap::MpState, "KVM_CAP_MP_STATE"),
];

/// The answer of [`probe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvmCapabilities {
    /// KVM_GET_API_VERSION.
    pub api_version: i32,
    /// The vCPUs per VM KVM recommends.
    pub max_vcpus: usize,
    /// Required capabilities this KVM lacks, by name.
    pub missing: Vec<&'static str>,
}

/// Opens /dev/kvm and reads its API version, vCPU limit and missing capabilities.
pub fn probe() -> Result<KvmCapabilities, VmmError> {
    let kvm = Kvm::new().map_err(VmmError::kvm("open /dev/kvm"))?;
    Ok(KvmCapabilities {
        api_version: kvm.get_api_version(),
        max_vcpus: kvm.get_nr_vcpus(),
        missing: REQUIRED_CAPS
            .iter()
            .filter(|(cap, _)| !kvm.check_extension(*cap))
            .map(|(_, name)| *name)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_answers_or_names_the_device() {
        match probe() {
            // /dev/kvm here (plain KVM or kvm-pvm) has every capability the VMM needs.
            Ok(caps) => {
                assert_eq!(
                    caps.api_version, 12,
                    "KVM_API_VERSION is 12 since Linux 2.6.22"
                );
                assert!(caps.max_vcpus >= 1);
                assert!(caps.missing.is_empty(), "{:?}", caps.missing);
            }
            Err(e) => assert!(e.to_string().starts_with("open /dev/kvm failed"), "{e}"),
        }
    }
}
