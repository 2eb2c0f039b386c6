//! Port-forward streams (`agent_protocol::forward`): the host's half of `kubectl port-forward`
//! ends in the shim, which opens one connection here per forwarded TCP connection with the
//! request `tcp <port>\n`. The agent dials that port on the guest's loopback, 127.0.0.1 first
//! and then ::1 (as containerd dials `localhost` in a runc pod's netns), in the network
//! namespace the pod's containers share (the agent's own), answers `ok` or `error <why>`, and
//! copies the bytes both ways: one thread per direction, each ending at its source's EOF with a
//! shutdown of the other side's write half, so half-closes pass through.

use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_protocol::forward::{ForwardReply, ForwardRequest, MAX_LINE_LEN};

use crate::listener::{self, shutdown, Conn, ListenError};

/// Time a new connection has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Time dialing one loopback address may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the host may go on sending after the port's side ended (containerd itself gives
/// the other direction 1 s).
const HALF_CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Forwarded connections at once; the next one is answered with an error.
const MAX_FORWARDS: usize = 256;

/// The default port-forward address in the guest.
pub fn default_address() -> String {
    format!("vsock://-1:{}", agent_protocol::AGENT_FORWARD_PORT)
}

/// Binds `address` (`vsock://-1:PORT` or `unix:///path`) and serves port-forward connections
/// for the agent's whole life.
pub fn serve(address: &str) -> Result<(), ListenError> {
    let active = Arc::new(AtomicUsize::new(0));
    listener::serve(address, "forward", move |conn| {
        handle_connection(conn, &active)
    })
}

/// Counts one forwarded connection while it lives.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>) -> Option<Self> {
        let taken = active.fetch_add(1, Ordering::AcqRel);
        let slot = Self(active.clone());
        (taken < MAX_FORWARDS).then_some(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn handle_connection(mut conn: Conn, active: &Arc<AtomicUsize>) {
    let request = match listener::read_line(&mut conn, MAX_LINE_LEN, REQUEST_TIMEOUT)
        .and_then(|line| ForwardRequest::parse(&line).map_err(|e| e.to_string()))
    {
        Ok(r) => r,
        Err(e) => {
            log::warn!("port-forward connection refused: {e}");
            return;
        }
    };
    let Some(slot) = Slot::take(active) else {
        reply(
            &mut conn,
            &ForwardReply::Failed(format!(
                "{MAX_FORWARDS} port-forward connections are open in this pod already"
            )),
        );
        return;
    };
    let tcp = match dial_loopback(request.port) {
        Ok(tcp) => tcp,
        Err(why) => {
            log::info!("port-forward to port {}: {why}", request.port);
            reply(&mut conn, &ForwardReply::Failed(why));
            return;
        }
    };
    if !reply(&mut conn, &ForwardReply::Connected) {
        return;
    }
    log::debug!("port-forward to port {}: connected", request.port);
    splice(conn, tcp, slot);
}

fn reply(conn: &mut Conn, reply: &ForwardReply) -> bool {
    match conn.write_all(reply.line().as_bytes()) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("port-forward: writing the reply: {e}");
            false
        }
    }
}

/// Dials `port` on 127.0.0.1, then on ::1.
fn dial_loopback(port: u16) -> Result<TcpStream, String> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&v4, DIAL_TIMEOUT) {
        Ok(tcp) => Ok(tcp),
        Err(e4) => TcpStream::connect_timeout(&v6, DIAL_TIMEOUT).map_err(|e6| {
            format!("nothing accepts on port {port} in the pod: {v4}: {e4}; {v6}: {e6}")
        }),
    }
}

/// Copies both ways until both directions ended; the slot is freed then. When the port's side
/// ends first, the host gets a half-close and [`HALF_CLOSE_GRACE`] to end its own direction;
/// then the connection is shut both ways (not every vsock device passes a half-close on to the
/// host: QEMU's vhost-device-vsock does not, and the host would wait forever for an EOF).
fn splice(conn: Conn, tcp: TcpStream, slot: Slot) {
    let (Ok(conn_in), Ok(tcp_out)) = (conn.try_clone(), tcp.try_clone()) else {
        log::warn!("port-forward: duplicating the connection's fds failed");
        return;
    };
    let (ended_tx, ended_rx) = std::sync::mpsc::channel::<()>();
    let inbound = std::thread::Builder::new()
        .name("forward-in".into())
        .spawn(move || {
            // Host -> guest port: at the host's EOF, the port's side sees EOF too.
            let _ = io::copy(&mut &conn_in, &mut &tcp_out);
            let _ = tcp_out.shutdown(std::net::Shutdown::Write);
            drop(ended_tx);
        });
    // Guest port -> host.
    let _ = io::copy(&mut &tcp, &mut &conn);
    shutdown(&conn, libc::SHUT_WR);
    if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = ended_rx.recv_timeout(HALF_CLOSE_GRACE)
    {
        shutdown(&conn, libc::SHUT_RDWR);
        let _ = tcp.shutdown(std::net::Shutdown::Both);
    }
    match inbound {
        Ok(thread) => {
            let _ = thread.join();
        }
        Err(e) => log::warn!("port-forward: no thread for the inbound copy: {e}"),
    }
    drop(slot);
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::os::unix::net::UnixStream;

    use super::*;

    fn forward_address(dir: &tempfile::TempDir) -> (String, std::path::PathBuf) {
        let path = dir.path().join("forward.sock");
        (format!("unix://{}", path.display()), path)
    }

    fn request(path: &std::path::Path, port: u16) -> (UnixStream, Vec<u8>) {
        let mut s = UnixStream::connect(path).expect("connect");
        s.write_all(ForwardRequest { port }.line().as_bytes())
            .expect("request");
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).expect("reply") == 1 {
            line.push(b[0]);
            if b[0] == b'\n' {
                break;
            }
        }
        (s, line)
    }

    #[test]
    fn a_request_reaches_the_loopback_port_both_ways_with_half_close() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (address, path) = forward_address(&dir);
        serve(&address).expect("serve");
        let server = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let port = server.local_addr().expect("addr").port();
        let echo = std::thread::spawn(move || {
            let (mut c, _) = server.accept().expect("accept");
            let mut got = Vec::new();
            c.read_to_end(&mut got).expect("read to EOF");
            c.write_all(&got).expect("echo");
        });
        let (mut s, line) = request(&path, port);
        assert_eq!(ForwardReply::parse(&line), Ok(ForwardReply::Connected));
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        s.write_all(&data).expect("send");
        // Our EOF reaches the server, whose answer still comes back.
        s.shutdown(std::net::Shutdown::Write).expect("half close");
        let mut back = Vec::new();
        s.read_to_end(&mut back).expect("echoed");
        assert_eq!(back, data);
        echo.join().expect("echo thread");
    }

    #[test]
    fn a_port_nobody_listens_on_is_an_error_reply_and_garbage_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (address, path) = forward_address(&dir);
        serve(&address).expect("serve");
        // A port just freed: nothing listens there.
        let port = {
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
            l.local_addr().expect("addr").port()
        };
        let (_s, line) = request(&path, port);
        match ForwardReply::parse(&line) {
            Ok(ForwardReply::Failed(why)) => {
                assert!(why.contains(&format!("port {port}")), "{why}")
            }
            other => panic!("{other:?}"),
        }
        let mut s = UnixStream::connect(&path).expect("connect");
        s.write_all(b"tcp 99999\n").expect("garbage");
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).expect("closed");
        assert!(rest.is_empty(), "{rest:?}");
    }
}
