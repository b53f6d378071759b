//! What a `schedule` or a `check` asks for, validated in one place for every front end: the
//! command line fills these from its flags, the Python binding from an options dict through
//! serde, so an unknown key or a bad value is refused with its name, whichever way it came.

use crate::report::Report;
use crate::summary::GraphSummary;
use serde::de::{self, Deserializer, Unexpected, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;
use zerosched_ir::{ImportError, Program};
use zerosched_passes::checker::{CheckOptions, CheckReport, Violations, check_program};
use zerosched_passes::cost::CostModel;
use zerosched_passes::pipeline::{self, Context, PassError, PipelineOptions};
use zerosched_passes::schedule::{self, ScheduleError, ScheduleOptions};
use zerosched_passes::simulate::SimOptions;

/// A request the front end could not turn into options.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("unknown pass `{name}` (passes: {known})")]
    UnknownPass { name: String, known: String },
    #[error("unknown scheduler `{name}` (schedulers: {known})")]
    UnknownScheduler { name: String, known: String },
    #[error("the world size must be at least 1")]
    WorldSize,
    /// A key or value serde refused, with the key's path (`cost.peak_flops: invalid type ...`).
    #[error("{0}")]
    Field(String),
}

/// Whatever a request can fail with, in the words the command line prints.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("not valid gzip: {0}")]
    Gzip(std::io::Error),
    #[error(transparent)]
    Import(#[from] ImportError),
    /// Boxed: a pass error is large and the other variants are small.
    #[error(transparent)]
    Pass(Box<PassError>),
    #[error("{input}: the schedule checker rejects it:\n{violations}")]
    Rejected {
        input: String,
        violations: Violations,
    },
}

impl From<PassError> for Error {
    fn from(e: PassError) -> Error {
        Error::Pass(Box::new(e))
    }
}

impl Error {
    /// For a budget no schedule fits (the gathered budget or the memory budget): the
    /// smallest of that budget that works for the whole program. For a scheduler that does not
    /// plan for memory (deepcompile ignores the budgets) that is the most its schedule reached
    /// in any graph.
    pub fn needed_budget(&self) -> Option<u64> {
        let Error::Pass(e) = self else { return None };
        match **e {
            PassError::Schedule(
                ScheduleError::OverBudget { needed, .. } | ScheduleError::OverMemory { needed, .. },
            )
            | PassError::OverBudget { needed, .. }
            | PassError::OverMemory { needed, .. } => Some(needed),
            _ => None,
        }
    }

    /// Which budget [`Error::needed_budget`] is for: `"budget"` or `"memory"`.
    pub fn needed_kind(&self) -> Option<&'static str> {
        let Error::Pass(e) = self else { return None };
        match **e {
            PassError::Schedule(ScheduleError::OverBudget { .. })
            | PassError::OverBudget { .. } => Some("budget"),
            PassError::Schedule(ScheduleError::OverMemory { .. })
            | PassError::OverMemory { .. } => Some("memory"),
            _ => None,
        }
    }
}

/// Reads a request from any serde source, naming the offending key on failure.
pub fn parse<'de, T: Deserialize<'de>, D: Deserializer<'de>>(d: D) -> Result<T, RequestError> {
    serde_path_to_error::deserialize(d).map_err(|e| RequestError::Field(e.to_string()))
}

/// Bytes in the units users write: `40GiB`, `512MiB`, `1e9`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("not a byte size: {e}"))
}

/// Reads a document's bytes in either encoding, gzip-compressed or not.
pub fn import(bytes: &[u8]) -> Result<Program, Error> {
    let bytes = crate::io::gunzip_if_needed(bytes.to_vec()).map_err(Error::Gzip)?;
    Ok(zerosched_ir::import(&bytes)?)
}

