//! Training against PyTorch: zoo architectures whose import reads something the exporter
//! wrote in a way of its own take one SGD step in pipewright and in PyTorch
//! (`zoo/torch_step.py`, the same model from its constructor), and the model pipewright
//! exports after the step must compute what PyTorch's stepped model does.
//!
//! - Mixtral (mixture of experts; TorchScript, dynamic and fixed batch): the routing's
//!   data-dependent `NonZero` is read densely, every expert on every (choice, token)
//!   pair with the unselected pairs masked out of the sum; the step checks its gradients.
//! - DINOv2 (TorchScript): the patch position embeddings reach the model through a Reshape
//!   and a Transpose of the parameter, which must stay a parameter.
//! - Gemma 2 (TorchScript): its cache's length is counted from a zero-filled cache at
//!   import; TorchScript folds the tied output projection's transpose into an initializer
//!   of its own, which must be computed from the embedding again (found by its values).
//! - BERT (the default exporter): the same fold of its tied decoder, recorded as folded
//!   from the embedding; tied, one step landed 0.29 from PyTorch's.
//! - Llama and OLMo (the default exporter, dynamic batch and batch 1) and OLMoE: the
//!   exporter folds the causal mask, the rotary tables and a weightless LayerNorm's ones
//!   into initializers it marks as folded from no parameter, which must stay constants.
//! - ViT, ConvNeXt and OPT (the default exporter): its optimizer drops a Conv's or Gemm's
//!   all-zero bias (the patch projection, attention output and MLP projections, heads),
//!   which the import restores as zeros from the exported program's signature; without
//!   them, each layer trained without its bias and one step landed away from PyTorch's.
//! - ALBERT (the default exporter): one layer's weights shared by every layer, whose
//!   LayerNorm ones and zero biases the exporter also merged with other modules': untied
//!   by the parameter of each reading node's module (the exporter records it), the
//!   shared layer stays one weight; untied per node, each layer trained its own copy.
//! - Eight architectures exported by the default exporter without its optimizer
//!   (`optimize=False`, the zoo's `dynamo-noopt-dyn`), the export compile recommends
//!   where the optimizer computed constants from parameters or dropped some: Swin and
//!   DeBERTa v2 (relative-position tables), T5 (bucketed relative attention bias),
//!   HuBERT (a weight-normed convolution), DeiT and SigLIP (zero biases and class tokens),
//!   ConvNeXt, and Whisper's encoder.
//! - Whisper's encoder and Marian (the default exporter, Marian with its optimizer, which
//!   gathers the table at the positions used into an initializer of its own): their
//!   sinusoidal position tables, parameters PyTorch does not train, are recognised by
//!   their values and kept frozen; trained, one step landed 0.14 (Whisper)
//!   and 1.9e-3 (Marian) away.
//! - HF ResNet and DenseNet (the default exporter without its optimizer, which would fuse
//!   their BatchNorms into the convolutions): exported in eval mode, their BatchNorms
//!   train on batch statistics as PyTorch's do in training, and keep running statistics
//!   with PyTorch's unbiased variance (at these small maps the population variance ONNX
//!   defines for its outputs put the stepped outputs 2e-3 away).
//! - DAC (the default exporter, with and without its optimizer): its quantizer's
//!   straight-through estimator, `z + (q - z).detach()`, must pass no gradient through
//!   `q - z`; the optimizer drops the detach and records it in the reading node's metadata
//!   only, where the import finds it again. Read as a plain value (as before), one step
//!   landed 2e-3 away, both ways.
//! - Speech2Text (the default exporter, with and without its optimizer): its decoder's
//!   token embedding has a padding index (1), whose row PyTorch never trains, and the
//!   labels hold it; the lookup's FX node records it, where the import finds it. Trained as
//!   a plain `Gather` (as before), one step landed 3.2 away.
//! - Marian and mBART (TorchScript): the logits bias of BART's family is a buffer,
//!   `final_logits_bias`, which that exporter writes as an initializer like any
//!   parameter; kept frozen by its name where no exported program's signature tells.
//!   Trained (as before), one step landed 3.5e-2 away.
//! - TimeSformer (the default exporter, dynamic batch): it slices its class tokens back
//!   out of frames merged into the batch axis, `embeddings[:batch_size]`, a Slice whose
//!   end is the batch size; the import follows such bounds as multiples of it (it refused
//!   the model before).
//! - SpeechT5's HiFi-GAN vocoder (the default exporter): its optimizer dropped every
//!   convolution's zero bias and folded nothing, recording only the rewrite on each Conv;
//!   the biases come back from that record. Trained without them (as before), one step
//!   landed 2.2e-4 away.
//! - DenseNet and LeViT (TorchScript, exported in eval mode): the exporter fused most
//!   BatchNorms into their convolutions (those stay in eval mode in PyTorch's step, their
//!   scale frozen, as the fused graph trains them), and stores a fresh BatchNorm's running
//!   variance and mean once with its scale and bias, read through `Identity` nodes; each
//!   running statistic gets a copy of its own that follows the batches. Read as the
//!   trained scale and bias (as before), one step landed 7.7e-2 (DenseNet) and 6.7e-3
//!   (LeViT) away.
//! - HF ResNet and torchvision's ResNet (the default exporter, in eval mode): its
//!   optimizer fused every BatchNorm into the convolution before it (those stay in eval
//!   mode in PyTorch's step, their scale frozen) and then dropped the fused biases, zeros
//!   for fresh BatchNorms; they come back as the BatchNorms' shifts. Trained without them
//!   (as before), one step landed 7.7e-2 (HF ResNet) and 9.9e-2 (ResNet) away.
//! - MobileNetV2 (the default exporter, fused BatchNorms as above): its ReLU6, exported as
//!   `Clip(0, 6)`, passes no gradient at the bounds, as PyTorch's `hardtanh`; its
//!   depthwise convolutions output exactly 0 (their bias) over windows the ReLU6 before
//!   them zeroed. Lowered as libtorch's `clamp` (as before), which passes it at the
//!   bounds, one step landed 6.0e-4 away.
//! - GraniteMoE (the default exporter, with and without its optimizer) and JetMoE (at
//!   batch 1): their experts split the rows sorted by expert at sizes the routing
//!   computes (a `Split`, or a `SplitToSequence` without the optimizer), read densely,
//!   every expert on every row with the rows outside its part masked out of the
//!   `Concat`; at batch 1 the router's one-hot choice, its sort and the zeros it scatters
//!   the rows back into are read so that they follow the batch. Both were refused before.
//! - Qwen3-MoE (the default exporter without its optimizer): its routing's `NonZero`
//!   positions pass through a `Max` of one operand (the exporter's broadcast of one index
//!   tensor), index arithmetic that the dense reading follows; refused before.
//! - DeepSeek-V3 (TorchScript, batch 1): its router's group mask scatters into zeros the
//!   exporter wrote for the export batch's tokens, read so that they follow the batch.
//! - PatchTST (batch 2) and ViTDet (batch 1), the default exporter: views whose leading
//!   literal holds the batch merged with channels, windows or heads (`[6, -1, 2, 8]` of
//!   `[3N, 4, 16]` at batch 2), read so that the batch stays where it was; read with the
//!   -1 taking the batch, as before, neither compiled at another batch.
//! - BridgeTower's vision tower: its output stacks every layer's, `[L, N, S, D]`, the
//!   batch on the second axis; the labels (sample first, as `train --data` reads them)
//!   move there for the loss. Refused before: the loss took them as they came.
//! - SegGPT and ALBERT (TorchScript): the exporter keeps one of several equal parameters
//!   (zero biases, unit LayerNorm scales) and reads the others through an `Identity` of
//!   it; the nodes reading the kept one itself are one parameter (SegGPT's patch
//!   embedding runs on the prompt and on the input, ALBERT's shared layer runs twice).
//!   Untied one weight per reading node (as before), one step landed 4.7e-3 (SegGPT) and
//!   1.2e-3 (ALBERT) away.
//! - TimeSformer (TorchScript, batch 2): the class tokens come back out of frames merged
//!   into the batch as `x[:2]` of `[frames * 2, ...]`, read as the first row group at
//!   any batch; refused before (the class tokens stayed at the export batch).
//! - CSM's depth decoder (batch 2, both exporters): `x[:, 0] = y`, a ScatterElements at
//!   indices all 0 (or a ScatterND at the pairs `(i, 0)`) shaped for the export batch's
//!   rows, read as one at position 0 of every row; refused before.
//! - BERT (the default exporter, batch 2): its optimizer folds the token type embeddings
//!   looked up at ids of zeros into a constant of the export batch, `[2, 8, 16]`, recorded
//!   as folded from `token_type_embeddings.weight`: the one row it repeats trains, as
//!   PyTorch trains row 0; kept frozen (as before), one step landed 0.28 away.
//! - TimeSformer (the default exporter, batch 1): the class token expanded to every frame
//!   of the batch, `[frames * batch, 1, width]`, folded at the export batch into
//!   `[frames, 1, width]` and recorded as the `cls_token` parameter expanded: one slice,
//!   expanded to frames times the batch at run time, trains as that parameter; refused
//!   before (the frames' tokens stayed at the export batch's).
//! - Data2VecAudio (the default exporter): its positional convolutions' LayerNorms hold no
//!   weight (`elementwise_affine=False`); the optimizer merged their ones with the
//!   encoder's LayerNorm weight, whose module's parameters the signature lists while theirs
//!   hold none: they read a frozen copy. Trained with the weight (as before), one step
//!   landed 0.43 away.
//!
//! The step is 0.5 on the mean cross-entropy against fixed labels, at d = 2 under
//! PipeDream-Flush with one microbatch of the export batch (the mean PyTorch takes), with
//! the exporter's merged initializers untied (each LayerNorm its own weight, as PyTorch's
//! are). The source model must not match PyTorch's stepped outputs, so that a step that
//! changed nothing cannot pass.
#![cfg(feature = "torch")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

