//! Each op's ONNX face: its spec (the schema versions and arity of every op the importer
//! knows, and the first version whose semantics are implemented) and how one ONNX node's
//! attributes become an [`Op`], read as the node's definition version has them (the
//! writing half is [`Op::attributes`], which the text form and the ONNX exporter share).
//!
//! A node is judged by the definition its model's opset selects: the newest schema
//! version `<=` the default-domain opset. If that version predates `supported_from`, the
//! node is reported as unsupported (with the version) rather than interpreted with the
//! semantics of a later definition. Attributes come through [`AttrSource`], so the reader
//! does not depend on protobuf: the importer gives it a node's `AttributeProto`s, the text
//! parser the attributes it parsed.

use crate::dtype::onnx_type_name;
use crate::op::{AspectPolicy, Attention, AutoPad, BatchNorm, BinaryOp, CastMode, ClassLoss, Conv, ConvTranspose, CoordMode, GeluApprox, Gemm, GridPadding, GroupNorm, LayerNorm, LinearAttention, LinearRule, LossReduction, Lrn, NearestMode, Op, OptimizerStep, Pad, PadMode, Pool, Quantize, Reduce, ReduceKind, Resize, ResizeMode, Rnn, RnnCell, RnnDirection, RoiAlign, Rotary, RoundMode, ScatterReduction, Slice, Softmax, Split, TreeEnsemble, UnaryOp, VariadicOp, Window};
use crate::{DType, TensorData};

/// The default-domain opset the version tables below are complete up to (ONNX 1.23).
pub const MAX_KNOWN_OPSET: i64 = 28;

/// One op's spec.
#[derive(Debug)]
pub struct OpSpec {
    pub name: &'static str,
    /// `""` for the default domain; else the op's domain (see [`DOMAIN_SPECS`]).
    pub domain: &'static str,
    /// Every `since_version` of the op's schema in the default domain.
    pub versions: &'static [i64],
    /// The oldest schema version whose semantics are implemented.
    pub supported_from: i64,
    /// Inputs (min, max) of the newest definition; `usize::MAX` means variadic.
    pub inputs: (usize, usize),
    /// Outputs (min, max).
    pub outputs: (usize, usize),
}

impl OpSpec {
    /// The schema version in force at `opset`, if the op exists there.
    pub fn version_at(&self, opset: i64) -> Option<i64> {
        self.versions.iter().copied().filter(|&v| v <= opset).max()
    }
}

const V: usize = usize::MAX;

macro_rules! specs {
    ($($name:literal: [$($v:literal),*] from $from:literal, in $imin:literal..$imax:expr, out $omin:literal..$omax:expr;)*) => {
        /// The table of every op the importer knows, sorted by name.
        pub static SPECS: &[OpSpec] = &[
            $(OpSpec { name: $name, domain: "", versions: &[$($v),*], supported_from: $from, inputs: ($imin, $imax), outputs: ($omin, $omax) },)*
        ];
    };
}

