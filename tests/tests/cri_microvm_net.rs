//! The pod network of `microvm` pods through CRI on a private containerd whose CNI chain is a
//! dual-stack bridge with MTU 1400, portmap and bandwidth (Debian's CNI plugins): the pod's IP
//! answers from the host, pods reach each other (microvm and runc), containers of a pod share
//! loopback, hostPort and the bandwidth annotations work, CRI PortForward reaches ports on the
//! guest's loopback (kubectl port-forward), the guest has the MTU, addresses, MAC and DNS config
//! CNI and the pod spec gave, and nothing of ours is left in the pod's netns, also after kill -9
//! of the shim. The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by default; `make
//! test` runs the suite again on the embedded VMM where it can: docs/nested-lane.md).
//!
//! Needs root, containerd, the CNI plugins, iptables (portmap), QEMU and vhost-device-vsock
//! (scripts/install-deps.sh), and `make kernel initrd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_cri::v1::{DnsConfig, PortMapping};
use microvm_tests::containerd::{CniOptions, PrivateContainerd};
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::lifecycle::wait_pod_gone;
use microvm_tests::microvm_pods::*;
use microvm_tests::port_forward::{http_body, Forwarded, PortForwardSession};

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const HTTP_PORT: u16 = 8080;
const MTU: u32 = 1400;
/// Bound on reaching a freshly started server (the guest boots and starts httpd under TCG).
const REACH_TIMEOUT: Duration = Duration::from_secs(90);

fn network() -> CniOptions {
    CniOptions {
        mtu: Some(MTU),
        ipv6: true,
        portmap: true,
        bandwidth: true,
    }
}

async fn start_net() -> (tempfile::TempDir, PrivateContainerd, CriClient) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let config = write_config(dir.path(), None);
    let (ctrd, cri) = start_with_cni(&config, network()).await;
    cri.wait_ready(&[ctrd.busybox_image()], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (dir, ctrd, cri)
}

/// What a test pod is given beyond its name and handler.
#[derive(Default)]
struct PodExtras {
    annotations: HashMap<String, String>,
    port_mappings: Vec<PortMapping>,
    dns: Option<DnsConfig>,
}

/// A pod (`handler`) with one container serving `/www` over busybox httpd on [`HTTP_PORT`],
/// whose index page is the pod's name and `/big` is `big_kib` KiB of random bytes.
async fn pod_serving(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    name: &str,
    handler: &str,
    extras: PodExtras,
    big_kib: u32,
) -> (Pod, String) {
    let mut config = ctrd.pod_config(name, extras.annotations).unwrap();
    config.port_mappings = extras.port_mappings;
    config.dns_config = extras.dns;
    let pod = cri
        .run_pod_sandbox(config, handler)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RunPodSandbox {name}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        });
    let script = format!(
        "mkdir -p /www && echo {name} > /www/index.html && \
         head -c {} /dev/urandom > /www/big && exec httpd -f -p {HTTP_PORT} -h /www",
        u64::from(big_kib) * 1024
    );
    let id = start_container(ctrd, cri, &pod, "httpd", &["sh", "-c", &script]).await;
    (pod, id)
}

