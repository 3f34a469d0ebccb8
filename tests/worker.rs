//! Multi-process pipelines on MPI: `pipewright worker` ranks (SPMD) and stage executables
//! (MPMD) started by `mpirun` train exactly like the embedded executor (the same loss at
//! every step and the same weights, bit for bit, under every schedule, with stages and
//! replicas; where a worker runs several stages, their ranks take turns in its order), and `pipewright export` reads what they trained; ranks started
//! differently are refused before the first step; a killed or frozen rank stops the whole
//! job within 30 s, naming who and what; multi-process checkpoints resume bit-identically,
//! also after a kill and on the embedded executor.
#![cfg(feature = "torch")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{command, fails, model, ok, root};
use pipewright_core::schedule::{worker_ops_from, Op};
use pipewright_core::Schedule;

fn data() -> PathBuf {
    root().join("examples/digits/digits.npz")
}

/// The options every rank and the embedded run get: `steps` steps of 4 microbatches (2BW
/// needs at least as many as stages).
fn options(steps: usize) -> Vec<String> {
    let data = data();
    let steps = steps.to_string();
    let v = [
        "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", &steps, "--microbatch", "8",
        "--microbatches", "4", "--optimizer", "adam", "--lr", "0.003", "--clip-norm", "1.0", "--no-progress",
        // Bit-identical results need the same intra-op thread count on both sides
        // (parallel reductions inside kernels sum in a thread-dependent order).
        "--threads", "1",
    ];
    v.iter().map(|s| s.to_string()).collect()
}

fn compile(out: &Path, stages: usize, schedule: &str, executables: bool) {
    let mut c = command();
    c.args(["compile", model("mlp").to_str().unwrap(), "--stages", &stages.to_string(), "--schedule", schedule, "-o"]).arg(out);
    if executables {
        c.arg("--executables");
    }
    ok(&c.output().unwrap());
}

/// The flags `pipewright launch` gives mpirun on this machine (the one place they live).
fn mpirun_flags(build: &Path) -> Vec<String> {
    let line = ok(&command().arg("launch").arg(build).arg("--dry-run").output().unwrap());
    let words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    assert_eq!(words[0], "mpirun", "{line}");
    let np = words.iter().position(|w| w == "-np").unwrap();
    words[1..np].to_vec()
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

/// What a run left: the loss of every step, the build's weights (taken away, so the
/// next run writes its own) and the model `pipewright export` wrote from them.
struct Run {
    losses: Vec<f64>,
    weights: Vec<(String, Vec<u8>)>,
    onnx: Vec<u8>,
    /// A launched job's standard output (its reporting rank's summary).
    stdout: String,
}

fn finish(build: &Path, metrics: &Path) -> Run {
    let onnx = build.join("exported.onnx");
    ok(&command().arg("export").arg(build).arg("-o").arg(&onnx).output().unwrap());
    let path = build.join("weights.safetensors");
    let run = Run { losses: losses(metrics), weights: tensors(&path), onnx: std::fs::read(&onnx).unwrap(), stdout: String::new() };
    std::fs::remove_file(&path).unwrap();
    run
}

fn embedded(build: &Path, extra: &[&str]) -> Run {
    let metrics = build.join("embedded.jsonl");
    ok(&command().arg("train").arg(build).args(options(8)).args(extra).arg("--metrics").arg(&metrics).output().unwrap());
    finish(build, &metrics)
}

/// `pipewright launch BUILD [--executables] -- OPTIONS`: an MPI job of stages x replicas ranks.
fn launched(build: &Path, executables: bool, extra: &[&str]) -> Run {
    let metrics = build.join("mpi.jsonl");
    let mut c = command();
    c.arg("launch").arg(build);
    if executables {
        c.arg("--executables");
    }
    let stdout = ok(&c.arg("--").args(options(8)).args(extra).arg("--metrics").arg(&metrics).output().unwrap());
    // One job, one result: a single rank reports the loss.
    assert_eq!(stdout.matches("trained ").count(), 1, "{stdout}");
    Run { stdout, ..finish(build, &metrics) }
}

fn same(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.losses.len(), 8, "{what}");
    assert_eq!(a.losses, b.losses, "{what}: the loss of every step must be the embedded executor's");
    assert_eq!(a.weights.len(), b.weights.len(), "{what}");
    assert!(a.weights == b.weights, "{what}: the weights must be the embedded executor's, bit for bit");
    // Export reads what rank 0 wrote: the same model as after the embedded run.
    assert!(a.onnx == b.onnx, "{what}: export after the MPI run must equal export after the embedded run");
}

#[test]
fn two_ranks_and_stage_executables_train_like_the_embedded_executor_under_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["2bw", "flush", "gpipe", "zb-h1", "zb-h2"] {
        let build = dir.path().join(schedule);
        let executables = schedule == "2bw" || schedule == "zb-h1";
        compile(&build, 2, schedule, executables);
        let one = embedded(&build, &[]);
        let spmd = launched(&build, false, &[]);
        same(&one, &spmd, &format!("{schedule}, 2 ranks (SPMD)"));
        if executables {
            same(&one, &launched(&build, true, &[]), &format!("{schedule}, stage executables (MPMD)"));
        }
    }
}

/// Interleaved 1F1B and ZB-V over MPI: a rank per stage, and the ranks of one worker's
/// stages take turns. The job trains like the embedded executor bit for bit (SPMD, stage
/// executables, two replicas; four stages per worker on a generated GPT in 8 stages), and
/// the ranks' traces (one time origin, rank 0's clock) show each worker's forwards and
/// backwards one at a time, in the worker's order.
#[test]
fn ranks_sharing_a_worker_take_turns_in_its_order_and_train_like_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["interleaved-2", "zb-v"] {
        let build = dir.path().join(name);
        compile(&build, 4, name, name == "zb-v");
        let one = embedded(&build, &[]);
        let trace = dir.path().join(format!("{name}.json"));
        same(&one, &launched(&build, false, &["--trace", trace.to_str().unwrap()]), &format!("{name}, 4 stages on 2 workers (SPMD)"));
        if name == "zb-v" {
            same(&one, &launched(&build, true, &[]), &format!("{name}, stage executables (MPMD)"));
        } else {
            same(&embedded(&build, &["--replicas", "2"]), &launched(&build, false, &["--replicas", "2"]), &format!("{name}, 4 stages x 2 replicas"));
        }
        ranks_take_turns(&trace, name.parse().unwrap(), 4, 8);
    }
    // Four stages per worker: 8 ranks, each worker's 3 peers telling it of every turn.
    let model = dir.path().join("gpt.onnx");
    ok(&command().args(["synth", "gpt", "--preset", "tiny", "-o"]).arg(&model).output().unwrap());
    let build = dir.path().join("interleaved-4");
    ok(&command().arg("compile").arg(&model).args(["--stages", "8", "--schedule", "interleaved-4", "-o"]).arg(&build).output().unwrap());
    let opts = ["--steps", "3", "--microbatch", "2", "--microbatches", "4", "--optimizer", "sgd", "--threads", "1", "--no-progress", "--metrics"];
    let one = build.join("e.jsonl");
    ok(&command().arg("train").arg(&build).args(opts).arg(&one).output().unwrap());
    let one = finish(&build, &one);
    let trace = dir.path().join("interleaved-4.json");
    let job = build.join("m.jsonl");
    ok(&command().arg("launch").arg(&build).arg("--").args(opts).arg(&job).args(["--trace", trace.to_str().unwrap()]).output().unwrap());
    let job = finish(&build, &job);
    assert_eq!(one.losses.len(), 3);
    assert_eq!(one.losses, job.losses, "interleaved-4, 8 stages on 2 workers");
    assert!(one.weights == job.weights, "interleaved-4, 8 stages on 2 workers: the weights must be the embedded executor's, bit for bit");
    ranks_take_turns(&trace, Schedule::Interleaved4, 8, 3);
}

