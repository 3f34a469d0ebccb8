//! Whole models through the runtime's op layer: a [`Runner`] (import, lower to one
//! program, interpret), the `input_K.pb`/`output_K.pb` folders of the corpus and the
//! backend suite, and the comparison with expected outputs that `run-forward`, the
//! conformance runner and the forward-equivalence tests share; plus `bench-step`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use pipewright_codegen::lower_graph;
use pipewright_core::Device;
use pipewright_ir::{import_model, read_tensor_file, Graph, ImportOptions, TensorData};
use pipewright_runtime::device::tch_device;
use pipewright_runtime::exec::{tensor_from_bytes, tensor_to_bytes, tensor_to_bytes_as, Mode};
use pipewright_runtime::interp::Interpreter;
use tch::{Kind, Tensor};

use crate::DriverError;

/// A named tensor read from a `.pb` file.
pub struct NamedTensor {
    pub name: String,
    pub data: TensorData,
}

/// `PREFIXK.pb` files of a folder (`input_0.pb`, `input_1.pb`, ...), in K order.
pub fn read_tensors(dir: &Path, prefix: &str) -> Result<Vec<NamedTensor>, DriverError> {
    let entries = std::fs::read_dir(dir).map_err(|source| DriverError::Read { path: dir.to_path_buf(), source })?;
    let mut files: Vec<(usize, PathBuf)> = entries
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

/// IR tensor data as a libtorch tensor.
pub fn to_torch(t: &TensorData) -> Result<Tensor, DriverError> {
    Ok(tensor_from_bytes(t.dtype, &t.dims, &t.bytes)?)
}

/// A model lowered to one program, ready to run.
pub struct Runner {
    pub graph: Graph,
    interp: Interpreter,
}

impl Runner {
    pub fn load(path: &Path, opts: &ImportOptions, device: tch::Device) -> Result<Runner, DriverError> {
        let graph = import_model(path, opts)?;
        let program = lower_graph(&graph)?;
        let interp = Interpreter::new(program, device)?;
        Ok(Runner { graph, interp })
    }

    /// The interpreter (for callers that run with autograd on, e.g. `bench-step`).
    pub fn interp(&self) -> &Interpreter {
        &self.interp
    }

    /// The graph inputs fed from `inputs`: by name when the names match, else by order.
    pub fn feeds(&self, inputs: &[NamedTensor]) -> Result<Vec<Tensor>, DriverError> {
        let g = &self.graph;
        let by_name: HashMap<&str, &NamedTensor> = inputs.iter().map(|t| (t.name.as_str(), t)).collect();
        g.inputs()
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let name = &g.value(v).name;
                let t = match by_name.get(name.as_str()) {
                    Some(t) => *t,
                    None => inputs.get(i).ok_or_else(|| DriverError::msg(format!("no tensor given for graph input {name:?}")))?,
                };
                Ok(to_torch(&t.data)?.f_to_device(self.interp.device())?)
            })
            .collect()
    }

    /// Runs forward (no autograd) on `inputs`.
    pub fn run(&self, inputs: &[NamedTensor]) -> Result<Vec<Tensor>, DriverError> {
        let feeds = self.feeds(inputs)?;
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
pub fn compare(actual: &Tensor, expected: &TensorData, rtol: f64, atol: f64) -> Result<Comparison, DriverError> {
    let want = expected.dtype;
    // Bytes as the expected type: u16/u32/u64 results live in a carrier kind.
    let Ok((dims, bytes)) = tensor_to_bytes_as(actual, want) else {
        let (et, _, _) = tensor_to_bytes(actual)?;
        return Err(DriverError::msg(format!("element type {et}, expected {}", expected.dtype)));
    };
    if dims != expected.dims {
        return Err(DriverError::msg(format!("shape {:?}, expected {:?}", dims, expected.dims)));
    }
    let a: Vec<f64> = if want.is_float() || want.holder() != want {
        Vec::<f64>::try_from(actual.f_to_kind(Kind::Double)?.f_flatten(0, -1)?)?
    } else {
        // Integers from their bytes, so u64 values from 2^63 up read as themselves.
        TensorData::new(expected.dtype, dims, bytes.into()).ok_or_else(|| DriverError::msg("result bytes do not match the shape"))?.to_f64s()
    };
    let e = expected.to_f64s();
    let mut c = Comparison { max_abs_err: 0.0, max_expected: 0.0, mismatches: 0, numel: e.len() };
    for (x, y) in a.iter().zip(&e) {
        if x.is_nan() || y.is_nan() {
            // NaN matches NaN only; a number where NaN is expected (or the reverse) is off.
            if x.is_nan() != y.is_nan() {
                c.max_abs_err = f64::INFINITY;
                c.mismatches += 1;
            }
            continue;
        }
        let err = if x == y { 0.0 } else { (x - y).abs() };
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
pub fn tile(t: NamedTensor, k: usize) -> Result<NamedTensor, DriverError> {
    if k <= 1 || t.data.dims.is_empty() {
        return Ok(t);
    }
    let mut dims = t.data.dims.clone();
    dims[0] *= k as i64;
    let bytes: Vec<u8> = t.data.bytes.iter().copied().cycle().take(t.data.bytes.len() * k).collect();
    let data = TensorData::new(t.data.dtype, dims, bytes.into()).ok_or_else(|| DriverError::msg(format!("tensor {:?}: cannot tile", t.name)))?;
    Ok(NamedTensor { name: t.name, data })
}

/// One output of a forward run, compared with its expected value when there is one.
pub struct ForwardOutput {
    pub name: String,
    pub tensor: Tensor,
    pub comparison: Option<Comparison>,
}

/// `pipewright run-forward`: runs the model on the `input_K.pb` files of `inputs` (each
/// repeated `tile` times along the batch axis) and compares with `output_K.pb` where
/// present.
pub fn run_forward(model: &Path, inputs: &Path, device: tch::Device, tile_batch: usize, rtol: f64, atol: f64) -> Result<Vec<ForwardOutput>, DriverError> {
    let runner = Runner::load(model, &ImportOptions::default(), device)?;
    let given = read_tensors(inputs, "input_")?;
    if given.is_empty() {
        return Err(DriverError::msg(format!("{}: no input_K.pb files", inputs.display())));
    }
    let k = tile_batch.max(1);
    let given = given.into_iter().map(|t| tile(t, k)).collect::<Result<Vec<_>, _>>()?;
    let outputs = runner.run(&given)?;
    let expected = read_tensors(inputs, "output_")?.into_iter().map(|t| tile(t, k)).collect::<Result<Vec<_>, _>>()?;
    let g = &runner.graph;
    outputs
        .into_iter()
        .zip(g.outputs())
        .enumerate()
        .map(|(i, (tensor, v))| {
            let comparison = expected.get(i).map(|e| compare(&tensor, &e.data, rtol, atol)).transpose()?;
            Ok(ForwardOutput { name: g.value(*v).name.clone(), tensor, comparison })
        })
        .collect()
}

/// `run-forward`'s conclusion: whether every output matched its expected value, in words.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// False when an output differs from its expected value beyond the tolerances.
    pub matched: bool,
    pub lines: Vec<String>,
}

/// The verdict on `outputs` compared (where `inputs` held an `output_K.pb`) at `rtol` and
/// `atol`: an element matches when `|actual - expected| <= atol + rtol * |expected|`.
pub fn verdict(outputs: &[ForwardOutput], inputs: &Path, rtol: f64, atol: f64) -> Verdict {
    let compared: Vec<(usize, &ForwardOutput, &Comparison)> = outputs.iter().enumerate().filter_map(|(i, o)| Some((i, o, o.comparison.as_ref()?))).collect();
    if compared.is_empty() {
        return Verdict { matched: true, lines: vec![format!("no output_K.pb in {}: nothing to compare with", inputs.display())] };
    }
    let rule = format!("|actual - expected| <= atol + rtol * |expected| (atol {atol:e}, rtol {rtol:e})");
    let off: Vec<String> = compared
        .iter()
        .filter(|(_, _, c)| c.mismatches > 0)
        .map(|(i, o, c)| {
            format!(
                "MISMATCH: output {i} {:?}: {} of {} elements differ from {} by more than the tolerance (largest difference {:.3e})",
                o.name,
                c.mismatches,
                c.numel,
                inputs.join(format!("output_{i}.pb")).display(),
                c.max_abs_err
            )
        })
        .collect();
    if off.is_empty() {
        let n = compared.len();
        return Verdict { matched: true, lines: vec![format!("match: all {n} compared output(s) agree with the expected outputs: {rule}")] };
    }
    let mut lines = off;
    lines.push(format!("an element matches when {rule}; loosen with --rtol/--atol if these differences are acceptable"));
    Verdict { matched: false, lines }
}

/// Writes the outputs, by output name, to an `.npz` file (atomically).
pub fn save_outputs(path: &Path, outputs: &[ForwardOutput]) -> Result<(), DriverError> {
    let arrays: Vec<(String, Tensor)> = outputs.iter().map(|o| (o.name.clone(), o.tensor.shallow_clone())).collect();
    let bytes = pipewright_runtime::data::npz_bytes(&arrays).map_err(|e| DriverError::msg(format!("{}: {e}", path.display())))?;
    pipewright_core::fs::write_atomic(path, &bytes).map_err(|e| DriverError::msg(e.to_string()))
}

/// Timings of `bench-step`, in milliseconds per step.
#[derive(Clone, Debug)]
pub struct StepTimes {
    /// Trainable weight tensors, and the values they hold (what `inspect` counts).
    pub parameters: usize,
    pub parameter_values: i64,
    pub steps: usize,
    pub median_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
}

/// `pipewright bench-step`: `warmup` then `steps` timed forward + backward steps (loss =
/// the sum of the floating-point outputs; parameter gradients zeroed after each).
pub fn bench_step(model: &Path, inputs: &Path, device: tch::Device, train_mode: bool, warmup: usize, steps: usize) -> Result<StepTimes, DriverError> {
    if steps == 0 {
        return Err(DriverError::msg("--steps must be at least 1"));
    }
    let runner = Runner::load(model, &ImportOptions::default(), device)?;
    let given = read_tensors(inputs, "input_")?;
    if given.is_empty() {
        return Err(DriverError::msg(format!("{}: no input_K.pb files", inputs.display())));
    }
    let feeds = runner.feeds(&given)?;
    let interp = runner.interp();
    let params: Vec<Tensor> = interp.parameters().into_iter().map(|t| t.shallow_clone()).collect();
    if params.is_empty() {
        return Err(DriverError::msg(format!("{}: the model has no trainable parameters", model.display())));
    }
    let mode = if train_mode { Mode::Train } else { Mode::Eval };
    let step = || -> Result<(), DriverError> {
        let outputs = interp.run(&feeds, mode)?;
        let mut loss: Option<Tensor> = None;
        for o in outputs.iter().filter(|o| o.is_floating_point()) {
            let s = o.f_sum(Kind::Float)?;
            loss = Some(match loss {
                Some(l) => l.f_add(&s)?,
                None => s,
            });
        }
        let loss = loss.ok_or_else(|| DriverError::msg(format!("{}: the model has no floating-point output", model.display())))?;
        loss.f_backward()?;
        for p in &params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.f_zero_()?;
            }
        }
        if let tch::Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        Ok(())
    };
    for _ in 0..warmup {
        step()?;
    }
    let mut ms = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t0 = Instant::now();
        step()?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let mean_ms = ms.iter().sum::<f64>() / ms.len() as f64;
    ms.sort_by(|a, b| a.total_cmp(b));
    let n = ms.len();
    let median_ms = if n % 2 == 1 { ms[n / 2] } else { (ms[n / 2 - 1] + ms[n / 2]) / 2.0 };
    let parameter_values = params.iter().map(|t| t.numel() as i64).sum();
    Ok(StepTimes { parameters: params.len(), parameter_values, steps: n, median_ms, mean_ms, min_ms: ms[0] })
}

