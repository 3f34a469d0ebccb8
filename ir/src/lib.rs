//! pipewright's graph IR: ONNX import, typed ops, shapes with a symbolic batch
//! dimension, the verifier and the text form.
//!
//! The flow is `import_model` (parse, convert nodes to [`Op`]s, infer shapes, fold
//! shape subgraphs, fuse spelled-out GELUs and attention, compact, verify) and then passes over [`Graph`] in the
//! `pipewright-passes` crate.

pub mod batch_drop;
pub mod dim;
pub mod dot;
pub mod error;
pub mod fuse;
pub mod graph;
pub mod import;
pub mod infer;
pub mod known;
pub mod parse;
pub mod stage;
pub mod summary;
pub mod text;
pub mod verify;

pub use dim::{Dim, Shape, TensorType};
pub use pipewright_ops::{DType, Op, TensorData};
pub use error::{ImportError, ModelError, NodeRef};
pub use graph::{BatchInfo, Edge, Graph, ModelMeta, Node, NodeId, Value, ValueDef, ValueId, Weight};
pub use import::{content_crc32, import_bytes, import_model, read_tensor_file, BatchMode, ImportOptions};
pub use parse::{parse_graph, parse_graph_annotated, ParseError};
pub use stage::{verify_stages, StageMap};
pub use verify::{verify, VerifyError};
