//! What both replay engines keep and how they report: each stage's [`StageState`], the
//! arrivals of its inputs, the tied stages' meetings, the recorded intervals, and the
//! [`report`] made of them.

use pipewright_core::schedule::Op;
use pipewright_core::timeline::{TraceEvent, TraceKind};
use pipewright_core::{Scheme, UpdateRule};

use super::{scheme_orders, SimError, SimSetup, Simulation, StageCost, StageReport};

/// What both engines start a replay with besides their stages: the update rule, each
/// stage's all-reduce, the tied stages' meetings, per stage whether its updates wait for
/// their version ([`defers_updates`]), the stages' inputs arriving, each batch's end and
/// the intervals kept for the trace.
pub(super) struct Start {
    pub(super) rule: UpdateRule,
    pub(super) allreduce: Vec<f64>,
    pub(super) meetings: Meetings,
    pub(super) deferred: Vec<bool>,
    /// Per stage: it reaches its tied stages' meeting at its batch's last input gradient
    /// ([`pipewright_core::Schedule::sums_tied_early`]), not at its step.
    pub(super) early_tied: Vec<bool>,
    /// Activations arriving at each stage, and gradients.
    pub(super) acts: Vec<Arrivals>,
    pub(super) grads: Vec<Arrivals>,
    pub(super) batch_end: Vec<f64>,
    pub(super) events: Events,
}

impl Start {
    /// For `setup` (already checked); refuses tied groups naming no stage of it.
    pub(super) fn new(setup: &SimSetup) -> Result<Start, SimError> {
        let rule = if setup.scheme == Scheme::TwoBw { UpdateRule::TwoBw } else { UpdateRule::Vanilla };
        let deferred = defers_updates(setup, rule);
        let tied = |s: usize| setup.tied_groups.iter().any(|g| g.contains(&s));
        let early_tied = (0..setup.stages.len()).map(|s| !deferred[s] && tied(s) && setup.scheme.schedule().is_some_and(|k| k.sums_tied_early(s))).collect();
        Ok(Start {
            rule,
            allreduce: allreduce_per_stage(setup),
            meetings: Meetings::new(setup)?,
            deferred,
            early_tied,
            acts: arrivals(setup),
            grads: arrivals(setup),
            batch_end: vec![0.0f64; setup.batches],
            events: Events { keep: setup.record, list: Vec::new() },
        })
    }
}

/// Arrival times by microbatch in a window of slots reused modulo its length (a producer
/// is never more than a batch and a pipeline ahead of its consumer).
pub(super) struct Arrivals {
    slots: Vec<(u64, f64)>,
}

impl Arrivals {
    pub(super) fn new(window: usize) -> Arrivals {
        Arrivals { slots: vec![(u64::MAX, 0.0); window.max(1)] }
    }

    pub(super) fn put(&mut self, mb: u64, at: f64) -> Result<(), SimError> {
        let n = self.slots.len();
        let slot = &mut self.slots[(mb % n as u64) as usize];
        if slot.0 != u64::MAX {
            return Err(SimError::Setup(format!("microbatch {mb} arrived while microbatch {} still waited in its slot", slot.0)));
        }
        *slot = (mb, at);
        Ok(())
    }

    /// When microbatch `mb` arrives, if it has been sent.
    pub(super) fn peek(&self, mb: u64) -> Option<f64> {
        let slot = &self.slots[(mb % self.slots.len() as u64) as usize];
        (slot.0 == mb).then_some(slot.1)
    }

    pub(super) fn take(&mut self, mb: u64) -> Option<f64> {
        let n = self.slots.len();
        let slot = &mut self.slots[(mb % n as u64) as usize];
        (slot.0 == mb).then(|| {
            slot.0 = u64::MAX;
            slot.1
        })
    }
}

