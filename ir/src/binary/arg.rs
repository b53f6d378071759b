//! Reading an ARG from the binary form, for bincode's `Decode` and for the fast path alike.
//!
//! One reader over a [`Source`] serves both: bincode's decoder behind `Decode for Arg` (the
//! careful path) and the fast path's [`Wire`]. Both then read the same bytes with the same
//! claims against the decode limit, and nesting is bounded the same way.

use super::wire::Wire;
use crate::{Arg, Dtype, Kwargs, Str, SymInt};
use bincode::de::{BorrowDecoder, Decoder};
use bincode::enc::Encoder;
use bincode::error::{AllowedEnumVariants, DecodeError, EncodeError};
use bincode::{BorrowDecode, Decode, Encode};
use std::cell::Cell;

/// The primitives an ARG is made of, each read as bincode's standard configuration writes it.
pub(super) trait Source {
    type Error;
    /// Also an enum's variant index.
    fn u32(&mut self) -> Result<u32, Self::Error>;
    fn bool(&mut self) -> Result<bool, Self::Error>;
    fn i64(&mut self) -> Result<i64, Self::Error>;
    fn f64(&mut self) -> Result<f64, Self::Error>;
    fn string(&mut self) -> Result<String, Self::Error>;
    /// A container's length, with the claim bincode makes for `len` items of `T`.
    fn items<T>(&mut self) -> Result<usize, Self::Error>;
    /// What bincode gives back of that claim as it starts on each item.
    fn next_item<T>(&mut self);
    fn dtype(&mut self) -> Result<Dtype, Self::Error>;
    fn sym(&mut self) -> Result<SymInt, Self::Error>;
    /// This source's error for a refusal the reader makes itself.
    fn refuse(&self, e: DecodeError) -> Self::Error;
}

/// bincode's own decoder as a [`Source`].
pub(super) struct Bincode<'d, D>(pub(super) &'d mut D);

impl<D: Decoder> Source for Bincode<'_, D> {
    type Error = DecodeError;
    fn u32(&mut self) -> Result<u32, DecodeError> {
        u32::decode(self.0)
    }
    fn bool(&mut self) -> Result<bool, DecodeError> {
        bool::decode(self.0)
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        i64::decode(self.0)
    }
    fn f64(&mut self) -> Result<f64, DecodeError> {
        f64::decode(self.0)
    }
    fn string(&mut self) -> Result<String, DecodeError> {
        String::decode(self.0)
    }
    fn items<T>(&mut self) -> Result<usize, DecodeError> {
        let len = u64::decode(self.0)?;
        let len = usize::try_from(len).map_err(|_| DecodeError::OutsideUsizeRange(len))?;
        self.0.claim_container_read::<T>(len)?;
        Ok(len)
    }
    fn next_item<T>(&mut self) {
        self.0.unclaim_bytes_read(std::mem::size_of::<T>());
    }
    fn dtype(&mut self) -> Result<Dtype, DecodeError> {
        Dtype::decode(self.0)
    }
    fn sym(&mut self) -> Result<SymInt, DecodeError> {
        SymInt::decode(self.0)
    }
    fn refuse(&self, e: DecodeError) -> DecodeError {
        e
    }
}

/// The fast path's reader as a [`Source`]: any refusal is `()`, and the careful path names it.
impl Source for Wire<'_> {
    type Error = ();
    fn u32(&mut self) -> Result<u32, ()> {
        Wire::u32(self).ok_or(())
    }
    fn bool(&mut self) -> Result<bool, ()> {
        Wire::bool(self).ok_or(())
    }
    fn i64(&mut self) -> Result<i64, ()> {
        Wire::i64(self).ok_or(())
    }
    fn f64(&mut self) -> Result<f64, ()> {
        Wire::f64(self).ok_or(())
    }
    fn string(&mut self) -> Result<String, ()> {
        self.str().map(String::from).ok_or(())
    }
    fn items<T>(&mut self) -> Result<usize, ()> {
        let len = self.len().ok_or(())?;
        self.claim_items::<T>(len).ok_or(())?;
        Ok(len)
    }
    fn next_item<T>(&mut self) {
        self.unclaim_item::<T>();
    }
    fn dtype(&mut self) -> Result<Dtype, ()> {
        let v = Wire::u32(self).ok_or(())?;
        Dtype::ALL.get(v as usize).copied().ok_or(())
    }
    fn sym(&mut self) -> Result<SymInt, ()> {
        let expr = Str::from(self.str().ok_or(())?);
        let hint = Wire::i64(self).ok_or(())?;
        Ok(SymInt { expr, hint })
    }
    fn refuse(&self, _: DecodeError) {}
}

thread_local! {
    /// Containers (lists and slices, in JSON levels) around the ARG being read.
    static NESTING: Cell<usize> = const { Cell::new(0) };
}

/// Entered around the reading of a container's items; restores the count when dropped, on
/// errors too.
struct Nesting(usize);

impl Nesting {
    fn enter(levels: usize) -> Result<Nesting, DecodeError> {
        let outer = NESTING.get();
        let inner = outer + levels;
        // An item at `inner` containers has at least that JSON depth: refusing here refuses
        // nothing within MAX_DEPTH, and keeps the recursion below bounded.
        if inner > crate::arg::MAX_DEPTH {
            return Err(DecodeError::OtherString(format!(
                "ARG nested deeper than {} levels",
                crate::arg::MAX_DEPTH
            )));
        }
        NESTING.set(inner);
        Ok(Nesting(outer))
    }
}

