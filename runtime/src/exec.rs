//! Executes [`Kernel`]s on libtorch tensors through `tch` (the `torch` feature).
//!
//! Every kernel is built from differentiable libtorch ops, so running a stage forward with
//! autograd enabled gives its backward pass for free. Kernels never panic on bad inputs:
//! libtorch failures are caught through tch's fallible `f_` functions and reported, with
//! the op's name, as [`KernelError`]s.

mod bits;
mod convert;
mod elementwise;
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
pub use convert::{elem_type, tensor_from_bytes, tensor_to_bytes, tensor_to_bytes_as, torch_kind};

use crate::kernel::Kernel;
use util::{all, need, opt, Fail, R};

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

/// Runs one kernel. `inputs` follow the ONNX input order, `None` for absent optional
/// inputs. Returns every output the op defines, in ONNX order (a node with fewer outputs
/// uses the prefix; see [`Kernel`]).
pub fn run(k: &Kernel, inputs: &[Option<&Tensor>], mode: Mode) -> Result<Vec<Tensor>, KernelError> {
    dispatch(k, inputs, mode, None).map_err(|f| f.into_error(k.name()))
}

/// [`run`] for a node that reads only the outputs marked in `used` (by ONNX output index;
/// missing = unused). Outputs nobody reads may come back as placeholders that carry no
/// gradient, which lets a kernel take a fused path (LayerNormalization whose mean and
/// inverse deviation nobody reads runs libtorch's single layer-norm kernel).
pub fn run_used(k: &Kernel, inputs: &[Option<&Tensor>], mode: Mode, used: &[bool]) -> Result<Vec<Tensor>, KernelError> {
    dispatch(k, inputs, mode, Some(used)).map_err(|f| f.into_error(k.name()))
}

fn one(t: R<Tensor>) -> R<Vec<Tensor>> {
    t.map(|t| vec![t])
}

fn dispatch(k: &Kernel, ins: &[Option<&Tensor>], mode: Mode, outputs_read: Option<&[bool]>) -> R<Vec<Tensor>> {
    use Kernel::*;
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match k {
        Unary(u) => one(elementwise::unary(*u, x()?)),
        Binary(b) => one(elementwise::binary(*b, x()?, y()?)),
        Variadic(v) => one(elementwise::variadic(*v, &all(ins)?)),
        LeakyRelu { alpha } => one(elementwise::leaky_relu(x()?, *alpha)),
        Elu { alpha } => one(elementwise::elu(x()?, *alpha)),
        Celu { alpha } => one(elementwise::celu(x()?, *alpha)),
        Selu { alpha, gamma } => one(elementwise::selu(x()?, *alpha, *gamma)),
        HardSigmoid { alpha, beta } => one(elementwise::hard_sigmoid(x()?, *alpha, *beta)),
        ThresholdedRelu { alpha } => one(elementwise::thresholded_relu(x()?, *alpha)),
        Swish { alpha } => one(elementwise::swish(x()?, *alpha)),
        SwiGlu { alpha } => one(elementwise::swiglu(x()?, y()?, *alpha)),
        Gelu { approximate } => one(elementwise::gelu(x()?, *approximate)),
        Clip { min, max } => one(elementwise::clip(ins, *min, *max)),
        IsInf {
            detect_positive,
            detect_negative,
        } => one(elementwise::is_inf(
            x()?,
            *detect_positive,
            *detect_negative,
        )),
        Where => one(elementwise::where_(x()?, y()?, need(ins, 2)?)),
        Unsigned { types, kernel } => unsigned::run(kernel, types, ins),
        Cast { to, mode } => one(lowp::cast(x()?, *to, *mode)),
        CastLike { mode } => one(convert::elem_of(y()?.f_kind()?).and_then(|to| lowp::cast(x()?, to, *mode))),
        QuantizeLinear(q) => one(quant::quantize(x()?, y()?, opt(ins, 2), q)),
        DequantizeLinear { axis, block_size, to } => one(quant::dequantize(x()?, y()?, opt(ins, 2), *axis, *block_size, *to)),
        DynamicQuantizeLinear => quant::dynamic_quantize(x()?),
        _ => dispatch_nn(k, ins, mode, outputs_read),
    }
}

