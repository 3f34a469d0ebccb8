//! Network kernels other than windows: Softmax/LogSoftmax, MatMul, Gemm, the
//! normalisations (batch, layer, instance) and Dropout.

use tch::{Kind, Tensor};

use super::util::{invalid, kind, need, norm_axis, opt, scalar_f64, R};
use super::Mode;
use pipewright_ops::op::{BatchNorm, Gemm, LayerNorm, Softmax};

/// Softmax or LogSoftmax, per axis (opset >= 13) or over the coerced 2-D trailing block.
pub(crate) fn softmax(x: &Tensor, s: &Softmax, log: bool) -> R<Tensor> {
    let axis = norm_axis(s.axis, x.dim())?;
    let f = |t: &Tensor, d: i64| -> R<Tensor> {
        Ok(if log {
            t.f_log_softmax(d, None)?
        } else {
            t.f_softmax(d, None)?
        })
    };
    if !s.coerce_2d {
        return f(x, axis);
    }
    let shape = x.size();
    let outer: i64 = shape[..axis as usize].iter().product();
    let inner: i64 = shape[axis as usize..].iter().product();
    f(&x.f_reshape([outer, inner])?, 1)?
        .f_reshape(&shape)
        .map_err(Into::into)
}

/// `alpha * A' B' + beta * C`, `C` optional and broadcast.
pub(crate) fn gemm(g: &Gemm, a: &Tensor, b: &Tensor, c: Option<&Tensor>) -> R<Tensor> {
    if a.dim() != 2 || b.dim() != 2 {
        return Err(invalid(format!(
            "A and B must be 2-D, got ranks {} and {}",
            a.dim(),
            b.dim()
        )));
    }
    let a = if g.trans_a {
        a.f_transpose(0, 1)?
    } else {
        a.shallow_clone()
    };
    let b = if g.trans_b {
        b.f_transpose(0, 1)?
    } else {
        b.shallow_clone()
    };
    let mut y = a.f_matmul(&b)?;
    if g.alpha != 1.0 {
        y = y.f_mul_scalar(g.alpha as f64)?;
    }
    if let Some(c) = c {
        let c = if g.beta != 1.0 {
            c.f_mul_scalar(g.beta as f64)?
        } else {
            c.shallow_clone()
        };
        y = y.f_add(&c)?;
    }
    let k = kind(&a)?;
    Ok(if kind(&y)? == k { y } else { y.f_to_kind(k)? })
}

/// BatchNormalization. Train: batch statistics, and the updated running mean and variance
/// (ONNX momentum convention) as outputs 1 and 2. Eval: running stats, unless the node was
/// exported with `training_mode = 1`.
///
/// The running variance takes the batch's variance two ways. Where the graph reads the
/// running statistics (`stats_read`: a node exported with `training_mode = 1` and those
/// outputs), they are values the ONNX definition gives, with the population variance.
/// Otherwise they are state the runtime keeps while training (a node exported for
/// inference has no such outputs) and follow the batches as the framework that trains
/// such models does: PyTorch (and cuDNN) take the unbiased estimate, n / (n - 1) times the
/// population variance over the n values per channel. At batch 2 with 2 x 2 maps (n = 8)
/// the two differ by 14%, and the model exported after training would not be PyTorch's.
pub(crate) fn batch_norm(bn: &BatchNorm, ins: &[Option<&Tensor>], mode: Mode, stats_read: bool) -> R<Vec<Tensor>> {
    let (x, scale, bias) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let (mean, var) = (need(ins, 3)?, need(ins, 4)?);
    if x.dim() < 2 {
        return Err(invalid(format!("X must have rank >= 2, got {}", x.dim())));
    }
    let eps = bn.epsilon as f64;
    // A node exported with training_mode=1 asks for batch statistics even at inference.
    if mode == Mode::Eval && !bn.training_mode {
        let y = x.f_batch_norm(
            Some(scale),
            Some(bias),
            Some(mean),
            Some(var),
            false,
            0.0,
            eps,
            true,
        )?;
        return Ok(vec![y]);
    }
    let y = x.f_batch_norm(Some(scale), Some(bias), None, None, true, 0.0, eps, true)?;
    let (bm, bv) = batch_stats(&x.f_detach()?)?;
    let bv = if stats_read { bv } else { unbiased(bv, x)? };
    let m = bn.momentum as f64;
    let run_mean = mean
        .f_detach()?
        .f_mul_scalar(m)?
        .f_add(&bm.f_mul_scalar(1.0 - m)?)?;
    let run_var = var
        .f_detach()?
        .f_mul_scalar(m)?
        .f_add(&bv.f_mul_scalar(1.0 - m)?)?;
    Ok(vec![y, run_mean, run_var])
}

/// The unbiased estimate from the population variance `var` of `x`'s channels (one value
/// per channel stays as it is: there is nothing to correct, and PyTorch refuses it).
fn unbiased(var: Tensor, x: &Tensor) -> R<Tensor> {
    let n = x.numel() as f64 / x.size()[1].max(1) as f64;
    Ok(if n > 1.0 { var.f_mul_scalar(n / (n - 1.0))? } else { var })
}

