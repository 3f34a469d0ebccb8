//! `pipewright train` (the embedded executor: every stage and replica a thread of this
//! process) and `pipewright worker` / stage executables (one stage of one replica per
//! process, an MPI job: see the runtime's `pipeline::distributed`).
//!
//! Both take the pipeline's shape from the build: the schedule and recomputation the
//! stages were compiled for, and the microbatch size, microbatches per step and replicas
//! when the compile decided them (a plan), each overridable by a flag; [`RunShape`] says
//! where every value came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pipewright_core::{DataOrder, Decay, Device, Loss, NonFinite, Optimizer, Placement, Precision, Recompute, RunFlags, RunShape, Schedule, TokenType};
use pipewright_runtime::build::{Build, Identity, Manifest, MANIFEST_FILE};
use pipewright_runtime::data::{DataError, Dataset, LabelArray, MicrobatchData, Stop, DEFAULT_LABEL};
use pipewright_runtime::tokens::{is_token_file, TokenFile, TokenWindows};
use pipewright_runtime::device::tch_device;
use pipewright_runtime::module::{decode_module_bytes, read_module, StageModule};
use pipewright_core::fs::write_atomic;
use pipewright_core::lock::FolderLock;
use pipewright_core::timeline::chrome_trace_json;
use pipewright_core::units::human_bytes;
use pipewright_runtime::pipeline::{
    batch_fingerprint, check_resume, read_checkpoint, resume, resume_differences, run_record, run_worker, train, train_evaluated, BatchStream, Checkpoint, EvalLink, EvalPoints, EvalResult, EvalSet, Layout, Reduction, LrSchedule, Microbatch, Mpi, MpiTurns, Objective, OptimizerConfig,
    StageState, TrainConfig, TurnLink, WorkerHooks,
};

/// The runtime's types a command sees: each step's report, the run's, and the MPI job.
pub use pipewright_runtime::pipeline::{MpiJob, StepReport, StopGate, TrainReport};

use crate::export::WEIGHTS_FILE;
use crate::DriverError;

/// Where the training data comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataSource {
    /// Seeded random inputs, and labels shaped for the loss.
    Synthetic,
    /// A `.npz`, a `.npy` or a folder of them, or a `.safetensors` file.
    File(PathBuf),
}

/// What a training run is asked to do (the options of `train`, `worker` and stage
/// executables).
#[derive(Clone, Debug)]
pub struct TrainRequest {
    pub data: DataSource,
    /// The labels array in the data.
    pub label: Option<String>,
    pub loss: Loss,
    /// The model output the loss applies to (`None`: the model's only output).
    pub output: Option<String>,
    /// Classes of synthetic labels (`None`: the size of the output's last axis, else
    /// [`DEFAULT_CLASSES`]).
    pub classes: Option<i64>,
    /// Cross-entropy: labels equal to this are skipped (PyTorch's `ignore_index`).
    pub ignore_index: i64,
    /// Cross-entropy label smoothing, in `[0, 1]`.
    pub label_smoothing: f64,
    pub steps: usize,
    /// Overrides of the build's microbatch, microbatches and replicas.
    pub flags: RunFlags,
    pub lr: f64,
    pub optimizer: Optimizer,
    /// SGD momentum.
    pub momentum: f64,
    pub weight_decay: f64,
    pub warmup: usize,
    pub decay: Decay,
    pub clip_norm: Option<f64>,
    pub seed: u64,
    pub device: Device,
    pub trace: bool,
    /// Write a checkpoint every this many steps into `checkpoint_dir` (default:
    /// `BUILD/checkpoints`).
    pub checkpoint_every: Option<usize>,
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from a checkpoint (a step folder, or a checkpoints folder).
    pub resume: Option<PathBuf>,
    /// Resume even where this run's settings differ from the checkpoint's.
    pub force: bool,
    /// Intra-op threads per worker.
    pub threads: Option<usize>,
    /// How long a stage waits for a neighbour or a reduction before it stops with an error.
    pub timeout: Duration,
    /// The most bytes decompressed from an `.npz` data file.
    pub max_inflated: u64,
    /// The data is a flat token file of this type (`--tokens`); a 1-D `.npy` is one
    /// without it.
    pub tokens: Option<TokenType>,
    /// The order samples (or token windows) are visited in.
    pub data_order: DataOrder,
    /// A held-out set to evaluate during training (the embedded executor's).
    pub eval_data: Option<PathBuf>,
    /// Evaluate after every this many steps (and after the last); `None`: after the last.
    pub eval_every: Option<usize>,
    /// Microbatches of the held-out set each evaluation runs; `None`: the whole set.
    pub eval_batches: Option<usize>,
    /// The compute element type (fp32 master weights and optimizer state always).
    pub precision: Precision,
    /// Stage placement (`--devices`): worker (replica `r`, stage `k`), rank `k * w + r`, on
    /// device `(k * w + r) % len`; empty: every worker on `device`.
    pub devices: Vec<Device>,
    /// A step whose loss or gradients are not finite: stop, or skip its update.
    pub on_nonfinite: NonFinite,
    /// Skipped steps in a row after which `Skip` stops.
    pub max_skips: usize,
    /// The schedule the user expects (`train --schedule`): the build's own must be it, as
    /// the schedule is compiled in.
    pub schedule: Option<Schedule>,
}

/// The run's configuration, built from the request and the build's shape.
fn config(req: &TrainRequest, manifest: &Manifest, shape: &RunShape, build: &Path) -> Result<TrainConfig, DriverError> {
    check_schedule(req.schedule, manifest, build)?;
    check_numbers(req)?;
    check_step_size(req, manifest, shape)?;
    let output = loss_output(req, manifest)?;
    if !(0.0..=1.0).contains(&req.label_smoothing) {
        return Err(DriverError::msg(format!("--label-smoothing must be between 0 and 1, got {}", req.label_smoothing)));
    }
    if req.label_smoothing != 0.0 && req.loss != Loss::CrossEntropy {
        return Err(DriverError::msg(format!("--label-smoothing applies to --loss cross-entropy, not --loss {}", req.loss)));
    }
    let objective = Objective { ignore_index: req.ignore_index, label_smoothing: req.label_smoothing, ..Objective::new(req.loss, output) };
    let mut cfg = TrainConfig::new(manifest.pipeline.schedule, objective, req.lr, req.steps);
    cfg.optimizer = OptimizerConfig { momentum: req.momentum, weight_decay: req.weight_decay, ..OptimizerConfig::new(req.optimizer) };
    cfg.lr_schedule = LrSchedule { warmup_steps: req.warmup, decay: req.decay, total_steps: req.steps, final_lr: 0.0 };
    cfg.clip_norm = req.clip_norm;
    cfg.seed = req.seed as i64;
    cfg.device = tch_device(req.device).map_err(|e| DriverError::msg(e.to_string()))?;
    cfg.trace = req.trace;
    cfg.replicas = usize::try_from(shape.replicas.value).unwrap_or(usize::MAX);
    cfg.placement = manifest.pipeline.placement;
    cfg.settings = settings(shape);
    cfg.settings.insert("--data".into(), data_identity(req)?);
    cfg.force_resume = req.force;
    if req.threads == Some(0) {
        return Err(DriverError::msg("--threads must be at least 1"));
    }
    cfg.threads = req.threads;
    if req.timeout.is_zero() {
        return Err(DriverError::msg("--timeout must be positive"));
    }
    cfg.timeout = req.timeout;
    cfg.precision = req.precision;
    if req.max_skips == 0 {
        return Err(DriverError::msg("--max-skips must be at least 1"));
    }
    cfg.on_nonfinite = req.on_nonfinite;
    cfg.max_skips = req.max_skips;
    let devices = match req.devices.is_empty() {
        true => default_placement(req.device, visible_gpus(req.device)),
        false => req.devices.clone(),
    };
    cfg.devices = devices.iter().map(|&d| tch_device(d).map_err(|e| DriverError::msg(format!("--devices: {e}")))).collect::<Result<_, _>>()?;
    if let Some(n) = req.checkpoint_every {
        if n == 0 {
            return Err(DriverError::msg("--checkpoint-every must be at least 1"));
        }
        cfg.checkpoint_every = Some(n);
        cfg.checkpoint_dir = Some(req.checkpoint_dir.clone().unwrap_or_else(|| build.join("checkpoints")));
    }
    Ok(cfg)
}