/// `run-forward`: runs `model` on `device` over the inputs in `inputs` (tiled
/// `tile_batch` times), saves the outputs to `save` when asked, and compares them with
/// the folder's expected outputs. Returns what the command prints and the verdict.
pub fn run_forward_command(model: &Path, inputs: &Path, device: Device, tile_batch: usize, tolerance: (f64, f64), save: Option<&Path>) -> Result<(Vec<String>, Verdict), DriverError> {
    let (rtol, atol) = tolerance;
    let device = tch_device(device).map_err(|e| DriverError::msg(e.to_string()))?;
    let outputs = run_forward(model, inputs, device, tile_batch, rtol, atol)?;
    let mut lines: Vec<String> = outputs.iter().enumerate().map(|(i, out)| output_line(i, out)).collect();
    if let Some(path) = save {
        save_outputs(path, &outputs)?;
        lines.push(format!("saved {} output(s) to {}", outputs.len(), path.display()));
    }
    let v = verdict(&outputs, inputs, rtol, atol);
    lines.extend(v.lines.iter().cloned());
    Ok((lines, v))
}

/// `output 0 "y": Float [2, 10] mean=0.1 max_abs_err=...`.
fn output_line(i: usize, out: &ForwardOutput) -> String {
    let t = &out.tensor;
    let mut line = format!("output {i} {:?}: {:?} {:?}", out.name, t.kind(), t.size());
    if let Ok(Ok(m)) = t.f_to_kind(Kind::Double).and_then(|d| d.f_mean(Kind::Double)).map(f64::try_from) {
        line.push_str(&format!(" mean={m:.6}"));
    }
    if let Some(c) = &out.comparison {
        line.push_str(&format!(" max_abs_err={:.3e} relative={:.3e} mismatches={}/{}", c.max_abs_err, c.relative(), c.mismatches, c.numel));
    }
    line
}