use common::{pw_ok, root, try_pw};

/// A zoo architecture, one of its entries, and what compile needs besides.
const ENTRIES: [(&str, &str, &[&str]); 59] = [
    ("mixtral", "mixtral-script-dyn", &[]),
    ("mixtral", "mixtral-script-b2", &[]),
    ("olmoe", "olmoe-dynamo-dyn", &[]),
    ("dinov2", "dinov2-script-dyn", &[]),
    ("gemma2", "gemma2-script-dyn", &[]),
    ("bert", "bert-dynamo-dyn", &[]),
    ("vit", "vit-dynamo-dyn", &[]),
    ("convnext", "convnext-dynamo-dyn", &[]),
    ("opt", "opt-dynamo-dyn", &[]),
    ("albert", "albert-dynamo-dyn", &[]),
    ("swin", "swin-dynamo-noopt-dyn", &[]),
    ("deberta_v2", "deberta_v2-dynamo-noopt-dyn", &[]),
    ("t5", "t5-dynamo-noopt-dyn", &[]),
    ("hubert", "hubert-dynamo-noopt-dyn", &[]),
    ("deit", "deit-dynamo-noopt-dyn", &[]),
    ("siglip_vision", "siglip_vision-dynamo-noopt-dyn", &[]),
    ("convnext", "convnext-dynamo-noopt-dyn", &[]),
    ("whisper_encoder", "whisper_encoder-dynamo-noopt-dyn", &[]),
    ("marian", "marian-dynamo-dyn", &[]),
    ("hf_resnet", "hf_resnet-dynamo-noopt-dyn", &[]),
    ("densenet", "densenet-dynamo-noopt-dyn", &[]),
    ("llama", "llama-dynamo-dyn", &[]),
    ("llama", "llama-dynamo-b1", &[]),
    ("olmo", "olmo-dynamo-dyn", &[]),
    ("dac", "dac-dynamo-dyn", &[]),
    ("dac", "dac-dynamo-noopt-dyn", &[]),
    ("speech_to_text", "speech_to_text-dynamo-dyn", &[]),
    ("speech_to_text", "speech_to_text-dynamo-noopt-dyn", &[]),
    ("marian", "marian-script-dyn", &[]),
    ("mbart", "mbart-script-dyn", &[]),
    ("timesformer", "timesformer-dynamo-dyn", &[]),
    ("speecht5_hifigan", "speecht5_hifigan-dynamo-dyn", &[]),
    ("densenet", "densenet-script-dyn", &[]),
    ("levit", "levit-script-dyn", &[]),
    ("hf_resnet", "hf_resnet-dynamo-dyn", &[]),
    ("resnet", "resnet-dynamo-dyn", &[]),
    ("mobilenet_v2", "mobilenet_v2-dynamo-dyn", &[]),
    ("granitemoe", "granitemoe-dynamo-dyn", &[]),
    ("granitemoe", "granitemoe-dynamo-noopt-dyn", &[]),
    ("jetmoe", "jetmoe-dynamo-b1", &[]),
    ("qwen3_moe", "qwen3_moe-dynamo-noopt-dyn", &[]),
    ("deepseek_v3", "deepseek_v3-script-b1", &[]),
    ("patchtst", "patchtst-dynamo-b2", &[]),
    ("vitdet", "vitdet-dynamo-b1", &[]),
    ("pegasus_x", "pegasus_x-script-b1", &[]),
    ("pegasus_x", "pegasus_x-script-b2", &[]),
    ("pegasus_x", "pegasus_x-dynamo-b2", &[]),
    ("vit", "vit-dynamo-b2", &[]),
    ("longt5", "longt5-script-b2", &[]),
    ("bridgetower_vision", "bridgetower_vision-script-dyn", &[]),
    ("bridgetower_vision", "bridgetower_vision-dynamo-b2", &[]),
    ("seggpt", "seggpt-script-dyn", &[]),
    ("albert", "albert-script-dyn", &[]),
    ("timesformer", "timesformer-script-b2", &[]),
    ("csm_depth", "csm_depth-dynamo-b2", &[]),
    ("csm_depth", "csm_depth-script-b2", &[]),
    ("bert", "bert-dynamo-b2", &[]),
    ("timesformer", "timesformer-dynamo-b1", &[]),
    ("data2vec_audio", "data2vec_audio-dynamo-dyn", &[]),
];

