//! The command line's own arguments: those of the subcommands that run models (train,
//! worker, run-forward, ...), launch, export, trace-svg and synth, and their translation
//! into the driver's requests. `inspect`, `plan`, `simulate` and `compile` take the
//! driver's request types as their arguments directly (their options are declared once,
//! there).

use std::path::PathBuf;

use pipewright_core::timeline::StepWindow;
use pipewright_core::{DataOrder, Decay, Device, Loss, NonFinite, Optimizer, Precision, Storage, TokenType};
use pipewright_driver::synth::{SynthRequest, SynthShape};

/// `--loss KIND[:OUTPUT]`.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "torch"), allow(dead_code))]
pub struct LossArg {
    pub loss: Loss,
    pub output: Option<String>,
}

fn parse_loss(s: &str) -> Result<LossArg, String> {
    let (kind, output) = match s.split_once(':') {
        Some((_, "")) => return Err(format!("{s:?} names no model output after the colon")),
        Some((kind, output)) => (kind, Some(output.to_string())),
        None => (s, None),
    };
    let loss = kind.parse::<Loss>().map_err(|e| e.to_string())?;
    Ok(LossArg { loss, output })
}

#[cfg_attr(not(feature = "torch"), allow(dead_code))]
impl TrainArgs {
    /// The model output the loss applies to, from `--loss KIND:OUTPUT` or `--output`.
    pub fn loss_output(&self) -> Result<Option<String>, String> {
        match (&self.loss.output, &self.output) {
            (Some(a), Some(b)) if a != b => Err(format!("--loss names output {a:?} but --output names {b:?}")),
            (a, b) => Ok(a.clone().or_else(|| b.clone())),
        }
    }
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The build folder written by `pipewright compile`.
    pub build: PathBuf,
    /// `synthetic`, or a .npz file, a folder of .npy files, or a .safetensors file whose
    /// arrays are named after the model's inputs (first axis = samples).
    #[arg(long, default_value = "synthetic")]
    pub data: PathBuf,
    /// The labels array in the data file (default: the array named `label`, for a loss
    /// that needs labels), sample axis first like every array; where the output carries
    /// the batch further in (`[L, N, ...]`), the loss moves that axis there.
    #[arg(long)]
    pub label: Option<String>,
    /// The loss: cross-entropy, mse, or output (the model output is the loss itself, e.g.
    /// a SoftmaxCrossEntropyLoss node's); `KIND:OUTPUT` also names the model output it
    /// applies to (`--loss output:loss`), like --output.
    #[arg(long, value_name = "KIND[:OUTPUT]", value_parser = parse_loss, default_value = "cross-entropy")]
    pub loss: LossArg,
    /// The model output the loss applies to (default: the model's only output).
    #[arg(long)]
    pub output: Option<String>,
    /// Classes of the random labels of `--data synthetic` (default: the size of the
    /// output's last axis).
    #[arg(long)]
    pub classes: Option<i64>,
    /// Cross-entropy: labels equal to this count neither in the loss nor in its mean
    /// (PyTorch's default; the Hugging Face convention for masked tokens).
    #[arg(long, default_value_t = -100, allow_negative_numbers = true)]
    pub ignore_index: i64,
    /// Cross-entropy label smoothing: the target gives 1 - S to the label and spreads S
    /// over all classes (0 to 1).
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub label_smoothing: f64,
    /// Optimizer steps (batches).
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Samples per microbatch (default: the build's, else 16).
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Microbatches per step and replica (default: the build's, else the pipeline depth,
    /// the least 2BW allows).
    #[arg(long)]
    pub microbatches: Option<u64>,
    /// Data-parallel width: copies of the pipeline, each fed every W-th microbatch;
    /// gradients are averaged across copies before each update (default: the build's, else 1).
    #[arg(long)]
    pub replicas: Option<u64>,
    // Negative values parse, so they get the range error that names the option.
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub lr: f64,
    #[arg(long, value_enum, default_value_t = Optimizer::Sgd)]
    pub optimizer: Optimizer,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub momentum: f64,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Learning-rate decay after the warm-up.
    #[arg(long, value_enum, default_value_t = Decay::Constant)]
    pub decay: Decay,
    /// Clip gradients to this global norm across all stages.
    #[arg(long, allow_negative_numbers = true)]
    pub clip_norm: Option<f64>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Write one JSON line of metrics per step here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Print progress every this many steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Write a Chrome/Perfetto trace (JSON) of every forward, backward, recompute, send,
    /// receive and optimizer step per stage here.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write a checkpoint (weights, both 2BW versions, optimizer state) every N steps.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<usize>,
    /// Where checkpoints go (default: BUILD/checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from a checkpoint: a step folder, or a checkpoint folder (its newest step).
    /// Give the same data, seed and --steps as the interrupted run.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Resume even though the optimizer, microbatch, microbatches, replicas or loss differ
    /// from the checkpoint's (refused otherwise).
    #[arg(long, requires = "resume")]
    pub force: bool,
    /// Plain progress lines instead of a progress bar (also when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Intra-op threads per worker (default for `train`: the cores divided among its
    /// stages x replicas worker threads, at least 1; for `worker`: libtorch's default).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds a stage waits for a neighbour's tensors or a reduction before it stops with
    /// an error saying what it waited for.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub timeout: u64,
    /// The most bytes read out of an `.npz` data file, all arrays decompressed (a
    /// decompression bomb stops with an error at this cap): `16GiB`, `512MiB`, `4096`.
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_size)]
    pub max_data_size: u64,
    /// --data is a flat file of token ids of this type, cut into windows of the model's
    /// sequence length with next-token labels (a `.bin` needs it; a 1-D `.npy` of
    /// integers is a token stream without it).
    #[arg(long, value_enum)]
    pub tokens: Option<TokenType>,
    /// The order samples (or token windows) are visited in each epoch.
    #[arg(long, value_enum, default_value_t = DataOrder::Shuffle)]
    pub data_order: DataOrder,
    /// A held-out set (the formats of --data) to evaluate during training: forward only,
    /// no update, nothing of training changed; loss, accuracy (cross-entropy) or
    /// perplexity (a token stream) after the last step and every --eval-every steps.
    #[arg(long, value_name = "DATA")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate after every N steps as well as after the last.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<usize>,
    /// Microbatches of --eval-data each evaluation runs (default: the whole set, in order).
    #[arg(long, value_name = "K")]
    pub eval_batches: Option<usize>,
    /// The element type training computes in; master weights and optimizer state stay fp32.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Stage placement, overriding --device: `D0,D1,...` (`cpu`, `cuda:N`); stage k of
    /// replica r runs on the ((r * stages + k) mod count)-th device, so one device per
    /// stage places every replica alike.
    #[arg(long, value_delimiter = ',', value_name = "DEVICES")]
    pub devices: Vec<Device>,
    /// A step whose loss or gradients are not finite (NaN or infinite): `stop` with the
    /// divergence error, or `skip` its update in every stage and go on (counted in the
    /// summary and `--metrics`).
    #[arg(long, value_enum, default_value_t = NonFinite::Stop)]
    pub on_nonfinite: NonFinite,
    /// With `--on-nonfinite skip`: stop with the divergence error after this many skipped
    /// steps in a row.
    #[arg(long, value_name = "N", default_value_t = pipewright_core::DEFAULT_MAX_SKIPS)]
    pub max_skips: usize,
    /// Not a choice of `train`: the schedule is compiled into the build. Accepted so that
    /// asking for another one explains that and prints the `compile` command.
    #[arg(long, value_enum, hide = true)]
    pub schedule: Option<pipewright_core::Schedule>,
}

