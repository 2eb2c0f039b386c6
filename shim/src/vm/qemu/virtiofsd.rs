//! The Rust virtiofsd as the QEMU backend runs it: its command line ([`virtiofsd_args`]) and
//! the capabilities it gives up, keeps and may ever hold, and its file limit. `launch` starts
//! it confined (`process::confine_helper`) with these.

use std::path::Path;

/// Capabilities virtiofsd gives up (`--modcaps`): of its default set (`chown`, `dac_override`,
/// `fowner`, `fsetid`, `setgid`, `setuid`, `mknod`, `setfcap`) no device nodes but the 0:0
/// overlay whiteout (`mknod`), no file capabilities (`setfcap`), and set-ID bits cleared on every
/// write and truncate (`fsetid`). It keeps `chown`, `dac_override`, `fowner`, `setgid` and
/// `setuid`, which serving guest root's files as their owners needs ([`VIRTIOFSD_KEPT_CAPS`]).
pub const VIRTIOFSD_MODCAPS: &str = "-mknod:-setfcap:-fsetid";

/// The capabilities virtiofsd's every thread holds once it serves (bit n: capability n of
/// linux/capability.h): `chown`, `dac_override`, `fowner`, `setgid`, `setuid`.
pub const VIRTIOFSD_KEPT_CAPS: u64 = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 6) | (1 << 7);

/// The capabilities virtiofsd may ever hold: what it keeps to serve the guest's files
/// ([`VIRTIOFSD_KEPT_CAPS`]) and what it uses once at its start, before it has a thread
/// besides its main one or reads anything of the guest's (`sys_chroot` for `--sandbox chroot`,
/// `setpcap` for emptying its bounding set as it drops the rest). Nothing else is there to
/// keep: no `dac_read_search` (`--inode-file-handles=never`), no `sys_admin` (no
/// `--sandbox namespace`), no `sys_resource` (the shim sets its file limit).
pub(super) const VIRTIOFSD_BOUNDING: u64 = {
    // linux/capability.h
    const CHOWN: u32 = 0;
    const DAC_OVERRIDE: u32 = 1;
    const FOWNER: u32 = 3;
    const SETGID: u32 = 6;
    const SETUID: u32 = 7;
    const SETPCAP: u32 = 8;
    const SYS_CHROOT: u32 = 18;
    (1 << CHOWN)
        | (1 << DAC_OVERRIDE)
        | (1 << FOWNER)
        | (1 << SETGID)
        | (1 << SETUID)
        | (1 << SETPCAP)
        | (1 << SYS_CHROOT)
};

/// virtiofsd's `RLIMIT_NOFILE` at most: what it used to raise its own limit to (it holds a
/// file per inode the guest looks up); the shim sets it (within its own hard limit) so that
/// virtiofsd needs no `CAP_SYS_RESOURCE`.
pub(super) const VIRTIOFSD_MAX_FILES: u64 = 1_000_000;

/// The Rust virtiofsd's command line for `source` on `socket` (docs/qemu-backend.md has each
/// option against the C virtiofsd's it replaces):
/// - `--sandbox=chroot`: it serves from the host's mount namespace, so the mounts the shim makes
///   under the directory later (container rootfs, volumes) are seen, and their unmounts too.
///   `--sandbox=namespace` serves from a private copy of the mount namespace, which sees later
///   mounts only through mount propagation (none on hosts whose `/` is private) and would keep
///   unmounted container mounts alive; it also needs `sys_admin` at its start.
/// - `--seccomp=kill`: a system call outside its filter kills the process (its default, made
///   explicit). The filter and the capability drop come before its first thread.
/// - `--inode-file-handles=never`: file handles would add `dac_read_search` to the kept
///   capabilities, and with it `open_by_handle_at`, which opens any inode of the share's file
///   systems whatever the chroot.
/// - `--modcaps`: [`VIRTIOFSD_MODCAPS`].
/// - no `--xattr`, `--posix-acl`, `--security-label` or `--xattrmap`: every SETXATTR is refused,
///   `security.capability` included.
/// - `--no-announce-submounts`: the guest sees the share as one file system, as before (its
///   kernel makes no automount per host mount point).
/// - `--rlimit-nofile=0`: the limit the shim set is kept (its capability bounding set has no
///   `CAP_SYS_RESOURCE`).
/// - `--cache=auto`, `--log-level=warn`.
///
/// What it cannot refuse: `chmod u+s`/`g+s` and set-ID modes at creation (docs/qemu-backend.md).
pub fn virtiofsd_args(socket: &Path, source: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "--shared-dir".into(),
        source.into(),
        "--socket-path".into(),
        socket.into(),
    ];
    let modcaps = format!("--modcaps={VIRTIOFSD_MODCAPS}");
    for opt in [
        "--sandbox=chroot",
        "--seccomp=kill",
        "--inode-file-handles=never",
        modcaps.as_str(),
        "--no-announce-submounts",
        "--cache=auto",
        // The shim sets its file limit ([`VIRTIOFSD_MAX_FILES`]): raising it would need
        // a capability it does not get.
        "--rlimit-nofile=0",
        "--log-level=warn",
    ] {
        args.push(opt.into());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtiofsd_gets_the_host_safety_options() {
        let args: Vec<String> = virtiofsd_args(Path::new("/w/fs.sock"), Path::new("/r/shared"))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--shared-dir",
                "/r/shared",
                "--socket-path",
                "/w/fs.sock",
                "--sandbox=chroot",
                "--seccomp=kill",
                "--inode-file-handles=never",
                "--modcaps=-mknod:-setfcap:-fsetid",
                "--no-announce-submounts",
                "--cache=auto",
                "--rlimit-nofile=0",
                "--log-level=warn",
            ]
        );
        // Nothing that turns xattrs on, and none of the C virtiofsd's `-o` options.
        for a in &args {
            assert!(
                ![
                    "--xattr",
                    "--xattrmap",
                    "--posix-acl",
                    "--security-label",
                    "-o"
                ]
                .iter()
                .any(|bad| a.starts_with(bad)),
                "{a}"
            );
        }
        // The kept set is what the default set less the modcaps leaves, and it and the start-up
        // capabilities are all the shim's bounding set holds.
        assert_eq!(
            VIRTIOFSD_BOUNDING & !VIRTIOFSD_KEPT_CAPS,
            (1 << 8) | (1 << 18),
            "setpcap and sys_chroot"
        );
    }
}