/// Where a stage is in either engine's replay: its place in its operation order, when its
/// stream, links and all-reduce channel are free, and what it has done and holds.
pub(super) struct StageState {
    pub(super) ops: Vec<Op>,
    pub(super) pc: usize,
    /// When its stream is free: its last work's end.
    pub(super) free: f64,
    pub(super) busy: f64,
    pub(super) in_flight: u64,
    pub(super) peak_in_flight: u64,
    /// Whether the stage splits its backward, and of `in_flight` those between their
    /// input and weight gradients there.
    splits: bool,
    awaiting: u64,
    /// What it held at each moment no other moment's holding covers: `(whole, awaiting,
    /// batches' gradients held)`.
    held: Vec<(u64, u64, usize)>,
    /// Whether its batch's weight gradients exist (from the first weight gradient to the
    /// step).
    gradient: bool,
    /// Link to the next stage (forward) and to the previous one (backward) free from.
    pub(super) fwd_link_free: f64,
    pub(super) bwd_link_free: f64,
    /// 2BW's all-reduce channel free from, and updates waiting for their version's turn:
    /// (step, all-reduce done); each holds its batch's gradients until it is applied.
    pub(super) net_free: f64,
    pub(super) pending: Vec<(u64, f64)>,
    /// Version the stage's weights are at (updates applied).
    pub(super) version: u64,
}

impl StageState {
    /// A stage about to run `ops`, at time 0 with nothing done.
    fn new(ops: Vec<Op>, splits: bool) -> StageState {
        StageState { ops, pc: 0, free: 0.0, busy: 0.0, in_flight: 0, peak_in_flight: 0, splits, awaiting: 0, held: Vec::new(), gradient: false, fwd_link_free: 0.0, bwd_link_free: 0.0, net_free: 0.0, pending: Vec::new(), version: 0 }
    }

    /// Every stage of `setup` about to run its order ([`scheme_orders`]).
    pub(super) fn all(setup: &SimSetup) -> Result<Vec<StageState>, SimError> {
        let (d, m) = (setup.stages.len(), setup.m as usize);
        let splits = |k: usize| setup.scheme.schedule().is_some_and(|s| s.splits_stage_backward(k));
        Ok(scheme_orders(setup.scheme, d, m, setup.batches)?.into_iter().enumerate().map(|(k, ops)| StageState::new(ops, splits(k))).collect())
    }

    /// A forward: one more microbatch held.
    pub(super) fn hold(&mut self) {
        self.in_flight += 1;
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        self.note_gradients();
    }

    /// A whole backward or a weight gradient: its microbatch released, the batch's weight
    /// gradients there from now on.
    pub(super) fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.splits {
            self.awaiting = self.awaiting.saturating_sub(1);
        }
        self.gradient = true;
        self.note_gradients();
    }

    /// An input gradient: on a stage that splits its backward, its microbatch now awaits
    /// its weight gradient (and holds what that keeps, not its whole forward's state).
    pub(super) fn input_gradient(&mut self) {
        if self.splits {
            self.awaiting += 1;
            self.note_gradients();
        }
    }

    /// The update took the batch's gradients.
    pub(super) fn drop_gradient(&mut self) {
        self.gradient = false;
    }

    /// The step left its update for later (`ready`: when its all-reduce is done): the
    /// batch's gradients stay held, with the update, until it is applied.
    pub(super) fn defer_update(&mut self, t: u64, ready: f64) {
        self.gradient = false;
        self.pending.push((t, ready));
        self.note_gradients();
    }

    /// Records what it holds now: its whole and awaiting microbatches and the batches'
    /// gradients it holds (its own, and a deferred update's in `pending`).
    fn note_gradients(&mut self) {
        let held = usize::from(self.gradient) + self.pending.len();
        let now = (self.in_flight.saturating_sub(self.awaiting), self.awaiting, held);
        let covers = |a: &(u64, u64, usize), b: &(u64, u64, usize)| a.0 >= b.0 && a.1 >= b.1 && a.2 >= b.2;
        if !self.held.iter().any(|h| covers(h, &now)) {
            self.held.retain(|h| !covers(&now, h));
            self.held.push(now);
        }
    }

    /// What it ended with, for [`report`]: last busy when its stream, links or all-reduce
    /// channel last were.
    pub(super) fn end(&self) -> StageEnd {
        StageEnd { busy: self.busy, peak_in_flight: self.peak_in_flight, held: self.held.clone(), last: self.free.max(self.fwd_link_free).max(self.bwd_link_free).max(self.net_free) }
    }
}

