//! The planner: searches PipeDream-2BW's configuration space (data-parallel width `w`,
//! pipeline depth `d`, microbatch `b`, recomputation, schedule) for the highest predicted
//! throughput that fits in memory, and partitions the graph into `d` stages.
//!
//! # Search space
//! `w * d <= workers`, `d <= n` (nodes), `w` divides the global batch `B`, `b` a power of
//! two dividing `B / w`, `m = B / (w * b)` microbatches per batch per pipeline, with
//! `m >= d` for 2BW and Flush; recomputation on and off; every requested schedule.
//!
//! # Memory per worker (stage `[i, j)`, [`MemoryModel`])
//! Weight bytes count `versions + 1 (gradient accumulator) + optimizer state` times
//! (SGD 0, momentum 1, Adam 2; the gradient buffer is a pipewright addition to the
//! paper's formula). Versions: 2BW 2, Flush and GPipe 1, and 2 under every schedule
//! while the update writes the new version (a phase of its own for Flush and GPipe, whose
//! activations are all released by then). Activations: the microbatches stage `k` holds
//! in flight under the schedule's own operation order ([`PipelineMemory::of_pipeline`]:
//! `d - k` under 1F1B, 2BW's and Flush's, `m` in every stage under GPipe); with
//! recomputation `held * live(i)` (stage inputs) plus one microbatch's activations of the
//! stage, without it `held *` the stage's activations. Tied weights read in several
//! stages count in each.
//!
//! # Time
//! Stage time `T_s` = compute (forward + backward, times 4/3 with recomputation) plus
//! `2 * live / bw` at each of its cuts. Its all-reduce `AR_s` is
//! [`Cluster::allreduce`]'s time for its gradient bytes (a ring inside a server; a ring
//! per server plus one per GPU shard across servers when the replicas fill whole servers;
//! else a flat ring over the network, shared by the rings crossing a server when
//! `server_bw` is known), the very function the simulator times it with, plus
//! for tied weights spanning `k` stages `2 (k-1)/k * bytes / pipeline_bw`. Per microbatch
//! `t = max_s max(T_s, AR_s / m)`; per batch 2BW takes `m * t` (the all-reduce overlaps
//! the next batch), Flush and GPipe `(m + d - 1) * max_s T_s + max_s AR_s` (the bubble, then
//! the all-reduce after the flush). Throughput = `B / time per batch` (= `b * w / t` for
//! 2BW). This closed form is what the search prunes and sorts by.
//!
//! # Choice
//! The best `max(top, REPLAYED)` configurations by the closed form are then replayed event
//! by event ([`crate::simulate`], [`REPLAY_BATCHES`] batches, each boundary on its own link,
//! with link latencies), and the plan lists and chooses them by the replayed samples/s,
//! keeping both figures ([`Candidate::replayed_samples_per_s`]). The closed form adds
//! communication to compute where the replay overlaps them, and leaves out latencies and
//! the optimizer, so near the top the two can rank differently.
//!
//! # Placement
//! Each `w x d` is searched under both numberings of its workers (the MPI ranks' order,
//! [`Placement`]) wherever they give different links: stage-major, `stage * w + replica`,
//! keeps a stage's replicas in a server when `w` divides the server size (the all-reduce on
//! NVLink, the boundaries across the network); replica-major, `replica * d + stage`, keeps
//! a pipeline in a server when `d` divides it (the boundaries on NVLink, the all-reduce
//! across). `bw` at the cuts is [`Cluster::pipeline_bw`]'s and the all-reduce
//! [`Cluster::allreduce`]'s for the candidate's layout; the plan records the placement and
//! the MPI workers number their ranks by it.
//!
//! The search evaluates configurations in decreasing order of an optimistic throughput
//! (bottleneck >= (total compute + the cheapest cut's communication at each of the d - 1
//! cuts, twice) / d, all-reduce >= that of a d-th of the parameters) and
//! drops those whose memory exceeds the limit even split evenly; it stops once no remaining one can enter the top
//! list; partitions are cached per `(d, b, recompute)` and only re-solved with the memory
//! limit when the unconstrained optimum does not fit.

// `%` and `map_or(true, ..)`: the workspace's MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of, clippy::unnecessary_map_or)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

use pipewright_ir::{Graph, NodeId, StageMap};
use pipewright_core::units::human_bytes;
use pipewright_core::words::spellings;
use pipewright_core::{Balance, Layout, Optimizer, Placement, Precision, Recompute, Schedule};
use rayon::iter::{IndexedParallelIterator, IntoParallelIterator, ParallelIterator};
use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, Latencies};
use crate::machine::Link;
use crate::simulate::{simulate, SimError, SimSetup};
use pipewright_ops::op::OpClass;

use crate::cost::{CostError, CostModel, Lin};
use crate::partition::{
    balanced_by, choose_order, stage_ranges, uniform_by_nodes, valid_cuts, value_bytes,
    LinearOrder, MemoryModel, OrderKind, PartitionProblem, PipelineMemory,
};

/// What to search.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// Samples per optimizer step over all replicas.
    pub global_batch: u64,
    pub schedules: Vec<Schedule>,
    /// Fix the pipeline depth.
    pub stages: Option<usize>,
    /// Fix the data-parallel width: `w` replicas of the pipeline (the number of
    /// tensor-parallel groups for `simulate`'s tensor parallelism). Absent in plan files
    /// from before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    /// Explicit boundaries: a stage starts at each named node.
    pub cuts: Option<Vec<String>>,
    pub balance: Balance,
    /// The optimizer whose state counts in memory.
    pub optimizer: Optimizer,
    /// SGD with momentum keeps one state tensor per weight.
    pub momentum: bool,
    /// How many candidates to keep.
    pub top: usize,
    /// Fix the microbatch size.
    pub microbatch: Option<u64>,
    /// Fix the recomputation mode (otherwise none, selective and full are all tried).
    pub recompute: Option<Recompute>,
    /// The compute type training will use (`train --precision`): what it keeps per
    /// weight and per activation. Absent in plan files from before it existed (fp32).
    #[serde(default, skip_serializing_if = "is_fp32")]
    pub precision: Precision,
    /// Fix how the workers are numbered (otherwise both placements are tried wherever they
    /// put different links under the boundaries or the gradient sums). Absent in plan files
    /// from before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
}

fn is_fp32(p: &Precision) -> bool {
    *p == Precision::Fp32
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions {
            global_batch: 64,
            schedules: vec![Schedule::TwoBw, Schedule::Flush, Schedule::GPipe],
            stages: None,
            width: None,
            cuts: None,
            balance: Balance::Optimal,
            optimizer: Optimizer::Adam,
            momentum: false,
            top: 10,
            microbatch: None,
            recompute: None,
            precision: Precision::Fp32,
            placement: None,
        }
    }
}

/// One evaluated configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub w: usize,
    pub d: usize,
    pub b: u64,
    pub m: u64,
    pub recompute: Recompute,
    pub schedule: Schedule,
    /// How the `w x d` workers are numbered. Absent from plan files written before the
    /// planner weighed it (stage-major, the only placement then).
    #[serde(default, skip_serializing_if = "Placement::is_stage_major")]
    pub placement: Placement,
    /// The closed form's samples/s (what the search prunes and sorts by).
    pub samples_per_s: f64,
    /// Samples/s of an event-by-event replay of this configuration ([`crate::simulate`]),
    /// for the candidates the planner replayed; the plan chooses by it. Absent from plan
    /// files written before the planner replayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_samples_per_s: Option<f64>,
    pub peak_memory_per_stage: Vec<u64>,
    pub bottleneck_stage: usize,
    /// First positions (in the plan's linear order) of stages `1..d`.
    pub cuts: Vec<usize>,
}

/// One stage of the chosen configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    pub index: usize,
    pub first_node: String,
    pub last_node: String,
    pub nodes: usize,
    /// Parameter elements held (tied weights counted in each stage using them).
    pub params: u64,
    /// Forward + backward flops per microbatch (without recomputation).
    pub flops: f64,
    /// One microbatch's activation bytes.
    pub activation_bytes: u64,
    /// Predicted seconds per microbatch: compute plus boundary communication.
    pub time_s: f64,
    /// Predicted bytes per worker.
    pub memory: u64,
    /// Values live across the stage's first cut (received), with bytes per microbatch as
    /// they cross (float activations in the compute type); values passing through (skip
    /// connections) appear in both lists.
    pub inputs: Vec<(String, u64)>,
    /// Values live across the stage's last cut (sent).
    pub outputs: Vec<(String, u64)>,
}

/// A tied weight read in more than one stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedWeight {
    pub name: String,
    pub stages: Vec<usize>,
    pub decision: String,
}

