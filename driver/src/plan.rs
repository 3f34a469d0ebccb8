//! The requests of `plan` and `compile`, built from the commands' plain values: the cluster
//! a plan is made for (defaults, then a TOML file, then single values), the planner's
//! options, and the plan pass's request (a plan file, a fixed depth, or a search).

use std::path::{Path, PathBuf};

use pipewright_core::units::parse_bytes;
use pipewright_core::{Balance, Optimizer, PassName, Placement, Precision, PrintAfter, Recompute, Schedule, WordList};
use pipewright_ir::ImportOptions;
use pipewright_core::units::{parse_bandwidth, parse_flops};
use pipewright_passes::cluster::{Cluster, DEFAULT_CLUSTER_NOTE};
use pipewright_passes::manager::PassOptions;
use pipewright_passes::pipeline::PlanRequest;
use pipewright_passes::plan_file::PlanFile;
use pipewright_passes::planner::PlanOptions;
use pipewright_passes::presets::{self, SimCluster};
use pipewright_passes::profile::Profile;

use crate::compile::{compile, plan, CompileRequest, Compiled};
use crate::DriverError;

/// The global batch the planner searches for when none is given.
pub const DEFAULT_GLOBAL_BATCH: u64 = 512;

/// The cluster a plan is made for: the default one, then a TOML file, then single values.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ClusterSpec {
    /// Workers (accelerators) in the cluster.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Memory per worker, e.g. 16GiB.
    #[arg(long)]
    pub memory: Option<String>,
    /// Bandwidth between workers of one server, e.g. 150GB/s.
    #[arg(long)]
    pub intra_bw: Option<String>,
    /// Bandwidth between servers, e.g. 25Gbit/s.
    #[arg(long)]
    pub inter_bw: Option<String>,
    /// Workers per server.
    #[arg(long)]
    pub workers_per_node: Option<usize>,
    /// Peak flop/s of one worker, e.g. 15.7T.
    #[arg(long)]
    pub peak_flops: Option<String>,
    /// A cluster description in TOML, or a device preset as `simulate` takes one
    /// (V100-16GB, A100-40GB, A100-80GB, H100, H200, with --servers, --gpus-per-server and
    /// --network): the values above override it.
    #[arg(long, value_name = "FILE|PRESET")]
    pub cluster: Option<PathBuf>,
    #[command(flatten)]
    pub preset: PresetShape,
}

/// How many servers of a device preset, and their network (`plan` and `simulate`).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct PresetShape {
    /// Servers, with a device preset (default 1).
    #[arg(long)]
    pub servers: Option<usize>,
    /// GPUs per server, with a device preset (default 8).
    #[arg(long)]
    pub gpus_per_server: Option<usize>,
    /// Network between servers, with a device preset: 25gbit, 100gbit, 8x200gbit,
    /// 8x400gbit (default: the one the device's usual servers have).
    #[arg(long)]
    pub network: Option<String>,
}

impl PresetShape {
    /// The flags given, by name (they need a preset).
    pub fn given(&self) -> Vec<&'static str> {
        [("--servers", self.servers.is_some()), ("--gpus-per-server", self.gpus_per_server.is_some()), ("--network", self.network.is_some())].iter().filter(|f| f.1).map(|f| f.0).collect()
    }

    /// The device preset `name` in this shape, computing in `precision`, each kernel at a
    /// flat `efficiency` of the peaks or (`None`) at what the device's published
    /// measurements say.
    pub fn cluster(&self, name: &str, precision: Precision, efficiency: Option<f64>) -> Result<SimCluster, DriverError> {
        let device = presets::device(name).map_err(|e| DriverError::msg(format!("--cluster: {e}")))?;
        let network = presets::network(self.network.as_deref().unwrap_or(device.network)).map_err(|e| DriverError::msg(format!("--network: {e}")))?;
        SimCluster::from_preset(device, network, self.servers.unwrap_or(1), self.gpus_per_server.unwrap_or(8), precision, efficiency).map_err(|e| DriverError::msg(format!("--cluster {name}: {e}")))
    }
}

