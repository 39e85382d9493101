"""Helpers of the calibration tests (tests/integration/): the tiny model with skewed key channels."""
from __future__ import annotations

import mlx.core as mx
import numpy as np


def _skewed_copy(model, factor: float = 8.0):
    """The tiny model with keys (and values) of 16 channels per head scaled up by ``factor`` and the matching
    queries (output-projection columns) scaled down: the same function (scores and outputs unchanged up to
    rounding), but keys whose energy sits where the queries do not look, as real models' outlier channels."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model

    new = Model(model.args)
    new.load_weights(list(tree_flatten(model.parameters())))
    d = model.args.head_dim
    chans = np.zeros(d, dtype=np.float32)
    chans[list(range(0, 8)) + list(range(d // 2, d // 2 + 8))] = 1  # both channels of 8 RoPE pairs
    up = mx.array(1 + (factor - 1) * chans)[:, None]  # (d, 1) per output row of a head
    for layer in new.layers:
        at = layer.self_attn
        hq, hkv = model.args.num_attention_heads, model.args.num_key_value_heads
        at.k_proj.weight = at.k_proj.weight * mx.tile(up, (hkv, 1))
        at.q_proj.weight = at.q_proj.weight / mx.tile(up, (hq, 1))
        at.v_proj.weight = at.v_proj.weight * mx.tile(up, (hkv, 1))
        at.o_proj.weight = at.o_proj.weight / mx.tile(up.T, (1, hq))
    mx.eval(new.parameters())
    new.eval()
    return new

