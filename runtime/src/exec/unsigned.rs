//! Kernels on the unsigned types libtorch lacks (u16, u32, u64), held in a signed carrier
//! kind (see `convert`): u16 in int32 and u32 in int64 keep their values, so only results
//! that can leave the type's range need their low bits taken (Add, Sub, Mul, Sum, left
//! shifts, BitwiseNot); u64 in int64 keeps its bits, so comparisons, Min/Max and TopK
//! order by the value with the sign bit flipped (which orders int64 as unsigned), and
//! Div/Mod use an unsigned long division. Ops not listed here are refused rather than
//! computed with signed semantics.

use tch::{Kind, Tensor};

use super::bits;
use super::convert::is_emulated;
use super::elementwise;
use super::index;
use super::quant;
use super::util::{bad_dtype, need, R};
use pipewright_ops::{DType, Op};
use pipewright_ops::op::{BinaryOp, UnaryOp, VariadicOp};

/// Runs `k` whose inputs have the element types `types` (at least one emulated) and
/// whose first output is declared `out`.
pub(crate) fn run(k: &Op, types: &[Option<DType>], out: Option<DType>, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let Some(et) = types.iter().flatten().copied().find(|t| is_emulated(*t)) else {
        return Err(bad_dtype("internal: unsigned kernel without an unsigned operand"));
    };
    let refuse = || bad_dtype(format!("{} on {et} (held in a wider libtorch kind) is not supported", k.name()));
    let x = || need(ins, 0);
    Ok(vec![match k {
        Op::Binary(BinaryOp::Pow) if types.first().copied().flatten().is_some_and(|t| t.is_float()) => {
            elementwise::binary(BinaryOp::Pow, x()?, &to_float(need(ins, 1)?, et, x()?.f_kind()?)?)?
        }
        Op::Binary(b) if types.iter().take(2).all(|t| *t == Some(et)) => binary(*b, et, x()?, need(ins, 1)?)?,
        Op::Unary(UnaryOp::BitNot) => bits::not(x()?, Some(et))?,
        Op::Unary(UnaryOp::Identity) => x()?.shallow_clone(),
        Op::Variadic(v) if types.iter().all(|t| *t == Some(et)) => variadic(*v, et, ins).map_err(|_| refuse())?,
        Op::TopK { axis, largest, .. } => return top_k(et, x()?, need(ins, 1)?, *axis, *largest),
        // The carrier holds the values themselves, which is all (de)quantization reads.
        Op::QuantizeLinear(q) => quant::quantize(x()?, need(ins, 1)?, ins.get(2).copied().flatten(), q, out)?,
        Op::DequantizeLinear { axis, block_size, output_dtype } => {
            quant::dequantize(x()?, need(ins, 1)?, ins.get(2).copied().flatten(), *axis, *block_size, out.or(*output_dtype))?
        }
        _ => return Err(refuse()),
    }])
}

fn binary(b: BinaryOp, et: DType, x: &Tensor, y: &Tensor) -> R<Tensor> {
    use BinaryOp::*;
    let e = Some(et);
    Ok(match b {
        // Wrapping int64 arithmetic keeps the low bits exact.
        Add => bits::truncate(&x.f_add(y)?, e)?,
        Sub => bits::truncate(&x.f_sub(y)?, e)?,
        Mul => bits::truncate(&x.f_mul(y)?, e)?,
        Div => divide(et, x, y)?,
        // Both Mod forms agree on non-negative values.
        Mod | Fmod => x.f_sub(&divide(et, x, y)?.f_mul(y)?)?,
        Equal => x.f_eq_tensor(y)?,
        Less => key(et, x)?.f_lt_tensor(&key(et, y)?)?,
        Greater => key(et, x)?.f_gt_tensor(&key(et, y)?)?,
        LessOrEqual => key(et, x)?.f_le_tensor(&key(et, y)?)?,
        GreaterOrEqual => key(et, x)?.f_ge_tensor(&key(et, y)?)?,
        BitAnd => bits::logic('&', x, y)?,
        BitOr => bits::logic('|', x, y)?,
        BitXor => bits::logic('^', x, y)?,
        ShiftLeft => bits::shift(x, y, true, e)?,
        ShiftRight => bits::shift(x, y, false, e)?,
        other => return Err(bad_dtype(format!("{other:?} on {et} is not supported"))),
    })
}

/// A tensor whose signed order is the unsigned order of the values: u64 bit patterns with
/// the sign bit flipped; u16/u32 carriers already hold the values.
fn key(et: DType, x: &Tensor) -> R<Tensor> {
    Ok(if et == DType::U64 { x.f_bitwise_xor(i64::MIN)? } else { x.shallow_clone() })
}

/// Unsigned division truncating toward zero (by zero: libtorch's error).
fn divide(et: DType, n: &Tensor, d: &Tensor) -> R<Tensor> {
    if et != DType::U64 {
        return Ok(n.f_div_tensor_mode(d, "trunc")?);
    }
    // A divisor of 2^63 or more (negative as int64) goes at most once. Any other one
    // divides half the dividend (non-negative), which gives the quotient to within one;
    // the remainder decides the last step (Hacker's Delight, `divlu`).
    let big = d.f_lt(0)?;
    let once = key(et, n)?.f_ge_tensor(&key(et, d)?)?.f_to_kind(Kind::Int64)?;
    let d1 = d.f_ones_like()?.f_where_self(&big, d)?;
    let half = n.f_bitwise_right_shift_tensor_scalar(1)?.f_bitwise_and(i64::MAX)?;
    let q = half.f_div_tensor_mode(&d1, "trunc")?.f_bitwise_left_shift_tensor_scalar(1)?;
    let r = n.f_sub(&q.f_mul(&d1)?)?;
    let q = q.f_add(&key(et, &r)?.f_ge_tensor(&key(et, &d1)?)?.f_to_kind(Kind::Int64)?)?;
    Ok(once.f_where_self(&big, &q)?)
}

/// Unsigned values as floats of kind `k` (u64 patterns from 2^63 up add 2^64).
fn to_float(x: &Tensor, et: DType, k: Kind) -> R<Tensor> {
    let f = x.f_to_kind(Kind::Double)?;
    let f = if et == DType::U64 { f.f_add_scalar(18_446_744_073_709_551_616.0)?.f_where_self(&x.f_lt(0)?, &f)? } else { f };
    Ok(f.f_to_kind(k)?)
}

fn variadic(v: VariadicOp, et: DType, ins: &[Option<&Tensor>]) -> R<Tensor> {
    if v == VariadicOp::Mean {
        return Err(bad_dtype("Mean"));
    }
    let mut acc = need(ins, 0)?.shallow_clone();
    for i in 1..ins.len() {
        let y = need(ins, i)?;
        acc = match v {
            VariadicOp::Sum => bits::truncate(&acc.f_add(y)?, Some(et))?,
            VariadicOp::Max => acc.f_where_self(&key(et, &acc)?.f_ge_tensor(&key(et, y)?)?, y)?,
            VariadicOp::Min => acc.f_where_self(&key(et, &acc)?.f_le_tensor(&key(et, y)?)?, y)?,
            VariadicOp::Mean => return Err(bad_dtype("Mean")),
        };
    }
    Ok(acc)
}

/// TopK ordered by the unsigned value; the flip of the sign bit is undone on the values.
fn top_k(et: DType, x: &Tensor, k: &Tensor, axis: i64, largest: bool) -> R<Vec<Tensor>> {
    let mut outs = index::top_k(&key(et, x)?, k, axis, largest)?;
    outs[0] = key(et, &outs[0])?;
    Ok(outs)
}
