//! The subcommands that execute models (libtorch): train, worker (and stage
//! executables), run-forward, bench-step, conformance and profile.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Result};
use pipewright_core::fs::write_atomic;
use pipewright_core::units::human_bytes;
use pipewright_driver::conformance::{report, run_all, totals};
use pipewright_driver::export::{save_weights, WEIGHTS_FILE};
use pipewright_passes::profile::{BatchSpread, Profile, StageSplit};
use pipewright_driver::forward::{bench_step, run_forward, save_outputs, verdict};
use pipewright_driver::profile::Progress as ProfileProgress;
use pipewright_driver::train::{Session, WorkerSession};
use pipewright_runtime::device::tch_device;
use pipewright_runtime::pipeline::{MpiJob, StepReport, TrainReport};
use pipewright_runtime::timeline::chrome_trace_json;

use crate::args::{BenchStepArgs, ConformanceArgs, ProfileArgs, RunForwardArgs, TrainArgs, WorkerArgs};
use crate::progress::Progress;

fn progress(args: &TrainArgs, first_step: usize) -> Result<Progress> {
    Progress::new(args.steps, first_step, args.log_every, args.no_progress, args.metrics.as_deref())
}

fn save_trace(path: Option<&Path>, report: &TrainReport) -> Result<()> {
    if let Some(path) = path {
        write_atomic(path, chrome_trace_json(&report.trace).as_bytes())?;
        eprintln!("wrote {} trace events to {}", report.trace.len(), path.display());
    }
    Ok(())
}

/// The first and last finite losses (a skipped step's loss may be NaN).
fn loss_range(report: &TrainReport) -> (f64, f64) {
    let mut finite = report.losses.iter().copied().filter(|l| l.is_finite());
    let first = finite.next().unwrap_or(f64::NAN);
    (first, finite.last().unwrap_or(first))
}

/// `stage 0 cuda:0, stage 1 cuda:1` (replica 0; every replica when they differ).
fn placement(cfg: &pipewright_runtime::pipeline::TrainConfig, depth: usize, replicas: usize) -> String {
    let name = |d: tch::Device| match d {
        tch::Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".to_string(),
    };
    let alike = (0..replicas).all(|r| (0..depth).all(|k| cfg.worker_device(k, r) == cfg.worker_device(k, 0)));
    let shown = if alike { 1 } else { replicas };
    let mut parts = Vec::new();
    for r in 0..shown {
        for k in 0..depth {
            let who = if alike { format!("stage {k}") } else { format!("replica {r} stage {k}") };
            parts.push(format!("{who} {}", name(cfg.worker_device(k, r))));
        }
    }
    parts.join(", ")
}

pub fn train(args: &TrainArgs) -> Result<()> {
    let session = Session::prepare(&args.build, &args.request()?)?;
    let c = &session.build.manifest.pipeline;
    eprint!("{}", session.shape.report());
    for line in session.build.manifest.choices.lines() {
        eprintln!("note: {line}");
    }
    eprintln!(
        "training {} stage(s) x {} replica(s), schedule {}, recompute {} (from the build), steps {}..{}",
        c.depth, session.shape.replicas.value, c.schedule, c.recompute, session.start, args.steps
    );
    if !session.config.devices.is_empty() {
        eprintln!("placement: {}", placement(&session.config, c.depth as usize, session.shape.replicas.value as usize));
    }
    // Trained weights of an earlier run are replaced: say so before and after.
    let weights = args.build.join(WEIGHTS_FILE);
    let replacing = weights.is_file();
    if replacing {
        eprintln!("note: {} exists (an earlier run's weights); this run replaces it when it ends", weights.display());
    }
    let mut progress = progress(args, session.start)?;
    let mut skipped = 0;
    let report = session.run(&mut |r: StepReport| {
        progress.step(&r);
        if r.skipped {
            skipped += 1;
            // Above the bar on a terminal, so it never runs into it.
            progress.println(&format!("step {}: skipped (a loss or gradient was not finite; every stage kept its weights and optimizer state)", r.step + 1));
        }
    })?;
    progress.finish();
    save_trace(args.trace.as_deref(), &report)?;
    for p in &report.checkpoints {
        eprintln!("wrote checkpoint {}", p.display());
    }
    save_weights(&weights, &report)?;
    eprintln!("wrote {}{}", weights.display(), if replacing { " (replacing the earlier run's weights)" } else { "" });
    let (first, last) = loss_range(&report);
    let skipped = if skipped > 0 { format!(" ({skipped} skipped)") } else { String::new() };
    println!(
        "trained {} steps{skipped} in {:.1}s: loss {first:.4} -> {last:.4}; weight versions held per stage (peak): {:?}",
        report.losses.len(),
        progress.started.elapsed().as_secs_f64(),
        report.peak_versions
    );
    let peaks: Vec<String> = report.memory.iter().map(|m| human_bytes(m.total)).collect();
    println!("peak live tensor bytes per stage: {}", peaks.join(", "));
    Ok(())
}

