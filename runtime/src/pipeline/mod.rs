//! The embedded pipeline executor: one process, one worker thread per stage, running
//! GPipe, PipeDream-Flush or PipeDream-2BW (see `shared/design/2bw.md`).

mod checkpoint;
mod distributed;
mod eval;
mod memory;
mod optim;
mod pieces;
mod precision;
mod schedule;
mod specialise;
mod stage;
mod stop;
mod trace;
mod transport;
mod turns;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pipewright_core::{Loss, NonFinite, Placement, Schedule};
use tch::Tensor;

pub use crate::exec::Mode;
pub use optim::{accumulate_ms, step_ms, update_ms, LrSchedule, OptimizerConfig};
pub use stage::loss_ms;
pub use precision::{compute_kind, LossScaler, Precision};
pub use schedule::{stage_ops, stage_ops_from, Op};
pub use checkpoint::{decode_checkpoint, decode_stage, read_checkpoint, step_dir_name, write_checkpoint, Checkpoint, CheckpointError, StageState};
pub use distributed::{batch_fingerprint, Agreed, Layout, Mpi, MpiJob, MpiTurns, Reduction, DEFAULT_HEARTBEAT_TIMEOUT, HEARTBEAT_PERIOD};
pub use memory::{bytes_of, StageMemory};
pub use eval::{EvalLink, EvalResult, EvalSet};
pub use stop::StopGate;
pub use transport::{InProcess, Named, SumGroup, Transport};
pub use turns::TurnLink;

use crate::build::{Field, Identity};
use crate::module::StageModule;
use crate::timeline::TraceEvent;

/// The training objective: a loss applied at the last stage to one of its outputs (by
/// name): cross-entropy of logits `[N, C]` or `[N, ..., C]` against i64 labels `[N, ...]`,
/// mean squared error against float labels of the output's shape, or the output itself
/// (a scalar the graph computes).
#[derive(Clone, Debug, PartialEq)]
pub struct Objective {
    pub loss: Loss,
    pub output: String,
    /// Cross-entropy: labels equal to this count neither in the loss nor in its mean (the
    /// mean is over the other labels), as PyTorch's `ignore_index`.
    pub ignore_index: i64,
    /// Cross-entropy: the target puts `1 - s` on the label and spreads `s` evenly over all
    /// classes (PyTorch's `label_smoothing`), `0 <= s <= 1`.
    pub label_smoothing: f64,
}

/// [`Objective::ignore_index`]'s default, PyTorch's (and Hugging Face's masked-label
/// convention).
pub const DEFAULT_IGNORE_INDEX: i64 = -100;

impl Objective {
    pub fn new(loss: Loss, output: impl Into<String>) -> Self {
        Objective { loss, output: output.into(), ignore_index: DEFAULT_IGNORE_INDEX, label_smoothing: 0.0 }
    }
}

/// One microbatch: graph inputs by name and the labels the loss needs.
pub struct Microbatch {
    pub inputs: Vec<(String, Tensor)>,
    pub labels: Option<Tensor>,
}

/// The batches a run trains on, made as training asks for them: each a batch's
/// microbatches, or why the data could not give it (a token out of the vocabulary, a file
/// changed under the run); the run stops with that message before the step's update, so
/// no checkpoint sees a partial step.
pub type BatchStream = Box<dyn Iterator<Item = Result<Vec<Microbatch>, String>> + Send>;

/// [`TrainConfig::timeout`]'s default: ten minutes, far more than any step of a stage.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub schedule: Schedule,
    /// Base learning rate.
    pub lr: f64,
    pub lr_schedule: LrSchedule,
    pub optimizer: OptimizerConfig,
    /// Clip gradients to this global norm (over all stages) before each update.
    pub clip_norm: Option<f64>,
    /// Number of batches (weight updates).
    pub steps: usize,
    pub seed: i64,
    pub device: tch::Device,
    /// Train or Eval kernels (BatchNormalization statistics, Dropout).
    pub mode: Mode,
    pub loss: Objective,
    /// Record a per-stage timeline of every forward, backward, recompute, send, receive
    /// and optimizer step into `TrainReport::trace` (off by default; replica 0 only).
    pub trace: bool,
    /// Data-parallel width `w`: copies of the whole pipeline, each fed every `w`-th
    /// microbatch (round-robin); gradients are averaged across copies before each update.
    pub replicas: usize,
    /// Write a checkpoint into `checkpoint_dir` after every this many updates.
    pub checkpoint_every: Option<usize>,
    pub checkpoint_dir: Option<PathBuf>,
    /// Intra-op threads of each worker (libtorch's per-thread setting); `None` leaves
    /// libtorch's default (every core, for every worker).
    pub threads: Option<usize>,
    /// How long a worker waits for a neighbour's tensors or a reduction before it stops
    /// with an error naming what it waited for.
    pub timeout: Duration,
    /// Settings only the caller knows that a resumed run must repeat, by flag (the batch's
    /// shape: `--microbatch` = `8`); recorded with [`run_record`]'s in every checkpoint.
    pub settings: BTreeMap<String, String>,
    /// Resume even where this run's settings differ from the checkpoint's (`--force`).
    pub force_resume: bool,
    /// The compute element type (fp32 master weights and optimizer state whatever it is).
    pub precision: Precision,
    /// fp16's initial loss scale and growth interval (ignored otherwise).
    pub loss_scale: LossScaler,
    /// Stage placement: worker (replica `r`, stage `k`) runs on the device of its rank in
    /// an MPI job, `devices[rank % len]` (the rank by [`TrainConfig::placement`],
    /// [`Layout::rank`]), so the embedded executor and the MPI workers place alike, and
    /// `len` GPUs per node give the ranks a node holds one GPU each (launchers fill a node
    /// with consecutive ranks): `d * w` devices give one per worker; stage-major, `w`
    /// devices give replica r device r (the replicas of a stage on different devices, each
    /// replica's stages on one); replica-major, `d` devices give stage k device k. Empty:
    /// every worker on `device`.
    pub devices: Vec<tch::Device>,
    /// How workers are numbered (the build's decision): which rank, and so which of
    /// `devices`, runs stage `k` of replica `r`.
    pub placement: Placement,
    /// A step whose loss or gradients are not finite: stop (the divergence error) or skip
    /// its update in every stage.
    pub on_nonfinite: NonFinite,
    /// With [`NonFinite::Skip`]: this many skipped steps in a row end training with
    /// [`PipelineError::TooManySkips`].
    pub max_skips: usize,
    /// Where a request to stop early is made (by the caller on Ctrl-C, or by an MPI
    /// rank's `SIGUSR1` watcher) and where the workers record the step they stopped after,
    /// checkpointed when `checkpoint_every` is set. `None`: the run goes to `steps`.
    pub stop: Option<std::sync::Arc<StopGate>>,
    /// After which steps the run evaluates ([`train_evaluated`]'s set; ignored without one).
    pub eval: EvalPoints,
}

