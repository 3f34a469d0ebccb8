//! The embedded pipeline executor against single-stage references written with plain tch.

mod common;

use bytes::Bytes;
use common::{normal, uniform};

use pipewright_ops::op::{Gemm, UnaryOp};
use pipewright_core::{Decay, Loss, Optimizer, Recompute, Schedule, UpdateRule};
use pipewright_runtime::module::{ModuleHeader, Section, StageModule, StageParams};
use pipewright_runtime::pipeline::*;
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo, Stored};
use pipewright_ops::DType;
use tch::{Kind, Tensor};

const DIMS: [i64; 5] = [4, 6, 5, 4, 3];
const LAYERS: usize = 4;

fn init_weights() -> Vec<(Tensor, Tensor)> {
    (0..LAYERS)
        .map(|i| {
            let (o, n) = (DIMS[i + 1], DIMS[i]);
            let w: Vec<f64> = uniform((o * n) as usize, 10 + i as u64, -0.8, 0.8);
            let b: Vec<f64> = uniform(o as usize, 20 + i as u64, -0.2, 0.2);
            (Tensor::from_slice(&w).reshape([o, n]), Tensor::from_slice(&b))
        })
        .collect()
}

fn bytes_of(t: &Tensor) -> Bytes {
    let v = Vec::<f64>::try_from(&t.reshape([-1])).unwrap();
    Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
}

/// Layers `lo..hi` of the MLP (Gemm, then Relu except after the last layer) as stage `k`.
fn stage(k: usize, depth: usize, lo: usize, hi: usize, sched: Schedule, rec: Recompute) -> StageModule {
    let init = init_weights();
    let mut p = Program::default();
    let slot = |p: &mut Program, name: String| {
        p.slots.push(SlotInfo { name, elem: DType::F64, shape: vec![Extent::Batch(1)], last_use: None });
        SlotId(p.slots.len() as u32 - 1)
    };
    let mut cur = slot(&mut p, if lo == 0 { "x".into() } else { format!("a{lo}") });
    p.inputs.push(cur);
    for i in lo..hi {
        let w = slot(&mut p, format!("w{i}"));
        let b = slot(&mut p, format!("b{i}"));
        for (s, t) in [(w, &init[i].0), (b, &init[i].1)] {
            p.stored.push(Stored { slot: s, elem: DType::F64, dims: t.size(), bytes: bytes_of(t), trainable: true, versions: sched.weight_versions(), update: sched.update_rule(), sync: Vec::new() });
        }
        let last = i + 1 == LAYERS;
        let g = slot(&mut p, if last { format!("a{}", i + 1) } else { format!("g{i}") });
        let gemm = Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
        p.instrs.push(Instr { name: format!("gemm{i}"), op: pipewright_ops::Op::Gemm(gemm), inputs: vec![Some(cur), Some(w), Some(b)], outputs: vec![Some(g)], recompute: false });
        cur = g;
        if !last {
            let a = slot(&mut p, format!("a{}", i + 1));
            p.instrs.push(Instr { name: format!("relu{i}"), op: pipewright_ops::Op::Unary(UnaryOp::Relu), inputs: vec![Some(cur)], outputs: vec![Some(a)], recompute: false });
            cur = a;
        }
    }
    p.outputs.push(cur);
    p.fill_last_uses();
    let params = StageParams { stage: k as u32, depth: depth as u32, schedule: sched, recompute: rec };
    let z = Section { offset: 0, len: 0 };
    StageModule { header: ModuleHeader { version: 1, params, checksum: 0, program: z, weights: z }, program: p }
}

fn stages(d: usize, sched: Schedule, rec: Recompute) -> Vec<StageModule> {
    let mut bounds = vec![0usize; d + 1];
    for i in 0..LAYERS {
        bounds[i * d / LAYERS + 1] = i + 1;
    }
    (0..d).map(|k| stage(k, d, bounds[k], bounds[k + 1], sched, rec)).collect()
}

type Batch = Vec<(Tensor, Tensor)>;

fn dataset(steps: usize, m: usize, nan_at: Option<usize>) -> Vec<Batch> {
    (0..steps)
        .map(|t| {
            (0..m)
                .map(|i| {
                    let seed = 1000 + (t * m + i) as u64;
                    let x = normal(&[2, 4], seed);
                    let x = if nan_at == Some(t) { x * f64::NAN } else { x };
                    let y: Vec<i64> = uniform(2, seed ^ 77, 0.0, 3.0).iter().map(|v| *v as i64).collect();
                    (x, Tensor::from_slice(&y))
                })
                .collect()
        })
        .collect()
}

fn feed(data: &[Batch]) -> BatchStream {
    let v: Vec<Vec<Microbatch>> = data
        .iter()
        .map(|b| b.iter().map(|(x, y)| Microbatch { inputs: vec![("x".into(), x.shallow_clone())], labels: Some(y.shallow_clone()) }).collect())
        .collect();
    Box::new(v.into_iter().map(Ok))
}

// ---- single-stage reference ----

fn ref_loss(ws: &[Tensor], x: &Tensor, y: &Tensor) -> Tensor {
    let mut h = x.shallow_clone();
    for i in 0..LAYERS {
        h = h.matmul(&ws[2 * i].tr()) + &ws[2 * i + 1];
        if i + 1 < LAYERS {
            h = h.relu();
        }
    }
    let lp = h.log_softmax(-1, Kind::Double);
    -lp.gather(1, &y.reshape([-1, 1]), false).mean(Kind::Double)
}

