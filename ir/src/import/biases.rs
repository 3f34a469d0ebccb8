//! Biases the exporter dropped: PyTorch's default exporter (its optimizer) removes the bias
//! operand of a `Conv`, `ConvTranspose` or `Gemm` whose bias holds only zeros, as a layer
//! freshly initialised before training does (Hugging Face models zero their linear and
//! patch-embedding biases). The model computes the same, but a parameter PyTorch trains is
//! gone: trained as exported, that layer stays without a bias and the training is no longer
//! the source model's.
//!
//! Where the exported program's signature lists `M.bias` that the model holds under no
//! name ([`provenance::parameters_not_in_graph`]) and a node of those kinds reads the
//! initializer `M.weight` with no bias operand, [`restore_dropped_biases`] gives the node
//! back a zero initializer `M.bias` (the element type of `M.weight`, one value per output
//! channel), which then trains as PyTorch's bias does. A node the optimizer fused a
//! BatchNorm `BN` into (an export in eval mode) gets `BN.bias` back the same way: the
//! fused bias is that BatchNorm's shift, zeros when fresh, and dropped again as such. Both the importer and `export` make
//! the rewrite on the same source graph, so the trained bias lands in the model written.

use std::collections::{BTreeMap, HashMap, HashSet};

use onnx_protobuf::{AttributeProto, GraphProto, NodeProto, TensorProto};

use super::merged::float_size;
use super::provenance;

/// Gives each node of `g` whose all-zero bias the exporter dropped a zero bias initializer
/// again (see the module docs). Returns the biases restored, `name [n]`, by name.
pub fn restore_dropped_biases(g: &mut GraphProto) -> Vec<String> {
    let missing: HashSet<String> = provenance::parameters_not_in_graph(g).into_iter().collect();
    if missing.is_empty() {
        return Vec::new();
    }
    let weights: HashMap<&str, &TensorProto> = g.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut restored: BTreeMap<String, (i64, i32)> = BTreeMap::new();
    let mut rewired: Vec<(usize, String)> = Vec::new();
    let mut conflicting: HashSet<String> = HashSet::new();
    for (k, node) in g.node.iter().enumerate() {
        let Some(bias) = dropped_bias(node, &missing).filter(|_| lacks_bias(node)) else { continue };
        let Some(weight) = weights.get(node.input[1].as_str()).filter(|w| float_size(w.data_type).is_some()) else { continue };
        let Some(channels) = output_channels(node, &weight.dims) else { continue };
        // A weight several nodes read (one module applied twice) has one bias; readers
        // that disagree on its extent get none.
        if conflicting.contains(&bias) || restored.insert(bias.clone(), (channels, weight.data_type)).is_some_and(|(n, _)| n != channels) {
            restored.remove(&bias);
            conflicting.insert(bias);
            continue;
        }
        rewired.push((k, bias));
    }
    for (k, bias) in rewired {
        if !restored.contains_key(&bias) {
            continue;
        }
        let inputs = &mut g.node[k].input;
        inputs.truncate(2);
        inputs.push(bias);
    }
    for (name, &(channels, data_type)) in &restored {
        let size = float_size(data_type).unwrap_or(4);
        let bytes = usize::try_from(channels).unwrap_or(0) * size;
        g.initializer.push(TensorProto { name: name.clone(), dims: vec![channels], data_type, raw_data: vec![0; bytes], ..TensorProto::default() });
    }
    restored.into_iter().map(|(name, (channels, _))| format!("{name} [{channels}]")).collect()
}

/// The parameter whose zeros `node` (reading the weight `M.weight`) lost, if the signature
/// lists it and the model lacks it: `M.bias`, or, where the optimizer fused a BatchNorm
/// into the node, that BatchNorm's shift `BN.bias` (the fused bias, which trains as the
/// shift does, and which the optimizer drops again when it is zeros, as a fresh
/// BatchNorm's is).
fn dropped_bias(node: &NodeProto, missing: &HashSet<String>) -> Option<String> {
    let module = node.input.get(1)?.strip_suffix(".weight")?;
    let own = format!("{module}.bias");
    if missing.contains(&own) {
        return Some(own);
    }
    let shift = format!("{}.bias", provenance::fused_batchnorm_of(node)?);
    missing.contains(&shift).then_some(shift)
}

