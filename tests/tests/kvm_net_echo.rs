//! The `net-echo` test guest under our VMM on the real /dev/kvm: the guest's own virtio-net
//! driver against our virtio-net device and a real tap. As root, each test makes a private
//! network namespace (`ip netns add`), creates a tap there (`vmm::open_tap` from a thread that
//! entered the namespace: the VMM itself never does), boots the guest with it, and sends frames
//! on the tap interface through an AF_PACKET socket: every size from 60 bytes to MTU + 14, a
//! burst of several times the guest's 16 receive buffers, then a stream for the throughput
//! figure. Each echo (source and destination MAC swapped) is checked byte for byte. At the end
//! the tap must be gone (the VMM closed it) and the namespace is deleted, by guard objects also
//! when a test fails.
//!
//! Needs root, `ip` (iproute2), /dev/net/tun, /dev/kvm and the guest built (`make -C
//! tests/guests OUT=$PWD/build/guests`; `MICROVM_GUEST_DIR` overrides where it is looked for).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use microvm_tests::guest_console::{test_guest_elf, Console};
use testkit::require_root;
use vmm::{NetConfig, SerialSink, Vm, VmConfig, VmExit, VmHandle};

const GUEST_MAC: [u8; 6] = [0x02, 0x6d, 0x76, 0x00, 0x00, 0x01];
const HOST_MAC: [u8; 6] = [0x02, 0x6d, 0x76, 0x00, 0x00, 0xfe];
const TAP: &str = "mvmecho0";
const ETHERTYPE_ECHO: u16 = 0x88b5;
const KIND_ECHO: u8 = 1;
const KIND_STOP: u8 = 2;
/// The guest's receive ring.
const GUEST_RX_BUFS: usize = 16;
/// Bound for each wait (kvm-pvm emulates the guest's kernel-mode code).
const TIMEOUT: Duration = Duration::from_secs(60);

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A named network namespace, deleted on drop.
struct NetNs {
    name: String,
}

impl NetNs {
    fn new(tag: &str) -> Self {
        let name = format!("mvm-netecho-{}-{tag}", std::process::id());
        // A leftover of an earlier run with the same pid would be reused silently: remove it.
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name]).expect("create the network namespace");
        Self { name }
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Runs `f` on a thread inside the namespace (only that thread enters it).
    fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let ns = std::fs::File::open(self.path()).expect("open the namespace");
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a namespace fd we own; CLONE_NEWNET moves only this thread,
                // which ends when `f` returns.
                let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", io::Error::last_os_error());
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }

    /// The interface index of `name` inside the namespace (0: no such interface).
    fn ifindex(&self, name: &str) -> u32 {
        let c = CString::new(name).expect("interface name");
        // SAFETY: if_nametoindex reads the NUL-terminated string, valid for the call.
        self.run_in(|| unsafe { libc::if_nametoindex(c.as_ptr()) })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("cleanup: {e}");
        }
    }
}

/// An AF_PACKET socket bound to one interface, for frames of our ethertype.
struct PacketSocket(OwnedFd);

impl PacketSocket {
    /// Opens it in the calling thread's namespace.
    fn bind(ifindex: u32) -> io::Result<Self> {
        let proto = ETHERTYPE_ECHO.to_be();
        // SAFETY: plain socket(2); the fd is owned right below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, libc::c_int::from(proto)) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let sock = Self(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: sockaddr_ll is plain data; all zeros is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: bind reads a sockaddr_ll of the given size, valid for the call.
        let r = unsafe {
            libc::bind(
                fd,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // Room for a whole burst of echoes (root may exceed rmem_max).
        let rcvbuf: libc::c_int = 8 << 20;
        // SAFETY: SO_RCVBUFFORCE reads one c_int through the pointer, valid for the call.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &rcvbuf as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        Ok(sock)
    }

    fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: send reads `frame.len()` bytes from `frame`, valid for the call.
        let n = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != frame.len() {
            return Err(io::Error::other(format!(
                "sent {n} of {} bytes",
                frame.len()
            )));
        }
        Ok(())
    }

    /// The next frame, or `None` after `timeout`.
    fn recv(&self, buf: &mut [u8], timeout: Duration) -> io::Result<Option<usize>> {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: poll reads and writes one pollfd, valid for the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if r == 0 {
            return Ok(None);
        }
        // SAFETY: recv writes at most `buf.len()` bytes into `buf`, valid for the call.
        let n = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Some(n as usize))
    }
}

