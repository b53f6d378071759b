//! Whether the stage would leave a graph exactly as it is, decided without building the
//! e-graph. Most graphs qualify (no casts, views or gaps on gathered chains), and for them
//! saturation, extraction and write-back are pure cost.
//!
//! The stage changes nothing when, for every segment in scope:
//! - no node makes a term of its gather or wait (a view, `t`, `transpose` or cast of it that
//!   the output does not read), so no rule pattern but the keep rule's can match, and no two
//!   e-nodes can coincide;
//! - it has no previous segment to keep a buffer from, so the keep rule adds nothing;
//! - its wait has a consumer other than a release, so extraction reaches it (an unreached
//!   gather would be removed);
//! - its release already reads the wait and names, in `after`, exactly the real uses that
//!   write-back would name.
//!
//! The program order must also be topological already (write-back re-sorts otherwise), and
//! the runner must be able to finish one iteration (a limit hit first reports the e-graph
//! unsaturated).

use super::RewriteOptions;
use super::build::{Scope, parse, previous};
use crate::ops::{self, CommOp};
use std::collections::BTreeSet;
use zerosched_ir::{Arg, Graph, NodeId, SideTable};

pub(super) fn unchanged(g: &Graph, scope: &Scope, opts: &RewriteOptions) -> bool {
    let mut in_scope = SideTable::new(g, false);
    let mut dtypes = BTreeSet::new();
    let mut segments = 0;
    for (_, _, found) in &scope.params {
        for s in found {
            in_scope[s.gather] = true;
            in_scope[s.wait] = true;
            dtypes.insert(s.dtype);
        }
        segments += found.len();
        if (0..found.len()).any(|k| previous(found, k).is_some()) {
            return false;
        }
    }
    // Atoms (one per parameter, segment and dtype), gathers and waits.
    let egraph_size = scope.params.len() + dtypes.len() + 3 * segments;
    if opts.iter_limit == 0 || egraph_size > opts.node_limit {
        return false;
    }
    let users = |id| g.consumers(id);
    let returned = |id| scope.output.is_some_and(|o| g.feeds(id, o));
    let makes_term = |u: NodeId| {
        !in_scope[u] && !returned(u) && parse(g.node(u)).is_some_and(|(x, _)| in_scope[x])
    };
    scope.params.iter().flat_map(|(_, _, f)| f).all(|s| {
        let consumed =
            users(s.wait).any(|u| !in_scope[u] && CommOp::of(g.node(u)) != Some(CommOp::Release));
        consumed
            && !users(s.gather).chain(users(s.wait)).any(makes_term)
            && release_as_written(g, scope, s.gather, s.wait, s.release)
    }) && is_topological(g, g.order())
}

/// Whether `release` already has the argument and keywords that write-back gives it.
fn release_as_written(
    g: &Graph,
    scope: &Scope,
    gather: NodeId,
    wait: NodeId,
    release: NodeId,
) -> bool {
    let name = ops::param_name(g.node(gather)).unwrap_or_default();
    let after: Vec<NodeId> = match scope.aliases.class(wait) {
        Some(class) => scope
            .aliases
            .real_uses(g, class)
            .into_iter()
            .filter(|&u| Some(u) != scope.output && CommOp::of(g.node(u)) != Some(CommOp::Release))
            .collect(),
        None => Vec::new(),
    };
    let n = g.node(release);
    n.args == [Arg::Node(wait)] && n.kwargs == ops::release_kwargs(name, &after)
}

/// Whether every node of `order` comes after all of its producers.
pub(super) fn is_topological(g: &Graph, order: &[NodeId]) -> bool {
    let mut placed = SideTable::new(g, false);
    order.iter().all(|&id| {
        let ready = g.producers(id).all(|p| placed[p]);
        placed[id] = true;
        ready
    })
}

#[cfg(test)]
mod tests {
    use super::super::{RewriteOptions, build, rewrite, saturate};
    use std::collections::BTreeSet;
    use std::path::Path;
    use zerosched_ir::{Program, json};

    /// Every exported fixture and every rewrite case, after insertion: where the pre-check
    /// says the stage changes nothing, the full stage indeed writes the same graph and the same
    /// report. Both outcomes of the pre-check must occur.
    #[test]
    fn graphs_the_pre_check_passes_come_out_of_the_full_stage_unchanged() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        for dir in ["../tests/fixtures", "tests/rewrite"] {
            let entries = std::fs::read_dir(root.join(dir)).expect("fixture directory");
            files.extend(entries.flatten().map(|e| e.path()));
        }
        files.retain(|p| p.extension().is_some_and(|x| x == "json"));
        files.sort();
        let opts = RewriteOptions::default();
        let (mut inert, mut not) = (0, 0);
        for path in &files {
            let bytes = std::fs::read(path).expect("fixture reads");
            let program = zerosched_ir::import(&bytes).expect("fixture imports");
            for mut g in program.graphs {
                crate::insert::insert(&mut g, &BTreeSet::new()).expect("inserts");
                if !super::unchanged(&g, &build::scope(&g), &opts) {
                    not += 1;
                    continue;
                }
                inert += 1;
                let mut full = g.clone();
                let scope = build::scope(&full);
                let full_report = saturate(&mut full, scope, &opts).expect("runs");
                let mut quick = g.clone();
                let quick_report = rewrite(&mut quick, &opts).expect("runs");
                let text = |g: &zerosched_ir::Graph| json::export(&Program::single(g.clone()));
                assert_eq!(text(&full), text(&g), "{}: {}", path.display(), g.label());
                assert_eq!(text(&quick), text(&g), "{}: {}", path.display(), g.label());
                assert_eq!(full_report, quick_report, "{}", path.display());
            }
        }
        assert!(inert > 0 && not > 0, "inert {inert}, not {not}");
    }
}
