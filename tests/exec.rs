//! The CPU executor proves schedules with real numbers: every f32 fixture, forward and
//! backward, original graph on one rank against the scheduled graph (every scheduler) on 2
//! and 4 ranks with the same per-rank inputs.
//!
//! Equalities, all bitwise (gathering, keeping and reusing never change the order of any
//! arithmetic, so no tolerance is needed anywhere):
//! - every output that is not a gradient or a shard: rank r's output equals the one-rank run of
//!   rank r's inputs;
//! - a returned shard of a sharded parameter, reassembled over the ranks, equals the full
//!   parameter the original returns;
//! - a gradient after reduce-scatter, reassembled over the ranks, equals the sum of the
//!   original graph's gradients over the ranks' inputs, summed in rank order (as the reduction
//!   sums);
//! - the measured peak of gathered-parameter bytes equals the simulator's `peak_gathered_bytes`
//!   and the checker's `peak_gathered` for that schedule.

use zerosched::exec::cpu::{Cpu, Tensor, sum_in_rank_order};
use zerosched::exec::inputs::Inputs;
use zerosched::exec::world::{run_program, unshard};
use zerosched::exec::{ExecError, ExecOptions, Executor, ProgramRun};
use zerosched_ir::{Graph, Program};
use zerosched_passes::checker::{CheckOptions, check_program};
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleOptions};
use zerosched_passes::simulate::{SimOptions, simulate_program};

const SEED: u64 = 7;

fn fixture(name: &str) -> Program {
    let path = format!("{}/tests/fixtures/{name}.json", env!("CARGO_MANIFEST_DIR"));
    zerosched::io::read_program(std::path::Path::new(&path)).expect("fixture")
}

fn schedule(p: &Program, scheduler: &str, world: u32) -> Program {
    let mut s = p.clone();
    let opts = PipelineOptions {
        scheduler: scheduler.to_owned(),
        schedule: ScheduleOptions {
            world_size: world,
            ..ScheduleOptions::default()
        },
        verify: true,
        ..PipelineOptions::default()
    };
    pipeline::run(&pipeline::standard(), &mut s, &opts).expect("pipeline");
    s
}

fn run(
    p: &Program,
    world: u32,
    streams: Option<Vec<u32>>,
) -> Result<ProgramRun<Tensor>, ExecError> {
    let inputs = Inputs {
        data_streams: streams,
        ..Inputs::new(SEED)
    };
    let mut exec = Executor::new(Cpu, ExecOptions { world_size: world });
    run_program(&mut exec, p, &inputs)
}

/// One-rank runs of the original, one per rank's data stream.
fn references(p: &Program, world: u32) -> Vec<ProgramRun<Tensor>> {
    (0..world)
        .map(|r| run(p, 1, Some(vec![r])).expect("reference run"))
        .collect()
}

fn shape(t: &Tensor) -> Vec<usize> {
    t.shape().to_vec()
}

fn assert_same(what: &str, got: &Tensor, want: &Tensor) {
    assert!(
        got.bitwise_eq(want),
        "{what}: {:?} {} vs {:?} {}, max |diff| {}",
        got.shape(),
        got.dtype,
        want.shape(),
        want.dtype,
        got.max_abs_diff(want)
    );
}

/// Whether output `slot` of scheduled graph `g` returns a sharded parameter's placeholder.
fn returns_shard(g: &Graph, slot: usize) -> bool {
    let inserted = g
        .nodes()
        .any(|(_, n)| zerosched_ir::comm::CommOp::of(n).is_some());
    g.output_values()
        .get(slot)
        .and_then(|a| a.as_node())
        .and_then(|&v| g.param_of(v))
        .is_some_and(|p| inserted && !p.persistent)
}

