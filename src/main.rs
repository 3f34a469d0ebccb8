//! The `pipewright` command line: inspect, plan, compile and train ONNX models as
//! pipeline-parallel jobs, plus the tools that check and measure them. Argument parsing
//! and printing only; the work is in the library crates (mostly `pipewright-driver`).

mod args;
mod commands;
#[cfg(feature = "torch")]
mod progress;
#[cfg(feature = "torch")]
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use args::{ExportArgs, LaunchArgs, MetricsSvgArgs, SynthArgs, TraceSvgArgs};
use pipewright_driver::inspect::InspectRequest;
use pipewright_driver::plan::{CompileSpec, PlanSpec};
use pipewright_driver::simulate::SimulateSpec;
#[cfg(feature = "torch")]
use args::{BenchAllreduceArgs, BenchStepArgs, ConformanceArgs, ProfileArgs, RefineProfileArgs, RunForwardArgs, TrainArgs, WorkerArgs};

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
    Inspect(InspectRequest),
    /// Plan the pipeline: depth, width, microbatch, recomputation, schedule, and the stages.
    ///
    /// The plan is for the cluster the options describe; without any, for a default server
    /// of 8 V100-class GPUs (16 GiB, 15.7 Tflop/s each), which the output says.
    Plan(PlanSpec),
    /// Replay training on a cluster event by event: 2BW, PipeDream-Flush, GPipe, ZB-H1, ZB-H2,
    /// interleaved 1F1B, ZB-V and the baselines without pipelining, each as the planner configures it, with the runtime's
    /// per-stage operation order; samples/s, bubbles, busy time and memory per stage.
    Simulate(SimulateSpec),
    /// Compile a model into a build folder: per-stage modules (`stageK.pwm`) and
    /// `pipeline.toml` (with `--stage-onnx`, also each stage as ONNX).
    Compile(CompileSpec),
    /// Write the weights `train` saved back into the original ONNX model.
    Export(ExportArgs),
    /// Draw a `train --trace` timeline as SVG (one row per stage) and print bubble fractions.
    TraceSvg(TraceSvgArgs),
    /// Draw the loss curves (and learning rate) of one or more `train --metrics` files as SVG.
    MetricsSvg(MetricsSvgArgs),
    /// Generate a synthetic ONNX model at a real size (GPT-2-shaped, or a long layered graph
    /// with skips) with random weights, to try the tool at scale without downloading one.
    Synth(SynthArgs),
    /// Start a build's pipeline as an MPI job (one rank per stage and replica), or print
    /// the `mpirun` line (`--dry-run`).
    Launch(LaunchArgs),
    /// Train a compiled pipeline on the embedded executor (one thread per stage and replica;
    /// under interleaved 1F1B and ZB-V a worker's stage threads take turns).
    #[cfg(feature = "torch")]
    Train(TrainArgs),
    /// Run one stage of one replica as a rank of an MPI job (started by `mpirun`, `srun` or
    /// `pipewright launch`; stage executables do the same).
    #[cfg(feature = "torch")]
    Worker(WorkerArgs),
    /// Run a model forward through the runtime's op layer and compare with expected outputs.
    #[cfg(feature = "torch")]
    RunForward(RunForwardArgs),
    /// Time forward + backward steps of a model through the op layer (for benchmarks).
    #[cfg(feature = "torch")]
    BenchStep(BenchStepArgs),
    /// Time a sum of each payload over every rank of an MPI job, by the fixed order and by
    /// MPI's all-reduce (`mpirun -np W pipewright bench-allreduce`; for benchmarks).
    #[cfg(feature = "torch")]
    BenchAllreduce(BenchAllreduceArgs),
    /// Run the ONNX backend test suite through the op layer and report conformance.
    #[cfg(feature = "torch")]
    Conformance(ConformanceArgs),
    /// Measure forward and backward time per node at several microbatch sizes, and what the runtime adds (a stage boundary, its untraced work after a backward, how it divides the pass between two stages, threads crowding the CPU cores, the scheduler's turn): JSON for `plan` and `simulate`.
    #[cfg(feature = "torch")]
    Profile(ProfileArgs),
    /// Replace a profile's stage split at a microbatch by the stages' times in a pipeline's
    /// trace (a `train --trace` run of a build), so that `plan --profile` cuts by what the
    /// pipeline measured.
    #[cfg(feature = "torch")]
    RefineProfile(RefineProfileArgs),
    /// Print the libtorch in use (version, folder), whether CUDA is available and the
    /// devices with their memory (for bug reports and for checking a GPU machine).
    #[cfg(feature = "torch")]
    Doctor,
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// A stage executable (`compile --executables`) run without arguments prints the stage
/// module appended to it; with options (`--...`) it runs that stage as a worker of a
/// multi-process pipeline, the build folder being its own folder. `None`: not a stage
/// executable, or run as the ordinary CLI.
fn stage_executable() -> Option<ExitCode> {
    let first = std::env::args().nth(1);
    let as_worker = first.as_deref().is_some_and(|a| a.starts_with("--") && a != "--help" && a != "--version");
    if first.is_some() && !as_worker {
        return None;
    }
    let bytes = pipewright_driver::inspect::embedded_module()?;
    if first.is_none() {
        let what = std::path::Path::new("the stage module appended to this executable");
        return Some(finish(pipewright_driver::inspect::module_listing(&bytes, what).map(|text| print!("{text}")).map_err(anyhow::Error::from)));
    }
    #[cfg(feature = "torch")]
    {
        let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
        let dir = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf())).unwrap_or_else(|| ".".into());
        argv.insert(1, dir.into_os_string());
        let cli = match args::StageExeCli::try_parse_from(argv) {
            Ok(cli) => cli,
            Err(e) => return Some(argument_error(e)),
        };
        Some(finish(run::worker(&cli.args, Some(bytes))))
    }
    #[cfg(not(feature = "torch"))]
    {
        eprintln!("error: this pipewright was built without libtorch and cannot run a stage");
        Some(ExitCode::FAILURE)
    }
}

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
    // Before any thread starts: libtorch's tensors are malloc'd, and a step frees and
    // allocates the same ones each microbatch.
    #[cfg(feature = "torch")]
    pipewright_driver::heap::keep_freed_memory();
    if let Some(code) = stage_executable() {
        return code;
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return argument_error(e),
    };
    finish(match cli.command {
        Command::Inspect(args) => commands::inspect(&args),
        Command::Plan(args) => commands::plan(&args),
        Command::Simulate(args) => commands::simulate(&args),
        Command::Compile(args) => commands::compile_command(&args),
        Command::Export(args) => commands::export(&args),
        Command::TraceSvg(args) => commands::trace_svg(&args),
        Command::MetricsSvg(args) => commands::metrics_svg(&args),
        Command::Synth(args) => commands::synth(&args),
        Command::Launch(args) => commands::launch(&args),
        #[cfg(feature = "torch")]
        Command::Train(args) => run::train(&args),
        #[cfg(feature = "torch")]
        Command::Worker(args) => run::worker(&args, None),
        #[cfg(feature = "torch")]
        Command::RunForward(args) => run::run_forward(&args),
        #[cfg(feature = "torch")]
        Command::BenchStep(args) => run::bench_step(&args),
        #[cfg(feature = "torch")]
        Command::BenchAllreduce(args) => run::bench_allreduce(&args),
        #[cfg(feature = "torch")]
        Command::Conformance(args) => run::conformance(&args),
        #[cfg(feature = "torch")]
        Command::Profile(args) => run::profile(&args),
        #[cfg(feature = "torch")]
        Command::RefineProfile(args) => run::refine_profile(&args),
        #[cfg(feature = "torch")]
        Command::Doctor => {
            print!("{}", pipewright_driver::doctor::doctor());
            Ok(())
        }
    })
}