/// An Ethernet frame of `len` bytes for the guest: our header, `kind`, a sequence number, a
/// pattern.
fn frame(len: usize, kind: u8, seq: u32) -> Vec<u8> {
    assert!(len >= 60);
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&GUEST_MAC);
    f[6..12].copy_from_slice(&HOST_MAC);
    f[12..14].copy_from_slice(&ETHERTYPE_ECHO.to_be_bytes());
    f[14] = kind;
    f[15..19].copy_from_slice(&seq.to_be_bytes());
    let mut x = u64::from(seq).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in &mut f[19..] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    f
}

/// What the guest sends back: the MACs swapped.
fn echo_of(f: &[u8]) -> Vec<u8> {
    let mut e = f.to_vec();
    e[0..6].copy_from_slice(&f[6..12]);
    e[6..12].copy_from_slice(&f[0..6]);
    e
}

/// One VM at a time in this test binary, so that the device thread whose CPU time a test
/// measures is its own.
static ONE_VM: Mutex<()> = Mutex::new(());

/// Everything one test VM needs; dropped in declaration order (VM, socket, namespace, lock).
struct Rig {
    handle: Option<VmHandle>,
    sock: PacketSocket,
    ns: NetNs,
    console: Console,
    buf: Vec<u8>,
    /// Frames echoed and their bytes, to compare with the guest's count.
    frames: u64,
    bytes: u64,
    _one_vm: std::sync::MutexGuard<'static, ()>,
}

impl Rig {
    fn start(tag: &str, mtu: u16, cmdline: &str) -> Self {
        require_root();
        let one_vm = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
        let ns = NetNs::new(tag);
        let tap = ns
            .run_in(|| vmm::open_tap(TAP))
            .expect("create the tap in the namespace");
        let mac = HOST_MAC.map(|b| format!("{b:02x}")).join(":");
        let mtu_s = mtu.to_string();
        ip(&[
            "-n", &ns.name, "link", "set", TAP, "address", &mac, "mtu", &mtu_s, "up",
        ])
        .expect("bring the tap up");
        let ifindex = ns.ifindex(TAP);
        assert_ne!(ifindex, 0, "the tap is not in the namespace");
        let sock = ns
            .run_in(|| PacketSocket::bind(ifindex))
            .expect("AF_PACKET socket on the tap");

        let console = Console::default();
        let mut cfg = VmConfig::new(test_guest_elf("net-echo.elf"));
        cfg.memory_mib = 64;
        cfg.cmdline = cmdline.to_owned();
        cfg.serial = SerialSink::Writer(Box::new(console.clone()));
        cfg.nets.push(NetConfig {
            tap,
            mac: GUEST_MAC,
            mtu: Some(mtu),
        });
        let handle = Vm::start(cfg).expect("the VM starts");
        let mut rig = Self {
            handle: Some(handle),
            sock,
            ns,
            console,
            buf: vec![0u8; 70_000],
            frames: 0,
            bytes: 0,
            _one_vm: one_vm,
        };
        rig.wait_ready(mtu);
        rig
    }

    fn wait_ready(&mut self, mtu: u16) {
        self.console.wait_until(
            "\"net-echo: ready\"",
            TIMEOUT,
            |t| t.contains("net-echo: ready"),
            |t| t.contains("RESULT: "),
        );
        let text = self.console.text();
        let mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
        let want = format!("mac {mac} mtu {mtu} link up");
        assert!(text.contains(&want), "want {want:?}; console:\n{text}");
    }

    /// The next echo; fails with the console on a timeout, or at once if the guest ended.
    fn recv(&mut self) -> Vec<u8> {
        let end = Instant::now() + TIMEOUT;
        loop {
            match self.sock.recv(&mut self.buf, Duration::from_millis(100)) {
                Ok(Some(n)) => return self.buf[..n].to_vec(),
                Ok(None) => {}
                Err(e) => panic!("AF_PACKET recv: {e}"),
            }
            let text = self.console.text();
            assert!(
                !text.contains("RESULT: ") && Instant::now() < end,
                "no echo after {} frames; console:\n{text}",
                self.frames
            );
        }
    }

