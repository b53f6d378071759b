//! bincode's standard encoding, read by hand: the fast path's reader.
//!
//! bincode defines the binary form: export and the careful import are its derived code. Its
//! decoder returns every primitive as a `Result` with a large error type and checks the limit
//! through several layers of generic calls, which costs more than the reading itself
//! when a file is a hundred thousand small records. [`Wire`] reads the same bytes as plain
//! slice operations and answers `None` for anything bincode would refuse, leaving the careful
//! path to say why. It makes the same claims against the decode limit that bincode's decoder
//! makes, in the same order, so that it never accepts a document the careful path refuses;
//! `fuzz/fuzz_targets/import_binary.rs` holds the two paths to the same answers.

use super::{LIMIT, config};
use bincode::BorrowDecode;

/// Markers of bincode's variable-length integers: a first byte up to 250 is the value itself;
/// these announce a little-endian `u16`, `u32` or `u64` after them.
const U16: u8 = 251;
const U32: u8 = 252;
const U64: u8 = 253;

/// What a value that [`Wire::decode`] hands to bincode may claim per byte it spans, at most.
/// Those values (tensor tables, parameters, gradient entries, symbolic sizes) hold containers
/// of items at least a byte long and at most 128 bytes in memory, two deep, plus primitives
/// that claim at most 16 bytes each: 256 covers all of it. A real table spans kilobytes, so
/// the bound never comes near the limit.
const DELEGATED_CLAIM_PER_BYTE: usize = 256;

#[derive(Clone)]
pub(super) struct Wire<'a> {
    rest: &'a [u8],
    /// What bincode's decoder would have claimed against [`LIMIT`] by now (or more, after a
    /// [`Wire::decode`]).
    claimed: usize,
}

