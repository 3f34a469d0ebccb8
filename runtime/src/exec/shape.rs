//! Shape and data-movement kernels: Reshape, Flatten, Transpose, Squeeze, Unsqueeze,
//! Concat, Split, Slice, Gather, GatherElements, GatherND, Expand, Shape, Size, ConstantOfShape,
//! Range, Tile, Trilu, Einsum, Pad, CumSum, DepthToSpace, SpaceToDepth, Col2Im and
//! CenterCropPad.

use tch::{Kind, Tensor};

use super::convert::kind_of;
use super::util::{
    broadcast_shapes, dim, index_tensor, ints, invalid, is_float_kind, kind, need, norm_axes,
    norm_axis, opt, pad_axis, pad_dims, scalar_f64, scalar_i64, R,
};
use pipewright_ops::{DType, TensorData};
use pipewright_ops::op::{Pad, PadMode, Slice, Split};

/// Reshape with ONNX's `0` (copy the input dim unless allowzero) and `-1` (inferred).
pub(crate) fn reshape(x: &Tensor, shape: &Tensor, allow_zero: bool) -> R<Tensor> {
    let dims = ints(shape)?;
    let input = x.size();
    let mut out = Vec::with_capacity(dims.len());
    let mut infer = None;
    for (i, &d) in dims.iter().enumerate() {
        match d {
            0 if !allow_zero => out.push(
                *input
                    .get(i)
                    .ok_or_else(|| invalid(format!("0 at {i} has no input dim")))?,
            ),
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            d if d < 0 => return Err(invalid(format!("bad target shape {dims:?}"))),
            d => out.push(d),
        }
    }
    if let Some(i) = infer {
        let known = out
            .iter()
            .try_fold(1i64, |a, &d| a.checked_mul(d))
            .unwrap_or(0);
        let numel: i64 = input.iter().product();
        if known == 0 || numel % known != 0 {
            return Err(invalid(format!("cannot reshape {input:?} to {dims:?}")));
        }
        out[i] = numel / known;
    }
    Ok(x.f_reshape(&out)?)
}

pub(crate) fn flatten(x: &Tensor, axis: i64) -> R<Tensor> {
    let shape = x.size();
    let r = shape.len() as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..=r).contains(&a) {
        return Err(invalid(format!("axis {axis} is out of range for rank {r}")));
    }
    let outer: i64 = shape[..a as usize].iter().product();
    let inner: i64 = shape[a as usize..].iter().product();
    Ok(x.f_reshape([outer, inner])?)
}

pub(crate) fn transpose(x: &Tensor, perm: Option<&Vec<i64>>) -> R<Tensor> {
    let r = x.dim();
    let perm: Vec<i64> = match perm {
        Some(p) => p.iter().map(|&a| norm_axis(a, r)).collect::<R<_>>()?,
        None => (0..r as i64).rev().collect(),
    };
    Ok(x.f_permute(&perm)?)
}

/// Axes from the attribute or (when `None`) from input 1, which may itself be absent.
fn axes_from(attr: Option<&Vec<i64>>, ins: &[Option<&Tensor>], i: usize) -> R<Option<Vec<i64>>> {
    match (attr, opt(ins, i)) {
        (Some(a), _) => Ok(Some(a.clone())),
        (None, Some(t)) => Ok(Some(ints(t)?)),
        (None, None) => Ok(None),
    }
}

pub(crate) fn squeeze(ins: &[Option<&Tensor>], attr: Option<&Vec<i64>>) -> R<Tensor> {
    let x = need(ins, 0)?;
    let Some(axes) = axes_from(attr, ins, 1)? else {
        return Ok(x.f_squeeze()?);
    };
    let axes = norm_axes(&axes, x.dim())?;
    if let Some(a) = axes.iter().find(|&&a| dim(x, a) != 1) {
        return Err(invalid(format!(
            "cannot squeeze axis {a} of size {}",
            dim(x, *a)
        )));
    }
    Ok(x.f_squeeze_dims(axes.as_slice())?)
}

