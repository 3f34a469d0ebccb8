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
/// its name (rotary frequencies, index tables, running statistics).
const BUFFER_NAMES: &[&str] = &["inv_freq", "position_ids", "token_type_ids", "running_mean", "running_var", "num_batches_tracked", "relative_position_index"];

/// The initializers of `g` its exporter marks as no parameter, each with why.
pub fn exporter_constants(g: &GraphProto) -> HashMap<String, String> {
    let initializers: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let mut constants = HashMap::new();
    for info in g.value_info.iter().filter(|v| initializers.contains(v.name.as_str())) {
        let meta = |key: &str| info.metadata_props.iter().find(|p| p.key == key).map(|p| p.value.as_str());
        if let Some(kind) = meta(INPUT_KIND).filter(|k| *k == "BUFFER" || *k == "CONSTANT_TENSOR") {
            constants.insert(info.name.clone(), format!("the exporter lifted it as a {}", kind.to_lowercase().replace('_', " ")));
        } else if let Some(sources) = meta(FOLDED_FROM) {
            if !folded_from_a_parameter(sources) {
                constants.insert(info.name.clone(), format!("the exporter folded it from no parameter ({})", abbreviated(sources)));
            }
        }
    }
    constants
}

/// Whether a folded constant's sources (a Python list of value names) include module
/// state other than a buffer: module state has a dotted name (`model.layers.0.weight`),
/// the exporter's own values do not (`arange`, `val_12`).
fn folded_from_a_parameter(sources: &str) -> bool {
    source_names(sources).any(|name| name.contains('.') && !BUFFER_NAMES.contains(&name.rsplit('.').next().unwrap_or(name)))
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

    #[test]
    fn masks_and_rotary_tables_are_folded_from_no_parameter() {
        assert!(!folded_from_a_parameter("['arange', 'arange_1', 'full', 'triu', 'val_4']"));
        assert!(!folded_from_a_parameter("['_to_copy', 'cos', 'model.model.rotary_emb.inv_freq', 'val_19']"));
        assert!(folded_from_a_parameter("['model.model.layers.0.self_attn.q_proj.weight']"));
        assert!(folded_from_a_parameter("['arange', 'model.transformer.wpe.weight', 'unsqueeze']"));
        assert_eq!(abbreviated("['a', 'b', 'c', 'd', 'e', 'f']"), "a, b, c, d and 2 more");
    }
}
