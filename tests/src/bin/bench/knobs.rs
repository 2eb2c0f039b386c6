//! The numeric knobs of the pod parts (`BENCH_NET_*`, `BENCH_DENSITY*`): positive numbers from
//! the environment.

use anyhow::{bail, Result};

/// A `BENCH_NET_*` knob: a positive number, `default` when unset.
pub(crate) fn positive_knob<T: std::str::FromStr + Default + PartialEq>(
    name: &str,
    default: T,
) -> Result<T> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<T>() {
            Ok(n) if n != T::default() => Ok(n),
            _ => bail!("{name}={v:?}: expected a positive whole number"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_knobs_are_positive_numbers() {
        std::env::remove_var("BENCH_NET_TEST_UNSET");
        assert_eq!(positive_knob("BENCH_NET_TEST_UNSET", 7usize).unwrap(), 7);
        std::env::set_var("BENCH_NET_TEST_SET", " 12 ");
        assert_eq!(positive_knob("BENCH_NET_TEST_SET", 7usize).unwrap(), 12);
        std::env::set_var("BENCH_NET_TEST_ZERO", "0");
        assert!(positive_knob("BENCH_NET_TEST_ZERO", 7u64).is_err());
        std::env::set_var("BENCH_NET_TEST_WORD", "many");
        assert!(positive_knob("BENCH_NET_TEST_WORD", 7u64).is_err());
    }
}
