//! The guest-facing part of virtio-vsock: the 44-byte packet header (`struct virtio_vsock_hdr`,
//! little endian) and its transfer through descriptor chains.
//!
//! A TX chain (guest to host) holds a header followed by `len` bytes of data, split over any
//! number of device-readable descriptors. An RX chain (host to guest) is a device-writable buffer
//! that receives a header and up to its remaining size in data. Every descriptor is checked
//! against guest memory (virtio-queue's [`Reader`]/[`Writer`] do that when they are built), the
//! data length is bounded by [`MAX_PKT_DATA`] and by what the chain really holds, and loops in a
//! chain end when virtio-queue's per-chain descriptor budget (the queue size) runs out.

use std::io::{Read, Write};
use std::ops::Deref;

use virtio_queue::{DescriptorChain, Reader, Writer};

use super::MAX_PKT_DATA;
use crate::GuestMemory;

/// Size of the packet header on the wire.
pub const HDR_SIZE: usize = 44;

/// The vsock packet header (virtio spec 5.10.6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VsockHeader {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl VsockHeader {
    /// Decodes a header from its little-endian wire form.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(a)
        };
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the header in its little-endian wire form.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// Why a descriptor chain could not be used as a vsock packet.
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// A descriptor points outside guest memory (or the chain is otherwise unusable).
    #[error("invalid descriptor chain: {0}")]
    DescriptorChain(#[source] virtio_queue::Error),
    /// The readable part of a TX chain is shorter than a header.
    #[error("TX chain holds {0} bytes, less than a packet header")]
    HeaderTooShort(usize),
    /// The header announces more data than a packet may carry.
    #[error("packet data length {0} exceeds the maximum")]
    DataTooLong(u32),
    /// The header announces more data than the chain holds.
    #[error("packet announces {len} data bytes, the chain holds {available}")]
    DataTruncated { len: u32, available: usize },
    /// The writable part of an RX chain cannot hold a header.
    #[error("RX buffer of {0} bytes is smaller than a packet header")]
    BufferTooSmall(usize),
    /// The packet does not fit the RX buffer (a bug of the caller).
    #[error("RX packet of {len} bytes does not fit a {capacity}-byte buffer")]
    PacketTooLarge { len: usize, capacity: usize },
    /// Copying to or from guest memory failed.
    #[error("accessing guest memory: {0}")]
    Memory(#[source] std::io::Error),
}

/// A packet the guest sent (TX queue).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxPacket {
    pub hdr: VsockHeader,
    /// Exactly `hdr.len` bytes.
    pub data: Vec<u8>,
}

/// A packet for the guest (RX queue), made by the host side (the muxer and its connections).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RxPacket {
    /// The header; `len` is set when it is written to the guest.
    pub hdr: VsockHeader,
    pub data: Vec<u8>,
}

/// Reads the packet held by the device-readable part of a TX chain.
pub fn read_tx_packet<M>(
    mem: &GuestMemory,
    chain: DescriptorChain<M>,
) -> Result<TxPacket, PacketError>
where
    M: Deref<Target = GuestMemory>,
{
    let mut reader: Reader<'_> = chain.reader(mem).map_err(PacketError::DescriptorChain)?;
    let available = reader.available_bytes();
    if available < HDR_SIZE {
        return Err(PacketError::HeaderTooShort(available));
    }
    let mut raw = [0u8; HDR_SIZE];
    reader.read_exact(&mut raw).map_err(PacketError::Memory)?;
    let hdr = VsockHeader::from_bytes(&raw);
    if hdr.len as usize > MAX_PKT_DATA {
        return Err(PacketError::DataTooLong(hdr.len));
    }
    let available = reader.available_bytes();
    if hdr.len as usize > available {
        return Err(PacketError::DataTruncated {
            len: hdr.len,
            available,
        });
    }
    let mut data = vec![0u8; hdr.len as usize];
    reader.read_exact(&mut data).map_err(PacketError::Memory)?;
    Ok(TxPacket { hdr, data })
}

/// The device-writable buffer of an RX chain, checked against guest memory.
pub struct RxBuffer<'a> {
    writer: Writer<'a>,
}

