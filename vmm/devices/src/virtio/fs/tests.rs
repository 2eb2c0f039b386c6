//! Whole-device tests: a simulated guest FUSE driver builds requests in guest memory, posts them
//! as descriptor chains on virtqueues (virtio-queue's `MockSplitQueue`), notifies the device and
//! reads the replies back from the used ring, against a real host directory.

use std::ffi::OsStr;
use std::mem::size_of;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuse_backend_rs::abi::fuse_abi::{
    AttrOut, CreateIn, Dirent, EntryOut, ForgetIn, GetattrIn, InHeader, InitIn, InitOut, LinkIn,
    MkdirIn, MknodIn, Opcode, OpenIn, OpenOut, OutHeader, ReadIn, ReleaseIn, Rename2In, RenameIn,
    SetattrIn, SetattrValid, SetxattrIn, WriteIn, WriteOut, ROOT_ID,
};
use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, ByteValued, Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::virtio::{device_type, IrqTrigger, VirtioDevice};
use crate::GuestMemory;

const MEM_SIZE: usize = 16 << 20;
const HIPRIO_BASE: u64 = 0x1_0000;
const HIPRIO_LEN: u16 = 64;
const REQ_BASE: u64 = 0x2_0000;
const REQ_LEN: u16 = 1024;
/// Where the driver puts a request's readable part, and the reply buffer.
const IN_BASE: u64 = 0x10_0000;
const OUT_BASE: u64 = 0x40_0000;
const HDR: usize = size_of::<InHeader>();
const OUT_HDR: usize = size_of::<OutHeader>();

/// A directory under the temp dir, removed on drop; `shared` is what the device exports and
/// `outside` a file next to it that the guest must never reach.
struct TestDir {
    root: PathBuf,
    shared: PathBuf,
}

