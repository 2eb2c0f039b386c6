//! Where the benchmark finds the repository (the test guests) and the built binaries.

use std::path::PathBuf;

use anyhow::{Context, Result};

pub(crate) fn repo_root() -> PathBuf {
    // tests/ is one level below the workspace root.
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Where the shim and the `microvm` tool are: next to this binary (`make build` builds them all
/// into the same target folder).
pub(crate) fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the bench binary")?;
    Ok(exe
        .parent()
        .context("the bench binary has no folder")?
        .to_path_buf())
}