fn dispatch_nn(k: &Kernel, ins: &[Option<&Tensor>], mode: Mode, outputs_read: Option<&[bool]>) -> R<Vec<Tensor>> {
    use Kernel::*;
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match k {
        Softmax(s) => one(nn::softmax(x()?, s, false)),
        LogSoftmax(s) => one(nn::softmax(x()?, s, true)),
        MatMul => one(Ok(x()?.f_matmul(y()?)?)),
        MatMulInteger => one(qlinear::matmul_integer(ins)),
        QLinearMatMul => one(qlinear::qlinear_matmul(ins)),
        ConvInteger(c) => one(qlinear::conv_integer(c, ins)),
        QLinearConv(c) => one(qlinear::qlinear_conv(c, ins)),
        Gemm(g) => one(nn::gemm(g, x()?, y()?, opt(ins, 2))),
        Conv(c) => one(window::conv(c, x()?, y()?, opt(ins, 2))),
        ConvTranspose(c) => one(window::conv_transpose(c, x()?, y()?, opt(ins, 2))),
        MaxPool(p) => window::max_pool(p, x()?),
        MaxUnpool { kernel_shape, strides, pads } => one(window::max_unpool(x()?, y()?, opt(ins, 2), [kernel_shape, strides, pads])),
        AveragePool(p) => one(window::average_pool(p, x()?)),
        LpPool { pool, p } => one(window::lp_pool(pool, *p, x()?)),
        GlobalAveragePool => one(window::global_pool(x()?, false)),
        GlobalMaxPool => one(window::global_pool(x()?, true)),
        BatchNormalization(b) => nn::batch_norm(b, ins, mode),
        LayerNormalization(l) => {
            let stats_read = outputs_read.map_or(true, |u| u.iter().skip(1).any(|&x| x));
            nn::layer_norm(l, ins, stats_read)
        }
        RmsNormalization(l) => one(transformer::rms_norm(l, x()?, y()?)),
        Attention(a) => transformer::attention(a, ins),
        RotaryEmbedding(r) => one(transformer::rotary_embedding(r, ins)),
        LinearAttention(l) => recurrent::linear_attention(l, ins),
        CausalConvWithState { silu } => recurrent::causal_conv_with_state(*silu, ins),
        Optimizer(o) => training::optimizer_step(o, ins),
        Binarizer { threshold } => one(training::binarizer(*threshold, x()?)),
        ArrayFeatureExtractor => one(training::array_feature_extractor(x()?, y()?)),
        TreeEnsemble(t) => one(training::tree_ensemble(t, x()?)),
        InstanceNormalization { epsilon } => one(nn::instance_norm(*epsilon, ins)),
        NegativeLogLikelihoodLoss(l) => one(loss::nll(l, x()?, y()?, opt(ins, 2))),
        SoftmaxCrossEntropyLoss(l) => loss::softmax_cross_entropy(l, x()?, y()?, opt(ins, 2)),
        Dropout { ratio, .. } => nn::dropout(*ratio, ins, mode),
        _ => dispatch_shape(k, ins),
    }
}