impl TestDir {
    fn new(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("virtiofs-t-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let shared = root.join("shared");
        std::fs::create_dir_all(&shared).unwrap();
        std::fs::write(root.join("outside-secret"), b"host only").unwrap();
        Self { root, shared }
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// What the device gave back for one chain.
#[derive(Debug)]
struct Used {
    len: u32,
}

/// A guest FUSE driver over fake guest memory.
struct Driver {
    mem: &'static GuestMemory,
    dev: VirtioFs,
    queues: [MockSplitQueue<'static, GuestMemory>; 2],
    next_desc: [u16; 2],
    used_seen: [u16; 2],
    unique: u64,
}

fn parse<T: ByteValued + Default>(b: &[u8]) -> T {
    let mut t = T::default();
    let n = size_of::<T>();
    assert!(b.len() >= n, "reply too short: {} < {n}", b.len());
    t.as_mut_slice().copy_from_slice(&b[..n]);
    t
}

fn cname(name: &str) -> Vec<u8> {
    let mut v = name.as_bytes().to_vec();
    v.push(0);
    v
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
}

impl Driver {
    fn new(shared: &Path) -> Self {
        // Leaked so the mock queues can borrow it for the whole test (a few MiB per test).
        let mem: &'static GuestMemory = Box::leak(Box::new(
            GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap(),
        ));
        let mut dev = VirtioFs::new("shared", shared).unwrap();
        let hiprio = MockSplitQueue::create(mem, GuestAddress(HIPRIO_BASE), HIPRIO_LEN);
        let req = MockSplitQueue::create(mem, GuestAddress(REQ_BASE), REQ_LEN);
        let queues: Vec<Queue> = vec![hiprio.create_queue().unwrap(), req.create_queue().unwrap()];
        let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        dev.set_acked_features(dev.avail_features());
        dev.activate(mem.clone(), queues, irq).unwrap();
        Self {
            mem,
            dev,
            queues: [hiprio, req],
            next_desc: [0; 2],
            used_seen: [0; 2],
            unique: 0,
        }
    }

    /// Puts raw descriptors (their `next` fields as given, relative indices shifted to where
    /// they are placed) on queue `q`, with the first as the head; notifies; returns the used
    /// entry, if the device gave the chain back.
    fn submit_raw(&mut self, q: usize, descs: &[RawDescriptor]) -> Option<Used> {
        let qlen = if q == HIPRIO_QUEUE {
            HIPRIO_LEN
        } else {
            REQ_LEN
        };
        let n = descs.len() as u16;
        assert!(n <= qlen);
        if self.next_desc[q] + n > qlen {
            self.next_desc[q] = 0;
        }
        let offset = self.next_desc[q];
        let shifted: Vec<RawDescriptor> = descs
            .iter()
            .map(|d| {
                let s = SplitDescriptor::from(*d);
                desc(
                    s.addr().0,
                    s.len(),
                    s.flags(),
                    s.next().wrapping_add(offset),
                )
            })
            .collect();
        // Every chain gets its own avail entry: write the table, then the ring entry by hand
        // (add_desc_chains would also add entries for descriptors that follow a non-NEXT one).
        for (i, d) in shifted.iter().enumerate() {
            self.queues[q]
                .desc_table()
                .store(offset + i as u16, *d)
                .unwrap();
        }
        let avail = self.queues[q].avail_addr();
        let idx: u16 = self.mem.read_obj(avail.unchecked_add(2)).unwrap();
        self.mem
            .write_obj(offset, avail.unchecked_add(4 + 2 * u64::from(idx % qlen)))
            .unwrap();
        self.mem
            .write_obj(idx.wrapping_add(1), avail.unchecked_add(2))
            .unwrap();
        self.next_desc[q] = offset + n;

        self.dev.queue_events()[q].write(1).unwrap();
        self.dev.process_queue_event(q);

        let used = self.queues[q].used_addr();
        let used_idx: u16 = self.mem.read_obj(used.unchecked_add(2)).unwrap();
        let mut got = None;
        while self.used_seen[q] != used_idx {
            let e = used.unchecked_add(4 + 8 * u64::from(self.used_seen[q] % qlen));
            let id: u32 = self.mem.read_obj(e).unwrap();
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).unwrap();
            assert_eq!(id, u32::from(offset), "used entry for another chain");
            assert!(got.is_none(), "two used entries for one chain");
            got = Some(Used { len });
            self.used_seen[q] = self.used_seen[q].wrapping_add(1);
        }
        got
    }

    /// Sends `header_bytes` + `args` on the request queue (header and arguments in separate
    /// descriptors, as Linux does) with a reply buffer of `reply_cap` bytes; returns the used
    /// length and the reply bytes.
    fn send_bytes(&mut self, header: &[u8], args: &[u8], reply_cap: u32) -> (u32, Vec<u8>) {
        let q = REQUEST_QUEUE;
        self.mem.write_slice(header, GuestAddress(IN_BASE)).unwrap();
        let args_addr = IN_BASE + 0x1000;
        self.mem.write_slice(args, GuestAddress(args_addr)).unwrap();
        // Poison the reply buffer so stale bytes cannot pass for a reply.
        let cap = reply_cap as usize;
        self.mem
            .write_slice(&vec![0xa5; cap.min(1 << 20)], GuestAddress(OUT_BASE))
            .unwrap();
        let mut descs = vec![desc(IN_BASE, header.len() as u32, 0, 0)];
        if !args.is_empty() {
            descs.push(desc(args_addr, args.len() as u32, 0, 0));
        }
        if reply_cap > 0 {
            descs.push(desc(OUT_BASE, reply_cap, VRING_DESC_F_WRITE as u16, 0));
        }
        let last = descs.len() - 1;
        for (i, d) in descs.iter_mut().enumerate().take(last) {
            let s = SplitDescriptor::from(*d);
            *d = desc(
                s.addr().0,
                s.len(),
                s.flags() | VRING_DESC_F_NEXT as u16,
                i as u16 + 1,
            );
        }
        let used = self.submit_raw(q, &descs).expect("chain not returned");
        assert!(used.len <= reply_cap, "used length beyond the reply buffer");
        let mut out = vec![0u8; used.len as usize];
        self.mem
            .read_slice(&mut out, GuestAddress(OUT_BASE))
            .unwrap();
        (used.len, out)
    }

    fn header(&mut self, opcode: u32, nodeid: u64, args_len: usize) -> InHeader {
        self.unique += 1;
        InHeader {
            len: (HDR + args_len) as u32,
            opcode,
            unique: self.unique,
            nodeid,
            uid: 0,
            gid: 0,
            pid: 1,
            padding: 0,
        }
    }

    /// One well-formed FUSE call: Ok(reply body) or Err(errno).
    fn call(
        &mut self,
        op: Opcode,
        nodeid: u64,
        args: &[u8],
        reply_cap: u32,
    ) -> Result<Vec<u8>, i32> {
        let h = self.header(op as u32, nodeid, args.len());
        let (len, out) = self.send_bytes(h.as_slice(), args, reply_cap);
        assert!(len as usize >= OUT_HDR, "{op:?}: reply of {len} bytes");
        let oh: OutHeader = parse(&out);
        assert_eq!(oh.unique, h.unique, "{op:?}: reply to another request");
        assert_eq!(oh.len, len, "{op:?}: header len vs used len");
        if oh.error != 0 {
            assert!(oh.error < 0);
            return Err(-oh.error);
        }
        Ok(out[OUT_HDR..].to_vec())
    }

    fn init(&mut self) -> InitOut {
        let args = InitIn {
            major: 7,
            minor: 33,
            max_readahead: 0x2_0000,
            flags: 0,
        };
        let out = self
            .call(Opcode::Init, 0, args.as_slice(), 4096)
            .expect("INIT");
        parse(&out)
    }

    fn lookup(&mut self, parent: u64, name: &str) -> Result<EntryOut, i32> {
        self.call(Opcode::Lookup, parent, &cname(name), 4096)
            .map(|b| parse(&b))
    }

    fn getattr(&mut self, node: u64) -> Result<AttrOut, i32> {
        let args = GetattrIn::default();
        self.call(Opcode::Getattr, node, args.as_slice(), 4096)
            .map(|b| parse(&b))
    }

    fn open(&mut self, node: u64, flags: u32) -> Result<OpenOut, i32> {
        let args = OpenIn {
            flags,
            fuse_flags: 0,
        };
        self.call(Opcode::Open, node, args.as_slice(), 4096)
            .map(|b| parse(&b))
    }

    fn read(
        &mut self,
        node: u64,
        fh: u64,
        offset: u64,
        size: u32,
        cap: u32,
    ) -> Result<Vec<u8>, i32> {
        let args = ReadIn {
            fh,
            offset,
            size,
            ..Default::default()
        };
        self.call(Opcode::Read, node, args.as_slice(), cap)
    }

    fn release(&mut self, node: u64, fh: u64) {
        let args = ReleaseIn {
            fh,
            ..Default::default()
        };
        self.call(Opcode::Release, node, args.as_slice(), 4096)
            .expect("RELEASE");
    }

    fn create(&mut self, parent: u64, name: &str, mode: u32) -> Result<(EntryOut, OpenOut), i32> {
        self.create_with(
            parent,
            name,
            mode,
            (libc::O_RDWR | libc::O_CREAT) as u32,
            0o022,
        )
    }

    fn create_with(
        &mut self,
        parent: u64,
        name: &str,
        mode: u32,
        flags: u32,
        umask: u32,
    ) -> Result<(EntryOut, OpenOut), i32> {
        let ci = CreateIn {
            flags,
            mode,
            umask,
            fuse_flags: 0,
        };
        let mut args = ci.as_slice().to_vec();
        args.extend(cname(name));
        self.call(Opcode::Create, parent, &args, 4096).map(|b| {
            (
                parse::<EntryOut>(&b),
                parse::<OpenOut>(&b[size_of::<EntryOut>()..]),
            )
        })
    }

    fn write(&mut self, node: u64, fh: u64, offset: u64, data: &[u8]) -> Result<u32, i32> {
        let wi = WriteIn {
            fh,
            offset,
            size: data.len() as u32,
            ..Default::default()
        };
        let mut args = wi.as_slice().to_vec();
        args.extend_from_slice(data);
        self.call(Opcode::Write, node, &args, 4096)
            .map(|b| parse::<WriteOut>(&b).size)
    }

    fn mkdir(&mut self, parent: u64, name: &str) -> Result<EntryOut, i32> {
        self.mkdir_mode(parent, name, 0o755)
    }

    fn mkdir_mode(&mut self, parent: u64, name: &str, mode: u32) -> Result<EntryOut, i32> {
        let mi = MkdirIn { mode, umask: 0o022 };
        let mut args = mi.as_slice().to_vec();
        args.extend(cname(name));
        self.call(Opcode::Mkdir, parent, &args, 4096)
            .map(|b| parse(&b))
    }

    /// OPENDIR + READDIR (until empty) + RELEASEDIR: the names, without "." and "..".
    fn list(&mut self, node: u64) -> Vec<String> {
        let oi = OpenIn::default();
        let oo: OpenOut = parse(
            &self
                .call(Opcode::Opendir, node, oi.as_slice(), 4096)
                .expect("OPENDIR"),
        );
        let mut names = Vec::new();
        let mut offset = 0u64;
        for _ in 0..100 {
            let ri = ReadIn {
                fh: oo.fh,
                offset,
                size: 4096,
                ..Default::default()
            };
            let buf = self
                .call(Opcode::Readdir, node, ri.as_slice(), 4096 + OUT_HDR as u32)
                .expect("READDIR");
            if buf.is_empty() {
                break;
            }
            let mut p = 0;
            while p + size_of::<Dirent>() <= buf.len() {
                let d: Dirent = parse(&buf[p..]);
                let start = p + size_of::<Dirent>();
                let name = &buf[start..start + d.namelen as usize];
                let name = OsStr::from_bytes(name).to_string_lossy().into_owned();
                if name != "." && name != ".." {
                    names.push(name);
                }
                offset = d.off;
                p = start + (d.namelen as usize).div_ceil(8) * 8;
            }
        }
        let ri = ReleaseIn {
            fh: oo.fh,
            ..Default::default()
        };
        self.call(Opcode::Releasedir, node, ri.as_slice(), 4096)
            .expect("RELEASEDIR");
        names.sort();
        names
    }

    fn rename(&mut self, olddir: u64, old: &str, newdir: u64, new: &str) -> Result<(), i32> {
        let ri = RenameIn { newdir };
        let mut args = ri.as_slice().to_vec();
        args.extend(cname(old));
        args.extend(cname(new));
        self.call(Opcode::Rename, olddir, &args, 4096).map(|_| ())
    }

    fn unlink(&mut self, parent: u64, name: &str) -> Result<(), i32> {
        self.call(Opcode::Unlink, parent, &cname(name), 4096)
            .map(|_| ())
    }

    fn rmdir(&mut self, parent: u64, name: &str) -> Result<(), i32> {
        self.call(Opcode::Rmdir, parent, &cname(name), 4096)
            .map(|_| ())
    }
}

#[test]
fn config_space_queues_and_setup_errors() {
    let dir = TestDir::new("config");
    let dev = VirtioFs::new("myfs", &dir.shared).unwrap();
    assert_eq!(dev.device_type(), device_type::FS);
    assert_eq!(dev.device_type(), 26);
    assert_eq!(dev.queue_max_sizes().len(), 2);
    assert_eq!(dev.queue_events().len(), 2);
    let mut cfg = [0xffu8; CONFIG_SIZE + 4];
    dev.read_config(0, &mut cfg);
    assert_eq!(&cfg[..4], b"myfs");
    assert!(cfg[4..TAG_MAX_LEN].iter().all(|&b| b == 0));
    assert_eq!(&cfg[TAG_MAX_LEN..CONFIG_SIZE], &1u32.to_le_bytes());
    assert_eq!(
        &cfg[CONFIG_SIZE..],
        &[0; 4],
        "beyond the config space reads 0"
    );
    let mut one = [0u8; 4];
    dev.read_config(u64::MAX, &mut one);
    assert_eq!(one, [0; 4]);

    let full = "a".repeat(TAG_MAX_LEN);
    let dev = VirtioFs::new(&full, &dir.shared).unwrap();
    let mut tag = [0u8; TAG_MAX_LEN];
    dev.read_config(0, &mut tag);
    assert_eq!(&tag[..], full.as_bytes());

    for bad in ["", "a\0b", &"b".repeat(TAG_MAX_LEN + 1)] {
        assert!(
            matches!(VirtioFs::new(bad, &dir.shared), Err(FsError::InvalidTag(_))),
            "tag {bad:?} accepted"
        );
    }
    let file = dir.root.join("outside-secret");
    let err = VirtioFs::new("t", &file).err().expect("a file accepted");
    assert!(err.to_string().contains("not a directory"), "{err}");
    let missing = dir.root.join("missing");
    assert!(matches!(
        VirtioFs::new("t", &missing),
        Err(FsError::HostDir { .. })
    ));
}

#[test]
fn init_lookup_getattr() {
    let dir = TestDir::new("lookup");
    std::fs::write(dir.shared.join("hello.txt"), b"hello from the host\n").unwrap();
    let mut g = Driver::new(&dir.shared);
    let init = g.init();
    assert_eq!(init.major, 7);
    assert!(init.max_write > 0);

    let root = g.getattr(ROOT_ID).unwrap();
    assert_eq!(root.attr.mode & libc::S_IFMT, libc::S_IFDIR);
    let e = g.lookup(ROOT_ID, "hello.txt").unwrap();
    assert_ne!(e.nodeid, ROOT_ID);
    assert_eq!(e.attr.size, 20);
    assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFREG);
    let a = g.getattr(e.nodeid).unwrap();
    assert_eq!(a.attr.size, 20);
    assert_eq!(g.lookup(ROOT_ID, "missing").err(), Some(libc::ENOENT));
    assert_eq!(g.getattr(0xdead_beef).err(), Some(libc::EBADF));
    assert_eq!(g.dev.stats().dropped, 0);
}

