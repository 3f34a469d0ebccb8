//! Helpers shared by the passes' integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use pipewright_ir::{import_model, Graph, ImportOptions, StageMap};

/// The path of a shared corpus model; panics when the corpus is missing.
pub fn model_path(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models").join(name);
    assert!(p.is_file(), "the shared corpus is missing: expected {}", p.display());
    p
}

/// A shared corpus model, imported.
pub fn model(name: &str) -> Graph {
    import_model(&model_path(name), &ImportOptions::default()).expect("shared model imports")
}

/// Splits the topological order into `d` chunks of equal node count.
pub fn contiguous(g: &Graph, d: u32) -> StageMap {
    let order = g.topo_order().expect("acyclic");
    let mut m = StageMap::new(d);
    for (i, n) in order.iter().enumerate() {
        m.set(*n, (i * d as usize / order.len()) as u32);
    }
    m
}
