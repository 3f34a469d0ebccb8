//! `pipewright train` end to end: compile the shared MLP into stages and train it on the
//! 8x8 digits in `examples/digits` under each schedule on the embedded executor.

use std::path::{Path, PathBuf};
use std::process::Command;

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
