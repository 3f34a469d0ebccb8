//! Indexing and scatter kernels: TopK, OneHot, ScatterND, ScatterElements (also ONNX's
//! deprecated Scatter), EyeLike, ReverseSequence and CumProd.
//!
//! The scatters are libtorch's `scatter`/`scatter_add`/`scatter_reduce` (differentiable in
//! the data and the updates); ScatterND flattens the indexed axes into one so it is an
//! ordinary row scatter.

use tch::{Kind, Tensor};

use super::convert::kind_of;
use super::shape::wrap_indices;
use super::util::{dim, ints, invalid, kind, norm_axis, pad_axis, scalar_f64, scalar_i64, R};
use pipewright_ops::DType;
use pipewright_ops::op::ScatterReduction;

/// TopK: values and (i64) indices of the `k` largest or smallest elements along `axis`.
/// A stable sort keeps equal elements in index order, as ONNX requires (libtorch's topk
/// does not promise it); the result is always sorted, which `sorted = 0` allows.
pub(crate) fn top_k(x: &Tensor, k: &Tensor, axis: i64, largest: bool) -> R<Vec<Tensor>> {
    let a = norm_axis(axis, x.dim())?;
    let k = scalar_i64(k)?;
    if k < 0 || k > dim(x, a) {
        return Err(invalid(format!("k = {k} does not fit axis {a} of {:?}", x.size())));
    }
    let (values, indices) = x.f_sort_stable(true, a, largest)?;
    Ok(vec![values.f_narrow(a, 0, k)?, indices.f_narrow(a, 0, k)?])
}

/// OneHot: `values[1]` where the (wrapped) index equals the position along the new axis,
/// `values[0]` elsewhere; indices outside `[-depth, depth)` give an all-off row.
pub(crate) fn one_hot(idx: &Tensor, depth: &Tensor, values: &Tensor, axis: i64) -> R<Tensor> {
    let depth = scalar_f64(depth)? as i64;
    if depth < 1 {
        return Err(invalid(format!("depth {depth} must be positive")));
    }
    if values.numel() != 2 {
        return Err(invalid(format!("values must hold [off, on], got {:?}", values.size())));
    }
    let a = norm_axis(axis, idx.dim() + 1)?;
    // Float indices are truncated, as the reference casts them to integers.
    let i = wrap_indices(idx, depth)?.f_unsqueeze(a)?;
    let mut shape = vec![1i64; idx.dim() + 1];
    shape[a as usize] = depth;
    let classes = Tensor::f_arange(depth, (Kind::Int64, idx.device()))?.f_reshape(&shape)?;
    let hot = i.f_eq_tensor(&classes)?;
    let values = values.f_reshape([2])?;
    Ok(values.f_select(0, 1)?.f_where_self(&hot, &values.f_select(0, 0)?)?)
}

/// Applies `updates` to `data` at `index` along `axis` (both already shaped alike).
fn scatter_with(data: &Tensor, axis: i64, index: &Tensor, updates: &Tensor, r: ScatterReduction) -> R<Tensor> {
    let reduce = |how: &str| data.f_internal_scatter_reduce(axis, index, updates, how, true);
    Ok(match r {
        ScatterReduction::None => data.f_scatter(axis, index, updates)?,
        ScatterReduction::Add => data.f_scatter_add(axis, index, updates)?,
        ScatterReduction::Mul => reduce("prod")?,
        ScatterReduction::Max => reduce("amax")?,
        ScatterReduction::Min => reduce("amin")?,
    })
}

/// ScatterElements: `out[.., idx[i,j,..], ..] = updates[i,j,..]` along `axis` (negative
/// indices count from the end), combined per `reduction`.
pub(crate) fn scatter_elements(data: &Tensor, idx: &Tensor, updates: &Tensor, axis: i64, r: ScatterReduction) -> R<Tensor> {
    let a = norm_axis(axis, data.dim())?;
    if idx.size() != updates.size() || idx.dim() != data.dim() {
        return Err(invalid(format!("indices {:?} and updates {:?} must match and have data's rank {}", idx.size(), updates.size(), data.dim())));
    }
    let i = wrap_indices(idx, dim(data, a))?;
    scatter_with(data, a, &i, updates, r)
}