impl ClusterSpec {
    /// Nothing described: the planner's default cluster is assumed (and the output says so).
    pub fn is_default(&self) -> bool {
        let ClusterSpec { workers, memory, intra_bw, inter_bw, workers_per_node, peak_flops, cluster, preset } = self;
        cluster.is_none() && workers.is_none() && memory.is_none() && intra_bw.is_none() && inter_bw.is_none() && workers_per_node.is_none() && peak_flops.is_none() && preset.given().is_empty()
    }

    /// The cluster: defaults, then the file or the preset (the preset's peak is the one of
    /// `precision`, as `simulate` takes it), then each value given.
    pub fn cluster(&self, precision: Precision) -> Result<Cluster, DriverError> {
        let given = self.preset.given();
        let mut c = match &self.cluster {
            Some(path) if !path.is_file() && presets::device(&path.to_string_lossy()).is_ok() => self.preset.cluster(&path.to_string_lossy(), precision, None)?.cluster,
            _ if !given.is_empty() => return Err(DriverError::msg(format!("{} need(s) a device preset in --cluster", given.join(", ")))),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| DriverError::Read { path: path.clone(), source })?;
                Cluster::from_toml(&text).map_err(|e| DriverError::msg(format!("{}: {e}", path.display())))?
            }
            None => Cluster::default(),
        };
        let bad = |flag: &str, e: &dyn std::fmt::Display| DriverError::msg(format!("{flag}: {e}"));
        if let Some(w) = self.workers {
            c.workers = w;
        }
        if let Some(m) = &self.memory {
            c.memory_per_worker = parse_bytes(m).map_err(|e| bad("--memory", &e))?;
        }
        if let Some(b) = &self.intra_bw {
            c.intra_bw = parse_bandwidth(b).map_err(|e| bad("--intra-bw", &e))?;
        }
        if let Some(b) = &self.inter_bw {
            c.inter_bw = parse_bandwidth(b).map_err(|e| bad("--inter-bw", &e))?;
        }
        if let Some(n) = self.workers_per_node {
            c.workers_per_node = n;
        }
        if let Some(f) = &self.peak_flops {
            c.peak_flops = parse_flops(f).map_err(|e| bad("--peak-flops", &e))?;
        }
        Ok(c)
    }
}

/// Reads a profile written by `pipewright profile`.
pub fn read_profile(path: &Path) -> Result<Profile, DriverError> {
    let text = std::fs::read_to_string(path).map_err(|source| DriverError::Read { path: path.to_path_buf(), source })?;
    Profile::from_json(&text).map_err(|e| DriverError::msg(format!("{}: {e}", path.display())))
}

/// What training will keep and compute in, as `plan` and `simulate` model it.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct TrainingShape {
    /// Optimizer whose state counts in memory (and in the update's time).
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    pub optimizer: Optimizer,
    /// Count an SGD momentum buffer per weight.
    #[arg(long)]
    pub momentum: bool,
    /// The compute type training will use (`train --precision`): the memory model's, and
    /// for `simulate` the device's fp32 peak or its tensor cores' (bf16/fp16).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
}

