//! One stage's worker: executes its op sequence, keeping at most the weight versions the
//! schedule still needs.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender};

use pipewright_core::{Loss, NonFinite, Recompute, UpdateRule};
use tch::{Kind, Tensor};

use super::checkpoint::StageState;
use super::memory::{bytes_of, StageMemory};
use super::optim::OptState;
use super::pieces::{pieces, Engine, Piece, PieceFwd, WeightRead};
use super::precision::{compute_kind, LossScaler, Precision};
use super::specialise::{self, Specialised};
use super::turns::Turns;
use super::trace::Recorder;
use crate::timeline::{TraceEvent, TraceKind};
use super::{Event, Objective, Op, PipelineError, StageData, SumGroup, TrainConfig, Transport};
use crate::exec::{tensor_from_bytes, Mode, Signatures};

use crate::module::StageModule;
use crate::program::{split_batch_axis, Program, SlotId};

#[derive(Clone)]
pub(crate) struct StageSpec {
    pub index: usize,
    pub program: Program,
    /// Leading program inputs received from the previous stage.
    pub n_recv: usize,
    pub graph_input_names: Vec<String>,
    /// Leading program outputs sent to the next stage.
    pub n_send: usize,
    /// Last stage: the loss and the index of its output in `program.outputs`.
    pub loss: Option<(Objective, usize)>,
    /// The axis of the loss's output that carries the batch (0 unless the output carries
    /// it further in, [`split_batch_axis`]): the labels' sample axis goes there.
    pub label_axis: usize,
    pub recompute_full: bool,
    /// The update rule of the stage's trainable weights (the weight-versioning pass's
    /// decision, from the module); `Constant` when the stage trains nothing.
    pub update: UpdateRule,
    /// The most weight versions the module lets the stage hold at once.
    pub version_budget: usize,
    /// Selective recomputation: the program runs piece by piece ([`super::pieces`]).
    pub recompute_selective: bool,
    pub needs_data: bool,
}

/// The spec of one stage known only from its own module (a worker process): received
/// inputs and sent outputs are recognised by their wire names (`value@stageK`).
pub(crate) fn spec_alone(s: &StageModule, loss: &Objective) -> Result<StageSpec, PipelineError> {
    let (k, d) = (s.header.params.stage as usize, s.header.params.depth as usize);
    let p = &s.program;
    let names = |slots: &[SlotId]| -> Vec<String> { slots.iter().map(|s| p.slots[s.index()].name.clone()).collect() };
    let (ins, outs) = (names(&p.inputs), names(&p.outputs));
    let (recv_tag, send_tag) = (format!("@stage{k}"), format!("@stage{}", k + 1));
    let n_recv = ins.iter().take_while(|n| n.ends_with(&recv_tag)).count();
    let n_send = if k + 1 < d { outs.iter().take_while(|n| n.ends_with(&send_tag)).count() } else { 0 };
    if ins[n_recv..].iter().any(|n| n.ends_with(&recv_tag)) || outs[n_send..].iter().any(|n| k + 1 < d && n.ends_with(&send_tag)) {
        return Err(PipelineError::Config(format!("stage {k}: received inputs / sent outputs must come first in the program")));
    }
    stage_spec(s, k + 1 == d, &ins, &outs, n_recv, n_send, loss)
}

/// The spec of stage `s` once its received inputs and sent outputs are known.
fn stage_spec(s: &StageModule, last: bool, ins: &[String], outs: &[String], n_recv: usize, n_send: usize, loss: &Objective) -> Result<StageSpec, PipelineError> {
    let k = s.header.params.stage as usize;
    let loss = if last {
        let i = outs.iter().position(|n| *n == loss.output).ok_or_else(|| PipelineError::Stage {
            stage: k,
            message: format!("the loss reads output {:?}, which the last stage does not produce (outputs {outs:?})", loss.output),
        })?;
        Some((loss.clone(), i))
    } else {
        None
    };
    let graph_input_names = ins[n_recv..].to_vec();
    let (update, version_budget) = weight_versioning(s)?;
    let label_axis = loss.as_ref().and_then(|(_, i)| s.program.outputs.get(*i)).and_then(|o| split_batch_axis(&s.program.slots[o.index()].shape)).map_or(0, |(axis, _)| axis);
    Ok(StageSpec {
        index: k,
        program: s.program.clone(),
        n_recv,
        needs_data: !graph_input_names.is_empty() || loss.is_some(),
        graph_input_names,
        n_send,
        loss,
        label_axis,
        recompute_full: s.header.params.recompute == Recompute::Full,
        update,
        version_budget,
        recompute_selective: s.header.params.recompute == Recompute::Selective,
    })
}

/// The update rule and version budget the weight-versioning pass gave the stage's
/// trainable weights: one rule for all of them (versions advance per stage, not per
/// weight), and the one the module's schedule implies. A stage that trains nothing
/// follows its schedule.
fn weight_versioning(s: &StageModule) -> Result<(UpdateRule, usize), PipelineError> {
    let k = s.header.params.stage as usize;
    let p = &s.program;
    let schedule = s.header.params.schedule;
    let fail = |message: String| PipelineError::Stage { stage: k, message };
    let mut decided: Option<(UpdateRule, usize)> = None;
    for t in p.stored.iter().filter(|t| t.trainable) {
        let name = &p.slots[t.slot.index()].name;
        if t.update != schedule.update_rule() {
            return Err(fail(format!(
                "trainable weight {name:?} is versioned for update rule {}, but the module's schedule {schedule} updates by {}; recompile the model",
                t.update,
                schedule.update_rule()
            )));
        }
        let budget = decided.map_or(0, |d| d.1).max(t.versions as usize);
        decided = Some((t.update, budget));
    }
    let (update, budget) = decided.unwrap_or((schedule.update_rule(), schedule.weight_versions() as usize));
    if update == UpdateRule::TwoBw && budget < 2 {
        return Err(fail(format!("2BW needs two weight versions, the module allows {budget}")));
    }
    Ok((update, budget))
}

pub(crate) fn specs(stages: &[StageModule], loss: &Objective) -> Result<Vec<StageSpec>, PipelineError> {
    let d = stages.len();
    let names = |p: &Program, slots: &[SlotId]| -> Vec<String> { slots.iter().map(|s| p.slots[s.index()].name.clone()).collect() };
    let mut out = Vec::new();
    for (k, s) in stages.iter().enumerate() {
        let p = &s.program;
        let ins = names(p, &p.inputs);
        let outs = names(p, &p.outputs);
        let prev_outs = if k > 0 { names(&stages[k - 1].program, &stages[k - 1].program.outputs) } else { Vec::new() };
        let next_ins = if k + 1 < d { names(&stages[k + 1].program, &stages[k + 1].program.inputs) } else { Vec::new() };
        let n_recv = ins.iter().take_while(|n| prev_outs.contains(n)).count();
        let n_send = outs.iter().take_while(|n| next_ins.contains(n)).count();
        if ins[n_recv..].iter().any(|n| prev_outs.contains(n)) || outs[n_send..].iter().any(|n| next_ins.contains(n)) {
            return Err(PipelineError::Config(format!("stage {k}: received inputs / sent outputs must come first in the program")));
        }
        if k + 1 < d {
            let nk = &stages[k + 1].program;
            let their = names(nk, &nk.inputs);
            let their_recv: Vec<&String> = their.iter().take_while(|n| outs.contains(n)).collect();
            let mine: Vec<&String> = outs[..n_send].iter().collect();
            if their_recv != mine {
                return Err(PipelineError::Config(format!("stage {k}: sends {mine:?} but stage {} receives {their_recv:?}", k + 1)));
            }
        }
        out.push(stage_spec(s, k + 1 == d, &ins, &outs, n_recv, n_send, loss)?);
    }
    Ok(out)
}

pub(crate) struct StageOut {
    pub weights: Vec<(String, Tensor)>,
    /// Running statistics as training left them.
    pub buffers: Vec<(String, Tensor)>,
    pub peak_versions: usize,
    pub memory: StageMemory,
    pub trace: Vec<TraceEvent>,
    /// Reads of values not known before the step that the stage's kernels made (device
    /// synchronisations on a GPU), over the whole run.
    pub host_reads: u64,
    /// Known values (stored constants, folded outputs) the stage never uploaded, and their
    /// bytes (`Specialised::off_device`).
    pub off_device: (usize, u64),
}

/// A stage error; `induced` when it only reflects another stage (or the feeder) stopping.
pub(crate) struct Failure {
    pub error: PipelineError,
    pub induced: bool,
}

/// The forward state a backward needs.
pub(super) struct Fwd {
    params: Vec<Tensor>,
    recv: Vec<Tensor>,
    pub(super) outputs: Vec<Tensor>,
    pub(super) loss: Option<Tensor>,
    /// Bytes of the non-view kernel outputs this forward produced while recording a graph.
    act_bytes: u64,
    /// Selective recomputation: the pieces' state and the leaf the loss was computed on.
    pieces: Option<(PieceFwd, Option<Tensor>)>,
    /// A schedule that splits the backward: each instruction's weight reads.
    reads: Vec<WeightRead>,
}

impl Fwd {
    /// Whether the weight-gradient half walks the forward's graph again: a deferred read
    /// whose gradient is not formed directly ([`super::pieces::DirectGrad`]) does.
    fn weights_need_graph(&self) -> bool {
        self.reads.iter().any(|r| r.deferred && r.direct.is_none())
    }

    /// What the weight-gradient half reads once the input gradient has run: the weights and
    /// the reads. Where the graph was not kept ([`Fwd::weights_need_graph`]) the outputs,
    /// the loss, the received inputs and the direct reads' outputs go too, so that the
    /// microbatch holds only its products' operands and kept gradients until then, not
    /// every activation its backward saved.
    fn weight_half(mut self) -> Fwd {
        if self.weights_need_graph() {
            return self;
        }
        self.outputs.clear();
        self.loss = None;
        self.recv.clear();
        for r in self.reads.iter_mut().filter(|r| r.direct.is_some()) {
            r.outputs.clear();
        }
        self
    }

    /// The live bytes of a microbatch between its input and weight gradients: the kept
    /// output gradients, and the forward's `graph_bytes` where the graph is kept, or else
    /// the products' operands (each tensor once: projections of one input share it).
    fn awaiting_bytes(&self, graph_bytes: u64, grads: &SplitGrads) -> u64 {
        let kept: u64 = grads.outputs.iter().flatten().flatten().map(bytes_of).sum();
        if self.weights_need_graph() {
            return graph_bytes + kept;
        }
        let mut seen = std::collections::HashSet::new();
        let operands: u64 = self.reads.iter().filter_map(|r| r.direct.as_ref()).map(|d| d.operand()).filter(|t| seen.insert(t.data_ptr() as usize)).map(bytes_of).sum();
        operands + kept
    }
}

/// A microbatch between its input gradient and its weight gradient (a schedule that
/// splits the backward): what its weight gradients read of its forward
/// ([`Fwd::weight_half`]), the gradient of each deferred weight read's outputs, and the
/// weight gradients the input gradient already gave.
struct AwaitingWeights {
    mb: u64,
    version: u64,
    fwd: Fwd,
    half: WeightHalf,
    /// Live bytes this entry holds.
    bytes: u64,
}

struct Stash {
    mb: u64,
    version: u64,
    /// Stage inputs (received then graph), kept for recomputation.
    inputs: Vec<Tensor>,
    labels: Option<Tensor>,
    fwd: Option<Fwd>,
    /// Live bytes this entry holds.
    bytes: u64,
}

/// Everything one worker thread needs: which stage of which replica it runs, its op
/// sequence, its links and, when resuming, its saved state.
pub(crate) struct WorkerArgs {
    pub spec: StageSpec,
    pub replica: usize,
    pub replicas: usize,
    pub ops: Vec<Op>,
    /// Where the worker runs other stages too (interleaved 1F1B): this stage's turns.
    pub turns: Option<Turns>,
    pub m: usize,
    pub cfg: TrainConfig,
    pub data: Option<Receiver<StageData>>,
    pub transport: Box<dyn Transport>,
    pub events: Sender<Event>,
    pub epoch: Option<std::time::Instant>,
    pub start_step: u64,
    pub resume: Option<StageState>,
}