/// ScatterND: each index tuple (the indices' last axis, length `k`) addresses a slice of
/// the data's first `k` axes, replaced by (or combined with) the matching update slice.
pub(crate) fn scatter_nd(data: &Tensor, idx: &Tensor, updates: &Tensor, r: ScatterReduction) -> R<Tensor> {
    let (d, i) = (data.size(), idx.size());
    let k = *i.last().ok_or_else(|| invalid("the indices are a scalar"))?;
    let k = usize::try_from(k).ok().filter(|&k| k <= d.len()).ok_or_else(|| invalid(format!("index tuples of length {k} for data {d:?}")))?;
    let expected: Vec<i64> = i[..i.len() - 1].iter().chain(&d[k..]).copied().collect();
    if updates.size() != expected {
        return Err(invalid(format!("updates {:?} must be {expected:?} for indices {i:?} and data {d:?}", updates.size())));
    }
    let rows: i64 = i[..i.len() - 1].iter().product();
    let slab: i64 = d[..k].iter().product();
    let width: i64 = d[k..].iter().product();
    let offsets = linear_offsets(&idx.f_reshape([rows, k as i64])?, &d[..k])?;
    let index = offsets.f_unsqueeze(1)?.f_expand([rows, width], false)?;
    let flat = data.f_reshape([slab, width])?;
    Ok(scatter_with(&flat, 0, &index, &updates.f_reshape([rows, width])?, r)?.f_reshape(&d)?)
}

/// Row-major offsets of index tuples `idx` (`[rows, k]`, negatives wrapped) into `extents`.
fn linear_offsets(idx: &Tensor, extents: &[i64]) -> R<Tensor> {
    let mut offset = Tensor::f_zeros([idx.size()[0]], (Kind::Int64, idx.device()))?;
    let mut stride: i64 = extents.iter().product();
    for (axis, &extent) in extents.iter().enumerate() {
        stride /= extent.max(1);
        let part = wrap_indices(&idx.f_select(1, axis as i64)?, extent)?;
        offset = offset.f_add(&part.f_mul_scalar(stride)?)?;
    }
    Ok(offset)
}

/// EyeLike: ones on diagonal `k` (above the main one when positive) of a 2-D tensor shaped
/// like the input, of `dtype` or the input's element type.
pub(crate) fn eye_like(x: &Tensor, dtype: Option<DType>, k: i64) -> R<Tensor> {
    let [rows, cols] = x.size()[..] else {
        return Err(invalid(format!("input must be 2-D, got {:?}", x.size())));
    };
    let to = match dtype {
        Some(e) => kind_of(e)?,
        None => kind(x)?,
    };
    let opts = (Kind::Int64, x.device());
    let r = Tensor::f_arange(rows, opts)?.f_unsqueeze(1)?;
    let c = Tensor::f_arange(cols, opts)?.f_unsqueeze(0)?;
    Ok(c.f_sub(&r)?.f_eq(k)?.f_to_kind(to)?)
}

