//! virtio-fs: FUSE requests through the real device (`vmm_devices::virtio::fs::VirtioFs`): its
//! chain checks, fuse-backend-rs's server and the host-safety policy (`fs/policy/`) in front
//! of the passthrough, on a scratch share as host root.
//!
//! Each input starts from the same share (a file, a directory, a symlink out of the share, a
//! set-user-ID file "from the image") with a canary directory beside it. Tape: queue sizes,
//! whether the driver sends INIT first, then operations: FUSE requests (opcode, node and handles
//! learnt from earlier replies patched into the arguments, the rest raw), raw chains, FORGETs on
//! the high-priority queue, resets.
//!
//! After every input the host is checked: the canary and the scratch root are as they were
//! (nothing escaped the share), and the share holds no device node but the 0:0 whiteout, no
//! set-user-ID anything, no set-group-ID non-directory, no file capability, and the image's
//! set-user-ID file kept its bit only if its content is untouched.
#![no_main]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, serve_until_idle, Desc, Driver, DATA_BASE};
use vmm_devices::virtio::fs::{VirtioFs, HIPRIO_QUEUE, QUEUE_SIZE, REQUEST_QUEUE};
use vmm_devices::virtio::VirtioDevice;

/// FUSE opcodes the operations pick from (a raw one with the high bit of the selector).
const OPCODES: [u32; 39] = [
    1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22, 23, 24, 25, 26, 27, 28,
    29, 30, 34, 35, 36, 38, 39, 42, 43, 44, 45, 46, 47,
];
const FUSE_INIT: u32 = 26;
const FUSE_FORGET: u32 = 2;
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
const ENTRY_OUT: usize = 128;
/// Where request and reply buffers go (offsets into the data region).
const REQ_AT: u64 = 0x1000;
const REPLY_AT: u64 = 0x8_0000;
const SUID_CONTENT: &[u8] = b"#!/bin/sh\necho from the image\n";

struct Harness {
    driver: Driver,
    dev: VirtioFs,
    nodes: Vec<u64>,
    handles: Vec<u64>,
    unique: u64,
}

impl Harness {
    fn activate(&mut self) {
        self.dev.set_acked_features(self.dev.avail_features());
        let queues = (0..2)
            .map(|i| self.driver.device_queue(i, QUEUE_SIZE))
            .collect();
        self.dev
            .activate(self.driver.mem.clone(), queues, self.driver.irq.clone())
            .expect("activation");
    }

    fn serve(&mut self, q: usize) {
        serve_until_idle(&self.driver, &mut self.dev, q, |d| d.process_queue(q));
    }

    /// Sends one request and returns its reply (what the device wrote).
    fn request(
        &mut self,
        q: usize,
        header: &[u8],
        args: &[u8],
        reply_len: u32,
        split: bool,
    ) -> Vec<u8> {
        let mut chain = if split {
            vec![
                Desc::readable(REQ_AT, header),
                Desc::readable(REQ_AT + 0x2_0000, args),
            ]
        } else {
            let mut all = header.to_vec();
            all.extend_from_slice(args);
            vec![Desc::readable(REQ_AT, &all)]
        };
        if reply_len > 0 {
            chain.push(Desc::writable(REPLY_AT, reply_len));
        }
        let Some(head) = self.driver.add_chain(q, &chain) else {
            return Vec::new();
        };
        self.serve(q);
        let used = self.driver.take_used(q);
        match used.iter().find(|(id, _)| *id == u32::from(head)) {
            Some(&(_, len)) if len > 0 => self
                .driver
                .read_mem(DATA_BASE + REPLY_AT, len.min(reply_len) as usize),
            _ => Vec::new(),
        }
    }

    fn header(&mut self, len: u32, opcode: u32, nodeid: u64, uid: u32, gid: u32) -> Vec<u8> {
        self.unique += 1;
        let mut h = Vec::with_capacity(IN_HEADER);
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&opcode.to_le_bytes());
        h.extend_from_slice(&self.unique.to_le_bytes());
        h.extend_from_slice(&nodeid.to_le_bytes());
        h.extend_from_slice(&uid.to_le_bytes());
        h.extend_from_slice(&gid.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h
    }

