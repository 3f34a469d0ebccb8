//! The [`Simulation`] analysis: a discrete-event replay of one training run on a cluster,
//! for `pipewright simulate`.
//!
//! Each stage runs the operation order the runtime's executor runs
//! ([`pipewright_core::schedule::stage_ops`], the same generator, not a formula), with
//! compute times per stage from the cost model (or a measured profile) and transfers from
//! link bandwidth and latency. The replicas of a pipeline are identical, so one pipeline is
//! replayed; its links are the slowest any replica has (replicas meet at every update),
//! and each stage's gradient all-reduce among its `w` replicas is timed as the planner
//! times it ([`AllReduce::seconds`]: a ring, or rings inside and across servers).
//!
//! # Timing rules
//! - A stage runs its operations in order on one compute stream; an operation starts when
//!   the stream is free and its input has arrived: a forward needs the previous stage's
//!   activation, a backward the next stage's gradient (the last stage's backward follows
//!   its own forward).
//! - A send occupies the producer's stream for [`StageCost::send_s`] (0 from the cost
//!   model), then waits for its link (one per boundary and direction) to be free and takes
//!   `latency + bytes / bandwidth` on it, while the stream goes on.
//! - `Step(t)` of Flush, GPipe and the baselines: the all-reduce of batch `t`'s gradients
//!   (with `w > 1`, and the tied-weight sync between stages), then the optimizer, both on
//!   the stage's critical path, as the flush requires.
//! - `Step(t)` of 2BW with `w > 1`: the all-reduce starts on the stage's network channel
//!   and the stream goes on; the update that creates version `t + 1` is applied when the
//!   all-reduce is done, just before the first forward that needs that version (batch
//!   `t + 2`, [`UpdateRule::version_for`]). That is the overlap 2BW's one-step delay
//!   allows, and the planner's `max(T, AR / m)` assumes. (pipewright's executor today
//!   all-reduces inside the step; the simulator models the schedule, not that shortcut.)
//!   With `w = 1` the update runs where the step is, as the executor runs it.
//! - Stages tied by a shared weight ([`SimSetup::tied_groups`]) sum its gradient at every
//!   step: a stage's `Step(t)` waits until every stage tied to it has reached `Step(t)`,
//!   then takes [`StageCost::tied_sync_s`] on the stream, as the runtime's step does. 2BW
//!   with `w > 1` defers that too: the update waits for the meeting and the sum just
//!   before the forward that needs it.
//! - Inter-layer model parallelism without pipelining runs each microbatch's forward and
//!   backward through all stages before the next one enters ([`model_parallel_ops`]).
//! - With [`SimSetup::host`]'s cores below the `w * d` threads, the stages' threads share
//!   the host's cores: every stage's work progresses at `min(1, C / (w n))` while `n`
//!   stages have work (`simulate/shared.rs`, an event loop running the same rules).
//!
//! # Reports
//! Throughput is measured between the ends of the first and the last simulated batch
//! (the steady state; the first batch's warm-up is excluded); per stage the busy time
//! (forward, recompute, backward, optimizer), the bubble fraction `1 - busy / span` over
//! the whole run (as `pipewright trace-svg` computes it from a real trace), the most
//! microbatches it held at once and the memory that implies.

use pipewright_core::schedule::{stage_ops, Op};
use pipewright_core::{Schedule, Scheme, UpdateRule};
use pipewright_core::timeline::{TraceEvent, TraceKind};
use serde::Serialize;

use crate::machine::{AllReduce, Crowding, DurationSpread, HostCores, Link};

mod shared;

pub use shared::dedicated_durations;

/// One stage's work per microbatch, and what it holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageCost {
    pub forward_s: f64,
    pub backward_s: f64,
    /// Forward work redone before the backward (recomputation), seconds.
    pub recompute_s: f64,
    /// The weight update, seconds.
    pub optimizer_s: f64,
    /// Bytes sent to the next stage per microbatch (the activations crossing the cut; the
    /// gradient coming back has the same size).
    pub send_bytes: f64,
    /// Seconds the stage's own stream spends handing each message to its link (copies,
    /// serialisation): 0 for a GPU's asynchronous copies; measured from a real run's trace
    /// by `simulate --stage-times` (the CPU executor's sends take time on the stage's thread).
    #[serde(default)]
    pub send_s: f64,
    /// Seconds the stage's stream spends after each backward (and the send of its
    /// gradient) on work no traced operation covers: the runtime releasing the
    /// microbatch's graph and activations. It takes the stage's core but is not busy time,
    /// as in a real run's trace (measured by `pipewright profile` as `after_backward_ms`,
    /// or from a real run's trace by `simulate --stage-times`; 0 otherwise).
    #[serde(default)]
    pub after_backward_s: f64,
    /// Gradient bytes all-reduced among the stage's replicas per step.
    pub grad_bytes: f64,
    /// Seconds of the tied-weight gradient sync between stages per step.
    pub tied_sync_s: f64,
    /// Memory with one microbatch in flight, and what each further one adds.
    pub memory_one: f64,
    pub memory_per_extra: f64,
}

/// What to replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimSetup {
    pub scheme: Scheme,
    /// Replicas of the pipeline.
    pub w: usize,
    /// Samples per microbatch.
    pub b: u64,
    /// Microbatches per batch and replica.
    pub m: u64,
    /// Batches (optimizer steps) to replay.
    pub batches: usize,
    pub stages: Vec<StageCost>,
    /// Link `s` joins stage `s` and `s + 1` (`d - 1` of them).
    pub links: Vec<Link>,
    /// How each stage's replicas all-reduce ([`crate::cluster::Cluster::allreduce`]: a
    /// flat ring, or rings inside and across servers), timed by [`AllReduce::seconds`] as
    /// the planner times it.
    pub allreduce: AllReduce,
    /// Keep every interval for a trace.
    pub record: bool,
    /// The stages are threads of one process on a CPU host, one compute thread per stage
    /// and replica (`w * d` in all, the runtime's embedded executor): when they outnumber
    /// its cores, the runnable ones share them (`simulate/shared.rs`). `None`: every
    /// stage has its own device.
    pub host: Option<HostCores>,
    /// Sets of stages that sum a tied weight's gradient at every step
    /// ([`StageCost::tied_sync_s`]): each stage waits there for every stage it is tied to,
    /// directly or through another group, as the runtime's step does.
    pub tied_groups: Vec<Vec<usize>>,
    /// How the operations' times vary from one microbatch to the next; `None`: every
    /// operation takes its stage's time.
    pub spread: Option<DurationSpread>,
}

/// Replays [`simulate`] averages when the operations' times spread.
pub const SPREAD_DRAWS: u64 = 16;

impl SimSetup {
    /// Stage `s`'s forward, recompute and backward seconds on microbatch `mb`: its
    /// [`StageCost`] times, each times its draw from the [`DurationSpread`] when there is one.
    fn op_seconds(&self, s: usize, mb: u64) -> [f64; 3] {
        let c = &self.stages[s];
        let times = [c.forward_s, c.recompute_s, c.backward_s];
        match &self.spread {
            Some(spread) => std::array::from_fn(|k| times[k] * spread.factor(s, mb, k as u64)),
            None => times,
        }
    }
}

/// One stage's share of the replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageReport {
    pub busy_s: f64,
    pub bubble_fraction: f64,
    /// Most microbatches between their forward and their backward at once.
    pub peak_in_flight: u64,
    pub peak_memory: f64,
    /// All-reduce seconds per step.
    pub allreduce_s: f64,
}