/// The passthrough clears the umask when the guest sends INIT: that must stay on the thread
/// that serves the guest. On the old code the process's umask was 0 after the first INIT.
#[test]
fn the_guests_init_leaves_the_process_umask_alone() {
    let dir = TestDir::new("umask");
    let shared = dir.shared.clone();
    // SAFETY: umask(2) swaps the process's mask and cannot fail; 0o022 is this harness's usual
    // mask (other tests see no change), and it is read back below.
    unsafe { libc::umask(0o022) };
    let host_mode = std::thread::spawn(move || {
        let mut g = Driver::new(&shared);
        g.init();
        // The guest's own umask (0 here) applies exactly: the reason for the passthrough's
        // umask(0), which must still hold on the serving thread.
        g.create_with(
            ROOT_ID,
            "open",
            0o666,
            (libc::O_RDWR | libc::O_CREAT) as u32,
            0,
        )
        .unwrap();
        host_mode(&shared.join("open"))
    })
    .join()
    .unwrap();
    assert_eq!(host_mode & 0o777, 0o666);
    // SAFETY: as above; puts back the mask it reads.
    let now = unsafe { libc::umask(0o022) };
    assert_eq!(
        now, 0o022,
        "the guest's INIT changed the process's umask to {now:o}"
    );
}

