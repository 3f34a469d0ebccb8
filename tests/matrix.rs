//! Every model trains at every depth under every schedule: each shared model and the
//! encoder-decoder fixture (`tests/data/t5-tiny.onnx`), compiled at d = 1, 2, 3 and 4 for
//! 2BW, PipeDream-Flush, GPipe, ZB-H1 and ZB-H2 (and interleaved 1F1B and ZB-V where their stages
//! per worker divide d: interleaved-2 and zb-v at 2 and 4, interleaved-4 at 4), trains 2 steps on synthetic data (microbatch 1) to a
//! finite loss, with no panic and no hang (a stage that waited longer than `--timeout`
//! would stop with an error). `tests/compile.rs` checks, per model and depth, that the
//! compiled stages run in sequence give the reference outputs.

mod common;

use std::path::Path;

use common::{model, root, try_pw};

const SCHEDULES: [&str; 8] = ["2bw", "flush", "gpipe", "zb-h1", "zb-h2", "interleaved-2", "interleaved-4", "zb-v"];

/// Stages per worker of a schedule (interleaved 1F1B's `v`).
fn stages_per_worker(schedule: &str) -> usize {
    schedule.parse::<pipewright_core::Schedule>().map_or(1, |s| s.virtual_stages())
}

/// The first graph output the compiled pipeline produces.
fn output_name(build: &Path) -> String {
    let m = pipewright_runtime::build::Manifest::read(build).unwrap();
    let name = m.outputs().next().expect("a graph output").name.clone();
    name
}

/// `(loss of step 1, loss of step 2)` from train's summary line.
fn losses(stdout: &str) -> (f64, f64) {
    let line = stdout.lines().find(|l| l.starts_with("trained 2 steps")).unwrap_or_else(|| panic!("no summary in {stdout}"));
    let part = line.split("loss ").nth(1).expect("loss").split(';').next().unwrap();
    let (a, b) = part.split_once(" -> ").expect("a -> b");
    (a.trim().parse().unwrap(), b.trim().parse().unwrap())
}

