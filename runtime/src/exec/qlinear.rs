//! Integer and quantized products, as the ONNX reference computes them: the (u)int8
//! operands less their zero points are multiplied exactly (in f64, exact for int32
//! accumulators below 2^53), giving int32 (MatMulInteger, ConvInteger); the QLinear ops
//! scale that by `a_scale * b_scale / y_scale` (computed in the scales' own type, as the
//! reference does), add the output zero point, round half to even and saturate to the
//! output type. None of these is differentiable.

use tch::{Kind, Tensor};

use super::util::{bad_dtype, kind, need, opt, R};
use super::window;
use pipewright_ops::op::Conv;

/// An integer operand less its optional zero point, in f64. A 1-D zero point broadcasts
/// along the last axis (numpy's rule, as the reference applies it), unless `per_channel`
/// puts it on axis 0 (convolution weights, one per output channel).
fn centered(x: &Tensor, zp: Option<&Tensor>, per_channel: bool) -> R<Tensor> {
    let k = kind(x)?;
    if !matches!(k, Kind::Int8 | Kind::Uint8) {
        return Err(bad_dtype(format!("quantized operands must be int8 or uint8, got {k:?}")));
    }
    let v = x.f_to_kind(Kind::Double)?;
    let Some(zp) = zp else { return Ok(v) };
    let z = zp.f_to_kind(Kind::Double)?;
    let z = if per_channel && z.dim() == 1 && z.size()[0] == x.size()[0] {
        let mut shape = vec![1i64; x.dim()];
        shape[0] = z.size()[0];
        z.f_reshape(&shape)?
    } else {
        z
    };
    Ok(v.f_sub(&z)?)
}

/// MatMulInteger: `(A - a_zero_point) @ (B - b_zero_point)` in int32.
pub(crate) fn matmul_integer(ins: &[Option<&Tensor>]) -> R<Tensor> {
    let a = centered(need(ins, 0)?, opt(ins, 2), false)?;
    let b = centered(need(ins, 1)?, opt(ins, 3), false)?;
    Ok(a.f_matmul(&b)?.f_to_kind(Kind::Int)?)
}

/// ConvInteger: the convolution of the centred operands in int32; a 1-D weight zero
/// point is per output channel.
pub(crate) fn conv_integer(c: &Conv, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = centered(need(ins, 0)?, opt(ins, 2), false)?;
    let w = centered(need(ins, 1)?, opt(ins, 3), true)?;
    Ok(window::conv(c, &x, &w, None)?.f_to_kind(Kind::Int)?)
}

/// QLinearMatMul: the exact product of the centred operands, requantized.
pub(crate) fn qlinear_matmul(ins: &[Option<&Tensor>]) -> R<Tensor> {
    let a = centered(need(ins, 0)?, opt(ins, 2), false)?;
    let b = centered(need(ins, 3)?, opt(ins, 5), false)?;
    let acc = a.f_matmul(&b)?;
    let scale = need(ins, 1)?.f_mul(need(ins, 4)?)?.f_div(need(ins, 6)?)?;
    requantize(&acc, &scale, opt(ins, 7), kind(need(ins, 0)?)?)
}

/// QLinearConv: the exact convolution of the centred operands plus the int32 bias,
/// requantized; a 1-D weight scale (or zero point) is per output channel.
pub(crate) fn qlinear_conv(c: &Conv, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = centered(need(ins, 0)?, opt(ins, 2), false)?;
    let w = centered(need(ins, 3)?, opt(ins, 5), true)?;
    let bias = opt(ins, 8).map(|b| b.f_to_kind(Kind::Double)).transpose()?;
    let acc = window::conv(c, &x, &w, bias.as_ref())?;
    let channel = |t: &Tensor| -> R<Tensor> {
        if t.dim() == 1 && t.numel() > 1 {
            let mut shape = vec![1i64; acc.dim()];
            shape[1] = t.numel() as i64;
            Ok(t.f_reshape(&shape)?)
        } else {
            Ok(t.shallow_clone())
        }
    };
    let scale = need(ins, 1)?.f_mul(&channel(need(ins, 4)?)?)?.f_div(need(ins, 6)?)?;
    requantize(&acc, &scale, opt(ins, 7), kind(need(ins, 0)?)?)
}

/// `round_half_even(acc * scale + zero_point)` saturated to the zero point's type (or
/// `fallback`, the input's, without one). `scale` keeps the rounding of its own type.
fn requantize(acc: &Tensor, scale: &Tensor, zp: Option<&Tensor>, fallback: Kind) -> R<Tensor> {
    let out = match zp {
        Some(z) => kind(z)?,
        None => fallback,
    };
    let (lo, hi) = match out {
        Kind::Int8 => (-128.0, 127.0),
        Kind::Uint8 => (0.0, 255.0),
        k => return Err(bad_dtype(format!("quantized outputs must be int8 or uint8, got {k:?}"))),
    };
    let mut y = acc.f_mul(&scale.f_to_kind(Kind::Double)?)?;
    if let Some(z) = zp {
        y = y.f_add(&z.f_to_kind(Kind::Double)?)?;
    }
    Ok(y.f_round()?.f_clamp(lo, hi)?.f_to_kind(out)?)
}
