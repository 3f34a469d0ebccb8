//! Executes [`Op`]s on libtorch tensors through `tch` (the `torch` feature).
//!
//! Every kernel is built from differentiable libtorch ops, so running a stage forward with
//! autograd enabled gives its backward pass for free. Kernels never panic on bad inputs:
//! libtorch failures are caught through tch's fallible `f_` functions and reported, with
//! the op's name, as [`KernelError`]s.

mod bits;
mod convert;
mod elementwise;
mod host;
mod loss;
mod index;
mod lowp;
mod nn;
mod norm;
mod qlinear;
mod quant;
mod recurrent;
mod reduce;
mod rnn;
mod resample;
mod shape;
mod signal;
mod training;
mod transformer;
mod unsigned;
mod util;
mod window;

use tch::Tensor;

pub use crate::device::{Device, DeviceError};
pub use host::{host_reads, stand_in};
pub use convert::{elem_type, tensor_from_bytes, tensor_to_bytes, tensor_to_bytes_as, torch_kind};

use pipewright_ops::op::ScatterReduction;
use pipewright_ops::{DType, Op};
use util::{all, need, opt, Fail, R};

use crate::program::{Program, SlotId};

/// Training or inference: decides BatchNormalization (batch vs running statistics) and
/// Dropout (random mask vs identity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Train,
    Eval,
}

/// Why a kernel could not run.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: required input {index} is missing")]
    MissingInput { op: &'static str, index: usize },
    #[error("{op}: unsupported attribute value: {detail}")]
    Unsupported { op: &'static str, detail: String },
    #[error("{op}: dtype not supported: {detail}")]
    DType { op: &'static str, detail: String },
    #[error("{op}: invalid input: {detail}")]
    Invalid { op: &'static str, detail: String },
    #[error("{op}: libtorch error: {}", first_line(source))]
    Torch {
        op: &'static str,
        #[source]
        source: tch::TchError,
    },
}

impl Fail {
    pub(crate) fn into_error(self, op: &'static str) -> KernelError {
        match self {
            Fail::Missing(index) => KernelError::MissingInput { op, index },
            Fail::Unsupported(detail) => KernelError::Unsupported { op, detail },
            Fail::DType(detail) => KernelError::DType { op, detail },
            Fail::Invalid(detail) => KernelError::Invalid { op, detail },
            Fail::Torch(source) => KernelError::Torch { op, source },
        }
    }
}

/// libtorch's messages carry a C++ stack trace after the first line; users get the line.
fn first_line(e: &tch::TchError) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or("").trim();
    line.strip_prefix("Internal torch error: ").unwrap_or(line).to_string()
}

/// What an op's kernel may need to know of its node beyond the input tensors: the
/// element types the program declares for the node's inputs and outputs (`None`: an
/// absent operand, or not known). A tensor's kind cannot tell them all: an `i4` value
/// lives in an `i8` tensor and a `u32` one in an `i64` tensor (see `convert`), so the
/// target of a CastLike or a quantization, and the unsigned operands, come from here; an
/// equal Split of an older opset splits into as many parts as the node has outputs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Signature<'a> {
    pub inputs: &'a [Option<DType>],
    pub outputs: &'a [Option<DType>],
}

impl Signature<'_> {
    /// Nothing declared: types come from the tensors alone (direct calls, tests).
    pub const NONE: Signature<'static> = Signature { inputs: &[], outputs: &[] };

    fn output(&self, i: usize) -> Option<DType> {
        self.outputs.get(i).copied().flatten()
    }

    /// An input of an unsigned type libtorch lacks, held in a signed carrier kind.
    fn has_emulated_input(&self) -> bool {
        self.inputs.iter().flatten().any(|t| convert::is_emulated(*t))
    }
}

/// The declared types of every instruction of a program, computed once per program.
#[derive(Clone, Debug, Default)]
pub struct Signatures {
    nodes: Vec<(Vec<Option<DType>>, Vec<Option<DType>>)>,
}

impl Signatures {
    pub fn of(p: &Program) -> Signatures {
        let types = |slots: &[Option<SlotId>]| slots.iter().map(|s| s.map(|s| p.slots[s.index()].elem)).collect();
        Signatures { nodes: p.instrs.iter().map(|i| (types(&i.inputs), types(&i.outputs))).collect() }
    }

