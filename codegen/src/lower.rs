//! IR graph to runtime [`Program`]: `Op` to `Kernel` one for one, values to slots in the
//! graph's topological order, weights and constants to stored tensors (sharing bytes).

use pipewright_core::UpdateRule;
use pipewright_ops::op as ir;
use pipewright_ir::{DType, Dim, Graph, NodeId, Op, ValueDef, ValueId};
use pipewright_runtime::kernel as rt;
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo, Stored};
use pipewright_runtime::{ElemType, Kernel};

/// Why a graph could not be lowered.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
    /// A node reads or writes a value that was given no slot (a bug in the caller).
    #[error("value {0:?} has no slot in the program")]
    MissingValue(String),
    /// The graph's stages are inconsistent.
    #[error("stage {stage}: {reason}")]
    Stage { stage: u32, reason: String },
}

/// Lowers the whole graph to one program.
pub fn lower_graph(g: &Graph) -> Result<Program, LowerError> {
    let order = g.topo_order().map_err(|n| LowerError::Cycle(g.node(n).name.clone()))?;
    let values: Vec<ValueId> = g.value_ids().collect();
    lower_nodes(g, &Lowering { nodes: &order, values: &values, inputs: g.inputs(), outputs: g.outputs() })
}

/// What [`lower_nodes`] lowers: a subset of a graph's nodes in execution order, and the
/// values that get slots (slot `i` is `values[i]`; every value a node reads or writes,
/// and every input and output, must be among them).
pub struct Lowering<'a> {
    pub nodes: &'a [NodeId],
    pub values: &'a [ValueId],
    /// Program inputs (fed by the caller), in order.
    pub inputs: &'a [ValueId],
    /// Program outputs, in order (a value may appear more than once).
    pub outputs: &'a [ValueId],
}

/// Lowers `l.nodes` of `g` to one program: weights and constants among `l.values` become
/// stored tensors, each node one instruction; then the [`rebatch`] rewrites apply.
pub fn lower_nodes(g: &Graph, l: &Lowering<'_>) -> Result<Program, LowerError> {
    let mut index: Vec<Option<SlotId>> = vec![None; g.value_count()];
    for (i, v) in l.values.iter().enumerate() {
        index[v.index()] = Some(SlotId(i as u32));
    }
    let slot = |v: ValueId| -> Result<SlotId, LowerError> {
        index.get(v.index()).copied().flatten().ok_or_else(|| LowerError::MissingValue(g.value(v).name.clone()))
    };
    let mut p = Program {
        slots: l.values.iter().map(|&v| slot_info(g, v)).collect(),
        inputs: l.inputs.iter().map(|&v| slot(v)).collect::<Result<_, _>>()?,
        outputs: l.outputs.iter().map(|&v| slot(v)).collect::<Result<_, _>>()?,
        ..Program::default()
    };
    for &v in l.values {
        if let ValueDef::Weight(w) = &g.value(v).def {
            let (elem, bytes) = match unpacked(&w.data) {
                Some((e, b)) => (e, b.into()),
                None => (elem(w.data.dtype), w.data.bytes.clone()),
            };
            p.stored.push(Stored {
                slot: slot(v)?,
                elem,
                dims: w.data.dims.clone(),
                bytes,
                trainable: w.trainable,
                versions: 1,
                // Plain training until the weight-versioning pass says otherwise.
                update: if w.trainable { UpdateRule::Vanilla } else { UpdateRule::Constant },
                sync: Vec::new(),
            });
        }
    }
    for &n in l.nodes {
        let node = g.node(n);
        p.instrs.push(Instr {
            name: node.name.clone(),
            kernel: unsigned(g, &node.inputs, typed_kernel(g, node)),
            inputs: node.inputs.iter().map(|v| v.map(slot).transpose()).collect::<Result<_, _>>()?,
            outputs: node.outputs.iter().map(|v| v.map(slot).transpose()).collect::<Result<_, _>>()?,
            recompute: false,
        });
    }
    rebatch::apply_to(g, &mut p, l.nodes, l.values);
    Ok(p)
}

/// A kernel reading u16/u32/u64 values, which the runtime holds in signed carrier kinds:
/// data movement is the same on the carrier; anything else goes through the runtime's
/// unsigned kernels, told every input's element type (they refuse what they do not
/// emulate exactly).
fn unsigned(g: &Graph, inputs: &[Option<ValueId>], k: Kernel) -> Kernel {
    let types: Vec<Option<ElemType>> = inputs.iter().map(|v| v.map(|v| elem(g.value(v).ty.dtype))).collect();
    let any = types.iter().flatten().any(|t| matches!(t, ElemType::U16 | ElemType::U32 | ElemType::U64));
    let moves_data = matches!(
        k,
        Kernel::Reshape { .. } | Kernel::Flatten { .. } | Kernel::Transpose { .. } | Kernel::Squeeze { .. }
            | Kernel::Unsqueeze { .. } | Kernel::Concat { .. } | Kernel::Split(_) | Kernel::Slice(_)
            | Kernel::Gather { .. } | Kernel::GatherElements { .. } | Kernel::GatherNd { .. } | Kernel::Expand
            | Kernel::Shape { .. } | Kernel::Size | Kernel::Tile | Kernel::Where
            | Kernel::DepthToSpace { .. } | Kernel::SpaceToDepth { .. }
    );
    if !any || moves_data {
        return k;
    }
    Kernel::Unsigned { types, kernel: Box::new(k) }
}

/// A weight of a packed 4- or 2-bit type unpacked into its runtime holder type (i8, u8 or
/// f32), since stage files keep one element per byte or more; `None` for other types,
/// stored as they are.
fn unpacked(t: &pipewright_ir::TensorData) -> Option<(ElemType, Vec<u8>)> {
    let e = elem(t.dtype);
    if e.per_byte() == 1 {
        return None;
    }
    let holder = e.holder();
    let values = t.to_f64s();
    let out: Vec<u8> = match holder {
        ElemType::I8 => values.iter().map(|&v| v as i8 as u8).collect(),
        ElemType::U8 => values.iter().map(|&v| v as u8).collect(),
        _ => values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
    };
    Some((holder, out))
}

