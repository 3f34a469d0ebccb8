//! The profile file: what `pipewright profile` measures and writes, and the cost model
//! reads ([`Profile`], JSON). Per node its forward and backward milliseconds at each
//! microbatch size measured, and for the whole model what timing nodes one at a time
//! misses: the whole pass, the weights' updates, the loss, the stage boundaries, how a
//! pipeline's stages share the pass, how threads crowd a CPU host and how much the
//! operations' times spread. This module parses and checks the format and reads it
//! (`Measured`: a time between and beyond the measured sizes); applying it to a graph is
//! the cost model's (`CostModel::apply_profile`).

use std::collections::HashMap;

use pipewright_core::Loss;
use serde::{Deserialize, Serialize};

use crate::machine::Crowding;

/// Why a profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("the profile is not valid JSON: {0}")]
    Json(String),
    #[error("invalid profile: {0}")]
    Invalid(String),
}

/// A measured per-node profile, written by `pipewright profile`.
///
/// JSON format:
/// ```json
/// { "model": "gpt2-tiny", "device": "H100",
///   "batches": [1, 2, 4, 8],
///   "nodes": [ { "name": "MatMul_3", "op": "MatMul",
///                "fwd_ms": [0.01, 0.02, 0.04, 0.08], "bwd_ms": [0.02, 0.04, 0.08, 0.16] } ] }
/// ```
/// `batches` are the microbatch sizes measured; `fwd_ms`/`bwd_ms` hold one time in
/// milliseconds per batch size, in the same order. Nodes are matched by IR node name; `op`
/// is the ONNX op type, kept for checking. `spread` (optional) says how much the whole
/// model's time varied over the repetitions, per batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub model: String,
    pub device: String,
    pub batches: Vec<u64>,
    pub nodes: Vec<ProfileNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spread: Vec<BatchSpread>,
    /// The whole model as one forward and one backward pass, per batch size (absent from
    /// profiles written before it was measured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub whole: Vec<WholePass>,
    /// Each trainable weight's measured update (absent from older profiles: the update is
    /// then costed from the memory bandwidth).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub updates: Vec<WeightUpdate>,
    /// The training loss on the model's output, per batch size (absent from older
    /// profiles: the last stage's time then leaves the loss out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossTiming>,
    /// All the weights updated in one step, per optimizer (absent from older profiles:
    /// the per-weight updates are then used as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<WholeStep>,
    /// The whole pass run by several threads at once on the host profiled (absent from
    /// older profiles: the simulator then shares a host's cores with no slowdown beyond
    /// the sharing itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<HostSharing>,
    /// What one stage boundary costs the runtime, at one or more batch sizes (absent from
    /// older profiles, and for a model of one node: the stages' times are then their
    /// nodes' alone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boundary: Vec<BoundaryCost>,
    /// One accumulation of a gradient of every trainable weight into its accumulator,
    /// milliseconds, which a stage's backward pays for each microbatch of a step but the
    /// first (absent from older profiles: the backward then leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulate_ms: Option<f64>,
    /// How the runtime divides the pass between the stages of a pipeline, at one or more
    /// batch sizes (absent from older profiles: the nodes' times are then divided as they
    /// were timed one at a time).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub split: Vec<StageSplit>,
    /// How the runtime's forwards and backwards vary from one microbatch to the next: in
    /// runs of the two-stage build behind `split` whose stages overlap, as a pipeline's
    /// do, each over its stage's mean of that kind in its run, as quantiles, each the
    /// middle of an equal share of them (absent from older profiles: the simulator then
    /// runs every operation at its stage's time). The simulator draws from it
    /// ([`crate::machine::DurationSpread`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub duration_factors: Vec<f64>,
}

