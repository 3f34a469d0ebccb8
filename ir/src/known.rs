//! Values known at import time: constants and shape-derived integers, possibly
//! containing the batch symbol. They drive shape inference (Reshape targets, Slice
//! bounds, ...) and constant folding of shape-computing subgraphs.

use crate::dim::Dim;
use pipewright_ops::op::{BinaryOp, Op, Reduce, ReduceKind, ScatterReduction, UnaryOp, VariadicOp};
use crate::{DType, TensorData};

/// Tensors larger than this are never tracked or folded: shape arithmetic is small.
pub const KNOWN_LIMIT: usize = 4096;

/// A small tensor whose contents are known at import.
#[derive(Clone, Debug, PartialEq)]
pub struct Known {
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub data: KnownData,
}

#[derive(Clone, Debug, PartialEq)]
pub enum KnownData {
    /// Integer and bool elements; shape arithmetic may make them multiples of `N`.
    Ints(Vec<Dim>),
    /// Float elements, exactly representable in f64.
    Floats(Vec<f64>),
}

impl Known {
    pub fn from_tensor(t: &TensorData) -> Option<Known> {
        // Low-precision values are not shape arithmetic; casts to and from them run at run time.
        // A shape-only weight (`ImportOptions::shapes_only`) has no values to know.
        if t.numel() > KNOWN_LIMIT || t.dtype.is_low_precision() || t.is_shape_only() {
            return None;
        }
        let data = if t.dtype.is_float() {
            KnownData::Floats(t.to_f64s())
        } else {
            KnownData::Ints(t.to_i64s().into_iter().map(Dim::Fixed).collect())
        };
        Some(Known { dtype: t.dtype, shape: t.dims.clone(), data })
    }

