//! Elementwise kernels: unary maths, binary arithmetic/comparison/logic with numpy
//! broadcasting and ONNX dtype rules, variadic folds, activations, Clip, IsInf, Where, Cast.

use tch::{Kind, Tensor};

use super::util::{bad_dtype, is_int_kind, kind, need, opt, R};
use pipewright_ops::op::{BinaryOp, GeluApprox, UnaryOp, VariadicOp};

/// One-input maths with no attributes.
pub(crate) fn unary(u: UnaryOp, x: &Tensor) -> R<Tensor> {
    use UnaryOp::*;
    Ok(match u {
        Abs => x.f_abs()?,
        Neg => x.f_neg()?,
        Sqrt => x.f_sqrt()?,
        Reciprocal => x.f_reciprocal()?,
        Exp => x.f_exp()?,
        Log => x.f_log()?,
        Erf => x.f_erf()?,
        Tanh => x.f_tanh()?,
        Sigmoid => x.f_sigmoid()?,
        Relu => x.f_relu()?,
        Not => require_bool(x, "Not")?.f_logical_not()?,
        IsNaN => x.f_isnan()?,
        BitNot => super::bits::not(x, None)?,
        Identity => x.shallow_clone(),
        other => unary_more(other, x)?,
    })
}

fn unary_more(u: UnaryOp, x: &Tensor) -> R<Tensor> {
    use UnaryOp::*;
    Ok(match u {
        Floor => x.f_floor()?,
        Ceil => x.f_ceil()?,
        // torch.round rounds half to even, as ONNX requires.
        Round => x.f_round()?,
        Sign => x.f_sign()?,
        Sin => x.f_sin()?,
        Cos => x.f_cos()?,
        Tan => x.f_tan()?,
        Asin => x.f_asin()?,
        Acos => x.f_acos()?,
        Atan => x.f_atan()?,
        Sinh => x.f_sinh()?,
        Cosh => x.f_cosh()?,
        Asinh => x.f_asinh()?,
        Acosh => x.f_acosh()?,
        Atanh => x.f_atanh()?,
        Softplus => x.f_softplus()?,
        Softsign => x.f_div(&x.f_abs()?.f_add_scalar(1.0)?)?,
        HardSwish => x.f_hardswish()?,
        Mish => x.f_mish()?,
        _ => return Err(bad_dtype(format!("internal: {u:?} dispatched twice"))),
    })
}

fn require_bool<'a>(x: &'a Tensor, op: &str) -> R<&'a Tensor> {
    match kind(x)? {
        Kind::Bool => Ok(x),
        k => Err(bad_dtype(format!("{op} needs bool inputs, got {k:?}"))),
    }
}

fn require_numeric(x: &Tensor) -> R<()> {
    match kind(x)? {
        Kind::Bool => Err(bad_dtype(
            "bool inputs are not supported by this arithmetic op",
        )),
        _ => Ok(()),
    }
}

/// Two-input ops with numpy broadcasting.
pub(crate) fn binary(b: BinaryOp, x: &Tensor, y: &Tensor) -> R<Tensor> {
    use BinaryOp::*;
    Ok(match b {
        Equal => x.f_eq_tensor(y)?,
        Less => x.f_lt_tensor(y)?,
        Greater => x.f_gt_tensor(y)?,
        LessOrEqual => x.f_le_tensor(y)?,
        GreaterOrEqual => x.f_ge_tensor(y)?,
        And => require_bool(x, "And")?.f_logical_and(require_bool(y, "And")?)?,
        Or => require_bool(x, "Or")?.f_logical_or(require_bool(y, "Or")?)?,
        Xor => require_bool(x, "Xor")?.f_logical_xor(require_bool(y, "Xor")?)?,
        BitAnd => super::bits::logic('&', x, y)?,
        BitOr => super::bits::logic('|', x, y)?,
        BitXor => super::bits::logic('^', x, y)?,
        ShiftLeft => super::bits::shift(x, y, true, None)?,
        ShiftRight => super::bits::shift(x, y, false, None)?,
        _ => arithmetic(b, x, y)?,
    })
}

