"""Attention for one layer straight from a compressed KV cache: at decode, no dequantized copy of the history.

Pure functions that name no codec. The history is a sequence of *parts* in temporal order (the order of the
mask's key axis):

- `ExactPart(keys, values)`: full-precision tokens ``(B, Hkv, n, d)`` (an exact sink or recent window);
- `CodedPart(k_codec, k_arrays, v_codec, v_arrays)`: tokens stored by codecs of the contract
  (:class:`veloxquant_mlx.codecs.Codec`), which score queries against their codes (``scores``) and sum weighted
  values from them (``weighted_sum``) themselves.

Every part is scored (in log2 units: the query carries ``scale / ln 2``) and the parts share one softmax: one
max over all of them, then each part exponentiates its own scores with `exp2_nonpositive` (plain elementwise
ops, several times cheaper than ``mx.exp`` on CPU) and aggregates its own values, so no score or weight tensor
of the whole history is ever concatenated or sliced. A per-head vector every decoded value carries (a codec's
``decoded_offset``, e.g. a centring mean) is added once with the total weight when all coded parts share it.
Optional per-head attention-sink logits join the denominator. Softmax math is float32.

Long query chunks (prefill) whose rows exceed the codecs' packed crossover are attended over the history decoded
once, `query_block` positions at a time (`_blocked_attention`): bounded score memory.

Shapes: queries ``(B, Hq, L, d)`` with ``Hq = R * Hkv`` (GQA: queries are grouped as ``(B, Hkv, R*L, d)`` so
every matmul is a plain batched one and the codes are never broadcast); output ``(B, Hq, L, dv)`` in the
queries' dtype. Masks follow `mx.fast.scaled_dot_product_attention`: None, ``"causal"`` (queries are the
last L of the N keys: chunked prefill with an offset), a bool array (True = attend) or an additive float
array, broadcastable to ``(B, Hq, L, N)``; sliding windows arrive as such arrays (mlx_lm's masks).

This module holds the entry points, the tunables that route between their paths and the shared-max softmax;
the parts and what is computed on each one (masks, scores, weighted values) are in
:mod:`veloxquant_mlx.attention.parts`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from veloxquant_mlx.attention import kernel
from veloxquant_mlx.attention.exp2 import LOG2E, exp2_nonpositive
from veloxquant_mlx.attention.parts import (NEG, CodedPart, ExactPart, KeyOffset, Part, _grouped_mask,
                                            _merge_exact, _part_heads, _segment_mask,
                                            _short_softmax_values, _weighted_values, band_columns, band_mask,
                                            base_mask, coded_keys, coded_scores, part_scores, with_exact_band)
from veloxquant_mlx.codecs.common import f32, packed_matmul_ok
from veloxquant_mlx.codecs.contract import check_codec
from veloxquant_mlx.validate import check_heads, check_int

# With more query rows per KV head than this (R*L, prefill chunks), the history is decoded once and attended
# QUERY_BLOCK positions at a time (CPU only: GPUs tile large row counts in the quantized kernels). 32 is the
# crossover measured for the affine layouts' value aggregation (benchmarks/probes/attention.py era).
CPU_BLOCKED_ROWS = 32

# Decode steps over at most this many tokens take one fused mx.softmax over all parts' scores (concatenated)
# instead of the shared-max 2**t softmax: measured on this CPU (scores (1, 3, 3, N), two parts, eval included)
# 87 vs 135 us at N=220, 225 vs 178 at 1024, 842 vs 208 at 4096 (mx.softmax's exp is scalar).
DECODE_SOFTMAX_TOKENS = 512

# Long query chunks on the dequantize path are attended QUERY_BLOCK positions at a time, so the float32
# scores (B, Hq, block, N) and the softmax's temporaries stay small: a 256-token prefill chunk at 4k context
# would otherwise hold several 9 x 256 x 4096 float32 tensors (~38 MiB each) at once. Measured on SmolLM2 at
# 4096 tokens (docs/history/benchmarks-journal.md): blocks of 32 peaked at 666.9 MiB, blocks of 16 at 618.0 MiB.
QUERY_BLOCK = 16

# Shorter histories take longer blocks, up to this many scores per query head (QUERY_BLOCK queries x 4096 keys,
# the measured setting above): a 20-token chunk over 220 tokens is then one block, not two of 16 and 4 (every
# block is ~20 more operations, ~10 us each on CPU whatever their size).
BLOCK_SCORES = QUERY_BLOCK * 4096


def query_block(n_keys: int) -> int:
    """Query positions attended at a time over ``n_keys`` keys (summed over a batch's rows) on the dequantize
    path (at least `QUERY_BLOCK`)."""
    return max(QUERY_BLOCK, BLOCK_SCORES // max(n_keys, 1))


# --------------------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------------------
def _check_parts(parts: Sequence[Part]) -> List[Part]:
    for p in parts:
        if not isinstance(p, (ExactPart, CodedPart)):
            raise TypeError(f"parts must be ExactPart or CodedPart, got {type(p).__name__}")
    parts = [p for p in parts if p.length > 0]
    if not parts:
        raise ValueError("parts must hold at least one token")
    return parts


def _check_arguments(queries, mask, window_size, packed_rows) -> None:
    check_heads("queries", queries)
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask must be None, 'causal' or an mx.array, got {mask!r}")
    if mask is not None and not isinstance(mask, (str, mx.array)):
        raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")
    if packed_rows is not None:
        check_int("packed_rows", packed_rows, 0)
    if window_size is not None and mask != "causal":
        raise ValueError("window_size is only used with mask='causal' (pass array masks already windowed)")


def packed_attention(
    queries: mx.array,
    parts: Sequence[Part],
    scale: float,
    mask=None,
    sinks: Optional[mx.array] = None,
    window_size: Optional[int] = None,
    packed_rows: Optional[int] = None,
) -> mx.array:
    """SDPA of ``queries`` ``(B, Hq, L, d)`` over the concatenation of ``parts`` -> ``(B, Hq, L, dv)``.

    Args:
        parts: `ExactPart` / `CodedPart` in temporal order (empty parts are skipped; at least one token).
        scale: multiplies the scores (usually ``d ** -0.5``).
        mask: None, "causal", a bool (True = attend) or additive array broadcastable to ``(B, Hq, L, N)``.
        sinks: optional per-query-head attention-sink logits ``(Hq,)`` (gpt-oss style: join the softmax
            denominator, carry no value).
        window_size: with ``mask="causal"`` only: each query also ignores keys ``window_size`` or more
            positions behind it (sliding-window attention).
        packed_rows: the most query rows per KV head (``R * L``) for which codecs read their codes directly
            (quantized matmuls); with more, codecs decode once and use BLAS, and long chunks are attended in
            query blocks. None: each codec's measured CPU crossover (always packed elsewhere).
    """
    _check_arguments(queries, mask, window_size, packed_rows)
    parts = _check_parts(parts)
    B, Hq, L, d = queries.shape
    Bk, Hkv, dk = _part_heads(parts[0])
    if Bk != B or Hq % Hkv or dk != d:
        raise ValueError(f"queries (B={B}, Hq={Hq}, d={d}) must have the cache's batch {Bk}, a multiple of its {Hkv} "
                         f"KV heads and its head_dim {dk}")
    if sinks is not None and sinks.size != Hq:
        raise ValueError(f"sinks must hold one logit per query head ({Hq}), got shape {tuple(sinks.shape)}")
    R, N = Hq // Hkv, sum(p.length for p in parts)
    if L > QUERY_BLOCK and not packed_matmul_ok(R * L, packed_rows, CPU_BLOCKED_ROWS):
        return _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N)
    return _attend(queries, parts, scale, mask, sinks, window_size, packed_rows, Hkv, N)


def _attend(queries, parts: List[Part], scale: float, mask, sinks, window_size, packed_rows, Hkv: int, N: int,
            fused_exp: bool = True):
    """`packed_attention` after its checks, all queries at once. ``fused_exp``: the softmax exponential as one
    fused kernel (False: plain ops, for the blocks of a long chunk, see `exp2_nonpositive`)."""
    B, Hq, L, d = queries.shape
    R = Hq // Hkv
    if L == 1 and (mask is None or (isinstance(mask, str) and window_size is None)):
        if packed_rows is None:
            return attend_one_query(queries, parts, scale, sinks)
        parts, mask = _merge_exact(parts), None
    if 1 < L <= QUERY_BLOCK and isinstance(mask, str) and window_size is None and packed_rows is None:
        out = _short_chunk(queries, parts, scale, sinks, R)
        if out is not None:
            return out
    if isinstance(mask, mx.array):
        mask = _grouped_mask(mask, B, Hq, Hkv, L, N)
        if mask.dtype != mx.bool_:
            mask = mask.astype(mx.float32) * LOG2E  # additive masks join log2 scores
    # Scores in log2 units (scale and 1/ln 2 folded into the query once), so the softmax is 2**(s - max).
    # Rows ordered (head r, query l) within each KV head, as (B, Hkv, R, L, d) flattened.
    q = (f32(queries) * (scale * LOG2E)).reshape(B, Hkv, R * L, d)
    scores, start = [], 0
    for p in parts:
        seg = _segment_mask(mask, start, start + p.length, L, N, window_size)
        scores.append(part_scores(q, p, seg, R, L, packed_rows))
        start += p.length
    o = _softmax_values(scores, parts, sinks, mask is not None, Hkv, R, L, packed_rows, fused_exp)
    out = o.reshape(B, Hq, L, o.shape[-1])
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def _short_chunk(queries, parts, scale, sinks, R: int) -> Optional[mx.array]:
    """A causal chunk of at most `QUERY_BLOCK` queries through the compiled kernel, in pieces of at most
    ``kernel.MAX_ROWS`` query rows per KV head (each piece reads the codes again), or None (then the ops path)."""
    L = queries.shape[2]
    per = max(kernel.MAX_ROWS // R, 1)
    outs = []
    for l0 in range(0, L, per):
        n = min(per, L - l0)
        o = kernel.decode_step(queries[:, :, l0:l0 + n], parts, scale, sinks, chunk=True, later=L - l0 - n)
        if o is None:
            return None
        outs.append(o)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _softmax_values(scores: List[mx.array], parts: Sequence[Part], sinks, masked: bool, Hkv: int, R: int, L: int,
                    packed_rows: Optional[int], fused_exp: bool = True) -> mx.array:
    """One softmax over every part's log2 scores, then the normalized weighted values ``(B, Hkv, R*L, dv)``.

    The parts share one max (no rescaling, no log-sum-exp merge); each exponentiates and aggregates its own
    scores. Concatenating the scores would cost a copy of them, and slicing the weights back per part another
    (a quantized matmul reads contiguous weights): at 10k tokens those copies were most of a decode step's
    attention memory.
    """
    m = None
    for s in scores:
        m_s = mx.max(s, axis=-1, keepdims=True)
        m = m_s if m is None else mx.maximum(m, m_s)
    sink_logits = None
    if sinks is not None:  # gpt-oss style sinks: join the denominator, carry no value
        sink_logits = mx.broadcast_to((sinks.astype(mx.float32) * LOG2E).reshape(1, Hkv, R, 1),
                                      (1, Hkv, R, L)).reshape(1, Hkv, R * L, 1)
        m = mx.maximum(m, sink_logits)
    if masked:
        m = mx.maximum(m, NEG)  # finite even when a row is fully masked
    es = [exp2_nonpositive(s - m, fused=fused_exp) for s in scores]
    l = None
    for e in es:
        l_e = mx.sum(e, axis=-1, keepdims=True)
        l = l_e if l is None else l + l_e
    o = _weighted_values(es, l, parts, packed_rows)
    if sink_logits is not None:
        l = l + exp2_nonpositive(sink_logits - m)
    return o / l


def attend_one_query(queries: mx.array, parts: Sequence[Part], scale: float, sinks: Optional[mx.array] = None,
                     masks: Optional[Sequence[Optional[mx.array]]] = None) -> mx.array:
    """`packed_attention` of one query per row over stored tokens (a decode step): ``queries`` ``(B, Hq, 1, d)``
    -> ``(B, Hq, 1, dv)``.

    ``masks``: None (every token visible) or one entry per part, None or a bool array (True = attend)
    broadcastable to the part's grouped scores ``(B, Hkv, R, n)`` (a batch's per-row valid slots); every row must
    see at least one token. What `packed_attention` computes (tested equal to float32 rounding), without its
    argument checks and its general mask and part bookkeeping: a cache calls it with the parts it built itself
    (non-empty, its own heads), once per layer per step, so its Python is part of a decode step on CPU: ~170 us
    per layer through `packed_attention`, ~80 us in a first version of this function, ~57 us written with one pass
    over the parts and ``mx.split`` (this CPU, SmolLM2 shapes, batch 1, one run each). Histories of at most
    `DECODE_SOFTMAX_TOKENS` tokens take one fused ``mx.softmax`` (`_short_softmax_values`).

    Codes a codec describes as `AffineCodes` (affine, symmetric, and TurboQuant-MSE / -Prod / -RVQ codebook
    codes) on the CPU run the compiled kernel (`veloxquant_mlx.attention.kernel`) when it is built; this
    function's MLX ops below are its reference (tests/attention/test_kernel.py) and its fallback.
    """
    out = kernel.decode_step(queries, parts, scale, sinks, masks)
    if out is not None:
        return out
    return reference_one_query(queries, parts, scale, sinks, masks)


def reference_one_query(queries: mx.array, parts: Sequence[Part], scale: float, sinks: Optional[mx.array] = None,
                        masks: Optional[Sequence[Optional[mx.array]]] = None) -> mx.array:
    """`attend_one_query` in plain MLX ops (the reference of the compiled kernel)."""
    B, Hq, _, d = queries.shape
    coded, exact, n = [], [], 0
    for i, p in enumerate(parts):
        m = None if masks is None else masks[i]
        if isinstance(p, CodedPart):
            coded.append((p, m))
            n += p.length
        elif p.keys.shape[2]:
            exact.append((p, m))
            n += p.keys.shape[2]
    first = (coded or exact)[0][0]
    Hkv = first.keys.shape[1] if isinstance(first, ExactPart) else next(iter(first.v_arrays.values())).shape[1]
    R = Hq // Hkv
    short = n <= DECODE_SOFTMAX_TOKENS
    q = (f32(queries) * (scale if short else scale * LOG2E)).reshape(B, Hkv, R, d)
    scores, merged = [], []
    for p, m in coded:
        s = coded_scores(q, p)
        scores.append(s if m is None else mx.where(m, s, NEG))
        merged.append(p)
    if exact:  # key order does not matter to one query: one exact part
        ek, ev, em = exact[0][0].keys, exact[0][0].values, exact[0][1]
        if len(exact) > 1:
            ek = mx.concatenate([p.keys for p, _ in exact], axis=2)
            ev = mx.concatenate([p.values for p, _ in exact], axis=2)
            given = [m for _, m in exact if m is not None]
            if given:
                lead = tuple(max(x) for x in zip(*(m.shape[:-1] for m in given)))
                em = mx.concatenate([mx.broadcast_to(m if m is not None else mx.array(True), lead + (p.length,))
                                     for p, m in exact], axis=-1)
        s = q @ mx.swapaxes(f32(ek), -1, -2)
        scores.append(s if em is None else mx.where(em, s, NEG))
        merged.append(ExactPart(ek, ev))
    if short:
        o = _short_softmax_values(scores, merged, sinks, Hkv, R)
    else:
        o = _softmax_values(scores, merged, sinks, masks is not None and any(m is not None for m in masks), Hkv, R, 1,
                            None)
    out = o.reshape(B, Hq, 1, o.shape[-1])
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N: int) -> mx.array:
    """`packed_attention` for a long chunk, `query_block` query positions at a time (one block when the history
    is short enough).

    Coded parts are decoded once (float32, ``(B, Hkv, n, d)``) and shared by every block; the mask is made
    explicit and sliced along its query axis. Same result, bounded score memory.
    """
    L = queries.shape[2]
    ks = [coded_keys(p, mx.float32) if isinstance(p, CodedPart) else f32(p.keys) for p in parts]
    vs = [p.v_codec.decode(p.v_arrays, mx.float32) if isinstance(p, CodedPart) else f32(p.values) for p in parts]
    # One exact part for the whole history: each block scores a single tensor, with no per-block slicing.
    exact = [ExactPart(ks[0], vs[0]) if len(ks) == 1 else ExactPart(mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))]
    if isinstance(mask, str):  # "causal": queries are the last L of the N keys
        q_pos, k_pos = mx.arange(N - L, N)[:, None], mx.arange(N)[None, :]
        mask = q_pos >= k_pos
        if window_size is not None:
            mask = mask & (q_pos < k_pos + window_size)
    elif isinstance(mask, mx.array):
        B, Hq = queries.shape[:2]
        _grouped_mask(mask, B, Hq, _part_heads(parts[0])[1], L, N)  # validates the shape, clear errors
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    Hkv, block = ks[0].shape[1], query_block(N * queries.shape[0])  # a batch's rows share the score budget
    if block >= L:  # one block: the whole chunk against the decoded history
        return _attend(queries, exact, scale, mask, sinks, None, packed_rows, Hkv, N)
    # Several blocks in one graph: the exponential as plain ops (the fused kernel's buffers raised the 4096-token
    # prefill peak, see exp2_nonpositive).
    outs = []
    for l0 in range(0, L, block):
        m = mask[..., l0: l0 + block, :] if isinstance(mask, mx.array) and mask.shape[-2] == L else mask
        outs.append(_attend(queries[:, :, l0: l0 + block], exact, scale, m, sinks, None, packed_rows, Hkv, N, False))
    return mx.concatenate(outs, axis=2)


def banded_attention(queries: mx.array, parts: Sequence[Part], band: ExactPart, recent: int, scale: float,
                     mask=None, sinks: Optional[mx.array] = None, window_size: Optional[int] = None,
                     packed_rows: Optional[int] = None) -> mx.array:
    """`packed_attention` of a chunk's ``queries`` ``(B, Hq, L, d)`` (the history's last L positions) in which each
    query reads its ``recent`` newest keys from ``band``, exact copies of the history's last M positions
    ``(B, Hkv, M, d)``, where the parts hold them as codes (`veloxquant_mlx.attention.parts.with_exact_band`): what
    the queries would read were the tokens decoded one at a time behind an exact window of ``recent``.

    A long chunk on the dequantize path decodes the history once and attends it `query_block` queries at a time,
    each block with only the copies its queries read (``block + recent - 1``), not the whole band.
    """
    _check_arguments(queries, mask, window_size, packed_rows)
    parts = _check_parts(parts)
    B, Hq, L, d = queries.shape
    Hkv = _part_heads(parts[0])[1]
    R = Hq // max(Hkv, 1)
    if L <= QUERY_BLOCK or packed_matmul_ok(R * L, packed_rows, CPU_BLOCKED_ROWS):
        banded, m = with_exact_band(parts, band, recent, L, mask, window_size)
        return packed_attention(queries, banded, scale, m, sinks=sinks, packed_rows=packed_rows)
    N, M, coded = band_columns(parts, band)
    if isinstance(mask, mx.array):
        _grouped_mask(mask, B, Hq, Hkv, L, N)  # validates the shape, clear errors
    base = base_mask(mask, L, N, window_size)
    ks = [coded_keys(p, mx.float32) if isinstance(p, CodedPart) else f32(p.keys) for p in parts]
    vs = [p.v_codec.decode(p.v_arrays, mx.float32) if isinstance(p, CodedPart) else f32(p.values) for p in parts]
    history = ExactPart(ks[0], vs[0]) if len(ks) == 1 else ExactPart(mx.concatenate(ks, axis=2),
                                                                      mx.concatenate(vs, axis=2))
    bk, bv = f32(band.keys[:, :, band.length - M:]), f32(band.values[:, :, band.length - M:])
    block, outs = query_block(N * B), []
    for l0 in range(0, L, block):
        n = min(block, L - l0)
        first = N - L + l0  # the block's first query position
        lo, hi = max(first - recent + 1, N - M), first + n  # the band positions its queries may read exact
        m = band_mask(base[..., l0:l0 + n, :], first, lo, coded[lo - (N - M):hi - (N - M)], recent)
        copies = ExactPart(bk[:, :, lo - (N - M):hi - (N - M)], bv[:, :, lo - (N - M):hi - (N - M)])
        outs.append(_attend(queries[:, :, l0:l0 + n], [history, copies], scale, m, sinks, None, packed_rows, Hkv,
                            N + hi - lo, False))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def coded_attention(
    queries: mx.array,
    k_codec,
    k_arrays: Dict[str, mx.array],
    v_codec,
    v_arrays: Dict[str, mx.array],
    scale: float,
    mask=None,
    *,
    sink: Optional[Tuple[mx.array, mx.array]] = None,
    recent: Optional[Tuple[mx.array, mx.array]] = None,
    sinks: Optional[mx.array] = None,
    window_size: Optional[int] = None,
    packed_rows: Optional[int] = None,
) -> mx.array:
    """Attention over ``[sink | coded | recent]`` history (the packed cache's layout) -> ``(B, Hq, L, dv)``.

    ``sink`` / ``recent``: optional exact ``(keys, values)`` ``(B, Hkv, n, d)`` before / after the coded tokens.
    Any codecs of the contract; see `packed_attention` for the rest.
    """
    check_codec(k_codec, "k_codec")
    check_codec(v_codec, "v_codec")
    parts: List[Part] = []
    if sink is not None:
        parts.append(ExactPart(*sink))
    parts.append(CodedPart(k_codec, k_arrays, v_codec, v_arrays))
    if recent is not None:
        parts.append(ExactPart(*recent))
    return packed_attention(queries, parts, scale, mask, sinks=sinks, window_size=window_size, packed_rows=packed_rows)