/// What `pipewright plan` is asked (its options).
#[derive(Clone, Debug, clap::Args)]
pub struct PlanSpec {
    /// The ONNX model file.
    pub model: PathBuf,
    #[command(flatten)]
    pub cluster: ClusterSpec,
    /// Global batch size (samples per optimizer step).
    #[arg(long, default_value_t = DEFAULT_GLOBAL_BATCH)]
    pub batch: u64,
    /// Fix the microbatch size.
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Fix the pipeline depth.
    #[arg(long)]
    pub stages: Option<u32>,
    /// Fix the data-parallel width: the replicas of the pipeline.
    #[arg(long)]
    pub width: Option<usize>,
    /// Explicit stage starts, by ONNX node name.
    #[arg(long, value_delimiter = ',')]
    pub cut: Vec<String>,
    /// How stages are balanced.
    #[arg(long, value_enum, default_value_t = Balance::Optimal)]
    pub balance: Balance,
    /// A profile from `pipewright profile` to calibrate the cost model.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    #[command(flatten)]
    pub training: TrainingShape,
    /// Schedules to consider: 2bw, flush, gpipe, zb-h1, zb-h2, interleaved-2, interleaved-4, zb-v (comma-separated), or all.
    #[arg(long, default_value = "all")]
    pub schedule: WordList<Schedule>,
    /// Fix activation recomputation; by default all three are tried.
    #[arg(long, value_enum)]
    pub recompute: Option<Recompute>,
    /// Fix how the workers are numbered; by default both are tried wherever they put
    /// different links under the stage boundaries or the gradient sums.
    #[arg(long, value_enum)]
    pub placement: Option<Placement>,
    /// Candidates to show.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the plan file (JSON, for `compile --plan`) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Print the result of a pass (`import`, `plan`, `partition`, or `all`) instead of
    /// the plan.
    #[arg(long, value_name = "PASS")]
    pub print_after: Option<PrintAfter>,
}

/// What a command prints: its standard output, and notes for standard error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Printed {
    pub stdout: String,
    pub notes: Vec<String>,
}

impl PlanSpec {
    /// The plan pass's request: a search on the described cluster.
    pub fn request(&self) -> Result<PlanRequest, DriverError> {
        let profile = self.profile.as_deref().map(read_profile).transpose()?;
        if self.balance == Balance::Profile && profile.is_none() {
            return Err(DriverError::msg("--balance profile needs --profile FILE (from `pipewright profile`)"));
        }
        let options = PlanOptions {
            global_batch: self.batch,
            schedules: self.schedule.0.clone(),
            stages: self.stages.map(|d| d as usize),
            width: self.width,
            cuts: (!self.cut.is_empty()).then(|| self.cut.clone()),
            balance: self.balance,
            optimizer: self.training.optimizer,
            momentum: self.training.momentum,
            precision: self.training.precision,
            top: self.top,
            microbatch: self.microbatch,
            recompute: self.recompute,
            placement: self.placement,
        };
        Ok(PlanRequest::Search { cluster: self.cluster.cluster(self.training.precision)?, options, profile })
    }
}

/// `pipewright plan`: the table (after the default cluster's note, when no cluster was
/// described), the plan file (the note then goes to standard error) or what
/// `--print-after` asked for.
pub fn plan_command(spec: &PlanSpec) -> Result<Printed, DriverError> {
    let print_after = spec.print_after.unwrap_or_default();
    let passes = PassOptions { print_after, ..PassOptions::default() };
    let planned = plan(&spec.model, &spec.request()?, &passes)?;
    if print_after != PrintAfter::None {
        return Ok(Printed { stdout: planned.printed, notes: Vec::new() });
    }
    let file = planned.file.ok_or_else(|| DriverError::msg(format!("{}: nothing was planned", spec.model.display())))?;
    let note = spec.cluster.is_default().then(|| DEFAULT_CLUSTER_NOTE.to_string());
    Ok(match (spec.json, note) {
        (true, note) => Printed { stdout: file.to_json() + "\n", notes: note.into_iter().collect() },
        (false, Some(note)) => Printed { stdout: format!("note: {note}\n{}", file.plan.text()), notes: Vec::new() },
        (false, None) => Printed { stdout: file.plan.text(), notes: Vec::new() },
    })
}

