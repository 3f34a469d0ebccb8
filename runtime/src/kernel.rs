//! The closed set of kernels the runtime executes, as plain serialisable data.
//!
//! [`Kernel`] mirrors the IR's `Op` one for one, with the same attribute meanings, but owns
//! its own types so the runtime never depends on the IR: codegen lowers each `Op` to a
//! `Kernel` and writes it into the stage module. Where an ONNX opset moved an attribute to
//! an input (Squeeze/Unsqueeze axes, Split sizes, Slice bounds, Clip bounds, Pad pads,
//! Reduce axes, Dropout ratio), the field is `Some` for the attribute form and `None` when
//! the value comes from the node's input.
//!
//! This module builds without libtorch (`--no-default-features`).

use serde::{Deserialize, Serialize};

/// Element types of runtime tensors (the IR's `DType`). The low-precision types after
/// `Bool` live in tensors of their [`ElemType::holder`] type (see `exec::lowp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ElemType {
    F32, F16, Bf16, F64, I64, I32, I16, I8, U8, U16, U32, U64, Bool,
    F8E4M3FN, F8E4M3FNUZ, F8E5M2, F8E5M2FNUZ, U4, I4, F4E2M1, F8E8M0, U2, I2,
}

impl ElemType {
    /// Bytes per element in the raw little-endian encoding (one for the packed 4- and 2-bit
    /// types, whose raw length is [`ElemType::byte_len`]).
    pub fn size_bytes(self) -> usize {
        use ElemType::*;
        match self {
            F64 | I64 | U64 => 8,
            F32 | I32 | U32 => 4,
            F16 | Bf16 | I16 | U16 => 2,
            I8 | U8 | Bool | F8E4M3FN | F8E4M3FNUZ | F8E5M2 | F8E5M2FNUZ | F8E8M0 => 1,
            U4 | I4 | F4E2M1 | U2 | I2 => 1,
        }
    }

    /// Elements per byte in raw data: 2 for the 4-bit types, 4 for the 2-bit ones, else 1.
    pub fn per_byte(self) -> usize {
        use ElemType::*;
        match self {
            U4 | I4 | F4E2M1 => 2,
            U2 | I2 => 4,
            _ => 1,
        }
    }

    /// Raw bytes of `numel` elements (packed types round the last byte up).
    pub fn byte_len(self, numel: usize) -> Option<usize> {
        match self.per_byte() {
            1 => numel.checked_mul(self.size_bytes()),
            k => Some(numel.div_ceil(k)),
        }
    }

    /// The type whose tensors hold this type's values exactly: i8 for `i4`/`i2`, u8 for
    /// `u4`/`u2`, f32 for `f4e2m1`/`f8e8m0`; every other type holds itself.
    pub fn holder(self) -> ElemType {
        use ElemType::*;
        match self {
            I4 | I2 => I8,
            U4 | U2 => U8,
            F4E2M1 | F8E8M0 => F32,
            t => t,
        }
    }

    /// The lowercase name (`f32`, `bool`, ...).
    pub fn name(self) -> &'static str {
        use ElemType::*;
        match self {
            F32 => "f32", F16 => "f16", Bf16 => "bf16", F64 => "f64", I64 => "i64",
            I32 => "i32", I16 => "i16", I8 => "i8", U8 => "u8", U16 => "u16", U32 => "u32",
            U64 => "u64", Bool => "bool", F8E4M3FN => "f8e4m3fn", F8E4M3FNUZ => "f8e4m3fnuz",
            F8E5M2 => "f8e5m2", F8E5M2FNUZ => "f8e5m2fnuz", U4 => "u4", I4 => "i4",
            F4E2M1 => "f4e2m1", F8E8M0 => "f8e8m0", U2 => "u2", I2 => "i2",
        }
    }

    /// Parses the name printed by [`ElemType::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        use ElemType::*;
        [F32, F16, Bf16, F64, I64, I32, I16, I8, U8, U16, U32, U64, Bool, F8E4M3FN, F8E4M3FNUZ, F8E5M2, F8E5M2FNUZ, U4, I4, F4E2M1, F8E8M0, U2, I2]
            .into_iter()
            .find(|e| e.name() == name)
    }

    /// Floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, ElemType::F32 | ElemType::F16 | ElemType::Bf16 | ElemType::F64)
    }
}

impl std::fmt::Display for ElemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// ONNX `round_mode` of casts to `f8e8m0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RoundMode {
    Up, Down, Nearest,
}

