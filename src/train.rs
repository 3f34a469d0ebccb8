//! `pipewright train`: trains a compiled pipeline (the stage modules `pipewright compile`
//! wrote) on the embedded executor — one process, one worker thread per stage — with the
//! schedule the modules were compiled for (2BW, PipeDream-Flush or GPipe).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use pipewright_runtime::module::{read_module, StageModule};
use pipewright_core::Loss;
use pipewright_runtime::pipeline::{
    chrome_trace_json, read_checkpoint, resume, train, LrSchedule, Microbatch, Objective, OptimizerConfig, StepReport, TrainConfig,
};
use pipewright_runtime::ElemType;

use crate::data::{Dataset, InputSpec, Stop};
use crate::TrainArgs;

/// The graph inputs the pipeline reads, from `pipeline.toml`: name, type, per-sample shape.
fn graph_inputs(manifest: &toml::Value, path: &Path) -> Result<Vec<InputSpec>> {
    let mut out: Vec<InputSpec> = Vec::new();
    let stages = manifest.get("stage").and_then(|s| s.as_array()).ok_or_else(|| anyhow!("{}: no [[stage]] entries", path.display()))?;
    for st in stages {
        for t in st.get("graph_inputs").and_then(|g| g.as_array()).into_iter().flatten() {
            let name = t.get("name").and_then(|v| v.as_str()).unwrap_or_default().to_string();
            if out.iter().any(|o| o.0 == name) {
                continue;
            }
            let dtype = t.get("dtype").and_then(|v| v.as_str()).unwrap_or_default();
            let elem = ElemType::from_name(dtype).ok_or_else(|| anyhow!("{}: input {name:?} has unknown dtype {dtype:?}", path.display()))?;
            let shape: Vec<&str> = t.get("shape").and_then(|v| v.as_array()).into_iter().flatten().filter_map(|v| v.as_str()).collect();
            if shape.first() != Some(&"N") {
                bail!("{}: input {name:?} has no batch axis first (shape {shape:?})", path.display());
            }
            let per_sample = shape[1..]
                .iter()
                .map(|d| d.parse::<i64>().map_err(|_| anyhow!("{}: input {name:?}: extent {d:?} is not fixed", path.display())))
                .collect::<Result<Vec<_>>>()?;
            out.push((name, elem, per_sample));
        }
    }
    Ok(out)
}

fn objective(args: &TrainArgs) -> Result<Objective> {
    let output = args.output.clone().ok_or_else(|| anyhow!("--loss {} needs --output NAME (the model output it applies to)", args.loss))?;
    Ok(Objective::new(args.loss, output))
}

fn optimizer(args: &TrainArgs) -> OptimizerConfig {
    OptimizerConfig { momentum: args.momentum, weight_decay: args.weight_decay, ..OptimizerConfig::new(args.optimizer) }
}

fn lr_schedule(args: &TrainArgs) -> LrSchedule {
    LrSchedule { warmup_steps: args.warmup, decay: args.decay, total_steps: args.steps, final_lr: 0.0 }
}

/// `pipeline.toml` of a build folder and its stage module file names, in stage order.
pub(crate) fn read_manifest(build: &Path) -> Result<(toml::Value, Vec<String>)> {
    let path = build.join("pipeline.toml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read (run `pipewright compile` first)", path.display()))?;
    let manifest: toml::Value = toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let order: Vec<String> = manifest
        .get("stage_order")
        .and_then(|v| v.as_array())
        .ok_or_else(|| anyhow!("{}: no stage_order", path.display()))?
        .iter()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    if order.is_empty() {
        bail!("{}: no stages", path.display());
    }
    Ok((manifest, order))
}

/// The manifest and the stage modules it lists, checked to come from one compile.
fn load_pipeline(build: &Path) -> Result<(toml::Value, Vec<StageModule>)> {
    let manifest_path = build.join("pipeline.toml");
    let (manifest, names) = read_manifest(build)?;
    let order: Vec<PathBuf> = names.iter().map(|f| build.join(f)).collect();
    let id = manifest.get("pipeline_id").and_then(|v| v.as_str()).unwrap_or_default();
    let mut modules = Vec::new();
    for path in &order {
        let module = read_module(path).map_err(|e| anyhow!("{e}"))?;
        if module.program.pipeline != id {
            bail!(
                "{}: this stage module comes from another compile (pipeline id {:?}) than {} ({id:?}); recompile, or copy the whole build folder",
                path.display(),
                module.program.pipeline,
                manifest_path.display()
            );
        }
        modules.push(module);
    }
    Ok((manifest, modules))
}

