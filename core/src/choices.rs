//! Choices the importer makes about a model's initializers that change what trains, kept
//! with the graph and the build so that `compile` and `train` each state them in one short
//! line per kind ([`ImportChoices::lines`]), naming the switch that changes them:
//!
//! - an initializer whose leading extent is the export batch (an activation the exporter
//!   evaluated, such as ViT's expanded class token) is kept as a frozen constant;
//! - an initializer the exporter merged because several parameters had identical values
//!   (all LayerNorm weights are ones when exported untrained) is read by several nodes and
//!   trains as one tied weight, unless `compile --untie-merged` gives each use a copy;
//!   its reads by modules that hold no parameter (a LayerNorm without affine weights,
//!   whose ones the exporter merged with a weight) read a frozen copy instead;
//! - an initializer the exporter marks as folded from no parameter (a causal mask, a
//!   rotary table) is kept as a frozen constant;
//! - an initializer holding exactly a permutation of another weight's values (the
//!   exporter folded the transpose of a tied weight, such as a language model's output
//!   projection, into a second initializer) is computed from that weight again, so the
//!   two train as one, as in the model exported;
//! - an initializer the exporter folded from parameters by more than a transpose, a
//!   reshape, a slice or a gather at distinct positions (a relative-position table
//!   gathered with repeats, a weight norm, `exp(A_log)`) trains as the tensor computed,
//!   not as those parameters: said, so that the user can export without folding;
//! - parameters the exporter's signature lists that the model holds under no name (its
//!   optimizer drops all-zero biases and stores equal parameters once) are said, with
//!   the export that keeps them;
//! - a one-element initializer read only as a factor of attention scales (the dynamo
//!   exporter's `sqrt(scale)` in a fixed-batch export) becomes the fused `Attention`'s
//!   `scale`, not a weight, unless `compile --train-attention-scales` keeps it trained;
//! - a value the source model detaches (`detach()`), which the exporter's optimizer left
//!   in node metadata only, is read through a `StopGradient` again, and a detach that
//!   metadata does not place is said, with the export that keeps it;
//! - an embedding lookup of a module with a padding index (which the exporter's metadata
//!   records) trains no row at that index, as PyTorch's does not;
//! - an initializer of an export without a signature (TorchScript's) named as PyTorch
//!   models name buffers (`final_logits_bias`) is kept as a frozen constant.

use serde::{Deserialize, Serialize};

/// An initializer read by several nodes that the importer takes for an exporter's merge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedInitializer {
    pub name: String,
    /// Nodes reading it.
    pub uses: usize,
    /// The weights it trains as once untied (`--untie-merged`): one per use but where
    /// several uses are one parameter's (a module applied more than once); `None` where
    /// it was not untied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<usize>,
}

/// An initializer the importer found to hold a permutation of another weight's values
/// and computes from it (`Transpose(source, perm)`), so that the tie trains as one weight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoldedImage {
    pub name: String,
    pub source: String,
    pub perm: Vec<usize>,
}

