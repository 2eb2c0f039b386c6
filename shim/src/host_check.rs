//! What this host can run: KVM present and which kind, the KVM capabilities the embedded VMM
//! needs, and whether a given guest kernel can boot under this host's KVM.
//!
//! The answer matters because some hosts expose a `/dev/kvm` that cannot boot a stock Linux
//! guest: kvm-pvm (a software nested hypervisor) runs guest code but only boots guest kernels
//! built with PVM guest support. There the product fails fast with the reason instead of hanging
//! in a guest that never comes up, or runs the guest under QEMU's software emulation where the
//! operator allowed it (`allow_software_emulation`). This module only probes the host and
//! reports what it found; it knows nothing of the config or the VM backends: `vm::backend` is
//! the one place that turns this answer and the config into a backend, for the shim,
//! `microvm boot --backend` and `microvm install`.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

/// The kind of KVM this host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvmKind {
    /// Hardware virtualization (Intel VMX or AMD SVM) behind kvm_intel / kvm_amd, on bare metal:
    /// the CPU has no `hypervisor` flag.
    Hardware,
    /// VMX/SVM offered by the hypervisor this host itself runs under (nested virtualization,
    /// e.g. a cloud VM with nested virtualization turned on): the CPU has the `hypervisor` flag.
    Nested,
    /// AMD SVM emulated in software by QEMU's TCG: this host is a VM of `qemu-system-x86_64
    /// -accel tcg -cpu max` (the nested lane, docs/nested-lane.md). Boots stock Linux guests, with
    /// every guest instruction emulated.
    SvmEmulatedByQemuTcg,
    /// kvm-pvm: the Pagetable-based Virtual Machine, a software nested hypervisor.
    Pvm,
    /// A `/dev/kvm` of a kind not recognised (it may work; nothing is promised).
    Unknown,
    /// No usable `/dev/kvm`.
    None,
}

impl KvmKind {
    /// What the kind is, in words, for the `kvm:` line of `microvm check-host`.
    pub fn description(self) -> &'static str {
        match self {
            KvmKind::Hardware => "hardware virtualization on bare metal",
            KvmKind::Nested => {
                "nested virtualization: VMX/SVM from the hypervisor this host runs under"
            }
            KvmKind::SvmEmulatedByQemuTcg => "SVM emulated by QEMU (nested, TCG)",
            KvmKind::Pvm => {
                "Pagetable-based Virtual Machine, a software nested hypervisor without VMX/SVM"
            }
            KvmKind::Unknown => "a /dev/kvm of a kind not recognised",
            KvmKind::None => "no usable KVM",
        }
    }
}

impl fmt::Display for KvmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // As the JSON names (serde's kebab-case), but kvm-pvm's full name for `Pvm` ("pvm" in
        // JSON, kept as it was).
        f.write_str(match self {
            KvmKind::Hardware => "hardware",
            KvmKind::Nested => "nested",
            KvmKind::SvmEmulatedByQemuTcg => "svm-emulated-by-qemu-tcg",
            KvmKind::Pvm => "kvm-pvm",
            KvmKind::Unknown => "unknown",
            KvmKind::None => "none",
        })
    }
}

/// How the model name of QEMU's `max` CPU under TCG begins: target/i386/cpu.c
/// `max_x86_cpu_initfn` sets `"QEMU TCG CPU version " QEMU_HW_VERSION`, which Debian 12's QEMU
/// 7.2 shows as `QEMU TCG CPU version 2.5+`. Under KVM, `-cpu max` shows the host's model instead.
pub const QEMU_TCG_MODEL_PREFIX: &str = "QEMU TCG CPU version";

pub use vmm::capabilities::REQUIRED_CAPS;

/// What the guest kernel is, as far as booting it under this host's KVM goes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KernelReport {
    /// The kernel file checked.
    pub path: PathBuf,
    /// Whether it was built with PVM guest support (CONFIG_PVM_GUEST), if that could be told.
    pub pvm_guest: Option<bool>,
    /// Whether it can boot under this host's KVM.
    pub bootable: bool,
    /// One line saying why (or why not).
    pub reason: String,
}