fn slot_info(g: &Graph, v: ValueId) -> SlotInfo {
    let val = g.value(v);
    SlotInfo { name: val.name.clone(), elem: elem(val.ty.dtype), shape: val.ty.shape.0.iter().map(|&d| extent(d)).collect(), last_use: None }
}

fn extent(d: Dim) -> Extent {
    match d {
        Dim::Fixed(v) => Extent::Fixed(v),
        Dim::Batch(k) => Extent::Batch(k),
    }
}

/// The runtime's name for an IR element type.
pub fn elem(d: DType) -> ElemType {
    match d {
        DType::F32 => ElemType::F32,
        DType::F16 => ElemType::F16,
        DType::Bf16 => ElemType::Bf16,
        DType::F64 => ElemType::F64,
        DType::I64 => ElemType::I64,
        DType::I32 => ElemType::I32,
        DType::I16 => ElemType::I16,
        DType::I8 => ElemType::I8,
        DType::U8 => ElemType::U8,
        DType::U16 => ElemType::U16,
        DType::U32 => ElemType::U32,
        DType::U64 => ElemType::U64,
        DType::Bool => ElemType::Bool,
        DType::F8E4M3FN => ElemType::F8E4M3FN,
        DType::F8E4M3FNUZ => ElemType::F8E4M3FNUZ,
        DType::F8E5M2 => ElemType::F8E5M2,
        DType::F8E5M2FNUZ => ElemType::F8E5M2FNUZ,
        DType::U4 => ElemType::U4,
        DType::I4 => ElemType::I4,
        DType::F4E2M1 => ElemType::F4E2M1,
        DType::F8E8M0 => ElemType::F8E8M0,
        DType::U2 => ElemType::U2,
        DType::I2 => ElemType::I2,
    }
}

/// [`kernel`], with the output type filled in where the runtime cannot tell it from its
/// inputs' kinds (a CastLike or QuantizeLinear to `i4` computes in an i8 tensor).
fn typed_kernel(g: &Graph, node: &pipewright_ir::Node) -> Kernel {
    let k = kernel(&node.op, node.outputs.len(), node.inputs.len());
    let Some(out) = node.outputs.first().copied().flatten().map(|v| elem(g.value(v).ty.dtype)) else {
        return k;
    };
    match k {
        Kernel::CastLike { mode } => Kernel::Cast { to: out, mode },
        Kernel::QuantizeLinear(q) => Kernel::QuantizeLinear(rt::Quantize { to: Some(out), ..q }),
        Kernel::DequantizeLinear { axis, block_size, .. } => Kernel::DequantizeLinear { axis, block_size, to: Some(out) },
        k => k,
    }
}

fn cast_mode(m: &ir::CastMode) -> rt::CastMode {
    let round = match m.round {
        ir::RoundMode::Up => rt::RoundMode::Up,
        ir::RoundMode::Down => rt::RoundMode::Down,
        ir::RoundMode::Nearest => rt::RoundMode::Nearest,
    };
    rt::CastMode { saturate: m.saturate, round }
}

