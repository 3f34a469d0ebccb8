//! `pipewright profile`: measured forward and backward time of every node at several
//! microbatch sizes, with the runtime's own kernels, written as the JSON profile that
//! `pipewright plan --profile` reads (format: `pipewright_passes` `Profile`).
//!
//! Each node is timed in isolation on the tensors a full forward pass gave it: forward is
//! the kernel call; backward is autograd through that one kernel from a ones gradient on
//! its float outputs. Several repetitions, median.

use std::time::Instant;

use anyhow::{Context, Result};
use pipewright_ir::{Graph, ImportOptions};
use pipewright_runtime::exec::{run as run_kernel, Mode};
use pipewright_runtime::program::Instr;
use serde_json::json;
use tch::{Kind, Tensor};

use crate::forward::Runner;
use crate::output::write_atomic;
use crate::ProfileArgs;

pub fn run(args: &ProfileArgs) -> Result<()> {
    let device = pipewright_runtime::device::tch_device(args.device)?;
    let runner = Runner::load(&args.model, &ImportOptions::default(), device)?;
    tch::manual_seed(args.seed as i64);
    let mut nodes: Vec<(String, String, Vec<f64>, Vec<f64>)> = runner
        .interp()
        .program()
        .instrs
        .iter()
        .map(|i| (i.name.clone(), i.kernel.name().to_string(), Vec::new(), Vec::new()))
        .collect();
    for &b in &args.batch {
        let inputs = synthetic_inputs(&runner.graph, b, device)?;
        let slots = runner
            .interp()
            .run_keep_all(&inputs, Mode::Train)
            .map_err(|e| anyhow::anyhow!("{}: the model does not run at batch {b}: {e}", args.model.display()))?;
        for (k, ins) in runner.interp().program().instrs.iter().enumerate() {
            let args_t: Vec<Option<Tensor>> = ins.inputs.iter().map(|s| s.and_then(|s| slots[s.index()].as_ref().map(|t| t.detach()))).collect();
            let (f, bw) = time_node(ins, &args_t, args.reps)?;
            nodes[k].2.push(f);
            nodes[k].3.push(bw);
        }
        eprintln!("profile: batch {b} done");
    }
    let doc = json!({
        "model": args.model.display().to_string(),
        "device": args.device.to_string(),
        "batches": args.batch,
        "nodes": nodes.iter().map(|(name, op, f, b)| json!({"name": name, "op": op, "fwd_ms": f, "bwd_ms": b})).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&doc)?;
    match &args.output {
        Some(p) => write_atomic(p, text.as_bytes())?,
        None => println!("{text}"),
    }
    Ok(())
}

/// Random float inputs (seeded) and zero index inputs of the graph's input shapes at `b`.
fn synthetic_inputs(g: &Graph, b: i64, device: tch::Device) -> Result<Vec<Tensor>> {
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

/// Median forward and backward milliseconds of one node.
fn time_node(ins: &Instr, inputs: &[Option<Tensor>], reps: usize) -> Result<(f64, f64)> {
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
        let outs = run_kernel(&ins.kernel, &refs, Mode::Train).with_context(|| format!("node {:?}", ins.name))?;
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
    Ok((median(fwd), median(bwd)))
}

fn is_float(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}