    /// Instruction `k`'s signature.
    pub fn get(&self, k: usize) -> Signature<'_> {
        self.nodes.get(k).map_or(Signature::NONE, |(inputs, outputs)| Signature { inputs, outputs })
    }
}

/// Runs one op with nothing declared about its node (see [`Signature::NONE`]). `inputs`
/// follow the ONNX input order, `None` for absent optional inputs. Returns every output
/// the op defines, in ONNX order (a node with fewer outputs uses the prefix; the
/// multi-output ops are Dropout: output, mask; MaxPool: Y, Indices; LayerNormalization:
/// Y, Mean, InvStdDev; BatchNormalization in training: Y, running mean, running var;
/// Attention: Y, present key, present value, scores).
pub fn run(op: &Op, inputs: &[Option<&Tensor>], mode: Mode) -> Result<Vec<Tensor>, KernelError> {
    run_node(op, Signature::NONE, inputs, mode, None)
}

/// Runs one node: its op, told its declared types, for a node that reads only the outputs
/// marked in `used` (by ONNX output index; missing = unused; `None`: all). Outputs nobody
/// reads may come back as placeholders that carry no gradient, which lets a kernel take a
/// fused path (LayerNormalization whose mean and inverse deviation nobody reads runs
/// libtorch's single layer-norm kernel).
pub fn run_node(op: &Op, sig: Signature<'_>, inputs: &[Option<&Tensor>], mode: Mode, used: Option<&[bool]>) -> Result<Vec<Tensor>, KernelError> {
    run_node_with(op, sig, inputs, &[], mode, used)
}

/// [`run_node`] where `host[i]`, when given, holds `inputs[i]`'s values on the host (known
/// before the step): the kernel reads those instead of copying from the device.
///
/// An input the op reads only on the host ([`Op::reads_on_host`]) that has no host copy is
/// copied once here (counted, as the kernel's own read would be) and the kernel is given a
/// [`host::stand_in`] in its place: every caller, the interpreter included, runs kernels
/// that never compute with such an input on the device, so the executor may leave a known
/// one off the device.
pub fn run_node_with(op: &Op, sig: Signature<'_>, inputs: &[Option<&Tensor>], host: &[Option<&Tensor>], mode: Mode, used: Option<&[bool]>) -> Result<Vec<Tensor>, KernelError> {
    let fail = |e: Fail| e.into_error(op.name());
    let (mut args, mut copies): (Vec<Option<Tensor>>, Vec<Option<Tensor>>) = (Vec::new(), Vec::new());
    for (i, t) in inputs.iter().enumerate() {
        let given = host.get(i).copied().flatten();
        match t {
            Some(t) if given.is_none() && op.reads_on_host(i) => {
                copies.push(Some(host::read_to_host(t).map_err(fail)?));
                args.push(Some(host::stand_in(t, t.device()).map_err(|e| fail(e.into()))?));
            }
            _ => {
                copies.push(given.map(Tensor::shallow_clone));
                args.push(t.map(Tensor::shallow_clone));
            }
        }
    }
    let inputs: Vec<Option<&Tensor>> = args.iter().map(Option::as_ref).collect();
    let host: Vec<Option<&Tensor>> = copies.iter().map(Option::as_ref).collect();
    let inputs = inputs.as_slice();
    let result = host::with_host_copies(inputs, &host, || {
        if sig.has_emulated_input() && !moves_data(op) {
            unsigned::run(op, sig.inputs, sig.output(0), inputs)
        } else {
            dispatch(op, sig, inputs, mode, used)
        }
    });
    result.map_err(|f| f.into_error(op.name()))
}

/// Ops that only move or select elements: they run on an unsigned type's carrier kind as
/// they do on any other (the carrier holds the values, or their bits, exactly).
fn moves_data(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. } | Op::Flatten { .. } | Op::Transpose { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Concat { .. }
            | Op::Split(_) | Op::Slice(_) | Op::Gather { .. } | Op::GatherElements { .. } | Op::GatherND { .. } | Op::Expand
            | Op::Shape { .. } | Op::Size | Op::Tile | Op::Where | Op::DepthToSpace { .. } | Op::SpaceToDepth { .. }
            | Op::StageBoundary { .. } | Op::StopGradient | Op::BitCast { .. }
    )
}