/// Per worker of a one-replica job of `depth` stages traced to `trace` (4 microbatches per
/// batch, `steps` batches): its ranks' forwards and backwards, merged by time, never
/// overlap and are the worker's order.
fn ranks_take_turns(trace: &Path, schedule: Schedule, depth: usize, steps: usize) {
    for worker in 0..schedule.workers(depth).unwrap() {
        let mut spans: Vec<(f64, f64, usize, String, u64)> = Vec::new();
        for stage in schedule.stages_of(worker, depth) {
            // One replica: stage k is rank k.
            let file = trace.with_extension(format!("rank{stage}.json"));
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
            for e in v.as_array().unwrap().iter().filter(|e| ["forward", "backward", "backward-weight"].contains(&e["name"].as_str().unwrap())) {
                let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                spans.push((ts, ts + dur, stage, e["name"].as_str().unwrap().to_string(), e["args"]["microbatch"].as_u64().unwrap()));
            }
        }
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in spans.windows(2) {
            // The turn passes after an op ends and a note reaches the next rank; 5 us
            // covers the two processes' reading of the shared clock.
            assert!(pair[1].0 >= pair[0].1 - 5.0, "{schedule}, worker {worker}: {:?} began before {:?} ended", pair[1], pair[0]);
        }
        let ran: Vec<(usize, String, u64)> = spans.into_iter().map(|(_, _, k, what, mb)| (k, what, mb)).collect();
        let order: Vec<(usize, String, u64)> = worker_ops_from(schedule, worker, depth, 4, 0, steps)
            .unwrap()
            .into_iter()
            .filter_map(|(k, op)| match op {
                Op::Forward(j) => Some((k, "forward".to_string(), j)),
                Op::Backward(j) | Op::BackwardInput(j) => Some((k, "backward".to_string(), j)),
                Op::BackwardWeight(j) => Some((k, "backward-weight".to_string(), j)),
                Op::Step(_) => None,
            })
            .collect();
        assert_eq!(ran, order, "{schedule}, worker {worker}: the ranks' ops by time must be the worker's order");
    }
}

#[test]
fn four_stages_and_two_stages_by_two_replicas_train_like_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    let four = dir.path().join("four");
    compile(&four, 4, "2bw", false);
    let trace = dir.path().join("t.json");
    same(&embedded(&four, &[]), &launched(&four, false, &["--trace", trace.to_str().unwrap()]), "2bw, 4 ranks = 4 stages");
    // Each rank traces its own stage into its own file.
    for r in 0..4 {
        let t = dir.path().join(format!("t.rank{r}.json"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&t).unwrap_or_else(|e| panic!("{}: {e}", t.display()))).unwrap();
        assert!(v.to_string().contains("forward"), "{}", t.display());
    }
    // Every schedule, both 4-rank shapes (the 2BW 4-stage case is above).
    for schedule in ["2bw", "flush", "gpipe", "zb-h1", "zb-h2"] {
        if schedule != "2bw" {
            let four = dir.path().join(format!("four-{schedule}"));
            compile(&four, 4, schedule, false);
            same(&embedded(&four, &[]), &launched(&four, false, &[]), &format!("{schedule}, 4 ranks = 4 stages"));
        }
        let two = dir.path().join(format!("two-{schedule}"));
        compile(&two, 2, schedule, false);
        same(&embedded(&two, &["--replicas", "2"]), &launched(&two, false, &["--replicas", "2"]), &format!("{schedule}, 4 ranks = 2 stages x 2 replicas"));
    }
}

/// Stage executables (MPMD) on 2 stages x 2 replicas: `launch --executables` lists each
/// stage once, on as many consecutive ranks as replicas (ranks are stage-major), and the job
/// equals the embedded executor bit for bit; executables listed replica by replica (the
/// replica-major order) are refused, naming the rank and the order expected.
#[test]
fn stage_executables_with_two_replicas_train_like_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", true);
    let (s0, s1) = (build.join("stage0"), build.join("stage1"));
    let line = ok(&command().arg("launch").arg(&build).args(["--executables", "--dry-run", "--", "--replicas", "2"]).output().unwrap());
    assert!(line.contains(&format!("-np 2 {} --replicas 2 : -np 2 {} --replicas 2", s0.display(), s1.display())), "{line}");
    same(&embedded(&build, &["--replicas", "2"]), &launched(&build, true, &["--replicas", "2"]), "2bw, stage executables (MPMD), 2 stages x 2 replicas");
    // Replica by replica: rank 1 gets stage 1's executable, but runs stage 0 of replica 1.
    let mut c = Command::new("mpirun");
    c.args(mpirun_flags(&build));
    for (i, exe) in [&s0, &s1, &s0, &s1].into_iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-np", "1"]).arg(exe).args(options(2)).args(["--replicas", "2"]);
    }
    fails(&c.output().unwrap(), &["rank 1 (stage 0, replica 1): this executable holds stage 1, but MPI rank 1 runs stage 0 (rank = stage x 2 replicas + replica)", "each with -np 2"]);
}

/// A build compiled replica-major (`compile --placement replica-major`, as a plan that
/// chose it records) numbers its ranks replica by replica: `launch --executables` lists
/// each replica's stages in order, one rank each; the SPMD and MPMD jobs on 2 stages x 2
/// replicas equal the embedded executor bit for bit under 2BW and Flush; the stage-major
/// MPMD order is refused, naming the rank and the order expected.
#[test]
fn a_replica_major_build_numbers_its_ranks_replica_by_replica() {
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["2bw", "flush"] {
        let build = dir.path().join(schedule);
        ok(&command().args(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "--schedule", schedule, "--placement", "replica-major", "--executables", "-o"]).arg(&build).output().unwrap());
        let (s0, s1) = (build.join("stage0"), build.join("stage1"));
        let line = ok(&command().arg("launch").arg(&build).args(["--executables", "--dry-run", "--", "--replicas", "2"]).output().unwrap());
        let want = format!("-np 1 {a} --replicas 2 : -np 1 {b} --replicas 2 : -np 1 {a} --replicas 2 : -np 1 {b} --replicas 2", a = s0.display(), b = s1.display());
        assert!(line.contains(&want), "{line}");
        let one = embedded(&build, &["--replicas", "2"]);
        same(&one, &launched(&build, false, &["--replicas", "2"]), &format!("{schedule}, replica-major, 2 stages x 2 replicas (SPMD)"));
        same(&one, &launched(&build, true, &["--replicas", "2"]), &format!("{schedule}, replica-major, 2 stages x 2 replicas (MPMD)"));
        if schedule == "2bw" {
            // Stage by stage: rank 1 gets stage 0's executable, but runs stage 1 of replica 0.
            let mut c = Command::new("mpirun");
            c.args(mpirun_flags(&build));
            c.args(["-np", "2"]).arg(&s0).args(options(2)).args(["--replicas", "2", ":", "-np", "2"]).arg(&s1).args(options(2)).args(["--replicas", "2"]);
            fails(&c.output().unwrap(), &["rank 1 (stage 1, replica 0): this executable holds stage 0, but MPI rank 1 runs stage 1 (replica-major: rank = replica x 2 stages + stage)", "with -np 1 each, once per replica (2 times)"]);
        }
    }
}

