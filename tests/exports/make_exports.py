"""Writes the export corpus: small models exported the ways people export them.

Each model (random weights from seed 0) is exported by torch's current exporter
(`dynamo=True`, opset 20) three ways — static batch 1, static batch 4, and a dynamic
batch axis — and by the legacy (TorchScript) exporter at opset 17 at batch 4, as
`tests/exports/NAME-WAY.onnx` with `NAME-WAY.inputs/` holding the inputs and what
onnxruntime computes for them (`input_K.pb`, `output_0.pb`; a dynamic export is fed a
batch of 3). `tests/exports.rs` imports every file, checks the forward against those
outputs and trains it for 2 steps at d = 1, 2 and 4.

Needs: torch, transformers, onnx, onnxscript, onnxruntime (pip). Run from the repository
root:
    python3 tests/exports/make_exports.py [NAME ...]
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

OUT = os.path.dirname(os.path.abspath(__file__))


class Logits(torch.nn.Module):
    """The model's logits from its keyword inputs (no cache, no dict output)."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)), **self.extra())
        return out.logits if hasattr(out, "logits") else out

    def extra(self):
        return {"use_cache": False} if "use_cache" in self.model.forward.__code__.co_varnames else {}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg), {"input_ids": lambda b: torch.randint(0, 96, (b, 16))}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg), {"input_ids": lambda b: torch.randint(0, 96, (b, 16))}


def bert():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(cfg), {"input_ids": lambda b: torch.randint(0, 96, (b, 12))}


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    return ViTForImageClassification(cfg), {"pixel_values": lambda b: torch.randn(b, 3, 16, 16)}


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
    return ResNetForImageClassification(cfg), {"pixel_values": lambda b: torch.randn(b, 3, 32, 32)}


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
    return ConvNextForImageClassification(cfg), {"pixel_values": lambda b: torch.randn(b, 3, 32, 32)}


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg), {"input_ids": lambda b: torch.randint(1, 96, (b, 8)),
                                             "decoder_input_ids": lambda b: torch.randint(1, 96, (b, 6))}


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=96, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=32,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=8, max_target_positions=16, decoder_start_token_id=0, pad_token_id=0)
    return WhisperForConditionalGeneration(cfg), {"input_features": lambda b: torch.randn(b, 8, 16),
                                                  "decoder_input_ids": lambda b: torch.randint(1, 96, (b, 6))}


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet, "convnext": convnext,
          "t5": t5, "whisper": whisper}
# (way, exporter, export batch, dynamic batch axis)
WAYS = [("b1", "dynamo", 1, False), ("b4", "dynamo", 4, False), ("dyn", "dynamo", 4, True), ("legacy", "legacy", 4, False)]


def save(path_dir, feeds, outputs):
    os.makedirs(path_dir, exist_ok=True)
    for k, (name, value) in enumerate(feeds.items()):
        with open(os.path.join(path_dir, f"input_{k}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(value, name).SerializeToString())
    for k, value in enumerate(outputs):
        with open(os.path.join(path_dir, f"output_{k}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(np.asarray(value), f"output_{k}").SerializeToString())


def export(name, make):
    torch.manual_seed(0)
    model, inputs = make()
    model = Logits(model.eval(), list(inputs))
    for way, exporter, batch, dynamic in WAYS:
        path = os.path.join(OUT, f"{name}-{way}.onnx")
        args = tuple(f(batch) for f in inputs.values())
        try:
            if exporter == "dynamo":
                shapes = {f"args": tuple({0: torch.export.Dim("batch", min=1, max=64)} for _ in inputs)} if dynamic else None
                torch.onnx.export(model, args, path, dynamo=True, opset_version=20, input_names=list(inputs),
                                  output_names=["logits"], dynamic_shapes=shapes, external_data=False)
            else:
                torch.onnx.export(model, args, path, dynamo=False, opset_version=17, input_names=list(inputs),
                                  output_names=["logits"])
            onnx.checker.check_model(onnx.load(path))
        except Exception as e:  # an exporter that cannot export this model is reported, not fatal
            print(f"{name}-{way}: the {exporter} exporter failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if os.path.exists(path):
                os.remove(path)
            continue
        run_batch = 3 if dynamic else batch
        torch.manual_seed(1)
        feeds = {k: f(run_batch).numpy() for k, f in inputs.items()}
        outputs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
        save(os.path.join(OUT, f"{name}-{way}.inputs"), feeds, outputs)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    for name in sys.argv[1:] or list(MODELS):
        export(name, MODELS[name])
