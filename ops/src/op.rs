//! The closed set of operators the IR understands, with typed attributes.
//!
//! Every ONNX node becomes one [`Op`]. Attributes are parsed once at import (see
//! `import::convert`) into the fields below, so no pass looks anything up by string.
//! Where an ONNX opset moved an attribute to an input (Squeeze axes, Split sizes, Slice
//! bounds, Clip bounds, Pad pads, Reduce axes, Dropout ratio), the field is `Some` for the
//! attribute form and `None` when the value comes from the node's input.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{DType, TensorData};

/// How an op runs when a stage computes in a low-precision type (bf16 or fp16), as
/// PyTorch's autocast decides it: matrix products and convolutions in the low type (their
/// float operands cast down), the numerically sensitive ops (softmax, normalisation
/// statistics, sums and products, exp, log, pow, losses) in fp32 (cast up, output fp32),
/// every other op in the type its inputs have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MixedPrecisionRule {
    LowType,
    Fp32,
    AsGiven,
}

/// Elementwise ops with one input and no attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Abs, Neg, Sqrt, Reciprocal, Exp, Log, Erf, Tanh, Sigmoid, Relu, Not, IsNaN, Floor, Ceil,
    Round, Sign, Sin, Cos, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh, Softplus,
    Softsign, Identity, HardSwish, Mish,
    /// `BitwiseNot` (integers).
    BitNot,
}

/// Elementwise ops with two inputs and numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add, Sub, Mul, Div, Pow, Equal, Less, Greater, LessOrEqual, GreaterOrEqual, And, Or, Xor,
    /// `fmod = 0`: integer modulo with the divisor's sign.
    Mod,
    /// `fmod = 1`: C `fmod`, the dividend's sign.
    Fmod,
    PRelu,
    /// `BitwiseAnd`, `BitwiseOr`, `BitwiseXor` (integers).
    BitAnd, BitOr, BitXor,
    /// `BitShift` with `direction = "LEFT"` / `"RIGHT"`.
    ShiftLeft, ShiftRight,
}

impl BinaryOp {
    /// Comparison and logic ops produce `bool`.
    pub fn is_predicate(self) -> bool {
        use BinaryOp::*;
        matches!(self, Equal | Less | Greater | LessOrEqual | GreaterOrEqual | And | Or | Xor)
    }
}

/// Elementwise ops over any number of broadcast inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum VariadicOp {
    Sum, Max, Min, Mean,
}

/// Reductions sharing the `axes`/`keepdims` interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceKind {
    Sum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AutoPad {
    #[default]
    NotSet,
    SameUpper,
    SameLower,
    Valid,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PadMode {
    Constant, Reflect, Edge, Wrap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GeluApprox {
    None, Tanh,
}

/// Convolution geometry shared by Conv, ConvTranspose and the pools. Empty vectors mean
/// "the ONNX default for the input's spatial rank" (ones for strides/dilations, zeros for pads).
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

/// RoiAlign: bilinear samples of each region of interest averaged (or maximised) per bin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoiAlign {
    /// `mode=max` (default avg).
    pub max: bool,
    pub output_height: i64,
    pub output_width: i64,
    /// Samples per bin along each axis; 0: `ceil(roi extent / output extent)` per region.
    pub sampling_ratio: i64,
    pub spatial_scale: f32,
    /// `coordinate_transformation_mode=half_pixel` (shift the region by -0.5 pixel).
    pub half_pixel: bool,
    /// Opset 10, which has no coordinate_transformation_mode (it is output_half_pixel).
    pub v10: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConvTranspose {
    pub window: Window,
    pub group: i64,
    pub output_padding: Vec<i64>,
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
    pub momentum: f32,
    /// The exported mode. The runtime trains with batch statistics regardless (see the stage program).
    pub training_mode: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerNorm {
    pub axis: i64,
    pub epsilon: f32,
    pub stash_type: i64,
}

/// Attention (opsets 23-25): scaled dot-product attention of Q, K, V given as
/// `[batch, heads, seq, head_size]` or `[batch, seq, heads * head_size]` (then the head
/// counts are the attributes), with an optional key/value cache, mask and output of the
/// attention scores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    pub is_causal: bool,
    /// Required for 3-D inputs, absent for 4-D ones.
    pub q_num_heads: Option<i64>,
    pub kv_num_heads: Option<i64>,
    /// What output 3 holds: 0 the raw `QK^T`, 1 after softcap, 2 with the mask added,
    /// 3 the softmax.
    pub qk_matmul_output_mode: i64,
    /// `None`: `1 / sqrt(head_size)`.
    pub scale: Option<f32>,
    /// `0`: no soft capping.
    pub softcap: f32,
    /// The type the softmax runs in; `None`: the inputs'.
    pub softmax_precision: Option<DType>,
    /// Opset 25's sliding window around each query's absolute position; `-1` unbounded.
    pub left_window_size: i64,
    pub right_window_size: i64,
}

/// RotaryEmbedding (opset 23): rotates pairs of each head's leading
/// `rotary_embedding_dim` features by the angles of the cos/sin caches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rotary {
    /// Pairs are adjacent features (`x[2i], x[2i+1]`) instead of the two halves.
    pub interleaved: bool,
    /// `0`: the whole head.
    pub rotary_embedding_dim: i64,
    /// Required for 3-D input `[batch, seq, heads * head_size]`.
    pub num_heads: Option<i64>,
}

/// How `Cast` rounds into the low-precision floats (ONNX `saturate`, `round_mode`; both
/// ignored for other targets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CastMode {
    /// Out-of-range values become the largest finite value (else NaN or infinity).
    pub saturate: bool,
    /// The rounding of `f8e8m0` targets.
    pub round: RoundMode,
}

impl Default for CastMode {
    fn default() -> Self {
        CastMode { saturate: true, round: RoundMode::Up }
    }
}

/// ONNX `round_mode` of casts to `f8e8m0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RoundMode {
    Up,
    Down,
    Nearest,
}

impl RoundMode {
    pub fn name(self) -> &'static str {
        match self {
            RoundMode::Up => "up",
            RoundMode::Down => "down",
            RoundMode::Nearest => "nearest",
        }
    }
}

/// LinearAttention's recurrence (opset 27): which of the decay gate and the delta
/// correction the state update applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinearRule {
    Linear,
    Gated,
    Delta,
    GatedDelta,
}

impl LinearRule {
    pub fn parse(s: &str) -> Option<LinearRule> {
        Some(match s {
            "linear" => LinearRule::Linear,
            "gated" => LinearRule::Gated,
            "delta" => LinearRule::Delta,
            "gated_delta" => LinearRule::GatedDelta,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LinearRule::Linear => "linear",
            LinearRule::Gated => "gated",
            LinearRule::Delta => "delta",
            LinearRule::GatedDelta => "gated_delta",
        }
    }

    /// The state decays by `exp(decay)` each step (input 4 required).
    pub fn gated(self) -> bool {
        matches!(self, LinearRule::Gated | LinearRule::GatedDelta)
    }

    /// The update writes `beta * (v - S^T k)` (input 5 required).
    pub fn delta(self) -> bool {
        matches!(self, LinearRule::Delta | LinearRule::GatedDelta)
    }
}

/// LinearAttention (opset 27): the recurrent state `S` (`[batch, kv_heads, d_k, d_v]`)
/// updated token by token from packed `[batch, seq, heads * d]` Q, K, V, read by the
/// queries; grouped-query heads share a KV head's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearAttention {
    pub q_num_heads: i64,
    pub kv_num_heads: i64,
    /// `0`: `1 / sqrt(d_k)`.
    pub scale: f32,
    pub update_rule: LinearRule,
    /// A tuning hint of chunked kernels; kept for the round trip, no effect on results.
    pub chunk_size: i64,
}

