//! The input format of every target: a tape of little-endian fields read front to back. A
//! read past the end yields zeros (and an empty slice), so every input, however short, is a
//! complete program; [`TapeWriter`] writes the same format, for the seed corpus.

/// The fuzzer's bytes, read as fields.
#[derive(Debug, Clone)]
pub struct Tape<'a> {
    data: &'a [u8],
}

impl<'a> Tape<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end of the tape).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// A byte string with a u16 length in front.
    pub fn blob(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16());
        self.bytes(n)
    }

    /// The rest of the tape.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }
}

/// Writes a tape (seed inputs).
#[derive(Debug, Default, Clone)]
pub struct TapeWriter {
    pub data: Vec<u8>,
}

impl TapeWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.data.push(v);
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.data.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.data.extend_from_slice(v);
        self
    }

    /// A byte string with a u16 length in front (at most 65535 bytes are kept).
    pub fn blob(&mut self, v: &[u8]) -> &mut Self {
        let v = &v[..v.len().min(usize::from(u16::MAX))];
        self.u16(v.len() as u16).bytes(v)
    }

    pub fn finish(&self) -> Vec<u8> {
        self.data.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_tape_reads_back_and_a_short_one_reads_zeros() {
        let mut w = TapeWriter::new();
        w.u8(7)
            .u16(0x1234)
            .u32(5)
            .u64(u64::MAX)
            .blob(b"abc")
            .bool(true);
        let data = w.finish();
        let mut t = Tape::new(&data);
        assert_eq!(t.u8(), 7);
        assert_eq!(t.u16(), 0x1234);
        assert_eq!(t.u32(), 5);
        assert_eq!(t.u64(), u64::MAX);
        assert_eq!(t.blob(), b"abc");
        assert!(t.bool());
        assert!(t.is_empty());
        assert_eq!(t.u32(), 0);
        assert_eq!(t.blob(), b"");
        let mut short = Tape::new(&[1, 2]);
        assert_eq!(short.u32(), 0x0201);
    }
}