/// After which steps a run evaluates its held-out set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvalPoints {
    #[default]
    Never,
    /// After the last step only.
    AtEnd,
    /// After every this many steps, and after the last.
    Every(usize),
}

impl EvalPoints {
    /// Whether a run of `steps` steps evaluates after step `t` (from 0).
    pub fn due(self, t: usize, steps: usize) -> bool {
        match self {
            EvalPoints::Never => false,
            EvalPoints::AtEnd => t + 1 == steps,
            EvalPoints::Every(n) => t + 1 == steps || (n > 0 && (t + 1) % n == 0),
        }
    }
}

pub use pipewright_core::DEFAULT_MAX_SKIPS;

impl TrainConfig {
    /// SGD at `lr`, constant rate, no clipping, CPU, train mode.
    pub fn new(schedule: Schedule, loss: Objective, lr: f64, steps: usize) -> Self {
        TrainConfig {
            schedule,
            lr,
            lr_schedule: LrSchedule::default(),
            optimizer: OptimizerConfig::sgd(),
            clip_norm: None,
            steps,
            seed: 0,
            device: tch::Device::Cpu,
            mode: Mode::Train,
            loss,
            trace: false,
            replicas: 1,
            checkpoint_every: None,
            checkpoint_dir: None,
            threads: None,
            timeout: DEFAULT_TIMEOUT,
            settings: BTreeMap::new(),
            force_resume: false,
            precision: Precision::Fp32,
            loss_scale: LossScaler::new(),
            devices: Vec::new(),
            placement: Placement::StageMajor,
            on_nonfinite: NonFinite::Stop,
            max_skips: DEFAULT_MAX_SKIPS,
            stop: None,
            eval: EvalPoints::Never,
        }
    }

    /// Whether the run evaluates after step `t` (from 0).
    pub fn eval_due(&self, t: usize) -> bool {
        self.eval.due(t, self.steps)
    }

    /// The device of stage `stage` of replica `replica` (of [`TrainConfig::replicas`]): its
    /// worker's ([`Schedule::worker_of`]: under interleaved 1F1B and ZB-V a worker runs
    /// several stages).
    pub fn worker_device(&self, depth: usize, stage: usize, replica: usize) -> tch::Device {
        if self.devices.is_empty() {
            return self.device;
        }
        let workers = self.schedule.workers(depth).unwrap_or(depth);
        let rank = Layout::new(workers, self.replicas.max(1)).placed(self.placement).rank(replica, self.schedule.worker_of(stage, depth));
        self.devices[rank % self.devices.len()]
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
    /// The update was skipped in every stage: fp16 gradients overflowed somewhere, or
    /// (`--on-nonfinite skip`) a loss or gradient was not finite.
    pub skipped: bool,
    /// The learning rate the step's update used (the schedule's, warm-up and decay in).
    pub lr: f64,
    /// The evaluation after this step, when the run evaluated.
    pub eval: Option<EvalResult>,
}

#[derive(Debug)]
pub struct TrainReport {
    /// Per stage: the newest trainable weights as (slot name, tensor).
    pub weights: Vec<Vec<(String, Tensor)>>,
    /// Per stage: running statistics (BatchNormalization mean and variance) as training
    /// left them, by name; replica 0's when there are several.
    pub buffers: Vec<Vec<(String, Tensor)>>,
    /// Per stage: the peak of live tensor bytes (replica 0) and its breakdown.
    pub memory: Vec<StageMemory>,
    /// Folders of the checkpoints written, in order.
    pub checkpoints: Vec<PathBuf>,
    /// Per step: mean microbatch loss.
    pub losses: Vec<f64>,
    /// Per stage: most weight versions held at once.
    pub peak_versions: Vec<usize>,
    /// Per stage (replica 0): reads of values not known before the step made by the
    /// stage's kernels over the run, each a device synchronisation on a GPU; zero when
    /// specialisation folded every shape computation ([`crate::exec::host_reads`]).
    pub host_reads: Vec<u64>,
    /// Per stage (replica 0): how many known values (stored constants and values folded
    /// from them and static shapes) were never uploaded because no kernel computes with
    /// them on the device (a Reshape's shape, a Slice's bounds), and their bytes.
    pub off_device: Vec<(usize, u64)>,
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
    /// `step` counts from 1, as the progress lines do.
    #[error(
        "step {step}, stage {stage}: the loss is {value} (not finite): training diverged and nothing of this step was saved; try a lower --lr, clip the gradients with --clip-norm (e.g. 1.0), or warm up with --warmup"
    )]
    NonFiniteLoss { step: usize, stage: usize, value: f64 },
    /// The first step of a run (`step` from 1): nothing was updated yet.
    #[error(
        "step {step}, stage {stage}: the loss is {value} (not finite) at the weights training started from, before any update: the model computes it from this data (synthetic data sets every integer input to 0, and an attention mask of zeros masks every position); train on real data (--data), or check the data for NaN or infinite values"
    )]
    NonFiniteFirstLoss { step: usize, stage: usize, value: f64 },
    /// `step` counts from 1, as the progress lines do.
    #[error("step {step}, stage {stage}: the optimizer update made weights non-finite (NaN or infinite gradients); nothing of this step was saved (try a lower --lr, or --clip-norm)")]
    NonFiniteWeights { step: usize, stage: usize },
    /// `--on-nonfinite skip` skipped `skips` steps in a row, the last `step` (from 1).
    #[error(
        "step {step}: {skips} steps in a row had a non-finite loss or gradients and were skipped (--max-skips {skips}): training diverged; try a lower --lr, clip the gradients with --clip-norm (e.g. 1.0), warm up with --warmup, or check the data for NaN or infinite values"
    )]
    TooManySkips { step: usize, skips: usize },
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
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
    /// `at`: when the step ended (the main thread may be busy evaluating when it arrives).
    Step { step: usize, replica: usize, loss: f64, samples: usize, skipped: bool, at: Instant },
    Checkpoint { step: u64, state: StageState },
    /// A stage's newest weights and running statistics after step `step`, for evaluation.
    Snapshot { step: usize, stage: usize, weights: Vec<Tensor>, stats: Vec<Tensor> },
}

/// Trains `stages` (any order; sorted by their header's stage index) for `cfg.steps`
/// batches drawn from `data`, one worker thread per stage and replica, calling `on_step`
/// after each update. A batch is `cfg.replicas * m` microbatches. Never hangs: a failing
/// worker closes its channels and aborts the reductions, and the others stop.
pub fn train(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    data: BatchStream,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    run_training(stages, cfg, None, data, on_step)
}

/// Continues the training `checkpoint` saved: weights (both 2BW versions), optimizer state
/// and running statistics are restored and training runs from batch `checkpoint.step` to
/// `cfg.steps`. `data` must yield the batches from `checkpoint.step` on (the same ones an
/// uninterrupted run would see there); with the same seed the result is bit-identical to
/// an uninterrupted run on CPU.
pub fn resume(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    checkpoint: Checkpoint,
    data: BatchStream,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    run_training(stages, cfg, Some(checkpoint), data, on_step)
}

