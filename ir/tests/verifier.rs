//! `verify` on deliberately broken graphs built through the public `Graph` API: every
//! problem is reported, and ids are checked before anything that would index by them.

mod common;

use pipewright_ops::op::{BinaryOp, UnaryOp};
use pipewright_ir::{
    verify, DType, Dim, Edge, Graph, ImportOptions, ModelMeta, Node, NodeId, Op, Shape, TensorData, TensorType, Value, ValueDef,
    ValueId, VerifyError, Weight,
};

fn f32_ty(dims: &[Dim]) -> TensorType {
    TensorType::new(DType::F32, Shape(dims.to_vec()))
}

fn n4() -> TensorType {
    f32_ty(&[Dim::N, Dim::Fixed(4)])
}

fn weight(name: &str, dims: &[i64]) -> Value {
    let n: i64 = dims.iter().product();
    let data = TensorData::from_f64s(DType::F32, dims.to_vec(), &vec![0.5; n as usize]);
    Value { name: name.into(), ty: TensorType::new(DType::F32, Shape::fixed(dims)), def: ValueDef::Weight(Weight { data, trainable: true }) }
}

/// `y = Relu(x)`, `z = Add(y, w)` with `x: f32[N,4]`, `w: f32[4]`; outputs `z`.
struct Base {
    g: Graph,
    x: ValueId,
    w: ValueId,
    relu: NodeId,
    y: ValueId,
    add: NodeId,
    z: ValueId,
}

fn base() -> Base {
    let mut g = Graph::new(ModelMeta { graph_name: "broken".into(), opset: 13, ..ModelMeta::default() });
    let x = g.add_value(Value { name: "x".into(), ty: n4(), def: ValueDef::Input });
    let w = g.add_value(weight("w", &[4]));
    let relu = g.add_node("relu".into(), Op::Unary(UnaryOp::Relu), vec![Some(x)], vec![Some(("y".into(), n4()))]);
    let y = g.node(relu).outputs[0].expect("y");
    let add = g.add_node("add".into(), Op::Binary(BinaryOp::Add), vec![Some(y), Some(w)], vec![Some(("z".into(), n4()))]);
    let z = g.node(add).outputs[0].expect("z");
    g.set_outputs(vec![z]);
    Base { g, x, w, relu, y, add, z }
}

/// A value id that does not exist in `base()`'s graph: ids are indices, so take one from
/// a bigger graph.
fn foreign_value_id() -> ValueId {
    let mut other = Graph::default();
    let ids: Vec<ValueId> = (0..50).map(|i| other.add_value(weight(&format!("p{i}"), &[1]))).collect();
    *ids.last().expect("ids")
}

fn errors(g: &Graph) -> Vec<VerifyError> {
    verify(g).expect_err("the broken graph passed verification")
}

#[test]
fn well_formed_graph_verifies() {
    let b = base();
    verify(&b.g).expect("the base graph is well formed");
    assert_eq!(b.g.inputs(), &[b.x]);
    assert_eq!(b.g.outputs(), &[b.z]);
    assert_eq!(b.g.topo_order().unwrap(), vec![b.relu, b.add]);
    let _ = b.w;
}

#[test]
fn out_of_range_input_id() {
    let mut b = base();
    let far = foreign_value_id();
    let bad = b.g.push_raw_node(Node { name: "bad".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(far)], outputs: vec![None] });
    let errs = errors(&b.g);
    assert_eq!(errs, vec![VerifyError::ValueOutOfRange { node: bad, value: far }]);
    let msg = errs[0].to_string();
    assert!(msg.contains(&bad.to_string()) && msg.contains(&far.to_string()) && msg.contains("does not exist"), "{msg}");
}

#[test]
fn out_of_range_output_ids() {
    let mut b = base();
    let far = foreign_value_id();
    let bad = b.g.push_raw_node(Node { name: "bad".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(b.x)], outputs: vec![Some(far)] });
    b.g.set_outputs(vec![b.z, far]);
    let errs = errors(&b.g);
    assert_eq!(errs, vec![VerifyError::ValueOutOfRange { node: bad, value: far }, VerifyError::GraphOutputOutOfRange { value: far }]);
    assert!(errs[1].to_string().contains("graph output"), "{}", errs[1]);
}

#[test]
fn ids_are_checked_before_semantics() {
    let mut b = base();
    // Semantic problems: a second producer of y, and a type that inference disagrees with...
    b.g.push_raw_node(Node { name: "dup".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(b.x)], outputs: vec![Some(b.y)] });
    b.g.value_mut(b.z).ty = f32_ty(&[Dim::N, Dim::Fixed(7)]);
    // ...and an id problem, which must be the only thing reported (the semantic checks
    // index by id and must not run on a graph whose ids do not resolve).
    let far = foreign_value_id();
    let bad = b.g.push_raw_node(Node { name: "bad".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(far)], outputs: vec![None] });
    assert_eq!(errors(&b.g), vec![VerifyError::ValueOutOfRange { node: bad, value: far }]);
}

