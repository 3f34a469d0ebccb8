//! The stage partitioner: splits a linear (topological) order of `n` nodes into `d`
//! contiguous stages minimising the bottleneck stage time under a per-stage memory limit.
//!
//! # Model
//! Position `i` has time `t_i`, parameter bytes `p_i` and activation bytes `a_i`; cut `c`
//! (`0..=n`, the boundary before position `c`) has `live(c)`, the bytes of values produced
//! before `c` and consumed at or after `c` (graph inputs count at cut 0, graph outputs at
//! cut `n`), so a skip connection counts at every cut it crosses.
//!
//! Stage `[i, j)` takes `T(i,j) = sum(t_i..t_j) + comm(i) + comm(j)` with
//! `comm(c) = 2 * live(c) / bandwidth` (forward activation plus backward gradient) and
//! `comm(0) = comm(n) = 0`. Its memory is
//! `M(i,j) = weight_factor * P(i,j) + act_factor * A(i,j) + input_factor * live(i)`
//! ([`MemoryModel`]): with recomputation `act_factor = 1` (one microbatch's activations
//! rebuilt at a time) and `input_factor` = microbatches in flight (their stage inputs);
//! without it `act_factor` = microbatches in flight and `input_factor = 0`. The factors
//! are the stage's own ([`PipelineMemory`]): under 1F1B stage `k` of `d` holds `d - k`
//! microbatches in flight, under GPipe every stage holds all `m`. A stage whose order
//! holds fewer microbatches once its batch's weight gradients exist (GPipe's `m - 1`, the
//! first stages of a flushing 1F1B at `m = d`) has a second computing phase: its weights
//! without the gradient and the larger count; its memory is the larger of the phases.
//!
//! # Algorithm ([`PartitionProblem::optimal_partition`])
//! Bisection on the bottleneck `B` over the bit patterns of positive `f64`s (so it ends on
//! the smallest representable feasible `B`, at most 64 steps) with a reachability DP per
//! step: with prefix sums `S`, position `j` is reachable with `k` stages iff some `i < j`
//! reachable with `k-1` stages has `S(i) - comm(i) >= S(j) + comm(j) - B` and
//! `M_k(i,j) <= limit` (stage `k`'s model). Writing `M_k(i,j) = G_k(j) - H_k(i)` with `G_k` non-decreasing, an `i` that
//! fails the memory test for `j` fails it for every later `j`; so each layer keeps the
//! candidate `i`s in a max-heap on `S(i) - comm(i)` and drops failed tops lazily:
//! `O(d * n log n)` per step, `O(d * n)` when the memory limit cannot bind (a running
//! maximum). Each layer only visits the positions where its stage can end at all under
//! `B` (every stage costs at least its compute and the cheapest cut's communication, so
//! the first `k` stages and the last `d - k` bound `S(j)` from both sides), and the
//! bisection starts from the bottleneck of the split balanced by compute, so near the
//! optimum the layers are narrow. The search stops when the interval is narrower than
//! 1e-9 of the bound, so the result is the optimum to within that relative margin (the
//! tests compare it with [`PartitionProblem::brute_force_partition`]).
//!
//! # Linear order ([`choose_order`])
//! The partition is contiguous in one topological order. Two are compared: the IR's
//! [`Graph::topo_order`] (ties by node id) and a depth-first order (Kahn's algorithm with
//! a LIFO ready list, which finishes a branch before starting the next). The order whose
//! largest live bytes over its cuts is smaller is kept (ties: the IR's order), because
//! live bytes are what cuts cost in communication and what recomputation stashes.

// `map_or(true, ..)` instead of `is_none_or`: the workspace's MSRV is 1.80.
#![allow(clippy::unnecessary_map_or)]

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::ops::Range;

use petgraph::visit::{EdgeRef, IntoEdgeReferences};
use petgraph::Direction;
use pipewright_core::schedule::{holdings_in_flight, Holding};
use pipewright_core::{Precision, Recompute, Schedule};
use pipewright_ir::{Graph, NodeId, ValueDef};
use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, Lin};

mod workers;

/// Memory of a stage `[i, j)`: `weight_factor * P + act_factor * A + kept_factor * K +
/// input_factor * live(i) + awaiting_factor * W` while it computes (`K`: the activations
/// selective recomputation keeps; `W`: what a microbatch between its input and weight
/// gradients keeps, [`PartitionProblem::awaiting_bytes`], plus `A` where the stage keeps its
/// graph for them, [`PartitionProblem::keeps_graph`]), and `update_factor * P` while its
/// update makes the new weight version; the larger must stay `<= limit`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MemoryModel {
    /// Copies of each weight byte: versions + gradient buffer + optimizer state.
    pub weight_factor: f64,
    pub act_factor: f64,
    pub kept_factor: f64,
    pub input_factor: f64,
    /// Copies of each weight byte while the update writes the new version beside the one
    /// it reads (the runtime never changes a version in place), with the gradient and the
    /// optimizer state: what a flushing schedule's stage peaks at when its weights outweigh
    /// its activations, which it has all released by then. 0: no such phase.
    pub update_factor: f64,
    /// Microbatches held between their input and weight gradients on a stage that splits
    /// its backward (in the compute type's share of fp32 bytes, as the other activation
    /// factors).
    pub awaiting_factor: f64,
    pub limit: f64,
}

impl MemoryModel {
    /// No memory limit.
    pub fn unlimited() -> MemoryModel {
        MemoryModel {
            weight_factor: 1.0,
            act_factor: 1.0,
            kept_factor: 0.0,
            input_factor: 0.0,
            update_factor: 0.0,
            awaiting_factor: 0.0,
            limit: f64::INFINITY,
        }
    }

    /// The planner's memory model of a stage holding `in_flight` microbatches under
    /// `schedule`: the copies of each weight byte (its versions, the gradient,
    /// `state_tensors` of optimizer state, the mixed-precision casts) and the factors of
    /// its activations in `precision`, against `limit`. The planner, the simulator's stage
    /// costs and the tensor-parallel baseline count memory by it.
    pub fn of_schedule(schedule: Schedule, recompute: Recompute, in_flight: f64, state_tensors: u32, precision: Precision, limit: f64) -> MemoryModel {
        // Master weights (each version), the fp32 gradient and the optimizer state keep the
        // model's type whatever the precision. Mixed precision adds the weights cast to the
        // compute type, one copy per version (the runtime shares it among the microbatches
        // using that version), and computes every activation in the compute type.
        let ratio = precision.activation_share();
        let cast_copies = if precision.is_mixed() { f64::from(schedule.weight_versions()) } else { 0.0 };
        let weight_factor = f64::from(schedule.weight_versions() + 1 + state_tensors) + ratio * cast_copies;
        // The update reads one version and writes the next: two at that moment under every
        // schedule (2BW has freed the older of its two by then), with 2BW's in-flight
        // activations counted by the model itself.
        let update_factor = f64::from(2 + 1 + state_tensors) + ratio * cast_copies;
        let model = MemoryModel::in_flight(recompute, in_flight, weight_factor, limit);
        MemoryModel {
            update_factor,
            act_factor: model.act_factor * ratio,
            kept_factor: model.kept_factor * ratio,
            input_factor: model.input_factor * ratio,
            ..model
        }
    }

    /// This model with `awaiting` microbatches between their input and weight gradients
    /// besides, in `precision`'s compute type.
    pub fn with_awaiting(self, awaiting: f64, precision: Precision) -> MemoryModel {
        MemoryModel { awaiting_factor: awaiting * precision.activation_share(), ..self }
    }

