"""Compressed caches on models sharded with ``mx.distributed`` (tensor or pipeline parallel, as mlx_lm shards them).

Nothing here communicates: mlx_lm's sharded models do that. Each rank's caches hold only its own KV heads (tensor
parallel: ``model.shard(group)`` splits q/k/v by heads) or its own layers (pipeline parallel:
``model.model.pipeline(group)``); the caches read the head count from the tensors, and their rotations and
codebooks are seeded, so every rank draws the same ones. `shard` adds the checks mlx_lm leaves out (a head count
that does not divide by the ranks would otherwise split a head across ranks), `rank_summary` is the line each
rank logs at start-up.
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx

from veloxquant_mlx.apps.eval.memory import measure_bytes_per_token
from veloxquant_mlx.integration.model_shape import attention_heads, local_kv_heads, model_kv_shape

__all__ = ["local_kv_heads", "rank_summary", "shard"]


def shard(model, group: Optional[mx.distributed.Group] = None, *, pipeline: bool = False):
    """Shard ``model`` over ``group`` (default: the launched world) as mlx_lm does; returns ``model``.

    Tensor parallel by default (each rank keeps ``n_kv_heads / N`` KV heads); ``pipeline=True`` gives each rank a
    slice of the layers. One rank: nothing to do. Raises ValueError when the model cannot be split that way.
    """
    group = group or mx.distributed.init()
    n = group.size()
    if n == 1:
        return model
    if pipeline:
        inner = getattr(model, "model", None)
        if not callable(getattr(inner, "pipeline", None)):
            raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} has no pipeline "
                             "parallelism in mlx_lm (no model.model.pipeline); run without --pipeline (tensor parallel)")
        if len(inner.layers) < n:
            raise ValueError(f"pipeline parallelism over {n} ranks needs at least {n} layers, the model has "
                             f"{len(inner.layers)}")
        inner.pipeline(group)
        mx.eval(model.parameters())  # materialize this rank's share now (see below)
        return model
    if not callable(getattr(model, "shard", None)):
        raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} has no tensor "
                         "parallelism in mlx_lm (no model.shard); try --pipeline")
    heads, kv = attention_heads(model)
    if heads is None or heads % n or kv % n:
        raise ValueError(f"tensor parallelism over {n} ranks splits attention heads across ranks: the model has "
                         f"{heads} query and {kv} KV heads, which must both divide by {n}; launch a number of ranks "
                         f"that divides {kv}, or use --pipeline")
    model.shard(group)
    # The shards are lazy slices of the full weights: evaluate them here, so that the arrays another thread
    # (mlx_lm's generation thread) reads carry no graph tied to this thread's stream, and the full weights go.
    mx.eval(model.parameters())
    return model


def rank_summary(model, make_cache, group: Optional[mx.distributed.Group] = None) -> str:
    """``rank r/N: <what it holds>, KV bytes per token <measured>`` for this rank's share of ``model``.

    ``make_cache(model) -> list`` builds this rank's caches (the bytes are measured by filling one layer's cache).
    """
    group = group or mx.distributed.init()
    n_layers = len(model.layers)
    head_dim = model_kv_shape(model)[2]
    heads = local_kv_heads(model)
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        what = f"pipeline parallel, layers {inner.start_idx}..{inner.end_idx - 1} ({n_layers}), {heads} KV heads"
    elif group.size() > 1:
        what = f"tensor parallel, {heads} of {attention_heads(model)[1]} KV heads, {n_layers} layers"
    else:
        what = f"{heads} KV heads, {n_layers} layers"
    m = measure_bytes_per_token(make_cache, heads, head_dim, model=model)
    # a hybrid model's linear-attention / SSM layers keep no keys and values: only m["layers"] grow per token
    per_layer = m["bytes_per_token_per_layer"]
    return (f"rank {group.rank()}/{group.size()}: {what}; KV bytes per token {per_layer * m['layers']:.0f} "
            f"({per_layer:.1f} per layer)")