impl<'a> RxBuffer<'a> {
    /// Checks the writable descriptors of `chain`; the buffer must hold at least a header.
    pub fn new<M>(mem: &'a GuestMemory, chain: DescriptorChain<M>) -> Result<Self, PacketError>
    where
        M: Deref<Target = GuestMemory>,
    {
        let writer: Writer<'a> = chain.writer(mem).map_err(PacketError::DescriptorChain)?;
        let available = writer.available_bytes();
        if available < HDR_SIZE {
            return Err(PacketError::BufferTooSmall(available));
        }
        Ok(Self { writer })
    }

    /// How many data bytes a packet written here may carry.
    pub fn data_capacity(&self) -> usize {
        self.writer
            .available_bytes()
            .saturating_sub(HDR_SIZE)
            .min(MAX_PKT_DATA)
    }

    /// Writes `hdr` (with `len` set to the data length) and `data`; returns the bytes written,
    /// the length to put in the used ring.
    pub fn write(mut self, hdr: &VsockHeader, data: &[u8]) -> Result<u32, PacketError> {
        let capacity = self.data_capacity();
        if data.len() > capacity {
            return Err(PacketError::PacketTooLarge {
                len: data.len(),
                capacity,
            });
        }
        let mut hdr = *hdr;
        // data.len() <= MAX_PKT_DATA, so it fits.
        hdr.len = data.len() as u32;
        self.writer
            .write_all(&hdr.to_bytes())
            .map_err(PacketError::Memory)?;
        self.writer.write_all(data).map_err(PacketError::Memory)?;
        Ok((HDR_SIZE + data.len()) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const MEM_SIZE: usize = 0x40_0000;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags as u16, 0))
    }

    fn hdr(len: u32) -> VsockHeader {
        VsockHeader {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1000,
            dst_port: 2000,
            len,
            type_: 1,
            op: 5,
            flags: 0,
            buf_alloc: 4096,
            fwd_cnt: 7,
        }
    }

    #[test]
    fn header_layout_is_the_wire_layout() {
        let h = hdr(0x0102_0304);
        let b = h.to_bytes();
        assert_eq!(&b[0..8], &3u64.to_le_bytes());
        assert_eq!(&b[24..28], &[4, 3, 2, 1]);
        assert_eq!(&b[28..30], &[1, 0]);
        assert_eq!(&b[30..32], &[5, 0]);
        assert_eq!(&b[40..44], &[7, 0, 0, 0]);
        assert_eq!(VsockHeader::from_bytes(&b), h);
    }