    /// The fp32 memory model of `recompute` with `in_flight` microbatches (no update phase).
    fn in_flight(recompute: Recompute, in_flight: f64, weight_factor: f64, limit: f64) -> MemoryModel {
        match recompute {
            Recompute::Full => MemoryModel {
                weight_factor,
                act_factor: 1.0,
                kept_factor: 0.0,
                input_factor: in_flight,
                update_factor: 0.0,
                awaiting_factor: 0.0,
                limit,
            },
            // Every in-flight microbatch keeps its stage inputs and matmul/conv outputs; the
            // one being back-propagated also has its recomputed activations.
            Recompute::Selective => MemoryModel {
                weight_factor,
                act_factor: 1.0,
                kept_factor: in_flight - 1.0,
                input_factor: in_flight,
                update_factor: 0.0,
                awaiting_factor: 0.0,
                limit,
            },
            Recompute::None => MemoryModel {
                weight_factor,
                act_factor: in_flight,
                kept_factor: 0.0,
                input_factor: 0.0,
                update_factor: 0.0,
                awaiting_factor: 0.0,
                limit,
            },
        }
    }
}

/// The memory model of every stage of a pipeline: stage `k`'s [`MemoryModel`]s, by what
/// its schedule's order has it hold ([`holdings_in_flight`]); one model for every stage
/// alike when built [`PipelineMemory::uniform`]. All stages share one limit.
///
/// A stage's gradients exist from its batch's first weight gradient to its update (the
/// runtime frees them at each update), and some orders hold their most microbatches before
/// that: PipeDream-Flush's stage 0 at `m = d` holds `d` microbatches before its first
/// backward and `d - 1` after it. A stage that splits its backward holds two kinds of
/// microbatch, whole ones and ones awaiting their weight gradient, in a mix that changes
/// along its order. A stage's model counts what it holds at its peak with the gradient,
/// and `others` what it holds at each other moment that may weigh more (without the
/// gradient there: its weight factor one less, no update phase); the stage holds the
/// largest.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelineMemory {
    stages: Vec<MemoryModel>,
    /// Per stage (as `stages`), its other phases; empty: none anywhere.
    others: Vec<Vec<MemoryModel>>,
}

impl PipelineMemory {
    /// Every stage by `model`.
    pub fn uniform(model: MemoryModel) -> PipelineMemory {
        PipelineMemory { stages: vec![model], others: Vec::new() }
    }

    /// Stage `k` by `models[k]` (at least one; all with the first one's limit).
    pub fn per_stage(models: Vec<MemoryModel>) -> PipelineMemory {
        PipelineMemory::phased(models.into_iter().map(|m| (m, Vec::new())).collect())
    }

    /// Stage `k` by `models[k]`: its model with the gradient and its other phases (at
    /// least one stage; all with the first one's limit).
    fn phased(models: Vec<(MemoryModel, Vec<MemoryModel>)>) -> PipelineMemory {
        assert!(!models.is_empty(), "a pipeline has a stage");
        let limit = models[0].0.limit;
        let mut phases: Vec<(MemoryModel, Vec<MemoryModel>)> = models.into_iter().map(|(m, o)| (MemoryModel { limit, ..m }, o.into_iter().map(|o| MemoryModel { limit, ..o }).collect())).collect();
        // Stages alike (GPipe's) keep one model: one prefix to compute, not d.
        if phases.iter().all(|p| *p == phases[0]) {
            phases.truncate(1);
        }
        let (stages, mut others): (Vec<MemoryModel>, Vec<Vec<MemoryModel>>) = phases.into_iter().unzip();
        if others.iter().all(Vec::is_empty) {
            others.clear();
        }
        PipelineMemory { stages, others }
    }

    /// Each stage of a `d`-stage pipeline under `schedule` with `m` microbatches per batch,
    /// holding what the schedule's own operation order has it hold ([`holdings_in_flight`]:
    /// GPipe all `m` in every stage, 1F1B `d - k` in stage `k`, the zero-bubble schedules'
    /// stages some of them awaiting their weight gradients).
    pub fn of_pipeline(schedule: Schedule, recompute: Recompute, d: usize, m: u64, state_tensors: u32, precision: Precision, limit: f64) -> PipelineMemory {
        let holdings = holdings_in_flight(schedule, d, m as usize);
        let model = |h: &Holding| MemoryModel::of_schedule(schedule, recompute, h.whole as f64, state_tensors, precision, limit).with_awaiting(h.awaiting as f64, precision);
        let models = (0..d.max(1))
            .map(|k| {
                let fallback = [Holding { whole: (d - k).min(m as usize).max(1), awaiting: 0, gradient: true }];
                stage_phases(holdings.get(k).and_then(Option::as_deref).unwrap_or(&fallback), model)
            })
            .collect();
        PipelineMemory::phased(models)
    }

    /// The same with one gradient more in every stage and phase when `deferred`: a stage
    /// whose update waits for its replicas' sum (2BW with replicas,
    /// [`UpdateRule::defers_update`](pipewright_core::UpdateRule::defers_update)) applies
    /// it only before the first forward that needs the new version, so the next batch's
    /// gradients grow beside the ones still to apply. The simulator's replay counts this
    /// where it happens (with the microbatches held then); the planner counts it at the
    /// stage's peak, which is never less.
    pub fn with_deferred_updates(mut self, deferred: bool) -> PipelineMemory {
        if deferred {
            let add = |m: &mut MemoryModel| {
                m.weight_factor += 1.0;
                if m.update_factor > 0.0 {
                    m.update_factor += 1.0;
                }
            };
            self.stages.iter_mut().for_each(add);
            self.others.iter_mut().flatten().for_each(add);
        }
        self
    }

    /// No memory limit, every stage alike.
    pub fn unlimited() -> PipelineMemory {
        PipelineMemory::uniform(MemoryModel::unlimited())
    }

    /// Stage `k`'s model (the last one's past the end: a uniform model's for every `k`).
    pub fn stage(&self, k: usize) -> &MemoryModel {
        &self.stages[k.min(self.stages.len() - 1)]
    }

    /// The models, one per distinct stage.
    fn models(&self) -> &[MemoryModel] {
        &self.stages
    }

    /// Stage `k`'s other phases (indexed as [`PipelineMemory::stage`]).
    pub fn others(&self, k: usize) -> &[MemoryModel] {
        if self.others.is_empty() {
            return &[];
        }
        &self.others[k.min(self.others.len() - 1)]
    }

    pub fn limit(&self) -> f64 {
        self.stages[0].limit
    }

    /// A model no stage's exceeds, factor by factor: what every stage holds at least.
    pub fn least(&self) -> MemoryModel {
        let min = |f: fn(&MemoryModel) -> f64| self.stages.iter().map(f).fold(f64::INFINITY, f64::min);
        MemoryModel { weight_factor: min(|m| m.weight_factor), act_factor: min(|m| m.act_factor), kept_factor: min(|m| m.kept_factor), input_factor: min(|m| m.input_factor), update_factor: min(|m| m.update_factor), awaiting_factor: min(|m| m.awaiting_factor), limit: self.limit() }
    }
}

/// A stage's model and other phases from what it holds (`held`, [`Holding`]s none covers):
/// the model at the holding with the gradient that holds the most microbatches (at least
/// one: the backward that makes the gradient frees its microbatch's activations as it
/// goes, not all at its end), with the update's phase; the others without it.
fn stage_phases(held: &[Holding], model: impl Fn(&Holding) -> MemoryModel) -> (MemoryModel, Vec<MemoryModel>) {
    let main = held.iter().filter(|h| h.gradient).max_by_key(|h| (h.total(), h.whole)).copied();
    let peak = match main {
        Some(h) if h.total() > 0 => h,
        _ => Holding { whole: 1, awaiting: 0, gradient: true },
    };
    let others = held
        .iter()
        .filter(|h| Some(**h) != main)
        .map(|h| {
            let m = model(h);
            let weight_factor = if h.gradient { m.weight_factor } else { m.weight_factor - 1.0 };
            MemoryModel { weight_factor, update_factor: 0.0, ..m }
        })
        .collect();
    (model(&peak), others)
}

