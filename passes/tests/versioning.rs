//! The weight-versioning pass: 2BW keeps two versions and needs m >= d, Flush and GPipe
//! one; BatchNorm running stats are constants; tied weights get a
//! gradient-sync group.

mod common;

use common::{contiguous, model};

use pipewright_ops::op::BatchNorm;
use pipewright_ir::{
    DType, Dim, Graph, ModelMeta, Op, Shape, StageMap, TensorData,
    TensorType, Value, ValueDef, Weight,
};
use pipewright_core::{Schedule, UpdateRule};
use pipewright_passes::boundaries::insert_stage_boundaries;
use pipewright_passes::versioning::{version_weights, VersionError, WeightKind};



fn partitioned(name: &str, d: u32) -> (Graph, StageMap) {
    let mut g = model(name);
    let stages = contiguous(&g, d);
    let table = insert_stage_boundaries(&mut g, &stages).expect("partitions");
    (g, table)
}

#[test]
fn two_bw_keeps_two_versions_of_every_trainable_weight() {
    for (name, d) in [("mlp.onnx", 2), ("resnet18.onnx", 4), ("gpt2-tiny.onnx", 4)] {
        let (g, t) = partitioned(name, d);
        let v = version_weights(&g, &t, Schedule::TwoBw, d, d).expect("versions");
        let trainable: Vec<_> = v.weights.iter().filter(|w| w.trainable).collect();
        assert!(!trainable.is_empty(), "{name}");
        for w in &trainable {
            assert!(w.versions.iter().all(|&k| k == 2), "{name} {}", w.name);
            assert_eq!(w.rule, UpdateRule::TwoBw);
        }
        for w in v.weights.iter().filter(|w| !w.trainable) {
            assert_eq!(w.rule, UpdateRule::Constant, "{name} {}", w.name);
            assert_eq!(w.max_versions(), 1);
        }
        // Every trainable weight is counted once per stage, twice over.
        let total: u64 = (0..d).map(|s| v.stage_bytes(s)).sum();
        let tied_extra: u64 = v
            .sync_groups
            .iter()
            .map(|gs| {
                let w = v.get(gs.value).unwrap();
                2 * w.bytes * (gs.stages.len() as u64 - 1)
            })
            .sum();
        assert_eq!(total, 2 * g.parameter_bytes() + tied_extra, "{name}");
        let reader = g
            .node_ids()
            .find(|&n| v.weights_of(n).iter().any(|w| w.trainable))
            .unwrap();
        let note = v.note(reader).unwrap();
        assert!(
            note.starts_with("w:%v") && note.contains(" x2 (2bw"),
            "{name}: {note}"
        );
        assert!(v.text().contains("W(t+1) = W(t) - lr * grad f(W(t-1))"), "{}", v.text());
    }
}

#[test]
fn two_bw_needs_at_least_d_microbatches() {
    let (g, t) = partitioned("gpt2-tiny.onnx", 4);
    assert_eq!(
        version_weights(&g, &t, Schedule::TwoBw, 4, 3).unwrap_err(),
        VersionError::TooFewMicrobatches { m: 3, d: 4 }
    );
    assert!(version_weights(&g, &t, Schedule::TwoBw, 4, 4).is_ok());
    assert!(version_weights(&g, &t, Schedule::TwoBw, 4, 8).is_ok());
    // Flush and GPipe accept any m.
    assert!(version_weights(&g, &t, Schedule::Flush, 4, 1).is_ok());
    // The depth must match the stage map.
    assert_eq!(
        version_weights(&g, &t, Schedule::Flush, 3, 4).unwrap_err(),
        VersionError::DepthMismatch { d: 3, stages: 4 }
    );
    assert!(VersionError::TooFewMicrobatches { m: 3, d: 4 }
        .to_string()
        .contains("m >= d"));
}

#[test]
fn flush_and_gpipe_keep_one_version() {
    let (g, t) = partitioned("resnet18.onnx", 2);
    for sched in [Schedule::Flush, Schedule::GPipe] {
        let v = version_weights(&g, &t, sched, 2, 1).unwrap();
        for w in &v.weights {
            assert_eq!(w.max_versions(), 1, "{sched:?} {}", w.name);
            if w.trainable {
                assert_eq!(w.rule, UpdateRule::Vanilla);
            }
        }
        assert_eq!(v.stage_bytes(0) + v.stage_bytes(1), g.parameter_bytes());
    }
}

fn f32s(dims: &[i64]) -> TensorData {
    let n: i64 = dims.iter().product();
    TensorData::from_f64s(DType::F32, dims.to_vec(), &vec![1.0; n as usize])
}

fn weight(g: &mut Graph, name: &str, dims: &[i64], trainable: bool) -> pipewright_ir::ValueId {
    g.add_value(Value {
        name: name.into(),
        ty: TensorType::new(DType::F32, Shape::fixed(dims)),
        def: ValueDef::Weight(Weight {
            data: f32s(dims),
            trainable,
        }),
    })
}

