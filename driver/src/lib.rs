//! pipewright's commands as library functions, over the crates that do the work: the
//! `pipewright` binary parses arguments, calls one of these and prints what it returns.
//!
//! - [`compile`]: `plan` and `compile` — the pass pipeline from an ONNX file to a build
//!   folder.
//! - [`export`]: trained weights back into the source ONNX model.
//! - [`simulate`]: `simulate` — plans for a cluster and replays each scheme event by event.
//! - [`launch`]: the `mpirun` line that starts a build as an MPI job.
//! - With the `torch` feature: [`train`] (the embedded executor, and one stage as a worker
//!   process), [`forward`] (whole-model runs, `run-forward`, `bench-step`),
//!   [`conformance`] (the ONNX backend suite) and [`profile`] (per-node timings).

pub mod compile;
mod error;
pub mod export;
pub mod simulate;
pub mod launch;
pub mod rebatch;

#[cfg(feature = "torch")]
pub mod conformance;
#[cfg(feature = "torch")]
pub mod doctor;
#[cfg(feature = "torch")]
pub mod forward;
#[cfg(feature = "torch")]
pub mod profile;
#[cfg(feature = "torch")]
pub mod train;

pub use error::DriverError;
