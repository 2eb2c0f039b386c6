//! The pod network end to end under QEMU/TCG (root, iproute2, QEMU, our kernel and initrd): a pod
//! netns as CNI leaves it (eth0, a veth to a peer netns holding the gateway addresses), the
//! shim's setup (tap + tc redirects), the tap fd given to QEMU's virtio-net (`-netdev tap,fd=`)
//! with eth0's MAC, the agent's ConfigureNetwork from setup's description; then the peer pings
//! the pod's IPv4 and IPv6 addresses, which now answer from inside the guest.
//!
//! The tap reaches QEMU through the QEMU backend's `QemuConfig::nics`, as in a pod.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_protocol::agent::ShutdownRequest;
use agent_protocol::agent_ttrpc::AgentClient;
use agent_protocol::AGENT_VSOCK_PORT;
use microvm_tests::microvm_pods::build_artifact;
use microvm_tests::netns::{in_netns, require_root, run, TestNet, POD_MAC};
use shim::config::qemu::default_vhost_vsock_binary;
use shim::resources::network::{self, MacAddr, TeardownOutcome};
use shim::vm::qemu::{Accel, QemuConfig, QemuNic, QemuVm};

const AGENT_TIMEOUT: Duration = Duration::from_secs(180);
const PING_TIMEOUT: Duration = Duration::from_secs(60);

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_duration(Duration::from_secs(30))
}

/// The Internet checksum (RFC 1071).
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// One ICMP(v6) echo from a raw socket opened in the peer netns; whether the reply came within
/// `wait`. (No `ping` binary needed.)
fn echo(sock: &OwnedFd, to: IpAddr, seq: u16, wait: Duration) -> bool {
    let ident: u16 = 0x6d76;
    let echo_request = if to.is_ipv4() { 8u8 } else { 128u8 };
    let mut pkt = vec![echo_request, 0, 0, 0];
    pkt.extend_from_slice(&ident.to_be_bytes());
    pkt.extend_from_slice(&seq.to_be_bytes());
    pkt.extend_from_slice(b"microvm-pod-network");
    if to.is_ipv4() {
        // (The kernel fills in the ICMPv6 checksum itself.)
        let sum = checksum(&pkt);
        pkt[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    let (addr, len) = sockaddr(to);
    // SAFETY: pkt and the sockaddr are valid for the lengths passed.
    let n = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            pkt.as_ptr().cast(),
            pkt.len(),
            0,
            (&addr as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if n < 0 {
        return false;
    }
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) } <= 0 {
            continue;
        }
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            continue;
        }
        let got = &buf[..n as usize];
        // An IPv4 raw socket hands over the IP header too.
        let icmp = if to.is_ipv4() {
            let ihl = usize::from(got[0] & 0x0f) * 4;
            &got[ihl.min(got.len())..]
        } else {
            got
        };
        let echo_reply = if to.is_ipv4() { 0u8 } else { 129u8 };
        if icmp.len() >= 8
            && icmp[0] == echo_reply
            && icmp[4..6] == ident.to_be_bytes()
            && icmp[6..8] == seq.to_be_bytes()
        {
            return true;
        }
    }
}

fn sockaddr(ip: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match ip {
        IpAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        IpAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = a.octets();
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

/// Pings `addr` from the peer netns until it answers (bounded).
fn ping_from_peer(net: &TestNet, addr: &str) {
    let to: IpAddr = addr.parse().unwrap();
    let sock = in_netns(&net.peer_path(), move || {
        let (domain, proto) = if to.is_ipv4() {
            (libc::AF_INET, libc::IPPROTO_ICMP)
        } else {
            (libc::AF_INET6, libc::IPPROTO_ICMPV6)
        };
        // SAFETY: plain socket(2) call.
        let fd = unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just returned by socket(2) and is owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    });
    let deadline = Instant::now() + PING_TIMEOUT;
    let mut seq = 0u16;
    loop {
        seq = seq.wrapping_add(1);
        if echo(&sock, to, seq, Duration::from_secs(2)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} did not answer within {PING_TIMEOUT:?}"
        );
    }
}

#[test]
fn a_guest_configured_from_the_pod_netns_answers_on_the_pods_addresses() {
    require_root();
    let kernel = build_artifact("MICROVM_KERNEL", "vmlinux", "kernel");
    let initrd = build_artifact("MICROVM_INITRD", "initrd.cpio", "initrd");
    let vhost = default_vhost_vsock_binary();
    assert!(vhost.exists(), "{}: run `make deps`", vhost.display());

    let net = TestNet::with_cni_interface();
    // The peer holds the gateway addresses eth0's routes name.
    run(&[
        "ip",
        "-n",
        &net.peer,
        "addr",
        "add",
        "10.77.0.1/24",
        "dev",
        "peer0",
    ]);
    run(&[
        "ip",
        "-n",
        &net.peer,
        "addr",
        "add",
        "fd77::1/64",
        "dev",
        "peer0",
        "nodad",
    ]);

    // Removed on drop, also when the test fails (short: the VM's Unix sockets live under it).
    let work_dir = tempfile::Builder::new().prefix("mvnetq").tempdir().unwrap();
    let work = work_dir.path().to_path_buf();
    let record = work.join("network.json");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut pod = rt
        .block_on(network::setup(&net.pod_path(), &record))
        .expect("setup");
    let nic = pod.nics.remove(0);
    assert_eq!(nic.guest.mac, MacAddr(POD_MAC));

    // The QEMU backend hands the tap to QEMU as `-netdev tap,fd=` with eth0's MAC and MTU.
    let mut cfg = QemuConfig::new(kernel, initrd, vhost, work.join("vm"));
    // The VM's init (`__pod-init`) is the shim's: this test binary is not one.
    cfg.init_binary =
        microvm_tests::microvm_pods::shim_bin_dir().join(microvm_tests::microvm_pods::SHIM);
    cfg.accel = Accel::Tcg;
    cfg.memory_mib = 256;
    cfg.nics = vec![QemuNic {
        tap: Arc::new(nic.tap.into_owned_fd()),
        mac: nic.guest.mac.0,
        mtu: u16::try_from(nic.guest.mtu).unwrap(),
    }];
    let mut vm = QemuVm::start(cfg).expect("start QEMU");
    vm.wait_for_console("microvm-agent: ready", AGENT_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}", vm.console_tail(30)));
    // The shim's handshake is async (tokio); this test drives the agent's sync ttrpc client.
    let stream = rt
        .block_on(shim::agent::handshake(
            vm.vsock_uds_path(),
            AGENT_VSOCK_PORT,
            tokio::time::Instant::now() + AGENT_TIMEOUT,
        ))
        .expect("hybrid vsock handshake")
        .into_std()
        .expect("a std stream");
    stream.set_nonblocking(false).expect("a blocking stream");
    let agent = AgentClient::new(ttrpc::Client::new(stream.into_raw_fd()).expect("ttrpc"));

    agent
        .configure_network(ctx(), &network::configure_network_request([&nic.guest]))
        .unwrap_or_else(|e| panic!("ConfigureNetwork: {e:?}\n{}", vm.console_tail(30)));
    ping_from_peer(&net, "10.77.0.5");
    ping_from_peer(&net, "fd77::5");

    let _ = agent.shutdown(ctx(), &ShutdownRequest::new());
    let _ = vm.wait_timeout(Duration::from_secs(30));
    drop(agent);
    drop(vm);
    assert_eq!(
        rt.block_on(network::teardown(&record)).expect("teardown"),
        TeardownOutcome::Removed
    );
    assert!(!net.pod_links().contains(&"mvtap0".to_owned()));
}