fn torch_python() -> String {
    std::env::var("PIPEWRIGHT_TORCH_PYTHON")
        .unwrap_or_else(|_| panic!("PIPEWRIGHT_TORCH_PYTHON must name a python with torch and transformers (scripts/test.sh sets it from zoo/env.sh)"))
}

/// `zoo/torch_step.py --serve`: one Python process takes every entry's PyTorch step, so
/// that torch and transformers are imported once, not once per entry.
struct TorchSteps {
    child: Child,
    answers: BufReader<ChildStdout>,
}

impl TorchSteps {
    fn start() -> TorchSteps {
        let mut child = Command::new(torch_python())
            .arg(root().join("zoo/torch_step.py"))
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("runs python");
        let answers = BufReader::new(child.stdout.take().expect("piped stdout"));
        TorchSteps { child, answers }
    }

    /// PyTorch's step on `arch` at the entry's inputs, written to `out`: `Err` with the
    /// script's message (its traceback went to this test's standard error).
    fn step(&mut self, arch: &str, entry: &Path, out: &Path) -> Result<(), String> {
        let request = format!("{arch}\t{}\t0.5\t{}", entry.display(), out.display());
        if request.contains('\n') || request.split('\t').count() != 4 {
            return Err(format!("zoo/torch_step.py {arch}: a path holds a tab or a line break: {request:?}"));
        }
        let stdin = self.child.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "{request}").map_err(|e| format!("zoo/torch_step.py stopped: {e}"))?;
        stdin.flush().map_err(|e| format!("zoo/torch_step.py stopped: {e}"))?;
        let mut answer = String::new();
        self.answers.read_line(&mut answer).map_err(|e| format!("zoo/torch_step.py: {e}"))?;
        match answer.trim_end() {
            a if a.starts_with("loss ") => Ok(()),
            "" => Err("zoo/torch_step.py exited (its standard error is above)".into()),
            a => Err(format!("zoo/torch_step.py {arch}: {a}")),
        }
    }
}