specs! {
    "Abs": [1, 6, 13] from 1, in 1..1, out 1..1;
    "Acos": [7, 22] from 7, in 1..1, out 1..1;
    "Acosh": [9, 22] from 9, in 1..1, out 1..1;
    "Add": [1, 6, 7, 13, 14] from 1, in 2..2, out 1..1;
    "AffineGrid": [20] from 20, in 2..2, out 1..1;
    "And": [1, 7] from 7, in 2..2, out 1..1;
    "ArgMax": [1, 11, 12, 13] from 1, in 1..1, out 1..1;
    "ArgMin": [1, 11, 12, 13] from 1, in 1..1, out 1..1;
    "Asin": [7, 22] from 7, in 1..1, out 1..1;
    "Asinh": [9, 22] from 9, in 1..1, out 1..1;
    "Atan": [7, 22] from 7, in 1..1, out 1..1;
    "Atanh": [9, 22] from 9, in 1..1, out 1..1;
    "Attention": [23, 24, 25] from 23, in 3..7, out 1..4;
    "AveragePool": [1, 7, 10, 11, 19, 22] from 1, in 1..1, out 1..1;
    "BatchNormalization": [1, 6, 7, 9, 14, 15] from 1, in 5..5, out 1..5;
    "BitCast": [26] from 26, in 1..1, out 1..1;
    "BitShift": [11, 28] from 11, in 2..2, out 1..1;
    "BitwiseAnd": [18] from 18, in 2..2, out 1..1;
    "BitwiseNot": [18] from 18, in 1..1, out 1..1;
    "BitwiseOr": [18] from 18, in 2..2, out 1..1;
    "BitwiseXor": [18] from 18, in 2..2, out 1..1;
    "BlackmanWindow": [17] from 17, in 1..1, out 1..1;
    "Cast": [1, 6, 9, 13, 19, 21, 23, 24, 25, 28] from 6, in 1..1, out 1..1;
    "CastLike": [15, 19, 21, 23, 24, 25] from 15, in 2..2, out 1..1;
    "CausalConvWithState": [27] from 27, in 2..4, out 1..2;
    "Ceil": [1, 6, 13] from 1, in 1..1, out 1..1;
    "Celu": [12, 28] from 12, in 1..1, out 1..1;
    "CenterCropPad": [18] from 18, in 2..2, out 1..1;
    "Clip": [1, 6, 11, 12, 13] from 1, in 1..3, out 1..1;
    "Col2Im": [18] from 18, in 3..3, out 1..1;
    "Compress": [9, 11, 28] from 9, in 2..2, out 1..1;
    "Concat": [1, 4, 11, 13] from 4, in 1..V, out 1..1;
    "ConcatFromSequence": [11] from 11, in 1..1, out 1..1;
    "Constant": [1, 9, 11, 12, 13, 19, 21, 23, 24, 25] from 1, in 0..0, out 1..1;
    "ConstantOfShape": [9, 20, 21, 23, 24, 25] from 9, in 1..1, out 1..1;
    "Conv": [1, 11, 22] from 1, in 2..3, out 1..1;
    "ConvInteger": [10] from 10, in 2..4, out 1..1;
    "ConvTranspose": [1, 11, 22] from 1, in 2..3, out 1..1;
    "Cos": [7, 22] from 7, in 1..1, out 1..1;
    "Cosh": [9, 22] from 9, in 1..1, out 1..1;
    "CumProd": [26] from 26, in 2..2, out 1..1;
    "CumSum": [11, 14] from 11, in 2..2, out 1..1;
    "DFT": [17, 20] from 17, in 1..3, out 1..1;
    "DeformConv": [19, 22] from 19, in 3..5, out 1..1;
    "DepthToSpace": [1, 11, 13, 28] from 1, in 1..1, out 1..1;
    "DequantizeLinear": [10, 13, 19, 21, 23, 24, 25, 28] from 10, in 2..3, out 1..1;
    "Det": [11, 22] from 11, in 1..1, out 1..1;
    "Div": [1, 6, 7, 13, 14] from 1, in 2..2, out 1..1;
    "Dropout": [1, 6, 7, 10, 12, 13, 22] from 7, in 1..3, out 1..2;
    "DynamicQuantizeLinear": [11] from 11, in 1..1, out 3..3;
    "Einsum": [12, 28] from 12, in 1..V, out 1..1;
    "Elu": [1, 6, 22] from 1, in 1..1, out 1..1;
    "Equal": [1, 7, 11, 13, 19] from 7, in 2..2, out 1..1;
    "Erf": [9, 13] from 9, in 1..1, out 1..1;
    "Exp": [1, 6, 13] from 1, in 1..1, out 1..1;
    "Expand": [8, 13] from 8, in 2..2, out 1..1;
    "EyeLike": [9, 22] from 9, in 1..1, out 1..1;
    "Flatten": [1, 9, 11, 13, 21, 23, 24, 25] from 1, in 1..1, out 1..1;
    "Floor": [1, 6, 13] from 1, in 1..1, out 1..1;
    "GRU": [1, 3, 7, 14, 22] from 7, in 3..6, out 0..2;
    "Gather": [1, 11, 13] from 1, in 2..2, out 1..1;
    "GatherElements": [11, 13] from 11, in 2..2, out 1..1;
    "GatherND": [11, 12, 13] from 11, in 2..2, out 1..1;
    "Gelu": [20] from 20, in 1..1, out 1..1;
    "Gemm": [1, 6, 7, 9, 11, 13] from 1, in 2..3, out 1..1;
    "GlobalAveragePool": [1, 22] from 1, in 1..1, out 1..1;
    "GlobalMaxPool": [1, 22] from 1, in 1..1, out 1..1;
    "Greater": [1, 7, 9, 13] from 7, in 2..2, out 1..1;
    "GreaterOrEqual": [12, 16] from 12, in 2..2, out 1..1;
    "GridSample": [16, 20, 22] from 16, in 2..2, out 1..1;
    "GroupNormalization": [18, 21] from 18, in 3..3, out 1..1;
    "HammingWindow": [17] from 17, in 1..1, out 1..1;
    "HannWindow": [17] from 17, in 1..1, out 1..1;
    "HardSigmoid": [1, 6, 22] from 1, in 1..1, out 1..1;
    "HardSwish": [14, 22] from 14, in 1..1, out 1..1;
    "Hardmax": [1, 11, 13] from 1, in 1..1, out 1..1;
    "Identity": [1, 13, 14, 16, 19, 21, 23, 24, 25] from 1, in 1..1, out 1..1;
    "If": [1, 11, 13, 16, 19, 21, 23, 24, 25] from 1, in 1..1, out 1..V;
    "InstanceNormalization": [1, 6, 22] from 1, in 3..3, out 1..1;
    "IsInf": [10, 20] from 10, in 1..1, out 1..1;
    "IsNaN": [9, 13, 20] from 9, in 1..1, out 1..1;
    "LRN": [1, 13] from 1, in 1..1, out 1..1;
    "LSTM": [1, 7, 14, 22] from 7, in 3..8, out 0..3;
    "LayerNormalization": [17] from 17, in 2..3, out 1..3;
    "LeakyRelu": [1, 6, 16] from 1, in 1..1, out 1..1;
    "Less": [1, 7, 9, 13] from 7, in 2..2, out 1..1;
    "LessOrEqual": [12, 16] from 12, in 2..2, out 1..1;
    "LinearAttention": [27] from 27, in 3..6, out 1..2;
    "Log": [1, 6, 13] from 1, in 1..1, out 1..1;
    "LogSoftmax": [1, 11, 13] from 1, in 1..1, out 1..1;
    "Loop": [1, 11, 13, 16, 19, 21, 23, 24, 25] from 1, in 2..V, out 1..V;
    "LpNormalization": [1, 22] from 1, in 1..1, out 1..1;
    "LpPool": [1, 2, 11, 18, 22] from 2, in 1..1, out 1..1;
    "MatMul": [1, 9, 13] from 1, in 2..2, out 1..1;
    "MatMulInteger": [10] from 10, in 2..4, out 1..1;
    "Max": [1, 6, 8, 12, 13] from 1, in 1..V, out 1..1;
    "MaxPool": [1, 8, 10, 11, 12, 22] from 1, in 1..1, out 1..2;
    "MaxUnpool": [9, 11, 22] from 9, in 2..3, out 1..1;
    "Mean": [1, 6, 8, 13] from 1, in 1..V, out 1..1;
    "MeanVarianceNormalization": [9, 13] from 9, in 1..1, out 1..1;
    "MelWeightMatrix": [17] from 17, in 5..5, out 1..1;
    "Min": [1, 6, 8, 12, 13] from 1, in 1..V, out 1..1;
    "Mish": [18, 22] from 18, in 1..1, out 1..1;
    "Mod": [10, 13, 28] from 10, in 2..2, out 1..1;
    "Mul": [1, 6, 7, 13, 14] from 1, in 2..2, out 1..1;
    "Neg": [1, 6, 13] from 1, in 1..1, out 1..1;
    "NegativeLogLikelihoodLoss": [12, 13, 22] from 12, in 2..3, out 1..1;
    "NonMaxSuppression": [10, 11] from 10, in 2..5, out 1..1;
    "NonZero": [9, 13] from 9, in 1..1, out 1..1;
    "Not": [1] from 1, in 1..1, out 1..1;
    "OneHot": [9, 11, 28] from 9, in 3..3, out 1..1;
    "Optional": [15, 28] from 15, in 0..1, out 1..1;
    "OptionalGetElement": [15, 18, 28] from 15, in 1..1, out 1..1;
    "OptionalHasElement": [15, 18, 28] from 15, in 0..1, out 1..1;
    "Or": [1, 7] from 7, in 2..2, out 1..1;
    "PRelu": [1, 6, 7, 9, 16] from 1, in 2..2, out 1..1;
    "Pad": [1, 2, 11, 13, 18, 19, 21, 23, 24, 25] from 2, in 1..4, out 1..1;
    "Pow": [1, 7, 12, 13, 15] from 1, in 2..2, out 1..1;
    "QLinearConv": [10] from 10, in 8..9, out 1..1;
    "QLinearMatMul": [10, 21] from 10, in 8..8, out 1..1;
    "QuantizeLinear": [10, 13, 19, 21, 23, 24, 25, 28] from 10, in 2..3, out 1..1;
    "RMSNormalization": [23] from 23, in 2..2, out 1..1;
    "RNN": [1, 7, 14, 22] from 7, in 3..6, out 0..2;
    "Range": [11, 27] from 11, in 3..3, out 1..1;
    "Reciprocal": [1, 6, 13] from 1, in 1..1, out 1..1;
    "ReduceL1": [1, 11, 13, 18] from 1, in 1..2, out 1..1;
    "ReduceL2": [1, 11, 13, 18] from 1, in 1..2, out 1..1;
    "ReduceLogSum": [1, 11, 13, 18, 28] from 1, in 1..2, out 1..1;
    "ReduceLogSumExp": [1, 11, 13, 18, 28] from 1, in 1..2, out 1..1;
    "ReduceMax": [1, 11, 12, 13, 18, 20] from 1, in 1..2, out 1..1;
    "ReduceMean": [1, 11, 13, 18] from 1, in 1..2, out 1..1;
    "ReduceMin": [1, 11, 12, 13, 18, 20] from 1, in 1..2, out 1..1;
    "ReduceProd": [1, 11, 13, 18] from 1, in 1..2, out 1..1;
    "ReduceSum": [1, 11, 13] from 1, in 1..2, out 1..1;
    "ReduceSumSquare": [1, 11, 13, 18] from 1, in 1..2, out 1..1;
    "Relu": [1, 6, 13, 14] from 1, in 1..1, out 1..1;
    "Reshape": [1, 5, 13, 14, 19, 21, 23, 24, 25] from 5, in 2..2, out 1..1;
    "Resize": [10, 11, 13, 18, 19] from 10, in 1..4, out 1..1;
    "ReverseSequence": [10, 28] from 10, in 2..2, out 1..1;
    "RoiAlign": [10, 16, 22] from 10, in 3..3, out 1..1;
    "RotaryEmbedding": [23] from 23, in 3..4, out 1..1;
    "Round": [11, 22] from 11, in 1..1, out 1..1;
    "STFT": [17] from 17, in 2..4, out 1..1;
    "Scan": [8, 9, 11, 16, 19, 21, 23, 24, 25] from 8, in 1..V, out 1..V;
    "Scatter": [9, 11] from 9, in 3..3, out 1..1;
    "ScatterElements": [11, 13, 16, 18] from 11, in 3..3, out 1..1;
    "ScatterND": [11, 13, 16, 18] from 11, in 3..3, out 1..1;
    "Selu": [1, 6, 22] from 1, in 1..1, out 1..1;
    "SequenceAt": [11] from 11, in 2..2, out 1..1;
    "SequenceConstruct": [11] from 11, in 1..V, out 1..1;
    "SequenceEmpty": [11] from 11, in 0..0, out 1..1;
    "SequenceErase": [11] from 11, in 1..2, out 1..1;
    "SequenceInsert": [11] from 11, in 2..3, out 1..1;
    "SequenceLength": [11] from 11, in 1..1, out 1..1;
    "Shape": [1, 13, 15, 19, 21, 23, 24, 25] from 1, in 1..1, out 1..1;
    "Shrink": [9] from 9, in 1..1, out 1..1;
    "Sigmoid": [1, 6, 13] from 1, in 1..1, out 1..1;
    "Sign": [9, 13] from 9, in 1..1, out 1..1;
    "Sin": [7, 22] from 7, in 1..1, out 1..1;
    "Sinh": [9, 22] from 9, in 1..1, out 1..1;
    "Size": [1, 13, 19, 21, 23, 24, 25] from 1, in 1..1, out 1..1;
    "Slice": [1, 10, 11, 13] from 1, in 1..5, out 1..1;
    "Softmax": [1, 11, 13] from 1, in 1..1, out 1..1;
    "SoftmaxCrossEntropyLoss": [12, 13] from 12, in 2..3, out 1..2;
    "Softplus": [1, 22] from 1, in 1..1, out 1..1;
    "Softsign": [1, 22] from 1, in 1..1, out 1..1;
    "SpaceToDepth": [1, 13, 28] from 1, in 1..1, out 1..1;
    "Split": [1, 2, 11, 13, 18] from 2, in 1..2, out 1..V;
    "SplitToSequence": [11, 24] from 11, in 1..2, out 1..1;
    "Sqrt": [1, 6, 13] from 1, in 1..1, out 1..1;
    "Squeeze": [1, 11, 13, 21, 23, 24, 25] from 1, in 1..2, out 1..1;
    "Sub": [1, 6, 7, 13, 14] from 1, in 2..2, out 1..1;
    "Sum": [1, 6, 8, 13] from 1, in 1..V, out 1..1;
    "SwiGLU": [28] from 28, in 2..2, out 1..1;
    "Swish": [24] from 24, in 1..1, out 1..1;
    "Tan": [7, 22] from 7, in 1..1, out 1..1;
    "Tanh": [1, 6, 13] from 1, in 1..1, out 1..1;
    "TensorScatter": [24] from 24, in 2..3, out 1..1;
    "ThresholdedRelu": [10, 22] from 10, in 1..1, out 1..1;
    "Tile": [1, 6, 13] from 6, in 2..2, out 1..1;
    "TopK": [1, 10, 11, 24] from 10, in 2..2, out 2..2;
    "Transpose": [1, 13, 21, 23, 24, 25] from 1, in 1..1, out 1..1;
    "Trilu": [14] from 14, in 1..2, out 1..1;
    "Unique": [11, 28] from 11, in 1..1, out 1..4;
    "Unsqueeze": [1, 11, 13, 21, 23, 24, 25] from 1, in 1..2, out 1..1;
    "Upsample": [1, 7, 9, 10] from 9, in 2..2, out 1..1;
    "Where": [9, 16] from 9, in 3..3, out 1..1;
    "Xor": [1, 7] from 7, in 2..2, out 1..1;
}

