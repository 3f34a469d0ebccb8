//! The model zoo (`zoo/`, written by `zoo/make_zoo.py`), every entry end to end through
//! the CLI as a user takes it: `inspect`; `compile` at d = 1, 2 and 4 under every schedule
//! of [`SCHEDULES`] (at d = 4 also [`SEVERAL_PER_WORKER`]'s), each trained 2 steps at microbatch 3 (never the export batch, 1 or 2) on the entry's own inputs repeated; `export`
//! of the d = 2 2bw build; and the exported model run by onnxruntime at two batch sizes,
//! its outputs matched by `run-forward`, and at three times the export batch (inputs
//! repeated) matched against its outputs at the export batch repeated
//! (`zoo/onnxruntime_batches.py`, one Python process per job serving every entry); and
//! the source model at three times its export batch through `run-forward`, against
//! onnxruntime's outputs for the entry at its export batch repeated.
//!
//! An entry passes when every step does. The one allowed failure is a refusal at import
//! or compile that names the node (or the graph output whose samples a fixed batch's
//! reading mixes): a model must never fail inside libtorch at step 1, nor train on mixed
//! samples.
//! Entries the exporter itself could not write are listed in `zoo/zoo.json` and skipped.
//!
//! The commands run in this process, parsed by the CLI's own argument types (`src/args.rs`
//! and the driver's request types) and done by the same driver calls, so that some two
//! thousand commands fit in CI's time (a process of its own costs each one the loading of
//! libtorch).
//!
//! `PIPEWRIGHT_ZOO_TABLE=docs/zoo.md` writes the results table there;
//! `PIPEWRIGHT_ZOO_FILTER=NAME[,NAME...]` takes only the entries whose name contains one of the NAMEs;
//! `PIPEWRIGHT_ZOO_JOBS` (default 2) is how many entries run at once.
#![cfg(feature = "torch")]

mod common;
#[path = "../src/args.rs"]
#[allow(dead_code)]
mod args;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use clap::Parser;
use common::root;
use pipewright_driver::inspect::InspectRequest;
use pipewright_driver::plan::CompileSpec;

const DEPTHS: [usize; 3] = [1, 2, 4];
/// The schedules every entry is compiled and trained under at every depth.
const SCHEDULES: [&str; 5] = ["2bw", "flush", "gpipe", "zb-h1", "zb-h2"];
/// The schedules that run several stages per worker, at depth 4 only (interleaved-2 and
/// ZB-V: 2 workers of 2 stages; interleaved-4: one worker of 4).
const SEVERAL_PER_WORKER: [&str; 3] = ["interleaved-2", "interleaved-4", "zb-v"];

/// The schedules an entry is trained under at depth `d`.
fn schedules_at(d: usize) -> Vec<&'static str> {
    let several: &[&'static str] = if d == 4 { &SEVERAL_PER_WORKER } else { &[] };
    SCHEDULES.iter().chain(several).copied().collect()
}
const MICROBATCH: &str = "3";

/// The relative tolerance the trained model's outputs are held to against onnxruntime's.
const TRAINED_RTOL: &str = "1e-3";

/// The relative tolerance for the trained models of [`ILL_CONDITIONED`].
const ILL_CONDITIONED_RTOL: &str = "1e-2";

/// Entries whose trained model is ill-conditioned at the zoo's sizes, so that two
/// libraries' roundings land further apart than [`TRAINED_RTOL`] (their source model
/// keeps it). MobileNet v1 without the exporter's optimizer: its 27 BatchNorms (eps 1e-3,
/// PyTorch momentum 0.9997) take their running variance almost wholly from the last
/// microbatch, at its last layers' 1 x 1 maps an estimate from 3 values per channel;
/// trained, 1 of its 10 outputs lands 5.1e-4 from onnxruntime's (both f32), past 1e-4
/// absolute plus 1e-3 relative (in the one-step PyTorch referee's procedure, PyTorch's own
/// f32 and f64 steps of it differ by 1.7).
const ILL_CONDITIONED: [&str; 1] = ["mobilenet_v1-dynamo-noopt-dyn"];

