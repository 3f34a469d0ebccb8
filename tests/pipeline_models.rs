//! The pipeline executor on real models: gpt2-tiny and resnet18 compiled into 1..4
//! stages train to the same weights under every schedule (PipeDream-Flush, GPipe and ZB-H1:
//! plain training, ZB-H1's checked against Flush's too; 2BW: the 1-stale update, which the
//! single-stage 2BW run applies), and the
//! runtime's peak live bytes match the planner's memory prediction.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;

use pipewright_runtime::module::{read_module, StageModule};
use pipewright_core::{Loss, Schedule};
use pipewright_runtime::pipeline::{train, BatchStream, Microbatch, Objective, OptimizerConfig, TrainConfig, TrainReport};
use tch::{Kind, Tensor};

use common::{model, pw_ok};

fn load(dir: &Path) -> Vec<StageModule> {
    let mut mods = Vec::new();
    for k in 0.. {
        let p = dir.join(format!("stage{k}.pwm"));
        if !p.exists() {
            break;
        }
        mods.push(read_module(&p).unwrap_or_else(|e| panic!("{e}")));
    }
    mods
}

fn compile(name: &str, d: usize, schedule: &str, recompute: &str, dir: &Path) -> Vec<StageModule> {
    let m = model(name);
    pw_ok(["compile", m.to_str().unwrap(), "--stages", &d.to_string(), "--schedule", schedule, "--recompute", recompute, "-o", dir.to_str().unwrap()]);
    load(dir)
}

/// Seeded random batches: `steps` batches of `m` microbatches of `b` samples.
fn batches(name: &str, steps: usize, m: usize, b: i64) -> Vec<Vec<(Tensor, Tensor)>> {
    tch::manual_seed(7);
    (0..steps)
        .map(|_| {
            (0..m)
                .map(|_| match name {
                    "gpt2-tiny" => (Tensor::randint(1000, [b, 32], (Kind::Int64, tch::Device::Cpu)), Tensor::randint(1000, [b, 32], (Kind::Int64, tch::Device::Cpu))),
                    "resnet18" => (Tensor::randn([b, 3, 224, 224], (Kind::Float, tch::Device::Cpu)), Tensor::randint(1000, [b], (Kind::Int64, tch::Device::Cpu))),
                    other => panic!("no data for {other}"),
                })
                .collect()
        })
        .collect()
}

fn feed(name: &str, data: &[Vec<(Tensor, Tensor)>]) -> BatchStream {
    let input = if name == "gpt2-tiny" { "input_ids" } else { "x" };
    let v: Vec<Vec<Microbatch>> = data
        .iter()
        .map(|b| b.iter().map(|(x, y)| Microbatch { inputs: vec![(input.into(), x.shallow_clone())], labels: Some(y.shallow_clone()) }).collect())
        .collect();
    Box::new(v.into_iter().map(Ok))
}

fn run(name: &str, stages: Vec<StageModule>, schedule: Schedule, data: &[Vec<(Tensor, Tensor)>]) -> TrainReport {
    let mut cfg = TrainConfig::new(schedule, Objective::new(Loss::CrossEntropy, "linear"), 0.05, data.len());
    cfg.optimizer = OptimizerConfig { momentum: 0.9, ..OptimizerConfig::sgd() };
    train(stages, &cfg, feed(name, data), &mut |_| {}).unwrap_or_else(|e| panic!("{name} {schedule:?}: {e}"))
}

/// Every weight of `got` (tied copies in several stages included) equals the reference's
/// within 1e-5 of the weight's largest magnitude; returns the largest relative difference.
fn assert_same_weights(got: &TrainReport, want: &TrainReport, what: &str) -> f64 {
    let reference: Vec<&(String, Tensor)> = want.weights.iter().flatten().collect();
    let mut worst: f64 = 0.0;
    let mut seen = 0;
    for (name, g) in got.weights.iter().flatten() {
        let (_, w) = reference.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{what}: {name} not in the reference"));
        let diff = (g - w).abs().max().double_value(&[]);
        let scale = w.abs().max().double_value(&[]).max(1e-12);
        assert!(diff / scale <= 1e-5, "{what}: {name} differs by {diff} (scale {scale})");
        worst = worst.max(diff / scale);
        seen += 1;
    }
    assert!(seen >= reference.len(), "{what}: {seen} weights, the reference has {}", reference.len());
    worst
}

