//! Reductions (the ten Reduce kinds with axes attribute or input, keepdims and
//! noop_with_empty_axes) and ArgMax/ArgMin with select_last_index.

use tch::{Kind, Tensor};

use super::util::{dim, ints, is_int_kind, kind, norm_axes, norm_axis, opt, R};
use pipewright_ops::op::{Reduce, ReduceKind};

/// A Reduce kernel. Empty or absent axes reduce everything unless noop_with_empty_axes,
/// in which case no axis is reduced (the elementwise part, e.g. the square of SumSquare,
/// still applies, as in the ONNX reference).
pub(crate) fn reduce(r: &Reduce, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = super::util::need(ins, 0)?;
    let axes = match (&r.axes, opt(ins, 1)) {
        (Some(a), _) => a.clone(),
        (None, Some(t)) => ints(t)?,
        (None, None) => Vec::new(),
    };
    let dims = match (axes.is_empty(), r.noop_with_empty_axes) {
        (true, true) => Vec::new(),
        (true, false) => (0..x.dim() as i64).collect(),
        (false, _) => norm_axes(&axes, x.dim())?,
    };
    let k = kind(x)?;
    let y = reduce_dims(r.kind, x, &dims, r.keepdims)?;
    Ok(if kind(&y)? == k { y } else { y.f_to_kind(k)? })
}

fn reduce_dims(kind_: ReduceKind, x: &Tensor, dims: &[i64], keep: bool) -> R<Tensor> {
    use ReduceKind::*;
    Ok(match kind_ {
        Sum => sum(x, dims, keep)?,
        Mean => mean(x, dims, keep)?,
        Max | Min if dims.is_empty() => x.shallow_clone(),
        Max | Min if dims.iter().any(|&d| dim(x, d) == 0) => empty_extreme(x, dims, keep, kind_ == Max)?,
        Max => x.f_amax(dims, keep)?,
        Min => x.f_amin(dims, keep)?,
        Prod => prod(x, dims, keep)?,
        L1 => sum(&x.f_abs()?, dims, keep)?,
        L2 => sum(&x.f_mul(x)?, dims, keep)?.f_sqrt()?,
        LogSum => sum(x, dims, keep)?.f_log()?,
        LogSumExp if dims.is_empty() => x.shallow_clone(),
        LogSumExp => x.f_logsumexp(dims, keep)?,
        SumSquare => sum(&x.f_mul(x)?, dims, keep)?,
    })
}

/// Max/Min over an empty set: the identity of the reduction (-inf for Max, +inf for Min;
/// the type's limits for integers, false/true for bool), as the ONNX reference defines.
fn empty_extreme(x: &Tensor, dims: &[i64], keep: bool, max: bool) -> R<Tensor> {
    let k = kind(x)?;
    let shape: Vec<i64> = (0..x.dim() as i64)
        .filter_map(|d| if dims.contains(&d) { keep.then_some(1) } else { Some(dim(x, d)) })
        .collect();
    let fill = match k {
        Kind::Bool => if max { 0.0 } else { 1.0 },
        Kind::Int64 => if max { i64::MIN as f64 } else { i64::MAX as f64 },
        Kind::Int => if max { i32::MIN as f64 } else { i32::MAX as f64 },
        _ => if max { f64::NEG_INFINITY } else { f64::INFINITY },
    };
    Ok(Tensor::f_full(&shape, fill, (k, x.device()))?)
}

fn sum(x: &Tensor, dims: &[i64], keep: bool) -> R<Tensor> {
    if dims.is_empty() {
        return Ok(x.shallow_clone());
    }
    Ok(x.f_sum_dim_intlist(dims, keep, kind(x)?)?)
}

fn mean(x: &Tensor, dims: &[i64], keep: bool) -> R<Tensor> {
    if dims.is_empty() {
        return Ok(x.shallow_clone());
    }
    if !is_int_kind(kind(x)?) {
        return Ok(x.f_mean_dim(dims, keep, None)?);
    }
    let count: i64 = dims.iter().map(|&d| dim(x, d)).product();
    Ok(sum(x, dims, keep)?.f_div_scalar_mode(count.max(1), "trunc")?)
}

fn prod(x: &Tensor, dims: &[i64], keep: bool) -> R<Tensor> {
    let mut y = x.shallow_clone();
    for &d in dims.iter().rev() {
        y = y.f_prod_dim_int(d, keep, kind(x)?)?;
    }
    Ok(y)
}

/// ArgMax / ArgMin along `axis` (i64 output); ties go to the first index, or the last
/// with select_last_index.
pub(crate) fn arg(x: &Tensor, axis: i64, keepdims: bool, last: bool, max: bool) -> R<Tensor> {
    let a = norm_axis(axis, x.dim())?;
    let t = if last {
        x.f_flip([a])?
    } else {
        x.shallow_clone()
    };
    let i = if max {
        t.f_argmax(a, keepdims)?
    } else {
        t.f_argmin(a, keepdims)?
    };
    if !last {
        return Ok(i);
    }
    Ok(i.f_neg()?
        .f_add_scalar(dim(x, a) - 1)?
        .f_to_kind(Kind::Int64)?)
}
