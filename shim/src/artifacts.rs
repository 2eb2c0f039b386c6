//! Where the guest artifacts are: the kernel (`vmlinux`), the initrd with the agent as `/init`,
//! and the test guests. An explicit path wins; then an environment variable; then the `build/`
//! folder of the source tree the binary was built in (found from the binary's own path,
//! `<repo>/target/<profile>/<bin>`), which is where `make` puts them.

use std::env;
use std::path::{Path, PathBuf};

/// The guest kernel: `MICROVM_KERNEL`, else `<repo>/build/vmlinux`.
pub fn default_kernel() -> PathBuf {
    from_env_or_build("MICROVM_KERNEL", "vmlinux")
}

/// The initrd: `MICROVM_INITRD`, else `<repo>/build/initrd.cpio`.
pub fn default_initrd() -> PathBuf {
    from_env_or_build("MICROVM_INITRD", "initrd.cpio")
}

/// The folder of test guest ELFs: `MICROVM_GUEST_DIR`, else `<repo>/build/guests`.
pub fn default_guest_dir() -> PathBuf {
    from_env_or_build("MICROVM_GUEST_DIR", "guests")
}

fn from_env_or_build(var: &str, name: &str) -> PathBuf {
    match env::var_os(var) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => build_dir().join(name),
    }
}

/// `<repo>/build`, from the running binary's path; `./build` when that cannot be told.
pub fn build_dir() -> PathBuf {
    env::current_exe()
        .ok()
        .and_then(|exe| repo_of_exe(&exe))
        .map(|repo| repo.join("build"))
        .unwrap_or_else(|| PathBuf::from("build"))
}

/// `<repo>` for an executable at `<repo>/target/[<triple>/]<profile>[/deps]/<bin>`.
fn repo_of_exe(exe: &Path) -> Option<PathBuf> {
    exe.ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "target"))
        .and_then(|t| t.parent())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_repo_from_target_paths() {
        assert_eq!(
            repo_of_exe(Path::new("/src/microvm/target/release/microvm")),
            Some(PathBuf::from("/src/microvm"))
        );
        assert_eq!(
            repo_of_exe(Path::new("/r/target/release/deps/host-abc")),
            Some(PathBuf::from("/r"))
        );
        assert_eq!(repo_of_exe(Path::new("/usr/bin/microvm")), None);
    }
}
