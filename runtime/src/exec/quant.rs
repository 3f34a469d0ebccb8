//! QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear (inference only: rounding
//! has no useful gradient, and the ops compute as ONNX's reference does).
//!
//! The scale and zero point apply per tensor (one element), per axis (a vector along
//! `axis`) or per block (x's shape with `axis` cut into blocks of `block_size`; each block
//! value is repeated over its block, the last block possibly short).

use tch::{Kind, Tensor};

use super::convert::{carrier, elem_of, kind_of};
use super::lowp;
use super::util::{invalid, R};
use pipewright_ops::DType;
use pipewright_ops::op::{CastMode, Quantize, RoundMode};

/// `param` (scale or zero point) shaped to broadcast against `x`.
fn expand(param: &Tensor, x: &Tensor, axis: i64, block_size: i64) -> R<Tensor> {
    let r = x.dim() as i64;
    if param.numel() == 1 && block_size == 0 {
        return Ok(param.f_reshape([] as [i64; 0])?);
    }
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..r).contains(&a) {
        return Err(invalid(format!("axis {axis} out of range for rank {r}")));
    }
    let n = x.size()[a as usize];
    if block_size == 0 {
        if param.size() != [n] {
            return Err(invalid(format!("a per-axis parameter must be [{n}], got {:?}", param.size())));
        }
        let mut dims = vec![1i64; r as usize];
        dims[a as usize] = n;
        return Ok(param.f_reshape(&dims)?);
    }
    let rep = param.f_repeat_interleave_self_int(block_size, a, None::<i64>)?;
    if param.dim() as i64 != r || rep.size()[a as usize] < n {
        return Err(invalid(format!("blocked parameter {:?} does not cover x {:?} in blocks of {block_size}", param.size(), x.size())));
    }
    let rep = rep.f_narrow(a, 0, n)?;
    if rep.size() != x.size() {
        return Err(invalid(format!("blocked parameter {:?} does not match x {:?} off axis {axis}", param.size(), x.size())));
    }
    Ok(rep)
}

/// The integer range of a quantized integer type.
fn int_range(t: DType) -> Option<(f64, f64)> {
    use DType::*;
    Some(match t {
        U8 => (0.0, 255.0),
        I8 => (-128.0, 127.0),
        U16 => (0.0, 65535.0),
        I16 => (-32768.0, 32767.0),
        U4 => (0.0, 15.0),
        I4 => (-8.0, 7.0),
        U2 => (0.0, 3.0),
        I2 => (-2.0, 1.0),
        _ => return None,
    })
}

/// `to`: the output type the program declares (an `i4` output lives in an `i8` tensor),
/// else the attribute's, else the zero point's, else u8.
pub(crate) fn quantize(x: &Tensor, scale: &Tensor, zp: Option<&Tensor>, q: &Quantize, to: Option<DType>) -> R<Tensor> {
    let to = match (to.or(q.output_dtype), zp) {
        (Some(t), _) => t,
        (None, Some(z)) => elem_of(z.f_kind()?)?,
        (None, None) => DType::U8,
    };
    let s = expand(scale, x, q.axis, q.block_size)?;
    let scaled = match q.precision {
        Some(p) => x.f_to_kind(kind_of(p)?)?.f_div(&s.f_to_kind(kind_of(p)?)?)?,
        None => x.f_div(&s)?,
    };
    let zp = zp.map(|z| expand(z, x, q.axis, q.block_size)).transpose()?;
    if let Some((lo, hi)) = int_range(to) {
        // Round half to even, add the zero point, clamp: in f64, where every sum is exact.
        let mut y = scaled.f_round()?.f_to_kind(Kind::Double)?;
        if let Some(z) = &zp {
            y = y.f_add(&z.f_to_kind(Kind::Double)?)?;
        }
        // u16 results live in their carrier kind (see `convert`).
        return Ok(y.f_clamp(lo, hi)?.f_to_kind(carrier(to)?)?);
    }
    let mode = CastMode { saturate: q.saturate, round: RoundMode::Up };
    match to {
        // The float8 zero point must be zero and is not added (as the reference).
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ => lowp::cast(&scaled, to, mode),
        DType::F4E2M1 => {
            let y = match &zp {
                Some(z) => scaled.f_add(&z.f_to_kind(scaled.f_kind()?)?)?,
                None => scaled,
            };
            lowp::cast(&y, to, mode)
        }
        other => Err(invalid(format!("{other} is not a quantized type"))),
    }
}

/// `(x - zero_point) * scale` in f32, then the output type (`to`, else the scale's).
pub(crate) fn dequantize(x: &Tensor, scale: &Tensor, zp: Option<&Tensor>, axis: i64, block_size: i64, to: Option<DType>) -> R<Tensor> {
    let mut dx = x.f_to_kind(Kind::Float)?;
    // Float inputs (float8, and f4e2m1 in its f32 holder) take no zero point: the
    // reference requires it to be zero and ignores it.
    if let Some(z) = zp.filter(|_| !x.is_floating_point()) {
        dx = dx.f_sub(&expand(z, x, axis, block_size)?.f_to_kind(Kind::Float)?)?;
    }
    let s = expand(scale, x, axis, block_size)?;
    let out = match to {
        Some(t) => kind_of(t)?,
        None => s.f_kind()?,
    };
    Ok(dx.f_mul(&s.f_to_kind(Kind::Float)?)?.f_to_kind(out)?)
}

/// u8 quantization over x's range extended to include 0: scale `(max - min) / 255` (1/255
/// for a constant zero range, as the reference), zero point `round(-min / scale)`.
pub(crate) fn dynamic_quantize(x: &Tensor) -> R<Vec<Tensor>> {
    if x.numel() == 0 {
        return Err(invalid("x is empty: its range is undefined"));
    }
    let xf = x.f_to_kind(Kind::Float)?;
    let zero = Tensor::f_zeros([] as [i64; 0], (Kind::Float, x.device()))?;
    let maxx = xf.f_max()?.f_maximum(&zero)?;
    let minx = xf.f_min()?.f_minimum(&zero)?;
    let range = maxx.f_sub(&minx)?;
    let range = range.f_masked_fill(&range.f_eq(0.0)?, 1.0)?;
    let scale = range.f_div_scalar(255.0)?;
    let zp = minx.f_neg()?.f_div(&scale)?.f_clamp(0.0, 255.0)?.f_round()?;
    let y = xf.f_div(&scale)?.f_round()?.f_add(&zp)?.f_clamp(0.0, 255.0)?.f_to_kind(Kind::Uint8)?;
    Ok(vec![y, scale.f_to_kind(x.f_kind()?)?, zp.f_to_kind(Kind::Uint8)?])
}
