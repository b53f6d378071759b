//! Guarantees 2–4: shards are read only by their gathers and the output; every real use of
//! gathered storage lies between its wait and its release; one wait and one release (or keep)
//! per gather, none for a gather whose value escapes through the output; buckets of gathers
//! are contiguous and of one dtype. A `reuse` of a buffer an earlier graph kept stands for a
//! gather throughout.

use super::storage::{self, Storage};
use super::{Ctx, Violation};
use std::collections::BTreeMap;
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Dtype, GraphKind, Node, NodeId, Op, SideTable};

pub(super) struct Gather {
    /// The all-gather or reuse.
    pub node: NodeId,
    pub reuse: bool,
    /// The parameter gathered: the placeholder's, else the `param` keyword.
    pub param: String,
    pub waits: Vec<NodeId>,
    /// Releases and keeps, in program order.
    pub releases: Vec<NodeId>,
    /// Real uses of its storage other than the output, in program order.
    pub uses: Vec<NodeId>,
    pub escaped: bool,
}

pub(super) struct Gathers {
    /// In program order.
    pub list: Vec<Gather>,
    /// The gather (index into `list`) each release or keep ends.
    pub frees: SideTable<Option<usize>>,
    pub releases: usize,
    pub keeps: usize,
    pub buckets: usize,
}

pub(super) fn check(cx: &mut Ctx) -> Gathers {
    let g = cx.g;
    shard_reads(cx);

    let mut index = SideTable::new(g, None);
    let mut list = Vec::new();
    for (id, n) in g.nodes() {
        let op = CommOp::of(n);
        if matches!(op, Some(CommOp::AllGather | CommOp::Reuse)) {
            index[id] = Some(list.len());
            let param = gathered_param(cx, id, n);
            list.push(Gather {
                node: id,
                reuse: op == Some(CommOp::Reuse),
                param,
                waits: Vec::new(),
                releases: Vec::new(),
                uses: Vec::new(),
                escaped: false,
            });
        }
    }
    let storage = Storage::analyse(g, &index);

    let mut frees = SideTable::new(g, None);
    let (mut releases, mut keeps) = (0, 0);
    for (id, n) in g.nodes() {
        let op = CommOp::of(n);
        match op {
            Some(CommOp::Wait) => match first_ref(n).and_then(|v| index[v]) {
                Some(i) => {
                    param_matches(cx, id, n, &list[i].param);
                    list[i].waits.push(id);
                }
                None => cx.at_field(id, "args[0]", Violation::WaitNotOnGather),
            },
            Some(CommOp::Release | CommOp::Keep) => {
                if op == Some(CommOp::Keep) {
                    keeps += 1;
                    if g.kind != GraphKind::Forward {
                        cx.at(id, Violation::KeepOutsideForward);
                    }
                } else {
                    releases += 1;
                }
                let candidates = first_ref(n).map_or(&[][..], |v| storage.gathers(v));
                let named = comm::param_name(n);
                let chosen = candidates
                    .iter()
                    .copied()
                    .find(|&i| Some(list[i].param.as_str()) == named)
                    .or_else(|| candidates.first().copied());
                match chosen {
                    Some(i) => {
                        param_matches(cx, id, n, &list[i].param);
                        list[i].releases.push(id);
                        frees[id] = Some(i);
                    }
                    None => cx.at_field(id, "args[0]", Violation::ReleaseNotGathered),
                }
            }
            _ => {}
        }
    }

    // Real uses of each gathered buffer; `seen` de-duplicates a node's references.
    let mut seen = SideTable::new(g, usize::MAX);
    for (here, (id, n)) in g.nodes().enumerate() {
        if !storage.reads_gathered(n) {
            continue;
        }
        let (views, writes) = (storage::alias_sources(n), storage::written(n));
        for &v in n.refs() {
            if seen[v] == here || !storage::is_real_use(n, v, &views, &writes) {
                continue;
            }
            seen[v] = here;
            for &i in storage.gathers(v) {
                let x = &mut list[i];
                if n.op == Op::Output {
                    x.escaped = true;
                } else if x.uses.last() != Some(&id) {
                    x.uses.push(id);
                }
            }
        }
    }

    let mut in_after = SideTable::new(g, usize::MAX);
    for x in &list {
        lifetime(cx, x, &mut in_after);
    }
    let buckets = buckets(cx, &list);
    Gathers {
        list,
        frees,
        releases,
        keeps,
        buckets,
    }
}

/// Guarantee 2, for every sharded parameter's placeholder.
fn shard_reads(cx: &mut Ctx) {
    let g = cx.g;
    for p in &g.params {
        if !cx.sharded(p) || g.get(p.node).is_none() {
            continue;
        }
        for u in g.users(p.node) {
            let n = g.node(u);
            let gathers_it = matches!(CommOp::of(n), Some(CommOp::AllGather | CommOp::Reuse))
                && first_ref(n) == Some(p.node);
            if !gathers_it && n.op != Op::Output {
                let violation = Violation::ShardRead {
                    param: p.name.clone(),
                    placeholder: cx.name(p.node),
                };
                cx.at(u, violation);
            }
        }
    }
}

