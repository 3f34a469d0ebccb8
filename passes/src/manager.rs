//! The pass manager: an ordered list of named passes over a [`PipelineState`], with the
//! verifier after each pass (tests and debug builds), `--print-after`, `--stop-after` and
//! per-pass timing.
//!
//! The compile pipeline is `import -> shape-inference -> partition -> recompute ->
//! weight-versioning -> lower` ([`standard_passes`]). Import and shape inference happen
//! together in the IR importer (`pipewright_ir::import_model`), so here they are named
//! stages whose output is the imported graph the state starts with; `lower` is a no-op
//! placeholder the caller replaces with [`PassManager::replace`].
//!
//! Printed text is collected in [`PipelineState::printed`] rather than written out, so the
//! caller decides where it goes. The graph is printed in the IR text form with each node
//! annotated by whatever the passes so far decided: `stage=1 stash w:%v3 x2 (2bw)`.

use std::fmt::Write;
use std::time::{Duration, Instant};

use pipewright_ir::text::print_graph_annotated;
use pipewright_ir::{verify, verify_stages, Graph, NodeId, StageMap};

use crate::boundaries::insert_stage_boundaries;
use crate::cost::{CostModel, Roofline};
use pipewright_core::{Recompute, Schedule};
use crate::recompute::{decide_recomputation, RecomputePlan};
use crate::versioning::{version_weights, WeightVersions};

/// Everything the passes have produced so far.
#[derive(Clone, Debug)]
pub struct PipelineState {
    pub graph: Graph,
    /// The stage of every node of the imported graph (the partition pass's input).
    pub input_stages: Option<StageMap>,
    /// The stage table of the partitioned graph.
    pub stages: Option<StageMap>,
    /// The cost model of the partitioned graph.
    pub cost: Option<CostModel>,
    pub recompute: Option<RecomputePlan>,
    pub versions: Option<WeightVersions>,
    /// Text requested by `print_after`.
    pub printed: String,
    /// Wall time of each pass run, in order.
    pub timings: Vec<(String, Duration)>,
    /// The passes run, in order.
    pub ran: Vec<String>,
}

impl PipelineState {
    pub fn new(graph: Graph) -> PipelineState {
        PipelineState {
            graph,
            input_stages: None,
            stages: None,
            cost: None,
            recompute: None,
            versions: None,
            printed: String::new(),
            timings: Vec::new(),
            ran: Vec::new(),
        }
    }

    /// A state whose graph is to be partitioned by `stages`.
    pub fn with_stages(graph: Graph, stages: StageMap) -> PipelineState {
        PipelineState {
            input_stages: Some(stages),
            ..PipelineState::new(graph)
        }
    }

    /// The combined annotation of node `n`: `stage=1 stash w:%v3 x2 (2bw)`.
    pub fn note(&self, n: NodeId) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(s) = self.stages.as_ref().and_then(|m| m.get(n)) {
            parts.push(format!("stage={s}"));
        }
        if let Some(x) = self.recompute.as_ref().and_then(|r| r.note(n)) {
            parts.push(x);
        }
        if let Some(x) = self.versions.as_ref().and_then(|v| v.note(n)) {
            parts.push(x);
        }
        if parts.is_empty() {
            None
        } else {
            Some(parts.join(" "))
        }
    }

    /// The graph in text form annotated with [`PipelineState::note`].
    pub fn annotated_text(&self) -> String {
        print_graph_annotated(&self.graph, |n| self.note(n))
    }

    /// One line per pass run with its wall time, then the total.
    pub fn timings_text(&self) -> String {
        let width = self
            .timings
            .iter()
            .map(|t| t.0.len())
            .max()
            .unwrap_or(0)
            .max(5);
        let mut s = String::new();
        let mut total = Duration::ZERO;
        for (name, t) in &self.timings {
            total += *t;
            let _ = writeln!(s, "  {name:<width$}  {:>10.3} ms", t.as_secs_f64() * 1e3);
        }
        let _ = writeln!(
            s,
            "  {:<width$}  {:>10.3} ms",
            "total",
            total.as_secs_f64() * 1e3
        );
        s
    }
}

/// Which passes' results are printed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PrintAfter {
    #[default]
    None,
    Pass(String),
    All,
}

/// How a [`PassManager`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunOptions {
    pub print_after: PrintAfter,
    /// Stop after the pass of this name.
    pub stop_after: Option<String>,
    /// Run the IR verifier (and `verify_stages` once stages exist) after each pass;
    /// defaults to `cfg!(debug_assertions)`.
    pub verify: bool,
}

