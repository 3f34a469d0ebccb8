//! Trained weights out of a pipeline: `train` saves them as `BUILD/weights.safetensors`
//! ([`save_weights`]); `pipewright export BUILD -o trained.onnx` writes them back into the
//! source model's initializers ([`export_onnx`]: by name, same shape), with the weights in
//! `trained.onnx.data` beside it when the source kept them in an external data file (as
//! PyTorch's default exporter does) or they are too large for one protobuf.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use onnx_protobuf::tensor_proto::DataLocation;
use onnx_protobuf::{GraphProto, Message, ModelProto, StringStringEntryProto, TensorProto};
use protobuf::EnumOrUnknown;
use pipewright_core::fs::write_atomic;
use pipewright_core::MergedInitializer;
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
    /// The external data file written beside the model, when the source had one or the
    /// weights are too large for one protobuf.
    pub data: Option<PathBuf>,
}

impl Exported {
    /// One line on the batch axis, for people.
    pub fn batch_text(&self) -> String {
        match &self.batch {
            Rebatched::Dynamic { inputs, reshapes, expands, sliced, rewritten } => format!(
                "batch axis dynamic (dim_param \"N\"): {inputs} input(s), {reshapes} Reshape and {expands} Expand target(s), {sliced} batch-baked constant(s) and {rewritten} other node(s) rewritten"
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
    // Not while a job trains this build (its weights file may be half replaced).
    let _lock = pipewright_core::lock::FolderLock::acquire(build, "export").map_err(|e| DriverError::msg(e.to_string()))?;
    let model_path = Path::new(&manifest.model);
    let source_dir = model_path.parent().unwrap_or(Path::new("."));
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
    // The import gave back the all-zero biases the exporter dropped, first thing: the same
    // rewrite of the source names them alike here, so their trained values go in.
    if !manifest.choices.restored_biases.is_empty() {
        let restored = pipewright_ir::import::biases::restore_dropped_biases(graph);
        if restored != manifest.choices.restored_biases {
            return Err(DriverError::msg(format!("{}: the biases its exporter dropped are not those {} was compiled with; compile and train it again", model_path.display(), build.display())));
        }
    }
    // The import split BatchNorm buffers shared with weights (or other BatchNorms) into
    // copies, which trained as their own running statistics: the same split of the source
    // names them alike here.
    if pipewright_ir::import::merged::split_buffers(graph) != manifest.choices.split_buffers {
        return Err(DriverError::msg(format!("{}: its BatchNorm buffers are not those {} was compiled with; compile and train it again", model_path.display(), build.display())));
    }
    // The import gave the reads of merged parameters by weightless modules a frozen copy:
    // the same split of the source keeps them reading it.
    if pipewright_ir::import::merged::split_weightless_reads(graph, source_dir) != manifest.choices.weightless_reads {
        return Err(DriverError::msg(format!("{}: its weightless modules' reads are not those {} was compiled with; compile and train it again", model_path.display(), build.display())));
    }
    // A build compiled with --untie-merged trained one copy per use of each merged
    // initializer: the same rewrite of the source graph names those copies as the import
    // did, so each gets its trained values.
    if manifest.choices.untied {
        let untied = pipewright_ir::import::merged::untie_merged(graph, source_dir);
        // A build recorded before the weights were counted has none to compare.
        let same = |a: &MergedInitializer, b: &MergedInitializer| a.name == b.name && a.uses == b.uses && (b.weights.is_none() || a.weights == b.weights);
        if untied.len() != manifest.choices.merged.len() || !untied.iter().zip(&manifest.choices.merged).all(|(a, b)| same(a, b)) {
            return Err(DriverError::msg(format!(
                "{}: its merged initializers ({}) are not those {} was compiled with ({}); compile and train it again",
                model_path.display(),
                untied.len(),
                build.display(),
                manifest.choices.merged.len()
            )));
        }
    }
    let external_in_source: HashSet<String> = graph.initializer.iter().filter(|t| !t.external_data.is_empty()).map(|t| t.name.clone()).collect();
    let mut replaced = 0;
    for init in graph.initializer.iter_mut() {
        let Some(view) = trained.get(&init.name) else { continue };
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        // A batch-baked initializer trained as one slice (--train-batch-baked; a row
        // looked up at every position, one row) goes back as that slice repeated over the
        // export batch (and the positions), as the source holds it.
        let slice_of = |name: &str| manifest.choices.trained_batch_baked.iter().any(|t| t.rsplit_once(" [").map(|(n, _)| n) == Some(name));
        if let Some(copies) = slice_of(&init.name).then(|| leading_repeats(&dims, &init.dims)).flatten() {
            set_raw_data(init, view.data().repeat(copies));
            replaced += 1;
            continue;
        }
        if dims != init.dims {
            return Err(DriverError::msg(format!("{}: weight {:?} has shape {dims:?}, the model's initializer {:?}", weights_path.display(), init.name, init.dims)));
        }
        // An external weight comes back inline here; [`externalize`] lays out the data
        // file of the model written.
        set_raw_data(init, view.data().to_vec());
        replaced += 1;
    }
    if replaced == 0 {
        return Err(DriverError::msg(format!("{}: none of its weights names an initializer of {}", weights_path.display(), model_path.display())));
    }
    write_folded_images(graph, &manifest.choices.retied, &trained, &weights_path)?;
    // The importer's view of the same source (the batch axis and every extent): training
    // ran at any batch, so the model written takes any batch too. (Trained batch-baked
    // initializers are back at the export batch here, and the rewrite treats them as the
    // frozen ones: one slice, expanded to the batch.) Unfused: the rewrite finds the source's
    // nodes by name, those inside a fused attention included.
    let options = ImportOptions {
        untie_merged: manifest.choices.untied,
        unfused: true,
        no_restore_biases: manifest.choices.restored_biases.is_empty(),
        expanded_parameters_baked: true,
        ..ImportOptions::default()
    };
    let ir = pipewright_ir::import_bytes(&model_bytes, model_path.parent().unwrap_or(Path::new(".")), &options).map_err(|e| DriverError::msg(format!("{}: {e}", model_path.display())))?;
    let data = externalize(graph, &external_in_source, source_dir, output)?;
    let output_dir = output.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Some((path, bytes)) = &data {
        write_atomic(path, bytes)?;
    }
    let source = graph.clone();
    let mut batch = dynamic_batch(graph, &ir);
    let mut out = model.write_to_bytes().map_err(|e| DriverError::msg(format!("{}: {e}", output.display())))?;
    if let Rebatched::Dynamic { .. } = batch {
        // Batch-dependent shapes the rewrite does not reach (an Expand target computed by
        // a chain of constants, as the legacy exporter writes them) would make the model
        // fail at another batch: the importer's shape inference finds them, and the model
        // is then written with the source's fixed batch instead, saying why.
        if let Err(e) = pipewright_ir::import_bytes(&out, output_dir, &ImportOptions::default()) {
            *model.graph.as_mut().ok_or_else(|| DriverError::msg("no graph"))? = source;
            batch = Rebatched::Fixed { batch: ir.batch.as_ref().map_or(1, |b| b.resolved_size()), why: format!("with a dynamic batch, {e}") };
            out = model.write_to_bytes().map_err(|e| DriverError::msg(format!("{}: {e}", output.display())))?;
        }
    }
    write_atomic(output, &out)?;
    Ok(Exported { replaced, batch, data: data.map(|(path, _)| path) })
}

/// The import computed each permuted copy of a tied weight from that weight
/// ([`pipewright_ir::import::images`]): each goes back as its source's trained values,
/// permuted, so the model written holds the tie as the source did.
fn write_folded_images(graph: &mut GraphProto, images: &[pipewright_core::FoldedImage], trained: &HashMap<String, TensorView>, weights_path: &Path) -> Result<(), DriverError> {
    for image in images {
        let Some(view) = trained.get(&image.source) else { continue };
        let Some(init) = graph.initializer.iter_mut().find(|t| t.name == image.name) else { continue };
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let dtype = pipewright_ir::DType::from_onnx(init.data_type).ok_or_else(|| DriverError::msg(format!("{}: initializer {:?} has no element type", weights_path.display(), image.name)))?;
        let permuted = pipewright_ir::TensorData::new(dtype, dims, bytes::Bytes::copy_from_slice(view.data()))
            .and_then(|source| source.permuted(&image.perm))
            .filter(|p| p.dims == init.dims)
            .ok_or_else(|| DriverError::msg(format!("{}: weight {:?} permuted {:?} is not the shape of {:?} {:?}; compile and train again", weights_path.display(), image.source, image.perm, image.name, init.dims)))?;
        set_raw_data(init, permuted.bytes.to_vec());
    }
    Ok(())
}

/// How many copies of a tensor of `slice` extents fill one of `full` extents when `slice`
/// is `full` with some leading axes (the batch first) shrunk to one; `None` otherwise.
fn leading_repeats(slice: &[i64], full: &[i64]) -> Option<usize> {
    if slice.len() != full.len() {
        return None;
    }
    let shrunk = slice.iter().take_while(|&&d| d == 1).count();
    let k = (1..=shrunk).find(|&k| slice[k..] == full[k..])?;
    usize::try_from(full[..k].iter().product::<i64>()).ok()
}

/// Makes `init` hold `bytes` inline as its raw data, and nothing else.
fn set_raw_data(init: &mut TensorProto, bytes: Vec<u8>) {
    init.external_data.clear();
    init.data_location = EnumOrUnknown::new(DataLocation::DEFAULT);
    init.raw_data = bytes;
    init.float_data.clear();
    init.double_data.clear();
    init.int32_data.clear();
    init.int64_data.clear();
}

/// Protobuf cannot hold a model of 2 GiB or more: past this many initializer bytes the
/// written model keeps its weights in an external data file.
const INLINE_LIMIT: usize = (1 << 31) - (64 << 20);
/// Initializers smaller than this stay inline in a model written with a data file.
const EXTERNAL_FROM: usize = 1024;

/// When the source kept weights in an external data file, or the weights are too large
/// for one protobuf, lays out `OUTPUT.data` beside `output` and points the initializers at
/// it: every initializer that was external in the source (`external_in_source`, trained
/// ones included), and every one of at least [`EXTERNAL_FROM`] bytes when the size
/// demands it. Returns the data file and its bytes (`None`: the model stays whole). The
/// values of external initializers that were not trained are read from the source's data
/// files (relative to `source_dir`).
fn externalize(graph: &mut GraphProto, external_in_source: &HashSet<String>, source_dir: &Path, output: &Path) -> Result<Option<(PathBuf, Vec<u8>)>, DriverError> {
    let external = |t: &TensorProto| !t.external_data.is_empty();
    let inline_bytes: usize = graph.initializer.iter().map(|t| t.raw_data.len()).sum();
    let too_large = inline_bytes >= INLINE_LIMIT;
    if !too_large && external_in_source.is_empty() {
        return Ok(None);
    }
    let name = format!("{}.data", output.file_name().map_or("model.onnx".into(), |n| n.to_string_lossy().into_owned()));
    let path = output.with_file_name(&name);
    let mut data: Vec<u8> = Vec::new();
    for t in graph.initializer.iter_mut() {
        let moved = external_in_source.contains(&t.name) || (too_large && t.raw_data.len() >= EXTERNAL_FROM);
        let values = match (external(t), moved) {
            (true, _) => pipewright_ir::import::tensor::tensor_from_proto(t.clone(), source_dir)
                .map_err(|e| DriverError::msg(format!("{}: initializer {:?}: {e}", source_dir.display(), t.name)))?
                .bytes
                .to_vec(),
            (false, true) => std::mem::take(&mut t.raw_data),
            (false, false) => continue,
        };
        let entry = |key: &str, value: String| StringStringEntryProto { key: key.into(), value, ..Default::default() };
        t.external_data = vec![entry("location", name.clone()), entry("offset", data.len().to_string()), entry("length", values.len().to_string())];
        t.data_location = EnumOrUnknown::new(DataLocation::EXTERNAL);
        t.raw_data.clear();
        t.float_data.clear();
        t.double_data.clear();
        t.int32_data.clear();
        t.int64_data.clear();
        data.extend_from_slice(&values);
    }
    Ok(Some((path, data)))
}

fn crc32(bytes: &[u8]) -> u32 {
    pipewright_ir::content_crc32(bytes)
}

#[cfg(test)]
mod tests {
    /// A class token's slice repeats over the batch; a row looked up at every position
    /// over the batch and the positions; a slice of other extents is no such copy.
    #[test]
    fn trained_slices_fill_the_baked_extents() {
        assert_eq!(leading_repeats(&[1, 1, 16], &[2, 1, 16]), Some(2));
        assert_eq!(leading_repeats(&[1, 1, 16], &[2, 8, 16]), Some(16));
        assert_eq!(leading_repeats(&[1, 8, 16], &[2, 8, 16]), Some(2));
        assert_eq!(leading_repeats(&[2, 8, 16], &[2, 8, 16]), None);
        assert_eq!(leading_repeats(&[1, 4, 16], &[2, 8, 16]), None);
        assert_eq!(leading_repeats(&[1, 16], &[2, 8, 16]), None);
    }

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

    /// The bytes an external initializer names, read from its data file beside `model`.
    fn external_bytes(model: &Path, t: &TensorProto) -> Vec<u8> {
        let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.clone()).unwrap();
        let data = std::fs::read(model.with_file_name(get("location"))).unwrap();
        let (offset, length): (usize, usize) = (get("offset").parse().unwrap(), get("length").parse().unwrap());
        data[offset..offset + length].to_vec()
    }

    /// A model whose weights live in an external data file (as PyTorch's default exporter
    /// writes them) exports with its weights in `OUTPUT.data`: the trained ones with their
    /// new values, the others as the source has them; the model written imports again.
    #[test]
    fn external_data_models_export_to_a_data_file() {
        use pipewright_core::Storage;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("gpt.onnx");
        let shape = pipewright_synth::GptShape { layers: 1, ..pipewright_synth::GptShape::TINY };
        pipewright_synth::gpt(&shape).unwrap().write(&src, Storage::External, 5).unwrap();
        let build = dir.path().join("build");
        let mut req = request("mlp.onnx", stages(2), &build);
        req.model = src.clone();
        compile(&req).unwrap();
        let source = ModelProto::parse_from_bytes(&std::fs::read(&src).unwrap()).unwrap();
        let externals: Vec<&TensorProto> = source.graph.initializer.iter().filter(|t| !t.external_data.is_empty()).collect();
        assert!(externals.len() >= 2, "the synthesized model keeps its weights outside");
        let (trained, kept) = (externals[0], externals[1]);
        let dims: Vec<usize> = trained.dims.iter().map(|&d| d as usize).collect();
        weights(&build.join(WEIGHTS_FILE), &trained.name, &dims, 0.5);
        let out = dir.path().join("out").join("trained.onnx");
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let exported = export_onnx(&build, &out).unwrap();
        assert_eq!(exported.data.as_deref(), Some(out.with_file_name("trained.onnx.data").as_path()));
        let model = ModelProto::parse_from_bytes(&std::fs::read(&out).unwrap()).unwrap();
        let find = |name: &str| model.graph.initializer.iter().find(|t| t.name == name).unwrap().clone();
        let (t, k) = (find(&trained.name), find(&kept.name));
        assert!(t.external_data.iter().any(|e| e.key == "location" && e.value == "trained.onnx.data"), "{:?}", t.external_data);
        assert_eq!(external_bytes(&out, &t), std::iter::repeat_n(0.5f32.to_le_bytes(), dims.iter().product()).flatten().collect::<Vec<u8>>());
        assert_eq!(external_bytes(&out, &k), external_bytes(&src, kept));
        pipewright_ir::import_model(&out, &ImportOptions::default()).expect("the exported model imports");
    }
}
