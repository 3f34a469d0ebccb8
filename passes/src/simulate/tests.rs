//! The replay's tests: the runtime's order in both engines, the closed forms of the
//! bubbles, transfers and all-reduces, processor sharing and its inverse, tied stages,
//! duration spreads and refused setups.

use super::*;
use crate::machine::{allreduce_seconds, default_time_slice};
use pipewright_core::schedule::{stage_ops, worker_ops_from};
use pipewright_core::timeline::TraceKind;

fn equal(d: usize, f: f64, b: f64) -> Vec<StageCost> {
    // A third of the backward is the weight gradients (what a splitting schedule defers).
    vec![StageCost { forward_s: f, backward_s: b, weight_grad_s: b / 3.0, recompute_s: 0.0, optimizer_s: 0.0, send_s: 0.0, after_backward_s: 0.0, send_bytes: 0.0, grad_bytes: 0.0, tied_sync_s: 0.0, memory_one: 0.0, memory_per_extra: 0.0, memory_at_update: 0.0, gradient_bytes: 0.0, memory_per_awaiting: 0.0 }; d]
}

fn setup(scheme: Scheme, d: usize, m: u64, batches: usize) -> SimSetup {
    let link = Link { bandwidth: 1e9, latency_s: 0.0 };
    SimSetup { scheme, w: 1, b: 1, m, batches, stages: equal(d, 1.0, 2.0), links: vec![link; d - 1], allreduce: AllReduce::ring(link), record: true, host: None, tied_groups: Vec::new(), spread: None }
}

/// Per stage, the compute operations of the trace in time order (a `backward` is the
/// input gradient alone when the schedule splits the backward).
fn order(sim: &Simulation, stage: usize, schedule: Schedule) -> Vec<Op> {
    let mut ev: Vec<&TraceEvent> = sim.events.iter().filter(|e| e.stage == stage && matches!(e.kind, TraceKind::Forward | TraceKind::Backward | TraceKind::BackwardWeight | TraceKind::Optimizer)).collect();
    ev.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    ev.iter()
        .map(|e| {
            let mb = e.microbatch.unwrap_or(0);
            match e.kind {
                TraceKind::Forward => Op::Forward(mb),
                TraceKind::Backward if schedule.splits_backward() => Op::BackwardInput(mb),
                TraceKind::Backward => Op::Backward(mb),
                TraceKind::BackwardWeight => Op::BackwardWeight(mb),
                _ => Op::Step(e.step),
            }
        })
        .collect()
}