/// [`train`] (or, with `checkpoint`, [`resume`]) that also evaluates `eval` after the steps
/// `cfg.eval` names (see [`eval`](self::eval)): each such step's report carries the
/// result. Training is the same as without it, bit for bit.
pub fn train_evaluated(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    checkpoint: Option<Checkpoint>,
    eval: EvalSet,
    data: BatchStream,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    run_training_with(stages, cfg, checkpoint, Some(eval), data, on_step)
}

fn empty_report(d: usize) -> TrainReport {
    TrainReport {
        weights: Vec::new(),
        buffers: Vec::new(),
        memory: vec![StageMemory::default(); d],
        checkpoints: Vec::new(),
        losses: Vec::new(),
        peak_versions: vec![0; d],
        host_reads: vec![0; d],
        off_device: vec![(0, 0); d],
        trace: Vec::new(),
    }
}

/// The identity the run holds its modules and checkpoint to: stage 0's compile, the stage
/// count and the schedule the run was given (recomputation may differ per stage: a plan
/// decides it stage by stage).
fn run_identity(stages: &[StageModule], cfg: &TrainConfig) -> Identity {
    let pipeline = stages.first().map(|s| s.program.pipeline.clone()).unwrap_or_default();
    Identity { pipeline, depth: u32::try_from(stages.len()).unwrap_or(u32::MAX), schedule: cfg.schedule, recompute: None }
}

/// Stage order and depth, and every module's identity, agree with the run (and with a
/// checkpoint).
fn check_stages(stages: &[StageModule], resume: Option<&Checkpoint>, cfg: &TrainConfig) -> Result<(), PipelineError> {
    let d = stages.len();
    if d == 0 {
        return Err(PipelineError::Config("no stages".into()));
    }
    let run = run_identity(stages, cfg);
    for (k, s) in stages.iter().enumerate() {
        let p = s.header.params;
        if p.stage as usize != k || p.depth as usize != d {
            return Err(PipelineError::Config(format!("stage {k}: header says stage {} of {}, have {d} stages", p.stage, p.depth)));
        }
        let message = match run.agree(&Identity::of_module(s)) {
            Ok(()) => continue,
            Err(x) if x.field == Field::Pipeline => format!("stage {k} comes from a different compile (pipeline id {:?}) than stage 0 ({:?})", x.theirs, x.ours),
            Err(x) => format!("stage {k}: its module's {}, but {}", x.theirs_text(), x.ours_text("the run")),
        };
        return Err(PipelineError::Config(format!("{message}; recompile and use one build folder's modules")));
    }
    if cfg.replicas == 0 {
        return Err(PipelineError::Config("the data-parallel width must be at least 1".into()));
    }
    if cfg.checkpoint_every.is_some() && cfg.checkpoint_dir.is_none() {
        return Err(PipelineError::Config("checkpoints need a folder (checkpoint_dir)".into()));
    }
    if let Some(ck) = resume {
        check_resume(ck, &run, cfg)?;
    }
    Ok(())
}

/// Whether checkpoint `ck` can continue a run of the pipeline `run` under `cfg`'s
/// settings (the same settings as the run that wrote it, unless `cfg.force_resume`).
pub fn check_resume(ck: &Checkpoint, run: &Identity, cfg: &TrainConfig) -> Result<(), PipelineError> {
    let written = Identity { pipeline: ck.pipeline.clone(), depth: u32::try_from(ck.stages.len()).unwrap_or(u32::MAX), schedule: ck.schedule, recompute: None };
    if let Err(x) = run.agree(&written) {
        return Err(PipelineError::Config(match x.field {
            Field::Depth => format!("the checkpoint holds {} stages, the pipeline has {}", x.theirs, x.ours),
            Field::Pipeline => format!("the checkpoint was written for pipeline {:?}, these modules are pipeline {:?}", x.theirs, x.ours),
            Field::Schedule | Field::Recompute => format!("the checkpoint was written under {} {}, the modules use {}", x.field.name(), x.theirs, x.ours),
        }));
    }
    if ck.step > cfg.steps as u64 {
        return Err(PipelineError::Config(format!("the checkpoint is at step {}, beyond the {} steps asked for", ck.step, cfg.steps)));
    }
    // A resumed run reaches the uninterrupted run's weights only under the same
    // settings; a silently different rate or seed would train something else.
    let differ = resume_differences(ck, cfg);
    if !differ.is_empty() && !cfg.force_resume {
        return Err(PipelineError::Config(format!(
            "this run differs from the one that wrote the checkpoint: {}; give the same options, or --force to continue anyway",
            differ.join(", ")
        )));
    }
    Ok(())
}

/// Each setting of `cfg`'s [`run_record`] that differs from the checkpoint's, as
/// `--lr 0.1 (checkpoint) -> 0.2 (this run)`: what a resume refuses, or with `--force`
/// goes on despite (and says so).
pub fn resume_differences(ck: &Checkpoint, cfg: &TrainConfig) -> Vec<String> {
    run_record(cfg)
        .iter()
        .filter_map(|(k, v)| match ck.config.get(k) {
            Some(was) if was != v => Some(format!("{k} {was} (checkpoint) -> {v} (this run)")),
            None => Some(format!("{k} unrecorded (checkpoint) -> {v} (this run)")),
            _ => None,
        })
        .collect()
}

