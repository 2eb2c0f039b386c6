//! What the workspace's tests and the fuzz package's seeds share: writers of test data that
//! several crates need. Only a dev-dependency (and the fuzz package's dependency): product code
//! never links it.

pub mod cpio;
pub mod guests;

/// A map of strings from `(key, value)` pairs: annotations, labels, sysctls in tests.
pub fn string_map(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
