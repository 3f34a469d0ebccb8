//! Declarative specs of the supported ONNX ops: schema versions, arity, and the first
//! version whose semantics the IR implements.
//!
//! A node is judged by the definition its model's opset selects: the newest schema
//! version `<=` the default-domain opset. If that version predates `supported_from`, the
//! node is reported as unsupported (with the version) rather than interpreted with the
//! semantics of a later definition.

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
