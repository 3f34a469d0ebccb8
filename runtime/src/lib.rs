//! The pipewright runtime: loads stage modules written by codegen and executes them.
//! It depends on neither the IR nor the passes, so a deployed stage binary carries no
//! importer.
//!
//! The ops it executes are `pipewright-ops`'s [`Op`]s, the same values the importer
//! built: codegen writes them into stage modules unchanged.
//!
//! Always available (plain Rust): [`program`] and [`module`] are the stage-module format ([`listing`] prints it, [`exe`]
//! appends it to a stage executable), [`build`] is the build folder's manifest,
//! [`timeline`] reads and draws schedule traces. With the `torch` feature, `exec` runs the
//! ops on libtorch through `tch`, `interp` runs whole programs, `pipeline` schedules
//! stages and `data` loads training data.
//!
//! [`Op`]: pipewright_ops::Op

pub mod build;
pub mod device;
pub mod exe;
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
pub mod heap;
#[cfg(feature = "torch")]
pub mod interp;
#[cfg(feature = "torch")]
pub mod pipeline;
#[cfg(feature = "torch")]
pub mod tokens;

pub use device::{Device, DeviceError};
