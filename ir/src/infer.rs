//! Shape and dtype inference for every op, over dimensions with a symbolic batch `N`.
//!
//! Models exported at a fixed batch size carry that size in constants (Reshape targets,
//! Expand shapes). `Ctx::export_batch` is that size: a fixed extent equal to it that
//! meets an `N` is read as `N`, so the batch stays symbolic through such constants.

use crate::dim::{normalize_axis, Dim, Shape, TensorType};
use crate::known::Known;
use pipewright_ops::op::{AspectPolicy, Attention, AutoPad, BinaryOp, ClassLoss, Conv, ConvTranspose, CoordMode, Gemm, LinearAttention, LossReduction, Op, OptimizerStep, Pad, Pool, Quantize, Reduce, Resize, ResizeMode, Rnn, RnnCell, Slice, Split, UnaryOp, Window};
use crate::DType;

mod signal;

/// What inference knows beyond the op: the batch size the model's constants assume.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ctx {
    pub export_batch: Option<i64>,
}

/// One operand as inference sees it.
#[derive(Clone, Copy, Debug)]
pub struct In<'a> {
    pub ty: &'a TensorType,
    pub known: Option<&'a Known>,
}

type R<T> = Result<T, String>;

/// Infers the types of the first `n_out` outputs of `op`.
pub fn infer(op: &Op, ins: &[Option<In>], n_out: usize, ctx: Ctx) -> R<Vec<TensorType>> {
    let req = |i: usize| -> R<In> { ins.get(i).copied().flatten().ok_or_else(|| format!("input {i} is required")) };
    let x = || req(0);
    let out1 = |dtype: DType, shape: Shape| Ok(vec![TensorType::new(dtype, shape)]);
    match op {
        Op::Unary(UnaryOp::Not) | Op::Unary(UnaryOp::IsNaN) | Op::IsInf { .. } => out1(DType::Bool, x()?.ty.shape.clone()),
        Op::Unary(_)
        | Op::LeakyRelu { .. }
        | Op::Elu { .. }
        | Op::Celu { .. }
        | Op::Selu { .. }
        | Op::HardSigmoid { .. }
        | Op::ThresholdedRelu { .. }
        | Op::Swish { .. }
        | Op::Gelu { .. }
        | Op::Clip { .. }
        | Op::Trilu { .. }
        | Op::InstanceNormalization { .. }
        | Op::CumSum { .. }
        | Op::CumProd { .. }
        | Op::ScatterND { .. }
        | Op::ScatterElements { .. }
        | Op::Scatter { .. }
        | Op::Shrink { .. }
        | Op::Lrn(_)
        | Op::MeanVarianceNormalization { .. }
        | Op::GroupNormalization(_)
        | Op::ReverseSequence { .. }
        | Op::StageBoundary { .. }
        | Op::StopGradient => out1(x()?.ty.dtype, x()?.ty.shape.clone()),
        Op::Hardmax(s) => axis_op(x()?, s.axis, s.coerce_2d),
        Op::LpNormalization { axis, .. } => axis_op(x()?, *axis, false),
        Op::TopK { axis, .. } => top_k(x()?, req(1)?, *axis),
        Op::Rnn(r) => rnn(r, x()?, req(1)?, req(2)?, ctx),
        Op::OneHot { axis } => one_hot(req(0)?, req(1)?, req(2)?, *axis),
        Op::EyeLike { dtype, .. } => {
            let t = &x()?.ty;
            if t.shape.rank() != 2 {
                return Err(format!("input must be 2-D, got {}", t.shape));
            }
            out1(dtype.unwrap_or(t.dtype), t.shape.clone())
        }
        Op::Det => {
            let t = &x()?.ty;
            let r = t.shape.rank();
            // An export-batch extent may be the batch symbol on one side.
            if r < 2 || !dims_agree(t.shape.0[r - 1], t.shape.0[r - 2], ctx) {
                return Err(format!("input must be [*, M, M], got {}", t.shape));
            }
            out1(t.dtype, Shape(t.shape.0[..r - 2].to_vec()))
        }
        Op::Softmax(s) | Op::LogSoftmax(s) => {
            let t = &x()?.ty;
            // Before opset 13 the axis splits the input into a 2-D view, so `r` is valid too.
            let r = t.shape.rank() as i64;
            let ok = if s.coerce_2d { (-r..=r).contains(&s.axis) } else { (-r..r).contains(&s.axis) };
            if !ok {
                return Err(format!("axis {} out of range for {}", s.axis, t.shape));
            }
            out1(t.dtype, t.shape.clone())
        }
        Op::Binary(BinaryOp::PRelu) => {
            broadcast(&[&x()?.ty.shape, &req(1)?.ty.shape], ctx)?;
            out1(x()?.ty.dtype, x()?.ty.shape.clone())
        }
        Op::Binary(b) => {
            let (a, c) = (x()?, req(1)?);
            let shape = broadcast(&[&a.ty.shape, &c.ty.shape], ctx)?;
            if !matches!(b, BinaryOp::Pow) && a.ty.dtype != c.ty.dtype {
                return Err(format!("operand types differ: {} and {}", a.ty.dtype, c.ty.dtype));
            }
            out1(if b.is_predicate() { DType::Bool } else { a.ty.dtype }, shape)
        }
        Op::Variadic(_) => {
            let all: Vec<In> = ins.iter().map(|i| i.ok_or_else(|| "inputs cannot be omitted".to_string())).collect::<R<_>>()?;
            let shapes: Vec<&Shape> = all.iter().map(|i| &i.ty.shape).collect();
            out1(x()?.ty.dtype, broadcast(&shapes, ctx)?)
        }
        Op::MatMul => out1(x()?.ty.dtype, matmul(&x()?.ty.shape, &req(1)?.ty.shape, ctx)?),
        Op::Gemm(g) => gemm(g, x()?, req(1)?, ins.get(2).copied().flatten(), ctx),
        Op::Conv(c) => conv(c, x()?, req(1)?),
        Op::ConvInteger(c) => retype(conv(c, x()?, req(1)?)?, DType::I32),
        Op::QLinearConv(c) => retype(conv(c, x()?, req(3)?)?, req(7)?.ty.dtype),
        Op::MatMulInteger => out1(DType::I32, matmul(&x()?.ty.shape, &req(1)?.ty.shape, ctx)?),
        Op::QLinearMatMul => out1(req(7)?.ty.dtype, matmul(&x()?.ty.shape, &req(3)?.ty.shape, ctx)?),
        Op::SwiGlu { .. } => {
            let (a, b) = (x()?.ty, req(1)?.ty);
            // No broadcasting: the gate and the value must agree exactly.
            if a != b {
                return Err(format!("gate {a} and value {b} must have one type and shape"));
            }
            out1(a.dtype, a.shape.clone())
        }
        Op::MaxUnpool { kernel_shape, strides, pads } => max_unpool(x()?, ins.get(2).copied().flatten(), kernel_shape, strides, pads),
        Op::TensorScatter { axis, .. } => tensor_scatter(x()?, req(1)?, *axis),
        Op::ConvTranspose(c) => conv_transpose(c, x()?, req(1)?),
        Op::MaxPool(p) | Op::AveragePool(p) => {
            let y = pool(p, x()?)?;
            let mut outs = vec![y.clone()];
            if n_out > 1 {
                outs.push(TensorType::new(DType::I64, y.shape));
            }
            Ok(outs)
        }
        Op::LpPool { pool: p, .. } => Ok(vec![pool(p, x()?)?]),
        Op::GlobalAveragePool | Op::GlobalMaxPool => {
            let t = &x()?.ty;
            if t.shape.rank() < 3 {
                return Err(format!("input must be [N,C,spatial...], got {}", t.shape));
            }
            let mut d = t.shape.0[..2].to_vec();
            d.extend(std::iter::repeat_n(Dim::Fixed(1), t.shape.rank() - 2));
            out1(t.dtype, Shape(d))
        }
        Op::BatchNormalization(_) => {
            let t = &x()?.ty;
            if t.shape.rank() < 2 {
                return Err(format!("input must have a channel axis, got {}", t.shape));
            }
            let stats = TensorType::new(t.dtype, Shape(vec![t.shape.0[1]]));
            let mut outs: Vec<TensorType> = vec![(*t).clone()];
            outs.extend(std::iter::repeat_n(stats, n_out.saturating_sub(1)));
            Ok(outs)
        }
        Op::LayerNormalization(l) => {
            let t = &x()?.ty;
            let axis = t.shape.axis(l.axis).ok_or_else(|| format!("axis {} out of range for {}", l.axis, t.shape))?;
            let mut stat = t.shape.0.clone();
            stat[axis..].iter_mut().for_each(|d| *d = Dim::Fixed(1));
            let stash = DType::from_onnx(l.stash_type as i32).unwrap_or(DType::F32);
            let mut outs: Vec<TensorType> = vec![(*t).clone()];
            outs.extend(std::iter::repeat_n(TensorType::new(stash, Shape(stat)), n_out.saturating_sub(1)));
            Ok(outs)
        }
        Op::NegativeLogLikelihoodLoss(l) | Op::SoftmaxCrossEntropyLoss(l) => {
            let mut outs = vec![class_loss(&x()?.ty, &req(1)?.ty, l, ctx)?];
            if n_out > 1 {
                outs.push(x()?.ty.clone());
            }
            Ok(outs)
        }
        Op::RMSNormalization(l) => {
            let t = &x()?.ty;
            t.shape.axis(l.axis).ok_or_else(|| format!("axis {} out of range for {}", l.axis, t.shape))?;
            out1(t.dtype, t.shape.clone())
        }
        Op::RotaryEmbedding(r) => {
            let t = &x()?.ty;
            match (t.shape.rank(), r.num_heads) {
                (4, _) | (3, Some(_)) => out1(t.dtype, t.shape.clone()),
                (3, None) => Err("a 3-D input needs num_heads".into()),
                (rank, _) => Err(format!("input must be 3-D or 4-D, got rank {rank}")),
            }
        }
        Op::Attention(at) => attention(at, ins),
        Op::LinearAttention(la) => linear_attention(la, ins),
        Op::Optimizer(o) => optimizer(o, ins, n_out),
        Op::Binarizer { .. } => out1(x()?.ty.dtype, x()?.ty.shape.clone()),
        Op::ArrayFeatureExtractor => array_feature_extractor(x()?, req(1)?),
        Op::TreeEnsemble(t) => {
            let xt = &x()?.ty;
            match (&xt.shape.0[..], t.featureids.iter().max()) {
                ([n, Dim::Fixed(f)], Some(&top)) if top < *f => out1(xt.dtype, Shape(vec![*n, Dim::Fixed(t.n_targets)])),
                _ => Err(format!("input {} must be [N, features] with more features than the largest feature id", xt.shape)),
            }
        }
        Op::CausalConvWithState { .. } => causal_conv_with_state(ins),
        Op::Dropout { .. } => {
            let t = &x()?.ty;
            let mut outs: Vec<TensorType> = vec![(*t).clone()];
            if n_out > 1 {
                outs.push(TensorType::new(DType::Bool, t.shape.clone()));
            }
            Ok(outs)
        }
        Op::Reshape { allow_zero } => {
            let target = known_dims(req(1)?, "shape")?;
            out1(x()?.ty.dtype, reshape(&x()?.ty.shape, &target, *allow_zero, ctx)?)
        }
        Op::Flatten { axis } => {
            let t = &x()?.ty;
            let r = t.shape.rank();
            let a = if *axis < 0 { *axis + r as i64 } else { *axis };
            if !(0..=r as i64).contains(&a) {
                return Err(format!("axis {axis} out of range for {}", t.shape));
            }
            let (outer, inner) = t.shape.0.split_at(a as usize);
            out1(t.dtype, Shape(vec![product(outer, ctx)?, product(inner, ctx)?]))
        }
        Op::Transpose { perm } => {
            let t = &x()?.ty;
            let r = t.shape.rank();
            let perm: Vec<i64> = perm.clone().unwrap_or_else(|| (0..r as i64).rev().collect());
            let mut seen = vec![false; r];
            let mut d = Vec::with_capacity(r);
            for &p in &perm {
                let a = normalize_axis(p, r).filter(|&a| !seen[a]).ok_or_else(|| format!("perm {perm:?} is not a permutation of rank {r}"))?;
                seen[a] = true;
                d.push(t.shape.0[a]);
            }
            if d.len() != r {
                return Err(format!("perm {perm:?} is not a permutation of rank {r}"));
            }
            out1(t.dtype, Shape(d))
        }
        Op::Squeeze { axes } => {
            let t = &x()?.ty;
            let axes = match axes {
                Some(a) => Some(a.clone()),
                None => ins.get(1).copied().flatten().map(|i| known_ints(i, "axes")).transpose()?,
            };
            let r = t.shape.rank();
            let drop: Vec<usize> = match axes {
                Some(a) => a.iter().map(|&x| normalize_axis(x, r).ok_or(format!("axis {x} out of range for {}", t.shape))).collect::<R<_>>()?,
                None => (0..r).filter(|&i| t.shape.0[i] == Dim::Fixed(1)).collect(),
            };
            for &a in &drop {
                if t.shape.0[a] != Dim::Fixed(1) && !(t.shape.0[a] == Dim::N && ctx.export_batch == Some(1)) {
                    return Err(format!("cannot squeeze axis {a} of extent {} in {}", t.shape.0[a], t.shape));
                }
            }
            let d = (0..r).filter(|i| !drop.contains(i)).map(|i| t.shape.0[i]).collect();
            out1(t.dtype, Shape(d))
        }
        Op::Unsqueeze { axes } => {
            let t = &x()?.ty;
            let axes = match axes {
                Some(a) => a.clone(),
                None => known_ints(req(1)?, "axes")?,
            };
            let r = t.shape.rank() + axes.len();
            let mut ins_at = vec![false; r];
            for &a in &axes {
                let n = normalize_axis(a, r).ok_or(format!("axis {a} out of range for output rank {r}"))?;
                if ins_at[n] {
                    return Err(format!("axis {a} repeated"));
                }
                ins_at[n] = true;
            }
            let mut src = t.shape.0.iter();
            let d = ins_at.iter().map(|&new| if new { Dim::Fixed(1) } else { *src.next().expect("rank checked") }).collect();
            out1(t.dtype, Shape(d))
        }
        Op::Concat { axis } => {
            let all: Vec<In> = ins.iter().map(|i| i.ok_or_else(|| "inputs cannot be omitted".to_string())).collect::<R<_>>()?;
            let first = &all.first().ok_or("needs at least one input")?.ty;
            let r = first.shape.rank();
            let a = normalize_axis(*axis, r).ok_or(format!("axis {axis} out of range for {}", first.shape))?;
            let mut d = first.shape.0.clone();
            for other in &all[1..] {
                if other.ty.shape.rank() != r {
                    return Err(format!("inputs of rank {} and {} cannot be concatenated", r, other.ty.shape.rank()));
                }
                for (i, &o) in other.ty.shape.0.iter().enumerate() {
                    if i == a {
                        d[a] = d[a].add(o).unwrap_or_else(|| resolve_sum(d[a], o, ctx));
                    } else if dims_agree(d[i], o, ctx) {
                        // An input baked at the export batch meets one with N: keep N.
                        if o.is_batch() {
                            d[i] = o;
                        }
                    } else {
                        return Err(format!("{} and {} differ outside axis {a}", first.shape, other.ty.shape));
                    }
                }
            }
            out1(first.dtype, Shape(d))
        }
        Op::Split(s) => split(s, x()?, ins.get(1).copied().flatten(), n_out, ctx),
        Op::Slice(s) => slice(s, ins, ctx),
        Op::Gather { axis } => {
            let (d, i) = (&x()?.ty, &req(1)?.ty);
            let a = d.shape.axis(*axis).ok_or(format!("axis {axis} out of range for {}", d.shape))?;
            let mut out = d.shape.0[..a].to_vec();
            out.extend(&i.shape.0);
            out.extend(&d.shape.0[a + 1..]);
            out1(d.dtype, Shape(out))
        }
        Op::GatherElements { .. } => out1(x()?.ty.dtype, req(1)?.ty.shape.clone()),
        Op::GatherND { batch_dims } => gather_nd(&x()?.ty, &req(1)?.ty, *batch_dims),
        Op::Expand => {
            let target = Shape(known_dims(req(1)?, "shape")?);
            out1(x()?.ty.dtype, broadcast(&[&x()?.ty.shape, &target], ctx)?)
        }
        Op::Where => {
            let (c, a, b) = (x()?, req(1)?, req(2)?);
            out1(a.ty.dtype, broadcast(&[&c.ty.shape, &a.ty.shape, &b.ty.shape], ctx)?)
        }
        Op::Cast { to, .. } => out1(*to, x()?.ty.shape.clone()),
        Op::BitCast { to } => {
            let from = x()?.ty.dtype;
            if from.bits() != to.bits() {
                return Err(format!("bitcast from {from} ({} bits) to {to} ({} bits): the types must have the same width", from.bits(), to.bits()));
            }
            out1(*to, x()?.ty.shape.clone())
        }
        Op::CastLike { .. } => out1(req(1)?.ty.dtype, x()?.ty.shape.clone()),
        Op::QuantizeLinear(q) => {
            let zp = ins.get(2).copied().flatten();
            let to = quantize_dtype(q, x()?, req(1)?, zp)?;
            quant_params(x()?, req(1)?, zp, q.axis, q.block_size, ctx)?;
            out1(to, x()?.ty.shape.clone())
        }
        Op::DequantizeLinear { axis, block_size, output_dtype } => {
            let (xq, scale, zp) = (x()?, req(1)?, ins.get(2).copied().flatten());
            let xt = xq.ty.dtype;
            if !(xt.is_quantized() || xt == DType::I32) {
                return Err(format!("x of type {xt} is not a quantized type"));
            }
            if !scale.ty.dtype.is_float() {
                return Err(format!("x_scale must be a float, got {}", scale.ty.dtype));
            }
            if let Some(z) = zp.filter(|z| z.ty.dtype != xt) {
                return Err(format!("x_zero_point of type {} must match x's type {xt}", z.ty.dtype));
            }
            quant_params(xq, scale, zp, *axis, *block_size, ctx)?;
            out1(output_dtype.unwrap_or(scale.ty.dtype), xq.ty.shape.clone())
        }
        Op::DynamicQuantizeLinear => {
            let xt = x()?.ty;
            if xt.dtype != DType::F32 {
                return Err(format!("x must be f32, got {}", xt.dtype));
            }
            Ok(vec![
                TensorType::new(DType::U8, xt.shape.clone()),
                TensorType::new(DType::F32, Shape::scalar()),
                TensorType::new(DType::U8, Shape::scalar()),
            ])
        }
        Op::Shape { start, end } => {
            let r = x()?.ty.shape.rank() as i64;
            let clamp = |v: i64| if v < 0 { (v + r).clamp(0, r) } else { v.min(r) };
            let n = (clamp(end.unwrap_or(r)) - clamp(*start)).max(0);
            out1(DType::I64, Shape::fixed(&[n]))
        }
        Op::Size => out1(DType::I64, Shape::scalar()),
        Op::ConstantOfShape { value } => {
            let dims = known_dims(x()?, "shape")?;
            out1(value.as_ref().map(|v| v.dtype).unwrap_or(DType::F32), Shape(dims))
        }
        Op::Range => {
            let start = x()?;
            let n = match (start.known, req(1)?.known, req(2)?.known) {
                (Some(s), Some(l), Some(d)) => {
                    let f = |k: &Known| k.floats().and_then(|v| v.first().copied());
                    let first = |k: &Known| k.dims().first().cloned();
                    match (f(s), f(l), f(d)) {
                        (Some(s), Some(l), Some(d)) if d != 0.0 => Dim::Fixed(((l - s) / d).ceil().max(0.0) as i64),
                        // `arange(N)` over the batch (exporters index rows with it).
                        _ if first(s) == Some(Dim::Fixed(0)) && first(d) == Some(Dim::Fixed(1)) && matches!(first(l), Some(Dim::Batch(_))) => {
                            first(l).unwrap_or(Dim::Fixed(0))
                        }
                        _ => return Err("start, limit and delta must be known scalars with delta != 0 (or 0, a multiple of the batch, 1)".into()),
                    }
                }
                _ => return Err("the output length depends on start/limit/delta, which are not known at import".into()),
            };
            out1(start.ty.dtype, Shape(vec![n]))
        }
        Op::Reduce(r) => reduce(r, x()?, ins.get(1).copied().flatten()),
        Op::ArgMax { axis, keepdims, .. } | Op::ArgMin { axis, keepdims, .. } => {
            let t = &x()?.ty;
            let a = t.shape.axis(*axis).ok_or(format!("axis {axis} out of range for {}", t.shape))?;
            out1(DType::I64, reduce_shape(&t.shape, &[a], *keepdims))
        }
        Op::Einsum { equation } => {
            let all: Vec<In> = ins.iter().map(|i| i.ok_or_else(|| "inputs cannot be omitted".to_string())).collect::<R<_>>()?;
            let shapes: Vec<&Shape> = all.iter().map(|i| &i.ty.shape).collect();
            out1(x()?.ty.dtype, einsum(equation, &shapes, ctx)?)
        }
        Op::Pad(p) => pad(p, ins),
        Op::Resize(r) | Op::Upsample(r) => resize(r, ins),
        Op::Col2Im { dilations, pads, strides } => col2im(&x()?.ty, req(1)?, req(2)?, [dilations, pads, strides]),
        Op::CenterCropPad { axes } => {
            let t = &x()?.ty;
            let shape = req(1)?.known.ok_or("shape is not known at import")?.fixed_ints().ok_or("shape must be fixed")?;
            let rank = t.shape.rank();
            let axes: Vec<usize> = match axes {
                Some(a) => a.iter().map(|&a| normalize_axis(a, rank).ok_or(format!("axis {a} out of range for rank {rank}"))).collect::<R<_>>()?,
                None => (0..rank).collect(),
            };
            if shape.len() != axes.len() || shape.iter().any(|&v| v < 0) {
                return Err(format!("shape {shape:?} does not fit {} axes", axes.len()));
            }
            let mut out = t.shape.0.clone();
            // The target is literal: an axis that was the batch becomes that fixed extent.
            for (&a, &v) in axes.iter().zip(&shape) {
                out[a] = Dim::Fixed(v);
            }
            out1(t.dtype, Shape(out))
        }
        Op::AffineGrid { .. } => affine_grid(&x()?.ty, req(1)?),
        Op::GridSample { mode, .. } => grid_sample(&x()?.ty, &req(1)?.ty, *mode),
        Op::Dft { inverse, onesided, axis } => {
            let opt = |i: usize| ins.get(i).copied().flatten();
            Ok(vec![signal::dft(&x()?.ty, opt(1), opt(2), *axis, *inverse, *onesided)?.0])
        }
        Op::Stft { onesided } => signal::stft(&x()?.ty, req(1)?, ins.get(2).copied().flatten(), ins.get(3).copied().flatten(), *onesided),
        Op::RoiAlign(r) => signal::roi_align(r, &x()?.ty, &req(1)?.ty, &req(2)?.ty),
        Op::DeformConv { conv, offset_group } => {
            let mask = ins.get(4).copied().flatten().map(|m| m.ty);
            signal::deform_conv(conv, *offset_group, x()?, req(1)?, &req(2)?.ty, mask)
        }
        Op::DepthToSpace { blocksize, .. } => block_move(&x()?.ty, *blocksize, true),
        Op::SpaceToDepth { blocksize, .. } => block_move(&x()?.ty, *blocksize, false),
        Op::Tile => {
            let t = &x()?.ty;
            // Repeats may be the batch (a dynamic export tiles position ids over it).
            let reps = req(1)?.known.ok_or("repeats input is not known at import")?.dims();
            if reps.len() != t.shape.rank() {
                return Err(format!("{} repeats for rank {}", reps.len(), t.shape.rank()));
            }
            let text = || fmt_target(&reps);
            let d = t
                .shape
                .0
                .iter()
                .zip(&reps)
                .map(|(d, &r)| match r {
                    Dim::Fixed(0) => Ok(Dim::Fixed(0)),
                    Dim::Fixed(v) if v < 0 => Err(format!("repeats {} must not be negative", text())),
                    r => d.mul(r).ok_or_else(|| format!("repeats {} overflow the extents of {} (or repeat the batch by the batch)", text(), t.shape)),
                })
                .collect::<R<_>>()?;
            out1(t.dtype, Shape(d))
        }
    }
    .map(|mut v: Vec<TensorType>| {
        v.truncate(n_out.max(1));
        v
    })
    .and_then(|v| if v.len() < n_out { Err(format!("op has {} outputs, node names {n_out}", v.len())) } else { Ok(v) })
}

