//! The agent's port-forward reply as the shim reads it (`shim::agent::forward::open_forward_stream`):
//! after the hybrid-vsock handshake to port 1027 and the request `tcp 8080\n`, the guest's agent
//! answers a line, then the stream's bytes. The peer here plays the VMM's `OK` and writes the
//! tape's bytes as the agent's, then closes. Checked: a stream is given only for the reply
//! `ok\n`, and every byte after it is left in the stream, in order; an error's text is bounded
//! and carries no control character but newline and tab (it reaches a log line).
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::rt::runtime;
use microvm_fuzz::scratch::{self, Scratch};
use shim::agent::forward::{open_forward_stream, AGENT_FORWARD_PORT};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::agent_forward);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("forward");
        let uds = dir.path().join("v.sock");
        let reply = data.to_vec();
        runtime().block_on(async move {
            let listener = UnixListener::bind(&uds).expect("listener");
            let peer = tokio::spawn(async move {
                let (stream, _) = listener.accept().await.expect("accept");
                let mut stream = BufReader::new(stream);
                let mut line = Vec::new();
                let _ = stream.read_until(b'\n', &mut line).await;
                assert_eq!(line, format!("CONNECT {AGENT_FORWARD_PORT}\n").as_bytes());
                let _ = stream.get_mut().write_all(b"OK 7\n").await;
                line.clear();
                let _ = stream.read_until(b'\n', &mut line).await;
                assert_eq!(line, b"tcp 8080\n");
                let _ = stream.get_mut().write_all(&reply).await;
            });
            let result = open_forward_stream(&uds, 8080, Duration::from_secs(5)).await;
            peer.await.expect("peer");
            match result {
                Ok(mut stream) => {
                    assert!(data.starts_with(b"ok\n"), "a stream without `ok`");
                    let mut rest = Vec::new();
                    stream.read_to_end(&mut rest).await.expect("read the rest");
                    assert_eq!(rest, &data[3..], "the bytes after the reply line");
                }
                Err(e) => {
                    let text = e.to_string();
                    assert!(text.len() < 8192, "an error of {} bytes", text.len());
                    assert!(
                        !text.chars().any(|c| c.is_control() && c != '\n' && c != '\t'),
                        "a control character in {text:?}"
                    );
                }
            }
        });
    }
);