/// The settings of a run that decide its weights, as recorded in its checkpoints and
/// compared on resume, and agreed on by every rank of an MPI job (the modules are bound
/// separately; the data by `settings`, which the caller fills). Every field of
/// [`TrainConfig`] is either here or named as not deciding the result in the test
/// `the_run_record_holds_every_setting_that_decides_the_result`.
pub fn run_record(cfg: &TrainConfig) -> BTreeMap<String, String> {
    let o = &cfg.optimizer;
    let l = &cfg.lr_schedule;
    let mut record: BTreeMap<String, String> = [
        ("--optimizer", o.kind.to_string()),
        ("--lr", format!("{:?}", cfg.lr)),
        ("--momentum", format!("{:?}", o.momentum)),
        ("beta1", format!("{:?}", o.beta1)),
        ("beta2", format!("{:?}", o.beta2)),
        ("eps", format!("{:?}", o.eps)),
        ("--weight-decay", format!("{:?}", o.weight_decay)),
        ("--clip-norm", cfg.clip_norm.map_or("none".into(), |c| format!("{c:?}"))),
        ("--warmup", l.warmup_steps.to_string()),
        ("--decay", l.decay.to_string()),
        ("--steps", cfg.steps.to_string()),
        ("--seed", cfg.seed.to_string()),
        ("--replicas", cfg.replicas.to_string()),
        ("--loss", format!("{}:{}", cfg.loss.loss, cfg.loss.output)),
        ("--ignore-index", cfg.loss.ignore_index.to_string()),
        ("--label-smoothing", format!("{:?}", cfg.loss.label_smoothing)),
        ("--precision", cfg.precision.to_string()),
        ("loss scale", format!("{:?} growing every {}", cfg.loss_scale.scale, cfg.loss_scale.growth_interval)),
        ("final lr", format!("{:?}", l.final_lr)),
        ("mode", format!("{:?}", cfg.mode)),
        ("--on-nonfinite", cfg.on_nonfinite.to_string()),
        ("--max-skips", cfg.max_skips.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    record.extend(cfg.settings.iter().map(|(k, v)| (k.clone(), v.clone())));
    record
}

/// Per replica and stage, the data channel of workers that read graph inputs or labels.
type DataLinks = (Vec<Vec<Option<mpsc::SyncSender<StageData>>>>, Vec<Vec<Option<mpsc::Receiver<StageData>>>>);

fn data_links(specs: &[stage::StageSpec], replicas: usize, cap: usize) -> DataLinks {
    let (mut txs, mut rxs) = (Vec::new(), Vec::new());
    for _ in 0..replicas {
        let (mut tx_row, mut rx_row) = (Vec::new(), Vec::new());
        for spec in specs {
            if spec.needs_data {
                let (tx, rx) = mpsc::sync_channel::<StageData>(cap);
                tx_row.push(Some(tx));
                rx_row.push(Some(rx));
            } else {
                tx_row.push(None);
                rx_row.push(None);
            }
        }
        txs.push(tx_row);
        rxs.push(rx_row);
    }
    (txs, rxs)
}

/// Deals each batch's microbatches round-robin to the replicas (microbatch `i` of batch
/// `t` becomes replica `i % w`'s microbatch `t*m + i/w`) and sends each stage that reads
/// data its graph inputs and labels.
#[allow(clippy::too_many_arguments)]
fn feed(
    batches: impl Iterator<Item = Result<Vec<Microbatch>, String>>,
    first_step: usize,
    steps: usize,
    m: usize,
    txs: Vec<Vec<Option<mpsc::SyncSender<StageData>>>>,
    input_names: Vec<Vec<String>>,
    err: mpsc::Sender<PipelineError>,
) {
    let w = txs.len();
    let mut fed = first_step;
    for (t, batch) in (first_step..steps).zip(batches) {
        let batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                let _ = err.send(PipelineError::Data(e));
                return;
            }
        };
        if batch.len() != m * w {
            let _ = err.send(PipelineError::Data(format!("batch {t} has {} microbatches, expected {}", batch.len(), m * w)));
            return;
        }
        for (i, micro) in batch.into_iter().enumerate() {
            let (r, mb) = (i % w, (t * m + i / w) as u64);
            let samples = micro.inputs.first().map(|(_, x)| x.size().first().copied().unwrap_or(1)).unwrap_or(0) as usize;
            for (k, tx) in txs[r].iter().enumerate() {
                let Some(tx) = tx else { continue };
                let mut inputs = Vec::new();
                for name in &input_names[k] {
                    match micro.inputs.iter().find(|(n, _)| n == name) {
                        Some((_, x)) => inputs.push(x.shallow_clone()),
                        None => {
                            let _ = err.send(PipelineError::Data(format!("microbatch {i} of batch {t} lacks graph input {name:?} (stage {k})")));
                            return;
                        }
                    }
                }
                let labels = micro.labels.as_ref().map(|l| l.shallow_clone());
                if tx.send(StageData { mb, inputs, labels, samples }).is_err() {
                    return; // the stage stopped; its error is reported by it
                }
            }
        }
        fed += 1;
    }
    if fed < steps {
        let _ = err.send(PipelineError::Data(format!("the data ran out after {fed} of {steps} batches")));
    }
}

fn run_training(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    resume: Option<Checkpoint>,
    data: BatchStream,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    let cfg = TrainConfig { eval: EvalPoints::Never, ..cfg.clone() };
    run_training_with(stages, &cfg, resume, None, data, on_step)
}

fn run_training_with(
    stages: Vec<StageModule>,
    cfg: &TrainConfig,
    resume: Option<Checkpoint>,
    eval: Option<EvalSet>,
    data: BatchStream,
    on_step: &mut dyn FnMut(StepReport),
) -> Result<TrainReport, PipelineError> {
    let mut stages = stages;
    stages.sort_by_key(|s| s.header.params.stage);
    check_stages(&stages, resume.as_ref(), cfg)?;
    let (d, w) = (stages.len(), cfg.replicas);
    let start = resume.as_ref().map_or(0, |c| c.step as usize);
    if cfg.steps == start {
        return Ok(empty_report(d));
    }
    let (pipeline_id, schedule) = (stages[0].program.pipeline.clone(), cfg.schedule);
    let specs = stage::specs(&stages, &cfg.loss)?;
    let evaluator = match eval {
        Some(set) if cfg.eval != EvalPoints::Never => Some(eval::Evaluator::new(&specs, cfg, set)?),
        _ => None,
    };
    let tied: Vec<Vec<u32>> = tied_sets(&stages)?;
    drop(stages);
    // m (per replica) comes from the first batch.
    let mut data = data;
    let first = data.next().ok_or_else(|| PipelineError::Data("the data iterator is empty".into()))?.map_err(PipelineError::Data)?;
    if first.is_empty() || first.len() % w != 0 {
        return Err(PipelineError::Data(format!("batch {start} has {} microbatches, which {w} replica(s) cannot share evenly", first.len())));
    }
    let m = first.len() / w;
    // Per replica and stage: its ops, and its turns where its worker runs other stages.
    let mut orders = Vec::new();
    for _ in 0..w {
        orders.push(turns::Turns::for_pipeline(cfg.schedule, d, m, start, cfg.steps).map_err(PipelineError::Config)?);
    }
    let (data_tx, data_rx) = data_links(&specs, w, 2 * m + d);
    let input_names: Vec<Vec<String>> = specs.iter().map(|s| s.graph_input_names.clone()).collect();
    let steps = cfg.steps;
    let (err_tx, err_rx) = mpsc::channel::<PipelineError>();
    let feeder_err = err_tx.clone();
    let feeder = std::thread::spawn(move || feed(std::iter::once(Ok(first)).chain(data), start, steps, m, data_tx, input_names, feeder_err));
    drop(err_tx);

    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let epoch = cfg.trace.then(Instant::now);
    let mut resume_states: Vec<Option<StageState>> = match resume {
        Some(ck) => ck.stages.into_iter().map(Some).collect(),
        None => (0..d).map(|_| None).collect(),
    };
    let mut handles = Vec::new();
    for (r, ((row, rx_row), order)) in transport::InProcess::grid(d, w, &tied, cfg.timeout).into_iter().zip(data_rx).zip(orders).enumerate() {
        for (k, ((tr, rx), (ops, turns))) in row.into_iter().zip(rx_row).zip(order).enumerate() {
            let saved = if r + 1 == w { resume_states[k].take() } else { resume_states[k].as_ref().map(copy_state) };
            // Each worker computes on its own device; boundary tensors are moved to it as
            // they arrive.
            let mut placed = cfg.clone();
            placed.device = cfg.worker_device(d, k, r);
            let args = stage::WorkerArgs {
                spec: specs[k].clone(),
                replica: r,
                replicas: w,
                ops,
                turns,
                m,
                cfg: placed,
                data: rx,
                transport: Box::new(tr),
                events: ev_tx.clone(),
                epoch,
                start_step: start as u64,
                resume: saved,
            };
            let h = std::thread::Builder::new()
                .name(format!("pipewright-r{r}-stage{k}"))
                .spawn(move || stage::run(args))
                .map_err(|e| PipelineError::Stage { stage: k, message: format!("cannot spawn thread: {e}") })?;
            handles.push((k, h));
        }
    }
    drop(ev_tx);
    let mut events = EventSink::new(d, w, cfg, pipeline_id, schedule, on_step);
    events.evaluator = evaluator;
    for ev in ev_rx {
        events.handle(ev);
    }
    events.flush(true);
    let (losses, checkpoints, checkpoint_error, eval_error) = (events.losses, events.written, events.error, events.eval_error);
    let mut report = empty_report(d);
    report.losses = losses;
    report.checkpoints = checkpoints;
    let mut primary: Option<PipelineError> = None;
    let mut secondary: Option<PipelineError> = None;
    for (i, (k, h)) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(out)) => {
                report.peak_versions[k] = report.peak_versions[k].max(out.peak_versions);
                if i < d {
                    report.host_reads[k] = out.host_reads;
                    report.off_device[k] = out.off_device;
                    report.weights.push(out.weights);
                    report.buffers.push(out.buffers);
                    report.memory[k] = out.memory;
                    report.trace.extend(out.trace);
                }
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
    if let Some(e) = checkpoint_error {
        return Err(e.into());
    }
    if let Some(e) = eval_error {
        return Err(e);
    }
    Ok(report)
}

