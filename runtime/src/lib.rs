//! The pipewright runtime: loads stage modules written by codegen and executes them.
//! It depends on neither the IR nor the passes, so a deployed stage binary carries no
//! importer.
//!
//! [`kernel`] describes every operator as plain data and [`device`] names compute devices
//! (both always available); with the `torch` feature, `exec` runs the kernels on libtorch
//! through `tch`.

pub mod device;
pub mod kernel;
pub mod module;
pub mod program;

#[cfg(feature = "torch")]
pub mod exec;
#[cfg(feature = "torch")]
pub mod interp;
#[cfg(feature = "torch")]
pub mod pipeline;

pub use device::{Device, DeviceError};
pub use kernel::{ElemType, Kernel};