fn compare(label: &str, refs: &[ProgramRun<Tensor>], sched: &Program, world: u32) {
    let got = run(sched, world, None).unwrap_or_else(|e| panic!("{label}: {e}"));
    let sim = simulate_program(
        sched,
        &SimOptions {
            world_size: world,
            ..SimOptions::default()
        },
    );
    let checked = check_program(
        sched,
        &CheckOptions {
            budget: u64::MAX,
            world_size: world,
        },
    )
    .unwrap_or_else(|v| panic!("{label}: checker: {v}"));
    let mut cpu = Cpu;
    for (gi, g) in sched.graphs.iter().enumerate() {
        let gr = &got.graphs[gi];
        let grad_slots: Vec<usize> = g.grads.iter().map(|gr| gr.output_index as usize).collect();
        let slots = refs[0].graphs[gi].outputs[0].len();
        assert_eq!(gr.outputs[0].len(), slots, "{label}: output count");
        for slot in 0..slots {
            let what = format!("{label} {} output {slot}", g.label());
            let want: Vec<Option<&Tensor>> = refs
                .iter()
                .map(|r| r.graphs[gi].outputs[0][slot].as_ref())
                .collect();
            let have: Vec<Option<&Tensor>> = gr.outputs.iter().map(|o| o[slot].as_ref()).collect();
            if want[0].is_none() {
                assert!(have.iter().all(Option::is_none), "{what}: expected None");
                continue;
            }
            let have: Vec<&Tensor> = have.into_iter().map(|t| t.expect(&what)).collect();
            let want: Vec<&Tensor> = want.into_iter().map(|t| t.expect(&what)).collect();
            if grad_slots.contains(&slot) {
                let sum = sum_in_rank_order(&want).expect("sum");
                let full = unshard(&mut cpu, &have, &shape(&sum)).expect("unshard");
                assert_same(&format!("{what} (gradient)"), &full, &sum);
            } else if returns_shard(g, slot) {
                let full = unshard(&mut cpu, &have, &shape(want[0])).expect("unshard");
                assert_same(&format!("{what} (shard)"), &full, want[0]);
            } else {
                for r in 0..world as usize {
                    assert_same(&format!("{what} rank {r}"), have[r], want[r]);
                }
            }
        }
        let measured = gr.memory.iter().map(|c| c.peak_gathered).max().unwrap_or(0);
        assert!(
            gr.memory.iter().all(|c| c.peak_gathered == measured),
            "{label}: ranks differ"
        );
        assert_eq!(
            measured,
            sim.graphs[gi].summary.peak_gathered_bytes,
            "{label} {}: simulator",
            g.label()
        );
        assert_eq!(
            measured,
            checked[gi].peak_gathered,
            "{label} {}: checker",
            g.label()
        );
        if g.nodes()
            .any(|(_, n)| zerosched_ir::comm::CommOp::of(n).is_some())
        {
            assert!(measured > 0, "{label}: nothing gathered");
        }
    }
}

fn prove(name: &str, worlds: &[u32], schedulers: &[&str]) {
    let p = fixture(name);
    let max = worlds.iter().copied().max().unwrap_or(1);
    let refs = references(&p, max);
    for &world in worlds {
        for &s in schedulers {
            compare(
                &format!("{name} {s} x{world}"),
                &refs[..world as usize],
                &schedule(&p, s, world),
                world,
            );
        }
    }
}

#[test]
fn llama_program_all_schedulers() {
    prove("llama.program", &[2, 4], NAMES);
}

#[test]
fn llama_forward_and_backward_alone() {
    prove("llama_fwd_0", &[2, 4], NAMES);
    prove("llama_bwd_0", &[2, 4], NAMES);
}

#[test]
fn gpt2_program_all_schedulers() {
    prove("gpt2.program", &[2, 4], NAMES);
}

#[test]
fn gpt2_forward_and_backward_alone() {
    prove("gpt2_fwd_0", &[2, 4], &["prefetch"]);
    prove("gpt2_bwd_0", &[2, 4], &["prefetch"]);
}

#[test]
fn qwen2_moe_batched_program() {
    prove("qwen2_moe_batched.program", &[2], NAMES);
}

#[test]
fn qwen2_moe_batched_forward_and_backward_alone() {
    prove("qwen2_moe_batched_fwd_0", &[4], &["prefetch"]);
    prove("qwen2_moe_batched_bwd_0", &[2], &["jit"]);
}

/// The loss is what it should be for random weights: about ln(vocab).
#[test]
fn loss_is_near_log_vocab() {
    let r = run(&fixture("llama_fwd_0"), 1, None).expect("run");
    let loss = r.graphs[0].outputs[0][0]
        .as_ref()
        .expect("loss")
        .to_f64_vec()[0];
    assert!((loss - 256f64.ln()).abs() < 0.1, "loss {loss}");
}