/// Whether two extents agree, reading a fixed export-batch extent as `N`.
fn dims_agree(a: Dim, b: Dim, ctx: Ctx) -> bool {
    a == b
        || match (a, b, ctx.export_batch) {
            (Dim::Batch(k), Dim::Fixed(v), Some(n)) | (Dim::Fixed(v), Dim::Batch(k), Some(n)) => v == k * n,
            _ => false,
        }
}

/// Numpy multidirectional broadcasting.
pub fn broadcast(shapes: &[&Shape], ctx: Ctx) -> R<Shape> {
    let rank = shapes.iter().map(|s| s.rank()).max().unwrap_or(0);
    let mut out = vec![Dim::Fixed(1); rank];
    for s in shapes {
        let off = rank - s.rank();
        for (i, &d) in s.0.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == Dim::Fixed(1) {
                *o = d;
            } else if d == Dim::Fixed(1) || dims_agree(*o, d, ctx) {
                if d.is_batch() {
                    *o = d;
                }
            } else if ctx.export_batch == Some(1) && (*o == Dim::N || d == Dim::N) {
                // Exported at batch 1, an N axis may really be a broadcast axis of extent 1.
                *o = if *o == Dim::N { d } else { *o };
            } else {
                let list: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
                return Err(format!("shapes {} do not broadcast", list.join(" and ")));
            }
        }
    }
    Ok(Shape(out))
}