pub(crate) fn run(args: WorkerArgs) -> Result<StageOut, Failure> {
    let k = args.spec.index;
    let mut tr = args.transport;
    let (spec, data, events) = (args.spec, args.data, args.events);
    let ctx = Ctx { replica: args.replica, replicas: args.replicas, m: args.m, cfg: &args.cfg, start_step: args.start_step };
    let mut rec = Recorder::new(args.epoch.filter(|_| args.replica == 0), k);
    // Every libtorch call of the worker is fallible; should one still panic (a bug), the
    // panic stops this stage with an error like any other, and the others with it.
    silence_worker_panics();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(spec, args.ops, args.turns, &ctx, args.resume, data, tr.as_mut(), &events, &mut rec)))
        .unwrap_or_else(|panic| Err(E::Msg(format!("internal error (please report it): {}", panic_text(&panic)))));
    if r.is_err() {
        tr.abort();
    }
    drop(tr);
    r.map_err(|e| match e {
        E::Msg(message) => Failure { error: PipelineError::Stage { stage: k, message }, induced: false },
        E::Induced(message) => Failure { error: PipelineError::Stage { stage: k, message }, induced: true },
        E::Err(error) => Failure { error, induced: false },
    })
}

/// The first line of a panic's message (libtorch's own messages go on with a C++ trace).
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    let text = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("a panic");
    text.lines().next().unwrap_or("").to_string()
}

/// Keeps the default panic message off stderr for pipeline worker threads (their panics
/// become errors the caller reports); other threads keep the previous hook.
fn silence_worker_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !std::thread::current().name().is_some_and(|n| n.starts_with(WORKER_THREAD_PREFIX)) {
                previous(info);
            }
        }));
    });
}

/// Whether step `t` (from 0) writes a checkpoint (`TrainConfig::checkpoint_every`).
fn checkpoint_due(cfg: &TrainConfig, t: u64) -> bool {
    cfg.checkpoint_every.is_some_and(|n| n > 0 && (t + 1) % n as u64 == 0)
}

/// Pipeline worker threads are named `pipewright-r{replica}-stage{k}`.
pub(crate) const WORKER_THREAD_PREFIX: &str = "pipewright-r";

struct Ctx<'a> {
    replica: usize,
    replicas: usize,
    m: usize,
    cfg: &'a TrainConfig,
    start_step: u64,
}

impl Ctx<'_> {
    /// The first stage, about to begin step `step`: whether the run stops before it, agreed
    /// by the first stages of every replica ([`super::StopGate`]).
    fn stops_before(&self, step: u64, tr: &mut dyn Transport) -> Result<bool, E> {
        let Some(gate) = self.cfg.stop.as_ref() else { return Ok(false) };
        if step <= self.start_step {
            return Ok(false); // a session completes at least one step
        }
        let asked = gate.requested();
        if self.replicas == 1 {
            return Ok(asked);
        }
        // Every replica's first stage takes part at the same op, asked or not.
        let votes = tr.all_reduce_replicas(vec![Tensor::from(f64::from(u8::from(asked)))]).map_err(induced)?;
        let sum = votes.first().map(|v| v.f_double_value(&[])).transpose().map_err(torch("agreeing on a stop"))?;
        Ok(sum.is_some_and(|s| s > 0.0))
    }
}

/// The step an op belongs to.
fn op_step(op: Op, m: u64) -> u64 {
    match (op, op.microbatch()) {
        (_, Some(j)) => j / m,
        (Op::Step(t), None) => t,
        (_, None) => 0,
    }
}

pub(super) enum E {
    Msg(String),
    Induced(String),
    Err(PipelineError),
}

fn induced(s: String) -> E {
    E::Induced(s)
}

fn torch(what: &str) -> impl Fn(tch::TchError) -> E + '_ {
    move |e| E::Msg(format!("{what}: {}", e.to_string().lines().next().unwrap_or("")))
}

/// The gradients of `replicas` replicas summed, back on their devices (`here`) and divided
/// by the replica count.
fn replica_mean(summed: Vec<Tensor>, here: &[tch::Device], replicas: usize) -> Result<Vec<Tensor>, E> {
    tch::no_grad(|| summed.iter().zip(here).map(|(g, &dev)| g.f_to_device(dev).map(|g| g / replicas as f64)).collect::<Result<Vec<_>, _>>()).map_err(torch("moving reduced gradients"))
}

/// What a step's microbatches saw on this stage: their summed loss (last stage), samples
/// (first stage) and whether a loss was not finite.
struct Batch {
    loss: f64,
    samples: usize,
    nonfinite: bool,
}

/// Where a step's sum over its replicas stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplicaSum {
    /// Waiting for the tied sums it adds.
    NotBegun,
    InFlight,
    /// Summed (or one replica).
    Done,
}

/// A step's gradients on their way to its update (see [`Worker::step_op`]).
struct Deferred {
    batch: Batch,
    /// Its gradients: as accumulated, with the tied sums in, then averaged over replicas
    /// (empty while the replicas' sum is in flight).
    grads: Vec<Tensor>,
    /// The tied groups (indices into the worker's) whose sums are in flight.
    tied: Vec<usize>,
    replicas: ReplicaSum,
    t: u64,
    /// When its sums began (the trace's all-reduce span).
    t0: Option<std::time::Instant>,
    /// The gradients' devices.
    here: Vec<tch::Device>,
    /// Where the update needs an answer every stage agrees on ([`Worker::needs_agreement`]):
    /// the microbatch after whose forward it is made, the last of step `t + 1`. `None`:
    /// it is made when its version is first needed.
    agree_after: Option<u64>,
}

/// The tied weights' gradients of a stage that sums them early ([`Worker::early_tied`]),
/// kept apart from the batch's accumulator (whose entries for them stay empty scalars
/// until the sum takes their place).
#[derive(Default)]
struct EarlyTied {
    /// This batch's gradients so far, by weight index: each input gradient adds its own.
    acc: BTreeMap<usize, Tensor>,
    /// The tied groups whose sum the batch's last input gradient began, each with its sum
    /// where that completed at once.
    begun: Vec<(usize, Option<Vec<Tensor>>)>,
    /// Bytes of the begun groups' gradients, held until the step.
    begun_bytes: u64,
}

impl EarlyTied {
    fn bytes(&self) -> u64 {
        self.acc.values().map(bytes_of).sum::<u64>() + self.begun_bytes
    }
}

/// The mutable state of a worker between ops.
struct State {
    versions: BTreeMap<u64, Vec<Tensor>>,
    /// Mixed precision: each live version's weights in the compute type, made by its first
    /// forward and shared (as fresh autograd leaves over the same storage) by every
    /// microbatch that uses it, so a stage holds one cast copy per version, not one per
    /// in-flight microbatch.
    cast: BTreeMap<u64, Vec<Tensor>>,
    opt: OptState,
    stash: VecDeque<Stash>,
    /// Microbatches whose weight gradient is still to run (a schedule that splits the
    /// backward), oldest first.
    awaiting: VecDeque<AwaitingWeights>,
    acc: Option<Vec<Tensor>>,
    /// The tied weights' gradients of a stage that sums them early ([`Worker::early_tied`]).
    tied: EarlyTied,
    /// Bytes of the gradients of an update waiting for its sums ([`Deferred`]): held
    /// beside the next batch's accumulator until the update is applied.
    deferred_gradients: u64,
    batch_loss: f64,
    batch_samples: usize,
    /// `--on-nonfinite skip`: this batch's loss was not finite (so far, on this stage).
    batch_nonfinite: bool,
    /// `--on-nonfinite skip`: steps skipped in a row up to the last one.
    skips_in_a_row: usize,
    /// Running statistics after the last forward of each batch not yet checkpointed.
    stats_at_batch_end: BTreeMap<u64, Vec<Tensor>>,
    peak_versions: usize,
    memory: StageMemory,
}

#[allow(clippy::too_many_arguments)]
fn run_inner(
    spec: StageSpec,
    ops: Vec<Op>,
    mut turns: Option<Turns>,
    ctx: &Ctx<'_>,
    resume: Option<StageState>,
    data: Option<Receiver<StageData>>,
    tr: &mut dyn Transport,
    events: &Sender<Event>,
    rec: &mut Recorder,
) -> Result<StageOut, E> {
    let cfg = ctx.cfg;
    if let Some(n) = cfg.threads {
        // Per calling thread (OpenMP): each worker gets its own share of the cores.
        tch::set_num_threads(n.max(1) as i32);
    }
    tch::manual_seed(cfg.seed.wrapping_add(spec.index as i64));
    let reads_before = crate::exec::host_reads();
    let (mut w, params) = Worker::load(spec, cfg)?;
    tr.prepare_sums(&w.sum_groups(ctx)).map_err(E::Msg)?;
    let mut st = State {
        versions: BTreeMap::new(),
        cast: BTreeMap::new(),
        opt: OptState::new(cfg.optimizer, params.len()),
        stash: VecDeque::new(),
        awaiting: VecDeque::new(),
        acc: None,
        tied: EarlyTied::default(),
        deferred_gradients: 0,
        batch_loss: 0.0,
        batch_samples: 0,
        batch_nonfinite: false,
        skips_in_a_row: 0,
        stats_at_batch_end: BTreeMap::new(),
        peak_versions: 1,
        memory: StageMemory::default(),
    };
    match resume {
        Some(saved) => w.restore(&mut st, params, saved, ctx)?,
        None => {
            st.versions.insert(ctx.start_step, params);
        }
    }
    // For each op, the microbatch of the next forward at or after it.
    let mut next_fwd: Vec<Option<u64>> = vec![None; ops.len() + 1];
    for i in (0..ops.len()).rev() {
        next_fwd[i] = match ops[i] {
            Op::Forward(j) => Some(j),
            _ => next_fwd[i + 1],
        };
    }
    let m64 = ctx.m as u64;
    // Set when the run stops early: the first step not run ([`super::StopGate`]).
    let mut stop_before: Option<u64> = None;
    // A step whose update waits for its gradient sum, done before its version is needed.
    let mut deferred: Option<Deferred> = None;
    for (i, op) in ops.into_iter().enumerate() {
        // Passed on at the end of the iteration, however it ends (skipped ops too).
        let _turn = match turns.as_mut() {
            Some(t) => Some(t.take(i).map_err(induced)?),
            None => None,
        };
        if stop_before.is_some_and(|s| op_step(op, m64) >= s) {
            continue;
        }
        if let Some(d) = deferred.as_mut() {
            w.advance(d, ctx, tr)?;
        }
        match op {
            Op::Forward(j) => {
                if deferred.as_ref().is_some_and(|d| w.spec.update.version_for(j, m64) > d.t) {
                    if let Some(d) = deferred.take() {
                        w.finish_step(&mut st, d, ctx, tr, events, rec)?;
                    }
                }
                if !w.forward_op(&mut st, j, ctx, data.as_ref(), tr, rec)? {
                    stop_before = Some(j / m64);
                    continue;
                }
                if deferred.as_ref().is_some_and(|d| d.agree_after == Some(j)) {
                    if let Some(d) = deferred.take() {
                        w.finish_step(&mut st, d, ctx, tr, events, rec)?;
                    }
                }
            }
            Op::Backward(j) => w.backward_op(&mut st, j, ctx, tr, rec)?,
            Op::BackwardInput(j) => w.backward_input_op(&mut st, j, ctx, tr, rec)?,
            Op::BackwardWeight(j) => w.backward_weight_op(&mut st, j, ctx, rec)?,
            Op::Step(t) => {
                if let Some(d) = deferred.take() {
                    w.finish_step(&mut st, d, ctx, tr, events, rec)?;
                }
                // Free versions no longer needed before making the new one, so 2BW never
                // holds three.
                w.retain_versions(&mut st, next_fwd[i + 1].map(|j| w.spec.update.version_for(j, m64)))?;
                deferred = w.step_op(&mut st, t, ctx, tr, events, rec)?;
            }
        }
        w.retain_versions(&mut st, next_fwd[i + 1].map(|j| w.spec.update.version_for(j, m64)))?;
    }
    if let Some(d) = deferred.take() {
        w.finish_step(&mut st, d, ctx, tr, events, rec)?;
    }
    if let Some(s) = stop_before {
        w.checkpoint_at_stop(&mut st, s - 1, ctx, events)?;
    }
    let (_, last) = st.versions.into_iter().next_back().ok_or_else(|| E::Msg("no weights".into()))?;
    let weights = w.param_names.iter().cloned().zip(last).collect();
    let host_reads = crate::exec::host_reads() - reads_before;
    Ok(StageOut { weights, buffers: w.buffers(), peak_versions: st.peak_versions, memory: st.memory, trace: std::mem::take(&mut rec.events), host_reads, off_device: w.off_device() })
}

