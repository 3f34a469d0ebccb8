//! `pipewright train` end to end: compile the shared MLP into stages and train it on the
//! 8x8 digits in `examples/digits` under each schedule on the embedded executor.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{corpus, fails, model, node, ok, pw, pw_ok, root, value_info, ModelBuilder, I64};
use onnx_protobuf::{Message, ModelProto};

fn compile(dir: &Path, stages: &str, schedule: &str, recompute: &str) {
    let mlp = model("mlp");
    pw_ok(["compile", mlp.to_str().unwrap(), "--stages", stages, "--schedule", schedule, "--recompute", recompute, "-o", dir.to_str().unwrap()]);
}

/// Trains and returns the per-step losses from the metrics file.
fn train(dir: &Path, steps: &str) -> Vec<f64> {
    let data = root().join("examples/digits/digits.npz");
    train_losses(dir, &[
        "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", steps, "--microbatch", "16",
        "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003",
    ])
}

#[test]
fn digits_train_to_a_low_loss_under_every_schedule() {
    // Interleaved 1F1B and ZB-V: 4 stages on 2 workers.
    for (schedule, stages, recompute) in [("2bw", "2", "none"), ("2bw", "2", "full"), ("flush", "2", "none"), ("gpipe", "2", "full"), ("interleaved-2", "4", "none"), ("zb-v", "4", "none")] {
        let dir = tempfile::tempdir().expect("temp dir");
        compile(dir.path(), stages, schedule, recompute);
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
        (vec!["--label", "nope", "--output", "linear_3"], "digits.npz: no label array `nope` (arrays: input, label)"),
        (vec!["--label", "label", "--output", "no_output"], "--output \"no_output\": the model has no output of that name (outputs: \"linear_3\")"),
        (vec!["--label", "label", "--output", "linear_3", "--microbatches", "1"], "2BW needs at least as many microbatches per batch as stages (m = 1 < d = 2)"),
        (vec!["--label", "label", "--output", "linear_3", "--loss", "mse"], "stage 1: loss: mse: targets have shape [16], output \"linear_3\" has [16, 10]"),
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

/// Every file under `dir`, with its contents (to show a failed run changed nothing).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("readable folder").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).expect("readable file")));
            }
        }
    }
    out.sort();
    out
}

/// A 2-stage MLP build trained 2 steps on the digits with a checkpoint per step, and the
/// data file: the starting point of the tests that check a refused run changes nothing.
fn trained_two_steps() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let out = pw(&train_args(dir.path(), &data, "2", &["--checkpoint-every", "1"]));
    ok(&out);
    (dir, data)
}

