//! The compile-time check that a fixed-batch export really follows the batch: the lowered
//! stages run forward once, in order, at a batch other than the export batch, every
//! sample the same input, before the build is written.
//!
//! An exporter that fixes the batch bakes it into shape computations (attention masks,
//! window partitions, expanded class tokens) that the importer and lowering's batch
//! rewrites cannot always make symbolic. Without this check such a model compiled, then
//! failed inside libtorch at the first training step at any other microbatch. With it,
//! `compile` refuses, naming the stage and node, and says what to do. A reading of the
//! baked shapes whose element counts agree at the other batch but that moves values
//! between samples fails no kernel; it shows as samples of the same input giving
//! different outputs, and `compile` refuses that too, naming the output.

use std::collections::HashMap;
use std::path::Path;

use pipewright_codegen::build::Lowered;
use pipewright_codegen::stage::StageTensor;
use pipewright_runtime::program::Extent;
use pipewright_runtime::exec::{torch_kind, Mode};
use pipewright_runtime::interp::Interpreter;
use tch::Tensor;

use crate::DriverError;

/// Runs `lowered`'s stages forward at batch `export_batch + 1`, every sample the same
/// input ([`same_samples`]); an error names the stage and node that fail there, or the
/// graph output whose samples differ.
pub fn check_other_batch(lowered: &Lowered, model: &Path, export_batch: i64) -> Result<(), DriverError> {
    let batch = export_batch + 1;
    let axes: Vec<String> = lowered.stages.iter().flat_map(|sp| &sp.graph_inputs).map(|i| format!("{:?}: {{0: \"batch\"}}", i.name)).collect();
    let axes = axes.join(", ");
    let _guard = tch::no_grad_guard();
    let mut env: HashMap<String, Tensor> = HashMap::new();
    let refuse = |stage: u32, what: String| {
        DriverError::msg(format!(
            "{}: stage {stage}: {what}, at batch {batch} (the model was exported at the fixed batch {export_batch}). The export fixed the batch in shapes this depends on, which pipewright cannot make follow the batch: export the model with a dynamic batch axis (torch.onnx.export(..., dynamic_shapes=...) with dynamo=True, or dynamic_axes={{{axes}}} with dynamo=False) and compile that",
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
            args.push(same_samples(input, kind, batch).map_err(|e| refuse(sp.stage, format!("graph input {:?}: {e}", input.name)))?);
        }
        let interp = Interpreter::new(sp.program.clone(), tch::Device::Cpu).map_err(|e| refuse(sp.stage, e.to_string()))?;
        let results = interp.run(&args, Mode::Eval).map_err(|e| refuse(sp.stage, first_line(&e.to_string())))?;
        for (output, t) in sp.graph_outputs.iter().zip(&results[sp.sent.len()..]) {
            if let Some(what) = samples_differ(output, t).map_err(|e| refuse(sp.stage, format!("graph output {:?}: {e}", output.name)))? {
                return Err(refuse(sp.stage, format!("graph output {:?}: {what}, though every sample was the same input: pipewright's reading of the export's fixed shapes moves values between the samples", output.name)));
            }
        }
        let names = sp.sent.iter().map(|s| s.name.clone()).chain(sp.graph_outputs.iter().map(|o| o.name.clone()));
        env.extend(names.zip(results));
    }
    Ok(())
}

/// Graph input `input` at `batch` with every sample the same: a float input that leads
/// with the batch is one sample of smoothly varying values (`sin` of the element index,
/// no random state) repeated along the batch; anything else is zeros, which are valid
/// token ids, indices and masks.
fn same_samples(input: &StageTensor, kind: tch::Kind, batch: i64) -> Result<Tensor, tch::TchError> {
    let dims: Vec<i64> = input.shape.iter().map(|e| e.at(batch)).collect();
    let leads_with_batch = input.shape.first() == Some(&Extent::Batch(1));
    if !(leads_with_batch && input.elem.is_float()) {
        return Ok(Tensor::zeros(dims.as_slice(), (kind, tch::Device::Cpu)));
    }
    let sample: i64 = dims[1..].iter().product();
    let one = Tensor::f_arange(sample, (tch::Kind::Double, tch::Device::Cpu))?.f_mul_scalar(0.37)?.f_sin()?;
    let mut shape = vec![1];
    shape.extend_from_slice(&dims[1..]);
    one.f_reshape(shape.as_slice())?.f_expand(dims.as_slice(), false)?.f_contiguous()?.f_to_kind(kind)
}

/// Where a float graph output leading with the batch differs between its first sample and
/// another by more than 1e-3 of the first's largest magnitude: which sample, and by how much.
fn samples_differ(output: &StageTensor, t: &Tensor) -> Result<Option<String>, tch::TchError> {
    if output.shape.first() != Some(&Extent::Batch(1)) || !t.is_floating_point() || t.dim() == 0 || t.size()[0] < 2 {
        return Ok(None);
    }
    let t = t.f_to_kind(tch::Kind::Double)?;
    let first = t.f_get(0)?;
    let scale = first.f_abs()?.f_max()?.f_double_value(&[])?;
    for k in 1..t.size()[0] {
        let diff = t.f_get(k)?.f_sub(&first)?.f_abs()?.f_max()?.f_double_value(&[])?;
        if diff > 1e-3 * scale {
            return Ok(Some(format!("sample {k} differs from sample 0 by up to {diff:.3e} (its values reach {scale:.3e})")));
        }
    }
    Ok(None)
}

/// libtorch's messages go on with a C++ trace after their first line.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").to_string()
}