/// ReverseSequence: for each batch entry `b`, the first `lens[b]` steps along the time
/// axis are reversed and the rest kept, as one gather along the time axis.
pub(crate) fn reverse_sequence(x: &Tensor, lens: &Tensor, batch_axis: i64, time_axis: i64) -> R<Tensor> {
    let r = x.dim();
    let (b, t) = (norm_axis(batch_axis, r)?, norm_axis(time_axis, r)?);
    if b == t {
        return Err(invalid(format!("batch_axis and time_axis are both {b}")));
    }
    let (batch, steps) = (dim(x, b), dim(x, t));
    let l = ints(lens)?;
    if l.len() as i64 != batch || l.iter().any(|&v| !(0..=steps).contains(&v)) {
        return Err(invalid(format!("sequence_lens {l:?} must give one length in 0..={steps} per batch entry ({batch})")));
    }
    let opts = (Kind::Int64, x.device());
    let time = Tensor::f_arange(steps, opts)?.f_unsqueeze(1)?;
    let lens = Tensor::f_from_slice(&l)?.f_to(x.device())?.f_unsqueeze(0)?;
    // [steps, batch]: the source step of each output step.
    let reversed = lens.f_sub(&time)?.f_sub_scalar(1)?;
    let src = reversed.f_where_self(&time.f_lt_tensor(&lens)?, &time.f_expand([steps, batch], false)?)?;
    let src = if t < b { src } else { src.f_transpose(0, 1)? };
    let mut shape = vec![1i64; r];
    shape[t as usize] = steps;
    shape[b as usize] = batch;
    let index = src.f_reshape(&shape)?.f_expand(x.size(), false)?;
    Ok(x.f_gather(t, &index, false)?)
}

/// CumProd along the axis from input 1, optionally exclusive (starting from 1) and/or
/// reversed.
pub(crate) fn cumprod(x: &Tensor, axis: &Tensor, exclusive: bool, reverse: bool) -> R<Tensor> {
    let a = norm_axis(scalar_i64(axis)?, x.dim())?;
    let t = if reverse { x.f_flip([a])? } else { x.shallow_clone() };
    let mut c = t.f_cumprod(a, kind(x)?)?;
    if exclusive {
        c = pad_axis(&c, a, 1, -1, 1.0)?;
    }
    Ok(if reverse { c.f_flip([a])? } else { c })
}

/// TensorScatter: the cache with `update` written along `axis` from each batch row's
/// write index (default 0), wrapping modulo the axis length when `circular`. One
/// scatter, so gradients reach both the cache (outside the written entries) and the
/// update.
pub(crate) fn tensor_scatter(cache: &Tensor, update: &Tensor, write: Option<&Tensor>, axis: i64, circular: bool) -> R<Tensor> {
    let a = norm_axis(axis, cache.dim())?;
    let (cs, us) = (cache.size(), update.size());
    let fits = a > 0 && cs.len() == us.len() && cs.iter().zip(&us).enumerate().all(|(i, (c, u))| if i == a as usize { u <= c } else { c == u });
    if !fits {
        return Err(invalid(format!("update {us:?} does not fit cache {cs:?} along axis {a}")));
    }
    let (batch, max_len, len) = (cs[0], cs[a as usize], us[a as usize]);
    let dev = cache.device();
    let start = match write {
        Some(w) => w.f_to_kind(Kind::Int64)?.f_reshape([-1])?,
        None => Tensor::f_zeros([batch], (Kind::Int64, dev))?,
    };
    if start.size() != [batch] {
        return Err(invalid(format!("write_indices {:?} must hold one index per batch row ({batch})", start.size())));
    }
    // Cache positions [batch, len]: the write index plus the offset in the update.
    let pos = start.f_unsqueeze(1)?.f_add(&Tensor::f_arange(len, (Kind::Int64, dev))?.f_unsqueeze(0)?)?;
    let pos = if circular && max_len > 0 { pos.f_remainder(max_len)? } else { pos };
    if pos.numel() > 0 {
        let (lo, hi) = (scalar_i64(&pos.f_min()?)?, scalar_i64(&pos.f_max()?)?);
        if lo < 0 || hi >= max_len {
            return Err(invalid(format!("write positions {lo}..={hi} fall outside the cache's {max_len} entries")));
        }
    }
    let mut view = vec![1i64; cs.len()];
    view[0] = batch;
    view[a as usize] = len;
    let idx = pos.f_reshape(&view)?.f_expand(&us, false)?;
    Ok(cache.f_scatter(a, &idx, update)?)
}