/// The optimizer steps of the `ai.onnx.preview.training` domain. Inputs: the learning
/// rate `R`, the update count `T`, then `n` tensors `X`, their gradients `G` and the
/// optimizer's state tensors (Adagrad: `H`; Adam: `V`, `H`; Momentum: `V`), each a block
/// of `n`; outputs: the new `X` and the new states, in blocks of `n`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerStep {
    Adagrad { decay_factor: f32, epsilon: f32, norm_coefficient: f32 },
    Adam { alpha: f32, beta: f32, epsilon: f32, norm_coefficient: f32, norm_coefficient_post: f32 },
    Momentum { alpha: f32, beta: f32, norm_coefficient: f32, nesterov: bool },
}

impl OptimizerStep {
    /// The state tensors per optimized tensor.
    pub fn states(&self) -> usize {
        match self {
            OptimizerStep::Adam { .. } => 2,
            _ => 1,
        }
    }
}

/// QuantizeLinear: `y = saturate(round(x / scale) + zero_point)`, per tensor, per `axis`
/// (1-D scale) or per block of `block_size` along `axis` (scale of x's rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quantize {
    pub axis: i64,
    /// 0: per tensor or per axis.
    pub block_size: i64,
    pub saturate: bool,
    /// The output type when there is no zero point (else the zero point's type; u8 if neither).
    pub output_dtype: Option<DType>,
    /// The float type `x / scale` is computed in (else x's type).
    pub precision: Option<DType>,
}

/// TreeEnsemble (`ai.onnx.ml` 5): decision trees over the features of `[N, F]` rows,
/// each tree giving one leaf's weight to its target, aggregated per target. The node
/// and leaf tables are ONNX's (`nodes_*`, `leaf_*`); the tensors keep their element
/// types so the attributes round-trip.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TreeEnsemble {
    pub featureids: Vec<i64>,
    /// Per node: 0 `<=`, 1 `<`, 2 `>=`, 3 `>`, 4 `==`, 5 `!=`, 6 set membership.
    pub modes: TensorData,
    pub splits: TensorData,
    pub truenodeids: Vec<i64>,
    pub falsenodeids: Vec<i64>,
    pub trueleafs: Vec<i64>,
    pub falseleafs: Vec<i64>,
    /// Per node, whether a NaN feature takes the true branch; empty: never.
    pub missing_tracks_true: Vec<i64>,
    pub leaf_targetids: Vec<i64>,
    pub leaf_weights: TensorData,
    pub tree_roots: Vec<i64>,
    /// The members of each set-membership node in node order, each set ended by NaN.
    pub membership_values: Option<TensorData>,
    pub n_targets: i64,
    /// 0 average, 1 sum, 2 min, 3 max.
    pub aggregate_function: i64,
}

/// How ScatterND/ScatterElements combine an update with the element it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScatterReduction {
    None,
    Add,
    Mul,
    Max,
    Min,
}

/// LRN's attributes: `y = x / (bias + alpha / size * sum_window(x^2))^beta` over `size`
/// neighbouring channels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Lrn {
    pub alpha: f32,
    pub beta: f32,
    pub bias: f32,
    pub size: i64,
}

/// GroupNormalization: statistics per (sample, group of channels).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupNorm {
    pub epsilon: f32,
    pub num_groups: i64,
    /// The precision of the statistics (opset 21; 1 = f32).
    pub stash_type: i64,
    /// Opset 21: scale and bias hold one value per channel; opset 18: one per group.
    pub per_channel: bool,
}

/// The recurrent cell of an RNN, GRU or LSTM node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RnnCell {
    Rnn,
    Gru,
    Lstm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RnnDirection {
    Forward,
    Reverse,
    Bidirectional,
}

/// RNN/GRU/LSTM with their default activations (Tanh; Sigmoid, Tanh; Sigmoid, Tanh, Tanh).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rnn {
    pub cell: RnnCell,
    pub hidden_size: i64,
    pub direction: RnnDirection,
    /// `layout = 1` (opset 14): X, Y and the states are batch-major.
    pub batch_major: bool,
    /// Bounds the gates' pre-activations to `[-clip, clip]`.
    pub clip: Option<f32>,
    /// GRU: the reset gate multiplies the recurrent projection (with its bias) rather than
    /// the previous state.
    pub linear_before_reset: bool,
}

impl Rnn {
    /// Gates per direction: 1 (RNN), 3 (GRU: z, r, h) or 4 (LSTM: i, o, f, c).
    pub fn gates(&self) -> i64 {
        match self.cell {
            RnnCell::Rnn => 1,
            RnnCell::Gru => 3,
            RnnCell::Lstm => 4,
        }
    }

    pub fn directions(&self) -> i64 {
        if self.direction == RnnDirection::Bidirectional { 2 } else { 1 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Softmax {
    pub axis: i64,
    /// Opsets < 13: the input is coerced to 2-D at `axis` and normalised over the trailing block.
    pub coerce_2d: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slice {
    /// Opsets < 10 carry the bounds as attributes: `(starts, ends, axes)`.
    pub attrs: Option<(Vec<i64>, Vec<i64>, Option<Vec<i64>>)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Split {
    pub axis: i64,
    /// Sizes from the attribute (opsets < 13); `None` means input 1 or equal parts.
    pub split: Option<Vec<i64>>,
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

/// `reduction` of the loss ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LossReduction {
    None, Sum, Mean,
}

/// The attributes shared by NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassLoss {
    pub reduction: LossReduction,
    /// Targets equal to it add nothing to the loss nor to the mean's denominator.
    pub ignore_index: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pad {
    pub mode: PadMode,
    /// Opsets < 11: pads and value as attributes.
    pub attrs: Option<(Vec<i64>, f32)>,
}

/// Resize `mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResizeMode {
    Nearest, Linear, Cubic,
}

/// Resize `coordinate_transformation_mode`: how an output index maps to a source coordinate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CoordMode {
    HalfPixel, HalfPixelSymmetric, PytorchHalfPixel, AlignCorners, Asymmetric, TfCropAndResize,
}

/// Resize `nearest_mode`: how a fractional source coordinate rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NearestMode {
    RoundPreferFloor, RoundPreferCeil, Floor, Ceil,
}

/// Resize `keep_aspect_ratio_policy` (with `sizes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AspectPolicy {
    Stretch, NotLarger, NotSmaller,
}

/// Resize and Upsample. The roi, scales and sizes are inputs (known at import, they fix
/// the output shape); `legacy` is the opset-10 Resize and Upsample form: inputs (X,
/// scales), asymmetric coordinates, nearest rounding down, no other attribute.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Resize {
    pub mode: ResizeMode,
    pub coord: CoordMode,
    pub nearest: NearestMode,
    pub cubic_a: f32,
    pub exclude_outside: bool,
    pub extrapolation: f32,
    pub antialias: bool,
    pub axes: Option<Vec<i64>>,
    pub aspect: AspectPolicy,
    pub legacy: bool,
}

/// GridSample `padding_mode`: the value of a sample outside the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GridPadding {
    Zeros, Border, Reflection,
}