/// The kernel implementing `op` for a node with `n_out` outputs and `n_in` inputs.
pub fn kernel(op: &Op, n_out: usize, n_in: usize) -> Kernel {
    match op {
        Op::Unary(u) => Kernel::Unary(unary(*u)),
        Op::Binary(b) => Kernel::Binary(binary(*b)),
        Op::Variadic(v) => Kernel::Variadic(match v {
            ir::VariadicOp::Sum => rt::VariadicKind::Sum,
            ir::VariadicOp::Max => rt::VariadicKind::Max,
            ir::VariadicOp::Min => rt::VariadicKind::Min,
            ir::VariadicOp::Mean => rt::VariadicKind::Mean,
        }),
        Op::LeakyRelu { alpha } => Kernel::LeakyRelu { alpha: *alpha },
        Op::Elu { alpha } => Kernel::Elu { alpha: *alpha },
        Op::Celu { alpha } => Kernel::Celu { alpha: *alpha },
        Op::Selu { alpha, gamma } => Kernel::Selu { alpha: *alpha, gamma: *gamma },
        Op::HardSigmoid { alpha, beta } => Kernel::HardSigmoid { alpha: *alpha, beta: *beta },
        Op::ThresholdedRelu { alpha } => Kernel::ThresholdedRelu { alpha: *alpha },
        Op::Swish { alpha } => Kernel::Swish { alpha: *alpha },
        Op::SwiGlu { alpha } => Kernel::SwiGlu { alpha: *alpha },
        Op::Gelu { approximate } => Kernel::Gelu {
            approximate: match approximate {
                ir::GeluApprox::None => rt::GeluApprox::None,
                ir::GeluApprox::Tanh => rt::GeluApprox::Tanh,
            },
        },
        Op::Clip { min, max } => Kernel::Clip { min: *min, max: *max },
        Op::IsInf { detect_positive, detect_negative } => {
            Kernel::IsInf { detect_positive: *detect_positive, detect_negative: *detect_negative }
        }
        Op::Softmax(s) => Kernel::Softmax(rt::Softmax { axis: s.axis, coerce_2d: s.coerce_2d }),
        Op::LogSoftmax(s) => Kernel::LogSoftmax(rt::Softmax { axis: s.axis, coerce_2d: s.coerce_2d }),
        Op::MatMul => Kernel::MatMul,
        Op::MatMulInteger => Kernel::MatMulInteger,
        Op::QLinearMatMul => Kernel::QLinearMatMul,
        Op::ConvInteger(c) => Kernel::ConvInteger(rt::Conv { window: window(&c.window), group: c.group }),
        Op::QLinearConv(c) => Kernel::QLinearConv(rt::Conv { window: window(&c.window), group: c.group }),
        Op::Gemm(g) => Kernel::Gemm(rt::Gemm { alpha: g.alpha, beta: g.beta, trans_a: g.trans_a, trans_b: g.trans_b }),
        Op::Conv(c) => Kernel::Conv(rt::Conv { window: window(&c.window), group: c.group }),
        Op::ConvTranspose(c) => Kernel::ConvTranspose(rt::ConvTranspose {
            window: window(&c.window),
            group: c.group,
            output_padding: c.output_padding.clone(),
            output_shape: c.output_shape.clone(),
        }),
        Op::MaxPool(p) => Kernel::MaxPool(pool(p)),
        Op::MaxUnpool { kernel_shape, strides, pads } => {
            Kernel::MaxUnpool { kernel_shape: kernel_shape.clone(), strides: strides.clone(), pads: pads.clone() }
        }
        Op::AveragePool(p) => Kernel::AveragePool(pool(p)),
        Op::LpPool { pool: po, p } => Kernel::LpPool { pool: pool(po), p: *p },
        Op::GlobalAveragePool => Kernel::GlobalAveragePool,
        Op::GlobalMaxPool => Kernel::GlobalMaxPool,
        Op::BatchNormalization(b) => {
            Kernel::BatchNormalization(rt::BatchNorm { epsilon: b.epsilon, momentum: b.momentum, training_mode: b.training_mode })
        }
        Op::LayerNormalization(l) => {
            Kernel::LayerNormalization(rt::LayerNorm { axis: l.axis, epsilon: l.epsilon, stash_type: l.stash_type })
        }
        Op::RMSNormalization(l) => {
            Kernel::RmsNormalization(rt::LayerNorm { axis: l.axis, epsilon: l.epsilon, stash_type: l.stash_type })
        }
        Op::Attention(a) => Kernel::Attention(rt::Attention {
            is_causal: a.is_causal,
            q_num_heads: a.q_num_heads,
            kv_num_heads: a.kv_num_heads,
            qk_matmul_output_mode: a.qk_matmul_output_mode,
            scale: a.scale,
            softcap: a.softcap,
            softmax_precision: a.softmax_precision.map(elem),
            left_window_size: a.left_window_size,
            right_window_size: a.right_window_size,
        }),
        Op::RotaryEmbedding(r) => Kernel::RotaryEmbedding(rt::Rotary {
            interleaved: r.interleaved,
            rotary_embedding_dim: r.rotary_embedding_dim,
            num_heads: r.num_heads,
        }),
        Op::LinearAttention(l) => Kernel::LinearAttention(rt::LinearAttention {
            q_num_heads: l.q_num_heads,
            kv_num_heads: l.kv_num_heads,
            scale: l.scale,
            gated: l.update_rule.gated(),
            delta: l.update_rule.delta(),
        }),
        Op::CausalConvWithState { silu } => Kernel::CausalConvWithState { silu: *silu },
        Op::Optimizer(o) => Kernel::Optimizer(match *o {
            ir::Optimizer::Adagrad { decay_factor, epsilon, norm_coefficient } => rt::Optimizer::Adagrad { decay_factor, epsilon, norm_coefficient },
            ir::Optimizer::Adam { alpha, beta, epsilon, norm_coefficient, norm_coefficient_post } => {
                rt::Optimizer::Adam { alpha, beta, epsilon, norm_coefficient, norm_coefficient_post }
            }
            ir::Optimizer::Momentum { alpha, beta, norm_coefficient, nesterov } => rt::Optimizer::Momentum { alpha, beta, norm_coefficient, nesterov },
        }),
        Op::Binarizer { threshold } => Kernel::Binarizer { threshold: *threshold },
        Op::ArrayFeatureExtractor => Kernel::ArrayFeatureExtractor,
        Op::TreeEnsemble(t) => Kernel::TreeEnsemble(Box::new(tree_ensemble(t))),
        Op::InstanceNormalization { epsilon } => Kernel::InstanceNormalization { epsilon: *epsilon },
        Op::NegativeLogLikelihoodLoss(l) => Kernel::NegativeLogLikelihoodLoss(class_loss(l)),
        Op::SoftmaxCrossEntropyLoss(l) => Kernel::SoftmaxCrossEntropyLoss(class_loss(l)),
        Op::Dropout { ratio, seed } => Kernel::Dropout { ratio: *ratio, seed: *seed },
        _ => shape_kernel(op, n_out, n_in),
    }
}

fn class_loss(l: &ir::ClassLoss) -> rt::ClassLoss {
    let reduction = match l.reduction {
        ir::LossReduction::None => rt::LossReduction::None,
        ir::LossReduction::Sum => rt::LossReduction::Sum,
        ir::LossReduction::Mean => rt::LossReduction::Mean,
    };
    rt::ClassLoss { reduction, ignore_index: l.ignore_index }
}

