//! Cost model, planner and partition tests on small graphs built through the IR API and
//! on the shared corpus models.

use std::path::PathBuf;

use bytes::Bytes;
use pipewright_ops::op::UnaryOp;
use pipewright_ir::{
    DType, Dim, Graph, ModelMeta, NodeId, Op, Shape, TensorData, TensorType, Value, ValueDef,
    ValueId, Weight,
};
use pipewright_passes::cluster::Cluster;
use pipewright_passes::cost::{Achievable, CostModel, GemmShape, Lin, Roofline};
use pipewright_passes::machine::Crowding;
use pipewright_passes::partition::{choose_order, live_bytes};
use pipewright_core::{Balance, Placement, Precision, Schedule, Scheme};
use pipewright_passes::planner::{plan, plan_on, Candidate, PlanContext, PlanError, PlanOptions, REPLAYED};
use pipewright_passes::cluster::Latencies;
use pipewright_passes::profile::{BoundaryCost, Profile};
use pipewright_passes::simulate::{simulate, SimSetup};

fn row(w: i64) -> TensorType {
    TensorType::new(DType::F32, Shape(vec![Dim::N, Dim::Fixed(w)]))
}

fn input(g: &mut Graph, w: i64) -> ValueId {
    g.add_value(Value {
        name: "x".into(),
        ty: row(w),
        def: ValueDef::Input,
    })
}

fn unary(g: &mut Graph, name: &str, x: ValueId, w: i64) -> (NodeId, ValueId) {
    let n = g.add_node(
        name.into(),
        Op::Unary(UnaryOp::Relu),
        vec![Some(x)],
        vec![Some((format!("{name}_out"), row(w)))],
    );
    (n, g.node(n).outputs[0].unwrap())
}

fn add(g: &mut Graph, name: &str, a: ValueId, b: ValueId, w: i64) -> (NodeId, ValueId) {
    let op = Op::Binary(pipewright_ops::op::BinaryOp::Add);
    let n = g.add_node(
        name.into(),
        op,
        vec![Some(a), Some(b)],
        vec![Some((format!("{name}_out"), row(w)))],
    );
    (n, g.node(n).outputs[0].unwrap())
}

fn weight(g: &mut Graph, name: &str, dims: &[i64]) -> ValueId {
    let numel: i64 = dims.iter().product();
    let data = TensorData::new(
        DType::F32,
        dims.to_vec(),
        Bytes::from(vec![0u8; numel as usize * 4]),
    )
    .unwrap();
    g.add_value(Value {
        name: name.into(),
        ty: TensorType::new(DType::F32, Shape::fixed(dims)),
        def: ValueDef::Weight(Weight {
            data,
            trainable: true,
        }),
    })
}

fn matmul(g: &mut Graph, name: &str, x: ValueId, w: ValueId, out: i64) -> (NodeId, ValueId) {
    let n = g.add_node(
        name.into(),
        Op::MatMul,
        vec![Some(x), Some(w)],
        vec![Some((format!("{name}_out"), row(out)))],
    );
    (n, g.node(n).outputs[0].unwrap())
}

fn chain(len: usize) -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let mut v = input(&mut g, 64);
    for i in 0..len {
        v = unary(&mut g, &format!("relu{i}"), v, 64).1;
    }
    g.set_outputs(vec![v]);
    g
}

/// `x -> a -> {b, c} -> d = b + c -> e = d + a` (a skip from `a` to `e`).
fn diamond() -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 64);
    let (_, a) = unary(&mut g, "a", x, 64);
    let (_, b) = unary(&mut g, "b", a, 64);
    let (_, c) = unary(&mut g, "c", a, 64);
    let (_, d) = add(&mut g, "d", b, c, 64);
    let (_, e) = add(&mut g, "e", d, a, 64);
    g.set_outputs(vec![e]);
    g
}

fn small_cluster() -> Cluster {
    Cluster {
        workers: 4,
        workers_per_node: 4,
        ..Cluster::default()
    }
}

#[test]
fn cost_rules() {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 64);
    let w = weight(&mut g, "w", &[64, 32]);
    let (mm, y) = matmul(&mut g, "mm", x, w, 32);
    let (r, y) = unary(&mut g, "relu", y, 32);
    let t = g.add_node(
        "tanh".into(),
        Op::Unary(UnaryOp::Tanh),
        vec![Some(y)],
        vec![Some(("t".into(), row(32)))],
    );
    g.set_outputs(vec![g.node(t).outputs[0].unwrap()]);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    assert_eq!(c.node(mm).fwd_flops, Lin::new(2.0 * 32.0 * 64.0, 0.0));
    assert_eq!(c.node(mm).bwd_flops, Lin::new(4.0 * 32.0 * 64.0, 0.0));
    assert_eq!(c.node(mm).params, 64 * 32);
    assert_eq!(c.node(mm).param_bytes, 64 * 32 * 4);
    assert_eq!(c.node(mm).activation_bytes, Lin::new(32.0 * 4.0, 0.0));
    assert_eq!(
        c.node(mm).bytes_moved,
        Lin::new(64.0 * 4.0 + 32.0 * 4.0, 64.0 * 32.0 * 4.0)
    );
    assert_eq!(c.node(r).fwd_flops, Lin::new(32.0, 0.0));
    assert_eq!(c.node(t).fwd_flops, Lin::new(4.0 * 32.0, 0.0));
    assert_eq!(c.node(t).bwd_flops, c.node(t).fwd_flops);
    assert_eq!(c.node(mm).fwd_flops.at(8), 8.0 * 4096.0);
    // Roofline: the matmul at b=1 is memory bound on the default device.
    let (f, _) = c.time(mm, 1);
    assert!((f - c.node(mm).bytes_moved.at(1) / 900e9).abs() < 1e-18);
}

/// Tile and wave quantization by hand (NVIDIA's *Matrix Multiplication Background User's
/// Guide*: its tiles from 256 x 128 to 64 x 64, one per multiprocessor, the best one
/// taken), and a GPU roofline per node: the matmul at its achievable share of the peak
/// times its useful share, forward and the two backward products apart; the relu at the
/// achievable bandwidth, at the compute type's width; no kernel under its launch.
#[test]
fn a_gpu_roofline_per_node() {
    let one = Lin::new(0.0, 1.0);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-30);
    // 320 x 64 tiles of 256 x 128 fill 256 waves of 80 exactly: all useful.
    let large = GemmShape { count: one, rows: Lin::new(0.0, 81920.0), cols: 8192.0, depth: 64.0 };
    assert!(close(large.useful_share(1, 80), 1.0));
    // 1024 x 2048 on 80 SMs: 256 x 128 tiles make 64, one wave of 80 (0.8); 64 x 64 tiles
    // make 512, seven waves (560 slots): 512 / 560, the best.
    let square = GemmShape { count: one, rows: Lin::new(0.0, 1024.0), cols: 2048.0, depth: 2048.0 };
    assert!(close(square.useful_share(1, 80), 512.0 / 560.0));
    // One row: 32 tiles of 64 x 64, each 1/64 useful, in a wave of 80.
    let row = GemmShape { rows: Lin::new(0.0, 1.0), ..square };
    assert!(close(row.useful_share(1, 80), 2048.0 / (80.0 * 64.0 * 64.0)));
    // Rows linear in the batch: 512 per sample, 160 samples = 81920 rows, as `large`.
    let per_sample = GemmShape { count: one, rows: Lin::new(512.0, 0.0), cols: 8192.0, depth: 64.0 };
    assert!(close(per_sample.useful_share(160, 80), 1.0));

    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 2048);
    let w = weight(&mut g, "w", &[2048, 2048]);
    let (mm, y) = matmul(&mut g, "mm", x, w, 2048);
    let (r, y) = unary(&mut g, "relu", y, 2048);
    g.set_outputs(vec![y]);
    let gpu = Achievable { gemm: 0.5, bandwidth: 0.8, launch_s: 5e-6, sms: 80, bytes_scale: 0.5 };
    let roofline = Roofline { name: "gpu".into(), peak_flops: 100e12, mem_bw: 1e12, achievable: Some(gpu) };
    let c = CostModel::new(&g, roofline).unwrap();
    let (shape, weight) = c.node(mm).gemm.expect("a matmul is a product");
    assert!(weight);
    assert_eq!((shape.rows, shape.cols, shape.depth), (Lin::new(1.0, 0.0), 2048.0, 2048.0));
    assert_eq!(c.node(mm).kernels, [1, 2]);
    assert_eq!(c.node(r).kernels, [1, 1]);
    // b = 1024: the forward's 1024 x 2048 output is 512/560 useful, and so is the
    // backward's input gradient; the weight's gradient, 2048 x 2048, is 1024 tiles of 64 x
    // 64 in 13 waves (1040 slots).
    let flops = 2.0 * 1024.0 * 2048.0 * 2048.0;
    let rate = 100e12 * 0.5;
    let (f, bwd) = c.time(mm, 1024);
    assert!(close(f, flops / (rate * 512.0 / 560.0)), "{f}");
    assert!(close(bwd, flops / (rate * 512.0 / 560.0) + flops / (rate * 1024.0 / 1040.0)), "{bwd}");
    // The relu streams 1024 x 2048 in and out, 2 bytes each in fp16: 8 MiB at 0.8 TB/s.
    let (rf, rb) = c.time(r, 1024);
    assert!(close(rf, 2.0 * 1024.0 * 2048.0 * 2.0 / 0.8e12), "{rf}");
    assert!(close(rb, 2.0 * rf), "{rb}");
    // One sample: the relu is shorter than its launches; the one-row matmul is bound by
    // its tiles (32 of 64 x 64, each 1/64 useful), not by reading the 8 MiB weight.
    assert_eq!(c.time(r, 1), (5e-6, 5e-6));
    let (f1, _) = c.time(mm, 1);
    assert!(close(f1, 2.0 * 2048.0 * 2048.0 / (rate * 2048.0 / (80.0 * 64.0 * 64.0))), "{f1}");
}

