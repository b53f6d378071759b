//! Text-file cases for the rewrite stage (Cranelift's filetests are the model).
//!
//! Each `tests/rewrite/NAME.json` is an fx-graph v1 document before insertion, with an extra
//! `"test"` object (the format ignores unknown fields) that says how to run it: `split`
//! (`min_gap_nodes` for `split_long_gaps`), `budget`, `world_size`, `disable` (rule names).
//! The runner inserts, optionally splits, rewrites, and compares a listing of the graph before
//! and after the stage ([`zerosched_ir::listing`]), and the report, with the snapshot
//! `NAME.snap` beside the case (insta: `cargo insta review` accepts an intended change).
//! Every case also checks, by hand, insertion's invariants on the result, the verifier, and
//! that a second run gives byte-identical output.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};
use zerosched_ir::listing;
use zerosched_ir::{Graph, NodeId};
use zerosched_passes::alias::Aliases;
use zerosched_passes::insert::insert;
use zerosched_passes::ops::{self, CommOp};
use zerosched_passes::rewrite::split::split_long_gaps;
use zerosched_passes::rewrite::{RewriteOptions, RewriteReport, rewrite};
use zerosched_passes::schedule::{Prefetch, ScheduleOptions, Scheduler};

fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rewrite");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/rewrite exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    out.sort();
    out
}

fn report_text(r: &RewriteReport) -> String {
    let mut out = String::new();
    for (rule, n) in &r.fired {
        let _ = writeln!(out, "fired {rule}: {n}");
    }
    let _ = writeln!(
        out,
        "casts fused: {}\nregathers removed: {}\nalias nodes: {} -> {}\n\
         communicated bytes: {} -> {} (saved {})\nkept bytes: {}\nsaturated: {}",
        r.casts_fused,
        r.regathers_removed,
        r.alias_nodes_before,
        r.alias_nodes_after,
        r.comm_bytes_before,
        r.comm_bytes_after,
        r.comm_bytes_saved(),
        r.kept_bytes,
        r.saturated
    );
    out
}

/// Insertion's guarantees, checked independently of the stage: each gather has one wait and
/// one release; every real use of the gathered storage comes after the wait and before the
/// release, and the release's `after` names exactly those uses; a sharded placeholder is read
/// only by gathers and the output; the order is topological (the verifier).
fn check_invariants(g: &Graph) -> Result<(), String> {
    zerosched_ir::verify::graph(g).map_err(|d| format!("verifier: {d:?}"))?;
    let aliases = Aliases::analyse(g);
    let pos = g.positions();
    let output = g.output();
    for (id, n) in g.nodes() {
        if CommOp::of(n) != Some(CommOp::AllGather) {
            continue;
        }
        let waits: Vec<NodeId> = g.users(id);
        let [wait] = waits[..] else {
            return Err(format!("{}: {} users, want one wait", n.name, waits.len()));
        };
        let releases: BTreeSet<NodeId> = aliases
            .members(id)
            .iter()
            .flat_map(|&m| g.users(m))
            .filter(|&u| CommOp::of(g.node(u)) == Some(CommOp::Release))
            .collect();
        let [release] = releases.iter().copied().collect::<Vec<_>>()[..] else {
            return Err(format!("{}: {} releases, want one", n.name, releases.len()));
        };
        let uses: BTreeSet<NodeId> = aliases
            .real_uses(g, id)
            .into_iter()
            .filter(|&u| Some(u) != output)
            .collect();
        for &u in &uses {
            if !(pos[wait] < pos[u] && pos[u] < pos[release]) {
                return Err(format!(
                    "{}: use {} outside wait..release",
                    n.name,
                    g.node(u).name
                ));
            }
        }
        let after: BTreeSet<NodeId> = ops::release_after(g.node(release)).into_iter().collect();
        if after != uses {
            return Err(format!("{}: release `after` is not its real uses", n.name));
        }
    }
    for p in &g.params {
        for u in g.users(p.node) {
            if Some(u) != output
                && CommOp::of(g.node(u)) != Some(CommOp::AllGather)
                && !p.persistent
            {
                return Err(format!("placeholder {} read by {}", p.name, g.node(u).name));
            }
        }
    }
    Ok(())
}