impl Drop for TorchSteps {
    fn drop(&mut self) {
        // Killed, not waited for: a step that never returns must not hang the test's end.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// pipewright's step on the entry's model, exported to `work/stepped.onnx`.
fn pipewright_step(model: &Path, data: &Path, work: &Path, compile_flags: &[&str]) -> std::path::PathBuf {
    let (build, exported) = (work.join("build"), work.join("stepped.onnx"));
    let s = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    let mut compile = vec!["compile".to_string(), s(model), "--stages".into(), "2".into(), "--schedule".into(), "flush".into(), "--untie-merged".into(), "-o".into(), s(&build)];
    compile.extend(compile_flags.iter().map(|f| f.to_string()));
    pw_ok(compile);
    // One microbatch of the export batch (the inputs'), the mean PyTorch takes.
    let batch = if model.to_string_lossy().contains("-b1") { "1" } else { "2" };
    pw_ok(["train", &s(&build), "--data", &s(data), "--steps", "1", "--microbatch", batch, "--microbatches", "1", "--lr", "0.5", "--no-progress"]);
    pw_ok(["export", &s(&build), "-o", &s(&exported)]);
    exported
}

#[test]
fn one_step_matches_pytorch() {
    let mut failures = Vec::new();
    let mut torch = TorchSteps::start();
    for (arch, name, compile_flags) in ENTRIES {
        let dir = tempfile::tempdir().expect("temp dir");
        let entry = root().join("zoo/models").join(name);
        let reference = dir.path().join("torch");
        if let Err(e) = torch.step(arch, &entry, &reference) {
            failures.push(e);
            continue;
        }
        let exported = pipewright_step(&entry.join("model.onnx"), &reference.join("data.safetensors"), dir.path(), compile_flags);
        let compare = |model: &Path| try_pw(["run-forward", model.to_str().unwrap(), "--inputs", reference.to_str().unwrap(), "--rtol", "1e-3", "--atol", "1e-4"]);
        if let Err(e) = compare(&exported) {
            failures.push(format!("{name}: pipewright's step differs from PyTorch's:\n{e}"));
        }
        if compare(&entry.join("model.onnx")).is_ok() {
            failures.push(format!("{name}: the source model already matches PyTorch's stepped outputs; the step shows nothing"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