pub(super) struct Worker {
    spec: StageSpec,
    mode: Mode,
    last_use: Vec<Option<usize>>,
    /// The declared types of the program's instructions.
    signatures: Signatures,
    /// Non-trainable stored tensors (running statistics are replaced as training updates them).
    constants: Vec<(SlotId, Tensor)>,
    /// Constants held on the host at load, because a step may need no device copy of them
    /// ([`specialise::may_stay_on_host`]): the specialisation uploads those it needs.
    kept_on_host: Vec<SlotId>,
    constant_bytes: u64,
    param_slots: Vec<SlotId>,
    param_names: Vec<String>,
    /// Per weight: the stages sharing it when tied (empty otherwise).
    param_sync: Vec<Vec<u32>>,
    tied_groups: Vec<(Vec<u32>, Vec<usize>)>,
    /// BatchNormalization instructions whose running mean and variance are stored
    /// constants: `(instruction, mean index, variance index)` into `constants`.
    bn_stats: Vec<(usize, usize, usize)>,
    /// The distinct constants in `bn_stats` (mean, variance per node, in node order).
    stat_consts: Vec<usize>,
    /// Selective recomputation's pieces (empty otherwise).
    pieces: Vec<Piece>,
    /// The element type kernels compute in (fp32 unless mixed precision).
    compute: Kind,
    /// fp16's loss scale, the same in every stage (see [`super::precision`]).
    scaler: Option<LossScaler>,
    /// The program specialised for the batch size of the forwards so far (made by the
    /// first forward, remade if the batch size changes).
    special: Option<Specialised>,
    /// This stage computes each backward in two halves
    /// ([`pipewright_core::Schedule::splits_stage_backward`]): forwards record their
    /// weight reads apart.
    split_backward: bool,
    /// A split stage with tied weights under a synchronous update: their reads' weight
    /// gradients come with the input gradient, so they are complete at the batch's last
    /// input gradient, and their sum over the tied stages begins there, while the weight
    /// gradients still run. Otherwise the stage before, waiting in the step for that sum,
    /// would wait for this stage's last weight gradient, and this stage's deferred weight
    /// gradients could not fill the time the stage before takes to update and run the next
    /// batch's first forward.
    early_tied: bool,
}

impl Worker {
    /// Reads the stored tensors: constants stay in the worker, trainable ones are returned
    /// as weight version 0.
    pub(super) fn load(spec: StageSpec, cfg: &TrainConfig) -> Result<(Worker, Vec<Tensor>), E> {
        let p = &spec.program;
        let (mut constants, mut params, mut param_slots, mut param_sync) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut kept_on_host = Vec::new();
        // BatchNormalization nodes with their running mean and variance slots.
        let bn_nodes: Vec<(usize, Option<SlotId>, Option<SlotId>)> = p
            .instrs
            .iter()
            .enumerate()
            .filter(|(_, ins)| matches!(ins.op, pipewright_ops::Op::BatchNormalization(_)))
            .map(|(i, ins)| (i, ins.inputs.get(3).copied().flatten(), ins.inputs.get(4).copied().flatten()))
            .collect();
        // The running statistics stay fp32 under mixed precision (the node runs in fp32),
        // so they are kept and saved at full precision.
        let is_running_stat = |s: SlotId| bn_nodes.iter().any(|&(_, m, v)| m == Some(s) || v == Some(s));
        for s in &p.stored {
            let name = &p.slots[s.slot.index()].name;
            let t = tensor_from_bytes(s.elem, &s.dims, &s.bytes).map_err(|e| E::Msg(format!("stored tensor {name:?}: {e}")))?;
            if s.trainable {
                params.push(t.f_to_device(cfg.device).map_err(torch("moving weights"))?);
                param_slots.push(s.slot);
                param_sync.push(s.sync.clone());
            } else {
                // Non-trainable float tensors (biases folded as constants, running
                // statistics) compute in the compute type like everything else.
                let cast = cfg.precision.is_mixed() && matches!(t.kind(), Kind::Float | Kind::Double) && !is_running_stat(s.slot);
                let t = if cast { t.f_to_kind(compute_kind(cfg.precision)).map_err(torch("casting constants"))? } else { t };
                if t.numel() as i64 <= specialise::HOST_LIMIT && !is_running_stat(s.slot) && specialise::may_stay_on_host(p, s.slot) {
                    kept_on_host.push(s.slot);
                    constants.push((s.slot, t));
                } else {
                    constants.push((s.slot, t.f_to_device(cfg.device).map_err(torch("moving constants"))?));
                }
            }
        }
        let param_names: Vec<String> = param_slots.iter().map(|s| p.slots[s.index()].name.clone()).collect();
        let tied_groups = tied_groups(&param_sync, &param_names, spec.index as u32);
        let const_index = |s: Option<SlotId>| s.and_then(|s| constants.iter().position(|(c, _)| *c == s));
        let bn_stats = bn_nodes.iter().filter_map(|&(i, mean, var)| Some((i, const_index(mean)?, const_index(var)?))).collect();
        let mut stat_consts: Vec<usize> = Vec::new();
        for &(_, mean, var) in &bn_stats {
            for i in [mean, var] {
                if !stat_consts.contains(&i) {
                    stat_consts.push(i);
                }
            }
        }
        let constant_bytes = constants.iter().filter(|(s, _)| !kept_on_host.contains(s)).map(|(_, t)| bytes_of(t)).sum();
        if spec.recompute_selective && cfg.schedule.splits_backward() {
            return Err(E::Msg(format!("the {} schedule splits each backward in two, which selective recomputation does not: compile with --recompute none or full", cfg.schedule)));
        }
        let pieces = if spec.recompute_selective { pieces(p, &param_slots) } else { Vec::new() };
        let split_backward = cfg.schedule.splits_stage_backward(spec.index);
        let early_tied = cfg.schedule.sums_tied_early(spec.index) && !tied_groups.is_empty();
        let w = Worker {
            pieces,
            last_use: p.last_uses(),
            signatures: Signatures::of(p),
            mode: cfg.mode,
            constants,
            kept_on_host,
            param_slots,
            param_names,
            param_sync,
            tied_groups,
            bn_stats,
            stat_consts,
            constant_bytes,
            spec,
            compute: compute_kind(cfg.precision),
            scaler: (cfg.precision == Precision::Fp16).then(|| cfg.loss_scale.clone()),
            special: None,
            split_backward,
            early_tied,
        };
        Ok((w, params))
    }

    /// Known values the specialisation left off the device (none before the first step).
    fn off_device(&self) -> (usize, u64) {
        self.special.as_ref().map_or((0, 0), |sp| sp.off_device)
    }

    /// Installs a checkpoint's weights, shadow version, optimizer state and statistics.
    fn restore(&mut self, st: &mut State, params: Vec<Tensor>, saved: StageState, ctx: &Ctx<'_>) -> Result<(), E> {
        let bad = |m: String| E::Msg(format!("resuming: {m}"));
        let newest = self.match_weights(&params, &saved.newest).map_err(bad)?;
        st.versions.insert(ctx.start_step, newest);
        if self.spec.update == UpdateRule::TwoBw && ctx.start_step > 0 {
            if saved.shadow.is_empty() && !params.is_empty() {
                return Err(bad("a 2BW checkpoint needs the shadow weight version, and this one has none".into()));
            }
            let shadow = self.match_weights(&params, &saved.shadow).map_err(bad)?;
            st.versions.insert(ctx.start_step - 1, shadow);
        }
        st.opt.restore(saved.opt_steps, &self.param_names, &params, &saved.opt_m, &saved.opt_v).map_err(bad)?;
        // fp16 continues from the saved scale (a fresh 2^16 would change every later step);
        // a checkpoint without one (written in another precision, resumed with --force)
        // keeps the configured start.
        if let (Some(scaler), Some(saved_scale)) = (self.scaler.as_mut(), saved.loss_scale) {
            *scaler = saved_scale;
        }
        st.skips_in_a_row = saved.skips_in_a_row;
        let p = &self.spec.program;
        for (name, t) in saved.buffers {
            let i = self.constants.iter().position(|(s, _)| p.slots[s.index()].name == name).ok_or_else(|| bad(format!("buf/{name}: no such tensor in this stage")))?;
            let cur = &self.constants[i].1;
            if t.size() != cur.size() {
                return Err(bad(format!("buf/{name}: shape {:?}, the stage has {:?}", t.size(), cur.size())));
            }
            self.constants[i].1 = t.to_kind(cur.kind()).to_device(cur.device());
        }
        Ok(())
    }

    /// `saved` in this stage's weight order, checked against the module's weights.
    fn match_weights(&self, params: &[Tensor], saved: &[(String, Tensor)]) -> Result<Vec<Tensor>, String> {
        if saved.len() != params.len() {
            return Err(format!("the checkpoint has {} weights for this stage, the module {}", saved.len(), params.len()));
        }
        self.param_names
            .iter()
            .zip(params)
            .map(|(name, p)| {
                let (_, t) = saved.iter().find(|(n, _)| n == name).ok_or_else(|| format!("weight {name:?} is missing"))?;
                if t.size() != p.size() || t.kind() != p.kind() {
                    return Err(format!("weight {name:?}: {:?} {:?} in the checkpoint, {:?} {:?} in the module", t.kind(), t.size(), p.kind(), p.size()));
                }
                Ok(t.to_device(p.device()))
            })
            .collect()
    }