#[test]
fn open_and_read_a_host_file() {
    let dir = TestDir::new("read");
    let content: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.shared.join("data.bin"), &content).unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let e = g.lookup(ROOT_ID, "data.bin").unwrap();
    let o = g.open(e.nodeid, libc::O_RDONLY as u32).unwrap();
    let mut got = Vec::new();
    while got.len() < content.len() {
        let chunk = g
            .read(
                e.nodeid,
                o.fh,
                got.len() as u64,
                32768,
                32768 + OUT_HDR as u32,
            )
            .unwrap();
        assert!(!chunk.is_empty());
        got.extend(chunk);
    }
    assert_eq!(got, content);
    // At EOF: an empty reply.
    let eof = g
        .read(
            e.nodeid,
            o.fh,
            content.len() as u64,
            4096,
            4096 + OUT_HDR as u32,
        )
        .unwrap();
    assert!(eof.is_empty());
    g.release(e.nodeid, o.fh);
    // The handle is gone.
    assert!(g.read(e.nodeid, o.fh, 0, 16, 64).is_err());
}

#[test]
fn create_and_write_reach_the_host() {
    let dir = TestDir::new("write");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let (e, o) = g.create(ROOT_ID, "new.txt", 0o640 | libc::S_IFREG).unwrap();
    assert_eq!(e.attr.mode & libc::S_IFMT, libc::S_IFREG);
    assert_eq!(
        g.write(e.nodeid, o.fh, 0, b"written by the guest").unwrap(),
        20
    );
    assert_eq!(g.write(e.nodeid, o.fh, 20, b", twice").unwrap(), 7);
    g.release(e.nodeid, o.fh);
    let host = dir.shared.join("new.txt");
    assert_eq!(
        std::fs::read(&host).unwrap(),
        b"written by the guest, twice"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&host).unwrap().permissions().mode() & 0o777,
        0o640
    );
    // Creating it again fails (O_CREAT without O_EXCL opens it: FUSE CREATE on an existing
    // name is allowed by passthrough), but writing through a stale handle does not.
    assert!(g.write(e.nodeid, o.fh, 0, b"x").is_err());
    assert_eq!(g.getattr(e.nodeid).unwrap().attr.size, 27);
}

