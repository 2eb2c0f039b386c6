//! The client side of CRI PortForward's streaming protocol, as containerd's stream server (the
//! kubelet's streaming library) serves it over WebSocket (`v4.channel.k8s.io`): per requested
//! port two channels, data (2i) and error (2i+1); every binary message starts with its channel
//! number; the server first writes each channel's port (u16, little-endian); the session ends
//! when the server closes the WebSocket, after every port's forward ended. kubectl speaks the
//! same forwards over SPDY to the kubelet; the stream server hands both to the same
//! PortForward of containerd, which is what these tests exercise.

use std::net::TcpStream;
use std::time::Duration;

use tungstenite::client::IntoClientRequest;
use tungstenite::{Message, WebSocket};

const PROTOCOL: &str = "v4.channel.k8s.io";

/// One PortForward session (one WebSocket) for the ports given to CRI PortForward.
pub struct PortForwardSession {
    ws: WebSocket<TcpStream>,
    ports: Vec<u16>,
}

/// What a session carried, per port in the order requested: the data the pod sent, and the
/// error text containerd wrote (empty when the forward ended cleanly).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Forwarded {
    pub data: Vec<Vec<u8>>,
    pub errors: Vec<String>,
}

impl PortForwardSession {
    /// Opens the stream at `url` (CRI PortForward's answer) for `ports` (those of the
    /// request), and reads the server's port announcements. Every read waits at most `timeout`.
    pub fn open(url: &str, ports: &[u16], timeout: Duration) -> Result<Self, String> {
        let ws_url = url
            .strip_prefix("http://")
            .map(|rest| format!("ws://{rest}"))
            .ok_or_else(|| format!("not an http:// stream URL: {url}"))?;
        let authority = ws_url
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let tcp = TcpStream::connect(&authority).map_err(|e| format!("{authority}: {e}"))?;
        tcp.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let mut request = ws_url
            .as_str()
            .into_client_request()
            .map_err(|e| e.to_string())?;
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            PROTOCOL.parse().map_err(|e| format!("{e}"))?,
        );
        let (ws, response) =
            tungstenite::client::client(request, tcp).map_err(|e| format!("{ws_url}: {e}"))?;
        let chosen = response
            .headers()
            .get("Sec-WebSocket-Protocol")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        if chosen != PROTOCOL {
            return Err(format!("the server chose protocol {chosen:?}"));
        }
        let mut session = Self {
            ws,
            ports: ports.to_vec(),
        };
        let mut announced = vec![false; 2 * ports.len()];
        while announced.iter().any(|a| !a) {
            let (channel, body) = session
                .next_frame()?
                .ok_or("closed before announcing the ports")?;
            let port = ports.get(channel / 2).copied();
            if body.len() != 2 || port != Some(u16::from_le_bytes([body[0], body[1]])) {
                return Err(format!(
                    "channel {channel} announced {body:?}, expected port {port:?}"
                ));
            }
            announced[channel] = true;
        }
        Ok(session)
    }

    /// Sends `data` to the pod's port at `index` of the requested ports.
    pub fn send(&mut self, index: usize, data: &[u8]) -> Result<(), String> {
        if index >= self.ports.len() {
            return Err(format!("no port at index {index}"));
        }
        let channel = u8::try_from(2 * index).map_err(|e| e.to_string())?;
        let mut message = Vec::with_capacity(data.len() + 1);
        message.push(channel);
        message.extend_from_slice(data);
        self.ws
            .send(Message::Binary(message.into()))
            .map_err(|e| format!("sending to port {}: {e}", self.ports[index]))
    }

    /// Reads until the server closes the session: what each port's forward carried.
    pub fn finish(mut self) -> Result<Forwarded, String> {
        let mut out = Forwarded {
            data: vec![Vec::new(); self.ports.len()],
            errors: vec![String::new(); self.ports.len()],
        };
        while let Some((channel, body)) = self.next_frame()? {
            let index = channel / 2;
            if index >= self.ports.len() {
                return Err(format!("a message on channel {channel}"));
            }
            if channel % 2 == 0 {
                out.data[index].extend_from_slice(&body);
            } else {
                out.errors[index].push_str(&String::from_utf8_lossy(&body));
            }
        }
        Ok(out)
    }

    /// The next binary message as (channel, body); `None` once the server closed.
    fn next_frame(&mut self) -> Result<Option<(usize, Vec<u8>)>, String> {
        loop {
            match self.ws.read() {
                Ok(Message::Binary(bytes)) => {
                    let Some((&channel, body)) = bytes.split_first() else {
                        return Err("an empty message".into());
                    };
                    return Ok(Some((usize::from(channel), body.to_vec())));
                }
                Ok(Message::Close(_))
                | Err(tungstenite::Error::ConnectionClosed)
                | Err(tungstenite::Error::AlreadyClosed) => return Ok(None),
                // An abrupt end of the TCP stream after the last message is also the end.
                Err(tungstenite::Error::Protocol(
                    tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
                )) => return Ok(None),
                Ok(_) => {}
                Err(e) => return Err(format!("reading the session: {e}")),
            }
        }
    }
}

/// The body of an HTTP/1.0 response with status 200, or why it is not one.
pub fn http_body(reply: &[u8]) -> Result<Vec<u8>, String> {
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP reply: {:?}", String::from_utf8_lossy(reply)))?;
    if !reply.starts_with(b"HTTP/1.0 200") && !reply.starts_with(b"HTTP/1.1 200") {
        return Err(format!(
            "HTTP status {:?}",
            String::from_utf8_lossy(&reply[..split.min(40)])
        ));
    }
    Ok(reply[split + 4..].to_vec())
}
