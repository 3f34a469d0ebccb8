//! `pipewright train --trace` and `pipewright trace-svg` end to end (issue 6): compile the
//! shared MLP into 2 stages, train 5 steps on the digits with a trace, check the trace
//! against the schedule and draw it.

mod common;

use std::path::{Path, PathBuf};

use pipewright_core::Schedule;
use pipewright_runtime::pipeline::{stage_ops, Op};
use serde_json::Value;

use common::{assert_clean_error, fails, model, pw, pw_ok, root};

const STEPS: usize = 5;
const M: usize = 4;
const DEPTH: usize = 2;

fn compile(dir: &Path, schedule: &str, recompute: &str) {
    let mlp = model("mlp");
    pw_ok(["compile", mlp.to_str().unwrap(), "--stages", "2", "--schedule", schedule, "--recompute", recompute, "-o", dir.to_str().unwrap()]);
}

/// Trains `STEPS` steps with `--trace` and returns the parsed trace.
fn train_traced(dir: &Path) -> (PathBuf, Vec<Value>) {
    let data = root().join("examples/digits/digits.npz");
    let trace = dir.join("trace.json");
    let steps = STEPS.to_string();
    let m = M.to_string();
    pw_ok([
        "train", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3",
        "--steps", &steps, "--microbatch", "16", "--microbatches", &m, "--optimizer", "adam", "--lr", "0.003",
        "--trace", trace.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&trace).expect("trace written");
    let v: Value = serde_json::from_str(&text).expect("trace is valid JSON");
    let events = v.as_array().expect("trace is a JSON array").clone();
    (trace, events)
}

fn name(e: &Value) -> &str {
    e["name"].as_str().expect("name")
}
fn tid(e: &Value) -> usize {
    e["tid"].as_u64().expect("tid") as usize
}
fn ts(e: &Value) -> f64 {
    e["ts"].as_f64().expect("ts")
}
fn dur(e: &Value) -> f64 {
    e["dur"].as_f64().expect("dur")
}
fn mb(e: &Value) -> u64 {
    e["args"]["microbatch"].as_u64().expect("microbatch")
}
fn step(e: &Value) -> u64 {
    e["args"]["step"].as_u64().expect("step")
}

/// The events of stage `k` in time order.
fn stage_events(events: &[Value], k: usize) -> Vec<&Value> {
    let mut v: Vec<&Value> = events.iter().filter(|e| tid(e) == k).collect();
    v.sort_by(|a, b| ts(a).partial_cmp(&ts(b)).unwrap());
    v
}

/// Structural checks every schedule must pass.
fn check_trace(events: &[Value], schedule: Schedule, recompute: bool) {
    assert!(!events.is_empty());
    let kinds = ["forward", "backward", "recompute", "send", "recv", "optimizer"];
    for e in events {
        assert_eq!(e["ph"], "X", "{e}");
        assert_eq!(e["pid"], 0, "{e}");
        assert!(kinds.contains(&name(e)), "{e}");
        assert!(e["cat"].is_string(), "{e}");
        assert!(ts(e) >= 0.0 && dur(e) >= 0.0, "{e}");
        assert!(tid(e) < DEPTH, "{e}");
        assert!(e["args"]["version"].is_u64(), "{e}");
        assert!(e["args"]["step"].is_u64(), "{e}");
    }
    let total = (STEPS * M) as u64;
    for k in 0..DEPTH {
        let evs = stage_events(events, k);
        // No overlap within a stage (a few ns of float slack).
        for w in evs.windows(2) {
            assert!(ts(w[0]) + dur(w[0]) <= ts(w[1]) + 1e-3, "stage {k}: {} overlaps {}", w[0], w[1]);
        }
        // Forward and backward of every microbatch, backward after its forward.
        for j in 0..total {
            let f: Vec<&&Value> = evs.iter().filter(|e| name(e) == "forward" && mb(e) == j).collect();
            let b: Vec<&&Value> = evs.iter().filter(|e| name(e) == "backward" && mb(e) == j).collect();
            assert_eq!(f.len(), 1, "stage {k}: forwards of microbatch {j}");
            assert_eq!(b.len(), 1, "stage {k}: backwards of microbatch {j}");
            assert!(ts(b[0]) >= ts(f[0]) + dur(f[0]) - 1e-3, "stage {k}: backward of {j} before its forward ends");
            assert_eq!(step(f[0]), j / M as u64);
            let r = evs.iter().filter(|e| name(e) == "recompute" && mb(e) == j).count();
            assert_eq!(r, recompute as usize, "stage {k}: recomputes of microbatch {j}");
        }
        // One optimizer event per step, in order.
        let opt: Vec<u64> = evs.iter().filter(|e| name(e) == "optimizer").map(|e| step(e)).collect();
        assert_eq!(opt, (0..STEPS as u64).collect::<Vec<_>>(), "stage {k}: optimizer steps");
        // Sends and receives: stage 0 receives gradients and sends activations; the last
        // stage the opposite — one each per microbatch.
        let sends = evs.iter().filter(|e| name(e) == "send").count();
        let recvs = evs.iter().filter(|e| name(e) == "recv").count();
        assert_eq!((sends, recvs), (total as usize, total as usize), "stage {k}: sends/receives");
        // The op order is the schedule's.
        let got: Vec<Op> = evs
            .iter()
            .filter_map(|e| match name(e) {
                "forward" => Some(Op::Forward(mb(e))),
                "backward" => Some(Op::Backward(mb(e))),
                "optimizer" => Some(Op::Step(step(e))),
                _ => None,
            })
            .collect();
        assert_eq!(got, stage_ops(schedule, k, DEPTH, M, STEPS).unwrap(), "stage {k}: op order under {schedule:?}");
    }
}

#[test]
fn gpipe_trace_matches_the_schedule_and_draws() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "gpipe", "full");
    let (trace, events) = train_traced(dir.path());
    check_trace(&events, Schedule::GPipe, true);
    // GPipe: on stage 0 every forward of a batch ends before any of its backwards starts.
    let s0 = stage_events(&events, 0);
    for t in 0..STEPS as u64 {
        let last_f = s0.iter().filter(|e| name(e) == "forward" && step(e) == t).map(|e| ts(e) + dur(e)).fold(0.0, f64::max);
        let first_b = s0.iter().filter(|e| name(e) == "backward" && step(e) == t).map(|e| ts(e)).fold(f64::INFINITY, f64::min);
        assert!(last_f <= first_b + 1e-3, "batch {t}: a backward starts before the last forward");
    }

    let svg = dir.path().join("timeline.svg");
    let stdout = pw_ok(["trace-svg", trace.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    let text = std::fs::read_to_string(&svg).expect("svg written");
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    assert_eq!(text.matches("<rect").count(), events.len(), "one <rect> per event");
    for k in 0..DEPTH {
        let line = stdout.lines().find(|l| l.starts_with(&format!("stage {k}:"))).unwrap_or_else(|| panic!("no bubble line for stage {k}: {stdout}"));
        let frac: f64 = line.split("bubble fraction ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|f| f.parse().ok()).unwrap_or_else(|| panic!("{line}"));
        assert!((0.0..1.0).contains(&frac), "{line}");
    }
}

#[test]
fn two_bw_trace_interleaves_forwards_and_backwards() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2bw", "none");
    let (_, events) = train_traced(dir.path());
    check_trace(&events, Schedule::TwoBw, false);
    // 1F1B: on stage 0 the backward of microbatch 0 comes before the forward of microbatch
    // M - 1 (under GPipe it would come after all of batch 0's forwards).
    let s0 = stage_events(&events, 0);
    let b0 = s0.iter().position(|e| name(e) == "backward" && mb(e) == 0).unwrap();
    let f_last = s0.iter().position(|e| name(e) == "forward" && mb(e) == M as u64 - 1).unwrap();
    assert!(b0 < f_last, "2BW stage 0 should interleave");
}

#[test]
fn trace_svg_rejects_a_bad_trace() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    let out = pw(["trace-svg", bad.to_str().unwrap(), "-o", dir.path().join("x.svg").to_str().unwrap()]);
    assert_clean_error(&out, &bad, &["not a trace (a JSON array of events, or {\"traceEvents\": [...]})"]);
    assert!(!dir.path().join("x.svg").exists());
}

