"""Prefill and decode throughput, stored cache bytes and peak memory of one cache configuration."""
from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx
from tqdm.auto import tqdm

from veloxquant_mlx.apps.eval.forward import DEFAULT_CHUNK, greedy_decode, prefill
from veloxquant_mlx.apps.eval.memory import cache_memory, model_kv_shape
from veloxquant_mlx.apps.eval.specs import CacheSpec


def speed_eval(
    model,
    tokens: Sequence[int],
    spec: CacheSpec,
    context: int,
    decode_tokens: int = 32,
    chunk: int = DEFAULT_CHUNK,
    progress: bool = True,
) -> dict:
    """Prefill ``context`` tokens (chunked), then greedy-decode ``decode_tokens``; JSON-ready dict.

    Memory is read right after the prefill (``context`` tokens stored); ``peak_memory_bytes`` is
    ``mx.get_peak_memory()`` since a reset at the start of this call: the largest total of MLX
    allocations (model weights included) while this configuration ran.
    """
    if context <= 0 or context > len(tokens):
        raise ValueError(f"context must be within [1, {len(tokens)}], got {context}")
    if decode_tokens <= 0:
        raise ValueError(f"decode_tokens must be > 0, got {decode_tokens}")
    n_layers, kv_heads, head_dim = model_kv_shape(model)
    mx.synchronize() if hasattr(mx, "synchronize") else None
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = spec.make_cache(model)
    bar = tqdm(total=context, desc=f"prefill {spec.name}", unit="tok", disable=not progress, leave=False)
    t0 = time.perf_counter()
    logits = prefill(model, tokens[:context], cache, chunk=chunk, progress=bar)
    t_prefill = time.perf_counter() - t0
    bar.close()
    mem = cache_memory(cache, context, kv_heads, head_dim)
    t0 = time.perf_counter()
    gen = greedy_decode(model, logits, cache, decode_tokens)
    t_decode = time.perf_counter() - t0
    return {
        "method": spec.name,
        "context": context,
        "prefill_tokens_per_s": context / t_prefill,
        "decode_tokens": len(gen),
        "decode_tokens_per_s": len(gen) / t_decode,
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "memory": mem,
        "bits_per_coordinate": mem["bits_per_coordinate"],
        "bytes_per_token": mem["bytes_per_token"],
    }
