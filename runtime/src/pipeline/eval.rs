//! Evaluation during training: the loss (and accuracy, for cross-entropy) of a held-out
//! set under the newest weights, while training goes on.
//!
//! At a step the run evaluates after, every stage of replica 0 sends a snapshot of its
//! newest weights and running statistics (versions are never changed in place, so the
//! snapshot is a set of handles) to the thread that handles its events, where an
//! [`Evaluator`] runs the stages' programs in turn, forward only, in inference mode
//! (Dropout off, BatchNormalization on its running statistics) over the evaluation
//! microbatches. The training workers never wait for it, nothing of theirs changes (no
//! update, no weight version, no statistics, no data drawn), so an evaluated run trains,
//! checkpoints and resumes exactly as one without evaluation. Under 2BW the snapshot is
//! the version the step's update made, the newest weights, which the next step's
//! microbatches begin to use.
//!
//! The embedded executor's evaluator holds every stage. A worker process holds one: its
//! evaluator receives each evaluation microbatch's activations from the previous stage's
//! process over an [`EvalLink`] and sends its own to the next, so the evaluation runs
//! through the pipeline as the forwards of training do, and the last stage's process, the
//! one that reports the job's steps, holds the result. Each process evaluates once its
//! own stage has finished the step, so the weights are those of the same step everywhere.

use tch::{Kind, Tensor};

use super::stage::{StageSpec, Worker, E};
use super::transport::Named;
use super::{Microbatch, Mode, PipelineError, TrainConfig};

/// A worker process's evaluation link to the processes of the neighbouring stages
/// (replica 0's): the activations of evaluation microbatch `index` of each evaluation,
/// apart from the training's messages. Errors are messages; no wait lasts forever.
pub trait EvalLink: Send {
    /// Sends the activations of evaluation microbatch `index` to the next stage.
    fn send_activations(&mut self, index: u64, tensors: Named) -> Result<(), String>;
    /// Receives the activations of evaluation microbatch `index` from the previous stage.
    fn recv_activations(&mut self, index: u64) -> Result<Named, String>;
}

/// The held-out microbatches a run evaluates on, and how often.
pub struct EvalSet {
    pub microbatches: Vec<Microbatch>,
}

/// What one evaluation measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalResult {
    /// The mean of the microbatches' losses (as training computes a step's loss).
    pub loss: f64,
    /// Cross-entropy: the fraction of labels (those not ignored) whose class scored highest.
    pub accuracy: Option<f64>,
    pub samples: usize,
}

/// One stage's weights and running statistics after a step, as its worker sent them.
pub(crate) struct Snapshot {
    pub weights: Vec<Tensor>,
    pub stats: Vec<Tensor>,
}

/// The stages' programs loaded for inference, and the evaluation set.
pub(crate) struct Evaluator {
    /// The stages this process holds, in order: every stage, or (a worker process) one.
    workers: Vec<Worker>,
    /// Each stage's device (its replica-0 worker's, where its snapshots live).
    devices: Vec<tch::Device>,
    microbatches: Vec<Microbatch>,
    /// To the stages before and after this process's (a worker process).
    link: Option<Box<dyn EvalLink>>,
}

/// Where one evaluation microbatch's forward through this process's stages ended.
enum Reached {
    /// The loss and, for cross-entropy, (correct, counted).
    Loss(f64, Option<(f64, f64)>),
    /// The last stage here sends on these activations.
    Boundary(Named),
}

impl Evaluator {
    /// Every stage's evaluator (the embedded executor).
    pub(crate) fn new(specs: &[StageSpec], cfg: &TrainConfig, set: EvalSet) -> Result<Evaluator, PipelineError> {
        Self::of(specs, cfg, set, None)
    }

    /// A worker process's evaluator of stage `spec`, linked to its neighbours' by `link`.
    pub(crate) fn for_stage(spec: &StageSpec, cfg: &TrainConfig, set: EvalSet, link: Box<dyn EvalLink>) -> Result<Evaluator, PipelineError> {
        Self::of(std::slice::from_ref(spec), cfg, set, Some(link))
    }

