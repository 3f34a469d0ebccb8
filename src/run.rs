//! The subcommands that execute models (libtorch): train, worker (and stage
//! executables), run-forward, bench-step, conformance and profile.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use pipewright_core::fs::write_atomic;
use pipewright_driver::conformance::{report, run_all, totals};
use pipewright_driver::export::{save_weights, WEIGHTS_FILE};
use pipewright_driver::forward::{bench_step_command, run_forward_command};
use pipewright_driver::profile::{notes, profile_json, refine_files, split_note, Progress as ProfileProgress};
use pipewright_driver::train::{eval_line, host_reads_line, off_device_line, loss_range, peak_memory_line, memory_peaks, save_trace, stages_text, stopped_job_lines, stopped_lines, MpiJob, Session, StepReport, StopGate, WorkerSession};

use crate::args::{BenchAllreduceArgs, BenchStepArgs, ConformanceArgs, ProfileArgs, RefineProfileArgs, RunForwardArgs, TrainArgs, WorkerArgs};
use crate::progress::Progress;

fn progress(args: &TrainArgs, first_step: usize) -> Result<Progress> {
    Progress::new(args.steps, first_step, args.log_every, args.no_progress, args.metrics.as_deref())
}

/// On the first SIGINT or SIGTERM, asks the run to stop at the next step boundary every
/// stage agrees on; on a second, exits at once.
fn stop_on_signal() -> Result<Arc<StopGate>> {
    let gate = Arc::new(StopGate::new());
    let asked = gate.clone();
    ctrlc::set_handler(move || {
        if asked.requested() {
            eprintln!("\nstopping now (second signal); nothing more is saved");
            std::process::exit(130);
        }
        asked.request();
        eprintln!("\nstopping after the current step (a second Ctrl-C stops at once, without saving)");
    })
    .map_err(|e| anyhow!("cannot handle Ctrl-C: {e}"))?;
    Ok(gate)
}

pub fn train(args: &TrainArgs) -> Result<()> {
    let mut session = Session::prepare(&args.build, &args.request()?)?;
    let gate = stop_on_signal()?;
    session.config.stop = Some(gate.clone());
    for line in session.preamble(args.steps) {
        eprintln!("{line}");
    }
    // Held until the weights are written.
    let _locks = session.take_locks();
    let pipeline = session.pipeline_text();
    let session_start = session.start;
    let weights = args.build.join(WEIGHTS_FILE);
    let replacing = weights.is_file();
    let language_model = session.language_model;
    let mut progress = progress(args, session.start)?.forced(session.forced.clone()).language_model(language_model);
    let mut skipped = 0;
    let mut last_eval = None;
    let report = session.run(&mut |r: StepReport| {
        progress.step(&r);
        last_eval = show_eval(&mut progress, &r, language_model).or(last_eval.take());
        if r.skipped {
            skipped += 1;
            // Above the bar on a terminal, so it never runs into it.
            progress.println(&format!("step {}: skipped (a loss or gradient was not finite; every stage kept its weights and optimizer state)", r.step + 1));
        }
    })?;
    progress.finish();
    if let Some(line) = save_trace(args.trace.as_deref(), &report)? {
        eprintln!("{line}");
    }
    for p in &report.checkpoints {
        eprintln!("wrote checkpoint {}", p.display());
    }
    save_weights(&weights, &report)?;
    eprintln!("wrote {}{}", weights.display(), if replacing { " (replacing the earlier run's weights)" } else { "" });
    let (first, last) = loss_range(&report);
    let skipped = if skipped > 0 { format!(" ({skipped} skipped)") } else { String::new() };
    println!(
        "trained {} steps{skipped} under {pipeline} in {:.1}s: loss {first:.4} -> {last:.4}; weight versions held per stage (peak): {:?}",
        report.losses.len(),
        progress.started.elapsed().as_secs_f64(),
        report.peak_versions
    );
    println!("peak live tensor bytes per stage: {}", memory_peaks(&report).join(", "));
    println!("{}", host_reads_line(&report));
    println!("{}", off_device_line(&report));
    if let Some(line) = last_eval {
        println!("{line}");
    }
    if let Some(line) = peak_memory_line() {
        println!("{line}");
    }
    let done = session_start + report.losses.len();
    if gate.stop_after().is_some() && done < args.steps {
        let argv: Vec<String> = std::env::args().collect();
        for line in stopped_lines(done, args.steps, report.checkpoints.last().map(|p| p.as_path()), &argv) {
            eprintln!("{line}");
        }
        std::process::exit(130);
    }
    Ok(())
}

/// Prints step `r`'s evaluation, when it has one, above the progress bar; its line, which
/// the run's summary repeats.
fn show_eval(progress: &mut Progress, r: &StepReport, language_model: bool) -> Option<String> {
    let line = eval_line(r.step + 1, r.eval.as_ref()?, language_model);
    progress.println(&line);
    Some(line)
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
            // One line, naming the rank, however far the rank got.
            let who = job.who(job.rank());
            let text = e.to_string();
            say(&format!("error: {}", if text.starts_with(&who) { text } else { format!("{who}: {text}") }));
            job.abort(1)
        }
    }
}

