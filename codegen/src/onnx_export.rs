//! Each stage's forward subgraph as a standalone ONNX model (the inverse of the importer's
//! `Op` conversion), for inspection with ONNX tools and for checking a partition.
//!
//! Stage `k`'s model: the tensors it receives and the graph inputs it reads are graph
//! inputs; the tensors it sends and the graph outputs it produces are graph outputs; the
//! weights and constants it reads are initializers (`raw_data`). Nodes keep their ONNX op
//! type, name and attributes; `StageBoundary` nodes are not emitted. Sent tensors carry
//! their wire name (`x@stage2`, the name the next stage's model reads them by) through an
//! `Identity` node, so stage models chain by name. The opset and IR version are the
//! source model's; an op the importer fused (`Gelu`, `Attention`) is spelled out again for
//! opsets that lack it ([`crate::spell_out`]).
//!
//! Batch axes: when the source was exported at a batch size above 1 (constants such as
//! reshape targets and attention masks are baked for it), every extent is written at that
//! size, as the source declared them, so the stage model re-imports exactly like the
//! source (the importer recovers `N` from a shared axis 0). Otherwise axis 0 of extent
//! `N` is written as `dim_param "N"` and other batch-dependent extents at size 1.

use std::collections::HashMap;

use onnx_protobuf::tensor_shape_proto::{dimension, Dimension};
use onnx_protobuf::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
    TypeProto, ValueInfoProto,
};
use pipewright_ir::import::{attribute_proto, tensor::tensor_to_proto};
use pipewright_ir::{Dim, Graph, Op, ValueId};
use protobuf::{Message, MessageField};

use crate::spell_out::spell_out;
use crate::stage::StageSlice;

/// Why a stage could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("stage {stage}: node {node:?} ({op}) has no ONNX form")]
    NotOnnx { stage: u32, node: String, op: &'static str },
    #[error("stage {stage}: node {node:?} cannot be written at the model's opset: {reason}")]
    NoSpelling { stage: u32, node: String, reason: String },
    #[error("stage {stage}: cannot serialise the model: {reason}")]
    Encode { stage: u32, reason: String },
}

/// The serialised ONNX model of one stage.
pub fn export_stage_bytes(g: &Graph, s: &StageSlice) -> Result<Vec<u8>, ExportError> {
    export_stage(g, s)?.write_to_bytes().map_err(|e| ExportError::Encode { stage: s.stage, reason: e.to_string() })
}