fn arithmetic(b: BinaryOp, x: &Tensor, y: &Tensor) -> R<Tensor> {
    use BinaryOp::*;
    require_numeric(x)?;
    require_numeric(y)?;
    Ok(match b {
        Add => x.f_add(y)?,
        Sub => x.f_sub(y)?,
        Mul => x.f_mul(y)?,
        // ONNX integer division truncates toward zero.
        Div if is_int_kind(kind(x)?) => x.f_div_tensor_mode(y, "trunc")?,
        Div => x.f_div(y)?,
        Pow => pow(x, y)?,
        // fmod = 0: Python-style remainder, the divisor's sign.
        Mod => x.f_remainder_tensor(y)?,
        // fmod = 1: C fmod, the dividend's sign.
        Fmod => x.f_fmod_tensor(y)?,
        PRelu => x.f_mul(y)?.f_where_self(&x.f_lt(0)?, x)?,
        _ => return Err(bad_dtype(format!("internal: {b:?} is not arithmetic"))),
    })
}

/// ONNX Pow: the output has the base's type whatever the exponent's type. A one-element
/// exponent that needs no gradient (a constant, as in GELU's `x^3`) goes through the
/// scalar kernel, whose forward and backward are a few times faster than the
/// tensor-exponent ones (libtorch special-cases 2, 3, 0.5, -1...).
fn pow(x: &Tensor, y: &Tensor) -> R<Tensor> {
    let r = if y.numel() == 1 && !y.requires_grad() && x.is_floating_point() && y.dim() <= x.dim() {
        // With a rank no higher than the base's, a one-element exponent broadcasts to the
        // base's shape, so the result's shape is the base's as with the tensor kernel.
        x.f_pow_tensor_scalar(super::util::scalar_f64(y)?)?
    } else {
        x.f_pow(y)?
    };
    let k = kind(x)?;
    Ok(if kind(&r)? == k { r } else { r.f_to_kind(k)? })
}

/// Sum/Max/Min/Mean over broadcast inputs.
pub(crate) fn variadic(v: VariadicOp, xs: &[&Tensor]) -> R<Tensor> {
    let (first, rest) = xs
        .split_first()
        .ok_or_else(|| bad_dtype("needs at least one input"))?;
    let mut acc = first.shallow_clone();
    for x in rest {
        acc = match v {
            VariadicOp::Sum | VariadicOp::Mean => acc.f_add(x)?,
            VariadicOp::Max => acc.f_maximum(x)?,
            VariadicOp::Min => acc.f_minimum(x)?,
        };
    }
    if v == VariadicOp::Mean {
        acc = acc.f_div_scalar(xs.len() as f64)?;
    }
    Ok(acc)
}

pub(crate) fn leaky_relu(x: &Tensor, alpha: f32) -> R<Tensor> {
    Ok(x.f_mul_scalar(alpha as f64)?.f_where_self(&x.f_lt(0)?, x)?)
}

/// `relu(x) + alpha * expm1(min(x, 0))`: Elu without a `where` (no NaN gradients).
pub(crate) fn elu(x: &Tensor, alpha: f32) -> R<Tensor> {
    let neg = x.f_clamp_max(0.0)?.f_expm1()?.f_mul_scalar(alpha as f64)?;
    Ok(x.f_relu()?.f_add(&neg)?)
}

pub(crate) fn celu(x: &Tensor, alpha: f32) -> R<Tensor> {
    let a = alpha as f64;
    let neg = x
        .f_clamp_max(0.0)?
        .f_div_scalar(a)?
        .f_expm1()?
        .f_mul_scalar(a)?;
    Ok(x.f_relu()?.f_add(&neg)?)
}

pub(crate) fn selu(x: &Tensor, alpha: f32, gamma: f32) -> R<Tensor> {
    Ok(elu(x, alpha)?.f_mul_scalar(gamma as f64)?)
}

pub(crate) fn hard_sigmoid(x: &Tensor, alpha: f32, beta: f32) -> R<Tensor> {
    Ok(x.f_mul_scalar(alpha as f64)?
        .f_add_scalar(beta as f64)?
        .f_clamp(0.0, 1.0)?)
}

pub(crate) fn thresholded_relu(x: &Tensor, alpha: f32) -> R<Tensor> {
    let mask = x.f_gt(alpha as f64)?.f_to_kind(kind(x)?)?;
    Ok(x.f_mul(&mask)?)
}

/// Swish: `x * sigmoid(alpha * x)`.
pub(crate) fn swish(x: &Tensor, alpha: f32) -> R<Tensor> {
    Ok(x.f_mul(&x.f_mul_scalar(alpha as f64)?.f_sigmoid()?)?)
}