/// The numeric inputs of the partitioner.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PartitionProblem {
    /// `t_i`, seconds (forward + backward) per position.
    pub time: Vec<f64>,
    /// `p_i`, parameter bytes per position.
    pub param_bytes: Vec<f64>,
    /// `a_i`, activation bytes per position.
    pub act_bytes: Vec<f64>,
    /// `k_i`, the part of `a_i` selective recomputation keeps (matmul/conv outputs);
    /// empty = none.
    pub kept_bytes: Vec<f64>,
    /// `live(c)` for `c` in `0..=n`.
    pub live_bytes: Vec<f64>,
    /// `w_i`, what a microbatch keeps for position `i`'s weight gradient between its
    /// input and weight gradients under a schedule that splits the backward
    /// ([`crate::cost::NodeCost::awaiting_bytes`]); empty = none.
    pub awaiting_bytes: Vec<f64>,
    /// Whether position `i`'s weight gradient needs the forward's graph: a stage with one
    /// keeps its whole graph for its weight gradients, `A` more per awaiting microbatch;
    /// empty = none.
    pub keeps_graph: Vec<bool>,
    /// Bytes/s between consecutive stages.
    pub bandwidth: f64,
    /// Bytes a cut's live byte puts on that link: activations cross in the compute type
    /// ([`pipewright_core::Precision::activation_share`]; 1 in fp32).
    pub transfer_share: f64,
}

/// A partition into stages: `cuts` are the first positions of stages `1..d` (increasing).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Partition {
    pub cuts: Vec<usize>,
    /// The largest stage time `T(i,j)`.
    pub bottleneck: f64,
}

impl Partition {
    /// The stages as position ranges of an order of `n` nodes.
    pub fn stages(&self, n: usize) -> Vec<Range<usize>> {
        stage_ranges(&self.cuts, n)
    }

    /// The stage of every node of `order` (the order the partition was made on).
    pub fn stage_of_nodes(&self, order: &[NodeId]) -> Vec<(NodeId, usize)> {
        let mut out = Vec::with_capacity(order.len());
        for (s, r) in self.stages(order.len()).into_iter().enumerate() {
            out.extend(order[r].iter().map(|&n| (n, s)));
        }
        out
    }
}

/// Stage ranges from cut positions.
pub fn stage_ranges(cuts: &[usize], n: usize) -> Vec<Range<usize>> {
    let mut bounds = Vec::with_capacity(cuts.len() + 2);
    bounds.push(0);
    bounds.extend_from_slice(cuts);
    bounds.push(n);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

#[derive(Clone, Copy, PartialEq)]
struct Cand {
    x: f64,
    i: u32,
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        self.x.total_cmp(&o.x).then(o.i.cmp(&self.i))
    }
}

/// How far, relative to the limit, a stage's memory may exceed it (rounding).
const MEMORY_SLACK: f64 = 1e-9;

/// How close to the optimum bottleneck the search goes, relative to it.
const RELATIVE_PRECISION: f64 = 1e-9;

/// The reachable positions of one feasibility test, kept between tests so that their
/// memory is allocated once.
#[derive(Default)]
struct Reach {
    entries: Vec<(u32, u32)>,
    starts: Vec<usize>,
}

/// Prefix sums of the per-node inputs: `S` (time), `P` (parameter bytes), `A`
/// (activation bytes), `K` (kept bytes), `W` (awaiting bytes), and the count of positions
/// that keep the graph.
struct Sums {
    s: Vec<f64>,
    p: Vec<f64>,
    a: Vec<f64>,
    k: Vec<f64>,
    w: Vec<f64>,
    graph: Vec<u32>,
}

impl Sums {
    /// `G(j) = wf * P(j) + ka * A(j) + kk * K(j) + kw * W(j)` of model `m`.
    fn held(&self, m: &MemoryModel, j: usize) -> f64 {
        m.weight_factor * self.p[j] + m.act_factor * self.a[j] + m.kept_factor * self.k[j] + m.awaiting_factor * self.w[j]
    }

    fn graph_kept(&self, i: usize, j: usize) -> f64 {
        graph_kept(&self.a, &self.graph, i, j)
    }

    /// `H(i) = G(i) - kin * live(i)`: a stage `[i, j)` holds `G(j) - H(i)`.
    fn start_credit(&self, m: &MemoryModel, i: usize, live: f64) -> f64 {
        self.held(m, i) - m.input_factor * live
    }
}

/// Prefix sums shared by every feasibility test.
struct Prefix {
    s: Vec<f64>,
    /// `P(j)`, the parameter bytes before `j`.
    p: Vec<f64>,
    /// Per model `k` of the [`PipelineMemory`]: its `weight_factor` and `update_factor`.
    weight: Vec<f64>,
    update: Vec<f64>,
    /// `G_k(j) = wf * P(j) + ka * A(j) + kk * K(j) + kw * W(j)`.
    g: Vec<Vec<f64>>,
    /// `H_k(i) = G_k(i) - kin * live(i)`.
    h: Vec<Vec<f64>>,
    /// Per model `k`, its `awaiting_factor`.
    awaiting: Vec<f64>,
    /// Per model `k`, `G`, `H` and the `awaiting_factor` of each of its other phases
    /// ([`PipelineMemory::others`]).
    others: Vec<Vec<(Vec<f64>, Vec<f64>, f64)>>,
    /// `A(j)` and the positions before `j` that keep the graph, for [`graph_kept`].
    a: Vec<f64>,
    graph: Vec<u32>,
    comm: Vec<f64>,
    /// The smallest `comm(c)` of an interior cut (0 when there is none or it is infinite).
    min_comm: f64,
    /// `max over i <= p of S(i) - comm(i)`: the best start of a stage among positions up to p.
    best_start: Vec<f64>,
    /// `min over j >= p of S(j) + comm(j)`: the cheapest end of a stage among positions from p.
    cheapest_end: Vec<f64>,
}

impl Prefix {
    /// Whether `M_k(i, j) <= limit`: `M_k` is the largest of stage `[i, j)`'s memory in each
    /// of its phases while it computes and while it updates, by model `k`, non-decreasing
    /// in `j` for a fixed `i`. Stops at the first phase over the limit.
    fn fits(&self, k: usize, i: usize, j: usize, limit: f64) -> bool {
        let graph = self.graph_kept(i, j);
        held_between(self.g[k][j] + self.awaiting[k] * graph, self.h[k][i], self.p[j] - self.p[i], 0.0, self.weight[k], self.update[k]) <= limit
            && self.others.get(k).into_iter().flatten().all(|(g, h, aw)| g[j] - h[i] + aw * graph <= limit)
    }

    fn graph_kept(&self, i: usize, j: usize) -> f64 {
        graph_kept(&self.a, &self.graph, i, j)
    }

    /// Every computing phase's `G`, `H` and `awaiting_factor`, of every model.
    fn computing_phases(&self) -> impl Iterator<Item = (&Vec<f64>, &Vec<f64>, f64)> {
        self.g.iter().zip(&self.h).zip(&self.awaiting).map(|((g, h), aw)| (g, h, *aw)).chain(self.others.iter().flatten().map(|(g, h, aw)| (g, h, *aw)))
    }

