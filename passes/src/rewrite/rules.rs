//! The rewrite rules, held as data: a named list that options can filter.
//!
//! A family name (`canonical-alias-chain`) covers its members (`canonical-alias-chain/t-t`), so
//! disabling the family disables them all. Every rule only adds equalities that hold for the
//! values; whether a form pays (fewer bytes on the wire, memory held over a gap) is the cost
//! function's call, with two exceptions that are conditions of validity: a cast fuses into a
//! gather only when it is the segment's only real use, and a view drops only when it does not
//! change the shape.

use super::lang::{Atom, Comm, CommGraph, Context, atom, dtype_atom, resolve_view, seg_atom};
use egg::{Applier, Id, PatternAst, Rewrite, Subst, Symbol, Var, rewrite};

pub const FUSE_CAST: &str = "fuse-cast-into-gather";
pub const KEEP: &str = "keep-instead-of-regather";
pub const CANONICAL: &str = "canonical-alias-chain";

/// Every rule, in the order the runner applies them.
pub fn all() -> Vec<Rewrite<Comm, Context>> {
    vec![
        rewrite!("fuse-cast-into-gather";
            "(cast (wait (gather ?p ?d ?s)) ?to)" => "(wait (gather ?p ?to ?s))"
            if only_downcast("?d", "?s", "?to")),
        // An elementwise cast commutes with views: these bring a cast down to the wait.
        rewrite!("fuse-cast-into-gather/through-view";
            "(cast (view ?x ?sh) ?to)" => "(view (cast ?x ?to) ?sh)"),
        rewrite!("fuse-cast-into-gather/through-t"; "(cast (t ?x) ?to)" => "(t (cast ?x ?to))"),
        rewrite!("fuse-cast-into-gather/through-transpose";
            "(cast (transpose ?x ?i ?j) ?to)" => "(transpose (cast ?x ?to) ?i ?j)"),
        Rewrite::new(
            KEEP,
            egg::Pattern::<Comm>::new("(wait (gather ?p ?d ?s))".parse().expect("pattern")),
            KeepApplier {
                p: var("?p"),
                d: var("?d"),
                s: var("?s"),
            },
        )
        .expect("keep rule"),
        rewrite!("canonical-alias-chain/view-view";
            "(view (view ?x ?a) ?b)" => "(view ?x ?b)"),
        rewrite!("canonical-alias-chain/t-t"; "(t (t ?x))" => "?x"),
        rewrite!("canonical-alias-chain/transpose-transpose";
            "(transpose (transpose ?x ?i ?j) ?i ?j)" => "?x"),
        rewrite!("canonical-alias-chain/transpose-transpose-swapped";
            "(transpose (transpose ?x ?i ?j) ?j ?i)" => "?x"),
        rewrite!("canonical-alias-chain/view-same-shape";
            "(view ?x ?sh)" => "?x" if same_shape("?x", "?sh")),
    ]
}

/// The names `disabled` may use: every rule and every family.
pub fn known_names() -> Vec<String> {
    let mut names: Vec<String> = all().iter().map(|r| r.name.to_string()).collect();
    names.extend([FUSE_CAST, KEEP, CANONICAL].map(String::from));
    names.sort();
    names.dedup();
    names
}

/// Whether `disabled` names `rule` or its family.
pub fn is_disabled(rule: &str, disabled: &std::collections::BTreeSet<String>) -> bool {
    let family = rule.split('/').next().unwrap_or(rule);
    disabled.contains(rule) || disabled.contains(family)
}

fn var(name: &str) -> Var {
    name.parse().expect("a pattern variable")
}

type Condition = Box<dyn Fn(&mut CommGraph, Id, &Subst) -> bool + Send + Sync>;

/// The cast goes to a smaller float dtype and is the only real use of the segment's storage.
fn only_downcast(d: &str, s: &str, to: &str) -> Condition {
    let (d, s, to) = (var(d), var(s), var(to));
    Box::new(move |eg, _, subst| {
        let (Some(from), Some(to), Some(seg)) = (
            dtype_atom(eg, subst[d]),
            dtype_atom(eg, subst[to]),
            seg_atom(eg, subst[s]),
        ) else {
            return false;
        };
        let only = eg.analysis.segs.get(seg as usize).and_then(|i| i.only_cast);
        only == Some(to) && to.is_floating() && from.is_floating() && to.size() < from.size()
    })
}

/// The view's size, resolved, is the viewed tensor's own shape.
fn same_shape(x: &str, sh: &str) -> Condition {
    let (x, sh) = (var(x), var(sh));
    Box::new(move |eg, _, subst| {
        let Some(ty) = eg[subst[x]].data.clone() else {
            return false;
        };
        let Some(Atom::Shape(sizes)) = atom(eg, subst[sh]) else {
            return false;
        };
        let numel = ty.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        numel.and_then(|n| resolve_view(sizes, n)) == Some(ty.shape)
    })
}

/// `(wait (gather p d s))` = `(keep (wait (gather p d prev)) s)`: the value of segment `s` is
/// the previous segment's buffer, held across the gap. Needs the segment table, so it is a
/// custom applier rather than a pattern.
struct KeepApplier {
    p: Var,
    d: Var,
    s: Var,
}

impl Applier<Comm, Context> for KeepApplier {
    fn apply_one(
        &self,
        eg: &mut CommGraph,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<Comm>>,
        rule_name: Symbol,
    ) -> Vec<Id> {
        let Some(seg) = seg_atom(eg, subst[self.s]) else {
            return Vec::new();
        };
        let Some(prev) = eg.analysis.segs.get(seg as usize).and_then(|i| i.prev) else {
            return Vec::new();
        };
        let prev = eg.add(Comm::Atom(Atom::Seg(prev)));
        let gather = eg.add(Comm::Gather([subst[self.p], subst[self.d], prev]));
        let held = eg.add(Comm::Wait(gather));
        let kept = eg.add(Comm::Keep([held, subst[self.s]]));
        if eg.union_trusted(eclass, kept, rule_name) {
            vec![eclass]
        } else {
            Vec::new()
        }
    }
}
