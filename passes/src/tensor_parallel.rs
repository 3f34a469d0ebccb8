//! Tensor model parallelism in the style of Megatron-LM, for `pipewright simulate`'s
//! comparison: the [`TensorSplit`] analysis decides which nodes of a graph are split over
//! the `t` GPUs of a group, and [`plan_tensor_parallel`] chooses `t`, the number of
//! data-parallel groups and the microbatch, and prices one group's work per microbatch
//! for the replay (a one-stage pipeline per group).
//!
//! # The split (propagated in topological order)
//! - A MatMul or Gemm whose second operand is a 2-D weight initializer (or its transpose,
//!   as a tied LM head reads the token embedding) is
//!   **column-parallel** (each GPU holds `1/t` of the weight's columns and computes `1/t`
//!   of the output, which stays sharded) when its activation operand is full, and
//!   **row-parallel** (`1/t` of the rows; the partial outputs are summed by an all-reduce,
//!   so the output is full) when its activation operand is sharded.
//! - A `Gather` of rows of a 2-D weight by a graph input (the token embedding) is split
//!   **by vocabulary** (Megatron's `VocabParallelEmbedding`): `1/t` of the table per GPU,
//!   each looking every token up in its rows, the partial outputs summed by an all-reduce.
//! - Elementwise ops, reshapes, transposes, splits, casts, dropout, softmax and the
//!   matmuls between two activations (attention's scores and context) are **sharded**
//!   when any input is sharded (Megatron splits attention by heads), full otherwise.
//! - Everything else is **full**: normalisations over the hidden axis, other gathers
//!   (a position table), reductions, convolutions, and any op not named above. That is
//!   conservative: such a node is replicated on every GPU of the group with its full time
//!   and memory. A full node reading a sharded value needs the whole value: an all-gather
//!   in the forward and a reduce-scatter in the backward ([`TensorSplit::gathers`]).
//!   Megatron's GPT blocks never need one.
//! - A graph output sharded along its last axis (the vocabulary-split logits) is finished
//!   by the loss from per-position partials, as Megatron's parallel cross-entropy does
//!   (three all-reduces of one fp32 value per position; [`TensorSplit::loss_allreduces`]);
//!   one of unknown last extent is gathered.
//!
//! # Communication per microbatch, inside the group (a ring)
//! Forward: one all-reduce of each row-parallel matmul's and vocabulary-split lookup's
//! output (Megatron's `g`), and the loss's three per position.
//! Backward: one all-reduce of the gradient of each distinct full value that
//! column-parallel matmuls read (Megatron's `f`; none for graph inputs and weights, whose
//! gradient with respect to the input nobody needs). So a GPT block has two of each. They
//! are on the critical path, so the replay adds them to the forward and backward time.
//! The ring runs over NVLink when the group sits in one server; a group of a fixed `t`
//! larger than a server (`simulate --tensor-ways`) spans whole servers and its ring
//! crosses each server's network once, at the network's speed.
//!
//! # Cost and memory with `t`
//! Sharded nodes and both kinds of split matmul take `1/t` of their time (the
//! [`CostModel`]'s node times) and hold `1/t` of their parameters and activations; full
//! nodes keep all of theirs. Memory per GPU is the planner's model of a one-stage Flush
//! pipeline ([`MemoryModel::of_schedule`]: weights, gradient, optimizer state and
//! the mixed-precision copy per weight byte, one microbatch's activations) on those shares.
//!
//! # Recomputation
//! None is searched: with one stage and one microbatch in flight it keeps as much as
//! without it. Fixed (`simulate --recompute`, as the PipeDream-2BW paper runs every
//! baseline with activation recomputation), it costs what Megatron's activation
//! checkpointing costs: `full` reruns each microbatch's forward before its backward,
//! the forward's tensor all-reduces and gathers included (they are part of the layer
//! function that is checkpointed); `selective` reruns the nodes outside the matmul class
//! (their outputs are the ones not kept), which communicate nothing. The memory is the
//! planner's model of that recomputation on one stage.
//!
//! # Search
//! `t` over the divisors of the server size from 2 (a group never leaves its server, as
//! Megatron places it), or the one `t` asked for (`simulate --tensor-ways`: a divisor of the
//! server size or a multiple of it, the way the PipeDream-2BW paper runs its 16-way
//! tensor-parallel baseline over two servers);
//! `groups` from 1 to `workers / t` dividing the global batch, `b` a power of two
//! dividing `batch / groups`, `m = batch / (groups * b)` (gradient accumulation). Per
//! batch a group takes `m * T + AR` (`T` the microbatch's compute and tensor all-reduces,
//! `AR` the data-parallel all-reduce of each GPU's `1/t`-sharded gradients among the
//! groups, as the planner prices Flush with one stage); the fastest that fits wins.

// `%` and `map_or(true, ..)`: the workspace's MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of, clippy::unnecessary_map_or)]

use pipewright_core::units::human_bytes;
use pipewright_core::{Placement, Recompute, Schedule};
use pipewright_ir::{Graph, NodeId, Op, ValueDef, ValueId};
use serde::Serialize;

use crate::cost::CostModel;
use pipewright_ops::op::OpClass;
use crate::machine::{allreduce_seconds, Link};
use crate::partition::{value_bytes, MemoryModel, PartitionProblem, PipelineMemory};
use crate::planner::{Candidate, PlanOptions};
use crate::presets::SimCluster;
use crate::simulate::StageCost;

/// How one node is split over the `t` GPUs of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharding {
    /// Replicated: every GPU runs all of it.
    Full,
    /// A matmul with a weight split by columns: output sharded.
    Column,
    /// A matmul with a weight split by rows: output full after an all-reduce.
    Row,
    /// Runs on a `1/t` slice (heads, hidden columns) of its inputs.
    Sharded,
    /// An embedding lookup split by vocabulary: each GPU holds `1/t` of the table's rows
    /// and looks every token up in them (zeros for the rows it lacks); the partial
    /// outputs are summed by an all-reduce, so the output is full.
    Vocab,
}

