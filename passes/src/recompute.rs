//! The recomputation pass: an analysis deciding, per stage of a partitioned graph, which
//! node outputs are stashed for the backward pass and which are recomputed from the
//! stage's inputs just before it.
//!
//! - [`Recompute::None`]: every node output the backward needs is stashed.
//! - [`Recompute::Full`]: only the stage inputs are stashed (outputs of `StageBoundary`
//!   nodes and graph inputs read in the stage); the stage's forward reruns before its
//!   backward. This is PipeDream-2BW's default (`|A_input(b)|` per in-flight microbatch).
//! - [`Recompute::Selective`]: keep tensors that are cheap to store and expensive to
//!   recompute (MatMul / Gemm / Einsum / Conv outputs: high flops per byte) and recompute
//!   elementwise, normalisation and data-movement outputs. Without a memory limit exactly
//!   the matmul/conv class is kept. With a limit, a stage starts from "stash everything"
//!   and greedily turns outputs with the lowest (recompute flops / stored bytes) into
//!   recomputations until its stash fits the limit (`fits` says whether it did).
//!
//! Stage inputs are always stashed. Weights are never stashed here (see the versioning
//! pass). Pure views (Reshape, Flatten, Squeeze, Unsqueeze, Identity) store nothing of their
//! own (the cost model gives them zero activation bytes).
//!
//! The `CostModel` must be built on the partitioned graph `g` (node ids must match). All
//! byte and flop figures are per microbatch of size `b`.

use std::fmt::Write;

use pipewright_ir::{Graph, NodeId, Op, StageMap, ValueDef, ValueId};

use pipewright_ops::op::OpClass;

use crate::cost::CostModel;
use crate::partition::value_bytes;
use pipewright_core::units::human_bytes;
use pipewright_core::Recompute;

/// What happens to one tensor between the forward and the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    Stash,
    Recompute,
}

impl Decision {
    pub fn name(self) -> &'static str {
        match self {
            Decision::Stash => "stash",
            Decision::Recompute => "recompute",
        }
    }
}

/// Per-stage totals of a [`RecomputePlan`].
#[derive(Clone, Debug, PartialEq)]
pub struct StageRecompute {
    pub stage: u32,
    /// The stage inputs: outputs of its `StageBoundary` nodes and graph inputs it reads.
    pub inputs: Vec<ValueId>,
    /// Bytes of the stage inputs (always stashed), per microbatch.
    pub input_bytes: u64,
    /// Bytes stashed per microbatch (stage inputs included).
    pub stash_bytes: u64,
    /// Forward flops rerun before the backward, per microbatch.
    pub recompute_flops: f64,
    /// The stage's forward flops, per microbatch (for the recompute overhead ratio).
    pub forward_flops: f64,
    /// Nodes whose outputs are stashed / recomputed.
    pub stashed_nodes: usize,
    pub recomputed_nodes: usize,
    /// Whether `stash_bytes` is within the memory limit (always true without one).
    pub fits: bool,
}

/// The recomputation decisions: side tables indexed by `NodeId::index` and
/// `ValueId::index`, with per-stage totals.
#[derive(Clone, Debug, PartialEq)]
pub struct RecomputePlan {
    pub mode: Recompute,
    /// The microbatch size the figures are costed at.
    pub b: u64,
    pub memory_limit: Option<u64>,
    nodes: Vec<Option<Decision>>,
    values: Vec<Option<Decision>>,
    pub stages: Vec<StageRecompute>,
}

impl RecomputePlan {
    /// The decision for node `n`'s outputs (`None`: no stage or unknown node).
    pub fn node(&self, n: NodeId) -> Option<Decision> {
        self.nodes.get(n.index()).copied().flatten()
    }

    /// The decision for value `v` (`None` for weights and unread inputs).
    pub fn value(&self, v: ValueId) -> Option<Decision> {
        self.values.get(v.index()).copied().flatten()
    }

    /// Values stashed, in id order.
    pub fn stashed_values(&self) -> Vec<ValueId> {
        self.values
            .iter()
            .enumerate()
            .filter(|(_, d)| **d == Some(Decision::Stash))
            .map(|(i, _)| ValueId::from_index(i))
            .collect()
    }

    /// `stash` / `recompute`, for the annotated text form.
    pub fn note(&self, n: NodeId) -> Option<String> {
        self.node(n).map(|d| d.name().to_string())
    }

    /// Sum of the stages' stash bytes per microbatch.
    pub fn total_stash_bytes(&self) -> u64 {
        self.stages.iter().map(|s| s.stash_bytes).sum()
    }

    /// Sum of the stages' recomputed flops per microbatch.
    pub fn total_recompute_flops(&self) -> f64 {
        self.stages.iter().map(|s| s.recompute_flops).sum()
    }

    /// A per-stage summary.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "recompute: mode {}, microbatch {}",
            self.mode.name(),
            self.b
        );
        if let Some(l) = self.memory_limit {
            let _ = write!(s, ", stash limit {} per stage", human_bytes(l));
        }
        s.push('\n');
        for st in &self.stages {
            let overhead = if st.forward_flops > 0.0 {
                st.recompute_flops / st.forward_flops
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "  stage {}: stash {} (inputs {}, {} values), {} stashed / {} recomputed nodes, recompute {:.3e} flops ({:.0}% of forward){}",
                st.stage,
                human_bytes(st.stash_bytes),
                human_bytes(st.input_bytes),
                st.inputs.len(),
                st.stashed_nodes,
                st.recomputed_nodes,
                // `+ 0.0` turns a -0.0 (an empty sum of negated terms) into 0.
                st.recompute_flops + 0.0,
                overhead * 100.0 + 0.0,
                if st.fits { "" } else { " OVER LIMIT" }
            );
        }
        s
    }
}

