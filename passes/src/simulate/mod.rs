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
//!   `t + 2`, [`pipewright_core::UpdateRule::version_for`]). That is the overlap 2BW's
//!   one-step delay allows, and the planner's `max(T, AR / m)` assumes (the runtime's
//!   workers do the same, over MPI and in one process: `runtime/src/pipeline/stage.rs`,
//!   `Deferred`). With `w = 1` an untied stage's update runs where the step is, as the
//!   executor runs it.
//! - Stages tied by a shared weight ([`SimSetup::tied_groups`]) sum its gradient at every
//!   step: a stage's `Step(t)` waits until every stage tied to it has reached `Step(t)`,
//!   then takes [`StageCost::tied_sync_s`] on the stream, as the runtime's step does. 2BW
//!   defers that too: the update waits for the meeting and the sum just before the
//!   forward that needs it. A stage that splits its backward arrives at its batch's last
//!   input gradient ([`pipewright_core::Schedule::sums_tied_early`]).
//! - Inter-layer model parallelism without pipelining runs each microbatch's forward and
//!   backward through all stages before the next one enters ([`model_parallel_ops`]).
//! - With [`SimSetup::host`]'s cores below the `w * d` threads, the stages' threads share
//!   the host's cores: every stage's work progresses at `min(1, C / (w n))` while `n`
//!   stages have work (`simulate/shared.rs`, an event loop running the same rules).
//!
//! # Engines
//! `dedicated.rs` replays stage by stage when every stage has its own device, `shared.rs`
//! runs an event loop when the stages' threads share a host's cores; both keep each
//! stage's `StageState` and report through `state.rs`.
//!
//! # Reports
//! Throughput is measured between the ends of the first and the last simulated batch
//! (the steady state; the first batch's warm-up is excluded); per stage the busy time
//! (forward, recompute, backward, optimizer), the bubble fraction `1 - busy / span` over
//! the whole run (as `pipewright trace-svg` computes it from a real trace), the most
//! microbatches it held at once and the memory that implies.

use pipewright_core::schedule::{stage_orders, Op};
use pipewright_core::timeline::TraceEvent;
use pipewright_core::{Schedule, Scheme};
use serde::Serialize;

use crate::machine::{AllReduce, Crowding, DurationSpread, HostCores, Link};

mod dedicated;
mod shared;
mod state;
#[cfg(test)]
mod tests;

use dedicated::replay_dedicated;
pub use shared::dedicated_durations;

/// One stage's work per microbatch, and what it holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageCost {
    pub forward_s: f64,
    pub backward_s: f64,
    /// Of `backward_s`, the weight gradients' part (the weight operand's product of each
    /// matrix product with a weight): what a schedule that splits the backward runs apart
    /// from the input gradient.
    #[serde(default)]
    pub weight_grad_s: f64,
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
    /// Memory while the update writes the new weight version (the stage's peak when its
    /// weights outweigh its activations; [`crate::partition::MemoryModel::update_factor`]).
    #[serde(default)]
    pub memory_at_update: f64,
    /// Bytes of the stage's gradients, which `memory_one` counts but it does not hold
    /// before its batch's first weight gradient (the runtime frees them at each update).
    #[serde(default)]
    pub gradient_bytes: f64,
    /// What each microbatch between its input and weight gradients holds, on a stage that
    /// splits its backward (in place of what `memory_per_extra` counts for a whole one).
    #[serde(default)]
    pub memory_per_awaiting: f64,
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
    /// Microbatch `mb`'s backward on stage `s` as `op` runs it: the input gradient alone
    /// (`BackwardInput`), the weight gradient alone (`BackwardWeight`), or both. A stage
    /// that does not split its backward ([`Schedule::splits_stage_backward`]) runs all of
    /// it at the weight-gradient op.
    fn backward_seconds(&self, s: usize, mb: u64, op: Op) -> f64 {
        let [_, _, backward_s] = self.op_seconds(s, mb);
        let splits = self.scheme.schedule().is_some_and(|k| k.splits_stage_backward(s));
        let share = match self.stages[s].backward_s {
            _ if !splits => 1.0,
            b if b > 0.0 => (self.stages[s].weight_grad_s / b).clamp(0.0, 1.0),
            _ => 0.0,
        };
        match op {
            Op::BackwardInput(_) => backward_s * (1.0 - share),
            Op::BackwardWeight(_) => backward_s * share,
            _ => backward_s,
        }
    }

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

/// The orders the `depth` stages run under `scheme`: the runtime's schedule's (data and
/// tensor parallelism run as Flush with one stage), or [`model_parallel_ops`]; each
/// worker's order made once ([`stage_orders`]).
pub fn scheme_orders(scheme: Scheme, depth: usize, m: usize, batches: usize) -> Result<Vec<Vec<Op>>, SimError> {
    let schedule = match scheme {
        Scheme::ModelParallel => return Ok(vec![model_parallel_ops(m, batches); depth]),
        // Data and tensor parallelism run one stage per group: Flush's order with d = 1
        // (tensor parallelism's all-reduces are inside its forward and backward times).
        Scheme::DataParallel | Scheme::TensorParallel => Schedule::Flush,
        s => s.schedule().unwrap_or(Schedule::Flush),
    };
    stage_orders(schedule, depth, m, 0, batches).map_err(SimError::Setup)
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
    // Under interleaved 1F1B and ZB-V a worker's stages take turns: one computes at a
    // time (their optimizer steps apart, which are short).
    let d = setup.stages.len();
    let schedule = setup.scheme.schedule();
    let workers = schedule.map_or(Ok(d), |s| s.workers(d)).map_err(SimError::Setup)?;
    let threads = setup.w * workers;
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

impl StageCost {
    /// Bytes of the gradient this stage sends back to `prev`: the activations `prev` sent.
    fn send_bytes_back(&self, prev: &StageCost) -> f64 {
        prev.send_bytes
    }
}
