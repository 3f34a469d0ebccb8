//! The conformance runner: every ONNX backend-suite test whose ops import is run through
//! the runtime's op layer and compared with the suite's expected outputs (rtol 1e-3,
//! atol 1e-7, as ONNX's own runner). Tests that do not import are skipped with the reason.
//! Cases run in parallel (rayon), each on one intra-op thread; the report keeps suite order.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use pipewright_ir::{BatchMode, ImportError, ImportOptions};
use rayon::prelude::{IntoParallelRefIterator, ParallelIterator};

use crate::forward::{compare, read_tensors, NamedTensor, Runner};
use crate::DriverError;

const RTOL: f64 = 1e-3;
const ATOL: f64 = 1e-7;

/// The outcome of one test.
#[derive(Clone, Debug)]
pub enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

/// One backend test: a model and its data sets.
struct Case {
    suite: String,
    name: String,
    model: PathBuf,
    /// Folders holding `input_K.pb`/`output_K.pb`; for `light/` the model's own folder
    /// with a file prefix.
    data: Vec<(PathBuf, String)>,
}

fn cases(root: &Path) -> Result<Vec<Case>, DriverError> {
    let list = |dir: &Path| std::fs::read_dir(dir).map_err(|source| DriverError::Read { path: dir.to_path_buf(), source });
    let suite = root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = list(root)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for e in entries {
        let name = e.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if e.is_dir() && e.join("model.onnx").is_file() {
            let mut data: Vec<(PathBuf, String)> = list(&e)?
                .filter_map(|d| d.ok().map(|d| d.path()))
                .filter(|d| d.is_dir() && d.file_name().is_some_and(|n| n.to_string_lossy().starts_with("test_data_set")))
                .map(|d| (d, String::new()))
                .collect();
            data.sort();
            out.push(Case { suite: suite.clone(), name, model: e.join("model.onnx"), data });
        } else if name.ends_with(".onnx") {
            let stem = name.trim_end_matches(".onnx").to_string();
            out.push(Case { suite: suite.clone(), name: stem.clone(), model: e.clone(), data: vec![(root.to_path_buf(), format!("{stem}_"))] });
        }
    }
    Ok(out)
}

/// Integer inputs (axes, shapes, pads) and scalars become constants, as a compiler for
/// static shapes needs them.
fn frozen(inputs: &[NamedTensor]) -> ImportOptions {
    let mut opts = ImportOptions::default();
    opts.freeze_shape_inputs(inputs.iter().map(|t| (t.name.as_str(), &t.data)));
    opts
}

/// A model whose batch symbol landed on a sequence axis (inputs detected as batch-major
/// that are not), which only a fixed batch imports.
fn sequence_major(e: &DriverError) -> bool {
    matches!(e, DriverError::Model(m) if m.error.is_sequence_major())
}

fn skip_reason(e: &ImportError) -> Option<String> {
    Some(match e {
        ImportError::UnknownOps(ops) => format!("unsupported op {}", ops.iter().map(|o| o.0.as_str()).collect::<Vec<_>>().join(", ")),
        ImportError::OpVersion { op, version, .. } => format!("{op} version {version} not implemented"),
        ImportError::ValueType { type_name, .. } => format!("element type {type_name}"),
        ImportError::BadTensor { reason, .. } if reason.contains("element type") => "unsupported element type".into(),
        ImportError::BadTensor { reason, .. } if reason.contains("symbol") || reason.contains("no extent") => "dynamic input shape".into(),
        ImportError::Domain(_) | ImportError::NoDefaultOpset => "non-default operator domain".into(),
        ImportError::BadNode { reason, .. } if reason.contains("not supported") => reason.clone(),
        ImportError::Shape { reason, .. } if reason.contains("not known at import") => "data-dependent output shape".into(),
        _ => return None,
    })
}

fn run_case(case: &Case) -> Outcome {
    let mut any = false;
    for (dir, prefix) in &case.data {
        let inputs = match read_tensors(dir, &format!("{prefix}input_")) {
            Ok(v) => v,
            Err(e) => return unreadable("inputs", e),
        };
        let expected = match read_tensors(dir, &format!("{prefix}output_")) {
            Ok(v) if !v.is_empty() => v,
            Ok(_) => continue,
            Err(e) => return unreadable("outputs", e),
        };
        any = true;
        let mut opts = frozen(&inputs);
        let mut loaded = Runner::load(&case.model, &opts, tch::Device::Cpu);
        if loaded.as_ref().err().is_some_and(sequence_major) {
            // The suite runs every model at its exported shapes, which a fixed batch keeps.
            opts.batch = BatchMode::Fixed;
            loaded = Runner::load(&case.model, &opts, tch::Device::Cpu);
        }
        let runner = match loaded {
            Ok(r) => r,
            Err(e) => {
                let reason = match &e {
                    DriverError::Model(m) => skip_reason(&m.error),
                    _ => None,
                };
                return match reason {
                    Some(reason) => Outcome::Skipped(reason),
                    None if e.to_string().contains("dtype not supported") => Outcome::Skipped("element type not supported by libtorch (u16/u32/u64)".into()),
                    None => Outcome::Failed(format!("import: {e}")),
                };
            }
        };
        if has_training_dropout(&runner.graph) {
            return Outcome::Skipped("random output (Dropout in training mode)".into());
        }
        // Float parameters the importer froze are no graph inputs; feeds are matched by name.
        let feeds: Vec<NamedTensor> = inputs.into_iter().filter(|t| !opts.frozen_inputs.contains_key(&t.name)).collect();
        if feeds.len() < runner.graph.inputs().len() {
            return Outcome::Skipped("the suite ships no input data for this model".into());
        }
        let outs = match runner.run(&feeds) {
            Ok(o) => o,
            Err(e) => return Outcome::Failed(format!("run: {e}")),
        };
        for (k, (got, want)) in outs.iter().zip(&expected).enumerate() {
            let (rtol, atol) = tolerance(want.data.dtype);
            match compare(got, &want.data, rtol, atol) {
                Err(e) => return Outcome::Failed(format!("output {k}: {e}")),
                Ok(c) if c.mismatches > 0 => {
                    return Outcome::Failed(format!(
                        "output {k}: {} of {} elements outside tolerance (max abs err {:.3e})",
                        c.mismatches, c.numel, c.max_abs_err
                    ))
                }
                Ok(_) => {}
            }
        }
    }
    if any { Outcome::Passed } else { Outcome::Skipped("no expected outputs".into()) }
}

