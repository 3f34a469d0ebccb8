//! Dimensions with one symbolic batch size `N`, and tensor shapes built from them.
//!
//! A dimension is either a fixed extent or a multiple `k*N` of the batch size. That is
//! enough for the costs the planner needs (everything scales linearly in the microbatch
//! size) and keeps arithmetic closed for the ops that matter; a result that would leave
//! this form (e.g. `N*N`, `N+3`) is resolved at the export batch size and becomes fixed.

use std::fmt;

/// One dimension of a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(i64),
    /// `k * N`, with `k >= 1`.
    Batch(i64),
}

impl Dim {
    pub const N: Dim = Dim::Batch(1);

    /// The extent at batch size `n`.
    pub fn eval(self, n: i64) -> i64 {
        match self {
            Dim::Fixed(v) => v,
            Dim::Batch(k) => k * n,
        }
    }

    pub fn fixed(self) -> Option<i64> {
        match self {
            Dim::Fixed(v) => Some(v),
            Dim::Batch(_) => None,
        }
    }

    pub fn is_batch(self) -> bool {
        matches!(self, Dim::Batch(_))
    }

    /// `self * other`, or `None` when the product is not of the form `k*N` or fixed, or
    /// overflows `i64`.
    pub fn mul(self, other: Dim) -> Option<Dim> {
        match (self, other) {
            (Dim::Fixed(a), Dim::Fixed(b)) => a.checked_mul(b).map(Dim::Fixed),
            (Dim::Fixed(0), Dim::Batch(_)) | (Dim::Batch(_), Dim::Fixed(0)) => Some(Dim::Fixed(0)),
            (Dim::Fixed(a), Dim::Batch(k)) | (Dim::Batch(k), Dim::Fixed(a)) if a > 0 => a.checked_mul(k).map(Dim::Batch),
            _ => None,
        }
    }

    /// `self / other` when it divides exactly into the `k*N` or fixed form.
    pub fn div_exact(self, other: Dim) -> Option<Dim> {
        match (self, other) {
            // `checked_rem` also rules out `i64::MIN / -1`, which panics even in release.
            (Dim::Fixed(a), Dim::Fixed(b)) if a.checked_rem(b) == Some(0) => a.checked_div(b).map(Dim::Fixed),
            (Dim::Batch(k), Dim::Fixed(b)) if b > 0 && k % b == 0 => Some(Dim::Batch(k / b)),
            (Dim::Batch(k), Dim::Batch(j)) if k % j == 0 => Some(Dim::Fixed(k / j)),
            _ => None,
        }
    }

    /// `self + other` when both are fixed or both are batch multiples (and the sum fits).
    pub fn add(self, other: Dim) -> Option<Dim> {
        match (self, other) {
            (Dim::Fixed(a), Dim::Fixed(b)) => a.checked_add(b).map(Dim::Fixed),
            (Dim::Batch(a), Dim::Batch(b)) => a.checked_add(b).map(Dim::Batch),
            (Dim::Fixed(0), d) | (d, Dim::Fixed(0)) => Some(d),
            _ => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(v) => write!(f, "{v}"),
            Dim::Batch(1) => f.write_str("N"),
            Dim::Batch(k) => write!(f, "{k}N"),
        }
    }
}

/// A tensor shape. Rank 0 is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn fixed(dims: &[i64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    /// The extents at batch size `n`.
    pub fn eval(&self, n: i64) -> Vec<i64> {
        self.0.iter().map(|d| d.eval(n)).collect()
    }

    /// The element count at batch size `n`.
    pub fn numel(&self, n: i64) -> i64 {
        self.0.iter().map(|d| d.eval(n)).product()
    }

    /// The element count as a `k*N` or fixed dimension, if it has that form.
    pub fn numel_dim(&self) -> Option<Dim> {
        self.0.iter().try_fold(Dim::Fixed(1), |acc, &d| acc.mul(d))
    }

    pub fn has_batch(&self) -> bool {
        self.0.iter().any(|d| d.is_batch())
    }

    /// Normalises a possibly negative axis against this rank.
    pub fn axis(&self, axis: i64) -> Option<usize> {
        normalize_axis(axis, self.rank())
    }
}

/// Normalises an ONNX axis (negative counts from the end) against `rank`.
pub fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of a tensor value: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: crate::DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: crate::DType, shape: Shape) -> TensorType {
        TensorType { dtype, shape }
    }

    /// Bytes of one tensor of this type at batch size `n`.
    pub fn bytes(&self, n: i64) -> i64 {
        self.shape.numel(n) * self.dtype.size() as i64
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