fn round(x: f64) -> u64 {
    if x <= 0.0 {
        0
    } else {
        x.round() as u64
    }
}

/// Decides stash/recompute for every node output of the partitioned graph `g`.
/// `cost` must be built on `g`; `memory_limit` (bytes per microbatch per stage) only
/// matters for [`Recompute::Selective`].
pub fn decide_recomputation(
    g: &Graph,
    stages: &StageMap,
    cost: &CostModel,
    mode: Recompute,
    memory_limit: Option<u64>,
    b: u64,
) -> RecomputePlan {
    let order = g.topo_order().unwrap_or_else(|_| g.node_ids().collect());
    let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut nodes: Vec<Option<Decision>> = vec![None; bound];
    let mut values: Vec<Option<Decision>> = vec![None; g.value_count()];
    let d = stages.num_stages;
    let mut per_stage: Vec<Vec<NodeId>> = vec![Vec::new(); d as usize];
    for &n in &order {
        if let Some(s) = stages.get(n).filter(|&s| s < d) {
            per_stage[s as usize].push(n);
        }
    }
    let act = |n: NodeId| round(cost.node(n).activation_bytes.at(b));
    let fwd = |n: NodeId| cost.node(n).fwd_flops.at(b).max(0.0);
    let mut out_stages = Vec::with_capacity(d as usize);
    for (s, members) in per_stage.iter().enumerate() {
        // Stage inputs: boundary outputs produced here and graph inputs read here.
        let mut inputs: Vec<ValueId> = Vec::new();
        let mut input_bytes = 0u64;
        for &n in members {
            let node = g.node(n);
            if matches!(node.op, Op::StageBoundary { .. }) {
                for &v in node.outputs.iter().flatten() {
                    if !inputs.contains(&v) {
                        inputs.push(v);
                        input_bytes += round(value_bytes(g.value(v), cost.export_batch).at(b));
                    }
                }
            }
            for &v in node.inputs.iter().flatten() {
                if matches!(g.value(v).def, ValueDef::Input) && !inputs.contains(&v) {
                    inputs.push(v);
                    input_bytes += round(value_bytes(g.value(v), cost.export_batch).at(b));
                }
            }
        }
        inputs.sort();
        // Nodes whose outputs are decided (boundaries are always stage inputs).
        let body: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|&n| !matches!(g.node(n).op, Op::StageBoundary { .. }))
            .collect();
        let mut decision: Vec<(NodeId, Decision)> = body
            .iter()
            .map(|&n| {
                let dec = match mode {
                    Recompute::None => Decision::Stash,
                    Recompute::Full => Decision::Recompute,
                    Recompute::Selective => match memory_limit {
                        None if matches!(cost.class(n), OpClass::MatMul | OpClass::Conv)
                            && act(n) > 0 =>
                        {
                            Decision::Stash
                        }
                        None => Decision::Recompute,
                        // Start from stash-everything; zero-byte outputs are free to redo.
                        Some(_) if act(n) == 0 => Decision::Recompute,
                        Some(_) => Decision::Stash,
                    },
                };
                (n, dec)
            })
            .collect();
        let stash_of = |dec: &[(NodeId, Decision)]| -> u64 {
            input_bytes
                + dec
                    .iter()
                    .filter(|x| x.1 == Decision::Stash)
                    .map(|x| act(x.0))
                    .sum::<u64>()
        };
        if let (Recompute::Selective, Some(limit)) = (mode, memory_limit) {
            let mut stash = stash_of(&decision);
            if stash > limit {
                // Cheapest to recompute per byte saved first; ties by node id.
                let mut cand: Vec<usize> = (0..decision.len())
                    .filter(|&i| decision[i].1 == Decision::Stash)
                    .collect();
                cand.sort_by(|&i, &j| {
                    let (a, bb) = (decision[i].0, decision[j].0);
                    let ra = fwd(a) / act(a) as f64;
                    let rb = fwd(bb) / act(bb) as f64;
                    ra.partial_cmp(&rb)
                        .unwrap_or(std::cmp::Ordering::Equal)
                        .then(a.cmp(&bb))
                });
                for i in cand {
                    if stash <= limit {
                        break;
                    }
                    decision[i].1 = Decision::Recompute;
                    stash -= act(decision[i].0);
                }
            }
        }
        let stash_bytes = stash_of(&decision);
        let recompute_flops: f64 = decision
            .iter()
            .filter(|x| x.1 == Decision::Recompute)
            .map(|x| fwd(x.0))
            .sum();
        let forward_flops: f64 = members.iter().map(|&n| fwd(n)).sum();
        let stashed_nodes = decision.iter().filter(|x| x.1 == Decision::Stash).count();
        let recomputed_nodes = decision.len() - stashed_nodes;
        for &n in members {
            if matches!(g.node(n).op, Op::StageBoundary { .. }) {
                nodes[n.index()] = Some(Decision::Stash);
            }
        }
        for &(n, dec) in &decision {
            nodes[n.index()] = Some(dec);
        }
        for &n in members {
            let dec = nodes[n.index()];
            for &v in g.node(n).outputs.iter().flatten() {
                values[v.index()] = dec;
            }
        }
        for &v in &inputs {
            values[v.index()] = Some(Decision::Stash);
        }
        out_stages.push(StageRecompute {
            stage: s as u32,
            inputs,
            input_bytes,
            stash_bytes,
            recompute_flops,
            forward_flops,
            stashed_nodes,
            recomputed_nodes,
            fits: match memory_limit {
                Some(l) => stash_bytes <= l,
                None => true,
            },
        });
    }
    RecomputePlan {
        mode,
        b,
        memory_limit,
        nodes,
        values,
        stages: out_stages,
    }
}
