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
    if schedule.virtual_stages() > 1 {
        schedule.workers(depth)?;
        let worker = worker_ops_from(schedule, schedule.worker_of(stage, depth), depth, m, start, steps)?;
        return Ok(worker.into_iter().filter(|&(k, _)| k == stage).map(|(_, op)| op).collect());
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
        Schedule::ZbH1 | Schedule::ZbH2 => {
            // Every batch runs the same order: made once.
            let batch = zero_bubble(schedule, m64, depth)?.swap_remove(stage);
            ops = stage_batches(&batch, m64, start, steps);
        }
        Schedule::Interleaved2 | Schedule::Interleaved4 | Schedule::ZbV => unreachable!("orders of several stages per worker are made per worker above"),
    }
    Ok(ops)
}

/// The workers an interleaved pipeline of `depth` stages runs on with `m` microbatches
/// per batch, or why it cannot: its order sends microbatches round the workers in groups
/// of one per worker, so `m` must be a multiple of the workers (as in Megatron-LM).
fn interleaved_workers(schedule: Schedule, depth: usize, m: usize) -> Result<usize, String> {
    let workers = schedule.workers(depth)?;
    if m % workers != 0 {
        return Err(format!("{schedule} sends microbatches round its {workers} workers in groups of {workers}, so the microbatches per batch must be a multiple of {workers} (m = {m})"));
    }
    Ok(workers)
}

