//! ConfigureNetwork through the real agent binary and ttrpc, in a private network namespace
//! (needs root and iproute2): the "guest NICs" are veth ends carrying the MACs; the result is
//! read back with `ip -j`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agent_protocol::agent::{
    ConfigureNetworkRequest, IpFamily, IpNet, NetworkInterface, Route, RouteScope, ShutdownRequest,
};
use agent_protocol::agent_ttrpc::AgentClient;
use serde_json::Value;

const AGENT: &str = env!("CARGO_BIN_EXE_microvm-agent");
const NIC_MAC: &str = "02:00:5e:00:53:01";
const OTHER_MAC: &str = "02:00:5e:00:53:02";

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_duration(Duration::from_secs(10))
}

fn run(args: &[&str]) -> String {
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
    String::from_utf8(out.stdout).expect("utf-8")
}

/// A netns with two dummy "guest NICs", and the agent serving inside it; all removed on drop.
struct Guest {
    ns: String,
    dir: PathBuf,
    agent: Child,
    client: AgentClient,
}

impl Guest {
    fn start() -> Guest {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "network namespaces need root, as CI runs these tests"
        );
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ns = format!("mvagent-net-{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(&ns);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        run(&["ip", "netns", "add", &ns]);
        // From here on a failure still removes the netns: the guard owns it once built, and
        // until then this closure cleans up.
        let cleanup = |ns: &str| {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        };
        let setup = std::panic::catch_unwind(|| {
            // veth pairs (the dummy module may be missing); the peer ends are up for carrier.
            for (nic, mac) in [("nic0", NIC_MAC), ("other0", OTHER_MAC)] {
                let peer = format!("{nic}p");
                run(&[
                    "ip", "-n", &ns, "link", "add", nic, "address", mac, "type", "veth", "peer",
                    "name", &peer,
                ]);
                run(&["ip", "-n", &ns, "link", "set", &peer, "up"]);
            }
        });
        if let Err(e) = setup {
            cleanup(&ns);
            std::panic::resume_unwind(e);
        }
        let sock = dir.join("agent.sock");
        let mut agent = match Command::new("ip")
            .args(["netns", "exec", &ns, AGENT])
            .arg(format!("--listen=unix://{}", sock.display()))
            .arg(format!("--state-dir={}", dir.join("state").display()))
            .stdout(Stdio::piped())
            .spawn()
        {
            Ok(a) => a,
            Err(e) => {
                cleanup(&ns);
                panic!("spawn agent: {e}");
            }
        };
        let mut line = String::new();
        let read = BufReader::new(agent.stdout.take().expect("stdout")).read_line(&mut line);
        if read.is_err() || !line.contains("ready") {
            let _ = agent.kill();
            let _ = agent.wait();
            cleanup(&ns);
            panic!("agent not ready: {read:?} {line:?}");
        }
        let client = AgentClient::new(
            ttrpc::Client::connect(&format!("unix://{}", sock.display())).expect("connect"),
        );
        Guest {
            ns,
            dir,
            agent,
            client,
        }
    }

    fn ip_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["ip", "-n", &self.ns, "-j"];
        all.extend_from_slice(args);
        serde_json::from_str(&run(&all)).expect("ip -j output")
    }

    fn link(&self, name: &str) -> Option<Value> {
        self.ip_json(&["addr", "show"])
            .as_array()
            .expect("array")
            .iter()
            .find(|l| l["ifname"] == name)
            .cloned()
    }

    fn routes(&self, family: &str) -> Vec<String> {
        self.ip_json(&[family, "route", "show", "table", "main"])
            .as_array()
            .expect("array")
            .iter()
            .map(|r| {
                let mut s = format!(
                    "{} dev {}",
                    r["dst"].as_str().unwrap(),
                    r["dev"].as_str().unwrap()
                );
                if let Some(gw) = r["gateway"].as_str() {
                    s.push_str(&format!(" via {gw}"));
                }
                if let Some(scope) = r["scope"].as_str() {
                    s.push_str(&format!(" scope {scope}"));
                }
                s
            })
            .collect()
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.client.shutdown(ctx(), &ShutdownRequest::new());
        let _ = self.agent.kill();
        let _ = self.agent.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn mac(s: &str) -> Vec<u8> {
    s.split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect()
}

fn net(s: &str) -> IpNet {
    let (a, p) = s.split_once('/').unwrap();
    let ip: std::net::IpAddr = a.parse().unwrap();
    IpNet {
        addr: match ip {
            std::net::IpAddr::V4(v) => v.octets().to_vec(),
            std::net::IpAddr::V6(v) => v.octets().to_vec(),
        },
        prefix_len: p.parse().unwrap(),
        ..Default::default()
    }
}

fn route(dst: &str, gw: Option<&str>, scope: RouteScope) -> Route {
    let d = net(dst);
    let family = if d.addr.len() == 4 {
        IpFamily::IP_FAMILY_V4
    } else {
        IpFamily::IP_FAMILY_V6
    };
    Route {
        family: family.into(),
        destination: protobuf::MessageField::some(d),
        gateway: gw.map(|g| net(&format!("{g}/0")).addr).unwrap_or_default(),
        scope: scope.into(),
        ..Default::default()
    }
}

fn pod_interface() -> NetworkInterface {
    NetworkInterface {
        name: "eth0".into(),
        mac: mac(NIC_MAC),
        mtu: 1400,
        addresses: vec![net("10.77.0.5/24"), net("fd77::5/64")],
        // Gateway routes first in the request: the agent must still add the link-scope ones
        // before them (10.98/16's gateway is only reachable through 10.99/16).
        routes: vec![
            route(
                "0.0.0.0/0",
                Some("10.77.0.1"),
                RouteScope::ROUTE_SCOPE_UNIVERSE,
            ),
            route(
                "10.98.0.0/16",
                Some("10.99.0.1"),
                RouteScope::ROUTE_SCOPE_UNIVERSE,
            ),
            route("::/0", Some("fd77::1"), RouteScope::ROUTE_SCOPE_UNIVERSE),
            route("10.99.0.0/16", None, RouteScope::ROUTE_SCOPE_LINK),
        ],
        ..Default::default()
    }
}

fn request(ifaces: Vec<NetworkInterface>) -> ConfigureNetworkRequest {
    ConfigureNetworkRequest {
        interfaces: ifaces,
        ..Default::default()
    }
}

fn status_of(err: ttrpc::Error) -> (ttrpc::Code, String) {
    match err {
        ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_owned()),
        other => panic!("not an RPC status: {other:?}"),
    }
}

