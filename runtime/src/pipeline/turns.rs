//! Turns: how the stages of one worker share it. Under interleaved 1F1B and ZB-V a worker
//! runs `v` stages ([`Schedule::virtual_stages`], placed by [`Schedule::worker_of`]); the
//! embedded executor gives each its own thread,
//! as it does every stage, and [`Turns`] makes those threads run their forwards and
//! backwards one at a time in the worker's order ([`worker_ops_from`]), so that the worker
//! computes one op at a time, as one device would.
//!
//! Optimizer steps take no turn: a step may wait for the other stages' gradient norms
//! (clipping) or tied sums, and a step of one of the worker's stages waiting for another's
//! that needs the turn would never end. A step waits instead until its worker has run all
//! of the batch's forwards and backwards (holding nothing while it waits), so it computes
//! beside the worker's other steps and the next batch's first ops, not inside its batch.
//!
//! A stage that stops early (an error) gives up its turns: the worker's other stages,
//! waiting for a turn it would never pass on, stop with an error naming it.

use std::sync::{Arc, Condvar, Mutex};

use pipewright_core::schedule::{stage_ops_from, worker_ops_from, worker_orders, Op};
use pipewright_core::Schedule;

/// How the stages of one worker follow its place in its order: a counter of the turns the
/// worker has passed, moved on by whichever stage holds the turn. Threads of one process
/// share it in memory (the embedded executor); ranks of an MPI job keep a copy each and
/// tell one another each move ([`super::MpiTurns`]).
pub trait TurnLink: Send {
    /// Waits until `reached` holds for the worker's count of passed turns; an error when a
    /// stage of the worker stopped before passing its turns on, or the wait timed out.
    fn wait(&mut self, reached: &dyn Fn(usize) -> bool) -> Result<(), String>;
    /// The stage holding the turn has passed it on: the worker's count moves by one.
    fn pass(&mut self);
    /// Stage `stage` stops before its last turn: the others must not wait for it.
    fn abandon(&mut self, stage: usize);
}

/// The worker's place in its order, shared by its stages' threads.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    moved: Condvar,
}

#[derive(Default)]
struct GateState {
    /// The position in the worker's order of the op that may run now.
    next: usize,
    /// A stage that stopped before its last turn.
    abandoned_by: Option<usize>,
}

impl TurnLink for Arc<Gate> {
    fn wait(&mut self, reached: &dyn Fn(usize) -> bool) -> Result<(), String> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while !reached(state.next) {
            if let Some(k) = state.abandoned_by {
                return Err(abandoned(k));
            }
            state = self.moved.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    fn pass(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.next += 1;
        self.moved.notify_all();
    }

    fn abandon(&mut self, stage: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.abandoned_by.get_or_insert(stage);
        self.moved.notify_all();
    }
}

/// The error of a stage waiting for a turn that stage `k` will never pass on.
pub(crate) fn abandoned(k: usize) -> String {
    format!("stage {k}, which shares this stage's worker, stopped before its turn came")
}

/// When an op of a stage may run on its worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// A forward or backward: at this position of the worker's order, taking the turn.
    Turn(usize),
    /// A step: once the worker has passed this many turns (its batch's), taking none.
    After(usize),
}

/// One stage's turns on its worker: per op of the stage's order, when it may run.
pub(crate) struct Turns {
    link: Box<dyn TurnLink>,
    stage: usize,
    positions: Vec<Slot>,
    /// Turns passed on so far.
    passed: usize,
}

/// What [`Turns::take`] returns: the turn, passed on when dropped (at the end of the
/// op, however the op ends).
pub(crate) struct Turn<'a> {
    turns: Option<&'a mut Turns>,
}

/// A stage's ops in its worker's order and, per op, its slot in that order.
type StageOrder = (usize, Vec<Op>, Vec<Slot>);

/// A stage's ops and, where its worker runs other stages too, its turns.
pub(crate) type StageRun = (Vec<Op>, Option<Turns>);