/// The ops of other domains the importer accepts, sorted by name (their names clash with
/// no default-domain op). Versions are of the op's own domain's opset.
pub static DOMAIN_SPECS: &[OpSpec] = &[
    OpSpec { name: "Adagrad", domain: TRAINING, versions: &[1], supported_from: 1, inputs: (3, V), outputs: (1, V) },
    OpSpec { name: "Adam", domain: TRAINING, versions: &[1], supported_from: 1, inputs: (3, V), outputs: (1, V) },
    OpSpec { name: "ArrayFeatureExtractor", domain: ML, versions: &[1], supported_from: 1, inputs: (2, 2), outputs: (1, 1) },
    OpSpec { name: "Binarizer", domain: ML, versions: &[1], supported_from: 1, inputs: (1, 1), outputs: (1, 1) },
    OpSpec { name: "FlexAttention", domain: PREVIEW, versions: &[1], supported_from: 1, inputs: (3, 3), outputs: (1, 1) },
    OpSpec { name: "Momentum", domain: TRAINING, versions: &[1], supported_from: 1, inputs: (3, V), outputs: (1, V) },
    OpSpec { name: "TreeEnsemble", domain: ML, versions: &[5], supported_from: 5, inputs: (1, 1), outputs: (1, 1) },
];

/// The domain of ONNX's training operators.
pub const TRAINING: &str = "ai.onnx.preview.training";
/// The domain of ONNX's preview operators.
pub const PREVIEW: &str = "ai.onnx.preview";
/// The domain of ONNX's traditional machine-learning operators.
pub const ML: &str = "ai.onnx.ml";

/// Looks up the spec of an op type: a default-domain op, or one of [`DOMAIN_SPECS`].
pub fn spec(op_type: &str) -> Option<&'static OpSpec> {
    match SPECS.binary_search_by(|s| s.name.cmp(op_type)) {
        Ok(i) => Some(&SPECS[i]),
        Err(_) => DOMAIN_SPECS.binary_search_by(|s| s.name.cmp(op_type)).ok().map(|i| &DOMAIN_SPECS[i]),
    }
}

/// The spec of `op_type` in `domain` (`""` or `"ai.onnx"` for the default domain).
pub fn spec_in(domain: &str, op_type: &str) -> Option<&'static OpSpec> {
    let domain = if domain == "ai.onnx" { "" } else { domain };
    spec(op_type).filter(|s| s.domain == domain)
}

/// A node's attributes, as the op readers ask for them. Each getter marks the attribute as
/// understood; the source then reports any attribute nobody asked for, so an attribute
/// whose meaning is not implemented is an error rather than silently ignored.
pub trait AttrSource {
    fn int(&mut self, name: &str) -> Result<Option<i64>, String>;
    fn float(&mut self, name: &str) -> Result<Option<f32>, String>;
    fn ints(&mut self, name: &str) -> Result<Option<Vec<i64>>, String>;
    fn string(&mut self, name: &str) -> Result<Option<String>, String>;
    fn strings(&mut self, name: &str) -> Result<Option<Vec<String>>, String>;
    fn tensor(&mut self, name: &str) -> Result<Option<TensorData>, String>;
    /// Marks an attribute that carries no semantics here (a hint) as understood.
    fn ignore(&mut self, name: &str);

    fn int_or(&mut self, name: &str, default: i64) -> Result<i64, String> {
        Ok(self.int(name)?.unwrap_or(default))
    }

    fn bool_or(&mut self, name: &str, default: bool) -> Result<bool, String> {
        Ok(self.int(name)?.map(|v| v != 0).unwrap_or(default))
    }

    fn float_or(&mut self, name: &str, default: f32) -> Result<f32, String> {
        Ok(self.float(name)?.unwrap_or(default))
    }

    fn ints_or_empty(&mut self, name: &str) -> Result<Vec<i64>, String> {
        Ok(self.ints(name)?.unwrap_or_default())
    }
}

/// Reads the op of a (non-Constant, non-control-flow) node of type `op_type` whose schema
/// version at the model's opset is `version`, with `n_inputs` inputs.
pub fn read_op(op_type: &str, version: i64, a: &mut dyn AttrSource, n_inputs: usize) -> Result<Op, String> {
    convert_op(op_type, version, a, n_inputs)
}