fn parse_size(text: &str) -> Result<u64, String> {
    pipewright_core::units::parse_bytes(text).map_err(|e| e.to_string())
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Seconds a neighbouring rank may send no heartbeat before the job is stopped as
    /// frozen or gone (heartbeats go every second from a thread of their own, so a long
    /// computation never counts).
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub heartbeat_timeout: u64,
    /// Save this stage's trained weights (safetensors) here.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Sum gradients over a stage's replicas and over tied stages in the embedded
    /// executor's fixed order (gathered to each group's first rank): bit-identical to
    /// `pipewright train`, but the first rank's traffic grows with the group. By default
    /// MPI's own all-reduce sums them, in an order of its choosing (within fp32 rounding).
    #[arg(long)]
    pub deterministic_reduce: bool,
}

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// The build folder written by `pipewright compile`.
    pub build: PathBuf,
    /// Ranks to start (default: stages x replicas, which it must equal).
    #[arg(long)]
    pub np: Option<usize>,
    /// An Open MPI hostfile (hosts and slots) for a job over several machines. Under interleaved 1F1B and ZB-V each worker's stages are placed on one host (every host then needs `slots=N`)
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Run the build's stage executables (MPMD; `compile --executables`) instead of
    /// `pipewright worker` on every rank (SPMD).
    #[arg(long)]
    pub executables: bool,
    /// Print the mpirun line instead of running it.
    #[arg(long)]
    pub dry_run: bool,
    /// The worker options, after `--`, given to every rank (`-- --steps 100 --data d.npz`).
    #[arg(last = true)]
    pub worker_args: Vec<String>,
}