/// The product of `dims`; an error when it overflows (declared extents near 2^62 made it
/// panic in debug builds and wrap in release; found by pipewright-fuzz,
/// fuzz/crashes/onnx-f7288aae93418f8f.bin).
fn product(dims: &[Dim], ctx: Ctx) -> R<Dim> {
    dims.iter().try_fold(Dim::Fixed(1), |acc, &d| {
        acc.mul(d)
            .or_else(|| acc.eval(batch(ctx)).checked_mul(d.eval(batch(ctx))).map(Dim::Fixed))
            .ok_or_else(|| format!("the product of the extents {} overflows", Shape(dims.to_vec())))
    })
}

fn batch(ctx: Ctx) -> i64 {
    ctx.export_batch.unwrap_or(1)
}

fn resolve_sum(a: Dim, b: Dim, ctx: Ctx) -> Dim {
    Dim::Fixed(a.eval(batch(ctx)) + b.eval(batch(ctx)))
}

fn known_dims(i: In, what: &str) -> R<Vec<Dim>> {
    i.known.map(|k| k.dims()).ok_or_else(|| format!("{what} input is not known at import"))
}

fn known_ints(i: In, what: &str) -> R<Vec<i64>> {
    let k = i.known.ok_or_else(|| format!("{what} input is not known at import"))?;
    k.fixed_ints().ok_or_else(|| format!("{what} input depends on the batch size"))
}

fn matmul(a: &Shape, b: &Shape, ctx: Ctx) -> R<Shape> {
    if a.rank() == 0 || b.rank() == 0 {
        return Err("MatMul operands must have rank >= 1".into());
    }
    let a2 = if a.rank() == 1 { Shape(vec![Dim::Fixed(1), a.0[0]]) } else { a.clone() };
    let b2 = if b.rank() == 1 { Shape(vec![b.0[0], Dim::Fixed(1)]) } else { b.clone() };
    let (ra, rb) = (a2.rank(), b2.rank());
    let (m, ka) = (a2.0[ra - 2], a2.0[ra - 1]);
    let (kb, n) = (b2.0[rb - 2], b2.0[rb - 1]);
    if !dims_agree(ka, kb, ctx) {
        return Err(format!("inner dimensions differ: {a} x {b}"));
    }
    let batch_dims = broadcast(&[&Shape(a2.0[..ra - 2].to_vec()), &Shape(b2.0[..rb - 2].to_vec())], ctx)?;
    let mut out = batch_dims.0;
    if a.rank() > 1 {
        out.push(m);
    }
    if b.rank() > 1 {
        out.push(n);
    }
    Ok(Shape(out))
}

fn gemm(g: &Gemm, a: In, b: In, c: Option<In>, ctx: Ctx) -> R<Vec<TensorType>> {
    let (sa, sb) = (&a.ty.shape, &b.ty.shape);
    if sa.rank() != 2 || sb.rank() != 2 {
        return Err(format!("Gemm needs 2-D operands, got {sa} and {sb}"));
    }
    let (m, ka) = if g.trans_a { (sa.0[1], sa.0[0]) } else { (sa.0[0], sa.0[1]) };
    let (kb, n) = if g.trans_b { (sb.0[1], sb.0[0]) } else { (sb.0[0], sb.0[1]) };
    if !dims_agree(ka, kb, ctx) {
        return Err(format!("inner dimensions differ: {sa} x {sb} (trans_a={}, trans_b={})", g.trans_a as u8, g.trans_b as u8));
    }
    let y = Shape(vec![m, n]);
    if let Some(c) = c {
        let out = broadcast(&[&y, &c.ty.shape], ctx)?;
        if !out.0.iter().zip(&y.0).all(|(p, q)| dims_agree(*p, *q, ctx)) {
            return Err(format!("C of shape {} does not broadcast to {y}", c.ty.shape));
        }
    }
    Ok(vec![TensorType::new(a.ty.dtype, y)])
}

fn spatial<'a>(v: &'a [i64], n: usize, default: i64) -> Vec<i64> {
    if v.is_empty() { vec![default; n] } else { v.to_vec() }
}

/// Output extents of a convolution-like window over `input` spatial extents.
fn window_out(w: &Window, input: &[i64], kernel: &[i64], ceil_mode: bool) -> R<Vec<i64>> {
    let n = input.len();
    let strides = spatial(&w.strides, n, 1);
    let dil = spatial(&w.dilations, n, 1);
    let pads = spatial(&w.pads, 2 * n, 0);
    if kernel.len() != n || strides.len() != n || dil.len() != n || pads.len() != 2 * n {
        return Err(format!("window attributes do not match {n} spatial dimensions"));
    }
    if kernel.iter().chain(&strides).chain(&dil).any(|&v| v < 1) {
        return Err(format!("kernel {kernel:?}, strides {strides:?} and dilations {dil:?} must be positive"));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // In i128, so absurd attribute values give an error rather than an overflow.
        let (input_i, stride, pad_begin) = (input[i] as i128, strides[i] as i128, pads[i] as i128);
        let eff = (kernel[i] as i128 - 1) * dil[i] as i128 + 1;
        let o = match w.auto_pad {
            AutoPad::SameUpper | AutoPad::SameLower => (input_i + stride - 1) / stride,
            AutoPad::Valid => (input_i - eff).div_euclid(stride) + 1,
            AutoPad::NotSet => {
                let span = input_i + pad_begin + pads[i + n] as i128 - eff;
                if ceil_mode {
                    let mut o = (span + stride - 1).div_euclid(stride) + 1;
                    // The last window must start inside the input or its leading pad.
                    if (o - 1) * stride >= input_i + pad_begin {
                        o -= 1;
                    }
                    o
                } else {
                    span.div_euclid(stride) + 1
                }
            }
        };
        if o < 1 {
            return Err(format!("window {kernel:?} does not fit the input extents {input:?}"));
        }
        out.push(i64::try_from(o).map_err(|_| format!("output extent {o} is out of range"))?);
    }
    Ok(out)
}

fn fixed_spatial(s: &Shape, what: &str) -> R<Vec<i64>> {
    s.0[2..].iter().map(|d| d.fixed().ok_or_else(|| format!("{what} spatial extents must not depend on the batch (they do when a shape the exporter fixed at the export batch moved the batch onto them): export the model with a dynamic batch axis"))).collect()
}

/// The inferred outputs with element type `dtype` (integer and quantized convolutions).
fn retype(mut outs: Vec<TensorType>, dtype: DType) -> R<Vec<TensorType>> {
    outs.iter_mut().for_each(|t| t.dtype = dtype);
    Ok(outs)
}

/// MaxUnpool: `output_shape` when given (known at import, at least the unpooled extents),
/// else `(in - 1) * stride - pad_begin - pad_end + kernel` per spatial axis.
fn max_unpool(x: In, output_shape: Option<In>, kernel: &[i64], strides: &[i64], pads: &[i64]) -> R<Vec<TensorType>> {
    let s = &x.ty.shape;
    let n = kernel.len();
    if s.rank() != n + 2 {
        return Err(format!("input {s} must be [N,C] and {n} spatial axes (kernel_shape {kernel:?})"));
    }
    let (strides, pads) = (spatial(strides, n, 1), spatial(pads, 2 * n, 0));
    if strides.len() != n || pads.len() != 2 * n {
        return Err(format!("strides {strides:?} and pads {pads:?} do not match {n} spatial axes"));
    }
    let input = fixed_spatial(s, "input")?;
    let mut d = s.0[..2].to_vec();
    for i in 0..n {
        let e = (input[i] - 1).checked_mul(strides[i]).and_then(|v| v.checked_add(kernel[i] - pads[i] - pads[i + n]));
        d.push(Dim::Fixed(e.filter(|&e| e >= 0).ok_or_else(|| format!("unpooled extent of spatial axis {i} is out of range"))?));
    }
    if let Some(o) = output_shape {
        let want = known_dims(o, "output_shape")?;
        let fits = want.len() == d.len() && want.iter().zip(&d).skip(2).all(|(w, u)| matches!((w, u), (Dim::Fixed(w), Dim::Fixed(u)) if w >= u));
        if !fits {
            return Err(format!("output_shape {want:?} must have rank {} and hold the unpooled extents {}", d.len(), Shape(d.clone())));
        }
        d.splice(2.., want[2..].iter().copied());
    }
    Ok(vec![TensorType::new(x.ty.dtype, Shape(d))])
}

