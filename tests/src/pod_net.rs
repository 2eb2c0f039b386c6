//! The host's side of a pod's network, for the benchmark and the demo: what a busybox container
//! serves, and the host-side clients that measure it through the pod IP.
//!
//! A container running [`server_script`] serves, with busybox only:
//! - HTTP on [`PodServers::http`] (`httpd`): `/` is the pod's name (the latency requests);
//! - on [`PodServers::upload`] (`nc -ll -e`): reads everything the client sends until the client
//!   shuts its side down, then answers [`UPLOAD_DONE`]: the host -> pod transfer, whose end the
//!   host sees only once the pod has read the last byte;
//! - on [`PodServers::download`] (`nc -ll -e dd`): sends a fixed number of zero bytes, then
//!   closes: the pod -> host transfer, counted on the host.
//!
//! The transfers go through no file system on the pod's side (`/dev/zero`, `/dev/null`), so that
//! they measure the network path (and the pod's CPU for TCP), not the container's storage.
//! Every client call is bounded by a timeout and checks what it got: a transfer cut short or a
//! wrong answer is an error, never a number.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::cri::{CriClient, CriError};

/// What the upload server answers once it has read the client's whole stream.
pub const UPLOAD_DONE: &str = "received";
/// The download server's block size (`dd bs=`): downloads are a whole number of these.
pub const DOWNLOAD_BLOCK: u64 = 65536;
/// Bound on an HTTP reply (the pages served here are a line).
const MAX_HTTP_REPLY: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PodNetError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} with {addr}: {source}")]
    Io {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{addr}: {detail}")]
    Protocol { addr: SocketAddr, detail: String },
    #[error("{addr}: got {got} bytes, expected {expected}")]
    Short {
        addr: SocketAddr,
        got: u64,
        expected: u64,
    },
    #[error("{addr} did not answer within {after:?}; the last try: {last}")]
    Unreachable {
        addr: SocketAddr,
        after: Duration,
        last: Box<PodNetError>,
    },
    #[error("the pod {pod} has no IP in its CRI status (network: {network})")]
    NoPodIp { pod: String, network: String },
    #[error("the pod {pod}'s IP {ip:?} in its CRI status is not an address")]
    BadPodIp { pod: String, ip: String },
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("the download size {0} is not a positive multiple of {DOWNLOAD_BLOCK} bytes")]
    DownloadSize(u64),
    #[error("the server script's {what} {value:?} is empty or has characters other than letters, digits, `.`, `_`, `-` (and `/` in a path)")]
    ScriptArg { what: &'static str, value: String },
}

/// The ports of a pod's servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodPorts {
    pub http: u16,
    pub upload: u16,
    pub download: u16,
}

/// The ports the benchmark's pods serve on (in the pod's own network namespace).
pub const POD_PORTS: PodPorts = PodPorts {
    http: 8080,
    upload: 5001,
    download: 5002,
};

/// What [`server_script`] serves where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSpec {
    /// The body of `GET /` (one line: letters, digits, `.`, `_` and `-` only).
    pub page: String,
    /// httpd's document root (created; the same characters and `/`).
    pub www: String,
    pub ports: PodPorts,
    /// Bytes the download server sends per connection (a multiple of [`DOWNLOAD_BLOCK`]).
    pub download_bytes: u64,
}

/// A pod's servers as the host reaches them: the pod IP and the ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodServers {
    pub ip: IpAddr,
    pub ports: PodPorts,
}

impl PodServers {
    pub fn http(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.ports.http)
    }
    pub fn upload(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.ports.upload)
    }
    pub fn download(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.ports.download)
    }
}

