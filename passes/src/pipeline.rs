//! The passes of `pipewright compile` up to lowering, as typed steps over one compilation:
//!
//! `import` ([`import`]) → [`Imported`] → `plan` ([`plan_stages`]) → [`Planned`] →
//! `partition` ([`partition`]) → [`Partitioned`] → `recompute` ([`recompute`]) →
//! [`Recomputed`] → `weight-versioning` ([`version`]) → [`Versioned`], which codegen lowers.
//!
//! Each state owns the graph and keeps every earlier analysis beside it (the IR is never
//! annotated in place); each prints itself for `--print-after` and checks itself with the
//! verifier. The plan pass also records the [`Decision`]: the pipeline values that were
//! actually decided (by a plan, a search, or the user), which the build manifest carries to
//! `train`.

use std::path::{Path, PathBuf};

use pipewright_core::{Decision, Placement, Recompute, Schedule};
use pipewright_ir::text::{print_graph, print_graph_annotated};
use pipewright_ir::{import_model, verify, verify_stages, Graph, ImportOptions, ModelError, NodeId, StageMap};

use crate::boundaries::{insert_stage_boundaries, BoundaryError};
use crate::cluster::Cluster;
use crate::cost::{CostError, CostModel};
use crate::manager::PassOutput;
use crate::plan_file::{PlanFile, PlanFileError};
use crate::planner::{plan, Plan, PlanError, PlanOptions};
use crate::profile::Profile;
use crate::recompute::{decide_recomputation, RecomputePlan};
use crate::versioning::{version_weights, VersionError, WeightVersions};

/// The imported graph.
#[derive(Clone, Debug)]
pub struct Imported {
    pub graph: Graph,
}

/// The `import` pass: read, convert, infer shapes, fold constants, verify.
pub fn import(model: &Path, opts: &ImportOptions) -> Result<Imported, ModelError> {
    Ok(Imported { graph: import_model(model, opts)? })
}

/// What the plan pass is asked to do.
#[derive(Clone, Debug)]
pub enum PlanRequest {
    /// Search depth, width, microbatch, recomputation and schedule on a cluster.
    Search { cluster: Cluster, options: PlanOptions, profile: Option<Profile> },
    /// Use a plan file from `pipewright plan --json`, field for field.
    File { path: PathBuf, file: Box<PlanFile> },
    /// A fixed depth without a cluster: only the stage cuts are chosen (balancing the
    /// predicted compute time at microbatch `microbatch`, or 1); the rest is as given.
    Stages { depth: u32, schedule: Schedule, recompute: Recompute, microbatch: Option<u64>, microbatches: Option<u64>, placement: Placement },
}