/// TensorScatter: the cache's type; the update may be shorter along `axis` only.
fn tensor_scatter(cache: In, update: In, axis: i64) -> R<Vec<TensorType>> {
    let (c, u) = (&cache.ty.shape, &update.ty.shape);
    let a = normalize_axis(axis, c.rank()).ok_or_else(|| format!("axis {axis} out of range for {c}"))?;
    // The write index is per batch row (axis 0), so the sequence axis cannot be 0.
    let fits = a > 0 && u.rank() == c.rank() && c.0.iter().zip(&u.0).enumerate().all(|(i, (p, q))| if i == a { matches!((p, q), (Dim::Fixed(p), Dim::Fixed(q)) if q <= p) } else { p == q });
    if !fits || cache.ty.dtype != update.ty.dtype {
        return Err(format!("update {} does not fit cache {} along axis {axis}", update.ty, cache.ty));
    }
    Ok(vec![cache.ty.clone()])
}

fn conv(c: &Conv, x: In, w: In) -> R<Vec<TensorType>> {
    let (sx, sw) = (&x.ty.shape, &w.ty.shape);
    if sx.rank() < 3 || sw.rank() != sx.rank() {
        return Err(format!("input {sx} and weight {sw} must be [N,C,spatial...] and [M,C/group,kernel...]"));
    }
    let input = fixed_spatial(sx, "input")?;
    let kernel = if c.window.kernel_shape.is_empty() { fixed_spatial(sw, "kernel")? } else { c.window.kernel_shape.clone() };
    let cin = sw.0[1].fixed().ok_or("weight channels must be fixed")?.checked_mul(c.group).ok_or("group overflows")?;
    if sx.0[1].fixed() != Some(cin) {
        return Err(format!("input has {} channels, weight {sw} with group {} expects {cin}", sx.0[1], c.group));
    }
    let mut d = vec![sx.0[0], sw.0[0]];
    d.extend(window_out(&c.window, &input, &kernel, false)?.into_iter().map(Dim::Fixed));
    Ok(vec![TensorType::new(x.ty.dtype, Shape(d))])
}

fn conv_transpose(c: &ConvTranspose, x: In, w: In) -> R<Vec<TensorType>> {
    let (sx, sw) = (&x.ty.shape, &w.ty.shape);
    if sx.rank() < 3 || sw.rank() != sx.rank() {
        return Err(format!("input {sx} and weight {sw} must be [N,C,spatial...] and [C,M/group,kernel...]"));
    }
    let input = fixed_spatial(sx, "input")?;
    let n = input.len();
    let kernel = if c.window.kernel_shape.is_empty() { fixed_spatial(sw, "kernel")? } else { c.window.kernel_shape.clone() };
    let strides = spatial(&c.window.strides, n, 1);
    let dil = spatial(&c.window.dilations, n, 1);
    let pads = spatial(&c.window.pads, 2 * n, 0);
    let outpad = spatial(&c.output_padding, n, 0);
    if kernel.len() != n || strides.len() != n || dil.len() != n || pads.len() != 2 * n || outpad.len() != n {
        return Err(format!("window attributes do not match {n} spatial dimensions"));
    }
    let out: Vec<i64> = if !c.output_shape.is_empty() {
        c.output_shape[c.output_shape.len().saturating_sub(n)..].to_vec()
    } else {
        (0..n)
            .map(|i| {
                // In i128, so absurd attribute values give an error rather than an overflow.
                let w = |v: i64| v as i128;
                let o = match c.window.auto_pad {
                    AutoPad::SameUpper | AutoPad::SameLower => w(input[i]) * w(strides[i]),
                    _ => {
                        w(strides[i]) * (w(input[i]) - 1) + w(outpad[i]) + (w(kernel[i]) - 1) * w(dil[i]) + 1
                            - w(pads[i])
                            - w(pads[i + n])
                    }
                };
                i64::try_from(o).map_err(|_| format!("output extent {o} is out of range"))
            })
            .collect::<R<_>>()?
    };
    let m = sw.0[1].fixed().ok_or("weight channels must be fixed")?.checked_mul(c.group).ok_or("group overflows")?;
    let mut d = vec![sx.0[0], Dim::Fixed(m)];
    d.extend(out.into_iter().map(Dim::Fixed));
    Ok(vec![TensorType::new(x.ty.dtype, Shape(d))])
}

fn pool(p: &Pool, x: In) -> R<TensorType> {
    let s = &x.ty.shape;
    if s.rank() < 3 {
        return Err(format!("input must be [N,C,spatial...], got {s}"));
    }
    if p.window.kernel_shape.is_empty() {
        return Err("attribute \"kernel_shape\" is required".into());
    }
    let out = window_out(&p.window, &fixed_spatial(s, "input")?, &p.window.kernel_shape, p.ceil_mode)?;
    let mut d = s.0[..2].to_vec();
    d.extend(out.into_iter().map(Dim::Fixed));
    Ok(TensorType::new(x.ty.dtype, Shape(d)))
}

/// Resolves a Reshape target (with `0` and `-1`) against the input shape.
fn reshape(input: &Shape, target: &[Dim], allow_zero: bool, ctx: Ctx) -> R<Shape> {
    let mut out: Vec<Option<Dim>> = Vec::with_capacity(target.len());
    for (i, &t) in target.iter().enumerate() {
        out.push(match t {
            Dim::Fixed(0) if !allow_zero => Some(*input.0.get(i).ok_or(format!("0 at position {i} copies a dimension {input} lacks"))?),
            Dim::Fixed(-1) => None,
            Dim::Fixed(v) if v < -1 => return Err(format!("invalid target extent {v}")),
            other => Some(other),
        });
    }
    if out.iter().filter(|d| d.is_none()).count() > 1 {
        return Err("more than one -1 in the target shape".into());
    }
    let total = input.numel_dim();
    let n = batch(ctx);
    let mut dims: Vec<Dim> = out.iter().map(|d| d.unwrap_or(Dim::Fixed(1))).collect();
    let known_product = product(&dims, ctx)?;
    // A target that follows the batch (its extents read from a batch-carrying value) over
    // a value whose rows were fixed at export fits at the export batch only.
    if total.is_some_and(|t| !t.is_batch()) && known_product.is_batch() {
        return Err(format!(
            "cannot reshape {input} to {}: the target follows the batch, but the value's extents were fixed at export (it does not follow the batch)",
            fmt_target(target)
        ));
    }
    match out.iter().position(|d| d.is_none()) {
        Some(hole) => {
            // A leading literal next to a -1, where the input leads with the batch, holds the
            // batch as its outermost factor, as a reshape that keeps the samples apart must:
            // the export batch itself (`[2, 65, -1]`), or the batch folded with the next
            // axis (`view(batch * heads, -1, head)` exported at batch 1 as `[2, -1, 8]`).
            if let (Some(Dim::Batch(_)), Some(b), Some(Dim::Batch(k))) = (total, ctx.export_batch, input.0.first()) {
                // Where the input's first extent holds more than the batch (`[8N, 8]`,
                // the batch and a sequence merged), only a literal equal to the export
                // batch is read as the batch (`view(batch, -1, heads, head)`), or one equal
                // to the product of the input's leading extents, which then stay merged
                // as they were (PatchTST's `view(batch * channels, -1, heads, head)` of
                // `[3N, 4, 16]`, and `view(batch * channels * heads, -1, head)` of
                // `[3N, 2, 4, 8]`, at batch 1).
                let leading = |v: i64| -> Option<Dim> {
                    let mut p = Dim::Fixed(1);
                    input.0.iter().find_map(|&d| {
                        p = p.mul(d)?;
                        (p.eval(b) == v).then_some(p)
                    })
                };
                // (A -1 that reading would leave at the export batch stands for the batch
                // itself, as in a sequence-first `view(seq, -1, width)`: the literal is
                // then the rows.)
                let hole_of = |lead: Dim| total.and_then(|t| t.div_exact(product(&dims.iter().enumerate().map(|(i, &d)| if i == hole { Dim::Fixed(1) } else if i == 0 { lead } else { d }).collect::<Vec<_>>(), ctx).ok()?));
                // The batch is the outermost factor of `k*N`: a literal of the batch times a
                // divisor of `k` holds it with some of the factors inside it (ViTDet's
                // `view(windows, heads, h, w, -1)` of `[8N, 4, 8]`, windows and heads
                // merged, written `[4, 2, 2, 2, -1]` at batch 1).
                let as_batch = |v: i64| -> Option<Dim> {
                    match *k {
                        1 if v % b == 0 => Some(Dim::Batch(v / b)),
                        _ if v == b => Some(Dim::N),
                        _ => Some(Dim::Batch(v / b))
                            .filter(|_| v % b == 0 && k % (v / b) == 0)
                            .or_else(|| leading(v))
                            .filter(|d| d.is_batch() && hole_of(*d) != Some(Dim::Fixed(b))),
                    }
                };
                if let Some(d) = dims[0].fixed().filter(|&v| hole != 0 && b > 0 && v > 0 && !dims.iter().any(|d| d.is_batch())).and_then(as_batch) {
                    dims[0] = d;
                }
            }
            if let Some(axis) = batch_kept_in_place(input, &dims, hole, ctx.export_batch) {
                dims[axis] = Dim::N;
            }
            let known_product = product(&dims.iter().enumerate().map(|(i, &d)| if i == hole { Dim::Fixed(1) } else { d }).collect::<Vec<_>>(), ctx)?;
            dims[hole] = match total.and_then(|t| t.div_exact(known_product)) {
                Some(d) => d,
                None => {
                    let (t, k) = (input.numel(n), known_product.eval(n));
                    if k == 0 || t % k != 0 {
                        return Err(match (total, known_product) {
                            (Some(Dim::Batch(rows)), Dim::Fixed(p)) if p > 0 => split_batch_error(input, target, rows, p),
                            _ => format!("cannot reshape {input} to {}", fmt_target(target)),
                        });
                    }
                    Dim::Fixed(t / k)
                }
            };
        }
        None => {
            if input.numel(n) != known_product.eval(n) {
                return Err(format!("cannot reshape {input} ({} elements) to {}", input.numel(n), fmt_target(target)));
            }
            // A target written for the export batch: find where the batch went.
            if let (Some(Dim::Batch(k)), Some(b)) = (total, ctx.export_batch) {
                if !dims.iter().any(|d| d.is_batch()) {
                    symbolize_batch(&mut dims, input, k, b);
                }
            }
        }
    }
    Ok(Shape(dims))
}

/// Rewrites one fixed extent of `dims` as a batch multiple so the element count is `k*N`.
fn symbolize_batch(dims: &mut [Dim], input: &Shape, k: i64, b: i64) {
    // Saturating: a heuristic over declared extents, which may be absurd.
    let total: i64 = dims.iter().map(|d| d.fixed().unwrap_or(1)).fold(1, i64::saturating_mul);
    // Where the batch sits in the input's row-major layout: it is the outermost factor of
    // its axis, so the target extent that starts at the same element offset holds it (an
    // export at batch 1, where every 1 looks alike, keeps its batch in place this way).
    if let Some(a) = input.0.iter().position(|d| d.is_batch()) {
        let before: Option<i64> = input.0[..a].iter().try_fold(1i64, |p, d| d.fixed().map(|v| p.saturating_mul(v)));
        let mut prefix = 1i64;
        for i in 0..dims.len() {
            let Some(v) = dims[i].fixed() else { break };
            if Some(prefix) == before && b > 0 && v % b == 0 && total / v * (v / b) == k {
                dims[i] = Dim::Batch(v / b);
                return;
            }
            prefix = prefix.saturating_mul(v);
        }
    }
    // Prefer an extent equal to the export batch, then any multiple of it (batch folded
    // into a larger extent); leading positions first, as exporters keep batch leading.
    let rest_ok = |i: usize, mult: i64| dims[i].fixed().is_some_and(|v| v == mult * b && total / v * mult == k);
    if let Some(i) = (0..dims.len()).find(|&i| rest_ok(i, 1)) {
        dims[i] = Dim::Batch(1);
        return;
    }
    for i in 0..dims.len() {
        if let Some(v) = dims[i].fixed() {
            if b > 0 && v % b == 0 && total / v * (v / b) == k {
                dims[i] = Dim::Batch(v / b);
                return;
            }
        }
    }
}

