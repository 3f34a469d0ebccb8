//! Control flow, sequences and optionals resolved at import: If inlines the branch its
//! known condition selects, Loop and Scan unroll (reading outer-scope values from their
//! bodies), sequence ops leave only tensor ops behind, and data-dependent control is
//! refused naming the node.

mod common;

use std::path::Path;

use common::*;
use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::{AttributeProto, GraphProto, NodeProto, ValueInfoProto};
use pipewright_ir::{import_bytes, verify, BatchMode, Graph, ImportError, ImportOptions};
use protobuf::{EnumOrUnknown, MessageField};

fn try_import(m: &ModelBuilder, batch: BatchMode) -> Result<Graph, ImportError> {
    import_bytes(&m.bytes(), Path::new("."), &ImportOptions { batch, ..ImportOptions::default() })
}

fn import(m: &ModelBuilder, batch: BatchMode) -> Graph {
    let g = try_import(m, batch).unwrap_or_else(|e| panic!("import failed: {e}"));
    verify(&g).unwrap_or_else(|e| panic!("imported graph fails verification: {e:?}"));
    g
}

fn ty(g: &Graph, v: pipewright_ir::ValueId) -> String {
    g.value(v).ty.to_string()
}

fn output_types(g: &Graph) -> Vec<String> {
    g.outputs().iter().map(|&v| ty(g, v)).collect()
}

fn op_names(g: &Graph) -> Vec<&'static str> {
    g.topo_order().unwrap().into_iter().map(|n| g.node(n).op.name()).collect()
}

/// A subgraph attribute: `inputs` (untyped: the importer binds them), `nodes`, `outputs`.
fn graph_attr(name: &str, inputs: &[&str], nodes: Vec<NodeProto>, outputs: &[&str]) -> AttributeProto {
    let vi = |n: &&str| ValueInfoProto { name: n.to_string(), ..Default::default() };
    let g = GraphProto {
        name: format!("{name}_graph"),
        input: inputs.iter().map(vi).collect(),
        output: outputs.iter().map(vi).collect(),
        node: nodes,
        ..Default::default()
    };
    AttributeProto { name: name.into(), type_: EnumOrUnknown::new(AttributeType::GRAPH), g: MessageField::some(g), ..Default::default() }
}

fn if_model(cond_nodes: Vec<NodeProto>) -> ModelBuilder {
    let then_b = graph_attr("then_branch", &[], vec![node("Relu", "r", &["x"], &["t"])], &["t"]);
    let else_b = graph_attr("else_branch", &[], vec![node("Neg", "n", &["x"], &["e"])], &["e"]);
    let mut m = ModelBuilder::new(18).input_f32("x", &[2, 3]).init(tensor_i64("one", &[], &[1])).init(tensor_i64("two", &[], &[2]));
    for n in cond_nodes {
        m = m.node(n);
    }
    m.node(node("If", "branch", &["c"], &["y"]).attr(then_b).attr(else_b)).output("y")
}

#[test]
fn if_inlines_the_branch_its_known_condition_takes() {
    let g = import(&if_model(vec![node("Greater", "gt", &["two", "one"], &["c"])]), BatchMode::Auto);
    assert_eq!(op_names(&g), ["Relu"]);
    let g = import(&if_model(vec![node("Less", "lt", &["two", "one"], &["c"])]), BatchMode::Auto);
    assert_eq!(op_names(&g), ["Neg"]);
    assert_eq!(output_types(&g), ["f32[N,3]"]);
    // A condition computed from data is a run-time branch: refused, naming the node.
    let data_cond = vec![node("ReduceSum", "s", &["x"], &["sum"]).int("keepdims", 0), node("Greater", "gt", &["sum", "zero"], &["c"])];
    let m = if_model(data_cond).init(tensor_f32("zero", &[], &[0.0]));
    let e = try_import(&m, BatchMode::Auto).expect_err("a data-dependent If must be refused").to_string();
    assert!(e.contains("\"branch\"") && e.contains("not known at import"), "{e}");
}

/// Loop body: the carried `y` plus the outer `x`, also emitted as a scan output.
fn loop_model(trips: &[i64], cond: &str) -> ModelBuilder {
    let body = graph_attr(
        "body",
        &["i", "c_in", "y_in"],
        vec![node("Identity", "keep", &["c_in"], &["c_out"]), node("Add", "acc", &["y_in", "x"], &["y_out"]), node("Identity", "emit", &["y_out"], &["s"])],
        &["c_out", "y_out", "s"],
    );
    ModelBuilder::new(18)
        .input_f32("x", &[2, 4])
        .init(tensor_i64("m", &[], trips))
        .node(node("Loop", "loop", &["m", cond, "x"], &["y", "scan"]).attr(body))
        .output("y")
        .output("scan")
}

#[test]
fn loop_unrolls_with_a_known_trip_count() {
    let g = import(&loop_model(&[3], ""), BatchMode::Auto);
    assert_eq!(op_names(&g).iter().filter(|o| **o == "Add").count(), 3);
    assert_eq!(output_types(&g), ["f32[N,4]", "f32[3,N,4]"]);
    // No trip count, no condition input: a loop without an import-time bound.
    let body = graph_attr("body", &["i", "c_in", "y_in"], vec![node("Identity", "keep", &["c_in"], &["c_out"])], &["c_out", "y_in"]);
    let m = ModelBuilder::new(18).input_f32("x", &[2, 4]).node(node("Loop", "forever", &["", "", "x"], &["y"]).attr(body)).output("y");
    let e = try_import(&m, BatchMode::Auto).expect_err("an unbounded loop must be refused").to_string();
    assert!(e.contains("\"forever\"") && e.contains("iterations"), "{e}");
}

