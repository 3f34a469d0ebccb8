//! What the exporter says an initializer is: PyTorch's default exporter records, for a
//! constant it folded, the values it was folded from (`pkg.onnxscript.optimizer.folded_from`
//! in the `value_info` metadata), and for a lifted input whether it was a parameter or a
//! buffer (`pkg.torch.export.graph_signature.InputSpec.kind`).
//!
//! A float initializer of rank >= 1 is otherwise taken for a parameter, which is wrong for
//! the constants that exporter folds at a fixed batch or a fixed sequence: a causal mask
//! (folded from `arange`, `full`, `triu`...: no module state at all) and a rotary table
//! (folded from the `inv_freq` buffer). Trained, a mask's zeros and a table's entries
//! move, and the model is no longer the one exported (a Llama exported with a dynamic
//! batch trained to outputs 2e-2 away from PyTorch's after one step). Such initializers are
//! frozen. A constant folded from a parameter (a transposed weight, position embeddings
//! gathered at fixed positions) is that parameter's image and trains.

use std::collections::{HashMap, HashSet};

use onnx_protobuf::GraphProto;

const FOLDED_FROM: &str = "pkg.onnxscript.optimizer.folded_from";
const INPUT_KIND: &str = "pkg.torch.export.graph_signature.InputSpec.kind";

/// Module state PyTorch models register as buffers, never trained, by the last part of
/// its name (rotary frequencies, index tables, running statistics, the logits bias of
/// BART's family).
const BUFFER_NAMES: &[&str] = &["inv_freq", "position_ids", "token_type_ids", "running_mean", "running_var", "num_batches_tracked", "relative_position_index", "final_logits_bias"];

/// Whether the last part of `name` is one of [`BUFFER_NAMES`].
fn has_buffer_name(name: &str) -> bool {
    BUFFER_NAMES.contains(&name.rsplit('.').next().unwrap_or(name))
}

/// The initializers of an export without an exported program's signature (the
/// TorchScript exporter's) that carry a buffer's name ([`BUFFER_NAMES`]): that exporter
/// writes buffers as initializers like parameters, and nothing else tells them apart. An
/// export with a signature says which are buffers ([`exporter_constants`]).
pub fn buffers_by_name(g: &GraphProto) -> HashSet<String> {
    if signature(g).is_some() {
        return HashSet::new();
    }
    g.initializer.iter().filter(|t| has_buffer_name(&t.name)).map(|t| t.name.clone()).collect()
}

/// The initializers of `g` its exporter marks as no parameter, each with why.
pub fn exporter_constants(g: &GraphProto) -> HashMap<String, String> {
    let initializers: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let parameters = Parameters::of(g);
    let mut constants = HashMap::new();
    for info in g.value_info.iter().filter(|v| initializers.contains(v.name.as_str())) {
        let meta = |key: &str| info.metadata_props.iter().find(|p| p.key == key).map(|p| p.value.as_str());
        if let Some(kind) = meta(INPUT_KIND).filter(|k| *k == "BUFFER" || *k == "CONSTANT_TENSOR") {
            constants.insert(info.name.clone(), format!("the exporter lifted it as a {}", kind.to_lowercase().replace('_', " ")));
        } else if let Some(sources) = meta(FOLDED_FROM) {
            if !source_names(sources).any(|n| parameters.contains(n)) {
                constants.insert(info.name.clone(), format!("the exporter folded it from no parameter ({})", abbreviated(sources)));
            }
        }
    }
    constants
}

/// What a value was folded from, as the exporter recorded it (a Python list of names).
fn folded_from(info: &onnx_protobuf::ValueInfoProto) -> Option<&str> {
    info.metadata_props.iter().find(|p| p.key == FOLDED_FROM).map(|p| p.value.as_str())
}

/// Each initializer of `g` the exporter records as folded, with what it was folded from.
fn folds(g: &GraphProto) -> impl Iterator<Item = (&str, &str)> {
    let initializers: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    g.value_info.iter().filter(move |v| initializers.contains(v.name.as_str())).filter_map(|info| Some((info.name.as_str(), folded_from(info)?)))
}

/// The exported program's signature (graph metadata): one line per input, `NAME: KIND
/// target='PARAMETER.NAME'` for module state.
const SIGNATURE: &str = "pkg.torch.export.ExportedProgram.graph_signature";