#[test]
fn shared_weight_counted_once_and_reported() {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 16);
    let w = weight(&mut g, "tied", &[16, 16]);
    let (m1, y) = matmul(&mut g, "first", x, w, 16);
    let mut v = y;
    for i in 0..6 {
        v = unary(&mut g, &format!("mid{i}"), v, 16).1;
    }
    let (m2, z) = matmul(&mut g, "last", v, w, 16);
    g.set_outputs(vec![z]);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    assert_eq!(c.node(m1).params, 256);
    assert_eq!(c.node(m2).params, 0);
    assert_eq!(c.shared.len(), 1);
    assert_eq!(c.shared[0].name, "tied");
    assert_eq!(c.shared[0].consumers, vec![m1, m2]);
    let opts = PlanOptions {
        stages: Some(2),
        cuts: Some(vec!["mid3".into()]),
        microbatch: Some(4),
        ..PlanOptions::default()
    };
    let p = plan(&g, &c, &small_cluster(), &opts).unwrap();
    assert_eq!(p.shared_weights.len(), 1);
    assert_eq!(p.shared_weights[0].stages, vec![0, 1]);
    assert!(p.shared_weights[0].decision.contains("all-reduce"));
    assert_eq!(p.stages[0].params, 256);
    assert_eq!(p.stages[1].params, 256);
    assert_eq!(p.stages[1].first_node, "mid3");
}

#[test]
fn chain_live_bytes_and_plan() {
    let g = chain(8);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let order = choose_order(&g, &c, 1).unwrap();
    let live = live_bytes(&g, &order.nodes, &c);
    assert_eq!(live.len(), 9);
    assert!(live.iter().all(|l| *l == Lin::new(256.0, 0.0)));
    let opts = PlanOptions {
        stages: Some(4),
        microbatch: Some(8),
        schedules: vec![Schedule::TwoBw],
        ..PlanOptions::default()
    };
    // Communication nearly free: equal stages.
    let fast = Cluster {
        intra_bw: 1e18,
        inter_bw: 1e18,
        ..small_cluster()
    };
    let p = plan(&g, &c, &fast, &opts).unwrap();
    assert_eq!(p.chosen.d, 4);
    assert_eq!(p.stages.len(), 4);
    assert!(p.stages.iter().all(|s| s.nodes == 2), "{}", p.text());
    let mut seen: Vec<usize> = p.stage_of_nodes().iter().map(|(n, _)| n.index()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..8).collect::<Vec<_>>());
    assert_eq!(p.stage_map().get(p.stage_of_nodes()[7].0), Some(3));
    // Candidates are sorted best first.
    assert!(p
        .candidates
        .windows(2)
        .all(|w| w[0].samples_per_s >= w[1].samples_per_s));
    assert_eq!(p.candidates[0], p.chosen);
    let text = p.text();
    assert!(
        text.contains("samples/s") && text.contains("stage 3"),
        "{text}"
    );
    let json = serde_json::to_string(&p).unwrap();
    assert!(json.contains("\"schedule\":\"2bw\""));
}

#[test]
fn diamond_skip_counts_at_every_cut() {
    let g = diamond();
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let order = choose_order(&g, &c, 1).unwrap();
    let names: Vec<&str> = order
        .nodes
        .iter()
        .map(|&n| g.node(n).name.as_str())
        .collect();
    assert_eq!(names, ["a", "b", "c", "d", "e"]);
    let live: Vec<f64> = live_bytes(&g, &order.nodes, &c)
        .iter()
        .map(|l| l.at(1))
        .collect();
    // cut 1: a; cut 2: a, b; cut 3: a, b, c; cut 4: a (skip), d; cut 5: e.
    assert_eq!(live, vec![256.0, 256.0, 512.0, 768.0, 512.0, 256.0]);
    let opts = PlanOptions {
        stages: Some(2),
        microbatch: Some(4),
        recompute: Some(pipewright_core::Recompute::None),
        ..PlanOptions::default()
    };
    let p = plan(&g, &c, &small_cluster(), &opts).unwrap();
    // The cheapest cuts carry only one tensor: after `a`.
    assert_eq!(p.chosen.cuts, vec![1], "{}", p.text());
    assert_eq!(p.stages[1].inputs, vec![("a_out".to_string(), 1024)]);
    let opts = PlanOptions {
        cuts: Some(vec!["d".into()]),
        microbatch: Some(4),
        ..PlanOptions::default()
    };
    let p = plan(&g, &c, &small_cluster(), &opts).unwrap();
    let ins: Vec<&str> = p.stages[1].inputs.iter().map(|x| x.0.as_str()).collect();
    assert_eq!(ins, ["a_out", "b_out", "c_out"]);
}

#[test]
fn plan_errors() {
    let g = chain(3);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let cl = small_cluster();
    let bad = |o: PlanOptions| plan(&g, &c, &cl, &o).unwrap_err();
    assert!(matches!(
        bad(PlanOptions {
            cuts: Some(vec!["nope".into()]),
            ..PlanOptions::default()
        }),
        PlanError::UnknownCutNode(_)
    ));
    assert!(matches!(
        bad(PlanOptions {
            cuts: Some(vec!["relu0".into()]),
            ..PlanOptions::default()
        }),
        PlanError::BadCut(_)
    ));
    assert!(matches!(
        bad(PlanOptions {
            cuts: Some(vec!["relu1".into()]),
            stages: Some(3),
            ..PlanOptions::default()
        }),
        PlanError::StagesMismatch { .. }
    ));
    assert!(matches!(
        bad(PlanOptions {
            global_batch: 0,
            ..PlanOptions::default()
        }),
        PlanError::Options(_)
    ));
    assert!(matches!(
        bad(PlanOptions {
            stages: Some(4),
            ..PlanOptions::default()
        }),
        PlanError::Options(_)
    ));
    for (width, why) in [(0, "width must be at least 1"), (3, "a width of 3 replicas does not divide the global batch 64")] {
        assert_eq!(bad(PlanOptions { width: Some(width), ..PlanOptions::default() }).to_string(), format!("invalid plan options: {why}"));
    }
    let tiny = Cluster {
        memory_per_worker: 16,
        ..cl.clone()
    };
    assert!(matches!(
        plan(&g, &c, &tiny, &PlanOptions::default()),
        Err(PlanError::NoFeasible(_))
    ));
    assert!(matches!(
        plan(
            &Graph::new(ModelMeta::default()),
            &c,
            &cl,
            &PlanOptions::default()
        ),
        Err(PlanError::EmptyGraph)
    ));
}

/// A fixed width keeps the search to that many replicas; one the cluster cannot hold
/// with any depth finds nothing, saying which width it kept to.
#[test]
fn a_fixed_width_is_the_replicas() {
    let g = chain(4);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let cl = small_cluster();
    for w in [1, 2] {
        let p = plan(&g, &c, &cl, &PlanOptions { width: Some(w), ..PlanOptions::default() }).unwrap();
        assert_eq!(p.chosen.w, w, "{}", p.text());
        assert!(p.candidates.iter().all(|k| k.w == w), "{}", p.text());
    }
    let e = plan(&g, &c, &cl, &PlanOptions { width: Some(cl.workers * 2), global_batch: 64, ..PlanOptions::default() }).unwrap_err();
    assert!(e.to_string().contains(&format!("with w = {}", cl.workers * 2)), "{e}");
}