fn convert_op(op_type: &str, version: i64, a: &mut dyn AttrSource, n_inputs: usize) -> Result<Op, String> {
    if let Some(u) = unary(op_type) {
        return Ok(Op::Unary(u));
    }
    if let Some(b) = binary(op_type) {
        if version < 7 {
            // Applied by the importer as an Unsqueeze of input 1 (see `legacy`).
            a.ignore("broadcast");
            a.ignore("axis");
        }
        return Ok(Op::Binary(b));
    }
    Ok(match op_type {
        "Mod" => Op::Binary(if a.bool_or("fmod", false)? { BinaryOp::Fmod } else { BinaryOp::Mod }),
        "BitShift" => Op::Binary(match a.string("direction")?.as_deref() {
            Some("LEFT") => BinaryOp::ShiftLeft,
            Some("RIGHT") => BinaryOp::ShiftRight,
            other => return Err(format!("BitShift direction {other:?} is not LEFT or RIGHT")),
        }),
        "Sum" => Op::Variadic(VariadicOp::Sum),
        "Max" => Op::Variadic(VariadicOp::Max),
        "Min" => Op::Variadic(VariadicOp::Min),
        "Mean" => Op::Variadic(VariadicOp::Mean),
        "LeakyRelu" => Op::LeakyRelu { alpha: a.float_or("alpha", 0.01)? },
        "Elu" => Op::Elu { alpha: a.float_or("alpha", 1.0)? },
        "Celu" => Op::Celu { alpha: a.float_or("alpha", 1.0)? },
        "Selu" => Op::Selu { alpha: a.float_or("alpha", 1.673_263_2)?, gamma: a.float_or("gamma", 1.050_701)? },
        "HardSigmoid" => Op::HardSigmoid { alpha: a.float_or("alpha", 0.2)?, beta: a.float_or("beta", 0.5)? },
        "ThresholdedRelu" => Op::ThresholdedRelu { alpha: a.float_or("alpha", 1.0)? },
        "Gelu" => Op::Gelu {
            approximate: match a.string("approximate")?.as_deref() {
                None | Some("none") => GeluApprox::None,
                Some("tanh") => GeluApprox::Tanh,
                Some(other) => return Err(format!("approximate={other:?} is not a Gelu mode")),
            },
        },
        "Clip" if version < 11 => Op::Clip { min: Some(a.float_or("min", f32::MIN)?), max: Some(a.float_or("max", f32::MAX)?) },
        "Clip" => Op::Clip { min: None, max: None },
        "IsInf" => Op::IsInf {
            detect_positive: a.bool_or("detect_positive", true)?,
            detect_negative: a.bool_or("detect_negative", true)?,
        },
        "Softmax" | "LogSoftmax" => {
            let s = Softmax { axis: a.int_or("axis", if version < 13 { 1 } else { -1 })?, coerce_2d: version < 13 };
            if op_type == "Softmax" { Op::Softmax(s) } else { Op::LogSoftmax(s) }
        }
        "MatMul" => Op::MatMul,
        "Gemm" => {
            // Before opset 7 C broadcasts only with `broadcast = 1`; without it C has the
            // output's shape, a case of the unidirectional broadcast of later opsets.
            a.ignore("broadcast");
            Op::Gemm(Gemm {
                alpha: a.float_or("alpha", 1.0)?,
                beta: a.float_or("beta", 1.0)?,
                trans_a: a.bool_or("transA", false)?,
                trans_b: a.bool_or("transB", false)?,
            })
        }
        "Conv" => Op::Conv(Conv { window: window(a)?, group: a.int_or("group", 1)? }),
        "DeformConv" => {
            let w = window(a)?;
            // DeformConv's schema has no auto_pad: its pads are always explicit.
            if w.auto_pad != AutoPad::NotSet {
                return Err("attribute \"auto_pad\" is not supported (DeformConv has explicit pads only)".into());
            }
            Op::DeformConv { conv: Conv { window: w, group: a.int_or("group", 1)? }, offset_group: a.int_or("offset_group", 1)? }
        }
        "ConvInteger" => Op::ConvInteger(Conv { window: window(a)?, group: a.int_or("group", 1)? }),
        "QLinearConv" => Op::QLinearConv(Conv { window: window(a)?, group: a.int_or("group", 1)? }),
        "MatMulInteger" => Op::MatMulInteger,
        "QLinearMatMul" => Op::QLinearMatMul,
        "MaxUnpool" => Op::MaxUnpool {
            kernel_shape: a.ints("kernel_shape")?.ok_or("attribute \"kernel_shape\" is required")?,
            strides: a.ints_or_empty("strides")?,
            pads: a.ints_or_empty("pads")?,
        },
        "Swish" => Op::Swish { alpha: a.float_or("alpha", 1.0)? },
        "SwiGLU" => Op::SwiGlu { alpha: a.float_or("alpha", 1.0)? },
        "ConvTranspose" => Op::ConvTranspose(ConvTranspose {
            window: window(a)?,
            group: a.int_or("group", 1)?,
            output_padding: a.ints_or_empty("output_padding")?,
            output_shape: a.ints_or_empty("output_shape")?,
        }),
        "MaxPool" => {
            if a.int_or("storage_order", 0)? != 0 {
                return Err("storage_order=1 (column-major indices) is not supported".into());
            }
            Op::MaxPool(Pool { window: window(a)?, ceil_mode: a.bool_or("ceil_mode", false)?, count_include_pad: false })
        }
        "AveragePool" => Op::AveragePool(Pool {
            window: window(a)?,
            ceil_mode: a.bool_or("ceil_mode", false)?,
            count_include_pad: a.bool_or("count_include_pad", false)?,
        }),
        "LpPool" => {
            let p = a.int_or("p", 2)?;
            if p <= 0 {
                return Err(format!("p = {p} is not positive"));
            }
            Op::LpPool { pool: Pool { window: window(a)?, ceil_mode: a.bool_or("ceil_mode", false)?, count_include_pad: false }, p }
        }
        "GlobalAveragePool" => Op::GlobalAveragePool,
        "GlobalMaxPool" => Op::GlobalMaxPool,
        "BatchNormalization" => {
            if version < 9 && !a.bool_or("spatial", true)? {
                return Err("spatial=0 (per-activation statistics) is not supported".into());
            }
            // Opsets before 7 mark inference with `is_test`; the runtime's mode decides.
            a.ignore("is_test");
            Op::BatchNormalization(BatchNorm {
                epsilon: a.float_or("epsilon", 1e-5)?,
                momentum: a.float_or("momentum", 0.9)?,
                training_mode: a.bool_or("training_mode", false)?,
            })
        }
        "NegativeLogLikelihoodLoss" => Op::NegativeLogLikelihoodLoss(class_loss(a)?),
        "SoftmaxCrossEntropyLoss" => Op::SoftmaxCrossEntropyLoss(class_loss(a)?),
        "LayerNormalization" => Op::LayerNormalization(LayerNorm {
            axis: a.int_or("axis", -1)?,
            epsilon: a.float_or("epsilon", 1e-5)?,
            stash_type: a.int_or("stash_type", 1)?,
        }),
        "RMSNormalization" => Op::RMSNormalization(LayerNorm {
            axis: a.int_or("axis", -1)?,
            epsilon: a.float_or("epsilon", 1e-5)?,
            stash_type: float_code(a.int_or("stash_type", 1)?, "stash_type")?,
        }),
        "Attention" => Op::Attention(attention(version, a, n_inputs)?),
        "RotaryEmbedding" => {
            let r = Rotary {
                interleaved: a.bool_or("interleaved", false)?,
                rotary_embedding_dim: a.int_or("rotary_embedding_dim", 0)?,
                num_heads: a.int("num_heads")?,
            };
            if r.rotary_embedding_dim < 0 || r.rotary_embedding_dim % 2 != 0 || r.num_heads.is_some_and(|n| n <= 0) {
                return Err(format!("rotary_embedding_dim={} must be even and >= 0, num_heads > 0", r.rotary_embedding_dim));
            }
            Op::RotaryEmbedding(r)
        }
        "LinearAttention" => Op::LinearAttention(linear_attention(a)?),
        "Adagrad" => Op::Optimizer(OptimizerStep::Adagrad {
            decay_factor: a.float_or("decay_factor", 0.0)?,
            epsilon: a.float_or("epsilon", 1e-6)?,
            norm_coefficient: a.float_or("norm_coefficient", 0.0)?,
        }),
        "Adam" => Op::Optimizer(OptimizerStep::Adam {
            alpha: a.float_or("alpha", 0.9)?,
            beta: a.float_or("beta", 0.999)?,
            epsilon: a.float_or("epsilon", 1e-6)?,
            norm_coefficient: a.float_or("norm_coefficient", 0.0)?,
            norm_coefficient_post: a.float_or("norm_coefficient_post", 0.0)?,
        }),
        "Momentum" => {
            let required = |a: &mut dyn AttrSource, name: &str| a.float(name)?.ok_or_else(|| format!("attribute {name:?} is required"));
            Op::Optimizer(OptimizerStep::Momentum {
                alpha: required(a, "alpha")?,
                beta: required(a, "beta")?,
                norm_coefficient: required(a, "norm_coefficient")?,
                nesterov: match a.string("mode")?.as_deref() {
                    Some("standard") => false,
                    Some("nesterov") => true,
                    other => return Err(format!("mode {other:?} is not \"standard\" or \"nesterov\"")),
                },
            })
        }
        "Binarizer" => Op::Binarizer { threshold: a.float_or("threshold", 0.0)? },
        "ArrayFeatureExtractor" => Op::ArrayFeatureExtractor,
        "TreeEnsemble" => Op::TreeEnsemble(Box::new(tree_ensemble(a)?)),
        "CausalConvWithState" => Op::CausalConvWithState {
            silu: match a.string("activation")?.as_deref().unwrap_or("none") {
                "none" => false,
                "silu" | "swish" => true,
                other => return Err(format!("activation {other:?} is not one of none, silu, swish")),
            },
        },
        "InstanceNormalization" => Op::InstanceNormalization { epsilon: a.float_or("epsilon", 1e-5)? },
        "Dropout" if version < 12 => Op::Dropout { ratio: Some(a.float_or("ratio", 0.5)?), seed: None },
        "Dropout" => Op::Dropout { ratio: None, seed: a.int("seed")? },
        "Reshape" => Op::Reshape { allow_zero: a.bool_or("allowzero", false)? },
        "Flatten" => Op::Flatten { axis: a.int_or("axis", 1)? },
        "Transpose" => Op::Transpose { perm: a.ints("perm")? },
        "Squeeze" if version < 13 => Op::Squeeze { axes: a.ints("axes")? },
        "Squeeze" => Op::Squeeze { axes: None },
        "Unsqueeze" if version < 13 => Op::Unsqueeze { axes: Some(a.ints("axes")?.ok_or("attribute \"axes\" is required")?) },
        "Unsqueeze" => {
            if n_inputs < 2 {
                return Err("input \"axes\" is required from opset 13".into());
            }
            Op::Unsqueeze { axes: None }
        }
        "Concat" => Op::Concat { axis: a.int("axis")?.ok_or("attribute \"axis\" is required")? },
        "Split" => Op::Split(Split {
            axis: a.int_or("axis", 0)?,
            split: if version < 13 { a.ints("split")? } else { None },
            num_outputs: if version >= 18 { a.int("num_outputs")? } else { None },
        }),
        "Slice" if version < 10 => {
            let starts = a.ints("starts")?.ok_or("attribute \"starts\" is required")?;
            let ends = a.ints("ends")?.ok_or("attribute \"ends\" is required")?;
            Op::Slice(Slice { attrs: Some((starts, ends, a.ints("axes")?)) })
        }
        "Slice" => Op::Slice(Slice { attrs: None }),
        "Gather" => Op::Gather { axis: a.int_or("axis", 0)? },
        "GatherElements" => Op::GatherElements { axis: a.int_or("axis", 0)? },
        "Resize" => Op::Resize(resize(a, version)?),
        "GridSample" => grid_sample(a, version)?,
        "DFT" => Op::Dft {
            inverse: a.bool_or("inverse", false)?,
            onesided: a.bool_or("onesided", false)?,
            axis: if version < 20 { Some(a.int_or("axis", 1)?) } else { None },
        },
        "STFT" => Op::Stft { onesided: a.bool_or("onesided", true)? },
        "RoiAlign" => roi_align(a, version)?,
        "Col2Im" => Op::Col2Im {
            dilations: a.ints("dilations")?.unwrap_or_default(),
            pads: a.ints("pads")?.unwrap_or_default(),
            strides: a.ints("strides")?.unwrap_or_default(),
        },
        "CenterCropPad" => Op::CenterCropPad { axes: a.ints("axes")? },
        "AffineGrid" => Op::AffineGrid { align_corners: a.bool_or("align_corners", false)? },
        "DepthToSpace" | "SpaceToDepth" => {
            let blocksize = a.int("blocksize")?.ok_or("attribute \"blocksize\" is required")?;
            if blocksize <= 0 {
                return Err(format!("blocksize {blocksize} is not positive"));
            }
            let has_mode = version >= if op_type == "DepthToSpace" { 11 } else { 28 };
            let crd = match a.string("mode")?.as_deref() {
                None | Some("DCR") => false,
                Some("CRD") if has_mode => true,
                Some(other) => return Err(format!("mode={other:?} is not a {op_type} mode at this opset")),
            };
            if op_type == "DepthToSpace" { Op::DepthToSpace { blocksize, crd } } else { Op::SpaceToDepth { blocksize, crd } }
        }
        "Upsample" => Op::Upsample(resize(a, 10)?),
        "GatherND" => Op::GatherND { batch_dims: a.int_or("batch_dims", 0)? },
        "Expand" => Op::Expand,
        "Where" => Op::Where,
        "Cast" => {
            let code = a.int("to")?.ok_or("attribute \"to\" is required")?;
            let to = DType::from_onnx(code as i32)
                .ok_or_else(|| format!("cast to {} is not supported", onnx_type_name(code as i32)))?;
            Op::Cast { to, mode: cast_mode(a)? }
        }
        "CastLike" => Op::CastLike { mode: cast_mode(a)? },
        "BitCast" => {
            let code = a.int("to")?.ok_or("attribute \"to\" is required")?;
            let to = DType::from_onnx(code as i32).ok_or_else(|| format!("bitcast to {} is not supported", onnx_type_name(code as i32)))?;
            Op::BitCast { to }
        }
        "QuantizeLinear" => {
            let (axis, block_size) = quant_axis(a)?;
            let saturate = a.bool_or("saturate", true)?;
            let output_dtype = a.int("output_dtype")?.filter(|&c| c != 0).map(|c| quant_dtype(c, "output_dtype")).transpose()?;
            let precision = match a.int("precision")?.filter(|&c| c != 0) {
                Some(code) => DType::from_onnx(float_code(code, "precision")? as i32),
                None => None,
            };
            Op::QuantizeLinear(Quantize { axis, block_size, saturate, output_dtype, precision })
        }
        "DequantizeLinear" => {
            let (axis, block_size) = quant_axis(a)?;
            let output_dtype = match a.int("output_dtype")?.filter(|&c| c != 0) {
                Some(code) => DType::from_onnx(float_code(code, "output_dtype")? as i32),
                None => None,
            };
            Op::DequantizeLinear { axis, block_size, output_dtype }
        }
        "DynamicQuantizeLinear" => Op::DynamicQuantizeLinear,
        "Shape" => Op::Shape { start: a.int_or("start", 0)?, end: a.int("end")? },
        "Size" => Op::Size,
        "ConstantOfShape" => Op::ConstantOfShape { value: a.tensor("value")? },
        "Range" => {
            // stash_type (opset 27) only widens the accumulator of narrow floats.
            a.ignore("stash_type");
            Op::Range
        }
        "ArgMax" | "ArgMin" => {
            let (axis, keepdims, select_last_index) =
                (a.int_or("axis", 0)?, a.bool_or("keepdims", true)?, a.bool_or("select_last_index", false)?);
            if op_type == "ArgMax" {
                Op::ArgMax { axis, keepdims, select_last_index }
            } else {
                Op::ArgMin { axis, keepdims, select_last_index }
            }
        }
        "Trilu" => Op::Trilu { upper: a.bool_or("upper", true)? },
        "Einsum" => Op::Einsum { equation: a.string("equation")?.ok_or("attribute \"equation\" is required")? },
        "Pad" => {
            let mode = match a.string("mode")?.as_deref() {
                None | Some("constant") => PadMode::Constant,
                Some("reflect") => PadMode::Reflect,
                Some("edge") => PadMode::Edge,
                Some("wrap") if version >= 19 => PadMode::Wrap,
                Some(other) => return Err(format!("mode={other:?} is not a Pad mode at this opset")),
            };
            let attrs = if version < 11 {
                Some((a.ints("pads")?.ok_or("attribute \"pads\" is required")?, a.float_or("value", 0.0)?))
            } else {
                None
            };
            Op::Pad(Pad { mode, attrs })
        }
        "Tile" => Op::Tile,
        "CumSum" => Op::CumSum { exclusive: a.bool_or("exclusive", false)?, reverse: a.bool_or("reverse", false)? },
        "CumProd" => Op::CumProd { exclusive: a.bool_or("exclusive", false)?, reverse: a.bool_or("reverse", false)? },
        "TopK" => Op::TopK { axis: a.int_or("axis", -1)?, largest: a.bool_or("largest", true)?, sorted: a.bool_or("sorted", true)? },
        "OneHot" => Op::OneHot { axis: a.int_or("axis", -1)? },
        "ScatterND" => Op::ScatterND { reduction: scatter_reduction(a, version)? },
        "ScatterElements" => Op::ScatterElements { axis: a.int_or("axis", 0)?, reduction: scatter_reduction(a, version)? },
        "Scatter" => Op::Scatter { axis: a.int_or("axis", 0)? },
        "TensorScatter" => Op::TensorScatter {
            axis: a.int_or("axis", -2)?,
            circular: match a.string("mode")?.as_deref() {
                None | Some("linear") => false,
                Some("circular") => true,
                Some(other) => return Err(format!("mode={other:?} is not linear or circular")),
            },
        },
        "Hardmax" => Op::Hardmax(Softmax { axis: a.int_or("axis", if version < 13 { 1 } else { -1 })?, coerce_2d: version < 13 }),
        "LpNormalization" => {
            let p = a.int_or("p", 2)?;
            if p != 1 && p != 2 {
                return Err(format!("p={p} is not a LpNormalization order (1 or 2)"));
            }
            Op::LpNormalization { axis: a.int_or("axis", -1)?, p }
        }
        "Shrink" => Op::Shrink { bias: a.float_or("bias", 0.0)?, lambd: a.float_or("lambd", 0.5)? },
        "LRN" => {
            let size = a.int("size")?.ok_or("attribute \"size\" is required")?;
            if size < 1 {
                return Err(format!("size={size} must be positive"));
            }
            Op::Lrn(Lrn { alpha: a.float_or("alpha", 1e-4)?, beta: a.float_or("beta", 0.75)?, bias: a.float_or("bias", 1.0)?, size })
        }
        "MeanVarianceNormalization" => Op::MeanVarianceNormalization { axes: a.ints("axes")?.unwrap_or_else(|| vec![0, 2, 3]) },
        "EyeLike" => {
            let dtype = match a.int("dtype")? {
                Some(code) => Some(DType::from_onnx(code as i32).ok_or_else(|| format!("dtype {} is not supported", onnx_type_name(code as i32)))?),
                None => None,
            };
            Op::EyeLike { dtype, k: a.int_or("k", 0)? }
        }
        "GroupNormalization" => {
            let num_groups = a.int("num_groups")?.ok_or("attribute \"num_groups\" is required")?;
            if num_groups < 1 {
                return Err(format!("num_groups={num_groups} must be positive"));
            }
            Op::GroupNormalization(GroupNorm {
                epsilon: a.float_or("epsilon", 1e-5)?,
                num_groups,
                stash_type: if version >= 21 { a.int_or("stash_type", 1)? } else { 1 },
                per_channel: version >= 21,
            })
        }
        "ReverseSequence" => Op::ReverseSequence { batch_axis: a.int_or("batch_axis", 1)?, time_axis: a.int_or("time_axis", 0)? },
        "Det" => Op::Det,
        "RNN" => rnn(a, version, RnnCell::Rnn)?,
        "GRU" => rnn(a, version, RnnCell::Gru)?,
        "LSTM" => rnn(a, version, RnnCell::Lstm)?,
        other => match reduce_kind(other) {
            Some(kind) => {
                // ReduceSum took axes as an input from 13, the others from 18.
                let axes_as_input = if kind == ReduceKind::Sum { version >= 13 } else { version >= 18 };
                Op::Reduce(Reduce {
                    kind,
                    axes: if axes_as_input { None } else { a.ints("axes")? },
                    keepdims: a.bool_or("keepdims", true)?,
                    noop_with_empty_axes: axes_as_input && a.bool_or("noop_with_empty_axes", false)?,
                })
            }
            None => return Err(format!("{other} has no converter")),
        },
    })
}

