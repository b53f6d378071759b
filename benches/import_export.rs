//! Import and export of a large program, JSON and binary.
//!
//! Input: `benches/data/llama70b_l80.program.json.gz` (the exported 80-layer Llama-70B
//! training step: 23,557 nodes, 7.2 MB of JSON), decompressed before anything is timed; JSON
//! import reads those exact bytes, binary import their binary export. Should it be missing,
//! the largest document under `benches/data` or `tests/fixtures` and a synthesized 80-layer
//! Llama-shaped program (`zerosched_ir::testing::llama_like(80)`). Set
//! `ZEROSCHED_BENCH_INPUT=path` to pick a file. The header says what was used.
//!
//! Besides criterion's figures it prints a summary per input: median JSON import throughput
//! (target ≥ 100 MB/s), binary-import speedup over JSON (target ≥ 5×), and memory per node
//! (bytes live after one JSON import, and the peak during it, from a counting allocator).
//! Import times are to a verified program in hand; dropping it afterwards is timed apart
//! (the same for both encodings: they build the same program).
//!
//! Imports are timed two ways. *Recycled*: each program is dropped before the next import,
//! so the allocator hands out memory it has just had back, as in a long-running compiler
//! process; this is the importers' own cost, and the one the target is judged on. *Held*:
//! programs are kept in batches of [`BATCH`] and dropped together, as criterion's
//! `iter_with_large_drop` keeps each batch (its `import-fresh` groups), so most imports write
//! memory that was not in use a moment before and that the allocator may first have to get
//! back from the system, cleared. That costs both importers about the same milliseconds for
//! the same program, and on a virtual machine it varies severalfold from run to run. The
//! summary runs each way in interleaved rounds, so that each ratio compares runs made under
//! the same conditions; criterion times each group on its own, minutes apart.
//!
//! `cargo bench --bench import_export`

use criterion::{BenchmarkId, Criterion, Throughput};
use mimalloc::MiMalloc;
use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use zerosched_ir::{Program, binary, json};