fn shape_kernel(op: &Op, n_out: usize, n_in: usize) -> Kernel {
    match op {
        Op::Reshape { allow_zero } => Kernel::Reshape { allow_zero: *allow_zero },
        Op::Flatten { axis } => Kernel::Flatten { axis: *axis },
        Op::Transpose { perm } => Kernel::Transpose { perm: perm.clone() },
        Op::Squeeze { axes } => Kernel::Squeeze { axes: axes.clone() },
        Op::Unsqueeze { axes } => Kernel::Unsqueeze { axes: axes.clone() },
        Op::Concat { axis } => Kernel::Concat { axis: *axis },
        Op::Split(s) => {
            // Equal parts in older opsets: the part count is the node's output count.
            let equal = s.split.is_none() && n_in < 2 && s.num_outputs.is_none();
            Kernel::Split(rt::Split {
                axis: s.axis,
                split: s.split.clone(),
                num_outputs: if equal { Some(n_out as i64) } else { s.num_outputs },
            })
        }
        Op::Slice(s) => Kernel::Slice(rt::Slice { attrs: s.attrs.clone() }),
        Op::Gather { axis } => Kernel::Gather { axis: *axis },
        Op::GatherElements { axis } => Kernel::GatherElements { axis: *axis },
        Op::GatherND { batch_dims } => Kernel::GatherNd { batch_dims: *batch_dims },
        Op::Expand => Kernel::Expand,
        Op::Where => Kernel::Where,
        Op::Cast { to, mode } => Kernel::Cast { to: elem(*to), mode: cast_mode(mode) },
        Op::CastLike { mode } => Kernel::CastLike { mode: cast_mode(mode) },
        Op::QuantizeLinear(q) => Kernel::QuantizeLinear(rt::Quantize {
            to: q.output_dtype.map(elem),
            axis: q.axis,
            block_size: q.block_size,
            saturate: q.saturate,
            precision: q.precision.map(elem),
        }),
        Op::DequantizeLinear { axis, block_size, output_dtype } => {
            Kernel::DequantizeLinear { axis: *axis, block_size: *block_size, to: output_dtype.map(elem) }
        }
        Op::DynamicQuantizeLinear => Kernel::DynamicQuantizeLinear,
        Op::Shape { start, end } => Kernel::Shape { start: *start, end: *end },
        Op::Size => Kernel::Size,
        Op::ConstantOfShape { value } => Kernel::ConstantOfShape {
            value: value.as_ref().map(|t| (elem(t.dtype), t.to_f64s().first().copied().unwrap_or(0.0))),
        },
        Op::Range => Kernel::Range,
        Op::Reduce(r) => Kernel::Reduce(rt::Reduce {
            kind: reduce_kind(r.kind),
            axes: r.axes.clone(),
            keepdims: r.keepdims,
            noop_with_empty_axes: r.noop_with_empty_axes,
        }),
        Op::ArgMax { axis, keepdims, select_last_index } => {
            Kernel::ArgMax { axis: *axis, keepdims: *keepdims, select_last_index: *select_last_index }
        }
        Op::ArgMin { axis, keepdims, select_last_index } => {
            Kernel::ArgMin { axis: *axis, keepdims: *keepdims, select_last_index: *select_last_index }
        }
        Op::Trilu { upper } => Kernel::Trilu { upper: *upper },
        Op::Einsum { equation } => Kernel::Einsum { equation: equation.clone() },
        Op::Pad(p) => Kernel::Pad(rt::Pad {
            mode: match p.mode {
                ir::PadMode::Constant => rt::PadMode::Constant,
                ir::PadMode::Reflect => rt::PadMode::Reflect,
                ir::PadMode::Edge => rt::PadMode::Edge,
                ir::PadMode::Wrap => rt::PadMode::Wrap,
            },
            attrs: p.attrs.clone(),
        }),
        Op::Tile => Kernel::Tile,
        Op::Resize(r) | Op::Upsample(r) => Kernel::Resize(resize(r)),
        Op::Col2Im { dilations, pads, strides } => {
            Kernel::Col2Im { dilations: dilations.clone(), pads: pads.clone(), strides: strides.clone() }
        }
        Op::CenterCropPad { axes } => Kernel::CenterCropPad { axes: axes.clone() },
        Op::AffineGrid { align_corners } => Kernel::AffineGrid { align_corners: *align_corners },
        Op::Dft { inverse, onesided, axis } => Kernel::Dft { inverse: *inverse, onesided: *onesided, axis: *axis },
        Op::Stft { onesided } => Kernel::Stft { onesided: *onesided },
        Op::RoiAlign(r) => Kernel::RoiAlign(rt::RoiAlign {
            max: r.max,
            output_height: r.output_height,
            output_width: r.output_width,
            sampling_ratio: r.sampling_ratio,
            spatial_scale: r.spatial_scale,
            half_pixel: r.half_pixel,
        }),
        Op::DeformConv { conv, offset_group } => Kernel::DeformConv {
            conv: rt::Conv { window: window(&conv.window), group: conv.group },
            offset_group: *offset_group,
        },
        Op::GridSample { mode, padding, align_corners, .. } => Kernel::GridSample {
            mode: match mode {
                ir::ResizeMode::Nearest => rt::ResizeMode::Nearest,
                ir::ResizeMode::Linear => rt::ResizeMode::Linear,
                ir::ResizeMode::Cubic => rt::ResizeMode::Cubic,
            },
            padding: match padding {
                ir::GridPadding::Zeros => rt::GridPadding::Zeros,
                ir::GridPadding::Border => rt::GridPadding::Border,
                ir::GridPadding::Reflection => rt::GridPadding::Reflection,
            },
            align_corners: *align_corners,
        },
        Op::DepthToSpace { blocksize, crd } => Kernel::DepthToSpace { blocksize: *blocksize, crd: *crd },
        Op::SpaceToDepth { blocksize, crd } => Kernel::SpaceToDepth { blocksize: *blocksize, crd: *crd },
        Op::CumSum { exclusive, reverse } => Kernel::CumSum { exclusive: *exclusive, reverse: *reverse },
        Op::CumProd { exclusive, reverse } => Kernel::CumProd { exclusive: *exclusive, reverse: *reverse },
        Op::TopK { axis, largest, sorted } => Kernel::TopK { axis: *axis, largest: *largest, sorted: *sorted },
        Op::OneHot { axis } => Kernel::OneHot { axis: *axis },
        Op::ScatterND { reduction } => Kernel::ScatterNd { reduction: scatter_reduction(*reduction) },
        Op::ScatterElements { axis, reduction } => {
            Kernel::ScatterElements { axis: *axis, reduction: scatter_reduction(*reduction) }
        }
        Op::Scatter { axis } => Kernel::ScatterElements { axis: *axis, reduction: rt::ScatterReduction::None },
        Op::TensorScatter { axis, circular } => Kernel::TensorScatter { axis: *axis, circular: *circular },
        Op::ReverseSequence { batch_axis, time_axis } => {
            Kernel::ReverseSequence { batch_axis: *batch_axis, time_axis: *time_axis }
        }
        Op::EyeLike { dtype, k } => Kernel::EyeLike { dtype: dtype.map(elem), k: *k },
        _ => norm_kernel(op),
    }
}

