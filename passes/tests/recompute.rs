//! The recomputation pass on real models: full recomputation stashes only stage inputs,
//! selective keeps matmul/conv outputs and sits between none and full, and a memory limit
//! is met greedily.

mod common;

use common::{contiguous, model};

use pipewright_ir::{Graph, Op, StageMap, ValueDef};
use pipewright_passes::boundaries::insert_stage_boundaries;
use pipewright_ops::op::OpClass;
use pipewright_passes::cost::{CostModel, Roofline};
use pipewright_core::Recompute;
use pipewright_passes::recompute::{decide_recomputation, Decision, RecomputePlan};



fn partitioned(name: &str, d: u32) -> (Graph, StageMap, CostModel) {
    let mut g = model(name);
    let stages = contiguous(&g, d);
    let table = insert_stage_boundaries(&mut g, &stages).expect("partitions");
    let cost = CostModel::new(&g, Roofline::default()).expect("costs");
    (g, table, cost)
}

const CASES: [(&str, u32); 4] = [
    ("mlp.onnx", 2),
    ("resnet18.onnx", 2),
    ("resnet18.onnx", 4),
    ("gpt2-tiny.onnx", 4),
];
const B: u64 = 4;

fn plan(
    g: &Graph,
    t: &StageMap,
    c: &CostModel,
    mode: Recompute,
    limit: Option<u64>,
) -> RecomputePlan {
    decide_recomputation(g, t, c, mode, limit, B)
}

#[test]
fn full_stashes_only_stage_inputs() {
    for (name, d) in CASES {
        let (g, t, c) = partitioned(name, d);
        let p = plan(&g, &t, &c, Recompute::Full, None);
        assert_eq!(p.stages.len(), d as usize);
        for v in p.stashed_values() {
            let ok = match g.value(v).def {
                ValueDef::Input => true,
                ValueDef::Node { node, .. } => matches!(g.node(node).op, Op::StageBoundary { .. }),
                ValueDef::Weight(_) => false,
            };
            assert!(ok, "{name}: {v} is stashed but is no stage input");
        }
        for st in &p.stages {
            assert_eq!(st.stash_bytes, st.input_bytes, "{name} stage {}", st.stage);
            assert_eq!(st.stashed_nodes, 0, "{name} stage {}", st.stage);
            if st.stage > 0 {
                assert!(
                    st.inputs
                        .iter()
                        .any(|v| matches!(g.value(*v).def, ValueDef::Node { .. })),
                    "{name}: stage {} reads no boundary",
                    st.stage
                );
            }
            // The whole forward (boundaries aside, which move data only) is rerun.
            assert!(
                (st.recompute_flops - st.forward_flops).abs() <= 1e-6 * st.forward_flops.max(1.0)
            );
        }
        for n in g.node_ids() {
            let want = if matches!(g.node(n).op, Op::StageBoundary { .. }) {
                "stash"
            } else {
                "recompute"
            };
            assert_eq!(p.note(n).as_deref(), Some(want), "{name} {n}");
        }
    }
}

#[test]
fn none_stashes_everything_and_recomputes_nothing() {
    for (name, d) in CASES {
        let (g, t, c) = partitioned(name, d);
        let p = plan(&g, &t, &c, Recompute::None, None);
        assert_eq!(p.total_recompute_flops(), 0.0, "{name}");
        for n in g.node_ids() {
            assert_eq!(p.node(n), Some(Decision::Stash), "{name} {n}");
        }
    }
}

#[test]
fn selective_keeps_matmul_and_conv_outputs_between_none_and_full() {
    for (name, d) in CASES {
        let (g, t, c) = partitioned(name, d);
        let none = plan(&g, &t, &c, Recompute::None, None);
        let full = plan(&g, &t, &c, Recompute::Full, None);
        let sel = plan(&g, &t, &c, Recompute::Selective, None);
        let mut kept = 0;
        for n in g.node_ids() {
            let heavy = matches!(c.class(n), OpClass::MatMul | OpClass::Conv);
            let boundary = matches!(g.node(n).op, Op::StageBoundary { .. });
            let want = if heavy || boundary {
                Decision::Stash
            } else {
                Decision::Recompute
            };
            assert_eq!(sel.node(n), Some(want), "{name} {n} {}", g.node(n).op);
            kept += heavy as usize;
        }
        assert!(kept > 0, "{name} has no matmul/conv");
        for s in 0..d as usize {
            let (a, b, f) = (
                none.stages[s].stash_bytes,
                sel.stages[s].stash_bytes,
                full.stages[s].stash_bytes,
            );
            assert!(
                f <= b && b <= a,
                "{name} stage {s}: full {f} <= selective {b} <= none {a}"
            );
            assert!(sel.stages[s].recompute_flops <= full.stages[s].recompute_flops);
        }
        assert!(full.total_stash_bytes() < sel.total_stash_bytes(), "{name}");
        assert!(sel.total_stash_bytes() < none.total_stash_bytes(), "{name}");
        // Recomputing the cheap ops saves most of the flops of a full rerun.
        assert!(
            sel.total_recompute_flops() < 0.5 * full.total_recompute_flops(),
            "{name}"
        );
    }
}

#[test]
fn selective_with_a_limit_fits_and_drops_cheap_ops_first() {
    let (g, t, c) = partitioned("gpt2-tiny.onnx", 2);
    let none = plan(&g, &t, &c, Recompute::None, None);
    let full = plan(&g, &t, &c, Recompute::Full, None);
    // Halfway between full and none in every stage.
    let limit = (0..2)
        .map(|s| (none.stages[s].stash_bytes + full.stages[s].stash_bytes) / 2)
        .min()
        .unwrap();
    let p = plan(&g, &t, &c, Recompute::Selective, Some(limit));
    for st in &p.stages {
        assert!(
            st.fits,
            "stage {} over the limit: {} > {limit}",
            st.stage, st.stash_bytes
        );
        assert!(st.stash_bytes <= limit);
    }
    // Some matmul output survives while elementwise outputs were dropped first: no
    // elementwise output with bytes is stashed while a matmul output was recomputed.
    let mm_recomputed = g
        .node_ids()
        .any(|n| c.class(n) == OpClass::MatMul && p.node(n) == Some(Decision::Recompute));
    let ew_stashed = g.node_ids().any(|n| {
        c.class(n) == OpClass::Elementwise
            && p.node(n) == Some(Decision::Stash)
            && c.node(n).fwd_flops.at(B) > 0.0
    });
    assert!(
        !(mm_recomputed && ew_stashed),
        "a matmul was recomputed while cheap elementwise outputs stayed stashed"
    );
    // A limit below the stage inputs cannot be met: reported, and everything is recomputed.
    let tiny = plan(&g, &t, &c, Recompute::Selective, Some(1));
    assert!(tiny.stages.iter().any(|s| !s.fits));
    assert_eq!(tiny.total_stash_bytes(), full.total_stash_bytes());
    // A generous limit stashes everything.
    let roomy = plan(&g, &t, &c, Recompute::Selective, Some(u64::MAX));
    assert_eq!(roomy.total_stash_bytes(), none.total_stash_bytes());
}

#[test]
fn stash_scales_with_the_microbatch() {
    let (g, t, c) = partitioned("mlp.onnx", 2);
    let p1 = decide_recomputation(&g, &t, &c, Recompute::None, None, 1);
    let p8 = decide_recomputation(&g, &t, &c, Recompute::None, None, 8);
    assert!(p8.total_stash_bytes() > p1.total_stash_bytes());
    assert!(p1.text().contains("stage 1"));
}
