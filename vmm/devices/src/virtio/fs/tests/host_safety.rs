//! Host-side file safety (`policy/`) through the whole device: what a hostile guest could
//! plant on the host (device nodes, set-ID files, file capabilities, writes into an image's
//! set-ID file), what is left to the kernel, and the serving thread's confinement. Uses the
//! simulated guest driver of the device tests.

use super::*;

/// `new_encode_dev(major, minor)`: how a Linux guest puts a device number in MKNOD.
fn guest_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

fn host_meta(p: &Path) -> Option<std::fs::Metadata> {
    std::fs::symlink_metadata(p).ok()
}

/// A file made by the host (as an image's set-ID binary would be) with exactly `mode`.
fn host_file(p: &Path, content: &[u8], mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(p, content).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    assert_eq!(host_mode(p) & 0o7777, mode);
}

/// The host's `security.capability` of `p`, if any.
fn host_file_caps(p: &Path) -> Option<Vec<u8>> {
    let path = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: both strings are NUL-terminated; the kernel writes at most buf.len() bytes.
    let n = unsafe {
        libc::lgetxattr(
            path.as_ptr(),
            c"security.capability".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

/// A VFS_CAP_REVISION_2 `security.capability` value granting `CAP_SETUID` (effective).
fn cap_setuid_value() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(0x0200_0000u32 | 1).to_le_bytes());
    v.extend_from_slice(&(1u32 << caps::Capability::CAP_SETUID.index()).to_le_bytes());
    v.extend_from_slice(&[0; 12]);
    v
}

impl Driver {
    fn mknod(
        &mut self,
        parent: u64,
        name: &str,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> Result<EntryOut, i32> {
        let mi = MknodIn {
            mode,
            rdev,
            umask,
            padding: 0,
        };
        let mut args = mi.as_slice().to_vec();
        args.extend(cname(name));
        self.call(Opcode::Mknod, parent, &args, 4096)
            .map(|b| parse(&b))
    }

    fn setattr(&mut self, node: u64, si: SetattrIn) -> Result<AttrOut, i32> {
        self.call(Opcode::Setattr, node, si.as_slice(), 4096)
            .map(|b| parse(&b))
    }

    fn chmod(&mut self, node: u64, mode: u32) -> Result<AttrOut, i32> {
        self.setattr(
            node,
            SetattrIn {
                valid: SetattrValid::MODE.bits(),
                mode,
                ..Default::default()
            },
        )
    }

    fn setxattr(&mut self, node: u64, name: &str, value: &[u8]) -> Result<(), i32> {
        let si = SetxattrIn {
            size: value.len() as u32,
            flags: 0,
        };
        let mut args = si.as_slice().to_vec();
        args.extend(cname(name));
        args.extend_from_slice(value);
        self.call(Opcode::Setxattr, node, &args, 4096).map(|_| ())
    }

    fn open_dir(&mut self, node: u64, flags: u32) -> Result<OpenOut, i32> {
        let oi = OpenIn {
            flags,
            fuse_flags: 0,
        };
        self.call(Opcode::Opendir, node, oi.as_slice(), 4096)
            .map(|b| parse(&b))
    }

    fn link(&mut self, node: u64, newparent: u64, newname: &str) -> Result<EntryOut, i32> {
        let li = LinkIn { oldnodeid: node };
        let mut args = li.as_slice().to_vec();
        args.extend(cname(newname));
        self.call(Opcode::Link, newparent, &args, 4096)
            .map(|b| parse(&b))
    }

    fn rename2(
        &mut self,
        olddir: u64,
        old: &str,
        newdir: u64,
        new: &str,
        flags: u32,
    ) -> Result<(), i32> {
        let ri = Rename2In {
            newdir,
            flags,
            padding: 0,
        };
        let mut args = ri.as_slice().to_vec();
        args.extend(cname(old));
        args.extend(cname(new));
        self.call(Opcode::Rename2, olddir, &args, 4096).map(|_| ())
    }
}

#[test]
fn device_nodes_are_refused_but_whiteouts_fifos_and_sockets_are_not() {
    let dir = TestDir::new("mknod");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let chr = libc::S_IFCHR;
    let blk = libc::S_IFBLK;
    let attacks: [(&str, u32, u32, u32); 9] = [
        ("mem", chr | 0o666, guest_dev(1, 1), 0o022), // /dev/mem
        ("kmem", chr | 0o600, guest_dev(1, 2), 0),
        ("null", chr | 0o666, guest_dev(1, 3), 0),
        ("zero-one", chr | 0o600, guest_dev(0, 1), 0), // major 0 is not enough
        ("big-minor", chr | 0o600, guest_dev(0, 0x100), 0),
        ("sda", blk | 0o660, guest_dev(8, 0), 0), // a host disk
        ("blk-zero", blk | 0o600, 0, 0),          // 0:0, but a block device
        ("dir", libc::S_IFDIR | 0o755, 0, 0),
        ("suid-fifo", libc::S_IFIFO | libc::S_ISUID | 0o644, 0, 0),
    ];
    for (name, mode, rdev, umask) in attacks {
        assert_eq!(
            g.mknod(ROOT_ID, name, mode, rdev, umask).err(),
            Some(libc::EPERM),
            "MKNOD {name} {mode:#o} {rdev:#x}"
        );
        assert!(
            host_meta(&dir.shared.join(name)).is_none(),
            "{name} on the host"
        );
    }
    assert_eq!(g.dev.stats().refused_by_policy, attacks.len() as u64);

    // What stays allowed: the overlayfs whiteout (0:0), FIFOs, sockets, regular files.
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let wo = g.mknod(ROOT_ID, "whiteout", chr, 0, 0o022).unwrap();
    assert_eq!(wo.attr.mode & libc::S_IFMT, libc::S_IFCHR);
    let m = host_meta(&dir.shared.join("whiteout")).unwrap();
    assert!(m.file_type().is_char_device());
    assert_eq!(m.rdev(), 0);
    g.mknod(ROOT_ID, "fifo", libc::S_IFIFO | 0o644, 0, 0o022)
        .unwrap();
    assert!(host_meta(&dir.shared.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    g.mknod(ROOT_ID, "sock", libc::S_IFSOCK | 0o755, 0, 0o022)
        .unwrap();
    assert!(host_meta(&dir.shared.join("sock"))
        .unwrap()
        .file_type()
        .is_socket());
    g.mknod(ROOT_ID, "plain", libc::S_IFREG | 0o755, 0, 0o022)
        .unwrap();
    assert_eq!(host_mode(&dir.shared.join("plain")), libc::S_IFREG | 0o755);
    // RENAME_WHITEOUT (overlayfs renaming a lower file) leaves a 0:0 whiteout behind.
    g.rename2(ROOT_ID, "plain", ROOT_ID, "moved", libc::RENAME_WHITEOUT)
        .unwrap();
    let m = host_meta(&dir.shared.join("plain")).unwrap();
    assert!(m.file_type().is_char_device() && m.rdev() == 0);
    assert_eq!(g.dev.stats().refused_by_policy, attacks.len() as u64);
}

#[test]
fn set_id_files_cannot_be_created() {
    let dir = TestDir::new("setid-create");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let rw_creat = (libc::O_RDWR | libc::O_CREAT) as u32;
    // (name, mode, umask): the umask cannot be used to hide the bit from the check.
    for (name, mode, umask) in [
        ("suid", 0o4755, 0o022),
        ("sgid", 0o2755, 0o022),
        ("both", 0o6755, 0o022),
        ("suid-typed", libc::S_IFREG | 0o4755, 0o022),
        ("suid-umask", 0o4755, 0o4022),
        ("sgid-noexec", 0o2644, 0o022),
    ] {
        assert_eq!(
            g.create_with(ROOT_ID, name, mode, rw_creat, umask).err(),
            Some(libc::EPERM),
            "CREATE {name} {mode:#o}"
        );
        assert!(host_meta(&dir.shared.join(name)).is_none(), "{name}");
        assert_eq!(
            g.mknod(ROOT_ID, name, mode, 0, umask).err(),
            Some(libc::EPERM),
            "MKNOD {name} {mode:#o}"
        );
        assert!(host_meta(&dir.shared.join(name)).is_none(), "{name}");
    }
    assert_eq!(
        g.mkdir_mode(ROOT_ID, "suid-dir", 0o4755).err(),
        Some(libc::EPERM)
    );
    assert!(host_meta(&dir.shared.join("suid-dir")).is_none());

    // Allowed: plain modes, and a set-group-ID directory (group inheritance only).
    let (e, o) = g
        .create_with(ROOT_ID, "tool", 0o755, rw_creat, 0o022)
        .unwrap();
    g.release(e.nodeid, o.fh);
    assert_eq!(host_mode(&dir.shared.join("tool")), libc::S_IFREG | 0o755);
    g.mkdir_mode(ROOT_ID, "team", 0o2775).unwrap();
    let m = host_mode(&dir.shared.join("team"));
    assert_eq!(m & (libc::S_IFMT | libc::S_ISUID), libc::S_IFDIR);
    assert_eq!(g.dev.stats().refused_by_policy, 13);
}

#[test]
fn chmod_cannot_add_set_id_bits() {
    let dir = TestDir::new("setid-chmod");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let (f, o) = g.create(ROOT_ID, "tool", 0o755).unwrap();
    g.release(f.nodeid, o.fh);
    let tool = dir.shared.join("tool");
    for mode in [
        0o4755,
        0o2755,
        0o6755,
        0o4000,
        libc::S_IFREG | 0o4755,
        // The guest claims a directory: the host inode's type decides.
        libc::S_IFDIR | 0o2755,
        libc::S_IFDIR | 0o4755,
    ] {
        assert_eq!(
            g.chmod(f.nodeid, mode).err(),
            Some(libc::EPERM),
            "{mode:#o}"
        );
        assert_eq!(host_mode(&tool), libc::S_IFREG | 0o755, "{mode:#o}");
    }
    // With an owner change in the same request: nothing of it happens.
    let both = SetattrIn {
        valid: (SetattrValid::MODE | SetattrValid::UID | SetattrValid::GID).bits(),
        mode: 0o4755,
        uid: 1234,
        gid: 1234,
        ..Default::default()
    };
    assert_eq!(g.setattr(f.nodeid, both).err(), Some(libc::EPERM));
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&tool).unwrap().uid(), 0);
    // Through an open handle (FATTR_FH) too.
    let o = g.open(f.nodeid, libc::O_RDONLY as u32).unwrap();
    let with_fh = SetattrIn {
        valid: (SetattrValid::MODE).bits() | fuse_backend_rs::abi::fuse_abi::FATTR_FH,
        fh: o.fh,
        mode: 0o4755,
        ..Default::default()
    };
    assert_eq!(g.setattr(f.nodeid, with_fh).err(), Some(libc::EPERM));
    g.release(f.nodeid, o.fh);
    assert_eq!(host_mode(&tool), libc::S_IFREG | 0o755);

    // Allowed: permission bits, removing set-ID bits, S_ISGID and the sticky bit on a directory.
    g.chmod(f.nodeid, 0o700).unwrap();
    assert_eq!(host_mode(&tool), libc::S_IFREG | 0o700);
    host_file(&dir.shared.join("image-suid"), b"x", 0o4755);
    let img = g.lookup(ROOT_ID, "image-suid").unwrap();
    assert_eq!(g.chmod(img.nodeid, 0o4750).err(), Some(libc::EPERM));
    g.chmod(img.nodeid, 0o755).unwrap();
    assert_eq!(
        host_mode(&dir.shared.join("image-suid")),
        libc::S_IFREG | 0o755
    );
    let d = g.mkdir(ROOT_ID, "shared-dir").unwrap();
    g.chmod(d.nodeid, 0o2775).unwrap();
    assert_eq!(
        host_mode(&dir.shared.join("shared-dir")),
        libc::S_IFDIR | 0o2775
    );
    g.chmod(d.nodeid, 0o1777).unwrap();
    assert_eq!(
        host_mode(&dir.shared.join("shared-dir")),
        libc::S_IFDIR | 0o1777
    );
    assert_eq!(g.chmod(d.nodeid, 0o4755).err(), Some(libc::EPERM));
    assert_eq!(g.dev.stats().refused_by_policy, 11);
}

#[test]
fn file_capabilities_are_refused() {
    let dir = TestDir::new("fcaps");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let (f, o) = g.create(ROOT_ID, "tool", 0o755).unwrap();
    g.release(f.nodeid, o.fh);
    assert_eq!(
        g.setxattr(f.nodeid, "security.capability", &cap_setuid_value())
            .err(),
        Some(libc::EPERM)
    );
    assert_eq!(host_file_caps(&dir.shared.join("tool")), None);
    assert_eq!(g.dev.stats().refused_by_policy, 1);
    // Other names reach the passthrough, which has xattrs off.
    assert_eq!(
        g.setxattr(f.nodeid, "user.x", b"1").err(),
        Some(libc::ENOSYS)
    );
}

/// The policy itself, over a passthrough with xattrs on (as a later change might configure it),
/// called directly on this thread (whose capabilities no device has dropped).
#[test]
fn file_capabilities_are_refused_with_xattrs_on() {
    use fuse_backend_rs::api::filesystem::{Context, FileSystem, FsOptions};
    use fuse_backend_rs::passthrough::{Config, PassthroughFs};
    let dir = TestDir::new("fcaps-xattr");
    host_file(&dir.shared.join("tool"), b"#!/bin/sh\n", 0o755);
    let cfg = Config {
        root_dir: dir.shared.to_str().unwrap().to_owned(),
        do_import: true,
        xattr: true,
        ..Default::default()
    };
    let fs = policy::HostPolicy::new(PassthroughFs::<()>::new(cfg).unwrap());
    fs.init(FsOptions::empty()).unwrap();
    let ctx = Context::default();
    let e = fs.lookup(&ctx, ROOT_ID, c"tool").unwrap();
    let err = fs
        .setxattr(
            &ctx,
            e.inode,
            c"security.capability",
            &cap_setuid_value(),
            0,
        )
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    assert_eq!(host_file_caps(&dir.shared.join("tool")), None);
    // Other names are delegated.
    fs.setxattr(&ctx, e.inode, c"user.note", b"kept", 0)
        .unwrap();
    assert_eq!(fs.refused(), 1);
}

#[test]
fn opening_a_set_id_file_for_writing_clears_its_bits() {
    let dir = TestDir::new("setid-write");
    for name in ["su", "su-trunc", "su-size", "su-create"] {
        host_file(&dir.shared.join(name), b"\x7fELF real", 0o4755);
    }
    host_file(&dir.shared.join("sg"), b"\x7fELF real", 0o2755);
    // S_ISGID without group-execute is not set-group-ID (the kernel keeps it too).
    host_file(&dir.shared.join("sg-noexec"), b"data", 0o2644);
    let mut g = Driver::new(&dir.shared);
    g.init();
    let path = |n: &str| dir.shared.join(n);

    // Reading keeps the bits.
    let su = g.lookup(ROOT_ID, "su").unwrap();
    let o = g.open(su.nodeid, libc::O_RDONLY as u32).unwrap();
    g.release(su.nodeid, o.fh);
    assert_eq!(host_mode(&path("su")) & 0o7777, 0o4755);
    // An open that can write clears them before the guest writes a byte.
    let o = g.open(su.nodeid, libc::O_WRONLY as u32).unwrap();
    assert_eq!(host_mode(&path("su")) & 0o7777, 0o755);
    assert_eq!(g.write(su.nodeid, o.fh, 0, b"pwn!").unwrap(), 4);
    g.release(su.nodeid, o.fh);
    assert_eq!(std::fs::read(path("su")).unwrap(), b"pwn! real");
    assert_eq!(host_mode(&path("su")) & 0o7777, 0o755);

    let sg = g.lookup(ROOT_ID, "sg").unwrap();
    let o = g.open(sg.nodeid, libc::O_RDWR as u32).unwrap();
    g.release(sg.nodeid, o.fh);
    assert_eq!(host_mode(&path("sg")) & 0o7777, 0o755);

    let t = g.lookup(ROOT_ID, "su-trunc").unwrap();
    let o = g
        .open(t.nodeid, (libc::O_RDONLY | libc::O_TRUNC) as u32)
        .unwrap();
    g.release(t.nodeid, o.fh);
    assert_eq!(host_mode(&path("su-trunc")) & 0o7777, 0o755);

    // Truncation by SETATTR, without a handle.
    let s = g.lookup(ROOT_ID, "su-size").unwrap();
    let size = SetattrIn {
        valid: SetattrValid::SIZE.bits(),
        size: 0,
        ..Default::default()
    };
    g.setattr(s.nodeid, size).unwrap();
    assert_eq!(host_mode(&path("su-size")) & 0o7777, 0o755);
    assert_eq!(std::fs::metadata(path("su-size")).unwrap().len(), 0);

    // CREATE without O_EXCL of an existing name opens that file.
    let (e, o) = g
        .create_with(ROOT_ID, "su-create", 0o644, libc::O_RDWR as u32, 0o022)
        .unwrap();
    g.release(e.nodeid, o.fh);
    assert_eq!(host_mode(&path("su-create")) & 0o7777, 0o755);

    let n = g.lookup(ROOT_ID, "sg-noexec").unwrap();
    let o = g.open(n.nodeid, libc::O_RDWR as u32).unwrap();
    g.release(n.nodeid, o.fh);
    assert_eq!(host_mode(&path("sg-noexec")) & 0o7777, 0o2644);
    assert_eq!(g.dev.stats().refused_by_policy, 0);
}

#[test]
fn open_requests_cannot_create_files() {
    let dir = TestDir::new("open-creat");
    std::fs::write(dir.shared.join("f"), b"x").unwrap();
    std::fs::create_dir(dir.shared.join("d")).unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let f = g.lookup(ROOT_ID, "f").unwrap();
    let d = g.lookup(ROOT_ID, "d").unwrap();
    let tmpfile = (libc::O_TMPFILE | libc::O_RDWR) as u32;
    assert_eq!(
        g.open(f.nodeid, (libc::O_RDWR | libc::O_CREAT) as u32)
            .err(),
        Some(libc::EPERM)
    );
    // O_TMPFILE on a directory inode would make an unnamed host file with whatever mode.
    assert_eq!(g.open(d.nodeid, tmpfile).err(), Some(libc::EPERM));
    assert_eq!(g.open_dir(d.nodeid, tmpfile).err(), Some(libc::EPERM));
    assert_eq!(
        g.create_with(ROOT_ID, "d", 0o644, tmpfile, 0o022).err(),
        Some(libc::EPERM)
    );
    assert_eq!(g.dev.stats().refused_by_policy, 4);
    // Plain opens still work.
    let o = g.open(f.nodeid, libc::O_RDWR as u32).unwrap();
    g.release(f.nodeid, o.fh);
    assert!(g.list(d.nodeid).is_empty());
}

#[test]
fn chown_and_link_of_a_set_id_file_are_left_to_the_kernel() {
    let dir = TestDir::new("setid-chown");
    host_file(&dir.shared.join("su"), b"x", 0o4755);
    host_file(&dir.shared.join("su2"), b"x", 0o6755);
    let mut g = Driver::new(&dir.shared);
    g.init();
    // chown clears S_ISUID (and S_ISGID with group-execute) for every caller.
    let su = g.lookup(ROOT_ID, "su").unwrap();
    let chown = SetattrIn {
        valid: (SetattrValid::UID | SetattrValid::GID).bits(),
        uid: 0,
        gid: 0,
        ..Default::default()
    };
    let a = g.setattr(su.nodeid, chown).unwrap();
    assert_eq!(a.attr.mode & 0o7777, 0o755);
    assert_eq!(host_mode(&dir.shared.join("su")) & 0o7777, 0o755);
    // A hard link adds a name to an inode the guest already reaches, with the bits it has.
    let su2 = g.lookup(ROOT_ID, "su2").unwrap();
    let l = g.link(su2.nodeid, ROOT_ID, "su2-link").unwrap();
    assert_eq!(l.attr.ino, su2.attr.ino);
    assert_eq!(g.dev.stats().refused_by_policy, 0);
}

/// The kernel's line: the thread that served requests has no CAP_MKNOD, CAP_SETFCAP or
/// CAP_FSETID (effective or permitted), so even a request the policy missed could not make a
/// device node or a file capability, or keep set-ID bits on a write; other threads keep theirs.
#[test]
fn the_serving_thread_gives_up_mknod_setfcap_and_fsetid() {
    use caps::{CapSet, Capability};
    let dir = TestDir::new("caps");
    // A thread started before the device served keeps its capabilities.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let other = std::thread::spawn(move || {
        rx.recv().unwrap();
        caps::has_cap(None, CapSet::Permitted, Capability::CAP_MKNOD).unwrap()
    });
    assert!(caps::has_cap(None, CapSet::Effective, Capability::CAP_MKNOD).unwrap());
    let mut g = Driver::new(&dir.shared);
    g.init();
    for cap in policy::DROPPED_CAPABILITIES {
        for set in [CapSet::Effective, CapSet::Permitted, CapSet::Inheritable] {
            assert!(!caps::has_cap(None, set, cap).unwrap(), "{cap} in {set:?}");
        }
    }
    // What the passthrough needs to serve guest root stays.
    for cap in [
        Capability::CAP_CHOWN,
        Capability::CAP_DAC_OVERRIDE,
        Capability::CAP_FOWNER,
        Capability::CAP_SETUID,
        Capability::CAP_SETGID,
    ] {
        assert!(
            caps::has_cap(None, CapSet::Effective, cap).unwrap(),
            "{cap}"
        );
    }
    tx.send(()).unwrap();
    assert!(other.join().unwrap(), "another thread lost CAP_MKNOD");

    // The host kernel now refuses this thread a device node, but not a whiteout.
    let p = |n: &str| std::ffi::CString::new(dir.shared.join(n).as_os_str().as_bytes()).unwrap();
    // SAFETY: NUL-terminated path; mknod writes no memory of ours.
    let r = unsafe {
        libc::mknod(
            p("mem").as_ptr(),
            libc::S_IFCHR | 0o600,
            libc::makedev(1, 1),
        )
    };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EPERM)
    );
    // SAFETY: as above.
    let r = unsafe { libc::mknod(p("wo").as_ptr(), libc::S_IFCHR, 0) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    // A write by this thread clears S_ISUID (no CAP_FSETID to keep it).
    host_file(&dir.shared.join("su"), b"x", 0o4755);
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.shared.join("su"))
        .unwrap()
        .write_all(b"y")
        .unwrap();
    assert_eq!(host_mode(&dir.shared.join("su")) & 0o7777, 0o755);
    // After a request under another uid (setresuid and back) the capabilities stay dropped.
    // (uid 1000 may create in the share: it was 0777 only while a guest's INIT had cleared the
    // process's umask, before each serving thread got one of its own.)
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir.shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (f, o) = g.create(ROOT_ID, "as-1000", 0o644).unwrap();
    g.release(f.nodeid, o.fh);
    let mut h = g.header(Opcode::Mkdir as u32, ROOT_ID, 0);
    h.uid = 1000;
    h.gid = 1000;
    let mi = MkdirIn {
        mode: 0o755,
        umask: 0,
    };
    let mut args = mi.as_slice().to_vec();
    args.extend(cname("owned-by-1000"));
    h.len = (HDR + args.len()) as u32;
    let (_, out) = g.send_bytes(h.as_slice(), &args, 4096);
    assert_eq!(parse::<OutHeader>(&out).error, 0);
    assert!(!caps::has_cap(None, CapSet::Effective, Capability::CAP_MKNOD).unwrap());
    assert!(caps::has_cap(None, CapSet::Effective, Capability::CAP_CHOWN).unwrap());
}