/// The normalisations and matrix ops added with the indexing ops.
fn norm_kernel(op: &Op) -> Kernel {
    match op {
        Op::Hardmax(s) => Kernel::Hardmax(rt::Softmax { axis: s.axis, coerce_2d: s.coerce_2d }),
        Op::LpNormalization { axis, p } => Kernel::LpNormalization { axis: *axis, p: *p },
        Op::Shrink { bias, lambd } => Kernel::Shrink { bias: *bias, lambd: *lambd },
        Op::Lrn(l) => Kernel::Lrn(rt::Lrn { alpha: l.alpha, beta: l.beta, bias: l.bias, size: l.size }),
        Op::MeanVarianceNormalization { axes } => Kernel::MeanVarianceNormalization { axes: axes.clone() },
        Op::GroupNormalization(g) => Kernel::GroupNormalization(rt::GroupNorm {
            epsilon: g.epsilon,
            num_groups: g.num_groups,
            stash_type: g.stash_type,
            per_channel: g.per_channel,
        }),
        Op::Det => Kernel::Det,
        Op::Rnn(r) => Kernel::Rnn(rt::Rnn {
            cell: match r.cell {
                ir::RnnCell::Rnn => rt::RnnCell::Rnn,
                ir::RnnCell::Gru => rt::RnnCell::Gru,
                ir::RnnCell::Lstm => rt::RnnCell::Lstm,
            },
            hidden_size: r.hidden_size,
            direction: match r.direction {
                ir::RnnDirection::Forward => rt::RnnDirection::Forward,
                ir::RnnDirection::Reverse => rt::RnnDirection::Reverse,
                ir::RnnDirection::Bidirectional => rt::RnnDirection::Bidirectional,
            },
            batch_major: r.batch_major,
            clip: r.clip,
            linear_before_reset: r.linear_before_reset,
        }),
        // Within one program a crossing is the identity; stage modules split here.
        Op::StageBoundary { .. } => Kernel::Unary(rt::UnaryKind::Identity),
        other => unreachable!("{} is lowered by `kernel`", other.name()),
    }
}

fn resize(r: &ir::Resize) -> rt::Resize {
    rt::Resize {
        mode: match r.mode {
            ir::ResizeMode::Nearest => rt::ResizeMode::Nearest,
            ir::ResizeMode::Linear => rt::ResizeMode::Linear,
            ir::ResizeMode::Cubic => rt::ResizeMode::Cubic,
        },
        coord: match r.coord {
            ir::CoordMode::HalfPixel => rt::CoordMode::HalfPixel,
            ir::CoordMode::HalfPixelSymmetric => rt::CoordMode::HalfPixelSymmetric,
            ir::CoordMode::PytorchHalfPixel => rt::CoordMode::PytorchHalfPixel,
            ir::CoordMode::AlignCorners => rt::CoordMode::AlignCorners,
            ir::CoordMode::Asymmetric => rt::CoordMode::Asymmetric,
            ir::CoordMode::TfCropAndResize => rt::CoordMode::TfCropAndResize,
        },
        nearest: match r.nearest {
            ir::NearestMode::RoundPreferFloor => rt::NearestMode::RoundPreferFloor,
            ir::NearestMode::RoundPreferCeil => rt::NearestMode::RoundPreferCeil,
            ir::NearestMode::Floor => rt::NearestMode::Floor,
            ir::NearestMode::Ceil => rt::NearestMode::Ceil,
        },
        aspect: match r.aspect {
            ir::AspectPolicy::Stretch => rt::AspectPolicy::Stretch,
            ir::AspectPolicy::NotLarger => rt::AspectPolicy::NotLarger,
            ir::AspectPolicy::NotSmaller => rt::AspectPolicy::NotSmaller,
        },
        cubic_a: r.cubic_a,
        exclude_outside: r.exclude_outside,
        extrapolation: r.extrapolation,
        antialias: r.antialias,
        axes: r.axes.clone(),
        legacy: r.legacy,
    }
}

fn window(w: &ir::Window) -> rt::Window {
    rt::Window {
        kernel_shape: w.kernel_shape.clone(),
        strides: w.strides.clone(),
        pads: w.pads.clone(),
        dilations: w.dilations.clone(),
        auto_pad: match w.auto_pad {
            ir::AutoPad::NotSet => rt::AutoPad::NotSet,
            ir::AutoPad::SameUpper => rt::AutoPad::SameUpper,
            ir::AutoPad::SameLower => rt::AutoPad::SameLower,
            ir::AutoPad::Valid => rt::AutoPad::Valid,
        },
    }
}

fn pool(p: &ir::Pool) -> rt::Pool {
    rt::Pool { window: window(&p.window), ceil_mode: p.ceil_mode, count_include_pad: p.count_include_pad }
}

fn scatter_reduction(r: ir::ScatterReduction) -> rt::ScatterReduction {
    use ir::ScatterReduction as I;
    use rt::ScatterReduction as R;
    match r {
        I::None => R::None, I::Add => R::Add, I::Mul => R::Mul, I::Max => R::Max, I::Min => R::Min,
    }
}

fn reduce_kind(k: ir::ReduceKind) -> rt::ReduceKind {
    use ir::ReduceKind as I;
    use rt::ReduceKind as R;
    match k {
        I::Sum => R::Sum, I::Mean => R::Mean, I::Max => R::Max, I::Min => R::Min, I::Prod => R::Prod,
        I::L1 => R::L1, I::L2 => R::L2, I::LogSum => R::LogSum, I::LogSumExp => R::LogSumExp,
        I::SumSquare => R::SumSquare,
    }
}