impl Default for RunOptions {
    fn default() -> RunOptions {
        RunOptions {
            print_after: PrintAfter::None,
            stop_after: None,
            verify: cfg!(debug_assertions),
        }
    }
}

/// A pass's own error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A pass: transforms or annotates the state.
pub type PassFn<'a> = Box<dyn FnMut(&mut PipelineState) -> Result<(), BoxError> + 'a>;

/// Why the pipeline stopped.
#[derive(Debug)]
pub enum ManagerError {
    /// `print_after` or `stop_after` (`option`) names no pass.
    UnknownPass {
        option: &'static str,
        name: String,
        valid: Vec<String>,
    },
    /// Two passes with one name.
    DuplicatePass(String),
    /// A pass failed.
    Pass { pass: String, source: BoxError },
    /// The graph or stage table is invalid after a pass.
    Verify { pass: String, errors: Vec<String> },
}

impl std::fmt::Display for ManagerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ManagerError::UnknownPass {
                option,
                name,
                valid,
            } => {
                write!(
                    f,
                    "{option}: unknown pass {name:?}; valid passes: {}",
                    valid.join(", ")
                )
            }
            ManagerError::DuplicatePass(name) => write!(f, "pass {name:?} is registered twice"),
            ManagerError::Pass { pass, source } => write!(f, "pass {pass} failed: {source}"),
            ManagerError::Verify { pass, errors } => {
                write!(
                    f,
                    "the graph is invalid after pass {pass}: {}",
                    errors.join("; ")
                )
            }
        }
    }
}

impl std::error::Error for ManagerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ManagerError::Pass { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// An ordered list of named passes.
#[derive(Default)]
pub struct PassManager<'a> {
    passes: Vec<(String, PassFn<'a>)>,
}

impl<'a> PassManager<'a> {
    pub fn new() -> PassManager<'a> {
        PassManager { passes: Vec::new() }
    }

    /// Appends a pass (builder style). A repeated name is reported by [`PassManager::run`].
    pub fn add(
        mut self,
        name: impl Into<String>,
        pass: impl FnMut(&mut PipelineState) -> Result<(), BoxError> + 'a,
    ) -> PassManager<'a> {
        self.passes.push((name.into(), Box::new(pass)));
        self
    }

    /// Replaces the pass called `name` (e.g. the `lower` placeholder).
    pub fn replace(
        &mut self,
        name: &str,
        pass: impl FnMut(&mut PipelineState) -> Result<(), BoxError> + 'a,
    ) -> Result<(), ManagerError> {
        match self.passes.iter_mut().find(|p| p.0 == name) {
            Some(p) => {
                p.1 = Box::new(pass);
                Ok(())
            }
            None => Err(self.unknown("replace", name)),
        }
    }

    /// The pass names in order.
    pub fn names(&self) -> Vec<String> {
        self.passes.iter().map(|p| p.0.clone()).collect()
    }

    fn unknown(&self, option: &'static str, name: &str) -> ManagerError {
        ManagerError::UnknownPass {
            option,
            name: name.to_string(),
            valid: self.names(),
        }
    }

    /// Runs the passes in order on `state`, up to and including `stop_after`.
    pub fn run(
        &mut self,
        state: &mut PipelineState,
        opts: &RunOptions,
    ) -> Result<(), ManagerError> {
        let names = self.names();
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(ManagerError::DuplicatePass(n.clone()));
            }
        }
        if let Some(stop) = &opts.stop_after {
            if !names.contains(stop) {
                return Err(self.unknown("stop-after", stop));
            }
        }
        if let PrintAfter::Pass(p) = &opts.print_after {
            if !names.contains(p) {
                return Err(self.unknown("print-after", p));
            }
        }
        for (name, pass) in &mut self.passes {
            let start = Instant::now();
            let result = pass(state);
            state.timings.push((name.clone(), start.elapsed()));
            result.map_err(|source| ManagerError::Pass {
                pass: name.clone(),
                source,
            })?;
            state.ran.push(name.clone());
            if opts.verify {
                verify_state(name, state)?;
            }
            let print = match &opts.print_after {
                PrintAfter::None => false,
                PrintAfter::All => true,
                PrintAfter::Pass(p) => p == name,
            };
            if print {
                print_state(name, state);
            }
            if opts.stop_after.as_deref() == Some(name.as_str()) {
                break;
            }
        }
        Ok(())
    }
}

fn verify_state(pass: &str, state: &PipelineState) -> Result<(), ManagerError> {
    let fail = |errors: Vec<pipewright_ir::VerifyError>| ManagerError::Verify {
        pass: pass.to_string(),
        errors: errors.iter().map(|e| e.to_string()).collect(),
    };
    verify(&state.graph).map_err(fail)?;
    if let Some(stages) = &state.stages {
        verify_stages(&state.graph, stages).map_err(fail)?;
    }
    Ok(())
}