#[test]
fn memory_limit_prefers_recompute_or_deeper_pipelines() {
    let g = chain(16);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let opts = PlanOptions {
        global_batch: 256,
        top: 100_000,
        ..PlanOptions::default()
    };
    let roomy = plan(&g, &c, &small_cluster(), &opts).unwrap();
    let peak = |p: &pipewright_passes::planner::Plan| {
        p.candidates
            .iter()
            .flat_map(|c| c.peak_memory_per_stage.iter().copied())
            .max()
            .unwrap()
    };
    let limit = peak(&roomy) / 4;
    let tight = Cluster {
        memory_per_worker: limit,
        ..small_cluster()
    };
    let p = plan(&g, &c, &tight, &opts).unwrap();
    assert!(peak(&p) <= limit);
    let fitting = roomy
        .candidates
        .iter()
        .filter(|c| c.peak_memory_per_stage.iter().all(|&m| m <= limit))
        .count();
    eprintln!(
        "roomy {} fitting {} tight {}",
        roomy.candidates.len(),
        fitting,
        p.candidates.len()
    );
    assert!(p.candidates.len() >= fitting);
    assert!(p.candidates.len() < roomy.candidates.len());
}

#[test]
fn baselines_and_profile() {
    let g = chain(6);
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    let json = r#"{"model": "chain", "device": "test", "batches": [1, 2, 4],
        "nodes": [{"name": "relu0", "op": "Relu", "fwd_ms": [1.0, 2.0, 4.0], "bwd_ms": [2.0, 4.0, 8.0]},
                  {"name": "ghost", "op": "Relu", "fwd_ms": [1, 1, 1], "bwd_ms": [1, 1, 1]}]}"#;
    let profile = Profile::from_json(json).unwrap();
    let report = c.apply_profile(&g, &profile).unwrap();
    assert_eq!(report.measured, 1);
    assert_eq!(report.calibrated, 5);
    assert_eq!(report.unknown_nodes, vec!["ghost".to_string()]);
    let relu0 = c.topo[0];
    let (f, b) = c.time(relu0, 8);
    assert!((f - 8e-3).abs() < 1e-12 && (b - 16e-3).abs() < 1e-12);
    // Uncalibrated relu1 is scaled by relu0's measured/analytic ratio: all six match.
    let (f1, b1) = c.time(c.topo[1], 8);
    let ratio = (f1 + b1) / (f + b);
    assert!((ratio - 1.0).abs() < 0.05, "{ratio}");
    let short = r#"{"model":"m","device":"d","batches":[1,2],"nodes":[{"name":"a","op":"Relu","fwd_ms":[1],"bwd_ms":[1,2]}]}"#;
    assert_eq!(Profile::from_json(short).unwrap_err().to_string(), "invalid profile: node \"a\": fwd_ms has 1 entries for 2 batch sizes");
    let e = Profile::from_json("not json").unwrap_err().to_string();
    assert!(e.starts_with("the profile is not valid JSON: ") && e.contains("line 1 column 2"), "{e}");
    for balance in [
        Balance::Params,
        Balance::Flops,
        Balance::Profile,
        Balance::Nodes,
    ] {
        let opts = PlanOptions {
            stages: Some(3),
            balance,
            microbatch: Some(2),
            ..PlanOptions::default()
        };
        let p = plan(&g, &c, &small_cluster(), &opts).unwrap();
        assert_eq!(p.stages.iter().map(|s| s.nodes).sum::<usize>(), 6);
    }
}

/// x -> mm0 (w1) -> mm1 (w2) -> mm2 -> its output, 8 x 8 each: mm2 reads w1 again when
/// `tied`, else a weight w3 of its own.
fn three_matmuls(tied: bool) -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 8);
    let (w1, w2) = (weight(&mut g, "w1", &[8, 8]), weight(&mut g, "w2", &[8, 8]));
    let w3 = if tied { w1 } else { weight(&mut g, "w3", &[8, 8]) };
    let (_, a) = matmul(&mut g, "mm0", x, w1, 8);
    let (_, b) = matmul(&mut g, "mm1", a, w2, 8);
    let (_, c) = matmul(&mut g, "mm2", b, w3, 8);
    g.set_outputs(vec![c]);
    g
}

/// The start of a profile of [`three_matmuls`]: each node 1 and 2 ms forward, 2 and 4 ms
/// backward at batches 1 and 2; the caller adds its own fields and closes it.
const THREE_MATMULS_PROFILE: &str = r#"{"model": "m", "device": "test", "batches": [1, 2],
    "nodes": [{"name": "mm0", "op": "MatMul", "fwd_ms": [1, 2], "bwd_ms": [2, 4]},
              {"name": "mm1", "op": "MatMul", "fwd_ms": [1, 2], "bwd_ms": [2, 4]},
              {"name": "mm2", "op": "MatMul", "fwd_ms": [1, 2], "bwd_ms": [2, 4]}]"#;