#[test]
fn mkdir_readdir_rename_unlink_rmdir() {
    let dir = TestDir::new("tree");
    std::fs::write(dir.shared.join("a"), b"1").unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let d = g.mkdir(ROOT_ID, "sub").unwrap();
    assert_eq!(d.attr.mode & libc::S_IFMT, libc::S_IFDIR);
    assert!(dir.shared.join("sub").is_dir());
    let (f, o) = g.create(d.nodeid, "inner", 0o644).unwrap();
    g.release(f.nodeid, o.fh);
    // Many entries, so READDIR needs more than one call.
    for i in 0..150 {
        std::fs::write(
            dir.shared.join(format!("file-with-a-longish-name-{i:03}")),
            b"",
        )
        .unwrap();
    }
    let names = g.list(ROOT_ID);
    assert_eq!(names.len(), 152, "{names:?}");
    assert!(names.contains(&"a".to_string()) && names.contains(&"sub".to_string()));
    assert_eq!(g.list(d.nodeid), vec!["inner".to_string()]);

    // RENAME within and across directories.
    g.rename(ROOT_ID, "a", ROOT_ID, "b").unwrap();
    assert!(!dir.shared.join("a").exists());
    assert_eq!(std::fs::read(dir.shared.join("b")).unwrap(), b"1");
    g.rename(d.nodeid, "inner", ROOT_ID, "moved").unwrap();
    assert!(dir.shared.join("moved").exists());
    assert_eq!(
        g.rename(ROOT_ID, "nope", ROOT_ID, "x").err(),
        Some(libc::ENOENT)
    );

    // UNLINK and RMDIR.
    g.unlink(ROOT_ID, "b").unwrap();
    assert!(!dir.shared.join("b").exists());
    assert_eq!(g.unlink(ROOT_ID, "b").err(), Some(libc::ENOENT));
    std::fs::write(dir.shared.join("sub/keep"), b"").unwrap();
    assert_eq!(g.rmdir(ROOT_ID, "sub").err(), Some(libc::ENOTEMPTY));
    g.unlink(d.nodeid, "keep").unwrap();
    g.rmdir(ROOT_ID, "sub").unwrap();
    assert!(!dir.shared.join("sub").exists());
    assert_eq!(g.dev.stats().dropped, 0);
    assert_eq!(g.dev.stats().rejected_answered, 0);
}

#[test]
fn names_cannot_escape_the_shared_directory() {
    let dir = TestDir::new("escape");
    std::fs::create_dir(dir.shared.join("sub")).unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let root_ino = g.getattr(ROOT_ID).unwrap().attr.ino;
    // ".." at the root is the root.
    let up = g.lookup(ROOT_ID, "..").unwrap();
    assert_eq!(up.nodeid, ROOT_ID);
    assert_eq!(up.attr.ino, root_ino);
    // And from there, the host file next to the shared directory is not found.
    assert_eq!(
        g.lookup(up.nodeid, "outside-secret").err(),
        Some(libc::ENOENT)
    );
    // ".." of a subdirectory is the root, not further.
    let sub = g.lookup(ROOT_ID, "sub").unwrap();
    let back = g.lookup(sub.nodeid, "..").unwrap();
    assert_eq!(back.attr.ino, root_ino);
    // Names with a slash are refused outright.
    assert_eq!(
        g.lookup(ROOT_ID, "../outside-secret").err(),
        Some(libc::EINVAL)
    );
    assert_eq!(
        g.lookup(sub.nodeid, "../../outside-secret").err(),
        Some(libc::EINVAL)
    );
    // Creating through ".." is refused too.
    assert!(g.create(ROOT_ID, "../evil", 0o644).is_err());
    assert!(g.mkdir(ROOT_ID, "..").is_err());
    assert!(!dir.root.join("evil").exists());
    // A symlink pointing outside is looked up as the link itself, not followed.
    std::os::unix::fs::symlink(dir.root.join("outside-secret"), dir.shared.join("link")).unwrap();
    let l = g.lookup(ROOT_ID, "link").unwrap();
    assert_eq!(l.attr.mode & libc::S_IFMT, libc::S_IFLNK);
    assert!(g.open(l.nodeid, libc::O_RDONLY as u32).is_err());
}