    fn init(&mut self, flags: u32) {
        let mut args = Vec::new();
        for v in [7u32, 31, 0x2_0000, flags] {
            args.extend_from_slice(&v.to_le_bytes());
        }
        let h = self.header((IN_HEADER + args.len()) as u32, FUSE_INIT, 0, 0, 0);
        self.request(REQUEST_QUEUE, &h, &args, 4096, false);
    }

    fn pick(list: &[u64], sel: u8) -> u64 {
        if list.is_empty() {
            0
        } else {
            list[usize::from(sel) % list.len()]
        }
    }

    /// A FUSE request from the tape; learns nodes and handles from its reply.
    fn fuse_op(&mut self, t: &mut Tape<'_>) {
        let sel = t.u8();
        let opcode = if sel & 0x80 != 0 {
            t.u32()
        } else {
            OPCODES[usize::from(sel) % OPCODES.len()]
        };
        let flags = t.u8();
        let nodeid = if flags & 1 != 0 {
            t.u64()
        } else {
            Self::pick(&self.nodes, t.u8())
        };
        let (uid, gid) = if flags & 2 != 0 {
            (t.u32(), t.u32())
        } else {
            (0, 0)
        };
        let mut args = t.blob().to_vec();
        // Patches: learnt handles and nodes written over the raw arguments.
        for _ in 0..t.u8() % 4 {
            let at = usize::from(t.u8());
            let src = t.u8();
            let value = if src & 0x80 != 0 {
                Self::pick(&self.nodes, src)
            } else {
                Self::pick(&self.handles, src)
            };
            if let Some(slot) = args.get_mut(at..at + 8) {
                slot.copy_from_slice(&value.to_le_bytes());
            }
        }
        let len = if flags & 4 != 0 {
            t.u32()
        } else {
            (IN_HEADER + args.len()) as u32
        };
        let reply_len = if flags & 8 != 0 {
            u32::from(t.u16())
        } else {
            0x2_0000
        };
        let q = if opcode == FUSE_FORGET || flags & 16 != 0 {
            HIPRIO_QUEUE
        } else {
            REQUEST_QUEUE
        };
        let h = self.header(len, opcode, nodeid, uid, gid);
        let reply = self.request(q, &h, &args, reply_len, flags & 32 != 0);
        self.learn(opcode, &reply);
    }

