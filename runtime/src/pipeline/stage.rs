//! One stage's worker: executes its op sequence, keeping at most the weight versions the
//! schedule still needs.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender};

use tch::{Kind, Tensor};

use super::optim::OptState;
use super::trace::{Recorder, TraceKind};
use super::{Event, Loss, Op, PipelineError, StageData, TrainConfig, Transport};
use crate::exec::{run as run_kernel, tensor_from_bytes, Mode};
use crate::module::{Recompute, StageModule};
use crate::program::{Program, SlotId};

pub(crate) struct StageSpec {
    pub index: usize,
    pub program: Program,
    /// Leading program inputs received from the previous stage.
    pub n_recv: usize,
    pub graph_input_names: Vec<String>,
    /// Leading program outputs sent to the next stage.
    pub n_send: usize,
    /// Last stage: the loss and the index of its output in `program.outputs`.
    pub loss: Option<(Loss, usize)>,
    pub recompute_full: bool,
    pub needs_data: bool,
}

pub(crate) fn specs(stages: &[StageModule], loss: &Loss) -> Result<Vec<StageSpec>, PipelineError> {
    let d = stages.len();
    let names = |p: &Program, slots: &[SlotId]| -> Vec<String> { slots.iter().map(|s| p.slots[s.index()].name.clone()).collect() };
    let mut out = Vec::new();
    for (k, s) in stages.iter().enumerate() {
        let p = &s.program;
        let ins = names(p, &p.inputs);
        let outs = names(p, &p.outputs);
        let prev_outs = if k > 0 { names(&stages[k - 1].program, &stages[k - 1].program.outputs) } else { Vec::new() };
        let next_ins = if k + 1 < d { names(&stages[k + 1].program, &stages[k + 1].program.inputs) } else { Vec::new() };
        let n_recv = ins.iter().take_while(|n| prev_outs.contains(n)).count();
        let n_send = outs.iter().take_while(|n| next_ins.contains(n)).count();
        if ins[n_recv..].iter().any(|n| prev_outs.contains(n)) || outs[n_send..].iter().any(|n| next_ins.contains(n)) {
            return Err(PipelineError::Config(format!("stage {k}: received inputs / sent outputs must come first in the program")));
        }
        if k + 1 < d {
            let nk = &stages[k + 1].program;
            let their = names(nk, &nk.inputs);
            let their_recv: Vec<&String> = their.iter().take_while(|n| outs.contains(n)).collect();
            let mine: Vec<&String> = outs[..n_send].iter().collect();
            if their_recv != mine {
                return Err(PipelineError::Config(format!("stage {k}: sends {mine:?} but stage {} receives {their_recv:?}", k + 1)));
            }
        }
        let loss = if k + 1 == d {
            let i = outs.iter().position(|n| n == loss.output()).ok_or_else(|| PipelineError::Stage {
                stage: k,
                message: format!("the loss reads output {:?}, which the last stage does not produce (outputs {outs:?})", loss.output()),
            })?;
            Some((loss.clone(), i))
        } else {
            None
        };
        let graph_input_names = ins[n_recv..].to_vec();
        out.push(StageSpec {
            index: k,
            program: p.clone(),
            n_recv,
            needs_data: !graph_input_names.is_empty() || loss.is_some(),
            graph_input_names,
            n_send,
            loss,
            recompute_full: s.header.params.recompute == Recompute::Full,
        });
    }
    Ok(out)
}

pub(crate) struct StageOut {
    pub weights: Vec<(String, Tensor)>,
    pub peak_versions: usize,
    pub trace: Vec<super::TraceEvent>,
}

/// A stage error; `induced` when it only reflects another stage (or the feeder) stopping.
pub(crate) struct Failure {
    pub error: PipelineError,
    pub induced: bool,
}

/// The forward state a backward needs.
struct Fwd {
    params: Vec<Tensor>,
    recv: Vec<Tensor>,
    outputs: Vec<Tensor>,
    loss: Option<Tensor>,
}

struct Stash {
    mb: u64,
    version: u64,
    /// Stage inputs (received then graph), kept for recomputation.
    inputs: Vec<Tensor>,
    labels: Option<Tensor>,
    fwd: Option<Fwd>,
}