/// Cast's `saturate` and `round_mode` (defaults: saturate, round up).
fn cast_mode(a: &mut dyn AttrSource) -> Result<CastMode, String> {
    let round = match a.string("round_mode")?.as_deref() {
        None | Some("up") => RoundMode::Up,
        Some("down") => RoundMode::Down,
        Some("nearest") => RoundMode::Nearest,
        Some(other) => return Err(format!("round_mode={other:?} is not up, down or nearest")),
    };
    Ok(CastMode { saturate: a.bool_or("saturate", true)?, round })
}

/// The quantization ops' `axis` (default 1) and `block_size` (default 0, no blocks).
fn quant_axis(a: &mut dyn AttrSource) -> Result<(i64, i64), String> {
    let block_size = a.int_or("block_size", 0)?;
    if block_size < 0 {
        return Err(format!("block_size={block_size} must not be negative"));
    }
    Ok((a.int_or("axis", 1)?, block_size))
}

/// QuantizeLinear's `output_dtype`: one of the quantized types.
fn quant_dtype(code: i64, name: &str) -> Result<DType, String> {
    match DType::from_onnx(code as i32) {
        Some(d) if d.is_quantized() => Ok(d),
        _ => Err(format!("{name}={} is not a supported quantized type", onnx_type_name(code as i32))),
    }
}