/// Per-channel (dimension 1) mean and population variance.
fn batch_stats(x: &Tensor) -> R<(Tensor, Tensor)> {
    let dims: Vec<i64> = (0..x.dim() as i64).filter(|&d| d != 1).collect();
    let mean = x.f_mean_dim(dims.as_slice(), true, None)?;
    let d = x.f_sub(&mean)?;
    let var = d.f_mul(&d)?.f_mean_dim(dims.as_slice(), false, None)?;
    Ok((mean.f_reshape([-1])?, var))
}

/// LayerNormalization over dimensions `axis..`; outputs Y, Mean, InvStdDev (kept dims).
/// LayerNormalization. Outputs 1 and 2 (mean, inverse standard deviation) are
/// differentiable when `stats_read`; otherwise libtorch's fused kernel runs, whose
/// statistics carry no gradient.
pub(crate) fn layer_norm(ln: &LayerNorm, ins: &[Option<&Tensor>], stats_read: bool) -> R<Vec<Tensor>> {
    let (x, scale) = (need(ins, 0)?, need(ins, 1)?);
    let axis = norm_axis(ln.axis, x.dim())?;
    let dims: Vec<i64> = (axis..x.dim() as i64).collect();
    let k = kind(x)?;
    let normalized: Vec<i64> = x.size()[axis as usize..].to_vec();
    let bias = opt(ins, 2);
    let exact_shapes = scale.size() == normalized && bias.map_or(true, |b| b.size() == normalized);
    if !stats_read && matches!(k, Kind::Float | Kind::Double) && exact_shapes && scale.kind() == k && bias.map_or(true, |b| b.kind() == k) {
        // libtorch's fused kernel (one pass forward, one backward) computes exactly the
        // ONNX definition; its mean and rstd keep the reduced axes as 1s, as ONNX's do.
        let (y, mean, rstd) = x.f_native_layer_norm(normalized.as_slice(), Some(scale), bias, ln.epsilon as f64)?;
        return Ok(vec![y, mean, rstd]);
    }
    let half = matches!(k, Kind::Half | Kind::BFloat16);
    let xs = if ln.stash_type == 1 && half {
        x.f_to_kind(Kind::Float)?
    } else {
        x.shallow_clone()
    };
    let mean = xs.f_mean_dim(dims.as_slice(), true, None)?;
    let d = xs.f_sub(&mean)?;
    let var = d.f_mul(&d)?.f_mean_dim(dims.as_slice(), true, None)?;
    let inv = var.f_add_scalar(ln.epsilon as f64)?.f_rsqrt()?;
    let mut y = d.f_mul(&inv)?.f_to_kind(k)?.f_mul(scale)?;
    if let Some(b) = opt(ins, 2) {
        y = y.f_add(b)?;
    }
    Ok(vec![y, mean, inv])
}

/// InstanceNormalization: per (sample, channel) statistics over the spatial dimensions.
pub(crate) fn instance_norm(eps: f32, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let (x, scale, bias) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    if x.dim() < 3 {
        return Err(invalid(format!("X must have rank >= 3, got {}", x.dim())));
    }
    let dims: Vec<i64> = (2..x.dim() as i64).collect();
    let mean = x.f_mean_dim(dims.as_slice(), true, None)?;
    let d = x.f_sub(&mean)?;
    let var = d.f_mul(&d)?.f_mean_dim(dims.as_slice(), true, None)?;
    let mut cshape = vec![1i64; x.dim()];
    cshape[1] = -1;
    let y = d.f_mul(&var.f_add_scalar(eps as f64)?.f_rsqrt()?)?;
    Ok(y.f_mul(&scale.f_reshape(&cshape)?)?
        .f_add(&bias.f_reshape(&cshape)?)?)
}

/// Dropout: outputs (output, mask). Train: keep each element with probability
/// `1 - ratio` and scale by `1 / (1 - ratio)`; eval: identity with an all-true mask.
/// The `seed` attribute is not honoured (libtorch's global generator is used).
pub(crate) fn dropout(ratio: Option<f32>, ins: &[Option<&Tensor>], mode: Mode) -> R<Vec<Tensor>> {
    let x = need(ins, 0)?;
    let ratio = match (ratio, opt(ins, 1)) {
        (Some(r), _) => r as f64,
        (None, Some(t)) => scalar_f64(t)?,
        (None, None) => 0.5,
    };
    if !(0.0..1.0).contains(&ratio) {
        return Err(invalid(format!("ratio must be in [0, 1), got {ratio}")));
    }
    if mode == Mode::Eval || ratio == 0.0 {
        return Ok(vec![
            x.shallow_clone(),
            x.f_ones_like()?.f_to_kind(Kind::Bool)?,
        ]);
    }
    let mask = x.f_rand_like()?.f_ge(ratio)?;
    let y = x
        .f_mul(&mask.f_to_kind(kind(x)?)?)?
        .f_div_scalar(1.0 - ratio)?;
    Ok(vec![y, mask])
}
