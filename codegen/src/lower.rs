//! IR graph to runtime [`Program`]: `Op` to `Kernel` one for one, values to slots in the
//! graph's topological order, weights and constants to stored tensors (sharing bytes).

use pipewright_ir::ops as ir;
use pipewright_ir::{DType, Dim, Graph, Op, ValueDef, ValueId};
use pipewright_runtime::kernel as rt;
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo, Stored};
use pipewright_runtime::{ElemType, Kernel};

/// Why a graph could not be lowered.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
}

/// Lowers the whole graph to one program.
pub fn lower_graph(g: &Graph) -> Result<Program, LowerError> {
    let order = g.topo_order().map_err(|n| LowerError::Cycle(g.node(n).name.clone()))?;
    let slot = |v: ValueId| SlotId(v.index() as u32);
    let mut p = Program {
        slots: g.value_ids().map(|v| slot_info(g, v)).collect(),
        inputs: g.inputs().iter().map(|&v| slot(v)).collect(),
        outputs: g.outputs().iter().map(|&v| slot(v)).collect(),
        ..Program::default()
    };
    for v in g.value_ids() {
        if let ValueDef::Weight(w) = &g.value(v).def {
            p.stored.push(Stored {
                slot: slot(v),
                elem: elem(w.data.dtype),
                dims: w.data.dims.clone(),
                bytes: w.data.bytes.clone(),
                trainable: w.trainable,
            });
        }
    }
    for n in order {
        let node = g.node(n);
        p.instrs.push(Instr {
            name: node.name.clone(),
            kernel: kernel(&node.op, node.outputs.len(), node.inputs.len()),
            inputs: node.inputs.iter().map(|v| v.map(slot)).collect(),
            outputs: node.outputs.iter().map(|v| v.map(slot)).collect(),
        });
    }
    Ok(p)
}

fn slot_info(g: &Graph, v: ValueId) -> SlotInfo {
    let val = g.value(v);
    SlotInfo { name: val.name.clone(), elem: elem(val.ty.dtype), shape: val.ty.shape.0.iter().map(|&d| extent(d)).collect() }
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
    }
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
        Op::Gemm(g) => Kernel::Gemm(rt::Gemm { alpha: g.alpha, beta: g.beta, trans_a: g.trans_a, trans_b: g.trans_b }),
        Op::Conv(c) => Kernel::Conv(rt::Conv { window: window(&c.window), group: c.group }),
        Op::ConvTranspose(c) => Kernel::ConvTranspose(rt::ConvTranspose {
            window: window(&c.window),
            group: c.group,
            output_padding: c.output_padding.clone(),
            output_shape: c.output_shape.clone(),
        }),
        Op::MaxPool(p) => Kernel::MaxPool(pool(p)),
        Op::AveragePool(p) => Kernel::AveragePool(pool(p)),
        Op::GlobalAveragePool => Kernel::GlobalAveragePool,
        Op::GlobalMaxPool => Kernel::GlobalMaxPool,
        Op::BatchNormalization(b) => {
            Kernel::BatchNormalization(rt::BatchNorm { epsilon: b.epsilon, momentum: b.momentum, training_mode: b.training_mode })
        }
        Op::LayerNormalization(l) => {
            Kernel::LayerNormalization(rt::LayerNorm { axis: l.axis, epsilon: l.epsilon, stash_type: l.stash_type })
        }
        Op::InstanceNormalization { epsilon } => Kernel::InstanceNormalization { epsilon: *epsilon },
        Op::Dropout { ratio, seed } => Kernel::Dropout { ratio: *ratio, seed: *seed },
        _ => shape_kernel(op, n_out, n_in),
    }
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
        Op::Expand => Kernel::Expand,
        Op::Where => Kernel::Where,
        Op::Cast { to } => Kernel::Cast { to: elem(*to) },
        Op::CastLike => Kernel::CastLike,
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
        Op::CumSum { exclusive, reverse } => Kernel::CumSum { exclusive: *exclusive, reverse: *reverse },
        // Within one program a crossing is the identity; stage modules split here.
        Op::StageBoundary { .. } => Kernel::Unary(rt::UnaryKind::Identity),
        other => unreachable!("{} is lowered by `kernel`", other.name()),
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
        I::Mish => R::Mish,
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
    }
}
