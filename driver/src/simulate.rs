//! `pipewright simulate`: plans a model (or takes a plan) for a cluster and replays each
//! scheme event by event ([`pipewright_passes::simulate`]), with the runtime's per-stage
//! operation order. Needs no libtorch, and never reads the weights' values: the model is
//! imported with [`ImportOptions::shapes_only`].

use std::path::{Path, PathBuf};

use pipewright_core::fs::write_atomic;
use pipewright_core::{Optimizer, Placement, Precision, Recompute, Reduction, Schedule, Scheme, WordList};
use pipewright_ir::{import_model, Graph, ImportOptions};
use pipewright_passes::cost::CostModel;
use pipewright_passes::machine::{duration_factors, AllReduce, DurationSpread, HostCores};
use pipewright_passes::plan_file::PlanFile;
use pipewright_passes::planner::{plan_on, Candidate, PlanContext, PlanError, PlanOptions};
use pipewright_passes::presets::SimCluster;
use pipewright_passes::profile::Profile;
use pipewright_passes::simulate::{dedicated_durations, simulate as replay, SimSetup, Simulation};
use pipewright_passes::tensor_parallel::{plan_tensor_parallel, TensorError};
use pipewright_runtime::timeline::{after_backward_us, chrome_trace_json, read_chrome_trace, timeline_svg, TraceKind};
use serde::Serialize;

use crate::plan::{PresetShape, TrainingShape};
use crate::DriverError;

/// What `pipewright simulate` is asked to do.
#[derive(Clone, Debug)]
pub struct SimulateRequest {
    /// An ONNX model, or a plan file from `pipewright plan --json`.
    pub input: PathBuf,
    /// The cluster; with a plan file, `None` keeps the plan's.
    pub cluster: Option<SimCluster>,
    /// Samples per optimizer step over all replicas (a plan file has its own).
    pub global_batch: Option<u64>,
    pub schemes: Vec<Scheme>,
    pub profile: Option<Profile>,
    pub optimizer: Optimizer,
    pub momentum: bool,
    pub precision: Precision,
    /// Batches to replay.
    pub batches: usize,
    /// Keep every interval, for [`write_trace`].
    pub record: bool,
    /// A real run's trace (`train --trace`) whose per-stage mean forward, recompute,
    /// backward, optimizer and send times replace the cost model's (for a plan of that run),
    /// and whose forwards and backwards, each over its stage's mean, are the replay's
    /// [`DurationSpread`].
    pub stage_times: Option<PathBuf>,
    /// The stages are threads sharing this many CPU cores (`--host-cores`; overrides the
    /// cluster's `host_cores`): the replay shares them among the working stages, and the
    /// `stage_times` trace's durations, measured under that sharing, are first converted
    /// back to dedicated work ([`dedicated_durations`]).
    pub host_cores: Option<usize>,
    /// How the replicas' gradient sums are taken (`--reduction`; overrides the cluster's).
    pub reduction: Option<Reduction>,
    /// Fix how the workers are numbered (`--placement`); `None`: the planner weighs both.
    pub placement: Option<Placement>,
    /// Fix the pipeline schemes' activation recomputation (`--recompute`); `None`: the
    /// planner tries all three for each.
    pub recompute: Option<Recompute>,
    /// How each scheme's configuration is fixed rather than searched (`--stages`,
    /// `--width`, `--microbatch`, `--tensor-ways`).
    pub fixed: FixedShape,
}

/// What a comparison may fix in every scheme's configuration, as the PipeDream-2BW paper's
/// does (each scheme at the planner's depth on all the GPUs, the largest microbatch that
/// fits): `None` leaves it to each scheme's search.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct FixedShape {
    /// Fix the depth of the pipeline schemes and of inter-layer model parallelism, as
    /// `plan --stages` does (data parallelism is depth 1 and tensor parallelism has its own
    /// --tensor-ways).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Fix the data-parallel width: each pipeline scheme's replicas, data parallelism's
    /// workers, tensor parallelism's groups.
    #[arg(long)]
    pub width: Option<usize>,
    /// Fix every scheme's microbatch size.
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Fix tensor parallelism's t (the GPUs each layer is split over): a divisor of the
    /// server size, or a multiple of it, whose groups then span whole servers and
    /// all-reduce over the network (the paper's 16-way baseline on GPT 3.8B); by default t
    /// is searched among the server size's divisors.
    #[arg(long)]
    pub tensor_ways: Option<usize>,
}

