"""Writes the model zoo: today's architectures, exported the ways people export them.

Every architecture is built from its library's own constructor or config (torchvision,
transformers; a few from torch.nn building blocks) at a tiny width and depth that keeps
its structure, with random weights from seed 0 (nothing is downloaded). Each one is
exported seven ways: by PyTorch's default exporter (`dynamo=True`, weights in an external
`model.onnx.data` file, as that exporter writes them) and by the TorchScript exporter
(`dynamo=False`), each at a fixed batch of 1, a fixed batch of 2, and with a dynamic batch
axis (exported at batch 2); and by the default exporter without its graph optimizer
(`optimize=False`, dynamic batch), the export that keeps every parameter as the model
trains it (the optimizer folds parameters into constants, drops all-zero biases and
stores equal parameters once).

Entry `ARCH-WAY` is the folder `zoo/models/ARCH-WAY/` with `model.onnx` (and
`model.onnx.data`), `input_K.pb` (the inputs at the export batch) and `output_K.pb` (what
onnxruntime computes for them). `zoo/zoo.json` lists every entry, with the exporter's
error where the exporter itself could not export the model (the zoo records that; it is
not pipewright's failure). `tests/zoo.rs` takes every entry end to end.

Run with the pinned environment (`zoo/env.sh` creates it), from the repository root:
    "$(bash zoo/env.sh)" zoo/make_zoo.py [--ways WAY,...] [ARCH ...]
(`--ways` re-exports only those ways of each architecture, e.g. `dynamo-noopt-dyn`.)
"""
import json
import os
import shutil
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn

ROOT = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(ROOT, "models")
INDEX = os.path.join(ROOT, "zoo.json")
# (way, exporter, export batch, dynamic batch axis)
WAYS = [
    ("dynamo-b1", "dynamo", 1, False),
    ("dynamo-b2", "dynamo", 2, False),
    ("dynamo-dyn", "dynamo", 2, True),
    ("dynamo-noopt-dyn", "dynamo-noopt", 2, True),
    ("script-b1", "torchscript", 1, False),
    ("script-b2", "torchscript", 2, False),
    ("script-dyn", "torchscript", 2, True),
]
VOCAB = 64
SEQ = 8


class Wrapped(nn.Module):
    """The model's main output (logits, or the last hidden state) from positional inputs."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        if not hasattr(self.model, "config"):  # torch.nn and torchvision models: positional
            out = self.model(*args)
        else:
            kwargs = dict(zip(self.names, args))
            if "use_cache" in self.model.forward.__code__.co_varnames:
                kwargs["use_cache"] = False
            out = self.model(**kwargs)
        for key in ("logits", "last_hidden_state", "sample", "predicted_depth", "prediction_outputs", "audio_values"):
            if hasattr(out, key) and getattr(out, key) is not None:
                return getattr(out, key)
        if isinstance(out, dict):  # torchvision's segmentation models: {"out": ..., "aux": ...}
            return out["out"]
        return out[0] if isinstance(out, (tuple, list)) else out


def image(size=32, channels=3):
    return {"pixel_values": lambda b: torch.randn(b, channels, size, size)}


def tokens(mask=True, seq=SEQ):
    """Token ids, and an attention mask that pads the end of every other row."""
    def attention_mask(b):
        m = torch.ones(b, seq, dtype=torch.int64)
        m[1::2, seq - 2:] = 0
        return m
    spec = {"input_ids": lambda b: torch.randint(1, VOCAB, (b, seq))}
    if mask:
        spec["attention_mask"] = attention_mask
    return spec


def seq2seq():
    return {"input_ids": lambda b: torch.randint(1, VOCAB, (b, SEQ)),
            "decoder_input_ids": lambda b: torch.randint(1, VOCAB, (b, 6))}


# ---- vision: torchvision constructors -------------------------------------------------

def tv_densenet():
    from torchvision.models import DenseNet
    return DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10), image()


def tv_mobilenet_v2():
    from torchvision.models import MobileNetV2
    setting = [[1, 8, 1, 1], [6, 12, 2, 2], [6, 16, 1, 2]]
    m = MobileNetV2(num_classes=10, inverted_residual_setting=setting, width_mult=1.0)
    return m, image()


def tv_mobilenet_v3():
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3
    c = InvertedResidualConfig
    setting = [c(8, 3, 8, 8, True, "RE", 2, 1, 1.0), c(8, 3, 24, 12, False, "RE", 2, 1, 1.0),
               c(12, 5, 32, 16, True, "HS", 2, 1, 1.0)]
    return MobileNetV3(setting, last_channel=32, num_classes=10), image()


def tv_efficientnet():
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig
    setting = [MBConvConfig(1, 3, 1, 8, 8, 1, 1.0, 1.0), MBConvConfig(4, 3, 2, 8, 12, 2, 1.0, 1.0),
               MBConvConfig(4, 5, 2, 12, 16, 1, 1.0, 1.0)]
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=32), image()


def tv_efficientnet_v2():
    """torchvision's EfficientNetV2 layout: fused MBConv stages (one expanded 3x3 convolution), then MBConv."""
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig
    setting = [FusedMBConvConfig(1, 3, 1, 8, 8, 1), FusedMBConvConfig(4, 3, 2, 8, 16, 1),
               MBConvConfig(4, 3, 2, 16, 24, 1, 1.0, 1.0)]
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=32), image()


def tv_regnet():
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams.from_init_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=4, se_ratio=0.25)
    return RegNet(params, num_classes=10, stem_width=8), image()


def tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    setting = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.0, num_classes=10), image()


def tv_vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10), image(16)


def tv_swin():
    from torchvision.models import SwinTransformer
    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=10), image(16)


def tv_swin_v2():
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=10, block=SwinTransformerBlockV2,
                           downsample_layer=PatchMergingV2), image(16)


