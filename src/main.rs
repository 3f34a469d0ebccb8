//! The `pipewright` command line: inspect, plan, compile and train ONNX models as
//! pipeline-parallel jobs, plus the tools that check and measure them.

#[cfg(feature = "torch")]
mod bench_step;
#[cfg(feature = "torch")]
mod conformance;
#[cfg(feature = "torch")]
mod forward;
#[cfg(feature = "torch")]
mod profile;
#[cfg(feature = "torch")]
mod data;
#[cfg(feature = "torch")]
mod train;
#[cfg(feature = "torch")]
mod export;
#[cfg(feature = "torch")]
mod worker;
mod compile;
mod inspect;
mod output;
mod plan;
mod trace_svg;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pipewright_core::{Balance, BatchMode, Decay, Device, Loss, Optimizer, PassName, Recompute, Schedule};

#[derive(Parser)]
#[command(name = "pipewright", version, about = "Compile ONNX models into pipeline-parallel (PipeDream-2BW) training jobs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import an ONNX model and print a summary (or its IR, or a Graphviz drawing); given a
    /// stage module (`.pwm`), print its header and stage program.
    Inspect(InspectArgs),
    /// Plan the pipeline: depth, width, microbatch, recomputation, schedule, and the stages.
    Plan(PlanArgs),
    /// Compile a model into per-stage modules (`stageK.pwm`), stage ONNX models and `pipeline.toml`.
    Compile(CompileArgs),
    /// Run a model forward through the runtime's op layer and compare with expected outputs.
    #[cfg(feature = "torch")]
    RunForward(RunForwardArgs),
    /// Time forward + backward steps of a model through the op layer (for benchmarks).
    #[cfg(feature = "torch")]
    BenchStep(bench_step::BenchStepArgs),
    /// Run the ONNX backend test suite through the op layer and report conformance.
    #[cfg(feature = "torch")]
    Conformance(ConformanceArgs),
    /// Measure forward and backward time per node at several microbatch sizes (JSON for `plan`).
    #[cfg(feature = "torch")]
    Profile(ProfileArgs),
    /// Train a compiled pipeline on the embedded executor (one thread per stage).
    #[cfg(feature = "torch")]
    Train(TrainArgs),
    /// Write the weights `train` saved back into the original ONNX model.
    #[cfg(feature = "torch")]
    Export(ExportArgs),
    /// Run one stage of one replica as its own process, linked to the other workers over
    /// TCP (a multi-process or multi-machine pipeline; stage executables do the same).
    #[cfg(feature = "torch")]
    Worker(worker::WorkerArgs),
    /// Draw a `train --trace` timeline as SVG (one row per stage) and print bubble fractions.
    TraceSvg(trace_svg::TraceSvgArgs),
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
    #[arg(long, default_value_t = 1e-3)]
    pub rtol: f64,
    #[arg(long, default_value_t = 1e-7)]
    pub atol: f64,
    /// Repeat the inputs (and expected outputs) K times along the batch axis: checks the
    /// compiled model at a microbatch other than the one it was exported with.
    #[arg(long, default_value_t = 1)]
    pub tile_batch: usize,
}

#[derive(clap::Args)]
pub struct PlanArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// Workers (accelerators) in the cluster.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Memory per worker, e.g. 16GiB.
    #[arg(long)]
    pub memory: Option<String>,
    /// Bandwidth between workers of one server, e.g. 150GB/s.
    #[arg(long)]
    pub intra_bw: Option<String>,
    /// Bandwidth between servers, e.g. 25Gbit/s.
    #[arg(long)]
    pub inter_bw: Option<String>,
    /// Workers per server.
    #[arg(long)]
    pub workers_per_node: Option<usize>,
    /// Peak flop/s of one worker, e.g. 15.7T.
    #[arg(long)]
    pub peak_flops: Option<String>,
    /// A cluster description in TOML (flags override it).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Global batch size (samples per optimizer step).
    #[arg(long, default_value_t = 512)]
    pub batch: u64,
    /// Fix the microbatch size.
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Fix the pipeline depth.
    #[arg(long)]
    pub stages: Option<usize>,
    /// Explicit stage starts, by ONNX node name.
    #[arg(long, value_delimiter = ',')]
    pub cut: Vec<String>,
    /// How stages are balanced.
    #[arg(long, value_enum, default_value_t = Balance::Optimal)]
    pub balance: Balance,
    /// A profile from `pipewright profile` to calibrate the cost model.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Optimizer whose state counts in memory.
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    pub optimizer: Optimizer,
    /// Count an SGD momentum buffer per weight.
    #[arg(long)]
    pub momentum: bool,
    /// Schedules to consider.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Schedule::ALL.to_vec())]
    pub schedule: Vec<Schedule>,
    /// Fix activation recomputation; by default all three are tried.
    #[arg(long, value_enum)]
    pub recompute: Option<Recompute>,
    /// Candidates to show.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print the IR after a pass instead of the plan (`partition`).
    #[arg(long, value_enum)]
    pub print_after: Option<PassName>,
}