/// A worker process's view of its stage: what it receives and sends (by wire name).
pub fn boundary_names(module: &StageModule, loss: &Objective) -> Result<(Vec<String>, Vec<String>), PipelineError> {
    let spec = stage::spec_alone(module, loss)?;
    let p = &spec.program;
    let name = |s: &crate::program::SlotId| p.slots[s.index()].name.clone();
    Ok((p.inputs[..spec.n_recv].iter().map(name).collect(), p.outputs[..spec.n_send].iter().map(name).collect()))
}

/// What a worker process does with what its stage reports.
pub struct WorkerHooks<'a> {
    /// Called on the last stage after each step.
    pub on_step: &'a mut dyn FnMut(StepReport),
    /// Replica 0, with `TrainConfig::checkpoint_every`: this stage's state after `step`
    /// batches, to be written; returns the folder of the checkpoint where this process
    /// committed it (e.g. [`Mpi::checkpoint`]).
    pub on_checkpoint: &'a mut dyn FnMut(u64, StageState) -> Result<Option<PathBuf>, String>,
    /// Replica 0, with `TrainConfig::eval`: the evaluation set and the link to the
    /// neighbouring stages' processes (see [`eval`](self::eval)).
    pub eval: Option<(EvalSet, Box<dyn EvalLink>)>,
    /// With `TrainConfig::trace`: when the job's traces start (e.g. [`Agreed::clock`]), so
    /// that the ranks' traces share a time origin; `None`: when this worker starts.
    pub trace_origin: Option<std::time::SystemTime>,
}

/// Runs one stage of one replica in this process, linked to the other workers by
/// `transport` (e.g. [`Mpi`]): the same worker the embedded executor runs per thread.
/// Under a schedule that runs several stages per worker, `turns` links it to its worker's
/// other stages (e.g. [`MpiTurns`]), whose ops it takes turns with in the worker's order.
/// `data` yields whole batches (`replicas * m` microbatches, from the first step on, or
/// from `resume`'s step on); this worker takes its replica's share. `resume`: the step
/// to continue after and this stage's saved state ([`check_resume`] the checkpoint
/// first). The report holds this stage only (index 0).
#[allow(clippy::too_many_arguments)]
pub fn run_worker(
    module: StageModule,
    cfg: &TrainConfig,
    replica: usize,
    transport: Box<dyn Transport>,
    turns: Option<Box<dyn TurnLink>>,
    data: BatchStream,
    resume: Option<(u64, StageState)>,
    hooks: WorkerHooks<'_>,
) -> Result<TrainReport, PipelineError> {
    let (k, d, w) = (module.header.params.stage as usize, module.header.params.depth as usize, cfg.replicas.max(1));
    let run = Identity { pipeline: module.program.pipeline.clone(), depth: module.header.params.depth, schedule: cfg.schedule, recompute: None };
    if let Err(x) = run.agree(&Identity::of_module(&module)) {
        return Err(PipelineError::Config(format!("stage {k}: its module's {}, but {}", x.theirs_text(), x.ours_text("the run"))));
    }
    if cfg.checkpoint_every.is_some() && cfg.checkpoint_dir.is_none() {
        return Err(PipelineError::Config("checkpoints need a folder (checkpoint_dir)".into()));
    }
    let (start, saved) = match resume {
        Some((step, state)) => (step as usize, Some(state)),
        None => (0, None),
    };
    if replica >= w {
        return Err(PipelineError::Config(format!("replica {replica} of {w}")));
    }
    let spec = stage::spec_alone(&module, &cfg.loss)?;
    let mut data = data;
    let first = data.next().ok_or_else(|| PipelineError::Data("the data iterator is empty".into()))?.map_err(PipelineError::Data)?;
    if first.is_empty() || first.len() % w != 0 {
        return Err(PipelineError::Data(format!("batch {start} has {} microbatches, which {w} replica(s) cannot share evenly", first.len())));
    }
    let m = first.len() / w;
    let (ops, turns) = turns::Turns::for_stage(cfg.schedule, k, d, m, start, cfg.steps, turns).map_err(PipelineError::Config)?;
    // Only this worker's data channel exists; the feeder skips the others.
    let mut txs: Vec<Vec<Option<mpsc::SyncSender<StageData>>>> = (0..w).map(|_| (0..d).map(|_| None).collect()).collect();
    let rx = if spec.needs_data {
        let (tx, rx) = mpsc::sync_channel::<StageData>(2 * m + d);
        txs[replica][k] = Some(tx);
        Some(rx)
    } else {
        None
    };
    let mut input_names = vec![Vec::new(); d];
    input_names[k] = spec.graph_input_names.clone();
    let (err_tx, err_rx) = mpsc::channel::<PipelineError>();
    let steps = cfg.steps;
    let feeder = std::thread::spawn(move || feed(std::iter::once(Ok(first)).chain(data), start, steps, m, txs, input_names, err_tx));
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let mut placed = cfg.clone();
    placed.device = cfg.worker_device(d, k, replica);
    let WorkerHooks { on_step, on_checkpoint, eval, trace_origin } = hooks;
    let evaluator = match eval {
        Some((set, link)) if replica == 0 && cfg.eval != EvalPoints::Never => Some(eval::Evaluator::for_stage(&spec, cfg, set, link)?),
        _ => None,
    };
    let args = stage::WorkerArgs {
        spec,
        replica,
        replicas: w,
        ops,
        turns,
        m,
        cfg: placed,
        data: rx,
        transport,
        events: ev_tx,
        epoch: cfg.trace.then(|| instant_of(trace_origin)),
        start_step: start as u64,
        resume: saved,
    };
    let h = std::thread::Builder::new()
        .name(format!("pipewright-r{replica}-stage{k}"))
        .spawn(move || stage::run(args))
        .map_err(|e| PipelineError::Stage { stage: k, message: format!("cannot spawn thread: {e}") })?;
    let mut sink = EventSink::new(1, 1, cfg, module.program.pipeline.clone(), cfg.schedule, on_step);
    sink.evaluator = evaluator;
    let (mut written, mut checkpoint_error) = (Vec::new(), None);
    for ev in ev_rx {
        match ev {
            Event::Checkpoint { step, state } => match on_checkpoint(step, state) {
                Ok(dir) => written.extend(dir),
                // As in the embedded executor: training goes on, the run fails at its end.
                Err(e) => {
                    checkpoint_error.get_or_insert(e);
                }
            },
            // This process's sink sees one replica and one stage, whichever they are.
            Event::Step { step, loss, samples, skipped, at, .. } => sink.handle(Event::Step { step, replica: 0, loss, samples, skipped, at }),
            Event::Snapshot { step, weights, stats, .. } => sink.handle(Event::Snapshot { step, stage: 0, weights, stats }),
        }
    }
    sink.flush(true);
    let (losses, eval_error) = (sink.losses, sink.eval_error);
    let out = h.join().map_err(|_| PipelineError::Stage { stage: k, message: "worker thread panicked".into() })?;
    let _ = feeder.join();
    let out = match out {
        Ok(out) => out,
        Err(f) => {
            if let Ok(e) = err_rx.try_recv() {
                return Err(e);
            }
            return Err(f.error);
        }
    };
    if let Some(e) = checkpoint_error {
        return Err(PipelineError::Stage { stage: k, message: e });
    }
    if let Some(e) = eval_error {
        return Err(e);
    }
    let mut report = empty_report(1);
    report.losses = losses;
    report.checkpoints = written;
    report.weights = vec![out.weights];
    report.buffers = vec![out.buffers];
    report.memory = vec![out.memory];
    report.peak_versions = vec![out.peak_versions];
    report.host_reads = vec![out.host_reads];
    report.off_device = vec![out.off_device];
    report.trace = out.trace;
    Ok(report)
}