/// `pipewright worker`, or a stage executable started with options (`embedded`: its own
/// module): one rank of an MPI job. Any error stops every rank (MPI_Abort) once printed.
pub fn worker(args: &WorkerArgs, embedded: Option<Vec<u8>>) -> Result<()> {
    let job = MpiJob::start(Duration::from_secs(args.heartbeat_timeout)).map_err(|e| anyhow!("{e}"))?;
    match worker_rank(args, embedded, &job) {
        Ok(()) => {
            let who = job.who(job.rank());
            job.finish().map_err(|e| anyhow!("{who}: {e}"))
        }
        Err(e) => {
            eprintln!("error: {e}");
            job.abort(1)
        }
    }
}

fn worker_rank(args: &WorkerArgs, embedded: Option<Vec<u8>>, job: &MpiJob) -> Result<()> {
    let t = &args.train;
    let session = WorkerSession::prepare(&t.build, &args.request()?, embedded, job)?;
    let (rank, stage, replica, depth) = (session.rank, session.stage, session.replica, session.depth);
    // One write, so the launcher does not interleave it with other ranks' lines.
    let line = format!("rank {rank}: stage {stage} of {depth}, replica {replica} of {}, pid {}\n", session.shape.replicas.value, std::process::id());
    eprint!("{line}");
    // One job, one result: the reporting rank alone shows progress and writes metrics.
    let reports = session.reports_steps;
    let replicas = session.shape.replicas.value;
    if reports {
        eprint!("{}", session.shape.report());
    }
    let start = session.start;
    let mut progress = if reports { progress(t, start)? } else { Progress::new(t.steps, start, t.log_every, true, None)? };
    let outcome = session.run(&mut |r: StepReport| progress.step(&r))?;
    progress.finish();
    let report = &outcome.report;
    // Every rank traces its own stage: `t.json` becomes `t.rank1.json` on rank 1.
    let trace = t.trace.as_ref().map(|p| p.with_extension(format!("rank{rank}.{}", p.extension().and_then(|e| e.to_str()).unwrap_or("json"))));
    save_trace(trace.as_deref(), report)?;
    for p in &report.checkpoints {
        eprintln!("rank {rank}: wrote checkpoint {}", p.display());
    }
    if let Some(all) = &outcome.job {
        let weights = t.build.join(WEIGHTS_FILE);
        save_weights(&weights, all)?;
        eprintln!("rank {rank}: wrote every stage's weights to {}", weights.display());
    }
    if reports {
        let (first, last) = loss_range(report);
        println!(
            "trained {} steps in {:.1}s over {depth} stage(s) x {} replica(s): loss {first:.4} -> {last:.4}",
            report.losses.len(),
            progress.started.elapsed().as_secs_f64(),
            replicas
        );
    }
    let peak = report.memory.first().map_or(0, |m| m.total);
    let versions = report.peak_versions.first().copied().unwrap_or(0);
    println!("rank {rank} (stage {stage}, replica {replica}): peak live tensor bytes {}, weight versions held (peak) {versions}", human_bytes(peak));
    Ok(())
}

pub fn run_forward_command(args: &RunForwardArgs) -> Result<()> {
    let device = tch_device(args.device)?;
    let outputs = run_forward(&args.model, &args.inputs, device, args.tile_batch, args.rtol, args.atol)?;
    for (i, out) in outputs.iter().enumerate() {
        let t = &out.tensor;
        print!("output {i} {:?}: {:?} {:?}", out.name, t.kind(), t.size());
        if let Ok(Ok(m)) = t.f_to_kind(tch::Kind::Double).and_then(|d| d.f_mean(tch::Kind::Double)).map(f64::try_from) {
            print!(" mean={m:.6}");
        }
        match &out.comparison {
            Some(c) => println!(" max_abs_err={:.3e} relative={:.3e} mismatches={}/{}", c.max_abs_err, c.relative(), c.mismatches, c.numel),
            None => println!(),
        }
    }
    if let Some(path) = &args.save {
        save_outputs(path, &outputs)?;
        println!("saved {} output(s) to {}", outputs.len(), path.display());
    }
    let v = verdict(&outputs, &args.inputs, args.rtol, args.atol);
    for line in &v.lines {
        println!("{line}");
    }
    if !v.matched {
        anyhow::bail!("{}: the outputs differ from the expected ones (see above)", args.model.display());
    }
    Ok(())
}

pub fn bench_step_command(args: &BenchStepArgs) -> Result<()> {
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let device = tch_device(args.device)?;
    let s = bench_step(&args.model, &args.inputs, device, args.train, args.warmup, args.steps)?;
    let threads = tch::get_num_threads();
    let name = args.model.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    println!(
        "{name}: {} parameters in {} weight tensors, {} steps after {} warmup, mode {}",
        s.parameter_values,
        s.parameters,
        s.steps,
        args.warmup,
        if args.train { "train" } else { "eval" }
    );
    println!("median {:.3} ms/step, mean {:.3} ms/step, min {:.3} ms, threads {threads}", s.median_ms, s.mean_ms, s.min_ms);
    println!("bench-step model={name} median_ms={:.3} mean_ms={:.3} threads={threads}", s.median_ms, s.mean_ms);
    Ok(())
}

