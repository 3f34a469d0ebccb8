//! Each stage's forward subgraph as a standalone ONNX model (the inverse of the importer's
//! `Op` conversion), for inspection with ONNX tools and for checking a partition.
//!
//! Stage `k`'s model: the tensors it receives and the graph inputs it reads are graph
//! inputs; the tensors it sends and the graph outputs it produces are graph outputs; the
//! weights and constants it reads are initializers (`raw_data`). Nodes keep their ONNX op
//! type, name and attributes; `StageBoundary` nodes are not emitted. Sent tensors carry
//! their wire name (`x@stage2`, the name the next stage's model reads them by) through an
//! `Identity` node, so stage models chain by name. The opset and IR version are the
//! source model's.
//!
//! Batch axes: when the source was exported at a batch size above 1 (constants such as
//! reshape targets and attention masks are baked for it), every extent is written at that
//! size, as the source declared them, so the stage model re-imports exactly like the
//! source (the importer recovers `N` from a shared axis 0). Otherwise axis 0 of extent
//! `N` is written as `dim_param "N"` and other batch-dependent extents at size 1.

use std::collections::HashMap;

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::tensor_shape_proto::{dimension, Dimension};
use onnx_protobuf::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto,
    TypeProto, ValueInfoProto,
};
use pipewright_ir::ops::*;
use pipewright_ir::{Dim, Graph, Op, TensorData, ValueId};
use protobuf::{EnumOrUnknown, Message, MessageField};

use crate::stage::StageSlice;

/// Why a stage could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("stage {stage}: node {node:?} ({op}) has no ONNX form")]
    NotOnnx { stage: u32, node: String, op: &'static str },
    #[error("stage {stage}: cannot serialise the model: {reason}")]
    Encode { stage: u32, reason: String },
}

/// The serialised ONNX model of one stage.
pub fn export_stage_bytes(g: &Graph, s: &StageSlice) -> Result<Vec<u8>, ExportError> {
    export_stage(g, s)?.write_to_bytes().map_err(|e| ExportError::Encode { stage: s.stage, reason: e.to_string() })
}

/// The ONNX model of one stage.
pub fn export_stage(g: &Graph, s: &StageSlice) -> Result<ModelProto, ExportError> {
    let export_batch = g.batch.as_ref().map(|b| b.export_size).unwrap_or(1);
    let name = |v: ValueId| g.value(v).name.clone();
    let mut graph = GraphProto { name: format!("{}_stage{}", g.meta.graph_name, s.stage), ..Default::default() };
    for &v in &s.inputs() {
        graph.input.push(value_info(g, v, &name(v), export_batch));
    }
    for &w in &s.weights {
        if let Some(weight) = g.value(w).weight() {
            graph.initializer.push(tensor_proto(&name(w), &weight.data));
        }
    }
    for &n in &s.nodes {
        let node = g.node(n);
        if matches!(node.op, Op::StageBoundary { .. }) {
            continue;
        }
        let names = |vs: &[Option<ValueId>]| vs.iter().map(|v| v.map(name).unwrap_or_default()).collect::<Vec<_>>();
        graph.node.push(NodeProto {
            name: node.name.clone(),
            op_type: node.op.name().to_string(),
            input: names(&node.inputs),
            output: names(&node.outputs),
            attribute: attributes(&node.op),
            ..Default::default()
        });
    }
    let mut used_outputs: HashMap<String, ()> = HashMap::new();
    for &(local, wire) in &s.sent {
        let wire_name = name(wire);
        graph.node.push(NodeProto {
            name: format!("send:{wire_name}"),
            op_type: "Identity".into(),
            input: vec![name(local)],
            output: vec![wire_name.clone()],
            ..Default::default()
        });
        used_outputs.insert(wire_name.clone(), ());
        graph.output.push(value_info(g, wire, &wire_name, export_batch));
    }
    for &v in &s.graph_outputs {
        if used_outputs.insert(name(v), ()).is_none() {
            graph.output.push(value_info(g, v, &name(v), export_batch));
        }
    }
    Ok(ModelProto {
        ir_version: if g.meta.ir_version > 0 { g.meta.ir_version } else { 8 },
        producer_name: "pipewright".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version: g.meta.opset, ..Default::default() }],
        graph: MessageField::some(graph),
        ..Default::default()
    })
}