/// The drawn compute (forward, backward, recompute) boxes of an SVG: (width, the title's
/// step, its microbatch, the label in it).
fn svg_boxes(svg: &str) -> Vec<(f64, u64, Option<u64>, Option<String>)> {
    let lines: Vec<&str> = svg.lines().collect();
    let mut out = Vec::new();
    let compute = |l: &str| ["<title>forward", "<title>backward", "<title>recompute"].iter().any(|k| l.contains(k));
    for (i, l) in lines.iter().enumerate().filter(|(_, l)| l.starts_with("<rect") && compute(l)) {
        let width: f64 = l.split(" width=\"").nth(1).and_then(|r| r.split('"').next()).and_then(|w| w.parse().ok()).expect("rect width");
        let step: u64 = l.split(" step ").nth(1).and_then(|r| r.split(':').next()).and_then(|s| s.parse().ok()).expect("rect step");
        let mb = l.split(" mb ").nth(1).and_then(|r| r.split(' ').next()).and_then(|s| s.parse().ok());
        let label = lines.get(i + 1).filter(|n| n.starts_with("<text") && n.contains("font-size=\"10\"")).and_then(|n| n.split('>').nth(1)).map(|t| t.trim_end_matches("</text").to_string());
        out.push((width, step, mb, label));
    }
    out
}

