//! Training checkpoints: every stage's weights (both versions under 2BW), optimizer state
//! and running statistics after a given number of batches, so training can resume and
//! reach the same weights as an uninterrupted run.
//!
//! Layout: `DIR/step-000012/` holds `checkpoint.json` (step, depth, schedule, the
//! pipeline id of the modules, the stage files) and one `stageK.safetensors` per stage
//! with tensors named `w/NAME` (newest weights), `shadow/NAME` (2BW: the older version the
//! next batch's microbatches still run with), `opt.m/NAME`, `opt.v/NAME` (optimizer
//! moments or momentum) and `buf/NAME` (BatchNormalization running statistics as of the
//! end of the batch). The folder is written under a temporary name and renamed into
//! place, so a step folder is either complete or absent.
//!
//! Integrity: the manifest binds the step, each stage file's CRC-32 and size, and the
//! run's settings ([`super::run_record`]); each stage file records its step too. Reading
//! verifies all of it, so a flipped bit, an edited step or stage files from different
//! steps are refused naming the file instead of resuming silently different weights.
//! Temporary folders of writers that died (`.step-*.tmp-PID`, `step-*.old-PID`) are
//! removed by the next writer.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use pipewright_core::Schedule;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::exec::{tensor_from_bytes, tensor_to_bytes};
use pipewright_ops::DType;
use crate::module::{dtype_of, elem_of_dtype};

use super::precision::LossScaler;

/// One stage's training state after `step` batches.
#[derive(Debug)]
pub struct StageState {
    pub stage: usize,
    pub newest: Vec<(String, Tensor)>,
    /// 2BW only: the version before `newest`; empty for the other schedules.
    pub shadow: Vec<(String, Tensor)>,
    /// Optimizer steps taken (for Adam's bias correction).
    pub opt_steps: i32,
    pub opt_m: Vec<(String, Tensor)>,
    pub opt_v: Vec<(String, Tensor)>,
    /// Running statistics (non-trainable tensors training updates).
    pub buffers: Vec<(String, Tensor)>,
    /// fp16's dynamic loss scale as of the end of the step (equal in every stage); `None`
    /// in other precisions.
    pub loss_scale: Option<LossScaler>,
    /// Steps skipped in a row so far (`--on-nonfinite skip`, fp16 overflows).
    pub skips_in_a_row: usize,
}

/// The whole pipeline's state after `step` batches.
#[derive(Debug)]
pub struct Checkpoint {
    pub step: u64,
    /// `Program::pipeline` of the modules that were trained.
    pub pipeline: String,
    pub schedule: Schedule,
    /// The run's settings ([`super::run_record`]), compared on resume.
    pub config: BTreeMap<String, String>,
    pub stages: Vec<StageState>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    At { path: PathBuf, message: String },
}

fn at(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::At { path: path.to_path_buf(), message: message.into() }
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    step: u64,
    depth: usize,
    schedule: Schedule,
    pipeline: String,
    stages: Vec<String>,
    /// Per stage file: CRC-32 of its bytes (8 hex digits) and its size.
    checksums: Vec<String>,
    sizes: Vec<u64>,
    config: BTreeMap<String, String>,
}

const VERSION: u32 = 2;

const FORMAT: &str = "pipewright-checkpoint";
const MANIFEST: &str = "checkpoint.json";

/// The folder name of the checkpoint after `step` batches.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Writes `ck` as `dir/step-NNNNNN/` (replacing an older folder of that step) and returns
/// that folder. Nothing is visible under the final name until every file is complete.
pub fn write_checkpoint(dir: &Path, ck: &Checkpoint) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| at(dir, format!("cannot create the checkpoint folder: {e}")))?;
    remove_stale(dir);
    let name = step_dir_name(ck.step);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = write_into(&tmp, ck).and_then(|()| publish(&tmp, &dir.join(&name)));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result.map(|()| dir.join(name))
}

fn write_into(tmp: &Path, ck: &Checkpoint) -> Result<(), CheckpointError> {
    std::fs::create_dir(tmp).map_err(|e| at(tmp, format!("cannot create: {e}")))?;
    let mut parts = Vec::new();
    for st in &ck.stages {
        parts.push(write_part(tmp, st, ck.step)?);
    }
    write_manifest(tmp, ck.step, ck.schedule, &ck.pipeline, &ck.config, parts)
}

/// One stage file of a checkpoint being written, as its manifest records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePart {
    pub file: String,
    /// CRC-32 of the file's bytes, 8 hex digits.
    pub checksum: String,
    pub size: u64,
}

