//! [`Str`]: the IR's owned string for node names, op targets, devices, keyword names and
//! symbolic expressions.
//!
//! Nearly all of those are at most 24 bytes (`mm_12`, `aten.mm.default`, `cuda:0`, `dtype`),
//! and compact_str keeps a string that short inline, in the 24 bytes a `String` takes anyway:
//! building a node then allocates nothing for them, and comparing a target reads the node
//! itself instead of following a pointer. Longer strings live on the heap as before.
//!
//! A newtype rather than `CompactString` itself, so that it can carry the bincode encoding of
//! a `String` (the binary form is unchanged by it).

use bincode::de::{BorrowDecoder, Decoder};
use bincode::enc::Encoder;
use bincode::error::{DecodeError, EncodeError};
use bincode::{BorrowDecode, Decode, Encode};
use compact_str::CompactString;
use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Str(CompactString);

impl Str {
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl Deref for Str {
    type Target = str;
    fn deref(&self) -> &str {
        self.0.as_str()
    }
}

impl AsRef<str> for Str {
    fn as_ref(&self) -> &str {
        self.0.as_str()
    }
}

// `Hash` and `Ord` are those of the `str`, so maps keyed by `Str` can be queried by `&str`.
impl Borrow<str> for Str {
    fn borrow(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Debug for Str {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Str {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Str {
    fn from(s: &str) -> Str {
        Str(CompactString::from(s))
    }
}

impl From<&String> for Str {
    fn from(s: &String) -> Str {
        Str::from(s.as_str())
    }
}

impl From<String> for Str {
    fn from(s: String) -> Str {
        Str(CompactString::from(s))
    }
}

impl From<&Str> for Str {
    fn from(s: &Str) -> Str {
        s.clone()
    }
}

impl From<Str> for String {
    fn from(s: Str) -> String {
        s.0.into_string()
    }
}

impl PartialEq<str> for Str {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Str {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Str {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<Str> for str {
    fn eq(&self, other: &Str) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Str> for &str {
    fn eq(&self, other: &Str) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Str> for String {
    fn eq(&self, other: &Str) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Encode for Str {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), EncodeError> {
        self.as_str().encode(e)
    }
}

impl<Context> Decode<Context> for Str {
    fn decode<D: Decoder<Context = Context>>(d: &mut D) -> Result<Self, DecodeError> {
        String::decode(d).map(Str::from)
    }
}

impl serde::Serialize for Str {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

// JSON strings without escapes are read in place, so a short one is never a `String` first.
impl<'de> serde::Deserialize<'de> for Str {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        CompactString::deserialize(d).map(Str)
    }
}

impl<'de, Context> BorrowDecode<'de, Context> for Str {
    fn borrow_decode<D: BorrowDecoder<'de, Context = Context>>(
        d: &mut D,
    ) -> Result<Self, DecodeError> {
        <&str>::borrow_decode(d).map(Str::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_as_a_string_does() {
        let config = bincode::config::standard();
        for s in [
            "",
            "mm_12",
            "aten._scaled_dot_product_flash_attention.default",
        ] {
            let ours = bincode::encode_to_vec(Str::from(s), config).unwrap();
            assert_eq!(ours, bincode::encode_to_vec(s.to_string(), config).unwrap());
            let (back, _): (Str, usize) = bincode::decode_from_slice(&ours, config).unwrap();
            assert_eq!(back, s);
            let (back, _): (Str, usize) = bincode::borrow_decode_from_slice(&ours, config).unwrap();
            assert_eq!(back, s);
        }
    }

    #[test]
    fn short_strings_are_inline() {
        assert!(!Str::from("aten.mm.default").0.is_heap_allocated());
        assert!(
            Str::from("aten._scaled_dot_product_flash_attention.default")
                .0
                .is_heap_allocated()
        );
    }
}