pub fn conformance(args: &ConformanceArgs) -> Result<()> {
    let rows = run_all(&args.suites, args.filter.as_deref())?;
    let text = report(&rows);
    match &args.report {
        Some(path) => write_atomic(path, text.as_bytes())?,
        None => print!("{text}"),
    }
    let (p, f, k) = totals(&rows);
    eprintln!("conformance: {p} passed, {f} failed, {k} skipped");
    Ok(())
}

/// A spread of the repetitions' totals, relative to their median, above which `profile`
/// warns that the measurements are unreliable.
const NOISY_SPREAD: f64 = 0.25;

/// One batch size's whole-model time over the repetitions, with a warning when they
/// spread too far.
fn report_spread(s: &BatchSpread) {
    eprintln!(
        "profile: batch {}: forward + backward {:.3} ms (median of {} repetitions; min {:.3}, max {:.3}: spread {:.0}%)",
        s.batch,
        s.median_ms,
        s.reps,
        s.min_ms,
        s.max_ms,
        s.relative() * 100.0
    );
    if s.relative() > NOISY_SPREAD {
        eprintln!("profile: warning: batch {}: the repetitions differ by more than {:.0}%; the machine looks busy (rerun idle, or with more --reps)", s.batch, NOISY_SPREAD * 100.0);
    }
}

/// How the stages of a split divided the pass against their nodes timed alone.
fn report_split(p: &Profile, sp: &StageSplit) {
    let Some(k) = p.batches.iter().position(|&b| b == sp.batch) else { return };
    let text = |v: Option<Vec<f64>>| v.map_or("-".to_string(), |v| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / "));
    let (fwd, bwd) = sp.stage_scales(&p.nodes, k);
    eprintln!(
        "profile: trained as {} stages, each stage's share of the pass over its nodes' timed alone: forward {}, backward {}, at batch {}",
        sp.stages.len(),
        text(fwd),
        text(bwd),
        sp.batch
    );
}

pub fn profile(args: &ProfileArgs) -> Result<()> {
    let mut on_progress = |p: ProfileProgress<'_>| match p {
        ProfileProgress::Batch(s) => report_spread(s),
        ProfileProgress::Skipped { what, why } => eprintln!("profile: warning: {what} was not measured: {why}"),
        ProfileProgress::Unsteady(why) => eprintln!("profile: warning: {why}: the machine looks busy or its speed moved (rerun idle); the simulator's crowding comes from these times"),
    };
    let p = pipewright_driver::profile::profile(&args.model, args.device, &args.batch, args.reps, args.seed, (args.loss.loss, args.loss.output.as_deref()), &mut on_progress)?;
    for c in &p.boundary {
        eprintln!("profile: a stage boundary costs {:.3} ms forward, {:.3} ms backward (per microbatch) and {:.3} ms per update, at batch {}", c.fwd_ms, c.bwd_ms, c.step_ms, c.batch);
        if let Some(ms) = c.after_backward_ms {
            eprintln!("profile: after each backward a stage's runtime works {ms:.3} ms outside its traced operations, at batch {}", c.batch);
        }
    }
    for sp in &p.split {
        report_split(&p, sp);
    }
    if let Some(spread) = pipewright_passes::machine::DurationSpread::new(&p.duration_factors) {
        let f = spread.factors();
        let at = |q: f64| f[((f.len() - 1) as f64 * q).round() as usize];
        eprintln!("profile: a stage's forwards and backwards take {:.2} to {:.2} of its mean (10th to 90th percentile; the simulator draws from these)", at(0.1), at(0.9));
    }
    if let Some(ms) = p.accumulate_ms {
        eprintln!("profile: accumulating a gradient of every weight takes {ms:.3} ms (each microbatch of a step but the first)");
    }
    if let Some(s) = &p.sharing {
        let b = p.batches.iter().copied().max().unwrap_or(1);
        let c = s.crowding(b);
        eprintln!("profile: threads crowding the {} cores slow each other by {:.2} ({} threads) and {:.2} ({}), at batch {b}", s.cores, c.at_cores, s.cores, c.at_twice, 2 * s.cores);
        if let Some(turn) = s.turn_ms {
            eprintln!("profile: a thread that never blocks keeps a core for {turn:.2} ms while others wait (the scheduler's tick in the replays)");
        }
    }
    let text = serde_json::to_string_pretty(&p).map_err(|e| anyhow!("profile: {e}"))?;
    match &args.output {
        Some(path) => write_atomic(path, text.as_bytes())?,
        None => println!("{text}"),
    }
    Ok(())
}
