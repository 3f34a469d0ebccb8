//! `pipewright inspect`: summary, text IR, Graphviz and JSON views of a model.

use anyhow::Result;
use pipewright_ir::summary::Summary;
use pipewright_ir::{import_model, BatchMode, ImportOptions};

use crate::{output::write_atomic, BatchArg, InspectArgs};

pub fn run(args: &InspectArgs) -> Result<()> {
    let opts = ImportOptions {
        batch: match args.batch {
            BatchArg::Auto => BatchMode::Auto,
            BatchArg::Fixed => BatchMode::Fixed,
        },
        ..ImportOptions::default()
    };
    let graph = import_model(&args.model, &opts)?;
    if let Some(path) = &args.dot {
        write_atomic(path, pipewright_ir::dot::print_dot(&graph).as_bytes())?;
    }
    if args.ir {
        print!("{}", pipewright_ir::text::print_graph(&graph));
    } else if args.json {
        println!("{}", serde_json::to_string_pretty(&Summary::of(&graph))?);
    } else {
        print!("{}", Summary::of(&graph).text());
    }
    Ok(())
}