/// The instant `origin` was on this process's monotonic clock (now when `None`, or when
/// `origin` lies ahead of the wall clock or too far behind the process's start).
fn instant_of(origin: Option<std::time::SystemTime>) -> Instant {
    let (now, wall) = (Instant::now(), std::time::SystemTime::now());
    let ago = origin.and_then(|o| wall.duration_since(o).ok()).unwrap_or_default();
    now.checked_sub(ago).unwrap_or(now)
}

/// The stage sets sharing tied weights, checked: every stage of a set must hold a copy of
/// the same weights, or their gradient sums would pair different tensors (or wait for a
/// stage that never joins).
fn tied_sets(stages: &[StageModule]) -> Result<Vec<Vec<u32>>, PipelineError> {
    // Per stage set: per member stage, the names of the tied weights it holds.
    let mut held: Vec<(Vec<u32>, BTreeMap<u32, Vec<String>>)> = Vec::new();
    for s in stages {
        let p = &s.program;
        for t in p.stored.iter().filter(|t| t.sync.len() > 1) {
            let at = match held.iter().position(|(set, _)| *set == t.sync) {
                Some(i) => i,
                None => {
                    held.push((t.sync.clone(), BTreeMap::new()));
                    held.len() - 1
                }
            };
            held[at].1.entry(s.header.params.stage).or_default().push(p.slots[t.slot.index()].name.clone());
        }
    }
    for (set, by_stage) in &mut held {
        by_stage.values_mut().for_each(|names| names.sort());
        let first = by_stage.values().next().cloned().unwrap_or_default();
        for &k in set.iter() {
            let mine = by_stage.get(&k).cloned().unwrap_or_default();
            if mine != first {
                return Err(PipelineError::Config(format!(
                    "stages {set:?} share tied weights, but stage {k} holds {mine:?} where stage {} holds {first:?}; recompile the model",
                    by_stage.keys().next().copied().unwrap_or(0)
                )));
            }
        }
    }
    Ok(held.into_iter().map(|(set, _)| set).collect())
}

fn copy_state(s: &StageState) -> StageState {
    let c = |v: &Vec<(String, Tensor)>| v.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
    StageState {
        stage: s.stage,
        newest: c(&s.newest),
        shadow: c(&s.shadow),
        opt_steps: s.opt_steps,
        opt_m: c(&s.opt_m),
        opt_v: c(&s.opt_v),
        buffers: c(&s.buffers),
        loss_scale: s.loss_scale.clone(),
        skips_in_a_row: s.skips_in_a_row,
    }
}

/// The main thread's side of the workers' events: step reports (merged over replicas)
/// and checkpoint parts (written once every stage's part of a step has arrived).
struct EventSink<'a> {
    d: usize,
    w: usize,
    /// The modules' schedule name (`2bw`, `flush`, `gpipe`), recorded in checkpoints.
    schedule: Schedule,
    pipeline: String,
    dir: Option<PathBuf>,
    /// The run's settings, bound into every checkpoint ([`run_record`]).
    record: BTreeMap<String, String>,
    on_step: &'a mut dyn FnMut(StepReport),
    /// Per step not yet reported: each replica's loss (summed in replica order, so the
    /// reported loss does not depend on which replica finished first), samples, skipped.
    pending_steps: std::collections::BTreeMap<usize, (Vec<Option<f64>>, usize, bool)>,
    pending_ckpt: std::collections::BTreeMap<u64, Vec<StageState>>,
    /// The base rate and its schedule, for each step's report.
    lr: (f64, LrSchedule),
    last: Instant,
    losses: Vec<f64>,
    written: Vec<PathBuf>,
    error: Option<CheckpointError>,
    /// Evaluation (runs that asked for it): the steps to evaluate after (of the
    /// run's `steps`), the stages' snapshots gathering per step, the results, and the step
    /// reports held back (in order) until their step's evaluation is done.
    eval_points: EvalPoints,
    steps: usize,
    evaluator: Option<eval::Evaluator>,
    snapshots: BTreeMap<usize, Vec<Option<eval::Snapshot>>>,
    evals: BTreeMap<usize, EvalResult>,
    held: BTreeMap<usize, StepReport>,
    eval_error: Option<PipelineError>,
}

