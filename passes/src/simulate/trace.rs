//! The simulated timeline as a Chrome / Perfetto trace (`chrome://tracing`, ui.perfetto.dev).
//!
//! One process; thread 0 is the compute stream (kernels, and stalls at waits), thread 1 the
//! communication stream (one slice per collective); two counters follow gathered and total
//! memory. Times are in µs. The text is written by hand, one event a line, so that its bytes
//! depend only on the simulation (no map ordering, no float formatting beyond Rust's
//! shortest round-trip `Display`).

use super::{CommSpan, GraphSim, Span};
use crate::cost::Collective;
use crate::ops::{self, CommOp};
use zerosched_ir::Graph;

const COMPUTE: u32 = 0;
const COMM: u32 = 1;

/// The trace of `graphs` as `sims` simulated them (pairwise, e.g. a program's graphs and
/// `ProgramSim::graphs`; a single graph with `std::slice::from_ref`).
pub fn chrome_trace(graphs: &[Graph], sims: &[GraphSim]) -> Vec<u8> {
    let mut w = Writer::default();
    w.event(r#""name":"process_name","ph":"M","pid":0,"args":{"name":"zerosched"}"#);
    for (tid, name) in [(COMPUTE, "compute"), (COMM, "communication")] {
        w.event(&format!(
            r#""name":"thread_name","ph":"M","pid":0,"tid":{tid},"args":{{"name":"{name}"}}"#
        ));
    }
    for (g, sim) in graphs.iter().zip(sims) {
        let offset = sim.timeline.offset_ms;
        for span in &sim.timeline.compute {
            compute_event(&mut w, g, span, offset);
        }
        for span in &sim.timeline.comm {
            comm_event(&mut w, g, span, offset);
        }
        for s in &sim.timeline.memory {
            for (name, bytes) in [("gathered memory", s.gathered), ("total memory", s.total)] {
                let mut e = format!(r#""name":"{name}","ph":"C","pid":0,"ts":"#);
                e.push_str(&us(offset + s.t_ms));
                e.push_str(&format!(r#","args":{{"bytes":{bytes}}}"#));
                w.event(&e);
            }
        }
    }
    w.finish()
}

fn compute_event(w: &mut Writer, g: &Graph, span: &Span, offset: f64) {
    let n = g.node(span.node);
    let cat = match CommOp::of(n) {
        Some(_) => "stall",
        None => "compute",
    };
    let mut e = slice(&n.name, cat, COMPUTE, span.start_ms, span.end_ms, offset);
    e.push_str(r#","args":{"graph":"#);
    e.push_str(&json_str(g.label()));
    e.push_str(r#","target":"#);
    e.push_str(&json_str(&n.target));
    e.push('}');
    w.event(&e);
}

fn comm_event(w: &mut Writer, g: &Graph, span: &CommSpan, offset: f64) {
    let first = span.nodes.first().map(|&id| g.node(id));
    let name = match (span.nodes.len(), first.and_then(ops::bucket)) {
        (2.., Some(b)) => format!("bucket {b}"),
        _ => first.map(|n| n.name.clone()).unwrap_or_default(),
    };
    let cat = match span.kind {
        Collective::AllGather => "all_gather",
        Collective::ReduceScatter => "reduce_scatter",
        Collective::AllReduce => "all_reduce",
    };
    let mut e = slice(&name, cat, COMM, span.start_ms, span.end_ms, offset);
    e.push_str(r#","args":{"graph":"#);
    e.push_str(&json_str(g.label()));
    e.push_str(&format!(r#","bytes":{},"params":["#, span.bytes));
    for (k, &id) in span.nodes.iter().enumerate() {
        if k > 0 {
            e.push(',');
        }
        e.push_str(&json_str(ops::param_name(g.node(id)).unwrap_or("")));
    }
    e.push_str("]}");
    w.event(&e);
}

/// The common fields of an "X" (complete) event, without its args.
fn slice(name: &str, cat: &str, tid: u32, start: f64, end: f64, offset: f64) -> String {
    format!(
        r#""name":{},"cat":"{cat}","ph":"X","pid":0,"tid":{tid},"ts":{},"dur":{}"#,
        json_str(name),
        us(offset + start),
        us(end - start),
    )
}

/// Milliseconds as a JSON number of µs; a non-finite time (a cost model with zero bandwidth)
/// becomes 0 rather than invalid JSON.
fn us(ms: f64) -> String {
    let t = ms * 1e3;
    if t.is_finite() {
        format!("{t}")
    } else {
        "0".to_owned()
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[derive(Default)]
struct Writer {
    out: String,
    events: usize,
}

impl Writer {
    /// Appends one event from its fields (the text between the braces).
    fn event(&mut self, fields: &str) {
        self.out
            .push_str(if self.events == 0 { "\n" } else { ",\n" });
        self.out.push('{');
        self.out.push_str(fields);
        self.out.push('}');
        self.events += 1;
    }

    fn finish(self) -> Vec<u8> {
        format!(
            "{{\"traceEvents\":[{}\n],\"displayTimeUnit\":\"ms\"}}\n",
            self.out
        )
        .into_bytes()
    }
}
