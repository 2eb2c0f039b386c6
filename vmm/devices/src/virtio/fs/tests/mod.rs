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

/// The mode of `p` on the host (its type bits included).
fn host_mode(p: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().mode()
}

// Host-side file safety: what a hostile guest could plant on the host.
mod host_safety;
