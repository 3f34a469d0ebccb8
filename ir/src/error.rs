//! Errors of import, shape inference and verification.

use std::path::PathBuf;

/// A node named as in the source model: `"node_Gemm_3" (Gemm)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRef {
    pub name: String,
    pub op_type: String,
}

impl std::fmt::Display for NodeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {:?} ({})", self.name, self.op_type)
    }
}

/// Why a model could not be imported. Every variant names what is wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read the file: {0}")]
    Io(#[source] std::io::Error),
    #[error("the file is empty, not an ONNX model")]
    Empty,
    #[error("not an ONNX model (protobuf decoding failed: {0})")]
    NotOnnx(String),
    #[error("the file is truncated or corrupt (protobuf decoding stopped early: {0})")]
    Truncated(String),
    #[error("not an ONNX model: {0}")]
    NotAModel(&'static str),
    #[error("IR version {0} is not supported (supported: 3 to 14)")]
    IrVersion(i64),
    #[error("the model imports default-domain opset {0}; supported opsets are 1 to {max}", max = pipewright_ops::onnx::MAX_KNOWN_OPSET)]
    Opset(i64),
    #[error("the model has no default-domain (ai.onnx) opset import")]
    NoDefaultOpset,
    #[error("{} node(s) use an operator domain pipewright cannot handle: {}", .0.len(), list_domains(.0))]
    Domain(Vec<(NodeRef, String)>),
    #[error("{} unknown operator type(s): {}", .0.len(), list_unknown(.0))]
    UnknownOps(Vec<(String, Vec<String>)>),
    #[error("{node}: {op} at opset {opset} uses the definition of version {version}, whose semantics are not implemented (supported from version {from})")]
    OpVersion { node: NodeRef, op: String, opset: i64, version: i64, from: i64 },
    #[error("{node}: {op} does not exist at opset {opset}")]
    OpNotInOpset { node: NodeRef, op: String, opset: i64 },
    #[error("{node}: {reason}")]
    BadNode { node: NodeRef, reason: String },
    #[error("tensor {name:?}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("tensor {name:?}: external data location {location:?} escapes the model's folder; refused")]
    ExternalEscape { name: String, location: String },
    #[error("tensor {name:?}: external data file {path} cannot be read: {source}")]
    ExternalMissing { name: String, path: PathBuf, #[source] source: std::io::Error },
    #[error("value {name:?}: element type {type_name} is not supported")]
    ValueType { name: String, type_name: String },
    #[error("{node}: input {input:?} is not defined by any node, initializer or graph input")]
    UndefinedInput { node: NodeRef, input: String },
    #[error("graph output {0:?} is not defined by any node, initializer or graph input")]
    UndefinedOutput(String),
    #[error("value {value:?} is produced twice: by {first} and by {second}")]
    DuplicateValue { value: String, first: String, second: String },
    #[error("the graph has a cycle through {}", .0.join(", "))]
    Cycle(Vec<String>),
    #[error("{node}: shape inference failed: {reason}")]
    Shape { node: NodeRef, reason: String },
    #[error("the graph failed verification after import: {0}")]
    Verify(String),
}

/// The words of the shape error that refuses a sequence-major input (an RNN whose sequence
/// axis carries the batch symbol); [`ImportError::is_sequence_major`] recognises it.
pub(crate) const SEQUENCE_MAJOR: &str = "carries the batch symbol on its sequence axis";

impl ImportError {
    /// The refusal of a sequence-major input under the automatic batch: such a model
    /// imports at its fixed shapes (`--batch fixed`), as the backend suite runs it.
    pub fn is_sequence_major(&self) -> bool {
        matches!(self, ImportError::Shape { reason, .. } if reason.contains(SEQUENCE_MAJOR))
    }
}

fn list_unknown(ops: &[(String, Vec<String>)]) -> String {
    ops.iter()
        .map(|(op, nodes)| {
            let shown: Vec<String> = nodes.iter().take(3).map(|n| format!("{n:?}")).collect();
            let more = if nodes.len() > 3 { format!(", ... {} more", nodes.len() - 3) } else { String::new() };
            format!("{op} (nodes {}{more})", shown.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn list_domains(nodes: &[(NodeRef, String)]) -> String {
    nodes
        .iter()
        .take(5)
        .map(|(n, d)| format!("{n} in domain {d:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An import error together with the model file it concerns.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {error}", path = .path.display())]
pub struct ModelError {
    pub path: PathBuf,
    #[source]
    pub error: ImportError,
}