impl FixedShape {
    /// The options given, by flag, for the error that a plan file takes none.
    fn given(&self) -> Vec<&'static str> {
        [("--stages", self.stages.is_some()), ("--width", self.width.is_some()), ("--microbatch", self.microbatch.is_some()), ("--tensor-ways", self.tensor_ways.is_some())]
            .into_iter()
            .filter_map(|(f, set)| set.then_some(f))
            .collect()
    }
}

/// What `pipewright simulate` is asked (its options).
#[derive(Clone, Debug, clap::Args)]
pub struct SimulateSpec {
    /// The ONNX model file (its weights' values are never read), or a plan file
    /// (`plan --json`, ending in .json).
    pub input: PathBuf,
    /// A cluster TOML file, or a device preset: V100-16GB, A100-40GB, A100-80GB, H100, H200.
    /// Needed for a model; a plan file brings its own.
    #[arg(long, value_name = "FILE|PRESET")]
    pub cluster: Option<String>,
    #[command(flatten)]
    pub preset: PresetShape,
    /// Share of the peak flop/s and memory bandwidth every kernel achieves, in (0, 1], with
    /// a device preset: overrides the preset's per-kernel model (matrix products at their
    /// published share of the peak, reduced by tile and wave quantization; other kernels at
    /// the published share of the memory bandwidth; a launch per kernel). A cluster file has
    /// its own `efficiency` key (default 1).
    #[arg(long)]
    pub efficiency: Option<f64>,
    /// Global batch size (samples per optimizer step); a plan file has its own.
    #[arg(long)]
    pub batch: Option<u64>,
    /// Schemes to compare: 2bw, flush, gpipe, zb-h1, zb-h2, interleaved-2, interleaved-4, zb-v, model-parallel, data-parallel, tensor-parallel
    /// (comma-separated), or all. Default: all for a model, the plan's schedule for a plan.
    #[arg(long)]
    pub schedule: Option<WordList<Scheme>>,
    /// A profile from `pipewright profile`: measured node times instead of the roofline,
    /// what a stage boundary costs the runtime and its untraced work after each backward,
    /// each stage's measured share of the pass;
    /// with --host-cores on a host of the profiled one's size, how threads crowding it slow
    /// each other and the scheduler's tick its turns end on.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    #[command(flatten)]
    pub training: TrainingShape,
    /// Batches (optimizer steps) to replay.
    #[arg(long, default_value_t = 10)]
    pub batches: usize,
    /// A real run's trace (`train --trace`) of the same configuration: its per-stage
    /// mean forward, recompute, backward, optimizer and send times replace the cost model's
    /// (to check the schedule model apart from the cost model, or replay a measured run
    /// under another schedule), and so does the mean gap after a backward (the runtime's
    /// untraced work) when the trace records its waits, as a run's does. Means, not
    /// medians: the rate is set by the total time.
    #[arg(long, value_name = "TRACE")]
    pub stage_times: Option<PathBuf>,
    /// The stages run as threads of one process on a host with N CPU cores (a CPU run of
    /// the embedded executor, one thread per stage and replica): the working stages take
    /// turns on the cores in Linux's default time slice (1.5 ms on 2 or 3 cores), each turn
    /// lasting until the scheduler's next tick when a --profile measured the tick on a host
    /// of N cores. With --stage-times, the trace's durations (measured under that sharing)
    /// are converted back to full-speed work first. Overrides a cluster file's host_cores.
    #[arg(long, value_name = "N")]
    pub host_cores: Option<usize>,
    /// How the replicas' gradient sums are taken: `collective` (rings, as MPI's all-reduce
    /// and NCCL run them) or `fixed-order` (as `worker --deterministic-reduce` does: every
    /// part gathered to the first replica and the sum sent back). Overrides a cluster
    /// file's `reduction`; default collective.
    #[arg(long, value_enum)]
    pub reduction: Option<Reduction>,
    /// Fix how the workers of the pipeline schemes are numbered (stage-major: a stage's
    /// replicas on consecutive workers; replica-major: a pipeline's stages); by default the
    /// planner weighs both for each scheme.
    #[arg(long, value_enum)]
    pub placement: Option<Placement>,
    /// Fix the pipeline schemes' activation recomputation, as `plan --recompute` does (the
    /// PipeDream-2BW paper's GPipe always recomputes); by default all three are tried for
    /// each scheme. Not with a plan file, which brings its own.
    #[arg(long, value_enum)]
    pub recompute: Option<Recompute>,
    #[command(flatten)]
    pub fixed: FixedShape,
    /// Write the replay as a Chrome trace (the format of `train --trace`); with several
    /// schemes, one file per scheme (`t.2bw.json`, ...).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Draw the replay's timeline as SVG (as `trace-svg` does), one file per scheme likewise.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl SimulateSpec {
    /// The request: the cluster from its file or preset, the schemes, the profile.
    pub fn request(&self) -> Result<SimulateRequest, DriverError> {
        let profile = self.profile.as_deref().map(crate::plan::read_profile).transpose()?;
        let schemes = match &self.schedule {
            Some(s) => s.0.clone(),
            None if looks_like_plan(&self.input) => vec![PlanFile::read(&self.input)?.plan.chosen.schedule.into()],
            None => Scheme::ALL.to_vec(),
        };
        Ok(SimulateRequest {
            input: self.input.clone(),
            cluster: self.sim_cluster()?,
            global_batch: self.batch,
            schemes,
            profile,
            optimizer: self.training.optimizer,
            momentum: self.training.momentum,
            precision: self.training.precision,
            batches: self.batches,
            record: self.trace.is_some() || self.svg.is_some(),
            stage_times: self.stage_times.clone(),
            host_cores: self.host_cores,
            reduction: self.reduction,
            placement: self.placement,
            recompute: self.recompute,
            fixed: self.fixed,
        })
    }