/// The model trained as stages (one microbatch per step, so that they never overlap) at
/// microbatch `batch`: each stage's nodes and its forward and backward milliseconds per
/// microbatch, less its half of each boundary it has and (the last) the loss. Timing nodes
/// one at a time divides the pass between them with an error of its own (resnet18's later
/// layers took 9% more of the pass in every training run than they did when timed alone),
/// which the stages' measured times correct: [`Profile`]'s node times are scaled per stage
/// so that the stages' shares of the pass are the measured ones, the whole pass unchanged.
/// `pipewright profile` measures a split at every batch size it profiles, since the
/// shares move with the microbatch in ways a line between two sizes misses (resnet18's,
/// docs/simulator.md); between and beyond the measured sizes the scales are interpolated
/// (`Profile::split_scales`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageSplit {
    pub batch: u64,
    pub stages: Vec<SplitStage>,
}

/// One stage of a [`StageSplit`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitStage {
    /// The profile's nodes the stage ran, by name.
    pub nodes: Vec<String>,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

impl StageSplit {
    /// Per stage, what scales its nodes' forward and backward times (`nodes`, at batch
    /// index `k`) so that their shares of the pass are the measured ones; `None` for a
    /// direction where a stage has no time, measured or summed, to compare.
    pub fn stage_scales(&self, nodes: &[ProfileNode], k: usize) -> (Option<Vec<f64>>, Option<Vec<f64>>) {
        self.scales_of(&self.members(nodes), nodes, k)
    }

    /// [`StageSplit::stage_scales`] with each stage's node indices already found.
    fn scales_of(&self, members: &[Vec<usize>], nodes: &[ProfileNode], k: usize) -> (Option<Vec<f64>>, Option<Vec<f64>>) {
        (self.shares_over(members, |s| s.fwd_ms, |i| nodes[i].fwd_ms[k]), self.shares_over(members, |s| s.bwd_ms, |i| nodes[i].bwd_ms[k]))
    }

    /// Per stage, the indices in `nodes` of its nodes.
    fn members(&self, nodes: &[ProfileNode]) -> Vec<Vec<usize>> {
        let index: HashMap<&str, usize> = nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
        self.stages.iter().map(|s| s.nodes.iter().filter_map(|n| index.get(n.as_str()).copied()).collect()).collect()
    }

    /// Per profile node, [`StageSplit::stage_scales`] of its stage; 1 for a node in no
    /// stage.
    fn node_scales(&self, nodes: &[ProfileNode], k: usize) -> Vec<(f64, f64)> {
        let members = self.members(nodes);
        let (fwd, bwd) = self.scales_of(&members, nodes, k);
        let mut scales = vec![(1.0, 1.0); nodes.len()];
        for (r, m) in members.iter().enumerate() {
            for &i in m {
                scales[i] = (fwd.as_ref().map_or(1.0, |f| f[r]), bwd.as_ref().map_or(1.0, |b| b[r]));
            }
        }
        scales
    }

    /// Per stage, its measured share of the pass over its nodes' share; `None` where a
    /// stage has no time to compare.
    fn shares_over(&self, members: &[Vec<usize>], measured: fn(&SplitStage) -> f64, node_ms: impl Fn(usize) -> f64) -> Option<Vec<f64>> {
        let timed: Vec<f64> = self.stages.iter().map(measured).collect();
        let summed: Vec<f64> = members.iter().map(|m| m.iter().map(|&i| node_ms(i)).sum()).collect();
        if timed.iter().chain(&summed).any(|&x| x <= 0.0) {
            return None;
        }
        let (all_timed, all_summed) = (timed.iter().sum::<f64>(), summed.iter().sum::<f64>());
        Some(timed.iter().zip(&summed).map(|(t, s)| (t / all_timed) / (s / all_summed)).collect())
    }
}

/// What one stage boundary costs the runtime beyond its nodes, milliseconds, measured at
/// microbatch `batch`: the model trained as two stages less as one, one microbatch per
/// step (so the stages never overlap), per step: forward, backward and the update (the
/// hand-offs and the second stage's own step, seeding, graph and bookkeeping). A stage
/// pays half of it per boundary it has; between batch sizes it is linear in the batch, as
/// the nodes' times are.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BoundaryCost {
    pub batch: u64,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    pub step_ms: f64,
    /// In the same runs, the mean time a stage's thread spends after each backward (and the
    /// send of its gradient) before its next traced event: the runtime's work that no
    /// traced operation covers (releasing the microbatch's graph and activations), which
    /// every stage pays per microbatch and a trace shows as a gap. Absent from profiles
    /// taken before it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_backward_ms: Option<f64>,
}

