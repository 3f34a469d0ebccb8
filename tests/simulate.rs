//! `pipewright simulate` end to end (issue 15): the replay runs the per-stage order a real
//! run's trace shows, writes the trace formats of real runs, reports what it promises,
//! plans a model whose weights were never written, and names what is wrong with bad input.

mod common;

use std::path::Path;

use pipewright_runtime::timeline::{read_chrome_trace, TraceEvent, TraceKind};
use pipewright_synth::{gpt, GptShape};
use pipewright_core::Storage;
use serde_json::Value;

use common::{fails, model, pw, pw_ok, root};

fn trace(path: &Path) -> Vec<TraceEvent> {
    read_chrome_trace(&std::fs::read_to_string(path).expect("trace written")).expect("a trace")
}

/// Per stage, the forwards, backwards and updates in time order, as text.
fn order(events: &[TraceEvent], stage: usize) -> Vec<String> {
    let mut ev: Vec<&TraceEvent> = events.iter().filter(|e| e.stage == stage && matches!(e.kind, TraceKind::Forward | TraceKind::Backward | TraceKind::Optimizer)).collect();
    ev.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    ev.iter()
        .map(|e| match e.kind {
            TraceKind::Optimizer => format!("step {}", e.step),
            k => format!("{} {}", k.name(), e.microbatch.unwrap_or(u64::MAX)),
        })
        .collect()
}