/// One operator with its typed attributes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    Unary(UnaryOp),
    Binary(BinaryOp),
    Variadic(VariadicOp),
    LeakyRelu { alpha: f32 },
    Elu { alpha: f32 },
    Celu { alpha: f32 },
    Selu { alpha: f32, gamma: f32 },
    HardSigmoid { alpha: f32, beta: f32 },
    ThresholdedRelu { alpha: f32 },
    /// `x * sigmoid(alpha * x)`.
    Swish { alpha: f32 },
    /// `Swish_alpha(A) * B` for inputs of one shape.
    SwiGlu { alpha: f32 },
    Gelu { approximate: GeluApprox },
    /// Bounds from attributes in opsets < 11; inputs 1 and 2 afterwards.
    Clip { min: Option<f32>, max: Option<f32> },
    IsInf { detect_positive: bool, detect_negative: bool },
    Softmax(Softmax),
    LogSoftmax(Softmax),
    MatMul,
    /// Integer matmul of (u)int8 inputs less their optional zero points, to int32.
    MatMulInteger,
    /// Quantized matmul: inputs `a, a_scale, a_zero_point, b, b_scale, b_zero_point,
    /// y_scale, y_zero_point`; the int32 product is requantized to `y_zero_point`'s type.
    QLinearMatMul,
    Gemm(Gemm),
    Conv(Conv),
    ConvTranspose(ConvTranspose),
    /// Integer convolution of (u)int8 inputs less their optional zero points, to int32.
    ConvInteger(Conv),
    /// Quantized convolution: inputs `x, x_scale, x_zero_point, w, w_scale,
    /// w_zero_point, y_scale, y_zero_point[, B]`, requantized to `y_zero_point`'s type.
    QLinearConv(Conv),
    MaxPool(Pool),
    /// Scatters X to the flat output offsets I (MaxPool's indices) in a zero tensor of
    /// the unpooled shape, zero-padded at the end to `output_shape` (input 2) if given.
    MaxUnpool { kernel_shape: Vec<i64>, strides: Vec<i64>, pads: Vec<i64> },
    AveragePool(Pool),
    /// `(sum over the window of |x|^p)^(1/p)`.
    LpPool { pool: Pool, p: i64 },
    GlobalAveragePool,
    GlobalMaxPool,
    BatchNormalization(BatchNorm),
    LayerNormalization(LayerNorm),
    /// `X / sqrt(mean(X^2 over axis..) + epsilon) * Scale`; the same attributes as
    /// LayerNormalization.
    RMSNormalization(LayerNorm),
    Attention(Attention),
    RotaryEmbedding(Rotary),
    LinearAttention(LinearAttention),
    /// An optimizer step of the training domain (see [`OptimizerStep`]).
    Optimizer(OptimizerStep),
    /// `ai.onnx.ml`: 1 where the input exceeds `threshold`, else 0, in the input's type.
    Binarizer { threshold: f32 },
    TreeEnsemble(Box<TreeEnsemble>),
    /// `ai.onnx.ml`: the elements at the indices (input 1) along the last axis.
    ArrayFeatureExtractor,
    /// Causal depthwise 1-D convolution over `[batch, channels, length]` continuing a
    /// carried state (the last `k - 1` positions); `silu`: the fused SiLU activation.
    CausalConvWithState { silu: bool },
    InstanceNormalization { epsilon: f32 },
    /// Inputs: log-probabilities `[N, C, d...]`, class ids `[N, d...]`, optional class weights `[C]`.
    NegativeLogLikelihoodLoss(ClassLoss),
    /// Inputs: scores `[N, C, d...]`, class ids, optional class weights; outputs the loss
    /// and (optionally) the log-probabilities.
    SoftmaxCrossEntropyLoss(ClassLoss),
    /// `ratio` is the attribute of opsets < 12; afterwards input 1.
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
    /// Gathers slices of the data by index tuples (the indices' last axis); the first
    /// `batch_dims` axes of data and indices are matched one to one.
    GatherND { batch_dims: i64 },
    Expand,
    Where,
    Cast { to: DType, mode: CastMode },
    CastLike { mode: CastMode },
    /// The input's bits read as `to`, a type of the same width (no value conversion).
    BitCast { to: DType },
    QuantizeLinear(Quantize),
    /// `y = (x - zero_point) * scale`, with Quantize's per-axis and blocked forms.
    DequantizeLinear { axis: i64, block_size: i64, output_dtype: Option<DType> },
    /// u8 quantization with the scale and zero point taken from x's range.
    DynamicQuantizeLinear,
    Shape { start: i64, end: Option<i64> },
    Size,
    ConstantOfShape { value: Option<TensorData> },
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
    /// The `k` largest (or smallest) elements along `axis` and their indices; `k` is input
    /// 1 and must be known at import (it sets the output shape).
    TopK { axis: i64, largest: bool, sorted: bool },
    /// One-hot encoding of input 0 with `depth` (input 1, known at import) inserted at
    /// `axis`, filled with input 2's `[off, on]` values.
    OneHot { axis: i64 },
    ScatterND { reduction: ScatterReduction },
    ScatterElements { axis: i64, reduction: ScatterReduction },
    /// The deprecated (opset 9-10) name of ScatterElements without reduction.
    Scatter { axis: i64 },
    /// KV-cache write: `update` replaces the cache entries along `axis` from each batch
    /// row's write index (input 2, default 0), modulo the axis length when `circular`.
    TensorScatter { axis: i64, circular: bool },
    /// 1 at the first maximum along the axis (or, before opset 13, over the coerced 2-D
    /// trailing block), 0 elsewhere.
    Hardmax(Softmax),
    LpNormalization { axis: i64, p: i64 },
    Shrink { bias: f32, lambd: f32 },
    Lrn(Lrn),
    MeanVarianceNormalization { axes: Vec<i64> },
    /// A 2-D tensor of the input's shape with ones on diagonal `k`, of `dtype` (default:
    /// the input's).
    EyeLike { dtype: Option<DType>, k: i64 },
    GroupNormalization(GroupNorm),
    ReverseSequence { batch_axis: i64, time_axis: i64 },
    Det,
    Rnn(Rnn),
    Resize(Resize),
    /// Moves `blocksize x blocksize` blocks of channels into space; `crd`: the channels
    /// are column-row-depth ordered (default depth-column-row).
    DepthToSpace { blocksize: i64, crd: bool },
    /// Sums sliding blocks `[N, C * prod(block), L]` back into an image (inputs: the
    /// image shape and the block shape); empty vectors are the ONNX defaults.
    Col2Im { dilations: Vec<i64>, pads: Vec<i64>, strides: Vec<i64> },
    /// Crops or zero-pads each of `axes` (default all) around its centre to the shape input.
    CenterCropPad { axes: Option<Vec<i64>> },
    /// The sampling grid of affine matrices `theta` over an output of the given size.
    AffineGrid { align_corners: bool },
    /// Samples the input at the grid's normalised coordinates (4-D or 5-D); `v16`: the
    /// opset-16 spelling of the modes (bilinear, bicubic).
    GridSample { mode: ResizeMode, padding: GridPadding, align_corners: bool, v16: bool },
    /// The inverse of DepthToSpace.
    SpaceToDepth { blocksize: i64, crd: bool },
    /// Upsample (opset 9): a legacy Resize under its own name.
    Upsample(Resize),
    /// The discrete Fourier transform along an axis of a real (last axis 1) or complex
    /// (last axis 2) signal; `axis`: the opset-17 attribute (from 20 it is input 2, and
    /// the length input 1 in both).
    Dft { inverse: bool, onesided: bool, axis: Option<i64> },
    /// Short-time Fourier transform of `[batch, length, 1|2]` by frames of input 1's step.
    Stft { onesided: bool },
    RoiAlign(RoiAlign),
    /// A 2-D convolution whose taps are moved by per-position offsets (input 2) and
    /// optionally scaled by a mask (input 4); `offset_group` groups of channels share offsets.
    DeformConv { conv: Conv, offset_group: i64 },
    /// Not an ONNX op: the crossing of a tensor from pipeline stage `from` to stage
    /// `from + 1` (a send on one side, a receive on the other), inserted by the partition
    /// pass. Identity on the value; its gradient crosses back the same way.
    StageBoundary { from: u32, to: u32 },
    /// Not an ONNX op: the value unchanged, with no gradient back through it (PyTorch's
    /// `detach()`, which ONNX cannot state: the default exporter writes an `Identity`, or
    /// its optimizer drops the node and only the consumer's metadata records it). The
    /// exporter writes it as `Identity` again.
    StopGradient,
}

