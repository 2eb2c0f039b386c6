//! The policy's rules as pure functions of a request's raw values: which MKNOD modes and
//! device numbers, SETATTR modes and open flags may pass, and which set-ID bits a write clears.
//! [`HostPolicy`](super::HostPolicy)'s requests (`filesystem.rs`) apply them; the table in the
//! [module doc](super) says what each request may do and why.

/// The file-capability xattr (`XATTR_NAME_CAPS`).
pub const XATTR_CAPABILITY: &[u8] = b"security.capability";

/// The set-ID bits.
pub(super) const SET_ID: u32 = libc::S_ISUID | libc::S_ISGID;
/// `O_TMPFILE` without the `O_DIRECTORY` it includes (the kernel's `__O_TMPFILE`).
pub(super) const TMPFILE_BIT: u32 = (libc::O_TMPFILE & !libc::O_DIRECTORY) as u32;

/// Whether MKNOD may create a node of `mode` and `rdev` (the raw request values).
pub fn mknod_allowed(mode: u32, rdev: u32) -> bool {
    if mode & SET_ID != 0 {
        return false;
    }
    match mode & libc::S_IFMT {
        // Type 0 is a regular file for mknod(2).
        0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK => true,
        // The overlayfs whiteout. FUSE carries the device number as a u32 (the guest's
        // new_encode_dev); 0 is 0:0 in every encoding.
        libc::S_IFCHR => rdev == 0,
        _ => false,
    }
}

/// Whether a SETATTR may give an inode of type `file_type` (`S_IFMT` bits of the host inode)
/// the mode `mode`.
pub fn mode_allowed(file_type: u32, mode: u32) -> bool {
    if mode & libc::S_ISUID != 0 {
        return false;
    }
    mode & libc::S_ISGID == 0 || file_type == libc::S_IFDIR
}

/// Whether an open with these flags (OPEN, OPENDIR) may go on: it must not create anything,
/// and it must not ask for an `O_PATH` descriptor (no FUSE open needs one, and the passthrough's
/// READ and WRITE would fail on it in a way that closes the handle's descriptor: see
/// [`HostPolicy`](super::HostPolicy)'s handle flags).
pub fn open_flags_allowed(flags: u32) -> bool {
    flags & (libc::O_CREAT as u32 | TMPFILE_BIT | libc::O_PATH as u32) == 0
}

/// Whether an open with these flags can change the file's content.
pub(super) fn open_can_write(flags: u32) -> bool {
    flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 || flags & libc::O_TRUNC as u32 != 0
}

/// The set-ID bits a write would make the kernel clear on a file of `mode` (for an
/// unprivileged writer): `S_ISUID`, and `S_ISGID` with group-execute; regular files only.
pub fn bits_killed_by_write(mode: u32) -> u32 {
    if mode & libc::S_IFMT != libc::S_IFREG {
        return 0;
    }
    let mut kill = mode & libc::S_ISUID;
    if mode & libc::S_ISGID != 0 && mode & libc::S_IXGRP != 0 {
        kill |= libc::S_ISGID;
    }
    kill
}

#[cfg(test)]
mod tests {
    use libc::{S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFREG, S_IFSOCK, S_ISGID, S_ISUID};

    use super::*;

    #[test]
    fn mknod_admits_files_fifos_sockets_and_the_whiteout_only() {
        for (mode, rdev) in [
            (0o644, 0),
            (S_IFREG | 0o644, 0),
            (S_IFIFO | 0o600, 0),
            (S_IFSOCK | 0o755, 0),
            (S_IFCHR | 0o600, 0),
        ] {
            assert!(mknod_allowed(mode, rdev), "{mode:#o} {rdev:#x}");
        }
        for (mode, rdev) in [
            (S_IFCHR | 0o600, 0x101),
            (S_IFCHR | 0o600, 0x100),
            (S_IFBLK | 0o600, 0),
            (S_IFBLK | 0o600, 0x800),
            (S_IFREG | S_ISUID | 0o755, 0),
            (S_IFIFO | S_ISGID | 0o600, 0),
            (S_IFCHR | S_ISUID, 0),
            (S_IFDIR | 0o755, 0),
            (S_IFLNK | 0o777, 0),
        ] {
            assert!(!mknod_allowed(mode, rdev), "{mode:#o} {rdev:#x}");
        }
    }

    #[test]
    fn setattr_modes_never_add_set_user_id_and_set_group_id_only_on_directories() {
        assert!(!mode_allowed(S_IFREG, S_ISUID | 0o755));
        assert!(!mode_allowed(S_IFDIR, S_ISUID | 0o755));
        assert!(!mode_allowed(S_IFREG, S_ISGID | 0o755));
        assert!(mode_allowed(S_IFDIR, S_ISGID | 0o775));
        assert!(mode_allowed(S_IFDIR, S_ISGID | libc::S_ISVTX | 0o777));
        assert!(mode_allowed(S_IFREG, libc::S_ISVTX | 0o777));
    }

    #[test]
    fn opens_create_nothing_and_ask_for_no_path_descriptor() {
        let flags = |f: libc::c_int| f as u32;
        for ok in [
            libc::O_RDONLY,
            libc::O_WRONLY | libc::O_TRUNC,
            libc::O_RDWR | libc::O_APPEND,
            libc::O_DIRECTORY,
        ] {
            assert!(open_flags_allowed(flags(ok)), "{ok:#x}");
        }
        for bad in [
            libc::O_CREAT,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
            libc::O_TMPFILE | libc::O_RDWR,
            libc::O_PATH,
        ] {
            assert!(!open_flags_allowed(flags(bad)), "{bad:#x}");
        }
        assert!(!open_can_write(flags(libc::O_RDONLY)));
        assert!(open_can_write(flags(libc::O_WRONLY)));
        assert!(open_can_write(flags(libc::O_RDWR)));
        assert!(open_can_write(flags(libc::O_RDONLY | libc::O_TRUNC)));
    }

    #[test]
    fn a_write_clears_set_user_id_and_executable_set_group_id_on_regular_files() {
        assert_eq!(bits_killed_by_write(S_IFREG | S_ISUID | 0o755), S_ISUID);
        assert_eq!(bits_killed_by_write(S_IFREG | S_ISGID | 0o755), S_ISGID);
        assert_eq!(
            bits_killed_by_write(S_IFREG | S_ISUID | S_ISGID | 0o755),
            S_ISUID | S_ISGID
        );
        // Set-group-ID without group-execute (the mandatory-locking marker) stays.
        assert_eq!(bits_killed_by_write(S_IFREG | S_ISGID | 0o745), 0);
        assert_eq!(bits_killed_by_write(S_IFREG | 0o755), 0);
        assert_eq!(bits_killed_by_write(S_IFDIR | S_ISUID | S_ISGID | 0o755), 0);
    }
}