/// For each schedule: plan the shared MLP into 2 stages, compile the plan, train 3 steps
/// with a trace, replay the plan for 3 batches, and compare the two traces stage by stage.
#[test]
fn the_replay_runs_each_stage_in_the_order_a_real_run_does() {
    let mlp = model("mlp");
    let mlp = mlp.to_str().unwrap();
    let data = root().join("examples/digits/digits.npz");
    for schedule in ["2bw", "flush", "gpipe"] {
        let dir = tempfile::tempdir().unwrap();
        let plan = dir.path().join("plan.json");
        let planned = pw_ok(&[
            "plan", mlp, "--stages", "2", "--workers", "2", "--batch", "64", "--microbatch", "16", "--schedule", schedule, "--recompute",
            "none", "--json",
        ]);
        std::fs::write(&plan, planned).unwrap();
        let build = dir.path().join("build");
        pw_ok(&["compile", mlp, "--plan", plan.to_str().unwrap(), "-o", build.to_str().unwrap()]);
        let real = dir.path().join("real.json");
        pw_ok(&[
            "train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "3", "--trace",
            real.to_str().unwrap(),
        ]);
        let sim = dir.path().join("sim.json");
        let svg = dir.path().join("sim.svg");
        let report = pw_ok(&["simulate", plan.to_str().unwrap(), "--batches", "3", "--trace", sim.to_str().unwrap(), "--svg", svg.to_str().unwrap()]);
        assert!(report.contains(&format!("\n{schedule} ")), "{report}");
        let (real, sim) = (trace(&real), trace(&sim));
        for stage in 0..2 {
            let expect = order(&real, stage);
            assert_eq!(expect.len(), 3 * (2 * 4 + 1), "{schedule} stage {stage}: {expect:?}");
            assert_eq!(order(&sim, stage), expect, "{schedule} stage {stage}");
        }
        // The SVG is the one trace-svg draws: one box per event.
        let drawn = std::fs::read_to_string(&svg).unwrap();
        assert_eq!(drawn.matches("<rect").count(), sim.len());
        // --stage-times: the real run's mean forward and backward per stage, replayed (the
        // mean, not the median: a slow tail of the run is time its rate paid), each
        // operation times a draw from how the run's forwards and backwards spread about
        // their stage's mean.
        let timed = dir.path().join("timed.json");
        let real_path = dir.path().join("real.json");
        pw_ok(&["simulate", plan.to_str().unwrap(), "--batches", "3", "--stage-times", real_path.to_str().unwrap(), "--trace", timed.to_str().unwrap()]);
        let timed = trace(&timed);
        let durations = |ev: &[TraceEvent], stage: usize, kind: TraceKind| -> Vec<f64> { ev.iter().filter(|e| e.stage == stage && e.kind == kind).map(|e| e.dur_us).collect() };
        let kinds = [TraceKind::Forward, TraceKind::Backward];
        let mean = |ev: &[f64]| ev.iter().sum::<f64>() / ev.len() as f64;
        let factors: Vec<f64> = (0..2).flat_map(|stage| kinds.map(|kind| durations(&real, stage, kind))).flat_map(|d| { let m = mean(&d); d.into_iter().map(move |x| x / m) }).collect();
        for stage in 0..2 {
            for kind in kinds {
                let want = mean(&durations(&real, stage, kind));
                for got in durations(&timed, stage, kind) {
                    assert!(factors.iter().any(|f| (want * f - got).abs() <= 1e-6 * got.max(1.0)), "{schedule} stage {stage} {kind:?}: {got} µs replayed, mean {want} µs measured, factors {factors:?}");
                }
            }
        }
        // And the run's untraced work after each backward: in the replay, the gap from a
        // backward (and its send) to the stage's next event is the run's mean gap, or more
        // where the replay then waits (its trace records no waits), less the few µs of link
        // time a replayed send's event spans beyond its hand-off.
        let measured = pipewright_runtime::timeline::after_backward_us(&real, 0);
        for (stage, measured) in measured.into_iter().enumerate() {
            let measured = measured.unwrap_or_else(|| panic!("{schedule} stage {stage}: no gap after a backward"));
            let least = pipewright_runtime::timeline::gaps_after_backward(&timed, stage, 0).into_iter().fold(f64::INFINITY, f64::min);
            assert!(measured > 0.0 && least >= measured - 10.0, "{schedule} stage {stage}: {least} µs replayed at least, {measured} µs measured");
        }
    }
    // A trace of another depth is refused, naming it.
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, pw_ok(&["plan", mlp, "--stages", "3", "--workers", "3", "--batch", "64", "--schedule", "gpipe", "--json"])).unwrap();
    let two = dir.path().join("two.json");
    std::fs::write(&two, r#"[{"ph":"X","name":"forward","ts":0,"dur":1,"tid":1,"args":{"microbatch":0,"version":0,"step":0}}]"#).unwrap();
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--stage-times", two.to_str().unwrap()]), &["two.json: the trace has 2 stages, the replayed configuration 3"]);
    // A plan replayed on a cluster too small for it.
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--cluster", "H100", "--gpus-per-server", "2"]), &["plan.json: the plan needs 3 workers (w = 1, d = 3); the cluster has 2"]);
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--batch", "128"]), &["the plan is for a global batch of 64, not 128"]);
    // The plan's own cluster, and another schedule on request.
    let out = pw_ok(&["simulate", plan.to_str().unwrap(), "--schedule", "gpipe,flush", "--batches", "2"]);
    assert!(out.starts_with("simulated on: the plan's cluster: 3 workers"), "{out}");
    assert!(out.contains("\ngpipe ") && out.contains("\nflush "), "{out}");
    // A plan fixes a pipeline: tensor parallelism is for models.
    let out = pw_ok(&["simulate", plan.to_str().unwrap(), "--schedule", "tensor-parallel", "--batches", "2"]);
    assert!(out.contains("tensor-parallel a plan fixes the pipeline; simulate the model for tensor parallelism"), "{out}");
}

