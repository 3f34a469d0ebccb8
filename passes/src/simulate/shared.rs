//! The replay when the stages are threads sharing a host's CPU cores.
//!
//! On a CPU host, the runtime's embedded executor runs one compute thread per stage (and
//! replica), and the operating system shares the host's `C` cores among the runnable ones
//! (the stages with work on their stream: forward, recompute, backward, optimizer, the
//! send hand-off `send_s`). A stage that waits (for an input, an all-reduce, a tied
//! meeting) takes no core; link transfers and all-reduces are the network's and take none
//! either. Two ways of sharing ([`HostCores::time_slice_s`]):
//! - time slices (> 0, Linux's by default): a stage with work but no core waits in line,
//!   a core holder keeps it from one operation to the next until it blocks or its turn
//!   ends while others wait (then it goes to the back): the slice, extended to the
//!   scheduler's next tick when the tick is known ([`HostCores::turn_end`]); each stage
//!   takes its turn as the block of its `w` replicas' threads, on `C / w` slots
//!   ([`take_turns`]);
//! - ideal processor sharing (0): at every instant the `n` working stages each progress at
//!   `min(1, C / (w n))`.
//!
//! Progress changes whenever a stage starts or stops working, so the stages cannot be
//! replayed one after the other as [`super::dedicated`] does; this is a
//! time-ordered event loop instead. The next event is the earliest of: a work segment
//! ending at the current rates, a turn ending, an input a waiting stage needs arriving,
//! an all-reduce a waiting stage needs ending. Each operation is expanded, when its stage reaches it, into
//! the [`Step`]s the dedicated engine runs for it in the same order (the 2BW updates a
//! forward needs first, the input, the work, the hand-off, the link), so the semantics
//! are the module's timing rules; with no more threads than cores every rate is 1 and
//! the result is the dedicated engine's, bit for bit (tested in `super::tests`).

use std::collections::VecDeque;

use pipewright_core::schedule::Op;
use pipewright_core::timeline::{TraceEvent, TraceKind};

use crate::machine::HostCores;

use super::dedicated::Workers;
use super::state::{report, StageEnd, StageState, Start};
use super::{SimError, SimSetup, Simulation};

/// Work on a stage's stream.
#[derive(Clone, Copy, Debug)]
struct Work {
    /// `Send` is the hand-off, recorded with its link transfer by [`Step::Link`]; `None`
    /// is the runtime's work after a backward ([`super::StageCost::after_backward_s`]),
    /// which takes a core but is neither traced nor busy.
    kind: Option<TraceKind>,
    seconds: f64,
    mb: Option<u64>,
    version: u64,
    step: u64,
    /// The optimizer of a Flush/GPipe step ends its batch.
    ends_batch: bool,
}

/// One piece of an operation, run in order on its stage.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Interleaved 1F1B: the op that held the worker's turn is done; the turn passes on.
    PassTurn,
    /// Wait for microbatch `mb`'s activation (`grad` false) or gradient.
    Input { grad: bool, mb: u64 },
    /// Wait, taking no core, until then (an all-reduce).
    Until(f64),
    /// Meet the stages tied to this one at step `t` (arriving there now, or, for a
    /// deferred update, having arrived at the step before), then sum the tied gradients
    /// for `sync` seconds, taking no core.
    Meet { t: u64, sync: f64, arrive: bool },
    /// Reach the tied stages' meeting at step `t` now, going on at once (a stage that sums
    /// its tied weights early, [`Start::early_tied`]).
    Arrive { t: u64 },
    /// The rest of step `t` from when the stages have met: the replicas' all-reduce and
    /// the update.
    Update { t: u64 },
    Work(Work),
    /// Put microbatch `mb`'s message on the link to the next stage (`grad` false) or the
    /// previous one, once the hand-off is done.
    Link { grad: bool, mb: u64, version: u64 },
}

/// The work a stage is doing: it ends at `anchor + left / rate` unless the rate changes.
struct Running {
    work: Work,
    start: f64,
    /// When `left` seconds of dedicated work remained.
    anchor: f64,
    left: f64,
    rate: f64,
    /// Whether it ever ran below full speed: its duration is then measured on the clock,
    /// otherwise it is exactly `work.seconds` (so that unshared replays equal the
    /// dedicated engine's to the bit).
    slowed: bool,
    /// Under time slices: whether it has had a core yet (its trace event starts there, as
    /// a real thread's does when it runs again).
    started: bool,
}