struct Worker {
    spec: StageSpec,
    mode: Mode,
    last_use: Vec<Option<usize>>,
    /// Non-trainable stored tensors.
    constants: Vec<(SlotId, Tensor)>,
    param_slots: Vec<SlotId>,
}

pub(crate) fn run(
    spec: StageSpec,
    ops: Vec<Op>,
    m: usize,
    cfg: TrainConfig,
    data: Option<Receiver<StageData>>,
    mut tr: Box<dyn Transport>,
    events: Option<Sender<Event>>,
    epoch: Option<std::time::Instant>,
) -> Result<StageOut, Failure> {
    let k = spec.index;
    let mut rec = Recorder::new(epoch, k);
    let r = run_inner(spec, ops, m, &cfg, data, tr.as_mut(), events, &mut rec);
    if r.is_err() {
        tr.abort();
    }
    drop(tr);
    r.map_err(|e| match e {
        E::Msg(message) => Failure { error: PipelineError::Stage { stage: k, message }, induced: false },
        E::Induced(message) => Failure { error: PipelineError::Stage { stage: k, message }, induced: true },
        E::Err(error) => Failure { error, induced: false },
    })
}

enum E {
    Msg(String),
    Induced(String),
    Err(PipelineError),
}

fn induced(s: String) -> E {
    E::Induced(s)
}

fn torch(what: &str) -> impl Fn(tch::TchError) -> E + '_ {
    move |e| E::Msg(format!("{what}: {}", e.to_string().lines().next().unwrap_or("")))
}

