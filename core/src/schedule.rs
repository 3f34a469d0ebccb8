//! Per-stage operation sequences for the pipeline schedules: what each stage runs, in
//! order. The runtime's executor runs them and `pipewright simulate` replays them, so both
//! use this one generator (plain Rust, no libtorch).

use crate::Schedule;

/// One step of a stage's work. Microbatch indices are 0-based and global over training;
/// `Step(t)` applies the update of batch `t` (0-based) and creates weight version `t + 1`.
/// A schedule that splits the backward ([`Schedule::splits_backward`]) runs
/// `BackwardInput(j)` (the gradient of the stage's inputs, sent upstream) and later
/// `BackwardWeight(j)` (the weight gradient, added to the batch's) in place of
/// `Backward(j)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Forward(u64),
    Backward(u64),
    BackwardInput(u64),
    BackwardWeight(u64),
    Step(u64),
}

impl Op {
    /// The microbatch the op works on (`None` for a step).
    pub fn microbatch(self) -> Option<u64> {
        match self {
            Op::Forward(j) | Op::Backward(j) | Op::BackwardInput(j) | Op::BackwardWeight(j) => Some(j),
            Op::Step(_) => None,
        }
    }
}

/// The operation sequence of stage `stage` of `depth` for `steps` batches of `m`
/// microbatches. Errors when 2BW is asked for `m < depth`.
pub fn stage_ops(schedule: Schedule, stage: usize, depth: usize, m: usize, steps: usize) -> Result<Vec<Op>, String> {
    stage_ops_from(schedule, stage, depth, m, 0, steps)
}