impl Running {
    fn end(&self) -> f64 {
        if self.rate > 0.0 {
            self.anchor + self.left / self.rate
        } else if self.left > 0.0 {
            // Waiting in line for a core.
            f64::INFINITY
        } else {
            self.anchor
        }
    }

    /// Takes it off its core (or its share) at `now`.
    fn stop(&mut self, now: f64) {
        self.left = (self.left - self.rate * (now - self.anchor)).max(0.0);
        self.anchor = now;
        self.rate = 0.0;
    }
}

/// A stage in this engine: its [`StageState`], as the dedicated engine keeps it, and the
/// work it has expanded and is running, and its place on the host's cores.
struct Stage {
    common: StageState,
    steps: VecDeque<Step>,
    running: Option<Running>,
    /// When the hand-off of the message being sent began (the send's trace event starts
    /// there).
    handoff_start: f64,
    /// Under time slices: when its turn on the core it holds ends.
    core_until: Option<f64>,
    /// Under time slices: waiting in line for a core.
    queued: bool,
}

impl Stage {
    fn done(&self) -> bool {
        self.running.is_none() && self.steps.is_empty() && self.common.pc == self.common.ops.len() && self.common.pending.is_empty()
    }
}

/// Replays `setup` (already checked) with its `w * d` threads on `cores` cores.
pub(super) fn replay(setup: &SimSetup, host: HostCores) -> Result<Simulation, SimError> {
    let cores = host.cores;
    let d = setup.stages.len();
    let m64 = setup.m;
    let Start { rule, allreduce, mut meetings, deferred, early_tied, mut acts, mut grads, mut batch_end, mut events } = Start::new(setup)?;
    let mut st: Vec<Stage> = StageState::all(setup)?
        .into_iter()
        .map(|common| Stage { common, steps: VecDeque::new(), running: None, handoff_start: 0.0, core_until: None, queued: false })
        .collect();
    // Interleaved 1F1B: a worker's stages take turns at their forwards and backwards (a
    // stage waiting for its turn takes no core, as the runtime's waits on its turn).
    let mut workers = Workers::of(setup)?;
    // Under time slices a stage takes turns as a block of its `w` replicas' threads.
    let (slice, slots) = (host.time_slice_s, (cores / setup.w).max(1));
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut now = 0.0f64;
    loop {
        // Run every stage as far as it can go without the clock moving; a message sent
        // with no transfer time can let a neighbour on, so until nothing changes.
        let mut changed = true;
        while changed {
            changed = false;
            for s in 0..d {
                let cost = &setup.stages[s];
                loop {
                    let state = &mut st[s];
                    if let Some(r) = &state.running {
                        let end = r.end();
                        if end > now {
                            break;
                        }
                        let dur = if r.slowed { end - r.start } else { r.work.seconds };
                        let w = r.work;
                        if let Some(kind) = w.kind.filter(|k| *k != TraceKind::Send) {
                            events.record(kind, s, r.start, dur, w.mb, w.version, w.step);
                            state.common.busy += dur;
                        }
                        if w.ends_batch {
                            batch_end[w.step as usize] = batch_end[w.step as usize].max(end);
                        }
                        state.common.free = end;
                        state.running = None;
                        changed = true;
                        continue;
                    }
                    if let Some(&step) = state.steps.front() {
                        match step {
                            Step::PassTurn => {
                                if let Some(w) = workers.as_mut() {
                                    w.pass(s);
                                }
                            }
                            Step::Input { grad, mb } => {
                                let arrivals = if grad { &mut grads[s] } else { &mut acts[s] };
                                match arrivals.peek(mb) {
                                    Some(at) if at <= now => {
                                        arrivals.take(mb);
                                    }
                                    _ => break,
                                }
                            }
                            Step::Until(t) => {
                                if t > now {
                                    break;
                                }
                            }
                            Step::Meet { t, sync, arrive } => {
                                let met = if arrive { meetings.arrive(s, t, now) } else { meetings.met(s, t) };
                                let Some(met) = met else { break };
                                if sync > 0.0 {
                                    events.record(TraceKind::AllReduce, s, met, sync, None, t + 1, t);
                                }
                                state.steps.pop_front();
                                state.steps.push_front(Step::Until(met + sync));
                                changed = true;
                                continue;
                            }
                            Step::Arrive { t } => {
                                meetings.arrive(s, t, now);
                                state.steps.pop_front();
                                changed = true;
                                continue;
                            }
                            Step::Update { t } => {
                                let ar = allreduce[s];
                                state.steps.pop_front();
                                state.steps.push_front(Step::Work(Work { kind: Some(TraceKind::Optimizer), seconds: cost.optimizer_s, mb: None, version: t + 1, step: t, ends_batch: true }));
                                if ar > 0.0 {
                                    events.record(TraceKind::AllReduce, s, now, ar, None, t + 1, t);
                                    state.steps.push_front(Step::Until(now + ar));
                                }
                                state.common.version = t + 1;
                                changed = true;
                                continue;
                            }
                            Step::Work(work) => {
                                if work.kind == Some(TraceKind::Send) {
                                    state.handoff_start = now;
                                }
                                // The rate is set once every stage has settled (below);
                                // work of 0 s ends at once on the next pass.
                                state.running = Some(Running { work, start: now, anchor: now, left: work.seconds, rate: 1.0, slowed: false, started: true });
                            }
                            Step::Link { grad, mb, version } => {
                                // As the dedicated engine: the message waits for its link
                                // (one per boundary and direction), then takes latency +
                                // bytes / bandwidth there while the stream goes on.
                                let (link, bytes, free) = if grad {
                                    (setup.links[s - 1], setup.stages[s - 1].send_bytes, &mut state.common.bwd_link_free)
                                } else {
                                    (setup.links[s], cost.send_bytes, &mut state.common.fwd_link_free)
                                };
                                let t0 = now.max(*free);
                                let dt = link.seconds(bytes);
                                *free = t0 + dt;
                                events.record(TraceKind::Send, s, state.handoff_start, t0 + dt - state.handoff_start, Some(mb), version, mb / m64);
                                if grad {
                                    grads[s - 1].put(mb, t0 + dt)?;
                                } else {
                                    acts[s + 1].put(mb, t0 + dt)?;
                                }
                            }
                        }
                        state.steps.pop_front();
                        changed = true;
                        continue;
                    }
                    if let Some(&op) = state.common.ops.get(state.common.pc) {
                        let turn = workers.as_ref().is_some_and(|w| w.takes_turn(op));
                        if turn && workers.as_ref().is_some_and(|w| !w.may_run(s, op)) {
                            break;
                        }
                        state.common.pc += 1;
                        changed = true;
                        let work = |kind: TraceKind, seconds: f64, mb: Option<u64>, version: u64, step: u64| Step::Work(Work { kind: Some(kind), seconds, mb, version, step, ends_batch: false });
                        match op {
                            Op::Forward(i) => {
                                // 2BW: the updates this microbatch's version needs, each
                                // once its all-reduce is done.
                                let need = rule.version_for(i, m64);
                                while state.common.version < need {
                                    let Some(pos) = state.common.pending.iter().position(|p| p.0 == state.common.version) else { break };
                                    let (t, ar_done) = state.common.pending.remove(pos);
                                    state.steps.push_back(Step::Meet { t, sync: cost.tied_sync_s, arrive: false });
                                    state.steps.push_back(Step::Until(ar_done));
                                    state.steps.push_back(work(TraceKind::Optimizer, cost.optimizer_s, None, t + 1, t));
                                    state.common.version = t + 1;
                                }
                                if s > 0 {
                                    state.steps.push_back(Step::Input { grad: false, mb: i });
                                }
                                let [forward_s, _, _] = setup.op_seconds(s, i);
                                state.steps.push_back(work(TraceKind::Forward, forward_s, Some(i), need, i / m64));
                                state.common.hold();
                                if s + 1 < d {
                                    state.steps.push_back(work(TraceKind::Send, cost.send_s, Some(i), need, i / m64));
                                    state.steps.push_back(Step::Link { grad: false, mb: i, version: need });
                                }
                            }
                            Op::Backward(i) | Op::BackwardInput(i) => {
                                let version = rule.version_for(i, m64);
                                if s + 1 < d {
                                    state.steps.push_back(Step::Input { grad: true, mb: i });
                                }
                                let [_, recompute_s, _] = setup.op_seconds(s, i);
                                if recompute_s > 0.0 {
                                    state.steps.push_back(work(TraceKind::Recompute, recompute_s, Some(i), version, i / m64));
                                }
                                state.steps.push_back(work(TraceKind::Backward, setup.backward_seconds(s, i, op), Some(i), version, i / m64));
                                let whole = matches!(op, Op::Backward(_));
                                if whole {
                                    state.common.release();
                                } else {
                                    state.common.input_gradient();
                                }
                                if s > 0 {
                                    state.steps.push_back(work(TraceKind::Send, cost.send_s, Some(i), version, i / m64));
                                    state.steps.push_back(Step::Link { grad: true, mb: i, version });
                                }
                                if early_tied[s] && (i + 1).is_multiple_of(m64) {
                                    state.steps.push_back(Step::Arrive { t: i / m64 });
                                }
                                if whole && cost.after_backward_s > 0.0 {
                                    let untraced = Work { kind: None, seconds: cost.after_backward_s, mb: Some(i), version, step: i / m64, ends_batch: false };
                                    state.steps.push_back(Step::Work(untraced));
                                }
                            }
                            Op::BackwardWeight(i) => {
                                let version = rule.version_for(i, m64);
                                state.steps.push_back(work(TraceKind::BackwardWeight, setup.backward_seconds(s, i, op), Some(i), version, i / m64));
                                state.common.release();
                                if cost.after_backward_s > 0.0 {
                                    let untraced = Work { kind: None, seconds: cost.after_backward_s, mb: Some(i), version, step: i / m64, ends_batch: false };
                                    state.steps.push_back(Step::Work(untraced));
                                }
                            }
                            Op::Step(t) if deferred[s] => {
                                // The stream goes on: the all-reduce on the stage's network
                                // channel; the meeting and the update wait for the forward
                                // that needs them (`Step::Meet`).
                                meetings.arrive(s, t, now);
                                let ar = allreduce[s];
                                let start = now.max(state.common.net_free);
                                if ar > 0.0 {
                                    events.record(TraceKind::AllReduce, s, start, ar, None, t + 1, t);
                                }
                                state.common.net_free = start + ar;
                                state.common.defer_update(t, start + ar);
                                batch_end[t as usize] = batch_end[t as usize].max(start + ar);
                            }
                            Op::Step(t) => {
                                state.common.drop_gradient();
                                state.steps.push_back(Step::Meet { t, sync: cost.tied_sync_s, arrive: true });
                                state.steps.push_back(Step::Update { t });
                            }
                        }
                        if turn {
                            state.steps.push_back(Step::PassTurn);
                        }
                        continue;
                    }
                    if !state.common.pending.is_empty() {
                        // Updates still waiting at the end are applied then.
                        state.common.pending.sort_by_key(|p| p.0);
                        for (t, ar_done) in std::mem::take(&mut state.common.pending) {
                            state.steps.push_back(Step::Meet { t, sync: cost.tied_sync_s, arrive: false });
                            state.steps.push_back(Step::Until(ar_done));
                            state.steps.push_back(Step::Work(Work { kind: Some(TraceKind::Optimizer), seconds: cost.optimizer_s, mb: None, version: t + 1, step: t, ends_batch: false }));
                        }
                        changed = true;
                        continue;
                    }
                    break;
                }
            }
        }
        if slice > 0.0 {
            take_turns(&mut st, &mut queue, now, &host, slots);
        }
        // Every thread with a core (under ideal sharing, every working one) runs at the
        // speed the number of working threads allows, from now on.
        let working = st.iter().filter(|x| x.running.is_some()).count() * setup.w;
        let rate = host.rate(working);
        for x in st.iter_mut().filter(|x| slice == 0.0 || x.core_until.is_some()) {
            let Some(r) = x.running.as_mut() else { continue };
            if r.rate != rate {
                r.stop(now);
                r.rate = rate;
                r.slowed |= rate < 1.0;
            }
        }
        // The next event: a work segment ending, a turn ending (each is an event, so that
        // turns keep their length whether or not anyone waits), or what a waiting stage
        // waits for.
        let mut next = st.iter().filter_map(|x| x.core_until).fold(f64::INFINITY, f64::min);
        for (s, x) in st.iter().enumerate() {
            let at = match (&x.running, x.steps.front()) {
                (Some(r), _) => Some(r.end()),
                (None, Some(Step::Until(t))) => Some(*t),
                (None, Some(Step::Input { grad: true, mb })) => grads[s].peek(*mb),
                (None, Some(Step::Input { grad: false, mb })) => acts[s].peek(*mb),
                _ => None,
            };
            if let Some(at) = at {
                next = next.min(at);
            }
        }
        if next == f64::INFINITY {
            if st.iter().all(Stage::done) {
                break;
            }
            let s = st.iter().position(|x| !x.done()).unwrap_or(0);
            let op = st[s].common.pc.checked_sub(1).and_then(|pc| st[s].common.ops.get(pc)).map_or_else(|| "the end".to_string(), |op| format!("{op:?}"));
            return Err(SimError::Deadlock { stage: s, op });
        }
        now = next;
    }
    let ends: Vec<StageEnd> = st.iter().map(|x| x.common.end()).collect();
    Ok(report(setup, &ends, &batch_end, &allreduce, events.list))
}