/// The opening of a profile of [`three_matmuls`]' nodes, each timed `fwd` and `bwd` (JSON
/// arrays) at `batches`, for a test to add its own keys to and close.
fn three_matmuls_profile(batches: &str, fwd: &str, bwd: &str) -> String {
    let node = |name: &str| format!(r#"{{"name": "{name}", "op": "MatMul", "fwd_ms": {fwd}, "bwd_ms": {bwd}}}"#);
    format!(r#"{{"model": "m", "device": "test", "batches": {batches}, "nodes": [{}, {}, {}]"#, node("mm0"), node("mm1"), node("mm2"))
}

/// A profile's whole pass sets the total the nodes' times add up to, its whole step the
/// total the weight updates add up to (per optimizer), and the measured weight updates
/// become the stages' optimizer time, each weight counted at the node that reads it first
/// (a weight read twice is updated once).
#[test]
fn a_profiles_whole_pass_and_weight_updates_drive_the_stage_costs() {
    let g = three_matmuls(true);
    let json = THREE_MATMULS_PROFILE.to_string()
        + r#",
        "whole": [{"batch": 1, "fwd_ms": 6, "bwd_ms": 3}, {"batch": 2, "fwd_ms": 12, "bwd_ms": 6}],
        "updates": [{"name": "w1", "sgd_ms": 1, "momentum_ms": 2, "adam_ms": 5},
                    {"name": "w2", "sgd_ms": 3, "momentum_ms": 4, "adam_ms": 7}],
        "loss": {"loss": "cross-entropy", "output": "mm2_out", "fwd_ms": [0.5, 1], "bwd_ms": [1.5, 3]}}"#;
    let profile = Profile::from_json(&json).unwrap();
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    let report = c.apply_profile(&g, &profile).unwrap();
    assert_eq!((report.measured, report.updates_measured), (3, 2));
    // Forward: the nodes add up to 3 ms at batch 1, the whole pass took 6: each node 2 ms.
    // Backward: 6 ms of nodes against a whole pass of 3: each node 1 ms.
    for &n in &c.topo {
        let (f, b) = c.time(n, 1);
        assert!((f - 2e-3).abs() < 1e-12 && (b - 1e-3).abs() < 1e-12, "{f} {b}");
    }
    let by_name = |name: &str| c.topo.iter().copied().find(|&n| g.node(n).name == name).unwrap();
    use pipewright_core::Optimizer;
    assert_eq!(c.update_time(by_name("mm0"), Optimizer::Sgd, false), Some(1e-3));
    assert_eq!(c.update_time(by_name("mm1"), Optimizer::Adam, false), Some(7e-3));
    assert_eq!(c.update_time(by_name("mm2"), Optimizer::Sgd, true), Some(0.0));
    // Three stages, one node each: the optimizer times are the measured updates.
    let cl = small_cluster();
    for (optimizer, momentum, expect) in [(Optimizer::Sgd, false, [1e-3, 3e-3]), (Optimizer::Sgd, true, [2e-3, 4e-3]), (Optimizer::Adam, false, [5e-3, 7e-3])] {
        let opts = PlanOptions { stages: Some(3), microbatch: Some(1), optimizer, momentum, ..PlanOptions::default() };
        let p = plan(&g, &c, &cl, &opts).unwrap();
        let mut ctx = PlanContext::new(&g, &c, &cl, opts.precision).unwrap();
        let stages = ctx.stage_costs(&p.chosen, &opts);
        let per_byte = (expect[0] + expect[1]) / (2.0 * 8.0 * 8.0 * 4.0);
        // The last stage updates its copy of the tied w1 at the measured rate per byte.
        let want = [expect[0], expect[1], 8.0 * 8.0 * 4.0 * per_byte];
        for (s, w) in stages.iter().zip(want) {
            assert!((s.optimizer_s - w).abs() < 1e-12, "{optimizer} momentum {momentum}: {} != {w}", s.optimizer_s);
        }
        // The last stage computes the loss besides its node: 2 + 0.5 ms forward, 1 + 1.5
        // ms backward at b = 1.
        let times: Vec<(f64, f64)> = stages.iter().map(|s| (s.forward_s, s.backward_s)).collect();
        for (k, want) in [(2e-3, 1e-3), (2e-3, 1e-3), (2.5e-3, 2.5e-3)].into_iter().enumerate() {
            assert!((times[k].0 - want.0).abs() < 1e-12 && (times[k].1 - want.1).abs() < 1e-12, "stage {k}: {:?}", times[k]);
        }
    }
    // A whole step measured: each optimizer's updates are scaled to add up to it (SGD 1 +
    // 3 ms against a step of 8: twice; momentum 2 + 4 against 3: half; Adam as it was).
    let stepped = json.replace(r#""loss": {"#, r#""step": {"sgd_ms": 8, "momentum_ms": 3, "adam_ms": 12}, "loss": {"#);
    let mut c3 = CostModel::new(&g, Roofline::default()).unwrap();
    c3.apply_profile(&g, &Profile::from_json(&stepped).unwrap()).unwrap();
    for (node, optimizer, momentum, want) in [("mm0", Optimizer::Sgd, false, 2e-3), ("mm1", Optimizer::Sgd, false, 6e-3), ("mm0", Optimizer::Sgd, true, 1e-3), ("mm1", Optimizer::Adam, false, 7e-3)] {
        let got = c3.update_time(by_name(node), optimizer, momentum).unwrap();
        assert!((got - want).abs() < 1e-12, "{node} {optimizer} momentum {momentum}: {got} != {want}");
    }
    let bad = stepped.replace(r#""adam_ms": 12"#, r#""adam_ms": -12"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`step`: a negative"));
    // Without updates in the profile, the update is costed from the memory bandwidth.
    let mut bare = profile.clone();
    bare.updates.clear();
    let mut c2 = CostModel::new(&g, Roofline::default()).unwrap();
    c2.apply_profile(&g, &bare).unwrap();
    assert_eq!(c2.update_time(by_name("mm0"), Optimizer::Sgd, false), None);
    let bad = json.replace(r#""bwd_ms": [1.5, 3]"#, r#""bwd_ms": [1.5]"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("the loss (cross-entropy on \"mm2_out\") needs one"));
    let bad = json.replace(r#""sgd_ms": 1,"#, r#""sgd_ms": -1,"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("update of weight \"w1\""));
    let bad = json.replace(r#"{"batch": 2, "fwd_ms": 12"#, r#"{"batch": 3, "fwd_ms": 12"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`whole` at batch 3"));
}

/// A profile's times go through every size it measured, linear between two of them and
/// along the nearest two beyond them: a straight line fitted through all of them would miss
/// each where the time curves (a small model's pass at 1, 2, 4 and 8), and the stages
/// would no longer add up to the whole pass measured at the microbatch planned.
#[test]
fn a_profiles_times_go_through_every_size_it_measured() {
    let g = three_matmuls(false);
    let json = three_matmuls_profile("[4, 1, 2]", "[4, 1, 1.5]", "[1, 4, 2]")
        + r#", "loss": {"loss": "mse", "output": "mm2_out", "fwd_ms": [2, 0.5, 0.5], "bwd_ms": [1, 1, 1]}}"#;
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    c.apply_profile(&g, &Profile::from_json(&json).unwrap()).unwrap();
    let mm0 = c.topo[0];
    // Measured sizes (given out of order), between them, beyond them: forward 1, 1.5, 4 ms
    // at 1, 2, 4; backward 4, 2, 1 falls along its last segment and stops at 0.
    let want = [(1, 1.0, 4.0), (2, 1.5, 2.0), (3, 2.75, 1.5), (4, 4.0, 1.0), (8, 9.0, 0.0), (16, 19.0, 0.0)];
    for (b, fwd, bwd) in want {
        let (f, bw) = c.time(mm0, b);
        assert!((f - fwd * 1e-3).abs() < 1e-12 && (bw - bwd * 1e-3).abs() < 1e-12, "batch {b}: {f} {bw}");
    }
    for (b, fwd) in [(1, 0.5e-3), (2, 0.5e-3), (3, 1.25e-3), (4, 2e-3)] {
        assert!((c.loss_time(b).0 - fwd).abs() < 1e-12, "loss at batch {b}: {:?}", c.loss_time(b));
    }
    // One size alone scales in proportion to the microbatch.
    let one = r#"{"model": "m", "device": "test", "batches": [2],
        "nodes": [{"name": "mm0", "op": "MatMul", "fwd_ms": [3], "bwd_ms": [5]}]}"#;
    let mut c1 = CostModel::new(&g, Roofline::default()).unwrap();
    c1.apply_profile(&g, &Profile::from_json(one).unwrap()).unwrap();
    let (f, bw) = c1.time(mm0, 6);
    assert!((f - 9e-3).abs() < 1e-12 && (bw - 15e-3).abs() < 1e-12, "{f} {bw}");
}

/// A profile's gradient accumulation is paid by each stage's backward, its share by
/// weight bytes, for every microbatch of a step but the first: (m - 1) / m of it per
/// backward on average.
#[test]
fn a_profiles_gradient_accumulation_is_paid_by_the_backward_of_later_microbatches() {
    let g = three_matmuls(false);
    let json = THREE_MATMULS_PROFILE.to_string() + r#", "accumulate_ms": 6}"#;
    let with = Profile::from_json(&json).unwrap();
    let without = Profile { accumulate_ms: None, ..with.clone() };
    let cl = small_cluster();
    let costs = |p: &Profile, m: u64| {
        let mut c = CostModel::new(&g, Roofline::default()).unwrap();
        c.apply_profile(&g, p).unwrap();
        let opts = PlanOptions { stages: Some(3), microbatch: Some(1), global_batch: m, ..PlanOptions::default() };
        let chosen = plan(&g, &c, &cl, &opts).unwrap().chosen;
        assert_eq!(chosen.m, m);
        PlanContext::new(&g, &c, &cl, opts.precision).unwrap().stage_costs(&chosen, &opts)
    };
    // Three stages of one 8 x 8 weight each: 2 ms of the 6 each, times 3/4 at m = 4; one
    // microbatch per step accumulates nothing.
    for (m, each) in [(4, 1.5e-3), (1, 0.0)] {
        let (paid, free) = (costs(&with, m), costs(&without, m));
        for (k, (p, f)) in paid.iter().zip(&free).enumerate() {
            let extra = p.backward_s - f.backward_s;
            assert!((extra - each).abs() < 1e-12, "m = {m}, stage {k}: {extra} != {each}");
            assert_eq!((p.forward_s, p.optimizer_s), (f.forward_s, f.optimizer_s), "m = {m}, stage {k}");
        }
    }
    let bad = json.replace(r#""accumulate_ms": 6"#, r#""accumulate_ms": -6"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`accumulate_ms`: a negative"));
}

/// A split at a batch size the boundary was not measured at takes the boundary's cost
/// there as the cost model reads it: through the measured sizes, along the nearest two
/// beyond them, in proportion to the batch from one size alone.
#[test]
fn a_boundarys_cost_is_read_at_any_batch_through_the_measured_sizes() {
    let cost = |batch, fwd_ms, bwd_ms| BoundaryCost { batch, fwd_ms, bwd_ms, step_ms: 0.0, after_backward_ms: None };
    let costs = [cost(4, 5.0, 9.0), cost(1, 2.0, 3.0)];
    assert_eq!(BoundaryCost::pass_ms_at(&costs, 1), [2.0, 3.0]);
    assert_eq!(BoundaryCost::pass_ms_at(&costs, 2), [3.0, 5.0]);
    assert_eq!(BoundaryCost::pass_ms_at(&costs, 8), [9.0, 17.0]);
    assert_eq!(BoundaryCost::pass_ms_at(&[cost(2, 1.0, 3.0)], 4), [2.0, 6.0]);
    assert_eq!(BoundaryCost::pass_ms_at(&[], 4), [0.0, 0.0]);
}

/// A profile's split (the model trained as stages) scales each stage's nodes so that the
/// stages take their measured shares of the pass, the pass unchanged; between the batch
/// sizes it was measured at, the scales fall on a straight line.
#[test]
fn a_profiles_split_gives_each_stage_its_measured_share_of_the_pass() {
    let g = three_matmuls(false);
    let json = three_matmuls_profile("[1, 2, 4]", "[1, 2, 4]", "[2, 4, 8]")
        + r#", "split": [{"batch": 1, "stages": [{"nodes": ["mm0"], "fwd_ms": 3, "bwd_ms": 2},
                                          {"nodes": ["mm1", "mm2"], "fwd_ms": 3, "bwd_ms": 6}]},
                  {"batch": 4, "stages": [{"nodes": ["mm0"], "fwd_ms": 4, "bwd_ms": 8},
                                          {"nodes": ["mm1", "mm2"], "fwd_ms": 8, "bwd_ms": 16}]}]}"#;
    let profile = Profile::from_json(&json).unwrap();
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    c.apply_profile(&g, &profile).unwrap();
    let by_name = |name: &str| c.topo.iter().copied().find(|&n| g.node(n).name == name).unwrap();
    // Batch 1: the stages took half and half of the forward (their nodes alone: a third and
    // two), so mm0 gets 1.5 ms, mm1 and mm2 0.75; of the backward a quarter and three
    // quarters: mm0 1.5 ms, mm1 and mm2 2.25. Batch 4 measured the nodes' own shares: 1.
    // Batch 2, a third of the way: forward scales 4/3 and 5/6, backward 5/6 and 13/12.
    let want = [
        (1, [(1.5, 1.5), (0.75, 2.25), (0.75, 2.25)]),
        (2, [(2.0 * 4.0 / 3.0, 4.0 * 5.0 / 6.0), (2.0 * 5.0 / 6.0, 4.0 * 13.0 / 12.0), (2.0 * 5.0 / 6.0, 4.0 * 13.0 / 12.0)]),
        (4, [(4.0, 8.0), (4.0, 8.0), (4.0, 8.0)]),
    ];
    for (b, per_node) in want {
        for (name, (fwd, bwd)) in ["mm0", "mm1", "mm2"].into_iter().zip(per_node) {
            let (f, bw) = c.time(by_name(name), b);
            assert!((f - fwd * 1e-3).abs() < 1e-12 && (bw - bwd * 1e-3).abs() < 1e-12, "{name} at batch {b}: {f} {bw}, want {fwd} {bwd} ms");
        }
    }
    let (fwd, bwd) = profile.split[0].stage_scales(&profile.nodes, 0);
    assert_eq!((fwd, bwd), (Some(vec![1.5, 0.75]), Some(vec![0.75, 1.125])));
    // A node in two stages, or a split at a batch size the nodes were not timed at, is refused.
    let twice = json.replacen(r#"["mm1", "mm2"]"#, r#"["mm0", "mm2"]"#, 1);
    assert!(Profile::from_json(&twice).unwrap_err().to_string().contains(r#"`split` at batch 1: node "mm0" is in two stages"#));
    let unmeasured = json.replacen(r#""batch": 4, "stages""#, r#""batch": 3, "stages""#, 1);
    assert!(Profile::from_json(&unmeasured).unwrap_err().to_string().contains("`split` at batch 3: needs a measured batch size"));
}

#[test]
fn a_profiles_stage_boundary_is_paid_half_on_either_side() {
    let g = three_matmuls(false);
    let json = THREE_MATMULS_PROFILE.to_string()
        + r#",
        "boundary": [{"batch": 1, "fwd_ms": 1, "bwd_ms": 2, "step_ms": 0.5}, {"batch": 3, "fwd_ms": 3, "bwd_ms": 4, "step_ms": 0.5}]}"#;
    let with = Profile::from_json(&json).unwrap();
    let without = Profile { boundary: Vec::new(), ..with.clone() };
    // Linear in the microbatch between the measured sizes, as the nodes' times: forward b
    // ms, backward b + 1, the update 0.5 ms at every size.
    let mut fitted = CostModel::new(&g, Roofline::default()).unwrap();
    fitted.apply_profile(&g, &with).unwrap();
    for (b, want) in [(1, [1e-3, 2e-3, 0.5e-3]), (2, [2e-3, 3e-3, 0.5e-3]), (5, [5e-3, 6e-3, 0.5e-3])] {
        let got = fitted.boundary_time(b);
        assert!(got.iter().zip(want).all(|(x, w)| (x - w).abs() < 1e-12), "batch {b}: {got:?}");
    }
    let cl = small_cluster();
    let opts = PlanOptions { stages: Some(3), microbatch: Some(1), optimizer: pipewright_core::Optimizer::Sgd, ..PlanOptions::default() };
    let costs = |p: &Profile| {
        let mut c = CostModel::new(&g, Roofline::default()).unwrap();
        c.apply_profile(&g, p).unwrap();
        let chosen = plan(&g, &c, &cl, &opts).unwrap().chosen;
        PlanContext::new(&g, &c, &cl, opts.precision).unwrap().stage_costs(&chosen, &opts)
    };
    let (paid, free) = (costs(&with), costs(&without));
    // Three stages, two boundaries: the end stages have one side each, the middle two.
    for (k, sides) in [0.5, 1.0, 0.5].into_iter().enumerate() {
        let extra = [paid[k].forward_s - free[k].forward_s, paid[k].backward_s - free[k].backward_s, paid[k].optimizer_s - free[k].optimizer_s];
        let want = [1e-3, 2e-3, 0.5e-3].map(|t| sides * t);
        assert!(extra.iter().zip(want).all(|(x, w)| (x - w).abs() < 1e-12), "stage {k}: {extra:?} != {want:?}");
    }
    let bad = json.replace(r#""bwd_ms": 4, "step_ms""#, r#""bwd_ms": -4, "step_ms""#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`boundary`: needs a positive batch"));
    // Measured without the runtime's work after a backward: none in any stage.
    assert_eq!(fitted.after_backward_time(1), 0.0);
    assert!(paid.iter().all(|c| c.after_backward_s == 0.0));
}

#[test]
fn a_profiles_untraced_work_after_a_backward_is_paid_by_every_stage() {
    let g = three_matmuls(false);
    let json = THREE_MATMULS_PROFILE.to_string()
        + r#",
        "boundary": [{"batch": 1, "fwd_ms": 1, "bwd_ms": 2, "step_ms": 0.5, "after_backward_ms": 0.1},
                     {"batch": 3, "fwd_ms": 3, "bwd_ms": 4, "step_ms": 0.5, "after_backward_ms": 0.3}]}"#;
    let profile = Profile::from_json(&json).unwrap();
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    c.apply_profile(&g, &profile).unwrap();
    // Through the measured sizes as the other times: 0.1 ms at 1, 0.2 at 2, 0.5 at 5.
    for (b, want) in [(1, 0.1e-3), (2, 0.2e-3), (5, 0.5e-3)] {
        assert!((c.after_backward_time(b) - want).abs() < 1e-15, "batch {b}: {}", c.after_backward_time(b));
    }
    // Every stage pays it per microbatch, whatever its boundaries, beside its busy time.
    let cl = small_cluster();
    let opts = PlanOptions { stages: Some(3), microbatch: Some(2), optimizer: pipewright_core::Optimizer::Sgd, ..PlanOptions::default() };
    let chosen = plan(&g, &c, &cl, &opts).unwrap().chosen;
    let costs = PlanContext::new(&g, &c, &cl, opts.precision).unwrap().stage_costs(&chosen, &opts);
    assert_eq!(costs.len(), 3);
    assert!(costs.iter().all(|s| (s.after_backward_s - 0.2e-3).abs() < 1e-15), "{costs:?}");
    let bad = json.replace(r#""after_backward_ms": 0.1"#, r#""after_backward_ms": -0.1"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`boundary`: needs a positive batch and non-negative finite times"));
}

/// One 8 x 8 MatMul node, `mm`, on a batched input.
fn one_matmul() -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 8);
    let w = weight(&mut g, "w", &[8, 8]);
    let (_, y) = matmul(&mut g, "mm", x, w, 8);
    g.set_outputs(vec![y]);
    g
}

#[test]
fn a_profiles_crowded_passes_slow_the_threads_of_a_host_of_its_size() {
    let g = one_matmul();
    // On 2 cores: at batch 2, 2 threads take 11 ms a pass against 10 alone (1.1) and 4
    // threads 24 against twice 10 (1.2); at batch 4 nothing slows, and 2 threads taking
    // less than one alone is noise, read as no slowdown.
    let json = r#"{"model": "m", "device": "cpu", "batches": [2, 4],
        "nodes": [{"name": "mm", "op": "MatMul", "fwd_ms": [1, 2], "bwd_ms": [2, 4]}],
        "sharing": {"cores": 2, "runs": [
            {"batch": 2, "threads": 1, "pass_ms": 10}, {"batch": 2, "threads": 2, "pass_ms": 11}, {"batch": 2, "threads": 4, "pass_ms": 24},
            {"batch": 4, "threads": 1, "pass_ms": 20}, {"batch": 4, "threads": 2, "pass_ms": 19}, {"batch": 4, "threads": 4, "pass_ms": 40}]}}"#;
    let profile = Profile::from_json(json).unwrap();
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    assert_eq!(c.crowding(2, 2), Crowding::NONE, "no profile, no crowding");
    c.apply_profile(&g, &profile).unwrap();
    let close = |a: Crowding, b: (f64, f64)| (a.at_cores - b.0).abs() < 1e-12 && (a.at_twice - b.1).abs() < 1e-12;
    // Below, between and beyond the measured sizes: the nearest, linear, the nearest.
    for (b, want) in [(1, (1.1, 1.2)), (2, (1.1, 1.2)), (3, (1.05, 1.1)), (4, (1.0, 1.0)), (16, (1.0, 1.0))] {
        let got = c.crowding(2, b);
        assert!(close(got, want), "batch {b}: {got:?} != {want:?}");
    }
    // Measured on 2 cores, it says nothing of a host of 4.
    assert_eq!(c.crowding(4, 2), Crowding::NONE);
    let bad = json.replace(r#""pass_ms": 24"#, r#""pass_ms": -24"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`sharing` at batch 2 with 4 threads"));
    let bad = json.replace(r#""cores": 2"#, r#""cores": 0"#);
    assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`sharing`: a host of 0 cores"));
    // Without a measured turn the tick is unknown: turns end at Linux's slice.
    assert_eq!(c.tick(2), 0.0);
    assert_eq!(c.host_cores(2, 2).turn_end(1e-3), 1e-3 + 1.5e-3);
}

#[test]
fn a_profiles_measured_turn_is_the_tick_a_host_of_its_size_preempts_on() {
    let g = one_matmul();
    let json = r#"{"model": "m", "device": "cpu", "batches": [2],
        "nodes": [{"name": "mm", "op": "MatMul", "fwd_ms": [1], "bwd_ms": [2]}],
        "sharing": {"cores": 2, "turn_ms": 4, "runs": [
            {"batch": 2, "threads": 1, "pass_ms": 10}, {"batch": 2, "threads": 2, "pass_ms": 10}, {"batch": 2, "threads": 4, "pass_ms": 20}]}}"#;
    let mut c = CostModel::new(&g, Roofline::default()).unwrap();
    c.apply_profile(&g, &Profile::from_json(json).unwrap()).unwrap();
    assert_eq!(c.tick(2), 4e-3);
    // A turn starting 1 ms into a tick runs its 1.5 ms slice, then until the tick at 4 ms;
    // one starting at 3 ms until the tick at 8 ms.
    let host = c.host_cores(2, 2);
    let ends = [1e-3, 3e-3].map(|t| host.turn_end(t));
    assert!((ends[0] - 4e-3).abs() < 1e-15 && (ends[1] - 8e-3).abs() < 1e-15, "{ends:?}");
    // Measured on 2 cores, it says nothing of a host of 4.
    assert_eq!(c.tick(4), 0.0);
    for bad in ["0", "-4"] {
        let bad = json.replace(r#""turn_ms": 4"#, &format!(r#""turn_ms": {bad}"#));
        assert!(Profile::from_json(&bad).unwrap_err().to_string().contains("`sharing.turn_ms` must be a positive number"), "{bad}");
    }
}

fn corpus(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models").join(name);
    assert!(p.is_file(), "the shared corpus is missing: expected {}", p.display());
    p
}

#[test]
fn plans_corpus_models() {
    for name in ["gpt2-tiny.onnx", "resnet18.onnx", "mlp.onnx"] {
        let path = corpus(name);
        let g = pipewright_ir::import_model(&path, &Default::default()).unwrap();
        let cl = Cluster::default();
        let c = CostModel::new(&g, cl.roofline()).unwrap();
        let p = plan(&g, &c, &cl, &PlanOptions::default()).unwrap();
        assert_eq!(p.stage_of_nodes().len(), g.node_count());
        assert!(p.chosen.samples_per_s > 0.0);
        let params: u64 = p.stages.iter().map(|s| s.params).sum();
        let shared_extra: u64 = p
            .shared_weights
            .iter()
            .map(|w| w.stages.len() as u64 - 1)
            .sum::<u64>();
        if shared_extra == 0 {
            assert_eq!(params, g.parameter_count(), "{name}");
        }
        eprintln!("{name}:\n{}", p.text());
    }
}

/// The search solves partitions ahead in parallel; the plan is the same on one thread as
/// on several, for every shared model and a memory limit that forces re-solving.
#[test]
fn the_parallel_search_plans_as_the_sequential_one() {
    let mut planned = 0;
    for (name, memory) in [("gpt2-tiny.onnx", 48u64 << 20), ("resnet18.onnx", 256 << 20), ("bert-tiny.onnx", 16 << 30)] {
        let g = pipewright_ir::import_model(&corpus(name), &Default::default()).unwrap();
        let cl = Cluster { memory_per_worker: memory, ..Cluster::default() };
        let c = CostModel::new(&g, cl.roofline()).unwrap();
        let opts = PlanOptions { global_batch: 64, ..PlanOptions::default() };
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| plan(&g, &c, &cl, &opts))
        };
        match (on(1), on(4)) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "{name}");
                planned += 1;
            }
            (a, b) => panic!("{name}: one thread gives {a:?}, four {b:?}"),
        }
    }
    assert_eq!(planned, 3);
}

