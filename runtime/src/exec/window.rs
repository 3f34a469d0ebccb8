//! Windowed kernels: Conv, ConvTranspose, MaxPool, AveragePool and the global pools.
//!
//! Asymmetric pads, `auto_pad` and `ceil_mode` are all resolved here into explicit constant
//! padding (or cropping) of the input, so libtorch always sees symmetric zero padding.

use tch::{Kind, Tensor};

use super::util::{invalid, is_float_kind, kind, pad_dims, unsupported, R};
use pipewright_ops::op::{AutoPad, Conv, ConvTranspose, Pool, Window};

/// Resolved per-spatial-dimension geometry.
struct Geometry {
    kernel: Vec<i64>,
    strides: Vec<i64>,
    dilations: Vec<i64>,
    begins: Vec<i64>,
    ends: Vec<i64>,
}

/// Checks that `x` is `(N, C, D1, ..., Dn)` with `1 <= n <= 3` and returns `n`.
fn spatial_rank(x: &Tensor) -> R<usize> {
    match x.dim() {
        3..=5 => Ok(x.dim() - 2),
        r => Err(unsupported(format!(
            "only 1-D, 2-D and 3-D spatial inputs are supported (rank {r})"
        ))),
    }
}

fn or_default(v: &[i64], n: usize, default: i64, what: &str) -> R<Vec<i64>> {
    match v.len() {
        0 => Ok(vec![default; n]),
        l if l == n => Ok(v.to_vec()),
        l => Err(invalid(format!(
            "{what} has {l} values for {n} spatial dimensions"
        ))),
    }
}

/// Kernel, strides, dilations and explicit pads of a forward window over `input` sizes.
fn geometry(w: &Window, kernel: Vec<i64>, input: &[i64]) -> R<Geometry> {
    let n = input.len();
    let strides = or_default(&w.strides, n, 1, "strides")?;
    let dilations = or_default(&w.dilations, n, 1, "dilations")?;
    if strides
        .iter()
        .chain(&dilations)
        .chain(&kernel)
        .any(|&v| v < 1)
    {
        return Err(invalid(
            "kernel_shape, strides and dilations must be positive",
        ));
    }
    let (begins, ends) = match w.auto_pad {
        AutoPad::NotSet => {
            let pads = or_default(&w.pads, 2 * n, 0, "pads")?;
            (pads[..n].to_vec(), pads[n..].to_vec())
        }
        AutoPad::Valid => (vec![0; n], vec![0; n]),
        AutoPad::SameUpper | AutoPad::SameLower => {
            same_pads(w.auto_pad, &kernel, &strides, &dilations, input)
        }
    };
    Ok(Geometry {
        kernel,
        strides,
        dilations,
        begins,
        ends,
    })
}

/// SAME_UPPER / SAME_LOWER: output size `ceil(in / stride)`, the odd pad at the end / start.
fn same_pads(
    mode: AutoPad,
    k: &[i64],
    s: &[i64],
    d: &[i64],
    input: &[i64],
) -> (Vec<i64>, Vec<i64>) {
    let mut begins = Vec::new();
    let mut ends = Vec::new();
    for i in 0..input.len() {
        let out = (input[i] + s[i] - 1) / s[i];
        let total = ((out - 1) * s[i] + (k[i] - 1) * d[i] + 1 - input[i]).max(0);
        let small = total / 2;
        let (b, e) = if mode == AutoPad::SameUpper {
            (small, total - small)
        } else {
            (total - small, small)
        };
        begins.push(b);
        ends.push(e);
    }
    (begins, ends)
}

fn kernel_from_weight(w: &Window, weight: &Tensor) -> R<Vec<i64>> {
    let k = weight.size()[2..].to_vec();
    if !w.kernel_shape.is_empty() && w.kernel_shape != k {
        return Err(invalid(format!(
            "kernel_shape {:?} does not match the weight's {k:?}",
            w.kernel_shape
        )));
    }
    Ok(k)
}

/// The spatial rank of `x`, checking the weight has the same rank.
fn weighted_spatial_rank(x: &Tensor, w: &Tensor) -> R<usize> {
    let n = spatial_rank(x)?;
    if w.dim() != n + 2 {
        return Err(invalid(format!("weight rank {} does not match input rank {}", w.dim(), x.dim())));
    }
    Ok(n)
}

