//! Patterns of today's exporters, end to end through the CLI (compile, train under every
//! schedule, export, import of the exported model): PyTorch's default exporter merges
//! identical initializers (one tensor of ones is every BatchNorm's scale and running
//! variance) and keeps every weight in an external data file beside the model.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;

use common::{node, pw, pw_ok, tensor_external, tensor_f32, Ax, ModelBuilder, NodeExt, F32};

const C: usize = 4;

/// Conv → BatchNorm → Relu → Conv → BatchNorm → pool → Gemm, both BatchNorms reading one
/// `ones` (scale and running variance) and one `zeros` (bias and running mean), as a
/// default-exporter DenseNet does; with `external`, every initializer's values live in
/// `model.onnx.data`.
fn shared_batchnorm_model(dir: &Path, external: bool) -> std::path::PathBuf {
    let weights: Vec<(&str, Vec<i64>, Vec<f32>)> = vec![
        ("ones", vec![C as i64], vec![1.0; C]),
        ("zeros", vec![C as i64], vec![0.0; C]),
        ("w1", vec![C as i64, 3, 3, 3], (0..C * 27).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.03).collect()),
        ("w2", vec![C as i64, C as i64, 3, 3], (0..C * C * 9).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.03).collect()),
        ("fc", vec![10, C as i64], (0..10 * C).map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.1).collect()),
    ];
    let mut m = ModelBuilder::new(17).input("x", F32, &[Ax::Fixed(2), Ax::Fixed(3), Ax::Fixed(8), Ax::Fixed(8)]);
    let mut data = Vec::new();
    for (name, dims, values) in &weights {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        m = m.init(if external {
            let t = tensor_external(name, dims, "model.onnx.data", Some(data.len() as u64), Some(bytes.len() as u64));
            data.extend_from_slice(&bytes);
            t
        } else {
            tensor_f32(name, dims, values)
        });
    }
    let m = m
        .node(node("Conv", "conv1", &["x", "w1"], &["c1"]).ints("pads", &[1, 1, 1, 1]))
        .node(node("BatchNormalization", "bn1", &["c1", "ones", "zeros", "zeros", "ones"], &["b1"]))
        .node(node("Relu", "relu1", &["b1"], &["r1"]))
        .node(node("Conv", "conv2", &["r1", "w2"], &["c2"]).ints("pads", &[1, 1, 1, 1]))
        .node(node("BatchNormalization", "bn2", &["c2", "ones", "zeros", "zeros", "ones"], &["b2"]))
        .node(node("Relu", "relu2", &["b2"], &["r2"]))
        .node(node("GlobalAveragePool", "gap", &["r2"], &["g"]))
        .node(node("Flatten", "flat", &["g"], &["f"]))
        .node(node("Gemm", "fc", &["f", "fc"], &["y"]).int("transB", 1))
        .output("y");
    if external {
        std::fs::write(dir.join("model.onnx.data"), &data).unwrap();
    }
    m.write(dir, "model.onnx")
}

