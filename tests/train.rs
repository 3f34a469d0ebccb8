//! `pipewright train` end to end: compile the shared MLP into stages and train it on the
//! 8x8 digits in `examples/digits` under each schedule on the embedded executor.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{node, value_info, ModelBuilder, I64};
use onnx_protobuf::{Message, ModelProto};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pw(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright")).args(args).output().expect("runs pipewright")
}

fn compile(dir: &Path, stages: &str, schedule: &str, recompute: &str) {
    let model = root().join("../shared/corpus/models/mlp.onnx");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", stages, "--schedule", schedule, "--recompute", recompute, "-o", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Trains and returns the per-step losses from the metrics file.
fn train(dir: &Path, steps: &str) -> Vec<f64> {
    let data = root().join("examples/digits/digits.npz");
    let metrics = dir.join("metrics.jsonl");
    let out = pw(&[
        "train", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3",
        "--steps", steps, "--microbatch", "16", "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003",
        "--metrics", metrics.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(&metrics)
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line")["loss"].as_f64().expect("loss"))
        .collect()
}

#[test]
fn digits_train_to_a_low_loss_under_every_schedule() {
    for (schedule, recompute) in [("2bw", "none"), ("2bw", "full"), ("flush", "none"), ("gpipe", "full")] {
        let dir = tempfile::tempdir().expect("temp dir");
        compile(dir.path(), "2", schedule, recompute);
        let losses = train(dir.path(), "150");
        assert_eq!(losses.len(), 150);
        let (first, last) = (losses[0], losses[140..].iter().sum::<f64>() / 10.0);
        assert!(first > 2.0, "{schedule}: first loss {first}");
        assert!(last < 0.5, "{schedule}/{recompute}: loss {first} -> {last}");
    }
}

#[test]
fn training_is_deterministic() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "3", "2bw", "none");
    let a = train(dir.path(), "40");
    let b = train(dir.path(), "40");
    assert_eq!(a, b, "same seed, data and schedule must give identical losses");
}

#[test]
fn bad_training_input_is_one_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    for (extra, needle) in [
        (vec!["--label", "nope", "--output", "linear_3"], "nope"),
        (vec!["--label", "label", "--output", "no_output"], "no_output"),
        (vec!["--label", "label", "--output", "linear_3", "--microbatches", "1"], "m"),
        (vec!["--label", "label", "--output", "linear_3", "--loss", "mse"], "targets have shape"),
    ] {
        let mut args = vec!["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "3"];
        args.extend(extra.iter().copied());
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("error:") && last.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Trained weights go back into the ONNX model: a pipeline compiled from the exported
/// model starts where the first training ended.
#[test]
fn export_writes_the_trained_weights_into_the_model() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let losses = train(dir.path(), "150");
    let trained = dir.path().join("trained.onnx");
    let out = pw(&["export", dir.path().to_str().unwrap(), "-o", trained.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again = tempfile::tempdir().expect("temp dir");
    let out = pw(&["compile", trained.to_str().unwrap(), "--stages", "2", "-o", again.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let resumed = train(again.path(), "3");
    assert!(losses[0] > 2.0 && resumed[0] < 0.5, "fresh start {} vs exported start {}", losses[0], resumed[0]);
}

fn train_args<'a>(dir: &'a Path, data: &'a Path, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3",
        "--steps", steps, "--microbatch", "8", "--microbatches", "3", "--optimizer", "adam", "--lr", "0.003", "--no-progress",
    ];
    args.extend_from_slice(extra);
    args
}

/// Interrupting a run at a checkpoint and resuming it gives bit-identical weights under
/// every schedule (2BW included: both weight versions and Adam's moments are restored).
#[test]
fn resuming_from_a_checkpoint_reaches_the_same_weights() {
    let data = root().join("examples/digits/digits.npz");
    for schedule in ["2bw", "flush", "gpipe"] {
        let dir = tempfile::tempdir().expect("temp dir");
        compile(dir.path(), "3", schedule, if schedule == "gpipe" { "full" } else { "none" });
        let out = pw(&train_args(dir.path(), &data, "7", &["--checkpoint-every", "3"]));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let weights = dir.path().join("weights.safetensors");
        let uninterrupted = std::fs::read(&weights).expect("weights written");
        let ckpts = dir.path().join("checkpoints");
        for step in ["000003", "000006"] {
            let step_dir = ckpts.join(format!("step-{step}"));
            assert!(step_dir.join("checkpoint.json").is_file(), "{schedule}: checkpoint {step} written");
            let leftovers: Vec<_> = std::fs::read_dir(&ckpts).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().contains(".tmp")).collect();
            assert!(leftovers.is_empty(), "{schedule}: temporary folders left behind");
            std::fs::remove_file(&weights).unwrap();
            let out = pw(&train_args(dir.path(), &data, "7", &["--resume", step_dir.to_str().unwrap()]));
            assert!(out.status.success(), "{schedule} resume {step}: {}", String::from_utf8_lossy(&out.stderr));
            let resumed = std::fs::read(&weights).expect("weights written");
            assert!(resumed == uninterrupted, "{schedule}: resuming from step {step} changed the weights");
        }
        // A different schedule's modules refuse the checkpoint.
        let other = tempfile::tempdir().expect("temp dir");
        compile(other.path(), "3", if schedule == "2bw" { "flush" } else { "2bw" }, "none");
        let out = pw(&train_args(other.path(), &data, "7", &["--resume", ckpts.to_str().unwrap()]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("checkpoint") && !err.contains("panicked"), "{schedule}: {err}");
    }
}

/// Two replicas train to a low loss; a stage module from another compile is refused by name.
#[test]
fn replicas_train_and_mismatched_modules_are_refused() {
    let data = root().join("examples/digits/digits.npz");
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let metrics = dir.path().join("m.jsonl");
    let out = pw(&train_args(dir.path(), &data, "120", &["--replicas", "2", "--metrics", metrics.to_str().unwrap()]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 120);
    assert_eq!(lines[0]["samples"].as_u64(), Some(2 * 3 * 8), "a step is replicas x microbatches x microbatch samples");
    let last = lines[110..].iter().map(|l| l["loss"].as_f64().unwrap()).sum::<f64>() / 10.0;
    assert!(last < 0.6, "two replicas: loss {last}");

    let other = tempfile::tempdir().expect("temp dir");
    compile(other.path(), "2", "2bw", "full");
    std::fs::copy(other.path().join("stage1.pwm"), dir.path().join("stage1.pwm")).unwrap();
    let out = pw(&train_args(dir.path(), &data, "3", &[]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mixed modules must be refused");
    assert!(err.contains("stage1.pwm") && err.contains("another compile"), "{err}");
}

/// The shared MLP with its loss inside the model: a SoftmaxCrossEntropyLoss of its logits
/// against a `label` input, the model's only output.
fn mlp_with_loss_node(dir: &Path) -> PathBuf {
    let bytes = std::fs::read(root().join("../shared/corpus/models/mlp.onnx")).expect("read mlp.onnx");
    let model = ModelProto::parse_from_bytes(&bytes).expect("parse mlp.onnx");
    let mut m = ModelBuilder { model }.node(node("SoftmaxCrossEntropyLoss", "sce", &["linear_3", "label"], &["loss"]));
    let g = m.model.graph.as_mut().expect("graph");
    g.input.push(value_info("label", I64, &[8.into()]));
    g.output.clear();
    m.output("loss").write(dir, "mlp_sce.onnx")
}

/// `--loss output:NAME` trains on a loss the model computes: the MLP whose graph ends in a
/// SoftmaxCrossEntropyLoss node (labels fed as a model input from the data file) trains
/// to the same losses as the plain MLP under the built-in cross-entropy, at d = 2.
#[test]
fn a_loss_the_model_computes_trains_like_the_built_in_loss() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = mlp_with_loss_node(dir.path());
    let build = dir.path().join("sce");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let data = root().join("examples/digits/digits.npz");
    let metrics = dir.path().join("sce.jsonl");
    let out = pw(&[
        "train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--loss", "output:loss", "--steps", "30",
        "--microbatch", "16", "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003", "--metrics", metrics.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let inside: Vec<f64> = std::fs::read_to_string(&metrics)
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line")["loss"].as_f64().expect("loss"))
        .collect();
    let plain = dir.path().join("plain");
    compile(&plain, "2", "2bw", "none");
    let built_in = train(&plain, "30");
    assert_eq!(inside.len(), 30);
    for (step, (a, b)) in inside.iter().zip(&built_in).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "step {step}: model's loss {a}, built-in {b}");
    }
    let late = inside[25..].iter().sum::<f64>() / 5.0;
    assert!(late < 0.7 * inside[0], "the model's own loss must fall: {inside:?}");

    // Naming two different outputs is refused.
    let out = pw(&["train", build.to_str().unwrap(), "--loss", "output:loss", "--output", "other", "--steps", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--loss names output \"loss\" but --output names \"other\""), "{err}");
}

/// Per-step losses of `pipewright train` with `args` (the build folder first), read from
/// its metrics file.
fn train_losses(dir: &Path, args: &[&str]) -> Vec<f64> {
    let metrics = dir.join("metrics.jsonl");
    let mut all = vec!["train", dir.to_str().unwrap(), "--no-progress", "--metrics", metrics.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = pw(&all);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(&metrics)
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line")["loss"].as_f64().expect("loss"))
        .collect()
}

/// `--precision bf16` (and fp16) track fp32 on the digits MLP at d = 2 under 2BW: the
/// first 5 losses within 0.02 and the mean of the last 10 of 150 steps within 0.1 (the
/// runs part slowly as bf16's rounding accumulates), and both still reach a low loss.
#[test]
fn mixed_precision_tracks_fp32_on_digits() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let run = |precision: &str| {
        let args = ["--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "150", "--microbatch", "16", "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003", "--precision", precision];
        train_losses(dir.path(), &args)
    };
    let full = run("fp32");
    let tail = |l: &[f64]| l[140..].iter().sum::<f64>() / 10.0;
    for precision in ["bf16", "fp16"] {
        let low = run(precision);
        assert_eq!(low.len(), 150);
        for (a, b) in low[..5].iter().zip(&full[..5]) {
            assert!((a - b).abs() < 0.02, "{precision}: first losses {:?} vs fp32 {:?}", &low[..5], &full[..5]);
        }
        assert!(low != full, "{precision}: identical to fp32");
        assert!((tail(&low) - tail(&full)).abs() < 0.1 && tail(&low) < 0.5, "{precision}: final loss {} vs fp32 {}", tail(&low), tail(&full));
    }
}

/// The same on gpt2-tiny (synthetic tokens, d = 2, 2BW): 6 Adam steps, every loss within
/// 0.01 of fp32's (seen: within 3e-4).
#[test]
fn mixed_precision_tracks_fp32_on_gpt2_tiny() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = root().join("../shared/corpus/models/gpt2-tiny.onnx");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", "2bw", "-o", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = |precision: &str| train_losses(dir.path(), &["--steps", "6", "--microbatch", "4", "--microbatches", "2", "--optimizer", "adam", "--lr", "0.001", "--precision", precision]);
    let full = run("fp32");
    for precision in ["bf16", "fp16"] {
        let low = run(precision);
        assert_eq!(low.len(), 6);
        assert!(low.iter().zip(&full).all(|(a, b)| (a - b).abs() < 0.01), "{precision}: {low:?} vs fp32 {full:?}");
    }
    let out = pw(&["train", dir.path().to_str().unwrap(), "--steps", "1", "--precision", "fp8"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("fp8"));
}

/// `--devices cpu,cpu` places the two stages on two "devices" (both the CPU): the losses
/// are those of the one-device run; a device libtorch cannot reach is named.
#[test]
fn devices_place_stages_and_bad_devices_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let run = |extra: &[&str]| {
        let mut args = vec!["--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "20", "--microbatch", "16", "--microbatches", "4", "--replicas", "2"];
        args.extend_from_slice(extra);
        train_losses(dir.path(), &args)
    };
    assert_eq!(run(&[]), run(&["--devices", "cpu,cpu"]));
    assert_eq!(run(&[]), run(&["--devices", "cpu,cpu,cpu,cpu"]));
    let out = pw(&["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "2", "--devices", "cpu,cuda:7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    // No CUDA here (on a GPU machine: fewer than 8 GPUs).
    assert!(!out.status.success() && err.contains("--devices") && err.contains("cuda:7"), "{err}");
}
