//! The model summary printed by `pipewright inspect` (text and JSON).

use std::collections::BTreeMap;
use std::fmt::Write;

use pipewright_core::units::human_bytes;
use serde::Serialize;

use crate::{Graph, ValueDef};

/// A graph input or output.
#[derive(Clone, Debug, Serialize)]
pub struct Port {
    pub id: String,
    pub name: String,
    pub dtype: String,
    pub shape: String,
}

/// What `inspect` reports about an imported model.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub graph: String,
    pub producer: String,
    pub ir_version: i64,
    pub opset: i64,
    pub batch: Option<String>,
    pub inputs: Vec<Port>,
    pub outputs: Vec<Port>,
    pub nodes: usize,
    pub parameters: u64,
    pub parameter_bytes: u64,
    pub constants: usize,
    pub ops: BTreeMap<String, usize>,
    pub unsupported_ops: Vec<String>,
    pub warnings: Vec<String>,
}

impl Summary {
    pub fn of(g: &Graph) -> Summary {
        let port = |v: &crate::ValueId| {
            let val = g.value(*v);
            Port { id: v.to_string(), name: val.name.clone(), dtype: val.ty.dtype.to_string(), shape: val.ty.shape.to_string() }
        };
        let mut ops = BTreeMap::new();
        for n in g.node_ids() {
            *ops.entry(g.node(n).op.name().to_string()).or_insert(0) += 1;
        }
        let constants = g.value_ids().filter(|v| matches!(&g.value(*v).def, ValueDef::Weight(w) if !w.trainable)).count();
        Summary {
            graph: g.meta.graph_name.clone(),
            producer: format!("{} {}", g.meta.producer_name, g.meta.producer_version).trim().to_string(),
            ir_version: g.meta.ir_version,
            opset: g.meta.opset,
            batch: g.batch.as_ref().map(batch_line),
            inputs: g.inputs().iter().map(port).collect(),
            outputs: g.outputs().iter().map(port).collect(),
            nodes: g.node_count(),
            parameters: g.parameter_count(),
            parameter_bytes: g.parameter_bytes(),
            constants,
            ops,
            unsupported_ops: Vec::new(),
            warnings: g.warnings.clone(),
        }
    }

    /// The human-readable form.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "graph:       {:?}", self.graph);
        let _ = writeln!(s, "producer:    {}", if self.producer.is_empty() { "(none)" } else { &self.producer });
        let _ = writeln!(s, "ir version:  {}", self.ir_version);
        let _ = writeln!(s, "opset:       {}", self.opset);
        let _ = writeln!(s, "batch:       {}", self.batch.as_deref().unwrap_or("(none: all shapes fixed)"));
        let _ = writeln!(s, "inputs:");
        for p in &self.inputs {
            let _ = writeln!(s, "  {} {:?}: {}{}", p.id, p.name, p.dtype, p.shape);
        }
        let _ = writeln!(s, "outputs:");
        for p in &self.outputs {
            let _ = writeln!(s, "  {} {:?}: {}{}", p.id, p.name, p.dtype, p.shape);
        }
        let _ = writeln!(s, "nodes:       {}", self.nodes);
        let _ = writeln!(s, "parameters:  {} ({})", self.parameters, human_bytes(self.parameter_bytes));
        let _ = writeln!(s, "constants:   {}", self.constants);
        let _ = writeln!(s, "ops:");
        let mut hist: Vec<(&String, &usize)> = self.ops.iter().collect();
        hist.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (op, n) in hist {
            let _ = writeln!(s, "  {op:<22} {n}");
        }
        let _ = writeln!(s, "unsupported: {}", if self.unsupported_ops.is_empty() { "none".to_string() } else { self.unsupported_ops.join(", ") });
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        s
    }
}

/// `N = "batch" (dynamic in the model)`, or `N = "N" (the model's fixed batch 2, made
/// symbolic)`: what the importer found of the batch axis.
fn batch_line(b: &crate::BatchInfo) -> String {
    match b.export_size {
        Some(size) => format!("N = {:?} (exported at the fixed batch {size}, made symbolic)", b.name),
        None => format!("N = {:?} (a dynamic axis in the model; the export batch is not recorded)", b.name),
    }
}