fn fmt_target(t: &[Dim]) -> String {
    format!("[{}]", t.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
}

/// Where a Reshape beside a -1 keeps the input's batch axis in place: the input's first
/// batch axis `[.., N, ..]` is not its first, the target repeats the extents before it and
/// has the export batch `b` at its position (MLCD's sequence-first `view(seq, batch, -1)`
/// of `[seq, N, heads, head]`, written `[17, 1, -1]` at batch 1). Read otherwise the -1
/// would take the batch and merge it into the features.
fn batch_kept_in_place(input: &Shape, dims: &[Dim], hole: usize, b: Option<i64>) -> Option<usize> {
    let axis = input.0.iter().position(|d| d.is_batch()).filter(|&a| a > 0)?;
    let kept = input.0[axis] == Dim::N && hole > axis && dims.get(axis) == Some(&Dim::Fixed(b?)) && !dims.iter().any(|d| d.is_batch());
    (kept && dims[..axis] == input.0[..axis]).then_some(axis)
}

/// A Reshape of `rows * N` elements whose fixed extents `p` do not divide them: the batch
/// axis would be cut into groups of rows. That is an export whose batch axis holds several
/// rows per sample (MusicGen's `[batch * codebooks, seq]` input reshaped to `[-1,
/// codebooks, seq]`), which pipewright cannot cut into microbatches of whole samples.
fn split_batch_error(input: &Shape, target: &[Dim], rows: i64, p: i64) -> String {
    let group = p / gcd(p, rows);
    format!(
        "cannot reshape {input} to {}: it would cut the batch axis N into groups of {group} rows, so N must hold {group} rows per sample; \
         pipewright's batch axis holds whole samples: export the model with those {group} rows on an axis of their own (its inputs' leading axis the sample)",
        fmt_target(target)
    )
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

/// The loss of NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss: per target element
/// (`reduction = none`, the targets' shape) or a scalar. The targets are the input's shape
/// without its class axis 1.
fn class_loss(input: &TensorType, target: &TensorType, l: &ClassLoss, ctx: Ctx) -> R<TensorType> {
    let dims = input.shape.dims();
    if dims.len() < 2 {
        return Err(format!("the input {} has no class axis (it needs [N, C, ...])", input.shape));
    }
    if !input.dtype.is_float() {
        return Err(format!("the input must be floating point, got {}", input.dtype));
    }
    if target.dtype.is_float() || target.dtype == DType::Bool {
        return Err(format!("the targets must be integer class ids, got {}", target.dtype));
    }
    let expected: Vec<Dim> = dims.iter().enumerate().filter(|&(i, _)| i != 1).map(|(_, d)| *d).collect();
    let agree = target.shape.rank() == expected.len() && target.shape.dims().iter().zip(&expected).all(|(&t, &e)| dims_agree(t, e, ctx));
    if !agree {
        return Err(format!("targets {} do not match the input {} without its class axis", target.shape, input.shape));
    }
    let shape = if l.reduction == LossReduction::None { Shape(expected) } else { Shape::scalar() };
    Ok(TensorType::new(input.dtype, shape))
}

/// One of Attention's Q, K, V as `[batch, heads, seq, head_size]`: 4-D inputs are that
/// already, 3-D ones `[batch, seq, heads * head_size]` with `heads` from the attribute.
fn attention_heads(t: &TensorType, heads: Option<i64>, name: &str) -> R<[Dim; 4]> {
    match (&t.shape.0[..], heads) {
        ([b, h, s, d], _) => Ok([*b, *h, *s, *d]),
        ([b, s, hidden], Some(h)) => {
            let d = hidden.div_exact(Dim::Fixed(h)).ok_or_else(|| format!("{name} hidden size {hidden} is not a multiple of {h} heads"))?;
            Ok([*b, Dim::Fixed(h), *s, d])
        }
        ([_, _, _], None) => Err("3-D inputs need q_num_heads and kv_num_heads".into()),
        _ => Err(format!("{name} must be 3-D or 4-D, got {}", t.shape)),
    }
}

/// Attention's outputs: Y, present_key, present_value (the cache with the new keys and
/// values appended) and the attention scores `[batch, q_heads, q_seq, total_seq]`.
fn attention(at: &Attention, ins: &[Option<In>]) -> R<Vec<TensorType>> {
    let get = |i: usize, name: &str| ins.get(i).copied().flatten().ok_or_else(|| format!("input {name} is required"));
    let (q, k, v) = (&get(0, "Q")?.ty, &get(1, "K")?.ty, &get(2, "V")?.ty);
    let rank = q.shape.rank();
    if k.shape.rank() != rank || v.shape.rank() != rank {
        return Err(format!("Q, K and V differ in rank: {}, {}, {}", q.shape, k.shape, v.shape));
    }
    let [b, qh, qs, qd] = attention_heads(q, at.q_num_heads, "Q")?;
    let [_, kh, ks, kd] = attention_heads(k, at.kv_num_heads, "K")?;
    let [_, vh, vs, vd] = attention_heads(v, at.kv_num_heads, "V")?;
    let fixed_differ = |a: Dim, c: Dim| matches!((a, c), (Dim::Fixed(x), Dim::Fixed(y)) if x != y);
    if fixed_differ(qd, kd) || fixed_differ(kh, vh) || fixed_differ(ks, vs) {
        return Err(format!("Q, K and V do not match: {}, {}, {}", q.shape, k.shape, v.shape));
    }
    if let (Dim::Fixed(a), Dim::Fixed(c)) = (qh, kh) {
        if c == 0 || a % c != 0 {
            return Err(format!("{a} query heads are not a multiple of {c} key/value heads"));
        }
    }
    let past = match (ins.get(4).copied().flatten(), ins.get(5).copied().flatten()) {
        (Some(pk), Some(_)) => *pk.ty.shape.0.get(2).ok_or("past_key must be 4-D")?,
        (None, None) => Dim::Fixed(0),
        _ => return Err("past_key and past_value must be given together".into()),
    };
    let total = past.add(ks).ok_or_else(|| format!("past length {past} plus key length {ks} is not a batch multiple"))?;
    let y = if rank == 4 {
        Shape(vec![b, qh, qs, vd])
    } else {
        Shape(vec![b, qs, qh.mul(vd).ok_or("the output hidden size is not known")?])
    };
    Ok(vec![
        TensorType::new(q.dtype, y),
        TensorType::new(k.dtype, Shape(vec![b, kh, total, kd])),
        TensorType::new(v.dtype, Shape(vec![b, kh, total, vd])),
        TensorType::new(q.dtype, Shape(vec![b, qh, qs, total])),
    ])
}

/// QuantizeLinear's output type: the zero point's, else `output_dtype`, else u8.
fn quantize_dtype(q: &Quantize, x: In, scale: In, zp: Option<In>) -> R<DType> {
    if !x.ty.dtype.is_float() || !scale.ty.dtype.is_float() {
        return Err(format!("x ({}) and y_scale ({}) must be floats", x.ty.dtype, scale.ty.dtype));
    }
    let to = match (zp.map(|z| z.ty.dtype), q.output_dtype) {
        (Some(z), Some(o)) if z != o => return Err(format!("output_dtype {o} differs from the zero point's type {z}")),
        (Some(z), _) => z,
        (None, Some(o)) => o,
        (None, None) => DType::U8,
    };
    if !to.is_quantized() || to == DType::I32 {
        return Err(format!("{to} is not a quantized type"));
    }
    Ok(to)
}

/// Checks the scale and the zero point against x: each one element (per tensor), a
/// vector of x's extent at `axis` (per axis), or, with a block size, x's shape with the
/// axis divided into blocks (rounded up).
fn quant_params(x: In, scale: In, zp: Option<In>, axis: i64, block_size: i64, ctx: Ctx) -> R<()> {
    quant_param(x, scale, "scale", axis, block_size, ctx)?;
    zp.map_or(Ok(()), |z| quant_param(x, z, "zero point", axis, block_size, ctx))
}

fn quant_param(x: In, p: In, what: &str, axis: i64, block_size: i64, ctx: Ctx) -> R<()> {
    let xs = &x.ty.shape;
    let ps = &p.ty.shape;
    if block_size == 0 && ps.rank() <= 1 && ps.0.iter().all(|&d| d == Dim::Fixed(1)) {
        return Ok(());
    }
    let a = normalize_axis(axis, xs.rank()).ok_or_else(|| format!("axis {axis} out of range for {xs}"))?;
    if block_size == 0 {
        return match ps.0[..] {
            [n] if dims_agree(n, xs.0[a], ctx) => Ok(()),
            _ => Err(format!("a per-axis {what} must be [{}] for x {xs} at axis {axis}, got {ps}", xs.0[a])),
        };
    }
    let fits = ps.rank() == xs.rank()
        && xs.0.iter().zip(&ps.0).enumerate().all(|(i, (&d, &s))| match (i == a, d, s) {
            (true, Dim::Fixed(d), Dim::Fixed(s)) => s == (d + block_size - 1) / block_size,
            (true, _, _) => false,
            (false, d, s) => dims_agree(d, s, ctx),
        });
    if !fits {
        return Err(format!("a blocked {what} must be x {xs} with axis {axis} divided into blocks of {block_size}, got {ps}"));
    }
    Ok(())
}

/// LinearAttention's outputs: `[batch, seq, q_heads * d_v]` and the state
/// `[batch, kv_heads, d_k, d_v]` (of past_state's type when given).
fn linear_attention(la: &LinearAttention, ins: &[Option<In>]) -> R<Vec<TensorType>> {
    let get = |i: usize| ins.get(i).copied().flatten();
    let (Some(q), Some(k), Some(v)) = (get(0), get(1), get(2)) else { return Err("query, key and value are required".into()) };
    let (q, k, v) = (&q.ty, &k.ty, &v.ty);
    let per_head = |t: &TensorType, heads: i64, name: &str| -> R<i64> {
        match &t.shape.0[..] {
            [_, _, Dim::Fixed(hd)] if hd % heads == 0 => Ok(hd / heads),
            _ => Err(format!("{name} {} must be [batch, seq, {heads} heads * head size] with a fixed last axis", t.shape)),
        }
    };
    let d_k = per_head(q, la.q_num_heads, "query")?;
    let d_v = per_head(v, la.kv_num_heads, "value")?;
    if per_head(k, la.kv_num_heads, "key")? != d_k {
        return Err(format!("key {} and query {} differ in head size", k.shape, q.shape));
    }
    let rule = la.update_rule;
    if rule.gated() != get(4).is_some() || rule.delta() != get(5).is_some() {
        return Err(format!("update_rule {:?} needs {} decay and {} beta", rule.as_str(), if rule.gated() { "a" } else { "no" }, if rule.delta() { "a" } else { "no" }));
    }
    let kv = la.kv_num_heads;
    if let Some(d) = get(4) {
        match d.ty.shape.0.last().and_then(|d| d.fixed()) {
            Some(n) if d.ty.shape.rank() == 3 && (n == kv || n == kv * d_k) => {}
            _ => return Err(format!("decay {} must be [batch, seq, {kv}] or [batch, seq, {}]", d.ty.shape, kv * d_k)),
        }
    }
    if let Some(b) = get(5) {
        match b.ty.shape.0.last().and_then(|d| d.fixed()) {
            Some(n) if b.ty.shape.rank() == 3 && (n == kv || n == 1) => {}
            _ => return Err(format!("beta {} must be [batch, seq, {kv}] or [batch, seq, 1]", b.ty.shape)),
        }
    }
    let (b, s) = (q.shape.0[0], q.shape.0[1]);
    let state = Shape(vec![b, Dim::Fixed(kv), Dim::Fixed(d_k), Dim::Fixed(d_v)]);
    if let Some(p) = get(3) {
        if p.ty.shape.rank() != 4 || p.ty.shape.0[1..] != state.0[1..] {
            return Err(format!("past_state {} must be {state}", p.ty.shape));
        }
    }
    let state_dtype = get(3).map_or(q.dtype, |p| p.ty.dtype);
    Ok(vec![
        TensorType::new(q.dtype, Shape(vec![b, s, Dim::Fixed(la.q_num_heads * d_v)])),
        TensorType::new(state_dtype, state),
    ])
}

/// An optimizer step's outputs: the new tensors `X` (input block 0) and each state
/// (input blocks 2..), in blocks of `n`; `R` and `T` must be scalars.
fn optimizer(o: &OptimizerStep, ins: &[Option<In>], n_out: usize) -> R<Vec<TensorType>> {
    let blocks = 2 + o.states();
    let n = ins.len().saturating_sub(2) / blocks;
    if n == 0 || ins.len() != 2 + blocks * n || n_out > (1 + o.states()) * n {
        return Err(format!("takes R, T and {blocks} blocks of equally many tensors, gives at most {} blocks; got {} inputs, {n_out} outputs", 1 + o.states(), ins.len()));
    }
    for (i, name) in [(0, "R"), (1, "T")] {
        let t = ins[i].ok_or_else(|| format!("input {name} is required"))?;
        if t.ty.shape.rank() > 1 || t.ty.shape.0.iter().any(|d| d.fixed() != Some(1)) {
            return Err(format!("{name} must be a scalar, got {}", t.ty.shape));
        }
    }
    let mut outs = Vec::with_capacity(n_out);
    for j in 0..n_out {
        let (block, i) = (j / n, j % n);
        let input = 2 + if block == 0 { 0 } else { block + 1 } * n + i;
        let t = ins[input].ok_or_else(|| format!("input {input} is required"))?;
        if ins[2 + i].is_some_and(|x| x.ty.shape != t.ty.shape) {
            return Err(format!("input {input} {} differs from its tensor's shape", t.ty.shape));
        }
        outs.push(t.ty.clone());
    }
    Ok(outs)
}

/// ArrayFeatureExtractor: the data's leading axes (1-D data: `[1]`) and the number of
/// indices.
fn array_feature_extractor(x: In, idx: In) -> R<Vec<TensorType>> {
    let n = idx.ty.shape.0.iter().try_fold(1i64, |a, d| d.fixed().map(|v| a * v)).ok_or("the indices need a fixed shape")?;
    let xs = &x.ty.shape.0;
    if xs.is_empty() {
        return Err("the data must have at least one axis".into());
    }
    let mut dims = if xs.len() == 1 { vec![Dim::Fixed(1)] } else { xs[..xs.len() - 1].to_vec() };
    dims.push(Dim::Fixed(n));
    Ok(vec![TensorType::new(x.ty.dtype, Shape(dims))])
}

/// CausalConvWithState's outputs: the input's type, and the carry `[batch, channels, k - 1]`.
fn causal_conv_with_state(ins: &[Option<In>]) -> R<Vec<TensorType>> {
    let get = |i: usize| ins.get(i).copied().flatten();
    let (Some(x), Some(w)) = (get(0), get(1)) else { return Err("input and weight are required".into()) };
    let (x, w) = (&x.ty, &w.ty);
    let (xs, ws) = (&x.shape.0, &w.shape.0);
    let k = match (&xs[..], &ws[..]) {
        ([_, c, _], [wc, Dim::Fixed(1), Dim::Fixed(k)]) if *k >= 1 && dims_equal_or_unknown(*c, *wc) => *k,
        _ => return Err(format!("input {} must be [batch, channels, length] and weight {} [channels, 1, k]", x.shape, w.shape)),
    };
    let carry = Shape(vec![xs[0], xs[1], Dim::Fixed(k - 1)]);
    if let Some(p) = get(3) {
        if p.ty.shape.rank() != 3 || p.ty.shape.0[1..] != carry.0[1..] {
            return Err(format!("past_state {} must be {carry}", p.ty.shape));
        }
    }
    Ok(vec![(*x).clone(), TensorType::new(x.dtype, carry)])
}

fn dims_equal_or_unknown(a: Dim, b: Dim) -> bool {
    a == b || a.fixed().is_none() || b.fixed().is_none()
}

/// An op that keeps its input's type and works along `axis`; with `coerce_2d` (before
/// opset 13) the input is split into a 2-D view at the axis, so the rank is valid too.
fn axis_op(x: In, axis: i64, coerce_2d: bool) -> R<Vec<TensorType>> {
    let t = &x.ty;
    let r = t.shape.rank() as i64;
    let hi = if coerce_2d { r } else { r - 1 };
    if !(-r..=hi).contains(&axis) {
        return Err(format!("axis {axis} out of range for {}", t.shape));
    }
    Ok(vec![(*t).clone()])
}

/// RNN/GRU/LSTM outputs: `Y` `[T, D, B, H]` and the final states `[D, B, H]` (one for
/// RNN/GRU, hidden and cell for LSTM); batch-major (`layout = 1`): `[B, T, D, H]`, `[B, D, H]`.
fn rnn(r: &Rnn, x: In, w: In, rec: In, ctx: Ctx) -> R<Vec<TensorType>> {
    let (xs, ws, rs) = (&x.ty.shape, &w.ty.shape, &rec.ty.shape);
    // Checked: hidden_size 2^62 overflowed `gates * hidden_size` (found by pipewright-fuzz
    // in a debug build, fuzz/crashes/onnx-62712179e91b4069.bin).
    let gh = r.gates().checked_mul(r.hidden_size).filter(|_| r.hidden_size > 0).ok_or_else(|| format!("hidden_size {} is out of range", r.hidden_size))?;
    let (d, h) = (r.directions(), r.hidden_size);
    if xs.rank() != 3 || ws.rank() != 3 || rs.rank() != 3 {
        return Err(format!("X {xs}, W {ws} and R {rs} must be 3-D"));
    }
    // Weights of one direction exported at batch 1 may carry the batch symbol on axis 0.
    let fits = |s: &Shape, want: [Dim; 3]| s.0.iter().zip(want).all(|(&a, b)| dims_agree(a, b, ctx));
    let (dd, gg) = (Dim::Fixed(d), Dim::Fixed(gh));
    if !fits(ws, [dd, gg, xs.0[2]]) || !fits(rs, [dd, gg, Dim::Fixed(h)]) {
        return Err(format!("W {ws} and R {rs} must be [{d}, {gh}, input] and [{d}, {gh}, {h}] for X {xs}"));
    }
    let (t, b) = if r.batch_major { (xs.0[1], xs.0[0]) } else { (xs.0[0], xs.0[1]) };
    if t.is_batch() && !b.is_batch() {
        // Training at another batch size would then lengthen the sequence instead.
        return Err(format!(
            "X {xs} {} ({} = {}): the model's inputs are sequence-major, so the \
             batch cannot be resized; import it with --batch fixed to run it at its exported shapes",
            crate::error::SEQUENCE_MAJOR,
            if r.batch_major { "layout 1, axis 1" } else { "layout 0, axis 0" },
            t
        ));
    }
    let (d, h) = (Dim::Fixed(d), Dim::Fixed(h));
    let (y, state) = if r.batch_major { (vec![b, t, d, h], vec![b, d, h]) } else { (vec![t, d, b, h], vec![d, b, h]) };
    let n_states = if r.cell == RnnCell::Lstm { 2 } else { 1 };
    let mut outs = vec![TensorType::new(x.ty.dtype, Shape(y))];
    outs.extend(std::iter::repeat_n(TensorType::new(x.ty.dtype, Shape(state)), n_states));
    Ok(outs)
}

/// TopK's values and indices: the input's shape with extent `k` (input 1) at the axis.
/// `k` may follow the batch size: a sort of a whole axis that does (`torch.sort`, as the
/// exporters write it, takes `k` from the axis's own extent: mixture-of-experts routers).
fn top_k(x: In, k: In, axis: i64) -> R<Vec<TensorType>> {
    let t = &x.ty;
    let a = t.shape.axis(axis).ok_or(format!("axis {axis} out of range for {}", t.shape))?;
    let k = match known_dims(k, "k")?.as_slice() {
        [k] => *k,
        v => return Err(format!("k must be one value, got {}", v.len())),
    };
    let fits = match (k, t.shape.0[a]) {
        (Dim::Fixed(k), Dim::Fixed(n)) => (0..=n).contains(&k),
        (Dim::Fixed(k), Dim::Batch(_)) => k >= 0,
        (Dim::Batch(k), Dim::Batch(n)) => k <= n,
        (Dim::Batch(_), Dim::Fixed(_)) => false,
    };
    if !fits {
        return Err(format!("k = {k} does not fit axis {a} of {}", t.shape));
    }
    let mut d = t.shape.0.clone();
    d[a] = k;
    Ok(vec![TensorType::new(t.dtype, Shape(d.clone())), TensorType::new(DType::I64, Shape(d))])
}

/// OneHot's output: the indices' shape with `depth` (input 1) inserted at `axis`, of the
/// values' element type.
fn one_hot(idx: In, depth: In, values: In, axis: i64) -> R<Vec<TensorType>> {
    let depth = match depth.known.and_then(|k| k.floats()).as_deref() {
        Some([d]) => *d as i64,
        Some(v) => return Err(format!("depth must be one value, got {}", v.len())),
        None => return Err("depth input is not known at import (it sets the output shape)".into()),
    };
    if depth < 1 {
        return Err(format!("depth {depth} must be positive"));
    }
    let mut d = idx.ty.shape.0.clone();
    let r = d.len() as i64 + 1;
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..r).contains(&a) {
        return Err(format!("axis {axis} out of range for output rank {r}"));
    }
    d.insert(a as usize, Dim::Fixed(depth));
    Ok(vec![TensorType::new(values.ty.dtype, Shape(d))])
}

/// GatherND's output: the indices' shape without its last axis (the index tuple length
/// `k`), then the data's axes after the batch axes and the `k` indexed ones.
fn gather_nd(data: &TensorType, idx: &TensorType, batch_dims: i64) -> R<Vec<TensorType>> {
    let (d, i) = (&data.shape.0, &idx.shape.0);
    let b = usize::try_from(batch_dims).map_err(|_| format!("batch_dims {batch_dims} is negative"))?;
    let k = match i.last() {
        Some(Dim::Fixed(k)) => usize::try_from(*k).map_err(|_| format!("index tuple length {k} is negative"))?,
        Some(other) => return Err(format!("the index tuple length (the indices' last axis) must be known, not {other}")),
        None => return Err("the indices are a scalar".into()),
    };
    if b >= i.len() || b + k > d.len() {
        return Err(format!("indices {} do not fit data {} with batch_dims {b}", idx.shape, data.shape));
    }
    let out: Vec<Dim> = i[..i.len() - 1].iter().chain(&d[b + k..]).cloned().collect();
    Ok(vec![TensorType::new(data.dtype, Shape(out))])
}

/// Col2Im's output `[N, C, image...]` from `[N, C * prod(block), L]`, where `L` must be the
/// number of block positions in the padded image.
fn col2im(x: &TensorType, image: In, block: In, [dil, pads, strides]: [&Vec<i64>; 3]) -> R<Vec<TensorType>> {
    let known = |i: In, what: &str| i.known.and_then(|k| k.fixed_ints()).ok_or(format!("{what} is not known at import"));
    let (image, block) = (known(image, "image_shape")?, known(block, "block_shape")?);
    let n = image.len();
    let or = |v: &Vec<i64>, len: usize, d: i64| if v.is_empty() { Ok(vec![d; len]) } else if v.len() == len { Ok(v.clone()) } else { Err(format!("{} values where {len} are needed", v.len())) };
    let (dil, pads, strides) = (or(dil, n, 1)?, or(pads, 2 * n, 0)?, or(strides, n, 1)?);
    let d = &x.shape.0;
    let (Some(ck), Some(l)) = (d.get(1).and_then(|v| v.fixed()), d.get(2).and_then(|v| v.fixed())) else {
        return Err(format!("input {} is not [N, C * prod(block), L] with fixed C and L", x.shape));
    };
    // An overflowing block product is refused below (k = 0).
    let k: i64 = block.iter().try_fold(1i64, |p, &b| p.checked_mul(b)).unwrap_or(0);
    if d.len() != 3 || block.len() != n || n == 0 || k <= 0 || ck % k != 0 || dil.iter().chain(&strides).any(|&v| v <= 0) {
        return Err(format!("input {} does not fit blocks {block:?} of image {image:?}", x.shape));
    }
    let mut blocks = 1i64;
    for i in 0..n {
        let span = dil[i].checked_mul(block[i] - 1).ok_or("block span overflows")?;
        blocks = blocks.saturating_mul((image[i] + pads[i] + pads[n + i] - span - 1).div_euclid(strides[i]) + 1);
    }
    if blocks != l {
        return Err(format!("{l} blocks given, the padded image holds {blocks}"));
    }
    let out: Vec<Dim> = [d[0].clone(), Dim::Fixed(ck / k)].into_iter().chain(image.iter().map(|&v| Dim::Fixed(v))).collect();
    Ok(vec![TensorType::new(x.dtype, Shape(out))])
}

/// AffineGrid's output `[N, spatial..., d]` for `theta` `[N, d, d + 1]` (d = 2 or 3) and
/// `size` `[N, C, spatial...]` (its batch entry is theta's).
fn affine_grid(theta: &TensorType, size: In) -> R<Vec<TensorType>> {
    let t = &theta.shape.0;
    let size = size.known.ok_or("size is not known at import")?.fixed_ints().ok_or("size must be fixed")?;
    let d = match t.as_slice() {
        [_, Dim::Fixed(2), Dim::Fixed(3)] => 2,
        [_, Dim::Fixed(3), Dim::Fixed(4)] => 3,
        _ => return Err(format!("theta {} is not [N, 2, 3] or [N, 3, 4]", theta.shape)),
    };
    if size.len() != d + 2 || size.iter().any(|&v| v < 0) {
        return Err(format!("size {size:?} does not fit a {d}-D theta"));
    }
    let out: Vec<Dim> = std::iter::once(t[0].clone()).chain(size[2..].iter().map(|&v| Dim::Fixed(v))).chain([Dim::Fixed(d as i64)]).collect();
    Ok(vec![TensorType::new(theta.dtype, Shape(out))])
}

/// GridSample's output `[N, C, grid spatial extents]`: a 4-D or 5-D float input, the grid
/// `[N, spatial..., rank - 2]`.
fn grid_sample(x: &TensorType, grid: &TensorType, mode: ResizeMode) -> R<Vec<TensorType>> {
    let (d, g) = (&x.shape.0, &grid.shape.0);
    if !(4..=5).contains(&d.len()) || (mode == ResizeMode::Cubic && d.len() != 4) {
        return Err(format!("{} sampling of a {}-D input is not supported (4-D, or 5-D without cubic)", mode.name(), d.len()));
    }
    if !x.dtype.is_float() || !grid.dtype.is_float() {
        return Err(format!("input {} and grid {} must be floats", x.dtype, grid.dtype));
    }
    if g.len() != d.len() || g.last() != Some(&Dim::Fixed(d.len() as i64 - 2)) || g[0] != d[0] {
        return Err(format!("grid {} does not fit input {}", grid.shape, x.shape));
    }
    let out: Vec<Dim> = d[..2].iter().chain(&g[1..g.len() - 1]).cloned().collect();
    Ok(vec![TensorType::new(x.dtype, Shape(out))])
}

/// DepthToSpace (`to_space`) and SpaceToDepth on `[N, C, H, W]`: channels divided by
/// `b * b` and both spatial extents multiplied by `b`, or the reverse.
fn block_move(t: &TensorType, b: i64, to_space: bool) -> R<Vec<TensorType>> {
    let d = &t.shape.0;
    let fixed = |i: usize| d[i].fixed().ok_or(format!("axis {i} of {} must have a fixed extent", t.shape));
    if d.len() != 4 {
        return Err(format!("the input {} is not 4-D", t.shape));
    }
    let (c, h, w) = (fixed(1)?, fixed(2)?, fixed(3)?);
    let bb = b.checked_mul(b).ok_or("blocksize overflows")?;
    let out = if to_space {
        if c % bb != 0 {
            return Err(format!("{c} channels are not a multiple of blocksize^2 = {bb}"));
        }
        [c / bb, h.checked_mul(b).ok_or("extent overflows")?, w.checked_mul(b).ok_or("extent overflows")?]
    } else {
        if h % b != 0 || w % b != 0 {
            return Err(format!("spatial extents {h}x{w} are not multiples of blocksize {b}"));
        }
        [c.checked_mul(bb).ok_or("extent overflows")?, h / b, w / b]
    };
    let shape = std::iter::once(d[0].clone()).chain(out.iter().map(|&v| Dim::Fixed(v))).collect();
    Ok(vec![TensorType::new(t.dtype, Shape(shape))])
}

/// A Resize input that fixes the output shape (roi, scales, sizes): `None` when omitted
/// or empty, an error when its values are not known at import.
fn resize_param<'a>(ins: &[Option<In<'a>>], i: usize) -> R<Option<&'a Known>> {
    match ins.get(i).copied().flatten() {
        None => Ok(None),
        Some(In { known: Some(k), .. }) => Ok((!k.is_empty()).then_some(k)),
        Some(_) => Err(format!("input {i} (roi, scales or sizes) is not known at import; the output shape depends on it")),
    }
}

