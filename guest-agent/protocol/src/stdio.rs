//! The header line that opens each stdio connection on [`crate::AGENT_STDIO_PORT`]:
//! `<container_id> <exec_id or -> <stdin|stdout|stderr>\n`, at most [`MAX_HEADER_LEN`] bytes.
//! Shared by the agent (parsing) and the shim (writing), so both agree on ids and bounds.

use std::fmt;

/// Longest id accepted for containers and execs.
pub const MAX_ID_LEN: usize = 128;

/// Longest header line, newline included.
pub const MAX_HEADER_LEN: usize = 2 * MAX_ID_LEN + 16;

/// One of a process's three streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Stdin,
    Stdout,
    Stderr,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stdin => "stdin",
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        }
    }

    fn parse(word: &str) -> Option<Self> {
        match word {
            "stdin" => Some(Self::Stdin),
            "stdout" => Some(Self::Stdout),
            "stderr" => Some(Self::Stderr),
            _ => None,
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether `id` is a valid container or exec id: 1-128 bytes of `[A-Za-z0-9_.-]`, not starting
/// with `.` or `-` (so it is a safe file name and never the `-` placeholder).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with(['.', '-'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A parsed header: which process (exec_id "" = init) and which stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamHeader {
    pub container_id: String,
    pub exec_id: String,
    pub kind: StreamKind,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("stdio header is not `<container_id> <exec_id|-> <stdin|stdout|stderr>`: {0:?}")]
    Malformed(String),
    #[error("invalid id {0:?}")]
    BadId(String),
}

impl StreamHeader {
    /// The header line, newline included. Fails on ids that [`valid_id`] rejects (exec_id may
    /// be empty).
    pub fn line(&self) -> Result<String, HeaderError> {
        if !valid_id(&self.container_id) {
            return Err(HeaderError::BadId(self.container_id.clone()));
        }
        let exec = if self.exec_id.is_empty() {
            "-"
        } else if valid_id(&self.exec_id) {
            &self.exec_id
        } else {
            return Err(HeaderError::BadId(self.exec_id.clone()));
        };
        Ok(format!("{} {exec} {}\n", self.container_id, self.kind))
    }

    /// Parses one header line (with or without its newline).
    pub fn parse(line: &[u8]) -> Result<Self, HeaderError> {
        let malformed = || HeaderError::Malformed(String::from_utf8_lossy(line).into_owned());
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let text = std::str::from_utf8(line).map_err(|_| malformed())?;
        let mut words = text.split(' ');
        let (Some(container), Some(exec), Some(kind), None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            return Err(malformed());
        };
        let kind = StreamKind::parse(kind).ok_or_else(malformed)?;
        if !valid_id(container) {
            return Err(HeaderError::BadId(container.to_owned()));
        }
        let exec_id = if exec == "-" {
            String::new()
        } else if valid_id(exec) {
            exec.to_owned()
        } else {
            return Err(HeaderError::BadId(exec.to_owned()));
        };
        Ok(Self {
            container_id: container.to_owned(),
            exec_id,
            kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(valid_id("abc-DEF_1.2"));
        assert!(valid_id(&"a".repeat(128)));
        for bad in ["", "-", ".x", "-x", "a b", "a/b", "é", &"a".repeat(129)] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = StreamHeader {
            container_id: "c1".into(),
            exec_id: String::new(),
            kind: StreamKind::Stdout,
        };
        assert_eq!(h.line().unwrap(), "c1 - stdout\n");
        assert_eq!(StreamHeader::parse(b"c1 - stdout\n").unwrap(), h);
        let e = StreamHeader::parse(b"c1 e2 stdin").unwrap();
        assert_eq!((e.exec_id.as_str(), e.kind), ("e2", StreamKind::Stdin));
        for bad in [
            &b"c1 - stdout extra\n"[..],
            b"c1 -\n",
            b"c1  stdout\n",
            b"c1 - stdio\n",
            b"../x - stdin\n",
            b"c1 ../x stdin\n",
            b"\xff - stdin\n",
            b"",
        ] {
            assert!(StreamHeader::parse(bad).is_err(), "{bad:?}");
        }
        let bad_exec = StreamHeader {
            exec_id: "a/b".into(),
            ..h
        };
        assert!(bad_exec.line().is_err());
    }
}