    /// `T(i, j)`: the stage's compute and the communication at both its cuts.
    fn stage_time(&self, i: usize, j: usize) -> f64 {
        self.s[j] - self.s[i] + self.comm[i] + self.comm[j]
    }
}

/// What each microbatch awaiting its weight gradients holds besides `W` in stage `[i,
/// j)`, from the prefix sums `a` (`A`) and `graph` (positions that keep the graph): its
/// whole graph `A` where a position there keeps it.
fn graph_kept(a: &[f64], graph: &[u32], i: usize, j: usize) -> f64 {
    if graph[j] > graph[i] {
        a[j] - a[i]
    } else {
        0.0
    }
}

/// What a stage `[i, j)` holds (given `G(j)`, `H(i)` and its own parameter bytes) with
/// `extra` weight bytes besides, weighted `weight_factor` while it computes and
/// `update_factor` while it updates: the larger of the two phases.
fn held_between(g_end: f64, h_start: f64, params: f64, extra: f64, weight_factor: f64, update_factor: f64) -> f64 {
    (g_end - h_start + weight_factor * extra).max(update_factor * (params + extra))
}

impl PartitionProblem {
    pub fn len(&self) -> usize {
        self.time.len()
    }

    pub fn is_empty(&self) -> bool {
        self.time.is_empty()
    }

    /// `comm(c) = 2 * live(c) * transfer_share / bandwidth`, zero at both ends.
    pub fn comm(&self, c: usize) -> f64 {
        let n = self.len();
        if c == 0 || c >= n || self.bandwidth <= 0.0 {
            if c == 0 || c >= n {
                return 0.0;
            }
            return f64::INFINITY;
        }
        2.0 * self.live_bytes.get(c).copied().unwrap_or(0.0) * self.transfer_share / self.bandwidth
    }

    /// The prefix sums of time, parameter, activation and kept bytes.
    fn sums(&self) -> Sums {
        let n = self.len();
        let mut sums = Sums { s: vec![0.0; n + 1], p: vec![0.0; n + 1], a: vec![0.0; n + 1], k: vec![0.0; n + 1], w: vec![0.0; n + 1], graph: vec![0; n + 1] };
        for i in 0..n {
            sums.s[i + 1] = sums.s[i] + self.time[i];
            sums.p[i + 1] = sums.p[i] + self.param_bytes.get(i).copied().unwrap_or(0.0);
            sums.a[i + 1] = sums.a[i] + self.act_bytes.get(i).copied().unwrap_or(0.0);
            sums.k[i + 1] = sums.k[i] + self.kept_bytes.get(i).copied().unwrap_or(0.0);
            sums.w[i + 1] = sums.w[i] + self.awaiting_bytes.get(i).copied().unwrap_or(0.0);
            sums.graph[i + 1] = sums.graph[i] + u32::from(self.keeps_graph.get(i).copied().unwrap_or(false));
        }
        sums
    }

    /// The live bytes at cut `c` (0 past the end).
    fn live(&self, c: usize) -> f64 {
        self.live_bytes.get(c).copied().unwrap_or(0.0)
    }

    fn prefix(&self, mem: &PipelineMemory) -> Prefix {
        let n = self.len();
        let sums = self.sums();
        let g_of = |m: &MemoryModel| -> Vec<f64> { (0..=n).map(|j| sums.held(m, j)).collect() };
        let h_of = |m: &MemoryModel| -> Vec<f64> { (0..=n).map(|i| sums.start_credit(m, i, self.live(i))).collect() };
        let g = mem.models().iter().map(g_of).collect();
        let h = mem.models().iter().map(h_of).collect();
        let others = (0..mem.models().len()).map(|k| mem.others(k).iter().map(|m| (g_of(m), h_of(m), m.awaiting_factor)).collect()).collect();
        let awaiting = mem.models().iter().map(|m| m.awaiting_factor).collect();
        let Sums { s, p, a, graph, .. } = sums;
        let weight = mem.models().iter().map(|m| m.weight_factor).collect();
        let update = mem.models().iter().map(|m| m.update_factor).collect();
        let comm: Vec<f64> = (0..=n).map(|c| self.comm(c)).collect();
        let interior = comm.get(1..n).unwrap_or(&[]);
        let min_comm = interior.iter().copied().fold(f64::INFINITY, f64::min);
        let min_comm = if min_comm.is_finite() { min_comm } else { 0.0 };
        let best_start = (0..=n)
            .scan(f64::NEG_INFINITY, |best, i| {
                *best = f64::max(*best, s[i] - comm[i]);
                Some(*best)
            })
            .collect();
        let mut cheapest_end: Vec<f64> = (0..=n).map(|j| s[j] + comm[j]).collect();
        for j in (0..n).rev() {
            cheapest_end[j] = cheapest_end[j].min(cheapest_end[j + 1]);
        }
        Prefix { s, p, weight, update, g, h, awaiting, others, a, graph, comm, min_comm, best_start, cheapest_end }
    }

    /// `T(i,j)`, from prefix sums (as the DP computes it).
    pub fn stage_time(&self, i: usize, j: usize) -> f64 {
        self.evaluate_ranges(std::slice::from_ref(&(i..j)), &PipelineMemory::unlimited())
            .0[0]
    }

    /// `M(i,j)`, from prefix sums (as the DP computes it).
    pub fn stage_memory(&self, i: usize, j: usize, mem: &MemoryModel) -> f64 {
        self.evaluate_ranges(std::slice::from_ref(&(i..j)), &PipelineMemory::uniform(*mem)).1[0]
    }

    fn evaluate_ranges(&self, ranges: &[Range<usize>], mem: &PipelineMemory) -> (Vec<f64>, Vec<f64>) {
        self.evaluate_ranges_with(ranges, mem, &[])
    }