    pub fn ints(dtype: DType, shape: Vec<i64>, values: Vec<Dim>) -> Known {
        Known { dtype, shape, data: KnownData::Ints(values) }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            KnownData::Ints(v) => v.len(),
            KnownData::Floats(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements as dims (floats truncated).
    pub fn dims(&self) -> Vec<Dim> {
        match &self.data {
            KnownData::Ints(v) => v.clone(),
            KnownData::Floats(v) => v.iter().map(|&f| Dim::Fixed(f as i64)).collect(),
        }
    }

    /// The one value every element holds, if they all hold one (and there is one).
    pub fn uniform(&self) -> Option<f64> {
        let v = self.floats()?;
        let first = *v.first()?;
        v.iter().all(|&x| x == first).then_some(first)
    }

    /// Elements as fixed integers; `None` if any is a multiple of `N`.
    pub fn fixed_ints(&self) -> Option<Vec<i64>> {
        self.dims().into_iter().map(Dim::fixed).collect()
    }

    /// Elements as f64 (ints must be fixed).
    pub fn floats(&self) -> Option<Vec<f64>> {
        match &self.data {
            KnownData::Floats(v) => Some(v.clone()),
            KnownData::Ints(v) => v.iter().map(|d| d.fixed().map(|x| x as f64)).collect(),
        }
    }

    /// The tensor, when every element is fixed.
    pub fn to_tensor(&self) -> Option<TensorData> {
        Some(match &self.data {
            KnownData::Floats(v) => TensorData::from_f64s(self.dtype, self.shape.clone(), v),
            KnownData::Ints(v) => {
                let fixed: Vec<f64> = v.iter().map(|d| d.fixed().map(|x| x as f64)).collect::<Option<_>>()?;
                if self.dtype == DType::I64 {
                    TensorData::from_i64s(self.shape.clone(), &v.iter().filter_map(|d| d.fixed()).collect::<Vec<_>>())
                } else if self.dtype.is_int() {
                    // The low bytes of the i64: integer results wrap to the type's width
                    // (u8 `1 - 2` is 255), as the runtime computes them.
                    let w = self.dtype.size();
                    let bytes: Vec<u8> = v.iter().filter_map(|d| d.fixed()).flat_map(|x| x.to_le_bytes()[..w].to_vec()).collect();
                    TensorData::new(self.dtype, self.shape.clone(), bytes.into())?
                } else {
                    TensorData::from_f64s(self.dtype, self.shape.clone(), &fixed)
                }
            }
        })
    }
}

/// Evaluates `op` on known inputs; `None` when the op is not evaluated at import or a
/// needed input is unknown. `in_shapes` are the fixed input shapes where known (Shape
/// reads its input's type, not its contents), `out_dtype`/`out_shape` the inferred output.
pub fn evaluate(
    op: &Op,
    inputs: &[Option<&Known>],
    input_dims: &[Option<Vec<Dim>>],
    out_dtype: DType,
    out_shape: Option<Vec<i64>>,
) -> Option<Known> {
    let k = |i: usize| inputs.get(i).copied().flatten();
    match op {
        Op::Shape { start, end } => {
            let dims = input_dims.first()?.clone()?;
            let r = dims.len() as i64;
            let clamp = |v: i64| if v < 0 { (v + r).clamp(0, r) } else { v.min(r) } as usize;
            let (s, e) = (clamp(*start), clamp(end.unwrap_or(r)));
            let slice = if s < e { dims[s..e].to_vec() } else { Vec::new() };
            Some(Known::ints(DType::I64, vec![slice.len() as i64], slice))
        }
        Op::Size => {
            let dims = input_dims.first()?.clone()?;
            let n = dims.iter().try_fold(Dim::Fixed(1), |a, &d| a.mul(d))?;
            Some(Known::ints(DType::I64, vec![], vec![n]))
        }
        Op::Unary(UnaryOp::Identity) | Op::StageBoundary { .. } | Op::StopGradient | Op::Reshape { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Flatten { .. } => {
            let x = k(0)?;
            Some(Known { dtype: x.dtype, shape: out_shape?, data: x.data.clone() })
        }
        Op::Cast { to, .. } => cast(k(0)?, *to),
        Op::CastLike { .. } => cast(k(0)?, out_dtype),
        Op::Concat { axis } => {
            let parts: Vec<&Known> = inputs.iter().map(|x| *x).collect::<Option<_>>()?;
            if parts.iter().any(|p| p.shape.len() > 1) {
                return concat_nd(&parts, *axis, out_dtype, out_shape?);
            }
            let data = if out_dtype.is_float() {
                KnownData::Floats(parts.iter().map(|p| p.floats()).collect::<Option<Vec<_>>>()?.concat())
            } else {
                KnownData::Ints(parts.iter().flat_map(|p| p.dims()).collect())
            };
            Some(Known { dtype: out_dtype, shape: out_shape?, data })
        }
        Op::Gather { axis } => {
            let (data, idx) = (k(0)?, k(1)?);
            // Along the leading axis: elements of a vector, or rows of a table (a
            // sinusoidal position table looked up at positions known at import).
            if data.shape.is_empty() || (*axis != 0 && !(*axis == -1 && data.shape.len() == 1)) {
                return None;
            }
            let n = data.shape[0];
            let row = usize::try_from(data.shape[1..].iter().product::<i64>()).ok()?;
            let picks: Vec<usize> = idx
                .fixed_ints()?
                .into_iter()
                .map(|i| if i < 0 { i + n } else { i })
                .map(|i| (0..n).contains(&i).then_some(i as usize))
                .collect::<Option<_>>()?;
            if picks.len().checked_mul(row)? > KNOWN_LIMIT {
                return None;
            }
            fn rows<T: Clone>(v: &[T], picks: &[usize], row: usize) -> Vec<T> {
                picks.iter().flat_map(|&i| v[i * row..(i + 1) * row].iter().cloned()).collect()
            }
            let out = match &data.data {
                KnownData::Ints(v) => KnownData::Ints(rows(v, &picks, row)),
                KnownData::Floats(v) => KnownData::Floats(rows(v, &picks, row)),
            };
            let shape = idx.shape.iter().chain(&data.shape[1..]).copied().collect();
            Some(Known { dtype: data.dtype, shape, data: out })
        }
        Op::CumSum { exclusive, reverse } => cumsum(k(0)?, k(1)?, *exclusive, *reverse),
        Op::Slice(s) => slice_nd(s, inputs, out_shape?),
        Op::Pad(p) if p.mode == pipewright_ops::op::PadMode::Constant => pad_constant(p, inputs, out_shape?),
        Op::Transpose { perm } => transpose(k(0)?, perm.as_ref(), out_shape?),
        Op::ConstantOfShape { value } => {
            let shape = out_shape?;
            let n = shape.iter().try_fold(1i64, |a, &d| a.checked_mul(d))?;
            if n as usize > KNOWN_LIMIT {
                return None;
            }
            let fill = match value {
                Some(t) => t.to_f64s().first().copied().unwrap_or(0.0),
                None => 0.0,
            };
            Some(filled(out_dtype, shape, fill, n as usize))
        }
        Op::Range => {
            let (s, l, d) = (k(0)?.floats()?, k(1)?.floats()?, k(2)?.floats()?);
            let (s, l, d) = (*s.first()?, *l.first()?, *d.first()?);
            if d == 0.0 {
                return None;
            }
            let n = ((l - s) / d).ceil().max(0.0) as usize;
            if n > KNOWN_LIMIT {
                return None;
            }
            let vals: Vec<f64> = (0..n).map(|i| s + i as f64 * d).collect();
            Some(from_f64s(out_dtype, vec![n as i64], vals))
        }
        Op::Unary(UnaryOp::Neg) => map_unary(k(0)?, |d| d.mul(Dim::Fixed(-1)).or(None), |f| -f),
        Op::Unary(UnaryOp::Abs) => map_unary(k(0)?, |d| d.fixed()?.checked_abs().map(Dim::Fixed), f64::abs),
        Op::Unary(UnaryOp::Sqrt) if out_dtype.is_float() => map_unary(k(0)?, |_| None, f64::sqrt),
        Op::Unary(UnaryOp::Ceil) => map_unary(k(0)?, |d| d.fixed().map(Dim::Fixed), f64::ceil),
        Op::Unary(UnaryOp::Floor) => map_unary(k(0)?, |d| d.fixed().map(Dim::Fixed), f64::floor),
        Op::Unary(UnaryOp::Relu) => map_unary(k(0)?, |d| Some(Dim::Fixed(d.fixed()?.max(0))), |f| f.max(0.0)),
        Op::Unary(UnaryOp::Not) => map_unary(k(0)?, |d| Some(Dim::Fixed((d.fixed()? == 0) as i64)), |f| (f == 0.0) as i64 as f64),
        Op::Binary(b) => binary(*b, k(0)?, k(1)?, out_dtype, out_shape?),
        Op::Variadic(v @ (VariadicOp::Max | VariadicOp::Min)) if inputs.len() == 2 => {
            let b = if *v == VariadicOp::Max { BinaryOp::Greater } else { BinaryOp::Less };
            let (x, y) = (k(0)?, k(1)?);
            let pick = binary(b, x, y, DType::Bool, out_shape.clone()?)?;
            where_(&pick, x, y, out_dtype, out_shape?)
        }
        Op::Where => where_(k(0)?, k(1)?, k(2)?, out_dtype, out_shape?),
        Op::Expand => expand(k(0)?, out_shape?),
        Op::Trilu { upper } => trilu(k(0)?, k(1), *upper),
        Op::Reduce(r) => reduce(r, k(0)?, k(1), out_shape?),
        Op::ScatterElements { axis, reduction: ScatterReduction::None } | Op::Scatter { axis } => scatter_1d(*axis, k(0)?, k(1)?, k(2)?),
        Op::OneHot { axis } => one_hot(k(0)?, k(1)?, k(2)?, *axis),
        _ => None,
    }
}

/// ONNX OneHot of known indices: `values[1]` where an index (negative ones counted from
/// `depth`) equals the position along the new axis `axis`, `values[0]` elsewhere (an
/// index outside `[-depth, depth)` selects no position). The TorchScript exporter builds
/// `Tile` repeats this way (`[1, heads, 1, 1]` as a one-hot of the heads axis scaled by
/// the head count).
fn one_hot(indices: &Known, depth: &Known, values: &Known, axis: i64) -> Option<Known> {
    let depth = *depth.floats()?.first()? as i64;
    let rank = indices.shape.len() as i64;
    let a = usize::try_from(if axis < 0 { axis + rank + 1 } else { axis }).ok().filter(|&a| a as i64 <= rank)?;
    if depth < 1 || values.len() != 2 || indices.len().checked_mul(depth as usize)? > KNOWN_LIMIT {
        return None;
    }
    let idx = indices.fixed_ints()?;
    let inner: usize = indices.shape[a..].iter().map(|&d| d.max(0) as usize).product();
    let outer = idx.len().checked_div(inner).unwrap_or(0);
    // Per output element: whether it is "on" (row-major over [outer, depth, inner]).
    let on: Vec<bool> = (0..outer)
        .flat_map(|o| (0..depth).flat_map(move |d| (0..inner).map(move |i| (o, d, i))))
        .map(|(o, d, i)| {
            let x = idx[o * inner + i];
            (if x < 0 { x + depth } else { x }) == d
        })
        .collect();
    let data = match &values.data {
        KnownData::Ints(v) => KnownData::Ints(on.iter().map(|&b| v[usize::from(b)]).collect()),
        KnownData::Floats(v) => KnownData::Floats(on.iter().map(|&b| v[usize::from(b)]).collect()),
    };
    let mut shape = indices.shape.clone();
    shape.insert(a, depth);
    Some(Known { dtype: values.dtype, shape, data })
}

/// `data` with the `updates` written at `indices` (vectors: replacing one extent of a
/// shape, as a model writes a new sequence length into its cache's shape).
fn scatter_1d(axis: i64, data: &Known, indices: &Known, updates: &Known) -> Option<Known> {
    if data.shape.len() != 1 || indices.shape.len() != 1 || updates.len() != indices.len() || !(axis == 0 || axis == -1) {
        return None;
    }
    let n = data.len() as i64;
    let mut out = data.clone();
    for (slot, i) in indices.fixed_ints()?.into_iter().enumerate() {
        let i = usize::try_from(if i < 0 { i + n } else { i }).ok().filter(|&i| i < data.len())?;
        match (&mut out.data, &updates.data) {
            (KnownData::Ints(o), KnownData::Ints(u)) => o[i] = u[slot],
            (KnownData::Floats(o), KnownData::Floats(u)) => o[i] = u[slot],
            _ => return None,
        }
    }
    Some(out)
}

/// The one value every element of `op`'s output holds when every element of its input 0
/// is `fill`: ops that only select, move or repeat elements keep it (a cast converts it),
/// and `ConstantOfShape` starts one. This knows the contents of a value whose shape
/// holds the batch (an all-zeros cache of `[batch, heads, length, dim]` that a model
/// indexes and counts at its first step) once an op's output no longer does.
pub fn fill_through(op: &Op, fill: Option<f64>, out_dtype: DType) -> Option<f64> {
    let v = match op {
        Op::ConstantOfShape { value } => value.as_ref().map_or(Some(0.0), |t| t.to_f64s().first().copied())?,
        Op::Gather { .. }
        | Op::Slice(_)
        | Op::Squeeze { .. }
        | Op::Unsqueeze { .. }
        | Op::Reshape { .. }
        | Op::Flatten { .. }
        | Op::Transpose { .. }
        | Op::Expand
        | Op::Tile
        | Op::Unary(UnaryOp::Identity)
        | Op::StopGradient
        | Op::Cast { .. }
        | Op::CastLike { .. } => fill?,
        _ => return None,
    };
    Some(if out_dtype == DType::Bool {
        (v != 0.0) as i64 as f64
    } else if out_dtype.is_float() {
        round_floats(out_dtype, vec![v])[0]
    } else {
        v.trunc()
    })
}

/// `fill` over the fixed `shape` (the value [`fill_through`] found, once its shape is fixed).
pub fn filled_shape(dtype: DType, shape: Vec<i64>, fill: f64) -> Option<Known> {
    let n = shape.iter().try_fold(1i64, |a, &d| a.checked_mul(d))?;
    (n as usize <= KNOWN_LIMIT && !dtype.is_low_precision()).then(|| filled(dtype, shape, fill, n as usize))
}

/// A sum, product, maximum or minimum of `x` over the axes of `r` (or input `axes`),
/// for shape arithmetic that counts (how many cache positions are filled).
fn reduce(r: &Reduce, x: &Known, axes: Option<&Known>, out_shape: Vec<i64>) -> Option<Known> {
    let rank = x.shape.len();
    let listed = match (&r.axes, axes) {
        (Some(a), _) => a.clone(),
        (None, Some(k)) => k.fixed_ints()?,
        (None, None) => Vec::new(),
    };
    if listed.is_empty() && r.noop_with_empty_axes {
        return Some(Known { shape: out_shape, ..x.clone() });
    }
    let mut reduced = vec![listed.is_empty(); rank];
    for a in listed {
        *reduced.get_mut(usize::try_from(if a < 0 { a + rank as i64 } else { a }).ok()?)? = true;
    }
    let n_out: i64 = x.shape.iter().zip(&reduced).filter(|(_, &r)| !r).map(|(&d, _)| d).product();
    if n_out != out_shape.iter().product::<i64>() {
        return None;
    }
    let (init, step): (f64, fn(f64, f64) -> f64) = match r.kind {
        ReduceKind::Sum => (0.0, |a, b| a + b),
        ReduceKind::Prod => (1.0, |a, b| a * b),
        ReduceKind::Max => (f64::NEG_INFINITY, f64::max),
        ReduceKind::Min => (f64::INFINITY, f64::min),
        _ => return None,
    };
    let values = x.floats()?;
    if values.is_empty() && matches!(r.kind, ReduceKind::Max | ReduceKind::Min) {
        return None;
    }
    let mut out = vec![init; n_out as usize];
    for (i, &v) in values.iter().enumerate() {
        let o = reduced_index(i, &x.shape, &reduced);
        out[o] = step(out[o], v);
    }
    let out = if x.dtype.is_float() { round_floats(x.dtype, out) } else { out };
    Some(from_f64s(x.dtype, out_shape, out))
}

/// The output position of input element `i` of `shape` once the `reduced` axes are summed away.
fn reduced_index(i: usize, shape: &[i64], reduced: &[bool]) -> usize {
    let (mut rem, mut o, mut stride) = (i, 0usize, 1usize);
    for ax in (0..shape.len()).rev() {
        let d = shape[ax] as usize;
        if !reduced[ax] {
            o += (rem % d) * stride;
            stride *= d;
        }
        rem /= d;
    }
    o
}

/// Parts of rank 2 or more joined along `axis` (a mask of constants built in pieces).
fn concat_nd(parts: &[&Known], axis: i64, out_dtype: DType, shape: Vec<i64>) -> Option<Known> {
    let rank = shape.len() as i64;
    let axis = usize::try_from(if axis < 0 { axis + rank } else { axis }).ok()?;
    let n = shape.iter().try_fold(1i64, |a, &d| a.checked_mul(d))? as usize;
    if n > KNOWN_LIMIT || axis >= shape.len() || parts.iter().any(|p| p.shape.len() != shape.len() || p.dtype != out_dtype) {
        return None;
    }
    let outer: usize = shape[..axis].iter().product::<i64>() as usize;
    let chunk = |p: &Known| p.shape[axis..].iter().product::<i64>() as usize;
    let mut src: Vec<(usize, usize)> = Vec::with_capacity(n);
    for o in 0..outer {
        for (k, p) in parts.iter().enumerate() {
            let c = chunk(p);
            src.extend((o * c..(o + 1) * c).map(|i| (k, i)));
        }
    }
    if src.len() != n {
        return None;
    }
    // As the 1-D case reads its parts.
    let data = if out_dtype.is_float() {
        let values: Vec<Vec<f64>> = parts.iter().map(|p| p.floats()).collect::<Option<_>>()?;
        KnownData::Floats(src.iter().map(|&(k, i)| values[k][i]).collect())
    } else {
        let values: Vec<Vec<Dim>> = parts.iter().map(|p| p.dims()).collect();
        KnownData::Ints(src.iter().map(|&(k, i)| values[k][i]).collect())
    };
    Some(Known { dtype: out_dtype, shape, data })
}

/// Float `x` broadcast to `shape` (Expand of a constant: a causal mask repeated over
/// the export batch, which lowering keeps one slice of where its readers broadcast).
/// Integer expands stay ops: position ids expanded to the export batch feed a Gather,
/// which does not broadcast, and lowering makes the Expand follow the batch instead.
fn expand(x: &Known, shape: Vec<i64>) -> Option<Known> {
    if !x.dtype.is_float() {
        return None;
    }
    let n = shape.iter().try_fold(1i64, |a, &d| a.checked_mul(d))? as usize;
    if n > KNOWN_LIMIT || shape.len() < x.shape.len() {
        return None;
    }
    let src: Vec<usize> = (0..n).map(|i| bcast_index(i, &shape, &x.shape)).collect();
    Some(Known { dtype: x.dtype, shape, data: pick(&x.data, &src) })
}

/// The upper (or lower) triangle of each matrix of `x` from diagonal `k` on, zeros
/// elsewhere (a causal mask built from a constant).
fn trilu(x: &Known, k: Option<&Known>, upper: bool) -> Option<Known> {
    let diagonal = match k {
        Some(k) => *k.fixed_ints()?.first()?,
        None => 0,
    };
    let [.., rows, cols] = x.shape[..] else { return None };
    let keep = |i: usize| {
        let (r, c) = ((i as i64 / cols) % rows, i as i64 % cols);
        if upper { c - r >= diagonal } else { c - r <= diagonal }
    };
    let data = match &x.data {
        KnownData::Ints(v) => KnownData::Ints(v.iter().enumerate().map(|(i, &d)| if keep(i) { d } else { Dim::Fixed(0) }).collect()),
        KnownData::Floats(v) => KnownData::Floats(v.iter().enumerate().map(|(i, &f)| if keep(i) { f } else { 0.0 }).collect()),
    };
    Some(Known { dtype: x.dtype, shape: x.shape.clone(), data })
}

fn filled(dtype: DType, shape: Vec<i64>, fill: f64, n: usize) -> Known {
    from_f64s(dtype, shape, vec![fill; n])
}

fn from_f64s(dtype: DType, shape: Vec<i64>, vals: Vec<f64>) -> Known {
    let data = if dtype.is_float() {
        KnownData::Floats(vals)
    } else {
        KnownData::Ints(vals.into_iter().map(|f| Dim::Fixed(f as i64)).collect())
    };
    Known { dtype, shape, data }
}

fn cast(x: &Known, to: DType) -> Option<Known> {
    if to.is_low_precision() {
        return None;
    }
    let data = match (&x.data, to.is_float()) {
        (KnownData::Ints(v), false) if to == DType::Bool => {
            KnownData::Ints(v.iter().map(|d| d.fixed().map(|i| Dim::Fixed((i != 0) as i64))).collect::<Option<_>>()?)
        }
        (KnownData::Ints(v), false) => KnownData::Ints(v.clone()),
        (KnownData::Floats(v), false) => {
            KnownData::Ints(v.iter().map(|&f| Dim::Fixed(if to == DType::Bool { (f != 0.0) as i64 } else { f as i64 })).collect())
        }
        (_, true) => KnownData::Floats(round_floats(to, x.floats()?)),
    };
    Some(Known { dtype: to, shape: x.shape.clone(), data })
}

/// Rounds f64 values to the precision of `dtype` so folded constants match the runtime.
fn round_floats(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    match dtype {
        DType::F32 => v.into_iter().map(|f| f as f32 as f64).collect(),
        DType::F16 => v.into_iter().map(|f| half::f16::from_f64(f).to_f64()).collect(),
        DType::Bf16 => v.into_iter().map(|f| half::bf16::from_f64(f).to_f64()).collect(),
        _ => v,
    }
}

fn map_unary(x: &Known, on_int: impl Fn(Dim) -> Option<Dim>, on_float: impl Fn(f64) -> f64) -> Option<Known> {
    let data = match &x.data {
        KnownData::Ints(v) => KnownData::Ints(v.iter().map(|&d| on_int(d)).collect::<Option<_>>()?),
        KnownData::Floats(v) => KnownData::Floats(round_floats(x.dtype, v.iter().map(|&f| on_float(f)).collect())),
    };
    Some(Known { dtype: x.dtype, shape: x.shape.clone(), data })
}

/// Index into a broadcast operand for output element `i`.
pub(crate) fn bcast_index(i: usize, out: &[i64], shape: &[i64]) -> usize {
    let mut rem = i;
    let mut idx = 0usize;
    let mut stride = 1usize;
    let offset = out.len() - shape.len();
    for ax in (0..out.len()).rev() {
        let o = out[ax] as usize;
        let c = rem % o;
        rem /= o;
        if ax >= offset {
            let s = shape[ax - offset] as usize;
            if s != 1 {
                idx += c * stride;
            }
            stride *= s;
        }
    }
    idx
}

fn binary(op: BinaryOp, x: &Known, y: &Known, out_dtype: DType, out_shape: Vec<i64>) -> Option<Known> {
    // u64 values from 2^63 up are held as negative i64 bit patterns, on which signed
    // division and order are wrong: the runtime's unsigned kernels compute those.
    let big_u64 = |k: &Known| k.dtype == DType::U64 && k.dims().iter().any(|d| d.fixed().map_or(true, |v| v < 0));
    if big_u64(x) || big_u64(y) {
        return None;
    }
    let n: i64 = out_shape.iter().product();
    let n = n as usize;
    if n > KNOWN_LIMIT {
        return None;
    }
    let both_int = matches!((&x.data, &y.data), (KnownData::Ints(_), KnownData::Ints(_)));
    if both_int && !op.is_predicate() {
        let (a, b) = (x.dims(), y.dims());
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let (p, q) = (a[bcast_index(i, &out_shape, &x.shape)], b[bcast_index(i, &out_shape, &y.shape)]);
            out.push(int_op(op, p, q)?);
        }
        return Some(Known { dtype: out_dtype, shape: out_shape, data: KnownData::Ints(out) });
    }
    if both_int && (x.fixed_ints().is_none() || y.fixed_ints().is_none()) {
        // A comparison with a multiple of the batch: decided where N >= 1 decides it.
        let (a, b) = (x.dims(), y.dims());
        let out = (0..n)
            .map(|i| compare(op, a[bcast_index(i, &out_shape, &x.shape)], b[bcast_index(i, &out_shape, &y.shape)]).map(|c| Dim::Fixed(c as i64)))
            .collect::<Option<Vec<Dim>>>()?;
        return Some(Known { dtype: out_dtype, shape: out_shape, data: KnownData::Ints(out) });
    }
    let (a, b) = (x.floats()?, y.floats()?);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (p, q) = (a[bcast_index(i, &out_shape, &x.shape)], b[bcast_index(i, &out_shape, &y.shape)]);
        out.push(float_op(op, p, q)?);
    }
    Some(from_f64s(out_dtype, out_shape, round_floats(out_dtype, out)))
}

/// A comparison of two extents, either of which may be `k * N`: every batch size is at
/// least 1, so `k * N` is at least `k` and grows with `N`. `None` where the answer depends
/// on `N` (`N == 4`).
fn compare(op: BinaryOp, p: Dim, q: Dim) -> Option<bool> {
    use std::cmp::Ordering;
    // The order of `p` and `q` for every batch size, when there is one.
    let order = match (p, q) {
        (Dim::Fixed(a), Dim::Fixed(b)) => a.cmp(&b),
        (Dim::Batch(a), Dim::Batch(b)) => a.cmp(&b),
        (Dim::Batch(k), Dim::Fixed(c)) if c < k => Ordering::Greater,
        (Dim::Fixed(c), Dim::Batch(k)) if c < k => Ordering::Less,
        _ => return None,
    };
    Some(match op {
        BinaryOp::Equal => order == Ordering::Equal,
        BinaryOp::Less => order == Ordering::Less,
        BinaryOp::Greater => order == Ordering::Greater,
        BinaryOp::LessOrEqual => order != Ordering::Greater,
        BinaryOp::GreaterOrEqual => order != Ordering::Less,
        _ => return None,
    })
}

fn int_op(op: BinaryOp, p: Dim, q: Dim) -> Option<Dim> {
    match op {
        BinaryOp::Add => p.add(q),
        BinaryOp::Sub => match (p, q) {
            (Dim::Batch(a), Dim::Batch(b)) if a > b => Some(Dim::Batch(a - b)),
            (Dim::Batch(a), Dim::Batch(b)) if a == b => Some(Dim::Fixed(0)),
            (_, Dim::Fixed(b)) => p.add(Dim::Fixed(b.checked_neg()?)),
            _ => None,
        },
        BinaryOp::Mul => p.mul(q),
        // ONNX integer division truncates; the symbolic form only divides exactly.
        BinaryOp::Div => match (p, q) {
            // `checked_div` is `None` for a zero divisor and for `i64::MIN / -1`.
            (Dim::Fixed(a), Dim::Fixed(b)) => a.checked_div(b).map(Dim::Fixed),
            _ => p.div_exact(q),
        },
        BinaryOp::Mod => {
            // The divisor's sign; `checked_rem` is `None` for 0 and for `i64::MIN % -1`.
            let (a, b) = (p.fixed()?, q.fixed()?);
            let r = a.checked_rem(b)?;
            Some(Dim::Fixed(if r != 0 && (r < 0) != (b < 0) { r + b } else { r }))
        }
        BinaryOp::Fmod => p.fixed()?.checked_rem(q.fixed()?).map(Dim::Fixed),
        BinaryOp::Pow => {
            let (a, b) = (p.fixed()?, q.fixed()?);
            u32::try_from(b).ok().and_then(|e| a.checked_pow(e)).map(Dim::Fixed)
        }
        _ => None,
    }
}

fn float_op(op: BinaryOp, p: f64, q: f64) -> Option<f64> {
    let b = |c: bool| c as i64 as f64;
    Some(match op {
        BinaryOp::Add => p + q,
        BinaryOp::Sub => p - q,
        BinaryOp::Mul => p * q,
        BinaryOp::Div => p / q,
        // Swin's attention scale, `head_dim ** -0.5`, is written as a Pow of constants.
        BinaryOp::Pow => p.powf(q),
        BinaryOp::Equal => b(p == q),
        BinaryOp::Less => b(p < q),
        BinaryOp::Greater => b(p > q),
        BinaryOp::LessOrEqual => b(p <= q),
        BinaryOp::GreaterOrEqual => b(p >= q),
        BinaryOp::And => b(p != 0.0 && q != 0.0),
        BinaryOp::Or => b(p != 0.0 || q != 0.0),
        BinaryOp::Xor => b((p != 0.0) != (q != 0.0)),
        _ => return None,
    })
}

fn where_(c: &Known, x: &Known, y: &Known, out_dtype: DType, out_shape: Vec<i64>) -> Option<Known> {
    let n = out_shape.iter().product::<i64>() as usize;
    if n > KNOWN_LIMIT {
        return None;
    }
    let cond = c.fixed_ints()?;
    let pick = |i: usize| cond[bcast_index(i, &out_shape, &c.shape)] != 0;
    let data = match (&x.data, &y.data) {
        (KnownData::Ints(a), KnownData::Ints(b)) => KnownData::Ints(
            (0..n)
                .map(|i| if pick(i) { a[bcast_index(i, &out_shape, &x.shape)] } else { b[bcast_index(i, &out_shape, &y.shape)] })
                .collect(),
        ),
        _ => {
            let (a, b) = (x.floats()?, y.floats()?);
            KnownData::Floats(
                (0..n)
                    .map(|i| if pick(i) { a[bcast_index(i, &out_shape, &x.shape)] } else { b[bcast_index(i, &out_shape, &y.shape)] })
                    .collect(),
            )
        }
    };
    Some(Known { dtype: out_dtype, shape: out_shape, data })
}

/// The elements at flat indices `src`, in that order.
fn pick(data: &KnownData, src: &[usize]) -> KnownData {
    match data {
        KnownData::Ints(v) => KnownData::Ints(src.iter().map(|&i| v[i]).collect()),
        KnownData::Floats(v) => KnownData::Floats(src.iter().map(|&i| v[i]).collect()),
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[i64]) -> Vec<usize> {
    let mut st = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1].max(0) as usize;
    }
    st
}