/// The result of a replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Simulation {
    pub scheme: Scheme,
    pub w: usize,
    pub d: usize,
    pub b: u64,
    pub m: u64,
    pub batches: usize,
    /// Steady-state samples per second over all replicas.
    pub samples_per_s: f64,
    /// Seconds per batch in the steady state.
    pub batch_s: f64,
    /// From the first start to the last end.
    pub makespan_s: f64,
    pub stages: Vec<StageReport>,
    /// The mean of the stages' bubble fractions.
    pub bubble_fraction: f64,
    /// The intervals, when recorded: stage = trace row, times in µs.
    #[serde(skip)]
    pub events: Vec<TraceEvent>,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimError {
    #[error("invalid simulation: {0}")]
    Setup(String),
    #[error("the schedule deadlocked: stage {stage} waits at operation {op} for an input that never comes")]
    Deadlock { stage: usize, op: String },
}

/// The operation order of inter-layer model parallelism without pipelining: every stage
/// runs forward then backward of each microbatch in turn (the dependencies keep one
/// microbatch in the pipeline at a time), then the step.
pub fn model_parallel_ops(m: usize, batches: usize) -> Vec<Op> {
    let m64 = m as u64;
    let mut ops = Vec::with_capacity(batches * (2 * m + 1));
    for t in 0..batches as u64 {
        for i in 0..m64 {
            ops.push(Op::Forward(t * m64 + i));
            ops.push(Op::Backward(t * m64 + i));
        }
        ops.push(Op::Step(t));
    }
    ops
}

/// The order stage `stage` of `depth` runs under `scheme`: the runtime's schedule for the
/// three schedules (data and tensor parallelism run as Flush with one stage), or
/// [`model_parallel_ops`].
pub fn scheme_ops(scheme: Scheme, stage: usize, depth: usize, m: usize, batches: usize) -> Result<Vec<Op>, SimError> {
    let schedule = match scheme {
        Scheme::ModelParallel => return Ok(model_parallel_ops(m, batches)),
        // Data and tensor parallelism run one stage per group: Flush's order with d = 1
        // (tensor parallelism's all-reduces are inside its forward and backward times).
        Scheme::DataParallel | Scheme::TensorParallel => Schedule::Flush,
        s => s.schedule().unwrap_or(Schedule::Flush),
    };
    stage_ops(schedule, stage, depth, m, batches).map_err(SimError::Setup)
}

/// Arrival times by microbatch in a window of slots reused modulo its length (a producer
/// is never more than a batch and a pipeline ahead of its consumer).
struct Arrivals {
    slots: Vec<(u64, f64)>,
}

impl Arrivals {
    fn new(window: usize) -> Arrivals {
        Arrivals { slots: vec![(u64::MAX, 0.0); window.max(1)] }
    }

    fn put(&mut self, mb: u64, at: f64) -> Result<(), SimError> {
        let n = self.slots.len();
        let slot = &mut self.slots[(mb % n as u64) as usize];
        if slot.0 != u64::MAX {
            return Err(SimError::Setup(format!("microbatch {mb} arrived while microbatch {} still waited in its slot", slot.0)));
        }
        *slot = (mb, at);
        Ok(())
    }

    /// When microbatch `mb` arrives, if it has been sent.
    fn peek(&self, mb: u64) -> Option<f64> {
        let slot = &self.slots[(mb % self.slots.len() as u64) as usize];
        (slot.0 == mb).then_some(slot.1)
    }

    fn take(&mut self, mb: u64) -> Option<f64> {
        let n = self.slots.len();
        let slot = &mut self.slots[(mb % n as u64) as usize];
        (slot.0 == mb).then(|| {
            slot.0 = u64::MAX;
            slot.1
        })
    }
}

struct StageState {
    ops: Vec<Op>,
    pc: usize,
    free: f64,
    busy: f64,
    in_flight: u64,
    peak_in_flight: u64,
    /// Link to the next stage (forward) and to the previous one (backward) free from.
    fwd_link_free: f64,
    bwd_link_free: f64,
    /// 2BW's all-reduce channel free from, and updates waiting for their version's turn:
    /// (step, all-reduce done).
    net_free: f64,
    pending: Vec<(u64, f64)>,
    /// Version the stage's weights are at (updates applied).
    version: u64,
}

impl StageState {
    /// Applies stage `s`'s deferred update of step `t` (its all-reduce done at `ar_done`)
    /// once the stages tied to it have met and summed (they have, by the callers' check).
    fn apply_deferred(&mut self, s: usize, t: u64, ar_done: f64, cost: &StageCost, meetings: &Meetings, events: &mut Events) {
        let summed = meetings.met(s, t).map_or(ar_done, |met| {
            if cost.tied_sync_s > 0.0 {
                events.record(TraceKind::AllReduce, s, met, cost.tied_sync_s, None, t + 1, t);
            }
            ar_done.max(met + cost.tied_sync_s)
        });
        let start = self.free.max(summed);
        events.record(TraceKind::Optimizer, s, start, cost.optimizer_s, None, t + 1, t);
        self.free = start + cost.optimizer_s;
        self.busy += cost.optimizer_s;
        self.version = t + 1;
    }
}

