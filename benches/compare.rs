//! Side-by-side comparison of the schedulers on the exported 70B-class and MoE programs, in one
//! run: schedule quality (simulated step time against the lower bound, exposed communication,
//! peak gathered memory) at budgets of 1, 2 and 4 decoder layers' worth of parameters, and
//! the time each scheduler takes. Prints markdown tables.
//!
//! `cargo bench --bench compare` (add `-- --quick` for one repetition per timing).

// The allocator the command line uses, so that the figures are the command line's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::Path;
use std::time::{Duration, Instant};
use zerosched_ir::Program;
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleOptions, by_name};
use zerosched_passes::simulate::{SimOptions, simulate_program};

const PROGRAMS: &[&str] = &["llama70b_l8", "llama70b_l80", "mixtral8x7b_l24"];
const WORLD: u32 = 8;

fn load(name: &str) -> Option<(Vec<u8>, Program)> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("benches/data/{name}.program.json.gz"));
    let bytes = zerosched_api::io::read_bytes(&path).ok()?;
    let p = zerosched_ir::import(&bytes).ok()?;
    Some((bytes, p))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// One timed run of `f` on a fresh input from `setup`; making the input and dropping what `f`
/// returns stay outside the timing.
fn time_once<T, R>(setup: &mut impl FnMut() -> T, f: &mut impl FnMut(T) -> R) -> Duration {
    let input = setup();
    let t = Instant::now();
    let out = f(input);
    let d = t.elapsed();
    drop(out);
    d
}

/// Scheduling times of one program.
struct Timing<'a> {
    name: &'a str,
    /// After insertion.
    nodes: usize,
    per: Vec<(&'a str, Duration)>,
}

/// Something to time, run by [`interleaved`].
type Timed<'a> = Box<dyn FnMut() -> Duration + 'a>;

/// Medians of the `runs`, timed in `rounds` rounds that each run every one of them in turn,
/// as often as it takes to fill about the time the slowest takes once (at most 25 times), so
/// that figures compared in a ratio see the same load on a shared machine.
fn interleaved(rounds: usize, runs: &mut [Timed]) -> Vec<Duration> {
    let once: Vec<Duration> = runs.iter_mut().map(|f| f()).collect();
    let slowest = once.iter().max().copied().unwrap_or_default();
    let per_round: Vec<usize> = once
        .iter()
        .map(|d| (slowest.as_secs_f64() / d.as_secs_f64().max(1e-9)).clamp(1.0, 25.0) as usize)
        .collect();
    let mut samples = vec![Vec::new(); runs.len()];
    for _ in 0..rounds {
        for ((f, &k), out) in runs.iter_mut().zip(&per_round).zip(&mut samples) {
            out.extend((0..k).map(|_| f()));
        }
    }
    samples.into_iter().map(median).collect()
}

