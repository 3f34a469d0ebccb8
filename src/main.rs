//! The `pipewright` command line: inspect ONNX models (and, as the later passes land,
//! plan, compile and train them).

mod inspect;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "pipewright", version, about = "Compile ONNX models into pipeline-parallel (PipeDream-2BW) training jobs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import an ONNX model and print a summary (or its IR, or a Graphviz drawing).
    Inspect(InspectArgs),
}

/// How to treat the batch axis at import.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum BatchArg {
    /// Axis 0 of the graph inputs becomes the symbol N when all inputs share it.
    Auto,
    /// Keep every extent as exported.
    Fixed,
}

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The ONNX model file.
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
    #[arg(long, value_enum, default_value = "auto")]
    pub batch: BatchArg,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