/// The search's early stop (optimistic bounds with communication and all-reduce, and the
/// memory bound that drops configurations before partitioning) keeps the exact result:
/// the top 5 equal the first 5 of a search that keeps every candidate (so evaluates every
/// configuration), on two servers of four with slow links (200 MB/s inside a server,
/// 50 MB/s between), where communication and all-reduce dominate, with and without a tight
/// memory limit. (The planner also checks, in debug builds, that no configuration beats its
/// optimistic rate: with the communication bound ten times too tight this test fails.)
#[test]
fn the_bounded_search_finds_what_the_exhaustive_one_does() {
    let mut compared = 0;
    for (name, memory) in [("gpt2-tiny.onnx", 16u64 << 30), ("gpt2-tiny.onnx", 40 << 20), ("resnet18.onnx", 160 << 20), ("mobilenet_v2.onnx", 16 << 30)] {
        let g = pipewright_ir::import_model(&corpus(name), &Default::default()).unwrap();
        let cl = Cluster { memory_per_worker: memory, workers: 8, workers_per_node: 4, intra_bw: 2e8, inter_bw: 5e7, server_bw: Some(5e7), ..Cluster::default() };
        let c = CostModel::new(&g, cl.roofline()).unwrap();
        // The plan lists its candidates by the replay; the search's bound is on the closed
        // form, so compare the closed-form rates of the REPLAYED best, and the replayed
        // choice among them.
        let opts = PlanOptions { global_batch: 64, top: REPLAYED, ..PlanOptions::default() };
        let (Ok(bounded), Ok(all)) = (plan(&g, &c, &cl, &opts), plan(&g, &c, &cl, &PlanOptions { top: 1_000_000, ..opts.clone() })) else {
            panic!("{name} at {memory} bytes: no plan");
        };
        let by_closed_form = |p: &pipewright_passes::planner::Plan| {
            let mut c = p.candidates.clone();
            c.sort_by(|a, b| b.samples_per_s.total_cmp(&a.samples_per_s));
            c.truncate(REPLAYED);
            c
        };
        let rates = |c: &[Candidate]| c.iter().map(|c| c.samples_per_s).collect::<Vec<_>>();
        assert_eq!(rates(&by_closed_form(&bounded)), rates(&by_closed_form(&all)), "{name} at {memory} bytes");
        let best_replayed = by_closed_form(&all).iter().filter_map(|c| c.replayed_samples_per_s).fold(0.0, f64::max);
        assert_eq!(bounded.chosen.replayed_samples_per_s, Some(best_replayed), "{name} at {memory} bytes");
        compared += 1;
    }
    assert_eq!(compared, 4);
}