/// Tensor parallelism end to end on a synthetic GPT: the layers split over t GPUs of a
/// server (t in the table and the JSON), one stage per group whose replay is m
/// microbatches plus the groups' all-reduce and the update; a cluster too small for any
/// t says why, and so does a cluster whose servers hold one GPU each.
#[test]
fn tensor_parallelism_splits_layers_within_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.onnx");
    gpt(&GptShape { layers: 4, hidden: 256, heads: 8, seq: 128, vocab: 1000, tied: true }).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
    let p = path.to_str().unwrap();
    let args = ["simulate", p, "--cluster", "V100-16GB", "--servers", "2", "--precision", "fp16", "--batch", "64", "--schedule", "tensor-parallel", "--batches", "3"];
    let v: Value = serde_json::from_str(&pw_ok(&[&args[..], &["--json"]].concat())).unwrap();
    let o = &v["outcomes"][0];
    assert_eq!(o["scheme"], "tensor-parallel");
    let (t, c, sim) = (o["t"].as_u64().unwrap(), &o["config"], &o["simulation"]);
    assert!([2, 4, 8].contains(&t), "{o}");
    assert_eq!(c["d"], 1);
    let (w, b, m) = (c["w"].as_u64().unwrap(), c["b"].as_u64().unwrap(), c["m"].as_u64().unwrap());
    assert!(w * t <= 16 && w * b * m == 64, "{c}");
    let stages = sim["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 1);
    // Per batch: m microbatches (their tensor all-reduces inside), then the groups'
    // all-reduce and the update; the closed form counts all but the update.
    let batch_s = sim["batch_s"].as_f64().unwrap();
    let busy_per_batch = stages[0]["busy_s"].as_f64().unwrap() / 3.0;
    let allreduce = stages[0]["allreduce_s"].as_f64().unwrap();
    assert!((batch_s - (busy_per_batch + allreduce)).abs() <= 1e-9 * batch_s, "{batch_s} against {busy_per_batch} + {allreduce}");
    let planned = o["planned_samples_per_s"].as_f64().unwrap();
    assert!(planned >= sim["samples_per_s"].as_f64().unwrap(), "{o}");
    let text = pw_ok(&args);
    let row = text.lines().find(|l| l.starts_with("tensor-parallel ")).unwrap_or_else(|| panic!("{text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // w, d, placement (none: one stage), t.
    assert_eq!(cells[1..5], [w.to_string(), "1".to_string(), "-".to_string(), t.to_string()], "{row}");
    // 64 KiB per GPU: nothing fits, and the least need is named.
    let toml = dir.path().join("small.toml");
    std::fs::write(&toml, "workers = 8\nworkers_per_node = 8\nmemory_per_worker = \"64KiB\"\n").unwrap();
    let text = pw_ok(&["simulate", p, "--cluster", toml.to_str().unwrap(), "--batch", "8", "--schedule", "tensor-parallel,2bw"]);
    assert!(text.contains("tensor-parallel does not fit at any t: the least a GPU needs is "), "{text}");
    assert!(text.contains("(t = 8, b = 1: ") && text.contains(" of its 64.0 KiB"), "{text}");
    // One GPU per server: no group to split a layer over.
    let text = pw_ok(&["simulate", p, "--cluster", "H100", "--gpus-per-server", "1", "--servers", "4", "--batch", "8", "--schedule", "tensor-parallel"]);
    assert!(text.contains("the servers have 1 GPU(s); it needs at least 2"), "{text}");
}

/// `--stages`, `--width`, `--microbatch` and `--tensor-ways` fix every scheme's
/// configuration as the PipeDream-2BW paper's comparison does (each scheme at the same
/// model-parallel size): the pipelines and inter-layer model parallelism at that depth
/// and width, tensor parallelism at that `t` (here two whole servers, so its all-reduces
/// cross the network and it is slower than within one), all at that microbatch; a plan
/// file refuses them, and a `t` that is neither a divisor of a server nor whole servers
/// is refused, saying why.
#[test]
fn the_configuration_can_be_fixed_for_every_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.onnx");
    gpt(&GptShape { layers: 4, hidden: 256, heads: 8, seq: 128, vocab: 1000, tied: true }).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
    let p = path.to_str().unwrap();
    // Four servers of 8: t = 16 spans two, and two groups of it fill them.
    let run = |schemes: &str, extra: &[&str]| -> Value {
        let args = [&["simulate", p, "--cluster", "V100-16GB", "--servers", "4", "--precision", "fp16", "--batch", "64", "--batches", "3", "--schedule", schemes, "--json"][..], extra].concat();
        serde_json::from_str(&pw_ok(&args)).unwrap()
    };
    let fixed = run("2bw,gpipe,model-parallel,tensor-parallel", &["--stages", "4", "--width", "2", "--microbatch", "2", "--tensor-ways", "16"]);
    for o in fixed["outcomes"].as_array().unwrap() {
        let c = &o["config"];
        assert_eq!((c["w"].as_u64(), c["b"].as_u64()), (Some(2), Some(2)), "{o}");
        if o["scheme"] == "tensor-parallel" {
            assert_eq!((o["t"].as_u64(), c["d"].as_u64()), (Some(16), Some(1)), "{o}");
        } else {
            assert_eq!(c["d"].as_u64(), Some(4), "{o}");
        }
    }
    let rate = |v: &Value| v["outcomes"][0]["simulation"]["samples_per_s"].as_f64().unwrap();
    let tensor = |ways: &str| run("tensor-parallel", &["--width", "1", "--microbatch", "2", "--tensor-ways", ways]);
    let (within, across) = (tensor("8"), tensor("16"));
    assert!(rate(&across) < rate(&within), "t = 16 over the network {} against t = 8 over NVLink {}", rate(&across), rate(&within));
    fails(&pw(&["simulate", p, "--cluster", "V100-16GB", "--servers", "2", "--batch", "64", "--schedule", "tensor-parallel", "--tensor-ways", "12"]), &["gpt.onnx: --tensor-ways 12: a group must divide a server of 8 GPUs or be whole servers (a multiple of 8)"]);
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, pw_ok(&["plan", p, "--stages", "2", "--workers", "2", "--batch", "16", "--schedule", "flush", "--json"])).unwrap();
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--width", "2", "--microbatch", "1"]), &["plan.json: --width, --microbatch fix(es) a model's configuration; a plan file has its own"]);
}