/// What `pipewright compile` is asked (its options).
#[derive(Clone, Debug, clap::Args)]
pub struct CompileSpec {
    /// The ONNX model file.
    pub model: PathBuf,
    /// A plan from `pipewright plan --json`: its depth, stage starts, microbatch,
    /// microbatches, replicas, recomputation and schedule, as planned.
    #[arg(long, conflicts_with_all = ["stages", "schedule", "recompute", "microbatch", "microbatches", "batch"])]
    pub plan: Option<PathBuf>,
    /// Pipeline depth; the stages are cut to balance predicted compute. Without this or
    /// --plan, the planner chooses every value on its default cluster.
    #[arg(long)]
    pub stages: Option<u32>,
    /// The build folder (created if missing).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = Schedule::TwoBw)]
    pub schedule: Schedule,
    /// Activation recomputation.
    #[arg(long, value_enum, default_value_t = Recompute::None)]
    pub recompute: Recompute,
    /// Samples per microbatch, recorded in the build for `train`.
    #[arg(long)]
    pub microbatch: Option<u64>,
    /// Microbatches per step, recorded in the build for `train` (2BW needs at least the depth).
    #[arg(long, requires = "stages")]
    pub microbatches: Option<u64>,
    /// How the MPI ranks of a job with replicas are numbered, recorded in the build
    /// (stage-major when not given; a plan carries its own).
    #[arg(long, value_enum, requires = "stages")]
    pub placement: Option<Placement>,
    /// Global batch size the planner searches for (without --stages or --plan).
    #[arg(long, conflicts_with = "stages")]
    pub batch: Option<u64>,
    /// Also write `stageK`: a copy of this binary with the stage module appended (run it
    /// without arguments to print its module, with training options to run its stage).
    #[arg(long)]
    pub executables: bool,
    /// Also write each stage's forward subgraph as ONNX (`stageK.onnx`), e.g. to check a
    /// stage with onnxruntime. It holds a second copy of the stage's weights.
    #[arg(long)]
    pub stage_onnx: bool,
    /// Print the result of a pass, or of `all`.
    #[arg(long, value_name = "PASS")]
    pub print_after: Option<PrintAfter>,
    /// Stop after this pass (the build folder is written only when `lower` ran).
    #[arg(long, value_enum)]
    pub stop_after: Option<PassName>,
    /// Print the time each pass and each kind of output file took (stderr).
    #[arg(long)]
    pub timings: bool,
    /// Give each node reading an initializer the exporter merged (identical values, e.g.
    /// every LayerNorm's ones) its own copy, trained separately, instead of one tied
    /// weight; `export` writes the copies into the model. (Nodes of modules that hold no
    /// parameter read a frozen copy either way.)
    #[arg(long)]
    pub untie_merged: bool,
    /// Train these initializers baked for the export batch (named by compile's note, e.g. a
    /// class token the exporter expanded to the batch; a leading extent of k rows per sample
    /// is expanded to k times the batch) as one slice shared by the whole batch, instead of
    /// keeping them frozen; not for attention masks. (One the default exporter records as
    /// a parameter it expanded to the batch, or looked up at fixed positions, trains so
    /// without asking.)
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    pub train_batch_baked: Vec<String>,
    /// Keep training the one-element initializers the model reads only as attention scales
    /// (a fixed-batch dynamo export's `[1]` scale), leaving those attentions spelled out,
    /// instead of making their value the fused attention's scale.
    #[arg(long)]
    pub train_attention_scales: bool,
    /// Keep these initializers frozen (not trained), as a parameter PyTorch does not train
    /// (`requires_grad=False`) or a part being fine-tuned around; `export` writes them
    /// back unchanged. (Sinusoidal position tables are kept frozen without asking.)
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    pub freeze: Vec<String>,
    /// Train these sinusoidal position tables (named by compile's note), which are
    /// otherwise kept frozen as PyTorch keeps them: for a learned position embedding that
    /// starts from sinusoids.
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    pub train_sinusoidal: Vec<String>,
    /// Train the model as exported where PyTorch's default exporter dropped all-zero
    /// biases (a Conv or Gemm without the bias its exported program lists), instead of
    /// restoring them as zero biases that train as the source model's do.
    #[arg(long)]
    pub no_restore_biases: bool,
}