/// For every element of an output whose axis `a` takes the source positions `idx[a]`, its
/// flat index in the source of shape `shape` (row-major, the last axis fastest).
fn gather_flat(shape: &[i64], idx: &[Vec<i64>]) -> Vec<usize> {
    let st = strides(shape);
    let mut out = vec![0usize];
    for (a, positions) in idx.iter().enumerate() {
        let stride = st[a];
        out = out.iter().flat_map(|&base| positions.iter().map(move |&p| base + p as usize * stride)).collect();
    }
    out
}

/// Slice of a known tensor of any rank (the shape arithmetic of pads and strides: a pads
/// vector reshaped to `[-1, 2]` and reversed along axis 0).
fn slice_nd(s: &pipewright_ops::op::Slice, inputs: &[Option<&Known>], out_shape: Vec<i64>) -> Option<Known> {
    let data = inputs.first().copied().flatten()?;
    let rank = data.shape.len() as i64;
    let get = |i: usize| inputs.get(i).copied().flatten().and_then(|k| k.fixed_ints());
    let (starts, ends, axes, steps) = match &s.attrs {
        Some((st, en, ax)) => (st.clone(), en.clone(), ax.clone(), None),
        None => (get(1)?, get(2)?, match inputs.get(3).copied().flatten() {
            Some(k) => Some(k.fixed_ints()?),
            None => None,
        }, match inputs.get(4).copied().flatten() {
            Some(k) => Some(k.fixed_ints()?),
            None => None,
        }),
    };
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if [ends.len(), axes.len(), steps.len()].iter().any(|&n| n != starts.len()) {
        return None;
    }
    let mut idx: Vec<Vec<i64>> = data.shape.iter().map(|&d| (0..d).collect()).collect();
    for (((&start, &end), &axis), &step) in starts.iter().zip(&ends).zip(&axes).zip(&steps) {
        let a = if axis < 0 { axis + rank } else { axis };
        let a = usize::try_from(a).ok().filter(|&a| a < idx.len())?;
        idx[a] = crate::infer::slice_indices(data.shape[a], start, end, step)?;
    }
    if idx.iter().map(|v| v.len() as i64).ne(out_shape.iter().copied()) {
        return None;
    }
    Some(Known { dtype: data.dtype, shape: out_shape, data: pick(&data.data, &gather_flat(&data.shape, &idx)) })
}

