//! Bitwise kernels on integer tensors: BitwiseAnd/Or/Xor/Not and BitShift, for the kinds
//! libtorch has and for the unsigned types held in a carrier kind (see `convert`).

use tch::{Kind, Tensor};

use super::util::{bad_dtype, kind, R};
use pipewright_ops::DType;

/// The integer width and signedness of a tensor of kind `k`, or of the emulated unsigned
/// type `emulated` it carries.
fn width(k: Kind, emulated: Option<DType>) -> R<(i64, bool)> {
    Ok(match (emulated, k) {
        (Some(DType::U16), _) => (16, true),
        (Some(DType::U32), _) => (32, true),
        (Some(DType::U64), _) => (64, true),
        (_, Kind::Uint8) => (8, true),
        (_, Kind::Int8) => (8, false),
        (_, Kind::Int16) => (16, false),
        (_, Kind::Int) => (32, false),
        (_, Kind::Int64) => (64, false),
        (e, k) => return Err(bad_dtype(format!("bitwise ops need integer inputs, got {k:?}{}", e.map(|e| format!(" ({e})")).unwrap_or_default()))),
    })
}

/// BitwiseAnd/Or/Xor: the carriers hold the same low bits, so the native op is exact.
pub(crate) fn logic(op: char, x: &Tensor, y: &Tensor) -> R<Tensor> {
    width(kind(x)?, None).or_else(|_| width(kind(y)?, None))?;
    Ok(match op {
        '&' => x.f_bitwise_and_tensor(y)?,
        '|' => x.f_bitwise_or_tensor(y)?,
        _ => x.f_bitwise_xor_tensor(y)?,
    })
}

/// BitwiseNot; an emulated u16/u32 flips only its own bits.
pub(crate) fn not(x: &Tensor, emulated: Option<DType>) -> R<Tensor> {
    let (bits, _) = width(kind(x)?, emulated)?;
    match emulated {
        Some(DType::U16 | DType::U32) => Ok(x.f_bitwise_xor((1i64 << bits) - 1)?),
        _ => Ok(x.f_bitwise_not()?),
    }
}

/// The low `bits` bits of a carrier value (u16 in int32, u32 in int64).
pub(crate) fn truncate(x: &Tensor, emulated: Option<DType>) -> R<Tensor> {
    Ok(match emulated {
        Some(DType::U16) => x.f_bitwise_and(0xFFFFi64)?,
        Some(DType::U32) => x.f_bitwise_and(0xFFFF_FFFFi64)?,
        _ => x.shallow_clone(),
    })
}

/// BitShift with opset 28's rule for shifts outside `0..bits` (negative, or at least the
/// width): 0, or -1 for a right shift of a negative signed value. Unsigned right shifts
/// are logical, signed ones arithmetic; left shifts drop the bits past the width.
pub(crate) fn shift(x: &Tensor, s: &Tensor, left: bool, emulated: Option<DType>) -> R<Tensor> {
    let (bits, unsigned) = width(kind(x)?, emulated)?;
    // libtorch's shifts are undefined outside 0..bits, so the amount is clamped and the
    // out-of-range lanes replaced afterwards.
    let valid = s.f_ge(0)?.f_logical_and(&s.f_lt(bits)?)?;
    let sc = s.f_clamp(0, bits - 1)?;
    let zero = x.f_zeros_like()?;
    if left {
        let r = truncate(&x.f_bitwise_left_shift(&sc)?, emulated)?;
        return Ok(r.f_where_self(&valid, &zero)?);
    }
    let r = if emulated == Some(DType::U64) { logical_right(x, &sc)? } else { x.f_bitwise_right_shift(&sc)? };
    let fill = if unsigned { zero } else { x.f_ones_like()?.f_neg()?.f_where_self(&x.f_lt(0)?, &zero)? };
    Ok(r.f_where_self(&valid, &fill)?)
}

/// Logical right shift of int64 bit patterns by amounts in `0..64`: one arithmetic shift
/// with the sign bit cleared makes the value non-negative, after which the arithmetic
/// shift is logical.
pub(crate) fn logical_right(x: &Tensor, s: &Tensor) -> R<Tensor> {
    let half = x.f_bitwise_right_shift_tensor_scalar(1)?.f_bitwise_and(i64::MAX)?;
    let rest = half.f_bitwise_right_shift(&s.f_sub_scalar(1)?.f_clamp_min(0)?)?;
    Ok(rest.f_where_self(&s.f_ne(0)?, x)?)
}

/// BitCast: the input's bits read as `to` (declared input type `from`, else the tensor's
/// kind). The unsigned types held in a wider carrier (u16 in int32, u32 in int64) pass
/// through the signed kind of their own width, whose bits they are.
pub(crate) fn bitcast(x: &Tensor, from: Option<DType>, to: DType) -> R<Tensor> {
    let from = match from {
        Some(t) => t,
        None => super::convert::elem_of(kind(x)?)?,
    };
    let same_width = |t: DType| -> R<Kind> {
        match t {
            DType::U16 => Ok(Kind::Int16),
            DType::U32 => Ok(Kind::Int),
            DType::U64 => Ok(Kind::Int64),
            t if t.is_low_precision() => Err(bad_dtype(format!("BitCast of {t} is not supported"))),
            t => super::convert::kind_of(t),
        }
    };
    // Narrowing a carrier keeps its low bits: the value's own bits.
    let raw = x.f_to_kind(same_width(from)?)?;
    let cast = raw.f_view_dtype(same_width(to)?)?;
    Ok(match to {
        DType::U16 | DType::U32 => truncate(&cast.f_to_kind(super::convert::carrier(to)?)?, Some(to))?,
        _ => cast,
    })
}