fn same_weights_at_every_depth(name: &str, steps: usize, b: i64) {
    let data = batches(name, steps, 4, b);
    let mut vanilla: Option<TrainReport> = None;
    for (schedule, sched, recompute) in [("gpipe", Schedule::GPipe, "full"), ("flush", Schedule::Flush, "none"), ("zb-h1", Schedule::ZbH1, "none"), ("zb-h1", Schedule::ZbH1, "full"), ("zb-h2", Schedule::ZbH2, "none"), ("2bw", Schedule::TwoBw, "full")] {
        let tmp = tempfile::tempdir().expect("temp dir");
        let single = run(name, compile(name, 1, schedule, recompute, &tmp.path().join("d1")), sched, &data);
        // The split backward computes what the whole one does: ZB-H1 trains to Flush's
        // weights (vanilla training).
        if let (Schedule::ZbH1 | Schedule::ZbH2, Some(v)) = (sched, &vanilla) {
            let worst = assert_same_weights(&single, v, &format!("{name} {schedule} ({recompute}) d=1 against flush"));
            eprintln!("{name} {schedule} ({recompute}) d=1: largest relative weight difference to flush: {worst:.2e}");
        }
        let initial = load(&tmp.path().join("d1"));
        let moved = single.weights[0].iter().any(|(n, t)| {
            let p = &initial[0].program;
            let s = p.stored.iter().find(|s| &p.slots[s.slot.index()].name == n).expect("stored weight");
            let t0 = pipewright_runtime::exec::tensor_from_bytes(s.elem, &s.dims, &s.bytes).unwrap();
            (t - t0).abs().max().double_value(&[]) > 1e-6
        });
        assert!(moved, "{name} {schedule}: training did not change the weights");
        for d in 2..=4 {
            let what = format!("{name} {schedule} ({recompute}) d={d}");
            let r = run(name, compile(name, d, schedule, recompute, &tmp.path().join(format!("d{d}"))), sched, &data);
            assert_eq!(r.weights.len(), d);
            let worst = assert_same_weights(&r, &single, &what);
            eprintln!("{what}: largest relative weight difference to d=1: {worst:.2e}");
            let versions = if sched == Schedule::TwoBw { 2 } else { 1 };
            assert!(r.peak_versions.iter().all(|&v| v <= versions), "{what}: {:?}", r.peak_versions);
        }
        if sched == Schedule::Flush {
            vanilla = Some(single);
        }
    }
}

#[test]
fn gpt2_tiny_trains_to_the_same_weights_at_every_depth() {
    same_weights_at_every_depth("gpt2-tiny", 3, 2);
}

#[test]
fn resnet18_trains_to_the_same_weights_at_every_depth() {
    same_weights_at_every_depth("resnet18", 2, 1);
}

/// The planner's memory prediction for stage 0 (which holds `d` microbatches in flight,
/// the number the planner's formula assumes for every stage) matches the runtime's peak
/// live bytes within 10% under 2BW, with and without recomputation; later stages hold
/// fewer microbatches and stay under the prediction; no stage holds more than two weight
/// versions.
#[test]
fn peak_memory_matches_the_planner_prediction() {
    let name = "gpt2-tiny";
    let m = model(name);
    let (b, mb) = (4i64, 2usize);
    let data = batches(name, 4, mb, b);
    for recompute in ["none", "full"] {
        let tmp = tempfile::tempdir().expect("temp dir");
        let plan_file = tmp.path().join("plan.json");
        let (b_arg, batch_arg) = (b.to_string(), (b * mb as i64).to_string());
        let json = pw_ok([
            "plan", m.to_str().unwrap(), "--stages", "2", "--workers", "2", "--microbatch", &b_arg, "--batch", &batch_arg, "--schedule", "2bw",
            "--recompute", recompute, "--optimizer", "sgd", "--json",
        ]);
        std::fs::write(&plan_file, json).unwrap();
        let plan = pipewright_passes::plan_file::PlanFile::read(&plan_file).unwrap();
        let predicted = plan.plan.chosen.peak_memory_per_stage.clone();
        let build = tmp.path().join("build");
        pw_ok(["compile", m.to_str().unwrap(), "--plan", plan_file.to_str().unwrap(), "-o", build.to_str().unwrap()]);
        let mut cfg = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::CrossEntropy, "linear"), 0.05, data.len());
        cfg.optimizer = OptimizerConfig::sgd();
        let r = train(load(&build), &cfg, feed(name, &data), &mut |_| {}).unwrap();
        for (k, (mem, &want)) in r.memory.iter().zip(&predicted).enumerate() {
            let ratio = mem.total as f64 / want as f64;
            eprintln!("recompute {recompute}, stage {k}: runtime peak {} B vs planner {want} B (ratio {ratio:.3}); {mem:?}", mem.total);
            if k == 0 {
                assert!((ratio - 1.0).abs() <= 0.10, "recompute {recompute}: stage 0 peak {} vs predicted {want}", mem.total);
                assert_eq!(mem.in_flight, 2, "stage 0 of 2 holds 2 microbatches at its peak");
            } else {
                assert!(ratio <= 1.10, "recompute {recompute}: stage {k} peak {} over predicted {want}", mem.total);
            }
            assert!(mem.versions <= 2 && r.peak_versions[k] <= 2, "{mem:?}");
        }
    }
}

/// Selective recomputation (kept matmul/conv outputs, recomputed elementwise runs) trains
/// to the same weights as no recomputation, and stashes fewer activation bytes.
#[test]
fn selective_recompute_matches_no_recompute() {
    for (name, steps, b) in [("gpt2-tiny", 3, 2), ("resnet18", 2, 1)] {
        let data = batches(name, steps, 2, b);
        let tmp = tempfile::tempdir().expect("temp dir");
        let none = run(name, compile(name, 2, "2bw", "none", &tmp.path().join("none")), Schedule::TwoBw, &data);
        let selective_modules = compile(name, 2, "2bw", "selective", &tmp.path().join("sel"));
        assert!(selective_modules.iter().any(|m| m.program.recompute_count() > 0), "{name}: nothing marked for recomputation");
        let selective = run(name, selective_modules, Schedule::TwoBw, &data);
        let worst = assert_same_weights(&selective, &none, &format!("{name} selective"));
        let (a_sel, a_none) = (selective.memory[0].activations, none.memory[0].activations);
        eprintln!("{name}: selective vs none: weights within {worst:.2e}; stage-0 activations {a_sel} vs {a_none} bytes");
        assert!(a_sel < a_none, "{name}: selective stashes {a_sel} bytes, none {a_none}");
    }
}
