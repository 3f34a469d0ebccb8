//! Conversions between [`DType`] and libtorch kinds, and between tensors and raw
//! little-endian bytes (the format of the conformance runner and the stage files).
//!
//! libtorch (through tch) has no u16, u32 or u64 kind. Tensors of those types are held in
//! a *carrier* kind, decided here only ([`carrier`]): u16 in int32 and u32 in int64 (the
//! same values, exactly), u64 in int64 (the same 64 bits; values from 2^63 up read as
//! negative). Bytes round-trip exactly through the carrier. Data movement is the same on
//! the carrier; the ops whose result depends on signedness or width run through
//! `exec::unsigned`, which the lowering selects from the operands' element types.

use tch::{Kind, Tensor};

use super::util::{bad_dtype, invalid, R};
use super::KernelError;
use pipewright_ops::DType;

/// The libtorch kind of an element type (of its holder, for the emulated low-precision
/// types). `u16`, `u32` and `u64` have no kind in tch.
pub(crate) fn kind_of(et: DType) -> R<Kind> {
    use DType::*;
    Ok(match et {
        F32 => Kind::Float,
        F16 => Kind::Half,
        Bf16 => Kind::BFloat16,
        F64 => Kind::Double,
        I64 => Kind::Int64,
        I32 => Kind::Int,
        I16 => Kind::Int16,
        I8 => Kind::Int8,
        U8 => Kind::Uint8,
        Bool => Kind::Bool,
        F8E4M3FN => Kind::Float8e4m3fn,
        F8E4M3FNUZ => Kind::Float8e4m3fnuz,
        F8E5M2 => Kind::Float8e5m2,
        F8E5M2FNUZ => Kind::Float8e5m2fnuz,
        // Held in wider tensors (see `lowp`).
        I4 | I2 => Kind::Int8,
        U4 | U2 => Kind::Uint8,
        F4E2M1 | F8E8M0 => Kind::Float,
        U16 | U32 | U64 => return Err(bad_dtype(format!("{et} has no libtorch kind through tch"))),
    })
}

/// The kind a tensor of `et` is held in: its own kind, or for u16/u32/u64 the signed
/// carrier described in the module doc.
pub(crate) fn carrier(et: DType) -> R<Kind> {
    match et {
        DType::U16 => Ok(Kind::Int),
        DType::U32 | DType::U64 => Ok(Kind::Int64),
        other => kind_of(other),
    }
}

/// Whether `et` is held in a carrier kind of another type (u16, u32, u64).
pub(crate) fn is_emulated(et: DType) -> bool {
    matches!(et, DType::U16 | DType::U32 | DType::U64)
}

/// The element type of a libtorch kind (complex and quantised kinds have none; the
/// emulated low-precision types come back as their holders).
pub(crate) fn elem_of(k: Kind) -> R<DType> {
    use DType::*;
    Ok(match k {
        Kind::Float => F32,
        Kind::Half => F16,
        Kind::BFloat16 => Bf16,
        Kind::Double => F64,
        Kind::Int64 => I64,
        Kind::Int => I32,
        Kind::Int16 => I16,
        Kind::Int8 => I8,
        Kind::Uint8 => U8,
        Kind::Bool => Bool,
        Kind::Float8e4m3fn => F8E4M3FN,
        Kind::Float8e4m3fnuz => F8E4M3FNUZ,
        Kind::Float8e5m2 => F8E5M2,
        Kind::Float8e5m2fnuz => F8E5M2FNUZ,
        k => {
            return Err(bad_dtype(format!(
                "libtorch kind {k:?} has no element type"
            )))
        }
    })
}

/// The libtorch kind of an element type, as a public error.
pub fn torch_kind(et: DType) -> Result<Kind, KernelError> {
    kind_of(et).map_err(|f| f.into_error("tensor conversion"))
}

/// The element type of a tensor.
pub fn elem_type(t: &Tensor) -> Result<DType, KernelError> {
    (|| elem_of(t.f_kind()?))().map_err(|f| f.into_error("tensor conversion"))
}

/// A CPU tensor from raw little-endian bytes (`bool`: one byte each, nonzero is true; the
/// packed 4/2-bit types low bits first, decoded into their holder type).
pub fn tensor_from_bytes(et: DType, shape: &[i64], bytes: &[u8]) -> Result<Tensor, KernelError> {
    from_bytes(et, shape, bytes).map_err(|f| f.into_error("tensor conversion"))
}