/// How a cast rounds into the low-precision floats (ONNX `saturate`, `round_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CastMode {
    pub saturate: bool,
    pub round: RoundMode,
}

impl Default for CastMode {
    /// ONNX's defaults: saturate, round up.
    fn default() -> Self {
        CastMode { saturate: true, round: RoundMode::Up }
    }
}

/// QuantizeLinear's attributes, `to` resolved from the zero point's type at lowering
/// (`None`: the zero point's holder type, u8 without one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quantize {
    pub to: Option<ElemType>,
    pub axis: i64,
    pub block_size: i64,
    pub saturate: bool,
    pub precision: Option<ElemType>,
}

/// Elementwise kernels with one input and no attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryKind {
    Abs, Neg, Sqrt, Reciprocal, Exp, Log, Erf, Tanh, Sigmoid, Relu, Not, IsNaN, Floor, Ceil,
    Round, Sign, Sin, Cos, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh, Softplus,
    Softsign, Identity, HardSwish, Mish,
    /// `BitwiseNot` (integers).
    BitNot,
}

/// Elementwise kernels with two inputs and numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryKind {
    Add, Sub, Mul, Div, Pow, Equal, Less, Greater, LessOrEqual, GreaterOrEqual, And, Or, Xor,
    /// ONNX `Mod` with `fmod = 0`: the result takes the divisor's sign.
    Mod,
    /// ONNX `Mod` with `fmod = 1`: C `fmod`, the result takes the dividend's sign.
    Fmod,
    PRelu,
    /// `BitwiseAnd`, `BitwiseOr`, `BitwiseXor` (integers).
    BitAnd, BitOr, BitXor,
    /// `BitShift` (opset 28 semantics for shifts outside `0..bits`).
    ShiftLeft, ShiftRight,
}

/// Elementwise kernels over any number of broadcast inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum VariadicKind {
    Sum, Max, Min, Mean,
}

/// Reductions sharing the `axes`/`keepdims` interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceKind {
    Sum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare,
}

/// ONNX `auto_pad`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AutoPad {
    #[default]
    NotSet,
    SameUpper,
    SameLower,
    Valid,
}

/// ONNX `Pad` modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PadMode {
    Constant, Reflect, Edge, Wrap,
}

/// How ScatterND/ScatterElements combine an update with the element it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScatterReduction {
    None, Add, Mul, Max, Min,
}

/// ONNX `Gelu` `approximate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GeluApprox {
    None, Tanh,
}

/// Window geometry shared by Conv, ConvTranspose and the pools. Empty vectors mean the ONNX
/// default for the input's spatial rank (ones for strides/dilations, zeros for pads; the
/// kernel shape of a convolution then comes from its weight).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub kernel_shape: Vec<i64>,
    pub strides: Vec<i64>,
    /// `[x1_begin, x2_begin, ..., x1_end, x2_end, ...]`.
    pub pads: Vec<i64>,
    pub dilations: Vec<i64>,
    pub auto_pad: AutoPad,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Conv {
    pub window: Window,
    pub group: i64,
}

/// ONNX `RoiAlign` (see the IR's `RoiAlign`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoiAlign {
    pub max: bool,
    pub output_height: i64,
    pub output_width: i64,
    pub sampling_ratio: i64,
    pub spatial_scale: f32,
    pub half_pixel: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConvTranspose {
    pub window: Window,
    pub group: i64,
    pub output_padding: Vec<i64>,
    /// Spatial output shape; when non-empty the pads are derived from it.
    pub output_shape: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    pub window: Window,
    pub ceil_mode: bool,
    /// AveragePool only.
    pub count_include_pad: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gemm {
    pub alpha: f32,
    pub beta: f32,
    pub trans_a: bool,
    pub trans_b: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchNorm {
    pub epsilon: f32,
    /// ONNX convention: `running = running * momentum + batch * (1 - momentum)`.
    pub momentum: f32,
    /// The exported mode; the runtime's train/eval mode decides what runs.
    pub training_mode: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerNorm {
    pub axis: i64,
    pub epsilon: f32,
    /// 1: compute the statistics in f32 (for f16/bf16 inputs).
    pub stash_type: i64,
}

/// Attention (opsets 23-25); see the IR's `Attention` for the fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    pub is_causal: bool,
    /// Head counts of 3-D `[batch, seq, heads * head_size]` inputs.
    pub q_num_heads: Option<i64>,
    pub kv_num_heads: Option<i64>,
    /// Output 3: 0 raw scores, 1 after softcap, 2 with the mask, 3 the softmax.
    pub qk_matmul_output_mode: i64,
    /// `None`: `1 / sqrt(head_size)`.
    pub scale: Option<f32>,
    /// `0`: none.
    pub softcap: f32,
    pub softmax_precision: Option<ElemType>,
    /// Sliding window bounds around each query's absolute position; `-1` unbounded.
    pub left_window_size: i64,
    pub right_window_size: i64,
}

/// RotaryEmbedding (opset 23).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rotary {
    pub interleaved: bool,
    /// `0`: the whole head.
    pub rotary_embedding_dim: i64,
    pub num_heads: Option<i64>,
}

/// LinearAttention (opset 27); `gated`/`delta` are the update rule's decay gate and
/// delta correction (see the IR's `LinearRule`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearAttention {
    pub q_num_heads: i64,
    pub kv_num_heads: i64,
    /// `0`: `1 / sqrt(d_k)`.
    pub scale: f32,
    pub gated: bool,
    pub delta: bool,
}

