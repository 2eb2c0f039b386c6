//! The pod network's host side (shim::resources::network) against real network namespaces
//! (needs root and iproute2): a pod netns whose eth0 is one end of a veth pair, the other end in
//! a "peer" netns playing the host's bridge. Frames go both ways between the peer end and the
//! tap fd through the tc redirects; teardown (also from the record alone, as after a crash)
//! leaves the pod netns as CNI made it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use microvm_tests::netns::{in_netns, require_root, run, TestNet, PEER_MAC, POD_MAC};
use shim::resources::network::{
    self, IngressQdisc, IpFamily, IpNet, MacAddr, NetworkError, Route, RouteScope, TeardownOutcome,
    UndoLink, UndoRecord, FILTER_PRIORITY,
};

/// IEEE 802 local experimental ethertype: nothing in either netns answers it.
const ETHERTYPE: u16 = 0x88b5;
const VNET_HDR_LEN: usize = 12;

/// An AF_PACKET socket bound to `ifname` in `netns`, receiving every protocol.
fn packet_socket(netns: &Path, ifname: &'static str) -> OwnedFd {
    in_netns(netns, move || {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just returned by socket(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: name is a NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(index, 0, "no {ifname}");
        // SAFETY: sockaddr_ll is plain old data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = index as i32;
        // SAFETY: sll is a valid sockaddr_ll of the size passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        fd
    })
}

fn frame(dst: [u8; 6], src: [u8; 6], marker: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(marker);
    f.resize(f.len().max(60), 0);
    f
}

fn write_all(fd: impl AsFd, buf: &[u8]) {
    // SAFETY: buf is valid for buf.len() bytes.
    let n = unsafe { libc::write(fd.as_fd().as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    assert_eq!(
        n,
        buf.len() as isize,
        "write: {}",
        std::io::Error::last_os_error()
    );
}

/// Reads packets from `fd` (up to 5 s) until one contains `marker`; returns it.
fn read_until(fd: impl AsFd, marker: &[u8]) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = vec![0u8; 65536];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no frame with marker {marker:?} within 5 s"
        );
        let mut pfd = libc::pollfd {
            fd: fd.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
        assert!(rc >= 0, "poll: {}", std::io::Error::last_os_error());
        if rc == 0 {
            continue;
        }
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::read(pfd.fd, buf.as_mut_ptr().cast(), buf.len()) };
        assert!(n >= 0, "read: {}", std::io::Error::last_os_error());
        let got = &buf[..n as usize];
        if got.windows(marker.len()).any(|w| w == marker) {
            return got.to_vec();
        }
    }
}

fn set_vnet_hdr_len(tap: impl AsFd, len: i32) {
    // SAFETY: TUNSETVNETHDRSZ reads one int, which `len` is.
    let rc = unsafe { libc::ioctl(tap.as_fd().as_raw_fd(), libc::TUNSETVNETHDRSZ, &len) };
    assert_eq!(
        rc,
        0,
        "TUNSETVNETHDRSZ: {}",
        std::io::Error::last_os_error()
    );
}

