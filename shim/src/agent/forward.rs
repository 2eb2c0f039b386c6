//! Port-forward streams to the agent (`agent_protocol::forward`): one hybrid-vsock connection
//! to [`AGENT_FORWARD_PORT`] per forwarded TCP connection, the request `tcp <port>\n`, and the
//! agent's reply line, read one byte at a time (what follows is the port's stream), bounded in
//! length and time. The agent's text in an error passes [`agent_text`](super::agent_text).

use std::path::Path;
use std::time::Duration;

use agent_protocol::forward::{ForwardReply, ForwardRequest, MAX_LINE_LEN};
pub use agent_protocol::AGENT_FORWARD_PORT;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::{agent_text, handshake, AgentError, HandshakeError};

/// Why a port could not be forwarded.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("no reply from the agent in {0:?}")]
    TimedOut(Duration),
    #[error("reading the agent's reply: {0}")]
    Read(std::io::Error),
    #[error("the agent's reply: {0}")]
    BadReply(String),
    #[error("the guest: {0}")]
    Refused(String),
}

/// Opens a stream to TCP `port` on the guest's loopback, within `timeout` in all. The returned
/// stream carries that connection's bytes.
pub async fn open_forward_stream(
    uds_path: &Path,
    port: u16,
    timeout: Duration,
) -> Result<UnixStream, ForwardError> {
    let deadline = Instant::now() + timeout;
    let handshake_err = |source| AgentError::Handshake {
        path: uds_path.to_owned(),
        port: AGENT_FORWARD_PORT,
        source,
    };
    let mut stream = handshake(uds_path, AGENT_FORWARD_PORT, deadline)
        .await
        .map_err(handshake_err)?;
    let request = ForwardRequest { port }.line();
    let exchange = async {
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| ForwardError::Agent(handshake_err(HandshakeError::Send(e))))?;
        read_reply(&mut stream).await
    };
    match tokio::time::timeout_at(deadline, exchange).await {
        Err(_) => Err(ForwardError::TimedOut(timeout)),
        Ok(Err(e)) => Err(e),
        Ok(Ok(ForwardReply::Connected)) => Ok(stream),
        Ok(Ok(ForwardReply::Failed(why))) => Err(ForwardError::Refused(agent_text(&why))),
    }
}

async fn read_reply(stream: &mut UnixStream) -> Result<ForwardReply, ForwardError> {
    let mut line = Vec::with_capacity(64);
    loop {
        let byte = stream.read_u8().await.map_err(ForwardError::Read)?;
        line.push(byte);
        if byte == b'\n' {
            break;
        }
        if line.len() >= MAX_LINE_LEN {
            return Err(ForwardError::BadReply(format!(
                "longer than {MAX_LINE_LEN} bytes"
            )));
        }
    }
    ForwardReply::parse(&line).map_err(|e| ForwardError::BadReply(agent_text(&e.to_string())))
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::agent::connection::tests::TempDir;

    /// Plays the VMM and the agent: accepts one connection, checks CONNECT and the request,
    /// answers `reply`, then echoes what follows.
    fn guest(listener: UnixListener, reply: &'static [u8]) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            reader.read_line(&mut line).expect("CONNECT");
            assert_eq!(line, format!("CONNECT {AGENT_FORWARD_PORT}\n"));
            let mut stream = stream;
            stream.write_all(b"OK 7\n").expect("OK");
            line.clear();
            reader.read_line(&mut line).expect("request");
            assert_eq!(line, "tcp 8080\n");
            stream.write_all(reply).expect("reply");
            let mut buf = [0u8; 5];
            if reader.read_exact(&mut buf).is_ok() {
                stream.write_all(&buf).expect("echo");
            }
        })
    }

    #[tokio::test]
    async fn an_ok_gives_the_stream_and_an_error_names_the_guests_words() {
        let dir = TempDir::new("forward-ok");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let g = guest(listener, b"ok\n");
        let mut s = open_forward_stream(&dir.sock(), 8080, Duration::from_secs(5))
            .await
            .expect("forwarded");
        s.write_all(b"hello").await.expect("send");
        let mut back = [0u8; 5];
        s.read_exact(&mut back).await.expect("echo");
        assert_eq!(&back, b"hello");
        g.join().expect("guest");

        let dir = TempDir::new("forward-refused");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let g = guest(listener, b"error nothing \x1b[2J on 8080\n");
        let err = open_forward_stream(&dir.sock(), 8080, Duration::from_secs(5))
            .await
            .expect_err("refused");
        assert_eq!(
            err.to_string(),
            "the guest: nothing \\u{1b}[2J on 8080",
            "escaped"
        );
        g.join().expect("guest");
    }

    #[tokio::test]
    async fn a_silent_or_endless_reply_is_bounded() {
        let dir = TempDir::new("forward-endless");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let endless: &'static [u8] = &[b'x'; 4096];
        let g = guest(listener, endless);
        let err = open_forward_stream(&dir.sock(), 8080, Duration::from_secs(5))
            .await
            .expect_err("too long");
        assert!(matches!(err, ForwardError::BadReply(_)), "{err}");
        drop(g);

        let dir = TempDir::new("forward-silent");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let g = guest(listener, b"");
        let err = open_forward_stream(&dir.sock(), 8080, Duration::from_millis(300))
            .await
            .expect_err("silent");
        assert!(matches!(err, ForwardError::TimedOut(_)), "{err}");
        drop(g);
    }
}