/// Every setting of the run record (everything that decides the result), given to one rank
/// of an MPMD line with another value than to the other, is refused at start-up naming
/// the setting, both values and both ranks, before any step (`--on-nonfinite` used to
/// deadlock at step 1, `--label-smoothing` and `--ignore-index` to train with the last
/// stage's value). The table is checked against the record's keys, so that a setting
/// added to the record is added here too.
#[test]
fn ranks_started_with_different_settings_are_refused_before_the_first_step() {
    use std::collections::BTreeSet;
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let data = data();
    let held_out = data.to_str().unwrap();
    // (record key, option and the other value given to rank 1, the key the refusal names
    // first: a different batch shape or seed changes the first batch's fingerprint too,
    // and "--data" sorts first).
    let flags: &[(&str, &[&str], &str)] = &[
        ("--optimizer", &["--optimizer", "sgd"], "--optimizer"),
        ("--lr", &["--lr", "0.01"], "--lr"),
        ("--momentum", &["--momentum", "0.5"], "--momentum"),
        ("--weight-decay", &["--weight-decay", "0.1"], "--weight-decay"),
        ("--clip-norm", &["--clip-norm", "2.0"], "--clip-norm"),
        ("--warmup", &["--warmup", "1"], "--warmup"),
        ("--decay", &["--decay", "cosine"], "--decay"),
        ("--steps", &["--steps", "20"], "--steps"),
        ("--seed", &["--seed", "1"], "--data"), // the seed shuffles the data
        ("--loss", &["--loss", "mse"], "--loss"),
        ("--ignore-index", &["--ignore-index", "0"], "--ignore-index"),
        ("--label-smoothing", &["--label-smoothing", "0.1"], "--label-smoothing"),
        ("--precision", &["--precision", "bf16"], "--precision"),
        ("--on-nonfinite", &["--on-nonfinite", "skip"], "--on-nonfinite"),
        ("--max-skips", &["--max-skips", "5"], "--max-skips"),
        ("--microbatch", &["--microbatch", "4"], "--data"),
        ("--microbatches", &["--microbatches", "2"], "--data"),
        ("--data", &["--microbatch", "2"], "--data"),
        // Evaluation needs its set; rank 0 has none, which sorts first.
        ("--eval-data", &["--eval-data", held_out], "--eval-data"),
        ("--eval-every", &["--eval-data", held_out, "--eval-every", "2"], "--eval-data"),
    ];
    // Not options: fixed in this pipewright (the same on every rank), or checked by the
    // job's layout before the settings (`--replicas`: the rank count).
    let not_options = ["beta1", "beta2", "eps", "loss scale", "final lr", "mode", "--replicas"];
    let cfg = pipewright_runtime::pipeline::TrainConfig::new(pipewright_core::Schedule::TwoBw, pipewright_runtime::pipeline::Objective::new(pipewright_core::Loss::CrossEntropy, "y"), 0.1, 1);
    let mut record: BTreeSet<String> = pipewright_runtime::pipeline::run_record(&cfg).into_keys().collect();
    // The driver's settings: the batch shape, the data and the evaluation.
    record.extend(["--microbatch", "--microbatches", "--data", "--eval-data", "--eval-every"].map(String::from));
    let covered: BTreeSet<String> = flags.iter().map(|f| f.0.to_string()).chain(not_options.map(String::from)).collect();
    assert_eq!(covered, record, "every setting of the run record is tried here (or said not to be an option)");
    let rank = |extra: &[&str]| -> Vec<String> {
        let mut v = vec!["-np".to_string(), "1".into(), env!("CARGO_BIN_EXE_pipewright").into(), "worker".into(), build.display().to_string()];
        let mut o = options(10);
        for pair in extra.chunks(2) {
            match o.iter().position(|a| a == pair[0]) {
                Some(i) => o[i + 1] = pair[1].to_string(),
                None => o.extend(pair.iter().map(|s| s.to_string())),
            }
        }
        v.extend(o);
        v.extend(["--log-every".to_string(), "1".into()]);
        v
    };
    for (key, extra, named) in flags {
        let mut line = rank(&[]);
        line.push(":".into());
        line.extend(rank(extra));
        let out = Command::new("mpirun").args(mpirun_flags(&build)).args(&line).output().unwrap();
        let err = fails(&out, &["the ranks were started with different settings: rank 1 (stage 1, replica 0) has ", &format!(" where rank 0 (stage 0, replica 0) has {named} ")]);
        assert!(!err.contains("step     1/"), "{key}: no step may run: {err}");
        assert!(!build.join("weights.safetensors").exists(), "{key}: a refused job writes no weights");
    }
}

/// A job of 2 ranks training for long, its stderr read as it comes; the ranks' process ids.
struct Job {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: String,
    pids: Vec<u32>,
}

fn long_job(build: &Path, extra: &[&str]) -> Job {
    let mut c = command();
    c.arg("launch").arg(build).arg("--").args(options(1_000_000)).args(["--log-every", "1"]).args(extra);
    watch(c)
}

/// [`long_job`] as an MPMD line, each rank with options of its own.
fn long_mpmd_job(build: &Path, per_rank: [&[&str]; 2]) -> Job {
    let mut c = Command::new("mpirun");
    c.args(mpirun_flags(build));
    for (r, extra) in per_rank.iter().enumerate() {
        if r > 0 {
            c.arg(":");
        }
        c.args(["-np", "1", env!("CARGO_BIN_EXE_pipewright"), "worker"]).arg(build).args(options(1_000_000)).args(["--log-every", "1"]).args(*extra);
    }
    watch(c)
}

/// Starts `c` and reads its stderr until both ranks have said who they are and training
/// runs.
fn watch(c: Command) -> Job {
    watch_ranks(c, 2)
}

/// [`watch`] for a job of `ranks` ranks: reads until every one has said who it is (its
/// pid) and training runs.
fn watch_ranks(mut c: Command, ranks: usize) -> Job {
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let (tx, lines) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let mut job = Job { child, lines, seen: String::new(), pids: vec![0; ranks] };
    let deadline = Instant::now() + Duration::from_secs(60);
    while job.pids.contains(&0) || !job.seen.contains("step     3/") {
        let l = job.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap_or_else(|_| panic!("the job did not start:\n{}", job.seen));
        if let (Some(r), Some(p)) = (l.strip_prefix("rank ").and_then(|t| t.split(':').next()).and_then(|r| r.parse::<usize>().ok()), l.split("pid ").nth(1)) {
            if r >= job.pids.len() {
                job.pids.resize(r + 1, 0);
            }
            job.pids[r] = p.trim().parse().unwrap();
        }
        job.seen.push_str(&l);
        job.seen.push('\n');
    }
    job
}

impl Job {
    /// Waits for the job to end (at most `limit`): its exit status, all it printed and how
    /// long it took.
    fn end(self, limit: Duration) -> (bool, String, Duration) {
        let (code, seen, took) = self.end_code(limit);
        (code == Some(0), seen, took)
    }

