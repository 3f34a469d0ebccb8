//! `pipewright compile`: import, plan, partition, lower per stage and write the build
//! folder: `pipeline.toml` (the plan and how stages connect), `stageK.pwm` (the stage
//! modules the runtime loads) and `stageK.onnx` (each stage's forward subgraph as ONNX).
//! Every file is written atomically (temporary file, then rename).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use pipewright_codegen::module::{write_module, StageParams};
use pipewright_core::{Recompute, Schedule};
use pipewright_codegen::onnx_export::export_stage_bytes;
use pipewright_codegen::stage::{lower_slice_annotated, slice_stages, Annotations, BoundaryTensor, StageSlice, StageTensor};
use pipewright_ir::{import_model, ImportOptions};
use pipewright_passes::manager::{compile_passes, CompileOptions, PrintAfter};
use pipewright_passes::cluster::Cluster;
use pipewright_passes::cost::CostModel;
use pipewright_passes::planner::{self, PlanOptions};
use pipewright_runtime::program::Extent;
use serde::Serialize;

use crate::output::write_atomic;
use crate::CompileArgs;

/// The build manifest, `pipeline.toml`.
#[derive(Serialize)]
struct Manifest {
    model: String,
    /// The id every stage module of this compile carries (`Program::pipeline`).
    pipeline_id: String,
    plan: PlanNumbers,
    /// Stage module files in pipeline order.
    stage_order: Vec<String>,
    stage: Vec<StageEntry>,
}

#[derive(Serialize)]
struct PlanNumbers {
    /// Data-parallel width.
    w: usize,
    /// Pipeline depth (stages).
    d: usize,
    /// Microbatch size.
    b: u64,
    /// Microbatches per step and pipeline.
    m: u64,
    schedule: String,
    recompute: String,
}

#[derive(Serialize)]
struct StageEntry {
    index: u32,
    module: String,
    onnx: String,
    nodes: usize,
    received: Vec<TensorEntry>,
    sent: Vec<TensorEntry>,
    graph_inputs: Vec<TensorEntry>,
    graph_outputs: Vec<TensorEntry>,
}

#[derive(Serialize)]
struct TensorEntry {
    /// The wire name for boundary tensors (`x@stage2`), else the graph's name.
    name: String,
    /// For boundary tensors: the value's name in the sending stage.
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    /// For boundary tensors: the stage on the other side.
    #[serde(skip_serializing_if = "Option::is_none")]
    peer: Option<u32>,
    dtype: String,
    /// Extents, `N` for the microbatch size (`16*N` for a multiple of it).
    shape: Vec<String>,
}

/// `N`, `16*N` or a number.
pub fn extent_text(e: Extent) -> String {
    match e {
        Extent::Fixed(v) => v.to_string(),
        Extent::Batch(1) => "N".into(),
        Extent::Batch(k) => format!("{k}*N"),
    }
}

fn boundary_entry(t: &BoundaryTensor) -> TensorEntry {
    TensorEntry {
        name: t.name.clone(),
        value: Some(t.value.clone()),
        peer: Some(t.peer),
        dtype: t.elem.to_string(),
        shape: t.shape.iter().map(|&e| extent_text(e)).collect(),
    }
}

fn tensor_entry(t: &StageTensor) -> TensorEntry {
    TensorEntry {
        name: t.name.clone(),
        value: None,
        peer: None,
        dtype: t.elem.to_string(),
        shape: t.shape.iter().map(|&e| extent_text(e)).collect(),
    }
}

/// The stage count, stage starts, microbatch and schedule of a `pipewright plan --json` file.
struct SavedPlan {
    d: usize,
    b: u64,
    schedule: Schedule,
    cuts: Vec<String>,
}

fn read_saved_plan(path: &Path) -> Result<SavedPlan> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: not a plan (JSON from `pipewright plan --json`): {e}", path.display()))?;
    let bad = |what: &str| anyhow!("{}: not a plan from `pipewright plan --json`: {what}", path.display());
    let chosen = v.get("chosen").ok_or_else(|| bad("no \"chosen\" configuration"))?;
    let d = chosen.get("d").and_then(|x| x.as_u64()).ok_or_else(|| bad("no chosen.d"))? as usize;
    let b = chosen.get("b").and_then(|x| x.as_u64()).ok_or_else(|| bad("no chosen.b"))?;
    let schedule = chosen.get("schedule").and_then(|x| x.as_str()).ok_or_else(|| bad("no chosen.schedule"))?;
    let schedule: Schedule = schedule.parse().map_err(|e| bad(&format!("{e}")))?;
    let stages = v.get("stages").and_then(|x| x.as_array()).ok_or_else(|| bad("no \"stages\" list"))?;
    let cuts = stages
        .iter()
        .skip(1)
        .map(|s| s.get("first_node").and_then(|x| x.as_str()).map(str::to_string).ok_or_else(|| bad("a stage without first_node")))
        .collect::<Result<Vec<_>>>()?;
    if cuts.len() + 1 != d {
        return Err(bad("the stage list does not match chosen.d"));
    }
    Ok(SavedPlan { d, b, schedule, cuts })
}