impl BoundaryCost {
    /// The forward and backward milliseconds of one boundary at microbatch `b` from the
    /// sizes `costs` were measured at, read as the cost model reads them: through every
    /// measured size, linear between two and along the nearest two beyond them; 0 without
    /// any.
    pub fn pass_ms_at(costs: &[BoundaryCost], b: u64) -> [f64; 2] {
        let batches: Vec<u64> = costs.iter().map(|c| c.batch).collect();
        let at = |ms: fn(&BoundaryCost) -> f64| Measured::new(&batches, &costs.iter().map(ms).collect::<Vec<f64>>()).at(b);
        [at(|c| c.fwd_ms), at(|c| c.bwd_ms)]
    }
}

/// The whole model's forward and backward pass run by 1, `cores` and `2 cores` threads at
/// once (each its own copy of the model) on the host profiled, which has `cores` cores:
/// what a pass costs beyond its share of the cores when threads crowd a host (caches,
/// memory bandwidth, the scheduler's switches), per batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostSharing {
    pub cores: usize,
    pub runs: Vec<SharedPasses>,
    /// How long a thread that never blocks keeps a core while as many others wait,
    /// milliseconds (the median of its uninterrupted runs): Linux preempts a thread that
    /// never blocks on its tick only, so this is the tick when the time slice is shorter
    /// (4 ms here: `CONFIG_HZ` 250 and a 1.5 ms slice). Absent from profiles taken before
    /// it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_ms: Option<f64>,
}

/// `threads` threads each running the whole pass at batch `batch`: milliseconds of the
/// window per pass per thread.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedPasses {
    pub batch: u64,
    pub threads: usize,
    pub pass_ms: f64,
}

impl HostSharing {
    fn check(&self) -> Result<(), ProfileError> {
        if self.cores == 0 {
            return Err(ProfileError::Invalid("`sharing`: a host of 0 cores".into()));
        }
        if let Some(turn) = self.turn_ms.filter(|t| !t.is_finite() || *t <= 0.0) {
            return Err(ProfileError::Invalid(format!("`sharing.turn_ms` must be a positive number of milliseconds, not {turn}")));
        }
        for r in &self.runs {
            if r.threads == 0 || r.batch == 0 || !r.pass_ms.is_finite() || r.pass_ms <= 0.0 {
                return Err(ProfileError::Invalid(format!(
                    "`sharing` at batch {} with {} threads: needs a positive batch, at least one thread and a positive finite time",
                    r.batch, r.threads
                )));
            }
        }
        Ok(())
    }

    /// At batch `b`: the slowdown with `cores` and with `2 cores` threads, each against
    /// one thread alone given its share of the cores; between the measured batch sizes
    /// linear in the batch, beyond them the nearest one's.
    pub fn crowding(&self, b: u64) -> Crowding {
        let mut at: Vec<(u64, Crowding)> = self.batches().into_iter().filter_map(|batch| Some((batch, self.crowding_at(batch)?))).collect();
        at.sort_by_key(|x| x.0);
        let Some(k) = at.iter().position(|x| x.0 >= b) else { return at.last().map_or(Crowding::NONE, |x| x.1) };
        if k == 0 || at[k].0 == b {
            return at[k].1;
        }
        let ((b0, c0), (b1, c1)) = (at[k - 1], at[k]);
        let t = (b - b0) as f64 / (b1 - b0) as f64;
        let mix = |x: f64, y: f64| x + t * (y - x);
        Crowding { at_cores: mix(c0.at_cores, c1.at_cores), at_twice: mix(c0.at_twice, c1.at_twice) }
    }

