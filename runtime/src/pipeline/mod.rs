//! The embedded pipeline executor: one process, one worker thread per stage, running
//! GPipe, PipeDream-Flush or PipeDream-2BW (see `shared/design/2bw.md`).

mod optim;
mod schedule;
mod stage;
mod trace;
mod transport;

use std::sync::mpsc;
use std::time::Instant;

use tch::Tensor;

pub use crate::exec::Mode;
pub use optim::{Decay, LrSchedule, Optimizer};
pub use schedule::{Op, Schedule};
pub use trace::{chrome_trace_json, TraceEvent, TraceKind};
pub use transport::{InProcess, Named, Transport};

use crate::module::StageModule;

/// The training objective, evaluated at the last stage on one of its outputs (by name).
#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    /// Mean cross-entropy of logits `[N, C]` or `[N, ..., C]` against i64 labels `[N, ...]`.
    CrossEntropy { output: String },
    /// Mean squared error against float labels of the output's shape.
    Mse { output: String },
    /// A scalar the graph computes itself.
    Output(String),
}

impl Loss {
    pub fn output(&self) -> &str {
        match self {
            Loss::CrossEntropy { output } | Loss::Mse { output } | Loss::Output(output) => output,
        }
    }
}

/// One microbatch: graph inputs by name and the labels the loss needs.
pub struct Microbatch {
    pub inputs: Vec<(String, Tensor)>,
    pub labels: Option<Tensor>,
}

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub schedule: Schedule,
    /// Base learning rate.
    pub lr: f64,
    pub lr_schedule: LrSchedule,
    pub optimizer: Optimizer,
    /// Clip gradients to this global norm (over all stages) before each update.
    pub clip_norm: Option<f64>,
    /// Number of batches (weight updates).
    pub steps: usize,
    pub seed: i64,
    pub device: tch::Device,
    /// Train or Eval kernels (BatchNormalization statistics, Dropout).
    pub mode: Mode,
    pub loss: Loss,
    /// Record a per-stage timeline of every forward, backward, recompute, send, receive
    /// and optimizer step into `TrainReport::trace` (off by default).
    pub trace: bool,
}

impl TrainConfig {
    /// SGD at `lr`, constant rate, no clipping, CPU, train mode.
    pub fn new(schedule: Schedule, loss: Loss, lr: f64, steps: usize) -> Self {
        TrainConfig {
            schedule,
            lr,
            lr_schedule: LrSchedule::default(),
            optimizer: Optimizer::sgd(),
            clip_norm: None,
            steps,
            seed: 0,
            device: tch::Device::Cpu,
            mode: Mode::Train,
            loss,
            trace: false,
        }
    }
}

/// Reported after each weight update (`step` is the 0-based batch index).
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    pub step: usize,
    /// Mean microbatch loss of the batch.
    pub loss: f64,
    pub samples: usize,
    /// Wall time since the previous report (or since the start).
    pub seconds: f64,
}

#[derive(Debug)]
pub struct TrainReport {
    /// Per stage: the newest trainable weights as (slot name, tensor).
    pub weights: Vec<Vec<(String, Tensor)>>,
    /// Per step: mean microbatch loss.
    pub losses: Vec<f64>,
    /// Per stage: most weight versions held at once.
    pub peak_versions: Vec<usize>,
    /// With `TrainConfig::trace`: every traced interval, stage by stage, each stage's in
    /// time order (times share one epoch, the start of training). Empty otherwise.
    pub trace: Vec<TraceEvent>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("pipeline configuration: {0}")]
    Config(String),
    #[error("data: {0}")]
    Data(String),
    #[error("stage {stage}: {message}")]
    Stage { stage: usize, message: String },
    #[error("step {step}, stage {stage}: loss is {value} (not finite)")]
    NonFiniteLoss { step: usize, stage: usize, value: f64 },
}

/// Data for one stage and microbatch: its graph inputs in program order, the labels (last
/// stage) and the sample count.
pub(crate) struct StageData {
    pub mb: u64,
    pub inputs: Vec<Tensor>,
    pub labels: Option<Tensor>,
    pub samples: usize,
}

pub(crate) enum Event {
    Step { step: usize, loss: f64, samples: usize },
}