    /// The weights of version `v` to compute with: the masters, or under mixed precision
    /// their compute-type copy (made once per version).
    fn weights_of<'s>(&self, st: &'s mut State, v: u64) -> Option<&'s [Tensor]> {
        let masters = st.versions.get(&v)?;
        if self.compute == Kind::Float {
            return Some(masters);
        }
        Some(st.cast.entry(v).or_insert_with(|| masters.iter().map(|t| self.cast(t)).collect()))
    }

    /// Keeps the newest version, the one the next forward uses and those in flight; errs
    /// when that is more than the module's version budget.
    fn retain_versions(&self, st: &mut State, next_v: Option<u64>) -> Result<(), E> {
        let Some(&newest) = st.versions.keys().next_back() else { return Ok(()) };
        let stash = &st.stash;
        st.versions.retain(|v, _| *v == newest || Some(*v) == next_v || stash.iter().any(|s| s.version == *v));
        let versions = &st.versions;
        st.cast.retain(|v, _| versions.contains_key(v));
        st.peak_versions = st.peak_versions.max(st.versions.len());
        if st.versions.len() > self.spec.version_budget {
            return Err(E::Msg(format!(
                "holds {} weight versions, more than the {} its module allows (update rule {})",
                st.versions.len(),
                self.spec.version_budget,
                self.spec.update
            )));
        }
        Ok(())
    }

    fn observe(&self, st: &mut State, extra_grads: u64, extra_act: u64) {
        let weights = st.versions.values().chain(st.cast.values()).flatten().map(bytes_of).sum();
        let gradients = st.acc.iter().flatten().map(bytes_of).sum::<u64>() + st.tied.bytes() + st.deferred_gradients + extra_grads;
        let activations = st.stash.iter().map(|s| s.bytes).chain(st.awaiting.iter().map(|a| a.bytes)).sum::<u64>() + extra_act;
        st.memory.keep_peak(StageMemory {
            total: 0,
            weights,
            gradients,
            optimizer: st.opt.bytes(),
            activations,
            constants: self.constant_bytes + self.special.as_ref().map_or(0, |sp| sp.uploaded_bytes),
            versions: st.versions.len(),
            in_flight: st.stash.len() + st.awaiting.len() + usize::from(extra_act > 0),
        });
    }

    /// Microbatch `j`'s forward; `false` when the run stops before it instead (`j` then
    /// begins a step, and the stop has been passed on).
    fn forward_op(&mut self, st: &mut State, j: u64, ctx: &Ctx<'_>, data: Option<&Receiver<StageData>>, tr: &mut dyn Transport, rec: &mut Recorder) -> Result<bool, E> {
        let (cfg, m64) = (ctx.cfg, ctx.m as u64);
        let v = self.spec.update.version_for(j, m64);
        let step = j / m64;
        let first_of_step = j.is_multiple_of(m64);
        if first_of_step && self.spec.n_recv == 0 && ctx.stops_before(step, tr)? {
            self.pass_stop(j, step, ctx, tr)?;
            return Ok(false);
        }
        let mut inputs = Vec::new();
        if self.spec.n_recv > 0 {
            let t0 = rec.start();
            let Some(got) = tr.recv_forward(j).map_err(induced)? else {
                if !first_of_step {
                    return Err(E::Msg(format!("a stop marker arrived in place of microbatch {j}, which does not begin a step")));
                }
                self.pass_stop(j, step, ctx, tr)?;
                return Ok(false);
            };
            for (_, t) in got {
                // The previous stage may compute on another device.
                inputs.push(t.f_to_device(cfg.device).map_err(torch("moving received activations"))?);
            }
            rec.record(TraceKind::Recv, t0, Some(j), v, step);
        }
        let mut labels = None;
        if let Some(rx) = data {
            let sd = rx.recv().map_err(|_| E::Induced("the data feed stopped".into()))?;
            if sd.mb != j {
                return Err(E::Msg(format!("data for microbatch {} arrived when {j} was expected", sd.mb)));
            }
            for x in sd.inputs {
                let x = x.f_to_device(cfg.device).map_err(torch("moving inputs"))?;
                let x = if matches!(x.kind(), Kind::Float | Kind::Double) && self.compute != Kind::Float { x.f_to_kind(self.compute).map_err(torch("casting inputs"))? } else { x };
                inputs.push(x);
            }
            labels = sd.labels.map(|l| l.to_device(cfg.device));
            st.batch_samples += sd.samples;
        }
        let grad = !self.spec.recompute_full;
        self.specialise_for(&inputs, cfg.device)?;
        let t0 = rec.start();
        let wts = self.weights_of(st, v).ok_or_else(|| E::Msg(format!("weight version {v} for microbatch {j} is gone")))?;
        let (fwd, stats) = self.forward(wts, &inputs, labels.as_ref(), grad, true)?;
        // Reading the loss synchronizes with the device, so it counts as forward.
        let loss_value = match &fwd.loss {
            Some(l) => Some(l.f_double_value(&[]).map_err(torch("reading the loss"))?),
            None => None,
        };
        rec.record(TraceKind::Forward, t0, Some(j), v, step);
        self.apply_stats(stats);
        // A checkpoint records the statistics as of its batch's last forward.
        if cfg.checkpoint_every.is_some() && (j + 1) % m64 == 0 {
            st.stats_at_batch_end.insert(step, self.bn_stat_tensors());
        }
        if self.spec.n_send > 0 {
            let t0 = rec.start();
            let sent = fwd.outputs[..self.spec.n_send].iter().zip(self.output_names()).map(|(t, n)| (n, t.detach())).collect();
            tr.send_forward(j, sent).map_err(induced)?;
            rec.record(TraceKind::Send, t0, Some(j), v, step);
        }
        if let Some(value) = loss_value {
            if !value.is_finite() {
                // Skipping: the step's update is dropped everywhere at its optimizer step
                // (where every stage learns of it), so the backward still runs.
                if cfg.on_nonfinite != NonFinite::Skip {
                    let (counted, stage) = (step as usize + 1, self.spec.index);
                    // The run's first step computes with the weights it started from: no
                    // update can have made the loss non-finite.
                    let error = if step == ctx.start_step {
                        PipelineError::NonFiniteFirstLoss { step: counted, stage, value }
                    } else {
                        PipelineError::NonFiniteLoss { step: counted, stage, value }
                    };
                    return Err(E::Err(error));
                }
                st.batch_nonfinite = true;
            }
            st.batch_loss += value;
        }
        let bytes = inputs.iter().chain(labels.iter()).map(bytes_of).sum::<u64>() + if grad { fwd.act_bytes } else { 0 };
        st.stash.push_back(Stash { mb: j, version: v, inputs, labels, fwd: grad.then_some(fwd), bytes });
        self.observe(st, 0, 0);
        Ok(true)
    }

    /// The run stops before step `step` (whose first microbatch is `j`): tells the next
    /// stage and the caller.
    fn pass_stop(&self, j: u64, step: u64, ctx: &Ctx<'_>, tr: &mut dyn Transport) -> Result<(), E> {
        if self.spec.n_send > 0 {
            tr.send_stop(j).map_err(induced)?;
        }
        if let Some(gate) = &ctx.cfg.stop {
            gate.stopped_before(step);
        }
        Ok(())
    }

    fn backward_op(&mut self, st: &mut State, j: u64, ctx: &Ctx<'_>, tr: &mut dyn Transport, rec: &mut Recorder) -> Result<(), E> {
        let (v, step, bytes, fwd) = self.take_forward(st, j, ctx, rec)?;
        self.observe(st, 0, bytes);
        let out_grads = self.receive_output_grads(j, v, step, tr, rec)?;
        let t0 = rec.start();
        let (pg, ig) = if fwd.pieces.is_some() { self.backward_pieces(fwd, out_grads)? } else { self.backward(&fwd, out_grads)? };
        self.accumulate(st, v, j, pg)?;
        rec.record(TraceKind::Backward, t0, Some(j), v, step);
        self.send_input_grads(j, v, step, ig, tr, rec)
    }

    /// Microbatch `j`'s input gradient alone (a schedule that splits the backward): sent
    /// upstream now; its forward's graph and the gradients of its weight reads' outputs
    /// wait for [`Worker::backward_weight_op`]. A stage that does not split its backward
    /// ([`pipewright_core::Schedule::splits_stage_backward`]) only takes the output gradients here, for
    /// the weight-gradient op's whole backward.
    fn backward_input_op(&mut self, st: &mut State, j: u64, ctx: &Ctx<'_>, tr: &mut dyn Transport, rec: &mut Recorder) -> Result<(), E> {
        let (version, step, bytes, fwd) = self.take_forward(st, j, ctx, rec)?;
        self.observe(st, 0, bytes);
        let out_grads = self.receive_output_grads(j, version, step, tr, rec)?;
        let t0 = rec.start();
        if !self.split_backward {
            rec.record(TraceKind::Backward, t0, Some(j), version, step);
            st.awaiting.push_back(AwaitingWeights { mb: j, version, fwd, half: WeightHalf::Whole(out_grads), bytes });
            return Ok(());
        }
        let (ig, mut grads) = self.backward_input(&fwd, out_grads)?;
        let fwd = fwd.weight_half();
        let bytes = fwd.awaiting_bytes(bytes, &grads);
        if self.early_tied {
            let (tied, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut grads.weights).into_iter().partition(|(w, _)| self.is_tied(*w));
            grads.weights = rest;
            self.accumulate_tied(st, version, tied)?;
        }
        rec.record(TraceKind::Backward, t0, Some(j), version, step);
        st.awaiting.push_back(AwaitingWeights { mb: j, version, fwd, half: WeightHalf::Split(grads), bytes });
        // What it holds until its weight gradient, which may be more than before (the
        // graph kept with the output gradients) or less (the graph freed).
        self.observe(st, 0, 0);
        self.send_input_grads(j, version, step, ig, tr, rec)?;
        // Input gradients run in microbatch order: this batch's tied gradients are complete.
        if self.early_tied && (j + 1).is_multiple_of((ctx.m as u64).max(1)) {
            self.begin_tied_sums(st, tr)?;
        }
        Ok(())
    }

    fn is_tied(&self, w: usize) -> bool {
        self.tied_groups.iter().any(|(_, idx)| idx.contains(&w))
    }

    /// Adds one microbatch's tied-weight gradients to the batch's (in the master type,
    /// in microbatch order, as [`Worker::accumulate`] adds the others). A weight read more
    /// than once gets its reads' gradients summed first, in read order, as the
    /// weight-gradient half sums them, so the batch's sum rounds as it did there.
    fn accumulate_tied(&self, st: &mut State, v: u64, tied: Vec<(usize, Tensor)>) -> Result<(), E> {
        let mut per_weight: Vec<(usize, Tensor)> = Vec::new();
        for (w, g) in tied {
            match per_weight.iter_mut().find(|(x, _)| *x == w) {
                Some((_, sum)) => *sum = sum.f_add(&g).map_err(torch("weight gradient"))?,
                None => per_weight.push((w, g)),
            }
        }
        for (w, g) in per_weight {
            let master = st.versions.get(&v).and_then(|ws| ws.get(w)).ok_or_else(|| E::Msg(format!("weight version {v} for its tied gradient is gone")))?;
            let g = if g.kind() != master.kind() { g.f_to_kind(master.kind()).map_err(torch("casting gradients"))? } else { g };
            match st.tied.acc.get_mut(&w) {
                Some(sum) => {
                    tch::no_grad(|| sum.f_add_(&g)).map(|_| ()).map_err(torch("accumulating gradients"))?;
                }
                None => {
                    st.tied.acc.insert(w, g);
                }
            }
        }
        Ok(())
    }

    /// Tied group `gi`'s part of the sum: this batch's gradients of its weights (zeros
    /// for one no microbatch read), taken from [`EarlyTied`].
    fn early_tied_part(&self, st: &mut State, gi: usize) -> Result<Vec<Tensor>, E> {
        let newest = st.versions.values().next_back().ok_or_else(|| E::Msg("no weights".into()))?;
        let mut part = Vec::with_capacity(self.tied_groups[gi].1.len());
        for &i in &self.tied_groups[gi].1 {
            part.push(match st.tied.acc.remove(&i) {
                Some(g) => g,
                None => newest.get(i).ok_or_else(|| E::Msg(format!("no weight {i}")))?.zeros_like(),
            });
        }
        Ok(part)
    }

    /// Begins each tied group's sum where the transport sums in the background (one that
    /// waits for the other stages would hold this one's weight gradients back until the
    /// stage before reaches its step; those groups are summed there).
    fn begin_tied_sums(&self, st: &mut State, tr: &mut dyn Transport) -> Result<(), E> {
        for (gi, (stages, _)) in self.tied_groups.iter().enumerate() {
            let group = SumGroup::Tied(stages.clone());
            if !tr.sums_in_background(&group) {
                continue;
            }
            let part = self.early_tied_part(st, gi)?;
            st.tied.begun_bytes += part.iter().map(bytes_of).sum::<u64>();
            let begun = tr.begin_sum(&group, part).map_err(induced)?;
            st.tied.begun.push((gi, begun));
        }
        Ok(())
    }

    /// Microbatch `j`'s weight gradient, from what its input gradient kept: added to the
    /// batch's.
    fn backward_weight_op(&mut self, st: &mut State, j: u64, ctx: &Ctx<'_>, rec: &mut Recorder) -> Result<(), E> {
        let a = st.awaiting.pop_front().ok_or_else(|| E::Msg(format!("weight gradient of microbatch {j} before its input gradient")))?;
        if a.mb != j {
            return Err(E::Msg(format!("weight gradient of microbatch {j}, but {} is the oldest waiting", a.mb)));
        }
        let t0 = rec.start();
        let pg = match a.half {
            WeightHalf::Split(grads) => self.backward_weight(&a.fwd, grads)?,
            // Nothing upstream takes an input gradient (the first stage).
            WeightHalf::Whole(out_grads) => self.backward(&a.fwd, out_grads)?.0,
        };
        self.accumulate(st, a.version, j, pg)?;
        let step = j / (ctx.m as u64).max(1);
        rec.record(TraceKind::BackwardWeight, t0, Some(j), a.version, step);
        Ok(())
    }

    /// Microbatch `j`'s forward state, the oldest stashed (recomputed under full
    /// recomputation), with its version, step and the live bytes it holds.
    fn take_forward(&mut self, st: &mut State, j: u64, ctx: &Ctx<'_>, rec: &mut Recorder) -> Result<(u64, u64, u64, Fwd), E> {
        let m64 = ctx.m as u64;
        let s = st.stash.pop_front().ok_or_else(|| E::Msg(format!("backward of microbatch {j} without its forward")))?;
        if s.mb != j {
            return Err(E::Msg(format!("backward of microbatch {j}, but {} is the oldest stashed", s.mb)));
        }
        let (v, step) = (s.version, j / m64);
        let fwd = match s.fwd {
            Some(f) => f,
            None => {
                let t0 = rec.start();
                let wts = self.weights_of(st, s.version).ok_or_else(|| E::Msg(format!("weight version {} for microbatch {j} is gone", s.version)))?;
                // Statistics were updated by the first forward; the rerun leaves them.
                let (f, _) = self.forward(wts, &s.inputs, s.labels.as_ref(), true, false)?;
                rec.record(TraceKind::Recompute, t0, Some(j), v, step);
                f
            }
        };
        let bytes = s.bytes + if self.spec.recompute_full { fwd.act_bytes } else { 0 };
        Ok((v, step, bytes, fwd))
    }

    /// The gradients of this stage's outputs for microbatch `j` from the next stage (none
    /// on the last).
    fn receive_output_grads(&self, j: u64, v: u64, step: u64, tr: &mut dyn Transport, rec: &mut Recorder) -> Result<Option<super::Named>, E> {
        if self.spec.n_send == 0 {
            return Ok(None);
        }
        let t0 = rec.start();
        let g = tr.recv_backward(j).map_err(induced)?;
        rec.record(TraceKind::Recv, t0, Some(j), v, step);
        Ok(Some(g))
    }

    /// Adds microbatch `j`'s weight gradients (of version `v`) to the batch's.
    fn accumulate(&self, st: &mut State, v: u64, j: u64, pg: Vec<Tensor>) -> Result<(), E> {
        // Gradients of the cast weights come back to the master weights' type (fp32).
        let pg = if self.compute != Kind::Float {
            let masters = st.versions.get(&v).ok_or_else(|| E::Msg(format!("weight version {v} for microbatch {j} is gone")))?;
            pg.into_iter().zip(masters).map(|(g, w)| if g.kind() != w.kind() { g.f_to_kind(w.kind()) } else { Ok(g) }).collect::<Result<Vec<_>, _>>().map_err(torch("casting gradients"))?
        } else {
            pg
        };
        st.acc = Some(match st.acc.take() {
            None => pg,
            // The accumulator is this worker's own: add in place, no new allocation.
            Some(mut a) => {
                super::optim::accumulate(&mut a, &pg).map_err(torch("accumulating gradients"))?;
                a
            }
        });
        Ok(())
    }

    /// Sends microbatch `j`'s input gradients upstream (not from the first stage).
    fn send_input_grads(&self, j: u64, v: u64, step: u64, ig: Vec<Tensor>, tr: &mut dyn Transport, rec: &mut Recorder) -> Result<(), E> {
        if self.spec.n_recv > 0 {
            let t0 = rec.start();
            tr.send_backward(j, self.input_names().into_iter().zip(ig).collect()).map_err(induced)?;
            rec.record(TraceKind::Send, t0, Some(j), v, step);
        }
        Ok(())
    }

    /// Step `t`'s update from the gradients accumulated over its microbatches: summed
    /// over tied stages, then over replicas, then applied. Under 2BW, where the transport
    /// can leave the sums in the background, the update waits for them
    /// ([`Worker::finish_step`]) and `Some` says so: its version is first used by the
    /// forwards of step `t + 2`, so step `t + 1` computes meanwhile.
    fn step_op(&mut self, st: &mut State, t: u64, ctx: &Ctx<'_>, tr: &mut dyn Transport, events: &Sender<Event>, rec: &mut Recorder) -> Result<Option<Deferred>, E> {
        let t0 = rec.start();
        let grads = st.acc.take().ok_or_else(|| E::Msg(format!("step {t} without gradients")))?;
        let grad_bytes = grads.iter().map(bytes_of).sum();
        // What the step's microbatches saw, taken now: the next step's begin to add up
        // while this update waits.
        let batch = Batch { loss: std::mem::take(&mut st.batch_loss), samples: std::mem::take(&mut st.batch_samples), nonfinite: std::mem::take(&mut st.batch_nonfinite) };
        let here: Vec<tch::Device> = grads.iter().map(|g| g.device()).collect();
        let replicas = if ctx.replicas == 1 { ReplicaSum::Done } else { ReplicaSum::NotBegun };
        // fp16's loss scale is agreed at each update and scales the next batch's
        // backwards: it must change between batches, so those updates never wait.
        let twobw = self.spec.update == UpdateRule::TwoBw && self.scaler.is_none();
        let agree_after = (twobw && self.needs_agreement(ctx)).then(|| (t + 2) * ctx.m as u64 - 1);
        let me = self.spec.index as u32;
        let tied_to_an_earlier_stage = self.tied_groups.iter().any(|(stages, _)| stages.first() != Some(&me));
        let background = agree_after.is_some() || (twobw && self.spec.update.defers_update(ctx.replicas, tied_to_an_earlier_stage));
        let mut d = Deferred { t, t0, here, batch, grads, tied: Vec::new(), replicas, agree_after };
        let mut begun = std::mem::take(&mut st.tied.begun);
        st.tied.begun_bytes = 0;
        for (gi, (stages, idx)) in self.tied_groups.iter().enumerate() {
            if let Some(at) = begun.iter().position(|(g, _)| *g == gi) {
                let summed = match begun.swap_remove(at).1 {
                    Some(sum) => sum,
                    None => tr.finish_sum(&SumGroup::Tied(stages.clone())).map_err(induced)?,
                };
                self.place_tied(&mut d.grads, gi, summed)?;
                continue;
            }
            let part: Vec<Tensor> = if self.early_tied { self.early_tied_part(st, gi)? } else { idx.iter().map(|&i| d.grads[i].shallow_clone()).collect() };
            let begun = if background { tr.begin_sum(&SumGroup::Tied(stages.clone()), part) } else { tr.all_reduce_tied(stages, part).map(Some) };
            match begun.map_err(induced)? {
                Some(summed) => self.place_tied(&mut d.grads, gi, summed)?,
                None => d.tied.push(gi),
            }
        }
        // The replicas add the tied sums: they begin once those are in.
        if d.tied.is_empty() {
            self.sum_replicas(&mut d, background, ctx, tr)?;
        }
        if !background {
            self.apply(st, d, ctx, tr, events, rec)?;
            return Ok(None);
        }
        st.deferred_gradients = grad_bytes;
        Ok(Some(d))
    }

    /// Whether an update needs an answer every stage agrees on: `--on-nonfinite skip`,
    /// `--clip-norm`'s global norm. Under 2BW every stage then makes its update at the
    /// same point of its order, after its last forward of the next step, whether or not
    /// its sums are done sooner: stages deferring by how their sums arrive would reach the
    /// agreement at different points, and one waiting in it before forwarding what a later
    /// stage needs to reach it would never be joined. Every stage reaches that point once
    /// the stage before it has forwarded the step, which it does before its own.
    fn needs_agreement(&self, ctx: &Ctx<'_>) -> bool {
        ctx.cfg.on_nonfinite == NonFinite::Skip || ctx.cfg.clip_norm.is_some()
    }

    /// Completes step `d.t`'s update once the sums [`Worker::step_op`] left in the
    /// background are in (the replicas' sum begun now if it waited for the tied ones).
    fn finish_step(&mut self, st: &mut State, mut d: Deferred, ctx: &Ctx<'_>, tr: &mut dyn Transport, events: &Sender<Event>, rec: &mut Recorder) -> Result<(), E> {
        // Counted by `apply` as the gradients of the update in progress from here.
        st.deferred_gradients = 0;
        self.finish_tied(&mut d, tr)?;
        if d.replicas == ReplicaSum::NotBegun {
            self.sum_replicas(&mut d, false, ctx, tr)?;
        }
        if d.replicas == ReplicaSum::InFlight {
            let sum = tr.finish_sum(&SumGroup::Replicas).map_err(induced)?;
            d.grads = replica_mean(sum, &d.here, ctx.replicas)?;
            d.replicas = ReplicaSum::Done;
        }
        self.apply(st, d, ctx, tr, events, rec)
    }

    /// Between ops: once a step's tied sums are in, begins its replicas' sum (which adds
    /// them) in the background, so that it is not left to begin when the update is due.
    fn advance(&self, d: &mut Deferred, ctx: &Ctx<'_>, tr: &mut dyn Transport) -> Result<(), E> {
        if d.tied.is_empty() || !d.tied.iter().all(|&gi| tr.sum_done(&SumGroup::Tied(self.tied_groups[gi].0.clone()))) {
            return Ok(());
        }
        self.finish_tied(d, tr)?;
        self.sum_replicas(d, true, ctx, tr)
    }

    /// Waits for the tied sums of `d` still in flight and puts them in place.
    fn finish_tied(&self, d: &mut Deferred, tr: &mut dyn Transport) -> Result<(), E> {
        for gi in std::mem::take(&mut d.tied) {
            let summed = tr.finish_sum(&SumGroup::Tied(self.tied_groups[gi].0.clone())).map_err(induced)?;
            self.place_tied(&mut d.grads, gi, summed)?;
        }
        Ok(())
    }

    /// Sums `d`'s gradients over the replicas, or with `background` begins to.
    fn sum_replicas(&self, d: &mut Deferred, background: bool, ctx: &Ctx<'_>, tr: &mut dyn Transport) -> Result<(), E> {
        if d.replicas != ReplicaSum::NotBegun {
            return Ok(());
        }
        let grads = std::mem::take(&mut d.grads);
        let begun = if background { tr.begin_sum(&SumGroup::Replicas, grads) } else { tr.all_reduce_replicas(grads).map(Some) };
        match begun.map_err(induced)? {
            Some(sum) => {
                d.grads = replica_mean(sum, &d.here, ctx.replicas)?;
                d.replicas = ReplicaSum::Done;
            }
            None => d.replicas = ReplicaSum::InFlight,
        }
        Ok(())
    }

    /// Puts tied group `gi`'s summed gradients in place of this stage's copies.
    fn place_tied(&self, grads: &mut [Tensor], gi: usize, summed: Vec<Tensor>) -> Result<(), E> {
        for (&i, g) in self.tied_groups[gi].1.iter().zip(summed) {
            grads[i] = g.f_to_device(grads[i].device()).map_err(torch("moving tied gradients"))?;
        }
        Ok(())
    }

    fn apply(&mut self, st: &mut State, d: Deferred, ctx: &Ctx<'_>, tr: &mut dyn Transport, events: &Sender<Event>, rec: &mut Recorder) -> Result<(), E> {
        self.update(st, d.t, d.grads, d.batch, d.t0, ctx, tr, events, rec)
    }

    /// Applies step `t`'s summed gradients (the sums began at `t0`; `batch`: what its
    /// microbatches saw): the mean over the microbatches, overflow and clipping, the
    /// optimizer, the step's events.
    #[allow(clippy::too_many_arguments)]
    fn update(&mut self, st: &mut State, t: u64, grads: Vec<Tensor>, batch: Batch, t0: Option<std::time::Instant>, ctx: &Ctx<'_>, tr: &mut dyn Transport, events: &Sender<Event>, rec: &mut Recorder) -> Result<(), E> {
        let (cfg, m) = (ctx.cfg, ctx.m);
        // The sums over tied stages and replicas (with the wait for the others) are traced
        // apart from the update, so that a trace shows the one and the other; the mean over
        // the microbatches is the update's work, not the sums'.
        let t0 = if !self.tied_groups.is_empty() || ctx.replicas > 1 {
            rec.record(TraceKind::AllReduce, t0, None, t + 1, t);
            rec.start()
        } else {
            t0
        };
        let grads = self.mean_over_microbatches(grads, m)?;
        let skip_policy = cfg.on_nonfinite == NonFinite::Skip;
        let (grads, apply) = self.unscale(grads, batch.nonfinite, skip_policy, tr)?;
        if skip_policy {
            st.skips_in_a_row = if apply { 0 } else { st.skips_in_a_row + 1 };
            // Every stage reaches the same count (the decision is agreed), so all stop here.
            if st.skips_in_a_row >= cfg.max_skips.max(1) {
                return Err(E::Err(PipelineError::TooManySkips { step: t as usize + 1, skips: st.skips_in_a_row }));
            }
        }
        let grads = match cfg.clip_norm {
            _ if !apply => grads,
            Some(clip) => self.clip(grads, clip, ctx.replicas, tr)?,
            None => grads,
        };
        let lr = cfg.lr_schedule.at(cfg.lr, t as usize);
        let (&newest, cur) = st.versions.iter().next_back().ok_or_else(|| E::Msg("no weights".into()))?;
        if newest != t {
            return Err(E::Msg(format!("step {t} found newest weight version {newest}")));
        }
        // A skipped step (fp16 overflow, or --on-nonfinite skip) keeps the weights and the
        // optimizer state as they were (the new version is the old one) in every stage
        // alike.
        let new = if apply { st.opt.step(cur, &grads, lr).map_err(torch("updating the weights"))? } else { cur.iter().map(|x| x.shallow_clone()).collect() };
        // A NaN or infinite gradient (overflow at a high rate) makes the new weights
        // non-finite while the loss of this batch still reads finite; stop here, before
        // the version is used, checkpointed or returned to be saved.
        if apply && !super::optim::all_finite(&new).map_err(torch("checking the new weights"))? {
            return Err(E::Err(PipelineError::NonFiniteWeights { step: t as usize + 1, stage: self.spec.index }));
        }
        st.versions.insert(t + 1, new);
        self.observe(st, grads.iter().map(bytes_of).sum(), 0);
        drop(grads);
        rec.record(TraceKind::Optimizer, t0, None, t + 1, t);
        if self.spec.loss.is_some() {
            let _ = events.send(Event::Step { step: t as usize, replica: ctx.replica, loss: batch.loss / m as f64, samples: batch.samples, skipped: !apply, at: std::time::Instant::now() });
        }
        // An evaluation after this step reads every stage's newest weights (replica 0's;
        // the replicas hold the same), as a snapshot: versions are never changed in place.
        if ctx.replica == 0 && cfg.eval_due(t as usize) {
            let weights = st.versions.get(&(t + 1)).map(|w| w.iter().map(Tensor::shallow_clone).collect()).unwrap_or_default();
            let _ = events.send(Event::Snapshot { step: t as usize, stage: self.spec.index, weights, stats: self.bn_stat_tensors() });
        }
        if checkpoint_due(cfg, t) && ctx.replica == 0 {
            let state = self.snapshot(st, t)?;
            let _ = events.send(Event::Checkpoint { step: t + 1, state });
        }
        // Step t's statistics stay until the next step: an early stop checkpoints them.
        st.stats_at_batch_end.retain(|b, _| *b >= t);
        Ok(())
    }

    /// At an early stop after step `t` (replica 0, with checkpoints on): the checkpoint of
    /// step `t + 1`, unless the step wrote one anyway.
    fn checkpoint_at_stop(&self, st: &mut State, t: u64, ctx: &Ctx<'_>, events: &Sender<Event>) -> Result<(), E> {
        if ctx.cfg.checkpoint_every.is_none() || checkpoint_due(ctx.cfg, t) || ctx.replica != 0 {
            return Ok(());
        }
        let state = self.snapshot(st, t)?;
        let _ = events.send(Event::Checkpoint { step: t + 1, state });
        Ok(())
    }

    /// The step's gradients divided by its `m` microbatches: in place where a gradient is
    /// this stage's own accumulator, into a new tensor where it is a tied sum, which the
    /// transport may hand to every stage of the group alike.
    fn mean_over_microbatches(&self, mut grads: Vec<Tensor>, m: usize) -> Result<Vec<Tensor>, E> {
        if m <= 1 {
            return Ok(grads);
        }
        let mut tied = vec![false; grads.len()];
        self.tied_groups.iter().flat_map(|(_, idx)| idx).for_each(|&i| tied[i] = true);
        let m = m as f64;
        tch::no_grad(|| {
            grads.iter_mut().zip(tied).try_for_each(|(g, shared)| {
                if shared {
                    *g = g.f_div_scalar(m)?;
                    Ok(())
                } else {
                    g.f_div_scalar_(m).map(|_| ())
                }
            })
        })
        .map_err(torch("scaling gradients"))?;
        Ok(grads)
    }

    /// fp16: divides the gradients by the loss scale; fp16 or `--on-nonfinite skip`
    /// (`skip`): decides, with every other stage and replica, whether this step is applied
    /// (no worker's gradients, nor the loss (`nonfinite_loss`), were non-finite), updating
    /// fp16's scale the same way everywhere. Otherwise every step is applied (a non-finite
    /// update then stops training).
    fn unscale(&mut self, grads: Vec<Tensor>, nonfinite_loss: bool, skip: bool, tr: &mut dyn Transport) -> Result<(Vec<Tensor>, bool), E> {
        if self.scaler.is_none() && !skip {
            return Ok((grads, true));
        }
        let grads: Vec<Tensor> = match self.scaler.as_ref() {
            Some(scaler) => {
                let inv = 1.0 / scaler.scale;
                tch::no_grad(|| grads.iter().map(|g| g * inv).collect())
            }
            None => grads,
        };
        let mut local = if nonfinite_loss { 1.0 } else { 0.0 };
        for g in &grads {
            if local != 0.0 {
                break;
            }
            let finite = g.f_isfinite().and_then(|f| f.f_all()).and_then(|a| a.f_int64_value(&[])).map_err(torch("checking gradients"))?;
            if finite == 0 {
                local = 1.0;
            }
        }
        // One agreed answer: a stage applying an update another skipped would leave the
        // stages on different weight versions.
        let overflowed = tr.all_reduce_sum(local).map_err(induced)? > 0.0;
        let apply = match self.scaler.as_mut() {
            Some(scaler) => scaler.update(overflowed),
            None => !overflowed,
        };
        Ok((grads, apply))
    }

    /// Scales `grads` so the global norm over all stages is at most `clip`. A tied weight
    /// counts once (in the first stage holding it); replicas hold equal gradients, so the
    /// sum over every worker is divided by their number.
    fn clip(&self, grads: Vec<Tensor>, clip: f64, replicas: usize, tr: &mut dyn Transport) -> Result<Vec<Tensor>, E> {
        let mut local = 0.0;
        for (g, sync) in grads.iter().zip(&self.param_sync) {
            if sync.first().is_some_and(|&first| first != self.spec.index as u32) {
                continue;
            }
            local += g.f_square().and_then(|x| x.f_sum(Kind::Double)).and_then(|x| x.f_double_value(&[])).map_err(torch("gradient norm"))?;
        }
        let norm = (tr.all_reduce_sum(local).map_err(induced)? / replicas as f64).sqrt();
        let coef = clip / (norm + 1e-6);
        Ok(if coef < 1.0 { tch::no_grad(|| grads.iter().map(|g| g * coef).collect()) } else { grads })
    }

    /// The stage's state after update `t`: newest weights, the 2BW shadow, optimizer state
    /// and the running statistics as of the end of batch `t`.
    fn snapshot(&self, st: &State, t: u64) -> Result<StageState, E> {
        let named = |ts: &[Tensor]| -> Vec<(String, Tensor)> { self.param_names.iter().cloned().zip(ts.iter().map(|x| x.shallow_clone())).collect() };
        let newest = st.versions.get(&(t + 1)).ok_or_else(|| E::Msg(format!("checkpoint after step {t}: version {} is gone", t + 1)))?;
        let shadow = match (self.spec.update, st.versions.get(&t)) {
            (UpdateRule::TwoBw, Some(s)) => named(s),
            (UpdateRule::TwoBw, None) => return Err(E::Msg(format!("checkpoint after step {t}: the shadow version {t} is gone"))),
            _ => Vec::new(),
        };
        let (opt_steps, opt_m, opt_v) = st.opt.export(&self.param_names);
        let stats = st.stats_at_batch_end.get(&t).map(|v| v.iter().map(|x| x.shallow_clone()).collect()).unwrap_or_else(|| self.bn_stat_tensors());
        let buffers = self.bn_stat_names().into_iter().zip(stats).collect();
        Ok(StageState {
            stage: self.spec.index,
            newest: named(newest),
            shadow,
            opt_steps,
            opt_m,
            opt_v,
            buffers,
            loss_scale: self.scaler.clone(),
            skips_in_a_row: st.skips_in_a_row,
        })
    }

    fn bn_stat_tensors(&self) -> Vec<Tensor> {
        self.stat_consts.iter().map(|&i| self.constants[i].1.shallow_clone()).collect()
    }

    fn bn_stat_names(&self) -> Vec<String> {
        let p = &self.spec.program;
        self.stat_consts.iter().map(|&i| p.slots[self.constants[i].0.index()].name.clone()).collect()
    }

    /// Takes `stats` ([`Worker::bn_stat_tensors`] of a worker of the same stage) as its
    /// running statistics.
    pub(super) fn set_stats(&mut self, stats: Vec<Tensor>) {
        for (&i, t) in self.stat_consts.iter().zip(stats) {
            self.constants[i].1 = t;
        }
    }

    pub(super) fn spec(&self) -> &StageSpec {
        &self.spec
    }

    fn apply_stats(&mut self, stats: Vec<(usize, Tensor)>) {
        for (i, t) in stats {
            self.constants[i].1 = t;
        }
    }

    /// Running statistics by source name, as training left them.
    fn buffers(&self) -> Vec<(String, Tensor)> {
        self.bn_stat_names().into_iter().zip(self.bn_stat_tensors()).collect()
    }
}