pub(crate) fn unsqueeze(ins: &[Option<&Tensor>], attr: Option<&Vec<i64>>) -> R<Tensor> {
    let x = need(ins, 0)?;
    let axes = axes_from(attr, ins, 1)?.ok_or_else(|| invalid("Unsqueeze needs axes"))?;
    let axes = norm_axes(&axes, x.dim() + axes.len())?;
    let mut y = x.shallow_clone();
    for a in axes {
        y = y.f_unsqueeze(a)?;
    }
    Ok(y)
}

pub(crate) fn concat(xs: &[&Tensor], axis: i64) -> R<Tensor> {
    let first = xs
        .first()
        .ok_or_else(|| invalid("Concat needs at least one input"))?;
    Ok(Tensor::f_cat(xs, norm_axis(axis, first.dim())?)?)
}

/// Split by attribute sizes, input-1 sizes, or `num_outputs` parts (the last may be
/// smaller); older opsets split equally into the node's `n_outputs` (0: unknown).
pub(crate) fn split(s: &Split, n_outputs: usize, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let x = need(ins, 0)?;
    let axis = norm_axis(s.axis, x.dim())?;
    let total = dim(x, axis);
    let parts = s.num_outputs.or((n_outputs > 0).then_some(n_outputs as i64));
    let sizes = match (&s.split, opt(ins, 1), parts) {
        (Some(v), _, _) => v.clone(),
        (None, Some(t), _) => ints(t)?,
        (None, None, Some(n)) => equal_parts(total, n)?,
        (None, None, None) => return Err(invalid(
            "an equal split needs num_outputs or the node's output count",
        )),
    };
    if sizes.iter().any(|&v| v < 0) || sizes.iter().sum::<i64>() != total {
        return Err(invalid(format!(
            "split sizes {sizes:?} do not add up to dimension {total}"
        )));
    }
    Ok(x.f_split_with_sizes(&sizes, axis)?)
}

fn equal_parts(total: i64, n: i64) -> R<Vec<i64>> {
    if n < 1 {
        return Err(invalid(format!("num_outputs must be positive, got {n}")));
    }
    let chunk = (total + n - 1) / n;
    let last = total - chunk * (n - 1);
    if last < 0 {
        return Err(invalid(format!("cannot split {total} into {n} parts")));
    }
    let mut v = vec![chunk; n as usize - 1];
    v.push(last);
    Ok(v)
}

/// Slice with attribute bounds or inputs starts/ends/axes/steps; clamps like ONNX and
/// supports negative steps.
pub(crate) fn slice(s: &Slice, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = need(ins, 0)?;
    let (starts, ends, axes, steps) = match &s.attrs {
        Some((st, en, ax)) => (st.clone(), en.clone(), ax.clone(), None),
        None => {
            let axes = opt(ins, 3).map(ints).transpose()?;
            (
                ints(need(ins, 1)?)?,
                ints(need(ins, 2)?)?,
                axes,
                opt(ins, 4).map(ints).transpose()?,
            )
        }
    };
    let n = starts.len();
    let axes = axes.unwrap_or_else(|| (0..n as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; n]);
    if ends.len() != n || axes.len() != n || steps.len() != n {
        return Err(invalid(
            "starts, ends, axes and steps must have the same length",
        ));
    }
    norm_axes(&axes, x.dim())?;
    let mut y = x.shallow_clone();
    for i in 0..n {
        y = slice_axis(
            &y,
            norm_axis(axes[i], x.dim())?,
            starts[i],
            ends[i],
            steps[i],
        )?;
    }
    Ok(y)
}

fn slice_axis(t: &Tensor, a: i64, start: i64, end: i64, step: i64) -> R<Tensor> {
    let d = dim(t, a);
    if step == 0 {
        return Err(invalid("slice step must not be 0"));
    }
    let s = if start < 0 {
        start.saturating_add(d)
    } else {
        start
    };
    let e = if end < 0 { end.saturating_add(d) } else { end };
    if step > 0 || d == 0 {
        let (s, e) = (s.clamp(0, d), e.clamp(0, d));
        return Ok(t.f_slice(a, s, e.max(s), step.max(1))?);
    }
    let (s, e) = (s.clamp(0, d - 1), e.clamp(-1, d - 1));
    if s <= e {
        return Ok(t.f_slice(a, 0, 0, 1)?);
    }
    let idx = Tensor::f_arange_start_step(s, e, step, (Kind::Int64, t.device()))?;
    Ok(t.f_index_select(a, &idx)?)
}

