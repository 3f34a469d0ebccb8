//! docs/tutorial.md runs as written: every `pipewright` line of its `sh` blocks, in
//! order, through `sh` (so `> plan.json` redirects), in a temporary folder holding a copy
//! of `examples/` (the tutorial's paths are relative to the repository root), with this
//! build's `pipewright` first on the PATH.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::root;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// The lines of the ```sh blocks of a Markdown text.
fn sh_lines(md: &str) -> Vec<String> {
    let (mut inside, mut out) = (false, Vec::new());
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside && line.trim() == "```sh";
            continue;
        }
        if inside && !line.trim().is_empty() {
            out.push(line.trim().to_string());
        }
    }
    out
}

#[test]
fn the_tutorial_runs_as_written() {
    let md = std::fs::read_to_string(root().join("docs/tutorial.md")).expect("docs/tutorial.md");
    let lines = sh_lines(&md);
    // The export step is Python's (the shipped files are its output); the rest is ours.
    assert!(lines.iter().any(|l| l == "python3 examples/tutorial/make_model.py"), "{lines:?}");
    assert!(root().join("examples/tutorial/make_model.py").is_file());
    let commands: Vec<&String> = lines.iter().filter(|l| l.starts_with("pipewright ")).collect();
    assert!(commands.len() >= 7, "{commands:?}");

    let dir = tempfile::tempdir().expect("temp dir");
    copy_dir(&root().join("examples/tutorial"), &dir.path().join("examples/tutorial"));
    copy_dir(&root().join("examples/digits"), &dir.path().join("examples/digits"));
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_pipewright"));
    let path = format!("{}:{}", bin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let mut transcript = String::new();
    for cmd in commands {
        let out = Command::new("sh").arg("-c").arg(cmd).current_dir(dir.path()).env("PATH", &path).output().expect("runs sh");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        transcript.push_str(&format!("$ {cmd}\n{stdout}{stderr}"));
        assert!(out.status.success(), "the tutorial's command failed:\n{transcript}");
    }
    // What the tutorial says happens, happens.
    assert!(transcript.contains("match: all 1 compared output(s)"), "{transcript}");
    assert!(transcript.contains("columns: w = replicas"), "{transcript}");
    assert!(transcript.contains("microbatch 16 (from the build: plan plan.json)"), "{transcript}");
    let trained = transcript.lines().find(|l| l.starts_with("trained 100 steps")).expect("a training summary");
    let last: f64 = trained.split("-> ").nth(1).and_then(|s| s.split(';').next()).and_then(|s| s.parse().ok()).expect("final loss");
    assert!(last < 1.0, "{trained}");
    for file in ["plan.json", "build/stage1.pwm", "build/weights.safetensors", "trained.onnx", "predictions.npz"] {
        assert!(dir.path().join(file).is_file(), "{file} missing:\n{transcript}");
    }
}