/// Tied weights grouped by the stage set that shares them (groups in ascending order of
/// that set, weights in each by name), so every stage of a group reduces the same tensors
/// in the same order and groups are reduced in one global order (no deadlock).
fn tied_groups(sync: &[Vec<u32>], names: &[String], stage: u32) -> Vec<(Vec<u32>, Vec<usize>)> {
    let mut groups: BTreeMap<Vec<u32>, Vec<usize>> = BTreeMap::new();
    for (i, s) in sync.iter().enumerate() {
        if s.len() > 1 && s.contains(&stage) {
            groups.entry(s.clone()).or_default().push(i);
        }
    }
    groups
        .into_iter()
        .map(|(set, mut idx)| {
            idx.sort_by(|&a, &b| names[a].cmp(&names[b]));
            (set, idx)
        })
        .collect()
}

impl Worker {
    /// Every group this worker sums gradients over: its stage's replicas (when there are
    /// several) and each set of stages sharing a tied weight.
    fn sum_groups(&self, ctx: &Ctx<'_>) -> Vec<SumGroup> {
        let replicas = (ctx.replicas > 1).then_some(SumGroup::Replicas);
        replicas.into_iter().chain(self.tied_groups.iter().map(|(stages, _)| SumGroup::Tied(stages.clone()))).collect()
    }

