//! The GPU acceptance run (`scripts/gpu_acceptance.py`, docs/gpu.md) on the CPU with a
//! tiny GPT-2: everything but the GPU itself is exercised before a GPU is lent — the
//! commands, the CPU references, the parity and host-read checks, the PyTorch-eager
//! baseline, the planner's memory figure and the verdict table.
#![cfg(feature = "torch")]

mod common;

use std::process::Command;

use common::corpus;

#[test]
fn the_gpu_acceptance_script_passes_its_cpu_dry_run() {
    let python = std::env::var("PIPEWRIGHT_TORCH_PYTHON")
        .expect("PIPEWRIGHT_TORCH_PYTHON must name a python with torch and transformers (scripts/test.sh sets it from zoo/env.sh)");
    let out = tempfile::tempdir().expect("temp dir");
    let run = Command::new(&python)
        .arg(common::root().join("scripts/gpu_acceptance.py"))
        .args(["--bin", env!("CARGO_BIN_EXE_pipewright"), "--device", "cpu", "--size", "tiny", "--models"])
        .arg(corpus().join("models"))
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("runs the acceptance script");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let table = std::fs::read_to_string(out.path().join("acceptance.md")).expect("the table was written");
    let count = |check: &str| table.lines().filter(|l| l.starts_with(&format!("| {check} |"))).count();
    assert_eq!(count("doctor"), 1, "{table}");
    assert_eq!(count("run-forward"), 4, "{table}");
    // d = 1 and 2 under three schedules in three precisions, and two placements at d = 2.
    assert_eq!(count("train parity"), 24, "{table}");
    assert_eq!(count("host reads"), 1, "{table}");
    assert_eq!(count("step time"), 2, "{table}");
    assert_eq!(count("peak memory"), 1, "{table}");
    // d = 2 and 4: 2bw, flush and gpipe in fp32, and 2bw in bf16.
    assert_eq!(count("schedules"), 8, "{table}");
    assert!(table.contains("41 checks on cpu: all passed."), "{table}");
    assert!(!table.contains("| FAIL |"), "{table}");
    fused_attention_of_the_torchscript_export_matches_onnxruntime(&out.path().join("gpt2-tiny.onnx"));
}

/// The script's GPT-2 export (torch.onnx's TorchScript exporter, transformers' SDPA
/// attention) imports with every attention fused (`pipewright_ir::fuse::attention`), and
/// runs as onnxruntime runs the export.
fn fused_attention_of_the_torchscript_export_matches_onnxruntime(model: &std::path::Path) {
    let ir = common::pw(&["inspect", model.to_str().unwrap(), "--ir"]);
    let text = String::from_utf8_lossy(&ir.stdout);
    assert_eq!((text.matches("= Attention[").count(), text.matches("= Softmax").count()), (2, 0), "{text}");
    let python = std::env::var("PIPEWRIGHT_PYTHON").expect("PIPEWRIGHT_PYTHON must name a python with onnxruntime (scripts/test.sh sets it)");
    let inputs = model.with_extension("inputs");
    let script = "import sys, os, numpy as np, onnxruntime as ort\nfrom onnx import numpy_helper\nm, d = sys.argv[1], sys.argv[2]\nos.makedirs(d)\ns = ort.InferenceSession(m)\ni = s.get_inputs()[0]\nx = np.random.default_rng(0).integers(0, 100, size=(3, i.shape[1])).astype(np.int64)\nopen(f'{d}/input_0.pb', 'wb').write(numpy_helper.from_array(x, i.name).SerializeToString())\ny = s.run(None, {i.name: x})[0]\nopen(f'{d}/output_0.pb', 'wb').write(numpy_helper.from_array(y, 'logits').SerializeToString())\n";
    let run = Command::new(&python).args(["-c", script]).arg(model).arg(&inputs).output().expect("runs onnxruntime");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let out = common::pw(&["run-forward", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("match: all 1 compared output(s) agree"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
}

/// `--checks` runs a subset (for a short GPU lease): only its rows, its count in the
/// verdict; an unknown check, or schedules without speed, is refused before anything runs.
#[test]
fn the_gpu_acceptance_script_runs_a_chosen_subset() {
    let python = std::env::var("PIPEWRIGHT_TORCH_PYTHON")
        .expect("PIPEWRIGHT_TORCH_PYTHON must name a python with torch and transformers (scripts/test.sh sets it from zoo/env.sh)");
    let out = tempfile::tempdir().expect("temp dir");
    let run = |checks: &str| {
        Command::new(&python)
            .arg(common::root().join("scripts/gpu_acceptance.py"))
            .args(["--bin", env!("CARGO_BIN_EXE_pipewright"), "--device", "cpu", "--size", "tiny", "--checks", checks, "--models"])
            .arg(corpus().join("models"))
            .arg("--out")
            .arg(out.path())
            .output()
            .expect("runs the acceptance script")
    };
    let ok = run("doctor,forward");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let table = std::fs::read_to_string(out.path().join("acceptance.md")).expect("the table was written");
    assert!(table.contains("5 checks on cpu: all passed."), "{table}");
    assert!(table.contains("--checks doctor,forward`"), "{table}");
    assert!(!table.contains("| train parity |"), "{table}");
    for bad in ["doctor,speeed", "schedules"] {
        let refused = run(bad);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains(&format!("--checks {bad}: choose from doctor,forward,parity,speed,schedules; schedules needs speed")), "{bad}: {stderr}");
    }
}
