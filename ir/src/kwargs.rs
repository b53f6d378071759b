//! [`Kwargs`]: a node's keyword arguments, sorted by key.
//!
//! Most nodes have none and the rest one to four, so they sit in one exactly sized vector of
//! pairs, found by binary search: a `BTreeMap` would allocate a node of eleven slots (about
//! 600 bytes) for a single keyword, and a scheduled graph carries one on every inserted op.
//! Iteration is in key order, so nothing downstream depends on the order a document spelled
//! them in.

use crate::{Arg, Str};
use std::borrow::Borrow;

/// Keyword arguments sorted by key, each key once; references spelled as `R` (see
/// [`crate::arg`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Kwargs<R = crate::NodeId>(Vec<(Str, Arg<R>)>);

impl<R> Default for Kwargs<R> {
    fn default() -> Kwargs<R> {
        Kwargs(Vec::new())
    }
}

impl<R> Kwargs<R> {
    pub fn new() -> Kwargs<R> {
        Kwargs::default()
    }

    /// From pairs in any order; where a key repeats, the last value stands, as for a map that
    /// inserts them in turn.
    pub fn from_pairs(mut pairs: Vec<(Str, Arg<R>)>) -> Kwargs<R> {
        // Documents spell keywords sorted: check before sorting.
        if !pairs.is_sorted_by(|(a, _), (b, _)| a < b) {
            // Stable, so that among equal keys the one read last comes last; `dedup_by` keeps
            // the first of a run, so each later value is swapped into its place first.
            pairs.sort_by(|(a, _), (b, _)| a.cmp(b));
            pairs.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    std::mem::swap(later, kept);
                }
                same
            });
        }
        pairs.shrink_to_fit();
        Kwargs(pairs)
    }

    fn find<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        Str: Borrow<Q>,
    {
        self.0.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&Arg<R>>
    where
        Str: Borrow<Q>,
    {
        self.find(key).ok().map(|i| &self.0[i].1)
    }

    /// Sets `key` to `value`; the value it had, if any.
    pub fn insert(&mut self, key: impl Into<Str>, value: Arg<R>) -> Option<Arg<R>> {
        let key = key.into();
        match self.find(key.as_str()) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs in key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&Str, &Arg<R>)> {
        self.0.iter().map(|(k, a)| (k, a))
    }

    pub fn keys(&self) -> impl ExactSizeIterator<Item = &Str> {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl ExactSizeIterator<Item = &Arg<R>> {
        self.0.iter().map(|(_, a)| a)
    }
}

/// [`Kwargs::from_pairs`].
impl<R, K: Into<Str>> FromIterator<(K, Arg<R>)> for Kwargs<R> {
    fn from_iter<I: IntoIterator<Item = (K, Arg<R>)>>(pairs: I) -> Kwargs<R> {
        Kwargs::from_pairs(pairs.into_iter().map(|(k, a)| (k.into(), a)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sorted_and_the_last_repeat_stands() {
        let kw: Kwargs<u32> = [
            ("weight", Arg::Node(1)),
            ("bias", Arg::None),
            ("weight", Arg::Node(2)),
            ("alpha", Arg::Int(3)),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            kw.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            ["alpha", "bias", "weight"]
        );
        assert_eq!(kw.get("weight"), Some(&Arg::Node(2)));
        assert_eq!(kw.get("missing"), None);
    }

    #[test]
    fn insert_keeps_order_and_replaces() {
        let mut kw: Kwargs<u32> = Kwargs::new();
        assert_eq!(kw.insert("param", Arg::Str("w".into())), None);
        assert_eq!(kw.insert("after", Arg::List(vec![])), None);
        assert_eq!(kw.insert("bucket", Arg::Int(0)), None);
        assert_eq!(kw.insert("bucket", Arg::Int(1)), Some(Arg::Int(0)));
        assert_eq!(
            kw.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["after", "bucket", "param"]
        );
        assert_eq!(kw.get("bucket"), Some(&Arg::Int(1)));
        assert_eq!(kw.len(), 3);
    }
}