/// What worker `worker` runs, in order, for batches `start..steps`: `(stage, op)` pairs.
/// A worker runs `v` stages of the `depth` ([`Schedule::virtual_stages`], placed by
/// [`Schedule::worker_of`]); for every schedule but interleaved 1F1B and ZB-V that is the
/// one stage `worker`, whose order is [`stage_ops_from`]'s. A batch of theirs ends with a
/// `Step` of each of the worker's stages, after all their backwards.
pub fn worker_ops_from(schedule: Schedule, worker: usize, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<(usize, Op)>, String> {
    let v = schedule.virtual_stages();
    if v == 1 {
        return Ok(stage_ops_from(schedule, worker, depth, m, start, steps)?.into_iter().map(|op| (worker, op)).collect());
    }
    let workers = shared_workers(schedule, depth, m, start, steps)?;
    if worker >= workers {
        return Err(format!("invalid schedule shape: worker {worker} of {workers}"));
    }
    let batch = match schedule {
        Schedule::ZbV => zb_v_orders(workers, m)?.swap_remove(worker),
        _ => interleaved_batch(worker, workers, v, m),
    };
    Ok(batches_of(schedule, worker, depth, &batch, m, start, steps))
}

/// [`worker_ops_from`] of every worker at once: ZB-V's orders come from one replay of the
/// whole pipeline, made once here rather than once per worker.
pub fn worker_orders(schedule: Schedule, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<Vec<(usize, Op)>>, String> {
    if schedule != Schedule::ZbV {
        return (0..schedule.workers(depth)?).map(|r| worker_ops_from(schedule, r, depth, m, start, steps)).collect();
    }
    let workers = shared_workers(schedule, depth, m, start, steps)?;
    let orders = zb_v_orders(workers, m)?;
    Ok(orders.iter().enumerate().map(|(r, batch)| batches_of(schedule, r, depth, batch, m, start, steps)).collect())
}

/// Every stage's order ([`stage_ops_from`]) at once, each worker's order made once.
pub fn stage_orders(schedule: Schedule, depth: usize, m: usize, start: usize, steps: usize) -> Result<Vec<Vec<Op>>, String> {
    if matches!(schedule, Schedule::ZbH1 | Schedule::ZbH2) && m > 0 && depth > 0 && start <= steps {
        // One replay of the whole pipeline gives every stage's batch.
        let batches = zero_bubble(schedule, m as u64, depth)?;
        return Ok(batches.iter().map(|batch| stage_batches(batch, m as u64, start, steps)).collect());
    }
    if schedule.virtual_stages() == 1 {
        return (0..depth).map(|k| stage_ops_from(schedule, k, depth, m, start, steps)).collect();
    }
    let mut stages = vec![Vec::new(); depth];
    for order in worker_orders(schedule, depth, m, start, steps)? {
        for (k, op) in order {
            stages[k].push(op);
        }
    }
    Ok(stages)
}

/// The workers of a pipeline of several stages per worker, checking its shape.
fn shared_workers(schedule: Schedule, depth: usize, m: usize, start: usize, steps: usize) -> Result<usize, String> {
    if m == 0 || start > steps {
        return Err(format!("invalid schedule shape: depth {depth}, m {m}"));
    }
    match schedule {
        Schedule::ZbV => schedule.workers(depth),
        _ => interleaved_workers(schedule, depth, m),
    }
}

/// [`zb_v`], its error naming the shape.
fn zb_v_orders(workers: usize, m: usize) -> Result<Vec<Vec<(usize, Op)>>, String> {
    zb_v(workers, m).map_err(|e| format!("{} on {workers} workers, m = {m}: {e}", Schedule::ZbV))
}

/// A stage's order for batches `start..steps` from one batch's (batch-local microbatches,
/// `m` of them), each batch ending with its step.
fn stage_batches(batch: &[Op], m: u64, start: usize, steps: usize) -> Vec<Op> {
    (start as u64..steps as u64).flat_map(|t| batch.iter().map(move |&op| shifted(op, t * m)).chain([Op::Step(t)])).collect()
}

/// Worker `worker`'s order for batches `start..steps` from one batch's (batch-local
/// microbatches), each batch ending with a step of each of its stages.
fn batches_of(schedule: Schedule, worker: usize, depth: usize, batch: &[(usize, Op)], m: usize, start: usize, steps: usize) -> Vec<(usize, Op)> {
    let m64 = m as u64;
    let stages = schedule.stages_of(worker, depth);
    let mut ops = Vec::with_capacity((steps - start) * (batch.len() + stages.len()));
    for t in start as u64..steps as u64 {
        ops.extend(batch.iter().map(|&(k, op)| (k, shifted(op, t * m64))));
        ops.extend(stages.iter().map(|&k| (k, Op::Step(t))));
    }
    ops
}

/// One batch of interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model
/// Training on GPU Clusters Using Megatron-LM", 2021) on worker `worker` of `workers`, `v`
/// stages each, `m` microbatches (a multiple of `workers`): `(stage, op)` pairs with
/// batch-local microbatches. The worker's `k`-th forward runs microbatch
/// `(k / (workers v)) workers + k % workers` on its chunk `(k / workers) % v`, so
/// microbatches go round the chunks in groups of `workers`; its `k`-th backward runs the
/// same microbatch on the chunks in reverse. Warm-up forwards: `2 (workers - 1 - worker)
/// + (v - 1) workers` (at most all); then one forward and one backward in turn, then the
/// remaining backwards. (Megatron-LM runs every forward first when `m = workers`, for its
/// paired blocking sends; this executor's sends do not block, and
/// `interleaved_orders_never_wait_on_themselves` replays `m = workers` to its end.)
fn interleaved_batch(worker: usize, workers: usize, v: usize, m: usize) -> Vec<(usize, Op)> {
    let (p, total) = (workers, m * v);
    let at = |k: usize, backward: bool| {
        let chunk = (k / p) % v;
        let chunk = if backward { v - 1 - chunk } else { chunk };
        let mb = ((k / (p * v)) * p + k % p) as u64;
        (worker + chunk * p, if backward { Op::Backward(mb) } else { Op::Forward(mb) })
    };
    let warm = (2 * (p - 1 - worker) + (v - 1) * p).min(total);
    let mut ops: Vec<(usize, Op)> = (0..warm).map(|k| at(k, false)).collect();
    for k in 0..total - warm {
        ops.push(at(warm + k, false));
        ops.push(at(k, true));
    }
    ops.extend((total - warm..total).map(|k| at(k, true)));
    ops
}

/// One batch of ZB-H1 or ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) on
/// each stage of `depth`: 1F1B's order of forwards and input gradients (with
/// [`zero_bubble_bounds`]' warm-up forwards), with each weight gradient put into a wait.
/// The order is that of a replay of the whole pipeline (free links) in which a forward,
/// input gradient and weight gradient take one tick each, but the first stage's, which
/// does not split its backward ([`Schedule::splits_stage_backward`]): its input gradient
/// takes none and its weight gradient, the whole backward, two. A weight gradient that
/// [`runs_at_once`] follows its input gradient; any other waits: a stage whose next
/// forward or input gradient is not ready runs its oldest waiting weight gradient instead,
/// as does one whose next forward would hold more graphs than the bound (a graph lives
/// until its weight gradient), and those still waiting when its input gradients are done
/// end the batch.
fn zero_bubble(schedule: Schedule, n: u64, depth: usize) -> Result<Vec<Vec<Op>>, String> {
    let ticks = |s: usize, op: Op| match op {
        _ if schedule.splits_stage_backward(s) => 1,
        Op::Backward(_) => 0,
        Op::BackwardWeight(_) => 2,
        _ => 1,
    };
    // Per stage: its forwards and input gradients in 1F1B order (batch-local indices).
    let orders: Vec<Vec<Op>> = (0..depth)
        .map(|s| {
            let mut o = Vec::new();
            one_f_one_b(&mut o, 0, n, zero_bubble_bounds(schedule, s, depth).0, |_| None);
            o
        })
        .collect();
    // The tick each stage's forward / input gradient of microbatch j ends.
    let mut fwd_end = vec![vec![None; n as usize]; depth];
    let mut bwd_end = vec![vec![None; n as usize]; depth];
    let mut next = vec![0usize; depth];
    // Per stage: graphs held (forwards run, weight gradients not yet), the microbatches
    // whose weight gradient waits (with the tick it may run from), and the tick its
    // running operation ends.
    let mut held = vec![0usize; depth];
    let mut waiting: Vec<std::collections::VecDeque<(u64, u64)>> = vec![std::collections::VecDeque::new(); depth];
    let mut free_at = vec![0u64; depth];
    let mut orders_run = vec![Vec::with_capacity(3 * n as usize); depth];
    let (total, mut ran) = (3 * n as usize * depth, 0usize);
    let mut tick: u64 = 0;
    while ran < total {
        for s in 0..depth {
            while free_at[s] <= tick {
                let done_by = |end: Option<u64>| end.is_some_and(|t| t <= tick);
                let ready = |op: Op| match op {
                    Op::Forward(j) => s == 0 || done_by(fwd_end[s - 1][j as usize]),
                    Op::Backward(j) => s + 1 == depth || done_by(bwd_end[s + 1][j as usize]),
                    _ => false,
                };
                // A forward past the bound waits for a weight gradient.
                let room = |op: Op| !matches!(op, Op::Forward(_)) || held[s] < zero_bubble_bounds(schedule, s, depth).1 || waiting[s].is_empty();
                let now = waiting[s].front().is_some_and(|&(j, at)| at <= tick && runs_at_once(schedule, s, depth, j, n));
                let op = match orders[s].get(next[s]).copied() {
                    Some(op) if ready(op) && room(op) && !now => {
                        next[s] += 1;
                        op
                    }
                    _ => match waiting[s].front() {
                        Some(&(j, at)) if at <= tick => {
                            waiting[s].pop_front();
                            Op::BackwardWeight(j)
                        }
                        _ => break,
                    },
                };
                let end = tick + ticks(s, op);
                match op {
                    Op::Forward(j) => {
                        fwd_end[s][j as usize] = Some(end);
                        held[s] += 1;
                    }
                    Op::Backward(j) => {
                        bwd_end[s][j as usize] = Some(end);
                        waiting[s].push_back((j, end));
                    }
                    _ => held[s] = held[s].saturating_sub(1),
                }
                free_at[s] = end;
                ran += 1;
                // The replay's input gradients are the schedule's `BackwardInput`.
                orders_run[s].push(if let Op::Backward(j) = op { Op::BackwardInput(j) } else { op });
            }
        }
        if ran < total && free_at.iter().all(|&t| t <= tick) {
            return Err(format!("the replay that orders {schedule} stopped at tick {tick} with {ran} of {total} operations run"));
        }
        tick += 1;
    }
    Ok(orders_run)
}

/// Whether stage `stage`'s weight gradient of batch-local microbatch `j` (of `n`) runs as
/// soon as its input gradient has, before the stage's next forward or input gradient. A
/// stage that does not split its backward only takes the output gradients at its input
/// gradient (no time), so its whole backward always follows at once. Under ZB-H2 a
/// splitting stage keeps back only the weight gradients of the batch's last microbatches,
/// as many as it may hold graphs ([`zero_bubble_bounds`]), for the batch's end: one kept
/// back from the middle of the batch would only hold its graph longer (one more graph
/// live in the middle of the batch, and measured slower on gpt2-tiny's last stage: a
/// weight gradient that runs right after its input gradient finds what it reads in
/// cache), and the end has as many to run either way.
fn runs_at_once(schedule: Schedule, stage: usize, depth: usize, j: u64, n: u64) -> bool {
    if !schedule.splits_stage_backward(stage) {
        return true;
    }
    schedule == Schedule::ZbH2 && j + (zero_bubble_bounds(schedule, stage, depth).1 as u64) < n
}

/// Stage `stage`'s warm-up forwards and the most graphs it may hold under a zero-bubble
/// schedule of one stage per worker: ZB-H1 holds what 1F1B's stage holds (`d - 1 - s`
/// warm-up forwards, `d - s` graphs); ZB-H2 runs `2(d - 1 - s)` warm-up forwards (so a
/// stage waits less for its first input gradient) and lets every stage hold up to `2d -
/// 1` graphs, as the paper's ZB-H2 does its first: weight gradients wait longer, for the
/// ends of the batch, where the flush would leave the stage idle.
///
/// Two stages differ from the paper's, from what the runtime does. The first stage does
/// not split its backward, so nothing of its own can fill a wait for its first input
/// gradient, which comes back after a forward on every stage and an input gradient on
/// every later one: `2(d - 1)` warm-up forwards would cover that only if an input
/// gradient took no longer than a forward, and it takes longer (about 1.2 forwards on
/// gpt2-tiny's last stage), so it runs one more, `2d - 1`. The last stage may hold `2d +
/// 1` graphs: the update is synchronous, so between stage `s`'s last input gradient and
/// its next batch's first forward the gradient goes back through the stages before it
/// (`s - 1` ticks), the first stage runs its whole backward (2), updates (about one) and
/// the forward comes down again (`s` ticks): `2s + 2` ticks, which its kept-back weight
/// gradients fill, within `2d - 1` on every stage but the last; on the last, `2d` weight
/// gradients would fill them only if one took as long as a forward, and it takes less
/// (about 0.6 of one on gpt2-tiny's last stage), so it keeps one more.
fn zero_bubble_bounds(schedule: Schedule, stage: usize, depth: usize) -> (u64, usize) {
    match schedule {
        Schedule::ZbH2 => {
            let first = stage == 0 && depth > 1 && !schedule.splits_stage_backward(stage);
            let warm = 2 * (depth - 1 - stage) + usize::from(first);
            let bound = if stage + 1 == depth { 2 * depth + 1 } else { 2 * depth - 1 };
            (warm as u64, bound)
        }
        _ => ((depth - 1 - stage) as u64, depth - stage),
    }
}

/// One batch of ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) on `p`
/// workers, `m` microbatches: per worker, its `(stage, op)` pairs in order, batch-local.
/// The `2p` stages sit in a V (worker `k` runs stages `k` and `2p - 1 - k`,
/// [`Schedule::worker_of`]), so worker 0 runs the first and the last stage and each
/// microbatch's forward goes down the workers and back up, its backward the same in
/// reverse. Each backward is split into the input gradient (`BackwardInput`, sent on at
/// once) and the weight gradient (`BackwardWeight`). The order is that of a replay in unit
/// times (every forward, input gradient and weight gradient one tick, free links): each
/// tick a worker runs the first of its ready input gradients (oldest microbatch, then the
/// later stage), else a ready forward while it holds fewer than `2p` graphs (a graph lives
/// until its weight gradient; `2p` is what 1F1B's first worker holds: `p` microbatches of
/// a stage twice the size), else its oldest waiting weight gradient.
fn zb_v(p: usize, m: usize) -> Result<Vec<Vec<(usize, Op)>>, String> {
    let mut orders: Vec<Vec<(usize, Op)>> = vec![Vec::with_capacity(6 * m); p];
    zb_v_replay(p, m, |r, s, op| orders[r].push((s, op)))?;
    Ok(orders)
}

/// Every stage's [`Holding`]s under ZB-V on `p` workers, walked during the replay
/// ([`zb_v_replay`]) without making the orders.
fn zb_v_holdings(p: usize, m: usize) -> Result<Vec<Vec<Holding>>, String> {
    let depth = 2 * p;
    let mut stages: Vec<HoldWalk> = (0..depth).map(|s| HoldWalk::new(Schedule::ZbV.splits_stage_backward(s))).collect();
    zb_v_replay(p, m, |_, s, op| stages[s].run(op))?;
    Ok(stages.into_iter().map(HoldWalk::holdings).collect())
}

/// The replay [`zb_v`] orders by: calls `ran(worker, stage, op)` for each operation in the
/// order each worker runs them.
fn zb_v_replay(p: usize, m: usize, mut ran_op: impl FnMut(usize, usize, Op)) -> Result<(), String> {
    let depth = 2 * p;
    let worker_of = |s: usize| Schedule::ZbV.worker_of(s, depth);
    let limit = 2 * p;
    // Per stage: the tick each microbatch's forward / input gradient ended.
    let mut fwd_end = vec![vec![None; m]; depth];
    let mut bwd_end = vec![vec![None; m]; depth];
    let (mut fnext, mut bnext) = (vec![0usize; depth], vec![0usize; depth]);
    let mut waiting: Vec<std::collections::VecDeque<usize>> = vec![std::collections::VecDeque::new(); depth];
    let mut held = vec![0usize; p];
    let total = 3 * depth * m;
    let (mut ran_total, mut tick) = (0usize, 0u64);
    // This tick's operations: they end at its end, so none of them enables another now.
    let mut ran = Vec::with_capacity(p);
    while ran_total < total {
        ran.clear();
        for r in 0..p {
            // This worker's stages, the later one first.
            let mine = [depth - 1 - r, r];
            let done_before = |end: &Option<u64>| end.is_some_and(|t| t <= tick);
            let backward = mine.iter().copied().filter(|&s| {
                let j = bnext[s];
                j < m && done_before(&fwd_end[s][j]) && (s + 1 == depth || done_before(&bwd_end[s + 1][j]))
            });
            let backward = backward.min_by_key(|&s| (bnext[s], std::cmp::Reverse(s)));
            let forward = || {
                mine.iter().copied().filter(|&s| fnext[s] < m && (s == 0 || done_before(&fwd_end[s - 1][fnext[s]]))).min_by_key(|&s| (fnext[s], std::cmp::Reverse(s)))
            };
            let weight = || mine.iter().copied().filter(|&s| !waiting[s].is_empty()).min_by_key(|&s| (waiting[s][0], std::cmp::Reverse(s)));
            let op = if let Some(s) = backward {
                bnext[s] += 1;
                Some((s, Op::BackwardInput((bnext[s] - 1) as u64)))
            } else if let Some(s) = forward().filter(|_| held[r] < limit) {
                fnext[s] += 1;
                held[r] += 1;
                Some((s, Op::Forward((fnext[s] - 1) as u64)))
            } else if let Some(s) = weight() {
                let j = waiting[s].pop_front().unwrap_or_default();
                held[r] -= 1;
                Some((s, Op::BackwardWeight(j as u64)))
            } else {
                None
            };
            if let Some((s, op)) = op {
                debug_assert_eq!(worker_of(s), r);
                ran_op(r, s, op);
                ran.push((s, op));
            }
        }
        if ran.is_empty() {
            return Err(format!("the replay that orders it stopped at tick {tick} with {} of {total} operations run", ran_total));
        }
        tick += 1;
        ran_total += ran.len();
        for &(s, op) in &ran {
            match op {
                Op::Forward(j) => fwd_end[s][j as usize] = Some(tick),
                Op::BackwardInput(j) => {
                    bwd_end[s][j as usize] = Some(tick);
                    waiting[s].push_back(j as usize);
                }
                _ => {}
            }
        }
    }
    Ok(())
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
/// A closed form, not a walk over the order, for the schedules of one stage per worker
/// but ZB-H2: the planner asks it for every stage of every configuration it weighs, and
/// the walk is `O(m)` each time (interleaved 1F1B, ZB-V and ZB-H2, whose replay sets how
/// far below its bound each stage stays, are walked; [`peaks_in_flight`] remembers them).
/// `peak_matches_the_order` checks it against [`stage_ops`] itself (two batches, so that 2BW's steady state is in
/// it) for every schedule.
pub fn peak_in_flight(schedule: Schedule, stage: usize, depth: usize, m: usize) -> Option<usize> {
    if m == 0 || depth == 0 || stage >= depth || (schedule == Schedule::TwoBw && m < depth) {
        return None;
    }
    Some(match schedule {
        Schedule::GPipe => m,
        Schedule::TwoBw | Schedule::Flush | Schedule::ZbH1 => (depth - stage).min(m),
        // Walked over one batch of the stage's own order (they flush, so one batch is every
        // batch); `peaks_in_flight` walks every stage at once.
        Schedule::ZbH2 | Schedule::Interleaved2 | Schedule::Interleaved4 | Schedule::ZbV => held_at_most(&stage_ops(schedule, stage, depth, m, 1).ok()?),
    })
}

/// The most microbatches stage `stage` of `depth` holds at once while its batch's weight
/// gradients exist (from its first weight gradient to its step) under `schedule` with `m`
/// microbatches per batch: [`peak_in_flight`] where a forward follows the stage's first
/// weight gradient, one less where none does. A stage's memory peaks at the larger of its
/// weights and state with [`peak_in_flight`]'s activations, and with the gradient too and
/// this many. GPipe runs every forward before its first backward (`m - 1`); 1F1B's stage
/// `k` runs a forward after its first backward only when `m > d - k`, and ZB-H1's weight
/// gradients follow its input gradients there; 2BW, which never flushes, runs the next
/// batch's forwards before the step (but with one microbatch per batch). `None` where
/// [`peak_in_flight`] is. Checked against the orders by
/// `gradient_peak_matches_the_order`.
pub fn peak_in_flight_with_gradient(schedule: Schedule, stage: usize, depth: usize, m: usize) -> Option<usize> {
    let peak = peak_in_flight(schedule, stage, depth, m)?;
    Some(match schedule {
        Schedule::GPipe => m - 1,
        // 2BW never flushes: the next batch's forwards run before this batch's step, but
        // for one microbatch per batch (one stage), whose step comes between.
        Schedule::TwoBw => peak - usize::from(m == 1),
        Schedule::Flush | Schedule::ZbH1 => peak - usize::from(m <= depth - stage),
        Schedule::ZbH2 | Schedule::Interleaved2 | Schedule::Interleaved4 | Schedule::ZbV => held_peaks(&stage_ops(schedule, stage, depth, m, 1).ok()?).1,
    })
}

/// [`peak_in_flight`] of every stage of a pipeline at once: the orders of interleaved
/// 1F1B and ZB-V (one replay of the whole pipeline) are made once here rather than once
/// per stage, and remembered per `(schedule, depth, m)` for the process: the planner asks
/// for the same pipeline's peaks for every configuration of it that it weighs. Past `m =
/// 4p` (`p` workers) their peaks no longer grow (the warm-up, which sets them, is over by
/// then), so a larger `m` is answered from `4p`'s order
/// (`holdings_stop_changing_past_four_microbatches_per_worker` checks it up to 32 workers).
pub fn peaks_in_flight(schedule: Schedule, depth: usize, m: usize) -> Vec<Option<usize>> {
    holdings_in_flight(schedule, depth, m).iter().map(|h| h.as_deref().map(|h| peak_of(h).0)).collect()
}

/// [`peak_in_flight_with_gradient`] of every stage of a pipeline at once, made and
/// remembered as [`peaks_in_flight`] are.
pub fn peaks_in_flight_with_gradient(schedule: Schedule, depth: usize, m: usize) -> Vec<Option<usize>> {
    holdings_in_flight(schedule, depth, m).iter().map(|h| h.as_deref().map(|h| peak_of(h).1)).collect()
}

/// What a stage holds at one moment of its order, as the memory of its microbatches
/// counts it: those whose forward's whole state is held, those of a stage that splits
/// its backward between their input and weight gradients (which hold less or more than a
/// whole one: the runtime then keeps only the weight gradients' operands and the kept
/// output gradients, or those with the whole graph where a weight gradient needs it), and
/// whether the batch's weight gradients exist then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Holding {
    pub whole: usize,
    pub awaiting: usize,
    pub gradient: bool,
}

impl Holding {
    /// Microbatches held, of either kind.
    pub fn total(self) -> usize {
        self.whole + self.awaiting
    }

    /// Whether a stage holding `self` holds at least what `other` does, whatever either
    /// kind of microbatch weighs.
    fn covers(self, other: Holding) -> bool {
        self.whole >= other.whole && self.awaiting >= other.awaiting && (self.gradient || !other.gradient)
    }
}

/// Every stage's [`Holding`]s under `schedule` with `m` microbatches per batch: those no
/// other moment of its order covers, so that the stage's memory peaks at one of them
/// whatever its kinds of microbatch weigh. `None` for a shape [`stage_ops`] refuses.
/// Remembered, and past `4p` microbatches answered from `4p`'s order, as
/// [`peaks_in_flight`] are: the peaks are the same; ZB-V's steady state on 12 or 24
/// workers moves one microbatch between the two kinds on some stages
/// (`holdings_stop_changing_past_four_microbatches_per_worker`).
pub fn holdings_in_flight(schedule: Schedule, depth: usize, m: usize) -> std::sync::Arc<[Option<Vec<Holding>>]> {
    let walked = schedule.virtual_stages() > 1 || schedule.splits_backward();
    let p = match (walked, schedule.virtual_stages()) {
        (false, _) | (true, 1) => depth,
        _ => match shared_workers(schedule, depth, m, 0, 1) {
            Ok(p) => p,
            Err(_) => return vec![None; depth].into(),
        },
    };
    let m = if walked { m.min(SETTLED_PER_WORKER * p) } else { m };
    // Shared, not copied: the planner asks for the same pipeline's for every
    // configuration of it it weighs.
    type Known = std::collections::HashMap<(Schedule, usize, usize), std::sync::Arc<[Option<Vec<Holding>>]>>;
    static KNOWN: std::sync::OnceLock<std::sync::Mutex<Known>> = std::sync::OnceLock::new();
    let known = KNOWN.get_or_init(Default::default);
    if let Some(h) = known.lock().unwrap_or_else(|p| p.into_inner()).get(&(schedule, depth, m)) {
        return h.clone();
    }
    let closed = |k: usize| {
        let (peak, after) = (peak_in_flight(schedule, k, depth, m)?, peak_in_flight_with_gradient(schedule, k, depth, m)?);
        let mut walk = HoldWalk::new(false);
        walk.note(Holding { whole: peak, awaiting: 0, gradient: false });
        walk.note(Holding { whole: after, awaiting: 0, gradient: true });
        Some(walk.holdings())
    };
    let holdings: std::sync::Arc<[Option<Vec<Holding>>]> = match schedule {
        _ if !walked => (0..depth).map(closed).collect(),
        // Walked during the replay: its orders are not needed here.
        Schedule::ZbV => match zb_v_holdings(p, m) {
            Ok(h) => h.into_iter().map(Some).collect(),
            Err(_) => vec![None; depth].into(),
        },
        _ => match stage_orders(schedule, depth, m, 0, 1) {
            Ok(orders) => orders.iter().enumerate().map(|(k, ops)| Some(walk_holdings(ops, schedule.splits_stage_backward(k)))).collect(),
            Err(_) => vec![None; depth].into(),
        },
    };
    known.lock().unwrap_or_else(|p| p.into_inner()).insert((schedule, depth, m), holdings.clone());
    holdings
}

/// The most microbatches held at any of `holdings`, and at those with the gradient (0
/// where none has it).
fn peak_of(holdings: &[Holding]) -> (usize, usize) {
    let peak = holdings.iter().map(|h| h.total()).max().unwrap_or(0);
    let with_gradient = holdings.iter().filter(|h| h.gradient).map(|h| h.total()).max().unwrap_or(0);
    (peak, with_gradient)
}

/// A walk over a stage's order that keeps the [`Holding`]s no other covers.
struct HoldWalk {
    /// Whether the stage splits its backward: its input gradient turns a whole
    /// microbatch into an awaiting one; otherwise it takes only the output gradients.
    splits: bool,
    now: Holding,
    kept: Vec<Holding>,
}

impl HoldWalk {
    fn new(splits: bool) -> HoldWalk {
        HoldWalk { splits, now: Holding::default(), kept: Vec::new() }
    }

    fn run(&mut self, op: Op) {
        let h = &mut self.now;
        match op {
            Op::Forward(_) => h.whole += 1,
            Op::Backward(_) => {
                h.whole = h.whole.saturating_sub(1);
                h.gradient = true;
            }
            Op::BackwardInput(_) if self.splits => {
                h.whole = h.whole.saturating_sub(1);
                h.awaiting += 1;
            }
            Op::BackwardInput(_) => {}
            Op::BackwardWeight(_) => {
                if self.splits {
                    h.awaiting = h.awaiting.saturating_sub(1);
                } else {
                    h.whole = h.whole.saturating_sub(1);
                }
                h.gradient = true;
            }
            Op::Step(_) => h.gradient = false,
        }
        let now = self.now;
        self.note(now);
    }

    fn note(&mut self, h: Holding) {
        if self.kept.iter().any(|k| k.covers(h)) {
            return;
        }
        self.kept.retain(|k| !h.covers(*k));
        self.kept.push(h);
    }

    /// The kept holdings that can be a stage's peak: of those alike in `gradient`, only the
    /// corners of their upper hull, since the memory is linear in the two counts with
    /// non-negative weights (a holding on or below the segment between two others never
    /// holds more than both).
    fn holdings(self) -> Vec<Holding> {
        let mut out = Vec::with_capacity(self.kept.len());
        for gradient in [true, false] {
            let mut class: Vec<Holding> = self.kept.iter().copied().filter(|h| h.gradient == gradient).collect();
            // None covers another: by more whole microbatches, fewer awaiting ones.
            class.sort_by_key(|h| h.whole);
            let mut hull: Vec<Holding> = Vec::with_capacity(class.len());
            for h in class {
                while let [.., a, b] = hull[..] {
                    // `b` is dropped when it lies on or below the segment from `a` to `h`.
                    let cross = (b.whole as i64 - a.whole as i64) * (h.awaiting as i64 - a.awaiting as i64) - (b.awaiting as i64 - a.awaiting as i64) * (h.whole as i64 - a.whole as i64);
                    if cross >= 0 {
                        hull.pop();
                    } else {
                        break;
                    }
                }
                hull.push(h);
            }
            out.extend(hull);
        }
        out
    }
}

/// [`HoldWalk`] over `ops`.
fn walk_holdings(ops: &[Op], splits: bool) -> Vec<Holding> {
    let mut walk = HoldWalk::new(splits);
    ops.iter().for_each(|&op| walk.run(op));
    walk.holdings()
}

/// Microbatches per worker past which the peaks of interleaved 1F1B and ZB-V stop growing
/// ([`peaks_in_flight`]); a multiple of 1, so `m` capped there stays a multiple of `p`.
const SETTLED_PER_WORKER: usize = 4;

/// The most microbatches `ops` holds between their forward and their last backward.
fn held_at_most(ops: &[Op]) -> usize {
    held_peaks(ops).0
}

/// The most microbatches `ops` holds between their forward and their last backward, and
/// the most it holds while its batch's weight gradients exist: from the batch's first op
/// that makes one (a whole backward or a weight gradient) to its step, which takes them
/// (the runtime frees a stage's accumulated gradients at each update and allocates them
/// again with the next batch's first weight gradient).
fn held_peaks(ops: &[Op]) -> (usize, usize) {
    peak_of(&walk_holdings(ops, false))
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
                        let walked = stage_ops(schedule, stage, depth, m, 2).ok().map(|ops| held_at_most(&ops));
                        assert_eq!(walked, peak_in_flight(schedule, stage, depth, m), "{schedule:?} d={depth} m={m} stage {stage}");
                    }
                }
            }
        }
    }

    /// The closed form of the peak while a batch's weight gradients exist is what the
    /// orders hold from each batch's first weight gradient to its step (two batches, so
    /// that 2BW's steady state is in it), and never more than the peak.
    #[test]
    fn gradient_peak_matches_the_order() {
        for &schedule in Schedule::ALL {
            for depth in 1..=8 {
                for m in [1, 2, 3, depth, depth + 1, 2 * depth, 16] {
                    for stage in 0..depth {
                        let walked = stage_ops(schedule, stage, depth, m, 2).ok().map(|ops| held_peaks(&ops).1);
                        let closed = peak_in_flight_with_gradient(schedule, stage, depth, m);
                        assert_eq!(walked, closed, "{schedule:?} d={depth} m={m} stage {stage}");
                        assert!(closed <= peak_in_flight(schedule, stage, depth, m), "{schedule:?} d={depth} m={m} stage {stage}");
                    }
                }
            }
        }
        // PipeDream-Flush at m = d: stage 0 holds both microbatches before its first
        // backward, one after it; with a third microbatch its forward follows that backward.
        assert_eq!((peak_in_flight(Schedule::Flush, 0, 2, 2), peak_in_flight_with_gradient(Schedule::Flush, 0, 2, 2)), (Some(2), Some(1)));
        assert_eq!(peak_in_flight_with_gradient(Schedule::Flush, 0, 2, 3), Some(2));
    }

    /// The orders made all at once (one ZB-V replay per call) are the ones made per worker
    /// and per stage, and so are the peaks taken from them (asked twice: the second answer
    /// is the remembered one).
    #[test]
    fn orders_made_at_once_are_the_per_worker_and_per_stage_ones() {
        for &schedule in Schedule::ALL {
            for depth in 1..=8 {
                for m in [1, 2, 3, depth, 2 * depth] {
                    for (start, steps) in [(0, 1), (1, 3)] {
                        let what = format!("{schedule} d={depth} m={m} batches {start}..{steps}");
                        let per_worker: Result<Vec<_>, _> = schedule.workers(depth).and_then(|p| (0..p).map(|r| worker_ops_from(schedule, r, depth, m, start, steps)).collect());
                        assert_eq!(worker_orders(schedule, depth, m, start, steps), per_worker, "{what}");
                        let per_stage: Result<Vec<_>, _> = (0..depth).map(|k| stage_ops_from(schedule, k, depth, m, start, steps)).collect();
                        assert_eq!(stage_orders(schedule, depth, m, start, steps), per_stage, "{what}");
                    }
                    let one_by_one: Vec<Option<usize>> = (0..depth).map(|k| peak_in_flight(schedule, k, depth, m)).collect();
                    assert_eq!(peaks_in_flight(schedule, depth, m), one_by_one, "{schedule} d={depth} m={m}");
                    assert_eq!(peaks_in_flight(schedule, depth, m), one_by_one, "{schedule} d={depth} m={m}, remembered");
                    let with_gradient: Vec<Option<usize>> = (0..depth).map(|k| peak_in_flight_with_gradient(schedule, k, depth, m)).collect();
                    assert_eq!(peaks_in_flight_with_gradient(schedule, depth, m), with_gradient, "{schedule} d={depth} m={m}");
                }
            }
        }
    }

    /// What the several-stages-per-worker and zero-bubble schedules hold stops changing
    /// once `m` reaches four microbatches per worker, which lets [`holdings_in_flight`]
    /// answer larger `m` from that order: every `m` up to 12 per worker for up to 12
    /// workers, and up to 8 per worker (and 16) for up to 32, the planner's range on 64
    /// GPUs.
    #[test]
    fn holdings_stop_changing_past_four_microbatches_per_worker() {
        let walked = |schedule: Schedule, p: usize, m: usize| -> Vec<Vec<Holding>> {
            let mut stages = match schedule {
                Schedule::ZbV => zb_v_holdings(p, m).unwrap(),
                _ => stage_orders(schedule, p * schedule.virtual_stages(), m, 0, 1).unwrap().iter().enumerate().map(|(k, ops)| walk_holdings(ops, schedule.splits_stage_backward(k))).collect(),
            };
            stages.iter_mut().for_each(|h| h.sort_by_key(|h| (h.whole, h.awaiting, h.gradient)));
            stages
        };
        for schedule in [Schedule::Interleaved2, Schedule::Interleaved4, Schedule::ZbV, Schedule::ZbH2, Schedule::ZbH1] {
            let v = schedule.virtual_stages();
            for p in (1..=12).chain([16, 24, 31, 32]) {
                let ms: Vec<usize> = if p <= 12 { (4 * p..=12 * p).collect() } else { (4 * p..=8 * p).chain([16 * p]).collect() };
                let settled = walked(schedule, p, 4 * p);
                for m in ms.into_iter().filter(|m| v == 1 || schedule == Schedule::ZbV || m % p == 0) {
                    let holdings = walked(schedule, p, m);
                    if schedule != Schedule::ZbV {
                        assert_eq!(holdings, settled, "{schedule} on {p} workers, m = {m}");
                        continue;
                    }
                    // ZB-V's steady state shifts a microbatch between kinds on some
                    // stages (12 and 24 workers): the peaks settle, the kinds within one.
                    for (k, (now, then)) in holdings.iter().zip(&settled).enumerate() {
                        assert_eq!(peak_of(now), peak_of(then), "{schedule} on {p} workers, m = {m}, stage {k}");
                        for h in now {
                            let near = then.iter().any(|s| s.gradient == h.gradient && s.total() == h.total() && s.whole.abs_diff(h.whole) <= 1);
                            assert!(near || then.iter().any(|s| s.covers(*h)), "{schedule} on {p} workers, m = {m}, stage {k}: {h:?} against {then:?}");
                        }
                    }
                }
            }
        }
    }

    /// ZB-H2 on 2 stages: the first stage runs two warm-up forwards more than 1F1B's and
    /// its whole backwards at its weight gradients; the last defers its weight gradients
    /// while it holds fewer than `2d = 4` graphs, so the last four fill the end of the
    /// batch, where it would wait for the first stage's last backward, update and next
    /// forward.
    #[test]
    fn zero_bubble_h2_keeps_the_last_weight_gradients_for_the_end_of_the_batch() {
        use Op::{BackwardInput as B, BackwardWeight as W, Forward as F};
        let ops = |k| stage_ops(Schedule::ZbH2, k, 2, 4, 1).unwrap();
        // The first stage runs 2d - 1 = 3 warm-up forwards; the last keeps back up to 2d + 1
        // = 5 weight gradients, here all 4.
        assert_eq!(ops(0), [F(0), F(1), F(2), F(3), B(0), W(0), B(1), W(1), B(2), W(2), B(3), W(3), Op::Step(0)]);
        assert_eq!(ops(1), [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), W(0), W(1), W(2), W(3), Op::Step(0)]);
        assert_eq!(peaks_in_flight(Schedule::ZbH2, 2, 4), [Some(4), Some(4)]);
        // m = 8: the last stage runs the first 3 weight gradients after their input
        // gradients and keeps the last 5 for the end.
        let ops = stage_ops(Schedule::ZbH2, 1, 2, 8, 1).unwrap();
        for j in 0..3 {
            let at = ops.iter().position(|&o| o == B(j)).unwrap();
            assert_eq!(ops[at + 1], W(j), "{ops:?}");
        }
        assert_eq!(ops[ops.len() - 6..], [W(3), W(4), W(5), W(6), W(7), Op::Step(0)]);
        assert_eq!(peaks_in_flight(Schedule::ZbH2, 2, 8), [Some(4), Some(5)]);
        // At d = 4, m = 16 the first stage holds 2d = 8, the middle ones at most 2d - 1 = 7
        // and the last at most 2d + 1 = 9.
        let peaks: Vec<usize> = peaks_in_flight(Schedule::ZbH2, 4, 16).into_iter().flatten().collect();
        assert_eq!(peaks.len(), 4);
        assert_eq!(peaks[0], 8);
        assert!(peaks[1..3].iter().all(|&p| p <= 7) && peaks[3] <= 9, "{peaks:?}");
    }

    /// A stage that does not split its backward (the first) runs a whole backward whose
    /// output gradients it has before it takes the next ones: taking them is no work, and
    /// waiting there would leave a backward it could run undone. On ZB-H2's d = 2, m = 8
    /// the first stage's whole backwards follow their input gradients one for one.
    #[test]
    fn a_whole_backward_runs_before_the_next_output_gradients_are_awaited() {
        use Op::{BackwardInput as B, BackwardWeight as W};
        for (schedule, d, m) in [(Schedule::ZbH2, 2, 8), (Schedule::ZbH2, 3, 8), (Schedule::ZbH1, 4, 8), (Schedule::ZbH2, 4, 16)] {
            let ops = stage_ops(schedule, 0, d, m, 1).unwrap();
            for j in 0..m as u64 {
                let at = ops.iter().position(|&o| o == B(j)).unwrap();
                assert_eq!(ops[at + 1], W(j), "{schedule} d = {d}, m = {m}: {ops:?}");
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

    /// Interleaved 1F1B on 2 workers, 2 stages each, 4 microbatches: worker 0 (stages 0
    /// and 2) warms up with two microbatches on each of its stages, then alternates, its
    /// backwards going round its stages in reverse.
    #[test]
    fn interleaved_goes_round_the_workers_stages_in_groups() {
        use Op::{Backward as B, Forward as F};
        let w0 = worker_ops_from(Schedule::Interleaved2, 0, 4, 4, 0, 1).unwrap();
        let expected = [
            (0, F(0)), (0, F(1)), (2, F(0)), (2, F(1)),
            (0, F(2)), (2, B(0)), (0, F(3)), (2, B(1)), (2, F(2)), (0, B(0)), (2, F(3)), (0, B(1)),
            (2, B(2)), (2, B(3)), (0, B(2)), (0, B(3)),
            (0, Op::Step(0)), (2, Op::Step(0)),
        ];
        assert_eq!(w0, expected);
        assert_eq!(stage_ops(Schedule::Interleaved2, 2, 4, 4, 1).unwrap(), [F(0), F(1), B(0), B(1), F(2), F(3), B(2), B(3), Op::Step(0)]);
        assert_eq!(held_at_most(&stage_ops(Schedule::Interleaved2, 0, 4, 4, 1).unwrap()), 4);
    }

    /// Every interleaved order runs to its end when each worker runs its ops strictly in
    /// order and an op waits only for its input (the previous stage's forward, the next
    /// stage's backward): replayed in unit times, for 1 to 4 workers, both `v` and several
    /// `m`. Each stage runs every microbatch once, its forward before its backward, and its
    /// backwards in microbatch order (so it sums gradients as PipeDream-Flush's stage does).
    #[test]
    fn interleaved_orders_never_wait_on_themselves() {
        for schedule in [Schedule::Interleaved2, Schedule::Interleaved4] {
            let v = schedule.virtual_stages();
            for workers in 1..=4 {
                let depth = workers * v;
                for m in [workers, 2 * workers, 3 * workers, 5 * workers] {
                    let shape = format!("{schedule} on {workers} workers, m = {m}");
                    let orders: Vec<Vec<(usize, Op)>> = (0..workers).map(|r| worker_ops_from(schedule, r, depth, m, 0, 1).unwrap()).collect();
                    assert!(replays_to_the_end(&orders, depth, m), "{shape} waits on itself");
                    for k in 0..depth {
                        let ops = stage_ops(schedule, k, depth, m, 1).unwrap();
                        let fwd: Vec<u64> = ops.iter().filter_map(|op| matches!(op, Op::Forward(_)).then(|| op.microbatch().unwrap())).collect();
                        let bwd: Vec<u64> = ops.iter().filter_map(|op| matches!(op, Op::Backward(_)).then(|| op.microbatch().unwrap())).collect();
                        let all: Vec<u64> = (0..m as u64).collect();
                        assert_eq!((&fwd, &bwd), (&all, &all), "{shape}, stage {k}");
                        assert_eq!(ops.last(), Some(&Op::Step(0)), "{shape}, stage {k}");
                    }
                }
            }
        }
        assert!(stage_ops(Schedule::Interleaved2, 0, 3, 4, 1).unwrap_err().contains("multiple of 2"));
        assert!(stage_ops(Schedule::Interleaved2, 0, 4, 3, 1).unwrap_err().contains("must be a multiple of 2 (m = 3)"));
    }

    /// Runs each worker's ops in order, one per unit of time, an op starting once its input
    /// was made in an earlier unit (a backward or input gradient the next stage's, a weight
    /// gradient its own input gradient); whether all of them ran.
    fn replays_to_the_end(orders: &[Vec<(usize, Op)>], depth: usize, m: usize) -> bool {
        let orders: Vec<Vec<(usize, Op)>> = orders.iter().map(|o| o.iter().copied().filter(|(_, op)| op.microbatch().is_some()).collect()).collect();
        // An input gradient counts as the backward its neighbour waits for.
        let as_done = |(k, op): (usize, Op)| (k, if let Op::BackwardInput(j) = op { Op::Backward(j) } else { op });
        let mut done = std::collections::HashSet::new();
        let mut next = vec![0usize; orders.len()];
        for _tick in 0..8 * depth * m + 8 {
            let mut ran = Vec::new();
            for (r, order) in orders.iter().enumerate() {
                let Some(&(k, op)) = order.get(next[r]) else { continue };
                let ready = match op {
                    Op::Forward(j) => k == 0 || done.contains(&(k - 1, Op::Forward(j))),
                    Op::Backward(j) | Op::BackwardInput(j) => done.contains(&(k, Op::Forward(j))) && (k + 1 == depth || done.contains(&(k + 1, Op::Backward(j)))),
                    Op::BackwardWeight(j) => done.contains(&(k, Op::Backward(j))),
                    Op::Step(_) => true,
                };
                if ready {
                    next[r] += 1;
                    ran.push(as_done((k, op)));
                }
            }
            done.extend(ran);
        }
        next.iter().zip(&orders).all(|(&n, o)| n == o.len())
    }

    /// ZB-V on 1 to 6 workers and several `m`: the orders run to their end when each
    /// worker runs its ops strictly in order; every stage runs each microbatch's forward,
    /// input gradient and weight gradient once, in that order and in microbatch order
    /// (so it sums gradients as Flush's stage does); a worker holds at most `2p` graphs;
    /// worker `k` runs stages `k` and `2p - 1 - k`.
    #[test]
    fn zero_bubble_v_orders_run_to_their_end_within_their_memory() {
        use Op::{BackwardInput as B, BackwardWeight as W, Forward as F};
        for p in 1..=6 {
            let depth = 2 * p;
            for m in [1, 2, p, 2 * p, 3 * p + 1, 16] {
                let shape = format!("zb-v on {p} workers, m = {m}");
                let orders: Vec<Vec<(usize, Op)>> = (0..p).map(|r| worker_ops_from(Schedule::ZbV, r, depth, m, 0, 1).unwrap()).collect();
                assert!(replays_to_the_end(&orders, depth, m), "{shape} waits on itself");
                for (r, order) in orders.iter().enumerate() {
                    let mine: std::collections::BTreeSet<usize> = order.iter().map(|&(k, _)| k).collect();
                    assert_eq!(mine.into_iter().collect::<Vec<_>>(), [r, depth - 1 - r], "{shape}: worker {r}");
                    let peak = held_at_most(&order.iter().map(|&(_, op)| op).collect::<Vec<_>>());
                    assert!(peak <= 2 * p, "{shape}: worker {r} holds {peak} graphs");
                }
                for k in 0..depth {
                    let ops = stage_ops(Schedule::ZbV, k, depth, m, 1).unwrap();
                    let of = |f: fn(u64) -> Op| -> Vec<usize> { (0..m as u64).map(|j| ops.iter().position(|&o| o == f(j)).unwrap_or_else(|| panic!("{shape}, stage {k}: no {:?}", f(j)))).collect() };
                    let (fs, bs, ws) = (of(F), of(B), of(W));
                    assert!(fs.windows(2).all(|x| x[0] < x[1]) && bs.windows(2).all(|x| x[0] < x[1]), "{shape}, stage {k}: {ops:?}");
                    assert!((0..m).all(|j| fs[j] < bs[j] && bs[j] < ws[j]), "{shape}, stage {k}: {ops:?}");
                    assert_eq!(ops.len(), 3 * m + 1, "{shape}, stage {k}: {ops:?}");
                }
            }
        }
        assert_eq!(Schedule::ZbV.stages_of(1, 6), [1, 4]);
        assert!(stage_ops(Schedule::ZbV, 0, 3, 4, 1).unwrap_err().contains("zb-v runs 2 stages per worker"));
    }
}
