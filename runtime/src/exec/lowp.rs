//! The low-precision element types in libtorch, and casts into them with ONNX semantics.
//!
//! Representation (the type's [`DType::holder`]):
//! - the four float8 types are libtorch's own float8 kinds;
//! - `i4`/`i2` live in i8 tensors and `u4`/`u2` in u8 tensors, holding the value itself;
//! - `f4e2m1` and `f8e8m0` live in f32 tensors holding the exact value (every `f4e2m1`
//!   value, and every power of two from 2^-127 to 2^127, is an f32).
//!
//! So a cast *from* any of them is a plain value conversion, and a tensor's kind does not
//! tell `i4` from `i8`: the IR keeps the declared types and lowering resolves casts and
//! quantization targets. Casts *into* them round as ONNX's reference does:
//! - float8: round to nearest even (libtorch's conversion); with `saturate`, values beyond
//!   the largest finite value (infinities included) are clamped to it first, without it
//!   they become NaN (or infinity for `e5m2`), as libtorch converts;
//! - 4/2-bit integers: non-finite values become 0, the rest truncate toward zero and wrap
//!   modulo 2^bits (the reference's `astype`);
//! - `f4e2m1`: round to nearest even on its grid, saturating at ±6, NaN to 0;
//! - `f8e8m0`: on the f32 exponent bits, rounding up, down or to nearest as `round_mode`
//!   says, saturating at 2^127 unless `saturate` is off; NaN and infinities give NaN.

use tch::{Kind, Tensor};

use super::convert::kind_of;
use super::util::R;
use pipewright_ops::DType;
use pipewright_ops::op::{CastMode, RoundMode};

/// Casts `x` to `to` (a tensor of `to`'s holder kind).
pub(crate) fn cast(x: &Tensor, to: DType, mode: CastMode) -> R<Tensor> {
    use DType::*;
    match to {
        F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ => to_float8(x, to, mode.saturate),
        I4 => wrap_int(x, 4, true),
        U4 => wrap_int(x, 4, false),
        I2 => wrap_int(x, 2, true),
        U2 => wrap_int(x, 2, false),
        F4E2M1 => to_f4e2m1(x),
        F8E8M0 => to_e8m0(x, mode),
        _ => Ok(x.f_to_kind(kind_of(to)?)?),
    }
}

/// The largest finite value of a float8 type.
pub(crate) fn float8_max(t: DType) -> f64 {
    match t {
        DType::F8E4M3FN => 448.0,
        DType::F8E4M3FNUZ => 240.0,
        _ => 57344.0,
    }
}

fn as_float(x: &Tensor) -> R<Tensor> {
    Ok(if x.is_floating_point() { x.shallow_clone() } else { x.f_to_kind(Kind::Float)? })
}

fn to_float8(x: &Tensor, to: DType, saturate: bool) -> R<Tensor> {
    let mut xf = as_float(x)?;
    if saturate {
        let m = float8_max(to);
        // clamp keeps NaN; infinities clamp to the largest finite value, as the reference.
        xf = xf.f_clamp(-m, m)?;
    }
    Ok(xf.f_to_kind(kind_of(to)?)?)
}

/// Truncation toward zero, then two's complement wrapping to `bits` bits.
fn wrap_int(x: &Tensor, bits: u32, signed: bool) -> R<Tensor> {
    let v = if x.is_floating_point() { x.f_nan_to_num(0.0, 0.0, 0.0)?.f_trunc()?.f_to_kind(Kind::Int64)? } else { x.f_to_kind(Kind::Int64)? };
    let m = 1i64 << bits;
    let off = if signed { m / 2 } else { 0 };
    let w = v.f_add_scalar(off)?.f_remainder(m)?.f_sub_scalar(off)?;
    Ok(w.f_to_kind(if signed { Kind::Int8 } else { Kind::Uint8 })?)
}