def tv_shufflenet():
    from torchvision.models import ShuffleNetV2
    return ShuffleNetV2(stages_repeats=[1, 1, 1], stages_out_channels=[8, 16, 32, 64, 64], num_classes=10), image()


def tv_mnasnet():
    """torchvision's MNASNet at alpha 0.1, its 1280-wide head narrowed to 32."""
    from torchvision.models import MNASNet
    m = MNASNet(alpha=0.1, num_classes=10, dropout=0.0)
    m.layers[-3] = nn.Conv2d(m.layers[-3].in_channels, 32, 1, bias=False)
    m.layers[-2] = nn.BatchNorm2d(32)
    m.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(32, 10))
    return m, image()


def tv_resnet():
    """torchvision's ResNet (BasicBlock) with its stem and stages at a tiny width."""
    from torchvision.models.resnet import BasicBlock, ResNet
    m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)
    # Same structure at 1/16 width: rebuild the layers with the block's own constructor.
    m.inplanes = 8
    m.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
    m.bn1 = nn.BatchNorm2d(8)
    m.layer1 = m._make_layer(BasicBlock, 8, 1)
    m.layer2 = m._make_layer(BasicBlock, 8, 1, stride=2)
    m.layer3 = m._make_layer(BasicBlock, 16, 1, stride=2)
    m.layer4 = m._make_layer(BasicBlock, 32, 1, stride=2)
    m.fc = nn.Linear(32, 10)
    return m, image()


def tv_resnext():
    """torchvision's ResNeXt (Bottleneck blocks, grouped 3x3 convolutions) at a tiny width."""
    from torchvision.models.resnet import Bottleneck, ResNet
    m = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=4, width_per_group=16)
    m.inplanes = 8
    m.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
    m.bn1 = nn.BatchNorm2d(8)
    m.layer1 = m._make_layer(Bottleneck, 8, 1)
    m.layer2 = m._make_layer(Bottleneck, 16, 1, stride=2)
    m.fc = nn.Linear(64, 10)
    m.layer3, m.layer4 = nn.Identity(), nn.Identity()
    return m, image()


def tv_maxvit():
    """torchvision's MaxViT (MBConv, then block and grid attention over 2x2 partitions), two tiny stages."""
    from torchvision.models import MaxVit
    return MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16], block_layers=[1, 1],
                  head_dim=4, stochastic_depth_prob=0.0, num_classes=10), image()


def tv_r3d():
    """torchvision's video ResNet (R3D: 3-D convolutions over frames), stem and two stages at a tiny width."""
    from torchvision.models.video.resnet import BasicBlock, BasicStem, Conv3DSimple, VideoResNet
    m = VideoResNet(BasicBlock, [Conv3DSimple] * 4, [1, 1, 1, 1], BasicStem, num_classes=10)
    m.inplanes = 8
    m.stem = nn.Sequential(nn.Conv3d(3, 8, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(8),
                           nn.ReLU(inplace=True))
    m.layer1 = m._make_layer(BasicBlock, Conv3DSimple, 8, 1)
    m.layer2 = m._make_layer(BasicBlock, Conv3DSimple, 16, 1, stride=2)
    m.layer3, m.layer4 = nn.Identity(), nn.Identity()
    m.fc = nn.Linear(16, 10)
    return m, {"video": lambda b: torch.randn(b, 3, 4, 16, 16)}


def tv_deeplabv3():
    """torchvision's DeepLabV3 (atrous spatial pyramid pooling, bilinear upsampling) on the tiny ResNet."""
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabV3
    backbone = IntermediateLayerGetter(tv_resnet()[0], {"layer4": "out"})
    # DeepLabHead's layout with its 256 channels narrowed to 16.
    head = nn.Sequential(ASPP(32, [2, 4, 6], out_channels=16), nn.Conv2d(16, 16, 3, padding=1, bias=False),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 3, 1))
    return DeepLabV3(backbone, head), image()


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1's layout (Fire modules from torchvision) at a tiny width."""

    def __init__(self):
        super().__init__()
        from torchvision.models.squeezenet import Fire
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
                                      Fire(8, 4, 8, 8), Fire(16, 4, 8, 8), nn.MaxPool2d(3, 2, ceil_mode=True),
                                      Fire(16, 8, 12, 12))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Conv2d(24, 10, 1), nn.ReLU(inplace=True),
                                        nn.AdaptiveAvgPool2d((1, 1)))

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