/// An attribute naming a floating-point type by its ONNX code.
fn float_code(code: i64, name: &str) -> Result<i64, String> {
    match DType::from_onnx(code as i32) {
        Some(d) if d.is_float() => Ok(code),
        _ => Err(format!("{name}={code} is not a supported floating-point type")),
    }
}

/// TreeEnsemble's tables, checked so the kernel's walk stays in range: equal lengths,
/// node and leaf indices in range, known modes, one member set per membership node.
fn tree_ensemble(a: &mut dyn AttrSource) -> Result<TreeEnsemble, String> {
    let tensor = |a: &mut dyn AttrSource, name: &str| a.tensor(name);
    let post = a.int_or("post_transform", 0)?;
    if post != 0 {
        return Err(format!("post_transform {post} is not supported (only NONE, 0)"));
    }
    a.ignore("nodes_hitrates");
    let t = TreeEnsemble {
        featureids: a.ints_or_empty("nodes_featureids")?,
        modes: tensor(a, "nodes_modes")?.ok_or("nodes_modes is required")?,
        splits: tensor(a, "nodes_splits")?.ok_or("nodes_splits is required")?,
        truenodeids: a.ints_or_empty("nodes_truenodeids")?,
        falsenodeids: a.ints_or_empty("nodes_falsenodeids")?,
        trueleafs: a.ints_or_empty("nodes_trueleafs")?,
        falseleafs: a.ints_or_empty("nodes_falseleafs")?,
        missing_tracks_true: a.ints_or_empty("nodes_missing_value_tracks_true")?,
        leaf_targetids: a.ints_or_empty("leaf_targetids")?,
        leaf_weights: tensor(a, "leaf_weights")?.ok_or("leaf_weights is required")?,
        tree_roots: a.ints_or_empty("tree_roots")?,
        membership_values: tensor(a, "membership_values")?,
        n_targets: a.int("n_targets")?.ok_or("n_targets is required")?,
        aggregate_function: a.int_or("aggregate_function", 1)?,
    };
    check_tree_tables(&t)?;
    Ok(t)
}

