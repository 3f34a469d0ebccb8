//! The partition pass on real models: every crossing goes through boundary nodes, skip
//! tensors are forwarded through the stages in between, and bad assignments are refused.

mod common;

use common::{contiguous, model};

use pipewright_ir::{verify_stages, Graph, Op, StageMap};
use pipewright_passes::boundaries::{insert_stage_boundaries, BoundaryError};



fn boundaries(g: &Graph) -> Vec<(u32, u32)> {
    g.node_ids()
        .filter_map(|n| match g.node(n).op {
            Op::StageBoundary { from, to } => Some((from, to)),
            _ => None,
        })
        .collect()
}

#[test]
fn crossings_go_through_boundaries() {
    for (name, d) in [("gpt2-tiny.onnx", 4), ("resnet18.onnx", 2), ("resnet18.onnx", 4), ("bert-tiny.onnx", 3)] {
        let mut g = model(name);
        let before = g.node_count();
        let stages = contiguous(&g, d);
        let table = insert_stage_boundaries(&mut g, &stages).unwrap_or_else(|e| panic!("{name}: {e}"));
        verify_stages(&g, &table).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        let b = boundaries(&g);
        assert_eq!(g.node_count(), before + b.len());
        for s in 0..d - 1 {
            assert!(b.contains(&(s, s + 1)), "{name}: no crossing from stage {s}");
        }
        assert!(b.iter().all(|(f, t)| t == &(f + 1)), "{name}: a boundary skips a stage");
    }
}

#[test]
fn a_skip_connection_is_forwarded_through_every_stage_it_crosses() {
    // fc1's output is read by relu (stage 1) and by add (stage 2): it crosses two cuts.
    let text = include_str!("filetests/partition_skip_forwarded.pwir");
    let input = text.split("// ----- expect -----").next().unwrap();
    let mut g = pipewright_ir::parse_graph(input).unwrap();
    let order = g.topo_order().unwrap();
    let mut stages = StageMap::new(3);
    for (i, n) in order.iter().enumerate() {
        stages.set(*n, [0, 1, 2, 2][i]);
    }
    let table = insert_stage_boundaries(&mut g, &stages).expect("partitions");
    let chained = g.node_ids().any(|n| {
        let node = g.node(n);
        matches!(node.op, Op::StageBoundary { .. })
            && node.inputs[0].is_some_and(|v| match g.value(v).def {
                pipewright_ir::ValueDef::Node { node: p, .. } => matches!(g.node(p).op, Op::StageBoundary { .. }),
                _ => false,
            })
    });
    assert!(chained, "no value was forwarded through an intermediate stage");
    assert_eq!(table.num_stages, 3);
}

/// gpt2-tiny in quarters: its attention masks (built from constants) and the transposed LM
/// head (from the tied embedding) are computed again in every stage that reads them; no
/// boundary carries a value computed from weights alone.
#[test]
fn values_computed_from_weights_alone_never_cross() {
    let mut g = model("gpt2-tiny.onnx");
    let stages = contiguous(&g, 4);
    insert_stage_boundaries(&mut g, &stages).expect("partitions");
    let order = g.topo_order().unwrap();
    let mut from_weights: Vec<bool> = g.value_ids().map(|v| matches!(g.value(v).def, pipewright_ir::ValueDef::Weight(_))).collect();
    for &n in &order {
        let node = g.node(n);
        let derived = !matches!(node.op, Op::StageBoundary { .. }) && node.inputs.iter().flatten().next().is_some() && node.inputs.iter().flatten().all(|v| from_weights[v.index()]);
        for v in node.outputs.iter().flatten() {
            from_weights[v.index()] = derived;
        }
    }
    let crossing: Vec<&str> = order
        .iter()
        .map(|&n| g.node(n))
        .filter(|node| matches!(node.op, Op::StageBoundary { .. }) && node.inputs[0].is_some_and(|v| from_weights[v.index()]))
        .map(|node| node.name.as_str())
        .collect();
    assert!(crossing.is_empty(), "weight-derived values cross: {crossing:?}");
    assert!(g.node_ids().any(|n| g.node(n).name.ends_with("@stage3")), "some weight-derived node was copied into the last stage");
}

#[test]
fn a_read_in_an_earlier_stage_is_refused() {
    let mut g = model("mlp.onnx");
    let order = g.topo_order().unwrap();
    let mut stages = StageMap::new(2);
    for (i, n) in order.iter().enumerate() {
        stages.set(*n, if i == 0 { 1 } else { 0 });
    }
    match insert_stage_boundaries(&mut g, &stages) {
        Err(BoundaryError::Backward { producer_stage: 1, consumer_stage: 0, .. }) => {}
        other => panic!("expected a backward-crossing error, got {other:?}"),
    }
}

#[test]
fn the_stage_verifier_rejects_a_crossing_without_boundary() {
    let g = model("mlp.onnx");
    let stages = contiguous(&g, 2);
    let errs = verify_stages(&g, &stages).expect_err("unpartitioned crossing must be reported");
    assert!(errs.iter().any(|e| e.to_string().contains("without a stage boundary")), "{errs:?}");
}