#[derive(clap::Args)]
pub struct CompileArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// Pipeline depth (number of stages); the planner picks it when neither this nor --plan is given.
    #[arg(long, conflicts_with = "plan")]
    pub stages: Option<usize>,
    /// A plan from `pipewright plan --json` (its depth, stage starts, microbatch and schedule).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// The build folder (created if missing).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = Schedule::TwoBw)]
    pub schedule: Schedule,
    /// Activation recomputation.
    #[arg(long, value_enum, default_value_t = Recompute::None)]
    pub recompute: Recompute,
    /// Global batch size (samples per optimizer step) for the planner.
    #[arg(long, default_value_t = 512)]
    pub batch: u64,
    /// Fix the microbatch size.
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Also write `stageK`: a copy of this binary with the stage module appended (run it
    /// without arguments to print its module).
    #[arg(long)]
    pub executables: bool,
    /// Print the IR after a pass (import, shape-inference, partition, recompute,
    /// weight-versioning, lower) or after `all`.
    #[arg(long)]
    pub print_after: Option<String>,
    /// Stop after this pass (nothing is written unless it is `lower`).
    #[arg(long)]
    pub stop_after: Option<String>,
    /// Print the time each pass took (stderr).
    #[arg(long)]
    pub timings: bool,
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
pub struct TrainArgs {
    /// The build folder written by `pipewright compile`.
    pub build: PathBuf,
    /// `synthetic`, or a .npz file, a folder of .npy files, or a .safetensors file whose
    /// arrays are named after the model's inputs (first axis = samples).
    #[arg(long, default_value = "synthetic")]
    pub data: PathBuf,
    /// The labels array in the data file.
    #[arg(long)]
    pub label: Option<String>,
    /// The loss, applied to the model output --output names.
    #[arg(long, value_enum, default_value_t = Loss::CrossEntropy)]
    pub loss: Loss,
    /// The model output the loss applies to.
    #[arg(long)]
    pub output: Option<String>,
    /// Classes of the random labels of `--data synthetic`.
    #[arg(long, default_value_t = 10)]
    pub classes: i64,
    /// Optimizer steps (batches).
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Microbatch size.
    #[arg(long, default_value_t = 16)]
    pub microbatch: usize,
    /// Microbatches per step (default: the pipeline depth, the least 2BW allows).
    #[arg(long)]
    pub microbatches: Option<usize>,
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,
    #[arg(long, value_enum, default_value_t = Optimizer::Sgd)]
    pub optimizer: Optimizer,
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Learning-rate decay after the warm-up.
    #[arg(long, value_enum, default_value_t = Decay::Constant)]
    pub decay: Decay,
    /// Clip gradients to this global norm across all stages.
    #[arg(long)]
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
    /// Data-parallel width: this many copies of the pipeline, each fed every W-th
    /// microbatch; gradients are averaged across copies before each update.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
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
    /// Plain progress lines instead of a progress bar (also when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Intra-op threads per worker (default for `train`: the cores divided among its
    /// stages x replicas worker threads, at least 1; for `worker`: libtorch's default).
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// Microbatch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub batch: Vec<i64>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Timed repetitions per node (median).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seed of the synthetic inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the profile here (atomically) instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
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
pub struct InspectArgs {
    /// The ONNX model file, or a stage module (`.pwm`) written by `compile`.
    pub model: PathBuf,
    /// Print the IR in text form instead of the summary.
    #[arg(long)]
    pub ir: bool,
    /// Write a Graphviz drawing of the graph to FILE.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long, conflicts_with = "ir")]
    pub json: bool,
    /// How the batch axis is chosen.
    #[arg(long, value_enum, default_value_t = BatchMode::Auto)]
    pub batch: BatchMode,
}

/// A stage executable started with options: its folder is the build folder.
#[cfg(feature = "torch")]
fn stage_executable(bytes: Vec<u8>) -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let dir = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf())).unwrap_or_else(|| PathBuf::from("."));
    argv.insert(1, dir.into_os_string());
    let cli = <worker::StageExeCli as Parser>::parse_from(argv);
    match worker::run(&cli.args, Some(bytes)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Help and version go to stdout as clap writes them; a bad argument is one line on
/// stderr, with the accepted values when there is a list of them.
fn argument_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) {
        let _ = e.print();
        return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
    }
    // clap's first paragraph says what is wrong (and lists the accepted values); usage and
    // tips follow after a blank line.
    let rendered = e.render().to_string();
    let first: Vec<&str> = rendered.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    eprintln!("{}", first.join(" "));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // A stage executable (`compile --executables`) run without arguments describes the
    // stage module appended to it; with options (`--...`) it runs that stage as a worker
    // of a multi-process pipeline; with a subcommand it is the ordinary CLI.
    #[cfg(feature = "torch")]
    if std::env::args().nth(1).is_some_and(|a| a.starts_with("--") && a != "--help" && a != "--version") {
        if let Some(bytes) = compile::embedded_module() {
            return stage_executable(bytes);
        }
    }
    if std::env::args_os().len() == 1 {
        if let Some(bytes) = compile::embedded_module() {
            return match inspect::print_module_bytes(&bytes) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("error: the stage module appended to this executable: {err}");
                    ExitCode::FAILURE
                }
            };
        }
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return argument_error(e),
    };
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Compile(args) => compile::run(&args),
        #[cfg(feature = "torch")]
        Command::RunForward(args) => forward::run(&args),
        #[cfg(feature = "torch")]
        Command::BenchStep(args) => bench_step::run(&args),
        #[cfg(feature = "torch")]
        Command::Conformance(args) => conformance::run(&args),
        #[cfg(feature = "torch")]
        Command::Profile(args) => profile::run(&args),
        #[cfg(feature = "torch")]
        Command::Train(args) => train::run(&args),
        #[cfg(feature = "torch")]
        Command::Export(args) => export::run(&args),
        #[cfg(feature = "torch")]
        Command::Worker(args) => worker::run(&args, None),
        Command::TraceSvg(args) => trace_svg::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