fn one(t: R<Tensor>) -> R<Vec<Tensor>> {
    t.map(|t| vec![t])
}

fn dispatch(op: &Op, sig: Signature<'_>, ins: &[Option<&Tensor>], mode: Mode, outputs_read: Option<&[bool]>) -> R<Vec<Tensor>> {
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match op {
        Op::Unary(u) => one(elementwise::unary(*u, x()?)),
        Op::Binary(b) => one(elementwise::binary(*b, x()?, y()?)),
        Op::Variadic(v) => one(elementwise::variadic(*v, &all(ins)?)),
        Op::LeakyRelu { alpha } => one(elementwise::leaky_relu(x()?, *alpha)),
        Op::Elu { alpha } => one(elementwise::elu(x()?, *alpha)),
        Op::Celu { alpha } => one(elementwise::celu(x()?, *alpha)),
        Op::Selu { alpha, gamma } => one(elementwise::selu(x()?, *alpha, *gamma)),
        Op::HardSigmoid { alpha, beta } => one(elementwise::hard_sigmoid(x()?, *alpha, *beta)),
        Op::ThresholdedRelu { alpha } => one(elementwise::thresholded_relu(x()?, *alpha)),
        Op::Swish { alpha } => one(elementwise::swish(x()?, *alpha)),
        Op::SwiGlu { alpha } => one(elementwise::swiglu(x()?, y()?, *alpha)),
        Op::Gelu { approximate } => one(elementwise::gelu(x()?, *approximate)),
        Op::Clip { min, max } => one(elementwise::clip(ins, *min, *max)),
        Op::IsInf { detect_positive, detect_negative } => one(elementwise::is_inf(x()?, *detect_positive, *detect_negative)),
        Op::Where => one(elementwise::where_(x()?, y()?, need(ins, 2)?)),
        Op::Cast { to, mode } => one(lowp::cast(x()?, *to, *mode)),
        Op::BitCast { to } => one(bits::bitcast(x()?, sig.inputs.first().copied().flatten(), *to)),
        // The declared output type: the second input's kind cannot tell `i4` from `i8`.
        Op::CastLike { mode } => {
            let to = match sig.output(0) {
                Some(t) => t,
                None => convert::elem_of(y()?.f_kind()?)?,
            };
            one(lowp::cast(x()?, to, *mode))
        }
        Op::QuantizeLinear(q) => one(quant::quantize(x()?, y()?, opt(ins, 2), q, sig.output(0))),
        Op::DequantizeLinear { axis, block_size, output_dtype } => {
            one(quant::dequantize(x()?, y()?, opt(ins, 2), *axis, *block_size, sig.output(0).or(*output_dtype)))
        }
        Op::DynamicQuantizeLinear => quant::dynamic_quantize(x()?),
        // Within one program a crossing is the identity; stage modules split there.
        Op::StageBoundary { .. } => one(Ok(x()?.shallow_clone())),
        Op::StopGradient => one(Ok(x()?.detach())),
        _ => dispatch_nn(op, sig, ins, mode, outputs_read),
    }
}

/// Whether the node reads any output past the first (a normalization's statistics); with
/// nothing declared, all of them.
fn statistics_read(outputs_read: Option<&[bool]>) -> bool {
    outputs_read.map_or(true, |u| u.iter().skip(1).any(|&x| x))
}