    fn expect_echo(&mut self, sent: &[u8]) {
        let got = self.recv();
        let want = echo_of(sent);
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            panic!(
                "echo of a {}-byte frame (seq {:?}) differs: got {} bytes, first difference at {at:?}",
                sent.len(),
                &sent[15..19],
                got.len()
            );
        }
        self.frames += 1;
        self.bytes += sent.len() as u64;
    }

    /// Sends the stop frame, waits for its echo and the guest's end; returns its RESULT line.
    fn stop(&mut self) -> String {
        let stop = frame(60, KIND_STOP, u32::MAX);
        self.sock.send(&stop).expect("send the stop frame");
        self.expect_echo(&stop);
        let handle = self.handle.take().expect("VM running");
        let exit = match handle.wait_timeout(TIMEOUT) {
            Some(r) => r.expect("the VM ends without a VMM error"),
            None => panic!("the guest did not end; console:\n{}", self.console.text()),
        };
        let text = self.console.text();
        assert_eq!(exit, VmExit::Reset, "console:\n{text}");
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with("RESULT: "))
            .unwrap_or_else(|| panic!("no RESULT line; console:\n{text}"))
            .to_owned();
        let want = format!("RESULT: PASS frames={} bytes={} ", self.frames, self.bytes);
        assert!(
            line.starts_with(&want) && line.ends_with(" end=stop"),
            "want {want:?}...end=stop; console:\n{text}"
        );
        line
    }

    /// After the VM: the tap is gone with the VMM's descriptor, then the namespace with the
    /// guard.
    fn check_nothing_left(self) {
        let Rig { ns, sock, .. } = self;
        drop(sock);
        assert_eq!(
            ns.ifindex(TAP),
            0,
            "the tap outlived the VM: {:?}",
            ip(&["-n", &ns.name, "link", "show"])
        );
        let path = ns.path();
        let name = ns.name.clone();
        drop(ns);
        assert!(!path.exists(), "{} is left", path.display());
        let list = ip(&["netns", "list"]).expect("ip netns list");
        assert!(!list.contains(&name), "{name} still listed:\n{list}");
    }
}

/// One frame of each size from 60 bytes to MTU + 14, each echo awaited.
fn echo_each_size(rig: &mut Rig, mtu: u16, seq: &mut u32) {
    let max = usize::from(mtu) + 14;
    let mut sizes: Vec<usize> = vec![60, 61, 63, 64, 65, 100, 127, 128, 129, 255, 256, 511, 512];
    sizes.extend([1000, 1023, 1024, 1025, 1499, 1500, 1513, 1514]);
    sizes.extend([2048, 4096, 8191, 8192, 9000, 9014]);
    sizes.retain(|&s| s <= max);
    sizes.push(max - 1);
    sizes.push(max);
    for len in sizes {
        let f = frame(len, KIND_ECHO, *seq);
        *seq += 1;
        rig.sock.send(&f).expect("send a frame");
        rig.expect_echo(&f);
    }
}

/// Sends `n` frames back to back (more than the guest has buffers), then checks every echo, in
/// order.
fn echo_burst(rig: &mut Rig, mtu: u16, n: usize, seq: &mut u32) {
    let max = usize::from(mtu) + 14;
    let frames: Vec<_> = (0..n)
        .map(|i| {
            let len = 60 + (i * 997) % (max - 59);
            let f = frame(len, KIND_ECHO, *seq);
            *seq += 1;
            f
        })
        .collect();
    for f in &frames {
        rig.sock.send(f).expect("send a burst frame");
    }
    for f in &frames {
        rig.expect_echo(f);
    }
}

/// Streams MTU-sized frames with `window` in flight for about `secs`; prints the echo
/// throughput (bytes the guest sent back per second).
fn measure_throughput(rig: &mut Rig, mtu: u16, window: usize, secs: f64, seq: &mut u32) {
    let len = usize::from(mtu) + 14;
    let mut in_flight = std::collections::VecDeque::new();
    let start = Instant::now();
    let mut echoed = 0u64;
    let mut bytes = 0u64;
    loop {
        let sending = start.elapsed().as_secs_f64() < secs;
        if sending && in_flight.len() < window {
            let f = frame(len, KIND_ECHO, *seq);
            *seq += 1;
            rig.sock.send(&f).expect("send a stream frame");
            in_flight.push_back(f);
            continue;
        }
        let Some(f) = in_flight.pop_front() else {
            break;
        };
        rig.expect_echo(&f);
        echoed += 1;
        bytes += len as u64;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "net-echo throughput: {:.2} MB/s echoed ({echoed} frames of {len} bytes in {t:.2} s, \
         {window} in flight, {:.0} frames/s)",
        bytes as f64 / t / 1e6,
        echoed as f64 / t
    );
}

