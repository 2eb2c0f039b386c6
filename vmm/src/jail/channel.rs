//! The control channel between an embedder and a VMM running in a process of its own (the
//! process split, docs/security.md "The VMM's confinement"): one `SOCK_SEQPACKET` socketpair,
//! one message per datagram, descriptors alongside (`SCM_RIGHTS`).
//!
//! Each side treats the other as a peer it does not trust blindly (the VMM process is where a
//! guest that escaped its device code would be): a message is at most [`MAX_MESSAGE`] bytes and
//! [`MAX_FDS`] descriptors, a datagram or descriptor list that was cut (`MSG_TRUNC`,
//! `MSG_CTRUNC`) is an error, strings are bounded and UTF-8, every field is read with checked
//! accessors, and descriptors that come with a message that does not expect them are closed.
//!
//! The encoding is by hand (a tag byte, little-endian integers, length-prefixed strings): a
//! dozen fixed messages do not need a serialization crate, and the decoder stays small enough
//! to check by reading.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage,
    RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags,
    SocketType,
};

/// The largest message, in bytes.
pub const MAX_MESSAGE: usize = 16 << 10;
/// The most descriptors one message carries.
pub const MAX_FDS: usize = 8;
/// The longest string field (a disk's serial, an error's reason).
pub const MAX_STRING: usize = 4096;
/// The longest VM description (`Start`).
pub const MAX_DESCRIPTION: usize = MAX_MESSAGE - 8;

/// What travels on the channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Embedder -> VMM, first: the VM to run ([`super::split::VmDescription`] as JSON, at
    /// most [`MAX_DESCRIPTION`] bytes).
    Start { description: String },
    /// VMM -> embedder: the VM of `Start` runs (its threads are confined); how it boots.
    Started { detail: String },
    /// Embedder -> VMM: is the kernel text template still to be captured? Answered by `Flag`.
    KernelTextMissing,
    /// VMM -> embedder: the answer to a yes/no request.
    Flag { value: bool },
    /// Embedder -> VMM: stop the VM.
    Stop,
    /// Embedder -> VMM: one page sharing pass.
    SharePages,
    /// Embedder -> VMM: fill disk slot `index` with the file sent alongside.
    AttachBlock { index: u32, serial: String },
    /// Embedder -> VMM: empty disk slot `index`.
    DetachBlock { index: u32 },
    /// VMM -> embedder: the request before it succeeded.
    Done,
    /// VMM -> embedder: the request before it failed.
    Failed { reason: String },
    /// VMM -> embedder, unasked: the VM ended (`reset`, `stopped`, or an error's text).
    Ended { how: EndKind, detail: String },
}

/// How a VM ended, as [`Message::Ended`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    Reset = 1,
    Stopped = 2,
    Error = 3,
}

/// Why a message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("the control channel: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the control channel")]
    Closed,
    #[error("a message was cut (more than {MAX_MESSAGE} bytes or {MAX_FDS} descriptors)")]
    Truncated,
    #[error("a malformed message: {0}")]
    Malformed(&'static str),
    #[error("a message of {0} bytes is over the bound")]
    TooLarge(usize),
    #[error("{0} descriptors came with a message that takes {1}")]
    UnexpectedFds(usize, usize),
}

fn io(e: rustix::io::Errno) -> ChannelError {
    ChannelError::Io(e.into())
}

/// One end of the channel.
#[derive(Debug)]
pub struct Channel {
    sock: OwnedFd,
}

impl Channel {
    /// A connected pair (close-on-exec; the embedder clears the flag on the end it hands to
    /// the VMM process).
    pub fn pair() -> Result<(Channel, Channel), ChannelError> {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(io)?;
        Ok((Channel { sock: a }, Channel { sock: b }))
    }

    /// An end received as a descriptor (the VMM process's side).
    pub fn from_fd(sock: OwnedFd) -> Self {
        Channel { sock }
    }