/// The ONNX model of one stage.
pub fn export_stage(g: &Graph, s: &StageSlice) -> Result<ModelProto, ExportError> {
    let export_batch = g.batch.as_ref().map_or(1, |b| b.resolved_size());
    let name = |v: ValueId| g.value(v).name.clone();
    let mut graph = GraphProto { name: format!("{}_stage{}", g.meta.graph_name, s.stage), ..Default::default() };
    for &v in &s.inputs() {
        graph.input.push(value_info(g, v, &name(v), export_batch));
    }
    for &w in &s.weights {
        if let Some(weight) = g.value(w).weight() {
            graph.initializer.push(tensor_to_proto(&name(w), &weight.data));
        }
    }
    let mut domains: Vec<(&str, i64)> = Vec::new();
    for &n in &s.nodes {
        let node = g.node(n);
        if matches!(node.op, Op::StageBoundary { .. }) {
            continue;
        }
        let names = |vs: &[Option<ValueId>]| vs.iter().map(|v| v.map(name).unwrap_or_default()).collect::<Vec<_>>();
        if let Some(nodes) = spell_out(g, n).map_err(|reason| ExportError::NoSpelling { stage: s.stage, node: node.name.clone(), reason })? {
            graph.initializer.extend(nodes.initializers);
            graph.node.extend(nodes.nodes);
            continue;
        }
        // Ops of other domains (training, ML) carry their domain and import it.
        let domain = pipewright_ops::onnx::spec(node.op.name()).map_or("", |s| s.domain);
        if !domain.is_empty() && !domains.iter().any(|(d, _)| *d == domain) {
            let version = pipewright_ops::onnx::spec(node.op.name()).and_then(|s| s.versions.last().copied()).unwrap_or(1);
            domains.push((domain, version));
        }
        graph.node.push(NodeProto {
            name: node.name.clone(),
            op_type: node.op.name().to_string(),
            domain: domain.to_string(),
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
        opset_import: std::iter::once(("", g.meta.opset))
            .chain(domains)
            .map(|(domain, version)| OperatorSetIdProto { domain: domain.to_string(), version, ..Default::default() })
            .collect(),
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

/// The ONNX attributes of `op` (the inverse of the importer's conversion).
pub fn attributes(op: &Op) -> Vec<AttributeProto> {
    op.attributes().iter().map(|(name, value)| attribute_proto(name, value)).collect()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use pipewright_ir::{import_bytes, parse_graph, ImportOptions, StageMap};

    use super::export_stage;
    use crate::stage::slice_stages;

    /// A one-stage slice of `text`'s graph, exported.
    fn exported(text: &str) -> onnx_protobuf::ModelProto {
        let mut g = parse_graph(text).unwrap_or_else(|e| panic!("{e}"));
        let mut map = StageMap::new(1);
        for n in g.topo_order().unwrap() {
            map.set(n, 0);
        }
        let stages = pipewright_passes::boundaries::insert_stage_boundaries(&mut g, &map).unwrap();
        let slices = slice_stages(&g, &stages).unwrap();
        export_stage(&g, &slices[0]).unwrap()
    }

    #[test]
    fn gelu_is_spelled_out_before_opset_20_and_fused_again_on_import() {
        for (opset, spelled) in [(17, true), (20, false)] {
            let text = format!(
                "graph \"g\" ir_version=8 opset={opset} producer=\"t\" batch=N(\"N\", dynamic) {{\n  %v0: f32[N,8] = input \"x\"\n  %v1: f32[N,8] = Gelu[approximate=\"tanh\"](%v0)  # n0 \"act\"\n  %v2: f32[N,8] = Gelu(%v1)  # n1 \"act2\"\n  return %v2 \"y\"\n}}\n"
            );
            let model = exported(&text);
            let ops: Vec<&str> = model.graph.node.iter().map(|n| n.op_type.as_str()).collect();
            let expected: &[&str] = if spelled {
                &["Pow", "Mul", "Add", "Mul", "Tanh", "Add", "Mul", "Mul", "Div", "Erf", "Add", "Mul", "Mul"]
            } else {
                &["Gelu", "Gelu"]
            };
            assert_eq!(ops, expected, "opset {opset}");
            let bytes = protobuf::Message::write_to_bytes(&model).unwrap();
            let back = import_bytes(&bytes, Path::new("."), &ImportOptions::default()).unwrap_or_else(|e| panic!("opset {opset}: {e}"));
            let text = pipewright_ir::text::print_graph(&back);
            assert!(text.contains("Gelu[approximate=\"tanh\"](%v0)") && text.contains("Gelu(%v1)"), "opset {opset}: {text}");
            assert_eq!(back.node_count(), 2, "opset {opset}: {text}");
        }
    }

    /// ONNX has no stop-gradient: the stage model computes it as the `Identity` it is in
    /// inference, under the node's name, and the text form reads the op back.
    #[test]
    fn stop_gradient_is_written_as_identity() {
        let text = "graph \"g\" ir_version=8 opset=17 producer=\"t\" batch=N(\"N\", dynamic) {\n  %v0: f32[N,8] = input \"x\"\n  %v1: f32[N,8] = StopGradient(%v0)  # n0 \"detach:x\"\n  %v2: f32[N,8] = Add(%v0, %v1)  # n1 \"add\"\n  return %v2 \"y\"\n}\n";
        assert_eq!(pipewright_ir::text::print_graph(&parse_graph(text).unwrap()), text);
        let model = exported(text);
        let nodes: Vec<(&str, &str)> = model.graph.node.iter().map(|n| (n.name.as_str(), n.op_type.as_str())).collect();
        assert_eq!(nodes, [("detach:x", "Identity"), ("add", "Add")]);
    }

    #[test]
    fn attention_is_spelled_out_before_opset_23_and_fused_again_on_import() {
        let masks = [("f32[1,1,8,8]", "Add"), ("bool[1,1,8,8]", "Where")];
        for (opset, spelled) in [(17, true), (23, false)] {
            for (mask_type, mask_op) in masks {
                let text = format!(
                    "graph \"g\" ir_version=8 opset={opset} producer=\"t\" batch=N(\"N\", dynamic) {{\n  %v0: f32[N,4,8,16] = input \"q\"\n  %v1: f32[N,4,8,16] = input \"k\"\n  %v2: f32[N,4,8,16] = input \"v\"\n  %v3: {mask_type} = const \"mask\"\n  %v4: f32[N,4,8,16] = Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v3)  # n0 \"attn\"\n  return %v4 \"y\"\n}}\n"
                );
                let model = exported(&text);
                let ops: Vec<&str> = model.graph.node.iter().map(|n| n.op_type.as_str()).collect();
                let expected: Vec<&str> = if spelled { vec!["Transpose", "MatMul", "Mul", mask_op, "Softmax", "IsNaN", "Where", "MatMul"] } else { vec!["Attention"] };
                assert_eq!(ops, expected, "opset {opset}, mask {mask_type}");
                let bytes = protobuf::Message::write_to_bytes(&model).unwrap();
                let back = import_bytes(&bytes, Path::new("."), &ImportOptions::default()).unwrap_or_else(|e| panic!("opset {opset}: {e}"));
                let printed = pipewright_ir::text::print_graph(&back);
                assert!(printed.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v3)"), "opset {opset}: {printed}");
                assert_eq!(back.node_count(), 1, "opset {opset}: {printed}");
            }
        }
    }

    #[test]
    fn attention_the_old_opsets_cannot_express_is_refused_by_name() {
        let text = "graph \"g\" ir_version=8 opset=17 producer=\"t\" batch=N(\"N\", dynamic) {\n  %v0: f32[N,4,8,16] = input \"q\"\n  %v1: f32[N,4,8,16] = input \"k\"\n  %v2: f32[N,4,8,16] = input \"v\"\n  %v3: f32[N,4,8,16] = Attention[is_causal=1](%v0, %v1, %v2)  # n0 \"attn\"\n  return %v3 \"y\"\n}\n";
        let mut g = parse_graph(text).unwrap();
        let mut map = StageMap::new(1);
        for n in g.topo_order().unwrap() {
            map.set(n, 0);
        }
        let stages = pipewright_passes::boundaries::insert_stage_boundaries(&mut g, &map).unwrap();
        let slices = slice_stages(&g, &stages).unwrap();
        let err = export_stage(&g, &slices[0]).err().expect("refused").to_string();
        assert_eq!(err, "stage 0: node \"attn\" cannot be written at the model's opset: only 4-D attention without a cache, causal flag, soft cap, window or extra outputs has a form before opset 23; export the model at opset 23");
    }
}
