//! Per-stage operation sequences for the three pipeline schedules: what each stage runs, in
//! order. The runtime's executor runs them and `pipewright simulate` replays them, so both
//! use this one generator (plain Rust, no libtorch).

use crate::Schedule;

/// One step of a stage's work. Microbatch indices are 0-based and global over training;
/// `Step(t)` applies the update of batch `t` (0-based) and creates weight version `t + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Forward(u64),
    Backward(u64),
    Step(u64),
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
    }
    Ok(ops)
}

/// The most microbatches stage `stage` of `depth` holds between their forward and their
/// backward at once under `schedule` with `m` microbatches per batch: what its stashed
/// activations are counted by. Read off [`stage_ops`] itself (two batches, so that 2BW's
/// steady state, which never flushes, is in it): GPipe `m`, 1F1B `min(depth - stage, m)`.
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
            Op::Backward(_) => held = held.saturating_sub(1),
            Op::Step(_) => {}
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
    }
}