class GoogLeNet(nn.Module):
    """GoogLeNet's stem and Inception modules (torchvision's) at a tiny width."""

    def __init__(self):
        super().__init__()
        from torchvision.models.googlenet import BasicConv2d, Inception
        self.stem = nn.Sequential(BasicConv2d(3, 8, kernel_size=3, stride=2, padding=1),
                                  nn.MaxPool2d(3, 2, ceil_mode=True))
        self.inception3a = Inception(8, 4, 4, 8, 2, 4, 4)
        self.inception3b = Inception(20, 8, 4, 8, 2, 4, 4)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = self.inception3b(self.inception3a(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class UNet(nn.Module):
    """A U-Net: two down blocks, a bottleneck, two up blocks with skip concatenations."""

    def __init__(self, c=8):
        super().__init__()
        block = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                           nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
        self.down1, self.down2 = block(3, c), block(c, 2 * c)
        self.mid = block(2 * c, 4 * c)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), block(4 * c, 2 * c)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * c, c, 2, 2), block(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(nn.functional.max_pool2d(d1, 2))
        m = self.mid(nn.functional.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return self.head(u1)


class DiffusionUNet(nn.Module):
    """A denoising U-Net as diffusion models use it: a sinusoidal timestep embedding added
    into GroupNorm/SiLU residual blocks, self-attention at the lowest resolution, skips."""

    def __init__(self, c=8):
        super().__init__()
        self.c = c
        self.time = nn.Sequential(nn.Linear(c, 2 * c), nn.SiLU(), nn.Linear(2 * c, 2 * c))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.res1 = ResBlock(c, c, 2 * c)
        self.down = nn.Conv2d(c, 2 * c, 3, 2, 1)
        self.res2 = ResBlock(2 * c, 2 * c, 2 * c)
        self.attn = nn.MultiheadAttention(2 * c, 2, batch_first=True)
        self.norm = nn.GroupNorm(4, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, 2)
        self.res3 = ResBlock(2 * c, c, 2 * c)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t):
        half = self.c // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (np.log(10000.0) / half))
        args = t.float()[:, None] * freqs[None]
        emb = self.time(torch.cat([torch.sin(args), torch.cos(args)], -1))
        h1 = self.res1(self.inp(x), emb)
        h2 = self.res2(self.down(h1), emb)
        b, ch, hh, ww = h2.shape
        seq = self.norm(h2).flatten(2).transpose(1, 2)
        a, _ = self.attn(seq, seq, seq, need_weights=False)
        h2 = h2 + a.transpose(1, 2).reshape(b, ch, hh, ww)
        h = self.res3(torch.cat([self.up(h2), h1], 1), emb)
        return self.out(h)


class ResBlock(nn.Module):
    def __init__(self, i, o, emb):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, i), nn.Conv2d(i, o, 3, padding=1)
        self.t = nn.Linear(emb, o)
        self.n2, self.c2 = nn.GroupNorm(4, o), nn.Conv2d(o, o, 3, padding=1)
        self.skip = nn.Conv2d(i, o, 1) if i != o else nn.Identity()

    def forward(self, x, emb):
        h = self.c1(nn.functional.silu(self.n1(x))) + self.t(emb)[:, :, None, None]
        return self.skip(x) + self.c2(nn.functional.silu(self.n2(h)))


class MlpMixer(nn.Module):
    """MLP-Mixer: patch embedding, then token-mixing and channel-mixing MLPs."""

    def __init__(self, size=16, patch=4, dim=16, depth=2, classes=10):
        super().__init__()
        tokens = (size // patch) ** 2
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "tokens": nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens)),
                "norm2": nn.LayerNorm(dim),
                "channels": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
            }))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        for b in self.blocks:
            x = x + b["tokens"](b["norm1"](x).transpose(1, 2)).transpose(1, 2)
            x = x + b["channels"](b["norm2"](x))
        return self.head(self.norm(x).mean(1))


class LstmTagger(nn.Module):
    """A two-layer bidirectional LSTM tagger over token embeddings."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 5)

    def forward(self, input_ids):
        out, _ = self.lstm(self.embed(input_ids))
        return self.head(out)


class GruClassifier(nn.Module):
    """A GRU over token embeddings, classified from its last hidden state."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, input_ids):
        _, h = self.gru(self.embed(input_ids))
        return self.head(h[-1])


# ---- transformers configs -------------------------------------------------------------

def hf(config_cls, model_cls, inputs, **cfg):
    import transformers
    config = getattr(transformers, config_cls)(**cfg)
    return getattr(transformers, model_cls)(config), inputs


TEXT = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)
DECODER = dict(TEXT, num_key_value_heads=1)