/// Whether `node` is a `Conv`, `ConvTranspose` or `Gemm` (default domain) reading no bias,
/// whose bias, restored, would be added as PyTorch adds it (a `Gemm` with `beta` 1).
fn lacks_bias(node: &NodeProto) -> bool {
    let kind = matches!(node.op_type.as_str(), "Conv" | "ConvTranspose" | "Gemm") && matches!(node.domain.as_str(), "" | "ai.onnx");
    let no_bias = node.input.len() == 2 || (node.input.len() == 3 && node.input[2].is_empty());
    let beta_one = node.op_type != "Gemm" || attr(node, "beta").is_none_or(|a| a.f == 1.0);
    kind && no_bias && beta_one
}

/// The extent of the bias of `node`, whose weight has extents `dims`: a `Conv`'s output
/// channels (`dims[0]`), a `ConvTranspose`'s (`dims[1]` times its groups), a `Gemm`'s
/// output columns (`dims[0]` with `transB`, else `dims[1]`).
fn output_channels(node: &NodeProto, dims: &[i64]) -> Option<i64> {
    let int = |name: &str, default: i64| attr(node, name).map_or(default, |a| a.i);
    let n = match node.op_type.as_str() {
        "Conv" if dims.len() >= 3 => dims[0],
        "ConvTranspose" if dims.len() >= 3 => dims[1] * int("group", 1),
        "Gemm" if dims.len() == 2 => dims[if int("transB", 0) != 0 { 0 } else { 1 }],
        _ => return None,
    };
    (n > 0).then_some(n)
}