fn value_info(g: &Graph, v: ValueId, name: &str, export_batch: i64) -> ValueInfoProto {
    let ty = &g.value(v).ty;
    let dim = ty
        .shape
        .0
        .iter()
        .enumerate()
        .map(|(axis, d)| Dimension {
            value: Some(match *d {
                Dim::Batch(1) if axis == 0 && export_batch <= 1 => dimension::Value::DimParam("N".into()),
                other => dimension::Value::DimValue(other.eval(export_batch)),
            }),
            ..Default::default()
        })
        .collect();
    let tensor = type_proto::Tensor {
        elem_type: ty.dtype.onnx_code(),
        shape: MessageField::some(TensorShapeProto { dim, ..Default::default() }),
        ..Default::default()
    };
    ValueInfoProto {
        name: name.into(),
        type_: MessageField::some(TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() }),
        ..Default::default()
    }
}

/// A tensor with its bytes as `raw_data`.
pub fn tensor_proto(name: &str, t: &TensorData) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: t.dims.clone(),
        data_type: t.dtype.onnx_code(),
        raw_data: t.bytes.to_vec(),
        ..Default::default()
    }
}

fn attr(name: &str, kind: AttributeType) -> AttributeProto {
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(kind), ..Default::default() }
}

#[derive(Default)]
struct Attrs(Vec<AttributeProto>);

impl Attrs {
    fn i(&mut self, name: &str, v: i64) {
        self.0.push(AttributeProto { i: v, ..attr(name, AttributeType::INT) });
    }
    fn b(&mut self, name: &str, v: bool) {
        self.i(name, v as i64);
    }
    fn f(&mut self, name: &str, v: f32) {
        self.0.push(AttributeProto { f: v, ..attr(name, AttributeType::FLOAT) });
    }
    fn s(&mut self, name: &str, v: &str) {
        self.0.push(AttributeProto { s: v.as_bytes().to_vec(), ..attr(name, AttributeType::STRING) });
    }
    fn ints(&mut self, name: &str, v: &[i64]) {
        self.0.push(AttributeProto { ints: v.to_vec(), ..attr(name, AttributeType::INTS) });
    }
    fn ints_nonempty(&mut self, name: &str, v: &[i64]) {
        if !v.is_empty() {
            self.ints(name, v);
        }
    }
    fn t(&mut self, name: &str, t: &TensorData) {
        self.0.push(AttributeProto { t: MessageField::some(tensor_proto("", t)), ..attr(name, AttributeType::TENSOR) });
    }
    fn window(&mut self, w: &Window) {
        self.ints_nonempty("kernel_shape", &w.kernel_shape);
        self.ints_nonempty("strides", &w.strides);
        self.ints_nonempty("pads", &w.pads);
        self.ints_nonempty("dilations", &w.dilations);
        match w.auto_pad {
            AutoPad::NotSet => {}
            AutoPad::SameUpper => self.s("auto_pad", "SAME_UPPER"),
            AutoPad::SameLower => self.s("auto_pad", "SAME_LOWER"),
            AutoPad::Valid => self.s("auto_pad", "VALID"),
        }
    }
}