    /// Times and memories of `ranges`, stage `k` holding `extra[k]` weight bytes besides
    /// its own (none past the end of `extra`).
    fn evaluate_ranges_with(&self, ranges: &[Range<usize>], mem: &PipelineMemory, extra: &[f64]) -> (Vec<f64>, Vec<f64>) {
        // The same sums and expressions as the DP's prefix, for these ranges only (the
        // planner evaluates every configuration it weighs; a full prefix holds one array
        // per stage model).
        let sums = self.sums();
        let t = ranges.iter().map(|r| sums.s[r.end] - sums.s[r.start] + self.comm(r.start) + self.comm(r.end)).collect();
        let m = ranges
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let extra = extra.get(k).copied().unwrap_or(0.0);
                let graph = sums.graph_kept(r.start, r.end);
                let held = |m: &MemoryModel, update_factor: f64| {
                    held_between(sums.held(m, r.end) + m.awaiting_factor * graph, sums.start_credit(m, r.start, self.live(r.start)), sums.p[r.end] - sums.p[r.start], extra, m.weight_factor, update_factor)
                };
                let model = mem.stage(k);
                let phases = held(model, model.update_factor);
                mem.others(k).iter().fold(phases, |most, o| most.max(held(o, 0.0)))
            })
            .collect();
        (t, m)
    }

    /// Times and memories of the stages given by `cuts`.
    pub fn evaluate(&self, cuts: &[usize], mem: &PipelineMemory) -> (Vec<f64>, Vec<f64>) {
        self.evaluate_ranges(&stage_ranges(cuts, self.len()), mem)
    }

    /// [`PartitionProblem::evaluate`] with stage `k` also holding `extra[k]` weight bytes
    /// (copies of tied weights another stage owns), in every phase its weights count in.
    pub fn evaluate_with_extra(&self, cuts: &[usize], mem: &PipelineMemory, extra: &[f64]) -> (Vec<f64>, Vec<f64>) {
        self.evaluate_ranges_with(&stage_ranges(cuts, self.len()), mem, extra)
    }

    /// The bottleneck of `cuts`, or `None` if a stage breaks the memory limit (with a
    /// relative slack of 1e-9 for rounding) or the cuts are not a valid split.
    pub fn bottleneck_of(&self, cuts: &[usize], mem: &PipelineMemory) -> Option<f64> {
        if !valid_cuts(cuts, self.len()) {
            return None;
        }
        let (t, m) = self.evaluate(cuts, mem);
        if m.iter().any(|&x| x > mem.limit() * (1.0 + MEMORY_SLACK)) {
            return None;
        }
        Some(t.into_iter().fold(0.0, f64::max))
    }

    /// One feasibility test: is there a split into `d` stages with every `T <= bound` and
    /// every `M <= limit`? Returns the cuts when there is.
    fn feasible(
        &self,
        pre: &Prefix,
        d: usize,
        bound: f64,
        limit: f64,
        memory_binds: bool,
        reach: &mut Reach,
    ) -> Option<Vec<usize>> {
        let n = self.len();
        // Layer k (positions reach.starts[k]..reach.starts[k + 1] of reach.entries): every
        // (end j, start i of the last stage) reachable with k stages, by increasing j.
        // Layer 0 is position 0. The buffers are reused from test to test.
        reach.entries.clear();
        reach.entries.push((0, 0));
        reach.starts.clear();
        reach.starts.extend([0, 1]);
        let mut heap: BinaryHeap<Cand> = BinaryHeap::new();
        let (latest, earliest) = greedy_reach(pre, d, bound)?;
        for k in 1..=d {
            let (mut next, prev_end) = (reach.starts[k - 1], reach.starts[k]);
            // Stage k - 1 (from 0) by its own memory model.
            let at = (k - 1).min(pre.g.len() - 1);
            heap.clear();
            let mut best: Option<Cand> = None;
            let window = stage_end_window(pre, d, k, bound);
            for j in window.start.max(earliest[d - k])..window.end.min(latest[k] + 1) {
                // Every position reachable with k - 1 stages before j may start stage k.
                while next < prev_end && (reach.entries[next].0 as usize) < j {
                    let i = reach.entries[next].0 as usize;
                    let c = Cand { x: pre.s[i] - pre.comm[i], i: i as u32 };
                    if memory_binds {
                        heap.push(c);
                    } else if best.map_or(true, |b| c > b) {
                        best = Some(c);
                    }
                    next += 1;
                }
                let need = pre.s[j] + pre.comm[j] - bound;
                let top = if memory_binds {
                    while let Some(t) = heap.peek() {
                        if !pre.fits(at, t.i as usize, j, limit) {
                            heap.pop();
                        } else {
                            break;
                        }
                    }
                    heap.peek().copied()
                } else {
                    best
                };
                if let Some(t) = top.filter(|t| t.x >= need) {
                    reach.entries.push((j as u32, t.i));
                }
            }
            if reach.entries.len() == prev_end {
                return None;
            }
            reach.starts.push(reach.entries.len());
        }
        if reach.entries.last().map(|&(j, _)| j as usize) != Some(n) {
            return None;
        }
        let mut cuts = Vec::with_capacity(d.saturating_sub(1));
        let mut j = n as u32;
        for k in (1..=d).rev() {
            let layer = &reach.entries[reach.starts[k]..reach.starts[k + 1]];
            let at = layer.binary_search_by_key(&j, |&(end, _)| end).ok()?;
            let i = layer[at].1;
            if k > 1 {
                cuts.push(i as usize);
            }
            j = i;
        }
        cuts.reverse();
        Some(cuts)
    }

    /// The partition into exactly `d` non-empty stages minimising the bottleneck under the
    /// memory limit, or `None` when `d` is 0, exceeds `n`, or no split fits in memory.
    pub fn optimal_partition(&self, d: usize, mem: &PipelineMemory) -> Option<Partition> {
        let n = self.len();
        if d == 0 || d > n || self.time.iter().any(|t| !t.is_finite() || *t < 0.0) {
            return None;
        }
        let pre = self.prefix(mem);
        let mut reach = Reach::default();
        // Can the memory test fail for any i < j, in any stage's model, at all?
        let limit = mem.limit();
        let memory_binds = limit.is_finite()
            && (pre.update.iter().any(|u| u * pre.p[n] > limit) || pre.computing_phases().any(|(g, h, aw)| {
                // Every stage's graph counted kept: an upper bound.
                let mut min_h = f64::INFINITY;
                let mut worst = f64::NEG_INFINITY;
                for j in 1..=n {
                    min_h = min_h.min(h[j - 1] + aw * pre.a[j - 1]);
                    worst = worst.max(g[j] + aw * pre.a[j] - min_h);
                }
                worst > limit
            }));
        let max_comm = pre.comm.iter().copied().fold(0.0, f64::max);
        let hi = pre.s[n] + 2.0 * max_comm;
        if !hi.is_finite() {
            return None;
        }
        // A split balanced by compute time is usually close to the optimum: the bisection
        // starts from its bottleneck, which keeps every test's windows narrow (a test at a
        // loose bound reaches nearly every position in every layer).
        let balanced = balanced_by(&self.time, d);
        let (mut hi_cuts, mut hi_bits) = match self.bottleneck_of(&balanced, mem).filter(|&b| b < hi) {
            Some(b) => (balanced, b.to_bits()),
            None => (self.feasible(&pre, d, hi, limit, memory_binds, &mut reach)?, hi.to_bits()),
        };
        // Every split has a stage of at least total/d: start just below it.
        let lower = (pre.s[n] / d as f64) * (1.0 - 1e-12);
        let mut lo_bits =
            if lower > 0.0 && self.feasible(&pre, d, lower, limit, memory_binds, &mut reach).is_none() {
                lower.to_bits()
            } else if self.feasible(&pre, d, 0.0, limit, memory_binds, &mut reach).is_some() {
                hi_bits = 0;
                hi_cuts = self.feasible(&pre, d, 0.0, limit, memory_binds, &mut reach)?;
                0
            } else {
                0
            };
        // Halving down to a relative width of 1e-9, not to the last bit, saves tests; the
        // optimum lies in (lo, hi], so the split found is within that of it, far below
        // what any cost in the model is known to.
        while hi_bits > lo_bits + 1 && f64::from_bits(hi_bits) - f64::from_bits(lo_bits) > RELATIVE_PRECISION * f64::from_bits(hi_bits) {
            let mid = lo_bits + (hi_bits - lo_bits) / 2;
            match self.feasible(&pre, d, f64::from_bits(mid), limit, memory_binds, &mut reach) {
                Some(c) => {
                    // The split found may beat the tested bound by far: continue from it.
                    hi_bits = mid.min(bottleneck_at(&pre, &c).to_bits());
                    hi_cuts = c;
                }
                None => lo_bits = mid,
            }
        }
        let (t, _) = self.evaluate(&hi_cuts, mem);
        Some(Partition {
            bottleneck: t.into_iter().fold(0.0, f64::max),
            cuts: hi_cuts,
        })
    }

    /// Exhaustive search over all `C(n-1, d-1)` splits, for tests.
    pub fn brute_force_partition(&self, d: usize, mem: &PipelineMemory) -> Option<Partition> {
        let n = self.len();
        if d == 0 || d > n {
            return None;
        }
        let mut best: Option<Partition> = None;
        let mut cuts: Vec<usize> = (1..d).collect();
        loop {
            let (t, m) = self.evaluate(&cuts, mem);
            if m.iter().all(|&x| x <= mem.limit()) {
                let b = t.into_iter().fold(0.0, f64::max);
                if best.as_ref().map_or(true, |p| b < p.bottleneck) {
                    best = Some(Partition {
                        cuts: cuts.clone(),
                        bottleneck: b,
                    });
                }
            }
            // Next combination of d-1 cuts from 1..n.
            let k = cuts.len();
            let mut idx = k;
            while idx > 0 && cuts[idx - 1] == n - (k - idx) - 1 {
                idx -= 1;
            }
            if idx == 0 {
                break;
            }
            cuts[idx - 1] += 1;
            for t in idx..k {
                cuts[t] = cuts[t - 1] + 1;
            }
        }
        best
    }
}