/// Trains `stages` (any order; sorted by their header's stage index) for `cfg.steps`
/// batches drawn from `data`, one worker thread per stage, calling `on_step` after each
/// update. Never hangs: a failing stage closes its channels and the others stop.
pub fn train(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    data: Box<dyn Iterator<Item = Vec<Microbatch>> + Send>,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    let mut stages = stages;
    stages.sort_by_key(|s| s.header.params.stage);
    let d = stages.len();
    if d == 0 {
        return Err(PipelineError::Config("no stages".into()));
    }
    for (k, s) in stages.iter().enumerate() {
        let p = s.header.params;
        if p.stage as usize != k || p.depth as usize != d {
            return Err(PipelineError::Config(format!("stage {k}: header says stage {} of {}, have {d} stages", p.stage, p.depth)));
        }
    }
    if cfg.steps == 0 {
        return Ok(TrainReport { weights: Vec::new(), losses: Vec::new(), peak_versions: vec![0; d], trace: Vec::new() });
    }
    let specs = stage::specs(&stages, &cfg.loss)?;
    // m comes from the first batch.
    let mut data = data;
    let first = data.next().ok_or_else(|| PipelineError::Data("the data iterator is empty".into()))?;
    let m = first.len();
    if m == 0 {
        return Err(PipelineError::Data("batch 0 has no microbatches".into()));
    }
    let mut all_ops = Vec::new();
    for k in 0..d {
        all_ops.push(cfg.schedule.ops(k, d, m, cfg.steps).map_err(PipelineError::Config)?);
    }
    // Data channels for stages that read graph inputs (and the last, for labels).
    let cap = 2 * m + d;
    let mut data_tx = Vec::new();
    let mut data_rx = Vec::new();
    for spec in &specs {
        if spec.needs_data {
            let (tx, rx) = mpsc::sync_channel::<StageData>(cap);
            data_tx.push(Some(tx));
            data_rx.push(Some(rx));
        } else {
            data_tx.push(None);
            data_rx.push(None);
        }
    }
    let input_names: Vec<Vec<String>> = specs.iter().map(|s| s.graph_input_names.clone()).collect();
    let steps = cfg.steps;
    let (err_tx, err_rx) = mpsc::channel::<PipelineError>();
    let feeder_err = err_tx.clone();
    let feeder = std::thread::spawn(move || {
        let batches = std::iter::once(first).chain(data);
        let mut fed = 0usize;
        let mut mb = 0u64;
        for (t, batch) in batches.take(steps).enumerate() {
            if batch.len() != m {
                let _ = feeder_err.send(PipelineError::Data(format!("batch {t} has {} microbatches, batch 0 had {m}", batch.len())));
                return;
            }
            for micro in batch {
                let samples = micro.inputs.first().map(|(_, x)| x.size().first().copied().unwrap_or(1)).unwrap_or(0) as usize;
                for (k, tx) in data_tx.iter().enumerate() {
                    let Some(tx) = tx else { continue };
                    let mut inputs = Vec::new();
                    for name in &input_names[k] {
                        match micro.inputs.iter().find(|(n, _)| n == name) {
                            Some((_, x)) => inputs.push(x.shallow_clone()),
                            None => {
                                let _ = feeder_err.send(PipelineError::Data(format!("microbatch {mb} lacks graph input {name:?} (stage {k})")));
                                return;
                            }
                        }
                    }
                    let labels = micro.labels.as_ref().map(|l| l.shallow_clone());
                    if tx.send(StageData { mb, inputs, labels, samples }).is_err() {
                        return; // the stage stopped; its error is reported by it
                    }
                }
                mb += 1;
            }
            fed += 1;
        }
        if fed < steps {
            let _ = feeder_err.send(PipelineError::Data(format!("the data ran out after {fed} of {steps} batches")));
        }
    });
    drop(err_tx);

    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let transports = InProcess::pipeline(d);
    let epoch = cfg.trace.then(Instant::now);
    let mut handles = Vec::new();
    for (((spec, ops), rx), tr) in specs.into_iter().zip(all_ops).zip(data_rx).zip(transports) {
        let cfg = cfg.clone();
        let ev = (spec.index + 1 == d).then(|| ev_tx.clone());
        let k = spec.index;
        let h = std::thread::Builder::new()
            .name(format!("pipewright-stage-{k}"))
            .spawn(move || stage::run(spec, ops, m, cfg, rx, Box::new(tr), ev, epoch))
            .map_err(|e| PipelineError::Stage { stage: k, message: format!("cannot spawn thread: {e}") })?;
        handles.push(h);
    }
    drop(ev_tx);

    let mut losses = Vec::new();
    let mut last = Instant::now();
    for ev in ev_rx {
        match ev {
            Event::Step { step, loss, samples } => {
                let now = Instant::now();
                losses.push(loss);
                on_step(StepReport { step, loss, samples, seconds: now.duration_since(last).as_secs_f64() });
                last = now;
            }
        }
    }
    let mut weights = Vec::new();
    let mut peak_versions = Vec::new();
    let mut trace = Vec::new();
    let mut primary: Option<PipelineError> = None;
    let mut secondary: Option<PipelineError> = None;
    for (k, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(out)) => {
                weights.push(out.weights);
                peak_versions.push(out.peak_versions);
                trace.extend(out.trace);
            }
            Ok(Err(stage::Failure { error, induced })) => {
                let slot = if induced { &mut secondary } else { &mut primary };
                slot.get_or_insert(error);
            }
            Err(_) => {
                primary.get_or_insert(PipelineError::Stage { stage: k, message: "worker thread panicked".into() });
            }
        }
    }
    let _ = feeder.join();
    if let Ok(e) = err_rx.try_recv() {
        // A data error is the root cause of any induced stage failure.
        if primary.is_none() {
            return Err(e);
        }
    }
    if let Some(e) = primary.or(secondary) {
        return Err(e);
    }
    Ok(TrainReport { weights, losses, peak_versions, trace })
}
