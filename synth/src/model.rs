//! [`Model`]: a graph under construction (nodes, constants and the recipe of each weight)
//! and its writer, which fills the weights from the seed while it writes them.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::tensor_proto::{DataLocation, DataType};
use onnx_protobuf::tensor_shape_proto::{dimension, Dimension};
use onnx_protobuf::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use pipewright_core::fs::{write_atomic, write_atomic_with, WriteError};
use pipewright_core::Storage;
use protobuf::{EnumOrUnknown, Message, MessageField};

use crate::rng::SplitMix;

/// The opset every generated model imports (it has `LayerNormalization`, `Gelu` and
/// `Split` with `num_outputs`).
const OPSET: i64 = 20;
/// Values per chunk when streaming a weight to its file.
const CHUNK: usize = 1 << 16;


/// A model could not be generated or written.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid shape: {0}")]
    Shape(String),
    #[error("{}: weights of {bytes} bytes do not fit in one ONNX file (protobuf's limit is 2 GiB); use external storage", .path.display())]
    TooLargeInline { path: PathBuf, bytes: u64 },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error("{}: cannot serialize the model: {source}", .path.display())]
    Serialize {
        path: PathBuf,
        #[source]
        source: protobuf::Error,
    },
}

/// How a weight's values are made.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fill {
    /// Uniform with mean 0 and this standard deviation.
    Random { std: f32 },
    Constant(f32),
}

#[derive(Clone, Debug)]
struct WeightRecipe {
    name: String,
    dims: Vec<i64>,
    fill: Fill,
}

impl WeightRecipe {
    fn len(&self) -> usize {
        self.dims.iter().product::<i64>() as usize
    }

    /// Calls `sink` with consecutive chunks of the values (tensor `index`, `seed`).
    fn generate(&self, seed: u64, index: usize, mut sink: impl FnMut(&[f32]) -> std::io::Result<()>) -> std::io::Result<()> {
        let mut rng = SplitMix::for_tensor(seed, index);
        let mut chunk = Vec::with_capacity(CHUNK.min(self.len()));
        let mut left = self.len();
        while left > 0 {
            let n = left.min(CHUNK);
            chunk.clear();
            match self.fill {
                Fill::Random { std } => {
                    // A uniform on [-a, a] has standard deviation a / sqrt(3).
                    let a = std * 3f32.sqrt();
                    chunk.extend((0..n).map(|_| a * rng.next_signed_unit()));
                }
                Fill::Constant(v) => chunk.resize(n, v),
            }
            sink(&chunk)?;
            left -= n;
        }
        Ok(())
    }
}

/// What [`Model::write`] wrote.
#[derive(Clone, Debug)]
pub struct Written {
    pub model: PathBuf,
    /// The external data file, under [`Storage::External`].
    pub data: Option<PathBuf>,
    /// Trainable values (every weight is an f32 parameter).
    pub parameters: u64,
    pub nodes: usize,
    /// Bytes of the model file and the data file together.
    pub bytes: u64,
}

/// A graph being generated: nodes in order, one input, the outputs, and a recipe per weight.
#[derive(Clone, Debug)]
pub struct Model {
    name: String,
    input: ValueInfoProto,
    outputs: Vec<String>,
    nodes: Vec<NodeProto>,
    weights: Vec<WeightRecipe>,
}