impl Drop for Nesting {
    fn drop(&mut self) {
        NESTING.set(self.0);
    }
}

/// Reads one ARG as `#[derive(Decode)]` would, with `node` reading a reference. The usual
/// ones, a reference or a scalar, are read inline in the caller's loop, so the value is built
/// where the caller keeps it rather than returned through memory and copied; the rest take a
/// call.
#[inline(always)]
pub(super) fn read<S: Source, R>(
    s: &mut S,
    node: &mut impl FnMut(&mut S) -> Result<R, S::Error>,
) -> Result<Arg<R>, S::Error> {
    Ok(match s.u32()? {
        0 => Arg::None,
        1 => Arg::Bool(s.bool()?),
        2 => Arg::Int(s.i64()?),
        3 => Arg::Float(s.f64()?),
        5 => Arg::Node(node(s)?),
        variant => read_other(s, node, variant)?,
    })
}

/// [`read`] for the other variants, the containers among them.
#[inline(never)]
fn read_other<S: Source, R>(
    s: &mut S,
    node: &mut impl FnMut(&mut S) -> Result<R, S::Error>,
    variant: u32,
) -> Result<Arg<R>, S::Error> {
    let enter = |s: &S, levels| Nesting::enter(levels).map_err(|e| s.refuse(e));
    Ok(match variant {
        4 => Arg::Str(s.string()?),
        6 => {
            let _n = enter(s, 1)?;
            let len = s.items::<Arg<R>>()?;
            let mut items = Vec::with_capacity(len);
            for _ in 0..len {
                s.next_item::<Arg<R>>();
                items.push(read(s, node)?);
            }
            Arg::List(items)
        }
        7 => Arg::Dtype(s.dtype()?),
        8 => Arg::Device(s.string()?),
        9 => Arg::Layout(s.string()?),
        10 => Arg::MemoryFormat(s.string()?),
        11 => {
            let _n = enter(s, 2)?;
            let a = read(s, node)?;
            let b = read(s, node)?;
            let c = read(s, node)?;
            Arg::Slice(Box::new([a, b, c]))
        }
        12 => Arg::Sym(s.sym()?),
        13 => Arg::Repr(s.string()?),
        found => {
            return Err(s.refuse(DecodeError::UnexpectedVariant {
                type_name: "Arg",
                allowed: &AllowedEnumVariants::Range { min: 0, max: 13 },
                found,
            }));
        }
    })
}

impl<Context, R: Decode<Context>> Decode<Context> for Arg<R> {
    fn decode<D: Decoder<Context = Context>>(d: &mut D) -> Result<Self, DecodeError> {
        read(&mut Bincode(d), &mut |s| R::decode(s.0))
    }
}

impl<'de, Context, R: BorrowDecode<'de, Context>> BorrowDecode<'de, Context> for Arg<R> {
    fn borrow_decode<D: BorrowDecoder<'de, Context = Context>>(
        d: &mut D,
    ) -> Result<Self, DecodeError> {
        read(&mut Bincode(d), &mut |s| R::borrow_decode(s.0))
    }
}

// `Kwargs` travels as the map it is: a length, then each key and value, as bincode encodes a
// `BTreeMap<Str, Arg<R>>`, and decodes as that map does (claims included; a repeated key
// keeps its last value).
impl<R: Encode> Encode for Kwargs<R> {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), EncodeError> {
        (self.len() as u64).encode(e)?;
        for (k, a) in self.iter() {
            k.encode(e)?;
            a.encode(e)?;
        }
        Ok(())
    }
}

impl<Context, R: Decode<Context>> Decode<Context> for Kwargs<R> {
    fn decode<D: Decoder<Context = Context>>(d: &mut D) -> Result<Self, DecodeError> {
        decode_kwargs(d, |d| Ok((Str::decode(d)?, Arg::decode(d)?)))
    }
}

impl<'de, Context, R: BorrowDecode<'de, Context>> BorrowDecode<'de, Context> for Kwargs<R> {
    fn borrow_decode<D: BorrowDecoder<'de, Context = Context>>(
        d: &mut D,
    ) -> Result<Self, DecodeError> {
        decode_kwargs(d, |d| Ok((Str::borrow_decode(d)?, Arg::borrow_decode(d)?)))
    }
}

fn decode_kwargs<D: Decoder, R>(
    d: &mut D,
    mut pair: impl FnMut(&mut D) -> Result<(Str, Arg<R>), DecodeError>,
) -> Result<Kwargs<R>, DecodeError> {
    let len = u64::decode(d)?;
    let len = usize::try_from(len).map_err(|_| DecodeError::OutsideUsizeRange(len))?;
    d.claim_container_read::<(Str, Arg<R>)>(len)?;
    // Grown as pairs arrive, not reserved: a length is only a claim until the input backs it.
    let mut pairs = Vec::new();
    for _ in 0..len {
        d.unclaim_bytes_read(std::mem::size_of::<(Str, Arg<R>)>());
        pairs.push(pair(d)?);
    }
    Ok(Kwargs::from_pairs(pairs))
}
