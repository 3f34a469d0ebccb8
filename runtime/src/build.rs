//! The build folder: what `pipewright compile` writes and `train`, `worker`, `export` and
//! the stage executables read. Its contract is the [`Manifest`] (`pipeline.toml`), read
//! and written through this one struct: the source model, the pipeline id, the decided
//! pipeline values (core's [`Decision`]) and how the stage modules connect.
//!
//! The manifest is versioned. [`Manifest::parse`] first reads only `format` and `version`,
//! so a manifest of another pipewright version (or another tool) is refused with a message
//! naming its version before anything else is read. [`Build::open`] loads the stage
//! modules and checks each against the manifest ([`Manifest::check_module`], the one
//! pipeline-id check every reader uses).
//!
//! Plain Rust: builds without libtorch.

use std::path::{Path, PathBuf};

use pipewright_core::format::{Header, Mismatch};
use pipewright_core::fs::{write_atomic, WriteError};
use pipewright_core::{Decision, ImportChoices, Recompute, Schedule};
use serde::{Deserialize, Serialize};

use pipewright_ops::DType;
use crate::module::{read_module, ModuleError, StageModule};
use crate::program::{split_batch_axis, Extent};

/// The manifest's file name in a build folder.
pub const MANIFEST_FILE: &str = "pipeline.toml";
/// The manifest's `format`.
pub const BUILD_FORMAT: &str = "pipewright-build";
/// The manifest version this pipewright writes and reads. Version 1 (before the field
/// existed) had an untyped `[plan]` table that nothing read back.
pub const BUILD_VERSION: u32 = 2;

/// `pipeline.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The source model, as an absolute path.
    pub model: String,
    /// CRC-32 of the source model's bytes (8 hex digits).
    pub model_crc32: String,
    /// The id every stage module of this compile carries (`Program::pipeline`).
    pub pipeline_id: String,
    pub pipeline: Decision,
    /// What import decided about initializers that changes what trains (frozen
    /// batch-baked constants, exporter-merged weights, untied or not); `train` repeats it.
    #[serde(default, skip_serializing_if = "ImportChoices::is_empty")]
    pub choices: ImportChoices,
    /// The stages in pipeline order.
    #[serde(rename = "stage")]
    pub stages: Vec<StageEntry>,
}

/// One stage of the build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageEntry {
    pub index: u32,
    /// The stage module file, relative to the build folder.
    pub module: String,
    /// The stage's forward subgraph as ONNX, relative to the build folder (written on
    /// request: `compile --stage-onnx`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onnx: Option<String>,
    pub nodes: usize,
    pub received: Vec<TensorEntry>,
    pub sent: Vec<TensorEntry>,
    pub graph_inputs: Vec<TensorEntry>,
    pub graph_outputs: Vec<TensorEntry>,
}

/// A tensor crossing a stage's edge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The wire name for boundary tensors (`x@stage2`), else the graph's name.
    pub name: String,
    /// For boundary tensors: the value's name in the sending stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// For boundary tensors: the stage on the other side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<u32>,
    pub dtype: DType,
    /// Extents: `N` for the microbatch size, `16*N` for a multiple of it, or a number.
    #[serde(with = "extent_text")]
    pub shape: Vec<Extent>,
}

/// What a training input looks like: graph input name, element type and per-sample shape
/// (the shape without the leading batch axis).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSpec {
    pub name: String,
    pub elem: DType,
    pub per_sample: Vec<i64>,
}

/// A build folder that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{}: cannot read: {source} (run `pipewright compile` first)", .path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: not a pipewright build manifest: {reason}", .path.display())]
    NotAManifest { path: PathBuf, reason: String },
    #[error("{}: written by another pipewright (build format version {found}); this pipewright reads version {BUILD_VERSION}: compile the model again", .path.display())]
    Version { path: PathBuf, found: u32 },
    #[error("{}: {reason}", .path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Module(#[from] ModuleError),
    #[error("{}: this stage module comes from another compile (pipeline id {found:?}) than {} ({expected:?}); recompile, or copy the whole build folder", .path.display(), .manifest.display())]
    OtherCompile { path: PathBuf, manifest: PathBuf, found: String, expected: String },
    #[error(transparent)]
    Write(#[from] WriteError),
}

