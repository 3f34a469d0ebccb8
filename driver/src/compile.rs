//! `pipewright plan` and `pipewright compile`: the pass pipeline from an ONNX file to a
//! plan, or to a build folder.
//!
//! Both run the same passes through one [`PassManager`] (`import` → `plan` → `partition`
//! → `recompute` → `weight-versioning` → `lower`; `plan` stops after `plan`, or after
//! `partition` when asked to print it), so `--print-after`, `--stop-after` and the timings
//! cover every pass, the planner included.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pipewright_codegen::build::{lower, write_build, BuildOutputs, WriteTimes};
use pipewright_core::PassName;
use pipewright_ir::ImportOptions;
use pipewright_core::PrintAfter;
use pipewright_passes::manager::{ManagerError, PassManager, PassOptions};
use pipewright_core::Decision;
use pipewright_passes::pipeline::{import, partition, plan_stages, recompute, version, PlanRequest};
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
    /// Also write each stage's forward subgraph as ONNX.
    pub stage_onnx: bool,
    pub passes: PassOptions,
    /// How the model is imported (the batch axis, untying merged initializers).
    pub import: ImportOptions,
}

/// What a compile did.
#[derive(Debug)]
pub struct Compiled {
    /// What `--print-after` asked for.
    pub printed: String,
    /// Each pass's wall time, as text.
    pub pass_timings: String,
    /// Each pass's wall time.
    pub pass_times: Vec<(PassName, Duration)>,
    /// What was decided (`None` when stopped before the plan pass finished).
    pub decision: Option<Decision>,
    /// The build written (`None` when `--stop-after` stopped before `lower`).
    pub written: Option<(Manifest, WriteTimes)>,
    /// What import decided about initializers (`None` when import did not finish).
    pub choices: Option<pipewright_core::ImportChoices>,
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
    let mut choices = None;
    let lowered = (|| {
        let Some(imported) = pm.run(PassName::Import, (), |()| import(model, &req.import))? else { return Ok(None) };
        choices = Some(imported.graph.choices.clone());
        let Some(planned) = pm.run(PassName::Plan, imported, |g| plan_stages(g, &req.plan))? else { return Ok(None) };
        decision = Some(planned.decision.clone());
        let Some(partitioned) = pm.run(PassName::Partition, planned, partition)? else { return Ok(None) };
        let Some(recomputed) = pm.run(PassName::Recompute, partitioned, recompute)? else { return Ok(None) };
        let Some(versioned) = pm.run(PassName::WeightVersioning, recomputed, version)? else { return Ok(None) };
        pm.run(PassName::Lower, versioned, lower)
    })()
    .map_err(&fail)?;
    if let Some(lowered) = lowered {
        refuse_batch_drop(&lowered.versioned.partitioned.graph, model)?;
        #[cfg(feature = "torch")]
        if let Some(b) = lowered.versioned.partitioned.graph.batch.as_ref().and_then(|b| b.export_size) {
            crate::batch_check::check_other_batch(&lowered, model, b)?;
        }
        let outputs = BuildOutputs { executable: req.executable.as_deref(), stage_onnx: req.stage_onnx };
        written = Some(write_build(&lowered, model, &req.output, outputs)?);
    }
    Ok(Compiled { printed: pm.printed().to_string(), pass_timings: pm.timings_text(), pass_times: pm.timings().to_vec(), decision, written, choices })
}

/// A fixed-batch export whose output is computed at the export batch whatever the batch
/// ([`pipewright_ir::batch_drop`]) would train at no other microbatch: refused, naming the
/// node that drops the batch.
fn refuse_batch_drop(g: &pipewright_ir::Graph, model: &Path) -> Result<(), DriverError> {
    let Some(drop) = pipewright_ir::batch_drop::batch_drop(g) else { return Ok(()) };
    let node = g.node(drop.node);
    let export_batch = g.batch.as_ref().and_then(|b| b.export_size).unwrap_or(1);
    let typed = |v: Option<&pipewright_ir::ValueId>| v.map(|&v| g.value(v).ty.to_string()).unwrap_or_default();
    Err(DriverError::msg(format!(
        "{}: node {:?} ({}) drops the batch: it reads {} and writes {}, at the export batch {export_batch} whatever the batch is, so the model's output {:?} is {} at every batch. The exporter wrote this step with constants of the batch it exported at; export the model with a dynamic batch axis (torch.onnx.export(..., dynamic_shapes=...) with dynamo=True, or dynamic_axes with dynamo=False) and compile that",
        model.display(),
        node.name,
        node.op.name(),
        typed(node.inputs.iter().flatten().find(|v| g.value(**v).ty.shape.has_batch())),
        typed(node.outputs.iter().flatten().next()),
        g.value(drop.output).name,
        g.value(drop.output).ty
    )))
}