/// A training-domain optimizer step; see the IR's `Optimizer` (inputs R, T, then blocks
/// of X, G and the states; outputs the new X and states).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    Adagrad { decay_factor: f32, epsilon: f32, norm_coefficient: f32 },
    Adam { alpha: f32, beta: f32, epsilon: f32, norm_coefficient: f32, norm_coefficient_post: f32 },
    Momentum { alpha: f32, beta: f32, norm_coefficient: f32, nesterov: bool },
}

/// TreeEnsemble (`ai.onnx.ml` 5) with its tables resolved: per node the comparison and
/// where each branch goes (`(is_leaf, index)`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TreeEnsemble {
    pub nodes: Vec<TreeNode>,
    pub leaf_targets: Vec<i64>,
    pub leaf_weights: Vec<f64>,
    pub roots: Vec<i64>,
    pub n_targets: i64,
    /// 0 average, 1 sum, 2 min, 3 max.
    pub aggregate: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TreeNode {
    pub feature: i64,
    /// 0 `<=`, 1 `<`, 2 `>=`, 3 `>`, 4 `==`, 5 `!=`, 6 member of `members`.
    pub mode: i64,
    pub split: f64,
    pub members: Vec<f64>,
    pub missing_true: bool,
    pub on_true: (bool, i64),
    pub on_false: (bool, i64),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Softmax {
    pub axis: i64,
    /// Opsets < 13: the input is coerced to 2-D at `axis` and normalised over the trailing block.
    pub coerce_2d: bool,
}

/// LRN: `y = x / (bias + alpha / size * sum_window(x^2))^beta` over `size` channels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Lrn {
    pub alpha: f32,
    pub beta: f32,
    pub bias: f32,
    pub size: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupNorm {
    pub epsilon: f32,
    pub num_groups: i64,
    /// 1: compute the statistics in f32 (for f16/bf16 inputs).
    pub stash_type: i64,
    /// Scale and bias per channel (opset 21) or per group (opset 18).
    pub per_channel: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RnnCell {
    Rnn, Gru, Lstm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RnnDirection {
    Forward, Reverse, Bidirectional,
}

/// RNN/GRU/LSTM with the default activations. Inputs in ONNX order (X, W, R, B,
/// sequence_lens, initial_h, and for LSTM initial_c, P); outputs Y, Y_h (and Y_c).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rnn {
    pub cell: RnnCell,
    pub hidden_size: i64,
    pub direction: RnnDirection,
    /// `layout = 1`: X, Y and the states are batch-major.
    pub batch_major: bool,
    /// Bounds the gates' pre-activations to `[-clip, clip]`.
    pub clip: Option<f32>,
    /// GRU: the reset gate multiplies the recurrent projection (with its bias).
    pub linear_before_reset: bool,
}

/// `(starts, ends, axes)` of the Slice attribute form.
pub type SliceAttrs = (Vec<i64>, Vec<i64>, Option<Vec<i64>>);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slice {
    /// Opsets < 10 carry the bounds as attributes; `None`: inputs 1..=4.
    pub attrs: Option<SliceAttrs>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Split {
    pub axis: i64,
    /// Sizes from the attribute (opsets < 13); `None` means input 1 or equal parts.
    pub split: Option<Vec<i64>>,
    /// The opset-18 attribute. For an equal split in older opsets (no sizes anywhere) the
    /// lowering must set it to the node's output count: the kernel cannot see the node.
    pub num_outputs: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reduce {
    pub kind: ReduceKind,
    /// From the attribute (older opsets); `None` means input 1 (or all axes when absent).
    pub axes: Option<Vec<i64>>,
    pub keepdims: bool,
    pub noop_with_empty_axes: bool,
}

/// `reduction` of the loss kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LossReduction {
    None, Sum, Mean,
}

/// NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss attributes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassLoss {
    pub reduction: LossReduction,
    /// Targets equal to it count neither in the loss nor in the mean's denominator.
    pub ignore_index: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pad {
    pub mode: PadMode,
    /// Opsets < 11: pads and value as attributes; `None`: inputs 1..=3.
    pub attrs: Option<(Vec<i64>, f32)>,
}

/// ONNX `Resize` modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResizeMode {
    Nearest, Linear, Cubic,
}

/// ONNX `Resize` `coordinate_transformation_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CoordMode {
    HalfPixel, HalfPixelSymmetric, PytorchHalfPixel, AlignCorners, Asymmetric, TfCropAndResize,
}

/// ONNX `Resize` `nearest_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NearestMode {
    RoundPreferFloor, RoundPreferCeil, Floor, Ceil,
}

