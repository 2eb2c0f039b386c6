//! The pod's overhead (what the VMM and its helpers may spend on top of the VM's memory and
//! vCPUs) and the host cgroup's limits that follow from it. Pure: the cgroup files are read and
//! written in the parent module.
//!
//! The overhead comes from, per resource and in this order:
//! 1. the pod annotations [`ANN_OVERHEAD_MEMORY`] / [`ANN_OVERHEAD_CPU`] (Kubernetes quantities),
//!    when the config allows them;
//! 2. the RuntimeClass overhead containerd 2.x hands the shim typed (`PodSandboxConfig.linux.
//!    overhead`, Sandbox API only: `sandbox::pod_config`);
//! 3. the pod cgroup's limit minus the containers' sum (kubelet sized the pod cgroup to the
//!    containers plus the RuntimeClass overhead; containerd passes the containers' sum as the
//!    `io.kubernetes.cri.sandbox-*` annotations);
//! 4. the config default.
//!
//! The host cgroup's limits are the VM's size plus the overhead (memory: guest memory + overhead
//! memory; CPU: vCPUs + overhead CPU per period), never above the pod cgroup's own limit.

/// Pod annotation with the memory overhead (a Kubernetes quantity: `96Mi`, `100M`, `1.5Gi`).
pub const ANN_OVERHEAD_MEMORY: &str = "microvm.io/overhead-memory";
/// Pod annotation with the CPU overhead (a Kubernetes quantity: `250m`, `0.5`, `1`).
pub const ANN_OVERHEAD_CPU: &str = "microvm.io/overhead-cpu";
/// The CFS period the host cgroup's CPU quota is given in (the kernel's default, 100 ms).
pub const CPU_PERIOD_US: u64 = 100_000;

/// Where one part of the overhead came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Annotation,
    PodConfig,
    PodCgroup,
    Config,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Annotation => "pod annotation",
            Source::PodConfig => "RuntimeClass overhead in the PodSandboxConfig",
            Source::PodCgroup => "pod cgroup limit minus the containers' sum",
            Source::Config => "config default",
        })
    }
}

/// The pod's overhead, each part with its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overhead {
    pub memory_bytes: u64,
    pub memory_source: Source,
    pub cpu_millis: u64,
    pub cpu_source: Source,
}

/// A limit of the pod cgroup (or the containers' sum): a value, or none set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Amounts {
    /// Memory in bytes; `None`: unlimited / not given.
    pub memory_bytes: Option<u64>,
    /// CPU in millicores (quota / period * 1000); `None`: unlimited / not given.
    pub cpu_millis: Option<u64>,
}

/// The overhead of the config, used when nothing else gives one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defaults {
    pub memory_bytes: u64,
    pub cpu_millis: u64,
    /// Whether the overhead annotations are read (the allow-list).
    pub annotations_allowed: bool,
}

/// The host cgroup's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub cpu_quota_us: u64,
    pub cpu_period_us: u64,
}

impl Limits {
    /// The CPU limit in millicores.
    pub fn cpu_millis(&self) -> u64 {
        self.cpu_quota_us.saturating_mul(1000) / self.cpu_period_us.max(1)
    }
}

/// The overhead for a pod: see the module doc for the order.
pub fn resolve(
    annotations: &std::collections::HashMap<String, String>,
    defaults: Defaults,
    typed: Amounts,
    pod_cgroup: Amounts,
    containers: Amounts,
) -> Result<Overhead, String> {
    let annotated = |key: &str, to: fn(&Quantity) -> u64| -> Result<Option<u64>, String> {
        if !defaults.annotations_allowed {
            return Ok(None);
        }
        annotations
            .get(key)
            .map(|v| {
                Quantity::parse(v)
                    .map(|q| to(&q))
                    .map_err(|e| format!("annotation {key}={v:?}: {e}"))
            })
            .transpose()
    };
    let from_parent = |parent: Option<u64>, sum: Option<u64>| match (parent, sum) {
        (Some(p), Some(s)) if s > 0 && p > s => Some(p - s),
        _ => None,
    };
    let (memory_bytes, memory_source) =
        if let Some(v) = annotated(ANN_OVERHEAD_MEMORY, Quantity::ceil_units)? {
            (v, Source::Annotation)
        } else if let Some(v) = typed.memory_bytes {
            (v, Source::PodConfig)
        } else if let Some(v) = from_parent(pod_cgroup.memory_bytes, containers.memory_bytes) {
            (v, Source::PodCgroup)
        } else {
            (defaults.memory_bytes, Source::Config)
        };
    let (cpu_millis, cpu_source) =
        if let Some(v) = annotated(ANN_OVERHEAD_CPU, Quantity::ceil_millis)? {
            (v, Source::Annotation)
        } else if let Some(v) = typed.cpu_millis {
            (v, Source::PodConfig)
        } else if let Some(v) = from_parent(pod_cgroup.cpu_millis, containers.cpu_millis) {
            (v, Source::PodCgroup)
        } else {
            (defaults.cpu_millis, Source::Config)
        };
    Ok(Overhead {
        memory_bytes,
        memory_source,
        cpu_millis,
        cpu_source,
    })
}