    #[test]
    fn reads_header_and_data_split_over_descriptors() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        let raw = hdr(10).to_bytes();
        // Header split 20/24 over two descriptors, data in a third.
        m.write_slice(&raw[..20], GuestAddress(0x10_0000)).unwrap();
        m.write_slice(&raw[20..], GuestAddress(0x11_0000)).unwrap();
        m.write_slice(b"0123456789", GuestAddress(0x12_0000))
            .unwrap();
        let chain = q
            .build_desc_chain(&[
                desc(0x10_0000, 20, 0),
                desc(0x11_0000, 24, 0),
                desc(0x12_0000, 10, 0),
            ])
            .unwrap();
        let p = read_tx_packet(&m, chain).unwrap();
        assert_eq!(p.hdr, hdr(10));
        assert_eq!(p.data, b"0123456789");
    }

    #[test]
    fn out_of_range_descriptor_is_an_error() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        let chain = q
            .build_desc_chain(&[desc(MEM_SIZE as u64 - 10, 44, 0)])
            .unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::DescriptorChain(_))
        ));
        let chain = q.build_desc_chain(&[desc(u64::MAX - 3, 44, 0)]).unwrap();
        assert!(read_tx_packet(&m, chain).is_err());
        let chain = q
            .build_desc_chain(&[desc(0x10_0000, 44, 0), desc(1 << 40, 4096, 0)])
            .unwrap();
        assert!(read_tx_packet(&m, chain).is_err());
    }

    #[test]
    fn short_header_and_bad_lengths_are_errors() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        let chain = q.build_desc_chain(&[desc(0x10_0000, 43, 0)]).unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::HeaderTooShort(43))
        ));
        // A write-only descriptor is not packet data.
        let chain = q
            .build_desc_chain(&[desc(0x10_0000, 4096, VRING_DESC_F_WRITE)])
            .unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::HeaderTooShort(0))
        ));
        m.write_slice(&hdr(u32::MAX).to_bytes(), GuestAddress(0x10_0000))
            .unwrap();
        let chain = q.build_desc_chain(&[desc(0x10_0000, 4096, 0)]).unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::DataTooLong(u32::MAX))
        ));
        m.write_slice(&hdr(100).to_bytes(), GuestAddress(0x10_0000))
            .unwrap();
        let chain = q.build_desc_chain(&[desc(0x10_0000, 100, 0)]).unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::DataTruncated {
                len: 100,
                available: 56
            })
        ));
    }

    #[test]
    fn descriptor_loop_terminates() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        m.write_slice(&hdr(60_000).to_bytes(), GuestAddress(0x10_0000))
            .unwrap();
        // Descriptors 0 -> 1 -> 0 -> ...: the chain ends after queue-size descriptors, far
        // short of the announced data.
        let next = VRING_DESC_F_NEXT as u16;
        q.desc_table()
            .store(
                0,
                RawDescriptor::from(SplitDescriptor::new(0x10_0000, 44, next, 1)),
            )
            .unwrap();
        q.desc_table()
            .store(
                1,
                RawDescriptor::from(SplitDescriptor::new(0x11_0000, 100, next, 0)),
            )
            .unwrap();
        q.avail().ring().ref_at(0).unwrap().store(0);
        q.avail().idx().store(1);
        let mut queue: virtio_queue::Queue = q.create_queue().unwrap();
        use virtio_queue::QueueT;
        let chain = queue.pop_descriptor_chain(&m).unwrap();
        assert!(matches!(
            read_tx_packet(&m, chain),
            Err(PacketError::DataTruncated { len: 60_000, .. })
        ));
    }

    #[test]
    fn huge_descriptor_lengths_do_not_overflow() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        let chain = q
            .build_desc_chain(&[desc(0x10_0000, u32::MAX, 0), desc(0x10_0000, u32::MAX, 0)])
            .unwrap();
        assert!(read_tx_packet(&m, chain).is_err());
    }

    #[test]
    fn rx_buffer_checks_and_writes() {
        let m = mem();
        let q = MockSplitQueue::new(&m, 16);
        let chain = q
            .build_desc_chain(&[desc(0x10_0000, 43, VRING_DESC_F_WRITE)])
            .unwrap();
        assert!(matches!(
            RxBuffer::new(&m, chain),
            Err(PacketError::BufferTooSmall(43))
        ));
        let chain = q
            .build_desc_chain(&[desc(MEM_SIZE as u64 - 8, 4096, VRING_DESC_F_WRITE)])
            .unwrap();
        assert!(RxBuffer::new(&m, chain).is_err());
        // Header and data over two writable descriptors, as older Linux posts them.
        let chain = q
            .build_desc_chain(&[
                desc(0x10_0000, 44, VRING_DESC_F_WRITE),
                desc(0x11_0000, 8, VRING_DESC_F_WRITE),
            ])
            .unwrap();
        let buf = RxBuffer::new(&m, chain).unwrap();
        assert_eq!(buf.data_capacity(), 8);
        let n = buf.write(&hdr(0), b"abcdefgh").unwrap();
        assert_eq!(n, 52);
        let mut raw = [0u8; HDR_SIZE];
        m.read_slice(&mut raw, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(VsockHeader::from_bytes(&raw), hdr(8));
        let mut d = [0u8; 8];
        m.read_slice(&mut d, GuestAddress(0x11_0000)).unwrap();
        assert_eq!(&d, b"abcdefgh");
        let chain = q
            .build_desc_chain(&[desc(0x10_0000, 50, VRING_DESC_F_WRITE)])
            .unwrap();
        let buf = RxBuffer::new(&m, chain).unwrap();
        assert!(matches!(
            buf.write(&hdr(0), &[0; 7]),
            Err(PacketError::PacketTooLarge { .. })
        ));
    }
}