#[test]
fn a_model_report_has_every_scheme_and_its_numbers() {
    let gpt = model("gpt2-tiny");
    let gpt = gpt.to_str().unwrap();
    let out = pw_ok(&["simulate", gpt, "--cluster", "A100-40GB", "--batch", "64", "--batches", "4", "--json"]);
    let v: Value = serde_json::from_str(&out).expect("JSON");
    let outcomes = v["outcomes"].as_array().unwrap();
    let schemes: Vec<&str> = outcomes.iter().map(|o| o["scheme"].as_str().unwrap()).collect();
    assert_eq!(schemes, ["2bw", "flush", "gpipe", "zb-h1", "zb-h2", "interleaved-2", "interleaved-4", "zb-v", "model-parallel", "data-parallel", "tensor-parallel"]);
    assert_eq!(v["cluster"]["cluster"]["workers"], 8);
    for o in outcomes {
        let sim = &o["simulation"];
        assert!(sim["samples_per_s"].as_f64().unwrap() > 0.0, "{o}");
        let d = o["config"]["d"].as_u64().unwrap() as usize;
        let stages = sim["stages"].as_array().unwrap();
        assert_eq!(stages.len(), d);
        for st in stages {
            let bubble = st["bubble_fraction"].as_f64().unwrap();
            assert!((0.0..1.0).contains(&bubble), "{st}");
            assert!(st["busy_s"].as_f64().unwrap() > 0.0);
            assert!(st["peak_memory"].as_f64().unwrap() > 0.0);
        }
    }
    // The planner replays its candidates over 6 batches with this cluster's latencies (and
    // host cores, when the stages share them), so replayed for 6 batches here its choice
    // runs at the rate the plan predicts; the closed form is reported beside it.
    for cores in [None, Some("2")] {
        let mut args = vec!["simulate", gpt, "--cluster", "A100-40GB", "--batch", "64", "--batches", "6", "--schedule", "2bw,flush,gpipe,zb-h1,interleaved-2", "--json"];
        if let Some(c) = cores {
            args.extend(["--host-cores", c]);
        }
        let v: Value = serde_json::from_str(&pw_ok(&args)).expect("JSON");
        for o in v["outcomes"].as_array().unwrap() {
            let (planned, replayed) = (o["planned_samples_per_s"].as_f64().unwrap(), o["simulation"]["samples_per_s"].as_f64().unwrap());
            assert!((planned - replayed).abs() <= 1e-9 * replayed, "{} ({cores:?} cores): planned {planned}, replayed {replayed}", o["scheme"]);
            assert!(o["closed_form_samples_per_s"].as_f64().unwrap() > 0.0, "{o}");
        }
    }
    // The text form: a row per scheme and the ratios.
    let text = pw_ok(&["simulate", gpt, "--cluster", "A100-40GB", "--batch", "64", "--schedule", "2bw,gpipe", "--batches", "4"]);
    assert!(text.contains("closed form: the planner's formula"), "{text}");
    assert!(text.starts_with("simulated on: 1 x 8 A100-40GB (8x200gbit)"), "{text}");
    assert!(text.contains("slowdown against the fastest: 2bw "), "{text}");
    assert!(!text.contains("\nflush "), "{text}");
}

