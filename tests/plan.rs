//! `pipewright plan` on every shared model under three fixed cluster descriptions
//! (insta snapshots of the candidates table and the chosen partition), plus the
//! partition pass as `--print-after partition` and the planner's bad-input errors.

mod common;

use common::{command, model, root};
#[cfg(feature = "torch")]
use common::{fails, pw, pw_ok};

/// `pipewright plan MODEL ARGS` for the shared model `name`: whether it succeeded, its
/// stdout and its stderr.
fn plan(name: &str, args: &[&str]) -> (bool, String, String) {
    let out = command().arg("plan").arg(model(name)).args(args).output().expect("runs pipewright");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

const MODELS: [&str; 6] = ["mlp", "gpt2-tiny", "bert-tiny", "vit-tiny", "mobilenet_v2", "resnet18"];

/// The paper's setting: one server of eight 16 GiB GPUs, global batch 512.
#[test]
fn plans_on_one_eight_gpu_server() {
    for name in MODELS {
        let (ok, out, err) = plan(name, &["--workers", "8", "--memory", "16GiB", "--batch", "512", "--top", "5"]);
        assert!(ok, "{name}: {err}");
        insta::assert_snapshot!(format!("server8_{name}"), out);
    }
}

/// Four stages forced on a small cluster from a TOML file, global batch 64.
#[test]
fn plans_with_four_stages_on_a_small_cluster() {
    let cluster = root().join("tests/data/cluster-small.toml");
    for name in MODELS {
        let (ok, out, err) = plan(name, &["--cluster", cluster.to_str().unwrap(), "--stages", "4", "--batch", "64", "--top", "5"]);
        assert!(ok, "{name}: {err}");
        insta::assert_snapshot!(format!("small4_{name}"), out);
    }
}

/// Two servers of four GPUs over a slow network, 2BW only, with a tight memory limit.
#[test]
fn plans_two_servers_2bw_tight_memory() {
    for name in MODELS {
        let (ok, out, err) = plan(name, &["--workers", "8", "--workers-per-node", "4", "--memory", "512MiB", "--inter-bw", "10Gbit/s",
            "--schedule", "2bw", "--batch", "256", "--top", "5",
        ]);
        assert!(ok, "{name}: {err}");
        insta::assert_snapshot!(format!("twoservers_{name}"), out);
    }
}

#[test]
fn print_after_partition_marks_every_node_with_its_stage() {
    let (ok, out, err) = plan("resnet18", &["--stages", "2", "--batch", "64", "--print-after", "partition"]);
    assert!(ok, "{err}");
    let nodes: Vec<&str> = out.lines().filter(|l| l.contains(" # n")).collect();
    assert!(nodes.iter().all(|l| l.contains(" stage=")), "a node without a stage");
    assert!(out.contains("StageBoundary[from=0, to=1]"), "no boundary in\n{out}");
    // resnet's residual adds: a skip tensor crossing the cut is forwarded too.
    assert!(nodes.iter().any(|l| l.contains("stage=1")) && nodes.iter().any(|l| l.contains("stage=0")));
}

/// A given stage count under interleaved 1F1B and ZB-V takes `stages / v` workers per
/// pipeline: 4 stages fit 2 workers, and 4 workers hold 2 replicas.
#[test]
fn given_stages_of_v_shaped_and_interleaved_schedules_fit_their_workers() {
    for schedule in ["zb-v", "interleaved-2"] {
        let (ok, out, err) = plan("mlp", &["--workers", "2", "--stages", "4", "--schedule", schedule, "--batch", "8", "--top", "1"]);
        assert!(ok, "{schedule}: {err}");
        assert!(out.contains("chosen: w=1 d=4 placement=stage-major b=") && out.contains(&format!("schedule={schedule} ")), "{out}");
        let (ok, out, err) = plan("mlp", &["--workers", "4", "--stages", "4", "--schedule", schedule, "--batch", "64", "--top", "20"]);
        assert!(ok, "{schedule}: {err}");
        // Table rows: rank, w, d, placement, ...
        let two_replicas = out.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(1..3) == Some(&["2", "4"][..]) && cols.contains(&schedule)
        });
        assert!(two_replicas, "no row with 2 replicas: {out}");
    }
}

