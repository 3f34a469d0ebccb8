//! The pass manager: the standard pipeline runs in order with timings, stop-after stops,
//! unknown names are refused with the valid list, and the `--print-after` text of each
//! pass is snapshotted on gpt2-tiny and resnet18 at 2 and 4 stages.

mod common;

use common::{contiguous, model};

use pipewright_passes::manager::{
    compile_passes, standard_passes, CompileOptions, ManagerError, PassManager, PipelineState,
    PrintAfter, RunOptions, STANDARD_PASSES,
};
use pipewright_core::Recompute;



fn compile(name: &str, d: u32, opts: CompileOptions) -> Result<PipelineState, ManagerError> {
    let g = model(name);
    let stages = contiguous(&g, d);
    compile_passes(g, stages, &opts)
}

#[test]
fn the_standard_pipeline_runs_every_pass_in_order_with_timings() {
    let st = compile("mlp.onnx", 2, CompileOptions::default()).expect("compiles");
    let names: Vec<&str> = st.timings.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(names, STANDARD_PASSES);
    assert_eq!(st.ran, STANDARD_PASSES);
    assert_eq!(
        standard_passes(&CompileOptions::default()).names(),
        STANDARD_PASSES
    );
    assert!(
        st.stages.is_some() && st.cost.is_some() && st.recompute.is_some() && st.versions.is_some()
    );
    assert!(st.printed.is_empty());
    let t = st.timings_text();
    for p in STANDARD_PASSES {
        assert!(t.contains(p), "{t}");
    }
    assert!(t.contains("total") && t.contains(" ms"), "{t}");
}

#[test]
fn stop_after_stops() {
    let opts = CompileOptions {
        stop_after: Some("partition".into()),
        ..CompileOptions::default()
    };
    let st = compile("mlp.onnx", 2, opts).unwrap();
    assert_eq!(st.ran, ["import", "shape-inference", "partition"]);
    assert_eq!(st.timings.len(), 3);
    assert!(st.stages.is_some());
    assert!(st.recompute.is_none() && st.versions.is_none());
}

#[test]
fn unknown_pass_names_are_refused_with_the_valid_ones() {
    for opts in [
        CompileOptions {
            stop_after: Some("partitoin".into()),
            ..CompileOptions::default()
        },
        CompileOptions {
            print_after: PrintAfter::Pass("lowering".into()),
            ..CompileOptions::default()
        },
    ] {
        let err = compile("mlp.onnx", 2, opts).unwrap_err();
        match &err {
            ManagerError::UnknownPass { valid, .. } => assert_eq!(valid, &STANDARD_PASSES),
            other => panic!("expected an unknown-pass error, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("valid passes: import, shape-inference, partition, recompute, weight-versioning, lower"), "{msg}");
    }
}

#[test]
fn a_pass_error_names_the_pass_and_the_lower_placeholder_is_replaceable() {
    // 2BW with m < d fails in weight-versioning.
    let opts = CompileOptions {
        microbatches: Some(1),
        ..CompileOptions::default()
    };
    let err = compile("mlp.onnx", 2, opts).unwrap_err();
    assert!(
        matches!(&err, ManagerError::Pass { pass, .. } if pass == "weight-versioning"),
        "{err}"
    );
    assert!(err.to_string().contains("m >= d"), "{err}");

    let g = model("mlp.onnx");
    let stages = contiguous(&g, 2);
    let mut st = PipelineState::with_stages(g, stages);
    let mut lowered = 0;
    {
        let mut pm = standard_passes(&CompileOptions::default());
        pm.replace("lower", |s: &mut PipelineState| {
            assert!(s.versions.is_some());
            lowered += 1;
            Ok(())
        })
        .unwrap();
        assert!(pm
            .replace("codegen", |_: &mut PipelineState| Ok(()))
            .is_err());
        pm.run(&mut st, &RunOptions::default()).unwrap();
    }
    assert_eq!(lowered, 1);
}

#[test]
fn the_verifier_catches_a_pass_that_breaks_the_graph() {
    let g = model("mlp.onnx");
    let stages = contiguous(&g, 2);
    let mut st = PipelineState::with_stages(g, stages.clone());
    // Claims the unpartitioned graph is staged: verify_stages must refuse the crossings.
    let mut pm = PassManager::new().add("bad-partition", move |s: &mut PipelineState| {
        s.stages = Some(stages.clone());
        Ok(())
    });
    let err = pm
        .run(
            &mut st,
            &RunOptions {
                verify: true,
                ..RunOptions::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(&err, ManagerError::Verify { pass, .. } if pass == "bad-partition"),
        "{err}"
    );
    let dup = PassManager::new()
        .add("a", |_: &mut PipelineState| Ok(()))
        .add("a", |_: &mut PipelineState| Ok(()));
    let mut dup = dup;
    assert!(matches!(
        dup.run(
            &mut PipelineState::new(model("mlp.onnx")),
            &RunOptions::default()
        ),
        Err(ManagerError::DuplicatePass(_))
    ));
}

#[test]
fn print_after_all_prints_each_pass_with_combined_notes() {
    let opts = CompileOptions {
        print_after: PrintAfter::All,
        recompute: Recompute::Selective,
        ..CompileOptions::default()
    };
    let st = compile("mlp.onnx", 2, opts).unwrap();
    for p in STANDARD_PASSES {
        assert!(
            st.printed.contains(&format!("// ----- after {p} -----")),
            "{p}"
        );
    }
    assert!(st.printed.contains("stage=1 stash w:%v"), "{}", st.printed);
    assert!(st.printed.contains("recompute: mode selective"));
    assert!(st.printed.contains("weight versions: 2bw"));
}

#[test]
fn print_after_snapshots() {
    for name in ["gpt2-tiny", "resnet18"] {
        for d in [2u32, 4] {
            for pass in ["partition", "recompute", "weight-versioning"] {
                let opts = CompileOptions {
                    print_after: PrintAfter::Pass(pass.into()),
                    recompute: Recompute::Selective,
                    microbatch: 8,
                    ..CompileOptions::default()
                };
                let st = compile(&format!("{name}.onnx"), d, opts)
                    .unwrap_or_else(|e| panic!("{name} {d}: {e}"));
                assert!(st
                    .printed
                    .starts_with(&format!("// ----- after {pass} -----")));
                insta::assert_snapshot!(format!("{name}_{d}_stages_after_{pass}"), st.printed);
            }
        }
    }
}