    /// [`Job::end`] with the exit code (`None`: ended by a signal).
    fn end_code(mut self, limit: Duration) -> (Option<i32>, String, Duration) {
        let t0 = Instant::now();
        loop {
            while let Ok(l) = self.lines.try_recv() {
                self.seen.push_str(&l);
                self.seen.push('\n');
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(200));
                while let Ok(l) = self.lines.try_recv() {
                    self.seen.push_str(&l);
                    self.seen.push('\n');
                }
                return (status.code(), self.seen, t0.elapsed());
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                for p in &self.pids {
                    let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
                }
                panic!("the job still runs after {limit:?} (a hang):\n{}", self.seen);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn gone(pid: u32) -> bool {
    // A process that has ended (or is a zombie no one waits for any more) is no longer running.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.split(") ").nth(1).is_some_and(|rest| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[test]
fn a_killed_rank_stops_every_rank_within_30_s_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let job = long_job(&build, &[]);
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-9", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    // The launcher names the rank that died; the survivor says who it is and what it did.
    assert!(seen.contains("process rank 1") && seen.contains("signal 9"), "{seen}");
    assert!(seen.contains("rank 0 (stage 0, replica 0): stopped by SIGTERM"), "{seen}");
    assert!(pids.iter().all(|&p| gone(p)), "every rank must have ended: {pids:?}");
}

#[test]
fn a_frozen_rank_stops_every_rank_within_30_s_naming_it_and_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let job = long_job(&build, &[]);
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-STOP", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    assert!(seen.contains("rank 0 (stage 0, replica 0): rank 1 (stage 1, replica 0) sent no heartbeat for 10 s"), "{seen}");
    // What rank 0 waited for depends on when rank 1 stopped: a microbatch's gradients, or
    // its part of the gradient-norm sum (--clip-norm); either names rank 1.
    assert!(seen.contains("sent no heartbeat for 10 s (frozen or gone; --heartbeat-timeout) while waiting for ") && seen.contains("from rank 1 (stage 1, replica 0)"), "{seen}");
    assert!(pids.iter().all(|&p| gone(p)), "every rank must have ended, the frozen one too: {pids:?}");
}

/// A rank stopped (SIGSTOP) for longer than its heartbeat timeout and then woken says that
/// it was itself stopped, rather than blaming its healthy neighbour, and the job stops.
/// (Rank 0 waits 60 s for heartbeats here, so that it is rank 1 that speaks first.)
#[test]
fn a_woken_rank_says_it_was_stopped_itself() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let job = long_mpmd_job(&build, [&["--heartbeat-timeout", "60"], &["--heartbeat-timeout", "3"]]);
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-STOP", &pids[1].to_string()]).status().unwrap().success());
    std::thread::sleep(Duration::from_secs(5));
    assert!(Command::new("kill").args(["-CONT", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    assert!(seen.contains("rank 1 (stage 1, replica 0): this rank was itself stopped for "), "{seen}");
    assert!(!seen.contains("rank 0 (stage 0, replica 0) sent no heartbeat"), "the woken rank blamed its neighbour:\n{seen}");
    assert!(pids.iter().all(|&p| gone(p)), "every rank must have ended: {pids:?}");
}

/// An MPI job holds its build folder (rank 0 takes the lock): a `train` of the same build
/// is refused naming the job's rank 0, and a second MPI job is refused by its rank 0 in
/// one line that names the rank; the first job goes on until it is stopped.
#[test]
fn a_second_job_on_an_mpi_jobs_build_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let job = long_job(&build, &[]);
    let pids = job.pids.clone();
    let holder = format!("{} is in use by another job (worker (rank 0 of an MPI job): host ", build.display());
    fails(&command().args(["train", build.to_str().unwrap(), "--steps", "2"]).output().unwrap(), &[&holder, &format!("pid {}", pids[0])]);
    let mut second = command();
    second.arg("launch").arg(&build).arg("--").args(options(2));
    let out = second.output().unwrap();
    let err = fails(&out, &[&holder]);
    let line = err.lines().find(|l| l.contains(&holder)).unwrap_or_default();
    assert!(line.starts_with("error: rank 0: "), "one line naming the rank: {err}");
    assert!(!err.contains("error: error:"), "{err}");
    assert!(Command::new("kill").args(["-9", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, _) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
}

#[test]
fn multi_process_checkpoints_resume_bit_identically_even_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let ck = dir.path().join("ck");
    let ck_arg = ck.to_str().unwrap();
    let whole = launched(&build, false, &["--checkpoint-every", "4", "--checkpoint-dir", ck_arg]);
    // Each rank wrote its stage; rank 0 committed the manifest.
    let step4 = ck.join("step-000004");
    for f in ["checkpoint.json", "stage0.safetensors", "stage1.safetensors"] {
        assert!(step4.join(f).is_file(), "{f} missing");
    }
    let resumed = launched(&build, false, &["--resume", step4.to_str().unwrap()]);
    assert_eq!(resumed.losses, whole.losses[4..], "the resumed steps must repeat the uninterrupted run's losses");
    assert!(resumed.weights == whole.weights, "resuming from a multi-process checkpoint must reach the uninterrupted run's weights");
    // The embedded executor resumes from the same checkpoint to the same weights.
    let embedded_resumed = embedded(&build, &["--resume", step4.to_str().unwrap()]);
    assert!(embedded_resumed.weights == whole.weights, "the embedded executor must read what the ranks wrote");
    // And the ranks resume from what the embedded executor wrote.
    let eck = dir.path().join("embedded-ck");
    let _ = embedded(&build, &["--checkpoint-every", "4", "--checkpoint-dir", eck.to_str().unwrap()]);
    let from_embedded = launched(&build, false, &["--resume", eck.join("step-000004").to_str().unwrap()]);
    assert!(from_embedded.weights == whole.weights, "the ranks must read what the embedded executor wrote");

    // A job killed mid-run leaves complete checkpoints only; the newest resumes to what an
    // uninterrupted run of as many steps reaches.
    let killed = dir.path().join("killed");
    let job = long_job(&build, &["--checkpoint-every", "2", "--checkpoint-dir", killed.to_str().unwrap()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !killed.join("step-000006").is_dir() {
        assert!(Instant::now() < deadline, "no checkpoint after a minute");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-9", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, _) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    let text = std::fs::read_to_string(newest(&killed).join("checkpoint.json")).unwrap();
    let step: usize = serde_json::from_str::<serde_json::Value>(&text).unwrap()["step"].as_u64().unwrap() as usize;
    let more = (step + 4).to_string();
    let metrics = build.join("resumed.jsonl");
    // The killed run asked for a million steps: --force resumes it for fewer (a constant
    // learning rate does not depend on the total).
    let out = command().arg("launch").arg(&build).arg("--").args(options(step + 4)).args(["--resume", killed.to_str().unwrap(), "--force", "--metrics"]).arg(&metrics).output().unwrap();
    ok(&out);
    let after_kill = finish(&build, &metrics);
    let uninterrupted_metrics = build.join("uninterrupted.jsonl");
    let out = command().arg("launch").arg(&build).arg("--").args(options(step + 4)).arg("--metrics").arg(&uninterrupted_metrics).output().unwrap();
    ok(&out);
    let uninterrupted = finish(&build, &uninterrupted_metrics);
    assert_eq!(after_kill.losses, uninterrupted.losses[step..], "steps {step}..{more}");
    assert!(after_kill.weights == uninterrupted.weights, "resuming the killed job must reach the uninterrupted run's weights");
}

/// Ctrl-C to `pipewright launch` (with and without replicas): every rank stops after the
/// same step, rank 0 writes that step's checkpoint and prints the exact launch line that
/// resumes from it, the weights are saved, launch exits with 130 and no rank is left; the
/// losses before the stop are the uninterrupted run's, and resuming reaches its weights.
#[test]
fn ctrl_c_to_launch_stops_every_rank_at_one_step_and_resumes_bit_identically() {
    for extra in [&[][..], &["--replicas", "2"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        compile(&build, 2, "2bw", false);
        let ck = dir.path().join("ck");
        let metrics = dir.path().join("stopped.jsonl");
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["--checkpoint-every", "100000", "--checkpoint-dir", ck.to_str().unwrap(), "--metrics", metrics.to_str().unwrap()]);
        let job = long_job(&build, &args);
        let pids = job.pids.clone();
        assert!(Command::new("kill").args(["-INT", &job.child.id().to_string()]).status().unwrap().success());
        let (code, seen, _) = job.end_code(Duration::from_secs(60));
        assert_eq!(code, Some(130), "{extra:?}: {seen}");
        let line = seen.lines().find_map(|l| l.strip_prefix("rank 0: stopped by a signal after step ")).unwrap_or_else(|| panic!("{seen}"));
        let step: usize = line.split(' ').next().unwrap().parse().unwrap();
        let checkpoint = ck.join(format!("step-{step:06}"));
        assert!(seen.contains(&format!("rank 0: the last checkpoint is {}", checkpoint.display())), "{seen}");
        let resume = seen.lines().find_map(|l| l.strip_prefix("rank 0: resume with: ")).unwrap_or_else(|| panic!("{seen}"));
        assert!(resume.contains(" launch ") && resume.ends_with(&format!("--resume {}", checkpoint.display())), "{resume}");
        assert!(build.join("weights.safetensors").is_file(), "{extra:?}: the weights were saved\n{seen}");
        assert!(pids.iter().all(|&p| gone(p)), "{extra:?}: a rank is left\n{seen}");
        let stopped = losses(&metrics);
        assert_eq!(stopped.len(), step, "{extra:?}: one metrics line per step trained");

        let more = options(step + 2);
        let resumed_metrics = build.join("resumed.jsonl");
        let out = command().arg("launch").arg(&build).arg("--").args(&more).args(extra).args(["--resume", checkpoint.to_str().unwrap(), "--force", "--metrics"]).arg(&resumed_metrics).output().unwrap();
        ok(&out);
        let resumed = finish(&build, &resumed_metrics);
        let whole_metrics = build.join("whole.jsonl");
        ok(&command().arg("launch").arg(&build).arg("--").args(&more).args(extra).arg("--metrics").arg(&whole_metrics).output().unwrap());
        let whole = finish(&build, &whole_metrics);
        assert_eq!(stopped[..], whole.losses[..step], "{extra:?}: the losses before the stop");
        assert_eq!(resumed.losses[..], whole.losses[step..], "{extra:?}: the losses after resuming");
        assert!(resumed.weights == whole.weights, "{extra:?}: resuming the stopped job must reach the uninterrupted run's weights");
    }
}

/// With replicas the ranks of replica 0 (ranks 0 and 2 of a stage-major 2 x 2 job, not 0
/// and 1) write the checkpoint, and the embedded executor resumes from it to the job's
/// weights.
#[test]
fn checkpoints_of_two_stages_by_two_replicas_resume_on_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    let ck = dir.path().join("ck");
    let whole = launched(&build, false, &["--replicas", "2", "--checkpoint-every", "4", "--checkpoint-dir", ck.to_str().unwrap()]);
    let step4 = ck.join("step-000004");
    for f in ["checkpoint.json", "stage0.safetensors", "stage1.safetensors"] {
        assert!(step4.join(f).is_file(), "{f} missing");
    }
    let resumed = embedded(&build, &["--replicas", "2", "--resume", step4.to_str().unwrap()]);
    assert_eq!(resumed.losses, whole.losses[4..], "the resumed steps must repeat the job's losses");
    assert!(resumed.weights == whole.weights, "the embedded executor must resume the 2 x 2 job's checkpoint to its weights");
}

/// The newest complete step folder of a checkpoint folder.
fn newest(dir: &Path) -> PathBuf {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("step-")).collect();
    steps.sort();
    steps.pop().unwrap()
}

/// The weights of `a` and `b` agree within `rel` of each tensor's largest magnitude (every
/// weight is f32).
fn close(a: &Run, b: &Run, rel: f32, what: &str) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}");
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert!((x - y).abs() <= rel as f64 * x.abs().max(1.0), "{what}: losses {:?} and {:?}", a.losses, b.losses);
    }
    let floats = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    for ((n, x), (m, y)) in a.weights.iter().zip(&b.weights) {
        assert_eq!(n, m, "{what}");
        let (x, y) = (floats(x), floats(y));
        let scale = x.iter().fold(0f32, |s, v| s.max(v.abs())).max(1e-12);
        let gap = x.iter().zip(&y).fold(0f32, |g, (p, q)| g.max((p - q).abs()));
        assert!(gap <= rel * scale, "{what}: weight {n} differs by {gap} (largest magnitude {scale})");
    }
}

/// Eight ranks on two cores (oversubscribed), 4 stages x 2 replicas and 2 stages x 4
/// replicas, under every schedule. A stage's two replicas add alike in either order, so
/// MPI's all-reduce (the default) is bit-identical to the embedded executor there; over
/// four replicas MPI adds in an order of its own: `--deterministic-reduce` (the fixed
/// order) is bit-identical, the default agrees within fp32 rounding.
#[test]
fn eight_ranks_train_like_the_embedded_executor_under_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["2bw", "flush", "gpipe"] {
        let four = dir.path().join(format!("four-{schedule}"));
        compile(&four, 4, schedule, false);
        let two = ["--replicas", "2"];
        same(&embedded(&four, &two), &launched(&four, false, &two), &format!("{schedule}, 8 ranks = 4 stages x 2 replicas"));
        let two_stages = dir.path().join(format!("two-{schedule}"));
        compile(&two_stages, 2, schedule, false);
        let one = embedded(&two_stages, &["--replicas", "4"]);
        let what = format!("{schedule}, 8 ranks = 2 stages x 4 replicas");
        same(&one, &launched(&two_stages, false, &["--replicas", "4", "--deterministic-reduce"]), &format!("{what}, --deterministic-reduce"));
        close(&one, &launched(&two_stages, false, &["--replicas", "4"]), 1e-4, &format!("{what}, MPI's all-reduce"));
    }
}

/// A replica that stalls (alive: its heartbeat goes on) leaves the other waiting in the
/// gradient sum: the wait ends after `--timeout` naming the stalled rank (or, when it
/// stalled after beginning the sum, saying that every member had begun it), and the job
/// stops.
#[test]
fn a_rank_stalled_in_the_gradient_sum_stops_the_job_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    ok(&command().args(["compile", model("mlp").to_str().unwrap(), "--stages", "1", "-o"]).arg(&build).output().unwrap());
    let job = long_job(&build, &["--replicas", "2", "--timeout", "3", "--heartbeat-timeout", "120"]);
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-STOP", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    let line = seen.lines().find(|l| l.starts_with("error: rank 0 (stage 0, replica 0): stage 0: waited 3 s (--timeout) for ")).unwrap_or_else(|| panic!("rank 0's error:\n{seen}"));
    assert!(line.contains("rank 1 (stage 0, replica 1)") || line.ends_with("every member had begun it, and MPI did not complete it"), "{line}");
    assert!(pids.iter().all(|&p| gone(p)), "every rank must have ended: {pids:?}");
}