/// ONNX `Resize` `keep_aspect_ratio_policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AspectPolicy {
    Stretch, NotLarger, NotSmaller,
}

/// ONNX `GridSample` `padding_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GridPadding {
    Zeros, Border, Reflection,
}

/// Resize and Upsample. Inputs: X, roi, scales, sizes; `legacy` (opset-10 Resize,
/// Upsample): X, scales.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Resize {
    pub mode: ResizeMode,
    pub coord: CoordMode,
    pub nearest: NearestMode,
    pub aspect: AspectPolicy,
    pub cubic_a: f32,
    pub exclude_outside: bool,
    pub extrapolation: f32,
    pub antialias: bool,
    pub axes: Option<Vec<i64>>,
    pub legacy: bool,
}

/// One kernel with its typed attributes: the runtime twin of the IR's `Op`.
///
/// Multi-output kernels produce every output ONNX defines, in ONNX order (Dropout: output,
/// mask; MaxPool: Y, Indices; LayerNormalization: Y, Mean, InvStdDev; BatchNormalization in
/// training: Y, running mean, running var; Attention: Y, present key, present value, scores);
/// a node with fewer outputs uses the prefix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Kernel {
    Unary(UnaryKind),
    Binary(BinaryKind),
    Variadic(VariadicKind),
    LeakyRelu { alpha: f32 },
    Elu { alpha: f32 },
    Celu { alpha: f32 },
    Selu { alpha: f32, gamma: f32 },
    HardSigmoid { alpha: f32, beta: f32 },
    ThresholdedRelu { alpha: f32 },
    Swish { alpha: f32 },
    /// `Swish_alpha(A) * B`, inputs of one shape.
    SwiGlu { alpha: f32 },
    Gelu { approximate: GeluApprox },
    /// Bounds from attributes in opsets < 11 (`None` = unbounded); inputs 1 and 2 afterwards
    /// (then both fields are `None`).
    Clip { min: Option<f32>, max: Option<f32> },
    IsInf { detect_positive: bool, detect_negative: bool },
    Softmax(Softmax),
    LogSoftmax(Softmax),
    MatMul,
    /// Inputs A, B, a_zero_point, b_zero_point; int32 output.
    MatMulInteger,
    /// Inputs a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point.
    QLinearMatMul,
    Gemm(Gemm),
    Conv(Conv),
    ConvTranspose(ConvTranspose),
    /// Inputs X, W, x_zero_point, w_zero_point; int32 output.
    ConvInteger(Conv),
    /// Inputs x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B.
    QLinearConv(Conv),
    MaxPool(Pool),
    /// Inputs X, I (flat output offsets), optional output_shape.
    MaxUnpool { kernel_shape: Vec<i64>, strides: Vec<i64>, pads: Vec<i64> },
    AveragePool(Pool),
    GlobalAveragePool,
    GlobalMaxPool,
    BatchNormalization(BatchNorm),
    LayerNormalization(LayerNorm),
    /// The same attributes as LayerNormalization; `stash_type` widens narrow inputs.
    RmsNormalization(LayerNorm),
    Attention(Attention),
    RotaryEmbedding(Rotary),
    LinearAttention(LinearAttention),
    /// Causal depthwise 1-D convolution with a carried state; outputs Y and the new state.
    CausalConvWithState { silu: bool },
    Optimizer(Optimizer),
    Binarizer { threshold: f32 },
    ArrayFeatureExtractor,
    TreeEnsemble(Box<TreeEnsemble>),
    InstanceNormalization { epsilon: f32 },
    /// Log-probabilities `[N, C, d...]`, class ids `[N, d...]`, optional class weights.
    NegativeLogLikelihoodLoss(ClassLoss),
    /// Scores, class ids, optional class weights; outputs: the loss, the log-probabilities.
    SoftmaxCrossEntropyLoss(ClassLoss),
    /// `ratio` is the attribute of opsets < 12; afterwards input 1 (default 0.5).
    Dropout { ratio: Option<f32>, seed: Option<i64> },
    Reshape { allow_zero: bool },
    Flatten { axis: i64 },
    Transpose { perm: Option<Vec<i64>> },
    Squeeze { axes: Option<Vec<i64>> },
    Unsqueeze { axes: Option<Vec<i64>> },
    Concat { axis: i64 },
    Split(Split),
    Slice(Slice),
    Gather { axis: i64 },
    GatherElements { axis: i64 },
    GatherNd { batch_dims: i64 },
    Resize(Resize),
    LpPool { pool: Pool, p: i64 },
    DepthToSpace { blocksize: i64, crd: bool },
    GridSample { mode: ResizeMode, padding: GridPadding, align_corners: bool },
    /// `axis`: the opset-17 attribute; otherwise input 2 (default -2).
    Dft { inverse: bool, onesided: bool, axis: Option<i64> },
    Stft { onesided: bool },
    RoiAlign(RoiAlign),
    DeformConv { conv: Conv, offset_group: i64 },
    AffineGrid { align_corners: bool },
    Col2Im { dilations: Vec<i64>, pads: Vec<i64>, strides: Vec<i64> },
    CenterCropPad { axes: Option<Vec<i64>> },
    SpaceToDepth { blocksize: i64, crd: bool },
    Expand,
    Where,
    Cast { to: ElemType, mode: CastMode },
    /// Casts to the second input's type; lowering turns CastLike into `Cast` where the
    /// target is known (a tensor's kind cannot tell `i4` from `i8`).
    CastLike { mode: CastMode },
    QuantizeLinear(Quantize),
    DequantizeLinear { axis: i64, block_size: i64, to: Option<ElemType> },
    DynamicQuantizeLinear,
    Shape { start: i64, end: Option<i64> },
    Size,
    /// The `value` attribute as `(dtype, value)`; `None` = f32 zero.
    ConstantOfShape { value: Option<(ElemType, f64)> },
    Range,
    Reduce(Reduce),
    ArgMax { axis: i64, keepdims: bool, select_last_index: bool },
    ArgMin { axis: i64, keepdims: bool, select_last_index: bool },
    Trilu { upper: bool },
    Einsum { equation: String },
    Pad(Pad),
    Tile,
    CumSum { exclusive: bool, reverse: bool },
    CumProd { exclusive: bool, reverse: bool },
    /// Outputs: values, indices (i64).
    TopK { axis: i64, largest: bool, sorted: bool },
    OneHot { axis: i64 },
    ScatterNd { reduction: ScatterReduction },
    /// Also ONNX's deprecated `Scatter` (with no reduction).
    ScatterElements { axis: i64, reduction: ScatterReduction },
    /// Inputs past_cache, update, optional write_indices (per batch row).
    TensorScatter { axis: i64, circular: bool },
    Hardmax(Softmax),
    LpNormalization { axis: i64, p: i64 },
    Shrink { bias: f32, lambd: f32 },
    Lrn(Lrn),
    MeanVarianceNormalization { axes: Vec<i64> },
    /// `None`: the input's element type.
    EyeLike { dtype: Option<ElemType>, k: i64 },
    GroupNormalization(GroupNorm),
    ReverseSequence { batch_axis: i64, time_axis: i64 },
    Det,
    Rnn(Rnn),
    /// `kernel` on operands of an unsigned type libtorch lacks (u16, u32, u64), which
    /// the runtime holds in a wider or same-width signed kind (see `exec::convert`).
    /// `types` gives each input's element type (`None` where absent), so the kernel can
    /// make the operations whose result depends on signedness exact (`exec::unsigned`).
    Unsigned { types: Vec<Option<ElemType>>, kernel: Box<Kernel> },
}

