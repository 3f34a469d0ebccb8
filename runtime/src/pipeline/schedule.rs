//! Per-stage operation sequences for the three pipeline schedules: the generator lives in
//! `pipewright-core` (plain Rust) so that the simulator in `pipewright-passes` replays the
//! very order the executor runs.

pub use pipewright_core::schedule::{stage_ops, stage_ops_from, Op};
