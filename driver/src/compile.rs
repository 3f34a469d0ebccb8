//! `pipewright plan` and `pipewright compile`: the pass pipeline from an ONNX file to a
//! plan, or to a build folder.
//!
//! Both run the same passes through one [`PassManager`] (`import` → `plan` → `partition`
//! → `recompute` → `weight-versioning` → `lower`; `plan` stops after `plan`, or after
//! `partition` when asked to print it), so `--print-after`, `--stop-after` and the timings
//! cover every pass, the planner included.

use std::path::{Path, PathBuf};

use pipewright_codegen::build::{lower, write_build, WriteTimes};
use pipewright_core::PassName;
use pipewright_ir::ImportOptions;
use pipewright_passes::manager::{ManagerError, PassManager, PassOptions, PrintAfter};
use pipewright_passes::pipeline::{import, partition, plan_stages, recompute, version, Decision, PlanRequest};
use pipewright_passes::plan_file::PlanFile;
use pipewright_runtime::build::Manifest;

use crate::DriverError;

/// What `pipewright compile` is asked to do.
#[derive(Clone, Debug)]
pub struct CompileRequest {
    pub model: PathBuf,
    pub plan: PlanRequest,
    /// The build folder.
    pub output: PathBuf,
    /// The pipewright binary to copy into stage executables, when they are wanted.
    pub executable: Option<PathBuf>,
    pub passes: PassOptions,
}

/// What a compile did.
#[derive(Debug)]
pub struct Compiled {
    /// What `--print-after` asked for.
    pub printed: String,
    /// Each pass's wall time, as text.
    pub pass_timings: String,
    /// What was decided (`None` when stopped before the plan pass finished).
    pub decision: Option<Decision>,
    /// The build written (`None` when `--stop-after` stopped before `lower`).
    pub written: Option<(Manifest, WriteTimes)>,
}

fn pass_error(model: &Path) -> impl Fn(ManagerError) -> DriverError + '_ {
    move |source| DriverError::Pass { model: model.to_path_buf(), source }
}

/// Runs every pass and writes the build folder.
pub fn compile(req: &CompileRequest) -> Result<Compiled, DriverError> {
    let model = &req.model;
    let fail = pass_error(model);
    let mut pm = PassManager::new(req.passes.clone());
    let mut decision = None;
    let mut written = None;
    let lowered = (|| {
        let Some(imported) = pm.run(PassName::Import, (), |()| import(model, &ImportOptions::default()))? else { return Ok(None) };
        let Some(planned) = pm.run(PassName::Plan, imported, |g| plan_stages(g, &req.plan))? else { return Ok(None) };
        decision = Some(planned.decision.clone());
        let Some(partitioned) = pm.run(PassName::Partition, planned, partition)? else { return Ok(None) };
        let Some(recomputed) = pm.run(PassName::Recompute, partitioned, recompute)? else { return Ok(None) };
        let Some(versioned) = pm.run(PassName::WeightVersioning, recomputed, version)? else { return Ok(None) };
        pm.run(PassName::Lower, versioned, lower)
    })()
    .map_err(&fail)?;
    if let Some(lowered) = lowered {
        written = Some(write_build(&lowered, model, &req.output, req.executable.as_deref())?);
    }
    Ok(Compiled { printed: pm.printed().to_string(), pass_timings: pm.timings_text(), decision, written })
}

/// What `pipewright plan` gives back.
#[derive(Debug)]
pub struct Planned {
    /// The plan with the model and cluster it was made for (`plan --json` prints it);
    /// `None` when `--stop-after import` stopped before planning.
    pub file: Option<PlanFile>,
    pub printed: String,
}

/// Runs `import` and `plan` (and `partition`, when `--print-after` or `--stop-after`
/// names it) for `pipewright plan`.
pub fn plan(model: &Path, request: &PlanRequest, passes: &PassOptions) -> Result<Planned, DriverError> {
    let fail = pass_error(model);
    let mut pm = PassManager::new(passes.clone());
    pm.expect(&[PassName::Import, PassName::Plan, PassName::Partition]).map_err(&fail)?;
    let wants_partition = passes.print_after == PrintAfter::Pass(PassName::Partition) || passes.stop_after == Some(PassName::Partition);
    let mut file = None;
    (|| {
        let Some(imported) = pm.run(PassName::Import, (), |()| import(model, &ImportOptions::default()))? else { return Ok(()) };
        let crc = imported.graph.meta.source_crc32;
        let Some(planned) = pm.run(PassName::Plan, imported, |g| plan_stages(g, request))? else { return Ok(()) };
        file = Some(PlanFile::new(planned.plan.clone(), model, crc));
        if wants_partition {
            pm.run(PassName::Partition, planned, partition)?;
        }
        Ok(())
    })()
    .map_err(&fail)?;
    Ok(Planned { file, printed: pm.printed().to_string() })
}