/// `train --schedule S` on a build compiled for another schedule: the schedule is compiled
/// into the stage modules (their weight versioning), so the answer is the compile command
/// that builds the same pipeline for `S`.
fn check_schedule(asked: Option<Schedule>, manifest: &Manifest, build: &Path) -> Result<(), DriverError> {
    let Some(asked) = asked else { return Ok(()) };
    let p = &manifest.pipeline;
    if asked == p.schedule {
        return Ok(());
    }
    let recompute = match p.recompute {
        Recompute::None => String::new(),
        r => format!(" --recompute {r}"),
    };
    Err(DriverError::msg(format!(
        "--schedule {asked}: the schedule is compiled into the build, and {} was compiled for {}; compile it for {asked} (then train it as before): pipewright compile {} --stages {} --schedule {asked}{recompute} -o {}",
        build.display(),
        p.schedule,
        manifest.model,
        p.depth,
        build.display()
    )))
}

/// The folder locks of a training job (`what`: `train`, `worker`): its build folder and,
/// when given elsewhere, its checkpoint folder (created for the lock).
fn lock_job(build: &Path, checkpoint_dir: Option<&Path>, what: &str) -> Result<Vec<FolderLock>, DriverError> {
    let mut locks = vec![FolderLock::acquire(build, what).map_err(|e| DriverError::msg(e.to_string()))?];
    if let Some(dir) = checkpoint_dir.filter(|d| !d.starts_with(build)) {
        std::fs::create_dir_all(dir).map_err(|e| DriverError::msg(format!("--checkpoint-dir {}: {e}", dir.display())))?;
        locks.push(FolderLock::acquire(dir, what).map_err(|e| DriverError::msg(e.to_string()))?);
    }
    Ok(locks)
}

/// `note: ...` for a lock whose last holder ended without releasing it (killed).
fn stale_note(lock: &FolderLock) -> Option<String> {
    lock.stale.as_ref().map(|s| format!("note: took over {}, left by a job that ended without releasing it ({s})", lock.path().display()))
}

/// The summary line of this process's peak resident memory (Linux's `VmHWM`), or `None`
/// where the system does not say. Data read from files is not counted: a token stream's
/// reads sit in the page cache, not the process.
pub fn peak_memory_line() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(format!("peak resident memory of this process: {}", human_bytes(kib * 1024)))
}

/// The summary line of the kernels' host reads per step, per stage: each a device
/// synchronisation on a GPU (`TrainReport::host_reads`); 0 once specialisation folded
/// every shape computation.
pub fn host_reads_line(report: &TrainReport) -> String {
    let steps = report.losses.len().max(1) as f64;
    let per_stage: Vec<String> = report.host_reads.iter().map(|&r| format!("{}", r as f64 / steps)).collect();
    format!("host reads of computed values per step (device syncs on a GPU) per stage: {}", per_stage.join(", "))
}

/// The summary line of the known values each stage never uploaded, because its kernels
/// only read them on the host (`TrainReport::off_device`).
pub fn off_device_line(report: &TrainReport) -> String {
    let per_stage: Vec<String> = report.off_device.iter().map(|&(n, bytes)| format!("{n} ({})", human_bytes(bytes))).collect();
    format!("known values only read on the host, never uploaded, per stage: {}", per_stage.join(", "))
}

/// The command that continues a run stopped early: the same arguments (`argv`, the
/// program first), resuming from `checkpoint` in place of any earlier `--resume`.
pub fn resume_command(argv: &[String], checkpoint: &Path) -> Vec<String> {
    let mut out = Vec::with_capacity(argv.len() + 2);
    let mut args = argv.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--resume" => {
                args.next();
            }
            _ if a.starts_with("--resume=") => {}
            _ => out.push(a.clone()),
        }
    }
    out.extend(["--resume".to_string(), checkpoint.display().to_string()]);
    out
}

/// What `train` says when a signal stopped it after `done` of `steps` steps: where the
/// checkpoint of that step is and the command that resumes from it, or that none was
/// written (and how to have one next time).
pub fn stopped_lines(done: usize, steps: usize, checkpoint: Option<&Path>, argv: &[String]) -> Vec<String> {
    stopped_lines_with(done, steps, checkpoint, |ck| format!("resume with: {}", crate::launch::shell_line(&resume_command(argv, ck))))
}

/// [`stopped_lines`] for a rank of an MPI job: the resume command is the `pipewright
/// launch` line that started it (`launch_argv`, [`crate::launch::launch_argv`]), or, for a
/// job started by hand, what to add to it.
pub fn stopped_job_lines(done: usize, steps: usize, checkpoint: Option<&Path>, launch_argv: Option<&[String]>) -> Vec<String> {
    stopped_lines_with(done, steps, checkpoint, |ck| match launch_argv {
        Some(argv) => {
            // The options after `--` go to the ranks; `--resume` is one of them.
            let mut argv = argv.to_vec();
            if !argv.iter().any(|a| a == "--") {
                argv.push("--".into());
            }
            format!("resume with: {}", crate::launch::shell_line(&resume_command(&argv, ck)))
        }
        None => format!("resume by starting the job again with --resume {} added to every rank's options", crate::launch::shell_line(&[ck.display().to_string()])),
    })
}

fn stopped_lines_with(done: usize, steps: usize, checkpoint: Option<&Path>, resume_line: impl Fn(&Path) -> String) -> Vec<String> {
    let mut lines = vec![format!("stopped by a signal after step {done} of {steps}, at a step boundary every stage agreed on")];
    match checkpoint {
        Some(ck) => {
            lines.push(format!("the last checkpoint is {}", ck.display()));
            lines.push(resume_line(ck));
        }
        None => lines.push(format!(
            "no checkpoint was written, so this run cannot be resumed; train with --checkpoint-every N to have a stop write one (the weights after step {done} are saved)"
        )),
    }
    lines
}

