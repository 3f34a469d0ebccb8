//! The crate rules of docs/architecture.md, checked on the sources: the runtime (what a
//! stage binary carries) depends on neither the importer nor the passes, the op vocabulary
//! depends on no other pipewright crate but none at all, and the CLI calls the driver and
//! core's words only.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The pipewright crates a crate's Cargo.toml depends on (its `[dependencies]`).
fn pipewright_dependencies(krate: &str) -> Vec<String> {
    let text = std::fs::read_to_string(workspace().join(krate).join("Cargo.toml")).expect("the crate's Cargo.toml");
    let table: toml::Table = text.parse().expect("Cargo.toml is TOML");
    let deps = table.get("dependencies").and_then(|d| d.as_table()).cloned().unwrap_or_default();
    deps.keys().filter(|k| k.starts_with("pipewright-")).cloned().collect()
}

/// Every `pipewright_*` crate a folder's `.rs` files name, with the first file naming it.
fn crates_named_in(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).expect("the folder").flatten() {
        let path = entry.path();
        if path.extension().map_or(true, |e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a source file");
        for (i, _) in text.match_indices("pipewright_") {
            let name: String = text[i..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !found.iter().any(|(n, _)| *n == name) {
                found.push((name, path.clone()));
            }
        }
    }
    found
}

#[test]
fn the_runtime_carries_no_importer_and_no_passes() {
    let deps = pipewright_dependencies("runtime");
    for forbidden in ["pipewright-ir", "pipewright-passes", "pipewright-codegen", "pipewright-driver"] {
        assert!(!deps.iter().any(|d| d == forbidden), "runtime/Cargo.toml depends on {forbidden}: {deps:?}");
    }
    assert!(deps.iter().any(|d| d == "pipewright-ops"), "the runtime executes pipewright-ops's ops: {deps:?}");
}

#[test]
fn the_op_vocabulary_stands_alone() {
    assert_eq!(pipewright_dependencies("ops"), Vec::<String>::new());
    assert_eq!(pipewright_dependencies("core"), Vec::<String>::new());
}

#[test]
fn the_cli_calls_the_driver_and_core_only() {
    let named = crates_named_in(&workspace().join("src"));
    let others: Vec<&(String, PathBuf)> = named.iter().filter(|(n, _)| n != "pipewright_driver" && n != "pipewright_core").collect();
    assert!(others.is_empty(), "src/ uses more than the driver and core: {others:?}");
    let root = pipewright_dependencies(".");
    let mut expected = vec!["pipewright-core".to_string(), "pipewright-driver".to_string()];
    expected.sort();
    let mut root_sorted = root.clone();
    root_sorted.sort();
    assert_eq!(root_sorted, expected, "the CLI's [dependencies]");
}