fn worker_rank(args: &WorkerArgs, embedded: Option<Vec<u8>>, job: &MpiJob) -> Result<()> {
    let t = &args.train;
    let mut session = WorkerSession::prepare(&t.build, &args.request()?, embedded, job)?;
    // Held until the weights are written.
    let _locks = session.take_locks();
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
    let session_schedule = session.config.schedule;
    let language_model = session.language_model;
    let mut progress = if reports { progress(t, start)?.language_model(language_model) } else { Progress::new(t.steps, start, t.log_every, true, None)? };
    let gate = session.config.stop.clone();
    let mut last_eval = None;
    // Evaluations reach the reporting rank only (the last stage of replica 0 computes them).
    let outcome = session.run(&mut |r: StepReport| {
        progress.step(&r);
        last_eval = show_eval(&mut progress, &r, language_model).or(last_eval.take());
    })?;
    let stopped_after = gate.and_then(|g| g.stop_after());
    progress.finish();
    let report = &outcome.report;
    // Every rank traces its own stage: `t.json` becomes `t.rank1.json` on rank 1.
    let trace = t.trace.as_ref().map(|p| p.with_extension(format!("rank{rank}.{}", p.extension().and_then(|e| e.to_str()).unwrap_or("json"))));
    if let Some(line) = save_trace(trace.as_deref(), report)? {
        say(&format!("rank {rank}: {line}"));
    }
    for p in &report.checkpoints {
        say(&format!("rank {rank}: wrote checkpoint {}", p.display()));
    }
    // Rank 0 commits the checkpoints, so it says where a stopped job resumes.
    if let Some(last) = stopped_after.filter(|_| rank == 0) {
        let launched = pipewright_driver::launch::launch_argv();
        for line in stopped_job_lines(last as usize + 1, t.steps, report.checkpoints.last().map(|p| p.as_path()), launched.as_deref()) {
            say(&format!("rank 0: {line}"));
        }
    }
    if let Some(all) = &outcome.job {
        let weights = t.build.join(WEIGHTS_FILE);
        save_weights(&weights, all)?;
        say(&format!("rank {rank}: wrote every stage's weights to {}", weights.display()));
    }
    if reports {
        let (first, last) = loss_range(report);
        println!(
            "trained {} steps under {} over {} x {replicas} replica(s) in {:.1}s: loss {first:.4} -> {last:.4}",
            report.losses.len(),
            session_schedule,
            stages_text(session_schedule, depth as u32),
            progress.started.elapsed().as_secs_f64(),
        );
        if let Some(line) = last_eval {
            println!("{line}");
        }
    }
    let peak = memory_peaks(report).into_iter().next().unwrap_or_else(|| "0 B".into());
    let versions = report.peak_versions.first().copied().unwrap_or(0);
    println!("rank {rank} (stage {stage}, replica {replica}): peak live tensor bytes {peak}, weight versions held (peak) {versions}");
    Ok(())
}

/// One line on standard error in one write: the launcher interleaves the ranks' output,
/// and a line written in pieces (as `eprintln!` may) comes out mixed with another rank's.
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

pub fn run_forward(args: &RunForwardArgs) -> Result<()> {
    let (lines, verdict) = run_forward_command(&args.model, &args.inputs, args.device, args.tile_batch, (args.rtol, args.atol), args.save.as_deref())?;
    for line in &lines {
        println!("{line}");
    }
    if !verdict.matched {
        anyhow::bail!("{}: the outputs differ from the expected ones (see above)", args.model.display());
    }
    Ok(())
}

/// `pipewright bench-allreduce`, on every rank of an MPI job: rank 0 prints the table.
pub fn bench_allreduce(args: &BenchAllreduceArgs) -> Result<()> {
    let job = MpiJob::start(Duration::from_secs(args.timeout.max(2))).map_err(|e| anyhow!("{e}"))?;
    let ranks = job.size();
    match pipewright_driver::allreduce::bench_allreduce(&job, &args.sizes, args.repeat, Duration::from_secs(args.timeout)) {
        Ok(rows) => {
            for row in rows.iter().flatten() {
                println!(
                    "| {} | {ranks} | {:.2} | {:.2} | {:.2} | {:.1e} |",
                    pipewright_core::units::human_bytes(row.bytes),
                    row.fixed_order_ms,
                    row.collective_ms,
                    row.collective_ms / row.fixed_order_ms,
                    row.rel_gap
                );
            }
            job.finish().map_err(|e| anyhow!("{e}"))
        }
        Err(e) => {
            say(&format!("error: {}: {e}", job.who(job.rank())));
            job.abort(1)
        }
    }
}

pub fn bench_step(args: &BenchStepArgs) -> Result<()> {
    for line in bench_step_command(&args.model, &args.inputs, args.device, args.threads, args.train, args.warmup, args.steps)? {
        println!("{line}");
    }
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

/// A profile's JSON (`profile_json`), written (atomically) to `output`, else printed.
fn write_profile(text: &str, output: Option<&std::path::Path>) -> Result<()> {
    match output {
        Some(path) => write_atomic(path, text.as_bytes())?,
        None => println!("{text}"),
    }
    Ok(())
}

pub fn refine_profile(args: &RefineProfileArgs) -> Result<()> {
    let p = refine_files(&args.profile, &args.build, &args.trace, args.batch, args.warmup)?;
    if let Some(line) = p.split.last().and_then(|sp| split_note(&p, sp)) {
        eprintln!("{line}");
    }
    write_profile(&profile_json(&p)?, args.output.as_deref())
}

pub fn profile(args: &ProfileArgs) -> Result<()> {
    let mut on_progress = |p: ProfileProgress<'_>| {
        for line in p.lines() {
            eprintln!("{line}");
        }
    };
    let p = pipewright_driver::profile::profile(&args.model, args.device, &args.batch, args.reps, args.seed, (args.loss.loss, args.loss.output.as_deref()), &mut on_progress)?;
    for line in notes(&p) {
        eprintln!("{line}");
    }
    write_profile(&profile_json(&p)?, args.output.as_deref())
}
