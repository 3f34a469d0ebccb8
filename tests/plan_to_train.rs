//! The plan reaches the run: `plan --json` → `compile --plan` → `train` with no microbatch
//! flags. Every planned value — depth, stage cuts, schedule, recomputation, microbatch `b`,
//! microbatches `m`, replicas `w` — is carried field for field into the build and is what
//! the training run executes (checked from its report, its metrics and its trace, whose op
//! order per stage must be the schedule's for the planned `m`). A flag that overrides the
//! build says so.

mod common;

use std::path::Path;

use pipewright_core::Recompute;
use pipewright_passes::plan_file::PlanFile;
use pipewright_runtime::build::Manifest;
use pipewright_runtime::module::read_module;
use pipewright_runtime::pipeline::{stage_ops, Op};
use pipewright_runtime::timeline::{read_chrome_trace, TraceKind};

use common::{assert_clean_error, command, fails, model, ok, pw, pw_ok};

/// Plans `model`, compiles the plan and trains it `steps` steps (with `extra` train flags);
/// returns the plan, the build's manifest, train's stderr, the per-step sample counts and
/// the trace.
fn plan_compile_train(dir: &Path, name: &str, output: &str, plan_args: &[&str], extra: &[&str]) -> (PlanFile, Manifest, String, Vec<u64>, Vec<pipewright_runtime::timeline::TraceEvent>) {
    let model = model(name);
    let model = model.to_str().unwrap();
    let mut args = vec!["plan", model, "--json"];
    args.extend_from_slice(plan_args);
    let json = pw_ok(&args);
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, json).unwrap();
    let plan = PlanFile::read(&plan_path).expect("plan --json writes a plan file");
    let build = dir.join("build");
    pw_ok(["compile", model, "--plan", plan_path.to_str().unwrap(), "-o", build.to_str().unwrap()]);
    let manifest = Manifest::read(&build).unwrap();
    let (trace, metrics) = (dir.join("trace.json"), dir.join("metrics.jsonl"));
    let mut args = vec!["train", build.to_str().unwrap(), "--output", output, "--steps", "3", "--no-progress"];
    args.extend_from_slice(&["--trace", trace.to_str().unwrap(), "--metrics", metrics.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let out = pw(&args);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let samples = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| l.split("\"samples\":").nth(1).and_then(|r| r.split(',').next()).and_then(|n| n.parse().ok()).expect("samples in metrics"))
        .collect();
    let events = read_chrome_trace(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    (plan, manifest, stderr, samples, events)
}

/// Each stage's forward/backward/step order in the trace (replica 0).
fn traced_ops(events: &[pipewright_runtime::timeline::TraceEvent], stage: usize) -> Vec<Op> {
    events
        .iter()
        .filter(|e| e.stage == stage)
        .filter_map(|e| match e.kind {
            TraceKind::Forward => e.microbatch.map(Op::Forward),
            TraceKind::Backward => e.microbatch.map(Op::Backward),
            TraceKind::Optimizer => Some(Op::Step(e.step)),
            _ => None,
        })
        .collect()
}

/// A stage's traced ops against its schedule's order: the forwards and backwards in that
/// order, and each update after its batch's last backward and before the first forward
/// that needs its version. (Under 2BW an update whose gradient sums go on in the
/// background is made as late as that forward, so it need not stand where the order's
/// step does.)
fn assert_ops_follow_the_schedule(traced: &[Op], planned: &[Op], schedule: pipewright_core::Schedule, m: u64, what: &str) {
    let compute = |ops: &[Op]| ops.iter().copied().filter(|o| !matches!(o, Op::Step(_))).collect::<Vec<_>>();
    assert_eq!(compute(traced), compute(planned), "{what}: forwards and backwards");
    let steps = planned.iter().filter(|o| matches!(o, Op::Step(_))).count() as u64;
    for t in 0..steps {
        let at = traced.iter().position(|&o| o == Op::Step(t)).unwrap_or_else(|| panic!("{what}: no update of step {t} in {traced:?}"));
        let batch_done = traced.iter().rposition(|o| matches!(o, Op::Backward(j) | Op::BackwardWeight(j) if j / m == t));
        assert!(batch_done.is_some_and(|b| b < at), "{what}: the update of step {t} before its batch's last backward: {traced:?}");
        let needed = traced.iter().position(|o| matches!(o, Op::Forward(j) if schedule.update_rule().version_for(*j, m) > t));
        assert!(needed.is_none_or(|f| at < f), "{what}: the update of step {t} after a forward that needs it: {traced:?}");
    }
}

fn planned_values_reach_the_run(model: &str, output: &str, plan_args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (plan, manifest, stderr, samples, events) = plan_compile_train(dir.path(), model, output, plan_args, &[]);
    let c = &plan.plan.chosen;
    let (w, d, b, m) = (c.w as u64, c.d, c.b, c.m);
    assert!(m > 1 && d > 1, "{model}: a plan worth checking (d={d}, m={m})");
    // The build carries the plan field for field.
    let p = &manifest.pipeline;
    assert_eq!((p.depth as usize, p.schedule, p.recompute), (d, c.schedule, c.recompute), "{model}");
    assert_eq!((p.microbatch, p.microbatches, p.replicas), (Some(b), Some(m), Some(w)), "{model}");
    assert!(p.origin.starts_with("plan ") && p.origin.ends_with("plan.json"), "{}", p.origin);
    for (st, planned) in manifest.stages.iter().zip(&plan.plan.stages) {
        assert_eq!(st.nodes, planned.nodes, "{model}: stage {} holds the planned nodes", st.index);
        let module = read_module(dir.path().join("build").join(&st.module)).unwrap();
        assert_eq!((module.header.params.schedule, module.header.params.recompute), (c.schedule, c.recompute));
    }
    // The run uses them, and says where they came from.
    for line in [format!("microbatch {b} (from the build: plan "), format!("microbatches {m} (from the build: plan "), format!("replicas {w} (from the build: plan ")] {
        assert!(stderr.contains(&line), "{model}: {line:?} missing in:\n{stderr}");
    }
    assert!(stderr.contains(&format!("schedule {}, recompute {} (from the build)", c.schedule, c.recompute)), "{stderr}");
    assert_eq!(samples, vec![b * m * w; 3], "{model}: samples per step");
    for k in 0..d {
        assert_ops_follow_the_schedule(&traced_ops(&events, k), &stage_ops(c.schedule, k, d, m as usize, 3).unwrap(), c.schedule, m, &format!("{model}: stage {k} with m={m}"));
    }
    // Selective recomputation reruns its pieces inside each backward (one trace event);
    // the modules the run loaded carry the recompute segments it follows.
    for st in &manifest.stages {
        let p = read_module(dir.path().join("build").join(&st.module)).unwrap().program;
        match c.recompute {
            Recompute::Selective => assert!(p.recompute_count() > 0 && p.recompute_count() < p.instrs.len(), "{model}: stage {}", st.index),
            Recompute::Full => assert_eq!(p.recompute_count(), p.instrs.len()),
            Recompute::None => assert_eq!(p.recompute_count(), 0),
        }
    }
    let recomputed = events.iter().any(|e| e.kind == TraceKind::Recompute);
    assert_eq!(recomputed, c.recompute == Recompute::Full, "{model}: recompute events under {}", c.recompute);
}

#[test]
fn a_selective_plan_reaches_the_run_on_the_mlp() {
    planned_values_reach_the_run(
        "mlp",
        "linear_3",
        &["--stages", "2", "--workers", "4", "--batch", "32", "--microbatch", "4", "--schedule", "2bw", "--recompute", "selective"],
    );
}

#[test]
fn a_selective_plan_reaches_the_run_on_gpt2_tiny() {
    planned_values_reach_the_run(
        "gpt2-tiny",
        "linear",
        &["--stages", "2", "--workers", "2", "--batch", "8", "--microbatch", "2", "--schedule", "flush", "--recompute", "selective"],
    );
}

#[test]
fn a_flag_overrides_the_build_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let plan_args = ["--stages", "2", "--workers", "2", "--batch", "16", "--microbatch", "4", "--schedule", "2bw", "--recompute", "full"];
    let (plan, _, stderr, samples, events) = plan_compile_train(dir.path(), "mlp", "linear_3", &plan_args, &["--microbatches", "3"]);
    let c = &plan.plan.chosen;
    assert_eq!((c.b, c.m, c.w), (4, 4, 1));
    assert!(stderr.contains("microbatches 3 (--microbatches, overriding the build's 4)"), "{stderr}");
    assert!(stderr.contains("microbatch 4 (from the build: plan "), "{stderr}");
    assert_eq!(samples, vec![12; 3]);
    assert_eq!(traced_ops(&events, 0), stage_ops(c.schedule, 0, 2, 3, 3).unwrap());
    assert!(events.iter().any(|e| e.kind == TraceKind::Recompute), "full recomputation ran");
}

#[test]
fn a_plan_for_another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mlp, gpt) = (model("mlp"), model("gpt2-tiny"));
    let json = pw_ok(["plan", mlp.to_str().unwrap(), "--stages", "2", "--json"]);
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, json).unwrap();
    let build = dir.path().join("b");
    let out = command().arg("compile").arg(&gpt).arg("--plan").arg(&plan_path).arg("-o").arg(&build).output().unwrap();
    assert_clean_error(&out, &plan_path, &["planned for model", &mlp.display().to_string(), "not for this one"]);
    assert!(!build.exists(), "nothing written");
    // A plan from an older pipewright (no format field) is refused by version.
    std::fs::write(&plan_path, r#"{"chosen": {"d": 2}, "stages": []}"#).unwrap();
    let out = command().arg("compile").arg(&mlp).arg("--plan").arg(&plan_path).arg("-o").arg(&build).output().unwrap();
    fails(&out, &[&plan_path.display().to_string(), "not a plan file", "format"]);
}