impl Manifest {
    /// Parses a manifest; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest, BuildError> {
        let not_one = |reason: String| BuildError::NotAManifest { path: path.to_path_buf(), reason };
        let header: Header = toml::from_str(text).map_err(|e| not_one(first_line(&e)))?;
        match header.check(BUILD_FORMAT, BUILD_VERSION) {
            Ok(()) => {}
            Err(Mismatch::Version(found)) => return Err(BuildError::Version { path: path.to_path_buf(), found }),
            Err(Mismatch::NoVersion) => return Err(not_one("it has no format version".into())),
            Err(Mismatch::Foreign(other)) => return Err(not_one(format!("its format is {other:?}"))),
            // Version 1 manifests had neither field.
            Err(Mismatch::NoFormat) if text.contains("stage_order") => return Err(BuildError::Version { path: path.to_path_buf(), found: 1 }),
            Err(Mismatch::NoFormat) => return Err(not_one(format!("it has no `format = \"{BUILD_FORMAT}\"`"))),
        }
        let m: Manifest = toml::from_str(text).map_err(|e| not_one(first_line(&e)))?;
        m.check().map_err(|reason| BuildError::Invalid { path: path.to_path_buf(), reason })?;
        Ok(m)
    }

    /// Reads `BUILD/pipeline.toml`.
    pub fn read(build: &Path) -> Result<Manifest, BuildError> {
        let path = build.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| BuildError::Read { path: path.clone(), source })?;
        Self::parse(&text, &path)
    }

    /// The manifest as TOML: the text `toml::to_string_pretty` gives for the whole struct,
    /// with the stage list serialised in parallel chunks (a deep pipeline lists hundreds of
    /// thousands of boundary tensors; at 8,192 stages serialising took seconds).
    pub fn to_toml(&self) -> String {
        /// The fields before the stage list, borrowed (the layout stays the struct's).
        #[derive(Serialize)]
        struct Head<'a> {
            format: &'a str,
            version: u32,
            model: &'a str,
            model_crc32: &'a str,
            pipeline_id: &'a str,
            pipeline: &'a Decision,
            #[serde(skip_serializing_if = "ImportChoices::is_empty")]
            choices: &'a ImportChoices,
        }
        #[derive(Serialize)]
        struct Stages<'a> {
            stage: &'a [StageEntry],
        }
        let head = Head {
            format: &self.format,
            version: self.version,
            model: &self.model,
            model_crc32: &self.model_crc32,
            pipeline_id: &self.pipeline_id,
            pipeline: &self.pipeline,
            choices: &self.choices,
        };
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
        let chunk = self.stages.len().div_ceil(workers).max(1);
        let parts: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = self.stages.chunks(chunk).map(|c| s.spawn(move || pretty(&Stages { stage: c }))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let mut text = pretty(&head);
        for part in parts {
            text.push('\n');
            text.push_str(&part);
        }
        text
    }

    /// Writes `BUILD/pipeline.toml` atomically.
    pub fn write(&self, build: &Path) -> Result<(), BuildError> {
        Ok(write_atomic(build.join(MANIFEST_FILE), self.to_toml().as_bytes())?)
    }

    /// Consistency of what a well-formed manifest says.
    fn check(&self) -> Result<(), String> {
        if self.stages.is_empty() {
            return Err("no stages".into());
        }
        if self.stages.len() != self.pipeline.depth as usize {
            return Err(format!("{} stages listed for a pipeline of depth {}", self.stages.len(), self.pipeline.depth));
        }
        if let Some(k) = self.stages.iter().enumerate().find(|(k, s)| s.index as usize != *k).map(|(k, _)| k) {
            return Err(format!("stage entry {k} says it is stage {}", self.stages[k].index));
        }
        for (k, s) in self.stages.iter().enumerate() {
            for name in std::iter::once(&s.module).chain(&s.onnx) {
                pipewright_core::fs::plain_name(name).map_err(|e| format!("stage {k}: {e}; the manifest was edited"))?;
            }
        }
        if self.pipeline.microbatch == Some(0) || self.pipeline.microbatches == Some(0) || self.pipeline.replicas == Some(0) {
            return Err("microbatch, microbatches and replicas must be at least 1".into());
        }
        Ok(())
    }

    /// What every part of this pipeline must agree on (see [`Identity`]).
    pub fn identity(&self) -> Identity {
        Identity { pipeline: self.pipeline_id.clone(), depth: self.pipeline.depth, schedule: self.pipeline.schedule, recompute: Some(self.pipeline.recompute) }
    }

    /// Checks that `module`, read from `path`, is stage `stage` of this compile.
    pub fn check_module(&self, stage: usize, module: &StageModule, path: &Path, manifest: &Path) -> Result<(), BuildError> {
        let p = &module.header.params;
        match self.identity().agree(&Identity::of_module(module)) {
            Err(d) if d.field == Field::Pipeline => {
                return Err(BuildError::OtherCompile { path: path.to_path_buf(), manifest: manifest.to_path_buf(), found: d.theirs, expected: d.ours })
            }
            Err(d) => return Err(BuildError::Invalid { path: path.to_path_buf(), reason: format!("the module's {} but {}", d.theirs_text(), d.ours_text(&manifest.display().to_string())) }),
            Ok(()) if p.stage as usize != stage => {
                return Err(BuildError::Invalid { path: path.to_path_buf(), reason: format!("the module is stage {} but {} lists it as stage {stage}", p.stage, manifest.display()) })
            }
            Ok(()) => {}
        }
        Ok(())
    }

    /// The graph inputs the pipeline reads, first use first, each once.
    pub fn input_specs(&self) -> Result<Vec<InputSpec>, String> {
        let mut out: Vec<InputSpec> = Vec::new();
        for t in self.stages.iter().flat_map(|s| &s.graph_inputs) {
            if out.iter().any(|o| o.name == t.name) {
                continue;
            }
            let per_sample = split_batch_axis(&t.shape).filter(|(axis, _)| *axis == 0).map(|(_, rest)| rest).ok_or_else(|| {
                format!("input {:?} has shape {}, which has no batch axis N first followed by fixed extents", t.name, shape_text(&t.shape))
            })?;
            out.push(InputSpec { name: t.name.clone(), elem: t.dtype, per_sample });
        }
        Ok(out)
    }

    /// The graph outputs the last stages produce.
    pub fn outputs(&self) -> impl Iterator<Item = &TensorEntry> {
        self.stages.iter().flat_map(|s| &s.graph_outputs)
    }

    /// The per-sample shape of graph output `name`: its shape without the batch axis,
    /// wherever that is (`None` when absent or not batched).
    pub fn output_per_sample(&self, name: &str) -> Option<Vec<i64>> {
        self.outputs().find(|t| t.name == name).and_then(|t| split_batch_axis(&t.shape)).map(|(_, rest)| rest)
    }

    /// The stage module files, in stage order.
    pub fn module_paths(&self, build: &Path) -> Vec<PathBuf> {
        self.stages.iter().map(|s| build.join(&s.module)).collect()
    }
}