fn run_inner(
    spec: StageSpec,
    ops: Vec<Op>,
    m: usize,
    cfg: &TrainConfig,
    data: Option<Receiver<StageData>>,
    tr: &mut dyn Transport,
    events: Option<Sender<Event>>,
    rec: &mut Recorder,
) -> Result<StageOut, E> {
    let k = spec.index;
    tch::manual_seed(cfg.seed.wrapping_add(k as i64));
    let dev = cfg.device;
    let p = &spec.program;
    let mut constants = Vec::new();
    let mut params = Vec::new();
    let mut param_slots = Vec::new();
    for s in &p.stored {
        let name = &p.slots[s.slot.index()].name;
        let t = tensor_from_bytes(s.elem, &s.dims, &s.bytes).map_err(|e| E::Msg(format!("stored tensor {name:?}: {e}")))?;
        let t = t.f_to_device(dev).map_err(torch("moving weights"))?;
        if s.trainable {
            params.push(t);
            param_slots.push(s.slot);
        } else {
            constants.push((s.slot, t));
        }
    }
    let total = ops.iter().filter(|o| matches!(o, Op::Forward(_))).count() as u64;
    let w = Worker { last_use: p.last_uses(), mode: cfg.mode, constants, param_slots, spec };
    let m64 = m as u64;
    let mut versions: BTreeMap<u64, Vec<Tensor>> = BTreeMap::new();
    versions.insert(0, params);
    let mut peak = 1usize;
    let mut opt = OptState::new(cfg.optimizer, w.param_slots.len());
    let mut stash: VecDeque<Stash> = VecDeque::new();
    let mut acc: Option<Vec<Tensor>> = None;
    let mut fwd_done = 0u64;
    let (mut batch_loss, mut batch_samples) = (0.0f64, 0usize);
    for op in ops {
        match op {
            Op::Forward(j) => {
                let v = cfg.schedule.version_for(j, m64);
                let wts = versions.get(&v).ok_or_else(|| E::Msg(format!("weight version {v} for microbatch {j} is gone")))?;
                let mut inputs = Vec::new();
                let step = j / m64;
                if w.spec.n_recv > 0 {
                    let t0 = rec.start();
                    let got = tr.recv_forward(j).map_err(induced)?;
                    rec.record(TraceKind::Recv, t0, Some(j), v, step);
                    inputs.extend(got.into_iter().map(|(_, t)| t));
                }
                let mut labels = None;
                if let Some(rx) = &data {
                    let sd = rx.recv().map_err(|_| E::Induced("the data feed stopped".into()))?;
                    if sd.mb != j {
                        return Err(E::Msg(format!("data for microbatch {} arrived when {j} was expected", sd.mb)));
                    }
                    for x in sd.inputs {
                        inputs.push(x.f_to_device(dev).map_err(torch("moving inputs"))?);
                    }
                    labels = sd.labels.map(|l| l.to_device(dev));
                    batch_samples += sd.samples;
                }
                let grad = !w.spec.recompute_full;
                let t0 = rec.start();
                let fwd = w.forward(wts, &inputs, labels.as_ref(), grad)?;
                // Reading the loss synchronizes with the device, so it counts as forward.
                let loss_value = match &fwd.loss {
                    Some(l) => Some(l.f_double_value(&[]).map_err(torch("reading the loss"))?),
                    None => None,
                };
                rec.record(TraceKind::Forward, t0, Some(j), v, step);
                if w.spec.n_send > 0 {
                    let t0 = rec.start();
                    let names = w.output_names();
                    let sent = fwd.outputs[..w.spec.n_send].iter().zip(names).map(|(t, n)| (n, t.detach())).collect();
                    tr.send_forward(j, sent).map_err(induced)?;
                    rec.record(TraceKind::Send, t0, Some(j), v, step);
                }
                if let Some(value) = loss_value {
                    if !value.is_finite() {
                        return Err(E::Err(PipelineError::NonFiniteLoss { step: (j / m64) as usize, stage: k, value }));
                    }
                    batch_loss += value;
                }
                stash.push_back(Stash { mb: j, version: v, inputs, labels, fwd: grad.then_some(fwd) });
                fwd_done += 1;
            }
            Op::Backward(j) => {
                let s = stash.pop_front().ok_or_else(|| E::Msg(format!("backward of microbatch {j} without its forward")))?;
                if s.mb != j {
                    return Err(E::Msg(format!("backward of microbatch {j}, but {} is the oldest stashed", s.mb)));
                }
                let (v, step) = (s.version, j / m64);
                let fwd = match s.fwd {
                    Some(f) => f,
                    None => {
                        let t0 = rec.start();
                        let wts = versions.get(&s.version).ok_or_else(|| E::Msg(format!("weight version {} for microbatch {j} is gone", s.version)))?;
                        let f = w.forward(wts, &s.inputs, s.labels.as_ref(), true)?;
                        rec.record(TraceKind::Recompute, t0, Some(j), v, step);
                        f
                    }
                };
                let out_grads = if w.spec.n_send > 0 {
                    let t0 = rec.start();
                    let g = tr.recv_backward(j).map_err(induced)?;
                    rec.record(TraceKind::Recv, t0, Some(j), v, step);
                    Some(g)
                } else {
                    None
                };
                let t0 = rec.start();
                let (pg, ig) = w.backward(&fwd, out_grads)?;
                drop(fwd);
                tch::no_grad(|| {
                    acc = Some(match acc.take() {
                        None => pg,
                        Some(a) => a.iter().zip(&pg).map(|(a, g)| a + g).collect(),
                    });
                });
                rec.record(TraceKind::Backward, t0, Some(j), v, step);
                if w.spec.n_recv > 0 {
                    let t0 = rec.start();
                    let names = w.input_names();
                    tr.send_backward(j, names.into_iter().zip(ig).collect()).map_err(induced)?;
                    rec.record(TraceKind::Send, t0, Some(j), v, step);
                }
            }
            Op::Step(t) => {
                let t0 = rec.start();
                let grads = acc.take().ok_or_else(|| E::Msg(format!("step {t} without gradients")))?;
                let mut grads: Vec<Tensor> = tch::no_grad(|| grads.iter().map(|g| g / m as f64).collect());
                if let Some(clip) = cfg.clip_norm {
                    let mut local = 0.0;
                    for g in &grads {
                        local += g.f_square().and_then(|x| x.f_sum(Kind::Double)).and_then(|x| x.f_double_value(&[])).map_err(torch("gradient norm"))?;
                    }
                    let norm = tr.all_reduce_sum(local).map_err(induced)?.sqrt();
                    let coef = clip / (norm + 1e-6);
                    if coef < 1.0 {
                        grads = tch::no_grad(|| grads.iter().map(|g| g * coef).collect());
                    }
                }
                let lr = cfg.lr_schedule.at(cfg.lr, t as usize);
                let (&newest, cur) = versions.iter().next_back().ok_or_else(|| E::Msg("no weights".into()))?;
                if newest != t {
                    return Err(E::Msg(format!("step {t} found newest weight version {newest}")));
                }
                let new = opt.step(cur, &grads, lr);
                versions.insert(t + 1, new);
                rec.record(TraceKind::Optimizer, t0, None, t + 1, t);
                if let Some(ev) = &events {
                    let _ = ev.send(Event::Step { step: t as usize, loss: batch_loss / m as f64, samples: batch_samples });
                }
                batch_loss = 0.0;
                batch_samples = 0;
            }
        }
        // Keep the newest version, the one the next forward uses, and those in flight.
        let newest = *versions.keys().next_back().unwrap();
        let next_v = (fwd_done < total).then(|| cfg.schedule.version_for(fwd_done, m64));
        versions.retain(|v, _| *v == newest || Some(*v) == next_v || stash.iter().any(|s| s.version == *v));
        peak = peak.max(versions.len());
    }
    let (_, last) = versions.into_iter().next_back().unwrap();
    let weights = w.param_slots.iter().zip(last).map(|(s, t)| (w.spec.program.slots[s.index()].name.clone(), t)).collect();
    Ok(StageOut { weights, peak_versions: peak, trace: std::mem::take(&mut rec.events) })
}