/// Indices with negative entries counted from the end of a dimension of size `d`.
pub(crate) fn wrap_indices(idx: &Tensor, d: i64) -> R<Tensor> {
    let idx = idx.f_to_kind(Kind::Int64)?;
    Ok(idx.f_add_scalar(d)?.f_where_self(&idx.f_lt(0)?, &idx)?)
}

pub(crate) fn gather(x: &Tensor, idx: &Tensor, axis: i64) -> R<Tensor> {
    let a = norm_axis(axis, x.dim())?;
    let shape = x.size();
    let i = wrap_indices(idx, shape[a as usize])?;
    let mut out: Vec<i64> = shape[..a as usize].to_vec();
    out.extend(i.size());
    out.extend(&shape[a as usize + 1..]);
    Ok(x.f_index_select(a, &i.f_reshape([-1])?)?.f_reshape(&out)?)
}

pub(crate) fn gather_elements(x: &Tensor, idx: &Tensor, axis: i64) -> R<Tensor> {
    let a = norm_axis(axis, x.dim())?;
    let i = wrap_indices(idx, dim(x, a))?;
    Ok(x.f_gather(a, &i, false)?)
}

/// GatherND: `data[b..., idx[b..., m..., :]]`. The first `batch_dims` axes and the indexed
/// axes of the data are flattened into one, so the gather is one `index_select` (which
/// autograd differentiates) at offsets `batch * slab + sum(idx_k * stride_k)`.
pub(crate) fn gather_nd(data: &Tensor, idx: &Tensor, batch_dims: i64) -> R<Tensor> {
    let (d, i) = (data.size(), idx.size());
    let b = usize::try_from(batch_dims).map_err(|_| invalid(format!("GatherND: batch_dims {batch_dims} is negative")))?;
    let k = *i.last().ok_or_else(|| invalid("GatherND: the indices are a scalar"))?;
    let k = usize::try_from(k).map_err(|_| invalid("GatherND: negative index tuple length"))?;
    if b >= i.len() || b + k > d.len() || d[..b] != i[..b] {
        return Err(invalid(format!("GatherND: indices {i:?} do not fit data {d:?} with batch_dims {b}")));
    }
    let indexed = &d[b..b + k];
    let slab: i64 = indexed.iter().product();
    let batches: i64 = d[..b].iter().product();
    // Offsets of each index tuple inside its batch's slab, negatives counted from the end.
    let idx = idx.f_to_kind(Kind::Int64)?.f_reshape([batches, -1, k as i64])?;
    let mut offset = Tensor::f_zeros([batches, idx.size()[1]], (Kind::Int64, idx.device()))?;
    let mut stride = slab;
    for (axis, &extent) in indexed.iter().enumerate() {
        stride /= extent.max(1);
        let part = wrap_indices(&idx.f_select(2, axis as i64)?, extent)?;
        offset = offset.f_add(&part.f_mul_scalar(stride)?)?;
    }
    let base = Tensor::f_arange(batches, (Kind::Int64, idx.device()))?.f_mul_scalar(slab)?.f_unsqueeze(1)?;
    let flat = data.f_reshape([batches * slab].iter().copied().chain(d[b + k..].iter().copied()).collect::<Vec<_>>())?;
    let picked = flat.f_index_select(0, &offset.f_add(&base)?.f_reshape([-1])?)?;
    let out: Vec<i64> = i[..i.len() - 1].iter().chain(&d[b + k..]).copied().collect();
    Ok(picked.f_reshape(&out)?)
}