/// The allocator the command line uses (mimalloc), counting live and peak bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Counting costs atomics on every allocation: it is on only around the memory measurement,
/// so that the timings see mimalloc as the command line has it. Frees of blocks allocated while it was
/// off are not subtracted either, so `LIVE` stays exact for what was counted.
static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn counting() -> bool {
    COUNTING.load(Relaxed)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { MiMalloc.alloc(layout) };
        if !p.is_null() && counting() {
            let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { MiMalloc.dealloc(ptr, layout) };
        if counting() {
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() && counting() {
            if new_size >= layout.size() {
                let now =
                    LIVE.fetch_add(new_size - layout.size(), Relaxed) + new_size - layout.size();
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const REAL: &str = "benches/data/llama70b_l80.program.json.gz";

struct Input {
    label: String,
    json: Vec<u8>,
    bin: Vec<u8>,
    nodes: usize,
}

impl Input {
    fn new(label: String, program: &Program) -> Input {
        Input {
            label,
            json: json::export(program),
            bin: binary::export(program),
            nodes: program.node_count(),
        }
    }

    /// A JSON file is imported from its own bytes; a binary one from its JSON export.
    fn from_file(path: &Path) -> Input {
        let bytes = zerosched_api::io::read_bytes(path).expect("the bench input reads");
        let program = zerosched_ir::import(&bytes).expect("the bench input imports");
        let mut input = Input::new(path.display().to_string(), &program);
        if !binary::has_magic(&bytes) {
            input.json = bytes;
        }
        input
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The largest `.json` / `.json.gz` / `.zsg` document under the given directories.
fn largest(dirs: &[&str]) -> Option<PathBuf> {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut stack: Vec<PathBuf> = dirs.iter().map(|d| root().join(d)).collect();
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = p.to_string_lossy();
            if p.is_dir() {
                stack.push(p);
            } else if [".json", ".json.gz", ".zsg"]
                .iter()
                .any(|x| name.ends_with(x))
            {
                let len = e.metadata().map_or(0, |m| m.len());
                if best.as_ref().is_none_or(|(b, _)| len > *b) {
                    best = Some((len, p));
                }
            }
        }
    }
    best.map(|(_, p)| p)
}

fn inputs() -> Vec<Input> {
    if let Some(p) = std::env::var_os("ZEROSCHED_BENCH_INPUT") {
        return vec![Input::from_file(Path::new(&p))];
    }
    let real = root().join(REAL);
    if real.exists() {
        return vec![Input::from_file(&real)];
    }
    println!("{REAL} is not there yet: falling back");
    let mut out = Vec::new();
    if let Some(p) = largest(&["benches/data", "tests/fixtures"]) {
        out.push(Input::from_file(&p));
    }
    out.push(Input::new(
        "synthesized testing::llama_like(80)".into(),
        &zerosched_ir::testing::llama_like(80),
    ));
    out
}

/// Programs kept alive together when timing imports that are held (see the top).
const BATCH: usize = 8;

/// Interleaved rounds per way of timing imports: a load that comes and goes on a shared
/// machine spoils a few rounds, not the median of them.
const ROUNDS: u32 = 7;

/// Median wall time of `f` over enough runs to fill about `budget`; what `f` returns is
/// dropped outside the timed region, at once (`keep` 1) or `keep` results at a time.
fn median<T>(budget: Duration, keep: usize, mut f: impl FnMut() -> T) -> Duration {
    let start = Instant::now();
    drop(black_box(f()));
    let once = start.elapsed().max(Duration::from_nanos(1));
    let runs = (budget.as_secs_f64() / once.as_secs_f64()).clamp(5.0, 10_000.0) as usize;
    let mut kept = Vec::with_capacity(keep);
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            let out = black_box(f());
            let elapsed = t.elapsed();
            kept.push(out);
            if kept.len() >= keep {
                kept.clear();
            }
            elapsed
        })
        .collect();
    drop(kept);
    times.sort();
    times[times.len() / 2]
}

/// Median time to drop an imported program.
fn median_drop(budget: Duration, input: &Input) -> Duration {
    let runs = 5.max((budget.as_secs_f64() / 0.05) as usize);
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let p = black_box(json::import(&input.json).unwrap());
            let t = Instant::now();
            drop(p);
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn summary(input: &Input) {
    let mb = |bytes: usize, t: Duration| bytes as f64 / 1e6 / t.as_secs_f64();
    let budget = Duration::from_secs(3);
    // Interleaved rounds, so that both encodings see the same load on a shared machine; each
    // ratio is of the medians over all rounds. The recycled rounds come first: dropping a
    // batch of programs leaves the allocator memory to return to the system, work that would
    // land in whatever import runs next.
    let (mut jis, mut bis, mut jfs, mut bfs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        jis.push(median(budget / ROUNDS, 1, || {
            json::import(&input.json).unwrap()
        }));
        bis.push(median(budget / ROUNDS, 1, || {
            binary::import(&input.bin).unwrap()
        }));
    }
    for _ in 0..ROUNDS {
        jfs.push(median(budget / ROUNDS, BATCH, || {
            json::import(&input.json).unwrap()
        }));
        bfs.push(median(budget / ROUNDS, BATCH, || {
            binary::import(&input.bin).unwrap()
        }));
    }
    let mid = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (ji, bi, jf, bf) = (mid(jis), mid(bis), mid(jfs), mid(bfs));
    let dropped = median_drop(budget / 2, input);
    let program = json::import(&input.json).unwrap();
    let je = median(budget, 1, || json::export(&program));
    let be = median(budget, 1, || binary::export(&program));
    drop(program);

    // Counted from zero with counting on: the program's own blocks, and the peak of
    // everything the import allocated at once.
    let measure = |f: &dyn Fn() -> Program| {
        LIVE.store(0, Relaxed);
        PEAK.store(0, Relaxed);
        COUNTING.store(true, Relaxed);
        let program = f();
        let (live, peak) = (LIVE.load(Relaxed), PEAK.load(Relaxed));
        drop(program);
        COUNTING.store(false, Relaxed);
        (live, peak)
    };
    let (live, peak) = measure(&|| json::import(&input.json).unwrap());
    let (_, bin_peak) = measure(&|| binary::import(&input.bin).unwrap());

    let n = input.nodes as f64;
    println!("== {}", input.label);
    println!(
        "   {} nodes; JSON {:.2} MB, binary {:.2} MB ({:.1}x smaller)",
        input.nodes,
        input.json.len() as f64 / 1e6,
        input.bin.len() as f64 / 1e6,
        input.json.len() as f64 / input.bin.len() as f64
    );
    let verdict = |ok: bool| if ok { "ok" } else { "MISSED" };
    let jmb = mb(input.json.len(), ji);
    println!(
        "   JSON import   {:>9.3} ms  {:>7.1} MB/s  ({:.0} ns/node)  target >= 100 MB/s: {}",
        ji.as_secs_f64() * 1e3,
        jmb,
        ji.as_nanos() as f64 / n,
        verdict(jmb >= 100.0)
    );
    let ratio = ji.as_secs_f64() / bi.as_secs_f64();
    println!(
        "   binary import {:>9.3} ms  {:>7.1} MB/s  ({:.0} ns/node)  {:.1}x JSON import, target >= 5x: {}",
        bi.as_secs_f64() * 1e3,
        mb(input.bin.len(), bi),
        bi.as_nanos() as f64 / n,
        ratio,
        verdict(ratio >= 5.0)
    );
    println!(
        "   held in batches of {BATCH}: JSON import {:.3} ms, binary import {:.3} ms, {:.1}x",
        jf.as_secs_f64() * 1e3,
        bf.as_secs_f64() * 1e3,
        jf.as_secs_f64() / bf.as_secs_f64()
    );
    println!(
        "   drop          {:>9.3} ms  (not in the import times; with it: {:.1}x)",
        dropped.as_secs_f64() * 1e3,
        (ji + dropped).as_secs_f64() / (bi + dropped).as_secs_f64()
    );
    println!(
        "   JSON export   {:>9.3} ms  {:>7.1} MB/s",
        je.as_secs_f64() * 1e3,
        mb(input.json.len(), je)
    );
    println!(
        "   binary export {:>9.3} ms  {:>7.1} MB/s",
        be.as_secs_f64() * 1e3,
        mb(input.bin.len(), be)
    );
    println!(
        "   memory: {:.0} B/node live after a JSON import, peak {:.0} B/node during it; binary import peak {:.0} B/node",
        live as f64 / n,
        peak as f64 / n,
        bin_peak as f64 / n
    );
}

fn bench(c: &mut Criterion, input: &Input, name: &str) {
    let program = json::import(&input.json).unwrap();
    let mut g = c.benchmark_group(name);
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Bytes(input.json.len() as u64));
    // Recycled: each program dropped, untimed, before the next import.
    let recycled = criterion::BatchSize::PerIteration;
    g.bench_function(BenchmarkId::new("json", "import"), |b| {
        b.iter_batched(
            || (),
            |()| json::import(black_box(&input.json)).unwrap(),
            recycled,
        )
    });
    // Held: criterion keeps a batch's programs until the batch ends.
    g.bench_function(BenchmarkId::new("json", "import-fresh"), |b| {
        b.iter_with_large_drop(|| json::import(black_box(&input.json)).unwrap())
    });
    g.bench_function(BenchmarkId::new("json", "export"), |b| {
        b.iter(|| json::export(black_box(&program)))
    });
    g.throughput(Throughput::Bytes(input.bin.len() as u64));
    g.bench_function(BenchmarkId::new("binary", "import"), |b| {
        b.iter_batched(
            || (),
            |()| binary::import(black_box(&input.bin)).unwrap(),
            recycled,
        )
    });
    g.bench_function(BenchmarkId::new("binary", "import-fresh"), |b| {
        b.iter_with_large_drop(|| binary::import(black_box(&input.bin)).unwrap())
    });
    g.bench_function(BenchmarkId::new("binary", "export"), |b| {
        b.iter(|| binary::export(black_box(&program)))
    });
    g.finish();
}

fn main() {
    let inputs = inputs();
    println!(
        "machine: {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // `--profile-time` (criterion's mode for profilers) skips the summary.
    if !std::env::args().any(|a| a == "--profile-time") {
        for input in &inputs {
            summary(input);
        }
    }
    let mut c = Criterion::default().configure_from_args();
    for (i, input) in inputs.iter().enumerate() {
        bench(&mut c, input, &format!("input{i}"));
    }
    c.final_summary();
}
