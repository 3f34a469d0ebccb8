//! Where the source model stops gradients. PyTorch's `detach()` has no ONNX op: the
//! default exporter writes it as an `Identity` whose FX node (`pkg.torch.onnx.fx_node`
//! metadata) is `aten.detach`, and its optimizer then drops that `Identity`, so that the
//! only record left is in the metadata of the node that reads the detached value, whose FX
//! arguments name `%detach_K`, a value the graph no longer holds. Read as a plain value,
//! it would pass back gradients the source model never passes: a straight-through
//! estimator's `x + (q - x).detach()` would train a codebook through `q`, a detached
//! reference point the layers before it.
//!
//! [`stop_detached_reads`] puts each such read back behind a node of its own, which the
//! importer turns into [`crate::Op::StopGradient`], as it turns the `Identity` of an
//! unoptimized export ([`is_detach`]).
//!
//! The detached read is found by name: the consumer's inputs computed by other nodes that
//! none of its FX arguments names are what the dropped detaches passed on. Where more
//! such inputs than detaches remain (the optimizer also dropped a `clone` or folded a
//! product by one), the detach's position among the FX arguments picks the input at that
//! position, if that is one of them; otherwise the detach is reported unplaced.

use std::collections::{HashMap, HashSet};

use onnx_protobuf::{GraphProto, NodeProto};

use super::fx::{fx_arguments, fx_node, fx_target, fx_values, top_level};

/// Whether `node` is the `Identity` an unoptimized export writes for a `detach()`.
pub fn is_detach(node: &NodeProto) -> bool {
    node.op_type == "Identity" && fx_node(node).and_then(fx_target).is_some_and(|t| t.starts_with("aten.detach."))
}

/// What [`stop_detached_reads`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Detached {
    /// The nodes it added, each to be imported as a `StopGradient`.
    pub nodes: HashSet<String>,
    /// Each read put behind one: `NODE reads VALUE`.
    pub reads: Vec<String>,
    /// Nodes whose FX arguments name a dropped detach that no input could be matched to.
    pub unplaced: Vec<String>,
}

/// The inputs of the nodes from one FX node that `fx` says are read detached, by node
/// index and input position; `Err` when a dropped detach matches no input.
fn detached_inputs(fx: &str, group: &[usize], g: &GraphProto, held: &HashSet<&str>, computed: &HashSet<&str>) -> Result<Vec<(usize, usize)>, ()> {
    let Some((args, kwargs)) = fx_arguments(fx) else { return Ok(Vec::new()) };
    let named: HashSet<&str> = fx_values(args).chain(fx_values(kwargs)).collect();
    let dropped = named.iter().filter(|v| v.starts_with("detach") && !held.contains(**v)).count();
    if dropped == 0 {
        return Ok(Vec::new());
    }
    let inside: HashSet<&str> = group.iter().flat_map(|&i| g.node[i].output.iter().map(String::as_str)).collect();
    // Inputs other nodes computed that no argument names, each once.
    let mut unnamed: Vec<(usize, usize)> = Vec::new();
    for &i in group {
        for (k, input) in g.node[i].input.iter().enumerate() {
            let v = input.as_str();
            let fresh = !unnamed.iter().any(|&(j, m)| g.node[j].input[m] == v);
            if computed.contains(v) && !inside.contains(v) && !named.contains(v) && fresh {
                unnamed.push((i, k));
            }
        }
    }
    if unnamed.len() <= dropped {
        // None left: the detached value is a constant or an input, which trains nothing.
        return Ok(unnamed);
    }
    let [single] = group else { return Err(()) };
    let arguments = top_level(args);
    let positions: Vec<usize> = arguments.iter().enumerate().filter(|(_, a)| a.strip_prefix('%').is_some_and(|v| v.starts_with("detach") && !held.contains(v))).map(|(k, _)| k).collect();
    let picked: Vec<(usize, usize)> = unnamed.iter().copied().filter(|&(_, k)| positions.contains(&k)).collect();
    if picked.len() == positions.len() && g.node[*single].input.len() == arguments.len() {
        Ok(picked)
    } else {
        Err(())
    }
}

/// Puts every read the default exporter recorded as detached behind a node of its own
/// (see the module docs): `VALUE` read by `NODE` becomes `VALUE:detached`, computed from it
/// by the node `detach:VALUE` (one per value, placed before its first reader).
pub fn stop_detached_reads(g: &mut GraphProto) -> Detached {
    let held: HashSet<&str> = g.node.iter().flat_map(|n| n.output.iter()).chain(g.input.iter().map(|i| &i.name)).chain(g.initializer.iter().map(|t| &t.name)).map(String::as_str).collect();
    let computed: HashSet<&str> = g.node.iter().filter(|n| n.op_type != "Constant").flat_map(|n| n.output.iter().map(String::as_str)).collect();
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, node) in g.node.iter().enumerate() {
        let Some(fx) = fx_node(node).filter(|fx| fx.contains("%detach")) else { continue };
        match groups.iter_mut().find(|(f, _)| *f == fx) {
            Some((_, members)) => members.push(i),
            None => groups.push((fx, vec![i])),
        }
    }
    let mut out = Detached::default();
    let mut reads: Vec<(usize, usize)> = Vec::new();
    for (fx, group) in &groups {
        match detached_inputs(fx, group, g, &held, &computed) {
            Ok(found) => reads.extend(found),
            Err(()) => out.unplaced.extend(group.iter().map(|&i| g.node[i].name.clone())),
        }
    }
    reads.sort_unstable();
    insert_stop_gradients(g, &reads, &mut out);
    out
}