impl Kernel {
    /// Reshape-like kernels whose output shares its input's storage: they add no
    /// activation memory (the same rule as the planner's cost model).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Kernel::Reshape { .. } | Kernel::Flatten { .. } | Kernel::Squeeze { .. } | Kernel::Unsqueeze { .. } | Kernel::Unary(UnaryKind::Identity)
        )
    }

    /// The ONNX op type this kernel implements (for error messages).
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Unary(u) => unary_name(*u),
            Kernel::Binary(b) => binary_name(*b),
            Kernel::Variadic(v) => variadic_name(*v),
            Kernel::Reduce(r) => reduce_name(r.kind),
            Kernel::Unsigned { kernel, .. } => kernel.name(),
            other => plain_name(other),
        }
    }
}

fn plain_name(k: &Kernel) -> &'static str {
    use Kernel::*;
    match k {
        LeakyRelu { .. } => "LeakyRelu", Elu { .. } => "Elu", Celu { .. } => "Celu",
        Selu { .. } => "Selu", HardSigmoid { .. } => "HardSigmoid",
        ThresholdedRelu { .. } => "ThresholdedRelu", Swish { .. } => "Swish", SwiGlu { .. } => "SwiGLU", Gelu { .. } => "Gelu", Clip { .. } => "Clip",
        IsInf { .. } => "IsInf", Softmax(_) => "Softmax", LogSoftmax(_) => "LogSoftmax",
        MatMul => "MatMul", Gemm(_) => "Gemm", Conv(_) => "Conv", ConvTranspose(_) => "ConvTranspose",
        MatMulInteger => "MatMulInteger", QLinearMatMul => "QLinearMatMul", ConvInteger(_) => "ConvInteger",
        QLinearConv(_) => "QLinearConv", MaxUnpool { .. } => "MaxUnpool", TensorScatter { .. } => "TensorScatter",
        MaxPool(_) => "MaxPool", AveragePool(_) => "AveragePool",
        GlobalAveragePool => "GlobalAveragePool", GlobalMaxPool => "GlobalMaxPool",
        BatchNormalization(_) => "BatchNormalization", LayerNormalization(_) => "LayerNormalization",
        RmsNormalization(_) => "RMSNormalization", Attention(_) => "Attention", RotaryEmbedding(_) => "RotaryEmbedding",
        LinearAttention(_) => "LinearAttention", CausalConvWithState { .. } => "CausalConvWithState",
        Optimizer(self::Optimizer::Adagrad { .. }) => "Adagrad", Optimizer(self::Optimizer::Adam { .. }) => "Adam",
        Optimizer(self::Optimizer::Momentum { .. }) => "Momentum",
        Binarizer { .. } => "Binarizer", ArrayFeatureExtractor => "ArrayFeatureExtractor", TreeEnsemble(_) => "TreeEnsemble",
        InstanceNormalization { .. } => "InstanceNormalization", Dropout { .. } => "Dropout",
        NegativeLogLikelihoodLoss(_) => "NegativeLogLikelihoodLoss", SoftmaxCrossEntropyLoss(_) => "SoftmaxCrossEntropyLoss",
        Reshape { .. } => "Reshape", Flatten { .. } => "Flatten", Transpose { .. } => "Transpose",
        Squeeze { .. } => "Squeeze", Unsqueeze { .. } => "Unsqueeze", Concat { .. } => "Concat",
        Split(_) => "Split", Slice(_) => "Slice", Gather { .. } => "Gather",
        GatherElements { .. } => "GatherElements", GatherNd { .. } => "GatherND", Resize(_) => "Resize", LpPool { .. } => "LpPool",
        DepthToSpace { .. } => "DepthToSpace", GridSample { .. } => "GridSample",
        Dft { .. } => "DFT", Stft { .. } => "STFT", RoiAlign(_) => "RoiAlign", DeformConv { .. } => "DeformConv",
        AffineGrid { .. } => "AffineGrid", Col2Im { .. } => "Col2Im", CenterCropPad { .. } => "CenterCropPad", SpaceToDepth { .. } => "SpaceToDepth", Expand => "Expand", Where => "Where",
        Cast { .. } => "Cast", CastLike { .. } => "CastLike", QuantizeLinear(_) => "QuantizeLinear",
        DequantizeLinear { .. } => "DequantizeLinear", DynamicQuantizeLinear => "DynamicQuantizeLinear", Shape { .. } => "Shape", Size => "Size",
        ConstantOfShape { .. } => "ConstantOfShape", Range => "Range", ArgMax { .. } => "ArgMax",
        ArgMin { .. } => "ArgMin", Trilu { .. } => "Trilu", Einsum { .. } => "Einsum",
        Pad(_) => "Pad", Tile => "Tile", CumSum { .. } => "CumSum", CumProd { .. } => "CumProd",
        TopK { .. } => "TopK", OneHot { .. } => "OneHot", ScatterNd { .. } => "ScatterND",
        ScatterElements { .. } => "ScatterElements", Hardmax(_) => "Hardmax",
        LpNormalization { .. } => "LpNormalization", Shrink { .. } => "Shrink", Lrn(_) => "LRN",
        MeanVarianceNormalization { .. } => "MeanVarianceNormalization", EyeLike { .. } => "EyeLike",
        GroupNormalization(_) => "GroupNormalization", ReverseSequence { .. } => "ReverseSequence",
        Det => "Det",
        Rnn(r) => match r.cell {
            RnnCell::Rnn => "RNN",
            RnnCell::Gru => "GRU",
            RnnCell::Lstm => "LSTM",
        },
        Unary(_) | Binary(_) | Variadic(_) | Reduce(_) | Unsigned { .. } => "?",
    }
}