#[test]
fn value_with_two_producers() {
    let mut b = base();
    let dup = b.g.push_raw_node(Node { name: "dup".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(b.x)], outputs: vec![Some(b.y)] });
    let errs = errors(&b.g);
    assert!(errs.contains(&VerifyError::TwoProducers { value: b.y, first: b.relu, second: dup }), "{errs:?}");
    // y's definition names relu, so dup's claim is also a producer mismatch.
    assert!(errs.contains(&VerifyError::ProducerMismatch { value: b.y, node: dup }), "{errs:?}");
    let msg = errs.iter().find(|e| matches!(e, VerifyError::TwoProducers { .. })).unwrap().to_string();
    assert!(msg.contains(&b.relu.to_string()) && msg.contains(&dup.to_string()), "{msg}");
}

#[test]
fn output_whose_definition_names_another_node() {
    let mut b = base();
    // z claims to come from relu, but add lists it.
    b.g.value_mut(b.z).def = ValueDef::Node { node: b.relu, slot: 0 };
    let errs = errors(&b.g);
    assert!(errs.contains(&VerifyError::ProducerMismatch { value: b.z, node: b.add }), "{errs:?}");
}

#[test]
fn input_defined_by_nothing() {
    let mut b = base();
    // A value claiming to be relu's second output, which relu does not have.
    let ghost = b.g.add_value(Value { name: "ghost".into(), ty: n4(), def: ValueDef::Node { node: b.relu, slot: 1 } });
    let user = b.g.add_node("user".into(), Op::Unary(UnaryOp::Neg), vec![Some(ghost)], vec![Some(("u".into(), n4()))]);
    let errs = errors(&b.g);
    assert_eq!(errs, vec![VerifyError::UndefinedInput { node: user, slot: 0, value: ghost }]);
    let msg = errs[0].to_string();
    assert!(msg.contains(&ghost.to_string()) && msg.contains("no node, weight or input defines"), "{msg}");
}

#[test]
fn operand_without_its_edge() {
    let mut b = base();
    // Reads y (produced by relu) but no petgraph edge says so.
    let lonely = b.g.push_raw_node(Node { name: "lonely".into(), op: Op::Unary(UnaryOp::Neg), inputs: vec![Some(b.y)], outputs: vec![None] });
    assert_eq!(errors(&b.g), vec![VerifyError::EdgeMismatch { node: lonely }]);
}

#[test]
fn edge_without_its_operand() {
    let mut b = base();
    // An extra edge from relu into add that add's operands do not account for.
    b.g.push_raw_edge(b.relu, b.add, Edge { value: b.y, slot: 1 });
    assert_eq!(errors(&b.g), vec![VerifyError::EdgeMismatch { node: b.add }]);
}

#[test]
fn type_that_disagrees_with_inference() {
    let mut b = base();
    b.g.value_mut(b.y).ty = f32_ty(&[Dim::N, Dim::Fixed(5)]);
    let errs = errors(&b.g);
    // y's stored type is wrong at relu; add then infers from the wrong type and fails.
    assert_eq!(
        errs[0],
        VerifyError::TypeMismatch { node: b.relu, value: b.y, stored: f32_ty(&[Dim::N, Dim::Fixed(5)]), inferred: n4() }
    );
    let msg = errs[0].to_string();
    assert!(msg.contains("f32[N,5]") && msg.contains("f32[N,4]"), "{msg}");
    assert!(errs.iter().any(|e| matches!(e, VerifyError::InferenceFailed { node, .. } if *node == b.add)), "{errs:?}");
}

#[test]
fn dtype_that_disagrees_with_inference() {
    let mut b = base();
    b.g.value_mut(b.z).ty.dtype = DType::F16;
    assert_eq!(
        errors(&b.g),
        vec![VerifyError::TypeMismatch { node: b.add, value: b.z, stored: TensorType::new(DType::F16, n4().shape), inferred: n4() }]
    );
}

#[test]
fn batch_multiple_that_disagrees_with_inference() {
    let mut b = base();
    b.g.value_mut(b.z).ty = f32_ty(&[Dim::Batch(2), Dim::Fixed(4)]);
    let errs = errors(&b.g);
    assert!(matches!(&errs[..], [VerifyError::TypeMismatch { node, .. }] if *node == b.add), "{errs:?}");
    assert!(errs[0].to_string().contains("f32[2N,4]"), "{}", errs[0]);
}

#[test]
fn inference_failure() {
    let mut b = base();
    let w5 = b.g.add_value(weight("w5", &[5]));
    let bad = b.g.add_node("bad_add".into(), Op::Binary(BinaryOp::Add), vec![Some(b.z), Some(w5)], vec![Some(("q".into(), n4()))]);
    let errs = errors(&b.g);
    assert!(matches!(&errs[..], [VerifyError::InferenceFailed { node, reason }] if *node == bad && reason.contains("broadcast")), "{errs:?}");
}