#[test]
fn echoes_every_size_a_burst_and_a_stream_at_mtu_1500() {
    let mut rig = Rig::start("1500", 1500, "");
    let mut seq = 0;
    echo_each_size(&mut rig, 1500, &mut seq);
    echo_burst(&mut rig, 1500, 4 * GUEST_RX_BUFS, &mut seq);
    measure_throughput(&mut rig, 1500, GUEST_RX_BUFS - 2, 2.0, &mut seq);
    let line = rig.stop();
    println!("{line}");
    rig.check_nothing_left();
}

#[test]
fn echoes_jumbo_frames_at_mtu_9000() {
    let mut rig = Rig::start("9000", 9000, "");
    let mut seq = 0;
    echo_each_size(&mut rig, 9000, &mut seq);
    echo_burst(&mut rig, 9000, 3 * GUEST_RX_BUFS, &mut seq);
    measure_throughput(&mut rig, 9000, GUEST_RX_BUFS - 2, 1.0, &mut seq);
    let line = rig.stop();
    println!("{line}");
    rig.check_nothing_left();
}

/// CPU time (user + system, in clock ticks) of this process's device event-loop threads.
fn device_thread_ticks() -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = task.expect("task entry").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != "vmm-devices" {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Fields after the ")" that ends the command name: state is field 3, utime 14, stime 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        ticks += num(11) + num(12);
    }
    ticks
}

#[test]
fn frames_wait_without_spinning_while_the_guest_has_no_rx_buffers() {
    // The guest posts its receive buffers 4 s after saying ready.
    let mut rig = Rig::start("nobufs", 1500, "net_echo.post_delay_ms=4000");
    let mut seq = 0;
    let frames: Vec<_> = (0..100)
        .map(|i| {
            seq += 1;
            frame(60 + (i * 131) % 1455, KIND_ECHO, seq)
        })
        .collect();
    for f in &frames {
        rig.sock.send(f).expect("send a frame");
    }
    // Meanwhile the device has nowhere to put them: it must sleep, not poll the tap.
    let before = device_thread_ticks();
    std::thread::sleep(Duration::from_millis(1500));
    let spent = device_thread_ticks() - before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    assert!(
        !rig.console.text().contains("receive buffers posted"),
        "the guest posted its buffers too early to tell; console:\n{}",
        rig.console.text()
    );
    // Idle it uses nothing; polling the tap showed 37 ticks of 150 here (two busy cores).
    assert!(
        spent < hz * 15 / 100,
        "the device thread used {spent} ticks ({hz}/s) in 1.5 s while waiting for buffers"
    );
    println!("device thread while waiting for rx buffers: {spent} ticks in 1.5 s ({hz}/s)");
    // Then every frame arrives, in order (the tap holds up to 500).
    for f in &frames {
        rig.expect_echo(f);
    }
    rig.stop();
    rig.check_nothing_left();
}

#[test]
fn a_tap_without_a_vnet_header_is_refused_and_nothing_is_left() {
    require_root();
    let ns = NetNs::new("novnet");
    // A tap opened by hand with IFF_TAP | IFF_NO_PI only.
    let tap = ns.run_in(|| -> io::Result<OwnedFd> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        // SAFETY: ifreq is plain data; all zeros is valid.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in ifr.ifr_name.iter_mut().zip(TAP.bytes()) {
            *d = s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one ifreq, valid for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(file.into())
    });
    let tap = tap.expect("create a tap without IFF_VNET_HDR");
    let mut cfg = VmConfig::new(test_guest_elf("net-echo.elf"));
    cfg.memory_mib = 16;
    cfg.serial = SerialSink::Null;
    cfg.nets.push(NetConfig {
        tap,
        mac: GUEST_MAC,
        mtu: None,
    });
    let e = Vm::start(cfg).err().expect("refused").to_string();
    // IFF_TAP | IFF_NO_PI, without IFF_VNET_HDR.
    assert!(
        e.contains("virtio-net 0") && e.contains("IFF_VNET_HDR (its flags are 0x1002)"),
        "{e}"
    );
    assert_eq!(
        ns.ifindex(TAP),
        0,
        "the refused tap's descriptor was not closed"
    );
}