/// The planner's result, with the cluster and options it was made for. `plan --json`
/// writes it (inside the plan file's `PlanFile`); `compile --plan` reads it back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub cluster: Cluster,
    pub options: PlanOptions,
    /// The node order the cuts are positions in.
    pub order: OrderKind,
    /// Best first.
    pub candidates: Vec<Candidate>,
    pub chosen: Candidate,
    pub stages: Vec<StagePlan>,
    pub shared_weights: Vec<SharedWeight>,
    /// Not saved: a plan read back rebuilds it from the order and the stage starts.
    #[serde(skip)]
    node_stage: Vec<(NodeId, usize)>,
}

/// Planner errors.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the graph has no nodes")]
    EmptyGraph,
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
    #[error("invalid plan options: {0}")]
    Options(String),
    #[error("cut at unknown node {0:?}")]
    UnknownCutNode(String),
    #[error("cut at node {0:?} is not a valid stage start (first node, or repeated)")]
    BadCut(String),
    #[error("{stages} stages requested but the cuts give {from_cuts}")]
    StagesMismatch { stages: usize, from_cuts: usize },
    #[error("no configuration fits: {0}")]
    NoFeasible(String),
    #[error("the plan's stage {stage} starts at node {node:?}, which this model does not have (planned for another model?)")]
    PlanNodeMissing { stage: usize, node: String },
    #[error("the plan's stage starts are out of order for this model: {0}")]
    PlanCutsInvalid(String),
    #[error(transparent)]
    Cost(#[from] CostError),
    #[error("replaying w={w} d={d} b={b} {schedule}: {error}")]
    Replay { w: usize, d: usize, b: u64, schedule: Schedule, error: SimError },
}

impl Candidate {
    /// The plan's prediction: the replayed samples/s where the planner replayed this
    /// configuration, else the closed form's.
    pub fn predicted_samples_per_s(&self) -> f64 {
        self.replayed_samples_per_s.unwrap_or(self.samples_per_s)
    }

    /// Its workers: `w` pipelines of `d` stages (of `d / v` workers under interleaved
    /// 1F1B and ZB-V, `Schedule::worker_of`), numbered by its placement.
    pub fn layout(&self) -> Layout {
        worker_layout(self.schedule, self.d, self.w, self.placement)
    }

    /// Its stages' links, boundary by boundary ([`Cluster::stage_links`]).
    pub fn stage_links(&self, cluster: &Cluster, latencies: Latencies) -> Vec<Link> {
        cluster.stage_links(self.layout(), &self.schedule.placement(self.d), latencies)
    }

    /// Its placement for tables: `-` where it numbers nothing differently (one replica or
    /// one stage).
    pub fn placement_text(&self) -> &'static str {
        if self.w <= 1 || self.d <= 1 { "-" } else { self.placement.name() }
    }
}

/// How many of the best configurations by the closed form are replayed at least (the
/// plan's `top` if more): the closed form idealises communication (it adds to the compute,
/// where the replay overlaps it) and the link hierarchy, so its ranking near the top is
/// not the replay's, but it is close enough to prune with. 16, not 8: at the paper's scale
/// the replica-major configurations that replay best at large batches rank 9th to 16th
/// by the closed form (docs/planner.md, choice by replay). Over all the schedules searched
/// together, not per schedule: keeping each schedule's best 8 doubled the planning time
/// for GPT 3.8B on 64 GPUs (437 partitions solved where 2BW alone needs 236; the slower
/// schedules' first feasible configurations lie deep in the search); `simulate` plans
/// each schedule alone.
pub const REPLAYED: usize = 16;

/// Batches per replay of a candidate: the steady state is measured between the first and
/// the last batch's end, and 2BW's delayed updates settle within a few batches.
pub const REPLAY_BATCHES: usize = 6;

impl Plan {
    /// The stage of every node of the graph (for the partition pass).
    pub fn stage_of_nodes(&self) -> &[(NodeId, usize)] {
        &self.node_stage
    }

    /// The chosen stages as the IR's stage side table.
    pub fn stage_map(&self) -> StageMap {
        let mut map = StageMap::new(self.chosen.d as u32);
        for &(n, s) in &self.node_stage {
            map.set(n, s as u32);
        }
        map
    }

    /// The first node of each stage after the first, by name.
    pub fn cut_names(&self) -> Vec<String> {
        self.stages.iter().skip(1).map(|s| s.first_node.clone()).collect()
    }

    /// Attaches a plan read from a file to `g`: rebuilds the node order the plan was cut
    /// from and assigns every node its stage from the saved stage starts.
    pub fn attach(&mut self, g: &Graph) -> Result<(), PlanError> {
        let nodes = self.order.order(g).map_err(|n| PlanError::Cycle(g.node(n).name.clone()))?;
        let by_name: HashMap<&str, usize> = nodes.iter().enumerate().map(|(p, &x)| (g.node(x).name.as_str(), p)).collect();
        let mut cuts = Vec::with_capacity(self.stages.len().saturating_sub(1));
        for st in self.stages.iter().skip(1) {
            let &p = by_name
                .get(st.first_node.as_str())
                .ok_or_else(|| PlanError::PlanNodeMissing { stage: st.index, node: st.first_node.clone() })?;
            cuts.push(p);
        }
        if self.stages.len() != self.chosen.d || !valid_cuts(&cuts, nodes.len()) {
            return Err(PlanError::PlanCutsInvalid(format!("{} stages starting at positions {cuts:?} of {} nodes", self.stages.len(), nodes.len())));
        }
        let ranges = stage_ranges(&cuts, nodes.len());
        self.node_stage = ranges.iter().enumerate().flat_map(|(s, r)| nodes[r.clone()].iter().map(move |&x| (x, s))).collect();
        Ok(())
    }

    /// The candidates table (with [`COLUMNS_LEGEND`] under it) and the chosen partition,
    /// as text.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "planned for: {}, global batch {}", self.cluster.summary(), self.options.global_batch);
        let _ = writeln!(s, "node order: {} (stages are contiguous runs of it)", self.order);
        let _ = writeln!(
            s,
            "{:>3} {:>3} {:>3} {:>13} {:>5} {:>5} {:>9} {:>8} {:>12} {:>11}  {:<10} peak memory per stage",
            "#", "w", "d", "placement", "b", "m", "recompute", "schedule", "samples/s", "closed form", "bottleneck"
        );
        for (k, c) in self.candidates.iter().enumerate() {
            let mem: Vec<String> = c
                .peak_memory_per_stage
                .iter()
                .map(|&x| human_bytes(x))
                .collect();
            let _ = writeln!(
                s,
                "{:>3} {:>3} {:>3} {:>13} {:>5} {:>5} {:>9} {:>8} {:>12.1} {:>11.1}  {:<10} {}",
                k + 1,
                c.w,
                c.d,
                c.placement_text(),
                c.b,
                c.m,
                c.recompute.name(),
                c.schedule.name(),
                c.predicted_samples_per_s(),
                c.samples_per_s,
                format!("stage {}", c.bottleneck_stage),
                mem.join(" ")
            );
        }
        let _ = writeln!(s, "{}", COLUMNS_LEGEND);
        let c = &self.chosen;
        let _ = writeln!(
            s,
            "\nchosen: w={} d={} placement={} b={} m={} recompute={} schedule={} ({:.1} samples/s; closed form {:.1})",
            c.w,
            c.d,
            c.placement.name(),
            c.b,
            c.m,
            c.recompute.name(),
            c.schedule.name(),
            c.predicted_samples_per_s(),
            c.samples_per_s
        );
        for st in &self.stages {
            let _ = writeln!(
                s,
                "stage {}: {} nodes [{} .. {}], {} params, {:.3} GFLOP, act {}, {:.3} ms, memory {}, in {}, out {}",
                st.index,
                st.nodes,
                st.first_node,
                st.last_node,
                st.params,
                st.flops / 1e9,
                human_bytes(st.activation_bytes),
                st.time_s * 1e3,
                human_bytes(st.memory),
                boundary_text(&st.inputs),
                boundary_text(&st.outputs)
            );
        }
        // The rule is the same for every tied weight: said once, then a short line each
        // (a sentence per weight made a wall of text for models whose exporter merged
        // every LayerNorm's weights).
        if !self.shared_weights.is_empty() {
            let _ = writeln!(
                s,
                "tied weights read in several stages ({}): each of those stages holds a copy, and their gradients are summed across those stages before every update",
                self.shared_weights.len()
            );
            for w in &self.shared_weights {
                let _ = writeln!(s, "  {} in stages {:?}", w.name, w.stages);
            }
        }
        s
    }
}

fn boundary_text(list: &[(String, u64)]) -> String {
    if list.is_empty() {
        return "-".into();
    }
    let total: u64 = list.iter().map(|x| x.1).sum();
    let names: Vec<&str> = list.iter().take(3).map(|x| x.0.as_str()).collect();
    let more = if list.len() > 3 {
        format!(" +{}", list.len() - 3)
    } else {
        String::new()
    };
    format!("{} ({}{})", human_bytes(total), names.join(", "), more)
}