/// A data file the IR cannot represent (string, float8, 4-bit types) skips the test.
fn unreadable(what: &str, e: DriverError) -> Outcome {
    let msg = e.to_string();
    if msg.contains("element type") {
        Outcome::Skipped("unsupported element type".into())
    } else {
        Outcome::Failed(format!("reading {what}: {msg}"))
    }
}

/// ONNX's runner tolerances, looser for half-precision outputs: their expected values come
/// from a reference that rounds differently (f32 accumulation in libtorch vs per-op
/// rounding in the reference), which moves results by about one unit in the last place.
fn tolerance(dtype: pipewright_ir::DType) -> (f64, f64) {
    match dtype {
        pipewright_ir::DType::Bf16 => (1e-2, 1e-2),
        pipewright_ir::DType::F16 => (1e-3, 1e-3),
        _ => (RTOL, ATOL),
    }
}

/// A Dropout whose `training_mode` input is a true constant draws a random mask that no
/// other implementation reproduces.
fn has_training_dropout(g: &pipewright_ir::Graph) -> bool {
    g.node_ids().any(|n| {
        let node = g.node(n);
        matches!(node.op, pipewright_ir::Op::Dropout { .. })
            && node.inputs.get(2).copied().flatten().and_then(|v| g.value(v).weight()).is_some_and(|w| w.data.to_i64s().iter().any(|&x| x != 0))
    })
}

/// One test's result.
pub type Row = (String, String, Outcome);

/// Runs every case under `roots` (those whose name contains `filter`), in parallel;
/// returns `(suite, name, outcome)` rows in suite order.
pub fn run_all(roots: &[PathBuf], filter: Option<&str>) -> Result<Vec<Row>, DriverError> {
    let mut all = Vec::new();
    for root in roots {
        all.extend(cases(root)?.into_iter().filter(|c| !filter.is_some_and(|f| !c.name.contains(f))));
    }
    Ok(all
        .par_iter()
        .map(|case| {
            // Small single-op cases: one intra-op thread each, and the cores go to cases.
            tch::set_num_threads(1);
            (case.suite.clone(), case.name.clone(), run_case(case))
        })
        .collect())
}

/// The markdown report: totals per suite, every failure with its cause, skip reasons.
pub fn report(rows: &[Row]) -> String {
    let mut totals: BTreeMap<&str, [usize; 3]> = BTreeMap::new();
    let mut skips: BTreeMap<String, usize> = BTreeMap::new();
    for (suite, _, o) in rows {
        let t = totals.entry(suite).or_default();
        match o {
            Outcome::Passed => t[0] += 1,
            Outcome::Failed(_) => t[1] += 1,
            Outcome::Skipped(r) => {
                t[2] += 1;
                *skips.entry(r.clone()).or_default() += 1;
            }
        }
    }
    let mut s = String::from("| suite | passed | failed | skipped | pass rate of run tests |\n|---|---|---|---|---|\n");
    for (suite, [p, f, k]) in &totals {
        let rate = if p + f > 0 { 100.0 * *p as f64 / (p + f) as f64 } else { 0.0 };
        let _ = writeln!(s, "| {suite} | {p} | {f} | {k} | {rate:.1}% |");
    }
    s.push_str("\n### Failures\n\n");
    for (suite, name, o) in rows {
        if let Outcome::Failed(r) = o {
            let _ = writeln!(s, "- `{suite}/{name}`: {}", r.replace('\n', " "));
        }
    }
    s.push_str("\n### Skip reasons\n\n| reason | tests |\n|---|---|\n");
    let mut sk: Vec<_> = skips.into_iter().collect();
    sk.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for (r, n) in sk {
        let _ = writeln!(s, "| {} | {n} |", r.replace('|', "/"));
    }
    s
}

/// Passed, failed and skipped counts.
pub fn totals(rows: &[Row]) -> (usize, usize, usize) {
    rows.iter().fold((0, 0, 0), |(p, f, k), r| match r.2 {
        Outcome::Passed => (p + 1, f, k),
        Outcome::Failed(_) => (p, f + 1, k),
        Outcome::Skipped(_) => (p, f, k + 1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(name: &str) -> PathBuf {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/onnx-backend").join(name);
        assert!(p.is_dir(), "the shared corpus is missing: expected {}", p.display());
        p
    }

    #[test]
    fn runs_cases_in_parallel_and_reports_them_in_suite_order() {
        let rows = run_all(&[suite("node")], Some("test_relu")).unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "suite order");
        assert!(rows.iter().all(|r| matches!(r.2, Outcome::Passed)), "{:?}", rows.iter().map(|r| (&r.1, &r.2)).collect::<Vec<_>>());
        assert_eq!(totals(&rows), (rows.len(), 0, 0));
        let text = report(&rows);
        assert!(text.contains(&format!("| node | {} | 0 | 0 | 100.0% |", rows.len())), "{text}");
    }
}