/// Which nodes Megatron-style tensor parallelism splits (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSplit {
    /// By `NodeId::index()`.
    sharding: Vec<Sharding>,
    /// Outputs of row-parallel matmuls: all-reduced in the forward.
    pub forward_allreduces: Vec<ValueId>,
    /// Distinct full values read by column-parallel matmuls: their gradients are
    /// all-reduced in the backward.
    pub backward_allreduces: Vec<ValueId>,
    /// Sharded values a full node or the graph's outputs need whole: all-gathered in the
    /// forward, reduce-scattered in the backward.
    pub gathers: Vec<ValueId>,
    /// Graph outputs sharded along their last axis (of the given extent), which the loss
    /// finishes from per-position partials as Megatron's parallel cross-entropy does:
    /// three all-reduces of one fp32 value per position (the maximum, the sum of the
    /// exponentials, the target's logit) in the forward, none in the backward.
    pub loss_allreduces: Vec<(ValueId, i64)>,
}

/// Why tensor parallelism cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TensorError {
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
    #[error("no MatMul or Gemm has a 2-D weight to split, so tensor parallelism would only replicate the model")]
    NothingToSplit,
    #[error("tensor parallelism splits layers over the GPUs of one server, and the servers have {0} GPU(s); it needs at least 2")]
    ServerTooSmall(usize),
    #[error("no (t, groups, b) has t x groups within the {workers} GPUs, groups dividing the global batch {batch} and b a power of two dividing batch / groups{fixed}")]
    NoConfiguration { workers: usize, batch: u64, fixed: String },
    #[error("does not fit at any t: {0}")]
    DoesNotFit(String),
    #[error("--tensor-ways {ways}: {why}")]
    Ways { ways: usize, why: String },
}

/// The `t` to try: the divisors of the server size from 2, or `ways` when it is one of
/// them or a multiple of the server size within the cluster (a group of whole servers).
fn tensor_ways(ways: Option<usize>, per_server: usize, workers: usize) -> Result<Vec<usize>, TensorError> {
    let divisors = || (2..=per_server).filter(|t| per_server % t == 0);
    let Some(t) = ways else { return Ok(divisors().collect()) };
    let bad = |why: String| Err(TensorError::Ways { ways: t, why });
    if t < 2 {
        return bad("a layer is split over at least 2 GPUs".into());
    }
    if t > workers {
        return bad(format!("the cluster has {workers} GPUs"));
    }
    if t <= per_server && per_server % t != 0 || t > per_server && t % per_server != 0 {
        return bad(format!("a group must divide a server of {per_server} GPUs or be whole servers (a multiple of {per_server})"));
    }
    Ok(vec![t])
}

/// Ops that run on a slice of a sharded input without communication (see the module docs).
fn follows_input(op: &Op) -> bool {
    op.is_elementwise()
        || matches!(
            op,
            Op::Reshape { .. }
                | Op::Flatten { .. }
                | Op::Transpose { .. }
                | Op::Squeeze { .. }
                | Op::Unsqueeze { .. }
                | Op::Split(_)
                | Op::Dropout { .. }
                | Op::Cast { .. }
                | Op::CastLike { .. }
                | Op::Softmax(_)
                | Op::LogSoftmax(_)
                | Op::MatMul
                | Op::Gemm(_)
                | Op::Einsum { .. }
                | Op::Attention(_)
        )
}

/// `v` when it is a trainable 2-D weight initializer.
fn weight_matrix(g: &Graph, v: ValueId) -> Option<ValueId> {
    let val = g.value(v);
    (val.weight().is_some_and(|x| x.trainable) && val.ty.shape.rank() == 2).then_some(v)
}

/// The trainable 2-D weight `v` is the transpose of (`Transpose` swapping its two axes),
/// as a tied language-model head reads the token embedding.
fn transposed_weight(g: &Graph, v: ValueId) -> Option<ValueId> {
    let ValueDef::Node { node, .. } = &g.value(v).def else { return None };
    let t = g.node(*node);
    let swaps = match &t.op {
        Op::Transpose { perm: None } => true,
        Op::Transpose { perm: Some(p) } => p.as_slice() == [1, 0],
        _ => false,
    };
    t.inputs.first().copied().flatten().filter(|_| swaps).and_then(|w| weight_matrix(g, w))
}

/// The 2-D weight initializer a MatMul or Gemm multiplies its first operand by, read
/// directly or through a transpose (the tied LM head: Megatron splits it by vocabulary).
fn split_weight(g: &Graph, n: NodeId) -> Option<ValueId> {
    let node = g.node(n);
    if !matches!(node.op, Op::MatMul | Op::Gemm(_)) {
        return None;
    }
    let w = node.inputs.get(1).copied().flatten()?;
    weight_matrix(g, w).or_else(|| transposed_weight(g, w))
}

/// The embedding table a `Gather` of rows looks the graph's token ids up in: a trainable
/// 2-D weight indexed by a graph input (Megatron splits it by vocabulary; a position
/// table indexed by computed positions stays whole).
fn vocabulary_table(g: &Graph, n: NodeId) -> Option<ValueId> {
    let node = g.node(n);
    if !matches!(node.op, Op::Gather { axis: 0 }) {
        return None;
    }
    let ids = node.inputs.get(1).copied().flatten()?;
    matches!(g.value(ids).def, ValueDef::Input).then_some(())?;
    weight_matrix(g, node.inputs.first().copied().flatten()?)
}

