//! `inspect`: what an ONNX model or a stage module holds, as the text the command prints.

use std::path::{Path, PathBuf};

use pipewright_core::fs::write_atomic;
use pipewright_core::BatchMode;
use pipewright_ir::summary::Summary;
use pipewright_ir::{import_model, ImportOptions};
use pipewright_runtime::listing::{module_json, module_text};
use pipewright_runtime::module::{looks_like_module, read_module};

use crate::DriverError;

/// What to show of a model or a stage module (`pipewright inspect`'s options).
#[derive(Clone, Debug, clap::Args)]
pub struct InspectRequest {
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

/// The text `inspect` prints for `req` (a summary, the IR, JSON, or a stage module's
/// listing); writes the Graphviz file first when one is asked for.
pub fn inspect(req: &InspectRequest) -> Result<String, DriverError> {
    if looks_like_module(&req.model) {
        let m = read_module(&req.model)?;
        return Ok(if req.json { json_text(&module_json(&m))? } else { module_text(&m) });
    }
    let graph = import_model(&req.model, &ImportOptions { batch: req.batch, ..ImportOptions::default() })?;
    if let Some(path) = &req.dot {
        write_atomic(path, pipewright_ir::dot::print_dot(&graph).as_bytes())?;
    }
    Ok(if req.ir {
        pipewright_ir::text::print_graph(&graph)
    } else if req.json {
        json_text(&Summary::of(&graph))?
    } else {
        Summary::of(&graph).text()
    })
}

fn json_text<T: serde::Serialize>(v: &T) -> Result<String, DriverError> {
    serde_json::to_string_pretty(v).map(|s| s + "\n").map_err(|e| DriverError::msg(e.to_string()))
}

/// The stage module appended to this executable, when it is a stage executable
/// (`compile --executables`).
pub fn embedded_module() -> Option<Vec<u8>> {
    pipewright_runtime::exe::embedded_module()
}

/// The listing of a stage module given as bytes (a stage executable's own module).
pub fn module_listing(bytes: &[u8], what: &Path) -> Result<String, DriverError> {
    pipewright_runtime::module::decode_module(bytes)
        .map(|m| module_text(&m))
        .map_err(|e| DriverError::msg(format!("{}: {e}", what.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: PathBuf, ir: bool, json: bool) -> InspectRequest {
        InspectRequest { model: path, ir, dot: None, json, batch: BatchMode::Auto }
    }

    /// A model's summary, IR and JSON, and a stage module's listing, each as printed.
    #[test]
    fn models_and_modules_print_their_forms() {
        let mlp = crate::compile::tests::model("mlp.onnx");
        assert!(inspect(&request(mlp.clone(), false, false)).unwrap().contains("nodes"));
        assert!(inspect(&request(mlp.clone(), true, false)).unwrap().contains("Gemm"));
        let json: serde_json::Value = serde_json::from_str(&inspect(&request(mlp.clone(), false, true)).unwrap()).unwrap();
        assert!(json.is_object(), "{json}");
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("b");
        crate::compile::compile(&crate::compile::tests::request("mlp.onnx", crate::compile::tests::stages(2), &build)).unwrap();
        let listing = inspect(&request(build.join("stage1.pwm"), false, false)).unwrap();
        assert!(listing.starts_with("stage module: stage 1 of 2"), "{listing}");
        let bytes = std::fs::read(build.join("stage0.pwm")).unwrap();
        assert!(module_listing(&bytes, Path::new("stage0")).unwrap().starts_with("stage module: stage 0 of 2"));
        let e = module_listing(b"nonsense", Path::new("the stage module appended to this executable")).unwrap_err().to_string();
        assert!(e.starts_with("the stage module appended to this executable: "), "{e}");
    }
}