fn unary(u: ir::UnaryOp) -> rt::UnaryKind {
    use ir::UnaryOp as I;
    use rt::UnaryKind as R;
    match u {
        I::Abs => R::Abs, I::Neg => R::Neg, I::Sqrt => R::Sqrt, I::Reciprocal => R::Reciprocal,
        I::Exp => R::Exp, I::Log => R::Log, I::Erf => R::Erf, I::Tanh => R::Tanh,
        I::Sigmoid => R::Sigmoid, I::Relu => R::Relu, I::Not => R::Not, I::IsNaN => R::IsNaN,
        I::Floor => R::Floor, I::Ceil => R::Ceil, I::Round => R::Round, I::Sign => R::Sign,
        I::Sin => R::Sin, I::Cos => R::Cos, I::Tan => R::Tan, I::Asin => R::Asin, I::Acos => R::Acos,
        I::Atan => R::Atan, I::Sinh => R::Sinh, I::Cosh => R::Cosh, I::Asinh => R::Asinh,
        I::Acosh => R::Acosh, I::Atanh => R::Atanh, I::Softplus => R::Softplus,
        I::Softsign => R::Softsign, I::Identity => R::Identity, I::HardSwish => R::HardSwish,
        I::Mish => R::Mish, I::BitNot => R::BitNot,
    }
}

fn binary(b: ir::BinaryOp) -> rt::BinaryKind {
    use ir::BinaryOp as I;
    use rt::BinaryKind as R;
    match b {
        I::Add => R::Add, I::Sub => R::Sub, I::Mul => R::Mul, I::Div => R::Div, I::Pow => R::Pow,
        I::Equal => R::Equal, I::Less => R::Less, I::Greater => R::Greater,
        I::LessOrEqual => R::LessOrEqual, I::GreaterOrEqual => R::GreaterOrEqual, I::And => R::And,
        I::Or => R::Or, I::Xor => R::Xor, I::Mod => R::Mod, I::Fmod => R::Fmod, I::PRelu => R::PRelu,
        I::BitAnd => R::BitAnd, I::BitOr => R::BitOr, I::BitXor => R::BitXor,
        I::ShiftLeft => R::ShiftLeft, I::ShiftRight => R::ShiftRight,
    }
}

/// TreeEnsemble's tables as the kernel walks them; each set-membership node takes the
/// next NaN-terminated run of `membership_values` (the importer checked the counts).
fn tree_ensemble(t: &ir::TreeEnsemble) -> rt::TreeEnsemble {
    let modes = t.modes.to_i64s();
    let splits = t.splits.to_f64s();
    let members = t.membership_values.as_ref().map(|m| m.to_f64s()).unwrap_or_default();
    let mut sets = members.split(|x| x.is_nan());
    let nodes = (0..t.featureids.len())
        .map(|i| rt::TreeNode {
            feature: t.featureids[i],
            mode: modes[i],
            split: splits[i],
            members: if modes[i] == 6 { sets.next().unwrap_or_default().to_vec() } else { Vec::new() },
            missing_true: t.missing_tracks_true.get(i).is_some_and(|&m| m != 0),
            on_true: (t.trueleafs[i] != 0, t.truenodeids[i]),
            on_false: (t.falseleafs[i] != 0, t.falsenodeids[i]),
        })
        .collect();
    rt::TreeEnsemble {
        nodes,
        leaf_targets: t.leaf_targetids.clone(),
        leaf_weights: t.leaf_weights.to_f64s(),
        roots: t.tree_roots.clone(),
        n_targets: t.n_targets,
        aggregate: t.aggregate_function,
    }
}

/// Rewrites what a fixed-batch export baked into constants so the program runs at any
/// microbatch size: Reshape targets get `-1` where the IR inferred the batch, Expand
/// targets and Tile repeats get `1` where they would pin the export batch, constants that
/// are one slice repeated over the export batch (attention masks) keep a single slice when
/// every reader broadcasts, and repeated slices concatenated with a batched tensor (class
/// tokens) are expanded to its batch at run time.
pub mod rebatch {
    use pipewright_core::UpdateRule;
    use pipewright_ir::{Dim, Graph, NodeId, Op, ValueDef, ValueId};
    use pipewright_runtime::program::{Extent, Program, SlotId, SlotInfo, Stored};
    use pipewright_runtime::ElemType;

    /// The rewrites for a whole-graph program (slot `i` is value `i`, one instruction per
    /// node in topological order), as `lower_graph` builds it.
    pub fn apply(g: &Graph, p: &mut Program) {
        let order = g.topo_order().unwrap_or_default();
        let values: Vec<ValueId> = g.value_ids().collect();
        apply_to(g, p, &order, &values);
    }

    /// The rewrites for a program whose instruction `k` lowers `nodes[k]` and whose slot
    /// `i` holds `values[i]` (slots past `values` are ones codegen added).
    pub fn apply_to(g: &Graph, p: &mut Program, nodes: &[NodeId], values: &[ValueId]) {
        // An export at batch 1 bakes its batch into these constants as much as one at 4.
        let Some(b0) = g.batch.as_ref().map(|b| b.export_size).filter(|&b| b > 0) else { return };
        for (k, &n) in nodes.iter().enumerate() {
            let node = g.node(n);
            let target = node.inputs.get(1).copied().flatten().filter(|v| is_const(g, *v));
            let out = node.outputs.first().copied().flatten().map(|v| g.value(v).ty.shape.0.clone());
            let (Some(target), Some(out)) = (target, out) else { continue };
            let new = match node.op {
                Op::Reshape { .. } if out.iter().filter(|d| d.is_batch()).count() == 1 => {
                    Some(out.iter().map(|d| if d.is_batch() { -1 } else { d.fixed().unwrap_or(0) }).collect::<Vec<i64>>())
                }
                Op::Expand if !read_as_element_indices(g, node.outputs[0]) => expand_target(g, node.inputs[0], &out, b0),
                Op::Tile => tile_repeats(g, node.inputs[0], target, b0),
                _ => None,
            };
            if let Some(values) = new {
                let slot = push_i64(p, &format!("{}:rebatched", g.value(target).name), &values);
                p.instrs[k].inputs[1] = Some(slot);
            }
        }
        shrink_repeated_constants(g, p, b0, values);
        expand_concat_slices(p, b0);
    }

