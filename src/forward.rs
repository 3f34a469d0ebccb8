//! Forward execution of a whole model through the runtime's op layer, and comparison of
//! outputs with expected tensors (`pipewright run-forward`, the conformance runner and
//! the forward-equivalence tests share it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pipewright_codegen::lower_graph;
use pipewright_ir::{import_model, read_tensor_file, Graph, ImportOptions, TensorData};
use pipewright_runtime::exec::{tensor_from_bytes, tensor_to_bytes, Mode};
use pipewright_runtime::interp::Interpreter;
use tch::Tensor;

use crate::RunForwardArgs;

/// A named tensor read from a `.pb` file.
pub struct NamedTensor {
    pub name: String,
    pub data: TensorData,
}

/// `input_K.pb` (or `output_K.pb`) files of a folder, in K order.
pub fn read_tensors(dir: &Path, prefix: &str) -> Result<Vec<NamedTensor>> {
    let mut files: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_string();
            let k = stem.strip_prefix(prefix)?.parse().ok()?;
            (p.extension()? == "pb").then_some((k, p))
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|(_, p)| {
            let (name, data) = read_tensor_file(&p)?;
            Ok(NamedTensor { name, data })
        })
        .collect()
}

/// Converts IR tensor data to a libtorch tensor.
pub fn to_torch(t: &TensorData) -> Result<Tensor> {
    Ok(tensor_from_bytes(pipewright_codegen::lower::elem(t.dtype), &t.dims, &t.bytes)?)
}

/// A model compiled to one program and ready to run.
pub struct Runner {
    pub graph: Graph,
    interp: Interpreter,
}

impl Runner {
    pub fn load(path: &Path, opts: &ImportOptions, device: tch::Device) -> Result<Runner> {
        let graph = import_model(path, opts)?;
        let program = lower_graph(&graph)?;
        let interp = Interpreter::new(program, device)?;
        Ok(Runner { graph, interp })
    }

    /// The interpreter (for callers that run with autograd on, e.g. `bench-step`).
    pub fn interp(&self) -> &Interpreter {
        &self.interp
    }

    /// Runs on `inputs`, matched to graph inputs by name when names are given, else by order.
    pub fn run(&self, inputs: &[NamedTensor]) -> Result<Vec<Tensor>> {
        let g = &self.graph;
        let by_name: HashMap<&str, &NamedTensor> = inputs.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut feeds = Vec::with_capacity(g.inputs().len());
        for (i, &v) in g.inputs().iter().enumerate() {
            let name = &g.value(v).name;
            let t = match by_name.get(name.as_str()) {
                Some(t) => *t,
                None => inputs.get(i).with_context(|| format!("no tensor given for graph input {name:?}"))?,
            };
            feeds.push(to_torch(&t.data)?.f_to_device(self.interp.device())?);
        }
        let _guard = tch::no_grad_guard();
        Ok(self.interp.run(&feeds, Mode::Eval)?)
    }
}

/// How one output compares with its expected value.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub max_abs_err: f64,
    pub max_expected: f64,
    /// Elements outside `atol + rtol * |expected|`.
    pub mismatches: usize,
    pub numel: usize,
}

impl Comparison {
    /// Max abs error relative to the output's max magnitude (forward-equivalence metric).
    pub fn relative(&self) -> f64 {
        if self.max_expected > 0.0 { self.max_abs_err / self.max_expected } else { self.max_abs_err }
    }
}

/// Compares `actual` with `expected` elementwise (NaN matches NaN); errs on shape or
/// dtype disagreement.
pub fn compare(actual: &Tensor, expected: &TensorData, rtol: f64, atol: f64) -> Result<Comparison> {
    let (et, dims, _) = tensor_to_bytes(actual)?;
    if dims != expected.dims {
        bail!("shape {:?}, expected {:?}", dims, expected.dims);
    }
    if et != pipewright_codegen::lower::elem(expected.dtype) {
        bail!("element type {et}, expected {}", expected.dtype);
    }
    let a: Vec<f64> = Vec::<f64>::try_from(actual.f_to_kind(tch::Kind::Double)?.f_flatten(0, -1)?)?;
    let e = expected.to_f64s();
    let mut c = Comparison { max_abs_err: 0.0, max_expected: 0.0, mismatches: 0, numel: e.len() };
    for (x, y) in a.iter().zip(&e) {
        if x.is_nan() && y.is_nan() {
            continue;
        }
        let err = if x == y { 0.0 } else { (x - y).abs() };
        let err = if err.is_nan() { f64::INFINITY } else { err };
        c.max_abs_err = c.max_abs_err.max(err);
        if y.is_finite() {
            c.max_expected = c.max_expected.max(y.abs());
        }
        if err > atol + rtol * y.abs() {
            c.mismatches += 1;
        }
    }
    Ok(c)
}

/// Repeats a tensor `k` times along axis 0 (raw bytes: axis 0 is outermost).
fn tile(t: NamedTensor, k: usize) -> NamedTensor {
    if k == 1 || t.data.dims.is_empty() {
        return t;
    }
    let mut dims = t.data.dims.clone();
    dims[0] *= k as i64;
    let bytes: Vec<u8> = t.data.bytes.iter().copied().cycle().take(t.data.bytes.len() * k).collect();
    let data = TensorData::new(t.data.dtype, dims, bytes.into()).expect("tiled size matches");
    NamedTensor { name: t.name, data }
}

/// `pipewright run-forward`.
pub fn run(args: &RunForwardArgs) -> Result<()> {
    let device = pipewright_runtime::device::tch_device(args.device)?;
    let runner = Runner::load(&args.model, &ImportOptions::default(), device)?;
    let inputs = read_tensors(&args.inputs, "input_")?;
    if inputs.is_empty() {
        bail!("{}: no input_K.pb files", args.inputs.display());
    }
    let k = args.tile_batch.max(1);
    let inputs: Vec<NamedTensor> = inputs.into_iter().map(|t| tile(t, k)).collect();
    let outputs = runner.run(&inputs)?;
    let expected: Vec<NamedTensor> = read_tensors(&args.inputs, "output_")?.into_iter().map(|t| tile(t, k)).collect();
    let g = &runner.graph;
    for (i, (t, v)) in outputs.iter().zip(g.outputs()).enumerate() {
        let shape = t.size();
        let mean = t.f_to_kind(tch::Kind::Double).ok().and_then(|d| d.f_mean(tch::Kind::Double).ok()).map(f64::try_from);
        print!("output {i} {:?}: {:?} {shape:?}", g.value(*v).name, t.kind());
        if let Some(Ok(m)) = mean {
            print!(" mean={m:.6}");
        }
        match expected.get(i) {
            Some(e) => {
                let c = compare(t, &e.data, args.rtol, args.atol)?;
                println!(
                    " max_abs_err={:.3e} relative={:.3e} mismatches={}/{}",
                    c.max_abs_err,
                    c.relative(),
                    c.mismatches,
                    c.numel
                );
            }
            None => println!(),
        }
    }
    Ok(())
}