/// READ and WRITE carry the guest's file flags. The passthrough applied flags that differ from
/// the open's with `fcntl(F_SETFL)` and, when that failed, closed the handle's descriptor while
/// the handle kept its number (found by the `virtio_fs` fuzz target): the next descriptor the
/// process opened took that number and the guest's handle reached it. On the code before the
/// fix the directory handle below is dead after the READ (its READDIR fails with EBADF), and the
/// `O_PATH` open, the fuzzer's way there, is served.
#[test]
fn a_read_or_write_with_other_flags_never_closes_the_handles_descriptor() {
    let dir = TestDir::new("flags");
    std::fs::write(dir.shared.join("f"), b"content").unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let oo: OpenOut = parse(
        &g.call(Opcode::Opendir, ROOT_ID, OpenIn::default().as_slice(), 4096)
            .expect("OPENDIR"),
    );
    let readdir = |g: &mut Driver| {
        let ri = ReadIn {
            fh: oo.fh,
            size: 4096,
            ..Default::default()
        };
        g.call(
            Opcode::Readdir,
            ROOT_ID,
            ri.as_slice(),
            4096 + OUT_HDR as u32,
        )
    };
    assert!(!readdir(&mut g).expect("READDIR").is_empty());
    // O_DIRECT on a directory's descriptor: F_SETFL would fail with EINVAL.
    let direct = libc::O_DIRECT as u32;
    let ri = ReadIn {
        fh: oo.fh,
        size: 16,
        flags: direct,
        ..Default::default()
    };
    let _ = g.call(Opcode::Read, ROOT_ID, ri.as_slice(), 16 + OUT_HDR as u32);
    assert!(
        readdir(&mut g).is_ok(),
        "a READ with O_DIRECT closed the directory handle's descriptor"
    );
    let wi = WriteIn {
        fh: oo.fh,
        size: 1,
        flags: direct,
        ..Default::default()
    };
    let mut args = wi.as_slice().to_vec();
    args.push(b'x');
    let _ = g.call(Opcode::Write, ROOT_ID, &args, 4096);
    assert!(
        readdir(&mut g).is_ok(),
        "a WRITE with O_DIRECT closed the directory handle's descriptor"
    );
    // A READ on a handle the guest does not hold is EBADF.
    let ri = ReadIn {
        fh: oo.fh + 1000,
        size: 16,
        ..Default::default()
    };
    assert_eq!(
        g.call(Opcode::Read, ROOT_ID, ri.as_slice(), 64),
        Err(libc::EBADF)
    );
    // An O_PATH open (no FUSE open needs one; every F_SETFL on it fails) is refused.
    let e = g.lookup(ROOT_ID, "f").unwrap();
    assert_eq!(
        g.open(e.nodeid, (libc::O_RDWR | libc::O_PATH) as u32)
            .map(|o| o.fh),
        Err(libc::EPERM)
    );
    // A file's handle still reads with whatever flags the READ carries.
    let o = g.open(e.nodeid, libc::O_RDONLY as u32).unwrap();
    let ri = ReadIn {
        fh: o.fh,
        size: 16,
        flags: direct | libc::O_NOATIME as u32,
        ..Default::default()
    };
    assert_eq!(
        g.call(Opcode::Read, e.nodeid, ri.as_slice(), 16 + OUT_HDR as u32)
            .unwrap(),
        b"content"
    );
    g.release(e.nodeid, o.fh);
    assert_eq!(
        g.call(Opcode::Read, e.nodeid, ri.as_slice(), 64),
        Err(libc::EBADF),
        "a released handle"
    );
}