#[test]
fn configure_network_renames_addresses_and_routes_the_nic_found_by_mac() {
    let guest = Guest::start();

    // Malformed: refused before anything changes.
    let mut bad = pod_interface();
    bad.mtu = 10;
    let (code, msg) = status_of(
        guest
            .client
            .configure_network(ctx(), &request(vec![bad]))
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("eth0") && msg.contains("MTU 10"), "{msg}");
    assert!(guest.link("nic0").is_some() && guest.link("eth0").is_none());
    assert!(guest.link("lo").unwrap()["flags"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f != "UP"));

    // A MAC no NIC has.
    let mut unknown = pod_interface();
    unknown.mac = mac("02:00:5e:00:53:99");
    let (code, msg) = status_of(
        guest
            .client
            .configure_network(ctx(), &request(vec![unknown]))
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::NOT_FOUND, "{msg}");
    assert!(
        msg.contains("eth0") && msg.contains("02:00:5e:00:53:99"),
        "{msg}"
    );

    guest
        .client
        .configure_network(ctx(), &request(vec![pod_interface()]))
        .expect("configure network");

    let lo = guest.link("lo").expect("lo");
    assert!(
        lo["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
        "{lo}"
    );
    assert!(guest.link("nic0").is_none(), "nic0 was not renamed");
    let eth0 = guest.link("eth0").expect("eth0");
    assert_eq!(eth0["address"], NIC_MAC);
    assert_eq!(eth0["mtu"], 1400);
    assert!(
        eth0["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
        "{eth0}"
    );
    let addrs: Vec<String> = eth0["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["scope"] == "global")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect();
    assert_eq!(addrs, vec!["10.77.0.5/24", "fd77::5/64"]);
    let v4 = guest.addr_broadcast();
    assert_eq!(v4.as_deref(), Some("10.77.0.255"));

    let routes4 = guest.routes("-4");
    for want in [
        "default dev eth0 via 10.77.0.1",
        "10.98.0.0/16 dev eth0 via 10.99.0.1",
        "10.99.0.0/16 dev eth0 scope link",
        "10.77.0.0/24 dev eth0 scope link",
    ] {
        assert!(
            routes4.iter().any(|r| r == want),
            "{want:?} not in {routes4:?}"
        );
    }
    let routes6 = guest.routes("-6");
    assert!(
        routes6.iter().any(|r| r == "default dev eth0 via fd77::1"),
        "{routes6:?}"
    );

    // The other NIC is untouched.
    let other = guest.link("other0").expect("other0");
    assert_eq!(other["address"], OTHER_MAC);
    assert!(other["addr_info"].as_array().unwrap().is_empty(), "{other}");

    // Again: harmless.
    guest
        .client
        .configure_network(ctx(), &request(vec![pod_interface()]))
        .expect("configure network twice");

    // A route whose gateway is unreachable fails naming the interface and the route.
    let mut unreachable = pod_interface();
    unreachable.routes = vec![route(
        "10.200.0.0/16",
        Some("192.0.2.1"),
        RouteScope::ROUTE_SCOPE_UNIVERSE,
    )];
    let (code, msg) = status_of(
        guest
            .client
            .configure_network(ctx(), &request(vec![unreachable]))
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(
        msg.contains("interface eth0") && msg.contains("10.200.0.0/16 via 192.0.2.1"),
        "{msg}"
    );
}

impl Guest {
    /// eth0's IPv4 broadcast address.
    fn addr_broadcast(&self) -> Option<String> {
        let eth0 = self.link("eth0")?;
        eth0["addr_info"]
            .as_array()?
            .iter()
            .find(|a| a["family"] == "inet")
            .and_then(|a| a["broadcast"].as_str().map(str::to_owned))
    }
}

#[test]
fn two_nics_whose_names_are_swapped_are_renamed_through_a_temporary_name() {
    let guest = Guest::start();
    let iface = |name: &str, mac_str: &str, addr: &str| NetworkInterface {
        name: name.into(),
        mac: mac(mac_str),
        mtu: 1500,
        addresses: vec![net(addr)],
        ..Default::default()
    };
    guest
        .client
        .configure_network(
            ctx(),
            &request(vec![
                iface("other0", NIC_MAC, "10.1.0.2/24"),
                iface("nic0", OTHER_MAC, "10.2.0.2/24"),
            ]),
        )
        .expect("configure network");
    let other0 = guest.link("other0").expect("other0");
    assert_eq!(other0["address"], NIC_MAC);
    assert_eq!(other0["addr_info"][0]["local"], "10.1.0.2");
    let nic0 = guest.link("nic0").expect("nic0");
    assert_eq!(nic0["address"], OTHER_MAC);
    assert_eq!(nic0["addr_info"][0]["local"], "10.2.0.2");
    assert!(guest.link("mvnic0").is_none() && guest.link("mvnic1").is_none());
}