fn params_text(depth: u32, schedule: Schedule, recompute: Recompute) -> String {
    format!("{depth}|{schedule:?}|{recompute:?}")
}

/// The id every stage of this compile carries: a CRC-32 of the source model's bytes
/// joined with a hash of the stage parameters and the node-to-stage assignment. The same
/// compile run twice (anywhere) gives the same id and byte-identical modules; another
/// model, other weights or another partition give another, so `train` refuses to mix
/// their stages.
fn pipeline_id(model: &Path, params: &str, slices: &[StageSlice]) -> String {
    let content = std::fs::read(model).map(|b| crc32fast::hash(&b)).unwrap_or(0);
    // FNV-1a: stable across builds and Rust versions, unlike std's DefaultHasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(params.as_bytes());
    for s in slices {
        feed(&s.stage.to_le_bytes());
        for n in &s.nodes {
            feed(&(n.index() as u64).to_le_bytes());
        }
    }
    format!("{content:08x}{:08x}", (h >> 32) as u32 ^ h as u32)
}

pub fn run(args: &CompileArgs) -> Result<()> {
    let model = &args.model;
    let at = |what: &str, e: &dyn std::fmt::Display| anyhow!("{}: {what}: {e}", model.display());
    let started = std::time::Instant::now();
    let graph = import_model(model, &ImportOptions::default())?;
    let import_time = started.elapsed();
    let saved = args.plan.as_deref().map(read_saved_plan).transpose()?;
    let schedule = saved.as_ref().map(|p| p.schedule).unwrap_or(args.schedule);
    let recompute = args.recompute;
    let stages = saved.as_ref().map(|p| p.d).or(args.stages);
    if stages == Some(0) {
        bail!("--stages must be at least 1");
    }
    let mut cluster = Cluster::default();
    if let Some(d) = stages {
        cluster.workers = cluster.workers.max(d);
        cluster.workers_per_node = cluster.workers_per_node.max(d);
    }
    let cost = CostModel::new(&graph, cluster.roofline()).map_err(|e| at("cost model", &e))?;
    let opts = PlanOptions {
        global_batch: args.batch,
        schedules: vec![schedule],
        stages,
        cuts: saved.as_ref().map(|p| p.cuts.clone()).filter(|c| !c.is_empty()),
        microbatch: saved.as_ref().map(|p| p.b).or(args.microbatch),
        recompute: Some(recompute),
        top: 1,
        ..PlanOptions::default()
    };
    let plan = planner::plan(&graph, &cost, &cluster, &opts).map_err(|e| at("plan", &e))?;
    let depth = plan.chosen.d as u32;
    let pass_opts = CompileOptions {
        device: cluster.roofline(),
        recompute,
        microbatch: plan.chosen.b,
        schedule,
        microbatches: u32::try_from(plan.chosen.m).ok(),
        print_after: match args.print_after.as_deref() {
            None => PrintAfter::None,
            Some("all") => PrintAfter::All,
            Some(p) => PrintAfter::Pass(p.to_string()),
        },
        stop_after: args.stop_after.clone(),
        ..CompileOptions::default()
    };
    let state = compile_passes(graph, plan.stage_map(), &pass_opts).map_err(|e| at("passes", &e))?;
    print!("{}", state.printed);
    if args.timings {
        // The importer parses, converts and infers shapes in one go; the manager's
        // `import`/`shape-inference` entries only mark that point in the pipeline.
        eprintln!("  import+shape-inference (importer) {:.3} ms", import_time.as_secs_f64() * 1e3);
        eprint!("{}", state.timings_text());
    }
    if args.stop_after.is_some() && !state.ran.iter().any(|p| p == "lower") {
        return Ok(());
    }
    let (graph, stage_map) = match state.stages {
        Some(stages) => (state.graph, stages),
        None => bail!("{}: the pass pipeline produced no stages", model.display()),
    };
    let slices = slice_stages(&graph, &stage_map).map_err(|e| at("lower", &e))?;
    let annotations = Annotations { recompute: state.recompute.as_ref(), versions: state.versions.as_ref() };

    let out = &args.output;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create the output folder", out.display()))?;
    let mut entries = Vec::new();
    let mut order = Vec::new();
    let mut spent = WriteTimes::default();
    let pipeline_id = pipeline_id(model, &params_text(depth, schedule, recompute), &slices);
    for slice in &slices {
        let k = slice.stage;
        let t = std::time::Instant::now();
        let mut sp = lower_slice_annotated(&graph, slice, &annotations).map_err(|e| at("lower", &e))?;
        sp.program.pipeline = pipeline_id.clone();
        spent.lower += t.elapsed();
        let module_name = format!("stage{k}.pwm");
        let onnx_name = format!("stage{k}.onnx");
        let params = StageParams { stage: k, depth, schedule, recompute };
        let t = std::time::Instant::now();
        write_module(out.join(&module_name), &params, &sp.program).map_err(|e| anyhow!("{e}"))?;
        spent.modules += t.elapsed();
        let t = std::time::Instant::now();
        let onnx = export_stage_bytes(&graph, slice).map_err(|e| at("ONNX export", &e))?;
        write_atomic(&out.join(&onnx_name), &onnx)?;
        spent.onnx += t.elapsed();
        if args.executables {
            write_executable(&out.join(format!("stage{k}")), &out.join(&module_name))?;
        }
        order.push(module_name.clone());
        entries.push(StageEntry {
            index: k,
            module: module_name,
            onnx: onnx_name,
            nodes: slice.nodes.len(),
            received: sp.received.iter().map(boundary_entry).collect(),
            sent: sp.sent.iter().map(boundary_entry).collect(),
            graph_inputs: sp.graph_inputs.iter().map(tensor_entry).collect(),
            graph_outputs: sp.graph_outputs.iter().map(tensor_entry).collect(),
        });
    }
    if args.timings {
        eprint!("{}", spent.text());
    }
    let c = &plan.chosen;
    let manifest = Manifest {
        model: std::fs::canonicalize(model).unwrap_or_else(|_| model.clone()).display().to_string(),
        pipeline_id: pipeline_id.clone(),
        plan: PlanNumbers {
            w: c.w,
            d: c.d,
            b: c.b,
            m: c.m,
            schedule: schedule.to_string(),
            recompute: recompute.to_string(),
        },
        stage_order: order,
        stage: entries,
    };
    let text = toml::to_string_pretty(&manifest).map_err(|e| anyhow!("pipeline.toml: cannot serialise: {e}"))?;
    write_atomic(&out.join("pipeline.toml"), text.as_bytes())?;
    println!(
        "compiled {} into {} stage(s) in {} (w={} d={} b={} m={} schedule={} recompute={})",
        model.display(),
        depth,
        out.display(),
        c.w,
        c.d,
        c.b,
        c.m,
        schedule,
        recompute
    );
    Ok(())
}