/// The whole answer of `microvm check-host`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HostReport {
    /// Which KVM this is.
    pub kvm_kind: KvmKind,
    /// One line on how the kind was told (or why there is no KVM).
    pub kvm_reason: String,
    /// KVM_GET_API_VERSION, when /dev/kvm opened.
    pub api_version: Option<i32>,
    /// Required capabilities this KVM lacks (by name).
    pub missing_caps: Vec<&'static str>,
    /// The maximum vCPUs per VM KVM recommends, when /dev/kvm opened.
    pub max_vcpus: Option<usize>,
    /// The guest kernel verdict, when a kernel was given.
    pub kernel: Option<KernelReport>,
}

impl HostReport {
    /// Whether the embedded VMM can run VMs at all here (our own test guests, for one).
    pub fn vmm_usable(&self) -> bool {
        !matches!(self.kvm_kind, KvmKind::None) && self.missing_caps.is_empty()
    }

    /// Whether the checked Linux guest kernel can boot under the embedded VMM here.
    pub fn linux_guest_bootable(&self) -> bool {
        self.linux_guest_blocker().is_none()
    }

    /// The one-line reason a Linux guest cannot boot under the embedded VMM here, if it cannot.
    pub fn linux_guest_blocker(&self) -> Option<String> {
        if matches!(self.kvm_kind, KvmKind::None) {
            return Some(format!("no usable KVM: {}", self.kvm_reason));
        }
        if !self.missing_caps.is_empty() {
            return Some(format!(
                "KVM lacks capabilities the VMM needs: {}",
                self.missing_caps.join(", ")
            ));
        }
        match &self.kernel {
            None => Some("no guest kernel was given to check".to_string()),
            Some(k) if !k.bootable => Some(k.reason.clone()),
            Some(_) => None,
        }
    }

    /// The human-readable lines `microvm check-host` prints.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.push(format!(
            "kvm: {} ({}: {})",
            self.kvm_kind,
            self.kvm_kind.description(),
            self.kvm_reason
        ));
        if let Some(v) = self.api_version {
            out.push(format!("kvm api version: {v}"));
        }
        if let Some(n) = self.max_vcpus {
            out.push(format!("kvm recommended max vcpus: {n}"));
        }
        if !matches!(self.kvm_kind, KvmKind::None) {
            if self.missing_caps.is_empty() {
                let names: Vec<&str> = REQUIRED_CAPS.iter().map(|(_, n)| *n).collect();
                out.push(format!("capabilities: all present ({})", names.join(", ")));
            } else {
                out.push(format!(
                    "capabilities: missing {}",
                    self.missing_caps.join(", ")
                ));
            }
        }
        out.push(format!(
            "embedded vmm: {}",
            if self.vmm_usable() {
                "usable (runs our test guests)"
            } else {
                "not usable"
            }
        ));
        match &self.kernel {
            Some(k) => out.push(format!(
                "guest kernel {}: {} ({})",
                k.path.display(),
                if k.bootable {
                    "can boot here"
                } else {
                    "cannot boot here"
                },
                k.reason
            )),
            None => out.push("guest kernel: not checked (none given)".to_string()),
        }
        match self.linux_guest_blocker() {
            None => out.push("verdict: linux guests boot under the embedded vmm".to_string()),
            Some(why) => out.push(format!(
                "verdict: linux guests cannot boot under the embedded vmm here: {why}"
            )),
        }
        out
    }
}

/// Tells which KVM this is from sysfs and the CPU flags.
pub fn kvm_kind() -> (KvmKind, String) {
    kvm_kind_from(
        Path::new("/sys/module"),
        Path::new("/proc/cpuinfo"),
        Path::new("/dev/kvm"),
    )
}

/// What /proc/cpuinfo says about the CPU, as far as telling the KVM kind goes.
#[derive(Debug, Default)]
struct CpuInfo {
    /// The flags of the first processor.
    flags: Vec<String>,
    /// The model name of the first processor.
    model_name: Option<String>,
}

impl CpuInfo {
    fn parse(text: &str) -> CpuInfo {
        let mut info = CpuInfo::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            match key.trim() {
                "flags" if info.flags.is_empty() => {
                    info.flags = value.split_whitespace().map(str::to_owned).collect();
                }
                "model name" if info.model_name.is_none() => {
                    info.model_name = Some(value.trim().to_owned());
                }
                _ => {}
            }
        }
        info
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    fn is_qemu_tcg_model(&self) -> bool {
        self.model_name
            .as_deref()
            .is_some_and(|m| m.starts_with(QEMU_TCG_MODEL_PREFIX))
    }
}