fn write_part(tmp: &Path, st: &StageState, step: u64) -> Result<StagePart, CheckpointError> {
    let file = format!("stage{}.safetensors", st.stage);
    let bytes = encode_stage(st, step).map_err(|m| at(&tmp.join(&file), m))?;
    write_synced(&tmp.join(&file), &bytes)?;
    Ok(StagePart { file, checksum: format!("{:08x}", crc32fast::hash(&bytes)), size: bytes.len() as u64 })
}

fn write_manifest(tmp: &Path, step: u64, schedule: Schedule, pipeline: &str, config: &BTreeMap<String, String>, parts: Vec<StagePart>) -> Result<(), CheckpointError> {
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        step,
        depth: parts.len(),
        schedule,
        pipeline: pipeline.to_string(),
        checksums: parts.iter().map(|p| p.checksum.clone()).collect(),
        sizes: parts.iter().map(|p| p.size).collect(),
        stages: parts.into_iter().map(|p| p.file).collect(),
        config: config.clone(),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| at(tmp, e.to_string()))?;
    write_synced(&tmp.join(MANIFEST), &json)
}

/// Multi-process checkpoints: the step's temporary folder, shared by every process of
/// job `job` (the committing process's id, so that a later writer removes it only once
/// that process is gone).
pub fn part_dir(dir: &Path, step: u64, job: u32) -> PathBuf {
    dir.join(format!(".{}.tmp-{job}", step_dir_name(step)))
}

/// Multi-process checkpoints: writes one stage's file into [`part_dir`] (each process its
/// own stage); nothing is visible until [`commit_parts`].
pub fn write_stage_part(dir: &Path, step: u64, job: u32, st: &StageState) -> Result<StagePart, CheckpointError> {
    let tmp = part_dir(dir, step, job);
    std::fs::create_dir_all(&tmp).map_err(|e| at(&tmp, format!("cannot create: {e}")))?;
    write_part(&tmp, st, step)
}

/// Multi-process checkpoints: once every stage's part is written, writes the manifest and
/// renames the folder into place (the one atomic commit), returning it. `parts` in stage
/// order.
pub fn commit_parts(
    dir: &Path,
    step: u64,
    job: u32,
    schedule: Schedule,
    pipeline: &str,
    config: &BTreeMap<String, String>,
    parts: Vec<StagePart>,
) -> Result<PathBuf, CheckpointError> {
    let tmp = part_dir(dir, step, job);
    let name = step_dir_name(step);
    let result = write_manifest(&tmp, step, schedule, pipeline, config, parts).and_then(|()| publish(&tmp, &dir.join(&name)));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    remove_stale(dir);
    result.map(|()| dir.join(name))
}

/// Multi-process checkpoints: gives up a step whose parts could not all be written.
pub fn discard_parts(dir: &Path, step: u64, job: u32) {
    let _ = std::fs::remove_dir_all(part_dir(dir, step, job));
}

pub fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let pid = if name.starts_with(".step-") {
            name.rsplit_once(".tmp-").map(|(_, pid)| pid.to_string())
        } else if name.starts_with("step-") {
            name.rsplit_once(".old-").map(|(_, pid)| pid.to_string())
        } else {
            None
        };
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !process_alive(pid) && e.path().is_dir() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Whether process `pid` exists; where the system cannot say (no /proc), it is taken to
/// be alive so nothing is removed.
fn process_alive(pid: u32) -> bool {
    let proc_root = Path::new("/proc");
    !proc_root.join("self").exists() || proc_root.join(pid.to_string()).exists()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| at(path, format!("cannot create: {e}")))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| at(path, format!("cannot write: {e}")))
}