/// `--precision bf16` in the memory model: master weights, gradient and Adam's two
/// moments stay fp32 (2BW: 2 versions + 1 + 2 = 5 copies), each of the 2 versions has
/// a bf16 copy of the weights (half a copy each), and activations halve.
/// The plan file carries the precision; one without it reads as fp32.
#[test]
fn precision_in_the_memory_model() {
    // Eight matmul + relu layers: every stage has weights and activations.
    let mut g = Graph::new(ModelMeta::default());
    let mut v = input(&mut g, 64);
    for i in 0..8 {
        let w = weight(&mut g, &format!("w{i}"), &[64, 64]);
        v = matmul(&mut g, &format!("mm{i}"), v, w, 64).1;
        v = unary(&mut g, &format!("relu{i}"), v, 64).1;
    }
    g.set_outputs(vec![v]);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let opts = |precision| PlanOptions {
        stages: Some(4),
        microbatch: Some(8),
        schedules: vec![Schedule::TwoBw],
        recompute: Some(pipewright_core::Recompute::None),
        precision,
        ..PlanOptions::default()
    };
    let full = plan(&g, &c, &small_cluster(), &opts(Precision::Fp32)).unwrap();
    let half = plan(&g, &c, &small_cluster(), &opts(Precision::Bf16)).unwrap();
    assert_eq!(full.chosen.cuts, half.chosen.cuts);
    for s in 0..4 {
        let p = full.stages[s].params as f64 * 4.0;
        assert!(p > 0.0);
        let peak = full.chosen.peak_memory_per_stage[s] as f64;
        let act = peak - 5.0 * p;
        assert!(act > 0.0, "stage {s}: no activations in {peak}");
        let want = 5.0 * p + 0.5 * 2.0 * p + 0.5 * act;
        let got = half.chosen.peak_memory_per_stage[s] as f64;
        assert!((got - want).abs() <= 2.0, "stage {s}: bf16 peak {got}, expected {want} (fp32 {peak})");
    }
    let json = serde_json::to_value(&half.options).unwrap();
    assert_eq!(json["precision"], "bf16");
    let mut old = serde_json::to_value(&full.options).unwrap();
    assert!(old.get("precision").is_none(), "fp32 is left out of plan files");
    old.as_object_mut().unwrap().remove("precision");
    let back: PlanOptions = serde_json::from_value(old).unwrap();
    assert_eq!(back.precision, Precision::Fp32);
}