impl Op {
    /// The ONNX op type this op was imported from (and is exported as).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => unary_name(*u),
            Op::Binary(b) => binary_name(*b),
            Op::Variadic(v) => match v {
                VariadicOp::Sum => "Sum",
                VariadicOp::Max => "Max",
                VariadicOp::Min => "Min",
                VariadicOp::Mean => "Mean",
            },
            Op::LeakyRelu { .. } => "LeakyRelu",
            Op::Elu { .. } => "Elu",
            Op::Celu { .. } => "Celu",
            Op::Selu { .. } => "Selu",
            Op::HardSigmoid { .. } => "HardSigmoid",
            Op::ThresholdedRelu { .. } => "ThresholdedRelu",
            Op::Swish { .. } => "Swish",
            Op::SwiGlu { .. } => "SwiGLU",
            Op::Gelu { .. } => "Gelu",
            Op::Clip { .. } => "Clip",
            Op::IsInf { .. } => "IsInf",
            Op::Softmax(_) => "Softmax",
            Op::LogSoftmax(_) => "LogSoftmax",
            Op::MatMul => "MatMul",
            Op::MatMulInteger => "MatMulInteger",
            Op::QLinearMatMul => "QLinearMatMul",
            Op::Gemm(_) => "Gemm",
            Op::Conv(_) => "Conv",
            Op::ConvTranspose(_) => "ConvTranspose",
            Op::ConvInteger(_) => "ConvInteger",
            Op::QLinearConv(_) => "QLinearConv",
            Op::MaxPool(_) => "MaxPool",
            Op::MaxUnpool { .. } => "MaxUnpool",
            Op::AveragePool(_) => "AveragePool",
            Op::LpPool { .. } => "LpPool",
            Op::GlobalAveragePool => "GlobalAveragePool",
            Op::GlobalMaxPool => "GlobalMaxPool",
            Op::BatchNormalization(_) => "BatchNormalization",
            Op::LayerNormalization(_) => "LayerNormalization",
            Op::RMSNormalization(_) => "RMSNormalization",
            Op::Attention(_) => "Attention",
            Op::RotaryEmbedding(_) => "RotaryEmbedding",
            Op::LinearAttention(_) => "LinearAttention",
            Op::Optimizer(OptimizerStep::Adagrad { .. }) => "Adagrad",
            Op::Optimizer(OptimizerStep::Adam { .. }) => "Adam",
            Op::Optimizer(OptimizerStep::Momentum { .. }) => "Momentum",
            Op::Binarizer { .. } => "Binarizer",
            Op::TreeEnsemble(_) => "TreeEnsemble",
            Op::ArrayFeatureExtractor => "ArrayFeatureExtractor",
            Op::CausalConvWithState { .. } => "CausalConvWithState",
            Op::InstanceNormalization { .. } => "InstanceNormalization",
            Op::NegativeLogLikelihoodLoss(_) => "NegativeLogLikelihoodLoss",
            Op::SoftmaxCrossEntropyLoss(_) => "SoftmaxCrossEntropyLoss",
            Op::Dropout { .. } => "Dropout",
            Op::Reshape { .. } => "Reshape",
            Op::Flatten { .. } => "Flatten",
            Op::Transpose { .. } => "Transpose",
            Op::Squeeze { .. } => "Squeeze",
            Op::Unsqueeze { .. } => "Unsqueeze",
            Op::Concat { .. } => "Concat",
            Op::Split(_) => "Split",
            Op::Slice(_) => "Slice",
            Op::Gather { .. } => "Gather",
            Op::GatherElements { .. } => "GatherElements",
            Op::GatherND { .. } => "GatherND",
            Op::Expand => "Expand",
            Op::Where => "Where",
            Op::Cast { .. } => "Cast",
            Op::BitCast { .. } => "BitCast",
            Op::CastLike { .. } => "CastLike",
            Op::QuantizeLinear(_) => "QuantizeLinear",
            Op::DequantizeLinear { .. } => "DequantizeLinear",
            Op::DynamicQuantizeLinear => "DynamicQuantizeLinear",
            Op::Shape { .. } => "Shape",
            Op::Size => "Size",
            Op::ConstantOfShape { .. } => "ConstantOfShape",
            Op::Range => "Range",
            Op::Reduce(r) => reduce_name(r.kind),
            Op::ArgMax { .. } => "ArgMax",
            Op::ArgMin { .. } => "ArgMin",
            Op::Trilu { .. } => "Trilu",
            Op::Einsum { .. } => "Einsum",
            Op::Pad(_) => "Pad",
            Op::Tile => "Tile",
            Op::CumSum { .. } => "CumSum",
            Op::CumProd { .. } => "CumProd",
            Op::TopK { .. } => "TopK",
            Op::OneHot { .. } => "OneHot",
            Op::ScatterND { .. } => "ScatterND",
            Op::ScatterElements { .. } => "ScatterElements",
            Op::Scatter { .. } => "Scatter",
            Op::TensorScatter { .. } => "TensorScatter",
            Op::Hardmax(_) => "Hardmax",
            Op::LpNormalization { .. } => "LpNormalization",
            Op::Shrink { .. } => "Shrink",
            Op::Lrn(_) => "LRN",
            Op::MeanVarianceNormalization { .. } => "MeanVarianceNormalization",
            Op::EyeLike { .. } => "EyeLike",
            Op::GroupNormalization(_) => "GroupNormalization",
            Op::ReverseSequence { .. } => "ReverseSequence",
            Op::Det => "Det",
            Op::Rnn(r) => match r.cell {
                RnnCell::Rnn => "RNN",
                RnnCell::Gru => "GRU",
                RnnCell::Lstm => "LSTM",
            },
            Op::Resize(_) => "Resize",
            Op::DepthToSpace { .. } => "DepthToSpace",
            Op::GridSample { .. } => "GridSample",
            Op::Col2Im { .. } => "Col2Im",
            Op::CenterCropPad { .. } => "CenterCropPad",
            Op::AffineGrid { .. } => "AffineGrid",
            Op::SpaceToDepth { .. } => "SpaceToDepth",
            Op::Upsample(_) => "Upsample",
            Op::Dft { .. } => "DFT",
            Op::Stft { .. } => "STFT",
            Op::RoiAlign(_) => "RoiAlign",
            Op::DeformConv { .. } => "DeformConv",
            Op::StageBoundary { .. } => "StageBoundary",
            Op::StopGradient => "StopGradient",
        }
    }

    /// The op's attributes under their ONNX names, in a fixed order: the one table both
    /// the text form ([`Op::attrs_text`]) and the ONNX exporter write, and the text parser
    /// reads back through the importer's conversion. Attributes whose schema is
    /// opset-dependent are given only when they differ from the default (`allowzero`,
    /// `training_mode`, `select_last_index`, `start`, `noop_with_empty_axes`), so the
    /// result is valid at the model's opset. `StageBoundary`'s `from`/`to` are not ONNX
    /// (the exporter leaves boundaries out).
    pub fn attributes(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = Attrs::default();
        match self {
            Op::Unary(_) | Op::Variadic(_) | Op::MatMul | Op::GlobalAveragePool | Op::GlobalMaxPool | Op::Expand | Op::StopGradient => {}
            Op::Where | Op::Size | Op::Range | Op::Tile | Op::Det | Op::DynamicQuantizeLinear | Op::ArrayFeatureExtractor => {}
            Op::MatMulInteger | Op::QLinearMatMul => {}
            Op::Swish { alpha } | Op::SwiGlu { alpha } => a.f("alpha", *alpha),
            Op::ConvInteger(c) | Op::QLinearConv(c) => {
                a.window(&c.window);
                a.i("group", c.group);
            }
            Op::MaxUnpool { kernel_shape, strides, pads } => {
                a.v("kernel_shape", kernel_shape);
                a.v("strides", strides);
                a.v("pads", pads);
            }
            Op::TensorScatter { axis, circular } => {
                a.i("axis", *axis);
                a.s("mode", if *circular { "circular" } else { "linear" });
            }
            Op::Binary(BinaryOp::ShiftLeft) => a.s("direction", "LEFT"),
            Op::Binary(BinaryOp::ShiftRight) => a.s("direction", "RIGHT"),
            Op::Binary(b) => a.flag("fmod", *b == BinaryOp::Fmod),
            Op::LeakyRelu { alpha } | Op::Elu { alpha } | Op::Celu { alpha } | Op::ThresholdedRelu { alpha } => a.f("alpha", *alpha),
            Op::Selu { alpha, gamma } => {
                a.f("alpha", *alpha);
                a.f("gamma", *gamma);
            }
            Op::HardSigmoid { alpha, beta } => {
                a.f("alpha", *alpha);
                a.f("beta", *beta);
            }
            Op::Gelu { approximate } => {
                if *approximate == GeluApprox::Tanh {
                    a.s("approximate", "tanh");
                }
            }
            Op::Clip { min, max } => {
                if let Some(v) = min {
                    a.f("min", *v);
                }
                if let Some(v) = max {
                    a.f("max", *v);
                }
            }
            Op::IsInf { detect_positive, detect_negative } => {
                a.b("detect_positive", *detect_positive);
                a.b("detect_negative", *detect_negative);
            }
            Op::Softmax(s) | Op::LogSoftmax(s) => a.i("axis", s.axis),
            Op::Gemm(g) => {
                a.f("alpha", g.alpha);
                a.f("beta", g.beta);
                a.b("transA", g.trans_a);
                a.b("transB", g.trans_b);
            }
            Op::Conv(c) => {
                a.window(&c.window);
                a.i("group", c.group);
            }
            Op::ConvTranspose(c) => {
                a.window(&c.window);
                a.i("group", c.group);
                a.v("output_padding", &c.output_padding);
                a.v("output_shape", &c.output_shape);
            }
            Op::MaxPool(p) => {
                a.window(&p.window);
                a.b("ceil_mode", p.ceil_mode);
            }
            Op::LpPool { pool, p } => {
                a.window(&pool.window);
                a.flag("ceil_mode", pool.ceil_mode);
                a.i("p", *p);
            }
            Op::AveragePool(p) => {
                a.window(&p.window);
                a.b("ceil_mode", p.ceil_mode);
                a.b("count_include_pad", p.count_include_pad);
            }
            Op::BatchNormalization(b) => {
                a.f("epsilon", b.epsilon);
                a.f("momentum", b.momentum);
                a.flag("training_mode", b.training_mode);
            }
            Op::Attention(at) => attention_attrs(&mut a, at),
            Op::RotaryEmbedding(r) => {
                a.flag("interleaved", r.interleaved);
                if r.rotary_embedding_dim != 0 {
                    a.i("rotary_embedding_dim", r.rotary_embedding_dim);
                }
                if let Some(n) = r.num_heads {
                    a.i("num_heads", n);
                }
            }
            Op::LinearAttention(l) => {
                a.i("q_num_heads", l.q_num_heads);
                a.i("kv_num_heads", l.kv_num_heads);
                a.f("scale", l.scale);
                a.s("update_rule", l.update_rule.as_str());
                a.i("chunk_size", l.chunk_size);
            }
            Op::Optimizer(OptimizerStep::Adagrad { decay_factor, epsilon, norm_coefficient }) => {
                a.f("decay_factor", *decay_factor);
                a.f("epsilon", *epsilon);
                a.f("norm_coefficient", *norm_coefficient);
            }
            Op::Optimizer(OptimizerStep::Adam { alpha, beta, epsilon, norm_coefficient, norm_coefficient_post }) => {
                a.f("alpha", *alpha);
                a.f("beta", *beta);
                a.f("epsilon", *epsilon);
                a.f("norm_coefficient", *norm_coefficient);
                a.f("norm_coefficient_post", *norm_coefficient_post);
            }
            Op::Optimizer(OptimizerStep::Momentum { alpha, beta, norm_coefficient, nesterov }) => {
                a.f("alpha", *alpha);
                a.f("beta", *beta);
                a.f("norm_coefficient", *norm_coefficient);
                a.s("mode", if *nesterov { "nesterov" } else { "standard" });
            }
            Op::Binarizer { threshold } => a.f("threshold", *threshold),
            Op::TreeEnsemble(t) => {
                a.ints("nodes_featureids", &t.featureids);
                a.0.push(("nodes_modes", AttrValue::Tensor(t.modes.clone())));
                a.0.push(("nodes_splits", AttrValue::Tensor(t.splits.clone())));
                a.ints("nodes_truenodeids", &t.truenodeids);
                a.ints("nodes_falsenodeids", &t.falsenodeids);
                a.ints("nodes_trueleafs", &t.trueleafs);
                a.ints("nodes_falseleafs", &t.falseleafs);
                a.v("nodes_missing_value_tracks_true", &t.missing_tracks_true);
                a.ints("leaf_targetids", &t.leaf_targetids);
                a.0.push(("leaf_weights", AttrValue::Tensor(t.leaf_weights.clone())));
                a.ints("tree_roots", &t.tree_roots);
                if let Some(m) = &t.membership_values {
                    a.0.push(("membership_values", AttrValue::Tensor(m.clone())));
                }
                a.i("n_targets", t.n_targets);
                a.i("aggregate_function", t.aggregate_function);
            }
            Op::CausalConvWithState { silu } => a.s("activation", if *silu { "silu" } else { "none" }),
            Op::LayerNormalization(l) | Op::RMSNormalization(l) => {
                a.i("axis", l.axis);
                a.f("epsilon", l.epsilon);
                a.i("stash_type", l.stash_type);
            }
            Op::InstanceNormalization { epsilon } => a.f("epsilon", *epsilon),
            Op::NegativeLogLikelihoodLoss(l) | Op::SoftmaxCrossEntropyLoss(l) => {
                a.s("reduction", loss_reduction_name(l.reduction));
                if let Some(i) = l.ignore_index {
                    a.i("ignore_index", i);
                }
            }
            Op::Dropout { ratio, seed } => {
                if let Some(r) = ratio {
                    a.f("ratio", *r);
                }
                if let Some(s) = seed {
                    a.i("seed", *s);
                }
            }
            Op::Reshape { allow_zero } => a.flag("allowzero", *allow_zero),
            Op::Flatten { axis } | Op::Concat { axis } | Op::Gather { axis } | Op::GatherElements { axis } => a.i("axis", *axis),
            Op::GatherND { batch_dims } => a.i("batch_dims", *batch_dims),
            Op::Transpose { perm } => {
                if let Some(p) = perm {
                    a.ints("perm", p);
                }
            }
            Op::Squeeze { axes } | Op::Unsqueeze { axes } => {
                if let Some(x) = axes {
                    a.ints("axes", x);
                }
            }
            Op::Split(s) => {
                a.i("axis", s.axis);
                if let Some(v) = &s.split {
                    a.ints("split", v);
                }
                if let Some(n) = s.num_outputs {
                    a.i("num_outputs", n);
                }
            }
            Op::Slice(s) => {
                if let Some((starts, ends, axes)) = &s.attrs {
                    a.ints("starts", starts);
                    a.ints("ends", ends);
                    if let Some(x) = axes {
                        a.ints("axes", x);
                    }
                }
            }
            Op::Cast { to, mode } => {
                a.0.push(("to", AttrValue::DType(*to)));
                a.cast_mode(mode);
            }
            Op::CastLike { mode } => a.cast_mode(mode),
            Op::BitCast { to } => a.0.push(("to", AttrValue::DType(*to))),
            Op::QuantizeLinear(q) => {
                a.quant_axis(q.axis, q.block_size);
                a.unflag("saturate", q.saturate);
                if let Some(d) = q.output_dtype {
                    a.0.push(("output_dtype", AttrValue::DType(d)));
                }
                if let Some(d) = q.precision {
                    a.0.push(("precision", AttrValue::DType(d)));
                }
            }
            Op::DequantizeLinear { axis, block_size, output_dtype } => {
                a.quant_axis(*axis, *block_size);
                if let Some(d) = output_dtype {
                    a.0.push(("output_dtype", AttrValue::DType(*d)));
                }
            }
            Op::Shape { start, end } => {
                if *start != 0 {
                    a.i("start", *start);
                }
                if let Some(e) = end {
                    a.i("end", *e);
                }
            }
            Op::ConstantOfShape { value } => {
                if let Some(t) = value {
                    a.0.push(("value", AttrValue::Tensor(t.clone())));
                }
            }
            Op::Reduce(r) => {
                if let Some(x) = &r.axes {
                    a.ints("axes", x);
                }
                a.b("keepdims", r.keepdims);
                a.flag("noop_with_empty_axes", r.noop_with_empty_axes);
            }
            Op::ArgMax { axis, keepdims, select_last_index } | Op::ArgMin { axis, keepdims, select_last_index } => {
                a.i("axis", *axis);
                a.b("keepdims", *keepdims);
                a.flag("select_last_index", *select_last_index);
            }
            Op::Trilu { upper } => a.b("upper", *upper),
            Op::Einsum { equation } => a.s("equation", equation),
            Op::Pad(p) => {
                a.s("mode", pad_mode_name(p.mode));
                if let Some((pads, value)) = &p.attrs {
                    a.ints("pads", pads);
                    a.f("value", *value);
                }
            }
            Op::CumSum { exclusive, reverse } | Op::CumProd { exclusive, reverse } => {
                a.b("exclusive", *exclusive);
                a.b("reverse", *reverse);
            }
            Op::TopK { axis, largest, sorted } => {
                a.i("axis", *axis);
                // Opset 10 has neither attribute: given only when not the default (true).
                a.unflag("largest", *largest);
                a.unflag("sorted", *sorted);
            }
            Op::OneHot { axis } | Op::Scatter { axis } => a.i("axis", *axis),
            Op::ScatterND { reduction } => a.reduction(*reduction),
            Op::ScatterElements { axis, reduction } => {
                a.i("axis", *axis);
                a.reduction(*reduction);
            }
            Op::Hardmax(s) => a.i("axis", s.axis),
            Op::LpNormalization { axis, p } => {
                a.i("axis", *axis);
                a.i("p", *p);
            }
            Op::Shrink { bias, lambd } => {
                a.f("bias", *bias);
                a.f("lambd", *lambd);
            }
            Op::Lrn(l) => {
                a.f("alpha", l.alpha);
                a.f("beta", l.beta);
                a.f("bias", l.bias);
                a.i("size", l.size);
            }
            Op::MeanVarianceNormalization { axes } => a.ints("axes", axes),
            Op::EyeLike { dtype, k } => {
                if let Some(d) = dtype {
                    a.0.push(("dtype", AttrValue::DType(*d)));
                }
                a.i("k", *k);
            }
            Op::GroupNormalization(g) => {
                a.f("epsilon", g.epsilon);
                a.i("num_groups", g.num_groups);
                // Opset 21's attribute: given only when not the default (1).
                if g.stash_type != 1 {
                    a.i("stash_type", g.stash_type);
                }
            }
            Op::ReverseSequence { batch_axis, time_axis } => {
                a.i("batch_axis", *batch_axis);
                a.i("time_axis", *time_axis);
            }
            Op::Rnn(r) => {
                a.i("hidden_size", r.hidden_size);
                a.s("direction", rnn_direction_name(r.direction));
                // Opset 14's attribute: given only when set.
                a.flag("layout", r.batch_major);
                if let Some(c) = r.clip {
                    a.f("clip", c);
                }
                if r.cell == RnnCell::Gru {
                    a.b("linear_before_reset", r.linear_before_reset);
                }
            }
            Op::Resize(r) | Op::Upsample(r) => resize_attributes(&mut a, r),
            Op::Col2Im { dilations, pads, strides } => {
                for (k, v) in [("dilations", dilations), ("pads", pads), ("strides", strides)] {
                    if !v.is_empty() {
                        a.ints(k, v);
                    }
                }
            }
            Op::CenterCropPad { axes } => {
                if let Some(axes) = axes {
                    a.ints("axes", axes);
                }
            }
            Op::AffineGrid { align_corners } => a.flag("align_corners", *align_corners),
            Op::GridSample { mode, padding, align_corners, v16 } => {
                let name = match (mode, v16) {
                    (ResizeMode::Linear, true) => "bilinear",
                    (ResizeMode::Cubic, true) => "bicubic",
                    (m, _) => m.name(),
                };
                a.s("mode", name);
                a.s("padding_mode", padding.name());
                a.flag("align_corners", *align_corners);
            }
            Op::DepthToSpace { blocksize, crd } | Op::SpaceToDepth { blocksize, crd } => {
                a.i("blocksize", *blocksize);
                if *crd {
                    a.s("mode", "CRD");
                }
            }
            Op::Dft { inverse, onesided, axis } => {
                if let Some(axis) = axis {
                    a.i("axis", *axis);
                }
                a.flag("inverse", *inverse);
                a.flag("onesided", *onesided);
            }
            Op::Stft { onesided } => a.b("onesided", *onesided),
            Op::RoiAlign(r) => {
                if !r.v10 {
                    a.s("coordinate_transformation_mode", if r.half_pixel { "half_pixel" } else { "output_half_pixel" });
                }
                a.s("mode", if r.max { "max" } else { "avg" });
                a.i("output_height", r.output_height);
                a.i("output_width", r.output_width);
                a.i("sampling_ratio", r.sampling_ratio);
                a.f("spatial_scale", r.spatial_scale);
            }
            Op::DeformConv { conv, offset_group } => {
                a.window(&conv.window);
                a.i("group", conv.group);
                a.i("offset_group", *offset_group);
            }
            Op::StageBoundary { from, to } => {
                a.i("from", i64::from(*from));
                a.i("to", i64::from(*to));
            }
        }
        a.0
    }

    /// The attributes in text form, `""` when there are none (`[axis=1, keepdims=0]`).
    pub fn attrs_text(&self) -> String {
        let attrs = self.attributes();
        if attrs.is_empty() {
            return String::new();
        }
        let items: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("[{}]", items.join(", "))
    }

    /// Elementwise ops that cost several flops per element (exp, tanh, pow, ...).
    pub fn is_transcendental(&self) -> bool {
        match self {
            Op::Unary(u) => matches!(
                u,
                UnaryOp::Exp
                    | UnaryOp::Log
                    | UnaryOp::Erf
                    | UnaryOp::Tanh
                    | UnaryOp::Sigmoid
                    | UnaryOp::Sin
                    | UnaryOp::Cos
                    | UnaryOp::Tan
                    | UnaryOp::Asin
                    | UnaryOp::Acos
                    | UnaryOp::Atan
                    | UnaryOp::Sinh
                    | UnaryOp::Cosh
                    | UnaryOp::Asinh
                    | UnaryOp::Acosh
                    | UnaryOp::Atanh
                    | UnaryOp::Softplus
                    | UnaryOp::Mish
            ),
            Op::Binary(BinaryOp::Pow) => true,
            Op::Gelu { .. } | Op::Elu { .. } | Op::Selu { .. } | Op::Celu { .. } => true,
            Op::Swish { .. } | Op::SwiGlu { .. } => true,
            _ => false,
        }
    }

    /// How the op runs when a stage computes in bf16 or fp16 (autocast's rule): see
    /// [`MixedPrecisionRule`].
    pub fn mixed_precision_rule(&self) -> MixedPrecisionRule {
        use MixedPrecisionRule::{AsGiven, Fp32, LowType};
        match self {
            Op::MatMul | Op::Gemm(_) | Op::Conv(_) | Op::ConvTranspose(_) | Op::Attention(_) | Op::LinearAttention(_) | Op::Einsum { .. } | Op::DeformConv { .. } => LowType,
            Op::Softmax(_)
            | Op::LogSoftmax(_)
            | Op::LayerNormalization(_)
            | Op::RMSNormalization(_)
            | Op::GroupNormalization(_)
            | Op::InstanceNormalization { .. }
            | Op::BatchNormalization(_)
            | Op::LpNormalization { .. }
            | Op::MeanVarianceNormalization { .. }
            | Op::Lrn(_)
            | Op::NegativeLogLikelihoodLoss(_)
            | Op::SoftmaxCrossEntropyLoss(_)
            | Op::CumSum { .. }
            | Op::CumProd { .. }
            | Op::Det
            | Op::Unary(UnaryOp::Exp | UnaryOp::Log)
            | Op::Binary(BinaryOp::Pow) => Fp32,
            Op::Reduce(r) if !matches!(r.kind, ReduceKind::Max | ReduceKind::Min) => Fp32,
            _ => AsGiven,
        }
    }

    /// Whether input `i` only parameterises the op (a shape, axes, pads, counts, bounds):
    /// its values are read on the host and never computed with on the device, so a value
    /// known before a step needs no device copy, only its shape and type. The runtime's
    /// interpreter gives these inputs a stand-in that holds no values, so the ONNX backend
    /// suite checks this list against the kernels.
    pub fn reads_on_host(&self, i: usize) -> bool {
        match self {
            Op::Reshape { .. } | Op::Expand | Op::Tile | Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Split(_) | Op::Reduce(_) => i == 1,
            Op::TopK { .. } | Op::OneHot { .. } | Op::CumSum { .. } | Op::CumProd { .. } | Op::CenterCropPad { .. } => i == 1,
            Op::Slice(_) => (1..=4).contains(&i),
            Op::Pad(_) => (1..=3).contains(&i),
            Op::Dropout { .. } => (1..=2).contains(&i),
            Op::Resize(_) => (1..=3).contains(&i),
            Op::Upsample(_) => i == 1,
            Op::ConstantOfShape { .. } => i == 0,
            Op::Range => i <= 2,
            _ => false,
        }
    }

    /// Reshape-like ops whose output shares its input's storage: they add no activation
    /// memory (the runtime's memory account and the planner's cost model agree on this).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Reshape { .. } | Op::Flatten { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Unary(UnaryOp::Identity) | Op::StopGradient
        )
    }

    /// Whether the op is an elementwise map of its (broadcast) inputs.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Variadic(_)
                | Op::LeakyRelu { .. }
                | Op::Elu { .. }
                | Op::Celu { .. }
                | Op::Selu { .. }
                | Op::HardSigmoid { .. }
                | Op::ThresholdedRelu { .. }
                | Op::Swish { .. }
                | Op::SwiGlu { .. }
                | Op::Gelu { .. }
                | Op::Clip { .. }
                | Op::IsInf { .. }
                | Op::Where
                | Op::Cast { .. }
                | Op::CastLike { .. }
                | Op::Dropout { .. }
                | Op::Shrink { .. }
        )
    }
}

