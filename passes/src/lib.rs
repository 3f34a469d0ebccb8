//! Passes over the pipewright IR. Analyses are nouns (`CostModel`), transformations are
//! verbs (`insert_stage_boundaries`); each pass's output is printable with the IR text
//! form and the verifier runs after each in tests and debug builds.
//!
//! This crate currently holds the pass plumbing every later pass uses: running a pass and
//! verifying its result.

pub mod boundaries;
pub mod cluster;
pub mod cost;
pub mod manager;
pub mod partition;
pub mod planner;
pub mod recompute;
pub mod versioning;

use pipewright_ir::{verify, Graph, VerifyError};

/// Runs the verifier after a pass in debug builds and tests; release builds skip it
/// because import already verified and passes are tested with it on.
pub fn verify_after(pass: &str, g: &Graph) -> Result<(), PassError> {
    if cfg!(debug_assertions) {
        verify(g).map_err(|errors| PassError::Verify { pass: pass.to_string(), errors })?;
    }
    Ok(())
}

/// A pass failed or left an invalid graph.
#[derive(Debug)]
pub enum PassError {
    Verify { pass: String, errors: Vec<VerifyError> },
}

impl std::fmt::Display for PassError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PassError::Verify { pass, errors } => {
                let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                write!(f, "the graph is invalid after pass {pass}: {}", list.join("; "))
            }
        }
    }
}

impl std::error::Error for PassError {}