/// The positions where the k-th of `d` stages may end when no stage takes longer than
/// `bound`. A stage takes at least its compute time plus `2 * min_comm` per interior cut it
/// shares, so the first `k` stages end where `S(j) + 2 (k-1) min_comm <= k * bound`, and the
/// other `d - k` still hold the rest: `S(n) - S(j) + 2 (d-k-1) min_comm <= (d - k) * bound`.
/// Only positions outside both are left out (with a slack far above rounding), so the
/// search stays exact; near the optimum the window is narrow, which makes deep pipelines
/// on long graphs cheap. (When communication varies a lot along the graph, `min_comm`
/// is far below a typical cut's and the windows of deep pipelines stay wide.)
fn stage_end_window(pre: &Prefix, d: usize, k: usize, bound: f64) -> Range<usize> {
    let n = pre.s.len() - 1;
    let slack = 1e-9 * (pre.s[n].abs() + d as f64 * (bound.abs() + 2.0 * pre.min_comm));
    let cuts_before = 2.0 * (k - 1) as f64 * pre.min_comm;
    let cuts_after = 2.0 * (d - k).saturating_sub(1) as f64 * pre.min_comm;
    let first = pre.s.partition_point(|&s| s < pre.s[n] - (d - k) as f64 * bound + cuts_after - slack);
    let end = pre.s.partition_point(|&s| s <= k as f64 * bound - cuts_before + slack);
    first.max(k)..end.min(n - (d - k) + 1)
}

/// The bottleneck of `cuts`, with the prefix sums at hand (as `evaluate` computes it).
fn bottleneck_at(pre: &Prefix, cuts: &[usize]) -> f64 {
    let n = pre.s.len() - 1;
    stage_ranges(cuts, n)
        .iter()
        .map(|r| pre.stage_time(r.start, r.end))
        .fold(0.0, f64::max)
}

/// Two relaxations of one feasibility test that bound each layer's positions from both
/// sides with the communication of the cuts actually there (the windows above assume the
/// cheapest cut everywhere, which on a graph with long skips leaves deep pipelines' windows
/// wide). `latest[k]`: no split reaches past it with `k` stages, as a stage ending at `j`
/// needs a start `i` before it with `S(i) - comm(i) >= S(j) + comm(j) - bound`, and any
/// position up to `latest[k - 1]` is allowed to be that start. `earliest[m]`: no position
/// before it finishes the graph in `m` stages, by the mirror argument from the end (any
/// position from `earliest[m - 1]` on may be the stage's end). Both are supersets of the
/// exact reachable sets, so the search stays exact; `None` when one side already shows
/// that no split exists.
fn greedy_reach(pre: &Prefix, d: usize, bound: f64) -> Option<(Vec<usize>, Vec<usize>)> {
    let n = pre.s.len() - 1;
    let slack = 1e-9 * (pre.s[n].abs() + d as f64 * (bound.abs() + 2.0 * pre.min_comm));
    let mut latest = vec![0; d + 1];
    let mut earliest = vec![n; d + 1];
    for k in 1..=d {
        let start = pre.best_start[latest[k - 1]] + slack;
        let ends = pre.cheapest_end.partition_point(|&c| c - bound <= start);
        latest[k] = ends.checked_sub(1)?.min(n);
        let end = pre.cheapest_end[earliest[k - 1]] - bound - slack;
        earliest[k] = pre.best_start.partition_point(|&x| x < end);
        if earliest[k] > n {
            return None;
        }
    }
    Some((latest, earliest))
}

/// Whether `cuts` split `0..n` into non-empty stages.
pub fn valid_cuts(cuts: &[usize], n: usize) -> bool {
    let mut prev = 0;
    for &c in cuts {
        if c <= prev || c >= n {
            return false;
        }
        prev = c;
    }
    n > 0
}

/// Baseline: `d` stages of (nearly) equal node counts.
pub fn uniform_by_nodes(n: usize, d: usize) -> Vec<usize> {
    if d == 0 || d > n {
        return Vec::new();
    }
    (1..d).map(|k| k * n / d).collect()
}

/// Baseline: a greedy contiguous split balancing a per-node weight (parameters, as
/// DeepSpeed's default `partition_method="parameters"`, or flops): stage `k` ends at the
/// boundary whose prefix weight is nearest `k * total / d`, keeping every stage non-empty.
pub fn balanced_by(weights: &[f64], d: usize) -> Vec<usize> {
    let n = weights.len();
    if d == 0 || d > n {
        return Vec::new();
    }
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + weights[i].max(0.0);
    }
    let total = prefix[n];
    let mut cuts = Vec::with_capacity(d - 1);
    let mut prev = 0usize;
    for k in 1..d {
        let target = total * k as f64 / d as f64;
        // Positions allowed so that every stage stays non-empty.
        let lo = prev + 1;
        let hi = n - (d - k);
        let pos = prefix[lo..=hi].partition_point(|&x| x < target) + lo;
        let mut best = pos.min(hi);
        if best > lo && (target - prefix[best - 1]).abs() <= (prefix[best] - target).abs() {
            best -= 1;
        }
        cuts.push(best);
        prev = best;
    }
    cuts
}

/// Which linear order of the nodes the stages are cut from (the one with fewer live
/// bytes at its widest cut).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OrderKind {
    /// [`Graph::topo_order`].
    Topological,
    /// Kahn's algorithm with a LIFO ready list.
    DepthFirst,
}

impl OrderKind {
    /// The nodes of `g` in this order, or a node on a cycle.
    pub fn order(self, g: &Graph) -> Result<Vec<NodeId>, NodeId> {
        match self {
            OrderKind::Topological => g.topo_order(),
            OrderKind::DepthFirst => depth_first_order(g),
        }
    }
}

impl std::fmt::Display for OrderKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OrderKind::Topological => "topological",
            OrderKind::DepthFirst => "depth-first",
        })
    }
}

/// A linear order of the nodes with its per-cut live values.
#[derive(Clone, Debug)]
pub struct LinearOrder {
    pub kind: OrderKind,
    pub nodes: Vec<NodeId>,
    /// `live(c)` as a function of the microbatch size, `c` in `0..=n`.
    pub live: Vec<Lin>,
    /// Largest live bytes over the cuts at the reference batch, for this and the other order.
    pub max_live: f64,
    pub other_max_live: f64,
}