/// The hardware virtualization extensions KVM has modules for: (module, cpuinfo flag, name).
const VIRT_EXTENSIONS: [(&str, &str, &str); 2] = [
    ("kvm_intel", "vmx", "Intel VMX"),
    ("kvm_amd", "svm", "AMD SVM"),
];

fn kvm_kind_from(sys_module: &Path, cpuinfo: &Path, dev_kvm: &Path) -> (KvmKind, String) {
    if !dev_kvm.exists() {
        return (
            KvmKind::None,
            format!("{} does not exist", dev_kvm.display()),
        );
    }
    if sys_module.join("kvm_pvm").exists() {
        return (KvmKind::Pvm, "kvm_pvm is loaded".to_string());
    }
    let cpu = match fs::read_to_string(cpuinfo) {
        Ok(text) => CpuInfo::parse(&text),
        Err(e) => {
            return (
                KvmKind::Unknown,
                format!(
                    "kvm_pvm is not loaded and {} cannot be read: {e}",
                    cpuinfo.display()
                ),
            )
        }
    };
    let model = cpu.model_name.as_deref().unwrap_or("not given");
    for (module, flag, name) in VIRT_EXTENSIONS {
        if !(sys_module.join(module).exists() && cpu.has_flag(flag)) {
            continue;
        }
        if !cpu.has_flag("hypervisor") {
            return (
                KvmKind::Hardware,
                format!("{module} is loaded, CPU has {name} and no hypervisor flag"),
            );
        }
        // QEMU's TCG emulates SVM only (no VMX), so only kvm_amd can sit on it.
        if flag == "svm" && cpu.is_qemu_tcg_model() {
            return (
                KvmKind::SvmEmulatedByQemuTcg,
                format!(
                    "{module} is loaded, CPU has {name} and the hypervisor flag, model name \
                     \"{model}\" (QEMU's max CPU under TCG): every instruction, the guest's \
                     too, is emulated in software"
                ),
            );
        }
        return (
            KvmKind::Nested,
            format!(
                "{module} is loaded, CPU has {name} and the hypervisor flag, model name \"{model}\""
            ),
        );
    }
    let found = |names: Vec<&str>| {
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    };
    let loaded = found(
        VIRT_EXTENSIONS
            .iter()
            .map(|(m, _, _)| *m)
            .filter(|m| sys_module.join(m).exists())
            .collect(),
    );
    let flags = found(
        VIRT_EXTENSIONS
            .iter()
            .map(|(_, f, _)| *f)
            .filter(|f| cpu.has_flag(f))
            .collect(),
    );
    (
        KvmKind::Unknown,
        format!(
            "no kvm_pvm, and no kvm_intel with VMX or kvm_amd with SVM (kvm_intel/kvm_amd \
             loaded: {loaded}; vmx/svm in the CPU flags: {flags})"
        ),
    )
}

/// Whether `kernel` was built with PVM guest support: from the kernel config stored beside it
/// (`config` or `.config`, as kernel-config/build.sh keeps it), else from its ELF symbols.
pub fn kernel_has_pvm_guest(kernel: &Path) -> Result<Option<bool>, String> {
    let dir = kernel.parent().unwrap_or(Path::new("."));
    // build/vmlinux is a link into the kernel cache: look beside the real file too.
    let real_dir = fs::canonicalize(kernel)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    for d in [Some(dir.to_path_buf()), real_dir].into_iter().flatten() {
        for name in ["config", ".config"] {
            if let Ok(cfg) = fs::read_to_string(d.join(name)) {
                return Ok(Some(cfg.lines().any(|l| l.trim() == "CONFIG_PVM_GUEST=y")));
            }
        }
    }
    let data = fs::read(kernel).map_err(|e| format!("cannot read {}: {e}", kernel.display()))?;
    elf_has_pvm_symbols(&data)
}

fn elf_has_pvm_symbols(data: &[u8]) -> Result<Option<bool>, String> {
    use object::{Object, ObjectSymbol};
    let file = object::File::parse(data).map_err(|e| format!("not an ELF kernel: {e}"))?;
    let mut any = false;
    for sym in file.symbols() {
        any = true;
        if let Ok(name) = sym.name() {
            if name == "pvm_early_setup" || name == "pvm_detect" {
                return Ok(Some(true));
            }
        }
    }
    // A stripped kernel says nothing either way.
    Ok(any.then_some(false))
}