fn dispatch_shape(k: &Kernel, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    use Kernel::*;
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    match k {
        Reshape { allow_zero } => one(shape::reshape(x()?, y()?, *allow_zero)),
        Flatten { axis } => one(shape::flatten(x()?, *axis)),
        Transpose { perm } => one(shape::transpose(x()?, perm.as_ref())),
        Squeeze { axes } => one(shape::squeeze(ins, axes.as_ref())),
        Unsqueeze { axes } => one(shape::unsqueeze(ins, axes.as_ref())),
        Concat { axis } => one(shape::concat(&all(ins)?, *axis)),
        Split(s) => shape::split(s, ins),
        Slice(s) => one(shape::slice(s, ins)),
        Gather { axis } => one(shape::gather(x()?, y()?, *axis)),
        GatherElements { axis } => one(shape::gather_elements(x()?, y()?, *axis)),
        GatherNd { batch_dims } => one(shape::gather_nd(x()?, y()?, *batch_dims)),
        Resize(r) => one(resample::resize(r, ins)),
        Col2Im { dilations, pads, strides } => one(shape::col2im(ins, [dilations, pads, strides])),
        CenterCropPad { axes } => one(shape::center_crop_pad(x()?, y()?, axes.as_deref())),
        AffineGrid { align_corners } => one(resample::affine_grid(x()?, y()?, *align_corners)),
        GridSample { mode, padding, align_corners } => one(resample::grid_sample(x()?, y()?, *mode, *padding, *align_corners)),
        Dft { inverse, onesided, axis } => one(signal::dft(ins, *inverse, *onesided, *axis)),
        Stft { onesided } => one(signal::stft(ins, *onesided)),
        RoiAlign(r) => one(signal::roi_align(r, x()?, y()?, need(ins, 2)?)),
        DeformConv { conv, offset_group } => one(signal::deform_conv(conv, *offset_group, ins)),
        DepthToSpace { blocksize, crd } => one(shape::depth_to_space(x()?, *blocksize, *crd)),
        SpaceToDepth { blocksize, crd } => one(shape::space_to_depth(x()?, *blocksize, *crd)),
        Expand => one(shape::expand(x()?, y()?)),
        Shape { start, end } => one(shape::shape_of(x()?, *start, *end)),
        Size => one(shape::size_of(x()?)),
        ConstantOfShape { value } => one(shape::constant_of_shape(x()?, *value)),
        Range => one(shape::range(x()?, y()?, need(ins, 2)?)),
        Tile => one(shape::tile(x()?, y()?)),
        Trilu { upper } => one(shape::trilu(ins, *upper)),
        Einsum { equation } => one(shape::einsum(equation, &all(ins)?)),
        Pad(p) => one(shape::pad(p, ins)),
        CumSum { exclusive, reverse } => one(shape::cumsum(x()?, y()?, *exclusive, *reverse)),
        _ => dispatch_index(k, ins),
    }
}

fn dispatch_index(k: &Kernel, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    use Kernel::*;
    let x = || need(ins, 0);
    let y = || need(ins, 1);
    let z = || need(ins, 2);
    match k {
        CumProd { exclusive, reverse } => one(index::cumprod(x()?, y()?, *exclusive, *reverse)),
        TopK { axis, largest, .. } => index::top_k(x()?, y()?, *axis, *largest),
        OneHot { axis } => one(index::one_hot(x()?, y()?, z()?, *axis)),
        ScatterNd { reduction } => one(index::scatter_nd(x()?, y()?, z()?, *reduction)),
        ScatterElements { axis, reduction } => one(index::scatter_elements(x()?, y()?, z()?, *axis, *reduction)),
        TensorScatter { axis, circular } => one(index::tensor_scatter(x()?, y()?, opt(ins, 2), *axis, *circular)),
        EyeLike { dtype, k } => one(index::eye_like(x()?, *dtype, *k)),
        ReverseSequence { batch_axis, time_axis } => one(index::reverse_sequence(x()?, y()?, *batch_axis, *time_axis)),
        Hardmax(s) => one(norm::hardmax(x()?, s)),
        LpNormalization { axis, p } => one(norm::lp_normalization(x()?, *axis, *p)),
        Shrink { bias, lambd } => one(norm::shrink(x()?, *bias, *lambd)),
        Lrn(l) => one(norm::lrn(x()?, l)),
        MeanVarianceNormalization { axes } => one(norm::mean_variance_normalization(x()?, axes)),
        GroupNormalization(g) => one(norm::group_normalization(g, ins)),
        Det => one(norm::det(x()?)),
        Rnn(r) => rnn::rnn(r, ins),
        _ => dispatch_reduce(k, ins),
    }
}

fn dispatch_reduce(k: &Kernel, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    use Kernel::*;
    let x = || need(ins, 0);
    match k {
        Reduce(r) => one(reduce::reduce(r, ins)),
        ArgMax {
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
        ArgMin {
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
