//! The six shared models: import, verify, fully inferred shapes with the batch symbol on
//! the inputs and outputs, and insta snapshots of the summary and the text IR.
//!
//! Update the snapshots with `INSTA_UPDATE=always cargo test -p pipewright-ir --test snapshots`
//! (or `cargo insta review`) and read the diff before committing it.

mod common;

use std::path::Path;

use pipewright_ir::summary::Summary;
use pipewright_ir::{import_model, text, verify, Dim, Graph, ImportOptions};

fn import(path: &Path) -> Graph {
    import_model(path, &ImportOptions::default()).unwrap_or_else(|e| panic!("{}: import failed: {e}", path.display()))
}

fn stem(path: &Path) -> String {
    path.file_stem().expect("file name").to_string_lossy().replace('-', "_")
}

#[test]
fn there_are_six_shared_models() {
    let names: Vec<String> = common::shared_models().iter().map(|p| stem(p)).collect();
    assert_eq!(names, ["bert_tiny", "gpt2_tiny", "mlp", "mobilenet_v2", "resnet18", "vit_tiny"]);
}

#[test]
fn shared_models_import_verify_and_keep_the_batch_symbol() {
    for path in common::shared_models() {
        let name = path.display();
        let g = import(&path);
        verify(&g).unwrap_or_else(|e| panic!("{name}: verification failed: {e:?}"));
        assert!(g.batch.is_some(), "{name}: no batch symbol detected");
        assert!(g.node_count() > 0, "{name}: no nodes");
        for v in g.value_ids() {
            let val = g.value(v);
            for d in val.ty.shape.dims() {
                let ok = match *d {
                    Dim::Fixed(x) => x >= 0,
                    Dim::Batch(k) => k >= 1,
                };
                assert!(ok, "{name}: value {v} {:?} has an uninferred or invalid extent: {}", val.name, val.ty);
            }
        }
        assert!(!g.inputs().is_empty(), "{name}: no graph inputs");
        for &v in g.inputs() {
            let ty = &g.value(v).ty;
            assert_eq!(ty.shape.dims().first(), Some(&Dim::N), "{name}: input {:?} is {ty}, not [N,...]", g.value(v).name);
            assert!(ty.shape.dims()[1..].iter().all(|d| d.fixed().is_some()), "{name}: input {ty} has N off axis 0");
        }
        assert!(!g.outputs().is_empty(), "{name}: no graph outputs");
        for &v in g.outputs() {
            let ty = &g.value(v).ty;
            assert_eq!(ty.shape.dims().first(), Some(&Dim::N), "{name}: output {:?} is {ty}, not [N,...]", g.value(v).name);
        }
        // No trainable parameter may depend on the batch.
        for v in g.value_ids() {
            if let Some(w) = g.value(v).weight() {
                assert!(!g.value(v).ty.shape.has_batch(), "{name}: weight {:?} has a batch extent", g.value(v).name);
                assert_eq!(w.data.dims, g.value(v).ty.shape.eval(1), "{name}: weight {:?} type and data differ", g.value(v).name);
            }
        }
    }
}

#[test]
fn shared_model_summaries() {
    for path in common::shared_models() {
        let g = import(&path);
        insta::assert_snapshot!(format!("{}_summary", stem(&path)), Summary::of(&g).text());
    }
}

#[test]
fn shared_model_text_ir() {
    for path in common::shared_models() {
        let g = import(&path);
        insta::assert_snapshot!(format!("{}_ir", stem(&path)), text::print_graph(&g));
    }
}

#[test]
fn import_is_deterministic() {
    for path in common::shared_models() {
        let (a, b) = (import(&path), import(&path));
        assert_eq!(text::print_graph(&a), text::print_graph(&b), "{}", path.display());
        assert_eq!(Summary::of(&a).text(), Summary::of(&b).text(), "{}", path.display());
    }
}

/// The text form reads back: every shared model printed, parsed, verified and printed
/// again gives the same text (weights come back as zeros, which the text never shows).
#[test]
fn the_text_form_parses_back_to_the_same_text() {
    for path in common::shared_models() {
        let text = text::print_graph(&import(&path));
        let back = pipewright_ir::parse_graph(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        verify(&back).unwrap_or_else(|e| panic!("{}: the parsed graph does not verify: {e:?}", path.display()));
        assert_eq!(text::print_graph(&back), text, "{}", path.display());
    }
}