impl TensorSplit {
    /// Classifies every node of `g` (see the module docs).
    pub fn of(g: &Graph) -> Result<TensorSplit, TensorError> {
        let topo = g.topo_order().map_err(|n| TensorError::Cycle(g.node(n).name.clone()))?;
        let bound = g.node_ids().map(|x| x.index() + 1).max().unwrap_or(0);
        let mut sharding = vec![Sharding::Full; bound];
        let mut sharded = vec![false; g.value_count()];
        let (mut forward, mut backward, mut gathers) = (Vec::new(), Vec::new(), Vec::new());
        for &n in &topo {
            let node = g.node(n);
            let any_sharded = node.inputs.iter().flatten().any(|v| sharded[v.index()]);
            let transposes_a_weight = matches!(node.op, Op::Transpose { .. }) && node.outputs.iter().flatten().any(|&v| transposed_weight(g, v).is_some());
            let p = match split_weight(g, n) {
                _ if vocabulary_table(g, n).is_some() => Sharding::Vocab,
                // Each GPU transposes its own slice of the weight.
                _ if transposes_a_weight => Sharding::Sharded,
                Some(_) => {
                    let x = node.inputs.first().copied().flatten();
                    if x.is_some_and(|x| sharded[x.index()]) {
                        Sharding::Row
                    } else {
                        // Weights and graph inputs need no input gradient, so no `f`.
                        if let Some(x) = x.filter(|x| matches!(g.value(*x).def, ValueDef::Node { .. })) {
                            if !backward.contains(&x) {
                                backward.push(x);
                            }
                        }
                        Sharding::Column
                    }
                }
                None if any_sharded && follows_input(&node.op) => Sharding::Sharded,
                None => {
                    for v in node.inputs.iter().flatten() {
                        if sharded[v.index()] && !gathers.contains(v) {
                            gathers.push(*v);
                        }
                    }
                    Sharding::Full
                }
            };
            sharding[n.index()] = p;
            let out_sharded = matches!(p, Sharding::Column | Sharding::Sharded);
            for v in node.outputs.iter().flatten() {
                sharded[v.index()] = out_sharded;
                if matches!(p, Sharding::Row | Sharding::Vocab) {
                    forward.push(*v);
                }
            }
        }
        let mut loss_allreduces = Vec::new();
        for v in g.outputs() {
            if !sharded[v.index()] || gathers.contains(v) {
                continue;
            }
            // Sharded along its last axis with a known extent: the loss finishes it from
            // per-position partials (Megatron's parallel cross-entropy), else it is gathered.
            match g.value(*v).ty.shape.dims().last().and_then(|d| d.fixed()) {
                Some(k) if k > 0 => loss_allreduces.push((*v, k)),
                _ => gathers.push(*v),
            }
        }
        Ok(TensorSplit { sharding, forward_allreduces: forward, backward_allreduces: backward, gathers, loss_allreduces })
    }

    /// The sharding of node `n`.
    pub fn sharding(&self, n: NodeId) -> Sharding {
        self.sharding.get(n.index()).copied().unwrap_or(Sharding::Full)
    }

    /// The share of node `n`'s time, parameters and activations one of `t` GPUs has.
    pub fn share(&self, n: NodeId, t: usize) -> f64 {
        match self.sharding(n) {
            // Every GPU looks up every token and writes the whole output.
            Sharding::Full | Sharding::Vocab => 1.0,
            Sharding::Column | Sharding::Row | Sharding::Sharded => 1.0 / t.max(1) as f64,
        }
    }

    /// The share of node `n`'s parameters one of `t` GPUs holds.
    pub fn param_share(&self, n: NodeId, t: usize) -> f64 {
        match self.sharding(n) {
            Sharding::Vocab => 1.0 / t.max(1) as f64,
            _ => self.share(n, t),
        }
    }
}

/// The tensor-parallel configuration chosen, and what one group's GPU does per microbatch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorParallelPlan {
    /// GPUs per group: each split layer is divided among them.
    pub t: usize,
    /// The configuration as the simulator replays it: `w` data-parallel groups, one stage,
    /// microbatch `b`, `m` microbatches per batch and group, the recomputation asked for
    /// (none unless fixed; the Flush order with one stage); `samples_per_s` the closed form
    /// `groups * b * m / (m T + AR)`.
    pub candidate: Candidate,
    /// `T`: forward and backward compute plus the tensor all-reduces, and what the
    /// recomputation reruns, per microbatch.
    pub microbatch_s: f64,
    /// Seconds of the tensor all-reduces (and gathers) per microbatch, forward and backward.
    pub forward_comm_s: f64,
    pub backward_comm_s: f64,
    /// One GPU's work, as the replay takes it (the all-reduces inside forward and backward).
    pub stage: StageCost,
    /// The link of the data-parallel all-reduce among the groups.
    pub dp_link: Link,
}

/// One GPU's share of the model at `t`, microbatch `b`: forward, backward and recomputed
/// compute seconds (`recompute`'s compute only; see the module docs), and the
/// per-position numbers of the planner's one-stage memory model.
fn shares(cost: &CostModel, split: &TensorSplit, topo: &[NodeId], t: usize, b: u64, recompute: Recompute) -> (f64, f64, f64, PartitionProblem) {
    let (mut fwd, mut bwd, mut re) = (0.0, 0.0, 0.0);
    let n = topo.len();
    let mut prob = PartitionProblem { time: Vec::with_capacity(n), param_bytes: Vec::with_capacity(n), act_bytes: Vec::with_capacity(n), kept_bytes: Vec::new(), live_bytes: vec![0.0; n + 1], bandwidth: f64::INFINITY, transfer_share: 1.0, awaiting_bytes: Vec::new(), keeps_graph: Vec::new() };
    for &x in topo {
        let k = split.share(x, t);
        let (f, bw) = cost.time(x, b);
        fwd += f * k;
        bwd += bw * k;
        re += match recompute {
            Recompute::None => 0.0,
            Recompute::Full => f * k,
            Recompute::Selective if matches!(cost.class(x), OpClass::MatMul | OpClass::Conv) => 0.0,
            Recompute::Selective => f * k,
        };
        let c = cost.node(x);
        prob.time.push((f + bw) * k);
        prob.param_bytes.push(c.param_bytes as f64 * split.param_share(x, t));
        prob.act_bytes.push(c.activation_bytes.at(b).max(0.0) * k);
    }
    (fwd, bwd, re, prob)
}

