//! Trained weights out of a pipeline: `pipewright train` saves them as
//! `BUILD/weights.safetensors`, and `pipewright export BUILD -o trained.onnx` writes them
//! back into the original ONNX model's initializers (by name, same type and shape).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use onnx_protobuf::{Message, ModelProto};
use pipewright_runtime::exec::tensor_to_bytes;
use pipewright_runtime::module::dtype_of;
use pipewright_runtime::pipeline::TrainReport;
use pipewright_runtime::ElemType;
use safetensors::tensor::TensorView;

use crate::output::write_atomic;
use crate::ExportArgs;

/// The file `train` writes into the build folder.
pub const WEIGHTS_FILE: &str = "weights.safetensors";

/// Saves a training report's newest trainable weights and running statistics, by source
/// name, atomically. A weight present in several stages (a tied weight) is saved once,
/// from its first stage.
pub fn save_weights(path: &Path, report: &TrainReport) -> Result<()> {
    let mut raw: Vec<(String, ElemType, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in report.weights.iter().chain(&report.buffers).flatten() {
        if raw.iter().any(|r| &r.0 == name) {
            continue;
        }
        let (elem, dims, bytes) = tensor_to_bytes(t).map_err(|e| anyhow!("weight {name:?}: {e}"))?;
        raw.push((name.clone(), elem, dims.iter().map(|&d| d as usize).collect(), bytes));
    }
    let views = raw
        .iter()
        .map(|(n, e, d, b)| TensorView::new(dtype_of(*e), d.clone(), b).map(|v| (n.clone(), v)).map_err(|e| anyhow!("weight {n:?}: {e:?}")))
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| anyhow!("{}: {e:?}", path.display()))?;
    write_atomic(path, &bytes)
}

/// `pipewright export`.
pub fn run(args: &ExportArgs) -> Result<()> {
    let manifest_path = args.build.join("pipeline.toml");
    let text = std::fs::read_to_string(&manifest_path).with_context(|| format!("{}: cannot read", manifest_path.display()))?;
    let manifest: toml::Value = toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", manifest_path.display()))?;
    let model_path = manifest.get("model").and_then(|m| m.as_str()).ok_or_else(|| anyhow!("{}: no model", manifest_path.display()))?;
    let weights_path = args.build.join(WEIGHTS_FILE);
    let weights_bytes = std::fs::read(&weights_path).with_context(|| format!("{}: cannot read (train the pipeline first)", weights_path.display()))?;
    let weights = safetensors::SafeTensors::deserialize(&weights_bytes).map_err(|e| anyhow!("{}: {e:?}", weights_path.display()))?;
    let trained: HashMap<String, TensorView> = weights.tensors().into_iter().collect();
    let model_bytes = std::fs::read(model_path).with_context(|| format!("{model_path}: cannot read the source model"))?;
    let mut model = ModelProto::parse_from_bytes(&model_bytes).map_err(|e| anyhow!("{model_path}: {e}"))?;
    let graph = model.graph.as_mut().ok_or_else(|| anyhow!("{model_path}: no graph"))?;
    let mut replaced = 0;
    for init in graph.initializer.iter_mut() {
        let Some(view) = trained.get(&init.name) else { continue };
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        if dims != init.dims {
            bail!("{}: weight {:?} has shape {:?}, the model's initializer {:?}", weights_path.display(), init.name, dims, init.dims);
        }
        if !init.external_data.is_empty() {
            bail!("{model_path}: initializer {:?} uses external data, which export does not rewrite", init.name);
        }
        init.raw_data = view.data().to_vec();
        init.float_data.clear();
        init.double_data.clear();
        init.int32_data.clear();
        init.int64_data.clear();
        replaced += 1;
    }
    if replaced == 0 {
        bail!("{}: none of its weights names an initializer of {model_path}", weights_path.display());
    }
    let out = model.write_to_bytes().map_err(|e| anyhow!("{}: {e}", args.output.display()))?;
    write_atomic(&args.output, &out)?;
    println!("wrote {} ({replaced} trained initializers from {})", args.output.display(), weights_path.display());
    Ok(())
}