/// One entry of `zoo/zoo.json`.
struct Entry {
    name: String,
    arch: String,
    exporter: String,
    batch: String,
    exporter_error: Option<String>,
}

fn entries() -> Vec<Entry> {
    let path = root().join("zoo/zoo.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("the zoo index is missing: {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("zoo.json parses");
    let field = |e: &serde_json::Value, k: &str| e[k].as_str().unwrap_or_else(|| panic!("zoo.json: entry without {k}: {e}")).to_string();
    json["entries"]
        .as_array()
        .expect("zoo.json has entries")
        .iter()
        .map(|e| Entry {
            name: field(e, "name"),
            arch: field(e, "arch"),
            exporter: field(e, "exporter"),
            batch: field(e, "batch"),
            exporter_error: e["exporter_error"].as_str().map(str::to_string),
        })
        .collect()
}

/// How one step of an entry ended.
#[derive(Clone, Debug)]
enum Outcome {
    Pass(String),
    /// The step failed with this message.
    Fail(String),
    /// Not run: an earlier step failed, or the model has too few layers for the depth.
    NotRun(String),
}

impl Outcome {
    fn cell(&self) -> String {
        match self {
            Outcome::Pass(s) => format!("pass{}", if s.is_empty() { String::new() } else { format!(" ({s})") }),
            // Paths relative to the workspace, so that the table reads the same anywhere.
            Outcome::Fail(m) => format!("**fail**: {}", m.replace(&format!("{}/", root().display()), "").replace('|', "\\|")),
            Outcome::NotRun(why) => format!("– ({why})"),
        }
    }
}

/// The steps of one entry, in order: import, d=1, d=2, d=4, export, onnxruntime.
struct Row {
    steps: Vec<(&'static str, Outcome)>,
}

impl Row {
    /// The first failure, if any: its step and message.
    fn failure(&self) -> Option<(&'static str, &str)> {
        self.steps.iter().find_map(|(step, o)| match o {
            Outcome::Fail(m) => Some((*step, m.as_str())),
            _ => None,
        })
    }
}

/// The last line of what a failed command printed (its `error:` line).
fn last_line(stderr: &str) -> String {
    stderr.trim_end().lines().last().unwrap_or("").trim_start_matches("error: ").to_string()
}

#[derive(Parser)]
enum Cli {
    Inspect(InspectRequest),
    Compile(CompileSpec),
    Train(args::TrainArgs),
    Export(args::ExportArgs),
    RunForward(args::RunForwardArgs),
}

/// `pipewright ARGS`, in this process: `Ok(what it printed)` or `Err(its error)`. A panic
/// is an error too (the CLI would have shown a backtrace).
fn try_pw<const N: usize>(argv: [&str; N]) -> Result<String, String> {
    let cli = Cli::try_parse_from(std::iter::once("pipewright").chain(argv)).map_err(|e| e.to_string())?;
    match catch_unwind(AssertUnwindSafe(|| run(cli))) {
        Ok(result) => result.map_err(|e| format!("error: {e}")),
        Err(panic) => Err(format!("panicked: {}", panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default())),
    }
}

fn run(cli: Cli) -> anyhow::Result<String> {
    use pipewright_driver::export::{export_onnx, save_weights, WEIGHTS_FILE};
    use pipewright_driver::train::Session;
    Ok(match cli {
        Cli::Inspect(req) => pipewright_driver::inspect::inspect(&req)?,
        Cli::Compile(spec) => pipewright_driver::plan::compile_command(&spec)?.1.stdout,
        Cli::Train(args) => {
            let report = Session::prepare(&args.build, &args.request()?)?.run(&mut |_| {})?;
            // Every zoo model has static shapes at a fixed microbatch: specialisation must
            // leave its steps no value to read back from the device.
            if report.host_reads.iter().any(|&r| r > 0) {
                anyhow::bail!("{}", pipewright_driver::train::host_reads_line(&report));
            }
            save_weights(&args.build.join(WEIGHTS_FILE), &report)?;
            format!("losses {:?}", report.losses)
        }
        Cli::Export(args) => export_onnx(&args.build, &args.output)?.batch_text(),
        Cli::RunForward(args) => {
            let (lines, verdict) = pipewright_driver::forward::run_forward_command(&args.model, &args.inputs, args.device, args.tile_batch, (args.rtol, args.atol), None)?;
            if !verdict.matched {
                anyhow::bail!("{}: the outputs differ from the expected ones: {}", args.model.display(), lines.join("; "));
            }
            lines.join("\n")
        }
    })
}

fn run_entry(entry: &Entry, work: &Path, ort: &mut Option<Onnxruntime>) -> Row {
    let model = root().join("zoo/models").join(&entry.name).join("model.onnx");
    let model_arg = model.to_str().expect("utf-8 path");
    let mut steps = Vec::new();
    if let Err(e) = try_pw(["inspect", model_arg]) {
        steps.push(("import", Outcome::Fail(last_line(&e))));
        return Row { steps };
    }
    steps.push(("import", Outcome::Pass(String::new())));
    let data = work.join("data.safetensors");
    let batch_axis = match output_batch_axis(&model) {
        Ok(axis) => axis,
        Err(e) => {
            steps.push(("d=1", Outcome::Fail(format!("the output's batch axis: {e}"))));
            return Row { steps };
        }
    };
    if let Err(e) = write_entry_data(model.parent().expect("entry folder"), &data, batch_axis) {
        steps.push(("d=1", Outcome::Fail(format!("the entry's inputs: {e}"))));
        return Row { steps };
    }
    let mut export_build = None;
    for d in DEPTHS {
        let outcome = depth(&model, d, &data, work, &mut export_build);
        steps.push((["d=1", "d=2", "d=4"][DEPTHS.iter().position(|&x| x == d).unwrap_or(0)], outcome));
    }
    let Some(build) = export_build else {
        steps.push(("export", Outcome::NotRun("no trained build".into())));
        steps.push(("onnxruntime", Outcome::NotRun("no export".into())));
        return Row { steps };
    };
    let exported = work.join("exported.onnx");
    match try_pw(["export", build.to_str().unwrap_or_default(), "-o", exported.to_str().unwrap_or_default()]) {
        Ok(out) => steps.push(("export", Outcome::Pass(export_note(&out)))),
        Err(e) => {
            steps.push(("export", Outcome::Fail(last_line(&e))));
            steps.push(("onnxruntime", Outcome::NotRun("no export".into())));
            return Row { steps };
        }
    }
    let rtol = if ILL_CONDITIONED.contains(&entry.name.as_str()) { ILL_CONDITIONED_RTOL } else { TRAINED_RTOL };
    steps.push(("onnxruntime", onnxruntime_check(ort, &exported, &model, work, rtol, batch_axis)));
    Row { steps }
}

/// Samples of the training data written for each entry: its inputs repeated, enough for
/// 2 steps of as many microbatches of [`MICROBATCH`] as stages (at most 4, the default
/// count at d = 4).
const DATA_SAMPLES: usize = 24;

/// The entry's own inputs (`input_K.pb`, at its export batch) repeated to
/// [`DATA_SAMPLES`] samples (float inputs' repeats jittered, [`jitter_repeats`]), with labels `(7 i + 3) mod C` over the leading axes of its
/// output (`output_0.pb`, C its last extent) but its batch axis, sample axis first, as a
/// safetensors file for `train --data`.
/// Real inputs, not synthetic zeros: an attention mask of zeros masks every position, and
/// some models (Helium's) then compute NaN.
fn write_entry_data(entry: &Path, out: &Path, batch_axis: usize) -> Result<(), String> {
    use protobuf::Message;
    let read = |file: &str| -> Result<pipewright_ir::TensorData, String> {
        let path = entry.join(file);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let proto = onnx_protobuf::TensorProto::parse_from_bytes(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        pipewright_ir::import::tensor::tensor_from_proto(proto, entry).map_err(|e| format!("{}: {e}", path.display()))
    };
    let names = input_names(&entry.join("model.onnx"))?;
    let mut arrays = Vec::new();
    for (k, name) in names.iter().enumerate() {
        let t = read(&format!("input_{k}.pb"))?;
        let batch = *t.dims.first().ok_or(format!("input_{k}.pb is a scalar"))? as usize;
        let mut dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        dims[0] = DATA_SAMPLES;
        let sample = t.bytes.len() / batch.max(1);
        let mut bytes: Vec<u8> = t.bytes.chunks(sample).cycle().take(DATA_SAMPLES).flatten().copied().collect();
        if t.dtype == pipewright_ir::DType::F32 {
            jitter_repeats(&mut bytes[t.bytes.len()..]);
        }
        arrays.push((name.clone(), safetensors_dtype(t.dtype)?, dims, bytes));
    }
    let output = read("output_0.pb")?;
    // A sample's labels: the output's extents but its batch axis and its class axis.
    let Some((&classes, leading)) = output.dims.split_last().filter(|(_, leading)| batch_axis < leading.len()) else {
        return Err(format!("output_0.pb (shape {:?}) has no class axis after its batch axis {batch_axis}", output.dims));
    };
    let sample_dims: Vec<usize> = leading.iter().enumerate().filter(|(a, _)| *a != batch_axis).map(|(_, &d)| d as usize).collect();
    let per_sample: usize = sample_dims.iter().product();
    let labels: Vec<u8> = (0..(DATA_SAMPLES * per_sample) as i64).flat_map(|i| ((7 * i + 3) % classes.max(1)).to_le_bytes()).collect();
    let mut label_dims = vec![DATA_SAMPLES];
    label_dims.extend(sample_dims);
    arrays.push(("label".into(), safetensors::Dtype::I64, label_dims, labels));
    let views: Vec<(String, safetensors::tensor::TensorView)> = arrays
        .iter()
        .map(|(n, dt, dims, b)| safetensors::tensor::TensorView::new(*dt, dims.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("{n}: {e:?}")))
        .collect::<Result<_, _>>()?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| format!("{e:?}"))?;
    std::fs::write(out, bytes).map_err(|e| format!("{}: {e}", out.display()))
}

/// Adds up to +-0.1 to every f32 of the repeated samples (a fixed sequence): identical
/// samples would leave a BatchNorm after pooling (or after a per-sample normalization)
/// with no variance across the batch, which no real batch has.
fn jitter_repeats(bytes: &mut [u8]) {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in bytes.chunks_exact_mut(4) {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) + 0.1 * unit;
        chunk.copy_from_slice(&v.to_le_bytes());
    }
}

/// The axis of the model's output that carries the batch as pipewright imports it: the
/// first unless the output carries it further in (a stack of layers' outputs); the first
/// where none does (a batch the export fixed).
fn output_batch_axis(model: &Path) -> Result<usize, String> {
    let g = pipewright_ir::import_model(model, &pipewright_ir::ImportOptions::default()).map_err(|e| e.to_string())?;
    let output = *g.outputs().first().ok_or_else(|| format!("{}: no outputs", model.display()))?;
    Ok(g.value(output).ty.shape.0.iter().position(|d| *d == pipewright_ir::Dim::N).unwrap_or(0))
}

/// The model's graph inputs that are not initializers, in order (the order of `input_K.pb`).
fn input_names(model: &Path) -> Result<Vec<String>, String> {
    use protobuf::Message;
    let bytes = std::fs::read(model).map_err(|e| format!("{}: {e}", model.display()))?;
    let m = onnx_protobuf::ModelProto::parse_from_bytes(&bytes).map_err(|e| format!("{}: {e}", model.display()))?;
    let g = m.graph.as_ref().ok_or("no graph")?;
    let inits: std::collections::HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    Ok(g.input.iter().filter(|i| !inits.contains(i.name.as_str())).map(|i| i.name.clone()).collect())
}

fn safetensors_dtype(d: pipewright_ir::DType) -> Result<safetensors::Dtype, String> {
    use pipewright_ir::DType;
    Ok(match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::F16 => safetensors::Dtype::F16,
        DType::I64 => safetensors::Dtype::I64,
        DType::I32 => safetensors::Dtype::I32,
        DType::Bool => safetensors::Dtype::BOOL,
        other => return Err(format!("input type {other:?} has no safetensors form here")),
    })
}

/// `kept the export batch 1` or nothing: what export said of the batch when it had to keep it.
fn export_note(stdout: &str) -> String {
    match stdout.split("kept the export batch ").nth(1) {
        Some(rest) => format!("batch kept at {}", rest.split(':').next().unwrap_or("?")),
        None => String::new(),
    }
}

/// Compiles at depth `d` under every schedule and trains each build 2 steps; the d = 2 2bw
/// build (or the first to train) is kept for export.
fn depth(model: &Path, d: usize, data: &Path, work: &Path, export_build: &mut Option<PathBuf>) -> Outcome {
    let mut trained = Vec::new();
    for schedule in schedules_at(d) {
        let build = work.join(format!("d{d}-{schedule}"));
        let compile = ["compile", model.to_str().unwrap_or_default(), "--stages", &d.to_string(), "--schedule", schedule, "-o", build.to_str().unwrap_or_default()];
        if let Err(e) = try_pw(compile) {
            let message = last_line(&e);
            if message.contains("cannot be cut into") || message.contains("fewer") {
                return Outcome::NotRun(message);
            }
            return Outcome::Fail(format!("compile --schedule {schedule}: {message}"));
        }
        let train = ["train", build.to_str().unwrap_or_default(), "--data", data.to_str().unwrap_or_default(), "--steps", "2", "--microbatch", MICROBATCH, "--threads", "1", "--timeout", "120"];
        match try_pw(train) {
            Ok(_) => trained.push(schedule),
            Err(e) => return Outcome::Fail(format!("train ({schedule}): {}", last_line(&e))),
        }
        if export_build.is_none() || (d == 2 && schedule == "2bw") {
            *export_build = Some(build);
        }
    }
    Outcome::Pass(trained.join(", "))
}

/// The exported model through onnxruntime at the export batch and at 3x it (where export
/// made the batch dynamic), each matched by `run-forward` on the same inputs; at 3x also
/// against its outputs at the export batch repeated (the script fails otherwise). Then the
/// source model at 3x its export batch through `run-forward`, against the entry's own
/// onnxruntime outputs repeated. The exported model is held to `rtol` (atol 1e-4). The
/// outputs repeat along `batch_axis`, where they carry the batch.
fn onnxruntime_check(ort: &mut Option<Onnxruntime>, exported: &Path, source: &Path, work: &Path, rtol: &str, batch_axis: usize) -> Outcome {
    let inputs = source.parent().expect("entry folder");
    let server = match ort {
        Some(server) => server,
        None => ort.insert(Onnxruntime::start()),
    };
    let printed = match server.run(exported, inputs, work, batch_axis) {
        Ok(printed) => printed,
        Err(Answer::Refused(message)) => return Outcome::Fail(format!("onnxruntime: {message}")),
        Err(Answer::Lost(message)) => {
            // The next entry starts a new Python.
            *ort = None;
            return Outcome::Fail(format!("onnxruntime: {message}"));
        }
    };
    let mut batches = Vec::new();
    for line in printed.lines() {
        let Some((batch, folder)) = line.strip_prefix("batch ").and_then(|l| l.split_once(' ')) else { continue };
        match try_pw(["run-forward", exported.to_str().unwrap_or_default(), "--inputs", folder, "--rtol", rtol, "--atol", "1e-4"]) {
            Ok(_) => batches.push(batch.to_string()),
            Err(e) => return Outcome::Fail(format!("run-forward at batch {batch}: {}", last_line(&e))),
        }
    }
    if batches.is_empty() {
        return Outcome::Fail(format!("onnxruntime ran no batch: {printed}"));
    }
    // The source model itself at 3x its export batch against onnxruntime's outputs at the
    // export batch repeated: a fixed batch's reading must not mix samples.
    let Some((batch, folder)) = printed.lines().find_map(|l| l.strip_prefix("source ").and_then(|l| l.split_once(' '))) else {
        return Outcome::Fail(format!("onnxruntime wrote no tripled source inputs: {printed}"));
    };
    if let Err(e) = try_pw(["run-forward", source.to_str().unwrap_or_default(), "--inputs", folder, "--rtol", "1e-3", "--atol", "1e-4"]) {
        return Outcome::Fail(format!("run-forward of the source at batch {batch}: {}", last_line(&e)));
    }
    Outcome::Pass(format!("batch {}; source at {batch}", batches.join(", ")))
}

/// `zoo/onnxruntime_batches.py --serve`, one per job, so that Python and onnxruntime
/// start once rather than for each of some nine hundred entries.
struct Onnxruntime {
    child: std::process::Child,
    requests: std::process::ChildStdin,
    answers: std::io::BufReader<std::process::ChildStdout>,
}

/// Why a request to [`Onnxruntime`] got no lines: the script's error for this model, or
/// the process itself gone.
enum Answer {
    Refused(String),
    Lost(String),
}

impl Onnxruntime {
    fn start() -> Self {
        let python = std::env::var("PIPEWRIGHT_PYTHON").unwrap_or_else(|_| panic!("PIPEWRIGHT_PYTHON is not set: run the tests through scripts/test.sh (it sets up onnxruntime)"));
        let script = root().join("zoo/onnxruntime_batches.py");
        let mut child = Command::new(&python)
            // One BLAS thread: numpy's pool would only spin beside the other job.
            .env("OPENBLAS_NUM_THREADS", "1")
            .arg(&script)
            .arg("--serve")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{python}: {e}"));
        let requests = child.stdin.take().expect("piped stdin");
        let answers = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        Onnxruntime { child, requests, answers }
    }

    /// The lines the script printed for `exported` (whose outputs carry the batch on
    /// `batch_axis`) before `end ok`.
    fn run(&mut self, exported: &Path, inputs: &Path, work: &Path, batch_axis: usize) -> Result<String, Answer> {
        use std::io::{BufRead, Write};
        let paths = [exported, inputs, work].map(|p| p.display().to_string()).join("\t");
        if paths.contains('\n') || paths.split('\t').count() != 3 {
            return Err(Answer::Refused(format!("a path holds a tab or a line break: {paths:?}")));
        }
        let request = format!("{paths}\t{batch_axis}");
        writeln!(self.requests, "{request}").and_then(|()| self.requests.flush()).map_err(|e| self.lost(&e.to_string()))?;
        let mut printed = String::new();
        loop {
            let mut line = String::new();
            match self.answers.read_line(&mut line) {
                Ok(0) => return Err(self.lost("no answer")),
                Err(e) => return Err(self.lost(&e.to_string())),
                Ok(_) => {}
            }
            match line.trim_end().strip_prefix("end ") {
                Some("ok") => return Ok(printed),
                Some(error) => return Err(Answer::Refused(error.strip_prefix("error ").unwrap_or(error).to_string())),
                None => printed.push_str(&line),
            }
        }
    }

    /// The process is gone (or no longer answers): how it ended.
    fn lost(&mut self, what: &str) -> Answer {
        let _ = self.child.kill();
        let status = self.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
        Answer::Lost(format!("the Python process ended ({status}; {what})"))
    }
}

impl Drop for Onnxruntime {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn table(entries: &[Entry], rows: &[Option<Row>]) -> String {
    let mut text = String::from(concat!(
        "# The model zoo\n\n",
        "Every architecture of `zoo/` (written by `zoo/make_zoo.py` from torchvision, transformers and torch.nn ",
        "building blocks at tiny widths, random weights), exported by PyTorch's default exporter (`dynamo`, ",
        "weights in an external data file) and the TorchScript exporter (`script`), at a fixed batch of 1, a ",
        "fixed batch of 2 and with a dynamic batch axis, and by the default exporter without its graph optimizer ",
        "(`dynamo-noopt`, `optimize=False`, dynamic batch: every parameter kept as the model trains it). ",
        "Each entry is taken through `inspect`, `compile` at ",
        "d = 1, 2 and 4 under "));
    text.push_str(&SCHEDULES.join(", "));
    text.push_str(" (at d = 4 also ");
    text.push_str(&SEVERAL_PER_WORKER.join(", "));
    text.push(')');
    text.push_str(concat!(
        "; each build trained 2 steps at microbatch 3 on the entry's own inputs, repeated; `export` of ",
        "the d = 2 2bw build, and onnxruntime on the exported model at two batch sizes against `run-forward`; ",
        "last `run-forward` of the source model at three times its export batch (\"source at B\") against ",
        "onnxruntime's outputs for the entry at its export batch, repeated.\n\n",
        "Generated by `tests/zoo.rs`; to regenerate:\n\n",
        "    PIPEWRIGHT_PYTHON=$(bash scripts/pyref.sh) PIPEWRIGHT_ZOO_TABLE=$PWD/docs/zoo.md cargo test --release --test zoo\n\n",
    ));
    let (mut pass, mut fail, mut exporter) = (0, 0, 0);
    for (e, r) in entries.iter().zip(rows) {
        match (e.exporter_error.is_some(), r.as_ref().map(Row::failure)) {
            (true, _) => exporter += 1,
            (false, Some(None)) => pass += 1,
            (false, Some(Some(_))) => fail += 1,
            (false, None) => {}
        }
    }
    text.push_str(&format!(
        "{} entries of {} architectures: **{pass} pass every step**, {fail} fail, {exporter} could not be exported by the exporter itself.\n\n",
        entries.len(),
        entries.iter().map(|e| e.arch.as_str()).collect::<std::collections::BTreeSet<_>>().len()
    ));
    text.push_str("| model | exporter | batch | import | d=1 | d=2 | d=4 | export | onnxruntime |\n|---|---|---|---|---|---|---|---|---|\n");
    for (e, r) in entries.iter().zip(rows) {
        let cells: Vec<String> = match (&e.exporter_error, r) {
            (Some(err), _) => vec![format!("exporter failed: {}", err.chars().take(120).collect::<String>().replace('|', "\\|"))],
            (None, Some(r)) => r.steps.iter().map(|(_, o)| o.cell()).collect(),
            (None, None) => vec!["not run".into()],
        };
        text.push_str(&format!("| {} | {} | {} | {} |\n", e.arch, e.exporter, e.batch, cells.join(" | ")));
    }
    text
}

#[test]
fn every_zoo_entry_end_to_end() {
    let all = entries();
    let filter = std::env::var("PIPEWRIGHT_ZOO_FILTER").unwrap_or_default();
    if filter.is_empty() {
        assert!(all.len() >= 240, "the zoo lists {} entries: expected six for each of at least 40 architectures (zoo/make_zoo.py)", all.len());
    }
    let jobs: usize = std::env::var("PIPEWRIGHT_ZOO_JOBS").ok().and_then(|j| j.parse().ok()).unwrap_or(2);
    let work = tempfile::tempdir().expect("temp dir");
    let rows: Vec<Mutex<Option<Row>>> = all.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| {
                // The jobs share the cores: `run-forward` on this thread takes one intra-op
                // thread (a second would only spin while the other job computes).
                tch::set_num_threads(1);
                let mut ort = None;
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(entry) = all.get(i) else { break };
                    if entry.exporter_error.is_some() || !filter.split(',').any(|f| entry.name.contains(f)) {
                        continue;
                    }
                    let dir = work.path().join(&entry.name);
                    std::fs::create_dir_all(&dir).expect("work dir");
                    let row = run_entry(entry, &dir, &mut ort);
                    let _ = std::fs::remove_dir_all(&dir);
                    *rows[i].lock().expect("row") = Some(row);
                }
            });
        }
    });
    let rows: Vec<Option<Row>> = rows.into_iter().map(|m| m.into_inner().expect("row")).collect();
    if let Ok(path) = std::env::var("PIPEWRIGHT_ZOO_TABLE") {
        std::fs::write(&path, table(&all, &rows)).expect("writes the table");
    }
    let mut failures = Vec::new();
    for (e, r) in all.iter().zip(&rows) {
        let Some((step, message)) = r.as_ref().and_then(Row::failure) else { continue };
        // The one failure allowed: a refusal at import or compile naming the node, or the
        // graph output whose samples a fixed batch's reading mixes.
        let refused_early = step == "import" || message.starts_with("compile");
        if !(refused_early && (message.contains("node \"") || message.contains("graph output \""))) {
            failures.push(format!("{} ({}): {step}: {message}", e.name, e.batch));
        }
    }
    assert!(failures.is_empty(), "{} zoo entries failed:\n{}", failures.len(), failures.join("\n"));
}
