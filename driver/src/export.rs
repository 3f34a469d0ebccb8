//! Trained weights out of a pipeline: `train` saves them as `BUILD/weights.safetensors`
//! ([`save_weights`]); `pipewright export BUILD -o trained.onnx` writes them back into the
//! source model's initializers ([`export_onnx`]: by name, same shape).

use std::collections::HashMap;
use std::path::Path;

use onnx_protobuf::{Message, ModelProto};
use pipewright_core::fs::write_atomic;
use pipewright_ir::ImportOptions;
use pipewright_runtime::build::Manifest;
use safetensors::tensor::TensorView;

use crate::rebatch::{dynamic_batch, Rebatched};
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
    let mut raw: Vec<(String, pipewright_ops::DType, Vec<usize>, Vec<u8>)> = Vec::new();
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

/// What [`export_onnx`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// Initializers given their trained values.
    pub replaced: usize,
    /// The batch axis of the written model.
    pub batch: Rebatched,
}

impl Exported {
    /// One line on the batch axis, for people.
    pub fn batch_text(&self) -> String {
        match &self.batch {
            Rebatched::Dynamic { inputs, reshapes, expands, sliced } => format!(
                "batch axis dynamic (dim_param \"N\"): {inputs} input(s), {reshapes} Reshape and {expands} Expand target(s), {sliced} batch-baked constant(s) rewritten"
            ),
            Rebatched::NoBatch => "no batch axis found; shapes kept as in the source".into(),
            Rebatched::Fixed { batch, why } => format!("kept the export batch {batch}: {why}"),
        }
    }
}

/// Writes the source model of the build `build` to `output` with the trained weights of
/// `BUILD/weights.safetensors` in its initializers, taking any batch where the source
/// took a batch the importer made symbolic ([`crate::rebatch`]).
pub fn export_onnx(build: &Path, output: &Path) -> Result<Exported, DriverError> {
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
    // A build compiled with --untie-merged trained one copy per use of each merged
    // initializer: the same rewrite of the source graph names those copies as the import
    // did, so each gets its trained values.
    if manifest.choices.untied {
        let untied = pipewright_ir::import::merged::untie_merged(graph);
        if untied != manifest.choices.merged {
            return Err(DriverError::msg(format!(
                "{}: its merged initializers ({}) are not those {} was compiled with ({}); compile and train it again",
                model_path.display(),
                untied.len(),
                build.display(),
                manifest.choices.merged.len()
            )));
        }
    }
    let mut replaced = 0;
    for init in graph.initializer.iter_mut() {
        let Some(view) = trained.get(&init.name) else { continue };
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        // A batch-baked initializer trained as one slice (--train-batch-baked) goes back
        // as that slice repeated over the export batch, as the source holds it.
        let slice_of = |name: &str| manifest.choices.trained_batch_baked.iter().any(|t| t.rsplit_once(" [").map(|(n, _)| n) == Some(name));
        if slice_of(&init.name) && dims.first() == Some(&1) && dims.len() == init.dims.len() && dims[1..] == init.dims[1..] && init.external_data.is_empty() {
            init.raw_data = view.data().repeat(usize::try_from(init.dims[0]).unwrap_or(1));
            init.float_data.clear();
            init.double_data.clear();
            init.int32_data.clear();
            init.int64_data.clear();
            replaced += 1;
            continue;
        }
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
    // The importer's view of the same source (the batch axis and every extent): training
    // ran at any batch, so the model written takes any batch too. (Trained batch-baked
    // initializers are back at the export batch here, and the rewrite treats them as the
    // frozen ones: one slice, expanded to the batch.)
    let options = ImportOptions { untie_merged: manifest.choices.untied, ..ImportOptions::default() };
    let ir = pipewright_ir::import_bytes(&model_bytes, model_path.parent().unwrap_or(Path::new(".")), &options).map_err(|e| DriverError::msg(format!("{}: {e}", model_path.display())))?;
    let source = graph.clone();
    let mut batch = dynamic_batch(graph, &ir);
    let mut out = model.write_to_bytes().map_err(|e| DriverError::msg(format!("{}: {e}", output.display())))?;
    if let Rebatched::Dynamic { .. } = batch {
        // Batch-dependent shapes the rewrite does not reach (an Expand target computed by
        // a chain of constants, as the legacy exporter writes them) would make the model
        // fail at another batch: the importer's shape inference finds them, and the model
        // is then written with the source's fixed batch instead, saying why.
        if let Err(e) = pipewright_ir::import_bytes(&out, model_path.parent().unwrap_or(Path::new(".")), &ImportOptions::default()) {
            *model.graph.as_mut().ok_or_else(|| DriverError::msg("no graph"))? = source;
            batch = Rebatched::Fixed { batch: ir.batch.as_ref().map_or(1, |b| b.export_size), why: format!("with a dynamic batch, {e}") };
            out = model.write_to_bytes().map_err(|e| DriverError::msg(format!("{}: {e}", output.display())))?;
        }
    }
    write_atomic(output, &out)?;
    Ok(Exported { replaced, batch })
}

fn crc32(bytes: &[u8]) -> u32 {
    pipewright_ir::content_crc32(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile;
    use crate::compile::tests::{request, stages};

    /// A weights file with one trained tensor, as `train` would write it.
    fn weights(path: &Path, name: &str, dims: &[usize], value: f32) {
        let bytes: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), dims.iter().product()).flatten().collect();
        let view = TensorView::new(safetensors::Dtype::F32, dims.to_vec(), &bytes).unwrap();
        std::fs::write(path, safetensors::serialize(vec![(name.to_string(), view)], &None).unwrap()).unwrap();
    }

    #[test]
    fn writes_trained_weights_into_the_source_model() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        compile(&request("mlp.onnx", stages(2), &build)).unwrap();
        let out = dir.path().join("trained.onnx");
        let e = export_onnx(&build, &out).unwrap_err().to_string();
        assert!(e.contains("weights.safetensors") && e.contains("train the pipeline first"), "{e}");
        weights(&build.join(WEIGHTS_FILE), "6.bias", &[10], 0.25);
        let exported = export_onnx(&build, &out).unwrap();
        assert_eq!(exported.replaced, 1);
        // The MLP was exported at batch 8; the model written takes any batch.
        assert!(matches!(exported.batch, Rebatched::Dynamic { inputs: 1, .. }), "{exported:?}");
        let model = ModelProto::parse_from_bytes(&std::fs::read(&out).unwrap()).unwrap();
        let bias = model.graph.initializer.iter().find(|t| t.name == "6.bias").unwrap();
        assert_eq!(bias.raw_data, std::iter::repeat_n(0.25f32.to_le_bytes(), 10).flatten().collect::<Vec<u8>>());
        // A weight of another shape is refused, and the output is not replaced.
        weights(&build.join(WEIGHTS_FILE), "6.bias", &[11], 0.5);
        let e = export_onnx(&build, &out).unwrap_err().to_string();
        assert!(e.contains("\"6.bias\" has shape [11]"), "{e}");
        let again = ModelProto::parse_from_bytes(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(again.graph.initializer.iter().find(|t| t.name == "6.bias").unwrap().raw_data, bias.raw_data);
    }
}