#[test]
fn forget_on_the_high_priority_queue() {
    let dir = TestDir::new("forget");
    std::fs::write(dir.shared.join("f"), b"").unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let e = g.lookup(ROOT_ID, "f").unwrap();
    let h = g.header(Opcode::Forget as u32, e.nodeid, size_of::<ForgetIn>());
    let fi = ForgetIn { nlookup: 1 };
    let mut bytes = h.as_slice().to_vec();
    bytes.extend_from_slice(fi.as_slice());
    g.mem.write_slice(&bytes, GuestAddress(IN_BASE)).unwrap();
    let used = g
        .submit_raw(HIPRIO_QUEUE, &[desc(IN_BASE, bytes.len() as u32, 0, 0)])
        .expect("FORGET chain not returned");
    assert_eq!(used.len, 0, "FORGET has no reply");
    // The inode is gone from the server's table.
    assert_eq!(g.getattr(e.nodeid).err(), Some(libc::EBADF));
}

/// Sends a raw request and expects an error reply with `errno`.
fn expect_error_reply(g: &mut Driver, header: &InHeader, args: &[u8], cap: u32, errno: i32) {
    let (len, out) = g.send_bytes(header.as_slice(), args, cap);
    assert_eq!(len as usize, OUT_HDR, "{header:?}");
    let oh: OutHeader = parse(&out);
    assert_eq!(oh.error, -errno, "{header:?}");
    assert_eq!(oh.unique, header.unique);
    assert_eq!(oh.len as usize, OUT_HDR);
}

#[test]
fn hostile_requests_get_errors_not_panics() {
    let dir = TestDir::new("hostile");
    std::fs::write(dir.shared.join("f"), vec![7u8; 10_000]).unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let e = g.lookup(ROOT_ID, "f").unwrap();
    let ga = GetattrIn::default();

    // Header len disagreeing with the chain, both ways: EINVAL.
    for delta in [-8i64, 1, 4096, i64::from(u32::MAX)] {
        let mut h = g.header(Opcode::Getattr as u32, ROOT_ID, ga.as_slice().len());
        h.len = (i64::from(h.len) + delta).clamp(0, i64::from(u32::MAX)) as u32;
        expect_error_reply(&mut g, &h, ga.as_slice(), 4096, libc::EINVAL);
    }

    // Too-short header (fewer bytes than a fuse_in_header): nothing to answer, dropped.
    let before = g.dev.stats().dropped;
    let h = g.header(Opcode::Getattr as u32, ROOT_ID, 0);
    let (len, _) = g.send_bytes(&h.as_slice()[..20], &[], 4096);
    assert_eq!(len, 0);
    assert_eq!(g.dev.stats().dropped, before + 1);

    // Unknown opcodes: ENOSYS from the server.
    for op in [0u32, 9999, Opcode::MaxOpcode as u32, u32::MAX] {
        let h = g.header(op, ROOT_ID, 0);
        expect_error_reply(&mut g, &h, &[], 4096, libc::ENOSYS);
    }

    // Arguments shorter than the operation's struct: an error, not a read past the chain.
    let h = g.header(Opcode::Read as u32, e.nodeid, 4);
    let (len, _) = g.send_bytes(h.as_slice(), &[0; 4], 4096);
    assert!(len == 0 || len as usize == OUT_HDR);

    // Lookup name without its NUL.
    let h = g.header(Opcode::Lookup as u32, ROOT_ID, 1);
    let (len, out) = g.send_bytes(h.as_slice(), b"f", 4096);
    if len > 0 {
        assert_ne!(parse::<OutHeader>(&out).error, 0);
    }

    // A huge read size: refused (the server checks it against the guest's reply buffer),
    // nothing is allocated for it on the host.
    let o = g.open(e.nodeid, libc::O_RDONLY as u32).unwrap();
    assert!(g.read(e.nodeid, o.fh, 0, u32::MAX, 4096).is_err());
    assert!(g.read(e.nodeid, o.fh, 0, 4096, 4096).is_err());
    // A size that fits the buffer is served.
    let data = g
        .read(e.nodeid, o.fh, 0, 4096 - OUT_HDR as u32, 4096)
        .unwrap();
    assert_eq!(data.len(), 4096 - OUT_HDR);
    assert!(data.iter().all(|&b| b == 7));
    // Reading at an absurd offset: an error or nothing.
    if let Ok(data) = g.read(e.nodeid, o.fh, u64::MAX - 10, 4096, 8192) {
        assert!(data.is_empty());
    }

    // A reply buffer too small even for the header: nothing written.
    let ri = ReadIn {
        fh: o.fh,
        size: 100,
        ..Default::default()
    };
    let h = g.header(Opcode::Read as u32, e.nodeid, size_of::<ReadIn>());
    let (len, _) = g.send_bytes(h.as_slice(), ri.as_slice(), 8);
    assert!(len <= 8);
    // No reply buffer at all.
    let h = g.header(Opcode::Getattr as u32, ROOT_ID, ga.as_slice().len());
    let (len, _) = g.send_bytes(h.as_slice(), ga.as_slice(), 0);
    assert_eq!(len, 0);

    // A reply buffer beyond MAX_REPLY_BYTES: rejected with EINVAL (the buffer is guest memory,
    // but the host would size READDIR buffers from it).
    let h = g.header(Opcode::Getattr as u32, ROOT_ID, ga.as_slice().len());
    expect_error_reply(
        &mut g,
        &h,
        ga.as_slice(),
        MAX_REPLY_BYTES as u32 + 1,
        libc::EINVAL,
    );
    // A write claiming more data than the request carries.
    let wi = WriteIn {
        fh: o.fh,
        size: 1 << 20,
        ..Default::default()
    };
    let mut args = wi.as_slice().to_vec();
    args.extend_from_slice(b"short");
    let h = g.header(Opcode::Write as u32, e.nodeid, args.len());
    let (len, out) = g.send_bytes(h.as_slice(), &args, 4096);
    if len > 0 {
        assert_ne!(parse::<OutHeader>(&out).error, 0);
    }
    // A request larger than MAX_REQUEST_BYTES (as one readable descriptor): EINVAL.
    let big = vec![0u8; MAX_REQUEST_BYTES];
    let h = g.header(Opcode::Write as u32, e.nodeid, big.len());
    expect_error_reply(&mut g, &h, &big, 4096, libc::EINVAL);

    g.release(e.nodeid, o.fh);
    assert_eq!(
        std::fs::read(dir.shared.join("f")).unwrap(),
        vec![7u8; 10_000]
    );

    // The device still serves normal requests.
    assert_eq!(g.getattr(e.nodeid).unwrap().attr.size, 10_000);
}