ARCHS = {
    # vision
    "resnet": lambda: tv_resnet(),
    "resnext": lambda: tv_resnext(),
    "densenet": lambda: tv_densenet(),
    "mobilenet_v2": lambda: tv_mobilenet_v2(),
    "mobilenet_v3": lambda: tv_mobilenet_v3(),
    "efficientnet": lambda: tv_efficientnet(),
    "regnet": lambda: tv_regnet(),
    "convnext": lambda: tv_convnext(),
    "vit": lambda: tv_vit(),
    "swin": lambda: tv_swin(),
    "swin_v2": lambda: tv_swin_v2(),
    "squeezenet": lambda: (SqueezeNet(), image()),
    "shufflenet": lambda: tv_shufflenet(),
    "googlenet": lambda: (GoogLeNet(), image()),
    "mnasnet": lambda: tv_mnasnet(),
    "unet": lambda: (UNet(), image(16)),
    "maxvit": lambda: tv_maxvit(),
    "r3d": lambda: tv_r3d(),
    "deeplabv3": lambda: tv_deeplabv3(),
    "hf_resnet": lambda: hf("ResNetConfig", "ResNetForImageClassification", image(),
                            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5),
    "deit": lambda: hf("DeiTConfig", "DeiTForImageClassification", image(16), image_size=16, patch_size=4,
                       hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=5),
    "mobilevit": lambda: hf("MobileViTConfig", "MobileViTForImageClassification", image(32), image_size=32,
                            hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
                            num_attention_heads=2, num_labels=5),
    "poolformer": lambda: hf("PoolFormerConfig", "PoolFormerForImageClassification", image(32),
                             hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], num_labels=5),
    "segformer": lambda: hf("SegformerConfig", "SegformerForSemanticSegmentation", image(32),
                            hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2],
                            decoder_hidden_size=16, num_labels=3),
    "beit": lambda: hf("BeitConfig", "BeitForImageClassification", image(16), image_size=16, patch_size=4,
                       hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       use_relative_position_bias=True),
    "cvt": lambda: hf("CvtConfig", "CvtForImageClassification", image(32), embed_dim=[8, 16], num_heads=[1, 2],
                      depth=[1, 2], patch_sizes=[7, 3], patch_stride=[4, 2], patch_padding=[2, 1],
                      mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0],
                      drop_path_rate=[0.0, 0.0], qkv_bias=[True, True], cls_token=[False, True],
                      qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3], padding_kv=[1, 1],
                      stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1], num_labels=5),
    "levit": lambda: hf("LevitConfig", "LevitForImageClassification", image(32), image_size=32, patch_size=16,
                        hidden_sizes=[16, 24, 32], num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[8, 8, 8],
                        drop_path_rate=0.0, mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2],
                        down_ops=[["Subsample", 8, 2, 4, 2, 2], ["Subsample", 8, 3, 4, 2, 2]], num_labels=5),
    "mobilevitv2": lambda: hf("MobileViTV2Config", "MobileViTV2ForImageClassification", image(64), image_size=64,
                              width_multiplier=0.25, num_labels=5),
    "dinov2": lambda: hf("Dinov2Config", "Dinov2ForImageClassification", image(16), image_size=16, patch_size=4,
                         hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, num_labels=5),
    "efficientnet_v2": lambda: tv_efficientnet_v2(),
    "convnextv2": lambda: hf("ConvNextV2Config", "ConvNextV2ForImageClassification", image(32), num_stages=2,
                             hidden_sizes=[8, 16], depths=[1, 1], num_labels=5),
    "focalnet": lambda: hf("FocalNetConfig", "FocalNetForImageClassification", image(32), image_size=32, patch_size=4,
                           embed_dim=8, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3], num_labels=5),
    "pvt_v2": lambda: hf("PvtV2Config", "PvtV2ForImageClassification", image(32), hidden_sizes=[8, 16],
                         depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1], num_attention_heads=[1, 2],
                         patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], num_labels=5),
    "swiftformer": lambda: hf("SwiftFormerConfig", "SwiftFormerForImageClassification", image(32),
                              depths=[1, 1, 1, 1], embed_dims=[8, 8, 16, 16], num_labels=5),
    "bit": lambda: hf("BitConfig", "BitForImageClassification", image(32), embedding_size=8, hidden_sizes=[8, 16],
                      depths=[1, 1], layer_type="preactivation", num_groups=4, num_labels=5),
    "yolos": lambda: hf("YolosConfig", "YolosForObjectDetection", image(32), image_size=[32, 32], patch_size=8,
                        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        num_detection_tokens=4, num_labels=5),
    "dpt": lambda: hf("DPTConfig", "DPTForDepthEstimation", image(32), image_size=32, patch_size=8, hidden_size=16,
                      num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                      backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 8, 8, 8], fusion_hidden_size=8,
                      head_hidden_size=8, reassemble_factors=[4, 2, 1, 0.5]),
    "hiera": lambda: hf("HieraConfig", "HieraForImageClassification", image(64), image_size=[64, 64], embed_dim=8,
                        depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], num_labels=5),
    "clip_vision": lambda: hf("CLIPVisionConfig", "CLIPVisionModel", image(32), image_size=32, patch_size=8,
                              hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32),
    "siglip_vision": lambda: hf("SiglipVisionConfig", "SiglipVisionModel", image(32), image_size=32, patch_size=8,
                                hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32),
    "vitdet": lambda: hf("VitDetConfig", "VitDetModel", image(32), image_size=32, pretrain_image_size=32,
                         patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                         window_size=2, window_block_indices=[0], use_relative_position_embeddings=True),
    "data2vec_vision": lambda: hf("Data2VecVisionConfig", "Data2VecVisionForImageClassification", image(16),
                                  image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32, use_relative_position_bias=True,
                                  num_labels=5),
    "dinov2_registers": lambda: hf("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification",
                                   image(16), image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, mlp_ratio=2, num_register_tokens=2, num_labels=5),
    "mobilenet_v1": lambda: hf("MobileNetV1Config", "MobileNetV1ForImageClassification", image(32), image_size=32,
                               depth_multiplier=0.25, min_depth=4, num_labels=5),
    "glpn": lambda: hf("GLPNConfig", "GLPNForDepthEstimation", image(32), hidden_sizes=[8, 8, 16, 16],
                       depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2], decoder_hidden_size=8),
    # video
    "videomae": lambda: hf("VideoMAEConfig", "VideoMAEForVideoClassification",
                           {"pixel_values": lambda b: torch.randn(b, 4, 3, 16, 16)}, image_size=16, patch_size=8,
                           num_frames=4, tubelet_size=2, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, num_labels=5),
    "timesformer": lambda: hf("TimesformerConfig", "TimesformerForVideoClassification",
                              {"pixel_values": lambda b: torch.randn(b, 4, 3, 16, 16)}, image_size=16, patch_size=8,
                              num_frames=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, num_labels=5),
    # language: encoders
    "bert": lambda: hf("BertConfig", "BertForMaskedLM", tokens(), **TEXT),
    "roberta": lambda: hf("RobertaConfig", "RobertaForSequenceClassification", tokens(), pad_token_id=1,
                          **dict(TEXT, max_position_embeddings=40), num_labels=3),
    "distilbert": lambda: hf("DistilBertConfig", "DistilBertForSequenceClassification", tokens(), vocab_size=VOCAB,
                             dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32, num_labels=3),
    "albert": lambda: hf("AlbertConfig", "AlbertForMaskedLM", tokens(), embedding_size=8, **TEXT),
    "electra": lambda: hf("ElectraConfig", "ElectraForPreTraining", tokens(), embedding_size=8, **TEXT),
    "deberta_v2": lambda: hf("DebertaV2Config", "DebertaV2ForSequenceClassification", tokens(), num_labels=3,
                             position_buckets=8, max_relative_positions=16, relative_attention=True, **TEXT),
    "mpnet": lambda: hf("MPNetConfig", "MPNetForMaskedLM", tokens(), **TEXT),
    "convbert": lambda: hf("ConvBertConfig", "ConvBertForMaskedLM", tokens(), embedding_size=16, **TEXT),
    "funnel": lambda: hf("FunnelConfig", "FunnelForSequenceClassification", tokens(), vocab_size=VOCAB, d_model=16,
                         n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1], num_decoder_layers=1),
    "roformer": lambda: hf("RoFormerConfig", "RoFormerForMaskedLM", tokens(), embedding_size=16, **TEXT),
    "squeezebert": lambda: hf("SqueezeBertConfig", "SqueezeBertForSequenceClassification", tokens(), embedding_size=16,
                              q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2,
                              output_groups=2, num_labels=3, **TEXT),
    "nystromformer": lambda: hf("NystromformerConfig", "NystromformerForMaskedLM", tokens(), num_landmarks=4,
                                segment_means_seq_len=SEQ, conv_kernel_size=None, **TEXT),
    "esm": lambda: hf("EsmConfig", "EsmForMaskedLM", tokens(), position_embedding_type="rotary", pad_token_id=1,
                      mask_token_id=2, **TEXT),
    "fnet": lambda: hf("FNetConfig", "FNetForMaskedLM", tokens(mask=False), **dict(TEXT, num_attention_heads=None)),
    "mobilebert": lambda: hf("MobileBertConfig", "MobileBertForMaskedLM", tokens(), embedding_size=16,
                             intra_bottleneck_size=8, true_hidden_size=8, num_feedforward_networks=2, **TEXT),
    "xlnet": lambda: hf("XLNetConfig", "XLNetLMHeadModel", tokens(), vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2,
                        d_inner=32),
    "megatron_bert": lambda: hf("MegatronBertConfig", "MegatronBertForMaskedLM", tokens(), **TEXT),
    "ernie": lambda: hf("ErnieConfig", "ErnieForMaskedLM", tokens(), **TEXT),
    "rembert": lambda: hf("RemBertConfig", "RemBertForMaskedLM", tokens(), input_embedding_size=8,
                          output_embedding_size=16, pad_token_id=0, **TEXT),
    "big_bird": lambda: hf("BigBirdConfig", "BigBirdForMaskedLM", tokens(), attention_type="original_full", **TEXT),
    "xlm": lambda: hf("XLMConfig", "XLMWithLMHeadModel", tokens(), vocab_size=VOCAB, emb_dim=16, n_layers=2,
                      n_heads=2, max_position_embeddings=32),
    "modernbert": lambda: hf("ModernBertConfig", "ModernBertForMaskedLM", tokens(), vocab_size=VOCAB, hidden_size=16,
                             intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                             global_attn_every_n_layers=2, local_attention=4, max_position_embeddings=32,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                             reference_compile=False),
    # language: decoders
    "gpt2": lambda: hf("GPT2Config", "GPT2LMHeadModel", tokens(), vocab_size=VOCAB, n_positions=32, n_embd=16,
                       n_layer=2, n_head=2),
    "gpt_neo": lambda: hf("GPTNeoConfig", "GPTNeoForCausalLM", tokens(), vocab_size=VOCAB, max_position_embeddings=32,
                          hidden_size=16, num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=2,
                          window_size=4, intermediate_size=32),
    "gpt_neox": lambda: hf("GPTNeoXConfig", "GPTNeoXForCausalLM", tokens(), **TEXT),
    "llama": lambda: hf("LlamaConfig", "LlamaForCausalLM", tokens(), **DECODER),
    "mistral": lambda: hf("MistralConfig", "MistralForCausalLM", tokens(), sliding_window=4, **DECODER),
    "qwen2": lambda: hf("Qwen2Config", "Qwen2ForCausalLM", tokens(), **DECODER),
    "qwen3": lambda: hf("Qwen3Config", "Qwen3ForCausalLM", tokens(), head_dim=8, **DECODER),
    "phi": lambda: hf("PhiConfig", "PhiForCausalLM", tokens(), **TEXT),
    "phi3": lambda: hf("Phi3Config", "Phi3ForCausalLM", tokens(), pad_token_id=0, **DECODER),
    "gemma": lambda: hf("GemmaConfig", "GemmaForCausalLM", tokens(), head_dim=8, **DECODER),
    "opt": lambda: hf("OPTConfig", "OPTForCausalLM", tokens(), vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=16),
    "bloom": lambda: hf("BloomConfig", "BloomForCausalLM", tokens(), vocab_size=VOCAB, hidden_size=16, n_layer=2,
                        n_head=2),
    "falcon": lambda: hf("FalconConfig", "FalconForCausalLM", tokens(), vocab_size=VOCAB, hidden_size=16,
                         num_hidden_layers=2, num_attention_heads=2, new_decoder_architecture=True, num_kv_heads=1),
    "gptj": lambda: hf("GPTJConfig", "GPTJForCausalLM", tokens(), vocab_size=VOCAB, n_positions=32, n_embd=16,
                       n_layer=2, n_head=2, rotary_dim=4),
    "biogpt": lambda: hf("BioGptConfig", "BioGptForCausalLM", tokens(), **TEXT),
    "stablelm": lambda: hf("StableLmConfig", "StableLmForCausalLM", tokens(), **DECODER),
    "olmo": lambda: hf("OlmoConfig", "OlmoForCausalLM", tokens(), pad_token_id=0, **DECODER),
    "gpt_bigcode": lambda: hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", tokens(), vocab_size=VOCAB, n_positions=32,
                              n_embd=16, n_layer=2, n_head=2, multi_query=True),
    "mpt": lambda: hf("MptConfig", "MptForCausalLM", tokens(), vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2,
                      max_seq_len=32, expansion_ratio=2),
    # CodeGen splits its fused projection into 4 model-parallel parts: 4 heads of 4.
    "codegen": lambda: hf("CodeGenConfig", "CodeGenForCausalLM", tokens(), vocab_size=VOCAB, n_positions=32, n_ctx=32,
                          n_embd=16, n_layer=2, n_head=4, rotary_dim=4),
    "xglm": lambda: hf("XGLMConfig", "XGLMForCausalLM", tokens(), vocab_size=VOCAB, d_model=16, num_layers=2,
                       attention_heads=2, ffn_dim=32, max_position_embeddings=32),
    "gemma2": lambda: hf("Gemma2Config", "Gemma2ForCausalLM", tokens(), head_dim=8, sliding_window=4,
                         **DECODER),
    "cohere": lambda: hf("CohereConfig", "CohereForCausalLM", tokens(), pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **DECODER),
    "olmo2": lambda: hf("Olmo2Config", "Olmo2ForCausalLM", tokens(), pad_token_id=0, **DECODER),
    "starcoder2": lambda: hf("Starcoder2Config", "Starcoder2ForCausalLM", tokens(), **DECODER),
    "mixtral": lambda: hf("MixtralConfig", "MixtralForCausalLM", tokens(), num_local_experts=4,
                          num_experts_per_tok=2, **DECODER),
    "qwen2_moe": lambda: hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", tokens(), num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16, **DECODER),
    "olmoe": lambda: hf("OlmoeConfig", "OlmoeForCausalLM", tokens(), num_experts=4, num_experts_per_tok=2,
                        pad_token_id=0, **DECODER),
    "granitemoe": lambda: hf("GraniteMoeConfig", "GraniteMoeForCausalLM", tokens(), num_local_experts=4,
                             num_experts_per_tok=2, **DECODER),
    "granite": lambda: hf("GraniteConfig", "GraniteForCausalLM", tokens(), **DECODER),
    "nemotron": lambda: hf("NemotronConfig", "NemotronForCausalLM", tokens(), head_dim=8, partial_rotary_factor=0.5,
                           **DECODER),
    "glm": lambda: hf("GlmConfig", "GlmForCausalLM", tokens(), head_dim=8, pad_token_id=0, **DECODER),
    "helium": lambda: hf("HeliumConfig", "HeliumForCausalLM", tokens(), head_dim=8, pad_token_id=0, **DECODER),
    "persimmon": lambda: hf("PersimmonConfig", "PersimmonForCausalLM", tokens(), **TEXT),
    "diffllama": lambda: hf("DiffLlamaConfig", "DiffLlamaForCausalLM", tokens(), **DECODER),
    "gemma3": lambda: hf("Gemma3TextConfig", "Gemma3ForCausalLM", tokens(), head_dim=8, sliding_window=4,
                         sliding_window_pattern=2, **DECODER),
    "cohere2": lambda: hf("Cohere2Config", "Cohere2ForCausalLM", tokens(), sliding_window=4, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, **DECODER),
    "ctrl": lambda: hf("CTRLConfig", "CTRLLMHeadModel", tokens(), vocab_size=VOCAB, n_positions=32, n_embd=16,
                       dff=32, n_layer=2, n_head=2),
    "mamba": lambda: hf("MambaConfig", "MambaForCausalLM", tokens(mask=False), vocab_size=VOCAB, hidden_size=16,
                        state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=2),
    "rwkv": lambda: hf("RwkvConfig", "RwkvForCausalLM", tokens(mask=False), vocab_size=VOCAB, context_length=32,
                       hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32),
    "qwen3_moe": lambda: hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tokens(), num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, head_dim=8, **DECODER),
    "deepseek_v3": lambda: hf("DeepseekV3Config", "DeepseekV3ForCausalLM", tokens(), n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
                              first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                              qk_nope_head_dim=4, v_head_dim=8, pad_token_id=0, **dict(DECODER, num_key_value_heads=2)),
    "dbrx": lambda: hf("DbrxConfig", "DbrxForCausalLM", tokens(), d_model=16, n_heads=2, n_layers=2, max_seq_len=32,
                       vocab_size=VOCAB, attn_config={"kv_n_heads": 1, "clip_qkv": 8},
                       ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "jetmoe": lambda: hf("JetMoeConfig", "JetMoeForCausalLM", tokens(), vocab_size=VOCAB, hidden_size=16,
                         num_hidden_layers=2, num_key_value_heads=2, kv_channels=4, intermediate_size=32,
                         max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2),
    # language: encoder-decoders
    "t5": lambda: hf("T5Config", "T5ForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                     num_layers=2, num_decoder_layers=2, num_heads=2, decoder_start_token_id=0, pad_token_id=0),
    "bart": lambda: hf("BartConfig", "BartForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                       encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32),
    "pegasus": lambda: hf("PegasusConfig", "PegasusForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                          encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32),
    "marian": lambda: hf("MarianConfig", "MarianMTModel", seq2seq(), vocab_size=VOCAB, d_model=16, encoder_layers=2,
                         decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0, decoder_start_token_id=0),
    "mbart": lambda: hf("MBartConfig", "MBartForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                        encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32),
    "m2m100": lambda: hf("M2M100Config", "M2M100ForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                         encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
                         decoder_start_token_id=2),
    "switch_transformers": lambda: hf("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
                                      seq2seq(), vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                      num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=16,
                                      decoder_start_token_id=0, pad_token_id=0),
    "umt5": lambda: hf("UMT5Config", "UMT5ForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16, d_kv=8,
                       d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
                       pad_token_id=0),
    "longt5": lambda: hf("LongT5Config", "LongT5ForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                         d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, local_radius=2,
                         encoder_attention_type="local", decoder_start_token_id=0, pad_token_id=0),
    "blenderbot": lambda: hf("BlenderbotConfig", "BlenderbotForConditionalGeneration", seq2seq(), vocab_size=VOCAB,
                             d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                             max_position_embeddings=32),
    "plbart": lambda: hf("PLBartConfig", "PLBartForConditionalGeneration", seq2seq(), vocab_size=VOCAB, d_model=16,
                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                         encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32),
    # PEGASUS-X: block-local attention with global tokens, its mask padded to whole blocks
    "pegasus_x": lambda: hf("PegasusXConfig", "PegasusXForConditionalGeneration", seq2seq(), vocab_size=VOCAB,
                            d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                            max_position_embeddings=32, num_global_tokens=4, block_size=4, stagger_local_blocks=True),
    # speech
    "whisper_encoder": lambda: whisper_encoder(),
    "wav2vec2": lambda: hf("Wav2Vec2Config", "Wav2Vec2Model", {"input_values": lambda b: torch.randn(b, 400)},
                           hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                           conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                           num_conv_pos_embedding_groups=2, do_stable_layer_norm=True, feat_extract_norm="layer"),
    "hubert": lambda: hf("HubertConfig", "HubertModel", {"input_values": lambda b: torch.randn(b, 400)},
                         hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                         conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2),
    "wavlm": lambda: hf("WavLMConfig", "WavLMModel", {"input_values": lambda b: torch.randn(b, 400)},
                        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                        num_conv_pos_embedding_groups=2, num_buckets=8, max_bucket_distance=16),
    "ast": lambda: hf("ASTConfig", "ASTForAudioClassification", {"input_values": lambda b: torch.randn(b, 16, 8)},
                      hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, patch_size=4,
                      frequency_stride=4, time_stride=4, max_length=16, num_mel_bins=8, num_labels=5),
    "wav2vec2_conformer": lambda: hf("Wav2Vec2ConformerConfig", "Wav2Vec2ConformerModel",
                                     {"input_values": lambda b: torch.randn(b, 400)}, hidden_size=16,
                                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
                                     conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                     num_conv_pos_embedding_groups=2, position_embeddings_type="relative",
                                     conv_depthwise_kernel_size=3, max_source_positions=64),
    "sew_d": lambda: hf("SEWDConfig", "SEWDModel", {"input_values": lambda b: torch.randn(b, 400)}, hidden_size=16,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
                        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                        num_conv_pos_embedding_groups=2, squeeze_factor=2, max_position_embeddings=64,
                        position_buckets=8),
    "data2vec_audio": lambda: hf("Data2VecAudioConfig", "Data2VecAudioModel",
                                 {"input_values": lambda b: torch.randn(b, 400)}, hidden_size=16,
                                 num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
                                 conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                 num_conv_pos_embedding_groups=2, conv_pos_kernel_size=5),
    # MusicGen's decoder: its batch axis holds batch x codebooks rows (refused at import)
    "musicgen": lambda: hf("MusicgenDecoderConfig", "MusicgenForCausalLM",
                           {"input_ids": lambda b: torch.randint(0, 32, (b * 2, 6))}, vocab_size=32, hidden_size=16,
                           num_hidden_layers=2, num_attention_heads=2, ffn_dim=32, num_codebooks=2,
                           max_position_embeddings=32),
    "speech_to_text": lambda: hf("Speech2TextConfig", "Speech2TextForConditionalGeneration",
                                 {"input_features": lambda b: torch.randn(b, 16, 8),
                                  "decoder_input_ids": lambda b: torch.randint(1, VOCAB, (b, 6))},
                                 vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                 decoder_ffn_dim=32, input_feat_per_channel=8, num_conv_layers=2, conv_channels=16,
                                 conv_kernel_sizes=[5, 5], max_source_positions=32, max_target_positions=32),
    # audio codec: a residual vector quantizer whose straight-through estimator,
    # `z + (q - z).detach()`, the default exporter's optimizer leaves in node metadata only
    "dac": lambda: hf("DacConfig", "DacModel", {"input_values": lambda b: torch.randn(b, 1, 256)},
                      encoder_hidden_size=4, downsampling_ratios=[2, 4], decoder_hidden_size=16, n_codebooks=2,
                      codebook_size=32, codebook_dim=4, hidden_size=32, sampling_rate=8000),
    # vocoder: convolutions with zero biases, which the default exporter's optimizer drops
    # recording only that rewrite (no fold)
    "speecht5_hifigan": lambda: hf("SpeechT5HifiGanConfig", "SpeechT5HifiGan", {"spectrogram": lambda b: torch.randn(b, 6, 8)},
                                   model_in_dim=8, upsample_initial_channel=16, upsample_rates=[2, 2],
                                   upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
                                   normalize_before=False),
    # time series
    "patchtst": lambda: hf("PatchTSTConfig", "PatchTSTForPrediction",
                           {"past_values": lambda b: torch.randn(b, 32, 3)}, num_input_channels=3, context_length=32,
                           patch_length=8, patch_stride=8, prediction_length=8, d_model=16, num_attention_heads=2,
                           num_hidden_layers=2, ffn_dim=32),
    # others
    "mlp_mixer": lambda: (MlpMixer(), image(16)),
    "diffusion_unet": lambda: (DiffusionUNet(), {"sample": lambda b: torch.randn(b, 3, 16, 16),
                                                 "timestep": lambda b: torch.randint(0, 1000, (b,))}),
    "lstm": lambda: (LstmTagger(), tokens(mask=False)),
    "gru": lambda: (GruClassifier(), tokens(mask=False)),
    "bridgetower_vision": lambda: bridgetower_vision(),
    "seggpt": lambda: hf("SegGptConfig", "SegGptModel", {"pixel_values": lambda b: torch.randn(b, 3, 32, 16),
                                                         "prompt_pixel_values": lambda b: torch.randn(b, 3, 32, 16),
                                                         "prompt_masks": lambda b: torch.randn(b, 3, 32, 16)},
                         hidden_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=[64, 16],
                         patch_size=8, mlp_dim=32, intermediate_hidden_state_indices=[0, 1], merge_index=0,
                         decoder_hidden_size=8, pretrain_image_size=32),
    "csm_depth": lambda: hf("CsmDepthDecoderConfig", "CsmDepthDecoderModel",
                            {"input_ids": lambda b: torch.randint(0, 32, (b, 4)),
                             "backbone_last_hidden_state": lambda b: torch.randn(b, 16)},
                            vocab_size=32, backbone_hidden_size=16, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_codebooks=4,
                            max_position_embeddings=8, head_dim=8),
    "mllama_vision": lambda: mllama_vision(),
    "depth_anything": lambda: depth_anything(),
}


def mllama_vision():
    """Mllama's vision encoder: images in tiles, `[N, images, tiles, C, H, W]`, with the
    class embedding expanded to every tile of every sample and a mask over the tiles."""
    from transformers.models.mllama.configuration_mllama import MllamaVisionConfig
    from transformers.models.mllama.modeling_mllama import MllamaVisionModel
    cfg = MllamaVisionConfig(hidden_size=16, num_hidden_layers=2, num_global_layers=1, num_attention_heads=2,
                             intermediate_size=32, vision_output_dim=32, image_size=16, patch_size=8, max_num_tiles=2,
                             intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2]])
    return MllamaVisionModel(cfg), {"pixel_values": lambda b: torch.randn(b, 1, 2, 3, 16, 16),
                                    "aspect_ratio_ids": lambda b: torch.ones(b, 1, dtype=torch.int64),
                                    "aspect_ratio_mask": lambda b: torch.ones(b, 1, 2, dtype=torch.int64)}


def depth_anything():
    """Depth Anything: a DINOv2 backbone, a DPT-style neck and a head that resizes its
    16 x 16 map to the 28 x 28 input (no whole scale)."""
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config
    backbone = Dinov2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2, image_size=28,
                            patch_size=14, out_features=["stage1", "stage2", "stage3", "stage4"],
                            reshape_hidden_states=False)
    cfg = DepthAnythingConfig(backbone_config=backbone, reassemble_hidden_size=16, neck_hidden_sizes=[8, 8, 16, 16],
                              fusion_hidden_size=8, head_hidden_size=8, patch_size=14)
    return DepthAnythingForDepthEstimation(cfg), image(28)


def bridgetower_vision():
    """BridgeTower's vision tower: every layer's output stacked, [L, N, S, D], the batch on
    the second axis (its heads are 64 wide, so the width is 64)."""
    from transformers import BridgeTowerVisionConfig
    from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerVisionModel
    cfg = BridgeTowerVisionConfig(hidden_size=64, num_hidden_layers=3, image_size=16, patch_size=8)
    return BridgeTowerVisionModel(cfg), {"image": lambda b: torch.randn(b, 3, 16, 16)}


def whisper_encoder():
    from transformers import WhisperConfig, WhisperModel
    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=1, d_model=16,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=0,
                        eos_token_id=0, decoder_start_token_id=0)
    return WhisperModel(cfg).encoder, {"input_features": lambda b: torch.randn(b, 8, 16)}


