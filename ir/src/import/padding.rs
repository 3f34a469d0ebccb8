//! Embedding rows PyTorch never trains. `nn.Embedding(num, dim, padding_idx=p)` gives
//! row `p` no gradient; ONNX's `Gather` has no such notion, and the default exporter
//! keeps it only in the lookup's FX node ([`super::fx`]),
//! `aten.embedding.default(%weight, %ids, p)`. Trained as a plain `Gather`, the padding
//! row moves wherever the ids hold `p` (a decoder fed labels padded with it).
//!
//! [`stop_padding_rows`] reads each such lookup through
//! `Where(Unsqueeze(ids == p, -1), StopGradient(rows), rows)`: the same values, and no
//! gradient from the positions that hold `p`, the only ones that read row `p`. The rows
//! others read train as before.

use std::collections::HashSet;

use onnx_protobuf::{NodeProto, TensorProto};
use pipewright_ops::op::AttrValue;

use super::attrs::attribute_proto;
use super::fx::{fx_arguments, fx_node, fx_target, top_level};

/// What [`stop_padding_rows`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PaddingRows {
    /// The nodes it added that the importer reads as `StopGradient`.
    pub stops: HashSet<String>,
    /// Each lookup it rewrote: `NODE (row P of WEIGHT)`.
    pub lookups: Vec<String>,
}

/// The first opset whose `Unsqueeze` takes its axes as an input.
const UNSQUEEZE_AXES_INPUT: i64 = 13;

/// The padding index the default exporter recorded for `node`, when it is an embedding
/// lookup (`Gather` along axis 0) of a module given one.
fn padding_index(node: &NodeProto) -> Option<i64> {
    let along_rows = node.attribute.iter().all(|a| a.name != "axis" || a.i == 0);
    if node.op_type != "Gather" || node.input.len() != 2 || node.output.len() != 1 || !along_rows {
        return None;
    }
    let fx = fx_node(node)?;
    if fx_target(fx)? != "aten.embedding.default" {
        return None;
    }
    let p: i64 = top_level(fx_arguments(fx)?.0).get(2)?.parse().ok()?;
    // PyTorch stores a negative index counted from the end; -1 only in FX's default.
    (p >= 0).then_some(p)
}

/// Rewrites every embedding lookup with a padding index in `nodes` (see the module docs);
/// the constants it needs join `initializers`. `opset`: the model's default opset.
pub fn stop_padding_rows(nodes: &mut Vec<NodeProto>, initializers: &mut Vec<TensorProto>, opset: i64) -> PaddingRows {
    let mut out = PaddingRows::default();
    let mut k = 0;
    while k < nodes.len() {
        match padding_index(&nodes[k]) {
            Some(p) => {
                let (added, constants) = guard_padding_row(&mut nodes[k], p, opset, &mut out);
                let count = added.len();
                nodes.splice(k + 1..k + 1, added);
                initializers.extend(constants);
                k += 1 + count;
            }
            None => k += 1,
        }
    }
    out
}

/// The nodes and constants that read `lookup`'s rows where its id is `p` without a
/// gradient; `lookup` now writes the rows under a name of its own.
fn guard_padding_row(lookup: &mut NodeProto, p: i64, opset: i64, out: &mut PaddingRows) -> (Vec<NodeProto>, Vec<TensorProto>) {
    let (name, ids, y) = (lookup.name.clone(), lookup.input[1].clone(), lookup.output[0].clone());
    out.lookups.push(format!("{name} (row {p} of {})", lookup.input[0]));
    let value = |part: &str| format!("{y}:{part}");
    let rows = value("rows");
    lookup.output[0] = rows.clone();
    let step = |op: &str, inputs: &[&str], output: &str| NodeProto {
        name: format!("{name}/padding_idx/{op}"),
        op_type: op.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        ..Default::default()
    };
    let index = TensorProto { name: value("padding_idx"), data_type: 7, int64_data: vec![p], ..Default::default() };
    let mut constants = vec![index.clone()];
    let mut cast = step("Cast", &[&ids], &value("ids"));
    cast.attribute.push(attribute_proto("to", &AttrValue::Int(7)));
    let equal = step("Equal", &[&value("ids"), &index.name], &value("is_padding"));
    let unsqueeze = if opset >= UNSQUEEZE_AXES_INPUT {
        let axes = TensorProto { name: value("last_axis"), data_type: 7, dims: vec![1], int64_data: vec![-1], ..Default::default() };
        let node = step("Unsqueeze", &[&value("is_padding"), &axes.name], &value("padding_rows"));
        constants.push(axes);
        node
    } else {
        let mut node = step("Unsqueeze", &[&value("is_padding")], &value("padding_rows"));
        node.attribute.push(attribute_proto("axes", &AttrValue::Ints(vec![-1])));
        node
    };
    let stop = NodeProto { name: format!("detach:{rows}"), op_type: "Identity".into(), input: vec![rows.clone()], output: vec![value("detached")], ..Default::default() };
    out.stops.insert(stop.name.clone());
    let select = step("Where", &[&value("padding_rows"), &value("detached"), &rows], &y);
    (vec![cast, equal, unsqueeze, stop, select], constants)
}