#[test]
fn hostile_chains_are_dropped() {
    let dir = TestDir::new("chains");
    let mut g = Driver::new(&dir.shared);
    g.init();
    let ga = GetattrIn::default();
    let h = g.header(Opcode::Getattr as u32, ROOT_ID, ga.as_slice().len());
    let mut req = h.as_slice().to_vec();
    req.extend_from_slice(ga.as_slice());
    g.mem.write_slice(&req, GuestAddress(IN_BASE)).unwrap();
    let rlen = req.len() as u32;
    let next = VRING_DESC_F_NEXT as u16;
    let wr = VRING_DESC_F_WRITE as u16;
    let mem_end = MEM_SIZE as u64;

    let cases: Vec<(&str, Vec<RawDescriptor>)> = vec![
        (
            "readable outside memory",
            vec![desc(mem_end, rlen, next, 1), desc(OUT_BASE, 4096, wr, 0)],
        ),
        (
            "readable crossing the end",
            vec![
                desc(mem_end - 8, rlen, next, 1),
                desc(OUT_BASE, 4096, wr, 0),
            ],
        ),
        (
            "address overflow",
            vec![
                desc(u64::MAX - 4, rlen, next, 1),
                desc(OUT_BASE, 4096, wr, 0),
            ],
        ),
        (
            "writable outside memory",
            vec![
                desc(IN_BASE, rlen, next, 1),
                desc(mem_end + 0x1000, 4096, wr, 0),
            ],
        ),
        (
            "writable crossing the end",
            vec![
                desc(IN_BASE, rlen, next, 1),
                desc(mem_end - 16, 4096, wr, 0),
            ],
        ),
        (
            "huge writable",
            vec![desc(IN_BASE, rlen, next, 1), desc(0, u32::MAX, wr, 0)],
        ),
        (
            "descriptor loop",
            vec![
                desc(IN_BASE, rlen, next, 1),
                desc(OUT_BASE, 4096, wr | next, 0),
            ],
        ),
        ("self loop", vec![desc(IN_BASE, 8, next, 0)]),
        (
            "readable after writable",
            vec![
                desc(IN_BASE, rlen, next, 1),
                desc(OUT_BASE, 4096, wr | next, 2),
                desc(IN_BASE, 16, 0, 0),
            ],
        ),
        (
            "next beyond the table",
            vec![desc(IN_BASE, rlen, next, 5000)],
        ),
        ("empty descriptor", vec![desc(IN_BASE, 0, 0, 0)]),
    ];
    for (what, descs) in cases {
        let used = g.submit_raw(REQUEST_QUEUE, &descs);
        let used = used.unwrap_or_else(|| panic!("{what}: chain not returned"));
        // Either dropped or an EINVAL reply; never a served request.
        if used.len > 0 {
            assert_eq!(used.len as usize, OUT_HDR, "{what}");
            let oh: OutHeader = g.mem.read_obj(GuestAddress(OUT_BASE)).unwrap();
            assert_eq!(oh.error, -libc::EINVAL, "{what}");
        }
    }
    // Too many descriptors: 600 one-byte readable descriptors.
    let mut many: Vec<RawDescriptor> = (0..600u16)
        .map(|i| desc(IN_BASE + u64::from(i), 1, next, i + 1))
        .collect();
    many.push(desc(OUT_BASE, 4096, wr, 0));
    let before = g.dev.stats().dropped;
    let used = g.submit_raw(REQUEST_QUEUE, &many).expect("returned");
    assert_eq!(used.len, 0);
    assert_eq!(g.dev.stats().dropped, before + 1);
    // The header split across many small descriptors is fine, though.
    let mut split: Vec<RawDescriptor> = (0..rlen as u16)
        .map(|i| desc(IN_BASE + u64::from(i), 1, next, i + 1))
        .collect();
    split.push(desc(OUT_BASE, 4096, wr, 0));
    let used = g.submit_raw(REQUEST_QUEUE, &split).expect("returned");
    let oh: OutHeader = g.mem.read_obj(GuestAddress(OUT_BASE)).unwrap();
    assert_eq!(oh.error, 0);
    assert_eq!(used.len as usize, OUT_HDR + size_of::<AttrOut>());

    // Still serving.
    assert!(g.getattr(ROOT_ID).is_ok());
}

