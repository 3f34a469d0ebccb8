//! The compile-time check that a fixed-batch export really follows the batch: the lowered
//! stages run forward once, in order, at a batch other than the export batch, before the
//! build is written.
//!
//! An exporter that fixes the batch bakes it into shape computations (attention masks,
//! window partitions, expanded class tokens) that the importer and lowering's batch
//! rewrites cannot always make symbolic. Without this check such a model compiled, then
//! failed inside libtorch at the first training step at any other microbatch. With it,
//! `compile` refuses, naming the stage and node, and says what to do.

use std::collections::HashMap;
use std::path::Path;

use pipewright_codegen::build::Lowered;
use pipewright_runtime::exec::{torch_kind, Mode};
use pipewright_runtime::interp::Interpreter;
use tch::Tensor;

use crate::DriverError;

/// Runs `lowered`'s stages forward at batch `export_batch + 1` on zeros; an error names
/// the stage and node that fail there.
pub fn check_other_batch(lowered: &Lowered, model: &Path, export_batch: i64) -> Result<(), DriverError> {
    let batch = export_batch + 1;
    let axes: Vec<String> = lowered.stages.iter().flat_map(|sp| &sp.graph_inputs).map(|i| format!("{:?}: {{0: \"batch\"}}", i.name)).collect();
    let axes = axes.join(", ");
    let _guard = tch::no_grad_guard();
    let mut env: HashMap<String, Tensor> = HashMap::new();
    let refuse = |stage: u32, what: String| {
        DriverError::msg(format!(
            "{}: stage {stage}: {what}, at batch {batch} (the model was exported at the fixed batch {export_batch}). The export fixed the batch in shapes this node depends on, which pipewright cannot make follow the batch: export the model with a dynamic batch axis (torch.onnx.export(..., dynamic_shapes=...) with dynamo=True, or dynamic_axes={{{axes}}} with dynamo=False) and compile that",
            model.display()
        ))
    };
    for sp in &lowered.stages {
        let mut args = Vec::with_capacity(sp.program.inputs.len());
        for r in &sp.received {
            args.push(env.get(&r.name).map(Tensor::shallow_clone).ok_or_else(|| refuse(sp.stage, format!("nothing was sent as {:?}", r.name)))?);
        }
        for input in &sp.graph_inputs {
            let kind = torch_kind(input.elem).map_err(|e| refuse(sp.stage, format!("graph input {:?}: {e}", input.name)))?;
            let dims: Vec<i64> = input.shape.iter().map(|e| e.at(batch)).collect();
            args.push(Tensor::zeros(dims.as_slice(), (kind, tch::Device::Cpu)));
        }
        let interp = Interpreter::new(sp.program.clone(), tch::Device::Cpu).map_err(|e| refuse(sp.stage, e.to_string()))?;
        let results = interp.run(&args, Mode::Eval).map_err(|e| refuse(sp.stage, first_line(&e.to_string())))?;
        let names = sp.sent.iter().map(|s| s.name.clone()).chain(sp.graph_outputs.iter().map(|o| o.name.clone()));
        env.extend(names.zip(results));
    }
    Ok(())
}

/// libtorch's messages go on with a C++ trace after their first line.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").to_string()
}