/// Under 2BW the replicas' gradient sum of step t goes on in the background (MPI's
/// non-blocking all-reduce) while step t + 1 computes, since the update made from it is
/// first used by the forwards of step t + 2: in rank 0's trace every all-reduce span but
/// the last overlaps a forward of the next step, and the job is still the embedded
/// executor's bit for bit. Under PipeDream-Flush the next forward needs the update at
/// once, and no span overlaps one.
#[test]
fn under_2bw_the_gradient_sum_overlaps_the_next_steps_compute() {
    let dir = tempfile::tempdir().unwrap();
    for (schedule, overlapping) in [("2bw", 7), ("flush", 0)] {
        let build = dir.path().join(schedule);
        compile(&build, 2, schedule, false);
        let trace = dir.path().join(format!("{schedule}.json"));
        let extra = ["--replicas", "2"];
        let one = embedded(&build, &extra);
        let job = launched(&build, false, &["--replicas", "2", "--trace", trace.to_str().unwrap()]);
        same(&one, &job, &format!("{schedule}, 2 stages x 2 replicas, traced"));
        let rank0 = dir.path().join(format!("{schedule}.rank0.json"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&rank0).unwrap()).unwrap();
        let events = v.get("traceEvents").unwrap_or(&v).as_array().unwrap().clone();
        let spans = |name: &str| -> Vec<(f64, f64, u64)> {
            events.iter().filter(|e| e["ph"] == "X" && e["name"] == name).map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(), e["args"]["step"].as_u64().unwrap())).collect()
        };
        let (sums, forwards) = (spans("allreduce"), spans("forward"));
        assert_eq!(sums.len(), 8, "{schedule}: one gradient sum per step");
        let overlaps = sums.iter().filter(|&&(s, e, t)| forwards.iter().any(|&(fs, fe, ft)| ft == t + 1 && fs < e && fe > s)).count();
        assert_eq!(overlaps, overlapping, "{schedule}: gradient sums overlapping the next step's forwards: {sums:?}");
    }
}

