//! The agent's ready event as the shim reads it (`shim::vm::ready::ReadyListener`): the guest
//! connects to host vsock port 1026 and writes a line; the shim's listener takes the first
//! connection and reads one bounded line. The peer here writes the tape's bytes and closes its
//! side. Checked: the event is accepted only for a first line that starts with the agent's
//! ready prefix.
#![no_main]

use std::io::Write;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use agent_protocol::AGENT_READY_PREFIX;
use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use shim::vm::ready::{host_port_path, ReadyListener};

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::ready_line);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("ready");
        let uds = dir.path().join("v.sock");
        let listener = ReadyListener::bind(&uds).expect("ready listener");
        let mut peer =
            UnixStream::connect(host_port_path(&uds, agent_protocol::AGENT_READY_PORT))
                .expect("connect");
        // The socket buffer takes a small line whole; a large one is cut where it is full.
        peer.set_nonblocking(true).expect("nonblocking");
        let _ = peer.write(data);
        let _ = peer.shutdown(Shutdown::Write);
        let result = listener.wait(Duration::from_secs(5), || false);
        if result.is_ok() {
            assert!(
                data.starts_with(AGENT_READY_PREFIX.as_bytes()),
                "accepted {:?}",
                String::from_utf8_lossy(&data[..data.len().min(80)])
            );
        }
    }
);
