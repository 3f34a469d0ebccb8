//! Ops of ONNX's other domains: the optimizer steps of `ai.onnx.preview.training`
//! (Adagrad, Adam, Momentum), and Binarizer and ArrayFeatureExtractor of `ai.onnx.ml`.
//!
//! The optimizer steps are elementwise formulas over libtorch ops (so a graph that
//! differentiates through them still can); the learning rate `R` and update count `T`
//! are scalars read at run time.

use tch::{Kind, Tensor};

use super::util::{invalid, need, scalar_f64, R};
use crate::kernel::Optimizer;

/// One optimizer step over every tensor block: the new `X`s, then the new states.
pub(crate) fn optimizer_step(o: &Optimizer, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let states = if matches!(o, Optimizer::Adam { .. }) { 2 } else { 1 };
    let blocks = 2 + states;
    let n = ins.len().saturating_sub(2) / blocks;
    if n == 0 || ins.len() != 2 + blocks * n {
        return Err(invalid(format!("{} inputs are not R, T and {blocks} blocks of equally many tensors", ins.len())));
    }
    let (r, t) = (scalar_f64(need(ins, 0)?)?, scalar_f64(need(ins, 1)?)?);
    let mut outs: Vec<Vec<Tensor>> = (0..1 + states).map(|_| Vec::with_capacity(n)).collect();
    for i in 0..n {
        let block = |b: usize| need(ins, 2 + b * n + i);
        let (x, g) = (block(0)?, block(1)?);
        let step = match *o {
            Optimizer::Adagrad { decay_factor, epsilon, norm_coefficient } => {
                adagrad(r, t, x, g, block(2)?, decay_factor as f64, epsilon as f64, norm_coefficient as f64)?
            }
            Optimizer::Adam { alpha, beta, epsilon, norm_coefficient, norm_coefficient_post } => {
                let coef = AdamCoef { alpha: alpha as f64, beta: beta as f64, epsilon: epsilon as f64, norm: norm_coefficient as f64, norm_post: norm_coefficient_post as f64 };
                adam(r, t, x, g, block(2)?, block(3)?, &coef)?
            }
            Optimizer::Momentum { alpha, beta, norm_coefficient, nesterov } => {
                momentum(r, t, x, g, block(2)?, alpha as f64, beta as f64, norm_coefficient as f64, nesterov)?
            }
        };
        for (slot, v) in step.into_iter().enumerate() {
            outs[slot].push(v);
        }
    }
    Ok(outs.into_iter().flatten().collect())
}

/// `G + norm * X`: the gradient with that of `0.5 * norm * ||X||^2` added.
fn regularized(x: &Tensor, g: &Tensor, norm: f64) -> R<Tensor> {
    Ok(g.f_add(&x.f_mul_scalar(norm)?)?)
}

/// Adagrad: `H' = H + G_r^2`, `X' = X - r * G_r / (sqrt(H') + eps)` with the learning
/// rate decayed to `r = R / (1 + T * decay_factor)`.
#[allow(clippy::too_many_arguments)]
fn adagrad(r: f64, t: f64, x: &Tensor, g: &Tensor, h: &Tensor, decay: f64, eps: f64, norm: f64) -> R<Vec<Tensor>> {
    let rate = r / (1.0 + t * decay);
    let gr = regularized(x, g, norm)?;
    let h_new = h.f_add(&gr.f_square()?)?;
    let x_new = x.f_sub(&gr.f_div(&h_new.f_sqrt()?.f_add_scalar(eps)?)?.f_mul_scalar(rate)?)?;
    Ok(vec![x_new, h_new])
}

struct AdamCoef {
    alpha: f64,
    beta: f64,
    epsilon: f64,
    norm: f64,
    norm_post: f64,
}

/// Adam: running averages `V` (of G_r) and `H` (of G_r^2), a bias-corrected rate after
/// the first update (`T > 0`), and the optional post-update decay of `X`.
fn adam(r: f64, t: f64, x: &Tensor, g: &Tensor, v: &Tensor, h: &Tensor, c: &AdamCoef) -> R<Vec<Tensor>> {
    let gr = regularized(x, g, c.norm)?;
    let v_new = v.f_mul_scalar(c.alpha)?.f_add(&gr.f_mul_scalar(1.0 - c.alpha)?)?;
    let h_new = h.f_mul_scalar(c.beta)?.f_add(&gr.f_square()?.f_mul_scalar(1.0 - c.beta)?)?;
    let rate = if t > 0.0 { r * (1.0 - c.beta.powf(t)).sqrt() / (1.0 - c.alpha.powf(t)) } else { r };
    let x_new = x.f_sub(&v_new.f_div(&h_new.f_sqrt()?.f_add_scalar(c.epsilon)?)?.f_mul_scalar(rate)?)?;
    Ok(vec![x_new.f_mul_scalar(1.0 - c.norm_post)?, v_new, h_new])
}

/// Momentum: `V' = alpha * V + beta' * G_r` (`beta' = 1` at the first update, `T = 0`),
/// `X' = X - R * V'` (standard) or `X - R * (G_r + alpha * V')` (Nesterov).
#[allow(clippy::too_many_arguments)]
fn momentum(r: f64, t: f64, x: &Tensor, g: &Tensor, v: &Tensor, alpha: f64, beta: f64, norm: f64, nesterov: bool) -> R<Vec<Tensor>> {
    let gr = regularized(x, g, norm)?;
    let beta = if t > 0.0 { beta } else { 1.0 };
    let v_new = v.f_mul_scalar(alpha)?.f_add(&gr.f_mul_scalar(beta)?)?;
    let direction = if nesterov { gr.f_add(&v_new.f_mul_scalar(alpha)?)? } else { v_new.shallow_clone() };
    Ok(vec![x.f_sub(&direction.f_mul_scalar(r)?)?, v_new])
}

/// Binarizer: `x > threshold` as 1 or 0 in the input's type.
pub(crate) fn binarizer(threshold: f32, x: &Tensor) -> R<Tensor> {
    Ok(x.f_gt(threshold as f64)?.f_to_kind(x.kind())?)
}

/// ArrayFeatureExtractor: the elements at the (flattened) indices along the last axis;
/// 1-D data gives `[1, m]`.
pub(crate) fn array_feature_extractor(x: &Tensor, idx: &Tensor) -> R<Tensor> {
    let last = *x.size().last().ok_or_else(|| invalid("the data must have at least one axis"))?;
    let flat = idx.f_flatten(0, -1)?.f_to_kind(Kind::Int64)?;
    let bad = flat.f_lt(0)?.f_logical_or(&flat.f_ge(last)?)?.f_any()?;
    if bad.int64_value(&[]) != 0 {
        return Err(invalid(format!("an index is outside [0, {last})")));
    }
    let picked = x.f_index_select(-1, &flat)?;
    let mut shape = x.size();
    if shape.len() == 1 {
        shape = vec![1];
    } else {
        shape.pop();
    }
    shape.push(flat.size()[0]);
    Ok(picked.f_reshape(shape.as_slice())?)
}
