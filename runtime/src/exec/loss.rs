//! The loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, through libtorch's
//! `nll_loss`, whose weighting, `ignore_index` and mean (divided by the summed weights of
//! the counted targets) are ONNX's.

use tch::{Kind, Reduction, Tensor};

use super::util::{invalid, R};
use pipewright_ops::op::{ClassLoss, LossReduction};

/// No target equals it: ONNX without `ignore_index` counts every target (and libtorch then
/// reports any target outside `[0, C)`).
const NO_IGNORED_TARGET: i64 = i64::MIN;

/// `-sum(weight[t] * logp[n, t, d...]) / (sum of weight[t] counted)` (or per element, or summed).
pub(crate) fn nll(l: &ClassLoss, logp: &Tensor, target: &Tensor, weight: Option<&Tensor>) -> R<Tensor> {
    if logp.dim() < 2 {
        return Err(invalid(format!("input {:?} has no class axis (it needs [N, C, ...])", logp.size())));
    }
    let reduction = match l.reduction {
        LossReduction::None => Reduction::None,
        LossReduction::Sum => Reduction::Sum,
        LossReduction::Mean => Reduction::Mean,
    };
    let target = target.f_to_kind(Kind::Int64)?;
    let weight = weight.map(|w| w.f_to_kind(logp.kind())).transpose()?;
    Ok(logp.f_nll_loss_nd(&target, weight.as_ref(), reduction, l.ignore_index.unwrap_or(NO_IGNORED_TARGET))?)
}

/// The loss of `log_softmax(scores, axis 1)` and the log-probabilities themselves.
pub(crate) fn softmax_cross_entropy(l: &ClassLoss, scores: &Tensor, target: &Tensor, weight: Option<&Tensor>) -> R<Vec<Tensor>> {
    if scores.dim() < 2 {
        return Err(invalid(format!("scores {:?} have no class axis (they need [N, C, ...])", scores.size())));
    }
    let logp = scores.f_log_softmax(1, None)?;
    Ok(vec![nll(l, &logp, target, weight)?, logp])
}
