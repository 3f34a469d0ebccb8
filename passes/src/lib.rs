//! Passes over the pipewright IR. Analyses are nouns (`CostModel`, `RecomputePlan`),
//! transformations are verbs (`insert_stage_boundaries`); [`pipeline`] chains them into
//! the typed passes of `pipewright compile`, which [`manager`] runs with verification,
//! printing and timing after each. [`simulate`] replays a plan on a cluster
//! ([`presets`]) event by event, with the runtime's own per-stage operation order;
//! [`tensor_parallel`] splits layers Megatron-style for the simulator's comparison.
//!
//! The modules import each other in one direction (`tests/module_graph.rs` checks it):
//! [`machine`] (links, all-reduces, a host's cores, duration spreads) at the bottom, then
//! [`profile`] (the profile file), [`cost`], [`cluster`] and [`presets`]; [`simulate`]
//! on those; [`partition`], then [`planner`], which replays with the simulator; above it
//! [`plan_file`] and [`tensor_parallel`]. The passes ([`boundaries`], [`recompute`],
//! [`versioning`]) use at most the cost model and the partitioner, and [`pipeline`]
//! chains everything over the generic [`manager`].

pub mod boundaries;
pub mod cluster;
pub mod cost;
pub mod machine;
pub mod manager;
pub mod partition;
pub mod pipeline;
pub mod plan_file;
pub mod planner;
pub mod presets;
pub mod profile;
pub mod recompute;
pub mod simulate;
pub mod tensor_parallel;
pub mod versioning;