    pub(crate) fn output_names(&self) -> Vec<String> {
        let p = &self.spec.program;
        p.outputs.iter().map(|s| p.slots[s.index()].name.clone()).collect()
    }

    fn input_names(&self) -> Vec<String> {
        let p = &self.spec.program;
        p.inputs[..self.spec.n_recv].iter().map(|s| p.slots[s.index()].name.clone()).collect()
    }

    /// Runs the program with weights `wts`; with `grad`, received activations and weights
    /// become leaves that require gradients, otherwise nothing records a graph. With
    /// `update_stats` (and train mode) also returns the new running statistics as
    /// `(constant index, tensor)`.
    pub(super) fn forward(&self, wts: &[Tensor], inputs: &[Tensor], labels: Option<&Tensor>, grad: bool, update_stats: bool) -> Result<(Fwd, Vec<(usize, Tensor)>), E> {
        if self.spec.recompute_selective && grad {
            return self.forward_pieces(wts, inputs, labels, update_stats);
        }
        let body = || -> Result<(Fwd, Vec<(usize, Tensor)>), E> {
            let leaf = |t: &Tensor| if grad && t.is_floating_point() { t.detach().set_requires_grad(true) } else { t.detach() };
            let recv: Vec<Tensor> = inputs[..self.spec.n_recv].iter().map(leaf).collect();
            let params: Vec<Tensor> = wts.iter().map(|t| leaf(&self.cast(t))).collect();
            let mut all: Vec<Tensor> = recv.iter().map(|t| t.shallow_clone()).collect();
            all.extend(inputs[self.spec.n_recv..].iter().map(|t| t.shallow_clone()));
            let run = self.execute(&params, &all, update_stats && self.mode == Mode::Train, grad)?;
            let loss = match &self.spec.loss {
                Some((l, i)) => Some(loss_of(l, &run.outputs[*i], labels, self.spec.label_axis).map_err(|e| E::Msg(format!("loss: {e}")))?),
                None => None,
            };
            let mut reads = run.reads;
            if self.early_tied {
                for r in reads.iter_mut().filter(|r| r.aliases.iter().any(|(w, _)| self.is_tied(*w))) {
                    r.deferred = false;
                    r.direct = None;
                }
            }
            Ok((Fwd { params, recv, outputs: run.outputs, loss, act_bytes: run.act_bytes, pieces: None, reads }, run.stats))
        };
        if grad {
            body()
        } else {
            tch::no_grad(body)
        }
    }