/// Cached cuts per partition key (`None`: no feasible split).
type CutsCache<K> = HashMap<K, Option<Vec<usize>>>;

struct SharedInfo {
    name: String,
    bytes: f64,
    numel: u64,
    owner: usize,
    positions: Vec<usize>,
}

/// Everything per position of the linear order, fixed for one planning run.
pub struct PlanContext<'a> {
    g: &'a Graph,
    cost: &'a CostModel,
    cluster: &'a Cluster,
    order: LinearOrder,
    n: usize,
    param_bytes: Vec<f64>,
    params: Vec<u64>,
    flops: Vec<Lin>,
    act: Vec<Lin>,
    /// Per position, [`crate::cost::NodeCost::awaiting_bytes`] and `keeps_graph`.
    awaiting: Vec<Lin>,
    keeps_graph: Vec<bool>,
    shared: Vec<SharedInfo>,
    /// Bytes a live fp32 byte at a cut puts on the link in the precision planned for.
    transfer_share: f64,
    problems: HashMap<(u64, Recompute, u64), PartitionProblem>,
    totals: HashMap<(u64, Recompute, u64), (f64, f64, f64)>,
}

impl<'a> PlanContext<'a> {
    /// The cost model it plans with.
    pub fn cost(&self) -> &'a CostModel {
        self.cost
    }

    /// Chooses the linear order and gathers per-position costs, for training in
    /// `precision` (the type activations cross the stage boundaries in).
    pub fn new(g: &'a Graph, cost: &'a CostModel, cluster: &'a Cluster, precision: Precision) -> Result<PlanContext<'a>, PlanError> {
        if g.node_count() == 0 {
            return Err(PlanError::EmptyGraph);
        }
        let reference_b = cost.export_batch.max(1) as u64;
        let order = choose_order(g, cost, reference_b)
            .map_err(|n| PlanError::Cycle(g.node(n).name.clone()))?;
        let n = order.nodes.len();
        let mut pos = vec![usize::MAX; g.node_ids().map(|x| x.index() + 1).max().unwrap_or(0)];
        for (p, &x) in order.nodes.iter().enumerate() {
            pos[x.index()] = p;
        }
        let costs: Vec<_> = order.nodes.iter().map(|&x| cost.node(x)).collect();
        let shared = cost
            .shared
            .iter()
            .filter_map(|s| {
                let positions: Vec<usize> = s
                    .consumers
                    .iter()
                    .filter_map(|c| pos.get(c.index()).copied())
                    .filter(|&p| p != usize::MAX)
                    .collect();
                let owner = *positions.first()?;
                let numel = s
                    .value
                    .and_then(|v| g.value(v).weight())
                    .map(|w| w.data.numel() as u64)
                    .unwrap_or(0);
                Some(SharedInfo {
                    name: s.name.clone(),
                    bytes: s.bytes as f64,
                    numel,
                    owner,
                    positions,
                })
            })
            .collect();
        Ok(PlanContext {
            g,
            cost,
            cluster,
            n,
            param_bytes: costs.iter().map(|c| c.param_bytes as f64).collect(),
            params: costs.iter().map(|c| c.params).collect(),
            flops: costs.iter().map(|c| c.fwd_flops + c.bwd_flops).collect(),
            act: costs.iter().map(|c| c.activation_bytes).collect(),
            awaiting: costs.iter().map(|c| c.awaiting_bytes).collect(),
            keeps_graph: costs.iter().map(|c| c.keeps_graph).collect(),
            order,
            shared,
            transfer_share: precision.activation_share(),
            problems: HashMap::new(),
            totals: HashMap::new(),
        })
    }

    pub fn order(&self) -> &LinearOrder {
        &self.order
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The partitioner's inputs at microbatch `b`: compute times 4/3 with full
    /// recomputation; with selective recomputation each recomputed node (all but the
    /// matmul/conv class, whose outputs stay stashed) adds its forward time once more.
    pub fn problem(&mut self, b: u64, recompute: Recompute, bandwidth: f64) -> &PartitionProblem {
        let key = (b, recompute, bandwidth.to_bits());
        let (cost, order, act, pb) = (self.cost, &self.order, &self.act, &self.param_bytes);
        let (awaiting, keeps_graph, transfer_share) = (&self.awaiting, &self.keeps_graph, self.transfer_share);
        self.problems.entry(key).or_insert_with(|| {
            let kept = |x: NodeId| matches!(cost.class(x), OpClass::MatMul | OpClass::Conv);
            PartitionProblem {
                time: order
                    .nodes
                    .iter()
                    .map(|&x| {
                        let (f, bw) = cost.time(x, b);
                        match recompute {
                            Recompute::None => f + bw,
                            Recompute::Full => (f + bw) * 4.0 / 3.0,
                            Recompute::Selective if kept(x) => f + bw,
                            Recompute::Selective => 2.0 * f + bw,
                        }
                    })
                    .collect(),
                param_bytes: pb.clone(),
                act_bytes: act.iter().map(|a| a.at(b).max(0.0)).collect(),
                kept_bytes: order
                    .nodes
                    .iter()
                    .zip(act)
                    .map(|(&x, a)| if kept(x) { a.at(b).max(0.0) } else { 0.0 })
                    .collect(),
                live_bytes: order.live.iter().map(|l| l.at(b).max(0.0)).collect(),
                bandwidth,
                transfer_share,
                awaiting_bytes: awaiting.iter().map(|w| w.at(b).max(0.0)).collect(),
                keeps_graph: keeps_graph.clone(),
            }
        })
    }

    /// The whole model's parameter, activation and kept-activation bytes at microbatch `b`
    /// (the sums of [`PlanContext::problem`]'s per-position numbers).
    fn totals(&mut self, b: u64, recompute: Recompute, bandwidth: f64) -> (f64, f64, f64) {
        let key = (b, recompute, bandwidth.to_bits());
        if let Some(t) = self.totals.get(&key) {
            return *t;
        }
        let prob = self.problem(b, recompute, bandwidth);
        let t = (prob.param_bytes.iter().sum(), prob.act_bytes.iter().sum(), prob.kept_bytes.iter().sum());
        self.totals.insert(key, t);
        t
    }

    /// Per-position weights for the greedy baselines.
    pub fn balance_weights(&self, balance: Balance, b: u64) -> Vec<f64> {
        match balance {
            Balance::Params => self.param_bytes.clone(),
            Balance::Flops => self.flops.iter().map(|f| f.at(b)).collect(),
            Balance::Profile | Balance::Optimal => self
                .order
                .nodes
                .iter()
                .map(|&x| {
                    let (f, bw) = self.cost.time(x, b);
                    f + bw
                })
                .collect(),
            Balance::Nodes => vec![1.0; self.n],
        }
    }

    /// What [`crate::simulate`] replays per stage of `cand`'s cuts at its microbatch:
    /// forward, backward and recomputed seconds (as [`PlanContext::problem`] counts them),
    /// the optimizer's seconds (reading weights, gradient and state and writing weights and
    /// state at the memory bandwidth), the bytes crossing the stage's last cut, the
    /// gradient bytes its replicas all-reduce, the tied-weight sync, and memory as a
    /// function of the microbatches in flight (linear in them, from the planner's model).
    pub fn stage_costs(&mut self, cand: &Candidate, opts: &PlanOptions) -> Vec<crate::simulate::StageCost> {
        let (d, b) = (cand.d, cand.b);
        let pbw = self.cluster.pipeline_bw(cand.layout());
        let (extra_bytes, _, sync) = self.shared_extra(&cand.cuts, pbw);
        let state = opts.optimizer.state_tensors(opts.momentum);
        // Memory as a line in the microbatches in flight, which the replay counts itself,
        // and apart from it the update's.
        let model = |k: f64| MemoryModel { update_factor: 0.0, ..MemoryModel::of_schedule(cand.schedule, cand.recompute, k, state, opts.precision, f64::INFINITY) };
        let (m1, m2) = (model(1.0), model(2.0));
        let update_factor = MemoryModel::of_schedule(cand.schedule, cand.recompute, 1.0, state, opts.precision, f64::INFINITY).update_factor;
        let prob = self.problem(b, cand.recompute, pbw);
        let ranges = stage_ranges(&cand.cuts, prob.len());
        let (_, mem1) = prob.evaluate(&cand.cuts, &PipelineMemory::uniform(m1));
        let (_, mem2) = prob.evaluate(&cand.cuts, &PipelineMemory::uniform(m2));
        let (_, mem1_awaiting) = prob.evaluate(&cand.cuts, &PipelineMemory::uniform(m1.with_awaiting(1.0, opts.precision)));
        let live: Vec<f64> = ranges.iter().map(|r| prob.live_bytes.get(r.end).copied().unwrap_or(0.0)).collect();
        let params: Vec<f64> = ranges.iter().map(|r| prob.param_bytes[r.clone()].iter().sum::<f64>()).collect();
        let (cost, order) = (self.cost, &self.order);
        let kept = |x: NodeId| matches!(cost.class(x), OpClass::MatMul | OpClass::Conv);
        let (opt, momentum) = (opts.optimizer, opts.momentum);
        // A profile's measured updates, and what a byte of weights costs by them (for the
        // tied copies a stage updates besides its own weights).
        let measured_update = |nodes: &[NodeId]| -> Option<f64> { nodes.iter().map(|&x| cost.update_time(x, opt, momentum)).sum() };
        let all_params: f64 = params.iter().sum();
        let per_byte = measured_update(&order.nodes).map(|t| if all_params > 0.0 { t / all_params } else { 0.0 });
        let boundary = cost.boundary_time(b);
        let after_backward = cost.after_backward_time(b);
        // Every microbatch of a step but the first adds its gradients into the
        // accumulators: per backward, (m - 1) / m of one accumulation on average.
        let accumulating = (cand.m.saturating_sub(1)) as f64 / cand.m.max(1) as f64;
        let accumulate_per_byte = cost.accumulate_time().map_or(0.0, |t| if all_params > 0.0 { accumulating * t / all_params } else { 0.0 });
        let mut out = Vec::with_capacity(d);
        for (s, r) in ranges.iter().enumerate() {
            let (mut fwd, mut bwd, mut re) = (0.0, 0.0, 0.0);
            let wgrad = self.weight_grad_time(r, b);
            for &x in &order.nodes[r.clone()] {
                let (f, bw) = cost.time(x, b);
                fwd += f;
                bwd += bw;
                re += match cand.recompute {
                    Recompute::None => 0.0,
                    Recompute::Full => (f + bw) / 3.0,
                    Recompute::Selective if kept(x) => 0.0,
                    Recompute::Selective => f,
                };
            }
            if s + 1 == d {
                let (lf, lb) = cost.loss_time(b);
                fwd += lf;
                bwd += lb;
            }
            let weights = params[s] + extra_bytes[s];
            let extra = m1.weight_factor * extra_bytes[s];
            // Half of each boundary's cost to either side of it.
            let sides = f64::from(u8::from(s > 0) + u8::from(s + 1 < d)) / 2.0;
            let [edge_fwd, edge_bwd, edge_step] = boundary.map(|t| sides * t);
            out.push(crate::simulate::StageCost {
                forward_s: fwd + edge_fwd,
                backward_s: bwd + edge_bwd + accumulate_per_byte * weights,
                // The accumulation follows the weight gradients.
                weight_grad_s: wgrad + accumulate_per_byte * weights,
                recompute_s: re,
                optimizer_s: match (measured_update(&order.nodes[r.clone()]), per_byte) {
                    (Some(t), Some(per_byte)) => t + extra_bytes[s] * per_byte,
                    _ => f64::from(3 + 2 * state) * weights / self.cluster.mem_bw,
                } + edge_step,
                send_s: 0.0,
                after_backward_s: after_backward,
                send_bytes: if s + 1 < d { live[s] * self.transfer_share } else { 0.0 },
                grad_bytes: weights,
                tied_sync_s: sync[s],
                memory_one: mem1[s] + extra,
                memory_per_extra: mem2[s] - mem1[s],
                memory_at_update: update_factor * weights,
                gradient_bytes: weights,
                memory_per_awaiting: mem1_awaiting[s] - mem1[s],
            });
        }
        out
    }

    /// Extra weight bytes per stage from tied weights read outside their owner's stage,
    /// and the tied-gradient all-reduce seconds per stage.
    /// Seconds of the weight gradients a split backward defers, for the nodes at
    /// positions `range` of the order at microbatch `b` ([`CostModel::weight_grad_time`]).
    fn weight_grad_time(&self, range: &std::ops::Range<usize>, b: u64) -> f64 {
        self.order.nodes[range.clone()].iter().map(|&x| self.cost.weight_grad_time(x, b)).sum()
    }

    fn shared_extra(&self, cuts: &[usize], pipeline_bw: f64) -> (Vec<f64>, Vec<u64>, Vec<f64>) {
        let d = cuts.len() + 1;
        let stage = |p: usize| cuts.partition_point(|&c| c <= p);
        let mut bytes = vec![0.0; d];
        let mut numel = vec![0u64; d];
        let mut sync = vec![0.0; d];
        for s in &self.shared {
            let mut stages: Vec<usize> = s.positions.iter().map(|&p| stage(p)).collect();
            stages.sort_unstable();
            stages.dedup();
            let owner = stage(s.owner);
            for &st in &stages {
                if st != owner {
                    bytes[st] += s.bytes;
                    numel[st] += s.numel;
                }
            }
            let k = stages.len() as f64;
            if stages.len() > 1 {
                for &st in &stages {
                    sync[st] += 2.0 * (k - 1.0) / k * s.bytes / pipeline_bw;
                }
            }
        }
        (bytes, numel, sync)
    }

    /// The sets of stages that sum a tied weight's gradient at every step, for the cut
    /// points `cuts` (one set per distinct group of stages, each sorted): they wait for
    /// each other there, as the runtime's step does.
    pub fn tied_stage_groups(&self, cuts: &[usize]) -> Vec<Vec<usize>> {
        let stage = |p: usize| cuts.partition_point(|&c| c <= p);
        let mut groups: Vec<Vec<usize>> = self
            .shared
            .iter()
            .map(|s| {
                let mut stages: Vec<usize> = s.positions.iter().map(|&p| stage(p)).collect();
                stages.sort_unstable();
                stages.dedup();
                stages
            })
            .filter(|g| g.len() > 1)
            .collect();
        groups.sort();
        groups.dedup();
        groups
    }
}

#[derive(Clone, Copy, Debug)]
struct Config {
    w: usize,
    d: usize,
    b: u64,
    m: u64,
    recompute: Recompute,
    schedule: Schedule,
    placement: Placement,
    optimistic: f64,
}

impl Config {
    fn layout(&self) -> Layout {
        worker_layout(self.schedule, self.d, self.w, self.placement)
    }

    /// The stages' memory models, each under its share of a worker's `limit`: all of it,
    /// or a `v`-th under interleaved 1F1B and ZB-V (a worker holds `v` stages; an even share, so
    /// that the cuts stay a partition problem per stage). Replicas under 2BW defer their
    /// updates and hold a second gradient ([`PipelineMemory::with_deferred_updates`]; a
    /// stage tied to an earlier one does too, which the cuts decide and this model does
    /// not see).
    fn memory_model(&self, opts: &PlanOptions, limit: f64) -> PipelineMemory {
        let state = opts.optimizer.state_tensors(opts.momentum);
        let share = limit / self.schedule.virtual_stages() as f64;
        let deferred = self.schedule.update_rule().defers_update(self.w, false);
        PipelineMemory::of_pipeline(self.schedule, self.recompute, self.d, self.m, state, opts.precision, share).with_deferred_updates(deferred)
    }
}

/// The workers of `w` pipelines of `d` stages under `schedule`: `d / v` per pipeline
/// under interleaved 1F1B and ZB-V, else `d`.
fn worker_layout(schedule: Schedule, d: usize, w: usize, placement: Placement) -> Layout {
    Layout::new(schedule.workers(d).unwrap_or(d), w).placed(placement)
}

/// Whether `schedule` runs `d` stages with `m` microbatches per batch (as the planner
/// weighs it: GPipe and ZB-V any `m`, 1F1B-like at least `d`, interleaved a multiple of
/// its workers).
fn runs_on(schedule: Schedule, d: usize, m: u64) -> bool {
    match schedule.workers(d) {
        Ok(_) if schedule == Schedule::ZbV => true,
        Ok(p) if schedule.virtual_stages() > 1 => m % p as u64 == 0,
        Ok(_) => schedule == Schedule::GPipe || m >= d as u64,
        Err(_) => false,
    }
}

/// Stage times per batch of interleaved 1F1B on `d` stages: `m v + d / v - 1`.
fn interleaved_slots(schedule: Schedule, d: usize, m: u64) -> f64 {
    let v = schedule.virtual_stages();
    (m as f64) * v as f64 + (d / v) as f64 - 1.0
}

/// Evaluates one configuration on given cuts; `None` when over memory.
fn assess(
    ctx: &mut PlanContext,
    cfg: &Config,
    cuts: &[usize],
    opts: &PlanOptions,
) -> Option<Candidate> {
    let cluster = ctx.cluster;
    let pbw = cluster.pipeline_bw(cfg.layout());
    let mem = cfg.memory_model(opts, cluster.memory_per_worker as f64);
    // Each stage's share of its worker's memory.
    let limit = mem.limit();
    let (extra_bytes, _, sync) = ctx.shared_extra(cuts, pbw);
    let prob = ctx.problem(cfg.b, cfg.recompute, pbw);
    let (times, mems) = prob.evaluate_with_extra(cuts, &mem, &extra_bytes);
    let ranges = stage_ranges(cuts, prob.len());
    // The same all-reduce the simulator replays, without latencies (the closed form has
    // none anywhere).
    let allreduce = cluster.allreduce(cfg.layout(), Latencies::NONE);
    let mut peak = Vec::with_capacity(cfg.d);
    let mut worst = (0.0f64, 0usize);
    let (mut max_time, mut max_ar, mut slowest) = (0.0f64, 0.0f64, 0usize);
    for s in 0..cfg.d {
        let memory = mems[s];
        if memory.is_nan() || memory > limit * (1.0 + 1e-12) {
            return None;
        }
        peak.push(memory.max(0.0).round() as u64);
        let grad: f64 = prob.param_bytes[ranges[s].clone()].iter().sum::<f64>() + extra_bytes[s];
        let ar = allreduce.seconds(grad, cfg.w) + sync[s];
        if times[s] > max_time {
            (max_time, slowest) = (times[s], s);
        }
        max_ar = max_ar.max(ar);
        let eff = times[s].max(ar / cfg.m as f64);
        if eff > worst.0 || s == 0 {
            worst = (eff, s);
        }
    }
    // 2BW all-reduces a batch's gradients while the next batch computes (its one-step
    // delay), so a stage's rate is the slower of the two. Flush and GPipe update after the
    // flush, with this batch's gradients: the all-reduce follows the pipeline's drain.
    // ZB-H1 is Flush less the weight gradients its drain runs without: with equal stages
    // a batch takes `(m + d - 1) T - (d - 1) W` (`simulate` tests), here with the slowest
    // stage's `T` and `W`; the replay times the split stage by stage.
    let flush = (cfg.m + cfg.d as u64 - 1) as f64 * max_time + max_ar;
    let per_batch = match cfg.schedule {
        Schedule::TwoBw => cfg.m as f64 * worst.0,
        Schedule::Flush | Schedule::GPipe => flush,
        // ZB-H2 with `m >= 2d - 1` (its warm-up complete): the weight gradients fill the
        // drain and only the first forward's way down the pipeline is left, `(d - 1) F`
        // (`simulate` tests), with a forward a third of a stage's time; with fewer
        // microbatches, ZB-H1's.
        Schedule::ZbH2 if cfg.m + 1 >= 2 * cfg.d as u64 => cfg.m as f64 * max_time + (cfg.d as f64 - 1.0) * max_time / 3.0 + max_ar,
        Schedule::ZbH1 | Schedule::ZbH2 => flush - (cfg.d as f64 - 1.0) * ctx.weight_grad_time(&ranges[slowest], cfg.b),
        // Interleaved: `d / v` workers of `v` stages each; a worker's microbatch takes
        // `v T` and the drain `(d / v - 1) T` (Narayanan et al., 2021: the bubble shrinks v
        // times), so a batch takes `(m v + d / v - 1) T`.
        Schedule::Interleaved2 | Schedule::Interleaved4 => interleaved_slots(cfg.schedule, cfg.d, cfg.m) * max_time + max_ar,
        // ZB-V: interleaved's slots on its two stages per worker, less the weight
        // gradients its drain runs without (as ZB-H1's).
        Schedule::ZbV => interleaved_slots(cfg.schedule, cfg.d, cfg.m) * max_time - (cfg.d as f64 / 2.0 - 1.0) * ctx.weight_grad_time(&ranges[slowest], cfg.b) + max_ar,
    };
    let samples = (cfg.b * cfg.m * cfg.w as u64) as f64;
    let samples_per_s = if per_batch > 0.0 {
        samples / per_batch
    } else {
        f64::INFINITY
    };
    Some(Candidate {
        w: cfg.w,
        d: cfg.d,
        b: cfg.b,
        m: cfg.m,
        recompute: cfg.recompute,
        schedule: cfg.schedule,
        placement: cfg.placement,
        samples_per_s,
        replayed_samples_per_s: None,
        peak_memory_per_stage: peak,
        bottleneck_stage: worst.1,
        cuts: cuts.to_vec(),
    })
}

/// The exact partitions solved so far: unconstrained per `(d, b, recompute, pipeline
/// bandwidth)`, and under the memory limit per `(d, b, recompute, schedule, m for GPipe,
/// pipeline bandwidth)` (only solved when the unconstrained one does not fit). The
/// bandwidth (its bits) is part of the key because it depends on `w` as well as `d` under
/// stage-major placement ([`Cluster::pipeline_bw`]) and the cuts' cost depends on it.
#[derive(Default)]
struct Caches {
    free: CutsCache<(usize, u64, Recompute, u64, Option<Schedule>)>,
    bound: CutsCache<(usize, u64, Recompute, Schedule, u64, u64)>,
}

impl Caches {
    fn free_key(cfg: &Config, cluster: &Cluster) -> (usize, u64, Recompute, u64, Option<Schedule>) {
        // Schedules with one stage per worker share their cuts; the others balance their
        // workers, each by its own placement.
        let placed = (cfg.schedule.virtual_stages() > 1).then_some(cfg.schedule);
        (cfg.d, cfg.b, cfg.recompute, cluster.pipeline_bw(cfg.layout()).to_bits(), placed)
    }

    fn bound_key(cfg: &Config, cluster: &Cluster) -> (usize, u64, Recompute, Schedule, u64, u64) {
        let m = if cfg.schedule == Schedule::GPipe { cfg.m } else { 0 };
        (cfg.d, cfg.b, cfg.recompute, cfg.schedule, m, cluster.pipeline_bw(cfg.layout()).to_bits())
    }

    /// Solves, in parallel, the partitions `configs` will ask for: first the unconstrained
    /// ones, then the memory-bound ones of configurations whose unconstrained partition
    /// does not fit.
    fn solve_ahead(&mut self, ctx: &mut PlanContext, configs: &[Config], opts: &PlanOptions) {
        let limit = ctx.cluster.memory_per_worker as f64;
        let cluster = ctx.cluster;
        let mut jobs = Vec::new();
        for cfg in configs {
            let key = Self::free_key(cfg, cluster);
            if !self.free.contains_key(&key) && !jobs.iter().any(|j: &(Config, PipelineMemory)| Self::free_key(&j.0, cluster) == key) {
                jobs.push((*cfg, PipelineMemory::unlimited()));
            }
        }
        for (cfg, cuts) in solve_all(ctx, jobs) {
            self.free.insert(Self::free_key(&cfg, cluster), cuts);
        }
        let mut jobs = Vec::new();
        for cfg in configs {
            let key = Self::bound_key(cfg, cluster);
            if self.bound.contains_key(&key) || jobs.iter().any(|j: &(Config, PipelineMemory)| Self::bound_key(&j.0, cluster) == key) {
                continue;
            }
            let fits = self.free.get(&Self::free_key(cfg, cluster)).cloned().flatten().and_then(|c| assess(ctx, cfg, &c, opts)).is_some();
            if !fits {
                jobs.push((*cfg, cfg.memory_model(opts, limit)));
            }
        }
        for (cfg, cuts) in solve_all(ctx, jobs) {
            self.bound.insert(Self::bound_key(&cfg, cluster), cuts);
        }
    }

    /// The best candidate for `cfg`: its unconstrained partition when that fits, else its
    /// partition under the memory limit.
    fn best(&mut self, ctx: &mut PlanContext, cfg: &Config, opts: &PlanOptions) -> Option<Candidate> {
        let cluster = ctx.cluster;
        let pbw = cluster.pipeline_bw(cfg.layout());
        let free = self
            .free
            .entry(Self::free_key(cfg, cluster))
            .or_insert_with(|| cuts_for(ctx.problem(cfg.b, cfg.recompute, pbw), cfg, &PipelineMemory::unlimited()))
            .clone();
        if let Some(c) = free.and_then(|c| assess(ctx, cfg, &c, opts)) {
            return Some(c);
        }
        let mem = cfg.memory_model(opts, ctx.cluster.memory_per_worker as f64);
        self.bound
            .entry(Self::bound_key(cfg, cluster))
            .or_insert_with(|| cuts_for(ctx.problem(cfg.b, cfg.recompute, pbw), cfg, &mem))
            .clone()
            .and_then(|c| assess(ctx, cfg, &c, opts))
    }
}

/// The cuts of `cfg` under `mem`: the partitioner's optimum (the slowest stage as fast as
/// can be) and, where a worker runs several stages, then its workers balanced
/// ([`PartitionProblem::balance_workers`]): a worker's rate is its stages' sum.
fn cuts_for(prob: &PartitionProblem, cfg: &Config, mem: &PipelineMemory) -> Option<Vec<usize>> {
    let cuts = prob.optimal_partition(cfg.d, mem)?.cuts;
    if cfg.schedule.virtual_stages() == 1 {
        return Some(cuts);
    }
    Some(prob.balance_workers(&cuts, &cfg.schedule.placement(cfg.d), mem))
}

/// The cuts of each `(configuration, memory model)` job ([`cuts_for`]), solved in parallel.
fn solve_all(ctx: &mut PlanContext, jobs: Vec<(Config, PipelineMemory)>) -> Vec<(Config, Option<Vec<usize>>)> {
    let keys: Vec<(u64, Recompute, u64)> = jobs
        .iter()
        .map(|(cfg, _)| {
            let bw = ctx.cluster.pipeline_bw(cfg.layout());
            ctx.problem(cfg.b, cfg.recompute, bw);
            (cfg.b, cfg.recompute, bw.to_bits())
        })
        .collect();
    let problems = &ctx.problems;
    jobs.into_par_iter()
        .zip(keys)
        .map(|((cfg, mem), key)| {
            let cuts = problems.get(&key).and_then(|p| cuts_for(p, &cfg, &mem));
            (cfg, cuts)
        })
        .collect()
}

fn explicit_cuts(ctx: &PlanContext, names: &[String]) -> Result<Vec<usize>, PlanError> {
    let by_name: HashMap<&str, usize> = ctx
        .order
        .nodes
        .iter()
        .enumerate()
        .map(|(p, &x)| (ctx.g.node(x).name.as_str(), p))
        .collect();
    let mut cuts = Vec::with_capacity(names.len());
    for name in names {
        let &p = by_name
            .get(name.as_str())
            .ok_or_else(|| PlanError::UnknownCutNode(name.clone()))?;
        if p == 0 || cuts.contains(&p) {
            return Err(PlanError::BadCut(name.clone()));
        }
        cuts.push(p);
    }
    cuts.sort_unstable();
    Ok(cuts)
}

/// Plans `g` on `cluster`: see the module docs. The candidates are replayed with the
/// assumed link latencies ([`Latencies::ASSUMED`]), as `simulate` replays a plan file.
pub fn plan(
    g: &Graph,
    cost: &CostModel,
    cluster: &Cluster,
    opts: &PlanOptions,
) -> Result<Plan, PlanError> {
    plan_on(g, cost, cluster, Latencies::ASSUMED, None, opts)
}

/// [`plan`] with the candidates replayed over links of the given latencies and, when the
/// stages are threads sharing `host_cores` CPU cores ([`SimSetup::host`]), on those:
/// `simulate`'s cluster's, so that its replay of the chosen configuration is the plan's
/// prediction.
///
/// Interleaved 1F1B's configurations have `d` stages on `d / v` workers per pipeline
/// (a search's depths are workers); each stage is held to a `v`-th of its worker's
/// memory ([`Config::memory_model`]).
pub fn plan_on(
    g: &Graph,
    cost: &CostModel,
    cluster: &Cluster,
    latencies: Latencies,
    host_cores: Option<usize>,
    opts: &PlanOptions,
) -> Result<Plan, PlanError> {
    if opts.global_batch == 0 {
        return Err(PlanError::Options("global_batch must be positive".into()));
    }
    if opts.schedules.is_empty() {
        return Err(PlanError::Options("no schedule to search".into()));
    }
    if cluster.workers == 0 {
        return Err(PlanError::Options("the cluster has no workers".into()));
    }
    let mut ctx = PlanContext::new(g, cost, cluster, opts.precision)?;
    let n = ctx.n;
    let fixed_cuts = match &opts.cuts {
        Some(names) => Some(explicit_cuts(&ctx, names)?),
        None => None,
    };
    let fixed_depth = fixed_cuts.is_some() || opts.stages.is_some();
    let only_interleaved = opts.schedules.iter().all(|s| s.virtual_stages() > 1);
    let depths: Vec<usize> = match (&fixed_cuts, opts.stages) {
        (Some(c), Some(s)) if c.len() + 1 != s => {
            return Err(PlanError::StagesMismatch {
                stages: s,
                from_cuts: c.len() + 1,
            })
        }
        (Some(c), _) => vec![c.len() + 1],
        (None, Some(0)) => return Err(PlanError::Options("stages must be at least 1".into())),
        (None, Some(s)) if s > n => {
            return Err(PlanError::Options(format!(
                "{s} stages but the graph has {n} nodes"
            )))
        }
        (None, Some(s)) => vec![s],
        (None, None) => (1..=cluster.workers.min(n)).collect(),
    };
    match opts.width {
        Some(0) => return Err(PlanError::Options("width must be at least 1".into())),
        Some(w) if opts.global_batch % w as u64 != 0 => {
            return Err(PlanError::Options(format!("a width of {w} replicas does not divide the global batch {}", opts.global_batch)))
        }
        _ => {}
    }
    if opts.recompute == Some(Recompute::Selective) && opts.schedules.iter().all(|s| s.splits_backward()) {
        return Err(PlanError::Options(format!("the {} schedule splits each backward in two, which selective recomputation does not: choose --recompute none or full", spellings(&opts.schedules))));
    }
    let recomputes: Vec<Recompute> = match opts.recompute {
        Some(r) => vec![r],
        None => vec![Recompute::None, Recompute::Selective, Recompute::Full],
    };
    let mut configs = Vec::new();
    // Per microbatch size: the nodes' summed and largest forward + backward time.
    let mut totals: HashMap<u64, (f64, f64)> = HashMap::new();
    // Per microbatch size: the interior cuts' live bytes, smallest first, summed (entry `k`
    // is the least `k` distinct cuts can carry).
    let mut cheapest_cuts: HashMap<u64, Vec<f64>> = HashMap::new();
    let param_total: f64 = ctx.param_bytes.iter().sum();
    for &d in &depths {
        // The workers one pipeline takes under `schedule`: a search's `d` is workers; a
        // given stage count takes `d / v` under interleaved 1F1B and ZB-V.
        let pipeline_workers = |schedule: Schedule| if fixed_depth { schedule.workers(d).unwrap_or(d) } else { d };
        let least = opts.schedules.iter().map(|&s| pipeline_workers(s)).min().unwrap_or(d);
        if least > cluster.workers {
            return Err(PlanError::Options(format!(
                "{d} stages need {least} workers but the cluster has {}",
                cluster.workers
            )));
        }
        for w in 1..=cluster.workers / least {
            if opts.global_batch % w as u64 != 0 || opts.width.is_some_and(|x| x != w) {
                continue;
            }
            // Each worker count's placements (they differ where its links do).
            let mut tried: Vec<Placement> = Vec::new();
            for &schedule in &opts.schedules {
                let p = pipeline_workers(schedule);
                if w * p <= cluster.workers {
                    tried.extend(placements(cluster, Layout::new(p, w), opts.placement));
                }
            }
            tried.sort_unstable();
            tried.dedup();
            for placement in tried {
            let per_replica = opts.global_batch / w as u64;
            let mut b = 1u64;
            while b <= per_replica && per_replica % b == 0 {
                if opts.microbatch.map_or(true, |x| x == b) {
                    let m = per_replica / b;
                    let (total, largest) = *totals.entry(b).or_insert_with(|| {
                        ctx.order.nodes.iter().fold((0.0, 0.0), |(sum, most): (f64, f64), &x| {
                            let (f, bw) = cost.time(x, b);
                            (sum + f + bw, most.max(f + bw))
                        })
                    });
                    for &recompute in &recomputes {
                        for &schedule in &opts.schedules {
                            // A search's `d` is workers, which hold `v` stages each under
                            // interleaved 1F1B; a given stage count is the stages.
                            let stages = if fixed_depth { d } else { d * schedule.virtual_stages() };
                            if stages > n || w * pipeline_workers(schedule) > cluster.workers || !runs_on(schedule, stages, m) {
                                continue;
                            }
                            // One worker has no pipeline to interleave: its stages differ
                            // from one Flush stage only in all-reducing each stage's
                            // gradients after its own backward, an overlap no other
                            // schedule is credited with. Weighed only for a stage count
                            // given with no other schedule (`compile --stages 2 --schedule
                            // interleaved-2`).
                            if schedule.virtual_stages() > 1 && stages == schedule.virtual_stages() && !(fixed_depth && only_interleaved) {
                                continue;
                            }
                            // The split backward runs on whole graphs, not selective pieces.
                            if schedule.splits_backward() && recompute == Recompute::Selective {
                                continue;
                            }
                            // Selective adds at most a third; 1 keeps the bound optimistic.
                            let slowdown = if recompute == Recompute::Full { 4.0 / 3.0 } else { 1.0 };
                            // The stages' times add up to the compute plus each interior
                            // cut's communication twice (it ends one stage and starts the
                            // next): at least that of the `d - 1` cheapest distinct cuts.
                            // The slowest stage takes at least their mean, and at least
                            // the largest node (a deep pipeline's mean can fall below one
                            // node, such as a transformer's LM head).
                            let cut_sums = cheapest_cuts.entry(b).or_insert_with(|| {
                                let mut live: Vec<f64> = ctx.order.live.get(1..n).unwrap_or(&[]).iter().map(|l| l.at(b).max(0.0)).collect();
                                live.sort_by(f64::total_cmp);
                                std::iter::once(0.0).chain(live.iter().scan(0.0, |sum, x| {
                                    *sum += x;
                                    Some(*sum)
                                }))
                                .collect()
                            });
                            let least_cut_bytes = cut_sums.get(stages - 1).copied().unwrap_or(0.0);
                            let layout = worker_layout(schedule, stages, w, placement);
                            let comm_lb = 2.0 * 2.0 * least_cut_bytes * ctx.transfer_share / cluster.pipeline_bw(layout);
                            let t_lb = ((total * slowdown + comm_lb) / stages as f64).max(largest * slowdown);
                            // Some stage holds at least a d-th of the parameters, and its
                            // all-reduce takes at least that share's time (as in `assess`).
                            let ar_lb = cluster.allreduce(layout, Latencies::NONE).seconds(param_total / stages as f64, w);
                            let per_batch = match schedule {
                                Schedule::TwoBw => (m as f64 * t_lb).max(ar_lb),
                                Schedule::Flush | Schedule::GPipe => (m + stages as u64 - 1) as f64 * t_lb + ar_lb,
                                // Its closed form takes at most the slowest stage's `W` off
                                // each of the drain's `d - 1` slots, and a `W` (half of
                                // some products' backward) is at most half a stage's time.
                                Schedule::ZbH1 => (m as f64 + (stages as f64 - 1.0) / 2.0) * t_lb + ar_lb,
                                // Bounded by no bubble at all.
                                Schedule::ZbH2 => m as f64 * t_lb + ar_lb,
                                Schedule::Interleaved2 | Schedule::Interleaved4 => interleaved_slots(schedule, stages, m) * t_lb + ar_lb,
                                // Bounded by no bubble at all: each worker's `2m` stage
                                // times.
                                Schedule::ZbV => 2.0 * m as f64 * t_lb + ar_lb,
                            };
                            let optimistic = if per_batch > 0.0 {
                                (b * m * w as u64) as f64 / per_batch
                            } else {
                                f64::INFINITY
                            };
                            configs.push(Config {
                                w,
                                d: stages,
                                b,
                                m,
                                recompute,
                                schedule,
                                placement,
                                optimistic,
                            });
                        }
                    }
                }
                b *= 2;
            }
            }
        }
    }
    if configs.is_empty() {
        return Err(PlanError::NoFeasible(format!(
            "no (w, d, b, m) satisfies w*d <= {} workers{}, b a power of two dividing {}/w{}, and m >= d for 2BW/Flush",
            cluster.workers,
            opts.width.map_or(String::new(), |w| format!(" with w = {w}")),
            opts.global_batch,
            opts.microbatch.map_or(String::new(), |b| format!(" (b = {b})")),
        )));
    }
    configs.sort_by(|a, b| b.optimistic.total_cmp(&a.optimistic));
    // Whether each configuration may fit at all ([`may_fit`]), asked when the search
    // reaches it: most are never reached (GPT 3.8B on 64 workers: about 600 of 10,000),
    // and for the zero-bubble and interleaved schedules the question walks their orders.
    let mut may: Vec<Option<bool>> = vec![None; configs.len()];
    let mut fits = |ctx: &mut PlanContext, k: usize| *may[k].get_or_insert_with(|| may_fit(ctx, &configs[k], opts));
    let top = opts.top.max(1);
    // The best by the closed form, the plan's `top` or REPLAYED of them if more: these are
    // replayed, and the plan lists the `top` by the replay.
    let keep = top.max(REPLAYED);
    // The closed form charges every cut one bandwidth and so ranks the two placements
    // apart poorly (deep replica-major pipelines above the stage-major ones that replay
    // faster): each placement's own best are kept for the replay.
    let searched: BTreeSet<Placement> = configs.iter().map(|c| c.placement).collect();
    let mut found: BTreeMap<Placement, Vec<Candidate>> = BTreeMap::new();
    // A configuration whose bound is below its placement's full list can enter it no more
    // (the lists' last rates only rise).
    let excluded = |found: &BTreeMap<Placement, Vec<Candidate>>, p: Placement, optimistic: f64| found.get(&p).is_some_and(|l| l.len() >= keep && optimistic < l[keep - 1].samples_per_s);
    let mut caches = Caches::default();
    let optimal = fixed_cuts.is_none() && opts.balance == Balance::Optimal;
    // The exact partitions of the next configurations are solved in parallel ahead of the
    // sequential search, which then finds them cached: the same result as solving them one
    // by one, and some speculative work when the search stops inside a chunk.
    let chunk = 4 * rayon::current_num_threads().max(1);
    let mut solved_upto = 0;
    for (i, cfg) in configs.iter().enumerate() {
        if searched.iter().all(|&p| excluded(&found, p, cfg.optimistic)) {
            break;
        }
        if excluded(&found, cfg.placement, cfg.optimistic) || !fits(&mut ctx, i) {
            continue;
        }
        if optimal && i >= solved_upto {
            // The next `chunk` configurations not already excluded.
            let ahead: Vec<usize> = (i..configs.len()).filter(|&k| !excluded(&found, configs[k].placement, configs[k].optimistic) && fits(&mut ctx, k)).take(chunk).collect();
            solved_upto = ahead.last().map_or(configs.len(), |&k| k + 1);
            let ahead: Vec<Config> = ahead.into_iter().map(|k| configs[k]).collect();
            caches.solve_ahead(&mut ctx, &ahead, opts);
        }
        let candidate = if let Some(c) = &fixed_cuts {
            assess(&mut ctx, cfg, c, opts)
        } else if !optimal {
            let cuts = if opts.balance == Balance::Nodes {
                uniform_by_nodes(n, cfg.d)
            } else {
                balanced_by(&ctx.balance_weights(opts.balance, cfg.b), cfg.d)
            };
            assess(&mut ctx, cfg, &cuts, opts)
        } else {
            caches.best(&mut ctx, cfg, opts)
        };
        if let Some(c) = candidate {
            // The early stop is exact only if no configuration beats its optimistic rate.
            debug_assert!(c.samples_per_s <= cfg.optimistic * (1.0 + 1e-9), "{cfg:?} reaches {} samples/s, above its bound", c.samples_per_s);
            insert_ranked(found.entry(c.placement).or_default(), c, keep, |x| x.samples_per_s);
        }
    }
    let found: Vec<Candidate> = found.into_values().flatten().collect();
    if found.is_empty() {
        return Err(PlanError::NoFeasible(format!(
            "every configuration needs more than {} per worker",
            human_bytes(cluster.memory_per_worker)
        )));
    }
    // Replay them (in parallel: each replay is independent), choose by the replayed rate,
    // and list the `top` by it.
    let mut pool = found;
    let setups: Vec<SimSetup> = pool.iter().map(|c| replay_setup(&mut ctx, c, opts, latencies, host_cores)).collect();
    let rates: Vec<Result<f64, SimError>> = setups.into_par_iter().map(|setup| simulate(&setup).map(|sim| sim.samples_per_s)).collect();
    for (c, rate) in pool.iter_mut().zip(rates) {
        let rate = rate.map_err(|error| PlanError::Replay { w: c.w, d: c.d, b: c.b, schedule: c.schedule, error })?;
        c.replayed_samples_per_s = Some(rate);
    }
    let mut ranked: Vec<Candidate> = Vec::with_capacity(top);
    for c in pool {
        insert_ranked(&mut ranked, c, top, Candidate::predicted_samples_per_s);
    }
    let chosen = ranked[0].clone();
    Ok(describe(&mut ctx, ranked, chosen, opts))
}

/// Whether `cfg` may fit in its workers' memory: any split into `d` stages has a stage
/// holding at least a `d`-th of the whole model's memory by the least of the stages'
/// models (the stage-input terms only add), so one over the limit by that measure never
/// fits and is dropped before its partition is solved. At paper scale most are (GPT 3.8B
/// on 64 workers: the shallow ones), and each would cost two exact partitions to find out.
fn may_fit(ctx: &mut PlanContext, cfg: &Config, opts: &PlanOptions) -> bool {
    let cluster = ctx.cluster;
    let mem = cfg.memory_model(opts, cluster.memory_per_worker as f64).least();
    let (p, a, k) = ctx.totals(cfg.b, cfg.recompute, cluster.pipeline_bw(cfg.layout()));
    (mem.weight_factor * p + mem.act_factor * a + mem.kept_factor * k) / cfg.d as f64 <= mem.limit * (1.0 + 1e-9)
}

/// The placements worth searching for `w x d` (stage-major numbering in `layout`): the
/// one asked for, else stage-major and, when it puts different links under the boundaries
/// or the gradient sums, replica-major (on one server, or with one replica or one stage,
/// the two are the same).
fn placements(cluster: &Cluster, layout: Layout, asked: Option<Placement>) -> Vec<Placement> {
    if let Some(p) = asked {
        return vec![p];
    }
    let other = layout.placed(Placement::ReplicaMajor);
    let differs = cluster.pipeline_links(layout, Latencies::NONE) != cluster.pipeline_links(other, Latencies::NONE)
        || cluster.allreduce(layout, Latencies::NONE) != cluster.allreduce(other, Latencies::NONE);
    if differs { vec![Placement::StageMajor, Placement::ReplicaMajor] } else { vec![Placement::StageMajor] }
}

/// Inserts `c` into `list` (best first by `rate`, ties to the smaller peak memory, then to
/// the earlier), keeping at most `cap`.
fn insert_ranked(list: &mut Vec<Candidate>, c: Candidate, cap: usize, rate: fn(&Candidate) -> f64) {
    let at = list.partition_point(|x| {
        rate(x) > rate(&c) || (rate(x) == rate(&c) && x.peak_memory_per_stage.iter().max() <= c.peak_memory_per_stage.iter().max())
    });
    if at < cap {
        list.insert(at, c);
        list.truncate(cap);
    }
}

/// What replaying `cand` for [`REPLAY_BATCHES`] batches on the planner's cluster means: the
/// stage costs [`PlanContext::stage_costs`] gives, each boundary on its own link, the
/// all-reduce of [`Cluster::allreduce`], the stages tied by shared weights meeting at each
/// step, as `simulate` replays it.
fn replay_setup(ctx: &mut PlanContext, cand: &Candidate, opts: &PlanOptions, latencies: Latencies, host_cores: Option<usize>) -> SimSetup {
    let cluster = ctx.cluster;
    SimSetup {
        scheme: cand.schedule.into(),
        w: cand.w,
        b: cand.b,
        m: cand.m,
        batches: REPLAY_BATCHES,
        stages: ctx.stage_costs(cand, opts),
        links: cand.stage_links(cluster, latencies),
        allreduce: cluster.allreduce(cand.layout(), latencies),
        record: false,
        host: host_cores.map(|c| ctx.cost.host_cores(c, cand.b)),
        tied_groups: ctx.tied_stage_groups(&cand.cuts),
        // The planner ranks by mean times: a spread raises near-balanced plans' bubbles,
        // but its draws would make the ranking move from one search to the next.
        spread: None,
    }
}

fn describe(ctx: &mut PlanContext, candidates: Vec<Candidate>, chosen: Candidate, opts: &PlanOptions) -> Plan {
    let n = ctx.n;
    let g = ctx.g;
    let cuts = chosen.cuts.clone();
    let ranges = stage_ranges(&cuts, n);
    let pbw = ctx.cluster.pipeline_bw(chosen.layout());
    let (_, extra_numel, _) = ctx.shared_extra(&cuts, pbw);
    let mem = PipelineMemory::of_pipeline(chosen.schedule, chosen.recompute, chosen.d, chosen.m, opts.optimizer.state_tensors(opts.momentum), opts.precision, f64::INFINITY);
    let (times, _) = ctx
        .problem(chosen.b, chosen.recompute, pbw)
        .evaluate(&cuts, &mem);
    let b = chosen.b;
    let export = ctx.cost.export_batch;
    // Live values per cut: (first cut, last cut) of each non-weight value.
    let mut pos = vec![usize::MAX; g.node_ids().map(|x| x.index() + 1).max().unwrap_or(0)];
    for (p, &x) in ctx.order.nodes.iter().enumerate() {
        pos[x.index()] = p;
    }
    let mut last: Vec<Option<usize>> = vec![None; g.value_count()];
    for (p, &x) in ctx.order.nodes.iter().enumerate() {
        for v in g.node(x).inputs.iter().flatten() {
            let l = &mut last[v.index()];
            *l = Some(l.map_or(p, |q| q.max(p)));
        }
    }
    for v in g.outputs() {
        last[v.index()] = Some(n);
    }
    let mut spans: Vec<(usize, usize, String, u64)> = Vec::new();
    for v in g.value_ids() {
        let Some(q) = last[v.index()] else { continue };
        let val = g.value(v);
        let first = match val.def {
            pipewright_ir::ValueDef::Input => 0,
            pipewright_ir::ValueDef::Node { node, .. } => match pos.get(node.index()) {
                Some(&p) if p != usize::MAX => p + 1,
                _ => continue,
            },
            pipewright_ir::ValueDef::Weight(_) => continue,
        };
        if first <= q {
            // What crosses a boundary: float activations in the compute type.
            let share = if val.ty.dtype.is_float() { ctx.transfer_share } else { 1.0 };
            spans.push((first, q, val.name.clone(), (value_bytes(val, export).at(b).max(0.0) * share) as u64));
        }
    }
    // The values live at each stage boundary, in one pass over the spans (a filter over
    // every span per boundary took seconds at thousands of stages).
    let mut bounds: Vec<usize> = ranges.iter().flat_map(|r| [r.start, r.end]).collect();
    bounds.sort_unstable();
    bounds.dedup();
    let mut live: Vec<Vec<(String, u64)>> = vec![Vec::new(); bounds.len()];
    for (first, last, name, bytes) in &spans {
        let (lo, hi) = (bounds.partition_point(|&c| c < *first), bounds.partition_point(|&c| c <= *last));
        for at in &mut live[lo..hi] {
            at.push((name.clone(), *bytes));
        }
    }
    let live_at = |c: usize| -> Vec<(String, u64)> { bounds.binary_search(&c).map(|i| live[i].clone()).unwrap_or_default() };
    let mut stages = Vec::with_capacity(ranges.len());
    for (s, r) in ranges.iter().enumerate() {
        let name = |p: usize| g.node(ctx.order.nodes[p]).name.clone();
        stages.push(StagePlan {
            index: s,
            first_node: name(r.start),
            last_node: name(r.end - 1),
            nodes: r.len(),
            params: ctx.params[r.clone()].iter().sum::<u64>() + extra_numel[s],
            flops: ctx.flops[r.clone()].iter().map(|f| f.at(b)).sum(),
            activation_bytes: ctx.act[r.clone()]
                .iter()
                .map(|a| a.at(b))
                .sum::<f64>()
                .max(0.0) as u64,
            time_s: times[s],
            memory: chosen.peak_memory_per_stage[s],
            inputs: live_at(r.start),
            outputs: live_at(r.end),
        });
    }
    let stage_of = |p: usize| cuts.partition_point(|&c| c <= p);
    let mut shared_weights = Vec::new();
    for sh in &ctx.shared {
        let mut st: Vec<usize> = sh.positions.iter().map(|&p| stage_of(p)).collect();
        st.sort_unstable();
        st.dedup();
        if st.len() > 1 {
            shared_weights.push(SharedWeight {
                name: sh.name.clone(),
                decision: format!(
                    "tied weight read in stages {st:?}: each of those stages holds a copy (counted in its memory) and their \
                     gradients are summed by an all-reduce among those stages before every update, so the copies stay \
                     identical without moving activations across the pipeline to a single owner"
                ),
                stages: st,
            });
        }
    }
    let mut node_stage = Vec::with_capacity(n);
    for (s, r) in ranges.iter().enumerate() {
        node_stage.extend(ctx.order.nodes[r.clone()].iter().map(|&x| (x, s)));
    }
    debug_assert!(valid_cuts(&cuts, n) || cuts.is_empty());
    Plan {
        cluster: ctx.cluster.clone(),
        options: opts.clone(),
        order: ctx.order.kind,
        candidates,
        chosen,
        stages,
        shared_weights,
        node_stage,
    }
}

/// What the columns of [`Plan::text`]'s table mean, printed under it.
pub const COLUMNS_LEGEND: &str = "\
columns: w = replicas (data-parallel copies of the pipeline), d = pipeline depth (stages),
  placement = how the w x d workers are numbered (stage-major: a stage's replicas on
  consecutive workers; replica-major: a pipeline's stages; - with one replica or one
  stage), b = microbatch size,
  m = microbatches per step and replica (w x b x m = the global batch; w x d workers,
  w x d / v under interleaved-v and zb-v (v = 2), whose workers run v stages each);
  samples/s = the prediction on the cluster above, not a measurement: an
  event-by-event replay of the configuration (as `pipewright simulate` runs it) from the
  cost model, which ranks the rows; closed form = the planner's formula, which prunes the
  search; bottleneck = the stage that limits the pipeline's rate by the closed form";
