//! The text form of the IR. Ids print exactly as their `Display` (`%v3`, `n7`); after
//! import (and `Graph::compact`) they are dense and nodes appear in topological order.
//! Weights are shown by name and type, never by value; small integer constants (shape
//! vectors, axes) are shown by value because they decide shapes.

use std::fmt::Write;

use crate::known::Known;
use crate::{Graph, ValueDef};

/// Constants with at most this many elements print their contents.
const SHOWN_CONSTANT: usize = 8;

/// The whole graph in text form.
pub fn print_graph(g: &Graph) -> String {
    print_graph_annotated(g, |_| None)
}

/// The graph in text form, with an optional trailing annotation per node (passes use it
/// to show stage assignments or recomputation decisions).
pub fn print_graph_annotated(g: &Graph, note: impl Fn(crate::NodeId) -> Option<String>) -> String {
    let mut s = String::new();
    let m = &g.meta;
    let _ = write!(s, "graph {:?} ir_version={} opset={}", m.graph_name, m.ir_version, m.opset);
    if !m.producer_name.is_empty() {
        let _ = write!(s, " producer={:?}", format!("{} {}", m.producer_name, m.producer_version).trim());
    }
    if let Some(b) = &g.batch {
        match b.export_size {
            Some(size) => write!(s, " batch=N({:?}, exported {size})", b.name),
            None => write!(s, " batch=N({:?}, dynamic)", b.name),
        }
        .unwrap_or_default();
    }
    s.push_str(" {\n");
    for v in g.value_ids() {
        let val = g.value(v);
        match &val.def {
            ValueDef::Input => {
                let _ = writeln!(s, "  {v}: {} = input {:?}", val.ty, val.name);
            }
            ValueDef::Weight(w) if w.trainable => {
                let _ = writeln!(s, "  {v}: {} = weight {:?}", val.ty, val.name);
            }
            ValueDef::Weight(w) => {
                let _ = write!(s, "  {v}: {} = const {:?}", val.ty, val.name);
                if w.data.numel() <= SHOWN_CONSTANT {
                    let _ = write!(s, " {}", constant_text(&w.data));
                }
                s.push('\n');
            }
            ValueDef::Node { .. } => {}
        }
    }
    let order = g.topo_order().unwrap_or_else(|_| g.node_ids().collect());
    for n in order {
        let node = g.node(n);
        s.push_str("  ");
        let outs: Vec<String> = node
            .outputs
            .iter()
            .map(|o| match o {
                Some(v) => format!("{v}: {}", g.value(*v).ty),
                None => "_".into(),
            })
            .collect();
        let ins: Vec<String> = node.inputs.iter().map(|i| i.map(|v| v.to_string()).unwrap_or("_".into())).collect();
        let _ = write!(s, "{} = {}({})  # {n} {:?}", outs.join(", "), node.op, ins.join(", "), node.name);
        if let Some(extra) = note(n) {
            let _ = write!(s, " {extra}");
        }
        s.push('\n');
    }
    let outs: Vec<String> = g.outputs().iter().map(|v| format!("{v} {:?}", g.value(*v).name)).collect();
    let _ = writeln!(s, "  return {}", outs.join(", "));
    s.push_str("}\n");
    s
}

fn constant_text(t: &crate::TensorData) -> String {
    match Known::from_tensor(t) {
        Some(k) if t.dtype.is_float() => {
            let v: Vec<String> = k.floats().unwrap_or_default().iter().map(|f| format!("{f:?}")).collect();
            format!("[{}]", v.join(", "))
        }
        Some(k) => {
            let v: Vec<String> = k.dims().iter().map(|d| d.to_string()).collect();
            format!("[{}]", v.join(", "))
        }
        None => String::new(),
    }
}
