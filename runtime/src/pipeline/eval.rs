//! Evaluation during training: the loss (and accuracy, for cross-entropy) of a held-out
//! set under the newest weights, while training goes on.
//!
//! At a step the run evaluates after, every stage of replica 0 sends a snapshot of its
//! newest weights and running statistics (versions are never changed in place, so the
//! snapshot is a set of handles) to the caller's thread, where an [`Evaluator`] runs the
//! stages' programs in turn, forward only, in inference mode (Dropout off,
//! BatchNormalization on its running statistics) over the evaluation microbatches. The
//! training workers never wait for it, nothing of theirs changes (no update, no weight
//! version, no statistics, no data drawn), so an evaluated run trains, checkpoints and
//! resumes exactly as one without evaluation. Under 2BW the snapshot is the version the
//! step's update made, the newest weights, which the next step's microbatches begin to use.

use tch::{Kind, Tensor};

use super::stage::{StageSpec, Worker, E};
use super::{Microbatch, Mode, PipelineError, TrainConfig};

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
    workers: Vec<Worker>,
    /// Each stage's device (its replica-0 worker's, where its snapshots live).
    devices: Vec<tch::Device>,
    microbatches: Vec<Microbatch>,
}

impl Evaluator {
    pub(crate) fn new(specs: &[StageSpec], cfg: &TrainConfig, set: EvalSet) -> Result<Evaluator, PipelineError> {
        let devices: Vec<tch::Device> = specs.iter().map(|s| cfg.worker_device(s.index, 0)).collect();
        let workers = specs
            .iter()
            .map(|s| {
                let placed = TrainConfig { mode: Mode::Eval, device: devices[s.index], ..cfg.clone() };
                Worker::load(s.clone(), &placed).map(|(w, _)| w).map_err(|e| failed(s.index, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if set.microbatches.is_empty() {
            return Err(PipelineError::Data("the evaluation set holds no microbatch".into()));
        }
        Ok(Evaluator { workers, devices, microbatches: set.microbatches })
    }

    /// The evaluation set's loss and accuracy under `snaps` (one per stage, in order).
    pub(crate) fn run(&mut self, snaps: Vec<Snapshot>) -> Result<EvalResult, PipelineError> {
        for (w, snap) in self.workers.iter_mut().zip(&snaps) {
            w.set_stats(snap.stats.iter().map(Tensor::shallow_clone).collect());
        }
        let (mut loss, mut correct, mut counted, mut samples) = (0.0, 0.0, 0.0, 0);
        for mb in &self.microbatches {
            let (l, right) = through_stages(&mut self.workers, &self.devices, mb, &snaps)?;
            loss += l;
            if let Some((c, n)) = right {
                correct += c;
                counted += n;
            }
            samples += mb.inputs.first().map_or(0, |(_, x)| x.size().first().copied().unwrap_or(1) as usize);
        }
        let n = self.microbatches.len() as f64;
        Ok(EvalResult { loss: loss / n, accuracy: (counted > 0.0).then(|| correct / counted), samples })
    }
}

/// One microbatch through every stage (`workers` on `devices`, with the weights of
/// `snaps`): its loss and, for cross-entropy, (correct, counted).
fn through_stages(workers: &mut [Worker], devices: &[tch::Device], mb: &Microbatch, snaps: &[Snapshot]) -> Result<(f64, Option<(f64, f64)>), PipelineError> {
    let mut carried: Vec<Tensor> = Vec::new();
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
                (pipewright_core::Loss::CrossEntropy, Some(y)) => Some(hits(&fwd.outputs[*out], y, objective.ignore_index).map_err(|e| torch_failed(k, "counting hits", e))?),
                _ => None,
            };
            return Ok((value, right));
        }
        carried = fwd.outputs[..w.spec().n_send].iter().map(Tensor::shallow_clone).collect();
    }
    Err(PipelineError::Data("no stage computes the loss".into()))
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
