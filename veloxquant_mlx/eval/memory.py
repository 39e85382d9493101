"""What caches really store: bytes (``nbytes`` of the stored arrays), bytes per token, bits per coordinate.

One measurement of bits per coordinate everywhere: :func:`cache_memory` of the caches holding ``n`` tokens
(every stored byte: codes, scales, norms, exact sink/tail tokens, fitted means; no spare growth capacity),
over the ``n * 2 * kv_heads * head_dim`` cached coordinates of each layer. The evaluation reads it from the
caches after each window; `measure_bytes_per_token` (``veloxquant methods``, the server's start-up log, the
bit-budget tests) fills a fresh cache with random keys/values to ``context`` tokens after its exact sink tokens
(whole blocks) and reads the same function, so every tool reports the same figure for the same configuration and
context.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from veloxquant_mlx.model_shape import local_kv_heads, model_kv_shape
from veloxquant_mlx.validate import check_int

from .specs import resolve_spec

__all__ = ["DEFAULT_CONTEXT", "FILL_CHUNK", "bits_per_coordinate", "cache_memory", "cache_nbytes",
           "measure_bytes_per_token", "measure_footprint", "model_kv_shape", "plan_context", "stored_nbytes"]


def cache_nbytes(cache) -> int:
    """Bytes one layer's cache stores: its ``nbytes`` when implemented, else the sum over ``state``.

    mlx_lm's caches allocate in steps of 256 tokens, so at a token count that is a multiple of
    256 this is exactly the stored data; otherwise it includes the unused tail of the last step.
    """
    try:
        n = cache.nbytes
        if callable(n):
            n = n()
        return int(n)
    except (AttributeError, NotImplementedError):
        pass
    state = getattr(cache, "state", None)
    return sum(int(a.nbytes) for _, a in tree_flatten(state) if isinstance(a, mx.array))


def stored_nbytes(cache) -> int:
    """Bytes of the data one layer's cache holds: ``live_nbytes`` where the cache has it (ours: no spare step
    capacity), else :func:`cache_nbytes` (mlx_lm's caches: exact at multiples of their 256-token step)."""
    live = getattr(cache, "live_nbytes", None)
    return int(live) if live is not None else cache_nbytes(cache)


def bits_per_coordinate(bytes_per_token_layer: float, kv_heads: int, head_dim: int) -> float:
    """bytes*8 over the 2*kv_heads*head_dim coordinates (keys and values) of one layer-token."""
    return bytes_per_token_layer * 8.0 / (2 * kv_heads * head_dim)


def cache_memory(caches: Sequence, n_tokens: int, kv_heads: int, head_dim: int) -> dict:
    """Stored bytes of a per-layer cache list holding ``n_tokens`` tokens (JSON-ready dict): THE measurement
    of bits per coordinate (:func:`stored_nbytes` of every layer over its cached K and V coordinates)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
    per_layer = [stored_nbytes(c) for c in caches]
    total = sum(per_layer)
    per_tok_layer = total / (n_tokens * max(len(caches), 1))
    return {
        "tokens": int(n_tokens),
        "bytes_total": int(total),
        "mib_total": total / 2**20,
        "bytes_per_token": total / n_tokens,
        "bytes_per_token_per_layer": per_tok_layer,
        "bytes_per_layer": per_layer,
        "bits_per_coordinate": bits_per_coordinate(per_tok_layer, kv_heads, head_dim),
    }


def _stub_model(n_layers: int, kv_heads: int, head_dim: int):
    """Just enough of a model for a cache factory: ``layers`` and ``args``."""
    args = SimpleNamespace(
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=kv_heads * head_dim,
        num_hidden_layers=n_layers,
    )
    return SimpleNamespace(layers=[None] * n_layers, args=args, model_type="stub")


# The context `veloxquant methods` and the server report bits at (the budgets are set at 2048 and 4096).
DEFAULT_CONTEXT = 2048
FILL_CHUNK = 256  # tokens per update_and_fetch, as the evaluation's chunked prefill feeds them


def measure_bytes_per_token(
    make_cache,
    kv_heads: int,
    head_dim: int,
    model=None,
    context: int = DEFAULT_CONTEXT,
    seed: int = 0,
    n_layers: int = 1,
) -> dict:
    """Stored bytes per layer of caches holding ``context`` random tokens after their exact sink, measured, not
    computed by formula.

    Fills fresh caches (``make_cache(model)``: every layer of ``model``, or of a stub with ``n_layers`` layers, for
    configurations with bits per layer) with the same random keys/values ``(1, kv_heads, n, head_dim)``: first the
    caches' exact sink tokens (``options.sink``, 0 for mlx_lm's caches), then ``context`` tokens in chunks of 256,
    and reads :func:`cache_memory` at ``sink + context - 256`` and at ``sink + context`` tokens. Blocks start after
    the sink, so at ``sink + context`` a block layout without exact windows (``recent=0, trim_headroom=0``: the
    budget presets) holds whole blocks (between two blocks its newest tokens wait exact: the ripple BENCHMARKS.md
    reports beside this figure). ``bits_per_coordinate`` and
    ``bytes_per_token_per_layer`` are every stored byte at ``sink + context`` tokens (fixed state such as fitted
    means and the exact sink tokens included, as the evaluation counts them); ``marginal_bytes_per_token_per_layer``
    is the growth over the last 256 tokens (what a longer context adds per token) and ``fixed_bytes`` the rest.
    A model's recurrent-state caches (no keys and values per token) are left out; ``layers`` counts the others.
    """
    context = check_int("context", context, 2 * FILL_CHUNK)
    if context % FILL_CHUNK:
        raise ValueError(f"context must be a multiple of {FILL_CHUNK} (mlx_lm's allocation step), got {context}")
    if model is None:
        model = _stub_model(n_layers, kv_heads, head_dim)
    # recurrent-state layers (linear attention, SSM: mlx_lm's ArraysCache) hold no per-token keys and values
    caches = [c for c in make_cache(model) if hasattr(c, "update_and_fetch")]
    if not caches:
        raise ValueError(f"make_cache gave {type(model).__name__} no cache of keys and values to measure")
    for c in caches:
        if hasattr(c, "fetch_placeholders"):  # no attention runs here: let it decode even while routing is on
            c.fetch_placeholders = False
    sink = max((_sink_tokens(c) for c in caches), default=0)
    total = sink + context
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, kv_heads, total, head_dim), key=k1)
    values = mx.random.normal((1, kv_heads, total, head_dim), key=k2)
    before = None
    for s0, s1 in [(0, sink)] * bool(sink) + [(s, s + FILL_CHUNK) for s in range(sink, total, FILL_CHUNK)]:
        mx.eval([c.update_and_fetch(keys[..., s0:s1, :], values[..., s0:s1, :]) for c in caches])
        if s1 == total - FILL_CHUNK:
            before = cache_memory(caches, s1, kv_heads, head_dim)["bytes_total"] / len(caches)
    mem = cache_memory(caches, total, kv_heads, head_dim)
    marginal = (mem["bytes_total"] / len(caches) - before) / FILL_CHUNK
    return {
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "layers": len(caches),  # the layers measured: those that cache keys and values
        "context": context,
        "sink": sink,
        "bytes_per_token_per_layer": mem["bytes_per_token_per_layer"],
        "marginal_bytes_per_token_per_layer": marginal,
        "fixed_bytes": mem["bytes_total"] / len(caches) - marginal * total,
        "bits_per_coordinate": mem["bits_per_coordinate"],
    }


def _sink_tokens(cache) -> int:
    """The exact sink tokens a cache keeps before its codes (our caches' ``options.sink``; 0 for others)."""
    sink = getattr(getattr(cache, "options", None), "sink", 0)
    return sink if isinstance(sink, int) and not isinstance(sink, bool) else 0


def plan_context(bytes_per_token_per_layer: float, n_layers: int, ram_bytes: float) -> int:
    """Longest context whose KV cache fits in ``ram_bytes`` (cache only; weights not counted)."""
    if bytes_per_token_per_layer <= 0:
        raise ValueError("bytes_per_token_per_layer must be > 0")
    if n_layers <= 0:
        raise ValueError(f"n_layers must be > 0, got {n_layers}")
    return int(ram_bytes // (bytes_per_token_per_layer * n_layers))


def measure_footprint(model, make_cache) -> dict:
    """Bytes per token of ``make_cache``'s caches at ``model``'s attention shape, measured by the code of
    ``veloxquant methods`` (`measure_bytes_per_token`), with the plain cache's alongside."""
    n_layers, _, head_dim = model_kv_shape(model)
    kv_heads = local_kv_heads(model)  # this rank's, when the model is sharded
    ours, plain = (measure_bytes_per_token(m, kv_heads, head_dim) for m in (make_cache, resolve_spec("kv").make_cache))
    return dict(ours, layers=n_layers, bytes_per_token=ours["bytes_per_token_per_layer"] * n_layers,
                plain_bytes_per_token=plain["bytes_per_token_per_layer"] * n_layers)
