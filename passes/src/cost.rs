//! The cost model: an analysis kept beside the IR giving every node its compute, memory
//! traffic, stashed activations and parameters, linear in the microbatch size `b`.
//!
//! Every tensor's element count is linear in the symbolic batch `N` (dims are `k*N` or
//! fixed), so each cost is a [`Lin`] `per_sample * b + fixed`. Costs are indexed by
//! `NodeId::index()`.
//!
//! # Rules per op class (forward flops; backward as stated)
//! - **MatMul / Gemm / Einsum**: `2*M*N*K` (= `2 * out_numel * K`; Einsum: 2 * the product of
//!   every index extent). Backward = 2x forward (both operand gradients).
//! - **RNN / GRU / LSTM**: `2 * D * G * H * (I + H)` per step and batch row (`G` gates,
//!   `D` directions, input width `I`), i.e. `in_numel * 2DGH(I + H) / I`. Backward = 2x.
//! - **Conv**: `2 * out_numel * (Cin/group * prod(kernel))` (the weight's dims 1..).
//!   **ConvTranspose**: `2 * in_numel * (Cout/group * prod(kernel))`. **DeformConv**: Conv's
//!   plus 8 per sampled column element (4 bilinear taps). Backward = 2x.
//! - **DFT / STFT**: `5 * out_numel * log2(n)` (an FFT; `n` the longest output axis before
//!   the complex one). Backward 1x.
//! - **Elementwise**: `out_numel`; transcendentals (exp, log, erf, tanh, sigmoid, trig,
//!   gelu, softplus, mish, pow, elu/selu/celu) ~4 per element. Backward ~1x forward.
//! - **Softmax / LogSoftmax**: 5 per element; **LayerNorm / InstanceNorm / GroupNorm /
//!   MeanVarianceNormalization / LpNormalization**: 8; **RMSNorm**: 5; **BatchNorm**: 6;
//!   **RotaryEmbedding**: 3; **Hardmax**: 2; **LRN**: `2 * size + 4`. Backward = 2x.
//! - **Optimizer steps** (Adagrad, Adam, Momentum): ~10 per element of `X` (a quarter
//!   of the inputs' elements); **Binarizer**, **ArrayFeatureExtractor**: `out_numel`;
//!   **TreeEnsemble**: 8 compares per tree and input element, no backward (piecewise constant).
//! - **LinearAttention**: `8 * d_k` per output element (the state's decay, retrieval and
//!   update, and the read). **CausalConvWithState**: `2k + 4` per output. Backward = 2x.
//! - **Attention**: the two matmuls, `2 * (q_numel + out_numel) * total_seq`, plus 5 per
//!   score for the softmax and masking. Backward = 2x.
//! - **SoftmaxCrossEntropyLoss**: 5 per score; **NegativeLogLikelihoodLoss**: 1 per target.
//! - **Pools**: `out_numel * prod(kernel)`; global pools `in_numel`; LpPool adds 4 per
//!   input and output element (the power and the root). Backward 1x.
//! - **QuantizeLinear**: 4 per element; **DequantizeLinear**: 2; **DynamicQuantizeLinear**:
//!   6 per input element (the range pass, then quantizing). No backward.
//! - **Reductions, ArgMax/ArgMin, CumSum, CumProd, TopK**: `in_numel`. Backward 1x.
//!   **Det**: `in_numel * M` (an LU factorisation of each `M x M` matrix). Backward 2x.
//! - **Gather / GatherElements / GatherND**: `out_numel`; **ScatterND / ScatterElements /
//!   Scatter**: `in_numel` (the copied data). Backward 1x (scatter-add or gather).
//! - **Resize / Upsample**: 2 per output element and tap (nearest 1, linear 2, cubic 4
//!   taps per resized axis; antialiased downsampling more, taken as 4). **GridSample**: 2
//!   per output element and tap (nearest 1, linear 2^d, cubic 16 for d spatial axes).
//!   **RoiAlign**: 8 per output element and sample (4 taps; `sampling_ratio^2` samples,
//!   4 when adaptive).
//!   Backward 1x (scatter-add of the gathers).
//! - **Shape and data-movement ops** (Reshape, Transpose, Concat, Slice, Split, Pad, Expand,
//!   Tile, ...): 0 flops, but their bytes moved count.
//!
//! `bytes_moved` is all input bytes (weights included) plus output bytes of the forward.
//! The backward is taken to move twice that (it reads the output gradient and the stash and
//! writes the input gradients). `activation_bytes` is the bytes of the node's outputs
//! (stashed for the backward); pure views (Reshape, Flatten, Squeeze, Unsqueeze,
//! Identity) stash nothing of their own.
//!
//! # Weights
//! Trainable weights are attributed to their consuming node. A weight read by several
//! nodes is counted once, by its first consumer in topological order, and listed in
//! [`CostModel::shared`].
//!
//! # Time
//! Analytic time per node is the roofline `max(flops / peak_flops, bytes / mem_bw)` of a
//! [`Roofline`]. On a GPU preset the roofline is per node ([`Achievable`]): a matrix
//! product at the achievable share of the peak times its tiles' useful share
//! ([`GemmShape::useful_share`]; its backward as the two products it is), every other
//! kernel at the achievable memory bandwidth (at the compute type's width), and no kernel
//! shorter than its launch. A measured [`Profile`] overrides node times by its measurements, linear
//! in `b` between two measured sizes and along the nearest two beyond them; nodes missing
//! from the profile are scaled by the median measured/analytic ratio of their [`OpClass`]
//! (or of all measured nodes when the class has none).

use std::collections::{HashMap, HashSet};

use pipewright_ops::op::{OpClass, ResizeMode};
use pipewright_ir::{Dim, Graph, NodeId, Op, TensorType, ValueDef, ValueId};
use pipewright_core::Optimizer;
use serde::{Deserialize, Serialize};

use crate::machine::{Crowding, DurationSpread, HostCores};
use crate::profile::{BoundaryCost, HostSharing, Measured, Profile, ProfileError, WeightUpdate};

/// A cost linear in the microbatch size: `per_sample * b + fixed`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lin {
    pub per_sample: f64,
    pub fixed: f64,
}

impl Lin {
    pub const ZERO: Lin = Lin {
        per_sample: 0.0,
        fixed: 0.0,
    };

