"""What caches really store: bytes (``nbytes`` of the stored arrays), bytes per token, bits per coordinate."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten


def model_kv_shape(model) -> Tuple[int, int, int]:
    """(n_layers, kv_heads, head_dim) of an mlx_lm model (from ``model.args``)."""
    args = model.args
    n_layers = len(model.layers)
    heads = int(args.num_attention_heads)
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return n_layers, kv_heads, int(head_dim)


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


def bits_per_coordinate(bytes_per_token_layer: float, kv_heads: int, head_dim: int) -> float:
    """bytes*8 over the 2*kv_heads*head_dim coordinates (keys and values) of one layer-token."""
    return bytes_per_token_layer * 8.0 / (2 * kv_heads * head_dim)


def cache_memory(caches: Sequence, n_tokens: int, kv_heads: int, head_dim: int) -> dict:
    """Stored bytes of a per-layer cache list holding ``n_tokens`` tokens (JSON-ready dict)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
    per_layer = [cache_nbytes(c) for c in caches]
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


def measure_bytes_per_token(
    make_cache,
    kv_heads: int,
    head_dim: int,
    model=None,
    tokens: Tuple[int, int] = (256, 512),
    seed: int = 0,
) -> dict:
    """Marginal stored bytes per token of one layer's cache, measured, not computed by formula.

    Fills a fresh cache with random keys/values ``(1, kv_heads, n, head_dim)`` to ``tokens[0]``
    then ``tokens[1]`` tokens and reads ``nbytes`` each time; the difference over the extra tokens
    is the per-token cost (fixed per-cache state such as rotation matrices cancels out; it is
    reported as ``fixed_bytes``). Both counts are multiples of mlx_lm's 256-token step.
    """
    t0, t1 = tokens
    if not 0 < t0 < t1:
        raise ValueError(f"tokens must be two increasing positive counts, got {tokens}")
    if model is None:
        model = _stub_model(1, kv_heads, head_dim)
    cache = make_cache(model)[0]
    if hasattr(cache, "fetch_placeholders"):  # no attention runs here: let it decode even while routing is on
        cache.fetch_placeholders = False
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    keys = mx.random.normal((1, kv_heads, t1, head_dim), key=k1)
    values = mx.random.normal((1, kv_heads, t1, head_dim), key=k2)
    out = cache.update_and_fetch(keys[..., :t0, :], values[..., :t0, :])
    mx.eval(out)
    b0 = cache_nbytes(cache)
    out = cache.update_and_fetch(keys[..., t0:, :], values[..., t0:, :])
    mx.eval(out)
    b1 = cache_nbytes(cache)
    per_token = (b1 - b0) / (t1 - t0)
    return {
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "bytes_per_token_per_layer": per_token,
        "fixed_bytes": b1 - per_token * t1,
        "bits_per_coordinate": bits_per_coordinate(per_token, kv_heads, head_dim),
    }


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
    from veloxquant_mlx.distributed import local_kv_heads
    from veloxquant_mlx.eval.specs import resolve_spec

    n_layers, _, head_dim = model_kv_shape(model)
    kv_heads = local_kv_heads(model)  # this rank's, when the model is sharded
    ours, plain = (measure_bytes_per_token(m, kv_heads, head_dim) for m in (make_cache, resolve_spec("kv").make_cache))
    return dict(ours, layers=n_layers, bytes_per_token=ours["bytes_per_token_per_layer"] * n_layers,
                plain_bytes_per_token=plain["bytes_per_token_per_layer"] * n_layers)