/// The ONNX attributes of `op` (the inverse of the importer's conversion).
pub fn attributes(op: &Op) -> Vec<AttributeProto> {
    let mut a = Attrs::default();
    match op {
        Op::Unary(_) | Op::Variadic(_) | Op::MatMul | Op::GlobalAveragePool | Op::GlobalMaxPool | Op::Expand => {}
        Op::Where | Op::CastLike | Op::Size | Op::Range | Op::Tile | Op::StageBoundary { .. } => {}
        Op::Binary(b) => {
            if *b == BinaryOp::Fmod {
                a.i("fmod", 1);
            }
        }
        Op::LeakyRelu { alpha } | Op::Elu { alpha } | Op::Celu { alpha } | Op::ThresholdedRelu { alpha } => a.f("alpha", *alpha),
        Op::Selu { alpha, gamma } => {
            a.f("alpha", *alpha);
            a.f("gamma", *gamma);
        }
        Op::HardSigmoid { alpha, beta } => {
            a.f("alpha", *alpha);
            a.f("beta", *beta);
        }
        Op::Gelu { approximate } => {
            if *approximate == GeluApprox::Tanh {
                a.s("approximate", "tanh");
            }
        }
        Op::Clip { min, max } => {
            if let Some(v) = min {
                a.f("min", *v);
            }
            if let Some(v) = max {
                a.f("max", *v);
            }
        }
        Op::IsInf { detect_positive, detect_negative } => {
            a.b("detect_positive", *detect_positive);
            a.b("detect_negative", *detect_negative);
        }
        Op::Softmax(s) | Op::LogSoftmax(s) => a.i("axis", s.axis),
        Op::Gemm(g) => {
            a.f("alpha", g.alpha);
            a.f("beta", g.beta);
            a.b("transA", g.trans_a);
            a.b("transB", g.trans_b);
        }
        Op::Conv(c) => {
            a.window(&c.window);
            a.i("group", c.group);
        }
        Op::ConvTranspose(c) => {
            a.window(&c.window);
            a.i("group", c.group);
            a.ints_nonempty("output_padding", &c.output_padding);
            a.ints_nonempty("output_shape", &c.output_shape);
        }
        Op::MaxPool(p) => {
            a.window(&p.window);
            a.b("ceil_mode", p.ceil_mode);
        }
        Op::AveragePool(p) => {
            a.window(&p.window);
            a.b("ceil_mode", p.ceil_mode);
            a.b("count_include_pad", p.count_include_pad);
        }
        Op::BatchNormalization(b) => {
            a.f("epsilon", b.epsilon);
            a.f("momentum", b.momentum);
            if b.training_mode {
                a.b("training_mode", true);
            }
        }
        Op::LayerNormalization(l) => {
            a.i("axis", l.axis);
            a.f("epsilon", l.epsilon);
            a.i("stash_type", l.stash_type);
        }
        Op::InstanceNormalization { epsilon } => a.f("epsilon", *epsilon),
        Op::Dropout { ratio, seed } => {
            if let Some(r) = ratio {
                a.f("ratio", *r);
            }
            if let Some(s) = seed {
                a.i("seed", *s);
            }
        }
        Op::Reshape { allow_zero } => {
            if *allow_zero {
                a.b("allowzero", true);
            }
        }
        Op::Flatten { axis } => a.i("axis", *axis),
        Op::Transpose { perm } => {
            if let Some(p) = perm {
                a.ints("perm", p);
            }
        }
        Op::Squeeze { axes } | Op::Unsqueeze { axes } => {
            if let Some(x) = axes {
                a.ints("axes", x);
            }
        }
        Op::Concat { axis } => a.i("axis", *axis),
        Op::Split(s) => {
            a.i("axis", s.axis);
            if let Some(x) = &s.split {
                a.ints("split", x);
            }
            if let Some(n) = s.num_outputs {
                a.i("num_outputs", n);
            }
        }
        Op::Slice(s) => {
            if let Some((starts, ends, axes)) = &s.attrs {
                a.ints("starts", starts);
                a.ints("ends", ends);
                if let Some(x) = axes {
                    a.ints("axes", x);
                }
            }
        }
        Op::Gather { axis } | Op::GatherElements { axis } => a.i("axis", *axis),
        Op::Cast { to } => a.i("to", to.onnx_code() as i64),
        Op::Shape { start, end } => {
            if *start != 0 {
                a.i("start", *start);
            }
            if let Some(e) = end {
                a.i("end", *e);
            }
        }
        Op::ConstantOfShape { value } => {
            if let Some(t) = value {
                a.t("value", t);
            }
        }
        Op::Reduce(r) => {
            if let Some(x) = &r.axes {
                a.ints("axes", x);
            }
            a.b("keepdims", r.keepdims);
            if r.noop_with_empty_axes {
                a.b("noop_with_empty_axes", true);
            }
        }
        Op::ArgMax { axis, keepdims, select_last_index } | Op::ArgMin { axis, keepdims, select_last_index } => {
            a.i("axis", *axis);
            a.b("keepdims", *keepdims);
            if *select_last_index {
                a.b("select_last_index", true);
            }
        }
        Op::Trilu { upper } => a.b("upper", *upper),
        Op::Einsum { equation } => a.s("equation", equation),
        Op::Pad(p) => {
            a.s("mode", pad_mode_name(p.mode));
            if let Some((pads, value)) = &p.attrs {
                a.ints("pads", pads);
                a.f("value", *value);
            }
        }
        Op::CumSum { exclusive, reverse } => {
            a.b("exclusive", *exclusive);
            a.b("reverse", *reverse);
        }
    }
    a.0
}