/// A 3.8-billion-parameter GPT whose 15 GB of weights were never written plans and
/// simulates on the paper's cluster; compiling it names the missing file.
#[test]
fn paper_scale_models_need_no_weights() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt-3.8b.onnx");
    let written = gpt(&GptShape::GPT_3_8B).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
    assert!(written.parameters > 3_700_000_000);
    assert!(written.bytes < 4 << 20, "{} bytes", written.bytes);
    assert!(!dir.path().join("gpt-3.8b.onnx.data").exists());
    let p = path.to_str().unwrap();
    let out = pw_ok(&["simulate", p, "--cluster", "V100-16GB", "--servers", "8", "--precision", "fp16", "--batch", "512", "--schedule", "2bw", "--batches", "6", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let c = &v["outcomes"][0]["config"];
    assert_eq!(c["w"].as_u64().unwrap() * c["d"].as_u64().unwrap(), 64, "{c}");
    let peak = v["outcomes"][0]["simulation"]["stages"].as_array().unwrap().iter().map(|s| s["peak_memory"].as_f64().unwrap()).fold(0.0, f64::max);
    assert!(peak <= 16.0 * (1u64 << 30) as f64, "{peak}");
    // `plan` on the same preset chooses what `simulate` replayed, with the same figure.
    let planned: Value = serde_json::from_str(&pw_ok(&["plan", p, "--cluster", "V100-16GB", "--servers", "8", "--batch", "512", "--schedule", "2bw", "--precision", "fp16", "--top", "1", "--json"])).unwrap();
    for key in ["w", "d", "b", "m", "recompute"] {
        assert_eq!(planned["chosen"][key], c[key], "{key}");
    }
    let replayed = v["outcomes"][0]["simulation"]["samples_per_s"].as_f64().unwrap();
    assert!((planned["chosen"]["replayed_samples_per_s"].as_f64().unwrap() - replayed).abs() <= 1e-9 * replayed);
    assert!(planned["cluster"]["achievable"]["gemm"].as_f64().unwrap() < 1.0);
    fails(&pw(&["compile", p, "--stages", "2", "-o", dir.path().join("build").to_str().unwrap()]), &["gpt-3.8b.onnx.data", "cannot be read"]);
}

/// `--recompute` fixes the pipeline schemes' recomputation, as `plan --recompute` does
/// (the paper's GPipe always recomputes): every configuration replayed has it, and a free
/// search is at least as fast; a plan file, which brings its own, refuses it.
#[test]
fn recomputation_can_be_fixed_for_the_search() {
    let gpt = model("gpt2-tiny");
    let gpt = gpt.to_str().unwrap();
    let run = |extra: &[&str]| -> Value {
        let args = [&["simulate", gpt, "--cluster", "A100-40GB", "--batch", "64", "--batches", "4", "--schedule", "2bw,gpipe", "--json"][..], extra].concat();
        serde_json::from_str(&pw_ok(&args)).unwrap()
    };
    let (free, full) = (run(&[]), run(&["--recompute", "full"]));
    for (f, r) in free["outcomes"].as_array().unwrap().iter().zip(full["outcomes"].as_array().unwrap()) {
        assert_eq!(r["config"]["recompute"], "full", "{r}");
        let rate = |o: &Value| o["simulation"]["samples_per_s"].as_f64().unwrap();
        assert!(rate(f) >= rate(r) * (1.0 - 1e-9), "{}: free {} against full {}", f["scheme"], rate(f), rate(r));
    }
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, pw_ok(&["plan", gpt, "--stages", "2", "--workers", "2", "--batch", "16", "--schedule", "gpipe", "--json"])).unwrap();
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--recompute", "full"]), &["plan.json: --recompute full is for a model", "plan again with --recompute"]);
}

