//! One guest page as the pass sees it: the page size, a hash to find candidate template pages
//! with ([`page_hash`]; equality is checked after) and whether a page is all zero
//! ([`is_zero`]).

/// The page size the pass works with (x86-64 base pages).
pub const PAGE: usize = 4096;

/// A hash of a page's bytes, to find candidate template pages (equality is then checked).
pub fn page_hash(p: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in p.chunks_exact(8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    h
}

/// Whether a page is all zero.
pub fn is_zero(p: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned middle.
        unsafe { p.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_and_zero_checks() {
        let z = vec![0u8; PAGE];
        assert!(is_zero(&z));
        let mut nz = z.clone();
        nz[PAGE - 1] = 1;
        assert!(!is_zero(&nz));
        assert_ne!(page_hash(&z), page_hash(&nz));
    }
}
