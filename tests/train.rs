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

/// A safetensors data file of `n` copies of one digit image (`input`) with the labels
/// `labels` under the array name `label_name`.
fn same_image_data(dir: &Path, file: &str, labels: &[i64], label_name: &str) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let n = labels.len();
    let image: Vec<f32> = (0..64).map(|i| (i % 7) as f32).collect();
    let x: Vec<u8> = image.iter().cycle().take(64 * n).flat_map(|v| v.to_le_bytes()).collect();
    let y: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        ("input".to_string(), TensorView::new(Dtype::F32, vec![n, 64], &x).expect("input view")),
        (label_name.to_string(), TensorView::new(Dtype::I64, vec![n], &y).expect("label view")),
    ];
    let bytes = safetensors::serialize(views, &None).expect("serialize");
    let path = dir.join(file);
    std::fs::write(&path, bytes).expect("write data");
    path
}

/// The first step's loss (the initial weights') of the one-stage MLP on `data`, with no
/// `--label` and no `--output` (the array `label` and the only output are the defaults).
fn first_loss(build: &Path, data: &Path, extra: &[&str]) -> Result<f64, String> {
    let metrics = build.join("first.jsonl");
    let mut args = vec![
        "train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "1", "--microbatch", "16",
        "--microbatches", "4", "--no-progress", "--metrics", metrics.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = pw(&args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "{err}");
    if !out.status.success() {
        return Err(err);
    }
    let line = std::fs::read_to_string(&metrics).expect("metrics written");
    Ok(serde_json::from_str::<serde_json::Value>(line.lines().next().expect("a line")).expect("JSON")["loss"].as_f64().expect("loss"))
}

/// Cross-entropy skips labels equal to `--ignore-index` (default -100) in the loss and in
/// its mean: 64 copies of one image, a quarter labelled -100 and the rest 3, give the loss
/// of all of them labelled 3 (every microbatch averages over its kept labels only); a
/// batch of nothing but ignored labels trains at loss 0 instead of diverging to NaN.
/// `--label-smoothing S` mixes the label's loss with the mean over all classes, linearly
/// in S. Out-of-range labels name the label, the class count and the flag.
#[test]
fn cross_entropy_ignores_labels_and_smooths() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "1", "2bw", "none");
    let build = dir.path();
    let threes = same_image_data(build, "threes.safetensors", &[3; 64], "label");
    let masked: Vec<i64> = (0..64).map(|i| if i % 4 == 0 { -100 } else { 3 }).collect();
    let masked = same_image_data(build, "masked.safetensors", &masked, "label");
    let all = first_loss(build, &threes, &[]).expect("labels 3");
    let kept = first_loss(build, &masked, &[]).expect("labels 3 and -100");
    assert!(all > 0.0 && (all - kept).abs() < 1e-5, "ignored labels changed the loss: {all} vs {kept}");
    let none = same_image_data(build, "none.safetensors", &[-100; 64], "label");
    assert_eq!(first_loss(build, &none, &[]).expect("all ignored"), 0.0);
    // Another ignored value: -100 becomes a label out of range.
    let e = first_loss(build, &masked, &["--ignore-index", "-1"]).unwrap_err();
    let last = e.lines().last().unwrap_or_default();
    assert!(last.contains("label -100") && last.contains("10 classes") && last.contains("--ignore-index"), "{e}");
    let big = same_image_data(build, "big.safetensors", &[12; 64], "label");
    let e = first_loss(build, &big, &[]).unwrap_err();
    assert!(e.contains("label 12") && e.contains("10 classes") && !e.contains("Internal torch error"), "{e}");

    let half = first_loss(build, &threes, &["--label-smoothing", "0.5"]).expect("smoothing 0.5");
    let full = first_loss(build, &threes, &["--label-smoothing", "1"]).expect("smoothing 1");
    assert!((full - all).abs() > 1e-3, "smoothing had no effect: {all} vs {full}");
    assert!((half - (all + full) / 2.0).abs() < 1e-5, "smoothing 0.5: {half}, expected the mean of {all} and {full}");
    let e = first_loss(build, &threes, &["--label-smoothing", "1.5"]).unwrap_err();
    assert!(e.contains("--label-smoothing") && e.contains("1.5"), "{e}");
}

/// Without `--label`, a loss that needs labels takes the array named `label`; when there
/// is none, the error asks for --label and lists the arrays.
#[test]
fn the_label_array_defaults_to_label() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "1", "2bw", "none");
    let named_y = same_image_data(dir.path(), "y.safetensors", &[3; 64], "y");
    let e = first_loss(dir.path(), &named_y, &[]).unwrap_err();
    let last = e.lines().last().unwrap_or_default();
    assert!(last.contains("--label") && last.contains("input, y"), "{e}");
    let with_y = first_loss(dir.path(), &named_y, &["--label", "y"]).expect("--label y");
    let named_label = same_image_data(dir.path(), "label.safetensors", &[3; 64], "label");
    assert_eq!(first_loss(dir.path(), &named_label, &[]).expect("default label"), with_y);
    // A wrong --output is refused before training starts, with the outputs there are.
    let e = first_loss(dir.path(), &named_label, &["--output", "nope"]).unwrap_err();
    assert!(e.contains("--output \"nope\"") && e.contains("\"linear_3\"") && !e.contains("training 1 stage"), "{e}");
}