    /// A tensor `[B0, ...]` of repeated slices concatenated (on another axis) with a batched
    /// tensor, like a class token, becomes its first slice expanded to the batch of that
    /// tensor at run time: `Expand(c[0:1], Concat(Shape(x)[0:1], c.dims[1..]))`. Its slices
    /// are known to repeat when it is a constant whose slices are equal, when the export
    /// batch is 1 (the exporter dropped the no-op expand of a parameter), or when an Expand
    /// of an operand with a leading 1 made it.
    fn expand_concat_slices(p: &mut Program, b0: i64) {
        use pipewright_runtime::kernel::Kernel;
        let mut k = p.instrs.len();
        while k > 0 {
            k -= 1;
            let Kernel::Concat { axis } = p.instrs[k].kernel else { continue };
            let ins = p.instrs[k].inputs.clone();
            let rank = ins.first().copied().flatten().map(|s| p.slots[s.index()].shape.len()).unwrap_or(0) as i64;
            if rank < 2 || axis == 0 || axis == -rank {
                continue;
            }
            let Some(batched) = ins.iter().flatten().copied().find(|s| matches!(p.slots[s.index()].shape.first(), Some(Extent::Batch(1)))) else {
                continue;
            };
            // Instructions go in before the Concat, which moves down as they do.
            let mut concat_at = k;
            for (pos, s) in ins.iter().enumerate() {
                let Some(s) = *s else { continue };
                let shape = &p.slots[s.index()].shape;
                if shape.len() < 2 || shape[0] != Extent::Fixed(b0) {
                    continue;
                }
                let fixed: Option<Vec<i64>> = shape.iter().map(|e| if let Extent::Fixed(v) = e { Some(*v) } else { None }).collect();
                let Some(dims) = fixed else { continue };
                let before = p.instrs.len();
                let Some(single) = first_slice(p, s, b0, concat_at) else { continue };
                concat_at += p.instrs.len() - before;
                let expanded = expand_to_batch(p, single, batched, &dims, concat_at);
                concat_at += 3;
                p.instrs[concat_at].inputs[pos] = Some(expanded);
            }
        }
    }

    /// A slot holding the first of `s`'s `b0` equal slices, or `None` when they are not
    /// known to be equal. May insert a Slice instruction at `k`.
    fn first_slice(p: &mut Program, s: SlotId, b0: i64, k: usize) -> Option<SlotId> {
        use pipewright_runtime::kernel::{Kernel, Slice};
        use pipewright_runtime::program::Instr;
        if let Some(st) = p.stored.iter().position(|x| x.slot == s && !x.trainable) {
            let (dims, bytes) = (p.stored[st].dims.clone(), p.stored[st].bytes.clone());
            let slice = bytes.len() / b0.max(1) as usize;
            if slice == 0 || !bytes.chunks(slice).all(|c| c == &bytes[..slice]) {
                return None;
            }
            let (name, elem) = (p.slots[s.index()].name.clone(), p.slots[s.index()].elem);
            let mut one = dims;
            one[0] = 1;
            let single = new_slot(p, &format!("{name}:slice"), elem, one.iter().map(|&d| Extent::Fixed(d)).collect());
            p.stored.push(Stored { slot: single, elem, dims: one, bytes: bytes.slice(..slice), trainable: false, versions: 1, update: UpdateRule::Constant, sync: Vec::new() });
            return Some(single);
        }
        if b0 == 1 {
            return Some(s);
        }
        let producer = p.instrs[..k].iter().rev().find(|i| i.outputs.contains(&Some(s)))?;
        let operand = producer.inputs.first().copied().flatten()?;
        if !matches!(producer.kernel, Kernel::Expand) || p.slots[operand.index()].shape.first() != Some(&Extent::Fixed(1)) {
            return None;
        }
        let (name, elem) = (p.slots[s.index()].name.clone(), p.slots[s.index()].elem);
        let mut shape = p.slots[s.index()].shape.clone();
        shape[0] = Extent::Fixed(1);
        let single = new_slot(p, &format!("{name}:slice"), elem, shape);
        let label = p.instrs[k].name.clone();
        let slice = Kernel::Slice(Slice { attrs: Some((vec![0], vec![1], Some(vec![0]))) });
        p.instrs.insert(k, Instr { name: format!("{label}:slice"), kernel: slice, inputs: vec![Some(s)], outputs: vec![Some(single)], recompute: false });
        Some(single)
    }

    /// Inserts, at `k`, `Expand(single, Concat(Shape(batched)[0:1], dims[1..]))` and
    /// returns its output slot.
    fn expand_to_batch(p: &mut Program, single: SlotId, batched: SlotId, dims: &[i64], k: usize) -> SlotId {
        use pipewright_runtime::kernel::Kernel;
        use pipewright_runtime::program::Instr;
        let (name, elem) = (p.slots[single.index()].name.clone(), p.slots[single.index()].elem);
        let rest = push_i64(p, &format!("{name}:dims"), &dims[1..]);
        let n_slot = new_slot(p, &format!("{name}:batch"), ElemType::I64, vec![Extent::Fixed(1)]);
        let target = new_slot(p, &format!("{name}:target"), ElemType::I64, vec![Extent::Fixed(dims.len() as i64)]);
        let mut shape = vec![Extent::Batch(1)];
        shape.extend(dims[1..].iter().map(|&d| Extent::Fixed(d)));
        let expanded = new_slot(p, &format!("{name}:expanded"), elem, shape);
        let label = p.instrs[k].name.clone();
        let new = [
            Instr { name: format!("{label}:batch"), kernel: Kernel::Shape { start: 0, end: Some(1) }, inputs: vec![Some(batched)], outputs: vec![Some(n_slot)], recompute: false },
            Instr { name: format!("{label}:target"), kernel: Kernel::Concat { axis: 0 }, inputs: vec![Some(n_slot), Some(rest)], outputs: vec![Some(target)], recompute: false },
            Instr { name: format!("{label}:expand"), kernel: Kernel::Expand, inputs: vec![Some(single), Some(target)], outputs: vec![Some(expanded)], recompute: false },
        ];
        for (i, instr) in new.into_iter().enumerate() {
            p.instrs.insert(k + i, instr);
        }
        expanded
    }