    /// The socket, for polling.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// Sends `msg` with `fds`.
    pub fn send(&self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<(), ChannelError> {
        if fds.len() > MAX_FDS {
            return Err(ChannelError::UnexpectedFds(fds.len(), MAX_FDS));
        }
        let bytes = encode(msg)?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(ChannelError::UnexpectedFds(fds.len(), MAX_FDS));
        }
        let sent = sendmsg(
            &self.sock,
            &[IoSlice::new(&bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(io)?;
        if sent != bytes.len() {
            return Err(ChannelError::Truncated);
        }
        Ok(())
    }

    /// Receives one message and the descriptors that came with it (close-on-exec). Blocks.
    pub fn recv(&self) -> Result<(Message, Vec<OwnedFd>), ChannelError> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &self.sock,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(io)?;
        // Take the descriptors first: whatever happens next, they are owned (and closed).
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if got
            .flags
            .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
        {
            return Err(ChannelError::Truncated);
        }
        if got.bytes == 0 {
            return Err(ChannelError::Closed);
        }
        let msg = decode(&buf[..got.bytes])?;
        let takes = fds_taken(&msg);
        if fds.len() != takes {
            return Err(ChannelError::UnexpectedFds(fds.len(), takes));
        }
        Ok((msg, fds))
    }
}

/// How many descriptors a message comes with.
pub fn fds_taken(msg: &Message) -> usize {
    match msg {
        Message::AttachBlock { .. } => 1,
        _ => 0,
    }
}

const T_STOP: u8 = 1;
const T_SHARE: u8 = 2;
const T_ATTACH: u8 = 3;
const T_DETACH: u8 = 4;
const T_DONE: u8 = 5;
const T_FAILED: u8 = 6;
const T_ENDED: u8 = 7;
const T_START: u8 = 8;
const T_STARTED: u8 = 9;
const T_TEXT_MISSING: u8 = 10;
const T_FLAG: u8 = 11;

fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), ChannelError> {
    put_str_max(out, s, MAX_STRING)
}

fn put_str_max(out: &mut Vec<u8>, s: &str, max: usize) -> Result<(), ChannelError> {
    if s.len() > max {
        return Err(ChannelError::TooLarge(s.len()));
    }
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// The bytes of `msg`.
pub fn encode(msg: &Message) -> Result<Vec<u8>, ChannelError> {
    let mut out = Vec::with_capacity(64);
    match msg {
        Message::Start { description } => {
            out.push(T_START);
            put_str_max(&mut out, description, MAX_DESCRIPTION)?;
        }
        Message::Started { detail } => {
            out.push(T_STARTED);
            put_str(&mut out, detail)?;
        }
        Message::KernelTextMissing => out.push(T_TEXT_MISSING),
        Message::Flag { value } => {
            out.push(T_FLAG);
            out.push(u8::from(*value));
        }
        Message::Stop => out.push(T_STOP),
        Message::SharePages => out.push(T_SHARE),
        Message::AttachBlock { index, serial } => {
            out.push(T_ATTACH);
            out.extend_from_slice(&index.to_le_bytes());
            put_str(&mut out, serial)?;
        }
        Message::DetachBlock { index } => {
            out.push(T_DETACH);
            out.extend_from_slice(&index.to_le_bytes());
        }
        Message::Done => out.push(T_DONE),
        Message::Failed { reason } => {
            out.push(T_FAILED);
            put_str(&mut out, reason)?;
        }
        Message::Ended { how, detail } => {
            out.push(T_ENDED);
            out.push(*how as u8);
            put_str(&mut out, detail)?;
        }
    }
    if out.len() > MAX_MESSAGE {
        return Err(ChannelError::TooLarge(out.len()));
    }
    Ok(out)
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u8(&mut self) -> Result<u8, ChannelError> {
        let (&b, rest) = self
            .0
            .split_first()
            .ok_or(ChannelError::Malformed("short"))?;
        self.0 = rest;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, ChannelError> {
        if self.0.len() < 4 {
            return Err(ChannelError::Malformed("short"));
        }
        let (head, rest) = self.0.split_at(4);
        self.0 = rest;
        Ok(u32::from_le_bytes([head[0], head[1], head[2], head[3]]))
    }

    fn string(&mut self) -> Result<String, ChannelError> {
        self.string_max(MAX_STRING)
    }

    fn string_max(&mut self, max: usize) -> Result<String, ChannelError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(ChannelError::Malformed("a string over the bound"));
        }
        if self.0.len() < len {
            return Err(ChannelError::Malformed("short"));
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        String::from_utf8(head.to_vec()).map_err(|_| ChannelError::Malformed("a string not UTF-8"))
    }

    fn end(self) -> Result<(), ChannelError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ChannelError::Malformed("trailing bytes"))
        }
    }
}

