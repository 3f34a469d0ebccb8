//! Graphviz output: op nodes as boxes, graph inputs and outputs as ellipses, edges
//! labelled with the tensor type they carry. Weights are folded into their op's label.

use std::fmt::Write;

use crate::{Graph, ValueDef};

/// The graph in DOT syntax.
pub fn print_dot(g: &Graph) -> String {
    let mut s = String::from("digraph pipewright {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n");
    for &v in g.inputs() {
        let _ = writeln!(s, "  v{} [shape=ellipse, label={}];", v.index(), quote(&format!("{}\n{}", g.value(v).name, g.value(v).ty)));
    }
    for n in g.node_ids() {
        let node = g.node(n);
        let weights: Vec<String> = node
            .inputs
            .iter()
            .flatten()
            .filter(|v| matches!(g.value(**v).def, ValueDef::Weight(_)))
            .map(|v| g.value(*v).ty.to_string())
            .collect();
        let mut label = format!("{n} {}\n{}", node.op.name(), node.name);
        if !weights.is_empty() {
            let _ = write!(label, "\nweights: {}", weights.join(" "));
        }
        let _ = writeln!(s, "  n{} [shape=box, label={}];", n.index(), quote(&label));
        for v in node.inputs.iter().flatten() {
            let src = match g.value(*v).def {
                ValueDef::Input => format!("v{}", v.index()),
                ValueDef::Node { node: p, .. } => format!("n{}", p.index()),
                ValueDef::Weight(_) => continue,
            };
            let _ = writeln!(s, "  {src} -> n{} [label={}];", n.index(), quote(&format!("{v} {}", g.value(*v).ty)));
        }
    }
    for (i, v) in g.outputs().iter().enumerate() {
        let _ = writeln!(s, "  out{i} [shape=ellipse, style=bold, label={}];", quote(&g.value(*v).name));
        let src = match g.value(*v).def {
            ValueDef::Node { node, .. } => format!("n{}", node.index()),
            _ => format!("v{}", v.index()),
        };
        let _ = writeln!(s, "  {src} -> out{i} [label={}];", quote(&g.value(*v).ty.to_string()));
    }
    s.push_str("}\n");
    s
}

fn quote(text: &str) -> String {
    let mut q = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}