fn from_bytes(et: DType, shape: &[i64], bytes: &[u8]) -> R<Tensor> {
    if cfg!(target_endian = "big") {
        return Err(invalid(
            "raw tensor bytes are little-endian; big-endian hosts are not supported",
        ));
    }
    if shape.iter().any(|&d| d < 0) {
        return Err(invalid(format!("negative dimension in shape {shape:?}")));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize));
    let want = numel.and_then(|n| et.byte_len(n));
    if want != Some(bytes.len()) {
        return Err(invalid(format!(
            "{} bytes do not hold a {et} tensor of shape {shape:?}",
            bytes.len()
        )));
    }
    if let Some(t) = super::lowp::decode(et, shape, bytes, numel.unwrap_or(0))? {
        return Ok(t);
    }
    let kind = carrier(et)?;
    if let Some(t) = widen(et, shape, bytes)? {
        return Ok(t);
    }
    if et == DType::Bool {
        let norm: Vec<u8> = bytes.iter().map(|&b| (b != 0) as u8).collect();
        return Ok(Tensor::f_from_data_size(&norm, shape, kind)?);
    }
    Ok(Tensor::f_from_data_size(bytes, shape, kind)?)
}

/// u16 and u32 bytes widened into their carriers (u64 bytes are already int64 bytes).
fn widen(et: DType, shape: &[i64], bytes: &[u8]) -> R<Option<Tensor>> {
    let t = match et {
        DType::U16 => Tensor::f_from_slice(&bytes.chunks_exact(2).map(|c| i32::from(u16::from_le_bytes([c[0], c[1]]))).collect::<Vec<i32>>())?,
        DType::U32 => Tensor::f_from_slice(&bytes.chunks_exact(4).map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect::<Vec<i64>>())?,
        _ => return Ok(None),
    };
    Ok(Some(t.f_reshape(shape)?))
}

/// The shape and raw little-endian bytes of a tensor holding element type `et` (any
/// device), for the unsigned types held in a carrier kind (and any other type, whose
/// kind must then be its own). Carrier values outside `et`'s range are an error.
pub fn tensor_to_bytes_as(t: &Tensor, et: DType) -> Result<(Vec<i64>, Vec<u8>), KernelError> {
    to_bytes_as(t, et).map_err(|f| f.into_error("tensor conversion"))
}

fn to_bytes_as(t: &Tensor, et: DType) -> R<(Vec<i64>, Vec<u8>)> {
    let k = t.f_kind()?;
    if k != carrier(et)? {
        return Err(bad_dtype(format!("a {k:?} tensor does not hold {et} values")));
    }
    let (_, shape, bytes) = to_bytes(t)?;
    let narrow = |width: usize, max: u64| -> R<Vec<u8>> {
        let src = bytes.len() / t.numel().max(1);
        let mut out = Vec::with_capacity(bytes.len() / src * width);
        for c in bytes.chunks_exact(src) {
            let mut w = [0u8; 8];
            w[..src].copy_from_slice(c);
            let v = if src == 4 { i64::from(i32::from_le_bytes([w[0], w[1], w[2], w[3]])) } else { i64::from_le_bytes(w) };
            if v < 0 || v as u64 > max {
                return Err(invalid(format!("value {v} is outside the range of {et}")));
            }
            out.extend_from_slice(&(v as u64).to_le_bytes()[..width]);
        }
        Ok(out)
    };
    let bytes = match et {
        DType::U16 => narrow(2, u64::from(u16::MAX))?,
        DType::U32 => narrow(4, u64::from(u32::MAX))?,
        _ => bytes,
    };
    Ok((shape, bytes))
}

/// The element type, shape and raw little-endian bytes of a tensor (any device). The
/// element type is read from the kind, so a u16/u32/u64 tensor reports its carrier's type
/// (see [`tensor_to_bytes_as`]); the emulated low-precision types come back as their
/// holders.
pub fn tensor_to_bytes(t: &Tensor) -> Result<(DType, Vec<i64>, Vec<u8>), KernelError> {
    to_bytes(t).map_err(|f| f.into_error("tensor conversion"))
}

fn to_bytes(t: &Tensor) -> R<(DType, Vec<i64>, Vec<u8>)> {
    if cfg!(target_endian = "big") {
        return Err(invalid(
            "raw tensor bytes are little-endian; big-endian hosts are not supported",
        ));
    }
    let et = elem_of(t.f_kind()?)?;
    let shape = t.size();
    let cpu = t.f_detach()?.f_to(tch::Device::Cpu)?.f_contiguous()?;
    let numel = cpu.numel();
    let mut bytes = vec![0u8; numel * et.size()];
    if numel > 0 {
        cpu.f_copy_data_u8(&mut bytes, numel)?;
    }
    Ok((et, shape, bytes))
}
