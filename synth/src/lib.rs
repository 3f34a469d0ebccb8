//! Synthetic ONNX models at real sizes, so that scaling is tested without downloading
//! anything: [`gpt`] builds a GPT-2-shaped decoder (any number of layers, hidden size,
//! heads, sequence length and vocabulary; the presets match GPT-2 small and medium
//! parameter for parameter), and [`layered`] builds a long chain of layers with skip
//! connections reaching across many of them, the shape that stresses partitioning.
//!
//! Both return a [`Model`], which writes one ONNX file with its random weights either
//! inline or, for models past protobuf's 2 GiB limit or when memory matters, streamed into
//! an external data file beside it. Weights depend only on the seed and the tensor's
//! position, so both storages hold the same numbers.

mod gpt;
mod layered;
mod model;
mod rng;

pub use gpt::{gpt, GptShape};
pub use layered::{layered, LayeredShape};
pub use model::{Model, SynthError, Written};
