//! `pipewright profile`: measured forward and backward time of every node at several
//! microbatch sizes, with the runtime's own kernels, as the [`Profile`] that
//! `pipewright plan --profile` reads.
//!
//! Each node is timed in isolation on the tensors a full forward pass gave it: forward is
//! the kernel call; backward is autograd through that one kernel from a ones gradient on
//! its float outputs, less what the same seeding costs on bare leaves of the outputs'
//! shapes (the engine start a stage pays once, not per node). Several repetitions, median;
//! the profile also keeps the spread of the whole model's time over the repetitions
//! (`spread`), which `profile` reports, the whole model run as one forward and one backward
//! pass (`whole`: the cost model scales the nodes' times to add up to it), and each
//! trainable weight's update under each optimizer, timed with the runtime's own step
//! (`updates`: the simulator's optimizer time on the machine profiled) and all of them
//! in one step (`step`: the updates are scaled to add up to it, as the nodes are to the
//! whole pass), the training loss on the model's output (`loss`: the last stage
//! computes it besides its nodes), on a CPU the whole pass run by several threads at once
//! (`sharing`: how threads crowding the host slow each other, for the simulator's replay
//! of stages sharing its cores), and what a stage boundary costs the runtime (`boundary`:
//! the model trained as two stages less as one, which each stage's costs carry half of
//! per boundary), and, from two-stage runs at every batch size, how the runtime divides
//! the pass between the two stages (`split`: the cost model scales each stage's nodes to
//! its measured share).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use std::path::Path;

use pipewright_core::timeline::{after_backward_us, TraceEvent, TraceKind};
use pipewright_core::{Decay, Device, NonFinite, Placement, Precision, Recompute, Schedule};
use pipewright_ir::{Graph, ImportOptions};
use pipewright_core::Loss;
use pipewright_passes::profile::{BatchSpread, BoundaryCost, HostSharing, LossTiming, Profile, ProfileNode, SharedPasses, SplitStage, StageSplit, WeightUpdate, WholePass, WholeStep};
use pipewright_runtime::exec::{run_node, Mode, Signature, Signatures};
use pipewright_runtime::module::read_module;
use pipewright_runtime::pipeline::{accumulate_ms, loss_ms, step_ms, update_ms, Objective, OptimizerConfig, TrainReport};
use pipewright_runtime::program::{Instr, SlotId};
use tch::{Kind, Tensor};

use pipewright_passes::manager::PassOptions;
use pipewright_passes::pipeline::PlanRequest;
use pipewright_core::RunFlags;
use pipewright_runtime::build::Manifest;
use pipewright_runtime::data::DEFAULT_MAX_INFLATED;

use crate::compile::{compile, CompileRequest};
use crate::forward::Runner;
use crate::train::{DataSource, Session, TrainRequest};
use crate::DriverError;

/// What [`profile`] tells as it goes.
pub enum Progress<'a> {
    /// A batch size is done: the spread of the whole model's time over the repetitions.
    Batch(&'a BatchSpread),
    /// A measurement could not be taken; the profile goes on without it.
    Skipped { what: &'static str, why: String },
    /// A measurement disagrees with another of the same thing: the machine was busy or its
    /// speed moved while profiling.
    Unsteady(String),
}

/// How far one thread's pass in the crowding measurement may stray from the whole pass's
/// median, and the slowdown of as many threads as cores, beyond which [`profile`] says the
/// host looked busy (another process on its cores makes `C` threads on `C` cores crowd
/// like more; this machine's own runs stayed within 1.2 of one alone).
const UNSTEADY_PASS: f64 = 0.25;
const BUSY_AT_CORES: f64 = 1.5;

/// Profiles `model` on `device` at each microbatch size of `batches` (`reps` timed
/// repetitions per node, median; synthetic inputs from `seed`); `on_progress` hears when a
/// size is done and what could not be measured.
pub fn profile(model: &Path, device: Device, batches: &[u64], reps: usize, seed: u64, loss: (Loss, Option<&str>), on_progress: &mut dyn FnMut(Progress<'_>)) -> Result<Profile, DriverError> {
    let tdev = pipewright_runtime::device::tch_device(device).map_err(|e| DriverError::msg(e.to_string()))?;
    let runner = Runner::load(model, &ImportOptions::default(), tdev)?;
    let (objective, loss_slot) = loss_output(&runner, model, loss)?;
    let mut loss_fwd = Vec::with_capacity(batches.len());
    let mut loss_bwd = Vec::with_capacity(batches.len());
    tch::manual_seed(seed as i64);
    let instrs = &runner.interp().program().instrs;
    let signatures = Signatures::of(runner.interp().program());
    let mut nodes: Vec<ProfileNode> =
        instrs.iter().map(|i| ProfileNode { name: i.name.clone(), op: i.op.name().to_string(), fwd_ms: Vec::new(), bwd_ms: Vec::new() }).collect();
    let mut spread = Vec::with_capacity(batches.len());
    let mut whole = Vec::with_capacity(batches.len());
    for &b in batches {
        let inputs = synthetic_inputs(&runner.graph, b as i64, tdev)?;
        let does_not_run = |e: String| DriverError::msg(format!("{}: the model does not run at batch {b}: {e}", model.display()));
        whole.push(time_whole(&runner, &inputs, b, reps).map_err(|e| does_not_run(e.to_string()))?);
        let slots = runner.interp().run_keep_all(&inputs, Mode::Train).map_err(|e| does_not_run(e.to_string()))?;
        let output = slots[loss_slot.index()].as_ref().ok_or_else(|| does_not_run(format!("output {:?} was not computed", objective.output)))?;
        let (f, bw) = loss_ms(&objective, output, reps)
            .map_err(|e| DriverError::msg(format!("{}: the {} loss on output {:?}: {e} (choose another with --loss KIND[:OUTPUT])", model.display(), objective.loss, objective.output)))?;
        loss_fwd.push(f);
        loss_bwd.push(bw);
        // Repetition r's total over all nodes: how much the whole model's time moves.
        let mut totals = vec![0.0; reps.max(1)];
        for (k, (node, ins)) in nodes.iter_mut().zip(instrs).enumerate() {
            // The inputs as the full pass made them: weights and what depends on them
            // require gradients, the data does not (its gradient is never computed).
            let args: Vec<Option<Tensor>> =
                ins.inputs.iter().map(|s| s.and_then(|s| slots[s.index()].as_ref().map(|t| t.detach().set_requires_grad(t.requires_grad())))).collect();
            let (f, bw) = time_node(ins, signatures.get(k), &args, reps)?;
            for (t, (x, y)) in totals.iter_mut().zip(f.iter().zip(&bw)) {
                *t += x + y;
            }
            node.fwd_ms.push(median(f));
            node.bwd_ms.push(median(bw));
        }
        let s = BatchSpread::of(b, totals);
        on_progress(Progress::Batch(&s));
        spread.push(s);
    }
    // Threads crowd a CPU host's cores; on a GPU the stages' threads share no cores.
    let sharing = if tdev == tch::Device::Cpu { Some(time_sharing(model, tdev, batches)?) } else { None };
    if let Some(s) = &sharing {
        unsteady_sharing(s, &whole).into_iter().for_each(|why| on_progress(Progress::Unsteady(why)));
    }
    let updates = time_updates(&runner, reps)?;
    let step = Some(time_step(&runner, reps)?);
    let accumulate_ms = Some(time_accumulate(&runner, reps)?);
    // A model the runtime cannot cut in two, or train on synthetic data, still profiles.
    let loss = LossTiming { loss: objective.loss, output: objective.output.clone(), fwd_ms: loss_fwd, bwd_ms: loss_bwd };
    let profiled = Profiled { batches, whole: &whole, nodes: &nodes, loss: &loss };
    let TwoStages { boundary, split, duration_factors } = time_boundary(model, device, &profiled, &objective).unwrap_or_else(|e| {
        on_progress(Progress::Skipped { what: "a stage boundary's cost", why: e.to_string() });
        TwoStages::default()
    });
    let loss = Some(loss);
    Ok(Profile { model: model.display().to_string(), device: device.to_string(), batches: batches.to_vec(), nodes, spread, whole, updates, loss, step, sharing, boundary, accumulate_ms, split, duration_factors })
}

/// What [`profile`] measured before the stage boundary: the batch sizes, the whole pass,
/// the nodes and the loss.
struct Profiled<'a> {
    batches: &'a [u64],
    whole: &'a [WholePass],
    nodes: &'a [ProfileNode],
    loss: &'a LossTiming,
}

impl Profiled<'_> {
    /// The loss's forward and backward milliseconds at batch `b` (0 where not measured).
    fn loss_at(&self, b: u64) -> (f64, f64) {
        loss_at(self.batches, self.loss, b)
    }
}