/// The host cgroup's limits: the VM (`vm_memory_bytes`, `vcpus`) plus `overhead`, each capped
/// by the pod cgroup's own limit where it has one.
pub fn limits(vm_memory_bytes: u64, vcpus: u8, overhead: &Overhead, pod_cgroup: Amounts) -> Limits {
    let mut memory_bytes = vm_memory_bytes.saturating_add(overhead.memory_bytes);
    if let Some(cap) = pod_cgroup.memory_bytes {
        memory_bytes = memory_bytes.min(cap);
    }
    let mut cpu_millis = u64::from(vcpus)
        .saturating_mul(1000)
        .saturating_add(overhead.cpu_millis);
    if let Some(cap) = pod_cgroup.cpu_millis {
        cpu_millis = cpu_millis.min(cap);
    }
    // The kernel's smallest quota is 1 ms.
    let cpu_quota_us = (cpu_millis.saturating_mul(CPU_PERIOD_US) / 1000).max(1000);
    Limits {
        memory_bytes,
        cpu_quota_us,
        cpu_period_us: CPU_PERIOD_US,
    }
}

/// CPU millicores of a CFS quota and period (`None` for no quota).
pub fn quota_millis(quota_us: i64, period_us: u64) -> Option<u64> {
    let quota = u64::try_from(quota_us).ok().filter(|q| *q > 0)?;
    if period_us == 0 {
        return None;
    }
    // In u128: a quota above u64::MAX / 1000 would saturate before the division and read as
    // fewer millicores than it is (found by `properties::quota_millis_rounds_up`).
    let millis = (u128::from(quota) * 1000).div_ceil(u128::from(period_us));
    Some(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// A Kubernetes resource quantity (`128Mi`, `1.5G`, `250m`, `2`, `1e3`), non-negative, held
/// exactly as `nanos / 10^9` units. Written here because no maintained crate parses quantities
/// without the whole Kubernetes API (docs/overhead.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    nanos: u128,
}

impl Quantity {
    /// Parses a quantity; the message says why not.
    pub fn parse(text: &str) -> Result<Quantity, String> {
        let s = text.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
            .unwrap_or(s.len());
        let (number, suffix) = s.split_at(split);
        let number = number.strip_prefix('+').unwrap_or(number);
        let (int, frac) = number.split_once('.').unwrap_or((number, ""));
        if (int.is_empty() && frac.is_empty())
            || !int.bytes().all(|b| b.is_ascii_digit())
            || !frac.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(format!("{text:?} is not a quantity"));
        }
        if int.len() > 20 || frac.len() > 9 {
            return Err(format!("{text:?}: too many digits"));
        }
        let int: u128 = if int.is_empty() {
            0
        } else {
            int.parse()
                .map_err(|_| format!("{text:?} is not a quantity"))?
        };
        let frac_nanos: u128 = if frac.is_empty() {
            0
        } else {
            let v: u128 = frac
                .parse()
                .map_err(|_| format!("{text:?} is not a quantity"))?;
            v * 10u128.pow(9 - frac.len() as u32)
        };
        let base = int * 1_000_000_000 + frac_nanos;
        // (multiplier, divisor) of the suffix.
        let (mul, div): (u128, u128) = match suffix {
            "" => (1, 1),
            "m" => (1, 1000),
            "k" => (1000, 1),
            "M" => (1000u128.pow(2), 1),
            "G" => (1000u128.pow(3), 1),
            "T" => (1000u128.pow(4), 1),
            "P" => (1000u128.pow(5), 1),
            "E" => (1000u128.pow(6), 1),
            "Ki" => (1 << 10, 1),
            "Mi" => (1 << 20, 1),
            "Gi" => (1 << 30, 1),
            "Ti" => (1 << 40, 1),
            "Pi" => (1 << 50, 1),
            "Ei" => (1 << 60, 1),
            e if (e.starts_with('e') || e.starts_with('E')) && e.len() > 1 => {
                let exp: u32 = e[1..]
                    .parse()
                    .map_err(|_| format!("{text:?}: bad exponent"))?;
                if exp > 18 {
                    return Err(format!("{text:?}: exponent too large"));
                }
                (10u128.pow(exp), 1)
            }
            other => return Err(format!("{text:?}: unknown suffix {other:?}")),
        };
        let nanos = base
            .checked_mul(mul)
            .ok_or_else(|| format!("{text:?} is too large"))?
            / div;
        Ok(Quantity { nanos })
    }

    /// The value rounded up to whole units (bytes for memory), saturating.
    pub fn ceil_units(&self) -> u64 {
        u64::try_from(self.nanos.div_ceil(1_000_000_000)).unwrap_or(u64::MAX)
    }

    /// The value in thousandths rounded up (millicores for CPU), saturating.
    pub fn ceil_millis(&self) -> u64 {
        u64::try_from(self.nanos.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MI: u64 = 1 << 20;

    use testkit::string_map as ann;

    #[test]
    fn quantities_parse_like_kubernetes() {
        let b = |s: &str| Quantity::parse(s).unwrap().ceil_units();
        let m = |s: &str| Quantity::parse(s).unwrap().ceil_millis();
        assert_eq!(b("128Mi"), 128 * MI);
        assert_eq!(b("1.5Gi"), 3 << 29);
        assert_eq!(b("100M"), 100_000_000);
        assert_eq!(b("64"), 64);
        assert_eq!(b("1e3"), 1000);
        assert_eq!(b("1k"), 1000);
        assert_eq!(b("0.5"), 1);
        assert_eq!(m("250m"), 250);
        assert_eq!(m("0.5"), 500);
        assert_eq!(m("2"), 2000);
        assert_eq!(m("0.0001"), 1);
        assert_eq!(m(" 1 "), 1000);
        for bad in ["", "abc", "-1", "1.2.3", "5Xi", "1e", "1e99", ".", "Mi"] {
            assert!(Quantity::parse(bad).is_err(), "{bad:?}");
        }
        // Saturates rather than wrapping, and refuses what overflows the arithmetic.
        assert_eq!(b("99999999999Ei"), u64::MAX);
        assert!(Quantity::parse("99999999999999999999Ei").is_err());
    }

    #[test]
    fn overhead_sources_in_order() {
        let defaults = Defaults {
            memory_bytes: 100 * MI,
            cpu_millis: 200,
            annotations_allowed: true,
        };
        let parent = Amounts {
            memory_bytes: Some(640 * MI),
            cpu_millis: Some(1500),
        };
        let sum = Amounts {
            memory_bytes: Some(512 * MI),
            cpu_millis: Some(1000),
        };
        // Nothing known: the config.
        let o = resolve(
            &HashMap::new(),
            defaults,
            Amounts::default(),
            Amounts::default(),
            sum,
        )
        .unwrap();
        assert_eq!(
            (o.memory_bytes, o.memory_source),
            (100 * MI, Source::Config)
        );
        assert_eq!((o.cpu_millis, o.cpu_source), (200, Source::Config));
        // The pod cgroup minus the containers.
        let o = resolve(&HashMap::new(), defaults, Amounts::default(), parent, sum).unwrap();
        assert_eq!(
            (o.memory_bytes, o.memory_source),
            (128 * MI, Source::PodCgroup)
        );
        assert_eq!((o.cpu_millis, o.cpu_source), (500, Source::PodCgroup));
        // Without the containers' sum the parent says nothing.
        let o = resolve(
            &HashMap::new(),
            defaults,
            Amounts::default(),
            parent,
            Amounts::default(),
        )
        .unwrap();
        assert_eq!(o.memory_source, Source::Config);
        // The annotation first, per resource.
        let a = ann(&[(ANN_OVERHEAD_MEMORY, "50Mi")]);
        let o = resolve(&a, defaults, Amounts::default(), parent, sum).unwrap();
        assert_eq!(
            (o.memory_bytes, o.memory_source),
            (50 * MI, Source::Annotation)
        );
        assert_eq!(o.cpu_source, Source::PodCgroup);
        // The typed RuntimeClass overhead (Sandbox API) after the annotation, before the
        // pod cgroup.
        let typed = Amounts {
            memory_bytes: Some(96 * MI),
            cpu_millis: Some(250),
        };
        let o = resolve(&a, defaults, typed, parent, sum).unwrap();
        assert_eq!(o.memory_source, Source::Annotation);
        assert_eq!((o.cpu_millis, o.cpu_source), (250, Source::PodConfig));
        let o = resolve(&HashMap::new(), defaults, typed, parent, sum).unwrap();
        assert_eq!(
            (o.memory_bytes, o.memory_source),
            (96 * MI, Source::PodConfig)
        );
        let a = ann(&[(ANN_OVERHEAD_CPU, "300m")]);
        let o = resolve(&a, defaults, Amounts::default(), Amounts::default(), sum).unwrap();
        assert_eq!((o.cpu_millis, o.cpu_source), (300, Source::Annotation));
        assert_eq!(o.memory_source, Source::Config);
        // Not on the allow-list: ignored.
        let off = Defaults {
            annotations_allowed: false,
            ..defaults
        };
        let a = ann(&[(ANN_OVERHEAD_MEMORY, "50Mi"), (ANN_OVERHEAD_CPU, "junk")]);
        let o = resolve(&a, off, Amounts::default(), Amounts::default(), sum).unwrap();
        assert_eq!(o.memory_source, Source::Config);
        // A bad annotation fails the pod, naming it.
        let e = resolve(&a, defaults, Amounts::default(), Amounts::default(), sum).unwrap_err();
        assert!(e.contains(ANN_OVERHEAD_CPU), "{e}");
    }

    #[test]
    fn limits_are_the_vm_plus_overhead_capped_by_the_pod_cgroup() {
        let o = Overhead {
            memory_bytes: 100 * MI,
            memory_source: Source::Config,
            cpu_millis: 250,
            cpu_source: Source::Config,
        };
        let l = limits(384 * MI, 2, &o, Amounts::default());
        assert_eq!(l.memory_bytes, 484 * MI);
        assert_eq!(l.cpu_period_us, 100_000);
        assert_eq!(l.cpu_quota_us, 225_000);
        assert_eq!(l.cpu_millis(), 2250);
        let cap = Amounts {
            memory_bytes: Some(400 * MI),
            cpu_millis: Some(1500),
        };
        let l = limits(384 * MI, 2, &o, cap);
        assert_eq!(l.memory_bytes, 400 * MI);
        assert_eq!(l.cpu_quota_us, 150_000);
        assert_eq!(quota_millis(150_000, 100_000), Some(1500));
        assert_eq!(quota_millis(-1, 100_000), None);
        assert_eq!(quota_millis(1, 0), None);
    }
}

/// Properties of the overhead arithmetic over any sizes.
#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn amount() -> impl Strategy<Value = Option<u64>> {
        prop::option::of(prop_oneof![0u64..(1 << 40), any::<u64>()])
    }

    fn overhead() -> impl Strategy<Value = Overhead> {
        (prop_oneof![0u64..(1 << 32), any::<u64>()], 0u64..100_000).prop_map(|(m, c)| Overhead {
            memory_bytes: m,
            memory_source: Source::Config,
            cpu_millis: c,
            cpu_source: Source::Config,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The limits never overflow, hold the VM plus its overhead unless the pod cgroup caps
        /// them lower, never pass that cap (but for the kernel's 1 ms smallest quota), and
        /// grow with the VM.
        #[test]
        fn limits_are_the_vm_plus_overhead_under_the_cap(
            vm in prop_oneof![0u64..(1 << 40), any::<u64>()],
            vcpus in any::<u8>(),
            extra_vcpus in 0u8..4,
            o in overhead(),
            cap_memory in amount(),
            cap_cpu in amount(),
        ) {
            let cap = Amounts { memory_bytes: cap_memory, cpu_millis: cap_cpu };
            let l = limits(vm, vcpus, &o, cap);
            let wanted_memory = vm.saturating_add(o.memory_bytes);
            prop_assert_eq!(l.memory_bytes, wanted_memory.min(cap_memory.unwrap_or(u64::MAX)));
            prop_assert_eq!(l.cpu_period_us, CPU_PERIOD_US);
            prop_assert!(l.cpu_quota_us >= 1000, "the kernel's smallest quota");
            let wanted_cpu = u64::from(vcpus) * 1000 + o.cpu_millis;
            let cpu = wanted_cpu.min(cap_cpu.unwrap_or(u64::MAX));
            // The quota holds the CPU asked for, to the microsecond of the period.
            prop_assert_eq!(l.cpu_millis(), cpu.max(10));
            let bigger = limits(vm.saturating_add(1 << 20), vcpus.saturating_add(extra_vcpus), &o, cap);
            prop_assert!(bigger.memory_bytes >= l.memory_bytes);
            prop_assert!(bigger.cpu_quota_us >= l.cpu_quota_us);
        }

        /// A quota read back from a cgroup gives at least the millicores it was written for
        /// (rounded up, never below), and no quota reads as none.
        #[test]
        fn quota_millis_rounds_up(quota in any::<i64>(), period in 0u64..10_000_000) {
            match quota_millis(quota, period) {
                None => prop_assert!(quota <= 0 || period == 0),
                Some(u64::MAX) => {
                    prop_assert!(quota as u128 * 1000 > u128::from(u64::MAX - 1) * u128::from(period));
                }
                Some(m) => {
                    let quota = quota as u128;
                    prop_assert!(u128::from(m) * u128::from(period) >= quota * 1000);
                    prop_assert!((u128::from(m) - 1) * u128::from(period) < quota * 1000);
                }
            }
        }

        /// Quantities: a whole number with a binary or decimal suffix is that many bytes
        /// (saturating); a decimal fraction rounds up to the millicore; any text parses or is
        /// refused without a panic.
        #[test]
        fn quantities_are_exact(
            n in 0u64..(1 << 40),
            suffix in prop::sample::select(vec![
                ("", 1u128), ("k", 1000), ("M", 1_000_000), ("G", 1_000_000_000),
                ("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40),
            ]),
            int in 0u32..100,
            frac in "[0-9]{1,9}",
            junk in "\\PC{0,24}",
        ) {
            let q = Quantity::parse(&format!("{n}{}", suffix.0))
                .map_err(TestCaseError::fail)?;
            let bytes = u128::from(n) * suffix.1;
            prop_assert_eq!(q.ceil_units(), u64::try_from(bytes).unwrap_or(u64::MAX));
            let cpu = Quantity::parse(&format!("{int}.{frac}")).map_err(TestCaseError::fail)?;
            let nanos = u128::from(int) * 1_000_000_000
                + frac.parse::<u128>().unwrap_or(0) * 10u128.pow(9 - frac.len() as u32);
            prop_assert_eq!(u128::from(cpu.ceil_millis()), nanos.div_ceil(1_000_000));
            prop_assert!(cpu.ceil_millis() >= u64::from(int) * 1000);
            if let Ok(q) = Quantity::parse(&junk) {
                prop_assert!(q.ceil_millis() >= q.ceil_units().min(u64::MAX / 1000));
            }
        }

        /// The annotation wins when allowed, then the typed overhead, then the pod cgroup's
        /// limit minus the containers' sum (only when above it), then the default.
        #[test]
        fn overhead_sources_keep_their_order(
            allowed in any::<bool>(),
            annotated in prop::option::of(0u64..(1 << 30)),
            typed in amount(),
            parent in amount(),
            sum in amount(),
            default in 0u64..(1 << 30),
        ) {
            let mut ann = HashMap::new();
            if let Some(a) = annotated {
                ann.insert(ANN_OVERHEAD_MEMORY.to_string(), a.to_string());
            }
            let defaults = Defaults { memory_bytes: default, cpu_millis: 0, annotations_allowed: allowed };
            let o = resolve(
                &ann,
                defaults,
                Amounts { memory_bytes: typed, cpu_millis: None },
                Amounts { memory_bytes: parent, cpu_millis: None },
                Amounts { memory_bytes: sum, cpu_millis: None },
            )
            .map_err(TestCaseError::fail)?;
            let from_parent = match (parent, sum) {
                (Some(p), Some(s)) if s > 0 && p > s => Some(p - s),
                _ => None,
            };
            let expected = match (annotated.filter(|_| allowed), typed, from_parent) {
                (Some(a), _, _) => (a, Source::Annotation),
                (None, Some(t), _) => (t, Source::PodConfig),
                (None, None, Some(p)) => (p, Source::PodCgroup),
                (None, None, None) => (default, Source::Config),
            };
            prop_assert_eq!((o.memory_bytes, o.memory_source), expected);
            prop_assert_eq!(o.cpu_source, Source::Config);
        }
    }
}