/// Rewires each `(node, input)` of `reads` (sorted) to the value's detached copy, adding
/// the node that computes it before its first reader.
fn insert_stop_gradients(g: &mut GraphProto, reads: &[(usize, usize)], out: &mut Detached) {
    let mut copies: HashMap<String, String> = HashMap::new();
    let mut before: Vec<(usize, NodeProto)> = Vec::new();
    for &(i, k) in reads {
        let value = g.node[i].input[k].clone();
        out.reads.push(format!("{} reads {value}", g.node[i].name));
        let copy = copies.entry(value.clone()).or_insert_with(|| {
            let copy = format!("{value}:detached");
            let node = NodeProto { name: format!("detach:{value}"), op_type: "Identity".into(), input: vec![value.clone()], output: vec![copy.clone()], ..Default::default() };
            out.nodes.insert(node.name.clone());
            before.push((i, node));
            copy
        });
        g.node[i].input[k] = copy.clone();
    }
    for (i, node) in before.into_iter().rev() {
        g.node.insert(i, node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::fx::FX_NODE;
    use onnx_protobuf::{StringStringEntryProto, TensorProto};

    fn node(name: &str, op: &str, inputs: &[&str], output: &str, fx: Option<&str>) -> NodeProto {
        let metadata_props = fx.map(|f| StringStringEntryProto { key: FX_NODE.into(), value: f.into(), ..Default::default() }).into_iter().collect();
        NodeProto { name: name.into(), op_type: op.into(), input: inputs.iter().map(|s| s.to_string()).collect(), output: vec![output.into()], metadata_props, ..Default::default() }
    }

    fn fx(out: &str, target: &str, args: &str) -> String {
        format!("%{out} : [num_users=1] = call_function[target=torch.ops.aten.{target}](args = ({args}), kwargs = {{}})")
    }

    /// DAC's straight-through quantizer as the optimizer leaves it: `z + (q - z).detach()`.
    fn straight_through() -> GraphProto {
        GraphProto {
            node: vec![
                node("node_conv", "Conv", &["x", "w"], "conv1d_16", None),
                node("node_sub", "Sub", &["q", "conv1d_16"], "sub_150", None),
                node("node_add", "Add", &["conv1d_16", "sub_150"], "add_624", Some(&fx("add_624", "add.Tensor", "%conv1d_16, %detach_2"))),
            ],
            initializer: vec![TensorProto { name: "w".into(), ..Default::default() }, TensorProto { name: "q".into(), ..Default::default() }],
            ..Default::default()
        }
    }

    #[test]
    fn a_dropped_detach_is_put_back_before_its_reader() {
        let mut g = straight_through();
        let d = stop_detached_reads(&mut g);
        assert_eq!(d.reads, ["node_add reads sub_150"]);
        assert!(d.unplaced.is_empty());
        let names: Vec<&str> = g.node.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["node_conv", "node_sub", "detach:sub_150", "node_add"]);
        assert_eq!((g.node[2].input.as_slice(), g.node[2].output.as_slice()), (&["sub_150".to_string()][..], &["sub_150:detached".to_string()][..]));
        assert_eq!(g.node[3].input, ["conv1d_16", "sub_150:detached"]);
        assert_eq!(d.nodes, HashSet::from(["detach:sub_150".to_string()]));
    }

    #[test]
    fn the_position_decides_where_names_do_not() {
        // `add(%mul_344, %detach_1)`: the optimizer also folded `mul_344` (a product by
        // one), so neither input is named; the detach is the second argument.
        let mut g = GraphProto {
            node: vec![
                node("e", "Gather", &["table", "ids"], "embedding_1", None),
                node("p", "Reshape", &["pos", "shape"], "view_22", None),
                node("node_add", "Add", &["embedding_1", "view_22"], "add_559", Some(&fx("add_559", "add.Tensor", "%mul_344, %detach_1"))),
            ],
            ..Default::default()
        };
        assert_eq!(stop_detached_reads(&mut g).reads, ["node_add reads view_22"]);
    }

    #[test]
    fn a_detach_no_input_can_be_matched_to_is_unplaced() {
        // Two unnamed computed inputs of a node from a decomposed op, and nothing to
        // tell which one the detach was.
        let text = fx("linear", "linear.default", "%detach, %clone_2");
        let mut g = GraphProto {
            node: vec![
                node("a", "Relu", &["x"], "a_out", None),
                node("b", "Relu", &["y"], "b_out", None),
                node("mm", "MatMul", &["a_out", "b_out"], "mm_out", Some(&text)),
                node("bias", "Add", &["mm_out", "b_out"], "linear", Some(&text)),
            ],
            ..Default::default()
        };
        let before = g.clone();
        let d = stop_detached_reads(&mut g);
        assert_eq!(d.unplaced, ["mm", "bias"]);
        assert!(d.reads.is_empty());
        assert_eq!(g, before);
    }

    #[test]
    fn a_detached_constant_or_a_value_still_held_needs_nothing() {
        // The detach's input was a constant (a sinusoidal table folded), or the detach
        // is still in the graph (an unoptimized export, read through `is_detach`).
        let mut g = GraphProto {
            node: vec![
                node("k", "Constant", &[], "table", None),
                node("node_add", "Add", &["x", "table"], "out", Some(&fx("out", "add.Tensor", "%x, %detach"))),
                node("node_detach", "Identity", &["out"], "detach_1", Some(&fx("detach_1", "detach.default", "%out"))),
                node("node_mul", "Mul", &["x", "detach_1"], "y", Some(&fx("y", "mul.Tensor", "%x, %detach_1"))),
            ],
            ..Default::default()
        };
        let before = g.clone();
        assert_eq!(stop_detached_reads(&mut g), Detached::default());
        assert_eq!(g, before);
        assert!(is_detach(&g.node[2]));
        assert!(!is_detach(&g.node[1]));
    }
}