    pub fn new(per_sample: f64, fixed: f64) -> Lin {
        Lin { per_sample, fixed }
    }

    /// The value at microbatch size `b`.
    pub fn at(self, b: u64) -> f64 {
        self.per_sample * b as f64 + self.fixed
    }

    pub fn scale(self, k: f64) -> Lin {
        Lin {
            per_sample: self.per_sample * k,
            fixed: self.fixed * k,
        }
    }
}

impl std::ops::Add for Lin {
    type Output = Lin;
    fn add(self, o: Lin) -> Lin {
        Lin {
            per_sample: self.per_sample + o.per_sample,
            fixed: self.fixed + o.fixed,
        }
    }
}

impl std::ops::AddAssign for Lin {
    fn add_assign(&mut self, o: Lin) {
        *self = *self + o;
    }
}

/// The performance description of one accelerator for the roofline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    pub name: String,
    /// Peak arithmetic throughput, flop/s.
    pub peak_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// What the device achieves of those peaks per kind of kernel; `None`: the peaks
    /// themselves (a CPU, a cluster file, or a flat `--efficiency`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub achievable: Option<Achievable>,
}

impl Default for Roofline {
    /// A V100-class GPU: 15.7 Tflop/s fp32, 900 GB/s.
    fn default() -> Roofline {
        Roofline {
            name: "default".into(),
            peak_flops: 15.7e12,
            mem_bw: 900e9,
            achievable: None,
        }
    }
}

/// What a GPU achieves of its datasheet peaks, from published measurements (each device
/// preset names its sources): a roofline per node instead of one efficiency for all.
/// A matrix product (MatMul, Gemm, convolution as an implicit GEMM) runs at `gemm` of the
/// peak flop/s times the share of its tiles' work that is useful (tile and wave
/// quantization, [`GemmShape::useful_share`]); every other kernel streams at `bandwidth`
/// of the memory bandwidth; no kernel takes less than its host launch, `launch_s` (the
/// host launches the next kernel while the device runs the last, so launches only show
/// where kernels are shorter than them).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Achievable {
    /// Share of the peak flop/s a large, tile-aligned matrix product reaches.
    pub gemm: f64,
    /// Share of the memory bandwidth a streaming kernel (one load and one store per
    /// element) reaches.
    pub bandwidth: f64,
    /// Seconds of host launch per kernel, which an eager runtime (libtorch, PyTorch) pays
    /// for every kernel and which bounds kernels shorter than it.
    pub launch_s: f64,
    /// Streaming multiprocessors: the thread blocks of one wave.
    pub sms: u32,
    /// Bytes a kernel moves per byte the graph's (fp32) types say: 0.5 when training
    /// computes in fp16 or bf16, whose activations and weight copies are 2 bytes.
    pub bytes_scale: f64,
}

/// The output tiles of cuBLAS's kernels in NVIDIA's *Matrix Multiplication Background
/// User's Guide* (§2.3, from "256x128 and 128x256 (most efficient)" to "64x64 (least
/// efficient)"), each taken at one thread block per SM (the guide's wave-quantization
/// example) and at the same rate per multiprocessor: the guide does not quantify how much
/// less efficient the smaller ones are, so a shape that only small tiles fit well is
/// taken at its best (optimistic for small products).
const TILES: [(f64, f64); 8] = [(256.0, 128.0), (128.0, 256.0), (128.0, 128.0), (256.0, 64.0), (64.0, 256.0), (128.0, 64.0), (64.0, 128.0), (64.0, 64.0)];

/// A matrix product as a GPU tiles it: `count` products of a `rows x cols` output each
/// (the leading axes of a product with a 2-D weight fold into its rows, as cuBLAS runs
/// it; a batched product of two activations is `count` products), linear in the batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GemmShape {
    pub count: Lin,
    pub rows: Lin,
    pub cols: f64,
    /// The reduction's length.
    pub depth: f64,
}

impl GemmShape {
    /// The share of the launched tiles' work that is useful at microbatch `b` on `sms`
    /// multiprocessors: every tile does a whole tile's math however little of it is
    /// inside the output (tile quantization, the guide's §3.1), and the last wave of tiles
    /// may leave multiprocessors idle (wave quantization, §3.2). The best of the guide's
    /// tiles, as cuBLAS's choice of kernel would take.
    pub fn useful_share(&self, b: u64, sms: u32) -> f64 {
        let (count, rows) = (self.count.at(b).max(1.0), self.rows.at(b).max(1.0));
        let share = |tm: f64, tn: f64| {
            let (tiles_m, tiles_n) = ((rows / tm).ceil(), (self.cols.max(1.0) / tn).ceil());
            let tiles = count * tiles_m * tiles_n;
            let waves = (tiles / f64::from(sms.max(1))).ceil();
            count * rows * self.cols.max(1.0) / (waves * f64::from(sms.max(1)) * tm * tn)
        };
        TILES.iter().map(|&(tm, tn)| share(tm, tn)).fold(0.0, f64::max).min(1.0)
    }

    /// The two products of the backward: the input's gradient (`rows x depth` over
    /// `cols`) and the other operand's (`depth x cols` over the rows, one product for a
    /// weight shared by every row, else one per product).
    fn backward(&self, weight: bool) -> [GemmShape; 2] {
        let input = GemmShape { count: self.count, rows: self.rows, cols: self.depth, depth: self.cols };
        // Its reduction runs over the rows, which a batch-linear count cannot hold as a
        // number; the tiles' share does not read it.
        let count = if weight { Lin::new(0.0, 1.0) } else { self.count };
        let other = GemmShape { count, rows: Lin::new(0.0, self.depth), cols: self.cols, depth: 0.0 };
        [input, other]
    }
}