/// The replicas' all-reduce per stage and step (the tied-weight sums are apart: they run
/// on the stream after the stages meet, [`Meetings`]).
fn allreduce_per_stage(setup: &SimSetup) -> Vec<f64> {
    setup.stages.iter().map(|c| setup.allreduce.seconds(c.grad_bytes, setup.w)).collect()
}

/// Where the stages tied by shared weights meet at each step: a stage's step waits until
/// every stage of its component (the stages linked through [`SimSetup::tied_groups`]; a
/// stage tied to none is a component of its own) has reached the same step, then sums the
/// tied gradients. Synchronous updates wait there on the stream; 2BW's deferred ones
/// ([`defers_updates`]) wait only before the forward that needs the update.
pub(super) struct Meetings {
    component: Vec<usize>,
    members: Vec<Vec<usize>>,
    /// `arrived[s][t]`: when stage `s` reached step `t` (NaN: not yet).
    arrived: Vec<Vec<f64>>,
}

impl Meetings {
    pub(super) fn new(setup: &SimSetup) -> Result<Meetings, SimError> {
        let d = setup.stages.len();
        // Union-find over the groups' stages.
        let mut parent: Vec<usize> = (0..d).collect();
        fn root(parent: &mut [usize], mut x: usize) -> usize {
            while parent[x] != x {
                parent[x] = parent[parent[x]];
                x = parent[x];
            }
            x
        }
        for g in &setup.tied_groups {
            if let Some(&bad) = g.iter().find(|&&x| x >= d) {
                return Err(SimError::Setup(format!("a tied group names stage {bad} of {d}")));
            }
            for pair in g.windows(2) {
                let (a, b) = (root(&mut parent, pair[0]), root(&mut parent, pair[1]));
                parent[a] = b;
            }
        }
        let mut component = vec![0; d];
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut index_of_root = vec![usize::MAX; d];
        for (s, comp) in component.iter_mut().enumerate() {
            let r = root(&mut parent, s);
            if index_of_root[r] == usize::MAX {
                index_of_root[r] = members.len();
                members.push(Vec::new());
            }
            members[index_of_root[r]].push(s);
            *comp = index_of_root[r];
        }
        let arrived = vec![vec![f64::NAN; setup.batches]; d];
        Ok(Meetings { component, members, arrived })
    }

    /// Stage `s` reaches step `t` at `at` (a later call for the same step keeps the first
    /// time); [`Meetings::met`] then.
    pub(super) fn arrive(&mut self, s: usize, t: u64, at: f64) -> Option<f64> {
        let slot = &mut self.arrived[s][t as usize];
        if slot.is_nan() {
            *slot = at;
        }
        self.met(s, t)
    }

    /// When every stage of `s`'s component has reached step `t`, if they all have.
    pub(super) fn met(&self, s: usize, t: u64) -> Option<f64> {
        self.members[self.component[s]].iter().map(|&x| self.arrived[x][t as usize]).try_fold(f64::NEG_INFINITY, |m, a| (!a.is_nan()).then(|| m.max(a)))
    }
}

/// Per stage, whether its updates are deferred: under 2BW a stage with replicas (`w > 1`)
/// or tied to a stage before it begins the step's sums and goes on, applying the update
/// once they are done, just before the first forward that needs its version, as both of
/// the runtime's transports do ([`UpdateRule::defers_update`]). The first stage of a tied
/// group, which reaches the step last, and a stage that sums with nobody update at the
/// step. (Where the update needs an
/// answer all stages agree on, `--clip-norm` and the like, the runtime makes it after the
/// next step's last forward instead, and under fp16 at the step; a replay knows no
/// training options.)
fn defers_updates(setup: &SimSetup, rule: UpdateRule) -> Vec<bool> {
    let tied_to_an_earlier_stage = |s: usize| setup.tied_groups.iter().any(|g| g.contains(&s) && g.iter().any(|&x| x < s));
    (0..setup.stages.len()).map(|s| rule.defers_update(setup.w, tied_to_an_earlier_stage(s))).collect()
}

