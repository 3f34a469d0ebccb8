//! The `lower` pass and the build folder it becomes.
//!
//! [`lower`] slices the analysed graph into its stages and lowers each (in parallel) to a
//! stage program carrying the passes' decisions (recompute segments, weight versions and
//! update rules, tied-weight sync groups) and the compile's pipeline id.
//! [`write_build`] writes the build folder: one stage module per stage (in parallel,
//! streamed from the programs), on request each stage's forward subgraph as ONNX and stage
//! executables, and `pipeline.toml` (the runtime's [`Manifest`]) last, so a folder with a
//! manifest is complete. Every file is written atomically.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::fs::File;
use std::io::{BufWriter, Write};

use pipewright_core::fs::{write_atomic, write_atomic_with, WriteError};
use pipewright_passes::manager::PassOutput;
use pipewright_core::Decision;
use pipewright_passes::pipeline::Versioned;
use pipewright_runtime::build::{BuildError, Manifest, StageEntry, TensorEntry, BUILD_FORMAT, BUILD_VERSION};
use pipewright_runtime::exe::{trailer, without_module};
use pipewright_runtime::listing::program_text;
use pipewright_runtime::module::{encode_parts, EncodedModule, ModuleError, ModuleErrorKind, StageParams};
use rayon::prelude::{IntoParallelRefIterator, ParallelIterator};

use crate::onnx_export::{export_stage_bytes, ExportError};
use crate::stage::{lower_slice_annotated, slice_stages, Annotations, BoundaryTensor, StageProgram, StageSlice, StageTensor};
use crate::LowerError;

/// The lowered stages, beside everything the passes decided.
pub struct Lowered {
    pub versioned: Versioned,
    pub slices: Vec<StageSlice>,
    pub stages: Vec<StageProgram>,
    /// The id every stage of this compile carries.
    pub pipeline_id: String,
}

/// The `lower` pass.
pub fn lower(versioned: Versioned) -> Result<Lowered, LowerError> {
    let p = &versioned.partitioned;
    let slices = slice_stages(&p.graph, &p.stages)?;
    let pipeline_id = pipeline_id(p.graph.meta.source_crc32, &p.decision, &slices);
    let annotations = Annotations { recompute: Some(&versioned.recompute), versions: Some(&versioned.versions) };
    let mut stages = slices.par_iter().map(|s| lower_slice_annotated(&p.graph, s, &annotations)).collect::<Result<Vec<_>, _>>()?;
    for sp in &mut stages {
        sp.program.pipeline = pipeline_id.clone();
    }
    Ok(Lowered { versioned, slices, stages, pipeline_id })
}

impl PassOutput for Lowered {
    fn text(&self) -> String {
        let marks = self.versioned.partitioned.decision.recompute != pipewright_core::Recompute::None;
        self.stages.iter().map(|sp| format!("stage {} (pipeline {}):\n{}", sp.stage, self.pipeline_id, program_text(&sp.program, marks))).collect()
    }
}

/// The id every stage of one compile carries: a CRC-32 of the source model's bytes joined
/// with a hash of the depth, schedule, recomputation and node-to-stage assignment. The same
/// compile run twice (anywhere) gives the same id and byte-identical modules; another
/// model, other weights or another partition give another, so stages of different compiles
/// are never mixed.
pub fn pipeline_id(model_crc32: u32, decision: &Decision, slices: &[StageSlice]) -> String {
    // FNV-1a: stable across builds and Rust versions, unlike std's DefaultHasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(format!("{}|{:?}|{:?}", slices.len(), decision.schedule, decision.recompute).as_bytes());
    for s in slices {
        feed(&s.stage.to_le_bytes());
        for n in &s.nodes {
            feed(&(n.index() as u64).to_le_bytes());
        }
    }
    format!("{model_crc32:08x}{:08x}", (h >> 32) as u32 ^ h as u32)
}

/// Writing a build folder failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteBuildError {
    #[error("{}: cannot create the build folder: {source}", .path.display())]
    Folder { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Module(#[from] ModuleError),
    #[error("stage {stage}: ONNX export: {source}")]
    Onnx { stage: u32, source: ExportError },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Manifest(#[from] BuildError),
    #[error("{}: cannot read the pipewright binary to make stage executables: {source}", .path.display())]
    Binary { path: PathBuf, source: std::io::Error },
}

/// Time spent writing, for `--timings`.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteTimes {
    pub modules: Duration,
    pub onnx: Duration,
    pub executables: Duration,
    /// Building and writing `pipeline.toml`.
    pub manifest: Duration,
}

/// What a build folder holds besides the stage modules and the manifest.
#[derive(Clone, Copy, Debug, Default)]
pub struct BuildOutputs<'a> {
    /// The pipewright binary: also write `stageK`, that binary with stage K's module
    /// appended.
    pub executable: Option<&'a Path>,
    /// Also write each stage's forward subgraph as ONNX (`stageK.onnx`, a second copy of
    /// the weights).
    pub stage_onnx: bool,
}

/// Module writers for builds of many stages (see `write_build`).
const IO_WRITERS: usize = 16;

