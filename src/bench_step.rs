//! `pipewright bench-step`: times forward + backward steps of a model through the runtime's
//! interpreter (a benchmark; `bench/fwd_bwd.sh` compares it with PyTorch eager).
//!
//! One step: forward with autograd on, loss = sum over the floating-point outputs of
//! `output.sum()`, `loss.backward()`, then the parameter gradients are zeroed in place.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use pipewright_ir::ImportOptions;
use pipewright_runtime::exec::Mode;
use tch::{Kind, Tensor};

use crate::forward::{read_tensors, to_torch, Runner};

#[derive(clap::Args)]
pub struct BenchStepArgs {
    /// The ONNX model file.
    pub model: PathBuf,
    /// A folder of `input_K.pb` files.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Intra-op threads (`tch::set_num_threads`); libtorch's default when absent.
    #[arg(long)]
    pub threads: Option<i32>,
    /// Run in training mode (batch statistics, dropout) instead of eval mode.
    #[arg(long)]
    pub train: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: pipewright_core::Device,
}

pub fn run(args: &BenchStepArgs) -> Result<()> {
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let device = pipewright_runtime::device::tch_device(args.device)?;
    let runner = Runner::load(&args.model, &ImportOptions::default(), device)?;
    let inputs = read_tensors(&args.inputs, "input_")?;
    if inputs.is_empty() {
        bail!("{}: no input_K.pb files", args.inputs.display());
    }
    // Match files to graph inputs by name, else by order (as `Runner::run` does).
    let g = &runner.graph;
    let by_name: HashMap<&str, usize> = inputs.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
    let mut feeds = Vec::with_capacity(g.inputs().len());
    for (i, &v) in g.inputs().iter().enumerate() {
        let name = &g.value(v).name;
        let t = match by_name.get(name.as_str()) {
            Some(&k) => &inputs[k],
            None => inputs.get(i).with_context(|| format!("no tensor given for graph input {name:?}"))?,
        };
        feeds.push(to_torch(&t.data)?.f_to_device(device)?);
    }
    let interp = runner.interp();
    let params: Vec<Tensor> = interp.parameters().into_iter().map(|t| t.shallow_clone()).collect();
    if params.is_empty() {
        bail!("model has no trainable parameters");
    }
    let mode = if args.train { Mode::Train } else { Mode::Eval };
    let step = || -> Result<()> {
        let outputs = interp.run(&feeds, mode)?;
        let mut loss: Option<Tensor> = None;
        for o in outputs.iter().filter(|o| o.is_floating_point()) {
            let s = o.f_sum(Kind::Float)?;
            loss = Some(match loss {
                Some(l) => l + s,
                None => s,
            });
        }
        let loss = loss.context("model has no floating-point output")?;
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
    for _ in 0..args.warmup {
        step()?;
    }
    let mut ms = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let t0 = Instant::now();
        step()?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    if ms.is_empty() {
        bail!("--steps must be at least 1");
    }
    let mean = ms.iter().sum::<f64>() / ms.len() as f64;
    let mut sorted = ms.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let n = sorted.len();
    let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
    let threads = tch::get_num_threads();
    let name = args.model.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    println!(
        "{name}: {} parameters, {} steps after {} warmup, mode {}",
        params.len(),
        n,
        args.warmup,
        if args.train { "train" } else { "eval" }
    );
    println!("median {median:.3} ms/step, mean {mean:.3} ms/step, min {:.3} ms, threads {threads}", sorted[0]);
    println!("bench-step model={name} median_ms={median:.3} mean_ms={mean:.3} threads={threads}");
    Ok(())
}