/// Fills each node's [`NodeCost::awaiting_bytes`] and [`NodeCost::keeps_graph`]
/// (`readers`: the nodes reading each trainable weight). A weight read by several nodes
/// (tied) is taken as summed with the input gradients, as the runtime does for weights
/// tied across stages.
fn awaiting_for_weight_gradients(g: &Graph, topo: &[NodeId], readers: &HashMap<ValueId, Vec<NodeId>>, export: i64, nodes: &mut [NodeCost]) {
    let mut operands_kept: HashSet<ValueId> = HashSet::new();
    for &n in topo {
        let node = g.node(n);
        let weights: Vec<usize> = node.inputs.iter().enumerate().filter_map(|(j, v)| v.filter(|v| readers.contains_key(v)).map(|_| j)).collect();
        let tied = node.inputs.iter().flatten().any(|v| readers.get(v).is_some_and(|r| r.len() > 1));
        if weights.is_empty() || tied || !node.op.defers_weight_gradient() {
            continue;
        }
        let rank = |j: usize| node.inputs.get(j).copied().flatten().map_or(0, |v| g.value(v).ty.shape.rank());
        let cost = &mut nodes[n.index()];
        for &v in node.outputs.iter().flatten() {
            cost.awaiting_bytes += bytes_lin(&g.value(v).ty, export);
        }
        if !node.op.forms_weight_gradient_directly(&weights, rank(1), rank(0)) {
            cost.keeps_graph = true;
        } else if let Some(x) = node.inputs.first().copied().flatten().filter(|&x| operands_kept.insert(x)) {
            cost.awaiting_bytes += bytes_lin(&g.value(x).ty, export);
        }
    }
}

/// Costs of one node.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NodeCost {
    pub fwd_flops: Lin,
    pub bwd_flops: Lin,
    pub bytes_moved: Lin,
    /// Outputs stashed for the backward.
    pub activation_bytes: Lin,
    /// Bytes of trainable weights attributed to this node (first consumer only).
    pub param_bytes: u64,
    /// Elements of trainable weights attributed to this node (first consumer only).
    pub params: u64,
    /// The matrix product it runs, for a node that is one; and whether its second
    /// operand is a weight (one gradient product for all rows).
    pub gemm: Option<(GemmShape, bool)>,
    /// Kernels its forward and its backward launch (0 for a view).
    pub kernels: [u8; 2],
    /// What a backward split into input and weight gradients keeps for this node's
    /// weight gradient between the two, per microbatch: the gradient of its output where
    /// it defers one ([`pipewright_ops::op::Op::defers_weight_gradient`], reading trainable
    /// weights no other node reads), and its first operand where it forms it directly
    /// ([`pipewright_ops::op::Op::forms_weight_gradient_directly`]; counted at the operand's
    /// first such node, as the runtime keeps it once).
    pub awaiting_bytes: Lin,
    /// Whether that deferred weight gradient needs the forward's graph (not formed
    /// directly): a stage with such a node keeps its whole graph until its weight gradients.
    pub keeps_graph: bool,
}

/// A trainable weight read by more than one node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SharedWeightUse {
    pub name: String,
    #[serde(skip)]
    pub value: Option<ValueId>,
    pub bytes: u64,
    /// Consumers in topological order; the first one carries the bytes in [`NodeCost`].
    #[serde(skip)]
    pub consumers: Vec<NodeId>,
}

/// What applying a profile did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ProfileReport {
    /// Nodes whose times come from the profile.
    pub measured: usize,
    /// Graph nodes absent from the profile (calibrated analytic times).
    pub calibrated: usize,
    /// Profile entries naming no node of the graph.
    pub unknown_nodes: Vec<String>,
    /// Profile entries whose `op` differs from the node's op type.
    pub op_mismatches: Vec<String>,
    /// Median measured/analytic time ratio per class.
    pub class_ratio: Vec<(OpClass, f64)>,
    /// Trainable weights whose update time comes from the profile.
    pub updates_measured: usize,
}

/// Cost model errors.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
    #[error(transparent)]
    Profile(#[from] ProfileError),
}

#[derive(Clone, Debug, PartialEq)]
enum Timing {
    Analytic {
        scale: f64,
    },
    /// The profile's seconds.
    Measured {
        fwd: Measured,
        bwd: Measured,
    },
}

/// Per-node costs of a graph, indexed by `NodeId::index()`.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub roofline: Roofline,
    nodes: Vec<NodeCost>,
    classes: Vec<OpClass>,
    timing: Vec<Timing>,
    /// Trainable weights each node reads (shared ones included), by node index.
    weights: Vec<Vec<ValueId>>,
    /// Trainable weights read by more than one node.
    pub shared: Vec<SharedWeightUse>,
    /// The topological order used for attribution.
    pub topo: Vec<NodeId>,
    /// The batch size the model was exported with (1 when unknown).
    pub export_batch: i64,
    /// Measured seconds to update the weights each node reads first (SGD, SGD with
    /// momentum, Adam), by node index, from a profile that has them.
    updates: Option<Vec<[f64; 3]>>,
    /// The training loss's forward and backward seconds from a profile that timed it.
    loss: Option<(Measured, Measured)>,
    /// The profile's threads crowding its host, when it measured them.
    sharing: Option<HostSharing>,
    /// What a stage boundary costs the runtime (forward, backward, update: milliseconds),
    /// when the profile measured it.
    boundary: Option<[Measured; 3]>,
    /// The runtime's untraced work after each backward (milliseconds), when the profile
    /// measured it at every size it timed a boundary at.
    after_backward: Option<Measured>,
    /// Seconds to accumulate a gradient of every trainable weight, when the profile
    /// measured it.
    accumulate: Option<f64>,
    /// How the operations' times spread, when the profile measured it.
    spread: Option<DurationSpread>,
}

fn numel_lin(ty: &TensorType, export: i64) -> Lin {
    match ty.shape.numel_dim() {
        Some(Dim::Fixed(k)) => Lin::new(0.0, k as f64),
        Some(Dim::Batch(k)) => Lin::new(k as f64, 0.0),
        None => Lin::new(0.0, ty.shape.numel(export).max(0) as f64),
    }
}

/// `lin * d` where `d` is a dimension; a batch dimension times a batch-linear count is
/// not linear, so it is resolved at the export size.
fn mul_dim(lin: Lin, d: Dim, export: i64) -> Lin {
    match d {
        Dim::Fixed(k) => lin.scale(k as f64),
        Dim::Batch(k) if lin.per_sample == 0.0 => Lin::new(lin.fixed * k as f64, 0.0),
        Dim::Batch(_) => lin.scale(d.eval(export) as f64),
    }
}