/// Writes the build folder `out` for `lowered`, whose source model is `model`. Modules are
/// streamed from the lowered programs, so writing needs no copy of the weights.
pub fn write_build(lowered: &Lowered, model: &Path, out: &Path, outputs: BuildOutputs<'_>) -> Result<(Manifest, WriteTimes), WriteBuildError> {
    std::fs::create_dir_all(out).map_err(|source| WriteBuildError::Folder { path: out.to_path_buf(), source })?;
    let p = &lowered.versioned.partitioned;
    let d = &p.decision;
    let depth = lowered.stages.len() as u32;
    let mut times = WriteTimes::default();

    let t = Instant::now();
    let write_modules = || {
        lowered
            .stages
            .par_iter()
            .map(|sp| {
                let params = StageParams { stage: sp.stage, depth, schedule: d.schedule, recompute: d.recompute };
                let path = out.join(module_name(sp.stage));
                let module = encode_parts(&params, &sp.program).map_err(|e| e.at(&path))?;
                write_atomic_with(&path, |f| write_buffered(f, |w| module.write_to(w)))
                    .map_err(|e| ModuleError::new(ModuleErrorKind::Io { op: e.op, source: e.source }).at(&path))?;
                Ok::<_, ModuleError>(module)
            })
            .collect::<Result<Vec<EncodedModule<'_>>, _>>()
    };
    // Each module is flushed to disk before its rename; with thousands of stages the
    // writers mostly wait on those flushes, so more of them than cores overlap the waits.
    let modules = match rayon::ThreadPoolBuilder::new().num_threads(IO_WRITERS.max(rayon::current_num_threads())).build() {
        Ok(pool) if lowered.stages.len() > IO_WRITERS => pool.install(write_modules)?,
        _ => write_modules()?,
    };
    times.modules = t.elapsed();

    if outputs.stage_onnx {
        let t = Instant::now();
        lowered.slices.par_iter().try_for_each(|slice| {
            let onnx = export_stage_bytes(&p.graph, slice).map_err(|source| WriteBuildError::Onnx { stage: slice.stage, source })?;
            write_atomic(out.join(onnx_name(slice.stage)), &onnx)?;
            Ok::<_, WriteBuildError>(())
        })?;
        times.onnx = t.elapsed();
    }

    if let Some(binary) = outputs.executable {
        let t = Instant::now();
        let bytes = std::fs::read(binary).map_err(|source| WriteBuildError::Binary { path: binary.to_path_buf(), source })?;
        for (k, module) in modules.iter().enumerate() {
            write_executable(&out.join(format!("stage{k}")), without_module(&bytes), module)?;
        }
        times.executables = t.elapsed();
    }

    let t = Instant::now();
    let manifest = manifest(lowered, model, outputs.stage_onnx);
    manifest.write(out)?;
    times.manifest = t.elapsed();
    Ok((manifest, times))
}

/// Runs `fill` on a buffered writer over `file` and flushes it.
fn write_buffered(file: &mut File, fill: impl FnOnce(&mut BufWriter<&mut File>) -> std::io::Result<()>) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, file);
    fill(&mut w)?;
    w.flush()
}

fn module_name(stage: u32) -> String {
    format!("stage{stage}.pwm")
}

fn onnx_name(stage: u32) -> String {
    format!("stage{stage}.onnx")
}

fn write_executable(path: &Path, binary: &[u8], module: &EncodedModule<'_>) -> Result<(), WriteError> {
    write_atomic_with(path, |f| {
        write_buffered(f, |w| {
            w.write_all(binary)?;
            module.write_to(w)?;
            w.write_all(&trailer(module.len()))
        })
    })?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|source| WriteError { path: path.to_path_buf(), op: "make it executable", source })?;
    }
    Ok(())
}

/// The manifest of a lowered compile.
fn manifest(lowered: &Lowered, model: &Path, stage_onnx: bool) -> Manifest {
    let p = &lowered.versioned.partitioned;
    let d = &p.decision;
    let boundary = |t: &BoundaryTensor| TensorEntry { name: t.name.clone(), value: Some(t.value.clone()), peer: Some(t.peer), dtype: t.elem, shape: t.shape.clone() };
    let tensor = |t: &StageTensor| TensorEntry { name: t.name.clone(), value: None, peer: None, dtype: t.elem, shape: t.shape.clone() };
    let stages = lowered
        .stages
        .iter()
        .zip(&lowered.slices)
        .map(|(sp, slice)| StageEntry {
            index: sp.stage,
            module: module_name(sp.stage),
            onnx: stage_onnx.then(|| onnx_name(sp.stage)),
            nodes: slice.nodes.len(),
            received: sp.received.iter().map(boundary).collect(),
            sent: sp.sent.iter().map(boundary).collect(),
            graph_inputs: sp.graph_inputs.iter().map(tensor).collect(),
            graph_outputs: sp.graph_outputs.iter().map(tensor).collect(),
        })
        .collect();
    Manifest {
        format: BUILD_FORMAT.into(),
        version: BUILD_VERSION,
        model: std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf()).display().to_string(),
        model_crc32: format!("{:08x}", p.graph.meta.source_crc32),
        pipeline_id: lowered.pipeline_id.clone(),
        // The decision as the plan pass made it: the stages are its depth's.
        pipeline: d.clone(),
        choices: p.graph.choices.clone(),
        stages,
    }
}
