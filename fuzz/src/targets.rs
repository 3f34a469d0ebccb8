//! The fuzz targets: each runs one of pipewright's loaders on bytes in memory. `Ok` means
//! the loader accepted the input, `Err` carries its error message (a clean refusal);
//! anything else (a panic, a hang, an unbounded allocation, an abort) is a finding.

use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use pipewright_ir::{import_bytes, ImportOptions};
use pipewright_runtime::build::InputSpec;
use pipewright_runtime::data::{parse_npy, Dataset};
use pipewright_runtime::exec::tensor_from_bytes;
use pipewright_runtime::pipeline::{decode_checkpoint, decode_stage};
use pipewright_ops::DType;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// `pipewright_ir::import_bytes`: protobuf parse, checks, shape inference.
    Onnx,
    /// `pipewright_runtime::module::decode_module`: envelope, checksum, program, weights.
    Module,
    /// `parse_npy` and the tensor built from it.
    Npy,
    /// `Dataset::from_npz_reader` (zip, .npy members, model-input checks).
    Npz,
    /// `Dataset::from_safetensors_bytes`.
    Safetensors,
    /// `decode_checkpoint` on a mutated `checkpoint.json`, with the seed's stage files.
    Checkpoint,
    /// `decode_stage` on a mutated checkpoint stage file.
    CheckpointStage,
}

impl Target {
    pub const ALL: [Target; 7] =
        [Target::Onnx, Target::Module, Target::Npy, Target::Npz, Target::Safetensors, Target::Checkpoint, Target::CheckpointStage];

    pub fn name(self) -> &'static str {
        match self {
            Target::Onnx => "onnx",
            Target::Module => "module",
            Target::Npy => "npy",
            Target::Npz => "npz",
            Target::Safetensors => "safetensors",
            Target::Checkpoint => "checkpoint",
            Target::CheckpointStage => "checkpoint-stage",
        }
    }

    pub fn from_name(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == s)
    }

    /// The folder under `fuzz/seeds/` holding this target's seeds, and their file suffix.
    pub fn seeds(self) -> (&'static str, &'static str) {
        match self {
            Target::Onnx => ("onnx", ".onnx"),
            Target::Module => ("module", ".pwm"),
            Target::Npy => ("npy", ".npy"),
            Target::Npz => ("npz", ".npz"),
            Target::Safetensors => ("safetensors", ".safetensors"),
            Target::Checkpoint => ("checkpoint", ".json"),
            Target::CheckpointStage => ("checkpoint", ".safetensors"),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the targets need besides the input: an empty folder the ONNX importer may look
/// for external data in (so a mutated path finds nothing real), and the seed checkpoint's
/// files, which the checkpoint targets pair with the mutated one.
pub struct Context {
    model_dir: PathBuf,
    checkpoint_files: HashMap<String, Vec<u8>>,
    inputs: Vec<InputSpec>,
}

impl Context {
    /// `seed_root` is `fuzz/seeds`; its `checkpoint/` folder is a checkpoint step folder.
    pub fn new(seed_root: &Path) -> Result<Context, String> {
        let model_dir = std::env::temp_dir().join(format!("pipewright-fuzz-empty-{}", std::process::id()));
        std::fs::create_dir_all(&model_dir).map_err(|e| format!("{}: cannot create: {e}", model_dir.display()))?;
        let ck = seed_root.join("checkpoint");
        let mut checkpoint_files = HashMap::new();
        for e in std::fs::read_dir(&ck).map_err(|e| format!("{}: cannot read the seed checkpoint: {e}", ck.display()))? {
            let path = e.map_err(|e| format!("{}: {e}", ck.display()))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            checkpoint_files.insert(name, bytes);
        }
        if !checkpoint_files.contains_key("checkpoint.json") {
            return Err(format!("{}: no checkpoint.json (the seed checkpoint)", ck.display()));
        }
        // The training data seeds are for mlp-small.onnx: input [N, 64] f32, label [N] i64.
        let inputs = vec![InputSpec { name: "input".into(), elem: DType::F32, per_sample: vec![64] }];
        Ok(Context { model_dir, checkpoint_files, inputs })
    }

    /// Runs `target` on `data`: `Ok` if accepted, `Err(message)` if refused.
    pub fn execute(&self, target: Target, data: &[u8]) -> Result<(), String> {
        match target {
            Target::Onnx => import_bytes(data, &self.model_dir, &ImportOptions::default()).map(drop).map_err(|e| e.to_string()),
            Target::Module => pipewright_runtime::module::decode_module(data).map(drop).map_err(|e| e.to_string()),
            Target::Npy => {
                let a = parse_npy(data).map_err(|e| format!("{e:#}"))?;
                tensor_from_bytes(a.elem, &a.shape, &a.data).map(drop).map_err(|e| e.to_string())
            }
            Target::Npz => Dataset::from_npz_reader("fuzz.npz", Cursor::new(data), &self.inputs, Some("label"))
                .map(drop)
                .map_err(|e| format!("{e:#}")),
            Target::Safetensors => Dataset::from_safetensors_bytes("fuzz.safetensors", data, &self.inputs, Some("label"))
                .map(drop)
                .map_err(|e| format!("{e:#}")),
            Target::Checkpoint => decode_checkpoint(Path::new("fuzz-checkpoint"), data, |file| {
                self.checkpoint_files.get(file).cloned().ok_or_else(|| std::io::ErrorKind::NotFound.into())
            })
            .map(drop)
            .map_err(|e| e.to_string()),
            Target::CheckpointStage => {
                // The seeds hold stages 0 and 1; either may be what the mutation left.
                let first = decode_stage(data, 0).map(drop);
                first.or_else(|_| decode_stage(data, 1).map(drop))
            }
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.model_dir);
    }
}