#[cfg(test)]
mod tests {
    use super::super::fx::FX_NODE;
    use super::*;
    use onnx_protobuf::StringStringEntryProto;

    fn lookup(args: &str) -> NodeProto {
        let fx = format!("%embedding : [num_users=1] = call_function[target=torch.ops.aten.embedding.default](args = ({args}), kwargs = {{}})");
        NodeProto {
            name: "node_embedding".into(),
            op_type: "Gather".into(),
            input: vec!["lm_head.weight".into(), "ids".into()],
            output: vec!["embedding".into()],
            metadata_props: vec![StringStringEntryProto { key: FX_NODE.into(), value: fx, ..Default::default() }],
            ..Default::default()
        }
    }

    #[test]
    fn a_lookup_with_a_padding_index_reads_that_row_without_a_gradient() {
        let mut nodes = vec![lookup("%p_lm_head_weight, %view_16, 1")];
        let mut initializers = Vec::new();
        let done = stop_padding_rows(&mut nodes, &mut initializers, 18);
        assert_eq!(done.lookups, ["node_embedding (row 1 of lm_head.weight)"]);
        assert_eq!(done.stops, HashSet::from(["detach:embedding:rows".to_string()]));
        let steps: Vec<(&str, Vec<&str>, &str)> = nodes.iter().map(|n| (n.op_type.as_str(), n.input.iter().map(String::as_str).collect(), n.output[0].as_str())).collect();
        assert_eq!(
            steps,
            [
                ("Gather", vec!["lm_head.weight", "ids"], "embedding:rows"),
                ("Cast", vec!["ids"], "embedding:ids"),
                ("Equal", vec!["embedding:ids", "embedding:padding_idx"], "embedding:is_padding"),
                ("Unsqueeze", vec!["embedding:is_padding", "embedding:last_axis"], "embedding:padding_rows"),
                ("Identity", vec!["embedding:rows"], "embedding:detached"),
                ("Where", vec!["embedding:padding_rows", "embedding:detached", "embedding:rows"], "embedding"),
            ]
        );
        let constants: Vec<(&str, &[i64])> = initializers.iter().map(|t| (t.name.as_str(), t.int64_data.as_slice())).collect();
        assert_eq!(constants, [("embedding:padding_idx", &[1][..]), ("embedding:last_axis", &[-1][..])]);
    }

    #[test]
    fn before_opset_13_the_axis_is_an_attribute() {
        let mut nodes = vec![lookup("%p_w, %ids, 0")];
        let mut initializers = Vec::new();
        stop_padding_rows(&mut nodes, &mut initializers, 11);
        let unsqueeze = nodes.iter().find(|n| n.op_type == "Unsqueeze").unwrap();
        assert_eq!(unsqueeze.input, ["embedding:is_padding"]);
        assert_eq!(unsqueeze.attribute, [attribute_proto("axes", &AttrValue::Ints(vec![-1]))]);
        assert_eq!(initializers.len(), 1);
    }

    #[test]
    fn lookups_without_a_padding_index_stay() {
        for args in ["%p_w, %ids", "%p_w, %ids, -1"] {
            let mut nodes = vec![lookup(args)];
            let before = nodes.clone();
            assert_eq!(stop_padding_rows(&mut nodes, &mut Vec::new(), 18), PaddingRows::default(), "{args}");
            assert_eq!(nodes, before);
        }
        let mut other_axis = lookup("%p_w, %ids, 0");
        other_axis.attribute.push(attribute_proto("axis", &AttrValue::Int(1)));
        assert_eq!(padding_index(&other_axis), None);
    }
}
