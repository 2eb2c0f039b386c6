//! The agent's ttrpc replies and events as the shim reads them: the real `shim::agent::AgentClient`
//! (hybrid-vsock handshake, ttrpc's async client, the generated protobuf types, the client's own
//! checks) against a stand-in agent that answers the shim's call with the tape's bytes: either
//! a well-framed ttrpc response (status code, message and reply payload from the tape, the right
//! stream id) or raw bytes on the connection (frames of any length, type and stream), then
//! closes. The calls are the shim's, including the long polls whose answers become containerd
//! events (WaitProcess: TaskExit; GetOomEvent: TaskOOM).
//!
//! Checked: what the client returns keeps the bounds it promises (Check's strings, ListPids'
//! count, an OOM event's container id), and every call ends (the peer closes).
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::rt::runtime;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use protobuf::Message;
use shim::agent::AgentClient;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

/// What the stand-in agent sends.
enum Answer {
    /// A response frame for the shim's request: status code, message, payload.
    Framed {
        code: i32,
        message: String,
        payload: Vec<u8>,
    },
    /// Bytes as they are.
    Raw(Vec<u8>),
}

const METHODS: u8 = 10;

async fn call(client: &AgentClient, method: u8) {
    match method % METHODS {
        0 => {
            if let Ok(info) = client.check().await {
                assert!(info.agent_version.len() <= 64);
                assert!(info.kernel_release.len() <= 256);
                assert!(info.boot_id.len() <= 64);
                assert_ne!(info.online_vcpus, 0);
            }
        }
        1 => {
            if let Ok(pids) = client.list_pids("c1").await {
                assert!(pids.len() <= 65_536);
            }
        }
        2 => {
            let _ = client.wait_process("c1", "", Duration::from_secs(5)).await;
        }
        3 => {
            if let Ok(Some(id)) = client.get_oom_event(Duration::from_secs(5)).await {
                assert!(agent_protocol::stdio::valid_id(&id), "OOM event for {id:?}");
            }
        }
        4 => {
            let _ = client.stats("c1").await;
        }
        5 => {
            let _ = client.start_container("c1").await;
        }
        6 => {
            let _ = client.start_exec("c1", "e1").await;
        }
        7 => {
            let _ = client.shutdown().await;
        }
        8 => {
            let _ = client.signal_process("c1", "", 9, false).await;
        }
        _ => {
            let _ = client.remove_container("c1").await;
        }
    }
}

/// The stand-in agent: the handshake, the shim's request frame, the answer, close.
async fn agent(listener: UnixListener, answer: Answer) {
    let Ok((stream, _)) = listener.accept().await else {
        return;
    };
    let mut stream = BufReader::new(stream);
    let mut line = Vec::new();
    let _ = stream.read_until(b'\n', &mut line).await;
    if stream
        .get_mut()
        .write_all(b"OK 1073741824\n")
        .await
        .is_err()
    {
        return;
    }
    // The request: a 10-byte header (length, stream id, type, flags; big endian) and its body.
    let mut header = [0u8; 10];
    if stream.read_exact(&mut header).await.is_err() {
        return;
    }
    let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let stream_id = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
    let mut body = vec![0u8; len.min(1 << 20)];
    if stream.read_exact(&mut body).await.is_err() {
        return;
    }
    let bytes = match answer {
        Answer::Framed {
            code,
            message,
            payload,
        } => {
            let mut status = ttrpc::Status::new();
            status.code = protobuf::EnumOrUnknown::from_i32(code);
            status.message = message;
            let mut response = ttrpc::Response::new();
            if code != 0 {
                response.status = protobuf::MessageField::some(status);
            }
            response.payload = payload;
            let body = response.write_to_bytes().expect("encode a response");
            let mut frame = Vec::with_capacity(10 + body.len());
            frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
            frame.extend_from_slice(&stream_id.to_be_bytes());
            frame.extend_from_slice(&[2, 0]);
            frame.extend_from_slice(&body);
            frame
        }
        Answer::Raw(bytes) => bytes,
    };
    let _ = stream.get_mut().write_all(&bytes).await;
    let _ = stream.get_mut().shutdown().await;
}

fn run(dir: &std::path::Path, data: &[u8]) {
    let mut t = Tape::new(data);
    let method = t.u8();
    let answer = if t.bool() {
        Answer::Raw(t.rest().to_vec())
    } else {
        let code = i32::from(t.u8() % 17);
        let message = String::from_utf8_lossy(t.blob()).into_owned();
        Answer::Framed {
            code,
            message,
            payload: t.rest().to_vec(),
        }
    };
    let uds = dir.join("v.sock");
    runtime().block_on(async {
        let listener = UnixListener::bind(&uds).expect("listener");
        let peer = tokio::spawn(agent(listener, answer));
        let connected = AgentClient::connect(&uds, 1024, Duration::from_secs(5)).await;
        if let Ok(mut client) = connected {
            client.set_call_timeout(Duration::from_secs(5));
            call(&client, method).await;
        }
        peer.await.expect("agent task");
    });
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::agent_reply);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("agent");
        run(dir.path(), data);
    }
);