#[test]
fn scan_unrolls_over_the_sequence_with_directions_and_axes() {
    let body = graph_attr(
        "body",
        &["s_in", "x_t"],
        vec![node("Add", "acc", &["s_in", "x_t"], &["s_out"]), node("Identity", "emit", &["s_out"], &["o"])],
        &["s_out", "o"],
    );
    let m = ModelBuilder::new(18)
        .input_f32("s0", &[4])
        .input_f32("xs", &[3, 4])
        .node(node("Scan", "scan", &["s0", "xs"], &["s", "z"]).attr(body).int("num_scan_inputs", 1).ints("scan_input_directions", &[1]).ints("scan_output_axes", &[1]))
        .output("s")
        .output("z");
    // The scanned axis 0 of a graph input is unrolled, so it is not made the batch.
    let g = import(&m, BatchMode::Auto);
    assert_eq!(output_types(&g), ["f32[4]", "f32[4,3]"]);
    assert_eq!(op_names(&g).iter().filter(|o| **o == "Gather").count(), 3);
}

#[test]
fn sequences_resolve_to_tensor_ops() {
    let m = ModelBuilder::new(18)
        .input_f32("x", &[2, 6])
        .init(tensor_i64("four", &[], &[4]))
        .init(tensor_i64("zero", &[], &[0]))
        .init(tensor_i64("last", &[], &[-1]))
        .node(node("SplitToSequence", "split", &["x", "four"], &["pieces"]).int("axis", 1))
        .node(node("SequenceInsert", "ins", &["pieces", "x", "zero"], &["with_x"]))
        .node(node("SequenceErase", "erase", &["with_x", "last"], &["two"]))
        .node(node("SequenceLength", "len", &["two"], &["n"]))
        .node(node("SequenceAt", "at", &["two", "last"], &["first_piece"]))
        .node(node("ConcatFromSequence", "cat", &["two"], &["joined"]).int("axis", 1))
        .output("n")
        .output("first_piece")
        .output("joined");
    let g = import(&m, BatchMode::Fixed);
    assert_eq!(output_types(&g), ["i64[]", "f32[2,4]", "f32[2,10]"]);
    let n = g.value(g.outputs()[0]).def.clone();
    assert!(matches!(n, pipewright_ir::ValueDef::Weight(w) if w.data.to_i64s() == [2]));
    // Pieces of 4 and 2 columns cannot be stacked.
    let m = m.node(node("ConcatFromSequence", "stack", &["pieces"], &["stacked"]).int("axis", 0).int("new_axis", 1)).output("stacked");
    let e = try_import(&m, BatchMode::Fixed).err().expect("pieces of 4 and 2 columns do not stack");
    assert_eq!(e.to_string(), "node \"stacked\" (Concat): shape inference failed: [1,2,4] and [1,2,2] differ outside axis 0");
}

#[test]
fn optionals_are_present_or_empty_at_import() {
    let m = ModelBuilder::new(18)
        .input_f32("x", &[2, 3])
        .node(node("Optional", "some", &["x"], &["o"]))
        .node(node("OptionalHasElement", "has", &["o"], &["h"]))
        .node(node("OptionalGetElement", "get", &["o"], &["y"]))
        .node(node("OptionalHasElement", "none", &[""], &["h0"]))
        .output("h")
        .output("y")
        .output("h0");
    let g = import(&m, BatchMode::Fixed);
    assert_eq!(output_types(&g), ["bool[]", "f32[2,3]", "bool[]"]);
    let flag = |i: usize| match &g.value(g.outputs()[i]).def {
        pipewright_ir::ValueDef::Weight(w) => w.data.to_i64s(),
        other => panic!("not a constant: {other:?}"),
    };
    assert_eq!((flag(0), flag(2)), (vec![1], vec![0]));
    // A sequence where a tensor op needs a tensor is an error naming the node.
    let m = ModelBuilder::new(18)
        .input_f32("x", &[2, 3])
        .node(node("SequenceConstruct", "seq", &["x", "x"], &["s"]))
        .node(node("Relu", "relu", &["s"], &["y"]))
        .output("y");
    let e = try_import(&m, BatchMode::Fixed).expect_err("Relu of a sequence").to_string();
    assert!(e.contains("\"relu\"") && e.contains("sequence"), "{e}");
}

/// FlexAttention (ai.onnx.preview) is composed at import: grouped K/V heads gathered,
/// the score modifier inlined between the two matmuls (reading its own initializer), the
/// result cast back to V's type.
#[test]
fn flex_attention_composes_its_modifiers() {
    let mut score_mod = graph_attr("score_mod", &["s"], vec![node("Add", "bias", &["s", "b"], &["s_out"])], &["s_out"]);
    score_mod.g.as_mut().unwrap().initializer.push(tensor_f32("b", &[], &[0.5]));
    let m = ModelBuilder::new(26)
        .opset_import("ai.onnx.preview", 1)
        .input_f32("q", &[2, 4, 3, 8])
        .input_f32("k", &[2, 2, 5, 8])
        .input_f32("v", &[2, 2, 5, 6])
        .node(node("FlexAttention", "flex", &["q", "k", "v"], &["y"]).domain("ai.onnx.preview").attr(score_mod))
        .output("y");
    let g = import(&m, BatchMode::Auto);
    assert_eq!(output_types(&g), ["f32[N,4,3,6]"]);
    let ops = op_names(&g);
    for op in ["Gather", "MatMul", "Add", "Softmax"] {
        assert!(ops.contains(&op), "{op} missing from {ops:?}");
    }
    assert_eq!(ops.iter().filter(|o| **o == "MatMul").count(), 2);
}
