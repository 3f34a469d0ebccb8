//! The pipeline decision: depth, schedule, recomputation and, when decided at compile
//! time, the microbatch size, the microbatches per step and the data-parallel width.
//!
//! One type, decided once (by a plan file, the planner's search or `compile --stages`) and
//! carried unchanged: the compile writes it into the build manifest, `train`, the MPI
//! workers and the stage executables read it back, and a run resolves its shape from it
//! ([`Decision::resolve`]: a flag wins over the build, the build over the defaults, which
//! are written here and nowhere else).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::{Placement, Recompute, Schedule};

/// The microbatch size a run uses when neither the build nor a flag gives one.
pub const DEFAULT_MICROBATCH: u64 = 16;

/// The pipeline values that were decided, and by what. `None`: not decided at compile
/// time (a run takes a flag or the default).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Stages `d`.
    pub depth: u32,
    pub schedule: Schedule,
    pub recompute: Recompute,
    /// Samples per microbatch (`b`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatch: Option<u64>,
    /// Microbatches per step and pipeline (`m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<u64>,
    /// Data-parallel replicas of the pipeline (`w`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u64>,
    /// How the MPI ranks (and the embedded executor's devices) are numbered. Absent from
    /// builds made before it was decided (stage-major, the only numbering then).
    #[serde(default, skip_serializing_if = "Placement::is_stage_major")]
    pub placement: Placement,
    /// What decided these values: `plan p.json`, `planned for 8 workers ...`,
    /// `compile --stages 2`.
    pub origin: String,
}

impl Decision {
    /// Microbatches per step when none was decided: the depth, the least 2BW allows.
    pub fn default_microbatches(depth: u32) -> u64 {
        u64::from(depth)
    }

    /// The decided microbatches per step, or [`Decision::default_microbatches`].
    pub fn microbatches_or_default(&self) -> u64 {
        self.microbatches.unwrap_or_else(|| Self::default_microbatches(self.depth))
    }

    /// `d=2 schedule=2bw recompute=none b=32 m=2 w=1 (plan p.json)`, leaving out what was
    /// not decided (and the placement when it is the default, stage-major).
    pub fn text(&self) -> String {
        let mut s = format!("d={} schedule={} recompute={}", self.depth, self.schedule, self.recompute);
        for (k, v) in [("b", self.microbatch), ("m", self.microbatches), ("w", self.replicas)] {
            if let Some(v) = v {
                let _ = write!(s, " {k}={v}");
            }
        }
        if !self.placement.is_stage_major() {
            let _ = write!(s, " placement={}", self.placement);
        }
        let _ = write!(s, " ({})", self.origin);
        s
    }

    /// The run shape: a flag wins over the build, the build over the default (microbatch
    /// [`DEFAULT_MICROBATCH`], microbatches [`Decision::default_microbatches`], one replica).
    pub fn resolve(&self, flags: RunFlags) -> RunShape {
        RunShape {
            microbatch: Setting::resolve(flags.microbatch, self.microbatch, DEFAULT_MICROBATCH),
            microbatches: Setting::resolve(flags.microbatches, self.microbatches, Self::default_microbatches(self.depth)),
            replicas: Setting::resolve(flags.replicas, self.replicas, 1),
            origin: self.origin.clone(),
        }
    }
}

/// Where a run value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The build (the compile decided it).
    Build,
    /// A flag; `overrides` is the build's value it replaced, if the build had one.
    Flag { overrides: Option<u64> },
    /// Neither the build nor a flag: the default.
    Default,
}

/// One run value and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    pub value: u64,
    pub source: Source,
}

impl Setting {
    fn resolve(flag: Option<u64>, build: Option<u64>, default: u64) -> Setting {
        match (flag, build) {
            (Some(value), _) => Setting { value, source: Source::Flag { overrides: build.filter(|&b| b != value) } },
            (None, Some(value)) => Setting { value, source: Source::Build },
            (None, None) => Setting { value: default, source: Source::Default },
        }
    }
}

/// The flags a run may override the build's values with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunFlags {
    pub microbatch: Option<u64>,
    pub microbatches: Option<u64>,
    pub replicas: Option<u64>,
}

/// The shape of a training run: microbatch size, microbatches per step and replicas, each
/// with where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunShape {
    pub microbatch: Setting,
    pub microbatches: Setting,
    pub replicas: Setting,
    /// What decided the build's values.
    pub origin: String,
}

impl RunShape {
    /// One line per value saying where it came from; a flag that overrides the build says so.
    pub fn report(&self) -> String {
        let mut s = String::new();
        for (what, flag, v) in [("microbatch", "--microbatch", self.microbatch), ("microbatches", "--microbatches", self.microbatches), ("replicas", "--replicas", self.replicas)] {
            let from = match v.source {
                Source::Build => format!("from the build: {}", self.origin),
                Source::Flag { overrides: Some(b) } => format!("{flag}, overriding the build's {b}"),
                Source::Flag { overrides: None } => flag.to_string(),
                Source::Default => "default".into(),
            };
            let _ = writeln!(s, "{what} {} ({from})", v.value);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decided(microbatch: Option<u64>, microbatches: Option<u64>) -> Decision {
        Decision { depth: 4, schedule: Schedule::TwoBw, recompute: Recompute::None, microbatch, microbatches, replicas: None, placement: Placement::StageMajor, origin: "compile --stages 4".into() }
    }

    /// A flag wins over the build, the build over the defaults; the defaults are the
    /// microbatch constant, the depth and one replica.
    #[test]
    fn runs_resolve_flags_then_the_build_then_the_defaults() {
        let shape = decided(Some(8), None).resolve(RunFlags { microbatch: Some(2), ..RunFlags::default() });
        assert_eq!(shape.microbatch, Setting { value: 2, source: Source::Flag { overrides: Some(8) } });
        assert_eq!(shape.microbatches, Setting { value: 4, source: Source::Default });
        assert_eq!(shape.replicas, Setting { value: 1, source: Source::Default });
        let shape = decided(None, Some(6)).resolve(RunFlags::default());
        assert_eq!(shape.microbatch, Setting { value: DEFAULT_MICROBATCH, source: Source::Default });
        assert_eq!(shape.microbatches, Setting { value: 6, source: Source::Build });
        assert_eq!(decided(None, None).microbatches_or_default(), 4);
        assert_eq!(decided(Some(3), Some(5)).text(), "d=4 schedule=2bw recompute=none b=3 m=5 (compile --stages 4)");
        let shape = decided(Some(32), Some(4)).resolve(RunFlags { microbatches: Some(8), ..RunFlags::default() });
        assert_eq!(
            shape.report(),
            "microbatch 32 (from the build: compile --stages 4)\nmicrobatches 8 (--microbatches, overriding the build's 4)\nreplicas 1 (default)\n"
        );
    }
}
