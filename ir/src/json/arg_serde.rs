//! ARG values in JSON: literals, lists and the one-key objects of the format's ARG table.
//!
//! One visitor reads every ARG; how a `{"node": ..}` reference is read is its parameter
//! ([`ReadRef`]): as a name (`Arg<String>`, the careful path) or resolved on the spot against
//! the nodes read so far (the fast path, [`super::fast`]).

use crate::{Arg, Dtype, SymInt};
use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use std::fmt;

/// Reads the value of a `node` key.
pub(super) trait ReadRef<'de>: Copy {
    type Ref;
    fn read<A: MapAccess<'de>>(self, map: &mut A) -> Result<Self::Ref, A::Error>;
}

/// References as names.
#[derive(Clone, Copy)]
struct ByName;

impl<'de> ReadRef<'de> for ByName {
    type Ref = String;
    fn read<A: MapAccess<'de>>(self, map: &mut A) -> Result<String, A::Error> {
        map.next_value()
    }
}

impl<'de> Deserialize<'de> for Arg<String> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ArgSeed(ByName).deserialize(d)
    }
}

/// One ARG, references read by `R`.
#[derive(Clone, Copy)]
pub(super) struct ArgSeed<R>(pub R);

impl<'de, R: ReadRef<'de>> DeserializeSeed<'de> for ArgSeed<R> {
    type Value = Arg<R::Ref>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ArgVisitor(self.0))
    }
}

/// A JSON array of ARGs, read as `Vec<Arg<_>>` reads one.
#[derive(Clone, Copy)]
pub(super) struct ArgsSeed<R>(pub R);

impl<'de, R: ReadRef<'de>> DeserializeSeed<'de> for ArgsSeed<R> {
    type Value = Vec<Arg<R::Ref>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(ArgsVisitor(self.0))
    }
}

struct ArgsVisitor<R>(R);

impl<'de, R: ReadRef<'de>> Visitor<'de> for ArgsVisitor<R> {
    type Value = Vec<Arg<R::Ref>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(ArgSeed(self.0))? {
            items.push(item);
        }
        // Kept in the IR: exact, as the careful path's are (a shrink is in place).
        items.shrink_to_fit();
        Ok(items)
    }
}

struct ArgVisitor<R>(R);

impl<'de, R: ReadRef<'de>> Visitor<'de> for ArgVisitor<R> {
    type Value = Arg<R::Ref>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an fx-graph ARG value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Arg::None)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Arg::None)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Arg::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Arg::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        i64::try_from(v)
            .map(Arg::Int)
            .map_err(|_| E::custom(format!("integer {v} does not fit in 64 signed bits")))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Arg::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Arg::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Arg::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(ArgSeed(self.0))? {
            items.push(item);
        }
        Ok(Arg::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // Keys may come in any order ({"hint": .., "sym": ..}); unknown keys are read past.
        let mut found: Option<Self::Value> = None;
        let mut sym: Option<String> = None;
        let mut hint: Option<i64> = None;
        let set = |found: &mut Option<Self::Value>, a: Self::Value| -> Result<(), A::Error> {
            if found.replace(a).is_some() {
                return Err(de::Error::custom("an ARG object has exactly one kind key"));
            }
            Ok(())
        };
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "node" => set(&mut found, Arg::Node(self.0.read(&mut map)?))?,
                "dtype" => {
                    let name: std::borrow::Cow<'de, str> = map.next_value()?;
                    let dtype = Dtype::from_name(&name)
                        .ok_or_else(|| de::Error::custom(format!("unknown dtype `{name}`")))?;
                    set(&mut found, Arg::Dtype(dtype))?
                }
                "device" => set(&mut found, Arg::Device(map.next_value()?))?,
                "layout" => set(&mut found, Arg::Layout(map.next_value()?))?,
                "memory_format" => set(&mut found, Arg::MemoryFormat(map.next_value()?))?,
                "repr" => set(&mut found, Arg::Repr(map.next_value()?))?,
                "float" => {
                    let s: std::borrow::Cow<'de, str> = map.next_value()?;
                    let x = match s.as_ref() {
                        "inf" => f64::INFINITY,
                        "-inf" => f64::NEG_INFINITY,
                        "nan" => f64::NAN,
                        other => {
                            return Err(de::Error::custom(format!(
                                "`float` must be \"inf\", \"-inf\" or \"nan\", not `{other}`"
                            )));
                        }
                    };
                    set(&mut found, Arg::Float(x))?
                }
                "slice" => {
                    let parts = map.next_value_seed(ArgsSeed(self.0))?;
                    let parts: [Self::Value; 3] = parts
                        .try_into()
                        .map_err(|_| de::Error::custom("`slice` takes exactly three ARGs"))?;
                    set(&mut found, Arg::Slice(Box::new(parts)))?
                }
                "sym" => sym = Some(map.next_value()?),
                "hint" => hint = Some(map.next_value()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match (found, sym, hint) {
            (Some(a), None, None) => Ok(a),
            (None, Some(expr), Some(hint)) => Ok(Arg::Sym(SymInt {
                expr: expr.into(),
                hint,
            })),
            (None, Some(_), None) => Err(de::Error::custom("a `sym` ARG needs a `hint`")),
            _ => Err(de::Error::custom(
                "expected one of node, dtype, device, layout, memory_format, float, slice, sym, repr",
            )),
        }
    }
}