/// The `sh -c` script of the serving container: the two `nc` servers in the background, then
/// httpd in the foreground (the container's main process). Busybox applets are called as
/// `busybox <applet>` so that the same script runs on a host whose `nc` is another netcat.
pub fn server_script(spec: &ServerSpec) -> Result<String, PodNetError> {
    if spec.download_bytes == 0 || !spec.download_bytes.is_multiple_of(DOWNLOAD_BLOCK) {
        return Err(PodNetError::DownloadSize(spec.download_bytes));
    }
    // Both go into the shell script unquoted: only characters the shell takes literally.
    let plain = |value: &str, slash: bool| {
        !value.is_empty()
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c) || (slash && c == '/'))
    };
    for (what, value, slash) in [("page", &spec.page, false), ("www", &spec.www, true)] {
        if !plain(value, slash) {
            return Err(PodNetError::ScriptArg {
                what,
                value: value.clone(),
            });
        }
    }
    let blocks = spec.download_bytes / DOWNLOAD_BLOCK;
    let PodPorts {
        http,
        upload,
        download,
    } = spec.ports;
    let (page, www) = (&spec.page, &spec.www);
    Ok(format!(
        "busybox mkdir -p {www} && echo {page} > {www}/index.html && \
         {{ busybox nc -ll -p {upload} -e busybox sh -c 'busybox cat > /dev/null && echo {UPLOAD_DONE}' & }} && \
         {{ busybox nc -ll -p {download} -e busybox sh -c 'busybox dd if=/dev/zero bs={DOWNLOAD_BLOCK} count={blocks} 2>/dev/null' & }} && \
         exec busybox httpd -f -p {http} -h {www}"
    ))
}

/// The pod's IPv4 address (CRI's `network.ip`).
pub async fn pod_ip(cri: &CriClient, pod_id: &str) -> Result<IpAddr, PodNetError> {
    let status = cri.pod_sandbox_status(pod_id, false).await?;
    let network = status.status.and_then(|s| s.network);
    let ip = network.as_ref().map(|n| n.ip.clone()).unwrap_or_default();
    if ip.is_empty() {
        return Err(PodNetError::NoPodIp {
            pod: pod_id.to_string(),
            network: format!("{network:?}"),
        });
    }
    ip.parse().map_err(|_| PodNetError::BadPodIp {
        pod: pod_id.to_string(),
        ip,
    })
}

fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, PodNetError> {
    let s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|source| PodNetError::Connect { addr, source })?;
    let io = |what| move |source| PodNetError::Io { what, addr, source };
    s.set_read_timeout(Some(timeout))
        .map_err(io("setting the read timeout"))?;
    s.set_write_timeout(Some(timeout))
        .map_err(io("setting the write timeout"))?;
    s.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
    Ok(s)
}

/// Reads `s` to its end, at most `limit` bytes (more is an error).
fn read_bounded(s: &mut TcpStream, addr: SocketAddr, limit: u64) -> Result<Vec<u8>, PodNetError> {
    let mut reply = Vec::new();
    s.take(limit + 1)
        .read_to_end(&mut reply)
        .map_err(|source| PodNetError::Io {
            what: "reading the reply",
            addr,
            source,
        })?;
    if reply.len() as u64 > limit {
        return Err(PodNetError::Protocol {
            addr,
            detail: format!("the reply is longer than {limit} bytes"),
        });
    }
    Ok(reply)
}

/// One HTTP/1.0 `GET path` (a connection of its own, as busybox httpd closes each): the time
/// from connecting to the end of the reply, and the body of a `200` reply (any other status is
/// an error). `timeout` bounds the connect and each read and write.
pub fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(Duration, Vec<u8>), PodNetError> {
    let start = Instant::now();
    let mut s = connect(addr, timeout)?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: pod\r\n\r\n").map_err(|source| PodNetError::Io {
        what: "sending the request",
        addr,
        source,
    })?;
    let reply = read_bounded(&mut s, addr, MAX_HTTP_REPLY)?;
    let elapsed = start.elapsed();
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| PodNetError::Protocol {
            addr,
            detail: format!(
                "not an HTTP reply: {:?}",
                String::from_utf8_lossy(&reply[..reply.len().min(80)])
            ),
        })?;
    let status = String::from_utf8_lossy(&reply[..split]);
    let status = status.lines().next().unwrap_or_default();
    if !(status.starts_with("HTTP/1.0 200 ") || status.starts_with("HTTP/1.1 200 ")) {
        return Err(PodNetError::Protocol {
            addr,
            detail: format!("GET {path}: {status:?}"),
        });
    }
    Ok((elapsed, reply[split + 4..].to_vec()))
}

