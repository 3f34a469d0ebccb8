//! Code generation: lowering the IR to the runtime's plain-data [`Program`] (each node's
//! [`Op`] as it is, values as numbered slots, weights as stored tensors). Stage
//! modules are built from lowered programs; [`build`] is the `lower` pass and writes the
//! build folder.
//!
//! [`Program`]: pipewright_runtime::program::Program
//! [`Op`]: pipewright_ops::Op

pub mod build;
pub mod lower;
pub mod module;
pub mod onnx_export;
pub mod spell_out;
pub mod stage;

pub use lower::{lower_graph, LowerError};