impl<'a> Wire<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Wire<'a> {
        Wire {
            rest: bytes,
            claimed: 0,
        }
    }

    /// Bytes not read yet.
    pub(super) fn remaining(&self) -> usize {
        self.rest.len()
    }

    pub(super) fn claim(&mut self, n: usize) -> Option<()> {
        self.claimed = self.claimed.checked_add(n).filter(|&c| c <= LIMIT)?;
        Some(())
    }

    /// The claim bincode makes before reading `len` items of `T` into a container.
    pub(super) fn claim_items<T>(&mut self, len: usize) -> Option<()> {
        self.claim(len.checked_mul(std::mem::size_of::<T>())?)
    }

    /// What bincode gives back of that claim as it starts on each item.
    pub(super) fn unclaim_item<T>(&mut self) {
        self.claimed = self.claimed.saturating_sub(std::mem::size_of::<T>());
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*head)
    }

    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.rest.split_at_checked(n)?;
        self.rest = rest;
        Some(head)
    }

    /// A variable-length integer with markers up to `widest`.
    #[inline]
    fn varint(&mut self, widest: u8) -> Option<u64> {
        let [first] = self.take::<1>()?;
        match first {
            0..=250 => Some(u64::from(first)),
            U16 => Some(u64::from(u16::from_le_bytes(self.take()?))),
            U32 if widest >= U32 => Some(u64::from(u32::from_le_bytes(self.take()?))),
            U64 if widest >= U64 => Some(u64::from_le_bytes(self.take()?)),
            _ => None,
        }
    }

    pub(super) fn u8(&mut self) -> Option<u8> {
        self.claim(1)?;
        Some(self.take::<1>()?[0])
    }

    pub(super) fn bool(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    /// An `Option`'s tag: whether a value follows.
    pub(super) fn is_some(&mut self) -> Option<bool> {
        self.bool()
    }

    /// Also an enum's variant index.
    #[inline]
    pub(super) fn u32(&mut self) -> Option<u32> {
        self.claim(4)?;
        self.varint(U32).and_then(|v| u32::try_from(v).ok())
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        self.claim(8)?;
        self.varint(U64)
    }

    /// Zigzag over the unsigned encoding.
    pub(super) fn i64(&mut self) -> Option<i64> {
        let n = self.u64()?;
        let half = (n / 2) as i64;
        Some(if n % 2 == 0 { half } else { !half })
    }

    pub(super) fn f64(&mut self) -> Option<f64> {
        self.claim(8)?;
        Some(f64::from_le_bytes(self.take()?))
    }

    /// A container's length.
    pub(super) fn len(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }

    pub(super) fn str(&mut self) -> Option<&'a str> {
        let len = self.len()?;
        self.claim(len)?;
        std::str::from_utf8(self.bytes(len)?).ok()
    }

    /// A `Vec<u8>`, borrowed.
    pub(super) fn section(&mut self) -> Option<&'a [u8]> {
        let len = self.len()?;
        self.claim(len)?;
        self.bytes(len)
    }

    /// A value that bincode reads itself: for the parts that occur once per graph or rarely,
    /// where its speed does not matter. Claims an upper bound of what bincode claimed.
    pub(super) fn decode<T: BorrowDecode<'a, ()>>(&mut self) -> Option<T> {
        let (value, used) = bincode::borrow_decode_from_slice(self.rest, config()).ok()?;
        self.claim(used.checked_mul(DELEGATED_CLAIM_PER_BYTE)?)?;
        self.bytes(used)?;
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bincode::Encode;

    /// Each value as bincode writes it reads back the same through `read`, using every byte.
    fn round_trip<T: Encode + PartialEq + std::fmt::Debug>(
        values: &[T],
        read: impl Fn(&mut Wire) -> Option<T>,
    ) {
        for v in values {
            let bytes = bincode::encode_to_vec(v, config()).unwrap();
            let mut w = Wire::new(&bytes);
            assert_eq!(read(&mut w).as_ref(), Some(v), "{bytes:?}");
            assert_eq!(w.remaining(), 0);
        }
    }

    #[test]
    fn reads_what_bincode_writes() {
        let edges = [
            0,
            1,
            250,
            251,
            255,
            256,
            65_535,
            65_536,
            u32::MAX as u64,
            u64::MAX,
        ];
        round_trip(&edges, |w| w.u64());
        let small: Vec<u32> = edges
            .iter()
            .filter_map(|&e| u32::try_from(e).ok())
            .collect();
        round_trip(&small, |w| w.u32());
        round_trip(&[0i64, 1, -1, 125, -126, i64::MIN, i64::MAX], |w| w.i64());
        round_trip(&[0.0, -1.5, f64::INFINITY, f64::MIN_POSITIVE], |w| w.f64());
        round_trip(&[true, false], |w| w.bool());
        let strings = [
            "",
            "mm_12",
            "aten._scaled_dot_product_flash_attention.default",
        ];
        round_trip(&strings.map(String::from), |w| w.str().map(String::from));
        round_trip(&[None, Some(7u32)], |w| match w.is_some()? {
            true => w.u32().map(Some),
            false => Some(None),
        });
    }

    /// Whether bincode reads a whole `T` from `bytes`.
    fn bincode_reads<T: bincode::Decode<()>>(bytes: &[u8]) -> bool {
        bincode::decode_from_slice::<T, _>(bytes, config()).is_ok_and(|(_, n)| n == bytes.len())
    }

    #[test]
    fn refuses_what_bincode_refuses() {
        let too_wide = [U64, 1, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(Wire::new(&too_wide).u32(), None);
        assert!(!bincode_reads::<u32>(&too_wide));
        assert_eq!(Wire::new(&too_wide).u64(), Some(1));
        let reserved = [255, 0, 0];
        assert_eq!(Wire::new(&reserved).u64(), None);
        assert!(!bincode_reads::<u64>(&reserved));
        assert_eq!(Wire::new(&[2]).bool(), None);
        assert!(!bincode_reads::<bool>(&[2]));
        assert!(!bincode_reads::<Option<u8>>(&[2, 0]));
        let not_utf8 = [2, 0xc3, 0x28];
        assert_eq!(Wire::new(&not_utf8).str(), None);
        assert!(!bincode_reads::<String>(&not_utf8));
        let short = [U32, 1, 2];
        assert_eq!(Wire::new(&short).u32(), None);
        assert!(!bincode_reads::<u32>(&short));
    }

    #[test]
    fn claims_as_bincode_does() {
        // A length that bincode's limit refuses before reading an item.
        let len = bincode::encode_to_vec(u64::MAX / 2, config()).unwrap();
        let mut w = Wire::new(&len);
        let n = w.len().unwrap();
        assert_eq!(w.claim_items::<u64>(n), None);
        let careful: Result<(Vec<u64>, usize), _> = bincode::decode_from_slice(&len, config());
        assert!(matches!(
            careful,
            Err(bincode::error::DecodeError::LimitExceeded)
        ));
    }
}