fn check_tree_tables(t: &TreeEnsemble) -> Result<(), String> {
    let n = t.featureids.len();
    let lens = [t.modes.numel(), t.splits.numel(), t.truenodeids.len(), t.falsenodeids.len(), t.trueleafs.len(), t.falseleafs.len()];
    if lens.iter().any(|&l| l != n) || !(t.missing_tracks_true.is_empty() || t.missing_tracks_true.len() == n) {
        return Err(format!("the nodes_* tables differ in length ({n} feature ids)"));
    }
    let leaves = t.leaf_targetids.len();
    if t.leaf_weights.numel() != leaves || leaves == 0 {
        return Err("leaf_targetids and leaf_weights must be non-empty and of equal length".into());
    }
    if t.n_targets <= 0 || t.leaf_targetids.iter().any(|&id| !(0..t.n_targets).contains(&id)) {
        return Err(format!("n_targets {} must be positive and bound every leaf target id", t.n_targets));
    }
    if !(0..=3).contains(&t.aggregate_function) {
        return Err(format!("aggregate_function {} is not 0 to 3", t.aggregate_function));
    }
    let modes = t.modes.to_i64s();
    if modes.iter().any(|m| !(0..=6).contains(m)) {
        return Err("nodes_modes must be 0 to 6".into());
    }
    let in_range = |ids: &[i64], leafs: &[i64]| ids.iter().zip(leafs).all(|(&id, &leaf)| id >= 0 && (id as usize) < if leaf != 0 { leaves } else { n });
    if !in_range(&t.truenodeids, &t.trueleafs) || !in_range(&t.falsenodeids, &t.falseleafs) || t.featureids.iter().any(|&f| f < 0) {
        return Err("a node or leaf index (or a feature id) is out of range".into());
    }
    if t.tree_roots.is_empty() || t.tree_roots.iter().any(|&r| r < 0 || r as usize >= n) {
        return Err("tree_roots must index nodes".into());
    }
    let sets = modes.iter().filter(|&&m| m == 6).count();
    let ends = t.membership_values.as_ref().map_or(0, |m| m.to_f64s().iter().filter(|x| x.is_nan()).count());
    if sets != ends {
        return Err(format!("{sets} set-membership nodes but {ends} NaN-terminated member sets"));
    }
    Ok(())
}

/// LinearAttention's attributes: both head counts are required, the query heads a
/// multiple of the KV heads.
fn linear_attention(a: &mut dyn AttrSource) -> Result<LinearAttention, String> {
    let q_num_heads = a.int("q_num_heads")?.ok_or("q_num_heads is required")?;
    let kv_num_heads = a.int("kv_num_heads")?.ok_or("kv_num_heads is required")?;
    if q_num_heads <= 0 || kv_num_heads <= 0 || q_num_heads % kv_num_heads != 0 {
        return Err(format!("q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads ({kv_num_heads})"));
    }
    let rule = a.string("update_rule")?.unwrap_or_else(|| "gated_delta".into());
    let update_rule = LinearRule::parse(&rule).ok_or_else(|| format!("update_rule {rule:?} is not one of linear, gated, delta, gated_delta"))?;
    Ok(LinearAttention { q_num_heads, kv_num_heads, scale: a.float_or("scale", 0.0)?, update_rule, chunk_size: a.int_or("chunk_size", 64)? })
}

/// Attention's attributes (opset 25 added the window sizes, 24 the `nonpad_kv_seqlen` input).
fn attention(version: i64, a: &mut dyn AttrSource, n_inputs: usize) -> Result<Attention, String> {
    if version < 24 && n_inputs > 6 {
        return Err("input nonpad_kv_seqlen needs Attention-24".into());
    }
    let softmax_precision = match a.int("softmax_precision")? {
        Some(code) => DType::from_onnx(float_code(code, "softmax_precision")? as i32),
        None => None,
    };
    let window = |a: &mut dyn AttrSource, name: &str| if version >= 25 { a.int_or(name, -1) } else { Ok(-1) };
    let at = Attention {
        is_causal: a.bool_or("is_causal", false)?,
        q_num_heads: a.int("q_num_heads")?,
        kv_num_heads: a.int("kv_num_heads")?,
        qk_matmul_output_mode: a.int_or("qk_matmul_output_mode", 0)?,
        scale: a.float("scale")?,
        softcap: a.float_or("softcap", 0.0)?,
        softmax_precision,
        left_window_size: window(a, "left_window_size")?,
        right_window_size: window(a, "right_window_size")?,
    };
    if !(0..=3).contains(&at.qk_matmul_output_mode) {
        return Err(format!("qk_matmul_output_mode={} is not 0, 1, 2 or 3", at.qk_matmul_output_mode));
    }
    if at.q_num_heads.is_some_and(|n| n <= 0) || at.kv_num_heads.is_some_and(|n| n <= 0) {
        return Err("q_num_heads and kv_num_heads must be positive".into());
    }
    if at.left_window_size < -1 || at.right_window_size < -1 {
        return Err(format!("window sizes {} and {} must be -1 or >= 0", at.left_window_size, at.right_window_size));
    }
    Ok(at)
}

/// ScatterND/ScatterElements `reduction`: `add`/`mul` from opset 16, `max`/`min` from 18.
fn scatter_reduction(a: &mut dyn AttrSource, version: i64) -> Result<ScatterReduction, String> {
    let r = match a.string("reduction")?.as_deref() {
        None | Some("none") => ScatterReduction::None,
        Some("add") if version >= 16 => ScatterReduction::Add,
        Some("mul") if version >= 16 => ScatterReduction::Mul,
        Some("max") if version >= 18 => ScatterReduction::Max,
        Some("min") if version >= 18 => ScatterReduction::Min,
        Some(other) => return Err(format!("reduction={other:?} is not a scatter reduction at this opset")),
    };
    Ok(r)
}

/// RNN/GRU/LSTM. Only the default activations are implemented: an `activations` list is
/// accepted when it names them (per direction), other lists are rejected, and so are
/// `activation_alpha`/`activation_beta` (which only parameterise other activations).
fn rnn(a: &mut dyn AttrSource, version: i64, cell: RnnCell) -> Result<Op, String> {
    let hidden_size = a.int("hidden_size")?.ok_or("attribute \"hidden_size\" is required")?;
    if hidden_size < 1 {
        return Err(format!("hidden_size={hidden_size} must be positive"));
    }
    let direction = match a.string("direction")?.as_deref() {
        None | Some("forward") => RnnDirection::Forward,
        Some("reverse") => RnnDirection::Reverse,
        Some("bidirectional") => RnnDirection::Bidirectional,
        Some(other) => return Err(format!("direction={other:?} is not an RNN direction")),
    };
    let defaults: &[&str] = match cell {
        RnnCell::Rnn => &["Tanh"],
        RnnCell::Gru => &["Sigmoid", "Tanh"],
        RnnCell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
    };
    if let Some(list) = a.strings("activations")? {
        let dirs = if direction == RnnDirection::Bidirectional { 2 } else { 1 };
        let want: Vec<&str> = defaults.iter().copied().cycle().take(defaults.len() * dirs).collect();
        if !list.iter().map(|s| s.as_str()).eq(want.iter().copied()) {
            return Err(format!("activations {list:?} are not supported (only the defaults {defaults:?})"));
        }
    }
    if cell == RnnCell::Lstm && a.bool_or("input_forget", false)? {
        return Err("input_forget=1 (coupled input and forget gates) is not supported".into());
    }
    Ok(Op::Rnn(Rnn {
        cell,
        hidden_size,
        direction,
        batch_major: version >= 14 && a.bool_or("layout", false)?,
        clip: a.float("clip")?,
        linear_before_reset: cell == RnnCell::Gru && a.bool_or("linear_before_reset", false)?,
    }))
}

/// Reads the convolution/pool window attributes.
/// Resize's attributes at schema `version` (10: the legacy form, which Upsample shares).
fn resize(a: &mut dyn AttrSource, version: i64) -> Result<Resize, String> {
    let legacy = version < 11;
    let mode = a.string("mode")?.unwrap_or_else(|| "nearest".into());
    let mode = match ResizeMode::parse(&mode) {
        Some(ResizeMode::Cubic) if legacy => None,
        m => m,
    }
    .ok_or_else(|| format!("mode={mode:?} is not a Resize mode at this opset"))?;
    if legacy {
        let (coord, nearest) = (CoordMode::Asymmetric, NearestMode::Floor);
        return Ok(Resize { mode, coord, nearest, cubic_a: -0.75, exclude_outside: false, extrapolation: 0.0, antialias: false, axes: None, aspect: AspectPolicy::Stretch, legacy });
    }
    let coord = a.string("coordinate_transformation_mode")?.unwrap_or_else(|| "half_pixel".into());
    let coord = match CoordMode::parse(&coord) {
        Some(CoordMode::HalfPixelSymmetric) if version < 19 => None,
        c => c,
    }
    .ok_or_else(|| format!("coordinate_transformation_mode={coord:?} is not known at this opset"))?;
    let nearest = a.string("nearest_mode")?.unwrap_or_else(|| "round_prefer_floor".into());
    let nearest = NearestMode::parse(&nearest).ok_or_else(|| format!("nearest_mode={nearest:?} is not known"))?;
    let (antialias, axes, aspect) = if version >= 18 {
        let policy = a.string("keep_aspect_ratio_policy")?.unwrap_or_else(|| "stretch".into());
        let aspect = AspectPolicy::parse(&policy).ok_or_else(|| format!("keep_aspect_ratio_policy={policy:?} is not known"))?;
        (a.bool_or("antialias", false)?, a.ints("axes")?, aspect)
    } else {
        (false, None, AspectPolicy::Stretch)
    };
    if antialias && mode == ResizeMode::Nearest {
        return Err("antialias applies to the linear and cubic modes, not nearest".into());
    }
    Ok(Resize {
        mode,
        coord,
        nearest,
        cubic_a: a.float_or("cubic_coeff_a", -0.75)?,
        exclude_outside: a.bool_or("exclude_outside", false)?,
        extrapolation: a.float_or("extrapolation_value", 0.0)?,
        antialias,
        axes,
        aspect,
        legacy,
    })
}

