//! Import + shape inference time on the shared models (criterion).
//!
//! `cargo bench -p pipewright-ir --bench import`. Reads `../shared/corpus/models`; the
//! file is read once outside the timed loop, so the figure is parsing, conversion, shape
//! inference, folding and verification, not disk I/O.

use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, Criterion};
use pipewright_ir::{import_bytes, ImportOptions};

fn model(name: &str) -> (Vec<u8>, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models");
    let path = dir.join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (the shared corpus is needed)", path.display()));
    (bytes, dir)
}

fn bench_import(c: &mut Criterion) {
    let mut group = c.benchmark_group("import");
    group.sample_size(20);
    for name in ["resnet18.onnx", "gpt2-tiny.onnx"] {
        let (bytes, dir) = model(name);
        group.bench_function(name, |b| {
            b.iter(|| import_bytes(&bytes, Path::new(&dir), &ImportOptions::default()).expect("imports"))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_import);
criterion_main!(benches);
