//! What the workspace's tests and the fuzz package's seeds share: writers of test data that
//! several crates need, and the checks their tests begin with. A dependency of test code only
//! (dev-dependencies, the test crate `microvm-tests` and the fuzz package): product code never
//! links it.

pub mod cpio;
pub mod guests;

/// Panics, naming the test, unless this process runs as root: the tests that make namespaces,
/// mounts, taps, cgroups or a private containerd need it (`make test` runs as root).
pub fn require_root() {
    if !rustix::process::geteuid().is_root() {
        let thread = std::thread::current();
        let test = thread.name().unwrap_or("this test");
        panic!("{test} needs root (make test runs as root)");
    }
}

/// A map of strings from `(key, value)` pairs: annotations, labels, sysctls in tests.
pub fn string_map(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