fn bytes_lin(ty: &TensorType, export: i64) -> Lin {
    numel_lin(ty, export).scale(ty.dtype.size() as f64)
}

/// Flops of `Einsum`: 2 * the product of all index extents (`None` if unparsable).
fn einsum_flops(eq: &str, inputs: &[&TensorType], export: i64) -> Option<Lin> {
    let lhs = eq.split("->").next()?;
    let terms: Vec<&str> = lhs.split(',').map(|t| t.trim()).collect();
    if terms.len() != inputs.len() || lhs.contains('.') {
        return None;
    }
    let mut extents: HashMap<char, Dim> = HashMap::new();
    for (t, ty) in terms.iter().zip(inputs) {
        let letters: Vec<char> = t.chars().filter(|c| c.is_alphabetic()).collect();
        if letters.len() != ty.shape.rank() {
            return None;
        }
        for (c, &d) in letters.iter().zip(ty.shape.dims()) {
            extents.entry(*c).or_insert(d);
        }
    }
    let mut acc = Lin::new(0.0, 2.0);
    for d in extents.values() {
        acc = mul_dim(acc, *d, export);
    }
    Some(acc)
}

/// The query heads of a 3-D Attention (whose Q packs them into its last axis).
fn attention_heads(op: &Op) -> i64 {
    match op {
        Op::Attention(a) => a.q_num_heads.unwrap_or(1).max(1),
        _ => 1,
    }
}

fn kernel_prod(w: &pipewright_ops::op::Window) -> f64 {
    w.kernel_shape.iter().product::<i64>().max(1) as f64
}