/// What every part of one pipeline must agree on: the compile it comes from (its pipeline
/// id) and the decision's depth, schedule and recomputation. The manifest, each stage
/// module's header, a checkpoint and every MPI rank carry it, and [`Identity::agree`] is
/// the one check between any two of them. (The pipeline id hashes the decision, so two
/// parts of one compile agree on everything; the fields make the message say what
/// differs.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub pipeline: String,
    pub depth: u32,
    pub schedule: Schedule,
    /// `None` where the part does not record it (a checkpoint).
    pub recompute: Option<Recompute>,
}

/// An [`Identity`] field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Pipeline,
    Depth,
    Schedule,
    Recompute,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::Pipeline => "pipeline id",
            Field::Depth => "depth",
            Field::Schedule => "schedule",
            Field::Recompute => "recompute",
        }
    }
}

/// The first field in which two identities differ, with both values as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disagreement {
    pub field: Field,
    pub ours: String,
    pub theirs: String,
}

impl Disagreement {
    /// `schedule is flush`: what the other part says.
    pub fn theirs_text(&self) -> String {
        format!("{} is {}", self.field.name(), self.theirs)
    }

    /// `pipeline.toml says 2bw`: what this part (`who`) says.
    pub fn ours_text(&self, who: &str) -> String {
        format!("{who} says {}", self.ours)
    }
}