/// A release moved before a use of the gathered storage (its `after` edited so the order is
/// still topological): the checker rejects it, and the executor, run without the checker,
/// fails at the first read of the released buffer, naming that node.
#[test]
fn broken_schedule_fails_loudly() {
    let mut p = schedule(&fixture("llama_fwd_0"), "jit", 2);
    let g = &mut p.graphs[0];
    let pos = g.positions();
    let (release, wait, uses) = g
        .nodes()
        .filter(|(_, n)| n.target == zerosched_ir::comm::RELEASE)
        .map(|(id, n)| {
            let wait = *n.args[0].as_node().expect("wait");
            (id, wait, zerosched_ir::comm::release_after(n))
        })
        .find(|(_, _, uses)| !uses.is_empty())
        .expect("a release with uses");
    let first_use = *uses.iter().min_by_key(|&&u| pos[u]).expect("use");
    let mut kwargs = g.node(release).kwargs.clone();
    kwargs.insert("after".into(), zerosched_ir::Arg::List(vec![]));
    let args = g.node(release).args.clone();
    g.set_args(release, args, kwargs).expect("edit");
    let mut order: Vec<_> = g
        .order()
        .iter()
        .copied()
        .filter(|&n| n != release)
        .collect();
    let at = order.iter().position(|&n| n == wait).expect("wait") + 1;
    order.insert(at, release);
    g.set_order(order).expect("still a topological order");
    zerosched_ir::verify::program(&p).expect("structurally valid");
    assert!(
        check_program(
            &p,
            &CheckOptions {
                budget: u64::MAX,
                world_size: 2
            }
        )
        .is_err()
    );
    // The first real use after the release, in the new order: a view of the wait (a permute)
    // is not a real use, so it may be the view's consumer.
    let err = run(&p, 2, None).expect_err("must fail");
    let msg = err.to_string();
    match &err {
        ExecError::UseAfterFree(u) => {
            assert_eq!(u.how, "released", "{msg}");
            assert_eq!(u.by, p.graphs[0].node(release).name, "{msg}");
            let reader = p.graphs[0].node_by_name(&u.node).expect("named node");
            let pos = p.graphs[0].positions();
            assert!(
                pos[reader] <= pos[first_use] || uses.contains(&reader),
                "{msg}"
            );
        }
        other => panic!("wrong error: {other}"),
    }
    assert!(msg.contains("released by"), "{msg}");
}

/// An op the backend lacks is refused before anything runs, naming op and node.
#[test]
fn unsupported_op_is_named_before_running() {
    let mut p = fixture("llama_fwd_0");
    let g = &mut p.graphs[0];
    let (id, name) = g
        .nodes()
        .find(|(_, n)| n.target == "aten.rsqrt.default")
        .map(|(id, n)| (id, n.name.clone()))
        .expect("rsqrt");
    g.set_target(id, "aten.frobnicate.default");
    let err = run(&p, 1, None).expect_err("must refuse");
    let msg = err.to_string();
    assert!(matches!(err, ExecError::Unsupported { .. }), "{msg}");
    assert!(
        msg.contains("aten.frobnicate.default") && msg.contains(&name),
        "{msg}"
    );
}

/// Same seed, same bits; another seed, other data.
#[test]
fn inputs_are_seeded() {
    let p = fixture("gpt2_fwd_0");
    let a = run(&p, 1, None).expect("run");
    let b = run(&p, 1, None).expect("run");
    let loss = |r: &ProgramRun<Tensor>| r.graphs[0].outputs[0][0].clone().expect("loss");
    assert!(loss(&a).bitwise_eq(&loss(&b)));
    let inputs = Inputs::new(SEED + 1);
    let mut exec = Executor::new(Cpu, ExecOptions { world_size: 1 });
    let c = run_program(&mut exec, &p, &inputs).expect("run");
    assert!(!loss(&a).bitwise_eq(&loss(&c)));
}

/// A dry run (sizes only) of a scheduled 70B-shape program measures the simulator's peaks on
/// every rank: gathered bytes exactly; total bytes up to the padding of reduce-scatter shards
/// (the executor holds `ceil(numel / N)` elements, the simulator counts `ceil(bytes / N)`
/// bytes: at most one element less per reduction).
#[test]
fn dry_run_measures_the_simulated_peaks() {
    use zerosched::exec::dry::Dry;
    let path = format!(
        "{}/benches/data/llama70b_l8.program.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let p = zerosched::io::read_program(std::path::Path::new(&path)).expect("bench data");
    let world = 8;
    let s = schedule(&p, "prefetch", world);
    let mut exec = Executor::new(Dry, ExecOptions { world_size: world });
    let got = run_program(&mut exec, &s, &Inputs::new(0)).expect("dry run");
    let sim = simulate_program(
        &s,
        &SimOptions {
            world_size: world,
            ..SimOptions::default()
        },
    );
    for (g, want) in got.graphs.iter().zip(&sim.graphs) {
        for c in &g.memory {
            assert_eq!(
                c.peak_gathered, want.summary.peak_gathered_bytes,
                "{}",
                g.graph
            );
            let slack = 4 * want.summary.reductions as u64;
            assert!(
                c.peak.abs_diff(want.summary.peak_total_bytes) <= slack,
                "{}: {} vs {}",
                g.graph,
                c.peak,
                want.summary.peak_total_bytes
            );
        }
    }
}
