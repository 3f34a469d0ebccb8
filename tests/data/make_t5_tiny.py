"""Writes tests/data/t5-tiny.onnx and its reference data (tests/data/t5-tiny.inputs/).

A T5-style encoder-decoder (transformers' T5ForConditionalGeneration: 2 encoder and 2
decoder layers, d_model 32, 4 heads, vocabulary 100, random weights from seed 0),
exported by torch's legacy (TorchScript) exporter at opset 17 with a fixed batch of 2:
two inputs (8 encoder tokens, 6 decoder tokens), the encoder's output feeding every
decoder layer's cross-attention, and the exporter's `Identity` nodes for deduplicated
initializers. `output_0.pb` is what onnxruntime computes for the stored inputs.

Needs: torch, transformers, onnx, onnxruntime (pip). Run from the repository root:
    python3 tests/data/make_t5_tiny.py
"""
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from transformers import T5Config, T5ForConditionalGeneration

out = os.path.join(os.path.dirname(os.path.abspath(__file__)))
torch.manual_seed(0)
cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(cfg).eval()


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, decoder_input_ids):
        return self.m(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


ids = torch.randint(1, 100, (2, 8))
dec = torch.randint(1, 100, (2, 6))
path = os.path.join(out, "t5-tiny.onnx")
torch.onnx.export(Logits(model), (ids, dec), path, dynamo=False, opset_version=17,
                  input_names=["input_ids", "decoder_input_ids"], output_names=["logits"])
onnx.checker.check_model(onnx.load(path))
feeds = {"input_ids": ids.numpy(), "decoder_input_ids": dec.numpy()}
(logits,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
data = os.path.join(out, "t5-tiny.inputs")
os.makedirs(data, exist_ok=True)
for k, (name, value) in enumerate(feeds.items()):
    with open(os.path.join(data, f"input_{k}.pb"), "wb") as f:
        f.write(numpy_helper.from_array(value, name).SerializeToString())
with open(os.path.join(data, "output_0.pb"), "wb") as f:
    f.write(numpy_helper.from_array(np.asarray(logits), "logits").SerializeToString())
print(f"wrote {path} ({os.path.getsize(path)} bytes) and {data}/")