/// The stage executable's command line: the worker options, the build folder being the
/// executable's own folder.
#[derive(clap::Parser)]
#[command(about = "A pipewright stage executable: run without arguments to print its stage module; with options, run its stage as a pipeline worker")]
pub struct StageExeCli {
    #[command(flatten)]
    pub args: WorkerArgs,
}

#[cfg(feature = "torch")]
mod requests {
    use pipewright_core::RunFlags;
    use pipewright_driver::train::{DataSource, TrainRequest, WorkerRequest};

    impl super::TrainArgs {
        pub fn request(&self) -> anyhow::Result<TrainRequest> {
            Ok(TrainRequest {
                data: if self.data.as_os_str() == "synthetic" { DataSource::Synthetic } else { DataSource::File(self.data.clone()) },
                label: self.label.clone(),
                loss: self.loss.loss,
                output: self.loss_output().map_err(anyhow::Error::msg)?,
                classes: self.classes,
                ignore_index: self.ignore_index,
                label_smoothing: self.label_smoothing,
                steps: self.steps,
                flags: RunFlags { microbatch: self.microbatch, microbatches: self.microbatches, replicas: self.replicas },
                lr: self.lr,
                optimizer: self.optimizer,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                warmup: self.warmup,
                decay: self.decay,
                clip_norm: self.clip_norm,
                seed: self.seed,
                device: self.device,
                trace: self.trace.is_some(),
                checkpoint_every: self.checkpoint_every,
                checkpoint_dir: self.checkpoint_dir.clone(),
                resume: self.resume.clone(),
                force: self.force,
                threads: self.threads,
                timeout: std::time::Duration::from_secs(self.timeout),
                max_inflated: self.max_data_size,
                tokens: self.tokens,
                data_order: self.data_order,
                eval_data: self.eval_data.clone(),
                eval_every: self.eval_every,
                eval_batches: self.eval_batches,
                on_nonfinite: self.on_nonfinite,
                max_skips: self.max_skips,
                precision: self.precision,
                devices: self.devices.clone(),
                schedule: self.schedule,
            })
        }
    }