/// The analytic forward flops and backward/forward ratio of one node.
fn flops(g: &Graph, n: NodeId, export: i64) -> (Lin, f64) {
    let node = g.node(n);
    let ty_in = |i: usize| {
        node.inputs
            .get(i)
            .copied()
            .flatten()
            .map(|v| &g.value(v).ty)
    };
    let out_numel: Lin = node
        .outputs
        .iter()
        .flatten()
        .map(|&v| numel_lin(&g.value(v).ty, export))
        .fold(Lin::ZERO, |a, b| a + b);
    let in_numel = ty_in(0).map(|t| numel_lin(t, export)).unwrap_or(Lin::ZERO);
    let first_out = node
        .outputs
        .iter()
        .flatten()
        .next()
        .map(|&v| numel_lin(&g.value(v).ty, export))
        .unwrap_or(Lin::ZERO);
    match &node.op {
        Op::MatMul => {
            let k = ty_in(0)
                .and_then(|t| t.shape.dims().last().copied())
                .unwrap_or(Dim::Fixed(1));
            (mul_dim(first_out, k, export).scale(2.0), 2.0)
        }
        // Integer products: the same multiply-adds, plus the requantization per output.
        Op::MatMulInteger | Op::QLinearMatMul => {
            let k = ty_in(0)
                .and_then(|t| t.shape.dims().last().copied())
                .unwrap_or(Dim::Fixed(1));
            (mul_dim(first_out, k, export).scale(2.0) + first_out.scale(3.0), 2.0)
        }
        Op::ConvInteger(_) | Op::QLinearConv(_) => {
            let w = if matches!(node.op, Op::QLinearConv(_)) { 3 } else { 1 };
            let per_out = ty_in(w)
                .map(|w| w.shape.eval(export).iter().skip(1).product::<i64>())
                .unwrap_or(1);
            (first_out.scale(2.0 * per_out as f64 + 3.0), 2.0)
        }
        Op::Gemm(gm) => {
            let k = ty_in(0)
                .and_then(|t| t.shape.dims().get(if gm.trans_a { 0 } else { 1 }).copied())
                .unwrap_or(Dim::Fixed(1));
            (mul_dim(first_out, k, export).scale(2.0) + first_out, 2.0)
        }
        Op::Einsum { equation } => {
            let tys: Vec<&TensorType> = node
                .inputs
                .iter()
                .flatten()
                .map(|&v| &g.value(v).ty)
                .collect();
            (
                einsum_flops(equation, &tys, export).unwrap_or(first_out.scale(2.0)),
                2.0,
            )
        }
        // About ten elementwise steps per optimized element; Binarizer one compare.
        Op::Optimizer(_) => (in_numel.scale(10.0 / 4.0), 1.0),
        Op::Binarizer { .. } | Op::ArrayFeatureExtractor => (first_out, 1.0),
        // A compare per visited node: about the tree depth, taken as 8, per tree and row.
        Op::TreeEnsemble(t) => (in_numel.scale(8.0 * t.tree_roots.len() as f64), 0.0),
        Op::CausalConvWithState { .. } => {
            let k = ty_in(1).and_then(|w| w.shape.eval(export).last().copied()).unwrap_or(1);
            (first_out.scale(2.0 * k as f64 + 4.0), 2.0)
        }
        Op::LinearAttention(la) => {
            // Per token and head: the state's decay, retrieval and rank-1 update, and the
            // query's read, each ~2 * d_k * d_v; per output element 8 * d_k.
            let d_k = ty_in(0).and_then(|t| t.shape.eval(export).last().copied()).unwrap_or(1) / la.q_num_heads.max(1);
            (first_out.scale(8.0 * d_k.max(1) as f64), 2.0)
        }
        Op::Conv(_) => {
            let per_out = ty_in(1)
                .map(|w| w.shape.eval(export).iter().skip(1).product::<i64>())
                .unwrap_or(1);
            (first_out.scale(2.0 * per_out as f64), 2.0)
        }
        // The convolution of the sampled columns, plus 4 taps of 2 flops per sample.
        Op::DeformConv { .. } => {
            let (per_out, c_out) = ty_in(1)
                .map(|w| {
                    let d = w.shape.eval(export);
                    (d.iter().skip(1).product::<i64>(), d.first().copied().unwrap_or(1).max(1))
                })
                .unwrap_or((1, 1));
            (first_out.scale(2.0 * per_out as f64 + 8.0 * per_out as f64 / c_out as f64), 2.0)
        }
        Op::Dft { .. } | Op::Stft { .. } => {
            let n = node.outputs.iter().flatten().next().map_or(1, |&v| {
                let d = g.value(v).ty.shape.eval(export);
                d.iter().rev().skip(1).copied().max().unwrap_or(1).max(2)
            });
            (first_out.scale(5.0 * (n as f64).log2()), 1.0)
        }
        Op::RoiAlign(r) => {
            let samples = if r.sampling_ratio > 0 { (r.sampling_ratio * r.sampling_ratio) as f64 } else { 4.0 };
            (first_out.scale(8.0 * samples), 1.0)
        }
        Op::ConvTranspose(_) => {
            let per_in = ty_in(1)
                .map(|w| w.shape.eval(export).iter().skip(1).product::<i64>())
                .unwrap_or(1);
            (in_numel.scale(2.0 * per_in as f64), 2.0)
        }
        Op::Softmax(_) | Op::LogSoftmax(_) => (out_numel.scale(5.0), 2.0),
        // A log-softmax over the scores, then a gather of the targets' entries.
        Op::SoftmaxCrossEntropyLoss(_) => (in_numel.scale(5.0), 2.0),
        Op::NegativeLogLikelihoodLoss(_) => (out_numel, 1.0),
        Op::LayerNormalization(_)
        | Op::InstanceNormalization { .. }
        | Op::GroupNormalization(_)
        | Op::MeanVarianceNormalization { .. }
        | Op::LpNormalization { .. } => (first_out.scale(8.0), 2.0),
        Op::Hardmax(_) => (first_out.scale(2.0), 2.0),
        Op::Rnn(r) => {
            let i = ty_in(0)
                .and_then(|t| t.shape.dims().last().and_then(|d| d.fixed()))
                .unwrap_or(1)
                .max(1) as f64;
            let (d, gh, h) = ((r.directions() * r.gates()) as f64, r.hidden_size as f64, r.hidden_size as f64);
            (in_numel.scale(2.0 * d * gh * (i + h) / i), 2.0)
        }
        Op::Lrn(l) => (first_out.scale(2.0 * l.size as f64 + 4.0), 2.0),
        Op::Det => {
            let m = ty_in(0)
                .and_then(|t| t.shape.dims().last().copied())
                .unwrap_or(Dim::Fixed(1));
            (mul_dim(in_numel, m, export), 2.0)
        }
        Op::BatchNormalization(_) => (first_out.scale(6.0), 2.0),
        Op::RMSNormalization(_) => (first_out.scale(5.0), 2.0),
        Op::RotaryEmbedding(_) => (first_out.scale(3.0), 2.0),
        // Divide, round, add, clamp (multiply and subtract back); no backward.
        Op::QuantizeLinear(_) => (first_out.scale(4.0), 0.0),
        Op::DequantizeLinear { .. } => (first_out.scale(2.0), 0.0),
        // A min/max pass over x, then QuantizeLinear.
        Op::DynamicQuantizeLinear => (in_numel.scale(6.0), 0.0),
        Op::Attention(_) => {
            // Q's numel covers `[b, heads, q_seq, head_size]` in either layout; the
            // scores have `total / head_size` times as many elements.
            let seq = |i: usize, rank4_axis: usize| {
                ty_in(i).map_or(0, |t| {
                    let d = t.shape.eval(export);
                    let axis = if d.len() == 4 { rank4_axis } else { 1 };
                    d.get(axis).copied().unwrap_or(0)
                })
            };
            let total = (seq(1, 2) + ty_in(4).map_or(0, |t| t.shape.eval(export).get(2).copied().unwrap_or(0))) as f64;
            let head = ty_in(0).and_then(|t| t.shape.eval(export).last().copied()).unwrap_or(1).max(1) as f64;
            let head = match ty_in(0).map(|t| t.shape.rank()) {
                Some(3) => head / attention_heads(&node.op) as f64,
                _ => head,
            };
            (in_numel.scale(2.0 * total + 5.0 * total / head.max(1.0)) + first_out.scale(2.0 * total), 2.0)
        }
        Op::MaxPool(p) | Op::AveragePool(p) => (first_out.scale(kernel_prod(&p.window)), 1.0),
        // |x|^p before the window sums and the root after: ~4 per element each.
        Op::LpPool { pool, .. } => (first_out.scale(kernel_prod(&pool.window) + 4.0) + in_numel.scale(4.0), 1.0),
        Op::GlobalAveragePool | Op::GlobalMaxPool => (in_numel, 1.0),
        Op::Reduce(_)
        | Op::ArgMax { .. }
        | Op::ArgMin { .. }
        | Op::CumSum { .. }
        | Op::CumProd { .. }
        | Op::TopK { .. } => (in_numel, 1.0),
        Op::Gather { .. } | Op::GatherElements { .. } | Op::GatherND { .. } => (out_numel, 1.0),
        Op::ScatterND { .. } | Op::ScatterElements { .. } | Op::Scatter { .. } | Op::TensorScatter { .. } => (in_numel, 1.0),
        Op::MaxUnpool { .. } => (first_out + in_numel, 1.0),
        Op::Resize(r) | Op::Upsample(r) => {
            let taps = match r.mode {
                ResizeMode::Nearest => 1.0,
                ResizeMode::Linear if !r.antialias => 2.0,
                _ => 4.0,
            };
            (out_numel.scale(2.0 * taps), 1.0)
        }
        Op::GridSample { mode, .. } => {
            let spatial = ty_in(0).map_or(2, |t| t.shape.rank().saturating_sub(2)) as i32;
            let taps = match mode {
                ResizeMode::Nearest => 1.0,
                ResizeMode::Linear => 2f64.powi(spatial),
                ResizeMode::Cubic => 4f64.powi(spatial),
            };
            (out_numel.scale(2.0 * taps), 1.0)
        }
        op if op.is_elementwise() => (
            out_numel.scale(if op.is_transcendental() { 4.0 } else { 1.0 }),
            1.0,
        ),
        _ => (Lin::ZERO, 0.0),
    }
}