/// Where the workers run when `--devices` is not given: `--device cuda` (that is,
/// `cuda:0`) spreads the stages over every visible GPU, stage k of replica r on GPU
/// `(k * w + r) mod count` (its rank, stage-major, modulo the count); any other device
/// (`cpu`, a GPU named by a non-zero index) holds every worker. Empty means "every worker on `--device`".
pub fn default_placement(device: Device, visible_gpus: usize) -> Vec<Device> {
    match device {
        Device::Cuda(0) if visible_gpus > 1 => (0..visible_gpus).map(Device::Cuda).collect(),
        _ => Vec::new(),
    }
}

/// How many CUDA devices libtorch sees (0 for a CPU run: nothing is loaded for it).
fn visible_gpus(device: Device) -> usize {
    match device {
        Device::Cpu => 0,
        Device::Cuda(_) => usize::try_from(tch::Cuda::device_count()).unwrap_or(0),
    }
}

/// Refuses numeric options that would train silently wrong or do nothing: a NaN or
/// negative rate or momentum turns every weight into NaN while the loss still prints
/// finite, and `--steps 0` would replace the trained weights with an empty file.
fn check_numbers(req: &TrainRequest) -> Result<(), DriverError> {
    let bad = |option: &str, value: f64, range: &str| DriverError::msg(format!("--{option} {value}: must be {range}"));
    if !(req.lr.is_finite() && req.lr > 0.0) {
        return Err(bad("lr", req.lr, "a finite number above 0"));
    }
    let momentum = req.momentum;
    if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
        return Err(bad("momentum", momentum, "a finite number in [0, 1)"));
    }
    let decay = req.weight_decay;
    if !(decay.is_finite() && decay >= 0.0) {
        return Err(bad("weight-decay", decay, "a finite number of at least 0"));
    }
    if let Some(clip) = req.clip_norm {
        if !(clip.is_finite() && clip > 0.0) {
            return Err(bad("clip-norm", clip, "a finite number above 0"));
        }
    }
    let f = req.flags;
    for (option, value) in [("microbatch", f.microbatch), ("microbatches", f.microbatches), ("replicas", f.replicas)] {
        if value == Some(0) {
            return Err(DriverError::msg(format!("--{option} 0: must be at least 1")));
        }
    }
    if req.steps == 0 {
        return Err(DriverError::msg("--steps 0: must be at least 1 (nothing would be trained, and the weights file would be replaced)"));
    }
    if req.warmup > req.steps {
        return Err(DriverError::msg(format!("--warmup {}: must be at most --steps ({})", req.warmup, req.steps)));
    }
    Ok(())
}

/// Refuses a microbatch size whose step cannot be held in memory before anything is
/// allocated: an absurd `--microbatch` made the data loader abort the process (allocation
/// failure) instead of reporting. The bound is the step's input bytes (synthetic data
/// holds four steps) against the machine's memory where the system says it.
fn check_step_size(req: &TrainRequest, manifest: &Manifest, shape: &RunShape) -> Result<(), DriverError> {
    let (b, m, w) = (shape.microbatch.value, shape.microbatches.value, shape.replicas.value);
    let held = if req.data == DataSource::Synthetic { 4 } else { 1 };
    let inputs = manifest.input_specs().map_err(|e| DriverError::msg(format!("{MANIFEST_FILE}: {e}")))?;
    // A dynamic per-sample dimension counts as 1: the bound is then a lower bound.
    let per_sample = inputs.iter().try_fold(0u64, |sum, i| {
        i.per_sample.iter().try_fold(i.elem.size().max(1) as u64, |n, &d| n.checked_mul(d.max(1) as u64)).and_then(|n| sum.checked_add(n))
    });
    let bytes = per_sample.and_then(|p| p.checked_mul(b)?.checked_mul(m)?.checked_mul(w)?.checked_mul(held));
    let limit = memory_bytes();
    match (bytes, limit) {
        (None, _) => Err(DriverError::msg(format!(
            "--microbatch {b}: {b} samples x {m} microbatches x {w} replicas of input data overflow 64-bit sizes; give a smaller --microbatch"
        ))),
        (Some(n), Some(limit)) if n > limit => Err(DriverError::msg(format!(
            "--microbatch {b}: the training data for one step ({b} samples x {m} microbatches x {w} replicas{}) needs {:.1} GiB, more than this machine's {:.1} GiB of memory; give a smaller --microbatch",
            if held > 1 { ", synthetic data holding 4 steps" } else { "" },
            n as f64 / (1u64 << 30) as f64,
            limit as f64 / (1u64 << 30) as f64
        ))),
        _ => Ok(()),
    }
}

