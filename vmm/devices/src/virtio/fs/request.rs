//! One FUSE request: checks a guest's descriptor chain and hands it to the FUSE server.

use std::io::Write;
use std::mem::size_of;
use std::sync::Arc;

use fuse_backend_rs::abi::fuse_abi::{InHeader, OutHeader};
use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::passthrough::PassthroughFs;

use super::policy::HostPolicy;
use fuse_backend_rs::transport::{Reader, VirtioFsWriter};
use virtio_queue::DescriptorChain;
use vm_memory::{ByteValued, GuestMemory as _};

use super::{MAX_DESCRIPTORS, MAX_REPLY_BYTES, MAX_REQUEST_BYTES};
use crate::GuestMemory;

/// The FUSE server over the passthrough file system behind the host-safety policy, as the
/// device runs it.
pub type FsServer = Server<Arc<HostPolicy<PassthroughFs<()>>>>;

/// Why a request was rejected or failed (all caused by the guest).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The chain has more than [`MAX_DESCRIPTORS`] descriptors.
    #[error("the chain has more than {MAX_DESCRIPTORS} descriptors")]
    TooManyDescriptors,
    /// A device-readable descriptor follows a device-writable one.
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    /// A descriptor is not inside guest memory.
    #[error("descriptor at {addr:#x} ({len} bytes) is outside guest memory")]
    OutsideMemory { addr: u64, len: u32 },
    /// More than [`MAX_REQUEST_BYTES`] device-readable bytes.
    #[error("{0} device-readable bytes, more than {MAX_REQUEST_BYTES}")]
    RequestTooLarge(u64),
    /// More than [`MAX_REPLY_BYTES`] device-writable bytes.
    #[error("{0} device-writable bytes, more than {MAX_REPLY_BYTES}")]
    ReplyTooLarge(u64),
    /// The readable part cannot hold a `fuse_in_header`.
    #[error("{0} device-readable bytes cannot hold a FUSE header")]
    ShortHeader(u64),
    /// The header's `len` is not the readable length of the chain.
    #[error("the header says {header} bytes, the chain carries {chain}")]
    LengthMismatch { header: u32, chain: u64 },
    /// fuse-backend-rs could not map the chain.
    #[error("descriptor chain: {0}")]
    Chain(fuse_backend_rs::transport::Error),
    /// The FUSE server could not decode the request or encode its reply.
    #[error("FUSE server: {0}")]
    Server(fuse_backend_rs::Error),
}

/// What became of one chain.
#[derive(Debug)]
pub struct Outcome {
    /// Bytes written to the chain's writable part (the used-ring length).
    pub used_len: u32,
    /// Why the request was not served normally (answered with an error reply when
    /// `used_len > 0`, otherwise returned unanswered).
    pub rejected: Option<RequestError>,
}

/// Sizes of a chain that passed [`scan`].
struct ChainShape {
    readable: u64,
    writable: u64,
}

/// Walks the chain once (virtio-queue ends it after the queue size, so loops end too) and
/// checks descriptor count, order, placement and total sizes.
fn scan(
    mem: &GuestMemory,
    chain: &DescriptorChain<&GuestMemory>,
) -> Result<ChainShape, RequestError> {
    let mut count = 0usize;
    let mut readable = 0u64;
    let mut writable = 0u64;
    for desc in chain.clone() {
        count += 1;
        if count > MAX_DESCRIPTORS {
            return Err(RequestError::TooManyDescriptors);
        }
        let len = desc.len();
        if !mem.check_range(desc.addr(), len as usize) {
            return Err(RequestError::OutsideMemory {
                addr: desc.addr().0,
                len,
            });
        }
        // At most MAX_DESCRIPTORS * u32::MAX: no u64 overflow.
        if desc.is_write_only() {
            writable += u64::from(len);
        } else if writable > 0 {
            return Err(RequestError::ReadableAfterWritable);
        } else {
            readable += u64::from(len);
        }
    }
    if readable > MAX_REQUEST_BYTES as u64 {
        return Err(RequestError::RequestTooLarge(readable));
    }
    if writable > MAX_REPLY_BYTES as u64 {
        return Err(RequestError::ReplyTooLarge(writable));
    }
    if readable < size_of::<InHeader>() as u64 {
        return Err(RequestError::ShortHeader(readable));
    }
    Ok(ChainShape { readable, writable })
}

/// Serves one request chain: checks it, runs it through `server`, and says how many bytes of
/// reply were written. Never panics on guest input.
pub fn handle_request(
    server: &FsServer,
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
) -> Outcome {
    let shape = match scan(mem, &chain) {
        Ok(s) => s,
        Err(e @ (RequestError::TooManyDescriptors | RequestError::OutsideMemory { .. })) => {
            return Outcome {
                used_len: 0,
                rejected: Some(e),
            }
        }
        Err(e) => return error_reply(mem, chain, e),
    };
    let reader = match Reader::from_descriptor_chain(mem, chain.clone()) {
        Ok(r) => r,
        Err(e) => {
            return Outcome {
                used_len: 0,
                rejected: Some(RequestError::Chain(e)),
            }
        }
    };
    let header = match reader.clone().read_obj::<InHeader>() {
        Ok(h) => h,
        Err(e) => {
            return Outcome {
                used_len: 0,
                rejected: Some(RequestError::Chain(
                    fuse_backend_rs::transport::Error::IoError(e),
                )),
            }
        }
    };
    if u64::from(header.len) != shape.readable {
        let e = RequestError::LengthMismatch {
            header: header.len,
            chain: shape.readable,
        };
        return error_reply(mem, chain, e);
    }
    let writer = match VirtioFsWriter::new(mem, chain) {
        Ok(w) => w,
        Err(e) => {
            return Outcome {
                used_len: 0,
                rejected: Some(RequestError::Chain(e)),
            }
        }
    };
    match server.handle_message(reader, writer.into(), None, None) {
        Ok(n) => Outcome {
            // The server wrote at most the writable bytes; clamp anyway.
            used_len: u32::try_from((n as u64).min(shape.writable)).unwrap_or(0),
            rejected: None,
        },
        Err(e) => Outcome {
            used_len: 0,
            rejected: Some(RequestError::Server(e)),
        },
    }
}

/// Answers a rejected request with `EINVAL` if its header can be read and it has room for a
/// reply; otherwise leaves it unanswered.
fn error_reply(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    why: RequestError,
) -> Outcome {
    let unanswered = |why| Outcome {
        used_len: 0,
        rejected: Some(why),
    };
    let Ok(mut reader) = Reader::from_descriptor_chain(mem, chain.clone()) else {
        return unanswered(why);
    };
    let Ok(header) = reader.read_obj::<InHeader>() else {
        return unanswered(why);
    };
    let Ok(mut writer) = VirtioFsWriter::new(mem, chain) else {
        return unanswered(why);
    };
    let out = OutHeader {
        len: size_of::<OutHeader>() as u32,
        error: -libc::EINVAL,
        unique: header.unique,
    };
    if writer.available_bytes() < size_of::<OutHeader>()
        || writer.write_all(out.as_slice()).is_err()
    {
        return unanswered(why);
    }
    Outcome {
        used_len: out.len,
        rejected: Some(why),
    }
}
