//! ARG values in JSON: literals, lists and the one-key objects of the format's ARG table.

use crate::{Arg, Dtype, SymInt};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

impl<'de> Deserialize<'de> for Arg<String> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ArgVisitor)
    }
}

struct ArgVisitor;

impl<'de> Visitor<'de> for ArgVisitor {
    type Value = Arg<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an fx-graph ARG value")
    }

    fn visit_unit<E>(self) -> Result<Arg<String>, E> {
        Ok(Arg::None)
    }
    fn visit_none<E>(self) -> Result<Arg<String>, E> {
        Ok(Arg::None)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Arg<String>, E> {
        Ok(Arg::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Arg<String>, E> {
        Ok(Arg::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Arg<String>, E> {
        i64::try_from(v)
            .map(Arg::Int)
            .map_err(|_| E::custom(format!("integer {v} does not fit in 64 signed bits")))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Arg<String>, E> {
        Ok(Arg::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Arg<String>, E> {
        Ok(Arg::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Arg<String>, E> {
        Ok(Arg::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Arg<String>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Arg::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Arg<String>, A::Error> {
        // Keys may come in any order ({"hint": .., "sym": ..}); unknown keys are read past.
        let mut found: Option<Arg<String>> = None;
        let mut sym: Option<String> = None;
        let mut hint: Option<i64> = None;
        let set = |found: &mut Option<Arg<String>>, a: Arg<String>| -> Result<(), A::Error> {
            if found.replace(a).is_some() {
                return Err(de::Error::custom("an ARG object has exactly one kind key"));
            }
            Ok(())
        };
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "node" => set(&mut found, Arg::Node(map.next_value()?))?,
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
                    let parts: Vec<Arg<String>> = map.next_value()?;
                    let parts: [Arg<String>; 3] = parts
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
            (None, Some(expr), Some(hint)) => Ok(Arg::Sym(SymInt { expr, hint })),
            (None, Some(_), None) => Err(de::Error::custom("a `sym` ARG needs a `hint`")),
            _ => Err(de::Error::custom(
                "expected one of node, dtype, device, layout, memory_format, float, slice, sym, repr",
            )),
        }
    }
}