/// The SVG of a 200-step run: by default its first 10 steps (the title says so), with
/// `--steps` the window asked for, and in either the microbatch ids written in the compute
/// boxes (most of them; every label in a box wide enough for it); a window outside the
/// trace is refused without writing a file.
#[test]
fn svg_of_a_200_step_run_shows_a_window_with_microbatch_labels() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2bw", "none");
    let trace = dir.path().join("trace.json");
    pw_ok(["train", dir.path().to_str().unwrap(), "--steps", "200", "--microbatch", "4", "--microbatches", "4", "--trace", trace.to_str().unwrap()]);
    let svg_path = dir.path().join("t.svg");
    let draw = |extra: &[&str]| {
        let mut args = vec!["trace-svg", trace.to_str().unwrap(), "-o", svg_path.to_str().unwrap()];
        args.extend_from_slice(extra);
        pw_ok(&args);
        std::fs::read_to_string(&svg_path).expect("svg written")
    };
    let check_labels = |svg: &str, boxes: &[(f64, u64, Option<u64>, Option<String>)]| {
        // Every box wide enough for its label shows it, and no other (the widths printed
        // are rounded to 0.01 px).
        for (width, _, mb, label) in boxes {
            let id = mb.map(|m| m.to_string());
            let needed = pipewright_core::timeline::label_width(id.as_ref().map_or(0, String::len));
            match label {
                Some(label) => {
                    assert_eq!(Some(label.clone()), id, "a label is its box's microbatch");
                    assert!(*width >= needed - 0.01, "label {label} in a box {width} px wide");
                }
                None => assert!(id.is_none() || *width < needed + 0.01, "a box {width} px wide lacks its label {id:?}"),
            }
        }
        // The drawing widens until nine in ten boxes hold their labels, unless it reached
        // its widest (a run whose timings spread far apart); at least three in four here.
        let total: f64 = svg.split(" width=\"").nth(1).and_then(|r| r.split('"').next()).and_then(|w| w.parse().ok()).expect("svg width");
        let widest = total - 110.0 >= f64::from(pipewright_core::timeline::MAX_SVG_WIDTH) - 0.5;
        let labelled = boxes.iter().filter(|b| b.3.is_some()).count();
        assert!(!boxes.is_empty() && (widest || labelled * 4 >= boxes.len() * 3), "{labelled} labels on {} compute boxes", boxes.len());
    };
    let svg = draw(&[]);
    assert!(svg.contains("steps 0..10 of 0..200: the first 10"), "{}", &svg[..500]);
    let boxes = svg_boxes(&svg);
    assert!(!boxes.is_empty() && boxes.iter().all(|b| b.1 < 10));
    check_labels(&svg, &boxes);
    let svg = draw(&["--steps", "120..125"]);
    assert!(svg.contains("steps 120..125 of 0..200"), "{}", &svg[..500]);
    let boxes = svg_boxes(&svg);
    assert!(boxes.iter().all(|b| (120..125).contains(&b.1)));
    for t in 120..125 {
        assert!(boxes.iter().any(|b| b.1 == t), "step {t} is not drawn");
    }
    check_labels(&svg, &boxes);
    std::fs::remove_file(&svg_path).unwrap();
    let out = pw(["trace-svg", trace.to_str().unwrap(), "-o", svg_path.to_str().unwrap(), "--steps", "500..510"]);
    fails(&out, &["--steps 500..510", "no events"]);
    assert!(!svg_path.exists());
    let out = pw(["trace-svg", trace.to_str().unwrap(), "-o", svg_path.to_str().unwrap(), "--steps", "9..3"]);
    fails(&out, &["9..3", "empty"]);
}