fn attr<'a>(node: &'a NodeProto, name: &str) -> Option<&'a AttributeProto> {
    node.attribute.iter().find(|a| a.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::StringStringEntryProto;

    fn node(op: &str, inputs: &[&str]) -> NodeProto {
        NodeProto { op_type: op.into(), name: format!("{op}_0"), input: inputs.iter().map(|s| s.to_string()).collect(), output: vec![format!("{op}_out")], ..NodeProto::default() }
    }

    fn weight(name: &str, dims: &[i64]) -> TensorProto {
        let n: i64 = dims.iter().product();
        TensorProto { name: name.into(), dims: dims.to_vec(), data_type: 1, raw_data: vec![1; 4 * n as usize], ..TensorProto::default() }
    }

    /// A default-exporter graph: its signature lists the parameters, and one fold record
    /// marks it as optimized (what [`provenance::parameters_not_in_graph`] asks for).
    fn exported(nodes: Vec<NodeProto>, inits: Vec<TensorProto>, params: &[&str]) -> GraphProto {
        let signature = params.iter().map(|p| format!("p_{}: PARAMETER target='{p}'", p.replace('.', "_"))).collect::<Vec<_>>().join("\n");
        let mut g = GraphProto { node: nodes, initializer: inits, ..GraphProto::default() };
        g.metadata_props.push(StringStringEntryProto { key: "pkg.torch.export.ExportedProgram.graph_signature".into(), value: signature, ..Default::default() });
        let mut folded = onnx_protobuf::ValueInfoProto { name: "val_0".into(), ..Default::default() };
        folded.metadata_props.push(StringStringEntryProto { key: "pkg.onnxscript.optimizer.folded_from".into(), value: "{'head.weight'}".into(), ..Default::default() });
        g.value_info.push(folded);
        g.initializer.push(weight("val_0", &[2]));
        g
    }

    #[test]
    fn a_dropped_conv_and_gemm_bias_come_back_as_zeros() {
        let mut gemm = node("Gemm", &["x", "head.weight"]);
        gemm.attribute.push(AttributeProto { name: "transB".into(), i: 1, ..Default::default() });
        let mut g = exported(
            vec![node("Conv", &["x", "conv.weight"]), gemm, node("Conv", &["x", "kept.weight", "kept.bias"])],
            vec![weight("conv.weight", &[8, 3, 3, 3]), weight("head.weight", &[10, 8]), weight("kept.weight", &[4, 3, 1, 1]), weight("kept.bias", &[4])],
            &["conv.weight", "conv.bias", "head.weight", "head.bias", "kept.weight", "kept.bias"],
        );
        assert_eq!(restore_dropped_biases(&mut g), ["conv.bias [8]", "head.bias [10]"]);
        assert_eq!(g.node[0].input, ["x", "conv.weight", "conv.bias"]);
        assert_eq!(g.node[1].input, ["x", "head.weight", "head.bias"]);
        assert_eq!(g.node[2].input, ["x", "kept.weight", "kept.bias"]);
        let bias = g.initializer.iter().find(|t| t.name == "head.bias").expect("restored");
        assert_eq!((bias.dims.as_slice(), bias.data_type, bias.raw_data.len()), ([10i64].as_slice(), 1, 40));
        assert!(bias.raw_data.iter().all(|&b| b == 0));
        // The rewrite is the same on the same source (export makes it again), and a model
        // that lists no missing bias keeps its graph.
        assert!(restore_dropped_biases(&mut g).is_empty());
    }

    /// One module applied twice (two nodes reading its weight) gets one bias, read by both.
    #[test]
    fn a_module_applied_twice_gets_one_bias() {
        let mut g = exported(vec![node("Conv", &["x", "shared.weight"]), node("Conv", &["Conv_out", "shared.weight"])], vec![weight("shared.weight", &[3, 3, 1, 1])], &["shared.weight", "shared.bias"]);
        assert_eq!(restore_dropped_biases(&mut g), ["shared.bias [3]"]);
        assert!(g.node.iter().all(|n| n.input.get(2).map(String::as_str) == Some("shared.bias")));
        assert_eq!(g.initializer.iter().filter(|t| t.name == "shared.bias").count(), 1);
    }

    /// An export whose optimizer only dropped zero Conv biases (SpeechT5's HiFi-GAN
    /// vocoder: no fold recorded) says so on the Conv it rewrote; without that record, or
    /// a fold's, nothing tells a dropped bias from a parameter no output reads.
    #[test]
    fn a_rewrite_record_alone_marks_the_export_optimized() {
        let mut conv = node("Conv", &["x", "conv.weight"]);
        let unread = |conv: NodeProto| {
            let mut g = exported(vec![conv], vec![weight("conv.weight", &[8, 3, 3])], &["conv.weight", "conv.bias"]);
            g.value_info.clear();
            g
        };
        assert!(restore_dropped_biases(&mut unread(conv.clone())).is_empty());
        conv.metadata_props.push(StringStringEntryProto { key: "pkg.onnxscript.rewriter.rule_name".into(), value: "RemoveOptionalBiasFromConv".into(), ..Default::default() });
        let mut g = unread(conv);
        assert_eq!(restore_dropped_biases(&mut g), ["conv.bias [8]"]);
        assert_eq!(g.node[0].input, ["x", "conv.weight", "conv.bias"]);
    }

    /// A Conv the optimizer fused a fresh BatchNorm into, whose zero fused bias it then
    /// dropped (hgnet_v2's stem, a convolution without a bias of its own): the bias comes
    /// back as the BatchNorm's shift, which is what the fused bias trains as.
    #[test]
    fn a_batchnorm_fused_into_a_conv_gets_its_dropped_shift_back() {
        let mut conv = node("Conv", &["x", "stem.conv.weight"]);
        conv.metadata_props.push(StringStringEntryProto { key: "pkg.onnxscript.rewriter.rule_name".into(), value: "RemoveOptionalBiasFromConv, FuseBatchNormIntoConv, RemoveOptionalBiasFromConv".into(), ..Default::default() });
        conv.metadata_props.push(StringStringEntryProto { key: "pkg.torch.onnx.name_scopes".into(), value: "['', 'stem.bn', '_native_batch_norm_legit_no_training']".into(), ..Default::default() });
        let mut g = exported(vec![conv], vec![weight("stem.conv.weight", &[8, 3, 3, 3])], &["stem.conv.weight", "stem.bn.weight", "stem.bn.bias"]);
        assert_eq!(restore_dropped_biases(&mut g), ["stem.bn.bias [8]"]);
        assert_eq!(g.node[0].input, ["x", "stem.conv.weight", "stem.bn.bias"]);
    }

    #[test]
    fn only_a_listed_bias_of_a_weight_read_as_such_is_restored() {
        // A layer PyTorch built without a bias (not listed), a Gemm whose beta scales its
        // bias, a weight the node reads under another name (a fold), a MatMul.
        let mut scaled = node("Gemm", &["x", "scaled.weight"]);
        scaled.attribute.push(AttributeProto { name: "beta".into(), f: 0.5, ..Default::default() });
        let mut g = exported(
            vec![node("Conv", &["x", "plain.weight"]), scaled, node("Gemm", &["x", "val_0"]), node("MatMul", &["x", "mm.weight"])],
            vec![weight("plain.weight", &[8, 3, 3, 3]), weight("scaled.weight", &[4, 4]), weight("mm.weight", &[4, 4])],
            &["plain.weight", "scaled.weight", "scaled.bias", "head.weight", "head.bias", "mm.weight", "mm.bias"],
        );
        let before = g.clone();
        assert!(restore_dropped_biases(&mut g).is_empty());
        assert_eq!(g, before);
    }
}