async fn start_container(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    name: &str,
    command: &[&str],
) -> String {
    let config = container_config(name, ctrd.busybox_image(), command);
    let id = cri.create_container(pod, config).await.unwrap_or_else(|e| {
        panic!(
            "CreateContainer {name}: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    });
    cri.start_container(&id).await.unwrap_or_else(|e| {
        panic!(
            "StartContainer {name}: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    });
    id
}

/// The pod's IPv4 address and its other addresses (IPv6), as CRI reports them.
async fn pod_ips(cri: &CriClient, pod: &Pod) -> (String, Vec<String>) {
    let status = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
    let network = status
        .status
        .and_then(|s| s.network)
        .expect("a CNI pod has a network status");
    assert!(!network.ip.is_empty(), "no pod IP: {network:?}");
    let more = network.additional_ips.into_iter().map(|p| p.ip).collect();
    (network.ip, more)
}

/// An HTTP/1.0 GET of `path` from `addr`, retried until it answers or `timeout` passes; the body.
fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        match try_http_get(addr, path) {
            Ok(body) => return Ok(body),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(format!(
        "GET http://{addr}{path}: no answer in {timeout:?}: {last}"
    ))
}

fn try_http_get(addr: SocketAddr, path: &str) -> Result<Vec<u8>, String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: pod\r\n\r\n").map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).map_err(|e| e.to_string())?;
    http_body(&reply)
}

async fn http_get_async(addr: SocketAddr, path: &str) -> Result<Vec<u8>, String> {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || http_get(addr, &path, REACH_TIMEOUT))
        .await
        .unwrap()
}

/// ExecSync in `container`, checked to exit 0; its stdout.
async fn exec_ok(cri: &CriClient, container: &str, cmd: &[&str]) -> String {
    let out = cri.exec_sync(container, cmd, 60).await.unwrap();
    assert_eq!(out.exit_code, 0, "{cmd:?}: {out:?}");
    out.stdout
}

/// `wget` of the index page of `ip` from inside `container`, retried (the server may be starting).
async fn wget_from(cri: &CriClient, container: &str, ip: &str) -> String {
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    wget_url(cri, container, &format!("http://{host}:{HTTP_PORT}/")).await
}

/// `wget` of `url` from inside `container`, retried (the server may be starting).
async fn wget_url(cri: &CriClient, container: &str, url: &str) -> String {
    let deadline = Instant::now() + REACH_TIMEOUT;
    loop {
        let out = cri
            .exec_sync(container, &["wget", "-q", "-O", "-", url], 30)
            .await
            .unwrap();
        if out.exit_code == 0 || Instant::now() >= deadline {
            assert_eq!(out.exit_code, 0, "wget {url} in {container}: {out:?}");
            return out.stdout;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The first address of the pods' subnet: the bridge, the pods' gateway.
fn gateway(ctrd: &PrivateContainerd) -> IpAddr {
    let subnet = ctrd.subnet();
    let base: std::net::Ipv4Addr = subnet.split('/').next().unwrap().parse().unwrap();
    IpAddr::V4(std::net::Ipv4Addr::from(u32::from(base) + 1))
}

/// Runs `args` inside the network namespace at `netns` (nsenter), its stdout.
fn in_netns(netns: &Path, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?} in {}: {out:?}",
        netns.display()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn netns_of(cri: &CriClient, pod: &Pod) -> PathBuf {
    cri.pod_netns_path(&pod.id)
        .await
        .unwrap()
        .expect("a CNI pod has a network namespace")
}

async fn remove_and_check(ctrd: &PrivateContainerd, cri: &CriClient, pod: &Pod) {
    remove_all_and_check(ctrd, cri, &[pod]).await;
}

/// Stops and removes `pods`, then checks that nothing of any is left (the leak check also sees
/// the instance's other processes, so every pod goes first).
async fn remove_all_and_check(ctrd: &PrivateContainerd, cri: &CriClient, pods: &[&Pod]) {
    let mut netns = Vec::new();
    for pod in pods {
        netns.push(netns_of(cri, pod).await);
        // Retried as kubelet does: after kill -9 of the shim, containerd 1.7 and 2.x report the
        // app container running for a moment (runc pods alike: cri_runc.rs).
        cri.stop_and_remove_pod_retrying(&pod.id, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    }
    for (pod, netns) in pods.iter().zip(&netns) {
        let left = wait_pod_gone(ctrd, &pod.id, Some(netns), Duration::from_secs(30));
        assert!(left.is_empty(), "pod {} left: {left:#?}", pod.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_ip_answers_from_the_host_and_containers_share_loopback() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let (pod, _httpd) =
        pod_serving(&ctrd, &cri, "net-http", "microvm", PodExtras::default(), 1).await;
    let (ip, _) = pod_ips(&cri, &pod).await;

    let t = Instant::now();
    let body = http_get_async(SocketAddr::new(ip.parse().unwrap(), HTTP_PORT), "/")
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(String::from_utf8_lossy(&body).trim(), "net-http");
    eprintln!(
        "the pod's httpd answered the host at {ip} after {:?}",
        t.elapsed()
    );

    // A second container of the pod reaches the first over 127.0.0.1.
    let sidecar = start_container(&ctrd, &cri, &pod, "sidecar", &["sleep", "3600"]).await;
    assert_eq!(
        wget_from(&cri, &sidecar, "127.0.0.1").await.trim(),
        "net-http"
    );

    remove_and_check(&ctrd, &cri, &pod).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_each_other_by_ip_microvm_to_microvm_and_to_runc() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let (a, a_httpd) = pod_serving(&ctrd, &cri, "net-a", "microvm", PodExtras::default(), 1).await;
    let (b, b_httpd) = pod_serving(&ctrd, &cri, "net-b", "microvm", PodExtras::default(), 1).await;
    let (c, c_httpd) = pod_serving(&ctrd, &cri, "net-runc", "runc", PodExtras::default(), 1).await;
    let (a_ip, a_v6) = pod_ips(&cri, &a).await;
    let (b_ip, _) = pod_ips(&cri, &b).await;
    let (c_ip, c_v6) = pod_ips(&cri, &c).await;

    assert_eq!(wget_from(&cri, &a_httpd, &b_ip).await.trim(), "net-b");
    assert_eq!(wget_from(&cri, &b_httpd, &a_ip).await.trim(), "net-a");
    assert_eq!(wget_from(&cri, &a_httpd, &c_ip).await.trim(), "net-runc");
    assert_eq!(wget_from(&cri, &c_httpd, &a_ip).await.trim(), "net-a");
    // And over IPv6, microvm <-> runc.
    let (a6, c6) = (&a_v6[0], &c_v6[0]);
    assert_eq!(wget_from(&cri, &a_httpd, c6).await.trim(), "net-runc");
    assert_eq!(wget_from(&cri, &c_httpd, a6).await.trim(), "net-a");

    remove_all_and_check(&ctrd, &cri, &[&a, &b, &c]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_port_reaches_the_pod_through_portmap() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let host_port = 20000 + (std::process::id() % 20000) as i32;
    let extras = PodExtras {
        port_mappings: vec![PortMapping {
            protocol: 0, // TCP
            container_port: i32::from(HTTP_PORT),
            host_port,
            host_ip: String::new(),
        }],
        ..PodExtras::default()
    };
    let (pod, _httpd) = pod_serving(&ctrd, &cri, "net-hostport", "microvm", extras, 1).await;
    let addr = SocketAddr::new(gateway(&ctrd), host_port as u16);
    let body = http_get_async(addr, "/")
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(String::from_utf8_lossy(&body).trim(), "net-hostport");
    remove_and_check(&ctrd, &cri, &pod).await;
}

/// A port only the pod's loopback serves (busybox httpd on 127.0.0.1).
const LOOPBACK_PORT: u16 = 9090;
/// A port nobody listens on in the pod.
const CLOSED_PORT: u16 = 7777;
/// Concurrent PortForward sessions of the concurrency check.
const SESSIONS: usize = 4;

/// `GET <path>` (HTTP/1.0) to each of `ports` through one PortForward session at `url`: what
/// came back, per port.
fn gets_through(url: &str, ports: &[u16], path: &str) -> Result<Forwarded, String> {
    let mut session = PortForwardSession::open(url, ports, REACH_TIMEOUT)?;
    for i in 0..ports.len() {
        session.send(
            i,
            format!("GET {path} HTTP/1.0\r\nHost: pod\r\n\r\n").as_bytes(),
        )?;
    }
    session.finish()
}

/// `sessions` PortForward sessions for `ports` of `pod`, at once, each carrying `GET <path>`
/// to every port: what came back, per session and port.
async fn forward_gets(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    sessions: usize,
    ports: &[u16],
    path: &str,
) -> Vec<Forwarded> {
    let mut urls = Vec::new();
    for _ in 0..sessions {
        urls.push(cri.port_forward(&pod.id, ports).await.unwrap());
    }
    let (ports, request) = (ports.to_vec(), path.to_string());
    let carried = tokio::task::spawn_blocking(move || {
        let threads: Vec<_> = urls
            .into_iter()
            .map(|url| {
                let (ports, path) = (ports.clone(), request.clone());
                std::thread::spawn(move || gets_through(&url, &ports, &path))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .unwrap();
    carried.unwrap_or_else(|e| {
        panic!(
            "port-forward {path}: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    })
}

/// kubectl port-forward (CRI PortForward): containerd dials `localhost:<port>` in the pod's
/// netns on the host; for a microvm pod that reaches the same port on the guest's loopback,
/// as it reaches the pod's own loopback for a runc pod (the same assertions on both): a port
/// served only on 127.0.0.1 in the pod, two ports in one session, several sessions at once
/// carrying 256 KiB each intact, and a port nobody listens on reported as an error on the
/// session's error channel. Nothing is left after the pods are removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_reaches_the_pods_loopback_ports() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let mut pods = Vec::new();
    // runc's pod is the reference the same assertions hold for; the QEMU run on the host checks
    // it, the lane's run (slow, under nested emulation) only our pod.
    let handlers: &[&str] = if test_hypervisor() == "kvm" {
        &["microvm"]
    } else {
        &["runc", "microvm"]
    };
    for &handler in handlers {
        let name = format!("net-pf-{handler}");
        let (pod, httpd) =
            pod_serving(&ctrd, &cri, &name, handler, PodExtras::default(), 256).await;
        let script = format!(
            "mkdir -p /lo && echo loopback-only > /lo/index.html && \
             exec httpd -f -p 127.0.0.1:{LOOPBACK_PORT} -h /lo"
        );
        start_container(&ctrd, &cri, &pod, "lo-httpd", &["sh", "-c", &script]).await;
        // Both servers up: the pod's IP answers, and the loopback one inside the pod.
        let (ip, _) = pod_ips(&cri, &pod).await;
        let big = http_get_async(SocketAddr::new(ip.parse().unwrap(), HTTP_PORT), "/big")
            .await
            .unwrap_or_else(|e| panic!("{handler}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        assert_eq!(big.len(), 256 * 1024);
        assert_eq!(
            wget_url(&cri, &httpd, &format!("http://127.0.0.1:{LOOPBACK_PORT}/"))
                .await
                .trim(),
            "loopback-only"
        );

        // Two ports in one session, one of them served only on the pod's loopback.
        let got = forward_gets(&ctrd, &cri, &pod, 1, &[HTTP_PORT, LOOPBACK_PORT], "/").await;
        let got = &got[0];
        assert_eq!(got.errors, ["", ""], "{handler}");
        let bodies: Vec<String> = got
            .data
            .iter()
            .map(|d| {
                String::from_utf8_lossy(&http_body(d).unwrap())
                    .trim()
                    .to_string()
            })
            .collect();
        assert_eq!(bodies, [name.as_str(), "loopback-only"], "{handler}");

        // Several sessions at once, each carrying the whole of /big.
        for got in forward_gets(&ctrd, &cri, &pod, SESSIONS, &[HTTP_PORT], "/big").await {
            assert_eq!(got.errors, [""], "{handler}");
            assert!(
                http_body(&got.data[0]).unwrap() == big,
                "{handler}: /big differs"
            );
        }

        // A port nobody listens on: no data, an error naming the port.
        let got = forward_gets(&ctrd, &cri, &pod, 1, &[CLOSED_PORT], "/").await;
        let got = &got[0];
        assert!(got.data[0].is_empty(), "{handler}: {:?}", got.data);
        assert!(
            got.errors[0].contains(&CLOSED_PORT.to_string()),
            "{handler}: {:?}",
            got.errors
        );
        pods.push(pod);
    }
    let pods: Vec<&Pod> = pods.iter().collect();
    remove_all_and_check(&ctrd, &cri, &pods).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guest_has_the_cni_mac_addresses_routes_mtu_and_the_pods_dns() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let extras = PodExtras {
        dns: Some(DnsConfig {
            servers: vec!["10.96.0.10".into()],
            searches: vec!["microvm-tests.svc.cluster.local".into()],
            options: vec!["ndots:5".into()],
        }),
        ..PodExtras::default()
    };
    let (pod, httpd) = pod_serving(&ctrd, &cri, "net-config", "microvm", extras, 1).await;
    let (ip, more) = pod_ips(&cri, &pod).await;
    let v6 = more.first().expect("a dual-stack pod has an IPv6 address");
    let netns = netns_of(&cri, &pod).await;
    // From netlink in the netns (/sys/class/net shows the namespace sysfs was mounted in).
    let link = in_netns(&netns, &["ip", "-o", "link", "show", "dev", "eth0"]);
    let host_mac = link
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {link}"))
        .to_string();

    let mac = exec_ok(&cri, &httpd, &["cat", "/sys/class/net/eth0/address"]).await;
    assert_eq!(
        mac.trim(),
        host_mac.trim(),
        "the guest NIC has the CNI interface's MAC"
    );
    let mtu = exec_ok(&cri, &httpd, &["cat", "/sys/class/net/eth0/mtu"]).await;
    assert_eq!(mtu.trim(), MTU.to_string());
    let addrs = exec_ok(&cri, &httpd, &["ip", "-o", "addr", "show", "dev", "eth0"]).await;
    assert!(addrs.contains(&format!("inet {ip}/24")), "{addrs}");
    assert!(addrs.contains(&format!("inet6 {v6}/64")), "{addrs}");
    let lo = exec_ok(&cri, &httpd, &["ip", "-o", "addr", "show", "dev", "lo"]).await;
    assert!(lo.contains("inet 127.0.0.1/8"), "lo is up: {lo}");
    let routes = exec_ok(&cri, &httpd, &["ip", "route"]).await;
    assert!(
        routes.contains(&format!("default via {}", gateway(&ctrd))),
        "{routes}"
    );
    let routes6 = exec_ok(&cri, &httpd, &["ip", "-6", "route"]).await;
    assert!(routes6.contains("default via fd00:88:"), "{routes6}");

    let resolv = exec_ok(&cri, &httpd, &["cat", "/etc/resolv.conf"]).await;
    for needle in [
        "nameserver 10.96.0.10",
        "search microvm-tests.svc.cluster.local",
        "options ndots:5",
    ] {
        assert!(
            resolv.contains(needle),
            "{needle} not in resolv.conf:\n{resolv}"
        );
    }
    let hostname = exec_ok(&cri, &httpd, &["hostname"]).await;
    assert_eq!(hostname.trim(), "net-config");
    let hosts = exec_ok(&cri, &httpd, &["cat", "/etc/hosts"]).await;
    assert!(hosts.contains("localhost"), "{hosts}");

    remove_and_check(&ctrd, &cri, &pod).await;
}

/// The host's tbf qdiscs (the bandwidth plugin's) as `tc` prints them.
fn host_tbf_qdiscs() -> String {
    let out = Command::new("tc").args(["qdisc", "show"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("tbf"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The largest `burst` of the tbf qdiscs in `tc`'s output, in bytes (`55834573b`, `512Kb`, `53Mb`).
fn largest_tbf_burst(qdiscs: &str) -> Option<u64> {
    qdiscs
        .lines()
        .filter_map(|l| {
            let word = l.split_whitespace().skip_while(|w| *w != "burst").nth(1)?;
            let digits: String = word
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let unit = match &word[digits.len()..] {
                "b" => 1.0,
                "Kb" => 1024.0,
                "Mb" => 1024.0 * 1024.0,
                "Gb" => 1024.0 * 1024.0 * 1024.0,
                _ => return None,
            };
            Some((digits.parse::<f64>().ok()? * unit) as u64)
        })
        .max()
}

/// Downloads `/big` (`size` bytes) from `ip` and returns the rate in bytes per second beyond
/// `burst`: `(size - burst) / T`, T the time from the request to the last byte. A token bucket
/// of `burst` bytes at rate r delivers at most `burst + r * t` bytes in any time t, however long
/// each part of the download took, so this is at most r under a limit. (A rate measured over the
/// tail alone is not: when the first part is slow, as on a loaded host in the nested lane, the
/// bucket refills meanwhile and the tail passes at full speed.) With `burst` 0 it is the plain
/// rate.
fn rate_beyond(ip: &str, size: u64, burst: u64) -> Result<f64, String> {
    let addr = SocketAddr::new(ip.parse().unwrap(), HTTP_PORT);
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    write!(s, "GET /big HTTP/1.0\r\nHost: pod\r\n\r\n").map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut head = Vec::new();
    let mut body = 0u64;
    loop {
        let n = s.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        if head.len() < 4 || !head.windows(4).any(|w| w == b"\r\n\r\n") {
            head.extend_from_slice(&buf[..n]);
            if let Some(p) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                body = (head.len() - p - 4) as u64;
            }
        } else {
            body += n as u64;
        }
    }
    if body != size {
        return Err(format!("got {body} of {size} bytes"));
    }
    Ok(size.saturating_sub(burst) as f64 / start.elapsed().as_secs_f64())
}

async fn rate_beyond_async(ip: &str, size: u64, burst: u64) -> f64 {
    // The server is up once the index page answers.
    http_get_async(SocketAddr::new(ip.parse().unwrap(), HTTP_PORT), "/")
        .await
        .unwrap();
    let ip = ip.to_string();
    tokio::task::spawn_blocking(move || rate_beyond(&ip, size, burst))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("download from {e}"))
}

/// Writes `/www/big` of `size` random bytes in the pod's httpd container at `ip`, once its
/// startup script is done (its server answers): the script makes `/www` and writes its own
/// `/www/big`, so an earlier write could find no directory or be truncated.
async fn make_big(cri: &CriClient, httpd: &str, ip: &str, size: u64) {
    http_get_async(SocketAddr::new(ip.parse().unwrap(), HTTP_PORT), "/")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let cmd = format!("head -c {size} /dev/urandom > /www/big");
    exec_ok(cri, httpd, &["sh", "-c", &cmd]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bandwidth_annotations_limit_the_pods_traffic() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    const LIMIT_BITS: f64 = 300_000.0; // "300k"
    let limit = LIMIT_BITS / 8.0;
    let shaped = || PodExtras {
        annotations: HashMap::from([
            (
                "kubernetes.io/egress-bandwidth".to_string(),
                "300k".to_string(),
            ),
            (
                "kubernetes.io/ingress-bandwidth".to_string(),
                "300k".to_string(),
            ),
        ]),
        ..PodExtras::default()
    };

    // A runc pod first: what the CNI chain does for any pod. containerd asks the bandwidth
    // plugin for a burst of 2^32-1 bits, which its tbf arithmetic (a u32 of clock ticks that
    // wraps) turns into a burst that depends on the rate: 56 MB at 2M, 2.1 MB at 300k here. A
    // token bucket passes its burst at full speed before it limits, so the shaped rates below
    // are of the bytes beyond the burst (read from the qdisc) over the whole download's time
    // (`rate_beyond`). 300k keeps the download short in the nested lane, where an unshaped pod
    // moves a few hundred KB/s.
    let (runc_pod, runc_httpd) =
        pod_serving(&ctrd, &cri, "net-shaped-runc", "runc", shaped(), 0).await;
    let tbf = host_tbf_qdiscs();
    let burst = largest_tbf_burst(&tbf)
        .unwrap_or_else(|| panic!("no tbf qdisc of the bandwidth plugin:\n{tbf}"));
    let size = burst + 768 * 1024;
    let (runc_ip, _) = pod_ips(&cri, &runc_pod).await;
    make_big(&cri, &runc_httpd, &runc_ip, size).await;
    let runc_rate = rate_beyond_async(&runc_ip, size, burst).await;
    remove_and_check(&ctrd, &cri, &runc_pod).await;

    let (free, free_httpd) = pod_serving(
        &ctrd,
        &cri,
        "net-unshaped",
        "microvm",
        PodExtras::default(),
        0,
    )
    .await;
    let (free_ip, _) = pod_ips(&cri, &free).await;
    make_big(&cri, &free_httpd, &free_ip, size).await;
    let unshaped = rate_beyond_async(&free_ip, size, 0).await;
    remove_and_check(&ctrd, &cri, &free).await;

    let (pod, httpd) = pod_serving(&ctrd, &cri, "net-shaped", "microvm", shaped(), 0).await;
    let (ip, _) = pod_ips(&cri, &pod).await;
    make_big(&cri, &httpd, &ip, size).await;
    let rate = rate_beyond_async(&ip, size, burst).await;
    eprintln!(
        "download of {size} bytes: microvm unshaped {:.0} KB/s; beyond the tbf burst of {burst} bytes, with 300k bandwidth annotations: microvm {:.0} KB/s, runc {:.0} KB/s (limit {:.0} KB/s)",
        unshaped / 1e3,
        rate / 1e3,
        runc_rate / 1e3,
        limit / 1e3
    );
    assert!(
        unshaped > 2.0 * limit,
        "unshaped at {:.0} KB/s: too slow here to check a {:.0} KB/s limit",
        unshaped / 1e3,
        limit / 1e3
    );
    assert!(
        runc_rate < 1.3 * limit,
        "the CNI chain does not limit even a runc pod:\n{tbf}"
    );
    assert!(
        rate < 1.3 * limit,
        "the microvm pod is not limited:\n{}",
        host_tbf_qdiscs()
    );
    remove_and_check(&ctrd, &cri, &pod).await;
}

#[test]
fn tbf_bursts_are_read_in_tcs_units() {
    let out = "qdisc tbf 1: dev veth1 root refcnt 3 rate 2Mbit burst 55834573b lat 1.92e+03s\n\
               qdisc tbf 1: dev bwp2 root refcnt 2 rate 2Mbit burst 512Kb lat 25ms";
    assert_eq!(largest_tbf_burst(out), Some(55834573));
    assert_eq!(
        largest_tbf_burst("qdisc tbf 1: dev x root rate 1Mbit burst 2Mb lat 1s"),
        Some(2 << 20)
    );
    assert_eq!(largest_tbf_burst("qdisc noqueue 0: dev lo root"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_of_the_shim_nothing_of_ours_is_left_in_the_pods_netns() {
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_net().await;
    let (pod, _httpd) =
        pod_serving(&ctrd, &cri, "net-kill9", "microvm", PodExtras::default(), 1).await;
    let netns = netns_of(&cri, &pod).await;
    let links = in_netns(&netns, &["ip", "-o", "link", "show"]);
    assert!(
        links.contains("mvtap"),
        "the pod's tap is in its netns: {links}"
    );

    let shims = shim_pids(&ctrd, &pod.id);
    assert_eq!(shims.len(), 1, "{shims:?}");
    // SAFETY: kill(2) on the pod's shim process found above.
    unsafe { libc::kill(shims[0], libc::SIGKILL) };
    // containerd sees the sandbox task end and runs `<shim> delete`, which undoes what the
    // state directory records; the netns itself stays until StopPodSandbox. Bounded generously:
    // on a loaded machine containerd may take a while to notice the shim's end.
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(120);
    let state_dir = Path::new(STATE_ROOT).join(&pod.id);
    loop {
        let status = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
        let state_gone = !state_dir.exists();
        if (status.status.map(|s| s.state) == Some(1) && state_gone) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let waited = killed.elapsed();
    let links = in_netns(&netns, &["ip", "-o", "link", "show"]);
    let qdiscs = in_netns(&netns, &["tc", "qdisc", "show", "dev", "eth0"]);
    let left = [
        links.contains("mvtap").then(|| format!("a tap: {links}")),
        qdiscs
            .contains("ingress")
            .then(|| format!("an ingress qdisc on eth0: {qdiscs}")),
    ];
    let left: Vec<String> = left.into_iter().flatten().collect();
    assert!(
        left.is_empty(),
        "after kill -9 of the shim and {waited:?} ({} state directory {}): {}\ncontainerd log:\n{}",
        if state_dir.exists() { "its" } else { "no" },
        state_dir.display(),
        left.join("; "),
        ctrd.log_tail()
    );
    remove_and_check(&ctrd, &cri, &pod).await;
}