/// Attention's attributes; the optional ones only when given, and the window sizes
/// (opset 25) only when bounded, so the result is valid at opsets 23 and 24.
fn attention_attrs(a: &mut Attrs, at: &Attention) {
    a.flag("is_causal", at.is_causal);
    if let Some(n) = at.q_num_heads {
        a.i("q_num_heads", n);
    }
    if let Some(n) = at.kv_num_heads {
        a.i("kv_num_heads", n);
    }
    if at.qk_matmul_output_mode != 0 {
        a.i("qk_matmul_output_mode", at.qk_matmul_output_mode);
    }
    if let Some(s) = at.scale {
        a.f("scale", s);
    }
    if at.softcap != 0.0 {
        a.f("softcap", at.softcap);
    }
    if let Some(p) = at.softmax_precision {
        a.0.push(("softmax_precision", AttrValue::DType(p)));
    }
    if at.left_window_size != -1 {
        a.i("left_window_size", at.left_window_size);
    }
    if at.right_window_size != -1 {
        a.i("right_window_size", at.right_window_size);
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.name(), self.attrs_text())
    }
}

pub fn unary_name(u: UnaryOp) -> &'static str {
    use UnaryOp::*;
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

pub fn binary_name(b: BinaryOp) -> &'static str {
    use BinaryOp::*;
    match b {
        Add => "Add", Sub => "Sub", Mul => "Mul", Div => "Div", Pow => "Pow", Equal => "Equal",
        Less => "Less", Greater => "Greater", LessOrEqual => "LessOrEqual",
        GreaterOrEqual => "GreaterOrEqual", And => "And", Or => "Or", Xor => "Xor",
        Mod | Fmod => "Mod", PRelu => "PRelu", BitAnd => "BitwiseAnd", BitOr => "BitwiseOr",
        BitXor => "BitwiseXor", ShiftLeft | ShiftRight => "BitShift",
    }
}

