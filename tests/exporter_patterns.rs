//! Patterns of today's exporters, end to end through the CLI (compile, train under every
//! schedule, export, import of the exported model): PyTorch's default exporter merges
//! identical initializers (one tensor of ones is every BatchNorm's scale and running
//! variance) and keeps every weight in an external data file beside the model.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;

use common::{node, pw, pw_ok, tensor_external, tensor_f32, Ax, ModelBuilder, NodeExt, F32};

const C: usize = 4;

/// Conv → BatchNorm → Relu → Conv → BatchNorm → pool → Gemm, both BatchNorms reading one
/// `ones` (scale and running variance) and one `zeros` (bias and running mean), as a
/// default-exporter DenseNet does; with `external`, every initializer's values live in
/// `model.onnx.data`.
fn shared_batchnorm_model(dir: &Path, external: bool) -> std::path::PathBuf {
    let weights: Vec<(&str, Vec<i64>, Vec<f32>)> = vec![
        ("ones", vec![C as i64], vec![1.0; C]),
        ("zeros", vec![C as i64], vec![0.0; C]),
        ("w1", vec![C as i64, 3, 3, 3], (0..C * 27).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.03).collect()),
        ("w2", vec![C as i64, C as i64, 3, 3], (0..C * C * 9).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.03).collect()),
        ("fc", vec![10, C as i64], (0..10 * C).map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.1).collect()),
    ];
    let mut m = ModelBuilder::new(17).input("x", F32, &[Ax::Fixed(2), Ax::Fixed(3), Ax::Fixed(8), Ax::Fixed(8)]);
    let mut data = Vec::new();
    for (name, dims, values) in &weights {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        m = m.init(if external {
            let t = tensor_external(name, dims, "model.onnx.data", Some(data.len() as u64), Some(bytes.len() as u64));
            data.extend_from_slice(&bytes);
            t
        } else {
            tensor_f32(name, dims, values)
        });
    }
    let m = m
        .node(node("Conv", "conv1", &["x", "w1"], &["c1"]).ints("pads", &[1, 1, 1, 1]))
        .node(node("BatchNormalization", "bn1", &["c1", "ones", "zeros", "zeros", "ones"], &["b1"]))
        .node(node("Relu", "relu1", &["b1"], &["r1"]))
        .node(node("Conv", "conv2", &["r1", "w2"], &["c2"]).ints("pads", &[1, 1, 1, 1]))
        .node(node("BatchNormalization", "bn2", &["c2", "ones", "zeros", "zeros", "ones"], &["b2"]))
        .node(node("Relu", "relu2", &["b2"], &["r2"]))
        .node(node("GlobalAveragePool", "gap", &["r2"], &["g"]))
        .node(node("Flatten", "flat", &["g"], &["f"]))
        .node(node("Gemm", "fc", &["f", "fc"], &["y"]).int("transB", 1))
        .output("y");
    if external {
        std::fs::write(dir.join("model.onnx.data"), &data).unwrap();
    }
    m.write(dir, "model.onnx")
}

/// Compiles, trains 2 steps at a microbatch other than the export batch, exports and
/// imports the result; returns what compile said (its notes).
fn round_trip(model: &Path, dir: &Path, schedule: &str) -> String {
    let build = dir.join(format!("build-{schedule}"));
    let out = pw(["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", schedule, "-o", build.to_str().unwrap()]);
    assert!(out.status.success(), "compile: {}", String::from_utf8_lossy(&out.stderr));
    pw_ok(["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--no-progress"]);
    let exported = dir.join(format!("trained-{schedule}.onnx"));
    let said = pw_ok(["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    assert!(said.contains("trained initializers"), "{said}");
    pw_ok(["inspect", exported.to_str().unwrap()]);
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// BatchNorm running statistics merged with the weights train under every schedule: the
/// statistics get copies of their own (and say so at compile), the weights train.
#[test]
fn batchnorm_buffers_merged_with_weights_train_under_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared_batchnorm_model(dir.path(), false);
    for schedule in ["2bw", "flush", "gpipe", "zb-h1"] {
        let notes = round_trip(&model, dir.path(), schedule);
        assert!(notes.contains("note: 2 initializers the exporter shared between BatchNorm running statistics and weights (or other BatchNorms) got a copy per running statistic"), "{notes}");
    }
}

/// The same model with its weights in `model.onnx.data`: merged initializers are noted as
/// for an inline model, and export writes `trained.onnx.data` beside the model.
#[test]
fn external_data_models_note_merges_and_export_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared_batchnorm_model(dir.path(), true);
    let notes = round_trip(&model, dir.path(), "2bw");
    assert!(notes.contains("initializers the exporter merged (identical values) train as tied weights"), "{notes}");
    assert!(dir.path().join("trained-2bw.onnx.data").is_file(), "the exported weights' data file");
}