impl Compiled {
    /// `compile --timings`: every pass, then every kind of file written, then one total of
    /// all of them (split into passes and writing), so the lines add up to the total.
    pub fn timings_text(&self) -> String {
        let mut rows: Vec<(String, Duration)> = self.pass_times.iter().map(|(n, t)| (n.name().to_string(), *t)).collect();
        let passes: Duration = rows.iter().map(|r| r.1).sum();
        if let Some((_, w)) = &self.written {
            // Files not asked for take no time and get no line.
            let files = [("write stage modules", w.modules), ("write stage ONNX", w.onnx), ("write executables", w.executables), ("write manifest", w.manifest)];
            for (name, t) in files {
                if !t.is_zero() {
                    rows.push((name.to_string(), t));
                }
            }
        }
        let total: Duration = rows.iter().map(|r| r.1).sum();
        let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(5);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut s = String::new();
        for (name, t) in &rows {
            s.push_str(&format!("  {name:<width$}  {:>10.3} ms\n", ms(*t)));
        }
        s.push_str(&format!("  {:<width$}  {:>10.3} ms (passes {:.3} ms + writing {:.3} ms)\n", "total", ms(total), ms(passes), ms(total - passes)));
        s
    }
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
        // Planning needs shapes, not values: large external-data weights stay unread.
        let shapes_only = ImportOptions { shapes_only: true, ..ImportOptions::default() };
        let Some(imported) = pm.run(PassName::Import, (), |()| import(model, &shapes_only))? else { return Ok(()) };
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pipewright_core::{Recompute, Schedule};

    pub(crate) fn model(name: &str) -> PathBuf {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models").join(name);
        assert!(p.is_file(), "the shared corpus is missing: expected {}", p.display());
        p
    }

    pub(crate) fn stages(depth: u32) -> PlanRequest {
        PlanRequest::Stages { depth, schedule: Schedule::TwoBw, recompute: Recompute::Full, microbatch: Some(4), microbatches: None, placement: pipewright_core::Placement::StageMajor }
    }

    pub(crate) fn request(name: &str, plan: PlanRequest, output: &Path) -> CompileRequest {
        CompileRequest { model: model(name), plan, output: output.to_path_buf(), executable: None, stage_onnx: false, passes: PassOptions::default(), import: ImportOptions::default() }
    }

    #[test]
    fn compiles_a_build_folder_recording_only_what_was_decided() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("build");
        let c = compile(&request("mlp.onnx", stages(2), &out)).unwrap();
        let (manifest, _) = c.written.expect("written");
        let p = &manifest.pipeline;
        assert_eq!((p.depth, p.schedule, p.recompute), (2, Schedule::TwoBw, Recompute::Full));
        assert_eq!((p.microbatch, p.microbatches, p.replicas), (Some(4), None, None));
        assert_eq!(p.origin, "compile --stages 2");
        assert_eq!(Manifest::read(&out).unwrap(), manifest, "the manifest on disk is the one returned");
        let mut files: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        files.sort();
        assert_eq!(files, ["pipeline.toml", "stage0.pwm", "stage1.pwm"], "stage ONNX only on request");
        assert!(c.pass_timings.contains("weight-versioning") && c.pass_timings.contains("lower"), "{}", c.pass_timings);
    }

    #[test]
    fn stop_after_writes_nothing_and_print_after_shows_the_pass() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("build");
        let mut req = request("mlp.onnx", stages(2), &out);
        req.passes = PassOptions { print_after: PrintAfter::Pass(PassName::Plan), stop_after: Some(PassName::Partition), ..PassOptions::default() };
        let c = compile(&req).unwrap();
        assert!(c.written.is_none() && !out.exists());
        assert!(c.printed.starts_with("// ----- after plan -----\n") && c.printed.contains("decided: d=2"), "{}", c.printed);
        assert!(!c.pass_timings.contains("recompute"), "{}", c.pass_timings);
    }

    #[test]
    fn a_plan_round_trips_into_the_build() {
        let dir = tempfile::tempdir().unwrap();
        let search = PlanRequest::Search {
            cluster: pipewright_passes::cluster::Cluster { workers: 4, workers_per_node: 2, ..Default::default() },
            options: pipewright_passes::planner::PlanOptions { global_batch: 32, stages: Some(2), placement: Some(pipewright_core::Placement::ReplicaMajor), ..Default::default() },
            profile: None,
        };
        let planned = plan(&model("gpt2-tiny.onnx"), &search, &PassOptions::default()).unwrap();
        let file = planned.file.expect("planned");
        let path = dir.path().join("plan.json");
        std::fs::write(&path, file.to_json()).unwrap();
        let read = PlanFile::read(&path).unwrap();
        assert_eq!(read.plan.chosen, file.plan.chosen);
        let out = dir.path().join("build");
        let c = compile(&request("gpt2-tiny.onnx", PlanRequest::File { path: path.clone(), file: Box::new(read) }, &out)).unwrap();
        let p = c.written.unwrap().0.pipeline;
        let chosen = &file.plan.chosen;
        assert_eq!((p.depth as usize, p.schedule, p.recompute), (chosen.d, chosen.schedule, chosen.recompute));
        assert_eq!((p.microbatch, p.microbatches, p.replicas), (Some(chosen.b), Some(chosen.m), Some(chosen.w as u64)));
        // The placement the plan chose numbers the build's MPI ranks.
        assert_eq!((chosen.placement, p.placement), (pipewright_core::Placement::ReplicaMajor, pipewright_core::Placement::ReplicaMajor));
        assert!(p.text().contains("placement=replica-major"), "{}", p.text());
        // The same plan for another model is refused, naming both.
        let other = PlanRequest::File { path: path.clone(), file: Box::new(PlanFile::read(&path).unwrap()) };
        let e = compile(&request("mlp.onnx", other, &dir.path().join("b2"))).unwrap_err().to_string();
        assert!(e.contains("planned for model") && e.contains("gpt2-tiny.onnx"), "{e}");
    }
}