/// Constant-mode Pad of a known tensor by non-negative pads (a mask padded to whole
/// blocks, as PEGASUS-X's local attention pads its ones).
fn pad_constant(p: &pipewright_ops::op::Pad, inputs: &[Option<&Known>], out_shape: Vec<i64>) -> Option<Known> {
    let x = inputs.first().copied().flatten()?;
    let rank = x.shape.len();
    let input = |i: usize| inputs.get(i).copied().flatten();
    let (pads, fill) = match &p.attrs {
        Some((pads, value)) => (pads.clone(), f64::from(*value)),
        None => (input(1)?.fixed_ints()?, input(2).map(|v| v.floats().and_then(|f| f.first().copied())).unwrap_or(Some(0.0))?),
    };
    let axes: Vec<usize> = match input(3) {
        Some(a) => a.fixed_ints()?.into_iter().map(|a| usize::try_from(if a < 0 { a + rank as i64 } else { a }).ok()).collect::<Option<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() || pads.iter().any(|&v| v < 0) || axes.iter().any(|&a| a >= rank) {
        return None;
    }
    let mut before = vec![0i64; rank];
    for (i, &a) in axes.iter().enumerate() {
        before[a] = pads[i];
    }
    let shape_fits = (0..rank).all(|a| out_shape.get(a).is_some_and(|&o| o >= x.shape[a] + before[a])) && out_shape.len() == rank;
    if !shape_fits {
        return None;
    }
    // Each output position's source element, or none where it lies in the padding.
    let (src_strides, out_strides) = (strides(&x.shape), strides(&out_shape));
    let total = out_shape.iter().try_fold(1usize, |a, &d| a.checked_mul(usize::try_from(d).ok()?))?;
    let source = |flat: usize| -> Option<usize> {
        (0..rank).try_fold(0usize, |at, a| {
            let p = (flat / out_strides[a]) as i64 % out_shape[a] - before[a];
            (0..x.shape[a]).contains(&p).then(|| at + p as usize * src_strides[a])
        })
    };
    let data = match &x.data {
        KnownData::Ints(v) => KnownData::Ints((0..total).map(|i| source(i).map_or(Dim::Fixed(fill as i64), |s| v[s])).collect()),
        KnownData::Floats(v) => KnownData::Floats((0..total).map(|i| source(i).map_or(fill, |s| v[s])).collect()),
    };
    Some(Known { dtype: x.dtype, shape: out_shape, data })
}

/// Transpose of a known tensor (default: the axes reversed).
fn transpose(x: &Known, perm: Option<&Vec<i64>>, out_shape: Vec<i64>) -> Option<Known> {
    let rank = x.shape.len();
    let perm: Vec<usize> = match perm {
        Some(p) => p.iter().map(|&a| usize::try_from(a).ok().filter(|&a| a < rank)).collect::<Option<_>>()?,
        None => (0..rank).rev().collect(),
    };
    if perm.len() != rank || perm.iter().map(|&a| x.shape[a]).ne(out_shape.iter().copied()) {
        return None;
    }
    // Output axis `i` walks source axis `perm[i]`: its source offset per step is that stride.
    let st = strides(&x.shape);
    let mut src = vec![0usize];
    for &a in &perm {
        let (stride, extent) = (st[a], x.shape[a].max(0) as usize);
        src = src.iter().flat_map(|&base| (0..extent).map(move |p| base + p * stride)).collect();
    }
    Some(Known { dtype: x.dtype, shape: out_shape, data: pick(&x.data, &src) })
}

/// Running sums along one axis (ONNX `CumSum`) of fixed integers or floats: positions
/// counted from a mask known at import (`cumsum(ones) * mask + padding_idx`).
fn cumsum(x: &Known, axis: &Known, exclusive: bool, reverse: bool) -> Option<Known> {
    let rank = x.shape.len() as i64;
    let a = *axis.fixed_ints()?.first()?;
    let a = usize::try_from(if a < 0 { a + rank } else { a }).ok().filter(|&a| (a as i64) < rank)?;
    let extent = usize::try_from(x.shape[a]).ok()?;
    let inner = usize::try_from(x.shape[a + 1..].iter().product::<i64>()).ok()?;
    let outer = usize::try_from(x.shape[..a].iter().product::<i64>()).ok()?;
    fn run<T: Copy + std::ops::Add<Output = T>>(v: &[T], zero: T, (outer, extent, inner): (usize, usize, usize), exclusive: bool, reverse: bool) -> Vec<T> {
        let mut out = v.to_vec();
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = zero;
                let steps: Vec<usize> = if reverse { (0..extent).rev().collect() } else { (0..extent).collect() };
                for e in steps {
                    let at = (o * extent + e) * inner + i;
                    let here = v[at];
                    if exclusive {
                        out[at] = acc;
                        acc = acc + here;
                    } else {
                        acc = acc + here;
                        out[at] = acc;
                    }
                }
            }
        }
        out
    }
    let dims = (outer, extent, inner);
    let data = match &x.data {
        KnownData::Ints(_) => KnownData::Ints(run(&x.fixed_ints()?, 0i64, dims, exclusive, reverse).into_iter().map(Dim::Fixed).collect()),
        KnownData::Floats(v) => KnownData::Floats(run(v, 0.0f64, dims, exclusive, reverse)),
    };
    Some(Known { dtype: x.dtype, shape: x.shape.clone(), data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(dtype: DType, v: &[i64]) -> Known {
        Known::ints(dtype, vec![v.len() as i64], v.iter().map(|&x| Dim::Fixed(x)).collect())
    }

    /// ONNX's OneHot examples (onnx/backend/test/case/node/onehot.py): the new axis last,
    /// first and in the middle, negative indices counted from the depth, an index past it
    /// all "off", a float depth; the values may be shape arithmetic (a multiple of the
    /// batch).
    #[test]
    fn one_hot_of_known_indices() {
        let idx = Known::ints(DType::I64, vec![2, 2], [0, 7, -1, 2].map(Dim::Fixed).to_vec());
        let depth = ints(DType::I64, &[3]);
        let values = ints(DType::I64, &[0, 5]);
        let last = one_hot(&idx, &depth, &values, -1).unwrap();
        assert_eq!(last.shape, vec![2, 2, 3]);
        assert_eq!(last.fixed_ints().unwrap(), vec![5, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 5]);
        let first = one_hot(&idx, &depth, &values, 0).unwrap();
        assert_eq!(first.shape, vec![3, 2, 2]);
        assert_eq!(first.fixed_ints().unwrap(), vec![5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5]);
        let middle = one_hot(&idx, &depth, &values, 1).unwrap();
        assert_eq!(middle.shape, vec![2, 3, 2]);
        assert_eq!(middle.fixed_ints().unwrap(), vec![5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5]);
        let batch = Known::ints(DType::I64, vec![2], vec![Dim::Fixed(1), Dim::Batch(2)]);
        let repeats = one_hot(&ints(DType::I64, &[1]), &ints(DType::I64, &[4]), &batch, -1).unwrap();
        assert_eq!(repeats.dims(), vec![Dim::Fixed(1), Dim::Batch(2), Dim::Fixed(1), Dim::Fixed(1)]);
        let floats = Known { dtype: DType::F32, shape: vec![2], data: KnownData::Floats(vec![-1.0, 1.0]) };
        let float_depth = Known { dtype: DType::F32, shape: vec![], data: KnownData::Floats(vec![3.0]) };
        let f = one_hot(&ints(DType::I64, &[1]), &float_depth, &floats, -1).unwrap();
        assert_eq!((f.dtype, f.floats().unwrap()), (DType::F32, vec![-1.0, 1.0, -1.0]));
        assert!(one_hot(&ints(DType::I64, &[1]), &ints(DType::I64, &[0]), &values, -1).is_none(), "depth 0");
        assert!(one_hot(&ints(DType::I64, &[1]), &depth, &values, 3).is_none(), "axis past the rank");
    }

    /// ONNX's constant Pad (onnx/backend/test/case/node/pad.py's `constant_pad`, pads
    /// `[0, 2, 0, 0]` of a `[3, 2]` input): the fill where no input element lands; by
    /// axes (opset 18); negative pads (a crop) and other modes are left to run time.
    #[test]
    fn pad_of_a_known_tensor() {
        let pad = Op::Pad(pipewright_ops::op::Pad { mode: pipewright_ops::op::PadMode::Constant, attrs: None });
        let x = Known { dtype: DType::F32, shape: vec![3, 2], data: KnownData::Floats(vec![1.0, 1.2, 2.3, 3.4, 4.5, 5.7]) };
        let value = Known { dtype: DType::F32, shape: vec![], data: KnownData::Floats(vec![1.2]) };
        let padded = evaluate(&pad, &[Some(&x), Some(&ints(DType::I64, &[0, 2, 0, 0])), Some(&value)], &[], DType::F32, Some(vec![3, 4])).unwrap();
        assert_eq!(padded.floats().unwrap(), vec![1.2, 1.2, 1.0, 1.2, 1.2, 1.2, 2.3, 3.4, 1.2, 1.2, 4.5, 5.7]);
        let by_axes = evaluate(&pad, &[Some(&x), Some(&ints(DType::I64, &[0, 1])), None, Some(&ints(DType::I64, &[0]))], &[], DType::F32, Some(vec![4, 2])).unwrap();
        assert_eq!(by_axes.floats().unwrap(), vec![1.0, 1.2, 2.3, 3.4, 4.5, 5.7, 0.0, 0.0]);
        assert!(evaluate(&pad, &[Some(&x), Some(&ints(DType::I64, &[0, -1, 0, 0])), None], &[], DType::F32, Some(vec![3, 1])).is_none(), "a crop");
        let edge = Op::Pad(pipewright_ops::op::Pad { mode: pipewright_ops::op::PadMode::Edge, attrs: None });
        assert!(evaluate(&edge, &[Some(&x), Some(&ints(DType::I64, &[0, 2, 0, 0])), None], &[], DType::F32, Some(vec![3, 4])).is_none());
    }

    /// Running sums along an axis (inclusive, exclusive, reversed), and rows of a table
    /// looked up at known positions.
    #[test]
    fn cumsum_and_row_lookups_of_known_tensors() {
        let mask = Known { dtype: DType::I64, shape: vec![2, 3], data: KnownData::Ints([1, 1, 1, 1, 0, 1].iter().map(|&x| Dim::Fixed(x)).collect()) };
        let axis = ints(DType::I64, &[1]);
        let sums = |exclusive, reverse| evaluate(&Op::CumSum { exclusive, reverse }, &[Some(&mask), Some(&axis)], &[], DType::I64, Some(vec![2, 3])).unwrap().fixed_ints().unwrap();
        assert_eq!(sums(false, false), [1, 2, 3, 1, 1, 2]);
        assert_eq!(sums(true, false), [0, 1, 2, 0, 1, 1]);
        assert_eq!(sums(false, true), [3, 2, 1, 2, 1, 1]);
        let table = Known { dtype: DType::F32, shape: vec![3, 2], data: KnownData::Floats(vec![0.5, 0.25, 1.5, 1.25, 2.5, 2.25]) };
        let at = Known { dtype: DType::I64, shape: vec![2, 2], data: KnownData::Ints([2, 0, -1, 1].iter().map(|&x| Dim::Fixed(x)).collect()) };
        let rows = evaluate(&Op::Gather { axis: 0 }, &[Some(&table), Some(&at)], &[], DType::F32, Some(vec![2, 2, 2])).unwrap();
        assert_eq!(rows.shape, [2, 2, 2]);
        assert_eq!(rows.floats().unwrap(), vec![2.5, 2.25, 0.5, 0.25, 2.5, 2.25, 1.5, 1.25]);
        assert!(evaluate(&Op::Gather { axis: 1 }, &[Some(&table), Some(&at)], &[], DType::F32, None).is_none(), "only along the leading axis");
    }

    /// A pads vector reshaped to pairs, reversed along axis 0 and transposed, as PyTorch
    /// exports `F.pad`'s pads: every step is shape arithmetic known at import.
    #[test]
    fn slices_and_transposes_of_known_tensors() {
        let pairs = Known::ints(DType::I64, vec![3, 2], [0, 1, 2, 3, 4, 5].map(Dim::Fixed).to_vec());
        let reversed_rows = pipewright_ops::op::Slice { attrs: Some((vec![-1], vec![i64::MIN], Some(vec![0]))) };
        // Attribute-form slices have step 1: reverse with the input form instead.
        assert!(slice_nd(&reversed_rows, &[Some(&pairs)], vec![0, 2]).is_some_and(|k| k.is_empty()));
        let (st, en, ax, step) = (ints(DType::I64, &[-1]), ints(DType::I64, &[i64::MIN]), ints(DType::I64, &[0]), ints(DType::I64, &[-1]));
        let input_form = pipewright_ops::op::Slice { attrs: None };
        let rev = slice_nd(&input_form, &[Some(&pairs), Some(&st), Some(&en), Some(&ax), Some(&step)], vec![3, 2]).unwrap();
        assert_eq!(rev.fixed_ints().unwrap(), [4, 5, 2, 3, 0, 1]);
        let t = transpose(&rev, Some(&vec![1, 0]), vec![2, 3]).unwrap();
        assert_eq!(t.fixed_ints().unwrap(), [4, 2, 0, 5, 3, 1]);
        assert!(transpose(&rev, Some(&vec![1, 0]), vec![3, 2]).is_none(), "a wrong output shape is not evaluated");
    }

    #[test]
    fn integer_results_wrap_to_the_type() {
        let d = binary(BinaryOp::Sub, &ints(DType::U8, &[1, 200]), &ints(DType::U8, &[2, 100]), DType::U8, vec![2]).unwrap();
        assert_eq!(d.to_tensor().unwrap().to_i64s(), [255, 100]);
        let p = binary(BinaryOp::Mul, &ints(DType::U16, &[300]), &ints(DType::U16, &[300]), DType::U16, vec![1]).unwrap();
        assert_eq!(p.to_tensor().unwrap().to_i64s(), [90_000 % 65_536]);
    }

    /// Swin's `head_dim ** -0.5`, a Pow of two float constants, is known (so the
    /// attention fusion sees its scale), rounded to the output type.
    #[test]
    fn a_power_of_float_constants_is_known() {
        let scalar = |v: f64| Known::from_tensor(&TensorData::from_f64s(DType::F32, vec![], &[v])).unwrap();
        let p = binary(BinaryOp::Pow, &scalar(4.0), &scalar(-0.5), DType::F32, vec![]).unwrap();
        assert_eq!(p.floats().unwrap(), [0.5]);
        let third = binary(BinaryOp::Pow, &scalar(3.0), &scalar(-1.0), DType::F32, vec![]).unwrap();
        assert_eq!(third.floats().unwrap(), [f64::from(1.0f32 / 3.0)]);
    }

    #[test]
    fn u64_from_2_pow_63_is_left_to_the_runtime() {
        // 2^63 as the i64 bit pattern the importer reads: signed division would be wrong.
        let big = ints(DType::U64, &[i64::MIN]);
        assert!(binary(BinaryOp::Div, &big, &ints(DType::U64, &[2]), DType::U64, vec![1]).is_none());
        assert!(binary(BinaryOp::Less, &ints(DType::U64, &[1]), &big, DType::Bool, vec![1]).is_none());
        assert!(binary(BinaryOp::Div, &ints(DType::U64, &[9]), &ints(DType::U64, &[2]), DType::U64, vec![1]).is_some());
    }
}