/// Why the plan pass failed.
#[derive(Debug, thiserror::Error)]
pub enum PlanPassError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    File(#[from] PlanFileError),
    #[error(transparent)]
    Cost(#[from] CostError),
}

/// The graph with its plan.
#[derive(Clone, Debug)]
pub struct Planned {
    pub graph: Graph,
    pub cost: CostModel,
    pub plan: Plan,
    pub decision: Decision,
}

/// The `plan` pass.
pub fn plan_stages(imported: Imported, request: &PlanRequest) -> Result<Planned, PlanPassError> {
    let graph = imported.graph;
    let (plan, decision) = match request {
        PlanRequest::Search { cluster, options, profile } => {
            let mut cost = CostModel::new(&graph, cluster.roofline())?;
            if let Some(p) = profile {
                cost.apply_profile(&graph, p)?;
            }
            let plan = plan(&graph, &cost, cluster, options)?;
            let decision = decided_by(&plan, format!("planned for {}", cluster.summary()));
            (plan, decision)
        }
        PlanRequest::File { path, file } => {
            let plan = file.as_ref().clone().into_plan_for(&graph, path)?;
            let decision = decided_by(&plan, format!("plan {}", path.display()));
            (plan, decision)
        }
        &PlanRequest::Stages { depth, schedule, recompute, microbatch, microbatches, placement } => {
            // Only the cuts are searched for: every worker is a stage and memory is not
            // limited (no cluster was described).
            let workers = depth.max(1) as usize;
            let cluster = Cluster { workers, workers_per_node: workers, memory_per_worker: u64::MAX, ..Cluster::default() };
            let b = microbatch.unwrap_or(1);
            if schedule.virtual_stages() > 1 {
                // Interleaved: the depth and the microbatches must divide among the
                // workers, or the build could never train.
                let m = microbatches.unwrap_or_else(|| Decision::default_microbatches(depth));
                pipewright_core::schedule::stage_ops(schedule, 0, depth as usize, m as usize, 1).map_err(PlanError::Options)?;
            }
            // 2BW needs at least d microbatches in flight.
            let m = microbatches.unwrap_or_else(|| Decision::default_microbatches(depth)).max(u64::from(depth));
            let options = PlanOptions {
                global_batch: b * m,
                schedules: vec![schedule],
                stages: Some(depth as usize),
                microbatch: Some(b),
                recompute: Some(recompute),
                top: 1,
                ..PlanOptions::default()
            };
            let cost = CostModel::new(&graph, cluster.roofline())?;
            let plan = plan(&graph, &cost, &cluster, &options)?;
            let decision = Decision { depth, schedule, recompute, microbatch, microbatches, replicas: None, placement, origin: format!("compile --stages {depth}") };
            (plan, decision)
        }
    };
    let cost = CostModel::new(&graph, plan.cluster.roofline())?;
    Ok(Planned { graph, cost, plan, decision })
}

fn decided_by(plan: &Plan, origin: String) -> Decision {
    let c = &plan.chosen;
    Decision {
        depth: u32::try_from(c.d).unwrap_or(u32::MAX),
        schedule: c.schedule,
        recompute: c.recompute,
        microbatch: Some(c.b),
        microbatches: Some(c.m),
        replicas: Some(c.w as u64),
        placement: c.placement,
        origin,
    }
}

/// The graph cut into stages, with explicit `StageBoundary` nodes.
#[derive(Clone, Debug)]
pub struct Partitioned {
    pub graph: Graph,
    /// The cost model of the partitioned graph.
    pub cost: CostModel,
    pub plan: Plan,
    pub decision: Decision,
    pub stages: StageMap,
}

/// Why the partition pass failed.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error(transparent)]
    Boundaries(#[from] BoundaryError),
    #[error(transparent)]
    Cost(#[from] CostError),
}

/// The `partition` pass: assigns every node its planned stage and inserts the stage
/// boundaries.
pub fn partition(planned: Planned) -> Result<Partitioned, PartitionError> {
    let Planned { mut graph, plan, decision, .. } = planned;
    let stages = insert_stage_boundaries(&mut graph, &plan.stage_map())?;
    let cost = CostModel::new(&graph, plan.cluster.roofline())?;
    Ok(Partitioned { graph, cost, plan, decision, stages })
}

/// The partitioned graph with its stash/recompute decisions.
#[derive(Clone, Debug)]
pub struct Recomputed {
    pub partitioned: Partitioned,
    pub recompute: RecomputePlan,
}

/// The microbatch the analyses are costed at: the decided one, else the plan's.
fn costed_microbatch(p: &Partitioned) -> u64 {
    p.decision.microbatch.unwrap_or(p.plan.chosen.b)
}

/// The `recompute` pass.
pub fn recompute(partitioned: Partitioned) -> Result<Recomputed, std::convert::Infallible> {
    let p = &partitioned;
    let recompute = decide_recomputation(&p.graph, &p.stages, &p.cost, p.decision.recompute, None, costed_microbatch(p));
    Ok(Recomputed { partitioned, recompute })
}

/// Everything the passes decided, ready for lowering.
#[derive(Clone, Debug)]
pub struct Versioned {
    pub partitioned: Partitioned,
    pub recompute: RecomputePlan,
    pub versions: WeightVersions,
}

/// The `weight-versioning` pass, for `m` = the decided microbatches (or `d`).
pub fn version(recomputed: Recomputed) -> Result<Versioned, VersionError> {
    let Recomputed { partitioned, recompute } = recomputed;
    let d = partitioned.stages.num_stages;
    let m = u32::try_from(partitioned.decision.microbatches_or_default()).unwrap_or(u32::MAX);
    let versions = version_weights(&partitioned.graph, &partitioned.stages, partitioned.decision.schedule, d, m)?;
    Ok(Versioned { partitioned, recompute, versions })
}

/// The IR annotated with what the passes so far decided per node:
/// `stage=1 recompute w:%v3 x2 (2bw)`.
pub fn annotated_text(g: &Graph, stages: &StageMap, recompute: Option<&RecomputePlan>, versions: Option<&WeightVersions>) -> String {
    let note = |n: NodeId| {
        let parts: Vec<String> = [stages.get(n).map(|s| format!("stage={s}")), recompute.and_then(|r| r.note(n)), versions.and_then(|v| v.note(n))]
            .into_iter()
            .flatten()
            .collect();
        (!parts.is_empty()).then(|| parts.join(" "))
    };
    print_graph_annotated(g, note)
}

fn check_graph(g: &Graph, stages: Option<&StageMap>) -> Result<(), Vec<String>> {
    let strings = |errors: Vec<pipewright_ir::VerifyError>| errors.iter().map(|e| e.to_string()).collect::<Vec<_>>();
    verify(g).map_err(strings)?;
    if let Some(s) = stages {
        verify_stages(g, s).map_err(strings)?;
    }
    Ok(())
}

impl PassOutput for Imported {
    fn text(&self) -> String {
        print_graph(&self.graph)
    }
    fn check(&self) -> Result<(), Vec<String>> {
        check_graph(&self.graph, None)
    }
}

impl PassOutput for Planned {
    fn text(&self) -> String {
        format!("{}decided: {}\n", self.plan.text(), self.decision.text())
    }
    fn check(&self) -> Result<(), Vec<String>> {
        let map = self.plan.stage_map();
        let unassigned = self.graph.node_ids().filter(|&n| map.get(n).is_none()).count();
        if unassigned > 0 {
            return Err(vec![format!("{unassigned} nodes have no stage in the plan")]);
        }
        Ok(())
    }
}

impl PassOutput for Partitioned {
    fn text(&self) -> String {
        annotated_text(&self.graph, &self.stages, None, None)
    }
    fn check(&self) -> Result<(), Vec<String>> {
        check_graph(&self.graph, Some(&self.stages))
    }
}

impl PassOutput for Recomputed {
    fn text(&self) -> String {
        let p = &self.partitioned;
        annotated_text(&p.graph, &p.stages, Some(&self.recompute), None) + &self.recompute.text()
    }
    fn check(&self) -> Result<(), Vec<String>> {
        self.partitioned.check()
    }
}

impl PassOutput for Versioned {
    fn text(&self) -> String {
        let p = &self.partitioned;
        annotated_text(&p.graph, &p.stages, Some(&self.recompute), Some(&self.versions)) + &self.versions.text()
    }
    fn check(&self) -> Result<(), Vec<String>> {
        self.partitioned.check()
    }
}