    /// A master weight in the compute type (itself under fp32).
    fn cast(&self, t: &Tensor) -> Tensor {
        if self.compute != Kind::Float && matches!(t.kind(), Kind::Float | Kind::Double) {
            t.to_kind(self.compute)
        } else {
            t.shallow_clone()
        }
    }

    /// fp16's loss scale (1 otherwise): the loss is multiplied by it before the backward.
    fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    fn engine(&self) -> Engine<'_> {
        Engine {
            program: &self.spec.program,
            signatures: &self.signatures,
            pieces: &self.pieces,
            constants: &self.constants,
            param_slots: &self.param_slots,
            mode: self.mode,
            last_use: &self.last_use,
            bn_stats: &self.bn_stats,
            special: self.special.as_ref(),
            compute: self.compute,
        }
    }

    /// Specialises the program for the batch size of `inputs` (the program's inputs) unless
    /// it already is: the values every step would compute alike are folded once.
    pub(super) fn specialise_for(&mut self, inputs: &[Tensor], device: tch::Device) -> Result<(), E> {
        let p = &self.spec.program;
        let batch = specialise::batch_of(p, inputs);
        if self.special.as_ref().is_some_and(|sp| sp.batch == batch) {
            return Ok(());
        }
        // Running statistics change every step: never folded. Inputs that depend on the
        // batch size alone (shapes an earlier stage computed) are known from this first
        // microbatch on.
        let mut constants: Vec<(SlotId, &Tensor)> = self.constants.iter().enumerate().filter(|(i, _)| !self.stat_consts.contains(i)).map(|(_, (s, t))| (*s, t)).collect();
        constants.extend(p.inputs.iter().zip(inputs).filter(|(s, _)| p.static_inputs.contains(s)).map(|(s, t)| (*s, t)));
        let special = Specialised::new(p, &self.signatures, &constants, &self.kept_on_host, batch, device).map_err(|e| E::Msg(format!("specialising the program: {e}")))?;
        self.special = Some(special);
        Ok(())
    }

    /// The selective forward: kept pieces record graphs, recomputed pieces do not.
    fn forward_pieces(&self, wts: &[Tensor], inputs: &[Tensor], labels: Option<&Tensor>, update_stats: bool) -> Result<(Fwd, Vec<(usize, Tensor)>), E> {
        let params: Vec<Tensor> = wts.iter().map(|t| self.cast(t)).map(|t| if t.is_floating_point() { t.detach().set_requires_grad(true) } else { t.detach() }).collect();
        let (pf, stats) = self.engine().forward(&params, inputs, update_stats && self.mode == Mode::Train).map_err(E::Msg)?;
        let (loss, loss_leaf) = match &self.spec.loss {
            Some((l, i)) => {
                let leaf = pf.outputs[*i].detach().set_requires_grad(pf.outputs[*i].is_floating_point());
                let loss = loss_of(l, &leaf, labels, self.spec.label_axis).map_err(|e| E::Msg(format!("loss: {e}")))?;
                (Some(loss), Some(leaf))
            }
            None => (None, None),
        };
        let recv = inputs[..self.spec.n_recv].iter().map(|t| t.shallow_clone()).collect();
        let fwd = Fwd { params, recv, outputs: pf.outputs.iter().map(|t| t.shallow_clone()).collect(), loss, act_bytes: pf.act_bytes, pieces: None, reads: Vec::new() };
        Ok((Fwd { pieces: Some((pf, loss_leaf)), ..fwd }, stats))
    }

    fn execute(&self, params: &[Tensor], inputs: &[Tensor], collect_stats: bool, count_act: bool) -> Result<Run, E> {
        let p = &self.spec.program;
        if inputs.len() != p.inputs.len() {
            return Err(E::Msg(format!("the program takes {} inputs, {} were given", p.inputs.len(), inputs.len())));
        }
        let engine = self.engine();
        let mut slots = engine.base_slots(params);
        for (s, t) in p.inputs.iter().zip(inputs) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        // A split backward needs each weight read apart (only a recorded graph has any).
        let mut reads = Vec::new();
        let recording = (self.split_backward && count_act).then_some(&mut reads);
        let (stats, act_bytes) = engine.run_range(0..p.instrs.len(), &mut slots, true, collect_stats, count_act, recording).map_err(E::Msg)?;
        let outputs = p
            .outputs
            .iter()
            .map(|s| slots[s.index()].as_ref().map(|t| t.shallow_clone()).ok_or_else(|| E::Msg(format!("output slot {s} was never written"))))
            .collect::<Result<_, _>>()?;
        Ok(Run { outputs, act_bytes, stats, reads })
    }

    /// The selective backward: seeds from the next stage and the loss, then piece by piece.
    fn backward_pieces(&self, f: Fwd, out_grads: Option<super::Named>) -> Result<(Vec<Tensor>, Vec<Tensor>), E> {
        let p = &self.spec.program;
        let Some((pf, loss_leaf)) = f.pieces else { return Err(E::Msg("selective backward without its forward state".into())) };
        let mut seeds = Vec::new();
        if let Some(gs) = out_grads {
            if gs.len() != self.spec.n_send {
                return Err(E::Msg(format!("received {} output gradients, expected {}", gs.len(), self.spec.n_send)));
            }
            seeds.extend(p.outputs.iter().zip(gs).map(|(s, (_, g))| (*s, g)));
        }
        if let (Some(loss), Some(leaf), Some((_, i))) = (&f.loss, &loss_leaf, &self.spec.loss) {
            if leaf.requires_grad() {
                let g = Tensor::f_run_backward(&[loss.to_kind(Kind::Double) * self.loss_scale()], &[leaf], false, false).map_err(torch("loss backward"))?;
                seeds.push((p.outputs[*i], g.into_iter().next().ok_or_else(|| E::Msg("no loss gradient".into()))?));
            }
        }
        let (pg, mut ig) = self.engine().backward(pf, &f.params, seeds).map_err(E::Msg)?;
        let pg = pg.into_iter().zip(&f.params).map(|(g, t)| g.unwrap_or_else(|| t.zeros_like())).collect();
        let ig = p.inputs[..self.spec.n_recv].iter().zip(&f.recv).map(|(s, t)| ig.remove(s).unwrap_or_else(|| t.zeros_like())).collect();
        Ok((pg, ig))
    }

    /// The scalar whose gradient is the backward: the scaled loss plus each output times
    /// the gradient received for it; `None` when nothing carries a gradient.
    fn backward_root(&self, f: &Fwd, out_grads: Option<super::Named>) -> Result<Option<Tensor>, E> {
        let mut terms: Vec<Tensor> = Vec::new();
        if let Some(l) = &f.loss {
            if l.requires_grad() {
                terms.push(l.f_to_kind(Kind::Double).and_then(|l| l.f_mul_scalar(self.loss_scale())).map_err(torch("loss"))?);
            }
        }
        if let Some(gs) = out_grads {
            if gs.len() != self.spec.n_send {
                return Err(E::Msg(format!("received {} output gradients, expected {}", gs.len(), self.spec.n_send)));
            }
            for ((o, (name, g)), k) in f.outputs.iter().zip(gs).zip(0..) {
                if o.requires_grad() {
                    if g.size() != o.size() {
                        return Err(E::Msg(format!("the gradient received for output {k} ({name:?}) has shape {:?}, the output {:?}", g.size(), o.size())));
                    }
                    let term = g.f_to_device(o.device()).and_then(|g| o.f_mul(&g)).and_then(|x| x.f_sum(Kind::Double));
                    terms.push(term.map_err(torch("output gradient"))?);
                }
            }
        }
        let mut terms = terms.into_iter();
        let Some(first) = terms.next() else { return Ok(None) };
        terms.try_fold(first, |a, b| a.f_add(&b)).map(Some).map_err(torch("backward seed"))
    }

    /// Weight gradients and received-input gradients (zeros where nothing flows).
    fn backward(&self, f: &Fwd, out_grads: Option<super::Named>) -> Result<(Vec<Tensor>, Vec<Tensor>), E> {
        let root = self.backward_root(f, out_grads)?;
        let targets: Vec<&Tensor> = f.params.iter().chain(f.recv.iter().filter(|t| t.requires_grad())).collect();
        let zeros = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.zeros_like()).collect() };
        let Some(root) = root.filter(|_| !targets.is_empty()) else {
            return Ok((zeros(&f.params), zeros(&f.recv)));
        };
        let grads = Tensor::f_run_backward(&[root], &targets, false, false).map_err(torch("backward"))?;
        let mut it = grads.into_iter();
        let pg: Vec<Tensor> = f.params.iter().map(|t| defined_or_zeros(it.next(), t)).collect();
        let ig: Vec<Tensor> = f.recv.iter().map(|t| if t.requires_grad() { defined_or_zeros(it.next(), t) } else { t.zeros_like() }).collect();
        Ok((pg, ig))
    }

    /// The input-gradient half of a split backward: the received inputs' gradients, the
    /// gradient of each deferred weight read's outputs, and the weight gradients of the
    /// other reads (the graph is kept for the other half). The engine computes only what
    /// leads to those, so no product's weight gradient is formed.
    fn backward_input(&self, f: &Fwd, out_grads: Option<super::Named>) -> Result<(Vec<Tensor>, SplitGrads), E> {
        let root = self.backward_root(f, out_grads)?;
        let recv: Vec<&Tensor> = f.recv.iter().filter(|t| t.requires_grad()).collect();
        let outputs: Vec<&Tensor> = f.reads.iter().filter(|r| r.deferred).flat_map(|r| &r.outputs).collect();
        let now: Vec<&(usize, Tensor)> = f.reads.iter().filter(|r| !r.deferred).flat_map(|r| &r.aliases).collect();
        let mut grads = SplitGrads { outputs: f.reads.iter().map(|r| r.outputs.iter().map(|_| None).collect()).collect(), weights: Vec::new() };
        let Some(root) = root.filter(|_| !recv.is_empty() || !outputs.is_empty() || !now.is_empty()) else {
            return Ok((f.recv.iter().map(Tensor::zeros_like).collect(), grads));
        };
        let targets: Vec<&Tensor> = recv.iter().chain(&outputs).copied().chain(now.iter().map(|(_, a)| a)).collect();
        let keep_graph = f.weights_need_graph();
        let computed = Tensor::f_run_backward(&[root], &targets, keep_graph, false).map_err(torch("backward (input gradient)"))?;
        let mut it = computed.into_iter();
        let ig: Vec<Tensor> = f.recv.iter().map(|t| if t.requires_grad() { defined_or_zeros(it.next(), t) } else { t.zeros_like() }).collect();
        for (read, slot) in f.reads.iter().zip(&mut grads.outputs).filter(|(r, _)| r.deferred) {
            *slot = read.outputs.iter().map(|_| it.next().filter(Tensor::defined)).collect();
        }
        grads.weights = now.iter().zip(it).filter(|(_, g)| g.defined()).map(|((w, _), g)| (*w, g)).collect();
        Ok((ig, grads))
    }

    /// The weight-gradient half: for each deferred weight read, its outputs' kept
    /// gradients back through that instruction alone to the aliases it read (each read's
    /// own graph, so nothing before it runs again), summed per weight with those the
    /// input gradient gave. The common products (`MatMul` by a 2-D weight, `Gemm`) form
    /// theirs directly ([`super::pieces::DirectGrad`]): autograd's kernel without its
    /// engine, the seed's dot product or the seed's gradient.
    fn backward_weight(&self, f: &Fwd, grads: SplitGrads) -> Result<Vec<Tensor>, E> {
        let mut pg: Vec<Option<Tensor>> = f.params.iter().map(|_| None).collect();
        let mut add = |w: usize, g: Tensor| -> Result<(), E> {
            pg[w] = Some(match pg[w].take() {
                None => g,
                Some(sum) => sum.f_add(&g).map_err(torch("weight gradient"))?,
            });
            Ok(())
        };
        for (w, g) in grads.weights {
            add(w, g)?;
        }
        for (read, outs) in f.reads.iter().zip(grads.outputs).filter(|(r, _)| r.deferred) {
            if let (Some(direct), [Some(g)]) = (&read.direct, outs.as_slice()) {
                let kinds: Vec<tch::Kind> = read.aliases.iter().map(|(_, a)| a.kind()).collect();
                for ((w, _), g) in read.aliases.iter().zip(direct.gradients(g, &kinds).map_err(torch("weight gradient"))?) {
                    add(*w, g)?;
                }
                continue;
            }
            // The seed whose gradient at each output is the kept one: a dot product.
            let mut terms = Vec::new();
            for (o, g) in read.outputs.iter().zip(outs) {
                if let Some(g) = g {
                    terms.push(o.f_flatten(0, -1).and_then(|o| g.f_flatten(0, -1).and_then(|g| o.f_dot(&g))).map_err(torch("weight gradient seed"))?);
                }
            }
            let mut terms = terms.into_iter();
            let Some(first) = terms.next() else { continue };
            let root = terms.try_fold(first, |a, b| a.f_add(&b)).map_err(torch("weight gradient seed"))?;
            let aliases: Vec<&Tensor> = read.aliases.iter().map(|(_, a)| a).collect();
            let computed = Tensor::f_run_backward(&[root], &aliases, false, false).map_err(torch("backward (weight gradient)"))?;
            for ((w, _), g) in read.aliases.iter().zip(computed) {
                if g.defined() {
                    add(*w, g)?;
                }
            }
        }
        // An early-tied weight's gradient is summed apart ([`EarlyTied`]): a scalar zero
        // holds its place in the accumulator, not a copy of its size.
        let empty = |w: usize, t: &Tensor| if self.early_tied && self.is_tied(w) { Tensor::zeros([], (t.kind(), t.device())) } else { t.zeros_like() };
        Ok(pg.into_iter().zip(&f.params).enumerate().map(|(w, (g, t))| g.unwrap_or_else(|| empty(w, t))).collect())
    }
}