/// Time slices at `now`: a stage with no work has blocked and frees its core; work
/// without a core joins the line; a stage whose turn has ended goes to the back of the
/// line if anyone waits (else it starts a new turn); free cores (`slots` of them) go to
/// the head of the line, each for one turn ([`HostCores::turn_end`]).
fn take_turns(st: &mut [Stage], queue: &mut VecDeque<usize>, now: f64, host: &HostCores, slots: usize) {
    for (s, x) in st.iter_mut().enumerate() {
        match x.running.as_mut() {
            None => x.core_until = None,
            Some(r) if x.core_until.is_none() && !x.queued => {
                // It has not run yet: its event starts when it gets a core.
                r.stop(now);
                r.started = false;
                x.queued = true;
                queue.push_back(s);
            }
            Some(_) => {}
        }
    }
    for (s, x) in st.iter_mut().enumerate() {
        let (Some(until), Some(r)) = (x.core_until, x.running.as_mut()) else { continue };
        if until > now {
            continue;
        }
        if queue.is_empty() {
            x.core_until = Some(host.turn_end(now));
        } else {
            r.stop(now);
            r.slowed = true;
            x.core_until = None;
            x.queued = true;
            queue.push_back(s);
        }
    }
    let mut held = st.iter().filter(|x| x.core_until.is_some()).count();
    while held < slots {
        let Some(s) = queue.pop_front() else { break };
        let x = &mut st[s];
        x.queued = false;
        x.core_until = Some(host.turn_end(now));
        if let Some(r) = x.running.as_mut() {
            if !r.started {
                r.start = now;
                r.started = true;
            }
            r.anchor = now;
            r.rate = 1.0;
        }
        held += 1;
    }
}

