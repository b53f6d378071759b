//! Guarantee 5, across the graphs of a program: a kept parameter is reused by exactly one later
//! graph and gathered by nothing in between; every reuse has a keep in an earlier graph.

use super::{Located, Violation};
use std::collections::BTreeMap;
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Location, Program};

pub(super) fn check(p: &Program, out: &mut Vec<Located>) {
    let push = |out: &mut Vec<Located>, graph: usize, node: &str, violation| {
        out.push(Located {
            location: Location::node(p.graphs[graph].label(), node),
            violation,
        });
    };
    // Per parameter, the keep not yet reused: (graph index, keep node name).
    let mut kept: BTreeMap<&str, (usize, &str)> = BTreeMap::new();
    for (gi, g) in p.graphs.iter().enumerate() {
        for (_, n) in g.nodes() {
            let (Some(op), Some(param)) = (CommOp::of(n), comm::param_name(n)) else {
                continue;
            };
            let param_owned = || param.to_owned();
            match op {
                CommOp::Keep => {
                    if let Some((kg, earlier)) = kept.insert(param, (gi, &n.name)) {
                        let violation = Violation::KeptNeverReused {
                            param: param_owned(),
                        };
                        push(out, kg, earlier, violation);
                    }
                }
                CommOp::Reuse => match kept.get(param) {
                    Some(&(kg, _)) if kg < gi => {
                        kept.remove(param);
                    }
                    _ => {
                        let violation = Violation::ReuseWithoutKeep {
                            param: param_owned(),
                        };
                        push(out, gi, &n.name, violation);
                    }
                },
                CommOp::AllGather => {
                    if let Some(&(kg, keep)) = kept.get(param) {
                        let violation = Violation::GatheredWhileKept {
                            param: param_owned(),
                            keep: keep.to_owned(),
                            graph: p.graphs[kg].label().to_owned(),
                        };
                        push(out, gi, &n.name, violation);
                    }
                }
                _ => {}
            }
        }
    }
    for (param, (gi, keep)) in kept {
        let violation = Violation::KeptNeverReused {
            param: param.to_owned(),
        };
        push(out, gi, keep, violation);
    }
}
