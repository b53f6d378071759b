//! The scheduled programs the pipeline writes, pinned as snapshots that say what changed
//! (insta; `cargo insta review` accepts an intended change, docs/design.md §"Tests").
//!
//! - Small fixtures (tests/fixtures/edge and the GPT-2 forward graph): the whole scheduled
//!   program as a listing ([`zerosched_ir::listing`]), every scheduler, no budget.
//! - Every exported fixture and the smaller benchmark programs, every scheduler and three budgets
//!   (none, two layers' worth, one layer's worth, infeasible for some): the facts that matter
//!   per graph, the order of the inserted ops (consecutive ops of one kind and bucket on one
//!   line), the simulated times, peaks, gathers and buckets, and the parameters kept; or the
//!   error. A renamed node or a new keyword leaves these alone; a moved gather shows as the
//!   lines that moved.

mod common;

use std::fmt::Write;
use std::path::Path;
use zerosched_ir::comm::{CommOp, Inserted};
use zerosched_ir::{Graph, Program};
use zerosched_passes::pipeline::{self, Context, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleOptions};
use zerosched_passes::simulate::{SimOptions, Summary, simulate_program};

fn schedule(bytes: &[u8], scheduler: &str, budget: u64) -> Result<(Program, Context), String> {
    let mut p = zerosched_ir::import(bytes).map_err(|e| e.to_string())?;
    let opts = PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            ..ScheduleOptions::default()
        },
        scheduler: scheduler.to_owned(),
        verify: true,
        ..PipelineOptions::default()
    };
    match pipeline::run(&pipeline::standard(), &mut p, &opts) {
        Ok(cx) => Ok((p, cx)),
        Err(e) => Err(e.to_string().lines().next().unwrap_or("").to_owned()),
    }
}

fn kind_name(op: CommOp) -> &'static str {
    match op {
        CommOp::AllGather => "allgather",
        CommOp::Wait => "wait",
        CommOp::Release => "release",
        CommOp::ReduceGrad => "reduce_grad",
        CommOp::EndBackward => "end_backward",
        CommOp::Keep => "keep",
        CommOp::Reuse => "reuse",
    }
}

/// The inserted ops of `g` in program order, a line per run of one kind (and bucket).
fn inserted_order(g: &Graph, out: &mut String) {
    let mut line: Option<(String, Vec<String>)> = None;
    for (_, n) in g.nodes() {
        let Some(op) = Inserted::of(n) else { continue };
        let head = match op {
            Inserted::AllGather {
                bucket: Some(b), ..
            } => format!("allgather bucket {b}"),
            Inserted::ReduceGrad {
                bucket: Some(b), ..
            } => format!("reduce_grad bucket {b}"),
            _ => kind_name(op.op()).to_owned(),
        };
        let param = op.param().unwrap_or("").to_owned();
        match &mut line {
            Some((h, params)) if *h == head => params.push(param),
            _ => {
                if let Some((h, params)) = line.take() {
                    let _ = writeln!(out, "    {h}: {}", params.join(" "));
                }
                line = Some((head, vec![param]));
            }
        }
    }
    if let Some((h, params)) = line {
        let _ = writeln!(out, "    {h}: {}", params.join(" "));
    }
}

fn figures(s: &Summary) -> String {
    format!(
        "step {:.4} ms, exposed {:.4} ms, stall {:.4} ms, peak gathered {} B, peak total {} B, \
         gathers {}, buckets {}, reduction buckets {}",
        s.step_ms,
        s.exposed_comm_ms,
        s.stall_ms,
        s.peak_gathered_bytes,
        s.peak_total_bytes,
        s.gathers,
        s.buckets,
        s.reduce_buckets
    )
}

fn facts(p: &Program, cx: &Context) -> String {
    let sim = simulate_program(p, &SimOptions::default());
    let mut out = format!("  total: {}\n", figures(&sim.total));
    if !cx.keep.kept.is_empty() {
        let _ = writeln!(out, "  kept: {}", cx.keep.kept.join(" "));
    }
    for (g, s) in p.graphs.iter().zip(&sim.graphs) {
        let _ = writeln!(
            out,
            "  graph {} ({}): {}",
            s.graph,
            s.kind,
            figures(&s.summary)
        );
        inserted_order(g, &mut out);
    }
    out
}

fn snapshot_name(path: &Path) -> String {
    common::relative(path)
        .trim_start_matches("tests/fixtures/")
        .trim_start_matches("benches/data/")
        .replace(['/', '.'], "_")
}

#[test]
fn small_fixtures_scheduled_listings() {
    let mut inputs = common::files("tests/fixtures/edge", &[".json"]);
    assert!(!inputs.is_empty(), "the edge-case fixtures are present");
    inputs.push(common::root().join("tests/fixtures/gpt2_fwd_0.json"));
    for path in &inputs {
        let bytes = zerosched_api::io::read_bytes(path).expect("fixture reads");
        let mut text = String::new();
        for scheduler in NAMES {
            let _ = writeln!(text, "## {scheduler}");
            match schedule(&bytes, scheduler, u64::MAX) {
                Ok((p, _)) => text.push_str(&zerosched_ir::listing::program(&p)),
                Err(e) => {
                    let _ = writeln!(text, "error: {e}\n");
                }
            }
        }
        insta::assert_snapshot!(format!("listing_{}", snapshot_name(path)), text);
    }
}

#[test]
fn scheduled_facts() {
    let mut inputs = common::files("tests/fixtures", &[".json"]);
    for name in ["llama70b_l8", "mixtral8x7b_l2"] {
        inputs.push(common::root().join(format!("benches/data/{name}.program.json.gz")));
    }
    for path in &inputs {
        let bytes = zerosched_api::io::read_bytes(path).expect("fixture reads");
        let program = zerosched_ir::import(&bytes).expect("fixture imports");
        let layer = zerosched_api::budget::layer_bytes(&program, 0, 8);
        // Unlimited, two layers' worth, and one layer's worth (infeasible for some).
        let mut budgets = vec![u64::MAX];
        if layer > 0 {
            budgets.extend([2 * layer, layer]);
        }
        let mut text = String::new();
        for budget in budgets {
            for scheduler in NAMES {
                let shown = if budget == u64::MAX {
                    "none".to_owned()
                } else {
                    budget.to_string()
                };
                let _ = writeln!(text, "## {scheduler}, budget {shown}");
                match schedule(&bytes, scheduler, budget) {
                    Ok((p, cx)) => text.push_str(&facts(&p, &cx)),
                    Err(e) => {
                        let _ = writeln!(text, "  error: {e}");
                    }
                }
            }
        }
        insta::assert_snapshot!(format!("facts_{}", snapshot_name(path)), text);
    }
}