/// `loss`'s forward and backward milliseconds at batch `b` of the profile's `batches` (0
/// where not measured).
fn loss_at(batches: &[u64], loss: &LossTiming, b: u64) -> (f64, f64) {
    batches.iter().position(|&x| x == b).map_or((0.0, 0.0), |k| (loss.fwd_ms[k], loss.bwd_ms[k]))
}

/// Random float inputs (seeded) and zero index inputs of the graph's input shapes at `b`.
fn synthetic_inputs(g: &Graph, b: i64, device: tch::Device) -> Result<Vec<Tensor>, DriverError> {
    g.inputs()
        .iter()
        .map(|&v| {
            let ty = &g.value(v).ty;
            let dims = ty.shape.eval(b);
            let et = ty.dtype;
            let k = pipewright_runtime::exec::torch_kind(et)?;
            Ok(if ty.dtype.is_float() {
                Tensor::f_randn(&dims, (k, device))?
            } else {
                Tensor::f_zeros(&dims, (k, device))?
            })
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The least time the repetitions of one node ([`time_node`]) and of the whole pass
/// ([`time_whole`]) take together, and the most repetitions this adds: a median of 5
/// passes of gpt2-tiny (10 ms each) moved by several percent between profiles, which a
/// profile of a small model can afford to average away.
const NODE_WINDOW_S: f64 = 0.02;
const WHOLE_WINDOW_S: f64 = 0.5;
const MOST_REPS: usize = 200;

/// Whether `done` timed repetitions, the first begun at `start`, are enough: at least
/// `reps`, and either filling `window_s` or [`MOST_REPS`].
fn enough(done: usize, reps: usize, start: Instant, window_s: f64) -> bool {
    done >= reps.max(1) && (done >= MOST_REPS || start.elapsed().as_secs_f64() >= window_s)
}

/// Forward and backward milliseconds of one node, one per repetition: `reps` of them, more
/// while they take less than [`NODE_WINDOW_S`].
fn time_node(ins: &Instr, sig: Signature<'_>, inputs: &[Option<Tensor>], reps: usize) -> Result<(Vec<f64>, Vec<f64>), DriverError> {
    repeat_timed(reps, NODE_WINDOW_S, || {
        let leaves: Vec<Option<Tensor>> =
            inputs.iter().map(|t| t.as_ref().map(|t| if t.requires_grad() { t.detach().set_requires_grad(true) } else { t.shallow_clone() })).collect();
        let refs: Vec<Option<&Tensor>> = leaves.iter().map(|t| t.as_ref()).collect();
        let start = Instant::now();
        let outs = run_node(&ins.op, sig, &refs, Mode::Train, None).map_err(|e| DriverError::msg(format!("node {:?}: {e}", ins.name)))?;
        let fwd = start.elapsed().as_secs_f64() * 1e3;
        let diff: Vec<Tensor> = outs.into_iter().filter(|o| is_float(o) && o.requires_grad()).collect();
        let took = backward_ms(&diff)?;
        // The same seeding and engine start on leaves shaped like the outputs: what timing
        // one node alone adds, which a stage's one backward pass through all its nodes
        // pays once, not per node.
        let alone: Vec<Tensor> = diff.iter().map(|o| o.detach().set_requires_grad(true)).collect();
        let overhead = backward_ms(&alone)?;
        Ok((fwd, (took - overhead).max(0.0)))
    })
}

/// `once`'s forward and backward milliseconds over its repetitions: one to warm caches
/// and allocators (left out), then [`enough`] of them for `reps` and `window_s`.
fn repeat_timed(reps: usize, window_s: f64, mut once: impl FnMut() -> Result<(f64, f64), DriverError>) -> Result<(Vec<f64>, Vec<f64>), DriverError> {
    once()?;
    let (mut fwd, mut bwd) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    let start = Instant::now();
    while !enough(fwd.len(), reps, start, window_s) {
        let (f, b) = once()?;
        fwd.push(f);
        bwd.push(b);
    }
    Ok((fwd, bwd))
}

/// The training loss to time and the slot of the output it applies to: `output` by name,
/// or the model's only output (as `train` picks it).
fn loss_output(runner: &Runner, model: &Path, (loss, output): (Loss, Option<&str>)) -> Result<(Objective, SlotId), DriverError> {
    let program = runner.interp().program();
    let names: Vec<&str> = program.outputs.iter().map(|s| program.slots[s.index()].name.as_str()).collect();
    let index = match output {
        Some(name) => names.iter().position(|n| *n == name),
        None if names.len() == 1 => Some(0),
        None => None,
    };
    let Some(index) = index else {
        let asked = output.map_or_else(|| "the model has several outputs; name the loss's".to_string(), |n| format!("no output {n:?}"));
        return Err(DriverError::msg(format!("{}: {asked} (--loss KIND:OUTPUT); its outputs are {}", model.display(), names.join(", "))));
    };
    Ok((Objective::new(loss, names[index]), program.outputs[index]))
}

/// Each trainable weight's update under SGD, SGD with momentum and Adam, as the runtime's
/// step applies it ([`update_ms`]; the division by the microbatch count included).
fn time_updates(runner: &Runner, reps: usize) -> Result<Vec<WeightUpdate>, DriverError> {
    let program = runner.interp().program();
    let names = program.stored.iter().filter(|s| s.trainable).map(|s| program.slots[s.slot.index()].name.clone());
    names
        .zip(runner.interp().parameters())
        .map(|(name, w)| {
            let [sgd_ms, momentum_ms, adam_ms] =
                per_optimizer(|opt| update_ms(opt, w, 2, reps).map_err(|e| DriverError::msg(format!("updating weight {name:?}: {e}"))))?;
            Ok(WeightUpdate { sgd_ms, momentum_ms, adam_ms, name })
        })
        .collect()
}

/// One step updating all the trainable weights under each optimizer, as [`time_updates`]
/// times one weight ([`step_ms`]).
fn time_step(runner: &Runner, reps: usize) -> Result<WholeStep, DriverError> {
    let weights: Vec<Tensor> = runner.interp().parameters().into_iter().map(|t| t.shallow_clone()).collect();
    let [sgd_ms, momentum_ms, adam_ms] =
        per_optimizer(|opt| step_ms(opt, &weights, 2, reps).map_err(|e| DriverError::msg(format!("updating all the weights in one step: {e}"))))?;
    Ok(WholeStep { sgd_ms, momentum_ms, adam_ms })
}

/// One accumulation of a gradient of every trainable weight, as a stage's backward adds
/// each microbatch's ([`accumulate_ms`]).
fn time_accumulate(runner: &Runner, reps: usize) -> Result<f64, DriverError> {
    let weights: Vec<Tensor> = runner.interp().parameters().into_iter().map(|t| t.shallow_clone()).collect();
    accumulate_ms(&weights, reps).map_err(|e| DriverError::msg(format!("accumulating the weights' gradients: {e}")))
}

/// `time` under each optimizer a profile records: SGD, SGD with momentum, Adam (AdamW
/// does the same work).
fn per_optimizer(mut time: impl FnMut(OptimizerConfig) -> Result<f64, DriverError>) -> Result<[f64; 3], DriverError> {
    let momentum = OptimizerConfig { momentum: 0.9, ..OptimizerConfig::sgd() };
    Ok([time(OptimizerConfig::sgd())?, time(momentum)?, time(OptimizerConfig::adam())?])
}

/// The whole model's forward (the interpreter's run) and backward (one pass from the ones
/// gradient on its float outputs to its weights, as a stage's backward runs), `reps` times
/// after one warm-up, more while they take less than [`WHOLE_WINDOW_S`]; medians.
fn time_whole(runner: &Runner, inputs: &[Tensor], b: u64, reps: usize) -> Result<WholePass, DriverError> {
    let params: Vec<Tensor> = runner.interp().parameters().into_iter().map(|t| t.shallow_clone()).collect();
    let (fwd, bwd) = repeat_timed(reps, WHOLE_WINDOW_S, || timed_pass(runner, &params, inputs))?;
    Ok(WholePass { batch: b, fwd_ms: median(fwd), bwd_ms: median(bwd) })
}

/// One forward pass and one backward pass from the ones gradient on the float outputs to
/// the weights: their milliseconds.
fn timed_pass(runner: &Runner, params: &[Tensor], inputs: &[Tensor]) -> Result<(f64, f64), DriverError> {
    let start = Instant::now();
    let outs = runner.interp().run(inputs, Mode::Train).map_err(|e| DriverError::msg(e.to_string()))?;
    let fwd = start.elapsed().as_secs_f64() * 1e3;
    let diff: Vec<Tensor> = outs.into_iter().filter(|o| is_float(o) && o.requires_grad()).collect();
    let start = Instant::now();
    if let Some(loss) = ones_seed(&diff)? {
        if !params.is_empty() {
            Tensor::f_run_backward(&[loss], params, false, false)?;
        }
    }
    Ok((fwd, start.elapsed().as_secs_f64() * 1e3))
}

/// Milliseconds of a backward pass from the ones gradient on every tensor of `outs`.
fn backward_ms(outs: &[Tensor]) -> Result<f64, DriverError> {
    let start = Instant::now();
    if let Some(loss) = ones_seed(outs)? {
        loss.f_backward()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// The sum of every tensor of `outs` (in double precision): its backward is the ones
/// gradient on each. `None` for no tensor.
fn ones_seed(outs: &[Tensor]) -> Result<Option<Tensor>, tch::TchError> {
    let Some((first, rest)) = outs.split_first() else { return Ok(None) };
    let mut loss = first.f_sum(Kind::Double)?;
    for o in rest {
        loss = loss.f_add(&o.f_sum(Kind::Double)?)?;
    }
    Ok(Some(loss))
}

fn is_float(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

/// What looks wrong in a crowding measurement ([`UNSTEADY_PASS`], [`BUSY_AT_CORES`]), one
/// line per batch size.
fn unsteady_sharing(sharing: &HostSharing, whole: &[WholePass]) -> Vec<String> {
    let mut found = Vec::new();
    for w in whole {
        let pass = |threads: usize| sharing.runs.iter().find(|r| r.batch == w.batch && r.threads == threads).map(|r| r.pass_ms);
        let (Some(alone), Some(at_cores)) = (pass(1), pass(sharing.cores)) else { continue };
        let median = w.fwd_ms + w.bwd_ms;
        if median > 0.0 && (alone / median - 1.0).abs() > UNSTEADY_PASS {
            found.push(format!("batch {}: one thread's pass took {alone:.3} ms while crowding was timed, the whole pass {median:.3} ms before", w.batch));
        }
        let slowdown = at_cores / alone;
        if sharing.cores > 1 && slowdown > BUSY_AT_CORES {
            found.push(format!("batch {}: {} threads on {} cores each took {slowdown:.2} times one thread alone", w.batch, sharing.cores, sharing.cores));
        }
    }
    found
}

/// Passes each thread of [`time_shared_passes`] completes at least, and the shortest window
/// it times (short passes are repeated for longer, so that a slice or two of the
/// scheduler's does not decide the rate).
const SHARED_PASSES: usize = 3;
const SHARED_WINDOW_S: f64 = 0.5;

/// The whole pass run by 1, `cores` and `2 cores` threads at once on this host, at each
/// batch size ([`HostSharing`]): each count twice, in mirrored order (1, C, 2C, 2C, C,
/// 1), and the mean of the two, so that a drift of the host's speed over the measurement
/// cancels out of the slowdowns rather than making one (single rounds of gpt2-tiny put 2
/// threads on 2 cores at 0.98 to 1.14 times one alone, a minute apart on an idle host).
fn time_sharing(model: &Path, device: tch::Device, batches: &[u64]) -> Result<HostSharing, DriverError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut counts = vec![1, cores, 2 * cores];
    counts.dedup();
    let mut runs = Vec::with_capacity(counts.len() * batches.len());
    for &batch in batches {
        if runs.iter().any(|r: &SharedPasses| r.batch == batch) {
            continue;
        }
        let mut sums = vec![0.0; counts.len()];
        for k in (0..counts.len()).chain((0..counts.len()).rev()) {
            sums[k] += time_shared_passes(model, device, batch, counts[k])?;
        }
        runs.extend(counts.iter().zip(sums).map(|(&threads, sum)| SharedPasses { batch, threads, pass_ms: sum / 2.0 }));
    }
    Ok(HostSharing { cores, runs, turn_ms: time_turn(cores) })
}

/// How long [`time_turn`]'s threads spin, and the least jump of a spinning thread's clock
/// that counts as its core taken away: another thread's turn lasts at least a time slice
/// (a millisecond or more), while interrupts and the hypervisor pause a thread for tens
/// of microseconds (a thread spinning alone here sees those every few hundred).
const TURN_WINDOW_S: f64 = 0.3;
const TURN_GAP_S: f64 = 100e-6;

/// How long a thread that never blocks keeps a core while others wait for it
/// ([`HostSharing::turn_ms`]): twice as many threads as cores spin together, each noting
/// where its clock jumped (it had lost its core); the median of the runs between two
/// jumps, milliseconds. `None` when no thread lost its core twice.
fn time_turn(cores: usize) -> Option<f64> {
    let threads = 2 * cores.max(1);
    let barrier = Barrier::new(threads);
    let mut runs: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    runs_between(&spin_and_note_pauses())
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    if runs.is_empty() {
        return None;
    }
    runs.sort_by(f64::total_cmp);
    Some(runs[runs.len() / 2] * 1e3)
}

/// Spins for [`TURN_WINDOW_S`]; returns each jump of the clock over [`TURN_GAP_S`], as
/// (last reading before it, first after it).
fn spin_and_note_pauses() -> Vec<(Instant, Instant)> {
    let (window, gap) = (Duration::from_secs_f64(TURN_WINDOW_S), Duration::from_secs_f64(TURN_GAP_S));
    let start = Instant::now();
    let (mut last, mut pauses) = (start, Vec::new());
    loop {
        let now = Instant::now();
        if now.duration_since(last) > gap {
            pauses.push((last, now));
        }
        last = now;
        if now.duration_since(start) > window {
            return pauses;
        }
    }
}

/// The whole runs between pauses, seconds: from each pause's end to the next one's start
/// (the runs before the first and after the last are cut by the window and left out).
fn runs_between(pauses: &[(Instant, Instant)]) -> Vec<f64> {
    pauses.windows(2).map(|p| p[1].0.duration_since(p[0].1).as_secs_f64()).collect()
}

/// Milliseconds of window per pass per thread when `n` threads each run the whole model's
/// forward and backward pass at batch `b` on their own copy of it, started together: each
/// keeps running until every one has done its share ([`SHARED_PASSES`], [`SHARED_WINDOW_S`]),
/// so that the whole window is crowded ([`window_per_pass_ms`]).
fn time_shared_passes(model: &Path, device: tch::Device, b: u64, n: usize) -> Result<f64, DriverError> {
    let barrier = Barrier::new(n);
    // Threads that have not done their share yet; the others keep running while any has not.
    let short = AtomicUsize::new(n);
    let timed: Vec<Result<PassEnds, DriverError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n).map(|_| scope.spawn(|| run_shared_passes(model, device, b, &barrier, &short))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(DriverError::msg("a profiling thread panicked")))).collect()
    });
    let timed = timed.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(window_per_pass_ms(&timed))
}

/// One thread's start and the ends of its passes, and which end completed its share.
struct PassEnds {
    ends: Vec<Instant>,
    share: usize,
}

/// One thread of [`time_shared_passes`]. It always reaches the barrier and always counts
/// itself out of `short`, so that a failing thread stops the others instead of leaving
/// them waiting.
fn run_shared_passes(model: &Path, device: tch::Device, b: u64, barrier: &Barrier, short: &AtomicUsize) -> Result<PassEnds, DriverError> {
    let ready = Runner::load(model, &ImportOptions::default(), device).and_then(|r| {
        let inputs = synthetic_inputs(&r.graph, b as i64, device)?;
        let params: Vec<Tensor> = r.interp().parameters().into_iter().map(|t| t.shallow_clone()).collect();
        // Caches and the allocator warm alone, then the threads start together.
        timed_pass(&r, &params, &inputs)?;
        Ok((r, params, inputs))
    });
    barrier.wait();
    let (runner, params, inputs) = match ready {
        Ok(x) => x,
        Err(e) => {
            short.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
    };
    let start = Instant::now();
    let mut timed = PassEnds { ends: vec![start], share: 0 };
    while short.load(Ordering::SeqCst) > 0 {
        let pass = timed_pass(&runner, &params, &inputs);
        let now = Instant::now();
        timed.ends.push(now);
        let counted = timed.share > 0;
        if pass.is_err() || (!counted && timed.ends.len() > SHARED_PASSES && now.duration_since(start).as_secs_f64() >= SHARED_WINDOW_S) {
            if !counted {
                timed.share = timed.ends.len() - 1;
                short.fetch_sub(1, Ordering::SeqCst);
            }
            pass?;
        }
    }
    Ok(timed)
}

/// The window is from the common start until the last thread completed its share; each
/// thread's passes in it count, the one under way at its end by the share of the thread's
/// mean pass time already spent. Milliseconds of window per pass per thread.
fn window_per_pass_ms(timed: &[PassEnds]) -> f64 {
    let start = timed.iter().map(|t| t.ends[0]).min();
    let end = timed.iter().map(|t| t.ends[t.share]).max();
    let (Some(start), Some(end)) = (start, end) else { return f64::NAN };
    let mut passes = 0.0;
    for t in timed {
        let done = t.ends.iter().skip(1).filter(|x| **x <= end).count();
        let last = t.ends.iter().rfind(|x| **x <= end).copied().unwrap_or(t.ends[0]);
        let total = t.ends.len() - 1;
        let mean = t.ends[total].duration_since(t.ends[0]).as_secs_f64() / total.max(1) as f64;
        let under_way = if mean > 0.0 { (end.duration_since(last).as_secs_f64() / mean).min(1.0) } else { 0.0 };
        passes += done as f64 + under_way;
    }
    end.duration_since(start).as_secs_f64() * 1e3 * timed.len() as f64 / passes
}

/// Rounds of [`time_boundary`]'s one- and two-stage runs (in alternating order), and the
/// steps each run leaves out first (building the autograd graphs' caches, the
/// allocator's pools).
const BOUNDARY_ROUNDS: usize = 4;
const BOUNDARY_WARM_STEPS: usize = 2;
/// The shortest a timed run lasts (estimated from the whole pass), and its fewest and most
/// steps.
const BOUNDARY_RUN_S: f64 = 0.4;
const BOUNDARY_STEPS: (usize, usize) = (6, 200);

/// What one stage boundary costs the runtime ([`BoundaryCost`]) at the smallest and the
/// middle profiled batch size, and how the runtime divides the pass between two stages
/// ([`StageSplit`]) at every profiled batch size: the model compiled as one stage and as
/// two (GPipe, no recomputation) and trained on synthetic data one microbatch per step
/// with one libtorch thread per stage, so that the stages never overlap; in
/// [`BOUNDARY_ROUNDS`] rounds, the two-stage run's forward, backward and step time per
/// step less the one-stage run's ([`boundary_share`]); and from the two-stage runs (alone
/// at the other sizes), each stage's share of the pass; then, from runs of the two-stage
/// build with the stages overlapping ([`spread_runs_at`]), how each forward and backward
/// spread about its stage's mean. Empty for a model of one node, which cannot be cut.
fn time_boundary(model: &Path, device: Device, profiled: &Profiled<'_>, objective: &Objective) -> Result<TwoStages, DriverError> {
    if profiled.nodes.len() < 2 {
        return Ok(TwoStages::default());
    }
    let mut sizes = profiled.batches.to_vec();
    sizes.sort_unstable();
    let mut costed = vec![sizes[0], sizes[sizes.len() / 2]];
    costed.dedup();
    sizes.dedup();
    let dir = tempfile::tempdir().map_err(|e| DriverError::msg(format!("a temporary folder for the one- and two-stage builds: {e}")))?;
    let mut costs = Vec::new();
    let mut per_size = Vec::new();
    for b in sizes {
        let runs = if costed.contains(&b) {
            let (cost, runs) = boundary_at(model, device, b, profiled, objective, dir.path())?;
            costs.push(cost);
            runs
        } else {
            stage_times_at(model, device, b, profiled, objective, dir.path())?
        };
        per_size.push((b, runs));
    }
    let split = per_size
        .iter()
        .map(|(b, runs)| {
            let build = build_path(dir.path(), *b, 2);
            let manifest = Manifest::read(&build).map_err(|e| DriverError::msg(e.to_string()))?;
            stage_split(&build, &manifest, *b, BoundaryCost::pass_ms_at(&costs, *b), &runs.per_stage, profiled.nodes, profiled.loss_at(*b))
        })
        .collect::<Result<_, _>>()?;
    let mut factors = Vec::new();
    for (b, _) in &per_size {
        factors.extend(spread_runs_at(&build_path(dir.path(), *b, 2), device, *b, profiled, objective)?);
    }
    Ok(TwoStages { boundary: costs, split, duration_factors: quantiles(factors) })
}

/// Microbatches per step of [`spread_runs_at`]'s runs: enough that the stages overlap for
/// most of a step, as a pipeline's do.
const SPREAD_MICROBATCHES: u64 = 4;
/// The shortest a [`spread_runs_at`] run lasts (by the whole pass, the stages overlapping),
/// so that the spread takes in how the machine's speed moves over seconds, as a training
/// run meets it.
const SPREAD_RUN_S: f64 = 3.0;

/// Each stage's forwards and backwards over its mean of that kind, in one run of the
/// two-stage `build` at microbatch `b` with [`SPREAD_MICROBATCHES`] per step (GPipe: the
/// stages overlap but for the fill and the drain), steps after the warm-up only. Why not
/// the one-microbatch runs: there the stages take turns, where a pipeline's run at once
/// and share the cores, caches and memory bandwidth (docs/simulator.md, "The operations'
/// spread").
fn spread_runs_at(build: &Path, device: Device, b: u64, profiled: &Profiled<'_>, objective: &Objective) -> Result<Vec<f64>, DriverError> {
    // Two stages at once do a step's passes in about half the time.
    let steps = steps_lasting(profiled, b, SPREAD_RUN_S, SPREAD_MICROBATCHES as f64 / 2.0);
    let report = train_traced(build, device, steps, SPREAD_MICROBATCHES, objective)?;
    Ok(duration_factors(&report.trace))
}

/// What [`time_boundary`] measured: [`Profile::boundary`], [`Profile::split`] and
/// [`Profile::duration_factors`].
#[derive(Default)]
struct TwoStages {
    boundary: Vec<BoundaryCost>,
    split: Vec<StageSplit>,
    duration_factors: Vec<f64>,
}

/// The two-stage runs at one batch size: each stage's mean forward and backward
/// milliseconds per step over [`BOUNDARY_ROUNDS`] runs.
#[derive(Default)]
struct TwoStageRuns {
    per_stage: Vec<[f64; 2]>,
}

impl TwoStageRuns {
    /// Adds one of the [`BOUNDARY_ROUNDS`] runs.
    fn add(&mut self, run: TimedRun) {
        self.per_stage.resize(run.per_stage_ms.len().max(self.per_stage.len()), [0.0; 2]);
        for (sum, ms) in self.per_stage.iter_mut().zip(&run.per_stage_ms) {
            sum[0] += ms[0] / BOUNDARY_ROUNDS as f64;
            sum[1] += ms[1] / BOUNDARY_ROUNDS as f64;
        }
    }
}

/// Where [`time_boundary`] builds the model as `depth` stages at microbatch `b` in `dir`.
fn build_path(dir: &Path, b: u64, depth: u32) -> std::path::PathBuf {
    dir.join(format!("b{b}-d{depth}"))
}

/// The steps of one of [`time_boundary`]'s runs at microbatch `b`: enough to last
/// [`BOUNDARY_RUN_S`] (by the whole pass), within [`BOUNDARY_STEPS`], and the warm-up.
fn boundary_steps(profiled: &Profiled<'_>, b: u64) -> usize {
    steps_lasting(profiled, b, BOUNDARY_RUN_S, 1.0)
}

/// Steps at microbatch `b` enough to last `run_s` when a step takes `passes` of the whole
/// pass, within [`BOUNDARY_STEPS`], and the warm-up.
fn steps_lasting(profiled: &Profiled<'_>, b: u64, run_s: f64, passes: f64) -> usize {
    let step_s = profiled.whole.iter().find(|w| w.batch == b).map_or(0.0, |w| (w.fwd_ms + w.bwd_ms) / 1e3) * passes;
    let timed = if step_s > 0.0 { (run_s / step_s).ceil() as usize } else { BOUNDARY_STEPS.1 };
    timed.clamp(BOUNDARY_STEPS.0, BOUNDARY_STEPS.1) + BOUNDARY_WARM_STEPS
}

/// [`time_boundary`]'s two-stage runs alone at microbatch `b`, building in `dir`.
fn stage_times_at(model: &Path, device: Device, b: u64, profiled: &Profiled<'_>, objective: &Objective, dir: &Path) -> Result<TwoStageRuns, DriverError> {
    let build = build_path(dir, b, 2);
    compile_stages(model, 2, b, &build)?;
    let steps = boundary_steps(profiled, b);
    let mut runs = TwoStageRuns::default();
    for _ in 0..BOUNDARY_ROUNDS {
        runs.add(per_step_ms(&build, device, steps, objective)?);
    }
    Ok(runs)
}

/// [`time_boundary`] at microbatch `b`, building in `dir`: the boundary's cost and the
/// two-stage runs.
fn boundary_at(model: &Path, device: Device, b: u64, profiled: &Profiled<'_>, objective: &Objective, dir: &Path) -> Result<(BoundaryCost, TwoStageRuns), DriverError> {
    let steps = boundary_steps(profiled, b);
    let builds = [1u32, 2].map(|depth| build_path(dir, b, depth));
    for (depth, build) in [1u32, 2].into_iter().zip(&builds) {
        compile_stages(model, depth, b, build)?;
    }
    let mut diffs: [Vec<f64>; 3] = Default::default();
    let mut after_backward = Vec::new();
    let mut runs = TwoStageRuns::default();
    for round in 0..BOUNDARY_ROUNDS {
        // Every other round runs the two-stage build first, so that the machine's drift
        // over the rounds (steady here for minutes at a time) adds to half the differences
        // and takes from the other half instead of adding to all of them.
        let mut ms = [[0.0; 3]; 2];
        for depth in if round % 2 == 0 { [0, 1] } else { [1, 0] } {
            let timed = per_step_ms(&builds[depth], device, steps, objective)?;
            ms[depth] = timed.per_step_ms;
            if depth == 1 {
                after_backward.extend(timed.after_backward_ms.iter().copied());
                runs.add(timed);
            }
        }
        let [one, two] = ms;
        for (k, d) in diffs.iter_mut().enumerate() {
            d.push(two[k] - one[k]);
        }
    }
    let [fwd_ms, bwd_ms, step_ms] = diffs.map(boundary_share);
    let after_backward_ms = (!after_backward.is_empty()).then(|| after_backward.iter().sum::<f64>() / after_backward.len() as f64);
    Ok((BoundaryCost { batch: b, fwd_ms, bwd_ms, step_ms, after_backward_ms }, runs))
}

/// A build's [`StageSplit`] at microbatch `b` (`manifest`, read from `build`): each stage's nodes (those of `nodes`, the
/// profile's) and its mean forward and backward per microbatch in `per_stage`, less half
/// of the boundary's forward and backward cost at `b`, `boundary`, per boundary it has
/// (the first and the last one, the others two), and, for the last, the loss (`loss_ms`).
fn stage_split(build: &Path, manifest: &Manifest, b: u64, boundary: [f64; 2], per_stage: &[[f64; 2]], nodes: &[ProfileNode], loss_ms: (f64, f64)) -> Result<StageSplit, DriverError> {
    let timed_nodes: std::collections::HashSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    let last = per_stage.len().saturating_sub(1);
    let stages = manifest
        .module_paths(build)
        .iter()
        .zip(per_stage)
        .enumerate()
        .map(|(i, (path, ms))| {
            let module = read_module(path).map_err(|e| DriverError::msg(e.to_string()))?;
            let nodes = module.program.instrs.iter().map(|ins| ins.name.clone()).filter(|n| timed_nodes.contains(n.as_str())).collect();
            let (lf, lb) = if i == last { loss_ms } else { (0.0, 0.0) };
            let sides = f64::from(u8::from(i > 0) + u8::from(i < last));
            Ok(SplitStage { nodes, fwd_ms: (ms[0] - sides * boundary[0] / 2.0 - lf).max(0.0), bwd_ms: (ms[1] - sides * boundary[1] / 2.0 - lb).max(0.0) })
        })
        .collect::<Result<_, DriverError>>()?;
    Ok(StageSplit { batch: b, stages })
}

/// `profile` with its [`StageSplit`] at the microbatch a pipeline was trained at replaced
/// by the one that pipeline's trace measured: the stages of `build` (as `train` ran them,
/// at `batch`, by default the microbatch the build decided), each one's mean forward and
/// backward (input and weight gradients together, recomputation apart) per microbatch in
/// `trace` over the steps from `warmup` on. A profile's own split comes from two stages
/// taking turns; a pipeline's stages share the machine, and with several stages per worker
/// their cuts need every stage's share, which only such a run measures (docs/planner.md,
/// "Cuts from a pipeline's trace"). The cost model scales each stage's nodes to its
/// measured share, so re-planning with the result moves the cuts toward the stages'
/// measured times; nodes that change stage keep the scale of the stage they ran in.
pub fn refine(mut profile: Profile, build: &Path, trace: &[TraceEvent], batch: Option<u64>, warmup: u64) -> Result<Profile, DriverError> {
    let manifest = Manifest::read(build).map_err(|e| DriverError::msg(e.to_string()))?;
    let b = batch.or(manifest.pipeline.microbatch).ok_or_else(|| {
        DriverError::msg(format!("{}: the build decided no microbatch; give the one its trace was trained at (--batch)", build.display()))
    })?;
    if !profile.batches.contains(&b) {
        let sizes: Vec<String> = profile.batches.iter().map(u64::to_string).collect();
        return Err(DriverError::msg(format!("the trace was trained at microbatch {b}, which the profile did not measure (it has {}): profile at {b} too (`pipewright profile --batch {b}`)", sizes.join(", "))));
    }
    let per_stage = traced_stage_ms(trace, manifest.stages.len(), warmup)?;
    let boundary = BoundaryCost::pass_ms_at(&profile.boundary, b);
    let loss = profile.loss.as_ref().map_or((0.0, 0.0), |l| loss_at(&profile.batches, l, b));
    let split = stage_split(build, &manifest, b, boundary, &per_stage, &profile.nodes, loss)?;
    if split.stages.iter().all(|s| s.nodes.is_empty()) {
        return Err(DriverError::msg(format!("{}: none of its stages' nodes is in the profile; profile the model the build was compiled from ({})", build.display(), manifest.model)));
    }
    profile.split.retain(|s| s.batch != b);
    profile.split.push(split);
    Ok(profile)
}

/// [`refine`] of the profile file `profile` by the trace files `traces` (`train --trace`:
/// one file, or one per rank of an MPI run) of a run of `build`.
pub fn refine_files(profile: &Path, build: &Path, traces: &[std::path::PathBuf], batch: Option<u64>, warmup: u64) -> Result<Profile, DriverError> {
    let p = crate::plan::read_profile(profile)?;
    let mut events = Vec::new();
    for trace in traces {
        let text = std::fs::read_to_string(trace).map_err(|source| DriverError::Read { path: trace.to_path_buf(), source })?;
        events.extend(pipewright_core::timeline::read_chrome_trace(&text).map_err(|e| DriverError::msg(format!("{}: {e}", trace.display())))?);
    }
    let named: Vec<String> = traces.iter().map(|t| t.display().to_string()).collect();
    refine(p, build, &events, batch, warmup).map_err(|e| DriverError::msg(format!("refining {} by {}: {e}", profile.display(), named.join(", "))))
}

/// Per stage of a pipeline of `stages`, its mean forward and backward milliseconds per
/// microbatch in `trace` over the steps from `warmup` on (a split backward's input and
/// weight gradients added).
fn traced_stage_ms(trace: &[TraceEvent], stages: usize, warmup: u64) -> Result<Vec<[f64; 2]>, DriverError> {
    let mut sums = vec![[0.0; 2]; stages];
    let mut forwards = vec![0u64; stages];
    for e in trace.iter().filter(|e| e.step >= warmup) {
        let k = match e.kind {
            TraceKind::Forward => 0,
            TraceKind::Backward | TraceKind::BackwardWeight => 1,
            _ => continue,
        };
        let Some(sum) = sums.get_mut(e.stage) else {
            return Err(DriverError::msg(format!("the trace has a stage {} but the build has {stages} stage(s): trace a run of this build", e.stage)));
        };
        sum[k] += e.dur_us / 1e3;
        forwards[e.stage] += u64::from(k == 0);
    }
    if let Some(s) = forwards.iter().position(|&n| n == 0) {
        return Err(DriverError::msg(format!("the trace has no forward of stage {s} from step {warmup} on: trace more steps, or fewer warm-up steps (--warmup)")));
    }
    Ok(sums.iter().zip(&forwards).map(|(s, &n)| s.map(|ms| ms / n as f64)).collect())
}

/// What [`per_step_ms`] measures of one training run.
struct TimedRun {
    /// Forward, backward and optimizer milliseconds of all stages together per step.
    per_step_ms: [f64; 3],
    /// Forward and backward milliseconds per step, by stage.
    per_stage_ms: Vec<[f64; 2]>,
    /// Per stage, the mean milliseconds after a backward before the next traced event
    /// ([`after_backward_us`]).
    after_backward_ms: Vec<f64>,
}

/// One kind's cost from the rounds' differences: their mean, 0 when it is negative. The
/// mean and not the median: with the order alternating, a drift over the rounds adds to
/// half the differences and takes from the others, which only the mean cancels. How far
/// apart the rounds are is the measurement's noise (this machine's speed moves by several
/// percent between runs seconds apart): gpt2-tiny's boundary, a tenth of its pass, stands
/// out of it; resnet18's, a few percent of its pass, hardly does.
fn boundary_share(diffs: Vec<f64>) -> f64 {
    (diffs.iter().sum::<f64>() / diffs.len().max(1) as f64).max(0.0)
}

/// Compiles `model` as `depth` stages at microbatch `b` into `build`.
fn compile_stages(model: &Path, depth: u32, b: u64, build: &Path) -> Result<(), DriverError> {
    let plan = PlanRequest::Stages { depth, schedule: Schedule::GPipe, recompute: Recompute::None, microbatch: Some(b), microbatches: Some(u64::from(depth)), placement: Placement::StageMajor };
    let req = CompileRequest { model: model.to_path_buf(), plan, output: build.to_path_buf(), executable: None, stage_onnx: false, passes: PassOptions::default(), import: ImportOptions::default() };
    compile(&req).map(|_| ()).map_err(|e| DriverError::msg(format!("{}: compiling it as {depth} stage(s) to time a stage boundary: {e}", model.display())))
}

/// Trains `build` for `steps` steps of one microbatch on synthetic data (SGD, one libtorch
/// thread per stage) and returns the forward, backward and optimizer milliseconds of all
/// its stages together per step, and each stage's untraced time after a backward, over the
/// steps after [`BOUNDARY_WARM_STEPS`].
fn per_step_ms(build: &Path, device: Device, steps: usize, objective: &Objective) -> Result<TimedRun, DriverError> {
    let report = train_traced(build, device, steps, 1, objective)?;
    let mut sums = [0.0; 3];
    let mut per_stage: Vec<[f64; 2]> = Vec::new();
    for e in report.trace.iter().filter(|e| e.step >= BOUNDARY_WARM_STEPS as u64) {
        let k = match e.kind {
            TraceKind::Forward => 0,
            TraceKind::Backward => 1,
            TraceKind::Optimizer => 2,
            _ => continue,
        };
        sums[k] += e.dur_us / 1e3;
        if k < 2 {
            if per_stage.len() <= e.stage {
                per_stage.resize(e.stage + 1, [0.0; 2]);
            }
            per_stage[e.stage][k] += e.dur_us / 1e3;
        }
    }
    let counted = (steps - BOUNDARY_WARM_STEPS).max(1) as f64;
    let after_backward_ms = after_backward_us(&report.trace, BOUNDARY_WARM_STEPS as u64).into_iter().flatten().map(|us| us / 1e3).collect();
    Ok(TimedRun { per_step_ms: sums.map(|x| x / counted), per_stage_ms: per_stage.into_iter().map(|s| s.map(|x| x / counted)).collect(), after_backward_ms })
}

/// Trains `build` for `steps` steps of `microbatches` microbatches on synthetic data (SGD,
/// one libtorch thread per stage), with a trace.
fn train_traced(build: &Path, device: Device, steps: usize, microbatches: u64, objective: &Objective) -> Result<TrainReport, DriverError> {
    let req = TrainRequest {
        data: DataSource::Synthetic,
        label: None,
        loss: objective.loss,
        output: Some(objective.output.clone()),
        classes: None,
        ignore_index: objective.ignore_index,
        label_smoothing: 0.0,
        steps,
        flags: RunFlags { microbatches: Some(microbatches), ..RunFlags::default() },
        lr: 1e-4,
        optimizer: pipewright_core::Optimizer::Sgd,
        momentum: 0.0,
        weight_decay: 0.0,
        warmup: 0,
        decay: Decay::Constant,
        clip_norm: None,
        seed: 0,
        device,
        trace: true,
        checkpoint_every: None,
        checkpoint_dir: None,
        resume: None,
        force: false,
        threads: Some(1),
        timeout: Duration::from_secs(600),
        max_inflated: DEFAULT_MAX_INFLATED,
        tokens: None,
        data_order: pipewright_core::DataOrder::Shuffle,
        eval_data: None,
        eval_every: None,
        eval_batches: None,
        precision: Precision::Fp32,
        devices: Vec::new(),
        // Not `Skip`: its agreement between the stages would put a wait in the update.
        on_nonfinite: NonFinite::Stop,
        max_skips: pipewright_core::DEFAULT_MAX_SKIPS,
        schedule: None,
    };
    Ok(Session::prepare(build, &req)?.run(&mut |_| {})?)
}

/// Each forward and backward of `trace` after [`BOUNDARY_WARM_STEPS`] over the mean of its
/// stage and kind there.
fn duration_factors(trace: &[TraceEvent]) -> Vec<f64> {
    let timed: Vec<TraceEvent> = trace.iter().filter(|e| e.step >= BOUNDARY_WARM_STEPS as u64).cloned().collect();
    let us: Vec<f64> = timed.iter().map(|e| e.dur_us).collect();
    pipewright_passes::machine::duration_factors(&timed, &us)
}

/// The factors a profile keeps of all its two-stage runs': at most this many evenly spaced
/// quantiles (a fast model's runs time thousands of operations).
const DURATION_QUANTILES: usize = 64;

/// `values` as [`DURATION_QUANTILES`] quantiles, each the middle of its equal share of the
/// sorted values (all of them, sorted, when fewer). The simulator draws each kept value
/// as often as any other, so the lowest and the highest are not kept: one outlier among
/// thousands would stand for a whole share (gpt2-tiny's profile kept a factor of 3.98,
/// and its spread's standard deviation was 0.40 instead of 0.15, docs/simulator.md, "The
/// operations' spread").
fn quantiles(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    if values.len() <= DURATION_QUANTILES {
        return values;
    }
    let n = values.len();
    (0..DURATION_QUANTILES).map(|i| values[(2 * i + 1) * n / (2 * DURATION_QUANTILES)]).collect()
}

/// A spread of the repetitions' totals, relative to their median, above which a profile
/// is said to be unreliable.
const NOISY_SPREAD: f64 = 0.25;

impl Progress<'_> {
    /// What the command says as the profile goes: one batch size's whole-model time over
    /// the repetitions (with a warning when they spread too far), or what was not measured.
    pub fn lines(&self) -> Vec<String> {
        match self {
            Progress::Batch(s) => {
                let mut v = vec![format!(
                    "profile: batch {}: forward + backward {:.3} ms (median of {} repetitions; min {:.3}, max {:.3}: spread {:.0}%)",
                    s.batch,
                    s.median_ms,
                    s.reps,
                    s.min_ms,
                    s.max_ms,
                    s.relative() * 100.0
                )];
                if s.relative() > NOISY_SPREAD {
                    v.push(format!("profile: warning: batch {}: the repetitions differ by more than {:.0}%; the machine looks busy (rerun idle, or with more --reps)", s.batch, NOISY_SPREAD * 100.0));
                }
                v
            }
            Progress::Skipped { what, why } => vec![format!("profile: warning: {what} was not measured: {why}")],
            Progress::Unsteady(why) => vec![format!("profile: warning: {why}: the machine looks busy or its speed moved (rerun idle); the simulator's crowding comes from these times")],
        }
    }
}

/// What a finished profile says beside its JSON: the stage boundary's cost, the runtime's
/// untraced work, each split's stage shares, the operations' spread, the accumulation and
/// the crowding of the host's cores.
pub fn notes(p: &Profile) -> Vec<String> {
    let mut v = Vec::new();
    for c in &p.boundary {
        v.push(format!("profile: a stage boundary costs {:.3} ms forward, {:.3} ms backward (per microbatch) and {:.3} ms per update, at batch {}", c.fwd_ms, c.bwd_ms, c.step_ms, c.batch));
        if let Some(ms) = c.after_backward_ms {
            v.push(format!("profile: after each backward a stage's runtime works {ms:.3} ms outside its traced operations, at batch {}", c.batch));
        }
    }
    v.extend(p.split.iter().filter_map(|sp| split_note(p, sp)));
    if let Some(spread) = pipewright_passes::machine::DurationSpread::new(&p.duration_factors) {
        let f = spread.factors();
        let at = |q: f64| f[((f.len() - 1) as f64 * q).round() as usize];
        v.push(format!("profile: a stage's forwards and backwards take {:.2} to {:.2} of its mean (10th to 90th percentile; the simulator draws from these)", at(0.1), at(0.9)));
    }
    if let Some(ms) = p.accumulate_ms {
        v.push(format!("profile: accumulating a gradient of every weight takes {ms:.3} ms (each microbatch of a step but the first)"));
    }
    if let Some(s) = &p.sharing {
        let b = p.batches.iter().copied().max().unwrap_or(1);
        let c = s.crowding(b);
        v.push(format!("profile: threads crowding the {} cores slow each other by {:.2} ({} threads) and {:.2} ({}), at batch {b}", s.cores, c.at_cores, s.cores, c.at_twice, 2 * s.cores));
        if let Some(turn) = s.turn_ms {
            v.push(format!("profile: a thread that never blocks keeps a core for {turn:.2} ms while others wait (the scheduler's tick in the replays)"));
        }
    }
    v
}

/// How the stages of a split divided the pass against their nodes timed alone.
pub fn split_note(p: &Profile, sp: &StageSplit) -> Option<String> {
    let k = p.batches.iter().position(|&b| b == sp.batch)?;
    let text = |v: Option<Vec<f64>>| v.map_or("-".to_string(), |v| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / "));
    let (fwd, bwd) = sp.stage_scales(&p.nodes, k);
    Some(format!(
        "profile: trained as {} stages, each stage's share of the pass over its nodes' timed alone: forward {}, backward {}, at batch {}",
        sp.stages.len(),
        text(fwd),
        text(bwd),
        sp.batch
    ))
}

/// The profile as the JSON `plan --profile` and `simulate --profile` read.
pub fn profile_json(p: &Profile) -> Result<String, DriverError> {
    serde_json::to_string_pretty(p).map_err(|e| DriverError::msg(format!("profile: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_or_moving_host_is_named_per_batch() {
        let run = |batch, threads, pass_ms| SharedPasses { batch, threads, pass_ms };
        let sharing = HostSharing {
            cores: 2,
            runs: vec![
                // Steady: one thread as fast as the whole pass, 2 threads 1.1 times it.
                run(1, 1, 5.0), run(1, 2, 5.5), run(1, 4, 12.0),
                // 2 threads on 2 cores 1.9 times one alone: someone else had a core.
                run(2, 1, 7.0), run(2, 2, 13.3), run(2, 4, 16.0),
                // One thread 40% slower than the whole pass moments before.
                run(4, 1, 14.0), run(4, 2, 14.5), run(4, 4, 30.0),
            ],
            turn_ms: None,
        };
        let whole = [(1, 5.0), (2, 7.0), (4, 10.0)].map(|(batch, ms)| WholePass { batch, fwd_ms: ms / 3.0, bwd_ms: 2.0 * ms / 3.0 });
        let found = unsteady_sharing(&sharing, &whole);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("batch 2: 2 threads on 2 cores each took 1.90 times"), "{found:?}");
        assert!(found[1].starts_with("batch 4: one thread's pass took 14.000 ms while crowding was timed, the whole pass 10.000 ms"), "{found:?}");
    }

    /// A run's factors are each forward and backward after the warm-up over the mean of its
    /// stage and kind; updates and warm-up steps do not count. Kept factors stand for equal
    /// shares of the sorted values, each its share's middle, so that an outlier among
    /// thousands is not kept as one of them.
    #[test]
    fn duration_factors_are_each_operation_over_its_stage_and_kinds_mean() {
        let ev = |kind, stage, step: u64, dur_us| TraceEvent { kind, stage, start_us: 0.0, dur_us, microbatch: Some(step), version: 0, step };
        let warm = BOUNDARY_WARM_STEPS as u64;
        let mut trace = vec![ev(TraceKind::Forward, 0, 0, 9e6), ev(TraceKind::Optimizer, 1, warm, 9e6)];
        for (step, f0, b1) in [(warm, 1000.0, 3000.0), (warm + 1, 3000.0, 1000.0)] {
            trace.extend([ev(TraceKind::Forward, 0, step, f0), ev(TraceKind::Backward, 1, step, b1)]);
        }
        let mut factors = duration_factors(&trace);
        factors.sort_by(f64::total_cmp);
        assert_eq!(factors, [0.5, 0.5, 1.5, 1.5]);
        let many: Vec<f64> = (0..=1000).rev().map(f64::from).collect();
        let q = quantiles(many);
        assert_eq!(q.len(), DURATION_QUANTILES);
        // 1,001 values in 64 shares of about 15.6: the first's middle is the 8th value.
        assert_eq!((q[0], q[DURATION_QUANTILES - 1]), (7.0, 993.0));
        assert!(q.windows(2).all(|w| w[0] < w[1]), "{q:?}");
        assert_eq!(quantiles(vec![2.0, 1.0]), [1.0, 2.0]);
        let mut one_slow = vec![1.0; 2000];
        one_slow[700] = 4.0;
        assert!(quantiles(one_slow).iter().all(|&f| f == 1.0));
    }

    /// A trace's stage times are each stage's forwards and backwards (input and weight
    /// gradients added, recomputation left out) per forward it ran, from the warm-up on.
    #[test]
    fn traced_stage_times_are_per_microbatch_after_the_warm_up() {
        let ev = |kind, stage, step: u64, dur_us| TraceEvent { kind, stage, start_us: 0.0, dur_us, microbatch: Some(step), version: 0, step };
        let mut trace = vec![ev(TraceKind::Forward, 0, 0, 9e6), ev(TraceKind::Backward, 1, 0, 9e6)];
        for step in [1, 2] {
            trace.extend([
                ev(TraceKind::Forward, 0, step, 1000.0),
                ev(TraceKind::Backward, 0, step, 2000.0),
                ev(TraceKind::Forward, 1, step, 3000.0),
                ev(TraceKind::Backward, 1, step, 1000.0),
                ev(TraceKind::BackwardWeight, 1, step, 500.0),
                ev(TraceKind::Recompute, 1, step, 7000.0),
                ev(TraceKind::Optimizer, 1, step, 7000.0),
            ]);
        }
        assert_eq!(traced_stage_ms(&trace, 2, 1).unwrap(), [[1.0, 2.0], [3.0, 1.5]]);
        let e = traced_stage_ms(&trace, 1, 1).unwrap_err().to_string();
        assert!(e.contains("the trace has a stage 1 but the build has 1 stage(s)"), "{e}");
        let e = traced_stage_ms(&trace, 3, 1).unwrap_err().to_string();
        assert!(e.contains("no forward of stage 2 from step 1 on"), "{e}");
    }

    /// A spinning thread's turns are the runs between two losses of its core; the run
    /// cut by the window's start and the one cut by its end are not turns.
    #[test]
    fn turns_run_from_one_pause_to_the_next() {
        let t0 = Instant::now();
        let at = |ms: f64| t0 + Duration::from_secs_f64(ms * 1e-3);
        // Pauses over [1, 5], [9, 13] and [17.5, 21] ms: turns of 4 and 4.5 ms.
        let pauses = [(at(1.0), at(5.0)), (at(9.0), at(13.0)), (at(17.5), at(21.0))];
        let runs: Vec<f64> = runs_between(&pauses).iter().map(|s| (s * 1e3 * 1e6).round() / 1e6).collect();
        assert_eq!(runs, [4.0, 4.5]);
        assert!(runs_between(&pauses[..1]).is_empty());
        assert!(runs_between(&[]).is_empty());
    }

    /// Repetitions stop once there are `reps` of them and they have filled the window, or
    /// at the most allowed, whichever comes first after `reps`.
    #[test]
    fn repetitions_fill_their_window_between_the_least_and_the_most() {
        let long_ago = Instant::now() - Duration::from_secs(10);
        let just_now = Instant::now();
        // The window long filled: `reps` decides.
        assert!(!enough(4, 5, long_ago, 0.5));
        assert!(enough(5, 5, long_ago, 0.5));
        // Not filled: more repetitions, up to the most.
        assert!(!enough(5, 5, just_now, 60.0));
        assert!(!enough(MOST_REPS - 1, 5, just_now, 60.0));
        assert!(enough(MOST_REPS, 5, just_now, 60.0));
        // More asked for than the most: the asked number still counts, and 0 reads as 1.
        assert!(!enough(MOST_REPS, MOST_REPS + 10, long_ago, 0.5));
        assert!(enough(1, 0, long_ago, 0.5));
    }
}