/// The parameters the exporter's signature lists that the model holds under no name: no
/// initializer, graph input or folded constant's source is named after them, in a graph
/// the exporter's optimizer went over (it records its folds, and the rules it rewrote
/// nodes by). That optimizer drops a Conv's or Gemm's all-zero bias (recording
/// `RemoveOptionalBiasFromConv` on the Conv, which may be all it folds) and stores
/// parameters of equal values (fresh zero biases, zero class tokens) once, under one
/// name. Without it, a parameter is missing only because no output reads it, or under the
/// name of the parameter it is tied to.
pub fn parameters_not_in_graph(g: &GraphProto) -> Vec<String> {
    let Some(signature) = signature(g) else { return Vec::new() };
    let records: Vec<&str> = g.value_info.iter().filter_map(folded_from).collect();
    let rewritten = g.node.iter().any(|n| n.metadata_props.iter().any(|p| p.key == RULES));
    if records.is_empty() && !rewritten {
        return Vec::new();
    }
    let mut named: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).chain(g.input.iter().map(|i| i.name.as_str())).collect();
    named.extend(records.into_iter().flat_map(source_names));
    signature_parameters(signature).filter(|name| !named.contains(name.as_str())).collect()
}

/// The exported program's signature of `g` (graph metadata), if its exporter wrote one.
fn signature(g: &GraphProto) -> Option<&str> {
    g.metadata_props.iter().find(|p| p.key == SIGNATURE).map(|p| p.value.as_str())
}

/// The parameters an exported program's signature lists, in its order.
fn signature_parameters(signature: &str) -> impl Iterator<Item = String> + '_ {
    signature_targets(signature, "PARAMETER")
}

/// The module state an exported program's signature lists as `kind` (`PARAMETER`,
/// `BUFFER`), in its order: the lines `NAME: KIND target='STATE.NAME' ...`.
fn signature_targets<'a>(signature: &'a str, kind: &'a str) -> impl Iterator<Item = String> + 'a {
    signature.lines().filter_map(move |line| {
        let target = line.split_once(": ")?.1.strip_prefix(kind)?.strip_prefix(" target='")?;
        target.split_once('\'').map(|(name, _)| name.to_string())
    })
}

/// Every parameter the exported program's signature (graph metadata) lists; empty for an
/// export without one.
pub fn listed_parameters(g: &GraphProto) -> HashSet<String> {
    signature(g).map(|s| signature_parameters(s).collect()).unwrap_or_default()
}

/// The module the default exporter recorded `node` in (`pkg.torch.onnx.name_scopes`, a
/// Python list whose last entry is the node's own op): `model.encoder.layer.0.output`.
pub fn module_of(node: &onnx_protobuf::NodeProto) -> Option<&str> {
    let scopes = node.metadata_props.iter().find(|p| p.key == "pkg.torch.onnx.name_scopes")?.value.as_str();
    let names: Vec<&str> = source_names(scopes).collect();
    names.len().checked_sub(2).map(|i| names[i]).filter(|m| !m.is_empty())
}

/// The rewrite rules the default exporter's optimizer applied to a node, comma-separated.
const RULES: &str = "pkg.onnxscript.rewriter.rule_name";

/// The BatchNorm modules the exporter's optimizer fused into the Conv, ConvTranspose or
/// Gemm before them (its `FuseBatchNormInto...` rules, which an export in eval mode
/// allows), in node order: the fused node records the rule and keeps the BatchNorm's
/// module. Their scale, shift and running statistics are then folded into that node's
/// weight and bias, and no longer in the model.
pub fn fused_batchnorms(g: &GraphProto) -> Vec<String> {
    let mut modules: Vec<String> = Vec::new();
    for node in &g.node {
        if let Some(module) = fused_batchnorm_of(node).filter(|m| !modules.iter().any(|k| k == m)) {
            modules.push(module.to_string());
        }
    }
    modules
}

/// The BatchNorm module the exporter's optimizer fused into `node`, where it did (see
/// [`fused_batchnorms`]).
pub fn fused_batchnorm_of(node: &onnx_protobuf::NodeProto) -> Option<&str> {
    let fused = node.metadata_props.iter().any(|p| p.key == RULES && p.value.split(", ").any(|r| r.starts_with("FuseBatchNormInto")));
    module_of(node).filter(|_| fused)
}