    impl super::WorkerArgs {
        pub fn request(&self) -> anyhow::Result<WorkerRequest> {
            Ok(WorkerRequest { train: self.train.request()?, save: self.save.clone(), deterministic_reduce: self.deterministic_reduce })
        }
    }
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The build folder (with pipeline.toml and the trained weights.safetensors).
    pub build: PathBuf,
    /// The ONNX file to write.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(clap::Args)]
pub struct RunForwardArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// A folder of `input_K.pb` files (and optionally `output_K.pb` to compare with).
    #[arg(long)]
    pub inputs: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Relative tolerance: an element matches when |actual - expected| <= atol + rtol *
    /// |expected|; any mismatch makes the command fail (exit status 1).
    #[arg(long, default_value_t = 1e-3)]
    pub rtol: f64,
    /// Absolute tolerance (see --rtol); the default allows float32 round-off on outputs
    /// near zero.
    #[arg(long, default_value_t = 1e-5)]
    pub atol: f64,
    /// Write the outputs to this .npz file, one array per output name.
    #[arg(long, value_name = "OUT.npz")]
    pub save: Option<PathBuf>,
    /// Repeat the inputs (and expected outputs) K times along the batch axis: checks the
    /// compiled model at a microbatch other than the one it was exported with.
    #[arg(long, default_value_t = 1)]
    pub tile_batch: usize,
}

#[derive(clap::Args)]
pub struct BenchStepArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// A folder of `input_K.pb` files.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Intra-op threads; libtorch's default when absent.
    #[arg(long)]
    pub threads: Option<i32>,
    /// Run in training mode (batch statistics, dropout) instead of eval mode.
    #[arg(long)]
    pub train: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
}

#[derive(clap::Args)]
pub struct BenchAllreduceArgs {
    /// Payloads to sum, each rank's (`1MiB,16MiB`).
    #[arg(long, value_name = "SIZE,...", value_delimiter = ',', value_parser = parse_size, default_value = "1MiB,4MiB,16MiB,64MiB,256MiB")]
    pub sizes: Vec<u64>,
    /// Timed sums per payload and way (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Seconds any wait may last.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
}

