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