#[test]
fn bad_input_is_named() {
    let mlp = model("mlp");
    let mlp = mlp.to_str().unwrap();
    fails(&pw(&["simulate", mlp, "--cluster", "K80", "--batch", "8"]), &["--cluster: unknown device preset \"K80\""]);
    fails(&pw(&["simulate", mlp, "--cluster", "V100-16GB"]), &["needs the global batch (--batch B)"]);
    fails(&pw(&["simulate", mlp, "--batch", "8"]), &["needs a cluster (--cluster FILE|PRESET)"]);
    fails(&pw(&["simulate", mlp, "--cluster", "V100-16GB", "--batch", "8", "--schedule", "pipedream"]), &["unknown scheme \"pipedream\""]);
    fails(&pw(&["simulate", mlp, "--cluster", "V100-16GB", "--batch", "8", "--precision", "bf16"]), &["V100-16GB has no bf16 tensor cores"]);
    fails(&pw(&["simulate", mlp, "--cluster", "H100", "--network", "smoke-signals", "--batch", "8"]), &["--network: unknown network preset \"smoke-signals\""]);
    fails(&pw(&["simulate", mlp, "--cluster", "H100", "--efficiency", "2", "--batch", "8"]), &["efficiency: 2 is not in (0, 1]"]);
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("c.toml");
    std::fs::write(&toml, "workers = 4\ninter_latency = \"later\"\n").unwrap();
    fails(&pw(&["simulate", mlp, "--cluster", toml.to_str().unwrap(), "--batch", "8"]), &["c.toml: inter_latency: cannot parse \"later\""]);
    fails(&pw(&["simulate", mlp, "--cluster", toml.to_str().unwrap(), "--servers", "2", "--batch", "8"]), &["--servers appl(ies) to a device preset, not to the cluster file"]);
    fails(&pw(&["simulate", mlp, "--network", "25gbit", "--batch", "8"]), &["--network need(s) a device preset in --cluster"]);
    // A trace that cannot be written loses nothing and says where.
    fails(&pw(&["simulate", mlp, "--cluster", "H100", "--batch", "8", "--schedule", "2bw", "--trace", "/nonexistent/dir/t.json"]), &["/nonexistent/dir/t.json: cannot write", "No such file"]);
}

/// `--host-cores`: gpt2-tiny planned into 4 stages, replayed as 4 threads on 2 cores, is
/// slower than on 4 devices; with as many cores as stages it is the same replay; the
/// cluster file's `host_cores` key does the same; a replay's own trace, read back with
/// `--stage-times` under the same sharing, gives back about the same rate (the durations
/// are converted back to full-speed work, not shared twice); 0 cores is refused.
#[test]
fn stages_sharing_host_cores_are_replayed_slower() {
    let gpt = model("gpt2-tiny");
    let gpt = gpt.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, pw_ok(&["plan", gpt, "--stages", "4", "--workers", "4", "--batch", "16", "--microbatch", "4", "--schedule", "2bw", "--json"])).unwrap();
    let p = plan.to_str().unwrap();
    let rates = |extra: &[&str]| -> Vec<f64> {
        let mut args = vec!["simulate", p, "--schedule", "2bw,gpipe", "--batches", "6", "--json"];
        args.extend_from_slice(extra);
        let v: Value = serde_json::from_str(&pw_ok(&args)).expect("JSON");
        v["outcomes"].as_array().unwrap().iter().map(|o| o["simulation"]["samples_per_s"].as_f64().unwrap()).collect()
    };
    let own = rates(&[]);
    let shared = rates(&["--host-cores", "2"]);
    assert_eq!(own.len(), 2);
    for (o, s) in own.iter().zip(&shared) {
        assert!(*s < 0.9 * o, "2 cores: {s} samples/s, 4 devices: {o}");
    }
    assert_eq!(rates(&["--host-cores", "4"]), own);
    let toml = dir.path().join("c.toml");
    std::fs::write(&toml, "workers = 4\nhost_cores = 2\n").unwrap();
    let from_file = rates(&["--cluster", toml.to_str().unwrap()]);
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, "workers = 4\n").unwrap();
    assert_eq!(from_file, rates(&["--cluster", plain.to_str().unwrap(), "--host-cores", "2"]));
    assert!(from_file.iter().zip(&rates(&["--cluster", plain.to_str().unwrap()])).all(|(s, o)| s < o));
    let text = pw_ok(&["simulate", p, "--host-cores", "2", "--batches", "2"]);
    assert!(text.lines().next().unwrap().ends_with("the stages' threads sharing 2 CPU core(s)"), "{text}");
    // The replay's trace as a measured run's: its sends now take the stage's thread for
    // their link time too, a mean stands for every step's update, and the conversion
    // back to full-speed work assumes ideal sharing where the replay takes time slices, so
    // the rate is close to, not exactly, the original; taking the shared durations as
    // they are, without converting them back, is further off.
    let t = dir.path().join("t.json");
    pw_ok(&["simulate", p, "--schedule", "2bw", "--batches", "6", "--host-cores", "2", "--trace", t.to_str().unwrap()]);
    let timed = rates(&["--stage-times", t.to_str().unwrap(), "--host-cores", "2"]);
    assert!((timed[0] / shared[0] - 1.0).abs() < 0.08, "{} replayed from its own trace, {} before", timed[0], shared[0]);
    let as_they_are = rates(&["--stage-times", t.to_str().unwrap()]);
    assert!((as_they_are[0] / shared[0] - 1.0).abs() > (timed[0] / shared[0] - 1.0).abs() + 0.03, "{} unconverted, {} converted, {} before", as_they_are[0], timed[0], shared[0]);
    fails(&pw(&["simulate", p, "--host-cores", "0"]), &["--host-cores must be at least 1"]);
    std::fs::write(&toml, "workers = 4\nhost_cores = 0\n").unwrap();
    fails(&pw(&["simulate", p, "--cluster", toml.to_str().unwrap()]), &["c.toml: host_cores: 0 is not a number of cores"]);
}