/// Seconds of the tensor all-reduces and gathers per microbatch `b` among `t` GPUs over
/// `link`, forward and backward; activations travel in the compute type.
fn tensor_comm(g: &Graph, split: &TensorSplit, export: i64, ratio: f64, t: usize, b: u64, link: Link) -> (f64, f64) {
    let bytes = |v: &ValueId| value_bytes(g.value(*v), export).at(b).max(0.0) * ratio;
    // An all-gather (or reduce-scatter) is half a ring all-reduce: t - 1 steps of 1/t.
    let gathers: f64 = split.gathers.iter().map(|v| allreduce_seconds(bytes(v), t, link) / 2.0).sum();
    let fwd: f64 = split.forward_allreduces.iter().map(|v| allreduce_seconds(bytes(v), t, link)).sum();
    // Per position, fp32 (the graph's outputs are fp32 values, 4 bytes each).
    let partials = |(v, k): &(ValueId, i64)| value_bytes(g.value(*v), export).at(b).max(0.0) / *k as f64;
    let loss: f64 = split.loss_allreduces.iter().map(|o| 3.0 * allreduce_seconds(partials(o), t, link)).sum();
    let fwd = fwd + loss;
    let bwd: f64 = split.backward_allreduces.iter().map(|v| allreduce_seconds(bytes(v), t, link)).sum();
    (fwd + gathers, bwd + gathers)
}