impl CompileSpec {
    /// The compile request: a plan file field for field, a fixed depth, or a search on the
    /// default cluster.
    pub fn request(&self) -> Result<CompileRequest, DriverError> {
        for (flag, v) in [("--stages", self.stages.map(u64::from)), ("--microbatch", self.microbatch), ("--microbatches", self.microbatches), ("--batch", self.batch)] {
            if v == Some(0) {
                return Err(DriverError::msg(format!("{flag} must be at least 1")));
            }
        }
        let plan = if let Some(path) = &self.plan {
            PlanRequest::File { path: path.clone(), file: Box::new(PlanFile::read(path)?) }
        } else if let Some(depth) = self.stages {
            PlanRequest::Stages { depth, schedule: self.schedule, recompute: self.recompute, microbatch: self.microbatch, microbatches: self.microbatches, placement: self.placement.unwrap_or_default() }
        } else {
            let options = PlanOptions {
                global_batch: self.batch.unwrap_or(DEFAULT_GLOBAL_BATCH),
                schedules: vec![self.schedule],
                recompute: Some(self.recompute),
                microbatch: self.microbatch,
                top: 1,
                ..PlanOptions::default()
            };
            PlanRequest::Search { cluster: Cluster::default(), options, profile: None }
        };
        let executable = match self.executables {
            true => Some(std::env::current_exe().map_err(|e| DriverError::msg(format!("cannot locate the pipewright binary: {e}")))?),
            false => None,
        };
        Ok(CompileRequest {
            model: self.model.clone(),
            plan,
            output: self.output.clone(),
            executable,
            stage_onnx: self.stage_onnx,
            passes: PassOptions { print_after: self.print_after.unwrap_or_default(), stop_after: self.stop_after, ..PassOptions::default() },
            import: ImportOptions {
                untie_merged: self.untie_merged,
                train_batch_baked: self.train_batch_baked.clone(),
                train_attention_scales: self.train_attention_scales,
                freeze: self.freeze.clone(),
                train_sinusoidal: self.train_sinusoidal.clone(),
                no_restore_biases: self.no_restore_biases,
                ..ImportOptions::default()
            },
        })
    }
}

