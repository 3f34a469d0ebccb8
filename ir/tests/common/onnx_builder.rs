//! Building small ONNX models in memory with the `onnx-protobuf` types, shared by the IR's
//! and the CLI's integration tests (each includes this file as a module).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::tensor_proto::DataLocation;
use onnx_protobuf::tensor_shape_proto::{dimension, Dimension};
use onnx_protobuf::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use protobuf::{EnumOrUnknown, Message, MessageField};

/// ONNX element type codes used by the tests.
pub const F32: i32 = 1;
pub const I64: i32 = 7;

/// One axis of a declared tensor type: a fixed extent or a named (`dim_param`) one.
#[derive(Clone, Debug)]
pub enum Ax {
    Fixed(i64),
    Param(&'static str),
}

impl From<i64> for Ax {
    fn from(v: i64) -> Ax {
        Ax::Fixed(v)
    }
}

impl From<&'static str> for Ax {
    fn from(p: &'static str) -> Ax {
        Ax::Param(p)
    }
}

/// A tensor-typed `ValueInfoProto`.
pub fn value_info(name: &str, elem_type: i32, dims: &[Ax]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Ax::Fixed(v) => dimension::Value::DimValue(*v),
                Ax::Param(p) => dimension::Value::DimParam(p.to_string()),
            }),
            ..Default::default()
        })
        .collect();
    let tensor = type_proto::Tensor {
        elem_type,
        shape: MessageField::some(TensorShapeProto { dim, ..Default::default() }),
        ..Default::default()
    };
    ValueInfoProto {
        name: name.into(),
        type_: MessageField::some(TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() }),
        ..Default::default()
    }
}

/// A node; set attributes with [`NodeExt`].
pub fn node(op_type: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: op_type.into(),
        name: name.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Attribute and domain setters for [`NodeProto`].
pub trait NodeExt: Sized {
    fn attr(self, a: AttributeProto) -> Self;
    fn domain(self, domain: &str) -> Self;

    fn int(self, name: &str, v: i64) -> Self {
        self.attr(AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::INT), i: v, ..Default::default() })
    }

    fn ints(self, name: &str, v: &[i64]) -> Self {
        self.attr(AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::INTS), ints: v.to_vec(), ..Default::default() })
    }

    fn float(self, name: &str, v: f32) -> Self {
        self.attr(AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::FLOAT), f: v, ..Default::default() })
    }

    fn string(self, name: &str, v: &str) -> Self {
        self.attr(AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(AttributeType::STRING),
            s: v.as_bytes().to_vec(),
            ..Default::default()
        })
    }

    fn tensor(self, name: &str, t: TensorProto) -> Self {
        self.attr(AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::TENSOR), t: MessageField::some(t), ..Default::default() })
    }
}

impl NodeExt for NodeProto {
    fn attr(mut self, a: AttributeProto) -> Self {
        self.attribute.push(a);
        self
    }

    fn domain(mut self, domain: &str) -> Self {
        self.domain = domain.into();
        self
    }
}

/// An f32 tensor stored as raw little-endian bytes.
pub fn tensor_f32(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    assert_eq!(dims.iter().product::<i64>() as usize, values.len(), "tensor {name}: values do not match dims");
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: F32,
        raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

/// An f32 tensor of zeros.
pub fn tensor_f32_zeros(name: &str, dims: &[i64]) -> TensorProto {
    let n = dims.iter().product::<i64>() as usize;
    tensor_f32(name, dims, &vec![0.0; n])
}

/// An i64 tensor stored as raw little-endian bytes.
pub fn tensor_i64(name: &str, dims: &[i64], values: &[i64]) -> TensorProto {
    assert_eq!(dims.iter().product::<i64>() as usize, values.len(), "tensor {name}: values do not match dims");
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: I64,
        raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

/// An f32 tensor whose data lives in an external file at `location` (relative to the
/// model's folder), with optional `offset` and `length` entries.
pub fn tensor_external(name: &str, dims: &[i64], location: &str, offset: Option<u64>, length: Option<u64>) -> TensorProto {
    let kv = |k: &str, v: String| StringStringEntryProto { key: k.into(), value: v, ..Default::default() };
    let mut external_data = vec![kv("location", location.into())];
    if let Some(o) = offset {
        external_data.push(kv("offset", o.to_string()));
    }
    if let Some(l) = length {
        external_data.push(kv("length", l.to_string()));
    }
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: F32,
        external_data,
        data_location: EnumOrUnknown::new(DataLocation::EXTERNAL),
        ..Default::default()
    }
}

/// Builds a `ModelProto` one piece at a time.
#[derive(Clone, Debug)]
pub struct ModelBuilder {
    pub model: ModelProto,
}

impl ModelBuilder {
    /// An empty model importing the default domain at `opset`.
    pub fn new(opset: i64) -> ModelBuilder {
        let model = ModelProto {
            ir_version: 8,
            producer_name: "pipewright-tests".into(),
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: opset, ..Default::default() }],
            graph: MessageField::some(GraphProto { name: "test".into(), ..Default::default() }),
            ..Default::default()
        };
        ModelBuilder { model }
    }

    fn graph(&mut self) -> &mut GraphProto {
        self.model.graph.as_mut().expect("graph")
    }

    /// Also imports `domain` at `version`.
    pub fn opset_import(mut self, domain: &str, version: i64) -> Self {
        self.model.opset_import.push(OperatorSetIdProto { domain: domain.into(), version, ..Default::default() });
        self
    }

    /// A graph input of element type `elem_type`.
    pub fn input(mut self, name: &str, elem_type: i32, dims: &[Ax]) -> Self {
        self.graph().input.push(value_info(name, elem_type, dims));
        self
    }

    /// An f32 graph input of fixed extents.
    pub fn input_f32(self, name: &str, dims: &[i64]) -> Self {
        let dims: Vec<Ax> = dims.iter().map(|&d| Ax::Fixed(d)).collect();
        self.input(name, F32, &dims)
    }

    /// A graph output (declared without a type: the importer infers it).
    pub fn output(mut self, name: &str) -> Self {
        self.graph().output.push(ValueInfoProto { name: name.into(), ..Default::default() });
        self
    }

    pub fn node(mut self, n: NodeProto) -> Self {
        self.graph().node.push(n);
        self
    }

    pub fn init(mut self, t: TensorProto) -> Self {
        self.graph().initializer.push(t);
        self
    }

    pub fn build(self) -> ModelProto {
        self.model
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.model.write_to_bytes().expect("serialize the model")
    }

    /// Writes the model to `dir/file` and returns the path.
    pub fn write(&self, dir: &Path, file: &str) -> PathBuf {
        let path = dir.join(file);
        std::fs::write(&path, self.bytes()).expect("write the model");
        path
    }
}

