//! Normalisation-like kernels beyond the common ones in `nn`: Hardmax, LpNormalization,
//! Shrink, LRN, MeanVarianceNormalization, GroupNormalization, and Det.

use tch::{Kind, Tensor};

use super::util::{invalid, is_float_kind, kind, need, norm_axes, norm_axis, pad_axis, R};
use pipewright_ops::op::{GroupNorm, Lrn, Softmax};

/// Hardmax: 1 at the first maximum along the axis, 0 elsewhere. Before opset 13 the input
/// is viewed as 2-D at the axis (which may then equal the rank) and the maximum is taken
/// over each trailing block.
pub(crate) fn hardmax(x: &Tensor, s: &Softmax) -> R<Tensor> {
    let hard = |t: &Tensor, d: i64| -> R<Tensor> {
        let at = t.f_argmax(d, true)?;
        Ok(t.f_zeros_like()?.f_scatter_value(d, &at, 1.0)?)
    };
    if !s.coerce_2d {
        return hard(x, norm_axis(s.axis, x.dim())?);
    }
    let shape = x.size();
    let axis = norm_axis(s.axis, x.dim() + 1)? as usize;
    let outer: i64 = shape[..axis].iter().product();
    let inner: i64 = shape[axis..].iter().product();
    Ok(hard(&x.f_reshape([outer, inner])?, 1)?.f_reshape(&shape)?)
}

/// LpNormalization: `x / ||x||_p` along the axis, `p` 1 or 2; an all-zero vector stays
/// zero (its norm is taken as 1, as the reference does) rather than becoming NaN.
pub(crate) fn lp_normalization(x: &Tensor, axis: i64, p: i64) -> R<Tensor> {
    let a = norm_axis(axis, x.dim())?;
    let norm = match p {
        1 => x.f_abs()?.f_sum_dim_intlist([a].as_slice(), true, None::<Kind>)?,
        2 => x.f_square()?.f_sum_dim_intlist([a].as_slice(), true, None::<Kind>)?.f_sqrt()?,
        _ => return Err(invalid(format!("p = {p} is not 1 or 2"))),
    };
    let safe = norm.f_ones_like()?.f_where_self(&norm.f_eq(0.0)?, &norm)?;
    Ok(x.f_div(&safe)?)
}

/// Shrink: `x + bias` below `-lambd`, `x - bias` above `lambd`, 0 between; the input's
/// element type is kept (integer inputs included).
pub(crate) fn shrink(x: &Tensor, bias: f32, lambd: f32) -> R<Tensor> {
    let (b, l, k) = (bias as f64, lambd as f64, kind(x)?);
    let zero = x.f_zeros_like()?;
    let above = x.f_sub_scalar(b)?.f_to_kind(k)?.f_where_self(&x.f_gt(l)?, &zero)?;
    Ok(x.f_add_scalar(b)?.f_to_kind(k)?.f_where_self(&x.f_lt(-l)?, &above)?)
}

/// LRN over `[N, C, ...]`: the sum of squares over the `size` channels around each one
/// (`floor((size-1)/2)` before, `ceil((size-1)/2)` after, zero-padded) as an unfold.
pub(crate) fn lrn(x: &Tensor, l: &Lrn) -> R<Tensor> {
    if x.dim() < 2 || l.size < 1 {
        return Err(invalid(format!("input {:?} must be [N, C, ...] and size {} positive", x.size(), l.size)));
    }
    let before = (l.size - 1) / 2;
    let sq = pad_axis(&x.f_square()?, 1, before, l.size - 1 - before, 0.0)?;
    let sum = sq.f_unfold(1, l.size, 1)?.f_sum_dim_intlist([-1i64].as_slice(), false, None::<Kind>)?;
    let scale = sum.f_mul_scalar(l.alpha as f64 / l.size as f64)?.f_add_scalar(l.bias as f64)?;
    Ok(x.f_div(&scale.f_pow_tensor_scalar(l.beta as f64)?)?)
}

/// MeanVarianceNormalization: `(x - E[x]) / (sqrt(Var[x]) + 1e-9)` over the axes. The
/// variance is taken as `E[(x - E[x])^2]`, equal to the definition's `E[x^2] - E[x]^2`
/// but never negative from rounding (which made the square root NaN).
pub(crate) fn mean_variance_normalization(x: &Tensor, axes: &[i64]) -> R<Tensor> {
    let axes = norm_axes(axes, x.dim())?;
    let centred = x.f_sub(&x.f_mean_dim(axes.as_slice(), true, None::<Kind>)?)?;
    let var = centred.f_square()?.f_mean_dim(axes.as_slice(), true, None::<Kind>)?;
    Ok(centred.f_div(&var.f_sqrt()?.f_add_scalar(1e-9)?)?)
}

/// GroupNormalization over `[N, C, ...]` through libtorch's group norm. Opset 18's scale
/// and bias hold one value per group, repeated here over the group's channels. With
/// `stash_type = 1` half-precision inputs are normalised in f32.
pub(crate) fn group_normalization(g: &GroupNorm, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let (x, scale, bias) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let c = x.size().get(1).copied().ok_or_else(|| invalid("input must be [N, C, ...]"))?;
    if g.num_groups < 1 || c % g.num_groups != 0 {
        return Err(invalid(format!("{c} channels do not split into {} groups", g.num_groups)));
    }
    let per = if g.per_channel { c } else { g.num_groups };
    if scale.numel() as i64 != per || bias.numel() as i64 != per {
        return Err(invalid(format!("scale {:?} and bias {:?} must hold {per} values", scale.size(), bias.size())));
    }
    let channels = |t: &Tensor| -> R<Tensor> {
        if g.per_channel {
            return Ok(t.f_reshape([c])?);
        }
        Ok(t.f_reshape([per, 1])?.f_expand([per, c / per], false)?.f_reshape([c])?)
    };
    let k = kind(x)?;
    let widen = g.stash_type == 1 && is_float_kind(k) && matches!(k, Kind::Half | Kind::BFloat16);
    let work = |t: &Tensor| -> R<Tensor> { Ok(if widen { t.f_to_kind(Kind::Float)? } else { t.shallow_clone() }) };
    let y = work(x)?.f_group_norm(g.num_groups, Some(work(&channels(scale)?)?), Some(work(&channels(bias)?)?), g.epsilon as f64, false)?;
    Ok(if widen { y.f_to_kind(k)? } else { y })
}

/// Det: the determinant of each trailing `M x M` matrix.
pub(crate) fn det(x: &Tensor) -> R<Tensor> {
    let s = x.size();
    if s.len() < 2 || s[s.len() - 1] != s[s.len() - 2] {
        return Err(invalid(format!("input must be [*, M, M], got {s:?}")));
    }
    Ok(Tensor::f_linalg_det(x)?)
}