/// `pipewright compile`: runs the passes and writes the build; returns what they printed
/// and the notes and summary line the command shows.
pub fn compile_command(spec: &CompileSpec) -> Result<(Compiled, Printed), DriverError> {
    let compiled = compile(&spec.request()?)?;
    let notes = compiled.choices.as_ref().map(|c| c.lines()).unwrap_or_default();
    let mut stdout = compiled.printed.clone();
    if let Some((manifest, _)) = &compiled.written {
        let decision = compiled.decision.as_ref().map(|d| d.text()).unwrap_or_default();
        stdout.push_str(&format!("compiled {} into {} stage(s) in {}: {decision}\n", spec.model.display(), manifest.stages.len(), spec.output.display()));
    }
    Ok((compiled, Printed { stdout, notes }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ClusterSpec {
        ClusterSpec::default()
    }

    /// Values override the defaults; bad values name their flag; a file is read first.
    #[test]
    fn clusters_build_from_defaults_file_and_values() {
        assert!(spec().is_default());
        assert_eq!(spec().cluster(Precision::Fp32).unwrap(), Cluster::default());
        let c = ClusterSpec { workers: Some(16), memory: Some("8GiB".into()), inter_bw: Some("25Gbit/s".into()), ..spec() }.cluster(Precision::Fp32).unwrap();
        assert_eq!((c.workers, c.memory_per_worker), (16, 8 << 30));
        assert_eq!(c.inter_bw, 25e9 / 8.0);
        let e = ClusterSpec { memory: Some("lots".into()), ..spec() }.cluster(Precision::Fp32).unwrap_err().to_string();
        assert!(e.starts_with("--memory: "), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "workers = 4\n").unwrap();
        let c = ClusterSpec { cluster: Some(file.clone()), workers_per_node: Some(2), ..spec() }.cluster(Precision::Fp32).unwrap();
        assert_eq!((c.workers, c.workers_per_node), (4, 2));
        let e = ClusterSpec { cluster: Some(dir.path().join("none.toml")), ..spec() }.cluster(Precision::Fp32).unwrap_err().to_string();
        assert!(e.contains("none.toml: cannot read"), "{e}");
        // A device preset, as `simulate` takes it: the tensor cores' peak for fp16, the
        // network link shared by the server, what each kernel achieves; values override it.
        let v100 = ClusterSpec { cluster: Some("V100-16GB".into()), preset: PresetShape { servers: Some(8), ..PresetShape::default() }, ..spec() };
        let c = v100.cluster(Precision::Fp16).unwrap();
        assert_eq!((c.workers, c.workers_per_node, c.peak_flops, c.server_bw), (64, 8, 125e12, Some(25e9 / 8.0)));
        assert_eq!(c.achievable.map(|a| a.sms), Some(80));
        assert_eq!(ClusterSpec { memory: Some("32GiB".into()), ..v100 }.cluster(Precision::Fp32).unwrap().memory_per_worker, 32 << 30);
        let e = ClusterSpec { preset: PresetShape { servers: Some(2), ..PresetShape::default() }, ..spec() }.cluster(Precision::Fp32).unwrap_err().to_string();
        assert_eq!(e, "--servers need(s) a device preset in --cluster");
        let e = ClusterSpec { cluster: Some("V100-16GB".into()), preset: PresetShape { network: Some("carrier-pigeon".into()), ..PresetShape::default() }, ..spec() }.cluster(Precision::Fp32).unwrap_err().to_string();
        assert!(e.starts_with("--network: unknown network preset \"carrier-pigeon\""), "{e}");
    }

    fn compile_spec(output: &Path) -> CompileSpec {
        CompileSpec {
            model: crate::compile::tests::model("mlp.onnx"),
            plan: None,
            stages: Some(2),
            output: output.to_path_buf(),
            schedule: Schedule::Flush,
            recompute: Recompute::None,
            microbatch: None,
            microbatches: Some(4),
            placement: None,
            batch: None,
            executables: false,
            stage_onnx: false,
            print_after: None,
            stop_after: None,
            timings: false,
            untie_merged: false,
            train_batch_baked: Vec::new(),
            train_attention_scales: false,
            freeze: Vec::new(),
            train_sinusoidal: Vec::new(),
            no_restore_biases: false,
        }
    }

    /// A fixed depth compiles to a build whose summary line carries the decision; a zero
    /// is refused naming the flag; the planner's table notes the default cluster.
    #[test]
    fn compile_and_plan_commands_print_what_they_decided() {
        let dir = tempfile::tempdir().unwrap();
        let (_, printed) = compile_command(&compile_spec(&dir.path().join("b"))).unwrap();
        assert!(printed.stdout.contains("into 2 stage(s)") && printed.stdout.contains("d=2 schedule=flush recompute=none m=4 (compile --stages 2)"), "{}", printed.stdout);
        let e = CompileSpec { microbatches: Some(0), ..compile_spec(dir.path()) }.request().unwrap_err().to_string();
        assert_eq!(e, "--microbatches must be at least 1");
        let plan = PlanSpec {
            model: crate::compile::tests::model("mlp.onnx"),
            cluster: spec(),
            batch: 64,
            microbatch: None,
            stages: Some(2),
            width: None,
            cut: Vec::new(),
            balance: Balance::Optimal,
            profile: None,
            training: TrainingShape { optimizer: Optimizer::Sgd, momentum: false, precision: Precision::Fp32 },
            schedule: WordList(vec![Schedule::TwoBw]),
            recompute: Some(Recompute::None),
            placement: None,
            top: 1,
            json: false,
            print_after: None,
        };
        let table = plan_command(&plan).unwrap();
        assert!(table.stdout.starts_with(&format!("note: {DEFAULT_CLUSTER_NOTE}\n")), "{}", table.stdout);
        let json = plan_command(&PlanSpec { json: true, ..plan.clone() }).unwrap();
        assert!(json.stdout.starts_with('{') && json.notes == [DEFAULT_CLUSTER_NOTE], "{json:?}");
        let e = plan_command(&PlanSpec { balance: Balance::Profile, ..plan }).unwrap_err().to_string();
        assert_eq!(e, "--balance profile needs --profile FILE (from `pipewright profile`)");
    }
}
