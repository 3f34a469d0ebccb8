//! The stage side table: which pipeline stage each node runs in. Kept beside the graph
//! (indexed by node id), not inside it, like every analysis result.

use crate::verify::VerifyError;
use crate::{Graph, NodeId, Op, ValueDef};

/// The stage of every node of a partitioned graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageMap {
    stage: Vec<Option<u32>>,
    pub num_stages: u32,
}

impl StageMap {
    pub fn new(num_stages: u32) -> StageMap {
        StageMap { stage: Vec::new(), num_stages }
    }

    pub fn set(&mut self, node: NodeId, stage: u32) {
        if self.stage.len() <= node.index() {
            self.stage.resize(node.index() + 1, None);
        }
        self.stage[node.index()] = Some(stage);
    }

    pub fn get(&self, node: NodeId) -> Option<u32> {
        self.stage.get(node.index()).copied().flatten()
    }

    /// Follows a renumbering from `Graph::compact_with_remap`.
    pub fn remap(&self, remap: &[Option<NodeId>]) -> StageMap {
        let mut out = StageMap::new(self.num_stages);
        for (old, new) in remap.iter().enumerate() {
            if let (Some(new), Some(Some(s))) = (new, self.stage.get(old)) {
                out.set(*new, *s);
            }
        }
        out
    }
}

/// Checks a partitioned graph: every node has a stage below `num_stages`; a value is read
/// in the stage that produces it, except through a `StageBoundary` from stage `s` to
/// `s + 1`, which reads in `s` and produces in `s + 1`.
pub fn verify_stages(g: &Graph, stages: &StageMap) -> Result<(), Vec<VerifyError>> {
    let mut errs = Vec::new();
    for n in g.node_ids() {
        let Some(s) = stages.get(n).filter(|&s| s < stages.num_stages) else {
            errs.push(VerifyError::NoStage { node: n });
            continue;
        };
        let node = g.node(n);
        for v in node.inputs.iter().flatten() {
            let ValueDef::Node { node: p, .. } = g.value(*v).def else { continue };
            let Some(ps) = stages.get(p) else { continue };
            let ok = match node.op {
                Op::StageBoundary { from, to } => ps == from && s == to && to == from + 1,
                _ => ps == s,
            };
            if !ok {
                errs.push(VerifyError::StageCrossing { node: n, value: *v, producer_stage: ps, consumer_stage: s });
            }
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}