/// The matrix product node `n` runs, as a GPU tiles it, and whether its second operand is
/// a weight: MatMul (a 2-D second operand folds the leading axes into the rows), Gemm,
/// and a convolution as an implicit GEMM (rows: output positions, cols: output channels
/// per group, one product per group). `None` for any other node, and for a convolution
/// with under 8 output channels per group (a depthwise one, which runs as its own
/// memory-bound kernel rather than a matrix product).
fn gemm_shape(g: &Graph, n: NodeId, export: i64) -> Option<(GemmShape, bool)> {
    let node = g.node(n);
    let input = |i: usize| node.inputs.get(i).copied().flatten().map(|v| g.value(v));
    let out = node.outputs.iter().flatten().next().map(|&v| &g.value(v).ty)?;
    let out_numel = numel_lin(out, export);
    let dims = out.shape.eval(export);
    let is_weight = |i: usize| input(i).is_some_and(|v| matches!(v.def, ValueDef::Weight(_)));
    match &node.op {
        Op::MatMul => {
            let (a, b) = (input(0)?, input(1)?);
            let cols = *dims.last()? as f64;
            let depth = *a.ty.shape.eval(export).last()? as f64;
            if b.ty.shape.rank() <= 2 || dims.len() < 2 {
                let rows = out_numel.scale(1.0 / cols.max(1.0));
                return Some((GemmShape { count: Lin::new(0.0, 1.0), rows, cols, depth }, is_weight(1)));
            }
            let m = dims[dims.len() - 2] as f64;
            let count = out_numel.scale(1.0 / (m * cols).max(1.0));
            Some((GemmShape { count, rows: Lin::new(0.0, m), cols, depth }, false))
        }
        Op::Gemm(gm) => {
            let a = input(0)?.ty.shape.eval(export);
            let depth = *a.get(if gm.trans_a { 0 } else { 1 })? as f64;
            let cols = *dims.get(1)? as f64;
            Some((GemmShape { count: Lin::new(0.0, 1.0), rows: out_numel.scale(1.0 / cols.max(1.0)), cols, depth }, is_weight(1)))
        }
        Op::Conv(c) => {
            let w = input(1)?.ty.shape.eval(export);
            let groups = c.group.max(1) as f64;
            let c_out = *w.first()? as f64;
            let cols = c_out / groups;
            if cols < 8.0 {
                return None;
            }
            let depth = w.iter().skip(1).product::<i64>() as f64;
            Some((GemmShape { count: Lin::new(0.0, groups), rows: out_numel.scale(1.0 / c_out.max(1.0)), cols, depth }, true))
        }
        _ => None,
    }
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    })
}

impl CostModel {
    /// Computes the analytic costs of every node of `g` on `roofline`.
    pub fn new(g: &Graph, roofline: Roofline) -> Result<CostModel, CostError> {
        let topo = g
            .topo_order()
            .map_err(|n| CostError::Cycle(g.node(n).name.clone()))?;
        let export = g
            .batch
            .as_ref()
            .map_or(1, |b| b.resolved_size());
        let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
        let mut nodes = vec![NodeCost::default(); bound];
        let mut classes = vec![OpClass::DataMovement; bound];
        let mut weights: Vec<Vec<ValueId>> = vec![Vec::new(); bound];
        let mut first_consumer: HashMap<ValueId, Vec<NodeId>> = HashMap::new();
        for &n in &topo {
            let node = g.node(n);
            let i = n.index();
            classes[i] = node.op.class();
            let (fwd, bwd_ratio) = flops(g, n, export);
            let mut bytes = Lin::ZERO;
            for &v in node.inputs.iter().flatten() {
                let val = g.value(v);
                bytes += bytes_lin(&val.ty, export);
                if let ValueDef::Weight(w) = &val.def {
                    if w.trainable {
                        let users = first_consumer.entry(v).or_default();
                        if users.is_empty() {
                            nodes[i].param_bytes += w.data.byte_len() as u64;
                            nodes[i].params += w.data.numel() as u64;
                        }
                        if !users.contains(&n) {
                            users.push(n);
                            weights[i].push(v);
                        }
                    }
                }
            }
            let mut act = Lin::ZERO;
            for &v in node.outputs.iter().flatten() {
                let b = bytes_lin(&g.value(v).ty, export);
                bytes += b;
                act += b;
            }
            nodes[i].fwd_flops = fwd;
            nodes[i].bwd_flops = fwd.scale(bwd_ratio);
            nodes[i].bytes_moved = bytes;
            nodes[i].activation_bytes = if node.op.is_view() { Lin::ZERO } else { act };
            nodes[i].gemm = gemm_shape(g, n, export);
            // A product's backward is two products; other kernels' one; a view none.
            nodes[i].kernels = match (node.op.is_view(), nodes[i].gemm.is_some(), bwd_ratio > 0.0) {
                (true, _, _) => [0, 0],
                (false, true, _) => [1, 2],
                (false, false, true) => [1, 1],
                (false, false, false) => [1, 0],
            };
        }
        awaiting_for_weight_gradients(g, &topo, &first_consumer, export, &mut nodes);
        let mut shared: Vec<SharedWeightUse> = first_consumer
            .into_iter()
            .filter(|(_, users)| users.len() > 1)
            .map(|(v, consumers)| SharedWeightUse {
                name: g.value(v).name.clone(),
                value: Some(v),
                bytes: g
                    .value(v)
                    .weight()
                    .map(|w| w.data.byte_len() as u64)
                    .unwrap_or(0),
                consumers,
            })
            .collect();
        shared.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(CostModel {
            roofline,
            timing: vec![Timing::Analytic { scale: 1.0 }; bound],
            nodes,
            classes,
            weights,
            shared,
            topo,
            export_batch: export,
            updates: None,
            loss: None,
            sharing: None,
            boundary: None,
            after_backward: None,
            accumulate: None,
            spread: None,
        })
    }

    /// The costs of node `n` (zero for an index the graph did not have).
    pub fn node(&self, n: NodeId) -> NodeCost {
        self.nodes.get(n.index()).cloned().unwrap_or_default()
    }

    pub fn class(&self, n: NodeId) -> OpClass {
        self.classes
            .get(n.index())
            .copied()
            .unwrap_or(OpClass::DataMovement)
    }

    /// Trainable weights node `n` reads (shared ones included).
    pub fn weights_of(&self, n: NodeId) -> &[ValueId] {
        self.weights
            .get(n.index())
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }

    /// The uncalibrated roofline `(forward, backward)` seconds at microbatch `b`.
    pub fn analytic_time(&self, n: NodeId, b: u64) -> (f64, f64) {
        let c = match self.nodes.get(n.index()) {
            Some(c) => c,
            None => return (0.0, 0.0),
        };
        let dev = &self.roofline;
        let Some(gpu) = dev.achievable else {
            let fwd = (c.fwd_flops.at(b) / dev.peak_flops).max(c.bytes_moved.at(b) / dev.mem_bw);
            let bwd = (c.bwd_flops.at(b) / dev.peak_flops).max(2.0 * c.bytes_moved.at(b) / dev.mem_bw);
            return (fwd.max(0.0), bwd.max(0.0));
        };
        let (flops, bytes) = (c.fwd_flops.at(b), c.bytes_moved.at(b) * gpu.bytes_scale);
        let streamed = |bytes: f64| bytes / (dev.mem_bw * gpu.bandwidth);
        let computed = |flops: f64, shape: Option<&GemmShape>| {
            let useful = shape.map_or(1.0, |s| s.useful_share(b, gpu.sms));
            flops / (dev.peak_flops * gpu.gemm * useful)
        };
        let launches = |k: u8| f64::from(k) * gpu.launch_s;
        let (fwd, bwd) = match &c.gemm {
            Some((shape, weight)) => {
                // Each of the backward's two products does the forward's flops.
                let bwd: f64 = shape.backward(*weight).iter().map(|s| computed(flops, Some(s))).sum();
                (computed(flops, Some(shape)).max(streamed(bytes)), bwd.max(streamed(2.0 * bytes)))
            }
            // Products the tiles do not describe (attention, einsum): the large-GEMM rate.
            None if matches!(self.class(n), OpClass::MatMul | OpClass::Conv) => (computed(flops, None).max(streamed(bytes)), computed(c.bwd_flops.at(b), None).max(streamed(2.0 * bytes))),
            None => ((flops / dev.peak_flops).max(streamed(bytes)), (c.bwd_flops.at(b) / dev.peak_flops).max(streamed(2.0 * bytes))),
        };
        (fwd.max(launches(c.kernels[0])), bwd.max(launches(c.kernels[1])))
    }

    /// Of node `n`'s backward seconds at microbatch `b` ([`CostModel::time`]), the weight
    /// gradient's: for a matrix product whose other operand is a weight, the product giving
    /// that weight's gradient, half its backward (its two products do the same flops); 0
    /// for every other node (a norm's or a bias's weight gradient is a reduction, counted
    /// with the input gradient).
    pub fn weight_grad_time(&self, n: NodeId, b: u64) -> f64 {
        match self.nodes.get(n.index()).and_then(|c| c.gemm.as_ref()) {
            Some((_, true)) => self.time(n, b).1 / 2.0,
            _ => 0.0,
        }
    }

    /// `(forward, backward)` seconds of node `n` at microbatch `b`: measured when the
    /// profile has the node, calibrated analytic otherwise.
    pub fn time(&self, n: NodeId, b: u64) -> (f64, f64) {
        match self.timing.get(n.index()) {
            Some(Timing::Measured { fwd, bwd }) => (fwd.at(b), bwd.at(b)),
            Some(Timing::Analytic { scale }) => {
                let (f, bw) = self.analytic_time(n, b);
                (f * scale, bw * scale)
            }
            None => (0.0, 0.0),
        }
    }

    /// Overrides node times with the profile's measurements (`Measured`) and calibrates the
    /// others by the median measured/analytic ratio of their class.
    pub fn apply_profile(
        &mut self,
        g: &Graph,
        profile: &Profile,
    ) -> Result<ProfileReport, CostError> {
        profile.check()?;
        let by_name: HashMap<&str, NodeId> = self
            .topo
            .iter()
            .map(|&n| (g.node(n).name.as_str(), n))
            .collect();
        let mut report = ProfileReport::default();
        let mut ratios: HashMap<OpClass, Vec<f64>> = HashMap::new();
        let mut measured = vec![false; self.nodes.len()];
        let scales = profile.whole_pass_scales();
        let split_scales = profile.split_scales();
        for (p, split) in profile.nodes.iter().zip(&split_scales) {
            let Some(&n) = by_name.get(p.name.as_str()) else {
                report.unknown_nodes.push(p.name.clone());
                continue;
            };
            if g.node(n).op.name() != p.op {
                report.op_mismatches.push(format!(
                    "{}: profile says {}, graph has {}",
                    p.name,
                    p.op,
                    g.node(n).op.name()
                ));
            }
            let fwd_s: Vec<f64> = p.fwd_ms.iter().zip(&scales).zip(split).map(|((x, s), r)| x * s.0 * r.0 * 1e-3).collect();
            let bwd_s: Vec<f64> = p.bwd_ms.iter().zip(&scales).zip(split).map(|((x, s), r)| x * s.1 * r.1 * 1e-3).collect();
            let analytic: f64 = profile
                .batches
                .iter()
                .map(|&b| {
                    let (f, bw) = self.analytic_time(n, b);
                    f + bw
                })
                .sum();
            let total: f64 = fwd_s.iter().chain(&bwd_s).sum();
            if analytic > 0.0 && total > 0.0 {
                ratios
                    .entry(self.classes[n.index()])
                    .or_default()
                    .push(total / analytic);
            }
            self.timing[n.index()] = Timing::Measured {
                fwd: Measured::new(&profile.batches, &fwd_s),
                bwd: Measured::new(&profile.batches, &bwd_s),
            };
            measured[n.index()] = true;
            report.measured += 1;
        }
        let mut all: Vec<f64> = ratios.values().flatten().copied().collect();
        let global = median(&mut all).unwrap_or(1.0);
        let mut class_ratio: HashMap<OpClass, f64> = HashMap::new();
        for (c, mut v) in ratios {
            if let Some(m) = median(&mut v) {
                class_ratio.insert(c, m);
            }
        }
        for &n in &self.topo {
            if !measured[n.index()] {
                let scale = class_ratio
                    .get(&self.classes[n.index()])
                    .copied()
                    .unwrap_or(global);
                self.timing[n.index()] = Timing::Analytic { scale };
                report.calibrated += 1;
            }
        }
        let mut cr: Vec<(OpClass, f64)> = class_ratio.into_iter().collect();
        cr.sort_by_key(|x| x.0);
        report.class_ratio = cr;
        report.updates_measured = self.apply_updates(g, &profile.updates, profile.whole_step_scales());
        self.loss = profile.loss.as_ref().map(|l| {
            let secs = |v: &[f64]| v.iter().map(|x| x * 1e-3).collect::<Vec<f64>>();
            (Measured::new(&profile.batches, &secs(&l.fwd_ms)), Measured::new(&profile.batches, &secs(&l.bwd_ms)))
        });
        self.sharing = profile.sharing.clone();
        let batches: Vec<u64> = profile.boundary.iter().map(|c| c.batch).collect();
        self.boundary = (!batches.is_empty()).then(|| {
            let fit = |ms: fn(&BoundaryCost) -> f64| Measured::new(&batches, &profile.boundary.iter().map(ms).collect::<Vec<f64>>());
            [fit(|c| c.fwd_ms), fit(|c| c.bwd_ms), fit(|c| c.step_ms)]
        });
        let after: Option<Vec<f64>> = profile.boundary.iter().map(|c| c.after_backward_ms).collect();
        self.after_backward = after.filter(|ms| !ms.is_empty()).map(|ms| Measured::new(&batches, &ms));
        self.accumulate = profile.accumulate_ms.map(|ms| ms * 1e-3);
        self.spread = DurationSpread::new(&profile.duration_factors);
        Ok(report)
    }