/// The ONNX name of a unary kernel.
pub fn unary_name(u: UnaryKind) -> &'static str {
    use UnaryKind::*;
    match u {
        Abs => "Abs", Neg => "Neg", Sqrt => "Sqrt", Reciprocal => "Reciprocal", Exp => "Exp",
        Log => "Log", Erf => "Erf", Tanh => "Tanh", Sigmoid => "Sigmoid", Relu => "Relu",
        Not => "Not", IsNaN => "IsNaN", Floor => "Floor", Ceil => "Ceil", Round => "Round",
        Sign => "Sign", Sin => "Sin", Cos => "Cos", Tan => "Tan", Asin => "Asin", Acos => "Acos",
        Atan => "Atan", Sinh => "Sinh", Cosh => "Cosh", Asinh => "Asinh", Acosh => "Acosh",
        Atanh => "Atanh", Softplus => "Softplus", Softsign => "Softsign", Identity => "Identity",
        HardSwish => "HardSwish", Mish => "Mish", BitNot => "BitwiseNot",
    }
}

/// The ONNX name of a binary kernel.
pub fn binary_name(b: BinaryKind) -> &'static str {
    use BinaryKind::*;
    match b {
        Add => "Add", Sub => "Sub", Mul => "Mul", Div => "Div", Pow => "Pow", Equal => "Equal",
        Less => "Less", Greater => "Greater", LessOrEqual => "LessOrEqual",
        GreaterOrEqual => "GreaterOrEqual", And => "And", Or => "Or", Xor => "Xor",
        Mod | Fmod => "Mod", PRelu => "PRelu", BitAnd => "BitwiseAnd", BitOr => "BitwiseOr",
        BitXor => "BitwiseXor", ShiftLeft | ShiftRight => "BitShift",
    }
}

/// The ONNX name of a variadic kernel.
pub fn variadic_name(v: VariadicKind) -> &'static str {
    match v {
        VariadicKind::Sum => "Sum",
        VariadicKind::Max => "Max",
        VariadicKind::Min => "Min",
        VariadicKind::Mean => "Mean",
    }
}

/// The ONNX name of a reduction.
pub fn reduce_name(k: ReduceKind) -> &'static str {
    use ReduceKind::*;
    match k {
        Sum => "ReduceSum", Mean => "ReduceMean", Max => "ReduceMax", Min => "ReduceMin",
        Prod => "ReduceProd", L1 => "ReduceL1", L2 => "ReduceL2", LogSum => "ReduceLogSum",
        LogSumExp => "ReduceLogSumExp", SumSquare => "ReduceSumSquare",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes() {
        assert_eq!(Kernel::Binary(BinaryKind::Fmod).name(), "Mod");
        assert_eq!(Kernel::Tile.name(), "Tile");
        assert_eq!(ElemType::Bf16.size_bytes(), 2);
        assert_eq!(ElemType::U64.to_string(), "u64");
    }
}
