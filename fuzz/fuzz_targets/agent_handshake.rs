//! The hybrid-vsock handshake's reply as the shim reads it (`shim::agent::connection::handshake`):
//! the shim sends `CONNECT <port>\n` on the VM's socket and reads the reply the VMM's muxer, or
//! under QEMU vhost-device-vsock, wrote from what the guest did. The peer here writes the
//! tape's bytes and closes. Checked: an accepted reply is `OK <digits>\n`, and every byte after
//! its newline is left in the stream for ttrpc, in order.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::rt::runtime;
use microvm_fuzz::scratch::{self, Scratch};
use shim::agent::connection::handshake;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::agent_handshake);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("handshake");
        let uds = dir.path().join("v.sock");
        let reply = data.to_vec();
        runtime().block_on(async move {
            let listener = UnixListener::bind(&uds).expect("listener");
            let peer = tokio::spawn(async move {
                let (stream, _) = listener.accept().await.expect("accept");
                let mut stream = BufReader::new(stream);
                let mut line = Vec::new();
                let _ = stream.read_until(b'\n', &mut line).await;
                assert_eq!(line, b"CONNECT 1024\n");
                let _ = stream.get_mut().write_all(&reply).await;
            });
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            let result = handshake(&uds, 1024, deadline).await;
            peer.await.expect("peer");
            if let Ok(mut stream) = result {
                let nl = data.iter().position(|b| *b == b'\n').expect("a line ended");
                let line = std::str::from_utf8(&data[..nl]).expect("an accepted line is text");
                let digits = line.strip_prefix("OK ").expect("OK line");
                assert!(!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()));
                let mut rest = Vec::new();
                stream.read_to_end(&mut rest).await.expect("read the rest");
                assert_eq!(rest, &data[nl + 1..], "the bytes after the reply line");
            }
        });
    }
);
