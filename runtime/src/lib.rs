//! The pipewright runtime: loads stage modules written by codegen and executes them.
//! It depends on neither the IR nor the passes, so a deployed stage binary carries no
//! importer.
//!
//! Always available (plain Rust): [`kernel`] describes every operator as plain data,
//! [`program`] and [`module`] are the stage-module format ([`listing`] prints it, [`exe`]
//! appends it to a stage executable), [`build`] is the build folder's manifest,
//! [`timeline`] reads and draws schedule traces. With the `torch` feature, `exec` runs the
//! kernels on libtorch through `tch`, `interp` runs whole programs, `pipeline` schedules
//! stages and `data` loads training data.

pub mod build;
pub mod device;
pub mod exe;
pub mod kernel;
pub mod listing;
pub mod module;
pub mod program;
/// The trace format of training runs lives in `core` (the simulator writes it too, without
/// libtorch); re-exported here for the runtime's users.
pub use pipewright_core::timeline;

#[cfg(feature = "torch")]
pub mod data;
#[cfg(feature = "torch")]
pub mod exec;
#[cfg(feature = "torch")]
pub mod interp;
#[cfg(feature = "torch")]
pub mod pipeline;

pub use device::{Device, DeviceError};
pub use kernel::{ElemType, Kernel};