impl Identity {
    /// A stage module's: its program's pipeline id and its header's decision.
    pub fn of_module(m: &StageModule) -> Identity {
        let p = &m.header.params;
        Identity { pipeline: m.program.pipeline.clone(), depth: p.depth, schedule: p.schedule, recompute: Some(p.recompute) }
    }

    /// The first field in which `other` differs from `self` (recomputation only where
    /// both record it).
    pub fn agree(&self, other: &Identity) -> Result<(), Disagreement> {
        let differ = |field, ours: String, theirs: String| Err(Disagreement { field, ours, theirs });
        if self.pipeline != other.pipeline {
            return differ(Field::Pipeline, self.pipeline.clone(), other.pipeline.clone());
        }
        if self.depth != other.depth {
            return differ(Field::Depth, self.depth.to_string(), other.depth.to_string());
        }
        if self.schedule != other.schedule {
            return differ(Field::Schedule, self.schedule.to_string(), other.schedule.to_string());
        }
        match (self.recompute, other.recompute) {
            (Some(a), Some(b)) if a != b => differ(Field::Recompute, a.to_string(), b.to_string()),
            _ => Ok(()),
        }
    }

    /// The fields by name, as MPI ranks exchange them with the rest of their run settings.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![(Field::Pipeline.name(), self.pipeline.clone()), (Field::Depth.name(), self.depth.to_string()), (Field::Schedule.name(), self.schedule.to_string())];
        if let Some(r) = self.recompute {
            v.push((Field::Recompute.name(), r.to_string()));
        }
        v
    }
}

/// `[N,3,4]`.
pub fn shape_text(shape: &[Extent]) -> String {
    let dims: Vec<String> = shape.iter().map(|&e| extent_text::text(e)).collect();
    format!("[{}]", dims.join(","))
}

/// TOML of plain data (strings, numbers, lists of tables), which cannot fail to serialise.
fn pretty<T: Serialize>(value: &T) -> String {
    toml::to_string_pretty(value).unwrap_or_default()
}

fn first_line(e: &toml::de::Error) -> String {
    e.to_string().lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid TOML").trim().to_string()
}