/// The operation sequence for batches `start..steps` (a resumed run): microbatch and
/// step indices stay global, and the pipeline warms up again at `start`.
pub fn stage_ops_from(schedule: Schedule, stage: usize, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<Op>, String> {
    if m == 0 || depth == 0 || stage >= depth || start > steps {
        return Err(format!("invalid schedule shape: stage {stage}, depth {depth}, m {m}"));
    }
    if schedule == Schedule::TwoBw && m < depth {
        return Err(format!("2BW needs at least as many microbatches per batch as stages (m = {m} < d = {depth})"));
    }
    let (m64, mut ops) = (m as u64, Vec::new());
    let warm = depth - 1 - stage;
    match schedule {
        Schedule::GPipe => {
            for t in start as u64..steps as u64 {
                ops.extend((0..m64).map(|i| Op::Forward(t * m64 + i)));
                ops.extend((0..m64).map(|i| Op::Backward(t * m64 + i)));
                ops.push(Op::Step(t));
            }
        }
        Schedule::Flush => {
            for t in start as u64..steps as u64 {
                one_f_one_b(&mut ops, t * m64, m64, warm as u64, |_| None);
                ops.push(Op::Step(t));
            }
        }
        Schedule::TwoBw => {
            let (base, total) = (start as u64 * m64, (steps - start) as u64 * m64);
            one_f_one_b(&mut ops, base, total, warm as u64, |i| ((i + 1) % m64 == 0).then(|| Op::Step(i / m64)));
        }
        Schedule::ZbH1 => {
            // Every batch runs the same order: made once.
            let batch = zb_h1(m64, stage, depth);
            for t in start as u64..steps as u64 {
                ops.extend(batch.iter().map(|&op| shifted(op, t * m64)));
                ops.push(Op::Step(t));
            }
        }
    }
    Ok(ops)
}

/// One batch of ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) on stage
/// `stage` of `depth`: 1F1B's order of forwards and input gradients, with each weight
/// gradient put into a wait. The order is that of a replay in unit times (every forward,
/// input gradient and weight gradient one tick, free links): a stage whose next forward
/// or input gradient is not ready runs its oldest waiting weight gradient instead, as
/// does one whose next forward would hold more graphs than 1F1B's stage holds (`d - s`;
/// a graph lives until its weight gradient here), and those still waiting when its input
/// gradients are done end the batch.
fn zb_h1(n: u64, stage: usize, depth: usize) -> Vec<Op> {
    // Per stage: its forwards and input gradients in 1F1B order (batch-local indices).
    let orders: Vec<Vec<Op>> = (0..depth)
        .map(|s| {
            let mut o = Vec::new();
            one_f_one_b(&mut o, 0, n, (depth - 1 - s) as u64, |_| None);
            o
        })
        .collect();
    // Tick at which each stage's forward / input gradient of microbatch j ended.
    let mut fwd_end = vec![vec![None; n as usize]; depth];
    let mut bwd_end = vec![vec![None; n as usize]; depth];
    let mut next = vec![0usize; depth];
    // Per stage: graphs held (forwards run, weight gradients not yet).
    let mut held = vec![0usize; depth];
    let mut waiting: Vec<std::collections::VecDeque<u64>> = vec![std::collections::VecDeque::new(); depth];
    let mut mine = Vec::new();
    let mut tick: u64 = 0;
    while (0..depth).any(|s| next[s] < orders[s].len()) {
        let mut ran = Vec::new();
        for s in 0..depth {
            let ready = |op: Op| match op {
                Op::Forward(j) => s == 0 || fwd_end[s - 1][j as usize].is_some_and(|t| t <= tick),
                Op::Backward(j) => s + 1 == depth || bwd_end[s + 1][j as usize].is_some_and(|t| t <= tick),
                _ => false,
            };
            // A forward past 1F1B's `d - s` graphs held waits for a weight gradient, so
            // the stage holds no more than 1F1B's stage does.
            let room = |op: Op| !matches!(op, Op::Forward(_)) || held[s] < depth - s || waiting[s].is_empty();
            let op = match orders[s].get(next[s]).copied() {
                Some(op) if ready(op) && room(op) => {
                    next[s] += 1;
                    Some(op)
                }
                _ => waiting[s].pop_front().map(Op::BackwardWeight),
            };
            if let Some(op) = op {
                ran.push((s, op));
            }
        }
        tick += 1;
        for (s, op) in ran {
            match op {
                Op::Forward(j) => {
                    fwd_end[s][j as usize] = Some(tick);
                    held[s] += 1;
                }
                Op::Backward(j) => {
                    bwd_end[s][j as usize] = Some(tick);
                    waiting[s].push_back(j);
                }
                Op::BackwardWeight(_) => held[s] -= 1,
                _ => {}
            }
            if s == stage {
                mine.push(op);
            }
        }
    }
    mine.extend(waiting[stage].iter().map(|&j| Op::BackwardWeight(j)));
    // The replay's input gradients are the schedule's `BackwardInput`.
    mine.into_iter().map(|op| if let Op::Backward(j) = op { Op::BackwardInput(j) } else { op }).collect()
}

/// `op` of a batch-local order, for the batch whose first microbatch is `base`.
fn shifted(op: Op, base: u64) -> Op {
    match op {
        Op::Forward(j) => Op::Forward(base + j),
        Op::Backward(j) => Op::Backward(base + j),
        Op::BackwardInput(j) => Op::BackwardInput(base + j),
        Op::BackwardWeight(j) => Op::BackwardWeight(base + j),
        Op::Step(t) => Op::Step(t),
    }
}

/// The most microbatches stage `stage` of `depth` holds between their forward and their
/// backward at once under `schedule` with `m` microbatches per batch: what its stashed
/// activations are counted by. GPipe holds all `m`; 1F1B (2BW, PipeDream-Flush) runs
/// `depth - 1 - stage` warm-up forwards and then one more before each backward, so at most
/// `min(depth - stage, m)` (2BW never flushes and has `m >= depth`); ZB-H1 keeps a graph
/// until its weight gradient, which its order places so that a stage never holds more than
/// under 1F1B. `None` for a shape [`stage_ops`] refuses.
///
/// A closed form, not a walk over the order: the planner asks it for every stage of every
/// configuration it weighs, and the walk is `O(m)` each time. `peak_matches_the_order`
/// checks it against [`stage_ops`] itself (two batches, so that 2BW's steady state is in
/// it) for every schedule.
pub fn peak_in_flight(schedule: Schedule, stage: usize, depth: usize, m: usize) -> Option<usize> {
    if m == 0 || depth == 0 || stage >= depth || (schedule == Schedule::TwoBw && m < depth) {
        return None;
    }
    Some(match schedule {
        Schedule::GPipe => m,
        Schedule::TwoBw | Schedule::Flush | Schedule::ZbH1 => (depth - stage).min(m),
    })
}

/// Microbatches `base..base+n`: `warm` forwards, steady 1F1B, then the remaining
/// backwards; `after_b(i)` may add an op after the backward of microbatch `base + i`.
fn one_f_one_b(ops: &mut Vec<Op>, base: u64, n: u64, warm: u64, after_b: impl Fn(u64) -> Option<Op>) {
    let warm = warm.min(n);
    ops.extend((0..warm).map(|i| Op::Forward(base + i)));
    let mut b = 0;
    for f in warm..n {
        ops.push(Op::Forward(base + f));
        ops.push(Op::Backward(base + b));
        ops.extend(after_b(base + b));
        b += 1;
    }
    while b < n {
        ops.push(Op::Backward(base + b));
        ops.extend(after_b(base + b));
        b += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most microbatches an order holds between their forward and their last backward.
    fn peak_of(ops: &[Op]) -> usize {
        let (mut held, mut peak) = (0usize, 0usize);
        for &op in ops {
            match op {
                Op::Forward(_) => {
                    held += 1;
                    peak = peak.max(held);
                }
                Op::Backward(_) | Op::BackwardWeight(_) => held = held.saturating_sub(1),
                Op::BackwardInput(_) | Op::Step(_) => {}
            }
        }
        peak
    }

    #[test]
    fn stages_hold_what_their_schedule_admits() {
        let held = |s, m| (0..4).map(|k| peak_in_flight(s, k, 4, m).unwrap()).collect::<Vec<_>>();
        assert_eq!(held(Schedule::GPipe, 6), [6, 6, 6, 6]);
        assert_eq!(held(Schedule::Flush, 6), [4, 3, 2, 1]);
        assert_eq!(held(Schedule::TwoBw, 6), [4, 3, 2, 1]);
        // Fewer microbatches than stages: a flushing 1F1B holds at most m.
        assert_eq!(held(Schedule::Flush, 2), [2, 2, 2, 1]);
        assert_eq!(peak_in_flight(Schedule::TwoBw, 0, 4, 2), None);
        assert_eq!(held(Schedule::ZbH1, 8), [4, 3, 2, 1]);
        assert_eq!(held(Schedule::ZbH1, 2), [2, 2, 2, 1]);
    }

    /// `peak_in_flight`'s closed form is what each schedule's own order holds, walked op by
    /// op, for every schedule, depth and a range of `m` (`None` where the order is refused).
    #[test]
    fn peak_matches_the_order() {
        for &schedule in Schedule::ALL {
            for depth in 1..=8 {
                for m in [1, 2, 3, depth, depth + 1, 2 * depth, 16] {
                    for stage in 0..depth {
                        let walked = stage_ops(schedule, stage, depth, m, 2).ok().map(|ops| peak_of(&ops));
                        assert_eq!(walked, peak_in_flight(schedule, stage, depth, m), "{schedule:?} d={depth} m={m} stage {stage}");
                    }
                }
            }
        }
    }

    /// ZB-H1 on 3 stages, 4 microbatches: each weight gradient goes where the stage would
    /// otherwise wait or hold more than 1F1B does, after its input gradient; every
    /// microbatch runs F, then B, then W.
    #[test]
    fn zero_bubble_puts_weight_gradients_into_the_waits() {
        use Op::{BackwardInput as B, BackwardWeight as W, Forward as F};
        let ops = |k| stage_ops(Schedule::ZbH1, k, 3, 4, 1).unwrap();
        assert_eq!(ops(2), [F(0), B(0), W(0), F(1), B(1), W(1), F(2), B(2), W(2), F(3), B(3), W(3), Op::Step(0)]);
        assert_eq!(ops(1), [F(0), F(1), B(0), W(0), F(2), B(1), W(1), F(3), B(2), W(2), B(3), W(3), Op::Step(0)]);
        assert_eq!(ops(0), [F(0), F(1), F(2), B(0), W(0), F(3), B(1), W(1), B(2), W(2), B(3), W(3), Op::Step(0)]);
        for k in 0..3 {
            let flat: Vec<Op> = ops(k);
            for j in 0..4 {
                let at = |o: Op| flat.iter().position(|x| *x == o).unwrap();
                assert!(at(F(j)) < at(B(j)) && at(B(j)) < at(W(j)), "stage {k}, microbatch {j}: {flat:?}");
            }
        }
    }
}
