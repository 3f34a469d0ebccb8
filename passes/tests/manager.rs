//! The compile passes through the pass manager: they run in order with timings,
//! `--stop-after` stops, a failing pass is named, the verifier catches an invalid result,
//! and the `--print-after` text of each pass is snapshotted on gpt2-tiny and resnet18 at
//! 2 and 4 stages.

mod common;

use common::{contiguous, model_path};
use pipewright_core::{PassName, Recompute, Schedule};
use pipewright_ir::ImportOptions;
use pipewright_core::PrintAfter;
use pipewright_passes::manager::{ManagerError, PassManager, PassOptions, PassOutput};
use pipewright_passes::pipeline::{import, partition, plan_stages, recompute, version, Partitioned, PlanRequest, Versioned};

const FRONT: [PassName; 5] = [PassName::Import, PassName::Plan, PassName::Partition, PassName::Recompute, PassName::WeightVersioning];

fn stages(depth: u32, recompute: Recompute, microbatches: Option<u64>) -> PlanRequest {
    PlanRequest::Stages { depth, schedule: Schedule::TwoBw, recompute, microbatch: Some(8), microbatches, placement: pipewright_core::Placement::StageMajor }
}

/// Runs the passes of this crate (everything but `lower`) on a shared model.
fn front(name: &str, request: &PlanRequest, opts: PassOptions) -> (PassManager, Result<Option<Versioned>, ManagerError>) {
    let mut pm = PassManager::new(opts);
    let path = model_path(name);
    let result = (|| {
        let Some(imported) = pm.run(PassName::Import, (), |()| import(&path, &ImportOptions::default()))? else { return Ok(None) };
        let Some(planned) = pm.run(PassName::Plan, imported, |g| plan_stages(g, request))? else { return Ok(None) };
        let Some(partitioned) = pm.run(PassName::Partition, planned, partition)? else { return Ok(None) };
        let Some(recomputed) = pm.run(PassName::Recompute, partitioned, recompute)? else { return Ok(None) };
        pm.run(PassName::WeightVersioning, recomputed, version)
    })();
    (pm, result)
}

#[test]
fn the_passes_run_in_order_with_timings() {
    let (pm, out) = front("mlp.onnx", &stages(2, Recompute::None, None), PassOptions::default());
    let v = out.expect("compiles").expect("ran to the end");
    assert_eq!(pm.timings().iter().map(|t| t.0).collect::<Vec<_>>(), FRONT);
    assert_eq!(v.partitioned.stages.num_stages, 2);
    assert!(pm.printed().is_empty());
    let t = pm.timings_text();
    for p in FRONT {
        assert!(t.contains(p.name()), "{t}");
    }
    assert!(t.contains("total") && t.contains(" ms"), "{t}");
}

#[test]
fn stop_after_stops() {
    let opts = PassOptions { stop_after: Some(PassName::Partition), ..PassOptions::default() };
    let (pm, out) = front("mlp.onnx", &stages(2, Recompute::None, None), opts);
    assert!(out.unwrap().is_none());
    assert!(pm.stopped());
    assert_eq!(pm.timings().iter().map(|t| t.0).collect::<Vec<_>>(), [PassName::Import, PassName::Plan, PassName::Partition]);
}

#[test]
fn a_pass_error_names_the_pass() {
    // 2BW with m < d fails in weight-versioning.
    let (_, out) = front("mlp.onnx", &stages(2, Recompute::None, Some(1)), PassOptions::default());
    let err = out.unwrap_err();
    assert!(matches!(&err, ManagerError::Pass { pass: PassName::WeightVersioning, .. }), "{err}");
    assert!(err.to_string().starts_with("pass weight-versioning failed: ") && err.to_string().contains("m >= d"), "{err}");
}

#[test]
fn the_verifier_catches_a_pass_that_breaks_the_graph() {
    let (_, out) = front("mlp.onnx", &stages(2, Recompute::None, None), PassOptions { stop_after: Some(PassName::Plan), ..PassOptions::default() });
    assert!(out.unwrap().is_none());
    let path = model_path("mlp.onnx");
    let planned = plan_stages(import(&path, &ImportOptions::default()).unwrap(), &stages(2, Recompute::None, None)).unwrap();
    // A partition pass that claims the unpartitioned graph is staged: the stage verifier
    // must refuse the crossings without boundaries.
    let broken = |p: pipewright_passes::pipeline::Planned| -> Result<Partitioned, std::io::Error> {
        let stages = contiguous(&p.graph, 2);
        Ok(Partitioned { graph: p.graph, cost: p.cost, plan: p.plan, decision: p.decision, stages })
    };
    let mut pm = PassManager::new(PassOptions { verify: true, ..PassOptions::default() });
    let err = pm.run(PassName::Partition, planned, broken).unwrap_err();
    assert!(matches!(&err, ManagerError::Verify { pass: PassName::Partition, .. }), "{err}");
}

#[test]
fn print_after_all_prints_each_pass_with_combined_notes() {
    let opts = PassOptions { print_after: PrintAfter::All, ..PassOptions::default() };
    let (pm, out) = front("mlp.onnx", &stages(2, Recompute::Selective, None), opts);
    out.unwrap().unwrap();
    let printed = pm.printed();
    for p in FRONT {
        assert!(printed.contains(&format!("// ----- after {p} -----")), "{p}");
    }
    assert!(printed.contains("decided: d=2 schedule=2bw recompute=selective b=8 (compile --stages 2)"), "{printed}");
    assert!(printed.contains("stage=1 stash w:%v"), "{printed}");
    assert!(printed.contains("recompute: mode selective"));
    assert!(printed.contains("weight versions: 2bw"));
}

#[test]
fn every_pass_output_checks_itself() {
    let (_, out) = front("gpt2-tiny.onnx", &stages(3, Recompute::Full, None), PassOptions { verify: true, ..PassOptions::default() });
    let v = out.unwrap().unwrap();
    assert_eq!(v.check(), Ok(()));
    assert!(v.text().contains("gradient sync groups (tied weights)"), "the tied LM head is reported");
}

#[test]
fn print_after_snapshots() {
    for name in ["gpt2-tiny", "resnet18"] {
        for d in [2u32, 4] {
            for pass in [PassName::Partition, PassName::Recompute, PassName::WeightVersioning] {
                let opts = PassOptions { print_after: PrintAfter::Pass(pass), ..PassOptions::default() };
                let (pm, out) = front(&format!("{name}.onnx"), &stages(d, Recompute::Selective, None), opts);
                out.unwrap_or_else(|e| panic!("{name} {d}: {e}"));
                assert!(pm.printed().starts_with(&format!("// ----- after {pass} -----")));
                insta::assert_snapshot!(format!("{name}_{d}_stages_after_{pass}"), pm.printed());
            }
        }
    }
}