/// The message in `bytes` (all of them).
pub fn decode(bytes: &[u8]) -> Result<Message, ChannelError> {
    let mut r = Reader(bytes);
    let msg = match r.u8()? {
        T_START => Message::Start {
            description: r.string_max(MAX_DESCRIPTION)?,
        },
        T_STARTED => Message::Started {
            detail: r.string()?,
        },
        T_TEXT_MISSING => Message::KernelTextMissing,
        T_FLAG => Message::Flag {
            value: match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(ChannelError::Malformed("a flag neither 0 nor 1")),
            },
        },
        T_STOP => Message::Stop,
        T_SHARE => Message::SharePages,
        T_ATTACH => Message::AttachBlock {
            index: r.u32()?,
            serial: r.string()?,
        },
        T_DETACH => Message::DetachBlock { index: r.u32()? },
        T_DONE => Message::Done,
        T_FAILED => Message::Failed {
            reason: r.string()?,
        },
        T_ENDED => {
            let how = match r.u8()? {
                1 => EndKind::Reset,
                2 => EndKind::Stopped,
                3 => EndKind::Error,
                _ => return Err(ChannelError::Malformed("an unknown end")),
            };
            Message::Ended {
                how,
                detail: r.string()?,
            }
        }
        _ => return Err(ChannelError::Malformed("an unknown message")),
    };
    r.end()?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn all() -> Vec<Message> {
        vec![
            Message::Start {
                description: "{\"vcpus\":1}".into(),
            },
            Message::Started {
                detail: "embedded vmm".into(),
            },
            Message::KernelTextMissing,
            Message::Flag { value: true },
            Message::Stop,
            Message::SharePages,
            Message::AttachBlock {
                index: 3,
                serial: "disk-3".into(),
            },
            Message::DetachBlock { index: u32::MAX },
            Message::Done,
            Message::Failed {
                reason: "no such slot".into(),
            },
            Message::Ended {
                how: EndKind::Error,
                detail: "vCPU 0: triple fault".into(),
            },
        ]
    }

    #[test]
    fn every_message_goes_through_with_its_descriptors() {
        let (a, b) = Channel::pair().unwrap();
        for msg in all() {
            let file = tempfile::tempfile().unwrap();
            let fds: Vec<BorrowedFd<'_>> = (0..fds_taken(&msg)).map(|_| file.as_fd()).collect();
            a.send(&msg, &fds).unwrap();
            let (got, got_fds) = b.recv().unwrap();
            assert_eq!(got, msg);
            assert_eq!(got_fds.len(), fds_taken(&msg));
            // A descriptor that came across is the same open file.
            if let Some(fd) = got_fds.into_iter().next() {
                let mut theirs = std::fs::File::from(fd);
                theirs.write_all(b"through").unwrap();
                let mut mine = file.try_clone().unwrap();
                use std::io::Seek;
                mine.seek(std::io::SeekFrom::Start(0)).unwrap();
                let mut s = String::new();
                mine.read_to_string(&mut s).unwrap();
                assert_eq!(s, "through");
            }
        }
        drop(a);
        assert!(matches!(b.recv(), Err(ChannelError::Closed)));
    }

    #[test]
    fn a_hostile_peer_gets_errors_and_its_descriptors_are_closed() {
        let (a, b) = Channel::pair().unwrap();
        let raw = |bytes: &[u8], fds: &[BorrowedFd<'_>]| {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() {
                assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
            }
            sendmsg(
                &a.sock,
                &[IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .unwrap();
        };
        // Unknown tag, short fields, trailing bytes, a string over the bound or not UTF-8.
        let mut long = vec![T_FAILED];
        long.extend_from_slice(&(MAX_STRING as u32 + 1).to_le_bytes());
        long.resize(long.len() + MAX_STRING + 1, b'x');
        let cases: Vec<Vec<u8>> = vec![
            vec![0xff],
            vec![T_ATTACH, 1, 0],
            vec![T_STOP, 0],
            long,
            vec![T_FAILED, 2, 0, 0, 0, 0xc3, 0x28],
            vec![T_ENDED, 9, 0, 0, 0, 0],
            vec![T_FAILED, 0xff, 0xff, 0xff, 0xff],
            vec![T_FLAG, 2],
            vec![T_START],
            vec![T_STARTED, 1, 0, 0, 0],
        ];
        for bytes in cases {
            raw(&bytes, &[]);
            assert!(
                matches!(b.recv(), Err(ChannelError::Malformed(_))),
                "{bytes:?}"
            );
        }
        // A message over the bound is cut: an error, not a partial message.
        raw(&vec![T_STOP; MAX_MESSAGE + 1], &[]);
        assert!(matches!(b.recv(), Err(ChannelError::Truncated)));
        // Descriptors with a message that takes none, and too many descriptors: refused, and
        // the descriptors that arrived are closed (the pipe's writer sees its reader gone).
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        raw(&[T_STOP], &[reader.as_fd()]);
        assert!(matches!(b.recv(), Err(ChannelError::UnexpectedFds(1, 0))));
        let attach = encode(&Message::AttachBlock {
            index: 0,
            serial: String::new(),
        })
        .unwrap();
        let some: Vec<BorrowedFd<'_>> = (0..MAX_FDS + 1).map(|_| reader.as_fd()).collect();
        raw(&attach, &some);
        assert!(matches!(b.recv(), Err(ChannelError::UnexpectedFds(9, 1))));
        // More than the receiver has room for: the kernel cuts the list, and says so.
        let many: Vec<BorrowedFd<'_>> = (0..16).map(|_| reader.as_fd()).collect();
        raw(&attach, &many);
        assert!(matches!(b.recv(), Err(ChannelError::Truncated)));
        drop(reader);
        assert_eq!(
            rustix::io::write(&writer, b"x").unwrap_err(),
            rustix::io::Errno::PIPE,
            "a descriptor that came with a refused message is still open"
        );
        // A good message still goes through after all that.
        a.send(&Message::Done, &[]).unwrap();
        assert_eq!(b.recv().unwrap().0, Message::Done);
    }

    #[test]
    fn senders_refuse_what_the_receiver_would() {
        let too_long = Message::Failed {
            reason: "x".repeat(MAX_STRING + 1),
        };
        assert!(matches!(encode(&too_long), Err(ChannelError::TooLarge(_))));
        let (a, _b) = Channel::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        let many: Vec<BorrowedFd<'_>> = (0..MAX_FDS + 1).map(|_| file.as_fd()).collect();
        assert!(matches!(
            a.send(&Message::Stop, &many),
            Err(ChannelError::UnexpectedFds(..))
        ));
    }
}