/// What the importer decided about initializers (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportChoices {
    /// Batch-baked initializers kept as frozen constants: `name [d0, d1, ...]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen_batch_baked: Vec<String>,
    /// Initializers the exporter marks as folded from no parameter (or lifted as buffers),
    /// kept as frozen constants: `name [d0, d1, ...]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exporter_constants: Vec<String>,
    /// Batch-baked initializers trained as one slice shared by the batch
    /// (`--train-batch-baked`): `name [1, d1, ...]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trained_batch_baked: Vec<String>,
    /// One-element initializers read only as factors of attention scales, whose value the
    /// fused `Attention` took as its `scale` (not trained): `name [1]`. Empty with
    /// `--train-attention-scales`, which keeps them trained and the attention spelled out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen_attention_scales: Vec<String>,
    /// Merged initializers (tied, or untied when `untied`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged: Vec<MergedInitializer>,
    /// Initializers computed again from the weight they are a permuted copy of.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retied: Vec<FoldedImage>,
    /// Trained initializers the exporter folded from parameters by more than re-indexing:
    /// `name (sources)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub computed_from_parameters: Vec<String>,
    /// Trained initializers a TorchScript export computed and named itself (`onnx::Op_N`)
    /// that no layer reads as its weight: `name [dims]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub script_computed_constants: Vec<String>,
    /// Parameters the exporter's signature lists that no name in the model holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_parameters: Vec<String>,
    /// BatchNorm modules the exporter's optimizer fused into the layer before them, which
    /// train as that layer's weights and bias, without batch statistics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused_batchnorms: Vec<String>,
    /// Convolutions (node names) the TorchScript exporter fused the BatchNorm after them
    /// into, which train as plain convolutions, without batch statistics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub script_fused_batchnorms: Vec<String>,
    /// All-zero biases the exporter dropped, restored as zero trainable biases: `name [n]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restored_biases: Vec<String>,
    /// Sinusoidal position tables kept frozen, as PyTorch keeps them: `name [d0, d1]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen_sinusoidal: Vec<String>,
    /// Sinusoidal position tables trained on request (`compile --train-sinusoidal`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trained_sinusoidal: Vec<String>,
    /// Initializers frozen on request (`compile --freeze`): `name [d0, d1, ...]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen_on_request: Vec<String>,
    /// Whether each use of a merged initializer got its own copy (`--untie-merged`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub untied: bool,
    /// Reads of a value the source model detached (`detach()`), which pass no gradient
    /// back: `NODE reads VALUE`. Only those the exporter's optimizer dropped and its
    /// metadata records; an unoptimized export's detaches are nodes of the graph.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub detached_reads: Vec<String>,
    /// Nodes whose metadata records a detached argument that matches no one input: read
    /// as plain values, they pass gradients the source model does not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unplaced_detaches: Vec<String>,
    /// Embedding lookups of a module with a padding index, whose row at that index gets no
    /// gradient: `NODE (row P of WEIGHT)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub padding_rows: Vec<String>,
    /// Initializers of an export without a signature (TorchScript's) that carry the name of
    /// a buffer PyTorch models keep (`final_logits_bias`, `inv_freq`), kept frozen.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub named_buffers: Vec<String>,
    /// Initializers that were also BatchNorm running statistics (or shared by several
    /// BatchNorms' statistics): each running-statistic read got its own copy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub split_buffers: Vec<String>,
    /// Merged initializers (or their copies, `NAME.constant`) read only by modules that
    /// hold no parameter (a LayerNorm without affine weights), kept frozen.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weightless_reads: Vec<String>,
}

/// Up to three items, then how many more.
fn some_of(items: &[String]) -> String {
    let mut s = items.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > 3 {
        s.push_str(&format!(" and {} more", items.len() - 3));
    }
    s
}

impl ImportChoices {
    pub fn is_empty(&self) -> bool {
        self.frozen_batch_baked.is_empty() && self.exporter_constants.is_empty() && self.trained_batch_baked.is_empty() && self.frozen_attention_scales.is_empty() && self.merged.is_empty() && self.split_buffers.is_empty() && self.weightless_reads.is_empty() && self.retied.is_empty() && self.computed_from_parameters.is_empty() && self.script_computed_constants.is_empty() && self.missing_parameters.is_empty() && self.fused_batchnorms.is_empty() && self.script_fused_batchnorms.is_empty() && self.restored_biases.is_empty() && self.frozen_on_request.is_empty() && self.frozen_sinusoidal.is_empty() && self.trained_sinusoidal.is_empty() && self.detached_reads.is_empty() && self.unplaced_detaches.is_empty() && self.padding_rows.is_empty() && self.named_buffers.is_empty()
    }

