//! pipewright's commands as library functions, over the crates that do the work: the
//! `pipewright` binary parses arguments, calls one of these and prints what it returns.
//! Every request (the cluster, a plan, a simulation's set-up, a training run) is built
//! here from the command's plain values, so the CLI imports this crate and `core`'s words
//! only.
//!
//! - [`inspect`]: what a model or a stage module holds.
//! - [`plan`]: the requests of `plan` and `compile` built from plain values (the cluster,
//!   the planner's options, a plan file or a fixed depth), and both commands' output.
//! - [`compile`]: the pass pipeline from an ONNX file to a plan or a build folder.
//! - [`export`]: trained weights back into the source ONNX model.
//! - [`simulate`]: `simulate` — plans for a cluster and replays each scheme event by event.
//! - [`launch`]: the `mpirun` line that starts a build as an MPI job.
//! - [`synth`]: generated models at real sizes; [`trace`]: a training trace as SVG.
//! - With the `torch` feature: [`train`] (the embedded executor, and one stage as a worker
//!   process), [`forward`] (whole-model runs, `run-forward`, `bench-step`),
//!   [`conformance`] (the ONNX backend suite) and [`profile`] (per-node timings).

pub mod compile;
mod error;
pub mod export;
pub mod inspect;
pub mod launch;
pub mod plan;
pub mod rebatch;
pub mod simulate;
pub mod synth;
pub mod trace;

#[cfg(feature = "torch")]
pub mod allreduce;
#[cfg(feature = "torch")]
pub mod batch_check;
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
/// The process heap's settings for training, which the executable sets as it starts.
#[cfg(feature = "torch")]
pub use pipewright_runtime::heap;

pub use error::DriverError;