/// The evaluations a run wrote to its metrics: (step, loss, accuracy).
fn evaluations(metrics: &Path) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(metrics).unwrap_or_else(|e| panic!("{}: {e}", metrics.display()));
    let lines = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    lines.filter(|l| l.get("eval_loss").is_some()).map(|l| (l["step"].as_u64().unwrap(), l["eval_loss"].as_f64().unwrap(), l["eval_accuracy"].as_f64().unwrap())).collect()
}

/// Evaluation during training runs forward through replica 0's ranks (each rank's main
/// thread, while its stage trains on): under every schedule, on 2 and 4 stages and on 2
/// stages x 2 replicas, the job's evaluations are the embedded executor's bit for bit
/// (so onnxruntime's, by `tests/eval.rs`), the reporting rank prints them, and training
/// is unchanged (the same losses and weights as the embedded run).
#[test]
fn evaluation_over_mpi_equals_the_embedded_executors() {
    let dir = tempfile::tempdir().unwrap();
    let data = data();
    let eval = ["--eval-data", data.to_str().unwrap(), "--eval-every", "3", "--eval-batches", "3"];
    for (stages, schedule, replicas) in [(2, "2bw", "1"), (2, "flush", "1"), (2, "gpipe", "1"), (4, "2bw", "1"), (2, "2bw", "2")] {
        let what = format!("{schedule}, {stages} stages x {replicas} replica(s)");
        let build = dir.path().join(format!("{stages}-{schedule}-{replicas}"));
        compile(&build, stages, schedule, false);
        let extra: Vec<&str> = eval.iter().copied().chain(["--replicas", replicas]).collect();
        let one = embedded(&build, &extra);
        let want = evaluations(&build.join("embedded.jsonl"));
        assert_eq!(want.iter().map(|e| e.0).collect::<Vec<_>>(), [3, 6, 8], "{what}: the embedded run's evaluations");
        let job = launched(&build, false, &extra);
        same(&one, &job, &what);
        assert_eq!(evaluations(&build.join("mpi.jsonl")), want, "{what}: the job's evaluations must be the embedded executor's");
        assert!(job.stdout.contains(&format!("eval after step 8: loss {:.4}", want[2].1)), "{what}: the summary repeats the last evaluation:\n{}", job.stdout);
    }
}

#[test]
fn a_stage_of_another_compile_and_a_wrong_rank_count_are_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "flush", false);
    let run = |np: &str, words: &[&str]| {
        let mut c = Command::new("mpirun");
        c.args(mpirun_flags(&build)).args(["-np", np, env!("CARGO_BIN_EXE_pipewright"), "worker"]).arg(&build).args(options(4));
        fails(&c.output().unwrap(), words)
    };
    run("3", &["the launcher started 3 processes but the job has 2 (2 stages x 1 replicas)"]);
    // Without a launcher: a job of one rank, told how to start the pipeline.
    let out = command().arg("worker").arg(&build).args(options(4)).output().unwrap();
    fails(&out, &["this process is a job of one rank, but the pipeline has 2", "pipewright launch"]);
    let other = dir.path().join("other");
    // A different schedule makes a different compile.
    ok(&command().args(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "--schedule", "gpipe", "-o"]).arg(&other).output().unwrap());
    std::fs::copy(other.join("stage1.pwm"), build.join("stage1.pwm")).unwrap();
    run("2", &["rank 1 (stage 1, replica 0):", "stage1.pwm"]);
}

/// A GPT whose output projection is tied to its token embedding (stages 0 and 1 hold a
/// copy each and sum their gradients), on 2 stages x 2 replicas: the tied-weight and the
/// replica reductions together, equal to the embedded executor.
#[test]
fn tied_weights_over_two_replicas_match_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gpt.onnx");
    ok(&command().args(["synth", "gpt", "--preset", "tiny", "-o"]).arg(&model).output().unwrap());
    let build = dir.path().join("build");
    ok(&command().arg("compile").arg(&model).args(["--stages", "2", "--schedule", "2bw", "-o"]).arg(&build).output().unwrap());
    let opts = ["--steps", "3", "--microbatch", "2", "--microbatches", "2", "--replicas", "2", "--threads", "1", "--no-progress", "--metrics"];
    let run = |args: &[&str], metrics: &str| -> Run {
        let m = build.join(metrics);
        ok(&command().args(args).arg(&build).args(if args[0] == "launch" { &["--"][..] } else { &[][..] }).args(opts).arg(&m).output().unwrap());
        finish(&build, &m)
    };
    let one = run(&["train"], "e.jsonl");
    let job = run(&["launch"], "m.jsonl");
    assert_eq!(one.losses.len(), 3);
    assert_eq!(one.losses, job.losses);
    assert!(one.weights == job.weights, "tied weights over MPI must equal the embedded executor's");
}

