//! Shared helpers for the IR's integration tests: the corpus, and the in-memory ONNX model
//! builder (`onnx_builder.rs`, which the CLI tests include too).
#![allow(dead_code)]

use std::path::PathBuf;

#[path = "onnx_builder.rs"]
mod onnx_builder;
#[allow(unused_imports)]
pub use onnx_builder::*;

/// `../shared/corpus` relative to the workspace root, or a clear panic if absent.
pub fn corpus() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus");
    assert!(root.is_dir(), "the shared corpus is missing: expected it at {}", root.display());
    root
}

/// The corpus models, sorted by name.
pub fn shared_models() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(corpus().join("models"))
        .expect("models folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    v.sort();
    v
}
