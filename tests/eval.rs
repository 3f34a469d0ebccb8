//! Evaluation during training (`train --eval-data --eval-every --eval-batches`): the loss
//! it reports is onnxruntime's on the exported model, it changes nothing of training under
//! any schedule, a language model reports perplexity, and bad evaluation data is refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{fails, model, ok, pw, pw_ok, python, root};

fn py(script: &str, args: &[&str]) -> String {
    let out = Command::new(python()).arg("-c").arg(script).args(args).output().expect("python runs");
    assert!(out.status.success(), "python failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The digits' last 48 samples as a held-out `.npz` (3 microbatches of 16).
fn held_out(dir: &Path) -> PathBuf {
    let path = dir.join("held_out.npz");
    let digits = root().join("examples/digits/digits.npz");
    py("import sys, numpy as np\nd = np.load(sys.argv[1])\nnp.savez(sys.argv[2], input=d['input'][-48:], label=d['label'][-48:])", &[digits.to_str().unwrap(), path.to_str().unwrap()]);
    path
}

fn compile_mlp(dir: &Path, schedule: &str) -> PathBuf {
    let build = dir.join(format!("mlp-{schedule}"));
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "--schedule", schedule, "-o", build.to_str().unwrap()]);
    build
}

fn train<'a>(build: &'a Path, extra: &[&'a str]) -> std::process::Output {
    let digits = root().join("examples/digits/digits.npz");
    let mut args: Vec<String> = ["train", build.to_str().unwrap(), "--data", digits.to_str().unwrap(), "--label", "label", "--output", "linear_3"].map(String::from).to_vec();
    args.extend(["--steps", "12", "--microbatch", "16", "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003", "--no-progress"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    pw(&args)
}

/// `eval after step 12: loss 0.1234, accuracy 0.9 (48 samples)` -> 0.1234.
fn eval_loss(stdout: &str, step: usize) -> f64 {
    let prefix = format!("eval after step {step}: loss ");
    stdout.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|rest| rest.split(',').next()).and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no evaluation after step {step} in:\n{stdout}"))
}

/// Under every schedule: the final evaluation's loss is onnxruntime's cross-entropy of the
/// exported trained model on the held-out set, and the weights are bit for bit those of
/// the same run without evaluation.
#[test]
fn the_evaluated_loss_is_onnxruntimes_on_the_exported_model_and_training_is_unchanged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let eval = held_out(dir.path());
    for schedule in ["2bw", "flush", "gpipe", "zb-h1"] {
        let build = compile_mlp(dir.path(), schedule);
        ok(&train(&build, &[]));
        let plain = std::fs::read(build.join("weights.safetensors")).expect("weights");
        let metrics = build.join("m.jsonl");
        let out = ok(&train(&build, &["--eval-data", eval.to_str().unwrap(), "--eval-every", "5", "--metrics", metrics.to_str().unwrap()]));
        assert!(std::fs::read(build.join("weights.safetensors")).expect("weights") == plain, "{schedule}: evaluation changed training");
        // The summary (stdout) repeats the last evaluation; each one's line goes to stderr.
        let ours = eval_loss(&out, 12);
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let evaluated: Vec<u64> = lines.iter().filter(|l| l.get("eval_loss").is_some()).map(|l| l["step"].as_u64().unwrap()).collect();
        assert_eq!(evaluated, [5, 10, 12], "{schedule}: evaluated steps in the metrics");
        let exported = build.join("trained.onnx");
        pw_ok(["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
        let script = r#"
import sys, numpy as np, onnxruntime as ort
model, data = sys.argv[1:3]
d = np.load(data)
s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
losses, right = [], 0
for k in range(3):
    x, y = d["input"][16 * k:16 * k + 16], d["label"][16 * k:16 * k + 16]
    logits = s.run(None, {s.get_inputs()[0].name: x})[0].astype(np.float64)
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    losses.append(-logp[np.arange(16), y].mean())
    right += int((logits.argmax(1) == y).sum())
print(np.mean(losses), right / 48)
"#;
        let reference = py(script, &[exported.to_str().unwrap(), eval.to_str().unwrap()]);
        let mut parts = reference.split_whitespace().map(|v| v.parse::<f64>().expect("a number"));
        let (want, accuracy) = (parts.next().unwrap(), parts.next().unwrap());
        assert!((ours - want).abs() <= 1e-4 * want.abs().max(1.0), "{schedule}: evaluated loss {ours}, onnxruntime {want}");
        assert!(out.contains(&format!("accuracy {accuracy:.4}")), "{schedule}: onnxruntime's accuracy {accuracy}:\n{out}");
    }
}

/// A language model on a token stream reports perplexity, the exponential of its loss.
#[test]
fn a_token_stream_evaluation_reports_perplexity() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = dir.path().join("gpt2");
    pw_ok(["compile", model("gpt2-tiny").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let (train_tokens, eval_tokens) = (dir.path().join("train.bin"), dir.path().join("val.bin"));
    for (path, seed) in [(&train_tokens, 1u32), (&eval_tokens, 2)] {
        let mut x = seed;
        let ids: Vec<u8> = (0..40 * 33)
            .flat_map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (((x >> 16) % 1000) as u16).to_le_bytes()
            })
            .collect();
        std::fs::write(path, ids).unwrap();
    }
    let out = ok(&pw([
        "train", build.to_str().unwrap(), "--data", train_tokens.to_str().unwrap(), "--tokens", "u16", "--steps", "4", "--microbatch", "2", "--microbatches", "2",
        "--eval-data", eval_tokens.to_str().unwrap(), "--eval-batches", "3", "--no-progress",
    ]));
    let line = out.lines().find(|l| l.starts_with("eval after step 4: ")).unwrap_or_else(|| panic!("{out}"));
    let loss = eval_loss(&out, 4);
    let ppl: f64 = line.split("perplexity ").nth(1).and_then(|r| r.split(',').next()).and_then(|v| v.parse().ok()).expect("perplexity");
    assert!((ppl - loss.exp()).abs() < 0.01 * ppl, "{line}");
    assert!(line.ends_with("(6 samples)"), "{line}");
}

#[test]
fn bad_evaluation_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = compile_mlp(dir.path(), "2bw");
    let eval = held_out(dir.path());
    fails(&train(&build, &["--eval-every", "5"]), &["--eval-every and --eval-batches need --eval-data"]);
    fails(&train(&build, &["--eval-data", eval.to_str().unwrap(), "--eval-batches", "4"]), &["--eval-batches 4: ", "held_out.npz holds 3 batch(es) of 16; give --eval-batches 3 or fewer"]);
    let wrong = dir.path().join("wrong.npz");
    py("import sys, numpy as np\nnp.savez(sys.argv[1], input=np.zeros((32, 10), np.float32), label=np.zeros(32, np.int64))", &[wrong.to_str().unwrap()]);
    fails(&train(&build, &["--eval-data", wrong.to_str().unwrap()]), &["--eval-data: ", "wrong.npz", "input"]);
    assert!(!build.join("weights.safetensors").exists(), "a refused run wrote weights");
}
