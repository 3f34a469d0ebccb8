//! The planner's memory model against the runtime (issue 39): for every shared model and
//! for GPT-2 small, at depths 2 and 4, under each schedule, `plan --json` predicts each
//! stage's peak (Adam, no recomputation, microbatch 2, 4 microbatches per step; interleaved
//! 1F1B at depth 4 too), the plan
//! is compiled and trained, and the run's peak live tensor bytes per stage must be within
//! 15% of the prediction. What the model has to get right for that: the microbatches each
//! stage holds (1F1B's and ZB-H1's `d - k` in stage `k`, GPipe's `m` in every stage), the weight
//! versions, the moment a flushing schedule's update holds two versions of weights
//! that outweigh its activations, and that a stage's gradient exists only from its batch's
//! first weight gradient on (`m = 2` at `d = 2`, and ZB-V replicas at `m = 2`).

mod common;

use std::path::Path;

use common::{model, pw, pw_ok};
use pipewright_core::Storage;
use pipewright_synth::{gpt, GptShape};
use serde_json::Value;

const TOLERANCE: f64 = 0.15;

/// A size as `human_bytes` prints it (`14.5 MiB`), and half its last printed digit.
fn printed_bytes(text: &str) -> (f64, f64) {
    let (value, unit) = text.trim().split_once(' ').unwrap_or_else(|| panic!("a size: {text:?}"));
    let scale = match unit {
        "B" => return (value.parse().unwrap(), 0.5),
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        other => panic!("unit {other:?} in {text:?}"),
    };
    (value.parse::<f64>().unwrap() * scale, 0.05 * scale)
}

/// One row per stage: `model d schedule stage: predicted, measured`, and whether it is
/// within the tolerance (the measurement's printed rounding given to it).
/// The cluster has one pipeline's workers (`workers`: `d`, or `d / v` under interleaved
/// 1F1B and ZB-V), so the plan is one pipeline of 4 microbatches.
fn compare(dir: &Path, onnx: &Path, d: usize, workers: usize, schedule: &str) -> Vec<(String, bool)> {
    compare_at(dir, onnx, d, workers, schedule, 8)
}