/// Mean over the batch's microbatches of the per-microbatch gradient at `ws`.
fn ref_grad(ws: &[Tensor], batch: &Batch) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = ws.iter().map(|w| w.detach().set_requires_grad(true)).collect();
    let mut acc: Vec<Tensor> = ws.iter().map(|w| w.zeros_like()).collect();
    for (x, y) in batch {
        let l = ref_loss(&leaves, x, y);
        let g = Tensor::run_backward(&[l], &leaves, false, false);
        acc = acc.iter().zip(&g).map(|(a, g)| a + g).collect();
    }
    acc.iter().map(|a| a / batch.len() as f64).collect()
}

fn ref_train(data: &[Batch], opt: OptimizerConfig, lr: f64, stale: bool, clip: Option<f64>) -> Vec<(String, Tensor)> {
    let mut ws: Vec<Tensor> = init_weights().into_iter().flat_map(|(w, b)| [w, b]).collect();
    let mut prev = ws.iter().map(|w| w.copy()).collect::<Vec<_>>();
    let mut m1: Vec<Tensor> = ws.iter().map(|w| w.zeros_like()).collect();
    let mut m2: Vec<Tensor> = ws.iter().map(|w| w.zeros_like()).collect();
    for (t, batch) in data.iter().enumerate() {
        let at = if stale { &prev } else { &ws };
        let mut g = ref_grad(at, batch);
        if let Some(c) = clip {
            let norm = g.iter().map(|g| g.square().sum(Kind::Double).double_value(&[])).sum::<f64>().sqrt();
            let coef = c / (norm + 1e-6);
            if coef < 1.0 {
                g = g.iter().map(|g| g * coef).collect();
            }
        }
        let OptimizerConfig { momentum, weight_decay, beta1, beta2, eps, .. } = opt;
        let new: Vec<Tensor> = tch::no_grad(|| match opt.kind {
            Optimizer::Sgd => {
                assert_eq!((momentum, weight_decay), (0.0, 0.0));
                ws.iter().zip(&g).map(|(w, g)| w - g * lr).collect()
            }
            Optimizer::Adam => {
                let n = (t + 1) as i32;
                (0..ws.len())
                    .map(|i| {
                        m1[i] = &m1[i] * beta1 + &g[i] * (1.0 - beta1);
                        m2[i] = &m2[i] * beta2 + &g[i] * &g[i] * (1.0 - beta2);
                        let mh = &m1[i] / (1.0 - beta1.powi(n));
                        let vh = &m2[i] / (1.0 - beta2.powi(n));
                        &ws[i] - mh / (vh.sqrt() + eps) * lr
                    })
                    .collect()
            }
            _ => unreachable!(),
        });
        prev = std::mem::replace(&mut ws, new);
    }
    ws.into_iter().enumerate().map(|(i, w)| (if i % 2 == 0 { format!("w{}", i / 2) } else { format!("b{}", i / 2) }, w)).collect()
}

fn assert_weights(got: &TrainReport, want: &[(String, Tensor)], what: &str) {
    let flat: Vec<&(String, Tensor)> = got.weights.iter().flatten().collect();
    assert_eq!(flat.len(), want.len(), "{what}: weight count");
    for (name, w) in want {
        let (_, g) = flat.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{what}: no weight {name}"));
        let diff = (g - w).abs().max().double_value(&[]);
        let scale = w.abs().max().double_value(&[]).max(1e-12);
        assert!(diff / scale <= 1e-5, "{what}: {name} differs by {diff} (scale {scale})");
    }
}

fn cfg(schedule: Schedule, opt: OptimizerConfig, lr: f64, steps: usize) -> TrainConfig {
    let mut c = TrainConfig::new(schedule, Objective::new(Loss::CrossEntropy, "a4"), lr, steps);
    c.optimizer = opt;
    c
}

const STEPS: usize = 3;
const M: usize = 4;

/// Every synchronous schedule trains to vanilla training's weights: GPipe, Flush, ZB-H1,
/// interleaved 1F1B and ZB-V (on every depth their stages per worker divide: 2 and 4
/// stages on 1 or 2 workers).
#[test]
fn synchronous_schedules_equal_vanilla_training() {
    let data = dataset(STEPS, M, None);
    for opt in [OptimizerConfig::sgd(), OptimizerConfig::adam()] {
        let lr = if opt.kind == Optimizer::Sgd { 0.3 } else { 0.05 };
        let want = ref_train(&data, opt, lr, false, None);
        for sched in [Schedule::GPipe, Schedule::Flush, Schedule::ZbH1, Schedule::ZbH2, Schedule::Interleaved2, Schedule::Interleaved4, Schedule::ZbV] {
            for d in (1..=4).filter(|d| d % sched.virtual_stages() == 0) {
                for rec in [Recompute::None, Recompute::Full] {
                    let what = format!("{sched:?} d={d} {opt:?} {rec:?}");
                    let mut reports = Vec::new();
                    let r = train(stages(d, sched, rec), &cfg(sched, opt, lr, STEPS), feed(&data), &mut |s| reports.push(s)).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_weights(&r, &want, &what);
                    assert_eq!(reports.len(), STEPS);
                    assert_eq!(reports.iter().map(|r| r.samples).collect::<Vec<_>>(), vec![2 * M; STEPS]);
                    assert_eq!(r.losses.len(), STEPS);
                    assert!(r.peak_versions.iter().all(|&v| v == 1), "{what}: {:?}", r.peak_versions);
                }
            }
        }
    }
}

