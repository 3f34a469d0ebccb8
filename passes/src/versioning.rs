//! The weight-versioning pass: an analysis giving every weight of a partitioned graph its
//! kind, stages, number of version slots and update rule.
//!
//! - **PipeDream-2BW**: 2 versions of every trainable weight (the newest for newly admitted
//!   microbatches, the shadow for microbatches still in flight); gradients of `m`
//!   microbatches are accumulated, then `W(t+1) = W(t) - lr * grad f(W(t-1))`. Requires
//!   `m >= d` (else the shadow would still be in use when a third version appears).
//! - **PipeDream-Flush / GPipe**: 1 version, vanilla update `W(t+1) = W(t) - lr * grad f(W(t))`
//!   after the flush.
//!
//! Non-trainable weights (constants: index tensors, folded shapes) and BatchNormalization
//! running statistics (inputs 3 and 4, updated by the forward rather than the optimizer)
//! are `constant`: one version, never updated by the optimizer.
//!
//! A trainable weight read in several stages (tied weights, e.g. GPT-2's token embedding
//! reused as the LM head) is replicated in each and gets a gradient-sync group listing the
//! stages: their gradients are summed before the update so the copies stay equal. A stage
//! also counts as reading a weight when it reads a value computed from weights alone
//! (e.g. `Transpose(wte)` forwarded through boundaries to the LM head's stage).

use std::fmt::Write;

use pipewright_ir::{Graph, NodeId, Op, StageMap, ValueDef, ValueId};

use pipewright_core::units::human_bytes;
use pipewright_core::{Schedule, UpdateRule};

/// What kind of weight a value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightKind {
    Trainable,
    /// BatchNormalization running mean / variance.
    RunningStat,
    Constant,
}

/// The versioning of one weight.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightVersion {
    pub value: ValueId,
    pub name: String,
    pub kind: WeightKind,
    /// `kind == Trainable`.
    pub trainable: bool,
    /// Bytes of one version.
    pub bytes: u64,
    /// Stages whose nodes read the weight, or a value computed from weights alone that
    /// derives from it, ascending.
    pub stages: Vec<u32>,
    /// Version slots held in each of `stages` (same order).
    pub versions: Vec<u32>,
    pub rule: UpdateRule,
}

impl WeightVersion {
    /// Version slots in `stage` (0 when the stage does not read the weight).
    pub fn versions_in(&self, stage: u32) -> u32 {
        self.stages
            .iter()
            .position(|&s| s == stage)
            .map(|i| self.versions[i])
            .unwrap_or(0)
    }

    pub fn max_versions(&self) -> u32 {
        self.versions.iter().copied().max().unwrap_or(0)
    }
}

/// Stages holding copies of one tied weight whose gradients are summed before the update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncGroup {
    pub value: ValueId,
    pub name: String,
    pub stages: Vec<u32>,
}

/// Why weights could not be versioned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionError {
    /// 2BW needs `m >= d` microbatches per batch.
    TooFewMicrobatches { m: u32, d: u32 },
    /// `d` or `m` is zero.
    Zero { what: &'static str },
    /// `d` differs from the stage map's stage count.
    DepthMismatch { d: u32, stages: u32 },
}

impl std::fmt::Display for VersionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VersionError::TooFewMicrobatches { m, d } => write!(
                f,
                "PipeDream-2BW needs at least as many microbatches per batch as stages (m >= d), got m={m} < d={d}"
            ),
            VersionError::Zero { what } => write!(f, "{what} must be at least 1"),
            VersionError::DepthMismatch { d, stages } => {
                write!(f, "pipeline depth {d} does not match the {stages} stages of the stage map")
            }
        }
    }
}

impl std::error::Error for VersionError {}

/// The weight versions of a partitioned graph.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightVersions {
    pub schedule: Schedule,
    pub d: u32,
    pub m: u32,
    /// Every weight read by some node, in value id order.
    pub weights: Vec<WeightVersion>,
    /// Tied trainable weights, in value id order.
    pub sync_groups: Vec<SyncGroup>,
    by_value: Vec<Option<usize>>,
    /// Indices into `weights` read by each node, by node index.
    by_node: Vec<Vec<usize>>,
    node_stage: Vec<Option<u32>>,
}

impl WeightVersions {
    /// The versioning of value `v`, if it is a weight some node reads.
    pub fn get(&self, v: ValueId) -> Option<&WeightVersion> {
        self.by_value
            .get(v.index())
            .copied()
            .flatten()
            .map(|i| &self.weights[i])
    }

