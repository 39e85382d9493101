"""Real models' per-layer shapes with random weights, built with mlx_lm's own model classes (for `e2e_speed.py
--shape`): the attention and MLP dimensions of each model, few layers (``layers``) and a small vocabulary, so that
per layer the ratio of weight bytes to KV bytes is the full model's (the embedding / LM head, whose share a small
vocabulary removes, is left out of that ratio: it is the same for every cache).

    from _shapes import SHAPES, build_shape_model
    model, info = build_shape_model("qwen2.5-1.5b", layers=2, weights="q4")
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# name -> (mlx_lm model module, ModelArgs fields besides num_hidden_layers / vocab_size)
SHAPES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000,
                                   tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000,
                                   tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000,
                                   tie_word_embeddings=True)),  # (head_dim = 1536 / 12 = 128)
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000,
                               max_position_embeddings=40960, tie_word_embeddings=True)),
    "mistral-7b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000,
                                 tie_word_embeddings=False)),
    "gemma-3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                                       num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
                                       query_pre_attn_scalar=256, rope_theta=1000000, rope_local_base_freq=10000,
                                       sliding_window=512, sliding_window_pattern=6)),
    "phi-3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000,
                                tie_word_embeddings=False)),  # (head_dim = 3072 / 32 = 96)
}
WEIGHTS = ("q4", "float32", "bfloat16")
Q4_GROUP = 64  # nn.quantize's group size for --weights q4 (mlx_lm's default for converted models)


def shape_names(arg: str):
    """``"all"`` or a comma list -> shape names (ValueError naming the known ones)."""
    names = list(SHAPES) if arg == "all" else [s for s in arg.split(",") if s]
    bad = [s for s in names if s not in SHAPES]
    if bad or not names:
        raise ValueError(f"--shape: unknown {bad or arg!r}; known: {', '.join(SHAPES)} or 'all'")
    return names


def shape_args(name: str, layers: int, vocab: int) -> Tuple[str, Dict[str, Any]]:
    """``(module, config dict)`` of shape ``name`` with ``layers`` layers and a ``vocab``-token vocabulary.

    gemma-3-1b: its sliding-window pattern (5 sliding layers, then 1 global) is kept when ``layers >= 6``; with
    fewer layers it becomes ``layers`` (the last layer global, the others sliding), so that both kinds are present.
    """
    module, fields = SHAPES[name]
    cfg = {"model_type": module, "num_hidden_layers": layers, "vocab_size": vocab, **fields}
    if module == "gemma3_text":
        if layers < 2:
            raise ValueError("gemma-3-1b needs --layers >= 2 (a sliding and a global layer)")
        cfg["sliding_window_pattern"] = min(fields["sliding_window_pattern"], layers)
    return module, cfg


def build_shape_model(name: str, layers: int = 2, weights: str = "q4", vocab: int = 1024, seed: int = 0):
    """``(model, info)``: mlx_lm's ``Model(ModelArgs.from_dict(cfg))`` of shape ``name``, random weights (MLX's
    default initialisation, seeded), cast to ``weights`` (``float32`` / ``bfloat16``) or 4-bit quantized by
    ``nn.quantize`` (group 64, the rest float32), evaluated. ``info``: the config and sizes, for the JSON."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {WEIGHTS}, got {weights!r}")
    module, cfg = shape_args(name, layers, vocab)
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    if weights == "bfloat16":
        model.set_dtype(mx.bfloat16)
    elif weights == "q4":
        nn.quantize(model, group_size=Q4_GROUP, bits=4)
    mx.eval(model.parameters())
    a = model.args
    n_q, n_kv = a.num_attention_heads, a.num_key_value_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // n_q
    params = tree_flatten(model.parameters())
    layer_bytes = sum(v.nbytes for k, v in params if k.startswith(("model.layers.", "layers.")))
    total_bytes = sum(v.nbytes for _, v in params)
    kinds = []
    for i in range(layers):
        if module == "gemma3_text":
            kinds.append("global" if i % cfg["sliding_window_pattern"] == cfg["sliding_window_pattern"] - 1
                         else f"sliding({cfg['sliding_window']})")
        else:
            kinds.append("global")
    info = {"shape": name, "module": module, "config": cfg, "weights": weights,
            "weights_note": {"q4": f"nn.quantize group {Q4_GROUP}, 4 bits (Linear and Embedding), norms float32",
                             "float32": "float32", "bfloat16": "bfloat16 (model.set_dtype)"}[weights],
            "heads": n_q, "kv_heads": n_kv, "head_dim": head_dim, "layers": layers, "layer_kinds": kinds,
            "vocab": vocab, "layer_weight_bytes": layer_bytes, "weight_bytes": total_bytes,
            # bytes of one token's keys and values in one layer, float16 (mlx_lm's KVCache holds the model's dtype)
            "kv_bytes_per_token_layer_fp16": 2 * n_kv * head_dim * 2}
    return model, info


def kv_dtype_of(model):
    """The dtype the model's keys / values come out in (its first float parameter's; q4 keeps scales float32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        if v.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return v.dtype
    return mx.float32
