"""What caches really store: bytes (``nbytes`` of the stored arrays), bytes per token, bits per coordinate.

One rule for bits per coordinate everywhere: :func:`cache_memory` of the caches holding ``n`` tokens (every stored
byte: codes, scales, norms, exact sink tokens, tokens waiting for their block however they are stored, fitted
means; no spare growth capacity), over the ``n * 2 * kv_heads * head_dim`` cached coordinates of each layer, ``n``
counting every token (the sink's too). The evaluation reads it from the caches after each window;
`measure_bytes_per_token` (``veloxquant methods``, the server's start-up log, the bit-budget tests) fills fresh
caches with random keys/values to ``context`` tokens and reads the same function; `measure_bits` reads it at the
lengths the tools report (`REPORT_LENGTHS`: 512, 2048, 3000, which is no block boundary, and 4096) and averages it
over the positions a KL figure averages over (each chunk of the evaluation's chunked prefill attends the cache as
it is after that chunk). So every tool reports the same figure for the same configuration and length, at the
length a user meets, not only at the lengths where a block layout holds whole blocks.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from veloxquant_mlx.integration.model_shape import local_kv_heads, model_kv_shape
from veloxquant_mlx.validate import check_int

from veloxquant_mlx.apps.eval.specs import resolve_spec

__all__ = ["DEFAULT_CONTEXT", "FILL_CHUNK", "REPORT_LENGTHS", "bits_per_coordinate", "cache_memory", "cache_nbytes",
           "measure_bits", "measure_bytes_per_token", "measure_footprint", "model_kv_shape", "plan_context",
           "stored_nbytes"]


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
    # each layer's attention with a standard RoPE: a layout storing keys less their rotated mean (rope_offset)
    # stores that mean here as it does in a model
    layer = SimpleNamespace(self_attn=SimpleNamespace(rope=nn.RoPE(head_dim), head_dim=head_dim))
    return SimpleNamespace(layers=[layer] * n_layers, args=args, model_type="stub")


# The context `veloxquant methods` and the server report bits at (the budgets are set at 2048 and 4096).
DEFAULT_CONTEXT = 2048
FILL_CHUNK = 256  # tokens per update_and_fetch, as the evaluation's chunked prefill feeds them
# The lengths bits are reported at (`measure_bits`): round lengths, and 3000, which is no multiple of a block.
REPORT_LENGTHS = (512, 2048, 3000, 4096)


def _fill_caches(make_cache, kv_heads: int, head_dim: int, model, n_layers: int, total: int, seed: int,
                 stops, chunk: int = FILL_CHUNK):
    """Fresh caches filled with ``total`` random tokens in chunks of ``chunk`` from token 0 (as the evaluation's
    prefill), cut also at ``stops``; yields ``(caches, tokens held)`` after every update."""
    if model is None:
        model = _stub_model(n_layers, kv_heads, head_dim)
    # recurrent-state layers (linear attention, SSM: mlx_lm's ArraysCache) hold no per-token keys and values
    caches = [c for c in make_cache(model) if hasattr(c, "update_and_fetch")]
    if not caches:
        raise ValueError(f"make_cache gave {type(model).__name__} no cache of keys and values to measure")
    for c in caches:
        if hasattr(c, "fetch_placeholders"):  # no attention runs here: let it decode even while routing is on
            c.fetch_placeholders = False
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, kv_heads, total, head_dim), key=k1)
    values = mx.random.normal((1, kv_heads, total, head_dim), key=k2)
    cuts = sorted({n for n in range(chunk, total, chunk)} | {n for n in stops if 0 < n < total} | {total})
    s0 = 0
    for s1 in cuts:
        mx.eval([c.update_and_fetch(keys[..., s0:s1, :], values[..., s0:s1, :]) for c in caches])
        yield caches, s1
        s0 = s1


def measure_bits(make_cache, kv_heads: int, head_dim: int, model=None, lengths=REPORT_LENGTHS, seed: int = 0,
                 n_layers: int = 1, chunk: int = FILL_CHUNK) -> dict:
    """Bits per coordinate of ``make_cache``'s caches, every stored byte (`cache_memory`), measured on one fill of
    random tokens (chunks of ``chunk`` from token 0, as the evaluation feeds a window):

    - ``bits[n]``: holding exactly ``n`` tokens, for each ``n`` of ``lengths``;
    - ``kl_average_bits[n]``: the average over the positions of an ``n``-token evaluation window (what a KL figure
      at context ``n`` averages over): each chunk's positions attend the cache as it is after that chunk, so the
      bits after each chunk, weighted by its positions;
    - ``max_bits[n]``: the most held after any chunk up to ``n``.
    """
    lengths = sorted({check_int("length", n, 1) for n in lengths})
    check_int("chunk", chunk, 1)
    bits, after = {}, []  # (tokens after a chunk, bits then)
    n_layers_measured = 0
    for caches, n in _fill_caches(make_cache, kv_heads, head_dim, model, n_layers, lengths[-1], seed, lengths, chunk):
        b = cache_memory(caches, n, kv_heads, head_dim)["bits_per_coordinate"]
        after.append((n, b))
        n_layers_measured = len(caches)
        if n in lengths:
            bits[n] = b
    kl_avg, worst = {}, {}
    for n in lengths:
        # the evaluation's own chunks of an n-token window: ends at multiples of `chunk` and at n
        ends = sorted({e for e in range(chunk, n, chunk)} | {n})
        held = dict(after)
        starts = [0] + ends[:-1]
        kl_avg[n] = sum((e - s) * held[e] for s, e in zip(starts, ends)) / n
        worst[n] = max(held[e] for e in ends)
    return {"kv_heads": kv_heads, "head_dim": head_dim, "layers": n_layers_measured, "chunk": chunk,
            "bits": bits, "kl_average_bits": kl_avg, "max_bits": worst}


def measure_bytes_per_token(
    make_cache,
    kv_heads: int,
    head_dim: int,
    model=None,
    context: int = DEFAULT_CONTEXT,
    seed: int = 0,
    n_layers: int = 1,
) -> dict:
    """Stored bytes per layer of caches holding ``context`` random tokens (the sink's counted among them), measured,
    not computed by formula.

    Fills fresh caches (``make_cache(model)``: every layer of ``model``, or of a stub with ``n_layers`` layers, for
    configurations with bits per layer) with the same random keys/values ``(1, kv_heads, n, head_dim)`` in chunks of
    256 from token 0 (as the evaluation feeds a window), and reads :func:`cache_memory` at ``context - 256`` and at
    ``context`` tokens: whatever the cache holds at that length, its newest tokens waiting for their block included
    (the same figure `measure_bits` reports; any ``context`` >= 512, a block boundary or not).
    ``bits_per_coordinate`` and ``bytes_per_token_per_layer`` are every stored byte at ``context`` tokens (fixed
    state such as fitted means and the exact sink tokens included, as the evaluation counts them);
    ``marginal_bytes_per_token_per_layer`` is the growth over the last 256 tokens (what a longer context adds per
    token) and ``fixed_bytes`` the rest. A model's recurrent-state caches (no keys and values per token) are left
    out; ``layers`` counts the others.
    """
    context = check_int("context", context, 2 * FILL_CHUNK)
    before, mem, caches = None, None, []
    for caches, n in _fill_caches(make_cache, kv_heads, head_dim, model, n_layers, context, seed,
                                  [context - FILL_CHUNK]):
        if n == context - FILL_CHUNK:
            before = cache_memory(caches, n, kv_heads, head_dim)["bytes_total"] / len(caches)
    sink = max((_sink_tokens(c) for c in caches), default=0)
    total = context
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