/// gpt2-tiny in 4 stages holds two tied groups that overlap: the LayerNorm weights the
/// exporter merged, on every stage, and the token embedding on stages 0 and 3. Each group's
/// reductions are counted apart (counted together per kind, stage 0's second sum of a step
/// was taken for the next step's by the stages in one group only, and a
/// `--deterministic-reduce` job stopped at its first step): under MPI's all-reduce and the
/// fixed order, Flush, interleaved 1F1B (whose ranks also take turns) and 2BW (whose sums
/// go on in the background on both sides, its updates deferred; with `--clip-norm` made
/// by every stage at one point of its order) train like the embedded executor (bit for
/// bit in the fixed order). The summary names the workers as `train`'s does.
#[test]
fn overlapping_tied_groups_over_mpi_match_the_embedded_executor() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ["--steps", "3", "--microbatch", "2", "--microbatches", "4", "--optimizer", "sgd", "--threads", "1", "--no-progress", "--metrics"];
    // ZB-H2: split backwards; the stages after the first form their tied gradients with
    // the input gradients and begin their sums after the last (MPI's all-reduce) or make
    // them at the step (the fixed order).
    for schedule in ["flush", "interleaved-2", "2bw", "zb-h2"] {
        let build = dir.path().join(schedule);
        ok(&command().arg("compile").arg(model("gpt2-tiny")).args(["--stages", "4", "--microbatch", "2", "--schedule", schedule, "-o"]).arg(&build).output().unwrap());
        let run = |launch: bool, extra: &[&str], metrics: &str| -> Run {
            let m = build.join(metrics);
            let mut c = command();
            if launch {
                c.arg("launch").arg(&build).arg("--");
            } else {
                c.arg("train").arg(&build);
            }
            let stdout = ok(&c.args(extra).args(opts).arg(&m).output().unwrap());
            let workers = if schedule == "interleaved-2" { "4 stage(s) on 2 worker(s) x 1" } else { "4 stage(s) x 1" };
            assert!(stdout.contains(&format!("trained 3 steps under {schedule} over {workers} replica(s)")), "{stdout}");
            finish(&build, &m)
        };
        let one = run(false, &[], "e.jsonl");
        assert_eq!(one.losses.len(), 3);
        // MPI's all-reduce adds the four stages' parts in an order of its own; the fixed
        // order adds them as the embedded executor does, bit for bit.
        close(&one, &run(true, &[], "m.jsonl"), 1e-5, &format!("{schedule}, MPI's all-reduce"));
        let fixed = run(true, &["--deterministic-reduce"], "m.jsonl");
        assert_eq!(one.losses, fixed.losses, "{schedule}, --deterministic-reduce");
        assert!(one.weights == fixed.weights, "{schedule}, --deterministic-reduce: tied weights over MPI must equal the embedded executor's");
        if schedule == "2bw" {
            let clipped = ["--clip-norm", "0.5", "--timeout", "60"];
            close(&run(false, &clipped, "ec.jsonl"), &run(true, &clipped, "mc.jsonl"), 1e-5, "2bw --clip-norm, MPI's all-reduce");
        }
    }
}