    /// Weights node `n` reads, in operand order.
    pub fn weights_of(&self, n: NodeId) -> Vec<&WeightVersion> {
        self.by_node
            .get(n.index())
            .map(|v| v.iter().map(|&i| &self.weights[i]).collect())
            .unwrap_or_default()
    }

    /// Bytes of all version slots of trainable weights held by `stage`.
    pub fn stage_bytes(&self, stage: u32) -> u64 {
        self.weights
            .iter()
            .filter(|w| w.trainable)
            .map(|w| w.bytes * w.versions_in(stage) as u64)
            .sum()
    }

    /// The versions of the trainable weights and running stats node `n` reads, e.g.
    /// `w:%v3 x2 (2bw)`; tied weights add their sync group (`w:%v3 x2 (2bw, sync 0+3)`).
    /// Plain constants are left out (the text form already marks them `const`).
    pub fn note(&self, n: NodeId) -> Option<String> {
        let stage = self.node_stage.get(n.index()).copied().flatten();
        let parts: Vec<String> = self
            .weights_of(n)
            .into_iter()
            .filter(|w| w.kind != WeightKind::Constant)
            .map(|w| {
                let k = match stage {
                    Some(s) => w.versions_in(s),
                    None => w.max_versions(),
                };
                let tied = if w.trainable && w.stages.len() > 1 {
                    let st: Vec<String> = w.stages.iter().map(|s| s.to_string()).collect();
                    format!(", sync {}", st.join("+"))
                } else {
                    String::new()
                };
                format!("w:{} x{} ({}{})", w.value, k, w.rule, tied)
            })
            .collect();
        if parts.is_empty() {
            None
        } else {
            Some(parts.join(" "))
        }
    }

    /// A per-stage summary: trainable weights, version slots and their bytes, constants,
    /// the update rule, then the sync groups.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "weight versions: {}, d={}, m={}", self.schedule, self.d, self.m);
        for st in 0..self.d {
            let here: Vec<&WeightVersion> = self
                .weights
                .iter()
                .filter(|w| w.stages.contains(&st))
                .collect();
            let trainable: Vec<&&WeightVersion> = here.iter().filter(|w| w.trainable).collect();
            let one: u64 = trainable.iter().map(|w| w.bytes).sum();
            let slots: Vec<u32> = trainable.iter().map(|w| w.versions_in(st)).collect();
            let vmax = slots.iter().copied().max().unwrap_or(0);
            let stats = here
                .iter()
                .filter(|w| w.kind == WeightKind::RunningStat)
                .count();
            let consts = here
                .iter()
                .filter(|w| w.kind == WeightKind::Constant)
                .count();
            let rule = trainable
                .first()
                .map(|w| format!("{} ({})", w.rule, w.rule.help()))
                .unwrap_or_else(|| "no trainable weights".into());
            let _ = writeln!(
                s,
                "  stage {st}: {} trainable ({}) x{vmax} versions = {}; {stats} running stats, {consts} constants; {rule}",
                trainable.len(),
                human_bytes(one),
                human_bytes(self.stage_bytes(st)),
            );
        }
        if !self.sync_groups.is_empty() {
            s.push_str("  gradient sync groups (tied weights):\n");
            for gsync in &self.sync_groups {
                let st: Vec<String> = gsync.stages.iter().map(|x| x.to_string()).collect();
                let _ = writeln!(
                    s,
                    "    {} {:?}: stages {}",
                    gsync.value,
                    gsync.name,
                    st.join(", ")
                );
            }
        }
        s
    }
}