/// `--reduction fixed-order` (the runtime's `--deterministic-reduce`) on a plan of 32
/// replicas over 4 servers: the report says so, the replicas' all-reduce takes far longer
/// than the rings' and the rate falls; a cluster file's `reduction` key makes the planner
/// choose with it (fewer replicas than with the rings).
#[test]
fn the_fixed_order_gradient_sum_is_charged_at_scale() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.onnx");
    gpt(&GptShape { layers: 4, ..GptShape::GPT2_SMALL }).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
    let p = path.to_str().unwrap();
    let cluster = |reduction: &str| {
        let toml = dir.path().join(format!("{reduction}.toml"));
        let text = format!("workers = 32\nworkers_per_node = 8\nmemory_per_worker = \"16GiB\"\nintra_bw = \"150GB/s\"\ninter_bw = \"25Gbit/s\"\nserver_bw = \"25Gbit/s\"\npeak_flops = \"125T\"\nreduction = \"{reduction}\"\n");
        std::fs::write(&toml, text).unwrap();
        toml.to_str().unwrap().to_string()
    };
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, pw_ok(&["plan", p, "--cluster", &cluster("collective"), "--stages", "1", "--schedule", "2bw", "--batch", "512", "--precision", "fp16", "--json"])).unwrap();
    let replay = |extra: &[&str]| -> Value {
        let mut args = vec!["simulate", plan.to_str().unwrap(), "--batches", "4", "--json"];
        args.extend_from_slice(extra);
        let v: Value = serde_json::from_str(&pw_ok(&args)).unwrap();
        v["outcomes"][0]["simulation"].clone()
    };
    let (rings, fixed) = (replay(&[]), replay(&["--reduction", "fixed-order"]));
    let allreduce = |s: &Value| s["stages"][0]["allreduce_s"].as_f64().unwrap();
    assert!(allreduce(&fixed) > 20.0 * allreduce(&rings), "{} vs {}", allreduce(&fixed), allreduce(&rings));
    assert!(fixed["samples_per_s"].as_f64().unwrap() < rings["samples_per_s"].as_f64().unwrap() / 2.0);
    let text = pw_ok(&["simulate", plan.to_str().unwrap(), "--batches", "2", "--reduction", "fixed-order"]);
    assert!(text.contains("gradient sums: fixed-order (every part gathered to the group's first rank"), "{text}");
    let width = |reduction: &str| -> u64 {
        let v: Value = serde_json::from_str(&pw_ok(&["plan", p, "--cluster", &cluster(reduction), "--schedule", "2bw", "--batch", "512", "--precision", "fp16", "--json"])).unwrap();
        v["chosen"]["w"].as_u64().unwrap()
    };
    assert!(width("fixed-order") < width("collective"));
    fails(&pw(&["simulate", plan.to_str().unwrap(), "--reduction", "tree"]), &["invalid value 'tree' for '--reduction <REDUCTION>'"]);
}