/// Numeric options are checked before training starts: a NaN, negative or out-of-range
/// value, `--steps 0` and a microbatch no machine can hold are each one error naming the
/// option, and no file of the build changes (the trained weights and checkpoints stay).
#[test]
fn numeric_options_are_checked_before_anything_is_written() {
    let (dir, data) = trained_two_steps();
    let before = snapshot(dir.path());
    for (extra, needle) in [
        (vec!["--momentum", "nan"], "--momentum NaN"),
        (vec!["--momentum", "1.5"], "--momentum 1.5"),
        (vec!["--lr", "nan"], "--lr NaN"),
        (vec!["--lr", "-1"], "--lr -1"),
        (vec!["--lr", "inf"], "--lr inf"),
        (vec!["--weight-decay", "-0.1"], "--weight-decay -0.1"),
        (vec!["--clip-norm", "-1"], "--clip-norm -1"),
        (vec!["--clip-norm", "nan"], "--clip-norm NaN"),
        (vec!["--warmup", "9"], "--warmup 9"),
        (vec!["--steps", "0"], "--steps 0"),
        (vec!["--replicas", "0"], "--replicas 0: must be at least 1"),
        (vec!["--microbatches", "0"], "--microbatches 0: must be at least 1"),
        (vec!["--microbatch", "0"], "--microbatch 0: must be at least 1"),
        (vec!["--microbatch", "100000000"], "--microbatch 100000000"),
        (vec!["--microbatch", "18446744073709551615"], "--microbatch 18446744073709551615"),
    ] {
        let mut args = train_args(dir.path(), &data, "2", &[]);
        // The later of two occurrences wins in clap only for some options; replace instead.
        for pair in extra.chunks(2) {
            match args.iter().position(|a| *a == pair[0]) {
                Some(i) => args[i + 1] = pair[1],
                None => args.extend_from_slice(pair),
            }
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("error:") && last.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(snapshot(dir.path()) == before, "{extra:?} changed a file of the build");
    }
    // Resuming at the last step trains nothing: refused, the weights stay.
    let last = dir.path().join("checkpoints/step-000002");
    let out = pw(&train_args(dir.path(), &data, "2", &["--resume", last.to_str().unwrap()]));
    fails(&out, &["--steps 2", "already at step 2"]);
    assert!(snapshot(dir.path()) == before, "resuming at the end changed a file");
}

/// An update that makes the weights non-finite (a rate so high the step overflows) stops
/// the run naming the step and stage with a hint; neither the weights file nor any
/// checkpoint is written.
#[test]
fn a_diverging_run_stops_and_keeps_the_files() {
    let (dir, data) = trained_two_steps();
    let before = snapshot(dir.path());
    let mut args = train_args(dir.path(), &data, "3", &["--checkpoint-every", "1"]);
    let i = args.iter().position(|a| *a == "--lr").unwrap();
    args[i + 1] = "1e300";
    let out = pw(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(!out.status.success(), "a diverging run exited 0: {err}");
    assert!(last.starts_with("error:") && last.contains("step 1, stage ") && last.contains("not") && last.contains("--lr"), "{err}");
    assert!(snapshot(dir.path()) == before, "a diverging run changed a file of the build");
}

/// A .npy file's bytes: `descr`, C or Fortran order, `shape`, and zeros (or `data`).
fn npy(descr: &str, fortran: bool, shape: &[usize], data: Option<Vec<u8>>) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': {}, 'shape': {tuple}, }}", if fortran { "True" } else { "False" });
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let width: usize = descr[2..].parse().unwrap();
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend(data.unwrap_or_else(|| vec![0; shape.iter().product::<usize>() * width]));
    b
}

/// Every .npy error says its cause through the CLI (half floats, big-endian, Fortran
/// order, a header claiming more data than the file holds), and fractional float labels
/// are refused for cross-entropy instead of being truncated to classes.
#[test]
fn data_errors_name_their_cause() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let labels: Vec<u8> = (0..32).flat_map(|i| (i as f32 % 10.0).to_le_bytes()).collect();
    let fractional: Vec<u8> = (0..32).flat_map(|i| (i as f32 * 0.25).to_le_bytes()).collect();
    for (what, input, label, needle) in [
        ("f16", npy("<f2", false, &[32, 64], None), None, "dtype `<f2` is not supported"),
        ("big-endian", npy(">f4", false, &[32, 64], None), None, "big-endian"),
        ("fortran", npy("<f4", true, &[32, 64], None), None, "Fortran (column-major) order"),
        ("short", npy("<f4", false, &[32, 64], Some(vec![0; 100])), None, "needs 8192 bytes of data, but the file holds 100"),
        ("fractional", npy("<f4", false, &[32, 64], None), Some(npy("<f4", false, &[32], Some(fractional.clone()))), "label array `label` holds 0.25 (element 1), not a class id"),
        ("whole", npy("<f4", false, &[32, 64], None), Some(npy("<f4", false, &[32], Some(labels.clone()))), ""),
    ] {
        let data = dir.path().join(format!("data-{what}"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("input.npy"), &input).unwrap();
        if let Some(l) = &label {
            std::fs::write(data.join("label.npy"), l).unwrap();
        }
        let mut args = vec!["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--output", "linear_3", "--steps", "1", "--microbatch", "4", "--no-progress"];
        if label.is_some() {
            args.extend(["--label", "label"]);
        } else {
            args[3] = data.to_str().unwrap();
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        if needle.is_empty() {
            // Whole-number float labels are class ids: they train.
            assert!(out.status.success(), "{what}: {err}");
            continue;
        }
        let last = err.lines().last().unwrap_or_default();
        assert!(!out.status.success() && last.starts_with("error:") && last.contains(needle), "{what}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `--max-data-size` caps the bytes decompressed from an .npz: the digits (475 KB
/// inflated) are refused under a 100KiB cap naming the member and the cap, and train
/// under the default.
#[test]
fn the_npz_decompression_cap_is_an_option() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "flush", "none");
    let data = root().join("examples/digits/digits.npz");
    let out = pw(&train_args(dir.path(), &data, "1", &["--max-data-size", "100KiB"]));
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(!out.status.success() && last.contains("digits.npz: member `input.npy`") && last.contains("more than 102400 bytes"), "{err}");
    assert!(!dir.path().join("weights.safetensors").exists());
    let out = pw(&train_args(dir.path(), &data, "1", &[]));
    ok(&out);
}

/// Copies the flat folder `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A damaged or tampered checkpoint is refused on resume naming the file: a flipped bit,
/// an edited step (with or without the folder renamed), a stage file from another step,
/// and a run with other settings; the weights file is left as it was.
#[test]
fn damaged_checkpoints_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let out = pw(&train_args(dir.path(), &data, "4", &["--checkpoint-every", "1"]));
    ok(&out);
    let ckpts = dir.path().join("checkpoints");
    let weights = dir.path().join("weights.safetensors");
    let trained = std::fs::read(&weights).unwrap();
    let bad = tempfile::tempdir().expect("temp dir");
    let case = |name: &str, edit: &dyn Fn(&Path)| -> PathBuf {
        let step = bad.path().join(name).join("step-000002");
        copy_dir(&ckpts.join("step-000002"), &step);
        edit(&step);
        step
    };
    let flipped = case("flip", &|d| {
        let p = d.join("stage1.safetensors");
        let mut b = std::fs::read(&p).unwrap();
        let i = b.len() - 5;
        b[i] ^= 0x10;
        std::fs::write(&p, b).unwrap();
    });
    let edit_step = |d: &Path| {
        let p = d.join("checkpoint.json");
        let text = std::fs::read_to_string(&p).unwrap().replace("\"step\": 2", "\"step\": 3");
        std::fs::write(&p, text).unwrap();
    };
    let edited = case("edit", &edit_step);
    let renamed = {
        let d = case("rename", &edit_step);
        let to = d.with_file_name("step-000003");
        std::fs::rename(&d, &to).unwrap();
        to
    };
    let mixed = case("mix", &|d| {
        std::fs::copy(ckpts.join("step-000003/stage0.safetensors"), d.join("stage0.safetensors")).unwrap();
    });
    for (what, step, needle) in [
        ("flipped bit", &flipped, "stage1.safetensors: checksum"),
        ("edited step", &edited, "checkpoint.json: says step 3, but the folder is step 2"),
        ("edited step, renamed folder", &renamed, "stage0.safetensors: holds step 2, the manifest says step 3"),
        ("mixed steps", &mixed, "stage0.safetensors: checksum"),
    ] {
        let out = pw(&train_args(dir.path(), &data, "4", &["--resume", step.to_str().unwrap()]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: resumed: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("error:") && last.contains(needle), "{what}: {err}");
        assert!(std::fs::read(&weights).unwrap() == trained, "{what}: the weights file changed");
    }
    // Other settings than the checkpoint's run: refused naming them.
    let second = ckpts.join("step-000002");
    let mut args = train_args(dir.path(), &data, "4", &["--resume", second.to_str().unwrap()]);
    let i = args.iter().position(|a| *a == "--lr").unwrap();
    args[i + 1] = "0.01";
    let out = pw(&args);
    fails(&out, &["--lr 0.003 (checkpoint) -> 0.01 (this run)"]);
    assert!(std::fs::read(&weights).unwrap() == trained, "other settings: the weights file changed");
}

/// Temporary checkpoint folders of a writer that died (a kill -9 mid-checkpoint) are
/// removed by the next run writing checkpoints there; a live process's are kept.
#[test]
fn stale_temporary_checkpoint_folders_are_removed() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "flush", "none");
    let data = root().join("examples/digits/digits.npz");
    let ckpts = dir.path().join("checkpoints");
    // No process has a pid above the kernel's limit (at most 2^22).
    let dead = [ckpts.join(".step-000005.tmp-999999999"), ckpts.join("step-000004.old-999999998")];
    let live = ckpts.join(format!(".step-000005.tmp-{}", std::process::id()));
    for d in dead.iter().chain([&live]) {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("stage0.safetensors"), b"partial").unwrap();
    }
    let out = pw(&train_args(dir.path(), &data, "2", &["--checkpoint-every", "1"]));
    ok(&out);
    for d in &dead {
        assert!(!d.exists(), "{} was left behind", d.display());
    }
    assert!(live.is_dir(), "a live process's temporary folder was removed");
    assert!(ckpts.join("step-000002/checkpoint.json").is_file());
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
    ok(&out);
    let again = tempfile::tempdir().expect("temp dir");
    let out = pw(&["compile", trained.to_str().unwrap(), "--stages", "2", "-o", again.path().to_str().unwrap()]);
    ok(&out);
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
    for schedule in ["2bw", "flush", "gpipe", "zb-h1", "zb-h2", "interleaved-2", "zb-v"] {
        let dir = tempfile::tempdir().expect("temp dir");
        // Interleaved and ZB-V: 2 stages taking turns on one worker (the 3 microbatches per
        // batch divide among no more workers for interleaved; ZB-V needs an even depth).
        let stages = if schedule.starts_with("interleaved") || schedule == "zb-v" { "2" } else { "3" };
        compile(dir.path(), stages, schedule, if schedule == "gpipe" { "full" } else { "none" });
        let out = pw(&train_args(dir.path(), &data, "7", &["--checkpoint-every", "3"]));
        ok(&out);
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
        fails(&out, &["pipeline configuration: the checkpoint was written for pipeline \"", "these modules are pipeline \""]);
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
    ok(&out);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 120);
    assert_eq!(lines[0]["samples"].as_u64(), Some(2 * 3 * 8), "a step is replicas x microbatches x microbatch samples");
    let last = lines[110..].iter().map(|l| l["loss"].as_f64().unwrap()).sum::<f64>() / 10.0;
    assert!(last < 0.6, "two replicas: loss {last}");

    let other = tempfile::tempdir().expect("temp dir");
    compile(other.path(), "2", "2bw", "full");
    std::fs::copy(other.path().join("stage1.pwm"), dir.path().join("stage1.pwm")).unwrap();
    let out = pw(&train_args(dir.path(), &data, "3", &[]));
    fails(&out, &["stage1.pwm", "another compile"]);
}