/// Total memory of this machine (`MemTotal` of /proc/meminfo), where the system says it.
fn memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What a resumed run must repeat that only this caller knows, by the flag that sets it:
/// the batch's shape (the rest of the run's settings are the runtime's `run_record`).
fn settings(shape: &RunShape) -> BTreeMap<String, String> {
    [("--microbatch", shape.microbatch.value.to_string()), ("--microbatches", shape.microbatches.value.to_string())]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// The training data's identity, recorded in checkpoints so that a resume on other data is
/// refused: `synthetic` (its seed is recorded apart), or each data file's name within its
/// folder (for a folder of arrays), size and a checksum of its first MiB and last 64 KiB.
/// Content, not the path: the same file moved resumes.
/// A sequential order and a token type are part of it (they decide which samples a step
/// sees).
fn data_identity(req: &TrainRequest) -> Result<String, DriverError> {
    let DataSource::File(path) = &req.data else { return Ok("synthetic".into()) };
    let mut id = files_identity(path)?;
    if req.data_order == DataOrder::Sequential {
        id.push_str(", sequential order");
    }
    if let Some(t) = req.tokens {
        id.push_str(&format!(", {t} tokens"));
    }
    Ok(id)
}

fn files_identity(path: &Path) -> Result<String, DriverError> {
    if !path.is_dir() {
        return file_identity(path).map_err(|source| DriverError::Read { path: path.to_path_buf(), source });
    }
    let files: Vec<std::path::PathBuf> = {
        let mut v: Vec<_> = std::fs::read_dir(path).map_err(|source| DriverError::Read { path: path.to_path_buf(), source })?.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
        v.sort();
        v
    };
    let mut parts = Vec::with_capacity(files.len());
    for f in &files {
        let name = f.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
        parts.push(format!("{name}: {}", file_identity(f).map_err(|source| DriverError::Read { path: f.clone(), source })?));
    }
    Ok(parts.join(", "))
}

/// `N bytes, crc32 X` over the file's first MiB and its last 64 KiB.
fn file_identity(path: &Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut head = Vec::new();
    (&mut f).take(1 << 20).read_to_end(&mut head)?;
    let mut tail = Vec::new();
    f.seek(SeekFrom::Start(len.saturating_sub(64 << 10)))?;
    f.read_to_end(&mut tail)?;
    head.extend_from_slice(&tail);
    Ok(format!("{len} bytes, crc32 {:08x}", pipewright_ir::content_crc32(&head)))
}

/// Classes of synthetic labels when neither the request nor the output's shape says.
pub const DEFAULT_CLASSES: i64 = 10;

/// The model output the loss applies to: `--output`, or the model's only output.
fn loss_output(req: &TrainRequest, manifest: &Manifest) -> Result<String, DriverError> {
    let outputs: Vec<&str> = manifest.outputs().map(|t| t.name.as_str()).collect();
    if let Some(o) = &req.output {
        // Checked here, before the run starts, rather than by the last stage at its first
        // step.
        if !outputs.contains(&o.as_str()) {
            return Err(DriverError::msg(format!(
                "--output {o:?}: the model has no output of that name (outputs: {})",
                outputs.iter().map(|o| format!("{o:?}")).collect::<Vec<_>>().join(", ")
            )));
        }
        return Ok(o.clone());
    }
    match outputs[..] {
        [only] => Ok(only.to_string()),
        _ => Err(DriverError::msg(format!(
            "--loss {} needs the model output it applies to (--loss {}:NAME or --output NAME): the model has outputs {}",
            req.loss,
            req.loss,
            outputs.iter().map(|o| format!("{o:?}")).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// `--data synthetic`: seeded inputs, and labels shaped for the loss on model output
/// `output` (class ids of its shape minus its class axis for cross-entropy, targets of
/// its shape for mse).
fn synthetic(req: &TrainRequest, manifest: &Manifest, output: &str, samples: usize) -> Result<Dataset, DriverError> {
    let inputs = manifest.input_specs().map_err(|e| DriverError::msg(format!("{MANIFEST_FILE}: {e}")))?;
    let data = Dataset::synthetic(&inputs, samples, req.seed)?;
    let out = manifest.output_per_sample(output);
    Ok(match (req.loss, out) {
        (Loss::Mse, Some(shape)) => data.with_random_targets(&shape, req.seed)?,
        (Loss::CrossEntropy, Some(shape)) if !shape.is_empty() => {
            // By default the labels range over the output's class axis, so any model's
            // output takes them.
            let classes = req.classes.unwrap_or(shape[shape.len() - 1]);
            data.with_random_labels_shaped(classes, &shape[..shape.len() - 1], req.seed)?
        }
        _ => data.with_random_labels(req.classes.unwrap_or(DEFAULT_CLASSES), req.seed)?,
    })
}

/// The batches of `per_batch` microbatches of `microbatch` samples from step `start` on (a
/// resumed run sees the batches an uninterrupted one would from there on), each made when
/// training asks for it; synthetic labels fit the loss of `config`.
fn batches(req: &TrainRequest, manifest: &Manifest, config: &TrainConfig, microbatch: usize, per_batch: usize, start: usize) -> Result<BatchStream, DriverError> {
    batches_counted(req, manifest, config, microbatch, per_batch, start).map(|(stream, _)| stream)
}

/// [`batches`], and how many of them one pass over the data holds.
fn batches_counted(req: &TrainRequest, manifest: &Manifest, config: &TrainConfig, microbatch: usize, per_batch: usize, start: usize) -> Result<(BatchStream, usize), DriverError> {
    if let DataSource::File(path) = &req.data {
        if reads_tokens(req, manifest, path) {
            return token_batches(req, manifest, config, path, microbatch, per_batch, start);
        }
    }
    let data = match &req.data {
        DataSource::Synthetic => synthetic(req, manifest, &config.loss.output, microbatch * per_batch * 4)?,
        DataSource::File(path) => {
            let inputs = manifest.input_specs().map_err(|e| DriverError::msg(format!("{MANIFEST_FILE}: {e}")))?;
            // A loss against labels takes the array named `label` when no --label names one.
            let label = match (&req.label, req.loss) {
                (Some(l), _) => LabelArray::Named(l),
                (None, Loss::Output) => LabelArray::None,
                (None, _) => LabelArray::Default(DEFAULT_LABEL),
            };
            let data = Dataset::open_capped(path, &inputs, label, req.max_inflated)?;
            if req.loss == Loss::CrossEntropy {
                data.check_class_labels(req.label.as_deref().unwrap_or(DEFAULT_LABEL))?;
            }
            data
        }
    };
    let per_epoch = data.batches_per_epoch(microbatch, per_batch);
    let stream = data.into_batches(microbatch, per_batch, req.seed, Stop::Steps(req.steps))?.in_order(req.data_order).starting_at(start);
    Ok((stream_of(stream), per_epoch))
}

/// The data loader's batches as the pipeline takes them.
fn stream_of(batches: impl Iterator<Item = Result<Vec<MicrobatchData>, DataError>> + Send + 'static) -> BatchStream {
    Box::new(batches.map(|batch| match batch {
        Ok(b) => Ok(b.into_iter().map(|(inputs, labels)| Microbatch { inputs, labels }).collect()),
        Err(e) => Err(e.to_string()),
    }))
}

/// The batches of a token stream: windows of the model's sequence length, each position's
/// label the next token, ids checked against the loss output's classes.
fn token_batches(req: &TrainRequest, manifest: &Manifest, config: &TrainConfig, path: &Path, microbatch: usize, per_batch: usize, start: usize) -> Result<(BatchStream, usize), DriverError> {
    if req.loss != Loss::CrossEntropy {
        return Err(DriverError::msg(format!("--data {}: a token stream trains next-token prediction, with --loss cross-entropy, not --loss {}", path.display(), req.loss)));
    }
    if let Some(l) = &req.label {
        return Err(DriverError::msg(format!("--label {l}: a token stream's labels are its next tokens; drop --label")));
    }
    let inputs = manifest.input_specs().map_err(|e| DriverError::msg(format!("{MANIFEST_FILE}: {e}")))?;
    let vocab = manifest.output_per_sample(&config.loss.output).and_then(|s| s.last().copied()).filter(|&v| v > 0);
    let file = TokenFile::open(path, req.tokens)?;
    let windows = TokenWindows::new(file, &inputs, vocab, req.data_order, req.seed, microbatch, per_batch, req.steps)?.starting_at(start);
    let per_epoch = size(windows.windows()) / (microbatch * per_batch).max(1);
    Ok((stream_of(windows), per_epoch))
}

/// `--eval-data`: `--eval-batches` microbatches of `microbatch` samples (default: one pass
/// over the set), in the file's order, read once before training; the same format rules
/// and checks as `--data` (a set whose arrays disagree with the model is refused by name).
fn eval_set(req: &TrainRequest, manifest: &Manifest, config: &TrainConfig, microbatch: usize) -> Result<Option<EvalSet>, DriverError> {
    let Some(path) = &req.eval_data else {
        if req.eval_every.is_some() || req.eval_batches.is_some() {
            return Err(DriverError::msg("--eval-every and --eval-batches need --eval-data (the held-out set to evaluate)"));
        }
        return Ok(None);
    };
    let shown = path.display();
    if req.eval_batches == Some(0) || req.eval_every == Some(0) {
        return Err(DriverError::msg("--eval-every and --eval-batches must be at least 1"));
    }
    // Opened once, in order; the stream makes batches as they are taken, so one longer
    // than the set costs nothing, and K of them are taken once K is known to fit.
    let eval = TrainRequest { data: DataSource::File(path.clone()), data_order: DataOrder::Sequential, steps: usize::MAX, ..req.clone() };
    let (stream, available) = batches_counted(&eval, manifest, config, microbatch, 1, 0).map_err(|e| DriverError::msg(format!("--eval-data: {e}")))?;
    let wanted = req.eval_batches.unwrap_or(available);
    if wanted > available {
        return Err(DriverError::msg(format!(
            "--eval-batches {wanted}: {shown} holds {available} batch(es) of {microbatch}; give --eval-batches {available} or fewer, or a larger set"
        )));
    }
    let mut microbatches = Vec::with_capacity(wanted);
    for batch in stream.take(wanted) {
        microbatches.extend(batch.map_err(|e| DriverError::msg(format!("--eval-data: {e}")))?);
    }
    Ok(Some(EvalSet { microbatches }))
}

/// After which steps a run with evaluation set `eval` evaluates (`--eval-every`).
fn eval_points(eval: &Option<EvalSet>, req: &TrainRequest) -> EvalPoints {
    match (eval, req.eval_every) {
        (None, _) => EvalPoints::Never,
        (Some(_), None) => EvalPoints::AtEnd,
        (Some(_), Some(n)) => EvalPoints::Every(n),
    }
}

/// Whether the run trains a language model on a token stream (its evaluations report
/// perplexity).
fn is_language_model(req: &TrainRequest, manifest: &Manifest) -> bool {
    matches!(&req.data, DataSource::File(p) if reads_tokens(req, manifest, p))
}

/// An evaluation's perplexity, for a language model (a token stream): the exponential
/// of its mean cross-entropy.
pub fn eval_perplexity(eval: &EvalResult, language_model: bool) -> Option<f64> {
    language_model.then(|| eval.loss.exp())
}

/// The line a run prints for the evaluation after step `step` (from 1): the loss and, for
/// cross-entropy, the accuracy; for a language model (a token stream) the perplexity.
pub fn eval_line(step: usize, eval: &EvalResult, language_model: bool) -> String {
    let mut line = format!("eval after step {step}: loss {:.4}", eval.loss);
    if let Some(p) = eval_perplexity(eval, language_model) {
        line.push_str(&format!(", perplexity {p:.2}"));
    }
    if let Some(a) = eval.accuracy {
        line.push_str(&format!(", accuracy {:.4}", a));
    }
    line.push_str(&format!(" ({} samples)", eval.samples));
    line
}

/// Whether `--data PATH` is read as a token stream: `--tokens`, or a file that is one
/// (a `.npy` named after a model input of one scalar per sample is an array).
fn reads_tokens(req: &TrainRequest, manifest: &Manifest, path: &Path) -> bool {
    let inputs = manifest.input_specs().unwrap_or_default();
    let scalar_inputs: Vec<&str> = inputs.iter().filter(|i| i.per_sample.is_empty()).map(|i| i.name.as_str()).collect();
    req.tokens.is_some() || is_token_file(path, &scalar_inputs)
}

fn size(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// A training run on the embedded executor, ready to start.
pub struct Session {
    /// Held while the session lives: one job per build (and checkpoint) folder.
    locks: Vec<FolderLock>,
    pub build: Build,
    pub shape: RunShape,
    pub config: TrainConfig,
    /// The first step (after the checkpoint resumed from).
    pub start: usize,
    checkpoint: Option<Checkpoint>,
    batches: BatchStream,
    /// The settings that differ from the checkpoint resumed from (`--force`).
    pub forced: Vec<String>,
    eval: Option<EvalSet>,
    /// The data is a token stream: evaluations report perplexity.
    pub language_model: bool,
}

impl Session {
    /// Opens the build, resolves the run's shape, loads the data and the checkpoint.
    pub fn prepare(build_dir: &Path, req: &TrainRequest) -> Result<Session, DriverError> {
        let build = Build::open(build_dir)?;
        let locks = lock_job(build_dir, req.checkpoint_dir.as_deref(), "train")?;
        let shape = build.manifest.pipeline.resolve(req.flags);
        let mut config = config(req, &build.manifest, &shape, build_dir)?;
        let checkpoint = match &req.resume {
            Some(dir) => Some(read_checkpoint(dir).map_err(|e| DriverError::msg(format!("--resume: {e}")))?),
            None => None,
        };
        let start = checkpoint.as_ref().map_or(0, |c| c.step as usize);
        if start >= req.steps {
            // Training nothing would still replace the weights file with an empty one.
            return Err(DriverError::msg(format!("--steps {}: the checkpoint resumed from is already at step {start}; give a larger --steps", req.steps)));
        }
        let (b, m, w) = (size(shape.microbatch.value), size(shape.microbatches.value), size(shape.replicas.value));
        let batches = batches(req, &build.manifest, &config, b, m * w, start)?;
        // Interleaved 1F1B runs several stages per worker thread's turn: cores go to workers.
        let workers = config.schedule.workers(build.modules.len()).unwrap_or(build.modules.len()) * w;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        config.threads = Some(req.threads.unwrap_or((cores / workers).max(1)));
        // What `--force` lets differ from the checkpoint, for the preamble and the metrics.
        let forced = checkpoint.as_ref().map(|ck| resume_differences(ck, &config)).unwrap_or_default();
        let eval = eval_set(req, &build.manifest, &config, size(shape.microbatch.value))?;
        config.eval = eval_points(&eval, req);
        let language_model = is_language_model(req, &build.manifest);
        Ok(Session { locks, build, shape, config, start, checkpoint, batches, forced, eval, language_model })
    }

    /// The folder locks, for the caller to hold until it has written what the run gives
    /// (the weights); otherwise they end with [`Session::run`].
    pub fn take_locks(&mut self) -> Vec<FolderLock> {
        std::mem::take(&mut self.locks)
    }

    /// Trains; `on_step` sees every step.
    pub fn run(self, on_step: &mut dyn FnMut(StepReport)) -> Result<TrainReport, DriverError> {
        let Session { build, config, checkpoint, batches, eval, .. } = self;
        match (checkpoint, eval) {
            (ck, Some(set)) => train_evaluated(build.modules, &config, ck, set, batches, on_step),
            (Some(ck), None) => resume(build.modules, &config, ck, batches, on_step),
            (None, None) => train(build.modules, &config, batches, on_step),
        }
        .map_err(|e| DriverError::msg(format!("{}: {e}", build.dir.display())))
    }
}

/// `2 stage(s)`, or `4 stage(s) on 2 worker(s)` where a worker runs several.
pub fn stages_text(schedule: Schedule, depth: u32) -> String {
    match schedule.workers(depth as usize) {
        Ok(w) if w != depth as usize => format!("{depth} stage(s) on {w} worker(s)"),
        _ => format!("{depth} stage(s)"),
    }
}

impl Session {
    /// `2bw over 2 stage(s) x 1 replica(s)`: the pipeline trained, for the run's summary.
    pub fn pipeline_text(&self) -> String {
        let c = &self.build.manifest.pipeline;
        format!("{} over {} x {} replica(s)", c.schedule, stages_text(c.schedule, c.depth), self.shape.replicas.value)
    }

    /// What `train` says before it starts: where each run value came from, the import's
    /// notes, the pipeline it trains, the stages' placement when one was given, and that an
    /// earlier run's weights will be replaced.
    pub fn preamble(&self, steps: usize) -> Vec<String> {
        let c = &self.build.manifest.pipeline;
        let mut lines: Vec<String> = self.shape.report().lines().map(str::to_string).collect();
        lines.extend(self.build.manifest.choices.lines().into_iter().map(|l| format!("note: {l}")));
        lines.extend(self.locks.iter().filter_map(stale_note));
        if !self.forced.is_empty() {
            lines.push(format!("note: resuming with settings that differ from the checkpoint's (--force): {}", self.forced.join(", ")));
        }
        lines.push(format!(
            "training {} x {} replica(s), schedule {}, recompute {} (from the build), steps {}..{steps}",
            stages_text(c.schedule, c.depth),
            self.shape.replicas.value,
            c.schedule,
            c.recompute,
            self.start
        ));
        if !self.config.devices.is_empty() {
            lines.push(format!("placement: {}", placement(&self.config, c.depth as usize, size(self.shape.replicas.value))));
        }
        let weights = self.build.dir.join(WEIGHTS_FILE);
        if weights.is_file() {
            lines.push(format!("note: {} exists (an earlier run's weights); this run replaces it when it ends", weights.display()));
        }
        lines
    }
}

/// How the stage executables go into an MPMD line for a layout, for messages.
fn mpmd_order(layout: Layout) -> String {
    match layout.placement {
        Placement::StageMajor => format!("list the stage executables in stage order, each with -np {} (one rank per replica)", layout.replicas),
        Placement::ReplicaMajor => format!("list the stage executables in stage order with -np 1 each, once per replica ({} times)", layout.replicas),
    }
}

/// `stage 0 cuda:0, stage 1 cuda:1` (replica 0; every replica when they differ).
fn placement(cfg: &TrainConfig, depth: usize, replicas: usize) -> String {
    let name = |d: tch::Device| match d {
        tch::Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".to_string(),
    };
    let alike = (0..replicas).all(|r| (0..depth).all(|k| cfg.worker_device(depth, k, r) == cfg.worker_device(depth, k, 0)));
    let shown = if alike { 1 } else { replicas };
    let mut parts = Vec::new();
    for r in 0..shown {
        for k in 0..depth {
            let who = if alike { format!("stage {k}") } else { format!("replica {r} stage {k}") };
            parts.push(format!("{who} {}", name(cfg.worker_device(depth, k, r))));
        }
    }
    parts.join(", ")
}

/// The first and last finite losses of a run (a skipped step's loss may be NaN).
pub fn loss_range(report: &TrainReport) -> (f64, f64) {
    let mut finite = report.losses.iter().copied().filter(|l| l.is_finite());
    let first = finite.next().unwrap_or(f64::NAN);
    (first, finite.last().unwrap_or(first))
}

/// Writes the run's trace to `path` when one is asked for; returns what to say.
pub fn save_trace(path: Option<&Path>, report: &TrainReport) -> Result<Option<String>, DriverError> {
    let Some(path) = path else { return Ok(None) };
    write_atomic(path, chrome_trace_json(&report.trace).as_bytes())?;
    Ok(Some(format!("wrote {} trace events to {}", report.trace.len(), path.display())))
}

/// Each stage's peak live tensor bytes, for people.
pub fn memory_peaks(report: &TrainReport) -> Vec<String> {
    report.memory.iter().map(|m| human_bytes(m.total)).collect()
}

/// What a worker process is asked to do.
#[derive(Clone, Debug)]
pub struct WorkerRequest {
    pub train: TrainRequest,
    /// Save this stage's trained weights here.
    pub save: Option<PathBuf>,
    /// Sums over groups of ranks in the embedded executor's fixed order
    /// ([`Reduction::FixedOrder`]) instead of MPI's all-reduce.
    pub deterministic_reduce: bool,
}

/// One stage of one replica in an MPI job (rank `stage * replicas + replica`), ready to
/// check its configuration with the other ranks and train.
pub struct WorkerSession {
    /// Rank 0's, held while the session lives ([`WorkerSession::take_locks`]).
    locks: Vec<FolderLock>,
    pub rank: usize,
    pub stage: usize,
    pub replica: usize,
    pub depth: usize,
    /// The first step (after the checkpoint resumed from).
    pub start: usize,
    pub shape: RunShape,
    pub config: TrainConfig,
    /// `rank 1 (stage 1, replica 0)`, the prefix of this rank's messages.
    pub who: String,
    /// Whether this rank reports the job's steps (progress, metrics, the loss over every
    /// replica): the last stage of replica 0.
    pub reports_steps: bool,
    module: StageModule,
    batches: BatchStream,
    /// The checkpoint's step and this stage's state in it.
    resume: Option<(u64, StageState)>,
    /// The stage worker's links.
    transport: Mpi,
    /// Its link to the other stages of its worker, under interleaved 1F1B and ZB-V.
    turns: Option<MpiTurns>,
    /// The main thread's: merging the replicas' step reports, gathering the weights.
    main: Mpi,
    /// `--eval-data` (read by every rank, used by replica 0's) and the main thread's
    /// link for running it through the stages.
    eval: Option<(EvalSet, Mpi)>,
    /// The data is a token stream: evaluations report perplexity.
    pub language_model: bool,
    /// What every rank must agree on before the first step (by flag or name).
    agreement: BTreeMap<String, String>,
}

impl WorkerSession {
    /// Reads the manifest and this rank's stage module (the executable's own when
    /// `embedded`), checks them against each other and against the job's size, and loads
    /// the data.
    pub fn prepare(build_dir: &Path, req: &WorkerRequest, embedded: Option<Vec<u8>>, job: &MpiJob) -> Result<WorkerSession, DriverError> {
        // Named by stage and replica once the build says the job's shape.
        Self::prepare_in(build_dir, req, embedded, job).map_err(|e| DriverError::msg(format!("{}: {e}", job.who(job.rank()))))
    }

    fn prepare_in(build_dir: &Path, req: &WorkerRequest, embedded: Option<Vec<u8>>, job: &MpiJob) -> Result<WorkerSession, DriverError> {
        let manifest = Manifest::read(build_dir)?;
        let manifest_path = build_dir.join(MANIFEST_FILE);
        // Rank 0 holds the job's folders (the others may be on hosts of their own).
        let locks = if job.rank() == 0 { lock_job(build_dir, req.train.checkpoint_dir.as_deref(), "worker (rank 0 of an MPI job)")? } else { Vec::new() };
        for note in locks.iter().filter_map(stale_note) {
            eprintln!("{note}");
        }
        let shape = manifest.pipeline.resolve(req.train.flags);
        // The numbers are checked (`--replicas 0`) before the layout places this rank.
        let mut config = config(&req.train, &manifest, &shape, build_dir)?;
        // SIGUSR1 stops the job at a step boundary every rank agrees on.
        config.stop = Some(job.stop_gate());
        let layout = Layout::new(manifest.stages.len(), size(shape.replicas.value)).placed(manifest.pipeline.placement);
        let reduction = if req.deterministic_reduce { Reduction::FixedOrder } else { Reduction::Collective };
        let transport = job.transport(layout, config.timeout).map_err(DriverError::msg)?.with_reduction(reduction);
        let main = job.transport(layout, config.timeout).map_err(DriverError::msg)?;
        let turns = job.turn_link(layout, config.schedule, config.timeout).map_err(DriverError::msg)?;
        let rank = job.rank();
        let (replica, stage) = layout.place(rank);
        let embedded = match embedded {
            Some(bytes) => Some(decode_module_bytes(bytes.into()).map_err(|e| DriverError::msg(format!("the stage module appended to this executable: {e}")))?),
            None => None,
        };
        if let Some(m) = &embedded {
            let own = m.header.params.stage as usize;
            if own != stage {
                return Err(DriverError::msg(format!(
                    "this executable holds stage {own}, but MPI rank {rank} runs stage {stage} ({}): {}, in the mpirun line (`pipewright launch BUILD --executables` writes it)",
                    layout.numbering(),
                    mpmd_order(layout)
                )));
            }
        }
        let module_path = build_dir.join(&manifest.stages[stage].module);
        let module = match embedded {
            Some(m) => m,
            None => read_module(&module_path)?,
        };
        manifest.check_module(stage, &module, &module_path, &manifest_path)?;
        // Every rank reads the checkpoint (a folder they all reach) and keeps its stage.
        let resume = match &req.train.resume {
            Some(dir) => {
                let mut ck = read_checkpoint(dir).map_err(|e| DriverError::msg(format!("--resume: {e}")))?;
                check_resume(&ck, &Identity { recompute: None, ..manifest.identity() }, &config).map_err(|e| DriverError::msg(format!("--resume: {e}")))?;
                if ck.step >= req.train.steps as u64 {
                    return Err(DriverError::msg(format!("--steps {}: the checkpoint resumed from is already at step {}; give a larger --steps", req.train.steps, ck.step)));
                }
                let state = ck.stages.swap_remove(stage);
                Some((ck.step, state))
            }
            None => None,
        };
        let start = resume.as_ref().map_or(0, |(s, _)| *s as usize);
        let mut batches = batches(&req.train, &manifest, &config, size(shape.microbatch.value), size(shape.microbatches.value) * layout.replicas, start)?;
        // The first batch is read now to fingerprint the data, then trained on as usual.
        let first = batches.next().ok_or_else(|| DriverError::msg("the data holds no batch"))?.map_err(DriverError::msg)?;
        let fingerprint = batch_fingerprint(&first).map_err(DriverError::msg)?;
        let batches: BatchStream = Box::new(std::iter::once(Ok(first)).chain(batches));
        let eval = eval_set(&req.train, &manifest, &config, size(shape.microbatch.value))?;
        config.eval = eval_points(&eval, &req.train);
        let eval_fingerprint = match &eval {
            Some(set) => batch_fingerprint(&set.microbatches).map_err(DriverError::msg)?,
            None => "none".into(),
        };
        let eval = match eval {
            Some(set) => Some((set, job.transport(layout, config.timeout).map_err(DriverError::msg)?)),
            None => None,
        };
        let mut agreement = run_record(&config);
        agreement.insert("--eval-data".into(), eval_fingerprint);
        agreement.insert("--eval-every".into(), format!("{:?}", config.eval));
        agreement.insert("--deterministic-reduce".into(), req.deterministic_reduce.to_string());
        // The module agrees with the manifest (checked above); the ranks agree on both.
        agreement.extend(manifest.identity().fields().into_iter().map(|(k, v)| (k.to_string(), v)));
        agreement.insert("--data".into(), fingerprint);
        agreement.insert("--replicas".into(), layout.replicas.to_string());
        agreement.insert("--checkpoint-every".into(), config.checkpoint_every.map_or("none".into(), |n| n.to_string()));
        agreement.insert("--resume".into(), resume.as_ref().map_or("none".into(), |(s, _)| format!("from step {s}")));
        let reports_steps = main.reports_steps();
        let language_model = is_language_model(&req.train, &manifest);
        Ok(WorkerSession { locks, rank, stage, replica, depth: layout.depth, start, shape, config, who: layout.who(rank), reports_steps, module, batches, resume, transport, turns, main, eval, language_model, agreement })
    }

    /// Checks with every other rank that all were started alike (refusing, naming the
    /// first difference), then trains this stage; `on_step` sees every step of the job
    /// (the loss over all replicas) on the reporting rank only.
    /// Rank 0's folder locks, for the caller to hold until it has written the weights.
    pub fn take_locks(&mut self) -> Vec<FolderLock> {
        std::mem::take(&mut self.locks)
    }

    pub fn run(self, on_step: &mut dyn FnMut(StepReport)) -> Result<WorkerOutcome, DriverError> {
        let WorkerSession { who, module, config, replica, batches, resume, mut transport, turns, mut main, eval, agreement, depth, .. } = self;
        let fail = |e: String| DriverError::msg(format!("{who}: {e}"));
        let agreed = transport.agree(&agreement).map_err(fail)?;
        let job = agreed.job;
        let (pipeline, schedule, record) = (module.program.pipeline.clone(), config.schedule, run_record(&config));
        let (mut losses, mut merge_error) = (Vec::new(), None);
        // The main thread's links serve both hooks, one at a time.
        let main = std::cell::RefCell::new(&mut main);
        let trained = {
            let mut merged = |r: StepReport| match main.borrow_mut().merge_step(r) {
                Ok(Some(all)) => {
                    losses.push(all.loss);
                    on_step(all);
                }
                Ok(None) => {}
                Err(e) => {
                    merge_error.get_or_insert(e);
                }
            };
            let dir = config.checkpoint_dir.clone().unwrap_or_default();
            let mut checkpoint = |step: u64, state: StageState| main.borrow_mut().checkpoint(&dir, step, job, &state, schedule, &pipeline, &record);
            let eval = eval.map(|(set, link)| (set, Box::new(link) as Box<dyn EvalLink>));
            let hooks = WorkerHooks { on_step: &mut merged, on_checkpoint: &mut checkpoint, eval, trace_origin: Some(agreed.clock) };
            run_worker(module, &config, replica, Box::new(transport), turns.map(|t| Box::new(t) as Box<dyn TurnLink>), batches, resume, hooks)
        };
        let mut report = trained.map_err(|e| fail(e.to_string()))?;
        if let Some(e) = merge_error {
            return Err(fail(e));
        }
        let main = main.into_inner();
        let layout = main.layout();
        report.losses = losses;
        // Rank 0 collects every stage's weights (replica 0's; the replicas hold the same)
        // and running statistics.
        let mine = |v: &Vec<Vec<(String, tch::Tensor)>>| -> Vec<(String, tch::Tensor)> {
            if replica == 0 { v.iter().flatten().map(|(n, t)| (n.clone(), t.shallow_clone())).collect() } else { Vec::new() }
        };
        let weights = main.gather_to_first(mine(&report.weights), "the trained weights").map_err(fail)?;
        let buffers = main.gather_to_first(mine(&report.buffers), "the running statistics").map_err(fail)?;
        // Ranks are stage-major: replica 0's stage k is rank `layout.rank(0, k)`, not rank k.
        let replica0 = |mut all: Vec<Vec<(String, tch::Tensor)>>| -> Vec<Vec<(String, tch::Tensor)>> {
            (0..depth).map(|k| all.get_mut(layout.rank(0, k)).map(std::mem::take).unwrap_or_default()).collect()
        };
        let job = match (weights, buffers) {
            (Some(w), Some(b)) => Some(TrainReport { weights: replica0(w), buffers: replica0(b), ..empty_report(depth) }),
            _ => None,
        };
        Ok(WorkerOutcome { report, job })
    }
}

/// What a worker rank ends with.
pub struct WorkerOutcome {
    /// This rank's stage (index 0); on the reporting rank, `losses` are the job's.
    pub report: TrainReport,
    /// On rank 0: every stage's trained weights and running statistics, in stage order,
    /// ready to be saved as the build's weights (as `pipewright train` saves them).
    pub job: Option<TrainReport>,
}

fn empty_report(depth: usize) -> TrainReport {
    TrainReport {
        weights: Vec::new(),
        buffers: Vec::new(),
        memory: Vec::new(),
        checkpoints: Vec::new(),
        losses: Vec::new(),
        peak_versions: vec![0; depth],
        host_reads: vec![0; depth],
        off_device: vec![(0, 0); depth],
        trace: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile;
    use crate::compile::tests::{request, stages};

    #[test]
    fn the_resume_command_repeats_the_run_from_the_checkpoint() {
        let argv: Vec<String> = ["pipewright", "train", "b", "--steps", "9", "--resume", "old", "--lr=0.1", "--resume=older"].map(String::from).to_vec();
        let cmd = resume_command(&argv, Path::new("b/checkpoints/step-000004"));
        assert_eq!(cmd, ["pipewright", "train", "b", "--steps", "9", "--lr=0.1", "--resume", "b/checkpoints/step-000004"]);
        let lines = stopped_lines(4, 9, Some(Path::new("b/my checkpoints/step-000004")), &argv[..5]);
        assert_eq!(lines[1], "the last checkpoint is b/my checkpoints/step-000004");
        assert_eq!(lines[2], "resume with: pipewright train b --steps 9 --resume 'b/my checkpoints/step-000004'");
        assert!(stopped_lines(4, 9, None, &argv)[1].contains("train with --checkpoint-every N"));
    }

    #[test]
    fn a_stopped_job_resumes_with_its_launch_line_or_says_what_to_add() {
        let ck = Path::new("b/checkpoints/step-000004");
        let launch: Vec<String> = ["pipewright", "launch", "b", "--", "--steps", "9"].map(String::from).to_vec();
        assert_eq!(stopped_job_lines(4, 9, Some(ck), Some(&launch))[2], "resume with: pipewright launch b -- --steps 9 --resume b/checkpoints/step-000004");
        let bare: Vec<String> = ["pipewright", "launch", "b"].map(String::from).to_vec();
        assert_eq!(stopped_job_lines(4, 9, Some(ck), Some(&bare))[2], "resume with: pipewright launch b -- --resume b/checkpoints/step-000004");
        assert_eq!(stopped_job_lines(4, 9, Some(ck), None)[2], "resume by starting the job again with --resume b/checkpoints/step-000004 added to every rank's options");
    }

    #[test]
    fn a_cuda_run_spreads_over_every_visible_gpu_unless_pinned() {
        let gpus = |n: usize| (0..n).map(Device::Cuda).collect::<Vec<_>>();
        assert_eq!(default_placement(Device::Cuda(0), 4), gpus(4));
        // One GPU, a CPU run, or a GPU named by index: every worker on that device.
        assert_eq!(default_placement(Device::Cuda(0), 1), Vec::<Device>::new());
        assert_eq!(default_placement(Device::Cuda(2), 4), Vec::<Device>::new());
        assert_eq!(default_placement(Device::Cpu, 4), Vec::<Device>::new());
    }

    fn req(steps: usize) -> TrainRequest {
        TrainRequest {
            data: DataSource::Synthetic,
            label: None,
            loss: Loss::CrossEntropy,
            output: Some("linear_3".into()),
            classes: None,
            ignore_index: -100,
            label_smoothing: 0.0,
            steps,
            flags: RunFlags { microbatch: Some(2), ..RunFlags::default() },
            lr: 0.01,
            optimizer: Optimizer::Sgd,
            momentum: 0.0,
            weight_decay: 0.0,
            warmup: 0,
            decay: Decay::Constant,
            clip_norm: None,
            seed: 0,
            device: Device::Cpu,
            trace: false,
            checkpoint_every: None,
            checkpoint_dir: None,
            resume: None,
            force: false,
            threads: Some(1),
            timeout: Duration::from_secs(60),
            max_inflated: pipewright_runtime::data::DEFAULT_MAX_INFLATED,
            tokens: None,
            data_order: pipewright_core::DataOrder::Shuffle,
            eval_data: None,
            eval_every: None,
            eval_batches: None,
            precision: Precision::Fp32,
            devices: Vec::new(),
            on_nonfinite: NonFinite::Stop,
            max_skips: pipewright_core::DEFAULT_MAX_SKIPS,
            schedule: None,
        }
    }

    /// Batches are made as training asks for them: a billion steps prepare as fast as two
    /// (building them first took memory in proportion to the steps), and the first batches
    /// are the same either way.
    #[test]
    fn batches_are_made_as_training_goes() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        compile(&request("mlp.onnx", stages(2), &build)).unwrap();
        let t0 = std::time::Instant::now();
        let mut huge = Session::prepare(&build, &req(1_000_000_000)).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "prepared in {:?}", t0.elapsed());
        // Released, so that a second session may open the build.
        drop(huge.take_locks());
        let small = Session::prepare(&build, &req(2)).unwrap();
        let (mut a, mut b) = (huge.batches, small.batches);
        for _ in 0..2 {
            let (x, y) = (a.next().unwrap().unwrap(), b.next().unwrap().unwrap());
            assert_eq!(x.len(), y.len());
            for (p, q) in x.iter().zip(&y) {
                assert!(p.inputs[0].1.equal(&q.inputs[0].1));
            }
        }
        assert!(b.next().is_none());
        assert!(a.next().is_some());
    }
}