#[test]
fn every_stage_runs_the_runtimes_order() {
    for schedule in Schedule::ALL.iter().copied() {
        // Interleaved shapes need a depth their stages per worker divide (4, 8) and
        // microbatches their workers divide.
        for (d, m) in [(2, 2), (3, 4), (4, 4), (4, 6), (8, 4), (8, 6)].into_iter().filter(|&(d, m)| stage_ops(schedule, 0, d, m as usize, 1).is_ok()) {
            let sim = simulate(&setup(schedule.into(), d, m, 3)).unwrap();
            for s in 0..d {
                assert_eq!(order(&sim, s, schedule), stage_ops(schedule, s, d, m as usize, 3).unwrap(), "{schedule} d={d} m={m} stage {s}");
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

/// Interleaved 1F1B on equal stages and free links: each worker runs its stages' forwards
/// and backwards one at a time in its order, and a batch takes `m v + p - 1` stage times
/// (`p = d / v` workers), the drain `v` times shorter than Flush's on `p` workers of `v`
/// stages' work each (Narayanan et al., 2021). The replay of threads sharing cores does
/// not run it yet, and says so.
#[test]
fn interleaved_stages_take_turns_on_their_worker() {
    for schedule in [Schedule::Interleaved2, Schedule::Interleaved4] {
        let v = schedule.virtual_stages();
        for (p, m) in [(1usize, 2u64), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (3, 9)] {
            let d = p * v;
            let sim = simulate(&setup(schedule.into(), d, m, 1)).unwrap();
            let expect = (m as usize * v + p - 1) as f64 * 3.0;
            assert!((sim.makespan_s - expect).abs() < 1e-9, "{schedule} p={p} m={m}: {} != {expect}", sim.makespan_s);
            for r in 0..p {
                let mut ev: Vec<&TraceEvent> = sim.events.iter().filter(|e| e.stage % p == r && matches!(e.kind, TraceKind::Forward | TraceKind::Backward)).collect();
                ev.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
                for pair in ev.windows(2) {
                    assert!(pair[1].start_us >= pair[0].start_us + pair[0].dur_us - 1e-6, "{schedule} p={p} m={m}: worker {r} overlaps {:?} and {:?}", pair[0], pair[1]);
                }
                let ran = worker_compute(&sim, r, p);
                let want: Vec<(usize, Op)> = worker_ops_from(schedule, r, d, m as usize, 0, 1).unwrap().into_iter().filter(|(_, op)| !matches!(op, Op::Step(_))).collect();
                assert_eq!(ran, want, "{schedule} p={p} m={m}: worker {r}");
            }
        }
    }
    // Two workers' threads on one core: each worker still runs one op at a time in its
    // order, and a batch takes twice the compute of one worker.
    let shared = simulate(&SimSetup { host: Some(HostCores::ideal(1)), ..setup(Scheme::Interleaved2, 4, 4, 1) }).unwrap();
    for r in 0..2 {
        let ran: Vec<(usize, Op)> = worker_compute(&shared, r, 2);
        let want: Vec<(usize, Op)> = worker_ops_from(Schedule::Interleaved2, r, 4, 4, 0, 1).unwrap().into_iter().filter(|(_, op)| !matches!(op, Op::Step(_))).collect();
        assert_eq!(ran, want, "worker {r} on a shared core");
    }
    assert!((shared.makespan_s - 2.0 * 4.0 * 2.0 * 3.0).abs() < 1e-9, "{}", shared.makespan_s);
}

/// Worker `r`'s (of `p`) forwards and backwards in a replay's trace, in time order.
fn worker_compute(sim: &Simulation, r: usize, p: usize) -> Vec<(usize, Op)> {
    let mut ev: Vec<&TraceEvent> = sim.events.iter().filter(|e| e.stage % p == r && matches!(e.kind, TraceKind::Forward | TraceKind::Backward)).collect();
    ev.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    ev.iter().map(|e| (e.stage, if e.kind == TraceKind::Forward { Op::Forward(e.microbatch.unwrap()) } else { Op::Backward(e.microbatch.unwrap()) })).collect()
}

/// ZB-H1 on equal stages and free links (forward 1, input gradient 4/3, weight gradient
/// 2/3): holding no more than 1F1B, a batch takes `(m + d - 1)(f + b) - (d - 1) w`, the
/// drain's chain of input gradients without the weight gradients; Qi et al.'s bound
/// `m (f + b) + (d - 1)(f + b - w)` needs a stage to hold more graphs than that.
#[test]
fn zero_bubble_h1_takes_the_weight_gradients_off_the_drain() {
    for (d, m) in [(2u64, 2u64), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)] {
        let sim = simulate(&setup(Scheme::ZbH1, d as usize, m, 1)).unwrap();
        let (f, b, w) = (1.0, 2.0, 2.0 / 3.0);
        let expect = (m + d - 1) as f64 * (f + b) - (d - 1) as f64 * w;
        assert!((sim.makespan_s - expect).abs() < 1e-9, "d={d} m={m}: {} != {expect}", sim.makespan_s);
        let held: Vec<u64> = sim.stages.iter().map(|s| s.peak_in_flight).collect();
        let flush = simulate(&setup(Scheme::Flush, d as usize, m, 1)).unwrap();
        assert_eq!(held, flush.stages.iter().map(|s| s.peak_in_flight).collect::<Vec<_>>(), "d={d} m={m}");
    }
}

#[test]
fn the_first_stage_runs_its_whole_backward_at_the_weight_gradient() {
    // Nothing waits on the first stage's input gradient (its inputs are data): its
    // `backward` takes no time and its `backward-weight` the whole backward, as the
    // runtime runs it; the other stages split theirs by their weight_grad_s (a third).
    for scheme in [Scheme::ZbH1, Scheme::ZbV] {
        let sim = simulate(&setup(scheme, 4, 8, 2)).unwrap();
        for e in sim.events.iter().filter(|e| matches!(e.kind, TraceKind::Backward | TraceKind::BackwardWeight)) {
            let expect_s = match (e.stage, e.kind) {
                (0, TraceKind::Backward) => 0.0,
                (0, _) => 2.0,
                (_, TraceKind::Backward) => 4.0 / 3.0,
                _ => 2.0 / 3.0,
            };
            assert!((e.dur_us / 1e6 - expect_s).abs() < 1e-9, "{scheme} stage {} {:?} microbatch {:?}: {} s", e.stage, e.kind, e.microbatch, e.dur_us / 1e6);
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
    // Not the schedules running several stages per worker: the dedicated replay puts a
    // worker's steps on its stream and the shared one on their stages' threads, so the two
    // differ by design (`interleaved_stages_take_turns_on_their_worker` covers both).
    for scheme in Scheme::ALL.iter().copied().filter(|s| s.schedule().map_or(true, |s| s.virtual_stages() == 1)) {
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
            // 2BW defers the tied stages' update, and the meeting with it, to the forward
            // that needs it: the first stage has long reached the step by then, so the
            // last stage runs on into the next batch and the tie costs nothing.
            assert!((b.samples_per_s - a.samples_per_s).abs() < 1e-9 * a.samples_per_s, "{} vs {}", b.samples_per_s, a.samples_per_s);
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
    // So it does with replicas, whose all-reduce it defers too.
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

/// Under the zero-bubble schedules the last stage, which splits its backward, reaches the
/// tied stages' meeting at its batch's last input gradient, as the runtime begins the sum
/// there: the sum starts once the first stage has reached its step, under ZB-H2 while the
/// last stage's deferred weight gradients still run; both engines alike.
#[test]
fn a_splitting_stage_meets_its_tied_stages_at_its_last_input_gradient() {
    for scheme in [Scheme::ZbH1, Scheme::ZbH2] {
        for (d, host) in [(2usize, None), (4, None), (2, Some(HostCores::linux(2)))] {
            let mut s = setup(scheme, d, 2 * d as u64, 4);
            s.tied_groups = vec![vec![0, d - 1]];
            s.host = host;
            s.stages.iter_mut().for_each(|c| c.tied_sync_s = 0.5);
            let sim = simulate(&s).unwrap();
            let end_of = |stage: usize, kind: TraceKind, t: u64| sim.events.iter().filter(|e| e.stage == stage && e.kind == kind && e.step == t).map(|e| e.start_us + e.dur_us).fold(0.0, f64::max);
            let mut early = 0;
            for t in 0..4u64 {
                // The first stage reaches its step after its last whole backward.
                let meet = end_of(0, TraceKind::BackwardWeight, t).max(end_of(d - 1, TraceKind::Backward, t));
                let sum = sim.events.iter().find(|e| e.stage == d - 1 && e.kind == TraceKind::AllReduce && e.step == t).unwrap_or_else(|| panic!("{scheme} d = {d}: no sum at step {t}"));
                assert!((sum.start_us - meet).abs() < 1e-6, "{scheme} d = {d} {host:?} step {t}: the sum starts at {} against {meet}", sum.start_us);
                early += usize::from(sum.start_us + 1e-6 < end_of(d - 1, TraceKind::BackwardWeight, t));
            }
            // ZB-H2's last stage keeps enough weight gradients for the end of the batch to
            // outlast the first stage's last whole backward.
            if scheme == Scheme::ZbH2 {
                assert!(early > 0, "{scheme} d = {d} {host:?}: no sum began before the last stage's weight gradients ended");
            }
        }
    }
}

/// A stage's peak memory counts its gradient from its batch's first weight gradient, as
/// the planner does: PipeDream-Flush's stage 0 at `m = d = 2` peaks with both microbatches
/// and no gradient, 2BW's with both and its gradient (its next batch's forwards come
/// before the step); both engines alike.
#[test]
fn the_replayed_memory_counts_the_gradient_from_the_first_weight_gradient() {
    let with_memory = |scheme| {
        let mut s = setup(scheme, 2, 2, 3);
        for c in &mut s.stages {
            (c.memory_one, c.memory_per_extra, c.gradient_bytes) = (12.0, 10.0, 1.0);
        }
        s
    };
    for (scheme, stage0) in [(Scheme::Flush, 21.0), (Scheme::TwoBw, 22.0), (Scheme::GPipe, 21.0)] {
        let s = with_memory(scheme);
        let dedicated = simulate(&s).unwrap();
        let shared = simulate(&SimSetup { host: Some(HostCores::ideal(1)), ..s }).unwrap();
        for sim in [dedicated, shared] {
            assert_eq!(sim.stages[0].peak_memory, stage0, "{scheme}");
        }
    }
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
        for (d, m) in [(2, 2), (3, 4), (4, 4), (4, 6), (8, 4)].into_iter().filter(|&(d, m)| stage_ops(schedule, 0, d, m as usize, 1).is_ok()) {
            for cores in [1, 2, 3] {
                let mut s = setup(schedule.into(), d, m, 3);
                s.host = Some(HostCores::ideal(cores));
                let sim = simulate(&s).unwrap();
                for st in 0..d {
                    assert_eq!(order(&sim, st, schedule), stage_ops(schedule, st, d, m as usize, 3).unwrap(), "{schedule} d={d} m={m} cores={cores} stage {st}");
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

/// ZB-V on equal stages and free links, its forward, input gradient and weight gradient
/// each one second (as for a matrix product: one product each): a batch takes `6m + p - 1`
/// seconds on `p` workers, against interleaved 1F1B's `6m + 3(p - 1)` on the same stages,
/// the weight gradients filling all but `p - 1` seconds of the drain; at most one second
/// more where the first stage's whole backward runs at its weight gradient (two seconds
/// in a slot the order made for one). (Its order is made for such equal parts,
/// [`pipewright_core::schedule`]; with others it leaves more.)
#[test]
fn zero_bubble_v_fills_the_drain_with_weight_gradients() {
    for (p, m) in [(1usize, 2u64), (2, 4), (2, 8), (3, 12), (4, 8), (4, 16), (4, 32)] {
        let d = 2 * p;
        let equal_parts = |scheme: Scheme| {
            let mut s = setup(scheme, d, m, 1);
            s.stages.iter_mut().for_each(|c| c.weight_grad_s = 1.0);
            simulate(&s).unwrap().makespan_s
        };
        let (zbv, interleaved) = (equal_parts(Scheme::ZbV), equal_parts(Scheme::Interleaved2));
        let m = m as f64;
        let p = p as f64;
        let split = 6.0 * m + p - 1.0;
        assert!(zbv > split - 1e-9 && zbv < split + 1.0 + 1e-9, "p={p} m={m}: {zbv}");
        assert!((interleaved - (6.0 * m + 3.0 * (p - 1.0))).abs() < 1e-9, "p={p} m={m}: {interleaved}");
    }
}

#[test]
fn zero_bubble_h2_leaves_only_the_first_forwards_way_down() {
    // Equal stages, free links, a third of each backward the weight gradients (the first
    // stage's whole backward at its weight gradient): once its warm-up is complete (m >=
    // 2d - 1), a batch takes m (f + b) + (d - 1) f; the drain is all weight gradients.
    // ZB-H1 leaves more, Flush more again.
    for (d, m) in [(2usize, 4u64), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)] {
        let makespan = |scheme| simulate(&setup(scheme, d, m, 1)).unwrap().makespan_s;
        let h2 = makespan(Scheme::ZbH2);
        let expect = m as f64 * 3.0 + (d - 1) as f64;
        assert!((h2 - expect).abs() < 1e-9, "d={d} m={m}: {h2} != {expect}");
        assert!(h2 < makespan(Scheme::ZbH1) && makespan(Scheme::ZbH1) < makespan(Scheme::Flush), "d={d} m={m}");
    }
}

/// A deferred update (2BW with replicas) holds its batch's gradients until it is applied,
/// before the forward that needs it, as the runtime holds them: into the next batch's
/// backwards, so such a stage peaks with two batches' gradients; one that updates at its
/// step never does. Both engines alike.
#[test]
fn a_deferred_update_holds_its_gradients_into_the_next_batch() {
    let mut s = setup(Scheme::TwoBw, 2, 2, 4);
    for c in &mut s.stages {
        // Gradient-heavy stages: one microbatch's activations 1, the gradients 10.
        (c.memory_one, c.memory_per_extra, c.gradient_bytes) = (11.0, 1.0, 10.0);
    }
    let at_step = simulate(&s).unwrap();
    let replicated = SimSetup { w: 2, ..s };
    let deferred = simulate(&replicated).unwrap();
    let shared = simulate(&SimSetup { host: Some(HostCores::ideal(4)), ..replicated }).unwrap();
    // At its step: the first stage holds two microbatches with its gradient, the last one.
    for (k, held) in [(0, 12.0), (1, 11.0)] {
        assert_eq!(at_step.stages[k].peak_memory, held, "stage {k}");
        for sim in [&deferred, &shared] {
            assert_eq!(sim.stages[k].peak_memory, 21.0, "stage {k}: one microbatch and two gradients");
        }
    }
}