/// The convolutions the TorchScript exporter fused the BatchNorm after them into, in node
/// order, by node name. Exporting a model in eval mode, that exporter folds each
/// BatchNorm's scale, shift and running statistics into the convolution before it and
/// stores the results as new constants it names itself (`onnx::Conv_N` for the weight and
/// `onnx::Conv_M` for the bias, which the fused layer has even where the convolution had
/// none); a convolution it leaves alone keeps its parameters' names. It records nothing
/// else of the fusion, so both names are the evidence. Equal constants (the fused biases
/// of freshly initialised BatchNorms are all zeros) it stores once, the others becoming
/// `Identity` nodes of that one.
pub fn script_fused_batchnorms(g: &GraphProto) -> Vec<String> {
    let initializers: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let identities: HashMap<&str, &str> =
        g.node.iter().filter(|n| n.op_type == "Identity" && n.input.len() == 1 && n.output.len() == 1).map(|n| (n.output[0].as_str(), n.input[0].as_str())).collect();
    let stored = |name: &str| initializers.contains(name) || identities.get(name).is_some_and(|source| initializers.contains(source));
    g.node
        .iter()
        .filter(|n| matches!(n.op_type.as_str(), "Conv" | "ConvTranspose"))
        .filter(|n| {
            let made = format!("onnx::{}_", n.op_type);
            let is_made = |i: usize| n.input.get(i).is_some_and(|name| name.starts_with(&made) && stored(name));
            is_made(1) && is_made(2)
        })
        .map(|n| n.name.clone())
        .collect()
}

/// The initializers an export without a signature (the TorchScript exporter's) computed
/// and named itself (`onnx::Op_N`, after the first node that reads it) and that no layer
/// reads as its weight (MatMul, Gemm, Conv, ConvTranspose and the recurrent layers, whose
/// folded weights are the parameter moved or a fused BatchNorm, said apart). Folding a
/// parameter through arithmetic (`1 - x`, a scale) or a buffer (`final_logits_bias`
/// through `.to(device)`) leaves such a constant and nothing else: the export records
/// neither its source nor that it was one.
pub fn script_computed_constants(g: &GraphProto) -> HashSet<String> {
    if signature(g).is_some() {
        return HashSet::new();
    }
    const LAYERS: &[&str] = &["MatMul", "Gemm", "Conv", "ConvTranspose", "LSTM", "GRU", "RNN"];
    let identities: HashMap<&str, &str> =
        g.node.iter().filter(|n| n.op_type == "Identity" && n.input.len() == 1 && n.output.len() == 1).map(|n| (n.output[0].as_str(), n.input[0].as_str())).collect();
    let mut read_by_layer: HashSet<&str> = HashSet::new();
    for n in g.node.iter().filter(|n| LAYERS.contains(&n.op_type.as_str())) {
        for input in &n.input {
            read_by_layer.insert(identities.get(input.as_str()).copied().unwrap_or(input.as_str()));
        }
    }
    g.initializer.iter().map(|t| t.name.as_str()).filter(|name| name.starts_with("onnx::") && !read_by_layer.contains(name)).map(String::from).collect()
}

/// Whether `parameter` is state of `module` (`module.weight`), not of a module whose name
/// merely begins the same (`module2.weight`).
pub fn is_state_of(parameter: &str, module: &str) -> bool {
    parameter.strip_prefix(module).is_some_and(|rest| rest.starts_with('.'))
}

/// For each initializer of `g` the exporter records as folded, the module state it was
/// folded from (its sources with a dotted name that is no buffer); empty when the exporter
/// recorded nothing (the TorchScript exporter never does).
pub fn folded_parameters(g: &GraphProto) -> HashMap<String, Vec<String>> {
    let parameters = Parameters::of(g);
    folds(g).map(|(name, sources)| (name.to_string(), source_names(sources).filter(|n| parameters.contains(n)).map(String::from).collect())).collect()
}

/// What the exporter's folding may do to a parameter and still leave each of its
/// elements in one place of the constant (so training the constant trains the parameter):
/// its own values (`val_N`), moving axes, slicing, and gathering at distinct positions
/// (an `arange`, or a `position_ids` buffer holding one).
const REINDEXING: &[&str] = &[
    "val", "t", "transpose", "permute", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "slice", "select", "clone", "_to_copy", "detach",
    "type_as", "contiguous", "alias", "lift_fresh_copy", "arange", "embedding", "position_ids",
];

