//! What the checker can find wrong, and where. Sections follow the numbered guarantees of
//! docs/format.md ("Inserted ops").

use std::fmt;
use zerosched_ir::Location;

/// One broken guarantee of docs/format.md ("Inserted ops"), independent of where it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    // 1. order
    #[error("references `{target}`, which does not come earlier in program order")]
    NotTopological { target: String },

    // 2. shards
    #[error(
        "reads the shard `{placeholder}` of sharded parameter `{param}`; only its all-gather \
         and the output may"
    )]
    ShardRead { param: String, placeholder: String },
    #[error("all-gather of something that is not a parameter placeholder")]
    GatherNotOfParam,
    #[error("all-gather of persistent parameter `{param}`, which is not sharded")]
    GatherOfPersistent { param: String },
    #[error("`param` is {found} but should be `{expected}`")]
    ParamMismatch { expected: String, found: String },

    // 3. waits, uses, releases
    #[error("all-gather of `{param}` has no wait")]
    MissingWait { param: String },
    #[error("second wait of the all-gather of `{param}` (first: `{first}`)")]
    ExtraWait { param: String, first: String },
    #[error("wait on something that is not an all-gather")]
    WaitNotOnGather,
    #[error("wait comes before its all-gather `{gather}`")]
    WaitBeforeGather { gather: String },
    #[error("uses the gathered `{param}` before its wait `{wait}`")]
    UseBeforeWait { param: String, wait: String },
    #[error("uses the gathered `{param}` after its release `{release}`")]
    UseAfterRelease { param: String, release: String },
    #[error("all-gather of `{param}` is never released and its value does not escape")]
    MissingRelease { param: String },
    #[error("releases `{param}` again (first released by `{first}`)")]
    DoubleRelease { param: String, first: String },
    #[error("releases a value that is not in any gathered storage")]
    ReleaseNotGathered,
    #[error("releases `{param}`, whose gathered value the output returns")]
    ReleaseOfEscaped { param: String },
    #[error("`after` of the release of `{param}` omits its real use `{user}`")]
    ReleaseMissesUse { param: String, user: String },

    #[error("keep outside a forward graph")]
    KeepOutsideForward,

    // 4. buckets
    #[error(
        "bucket {bucket} member is not adjacent to member `{previous}`: `{between}` is between"
    )]
    BucketNotAdjacent {
        bucket: i64,
        previous: String,
        between: String,
    },

    #[error("bucket {bucket} member gathers {found}, but member `{first}` gathers {expected}")]
    BucketMixedDtype {
        bucket: i64,
        first: String,
        expected: String,
        found: String,
    },

    #[error(
        "bucket {bucket} member is {found}, but member `{first}` is {expected}: one coalesced \
         reduction is one collective over one dtype"
    )]
    BucketMixedReduction {
        bucket: i64,
        first: String,
        expected: String,
        found: String,
    },

    #[error("reuse carries `bucket` {bucket}; a reuse issues no collective and has no bucket")]
    BucketOnReuse { bucket: i64 },

    // 5. keep and reuse, across the graphs of a program
    #[error("keeps `{param}` gathered, but no later graph reuses it")]
    KeptNeverReused { param: String },
    #[error("reuses `{param}`, which no earlier graph kept")]
    ReuseWithoutKeep { param: String },
    #[error("gathers `{param}` while it is kept (by `{keep}` in graph `{graph}`)")]
    GatheredWhileKept {
        param: String,
        keep: String,
        graph: String,
    },

    // 6. gradients (their buckets are checked as guarantee 4)
    #[error(
        "gradient slot {slot} of `{param}` is not a getitem of end_backward over its reduce_grad"
    )]
    GradNotReduced { param: String, slot: u32 },
    #[error("reduces `{param}` again (first reduced by `{first}`)")]
    DuplicateReduction { param: String, first: String },
    #[error("reduces `{param}`, which has no gradient slot")]
    StrayReduction { param: String },
    #[error("reduce_grad comes before the producer `{producer}` of its gradient")]
    ReduceBeforeProducer { producer: String },
    #[error("reduce_grad of `{param}` is awaited by no end_backward")]
    ReduceNotAwaited { param: String },
    #[error("end_backward comes before its reduction `{reduce}`")]
    EndBackwardBeforeReduce { reduce: String },
    #[error("end_backward comes after the output")]
    EndBackwardAfterOutput,

    // 7. memory
    #[error("gathered bytes reach {live} here, over the budget of {budget}")]
    OverBudget { live: u64, budget: u64 },
    #[error("live bytes reach {peak} (simulated), over the memory budget of {memory}")]
    OverMemory { peak: u64, memory: u64 },
}

/// A violation at a place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    pub location: Location,
    pub violation: Violation,
}

impl fmt::Display for Located {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.violation)
    }
}

/// Every violation found, in the order the checks ran.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Violations(pub Vec<Located>);

impl Violations {
    /// Whether a violation matching `pred` is reported at node `node`.
    pub fn at_node(&self, node: &str, pred: impl Fn(&Violation) -> bool) -> bool {
        self.0
            .iter()
            .any(|l| l.location.node.as_deref() == Some(node) && pred(&l.violation))
    }
}

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 50;
        for (i, l) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{l}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, "\n... and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

impl std::error::Error for Violations {}
