//! Selective unsharding: keeping a parameter gathered from the forward to the backward.

mod common;

use zerosched_passes::ops;
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;

fn run(budget: u64) -> (zerosched_ir::Program, pipeline::Context) {
    let mut p = common::train_step(6, 64, 1.0);
    let opts = PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            ..ScheduleOptions::default()
        },
        verify: true,
        ..PipelineOptions::default()
    };
    let cx = pipeline::run(&pipeline::standard(), &mut p, &opts).expect("pipeline");
    (p, cx)
}

const W: u64 = 64 * 64 * 4;

fn count(p: &zerosched_ir::Program, graph: usize, target: &str) -> usize {
    p.graphs[graph]
        .nodes()
        .filter(|(_, n)| n.target == target)
        .count()
}

#[test]
fn with_room_the_last_layer_stays_gathered_into_the_backward() {
    let (p, cx) = run(4 * W);
    assert!(
        cx.keep.kept.contains(&"layers.5.weight".to_owned()),
        "kept: {:?}",
        cx.keep.kept
    );
    assert_eq!(count(&p, 0, ops::KEEP), cx.keep.kept.len());
    assert_eq!(count(&p, 1, ops::REUSE), cx.keep.kept.len());
    assert_eq!(count(&p, 1, ops::ALLGATHER), 6 - cx.keep.kept.len());
    assert!(cx.keep.saved_ms > 0.0);
}

#[test]
fn at_the_smallest_budget_only_the_layer_at_the_boundary_is_kept() {
    // One layer's worth: nothing else is gathered after the forward's last release or before
    // the backward's first gather, so exactly that one parameter fits.
    let (p, cx) = run(W);
    assert_eq!(cx.keep.kept, vec!["layers.5.weight".to_owned()]);
    assert_eq!(count(&p, 1, ops::ALLGATHER), 5);
}

#[test]
fn keeping_is_switched_off_by_name() {
    let mut p = common::train_step(3, 64, 1.0);
    let mut opts = PipelineOptions {
        verify: true,
        ..PipelineOptions::default()
    };
    opts.disabled.insert("keep".into());
    let cx = pipeline::run(&pipeline::standard(), &mut p, &opts).expect("pipeline");
    assert!(cx.keep.kept.is_empty());
    assert_eq!(count(&p, 1, ops::REUSE), 0);
}