    /// `--cluster FILE|PRESET`: a file when one exists at that path, else a preset with the
    /// preset-only values; `None` without one.
    fn sim_cluster(&self) -> Result<Option<SimCluster>, DriverError> {
        let mut given = self.preset.given();
        given.extend(self.efficiency.is_some().then_some("--efficiency"));
        let Some(spec) = &self.cluster else {
            if !given.is_empty() {
                return Err(DriverError::msg(format!("{} need(s) a device preset in --cluster", given.join(", "))));
            }
            return Ok(None);
        };
        let path = Path::new(spec);
        if path.is_file() {
            if !given.is_empty() {
                return Err(DriverError::msg(format!("{} appl(ies) to a device preset, not to the cluster file {spec} (set its keys instead)", given.join(", "))));
            }
            let text = std::fs::read_to_string(path).map_err(|source| DriverError::Read { path: path.to_path_buf(), source })?;
            return Ok(Some(SimCluster::from_toml(spec, &text).map_err(|e| DriverError::msg(format!("{spec}: {e}")))?));
        }
        Ok(Some(self.preset.cluster(spec, self.training.precision, self.efficiency)?))
    }
}

/// Writes each replayed scheme's trace and drawing (`trace`, `svg`: one file per scheme
/// when there are several), returning what was written for the command to say.
pub fn write_traces(report: &SimulateReport, trace: Option<&Path>, svg: Option<&Path>) -> Result<Vec<String>, DriverError> {
    let several = report.outcomes.iter().filter(|o| o.simulation.is_some()).count() > 1;
    let mut written = Vec::new();
    for o in &report.outcomes {
        let Some(sim) = &o.simulation else { continue };
        let trace = trace.map(|p| per_scheme_path(p, o.scheme, several));
        let svg = svg.map(|p| per_scheme_path(p, o.scheme, several));
        write_trace(sim, trace.as_deref(), svg.as_deref(), 1200)?;
        for p in trace.iter().chain(&svg) {
            written.push(format!("wrote {} ({} events)", p.display(), sim.events.len()));
        }
    }
    Ok(written)
}

/// One scheme's configuration and replay, or why it has none.
#[derive(Clone, Debug, Serialize)]
pub struct SchemeOutcome {
    pub scheme: Scheme,
    /// GPUs each layer is split over: the tensor-parallel degree (1 for every scheme but
    /// tensor parallelism).
    pub t: usize,
    /// The configuration replayed: the planner's choice for this scheme.
    pub config: Option<Candidate>,
    /// The planner's prediction for that configuration, samples/s: its own replay where it
    /// replayed it (plans from before it replayed: the closed form).
    pub planned_samples_per_s: Option<f64>,
    /// The planner's closed-form figure for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub closed_form_samples_per_s: Option<f64>,
    pub simulation: Option<Simulation>,
    /// Why there is no simulation (nothing fits, ...).
    pub why_not: Option<String>,
}

impl SchemeOutcome {
    /// `scheme` was not replayed, for `why`.
    fn not_run(scheme: Scheme, why: String) -> SchemeOutcome {
        SchemeOutcome { scheme, t: 1, config: None, planned_samples_per_s: None, closed_form_samples_per_s: None, simulation: None, why_not: Some(why) }
    }
}

/// Everything `simulate` found.
#[derive(Clone, Debug, Serialize)]
pub struct SimulateReport {
    pub input: String,
    pub cluster: SimCluster,
    pub global_batch: u64,
    pub outcomes: Vec<SchemeOutcome>,
}

