//! The tap backend: a tap file descriptor set up the way the device needs it.
//!
//! The embedder opens the tap (with [`open_tap`], or any other way) in the network namespace the
//! frames belong to and hands the descriptor over; [`Tap::new`] checks it is a tap with
//! `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, sets the vnet header size to
//! [`VNET_HDR_LEN`](super::VNET_HDR_LEN), turns every offload off and makes it non-blocking. A tap
//! delivers one frame per `read` and takes one per `write`, each preceded by the vnet header.
//!
//! Four ioctls are written here by hand rather than taken from a tap crate: the crates on
//! crates.io either create the interface themselves (we receive a descriptor opened elsewhere,
//! often in another netns) or do not set the vnet header size and offloads.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::NetBackend;
use super::VNET_HDR_LEN;

/// The flags a tap must have for this device.
pub const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// Errors opening or setting up a tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The interface name is empty, too long for `IFNAMSIZ` or holds a NUL or a slash.
    #[error("invalid tap name {0:?}: it must be 1 to 15 bytes without NUL or '/'")]
    InvalidName(String),
    /// `/dev/net/tun` could not be opened.
    #[error("opening /dev/net/tun: {0}")]
    OpenTun(#[source] io::Error),
    /// An ioctl or fcntl on the tap failed.
    #[error("{op} on the tap: {source}")]
    Ioctl {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The descriptor is a tun/tap without the flags the device needs.
    #[error(
        "the descriptor is not a tap opened with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR \
         (its flags are {0:#x})"
    )]
    WrongFlags(libc::c_int),
}

fn ifreq_zeroed() -> libc::ifreq {
    // SAFETY: ifreq is a plain C struct (a name array and a union of integers, sockaddrs and a
    // pointer); all zeros is a valid value of every field.
    unsafe { std::mem::zeroed() }
}

/// Creates (or attaches to) the tap `name` in the calling thread's network namespace, with
/// `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, and returns its descriptor for [`Tap::new`]. The tap
/// lives as long as the descriptor (it is not made persistent).
pub fn open_tap(name: &str) -> Result<OwnedFd, TapError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.bytes().any(|b| b == 0 || b == b'/')
    {
        return Err(TapError::InvalidName(name.to_owned()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(TapError::OpenTun)?;
    let mut ifr = ifreq_zeroed();
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    // The flags fit a c_short (they are below 0x8000).
    ifr.ifr_ifru.ifru_flags = TAP_FLAGS as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `ifr` is, valid for the call;
    // the fd is a /dev/net/tun descriptor we own.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) };
    if r < 0 {
        return Err(TapError::Ioctl {
            op: "TUNSETIFF",
            source: io::Error::last_os_error(),
        });
    }
    Ok(OwnedFd::from(file))
}

/// A tap set up for the device (see the module doc).
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Checks `fd` and sets it up: vnet header size, no offloads, non-blocking.
    pub fn new(fd: OwnedFd) -> Result<Self, TapError> {
        let file = File::from(fd);
        let raw = file.as_raw_fd();
        let ioctl_err = |op| TapError::Ioctl {
            op,
            source: io::Error::last_os_error(),
        };
        let mut ifr = ifreq_zeroed();
        // SAFETY: TUNGETIFF writes one `struct ifreq` into `ifr`, valid for the call; on a
        // descriptor that is no tun it fails with an error and writes nothing.
        if unsafe { libc::ioctl(raw, libc::TUNGETIFF, &mut ifr) } < 0 {
            return Err(ioctl_err("TUNGETIFF"));
        }
        // SAFETY: TUNGETIFF filled `ifru_flags`; reading a c_short from the zero-initialised
        // union is valid whatever it wrote.
        let flags = libc::c_int::from(unsafe { ifr.ifr_ifru.ifru_flags }) & 0xffff;
        if flags & TAP_FLAGS != TAP_FLAGS || flags & libc::IFF_TUN != 0 {
            return Err(TapError::WrongFlags(flags));
        }
        // The kernel NUL-terminates the name; the last byte is kept zero by ifreq_zeroed anyway.
        ifr.ifr_name[libc::IFNAMSIZ - 1] = 0;
        let name_bytes: Vec<u8> = ifr
            .ifr_name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let name = String::from_utf8_lossy(&name_bytes).into_owned();
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one c_int through the pointer, valid for the call.
        if unsafe { libc::ioctl(raw, libc::TUNSETVNETHDRSZ, &hdr_len) } < 0 {
            return Err(ioctl_err("TUNSETVNETHDRSZ"));
        }
        // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned long of TUN_F_* bits);
        // 0 turns every offload off. No memory is passed.
        if unsafe { libc::ioctl(raw, libc::TUNSETOFFLOAD, 0 as libc::c_ulong) } < 0 {
            return Err(ioctl_err("TUNSETOFFLOAD"));
        }
        // SAFETY: F_GETFL on a descriptor we own; no memory is passed.
        let fl = unsafe { libc::fcntl(raw, libc::F_GETFL) };
        if fl < 0 {
            return Err(ioctl_err("F_GETFL"));
        }
        // SAFETY: F_SETFL on a descriptor we own, with its flags plus O_NONBLOCK.
        if unsafe { libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(ioctl_err("F_SETFL O_NONBLOCK"));
        }
        Ok(Self { file, name })
    }

    /// The interface name (as the kernel reports it for the descriptor).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The vnet header size the tap uses (for checks; [`VNET_HDR_LEN`] after [`Tap::new`]).
    pub fn vnet_hdr_len(&self) -> io::Result<usize> {
        let mut len: libc::c_int = 0;
        // SAFETY: TUNGETVNETHDRSZ writes one c_int through the pointer, valid for the call.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNGETVNETHDRSZ, &mut len) } < 0 {
            return Err(io::Error::last_os_error());
        }
        usize::try_from(len).map_err(|_| io::Error::other("negative vnet header size"))
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl NetBackend for Tap {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        (&self.file).write(frame)
    }
}