pub fn reduce_name(k: ReduceKind) -> &'static str {
    use ReduceKind::*;
    match k {
        Sum => "ReduceSum", Mean => "ReduceMean", Max => "ReduceMax", Min => "ReduceMin",
        Prod => "ReduceProd", L1 => "ReduceL1", L2 => "ReduceL2", LogSum => "ReduceLogSum",
        LogSumExp => "ReduceLogSumExp", SumSquare => "ReduceSumSquare",
    }
}

pub fn loss_reduction_name(r: LossReduction) -> &'static str {
    match r {
        LossReduction::None => "none",
        LossReduction::Sum => "sum",
        LossReduction::Mean => "mean",
    }
}

pub fn pad_mode_name(m: PadMode) -> &'static str {
    match m {
        PadMode::Constant => "constant",
        PadMode::Reflect => "reflect",
        PadMode::Edge => "edge",
        PadMode::Wrap => "wrap",
    }
}

pub fn scatter_reduction_name(r: ScatterReduction) -> &'static str {
    match r {
        ScatterReduction::None => "none",
        ScatterReduction::Add => "add",
        ScatterReduction::Mul => "mul",
        ScatterReduction::Max => "max",
        ScatterReduction::Min => "min",
    }
}

pub fn rnn_direction_name(d: RnnDirection) -> &'static str {
    match d {
        RnnDirection::Forward => "forward",
        RnnDirection::Reverse => "reverse",
        RnnDirection::Bidirectional => "bidirectional",
    }
}

