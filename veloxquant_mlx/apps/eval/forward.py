"""Forward passes through an mlx_lm model with a cache: chunked prefill, last-token logits, greedy decode."""
from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
from mlx_lm.models.llama import Model as LlamaModel

DEFAULT_CHUNK = 256


def _is_llama(model) -> bool:
    return isinstance(model, LlamaModel)


def last_logits(model, inputs: mx.array, cache) -> mx.array:
    """Logits of the last position only: ``inputs (B, L)`` -> ``(B, V)`` float32.

    For mlx_lm llama models the vocabulary projection is applied to the last hidden state only
    (it is ~20% of a prefill's FLOPs on SmolLM2); other models run whole and are sliced.
    """
    if _is_llama(model):
        h = model.model(inputs, cache)[:, -1:, :]
        if model.args.tie_word_embeddings:
            out = model.model.embed_tokens.as_linear(h)
        else:
            out = model.lm_head(h)
    else:
        out = model(inputs, cache=cache)[:, -1:, :]
    return out[:, 0, :].astype(mx.float32)


def prefill(model, tokens: Sequence[int], cache, chunk: int = DEFAULT_CHUNK, progress=None) -> mx.array:
    """Feed ``tokens`` through ``cache`` in chunks; returns the last position's logits ``(V,)``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    if len(tokens) == 0:
        raise ValueError("tokens must not be empty")
    x = mx.array(list(tokens), dtype=mx.int32)[None]
    logits = None
    for s in range(0, x.shape[1], chunk):
        logits = last_logits(model, x[:, s : s + chunk], cache)
        mx.eval(logits)
        if progress is not None:
            progress.update(min(chunk, x.shape[1] - s))
    return logits[0]


def greedy_decode(model, first_logits: mx.array, cache, n_tokens: int, eos_ids=()) -> List[int]:
    """Greedy continuation of ``n_tokens`` after a prefill whose last logits are ``first_logits (V,)``."""
    out: List[int] = []
    eos = set(int(e) for e in eos_ids)
    y = mx.argmax(first_logits, axis=-1)
    for _ in range(n_tokens):
        t = int(y.item())
        out.append(t)
        if t in eos:
            break
        logits = last_logits(model, mx.array([[t]], dtype=mx.int32), cache)
        y = mx.argmax(logits[0], axis=-1)
    return out