fn publish(tmp: &Path, target: &Path) -> Result<(), CheckpointError> {
    let old = target.with_extension(format!("old-{}", std::process::id()));
    let had_old = target.exists();
    if had_old {
        std::fs::rename(target, &old).map_err(|e| at(target, format!("cannot move the older checkpoint aside: {e}")))?;
    }
    std::fs::rename(tmp, target).map_err(|e| at(target, format!("cannot rename the new checkpoint into place: {e}")))?;
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

fn encode_stage(st: &StageState, step: u64) -> Result<Vec<u8>, String> {
    let groups: [(&str, &Vec<(String, Tensor)>); 5] =
        [("w", &st.newest), ("shadow", &st.shadow), ("opt.m", &st.opt_m), ("opt.v", &st.opt_v), ("buf", &st.buffers)];
    // safetensors 0.3 writes an unreadable header for an empty tensor map with metadata
    // (a stage may hold no weights), so every file carries its step as a tensor too.
    let mut raw: Vec<(String, DType, Vec<usize>, Vec<u8>)> = vec![("meta/step".into(), DType::I64, vec![1], (step as i64).to_le_bytes().to_vec())];
    for (prefix, list) in groups {
        for (name, t) in list {
            let (elem, dims, bytes) = tensor_to_bytes(t).map_err(|e| format!("tensor {name:?}: {e}"))?;
            raw.push((format!("{prefix}/{name}"), elem, dims.iter().map(|&d| d as usize).collect(), bytes));
        }
    }
    let views = raw
        .iter()
        .map(|(n, e, d, b)| TensorView::new(dtype_of(*e), d.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("tensor {n:?}: {e:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta: HashMap<String, String> =
        [("stage".to_string(), st.stage.to_string()), ("step".into(), step.to_string()), ("opt_steps".into(), st.opt_steps.to_string())]
            .into_iter()
            .collect();
    meta.insert("skips_in_a_row".into(), st.skips_in_a_row.to_string());
    if let Some(s) = &st.loss_scale {
        // `{}` prints an f64 that parses back to the same bits.
        meta.insert("loss_scale".into(), s.scale.to_string());
        meta.insert("loss_scale_growth_interval".into(), s.growth_interval.to_string());
        meta.insert("loss_scale_good_steps".into(), s.good_steps.to_string());
        meta.insert("loss_scale_skipped".into(), s.skipped.to_string());
    }
    safetensors::serialize(views, &Some(meta)).map_err(|e| format!("{e:?}"))
}

/// Reads a checkpoint: `path` is a step folder, or a folder of step folders (the newest
/// complete one is taken).
pub fn read_checkpoint(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let dir = if path.join(MANIFEST).is_file() { path.to_path_buf() } else { newest_step_dir(path)? };
    let mpath = dir.join(MANIFEST);
    let text = std::fs::read(&mpath).map_err(|e| at(&mpath, format!("cannot read: {e}")))?;
    decode_checkpoint(&dir, &text, |file| std::fs::read(dir.join(file)))
}

/// Decodes a step folder's manifest `text` (the bytes of `dir/checkpoint.json`) and the
/// stage files it lists, read through `read_stage` (a plain file name in `dir`). Split
/// from [`read_checkpoint`] so the fuzzer can run it on bytes in memory.
pub fn decode_checkpoint(
    dir: &Path,
    text: &[u8],
    mut read_stage: impl FnMut(&str) -> std::io::Result<Vec<u8>>,
) -> Result<Checkpoint, CheckpointError> {
    let mpath = dir.join(MANIFEST);
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| at(&mpath, format!("not a pipewright checkpoint manifest: {e}")))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(at(&mpath, format!("unsupported checkpoint format {:?} version {} (this pipewright reads version {VERSION}, which carries checksums)", m.format, m.version)));
    }
    if m.stages.len() != m.depth || m.checksums.len() != m.depth || m.sizes.len() != m.depth {
        return Err(at(&mpath, format!("lists {} stage files, {} checksums and {} sizes for depth {}", m.stages.len(), m.checksums.len(), m.sizes.len(), m.depth)));
    }
    // The folder's name is the step too: an edited manifest step disagrees with it.
    if let Some(named) = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-")).and_then(|n| n.parse::<u64>().ok()) {
        if named != m.step {
            return Err(at(&mpath, format!("says step {}, but the folder is step {named}; the checkpoint was edited or moved", m.step)));
        }
    }
    let mut stages = Vec::new();
    for (k, file) in m.stages.iter().enumerate() {
        let p = match pipewright_core::fs::file_in(dir, file) {
            Ok(p) => p,
            Err(e) => return Err(at(&mpath, format!("stage file name: {e}"))),
        };
        let bytes = read_stage(file).map_err(|e| at(&p, format!("cannot read: {e}")))?;
        if bytes.len() as u64 != m.sizes[k] {
            return Err(at(&p, format!("holds {} bytes, the manifest says {}; the checkpoint is damaged", bytes.len(), m.sizes[k])));
        }
        let sum = format!("{:08x}", crc32fast::hash(&bytes));
        if sum != m.checksums[k] {
            return Err(at(&p, format!("checksum {sum} does not match the manifest's {}; the file is damaged or from another checkpoint", m.checksums[k])));
        }
        let (state, step) = decode_stage(&bytes, k).map_err(|msg| at(&p, msg))?;
        if step != m.step {
            return Err(at(&p, format!("holds step {step}, the manifest says step {}; stage files from different checkpoints", m.step)));
        }
        stages.push(state);
    }
    Ok(Checkpoint { step: m.step, pipeline: m.pipeline, schedule: m.schedule, config: m.config, stages })
}

fn newest_step_dir(parent: &Path) -> Result<PathBuf, CheckpointError> {
    let entries = std::fs::read_dir(parent).map_err(|e| at(parent, format!("cannot read the checkpoint folder: {e}")))?;
    let mut best: Option<(u64, PathBuf)> = None;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) else { continue };
        if e.path().join(MANIFEST).is_file() && best.as_ref().map_or(true, |(b, _)| step > *b) {
            best = Some((step, e.path()));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| at(parent, "no checkpoint here (expected checkpoint.json or step-NNNNNN folders)"))
}