/// Activations cross the stage boundaries in the compute type, as the runtime sends them
/// (it casts the weights and the inputs, so what a stage computes and sends is in that
/// type): under bf16 the bytes each stage sends in the replay, the bytes the plan lists
/// at its boundaries and the partitioner's communication time are half of fp32's.
#[test]
fn activations_cross_the_boundaries_in_the_compute_type() {
    use pipewright_core::{Layout, Recompute};
    let g = matmul_chain(64);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let cl = small_cluster();
    let opts = |precision| PlanOptions { stages: Some(4), microbatch: Some(8), schedules: vec![Schedule::TwoBw], recompute: Some(Recompute::None), precision, ..PlanOptions::default() };
    let (full, half) = (opts(Precision::Fp32), opts(Precision::Bf16));
    let (fp32, bf16) = (plan(&g, &c, &cl, &full).unwrap(), plan(&g, &c, &cl, &half).unwrap());
    assert_eq!(fp32.chosen.cuts, bf16.chosen.cuts);
    for (a, b) in fp32.stages.iter().zip(&bf16.stages).take(3) {
        assert!(!a.outputs.is_empty(), "stage {} sends nothing", a.index);
        let bytes = |s: &pipewright_passes::planner::StagePlan| s.outputs.iter().map(|o| o.1).collect::<Vec<u64>>();
        assert_eq!(bytes(a), bytes(b).iter().map(|x| 2 * x).collect::<Vec<u64>>(), "stage {}", a.index);
    }
    let sends = |o: &PlanOptions| PlanContext::new(&g, &c, &cl, o.precision).unwrap().stage_costs(&fp32.chosen, o).iter().map(|s| s.send_bytes).collect::<Vec<f64>>();
    let (f, h) = (sends(&full), sends(&half));
    assert!(f[..3].iter().all(|&b| b > 0.0) && f[3] == 0.0, "{f:?}");
    assert_eq!(f, h.iter().map(|b| 2.0 * b).collect::<Vec<f64>>());
    let comm = |o: &PlanOptions| {
        let mut ctx = PlanContext::new(&g, &c, &cl, o.precision).unwrap();
        ctx.problem(8, Recompute::None, cl.pipeline_bw(Layout::new(4, 1))).comm(fp32.chosen.cuts[0])
    };
    assert!(comm(&full) > 0.0);
    assert_eq!(comm(&full), 2.0 * comm(&half));
}

/// The chain of eight 64-wide matmul + relu layers.
fn matmul_chain(width: i64) -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let mut v = input(&mut g, width);
    for i in 0..8 {
        let w = weight(&mut g, &format!("w{i}"), &[width, width]);
        v = matmul(&mut g, &format!("mm{i}"), v, w, width).1;
        v = unary(&mut g, &format!("relu{i}"), v, width).1;
    }
    g.set_outputs(vec![v]);
    g
}

/// The closed form ranks a data-parallel `w = 4, d = 1` first on one server of four (it
/// counts neither the optimizer's pass over the weights nor an all-reduce that, with one
/// microbatch per step, 2BW cannot hide), the replay a `w = 1, d = 4` pipeline: the plan
/// takes the replay's winner and lists the candidates by the replay, keeping both figures.
#[test]
fn the_plan_chooses_by_the_replay_where_the_closed_form_disagrees() {
    let g = matmul_chain(64);
    let cl = Cluster { workers: 4, workers_per_node: 4, intra_bw: 1e11, inter_bw: 1e7, server_bw: Some(1e7), peak_flops: 1e12, mem_bw: 1e11, ..Cluster::default() };
    let c = CostModel::new(&g, cl.roofline()).unwrap();
    let opts = PlanOptions { global_batch: 64, ..PlanOptions::default() };
    let p = plan_on(&g, &c, &cl, Latencies::NONE, None, &opts).unwrap();
    let closed_best = p.candidates.iter().max_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s)).unwrap();
    assert_eq!((closed_best.w, closed_best.d), (4, 1));
    assert_eq!((p.chosen.w, p.chosen.d), (1, 4));
    assert!(closed_best.samples_per_s > p.chosen.samples_per_s);
    let replayed = |c: &Candidate| c.replayed_samples_per_s.expect("every listed candidate is replayed");
    assert!(replayed(&p.chosen) > replayed(closed_best), "{} <= {}", replayed(&p.chosen), replayed(closed_best));
    assert_eq!(p.chosen, p.candidates[0]);
    assert!(p.candidates.windows(2).all(|w| replayed(&w[0]) >= replayed(&w[1])));
    // The table shows the replay as the prediction and the closed form beside it.
    let text = p.text();
    let row = text.lines().find(|l| l.trim_start().starts_with("1 ")).unwrap();
    assert!(row.contains(&format!("{:.1}", replayed(&p.chosen))) && row.contains(&format!("{:.1}", p.chosen.samples_per_s)), "{row}");
    assert!(text.contains("closed form = the planner's formula"));
}

/// The closed form and the replay time a stage's all-reduce with the same function: with
/// one stage under PipeDream-Flush and no latencies, the closed form's batch (`m T + AR`)
/// is the replay's batch less the optimizer, for every width, flat ring in one server
/// (w <= 8) or hierarchical over two (w = 16), and it is `Cluster::allreduce`'s time.
#[test]
fn the_planner_and_the_replay_time_the_same_allreduce() {
    let g = matmul_chain(1024);
    let cl = Cluster { workers: 16, workers_per_node: 8, intra_bw: 1e11, inter_bw: 1e9, server_bw: Some(1e9), peak_flops: 1e12, mem_bw: 1e12, ..Cluster::default() };
    let c = CostModel::new(&g, cl.roofline()).unwrap();
    let opts = PlanOptions { global_batch: 64, stages: Some(1), microbatch: Some(4), schedules: vec![Schedule::Flush], recompute: Some(pipewright_core::Recompute::None), top: 16, ..PlanOptions::default() };
    let p = plan_on(&g, &c, &cl, Latencies::NONE, None, &opts).unwrap();
    let mut ctx = PlanContext::new(&g, &c, &cl, opts.precision).unwrap();
    let mut widths = Vec::new();
    for cand in &p.candidates {
        let stages = ctx.stage_costs(cand, &opts);
        let allreduce = cl.allreduce(cand.layout(), Latencies::NONE);
        let setup = SimSetup { scheme: Scheme::Flush, w: cand.w, b: cand.b, m: cand.m, batches: 4, stages: stages.clone(), links: vec![], allreduce, record: false, host: None, tied_groups: Vec::new(), spread: None };
        let sim = simulate(&setup).unwrap();
        let closed_batch = (cand.b * cand.m * cand.w as u64) as f64 / cand.samples_per_s;
        let compute = cand.m as f64 * (stages[0].forward_s + stages[0].backward_s);
        let ar = allreduce.seconds(stages[0].grad_bytes, cand.w);
        assert!((closed_batch - (compute + ar)).abs() <= 1e-9 * closed_batch, "w = {}: {closed_batch} != {compute} + {ar}", cand.w);
        assert!((sim.batch_s - stages[0].optimizer_s - closed_batch).abs() <= 1e-9 * closed_batch, "w = {}: replay {} - {} != {closed_batch}", cand.w, sim.batch_s, stages[0].optimizer_s);
        assert_eq!(sim.stages[0].allreduce_s, ar);
        widths.push((cand.w, allreduce.per_server));
    }
    widths.sort_unstable();
    assert_eq!(widths, vec![(1, 1), (2, 2), (4, 4), (8, 8), (16, 8)]);
}

