//! Network namespaces for the pod network tests (root, iproute2): a pod netns whose `eth0` is
//! one end of a veth pair, as a CNI bridge plugin would leave it, and a "peer" netns holding
//! the other end (`peer0`, playing the host's bridge). Both are removed on drop, whatever the
//! test did.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use shim::resources::network::MacAddr;

/// eth0's MAC in the pod netns.
pub const POD_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x10, 0x20, 0x30];
/// peer0's MAC.
pub const PEER_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x10, 0x20, 0x31];

/// These tests make network namespaces: root.
pub use testkit::require_root;

/// Runs a command; panics with its stderr when it fails.
pub fn run(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

pub fn mac_str(m: [u8; 6]) -> String {
    MacAddr(m).to_string()
}

/// A pod netns (eth0: one veth end) and a peer netns (the other end, `peer0`); both are
/// removed when this is dropped, whatever the test did.
pub struct TestNet {
    pub pod: String,
    pub peer: String,
}

impl TestNet {
    fn names() -> (String, String) {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{n}", std::process::id());
        (format!("mvtest-pod-{id}"), format!("mvtest-peer-{id}"))
    }

    /// Just the two netns with their loopbacks, nothing connected.
    pub fn empty() -> TestNet {
        let (pod, peer) = Self::names();
        let net = TestNet { pod, peer };
        run(&["ip", "netns", "add", &net.pod]);
        run(&["ip", "netns", "add", &net.peer]);
        net
    }

    /// What a CNI plugin would leave: eth0 with MTU 1400, IPv4 and IPv6 addresses, a default
    /// route per family and one more link-scope route.
    pub fn with_cni_interface() -> TestNet {
        let net = Self::empty();
        let (pod, peer) = (net.pod.as_str(), net.peer.as_str());
        run(&[
            "ip", "-n", peer, "link", "add", "peer0", "type", "veth", "peer", "name", "eth0",
            "netns", pod,
        ]);
        run(&[
            "ip",
            "-n",
            peer,
            "link",
            "set",
            "peer0",
            "address",
            &mac_str(PEER_MAC),
            "mtu",
            "1400",
            "up",
        ]);
        run(&[
            "ip",
            "-n",
            pod,
            "link",
            "set",
            "eth0",
            "address",
            &mac_str(POD_MAC),
            "mtu",
            "1400",
            "up",
        ]);
        run(&["ip", "-n", pod, "link", "set", "lo", "up"]);
        run(&[
            "ip",
            "-n",
            pod,
            "addr",
            "add",
            "10.77.0.5/24",
            "dev",
            "eth0",
        ]);
        run(&[
            "ip",
            "-n",
            pod,
            "addr",
            "add",
            "fd77::5/64",
            "dev",
            "eth0",
            "nodad",
        ]);
        run(&[
            "ip",
            "-n",
            pod,
            "route",
            "add",
            "default",
            "via",
            "10.77.0.1",
            "dev",
            "eth0",
        ]);
        run(&[
            "ip", "-n", pod, "-6", "route", "add", "default", "via", "fd77::1", "dev", "eth0",
        ]);
        run(&[
            "ip",
            "-n",
            pod,
            "route",
            "add",
            "10.99.0.0/16",
            "dev",
            "eth0",
            "scope",
            "link",
        ]);
        net
    }

    pub fn pod_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.pod)
    }

    pub fn peer_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.peer)
    }

    /// `tc qdisc show` and `tc filter show ... ingress` of a device in the pod netns.
    pub fn tc(&self, dev: &str) -> (String, String) {
        let qdiscs = run(&["tc", "-n", &self.pod, "qdisc", "show", "dev", dev]);
        let filters = run(&[
            "tc", "-n", &self.pod, "filter", "show", "dev", dev, "ingress",
        ]);
        (qdiscs, filters)
    }

    pub fn pod_links(&self) -> Vec<String> {
        let json = run(&["ip", "-n", &self.pod, "-j", "link", "show"]);
        let links: serde_json::Value = serde_json::from_str(&json).expect("ip -j link");
        links
            .as_array()
            .expect("array")
            .iter()
            .map(|l| l["ifname"].as_str().expect("ifname").to_owned())
            .collect()
    }

    /// eth0's addresses and routes as `ip` prints them: what must not change.
    pub fn eth0_config(&self) -> (String, String, String) {
        (
            run(&["ip", "-n", &self.pod, "-j", "addr", "show", "dev", "eth0"]),
            run(&["ip", "-n", &self.pod, "-j", "-4", "route", "show"]),
            run(&["ip", "-n", &self.pod, "-j", "-6", "route", "show"]),
        )
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.peer] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Runs `f` on a thread that entered `netns` (sockets it opens stay in that netns).
pub fn in_netns<T: Send + 'static>(netns: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    let file = File::open(netns).expect("open netns");
    std::thread::spawn(move || {
        // SAFETY: the fd is open; setns changes only this short-lived thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread")
}