/// Resize's output: each resized axis becomes its `sizes` entry or `floor(extent *
/// scale)`; a `keep_aspect_ratio_policy` other than stretch scales all `axes` by one
/// factor, the smallest (not_larger) or largest (not_smaller) of `size / extent`.
fn resize(r: &Resize, ins: &[Option<In>]) -> R<Vec<TensorType>> {
    let t = &ins.first().copied().flatten().ok_or("input 0 is required")?.ty;
    if r.mode != ResizeMode::Nearest && !t.dtype.is_float() {
        return Err(format!("{} interpolation of {} elements is not supported", r.mode.name(), t.dtype));
    }
    let rank = t.shape.rank();
    let axes: Vec<usize> = match &r.axes {
        Some(a) => a.iter().map(|&a| normalize_axis(a, rank).ok_or(format!("axis {a} out of range for rank {rank}"))).collect::<R<_>>()?,
        None => (0..rank).collect(),
    };
    if (1..axes.len()).any(|i| axes[..i].contains(&axes[i])) {
        return Err(format!("axes {:?} repeat an axis", r.axes));
    }
    let (scales, sizes) = if r.legacy { (resize_param(ins, 1)?, None) } else { (resize_param(ins, 2)?, resize_param(ins, 3)?) };
    if r.coord == CoordMode::TfCropAndResize && resize_param(ins, 1)?.is_none_or(|roi| roi.len() != 2 * axes.len()) {
        return Err(format!("tf_crop_and_resize needs a roi of {} values", 2 * axes.len()));
    }
    let mut out = t.shape.0.clone();
    let given = match (scales, sizes) {
        (Some(s), None) => s.len(),
        (None, Some(s)) => s.len(),
        (Some(_), Some(_)) => return Err("scales and sizes are both given; only one may be".into()),
        (None, None) => return Err("neither scales nor sizes is given".into()),
    };
    if given != axes.len() {
        return Err(format!("{given} scales or sizes for {} axes", axes.len()));
    }
    if let Some(s) = scales {
        let s = s.floats().ok_or("scales are not plain numbers")?;
        for (&a, &f) in axes.iter().zip(&s) {
            out[a] = match t.shape.0[a] {
                _ if !(f > 0.0 && f.is_finite()) => return Err(format!("scale {f} is not positive")),
                Dim::Fixed(n) => Dim::Fixed((f * n as f64).floor() as i64),
                d if f == 1.0 => d,
                d => return Err(format!("scaling axis {a} of extent {d} (the batch) is not supported")),
            };
        }
    } else if let Some(s) = sizes {
        let dims = s.dims();
        if r.aspect == AspectPolicy::Stretch {
            for (&a, d) in axes.iter().zip(dims) {
                out[a] = d;
            }
        } else {
            let fixed = |d: &Dim| d.fixed().ok_or(format!("keep_aspect_ratio_policy needs fixed extents, not {d}"));
            let ratios = axes.iter().zip(&dims).map(|(&a, d)| Ok(fixed(d)? as f64 / fixed(&t.shape.0[a])? as f64)).collect::<R<Vec<f64>>>()?;
            let pick = if r.aspect == AspectPolicy::NotLarger { f64::min } else { f64::max };
            let f = ratios.iter().copied().reduce(pick).unwrap_or(1.0);
            for &a in &axes {
                out[a] = Dim::Fixed((f * fixed(&t.shape.0[a])? as f64 + 0.5).floor() as i64);
            }
        }
    }
    Ok(vec![TensorType::new(t.dtype, Shape(out))])
}