/// A deterministic xorshift generator (no dependency, reproducible failures).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_requests_never_panic() {
    let dir = TestDir::new("random");
    std::fs::write(dir.shared.join("f"), b"0123456789").unwrap();
    std::fs::create_dir(dir.shared.join("d")).unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let f = g.lookup(ROOT_ID, "f").unwrap();
    let d = g.lookup(ROOT_ID, "d").unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Operations that could fill the disk or change the test directory's own permissions are
    // left out; everything else, including INIT and DESTROY, is fair game.
    let excluded = [
        Opcode::Setattr as u32,
        Opcode::Fallocate as u32,
        Opcode::CopyFileRange as u32,
    ];
    for _ in 0..3000 {
        let opcode = loop {
            let op = if rng.below(10) == 0 {
                rng.next() as u32
            } else {
                rng.below(55) as u32
            };
            if !excluded.contains(&op) {
                break op;
            }
        };
        let nodeid = match rng.below(5) {
            0 => ROOT_ID,
            1 => f.nodeid,
            2 => d.nodeid,
            3 => 0,
            _ => rng.next(),
        };
        let args_len = rng.below(300) as usize;
        let mut args: Vec<u8> = (0..args_len).map(|_| rng.next() as u8).collect();
        // Sometimes a plausible name.
        if rng.below(3) == 0 {
            args = cname(["f", "d", "..", ".", "x", "d/f"][rng.below(6) as usize]);
        }
        let mut h = g.header(opcode, nodeid, args.len());
        if rng.below(8) == 0 {
            h.len = rng.next() as u32;
        }
        let cap = [0u32, 8, 16, 100, 4096, 65536][rng.below(6) as usize];
        let (len, out) = g.send_bytes(h.as_slice(), &args, cap);
        assert!(len <= cap);
        if len as usize >= OUT_HDR {
            let oh: OutHeader = parse(&out);
            assert_eq!(oh.unique, h.unique);
            assert!(oh.len <= len);
        }
    }
    // Nothing escaped the shared directory, and the device still answers.
    let mut entries: Vec<_> = std::fs::read_dir(&dir.root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    assert_eq!(entries, vec!["outside-secret", "shared"]);
    g.init();
    assert!(g.getattr(ROOT_ID).is_ok());
}

#[test]
fn reset_forgets_inodes_and_serves_again() {
    let dir = TestDir::new("reset");
    std::fs::write(dir.shared.join("f"), b"x").unwrap();
    let mut g = Driver::new(&dir.shared);
    g.init();
    let e = g.lookup(ROOT_ID, "f").unwrap();
    g.dev.reset();
    assert!(!g.dev.is_activated());
    // Re-activate on fresh queues (a new driver), like a guest reboot.
    let mem = g.mem;
    let hiprio = MockSplitQueue::create(mem, GuestAddress(HIPRIO_BASE), HIPRIO_LEN);
    let req = MockSplitQueue::create(mem, GuestAddress(REQ_BASE), REQ_LEN);
    let queues = vec![hiprio.create_queue().unwrap(), req.create_queue().unwrap()];
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    g.dev.activate(mem.clone(), queues, irq).unwrap();
    g.queues = [hiprio, req];
    g.next_desc = [0; 2];
    g.used_seen = [0; 2];
    g.init();
    assert_eq!(
        g.getattr(e.nodeid).map(|_| ()).err(),
        Some(libc::EBADF),
        "stale inode"
    );
    assert!(g.lookup(ROOT_ID, "f").is_ok());
}

// ---- Host-side file safety (policy/): what a hostile guest could plant on the host ----

/// `new_encode_dev(major, minor)`: how a Linux guest puts a device number in MKNOD.
fn guest_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

fn host_meta(p: &Path) -> Option<std::fs::Metadata> {
    std::fs::symlink_metadata(p).ok()
}

fn host_mode(p: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().mode()
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