/// What a backward's input-gradient op leaves for its weight-gradient op.
enum WeightHalf {
    /// A split backward's kept gradients.
    Split(SplitGrads),
    /// The output gradients received, for a whole backward (none on the last stage).
    Whole(Option<super::Named>),
}

/// What a split backward's input-gradient half leaves for its weight-gradient half.
struct SplitGrads {
    /// Per [`WeightRead`], per output: its gradient, kept for a deferred read (`None`
    /// where none flowed, and for every other read).
    outputs: Vec<Vec<Option<Tensor>>>,
    /// `(weight index, gradient)` of the reads that were not deferred.
    weights: Vec<(usize, Tensor)>,
}

/// `g` when the engine computed it, zeros like `t` otherwise.
fn defined_or_zeros(g: Option<Tensor>, t: &Tensor) -> Tensor {
    match g {
        Some(g) if g.defined() => g,
        _ => t.zeros_like(),
    }
}

/// What one execution of the program gave.
struct Run {
    outputs: Vec<Tensor>,
    act_bytes: u64,
    stats: Vec<(usize, Tensor)>,
    reads: Vec<WeightRead>,
}

/// Milliseconds of the training loss `l` on a model output like `out` (forward, then
/// its backward to the output), as the last stage computes it, on synthetic labels (class
/// 0 for cross-entropy, random targets for mse): medians of `reps` after one warm-up. For
/// `pipewright profile`; an error says why the loss does not apply to that output.
pub fn loss_ms(l: &Objective, out: &Tensor, reps: usize) -> Result<(f64, f64), String> {
    let labels = match l.loss {
        Loss::Output => None,
        Loss::Mse => Some(out.f_randn_like().map_err(|e| first_line(&e))?),
        Loss::CrossEntropy => {
            let dims = out.size();
            let batch = dims.split_last().map(|(_, rest)| rest.to_vec()).ok_or("logits are a scalar")?;
            Some(Tensor::f_zeros(&batch, (Kind::Int64, out.device())).map_err(|e| first_line(&e))?)
        }
    };
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for rep in 0..reps.max(1) + 1 {
        let leaf = out.detach().set_requires_grad(true);
        let start = std::time::Instant::now();
        let loss = loss_of(l, &leaf, labels.as_ref(), 0)?;
        let mid = std::time::Instant::now();
        Tensor::f_run_backward(&[loss], &[&leaf], false, false).map_err(|e| first_line(&e))?;
        if rep > 0 {
            fwd.push((mid - start).as_secs_f64() * 1e3);
            bwd.push(mid.elapsed().as_secs_f64() * 1e3);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(fwd), median(bwd)))
}

/// The loss of output `out` (whose batch is on axis `label_axis`) against the microbatch's
/// `labels` (sample axis first).
fn loss_of(l: &Objective, out: &Tensor, labels: Option<&Tensor>, label_axis: usize) -> Result<Tensor, String> {
    // Under mixed precision the loss (a softmax, a mean) is computed in fp32.
    let out = &match out.kind() {
        Kind::BFloat16 | Kind::Half => out.f_to_kind(Kind::Float).map_err(|e| e.to_string())?,
        _ => out.shallow_clone(),
    };
    let labels = labels.map(|y| labels_along(y, label_axis)).transpose()?;
    let need = || labels.as_ref().ok_or_else(|| "the microbatch has no labels".to_string());
    let moved = if label_axis > 0 { format!(" (their sample axis moved to axis {label_axis}, where the output carries the batch)") } else { String::new() };
    let output = &l.output;
    let r = match l.loss {
        Loss::Output => {
            if out.numel() != 1 {
                return Err(format!("loss output has shape {:?}, expected a scalar", out.size()));
            }
            Ok(out.reshape([] as [i64; 0]))
        }
        Loss::Mse => {
            let y = need()?;
            if y.size() != out.size() {
                return Err(format!("mse: targets have shape {:?}{moved}, output {output:?} has {:?}", y.size(), out.size()));
            }
            (|| (out - y.f_to_kind(out.kind())?).f_square()?.f_mean(out.kind()))()
        }
        Loss::CrossEntropy => {
            let y = need()?;
            let dims = out.size();
            let c = *dims.last().ok_or("logits are a scalar")?;
            if y.size() != dims[..dims.len() - 1] {
                return Err(format!(
                    "cross-entropy: labels have shape {:?}{moved}, but output {output:?} of shape {dims:?} needs class ids of shape {:?}",
                    y.size(),
                    &dims[..dims.len() - 1]
                ));
            }
            let y = y.f_to_kind(Kind::Int64).and_then(|y| y.f_reshape([-1])).map_err(|e| first_line(&e))?;
            if check_class_ids(l, &y, c)? == 0 {
                // Every label ignored (a microbatch of padding): libtorch's mean of nothing
                // is NaN, which would stop training as a divergence; nothing to learn is a
                // zero loss with zero gradients.
                return out.f_sum(out.kind()).and_then(|s| s.f_mul_scalar(0.0)).map_err(|e| first_line(&e));
            }
            // libtorch's cross-entropy leaves the ignored labels out of the sum and the
            // mean alike, and applies the smoothing.
            out.f_reshape([-1, c]).and_then(|x| x.f_cross_entropy_loss::<Tensor>(&y, None, tch::Reduction::Mean, l.ignore_index, l.label_smoothing))
        }
    };
    r.map_err(|e: tch::TchError| first_line(&e))
}

/// A microbatch's labels (or targets), sample axis first, with that axis moved to `axis`,
/// where the loss's output carries the batch.
pub(super) fn labels_along(y: &Tensor, axis: usize) -> Result<Tensor, String> {
    if axis == 0 {
        return Ok(y.shallow_clone());
    }
    if y.dim() <= axis {
        return Err(format!("labels of shape {:?} (sample axis first) have no axis {axis}, where the output carries the batch", y.size()));
    }
    y.f_movedim(&[0], &[axis as i64]).map_err(|e| first_line(&e))
}

fn first_line(e: &tch::TchError) -> String {
    e.to_string().lines().next().unwrap_or("").to_string()
}

/// Every label is a class id of the `c` classes or the ignored value: libtorch would stop
/// with an index error naming neither the label nor the option. Returns how many labels
/// are kept (not ignored).
fn check_class_ids(l: &Objective, y: &Tensor, c: i64) -> Result<usize, String> {
    let (kept, bad) = (|| {
        let kept = y.f_masked_select(&y.f_ne(l.ignore_index)?)?;
        let out = kept.f_masked_select(&kept.f_lt(0)?.f_logical_or(&kept.f_ge(c)?)?)?;
        Ok::<_, tch::TchError>((kept.numel(), if out.numel() > 0 { Some((out.f_int64_value(&[0])?, out.numel())) } else { None }))
    })()
    .map_err(|e| first_line(&e))?;
    match bad {
        None => Ok(kept),
        Some((v, n)) => Err(format!(
            "cross-entropy: label {v} ({n} such label(s) in the microbatch) is not a class id of output {:?}, which has {c} classes (0..={}); labels equal to --ignore-index ({}) are skipped",
            l.output,
            c - 1,
            l.ignore_index
        )),
    }
}