/// Appends the annotated graph (and the summary of the pass's analysis) to `printed`.
fn print_state(pass: &str, state: &mut PipelineState) {
    let mut s = format!("// ----- after {pass} -----\n");
    s.push_str(&state.annotated_text());
    match pass {
        "recompute" => {
            if let Some(r) = &state.recompute {
                s.push_str(&r.text());
            }
        }
        "weight-versioning" => {
            if let Some(v) = &state.versions {
                s.push_str(&v.text());
            }
        }
        _ => {}
    }
    state.printed.push_str(&s);
}

/// Options of the standard compile pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    /// Device for the cost model of the partitioned graph.
    pub device: Roofline,
    pub recompute: Recompute,
    /// Per-stage stash limit in bytes per microbatch (selective recomputation).
    pub memory_limit: Option<u64>,
    /// Microbatch size `b` the recomputation figures are costed at.
    pub microbatch: u64,
    pub schedule: Schedule,
    /// Microbatches per batch `m`; `None` uses the depth `d` (the least 2BW allows).
    pub microbatches: Option<u32>,
    pub print_after: PrintAfter,
    pub stop_after: Option<String>,
    /// Verify after each pass (default `cfg!(debug_assertions)`).
    pub verify: bool,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            device: Roofline::default(),
            recompute: Recompute::Full,
            memory_limit: None,
            microbatch: 1,
            schedule: Schedule::TwoBw,
            microbatches: None,
            print_after: PrintAfter::None,
            stop_after: None,
            verify: cfg!(debug_assertions),
        }
    }
}

/// The names of the standard pipeline, in order.
pub const STANDARD_PASSES: [&str; 6] = [
    "import",
    "shape-inference",
    "partition",
    "recompute",
    "weight-versioning",
    "lower",
];

fn missing(what: &str, pass: &str) -> BoxError {
    format!("{pass} needs {what}, which no earlier pass produced").into()
}

/// The standard pipeline (see the module docs) configured by `opts`; `lower` is a no-op
/// to [`PassManager::replace`].
pub fn standard_passes(opts: &CompileOptions) -> PassManager<'static> {
    let device = opts.device.clone();
    let (mode, limit, b) = (opts.recompute, opts.memory_limit, opts.microbatch);
    let (schedule, m) = (opts.schedule, opts.microbatches);
    PassManager::new()
        // Done by the importer: the state starts with the imported, shape-inferred graph.
        .add("import", |_| Ok(()))
        .add("shape-inference", |_| Ok(()))
        .add("partition", move |st| {
            let input = st
                .input_stages
                .as_ref()
                .ok_or_else(|| missing("a stage assignment", "partition"))?;
            let table = insert_stage_boundaries(&mut st.graph, input)?;
            st.cost = Some(CostModel::new(&st.graph, device.clone())?);
            st.stages = Some(table);
            st.recompute = None;
            st.versions = None;
            Ok(())
        })
        .add("recompute", move |st| {
            let stages = st
                .stages
                .as_ref()
                .ok_or_else(|| missing("stages", "recompute"))?;
            let cost = st
                .cost
                .as_ref()
                .ok_or_else(|| missing("a cost model", "recompute"))?;
            st.recompute = Some(decide_recomputation(
                &st.graph, stages, cost, mode, limit, b,
            ));
            Ok(())
        })
        .add("weight-versioning", move |st| {
            let stages = st
                .stages
                .as_ref()
                .ok_or_else(|| missing("stages", "weight-versioning"))?;
            let d = stages.num_stages;
            st.versions = Some(version_weights(
                &st.graph,
                stages,
                schedule,
                d,
                m.unwrap_or(d),
            )?);
            Ok(())
        })
        .add("lower", |_| Ok(()))
}

/// Runs the standard pipeline on the imported `graph` with `stages` (from
/// `planner::Plan::stage_map()` or a fixed split of the imported graph's nodes). The
/// returned state holds the partitioned graph, its stage table, cost model, recompute plan,
/// weight versions, the text `print_after` asked for and the timings.
pub fn compile_passes(
    graph: Graph,
    stages: StageMap,
    opts: &CompileOptions,
) -> Result<PipelineState, ManagerError> {
    let mut state = PipelineState::with_stages(graph, stages);
    let run = RunOptions {
        print_after: opts.print_after.clone(),
        stop_after: opts.stop_after.clone(),
        verify: opts.verify,
    };
    standard_passes(opts).run(&mut state, &run)?;
    Ok(state)
}