/// RoiAlign's attributes; opset 10 has no coordinate_transformation_mode (it behaves as
/// output_half_pixel).
fn roi_align(a: &mut dyn AttrSource, version: i64) -> Result<Op, String> {
    let half_pixel = match (a.string("coordinate_transformation_mode")?.as_deref(), version) {
        (None, v) => v >= 16,
        (Some("half_pixel"), v) if v >= 16 => true,
        (Some("output_half_pixel"), v) if v >= 16 => false,
        (Some(other), _) => return Err(format!("coordinate_transformation_mode={other:?} is not valid at this opset")),
    };
    let max = match a.string("mode")?.as_deref() {
        None | Some("avg") => false,
        Some("max") => true,
        Some(other) => return Err(format!("mode={other:?} is not avg or max")),
    };
    let r = RoiAlign {
        max,
        output_height: a.int_or("output_height", 1)?,
        output_width: a.int_or("output_width", 1)?,
        sampling_ratio: a.int_or("sampling_ratio", 0)?,
        spatial_scale: a.float_or("spatial_scale", 1.0)?,
        half_pixel,
        v10: version < 16,
    };
    if r.output_height < 1 || r.output_width < 1 || r.sampling_ratio < 0 {
        return Err(format!("output {}x{} and sampling_ratio {} must be positive (sampling_ratio may be 0)", r.output_height, r.output_width, r.sampling_ratio));
    }
    Ok(Op::RoiAlign(r))
}

/// GridSample's attributes; opset 16 spells the modes bilinear and bicubic.
fn grid_sample(a: &mut dyn AttrSource, version: i64) -> Result<Op, String> {
    let v16 = version < 20;
    let mode = a.string("mode")?;
    let mode = match (mode.as_deref(), v16) {
        (None, _) | (Some("bilinear"), true) | (Some("linear"), false) => ResizeMode::Linear,
        (Some("bicubic"), true) | (Some("cubic"), false) => ResizeMode::Cubic,
        (Some("nearest"), _) => ResizeMode::Nearest,
        (Some(other), _) => return Err(format!("mode={other:?} is not a GridSample mode at this opset")),
    };
    let padding = a.string("padding_mode")?.unwrap_or_else(|| "zeros".into());
    let padding = GridPadding::parse(&padding).ok_or_else(|| format!("padding_mode={padding:?} is not known"))?;
    // ONNX moves (clamps or reflects) an outside source coordinate before taking the four
    // cubic taps; libtorch pads each tap instead, which gives other values near the edges.
    if mode == ResizeMode::Cubic && padding != GridPadding::Zeros {
        return Err(format!("cubic sampling with padding_mode={} is not supported (only zeros)", padding.name()));
    }
    Ok(Op::GridSample { mode, padding, align_corners: a.bool_or("align_corners", false)?, v16 })
}

fn window(a: &mut dyn AttrSource) -> Result<Window, String> {
    let auto_pad = match a.string("auto_pad")?.as_deref() {
        None | Some("NOTSET") | Some("") => AutoPad::NotSet,
        Some("SAME_UPPER") => AutoPad::SameUpper,
        Some("SAME_LOWER") => AutoPad::SameLower,
        Some("VALID") => AutoPad::Valid,
        Some(other) => return Err(format!("auto_pad={other:?} is not valid")),
    };
    Ok(Window {
        kernel_shape: a.ints_or_empty("kernel_shape")?,
        strides: a.ints_or_empty("strides")?,
        pads: a.ints_or_empty("pads")?,
        dilations: a.ints_or_empty("dilations")?,
        auto_pad,
    })
}

fn unary(op: &str) -> Option<UnaryOp> {
    use UnaryOp::*;
    Some(match op {
        "Abs" => Abs, "Neg" => Neg, "Sqrt" => Sqrt, "Reciprocal" => Reciprocal, "Exp" => Exp,
        "Log" => Log, "Erf" => Erf, "Tanh" => Tanh, "Sigmoid" => Sigmoid, "Relu" => Relu,
        "Not" => Not, "IsNaN" => IsNaN, "Floor" => Floor, "Ceil" => Ceil, "Round" => Round,
        "Sign" => Sign, "Sin" => Sin, "Cos" => Cos, "Tan" => Tan, "Asin" => Asin, "Acos" => Acos,
        "Atan" => Atan, "Sinh" => Sinh, "Cosh" => Cosh, "Asinh" => Asinh, "Acosh" => Acosh,
        "Atanh" => Atanh, "Softplus" => Softplus, "Softsign" => Softsign, "Identity" => Identity,
        "HardSwish" => HardSwish, "Mish" => Mish, "BitwiseNot" => BitNot,
        _ => return None,
    })
}

fn class_loss(a: &mut dyn AttrSource) -> Result<ClassLoss, String> {
    let reduction = match a.string("reduction")?.as_deref() {
        None | Some("mean") => LossReduction::Mean,
        Some("sum") => LossReduction::Sum,
        Some("none") => LossReduction::None,
        Some(other) => return Err(format!("reduction={other:?} is not one of none, sum, mean")),
    };
    Ok(ClassLoss { reduction, ignore_index: a.int("ignore_index")? })
}

fn binary(op: &str) -> Option<BinaryOp> {
    use BinaryOp::*;
    Some(match op {
        "Add" => Add, "Sub" => Sub, "Mul" => Mul, "Div" => Div, "Pow" => Pow, "Equal" => Equal,
        "Less" => Less, "Greater" => Greater, "LessOrEqual" => LessOrEqual,
        "GreaterOrEqual" => GreaterOrEqual, "And" => And, "Or" => Or, "Xor" => Xor, "PRelu" => PRelu,
        "BitwiseAnd" => BitAnd, "BitwiseOr" => BitOr, "BitwiseXor" => BitXor,
        _ => return None,
    })
}

fn reduce_kind(op: &str) -> Option<ReduceKind> {
    use ReduceKind::*;
    Some(match op {
        "ReduceSum" => Sum, "ReduceMean" => Mean, "ReduceMax" => Max, "ReduceMin" => Min,
        "ReduceProd" => Prod, "ReduceL1" => L1, "ReduceL2" => L2, "ReduceLogSum" => LogSum,
        "ReduceLogSumExp" => LogSumExp, "ReduceSumSquare" => SumSquare,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sorted_and_versions_ascend() {
        for pair in SPECS.windows(2).chain(DOMAIN_SPECS.windows(2)) {
            assert!(pair[0].name < pair[1].name, "{} before {}", pair[0].name, pair[1].name);
        }
        for s in SPECS.iter().chain(DOMAIN_SPECS) {
            assert!(s.domain.is_empty() || SPECS.iter().all(|d| d.name != s.name), "{} is also a default-domain op", s.name);
            assert!(s.versions.windows(2).all(|w| w[0] < w[1]), "{} versions", s.name);
            assert!(s.versions.contains(&s.supported_from), "{} supported_from", s.name);
        }
    }

    #[test]
    fn version_selection_follows_the_opset() {
        let add = spec("Add").unwrap();
        assert_eq!(add.version_at(6), Some(6));
        assert_eq!(add.version_at(12), Some(7));
        assert_eq!(add.version_at(20), Some(14));
        assert_eq!(spec("Gelu").unwrap().version_at(17), None);
    }
}