fn opts(scheduler: &str, budget: u64) -> PipelineOptions {
    PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            world_size: WORLD,
            ..ScheduleOptions::default()
        },
        scheduler: scheduler.to_owned(),
        verify: false,
        ..PipelineOptions::default()
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 1 } else { 7 };
    println!(
        "machine: {} cores; figures compared in a ratio are timed side by side, medians over {rounds} rounds\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("## Schedule quality (simulated, world size {WORLD}, default H200 cost model)\n");
    println!(
        "| program | budget | scheduler | step ms | lower bound ms | step / bound | exposed comm ms | peak gathered GiB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut timing = Vec::new();
    let mut wholes = Vec::new();
    for &name in PROGRAMS {
        let Some((bytes, base)) = load(name) else {
            println!("| {name} | data missing | | | | | | |");
            continue;
        };
        let layer = zerosched_api::budget::layer_bytes(&base, 0, WORLD);
        for layers in [1u64, 2, 4] {
            for &s in NAMES {
                let mut p = base.clone();
                let mut o = opts(s, layers * layer);
                o.verify = true;
                match pipeline::run(&pipeline::standard(), &mut p, &o) {
                    Ok(_) => {
                        let sim = simulate_program(
                            &p,
                            &SimOptions {
                                world_size: WORLD,
                                cost: o.schedule.cost.clone(),
                            },
                        );
                        let t = &sim.total;
                        println!(
                            "| {name} | {layers} layer{} | {s} | {:.1} | {:.1} | {:.3} | {:.1} | {:.2} |",
                            if layers == 1 { "" } else { "s" },
                            t.step_ms,
                            t.lower_bound_ms,
                            t.ratio,
                            t.exposed_comm_ms,
                            t.peak_gathered_bytes as f64 / (1u64 << 30) as f64
                        );
                    }
                    Err(e) => println!(
                        "| {name} | {layers} layers | {s} | error: {} | | | | |",
                        e.to_string().lines().next().unwrap_or("")
                    ),
                }
            }
        }
        // Scheduling time alone, on the inserted graphs, at two layers.
        let mut inserted = base.clone();
        let mut insert_only = opts("prefetch", 2 * layer);
        insert_only.disabled = ["schedule", "keep"].map(String::from).into();
        if pipeline::run(&pipeline::standard(), &mut inserted, &insert_only).is_err() {
            continue;
        }
        let nodes = inserted.node_count();
        // Each scheduler on fresh copies of the inserted graphs, side by side.
        let (scheds, mut runs): (Vec<&str>, Vec<Timed>) = NAMES
            .iter()
            .filter_map(|&s| {
                let sched = by_name(s)?;
                let o = opts(s, 2 * layer).schedule;
                let inserted = &inserted;
                let mut setup = move || inserted.graphs.clone();
                let mut run = move |mut graphs: Vec<zerosched_ir::Graph>| {
                    for g in &mut graphs {
                        let _ = sched.schedule(g, &o);
                    }
                    graphs
                };
                Some((
                    s,
                    Box::new(move || time_once(&mut setup, &mut run)) as Timed,
                ))
            })
            .unzip();
        let per = scheds
            .into_iter()
            .zip(interleaved(rounds, &mut runs))
            .collect();
        drop(runs);
        timing.push(Timing { name, nodes, per });
        wholes.push((bytes, 2 * layer));
    }
    // The whole pipeline on every program (`wholes` lines up with `timing`), side by side, for
    // the growth from 8 to 80 layers.
    let mut runs: Vec<Timed> = wholes
        .iter()
        .map(|(bytes, budget)| {
            let budget = *budget;
            let mut run = move |()| {
                let mut p = zerosched_ir::import(bytes).ok()?;
                pipeline::run(&pipeline::standard(), &mut p, &opts("prefetch", budget)).ok()?;
                let check = zerosched_passes::checker::CheckOptions {
                    budget,
                    world_size: WORLD,
                    ..Default::default()
                };
                zerosched_passes::checker::check_program(&p, &check).ok()?;
                Some((std::hint::black_box(zerosched_ir::json::export(&p)), p))
            };
            Box::new(move || time_once(&mut || (), &mut run)) as Timed
        })
        .collect();
    let whole_times = interleaved(rounds, &mut runs);
    drop(runs);
    let whole = |n: &str| {
        timing
            .iter()
            .zip(&whole_times)
            .find(|(t, _)| t.name == n)
            .map(|(_, d)| d.as_secs_f64())
    };
    println!("\n## Time (2-layer budget)\n");
    println!(
        "| program | nodes after insertion | scheduler | schedule time | whole pipeline (import, insert, schedule, keep, check, export) |"
    );
    println!("|---|---|---|---|---|");
    for Timing { name, nodes, per } in &timing {
        for (s, d) in per {
            let w = match whole(name) {
                Some(t) if *s == "prefetch" => format!("{:.1} ms", t * 1e3),
                _ => String::new(),
            };
            println!(
                "| {name} | {nodes} | {s} | {:.2} ms | {w} |",
                d.as_secs_f64() * 1e3
            );
        }
        let get = |n: &str| {
            per.iter()
                .find(|(s, _)| *s == n)
                .map(|(_, d)| d.as_secs_f64())
        };
        if let (Some(dc), Some(ours)) = (get("deepcompile"), get("prefetch")) {
            println!(
                "| {name} | | deepcompile / prefetch | {:.0}× | |",
                dc / ours
            );
        }
    }
    if let (Some(l8), Some(l80)) = (whole("llama70b_l8"), whole("llama70b_l80")) {
        println!(
            "\nwhole pipeline, 80 layers over 8 layers: {:.1}×",
            l80 / l8
        );
    }
}
