"""Tiny random configurations of every architecture the installed mlx_lm ships (the data lives in
``tiny_configs.json`` beside this file: generated once from hand-written, validated configurations).

Key: the module name under ``mlx_lm.models``; value: what its ``ModelArgs.from_dict`` takes (as a config.json holds).
Each is small (hidden 64-128, 2-6 layers, vocabulary 128, head_dim 32 or 64 where the architecture lets it be
chosen) but keeps every layer kind its architecture has: sliding windows of 16 tokens (so an 80-token prompt
evicts), chunked attention, layers sharing another layer's keys and values, MLA latents, SSM / linear-attention
layers beside attention, MoE beside dense layers. `veloxquant_mlx.apps.eval.architectures` builds and checks them.
"""
import json
from pathlib import Path

# Architectures that need something this configuration cannot give: module -> why.
NEEDS = {
    "olmo": "the ai2-olmo package (mlx_lm's olmo imports hf_olmo)",
    "bitnet": "Metal (its BitLinear layers run an mx.fast.metal_kernel)",
    "muse_spark": "Metal (its attention and routing run mlx_lm.kernels' Metal kernels)",
}
METAL_ONLY = ("bitnet", "muse_spark")

# module name -> its config.json dict, in alphabetical order (one line each in the JSON file)
CONFIGS = json.loads((Path(__file__).with_name("tiny_configs.json")).read_text())