fn every_depth_and_schedule(model: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let model = model.to_str().unwrap();
    let mut failures = Vec::new();
    for d in 1..=4usize {
        for schedule in SCHEDULES.into_iter().filter(|s| d % stages_per_worker(s) == 0) {
            let what = format!("{model} d={d} {schedule}");
            let build = dir.path().join(format!("d{d}-{schedule}"));
            if let Err(e) = try_pw(&["compile", model, "--stages", &d.to_string(), "--schedule", schedule, "-o", build.to_str().unwrap()]) {
                failures.push(format!("{what}: compile: {e}"));
                continue;
            }
            let output = output_name(&build);
            let args = ["train", build.to_str().unwrap(), "--output", &output, "--steps", "2", "--microbatch", "1", "--no-progress", "--timeout", "120"];
            match try_pw(&args) {
                Ok(out) => {
                    let (a, b) = losses(&out);
                    if !(a.is_finite() && b.is_finite()) {
                        failures.push(format!("{what}: losses {a} -> {b}"));
                    }
                }
                Err(e) => failures.push(format!("{what}: train: {}", e.lines().last().unwrap_or(""))),
            }
        }
    }
    assert!(failures.is_empty(), "{} runs failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn mlp() {
    every_depth_and_schedule(&model("mlp"));
}

#[test]
fn gpt2_tiny() {
    every_depth_and_schedule(&model("gpt2-tiny"));
}

#[test]
fn bert_tiny() {
    every_depth_and_schedule(&model("bert-tiny"));
}

#[test]
fn vit_tiny() {
    every_depth_and_schedule(&model("vit-tiny"));
}

#[test]
fn mobilenet_v2() {
    every_depth_and_schedule(&model("mobilenet_v2"));
}

#[test]
fn resnet18() {
    every_depth_and_schedule(&model("resnet18"));
}

#[test]
fn t5_tiny_encoder_decoder() {
    every_depth_and_schedule(&root().join("tests/data/t5-tiny.onnx"));
}

/// Models generated here (`pipewright-synth`), which nothing was tuned on: a GPT with its
/// output projection tied to the token embedding (a weight shared by the first and last
/// stage), and a layered graph whose long skips cross every stage boundary.
#[test]
fn generated_gpt_and_layered_graph() {
    use pipewright_synth::{gpt, layered, GptShape, LayeredShape};
use pipewright_core::Storage;
    let dir = tempfile::tempdir().unwrap();
    let g = gpt(&GptShape { layers: 3, ..GptShape::TINY }).unwrap().write(&dir.path().join("gpt.onnx"), Storage::Inline, 1).unwrap();
    every_depth_and_schedule(&g.model);
    let shape = LayeredShape { layers: 120, width: 8, long_skip_every: 5, long_skip_span: 40 };
    let l = layered(&shape).unwrap().write(&dir.path().join("layered.onnx"), Storage::External, 2).unwrap();
    every_depth_and_schedule(&l.model);
}

/// The export corpus (`tests/exports/`, written by `tests/exports/make_exports.py`): small
/// GPT-2, Llama, BERT, ViT, ResNet, ConvNeXt, T5 and Whisper-style models, each exported by
/// the current PyTorch exporter at batch 1, at batch 4 and with a dynamic batch axis, and by
/// the legacy exporter at batch 4 where it can. Every file must give onnxruntime's outputs
/// on its own inputs and, at batch 3, on the dynamic export's inputs (so a fixed-batch
/// export runs at another batch); and train 2 steps at d = 1, 2 and 4 to the same losses
/// as every other export of the same model (same weights, same synthetic data).
#[cfg(feature = "torch")]
#[test]
fn exports_as_people_make_them() {
    use std::collections::BTreeMap;
    let dir = root().join("tests/exports");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "onnx")).collect();
    files.sort();
    assert!(files.len() >= 24, "the export corpus is missing: {} files in {}", files.len(), dir.display());
    let mut failures = Vec::new();
    // model -> depth -> [(file, (loss 1, loss 2))]
    let mut by_model: BTreeMap<String, BTreeMap<usize, Vec<(String, (f64, f64))>>> = BTreeMap::new();
    let work = tempfile::tempdir().unwrap();
    for file in &files {
        let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
        let model = stem.rsplit_once('-').map_or(stem.clone(), |(m, _)| m.to_string());
        let dynamic = dir.join(format!("{model}-dyn.inputs"));
        for inputs in [file.with_extension("inputs"), dynamic] {
            if !inputs.is_dir() {
                continue;
            }
            match pipewright_driver::forward::run_forward(file, &inputs, tch::Device::Cpu, 1, 1e-4, 1e-5) {
                Ok(outs) => {
                    for o in outs {
                        if let Some(c) = o.comparison.filter(|c| c.mismatches > 0) {
                            failures.push(format!("{stem} on {}: {} of {} elements differ (max abs error {:.3e})", inputs.display(), c.mismatches, c.numel, c.max_abs_err));
                        }
                    }
                }
                Err(e) => failures.push(format!("{stem} on {}: forward: {e}", inputs.display())),
            }
        }
        for d in [1usize, 2, 4] {
            let build = work.path().join(format!("{stem}-d{d}"));
            let what = format!("{stem} d={d}");
            if let Err(e) = try_pw(&["compile", file.to_str().unwrap(), "--stages", &d.to_string(), "-o", build.to_str().unwrap()]) {
                failures.push(format!("{what}: compile: {}", e.lines().last().unwrap_or("")));
                continue;
            }
            match try_pw(&["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "2", "--no-progress", "--timeout", "120"]) {
                Ok(out) => by_model.entry(model.clone()).or_default().entry(d).or_default().push((stem.clone(), losses(&out))),
                Err(e) => failures.push(format!("{what}: train: {}", e.lines().last().unwrap_or(""))),
            }
        }
    }
    for (model, depths) in &by_model {
        for (d, runs) in depths {
            let (first, (a0, b0)) = &runs[0];
            for (file, (a, b)) in &runs[1..] {
                let close = |x: f64, y: f64| (x - y).abs() <= 1e-3 * y.abs().max(1.0);
                if !(a.is_finite() && b.is_finite() && close(*a, *a0) && close(*b, *b0)) {
                    failures.push(format!("{model} d={d}: {file} trains to {a} -> {b}, {first} to {a0} -> {b0}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures over {} files:\n{}", failures.len(), files.len(), failures.join("\n"));
}