    /// One line per kind of choice (none when there is nothing to say).
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.frozen_batch_baked.is_empty() {
            let n = self.frozen_batch_baked.len();
            out.push(format!(
                "{n} initializer{} baked for the export batch kept frozen (not trained): {}; compile --train-batch-baked NAME trains one (a class token, not a mask) as a weight shared by the batch",
                if n == 1 { "" } else { "s" },
                some_of(&self.frozen_batch_baked),
            ));
        }
        if !self.frozen_sinusoidal.is_empty() {
            let n = self.frozen_sinusoidal.len();
            out.push(format!(
                "{n} initializer{} holding a sinusoidal position table (every column a sinusoid along the positions) kept frozen (not trained), as PyTorch keeps such tables: {}; compile --train-sinusoidal NAME trains one",
                if n == 1 { "" } else { "s" },
                some_of(&self.frozen_sinusoidal),
            ));
        }
        if !self.trained_sinusoidal.is_empty() {
            let n = self.trained_sinusoidal.len();
            out.push(format!(
                "{n} sinusoidal position table{} train{} on request (--train-sinusoidal): {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                some_of(&self.trained_sinusoidal),
            ));
        }
        if !self.frozen_on_request.is_empty() {
            let n = self.frozen_on_request.len();
            out.push(format!("{n} initializer{} kept frozen on request (--freeze): {}", if n == 1 { "" } else { "s" }, some_of(&self.frozen_on_request)));
        }
        if !self.exporter_constants.is_empty() {
            let n = self.exporter_constants.len();
            out.push(format!(
                "{n} initializer{} the exporter marks as folded from no parameter (a mask, a rotary table) kept frozen (not trained): {}",
                if n == 1 { "" } else { "s" },
                some_of(&self.exporter_constants),
            ));
        }
        if !self.named_buffers.is_empty() {
            let n = self.named_buffers.len();
            out.push(format!(
                "{n} initializer{} named as PyTorch models name buffers (final_logits_bias, inv_freq, ...), which this export (no exported program's signature) does not tell from parameters, kept frozen (not trained), as PyTorch keeps buffers: {}; compile --freeze does the same for others",
                if n == 1 { "" } else { "s" },
                some_of(&self.named_buffers),
            ));
        }
        if !self.trained_batch_baked.is_empty() {
            let n = self.trained_batch_baked.len();
            out.push(format!(
                "{n} initializer{} baked for the export batch train{} as one slice shared by the batch (--train-batch-baked, or a parameter the exporter expanded or looked up at fixed positions): {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                some_of(&self.trained_batch_baked)
            ));
        }
        if !self.frozen_attention_scales.is_empty() {
            let n = self.frozen_attention_scales.len();
            out.push(format!(
                "{n} one-element initializer{} read only as attention scales became the fused attentions' scale (not trained): {}; compile --train-attention-scales trains {} and keeps those attentions spelled out",
                if n == 1 { "" } else { "s" },
                some_of(&self.frozen_attention_scales),
                if n == 1 { "it" } else { "them" },
            ));
        }
        if !self.retied.is_empty() {
            let n = self.retied.len();
            let named: Vec<String> = self.retied.iter().map(|r| format!("{} = {} permuted {:?}", r.name, r.source, r.perm)).collect();
            out.push(format!(
                "{n} initializer{} holding a permuted copy of another weight (a tied weight the exporter stored transposed) {} computed from that weight and train{} with it: {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "is" } else { "are" },
                if n == 1 { "s" } else { "" },
                some_of(&named)
            ));
        }
        if !self.computed_from_parameters.is_empty() {
            let n = self.computed_from_parameters.len();
            out.push(format!(
                "{n} initializer{} the exporter computed from parameters by more than a transpose, a slice or a gather at distinct positions train{} as computed, not as those parameters (training differs from the source model's where values repeat or are transformed): {}; export from PyTorch with torch.onnx.export(..., optimize=False) to train the parameters themselves",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                some_of(&self.computed_from_parameters)
            ));
        }
        if !self.restored_biases.is_empty() {
            let n = self.restored_biases.len();
            out.push(format!(
                "{n} all-zero bias{} the exporter's optimizer dropped (a Conv or Gemm without its bias, which the exported program lists) train{} again from zeros, as in the source model: {}; compile --no-restore-biases trains the model as exported",
                if n == 1 { "" } else { "es" },
                if n == 1 { "s" } else { "" },
                some_of(&self.restored_biases)
            ));
        }
        if !self.script_computed_constants.is_empty() {
            let n = self.script_computed_constants.len();
            out.push(format!(
                "{n} initializer{} the TorchScript exporter computed and named itself (onnx::Op_N), read other than as a layer's weight, train{} as {} of {}: where the source model computes one from a parameter (a scale, 1 - x) it steps differently from that parameter, and where it comes from a buffer (final_logits_bias) the source model does not train it, and this export records neither: {}; compile --freeze NAME keeps one frozen, and an export with torch.onnx.export(..., dynamo=True, optimize=False) keeps the computation",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                if n == 1 { "a weight" } else { "weights" },
                if n == 1 { "its own" } else { "their own" },
                some_of(&self.script_computed_constants),
            ));
        }
        if !self.script_fused_batchnorms.is_empty() {
            let n = self.script_fused_batchnorms.len();
            let these = if n == 1 { "1 convolution the TorchScript exporter fused the BatchNorm after it".to_string() } else { format!("{n} convolutions the TorchScript exporter fused the BatchNorm after them") };
            let (train, back) = if n == 1 { ("trains as a plain convolution", "it as a BatchNorm") } else { ("train as plain convolutions", "them as BatchNorms") };
            out.push(format!(
                "{these} into (a model exported in eval mode; the weight and bias are constants it named itself, onnx::Conv_N) {train}, normalising no batch, unlike the source model in training: {}; export from PyTorch with torch.onnx.export(..., dynamo=True, optimize=False) to train {back}",
                some_of(&self.script_fused_batchnorms),
            ));
        }
        if !self.fused_batchnorms.is_empty() {
            let n = self.fused_batchnorms.len();
            out.push(format!(
                "{n} BatchNorm{} the exporter's optimizer fused into the Conv or Gemm before {} (a model exported in eval mode) train{} as that layer's weight and bias, normalising no batch, unlike the source model in training: {}; export from PyTorch with torch.onnx.export(..., optimize=False) to train {} as BatchNorm{}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "it" } else { "them" },
                if n == 1 { "s" } else { "" },
                some_of(&self.fused_batchnorms),
                if n == 1 { "it" } else { "them" },
                if n == 1 { "" } else { "s" },
            ));
        }
        if !self.missing_parameters.is_empty() {
            let n = self.missing_parameters.len();
            out.push(format!(
                "{n} parameter{} the exported program lists {} not in the model by name (the exporter's optimizer drops all-zero biases and stores parameters of equal values once, under one name): {}; export from PyTorch with torch.onnx.export(..., optimize=False) to keep every parameter",
                if n == 1 { "" } else { "s" },
                if n == 1 { "is" } else { "are" },
                some_of(&self.missing_parameters)
            ));
        }
        if !self.detached_reads.is_empty() {
            let n = self.detached_reads.len();
            out.push(format!(
                "{n} read{} of a value the source model detaches (detach(), which the exporter's optimizer dropped and its metadata records) pass{} no gradient back, as in the source model: {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "es" } else { "" },
                some_of(&self.detached_reads)
            ));
        }
        if !self.unplaced_detaches.is_empty() {
            let n = self.unplaced_detaches.len();
            out.push(format!(
                "{n} node{} the exporter's metadata says read{} a detached value (detach()) not told apart among {} inputs pass{} gradients back through it, unlike the source model: {}; export from PyTorch with torch.onnx.export(..., dynamo=True, optimize=False) to keep the detaches as nodes",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                if n == 1 { "its" } else { "their" },
                if n == 1 { "es" } else { "" },
                some_of(&self.unplaced_detaches)
            ));
        }
        if !self.padding_rows.is_empty() {
            let n = self.padding_rows.len();
            out.push(format!(
                "{n} embedding lookup{} of a module with a padding index (nn.Embedding(padding_idx=P), which the exporter's metadata records) train{} no row at that index, as in the source model: {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "s" } else { "" },
                some_of(&self.padding_rows)
            ));
        }
        if !self.split_buffers.is_empty() {
            let n = self.split_buffers.len();
            out.push(format!(
                "{n} initializer{} the exporter shared between BatchNorm running statistics and weights (or other BatchNorms) got a copy per running statistic, which follows the batches while the weights train: {}",
                if n == 1 { "" } else { "s" },
                some_of(&self.split_buffers)
            ));
        }
        if !self.weightless_reads.is_empty() {
            let n = self.weightless_reads.len();
            out.push(format!(
                "{n} initializer{} the exporter merged with parameters of equal values {} also read by modules that hold no parameter (a LayerNorm without affine weights), which read a frozen copy, as their PyTorch modules hold no weight: {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "is" } else { "are" },
                some_of(&self.weightless_reads)
            ));
        }
        if !self.merged.is_empty() {
            let (n, uses) = (self.merged.len(), self.merged.iter().map(|m| m.uses).sum::<usize>());
            let weights = self.merged.iter().map(|m| m.weights.unwrap_or(m.uses)).sum::<usize>();
            let named: Vec<String> = self.merged.iter().map(|m| format!("{:?} x{}", m.name, m.uses)).collect();
            out.push(if self.untied {
                format!("untied {n} exporter-merged initializer{} into {weights} separately trained weights (--untie-merged): {}", if n == 1 { "" } else { "s" }, some_of(&named))
            } else {
                format!(
                    "{n} initializer{} the exporter merged (identical values) train{} as tied weights: {uses} uses of {n} tensor{} ({}); compile --untie-merged trains each use separately",
                    if n == 1 { "" } else { "s" },
                    if n == 1 { "s" } else { "" },
                    if n == 1 { "" } else { "s" },
                    some_of(&named)
                )
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_short_line_per_kind() {
        assert!(ImportChoices::default().lines().is_empty());
        let merged = (0..5).map(|i| MergedInitializer { name: format!("w{i}"), uses: 3, weights: Some(3) }).collect();
        let c = ImportChoices { frozen_batch_baked: vec!["cls [2, 1, 8]".into()], merged, ..ImportChoices::default() };
        let lines = c.lines();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0], "1 initializer baked for the export batch kept frozen (not trained): cls [2, 1, 8]; compile --train-batch-baked NAME trains one (a class token, not a mask) as a weight shared by the batch");
        assert!(lines[1].starts_with("5 initializers the exporter merged (identical values) train as tied weights: 15 uses of 5 tensors (\"w0\" x3, \"w1\" x3, \"w2\" x3 and 2 more)"), "{}", lines[1]);
        assert!(lines[1].ends_with("compile --untie-merged trains each use separately"));
        let untied = ImportChoices { untied: true, ..c };
        assert!(untied.lines()[1].starts_with("untied 5 exporter-merged initializers into 15 separately trained weights"));
        let trained = ImportChoices { trained_batch_baked: vec!["cls [1, 1, 8]".into()], ..ImportChoices::default() };
        assert_eq!(trained.lines(), ["1 initializer baked for the export batch trains as one slice shared by the batch (--train-batch-baked, or a parameter the exporter expanded or looked up at fixed positions): cls [1, 1, 8]"]);
        let scales = ImportChoices { frozen_attention_scales: vec!["val_88 [1]".into()], ..ImportChoices::default() };
        assert!(!scales.is_empty());
        assert_eq!(scales.lines(), ["1 one-element initializer read only as attention scales became the fused attentions' scale (not trained): val_88 [1]; compile --train-attention-scales trains it and keeps those attentions spelled out"]);
        let constants = ImportChoices { exporter_constants: vec!["unsqueeze_7 [1, 1, 8, 8]".into(), "val_35 [16]".into()], ..ImportChoices::default() };
        assert!(!constants.is_empty());
        assert_eq!(constants.lines(), ["2 initializers the exporter marks as folded from no parameter (a mask, a rotary table) kept frozen (not trained): unsqueeze_7 [1, 1, 8, 8], val_35 [16]"]);
        let retied = ImportChoices { retied: vec![FoldedImage { name: "val_182".into(), source: "decoder.weight".into(), perm: vec![1, 0] }], ..ImportChoices::default() };
        assert!(!retied.is_empty());
        let computed = ImportChoices { computed_from_parameters: vec!["index (clone, index, rel_pos_h, permute_1)".into()], ..ImportChoices::default() };
        assert!(!computed.is_empty());
        assert!(computed.lines()[0].starts_with("1 initializer the exporter computed from parameters by more than a transpose, a slice or a gather at distinct positions trains as computed"), "{}", computed.lines()[0]);
        assert!(computed.lines()[0].ends_with("index (clone, index, rel_pos_h, permute_1); export from PyTorch with torch.onnx.export(..., optimize=False) to train the parameters themselves"));
        let tables = ImportChoices { frozen_sinusoidal: vec!["model.embed_positions.weight [8, 16]".into()], ..ImportChoices::default() };
        assert!(!tables.is_empty());
        assert_eq!(tables.lines(), ["1 initializer holding a sinusoidal position table (every column a sinusoid along the positions) kept frozen (not trained), as PyTorch keeps such tables: model.embed_positions.weight [8, 16]; compile --train-sinusoidal NAME trains one"]);
        let trained = ImportChoices { trained_sinusoidal: vec!["pe [8, 16]".into()], ..ImportChoices::default() };
        assert_eq!(trained.lines(), ["1 sinusoidal position table trains on request (--train-sinusoidal): pe [8, 16]"]);
        let frozen = ImportChoices { frozen_on_request: vec!["pos.weight [32, 16]".into()], ..ImportChoices::default() };
        assert_eq!(frozen.lines(), ["1 initializer kept frozen on request (--freeze): pos.weight [32, 16]"]);
        let missing = ImportChoices { missing_parameters: vec!["conv.bias".into()], ..ImportChoices::default() };
        assert!(!missing.is_empty());
        assert_eq!(missing.lines(), ["1 parameter the exported program lists is not in the model by name (the exporter's optimizer drops all-zero biases and stores parameters of equal values once, under one name): conv.bias; export from PyTorch with torch.onnx.export(..., optimize=False) to keep every parameter"]);
        let fused = ImportChoices { fused_batchnorms: vec!["model.bn1".into(), "model.layer1.0.bn1".into()], ..ImportChoices::default() };
        assert!(!fused.is_empty());
        assert_eq!(fused.lines(), ["2 BatchNorms the exporter's optimizer fused into the Conv or Gemm before them (a model exported in eval mode) train as that layer's weight and bias, normalising no batch, unlike the source model in training: model.bn1, model.layer1.0.bn1; export from PyTorch with torch.onnx.export(..., optimize=False) to train them as BatchNorms"]);
        let computed = ImportChoices { script_computed_constants: vec!["onnx::Add_968 [1, 64]".into()], ..ImportChoices::default() };
        assert!(!computed.is_empty());
        assert_eq!(computed.lines(), ["1 initializer the TorchScript exporter computed and named itself (onnx::Op_N), read other than as a layer's weight, trains as a weight of its own: where the source model computes one from a parameter (a scale, 1 - x) it steps differently from that parameter, and where it comes from a buffer (final_logits_bias) the source model does not train it, and this export records neither: onnx::Add_968 [1, 64]; compile --freeze NAME keeps one frozen, and an export with torch.onnx.export(..., dynamo=True, optimize=False) keeps the computation"]);
        let script = ImportChoices { script_fused_batchnorms: vec!["/model/down1/down1.0/Conv".into()], ..ImportChoices::default() };
        assert!(!script.is_empty());
        assert_eq!(script.lines(), ["1 convolution the TorchScript exporter fused the BatchNorm after it into (a model exported in eval mode; the weight and bias are constants it named itself, onnx::Conv_N) trains as a plain convolution, normalising no batch, unlike the source model in training: /model/down1/down1.0/Conv; export from PyTorch with torch.onnx.export(..., dynamo=True, optimize=False) to train it as a BatchNorm"]);
        let restored = ImportChoices { restored_biases: vec!["head.bias [10]".into(), "conv.bias [8]".into()], ..ImportChoices::default() };
        assert!(!restored.is_empty());
        assert_eq!(restored.lines(), ["2 all-zero biases the exporter's optimizer dropped (a Conv or Gemm without its bias, which the exported program lists) train again from zeros, as in the source model: head.bias [10], conv.bias [8]; compile --no-restore-biases trains the model as exported"]);
        let detached = ImportChoices { detached_reads: vec!["node_add_624 reads sub_150".into()], ..ImportChoices::default() };
        assert!(!detached.is_empty());
        assert_eq!(detached.lines(), ["1 read of a value the source model detaches (detach(), which the exporter's optimizer dropped and its metadata records) passes no gradient back, as in the source model: node_add_624 reads sub_150"]);
        let unplaced = ImportChoices { unplaced_detaches: vec!["node_linear".into(), "node_MatMul".into()], ..ImportChoices::default() };
        assert!(!unplaced.is_empty());
        assert_eq!(unplaced.lines(), ["2 nodes the exporter's metadata says read a detached value (detach()) not told apart among their inputs pass gradients back through it, unlike the source model: node_linear, node_MatMul; export from PyTorch with torch.onnx.export(..., dynamo=True, optimize=False) to keep the detaches as nodes"]);
        let padding = ImportChoices { padding_rows: vec!["node_embedding (row 1 of model.lm_head.weight)".into()], ..ImportChoices::default() };
        assert!(!padding.is_empty());
        assert_eq!(padding.lines(), ["1 embedding lookup of a module with a padding index (nn.Embedding(padding_idx=P), which the exporter's metadata records) trains no row at that index, as in the source model: node_embedding (row 1 of model.lm_head.weight)"]);
        let named = ImportChoices { named_buffers: vec!["model.final_logits_bias [1, 64]".into()], ..ImportChoices::default() };
        assert!(!named.is_empty());
        assert_eq!(named.lines(), ["1 initializer named as PyTorch models name buffers (final_logits_bias, inv_freq, ...), which this export (no exported program's signature) does not tell from parameters, kept frozen (not trained), as PyTorch keeps buffers: model.final_logits_bias [1, 64]; compile --freeze does the same for others"]);
        assert_eq!(retied.lines(), ["1 initializer holding a permuted copy of another weight (a tied weight the exporter stored transposed) is computed from that weight and trains with it: val_182 = decoder.weight permuted [1, 0]"]);
    }
}
