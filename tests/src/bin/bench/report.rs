//! What the parts' report lines share: the median, MiB, whether a target is met, and the fewest
//! samples a median is trusted from.

/// Fewer pods per handler than this and the medians say little (the report says so).
pub(crate) const MIN_PODS: usize = 5;

/// How a report line says whether a target is met.
pub(crate) fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

/// Bytes in MiB.
pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

/// The median of `v` (the mean of the middle two for an even count; NaN when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
