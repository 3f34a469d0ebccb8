//! Fusion: the import rewrites patterns exporters spell out node by node into the one op
//! that computes them, so the runtime can run one kernel where the export has many.
//!
//! - [`fuse_gelu`]: GELU's tanh and erf forms into `Gelu` ([`gelu`]).
//! - [`fuse_attention`]: `softmax(scale Q K^T + mask) V` into `Attention` ([`attention`]).
//!
//! Every fusion rewrites the last node of a matched pattern in place (its outputs and their
//! readers stay) and leaves the rest without readers for [`crate::Graph::remove_dead_nodes`];
//! a pattern is matched only when nothing outside it reads its intermediate values. The
//! stage ONNX writer spells a fused op out again where the model's opset lacks it.

pub mod attention;
pub mod gelu;
mod pattern;

pub use attention::fuse_attention;
pub use gelu::fuse_gelu;

/// The ops fusion writes, which the graph may hold at any opset (the text form parses
/// them whatever the graph's opset).
pub const FUSED_OPS: &[&str] = &["Gelu", "Attention"];