/// `bench-step`: times forward + backward steps of `model` on `device` (`threads` intra-op
/// threads, libtorch's default when `None`); returns the lines the command prints.
pub fn bench_step_command(model: &Path, inputs: &Path, device: Device, threads: Option<i32>, train: bool, warmup: usize, steps: usize) -> Result<Vec<String>, DriverError> {
    if let Some(t) = threads {
        tch::set_num_threads(t);
    }
    let device = tch_device(device).map_err(|e| DriverError::msg(e.to_string()))?;
    let s = bench_step(model, inputs, device, train, warmup, steps)?;
    let threads = tch::get_num_threads();
    let name = model.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    Ok(vec![
        format!("{name}: {} parameters in {} weight tensors, {} steps after {warmup} warmup, mode {}", s.parameter_values, s.parameters, s.steps, if train { "train" } else { "eval" }),
        format!("median {:.3} ms/step, mean {:.3} ms/step, min {:.3} ms, threads {threads}", s.median_ms, s.mean_ms, s.min_ms),
        format!("bench-step model={name} median_ms={:.3} mean_ms={:.3} threads={threads}", s.median_ms, s.mean_ms),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_ir::DType;

    fn data(dims: &[i64], v: &[f64]) -> TensorData {
        TensorData::from_f64s(DType::F32, dims.to_vec(), v)
    }

    #[test]
    fn compares_within_tolerance_and_matches_nan_with_nan() {
        let expected = data(&[4], &[1.0, -2.0, f64::NAN, 100.0]);
        let got = Tensor::from_slice(&[1.0f32, -2.001, f32::NAN, 100.0]);
        let c = compare(&got, &expected, 1e-3, 1e-7).unwrap();
        assert_eq!((c.mismatches, c.numel), (0, 4));
        assert!((c.relative() - 0.001 / 100.0).abs() < 1e-6, "{}", c.relative());
        let c = compare(&Tensor::from_slice(&[1.0f32, -2.1, 0.0, 100.0]), &expected, 1e-3, 1e-7).unwrap();
        assert_eq!(c.mismatches, 2, "-2.1 is outside, and a number is not NaN");
        let e = compare(&Tensor::from_slice(&[1.0f32, 2.0]), &expected, 1e-3, 1e-7).unwrap_err();
        assert_eq!(e.to_string(), "shape [2], expected [4]");
    }

    #[test]
    fn tiles_along_the_batch_axis() {
        let t = NamedTensor { name: "x".into(), data: data(&[2, 2], &[1.0, 2.0, 3.0, 4.0]) };
        let tiled = tile(t, 3).unwrap();
        assert_eq!(tiled.data.dims, vec![6, 2]);
        assert_eq!(tiled.data.to_f64s(), [1.0, 2.0, 3.0, 4.0].repeat(3));
    }
}