/// Round to nearest even on the `f4e2m1` grid: steps of 0.5 below 2, 1 up to 4, 2 up to 6.
fn to_f4e2m1(x: &Tensor) -> R<Tensor> {
    let xf = as_float(x)?.f_to_kind(Kind::Float)?;
    // NaN to 0; infinities to a large finite value that saturates below.
    let a = xf.f_abs()?.f_nan_to_num(0.0, 1e30, 0.0)?;
    // a = m * 2^e with m in [0.5, 1): the binade's exponent is e - 1, its step 2^(e - 2);
    // below 1 the subnormal step 0.5, above 4 the top binade's step 2.
    let (_, e) = a.f_frexp()?;
    let step = e.f_to_kind(Kind::Float)?.f_sub_scalar(2.0)?.f_clamp(-1.0, 1.0)?.f_exp2()?;
    let y = a.f_div(&step)?.f_round()?.f_mul(&step)?.f_clamp_max(6.0)?;
    Ok(y.f_copysign(&xf)?)
}

/// `f8e8m0` from the f32 exponent and fraction bits (the sign is ignored, as the reference).
fn to_e8m0(x: &Tensor, mode: CastMode) -> R<Tensor> {
    let bits = as_float(x)?.f_to_kind(Kind::Float)?.f_contiguous()?.f_view_dtype(Kind::Int)?.f_to_kind(Kind::Int64)?;
    let u = bits.f_remainder(1i64 << 32)?;
    let exp = u.f_floor_divide_scalar(1i64 << 23)?.f_remainder(256)?;
    let frac = u.f_remainder(1i64 << 23)?;
    let special = exp.f_eq(255)?;
    let round_up = match mode.round {
        RoundMode::Down => frac.f_zeros_like()?.f_to_kind(Kind::Bool)?,
        RoundMode::Up => frac.f_gt(0)?,
        RoundMode::Nearest => {
            let g = frac.f_ge(1i64 << 22)?;
            let r = frac.f_floor_divide_scalar(1i64 << 21)?.f_remainder(2)?.f_eq(1)?;
            let s = frac.f_remainder(1i64 << 21)?.f_gt(0)?;
            let lsb = exp.f_gt(0)?;
            g.f_logical_and(&r.f_logical_or(&s)?.f_logical_or(&lsb)?)?
        }
    };
    let round_up = if mode.saturate { round_up.f_logical_and(&exp.f_ne(254)?)? } else { round_up };
    let code = exp.f_add(&round_up.f_to_kind(Kind::Int64)?)?;
    let value = code.f_to_kind(Kind::Double)?.f_sub_scalar(127.0)?.f_exp2()?;
    let nan = special.f_logical_or(&code.f_eq(255)?)?;
    Ok(value.f_masked_fill(&nan, f64::NAN)?.f_to_kind(Kind::Float)?)
}

/// Values of raw low-precision data that libtorch has no kind for, as holder tensors:
/// `Some` for the packed 4/2-bit types, `f4e2m1` and `f8e8m0`; `None` for the rest.
pub(crate) fn decode(et: DType, shape: &[i64], bytes: &[u8], numel: usize) -> R<Option<Tensor>> {
    use DType::*;
    let per = et.per_byte();
    let code = |i: usize| -> u8 {
        let bits = 8 / per;
        (bytes[i / per] >> (bits * (i % per))) & (((1u16 << bits) - 1) as u8)
    };
    let t = match et {
        I4 | I2 => {
            let bits = 8 / per as u32;
            let v: Vec<i8> = (0..numel).map(|i| ((code(i) << (8 - bits)) as i8) >> (8 - bits)).collect();
            Tensor::f_from_slice(&v)?
        }
        U4 | U2 => Tensor::f_from_slice(&(0..numel).map(code).collect::<Vec<u8>>())?,
        F4E2M1 => Tensor::f_from_slice(&(0..numel).map(|i| f4e2m1_value(code(i))).collect::<Vec<f32>>())?,
        F8E8M0 => Tensor::f_from_slice(&bytes.iter().map(|&c| e8m0_value(c)).collect::<Vec<f32>>())?,
        _ => return Ok(None),
    };
    Ok(Some(t.f_reshape(shape)?))
}

fn f4e2m1_value(c: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[(c & 7) as usize];
    if c & 8 != 0 { -m } else { m }
}

fn e8m0_value(c: u8) -> f32 {
    if c == 0xFF { f32::NAN } else { 2f64.powi(c as i32 - 127) as f32 }
}