/// Col2Im: every block column is added into the zero padded image at its position (one
/// `index_add`, differentiable in the columns), then the padding is cut away.
pub(crate) fn col2im(ins: &[Option<&Tensor>], [dil, pads, strides]: [&Vec<i64>; 3]) -> R<Tensor> {
    let x = need(ins, 0)?;
    let (image, block) = (ints(need(ins, 1)?)?, ints(need(ins, 2)?)?);
    let n = image.len();
    let or = |v: &Vec<i64>, len: usize, d: i64| if v.is_empty() { vec![d; len] } else { v.clone() };
    let (dil, pads, strides) = (or(dil, n, 1), or(pads, 2 * n, 0), or(strides, n, 1));
    let (batch, ck, l) = match x.size().as_slice() {
        &[b, ck, l] => (b, ck, l),
        d => return Err(invalid(format!("input {d:?} is not 3-D"))),
    };
    let k: i64 = block.iter().product();
    let bad = n == 0 || block.len() != n || dil.len() != n || strides.len() != n || pads.len() != 2 * n;
    if bad || k <= 0 || ck % k != 0 || dil.iter().chain(&strides).any(|&v| v <= 0) || image.iter().any(|&v| v < 0) {
        return Err(invalid(format!("input {:?} does not fit blocks {block:?} of image {image:?}", x.size())));
    }
    let padded: Vec<i64> = (0..n).map(|i| image[i] + pads[i] + pads[n + i]).collect();
    let blocks: Vec<i64> = (0..n).map(|i| (padded[i] - dil[i] * (block[i] - 1) - 1).div_euclid(strides[i]) + 1).collect();
    if blocks.iter().any(|&b| b < 1) || blocks.iter().product::<i64>() != l {
        return Err(invalid(format!("{l} blocks given, the padded image {padded:?} holds {blocks:?}")));
    }
    // Offsets into the flattened padded image: kernel offsets outer, block positions inner.
    let mut idx = Vec::with_capacity((k * l) as usize);
    for kk in 0..k {
        let ko = unravel(kk, &block);
        for bl in 0..l {
            let bo = unravel(bl, &blocks);
            idx.push((0..n).fold(0, |acc, i| acc * padded[i] + bo[i] * strides[i] + ko[i] * dil[i]));
        }
    }
    let c = ck / k;
    let src = x.f_reshape([batch, c, k * l])?;
    let idx = Tensor::f_from_slice(&idx)?.f_to(x.device())?;
    let total: i64 = padded.iter().product();
    let sum = Tensor::f_zeros([batch, c, total], (x.f_kind()?, x.device()))?.f_index_add(2, &idx, &src)?;
    let mut out = sum.f_reshape([batch, c].iter().chain(&padded).copied().collect::<Vec<_>>())?;
    for i in 0..n {
        out = out.f_narrow(2 + i as i64, pads[i], image[i])?;
    }
    Ok(out)
}

/// The row-major multi-index of `flat` in `extents`.
fn unravel(mut flat: i64, extents: &[i64]) -> Vec<i64> {
    let mut out = vec![0; extents.len()];
    for (o, &e) in out.iter_mut().zip(extents).rev() {
        *o = flat % e;
        flat /= e;
    }
    out
}

/// CenterCropPad: per axis, a centred slice (crop; the extra element on the far side) or
/// zero padding (the extra element at the end).
pub(crate) fn center_crop_pad(x: &Tensor, shape: &Tensor, axes: Option<&[i64]>) -> R<Tensor> {
    let shape = ints(shape)?;
    let rank = x.dim();
    let axes: Vec<i64> = match axes {
        Some(a) => a.iter().map(|&a| norm_axis(a, rank)).collect::<R<_>>()?,
        None => (0..rank as i64).collect(),
    };
    if shape.len() != axes.len() || shape.iter().any(|&v| v < 0) {
        return Err(invalid(format!("shape {shape:?} does not fit axes {axes:?}")));
    }
    let mut y = x.shallow_clone();
    for (&a, &want) in axes.iter().zip(&shape) {
        let have = y.size()[a as usize];
        if want < have {
            y = y.f_narrow(a, (have - want) / 2, want)?;
        } else if want > have {
            let before = (want - have) / 2;
            let mut pad = vec![0i64; 2 * (rank - a as usize)];
            let last = pad.len();
            pad[last - 2] = before;
            pad[last - 1] = want - have - before;
            y = y.f_constant_pad_nd(pad.as_slice())?;
        }
    }
    Ok(y)
}

/// The `[N, C, H, W]` extents of a DepthToSpace/SpaceToDepth input with blocksize `b`.
fn nchw(x: &Tensor, b: i64) -> R<(i64, i64, i64, i64)> {
    match x.size().as_slice() {
        &[n, c, h, w] if b > 0 => Ok((n, c, h, w)),
        d => Err(invalid(format!("expected a 4-D input and a positive blocksize, got {d:?} and {b}"))),
    }
}