/// Decides whether `kernel` can boot under a KVM of `kind`.
pub fn check_kernel(kind: KvmKind, kernel: &Path) -> KernelReport {
    let report = |pvm_guest, bootable, reason: String| KernelReport {
        path: kernel.to_path_buf(),
        pvm_guest,
        bootable,
        reason,
    };
    if let Err(e) = fs::File::open(kernel) {
        return report(
            None,
            false,
            format!("cannot open {}: {e}", kernel.display()),
        );
    }
    let pvm = match kernel_has_pvm_guest(kernel) {
        Ok(p) => p,
        Err(e) => return report(None, false, e),
    };
    match kind {
        KvmKind::None => report(pvm, false, "no usable KVM on this host".to_string()),
        KvmKind::Hardware => report(
            pvm,
            true,
            "hardware virtualization boots a stock Linux guest".to_string(),
        ),
        KvmKind::Nested => report(
            pvm,
            true,
            "nested virtualization (VMX/SVM from the outer hypervisor) boots a stock Linux guest"
                .to_string(),
        ),
        KvmKind::SvmEmulatedByQemuTcg => report(
            pvm,
            true,
            "QEMU's TCG emulation of SVM boots a stock Linux guest, slowly: every guest \
             instruction is emulated"
                .to_string(),
        ),
        KvmKind::Pvm => match pvm {
            Some(true) => report(
                pvm,
                true,
                "kvm-pvm host and the kernel has PVM guest support (CONFIG_PVM_GUEST)".to_string(),
            ),
            Some(false) => report(
                pvm,
                false,
                "this host's KVM is kvm-pvm, which boots only guest kernels built with PVM guest \
                 support (CONFIG_PVM_GUEST); this kernel has none"
                    .to_string(),
            ),
            None => report(
                pvm,
                false,
                "this host's KVM is kvm-pvm, which boots only PVM guest kernels; this kernel has \
                 no config beside it and no symbols, so PVM support cannot be confirmed"
                    .to_string(),
            ),
        },
        KvmKind::Unknown => report(
            pvm,
            true,
            "unrecognised KVM kind; assuming it boots a stock Linux guest".to_string(),
        ),
    }
}