/// A neighbour that is alive (its heartbeat goes on) but sends nothing: the wait ends after
/// `--timeout` with an error naming what was awaited and from whom, and the job stops.
#[test]
fn a_wait_longer_than_the_timeout_stops_the_job_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "flush", false);
    // A heartbeat timeout far above --timeout: the frozen rank is caught by the wait's deadline.
    let job = long_job(&build, &["--timeout", "3", "--heartbeat-timeout", "120"]);
    let pids = job.pids.clone();
    assert!(Command::new("kill").args(["-STOP", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    // Stopped at any moment: rank 0 then waits for a microbatch's gradients or for the
    // stopped rank's part of the step's gradient-norm sum (--clip-norm).
    assert!(seen.contains("error: rank 0 (stage 0, replica 0): stage 0: waited 3 s (--timeout) for "), "{seen}");
    assert!(seen.contains("from rank 1 (stage 1, replica 0), which sent nothing"), "{seen}");
    assert!(pids.iter().all(|&p| gone(p)), "every rank must have ended: {pids:?}");
}

/// A 2-stage checkpoint folder holds its manifest and both stages' parts.
fn assert_whole_checkpoint(dir: &Path, what: &str) {
    for file in ["checkpoint.json", "stage0.safetensors", "stage1.safetensors"] {
        assert!(dir.join(file).is_file(), "{what}: {} lacks {file}", dir.display());
    }
}

/// Two "hosts" on this machine: network namespaces joined by a veth pair, each with an
/// address of its own, and an Open MPI launch agent (in place of ssh) that starts a
/// host's daemon inside its namespace. Removed (with the veth pair) when dropped.
struct TwoHosts {
    names: [String; 2],
    addresses: [String; 2],
    dir: tempfile::TempDir,
}

impl TwoHosts {
    /// Needs root (CAP_NET_ADMIN): a test that cannot make them fails saying so.
    fn new() -> TwoHosts {
        // One pair per test, tests of this process running at once.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = (std::process::id() % 1_000) * 10 + MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let names = [format!("pw{id}a"), format!("pw{id}b")];
        let subnet = format!("10.{}.{}", 100 + id % 100, id / 100 % 250);
        let addresses = [format!("{subnet}.1"), format!("{subnet}.2")];
        let ip = |args: &str| {
            let out = Command::new("ip").args(args.split_whitespace()).output().expect("the `ip` tool (iproute2) runs");
            assert!(out.status.success(), "ip {args}: {} (the two-host test makes network namespaces: it needs root, CAP_NET_ADMIN)", String::from_utf8_lossy(&out.stderr));
        };
        let hosts = TwoHosts { dir: tempfile::tempdir().unwrap(), names, addresses };
        let [a, b] = &hosts.names;
        ip(&format!("netns add {a}"));
        ip(&format!("netns add {b}"));
        ip(&format!("link add {a}v type veth peer name {b}v"));
        for (ns, addr) in hosts.names.iter().zip(&hosts.addresses) {
            ip(&format!("link set {ns}v netns {ns}"));
            ip(&format!("-n {ns} addr add {addr}/24 dev {ns}v"));
            ip(&format!("-n {ns} link set {ns}v up"));
            ip(&format!("-n {ns} link set lo up"));
        }
        let agent = format!(
            "#!/bin/sh\n# Open MPI's launch agent: [options] HOST COMMAND -> COMMAND in HOST's namespace.\nwhile [ \"${{1#-}}\" != \"$1\" ]; do shift; done\nhost=$1; shift\ncase $host in {} ) ns={a} ;; {} ) ns={b} ;; *) echo \"agent: no host $host\" >&2; exit 1 ;; esac\nexec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n",
            hosts.addresses[0], hosts.addresses[1]
        );
        std::fs::write(hosts.agent(), agent).unwrap();
        Command::new("chmod").arg("+x").arg(hosts.agent()).status().unwrap();
        std::fs::write(hosts.hostfile(), format!("{} slots=2\n{} slots=2\n", hosts.addresses[0], hosts.addresses[1])).unwrap();
        hosts
    }

    fn agent(&self) -> PathBuf {
        self.dir.path().join("agent.sh")
    }

    fn hostfile(&self) -> PathBuf {
        self.dir.path().join("hostfile")
    }

    /// `pipewright launch BUILD --hostfile H -- ...` started on the first host: ranks are
    /// placed `by` Open MPI's mapping policy (`slot`: fill a host first; `node`: round
    /// robin), and talk over TCP on the veth pair only.
    fn launch(&self, build: &Path, by: &str) -> Command {
        self.launch_on(build, by, &self.hostfile())
    }

    /// [`TwoHosts::launch`] with another hostfile.
    fn launch_on(&self, build: &Path, by: &str, hostfile: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[0], env!("CARGO_BIN_EXE_pipewright"), "launch"]).arg(build).arg("--hostfile").arg(hostfile).arg("--");
        let subnet = format!("{}/24", self.addresses[0]);
        c.env("OMPI_MCA_plm_rsh_agent", self.agent())
            .env("OMPI_MCA_oob_tcp_if_include", &subnet)
            .env("OMPI_MCA_btl_tcp_if_include", &subnet)
            .env("OMPI_MCA_btl", "tcp,self")
            .env("OMPI_MCA_rmaps_base_mapping_policy", by);
        c
    }

    /// The host (namespace) process `pid` runs in.
    fn host_of(&self, pid: u32) -> String {
        let out = Command::new("ip").args(["netns", "identify", &pid.to_string()]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A job over two hosts (network namespaces on this machine, see [`TwoHosts`]): stages on
/// different hosts (2 ranks, one per host), and replicas across hosts (2 stages x 2
/// replicas, ranks dealt round robin, so each stage's gradient sum crosses the link) equal
/// the embedded executor bit for bit, with checkpoints written by every rank and the
/// weights gathered to rank 0. A rank killed on one host stops the job on both within
/// 30 s, naming it.
#[test]
fn a_job_over_two_hosts_trains_like_one_host_and_a_kill_on_one_stops_both() {
    let hosts = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    // Round robin over the hosts: with 1 replica the two stages, with 2 the replicas of
    // each stage, are on different hosts; filling a host first puts stage 0's replicas on
    // one host and stage 1's on the other.
    for (replicas, by) in [("1", "node"), ("2", "node"), ("2", "slot")] {
        let what = format!("2 stages x {replicas} replica(s) over two hosts, ranks by {by}");
        let extra = ["--replicas", replicas];
        let one = embedded(&build, &extra);
        let metrics = build.join("hosts.jsonl");
        let checkpoints = dir.path().join(format!("ck-{replicas}-{by}"));
        let mut c = hosts.launch(&build, by);
        c.args(options(8)).args(extra).arg("--metrics").arg(&metrics).args(["--checkpoint-every", "4", "--checkpoint-dir"]).arg(&checkpoints);
        let stdout = ok(&c.output().unwrap());
        assert_eq!(stdout.matches("trained ").count(), 1, "{what}: {stdout}");
        same(&one, &finish(&build, &metrics), &what);
        // Each stage's part was written by its rank (one per host with one replica).
        for step in ["step-000004", "step-000008"] {
            assert_whole_checkpoint(&checkpoints.join(step), &what);
        }
    }
    // Where the ranks run, and a kill on the second host.
    let mut c = hosts.launch(&build, "node");
    c.args(options(1_000_000)).args(["--log-every", "1", "--timeout", "20"]);
    let job = watch(c);
    let pids = job.pids.clone();
    assert_eq!([hosts.host_of(pids[0]), hosts.host_of(pids[1])], hosts.names, "rank 0 on the first host, rank 1 on the second");
    assert!(Command::new("kill").args(["-9", &pids[1].to_string()]).status().unwrap().success());
    let (success, seen, took) = job.end(Duration::from_secs(60));
    assert!(!success, "{seen}");
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{seen}");
    assert!(seen.contains("rank 1 (stage 1, replica 0)"), "the message names the killed rank:\n{seen}");
    assert!(gone(pids[0]), "rank 0 must have ended");
    // A host nobody can reach: the launch agent (ssh's stand-in) names it, no rank starts,
    // and the job's error lists the hostfile's hosts to check.
    let nowhere = format!("{}.9", hosts.addresses[1].strip_suffix(".2").unwrap());
    let bad = dir.path().join("unreachable");
    std::fs::write(&bad, format!("{} slots=1\n{nowhere} slots=1\n", hosts.addresses[0])).unwrap();
    let mut c = hosts.launch_on(&build, "node", &bad);
    c.args(options(8));
    let err = fails(&c.output().unwrap(), &[&format!("agent: no host {nowhere}"), &format!("check that every host of {} ({}, {nowhere}) is reachable", bad.display(), hosts.addresses[0])]);
    assert!(!err.contains("step     1/"), "no step may run: {err}");
}

/// ZB-V over two hosts of two slots: `launch` gives each worker's two stages one host
/// (worker 0's stages 0 and 3 the first, worker 1's stages 1 and 2 the second), where
/// filling a host in rank order would split both workers; the job trains as the embedded
/// executor does, bit for bit.
#[test]
fn zb_v_over_two_hosts_keeps_each_workers_stages_on_one_host() {
    let hosts = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 4, "zb-v", false);
    let one = embedded(&build, &[]);
    let metrics = build.join("hosts.jsonl");
    let mut c = hosts.launch(&build, "slot");
    c.args(options(8)).arg("--metrics").arg(&metrics);
    ok(&c.output().unwrap());
    same(&one, &finish(&build, &metrics), "zb-v, 4 stages on 2 workers over two hosts");
    let mut c = hosts.launch(&build, "slot");
    c.args(options(1_000_000)).args(["--log-every", "1", "--timeout", "20"]);
    let mut job = watch_ranks(c, 4);
    let on: Vec<String> = job.pids.iter().map(|&p| hosts.host_of(p)).collect();
    let [a, b] = &hosts.names;
    assert_eq!(on, [a.as_str(), b, b, a], "ranks 0 to 3 (stages 0 to 3)");
    let pids = job.pids.clone();
    job.child.kill().unwrap();
    for p in pids {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
}

/// A small file system mounted for a test (tmpfs of `bytes`), unmounted when dropped.
struct SmallDisk {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Needs root (mount): a test that cannot make one fails saying so.
    fn new(bytes: u64) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        std::fs::create_dir(&path).unwrap();
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"]).arg(&path).output().expect("mount runs");
        assert!(out.status.success(), "mount tmpfs: {} (the full-disk test mounts a small file system: it needs root)", String::from_utf8_lossy(&out.stderr));
        SmallDisk { path, _dir: dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// A disk that fills while checkpointing (the checkpoint folder on a file system with room
/// for one checkpoint): the job ends with an error naming the rank that could not write
/// and its host, and the checkpoint written before stays whole (a run resumes from it).
#[test]
fn a_full_disk_while_checkpointing_ends_the_job_naming_rank_and_host_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    compile(&build, 2, "2bw", false);
    // One checkpoint's size, measured by writing one.
    let probe = dir.path().join("probe");
    ok(&command().arg("launch").arg(&build).arg("--").args(options(2)).args(["--checkpoint-every", "2", "--checkpoint-dir"]).arg(&probe).output().unwrap());
    let size: u64 = std::fs::read_dir(probe.join("step-000002")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let disk = SmallDisk::new(size * 3 / 2 + 16 * 1024);
    let out = command().arg("launch").arg(&build).arg("--").args(options(8)).args(["--checkpoint-every", "2", "--checkpoint-dir"]).arg(&disk.path).output().unwrap();
    let host = String::from_utf8_lossy(&Command::new("hostname").output().unwrap().stdout).trim().to_string();
    fails(&out, &["checkpoint step 4 was not written: rank ", &format!(" on host {host}: "), "No space left on device"]);
    let last = disk.path.join("step-000002");
    assert_whole_checkpoint(&last, "the last good checkpoint");
    assert!(!disk.path.join("step-000004").exists(), "no partial checkpoint is published");
    ok(&command().arg("train").arg(&build).args(options(8)).arg("--resume").arg(&last).output().unwrap());
}