/// The plan file keeps both figures; a file written before the planner replayed (no
/// `replayed_samples_per_s`) still reads, with the closed form as its prediction.
#[test]
fn the_plan_file_keeps_the_replayed_figure() {
    let g = matmul_chain(64);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let p = plan(&g, &c, &small_cluster(), &PlanOptions { global_batch: 16, ..PlanOptions::default() }).unwrap();
    let file = pipewright_passes::plan_file::PlanFile::new(p.clone(), std::path::Path::new("chain.onnx"), 7);
    let json = file.to_json();
    let back = pipewright_passes::plan_file::PlanFile::parse(&json, std::path::Path::new("p.json")).unwrap();
    // serde_json's default float parsing can be off in the last bit.
    let same = |a: &Candidate, b: &Candidate| {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs();
        close(a.samples_per_s, b.samples_per_s)
            && close(a.replayed_samples_per_s.unwrap(), b.replayed_samples_per_s.unwrap())
            && Candidate { samples_per_s: 0.0, replayed_samples_per_s: None, ..a.clone() } == Candidate { samples_per_s: 0.0, replayed_samples_per_s: None, ..b.clone() }
    };
    assert!(same(&back.plan.chosen, &p.chosen), "{:?} != {:?}", back.plan.chosen, p.chosen);
    assert_eq!(back.plan.candidates.len(), p.candidates.len());
    assert!(back.plan.candidates.iter().zip(&p.candidates).all(|(a, b)| same(a, b)));
    let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
    old["chosen"].as_object_mut().unwrap().remove("replayed_samples_per_s");
    for cand in old["candidates"].as_array_mut().unwrap() {
        cand.as_object_mut().unwrap().remove("replayed_samples_per_s");
    }
    let back = pipewright_passes::plan_file::PlanFile::parse(&old.to_string(), std::path::Path::new("old.json")).unwrap();
    assert_eq!(back.plan.chosen.replayed_samples_per_s, None);
    assert_eq!(back.plan.chosen.predicted_samples_per_s(), back.plan.chosen.samples_per_s);
    assert!((back.plan.chosen.samples_per_s - p.chosen.samples_per_s).abs() <= 1e-12 * p.chosen.samples_per_s);
}

/// Two servers of four, a slow network between them, 2 replicas of a 4-stage pipeline:
/// the planner weighs both numberings of the workers and keeps each one's rows. Wide
/// microbatches of a narrow chain send far more across the cuts than the replicas sum, so
/// replica-major (each pipeline in one server, its cuts on NVLink) wins; a wide chain at
/// one sample per microbatch sums far more than it sends, so stage-major (each stage's
/// replicas in one server) wins. Forcing the other placement replays slower.
#[test]
fn the_planner_places_pipelines_or_replicas_in_a_server_by_what_crosses_more() {
    let cl = Cluster { workers: 8, workers_per_node: 4, intra_bw: 1e11, inter_bw: 1e8, server_bw: Some(1e8), peak_flops: 1e10, mem_bw: 1e11, memory_per_worker: u64::MAX, ..Cluster::default() };
    for (width, b, batch, want) in [(64, 1024, 16384, Placement::ReplicaMajor), (1024, 1, 16, Placement::StageMajor)] {
        let g = matmul_chain(width);
        let c = CostModel::new(&g, cl.roofline()).unwrap();
        let opts = PlanOptions { global_batch: batch, stages: Some(4), microbatch: Some(b), schedules: vec![Schedule::TwoBw], recompute: Some(pipewright_core::Recompute::None), top: 4, ..PlanOptions::default() };
        let p = plan_on(&g, &c, &cl, Latencies::ASSUMED, None, &opts).unwrap();
        let rows: Vec<(usize, Placement, f64)> = p.candidates.iter().map(|x| (x.w, x.placement, x.predicted_samples_per_s())).collect();
        assert_eq!((p.chosen.w, p.chosen.placement), (2, want), "width {width}: {rows:?}");
        let forced = plan_on(&g, &c, &cl, Latencies::ASSUMED, None, &PlanOptions { placement: Some(other(want)), ..opts.clone() }).unwrap();
        let best_other = forced.candidates.iter().filter(|x| x.w == 2).map(Candidate::predicted_samples_per_s).fold(0.0, f64::max);
        assert!(best_other < p.chosen.predicted_samples_per_s(), "width {width}: {} forced {:?} against {}", best_other, other(want), p.chosen.predicted_samples_per_s());
        assert!(p.text().contains(want.name()), "{}", p.text());
    }
}

fn other(p: Placement) -> Placement {
    match p {
        Placement::StageMajor => Placement::ReplicaMajor,
        Placement::ReplicaMajor => Placement::StageMajor,
    }
}

/// ZB-H1's closed form is PipeDream-Flush's less the weight gradients its drain runs
/// without: `(d - 1)` times the slowest stage's deferred weight-gradient seconds, the same
/// seconds the replay gives that stage (`StageCost::weight_grad_s`).
#[test]
fn the_closed_form_credits_zero_bubble_with_the_drains_weight_gradients() {
    let g = matmul_chain(256);
    let cl = Cluster { workers: 4, workers_per_node: 4, memory_per_worker: u64::MAX, ..Cluster::default() };
    let c = CostModel::new(&g, cl.roofline()).unwrap();
    let opts = |s: Schedule| PlanOptions { global_batch: 32, stages: Some(4), microbatch: Some(4), schedules: vec![s], recompute: Some(pipewright_core::Recompute::None), top: 1, ..PlanOptions::default() };
    let flush = plan_on(&g, &c, &cl, Latencies::NONE, None, &opts(Schedule::Flush)).unwrap().chosen;
    let zb = plan_on(&g, &c, &cl, Latencies::NONE, None, &opts(Schedule::ZbH1)).unwrap().chosen;
    assert_eq!((flush.w, flush.d, flush.m, &flush.cuts), (1, 4, 8, &zb.cuts));
    let samples = (zb.b * zb.m) as f64;
    let saved = samples / flush.samples_per_s - samples / zb.samples_per_s;
    let mut ctx = PlanContext::new(&g, &c, &cl, opts(Schedule::ZbH1).precision).unwrap();
    let w = ctx.stage_costs(&zb, &opts(Schedule::ZbH1))[flush.bottleneck_stage].weight_grad_s;
    assert!(w > 0.0 && (saved - 3.0 * w).abs() <= 1e-9 * saved, "saved {saved} s per batch, W {w} s");
}

/// What a backward split into input and weight gradients keeps for each node's weight
/// gradient between the two, per sample: a product by a 2-D weight its output's gradient
/// and its operand, the operand counted once for the products that share it (a query and
/// a key projection); a product of a weight another node also reads (tied) nothing, its
/// gradient coming with the input gradient; a product that cannot form its weight
/// gradient directly (`alpha != 1`) its output's gradient, and its stage keeps the graph.
#[test]
fn a_split_backward_keeps_each_products_operand_once_and_its_output_gradient() {
    let mut g = Graph::new(ModelMeta::default());
    let x = input(&mut g, 64);
    let (wq, wk, tied) = (weight(&mut g, "wq", &[64, 32]), weight(&mut g, "wk", &[64, 32]), weight(&mut g, "tied", &[32, 32]));
    let (q_node, q) = matmul(&mut g, "q", x, wq, 32);
    let (k_node, k) = matmul(&mut g, "k", x, wk, 32);
    let (add_node, s) = add(&mut g, "s", q, k, 32);
    let (t1_node, t1) = matmul(&mut g, "t1", s, tied, 32);
    let (t2_node, t2) = matmul(&mut g, "t2", t1, tied, 32);
    let wg = weight(&mut g, "wg", &[32, 16]);
    let gemm = pipewright_ops::op::Gemm { alpha: 0.5, beta: 1.0, trans_a: false, trans_b: false };
    let gemm_node = g.add_node("g".into(), Op::Gemm(gemm), vec![Some(t2), Some(wg)], vec![Some(("g_out".into(), row(16)))]);
    let out = g.node(gemm_node).outputs[0].unwrap();
    g.set_outputs(vec![out]);
    let c = CostModel::new(&g, Roofline::default()).unwrap();
    let per_sample = |n: NodeId| (c.node(n).awaiting_bytes.at(2) - c.node(n).awaiting_bytes.at(1), c.node(n).keeps_graph);
    assert_eq!(per_sample(q_node), (4.0 * (32.0 + 64.0), false));
    assert_eq!(per_sample(k_node), (4.0 * 32.0, false));
    assert_eq!(per_sample(add_node), (0.0, false));
    assert_eq!(per_sample(t1_node), (0.0, false));
    assert_eq!(per_sample(t2_node), (0.0, false));
    assert_eq!(per_sample(gemm_node), (4.0 * 16.0, true));
}
