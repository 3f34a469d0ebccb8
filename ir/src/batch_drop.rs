//! Where a fixed-batch export loses the batch: the analysis that finds a graph output
//! computed at the export batch whatever the batch is, and the node that drops it.
//!
//! Exporters sometimes write a batch-dependent step with constants of the export batch
//! (PyTorch's default exporter turns `as_strided` into a Gather with a constant index
//! tensor): the importer then types everything after it at the export batch, and the
//! model's output no longer follows the batch. Training it at another microbatch would
//! fail at its loss; compile refuses it with this node named instead.

use crate::{DType, Graph, NodeId, ValueDef, ValueId};

/// A graph output that does not follow the batch, and the node nearest the inputs on its
/// way that reads a batch-carrying value and writes none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchDrop {
    pub output: ValueId,
    pub node: NodeId,
}

/// The first graph output of a fixed-batch export (`g.batch` with an export size) whose
/// leading extent is the export batch but not the symbolic batch, with the node that
/// drops the batch on its way; `None` when every such output follows the batch.
pub fn batch_drop(g: &Graph) -> Option<BatchDrop> {
    let b = g.batch.as_ref()?.export_size?;
    let order = g.topo_order().ok()?;
    for &out in g.outputs() {
        let dims = g.value(out).ty.shape.dims();
        if dims.first().and_then(|d| d.fixed()) != Some(b) || dims.iter().any(|d| d.is_batch()) {
            continue;
        }
        let ancestors = ancestors(g, out);
        let dropping = order.iter().copied().find(|&n| ancestors[n.index()] && drops_batch(g, n, b));
        if let Some(node) = dropping {
            return Some(BatchDrop { output: out, node });
        }
    }
    None
}

/// Whether node `n` reads a value that carries the batch, writes none that does, and
/// writes data (not a shape: `Shape` and its integer arithmetic drop the batch rightly)
/// whose leading extent is the export batch `b`.
fn drops_batch(g: &Graph, n: NodeId, b: i64) -> bool {
    let node = g.node(n);
    let carries = |v: &ValueId| g.value(*v).ty.shape.has_batch();
    let at_export_batch = |v: &ValueId| {
        let ty = &g.value(*v).ty;
        !matches!(ty.dtype, DType::I64 | DType::I32) && ty.shape.dims().first().and_then(|d| d.fixed()) == Some(b)
    };
    node.inputs.iter().flatten().any(carries) && !node.outputs.iter().flatten().any(carries) && node.outputs.iter().flatten().any(at_export_batch)
}

/// The nodes `out` is computed from (by node index).
fn ancestors(g: &Graph, out: ValueId) -> Vec<bool> {
    let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut seen = vec![false; bound];
    let mut stack = vec![out];
    while let Some(v) = stack.pop() {
        if let ValueDef::Node { node, .. } = g.value(v).def {
            if !seen[node.index()] {
                seen[node.index()] = true;
                stack.extend(g.node(node).inputs.iter().flatten().copied());
            }
        }
    }
    seen
}