/// `zerosched schedule`: the passes and their options.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleRequest {
    /// Most bytes of gathered parameters alive at once; none for no limit.
    #[serde(deserialize_with = "budget")]
    pub budget: Option<u64>,
    /// Most bytes alive at once on a rank, everything the simulator counts (activations,
    /// gathered parameters, gradients until reduced, buffers kept from the forward).
    #[serde(deserialize_with = "budget")]
    pub memory: Option<u64>,
    /// Ranks the parameters are sharded over.
    pub world_size: u32,
    /// One of `schedule::NAMES`.
    pub scheduler: String,
    pub cost: Option<CostModel>,
    /// Passes switched off by name.
    pub disable: Vec<String>,
    /// Passes after which to keep a copy (the command line writes them out beside its output).
    #[serde(skip)]
    pub dump_after: Vec<String>,
    /// Verify the program and check the schedule after every pass.
    pub verify: bool,
}

impl Default for ScheduleRequest {
    fn default() -> ScheduleRequest {
        ScheduleRequest {
            budget: None,
            memory: None,
            world_size: 8,
            scheduler: "prefetch".to_owned(),
            cost: None,
            disable: Vec::new(),
            dump_after: Vec::new(),
            verify: true,
        }
    }
}

/// A scheduled program's companions: what the passes did, and the report.
pub struct Scheduled {
    pub context: Context,
    pub report: Report,
}

impl ScheduleRequest {
    pub fn pipeline_options(&self) -> Result<PipelineOptions, RequestError> {
        let known = pipeline::pass_names();
        if let Some(name) = self
            .disable
            .iter()
            .chain(&self.dump_after)
            .find(|n| !known.contains(&n.as_str()))
        {
            return Err(RequestError::UnknownPass {
                name: name.clone(),
                known: known.join(", "),
            });
        }
        if !schedule::NAMES.contains(&self.scheduler.as_str()) {
            return Err(RequestError::UnknownScheduler {
                name: self.scheduler.clone(),
                known: schedule::NAMES.join(", "),
            });
        }
        world_size(self.world_size)?;
        Ok(PipelineOptions {
            schedule: ScheduleOptions {
                budget: self.budget.unwrap_or(u64::MAX),
                memory: self.memory.unwrap_or(u64::MAX),
                world_size: self.world_size,
                cost: self.cost.clone().unwrap_or_default(),
            },
            scheduler: self.scheduler.clone(),
            disabled: self.disable.iter().cloned().collect(),
            dump_after: self.dump_after.iter().cloned().collect(),
            verify: self.verify,
        })
    }

    /// Runs the standard pipeline over `program` in place and reports on the result.
    pub fn run(&self, input: &str, program: &mut Program) -> Result<Scheduled, Error> {
        let opts = self.pipeline_options()?;
        let context = pipeline::run(&pipeline::standard(), program, &opts)?;
        let sim = SimOptions {
            world_size: opts.schedule.world_size,
            cost: opts.schedule.cost.clone(),
        };
        let report = Report::new(
            input,
            program,
            Some(&context),
            Some(&opts.scheduler),
            (opts.schedule.budget, opts.schedule.memory),
            &sim,
        );
        Ok(Scheduled { context, report })
    }
}

/// `zerosched check`: verification, and the schedule checker where the program is scheduled.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckRequest {
    /// The gathered-memory budget a scheduled program must respect.
    #[serde(deserialize_with = "budget")]
    pub budget: Option<u64>,
    /// The device-memory budget (every live byte, simulated) it must respect.
    #[serde(deserialize_with = "budget")]
    pub memory: Option<u64>,
    /// Ranks the parameters are sharded over (sizes gathered buffers).
    pub world_size: u32,
    /// The cost model the memory simulation times the streams with.
    pub cost: Option<CostModel>,
}

impl Default for CheckRequest {
    fn default() -> CheckRequest {
        CheckRequest {
            budget: None,
            memory: None,
            world_size: 8,
            cost: None,
        }
    }
}

/// What a check found: each graph's size, and each schedule's figures if it holds ZeRO-3 ops.
#[derive(Clone, Debug, Serialize)]
pub struct CheckSummary {
    pub input: String,
    pub graphs: Vec<GraphSummary>,
    /// Empty when the program is not scheduled.
    pub schedules: Vec<CheckReport>,
}