/// Arrival times for each stage's inputs, in a window of `2m + 2d + 2` slots.
fn arrivals(setup: &SimSetup) -> Vec<Arrivals> {
    let window = 2 * setup.m as usize + 2 * setup.stages.len() + 2;
    (0..setup.stages.len()).map(|_| Arrivals::new(window)).collect()
}

/// The intervals a replay keeps for its trace (none unless asked): stage = trace row,
/// times in µs.
pub(super) struct Events {
    keep: bool,
    pub(super) list: Vec<TraceEvent>,
}

impl Events {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record(&mut self, kind: TraceKind, stage: usize, start: f64, dur: f64, mb: Option<u64>, version: u64, step: u64) {
        if self.keep {
            self.list.push(TraceEvent { kind, stage, start_us: start * 1e6, dur_us: dur * 1e6, microbatch: mb, version, step });
        }
    }
}

/// What each stage ended with, for [`report`].
pub(super) struct StageEnd {
    busy: f64,
    peak_in_flight: u64,
    /// [`StageState`]'s holdings.
    held: Vec<(u64, u64, usize)>,
    /// When its stream, links and all-reduce channel were last busy.
    last: f64,
}

/// A stage's peak memory by its costs, the largest over what it held at each moment
/// ([`StageState`]'s holdings) and while it updates (as the planner's
/// [`crate::partition::PipelineMemory`]): its whole microbatches and those awaiting their
/// weight gradients; with its gradient (at least one microbatch then: the backward that
/// makes it frees its microbatch's activations as it goes), without it, or, where a
/// deferred update held its gradients into the next batch, with one gradient more.
fn peak_memory(c: &StageCost, x: &StageEnd) -> f64 {
    let base = c.memory_one - c.memory_per_extra;
    let holding = |&(whole, awaiting, gradients): &(u64, u64, usize)| {
        let whole = if gradients > 0 && whole + awaiting == 0 { 1 } else { whole };
        base + c.memory_per_extra * whole as f64 + c.memory_per_awaiting * awaiting as f64 + c.gradient_bytes * (gradients as f64 - 1.0)
    };
    x.held.iter().map(holding).fold(c.memory_at_update, f64::max)
}

/// The report both engines give: steady-state rate between the ends of the first and the
/// last batch, bubbles over the whole replay.
pub(super) fn report(setup: &SimSetup, ends: &[StageEnd], batch_end: &[f64], allreduce: &[f64], events: Vec<TraceEvent>) -> Simulation {
    let (d, w) = (setup.stages.len(), setup.w);
    // The replay starts at 0 (the first stage's first forward).
    let makespan = ends.iter().map(|x| x.last).fold(0.0, f64::max);
    let n = setup.batches;
    let samples_per_batch = (setup.b * setup.m * w as u64) as f64;
    let batch_s = if n >= 2 { (batch_end[n - 1] - batch_end[0]) / (n - 1) as f64 } else { batch_end[0] };
    let samples_per_s = if batch_s > 0.0 { samples_per_batch / batch_s } else { f64::INFINITY };
    let stages: Vec<StageReport> = ends
        .iter()
        .zip(&setup.stages)
        .zip(allreduce)
        .map(|((x, c), &ar)| StageReport {
            busy_s: x.busy,
            bubble_fraction: if makespan > 0.0 { (1.0 - x.busy / makespan).clamp(0.0, 1.0) } else { 0.0 },
            peak_in_flight: x.peak_in_flight,
            peak_memory: peak_memory(c, x),
            allreduce_s: ar + c.tied_sync_s,
        })
        .collect();
    let bubble_fraction = stages.iter().map(|s| s.bubble_fraction).sum::<f64>() / d as f64;
    Simulation {
        scheme: setup.scheme,
        w,
        d,
        b: setup.b,
        m: setup.m,
        batches: n,
        samples_per_s,
        batch_s,
        makespan_s: makespan,
        stages,
        bubble_fraction,
        events,
    }
}
