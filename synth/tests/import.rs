//! Generated models import into the IR with the shapes they promise, and both weight
//! storages hold the same numbers.

use std::collections::BTreeMap;
use std::path::Path;

use pipewright_ir::{import_model, Graph, ImportOptions};
use pipewright_synth::{gpt, layered, GptShape, LayeredShape};
use pipewright_core::Storage;

fn import(path: &Path) -> Graph {
    import_model(path, &Default::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// Weight name -> bytes.
fn weights(g: &Graph) -> BTreeMap<String, Vec<u8>> {
    g.value_ids()
        .filter_map(|v| {
            let value = g.value(v);
            value.weight().filter(|w| w.trainable).map(|w| (value.name.clone(), w.data.bytes.to_vec()))
        })
        .collect()
}

#[test]
fn a_tiny_gpt_imports_with_its_promised_shapes_and_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let model = gpt(&GptShape::TINY).unwrap();
    let written = model.write(&dir.path().join("gpt.onnx"), Storage::Inline, 1).unwrap();
    assert!(written.data.is_none());
    let g = import(&written.model);
    assert_eq!(g.parameter_count(), written.parameters);
    // Every node written is read (the import fuses each layer's attention into one node).
    let unfused = import_model(&written.model, &ImportOptions { unfused: true, ..ImportOptions::default() }).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(unfused.node_count(), written.nodes);
    let fused = g.node_ids().filter(|&n| g.node(n).op.name() == "Attention").count();
    assert_eq!(fused, GptShape::TINY.layers as usize);
    let output = g.value(g.outputs()[0]);
    assert_eq!(output.name, "logits");
    assert_eq!(output.ty.to_string(), "f32[N,16,100]");
    let input = g.value(g.inputs()[0]);
    assert_eq!(input.ty.to_string(), "i64[N,16]");
}

#[test]
fn inline_and_external_storage_hold_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = gpt(&GptShape { tied: false, ..GptShape::TINY }).unwrap();
    let inline = model.write(&dir.path().join("inline.onnx"), Storage::Inline, 7).unwrap();
    let external = model.write(&dir.path().join("external.onnx"), Storage::External, 7).unwrap();
    let data = external.data.clone().expect("a data file");
    assert_eq!(data, dir.path().join("external.onnx.data"));
    assert_eq!(std::fs::metadata(&data).unwrap().len(), 4 * model.parameters());
    assert!(std::fs::metadata(&external.model).unwrap().len() < 100_000, "the model file keeps no weights");
    let (a, b) = (weights(&import(&inline.model)), weights(&import(&external.model)));
    assert_eq!(a.len(), b.len());
    assert_eq!(a, b);
    let other_seed = model.write(&dir.path().join("seed8.onnx"), Storage::Inline, 8).unwrap();
    assert_ne!(weights(&import(&other_seed.model))["h.0.attn.c_attn.weight"], a["h.0.attn.c_attn.weight"]);
}

#[test]
fn a_layered_graph_imports_with_its_long_skips() {
    let dir = tempfile::tempdir().unwrap();
    let shape = LayeredShape { layers: 300, width: 8, long_skip_every: 10, long_skip_span: 100 };
    let written = layered(&shape).unwrap().write(&dir.path().join("layered.onnx"), Storage::Inline, 1).unwrap();
    let g = import(&written.model);
    assert_eq!(g.node_count(), written.nodes);
    assert_eq!(g.node_count(), 3 * 300 + 20 + 1, "3 nodes a layer, 20 long skips, the output");
    assert_eq!(g.value(g.outputs()[0]).ty.to_string(), "f32[N,8]");
}

#[test]
fn a_failed_write_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-folder").join("gpt.onnx");
    let err = gpt(&GptShape::TINY).unwrap().write(&missing, Storage::External, 1).unwrap_err();
    assert!(err.to_string().contains("no-such-folder"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