fn dispatch_nn(k: &Op, sig: Signature<'_>, ins: &[Option<&Tensor>], mode: Mode, outputs_read: Option<&[bool]>) -> R<Vec<Tensor>> {
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match k {
        Op::Softmax(s) => one(nn::softmax(x()?, s, false)),
        Op::LogSoftmax(s) => one(nn::softmax(x()?, s, true)),
        Op::MatMul => one(Ok(x()?.f_matmul(y()?)?)),
        Op::MatMulInteger => one(qlinear::matmul_integer(ins)),
        Op::QLinearMatMul => one(qlinear::qlinear_matmul(ins)),
        Op::ConvInteger(c) => one(qlinear::conv_integer(c, ins)),
        Op::QLinearConv(c) => one(qlinear::qlinear_conv(c, ins)),
        Op::Gemm(g) => one(nn::gemm(g, x()?, y()?, opt(ins, 2))),
        Op::Conv(c) => one(window::conv(c, x()?, y()?, opt(ins, 2))),
        Op::ConvTranspose(c) => one(window::conv_transpose(c, x()?, y()?, opt(ins, 2))),
        Op::MaxPool(p) => window::max_pool(p, x()?),
        Op::MaxUnpool { kernel_shape, strides, pads } => one(window::max_unpool(x()?, y()?, opt(ins, 2), [kernel_shape, strides, pads])),
        Op::AveragePool(p) => one(window::average_pool(p, x()?)),
        Op::LpPool { pool, p } => one(window::lp_pool(pool, *p, x()?)),
        Op::GlobalAveragePool => one(window::global_pool(x()?, false)),
        Op::GlobalMaxPool => one(window::global_pool(x()?, true)),
        Op::BatchNormalization(b) => nn::batch_norm(b, ins, mode, statistics_read(outputs_read)),
        Op::LayerNormalization(l) => nn::layer_norm(l, ins, statistics_read(outputs_read)),
        Op::RMSNormalization(l) => one(transformer::rms_norm(l, x()?, y()?)),
        Op::Attention(a) => {
            let scores_read = outputs_read.map_or(true, |u| u.get(3).copied().unwrap_or(false));
            transformer::attention(a, ins, scores_read)
        }
        Op::RotaryEmbedding(r) => one(transformer::rotary_embedding(r, ins)),
        Op::LinearAttention(l) => recurrent::linear_attention(l, ins),
        Op::CausalConvWithState { silu } => recurrent::causal_conv_with_state(*silu, ins),
        Op::Optimizer(o) => training::optimizer_step(o, ins),
        Op::Binarizer { threshold } => one(training::binarizer(*threshold, x()?)),
        Op::ArrayFeatureExtractor => one(training::array_feature_extractor(x()?, y()?)),
        Op::TreeEnsemble(t) => one(training::tree_ensemble(t, x()?)),
        Op::InstanceNormalization { epsilon } => one(nn::instance_norm(*epsilon, ins)),
        Op::NegativeLogLikelihoodLoss(l) => one(loss::nll(l, x()?, y()?, opt(ins, 2))),
        Op::SoftmaxCrossEntropyLoss(l) => loss::softmax_cross_entropy(l, x()?, y()?, opt(ins, 2)),
        Op::Dropout { ratio, .. } => nn::dropout(*ratio, ins, mode),
        _ => dispatch_shape(k, sig, ins),
    }
}

fn dispatch_shape(k: &Op, sig: Signature<'_>, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match k {
        Op::Reshape { allow_zero } => one(shape::reshape(x()?, y()?, *allow_zero)),
        Op::Flatten { axis } => one(shape::flatten(x()?, *axis)),
        Op::Transpose { perm } => one(shape::transpose(x()?, perm.as_ref())),
        Op::Squeeze { axes } => one(shape::squeeze(ins, axes.as_ref())),
        Op::Unsqueeze { axes } => one(shape::unsqueeze(ins, axes.as_ref())),
        Op::Concat { axis } => one(shape::concat(&all(ins)?, *axis)),
        Op::Split(s) => shape::split(s, sig.outputs.len(), ins),
        Op::Slice(s) => one(shape::slice(s, ins)),
        Op::Gather { axis } => one(shape::gather(x()?, y()?, *axis)),
        Op::GatherElements { axis } => one(shape::gather_elements(x()?, y()?, *axis)),
        Op::GatherND { batch_dims } => one(shape::gather_nd(x()?, y()?, *batch_dims)),
        Op::Resize(r) | Op::Upsample(r) => one(resample::resize(r, ins)),
        Op::Col2Im { dilations, pads, strides } => one(shape::col2im(ins, [dilations, pads, strides])),
        Op::CenterCropPad { axes } => one(shape::center_crop_pad(x()?, y()?, axes.as_deref())),
        Op::AffineGrid { align_corners } => one(resample::affine_grid(x()?, y()?, *align_corners)),
        Op::GridSample { mode, padding, align_corners, .. } => one(resample::grid_sample(x()?, y()?, *mode, *padding, *align_corners)),
        Op::Dft { inverse, onesided, axis } => one(signal::dft(ins, *inverse, *onesided, *axis)),
        Op::Stft { onesided } => one(signal::stft(ins, *onesided)),
        Op::RoiAlign(r) => one(signal::roi_align(r, x()?, y()?, need(ins, 2)?)),
        Op::DeformConv { conv, offset_group } => one(signal::deform_conv(conv, *offset_group, ins)),
        Op::DepthToSpace { blocksize, crd } => one(shape::depth_to_space(x()?, *blocksize, *crd)),
        Op::SpaceToDepth { blocksize, crd } => one(shape::space_to_depth(x()?, *blocksize, *crd)),
        Op::Expand => one(shape::expand(x()?, y()?)),
        Op::Shape { start, end } => one(shape::shape_of(x()?, *start, *end)),
        Op::Size => one(shape::size_of(x()?)),
        Op::ConstantOfShape { value } => one(shape::constant_of_shape(x()?, value.as_ref())),
        Op::Range => one(shape::range(x()?, y()?, need(ins, 2)?)),
        Op::Tile => one(shape::tile(x()?, y()?)),
        Op::Trilu { upper } => one(shape::trilu(ins, *upper)),
        Op::Einsum { equation } => one(shape::einsum(equation, &all(ins)?)),
        Op::Pad(p) => one(shape::pad(p, ins)),
        Op::CumSum { exclusive, reverse } => one(shape::cumsum(x()?, y()?, *exclusive, *reverse)),
        _ => dispatch_index(k, ins),
    }
}