impl CheckRequest {
    /// Checks an imported (so verified) program's schedule, if it has one.
    pub fn run(&self, input: &str, program: &Program) -> Result<CheckSummary, Error> {
        world_size(self.world_size)?;
        let scheduled = program.graphs.iter().any(|g| {
            g.nodes()
                .any(|(_, n)| zerosched_ir::comm::CommOp::of(n).is_some())
        });
        let schedules = if scheduled {
            let opts = CheckOptions {
                budget: self.budget.unwrap_or(u64::MAX),
                memory: self.memory.unwrap_or(u64::MAX),
                world_size: self.world_size,
                cost: self.cost.clone().unwrap_or_default(),
            };
            check_program(program, &opts).map_err(|violations| Error::Rejected {
                input: input.to_owned(),
                violations,
            })?
        } else {
            Vec::new()
        };
        Ok(CheckSummary {
            input: input.to_owned(),
            graphs: program.graphs.iter().map(GraphSummary::of).collect(),
            schedules,
        })
    }
}

impl CheckSummary {
    pub fn to_json(&self) -> String {
        let mut out = serde_json::to_string_pretty(self).unwrap_or_default();
        out.push('\n');
        out
    }
}

fn world_size(n: u32) -> Result<(), RequestError> {
    if n == 0 {
        Err(RequestError::WorldSize)
    } else {
        Ok(())
    }
}

/// A budget: a byte count, a size such as `"40GiB"`, or null for none.
fn budget<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_any(BudgetVisitor)
}

struct BudgetVisitor;

impl Visitor<'_> for BudgetVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a byte count or a size such as \"40GiB\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u64::try_from(v)
            .map(Some)
            .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // `4e9` from Python is a float; a whole, representable one is a byte count.
        if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < u64::MAX as f64 {
            Ok(Some(v as u64))
        } else {
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        parse_bytes(v).map(Some).map_err(E::custom)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule_request(json: &str) -> Result<ScheduleRequest, RequestError> {
        parse(&mut serde_json::Deserializer::from_str(json))
    }

    #[test]
    fn budgets_as_counts_sizes_or_null() {
        for (json, want) in [
            (r#"{"budget": 1024}"#, Some(1024)),
            (r#"{"budget": "1KiB"}"#, Some(1024)),
            (r#"{"budget": 4e9}"#, Some(4_000_000_000)),
            (r#"{"budget": null}"#, None),
            ("{}", None),
        ] {
            let r = schedule_request(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(r.budget, want, "{json}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        for (json, needle) in [
            (r#"{"budgett": 1}"#, "unknown field `budgett`"),
            (r#"{"budget": -1}"#, "budget: invalid value: integer `-1`"),
            (r#"{"budget": "lots"}"#, "budget: not a byte size"),
            (r#"{"world_size": "8"}"#, "world_size: invalid type"),
            (
                r#"{"cost": {"peak_flops": "x"}}"#,
                "cost.peak_flops: invalid type",
            ),
            (
                r#"{"dump_after": ["insert"]}"#,
                "unknown field `dump_after`",
            ),
        ] {
            let e = schedule_request(json).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains(needle)),
                "{json}: {e:?}"
            );
        }
    }

    #[test]
    fn validation_refuses_unknown_names_and_zero_ranks() {
        for (json, needle) in [
            (r#"{"scheduler": "eager"}"#, "unknown scheduler `eager`"),
            (r#"{"disable": ["keep", "fuse"]}"#, "unknown pass `fuse`"),
            (r#"{"world_size": 0}"#, "world size must be at least 1"),
        ] {
            let r = schedule_request(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            let e = r.pipeline_options().err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains(needle)),
                "{json}: {e:?}"
            );
        }
    }

    #[test]
    fn defaults_are_the_command_lines() {
        let opts = ScheduleRequest::default()
            .pipeline_options()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opts.schedule.world_size, 8);
        assert_eq!(opts.schedule.budget, u64::MAX);
        assert_eq!(opts.scheduler, "prefetch");
        assert!(opts.verify);
    }
}