/// A depth-first topological order: Kahn's algorithm with a LIFO ready list (successors
/// pushed in reverse id order so the lowest id runs first), or a node on a cycle.
pub fn depth_first_order(g: &Graph) -> Result<Vec<NodeId>, NodeId> {
    let dag = g.dag();
    let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut indeg = vec![0usize; bound];
    for e in dag.edge_references() {
        indeg[e.target().index()] += 1;
    }
    let ids: Vec<NodeId> = g.node_ids().collect();
    let mut by_index: Vec<Option<NodeId>> = vec![None; bound];
    for &n in &ids {
        by_index[n.index()] = Some(n);
    }
    let mut stack: Vec<NodeId> = ids
        .iter()
        .rev()
        .copied()
        .filter(|n| indeg[n.index()] == 0)
        .collect();
    let mut order = Vec::with_capacity(ids.len());
    let mut succ: Vec<usize> = Vec::new();
    while let Some(n) = stack.pop() {
        order.push(n);
        succ.clear();
        for e in dag.edges_directed(
            petgraph::stable_graph::NodeIndex::new(n.index()),
            Direction::Outgoing,
        ) {
            let t = e.target().index();
            indeg[t] -= 1;
            if indeg[t] == 0 {
                succ.push(t);
            }
        }
        succ.sort_unstable_by(|a, b| b.cmp(a));
        succ.dedup();
        stack.extend(succ.iter().filter_map(|&t| by_index[t]));
    }
    if order.len() == ids.len() {
        Ok(order)
    } else {
        Err(ids
            .into_iter()
            .find(|n| indeg[n.index()] > 0)
            .unwrap_or(order[0]))
    }
}

/// `live(c)` for every cut of `order` (weights excluded; graph inputs from cut 0, graph
/// outputs to cut `n`), as functions of the microbatch size.
pub fn live_bytes(g: &Graph, order: &[NodeId], cost: &CostModel) -> Vec<Lin> {
    let n = order.len();
    let export = cost.export_batch;
    let bound = g.node_ids().map(|x| x.index() + 1).max().unwrap_or(0);
    let mut pos = vec![usize::MAX; bound];
    for (p, &x) in order.iter().enumerate() {
        pos[x.index()] = p;
    }
    // last[v]: the last position reading value v (n for graph outputs).
    let mut last: Vec<Option<usize>> = vec![None; g.value_count()];
    for (p, &x) in order.iter().enumerate() {
        for v in g.node(x).inputs.iter().flatten() {
            let l = &mut last[v.index()];
            *l = Some(l.map_or(p, |q| q.max(p)));
        }
    }
    for v in g.outputs() {
        last[v.index()] = Some(n);
    }
    let mut diff = vec![Lin::ZERO; n + 2];
    for v in g.value_ids() {
        let Some(q) = last[v.index()] else { continue };
        let val = g.value(v);
        let first = match val.def {
            ValueDef::Input => 0,
            ValueDef::Node { node, .. } => match pos.get(node.index()) {
                Some(&p) if p != usize::MAX => p + 1,
                _ => continue,
            },
            ValueDef::Weight(_) => continue,
        };
        if first > q {
            continue;
        }
        let bytes = value_bytes(val, export);
        diff[first] += bytes;
        diff[q + 1] += bytes.scale(-1.0);
    }
    let mut out = Vec::with_capacity(n + 1);
    let mut acc = Lin::ZERO;
    for d in diff.iter().take(n + 1) {
        acc += *d;
        out.push(acc);
    }
    out
}

/// Bytes of a value as a function of the microbatch size.
pub fn value_bytes(v: &pipewright_ir::Value, export: i64) -> Lin {
    let size = v.ty.dtype.size() as f64;
    match v.ty.shape.numel_dim() {
        Some(pipewright_ir::Dim::Fixed(k)) => Lin::new(0.0, k as f64 * size),
        Some(pipewright_ir::Dim::Batch(k)) => Lin::new(k as f64 * size, 0.0),
        None => Lin::new(0.0, v.ty.shape.numel(export).max(0) as f64 * size),
    }
}