/// SwiGLU: `Swish_alpha(a) * b`; the two inputs must have one shape (no broadcasting).
pub(crate) fn swiglu(a: &Tensor, b: &Tensor, alpha: f32) -> R<Tensor> {
    if a.size() != b.size() {
        return Err(super::util::invalid(format!("gate {:?} and value {:?} must have one shape", a.size(), b.size())));
    }
    Ok(swish(a, alpha)?.f_mul(b)?)
}

pub(crate) fn gelu(x: &Tensor, a: GeluApprox) -> R<Tensor> {
    Ok(x.f_gelu(match a {
        GeluApprox::None => "none",
        GeluApprox::Tanh => "tanh",
    })?)
}

/// Clip: attribute bounds (opset < 11) or inputs 1 and 2; any bound may be absent.
///
/// With both bounds, the gradient passes only strictly between them, as PyTorch's
/// `hardtanh` (ReLU6), which its exporters write as `Clip(min, max)`, passes it; with one,
/// also at the bound, as its `clamp_min` / `clamp_max`, written as `Clip` with one bound.
/// libtorch's `clamp` passes it at both bounds, and an input exactly at one is common: a
/// depthwise convolution over a window that a ReLU6 before it zeroed outputs its bias, 0.
/// The forward is `clamp`'s either way.
pub(crate) fn clip(ins: &[Option<&Tensor>], min: Option<f32>, max: Option<f32>) -> R<Tensor> {
    let x = need(ins, 0)?;
    let (lower, upper) = (Bound::of(min, opt(ins, 1)), Bound::of(max, opt(ins, 2)));
    let mut y = x.shallow_clone();
    match &lower {
        Some(Bound::Value(m)) => y = y.f_clamp_min(*m)?,
        Some(Bound::Tensor(t)) => y = y.f_clamp_min_tensor(t)?,
        None => {}
    }
    match &upper {
        Some(Bound::Value(m)) => y = y.f_clamp_max(*m)?,
        Some(Bound::Tensor(t)) => y = y.f_clamp_max_tensor(t)?,
        None => {}
    }
    let (Some(lower), Some(upper)) = (lower, upper) else { return Ok(y) };
    if !x.requires_grad() {
        return Ok(y);
    }
    let inside = lower.exceeded_by(x)?.f_logical_and(&upper.not_reached_by(x)?)?;
    // Between the bounds `x` itself (its gradient); elsewhere the clamped value, constant.
    Ok(x.f_where_self(&inside, &y.f_detach()?)?)
}

/// A bound of [`clip`]: an attribute's value or an input tensor.
enum Bound<'a> {
    Value(f64),
    Tensor(&'a Tensor),
}

impl<'a> Bound<'a> {
    fn of(attribute: Option<f32>, input: Option<&'a Tensor>) -> Option<Self> {
        match (attribute, input) {
            (Some(v), _) => Some(Bound::Value(v as f64)),
            (None, Some(t)) => Some(Bound::Tensor(t)),
            (None, None) => None,
        }
    }

    /// Where `x` is above this bound, strictly.
    fn exceeded_by(&self, x: &Tensor) -> R<Tensor> {
        Ok(match self {
            Bound::Value(v) => x.f_gt(*v)?,
            Bound::Tensor(t) => x.f_gt_tensor(*t)?,
        })
    }

    /// Where `x` is below this bound, strictly.
    fn not_reached_by(&self, x: &Tensor) -> R<Tensor> {
        Ok(match self {
            Bound::Value(v) => x.f_lt(*v)?,
            Bound::Tensor(t) => x.f_lt_tensor(*t)?,
        })
    }
}

pub(crate) fn is_inf(x: &Tensor, pos: bool, neg: bool) -> R<Tensor> {
    Ok(match (pos, neg) {
        (true, true) => x.f_isinf()?,
        (true, false) => x.f_isposinf()?,
        (false, true) => x.f_isneginf()?,
        (false, false) => x.f_zeros_like()?.f_to_kind(Kind::Bool)?,
    })
}

pub(crate) fn where_(c: &Tensor, x: &Tensor, y: &Tensor) -> R<Tensor> {
    let c = require_bool(c, "Where condition")?;
    Ok(x.f_where_self(c, y)?)
}