/// Conv with groups, dilations, explicit or automatic (possibly asymmetric) pads.
pub(crate) fn conv(c: &Conv, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> R<Tensor> {
    let n = weighted_spatial_rank(x, w)?;
    let g = geometry(&c.window, kernel_from_weight(&c.window, w)?, &x.size()[2..])?;
    let (x, pads) = if g.begins == g.ends {
        (x.shallow_clone(), g.begins.clone())
    } else {
        (pad_dims(x, 2, &g.begins, &g.ends, 0.0)?, vec![0; n])
    };
    let zeros = vec![0i64; n];
    Ok(x.f_convolution(
        w,
        b,
        &g.strides,
        &pads,
        &g.dilations,
        false,
        &zeros,
        c.group,
    )?)
}

/// ConvTranspose: the full transposed convolution, then cropped or extended to the ONNX
/// output window (pads, output_padding, output_shape, auto_pad), then the bias.
pub(crate) fn conv_transpose(
    c: &ConvTranspose,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> R<Tensor> {
    let n = weighted_spatial_rank(x, w)?;
    let input = x.size()[2..].to_vec();
    let kernel = kernel_from_weight(&c.window, w)?;
    let mut win = c.window.clone();
    win.auto_pad = AutoPad::NotSet;
    if c.window.auto_pad != AutoPad::NotSet {
        win.pads.clear();
    }
    let g = geometry(&win, kernel, &input)?;
    let out_pad = or_default(&c.output_padding, n, 0, "output_padding")?;
    let full: Vec<i64> = (0..n)
        .map(|i| (input[i] - 1) * g.strides[i] + (g.kernel[i] - 1) * g.dilations[i] + 1)
        .collect();
    let (begins, ends) = transpose_pads(c, &g, &full, &out_pad, &input)?;
    let zeros = vec![0i64; n];
    let y = x.f_convolution::<&Tensor>(
        w,
        None,
        &g.strides,
        &zeros,
        &g.dilations,
        true,
        &zeros,
        c.group,
    )?;
    let crop_b: Vec<i64> = begins.iter().map(|b| -b).collect();
    let crop_e: Vec<i64> = (0..n).map(|i| out_pad[i] - ends[i]).collect();
    let y = pad_dims(&y, 2, &crop_b, &crop_e, 0.0)?;
    add_channel_bias(y, b)
}

/// The begin/end pads of a transposed convolution (negative: extra output).
fn transpose_pads(
    c: &ConvTranspose,
    g: &Geometry,
    full: &[i64],
    op: &[i64],
    input: &[i64],
) -> R<(Vec<i64>, Vec<i64>)> {
    let n = full.len();
    let target: Option<Vec<i64>> = match (c.output_shape.len(), c.window.auto_pad) {
        (0, AutoPad::SameUpper | AutoPad::SameLower) => {
            Some((0..n).map(|i| input[i] * g.strides[i]).collect())
        }
        (0, _) => None,
        (l, _) if l == n => Some(c.output_shape.clone()),
        (l, _) if l == n + 2 => Some(c.output_shape[2..].to_vec()),
        (l, _) => {
            return Err(invalid(format!(
                "output_shape has {l} values for {n} spatial dimensions"
            )))
        }
    };
    let Some(target) = target else {
        return Ok((g.begins.clone(), g.ends.clone()));
    };
    let mut begins = Vec::new();
    let mut ends = Vec::new();
    for i in 0..n {
        let total = full[i] + op[i] - target[i];
        let half = total.div_euclid(2);
        let (b, e) = if c.window.auto_pad == AutoPad::SameUpper {
            (half, total - half)
        } else {
            (total - half, half)
        };
        begins.push(b);
        ends.push(e);
    }
    Ok((begins, ends))
}

fn add_channel_bias(y: Tensor, b: Option<&Tensor>) -> R<Tensor> {
    let Some(b) = b else { return Ok(y) };
    let mut shape = vec![1i64; y.dim()];
    shape[1] = -1;
    Ok(y.f_add(&b.f_reshape(&shape)?)?)
}

/// Output size and the end pad that makes a floor-mode pool produce exactly it.
fn pool_extent(g: &Geometry, input: &[i64], ceil_mode: bool) -> R<(Vec<i64>, Vec<i64>)> {
    let mut outs = Vec::new();
    let mut ends = Vec::new();
    for (i, &len) in input.iter().enumerate() {
        let (s, b) = (g.strides[i], g.begins[i]);
        let eff = (g.kernel[i] - 1) * g.dilations[i] + 1;
        let span = len + b + g.ends[i] - eff;
        if span < 0 {
            return Err(invalid(format!(
                "window {eff} is larger than the padded input {}",
                span + eff
            )));
        }
        let mut out = if ceil_mode {
            (span + s - 1) / s + 1
        } else {
            span / s + 1
        };
        if ceil_mode && (out - 1) * s >= len + b {
            out -= 1;
        }
        outs.push(out);
        ends.push((out - 1) * s + eff - len - b);
    }
    Ok((outs, ends))
}

fn pool_geometry(p: &Pool, x: &Tensor) -> R<(Geometry, Vec<i64>)> {
    let n = spatial_rank(x)?;
    if p.window.kernel_shape.len() != n {
        return Err(invalid(format!(
            "kernel_shape {:?} does not match {n} spatial dimensions",
            p.window.kernel_shape
        )));
    }
    let input = x.size()[2..].to_vec();
    let mut g = geometry(&p.window, p.window.kernel_shape.clone(), &input)?;
    let (_, ends) = pool_extent(&g, &input, p.ceil_mode)?;
    let real_ends = std::mem::replace(&mut g.ends, ends);
    Ok((g, real_ends))
}

/// The padding value that never wins a max.
fn lowest(k: Kind) -> R<f64> {
    Ok(match k {
        _ if is_float_kind(k) => f64::NEG_INFINITY,
        Kind::Uint8 => 0.0,
        Kind::Int8 => i8::MIN as f64,
        Kind::Int16 => i16::MIN as f64,
        Kind::Int => i32::MIN as f64,
        Kind::Int64 => i64::MIN as f64,
        k => {
            return Err(super::util::bad_dtype(format!(
                "MaxPool does not support {k:?}"
            )))
        }
    })
}

/// MaxPool: outputs Y and Indices (flattened NCHW offsets into X, storage_order 0).
pub(crate) fn max_pool(p: &Pool, x: &Tensor) -> R<Vec<Tensor>> {
    let (g, _) = pool_geometry(p, x)?;
    let xp = pad_dims(x, 2, &g.begins, &g.ends, lowest(kind(x)?)?)?;
    let zeros = vec![0i64; g.kernel.len()];
    let (y, idx) = match g.kernel.len() {
        1 => xp.f_max_pool1d_with_indices(&g.kernel, &g.strides, &zeros, &g.dilations, false)?,
        2 => xp.f_max_pool2d_with_indices(&g.kernel, &g.strides, &zeros, &g.dilations, false)?,
        _ => xp.f_max_pool3d_with_indices(&g.kernel, &g.strides, &zeros, &g.dilations, false)?,
    };
    let idx = onnx_indices(&idx, &xp.size()[2..], &x.size(), &g.begins)?;
    Ok(vec![y, idx])
}

/// Converts libtorch's per-plane indices into the padded input to ONNX's flat indices into X.
fn onnx_indices(idx: &Tensor, padded: &[i64], x_shape: &[i64], begins: &[i64]) -> R<Tensor> {
    let orig = &x_shape[2..];
    let mut rem = idx.shallow_clone();
    let mut flat = idx.f_zeros_like()?;
    let mut stride = 1i64;
    for i in (0..padded.len()).rev() {
        let coord = rem.f_remainder(padded[i])?.f_sub_scalar(begins[i])?;
        rem = rem.f_floor_divide_scalar(padded[i])?;
        flat = flat.f_add(&coord.f_mul_scalar(stride)?)?;
        stride *= orig[i];
    }
    let planes = x_shape[0] * x_shape[1];
    let mut base_shape = vec![x_shape[0], x_shape[1]];
    base_shape.extend(vec![1; orig.len()]);
    let base = Tensor::f_arange(planes, (Kind::Int64, idx.device()))?
        .f_mul_scalar(stride)?
        .f_reshape(&base_shape)?;
    Ok(flat.f_add(&base)?)
}

/// AveragePool as a sum (a ones-kernel convolution over the padded input) divided by the
/// number of counted elements, which handles dilations, ceil_mode, asymmetric pads and
/// count_include_pad uniformly.
pub(crate) fn average_pool(p: &Pool, x: &Tensor) -> R<Tensor> {
    let (sums, count) = window_sums(p, x, true)?;
    let count = count.ok_or_else(|| invalid("no window count"))?;
    let mut out_shape = x.size()[..2].to_vec();
    out_shape.extend(&sums.size()[2..]);
    Ok(sums.f_div(&count)?.f_reshape(&out_shape)?)
}

/// The sum of each pooling window over the zero padded input, as `[N * C, 1, out...]`,
/// and (when `counted`) the number of elements each window averages over.
fn window_sums(p: &Pool, x: &Tensor, counted: bool) -> R<(Tensor, Option<Tensor>)> {
    let (g, real_ends) = pool_geometry(p, x)?;
    let k = kind(x)?;
    if !is_float_kind(k) {
        return Err(super::util::bad_dtype(format!(
            "pooling needs a floating-point input, got {k:?}"
        )));
    }
    let shape = x.size();
    let n = g.kernel.len();
    let xp = pad_dims(x, 2, &g.begins, &g.ends, 0.0)?;
    let padded = xp.size()[2..].to_vec();
    let mut flat_shape = vec![shape[0] * shape[1], 1];
    flat_shape.extend(&padded);
    let mut ones_shape = vec![1i64, 1];
    ones_shape.extend(&g.kernel);
    let ones = Tensor::f_ones(&ones_shape, (k, x.device()))?;
    let sum_of = |t: &Tensor| -> R<Tensor> {
        let zeros = vec![0i64; n];
        Ok(t.f_convolution::<&Tensor>(
            &ones,
            None,
            &g.strides,
            &zeros,
            &g.dilations,
            false,
            &zeros,
            1,
        )?)
    };
    let sums = sum_of(&xp.f_reshape(&flat_shape)?)?;
    let count = if counted { Some(sum_of(&count_mask(p, &g, &real_ends, &shape, k, x)?)?) } else { None };
    Ok((sums, count))
}

/// LpPool: `(sum over the window of |x|^p)^(1/p)`, pads counting as zeros.
pub(crate) fn lp_pool(pool: &Pool, p: i64, x: &Tensor) -> R<Tensor> {
    let powered = x.f_abs()?.f_pow_tensor_scalar(p)?;
    let (sums, _) = window_sums(pool, &powered, false)?;
    let mut out_shape = x.size()[..2].to_vec();
    out_shape.extend(&sums.size()[2..]);
    Ok(sums.f_pow_tensor_scalar(1.0 / p as f64)?.f_reshape(&out_shape)?)
}

/// 1 where an element counts toward the average: the input, plus the real pads when
/// count_include_pad; 0 in the ceil-mode extension.
fn count_mask(
    p: &Pool,
    g: &Geometry,
    real_ends: &[i64],
    shape: &[i64],
    k: Kind,
    x: &Tensor,
) -> R<Tensor> {
    let mut mshape = vec![1i64, 1];
    mshape.extend(&shape[2..]);
    let ones = Tensor::f_ones(&mshape, (k, x.device()))?;
    if !p.count_include_pad {
        return pad_dims(&ones, 2, &g.begins, &g.ends, 0.0);
    }
    let with_pads = pad_dims(&ones, 2, &g.begins, real_ends, 1.0)?;
    let zeros = vec![0i64; g.begins.len()];
    let extra: Vec<i64> = g.ends.iter().zip(real_ends).map(|(e, r)| e - r).collect();
    pad_dims(&with_pads, 2, &zeros, &extra, 0.0)
}

/// GlobalAveragePool / GlobalMaxPool over every spatial dimension, kept as size 1.
pub(crate) fn global_pool(x: &Tensor, max: bool) -> R<Tensor> {
    if x.dim() < 3 {
        return Err(invalid(format!("X must have rank >= 3, got {}", x.dim())));
    }
    let dims: Vec<i64> = (2..x.dim() as i64).collect();
    Ok(if max {
        x.f_amax(dims.as_slice(), true)?
    } else {
        x.f_mean_dim(dims.as_slice(), true, None)?
    })
}

/// MaxUnpool: X scattered to its flat offsets I (MaxPool's indices over the whole
/// tensor) in zeros of the unpooled shape `(in - 1) * stride - pads + kernel`, then
/// zero-extended at the end of each spatial axis to `output_shape` when given (as the
/// ONNX reference does). One scatter, so the gradient w.r.t. X gathers at I.
pub(crate) fn max_unpool(x: &Tensor, idx: &Tensor, output_shape: Option<&Tensor>, [kernel, strides, pads]: [&Vec<i64>; 3]) -> R<Tensor> {
    let xs = x.size();
    let n = kernel.len();
    if xs.len() != n + 2 || idx.size() != xs {
        return Err(invalid(format!("X {xs:?} and I {:?} must be one [N,C] + {n}-D shape", idx.size())));
    }
    let stride = |i: usize| strides.get(i).copied().unwrap_or(1);
    let pad = |i: usize| pads.get(i).copied().unwrap_or(0);
    let mut shape = xs[..2].to_vec();
    for i in 0..n {
        shape.push((xs[i + 2] - 1) * stride(i) - pad(i) - pad(i + n) + kernel[i]);
    }
    if shape.iter().any(|&d| d < 0) {
        return Err(invalid(format!("unpooled shape {shape:?} is negative")));
    }
    let numel: i64 = shape.iter().product();
    let flat = Tensor::f_zeros([numel], (kind(x)?, x.device()))?;
    let y = flat.f_scatter(0, &idx.f_reshape([-1])?, &x.f_reshape([-1])?)?.f_reshape(&shape)?;
    let Some(out) = output_shape else { return Ok(y) };
    let want = super::util::ints(out)?;
    if want.len() != shape.len() || want.iter().zip(&shape).skip(2).any(|(w, u)| w < u) {
        return Err(invalid(format!("output_shape {want:?} must have rank {} and hold the unpooled shape {shape:?}", shape.len())));
    }
    // constant_pad_nd takes (begin, end) pairs from the last axis backwards.
    let ends: Vec<i64> = (2..shape.len()).rev().flat_map(|i| [0, want[i] - shape[i]]).collect();
    Ok(y.f_constant_pad_nd(&ends)?)
}
