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
            for t in start as u64..steps as u64 {
                zb_h1(&mut ops, t * m64, m64, warm as u64);
                ops.push(Op::Step(t));
            }
        }
    }
    Ok(ops)
}

/// One batch of ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) on a stage
/// `warm` stages from the last: 1F1B's order of forwards and input gradients, each weight
/// gradient `warm` input gradients after its own, and the `warm` left over at the end,
/// where 1F1B's stage would wait for the gradients of the flush. The last stage runs each
/// weight gradient right after its input gradient.
fn zb_h1(ops: &mut Vec<Op>, base: u64, n: u64, warm: u64) {
    let mut split = Vec::new();
    one_f_one_b(&mut split, base, n, warm, |_| None);
    let mut done = 0;
    for op in split {
        match op {
            Op::Backward(j) => {
                ops.push(Op::BackwardInput(j));
                if j - base >= warm {
                    ops.push(Op::BackwardWeight(base + done));
                    done += 1;
                }
            }
            other => ops.push(other),
        }
    }
    ops.extend((base + done..base + n).map(Op::BackwardWeight));
}

/// The most microbatches stage `stage` of `depth` holds between their forward and their
/// backward at once under `schedule` with `m` microbatches per batch: what its stashed
/// activations are counted by. Read off [`stage_ops`] itself (two batches, so that 2BW's
/// steady state, which never flushes, is in it): GPipe `m`, 1F1B `min(depth - stage, m)`,
/// ZB-H1 `min(2 (depth - stage) - 1, m)` (a microbatch's forward graph lives until its
/// weight gradient).
/// `None` for a shape [`stage_ops`] refuses.
pub fn peak_in_flight(schedule: Schedule, stage: usize, depth: usize, m: usize) -> Option<usize> {
    let ops = stage_ops(schedule, stage, depth, m, 2).ok()?;
    let (mut held, mut peak) = (0usize, 0usize);
    for op in ops {
        match op {
            Op::Forward(_) => {
                held += 1;
                peak = peak.max(held);
            }
            Op::Backward(_) | Op::BackwardWeight(_) => held = held.saturating_sub(1),
            Op::BackwardInput(_) | Op::Step(_) => {}
        }
    }
    Some(peak)
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

    #[test]
    fn stages_hold_what_their_schedule_admits() {
        let held = |s, m| (0..4).map(|k| peak_in_flight(s, k, 4, m).unwrap()).collect::<Vec<_>>();
        assert_eq!(held(Schedule::GPipe, 6), [6, 6, 6, 6]);
        assert_eq!(held(Schedule::Flush, 6), [4, 3, 2, 1]);
        assert_eq!(held(Schedule::TwoBw, 6), [4, 3, 2, 1]);
        // Fewer microbatches than stages: a flushing 1F1B holds at most m.
        assert_eq!(held(Schedule::Flush, 2), [2, 2, 2, 1]);
        assert_eq!(peak_in_flight(Schedule::TwoBw, 0, 4, 2), None);
        assert_eq!(held(Schedule::ZbH1, 8), [7, 5, 3, 1]);
        assert_eq!(held(Schedule::ZbH1, 4), [4, 4, 3, 1]);
    }

    /// ZB-H1 on 3 stages, 4 microbatches: the last stage runs each W after its B, the
    /// first defers two, every microbatch gets one B and one W after its F, in order.
    #[test]
    fn zero_bubble_defers_weight_gradients_into_the_flush() {
        use Op::{BackwardInput as B, BackwardWeight as W, Forward as F};
        let ops = |k| stage_ops(Schedule::ZbH1, k, 3, 4, 1).unwrap();
        assert_eq!(ops(2), [F(0), B(0), W(0), F(1), B(1), W(1), F(2), B(2), W(2), F(3), B(3), W(3), Op::Step(0)]);
        assert_eq!(ops(1), [F(0), F(1), B(0), F(2), B(1), W(0), F(3), B(2), W(1), B(3), W(2), W(3), Op::Step(0)]);
        assert_eq!(ops(0), [F(0), F(1), F(2), B(0), F(3), B(1), B(2), W(0), B(3), W(1), W(2), W(3), Op::Step(0)]);
        for k in 0..3 {
            let flat: Vec<Op> = ops(k);
            for j in 0..4 {
                let at = |o: Op| flat.iter().position(|x| *x == o).unwrap();
                assert!(at(F(j)) < at(B(j)) && at(B(j)) < at(W(j)), "stage {k}, microbatch {j}: {flat:?}");
            }
        }
    }
}
