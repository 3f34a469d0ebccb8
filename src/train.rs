//! `pipewright train`: trains a compiled pipeline (the stage modules `pipewright compile`
//! wrote) on the embedded executor — one process, one worker thread per stage — with the
//! schedule the modules were compiled for (2BW, PipeDream-Flush or GPipe).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use pipewright_runtime::module::read_module;
use pipewright_runtime::pipeline::{train, Decay, Loss, LrSchedule, Microbatch, Optimizer, Schedule, TrainConfig};
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

fn loss(args: &TrainArgs) -> Result<Loss> {
    Ok(match args.loss.split_once(':') {
        Some(("output", name)) => Loss::Output(name.to_string()),
        None if args.loss == "cross-entropy" || args.loss == "mse" => {
            let output = args.output.clone().ok_or_else(|| anyhow!("--loss {} needs --output NAME (the model output it applies to)", args.loss))?;
            if args.loss == "mse" { Loss::Mse { output } } else { Loss::CrossEntropy { output } }
        }
        _ => bail!("--loss takes cross-entropy, mse or output:NAME, not {:?}", args.loss),
    })
}

fn optimizer(args: &TrainArgs) -> Result<Optimizer> {
    let (b1, b2, eps, wd) = (0.9, 0.999, 1e-8, args.weight_decay);
    Ok(match args.optimizer.as_str() {
        "sgd" => Optimizer::Sgd { momentum: args.momentum, weight_decay: wd },
        "adam" => Optimizer::Adam { beta1: b1, beta2: b2, eps, weight_decay: wd },
        "adamw" => Optimizer::AdamW { beta1: b1, beta2: b2, eps, weight_decay: wd },
        other => bail!("--optimizer takes sgd, adam or adamw, not {other:?}"),
    })
}

fn lr_schedule(args: &TrainArgs) -> Result<LrSchedule> {
    let decay = match args.decay.as_str() {
        "constant" => Decay::Constant,
        "linear" => Decay::Linear { total_steps: args.steps, final_lr: 0.0 },
        "cosine" => Decay::Cosine { total_steps: args.steps, final_lr: 0.0 },
        other => bail!("--decay takes constant, linear or cosine, not {other:?}"),
    };
    Ok(LrSchedule { warmup_steps: args.warmup, decay })
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let manifest_path = args.build.join("pipeline.toml");
    let text = std::fs::read_to_string(&manifest_path).with_context(|| format!("{}: cannot read (run `pipewright compile` first)", manifest_path.display()))?;
    let manifest: toml::Value = toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", manifest_path.display()))?;
    let order: Vec<PathBuf> = manifest
        .get("stage_order")
        .and_then(|v| v.as_array())
        .ok_or_else(|| anyhow!("{}: no stage_order", manifest_path.display()))?
        .iter()
        .filter_map(|v| v.as_str())
        .map(|f| args.build.join(f))
        .collect();
    let modules = order.iter().map(|p| read_module(p).map_err(|e| anyhow!("{e}"))).collect::<Result<Vec<_>>>()?;
    let schedule: Schedule = modules.first().map(|m| m.header.params.schedule.into()).ok_or_else(|| anyhow!("no stages"))?;
    let depth = modules.len();
    let m = args.microbatches.unwrap_or(depth.max(1));
    let inputs = graph_inputs(&manifest, &manifest_path)?;
    let data = match args.data.to_str() {
        Some("synthetic") => Dataset::synthetic(&inputs, args.microbatch * m * 4, args.seed)?.with_random_labels(args.classes, args.seed)?,
        _ => Dataset::open(&args.data, &inputs, args.label.as_deref())?,
    };
    let batches: Vec<Vec<Microbatch>> = data
        .batches(args.microbatch, m, args.seed, Stop::Steps(args.steps))?
        .map(|batch| batch.into_iter().map(|(inputs, labels)| Microbatch { inputs, labels }).collect())
        .collect();
    let device = args.device.parse::<pipewright_runtime::Device>()?.to_tch()?;
    let mut cfg = TrainConfig::new(schedule, loss(args)?, args.lr, args.steps);
    cfg.optimizer = optimizer(args)?;
    cfg.lr_schedule = lr_schedule(args)?;
    cfg.clip_norm = args.clip_norm;
    cfg.seed = args.seed as i64;
    cfg.device = device;
    cfg.trace = args.trace.is_some();
    let mut metrics = match &args.metrics {
        Some(p) => Some(std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()))?),
        None => None,
    };
    let started = Instant::now();
    let steps = args.steps;
    eprintln!("training {} stage(s), schedule {schedule:?}, microbatch {}, {m} microbatches per step, {steps} steps", depth, args.microbatch);
    let mut on_step = |r: pipewright_runtime::pipeline::StepReport| {
        let elapsed = started.elapsed().as_secs_f64();
        let rate = r.samples as f64 / r.seconds.max(1e-9);
        let eta = elapsed / (r.step + 1) as f64 * (steps - r.step - 1) as f64;
        if r.step % args.log_every.max(1) == 0 || r.step + 1 == steps {
            eprintln!("step {:>5}/{steps}  loss {:.4}  {:.0} samples/s  eta {:.1}s", r.step + 1, r.loss, rate, eta);
        }
        if let Some(f) = metrics.as_mut() {
            let _ = writeln!(f, "{{\"step\":{},\"loss\":{},\"samples\":{},\"seconds\":{},\"samples_per_s\":{}}}", r.step + 1, r.loss, r.samples, r.seconds, rate);
        }
    };
    let report = train(modules, &cfg, Box::new(batches.into_iter()), &mut on_step).map_err(|e| anyhow!("{}: {e}", args.build.display()))?;
    if let Some(path) = &args.trace {
        let json = pipewright_runtime::pipeline::chrome_trace_json(&report.trace);
        crate::output::write_atomic(path, json.as_bytes())?;
        eprintln!("wrote {} trace events to {}", report.trace.len(), path.display());
    }
    crate::export::save_weights(&args.build.join(crate::export::WEIGHTS_FILE), &report.weights)?;
    let (first, last) = (report.losses.first().copied().unwrap_or(f64::NAN), report.losses.last().copied().unwrap_or(f64::NAN));
    println!(
        "trained {} steps in {:.1}s: loss {:.4} -> {:.4}; weight versions held per stage (peak): {:?}",
        report.losses.len(),
        started.elapsed().as_secs_f64(),
        first,
        last,
        report.peak_versions
    );
    Ok(())
}