/// The shared MLP with its loss inside the model: a SoftmaxCrossEntropyLoss of its logits
/// against a `label` input, the model's only output.
fn mlp_with_loss_node(dir: &Path) -> PathBuf {
    let bytes = std::fs::read(model("mlp")).expect("read mlp.onnx");
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
    ok(&out);
    let data = root().join("examples/digits/digits.npz");
    let inside = train_losses(&build, &[
        "--data", data.to_str().unwrap(), "--loss", "output:loss", "--steps", "30", "--microbatch", "16", "--microbatches", "4",
        "--optimizer", "adam", "--lr", "0.003",
    ]);
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
    fails(&out, &["--loss names output \"loss\" but --output names \"other\""]);
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
    // Resumed from step 2 of 4 (the newest checkpoint is at the last step already).
    let second = ckpts.join("step-000002");
    // Other data of the same shape: the digits with one pixel changed.
    let other_data = dir.path().join("other/digits.npz");
    std::fs::create_dir_all(other_data.parent().unwrap()).unwrap();
    let script = "import sys, numpy as np; d = dict(np.load(sys.argv[1])); k = [k for k in d if k != 'label'][0]; d[k] = d[k].copy(); d[k].flat[0] += 1; np.savez(sys.argv[2], **d)";
    let made = Command::new(onnxruntime_python()).args(["-c", script, data.to_str().unwrap(), other_data.to_str().unwrap()]).output().expect("runs python");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    // The same data moved elsewhere is the same data.
    let moved = dir.path().join("moved.npz");
    std::fs::copy(&data, &moved).unwrap();
    let out = pw(&train_args(dir.path(), &moved, "4", &["--resume", second.to_str().unwrap()]));
    assert!(out.status.success(), "the same data at another path: {}", String::from_utf8_lossy(&out.stderr));
    for (extra, needle) in [
        (vec!["--optimizer", "sgd"], "--optimizer adam (checkpoint) -> sgd (this run)"),
        (vec!["--microbatch", "4"], "--microbatch 8 (checkpoint) -> 4 (this run)"),
        (vec!["--microbatches", "2"], "--microbatches 3 (checkpoint) -> 2 (this run)"),
        (vec!["--label-smoothing", "0.1"], "--label-smoothing 0.0 (checkpoint) -> 0.1 (this run)"),
        (vec!["--ignore-index", "0"], "--ignore-index -100 (checkpoint) -> 0 (this run)"),
        (vec!["--data", other_data.to_str().unwrap()], "--data 68586 bytes, crc32 "),
    ] {
        // Change the value train_args gives for that flag, or add it.
        let mut args: Vec<&str> = train_args(dir.path(), &data, "4", &["--resume", second.to_str().unwrap()]);
        match args.iter().position(|a| *a == extra[0]) {
            Some(i) => args[i + 1] = extra[1],
            None => args.extend_from_slice(&extra),
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should be refused: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.contains(needle) && last.contains("--force"), "{extra:?}: {err}");
        // Forced through, the difference is said and recorded in the metrics.
        let metrics = dir.path().join("forced.jsonl");
        args.extend(["--force", "--metrics", metrics.to_str().unwrap()]);
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?} --force: {err}");
        assert!(err.contains("note: resuming with settings that differ from the checkpoint's (--force): ") && err.contains(needle), "{extra:?}: {err}");
        let first = std::fs::read_to_string(&metrics).unwrap().lines().next().unwrap_or_default().to_string();
        assert!(first.contains("\"forced\":[") && first.contains(needle), "{extra:?}: {first}");
    }
    // The same settings resume, and say that the weights file is replaced.
    let out = pw(&train_args(dir.path(), &data, "4", &["--resume", second.to_str().unwrap()]));
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
    let model = model("gpt2-tiny");
    let build = dir.path().join("gpt2-build");
    let data = dir.path().join("mlm.safetensors");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    ok(&out);
    let args = ["train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "2", "--microbatch", "4", "--label-smoothing", "0.1", "--no-progress"];
    let out = pw(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    ok(&out);
    assert!(stdout.starts_with("trained 2 steps") && !stdout.contains("NaN"), "{stdout}");
    let mut bad = args.to_vec();
    bad.extend(["--ignore-index", "-1"]);
    let out = pw(&bad);
    fails(&out, &["label -100", "1000 classes"]);
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
    let model = model("gpt2-tiny");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", "2bw", "-o", dir.path().to_str().unwrap()]);
    ok(&out);
    let run = |precision: &str| train_losses(dir.path(), &["--steps", "6", "--microbatch", "4", "--microbatches", "2", "--optimizer", "adam", "--lr", "0.001", "--precision", precision]);
    let full = run("fp32");
    for precision in ["bf16", "fp16"] {
        let low = run(precision);
        assert_eq!(low.len(), 6);
        assert!(low.iter().zip(&full).all(|(a, b)| (a - b).abs() < 0.01), "{precision}: {low:?} vs fp32 {full:?}");
    }
    let out = pw(&["train", dir.path().to_str().unwrap(), "--steps", "1", "--precision", "fp8"]);
    fails(&out, &["invalid value 'fp8' for '--precision <PRECISION>' [possible values: fp32, bf16, fp16]"]);
}

/// Under 2BW a stage whose gradient sum goes on in the background (here gpt2-tiny's token
/// embedding, tied to the output projection of the last stage) defers its update. Where
/// the update needs an answer every stage agrees on (`--clip-norm`, `--on-nonfinite
/// skip`), every stage makes it after its last forward of the next step: a stage waiting
/// in the agreement before forwarding what another needs to reach it would wait out the
/// timeout. At d = 3 both train, to d = 1's losses (the tied sums add in another order:
/// within fp32 rounding).
#[test]
fn tied_stages_under_2bw_agree_on_clipping_and_skips() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = model("gpt2-tiny");
    for d in ["1", "3"] {
        let out = pw(&["compile", model.to_str().unwrap(), "--stages", d, "--schedule", "2bw", "-o", dir.path().join(d).to_str().unwrap()]);
        ok(&out);
    }
    for agreed in [["--clip-norm", "0.5"], ["--on-nonfinite", "skip"]] {
        let run = |d: &str| {
            let mut args = vec!["--steps", "4", "--microbatch", "2", "--microbatches", "3", "--optimizer", "adam", "--lr", "0.001", "--timeout", "60"];
            args.extend(agreed);
            train_losses(&dir.path().join(d), &args)
        };
        let (one, three) = (run("1"), run("3"));
        assert_eq!(three.len(), 4, "{agreed:?}");
        assert!(one.iter().zip(&three).all(|(a, b)| (a - b).abs() <= 1e-4 * a.abs()), "{agreed:?}: d = 3 {three:?} vs d = 1 {one:?}");
    }
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
    // The banner states where each worker runs.
    let out = pw(&["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "1", "--microbatch", "16", "--microbatches", "4", "--replicas", "2", "--no-progress", "--devices", "cpu,cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("placement: stage 0 cpu, stage 1 cpu"), "{err}");
    let out = pw(&["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "2", "--devices", "cpu,cuda:7"]);
    // No CUDA here (on a GPU machine: fewer than 8 GPUs); either way the device is named.
    fails(&out, &["--devices: CUDA device cuda:7 requested but "]);
}

/// What a terminal shows for `raw` (the bytes a program wrote to it): per line, a carriage
/// return moves back to the start and `ESC [ 2K` clears; other escapes are dropped.
fn terminal_lines(raw: &str) -> Vec<String> {
    let mut shown = Vec::new();
    for line in raw.split('\n') {
        let (mut cells, mut at): (Vec<char>, usize) = (Vec::new(), 0);
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\r' => at = 0,
                '\x1b' => {
                    let mut seq = String::new();
                    if chars.peek() == Some(&'[') {
                        chars.next();
                        while let Some(&n) = chars.peek() {
                            chars.next();
                            seq.push(n);
                            if n.is_ascii_alphabetic() {
                                break;
                            }
                        }
                    }
                    if seq == "2K" {
                        cells.clear();
                    }
                }
                c => {
                    if at < cells.len() {
                        cells[at] = c;
                    } else {
                        cells.resize(at, ' ');
                        cells.push(c);
                    }
                    at += 1;
                }
            }
        }
        shown.push(cells.into_iter().collect::<String>().trim_end().to_string());
    }
    shown
}

/// `train` on a pseudo-terminal (util-linux `script`): the progress bar is drawn, and the
/// banner, the bar, the lines after it and the summary each keep a line of their own, as
/// does the error of a run that stops mid-way (the bar used to leave its cursor at the end
/// of its line: `eta 0swrote build/weights.safetensors`).
#[test]
fn terminal_output_never_shares_a_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let poisoned = data_with_inf(dir.path(), 96, &[40]);
    let on_terminal = |lr: &str| {
        // A skipped step (one sample is infinite) prints a warning while the bar is drawn.
        let data = if lr == "skip" { &poisoned } else { &data };
        let mut args = vec!["train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "30", "--microbatch", "8"];
        let extra = if lr == "skip" { ["--on-nonfinite", "skip"] } else { ["--lr", lr] };
        args.extend_from_slice(&extra);
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let command = format!("'{}' {}", env!("CARGO_BIN_EXE_pipewright"), quoted.join(" "));
        let out = Command::new("script").args(["-qec", &command, "/dev/null"]).output().expect("util-linux `script` runs (it gives the test a terminal)");
        let raw = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success(), terminal_lines(&raw), raw)
    };
    // A word that marks each kind of line (the bar's is its `eta`); no line shows two.
    let kinds = ["training ", "note: ", "eta ", "wrote ", "trained ", "peak live", "error:", "skipped ("];
    let check = |lines: &[String]| {
        for l in lines {
            let found: Vec<&str> = kinds.iter().copied().filter(|k| l.contains(k)).collect();
            assert!(found.len() <= 1, "a line shared by {found:?}: {l:?}\n{lines:#?}");
        }
    };
    let (ok, lines, raw) = on_terminal("0.05");
    assert!(ok, "{lines:#?}");
    // The bar itself was drawn (a terminal), not the plain progress lines of a pipe.
    assert!(raw.contains("\x1b[2K") && raw.contains("eta "), "no bar was drawn: {raw:?}");
    check(&lines);
    for start in ["training ", "step    30/30", "wrote ", "trained 30 steps", "peak live"] {
        assert!(lines.iter().any(|l| l.starts_with(start)), "no line starts with {start:?}: {lines:#?}");
    }
    // Warnings printed while the bar is drawn keep their own lines.
    let (ok, lines, _) = on_terminal("skip");
    assert!(ok, "{lines:#?}");
    check(&lines);
    assert!(lines.iter().filter(|l| l.starts_with("step ") && l.contains(": skipped (")).count() >= 1, "{lines:#?}");
    // A run that stops with an error (divergence) prints it on its own line too.
    let (ok, lines, _) = on_terminal("1e300");
    assert!(!ok, "{lines:#?}");
    check(&lines);
    assert!(lines.iter().any(|l| l.starts_with("error:")), "{lines:#?}");
}

