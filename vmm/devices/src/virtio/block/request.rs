//! Parsing a guest's request chain: header (readable), data segments, status byte (writable,
//! last). Only the shape and the guest addresses are checked here; the device checks the
//! request against the disk.

use virtio_queue::DescriptorChain;
use vm_memory::{Address, ByteValued, Bytes, GuestAddress, GuestMemory as _};

use super::{req_type, SEG_MAX, SIZE_MAX};
use crate::GuestMemory;

/// Size of the request header (type, reserved, sector).
pub const HEADER_LEN: u32 = 16;

/// The request header as the guest lays it out.
#[derive(Debug, Default, Clone, Copy)]
#[repr(C)]
pub struct RequestHeader {
    pub type_: u32,
    pub reserved: u32,
    pub sector: u64,
}

// SAFETY: plain integers, no padding (4 + 4 + 8 bytes), any bit pattern is valid.
unsafe impl ByteValued for RequestHeader {}

/// What the guest asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(v: u32) -> Self {
        match v {
            req_type::IN => Self::In,
            req_type::OUT => Self::Out,
            req_type::FLUSH => Self::Flush,
            req_type::GET_ID => Self::GetId,
            req_type::DISCARD => Self::Discard,
            req_type::WRITE_ZEROES => Self::WriteZeroes,
            t => Self::Unsupported(t),
        }
    }
}

impl RequestType {
    /// Whether the device writes into the data segments (so they must be device-writable).
    fn data_to_guest(self) -> bool {
        matches!(self, Self::In | Self::GetId)
    }
}

/// One data segment, checked to lie in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A well-formed request.
#[derive(Debug)]
pub struct Request {
    pub kind: RequestType,
    pub sector: u64,
    pub data: Vec<Segment>,
    /// Sum of the data segments' lengths (bounded by `SEG_MAX * SIZE_MAX`).
    pub data_len: u64,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the chain has no descriptor")]
    Empty,
    #[error("the chain has fewer than two descriptors (header and status)")]
    TooShort,
    #[error("the header descriptor is device-writable or shorter than {HEADER_LEN} bytes")]
    BadHeaderDescriptor,
    #[error("the header is not in guest memory")]
    HeaderUnreadable,
    #[error("the last descriptor is not a writable status byte")]
    NoStatus,
    #[error("the status byte is not in guest memory")]
    StatusOutOfRange,
    #[error("more than {SEG_MAX} data segments")]
    TooManySegments,
    #[error("a data segment of {0} bytes (more than {SIZE_MAX} or empty)")]
    BadSegmentLength(u32),
    #[error("a data segment is not in guest memory")]
    SegmentOutOfRange,
    #[error("a data segment has the wrong direction for the request type")]
    WrongDirection,
}

/// The outcome of parsing: a request, or an error with the status byte's address when the chain
/// has a usable one (the device then writes an error status there).
pub type ParseResult = Result<Request, (ParseError, Option<GuestAddress>)>;

/// Parses `chain` (its descriptors are bounded by the queue size: virtio-queue ends a chain that
/// loops or runs past the table).
pub fn parse(mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> ParseResult {
    let descs: Vec<_> = chain.take(usize::from(super::QUEUE_SIZE) + 1).collect();
    let Some(last) = descs.last() else {
        return Err((ParseError::Empty, None));
    };
    // The status byte first: every later error is reported through it.
    let status = if last.is_write_only() && last.len() >= 1 {
        let at = last
            .addr()
            .checked_add(u64::from(last.len()) - 1)
            .filter(|a| mem.check_address(*a).is_some());
        match at {
            Some(a) => a,
            None => return Err((ParseError::StatusOutOfRange, None)),
        }
    } else {
        return Err((ParseError::NoStatus, None));
    };
    let fail = |e| Err((e, Some(status)));
    if descs.len() < 2 {
        return fail(ParseError::TooShort);
    }
    let head = descs[0];
    if head.is_write_only() || head.len() < HEADER_LEN {
        return fail(ParseError::BadHeaderDescriptor);
    }
    let Ok(hdr) = mem.read_obj::<RequestHeader>(head.addr()) else {
        return fail(ParseError::HeaderUnreadable);
    };
    let kind = RequestType::from(u32::from_le(hdr.type_));
    let middle = &descs[1..descs.len() - 1];
    if middle.len() > SEG_MAX as usize {
        return fail(ParseError::TooManySegments);
    }
    let mut data = Vec::with_capacity(middle.len());
    let mut data_len: u64 = 0;
    for d in middle {
        if d.len() == 0 || d.len() > SIZE_MAX {
            return fail(ParseError::BadSegmentLength(d.len()));
        }
        if !mem.check_range(d.addr(), d.len() as usize) {
            return fail(ParseError::SegmentOutOfRange);
        }
        if !matches!(kind, RequestType::Unsupported(_)) && d.is_write_only() != kind.data_to_guest()
        {
            return fail(ParseError::WrongDirection);
        }
        data_len += u64::from(d.len());
        data.push(Segment {
            addr: d.addr(),
            len: d.len(),
        });
    }
    Ok(Request {
        kind,
        sector: u64::from_le(hdr.sector),
        data,
        data_len,
        status,
    })
}