    fn batches(&self) -> Vec<u64> {
        let mut b: Vec<u64> = self.runs.iter().map(|r| r.batch).collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// The measured crowding at one batch size, if it has a one-thread run; a slowdown
    /// below 1 is the measurement's noise and reads as none.
    fn crowding_at(&self, batch: u64) -> Option<Crowding> {
        let pass = |threads: usize| self.runs.iter().find(|r| r.batch == batch && r.threads == threads).map(|r| r.pass_ms);
        let alone = pass(1)?;
        let cores = self.cores as f64;
        let slowdown = |threads: usize| pass(threads).map_or(1.0, |ms| (ms / (alone * (threads as f64 / cores).max(1.0))).max(1.0));
        Some(Crowding { at_cores: slowdown(self.cores), at_twice: slowdown(2 * self.cores) })
    }
}

/// One step updating every trainable weight of the model, as a stage's step updates its
/// own (milliseconds per optimizer, as [`WeightUpdate`]): the per-weight times are scaled
/// to add up to it, since one weight updated over and over stays in the cache where a
/// step streams all of them through memory.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WholeStep {
    pub sgd_ms: f64,
    pub momentum_ms: f64,
    pub adam_ms: f64,
}

impl WholeStep {
    fn times(&self) -> [f64; 3] {
        [self.sgd_ms, self.momentum_ms, self.adam_ms]
    }
}

/// The training loss on one model output as the last stage computes it: forward, and
/// its backward to the output, milliseconds per batch size of the profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossTiming {
    pub loss: Loss,
    pub output: String,
    pub fwd_ms: Vec<f64>,
    pub bwd_ms: Vec<f64>,
}

/// One trainable weight's update as the runtime's step applies it (gradient scaling, the
/// optimizer, the finiteness check), milliseconds, per optimizer: SGD, SGD with momentum,
/// Adam (AdamW does the same work).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightUpdate {
    pub name: String,
    pub sgd_ms: f64,
    pub momentum_ms: f64,
    pub adam_ms: f64,
}

impl WeightUpdate {
    /// SGD, momentum, Adam: the order of the cost model's `update_time`.
    pub(crate) fn times(&self) -> [f64; 3] {
        [self.sgd_ms, self.momentum_ms, self.adam_ms]
    }
}

/// The whole model run as one forward and one backward pass, as a stage runs its nodes,
/// at one batch size: medians over the repetitions, milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WholePass {
    pub batch: u64,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

/// The whole model's forward + backward time (the sum over its nodes) at one batch size,
/// over the repetitions: a wide spread means a busy or noisy machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchSpread {
    pub batch: u64,
    pub reps: usize,
    pub min_ms: f64,
    pub median_ms: f64,
    pub max_ms: f64,
}

impl BatchSpread {
    /// From one total per repetition (at least one).
    pub fn of(batch: u64, mut totals: Vec<f64>) -> BatchSpread {
        totals.sort_by(|a, b| a.total_cmp(b));
        let n = totals.len();
        BatchSpread { batch, reps: n, min_ms: totals[0], median_ms: totals[n / 2], max_ms: totals[n - 1] }
    }

    /// `(max - min) / median`.
    pub fn relative(&self) -> f64 {
        if self.median_ms > 0.0 { (self.max_ms - self.min_ms) / self.median_ms } else { 0.0 }
    }
}

/// One node's measurements in a [`Profile`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileNode {
    pub name: String,
    pub op: String,
    pub fwd_ms: Vec<f64>,
    pub bwd_ms: Vec<f64>,
}

impl Profile {
    /// Parses and checks a profile (one time per batch size, finite and non-negative).
    pub fn from_json(text: &str) -> Result<Profile, ProfileError> {
        let p: Profile =
            serde_json::from_str(text).map_err(|e| ProfileError::Json(e.to_string()))?;
        p.check()?;
        Ok(p)
    }