#[test]
fn twobw_equals_one_stale_update_with_two_versions() {
    let steps = 5;
    let data = dataset(steps, M, None);
    for opt in [OptimizerConfig::sgd(), OptimizerConfig::adam()] {
        let lr = if opt.kind == Optimizer::Sgd { 0.3 } else { 0.05 };
        let want = ref_train(&data, opt, lr, true, None);
        let vanilla = ref_train(&data, opt, lr, false, None);
        for d in 1..=4 {
            for rec in [Recompute::None, Recompute::Full] {
                let what = format!("2BW d={d} {opt:?} {rec:?}");
                let r = train(stages(d, Schedule::TwoBw, rec), &cfg(Schedule::TwoBw, opt, lr, steps), feed(&data), &mut |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_weights(&r, &want, &what);
                assert!(r.peak_versions.iter().all(|&v| v <= 2), "{what}: {:?}", r.peak_versions);
                assert!(r.peak_versions.iter().all(|&v| v == 2), "{what}: expected a shadow version: {:?}", r.peak_versions);
            }
        }
        // The stale rule really differs from vanilla training.
        let d0 = (&want[0].1 - &vanilla[0].1).abs().max().double_value(&[]);
        assert!(d0 > 1e-6, "stale and vanilla references coincide");
    }
}

/// Clipping by the global norm under every synchronous schedule: ZB-H1 updates after its
/// batch's last weight gradient, as Flush and GPipe do after their flush, so the norm it
/// clips by is the whole batch's over every stage, with no step to validate afterwards.
#[test]
fn clipping_uses_the_global_norm_across_stages() {
    let data = dataset(STEPS, M, None);
    let want = ref_train(&data, OptimizerConfig::sgd(), 0.3, false, Some(0.05));
    let unclipped = ref_train(&data, OptimizerConfig::sgd(), 0.3, false, None);
    assert!((&want[0].1 - &unclipped[0].1).abs().max().double_value(&[]) > 1e-6, "clipping never engaged");
    for schedule in [Schedule::Flush, Schedule::GPipe, Schedule::ZbH1, Schedule::ZbH2, Schedule::Interleaved2, Schedule::ZbV] {
        for d in [1, 3].map(|d| d * schedule.virtual_stages()).into_iter().filter(|&d| d <= 4) {
            let mut c = cfg(schedule, OptimizerConfig::sgd(), 0.3, STEPS);
            c.clip_norm = Some(0.05);
            let r = train(stages(d, c.schedule, Recompute::None), &c, feed(&data), &mut |_| {}).unwrap();
            assert_weights(&r, &want, &format!("clip {schedule:?} d={d}"));
        }
    }
}

/// A non-finite loss at the first step comes from the data or the model, not from an
/// update: the error says so and asks for real data.
#[test]
fn nan_loss_at_the_first_step_blames_the_data() {
    let data = dataset(STEPS, M, Some(0));
    for sched in [Schedule::TwoBw, Schedule::Flush] {
        let e = train(stages(3, sched, Recompute::None), &cfg(sched, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PipelineError::NonFiniteFirstLoss { step: 1, stage: 2, .. }), "{sched:?}: {msg}");
        assert!(msg.contains("before any update") && msg.contains("--data"), "{msg}");
    }
}

#[test]
fn nan_loss_names_step_and_stage() {
    let data = dataset(STEPS, M, Some(1));
    for sched in [Schedule::TwoBw, Schedule::Flush, Schedule::GPipe] {
        let mut steps = Vec::new();
        let e = train(stages(3, sched, Recompute::None), &cfg(sched, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |s| steps.push(s.step)).unwrap_err();
        let msg = e.to_string();
        // The NaN is in the second batch: the progress reports step index 0 only (shown
        // as step 1), and the error names step 2, as the progress line would.
        assert_eq!(steps, [0], "{sched:?}");
        assert!(matches!(e, PipelineError::NonFiniteLoss { step: 2, stage: 2, .. }), "{sched:?}: {msg}");
        assert!(msg.contains("step 2,") && msg.contains("stage 2"), "{msg}");
        assert!(msg.contains("--lr") && msg.contains("--clip-norm"), "the error gives a hint: {msg}");
    }
}

/// An update that overflows the weights (here an infinite rate: the loss of the step is
/// still finite) stops training naming the step and stage, with a hint, instead of
/// returning NaN weights to be saved.
#[test]
fn non_finite_weights_stop_naming_step_and_stage() {
    let data = dataset(STEPS, M, None);
    for sched in [Schedule::TwoBw, Schedule::Flush] {
        let mut steps = Vec::new();
        let e = train(stages(2, sched, Recompute::None), &cfg(sched, OptimizerConfig::sgd(), f64::INFINITY, STEPS), feed(&data), &mut |s| steps.push(s.step)).unwrap_err();
        let msg = e.to_string();
        // The first step's update overflows: step 1, as the progress line counts.
        assert!(matches!(e, PipelineError::NonFiniteWeights { step: 1, .. }), "{sched:?}: {msg}");
        assert!(msg.contains("step 1, stage ") && msg.contains("--lr") && msg.contains("--clip-norm"), "{msg}");
    }
}

#[test]
fn configuration_errors() {
    let data = dataset(STEPS, 2, None);
    let e = train(stages(3, Schedule::TwoBw, Recompute::None), &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("m = 2 < d = 3"), "{e}");
    // Too little data: an error, not a hang.
    let e = train(stages(2, Schedule::TwoBw, Recompute::None), &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, STEPS + 2), feed(&data), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("ran out"), "{e}");
    // Unknown loss output.
    let mut c = cfg(Schedule::Flush, OptimizerConfig::sgd(), 0.1, 1);
    c.loss = Objective::new(Loss::Mse, "nope");
    let e = train(stages(2, c.schedule, Recompute::None), &c, feed(&data), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("stage 1") && e.to_string().contains("nope"), "{e}");
    // Interleaved 1F1B: a depth its stages per worker do not divide, microbatches its
    // workers do not divide.
    let interleaved = cfg(Schedule::Interleaved2, OptimizerConfig::sgd(), 0.1, 1);
    let e = train(stages(3, Schedule::Interleaved2, Recompute::None), &interleaved, feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("interleaved-2 runs 2 stages per worker, so the pipeline's depth must be a multiple of 2 (it is 3)"), "{e}");
    let odd = dataset(1, 3, None);
    let e = train(stages(4, Schedule::Interleaved2, Recompute::None), &interleaved, feed(&odd), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("the microbatches per batch must be a multiple of 2 (m = 3)"), "{e}");
}

/// The weight versions each stage holds and the version each microbatch runs with come
/// from the modules (the weight-versioning pass's decision), not from the schedule alone:
/// modules versioned for another schedule, or with too small a version budget, are refused.
#[test]
fn the_runtime_runs_the_versioning_the_modules_carry() {
    let data = dataset(STEPS, 2, None);
    let run = |modules: Vec<StageModule>, schedule: Schedule| train(modules, &cfg(schedule, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {});
    // Modules whose weights are versioned for a flush (one version, vanilla rule) under a
    // 2BW header and run.
    let mut flush = stages(2, Schedule::Flush, Recompute::None);
    flush.iter_mut().for_each(|m| m.header.params.schedule = Schedule::TwoBw);
    let e = run(flush, Schedule::TwoBw).unwrap_err().to_string();
    assert!(e.contains("stage 0: trainable weight \"w0\" is versioned for update rule vanilla, but the module's schedule 2bw updates by 2bw; recompile the model"), "{e}");
    // A 2BW module whose budget is one version.
    let mut one = stages(2, Schedule::TwoBw, Recompute::None);
    one[1].program.stored.iter_mut().for_each(|t| t.versions = 1);
    let e = run(one, Schedule::TwoBw).unwrap_err().to_string();
    assert!(e.contains("stage 1") && e.contains("2BW needs two weight versions, the module allows 1"), "{e}");
    // A weight whose rule disagrees with its module's schedule.
    let mut mixed = stages(2, Schedule::TwoBw, Recompute::None);
    mixed[0].program.stored[0].update = UpdateRule::Vanilla;
    let e = run(mixed, Schedule::TwoBw).unwrap_err().to_string();
    assert!(e.contains("stage 0") && e.contains("\"w0\" is versioned for update rule vanilla, but the module's schedule 2bw updates by 2bw"), "{e}");
    // The modules' own versioning trains, holding at most the budget.
    let r = run(stages(2, Schedule::TwoBw, Recompute::None), Schedule::TwoBw).unwrap();
    assert_eq!(r.peak_versions, vec![2, 2]);
    let r = run(stages(2, Schedule::Flush, Recompute::None), Schedule::Flush).unwrap();
    assert_eq!(r.peak_versions, vec![1, 1]);
}

/// Stages that disagree on which tied weights they share are refused before training (an
/// exporter's `Identity(weight)` forwarded to a later stage made one stage sum gradients
/// with a stage that held other weights, or waited for one that never joined).
#[test]
fn stages_must_agree_on_their_tied_weights() {
    let data = dataset(STEPS, 2, None);
    let mut modules = stages(2, Schedule::TwoBw, Recompute::None);
    modules[0].program.stored[0].sync = vec![0, 1];
    let e = train(modules, &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert_eq!(e, "pipeline configuration: stages [0, 1] share tied weights, but stage 1 holds [] where stage 0 holds [\"w0\"]; recompile the model");
}

/// Stage modules whose headers disagree with the run on the schedule or the depth (each
/// with a valid checksum of its own) are refused together, naming the stage; so is a run
/// given another schedule than its modules'.
#[test]
fn stage_headers_are_cross_checked() {
    let data = dataset(STEPS, 2, None);
    let mut modules = stages(2, Schedule::TwoBw, Recompute::None);
    modules[1].header.params.schedule = Schedule::Flush;
    let e = train(modules, &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("stage 1: its module's schedule is flush, but the run says 2bw; recompile and use one build folder's modules"), "{e}");
    let modules = stages(2, Schedule::TwoBw, Recompute::None);
    let e = train(modules, &cfg(Schedule::GPipe, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("stage 0: its module's schedule is 2bw, but the run says gpipe"), "{e}");
    let mut modules = stages(2, Schedule::TwoBw, Recompute::None);
    modules[1].header.params.depth = 3;
    let e = train(modules, &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("stage 1: header says stage 1 of 3, have 2 stages"), "{e}");
}

/// A kernel that fails at run time stops training with an error naming the stage, the
/// node and the op; no worker panics and none waits forever.
#[test]
fn a_failing_kernel_names_stage_node_and_op() {
    let data = dataset(STEPS, 2, None);
    let mut modules = stages(2, Schedule::Flush, Recompute::None);
    // Stage 1's first weight, `w2` [4, 5], declared [5, 4]: same bytes, wrong shape.
    let w = modules[1].program.stored.iter_mut().find(|t| t.dims.len() == 2).unwrap();
    w.dims.reverse();
    let e = train(modules, &cfg(Schedule::Flush, OptimizerConfig::sgd(), 0.1, STEPS), feed(&data), &mut |_| {}).unwrap_err().to_string();
    assert!(e.starts_with("stage 1: node \"gemm2\" (Gemm): "), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}

#[test]
fn schedules_generate_expected_ops() {
    use Op::*;
    assert_eq!(stage_ops(Schedule::Flush, 0, 2, 2, 1).unwrap(), vec![Forward(0), Forward(1), Backward(0), Backward(1), Step(0)]);
    assert_eq!(stage_ops(Schedule::Flush, 1, 2, 2, 1).unwrap(), vec![Forward(0), Backward(0), Forward(1), Backward(1), Step(0)]);
    assert_eq!(stage_ops(Schedule::GPipe, 1, 2, 2, 1).unwrap(), vec![Forward(0), Forward(1), Backward(0), Backward(1), Step(0)]);
    assert_eq!(
        stage_ops(Schedule::TwoBw, 0, 2, 2, 2).unwrap(),
        vec![Forward(0), Forward(1), Backward(0), Forward(2), Backward(1), Step(0), Forward(3), Backward(2), Backward(3), Step(1)]
    );
    assert_eq!((0..8).map(|j| UpdateRule::TwoBw.version_for(j, 2)).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1, 1, 2, 2]);
    let lr = LrSchedule { warmup_steps: 2, decay: Decay::Linear, total_steps: 4, final_lr: 0.0 };
    assert_eq!((0..5).map(|t| lr.at(1.0, t)).collect::<Vec<_>>(), vec![0.5, 1.0, 1.0, 0.5, 0.0]);
}

/// `w` replicas of a `d`-stage pipeline, each fed every `w`-th microbatch, equal
/// single-stage training on the whole batch: the gradient all-reduce averages over all
/// `w * m` microbatches (vanilla for GPipe/Flush, the 1-stale rule for 2BW).
#[test]
fn replicas_average_gradients_over_the_whole_batch() {
    let steps = 3;
    let data = dataset(steps, 2 * M, None);
    for sched in [Schedule::TwoBw, Schedule::Flush, Schedule::GPipe] {
        let want = ref_train(&data, OptimizerConfig::adam(), 0.05, sched == Schedule::TwoBw, Some(0.5));
        for d in [1, 2, 3] {
            let what = format!("{sched:?} d={d} w=2");
            let mut c = cfg(sched, OptimizerConfig::adam(), 0.05, steps);
            c.replicas = 2;
            c.clip_norm = Some(0.5);
            let mut reports = Vec::new();
            let r = train(stages(d, c.schedule, Recompute::Full), &c, feed(&data), &mut |s| reports.push(s)).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_weights(&r, &want, &what);
            assert_eq!(reports.iter().map(|r| r.samples).collect::<Vec<_>>(), vec![2 * 2 * M; steps], "{what}");
        }
    }
    // A batch the replicas cannot share evenly is refused.
    let mut c = cfg(Schedule::Flush, OptimizerConfig::sgd(), 0.1, 1);
    c.replicas = 3;
    let e = train(stages(2, c.schedule, Recompute::None), &c, feed(&dataset(1, 4, None)), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("cannot share evenly"), "{e}");
}

/// The runtime's live-bytes counter: 2BW without recomputation holds two weight versions,
/// the gradient accumulator and `d` microbatches' activations at stage 0; with full
/// recomputation only the stashed inputs plus one microbatch's activations.
#[test]
fn memory_counter_sees_versions_and_stashes() {
    let d = 2;
    let data = dataset(4, M, None);
    let run = |rec| train(stages(d, Schedule::TwoBw, rec), &cfg(Schedule::TwoBw, OptimizerConfig::sgd(), 0.1, 4), feed(&data), &mut |_| {}).unwrap();
    let (none, full) = (run(Recompute::None), run(Recompute::Full));
    let w0: u64 = none.weights[0].iter().map(|(_, t)| pipewright_runtime::pipeline::bytes_of(t)).sum();
    for r in [&none, &full] {
        let m0 = r.memory[0];
        assert_eq!(m0.versions, 2, "{m0:?}");
        assert_eq!(m0.weights, 2 * w0, "{m0:?}");
        assert_eq!(m0.optimizer, 0, "plain SGD keeps no state");
        assert!(m0.in_flight <= d && m0.in_flight >= 1, "{m0:?}");
        assert_eq!(m0.total, m0.weights + m0.gradients + m0.optimizer + m0.activations + m0.constants);
    }
    assert!(full.memory[0].activations < none.memory[0].activations, "recomputation stashes less: {:?} vs {:?}", full.memory[0], none.memory[0]);
}

/// One stage `x -> BatchNormalization -> Gemm -> a4` whose running mean and variance are
/// stored constants (as exported models keep them).
fn batchnorm_stage(sched: Schedule, rec: Recompute) -> StageModule {
    use pipewright_ops::op::BatchNorm;
    let mut p = Program::default();
    let mut slot = |name: &str| {
        p.slots.push(SlotInfo { name: name.into(), elem: DType::F64, shape: vec![Extent::Batch(1)], last_use: None });
        SlotId(p.slots.len() as u32 - 1)
    };
    let (x, scale, bias, mean, var, h, w, b, out) = (slot("x"), slot("scale"), slot("bias"), slot("mean"), slot("var"), slot("h"), slot("w"), slot("b"), slot("a4"));
    let w0 = Tensor::from_slice(&uniform(12, 5, -0.5, 0.5)).reshape([3, 4]);
    let stored = [
        (scale, Tensor::ones([4], (Kind::Double, tch::Device::Cpu)), true),
        (bias, Tensor::zeros([4], (Kind::Double, tch::Device::Cpu)), true),
        (mean, Tensor::from_slice(&[0.1f64, -0.2, 0.3, 0.0]), false),
        (var, Tensor::from_slice(&[1.0f64, 2.0, 0.5, 1.5]), false),
        (w, w0, true),
        (b, Tensor::zeros([3], (Kind::Double, tch::Device::Cpu)), true),
    ];
    for (s, t, trainable) in stored {
        let (versions, update) = if trainable { (sched.weight_versions(), sched.update_rule()) } else { (1, UpdateRule::Constant) };
        p.stored.push(Stored { slot: s, elem: DType::F64, dims: t.size(), bytes: bytes_of(&t), trainable, versions, update, sync: Vec::new() });
    }
    let bn = BatchNorm { epsilon: 1e-5, momentum: 0.9, training_mode: false };
    p.instrs.push(Instr { name: "bn".into(), op: pipewright_ops::Op::BatchNormalization(bn), inputs: vec![Some(x), Some(scale), Some(bias), Some(mean), Some(var)], outputs: vec![Some(h)], recompute: false });
    let gemm = Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
    p.instrs.push(Instr { name: "fc".into(), op: pipewright_ops::Op::Gemm(gemm), inputs: vec![Some(h), Some(w), Some(b)], outputs: vec![Some(out)], recompute: false });
    p.inputs.push(x);
    p.outputs.push(out);
    p.fill_last_uses();
    let params = StageParams { stage: 0, depth: 1, schedule: sched, recompute: rec };
    let z = Section { offset: 0, len: 0 };
    StageModule { header: ModuleHeader { version: 1, params, checksum: 0, program: z, weights: z }, program: p }
}

/// Train mode updates the running statistics once per microbatch forward (a recomputation
/// does not update them again), in microbatch order, and the report returns them by name.
#[test]
fn batchnorm_running_statistics_follow_training() {
    let data = dataset(2, M, None);
    let (mut mean, mut var) = (Tensor::from_slice(&[0.1f64, -0.2, 0.3, 0.0]), Tensor::from_slice(&[1.0f64, 2.0, 0.5, 1.5]));
    for (x, _) in data.iter().flatten() {
        let bm = x.mean_dim([0i64].as_slice(), false, Kind::Double);
        // The unbiased estimate, as PyTorch keeps it (the graph reads no statistics).
        let n = x.size()[0] as f64;
        let bv = (x - &bm).square().sum_dim_intlist([0i64].as_slice(), false, Kind::Double) / (n - 1.0);
        // The attribute is an f32, as in ONNX.
        let mom = 0.9f32 as f64;
        mean = &mean * mom + bm * (1.0 - mom);
        var = &var * mom + bv * (1.0 - mom);
    }
    for sched in [Schedule::GPipe, Schedule::TwoBw] {
        for rec in [Recompute::None, Recompute::Full] {
            let r = train(vec![batchnorm_stage(sched, rec)], &cfg(sched, OptimizerConfig::sgd(), 0.1, 2), feed(&data), &mut |_| {}).unwrap();
            let got = &r.buffers[0];
            assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["mean", "var"], "{sched:?} {rec:?}");
            for ((_, g), want) in got.iter().zip([&mean, &var]) {
                let diff = (g - want).abs().max().double_value(&[]);
                assert!(diff < 1e-12, "{sched:?} {rec:?}: running statistics off by {diff}");
            }
        }
    }
}

/// The largest relative difference between two runs' weights, over every stage.
fn weight_gap(a: &TrainReport, b: &TrainReport) -> f64 {
    let flat = |r: &TrainReport| -> Vec<(String, Tensor)> { r.weights.iter().flatten().map(|(n, t)| (n.clone(), t.shallow_clone())).collect() };
    let (fa, fb) = (flat(a), flat(b));
    assert_eq!(fa.len(), fb.len());
    fa.iter()
        .map(|(name, x)| {
            let (_, y) = fb.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no weight {name}"));
            assert_eq!(x.kind(), y.kind(), "{name}: master weights keep their type");
            (x - y).abs().max().double_value(&[]) / y.abs().max().double_value(&[]).max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// bf16 and fp16 compute with master weights in the stored type: training tracks the
/// full-precision run (relative weight difference under 2% after 5 SGD steps at d = 2,
/// where the rounding of bf16's 8-bit mantissa alone is 0.4%; Adam is left out, as it
/// turns rounding-sized gradients into full learning-rate steps) and the weights come
/// back in their own type.
#[test]
fn mixed_precision_tracks_full_precision() {
    let steps = 5;
    let data = dataset(steps, M, None);
    let opt = OptimizerConfig::sgd();
    let full = train(stages(2, Schedule::TwoBw, Recompute::None), &cfg(Schedule::TwoBw, opt, 0.3, steps), feed(&data), &mut |_| {}).unwrap();
    for p in [Precision::Bf16, Precision::Fp16] {
        let mut c = cfg(Schedule::TwoBw, opt, 0.3, steps);
        c.precision = p;
        let mut losses = Vec::new();
        let r = train(stages(2, Schedule::TwoBw, Recompute::None), &c, feed(&data), &mut |s| losses.push(s.loss)).unwrap();
        let gap = weight_gap(&r, &full);
        eprintln!("{p}: relative weight gap {gap:.2e}");
        assert!(gap < 0.02, "{p}: weights differ from fp32 by {gap}");
        assert!(gap > 0.0, "{p}: identical to full precision, so nothing was computed in {p}");
        for (a, b) in losses.iter().zip(&full.losses) {
            assert!((a - b).abs() < 0.02 * b.abs().max(1.0), "{p}: losses {losses:?} vs {:?}", full.losses);
        }
        // At most one 2-byte copy per held version of the 8-byte masters (at most a
        // quarter more weight bytes, counted in the stage's weights), not one per
        // in-flight microbatch.
        for (k, (low, hi)) in r.memory.iter().zip(&full.memory).enumerate() {
            assert!(low.weights > hi.weights && low.weights * 4 <= hi.weights * 5, "{p}: stage {k} weight bytes {} vs fp32 run {}", low.weights, hi.weights);
        }
    }
}

/// fp16 loss scaling: an overflow skips the update in every stage at once (no stage moves
/// ahead of the others), and the halved scale lets training go on.
#[test]
fn fp16_overflow_skips_the_step_in_every_stage() {
    let data = dataset(12, M, None);
    let fp16 = |scale: f64, steps: usize, d: usize, sched: Schedule| {
        let mut c = cfg(sched, OptimizerConfig::sgd(), 0.3, steps);
        c.precision = Precision::Fp16;
        c.loss_scale = LossScaler::with(scale, 1000);
        let mut skipped = Vec::new();
        let r = train(stages(d, sched, Recompute::None), &c, feed(&data[..steps]), &mut |s| skipped.push(s.skipped)).unwrap();
        (r, skipped)
    };
    // A scale far beyond fp16's range: every step overflows, no stage changes a weight.
    let init: Vec<Tensor> = init_weights().into_iter().flat_map(|(w, b)| [w, b]).collect();
    for sched in [Schedule::TwoBw, Schedule::Flush] {
        let (r, skipped) = fp16(2f64.powi(100), 3, 3, sched);
        assert_eq!(skipped, [true, true, true], "{sched:?}");
        for (got, want) in r.weights.iter().flatten().zip(&init) {
            assert!(got.1.equal(want), "{sched:?}: {} changed in a skipped step", got.0);
        }
    }
    // From 2^20 the first steps overflow and the scale halves until they fit: the skips
    // change the result (against a scale that never overflows), and are the same
    // decisions whether the layers are one stage or three.
    for sched in [Schedule::TwoBw, Schedule::Flush] {
        let (skipping, skips) = fp16(2f64.powi(20), 12, 3, sched);
        let (alone, skips_alone) = fp16(2f64.powi(20), 12, 1, sched);
        let (fitting, no_skips) = fp16(2f64.powi(4), 12, 3, sched);
        // Overflows first, then (the scale halved enough) none: reported once per step.
        let first_good = skips.iter().position(|s| !s).expect("the scale never fell far enough");
        assert!(first_good >= 1 && skips[first_good..].iter().all(|s| !s), "{sched:?}: {skips:?}");
        assert_eq!(skips, skips_alone, "{sched:?}");
        assert!(no_skips.iter().all(|s| !s), "{sched:?}: {no_skips:?}");
        assert!(weight_gap(&skipping, &fitting) > 0.01, "{sched:?}: no step was skipped from scale 2^20");
        let gap = weight_gap(&skipping, &alone);
        assert!(gap < 1e-3, "{sched:?}: d = 3 and d = 1 differ by {gap}: the stages skipped different steps");
        assert!(skipping.weights.iter().flatten().all(|(_, t)| t.isfinite().all().int64_value(&[]) == 1), "{sched:?}: non-finite weights");
    }
}

/// fp16's loss scale is part of a checkpoint: a run whose scale halved on overflows and
/// grew again, interrupted at a checkpoint and resumed, ends bit-identical to the
/// uninterrupted run (a resumed run restarting from the configured scale would skip
/// different steps), under 2BW and Flush at d = 3.
#[test]
fn fp16_resume_continues_from_the_saved_loss_scale() {
    let data = dataset(12, M, None);
    for sched in [Schedule::TwoBw, Schedule::Flush] {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut c = cfg(sched, OptimizerConfig::sgd(), 0.3, 12);
        c.precision = Precision::Fp16;
        // Overflows at first, then growth every 2 good steps: the scale moves both ways.
        c.loss_scale = LossScaler::with(2f64.powi(20), 2);
        c.checkpoint_every = Some(4);
        c.checkpoint_dir = Some(dir.path().to_path_buf());
        let mut skips = Vec::new();
        let whole = train(stages(3, sched, Recompute::None), &c, feed(&data), &mut |s| skips.push(s.skipped)).unwrap();
        assert!(skips[..4].iter().any(|s| *s), "{sched:?}: no overflow before the checkpoint: {skips:?}");
        let ck = read_checkpoint(&dir.path().join("step-000004")).unwrap();
        let saved = ck.stages[0].loss_scale.clone().expect("an fp16 checkpoint holds the loss scale");
        assert!(saved.scale < 2f64.powi(20), "{sched:?}: {saved:?}");
        assert!(ck.stages.iter().all(|s| s.loss_scale.as_ref() == Some(&saved)), "{sched:?}: the stages' scales differ");
        let mut c2 = c.clone();
        c2.checkpoint_every = None;
        let resumed = resume(stages(3, sched, Recompute::None), &c2, ck, feed(&data[4..]), &mut |_| {}).unwrap();
        for (a, b) in whole.weights.iter().flatten().zip(resumed.weights.iter().flatten()) {
            assert!(a.1.equal(&b.1), "{sched:?}: {} differs after resuming", a.0);
        }
    }
}

/// Stage placement: worker (r, k) takes the device of its stage-major rank, `(k * w + r) %
/// len`, and a run whose stages and replicas are placed on several devices (all the CPU
/// here) trains to the same weights and losses as the single-device run.
#[test]
fn placed_stages_train_like_one_device() {
    let mut c = cfg(Schedule::TwoBw, OptimizerConfig::adam(), 0.05, STEPS);
    c.replicas = 2;
    assert_eq!(c.worker_device(3, 2, 1), tch::Device::Cpu);
    c.devices = vec![tch::Device::Cpu, tch::Device::Cuda(1), tch::Device::Cuda(2)];
    // Rank i = k * 2 + r: stage i / 2, replica i % 2.
    assert_eq!((0..6).map(|i| c.worker_device(3, i / 2, i % 2)).collect::<Vec<_>>(), [c.devices.clone(), c.devices.clone()].concat());
    c.devices = vec![tch::Device::Cuda(0), tch::Device::Cuda(1)];
    // Two devices for three stages x two replicas: round-robin over the six ranks, so
    // each replica keeps one device.
    assert_eq!(c.worker_device(3, 2, 0), tch::Device::Cuda(0));
    assert_eq!(c.worker_device(3, 1, 1), tch::Device::Cuda(1));
    let data = dataset(STEPS, 2 * M, None);
    let mut one = cfg(Schedule::TwoBw, OptimizerConfig::adam(), 0.05, STEPS);
    one.replicas = 2;
    let mut losses_one = Vec::new();
    let base = train(stages(3, Schedule::TwoBw, Recompute::None), &one, feed(&data), &mut |s| losses_one.push(s.loss)).unwrap();
    let mut placed = one.clone();
    placed.devices = vec![tch::Device::Cpu; 3];
    let mut losses_placed = Vec::new();
    let r = train(stages(3, Schedule::TwoBw, Recompute::None), &placed, feed(&data), &mut |s| losses_placed.push(s.loss)).unwrap();
    assert_eq!(losses_one, losses_placed);
    assert_eq!(weight_gap(&r, &base), 0.0);
}

/// An early stop (Ctrl-C in `train`): asked while step 3 is reported, every worker stops
/// after one agreed step, that step is checkpointed although no regular checkpoint is due,
/// and resuming from it trains to the uninterrupted run's weights, bit for bit, under
/// every schedule and with replicas.
#[test]
fn a_stop_at_a_step_boundary_resumes_to_the_same_weights() {
    for (sched, replicas) in [(Schedule::TwoBw, 1), (Schedule::Flush, 1), (Schedule::GPipe, 1), (Schedule::TwoBw, 2)] {
        let data = dataset(12, replicas * M, None);
        let mut c = cfg(sched, OptimizerConfig::adam(), 0.05, 12);
        c.replicas = replicas;
        let whole = train(stages(3, sched, Recompute::None), &c, feed(&data), &mut |_| {}).unwrap();
        let dir = tempfile::tempdir().expect("temp dir");
        let gate = std::sync::Arc::new(StopGate::new());
        let mut stopping = c.clone();
        stopping.checkpoint_every = Some(100);
        stopping.checkpoint_dir = Some(dir.path().to_path_buf());
        stopping.stop = Some(gate.clone());
        let asked = gate.clone();
        let stopped = train(stages(3, sched, Recompute::None), &stopping, feed(&data), &mut |s| {
            if s.step == 2 {
                asked.request();
            }
        })
        .unwrap();
        let done = stopped.losses.len();
        assert!((3..12).contains(&done), "{sched:?} x{replicas}: stopped after {done} steps");
        assert_eq!(gate.stop_after(), Some(done as u64 - 1));
        assert_eq!(stopped.losses[..], whole.losses[..done], "{sched:?} x{replicas}: the losses before the stop");
        assert_eq!(stopped.checkpoints.len(), 1, "{sched:?} x{replicas}: {:?}", stopped.checkpoints);
        let ck = read_checkpoint(&stopped.checkpoints[0]).unwrap();
        assert_eq!(ck.step as usize, done);
        let resumed = resume(stages(3, sched, Recompute::None), &c, ck, feed(&data[done..]), &mut |_| {}).unwrap();
        assert_eq!(resumed.losses[..], whole.losses[done..], "{sched:?} x{replicas}: the losses after resuming");
        for (a, b) in whole.weights.iter().flatten().zip(resumed.weights.iter().flatten()) {
            assert!(a.1.equal(&b.1), "{sched:?} x{replicas}: {} differs after resuming", a.0);
        }
    }
}