def save(folder, feeds, outputs):
    for k, (name, value) in enumerate(feeds.items()):
        with open(os.path.join(folder, f"input_{k}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(value, name).SerializeToString())
    for k, value in enumerate(outputs):
        with open(os.path.join(folder, f"output_{k}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(np.asarray(value), f"output_{k}").SerializeToString())


def export_one(model, inputs, folder, exporter, batch, dynamic):
    path = os.path.join(folder, "model.onnx")
    names = list(inputs)
    torch.manual_seed(1)
    args = tuple(f(batch) for f in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter.startswith("dynamo"):
            batch_dim = torch.export.Dim("batch", min=1, max=1024)
            shapes = {"args": tuple({0: batch_dim} for _ in names)} if dynamic else None
            torch.onnx.export(model, args, path, dynamo=True, input_names=names, output_names=["output"],
                              dynamic_shapes=shapes, optimize=exporter != "dynamo-noopt")
        else:
            axes = {n: {0: "batch"} for n in names + ["output"]} if dynamic else None
            torch.onnx.export(model, args, path, dynamo=False, input_names=names, output_names=["output"],
                              dynamic_axes=axes)
    onnx.checker.check_model(path)
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    outputs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    save(folder, feeds, outputs)


def root_cause(e):
    """The exception at the bottom of `e`'s chain (the exporter wraps the reason), one line."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    first = " ".join(str(e).split("\n\n")[0].split())
    return f"{type(e).__name__}: {first[:300]}"


def build(arch):
    """The architecture's model (seed 0) wrapped for export, its inputs and parameter count."""
    torch.manual_seed(0)
    model, inputs = ARCHS[arch]()
    params = sum(p.numel() for p in model.parameters())
    return Wrapped(model.eval(), list(inputs)), inputs, params


def export_arch(arch, index, ways):
    model, inputs, params = build(arch)
    for way, exporter, batch, dynamic in WAYS:
        if ways and way not in ways:
            continue
        name = f"{arch}-{way}"
        folder = os.path.join(MODELS, name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        entry = {"name": name, "arch": arch, "exporter": exporter, "batch": "dynamic" if dynamic else f"fixed {batch}",
                 "export_batch": batch, "params": params}
        try:
            export_one(model, inputs, folder, exporter, batch, dynamic)
            entry["external_data"] = os.path.exists(os.path.join(folder, "model.onnx.data"))
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            print(f"{name}: {size} bytes", flush=True)
        except Exception as e:  # the exporter itself cannot export this model: recorded, not ours
            shutil.rmtree(folder, ignore_errors=True)
            entry["exporter_error"] = root_cause(e)
            print(f"{name}: the {exporter} exporter failed: {entry['exporter_error']}", flush=True)
        index[name] = entry


def main():
    args = sys.argv[1:]
    ways = []
    if args[:1] == ["--ways"]:
        ways, args = args[1].split(","), args[2:]
        unknown = [w for w in ways if w not in [w[0] for w in WAYS]]
        if unknown:
            sys.exit(f"make_zoo.py: unknown ways {unknown}; known: {', '.join(w[0] for w in WAYS)}")
    archs = args or list(ARCHS)
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        sys.exit(f"make_zoo.py: unknown architectures {unknown}; known: {', '.join(ARCHS)}")
    index = {}
    if os.path.exists(INDEX):
        index = {e["name"]: e for e in json.load(open(INDEX))["entries"]}
    os.makedirs(MODELS, exist_ok=True)
    for arch in archs:
        export_arch(arch, index, ways)
        entries = [index[k] for k in sorted(index)]
        versions = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__}
        import torchvision
        import transformers
        versions.update(torchvision=torchvision.__version__, transformers=transformers.__version__)
        with open(INDEX, "w") as f:
            json.dump({"generated_by": "zoo/make_zoo.py", "versions": versions, "entries": entries}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