pub(crate) fn config(args: &TrainArgs, schedule: pipewright_core::Schedule) -> Result<TrainConfig> {
    let mut cfg = TrainConfig::new(schedule, objective(args)?, args.lr, args.steps);
    cfg.optimizer = optimizer(args);
    cfg.lr_schedule = lr_schedule(args);
    cfg.clip_norm = args.clip_norm;
    cfg.seed = args.seed as i64;
    cfg.device = pipewright_runtime::device::tch_device(args.device)?;
    cfg.trace = args.trace.is_some();
    cfg.replicas = args.replicas;
    cfg.threads = args.threads;
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    if let Some(n) = args.checkpoint_every {
        if n == 0 {
            bail!("--checkpoint-every must be at least 1");
        }
        cfg.checkpoint_every = Some(n);
        cfg.checkpoint_dir = Some(args.checkpoint_dir.clone().unwrap_or_else(|| args.build.join("checkpoints")));
    }
    Ok(cfg)
}

/// Prints progress: an indicatif bar on a terminal, plain lines every `--log-every` steps
/// otherwise; and writes the metrics lines.
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    metrics: Option<std::fs::File>,
    pub(crate) started: Instant,
    first_step: usize,
    steps: usize,
    log_every: usize,
}

impl Progress {
    pub(crate) fn new(args: &TrainArgs, first_step: usize) -> Result<Self> {
        let metrics = match &args.metrics {
            Some(p) => Some(std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()))?),
            None => None,
        };
        let bar = (!args.no_progress && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(args.steps as u64);
            let style = ProgressStyle::with_template("{bar:30} step {pos}/{len}  {msg}  eta {eta}").unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(first_step as u64);
            bar
        });
        Ok(Progress { bar, metrics, started: Instant::now(), first_step, steps: args.steps, log_every: args.log_every.max(1) })
    }

    pub(crate) fn step(&mut self, r: &StepReport) {
        let rate = r.samples as f64 / r.seconds.max(1e-9);
        let done = r.step + 1 - self.first_step;
        let eta = self.started.elapsed().as_secs_f64() / done as f64 * (self.steps - r.step - 1) as f64;
        match &self.bar {
            Some(bar) => {
                bar.set_message(format!("loss {:.4}  {:.0} samples/s", r.loss, rate));
                bar.set_position(r.step as u64 + 1);
            }
            None if r.step % self.log_every == 0 || r.step + 1 == self.steps => {
                eprintln!("step {:>5}/{}  loss {:.4}  {:.0} samples/s  eta {:.1}s", r.step + 1, self.steps, r.loss, rate, eta);
            }
            None => {}
        }
        if let Some(f) = self.metrics.as_mut() {
            let _ = writeln!(f, "{{\"step\":{},\"loss\":{},\"samples\":{},\"seconds\":{},\"samples_per_s\":{}}}", r.step + 1, r.loss, r.samples, r.seconds, rate);
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let (mut v, mut u) = (bytes as f64, 0);
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// The per-sample shape of graph output `name` from `pipeline.toml` (`None` when absent
/// or not fixed).
fn output_shape(manifest: &toml::Value, name: &str) -> Option<Vec<i64>> {
    let stages = manifest.get("stage")?.as_array()?;
    let entry = stages.iter().flat_map(|st| st.get("graph_outputs").and_then(|g| g.as_array()).into_iter().flatten()).find(|t| t.get("name").and_then(|v| v.as_str()) == Some(name))?;
    let shape: Vec<&str> = entry.get("shape")?.as_array()?.iter().filter_map(|v| v.as_str()).collect();
    (shape.first() == Some(&"N")).then_some(())?;
    shape[1..].iter().map(|d| d.parse::<i64>().ok()).collect()
}

/// `--data synthetic`: seeded inputs, and labels shaped for the loss (class ids of the
/// output's shape minus its class axis for cross-entropy, targets of its shape for mse).
fn synthetic(args: &TrainArgs, manifest: &toml::Value, inputs: &[InputSpec], samples: usize) -> Result<Dataset> {
    let data = Dataset::synthetic(inputs, samples, args.seed)?;
    let out = args.output.as_deref().and_then(|o| output_shape(manifest, o));
    match (args.loss, out) {
        (Loss::Mse, Some(shape)) => data.with_random_targets(&shape, args.seed),
        (Loss::CrossEntropy, Some(shape)) if !shape.is_empty() => data.with_random_labels_shaped(args.classes, &shape[..shape.len() - 1], args.seed),
        _ => data.with_random_labels(args.classes, args.seed),
    }
}

/// The batches of `per_batch` microbatches from step `start` on (a resumed run sees the
/// batches an uninterrupted one would from there on).
pub(crate) fn load_batches(args: &TrainArgs, manifest: &toml::Value, manifest_path: &Path, per_batch: usize, start: usize) -> Result<Vec<Vec<Microbatch>>> {
    let inputs = graph_inputs(manifest, manifest_path)?;
    let data = match args.data.to_str() {
        Some("synthetic") => synthetic(args, manifest, &inputs, args.microbatch * per_batch * 4)?,
        _ => Dataset::open(&args.data, &inputs, args.label.as_deref())?,
    };
    Ok(data
        .batches(args.microbatch, per_batch, args.seed, Stop::Steps(args.steps))?
        .skip(start)
        .map(|batch| batch.into_iter().map(|(inputs, labels)| Microbatch { inputs, labels }).collect())
        .collect())
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let (manifest, modules) = load_pipeline(&args.build)?;
    let manifest_path = args.build.join("pipeline.toml");
    let schedule = modules[0].header.params.schedule;
    let depth = modules.len();
    let m = args.microbatches.unwrap_or(depth.max(1));
    let w = args.replicas.max(1);
    let checkpoint = match &args.resume {
        Some(dir) => Some(read_checkpoint(dir).map_err(|e| anyhow!("--resume: {e}"))?),
        None => None,
    };
    let start = checkpoint.as_ref().map_or(0, |c| c.step as usize);
    let batches = load_batches(args, &manifest, &manifest_path, m * w, start)?;
    let mut cfg = config(args, schedule)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cfg.threads = Some(args.threads.unwrap_or((cores / (depth * w)).max(1)));
    let mut progress = Progress::new(args, start)?;
    eprintln!(
        "training {depth} stage(s) x {w} replica(s), schedule {schedule}, microbatch {}, {m} microbatches per step and replica, steps {}..{}",
        args.microbatch, start, args.steps
    );
    let mut on_step = |r: StepReport| progress.step(&r);
    let data = Box::new(batches.into_iter());
    let report = match checkpoint {
        Some(ck) => resume(modules, &cfg, ck, data, &mut on_step),
        None => train(modules, &cfg, data, &mut on_step),
    }
    .map_err(|e| anyhow!("{}: {e}", args.build.display()))?;
    progress.finish();
    if let Some(path) = &args.trace {
        let json = chrome_trace_json(&report.trace);
        crate::output::write_atomic(path, json.as_bytes())?;
        eprintln!("wrote {} trace events to {}", report.trace.len(), path.display());
    }
    for p in &report.checkpoints {
        eprintln!("wrote checkpoint {}", p.display());
    }
    crate::export::save_weights(&args.build.join(crate::export::WEIGHTS_FILE), &report)?;
    let (first, last) = (report.losses.first().copied().unwrap_or(f64::NAN), report.losses.last().copied().unwrap_or(f64::NAN));
    println!(
        "trained {} steps in {:.1}s: loss {:.4} -> {:.4}; weight versions held per stage (peak): {:?}",
        report.losses.len(),
        progress.started.elapsed().as_secs_f64(),
        first,
        last,
        report.peak_versions
    );
    let peaks: Vec<String> = report.memory.iter().map(|m| human(m.total)).collect();
    println!("peak live tensor bytes per stage: {}", peaks.join(", "));
    Ok(())
}