/// What the exporter's folding may further do to the positions a parameter is read at, or
/// to its values, and leave the constant moving one to one with it when trained: expand it
/// to the batch, look it up at indices filled with one value (`zeros`, `full`, a buffer
/// of token type ids) or shifted by a constant (BART's positions `arange + 2`), or shift
/// its values by a constant (`add`, `sub`).
const EXPANDING: &[&str] = &["expand", "zeros", "ones", "full", "add", "sub"];

/// A batch-baked constant the exporter folded from one parameter: where it repeats one
/// slice over the export batch, that slice is the parameter (or rows of it) read at fixed
/// positions, and trains as the parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BakedParameter {
    pub parameter: String,
    /// The folded value is a lookup of the parameter's rows (`embedding`): positions whose
    /// rows are alike read one row (BERT's token type 0 at every position), which trains
    /// once for all of them, as the parameter's row does.
    pub lookup: bool,
}

/// The initializers of `g` the exporter folded from one parameter by [`REINDEXING`] and
/// [`EXPANDING`], expanded or looked up (PEGASUS-X's global token embeddings,
/// `embed_global(arange(G).expand(B, -1))`; BERT's token type embeddings at ids of zeros;
/// CLIP's class embedding expanded to the batch), each with that parameter.
pub fn expanded_parameters(g: &GraphProto) -> HashMap<String, BakedParameter> {
    let known = Parameters::of(g);
    folds(g)
        .filter_map(|(name, sources)| {
            let mut parameters = source_names(sources).filter(|n| known.contains(n));
            let (parameter, None) = (parameters.next()?, parameters.next()) else { return None };
            // Buffers (dotted, no parameter) hold indices: token type ids, position ids.
            let others: Vec<&str> = source_names(sources).filter(|n| !known.contains(n) && !n.contains('.')).map(op_of).collect();
            // The expand or lookup is a source, or the folded value itself (`expand_2`,
            // CLIP's class embedding `expand`ed to the batch, folded from that parameter alone).
            let lookup = op_of(name) == "embedding";
            let expands = others.contains(&"expand") || op_of(name) == "expand" || lookup;
            let moves_with_it = others.iter().all(|op| EXPANDING.contains(op) || REINDEXING.contains(op));
            (expands && moves_with_it).then(|| (name.to_string(), BakedParameter { parameter: parameter.to_string(), lookup }))
        })
        .collect()
}

/// The initializers of `g` the exporter folded from parameters by more than
/// [`REINDEXING`] (a relative-position table gathered with repeats, a weight norm,
/// `exp(A_log)`, positions interpolated), each with what it was folded from: trained, they
/// move as the tensors computed, not as the parameters they came from.
pub fn computed_from_parameters(g: &GraphProto) -> HashMap<String, String> {
    let known = Parameters::of(g);
    folds(g)
        .filter(|(_, sources)| {
            let parameters = source_names(sources).filter(|n| known.contains(n)).count();
            let reindexing = source_names(sources).filter(|n| !known.contains(n)).all(|n| REINDEXING.contains(&op_of(n)));
            parameters > 1 || (parameters == 1 && !reindexing)
        })
        .map(|(name, sources)| (name.to_string(), abbreviated(sources)))
        .collect()
}

/// The operation an exporter value is named after: `embedding_2` -> `embedding`, a
/// buffer `model.embeddings.position_ids` -> `position_ids`.
fn op_of(name: &str) -> &str {
    let last = name.rsplit('.').next().unwrap_or(name);
    match last.rsplit_once('_') {
        Some((op, n)) if !op.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => op,
        _ => last,
    }
}

/// Which names among a folded constant's sources are parameters: module state by its name,
/// dotted (`model.layers.0.weight`, where the exporter's own values are not: `arange`,
/// `val_12`) and no buffer name PyTorch models use ([`BUFFER_NAMES`]), unless the exported
/// program's signature lists the name as a buffer: a `FrozenBatchNorm2d`'s `weight` and
/// `bias`, as DETR's backbone keeps them, are buffers whatever their names.
struct Parameters {
    buffers: HashSet<String>,
}

impl Parameters {
    fn of(g: &GraphProto) -> Parameters {
        Parameters { buffers: signature(g).map(|s| signature_targets(s, "BUFFER").collect()).unwrap_or_default() }
    }

    fn contains(&self, name: &str) -> bool {
        name.contains('.') && !has_buffer_name(name) && !self.buffers.contains(name)
    }
}

fn source_names(sources: &str) -> impl Iterator<Item = &str> {
    sources.trim_matches(|c| c == '[' || c == ']').split(',').map(|s| s.trim().trim_matches(|c| c == '\'' || c == '"')).filter(|s| !s.is_empty())
}

