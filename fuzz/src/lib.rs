//! Fuzzing pipewright's loaders on stable Rust, with no fuzzing engine: a seeded,
//! deterministic, structure-aware mutator ([`mutate`], [`proto`]) feeds the targets
//! ([`targets`]: ONNX import, stage-module decoding, .npy/.npz/safetensors training data,
//! checkpoint manifests and stage files), and [`guard`] runs each input under
//! `catch_unwind` with a time limit and an allocation cap. `docs/fuzzing.md` has the
//! commands and the recorded campaigns.

pub mod campaign;
pub mod guard;
pub mod mutate;
pub mod proto;
pub mod rng;
pub mod targets;

pub use campaign::{replay, run, Options, Report};
pub use targets::{Context, Target};

// Every binary linking this crate (the CLI, the tests) counts its allocations, so an
// input that would allocate without bound is caught before it takes the machine down.
#[global_allocator]
static ALLOC: guard::CappedAlloc = guard::CappedAlloc;
