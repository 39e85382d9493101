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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from veloxquant_mlx.attention import kernel
from veloxquant_mlx.attention.exp2 import LOG2E, exp2_nonpositive
from veloxquant_mlx.codecs._common import f32, packed_matmul_ok
from veloxquant_mlx.codecs.contract import check_codec
from veloxquant_mlx.validate import check_heads, check_int

# A finite "minus infinity" for masked scores: exp(NEG - m) underflows to 0 without 0 * inf NaNs.
NEG = float(mx.finfo(mx.float32).min)

# With more query rows per KV head than this (R*L, prefill chunks), the history is decoded once and attended
# QUERY_BLOCK positions at a time (CPU only: GPUs tile large row counts in the quantized kernels). 32 is the
# crossover measured for the affine layouts' value aggregation (benchmarks/attention.py era).
CPU_BLOCKED_ROWS = 32

# Decode steps over at most this many tokens take one fused mx.softmax over all parts' scores (concatenated)
# instead of the shared-max 2**t softmax: measured on this CPU (scores (1, 3, 3, N), two parts, eval included)
# 87 vs 135 us at N=220, 225 vs 178 at 1024, 842 vs 208 at 4096 (mx.softmax's exp is scalar).
DECODE_SOFTMAX_TOKENS = 512

# Long query chunks on the dequantize path are attended QUERY_BLOCK positions at a time, so the float32
# scores (B, Hq, block, N) and the softmax's temporaries stay small: a 256-token prefill chunk at 4k context
# would otherwise hold several 9 x 256 x 4096 float32 tensors (~38 MiB each) at once. Measured on SmolLM2 at
# 4096 tokens (benchmarks/prefill_peak.py): blocks of 32 peaked at 666.9 MiB, blocks of 16 at 618.0 MiB.
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
# parts of the history
# --------------------------------------------------------------------------------------------------------
@dataclass
class ExactPart:
    """Full-precision keys ``(B, Hkv, n, dk)`` and values ``(B, Hkv, n, dv)``."""

    keys: mx.array
    values: mx.array

    @property
    def length(self) -> int:
        return self.keys.shape[2]


@dataclass
class CodedPart:
    """Tokens held as codes: ``k_arrays`` / ``v_arrays`` are what ``k_codec`` / ``v_codec`` encoded (n tokens).

    ``within``: ``(whole, lo, hi)`` when these codes are slots ``[lo, hi)`` of the coded part ``whole`` (views of
    its arrays; a sliding window's parts on either side of its evicted slots): the compiled kernel then reads all
    such parts of one ``whole`` in one pass over its codes, skipping the slots between them."""

    k_codec: object
    k_arrays: Dict[str, mx.array]
    v_codec: object
    v_arrays: Dict[str, mx.array]
    within: Optional[Tuple["CodedPart", int, int]] = None

    @property
    def length(self) -> int:
        return self.k_codec.n_tokens(self.k_arrays)


Part = Union[ExactPart, CodedPart]


