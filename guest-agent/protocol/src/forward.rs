//! Port-forward streams on [`crate::AGENT_FORWARD_PORT`]: the shim opens one connection per
//! forwarded TCP connection (containerd's PortForward dialing `localhost:<port>` in the pod's
//! netns on the host) and writes the request line `tcp <port>\n`; the agent dials that port on
//! the guest's loopback (127.0.0.1, then ::1) and answers one reply line: `ok\n`, after which
//! the connection carries the TCP stream's bytes both ways, or `error <text>\n` and closes.
//! Both lines are at most [`MAX_LINE_LEN`] bytes. Shared by the agent (parsing the request,
//! writing the reply) and the shim (the reverse), so both agree on the words and the bounds.

/// Longest request or reply line, newline included; a longer error text is cut to fit.
pub const MAX_LINE_LEN: usize = 256;

/// A forward request: which TCP port of the guest's loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardRequest {
    pub port: u16,
}

/// The agent's answer to a [`ForwardRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardReply {
    /// Connected: the stream's bytes follow.
    Connected,
    /// Not connected, and why (the agent's words: the host treats them as untrusted text).
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardLineError {
    #[error("port-forward request is not `tcp <port 1-65535>`: {0:?}")]
    BadRequest(String),
    #[error("port-forward reply is not `ok` or `error <text>`: {0:?}")]
    BadReply(String),
}

fn text_of(line: &[u8]) -> Option<&str> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    if line.len() >= MAX_LINE_LEN {
        return None;
    }
    std::str::from_utf8(line).ok()
}

fn lossy(line: &[u8]) -> String {
    String::from_utf8_lossy(&line[..line.len().min(MAX_LINE_LEN)]).into_owned()
}

impl ForwardRequest {
    /// The request line, newline included.
    pub fn line(&self) -> String {
        format!("tcp {}\n", self.port)
    }

    /// Parses one request line (with or without its newline): `tcp`, one space, a port of
    /// 1-65535 in plain decimal digits.
    pub fn parse(line: &[u8]) -> Result<Self, ForwardLineError> {
        let bad = || ForwardLineError::BadRequest(lossy(line));
        let digits = text_of(line)
            .and_then(|t| t.strip_prefix("tcp "))
            .ok_or_else(bad)?;
        if digits.is_empty() || digits.len() > 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        match digits.parse::<u16>() {
            Ok(port) if port != 0 => Ok(Self { port }),
            _ => Err(bad()),
        }
    }
}

impl ForwardReply {
    /// The reply line, newline included: an error's text has its control characters replaced
    /// by spaces and is cut (on a char boundary) so that the line fits [`MAX_LINE_LEN`].
    pub fn line(&self) -> String {
        match self {
            Self::Connected => "ok\n".to_owned(),
            Self::Failed(text) => {
                let mut line = String::from("error ");
                for c in text.chars() {
                    let c = if c.is_control() { ' ' } else { c };
                    if line.len() + c.len_utf8() + 1 > MAX_LINE_LEN {
                        break;
                    }
                    line.push(c);
                }
                line.push('\n');
                line
            }
        }
    }

    /// Parses one reply line (with or without its newline).
    pub fn parse(line: &[u8]) -> Result<Self, ForwardLineError> {
        let bad = || ForwardLineError::BadReply(lossy(line));
        let text = text_of(line).ok_or_else(bad)?;
        if text == "ok" {
            return Ok(Self::Connected);
        }
        text.strip_prefix("error ")
            .map(|why| Self::Failed(why.to_owned()))
            .ok_or_else(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_garbage_is_refused() {
        for port in [1, 80, 8080, 65535] {
            let req = ForwardRequest { port };
            assert_eq!(ForwardRequest::parse(req.line().as_bytes()), Ok(req));
        }
        assert_eq!(ForwardRequest { port: 80 }.line(), "tcp 80\n");
        for bad in [
            &b"tcp 0\n"[..],
            b"tcp 65536\n",
            b"tcp 080080\n",
            b"tcp +80\n",
            b"tcp -1\n",
            b"tcp  80\n",
            b"tcp 80 \n",
            b"udp 80\n",
            b"tcp\n",
            b"tcp \n",
            b"",
            b"\xff\xfe",
        ] {
            assert!(ForwardRequest::parse(bad).is_err(), "{bad:?}");
        }
        let long = format!("tcp {}\n", "1".repeat(MAX_LINE_LEN));
        assert!(ForwardRequest::parse(long.as_bytes()).is_err());
    }

    #[test]
    fn replies_round_trip_with_their_text_bounded_and_flat() {
        assert_eq!(ForwardReply::Connected.line(), "ok\n");
        assert_eq!(ForwardReply::parse(b"ok\n"), Ok(ForwardReply::Connected));
        let refused = ForwardReply::Failed("connecting to 127.0.0.1:81: refused".into());
        assert_eq!(ForwardReply::parse(refused.line().as_bytes()), Ok(refused));
        // Control characters become spaces: one line, nothing for a terminal.
        let line = ForwardReply::Failed("a\nb\x1b[2J".into()).line();
        assert_eq!(line, "error a b [2J\n");
        // A long text is cut to the bound, on a char boundary.
        let line = ForwardReply::Failed("€".repeat(1000)).line();
        assert!(line.len() <= MAX_LINE_LEN, "{}", line.len());
        assert!(matches!(
            ForwardReply::parse(line.as_bytes()),
            Ok(ForwardReply::Failed(t)) if t.starts_with("€€")
        ));
        for bad in [&b"OK\n"[..], b"okay\n", b"error\n", b"", b"\xff\n"] {
            assert!(ForwardReply::parse(bad).is_err(), "{bad:?}");
        }
        let long = format!("error {}\n", "x".repeat(MAX_LINE_LEN));
        assert!(ForwardReply::parse(long.as_bytes()).is_err());
    }
}