fn dispatch_index(k: &Op, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    let z = || need(ins, 2);
    match k {
        Op::CumProd { exclusive, reverse } => one(index::cumprod(x()?, y()?, *exclusive, *reverse)),
        Op::TopK { axis, largest, .. } => index::top_k(x()?, y()?, *axis, *largest),
        Op::OneHot { axis } => one(index::one_hot(x()?, y()?, z()?, *axis)),
        Op::ScatterND { reduction } => one(index::scatter_nd(x()?, y()?, z()?, *reduction)),
        Op::ScatterElements { axis, reduction } => one(index::scatter_elements(x()?, y()?, z()?, *axis, *reduction)),
        Op::Scatter { axis } => one(index::scatter_elements(x()?, y()?, z()?, *axis, ScatterReduction::None)),
        Op::TensorScatter { axis, circular } => one(index::tensor_scatter(x()?, y()?, opt(ins, 2), *axis, *circular)),
        Op::EyeLike { dtype, k } => one(index::eye_like(x()?, *dtype, *k)),
        Op::ReverseSequence { batch_axis, time_axis } => one(index::reverse_sequence(x()?, y()?, *batch_axis, *time_axis)),
        Op::Hardmax(s) => one(norm::hardmax(x()?, s)),
        Op::LpNormalization { axis, p } => one(norm::lp_normalization(x()?, *axis, *p)),
        Op::Shrink { bias, lambd } => one(norm::shrink(x()?, *bias, *lambd)),
        Op::Lrn(l) => one(norm::lrn(x()?, l)),
        Op::MeanVarianceNormalization { axes } => one(norm::mean_variance_normalization(x()?, axes)),
        Op::GroupNormalization(g) => one(norm::group_normalization(g, ins)),
        Op::Det => one(norm::det(x()?)),
        Op::Rnn(r) => rnn::rnn(r, ins),
        _ => dispatch_reduce(k, ins),
    }
}

fn dispatch_reduce(k: &Op, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let x = || need(ins, 0);
    match k {
        Op::Reduce(r) => one(reduce::reduce(r, ins)),
        Op::ArgMax {
            axis,
            keepdims,
            select_last_index,
        } => one(reduce::arg(
            x()?,
            *axis,
            *keepdims,
            *select_last_index,
            true,
        )),
        Op::ArgMin {
            axis,
            keepdims,
            select_last_index,
        } => one(reduce::arg(
            x()?,
            *axis,
            *keepdims,
            *select_last_index,
            false,
        )),
        other => Err(Fail::Unsupported(format!(
            "internal: no kernel for {}",
            other.name()
        ))),
    }
}