/// DepthToSpace: the channels split into `b x b` blocks (leading for DCR, trailing for
/// CRD) which a transpose interleaves with the rows and columns.
pub(crate) fn depth_to_space(x: &Tensor, b: i64, crd: bool) -> R<Tensor> {
    let (n, c, h, w) = nchw(x, b)?;
    if c % (b * b) != 0 {
        return Err(invalid(format!("{c} channels are not a multiple of blocksize^2 = {}", b * b)));
    }
    let k = c / (b * b);
    let (split, perm) = if crd { ([n, k, b, b, h, w], [0, 1, 4, 2, 5, 3]) } else { ([n, b, b, k, h, w], [0, 3, 4, 1, 5, 2]) };
    Ok(x.f_reshape(split)?.f_permute(perm)?.f_reshape([n, k, h * b, w * b])?)
}

/// SpaceToDepth: the inverse of DepthToSpace in the same mode.
pub(crate) fn space_to_depth(x: &Tensor, b: i64, crd: bool) -> R<Tensor> {
    let (n, c, h, w) = nchw(x, b)?;
    if h % b != 0 || w % b != 0 {
        return Err(invalid(format!("spatial extents {h}x{w} are not multiples of blocksize {b}")));
    }
    let perm = if crd { [0, 1, 3, 5, 2, 4] } else { [0, 3, 5, 1, 2, 4] };
    Ok(x.f_reshape([n, c, h / b, b, w / b, b])?.f_permute(perm)?.f_reshape([n, c * b * b, h / b, w / b])?)
}

/// Expand: bidirectional numpy broadcast of the input's shape and the given shape.
pub(crate) fn expand(x: &Tensor, shape: &Tensor) -> R<Tensor> {
    let out = broadcast_shapes(&x.size(), &ints(shape)?)?;
    Ok(x.f_expand(&out, false)?)
}

pub(crate) fn shape_of(x: &Tensor, start: i64, end: Option<i64>) -> R<Tensor> {
    let dims = x.size();
    let r = dims.len() as i64;
    let clampi = |v: i64| if v < 0 { (v + r).max(0) } else { v.min(r) };
    let (s, e) = (clampi(start), clampi(end.unwrap_or(r)));
    let slice = if s < e {
        &dims[s as usize..e as usize]
    } else {
        &[][..]
    };
    index_tensor(slice, x)
}

pub(crate) fn size_of(x: &Tensor) -> R<Tensor> {
    Ok(index_tensor(&[x.numel() as i64], x)?.f_reshape([] as [i64; 0])?)
}

pub(crate) fn constant_of_shape(shape: &Tensor, value: Option<&TensorData>) -> R<Tensor> {
    let dims = ints(shape)?;
    let (et, v) = value.map_or((DType::F32, 0.0), |t| (t.dtype, t.to_f64s().first().copied().unwrap_or(0.0)));
    let opts = (kind_of(et)?, shape.device());
    Ok(if et.is_float() || et == DType::Bool {
        Tensor::f_full(&dims, v, opts)?
    } else {
        Tensor::f_full(&dims, v as i64, opts)?
    })
}

/// Range(start, limit, delta): `max(ceil((limit - start) / delta), 0)` values.
pub(crate) fn range(start: &Tensor, limit: &Tensor, delta: &Tensor) -> R<Tensor> {
    let k = kind(start)?;
    let dev = start.device();
    if is_float_kind(k) {
        let (s, l, d) = (scalar_f64(start)?, scalar_f64(limit)?, scalar_f64(delta)?);
        if d == 0.0 {
            return Err(invalid("delta must not be 0"));
        }
        let n = ((l - s) / d).ceil().max(0.0) as i64;
        let steps = Tensor::f_arange(n, (Kind::Double, dev))?;
        return Ok(steps.f_mul_scalar(d)?.f_add_scalar(s)?.f_to_kind(k)?);
    }
    let (s, l, d) = (scalar_i64(start)?, scalar_i64(limit)?, scalar_i64(delta)?);
    if d == 0 {
        return Err(invalid("delta must not be 0"));
    }
    let n = ((l as f64 - s as f64) / d as f64).ceil().max(0.0) as i64;
    let steps = Tensor::f_arange(n, (Kind::Int64, dev))?;
    Ok(steps.f_mul_scalar(d)?.f_add_scalar(s)?.f_to_kind(k)?)
}