/// Replays `setup` (see the module docs): stage by stage when every stage has its own
/// device, under processor sharing (`simulate/shared.rs`) when the stages' threads outnumber the
/// host's cores.
pub fn simulate(setup: &SimSetup) -> Result<Simulation, SimError> {
    check(setup)?;
    let Some(spread) = &setup.spread else { return replay(setup) };
    let runs = (0..SPREAD_DRAWS)
        .map(|draw| {
            // The first draw's intervals make the trace.
            let one = SimSetup { record: setup.record && draw == 0, spread: Some(spread.with_draw(draw)), ..setup.clone() };
            replay(&one)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(mean_of(runs))
}

/// The mean of replays of one setup (their rates, times, busy times and bubbles; the
/// most in flight and the peak memory of any), with the first one's intervals.
fn mean_of(mut runs: Vec<Simulation>) -> Simulation {
    let n = runs.len() as f64;
    let mean = |f: &dyn Fn(&Simulation) -> f64| runs.iter().map(f).sum::<f64>() / n;
    let (rate, batch_s, makespan, bubble) = (mean(&|r| r.samples_per_s), mean(&|r| r.batch_s), mean(&|r| r.makespan_s), mean(&|r| r.bubble_fraction));
    let stages: Vec<StageReport> = (0..runs[0].stages.len())
        .map(|k| StageReport {
            busy_s: mean(&|r| r.stages[k].busy_s),
            bubble_fraction: mean(&|r| r.stages[k].bubble_fraction),
            peak_in_flight: runs.iter().map(|r| r.stages[k].peak_in_flight).max().unwrap_or(0),
            peak_memory: runs.iter().map(|r| r.stages[k].peak_memory).fold(0.0, f64::max),
            allreduce_s: runs[0].stages[k].allreduce_s,
        })
        .collect();
    let first = runs.swap_remove(0);
    Simulation { samples_per_s: rate, batch_s, makespan_s: makespan, bubble_fraction: bubble, stages, ..first }
}

/// One replay, by the engine the host calls for.
fn replay(setup: &SimSetup) -> Result<Simulation, SimError> {
    let threads = setup.w * setup.stages.len();
    match setup.host {
        Some(host) if host.cores < threads || host.crowding.slows(threads, host.cores) => shared::replay(setup, host),
        _ => replay_dedicated(setup),
    }
}

/// Refuses setups no replay can run.
fn check(setup: &SimSetup) -> Result<(), SimError> {
    let d = setup.stages.len();
    let (m, w) = (setup.m as usize, setup.w);
    if d == 0 || m == 0 || w == 0 || setup.batches == 0 {
        return Err(SimError::Setup(format!("need at least one stage, replica, microbatch and batch (d = {d}, w = {w}, m = {m}, batches = {})", setup.batches)));
    }
    if setup.links.len() + 1 != d {
        return Err(SimError::Setup(format!("{d} stages need {} links, got {}", d - 1, setup.links.len())));
    }
    if setup.scheme == Scheme::DataParallel && d != 1 {
        return Err(SimError::Setup(format!("data parallelism runs one stage per worker, not {d}")));
    }
    if let Some(host) = setup.host {
        if host.cores == 0 {
            return Err(SimError::Setup("the host's CPU cores must be at least 1".into()));
        }
        if !host.time_slice_s.is_finite() || host.time_slice_s < 0.0 {
            return Err(SimError::Setup(format!("the time slice must be a non-negative number of seconds, not {}", host.time_slice_s)));
        }
        if !host.tick_s.is_finite() || host.tick_s < 0.0 {
            return Err(SimError::Setup(format!("the scheduler's tick must be a non-negative number of seconds, not {}", host.tick_s)));
        }
        let Crowding { at_cores, at_twice } = host.crowding;
        if !(at_cores.is_finite() && at_twice.is_finite() && at_cores >= 1.0 && at_twice >= 1.0) {
            return Err(SimError::Setup(format!("a host's crowding must slow threads by a finite factor of at least 1, not {at_cores} and {at_twice}")));
        }
    }
    if setup.scheme == Scheme::TensorParallel && d != 1 {
        return Err(SimError::Setup(format!("tensor parallelism runs one stage per group of GPUs, not {d}")));
    }
    let bad = |x: f64| !x.is_finite() || x < 0.0;
    for (s, c) in setup.stages.iter().enumerate() {
        if [c.forward_s, c.backward_s, c.recompute_s, c.optimizer_s, c.send_s, c.send_bytes, c.grad_bytes, c.tied_sync_s].into_iter().any(bad) {
            return Err(SimError::Setup(format!("stage {s}: times and sizes must be finite and non-negative: {c:?}")));
        }
    }
    if setup.links.iter().chain(&setup.allreduce.links()).any(|l| l.bandwidth.is_nan() || l.bandwidth <= 0.0 || bad(l.latency_s)) {
        return Err(SimError::Setup("every link needs a positive bandwidth and a non-negative latency".into()));
    }
    Ok(())
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
/// (`w > 1`, [`defers_updates`]) wait only before the forward that needs the update.
struct Meetings {
    component: Vec<usize>,
    members: Vec<Vec<usize>>,
    /// `arrived[s][t]`: when stage `s` reached step `t` (NaN: not yet).
    arrived: Vec<Vec<f64>>,
}

impl Meetings {
    fn new(setup: &SimSetup) -> Result<Meetings, SimError> {
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
    fn arrive(&mut self, s: usize, t: u64, at: f64) -> Option<f64> {
        let slot = &mut self.arrived[s][t as usize];
        if slot.is_nan() {
            *slot = at;
        }
        self.met(s, t)
    }

    /// When every stage of `s`'s component has reached step `t`, if they all have.
    fn met(&self, s: usize, t: u64) -> Option<f64> {
        self.members[self.component[s]].iter().map(|&x| self.arrived[x][t as usize]).try_fold(f64::NEG_INFINITY, |m, a| (!a.is_nan()).then(|| m.max(a)))
    }
}

/// Whether `setup`'s updates are deferred: 2BW with replicas starts the step's sums (the
/// replicas' all-reduce and the tied stages' meeting) and goes on, applying the update
/// once they are done, just before the first forward that needs its version. With one
/// replica the update runs at the step, as the executor runs it.
fn defers_updates(setup: &SimSetup) -> bool {
    setup.scheme == Scheme::TwoBw && setup.w > 1
}

/// Arrival times for each stage's inputs, in a window of `2m + 2d + 2` slots.
fn arrivals(setup: &SimSetup) -> Vec<Arrivals> {
    let window = 2 * setup.m as usize + 2 * setup.stages.len() + 2;
    (0..setup.stages.len()).map(|_| Arrivals::new(window)).collect()
}

/// The intervals a replay keeps for its trace (none unless asked): stage = trace row,
/// times in µs.
struct Events {
    keep: bool,
    list: Vec<TraceEvent>,
}

impl Events {
    #[allow(clippy::too_many_arguments)]
    fn record(&mut self, kind: TraceKind, stage: usize, start: f64, dur: f64, mb: Option<u64>, version: u64, step: u64) {
        if self.keep {
            self.list.push(TraceEvent { kind, stage, start_us: start * 1e6, dur_us: dur * 1e6, microbatch: mb, version, step });
        }
    }
}

/// What each stage ended with, for [`report`].
struct StageEnd {
    busy: f64,
    peak_in_flight: u64,
    /// When its stream, links and all-reduce channel were last busy.
    last: f64,
}

/// The report both engines give: steady-state rate between the ends of the first and the
/// last batch, bubbles over the whole replay.
fn report(setup: &SimSetup, ends: &[StageEnd], batch_end: &[f64], allreduce: &[f64], events: Vec<TraceEvent>) -> Simulation {
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
            peak_memory: c.memory_one + c.memory_per_extra * x.peak_in_flight.saturating_sub(1) as f64,
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

/// The replay when every stage owns its device: each stage runs as far as its inputs allow,
/// in turn, until all are done (no global clock is needed, since stages never slow each
/// other down).
fn replay_dedicated(setup: &SimSetup) -> Result<Simulation, SimError> {
    let d = setup.stages.len();
    let m = setup.m as usize;
    let two_bw = setup.scheme == Scheme::TwoBw;
    let rule = if two_bw { UpdateRule::TwoBw } else { UpdateRule::Vanilla };
    let allreduce = allreduce_per_stage(setup);
    let mut meetings = Meetings::new(setup)?;
    let deferred = defers_updates(setup);
    let mut st = Vec::with_capacity(d);
    for s in 0..d {
        st.push(StageState {
            ops: scheme_ops(setup.scheme, s, d, m, setup.batches)?,
            pc: 0,
            free: 0.0,
            busy: 0.0,
            in_flight: 0,
            peak_in_flight: 0,
            fwd_link_free: 0.0,
            bwd_link_free: 0.0,
            net_free: 0.0,
            pending: Vec::new(),
            version: 0,
        });
    }
    let (mut acts, mut grads) = (arrivals(setup), arrivals(setup));
    let mut batch_end = vec![0.0f64; setup.batches];
    let mut events = Events { keep: setup.record, list: Vec::new() };
    let m64 = setup.m;
    loop {
        let mut progressed = false;
        let mut done = true;
        for s in 0..d {
            let cost = &setup.stages[s];
            while let Some(&op) = st[s].ops.get(st[s].pc) {
                done = false;
                match op {
                    Op::Forward(i) => {
                        // 2BW: updates waiting for the version this microbatch needs, once
                        // their stages have met.
                        let need = rule.version_for(i, m64);
                        if st[s].pending.iter().any(|p| p.0 < need && meetings.met(s, p.0).is_none()) {
                            break;
                        }
                        let ready = if s == 0 {
                            Some(0.0)
                        } else {
                            acts[s].take(i)
                        };
                        let Some(ready) = ready else { break };
                        let state = &mut st[s];
                        while state.version < need {
                            let Some(pos) = state.pending.iter().position(|p| p.0 == state.version) else { break };
                            let (t, ar_done) = state.pending.remove(pos);
                            state.apply_deferred(s, t, ar_done, cost, &meetings, &mut events);
                        }
                        let start = state.free.max(ready);
                        let [forward_s, _, _] = setup.op_seconds(s, i);
                        let end = start + forward_s;
                        events.record(TraceKind::Forward, s, start, forward_s, Some(i), need, i / m64);
                        state.free = end;
                        state.busy += forward_s;
                        state.in_flight += 1;
                        state.peak_in_flight = state.peak_in_flight.max(state.in_flight);
                        if s + 1 < d {
                            let link = setup.links[s];
                            state.free = end + cost.send_s;
                            let t0 = state.free.max(state.fwd_link_free);
                            let dt = link.seconds(cost.send_bytes);
                            state.fwd_link_free = t0 + dt;
                            events.record(TraceKind::Send, s, end, t0 + dt - end, Some(i), need, i / m64);
                            acts[s + 1].put(i, t0 + dt)?;
                        }
                    }
                    Op::Backward(i) => {
                        let ready = if s + 1 == d { Some(0.0) } else { grads[s].take(i) };
                        let Some(ready) = ready else { break };
                        let state = &mut st[s];
                        let version = rule.version_for(i, m64);
                        let mut start = state.free.max(ready);
                        let [_, recompute_s, backward_s] = setup.op_seconds(s, i);
                        if recompute_s > 0.0 {
                            events.record(TraceKind::Recompute, s, start, recompute_s, Some(i), version, i / m64);
                            start += recompute_s;
                        }
                        events.record(TraceKind::Backward, s, start, backward_s, Some(i), version, i / m64);
                        let end = start + backward_s;
                        // Two additions, as the shared engine's two segments add them.
                        state.busy += recompute_s;
                        state.busy += backward_s;
                        state.free = end;
                        state.in_flight = state.in_flight.saturating_sub(1);
                        if s > 0 {
                            let link = setup.links[s - 1];
                            state.free = end + cost.send_s;
                            let t0 = state.free.max(state.bwd_link_free);
                            let dt = link.seconds(cost.send_bytes_back(&setup.stages[s - 1]));
                            state.bwd_link_free = t0 + dt;
                            events.record(TraceKind::Send, s, end, t0 + dt - end, Some(i), version, i / m64);
                            grads[s - 1].put(i, t0 + dt)?;
                        }
                        state.free += cost.after_backward_s;
                    }
                    Op::Step(t) => {
                        let ar = allreduce[s];
                        if deferred {
                            // The stream goes on: the all-reduce on the stage's network
                            // channel, the meeting and the update wait for the forward
                            // that needs them.
                            meetings.arrive(s, t, st[s].free);
                            let state = &mut st[s];
                            let start = state.free.max(state.net_free);
                            if ar > 0.0 {
                                events.record(TraceKind::AllReduce, s, start, ar, None, t + 1, t);
                            }
                            state.net_free = start + ar;
                            state.pending.push((t, start + ar));
                            batch_end[t as usize] = batch_end[t as usize].max(start + ar);
                        } else {
                            // Tied stages meet, then sum the tied gradients on the stream.
                            let Some(met) = meetings.arrive(s, t, st[s].free) else { break };
                            let state = &mut st[s];
                            if cost.tied_sync_s > 0.0 {
                                events.record(TraceKind::AllReduce, s, met, cost.tied_sync_s, None, t + 1, t);
                            }
                            state.free = met + cost.tied_sync_s;
                            let start = state.free;
                            if ar > 0.0 {
                                events.record(TraceKind::AllReduce, s, start, ar, None, t + 1, t);
                            }
                            events.record(TraceKind::Optimizer, s, start + ar, cost.optimizer_s, None, t + 1, t);
                            state.free = start + ar + cost.optimizer_s;
                            state.busy += cost.optimizer_s;
                            state.version = t + 1;
                            batch_end[t as usize] = batch_end[t as usize].max(state.free);
                        }
                    }
                }
                st[s].pc += 1;
                progressed = true;
            }
        }
        if done {
            break;
        }
        if !progressed {
            let s = (0..d).find(|&s| st[s].pc < st[s].ops.len()).unwrap_or(0);
            return Err(SimError::Deadlock { stage: s, op: format!("{:?}", st[s].ops[st[s].pc]) });
        }
    }
    // Updates still waiting at the end are applied then.
    for (s, state) in st.iter_mut().enumerate() {
        let cost = &setup.stages[s];
        state.pending.sort_by_key(|p| p.0);
        for (t, ar_done) in std::mem::take(&mut state.pending) {
            // Every stage has reached every step by now.
            state.apply_deferred(s, t, ar_done, cost, &meetings, &mut events);
        }
    }
    let ends: Vec<StageEnd> = st
        .iter()
        .map(|x| StageEnd { busy: x.busy, peak_in_flight: x.peak_in_flight, last: x.free.max(x.fwd_link_free).max(x.bwd_link_free).max(x.net_free) })
        .collect();
    Ok(report(setup, &ends, &batch_end, &allreduce, events.list))
}

impl StageCost {
    /// Bytes of the gradient this stage sends back to `prev`: the activations `prev` sent.
    fn send_bytes_back(&self, prev: &StageCost) -> f64 {
        prev.send_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{allreduce_seconds, default_time_slice};

    fn equal(d: usize, f: f64, b: f64) -> Vec<StageCost> {
        vec![StageCost { forward_s: f, backward_s: b, recompute_s: 0.0, optimizer_s: 0.0, send_s: 0.0, after_backward_s: 0.0, send_bytes: 0.0, grad_bytes: 0.0, tied_sync_s: 0.0, memory_one: 0.0, memory_per_extra: 0.0 }; d]
    }

    fn setup(scheme: Scheme, d: usize, m: u64, batches: usize) -> SimSetup {
        let link = Link { bandwidth: 1e9, latency_s: 0.0 };
        SimSetup { scheme, w: 1, b: 1, m, batches, stages: equal(d, 1.0, 2.0), links: vec![link; d - 1], allreduce: AllReduce::ring(link), record: true, host: None, tied_groups: Vec::new(), spread: None }
    }

    /// Per stage, the compute operations of the trace in time order.
    fn order(sim: &Simulation, stage: usize) -> Vec<Op> {
        let mut ev: Vec<&TraceEvent> = sim.events.iter().filter(|e| e.stage == stage && matches!(e.kind, TraceKind::Forward | TraceKind::Backward | TraceKind::Optimizer)).collect();
        ev.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
        ev.iter()
            .map(|e| match e.kind {
                TraceKind::Forward => Op::Forward(e.microbatch.unwrap_or(0)),
                TraceKind::Backward => Op::Backward(e.microbatch.unwrap_or(0)),
                _ => Op::Step(e.step),
            })
            .collect()
    }

    #[test]
    fn every_stage_runs_the_runtimes_order() {
        for schedule in Schedule::ALL.iter().copied() {
            for (d, m) in [(2, 2), (3, 4), (4, 4), (4, 6)] {
                let sim = simulate(&setup(schedule.into(), d, m, 3)).unwrap();
                for s in 0..d {
                    assert_eq!(order(&sim, s), stage_ops(schedule, s, d, m as usize, 3).unwrap(), "{schedule} d={d} m={m} stage {s}");
                }
            }
        }
    }

    #[test]
    fn flush_and_gpipe_bubbles_match_the_closed_form() {
        // Equal stages, free links: one batch takes (m + d - 1)(f + b), so each stage idles
        // (d - 1) / (m + d - 1) of it: efficiency m / (m + d - 1).
        for scheme in [Scheme::Flush, Scheme::GPipe] {
            for (d, m) in [(2u64, 2u64), (4, 4), (4, 8), (8, 3), (3, 16)] {
                if scheme == Scheme::Flush && m < d {
                    continue;
                }
                let sim = simulate(&setup(scheme, d as usize, m, 1)).unwrap();
                let expect = (m + d - 1) as f64 * 3.0;
                assert!((sim.makespan_s - expect).abs() < 1e-9, "{scheme} d={d} m={m}: {} != {expect}", sim.makespan_s);
                for st in &sim.stages {
                    let bubble = (d - 1) as f64 / (m + d - 1) as f64;
                    assert!((st.bubble_fraction - bubble).abs() < 1e-9, "{scheme} d={d} m={m}: {} != {bubble}", st.bubble_fraction);
                }
                // Several batches: every one pays the same bubble.
                let sim = simulate(&setup(scheme, d as usize, m, 5)).unwrap();
                assert!((sim.batch_s - expect).abs() < 1e-9, "{scheme} d={d} m={m}: batch {} != {expect}", sim.batch_s);
            }
        }
    }

    #[test]
    fn two_bw_reaches_a_steady_state_without_bubbles() {
        // No flush: after the warm-up every batch takes m (f + b), and over n batches the
        // bubble is the one warm-up and cool-down, (d - 1) / (n m + d - 1).
        for (d, m, n) in [(2usize, 2u64, 6usize), (4, 4, 5), (4, 8, 3), (8, 8, 4)] {
            let sim = simulate(&setup(Scheme::TwoBw, d, m, n)).unwrap();
            assert!((sim.batch_s - m as f64 * 3.0).abs() < 1e-9, "d={d} m={m}: batch {}", sim.batch_s);
            assert!((sim.samples_per_s - 1.0 / 3.0).abs() < 1e-12);
            let expect = (n as u64 * m + d as u64 - 1) as f64 * 3.0;
            assert!((sim.makespan_s - expect).abs() < 1e-9, "d={d} m={m}: makespan {} != {expect}", sim.makespan_s);
            for st in &sim.stages {
                let bubble = (d - 1) as f64 / (n as u64 * m + d as u64 - 1) as f64;
                assert!((st.bubble_fraction - bubble).abs() < 1e-9);
            }
            // 1F1B: stage s holds d - s microbatches at once, not the d the planner assumes.
            let held: Vec<u64> = sim.stages.iter().map(|s| s.peak_in_flight).collect();
            assert_eq!(held, (0..d as u64).map(|s| d as u64 - s).collect::<Vec<_>>());
        }
    }

    #[test]
    fn model_parallelism_keeps_one_microbatch_in_the_pipeline() {
        let (d, m) = (4usize, 3u64);
        let sim = simulate(&setup(Scheme::ModelParallel, d, m, 2)).unwrap();
        // Each microbatch crosses all stages forward and back: m d (f + b) per batch.
        assert!((sim.batch_s - (m as usize * d) as f64 * 3.0).abs() < 1e-9, "{}", sim.batch_s);
        assert!(sim.stages.iter().all(|s| s.peak_in_flight == 1));
        for st in &sim.stages {
            assert!((st.bubble_fraction - (1.0 - 1.0 / d as f64)).abs() < 1e-9);
        }
    }

    #[test]
    fn transfers_and_allreduce_cost_time() {
        // Two stages, 1 s of link per microbatch each way: Flush with m = 2 takes
        // F0 (1) + send (1) + F on stage 1 ... the exact value is checked by hand:
        let mut s = setup(Scheme::Flush, 2, 2, 1);
        s.stages.iter_mut().for_each(|c| c.send_bytes = 1e9);
        let sim = simulate(&s).unwrap();
        // Stage 0: F0 [0,1], F1 [1,2]; act 0 arrives at 2, act 1 at 3 (link busy until 2).
        // Stage 1: F0 [2,3], B0 [3,5], F1 [5,6], B1 [6,8]; grad 0 arrives at 6, grad 1 at 9.
        // Stage 0: B0 [6,8], B1 [9,11].
        assert!((sim.makespan_s - 11.0).abs() < 1e-9, "{}", sim.makespan_s);
        // A send that costs the sender 0.5 s of its stream as well: stage 0 runs F0 [0,1],
        // hands it over [1,1.5], F1 [1.5,2.5], hands it over [2.5,3]; act 0 arrives at 2.5,
        // act 1 at 4 (link busy until 2.5, then 1 s). Stage 1: F0 [2.5,3.5], B0 [3.5,5.5],
        // sends [5.5,6] then the link to 7; F1 [6,7], B1 [7,9], sends [9,9.5], link to 10.5.
        // Stage 0: B0 [7,9], B1 [10.5,12.5].
        s.stages.iter_mut().for_each(|c| c.send_s = 0.5);
        let sim = simulate(&s).unwrap();
        assert!((sim.makespan_s - 12.5).abs() < 1e-9, "{}", sim.makespan_s);
        // All-reduce of 1 GB among 4 replicas over 1 GB/s: 2 * 3 * (1/4) = 1.5 s per step.
        assert_eq!(allreduce_seconds(1e9, 4, Link { bandwidth: 1e9, latency_s: 0.0 }), 1.5);
        let mut s = setup(Scheme::Flush, 1, 2, 2);
        s.w = 4;
        s.stages[0].grad_bytes = 1e9;
        let sim = simulate(&s).unwrap();
        assert!((sim.batch_s - (2.0 * 3.0 + 1.5)).abs() < 1e-9, "{}", sim.batch_s);
    }

    #[test]
    fn two_bw_hides_the_allreduce_behind_the_next_batch() {
        // Per batch: m (f + b) = 12 s of compute. An all-reduce of 6 s is hidden entirely.
        // One of 20 s sets the pace and then some: the next all-reduce can only start after
        // the batch's last backward, which the forwards waiting for the update delay (the
        // planner's max(T, AR / m) would say 20 s). Flush pays both in full.
        for (bytes, lo, hi) in [(4e9, 12.0, 12.0), (40e9 / 3.0, 20.0, 24.0)] {
            let mut s = setup(Scheme::TwoBw, 2, 4, 8);
            s.w = 4;
            s.stages.iter_mut().for_each(|c| c.grad_bytes = bytes);
            let sim = simulate(&s).unwrap();
            assert!(sim.batch_s >= lo - 1e-6 && sim.batch_s <= hi + 1e-6, "{bytes}: {}", sim.batch_s);
            let flush = simulate(&SimSetup { scheme: Scheme::Flush, ..s.clone() }).unwrap();
            let ar = s.allreduce.seconds(bytes, 4);
            assert_eq!(ar, allreduce_seconds(bytes, 4, s.allreduce.intra));
            assert!((flush.batch_s - (15.0 + ar)).abs() < 1e-6, "{}", flush.batch_s);
            assert!(flush.batch_s > sim.batch_s);
        }
    }

    /// `sim` with its events in a canonical order (the engines record in different orders).
    fn canonical(mut sim: Simulation) -> Simulation {
        sim.events.sort_by(|a, b| a.stage.cmp(&b.stage).then(a.start_us.total_cmp(&b.start_us)).then(a.kind.name().cmp(b.kind.name())).then(a.microbatch.cmp(&b.microbatch)));
        sim
    }

    /// Setups that exercise every timing rule: each scheme, transfers, hand-offs,
    /// recomputation, optimizer time, unequal stages, all-reduces (2BW's asynchronous one).
    fn varied_setups() -> Vec<SimSetup> {
        let mut out = Vec::new();
        for scheme in Scheme::ALL.iter().copied() {
            let shapes: &[(usize, u64)] = if matches!(scheme, Scheme::DataParallel | Scheme::TensorParallel) { &[(1, 2), (1, 5)] } else { &[(2, 2), (3, 4), (4, 4), (4, 6), (5, 8)] };
            for &(d, m) in shapes {
                for (variant, w) in [(0, 1), (1, 1), (2, 4)] {
                    let mut s = setup(scheme, d, m, 4);
                    s.w = w;
                    if variant > 0 {
                        for (k, c) in s.stages.iter_mut().enumerate() {
                            c.forward_s = 0.7 + 0.3 * k as f64;
                            c.backward_s = 1.9 - 0.2 * k as f64;
                            c.recompute_s = if k % 2 == 0 { 0.4 } else { 0.0 };
                            c.optimizer_s = 0.25;
                            c.send_s = 0.1;
                            c.after_backward_s = 0.05 + 0.02 * k as f64;
                            c.send_bytes = 3e8;
                            c.grad_bytes = 2e9;
                        }
                        s.links.iter_mut().for_each(|l| l.latency_s = 0.01);
                    }
                    if variant == 2 && d >= 3 {
                        // The first and last stages tied (an embedding), and a weight all
                        // of the middle ones read, linked to them through stage 1.
                        s.tied_groups = vec![vec![0, d - 1], (1..d - 1).collect()];
                        s.tied_groups[1].push(0);
                        for (k, c) in s.stages.iter_mut().enumerate() {
                            c.tied_sync_s = 0.05 * (k + 1) as f64;
                        }
                    }
                    out.push(s);
                }
            }
        }
        out
    }

    #[test]
    fn the_runtimes_work_after_a_backward_holds_the_stream_but_is_not_busy() {
        // One stage, m = 2, F = 1 s, B = 2 s and 0.5 s after each backward: F0 [0, 1],
        // B0 [1, 3], then F1 only at 3.5, B1 [4.5, 6.5], the step at 7; busy 6 s of 7,
        // and nothing in the trace for the untraced half-seconds. The same with the stage
        // as a thread on a host of one core.
        let mut s = setup(Scheme::DataParallel, 1, 2, 1);
        s.stages[0].after_backward_s = 0.5;
        for host in [None, Some(HostCores::linux(1)), Some(HostCores::ideal(1))] {
            s.host = host;
            let sim = simulate(&s).unwrap();
            assert!((sim.makespan_s - 7.0).abs() < 1e-9, "{host:?}: {}", sim.makespan_s);
            assert!((sim.stages[0].busy_s - 6.0).abs() < 1e-9, "{host:?}: {}", sim.stages[0].busy_s);
            let starts: Vec<f64> = sim.events.iter().filter(|e| e.kind != TraceKind::Optimizer).map(|e| e.start_us / 1e6).collect();
            assert_eq!(starts, [0.0, 1.0, 3.5, 4.5], "{host:?}");
        }
    }

    #[test]
    fn time_slices_make_a_woken_thread_wait_its_turn() {
        // Two stages on one core, slices of 0.3 s: stage 0 runs F0 over [0, 1] and goes on
        // with F1 on its core (its slice renewed at 0.3, 0.6, 0.9, as nobody waits);
        // stage 1, woken at 1 by F0's activation, waits for that slice to end at 1.2.
        let mut s = setup(Scheme::GPipe, 2, 2, 1);
        s.host = Some(HostCores { cores: 1, time_slice_s: 0.3, tick_s: 0.0, crowding: Crowding::NONE });
        let sim = simulate(&s).unwrap();
        let first = |stage: usize, kind: TraceKind| sim.events.iter().filter(|e| e.stage == stage && e.kind == kind).map(|e| e.start_us).fold(f64::INFINITY, f64::min);
        assert!((first(1, TraceKind::Forward) - 1.2e6).abs() < 1e-3, "{}", first(1, TraceKind::Forward));
        // Ideal sharing starts it at once, at half speed.
        s.host = Some(HostCores::ideal(1));
        let ideal = simulate(&s).unwrap();
        let first_ideal = ideal.events.iter().filter(|e| e.stage == 1 && e.kind == TraceKind::Forward).map(|e| e.start_us).fold(f64::INFINITY, f64::min);
        assert!((first_ideal - 1e6).abs() < 1e-3, "{first_ideal}");
        // One core never idles while work waits: either way a batch takes all the work,
        // 2 stages x 2 microbatches x 3 s.
        for slice in [0.3, 0.0] {
            s.host = Some(HostCores { cores: 1, time_slice_s: slice, tick_s: 0.0, crowding: Crowding::NONE });
            assert!((simulate(&s).unwrap().makespan_s - 12.0).abs() < 1e-9, "slice {slice}");
        }
        // Turns that end on a tick of 0.35 s (at 0.35, 0.70, 1.05: each the first tick at
        // least a slice after the turn began) make stage 1 wait until 1.05 instead.
        s.host = Some(HostCores { cores: 1, time_slice_s: 0.3, tick_s: 0.35, crowding: Crowding::NONE });
        let ticked = simulate(&s).unwrap();
        let first_ticked = ticked.events.iter().filter(|e| e.stage == 1 && e.kind == TraceKind::Forward).map(|e| e.start_us).fold(f64::INFINITY, f64::min);
        assert!((first_ticked - 1.05e6).abs() < 1e-3, "{first_ticked}");
        assert!((ticked.makespan_s - 12.0).abs() < 1e-9, "{}", ticked.makespan_s);
        s.host = Some(HostCores { cores: 1, time_slice_s: 0.3, tick_s: f64::NAN, crowding: Crowding::NONE });
        assert!(simulate(&s).unwrap_err().to_string().contains("the scheduler's tick must be a non-negative"));
        // Linux's default slice: 0.75 ms on one CPU, 1.5 ms on 2 or 3, 3 ms from 8 on.
        assert_eq!([1, 2, 3, 4, 8, 64].map(default_time_slice), [0.75e-3, 1.5e-3, 1.5e-3, 2.25e-3, 3e-3, 3e-3]);
        s.host = Some(HostCores { cores: 1, time_slice_s: -1.0, tick_s: 0.0, crowding: Crowding::NONE });
        assert!(simulate(&s).unwrap_err().to_string().contains("the time slice must be a non-negative"));
    }

    #[test]
    fn crowded_threads_run_slower_than_their_share_of_the_cores() {
        // 1 alone, linear up to `at_cores` at 4 threads, on to `at_twice` at 8, then held.
        let c = Crowding { at_cores: 1.3, at_twice: 1.5 };
        let got = [1, 2, 3, 4, 6, 8, 9, 20].map(|n| c.slowdown(n, 4));
        let want = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.5, 1.5];
        assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{got:?}");
        // Two replicas of one stage always work together: on 2 cores crowded by 1.25
        // each operation takes 1.25 times as long, under time slices or ideal sharing.
        let mut s = setup(Scheme::Flush, 1, 2, 3);
        s.w = 2;
        let alone = simulate(&s).unwrap().samples_per_s;
        for host in [HostCores::linux(2), HostCores::ideal(2)] {
            s.host = Some(host);
            assert_eq!(simulate(&s).unwrap().samples_per_s, alone, "{host:?}: no crowding, no change");
            s.host = Some(host.crowded(Crowding { at_cores: 1.25, at_twice: 2.0 }));
            let crowded = simulate(&s).unwrap().samples_per_s;
            assert!((crowded * 1.25 - alone).abs() < 1e-9 * alone, "{host:?}: {crowded} against {alone}");
        }
        s.host = Some(HostCores::linux(2).crowded(Crowding { at_cores: 0.9, at_twice: 1.0 }));
        assert!(simulate(&s).unwrap_err().to_string().contains("a host's crowding must slow threads by a finite factor of at least 1"));
    }

    #[test]
    fn tied_stages_meet_at_every_step() {
        for scheme in [Scheme::TwoBw, Scheme::Flush, Scheme::GPipe] {
            let (d, m) = (4usize, 4u64);
            let untied = setup(scheme, d, m, 6);
            let mut tied = untied.clone();
            tied.tied_groups = vec![vec![0, d - 1]];
            let (a, b) = (simulate(&untied).unwrap(), simulate(&tied).unwrap());
            if scheme == Scheme::TwoBw {
                // The last stage would run ahead into the next batch; waiting at each step
                // for the first stage's last backward costs 2BW its steady state.
                assert!(b.batch_s > a.batch_s + 1e-9, "{} vs {}", b.batch_s, a.batch_s);
            } else {
                // A flush already holds the last stage until the first has updated.
                assert_eq!(b.samples_per_s, a.samples_per_s, "{scheme}");
            }
            // With a sum of 0.5 s, both tied stages start it at the same instant: when the
            // later one finished its last backward of the batch (stage 2, tied to none,
            // sums on its own).
            let mut timed = tied.clone();
            timed.stages.iter_mut().for_each(|c| c.tied_sync_s = 0.5);
            timed.stages[1].tied_sync_s = 0.0;
            let sim = simulate(&timed).unwrap();
            for t in 0..6u64 {
                let sums: Vec<&TraceEvent> = sim.events.iter().filter(|e| e.kind == TraceKind::AllReduce && e.step == t).collect();
                assert_eq!(sums.len(), 3, "{scheme} step {t}: {sums:?}");
                let last_backward = |s: usize| sim.events.iter().filter(|e| e.stage == s && e.kind == TraceKind::Backward && e.step == t).map(|e| e.start_us + e.dur_us).fold(0.0, f64::max);
                let meet = last_backward(0).max(last_backward(d - 1));
                for e in sums.iter().filter(|e| e.stage == 0 || e.stage == d - 1) {
                    assert!((e.start_us - meet).abs() < 1e-6 && (e.dur_us - 0.5e6).abs() < 1e-6, "{scheme} step {t}: {e:?} against {meet}");
                }
            }
        }
        // With replicas, 2BW defers its update to the forward that needs it, and the
        // meeting with it: the first stage has long reached the step by then, so the tie
        // costs nothing.
        for d in [2usize, 4] {
            let mut untied = setup(Scheme::TwoBw, d, 4, 6);
            untied.w = 2;
            let tied = SimSetup { tied_groups: vec![vec![0, d - 1]], ..untied.clone() };
            assert_eq!(simulate(&tied).unwrap().samples_per_s, simulate(&untied).unwrap().samples_per_s, "d = {d}");
        }
        let mut bad = setup(Scheme::Flush, 2, 2, 1);
        bad.tied_groups = vec![vec![0, 2]];
        assert_eq!(simulate(&bad).unwrap_err(), SimError::Setup("a tied group names stage 2 of 2".into()));
    }

    #[test]
    fn shared_engine_equals_the_dedicated_one_when_the_cores_suffice() {
        // With as many cores as threads every rate is 1: the event loop must give the
        // stage-by-stage engine's replay exactly (same floating-point operations), events
        // included.
        for s in varied_setups() {
            let threads = s.w * s.stages.len();
            let dedicated = canonical(replay_dedicated(&s).unwrap());
            let shared = canonical(shared::replay(&s, HostCores::ideal(threads)).unwrap());
            assert_eq!(shared, dedicated, "{} d={} m={} w={}", s.scheme, s.stages.len(), s.m, s.w);
            // And `simulate` with enough cores is today's replay.
            for cores in [threads, threads + 3] {
                let sim = simulate(&SimSetup { host: Some(HostCores::ideal(cores)), ..s.clone() }).unwrap();
                assert_eq!(canonical(sim), dedicated);
            }
        }
    }

    #[test]
    fn every_stage_runs_the_runtimes_order_under_sharing() {
        for schedule in Schedule::ALL.iter().copied() {
            for (d, m) in [(2, 2), (3, 4), (4, 4), (4, 6)] {
                for cores in [1, 2, 3] {
                    let mut s = setup(schedule.into(), d, m, 3);
                    s.host = Some(HostCores::ideal(cores));
                    let sim = simulate(&s).unwrap();
                    for st in 0..d {
                        assert_eq!(order(&sim, st), stage_ops(schedule, st, d, m as usize, 3).unwrap(), "{schedule} d={d} m={m} cores={cores} stage {st}");
                    }
                }
            }
        }
    }

    #[test]
    fn one_core_serialises_all_the_work() {
        // Two stages on one core: some stage always has work (links are free), and the one
        // core does all of it, so a batch takes the total work, d m (f + b), whatever the
        // schedule does in between. (These schemes flush: no work of batch t + 1 starts
        // before batch t's update, so each batch is its own work.)
        for scheme in [Scheme::Flush, Scheme::GPipe, Scheme::ModelParallel] {
            for m in [2u64, 4, 6] {
                let mut s = setup(scheme, 2, m, 3);
                s.host = Some(HostCores::ideal(1));
                let sim = simulate(&s).unwrap();
                let total = 2.0 * m as f64 * 3.0;
                assert!((sim.batch_s - total).abs() < 1e-9, "{scheme} m={m}: batch {} != {total}", sim.batch_s);
                assert!((sim.makespan_s - 3.0 * total).abs() < 1e-9, "{scheme} m={m}: makespan {}", sim.makespan_s);
                // The dedicated replay overlaps the stages and is faster; without
                // pipelining one stage works at a time, and sharing costs nothing.
                s.host = None;
                let dedicated = simulate(&s).unwrap().makespan_s;
                if scheme == Scheme::ModelParallel {
                    assert_eq!(dedicated, sim.makespan_s);
                } else {
                    assert!(dedicated < sim.makespan_s - 1.0, "{scheme} m={m}: {dedicated}");
                }
            }
        }
    }

    #[test]
    fn sharing_a_core_doubles_an_operation() {
        // Flush, 2 stages on 1 core, f = 1, b = 2: stage 0's F0 runs alone [0, 1]; then its
        // F1 and stage 1's F0 share the core, each at half speed, so both take 2 s: [1, 3].
        let mut s = setup(Scheme::Flush, 2, 2, 1);
        s.host = Some(HostCores::ideal(1));
        let sim = simulate(&s).unwrap();
        let find = |stage: usize, kind: TraceKind, mb: u64| sim.events.iter().find(|e| e.stage == stage && e.kind == kind && e.microbatch == Some(mb)).map(|e| (e.start_us / 1e6, e.dur_us / 1e6));
        assert_eq!(find(0, TraceKind::Forward, 0), Some((0.0, 1.0)));
        assert_eq!(find(1, TraceKind::Forward, 0), Some((1.0, 2.0)));
        assert_eq!(find(0, TraceKind::Forward, 1), Some((1.0, 2.0)));
        // Busy time is the stretched time on the clock, as a real trace records it.
        let busy: f64 = sim.events.iter().filter(|e| e.stage == 1 && matches!(e.kind, TraceKind::Forward | TraceKind::Backward)).map(|e| e.dur_us / 1e6).sum();
        assert!((sim.stages[1].busy_s - busy).abs() < 1e-9);
        // Each replica is a thread: two replicas of the same pipeline on two cores share
        // them as one replica on one core does.
        let mut wide = s.clone();
        wide.w = 2;
        wide.host = Some(HostCores::ideal(2));
        let wide = simulate(&wide).unwrap();
        assert!((wide.makespan_s - sim.makespan_s).abs() < 1e-12, "{} != {}", wide.makespan_s, sim.makespan_s);
        assert!((wide.samples_per_s - 2.0 * sim.samples_per_s).abs() < 1e-9);
    }

    #[test]
    fn four_stages_on_two_cores_run_at_the_cores_rate() {
        // 2BW keeps all four stages busy in its steady state, so the two cores are always
        // both working: a microbatch's total work d (f + b) = 12 s is done at 2 s of work
        // per second, 6 s per microbatch, twice the dedicated replay's 3 s. (The last
        // batch drains the pipeline with fewer stages competing, so it is shorter; the
        // steady state is read between the updates before it.)
        for m in [4u64, 8] {
            let mut s = setup(Scheme::TwoBw, 4, m, 8);
            s.host = Some(HostCores::ideal(2));
            let sim = simulate(&s).unwrap();
            for st in 0..4 {
                let ends: Vec<f64> = sim.events.iter().filter(|e| e.stage == st && e.kind == TraceKind::Optimizer).map(|e| (e.start_us + e.dur_us) / 1e6).collect();
                assert_eq!(ends.len(), 8);
                for pair in ends[..7].windows(2) {
                    assert!((pair[1] - pair[0] - m as f64 * 6.0).abs() < 1e-6, "m={m} stage {st}: updates at {ends:?}");
                }
            }
            assert!(sim.batch_s < m as f64 * 6.0 && sim.batch_s > m as f64 * 5.0, "m={m}: batch {}", sim.batch_s);
            s.host = None;
            assert!((simulate(&s).unwrap().batch_s - m as f64 * 3.0).abs() < 1e-9);
        }
    }

    #[test]
    fn a_shared_trace_converts_back_to_its_work() {
        // Replay unequal stages on fewer cores than stages, then read the replay's trace as
        // a real run's: converting each duration back to full-speed work gives each
        // operation's cost exactly, while the raw durations are stretched.
        for (d, cores, w) in [(2usize, 1usize, 1usize), (4, 2, 1), (4, 3, 1), (3, 2, 2)] {
            let mut s = setup(Scheme::TwoBw, d, 4, 3);
            s.w = w;
            for (k, c) in s.stages.iter_mut().enumerate() {
                c.forward_s = 1.0 + 0.5 * k as f64;
                c.backward_s = 2.5 - 0.25 * k as f64;
                c.optimizer_s = 0.3;
            }
            // Crowding too is undone: what the replay stretched by it, the conversion shrinks.
            for crowding in [Crowding::NONE, Crowding { at_cores: 1.1, at_twice: 1.4 }] {
                let host = HostCores::ideal(cores).crowded(crowding);
                s.host = Some(host);
                let sim = simulate(&s).unwrap();
                let work = dedicated_durations(&sim.events, host, w);
                let mut stretched = 0;
                for (e, &t) in sim.events.iter().zip(&work) {
                    let c = &s.stages[e.stage];
                    let expect = match e.kind {
                        TraceKind::Forward => c.forward_s,
                        TraceKind::Backward => c.backward_s,
                        TraceKind::Optimizer => c.optimizer_s,
                        _ => e.dur_us / 1e6,
                    };
                    assert!((t - expect).abs() < 1e-9, "d={d} cores={cores} w={w}: {e:?} -> {t} != {expect}");
                    stretched += usize::from(e.dur_us / 1e6 > expect + 1e-9);
                }
                assert!(stretched > 0, "d={d} cores={cores}: nothing was shared");
                // With enough cores nothing changes.
                let plain: Vec<f64> = sim.events.iter().map(|e| e.dur_us / 1e6).collect();
                let wide = dedicated_durations(&sim.events, HostCores::ideal(64), 1);
                assert!(plain.iter().zip(&wide).all(|(a, b)| (a - b).abs() < 1e-12));
            }
        }
    }

    #[test]
    fn bad_setups_are_refused() {
        let mut s = setup(Scheme::TwoBw, 4, 2, 1);
        assert!(simulate(&s).unwrap_err().to_string().contains("2BW needs at least as many microbatches"));
        s.m = 4;
        s.links.pop();
        assert_eq!(simulate(&s).unwrap_err(), SimError::Setup("4 stages need 3 links, got 2".into()));
        let mut s = setup(Scheme::Flush, 2, 2, 1);
        s.stages[1].forward_s = f64::NAN;
        assert!(simulate(&s).unwrap_err().to_string().contains("stage 1: times and sizes must be finite"));
        let s = SimSetup { host: Some(HostCores::ideal(0)), ..setup(Scheme::Flush, 2, 2, 1) };
        assert_eq!(simulate(&s).unwrap_err(), SimError::Setup("the host's CPU cores must be at least 1".into()));
    }

    /// Factors all 1 replay as mean times do; a draw depends on the stage, the
    /// microbatch and the draw alone, so both engines draw alike and a replay repeats.
    #[test]
    fn a_spread_draws_alike_in_both_engines_and_of_ones_changes_nothing() {
        for s in varied_setups() {
            let ones = SimSetup { spread: DurationSpread::new(&[1.0, 1.0]), ..s.clone() };
            let (a, b) = (simulate(&s).unwrap(), simulate(&ones).unwrap());
            // The same replay 16 times over; their mean rounds in the last bit.
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs().max(1.0);
            assert!(close(a.samples_per_s, b.samples_per_s) && close(a.bubble_fraction, b.bubble_fraction), "{} d={}: {a:?} against {b:?}", s.scheme, s.stages.len());
            let spread = SimSetup { spread: DurationSpread::new(&[0.7, 1.0, 1.3]), ..s.clone() };
            let threads = s.w * s.stages.len();
            assert_eq!(canonical(shared::replay(&spread, HostCores::ideal(threads)).unwrap()), canonical(replay_dedicated(&spread).unwrap()));
            assert_eq!(simulate(&spread).unwrap(), simulate(&spread).unwrap());
        }
    }

    /// Two equal stages under 2BW never wait for each other with mean times (bubble: the
    /// fill and the drain only). With their operations spread, a hand-off often waits for
    /// the slower of two, so the bubble grows and the rate falls, while each stage's work
    /// stays about its mean (the draws average 1).
    #[test]
    fn a_spread_opens_waits_between_balanced_stages() {
        let even = setup(Scheme::TwoBw, 2, 4, 40);
        let spread = SimSetup { spread: DurationSpread::new(&[0.8, 1.2]), ..even.clone() };
        let (a, b) = (simulate(&even).unwrap(), simulate(&spread).unwrap());
        assert!(b.bubble_fraction > a.bubble_fraction + 0.02, "{} against {}", b.bubble_fraction, a.bubble_fraction);
        assert!(b.samples_per_s < a.samples_per_s * 0.97, "{} against {}", b.samples_per_s, a.samples_per_s);
        for (x, y) in a.stages.iter().zip(&b.stages) {
            assert!((y.busy_s / x.busy_s - 1.0).abs() < 0.02, "busy {} against {}", y.busy_s, x.busy_s);
        }
        // The trace is the first draw's: its forwards are 0.8 or 1.2 of the mean 1 s.
        let durations: std::collections::BTreeSet<u64> = b.events.iter().filter(|e| e.kind == TraceKind::Forward).map(|e| e.dur_us.round() as u64).collect();
        assert_eq!(durations.into_iter().collect::<Vec<_>>(), [800_000, 1_200_000]);
    }
}