#[derive(clap::Args)]
pub struct ConformanceArgs {
    /// Suite folders (each holding `test_*/model.onnx` or `*.onnx` files).
    #[arg(required = true)]
    pub suites: Vec<PathBuf>,
    /// Write the markdown report here instead of stdout.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Only tests whose name contains this.
    #[arg(long)]
    pub filter: Option<String>,
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// Microbatch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub batch: Vec<u64>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Timed repetitions per node and of the whole pass, at least (more while a node's
    /// take under 20 ms, the whole pass's under 0.5 s; the median is kept; the spread of
    /// the whole model's time over the first ones is reported and stored as `spread`).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seed of the synthetic inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The training loss to time on the model's output, as `train --loss` takes it
    /// (cross-entropy, mse or output; `KIND:OUTPUT` names the output of a model with
    /// several): the last stage computes it besides its nodes.
    #[arg(long, value_name = "KIND[:OUTPUT]", value_parser = parse_loss, default_value = "cross-entropy")]
    pub loss: LossArg,
    /// Write the profile here (atomically) instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct RefineProfileArgs {
    /// The profile written by `pipewright profile`.
    pub profile: PathBuf,
    /// The build folder the trace's run trained (`pipewright compile`).
    #[arg(long)]
    pub build: PathBuf,
    /// The trace of that run (`pipewright train --trace`), or one file per rank of an MPI
    /// run of it (`t.rankR.json`, each given: their events are read together).
    #[arg(long, num_args = 1.., required = true)]
    pub trace: Vec<PathBuf>,
    /// The microbatch the run trained at (default: the one the build decided).
    #[arg(long)]
    pub batch: Option<u64>,
    /// Steps of the trace left out at its start (the warm-up).
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Write the refined profile here (atomically) instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct TraceSvgArgs {
    /// The trace written by `pipewright train --trace`.
    pub trace: PathBuf,
    /// Where to write the SVG.
    #[arg(short, long, default_value = "timeline.svg")]
    pub output: PathBuf,
    /// Width of the time axis in pixels, at least: the drawing widens (up to 20,000) until
    /// a typical compute box holds its microbatch id.
    #[arg(long, default_value_t = 1200)]
    pub width: u32,
    /// The steps to draw, START..END (the trace's steps, from 0; END excluded) or START..;
    /// default: all of a trace of up to 10 steps, else its first 10 (the SVG's title says
    /// which).
    #[arg(long, value_name = "START..END")]
    pub steps: Option<StepWindow>,
}

#[derive(clap::Args)]
pub struct MetricsSvgArgs {
    /// Metrics files written by `pipewright train --metrics` (one curve each, labelled by
    /// file name).
    #[arg(required = true)]
    pub metrics: Vec<PathBuf>,
    /// Where to write the SVG.
    #[arg(short, long, default_value = "curves.svg")]
    pub output: PathBuf,
}

#[derive(clap::Args)]
pub struct SynthArgs {
    #[command(subcommand)]
    pub kind: SynthKind,
}

#[derive(clap::Subcommand)]
pub enum SynthKind {
    /// A GPT-2-shaped decoder (input `input_ids: i64[batch, seq]`, output `logits`).
    Gpt(GptArgs),
    /// A long chain of layers with residuals and skips across many layers (input `x`, output `y`).
    Layered(LayeredArgs),
}

impl SynthArgs {
    pub fn request(&self) -> SynthRequest {
        let (shape, weights) = match &self.kind {
            SynthKind::Gpt(a) => (
                SynthShape::Gpt { preset: a.preset.clone(), layers: a.layers, hidden: a.hidden, heads: a.heads, seq: a.seq, vocab: a.vocab, untied: a.untied },
                &a.weights,
            ),
            SynthKind::Layered(a) => (SynthShape::Layered { nodes: a.nodes, width: a.width, long_skip_every: a.long_skip_every, long_skip_span: a.long_skip_span }, &a.weights),
        };
        SynthRequest { shape, weights: weights.weights, seed: weights.seed, output: weights.output.clone() }
    }
}

/// Where the generated weights go, and from which seed.
#[derive(clap::Args)]
pub struct SynthWeightArgs {
    /// `inline` (in the ONNX file), `external` (streamed into FILE.data) or `none`
    /// (declared in FILE.data, which is not written: shapes only, for `plan` and
    /// `simulate`); by default inline below 1 GiB of weights, external above.
    #[arg(long, value_name = "STORAGE")]
    #[arg(value_enum)]
    pub weights: Option<Storage>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The ONNX file to write.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(clap::Args)]
pub struct GptArgs {
    /// Start from `gpt2-small` (12 x 768), `gpt2-medium` (24 x 1024), the PipeDream-2BW
    /// paper's `gpt-1.3b` (24 x 2048), `gpt-2.2b` (32 x 2304), `gpt-3.8b` (32 x 3072, all at
    /// 512 tokens) or `tiny` (2 x 32); the flags below override it.
    #[arg(long, default_value = "gpt2-small")]
    pub preset: String,
    #[arg(long)]
    pub layers: Option<usize>,
    /// Hidden size.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Attention heads (must divide the hidden size).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Tokens per sample.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Give the output projection its own weight instead of the token embedding's.
    #[arg(long)]
    pub untied: bool,
    #[command(flatten)]
    pub weights: SynthWeightArgs,
}

#[derive(clap::Args)]
pub struct LayeredArgs {
    /// About this many nodes (3 per layer, plus the long skips).
    #[arg(long, default_value_t = 100_800)]
    pub nodes: usize,
    /// Features per layer.
    #[arg(long, default_value_t = 64)]
    pub width: usize,
    /// A long skip every this many layers.
    #[arg(long, default_value_t = 50)]
    pub long_skip_every: usize,
    /// Layers a long skip reaches back.
    #[arg(long, default_value_t = 1000)]
    pub long_skip_span: usize,
    #[command(flatten)]
    pub weights: SynthWeightArgs,
}