    /// Seconds to add a gradient of every trainable weight into its accumulator, which a
    /// stage pays (its share by weight bytes) for each microbatch of a step but the first;
    /// `None` unless a profile measured it.
    pub fn accumulate_time(&self) -> Option<f64> {
        self.accumulate
    }

    /// Seconds one stage boundary costs the runtime beyond its nodes at microbatch `b`:
    /// forward and backward per microbatch, the update per step (each stage pays half per
    /// boundary it has); 0 unless a profile measured it.
    pub fn boundary_time(&self, b: u64) -> [f64; 3] {
        self.boundary.as_ref().map_or([0.0; 3], |fit| std::array::from_fn(|k| fit[k].at(b) * 1e-3))
    }

    /// Seconds of the runtime's untraced work after each backward of microbatch `b`, which
    /// every stage pays ([`BoundaryCost::after_backward_ms`]); 0 unless a profile measured
    /// it.
    pub fn after_backward_time(&self, b: u64) -> f64 {
        self.after_backward.as_ref().map_or(0.0, |fit| fit.at(b) * 1e-3)
    }

    /// How crowding slows threads at microbatch `b` on a host of `cores` cores: the
    /// profile's measurement when it was taken on a host of as many cores, else none (a
    /// host of another size crowds differently).
    pub fn crowding(&self, cores: usize, b: u64) -> Crowding {
        self.sharing.as_ref().filter(|s| s.cores == cores).map_or(Crowding::NONE, |s| s.crowding(b))
    }

    /// The scheduler's tick on a host of `cores` cores, seconds: the turn the profile
    /// measured ([`HostSharing::turn_ms`]) when it was taken on a host of as many cores,
    /// else 0 (unknown).
    pub fn tick(&self, cores: usize) -> f64 {
        self.sharing.as_ref().filter(|s| s.cores == cores).and_then(|s| s.turn_ms).map_or(0.0, |ms| ms * 1e-3)
    }

    /// How the operations' times spread about their stages' times, from a profile that
    /// measured it ([`Profile::duration_factors`]).
    pub fn duration_spread(&self) -> Option<&DurationSpread> {
        self.spread.as_ref()
    }

    /// A CPU host of `cores` cores as the replays of microbatch `b` share it: Linux's time
    /// slices ending on the measured tick, crowded as [`CostModel::crowding`] says.
    pub fn host_cores(&self, cores: usize, b: u64) -> HostCores {
        HostCores::linux(cores).ticking(self.tick(cores)).crowded(self.crowding(cores, b))
    }

    /// Forward and backward seconds of the training loss at microbatch `b`, which the last
    /// stage computes besides its nodes: (0, 0) unless a profile timed it.
    pub fn loss_time(&self, b: u64) -> (f64, f64) {
        self.loss.as_ref().map_or((0.0, 0.0), |(f, bw)| (f.at(b), bw.at(b)))
    }

    /// Attributes each measured weight update, scaled by `scales` (per optimizer, to the
    /// whole step), to the node that reads the weight first (as [`NodeCost::param_bytes`]
    /// is); returns how many weights of the graph were found.
    fn apply_updates(&mut self, g: &Graph, updates: &[WeightUpdate], scales: [f64; 3]) -> usize {
        if updates.is_empty() {
            return 0;
        }
        let by_name: HashMap<&str, &WeightUpdate> = updates.iter().map(|u| (u.name.as_str(), u)).collect();
        let mut per_node = vec![[0.0; 3]; self.nodes.len()];
        let mut seen = std::collections::HashSet::new();
        let mut found = 0;
        for &n in &self.topo {
            for &v in &self.weights[n.index()] {
                if !seen.insert(v) {
                    continue;
                }
                if let Some(u) = by_name.get(g.value(v).name.as_str()) {
                    found += 1;
                    for ((t, ms), scale) in per_node[n.index()].iter_mut().zip(u.times()).zip(scales) {
                        *t += ms * scale * 1e-3;
                    }
                }
            }
        }
        self.updates = Some(per_node);
        found
    }

    /// Measured seconds to update the weights node `n` reads first under `opt`, when the
    /// profile had updates.
    pub fn update_time(&self, n: NodeId, opt: Optimizer, momentum: bool) -> Option<f64> {
        let t = self.updates.as_ref()?.get(n.index())?;
        Some(match opt {
            Optimizer::Sgd if momentum => t[1],
            Optimizer::Sgd => t[0],
            Optimizer::Adam | Optimizer::AdamW => t[2],
        })
    }

    /// Totals over all nodes: (forward+backward flops, activation bytes, parameter bytes).
    pub fn totals(&self) -> (Lin, Lin, u64) {
        let mut f = Lin::ZERO;
        let mut a = Lin::ZERO;
        let mut p = 0;
        for &n in &self.topo {
            let c = &self.nodes[n.index()];
            f += c.fwd_flops + c.bwd_flops;
            a += c.activation_bytes;
            p += c.param_bytes;
        }
        (f, a, p)
    }
}