struct Outcome {
    before: Graph,
    after: Graph,
    report: RewriteReport,
}

fn run(path: &Path) -> Result<Outcome, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let doc: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    let test = doc.get("test").cloned().unwrap_or_default();
    let mut program = zerosched_ir::json::import(&bytes).map_err(|e| e.to_string())?;
    let mut g = program.graphs.remove(0);
    insert(&mut g, &BTreeSet::new()).map_err(|e| e.to_string())?;
    if let Some(gap) = test.get("split").and_then(|v| v.as_u64()) {
        split_long_gaps(&mut g, gap as usize).map_err(|e| e.to_string())?;
        check_invariants(&g).map_err(|e| format!("after split: {e}"))?;
    }
    let mut opts = RewriteOptions::default();
    if let Some(b) = test.get("budget").and_then(|v| v.as_u64()) {
        opts.budget = b;
    }
    if let Some(w) = test.get("world_size").and_then(|v| v.as_u64()) {
        opts.world_size = w as u32;
    }
    for d in test
        .get("disable")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
    {
        opts.disabled
            .insert(d.as_str().unwrap_or_default().to_owned());
    }
    let before = g.clone();
    let report = rewrite(&mut g, &opts).map_err(|e| e.to_string())?;
    check_invariants(&g).map_err(|e| format!("after rewrite: {e}"))?;
    let mut again = before.clone();
    let report2 = rewrite(&mut again, &opts).map_err(|e| e.to_string())?;
    if zerosched_ir::json::export_graph(&again) != zerosched_ir::json::export_graph(&g)
        || report2 != report
    {
        return Err("a second run gave different output".into());
    }
    // The next stage takes the result as it would any graph after insertion.
    let mut scheduled = g.clone();
    let sched = ScheduleOptions {
        budget: opts.budget,
        world_size: opts.world_size,
        ..ScheduleOptions::default()
    };
    Prefetch
        .schedule(&mut scheduled, &sched)
        .map_err(|e| e.to_string())?;
    check_invariants(&scheduled).map_err(|e| format!("after scheduling: {e}"))?;
    // The output is an ordinary document: it round-trips through the importer.
    zerosched_ir::json::import(&zerosched_ir::json::export_graph(&g)).map_err(|e| e.to_string())?;
    Ok(Outcome {
        before,
        after: g,
        report,
    })
}

#[test]
fn rewrite_cases() {
    let all = cases();
    assert!(!all.is_empty(), "no cases under tests/rewrite");
    for path in all {
        let o = run(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let text = format!(
            "# before\n{}\n# after\n{}\n# report\n{}",
            listing::graph(&o.before),
            listing::graph(&o.after),
            report_text(&o.report)
        );
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        insta::with_settings!({
            snapshot_path => "rewrite",
            prepend_module_to_snapshot => false,
            input_file => &path,
            omit_expression => true,
        }, {
            insta::assert_snapshot!(name.unwrap_or_default(), text);
        });
    }
}

/// The stage rejects names it does not know rather than silently running every rule.
#[test]
fn unknown_rule_name_is_an_error() {
    let mut g = Graph::default();
    let opts = RewriteOptions {
        disabled: BTreeSet::from(["no-such-rule".to_owned()]),
        ..RewriteOptions::default()
    };
    let err = rewrite(&mut g, &opts).expect_err("unknown rule");
    assert!(err.to_string().contains("no-such-rule"), "{err}");
}

/// Many threads at once (egg interns rule names in a shared table) still give one answer.
#[test]
fn concurrent_runs_agree() {
    let path = cases()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("keep_instead_of_regather"))
        .expect("the keep case");
    let outputs: BTreeMap<usize, Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let path = path.clone();
                s.spawn(move || {
                    (
                        i,
                        zerosched_ir::json::export_graph(&run(&path).expect("runs").after),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let first = &outputs[&0];
    assert!(outputs.values().all(|o| o == first));
}