#[test]
fn bad_planner_input_is_one_clear_error() {
    let cases: [(&[&str], &str); 5] = [
        (&["--memory", "lots"], "--memory: cannot parse \"lots\" as a byte size"),
        (&["--workers", "1", "--stages", "4", "--schedule", "zb-v"], "mlp.onnx: pass plan failed: invalid plan options: 4 stages need 2 workers but the cluster has 1"),
        (&["--cut", "no_such_node"], "mlp.onnx: pass plan failed: cut at unknown node \"no_such_node\""),
        (&["--schedule", "zigzag"], "invalid value 'zigzag' for '--schedule <SCHEDULE>': unknown schedule \"zigzag\""),
        (&["--balance", "profile"], "--balance profile needs --profile FILE"),
    ];
    for (extra, needle) in cases {
        let (ok, _, err) = plan("mlp", extra);
        assert!(!ok, "{extra:?} should fail");
        assert!(err.starts_with("error:") && err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn explicit_cuts_start_stages_at_the_named_nodes() {
    let (ok, out, err) = plan("mlp", &["--cut", "node_gelu", "--batch", "64", "--top", "1"]);
    assert!(ok, "{err}");
    assert!(out.contains("stage 1: 4 nodes [node_gelu .."), "{out}");
}

/// A measured profile from `pipewright profile` calibrates the plan.
#[cfg(feature = "torch")]
#[test]
fn a_measured_profile_drives_the_plan() {
    let dir = tempfile::tempdir().expect("temp dir");
    let profile = dir.path().join("mlp.json");
    let mlp = model("mlp");
    pw_ok(["profile", mlp.to_str().unwrap(), "--batch", "1,8", "--reps", "2", "-o", profile.to_str().unwrap()]);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&profile).unwrap()).expect("profile is JSON");
    assert_eq!(json["nodes"].as_array().map(|a| a.len()), Some(7));
    let args = ["--stages", "2", "--batch", "64", "--top", "1"];
    let (_, analytic, _) = plan("mlp", &args);
    let mut with = args.to_vec();
    with.extend(["--profile", profile.to_str().unwrap(), "--balance", "profile"]);
    let (ok, measured, err) = plan("mlp", &with);
    assert!(ok, "{err}");
    assert_ne!(analytic, measured, "the profile changed nothing");
}

/// `refine-profile` replaces a profile's split at the trace's microbatch by the stages'
/// times in a pipeline's trace: one entry per stage of the build, holding the stage's
/// nodes, and `plan` reads the result; a microbatch the profile did not measure, a build
/// that decided none, and a trace of another build are each one clear error.
#[cfg(feature = "torch")]
#[test]
fn a_pipelines_trace_refines_the_profiles_split() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let mlp = model("mlp");
    let mlp = mlp.to_str().unwrap();
    pw_ok(["profile", mlp, "--batch", "1,4", "--reps", "2", "-o", &path("p.json")]);
    let data = root().join("examples/digits/digits.npz");
    for (build, stages, schedule) in [("zbv", "4", "zb-v"), ("flush", "2", "flush")] {
        pw_ok(["compile", mlp, "--stages", stages, "--schedule", schedule, "-o", &path(build)]);
        pw_ok([
            "train", &path(build), "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3",
            "--steps", "3", "--microbatch", "4", "--microbatches", "4", "--trace", &path(&format!("{build}.trace.json")),
        ]);
    }
    let refine = |build: &str, trace: &str, extra: &[&str]| {
        let mut args = vec!["refine-profile".to_string(), path("p.json"), "--build".into(), path(build), "--trace".into(), path(trace), "-o".into(), path("r.json")];
        args.extend(extra.iter().map(|s| s.to_string()));
        pw(args)
    };
    fails(&refine("zbv", "zbv.trace.json", &[]), &["p.json", "zbv.trace.json", "the build decided no microbatch", "(--batch)"]);
    fails(&refine("zbv", "zbv.trace.json", &["--batch", "8"]), &["microbatch 8, which the profile did not measure (it has 1, 4)", "--batch 8"]);
    fails(&refine("flush", "zbv.trace.json", &["--batch", "4"]), &["the trace has a stage 2 but the build has 2 stage(s)"]);
    fails(&refine("zbv", "zbv.trace.json", &["--batch", "4", "--warmup", "3"]), &["no forward of stage 0 from step 3 on"]);
    assert!(!dir.path().join("r.json").exists(), "a failed refinement wrote its output");
    let out = refine("zbv", "zbv.trace.json", &["--batch", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("trained as 4 stages") && err.contains("at batch 4"), "{err}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path("r.json")).unwrap()).expect("refined profile is JSON");
    let splits = json["split"].as_array().expect("split");
    assert_eq!(splits.iter().filter(|s| s["batch"].as_u64() == Some(4)).count(), 1, "{splits:?}");
    let at4 = splits.iter().find(|s| s["batch"].as_u64() == Some(4)).unwrap();
    let stages = at4["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 4);
    let mut nodes: Vec<&str> = stages.iter().flat_map(|s| s["nodes"].as_array().unwrap().iter().filter_map(|n| n.as_str())).collect();
    nodes.sort_unstable();
    let mut profiled: Vec<&str> = json["nodes"].as_array().unwrap().iter().filter_map(|n| n["name"].as_str()).collect();
    profiled.sort_unstable();
    assert_eq!(nodes, profiled, "every profiled node in exactly one stage");
    // Each stage's time less its share of the boundaries and the loss as the profile timed
    // them; on a model this small that can reach 0 (then the split leaves that direction
    // unscaled), never below.
    assert!(stages.iter().all(|s| s["fwd_ms"].as_f64() >= Some(0.0) && s["bwd_ms"].as_f64() >= Some(0.0)), "{stages:?}");
    let (ok, out, err) = plan("mlp", &["--workers", "2", "--stages", "4", "--schedule", "zb-v", "--microbatch", "4", "--batch", "16", "--profile", &path("r.json")]);
    assert!(ok && out.contains("zb-v"), "{out}\n{err}");
    // An MPI run's trace comes as one file per rank: the same events split over two files
    // refine the profile as the one file did.
    let events: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(path("zbv.trace.json")).unwrap()).expect("trace is a JSON array");
    for (rank, stages) in [(0, [0, 3]), (1, [1, 2])] {
        let mine: Vec<&serde_json::Value> = events.iter().filter(|e| e["tid"].as_u64().is_some_and(|t| stages.contains(&t))).collect();
        std::fs::write(path(&format!("t.rank{rank}.json")), serde_json::to_vec(&mine).unwrap()).unwrap();
    }
    let by_ranks = pw(["refine-profile", &path("p.json"), "--build", &path("zbv"), "--trace", &path("t.rank0.json"), &path("t.rank1.json"), "--batch", "4", "-o", &path("r2.json")]);
    assert!(by_ranks.status.success(), "{}", String::from_utf8_lossy(&by_ranks.stderr));
    assert_eq!(std::fs::read(path("r2.json")).unwrap(), std::fs::read(path("r.json")).unwrap());
    fails(&pw(["refine-profile", &path("p.json"), "--build", &path("zbv"), "--trace", &path("t.rank0.json"), "--batch", "4"]), &["t.rank0.json", "no forward of stage 1"]);
}

/// With no cluster described, `plan` says in every output that it assumed the default
/// server of 8 V100-class GPUs (text: on stdout above the table; --json: on stderr, the
/// JSON on stdout staying parseable and carrying the cluster), and the table's columns
/// are explained under it; a described cluster gets no such note.
#[test]
fn plan_states_its_cluster_and_explains_its_columns() {
    let (ok, out, err) = plan("mlp", &["--top", "2"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("note: no cluster given, so the plan assumes the default: one server of 8 V100-class GPUs"), "{out}");
    assert!(out.contains("not this machine") && out.contains("--cluster FILE"), "{out}");
    assert!(out.contains("columns: w = replicas") && out.contains("d = pipeline depth") && out.contains("b = microbatch size") && out.contains("m = microbatches per step"), "{out}");
    let (ok, json, err) = plan("mlp", &["--top", "2", "--json"]);
    assert!(ok, "{err}");
    assert!(err.contains("no cluster given") && err.contains("V100"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).expect("--json prints JSON only");
    assert_eq!(v["cluster"]["workers"].as_u64(), Some(8));
    let (ok, out, err) = plan("mlp", &["--top", "2", "--workers", "2"]);
    assert!(ok, "{err}");
    assert!(!out.contains("no cluster given") && out.starts_with("planned for: 2 workers"), "{out}");
}

/// `profile` repeats each measurement and reports the spread: one stderr line per batch
/// size with the median, min and max of the whole model's forward + backward time over
/// the repetitions, and the same in the profile's `spread`.
#[cfg(feature = "torch")]
#[test]
fn profile_reports_the_spread_of_its_repetitions() {
    let dir = tempfile::tempdir().expect("temp dir");
    let profile = dir.path().join("mlp.json");
    let mlp = model("mlp");
    let mlp = mlp.to_str().unwrap();
    let out = pw(["profile", mlp, "--batch", "1,4,8", "--reps", "3", "-o", profile.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for b in [1, 4, 8] {
        assert!(err.lines().any(|l| l.starts_with(&format!("profile: batch {b}: forward + backward ")) && l.contains("(median of 3 repetitions; min ") && l.contains("spread")), "{err}");
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&profile).unwrap()).expect("profile is JSON");
    let spread = json["spread"].as_array().expect("spread");
    assert_eq!(spread.len(), 3);
    for (s, b) in spread.iter().zip([1, 4, 8]) {
        let f = |k: &str| s[k].as_f64().unwrap();
        assert_eq!((s["batch"].as_u64(), s["reps"].as_u64()), (Some(b), Some(3)));
        assert!(0.0 < f("min_ms") && f("min_ms") <= f("median_ms") && f("median_ms") <= f("max_ms"), "{s}");
    }
    // The whole model as one pass at each size, and every weight's update under each
    // optimizer.
    let whole = json["whole"].as_array().expect("whole");
    assert_eq!(whole.iter().map(|w| w["batch"].as_u64()).collect::<Vec<_>>(), [Some(1), Some(4), Some(8)]);
    assert!(whole.iter().all(|w| w["fwd_ms"].as_f64() > Some(0.0) && w["bwd_ms"].as_f64() > Some(0.0)), "{whole:?}");
    let updates = json["updates"].as_array().expect("updates");
    let names: std::collections::BTreeSet<&str> = updates.iter().filter_map(|u| u["name"].as_str()).collect();
    assert!(!updates.is_empty() && names.len() == updates.len(), "{updates:?}");
    for k in ["sgd_ms", "momentum_ms", "adam_ms"] {
        assert!(updates.iter().all(|u| u[k].as_f64() > Some(0.0)), "{k}: {updates:?}");
    }
    // All the weights updated in one step, under each optimizer.
    let step = &json["step"];
    for k in ["sgd_ms", "momentum_ms", "adam_ms"] {
        assert!(step[k].as_f64() > Some(0.0), "{k}: {step}");
    }
    // The whole pass run by 1, as many as the cores and twice as many threads at once, at
    // each size, on this host.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sharing = &json["sharing"];
    assert_eq!(sharing["cores"].as_u64(), Some(cores as u64), "{sharing}");
    let runs = sharing["runs"].as_array().expect("sharing runs");
    for b in [1, 4, 8] {
        let mut threads: Vec<u64> = runs.iter().filter(|r| r["batch"].as_u64() == Some(b)).filter_map(|r| r["threads"].as_u64()).collect();
        threads.sort_unstable();
        threads.dedup();
        assert_eq!(threads, [1, cores as u64, 2 * cores as u64].into_iter().collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>(), "batch {b}: {sharing}");
    }
    assert!(runs.iter().all(|r| r["pass_ms"].as_f64() > Some(0.0)), "{sharing}");
    // How long a thread that never blocks keeps a core while others wait: a scheduler's
    // turn, milliseconds (4 on this machine: its 250 Hz tick), and reported.
    assert!(sharing["turn_ms"].as_f64().is_some_and(|t| (0.1..100.0).contains(&t)), "{sharing}");
    assert!(err.contains("profile: a thread that never blocks keeps a core for "), "{err}");
    // A stage boundary's cost, timed at the smallest and the middle size (the model
    // trained as two stages less as one), and reported.
    let boundary = json["boundary"].as_array().expect("boundary");
    assert_eq!(boundary.iter().map(|c| c["batch"].as_u64()).collect::<Vec<_>>(), [Some(1), Some(4)], "{boundary:?}");
    for c in boundary {
        for k in ["fwd_ms", "bwd_ms", "step_ms"] {
            assert!(c[k].as_f64().is_some_and(|t| t.is_finite() && t >= 0.0), "{k}: {c}");
        }
        // The two-stage runs' untraced time after each backward: some, and far less than
        // the pass.
        assert!(c["after_backward_ms"].as_f64().is_some_and(|t| t > 0.0 && t < 50.0), "{c}");
    }
    assert!(err.contains("profile: after each backward a stage's runtime works "), "{err}");
    // From the two-stage runs, how the runtime divided the pass between the stages at
    // every size (8 too, where no boundary was costed): every node the profile timed in
    // one of the two, each stage's times, and reported.
    let nodes: std::collections::BTreeSet<&str> = json["nodes"].as_array().expect("nodes").iter().filter_map(|n| n["name"].as_str()).collect();
    let split = json["split"].as_array().expect("split");
    assert_eq!(split.iter().map(|s| s["batch"].as_u64()).collect::<Vec<_>>(), [Some(1), Some(4), Some(8)], "{split:?}");
    for s in split {
        let stages = s["stages"].as_array().expect("split stages");
        assert_eq!(stages.len(), 2, "{s}");
        let mut seen: Vec<&str> = stages.iter().flat_map(|st| st["nodes"].as_array().expect("stage nodes")).filter_map(|n| n.as_str()).collect();
        assert!(stages.iter().all(|st| st["nodes"].as_array().is_some_and(|n| !n.is_empty())), "{s}");
        seen.sort_unstable();
        assert_eq!(seen, nodes.iter().copied().collect::<Vec<_>>(), "{s}");
        for st in stages {
            for k in ["fwd_ms", "bwd_ms"] {
                assert!(st[k].as_f64().is_some_and(|t| t.is_finite() && t >= 0.0), "{k}: {st}");
            }
        }
        assert!(stages.iter().map(|st| st["fwd_ms"].as_f64().unwrap_or(0.0)).sum::<f64>() > 0.0, "{s}");
    }
    assert!(err.contains("profile: trained as 2 stages, each stage's share of the pass over its nodes' timed alone: forward "), "{err}");
    // In runs of the two stages overlapping, how each forward and backward spread about its
    // stage's mean: at most 64 quantiles, increasing, about 1 in the middle, and reported.
    let factors: Vec<f64> = json["duration_factors"].as_array().expect("duration_factors").iter().filter_map(|f| f.as_f64()).collect();
    assert!((2..=64).contains(&factors.len()) && factors.windows(2).all(|w| w[0] <= w[1]) && factors[0] > 0.0, "{factors:?}");
    assert!((0.5..2.0).contains(&factors[factors.len() / 2]), "{factors:?}");
    assert!(err.contains("profile: a stage's forwards and backwards take "), "{err}");
    assert!(err.contains("profile: a stage boundary costs ") && err.contains("profile: threads crowding the "), "{err}");
    // One accumulation of every weight's gradient, which a stage's backward pays for each
    // microbatch of a step but the first, and reported.
    assert!(json["accumulate_ms"].as_f64().is_some_and(|t| t.is_finite() && t > 0.0), "{}", json["accumulate_ms"]);
    assert!(err.contains("profile: accumulating a gradient of every weight takes "), "{err}");
    // The training loss (train's default, cross-entropy on the only output) at each size.
    let loss = &json["loss"];
    assert_eq!(loss["loss"].as_str(), Some("cross-entropy"), "{loss}");
    for k in ["fwd_ms", "bwd_ms"] {
        assert!(loss[k].as_array().is_some_and(|v| v.len() == 3 && v.iter().all(|x| x.as_f64() > Some(0.0))), "{loss}");
    }
    // A loss on an output the model does not have is named, with the outputs it has.
    fails(&pw(["profile", mlp, "--batch", "1", "--loss", "mse:nope"]), &["no output \"nope\"", "its outputs are"]);
    // The file still reads as a profile for the planner.
    let (ok, _, err) = plan("mlp", &["--stages", "2", "--batch", "64", "--top", "1", "--profile", profile.to_str().unwrap()]);
    assert!(ok, "{err}");
}