/// Picks the linear order (see the module docs), comparing max live bytes at microbatch `b`.
pub fn choose_order(g: &Graph, cost: &CostModel, b: u64) -> Result<LinearOrder, NodeId> {
    let topo = g.topo_order()?;
    let dfs = depth_first_order(g)?;
    let peak = |l: &[Lin]| l.iter().map(|x| x.at(b)).fold(0.0, f64::max);
    let lt = live_bytes(g, &topo, cost);
    let ld = live_bytes(g, &dfs, cost);
    let (pt, pd) = (peak(&lt), peak(&ld));
    Ok(if pd < pt {
        LinearOrder {
            kind: OrderKind::DepthFirst,
            nodes: dfs,
            live: ld,
            max_live: pd,
            other_max_live: pt,
        }
    } else {
        LinearOrder {
            kind: OrderKind::Topological,
            nodes: topo,
            live: lt,
            max_live: pt,
            other_max_live: pd,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(times: &[f64]) -> PartitionProblem {
        let n = times.len();
        PartitionProblem {
            time: times.to_vec(),
            param_bytes: vec![1.0; n],
            act_bytes: vec![1.0; n],
            kept_bytes: Vec::new(),
            live_bytes: vec![0.0; n + 1],
            bandwidth: 1.0,
            transfer_share: 1.0,
            awaiting_bytes: Vec::new(),
            keeps_graph: Vec::new(),
        }
    }

    #[test]
    fn chain_without_comm() {
        let p = chain(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let part = p.optimal_partition(3, &PipelineMemory::unlimited()).unwrap();
        // 21 total: best split {1,2,3,4}=10? no: [1,2,3][4,5][6] -> 6,9,6 = 9; [1..4][5][6]=10.
        assert_eq!(part.bottleneck, 9.0);
        assert_eq!(part.cuts, vec![3, 5]);
        assert_eq!(
            p.brute_force_partition(3, &PipelineMemory::unlimited())
                .unwrap()
                .bottleneck,
            9.0
        );
        assert!(p.optimal_partition(7, &PipelineMemory::unlimited()).is_none());
        assert_eq!(
            p.optimal_partition(1, &PipelineMemory::unlimited())
                .unwrap()
                .cuts,
            Vec::<usize>::new()
        );
    }

    /// The gradient counts from a stage's first weight gradient: PipeDream-Flush's stage 0
    /// at `m = d = 2` holds both microbatches before it (weights alone beside them) and one
    /// after it (weights and gradient), where the model used to hold both with the gradient;
    /// a third microbatch's forward follows that backward, and GPipe holds all but one with
    /// the gradient. The partitioner cuts by the phases too.
    #[test]
    fn the_gradient_counts_from_the_first_weight_gradient() {
        let mut p = chain(&[1.0, 1.0]);
        p.act_bytes = vec![10.0, 10.0];
        // SGD, fp32: one weight version, the gradient, no state.
        let memory = |schedule, m| p.evaluate(&[1], &PipelineMemory::of_pipeline(schedule, Recompute::None, 2, m, 0, Precision::Fp32, f64::INFINITY)).1;
        // Stage 0: max(2 * 1 + 1 * 10, 1 * 1 + 2 * 10); stage 1 holds one either way.
        assert_eq!(memory(Schedule::Flush, 2), [21.0, 12.0]);
        assert_eq!(memory(Schedule::Flush, 3), [22.0, 12.0]);
        assert_eq!(memory(Schedule::GPipe, 2), [21.0, 21.0]);
        // 2BW (two weight versions) runs its next batch's forwards before the step.
        assert_eq!(memory(Schedule::TwoBw, 2), [3.0 * 1.0 + 2.0 * 10.0, 3.0 * 1.0 + 10.0]);
        let limited = PipelineMemory::of_pipeline(Schedule::Flush, Recompute::None, 2, 2, 0, Precision::Fp32, 21.5);
        assert_eq!(p.optimal_partition(2, &limited).map(|x| x.cuts), Some(vec![1]));
        let tighter = PipelineMemory::of_pipeline(Schedule::Flush, Recompute::None, 2, 2, 0, Precision::Fp32, 20.5);
        assert_eq!(p.optimal_partition(2, &tighter), None);
    }

    /// 2BW whose update waits for its replicas' sum holds a second gradient in every stage:
    /// one more copy of each weight byte, nothing else; not deferred, nothing changes.
    #[test]
    fn a_deferred_update_adds_one_gradient_per_stage() {
        let mut p = chain(&[1.0, 1.0]);
        p.act_bytes = vec![10.0, 10.0];
        let two_bw = || PipelineMemory::of_pipeline(Schedule::TwoBw, Recompute::None, 2, 2, 0, Precision::Fp32, f64::INFINITY);
        let (_, alone) = p.evaluate(&[1], &two_bw().with_deferred_updates(false));
        let (_, deferred) = p.evaluate(&[1], &two_bw().with_deferred_updates(true));
        assert_eq!(alone, [23.0, 13.0]);
        assert_eq!(deferred, [24.0, 14.0]);
    }

    /// Microbatches awaiting their weight gradients count what they keep per position,
    /// and their stage's whole graph besides where a position there keeps it.
    #[test]
    fn awaiting_microbatches_hold_what_their_weight_gradients_keep() {
        let mut p = chain(&[1.0, 1.0, 1.0]);
        p.act_bytes = vec![10.0; 3];
        p.awaiting_bytes = vec![2.0; 3];
        p.keeps_graph = vec![false, false, true];
        let mem = MemoryModel { weight_factor: 1.0, act_factor: 1.0, awaiting_factor: 3.0, ..MemoryModel::unlimited() };
        // Stage [0, 2): 2 weights + 20 activations + 3 * 4 kept; stage [2, 3): 1 + 10 + 3 *
        // (2 + 10) with its graph.
        assert_eq!(p.evaluate(&[2], &PipelineMemory::uniform(mem)).1, vec![34.0, 47.0]);
        assert_eq!(p.evaluate(&[1], &PipelineMemory::uniform(mem)).1, vec![17.0, 2.0 + 20.0 + 3.0 * 24.0]);
        // Under a limit of 40 only the first split fits, and the partitioner finds it.
        let limited = PipelineMemory::uniform(MemoryModel { limit: 40.0, ..mem });
        assert_eq!(p.optimal_partition(2, &limited), None);
        let limited = PipelineMemory::uniform(MemoryModel { limit: 47.0, ..mem });
        assert_eq!(p.optimal_partition(2, &limited).map(|x| x.cuts), Some(vec![2]));
        assert_eq!(p.brute_force_partition(2, &limited).map(|x| x.cuts), Some(vec![2]));
    }

    #[test]
    fn comm_moves_the_cut() {
        // Cutting at 2 costs 2*10/1 = 20 on both sides; elsewhere nothing.
        let mut p = chain(&[5.0, 5.0, 5.0, 5.0]);
        p.live_bytes = vec![0.0, 0.0, 10.0, 0.0, 0.0];
        let part = p.optimal_partition(2, &PipelineMemory::unlimited()).unwrap();
        assert_eq!(part.bottleneck, 15.0);
        assert!(part.cuts == vec![1] || part.cuts == vec![3]);
    }

    #[test]
    fn memory_limit_forces_uneven_split() {
        let mut p = chain(&[1.0, 1.0, 1.0, 1.0]);
        p.param_bytes = vec![10.0, 0.0, 0.0, 0.0];
        let mem = MemoryModel {
            weight_factor: 1.0,
            act_factor: 0.0,
            kept_factor: 0.0,
            input_factor: 0.0,
            update_factor: 0.0,
            awaiting_factor: 0.0,
            limit: 10.0,
        };
        let part = p.optimal_partition(2, &PipelineMemory::uniform(mem)).unwrap();
        assert_eq!(part.bottleneck, 2.0);
        let tight = PipelineMemory::uniform(MemoryModel { limit: 9.0, ..mem });
        assert!(p.optimal_partition(2, &tight).is_none());
        assert!(p.brute_force_partition(2, &tight).is_none());
    }

    /// Each stage by its own model: the first of two holding two microbatches' activations
    /// and the second one's (1F1B), a limit of 3 leaves stage 0 one node and stage 1 three,
    /// where every stage holding two fits no split at all.
    #[test]
    fn each_stage_holds_its_own_microbatches() {
        let p = chain(&[1.0, 1.0, 1.0, 1.0]);
        let holding = |k: f64| MemoryModel { weight_factor: 0.0, act_factor: k, kept_factor: 0.0, input_factor: 0.0, update_factor: 0.0, awaiting_factor: 0.0, limit: 3.0 };
        let one_f_one_b = PipelineMemory::per_stage(vec![holding(2.0), holding(1.0)]);
        let part = p.optimal_partition(2, &one_f_one_b).unwrap();
        assert_eq!((part.cuts.clone(), part.bottleneck), (vec![1], 3.0));
        assert_eq!(p.brute_force_partition(2, &one_f_one_b).unwrap().cuts, vec![1]);
        assert_eq!(p.evaluate(&[1], &one_f_one_b).1, vec![2.0, 3.0]);
        assert!(p.optimal_partition(2, &PipelineMemory::uniform(holding(2.0))).is_none());
        // Alike stages keep one model; the least model bounds every stage's from below.
        assert_eq!(PipelineMemory::per_stage(vec![holding(2.0); 3]), PipelineMemory::uniform(holding(2.0)));
        assert_eq!(one_f_one_b.least(), holding(1.0));
    }

    /// The update's phase counts apart: weights of 1 per node held 3 times while computing
    /// and 4 times while updating (no activations then), against a limit of 8: each stage
    /// of two may hold two nodes, by the update (3 * 2 + 2 = 8 while computing).
    #[test]
    fn the_update_is_a_phase_of_its_own() {
        let p = chain(&[1.0, 1.0, 1.0, 1.0]);
        let mem = MemoryModel { weight_factor: 3.0, act_factor: 1.0, kept_factor: 0.0, input_factor: 0.0, update_factor: 4.0, awaiting_factor: 0.0, limit: 8.0 };
        let part = p.optimal_partition(2, &PipelineMemory::uniform(mem)).unwrap();
        assert_eq!(part.cuts, vec![2]);
        assert_eq!(p.evaluate(&[2], &PipelineMemory::uniform(mem)).1, vec![8.0, 8.0]);
        // A stage of three nodes would need 12 while updating (9 + 3 = 12 computing too).
        assert!(p.optimal_partition(2, &PipelineMemory::uniform(MemoryModel { limit: 7.9, ..mem })).is_none());
        // Tied copies held besides count in both phases: 2 extra bytes make stage 0 hold
        // max(8 + 3 * 2, 4 * 4) = 16.
        assert_eq!(p.evaluate_with_extra(&[2], &PipelineMemory::uniform(mem), &[2.0]).1, vec![16.0, 8.0]);
        let computing_only = MemoryModel { update_factor: 0.0, ..mem };
        assert_eq!(p.evaluate(&[3], &PipelineMemory::uniform(computing_only)).1, vec![12.0, 4.0]);
    }

    #[test]
    fn baselines() {
        assert_eq!(uniform_by_nodes(10, 3), vec![3, 6]);
        assert_eq!(balanced_by(&[1.0, 1.0, 1.0, 1.0], 2), vec![2]);
        assert_eq!(balanced_by(&[0.0, 0.0, 0.0, 9.0], 2), vec![2]); // a tie: the earlier boundary
        assert_eq!(balanced_by(&[9.0, 0.0, 0.0, 0.0], 3), vec![1, 2]);
        assert!(valid_cuts(&balanced_by(&[5.0, 0.0, 0.0, 0.0, 0.0], 4), 5));
    }
}