    pub fn check(&self) -> Result<(), ProfileError> {
        if self.batches.is_empty() || self.batches.contains(&0) {
            return Err(ProfileError::Invalid(
                "`batches` must be non-empty positive sizes".into(),
            ));
        }
        for n in &self.nodes {
            for (what, v) in [("fwd_ms", &n.fwd_ms), ("bwd_ms", &n.bwd_ms)] {
                if v.len() != self.batches.len() {
                    return Err(ProfileError::Invalid(format!(
                        "node {:?}: {what} has {} entries for {} batch sizes",
                        n.name,
                        v.len(),
                        self.batches.len()
                    )));
                }
                if v.iter().any(|x| !x.is_finite() || *x < 0.0) {
                    return Err(ProfileError::Invalid(format!(
                        "node {:?}: {what} has a negative or non-finite time",
                        n.name
                    )));
                }
            }
        }
        let bad = |x: f64| !x.is_finite() || x < 0.0;
        for w in &self.whole {
            if bad(w.fwd_ms) || bad(w.bwd_ms) || !self.batches.contains(&w.batch) {
                return Err(ProfileError::Invalid(format!(
                    "`whole` at batch {}: needs a measured batch size and non-negative finite times",
                    w.batch
                )));
            }
        }
        if let Some(l) = &self.loss {
            if l.fwd_ms.len() != self.batches.len() || l.bwd_ms.len() != self.batches.len() || l.fwd_ms.iter().chain(&l.bwd_ms).any(|&x| bad(x)) {
                return Err(ProfileError::Invalid(format!(
                    "the loss ({} on {:?}) needs one non-negative finite time per batch size",
                    l.loss, l.output
                )));
            }
        }
        for u in &self.updates {
            if u.times().into_iter().any(bad) {
                return Err(ProfileError::Invalid(format!(
                    "update of weight {:?}: a negative or non-finite time",
                    u.name
                )));
            }
        }
        if self.step.is_some_and(|w| w.times().into_iter().any(bad)) {
            return Err(ProfileError::Invalid("`step`: a negative or non-finite time".into()));
        }
        for c in &self.boundary {
            if c.batch == 0 || [c.fwd_ms, c.bwd_ms, c.step_ms].into_iter().chain(c.after_backward_ms).any(bad) {
                return Err(ProfileError::Invalid("`boundary`: needs a positive batch and non-negative finite times".into()));
            }
        }
        if self.duration_factors.iter().any(|&f| !f.is_finite() || f <= 0.0) {
            return Err(ProfileError::Invalid("`duration_factors`: needs positive finite factors".into()));
        }
        if self.accumulate_ms.is_some_and(bad) {
            return Err(ProfileError::Invalid("`accumulate_ms`: a negative or non-finite time".into()));
        }
        for sp in &self.split {
            if !self.batches.contains(&sp.batch) || sp.stages.iter().any(|s| bad(s.fwd_ms) || bad(s.bwd_ms)) {
                return Err(ProfileError::Invalid(format!(
                    "`split` at batch {}: needs a measured batch size and non-negative finite times",
                    sp.batch
                )));
            }
            let mut seen = std::collections::HashSet::new();
            if let Some(twice) = sp.stages.iter().flat_map(|s| &s.nodes).find(|n| !seen.insert(n.as_str())) {
                return Err(ProfileError::Invalid(format!("`split` at batch {}: node {twice:?} is in two stages", sp.batch)));
            }
        }
        self.sharing.as_ref().map_or(Ok(()), HostSharing::check)
    }

    /// Per optimizer (SGD, momentum, Adam), what scales the weights' update times so that
    /// they add up to the whole step; 1 where there is no whole step.
    pub(crate) fn whole_step_scales(&self) -> [f64; 3] {
        let Some(step) = self.step else { return [1.0; 3] };
        let sums: [f64; 3] = std::array::from_fn(|k| self.updates.iter().map(|u| u.times()[k]).sum());
        let whole = step.times();
        std::array::from_fn(|k| if sums[k] > 0.0 && whole[k] > 0.0 { whole[k] / sums[k] } else { 1.0 })
    }

