//! What the workspace's tests and the fuzz package's seeds share: writers of test data that
//! several crates need. Only a dev-dependency (and the fuzz package's dependency): product code
//! never links it.

pub mod cpio;
pub mod guests;