    fn of(specs: &[StageSpec], cfg: &TrainConfig, set: EvalSet, link: Option<Box<dyn EvalLink>>) -> Result<Evaluator, PipelineError> {
        let devices: Vec<tch::Device> = specs.iter().map(|s| cfg.worker_device(specs.len(), s.index, 0)).collect();
        let workers = specs
            .iter()
            .map(|s| {
                let placed = TrainConfig { mode: Mode::Eval, device: cfg.worker_device(specs.len(), s.index, 0), ..cfg.clone() };
                Worker::load(s.clone(), &placed).map(|(w, _)| w).map_err(|e| failed(s.index, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if set.microbatches.is_empty() {
            return Err(PipelineError::Data("the evaluation set holds no microbatch".into()));
        }
        Ok(Evaluator { workers, devices, microbatches: set.microbatches, link })
    }

    /// The evaluation set's loss and accuracy under `snaps` (one per stage held here, in
    /// order); `None` in a process whose stage does not compute the loss.
    pub(crate) fn run(&mut self, snaps: Vec<Snapshot>) -> Result<Option<EvalResult>, PipelineError> {
        for (w, snap) in self.workers.iter_mut().zip(&snaps) {
            w.set_stats(snap.stats.iter().map(Tensor::shallow_clone).collect());
        }
        let first = self.workers.first().map_or(0, |w| w.spec().index);
        let (mut loss, mut correct, mut counted, mut samples, mut reached) = (0.0, 0.0, 0.0, 0, false);
        for (i, mb) in self.microbatches.iter().enumerate() {
            let carried = match &mut self.link {
                Some(link) if first > 0 => link.recv_activations(i as u64).map_err(|e| failed(first, E::Msg(e)))?.into_iter().map(|(_, t)| t).collect(),
                _ => Vec::new(),
            };
            match through_stages(&mut self.workers, &self.devices, mb, &snaps, carried)? {
                Reached::Loss(l, right) => {
                    loss += l;
                    if let Some((c, n)) = right {
                        correct += c;
                        counted += n;
                    }
                    reached = true;
                }
                Reached::Boundary(out) => {
                    let last = self.workers.last().map_or(0, |w| w.spec().index);
                    let link = self.link.as_mut().ok_or_else(|| PipelineError::Data("no stage computes the loss".into()))?;
                    link.send_activations(i as u64, out).map_err(|e| failed(last, E::Msg(e)))?;
                }
            }
            samples += mb.inputs.first().map_or(0, |(_, x)| x.size().first().copied().unwrap_or(1) as usize);
        }
        let n = self.microbatches.len() as f64;
        Ok(reached.then(|| EvalResult { loss: loss / n, accuracy: (counted > 0.0).then(|| correct / counted), samples }))
    }
}

/// One microbatch through the stages held here (`workers` on `devices`, with the weights
/// of `snaps`), the first given `carried` (the previous stage's activations, if any).
fn through_stages(workers: &mut [Worker], devices: &[tch::Device], mb: &Microbatch, snaps: &[Snapshot], carried: Vec<Tensor>) -> Result<Reached, PipelineError> {
    let mut carried = carried;
    let mut sent = Vec::new();
    for ((w, snap), &device) in workers.iter_mut().zip(snaps).zip(devices) {
        let k = w.spec().index;
        let mut inputs = Vec::new();
        for t in carried.drain(..).chain(graph_inputs(w.spec(), mb)?) {
            inputs.push(t.f_to_device(device).map_err(|e| torch_failed(k, "moving inputs", e))?);
        }
        w.specialise_for(&inputs, device).map_err(|e| failed(k, e))?;
        let labels = match (&w.spec().loss, &mb.labels) {
            (Some(_), Some(l)) => Some(l.f_to_device(device).map_err(|e| torch_failed(k, "moving labels", e))?),
            _ => None,
        };
        let (fwd, _) = w.forward(&snap.weights, &inputs, labels.as_ref(), false, false).map_err(|e| failed(k, e))?;
        if let (Some(loss), Some((objective, out))) = (&fwd.loss, &w.spec().loss) {
            let value = loss.f_double_value(&[]).map_err(|e| torch_failed(k, "reading the loss", e))?;
            let right = match (objective.loss, &labels) {
                (pipewright_core::Loss::CrossEntropy, Some(y)) => {
                    let y = super::stage::labels_along(y, w.spec().label_axis).map_err(|e| failed(k, E::Msg(e)))?;
                    Some(hits(&fwd.outputs[*out], &y, objective.ignore_index).map_err(|e| torch_failed(k, "counting hits", e))?)
                }
                _ => None,
            };
            return Ok(Reached::Loss(value, right));
        }
        let n_send = w.spec().n_send;
        carried = fwd.outputs[..n_send].iter().map(Tensor::shallow_clone).collect();
        sent = w.output_names().into_iter().take(n_send).collect();
    }
    Ok(Reached::Boundary(sent.into_iter().zip(carried).collect()))
}

/// Stage `spec`'s graph inputs from the microbatch, by name.
fn graph_inputs(spec: &StageSpec, mb: &Microbatch) -> Result<Vec<Tensor>, PipelineError> {
    spec.graph_input_names
        .iter()
        .map(|name| {
            mb.inputs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.shallow_clone())
                .ok_or_else(|| PipelineError::Data(format!("the evaluation data lacks the model input {name:?} (stage {})", spec.index)))
        })
        .collect()
}

/// (labels whose class scored highest, labels counted), ignored labels left out.
fn hits(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<(f64, f64), tch::TchError> {
    let y = labels.f_to_kind(Kind::Int64)?.f_reshape([-1])?;
    let classes = logits.size().last().copied().unwrap_or(1);
    let predicted = logits.f_reshape([-1, classes])?.f_argmax(-1, false)?;
    let kept = y.f_ne(ignore_index)?;
    let right = predicted.f_eq_tensor(&y)?.f_logical_and(&kept)?;
    Ok((right.f_sum(Kind::Double)?.f_double_value(&[])?, kept.f_sum(Kind::Double)?.f_double_value(&[])?))
}

fn failed(stage: usize, e: E) -> PipelineError {
    let message = match e {
        E::Msg(m) | E::Induced(m) => m,
        E::Err(e) => return e,
    };
    PipelineError::Stage { stage, message: format!("evaluation: {message}") }
}

fn torch_failed(stage: usize, what: &str, e: tch::TchError) -> PipelineError {
    PipelineError::Stage { stage, message: format!("evaluation: {what}: {}", e.to_string().lines().next().unwrap_or("")) }
}