/// Time spent after the passes, for `--timings`: lowering every stage, writing the stage
/// modules (program + weights), and exporting the stage ONNX files.
#[derive(Default)]
struct WriteTimes {
    lower: std::time::Duration,
    modules: std::time::Duration,
    onnx: std::time::Duration,
}

impl WriteTimes {
    fn text(&self) -> String {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        format!(
            "  lower stages            {:.3} ms\n  write stage modules     {:.3} ms\n  write stage ONNX        {:.3} ms\n",
            ms(self.lower),
            ms(self.modules),
            ms(self.onnx)
        )
    }
}

/// Trailer magic of a stage executable: the pipewright binary, then the stage module,
/// then `PWSTAGEX` and the module's length as a little-endian u64.
pub const EXE_MAGIC: [u8; 8] = *b"PWSTAGEX";

/// Writes `path` = this pipewright binary + the module at `module` + the trailer, executable.
fn write_executable(path: &Path, module: &Path) -> Result<()> {
    let exe: PathBuf = std::env::current_exe().context("cannot locate the pipewright binary")?;
    let mut bytes = std::fs::read(&exe).with_context(|| format!("{}: cannot read", exe.display()))?;
    // A stage executable compiling again: keep only the binary part.
    if let Some(len) = appended_module_len(&bytes) {
        bytes.truncate(bytes.len() - 16 - len);
    }
    let m = std::fs::read(module).with_context(|| format!("{}: cannot read", module.display()))?;
    bytes.extend_from_slice(&m);
    bytes.extend_from_slice(&EXE_MAGIC);
    bytes.extend_from_slice(&(m.len() as u64).to_le_bytes());
    write_atomic(path, &bytes)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("{}: cannot make it executable", path.display()))?;
    }
    Ok(())
}

/// The length of a stage module appended to an executable's bytes, if there is one.
pub fn appended_module_len(bytes: &[u8]) -> Option<usize> {
    let n = bytes.len();
    if n < 16 || bytes[n - 16..n - 8] != EXE_MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(bytes[n - 8..].try_into().ok()?) as usize;
    (len <= n - 16).then_some(len)
}

/// The stage module appended to the running executable, if any (a `--executables` build).
pub fn embedded_module() -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let exe = std::env::current_exe().ok()?;
    let mut f = std::fs::File::open(exe).ok()?;
    let n = f.metadata().ok()?.len();
    if n < 16 {
        return None;
    }
    let mut trailer = [0u8; 16];
    f.seek(SeekFrom::End(-16)).ok()?;
    f.read_exact(&mut trailer).ok()?;
    if trailer[..8] != EXE_MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(trailer[8..].try_into().ok()?);
    if len > n - 16 {
        return None;
    }
    let mut m = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(n - 16 - len)).ok()?;
    f.read_exact(&mut m).ok()?;
    Some(m)
}
