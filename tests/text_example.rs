//! examples/text/run.sh, the language model trained on the `fortunes` text, runs end to
//! end at a few steps: tokenised text, a generated GPT-2-shaped model, training with
//! validation perplexity, and the curves drawn.

use std::process::Command;

mod common;

use common::root;

#[test]
fn the_text_example_trains_evaluates_and_draws() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new("bash")
        .arg(root().join("examples/text/run.sh"))
        .arg(dir.path())
        .env("STEPS", "6")
        .env("WARMUP", "2")
        .env("EVAL_EVERY", "3")
        .env("EVAL_BATCHES", "2")
        .env("PW", env!("CARGO_BIN_EXE_pipewright"))
        .output()
        .expect("bash runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "examples/text/run.sh failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("train.bin: ") && stdout.contains("val.bin: "), "{stdout}");
    for step in [3, 6] {
        assert!(stderr.contains(&format!("eval after step {step}: loss ")) || stdout.contains(&format!("eval after step {step}: loss ")), "no evaluation after step {step}:\n{stderr}");
    }
    assert!(stdout.contains("perplexity"), "{stdout}");
    let svg = std::fs::read_to_string(dir.path().join("curves.svg")).expect("curves drawn");
    assert!(svg.contains(r#"data-series="eval""#), "the validation curve is drawn");
}