#[test]
fn batchnorm_running_stats_are_constants() {
    let mut g = Graph::new(ModelMeta {
        graph_name: "bn".into(),
        opset: 17,
        ir_version: 8,
        ..ModelMeta::default()
    });
    let x_ty = TensorType::new(
        DType::F32,
        Shape(vec![Dim::N, Dim::Fixed(4), Dim::Fixed(2), Dim::Fixed(2)]),
    );
    let x = g.add_value(Value {
        name: "x".into(),
        ty: x_ty.clone(),
        def: ValueDef::Input,
    });
    let scale = weight(&mut g, "bn.weight", &[4], true);
    let bias = weight(&mut g, "bn.bias", &[4], true);
    // The importer would mark float initializers trainable; the pass must still see stats.
    let mean = weight(&mut g, "bn.running_mean", &[4], true);
    let var = weight(&mut g, "bn.running_var", &[4], true);
    let bn = g.add_node(
        "bn".into(),
        Op::BatchNormalization(BatchNorm {
            epsilon: 1e-5,
            momentum: 0.9,
            training_mode: false,
        }),
        vec![Some(x), Some(scale), Some(bias), Some(mean), Some(var)],
        vec![Some(("y".into(), x_ty))],
    );
    let y = g.node(bn).outputs[0].unwrap();
    g.set_outputs(vec![y]);
    pipewright_ir::verify(&g).expect("valid graph");
    let mut t = StageMap::new(1);
    t.set(bn, 0);
    let v = version_weights(&g, &t, Schedule::TwoBw, 1, 1).unwrap();
    for (w, kind) in [
        (scale, WeightKind::Trainable),
        (bias, WeightKind::Trainable),
        (mean, WeightKind::RunningStat),
        (var, WeightKind::RunningStat),
    ] {
        let wv = v.get(w).unwrap();
        assert_eq!(wv.kind, kind, "{}", wv.name);
        assert_eq!(wv.trainable, kind == WeightKind::Trainable);
        assert_eq!(wv.max_versions(), if wv.trainable { 2 } else { 1 });
        if !wv.trainable {
            assert_eq!(wv.rule, UpdateRule::Constant);
        }
    }
    let note = v.note(bn).unwrap();
    assert!(note.contains(&format!("w:{mean} x1 (constant)")), "{note}");
    assert!(note.contains(&format!("w:{scale} x2 (2bw)")), "{note}");
    assert!(v.text().contains("2 running stats"), "{}", v.text());
}

#[test]
fn tied_embedding_gets_a_sync_group_on_gpt2() {
    let (g, t) = partitioned("gpt2-tiny.onnx", 2);
    let v = version_weights(&g, &t, Schedule::TwoBw, 2, 2).unwrap();
    // lm_head.weight is GPT-2's token embedding: `Gather` reads it in stage 0 and the LM
    // head reads `Transpose(lm_head.weight)`, forwarded to stage 1 through a boundary.
    let lm = v
        .weights
        .iter()
        .find(|w| w.name == "lm_head.weight")
        .expect("lm_head.weight");
    assert_eq!(lm.stages, vec![0, 1]);
    assert!(v.sync_groups.iter().any(|gs| gs.name == "lm_head.weight"));
    let tied: Vec<_> = v
        .weights
        .iter()
        .filter(|w| w.trainable && w.stages.len() > 1)
        .collect();
    assert!(
        !tied.is_empty(),
        "no weight of gpt2-tiny is read in both stages"
    );
    assert_eq!(v.sync_groups.len(), tied.len());
    for gs in &v.sync_groups {
        assert_eq!(gs.stages, vec![0, 1], "{}", gs.name);
        let w = v.get(gs.value).unwrap();
        assert_eq!(w.versions, vec![2, 2]);
    }
    assert!(v.text().contains("gradient sync groups"));
    let reader = g
        .node_ids()
        .find(|&n| {
            v.weights_of(n)
                .iter()
                .any(|w| w.stages.len() > 1 && w.trainable)
        })
        .unwrap();
    assert!(
        v.note(reader).unwrap().contains("sync 0+1"),
        "{:?}",
        v.note(reader)
    );
    // At 4 stages the transposed table is forwarded through stages 1 and 2, which only
    // pass it on: the copies live in stage 0 and the LM head's stage 3.
    let (g4, t4) = partitioned("gpt2-tiny.onnx", 4);
    let v4 = version_weights(&g4, &t4, Schedule::TwoBw, 4, 4).unwrap();
    let lm4 = v4
        .weights
        .iter()
        .find(|w| w.name == "lm_head.weight")
        .unwrap();
    assert_eq!(lm4.stages, vec![0, 3]);
}
