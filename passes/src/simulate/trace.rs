//! The simulated timeline as a Chrome / Perfetto trace (`chrome://tracing`, ui.perfetto.dev).
//!
//! One process; thread 0 is the compute stream (kernels, and stalls at waits), thread 1 the
//! communication stream (one slice per collective); two counters follow gathered and total
//! memory. Times are in µs. The text is written by hand, one event a line, so that its bytes
//! depend only on the simulation (no map ordering; floats in Rust's shortest round-trip
//! `Display`, which never uses exponents).

use super::{CommSpan, GraphSim, Span};
use crate::cost::Collective;
use crate::ops::{self, CommOp};
use std::fmt::{Result, Write};
use zerosched_ir::Graph;

const COMPUTE: u32 = 0;
const COMM: u32 = 1;

/// The trace of `graphs` as `sims` simulated them (pairwise, e.g. a program's graphs and
/// `ProgramSim::graphs`; a single graph with `std::slice::from_ref`).
pub fn chrome_trace(graphs: &[Graph], sims: &[GraphSim]) -> Vec<u8> {
    let mut out = String::new();
    // Writing into a `String` cannot fail.
    let _ = write_trace(&mut out, graphs, sims);
    out.into_bytes()
}

fn write_trace(out: &mut String, graphs: &[Graph], sims: &[GraphSim]) -> Result {
    out.push_str("{\"traceEvents\":[\n");
    out.push_str(r#"{"name":"process_name","ph":"M","pid":0,"args":{"name":"zerosched"}}"#);
    for (tid, name) in [(COMPUTE, "compute"), (COMM, "communication")] {
        write!(
            out,
            ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":{tid},\
             \"args\":{{\"name\":\"{name}\"}}}}"
        )?;
    }
    for (g, sim) in graphs.iter().zip(sims) {
        let offset = sim.timeline.offset_ms;
        for span in &sim.timeline.compute {
            compute_event(out, g, span, offset)?;
        }
        for span in &sim.timeline.comm {
            comm_event(out, g, span, offset)?;
        }
        for s in &sim.timeline.memory {
            for (name, bytes) in [("gathered memory", s.gathered), ("total memory", s.total)] {
                write!(
                    out,
                    ",\n{{\"name\":\"{name}\",\"ph\":\"C\",\"pid\":0,\"ts\":"
                )?;
                us(out, offset + s.t_ms)?;
                write!(out, ",\"args\":{{\"bytes\":{bytes}}}}}")?;
            }
        }
    }
    out.push_str("\n],\"displayTimeUnit\":\"ms\"}\n");
    Ok(())
}

fn compute_event(out: &mut String, g: &Graph, span: &Span, offset: f64) -> Result {
    let n = g.node(span.node);
    let cat = match CommOp::of(n) {
        Some(_) => "stall",
        None => "compute",
    };
    slice(
        out,
        &n.name,
        cat,
        COMPUTE,
        span.start_ms,
        span.end_ms,
        offset,
    )?;
    out.push_str(r#","args":{"graph":"#);
    json_str(out, g.label());
    out.push_str(r#","target":"#);
    json_str(out, &n.target);
    out.push_str("}}");
    Ok(())
}

fn comm_event(out: &mut String, g: &Graph, span: &CommSpan, offset: f64) -> Result {
    let first = span.nodes.first().map(|&id| g.node(id));
    let name = match (span.nodes.len(), first.and_then(ops::bucket)) {
        (2.., Some(b)) => format!("bucket {b}"),
        _ => first.map(|n| n.name.to_string()).unwrap_or_default(),
    };
    let cat = match span.kind {
        Collective::AllGather => "all_gather",
        Collective::ReduceScatter => "reduce_scatter",
        Collective::AllReduce => "all_reduce",
    };
    slice(out, &name, cat, COMM, span.start_ms, span.end_ms, offset)?;
    out.push_str(r#","args":{"graph":"#);
    json_str(out, g.label());
    write!(out, r#","bytes":{},"params":["#, span.bytes)?;
    for (k, &id) in span.nodes.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        json_str(out, ops::param_name(g.node(id)).unwrap_or(""));
    }
    out.push_str("]}}");
    Ok(())
}

/// Opens an "X" (complete) event and writes its fields up to its args.
fn slice(
    out: &mut String,
    name: &str,
    cat: &str,
    tid: u32,
    start: f64,
    end: f64,
    offset: f64,
) -> Result {
    out.push_str(",\n{\"name\":");
    json_str(out, name);
    write!(out, r#","cat":"{cat}","ph":"X","pid":0,"tid":{tid},"ts":"#)?;
    us(out, offset + start)?;
    out.push_str(r#","dur":"#);
    us(out, end - start)
}

/// Milliseconds as a JSON number of µs; a non-finite time (a cost model with zero bandwidth)
/// becomes 0 rather than invalid JSON.
fn us(out: &mut String, ms: f64) -> Result {
    let t = ms * 1e3;
    if t.is_finite() {
        write!(out, "{t}")
    } else {
        out.push('0');
        Ok(())
    }
}

fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