# --------------------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------------------
def _grouped_mask(mask: mx.array, B: int, Hq: int, Hkv: int, L: int, N: int) -> mx.array:
    """Array mask broadcastable to ``(B, Hq, L, N)`` -> broadcastable to ``(B, Hkv, R, L, N)``."""
    if mask.ndim > 4 or mask.ndim == 0:
        raise ValueError(f"mask must have 1 to 4 dims broadcastable to (B, Hq, L, N), got shape {tuple(mask.shape)}")
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    mb, mh, ml, mn = shape
    if mn not in (1, N) or ml not in (1, L) or mh not in (1, Hq) or mb not in (1, B):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, L, N) = {(B, Hq, L, N)}"
        )
    mask = mask.reshape(shape)
    if mh == 1:
        return mx.expand_dims(mask, 2)  # (mb, 1, 1, ml, mn)
    return mask.reshape(mb, Hkv, Hq // Hkv, ml, mn)


def _segment_mask(mask, start: int, stop: int, L: int, N: int, window: Optional[int]):
    """The mask restricted to keys ``[start, stop)``: None (all visible), a bool or an additive array.

    ``mask`` is None, "causal" or a grouped array (see `_grouped_mask`); shapes ``(.., L, stop-start)``.
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        first_q = N - L  # position of the first query (queries are the last L keys)
        # Skip building a mask when every query sees the whole segment (decode, or old history):
        # the first query sees up to key first_q, the last query's window starts at N - window.
        if stop - 1 <= first_q and (window is None or start >= N - window):
            return None
        q_pos = mx.arange(first_q, N)[:, None]
        k_pos = mx.arange(start, stop)[None, :]
        visible = q_pos >= k_pos
        if window is not None:
            visible = visible & (q_pos < k_pos + window)
        return visible
    if mask.shape[-1] == 1:
        return mask
    return mask[..., start:stop]


def _apply_mask(scores: mx.array, mask, R: int, L: int) -> mx.array:
    """``scores`` ``(B, Hkv, R*L, n)`` with a segment mask; masked scores become NEG (bool) or get added."""
    if mask is None:
        return scores
    B, Hkv, RL, n = scores.shape
    s5 = scores.reshape(B, Hkv, R, L, n)
    if mask.dtype == mx.bool_:
        s5 = mx.where(mask, s5, NEG)
    else:
        s5 = s5 + mask.astype(mx.float32)
    return s5.reshape(B, Hkv, RL, n)


# --------------------------------------------------------------------------------------------------------
# one part: scores and weighted values (grouped layout: q (B, Hkv, R*L, d), weights (B, Hkv, R*L, n))
# --------------------------------------------------------------------------------------------------------
def part_scores(q: mx.array, part: Part, mask, R: int, L: int, packed_rows: Optional[int] = None) -> mx.array:
    """Masked scores ``(B, Hkv, R*L, n)`` of grouped queries on one part (in the queries' units)."""
    if isinstance(part, ExactPart):
        s = q @ mx.swapaxes(f32(part.keys), -1, -2)
    else:
        s = part.k_codec.scores(q, part.k_arrays, packed_rows)
    return _apply_mask(s, mask, R, L)


def _shared_offset(parts: Sequence[Part]) -> Optional[mx.array]:
    """The ``decoded_offset`` ``(Hkv, dv)`` every coded part's values carry when one value codec holds them all."""
    codec = None
    for p in parts:
        if isinstance(p, CodedPart):
            if codec is not None and p.v_codec is not codec:
                return None
            codec = p.v_codec
    return None if codec is None else codec.decoded_offset()


def _weighted_values(es: Sequence[mx.array], l: mx.array, parts: Sequence[Part], packed_rows: Optional[int]) -> mx.array:
    """``sum_j e_j v_j`` over every part -> ``(B, Hkv, M, dv)`` (unnormalized; ``es[i]`` are part i's weights,
    ``l`` their total row sums).

    With one shared value offset ``mu`` (centred values), it is added once with the total weight and taken off
    the exact parts' values instead (``sum_coded e mu = l mu - sum_exact e mu``): no per-part row sums.
    """
    mu = _shared_offset(parts)
    if mu is not None:
        mu = mu[None, :, None, :]  # (1, Hkv, 1, dv)
    o = None if mu is None else l * mu
    for e_p, p in zip(es, parts):
        if isinstance(p, ExactPart):
            o_p = e_p @ (f32(p.values) if mu is None else f32(p.values) - mu)
        else:
            o_p = p.v_codec.weighted_sum(e_p, p.v_arrays, packed_rows, with_offset=mu is None)
        o = o_p if o is None else o + o_p
    return o


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


def _part_heads(part: Part) -> Tuple[int, int, int]:
    """``(B, Hkv, dk)`` of a part."""
    if isinstance(part, ExactPart):
        return tuple(part.keys.shape[:2]) + (part.keys.shape[-1],)
    a = next(iter(part.v_arrays.values()))  # (B, H, ...) in every layout
    return a.shape[0], a.shape[1], part.k_codec.d


def _merge_exact(parts: List[Part]) -> List[Part]:
    """One query that sees every key: the order of keys does not matter, so all exact parts become one (two small
    concatenations instead of a second matmul pair and slices)."""
    exact = [p for p in parts if isinstance(p, ExactPart)]
    if len(exact) < 2:
        return parts
    merged = ExactPart(mx.concatenate([p.keys for p in exact], axis=2), mx.concatenate([p.values for p in exact], axis=2))
    return [p for p in parts if isinstance(p, CodedPart)] + [merged]


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
    function's MLX ops below are its reference (tests/cache/test_kernel.py) and its fallback.
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
        s = p.k_codec.scores(q, p.k_arrays)
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


def _short_softmax_values(scores: List[mx.array], parts: Sequence[Part], sinks, Hkv: int, R: int) -> mx.array:
    """`attend_one_query`'s weighted values ``(B, Hkv, R, dv)`` for a short history (natural-log ``scores``, one
    per part): one fused ``mx.softmax`` over the concatenated scores, split per part.

    Below `DECODE_SOFTMAX_TOKENS` this is fewer and cheaper ops than the shared-max ``2**t`` softmax (whose
    kernels cost more than their elements there). The weights come normalized, so a shared value offset ``mu``
    is added once, ``(1 - sink weight) mu``, and taken off the exact values.
    """
    cols = scores
    if sinks is not None:
        cols = scores + [mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, R, 1), scores[0].shape[:-1] + (1,))]
    if len(cols) == 1:
        ws = [mx.softmax(cols[0], axis=-1, precise=True)]
    else:
        cuts, at = [], 0
        for s in cols[:-1]:
            at += s.shape[-1]
            cuts.append(at)
        ws = mx.split(mx.softmax(mx.concatenate(cols, axis=-1), axis=-1, precise=True), cuts, axis=-1)
    # Not `_weighted_values(ws, 1 - sink weight, ...)`: that form gave other decode logits on 2-rank pipeline runs
    # (tests/mlx_lm/test_distributed.py) though equal in one process; not understood yet, so the sum stays explicit.
    mu = _shared_offset(parts)
    if mu is not None:
        mu = mx.expand_dims(mu, (0, 2))  # (1, Hkv, 1, dv)
    o = None
    for w_p, p in zip(ws, parts):
        if isinstance(p, ExactPart):
            o_p = w_p @ (f32(p.values) if mu is None else f32(p.values) - mu)
        else:
            o_p = p.v_codec.weighted_sum(w_p, p.v_arrays, with_offset=mu is None)
        o = o_p if o is None else o + o_p
    if mu is not None:
        o = o + (mu if sinks is None else (1.0 - ws[-1]) * mu)
    return o


def _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N: int) -> mx.array:
    """`packed_attention` for a long chunk, `query_block` query positions at a time (one block when the history
    is short enough).

    Coded parts are decoded once (float32, ``(B, Hkv, n, d)``) and shared by every block; the mask is made
    explicit and sliced along its query axis. Same result, bounded score memory.
    """
    L = queries.shape[2]
    ks = [p.k_codec.decode(p.k_arrays, mx.float32) if isinstance(p, CodedPart) else f32(p.keys) for p in parts]
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
