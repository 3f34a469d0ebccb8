//! The op vocabulary every phase of pipewright shares: element types ([`DType`]), dense
//! tensors ([`TensorData`]), and the closed enum of ops ([`Op`]) with their typed
//! attributes and ONNX specs.
//!
//! The importer builds these ops, the passes analyse them, codegen writes them into stage
//! modules (serde) and the runtime executes them: one definition, no translation between
//! phases. The crate carries no importer (no protobuf), so a stage binary that executes
//! ops does not link the IR.

pub mod dtype;
pub mod lowp;
pub mod onnx;
pub mod op;
pub mod tensor;

pub use dtype::DType;
pub use op::Op;
pub use tensor::TensorData;
