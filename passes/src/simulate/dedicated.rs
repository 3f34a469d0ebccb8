//! The replay when every stage has its own device: stage by stage, each as far as its
//! inputs allow, in turn (no global clock, since the stages never slow each other).

use pipewright_core::schedule::{worker_orders, Op};
use pipewright_core::timeline::TraceKind;

use super::state::{report, Events, Meetings, StageEnd, StageState, Start};
use super::{SimError, SimSetup, Simulation, StageCost};

/// The replay when every stage owns its device: each stage runs as far as its inputs allow,
/// in turn, until all are done (no global clock is needed, since stages never slow each
/// other down).
pub(super) fn replay_dedicated(setup: &SimSetup) -> Result<Simulation, SimError> {
    let d = setup.stages.len();
    let Start { rule, allreduce, mut meetings, deferred, early_tied, mut acts, mut grads, mut batch_end, mut events } = Start::new(setup)?;
    let mut st = StageState::all(setup)?;
    let mut workers = Workers::of(setup)?;
    let m64 = setup.m;
    loop {
        let mut progressed = false;
        let mut done = true;
        for s in 0..d {
            let cost = &setup.stages[s];
            while let Some(&op) = st[s].ops.get(st[s].pc) {
                done = false;
                if let Some(w) = &workers {
                    if !w.may_run(s, op) {
                        break;
                    }
                    w.share_stream(s, op, &mut st[s]);
                }
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
                        state.hold();
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
                    Op::Backward(i) | Op::BackwardInput(i) => {
                        let ready = if s + 1 == d { Some(0.0) } else { grads[s].take(i) };
                        let Some(ready) = ready else { break };
                        let state = &mut st[s];
                        let version = rule.version_for(i, m64);
                        let mut start = state.free.max(ready);
                        let [_, recompute_s, _] = setup.op_seconds(s, i);
                        let backward_s = setup.backward_seconds(s, i, op);
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
                        let whole = matches!(op, Op::Backward(_));
                        if whole {
                            state.release();
                        } else {
                            state.input_gradient();
                        }
                        if s > 0 {
                            let link = setup.links[s - 1];
                            state.free = end + cost.send_s;
                            let t0 = state.free.max(state.bwd_link_free);
                            let dt = link.seconds(cost.send_bytes_back(&setup.stages[s - 1]));
                            state.bwd_link_free = t0 + dt;
                            events.record(TraceKind::Send, s, end, t0 + dt - end, Some(i), version, i / m64);
                            grads[s - 1].put(i, t0 + dt)?;
                        }
                        if early_tied[s] && (i + 1).is_multiple_of(m64) {
                            meetings.arrive(s, i / m64, state.free);
                        }
                        if whole {
                            state.free += cost.after_backward_s;
                        }
                    }
                    Op::BackwardWeight(i) => {
                        // Needs nothing from a neighbour: the input gradient before it
                        // left the output gradient it reads.
                        let state = &mut st[s];
                        let version = rule.version_for(i, m64);
                        let weight_s = setup.backward_seconds(s, i, op);
                        events.record(TraceKind::BackwardWeight, s, state.free, weight_s, Some(i), version, i / m64);
                        state.busy += weight_s;
                        // Two additions, as the shared engine's two segments add them.
                        state.free += weight_s;
                        state.free += cost.after_backward_s;
                        state.release();
                    }
                    Op::Step(t) => {
                        let ar = allreduce[s];
                        if deferred[s] {
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
                            state.defer_update(t, start + ar);
                            batch_end[t as usize] = batch_end[t as usize].max(start + ar);
                        } else {
                            // Tied stages meet, then sum the tied gradients on the stream.
                            let Some(met) = meetings.arrive(s, t, st[s].free) else { break };
                            let state = &mut st[s];
                            state.drop_gradient();
                            if cost.tied_sync_s > 0.0 {
                                events.record(TraceKind::AllReduce, s, met, cost.tied_sync_s, None, t + 1, t);
                            }
                            // A stage that met early ([`Start::early_tied`]) may be past the
                            // sum. Any other arrived here, at the time its step takes (which
                            // waits for no worker's turn, though its clock may have been
                            // moved on by one meanwhile).
                            state.free = if early_tied[s] { state.free.max(met + cost.tied_sync_s) } else { met + cost.tied_sync_s };
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
                if let Some(w) = &mut workers {
                    w.ran(s, op, &st[s]);
                }
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
    let ends: Vec<StageEnd> = st.iter().map(StageState::end).collect();
    Ok(report(setup, &ends, &batch_end, &allreduce, events.list))
}

/// Under interleaved 1F1B and ZB-V, how the stages share their workers ([`Schedule::virtual_stages`]):
/// a stage's forwards and backwards run on its worker's one stream, in the worker's order
/// ([`worker_orders`]), as the runtime's turns run them; its optimizer steps take no
/// turn (`runtime/src/pipeline/turns.rs`) but run on the worker's stream too, after
/// whatever the replay has put on it so far.
///
/// [`Schedule::virtual_stages`]: pipewright_core::Schedule::virtual_stages
pub(super) struct Workers {
    /// Per stage, its worker.
    of_stage: Vec<usize>,
    /// Per worker: the stage of each of its forwards and backwards, in order.
    order: Vec<Vec<usize>>,
    next: Vec<usize>,
    /// When each worker's stream is free.
    free: Vec<f64>,
}

impl Workers {
    /// `None` where every stage has its own worker.
    pub(super) fn of(setup: &SimSetup) -> Result<Option<Workers>, SimError> {
        let Some(schedule) = setup.scheme.schedule().filter(|s| s.virtual_stages() > 1) else { return Ok(None) };
        let d = setup.stages.len();
        let count = schedule.workers(d).map_err(SimError::Setup)?;
        let of_stage = schedule.placement(d);
        let orders = worker_orders(schedule, d, setup.m as usize, 0, setup.batches).map_err(SimError::Setup)?;
        let order: Vec<Vec<usize>> = orders.into_iter().map(|ops| ops.into_iter().filter(|(_, op)| takes_turn(*op)).map(|(k, _)| k).collect()).collect();
        Ok(Some(Workers { of_stage, order, next: vec![0; count], free: vec![0.0; count] }))
    }

    /// Whether stage `s` may run `op` now: a step always, other ops in their worker's turn.
    pub(super) fn may_run(&self, s: usize, op: Op) -> bool {
        let w = self.of_stage[s];
        !takes_turn(op) || self.order[w].get(self.next[w]) == Some(&s)
    }

    /// Whether `op` waits for its worker's turn (forwards and backwards; steps do not).
    pub(super) fn takes_turn(&self, op: Op) -> bool {
        takes_turn(op)
    }

    /// Stage `s`'s op that held its worker's turn is done.
    pub(super) fn pass(&mut self, s: usize) {
        self.next[self.of_stage[s]] += 1;
    }

    /// Before `op` runs on stage `s`: the stage's stream is its worker's (a step's
    /// optimizer too: it takes no turn, but it computes on the worker's device).
    fn share_stream(&self, s: usize, _op: Op, state: &mut StageState) {
        state.free = state.free.max(self.free[self.of_stage[s]]);
    }

    /// After `op` ran on stage `s`: the worker's stream is busy until the stage's is.
    fn ran(&mut self, s: usize, op: Op, state: &StageState) {
        let w = self.of_stage[s];
        self.free[w] = self.free[w].max(state.free);
        if takes_turn(op) {
            self.pass(s);
        }
    }
}

fn takes_turn(op: Op) -> bool {
    !matches!(op, Op::Step(_))
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
