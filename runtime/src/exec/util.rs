//! Shared helpers of the kernels: the internal error type, input access, reading small
//! integer tensors (shapes, axes), axis normalisation and explicit padding.

use tch::{Kind, TchError, Tensor};

/// What went wrong inside a kernel; `run` adds the op name (see `KernelError`).
#[derive(Debug)]
pub(crate) enum Fail {
    Missing(usize),
    Unsupported(String),
    DType(String),
    Invalid(String),
    Torch(TchError),
}

impl From<TchError> for Fail {
    fn from(e: TchError) -> Self {
        Fail::Torch(e)
    }
}

pub(crate) type R<T> = Result<T, Fail>;

pub(crate) fn unsupported(msg: impl Into<String>) -> Fail {
    Fail::Unsupported(msg.into())
}

pub(crate) fn invalid(msg: impl Into<String>) -> Fail {
    Fail::Invalid(msg.into())
}

pub(crate) fn bad_dtype(msg: impl Into<String>) -> Fail {
    Fail::DType(msg.into())
}

/// Input `i`, which the op requires.
pub(crate) fn need<'a>(ins: &[Option<&'a Tensor>], i: usize) -> R<&'a Tensor> {
    opt(ins, i).ok_or(Fail::Missing(i))
}

/// Input `i` when present (absent or empty-named ONNX inputs are `None`).
pub(crate) fn opt<'a>(ins: &[Option<&'a Tensor>], i: usize) -> Option<&'a Tensor> {
    ins.get(i).copied().flatten()
}

/// All inputs, each required (variadic ops).
pub(crate) fn all<'a>(ins: &[Option<&'a Tensor>]) -> R<Vec<&'a Tensor>> {
    (0..ins.len()).map(|i| need(ins, i)).collect()
}

pub(crate) fn kind(t: &Tensor) -> R<Kind> {
    Ok(t.f_kind()?)
}

pub(crate) fn is_float_kind(k: Kind) -> bool {
    matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

pub(crate) fn is_int_kind(k: Kind) -> bool {
    matches!(
        k,
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64
    )
}

/// The values of a small integer tensor (shape, axes, pads, ...), flattened.
pub(crate) fn ints(t: &Tensor) -> R<Vec<i64>> {
    let flat = super::host::on_host(t)?
        .f_to_kind(Kind::Int64)?
        .f_reshape([-1])?;
    Ok(Vec::<i64>::try_from(&flat)?)
}

/// The single value of a scalar (or one-element) tensor as `f64`.
pub(crate) fn scalar_f64(t: &Tensor) -> R<f64> {
    let flat = super::host::on_host(t)?
        .f_to_kind(Kind::Double)?
        .f_reshape([-1])?;
    match Vec::<f64>::try_from(&flat)?.as_slice() {
        [v] => Ok(*v),
        v => Err(invalid(format!(
            "expected a scalar, got {} elements",
            v.len()
        ))),
    }
}

/// The single value of a scalar (or one-element) integer tensor.
pub(crate) fn scalar_i64(t: &Tensor) -> R<i64> {
    match ints(t)?.as_slice() {
        [v] => Ok(*v),
        v => Err(invalid(format!(
            "expected a scalar, got {} elements",
            v.len()
        ))),
    }
}

/// Normalises a possibly negative axis against `rank`.
pub(crate) fn norm_axis(axis: i64, rank: usize) -> R<i64> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&a) {
        Ok(a)
    } else {
        Err(invalid(format!(
            "axis {axis} is out of range for rank {rank}"
        )))
    }
}

/// Normalises a list of axes, rejecting duplicates.
pub(crate) fn norm_axes(axes: &[i64], rank: usize) -> R<Vec<i64>> {
    let mut out = axes
        .iter()
        .map(|&a| norm_axis(a, rank))
        .collect::<R<Vec<_>>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(invalid(format!("repeated axis in {axes:?}")));
    }
    Ok(out)
}

/// The size of dimension `axis` (already normalised).
pub(crate) fn dim(t: &Tensor, axis: i64) -> i64 {
    t.size().get(axis as usize).copied().unwrap_or(1)
}

/// Pads (or, with negative amounts, crops) the trailing dimensions from `first` on with a
/// constant: `begins[i]`/`ends[i]` apply to dimension `first + i`.
pub(crate) fn pad_dims(
    t: &Tensor,
    first: usize,
    begins: &[i64],
    ends: &[i64],
    value: f64,
) -> R<Tensor> {
    if begins.iter().chain(ends).all(|&p| p == 0) {
        return Ok(t.shallow_clone());
    }
    let mut pads = Vec::with_capacity(2 * begins.len());
    for i in (0..begins.len()).rev() {
        pads.push(begins[i]);
        pads.push(ends[i]);
    }
    debug_assert_eq!(first + begins.len(), t.dim());
    Ok(t.f_pad(pads, "constant", value)?)
}

/// Pads (or crops) one dimension with a constant.
pub(crate) fn pad_axis(t: &Tensor, axis: i64, begin: i64, end: i64, value: f64) -> R<Tensor> {
    let rest = t.dim() - axis as usize;
    let mut b = vec![0; rest];
    let mut e = vec![0; rest];
    b[0] = begin;
    e[0] = end;
    pad_dims(t, axis as usize, &b, &e, value)
}

/// The numpy broadcast of two shapes.
pub(crate) fn broadcast_shapes(a: &[i64], b: &[i64]) -> R<Vec<i64>> {
    let n = a.len().max(b.len());
    let at = |s: &[i64], i: usize| {
        if i + s.len() >= n {
            s[i + s.len() - n]
        } else {
            1
        }
    };
    (0..n)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            (x, y) => Err(invalid(format!(
                "shapes {a:?} and {b:?} do not broadcast ({x} vs {y})"
            ))),
        })
        .collect()
}

/// An `i64` tensor of `values` on `t`'s device.
pub(crate) fn index_tensor(values: &[i64], like: &Tensor) -> R<Tensor> {
    Ok(Tensor::f_from_slice(values)?.f_to(like.device())?)
}