/// Extents as text: `N`, `16*N`, `64`.
pub mod extent_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::program::Extent;

    /// `N`, `16*N` or a number.
    pub fn text(e: Extent) -> String {
        match e {
            Extent::Fixed(v) => v.to_string(),
            Extent::Batch(1) => "N".into(),
            Extent::Batch(k) => format!("{k}*N"),
        }
    }

    /// Parses [`text`]'s output.
    pub fn parse(s: &str) -> Option<Extent> {
        if s == "N" {
            return Some(Extent::Batch(1));
        }
        if let Some(k) = s.strip_suffix("*N") {
            return k.parse().ok().map(Extent::Batch);
        }
        s.parse().ok().map(Extent::Fixed)
    }

    pub fn serialize<S: Serializer>(shape: &[Extent], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(shape.iter().map(|&e| text(e)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Extent>, D::Error> {
        let texts = Vec::<String>::deserialize(d)?;
        texts
            .iter()
            .map(|t| parse(t).ok_or_else(|| serde::de::Error::custom(format!("extent {t:?} is not N, K*N or a number"))))
            .collect()
    }
}


/// A build folder: its manifest and stage modules, checked to belong together.
#[derive(Clone, Debug)]
pub struct Build {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub modules: Vec<StageModule>,
}

impl Build {
    /// Reads the manifest and every stage module it lists, checking each module.
    pub fn open(dir: &Path) -> Result<Build, BuildError> {
        let manifest = Manifest::read(dir)?;
        let manifest_path = dir.join(MANIFEST_FILE);
        let mut modules = Vec::with_capacity(manifest.stages.len());
        for (k, entry) in manifest.stages.iter().enumerate() {
            let path = &pipewright_core::fs::file_in(dir, &entry.module).map_err(|reason| BuildError::Invalid { path: manifest_path.clone(), reason: format!("stage {k}: {reason}") })?;
            let module = read_module(path)?;
            manifest.check_module(k, &module, path, &manifest_path)?;
            modules.push(module);
        }
        Ok(Build { dir: dir.to_path_buf(), manifest, modules })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let t = |name: &str, shape: Vec<Extent>| TensorEntry { name: name.into(), value: None, peer: None, dtype: DType::F32, shape };
        Manifest {
            format: BUILD_FORMAT.into(),
            version: BUILD_VERSION,
            model: "/m.onnx".into(),
            model_crc32: "0000abcd".into(),
            pipeline_id: "id".into(),
            pipeline: Decision {
                depth: 2,
                schedule: Schedule::TwoBw,
                recompute: Recompute::Selective,
                microbatch: Some(32),
                microbatches: Some(4),
                replicas: None,
                placement: pipewright_core::Placement::StageMajor,
                origin: "plan p.json".into(),
            },
            choices: ImportChoices::default(),
            stages: (0..2)
                .map(|k| StageEntry {
                    index: k,
                    module: format!("stage{k}.pwm"),
                    onnx: Some(format!("stage{k}.onnx")),
                    nodes: 3,
                    received: Vec::new(),
                    sent: Vec::new(),
                    graph_inputs: if k == 0 { vec![t("x", vec![Extent::Batch(1), Extent::Fixed(64)])] } else { Vec::new() },
                    graph_outputs: if k == 1 { vec![t("y", vec![Extent::Batch(1), Extent::Fixed(10)])] } else { Vec::new() },
                })
                .collect(),
        }
    }

    /// The chunked serialisation is the whole struct's, byte for byte, for any stage count
    /// (chunks of one stage and of several).
    #[test]
    fn chunked_toml_is_the_whole_structs() {
        let mut m = manifest();
        for extra in 0..10 {
            assert_eq!(m.to_toml(), pretty(&m), "{} stages", m.stages.len());
            let mut s = m.stages[0].clone();
            s.index = 2 + extra;
            m.stages.push(s);
        }
        // With the import's choices too (a table between the pipeline and the stages), and
        // read back field for field.
        m.choices = ImportChoices {
            frozen_batch_baked: vec!["cls [2, 1, 8]".into()],
            exporter_constants: vec!["unsqueeze_7 [1, 1, 8, 8]".into()],
            trained_batch_baked: vec!["token [1, 1, 8]".into()],
            frozen_attention_scales: vec!["val_88 [1]".into()],
            merged: vec![pipewright_core::MergedInitializer { name: "ln.weight".into(), uses: 9, weights: Some(9) }],
            untied: true,
            split_buffers: vec!["ones".into()],
            retied: vec![pipewright_core::FoldedImage { name: "val_182".into(), source: "wte".into(), perm: vec![1, 0] }],
            computed_from_parameters: vec!["index (clone, index, rel_pos_h)".into()],
            missing_parameters: vec!["conv.bias".into()],
            fused_batchnorms: vec!["model.bn1".into()],
            script_fused_batchnorms: vec!["/model/down1/down1.0/Conv".into()],
            script_computed_constants: vec!["onnx::Add_968 [1, 64]".into()],
            restored_biases: vec!["head.bias [10]".into()],
            frozen_on_request: vec!["pos.weight [32, 16]".into()],
            frozen_sinusoidal: vec!["model.embed_positions.weight [8, 16]".into()],
            trained_sinusoidal: vec!["pe [8, 16]".into()],
            detached_reads: vec!["node_add_624 reads sub_150".into()],
            unplaced_detaches: vec!["node_linear".into()],
            padding_rows: vec!["node_embedding (row 1 of lm_head.weight)".into()],
            named_buffers: vec!["model.final_logits_bias [1, 64]".into()],
            weightless_reads: vec!["model.encoder.layer_norm.weight.constant".into()],
        };
        assert_eq!(m.to_toml(), pretty(&m));
        let back: Manifest = toml::from_str(&m.to_toml()).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn round_trips_field_for_field() {
        let m = manifest();
        let text = m.to_toml();
        assert!(text.contains("shape = [\n    \"N\",\n    \"64\",\n]"), "{text}");
        assert_eq!(Manifest::parse(&text, Path::new("pipeline.toml")).unwrap(), m);
        assert_eq!(m.input_specs().unwrap(), vec![InputSpec { name: "x".into(), elem: DType::F32, per_sample: vec![64] }]);
        assert_eq!(m.output_per_sample("y"), Some(vec![10]));
    }

    #[test]
    fn old_and_foreign_manifests_are_refused_by_version() {
        let p = Path::new("b/pipeline.toml");
        let old = "model = \"m.onnx\"\npipeline_id = \"x\"\nstage_order = [\"stage0.pwm\"]\n[plan]\nw = 4\n";
        let e = Manifest::parse(old, p).unwrap_err().to_string();
        assert_eq!(e, "b/pipeline.toml: written by another pipewright (build format version 1); this pipewright reads version 2: compile the model again");
        let newer = manifest().to_toml().replace("version = 2", "version = 3");
        assert!(Manifest::parse(&newer, p).unwrap_err().to_string().contains("build format version 3"));
        let foreign = "format = \"cargo\"\nversion = 2\n";
        assert_eq!(Manifest::parse(foreign, p).unwrap_err().to_string(), "b/pipeline.toml: not a pipewright build manifest: its format is \"cargo\"");
        let bad = manifest().to_toml().replace("depth = 2", "depth = 3");
        assert_eq!(Manifest::parse(&bad, p).unwrap_err().to_string(), "b/pipeline.toml: 2 stages listed for a pipeline of depth 3");
    }

    /// The one agreement check names the first field that differs; a module of this
    /// compile agrees with its manifest.
    #[test]
    fn identities_agree_or_name_the_first_difference() {
        let m = manifest();
        let ours = m.identity();
        let theirs = |f: fn(&mut Identity)| {
            let mut i = ours.clone();
            f(&mut i);
            ours.agree(&i).unwrap_err()
        };
        assert_eq!(ours.agree(&ours.clone()), Ok(()));
        let d = theirs(|i| i.schedule = Schedule::Flush);
        assert_eq!((d.theirs_text(), d.ours_text("pipeline.toml")), ("schedule is flush".to_string(), "pipeline.toml says 2bw".to_string()));
        assert_eq!(theirs(|i| i.pipeline = "other".into()).field, Field::Pipeline);
        assert_eq!(theirs(|i| i.depth = 3).field, Field::Depth);
        assert_eq!(theirs(|i| i.recompute = Some(Recompute::Full)).field, Field::Recompute);
        // A part that does not record recomputation agrees on it.
        assert_eq!(ours.agree(&Identity { recompute: None, ..ours.clone() }), Ok(()));
    }
}