impl Model {
    /// An empty graph `name` with one input of ONNX type `elem_type` whose first axis is the
    /// symbolic batch `"batch"` and whose other axes are `dims`.
    pub(crate) fn new(name: &str, input: &str, elem_type: DataType, dims: &[i64]) -> Model {
        let mut dim = vec![Dimension { value: Some(dimension::Value::DimParam("batch".into())), ..Default::default() }];
        dim.extend(dims.iter().map(|&d| Dimension { value: Some(dimension::Value::DimValue(d)), ..Default::default() }));
        let tensor = type_proto::Tensor {
            elem_type: elem_type as i32,
            shape: MessageField::some(TensorShapeProto { dim, ..Default::default() }),
            ..Default::default()
        };
        let input = ValueInfoProto {
            name: input.into(),
            type_: MessageField::some(TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() }),
            ..Default::default()
        };
        Model { name: name.into(), input, outputs: Vec::new(), nodes: Vec::new(), weights: Vec::new() }
    }

    /// Adds node `name` computing `op_type` of `inputs` into `outputs` output values named
    /// `name` (one output) or `name:i`; returns their names.
    pub(crate) fn node(&mut self, op_type: &str, name: &str, inputs: &[&str], attrs: Vec<AttributeProto>, outputs: usize) -> Vec<String> {
        let output: Vec<String> = if outputs == 1 { vec![name.to_string()] } else { (0..outputs).map(|i| format!("{name}:{i}")).collect() };
        self.nodes.push(NodeProto {
            op_type: op_type.into(),
            name: name.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: output.clone(),
            attribute: attrs,
            ..Default::default()
        });
        output
    }

    /// Like [`Model::node`] for the usual single output.
    pub(crate) fn op(&mut self, op_type: &str, name: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        self.node(op_type, name, inputs, attrs, 1).remove(0)
    }

    /// A trainable f32 weight `name` of extents `dims`; returns its name.
    pub(crate) fn weight(&mut self, name: &str, dims: &[i64], fill: Fill) -> String {
        self.weights.push(WeightRecipe { name: name.into(), dims: dims.to_vec(), fill });
        name.to_string()
    }

    /// A `Constant` node holding an i64 vector.
    pub(crate) fn const_i64(&mut self, name: &str, values: &[i64]) -> String {
        let t = TensorProto {
            name: name.into(),
            dims: vec![values.len() as i64],
            data_type: DataType::INT64 as i32,
            raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ..Default::default()
        };
        self.op("Constant", name, &[], vec![attr_tensor("value", t)])
    }

    /// A `Constant` node holding an f32 tensor (not trained).
    pub(crate) fn const_f32(&mut self, name: &str, dims: &[i64], values: &[f32]) -> String {
        let t = TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: DataType::FLOAT as i32,
            raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ..Default::default()
        };
        self.op("Constant", name, &[], vec![attr_tensor("value", t)])
    }

    pub(crate) fn output(&mut self, name: &str) {
        self.outputs.push(name.to_string());
    }

    /// Trainable values.
    pub fn parameters(&self) -> u64 {
        self.weights.iter().map(|w| w.len() as u64).sum()
    }

    /// Nodes that compute (`Constant` nodes, which the importer folds, excluded).
    pub fn nodes(&self) -> usize {
        self.nodes.iter().filter(|n| n.op_type != "Constant").count()
    }

    /// Writes the model to `path` (and, under [`Storage::External`], its weights to
    /// `PATH.data`), each file atomically. Weights are made from `seed` while they are
    /// written, so external storage needs memory for the graph only.
    pub fn write(&self, path: &Path, storage: Storage, seed: u64) -> Result<Written, SynthError> {
        let weight_bytes = self.parameters() * 4;
        let (initializers, data) = match storage {
            Storage::Inline => {
                if weight_bytes >= (2u64 << 30) - (64 << 20) {
                    return Err(SynthError::TooLargeInline { path: path.to_path_buf(), bytes: weight_bytes });
                }
                (self.inline_initializers(seed), None)
            }
            Storage::External => {
                let data = data_path(path);
                self.write_data(&data, seed)?;
                (self.external_initializers(&data), Some(data))
            }
            Storage::ShapesOnly => (self.external_initializers(&data_path(path)), None),
        };
        let written = self
            .proto(initializers)
            .write_to_bytes()
            .map_err(|source| SynthError::Serialize { path: path.to_path_buf(), source })
            .and_then(|bytes| write_atomic(path, &bytes).map(|()| bytes).map_err(SynthError::from));
        let bytes = match written {
            Ok(bytes) => bytes,
            Err(e) => {
                // A data file without its model is of no use to anyone.
                if let Some(data) = &data {
                    let _ = std::fs::remove_file(data);
                }
                return Err(e);
            }
        };
        let data_bytes = if data.is_some() { weight_bytes } else { 0 };
        Ok(Written { model: path.to_path_buf(), data, parameters: self.parameters(), nodes: self.nodes(), bytes: bytes.len() as u64 + data_bytes })
    }

    fn inline_initializers(&self, seed: u64) -> Vec<TensorProto> {
        let mut out = Vec::with_capacity(self.weights.len());
        for (i, w) in self.weights.iter().enumerate() {
            let mut raw = Vec::with_capacity(w.len() * 4);
            let filled = w.generate(seed, i, |chunk| {
                raw.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                Ok(())
            });
            debug_assert!(filled.is_ok(), "filling memory cannot fail");
            out.push(TensorProto { raw_data: raw, ..self.tensor_header(w) });
        }
        out
    }

    fn write_data(&self, data: &Path, seed: u64) -> Result<(), SynthError> {
        write_atomic_with(data, |file| {
            let mut out = BufWriter::with_capacity(1 << 20, file);
            let mut bytes = Vec::with_capacity(CHUNK * 4);
            for (i, w) in self.weights.iter().enumerate() {
                w.generate(seed, i, |chunk| {
                    bytes.clear();
                    bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                    out.write_all(&bytes)
                })?;
            }
            out.flush()
        })?;
        Ok(())
    }

    fn external_initializers(&self, data: &Path) -> Vec<TensorProto> {
        let location = data.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let entry = |key: &str, value: String| StringStringEntryProto { key: key.into(), value, ..Default::default() };
        let mut offset = 0u64;
        let mut out = Vec::with_capacity(self.weights.len());
        for w in &self.weights {
            let length = w.len() as u64 * 4;
            out.push(TensorProto {
                data_location: EnumOrUnknown::new(DataLocation::EXTERNAL),
                external_data: vec![
                    entry("location", location.clone()),
                    entry("offset", offset.to_string()),
                    entry("length", length.to_string()),
                ],
                ..self.tensor_header(w)
            });
            offset += length;
        }
        out
    }

    fn tensor_header(&self, w: &WeightRecipe) -> TensorProto {
        TensorProto { name: w.name.clone(), dims: w.dims.clone(), data_type: DataType::FLOAT as i32, ..Default::default() }
    }

    fn proto(&self, initializer: Vec<TensorProto>) -> ModelProto {
        let graph = GraphProto {
            name: self.name.clone(),
            node: self.nodes.clone(),
            initializer,
            input: vec![self.input.clone()],
            // Output types are left to the importer's shape inference.
            output: self.outputs.iter().map(|o| ValueInfoProto { name: o.clone(), ..Default::default() }).collect(),
            ..Default::default()
        };
        ModelProto {
            ir_version: 9,
            producer_name: "pipewright-synth".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: OPSET, ..Default::default() }],
            graph: MessageField::some(graph),
            ..Default::default()
        }
    }
}

/// `MODEL.onnx` keeps its weights in `MODEL.onnx.data`.
fn data_path(model: &Path) -> PathBuf {
    let mut name = model.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".data");
    model.with_file_name(name)
}

pub(crate) fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::INT), i: v, ..Default::default() }
}

pub(crate) fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::INTS), ints: v.to_vec(), ..Default::default() }
}

pub(crate) fn attr_float(name: &str, v: f32) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::FLOAT), f: v, ..Default::default() }
}

pub(crate) fn attr_string(name: &str, v: &str) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::STRING), s: v.as_bytes().to_vec(), ..Default::default() }
}

fn attr_tensor(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::TENSOR), t: MessageField::some(t), ..Default::default() }
}