pub(crate) fn tile(x: &Tensor, repeats: &Tensor) -> R<Tensor> {
    let reps = ints(repeats)?;
    if reps.len() != x.dim() {
        return Err(invalid(format!(
            "repeats has {} values for rank {}",
            reps.len(),
            x.dim()
        )));
    }
    Ok(x.f_repeat(&reps)?)
}

pub(crate) fn trilu(ins: &[Option<&Tensor>], upper: bool) -> R<Tensor> {
    let x = need(ins, 0)?;
    let k = opt(ins, 1).map(scalar_i64).transpose()?.unwrap_or(0);
    Ok(if upper { x.f_triu(k)? } else { x.f_tril(k)? })
}

pub(crate) fn einsum(equation: &str, xs: &[&Tensor]) -> R<Tensor> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    Ok(Tensor::f_einsum(&eq, xs, None::<Vec<i64>>)?)
}

/// Pad in constant, reflect, edge or wrap mode; negative pads crop.
pub(crate) fn pad(p: &Pad, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = need(ins, 0)?;
    let r = x.dim();
    let (pads, value) = match &p.attrs {
        Some((pads, v)) => (pads.clone(), *v as f64),
        None => (
            ints(need(ins, 1)?)?,
            opt(ins, 2).map(scalar_f64).transpose()?.unwrap_or(0.0),
        ),
    };
    let axes = match opt(ins, 3) {
        Some(t) => ints(t)?
            .iter()
            .map(|&a| norm_axis(a, r))
            .collect::<R<Vec<_>>>()?,
        None => (0..r as i64).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(invalid(format!(
            "{} pads for {} axes",
            pads.len(),
            axes.len()
        )));
    }
    let (mut begins, mut ends) = (vec![0i64; r], vec![0i64; r]);
    for (i, &a) in axes.iter().enumerate() {
        begins[a as usize] = pads[i];
        ends[a as usize] = pads[i + axes.len()];
    }
    if p.mode == PadMode::Constant {
        return pad_dims(x, 0, &begins, &ends, value);
    }
    let mut y = x.shallow_clone();
    for a in 0..r {
        if begins[a] != 0 || ends[a] != 0 {
            y = index_pad(&y, a as i64, begins[a], ends[a], p.mode)?;
        }
    }
    Ok(y)
}

/// Reflect/edge/wrap padding of one axis as an index_select (differentiable, any rank).
fn index_pad(t: &Tensor, a: i64, b: i64, e: i64, mode: PadMode) -> R<Tensor> {
    let d = dim(t, a);
    if d == 0 {
        return Err(invalid(format!("cannot {mode:?}-pad an empty axis {a}")));
    }
    let src = |j: i64| match mode {
        PadMode::Edge => j.clamp(0, d - 1),
        PadMode::Wrap => j.rem_euclid(d),
        _ if d == 1 => 0,
        _ => {
            let period = 2 * (d - 1);
            let m = j.rem_euclid(period);
            if m >= d {
                period - m
            } else {
                m
            }
        }
    };
    let idx: Vec<i64> = (-b..d + e).map(src).collect();
    Ok(t.f_index_select(a, &index_tensor(&idx, t)?)?)
}

/// CumSum along the axis from input 1, optionally exclusive and/or reversed.
pub(crate) fn cumsum(x: &Tensor, axis: &Tensor, exclusive: bool, reverse: bool) -> R<Tensor> {
    let a = norm_axis(scalar_i64(axis)?, x.dim())?;
    let t = if reverse {
        x.f_flip([a])?
    } else {
        x.shallow_clone()
    };
    let mut c = t.f_cumsum(a, kind(x)?)?;
    if exclusive {
        c = pad_axis(&c, a, 1, -1, 0.0)?;
    }
    Ok(if reverse { c.f_flip([a])? } else { c })
}