    fn new_slot(p: &mut Program, name: &str, elem: ElemType, shape: Vec<Extent>) -> SlotId {
        let slot = SlotId(p.slots.len() as u32);
        p.slots.push(SlotInfo { name: name.to_string(), elem, shape, last_use: None });
        slot
    }

    fn is_const(g: &Graph, v: ValueId) -> bool {
        matches!(&g.value(v).def, ValueDef::Weight(w) if !w.trainable)
    }

    /// Whether `v` is read as the indices of GatherElements/ScatterElements, whose shape
    /// is the result's: an index tensor kept at extent 1 would not broadcast there.
    fn read_as_element_indices(g: &Graph, v: Option<ValueId>) -> bool {
        v.is_some_and(|v| {
            g.consumers(v).iter().any(|(n, slot)| {
                matches!(g.node(*n).op, Op::GatherElements { .. } | Op::ScatterElements { .. } | Op::Scatter { .. }) && *slot == 1
            })
        })
    }

    /// An Expand target with `1` wherever the operand's own extent is the batch, and
    /// where a leading axis of extent 1 was expanded to the export batch (the result then
    /// broadcasts against the batch instead of fixing it).
    fn expand_target(g: &Graph, x: Option<ValueId>, out: &[Dim], b0: i64) -> Option<Vec<i64>> {
        let xs = &g.value(x?).ty.shape.0;
        let off = out.len().checked_sub(xs.len())?;
        let mut t = Vec::with_capacity(out.len());
        let mut changed = false;
        for (i, d) in out.iter().enumerate() {
            t.push(match d {
                Dim::Fixed(v) if i == 0 && *v == b0 && (off > 0 || xs[0] == Dim::Fixed(1)) => {
                    changed = true;
                    1
                }
                Dim::Fixed(v) => *v,
                Dim::Batch(_) if i >= off && xs[i - off] == *d => {
                    changed = true;
                    1
                }
                Dim::Batch(_) => return None,
            });
        }
        changed.then_some(t)
    }

    /// Tile repeats with `1` where a leading axis of extent 1 was repeated to the export
    /// batch (position ids tiled over the batch): like an Expand to the export batch, the
    /// result then broadcasts against the batch.
    fn tile_repeats(g: &Graph, x: Option<ValueId>, repeats: ValueId, b0: i64) -> Option<Vec<i64>> {
        let first = g.value(x?).ty.shape.0.first().copied();
        let ValueDef::Weight(w) = &g.value(repeats).def else { return None };
        let mut reps = w.data.to_i64s();
        (first == Some(Dim::Fixed(1)) && reps.first() == Some(&b0) && b0 != 1).then(|| {
            reps[0] = 1;
            reps
        })
    }

    fn push_i64(p: &mut Program, name: &str, values: &[i64]) -> SlotId {
        let slot = SlotId(p.slots.len() as u32);
        p.slots.push(SlotInfo { name: name.to_string(), elem: ElemType::I64, shape: vec![Extent::Fixed(values.len() as i64)], last_use: None });
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        p.stored.push(Stored { slot, elem: ElemType::I64, dims: vec![values.len() as i64], bytes: bytes.into(), trainable: false, versions: 1, update: UpdateRule::Constant, sync: Vec::new() });
        slot
    }

    /// Constants `[B0, ...]` whose B0 slices are equal and whose readers all broadcast.
    fn shrink_repeated_constants(g: &Graph, p: &mut Program, b0: i64, values: &[ValueId]) {
        let readers_broadcast = |v: ValueId| {
            let c = g.consumers(v);
            !c.is_empty() && c.iter().all(|(n, _)| matches!(g.node(*n).op, Op::Binary(_) | Op::Variadic(_) | Op::Where))
        };
        for s in p.stored.iter_mut() {
            let Some(&v) = values.get(s.slot.index()) else { continue };
            if s.trainable || s.dims.len() < 2 || s.dims[0] != b0 || !readers_broadcast(v) {
                continue;
            }
            let slice = s.bytes.len() / b0 as usize;
            let first = &s.bytes[..slice];
            if s.bytes.chunks(slice).all(|c| c == first) {
                s.bytes = s.bytes.slice(..slice);
                s.dims[0] = 1;
                p.slots[s.slot.index()].shape[0] = Extent::Fixed(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use pipewright_ir::{DType, Graph, ModelMeta, Shape, TensorType, Value, ValueDef};
    use pipewright_runtime::kernel::{BinaryKind, ElemType, Kernel};

    use super::unsigned;

    /// Arithmetic on u16/u32/u64 operands goes through the runtime's unsigned kernels,
    /// told each input's type; data movement and other types keep their plain kernel.
    #[test]
    fn unsigned_operands_select_the_unsigned_kernels() {
        let mut g = Graph::new(ModelMeta::default());
        let mut value = |name: &str, dtype| {
            let ty = TensorType::new(dtype, Shape(vec![pipewright_ir::Dim::Fixed(3)]));
            g.add_value(Value { name: name.into(), ty, def: ValueDef::Input })
        };
        let (a, b, f, i) = (value("a", DType::U64), value("b", DType::U64), value("f", DType::F32), value("i", DType::I64));
        let add = Kernel::Binary(BinaryKind::Add);
        match unsigned(&g, &[Some(a), Some(b)], add.clone()) {
            Kernel::Unsigned { types, kernel } => {
                assert_eq!(types, [Some(ElemType::U64), Some(ElemType::U64)]);
                assert_eq!(*kernel, add);
            }
            other => panic!("u64 Add lowered to {other:?}"),
        }
        let pow = unsigned(&g, &[Some(f), Some(a)], Kernel::Binary(BinaryKind::Pow));
        assert!(matches!(pow, Kernel::Unsigned { .. }), "{pow:?}");
        assert_eq!(unsigned(&g, &[Some(f), Some(f)], add.clone()), add);
        let gather = Kernel::Gather { axis: 0 };
        assert_eq!(unsigned(&g, &[Some(a), Some(i)], gather.clone()), gather);
    }
}