impl Worker {
    fn output_names(&self) -> Vec<String> {
        let p = &self.spec.program;
        p.outputs.iter().map(|s| p.slots[s.index()].name.clone()).collect()
    }

    fn input_names(&self) -> Vec<String> {
        let p = &self.spec.program;
        p.inputs[..self.spec.n_recv].iter().map(|s| p.slots[s.index()].name.clone()).collect()
    }

    /// Runs the program with weights `wts`; with `grad`, received activations and weights
    /// become leaves that require gradients, otherwise nothing records a graph.
    fn forward(&self, wts: &[Tensor], inputs: &[Tensor], labels: Option<&Tensor>, grad: bool) -> Result<Fwd, E> {
        let body = || -> Result<Fwd, E> {
            let leaf = |t: &Tensor| if grad && t.is_floating_point() { t.detach().set_requires_grad(true) } else { t.detach() };
            let recv: Vec<Tensor> = inputs[..self.spec.n_recv].iter().map(leaf).collect();
            let params: Vec<Tensor> = wts.iter().map(leaf).collect();
            let mut all: Vec<Tensor> = recv.iter().map(|t| t.shallow_clone()).collect();
            all.extend(inputs[self.spec.n_recv..].iter().map(|t| t.shallow_clone()));
            let outputs = self.execute(&params, &all)?;
            let loss = match &self.spec.loss {
                Some((l, i)) => Some(loss_of(l, &outputs[*i], labels).map_err(|e| E::Msg(format!("loss: {e}")))?),
                None => None,
            };
            Ok(Fwd { params, recv, outputs, loss })
        };
        if grad {
            body()
        } else {
            tch::no_grad(body)
        }
    }