fn split(s: &Split, x: In, sizes: Option<In>, n_out: usize, ctx: Ctx) -> R<Vec<TensorType>> {
    let t = &x.ty;
    let a = t.shape.axis(s.axis).ok_or(format!("axis {} out of range for {}", s.axis, t.shape))?;
    let extent = t.shape.0[a];
    let parts: Vec<Dim> = match (&s.split, sizes) {
        (Some(v), _) => v.iter().map(|&x| Dim::Fixed(x)).collect(),
        // Sizes computed from the batch (row groups of it) are extents like any other.
        (None, Some(i)) => known_dims(i, "split")?,
        (None, None) => {
            // `num_outputs` must be the node's output count: it sizes a Vec, and a
            // crafted 2^31 made the importer ask for 32 GiB (found by pipewright-fuzz,
            // fuzz/crashes/onnx-5a83703e471492ca.bin).
            let n = s.num_outputs.unwrap_or(n_out as i64);
            if n < 1 || n != n_out as i64 {
                return Err(format!("num_outputs {n} does not match the node's {n_out} outputs"));
            }
            match extent.div_exact(Dim::Fixed(n)) {
                Some(d) => vec![d; n as usize],
                None => {
                    let e = extent.eval(batch(ctx));
                    let chunk = (e + n - 1) / n;
                    (0..n).map(|i| Dim::Fixed(chunk.min(e - i * chunk).max(0))).collect()
                }
            }
        }
    };
    let total = parts.iter().try_fold(Dim::Fixed(0), |acc, &d| acc.add(d));
    if !total.is_some_and(|t| dims_agree(t, extent, ctx)) {
        let sum: i64 = parts.iter().map(|d| d.eval(batch(ctx))).sum();
        if sum != extent.eval(batch(ctx)) {
            if matches!(extent, Dim::Batch(_)) && parts.iter().all(|d| d.fixed().is_some()) {
                // The TorchScript exporter writes a split along the batch with the sizes
                // of the batch it traced: the model then runs at no other batch size.
                return Err(format!("split sizes {} are constants, but the axis they split follows the batch ({extent}): the exporter fixed them for one batch size (or, tracing, for one input's data: a mixture-of-experts router's counts per expert), and ONNX requires them to add up to the axis, so the model runs at no other; export the model at a fixed batch size, or, where the sizes come from the data, with PyTorch's default exporter (torch.onnx.export(..., dynamo=True)), which computes them", fmt_target(&parts)));
            }
            return Err(format!("split sizes {} do not add up to extent {extent}", fmt_target(&parts)));
        }
    }
    Ok(parts
        .into_iter()
        .map(|p| {
            let mut d = t.shape.0.clone();
            d[a] = p;
            TensorType::new(t.dtype, Shape(d))
        })
        .collect())
}

