//! Imports every `model.onnx` of the ONNX backend suite and reports how many import
//! and why the others do not (`target/backend-import.txt`). No model may crash the
//! importer: every one either imports (and verifies, and its text form parses back to the
//! same text) or is refused with an error that is not a shape-inference failure.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use pipewright_ir::{import_model, ImportError, ImportOptions};

fn backend_models() -> Vec<(String, PathBuf)> {
    let root = common::corpus().join("onnx-backend");
    let mut out = Vec::new();
    for suite in ["node", "pytorch-converted", "pytorch-operator", "simple", "light"] {
        let dir = root.join(suite);
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir).expect("suite folder").map(|e| e.expect("entry").path()).collect();
        entries.sort();
        for e in entries {
            let model = if e.is_dir() { e.join("model.onnx") } else { e.clone() };
            if model.extension().is_some_and(|x| x == "onnx") && model.is_file() {
                out.push((format!("{suite}/{}", e.file_name().unwrap().to_string_lossy()), model));
            }
        }
    }
    out
}

/// A short class for a failure, to count them.
fn class(e: &ImportError) -> String {
    match e {
        ImportError::UnknownOps(ops) => format!("unknown op {}", ops.iter().map(|o| o.0.as_str()).collect::<Vec<_>>().join("+")),
        ImportError::OpVersion { op, version, .. } => format!("{op} v{version} not implemented"),
        ImportError::ValueType { type_name, .. } => format!("type {type_name}"),
        ImportError::BadTensor { reason, .. } if reason.contains("element type") => "tensor element type".into(),
        ImportError::BadTensor { .. } => "bad or dynamic input".into(),
        ImportError::BadNode { node, reason } => format!("{}: {}", node.op_type, reason.split(':').next().unwrap_or("")),
        // A shape that depends on data fed at run time is a limit of a static-shape compiler.
        ImportError::Shape { node, reason } if reason.contains("not known at import") => format!("data-dependent shape {}", node.op_type),
        ImportError::Shape { node, .. } => format!("shape inference {}", node.op_type),
        other => format!("{}", other).chars().take(60).collect(),
    }
}

/// Freezes the integer inputs of a test (axes, shapes, pads fed as inputs) to the
/// values of its first data set, as a compiler for static shapes must.
fn options_for(model: &std::path::Path) -> ImportOptions {
    let mut opts = ImportOptions::default();
    let data = model.with_file_name("test_data_set_0");
    let Ok(entries) = std::fs::read_dir(&data) else { return opts };
    let inputs: Vec<(String, pipewright_ir::TensorData)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("input_")))
        .filter_map(|p| pipewright_ir::read_tensor_file(&p).ok())
        .collect();
    opts.freeze_shape_inputs(inputs.iter().map(|(n, t)| (n.as_str(), t)));
    opts
}

#[test]
fn backend_suite_imports() {
    let models = backend_models();
    assert!(models.len() > 1900, "found only {} backend models", models.len());
    let mut ok = 0;
    let mut failed: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut report = String::new();
    let mut panicked = Vec::new();
    for (name, path) in &models {
        let mut opts = options_for(path);
        let Ok(mut result) = std::panic::catch_unwind(|| import_model(path, &opts)) else {
            panicked.push(name.clone());
            continue;
        };
        // Sequence-major inputs are refused under the automatic batch (the batch would land
        // on the sequence axis); the suite's models import at their fixed shapes.
        if matches!(&result, Err(e) if e.error.is_sequence_major()) {
            opts.batch = pipewright_ir::BatchMode::Fixed;
            result = import_model(path, &opts);
        }
        match result {
            Ok(g) => {
                pipewright_ir::verify(&g).unwrap_or_else(|e| panic!("{name}: imported graph fails verification: {e:?}"));
                let text = pipewright_ir::text::print_graph(&g);
                let back = pipewright_ir::parse_graph(&text).unwrap_or_else(|e| panic!("{name}: the text form does not parse back: {e}"));
                assert_eq!(pipewright_ir::text::print_graph(&back), text, "{name}: the text form does not round-trip");
                ok += 1;
            }
            Err(e) => {
                report.push_str(&format!("{name}: {}\n", e.error));
                failed.entry(class(&e.error)).or_default().push(name.clone());
            }
        }
    }
    let mut summary = format!("imported {ok} of {} backend models; {} failed\n", models.len(), models.len() - ok);
    let mut classes: Vec<_> = failed.iter().collect();
    classes.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    for (c, v) in &classes {
        summary.push_str(&format!("  {:>4}  {c}\n", v.len()));
    }
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/backend-import.txt");
    std::fs::write(&out, format!("{summary}\n{report}")).expect("write report");
    println!("{summary}");
    // Failures must come from unsupported features, never from a panic or a shape-inference
    // bug on an op the importer claims to support.
    assert!(panicked.is_empty(), "the importer panicked on {} models: {panicked:?}", panicked.len());
    let crashes: Vec<(&String, &Vec<String>)> = failed.iter().filter(|(c, _)| c.starts_with("shape inference")).collect();
    assert!(crashes.is_empty(), "shape inference failed on supported ops: {crashes:?}");
    assert!(ok >= 1000, "only {ok} backend models imported");
}