/// Little-endian f32 values (safetensors data, an ONNX initializer's raw data).
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The tensors of a weights file by name, as f32 values.
fn read_weights(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).expect("weights written");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors().into_iter().map(|(n, v)| (n, f32s(v.data()))).collect()
}

/// gpt2-tiny's exporter merged every LayerNorm's weight (ones) and bias (zeros) into one
/// initializer each: compile and train say so in one line, naming `--untie-merged`.
/// Without it the build trains one tied weight per tensor; with it every LayerNorm gets
/// its own copy, and after training the copies differ; `export` writes each copy into the
/// model, read by its own node.
#[test]
fn merged_initializers_are_announced_and_can_be_untied() {
    let model = model("gpt2-tiny");
    let dir = tempfile::tempdir().expect("temp dir");
    for untie in [false, true] {
        let build = dir.path().join(if untie { "untied" } else { "tied" });
        let mut args = vec!["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()];
        if untie {
            args.push("--untie-merged");
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let line = if untie {
            "note: untied 2 exporter-merged initializers into 18 separately trained weights (--untie-merged)"
        } else {
            "note: 2 initializers the exporter merged (identical values) train as tied weights: 18 uses of 2 tensors"
        };
        assert_eq!(err.lines().filter(|l| l.contains("merged")).count(), 1, "{err}");
        assert!(err.contains(line), "{err}");
        let out = pw(&["train", build.to_str().unwrap(), "--steps", "4", "--microbatch", "2", "--optimizer", "adam", "--lr", "0.01", "--no-progress"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains(line), "train does not repeat the compile's choice: {err}");
        let weights = read_weights(&build.join("weights.safetensors"));
        let names: Vec<&String> = weights.keys().filter(|n| n.starts_with("transformer.h.0.ln_1.weight")).collect();
        assert_eq!(names.len(), if untie { 9 } else { 1 }, "{names:?}");
        if untie {
            let first = &weights["transformer.h.0.ln_1.weight"];
            let other = &weights["transformer.h.0.ln_1.weight.untied3"];
            let diff = first.iter().zip(other).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(diff > 1e-4, "the untied copies trained alike (max difference {diff})");
            // Export writes every copy, each read by its own LayerNormalization.
            let exported = dir.path().join("untied.onnx");
            let out = pw(&["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
            ok(&out);
            let m = ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
            let scales: std::collections::BTreeSet<&str> = m.graph.node.iter().filter(|n| n.op_type == "LayerNormalization").map(|n| n.input[1].as_str()).collect();
            assert_eq!(scales.len(), 9, "{scales:?}");
            let copy = m.graph.initializer.iter().find(|t| t.name == "transformer.h.0.ln_1.weight.untied3").expect("the copy is an initializer");
            let values = f32s(&copy.raw_data);
            assert_eq!(&values, other);
        }
    }
}

/// The default exporter folds the transpose of BERT's tied embedding (also its output
/// projection) into a second initializer, `val_182`, recorded as folded from the
/// embedding: compile says it is computed from the embedding again, the build trains no
/// weight of that name, and the exported model holds it as the trained embedding
/// transposed, bit for bit. A relative-position table gathered with repeats (Swin's) is
/// said to train as computed, naming `optimize=False`.
#[test]
fn a_tied_weight_stored_transposed_trains_as_one() {
    let model = root().join("zoo/models/bert-dynamo-dyn/model.onnx");
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("b");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("note: 1 initializer holding a permuted copy of another weight (a tied weight the exporter stored transposed) is computed from that weight and trains with it: val_182 = model.cls.predictions.decoder.weight permuted [1, 0]"), "{err}");
    pw_ok(["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--lr", "0.5", "--no-progress"]);
    let weights = read_weights(&build.join("weights.safetensors"));
    assert!(!weights.contains_key("val_182") && weights.contains_key("model.cls.predictions.decoder.weight"), "{:?}", weights.keys().collect::<Vec<_>>());
    let exported = dir.path().join("stepped.onnx");
    pw_ok(["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    let m = ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
    let init = |name: &str| {
        let t = m.graph.initializer.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name}")).clone();
        pipewright_ir::import::tensor::tensor_from_proto(t, dir.path()).expect("reads")
    };
    let (embedding, projection) = (init("model.cls.predictions.decoder.weight"), init("val_182"));
    let source = pipewright_ir::import::tensor::tensor_from_proto(
        ModelProto::parse_from_bytes(&std::fs::read(&model).unwrap()).unwrap().graph.initializer.iter().find(|t| t.name == "model.cls.predictions.decoder.weight").unwrap().clone(),
        model.parent().unwrap(),
    )
    .expect("reads");
    assert_ne!(embedding.bytes, source.bytes, "the embedding trained");
    assert_eq!(embedding.permuted(&[1, 0]).expect("a matrix"), projection, "the projection is the trained embedding transposed");

    let swin = root().join("zoo/models/swin-dynamo-dyn/model.onnx");
    let out = pw(&["compile", swin.to_str().unwrap(), "--stages", "1", "-o", dir.path().join("swin").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("note: 2 initializers the exporter computed from parameters by more than a transpose, a slice or a gather at distinct positions train as computed") && err.contains("relative_position_bias_table") && err.contains("optimize=False"), "{err}");
}

/// `compile --freeze NAME` keeps a weight out of training (as PyTorch does a parameter
/// with `requires_grad=False`): compile and train say so, the build saves no such weight
/// and `export` writes the source's values back; a name the model lacks is refused,
/// naming it.
#[test]
fn frozen_on_request_stays_as_exported() {
    let model = root().join("zoo/models/gpt2-script-dyn/model.onnx");
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("b");
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "2", "--freeze", "model.transformer.wpe.weight", "-o", build.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = "note: 1 initializer kept frozen on request (--freeze): model.transformer.wpe.weight [32, 16]";
    assert!(err.contains(line), "{err}");
    let out = pw(&["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--lr", "0.5", "--no-progress"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains(line), "{err}");
    let weights = read_weights(&build.join("weights.safetensors"));
    assert!(!weights.contains_key("model.transformer.wpe.weight") && weights.contains_key("model.transformer.wte.weight"), "{:?}", weights.keys().collect::<Vec<_>>());
    let exported = dir.path().join("stepped.onnx");
    pw_ok(["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    let init = |path: &Path, name: &str| ModelProto::parse_from_bytes(&std::fs::read(path).unwrap()).unwrap().graph.initializer.iter().find(|t| t.name == name).cloned().unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(init(&exported, "model.transformer.wpe.weight"), init(&model, "model.transformer.wpe.weight"));
    assert_ne!(init(&exported, "model.transformer.wte.weight").raw_data, init(&model, "model.transformer.wte.weight").raw_data);
    let out = pw(&["compile", model.to_str().unwrap(), "--stages", "1", "--freeze", "wpe", "-o", dir.path().join("x").to_str().unwrap()]);
    fails(&out, &["tensor \"wpe\": --freeze: the model has no float initializer of this name"]);
}

/// The zoo's fixed-batch dynamo GPT-2 writes `sqrt(scale)` as a `[1]` initializer
/// (`val_88`) read by the Q and K^T products of both layers, which its exporter marks as
/// folded from no parameter: a constant, said by `inspect`. Without that mark (a copy with
/// the `value_info` metadata dropped, as an exporter that records none writes it) it is a
/// trainable one-element initializer: by default its value becomes the fused attentions'
/// scale, compile and train say so naming `--train-attention-scales`, and the stage
/// program runs `Attention`; with the flag it trains as a weight (saved after training)
/// and the attention stays spelled out.
#[test]
fn a_one_element_attention_scale_is_folded_and_said_or_kept_trained() {
    let source = root().join("zoo/models/gpt2-dynamo-b2");
    let said = pw_ok(["inspect", source.join("model.onnx").to_str().unwrap()]);
    assert!(said.contains("initializer \"val_88\": the exporter folded it from no parameter"), "{said}");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut unmarked = ModelProto::parse_from_bytes(&std::fs::read(source.join("model.onnx")).unwrap()).unwrap();
    for info in unmarked.graph.mut_or_insert_default().value_info.iter_mut() {
        info.metadata_props.clear();
    }
    let model = dir.path().join("model.onnx");
    std::fs::write(&model, unmarked.write_to_bytes().unwrap()).unwrap();
    std::fs::copy(source.join("model.onnx.data"), dir.path().join("model.onnx.data")).unwrap();
    for train_scales in [false, true] {
        let build = dir.path().join(if train_scales { "trained" } else { "folded" });
        let mut args = vec!["compile", model.to_str().unwrap(), "--stages", "1", "-o", build.to_str().unwrap()];
        if train_scales {
            args.push("--train-attention-scales");
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let line = "note: 1 one-element initializer read only as attention scales became the fused attentions' scale (not trained): val_88 [1]; compile --train-attention-scales trains it and keeps those attentions spelled out";
        assert_eq!(err.contains(line), !train_scales, "{err}");
        let program = pw_ok(["inspect", build.join("stage0.pwm").to_str().unwrap()]);
        assert_eq!((program.matches("Attention").count() > 0, program.matches("Softmax").count() > 0), (!train_scales, train_scales), "{program}");
        let out = pw(&["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--optimizer", "adam", "--lr", "0.01", "--no-progress"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert_eq!(err.contains(line), !train_scales, "train does not repeat the compile's choice: {err}");
        let weights = read_weights(&build.join("weights.safetensors"));
        assert_eq!(weights.contains_key("val_88"), train_scales, "{:?}", weights.keys().collect::<Vec<_>>());
    }
}

/// ViT's class token, which the exporter expanded to the export batch (`expand`, `[2, 1,
/// 128]`), is frozen by default, and compile and train say so, naming
/// `--train-batch-baked`; with it, the token trains as one slice `[1, 1, 128]` shared by
/// the batch, and `export` writes it back into a model that runs at another batch. A
/// name that is no batch-baked initializer is refused, naming it.
#[test]
fn batch_baked_initializers_are_announced_and_can_train() {
    let vit = model("vit-tiny");
    let dir = tempfile::tempdir().expect("temp dir");
    let source = ModelProto::parse_from_bytes(&std::fs::read(&vit).unwrap()).unwrap();
    let token = source.graph.initializer.iter().find(|t| t.name == "expand").expect("the class token");
    let initial: Vec<f32> = f32s(&token.raw_data).into_iter().take(128).collect();
    for train_it in [false, true] {
        let build = dir.path().join(if train_it { "trained" } else { "frozen" });
        let mut args = vec!["compile", vit.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()];
        if train_it {
            args.extend_from_slice(&["--train-batch-baked", "expand"]);
        }
        let out = pw(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let line = if train_it {
            "note: 1 initializer baked for the export batch trains as one slice shared by the batch (--train-batch-baked, or a parameter the exporter expanded or looked up at fixed positions): expand [1, 1, 128]"
        } else {
            "note: 1 initializer baked for the export batch kept frozen (not trained): expand [2, 1, 128]; compile --train-batch-baked NAME trains one"
        };
        assert!(err.contains(line), "{err}");
        let out = pw(&["train", build.to_str().unwrap(), "--steps", "3", "--microbatch", "4", "--optimizer", "adam", "--lr", "0.01", "--no-progress"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && err.contains(line), "{err}");
        let weights = read_weights(&build.join("weights.safetensors"));
        if !train_it {
            assert!(!weights.contains_key("expand"));
            continue;
        }
        let trained = &weights["expand"];
        assert_eq!(trained.len(), 128);
        assert!(trained.iter().zip(&initial).any(|(a, b)| (a - b).abs() > 1e-4), "the class token did not train");
        let exported = dir.path().join("vit.onnx");
        let out = pw(&["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("batch axis dynamic"), "{}", String::from_utf8_lossy(&out.stdout));
        let m = ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
        let t = m.graph.initializer.iter().find(|t| t.name == "expand").unwrap();
        let values = f32s(&t.raw_data);
        assert_eq!(&values, trained);
        let inputs = dir.path().join("inputs");
        std::fs::create_dir_all(&inputs).unwrap();
        std::fs::copy(corpus().join("models/vit-tiny.inputs/input_0.pb"), inputs.join("input_0.pb")).unwrap();
        let out = pw(&["run-forward", exported.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "--tile-batch", "3"]);
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("[6, 10]"), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    let out = pw(&["compile", vit.to_str().unwrap(), "--stages", "2", "-o", dir.path().join("bad").to_str().unwrap(), "--train-batch-baked", "vit.layers.0.mlp.fc1.bias"]);
    fails(&out, &["tensor \"vit.layers.0.mlp.fc1.bias\": --train-batch-baked: its shape [256] does not start with the export batch (2)"]);
    assert!(!dir.path().join("bad/pipeline.toml").exists());
}

/// The Python that runs onnxruntime for the tests: `PIPEWRIGHT_PYTHON` (scripts/test.sh sets
/// it from scripts/pyref.sh), else `python3` if it has onnxruntime. Missing, the test fails
/// saying how to get one: an outside reference is never skipped.
fn onnxruntime_python() -> String {
    let candidates = [std::env::var("PIPEWRIGHT_PYTHON").ok(), Some("python3".into())];
    candidates
        .into_iter()
        .flatten()
        .find(|p| Command::new(p).args(["-c", "import onnxruntime, numpy, onnx"]).output().is_ok_and(|o| o.status.success()))
        .unwrap_or_else(|| panic!("no Python with onnxruntime, onnx and numpy: run `bash scripts/pyref.sh` and set PIPEWRIGHT_PYTHON to the python it prints (scripts/test.sh does both)"))
}

/// gpt2-tiny was exported at batch 2 (every input and output, and its Reshape targets and
/// masks, at 2); pipewright trains it at any batch, and `export` writes a model that takes
/// any batch: axis 0 of its input and output is `dim_param "N"`, and at batch 16 both
/// pipewright (`run-forward --tile-batch 8`) and onnxruntime run it, with
/// the same outputs.
#[test]
fn export_takes_any_batch_like_training_did() {
    let model = model("gpt2-tiny");
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    pw_ok(&["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let out = pw(&["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "4", "--no-progress"]);
    ok(&out);
    let exported = dir.path().join("trained.onnx");
    let out = pw(&["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("batch axis dynamic (dim_param \"N\")"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let m = ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
    let dim0 = |vi: &onnx_protobuf::ValueInfoProto| match vi.type_.as_ref().and_then(|t| t.value.as_ref()) {
        Some(onnx_protobuf::type_proto::Value::TensorType(t)) => t.shape.as_ref().and_then(|s| s.dim.first()).and_then(|d| d.value.clone()),
        _ => None,
    };
    let n = Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimParam("N".into()));
    assert_eq!(dim0(&m.graph.input[0]), n);
    assert_eq!(dim0(&m.graph.output[0]), n);

    // Batch 16 through pipewright, saved.
    let inputs = dir.path().join("inputs");
    std::fs::create_dir(&inputs).unwrap();
    std::fs::copy(corpus().join("models/gpt2-tiny.inputs/input_0.pb"), inputs.join("input_0.pb")).unwrap();
    let saved = dir.path().join("pw.npz");
    let out = pw(&["run-forward", exported.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "--tile-batch", "8", "--save", saved.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("[16, 32, 1000]"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));

    // And through onnxruntime.
    let python = onnxruntime_python();
    let script = r#"
import sys, numpy as np, onnx, onnxruntime as ort
from onnx import numpy_helper
model, tensor, saved = sys.argv[1:4]
x = numpy_helper.to_array(onnx.load_tensor(tensor))
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
y = session.run(None, {session.get_inputs()[0].name: np.concatenate([x] * 8, 0)})[0]
ours = np.load(saved)["linear"]
print("shape", y.shape, "max_abs_diff", float(np.abs(y - ours).max()))
"#;
    let out = Command::new(&python).args(["-c", script, exported.to_str().unwrap(), inputs.join("input_0.pb").to_str().unwrap(), saved.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "onnxruntime refused the exported model at batch 16: {text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("shape (16, 32, 1000)"), "{text}");
    let diff: f64 = text.split("max_abs_diff ").nth(1).and_then(|d| d.trim().parse().ok()).expect("a difference");
    assert!(diff < 1e-4, "onnxruntime and run-forward differ by {diff}");
}

/// Where the rewrite cannot make the batch dynamic (a ViT exported at batch 1 concatenates
/// its class token parameter, `[1, 1, 32]`, with the batch), `export` writes the source's
/// fixed batch and says why, naming the node, rather than a model that fails at another
/// batch.
#[test]
fn export_keeps_the_export_batch_where_it_must_and_says_why() {
    let model = root().join("tests/exports/vit-b1.onnx");
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    pw_ok(&["compile", model.to_str().unwrap(), "--stages", "1", "-o", build.to_str().unwrap()]);
    let out = pw(&["train", build.to_str().unwrap(), "--steps", "1", "--microbatch", "2", "--no-progress"]);
    ok(&out);
    let exported = dir.path().join("trained.onnx");
    let out = pw(&["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    ok(&out);
    assert!(stdout.contains("kept the export batch 1: with a dynamic batch, node \"node_cat\" (Concat)"), "{stdout}");
    let m = ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
    let mut source = ModelProto::parse_from_bytes(&std::fs::read(&model).unwrap()).unwrap();
    assert_eq!(m.graph.input, source.graph.input, "the inputs are the source's");
    // The source's nodes, with the patch projection's and the classifier's zero biases the
    // exporter dropped read again (restored at import, trained, written back).
    let restored = pipewright_ir::import::biases::restore_dropped_biases(source.graph.as_mut().unwrap());
    assert_eq!(restored, ["model.classifier.bias [5]", "model.vit.embeddings.patch_embeddings.projection.bias [32]"]);
    assert_eq!(m.graph.node, source.graph.node);
}

/// `n` samples of the MLP's shape (`input` [n, 64], `label` [n]), pixel 5 of the samples in
/// `poisoned` set to +inf.
fn data_with_inf(dir: &Path, n: usize, poisoned: &[usize]) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let mut x: Vec<f32> = (0..n * 64).map(|i| ((i * 7 + i / 64 * 13) % 17) as f32 / 16.0).collect();
    for &s in poisoned {
        x[s * 64 + 5] = f32::INFINITY;
    }
    let y: Vec<i64> = (0..n as i64).map(|s| s % 10).collect();
    let (xb, yb): (Vec<u8>, Vec<u8>) = (x.iter().flat_map(|v| v.to_le_bytes()).collect(), y.iter().flat_map(|v| v.to_le_bytes()).collect());
    let views = vec![("input".to_string(), TensorView::new(Dtype::F32, vec![n, 64], &xb).unwrap()), ("label".to_string(), TensorView::new(Dtype::I64, vec![n], &yb).unwrap())];
    let path = dir.join("poisoned.safetensors");
    std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
    path
}

/// `--on-nonfinite skip` under 2BW at d = 2: one sample with an infinite pixel makes one
/// step per epoch non-finite; that step's update is dropped in both stages (agreed, as
/// fp16's overflow skips are), training goes on, the summary and the metrics count the
/// skipped steps, and the weights stay finite. The default (`stop`) stops at that step
/// with the divergence error; a run of skipped steps `--max-skips` long stops with it too.
/// ZB-H1 skips the same steps.
#[test]
fn nonfinite_steps_are_skipped_on_request() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2", "2bw", "none");
    // 96 samples, 16 a step: an epoch is 6 steps, 18 steps are 3 epochs.
    let data = data_with_inf(dir.path(), 96, &[40]);
    let metrics = dir.path().join("m.jsonl");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train", dir.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "18", "--microbatch", "8", "--microbatches", "2",
            "--optimizer", "adam", "--lr", "0.003", "--no-progress", "--metrics", metrics.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        pw(&args)
    };
    let out = run(&[]);
    fails(&out, &["(not finite): training diverged"]);

    let out = run(&["--on-nonfinite", "skip"]);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 18);
    let skipped: Vec<u64> = lines.iter().filter(|l| l["skipped"] == true).map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(skipped.len(), 3, "one skipped step per epoch: {skipped:?}");
    assert!(skipped.iter().zip(skipped.iter().skip(1)).all(|(a, b)| b - a >= 1) && skipped.iter().all(|s| (1..=18).contains(s)));
    for s in &skipped {
        assert!(err.contains(&format!("step {s}: skipped (a loss or gradient was not finite")), "{err}");
    }
    assert!(stdout.contains("trained 18 steps (3 skipped)"), "{stdout}");
    let losses: Vec<f64> = lines.iter().filter(|l| l["skipped"] != true).map(|l| l["loss"].as_f64().unwrap()).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[losses.len() - 3..].iter().sum::<f64>() < losses[..3].iter().sum::<f64>(), "training went on: {losses:?}");
    for (name, values) in read_weights(&dir.path().join("weights.safetensors")) {
        assert!(values.iter().all(|v| v.is_finite()), "weight {name} is not finite");
    }

    // Every sample poisoned: every step is skipped, and the third in a row stops the run.
    let all: Vec<usize> = (0..96).collect();
    let data = data_with_inf(dir.path(), 96, &all);
    let args = |max: &'static str| {
        vec![
            "train".to_string(), dir.path().display().to_string(), "--data".into(), data.display().to_string(), "--steps".into(), "18".into(),
            "--microbatch".into(), "8".into(), "--microbatches".into(), "2".into(), "--no-progress".into(), "--on-nonfinite".into(), "skip".into(),
            "--max-skips".into(), max.into(),
        ]
    };
    let out = pw(args("3"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.lines().last().unwrap_or_default().contains("step 3: 3 steps in a row had a non-finite loss or gradients and were skipped (--max-skips 3): training diverged"), "{err}");
    fails(&pw(args("0")), &["--max-skips must be at least 1"]);

    // ZB-H1 updates after its batch's last weight gradient, so the same agreement skips the
    // same steps there.
    let zb = tempfile::tempdir().expect("temp dir");
    compile(zb.path(), "2", "zb-h1", "none");
    let data = data_with_inf(zb.path(), 96, &[40]);
    let out = pw(&[
        "train", zb.path().to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "18", "--microbatch", "8", "--microbatches", "2",
        "--optimizer", "adam", "--lr", "0.003", "--no-progress", "--on-nonfinite", "skip",
    ]);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    assert!(stdout.contains("trained 18 steps (3 skipped)"), "{stdout}");
    for (name, values) in read_weights(&zb.path().join("weights.safetensors")) {
        assert!(values.iter().all(|v| v.is_finite()), "zb-h1: weight {name} is not finite");
    }
}

/// A `train` of a million steps on `build`, under way (its first progress line seen);
/// returns the process and what it printed so far.
fn long_train(b: &str) -> (std::process::Child, std::io::BufReader<std::process::ChildStderr>, String) {
    use std::io::{BufRead, BufReader};
    let mut child = common::command()
        .args(["train", b, "--steps", "1000000", "--checkpoint-every", "100000", "--no-progress", "--log-every", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts train");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut seen = String::new();
    while !seen.lines().any(|l| l.starts_with("step ")) {
        let mut line = String::new();
        assert!(err.read_line(&mut line).expect("reads stderr") > 0, "train ended before its first step:\n{seen}");
        seen.push_str(&line);
    }
    (child, err, seen)
}

/// Sends SIGINT to a [`long_train`] and waits for it: its exit status, and all it printed
/// on stderr.
fn interrupt(child: std::process::Child, mut err: std::io::BufReader<std::process::ChildStderr>, seen: String) -> (std::process::Output, String) {
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("runs kill");
    assert!(status.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).expect("reads stderr");
    let out = child.wait_with_output().expect("train ends");
    (out, seen + &rest)
}

/// Ctrl-C during `train`: the run stops at an agreed step boundary, writes that step's
/// checkpoint (as `--checkpoint-every` was given), saves the weights, prints the last
/// checkpoint and the exact command that resumes from it, and exits with 130.
#[test]
fn ctrl_c_stops_at_a_step_and_prints_the_resume_command() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let b = build.to_str().unwrap();
    let (child, err, seen) = long_train(b);
    let (out, stderr) = interrupt(child, err, seen);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let stopped = stderr.lines().find(|l| l.starts_with("stopped by a signal after step ")).unwrap_or_else(|| panic!("{stderr}"));
    let step: usize = stopped["stopped by a signal after step ".len()..].split(' ').next().and_then(|s| s.parse().ok()).expect("a step");
    let checkpoint = build.join("checkpoints").join(format!("step-{step:06}"));
    assert!(stderr.contains(&format!("the last checkpoint is {}", checkpoint.display())), "{stderr}");
    let resume = stderr.lines().find_map(|l| l.strip_prefix("resume with: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(resume.ends_with(&format!("train {b} --steps 1000000 --checkpoint-every 100000 --no-progress --log-every 1 --resume {}", checkpoint.display())), "{resume}");
    let ck = pipewright_runtime::pipeline::read_checkpoint(&checkpoint).expect("the stop's checkpoint reads back");
    assert_eq!(ck.step as usize, step);
    assert!(build.join("weights.safetensors").is_file(), "the weights were saved");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A stage entry of `pipeline.toml` edited to lead out of the build folder (a relative
/// path up, an absolute path, or a symbolic link) is refused naming the manifest, and the
/// file it pointed at is neither opened nor shown.
#[test]
fn manifest_paths_stay_inside_the_build() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let manifest = build.join("pipeline.toml");
    let original = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(dir.path().join("secret"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    for target in ["../../../../etc/passwd", "/etc/passwd", "../secret"] {
        std::fs::write(&manifest, original.replacen("module = \"stage0.pwm\"", &format!("module = {target:?}"), 1)).unwrap();
        let out = pw(["train", build.to_str().unwrap(), "--steps", "1"]);
        let err = fails(&out, &[&manifest.display().to_string(), &format!("{target:?} is not a plain file name inside the folder")]);
        assert!(!err.contains("root:x"), "{err}");
    }
    std::fs::write(&manifest, &original).unwrap();
    std::fs::rename(build.join("stage0.pwm"), dir.path().join("elsewhere.pwm")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret"), build.join("stage0.pwm")).unwrap();
    let out = pw(["train", build.to_str().unwrap(), "--steps", "1"]);
    let err = fails(&out, &["\"stage0.pwm\" is a symbolic link; the folder's files must be its own"]);
    assert!(!err.contains("root:x"), "{err}");
}

/// `train --schedule`: the schedule is compiled into the build; asking for another says so
/// and prints the compile command that builds it, and the build's own is accepted (and
/// named in the summary).
#[test]
fn train_schedule_says_it_is_compiled_in() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    let mlp = model("mlp");
    pw_ok(["compile", mlp.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let b = build.to_str().unwrap();
    let out = pw(["train", b, "--steps", "1", "--schedule", "flush"]);
    let expected = format!("--schedule flush: the schedule is compiled into the build, and {b} was compiled for 2bw; compile it for flush (then train it as before): pipewright compile {} --stages 2 --schedule flush -o {b}", mlp.canonicalize().unwrap().display());
    fails(&out, &[&expected]);
    let stdout = pw_ok(["train", b, "--steps", "1", "--schedule", "2bw", "--no-progress"]);
    assert!(stdout.starts_with("trained 1 steps under 2bw over 2 stage(s) x 1 replica(s) in "), "{stdout}");
}

/// Interleaved 1F1B: a depth its stages per worker do not divide is refused at compile
/// time, microbatches its workers do not divide at train time, each naming the fix; a
/// build that runs says how many workers its stages take turns on; `launch` starts a rank
/// per stage.
#[test]
fn interleaved_builds_name_their_workers_and_refuse_shapes_they_cannot_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    let (mlp, b) = (model("mlp"), build.to_str().unwrap());
    let out = pw(["compile", mlp.to_str().unwrap(), "--stages", "3", "--schedule", "interleaved-2", "-o", b]);
    fails(&out, &["interleaved-2 runs 2 stages per worker, so the pipeline's depth must be a multiple of 2 (it is 3): compile the model with --stages 4"]);
    assert!(!build.exists(), "a refused compile writes nothing");
    pw_ok(["compile", mlp.to_str().unwrap(), "--stages", "4", "--schedule", "interleaved-2", "-o", b]);
    let data = root().join("examples/digits/digits.npz");
    // `train_args` asks for 3 microbatches per batch.
    let out = pw(&train_args(&build, &data, "2", &[]));
    fails(&out, &["the microbatches per batch must be a multiple of 2 (m = 3)"]);
    let stdout = pw_ok(["train", b, "--steps", "1", "--no-progress"]);
    assert!(stdout.starts_with("trained 1 steps under interleaved-2 over 4 stage(s) on 2 worker(s) x 1 replica(s) in "), "{stdout}");
    // An MPI job runs a rank per stage (the ranks of a worker take turns: tests/worker.rs).
    let dry = pw_ok(["launch", b, "--dry-run"]);
    assert!(dry.contains(&format!(" -np 4 {} worker {b}", env!("CARGO_BIN_EXE_pipewright"))), "{dry}");
}

/// One job per build folder: while a `train` runs, a second `train` and an `export` of the
/// same build are refused naming the holder (its pid), and the first run's result is
/// intact: it ends (on Ctrl-C) with its own checkpoint and weights.
#[test]
fn a_second_job_on_a_build_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("build");
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let b = build.to_str().unwrap();
    let (child, err, seen) = long_train(b);
    let holder = format!("{b} is in use by another job (train: host ");
    let pid = format!("pid {}", child.id());
    let second = pw(["train", b, "--steps", "2", "--seed", "1"]);
    fails(&second, &[&holder, &pid, "wait for it to end, or give this job its own folder"]);
    let export = pw(["export", b, "-o", dir.path().join("x.onnx").to_str().unwrap()]);
    fails(&export, &[&holder, &pid]);
    let (out, stderr) = interrupt(child, err, seen);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let step: usize = stderr.lines().find_map(|l| l.strip_prefix("stopped by a signal after step ")).and_then(|s| s.split(' ').next()?.parse().ok()).expect("a stop line");
    let ck = pipewright_runtime::pipeline::read_checkpoint(&build.join("checkpoints").join(format!("step-{step:06}"))).expect("the first run's checkpoint");
    assert_eq!(ck.step as usize, step);
    assert!(build.join("weights.safetensors").is_file());
    // Released: the next job runs.
    pw_ok(["train", b, "--steps", "1", "--no-progress"]);
}

/// Specialised for its microbatch, a stage program reads nothing back from the device
/// during a step (each read would stall a GPU's stream): every shared model, at d = 2
/// under every schedule, makes zero host reads of computed values per step. Without
/// specialisation gpt2-tiny's stages made 64 and 52, bert-tiny's 34 and 16. The
/// transformers' shape values are never uploaded.
#[test]
fn specialised_steps_read_nothing_back_from_the_device() {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["mlp", "resnet18", "mobilenet_v2", "bert-tiny", "gpt2-tiny", "vit-tiny"] {
        for schedule in ["2bw", "flush", "gpipe", "zb-h1"] {
            let build = dir.path().join(format!("{name}-{schedule}"));
            let b = build.to_str().unwrap();
            pw_ok(["compile", model(name).to_str().unwrap(), "--stages", "2", "--schedule", schedule, "-o", b]);
            let out = pw_ok(["train", b, "--steps", "2", "--microbatch", "3", "--no-progress"]);
            let line = out.lines().find(|l| l.starts_with("host reads of computed values per step")).unwrap_or_else(|| panic!("{out}"));
            assert!(line.ends_with("per stage: 0, 0"), "{name} {schedule}: {line}");
            // The exported transformers' shape constants and the shapes folded from them
            // are only read on the host: none of them is uploaded.
            let kept = out.lines().find(|l| l.starts_with("known values only read on the host")).unwrap_or_else(|| panic!("{out}"));
            let counts: Vec<usize> = kept.rsplit(": ").next().unwrap_or_default().split(", ").map(|c| c.split(' ').next().unwrap_or_default().parse().expect(kept)).collect();
            assert_eq!(counts.len(), 2, "{kept}");
            if ["bert-tiny", "gpt2-tiny", "vit-tiny"].contains(&name) {
                assert!(counts.iter().all(|&n| n > 0), "{name} {schedule}: {kept}");
            }
        }
    }
}

/// `n` images for BridgeTower's vision tower (`image` [n, 3, 16, 16]) with class ids
/// `label` of per-sample shape `per_sample`.
fn tower_data(dir: &Path, n: usize, per_sample: &[usize]) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let x: Vec<u8> = (0..n * 3 * 16 * 16).flat_map(|i| (((i * 7) % 19) as f32 / 9.0 - 1.0).to_le_bytes()).collect();
    let labels: usize = n * per_sample.iter().product::<usize>();
    let y: Vec<u8> = (0..labels as i64).flat_map(|i| ((7 * i + 3) % 64).to_le_bytes()).collect();
    let mut dims = vec![n];
    dims.extend_from_slice(per_sample);
    let views = vec![("image".to_string(), TensorView::new(Dtype::F32, vec![n, 3, 16, 16], &x).unwrap()), ("label".to_string(), TensorView::new(Dtype::I64, dims, &y).unwrap())];
    let path = dir.join(format!("tower{per_sample:?}.safetensors"));
    std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
    path
}

/// BridgeTower's vision tower stacks every layer's output, `[L, N, S, D]` (3 layers, 5
/// tokens): the batch is on its second axis. Labels are read sample first (`[n, 3, 5]`) and
/// the loss moves that axis to the output's batch axis, so synthetic labels and a data
/// file's train alike; labels whose per-sample shape is not the output's without its batch
/// and class axes are refused, saying where their sample axis went.
#[test]
fn an_output_carrying_the_batch_second_takes_its_labels_sample_first() {
    let model = root().join("zoo/models/bridgetower_vision-script-dyn/model.onnx");
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("b");
    pw_ok(["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let b = build.to_str().unwrap();
    pw_ok(["train", b, "--data", "synthetic", "--steps", "2", "--microbatch", "3", "--microbatches", "2", "--no-progress"]);
    let good = tower_data(dir.path(), 6, &[3, 5]);
    pw_ok(["train", b, "--data", good.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--microbatches", "2", "--no-progress"]);
    let bad = tower_data(dir.path(), 6, &[5, 3]);
    let out = pw(&["train", b, "--data", bad.to_str().unwrap(), "--steps", "1", "--microbatch", "3", "--microbatches", "2", "--no-progress"]);
    fails(&out, &["stage 1: loss: cross-entropy: labels have shape [5, 3, 3] (their sample axis moved to axis 1, where the output carries the batch), but output \"output\" of shape [3, 3, 5, 64] needs class ids of shape [3, 3, 5]"]);
}