/// A resumed run must repeat the settings the checkpoint was written under: another
/// optimizer, microbatch or microbatch count is refused, naming the flag and both values,
/// unless `--force`; `train` says when it replaces an earlier run's weights file.
#[test]
fn resume_refuses_changed_settings_unless_forced() {
    let data = root().join("examples/digits/digits.npz");
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let out = pw(&train_args(dir.path(), &data, "4", &["--checkpoint-every", "2"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("replac"), "a first run replaces nothing: {err}");
    let ckpts = dir.path().join("checkpoints");
    let json = std::fs::read_to_string(ckpts.join("step-000002/checkpoint.json")).expect("checkpoint manifest");
    assert!(json.contains("\"--optimizer\": \"adam\""), "{json}");
    for (extra, needle) in [
        (vec!["--optimizer", "sgd"], "--optimizer adam (checkpoint) -> sgd (this run)"),
        (vec!["--microbatch", "4"], "--microbatch 8 (checkpoint) -> 4 (this run)"),
        (vec!["--microbatches", "2"], "--microbatches 3 (checkpoint) -> 2 (this run)"),
    ] {
        // Change the value train_args gives for that flag.
        let mut args: Vec<&str> = train_args(dir.path(), &data, "4", &["--resume", ckpts.to_str().unwrap()]);
        if let Some(i) = args.iter().position(|a| *a == extra[0]) {
            args[i + 1] = extra[1];
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should be refused: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.contains(needle) && last.contains("--force"), "{extra:?}: {err}");
        args.push("--force");
        let out = pw(&args);
        assert!(out.status.success(), "{extra:?} --force: {}", String::from_utf8_lossy(&out.stderr));
    }
    // The same settings resume, and say that the weights file is replaced.
    let out = pw(&train_args(dir.path(), &data, "4", &["--resume", ckpts.to_str().unwrap()]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("weights.safetensors exists") && err.contains("(replacing the earlier run's weights)"), "{err}");
}

/// docs/runtime.md's language-model example as written: gpt2-tiny (logits [N, 32, 1000])
/// trains on per-token labels, most of them -100, with label smoothing; the same file
/// with the ignored value changed fails on label -100 instead.
#[test]
fn per_token_labels_train_a_language_model() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = tempfile::tempdir().expect("temp dir");
    let n = 16;
    let ids: Vec<i64> = (0..n * 32).map(|i| (i * 7 % 1000) as i64).collect();
    // Every fourth token is a target; the rest are -100.
    let labels: Vec<i64> = (0..n * 32).map(|i| if i % 4 == 0 { (i * 13 % 1000) as i64 } else { -100 }).collect();
    let (x, y): (Vec<u8>, Vec<u8>) = (ids.iter().flat_map(|v| v.to_le_bytes()).collect(), labels.iter().flat_map(|v| v.to_le_bytes()).collect());
    let views = vec![
        ("input_ids".to_string(), TensorView::new(Dtype::I64, vec![n, 32], &x).unwrap()),
        ("label".to_string(), TensorView::new(Dtype::I64, vec![n, 32], &y).unwrap()),
    ];
    std::fs::write(dir.path().join("mlm.safetensors"), safetensors::serialize(views, &None).unwrap()).unwrap();
    let md = std::fs::read_to_string(root().join("docs/runtime.md")).unwrap();
    let compile_line = "pipewright compile ../shared/corpus/models/gpt2-tiny.onnx --stages 2 -o gpt2-build";
    let train_line = "pipewright train gpt2-build --data mlm.safetensors --steps 2 --microbatch 4 --label-smoothing 0.1";
    assert!(md.contains(compile_line) && md.contains(train_line), "docs/runtime.md no longer shows the example");
    let model = root().join("../shared/corpus/models/gpt2-tiny.onnx");
    let build = dir.path().join("gpt2-build");
    let data = dir.path().join("mlm.safetensors");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let args = ["train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "2", "--microbatch", "4", "--label-smoothing", "0.1", "--no-progress"];
    let out = pw(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("trained 2 steps") && !stdout.contains("NaN"), "{stdout}");
    let mut bad = args.to_vec();
    bad.extend(["--ignore-index", "-1"]);
    let out = pw(&bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("label -100") && err.contains("1000 classes"), "{err}");
}