    /// Per profile node and batch size, what scales its forward and backward times so that
    /// the stages of [`Profile::split`] take their measured shares of the pass: at a batch
    /// size measured there, that split's; between two, the straight line between them;
    /// beyond the ends, the nearest. 1 without a split.
    pub(crate) fn split_scales(&self) -> Vec<Vec<(f64, f64)>> {
        let mut at: Vec<(u64, Vec<(f64, f64)>)> = self
            .split
            .iter()
            .filter_map(|s| Some((s.batch, s.node_scales(&self.nodes, self.batches.iter().position(|&b| b == s.batch)?))))
            .collect();
        at.sort_by_key(|a| a.0);
        at.dedup_by_key(|a| a.0);
        (0..self.nodes.len())
            .map(|i| self.batches.iter().map(|&b| interpolate_scale(&at, i, b)).collect())
            .collect()
    }

    /// Per batch size, what scales the nodes' forward and backward times so that they add
    /// up to the whole pass: timing one node at a time misses what running them back to
    /// back shares (caches, the allocator) and adds what it alone pays (one backward
    /// engine start per node where a stage pays one in all). 1 where there is no whole
    /// pass.
    pub(crate) fn whole_pass_scales(&self) -> Vec<(f64, f64)> {
        (0..self.batches.len())
            .map(|k| {
                let Some(w) = self.whole.iter().find(|w| w.batch == self.batches[k]) else {
                    return (1.0, 1.0);
                };
                let fwd: f64 = self.nodes.iter().map(|n| n.fwd_ms[k]).sum();
                let bwd: f64 = self.nodes.iter().map(|n| n.bwd_ms[k]).sum();
                let ratio = |whole: f64, sum: f64| if sum > 0.0 && whole > 0.0 { whole / sum } else { 1.0 };
                (ratio(w.fwd_ms, fwd), ratio(w.bwd_ms, bwd))
            })
            .collect()
    }
}

/// A time measured at some microbatch sizes: linear between two measured sizes and, beyond
/// them, along the nearest two; one size alone scales in proportion to the microbatch. It
/// goes through every measurement, where a straight line fitted through all of them misses
/// each (gpt2-tiny's whole pass measured at 1, 2, 4 and 8 is curved enough that such a line
/// says a tenth more than was measured at 4).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Measured {
    /// (microbatch, seconds), by microbatch, one per size.
    points: Vec<(u64, f64)>,
}

impl Measured {
    /// `ys[k]` measured at `xs[k]`; of a size given twice, the first counts.
    pub(crate) fn new(xs: &[u64], ys: &[f64]) -> Measured {
        let mut points: Vec<(u64, f64)> = xs.iter().copied().zip(ys.iter().copied()).collect();
        points.sort_by_key(|p| p.0);
        points.dedup_by_key(|p| p.0);
        Measured { points }
    }

    /// The time at microbatch `b`, never below 0.
    pub(crate) fn at(&self, b: u64) -> f64 {
        let value = match self.points.as_slice() {
            [] => 0.0,
            [(x, y)] => y * b as f64 / (*x).max(1) as f64,
            points => {
                // The segment holding `b`, or the end one nearest it.
                let k = points.partition_point(|p| p.0 < b).clamp(1, points.len() - 1);
                let ((x0, y0), (x1, y1)) = (points[k - 1], points[k]);
                y0 + (y1 - y0) * (b as f64 - x0 as f64) / (x1 - x0) as f64
            }
        };
        value.max(0.0)
    }
}

/// Node `i`'s scales at batch `b` from `at` (sorted by batch): see
/// [`Profile::split_scales`].
fn interpolate_scale(at: &[(u64, Vec<(f64, f64)>)], i: usize, b: u64) -> (f64, f64) {
    let k = at.partition_point(|a| a.0 < b);
    match (k.checked_sub(1).map(|j| &at[j]), at.get(k)) {
        (_, Some((x1, s1))) if *x1 == b => s1[i],
        (Some((x0, s0)), Some((x1, s1))) => {
            let t = (b - x0) as f64 / (x1 - x0) as f64;
            (s0[i].0 + (s1[i].0 - s0[i].0) * t, s0[i].1 + (s1[i].1 - s0[i].1) * t)
        }
        (Some((_, s)), None) | (None, Some((_, s))) => s[i],
        (None, None) => (1.0, 1.0),
    }
}