fn ipnet(s: &str) -> IpNet {
    let (a, p) = s.split_once('/').unwrap();
    IpNet {
        addr: a.parse().unwrap(),
        prefix_len: p.parse().unwrap(),
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn tap_and_redirects_carry_frames_both_ways_and_teardown_leaves_the_cni_setup() {
    require_root();
    let net = TestNet::with_cni_interface();
    let state = tempfile::tempdir().unwrap();
    let record = state.path().join("network.json");
    let before = net.eth0_config();
    let rt = runtime();

    let pod = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .expect("setup");

    // The description matches what "CNI" configured.
    assert_eq!(pod.nics.len(), 1);
    let guest = &pod.nics[0].guest;
    assert_eq!(guest.name, "eth0");
    assert_eq!(guest.mac, MacAddr(POD_MAC));
    assert_eq!(guest.mtu, 1400);
    let addrs: BTreeSet<String> = guest.addresses.iter().map(|a| a.to_string()).collect();
    assert_eq!(
        addrs,
        BTreeSet::from(["10.77.0.5/24".to_owned(), "fd77::5/64".to_owned()])
    );
    let routes: BTreeSet<String> = guest.routes.iter().map(|r| format!("{r:?}")).collect();
    let expected: BTreeSet<String> = [
        Route {
            destination: IpNet::default_route(IpFamily::V4),
            gateway: Some(ip("10.77.0.1")),
            scope: RouteScope::Universe,
        },
        Route {
            destination: IpNet::default_route(IpFamily::V6),
            gateway: Some(ip("fd77::1")),
            scope: RouteScope::Universe,
        },
        Route {
            destination: ipnet("10.99.0.0/16"),
            gateway: None,
            scope: RouteScope::Link,
        },
    ]
    .iter()
    .map(|r| format!("{r:?}"))
    .collect();
    assert_eq!(routes, expected);

    // The record was written, and names what setup added.
    assert_eq!(
        network::read_record(&record).unwrap(),
        Some(UndoRecord {
            netns: net.pod_path(),
            links: vec![UndoLink {
                cni_interface: "eth0".into(),
                tap: "mvtap0".into(),
                cni_ingress: IngressQdisc::Added,
            }],
        })
    );

    // The tap: MTU of eth0, up; both ingresses redirect.
    let tap = &pod.nics[0].tap;
    assert_eq!(tap.name, "mvtap0");
    let link: serde_json::Value = serde_json::from_str(&run(&[
        "ip", "-n", &net.pod, "-j", "-d", "link", "show", "mvtap0",
    ]))
    .unwrap();
    assert_eq!(link[0]["mtu"], 1400);
    assert_eq!(link[0]["ifindex"], tap.ifindex);
    assert!(
        link[0]["flags"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "UP"),
        "{link}"
    );
    let (q, f) = net.tc("eth0");
    assert!(q.contains("qdisc ingress ffff:"), "{q}");
    assert!(
        f.contains(&format!("pref {FILTER_PRIORITY}"))
            && f.contains("Egress Redirect to device mvtap0"),
        "{f}"
    );
    let (q, f) = net.tc("mvtap0");
    assert!(q.contains("qdisc ingress ffff:"), "{q}");
    assert!(f.contains("Egress Redirect to device eth0"), "{f}");

    // Peer -> eth0 -> tap fd, with the vnet header in front.
    set_vnet_hdr_len(tap, VNET_HDR_LEN as i32);
    let peer_sock = packet_socket(&net.peer_path(), "peer0");
    let inbound = frame(POD_MAC, PEER_MAC, b"microvm-inbound");
    write_all(&peer_sock, &inbound);
    let got = read_until(tap, b"microvm-inbound");
    assert!(
        got.len() >= VNET_HDR_LEN + inbound.len(),
        "{} bytes",
        got.len()
    );
    assert_eq!(
        &got[VNET_HDR_LEN..VNET_HDR_LEN + inbound.len()],
        &inbound[..]
    );

    // tap fd -> eth0 -> peer.
    let outbound = frame(PEER_MAC, POD_MAC, b"microvm-outbound");
    let mut with_hdr = vec![0u8; VNET_HDR_LEN];
    with_hdr.extend_from_slice(&outbound);
    write_all(tap, &with_hdr);
    let got = read_until(&peer_sock, b"microvm-outbound");
    assert_eq!(&got[..outbound.len()], &outbound[..]);

    // Teardown while the fd is still open (a VM still holding it): tap, qdisc, filter gone;
    // eth0 as CNI left it.
    let outcome = rt.block_on(network::teardown(&record)).expect("teardown");
    assert_eq!(outcome, TeardownOutcome::Removed);
    assert!(
        !net.pod_links().contains(&"mvtap0".to_owned()),
        "{:?}",
        net.pod_links()
    );
    let (q, f) = net.tc("eth0");
    assert!(!q.contains("ingress"), "{q}");
    assert!(f.trim().is_empty(), "{f}");
    assert_eq!(net.eth0_config(), before);
    assert!(!record.exists());
    drop(pod);

    // Idempotent.
    assert_eq!(
        rt.block_on(network::teardown(&record)).unwrap(),
        TeardownOutcome::NothingRecorded
    );
}

#[test]
fn teardown_from_the_record_alone_after_the_fds_died() {
    require_root();
    let net = TestNet::with_cni_interface();
    let state = tempfile::tempdir().unwrap();
    let record = state.path().join("network.json");
    let before = net.eth0_config();
    let rt = runtime();
    let pod = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .expect("setup");
    // As a kill -9 would: every fd closes (the kernel removes the non-persistent tap), nothing
    // is undone in the process; only the record on disk is left.
    drop(pod);
    drop(rt);
    assert!(!net.pod_links().contains(&"mvtap0".to_owned()));
    let (q, f) = net.tc("eth0");
    assert!(
        q.contains("ingress") && f.contains("mirred"),
        "left behind: {q}{f}"
    );

    // A fresh runtime with nothing but the record's path.
    let rt = runtime();
    assert_eq!(
        rt.block_on(network::teardown(&record)).expect("teardown"),
        TeardownOutcome::Removed
    );
    let (q, f) = net.tc("eth0");
    assert!(!q.contains("ingress") && f.trim().is_empty(), "{q}{f}");
    assert_eq!(net.eth0_config(), before);
    assert!(!record.exists());
}

#[test]
fn an_existing_ingress_qdisc_and_other_filters_are_left_in_place() {
    require_root();
    let net = TestNet::with_cni_interface();
    let pod_ns = net.pod.clone();
    // Someone else's ingress qdisc and filter (pref 100) on eth0.
    run(&[
        "tc", "-n", &pod_ns, "qdisc", "add", "dev", "eth0", "ingress",
    ]);
    run(&[
        "tc",
        "-n",
        &pod_ns,
        "filter",
        "add",
        "dev",
        "eth0",
        "ingress",
        "pref",
        "100",
        "protocol",
        "ip",
        "u32",
        "match",
        "ip",
        "dst",
        "192.0.2.1/32",
        "flowid",
        "1:1",
    ]);
    let state = tempfile::tempdir().unwrap();
    let record = state.path().join("network.json");
    let rt = runtime();
    let pod = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .expect("setup");
    let undo = network::read_record(&record).unwrap().unwrap();
    assert_eq!(undo.links[0].cni_ingress, IngressQdisc::Existing);
    let (_, f) = net.tc("eth0");
    assert!(
        f.contains("pref 100") && f.contains(&format!("pref {FILTER_PRIORITY}")),
        "{f}"
    );

    assert_eq!(
        rt.block_on(network::teardown(&record)).unwrap(),
        TeardownOutcome::Removed
    );
    drop(pod);
    let (q, f) = net.tc("eth0");
    assert!(q.contains("qdisc ingress ffff:"), "{q}");
    assert!(f.contains("pref 100"), "{f}");
    assert!(!f.contains(&format!("pref {FILTER_PRIORITY}")), "{f}");
}

#[test]
fn bad_input_errors_clearly_and_leaves_nothing() {
    require_root();
    let state = tempfile::tempdir().unwrap();
    let record = state.path().join("network.json");
    let rt = runtime();

    // A netns path that does not exist.
    let missing = Path::new("/run/netns/mvtest-no-such-netns");
    let err = rt.block_on(network::setup(missing, &record)).unwrap_err();
    assert!(matches!(err, NetworkError::NetnsMissing(_)), "{err:?}");
    assert!(err.to_string().contains("mvtest-no-such-netns"), "{err}");
    assert!(!record.exists());

    // A file that is not a netns.
    let not_ns = state.path().join("plain-file");
    std::fs::write(&not_ns, b"").unwrap();
    let err = rt.block_on(network::setup(&not_ns, &record)).unwrap_err();
    assert!(matches!(err, NetworkError::NetnsEnter { .. }), "{err:?}");
    assert!(!record.exists());

    // A netns with lo only.
    let net = TestNet::empty();
    let err = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .unwrap_err();
    assert!(matches!(err, NetworkError::NoInterface(_)), "{err:?}");
    assert!(err.to_string().contains(&net.pod), "{err}");
    assert!(!record.exists());
    assert_eq!(net.pod_links(), vec!["lo".to_owned()]);

    // A record left from an earlier setup: setup refuses and touches nothing.
    let net = TestNet::with_cni_interface();
    std::fs::write(&record, b"{}").unwrap();
    let err = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .unwrap_err();
    assert!(matches!(err, NetworkError::RecordExists { .. }), "{err:?}");
    assert!(!net.pod_links().contains(&"mvtap0".to_owned()));
    std::fs::remove_file(&record).unwrap();

    // Teardown of a netns containerd already removed is success, and removes the record.
    let gone = UndoRecord {
        netns: missing.to_path_buf(),
        links: vec![UndoLink {
            cni_interface: "eth0".into(),
            tap: "mvtap0".into(),
            cni_ingress: IngressQdisc::Added,
        }],
    };
    std::fs::write(&record, serde_json::to_vec(&gone).unwrap()).unwrap();
    assert_eq!(
        rt.block_on(network::teardown(&record)).unwrap(),
        TeardownOutcome::NetnsGone
    );
    assert!(!record.exists());
}

/// Port-forward's host side: every TCP connection made in the pod netns to 127.0.0.1, on any
/// port, reaches the shim's one listener, whose accepted connection names the port dialed;
/// nothing else changes in the netns, and dropping the catch (as a teardown or the shim's
/// death does) leaves the loopback as it was: connections refused again.
#[test]
fn the_loopback_catch_takes_tcp_to_127_0_0_1_on_every_port_and_leaves_nothing() {
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, TcpStream};

    use shim::resources::network::loopback::catch_loopback;

    require_root();
    let net = TestNet::with_cni_interface();
    let dial_to =
        |ip: Ipv4Addr, port: u16| in_netns(&net.pod_path(), move || TcpStream::connect((ip, port)));
    let dial = |port: u16| dial_to(Ipv4Addr::LOCALHOST, port);
    assert!(dial(8080).is_err(), "nothing listens before the catch");
    let links_before = net.pod_links();

    let caught = catch_loopback(&net.pod_path()).expect("catch the loopback");
    let (listener, redirect) = caught.into_parts();
    listener.set_nonblocking(false).unwrap();
    for port in [1, 80, 8080, 65535] {
        let mut client = dial(port).unwrap_or_else(|e| panic!("port {port}: {e}"));
        let (mut conn, peer) = listener.accept().expect("accept");
        assert_eq!(conn.local_addr().unwrap().port(), port);
        assert_eq!(peer.ip(), std::net::IpAddr::from(Ipv4Addr::LOCALHOST));
        client.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
    }
    // Only 127.0.0.1: the pod's own address in the netns (eth0's, 10.77.0.5) is not taken.
    assert!(dial_to(Ipv4Addr::new(10, 77, 0, 5), 8080).is_err());
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "nothing reached the catch");
    listener.set_nonblocking(false).unwrap();
    assert_eq!(net.pod_links(), links_before, "no link added");

    // The listener closed but the program still attached: refused, never a hang.
    drop(listener);
    assert!(dial(8080).is_err());
    drop(redirect);
    assert!(dial(8080).is_err(), "refused again after the catch is gone");
    let err = catch_loopback(Path::new("/nonexistent/netns")).expect_err("no netns");
    assert!(err.to_string().contains("/nonexistent/netns"), "{err}");
}
