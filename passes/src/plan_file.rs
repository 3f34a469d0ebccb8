//! The plan file: what `pipewright plan --json` writes and `pipewright compile --plan`
//! reads back, field for field — the chosen `w, d, b, m`, recomputation, schedule, stage
//! starts, the cluster and options it was planned for, and the model it was planned for
//! (path and CRC-32 of its bytes, so a plan is never applied to another model).
//!
//! The file is versioned: [`PlanFile::read`] first reads only `format` and `version`, so a
//! foreign file or one from another version of pipewright is refused with a message naming
//! what it is, before any other field is looked at.

use std::path::{Path, PathBuf};

use pipewright_core::format::{Header, Mismatch};
use pipewright_ir::Graph;
use serde::{Deserialize, Serialize};

use crate::planner::{Plan, PlanError};

/// The `format` of a plan file.
pub const PLAN_FORMAT: &str = "pipewright-plan";
/// The plan-file version this pipewright writes and reads.
pub const PLAN_VERSION: u32 = 1;

/// A plan with what it was made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    pub format: String,
    pub version: u32,
    pub model: PlannedModel,
    #[serde(flatten)]
    pub plan: Plan,
}

/// The model a plan was made for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedModel {
    /// The path the planner was given.
    pub path: String,
    /// CRC-32 of the model file's bytes, as 8 hex digits.
    pub crc32: String,
}

/// A plan file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error("{}: cannot read: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: not a plan file (JSON from `pipewright plan --json`): {reason}", .path.display())]
    NotAPlan { path: PathBuf, reason: String },
    #[error("{}: plan file format version {found}, but this pipewright reads version {PLAN_VERSION}; plan again with this pipewright", .path.display())]
    Version { path: PathBuf, found: u32 },
    #[error("{}: planned for model {planned} (CRC-32 {planned_crc}), not for this one (CRC-32 {crc:08x}); plan again for this model", .path.display())]
    OtherModel { path: PathBuf, planned: String, planned_crc: String, crc: u32 },
    #[error("{}: {source}", .path.display())]
    Plan { path: PathBuf, source: PlanError },
}

impl PlanFile {
    /// The file for `plan`, made for the model at `model` (imported as a graph whose
    /// `source_crc32` is `crc32`).
    pub fn new(plan: Plan, model: &Path, crc32: u32) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            model: PlannedModel { path: model.display().to_string(), crc32: format!("{crc32:08x}") },
            plan,
        }
    }

    pub fn to_json(&self) -> String {
        // A plan is plain data (strings, numbers, lists): serialising cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses a plan file; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<PlanFile, PlanFileError> {
        let not_a_plan = |reason: String| PlanFileError::NotAPlan { path: path.to_path_buf(), reason };
        let header: Header = serde_json::from_str(text).map_err(|e| not_a_plan(e.to_string()))?;
        match header.check(PLAN_FORMAT, PLAN_VERSION) {
            Ok(()) => {}
            Err(Mismatch::Version(found)) => return Err(PlanFileError::Version { path: path.to_path_buf(), found }),
            Err(Mismatch::NoVersion) => return Err(not_a_plan("it has no format version".into())),
            Err(Mismatch::Foreign(other)) => return Err(not_a_plan(format!("its format is {other:?}"))),
            Err(Mismatch::NoFormat) => return Err(not_a_plan("it has no \"format\" field (plans from before format version 1 are not read; plan again)".into())),
        }
        serde_json::from_str(text).map_err(|e| not_a_plan(e.to_string()))
    }

    /// Reads and parses a plan file.
    pub fn read(path: &Path) -> Result<PlanFile, PlanFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanFileError::Io { path: path.to_path_buf(), source })?;
        Self::parse(&text, path)
    }

    /// The plan, attached to `g` (the model it must have been made for); `path` names the
    /// plan file in errors.
    pub fn into_plan_for(self, g: &Graph, path: &Path) -> Result<Plan, PlanFileError> {
        if self.model.crc32 != format!("{:08x}", g.meta.source_crc32) {
            return Err(PlanFileError::OtherModel {
                path: path.to_path_buf(),
                planned: self.model.path,
                planned_crc: self.model.crc32,
                crc: g.meta.source_crc32,
            });
        }
        let mut plan = self.plan;
        plan.attach(g).map_err(|source| PlanFileError::Plan { path: path.to_path_buf(), source })?;
        Ok(plan)
    }
}