    fn learn(&mut self, opcode: u32, reply: &[u8]) {
        if reply.len() < OUT_HEADER {
            return;
        }
        let error = i32::from_le_bytes(reply[4..8].try_into().expect("4 bytes"));
        if error != 0 {
            return;
        }
        let u64_at = |o: usize| {
            reply
                .get(o..o + 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let keep = |list: &mut Vec<u64>, v: Option<u64>| {
            if let Some(v) = v {
                if list.len() < 32 && !list.contains(&v) {
                    list.push(v);
                }
            }
        };
        match opcode {
            // LOOKUP, SYMLINK, MKNOD, MKDIR, LINK: an entry.
            1 | 6 | 8 | 9 | 13 => keep(&mut self.nodes, u64_at(OUT_HEADER)),
            // OPEN, OPENDIR: a handle.
            14 | 27 => keep(&mut self.handles, u64_at(OUT_HEADER)),
            // CREATE: an entry, then a handle.
            35 => {
                keep(&mut self.nodes, u64_at(OUT_HEADER));
                keep(&mut self.handles, u64_at(OUT_HEADER + ENTRY_OUT));
            }
            _ => {}
        }
    }
}

/// The share every input starts from, and the canary beside it.
fn lay_out(root: &Path) -> (std::path::PathBuf, u64) {
    let share = root.join("share");
    let outside = root.join("outside");
    std::fs::create_dir_all(share.join("d")).expect("share");
    std::fs::create_dir_all(&outside).expect("outside");
    std::fs::write(outside.join("canary"), b"canary").expect("canary");
    // Explicit modes: this thread serves the guest, whose INIT clears the thread's umask.
    std::fs::set_permissions(
        outside.join("canary"),
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    std::fs::write(share.join("f"), b"hello").expect("file");
    std::fs::write(share.join("d/g"), b"in d").expect("file in d");
    let _ = std::os::unix::fs::symlink("../outside/canary", share.join("l"));
    let suid = share.join("suid");
    std::fs::write(&suid, SUID_CONTENT).expect("suid file");
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
    let ino = std::fs::metadata(&suid).expect("suid file").ino();
    (share, ino)
}

/// The checks after each input (module doc).
fn check_host(root: &Path, share: &Path, suid_ino: u64) {
    let mut top: Vec<_> = std::fs::read_dir(root)
        .expect("scratch root")
        .map(|e| e.expect("entry").file_name())
        .collect();
    top.sort();
    assert_eq!(
        top,
        ["outside", "share"],
        "something appeared beside the share"
    );
    let outside: Vec<_> = std::fs::read_dir(root.join("outside"))
        .expect("outside")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(outside, ["canary"], "the canary's directory changed");
    let canary = root.join("outside/canary");
    assert_eq!(std::fs::read(&canary).expect("canary"), b"canary");
    let meta = std::fs::symlink_metadata(&canary).expect("canary");
    assert_eq!(meta.mode() & 0o7777, 0o644, "the canary's mode changed");
    walk(share, suid_ino);
}

fn walk(dir: &Path, suid_ino: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let mode = m.mode();
        let fmt = mode & libc::S_IFMT;
        match fmt {
            libc::S_IFBLK => panic!("a block device in the share: {path:?}"),
            libc::S_IFCHR => assert_eq!(m.rdev(), 0, "a character device in the share: {path:?}"),
            _ => {}
        }
        if mode & libc::S_ISUID != 0 {
            assert_eq!(m.ino(), suid_ino, "a new set-user-ID file: {path:?}");
            assert_eq!(
                std::fs::read(&path).ok().as_deref(),
                Some(SUID_CONTENT),
                "the image's set-user-ID file was written and kept its bit"
            );
        }
        if mode & libc::S_ISGID != 0 && fmt != libc::S_IFDIR {
            panic!("a set-group-ID non-directory: {path:?} {mode:o}");
        }
        if fmt != libc::S_IFLNK {
            assert!(
                !has_file_caps(&path),
                "a file capability in the share: {path:?}"
            );
        }
        if fmt == libc::S_IFDIR {
            walk(&path, suid_ino);
        }
    }
}

fn has_file_caps(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(p) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: lgetxattr with a NUL-terminated path and name, no buffer (size 0): it only
    // reports the value's size.
    let n = unsafe {
        libc::lgetxattr(
            p.as_ptr(),
            c"security.capability".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n >= 0
}

fn run(root: &Path, data: &[u8]) {
    let (share, suid_ino) = lay_out(root);
    let mut t = Tape::new(data);
    let sizes = [
        queue_size(t.u8(), QUEUE_SIZE),
        queue_size(t.u8(), QUEUE_SIZE),
    ];
    let dev = VirtioFs::new("fuzz", &share).expect("virtio-fs device");
    let mut h = Harness {
        driver: Driver::new(&sizes),
        dev,
        nodes: vec![1],
        handles: Vec::new(),
        unique: 0,
    };
    h.activate();
    if !t.bool() {
        let flags = t.u32();
        h.init(flags);
    }
    while !t.is_empty() {
        let op = t.u8() % 8;
        if h.driver.generic_op(op, &mut t) {
            continue;
        }
        match op {
            4 | 5 => h.fuse_op(&mut t),
            6 => {
                let q = usize::from(t.u8() % 2);
                h.serve(q);
                h.driver.take_all_used();
            }
            _ => {
                h.dev.reset();
                h.driver.strict = false;
                h.activate();
                h.nodes.truncate(1);
                h.handles.clear();
            }
        }
    }
    drop(h);
    check_host(root, &share, suid_ino);
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_fs);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("fs");
        run(dir.path(), data);
    }
);