/// `f` until it succeeds, every 250 ms, bounded by `within`: its result and the time it took;
/// past `within`, [`PodNetError::Unreachable`] with `f`'s last error.
fn retry<R>(
    addr: SocketAddr,
    within: Duration,
    mut f: impl FnMut() -> Result<R, PodNetError>,
) -> Result<(R, Duration), PodNetError> {
    let start = Instant::now();
    loop {
        let last = match f() {
            Ok(r) => return Ok((r, start.elapsed())),
            Err(e) => e,
        };
        if start.elapsed() + Duration::from_millis(250) >= within {
            return Err(PodNetError::Unreachable {
                addr,
                after: within,
                last: Box::new(last),
            });
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One `GET /` that must answer `page`.
fn get_page(addr: SocketAddr, page: &str, timeout: Duration) -> Result<(), PodNetError> {
    let (_, body) = http_get(addr, "/", timeout)?;
    if String::from_utf8_lossy(&body).trim() == page {
        Ok(())
    } else {
        Err(PodNetError::Protocol {
            addr,
            detail: format!(
                "GET / answered {:?}, expected {page:?}",
                String::from_utf8_lossy(&body[..body.len().min(80)])
            ),
        })
    }
}

/// `GET /` until it answers `page`, bounded by `within`: the pod's httpd is up and reached;
/// the time that took.
pub fn wait_page(addr: SocketAddr, page: &str, within: Duration) -> Result<Duration, PodNetError> {
    let per_try = Duration::from_secs(5).min(within);
    retry(addr, within, || get_page(addr, page, per_try)).map(|((), t)| t)
}

/// `GET path` until it answers 200, bounded by `within`: the time it took and the body.
pub fn wait_get(
    addr: SocketAddr,
    path: &str,
    within: Duration,
) -> Result<(Duration, Vec<u8>), PodNetError> {
    let per_try = Duration::from_secs(5).min(within);
    retry(addr, within, || http_get(addr, path, per_try)).map(|((_, body), t)| (t, body))
}

/// Waits, bounded by `within` in all, until each of the pod's servers has served once (the
/// page `page`, an upload of `download_bytes`, a download of `download_bytes`): they are up and
/// reached through the pod IP. These first transfers are not measured.
pub fn wait_servers(
    pod: &PodServers,
    page: &str,
    download_bytes: u64,
    within: Duration,
) -> Result<Duration, PodNetError> {
    let start = Instant::now();
    let left = || within.saturating_sub(start.elapsed());
    let per_try = Duration::from_secs(30).min(within);
    wait_page(pod.http(), page, within)?;
    retry(pod.upload(), left(), || {
        upload(pod.upload(), download_bytes, per_try)
    })?;
    retry(pod.download(), left(), || {
        download(pod.download(), download_bytes, per_try)
    })?;
    Ok(start.elapsed())
}

/// Sends `bytes` bytes to the upload server, shuts the sending side down, and waits for its
/// [`UPLOAD_DONE`]: the time from connecting until the pod has read everything.
pub fn upload(addr: SocketAddr, bytes: u64, timeout: Duration) -> Result<Duration, PodNetError> {
    let chunk = vec![0x5au8; 1 << 16];
    let start = Instant::now();
    let mut s = connect(addr, timeout)?;
    let mut left = bytes;
    while left > 0 {
        // Bounded by the chunk's length, so the cast is lossless.
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n]).map_err(|source| PodNetError::Io {
            what: "sending",
            addr,
            source,
        })?;
        left -= n as u64;
    }
    s.shutdown(Shutdown::Write)
        .map_err(|source| PodNetError::Io {
            what: "shutting down the sending side",
            addr,
            source,
        })?;
    let reply = read_bounded(&mut s, addr, 4096)?;
    let elapsed = start.elapsed();
    let reply = String::from_utf8_lossy(&reply);
    if reply.trim() != UPLOAD_DONE {
        return Err(PodNetError::Protocol {
            addr,
            detail: format!(
                "the upload server answered {:?} after {bytes} bytes, not {UPLOAD_DONE:?}",
                reply.trim()
            ),
        });
    }
    Ok(elapsed)
}

/// Reads the download server's stream to its end: the time from connecting to the end; fewer or
/// more bytes than `expected` is an error.
pub fn download(
    addr: SocketAddr,
    expected: u64,
    timeout: Duration,
) -> Result<Duration, PodNetError> {
    let start = Instant::now();
    let mut s = connect(addr, timeout)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut got: u64 = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got = got.saturating_add(n as u64),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(PodNetError::Io {
                    what: "receiving",
                    addr,
                    source,
                })
            }
        }
        if got > expected {
            break;
        }
    }
    let elapsed = start.elapsed();
    if got != expected {
        return Err(PodNetError::Short {
            addr,
            got,
            expected,
        });
    }
    Ok(elapsed)
}