    fn execute(&self, params: &[Tensor], inputs: &[Tensor]) -> Result<Vec<Tensor>, E> {
        let p = &self.spec.program;
        let mut slots: Vec<Option<Tensor>> = (0..p.slots.len()).map(|_| None).collect();
        for (s, t) in &self.constants {
            slots[s.index()] = Some(t.shallow_clone());
        }
        for (s, t) in self.param_slots.iter().zip(params) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        if inputs.len() != p.inputs.len() {
            return Err(E::Msg(format!("the program takes {} inputs, {} were given", p.inputs.len(), inputs.len())));
        }
        for (s, t) in p.inputs.iter().zip(inputs) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        let unset = |s: SlotId| E::Msg(format!("slot {s} ({:?}) is read before it is written", p.slots[s.index()].name));
        for (i, ins) in p.instrs.iter().enumerate() {
            let outs = {
                let args: Vec<Option<&Tensor>> = ins
                    .inputs
                    .iter()
                    .map(|s| s.map(|s| slots[s.index()].as_ref().ok_or_else(|| unset(s))).transpose())
                    .collect::<Result<_, _>>()?;
                run_kernel(&ins.kernel, &args, self.mode).map_err(|e| E::Msg(format!("node {:?}: {e}", ins.name)))?
            };
            if outs.len() < ins.outputs.len() {
                return Err(E::Msg(format!("node {:?}: produced {} outputs, expected {}", ins.name, outs.len(), ins.outputs.len())));
            }
            for (slot, t) in ins.outputs.iter().zip(outs) {
                if let Some(s) = slot {
                    slots[s.index()] = Some(t);
                }
            }
            for s in ins.inputs.iter().flatten() {
                if self.last_use[s.index()] == Some(i) && !p.outputs.contains(s) {
                    slots[s.index()] = None;
                }
            }
        }
        p.outputs.iter().map(|s| slots[s.index()].as_ref().map(|t| t.shallow_clone()).ok_or_else(|| unset(*s))).collect()
    }

    /// Weight gradients and received-input gradients (zeros where nothing flows).
    fn backward(&self, f: &Fwd, out_grads: Option<super::Named>) -> Result<(Vec<Tensor>, Vec<Tensor>), E> {
        let mut terms: Vec<Tensor> = Vec::new();
        if let Some(l) = &f.loss {
            if l.requires_grad() {
                terms.push(l.to_kind(Kind::Double));
            }
        }
        if let Some(gs) = out_grads {
            if gs.len() != self.spec.n_send {
                return Err(E::Msg(format!("received {} output gradients, expected {}", gs.len(), self.spec.n_send)));
            }
            for (o, (_, g)) in f.outputs.iter().zip(gs) {
                if o.requires_grad() {
                    let g = g.to_device(o.device());
                    terms.push((o * g).f_sum(Kind::Double).map_err(torch("output gradient"))?);
                }
            }
        }
        let targets: Vec<&Tensor> = f.params.iter().chain(f.recv.iter().filter(|t| t.requires_grad())).collect();
        let zeros = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.zeros_like()).collect() };
        if terms.is_empty() || targets.is_empty() {
            return Ok((zeros(&f.params), zeros(&f.recv)));
        }
        let root = terms.into_iter().reduce(|a, b| a + b).unwrap();
        let grads = Tensor::f_run_backward(&[root], &targets, false, false).map_err(torch("backward"))?;
        let mut it = grads.into_iter();
        let fix = |g: Option<Tensor>, t: &Tensor| match g {
            Some(g) if g.defined() => g,
            _ => t.zeros_like(),
        };
        let pg: Vec<Tensor> = f.params.iter().map(|t| fix(it.next(), t)).collect();
        let ig: Vec<Tensor> = f.recv.iter().map(|t| if t.requires_grad() { fix(it.next(), t) } else { t.zeros_like() }).collect();
        Ok((pg, ig))
    }
}

fn loss_of(l: &Loss, out: &Tensor, labels: Option<&Tensor>) -> Result<Tensor, String> {
    let need = || labels.ok_or_else(|| "the microbatch has no labels".to_string());
    let r = match l {
        Loss::Output(_) => {
            if out.numel() != 1 {
                return Err(format!("loss output has shape {:?}, expected a scalar", out.size()));
            }
            Ok(out.reshape([] as [i64; 0]))
        }
        Loss::Mse { .. } => {
            let y = need()?;
            (|| (out - y.f_to_kind(out.kind())?).f_square()?.f_mean(out.kind()))()
        }
        Loss::CrossEntropy { .. } => {
            let y = need()?;
            let c = *out.size().last().ok_or("logits are a scalar")?;
            (|| {
                let lp = out.f_reshape([-1, c])?.f_log_softmax(-1, out.kind())?;
                let y = y.f_to_kind(Kind::Int64)?.f_reshape([-1, 1])?;
                lp.f_gather(1, &y, false)?.f_neg()?.f_mean(out.kind())
            })()
        }
    };
    r.map_err(|e: tch::TchError| e.to_string().lines().next().unwrap_or("").to_string())
}