/// Whether an event of a real run's trace keeps its stage's thread working (a wait for a
/// message, an all-reduce, do not).
fn works(kind: TraceKind) -> bool {
    matches!(kind, TraceKind::Forward | TraceKind::Backward | TraceKind::BackwardWeight | TraceKind::Recompute | TraceKind::Optimizer | TraceKind::Send)
}

/// Each event's duration in seconds as full-speed work: the inverse of the sharing rule for
/// a trace recorded with its stages' threads on `host`, each stage standing for `replicas`
/// threads. While `n` working events overlap, each progressed at
/// `min(1, cores / (replicas n))` slowed by the host's crowding of `replicas n` threads
/// (the cores shared ideally: over a slice's length the turns average out), so an event's
/// work is the integral of that rate over its span. Events that take no core keep their
/// durations.
pub fn dedicated_durations(events: &[TraceEvent], host: HostCores, replicas: usize) -> Vec<f64> {
    let span = |e: &TraceEvent| (e.start_us / 1e6, (e.start_us + e.dur_us) / 1e6);
    // The number of working events changes only at their starts and ends: sweep them once
    // and integrate the rate between consecutive ones.
    let mut changes: Vec<(f64, i64)> = events.iter().filter(|e| works(e.kind)).flat_map(|e| {
        let (a, b) = span(e);
        [(a, 1), (b, -1)]
    }).collect();
    changes.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut points: Vec<f64> = Vec::with_capacity(changes.len());
    let mut integral: Vec<f64> = Vec::with_capacity(changes.len());
    let (mut working, mut k) = (0i64, 0);
    let ideal = HostCores { time_slice_s: 0.0, ..host };
    while k < changes.len() {
        let t = changes[k].0;
        if let (Some(&prev), Some(&before)) = (points.last(), integral.last()) {
            let rate = ideal.rate(usize::try_from(working).unwrap_or(0) * replicas.max(1));
            integral.push(before + rate * (t - prev));
        } else {
            integral.push(0.0);
        }
        points.push(t);
        while k < changes.len() && changes[k].0 == t {
            working += changes[k].1;
            k += 1;
        }
    }
    let at = |t: f64| integral[points.partition_point(|p| *p < t).min(points.len().saturating_sub(1))];
    events
        .iter()
        .map(|e| {
            if !works(e.kind) {
                return e.dur_us / 1e6;
            }
            let (a, b) = span(e);
            (at(b) - at(a)).max(0.0)
        })
        .collect()
}