impl<'a> EventSink<'a> {
    fn new(d: usize, w: usize, cfg: &TrainConfig, pipeline: String, schedule: Schedule, on_step: &'a mut dyn FnMut(StepReport)) -> Self {
        EventSink {
            d,
            w,
            schedule,
            pipeline,
            dir: cfg.checkpoint_dir.clone(),
            record: run_record(cfg),
            on_step,
            pending_steps: Default::default(),
            pending_ckpt: Default::default(),
            lr: (cfg.lr, cfg.lr_schedule),
            last: Instant::now(),
            losses: Vec::new(),
            written: Vec::new(),
            error: None,
            eval_points: cfg.eval,
            steps: cfg.steps,
            evaluator: None,
            snapshots: BTreeMap::new(),
            evals: BTreeMap::new(),
            held: BTreeMap::new(),
            eval_error: None,
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Step { step, replica, loss, samples, skipped, at } => {
                let w = self.w;
                let e = self.pending_steps.entry(step).or_insert_with(|| (vec![None; w], 0, false));
                if let Some(slot) = e.0.get_mut(replica) {
                    *slot = Some(loss);
                }
                e.1 += samples;
                e.2 |= skipped;
                if e.0.iter().all(Option::is_some) {
                    let (losses, samples, skipped) = self.pending_steps.remove(&step).unwrap_or_default();
                    // Timed by when the step ended, not when this thread got to it.
                    let now = at.max(self.last);
                    let loss = losses.iter().flatten().sum::<f64>() / self.w as f64;
                    self.losses.push(loss);
                    let lr = self.lr.1.at(self.lr.0, step);
                    self.held.insert(step, StepReport { step, loss, samples, seconds: now.duration_since(self.last).as_secs_f64(), skipped, lr, eval: None });
                    self.last = now;
                    self.flush(false);
                }
            }
            Event::Snapshot { step, stage, weights, stats } => {
                if self.evaluator.is_none() {
                    return;
                }
                let d = self.d;
                let parts = self.snapshots.entry(step).or_insert_with(|| (0..d).map(|_| None).collect());
                if let Some(slot) = parts.get_mut(stage) {
                    *slot = Some(eval::Snapshot { weights, stats });
                }
                if parts.iter().all(Option::is_some) {
                    let parts: Vec<eval::Snapshot> = self.snapshots.remove(&step).unwrap_or_default().into_iter().flatten().collect();
                    self.evaluate(step, parts);
                }
            }
            Event::Checkpoint { step, state } => {
                let parts = self.pending_ckpt.entry(step).or_default();
                parts.push(state);
                if parts.len() == self.d {
                    let mut parts = self.pending_ckpt.remove(&step).unwrap_or_default();
                    parts.sort_by_key(|s| s.stage);
                    self.write(step, parts);
                }
            }
        }
    }

    /// Step `step`'s evaluation; a failure stops further evaluation and is the run's error.
    fn evaluate(&mut self, step: usize, parts: Vec<eval::Snapshot>) {
        let Some(evaluator) = self.evaluator.as_mut() else { return };
        match evaluator.run(parts) {
            Ok(r) => {
                self.evals.extend(r.map(|r| (step, r)));
            }
            Err(e) => {
                self.eval_error = Some(e);
                self.evaluator = None;
            }
        }
        self.flush(false);
    }

    /// Reports the held step reports in order, each once its evaluation (if due) is done;
    /// `all`: every one left, the run having ended.
    fn flush(&mut self, all: bool) {
        self.flush_with(all, self.evaluator.is_some());
    }

    /// [`EventSink::flush`], `evaluating`: whether evaluations are still to come.
    fn flush_with(&mut self, all: bool, evaluating: bool) {
        while let Some((&step, _)) = self.held.first_key_value() {
            let waits = evaluating && self.eval_points.due(step, self.steps) && !self.evals.contains_key(&step);
            if waits && !all {
                return;
            }
            let Some(mut report) = self.held.remove(&step) else { return };
            report.eval = self.evals.remove(&step);
            (self.on_step)(report);
        }
    }

    fn write(&mut self, step: u64, stages: Vec<StageState>) {
        let (Some(dir), None) = (&self.dir, &self.error) else { return };
        let ck = Checkpoint { step, pipeline: self.pipeline.clone(), schedule: self.schedule, config: self.record.clone(), stages };
        match write_checkpoint(dir, &ck) {
            Ok(p) => self.written.push(p),
            Err(e) => self.error = Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of [`TrainConfig`] is named here, so that a new one does not build
    /// until it is placed: a change of each one that decides the result changes
    /// [`run_record`] (so a resume and every MPI rank must agree on it), and the others say
    /// why they do not decide it.
    #[test]
    fn the_run_record_holds_every_setting_that_decides_the_result() {
        let base = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::CrossEntropy, "y"), 0.1, 10);
        let TrainConfig {
            schedule: _,       // the modules' (their identity is bound apart)
            lr: _,             // below
            lr_schedule: _,    // below
            optimizer: _,      // below
            clip_norm: _,      // below
            steps: _,          // below
            seed: _,           // below
            device: _,         // where, not what (placement keeps results)
            mode: _,           // below
            loss: _,           // below
            trace: _,          // a timeline on the side
            replicas: _,       // below
            checkpoint_every: _, // when snapshots are taken
            checkpoint_dir: _, // where snapshots go
            threads: _,        // speed only (kernels are deterministic per thread count in tests)
            timeout: _,        // when a stall is an error
            settings: _,       // the caller's (microbatch, data): recorded as they are
            force_resume: _,   // how a difference is treated
            precision: _,      // below
            loss_scale: _,     // below
            devices: _,        // where, not what
            placement: _,      // which rank runs what; sums keep the replicas' order either way
            on_nonfinite: _,   // below
            max_skips: _,      // below
            stop: _,           // when the run ends, agreed by every worker
            eval: _,           // evaluation reads the weights, never changes them
        } = base.clone();
        let changes: Vec<(&str, Box<dyn Fn(&mut TrainConfig)>)> = vec![
            ("--lr", Box::new(|c| c.lr = 0.2)),
            ("--warmup", Box::new(|c| c.lr_schedule.warmup_steps = 2)),
            ("--decay", Box::new(|c| c.lr_schedule.decay = pipewright_core::Decay::Cosine)),
            ("final lr", Box::new(|c| c.lr_schedule.final_lr = 0.01)),
            ("--optimizer", Box::new(|c| c.optimizer.kind = pipewright_core::Optimizer::Adam)),
            ("--momentum", Box::new(|c| c.optimizer.momentum = 0.9)),
            ("beta1", Box::new(|c| c.optimizer.beta1 = 0.8)),
            ("beta2", Box::new(|c| c.optimizer.beta2 = 0.9)),
            ("eps", Box::new(|c| c.optimizer.eps = 1e-6)),
            ("--weight-decay", Box::new(|c| c.optimizer.weight_decay = 0.1)),
            ("--clip-norm", Box::new(|c| c.clip_norm = Some(1.0))),
            ("--steps", Box::new(|c| c.steps = 11)),
            ("--seed", Box::new(|c| c.seed = 1)),
            ("mode", Box::new(|c| c.mode = Mode::Eval)),
            ("--loss", Box::new(|c| c.loss.loss = Loss::Mse)),
            ("--ignore-index", Box::new(|c| c.loss.ignore_index = 0)),
            ("--label-smoothing", Box::new(|c| c.loss.label_smoothing = 0.1)),
            ("--replicas", Box::new(|c| c.replicas = 2)),
            ("--precision", Box::new(|c| c.precision = Precision::Bf16)),
            ("loss scale", Box::new(|c| c.loss_scale.growth_interval += 1)),
            ("--on-nonfinite", Box::new(|c| c.on_nonfinite = NonFinite::Skip)),
            ("--max-skips", Box::new(|c| c.max_skips += 1)),
        ];
        let before = run_record(&base);
        for (key, change) in changes {
            let mut c = base.clone();
            change(&mut c);
            let after = run_record(&c);
            assert_ne!(before.get(key), after.get(key), "{key}: a change is not recorded");
        }
    }