/// Chooses `t`, the groups and the microbatch for `g` on `cluster` (see the module docs),
/// with `opts`'s global batch, optimizer, precision, and fixed microbatch and width (the
/// groups) if any; `ways` fixes `t`.
pub fn plan_tensor_parallel(g: &Graph, cost: &CostModel, cluster: &SimCluster, opts: &PlanOptions, ways: Option<usize>) -> Result<TensorParallelPlan, TensorError> {
    let c = &cluster.cluster;
    let per_server = c.workers_per_node.min(c.workers);
    if per_server < 2 && ways.is_none() {
        return Err(TensorError::ServerTooSmall(per_server));
    }
    let ts = tensor_ways(ways, per_server, c.workers)?;
    let recompute = opts.recompute.unwrap_or(Recompute::None);
    let split = TensorSplit::of(g)?;
    let topo = g.topo_order().map_err(|n| TensorError::Cycle(g.node(n).name.clone()))?;
    if !topo.iter().any(|&n| split.sharding(n) == Sharding::Column) {
        return Err(TensorError::NothingToSplit);
    }
    let limit = c.memory_per_worker as f64;
    let ratio = opts.precision.activation_share();
    let state = opts.optimizer.state_tensors(opts.momentum);

    let batch = opts.global_batch;
    let mut best: Option<(f64, f64, TensorParallelPlan)> = None;
    // The smallest memory any configuration needs, for the error when none fits.
    let mut least: Option<(f64, String)> = None;
    for t in ts {
        let ring = cluster.tensor_link(t);
        for groups in (1..=c.workers / t).filter(|&w| batch % w as u64 == 0 && opts.width.map_or(true, |x| x == w)) {
            let per_group = batch / groups as u64;
            let mut b = 1u64;
            while b <= per_group && per_group % b == 0 {
                if opts.microbatch.is_some_and(|x| x != b) {
                    b *= 2;
                    continue;
                }
                let m = per_group / b;
                let (fwd, bwd, re, prob) = shares(cost, &split, &topo, t, b, recompute);
                let mem_one = MemoryModel::of_schedule(Schedule::Flush, recompute, 1.0, state, opts.precision, limit);
                let mem_two = MemoryModel::of_schedule(Schedule::Flush, recompute, 2.0, state, opts.precision, limit);
                let memory = prob.evaluate(&[], &PipelineMemory::uniform(mem_one)).1[0];
                let computing = |m: &MemoryModel| prob.evaluate(&[], &PipelineMemory::uniform(MemoryModel { update_factor: 0.0, ..*m })).1[0];
                if memory > limit * (1.0 + 1e-12) || memory.is_nan() {
                    if least.as_ref().map_or(true, |l| memory < l.0) {
                        let params: f64 = prob.param_bytes.iter().sum();
                        let acts: f64 = prob.act_bytes.iter().sum::<f64>() * mem_one.act_factor;
                        let why = format!(
                            "the least a GPU needs is {} (t = {t}, b = {b}: weights, gradients and optimizer state of {} of parameters, {} of activations) of its {}",
                            human_bytes(memory.max(0.0) as u64),
                            human_bytes(params as u64),
                            human_bytes(acts.max(0.0) as u64),
                            human_bytes(c.memory_per_worker)
                        );
                        least = Some((memory, why));
                    }
                    b *= 2;
                    continue;
                }
                let (fc, bc) = tensor_comm(g, &split, cost.export_batch, ratio, t, b, ring);
                let recompute_s = re + if recompute == Recompute::Full { fc } else { 0.0 };
                let microbatch_s = fwd + bwd + fc + bc + recompute_s;
                let grad: f64 = prob.param_bytes.iter().sum();
                let dp_bw = c.tensor_dp_bw(t, groups);
                let ar = if groups > 1 { 2.0 * (groups as f64 - 1.0) / groups as f64 * grad / dp_bw } else { 0.0 };
                let per_batch = m as f64 * microbatch_s + ar;
                let samples_per_s = if per_batch > 0.0 { (b * m * groups as u64) as f64 / per_batch } else { f64::INFINITY };
                // Faster wins; at equal speed the smaller memory, then the smaller t.
                let better = best.as_ref().map_or(true, |(s, mem, _)| samples_per_s > *s || (samples_per_s == *s && memory < *mem));
                if better {
                    let stage = StageCost {
                        forward_s: fwd + fc,
                        backward_s: bwd + bc,
                        // Replayed under Flush, which never splits the backward.
                        weight_grad_s: 0.0,
                        recompute_s,
                        optimizer_s: f64::from(3 + 2 * state) * grad / c.mem_bw,
                        send_s: 0.0,
                        after_backward_s: 0.0,
                        send_bytes: 0.0,
                        grad_bytes: grad,
                        tied_sync_s: 0.0,
                        // The replay's line in the microbatches in flight, the update apart.
                        memory_one: computing(&mem_one),
                        memory_per_extra: computing(&mem_two) - computing(&mem_one),
                        memory_at_update: mem_one.update_factor * grad,
                        gradient_bytes: grad,
                        memory_per_awaiting: 0.0,
                    };
                    let candidate = Candidate {
                        w: groups,
                        d: 1,
                        b,
                        m,
                        recompute,
                        schedule: Schedule::Flush,
                        // One stage: the placement numbers nothing differently.
                        placement: Placement::StageMajor,
                        samples_per_s,
                        replayed_samples_per_s: None,
                        peak_memory_per_stage: vec![memory.max(0.0).round() as u64],
                        bottleneck_stage: 0,
                        cuts: Vec::new(),
                    };
                    let plan = TensorParallelPlan { t, candidate, microbatch_s, forward_comm_s: fc, backward_comm_s: bc, stage, dp_link: cluster.tensor_dp_link(t, groups) };
                    best = Some((samples_per_s, memory, plan));
                }
                b *= 2;
            }
        }
    }
    match (best, least) {
        (Some((_, _, plan)), _) => Ok(plan),
        (None, Some((_, why))) => Err(TensorError::DoesNotFit(why)),
        (None, None) => {
            let fixed: Vec<String> = [opts.width.map(|w| format!("groups fixed at {w}")), opts.microbatch.map(|b| format!("microbatch fixed at {b}"))].into_iter().flatten().collect();
            let fixed = if fixed.is_empty() { String::new() } else { format!(" ({})", fixed.join(", ")) };
            Err(TensorError::NoConfiguration { workers: c.workers, batch, fixed })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_core::Precision;
    use pipewright_ir::{import_model, ImportOptions};
    use pipewright_synth::{gpt, GptShape};
use pipewright_core::Storage;

    use crate::presets::{device, network};
    use crate::simulate::{simulate, SimSetup};

    /// A synthetic GPT imported with shapes only (the importer the simulator uses).
    fn gpt_graph(shape: &GptShape) -> Graph {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpt.onnx");
        gpt(shape).unwrap().write(&path, Storage::ShapesOnly, 0).unwrap();
        import_model(&path, &ImportOptions { shapes_only: true, ..ImportOptions::default() }).unwrap()
    }

    fn by_name(g: &Graph, name: &str) -> NodeId {
        g.node_ids().find(|&n| g.node(n).name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Megatron's split of a GPT block: QKV and fc1 column-parallel, the attention
    /// projection and fc2 row-parallel, attention split by heads in between, the layer
    /// norms and residuals replicated; two all-reduces forward and two backward per layer.
    #[test]
    fn a_gpt_block_splits_as_megatron_does() {
        let shape = GptShape { layers: 3, ..GptShape::TINY };
        let g = gpt_graph(&shape);
        let split = TensorSplit::of(&g).unwrap();
        let at = |name: &str| split.sharding(by_name(&g, name));
        for l in 0..shape.layers {
            let p = format!("h.{l}");
            assert_eq!(at(&format!("{p}.attn.c_attn.matmul")), Sharding::Column);
            assert_eq!(at(&format!("{p}.mlp.c_fc.matmul")), Sharding::Column);
            assert_eq!(at(&format!("{p}.attn.c_proj.matmul")), Sharding::Row);
            assert_eq!(at(&format!("{p}.mlp.c_proj.matmul")), Sharding::Row);
            // Import fuses the attention (scores, scale, mask, softmax, context) into one
            // node, the context's.
            for sharded in ["attn.c_attn.add", "attn.split", "attn.q.transpose", "attn.context", "attn.merge.reshape", "mlp.c_fc.add", "mlp.gelu"] {
                assert_eq!(at(&format!("{p}.{sharded}")), Sharding::Sharded, "{p}.{sharded}");
            }
            for full in ["ln_1", "ln_2", "attn.c_proj.add", "residual_1", "mlp.c_proj.add", "residual_2"] {
                assert_eq!(at(&format!("{p}.{full}")), Sharding::Full, "{p}.{full}");
            }
        }
        // The token embedding and the tied head split by vocabulary: the lookup's output
        // all-reduced, the head's logits left sharded for the loss to finish.
        assert_eq!([at("wte"), at("embed"), at("ln_f"), at("lm_head.transpose"), at("logits")], [Sharding::Vocab, Sharding::Full, Sharding::Full, Sharding::Sharded, Sharding::Column]);
        assert_eq!(split.forward_allreduces.len(), 2 * shape.layers + 1);
        assert_eq!(split.backward_allreduces.len(), 2 * shape.layers + 1);
        assert!(split.gathers.is_empty());
        let names = |vs: &[ValueId]| vs.iter().map(|&v| g.value(v).name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&split.forward_allreduces)[..3], ["wte", "h.0.attn.c_proj.matmul", "h.0.mlp.c_proj.matmul"]);
        assert_eq!(names(&split.backward_allreduces)[..2], ["h.0.ln_1", "h.0.ln_2"]);
        assert_eq!(names(&split.backward_allreduces).last().map(String::as_str), Some("ln_f"));
        let logits: Vec<(String, i64)> = split.loss_allreduces.iter().map(|&(v, k)| (g.value(v).name.clone(), k)).collect();
        assert_eq!(logits, [("logits".to_string(), shape.vocab as i64)]);
        // Each GPU holds a t-th of the table, and looks up every token.
        assert_eq!((split.share(by_name(&g, "wte"), 4), split.param_share(by_name(&g, "wte"), 4)), (1.0, 0.25));
    }

    /// A full node reading a sharded value needs it whole (an all-gather), and so does a
    /// sharded graph output; a matmul reading a weight as its first operand and an op the
    /// analysis does not know are replicated.
    #[test]
    fn full_nodes_gather_their_sharded_inputs() {
        let g = pipewright_ir::parse_graph(
            r#"graph "g" ir_version=10 opset=20 batch=N("N", exported 4) {
  %v0: f32[N,8] = input "x"
  %v1: f32[8,16] = weight "fc1.weight"
  %v2: f32[16] = weight "ln.weight"
  %v3: f32[16] = weight "ln.bias"
  %v4: f32[N,16] = MatMul(%v0, %v1)  # n0 "fc1"
  %v5: f32[N,16] = Relu(%v4)  # n1 "relu"
  %v6: f32[N,16] = LayerNormalization[axis=-1, epsilon=1e-5, stash_type=1](%v5, %v2, %v3)  # n2 "ln"
  %v7: f32[N,16] = Relu(%v6)  # n3 "relu2"
  return %v5 "hidden", %v7 "out"
}"#,
        )
        .unwrap();
        let split = TensorSplit::of(&g).unwrap();
        let at = |name: &str| split.sharding(by_name(&g, name));
        assert_eq!([at("fc1"), at("relu"), at("ln"), at("relu2")], [Sharding::Column, Sharding::Sharded, Sharding::Full, Sharding::Full]);
        // relu's output: read whole by the LayerNorm and returned; gathered once.
        let names: Vec<&str> = split.gathers.iter().map(|&v| g.value(v).name.as_str()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(split.forward_allreduces, Vec::<ValueId>::new());
        // fc1 reads the graph input, whose gradient nobody needs: no backward all-reduce.
        assert_eq!(split.backward_allreduces, Vec::<ValueId>::new());
        assert_eq!(split.share(by_name(&g, "relu"), 4), 0.25);
        assert_eq!(split.share(by_name(&g, "ln"), 4), 1.0);
    }

    /// Only a lookup of graph-input ids splits by vocabulary (a table indexed by computed
    /// positions stays whole); a matmul by a weight's transpose is column-parallel; a
    /// sharded output of unknown last extent is gathered, one of known extent is left to
    /// the loss.
    #[test]
    fn lookups_of_ids_and_transposed_weights_split_by_vocabulary() {
        let g = pipewright_ir::parse_graph(
            r#"graph "g" ir_version=10 opset=20 batch=N("N", exported 4) {
  %v0: i64[N,4] = input "ids"
  %v1: f32[10,8] = weight "table"
  %v2: f32[6,8] = weight "positions"
  %v3: i64[4] = const "where" [0, 1, 2, 3]
  %v4: f32[N,4,8] = Gather[axis=0](%v1, %v0)  # n0 "tokens"
  %v5: f32[4,8] = Gather[axis=0](%v2, %v3)  # n1 "placed"
  %v6: f32[N,4,8] = Add(%v4, %v5)  # n2 "embed"
  %v7: f32[8,10] = Transpose[perm=[1, 0]](%v1)  # n3 "head.transpose"
  %v8: f32[N,4,10] = MatMul(%v6, %v7)  # n4 "head"
  %v9: f32[N,4,N] = MatMul(%v8, %v8)  # n5 "odd"
  return %v8 "logits", %v9 "odd"
}"#,
        )
        .unwrap();
        let split = TensorSplit::of(&g).unwrap();
        let at = |name: &str| split.sharding(by_name(&g, name));
        assert_eq!([at("tokens"), at("placed"), at("embed"), at("head.transpose"), at("head"), at("odd")], [Sharding::Vocab, Sharding::Full, Sharding::Full, Sharding::Sharded, Sharding::Column, Sharding::Sharded]);
        // By value: the lookup's output and the head's input (unnamed in the text), the
        // logits and the odd product (graph outputs, named).
        let name = |v: &ValueId| g.value(*v).name.clone();
        assert_eq!(split.forward_allreduces.iter().map(name).collect::<Vec<_>>(), ["v4"]);
        assert_eq!(split.backward_allreduces.iter().map(name).collect::<Vec<_>>(), ["v6"]);
        assert_eq!(split.loss_allreduces.iter().map(|(v, k)| (name(v), *k)).collect::<Vec<_>>(), [("logits".to_string(), 10)]);
        assert_eq!(split.gathers.iter().map(name).collect::<Vec<_>>(), ["odd"]);
    }

    fn cluster(servers: usize) -> SimCluster {
        SimCluster::from_preset(device("V100-16GB").unwrap(), network("25gbit").unwrap(), servers, 8, Precision::Fp32, Some(1.0)).unwrap()
    }

    /// The tiny GPT on one server of 8 V100s, global batch 8 at microbatch 1: its layers
    /// are so small that every all-reduce costs its latency (2 (t - 1) NVLink messages of
    /// 5 us), so the fewest GPUs per group win (t = 2) with the most groups (4, so m = 2).
    /// The time per microbatch, summed by hand from the node names: the attention and MLP
    /// nodes but the output projections' bias adds and the tied head at half their time,
    /// everything else in full, plus 2 forward and 2 backward all-reduces per layer of
    /// `seq x hidden` fp32, one more each way for the embedding's lookup (forward) and the
    /// head's input (backward), and the loss's three of one fp32 per position.
    #[test]
    fn the_tiny_gpt_picks_t_2_and_its_microbatch_time_is_the_hand_sum() {
        let shape = GptShape::TINY;
        let g = gpt_graph(&shape);
        let c = cluster(1);
        let cost = CostModel::new(&g, c.cluster.roofline()).unwrap();
        let opts = PlanOptions { global_batch: 8, microbatch: Some(1), precision: Precision::Fp32, ..PlanOptions::default() };
        let p = plan_tensor_parallel(&g, &cost, &c, &opts, None).unwrap();
        assert_eq!((p.t, p.candidate.w, p.candidate.b, p.candidate.m, p.candidate.d), (2, 4, 1, 2, 1));
        let mut compute = 0.0;
        for n in g.node_ids() {
            let name = &g.node(n).name;
            let (f, b) = cost.time(n, 1);
            let split = (name.contains(".attn.") || name.contains(".mlp.")) && !name.ends_with("c_proj.add") || name == "lm_head.transpose" || name == "logits";
            compute += if split { (f + b) / 2.0 } else { f + b };
        }
        let allreduce = |bytes: f64| 2.0 * (2.0 - 1.0) * (5e-6 + bytes / 2.0 / 150e9);
        let one_allreduce = allreduce((shape.seq * shape.hidden * 4) as f64);
        let loss = 3.0 * allreduce((shape.seq * 4) as f64);
        let forward = (2 * shape.layers + 1) as f64 * one_allreduce + loss;
        let hand = compute + (4 * shape.layers + 2) as f64 * one_allreduce + loss;
        assert!((p.microbatch_s - hand).abs() <= 1e-12 * hand, "{} against {hand}", p.microbatch_s);
        assert!((p.forward_comm_s - forward).abs() < 1e-15 + 1e-12 * forward, "{} against {forward}", p.forward_comm_s);
        assert!((p.stage.forward_s + p.stage.backward_s - hand).abs() <= 1e-12 * hand);
        // The replay: per batch m microbatches, then the groups' all-reduce of each GPU's
        // gradients (inside the server: NVLink) and the optimizer.
        assert_eq!(p.dp_link, c.tensor_link(2));
        let setup = SimSetup { scheme: pipewright_core::Scheme::TensorParallel, w: 4, b: 1, m: 2, batches: 4, stages: vec![p.stage.clone()], links: Vec::new(), allreduce: crate::machine::AllReduce::ring(p.dp_link), record: false, host: None, tied_groups: Vec::new(), spread: None };
        let sim = simulate(&setup).unwrap();
        let per_batch = 2.0 * hand + allreduce_seconds(p.stage.grad_bytes, 4, c.tensor_link(2)) + p.stage.optimizer_s;
        assert!((sim.batch_s - per_batch).abs() <= 1e-9 * per_batch, "{} against {per_batch}", sim.batch_s);
        assert!((sim.samples_per_s - 8.0 / per_batch).abs() <= 1e-9 * sim.samples_per_s);
        let two = SimSetup { stages: vec![p.stage.clone(); 2], links: vec![c.tensor_link(2)], ..setup };
        assert_eq!(simulate(&two).unwrap_err(), crate::simulate::SimError::Setup("tensor parallelism runs one stage per group of GPUs, not 2".into()));
        // Each GPU holds half of the split weights and all of the rest.
        let (mut half, mut full) = (0.0, 0.0);
        for n in g.node_ids() {
            let c = cost.node(n).param_bytes as f64;
            if split_weight(&g, n).is_some() || vocabulary_table(&g, n).is_some() || (g.node(n).name.contains(".attn.") || g.node(n).name.contains(".mlp.")) && !g.node(n).name.ends_with("c_proj.add") { half += c } else { full += c }
        }
        assert_eq!(p.stage.grad_bytes, half / 2.0 + full);
    }

    /// Across servers the groups' all-reduce crosses the network, the t rings sharing each
    /// server's link; the model that fits nowhere says what the least need was.
    #[test]
    fn links_and_a_model_that_fits_at_no_t() {
        let g = gpt_graph(&GptShape::TINY);
        let c = cluster(2);
        let cost = CostModel::new(&g, c.cluster.roofline()).unwrap();
        // Microbatch 1: 8 groups of 2 (m = 8) over both servers beat 4 in one (m = 16),
        // since a microbatch (latency-bound all-reduces) costs more than the network ring.
        let opts = PlanOptions { global_batch: 64, microbatch: Some(1), precision: Precision::Fp32, ..PlanOptions::default() };
        let p = plan_tensor_parallel(&g, &cost, &c, &opts, None).unwrap();
        assert_eq!((p.t, p.candidate.w, p.candidate.m), (2, 8, 8));
        assert_eq!(p.dp_link, Link { bandwidth: 25e9 / 8.0 / 2.0, latency_s: 20e-6 });
        let opts = PlanOptions { microbatch: None, ..opts };
        let mut small = c.clone();
        small.cluster.memory_per_worker = 64 << 10;
        let e = plan_tensor_parallel(&g, &cost, &small, &opts, None).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("does not fit at any t: the least a GPU needs is "), "{text}");
        assert!(text.contains("(t = 8, b = 1:") && text.ends_with("of its 64.0 KiB"), "{text}");
        let mut one = c.clone();
        one.cluster.workers_per_node = 1;
        assert_eq!(plan_tensor_parallel(&g, &cost, &one, &opts, None).unwrap_err(), TensorError::ServerTooSmall(1));
        let relu = pipewright_ir::parse_graph(
            r#"graph "r" ir_version=10 opset=20 batch=N("N", exported 4) {
  %v0: f32[N,8] = input "x"
  %v1: f32[N,8] = Relu(%v0)  # n0 "relu"
  return %v1 "y"
}"#,
        )
        .unwrap();
        let relu_cost = CostModel::new(&relu, c.cluster.roofline()).unwrap();
        assert_eq!(plan_tensor_parallel(&relu, &relu_cost, &c, &opts, None).unwrap_err(), TensorError::NothingToSplit);
        let odd = PlanOptions { global_batch: 3, microbatch: Some(2), ..opts.clone() };
        let e = plan_tensor_parallel(&g, &cost, &c, &odd, None).unwrap_err();
        assert!(matches!(e, TensorError::NoConfiguration { batch: 3, .. }), "{e}");
        assert_eq!(e.to_string(), "no (t, groups, b) has t x groups within the 16 GPUs, groups dividing the global batch 3 and b a power of two dividing batch / groups (microbatch fixed at 2)");
        let wide = PlanOptions { width: Some(2), ..opts.clone() };
        let e = plan_tensor_parallel(&g, &cost, &c, &wide, Some(16)).unwrap_err();
        assert_eq!(e.to_string(), "no (t, groups, b) has t x groups within the 16 GPUs, groups dividing the global batch 64 and b a power of two dividing batch / groups (groups fixed at 2)");
    }

    /// Recomputation fixed: `full` reruns the forward, its tensor all-reduces included
    /// (Megatron's checkpointed layer function holds them); `selective` only the nodes
    /// outside the matmul class, which communicate nothing; unfixed, none.
    #[test]
    fn recomputation_reruns_the_forward_and_its_all_reduces() {
        let g = gpt_graph(&GptShape::TINY);
        let c = cluster(1);
        let cost = CostModel::new(&g, c.cluster.roofline()).unwrap();
        let at = |recompute| {
            let opts = PlanOptions { global_batch: 8, microbatch: Some(1), recompute, precision: Precision::Fp32, ..PlanOptions::default() };
            plan_tensor_parallel(&g, &cost, &c, &opts, Some(2)).unwrap()
        };
        let (none, full, selective) = (at(None), at(Some(Recompute::Full)), at(Some(Recompute::Selective)));
        assert_eq!((none.stage.recompute_s, none.candidate.recompute), (0.0, Recompute::None));
        assert_eq!((full.stage.recompute_s, full.candidate.recompute), (none.stage.forward_s, Recompute::Full));
        assert!((full.microbatch_s - none.microbatch_s - none.stage.forward_s).abs() < 1e-12 * full.microbatch_s);
        let compute = none.stage.forward_s - none.forward_comm_s;
        assert!(selective.stage.recompute_s > 0.0 && selective.stage.recompute_s < compute, "{} of {compute}", selective.stage.recompute_s);
        assert_eq!(selective.candidate.recompute, Recompute::Selective);
    }

    /// A fixed `t` of whole servers: one group over both, its all-reduces over the
    /// network (the same bytes as at `t = 8` over NVLink, so the microbatch's
    /// communication grows by the links' ratio, less the ring's shorter shares); a fixed
    /// width is the number of groups; a `t` that neither divides a server nor is whole
    /// servers is refused, saying why.
    #[test]
    fn a_fixed_t_may_span_servers() {
        let g = gpt_graph(&GptShape::TINY);
        let c = cluster(2);
        let cost = CostModel::new(&g, c.cluster.roofline()).unwrap();
        let opts = PlanOptions { global_batch: 64, microbatch: Some(1), precision: Precision::Fp32, ..PlanOptions::default() };
        let within = plan_tensor_parallel(&g, &cost, &c, &PlanOptions { width: Some(1), ..opts.clone() }, Some(8)).unwrap();
        let across = plan_tensor_parallel(&g, &cost, &c, &PlanOptions { width: Some(1), ..opts.clone() }, Some(16)).unwrap();
        assert_eq!((within.t, within.candidate.w, across.t, across.candidate.w), (8, 1, 16, 1));
        let split = TensorSplit::of(&g).unwrap();
        let ratio = 1.0;
        let net = Link { bandwidth: 25e9 / 8.0, latency_s: 20e-6 };
        assert_eq!(c.tensor_link(16), net);
        let (f, b) = tensor_comm(&g, &split, cost.export_batch, ratio, 16, 1, net);
        assert_eq!((across.forward_comm_s, across.backward_comm_s), (f, b));
        assert!(across.forward_comm_s > 5.0 * within.forward_comm_s, "{} vs {}", across.forward_comm_s, within.forward_comm_s);
        let two = plan_tensor_parallel(&g, &cost, &c, &PlanOptions { width: Some(2), ..opts.clone() }, Some(8)).unwrap();
        assert_eq!((two.t, two.candidate.w, two.candidate.m), (8, 2, 32));
        for (ways, why) in [
            (1, "--tensor-ways 1: a layer is split over at least 2 GPUs"),
            (3, "--tensor-ways 3: a group must divide a server of 8 GPUs or be whole servers (a multiple of 8)"),
            (12, "--tensor-ways 12: a group must divide a server of 8 GPUs or be whole servers (a multiple of 8)"),
            (32, "--tensor-ways 32: the cluster has 16 GPUs"),
        ] {
            assert_eq!(plan_tensor_parallel(&g, &cost, &c, &opts, Some(ways)).unwrap_err().to_string(), why);
        }
    }
}