/// Probes the host: KVM kind, API version, capabilities, and (if given) the guest kernel.
pub fn probe(kernel: Option<&Path>) -> HostReport {
    let (mut kind, mut kvm_reason) = kvm_kind();
    let mut api_version = None;
    let mut missing_caps = Vec::new();
    let mut max_vcpus = None;
    if kind != KvmKind::None {
        match vmm::capabilities::probe() {
            Ok(caps) => {
                api_version = Some(caps.api_version);
                max_vcpus = Some(caps.max_vcpus);
                missing_caps = caps.missing;
            }
            Err(e) => {
                kind = KvmKind::None;
                kvm_reason = match e {
                    vmm::VmmError::Kvm { source, .. } => format!("cannot open /dev/kvm: {source}"),
                    other => other.to_string(),
                };
            }
        }
    }
    HostReport {
        kvm_kind: kind,
        kvm_reason,
        api_version,
        missing_caps,
        max_vcpus,
        kernel: kernel.map(|k| check_kernel(kind, k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("host-check-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// A /proc/cpuinfo of one processor with this model name and these flags.
    fn cpuinfo(model: &str, flags: &str) -> String {
        format!(
            "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\n\
             flags\t\t: fpu vme de pse {flags} sse sse2\n\nprocessor\t: 1\n\
             model name\t: {model}\nflags\t\t: fpu vme de pse {flags} sse sse2\n"
        )
    }

    const TCG_MODEL: &str = "QEMU TCG CPU version 2.5+";

    #[test]
    fn tells_kinds_apart() {
        let d = tmp("kinds");
        let modules = d.join("module");
        let cpu = d.join("cpuinfo");
        let kvm = d.join("kvm");
        let kind = || kvm_kind_from(&modules, &cpu, &kvm).0;
        assert_eq!(kind(), KvmKind::None);
        fs::write(&kvm, "").unwrap();
        fs::create_dir_all(modules.join("kvm_intel")).unwrap();
        fs::write(&cpu, cpuinfo("Intel Xeon", "")).unwrap();
        assert_eq!(kind(), KvmKind::Unknown);
        // Bare metal: VMX and no hypervisor flag.
        fs::write(&cpu, cpuinfo("Intel Xeon", "vmx")).unwrap();
        assert_eq!(kind(), KvmKind::Hardware);
        // A cloud VM with nested virtualization.
        fs::write(&cpu, cpuinfo("Intel Xeon", "vmx hypervisor")).unwrap();
        assert_eq!(kind(), KvmKind::Nested);
        fs::remove_dir_all(modules.join("kvm_intel")).unwrap();
        fs::create_dir_all(modules.join("kvm_amd")).unwrap();
        fs::write(&cpu, cpuinfo("AMD EPYC 7B13", "svm")).unwrap();
        assert_eq!(kind(), KvmKind::Hardware);
        fs::write(&cpu, cpuinfo("AMD EPYC 7B13", "svm hypervisor")).unwrap();
        assert_eq!(kind(), KvmKind::Nested);
        // The nested lane: QEMU's max CPU under TCG.
        fs::write(&cpu, cpuinfo(TCG_MODEL, "svm hypervisor")).unwrap();
        assert_eq!(kind(), KvmKind::SvmEmulatedByQemuTcg);
        // Without kvm_amd the emulated SVM is not KVM's.
        fs::remove_dir_all(modules.join("kvm_amd")).unwrap();
        assert_eq!(kind(), KvmKind::Unknown);
        fs::create_dir_all(modules.join("kvm_amd")).unwrap();
        fs::create_dir_all(modules.join("kvm_pvm")).unwrap();
        assert_eq!(kind(), KvmKind::Pvm);
        fs::remove_dir_all(&d).unwrap();
    }

    /// The `kvm:` line check-host prints for the kind told from these files.
    fn kvm_line(modules: &[&str], cpu: Option<&str>, dev_kvm: bool) -> (KvmKind, String) {
        let d = tmp(&format!("line-{}", modules.join("-")));
        for m in modules {
            fs::create_dir_all(d.join("module").join(m)).unwrap();
        }
        if let Some(text) = cpu {
            fs::write(d.join("cpuinfo"), text).unwrap();
        }
        if dev_kvm {
            fs::write(d.join("kvm"), "").unwrap();
        }
        let (kind, reason) = kvm_kind_from(&d.join("module"), &d.join("cpuinfo"), &d.join("kvm"));
        let line = HostReport {
            kvm_kind: kind,
            kvm_reason: reason,
            api_version: None,
            missing_caps: vec![],
            max_vcpus: None,
            kernel: None,
        }
        .lines()
        .remove(0);
        fs::remove_dir_all(&d).unwrap();
        (kind, line.replace(&d.display().to_string(), "<dir>"))
    }

    #[test]
    fn kvm_line_names_each_kind_truthfully() {
        let cases = [
            (
                kvm_line(&["kvm_intel"], Some(&cpuinfo("Intel Xeon", "vmx")), true),
                KvmKind::Hardware,
                "kvm: hardware (hardware virtualization on bare metal: kvm_intel is loaded, CPU \
                 has Intel VMX and no hypervisor flag)",
            ),
            (
                kvm_line(
                    &["kvm_amd"],
                    Some(&cpuinfo("AMD EPYC 7B13", "svm hypervisor")),
                    true,
                ),
                KvmKind::Nested,
                "kvm: nested (nested virtualization: VMX/SVM from the hypervisor this host runs \
                 under: kvm_amd is loaded, CPU has AMD SVM and the hypervisor flag, model name \
                 \"AMD EPYC 7B13\")",
            ),
            (
                kvm_line(
                    &["kvm_amd"],
                    Some(&cpuinfo(TCG_MODEL, "svm hypervisor")),
                    true,
                ),
                KvmKind::SvmEmulatedByQemuTcg,
                "kvm: svm-emulated-by-qemu-tcg (SVM emulated by QEMU (nested, TCG): kvm_amd is \
                 loaded, CPU has AMD SVM and the hypervisor flag, model name \"QEMU TCG CPU \
                 version 2.5+\" (QEMU's max CPU under TCG): every instruction, the guest's too, \
                 is emulated in software)",
            ),
            (
                kvm_line(
                    &["kvm_pvm"],
                    Some(&cpuinfo("Intel Xeon", "hypervisor")),
                    true,
                ),
                KvmKind::Pvm,
                "kvm: kvm-pvm (Pagetable-based Virtual Machine, a software nested hypervisor \
                 without VMX/SVM: kvm_pvm is loaded)",
            ),
            (
                kvm_line(
                    &["kvm_intel"],
                    Some(&cpuinfo("Intel Xeon", "hypervisor")),
                    true,
                ),
                KvmKind::Unknown,
                "kvm: unknown (a /dev/kvm of a kind not recognised: no kvm_pvm, and no kvm_intel \
                 with VMX or kvm_amd with SVM (kvm_intel/kvm_amd loaded: kvm_intel; vmx/svm in \
                 the CPU flags: none))",
            ),
            (
                kvm_line(&[], None, false),
                KvmKind::None,
                "kvm: none (no usable KVM: <dir>/kvm does not exist)",
            ),
        ];
        for ((kind, line), want_kind, want_line) in cases {
            assert_eq!(kind, want_kind);
            assert_eq!(line, want_line);
        }
        // The JSON names (`microvm check-host --json`'s `kvm_kind`).
        for (kind, json) in [
            (KvmKind::Hardware, "hardware"),
            (KvmKind::Nested, "nested"),
            (KvmKind::SvmEmulatedByQemuTcg, "svm-emulated-by-qemu-tcg"),
            (KvmKind::Pvm, "pvm"),
            (KvmKind::Unknown, "unknown"),
            (KvmKind::None, "none"),
        ] {
            assert_eq!(serde_json::to_value(kind).unwrap(), json);
        }
    }

    #[test]
    fn nested_and_emulated_kinds_boot_the_stock_kernel() {
        let d = tmp("nested-kernel");
        let k = d.join("vmlinux");
        fs::write(&k, b"not really a kernel").unwrap();
        fs::write(d.join("config"), "CONFIG_64BIT=y\n").unwrap();
        let r = check_kernel(KvmKind::Nested, &k);
        assert!(r.bootable);
        assert_eq!(
            r.reason,
            "nested virtualization (VMX/SVM from the outer hypervisor) boots a stock Linux guest"
        );
        let r = check_kernel(KvmKind::SvmEmulatedByQemuTcg, &k);
        assert!(r.bootable);
        assert_eq!(
            r.reason,
            "QEMU's TCG emulation of SVM boots a stock Linux guest, slowly: every guest \
             instruction is emulated"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn kernel_verdict_follows_config_beside_it() {
        let d = tmp("config");
        let k = d.join("vmlinux");
        fs::write(&k, b"not really a kernel").unwrap();
        fs::write(d.join("config"), "CONFIG_64BIT=y\n").unwrap();
        let r = check_kernel(KvmKind::Pvm, &k);
        assert!(!r.bootable);
        assert_eq!(r.pvm_guest, Some(false));
        assert!(r.reason.contains("CONFIG_PVM_GUEST"), "{}", r.reason);
        assert!(check_kernel(KvmKind::Hardware, &k).bootable);
        fs::write(d.join("config"), "CONFIG_64BIT=y\nCONFIG_PVM_GUEST=y\n").unwrap();
        assert!(check_kernel(KvmKind::Pvm, &k).bootable);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_or_bogus_kernel_is_not_bootable() {
        let d = tmp("bogus");
        let r = check_kernel(KvmKind::Hardware, &d.join("nope"));
        assert!(!r.bootable);
        assert!(r.reason.contains("nope"), "{}", r.reason);
        let k = d.join("vmlinux");
        fs::write(&k, b"garbage").unwrap();
        let r = check_kernel(KvmKind::Pvm, &k);
        assert!(!r.bootable);
        assert!(r.reason.contains("not an ELF"), "{}", r.reason);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn report_names_the_blocker() {
        let r = HostReport {
            kvm_kind: KvmKind::Pvm,
            kvm_reason: "x".into(),
            api_version: Some(12),
            missing_caps: vec![],
            max_vcpus: Some(4),
            kernel: Some(KernelReport {
                path: "/k".into(),
                pvm_guest: Some(false),
                bootable: false,
                reason: "needs PVM".into(),
            }),
        };
        assert!(r.vmm_usable());
        assert!(!r.linux_guest_bootable());
        assert_eq!(r.linux_guest_blocker().as_deref(), Some("needs PVM"));
        assert!(r.lines().last().unwrap().contains("needs PVM"));
    }
}