/// [`compare`] with `batch` samples per step (microbatch 2 still).
fn compare_at(dir: &Path, onnx: &Path, d: usize, workers: usize, schedule: &str, batch: u64) -> Vec<(String, bool)> {
    let onnx_arg = onnx.to_str().unwrap();
    let tag = format!("{}-{d}-{schedule}-w{workers}-b{batch}", onnx.file_stem().unwrap().to_string_lossy());
    let plan_path = dir.join(format!("{tag}.json"));
    let (d_arg, workers_arg) = (d.to_string(), workers.to_string());
    let batch_arg = batch.to_string();
    let plan = pw_ok(["plan", onnx_arg, "--stages", &d_arg, "--workers", &workers_arg, "--schedule", schedule, "--microbatch", "2", "--batch", &batch_arg, "--optimizer", "adam", "--recompute", "none", "--json"]);
    std::fs::write(&plan_path, &plan).unwrap();
    let v: Value = serde_json::from_str(&plan).unwrap();
    let predicted: Vec<f64> = v["chosen"]["peak_memory_per_stage"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let build = dir.join(format!("{tag}-build"));
    pw_ok(["compile", onnx_arg, "--plan", plan_path.to_str().unwrap(), "-o", build.to_str().unwrap()]);
    // Three steps: 2BW's steady state (two versions, the gradient, and the next batch's
    // forwards in flight with the previous batch's) first comes in the third; a two-step
    // run peaks one weight copy lower on stages that hold `d` microbatches.
    let out = pw(["train", build.to_str().unwrap(), "--steps", "3", "--optimizer", "adam", "--no-progress"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{tag}: train failed:\n{text}");
    let line = text.lines().find_map(|l| l.strip_prefix("peak live tensor bytes per stage: ")).unwrap_or_else(|| panic!("{tag}: no memory line in\n{text}"));
    let measured: Vec<(f64, f64)> = line.split(", ").map(printed_bytes).collect();
    assert_eq!(measured.len(), predicted.len(), "{tag}: {line}");
    std::fs::remove_dir_all(&build).ok();
    predicted
        .iter()
        .zip(&measured)
        .enumerate()
        .map(|(k, (&p, &(m, half)))| {
            let within = p >= (1.0 - TOLERANCE) * (m - half) && p <= (1.0 + TOLERANCE) * (m + half);
            (format!("{tag} stage {k}: predicted {:.2} MiB, measured {:.2} MiB ({:+.1}%)", p / 1048576.0, m / 1048576.0, (p / m - 1.0) * 100.0), within)
        })
        .collect()
}

fn assert_all_within(rows: Vec<(String, bool)>) {
    let table: Vec<String> = rows.iter().map(|(r, ok)| format!("{} {r}", if *ok { "  " } else { "X " })).collect();
    eprintln!("{}", table.join("\n"));
    assert!(rows.iter().all(|(_, ok)| *ok), "stages predicted more than {}% off (X):\n{}", TOLERANCE * 100.0, table.join("\n"));
}

#[test]
fn every_stage_of_every_shared_model_is_planned_within_15_percent_of_its_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for name in ["mlp", "gpt2-tiny", "bert-tiny", "vit-tiny", "resnet18", "mobilenet_v2"] {
        for d in [2, 4] {
            for schedule in ["2bw", "flush", "gpipe", "zb-h1", "zb-h2"] {
                rows.extend(compare(dir.path(), &model(name), d, d, schedule));
            }
        }
    }
    // Interleaved 1F1B and ZB-V: 4 stages on 2 workers, each stage holding what its place
    // in its worker's order keeps in flight.
    for name in ["mlp", "gpt2-tiny", "bert-tiny", "vit-tiny", "resnet18", "mobilenet_v2"] {
        for schedule in ["interleaved-2", "zb-v"] {
            rows.extend(compare(dir.path(), &model(name), 4, 2, schedule));
        }
    }
    assert_eq!(rows.len(), 6 * 5 * (2 + 4) + 6 * 2 * 4);
    assert_all_within(rows);
}

/// Stages that hold their most microbatches before their batch's first weight gradient,
/// where the gradient does not exist yet: two microbatches per pipeline at d = 2 (PipeDream-
/// Flush's and ZB-H1's first stage, every GPipe stage), and ZB-V in two replicas of two
/// workers at two microbatches each (where bert-tiny's first stage and mobilenet_v2's last
/// were predicted 21% and 19% above their runs while the gradient was counted with them).
#[test]
fn stages_full_before_their_first_weight_gradient_are_planned_within_15_percent() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for name in ["bert-tiny", "mobilenet_v2", "gpt2-tiny"] {
        for schedule in ["flush", "gpipe", "zb-h1"] {
            rows.extend(compare_at(dir.path(), &model(name), 2, 2, schedule, 4));
        }
        rows.extend(compare_at(dir.path(), &model(name), 4, 4, "zb-v", 8));
    }
    assert_eq!(rows.len(), 3 * (3 * 2 + 4));
    assert_all_within(rows);
}

/// GPT-2 small (124M parameters, 128 tokens, tied embedding): the case, where the
/// later stages were overestimated by 40% to 75% and GPipe predicted as PipeDream-Flush.
#[test]
fn gpt2_small_is_planned_within_15_percent_of_its_run_at_depths_2_and_4() {
    let dir = tempfile::tempdir().unwrap();
    let onnx = dir.path().join("gpt2-small.onnx");
    gpt(&GptShape { seq: 128, ..GptShape::GPT2_SMALL }).unwrap().write(&onnx, Storage::External, 0).unwrap();
    let mut rows = Vec::new();
    for d in [2, 4] {
        for schedule in ["2bw", "flush", "gpipe"] {
            rows.extend(compare(dir.path(), &onnx, d, d, schedule));
        }
    }
    // GPipe holds all four microbatches in every stage, Flush four down to one.
    let last = |schedule: &str| rows.iter().find(|(r, _)| r.starts_with(&format!("gpt2-small-4-{schedule}-w4-b8 stage 3"))).unwrap().0.clone();
    assert_ne!(last("gpipe").split(", measured").next(), last("flush").split(", measured").next());
    assert_all_within(rows);
}