/// A device preset's report says what each kernel achieves (the published shares, no flat
/// efficiency), `--efficiency` overrides it; inter-layer model parallelism gets its own configuration, at least as fast
/// without pipelining as PipeDream-Flush's own.
#[test]
fn presets_achieve_their_published_shares_and_each_baseline_its_own_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.onnx");
    gpt(&GptShape { layers: 8, seq: 512, ..GptShape::GPT2_SMALL }).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
    let p = path.to_str().unwrap();
    let run = |extra: &[&str]| -> Value {
        let mut args = vec!["simulate", p, "--cluster", "V100-16GB", "--servers", "2", "--precision", "fp16", "--batch", "128", "--batches", "3", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(&pw_ok(&args)).unwrap()
    };
    let modelled = run(&["--schedule", "2bw,flush,model-parallel"]);
    let name = modelled["cluster"]["name"].as_str().unwrap();
    assert!(name.contains("achievable: GEMM 0.66 of peak before tile and wave quantization, memory 0.90 of bandwidth, at least 5 µs per kernel"), "{name}");
    assert_eq!(modelled["cluster"]["cluster"]["achievable"]["sms"], 80);
    let flat = run(&["--schedule", "2bw", "--efficiency", "1"]);
    assert!(flat["cluster"]["name"].as_str().unwrap().ends_with("efficiency 1"), "{}", flat["cluster"]["name"]);
    assert!(flat["cluster"]["cluster"]["achievable"].is_null());
    let rate = |v: &Value, scheme: &str| v["outcomes"].as_array().unwrap().iter().find(|o| o["scheme"] == scheme).unwrap()["simulation"]["samples_per_s"].as_f64().unwrap();
    assert!(rate(&modelled, "2bw") != rate(&flat, "2bw"));
    // PipeDream-Flush's configuration replayed without pipelining (as a plan file).
    let flush = modelled["outcomes"].as_array().unwrap().iter().find(|o| o["scheme"] == "flush").unwrap()["config"].clone();
    let (w, d, b) = (flush["w"].to_string(), flush["d"].to_string(), flush["b"].to_string());
    let toml = dir.path().join("v100.toml");
    std::fs::write(&toml, "workers = 16\nworkers_per_node = 8\nmemory_per_worker = \"16GiB\"\nintra_bw = \"150GB/s\"\ninter_bw = \"25Gbit/s\"\nserver_bw = \"25Gbit/s\"\npeak_flops = \"125T\"\nmem_bw = \"900GB/s\"\n").unwrap();
    let plan = dir.path().join("flush.json");
    let workers = (flush["w"].as_u64().unwrap() * flush["d"].as_u64().unwrap()).to_string();
    std::fs::write(&plan, pw_ok(&["plan", p, "--cluster", toml.to_str().unwrap(), "--workers", &workers, "--stages", &d, "--microbatch", &b, "--batch", "128", "--schedule", "flush", "--precision", "fp16", "--json"])).unwrap();
    let as_mp: Value = serde_json::from_str(&pw_ok(&["simulate", plan.to_str().unwrap(), "--cluster", "V100-16GB", "--servers", "2", "--precision", "fp16", "--schedule", "model-parallel", "--batches", "3", "--json"])).unwrap();
    let flush_as_mp = as_mp["outcomes"][0]["simulation"]["samples_per_s"].as_f64().unwrap();
    assert!(rate(&modelled, "model-parallel") >= flush_as_mp * (1.0 - 1e-9), "own {} vs Flush's w={w} d={d} b={b} {flush_as_mp}", rate(&modelled, "model-parallel"));
}
