"""Attention computed directly on packed KV codes.

Pure math lives in :mod:`~veloxquant_mlx.attention.packed_sdpa`; the routing state the caches read (`is_active`,
`placeholder_history`, `implements_protocol`) in :mod:`~veloxquant_mlx.attention.hook`. The routing of mlx_lm's
attention itself (``use_packed_attention``, ``install`` / ``uninstall``, ``routes_model``) is
:mod:`veloxquant_mlx.integration`. Nothing is patched at import time.

The packed-attention protocol (what a cache implements to be routed by the hook)
--------------------------------------------------------------------------------
``cache.attend_packed(queries, scale, mask, sinks=None) -> mx.array``

- called by mlx_lm's ``scaled_dot_product_attention`` (replaced inside ``use_packed_attention``) right
  after the layer's ``cache.update_and_fetch(keys, values)``, i.e. the cache already holds this step's
  tokens;
- ``queries``: ``(B, Hq, L, d)``, the layer's (RoPE'd) queries, ``Hq`` a multiple of the cache's KV heads;
- ``scale``: float; ``mask``: None, ``"causal"``, or a bool / additive array broadcastable to
  ``(B, Hq, L, N)`` over the N cached tokens in temporal order (what the cache's ``make_mask`` built);
- ``sinks``: optional ``(Hq,)`` attention-sink logits; the hook passes it only when it is not None;
- returns ``(B, Hq, L, dv)`` in ``queries.dtype`` = softmax(scale q k^T + mask) v over the whole history.

While `is_active()` is True the cache's ``update_and_fetch`` may return `placeholder_history` tensors
of the right shape instead of dequantizing its history (the routing never reads them for protocol caches),
provided the model's attention really goes through mlx_lm's function: ``integration.routes_model(model)`` /
``integration.attention_is_routable(model)`` check that (a few mlx_lm model files call
``mx.fast.scaled_dot_product_attention`` directly).
Caches without ``attend_packed`` go through the original mlx_lm function unchanged.

A cache implements the method in one line: ``packed_attention(queries, self.attention_parts(), scale, mask,
sinks=sinks)``, where ``attention_parts()`` lists its history as `ExactPart` / `CodedPart` (codes of any codec
of :mod:`veloxquant_mlx.codecs`) in temporal order.
"""
from veloxquant_mlx.attention.hook import implements_protocol, is_active, placeholder_history
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, coded_attention, packed_attention

__all__ = [
    "CodedPart",
    "ExactPart",
    "coded_attention",
    "implements_protocol",
    "is_active",
    "packed_attention",
    "placeholder_history",
]