/// fp16's loss scale from a stage file's metadata: absent when the run was not fp16 (or
/// the file predates it), an error when present but unreadable.
fn decode_loss_scale(meta: &HashMap<String, String>) -> Result<Option<LossScaler>, String> {
    let Some(scale) = meta.get("loss_scale") else { return Ok(None) };
    let scale = scale.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 1.0).ok_or_else(|| format!("metadata loss_scale {scale:?} is not a scale of at least 1"))?;
    let num = |key: &str| -> Result<u64, String> {
        let v = meta.get(key).ok_or_else(|| format!("metadata has loss_scale but lacks {key:?}"))?;
        v.parse::<u64>().map_err(|_| format!("metadata {key} {v:?} is not a count"))
    };
    let growth = u32::try_from(num("loss_scale_growth_interval")?).map_err(|_| "metadata loss_scale_growth_interval is too large".to_string())?;
    let good = u32::try_from(num("loss_scale_good_steps")?).map_err(|_| "metadata loss_scale_good_steps is too large".to_string())?;
    let mut s = LossScaler::with(scale, growth);
    s.good_steps = good;
    s.skipped = num("loss_scale_skipped")?;
    Ok(Some(s))
}

/// Decodes one stage file of a checkpoint, which must hold stage `k`: the stage's state
/// and the step its file records. Errors do not name the file (the caller does).
pub fn decode_stage(bytes: &[u8], k: usize) -> Result<(StageState, u64), String> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| format!("not a safetensors file: {e:?}"))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let field = |name: &str| meta.get(name).and_then(|v| v.parse::<i64>().ok()).ok_or_else(|| format!("metadata lacks {name:?}"));
    if field("stage")? != k as i64 {
        return Err(format!("holds stage {}, expected stage {k}", field("stage")?));
    }
    let step = u64::try_from(field("step")?).map_err(|_| "metadata step is negative".to_string())?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e:?}"))?;
    let mut state = StageState {
        stage: k,
        newest: Vec::new(),
        shadow: Vec::new(),
        opt_steps: field("opt_steps")? as i32,
        opt_m: Vec::new(),
        opt_v: Vec::new(),
        buffers: Vec::new(),
        loss_scale: decode_loss_scale(&meta)?,
        // Absent in files written before it was recorded: the count starts again.
        skips_in_a_row: meta.get("skips_in_a_row").map(|v| v.parse::<usize>().map_err(|_| format!("metadata skips_in_a_row {v:?} is not a count"))).transpose()?.unwrap_or(0),
    };
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    for full in names {
        let view = st.tensor(&full).map_err(|e| format!("tensor {full:?}: {e:?}"))?;
        let elem = elem_of_dtype(view.dtype()).ok_or_else(|| format!("tensor {full:?}: unsupported dtype {:?}", view.dtype()))?;
        let dims: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = tensor_from_bytes(elem, &dims, view.data()).map_err(|e| format!("tensor {full:?}: {e}"))?;
        let (prefix, name) = full.split_once('/').ok_or_else(|| format!("tensor {full:?} has no group prefix"))?;
        let list = match prefix {
            "w" => &mut state.newest,
            "shadow" => &mut state.shadow,
            "opt.m" => &mut state.opt_m,
            "opt.v" => &mut state.opt_v,
            "buf" => &mut state.buffers,
            "meta" => continue,
            other => return Err(format!("tensor {full:?}: unknown group {other:?}")),
        };
        list.push((name.to_string(), t));
    }
    Ok((state, step))
}