/// Versions every weight of the partitioned graph `g` for `schedule` with `d` stages and
/// `m` microbatches per batch.
pub fn version_weights(
    g: &Graph,
    stages: &StageMap,
    schedule: Schedule,
    d: u32,
    m: u32,
) -> Result<WeightVersions, VersionError> {
    if d == 0 {
        return Err(VersionError::Zero {
            what: "the pipeline depth d",
        });
    }
    if m == 0 {
        return Err(VersionError::Zero {
            what: "the number of microbatches m",
        });
    }
    if d != stages.num_stages {
        return Err(VersionError::DepthMismatch {
            d,
            stages: stages.num_stages,
        });
    }
    if schedule == Schedule::TwoBw && m < d {
        return Err(VersionError::TooFewMicrobatches { m, d });
    }
    let order = g.topo_order().unwrap_or_else(|_| g.node_ids().collect());
    let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut node_stage = vec![None; bound];
    // Per weight value: stages reading it and whether it feeds a BN running-stat slot.
    let mut readers: Vec<Vec<u32>> = vec![Vec::new(); g.value_count()];
    let mut read = vec![false; g.value_count()];
    let mut stat = vec![false; g.value_count()];
    let mut node_reads: Vec<(NodeId, Vec<ValueId>)> = Vec::new();
    for &n in &order {
        let s = stages.get(n);
        node_stage[n.index()] = s;
        let node = g.node(n);
        let mut mine = Vec::new();
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            if !matches!(g.value(v).def, ValueDef::Weight(_)) {
                continue;
            }
            read[v.index()] = true;
            if let Some(s) = s {
                if !readers[v.index()].contains(&s) {
                    readers[v.index()].push(s);
                }
            }
            if matches!(node.op, Op::BatchNormalization(_)) && (slot == 3 || slot == 4) {
                stat[v.index()] = true;
            }
            if !mine.contains(&v) {
                mine.push(v);
            }
        }
        node_reads.push((n, mine));
    }
    // Values computed from weights alone (e.g. `Transpose(lm_head.weight)` feeding the LM
    // head while the embedding `Gather` reads the weight itself) carry the weight into
    // every stage that uses them (boundaries only forward): such a stage holds a copy too.
    let mut origins: Vec<Vec<ValueId>> = vec![Vec::new(); g.value_count()];
    for &n in &order {
        let node = g.node(n);
        let ins: Vec<ValueId> = node.inputs.iter().flatten().copied().collect();
        let derived = !ins.is_empty()
            && ins.iter().all(|v| {
                matches!(g.value(*v).def, ValueDef::Weight(_)) || !origins[v.index()].is_empty()
            });
        if !derived {
            continue;
        }
        let mut from: Vec<ValueId> = Vec::new();
        for v in &ins {
            let src = if matches!(g.value(*v).def, ValueDef::Weight(_)) {
                vec![*v]
            } else {
                origins[v.index()].clone()
            };
            for w in src {
                if !from.contains(&w) {
                    from.push(w);
                }
            }
        }
        for &o in node.outputs.iter().flatten() {
            origins[o.index()] = from.clone();
        }
    }
    for &n in &order {
        let Some(s) = stages.get(n) else { continue };
        // Boundaries only forward the value; the stage that uses it holds the copy.
        if matches!(g.node(n).op, Op::StageBoundary { .. }) {
            continue;
        }
        for v in g.node(n).inputs.iter().flatten() {
            for w in &origins[v.index()] {
                if !readers[w.index()].contains(&s) {
                    readers[w.index()].push(s);
                }
            }
        }
    }
    let mut weights = Vec::new();
    let mut by_value = vec![None; g.value_count()];
    let mut sync_groups = Vec::new();
    for v in g.value_ids() {
        let ValueDef::Weight(w) = &g.value(v).def else {
            continue;
        };
        if !read[v.index()] {
            continue;
        }
        let kind = if stat[v.index()] {
            WeightKind::RunningStat
        } else if w.trainable {
            WeightKind::Trainable
        } else {
            WeightKind::Constant
        };
        let mut st = readers[v.index()].clone();
        st.sort_unstable();
        let rule = match kind {
            WeightKind::Trainable => schedule.update_rule(),
            _ => UpdateRule::Constant,
        };
        let slots = if rule == UpdateRule::Constant { 1 } else { schedule.weight_versions() };
        let versions: Vec<u32> = vec![slots; st.len()];
        let name = g.value(v).name.clone();
        if kind == WeightKind::Trainable && st.len() > 1 {
            sync_groups.push(SyncGroup {
                value: v,
                name: name.clone(),
                stages: st.clone(),
            });
        }
        by_value[v.index()] = Some(weights.len());
        weights.push(WeightVersion {
            value: v,
            name,
            kind,
            trainable: kind == WeightKind::Trainable,
            bytes: w.data.bytes.len() as u64,
            stages: st,
            versions,
            rule,
        });
    }
    let mut by_node = vec![Vec::new(); bound];
    for (n, vs) in node_reads {
        by_node[n.index()] = vs.iter().filter_map(|v| by_value[v.index()]).collect();
    }
    Ok(WeightVersions {
        schedule,
        d,
        m,
        weights,
        sync_groups,
        by_value,
        by_node,
        node_stage,
    })
}