/// Compiles, trains 2 steps at a microbatch other than the export batch, exports and
/// imports the result; returns what compile said (its notes).
fn round_trip(model: &Path, dir: &Path, schedule: &str) -> String {
    let build = dir.join(format!("build-{schedule}"));
    let out = pw(["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", schedule, "-o", build.to_str().unwrap()]);
    assert!(out.status.success(), "compile: {}", String::from_utf8_lossy(&out.stderr));
    pw_ok(["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--no-progress"]);
    let exported = dir.join(format!("trained-{schedule}.onnx"));
    let said = pw_ok(["export", build.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    assert!(said.contains("trained initializers"), "{said}");
    pw_ok(["inspect", exported.to_str().unwrap()]);
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// BatchNorm running statistics merged with the weights train under every schedule: the
/// statistics get copies of their own (and say so at compile), the weights train.
#[test]
fn batchnorm_buffers_merged_with_weights_train_under_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared_batchnorm_model(dir.path(), false);
    for schedule in ["2bw", "flush", "gpipe", "zb-h1"] {
        let notes = round_trip(&model, dir.path(), schedule);
        assert!(notes.contains("note: 2 initializers the exporter shared between BatchNorm running statistics and weights (or other BatchNorms) got a copy per running statistic"), "{notes}");
    }
}

/// The same model with its weights in `model.onnx.data`: merged initializers are noted as
/// for an inline model, and export writes `trained.onnx.data` beside the model.
#[test]
fn external_data_models_note_merges_and_export_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let model = shared_batchnorm_model(dir.path(), true);
    let notes = round_trip(&model, dir.path(), "2bw");
    assert!(notes.contains("initializers the exporter merged (identical values) train as tied weights"), "{notes}");
    assert!(dir.path().join("trained-2bw.onnx.data").is_file(), "the exported weights' data file");
}

/// The default exporter's optimizer drops a Conv's or Gemm's all-zero bias (ViT's patch
/// projection and its attention output projections, freshly initialised): compile restores
/// each as a zero bias that trains, and says so; `export` writes the trained bias into the
/// model, read by its node again. `--no-restore-biases` trains the model as exported, whose
/// note then lists those biases among the parameters the model lacks. (That the restored
/// model's step is PyTorch's: `tests/torch_reference.rs`.)
#[test]
fn biases_the_exporter_dropped_train_again_and_export_into_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::root().join("zoo/models/vit-dynamo-dyn/model.onnx");
    assert!(model.is_file(), "{}: the zoo's ViT (default exporter, dynamic batch) is part of the checkout", model.display());
    let (restored, kept) = (dir.path().join("restored"), dir.path().join("kept"));
    let notes = compile_notes(&model, &restored, &["--schedule", "flush"]);
    assert!(notes.contains("note: 4 all-zero biases the exporter's optimizer dropped (a Conv or Gemm without its bias, which the exported program lists) train again from zeros, as in the source model: model.conv_proj.bias [16], "), "{notes}");
    let notes = compile_notes(&model, &kept, &["--schedule", "flush", "--no-restore-biases"]);
    assert!(!notes.contains("train again from zeros"), "{notes}");
    assert!(notes.contains("not in the model by name") && notes.contains("model.conv_proj.bias"), "{notes}");
    pw_ok(["train", restored.to_str().unwrap(), "--steps", "1", "--microbatch", "2", "--microbatches", "1", "--lr", "0.5", "--no-progress"]);
    let exported = dir.path().join("trained.onnx");
    pw_ok(["export", restored.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    use onnx_protobuf::Message;
    let written = onnx_protobuf::ModelProto::parse_from_bytes(&std::fs::read(&exported).unwrap()).unwrap();
    let graph = written.graph.as_ref().unwrap();
    let conv = graph.node.iter().find(|n| n.op_type == "Conv" && n.input.get(1).map(String::as_str) == Some("model.conv_proj.weight")).expect("the patch projection");
    assert_eq!(conv.input.get(2).map(String::as_str), Some("model.conv_proj.bias"), "{:?}", conv.input);
    assert!(graph.initializer.iter().any(|t| t.name == "model.conv_proj.bias" && t.dims == [16]), "the trained bias is an initializer of the model written");
    // An optimizer that folded nothing records the rewrite on each Conv it dropped the
    // bias of, which is enough: SpeechT5's HiFi-GAN vocoder gets its ten biases back.
    let notes = zoo_notes("speecht5_hifigan-dynamo-dyn", dir.path());
    assert!(notes.contains("note: 10 all-zero biases the exporter's optimizer dropped (a Conv or Gemm without its bias, which the exported program lists) train again from zeros, as in the source model: model.conv_post.bias [1], model.conv_pre.bias [16], "), "{notes}");
}

/// The default exporter's optimizer fuses an eval-mode BatchNorm into the convolution
/// before it: compile names the BatchNorms by module and says they train as convolution
/// weights (their scale and shift are not missing parameters of another kind); exported
/// without the optimizer, the same model keeps its BatchNorms and has nothing to say. The
/// TorchScript exporter fuses them too, and compile names the convolutions.
#[test]
fn batchnorms_the_exporter_fused_are_named_at_compile() {
    let dir = tempfile::tempdir().unwrap();
    let notes = |entry: &str| zoo_notes(entry, dir.path());
    let fused = notes("hf_resnet-dynamo-dyn");
    assert!(fused.contains("note: 8 BatchNorms the exporter's optimizer fused into the Conv or Gemm before them (a model exported in eval mode) train as that layer's weight and bias, normalising no batch, unlike the source model in training: model.resnet.embedder.embedder.normalization, "), "{fused}");
    assert!(fused.contains("torch.onnx.export(..., optimize=False) to train them as BatchNorms"), "{fused}");
    assert!(!fused.contains("not in the model by name"), "{fused}");
    // A fresh BatchNorm's fused bias is zeros, which the optimizer dropped again: it comes
    // back as the BatchNorm's shift, which the fused bias trains as.
    assert!(fused.contains("note: 8 all-zero biases the exporter's optimizer dropped (a Conv or Gemm without its bias, which the exported program lists) train again from zeros, as in the source model: model.resnet.embedder.embedder.normalization.bias [8], "), "{fused}");
    let kept = notes("hf_resnet-dynamo-noopt-dyn");
    assert!(!kept.contains("BatchNorm"), "{kept}");
    // The TorchScript exporter records no fusion: the constants it made for each fused
    // convolution's weight and bias (`onnx::Conv_N`, some stored once and read through an
    // Identity) are the evidence, and a convolution without a BatchNorm keeps its names.
    let script = notes("resnet-script-dyn");
    assert!(script.contains("note: 12 convolutions the TorchScript exporter fused the BatchNorm after them into (a model exported in eval mode; the weight and bias are constants it named itself, onnx::Conv_N) train as plain convolutions, normalising no batch, unlike the source model in training: /model/conv1/Conv, "), "{script}");
    assert!(script.contains("torch.onnx.export(..., dynamo=True, optimize=False) to train them as BatchNorms"), "{script}");
    let unfused = notes("convnext-script-dyn");
    assert!(!unfused.contains("BatchNorm"), "{unfused}");
}

/// DAC's quantizer passes gradients straight through, `z + (q - z).detach()`: the default
/// exporter's optimizer drops the detach and records it only in the reading node's
/// metadata, and compile says where it put it back; without the optimizer the detach is a
/// node of the graph, and TorchScript records none (so neither has anything to say).
#[test]
fn detaches_the_exporter_dropped_are_named_at_compile() {
    let dir = tempfile::tempdir().unwrap();
    let notes = |entry: &str| zoo_notes(entry, dir.path());
    let dropped = notes("dac-dynamo-dyn");
    assert!(dropped.contains("note: 2 reads of a value the source model detaches (detach(), which the exporter's optimizer dropped and its metadata records) pass no gradient back, as in the source model: node_add_624 reads sub_150, node_add_747 reads sub_190"), "{dropped}");
    for kept in ["dac-dynamo-noopt-dyn", "dac-script-dyn"] {
        let notes = notes(kept);
        assert!(!notes.contains("detach"), "{kept}: {notes}");
    }
}

/// Speech2Text's decoder embedding has a padding index, which only the default exporter
/// records (in the lookup's FX node): compile says that row trains no more, with or
/// without the exporter's optimizer; the TorchScript export cannot say.
#[test]
fn padding_rows_of_embeddings_are_named_at_compile() {
    let dir = tempfile::tempdir().unwrap();
    let notes = |entry: &str| zoo_notes(entry, dir.path());
    for entry in ["speech_to_text-dynamo-dyn", "speech_to_text-dynamo-noopt-dyn"] {
        let notes = notes(entry);
        assert!(notes.contains("note: 1 embedding lookup of a module with a padding index (nn.Embedding(padding_idx=P), which the exporter's metadata records) trains no row at that index, as in the source model: node_embedding (row 1 of model.lm_head.weight)"), "{entry}: {notes}");
    }
    let script = notes("speech_to_text-script-dyn");
    assert!(!script.contains("padding index"), "{script}");
}

/// BART's family keeps its logits bias as a buffer: the TorchScript exporter writes it
/// like a parameter, and compile keeps it frozen by its name, saying so; the default
/// exporter's signature lists it as a buffer, which needs no name.
#[test]
fn buffers_a_torchscript_export_writes_as_parameters_stay_frozen_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let notes = |entry: &str| zoo_notes(entry, dir.path());
    let script = notes("marian-script-dyn");
    assert!(script.contains("note: 1 initializer named as PyTorch models name buffers (final_logits_bias, inv_freq, ...), which this export (no exported program's signature) does not tell from parameters, kept frozen (not trained), as PyTorch keeps buffers: model.final_logits_bias [1, 64]"), "{script}");
    let dynamo = notes("marian-dynamo-dyn");
    assert!(!dynamo.contains("named as PyTorch models name buffers"), "{dynamo}");
    assert!(dynamo.contains("model.final_logits_bias [1, 64]"), "{dynamo}");
}

/// BART's logits bias, a buffer, reaches a fixed-batch TorchScript export as a constant
/// the exporter computed and named itself (`onnx::Add_968`, folded through
/// `.to(device)`), which no name or signature marks: compile says it trains as a weight
/// of its own and how to keep it frozen, which `--freeze` then does; the default
/// exporter's entry, whose signature lists the buffer, has no such constant.
#[test]
fn constants_a_torchscript_export_computed_are_named_at_compile() {
    let dir = tempfile::tempdir().unwrap();
    let script = zoo_notes("bart-script-b2", dir.path());
    assert!(script.contains("note: 1 initializer the TorchScript exporter computed and named itself (onnx::Op_N), read other than as a layer's weight, trains as a weight of its own: "), "{script}");
    assert!(script.contains("this export records neither: onnx::Add_968 [1, 64]; compile --freeze NAME keeps one frozen"), "{script}");
    let model = common::root().join("zoo/models/bart-script-b2/model.onnx");
    let frozen = compile_notes(&model, &dir.path().join("frozen"), &["--freeze", "onnx::Add_968"]);
    assert!(!frozen.contains("computed and named itself") && frozen.contains("onnx::Add_968"), "{frozen}");
    let dynamo = zoo_notes("bart-dynamo-b2", dir.path());
    assert!(!dynamo.contains("computed and named itself"), "{dynamo}");
}

/// Whisper's encoder stores its sinusoidal position table as a parameter (PyTorch keeps
/// it with `requires_grad=False`, which no export records): compile keeps it frozen and
/// says so; `--train-sinusoidal` trains it on request, and names a table that is none.
#[test]
fn sinusoidal_position_tables_stay_frozen_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::root().join("zoo/models/whisper_encoder-dynamo-noopt-dyn/model.onnx");
    assert!(model.is_file(), "{}: the zoo's Whisper encoder is part of the checkout", model.display());
    let notes = compile_notes(&model, &dir.path().join("frozen"), &[]);
    assert!(notes.contains("note: 1 initializer holding a sinusoidal position table (every column a sinusoid along the positions) kept frozen (not trained), as PyTorch keeps such tables: model.embed_positions.weight [8, 16]; compile --train-sinusoidal NAME trains one"), "{notes}");
    let notes = compile_notes(&model, &dir.path().join("trained"), &["--train-sinusoidal", "model.embed_positions.weight"]);
    assert!(notes.contains("note: 1 sinusoidal position table trains on request (--train-sinusoidal): model.embed_positions.weight [8, 16]"), "{notes}");
    assert!(!notes.contains("kept frozen"), "{notes}");
    let out = compile(&model, &dir.path().join("bad"), &["--train-sinusoidal", "model.conv1.weight"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model.conv1.weight") && err.contains("--train-sinusoidal: the model has no sinusoidal position table of this name (compile's note lists those it keeps frozen)"), "{err}");
    assert!(!dir.path().join("bad").exists(), "a refused compile leaves no build folder");
}

/// The TorchScript exporter stores a fresh BatchNorm's running variance and mean once
/// with its scale and bias, and reads them through `Identity` nodes (DenseNet exported in
/// eval mode, in the BatchNorms it did not fuse into a convolution): each running
/// statistic gets a copy of its own, which compile names; before, they trained as the
/// scale and bias.
#[test]
fn running_statistics_read_through_identities_get_copies_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let notes = zoo_notes("densenet-script-dyn", dir.path());
    assert!(notes.contains("note: 6 initializers the exporter shared between BatchNorm running statistics and weights (or other BatchNorms) got a copy per running statistic, which follows the batches while the weights train: model.features.denseblock1.denselayer1.norm1.weight, model.features.denseblock1.denselayer1.norm1.bias"), "{notes}");
}

/// Class tokens an export at a fixed batch expanded for that batch follow any other:
/// CLIP's vision tower exported by TorchScript at batch 2 (its token expanded to 2 rows),
/// and TimeSformer's at batch 1, whose token is expanded once per frame of each sample
/// (4 rows beside `4 N` rows of patches). Both compiled (which runs the stages at another
/// batch) and trained at microbatch 3; before, both stopped at their Concat at batch 3.
#[test]
fn class_tokens_expanded_for_the_export_batch_follow_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    for entry in ["clip_vision-script-b2", "timesformer-script-b1"] {
        zoo_notes(entry, dir.path());
        let build = dir.path().join(entry);
        pw_ok(["train", build.to_str().unwrap(), "--steps", "2", "--microbatch", "3", "--no-progress"]);
    }
}

/// `pipewright compile MODEL --stages 2 -o BUILD EXTRA...`, as it ended.
fn compile(model: &Path, build: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["compile", model.to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()];
    args.extend(extra);
    pw(args)
}

/// [`compile_notes`] of the zoo's `entry`, built under `dir`.
fn zoo_notes(entry: &str, dir: &Path) -> String {
    let model = common::root().join("zoo/models").join(entry).join("model.onnx");
    assert!(model.is_file(), "{}: the zoo's entry is part of the checkout", model.display());
    compile_notes(&model, &dir.join(entry), &[])
}

/// [`compile`]'s notes (stderr), which must come with success.
fn compile_notes(model: &Path, build: &Path, extra: &[&str]) -> String {
    let out = compile(model, build, extra);
    let notes = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "compile {}: {notes}", model.display());
    notes
}