/// The first index and the exclusive end of a Slice over an axis of extent `n` after
/// the ONNX clamping rules, or `None` for step 0 (or an empty axis with a negative step).
fn slice_bounds(n: i64, start: i64, end: i64, step: i64) -> Option<(i64, i64)> {
    let fix = |v: i64| if v < 0 { v.saturating_add(n) } else { v };
    let (s, e) = (fix(start), fix(end));
    match step {
        0 => None,
        // Positive steps: start and end are clamped to [0, n].
        1.. => Some((s.clamp(0, n), e.clamp(0, n))),
        // Negative steps: start is clamped to [0, n-1], end to [-1, n-1].
        _ if n > 0 => Some((s.clamp(0, n - 1), e.clamp(-1, n - 1))),
        _ => Some((0, 0)),
    }
}

/// The number of elements a Slice selects over an axis of extent `n`, without listing them.
pub fn slice_len(n: i64, start: i64, end: i64, step: i64) -> Option<i64> {
    if step == 0 {
        return None;
    }
    let (s, e) = slice_bounds(n, start, end, step)?;
    let span = if step > 0 { e - s } else { s - e };
    Some(if span > 0 { ((span - 1) as u64 / step.unsigned_abs()) as i64 + 1 } else { 0 })
}

/// Indices selected by a Slice over an axis of extent `n` (ONNX clamping rules).
pub fn slice_indices(n: i64, start: i64, end: i64, step: i64) -> Option<Vec<i64>> {
    let len = slice_len(n, start, end, step)?;
    let (s, _) = slice_bounds(n, start, end, step)?;
    Some((0..len).map(|j| s + j * step).collect())
}

fn slice(s: &Slice, ins: &[Option<In>], ctx: Ctx) -> R<Vec<TensorType>> {
    let x = ins.first().copied().flatten().ok_or("input 0 is required")?;
    let t = &x.ty;
    let get = |i: usize, what: &str| -> R<Option<Vec<i64>>> {
        ins.get(i).copied().flatten().map(|k| known_ints(k, what)).transpose()
    };
    // Starts and ends may be multiples of the batch size (`x[:N]`); axes and steps not.
    let bound = |i: usize, what: &str| -> R<Vec<Dim>> { ins.get(i).copied().flatten().map(|k| known_dims(k, what)).transpose()?.ok_or_else(|| format!("{what} is required")) };
    let fixed = |v: &[i64]| v.iter().map(|&x| Dim::Fixed(x)).collect::<Vec<Dim>>();
    let (starts, ends, axes, steps) = match &s.attrs {
        Some((st, en, ax)) => (fixed(st), fixed(en), ax.clone(), None),
        None => (bound(1, "starts")?, bound(2, "ends")?, get(3, "axes")?, get(4, "steps")?),
    };
    let r = t.shape.rank();
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err("starts, ends, axes and steps differ in length".into());
    }
    let mut d = t.shape.0.clone();
    for i in 0..starts.len() {
        let a = normalize_axis(axes[i], r).ok_or(format!("axis {} out of range for {}", axes[i], t.shape))?;
        let (Some(start), Some(end)) = (starts[i].fixed(), ends[i].fixed()) else {
            d[a] = batch_slice(d[a], starts[i], ends[i], steps[i]).ok_or_else(|| format!("slice {}..{} (step {}) of an axis of extent {}: a bound that depends on the batch size is followed only where both bounds are multiples of it (or 0, or the end), the step is 1 and the axis is a multiple of it", starts[i], ends[i], steps[i], d[a]))?;
            continue;
        };
        let whole = start == 0 && steps[i] == 1 && end >= i32::MAX as i64;
        if whole {
            continue;
        }
        let n = d[a].eval(batch(ctx));
        let len = slice_len(n, start, end, steps[i]).ok_or("step 0")?;
        d[a] = if d[a].is_batch() && len == n { d[a] } else { Dim::Fixed(len) };
    }
    Ok(vec![TensorType::new(t.dtype, Shape(d))])
}

/// The extent a Slice of step 1 selects over an axis of `k N` when a bound is a multiple
/// of the batch size `N` (`x[:N]` of `k N` rows, as a model slicing its batch back out of
/// a merged axis writes it): bounds clamped to the axis as multiples of `N`, so the extent
/// is one at every batch size. `None` for anything else (a fixed offset from a multiple of
/// `N`, a negative bound, another step), whose extent no [`Dim`] states.
fn batch_slice(axis: Dim, start: Dim, end: Dim, step: i64) -> Option<Dim> {
    let Dim::Batch(k) = axis else { return None };
    if step != 1 {
        return None;
    }
    let multiple = |b: Dim| match b {
        Dim::Batch(c) => Some(c.min(k)),
        Dim::Fixed(0) => Some(0),
        Dim::Fixed(v) if v >= i32::MAX as i64 => Some(k),
        Dim::Fixed(_) => None,
    };
    let (s, e) = (multiple(start)?, multiple(end)?);
    Some(if e > s { Dim::Batch(e - s) } else { Dim::Fixed(0) })
}

fn reduce_shape(s: &Shape, axes: &[usize], keepdims: bool) -> Shape {
    let mut d = Vec::new();
    for (i, &x) in s.0.iter().enumerate() {
        if axes.contains(&i) {
            if keepdims {
                d.push(Dim::Fixed(1));
            }
        } else {
            d.push(x);
        }
    }
    Shape(d)
}

fn reduce(r: &Reduce, x: In, axes_in: Option<In>) -> R<Vec<TensorType>> {
    let t = &x.ty;
    let axes = match (&r.axes, axes_in) {
        (Some(a), _) => a.clone(),
        (None, Some(i)) => known_ints(i, "axes")?,
        (None, None) => Vec::new(),
    };
    if axes.is_empty() && r.noop_with_empty_axes {
        return Ok(vec![(*t).clone()]);
    }
    let rank = t.shape.rank();
    let axes: Vec<usize> = if axes.is_empty() {
        (0..rank).collect()
    } else {
        axes.iter().map(|&a| normalize_axis(a, rank).ok_or(format!("axis {a} out of range for {}", t.shape))).collect::<R<_>>()?
    };
    Ok(vec![TensorType::new(t.dtype, reduce_shape(&t.shape, &axes, r.keepdims))])
}

fn pad(p: &Pad, ins: &[Option<In>]) -> R<Vec<TensorType>> {
    let x = ins.first().copied().flatten().ok_or("input 0 is required")?;
    let t = &x.ty;
    let r = t.shape.rank();
    let pads = match &p.attrs {
        Some((pads, _)) => pads.clone(),
        None => known_ints(ins.get(1).copied().flatten().ok_or("pads is required")?, "pads")?,
    };
    let axes: Vec<usize> = match ins.get(3).copied().flatten() {
        Some(a) => known_ints(a, "axes")?
            .into_iter()
            .map(|a| normalize_axis(a, r).ok_or(format!("axis {a} out of range for {}", t.shape)))
            .collect::<R<_>>()?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(format!("{} pads for {} axes", pads.len(), axes.len()));
    }
    let mut d = t.shape.0.clone();
    let k = axes.len();
    for (i, &a) in axes.iter().enumerate() {
        let extra = pads[i].checked_add(pads[i + k]).ok_or_else(|| format!("pads {pads:?} overflow"))?;
        d[a] = match d[a] {
            Dim::Fixed(v) if v.checked_add(extra).is_some_and(|e| e >= 0) => Dim::Fixed(v + extra),
            Dim::Batch(_) if extra == 0 => d[a],
            other => return Err(format!("padding {extra} on extent {other} is not supported")),
        };
    }
    Ok(vec![TensorType::new(t.dtype, Shape(d))])
}

/// Shape of an einsum result; supports explicit and implicit outputs and `...`.
fn einsum(eq: &str, shapes: &[&Shape], ctx: Ctx) -> R<Shape> {
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != shapes.len() {
        return Err(format!("equation has {} operands, node has {}", terms.len(), shapes.len()));
    }
    let mut sizes: std::collections::BTreeMap<char, Dim> = Default::default();
    let mut counts: std::collections::BTreeMap<char, usize> = Default::default();
    let mut ellipsis: Vec<&Shape> = Vec::new();
    let mut ell_shapes: Vec<Shape> = Vec::new();
    for (term, shape) in terms.iter().zip(shapes) {
        let letters: Vec<char> = term.replace("...", "").chars().collect();
        let has_ell = term.contains("...");
        let ell_rank = shape.rank().checked_sub(letters.len()).ok_or(format!("term {term:?} has more letters than {shape} has axes"))?;
        if !has_ell && ell_rank != 0 {
            return Err(format!("term {term:?} does not match {shape}"));
        }
        let prefix = term.find("...").map(|p| term[..p].chars().count()).unwrap_or(letters.len());
        let mut axis = 0;
        for (i, c) in letters.iter().enumerate() {
            if i == prefix {
                if has_ell {
                    ell_shapes.push(Shape(shape.0[axis..axis + ell_rank].to_vec()));
                }
                axis += ell_rank;
            }
            let d = shape.0[axis];
            match sizes.get(c) {
                Some(&prev) if !dims_agree(prev, d, ctx) && prev != Dim::Fixed(1) && d != Dim::Fixed(1) => {
                    return Err(format!("label {c} has extents {prev} and {d}"));
                }
                Some(&prev) if prev != Dim::Fixed(1) && !d.is_batch() => {}
                _ => {
                    sizes.insert(*c, d);
                }
            }
            *counts.entry(*c).or_default() += 1;
            axis += 1;
        }
        if has_ell && prefix == letters.len() {
            ell_shapes.push(Shape(shape.0[axis..axis + ell_rank].to_vec()));
        }
    }
    ellipsis.extend(ell_shapes.iter());
    let ell = broadcast(&ellipsis, ctx)?;
    let out_term = match rhs {
        Some(r) => r,
        None => {
            let once: String = counts.iter().filter(|(_, &n)| n == 1).map(|(c, _)| *c).collect();
            if ellipsis.is_empty() { once } else { format!("...{once}") }
        }
    };
    let mut out = Vec::new();
    let mut rest = out_term.as_str();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("...") {
            out.extend(&ell.0);
            rest = r;
            continue;
        }
        let c = rest.chars().next().expect("non-empty");
        out.push(*sizes.get(&c).ok_or(format!("output label {c} does not appear in the inputs"))?);
        rest = &rest[c.len_utf8()..];
    }
    Ok(Shape(out))
}