/// Checks a gather's (or reuse's) argument and keyword; returns the parameter it gathers.
fn gathered_param(cx: &mut Ctx, id: NodeId, n: &Node) -> String {
    let Some(p) = first_ref(n)
        .and_then(|v| cx.param_at[v])
        .map(|i| &cx.g.params[i])
    else {
        cx.at_field(id, "args[0]", Violation::GatherNotOfParam);
        return comm::param_name(n).unwrap_or_default().to_owned();
    };
    if !cx.sharded(p) {
        let param = p.name.clone();
        cx.at(id, Violation::GatherOfPersistent { param });
    }
    param_matches(cx, id, n, &p.name);
    p.name.clone()
}

fn param_matches(cx: &mut Ctx, id: NodeId, n: &Node, expected: &str) {
    let found = comm::param_name(n);
    if found != Some(expected) {
        let violation = Violation::ParamMismatch {
            expected: expected.to_owned(),
            found: found.map_or("missing".to_owned(), |f| format!("`{f}`")),
        };
        cx.at_field(id, "kwargs.param", violation);
    }
}

/// Guarantee 3 for one gather. `in_after` is scratch space, marked with the release's position.
fn lifetime(cx: &mut Ctx, x: &Gather, in_after: &mut SideTable<usize>) {
    let param = || x.param.clone();
    let wait = x.waits.first().copied();
    match wait {
        None => cx.at(x.node, Violation::MissingWait { param: param() }),
        Some(w) if cx.pos(w) < cx.pos(x.node) => {
            let gather = cx.name(x.node);
            cx.at(w, Violation::WaitBeforeGather { gather });
        }
        Some(_) => {}
    }
    for (&first, &extra) in x.waits.iter().zip(x.waits.iter().skip(1)) {
        let first = cx.name(first);
        cx.at(
            extra,
            Violation::ExtraWait {
                param: param(),
                first,
            },
        );
    }
    if x.escaped {
        for &r in &x.releases {
            cx.at(r, Violation::ReleaseOfEscaped { param: param() });
        }
    } else if let Some(&first) = x.releases.first() {
        for &r in &x.releases[1..] {
            let first = cx.name(first);
            cx.at(
                r,
                Violation::DoubleRelease {
                    param: param(),
                    first,
                },
            );
        }
    } else {
        cx.at(x.node, Violation::MissingRelease { param: param() });
    }
    let release = x.releases.first().copied().filter(|_| !x.escaped);
    for &u in &x.uses {
        if let Some(w) = wait.filter(|&w| cx.pos(u) < cx.pos(w)) {
            let wait = cx.name(w);
            cx.at(
                u,
                Violation::UseBeforeWait {
                    param: param(),
                    wait,
                },
            );
        }
        if let Some(r) = release.filter(|&r| cx.pos(u) > cx.pos(r)) {
            let release = cx.name(r);
            cx.at(
                u,
                Violation::UseAfterRelease {
                    param: param(),
                    release,
                },
            );
        }
    }
    if x.escaped {
        return;
    }
    for &r in &x.releases {
        let stamp = cx.pos(r);
        for a in comm::release_after(cx.g.node(r)) {
            in_after[a] = stamp;
        }
        for &u in &x.uses {
            if in_after[u] != stamp {
                let user = cx.name(u);
                cx.at_field(
                    r,
                    "kwargs.after",
                    Violation::ReleaseMissesUse {
                        param: param(),
                        user,
                    },
                );
            }
        }
    }
}

/// Guarantee 4; returns the number of distinct bucket ids.
fn buckets(cx: &mut Ctx, list: &[Gather]) -> usize {
    let mut members: BTreeMap<i64, Vec<NodeId>> = BTreeMap::new();
    for x in list {
        let Some(b) = comm::bucket(cx.g.node(x.node)) else {
            continue;
        };
        if x.reuse {
            // A reuse issues no collective: docs/format.md gives it no `bucket`.
            cx.at_field(
                x.node,
                "kwargs.bucket",
                Violation::BucketOnReuse { bucket: b },
            );
        } else {
            members.entry(b).or_default().push(x.node);
        }
    }
    // `list` is in program order, so each bucket's members are too.
    super::buckets::check(cx, &members, comm::bucket_dtypes, |bucket, first, e, f| {
        Violation::BucketMixedDtype {
            bucket,
            first,
            expected: describe_dtypes(e),
            found: describe_dtypes(f),
        }
    })
}

/// `bf16 (cast)` or `f32`, for a bucket's dtype violation.
fn describe_dtypes((cast, gathered): (Option<Dtype>, Option<Dtype>)) -> String {
    match (cast, gathered) {
        (Some(c), _) => format!("{} (cast)", c.name()),
        (None, g) => g.map_or("an unknown dtype", Dtype::name).to_owned(),
    }
}

fn first_ref(n: &Node) -> Option<NodeId> {
    n.args.first().and_then(|a| a.as_node()).copied()
}