    /// The reported loss of a step sums the replicas' losses in replica order, whatever
    /// order they arrive in: with three replicas floating-point addition is not
    /// associative, and an arrival-order sum made the reported loss vary between runs (and
    /// differ from the multi-process job's, which sums in replica order).
    #[test]
    fn replica_losses_are_summed_in_replica_order() {
        let losses = [1e16, 1.0, -1e16];
        let want = (losses[0] + losses[1] + losses[2]) / 3.0;
        for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0]] {
            let cfg = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::Mse, "y"), 0.1, 1);
            let mut seen = Vec::new();
            let mut on_step = |s: StepReport| seen.push(s.loss);
            let mut sink = EventSink::new(1, 3, &cfg, "p".into(), Schedule::TwoBw, &mut on_step);
            for r in order {
                sink.handle(Event::Step { step: 0, replica: r, loss: losses[r], samples: 1, skipped: false, at: Instant::now() });
            }
            drop(sink);
            assert_eq!(seen.len(), 1, "{order:?}");
            assert_eq!(seen[0].to_bits(), want.to_bits(), "{order:?}: {} vs {want}", seen[0]);
        }
    }

    /// `--devices` follows the rank: the device of worker (r, k) is the one its MPI rank
    /// gets under the build's placement, so per-node GPU lists give each rank of a node its
    /// own GPU.
    #[test]
    fn worker_devices_follow_the_rank() {
        let mut cfg = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::Mse, "y"), 0.1, 1);
        cfg.replicas = 2;
        cfg.devices = (0..6).map(tch::Device::Cuda).collect();
        for placement in [Placement::StageMajor, Placement::ReplicaMajor] {
            cfg.placement = placement;
            let layout = Layout::new(3, 2).placed(placement);
            for k in 0..3 {
                for r in 0..2 {
                    assert_eq!(cfg.worker_device(3, k, r), tch::Device::Cuda(layout.rank(r, k)), "{placement} replica {r} stage {k}");
                }
            }
        }
        // Stage 1 of replica 0 is rank 1 replica-major, rank 2 stage-major.
        assert_eq!(cfg.worker_device(3, 1, 0), tch::Device::Cuda(1));
        cfg.placement = Placement::StageMajor;
        assert_eq!(cfg.worker_device(3, 1, 0), tch::Device::Cuda(2));
        // Two devices for two replicas: each replica's stages on one device.
        cfg.devices = vec![tch::Device::Cuda(0), tch::Device::Cuda(1)];
        assert_eq!((0..3).map(|k| cfg.worker_device(3, k, 1)).collect::<Vec<_>>(), vec![tch::Device::Cuda(1); 3]);
        // Replica-major, three devices for three stages: stage k on device k.
        cfg.placement = Placement::ReplicaMajor;
        cfg.devices = (0..3).map(tch::Device::Cuda).collect();
        assert_eq!((0..3).map(|k| cfg.worker_device(3, k, 1)).collect::<Vec<_>>(), (0..3).map(tch::Device::Cuda).collect::<Vec<_>>());
        cfg.devices.clear();
        assert_eq!(cfg.worker_device(3, 2, 1), tch::Device::Cpu);
    }

    /// The steps evaluated after: none, the last only, or every n-th and the last.
    #[test]
    fn evaluation_points_are_every_nth_step_and_the_last() {
        let mut cfg = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::Mse, "y"), 0.1, 10);
        let due = |cfg: &TrainConfig| (0..cfg.steps).filter(|&t| cfg.eval_due(t)).map(|t| t + 1).collect::<Vec<_>>();
        assert!(due(&cfg).is_empty());
        cfg.eval = EvalPoints::AtEnd;
        assert_eq!(due(&cfg), [10]);
        cfg.eval = EvalPoints::Every(4);
        assert_eq!(due(&cfg), [4, 8, 10]);
        cfg.eval = EvalPoints::Every(5);
        assert_eq!(due(&cfg), [5, 10]);
    }

    /// A step report waits for its step's evaluation, and the reports after it wait
    /// behind it, so reports arrive in step order, each with its evaluation; at the end
    /// whatever is held is reported.
    #[test]
    fn step_reports_wait_in_order_for_their_evaluation() {
        let mut cfg = TrainConfig::new(Schedule::TwoBw, Objective::new(Loss::Mse, "y"), 0.1, 3);
        cfg.eval = EvalPoints::Every(1);
        let mut seen: Vec<(usize, Option<f64>)> = Vec::new();
        let mut on_step = |r: StepReport| seen.push((r.step, r.eval.map(|e| e.loss)));
        let mut sink = EventSink::new(1, 1, &cfg, "p".into(), Schedule::TwoBw, &mut on_step);
        sink.evaluator = None;
        // Without an evaluator nothing waits.
        sink.handle(Event::Step { step: 0, replica: 0, loss: 1.0, samples: 1, skipped: false, at: Instant::now() });
        assert_eq!(sink.held.len(), 0);
        // With results arriving late: step 1 waits for its evaluation, step 2 behind it.
        sink.held.insert(1, StepReport { step: 1, loss: 1.0, samples: 1, seconds: 0.0, skipped: false, lr: 0.1, eval: None });
        sink.held.insert(2, StepReport { step: 2, loss: 1.0, samples: 1, seconds: 0.0, skipped: false, lr: 0.1, eval: None });
        sink.evals.insert(2, EvalResult { loss: 0.2, accuracy: None, samples: 4 });
        let waiting = |sink: &EventSink<'_>| sink.held.keys().copied().collect::<Vec<_>>();
        sink.flush_with(false, true);
        assert_eq!(waiting(&sink), [1, 2], "step 2's result is in, but step 1 is still evaluating");
        sink.evals.insert(1, EvalResult { loss: 0.1, accuracy: None, samples: 4 });
        sink.flush_with(false, true);
        assert!(waiting(&sink).is_empty());
        drop(sink);
        assert_eq!(seen, [(0, None), (1, Some(0.1)), (2, Some(0.2))]);
    }
}