/// Resize's attributes: only `mode` in the legacy form; otherwise those that differ from
/// their defaults, so a model re-exported at its own opset carries only what it had.
fn resize_attributes(a: &mut Attrs, r: &Resize) {
    a.s("mode", r.mode.name());
    if r.legacy {
        return;
    }
    if r.coord != CoordMode::HalfPixel {
        a.s("coordinate_transformation_mode", r.coord.name());
    }
    if r.nearest != NearestMode::RoundPreferFloor {
        a.s("nearest_mode", r.nearest.name());
    }
    if r.cubic_a != -0.75 {
        a.f("cubic_coeff_a", r.cubic_a);
    }
    a.flag("exclude_outside", r.exclude_outside);
    if r.extrapolation != 0.0 {
        a.f("extrapolation_value", r.extrapolation);
    }
    a.flag("antialias", r.antialias);
    if let Some(axes) = &r.axes {
        a.ints("axes", axes);
    }
    if r.aspect != AspectPolicy::Stretch {
        a.s("keep_aspect_ratio_policy", r.aspect.name());
    }
}

/// ONNX names of the Resize attribute values, and their parsing.
macro_rules! onnx_names {
    ($t:ty { $($v:ident => $n:literal),* }) => {
        impl $t {
            pub const ALL: &'static [$t] = &[$(<$t>::$v),*];
            pub fn name(self) -> &'static str {
                match self { $(<$t>::$v => $n),* }
            }
            pub fn parse(s: &str) -> Option<$t> {
                Self::ALL.iter().copied().find(|v| v.name() == s)
            }
        }
    };
}

onnx_names!(ResizeMode { Nearest => "nearest", Linear => "linear", Cubic => "cubic" });
onnx_names!(CoordMode {
    HalfPixel => "half_pixel", HalfPixelSymmetric => "half_pixel_symmetric",
    PytorchHalfPixel => "pytorch_half_pixel", AlignCorners => "align_corners",
    Asymmetric => "asymmetric", TfCropAndResize => "tf_crop_and_resize"
});
onnx_names!(NearestMode {
    RoundPreferFloor => "round_prefer_floor", RoundPreferCeil => "round_prefer_ceil", Floor => "floor", Ceil => "ceil"
});
onnx_names!(GridPadding { Zeros => "zeros", Border => "border", Reflection => "reflection" });
onnx_names!(AspectPolicy { Stretch => "stretch", NotLarger => "not_larger", NotSmaller => "not_smaller" });

pub fn auto_pad_name(p: AutoPad) -> &'static str {
    match p {
        AutoPad::NotSet => "NOTSET",
        AutoPad::SameUpper => "SAME_UPPER",
        AutoPad::SameLower => "SAME_LOWER",
        AutoPad::Valid => "VALID",
    }
}

/// An attribute value as ONNX has it (`Op::attributes`).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Int(i64),
    Float(f32),
    Str(String),
    Ints(Vec<i64>),
    /// An element type (`Cast`'s `to`; ONNX writes its code).
    DType(DType),
    /// A one-element tensor (`ConstantOfShape`'s `value`).
    Tensor(TensorData),
}