#[test]
fn every_type_problem_is_reported() {
    let mut b = base();
    // Two independent mistakes: z's type, and a second branch u = Neg(x) typed wrong.
    b.g.value_mut(b.z).ty = f32_ty(&[Dim::Fixed(3), Dim::Fixed(4)]);
    let neg = b.g.add_node("neg".into(), Op::Unary(UnaryOp::Neg), vec![Some(b.x)], vec![Some(("u".into(), f32_ty(&[Dim::N, Dim::Fixed(9)])))]);
    let u = b.g.node(neg).outputs[0].unwrap();
    let errs = errors(&b.g);
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(errs.iter().any(|e| matches!(e, VerifyError::TypeMismatch { node, value, .. } if *node == b.add && *value == b.z)), "{errs:?}");
    assert!(errs.iter().any(|e| matches!(e, VerifyError::TypeMismatch { node, value, .. } if *node == neg && *value == u)), "{errs:?}");
}

#[test]
fn cycle() {
    let mut g = Graph::new(ModelMeta::default());
    // Placeholder definitions, fixed once the node ids exist.
    let va = g.add_value(weight("a", &[4]));
    let vb = g.add_value(weight("b", &[4]));
    let na = g.push_raw_node(Node { name: "a".into(), op: Op::Unary(UnaryOp::Relu), inputs: vec![Some(vb)], outputs: vec![Some(va)] });
    let nb = g.push_raw_node(Node { name: "b".into(), op: Op::Unary(UnaryOp::Neg), inputs: vec![Some(va)], outputs: vec![Some(vb)] });
    g.value_mut(va).def = ValueDef::Node { node: na, slot: 0 };
    g.value_mut(vb).def = ValueDef::Node { node: nb, slot: 0 };
    g.push_raw_edge(nb, na, Edge { value: vb, slot: 0 });
    g.push_raw_edge(na, nb, Edge { value: va, slot: 0 });
    g.set_outputs(vec![va]);
    let at = g.topo_order().expect_err("a cycle has no topological order");
    assert!(at == na || at == nb, "the cycle is a-b, not {at}");
    let errs = errors(&g);
    assert!(matches!(&errs[..], [VerifyError::Cycle { node }] if *node == na || *node == nb), "{errs:?}");
    assert!(errs[0].to_string().contains("cycle"), "{}", errs[0]);
}

#[test]
fn cycle_beside_a_healthy_part() {
    let mut b = base();
    let va = b.g.add_value(weight("a", &[4]));
    let vb = b.g.add_value(weight("b", &[4]));
    let na = b.g.push_raw_node(Node { name: "a".into(), op: Op::Binary(BinaryOp::Add), inputs: vec![Some(b.z), Some(vb)], outputs: vec![Some(va)] });
    let nb = b.g.push_raw_node(Node { name: "b".into(), op: Op::Unary(UnaryOp::Neg), inputs: vec![Some(va)], outputs: vec![Some(vb)] });
    b.g.value_mut(va).def = ValueDef::Node { node: na, slot: 0 };
    b.g.value_mut(vb).def = ValueDef::Node { node: nb, slot: 0 };
    b.g.push_raw_edge(b.add, na, Edge { value: b.z, slot: 0 });
    b.g.push_raw_edge(nb, na, Edge { value: vb, slot: 1 });
    b.g.push_raw_edge(na, nb, Edge { value: va, slot: 0 });
    let errs = errors(&b.g);
    assert!(matches!(&errs[..], [VerifyError::Cycle { node }] if *node == na || *node == nb), "{errs:?}");
}

#[test]
fn imported_model_verifies_and_breaks_when_edited() {
    let path = common::corpus().join("models/mlp.onnx");
    let mut g = pipewright_ir::import_model(&path, &ImportOptions::default()).expect("mlp imports");
    verify(&g).expect("an imported graph verifies");
    let first = g.topo_order().unwrap()[0];
    let out = g.node(first).outputs[0].expect("an output");
    g.value_mut(out).ty.shape.0[1] = Dim::Fixed(3);
    let errs = errors(&g);
    assert!(matches!(&errs[0], VerifyError::TypeMismatch { node, value, .. } if *node == first && *value == out), "{errs:?}");
    // Restore it, then rename an op in place to one with other semantics.
    g.value_mut(out).ty.shape.0[1] = Dim::Fixed(256);
    verify(&g).expect("restored");
    g.node_mut(first).op = Op::MatMul;
    let errs: Vec<String> = errors(&g).iter().map(ToString::to_string).collect();
    assert_eq!(errs, [format!("{first}: shape inference fails: inner dimensions differ: [N,64] x [256,64]")]);
}