impl Turns {
    /// Each stage of worker `worker` (a pipeline of `depth` stages under `schedule`, which
    /// runs several stages per worker) with its ops and their slots in the worker's order.
    fn orders(schedule: Schedule, worker: usize, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<StageOrder>, String> {
        Turns::split(schedule, worker, depth, worker_ops_from(schedule, worker, depth, m, start, steps)?)
    }

    /// Worker `worker`'s `order` split by stage, each op with its slot.
    fn split(schedule: Schedule, worker: usize, depth: usize, order: Vec<(usize, Op)>) -> Result<Vec<StageOrder>, String> {
        let mut stages: Vec<StageOrder> = schedule.stages_of(worker, depth).into_iter().map(|k| (k, Vec::new(), Vec::new())).collect();
        let mut position = 0;
        for (k, op) in order {
            let Some((_, ops, slots)) = stages.iter_mut().find(|(s, _, _)| *s == k) else {
                return Err(format!("worker {worker}'s order names stage {k}, which it does not run"));
            };
            ops.push(op);
            if let Op::Step(_) = op {
                slots.push(Slot::After(position));
            } else {
                slots.push(Slot::Turn(position));
                position += 1;
            }
        }
        Ok(stages)
    }

    /// For each stage of worker `worker` (a pipeline of `depth` stages under `schedule`):
    /// the stage, its ops in order, and its turns, on one gate in memory. `None` for a
    /// schedule that runs one stage per worker (no turns needed).
    #[cfg(test)]
    fn for_worker(schedule: Schedule, worker: usize, depth: usize, m: usize, start: usize, steps: usize) -> Result<Option<Vec<(usize, Vec<Op>, Turns)>>, String> {
        if schedule.virtual_stages() == 1 {
            return Ok(None);
        }
        Ok(Some(Turns::on_one_gate(Turns::orders(schedule, worker, depth, m, start, steps)?)))
    }

    /// A worker's stages with their ops, taking turns on one gate in memory.
    fn on_one_gate(stages: Vec<StageOrder>) -> Vec<(usize, Vec<Op>, Turns)> {
        let gate = Arc::new(Gate::default());
        stages.into_iter().map(|(k, ops, positions)| (k, ops, Turns { link: Box::new(gate.clone()), stage: k, positions, passed: 0 })).collect()
    }

    /// Stage `stage`'s ops and its turns over `link` (its worker's other stages run
    /// elsewhere, e.g. in other MPI ranks); `None` for turns when its worker runs it alone.
    pub(crate) fn for_stage(schedule: Schedule, stage: usize, depth: usize, m: usize, start: usize, steps: usize, link: Option<Box<dyn TurnLink>>) -> Result<(Vec<Op>, Option<Turns>), String> {
        if schedule.virtual_stages() == 1 {
            return Ok((stage_ops_from(schedule, stage, depth, m, start, steps)?, None));
        }
        let link = link.ok_or_else(|| format!("the {schedule} schedule runs stage {stage} on a worker with other stages, and this run gave it no link to them"))?;
        let worker = schedule.worker_of(stage, depth);
        let (_, ops, positions) = Turns::orders(schedule, worker, depth, m, start, steps)?
            .into_iter()
            .find(|(k, _, _)| *k == stage)
            .ok_or_else(|| format!("worker {worker} does not run stage {stage}"))?;
        Ok((ops, Some(Turns { link, stage, positions, passed: 0 })))
    }

    /// Per stage of a pipeline of `depth` stages: its ops and, where its worker runs other
    /// stages too, its turns (a gate per worker; one call per replica).
    pub(crate) fn for_pipeline(schedule: Schedule, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<StageRun>, String> {
        if schedule.virtual_stages() == 1 {
            return (0..depth).map(|k| Ok((stage_ops_from(schedule, k, depth, m, start, steps)?, None))).collect();
        }
        let mut per_stage: Vec<Option<StageRun>> = (0..depth).map(|_| None).collect();
        // Every worker's order at once (ZB-V's from one replay of the pipeline).
        for (worker, order) in worker_orders(schedule, depth, m, start, steps)?.into_iter().enumerate() {
            for (k, ops, turns) in Turns::on_one_gate(Turns::split(schedule, worker, depth, order)?) {
                per_stage[k] = Some((ops, Some(turns)));
            }
        }
        per_stage.into_iter().enumerate().map(|(k, s)| s.ok_or_else(|| format!("no worker runs stage {k}"))).collect()
    }

    /// Waits for the turn of the stage's `i`-th op (a step: for its worker's batch to be
    /// done); an error when a stage of the same worker stopped before passing the turn on.
    pub(crate) fn take(&mut self, i: usize) -> Result<Turn<'_>, String> {
        let Some(slot) = self.positions.get(i).copied() else {
            return Ok(Turn { turns: None });
        };
        let reached = move |next: usize| match slot {
            Slot::Turn(p) => next == p,
            Slot::After(p) => next >= p,
        };
        self.link.wait(&reached)?;
        Ok(Turn { turns: matches!(slot, Slot::Turn(_)).then_some(self) })
    }

    fn pass(&mut self) {
        self.passed += 1;
        self.link.pass();
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(turns) = self.turns.take() {
            turns.pass();
        }
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        if self.passed < self.positions.iter().filter(|s| matches!(s, Slot::Turn(_))).count() {
            self.link.abandon(self.stage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stages of one worker on their own threads run their ops in the worker's order,
    /// whatever order the threads start in, and their steps after the batch.
    #[test]
    fn a_workers_stages_take_turns_in_its_order() {
        let stages = Turns::for_worker(Schedule::Interleaved2, 0, 4, 4, 0, 1).unwrap().unwrap();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = stages
            .into_iter()
            .rev()
            .map(|(k, ops, mut turns)| {
                let ran = ran.clone();
                std::thread::spawn(move || {
                    for (i, op) in ops.into_iter().enumerate() {
                        let _turn = turns.take(i).unwrap();
                        ran.lock().unwrap().push((k, op));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let order: Vec<(usize, Op)> = worker_ops_from(Schedule::Interleaved2, 0, 4, 4, 0, 1).unwrap().into_iter().filter(|(_, op)| !matches!(op, Op::Step(_))).collect();
        // The steps come after the batch's forwards and backwards, in either order.
        let ran = ran.lock().unwrap();
        assert_eq!(ran[..order.len()], order[..]);
        let mut steps = ran[order.len()..].to_vec();
        steps.sort_by_key(|&(k, _)| k);
        assert_eq!(steps, [(0, Op::Step(0)), (2, Op::Step(0))]);
    }

    /// A stage that stops early lets the worker's other stages stop too, naming it.
    #[test]
    fn a_stage_that_stops_releases_its_worker() {
        let mut stages = Turns::for_worker(Schedule::Interleaved2, 0, 4, 4, 0, 1).unwrap().unwrap();
        let (_, _, mut second) = stages.pop().unwrap();
        let (_, _, first) = stages.pop().unwrap();
        // Stage 2's first op comes after two of stage 0's; stage 0 stops without them.
        let waiting = std::thread::spawn(move || second.take(0).map(|_| ()));
        drop(first);
        assert_eq!(waiting.join().unwrap(), Err("stage 0, which shares this stage's worker, stopped before its turn came".to_string()));
        assert!(Turns::for_worker(Schedule::Flush, 0, 4, 4, 0, 1).unwrap().is_none());
    }
}