impl fmt::Display for AttrValue {
    /// `1`, `1.0`, `"tanh"`, `[1, 0]`, `f32`, `f32:0.0`: floats always show a `.` or an
    /// exponent, so the text parser tells them from integers.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Int(v) => write!(f, "{v}"),
            AttrValue::Float(v) => write!(f, "{v:?}"),
            AttrValue::Str(s) => write!(f, "{s:?}"),
            AttrValue::Ints(v) => write!(f, "{v:?}"),
            AttrValue::DType(d) => write!(f, "{d}"),
            // A vector of other than one element (TreeEnsemble's tables): `f64:[1.0, 2.5]`.
            AttrValue::Tensor(t) if t.dims.len() == 1 && t.dims[0] != 1 => {
                let items: Vec<String> =
                    t.to_f64s().iter().map(|x| if t.dtype.is_float() { format!("{x:?}") } else { format!("{}", *x as i64) }).collect();
                write!(f, "{}:[{}]", t.dtype, items.join(", "))
            }
            AttrValue::Tensor(t) => {
                let x = t.to_f64s().first().copied().unwrap_or(0.0);
                if t.dtype.is_float() { write!(f, "{}:{x:?}", t.dtype) } else { write!(f, "{}:{}", t.dtype, x as i64) }
            }
        }
    }
}

/// Collects `(name, value)` attribute pairs.
#[derive(Default)]
struct Attrs(Vec<(&'static str, AttrValue)>);

impl Attrs {
    fn i(&mut self, k: &'static str, v: i64) {
        self.0.push((k, AttrValue::Int(v)));
    }
    fn b(&mut self, k: &'static str, v: bool) {
        self.i(k, i64::from(v))
    }
    /// A boolean given only when set (its default is false).
    fn flag(&mut self, k: &'static str, v: bool) {
        if v {
            self.b(k, true);
        }
    }
    fn f(&mut self, k: &'static str, v: f32) {
        self.0.push((k, AttrValue::Float(v)));
    }
    fn s(&mut self, k: &'static str, v: &str) {
        self.0.push((k, AttrValue::Str(v.to_string())));
    }
    fn ints(&mut self, k: &'static str, v: &[i64]) {
        self.0.push((k, AttrValue::Ints(v.to_vec())));
    }
    /// A boolean given only when cleared (its default is true).
    fn unflag(&mut self, k: &'static str, v: bool) {
        if !v {
            self.b(k, false);
        }
    }
    /// A scatter reduction given only when set (the attribute appeared in opset 16).
    /// `saturate` and `round_mode` when not their defaults (so the attributes stay valid at
    /// the opsets before they existed).
    fn cast_mode(&mut self, m: &CastMode) {
        self.unflag("saturate", m.saturate);
        if m.round != RoundMode::Up {
            self.s("round_mode", m.round.name());
        }
    }
    /// The quantization axis and block size when not their defaults (1 and 0).
    fn quant_axis(&mut self, axis: i64, block_size: i64) {
        if axis != 1 {
            self.i("axis", axis);
        }
        if block_size != 0 {
            self.i("block_size", block_size);
        }
    }
    fn reduction(&mut self, r: ScatterReduction) {
        if r != ScatterReduction::None {
            self.s("reduction", scatter_reduction_name(r));
        }
    }
    /// A list given only when not empty (empty means the ONNX default).
    fn v(&mut self, k: &'static str, v: &[i64]) {
        if !v.is_empty() {
            self.ints(k, v);
        }
    }
    fn window(&mut self, w: &Window) {
        self.v("kernel_shape", &w.kernel_shape);
        self.v("strides", &w.strides);
        self.v("pads", &w.pads);
        self.v("dilations", &w.dilations);
        if w.auto_pad != AutoPad::NotSet {
            self.s("auto_pad", auto_pad_name(w.auto_pad));
        }
    }
}

/// Coarse op classes: the unit of profile calibration and of the cost model's flop rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum OpClass {
    MatMul,
    Conv,
    Elementwise,
    Normalization,
    Pool,
    Reduction,
    Gather,
    DataMovement,
}

impl Op {
    /// Whether a split backward defers this op's weight gradient to the weight-gradient
    /// pass when it reads trainable weights: a product's (matrix product or
    /// convolution), a product of its own; other ops' come with the input gradient.
    pub fn defers_weight_gradient(&self) -> bool {
        matches!(self.class(), OpClass::MatMul | OpClass::Conv)
    }

    /// Whether this product's weight gradient is formed directly from its first operand
    /// and its output's gradient, without its graph, when it reads trainable weights at
    /// inputs `weights` (ascending), the one at input 1 of rank `weight_rank`, input 0 of
    /// rank `operand_rank`: `MatMul(x, W)` with `W` 2-D and `x` of rank 2 or more, and
    /// `Gemm(A, B[, C])` with `alpha = 1`, `A` not transposed and 2-D, `B` 2-D and `C`, if a
    /// weight, added with `beta = 1`. A split backward then keeps only those two for it
    /// between its input and weight gradients; the runtime forms them so, and the
    /// planner counts them so.
    pub fn forms_weight_gradient_directly(&self, weights: &[usize], weight_rank: usize, operand_rank: usize) -> bool {
        match (self, weights) {
            (Op::MatMul, [1]) => weight_rank == 2 && operand_rank >= 2,
            (Op::Gemm(g), [1] | [1, 2]) => g.alpha == 1.0 && !g.trans_a && weight_rank == 2 && operand_rank == 2 && (weights.len() == 1 || g.beta == 1.0),
            _ => false,
        }
    }

    /// The op's class: the cost model's unit of flop rules and of profile calibration
    /// (an op not listed is elementwise if it maps elements, else data movement).
    pub fn class(&self) -> OpClass {
        match self {
            Op::MatMul | Op::Gemm(_) | Op::Einsum { .. } | Op::Attention(_) | Op::Rnn(_) | Op::LinearAttention(_) => OpClass::MatMul,
            Op::Conv(_) | Op::ConvTranspose(_) | Op::DeformConv { .. } | Op::ConvInteger(_) | Op::QLinearConv(_) => OpClass::Conv,
            Op::CausalConvWithState { .. } => OpClass::Conv,
            Op::Dft { .. } | Op::Stft { .. } | Op::MatMulInteger | Op::QLinearMatMul => OpClass::MatMul,
            Op::Softmax(_)
            | Op::LogSoftmax(_)
            | Op::LayerNormalization(_)
            | Op::RMSNormalization(_)
            | Op::BatchNormalization(_)
            | Op::InstanceNormalization { .. }
            | Op::NegativeLogLikelihoodLoss(_)
            | Op::SoftmaxCrossEntropyLoss(_)
            | Op::GroupNormalization(_)
            | Op::MeanVarianceNormalization { .. }
            | Op::LpNormalization { .. }
            | Op::Lrn(_)
            | Op::Hardmax(_) => OpClass::Normalization,
            Op::MaxPool(_) | Op::AveragePool(_) | Op::GlobalAveragePool | Op::GlobalMaxPool => {
                OpClass::Pool
            }
            Op::Reduce(_)
            | Op::ArgMax { .. }
            | Op::ArgMin { .. }
            | Op::CumSum { .. }
            | Op::CumProd { .. }
            | Op::TopK { .. }
            | Op::Det => OpClass::Reduction,
            Op::Gather { .. }
            | Op::GatherElements { .. }
            | Op::GatherND { .. }
            | Op::ScatterND { .. }
            | Op::ScatterElements { .. }
            | Op::Scatter { .. }
            | Op::TensorScatter { .. }
            | Op::MaxUnpool { .. } => OpClass::Gather,
            Op::RotaryEmbedding(_) | Op::Optimizer(_) | Op::Binarizer { .. } => OpClass::Elementwise,
            Op::QuantizeLinear(_) | Op::DequantizeLinear { .. } | Op::DynamicQuantizeLinear => OpClass::Elementwise,
            Op::ArrayFeatureExtractor | Op::TreeEnsemble(_) => OpClass::Gather,
            Op::Resize(_) | Op::Upsample(_) | Op::GridSample { .. } | Op::RoiAlign(_) => OpClass::Gather,
            op if op.is_elementwise() => OpClass::Elementwise,
            _ => OpClass::DataMovement,
        }
    }
}