/// `metrics-svg` draws two runs' losses (raw and smoothed) and their learning rates (a
/// warm-up then a cosine decay, as the runs used) as well-formed SVG with one series of
/// each kind per run, every step a point; a file that is not metrics is refused by name.
#[test]
fn metrics_svg_draws_every_run_loss_and_learning_rate() {
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path(), "2bw", "none");
    let data = root().join("examples/digits/digits.npz");
    let runs = [("adam", "0.003"), ("sgd", "0.1")];
    let mut files = Vec::new();
    for (opt, lr) in runs {
        let metrics = dir.path().join(format!("{opt}.jsonl"));
        let b = dir.path().to_str().unwrap();
        let d = data.to_str().unwrap();
        let m = metrics.to_str().unwrap();
        pw_ok(["train", b, "--data", d, "--label", "label", "--output", "linear_3", "--steps", "40", "--microbatch", "16", "--microbatches", "4"]
            .into_iter()
            .chain(["--optimizer", opt, "--lr", lr, "--warmup", "5", "--decay", "cosine", "--metrics", m, "--no-progress"]));
        files.push(metrics);
    }
    let svg = dir.path().join("curves.svg");
    let out = pw(["metrics-svg", files[0].to_str().unwrap(), files[1].to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).expect("svg written");
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let series: Vec<(String, String, usize)> = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .map(|n| (n.attribute("data-run").unwrap_or("").to_string(), n.attribute("data-series").unwrap_or("").to_string(), n.attribute("points").unwrap_or("").split_whitespace().count()))
        .collect();
    for (opt, _) in runs {
        for kind in ["loss", "smoothed", "lr"] {
            assert!(series.contains(&(opt.to_string(), kind.to_string(), 40)), "{opt} {kind} with 40 points: {series:?}");
        }
    }
    // The rates: the warm-up's first step is a fifth of the base rate, the last step's
    // is near zero (cosine to 0).
    let lines: Vec<Value> = std::fs::read_to_string(&files[0]).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!((lines[0]["lr"].as_f64().unwrap() - 0.0006).abs() < 1e-12, "{}", lines[0]);
    assert!(lines[39]["lr"].as_f64().unwrap() < 1e-4, "{}", lines[39]);
    let bad = dir.path().join("notes.txt");
    std::fs::write(&bad, "hello\n").unwrap();
    let out = pw(["metrics-svg", bad.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert_clean_error(&out, &bad, &["line 1: not a metrics line of `train --metrics`"]);
}
