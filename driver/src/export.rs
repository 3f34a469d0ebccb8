//! Trained weights out of a pipeline: `train` saves them as `BUILD/weights.safetensors`
//! ([`save_weights`]); `pipewright export BUILD -o trained.onnx` writes them back into the
//! source model's initializers ([`export_onnx`]: by name, same shape).

use std::collections::HashMap;
use std::path::Path;

use onnx_protobuf::{Message, ModelProto};
use pipewright_core::fs::write_atomic;
use pipewright_runtime::build::Manifest;
use safetensors::tensor::TensorView;

use crate::DriverError;

/// The file `train` writes into the build folder.
pub const WEIGHTS_FILE: &str = "weights.safetensors";

/// Saves the newest trainable weights and running statistics of a training report, by
/// source name, atomically. A weight present in several stages (a tied weight) is saved
/// once, from its first stage.
#[cfg(feature = "torch")]
pub fn save_weights(path: &Path, report: &pipewright_runtime::pipeline::TrainReport) -> Result<(), DriverError> {
    use pipewright_runtime::exec::tensor_to_bytes;
    use pipewright_runtime::module::dtype_of;
    let mut raw: Vec<(String, pipewright_runtime::ElemType, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in report.weights.iter().chain(&report.buffers).flatten() {
        if raw.iter().any(|r| &r.0 == name) {
            continue;
        }
        let (elem, dims, bytes) = tensor_to_bytes(t).map_err(|e| DriverError::msg(format!("weight {name:?}: {e}")))?;
        raw.push((name.clone(), elem, dims.iter().map(|&d| d as usize).collect(), bytes));
    }
    let views = raw
        .iter()
        .map(|(n, e, d, b)| TensorView::new(dtype_of(*e), d.clone(), b).map(|v| (n.clone(), v)).map_err(|e| DriverError::msg(format!("weight {n:?}: {e:?}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| DriverError::msg(format!("{}: {e:?}", path.display())))?;
    Ok(write_atomic(path, &bytes)?)
}

/// Writes the source model of the build `build` to `output` with the trained weights of
/// `BUILD/weights.safetensors` in its initializers. Returns how many were replaced.
pub fn export_onnx(build: &Path, output: &Path) -> Result<usize, DriverError> {
    let manifest = Manifest::read(build)?;
    let model_path = Path::new(&manifest.model);
    let weights_path = build.join(WEIGHTS_FILE);
    let read = |p: &Path| std::fs::read(p).map_err(|source| DriverError::Read { path: p.to_path_buf(), source });
    let weights_bytes = read(&weights_path).map_err(|e| DriverError::msg(format!("{e} (train the pipeline first)")))?;
    let weights = safetensors::SafeTensors::deserialize(&weights_bytes).map_err(|e| DriverError::msg(format!("{}: {e:?}", weights_path.display())))?;
    let trained: HashMap<String, TensorView> = weights.tensors().into_iter().collect();
    let model_bytes = read(model_path)?;
    if format!("{:08x}", crc32(&model_bytes)) != manifest.model_crc32 {
        return Err(DriverError::msg(format!(
            "{}: the source model changed since it was compiled (CRC-32 {} in {}); compile and train it again",
            model_path.display(),
            manifest.model_crc32,
            build.display()
        )));
    }
    let mut model = ModelProto::parse_from_bytes(&model_bytes).map_err(|e| DriverError::msg(format!("{}: {e}", model_path.display())))?;
    let graph = model.graph.as_mut().ok_or_else(|| DriverError::msg(format!("{}: no graph", model_path.display())))?;
    let mut replaced = 0;
    for init in graph.initializer.iter_mut() {
        let Some(view) = trained.get(&init.name) else { continue };
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        if dims != init.dims {
            return Err(DriverError::msg(format!("{}: weight {:?} has shape {dims:?}, the model's initializer {:?}", weights_path.display(), init.name, init.dims)));
        }
        if !init.external_data.is_empty() {
            return Err(DriverError::msg(format!("{}: initializer {:?} uses external data, which export does not rewrite", model_path.display(), init.name)));
        }
        init.raw_data = view.data().to_vec();
        init.float_data.clear();
        init.double_data.clear();
        init.int32_data.clear();
        init.int64_data.clear();
        replaced += 1;
    }
    if replaced == 0 {
        return Err(DriverError::msg(format!("{}: none of its weights names an initializer of {}", weights_path.display(), model_path.display())));
    }
    let out = model.write_to_bytes().map_err(|e| DriverError::msg(format!("{}: {e}", output.display())))?;
    write_atomic(output, &out)?;
    Ok(replaced)
}

fn crc32(bytes: &[u8]) -> u32 {
    pipewright_ir::content_crc32(bytes)
}
