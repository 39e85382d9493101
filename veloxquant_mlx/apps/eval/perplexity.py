"""Perplexity, KL divergence and top-1 agreement of cache configurations against a reference cache.

Windows (`window_tokens`): window ``i`` feeds ``context`` tokens starting at corpus token ``i*context``. A window
starts as the model expects a text to: with the tokenizer's prefix (its BOS, ``tokens.prefix`` of
`veloxquant_mlx.apps.eval.corpus_tokens`; none for SmolLM2's tokenizer, ``<bos>`` for Gemma's), which is fed, never
scored: window ``i`` feeds ``prefix + corpus[i*context : (i+1)*context - len(prefix)]`` and scores the
predictions of the corpus tokens ``corpus[i*context + (0 if prefix else 1) : (i+1)*context - len(prefix) + 1]``
(without a prefix: feeds ``[i*context, (i+1)*context)``, predicts ``[i*context+1, (i+1)*context+1)``). So every
window is exactly ``context`` tokens and windows of one context never overlap. All caches see the same window in chunks of ``chunk`` tokens (prefill
chunks and cache growth through ``update_and_fetch``), in lockstep with the reference: the
logits of one chunk are compared in float32 and dropped, never a whole window's logits.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
from tqdm.auto import tqdm

from veloxquant_mlx.apps.eval.forward import DEFAULT_CHUNK
from veloxquant_mlx.apps.eval.memory import cache_memory, model_kv_shape
from veloxquant_mlx.apps.eval.specs import CacheSpec, baseline_specs


def window_starts(n_tokens: int, context: int, n_windows: int) -> List[int]:
    """Token offsets of the evaluation windows; raises if the corpus is too short."""
    if context <= 1:
        raise ValueError(f"context must be > 1, got {context}")
    if n_windows <= 0:
        raise ValueError(f"n_windows must be > 0, got {n_windows}")
    need = n_windows * context + 1
    if n_tokens < need:
        raise ValueError(
            f"corpus has {n_tokens} tokens; {n_windows} windows of context {context} need {need}"
        )
    return [i * context for i in range(n_windows)]


def window_tokens(tokens: Sequence[int], start: int, context: int, prefix: Optional[Sequence[int]] = None):
    """``(inputs, targets, skip)`` of the window at corpus offset ``start``: ``inputs`` ``(1, context)`` int32, the
    prefix (``prefix``, by default ``tokens.prefix``: the tokenizer's BOS when it adds one) then corpus tokens;
    ``targets`` ``(context,)``: the next token of each input position; the first ``skip`` positions (inside a
    prefix of more than one token) predict prefix tokens and are not scored."""
    prefix = tuple(getattr(tokens, "prefix", ()) if prefix is None else prefix)
    p = len(prefix)
    if p >= context:
        raise ValueError(f"context {context} leaves no room after the {p}-token prefix")
    body = list(tokens[start : start + context - p + 1])  # the corpus tokens fed, and the one after the last
    if len(body) != context - p + 1:
        raise ValueError(f"window at {start} of context {context} runs past the corpus's {len(tokens)} tokens")
    skip = max(p - 1, 0)
    inputs = list(prefix) + body[:-1]
    targets = [0] * skip + (body if p else body[1:])
    return mx.array(inputs, dtype=mx.int32)[None], mx.array(targets, dtype=mx.int32), skip


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _chunk_stats(ref_logp: mx.array, logp: mx.array, targets: mx.array):
    """Sums over one chunk: NLL of targets, KL(ref || test), top-1 agreements. Shapes (L, V), (L,)."""
    nll = -mx.take_along_axis(logp, targets[:, None], axis=-1).sum()
    kl = (mx.exp(ref_logp) * (ref_logp - logp)).sum()
    agree = (mx.argmax(logp, axis=-1) == mx.argmax(ref_logp, axis=-1)).sum()
    return nll, kl, agree


def perplexity_eval(
    model,
    tokens: Sequence[int],
    specs: Sequence[CacheSpec],
    context: int,
    n_windows: int = 1,
    chunk: int = DEFAULT_CHUNK,
    reference: Optional[CacheSpec] = None,
    progress: bool = True,
    prefix: Optional[Sequence[int]] = None,
) -> Dict[str, dict]:
    """Per spec name: ``ppl``, ``delta_ppl`` (vs reference), ``kl`` (nats/token), ``top1``, counts,
    and ``memory`` (:func:`cache_memory` of that cache holding one full window).

    ``reference`` defaults to mlx_lm's plain ``KVCache``; a spec with the reference's name
    reuses the reference pass (KL 0, top-1 1.0) instead of running twice. ``prefix``: what each window starts
    with, unscored (`window_tokens`; default ``tokens.prefix``, the tokenizer's BOS when it adds one).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    reference = reference or baseline_specs()[0]
    starts = window_starts(len(tokens), context, n_windows)
    others = [s for s in specs if s.name != reference.name]
    acc = {s.name: {"nll": 0.0, "kl": 0.0, "agree": 0} for s in others}
    ref_nll, n = 0.0, 0
    bar = tqdm(
        total=len(starts) * context,
        desc=f"ppl ctx={context} ({len(others) + 1} caches)",
        unit="tok",
        disable=not progress,
        leave=False,
    )
    for start in starts:
        inp, tgt, skip = window_tokens(tokens, start, context, prefix)
        ref_cache = reference.make_cache(model)
        caches = {s.name: s.make_cache(model) for s in others}
        for s0 in range(0, context, chunk):
            x, y = inp[:, s0 : s0 + chunk], tgt[s0 : s0 + chunk]
            lo = max(skip - s0, 0)  # positions inside a multi-token prefix: fed, not scored
            if lo:
                y = y[lo:]
            ref_logp = _log_softmax(model(x, cache=ref_cache)[0][lo:])
            r_nll = -mx.take_along_axis(ref_logp, y[:, None], axis=-1).sum()
            stats = {}
            for s in others:
                logp = _log_softmax(model(x, cache=caches[s.name])[0][lo:])
                stats[s.name] = _chunk_stats(ref_logp, logp, y)
            mx.eval(r_nll, stats)
            ref_nll += r_nll.item()
            for name, (a, b, c) in stats.items():
                acc[name]["nll"] += a.item()
                acc[name]["kl"] += b.item()
                acc[name]["agree"] += int(c.item())
            n += int(y.shape[0])
            bar.update(int(y.shape[0]))
        # stored bytes after the last window (all `context` tokens in the cache)
        _, kv_heads, head_dim = model_kv_shape(model)
        memory = {name: cache_memory(c, context, kv_heads, head_dim) for name, c in caches.items()}
        memory[reference.name] = cache_memory(ref_cache, context, kv_heads, head_dim)
        del ref_cache, caches
    bar.close()

    ref_ppl = math.exp(ref_nll / n)
    common = {"context": context, "windows": len(starts), "tokens": n, "chunk": chunk, "reference": reference.name}
    out = {reference.name: dict(common, ppl=ref_ppl, nll=ref_nll / n, delta_ppl=0.0, kl=0.0, top1=1.0,
                                memory=memory[reference.name])}
    for s in others:
        a = acc[s.name]
        ppl = math.exp(a["nll"] / n)
        out[s.name] = dict(
            common, ppl=ppl, nll=a["nll"] / n, delta_ppl=ppl - ref_ppl, kl=a["kl"] / n, top1=a["agree"] / n,
            memory=memory[s.name],
        )
    # keep the caller's order
    return {s.name: out[s.name] for s in specs if s.name in out} | (
        {} if reference.name in {s.name for s in specs} else {reference.name: out[reference.name]}
    )


def perplexity_full_forward(model, tokens: Sequence[int], context: int, n_windows: int = 1,
                            prefix: Optional[Sequence[int]] = None) -> float:
    """Perplexity of the same windows (`window_tokens`) from one cache-free forward pass per window (a cross-check)."""
    starts = window_starts(len(tokens), context, n_windows)
    nll, n = 0.0, 0
    for start in starts:
        inp, tgt, skip = window_tokens(tokens, start, context, prefix)
        logp = _log_softmax(model(inp)[0][skip:])
        s = -mx.take_along_axis(logp, tgt[skip:, None], axis=-1).sum()
        nll += s.item()
        n += context - skip
    return math.exp(nll / n)
