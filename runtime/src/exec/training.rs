//! Ops of ONNX's other domains: the optimizer steps of `ai.onnx.preview.training`
//! (Adagrad, Adam, Momentum), and Binarizer and ArrayFeatureExtractor of `ai.onnx.ml`.
//!
//! The optimizer steps are elementwise formulas over libtorch ops (so a graph that
//! differentiates through them still can); the learning rate `R` and update count `T`
//! are scalars read at run time.

use tch::{Kind, Tensor};

use super::util::{invalid, need, scalar_f64, R};
use pipewright_ops::op::{OptimizerStep, TreeEnsemble};

/// One optimizer step over every tensor block: the new `X`s, then the new states.
pub(crate) fn optimizer_step(o: &OptimizerStep, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let states = if matches!(o, OptimizerStep::Adam { .. }) { 2 } else { 1 };
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
            OptimizerStep::Adagrad { decay_factor, epsilon, norm_coefficient } => {
                adagrad(r, t, x, g, block(2)?, decay_factor as f64, epsilon as f64, norm_coefficient as f64)?
            }
            OptimizerStep::Adam { alpha, beta, epsilon, norm_coefficient, norm_coefficient_post } => {
                let coef = AdamCoef { alpha: alpha as f64, beta: beta as f64, epsilon: epsilon as f64, norm: norm_coefficient as f64, norm_post: norm_coefficient_post as f64 };
                adam(r, t, x, g, block(2)?, block(3)?, &coef)?
            }
            OptimizerStep::Momentum { alpha, beta, norm_coefficient, nesterov } => {
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
    if super::util::scalar_i64(&bad)? != 0 {
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

/// TreeEnsemble's tables as the walk reads them: per node the comparison and where each
/// branch goes (`(is_leaf, index)`).
struct Trees {
    nodes: Vec<TreeNode>,
    leaf_targets: Vec<i64>,
    leaf_weights: Vec<f64>,
}

struct TreeNode {
    feature: i64,
    /// 0 `<=`, 1 `<`, 2 `>=`, 3 `>`, 4 `==`, 5 `!=`, 6 member of `members`.
    mode: i64,
    split: f64,
    members: Vec<f64>,
    missing_true: bool,
    on_true: (bool, i64),
    on_false: (bool, i64),
}

/// Resolves the op's ONNX tables; each set-membership node takes the next NaN-terminated
/// run of `membership_values` (the importer checked the counts).
fn trees(t: &TreeEnsemble) -> Trees {
    let modes = t.modes.to_i64s();
    let splits = t.splits.to_f64s();
    let members = t.membership_values.as_ref().map(|m| m.to_f64s()).unwrap_or_default();
    let mut sets = members.split(|x| x.is_nan());
    let nodes = (0..t.featureids.len())
        .map(|i| TreeNode {
            feature: t.featureids[i],
            mode: modes[i],
            split: splits[i],
            members: if modes[i] == 6 { sets.next().unwrap_or_default().to_vec() } else { Vec::new() },
            missing_true: t.missing_tracks_true.get(i).is_some_and(|&m| m != 0),
            on_true: (t.trueleafs[i] != 0, t.truenodeids[i]),
            on_false: (t.falseleafs[i] != 0, t.falsenodeids[i]),
        })
        .collect();
    Trees { nodes, leaf_targets: t.leaf_targetids.clone(), leaf_weights: t.leaf_weights.to_f64s() }
}

/// TreeEnsemble: each row walks every tree to one leaf, whose weight goes to its target;
/// targets aggregate by sum, average over the trees, min or max (starting, as the
/// reference does, from 0 or the element type's extreme). Piecewise constant, so the
/// result carries no gradient; the walk runs on the host.
pub(crate) fn tree_ensemble(t: &TreeEnsemble, x: &Tensor) -> R<Tensor> {
    let s = x.size();
    let &[rows, features] = &s[..] else { return Err(invalid(format!("input {s:?} must be [N, features]"))) };
    let xs = Vec::<f64>::try_from(super::host::on_host(x)?.f_to_kind(Kind::Double)?.f_flatten(0, -1)?)?;
    let extreme = if x.kind() == Kind::Double { f64::MAX } else { f32::MAX as f64 };
    let init = match t.aggregate_function {
        2 => extreme,
        3 => -extreme,
        _ => 0.0,
    };
    let tables = trees(t);
    let targets = t.n_targets as usize;
    let mut out = vec![init; rows as usize * targets];
    for r in 0..rows as usize {
        let row = &xs[r * features as usize..(r + 1) * features as usize];
        for &root in &t.tree_roots {
            let leaf = walk(&tables, root, row)?;
            let (Some(&target), Some(&w)) = (tables.leaf_targets.get(leaf), tables.leaf_weights.get(leaf)) else {
                return Err(invalid(format!("leaf {leaf} does not exist")));
            };
            if !(0..t.n_targets).contains(&target) {
                return Err(invalid(format!("leaf target {target} is outside [0, {})", t.n_targets)));
            }
            let cell = &mut out[r * targets + target as usize];
            *cell = match t.aggregate_function {
                0 => *cell + w / t.tree_roots.len() as f64,
                2 => cell.min(w),
                3 => cell.max(w),
                _ => *cell + w,
            };
        }
    }
    Ok(Tensor::from_slice(&out).f_reshape([rows, t.n_targets])?.f_to_kind(x.kind())?.f_to_device(x.device())?)
}

/// The leaf one row reaches from `root`; a table that loops is an error.
fn walk(t: &Trees, root: i64, row: &[f64]) -> R<usize> {
    let mut at = root as usize;
    for _ in 0..=t.nodes.len() {
        let n = t.nodes.get(at).ok_or_else(|| invalid(format!("tree node {at} does not exist")))?;
        let v = *row.get(n.feature as usize).ok_or_else(|| invalid(format!("feature {} is out of range", n.feature)))?;
        let taken = (v.is_nan() && n.missing_true)
            || match n.mode {
                0 => v <= n.split,
                1 => v < n.split,
                2 => v >= n.split,
                3 => v > n.split,
                4 => v == n.split,
                5 => v != n.split,
                _ => n.members.contains(&v),
            };
        let (leaf, next) = if taken { n.on_true } else { n.on_false };
        if leaf {
            return Ok(next as usize);
        }
        at = next as usize;
    }
    Err(invalid("a tree's nodes form a cycle"))
}