/// The first few source names, for a message.
fn abbreviated(sources: &str) -> String {
    let names: Vec<&str> = source_names(sources).collect();
    let shown = names.iter().take(4).copied().collect::<Vec<_>>().join(", ");
    if names.len() > 4 { format!("{shown} and {} more", names.len() - 4) } else { shown }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TorchScript export (no signature) tells buffers only by their names; an export
    /// with a signature is taken at its word.
    #[test]
    fn buffers_are_told_by_name_only_without_a_signature() {
        let init = |name: &str| onnx_protobuf::TensorProto { name: name.into(), ..Default::default() };
        let mut g = GraphProto { initializer: vec![init("model.final_logits_bias"), init("model.lm_head.bias"), init("rotary.inv_freq")], ..Default::default() };
        assert_eq!(buffers_by_name(&g), HashSet::from(["model.final_logits_bias".to_string(), "rotary.inv_freq".to_string()]));
        let signature = "p_model_lm_head_bias: PARAMETER target='model.lm_head.bias'";
        g.metadata_props.push(onnx_protobuf::StringStringEntryProto { key: SIGNATURE.into(), value: signature.into(), ..Default::default() });
        assert!(buffers_by_name(&g).is_empty());
    }

    /// A node the optimizer fused a BatchNorm into names it by module, once however many
    /// rules it lists; a node fused by other rules names nothing.
    #[test]
    fn batchnorms_fused_into_convolutions_are_named_by_module() {
        let entry = |key: &str, value: &str| onnx_protobuf::StringStringEntryProto { key: key.into(), value: value.into(), ..Default::default() };
        let node = |rules: &str, module: &str| onnx_protobuf::NodeProto {
            op_type: "Conv".into(),
            metadata_props: vec![entry(RULES, rules), entry("pkg.torch.onnx.name_scopes", &format!("['', 'model', '{module}', '_native_batch_norm_legit_no_training']"))],
            ..Default::default()
        };
        let g = GraphProto {
            node: vec![
                node("RemoveOptionalBiasFromConv, FuseBatchNormIntoConv, RemoveOptionalBiasFromConv", "model.bn1"),
                node("RemoveOptionalBiasFromConv", "model.conv2"),
                node("FuseBatchNormIntoConv", "model.bn1"),
                node("FuseBatchNormIntoGemm", "model.head.bn"),
            ],
            ..Default::default()
        };
        assert_eq!(fused_batchnorms(&g), ["model.bn1", "model.head.bn"]);
        assert!(is_state_of("model.bn1.weight", "model.bn1"));
        assert!(!is_state_of("model.bn10.weight", "model.bn1"));
    }

    /// Weight and bias both made by the TorchScript exporter (stored, or an `Identity` of
    /// an equal stored one): a BatchNorm was fused in. A convolution with its parameters'
    /// names, or with only its weight made (a folded weight, no fusion), or reading names
    /// no initializer holds, names nothing.
    #[test]
    fn batchnorms_the_torchscript_exporter_fused_are_found_by_their_constants() {
        let conv = |name: &str, op: &str, inputs: &[&str]| onnx_protobuf::NodeProto {
            name: name.into(),
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let init = |name: &str| onnx_protobuf::TensorProto { name: name.into(), ..Default::default() };
        let g = GraphProto {
            node: vec![
                conv("/down1/Conv", "Conv", &["x", "onnx::Conv_115", "onnx::Conv_116"]),
                conv("/up/ConvTranspose", "ConvTranspose", &["y", "onnx::ConvTranspose_7", "onnx::ConvTranspose_8"]),
                conv("/head/Conv", "Conv", &["z", "head.weight", "head.bias"]),
                conv("/folded/Conv", "Conv", &["z", "onnx::Conv_9", "folded.bias"]),
                conv("/computed/Conv", "Conv", &["z", "onnx::Conv_11", "onnx::Conv_12"]),
                conv("/mixed/Conv", "Conv", &["z", "onnx::Conv_115", "onnx::Mul_3"]),
                onnx_protobuf::NodeProto { op_type: "Identity".into(), input: vec!["onnx::Conv_116".into()], output: vec!["onnx::Conv_121".into()], ..Default::default() },
                conv("/deduplicated/Conv", "Conv", &["z", "onnx::Conv_120", "onnx::Conv_121"]),
            ],
            initializer: ["onnx::Conv_115", "onnx::Conv_116", "onnx::Conv_120", "onnx::ConvTranspose_7", "onnx::ConvTranspose_8", "head.weight", "head.bias", "onnx::Conv_9", "folded.bias", "onnx::Mul_3"].map(init).to_vec(),
            ..Default::default()
        };
        assert_eq!(script_fused_batchnorms(&g), ["/down1/Conv", "/up/ConvTranspose", "/deduplicated/Conv"]);
    }

    /// A graph of initializers the exporter records as folded, `(name, sources)` each.
    fn folded_graph(folds: &[(&str, &str)]) -> GraphProto {
        let record = |name: &str, sources: &str| onnx_protobuf::ValueInfoProto {
            name: name.into(),
            metadata_props: vec![onnx_protobuf::StringStringEntryProto { key: FOLDED_FROM.into(), value: sources.into(), ..Default::default() }],
            ..Default::default()
        };
        GraphProto {
            initializer: folds.iter().map(|(n, _)| onnx_protobuf::TensorProto { name: (*n).into(), ..Default::default() }).collect(),
            value_info: folds.iter().map(|(n, s)| record(n, s)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn what_more_than_reindexes_a_parameter_is_computed_from_it() {
        let folds = [
            ("val_9", "['model.layers.0.q_proj.weight']"),
            ("embedding_2", "['model.bert.embeddings.position_embeddings.weight', 'model.bert.embeddings.position_ids', 'slice_2', 'val_19']"),
            ("index", "['clone', 'index', 'model.features.1.0.attn.relative_position_bias_table', 'model.features.1.0.attn.relative_position_index', 'permute_1', 'val_10']"),
            ("unsqueeze_1", "['exp', 'model.backbone.layers.0.mixer.A_log', 'neg', 'unsqueeze', 'val_33']"),
            ("mul", "['div', 'linalg_vector_norm', 'model.conv.weight_g', 'model.conv.weight_v']"),
            ("triu", "['arange', 'full', 'triu']"),
        ];
        let g = folded_graph(&folds);
        let mut computed: Vec<String> = computed_from_parameters(&g).into_keys().collect();
        computed.sort();
        assert_eq!(computed, ["index", "mul", "unsqueeze_1"]);
        assert_eq!(op_of("embedding_2"), "embedding");
        assert_eq!(op_of("model.bert.embeddings.position_ids"), "position_ids");
        assert_eq!(op_of("_to_copy"), "_to_copy");
    }

    /// PEGASUS-X's global tokens, `embed_global(arange(4).expand(batch, -1))` folded at
    /// the export batch, and CLIP's class embedding expanded to the batch (the folded value
    /// named after the expand) are those parameters expanded; so are lookups at token type
    /// ids (a buffer, or `zeros`) and at shifted positions (BART's). An expanded mask (no
    /// parameter), an expansion of two parameters, one computed further, or a lookup at
    /// computed buckets (T5's relative positions), is none.
    #[test]
    fn a_parameter_expanded_to_the_batch_is_found_with_its_name() {
        let folds = [
            ("embedding_1", "['arange_2', 'expand_2', 'model.model.encoder.embed_global.weight', 'unsqueeze_4', 'val_67']"),
            ("expand_1", "['arange', 'expand', 'val_3']"),
            ("cat", "['cat', 'expand', 'model.a.weight', 'model.b.weight']"),
            ("mul_3", "['expand', 'model.scale.weight', 'mul']"),
            ("view_1", "['model.cls_token', 'view']"),
            ("expand_2", "['model.vision_model.embeddings.class_embedding', 'val_59', 'val_60']"),
            ("embedding_3", "['expand', 'model.bert.embeddings.token_type_embeddings.weight', 'model.bert.embeddings.token_type_ids', 'slice_1', 'val_0']"),
            ("embedding_4", "['model.dpr.token_type_embeddings.weight', 'val_0', 'zeros']"),
            ("embedding_5", "['add', 'arange', 'expand', 'model.bart.embed_positions.weight', 'val_5']"),
            ("embedding_6", "['abs_1', 'div', 'model.t5.relative_attention_bias.weight', 'log']"),
        ];
        let g = folded_graph(&folds);
        let expanded = expanded_parameters(&g);
        let baked = |parameter: &str, lookup| BakedParameter { parameter: parameter.into(), lookup };
        assert_eq!(
            expanded,
            HashMap::from([
                ("embedding_1".to_string(), baked("model.model.encoder.embed_global.weight", true)),
                ("expand_2".to_string(), baked("model.vision_model.embeddings.class_embedding", false)),
                ("embedding_3".to_string(), baked("model.bert.embeddings.token_type_embeddings.weight", true)),
                ("embedding_4".to_string(), baked("model.dpr.token_type_embeddings.weight", true)),
                ("embedding_5".to_string(), baked("model.bart.embed_positions.weight", true)),
            ])
        );
    }

    /// A source the signature lists as a buffer is none of the parameters, whatever its
    /// name: folded from a frozen BatchNorm's buffers named `weight` and `running_var`, a
    /// constant is the exporter's (frozen); folded from a parameter, it trains with it.
    #[test]
    fn the_signature_tells_buffers_named_like_parameters() {
        let signature = "p_conv_weight: PARAMETER target='m.conv.weight'\nb_bn_weight: BUFFER target='m.bn.weight' persistent=True\nb_bn_var: BUFFER target='m.bn.running_var' persistent=True\n";
        let mut g = folded_graph(&[("mul_4", "['add_9', 'm.bn.running_var', 'm.bn.weight', 'rsqrt']"), ("val_3", "['m.conv.weight', 'permute']")]);
        g.metadata_props.push(onnx_protobuf::StringStringEntryProto { key: SIGNATURE.into(), value: signature.into(), ..Default::default() });
        assert_eq!(exporter_constants(&g).into_keys().collect::<Vec<_>>(), ["mul_4"]);
        assert_eq!(folded_parameters(&g)["val_3"], ["m.conv.weight"]);
        assert!(folded_parameters(&g)["mul_4"].is_empty());
        // Without a signature, the names decide: `weight` is a parameter's.
        g.metadata_props.clear();
        assert!(exporter_constants(&g).is_empty());
        assert_eq!(folded_parameters(&g)["mul_4"], ["m.bn.weight"]);
    }

    #[test]
    fn parameters_the_signature_lists_and_the_graph_lacks_are_found() {
        let signature = "\n# inputs\np_conv_weight: PARAMETER target='conv.weight'\np_conv_bias: PARAMETER target='conv.bias'\np_pos: PARAMETER target='pos.weight'\nb_ids: BUFFER target='pos.ids' persistent=False\nargs_0: USER_INPUT\n";
        let g = GraphProto {
            initializer: vec![onnx_protobuf::TensorProto { name: "conv.weight".into(), ..Default::default() }, onnx_protobuf::TensorProto { name: "embedding".into(), ..Default::default() }],
            value_info: vec![onnx_protobuf::ValueInfoProto {
                name: "embedding".into(),
                metadata_props: vec![onnx_protobuf::StringStringEntryProto { key: FOLDED_FROM.into(), value: "['pos.weight', 'pos.ids']".into(), ..Default::default() }],
                ..Default::default()
            }],
            metadata_props: vec![onnx_protobuf::StringStringEntryProto { key: SIGNATURE.into(), value: signature.into(), ..Default::default() }],
            ..Default::default()
        };
        assert_eq!(parameters_not_in_graph(&g), ["conv.bias"]);
        assert!(parameters_not_in_graph(&GraphProto::default()).is_empty());
        // Not optimized (nothing folded): a parameter no output reads is left out, not dropped.
        let unoptimized = GraphProto { value_info: Vec::new(), ..g };
        assert!(parameters_not_in_graph(&unoptimized).is_empty());
    }

    #[test]
    fn masks_and_rotary_tables_are_folded_from_no_parameter() {
        // No signature: the names decide.
        let by_name = Parameters::of(&GraphProto::default());
        let folded_from_a_parameter = |sources: &str| source_names(sources).any(|n| by_name.contains(n));
        assert!(!folded_from_a_parameter("['arange', 'arange_1', 'full', 'triu', 'val_4']"));
        assert!(!folded_from_a_parameter("['_to_copy', 'cos', 'model.model.rotary_emb.inv_freq', 'val_19']"));
        assert!(folded_from_a_parameter("['model.model.layers.0.self_attn.q_proj.weight']"));
        assert!(folded_from_a_parameter("['arange', 'model.transformer.wpe.weight', 'unsqueeze']"));
        assert_eq!(abbreviated("['a', 'b', 'c', 'd', 'e', 'f']"), "a, b, c, d and 2 more");
    }
}