fn shapes(path: &Path) -> Result<Graph, DriverError> {
    Ok(import_model(path, &ImportOptions { shapes_only: true, ..ImportOptions::default() })?)
}

fn looks_like_plan(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// Plans and replays every requested scheme (see the module docs).
pub fn simulate(req: &SimulateRequest) -> Result<SimulateReport, DriverError> {
    if req.batches == 0 {
        return Err(DriverError::msg("--batches must be at least 1"));
    }
    if req.schemes.is_empty() {
        return Err(DriverError::msg("no scheme to simulate"));
    }
    if req.host_cores == Some(0) {
        return Err(DriverError::msg("--host-cores must be at least 1 (the CPU cores the stages' threads share)"));
    }
    if looks_like_plan(&req.input) {
        if let Some(r) = req.recompute {
            return Err(DriverError::msg(format!("{}: --recompute {} is for a model; a plan file's configuration has its own recomputation (plan again with --recompute)", req.input.display(), r.name())));
        }
        let fixed = req.fixed.given();
        if !fixed.is_empty() {
            return Err(DriverError::msg(format!("{}: {} fix(es) a model's configuration; a plan file has its own (plan again with them)", req.input.display(), fixed.join(", "))));
        }
        return simulate_plan(req);
    }
    let cluster = req.cluster.clone().ok_or_else(|| DriverError::msg("simulating a model needs a cluster (--cluster FILE|PRESET)"))?;
    let cluster = with_overrides(cluster, req);
    let global_batch = req.global_batch.ok_or_else(|| DriverError::msg("simulating a model needs the global batch (--batch B)"))?;
    let g = shapes(&req.input)?;
    let cost = cost_model(&g, &cluster, req.profile.as_ref(), &req.input)?;
    let base = PlanOptions {
        global_batch,
        optimizer: req.optimizer,
        momentum: req.momentum,
        precision: req.precision,
        placement: req.placement,
        recompute: req.recompute,
        width: req.fixed.width,
        microbatch: req.fixed.microbatch,
        top: 1,
        ..PlanOptions::default()
    };
    let search = |schedule: Schedule, stages: Option<usize>| -> Result<Result<Candidate, String>, DriverError> {
        let opts = PlanOptions { schedules: vec![schedule], stages, ..base.clone() };
        // The planner replays its candidates with this cluster's latencies and host cores,
        // so its prediction for the chosen configuration is the replay below (at its batch
        // count).
        match plan_on(&g, &cost, &cluster.cluster, cluster.latencies(), cluster.host_cores, &opts) {
            Ok(p) => Ok(Ok(p.chosen)),
            Err(e @ (PlanError::NoFeasible(_) | PlanError::Options(_))) => Ok(Err(e.to_string())),
            Err(e) => Err(DriverError::msg(format!("{}: {e}", req.input.display()))),
        }
    };
    let mut flush: Option<Result<Candidate, String>> = None;
    let mut outcomes = Vec::new();
    for &scheme in &req.schemes {
        let config = match scheme {
            Scheme::TensorParallel => {
                outcomes.push(tensor_outcome(&g, &cost, &cluster, &base, req)?);
                continue;
            }
            Scheme::DataParallel => search(Schedule::Flush, Some(1))?.map_err(|e| format!("the whole model on every worker: {e}")),
            Scheme::ModelParallel => {
                if flush.is_none() {
                    flush = Some(search(Schedule::Flush, req.fixed.stages)?);
                }
                // Its own best configuration: layers sharded over d workers, one
                // microbatch at a time, w such pipelines data-parallel (the paper's
                // inter-layer model parallelism). Candidates: PipeDream-Flush's plan at each
                // depth (it fits with d - k microbatches in flight, so with one), and its
                // free choice; the one whose replay without pipelining is fastest.
                let first = flush.clone().unwrap_or_else(|| Err("no plan".into()));
                let mut best = match first {
                    Ok(c) => Ok((model_parallel_rate(&g, &cost, &cluster, &base, &c, req)?, c)),
                    Err(e) => Err(e),
                };
                let workers = cluster.cluster.workers;
                // A fixed depth is Flush's own (searched above); else every power of two.
                let depths = (0..).map(|k| 1usize << k).take_while(|&d| d <= workers && req.fixed.stages.is_none());
                for d in depths {
                    if let Ok(c) = search(Schedule::Flush, Some(d))? {
                        let rate = model_parallel_rate(&g, &cost, &cluster, &base, &c, req)?;
                        if best.as_ref().map_or(true, |(r, _)| rate > *r) {
                            best = Ok((rate, c));
                        }
                    }
                }
                best.map(|(_, c)| c).map_err(|e| format!("no configuration fits without pipelining: {e}"))
            }
            s => {
                let schedule = s.schedule().unwrap_or(Schedule::Flush);
                let found = search(schedule, req.fixed.stages)?;
                if schedule == Schedule::Flush {
                    flush = Some(found.clone());
                }
                found
            }
        };
        outcomes.push(outcome(&g, &cost, &cluster, &base, scheme, config, req)?);
    }
    Ok(SimulateReport { input: req.input.display().to_string(), cluster, global_batch, outcomes })
}

/// `--host-cores` and `--reduction` replace the cluster's own, so that the report says
/// which the replay used.
fn with_overrides(mut cluster: SimCluster, req: &SimulateRequest) -> SimCluster {
    if req.host_cores.is_some() {
        cluster.host_cores = req.host_cores;
    }
    if let Some(r) = req.reduction {
        cluster.cluster.reduction = r;
    }
    cluster
}

/// Tensor parallelism: its own search ([`plan_tensor_parallel`]: `t`, the groups, the
/// microbatch), replayed as one stage per group with the tensor all-reduces inside the
/// forward and backward times.
fn tensor_outcome(g: &Graph, cost: &CostModel, cluster: &SimCluster, opts: &PlanOptions, req: &SimulateRequest) -> Result<SchemeOutcome, DriverError> {
    let scheme = Scheme::TensorParallel;
    if req.stage_times.is_some() {
        // A pipeline run's per-stage times say nothing about a layer split over t GPUs.
        return Ok(SchemeOutcome::not_run(scheme, "--stage-times holds a pipeline run's stage times; tensor parallelism is simulated from the cost model only".into()));
    }
    let plan = match plan_tensor_parallel(g, cost, cluster, opts, req.fixed.tensor_ways) {
        Ok(p) => p,
        Err(e @ (TensorError::Cycle(_) | TensorError::Ways { .. })) => return Err(DriverError::msg(format!("{}: {e}", req.input.display()))),
        Err(e) => return Ok(SchemeOutcome::not_run(scheme, e.to_string())),
    };
    let cand = plan.candidate.clone();
    let setup = SimSetup {
        scheme,
        w: cand.w,
        b: cand.b,
        m: cand.m,
        batches: req.batches,
        stages: vec![plan.stage.clone()],
        links: Vec::new(),
        allreduce: AllReduce::ring(plan.dp_link).with_reduction(cluster.cluster.reduction),
        record: req.record,
        host: cluster.host_cores.map(|c| cost.host_cores(c, cand.b)),
        tied_groups: Vec::new(),
        spread: cost.duration_spread().cloned(),
    };
    let sim = replay(&setup).map_err(|e| DriverError::msg(format!("{}: {scheme}: {e}", req.input.display())))?;
    // Its search has only a closed form: that is its prediction.
    Ok(SchemeOutcome { scheme, t: plan.t, planned_samples_per_s: Some(cand.samples_per_s), closed_form_samples_per_s: Some(cand.samples_per_s), config: Some(cand), simulation: Some(sim), why_not: None })
}

fn cost_model(g: &Graph, cluster: &SimCluster, profile: Option<&Profile>, input: &Path) -> Result<CostModel, DriverError> {
    let mut cost = CostModel::new(g, cluster.cluster.roofline()).map_err(|e| DriverError::msg(format!("{}: {e}", input.display())))?;
    if let Some(p) = profile {
        cost.apply_profile(g, p).map_err(|e| DriverError::msg(format!("{}: {e}", input.display())))?;
    }
    Ok(cost)
}

fn outcome(
    g: &Graph,
    cost: &CostModel,
    cluster: &SimCluster,
    opts: &PlanOptions,
    scheme: Scheme,
    config: Result<Candidate, String>,
    req: &SimulateRequest,
) -> Result<SchemeOutcome, DriverError> {
    let cand = match config {
        Ok(c) => c,
        Err(why) => return Ok(SchemeOutcome::not_run(scheme, why)),
    };
    let mut ctx = PlanContext::new(g, cost, &cluster.cluster, opts.precision).map_err(|e| DriverError::msg(format!("{}: {e}", req.input.display())))?;
    let sim = replay_candidate(&mut ctx, cluster, opts, scheme, &cand, req)?;
    let planned = (scheme != Scheme::ModelParallel).then_some(&cand);
    Ok(SchemeOutcome {
        scheme,
        t: 1,
        planned_samples_per_s: planned.map(Candidate::predicted_samples_per_s),
        closed_form_samples_per_s: planned.map(|c| c.samples_per_s),
        config: Some(cand.clone()),
        simulation: Some(sim),
        why_not: None,
    })
}

/// Samples/s of `cand` replayed as inter-layer model parallelism without pipelining.
fn model_parallel_rate(g: &Graph, cost: &CostModel, cluster: &SimCluster, opts: &PlanOptions, cand: &Candidate, req: &SimulateRequest) -> Result<f64, DriverError> {
    let mut ctx = PlanContext::new(g, cost, &cluster.cluster, opts.precision).map_err(|e| DriverError::msg(format!("{}: {e}", req.input.display())))?;
    let quiet = SimulateRequest { record: false, ..req.clone() };
    Ok(replay_candidate(&mut ctx, cluster, opts, Scheme::ModelParallel, cand, &quiet)?.samples_per_s)
}

fn replay_candidate(ctx: &mut PlanContext, cluster: &SimCluster, opts: &PlanOptions, scheme: Scheme, cand: &Candidate, req: &SimulateRequest) -> Result<Simulation, DriverError> {
    // The memory and optimizer terms follow the scheme actually run.
    let run_as = Candidate { schedule: scheme.schedule().unwrap_or(Schedule::Flush), ..cand.clone() };
    let mut stages = ctx.stage_costs(&run_as, opts);
    let host = cluster.host_cores.map(|c| ctx.cost().host_cores(c, cand.b));
    let spread = match &req.stage_times {
        Some(path) => measured_stage_times(path, &mut stages, host.map(|h| (h, cand.w)))?,
        None => ctx.cost().duration_spread().cloned(),
    };
    let setup = SimSetup {
        scheme,
        w: cand.w,
        b: cand.b,
        m: cand.m,
        batches: req.batches,
        stages,
        links: cand.stage_links(&cluster.cluster, cluster.latencies()),
        allreduce: cluster.allreduce(cand.layout()),
        record: req.record,
        host,
        tied_groups: ctx.tied_stage_groups(&cand.cuts),
        spread,
    };
    replay(&setup).map_err(|e| DriverError::msg(format!("{}: {scheme}: {e}", req.input.display())))
}

/// A plan file: its configuration, under its own schedule or the pipeline schedules asked
/// for, on its cluster or the one given.
fn simulate_plan(req: &SimulateRequest) -> Result<SimulateReport, DriverError> {
    let file = PlanFile::read(&req.input)?;
    let model = PathBuf::from(&file.model.path);
    let g = shapes(&model)?;
    let plan = file.into_plan_for(&g, &req.input)?;
    let cluster = req.cluster.clone().unwrap_or_else(|| SimCluster::from_cluster(&format!("the plan's cluster: {}", plan.cluster.summary()), plan.cluster.clone()));
    let cluster = with_overrides(cluster, req);
    if cluster.cluster.workers < plan.chosen.w * plan.chosen.d {
        return Err(DriverError::msg(format!("{}: the plan needs {} workers (w = {}, d = {}); the cluster has {}", req.input.display(), plan.chosen.w * plan.chosen.d, plan.chosen.w, plan.chosen.d, cluster.cluster.workers)));
    }
    let cost = cost_model(&g, &cluster, req.profile.as_ref(), &model)?;
    let mut ctx = PlanContext::new(&g, &cost, &cluster.cluster, plan.options.precision).map_err(|e| DriverError::msg(format!("{}: {e}", model.display())))?;
    if ctx.order().kind != plan.order {
        return Err(DriverError::msg(format!(
            "{}: the plan cuts the {} order of the nodes, but with this cost model the {} order is chosen; plan again with the same profile",
            req.input.display(),
            plan.order,
            ctx.order().kind
        )));
    }
    // The plan's own options (batch, optimizer, precision) are what it was cut for.
    let opts = plan.options.clone();
    if let Some(b) = req.global_batch.filter(|&b| b != opts.global_batch) {
        return Err(DriverError::msg(format!("{}: the plan is for a global batch of {}, not {b}; plan again for another batch", req.input.display(), opts.global_batch)));
    }
    let mut outcomes = Vec::new();
    for &scheme in &req.schemes {
        let cand = &plan.chosen;
        let why_not = match scheme {
            Scheme::DataParallel => Some("a plan fixes the depth; simulate the model for data parallelism".to_string()),
            Scheme::TensorParallel => Some("a plan fixes the pipeline; simulate the model for tensor parallelism".to_string()),
            Scheme::TwoBw | Scheme::Flush if cand.m < cand.d as u64 => Some(format!("{scheme} needs m >= d (the plan has m = {}, d = {})", cand.m, cand.d)),
            _ => None,
        };
        if let Some(why) = why_not {
            outcomes.push(SchemeOutcome::not_run(scheme, why));
            continue;
        }
        let sim = replay_candidate(&mut ctx, &cluster, &opts, scheme, cand, req)?;
        let planned = (Some(cand.schedule) == scheme.schedule()).then_some(cand);
        outcomes.push(SchemeOutcome {
            scheme,
            t: 1,
            config: Some(cand.clone()),
            planned_samples_per_s: planned.map(Candidate::predicted_samples_per_s),
            closed_form_samples_per_s: planned.map(|c| c.samples_per_s),
            simulation: Some(sim),
            why_not: None,
        });
    }
    Ok(SimulateReport { input: req.input.display().to_string(), cluster, global_batch: opts.global_batch, outcomes })
}

/// Replaces each stage's compute times by the means of a real run's trace at `path`: a
/// rate is set by the total time the operations took, which the mean keeps and a median
/// drops (the slow tail of a stage sharing its core, the hand-offs that wait for one).
/// With `sharing` (host, replicas), the run's stages shared that host's cores, so each
/// event's duration is first converted to the work it stands for at full speed (the
/// replay shares the cores again; taking the inflated durations as work would count the
/// sharing twice). Returns how the forwards and backwards spread about their stage's mean
/// (`None` with fewer than two).
fn measured_stage_times(path: &Path, stages: &mut [pipewright_passes::simulate::StageCost], sharing: Option<(HostCores, usize)>) -> Result<Option<DurationSpread>, DriverError> {
    let text = std::fs::read_to_string(path).map_err(|source| DriverError::Read { path: path.to_path_buf(), source })?;
    let events = read_chrome_trace(&text).map_err(|e| DriverError::msg(format!("{}: {e}", path.display())))?;
    let traced = events.iter().map(|e| e.stage + 1).max().unwrap_or(0);
    if traced != stages.len() {
        return Err(DriverError::msg(format!("{}: the trace has {traced} stages, the replayed configuration {}", path.display(), stages.len())));
    }
    let seconds: Vec<f64> = match sharing {
        Some((host, replicas)) => dedicated_durations(&events, host, replicas),
        None => events.iter().map(|e| e.dur_us / 1e6).collect(),
    };
    // A real run's trace records its waits (recv), so the gaps left after a backward are
    // the runtime's own work; a replay's trace records no waits, and its gaps are those.
    let records_waits = events.iter().any(|e| e.kind == TraceKind::Recv);
    let after_backward = if records_waits { after_backward_us(&events, 0) } else { Vec::new() };
    let mean = |stage: usize, kind: TraceKind| -> Option<f64> {
        let (sum, n) = events.iter().zip(&seconds).filter(|(e, _)| e.stage == stage && e.kind == kind).fold((0.0, 0usize), |(s, n), (_, &t)| (s + t, n + 1));
        (n > 0).then(|| sum / n as f64)
    };
    for (s, c) in stages.iter_mut().enumerate() {
        let (Some(f), Some(b)) = (mean(s, TraceKind::Forward), mean(s, TraceKind::Backward)) else {
            return Err(DriverError::msg(format!("{}: stage {s} has no forward or no backward in the trace", path.display())));
        };
        // A split backward's two halves (input gradient, weight gradient) make its whole;
        // a whole one keeps the cost model's share of weight gradients.
        let share = if c.backward_s > 0.0 { c.weight_grad_s / c.backward_s } else { 0.0 };
        let (backward_s, weight_grad_s) = match mean(s, TraceKind::BackwardWeight) {
            Some(w) => (b + w, w),
            None => (b, b * share),
        };
        c.forward_s = f;
        c.backward_s = backward_s;
        c.weight_grad_s = weight_grad_s;
        c.recompute_s = mean(s, TraceKind::Recompute).unwrap_or(0.0);
        c.optimizer_s = mean(s, TraceKind::Optimizer).unwrap_or(0.0);
        c.send_s = mean(s, TraceKind::Send).unwrap_or(0.0);
        // The gaps are the thread's own time, taken as they are (not converted: no event
        // says how long it had a core in them).
        c.after_backward_s = after_backward.get(s).copied().flatten().map_or(0.0, |us| us / 1e6);
    }
    Ok(DurationSpread::new(&duration_factors(&events, &seconds)))
}

/// Writes a replay's Chrome trace (the format of `train --trace`) and, when asked, its SVG
/// timeline (as `pipewright trace-svg` draws it), each atomically.
pub fn write_trace(sim: &Simulation, trace: Option<&Path>, svg: Option<&Path>, width: u32) -> Result<(), DriverError> {
    if let Some(p) = trace {
        write_atomic(p, chrome_trace_json(&sim.events).as_bytes())?;
    }
    if let Some(p) = svg {
        write_atomic(p, timeline_svg(&sim.events, width).as_bytes())?;
    }
    Ok(())
}

/// `t.json` for one scheme, `t.2bw.json` for each of several.
pub fn per_scheme_path(path: &Path, scheme: Scheme, several: bool) -> PathBuf {
    if !several {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{scheme}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{scheme}"),
    };
    path.with_file_name(name)
}

impl SimulateReport {
    /// The table for people: one row per scheme, then each stage of each replay.
    pub fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = match self.cluster.host_cores {
            Some(c) => writeln!(s, "simulated on: {}, global batch {}, the stages' threads sharing {c} CPU core(s)", self.cluster.name, self.global_batch),
            None => writeln!(s, "simulated on: {}, global batch {}", self.cluster.name, self.global_batch),
        };
        if self.cluster.cluster.reduction != Reduction::Collective {
            let r = self.cluster.cluster.reduction;
            let _ = writeln!(s, "gradient sums: {r} ({})", r.help());
        }
        let _ = writeln!(
            s,
            "{:<15} {:>4} {:>4} {:>13} {:>3} {:>5} {:>5} {:>9} {:>12} {:>12} {:>11} {:>7} {:>11}",
            "scheme", "w", "d", "placement", "t", "b", "m", "recompute", "samples/s", "planner", "closed form", "bubble", "peak memory"
        );
        let best = self.outcomes.iter().filter_map(|o| o.simulation.as_ref()).map(|x| x.samples_per_s).fold(0.0, f64::max);
        for o in &self.outcomes {
            match (&o.config, &o.simulation) {
                (Some(c), Some(x)) => {
                    let peak = x.stages.iter().map(|st| st.peak_memory).fold(0.0, f64::max);
                    let planned = o.planned_samples_per_s.map_or("-".to_string(), |p| format!("{p:.1}"));
                    let closed = o.closed_form_samples_per_s.map_or("-".to_string(), |p| format!("{p:.1}"));
                    let _ = writeln!(
                        s,
                        "{:<15} {:>4} {:>4} {:>13} {:>3} {:>5} {:>5} {:>9} {:>12.1} {:>12} {:>11} {:>6.1}% {:>11}",
                        o.scheme.name(),
                        c.w,
                        c.d,
                        c.placement_text(),
                        o.t,
                        c.b,
                        c.m,
                        c.recompute.name(),
                        x.samples_per_s,
                        planned,
                        closed,
                        x.bubble_fraction * 100.0,
                        pipewright_core::units::human_bytes(peak.max(0.0) as u64)
                    );
                }
                _ => {
                    let _ = writeln!(s, "{:<15} {}", o.scheme.name(), o.why_not.as_deref().unwrap_or("not simulated"));
                }
            }
        }
        let _ = writeln!(s, "t: GPUs each layer is split over (tensor parallelism: w groups of t GPUs, w x t workers)");
        let _ = writeln!(s, "samples/s: simulated steady state over all replicas; planner: the planner's prediction for the same configuration (its own replay, over {} batches); closed form: the planner's formula, which prunes its search; bubble: mean over stages of 1 - busy / span", pipewright_passes::planner::REPLAY_BATCHES);
        if best > 0.0 {
            let ratios: Vec<String> = self
                .outcomes
                .iter()
                .filter_map(|o| o.simulation.as_ref().map(|x| format!("{} {:.2}x", o.scheme, best / x.samples_per_s)))
                .collect();
            let _ = writeln!(s, "slowdown against the fastest: {}", ratios.join(", "));
        }
        for o in &self.outcomes {
            let Some(x) = &o.simulation else { continue };
            let _ = writeln!(s, "\n{}: {:.3} ms per batch, {} batches in {:.3} ms", o.scheme, x.batch_s * 1e3, x.batches, x.makespan_s * 1e3);
            for (k, st) in x.stages.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "  stage {k}: busy {:.3} ms, bubble {:.1}%, up to {} microbatches held, peak memory {}, all-reduce {:.3} ms per step",
                    st.busy_s * 1e3,
                    st.bubble_fraction * 100.0,
                    st.peak_in_flight,
                    pipewright_core::units::human_bytes(st.peak_memory.max(0.0) as u64),
                    st.allreduce_s * 1e3
                );
            }
        }
        s
    }
}