/// MiB/s of `bytes` moved in `elapsed`.
pub fn mib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1048576.0 / elapsed.as_secs_f64()
}

/// The nearest-rank percentile `p` (0 < p <= 100) of `values`: the smallest value with at least
/// p % of the values at or below it; `None` for no values or a `p` out of range.
pub fn percentile(values: &[Duration], p: f64) -> Option<Duration> {
    if values.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    // ceil(p * n / 100) in 1..=n; p <= 100 keeps it within the slice. p * n first: p / 100
    // first would round a whole rank up past itself (0.999 * 1000 is just above 999).
    let rank = (p * sorted.len() as f64 / 100.0).ceil() as usize;
    sorted.get(rank.max(1) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command};

    const T: Duration = Duration::from_secs(10);

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v = ms(&[5, 1, 4, 2, 3]);
        assert_eq!(percentile(&v, 50.0), Some(Duration::from_millis(3)));
        assert_eq!(percentile(&v, 100.0), Some(Duration::from_millis(5)));
        assert_eq!(percentile(&v, 1.0), Some(Duration::from_millis(1)));
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(
            percentile(&ms(&hundred), 99.0),
            Some(Duration::from_millis(99))
        );
        for n in [10u64, 100, 300, 1000, 2000, 5000] {
            let values: Vec<u64> = (1..=n).collect();
            assert_eq!(
                percentile(&ms(&values), 99.0),
                Some(Duration::from_millis((n * 99).div_ceil(100))),
                "n={n}"
            );
        }
        let thousand: Vec<u64> = (1..=1000).collect();
        assert_eq!(
            percentile(&ms(&thousand), 99.9),
            Some(Duration::from_millis(999))
        );
        let two_hundred: Vec<u64> = (1..=200).rev().collect();
        assert_eq!(
            percentile(&ms(&two_hundred), 99.0),
            Some(Duration::from_millis(198))
        );
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&v, 0.0), None);
        assert_eq!(percentile(&v, 101.0), None);
        assert_eq!(percentile(&v, f64::NAN), None);
    }

    #[test]
    fn throughput_is_mib_per_second() {
        assert_eq!(mib_per_s(8 << 20, Duration::from_secs(2)), 4.0);
    }

    #[test]
    fn the_script_takes_whole_blocks_and_plain_words_only() {
        let mut spec = ServerSpec {
            page: "p".into(),
            www: "/www".into(),
            ports: POD_PORTS,
            download_bytes: DOWNLOAD_BLOCK * 3 + 1,
        };
        assert!(matches!(
            server_script(&spec),
            Err(PodNetError::DownloadSize(_))
        ));
        spec.download_bytes = 0;
        assert!(server_script(&spec).is_err());
        spec.download_bytes = DOWNLOAD_BLOCK * 3;
        let script = server_script(&spec).unwrap();
        assert!(script.contains("count=3 "), "{script}");
        for page in ["", "a b", "x;reboot", "$(id)", "a/b"] {
            let bad = ServerSpec {
                page: page.into(),
                ..spec.clone()
            };
            assert!(
                matches!(
                    server_script(&bad),
                    Err(PodNetError::ScriptArg { what: "page", .. })
                ),
                "{page:?}"
            );
        }
        let bad = ServerSpec {
            www: "/tmp/a b".into(),
            ..spec.clone()
        };
        assert!(server_script(&bad).is_err());
    }

    /// What a [`one_shot`] server reads before it answers.
    #[derive(Clone, Copy, PartialEq)]
    enum Reads {
        Nothing,
        /// Up to a blank line.
        Request,
        /// Everything until the client shuts its side down.
        All,
    }

    /// A one-connection server on 127.0.0.1 that reads as `reads` says, answers `reply` and
    /// closes.
    fn one_shot(reply: &'static [u8], reads: Reads) -> SocketAddr {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            if reads != Reads::Nothing {
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                    if reads == Reads::Request && got.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
            let _ = s.write_all(reply);
        });
        addr
    }

    #[test]
    fn http_get_returns_the_body_of_a_200_and_refuses_anything_else() {
        let addr = one_shot(
            b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nhi\n",
            Reads::Request,
        );
        let (_, body) = http_get(addr, "/", T).unwrap();
        assert_eq!(body, b"hi\n");
        let addr = one_shot(b"HTTP/1.1 200 OK\r\n\r\npage\n", Reads::Request);
        let (_, body) = wait_get(addr, "/", T).unwrap();
        assert_eq!(body, b"page\n");
        let addr = one_shot(b"HTTP/1.0 404 Not Found\r\n\r\nno\n", Reads::Request);
        let e = http_get(addr, "/", T).unwrap_err().to_string();
        assert!(e.contains("404"), "{e}");
        let addr = one_shot(b"garbage", Reads::Request);
        assert!(matches!(
            http_get(addr, "/", T),
            Err(PodNetError::Protocol { .. })
        ));
    }

    #[test]
    fn an_upload_needs_the_servers_answer_and_a_download_its_exact_size() {
        let addr = one_shot(b"received\n", Reads::All);
        upload(addr, 300_000, T).unwrap();
        let addr = one_shot(b"", Reads::All);
        let e = upload(addr, 1000, T).unwrap_err().to_string();
        assert!(e.contains("not \"received\""), "{e}");
        let addr = one_shot(&[0u8; 5000], Reads::Nothing);
        assert!(matches!(
            download(addr, 6000, T),
            Err(PodNetError::Short {
                got: 5000,
                expected: 6000,
                ..
            })
        ));
        let addr = one_shot(&[0u8; 5000], Reads::Nothing);
        assert!(matches!(
            download(addr, 4000, T),
            Err(PodNetError::Short { .. })
        ));
    }

    #[test]
    fn waiting_for_a_page_that_never_comes_ends_with_the_last_error() {
        // A port nothing listens on: bind, read the port, close.
        let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap();
        let t = Instant::now();
        let e = wait_get(addr, "/", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, PodNetError::Unreachable { .. }), "{e}");
        let e = wait_page(addr, "x", Duration::from_secs(1)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(8));
        match e {
            PodNetError::Unreachable { last, .. } => {
                assert!(matches!(*last, PodNetError::Connect { .. }), "{last}")
            }
            other => panic!("{other}"),
        }
    }

    /// The script of the pods, run on this host's busybox (a dependency of the tests:
    /// scripts/install-deps.sh), killed with its process group when dropped.
    struct HostServers(Child);

    impl Drop for HostServers {
        fn drop(&mut self) {
            // SAFETY: kill(2) of the process group our child leads (process_group(0) below).
            unsafe { libc::kill(-(self.0.id() as libc::pid_t), libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn the_pod_script_serves_what_the_clients_expect_on_busybox() {
        assert!(
            std::path::Path::new("/bin/busybox").is_file(),
            "/bin/busybox is missing: install busybox-static (scripts/install-deps.sh)"
        );
        let www = tempfile::tempdir().unwrap();
        let ports = PodPorts {
            http: free_port(),
            upload: free_port(),
            download: free_port(),
        };
        let download_bytes = 40 * DOWNLOAD_BLOCK;
        let spec = ServerSpec {
            page: "bench-pod-1".into(),
            www: www.path().join("www").to_string_lossy().into_owned(),
            ports,
            download_bytes,
        };
        let child = Command::new("/bin/busybox")
            .args(["sh", "-c", &server_script(&spec).unwrap()])
            .process_group(0)
            .spawn()
            .unwrap();
        let _servers = HostServers(child);
        let pod = PodServers {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            ports,
        };
        wait_servers(&pod, "bench-pod-1", download_bytes, T).unwrap();
        // Each nc server serves one connection after another.
        for _ in 0..2 {
            upload(pod.upload(), 3 << 20, T).unwrap();
            download(pod.download(), download_bytes, T).unwrap();
        }
        let e = download(pod.download(), download_bytes + 1, T).unwrap_err();
        assert!(matches!(e, PodNetError::Short { .. }), "{e}");
        let e = wait_page(pod.http(), "another-pod", Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("expected \"another-pod\""), "{e}");
    }
}
