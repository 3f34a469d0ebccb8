//! `pipewright profile`: measured forward and backward time of every node at several
//! microbatch sizes, with the runtime's own kernels, as the [`Profile`] that
//! `pipewright plan --profile` reads.
//!
//! Each node is timed in isolation on the tensors a full forward pass gave it: forward is
//! the kernel call; backward is autograd through that one kernel from a ones gradient on
//! its float outputs. Several repetitions, median; the profile also keeps the spread of
//! the whole model's time over the repetitions (`spread`), which `profile` reports.

use std::time::Instant;

use std::path::Path;

use pipewright_core::Device;
use pipewright_ir::{Graph, ImportOptions};
use pipewright_passes::cost::{BatchSpread, Profile, ProfileNode};
use pipewright_runtime::exec::{run as run_kernel, Mode};
use pipewright_runtime::program::Instr;
use tch::{Kind, Tensor};

use crate::forward::Runner;
use crate::DriverError;

/// Profiles `model` on `device` at each microbatch size of `batches` (`reps` timed
/// repetitions per node, median; synthetic inputs from `seed`); `on_batch` hears when a
/// size is done, with the spread of the whole model's time over the repetitions.
pub fn profile(model: &Path, device: Device, batches: &[u64], reps: usize, seed: u64, on_batch: &mut dyn FnMut(&BatchSpread)) -> Result<Profile, DriverError> {
    let tdev = pipewright_runtime::device::tch_device(device).map_err(|e| DriverError::msg(e.to_string()))?;
    let runner = Runner::load(model, &ImportOptions::default(), tdev)?;
    tch::manual_seed(seed as i64);
    let instrs = &runner.interp().program().instrs;
    let mut nodes: Vec<ProfileNode> =
        instrs.iter().map(|i| ProfileNode { name: i.name.clone(), op: i.kernel.name().to_string(), fwd_ms: Vec::new(), bwd_ms: Vec::new() }).collect();
    let mut spread = Vec::with_capacity(batches.len());
    for &b in batches {
        let inputs = synthetic_inputs(&runner.graph, b as i64, tdev)?;
        let slots = runner
            .interp()
            .run_keep_all(&inputs, Mode::Train)
            .map_err(|e| DriverError::msg(format!("{}: the model does not run at batch {b}: {e}", model.display())))?;
        // Repetition r's total over all nodes: how much the whole model's time moves.
        let mut totals = vec![0.0; reps.max(1)];
        for (node, ins) in nodes.iter_mut().zip(instrs) {
            let args: Vec<Option<Tensor>> = ins.inputs.iter().map(|s| s.and_then(|s| slots[s.index()].as_ref().map(|t| t.detach()))).collect();
            let (f, bw) = time_node(ins, &args, reps)?;
            for (t, (x, y)) in totals.iter_mut().zip(f.iter().zip(&bw)) {
                *t += x + y;
            }
            node.fwd_ms.push(median(f));
            node.bwd_ms.push(median(bw));
        }
        let s = BatchSpread::of(b, totals);
        on_batch(&s);
        spread.push(s);
    }
    Ok(Profile { model: model.display().to_string(), device: device.to_string(), batches: batches.to_vec(), nodes, spread })
}

/// Random float inputs (seeded) and zero index inputs of the graph's input shapes at `b`.
fn synthetic_inputs(g: &Graph, b: i64, device: tch::Device) -> Result<Vec<Tensor>, DriverError> {
    g.inputs()
        .iter()
        .map(|&v| {
            let ty = &g.value(v).ty;
            let dims = ty.shape.eval(b);
            let et = pipewright_codegen::lower::elem(ty.dtype);
            let k = pipewright_runtime::exec::torch_kind(et)?;
            Ok(if ty.dtype.is_float() {
                Tensor::f_randn(&dims, (k, device))?
            } else {
                Tensor::f_zeros(&dims, (k, device))?
            })
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Forward and backward milliseconds of one node, one per repetition.
fn time_node(ins: &Instr, inputs: &[Option<Tensor>], reps: usize) -> Result<(Vec<f64>, Vec<f64>), DriverError> {
    let reps = reps.max(1);
    let mut fwd = Vec::with_capacity(reps);
    let mut bwd = Vec::with_capacity(reps);
    for _ in 0..reps + 1 {
        let leaves: Vec<Option<Tensor>> = inputs
            .iter()
            .map(|t| t.as_ref().map(|t| if is_float(t) { t.detach().set_requires_grad(true) } else { t.shallow_clone() }))
            .collect();
        let refs: Vec<Option<&Tensor>> = leaves.iter().map(|t| t.as_ref()).collect();
        let start = Instant::now();
        let outs = run_kernel(&ins.kernel, &refs, Mode::Train).map_err(|e| DriverError::msg(format!("node {:?}: {e}", ins.name)))?;
        fwd.push(start.elapsed().as_secs_f64() * 1e3);
        let diff: Vec<Tensor> = outs.into_iter().filter(|o| is_float(o) && o.requires_grad()).collect();
        let start = Instant::now();
        if !diff.is_empty() {
            // A sum is the ones gradient on every float output.
            let mut loss = diff[0].f_sum(Kind::Double)?;
            for o in &diff[1..] {
                loss = loss.f_add(&o.f_sum(Kind::Double)?)?;
            }
            loss.f_backward()?;
        }
        bwd.push(start.elapsed().as_secs_f64() * 1e3);
    }
    // The first repetition warms caches and allocators.
    fwd.remove(0);
    bwd.remove(0);
    Ok((fwd, bwd))
}

fn is_float(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}
