"""Attention for one layer straight from a compressed KV cache: at decode, no dequantized copy of the history.

Pure functions. The history is a sequence of *parts* in temporal order (the order of the mask's key axis):

- `ExactPart(keys, values)`: full-precision tokens ``(B, Hkv, n, d)`` (e.g. an exact sink or recent window);
- `CodedPart(k_codec, k_arrays, v_codec, v_arrays)`: tokens stored by a codec, arrays ``(B, Hkv, n, ...)``.
  Three codec layouts are understood:
  * `AffineRotatedCodec` (``kind == "affine"``): stored ``y = Pi (x - mu)`` in MLX's affine format. Keys are
    scored with ``mx.quantized_matmul(q Pi^T, codes, transpose=True)`` and values aggregated with
    ``mx.quantized_matmul(p, codes)``; the ``(.., d)`` output is rotated back once (Pi is orthogonal,
    so q.k = (Pi q).(Pi k)).
  * `AffineBlockKeyCodec` (``kind == "affine_block"``): the same for keys, but quantized per channel along
    blocks of tokens, so scoring is ``mx.quantized_matmul(q Pi^T, K^T codes, transpose=False)`` (faster
    on CPU under GQA); as values it is decoded (correct, slower).
  * `ChannelCodec` (Lloyd-Max TurboQuant codes, optional outlier channel split): each channel group is
    decoded in its rotated basis (``decode_rotated``, no inverse rotation of the history) and multiplied
    with the query rotated per group. Correct, but it materializes float32 rotated codes: slower.

Centering is free: for keys ``q.(mu + Pi^T y) = (Pi q).y + q.mu`` and ``q.mu`` is one number per query,
carried as a shift of the part's running max; for values the weights of a part sum to ``l`` so ``l mu``
is added once to the ``(.., d)`` output.

Each part yields the flash-attention triple ``(o, m, l)``: ``m`` the max score, ``l = sum exp(s - m)``,
``o = sum exp(s - m) v``; parts (and optional per-head attention-sink logits) are merged exactly with a
log-sum-exp merge, so the result equals SDPA over the concatenated history. Softmax math is float32.

On CPU the quantized matmuls cost grows with the query rows per KV head (``R*L``), so for prefill-sized
chunks a coded part is dequantized once in the rotated domain and multiplied with BLAS instead (still
no inverse rotation of the history; see ``packed_rows`` / ``CPU_PACKED_ROWS``).

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

# A finite "minus infinity" for masked scores: exp(NEG - m) underflows to 0 without 0 * inf NaNs.
NEG = float(mx.finfo(mx.float32).min)

# On CPU `mx.quantized_matmul` costs grow linearly with the query rows per KV head (R*L: GQA group x
# queries), while dequantizing the part once (rotated domain) and using BLAS costs ~O(n d) whatever the
# rows. Measured crossovers (benchmarks/attention.py era, 8 KV heads, d=128, n=8k): per-token affine keys
# (transpose=True) ~12 rows; block keys and affine values (transpose=False) ~32 rows. On GPUs the
# quantized kernels tile large row counts, so packed matmuls are always used there.
CPU_PACKED_ROWS = {"keys": 12, "block_keys": 32, "values": 32}

# Long query chunks on the dequantize path are attended QUERY_BLOCK positions at a time, so the float32
# scores (B, Hq, block, N) stay small: a 256-token prefill chunk at 4k context would otherwise hold
# ~2-3 copies of a 9 x 256 x 4096 float32 score tensor (~38 MiB each) at once.
QUERY_BLOCK = 32


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
    """Tokens held as codes: ``k_arrays``/``v_arrays`` are a codec's ``encode`` output ``(B, Hkv, n, ...)``."""

    k_codec: object
    k_arrays: Dict[str, mx.array]
    v_codec: object
    v_arrays: Dict[str, mx.array]

    @property
    def length(self) -> int:
        return next(iter(self.k_arrays.values())).shape[2]


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
# per-codec scoring and value aggregation (grouped layout: q (B, Hkv, R*L, d), weights (B, Hkv, R*L, n))
# --------------------------------------------------------------------------------------------------------
def _is_affine(codec) -> bool:
    return getattr(codec, "kind", None) == "affine"


def _is_block(codec) -> bool:
    return getattr(codec, "kind", None) == "affine_block"


def _is_channel(codec) -> bool:
    return hasattr(codec, "quantizers") and hasattr(codec, "groups")


def _check_codec(codec, name: str) -> None:
    if not (_is_affine(codec) or _is_block(codec) or _is_channel(codec)):
        raise TypeError(
            f"{name} must be an AffineRotatedCodec, AffineBlockKeyCodec or ChannelCodec, got {type(codec).__name__}"
        )


def _group_ev(codec, arrays: Dict[str, mx.array], g: str):
    """The EncodedVector of channel group ``g`` from a ChannelCodec's stored arrays (as its decode does)."""
    from veloxquant_mlx.core.context import EncodedVector

    fields = {k[len(g) + 1 :]: v for k, v in arrays.items() if k.startswith(g + "_")}
    return EncodedVector(quantizer_type=codec.method, dim=codec.groups[g][0], dtype_name="float32", **fields)


def _channel_perm(codec):
    """A ChannelCodec's ``(perm, inv_perm)`` ``(H, d)`` int32 (outlier channels first), or Nones."""
    return codec.perm, codec.inv_perm


def _mean(codec) -> Optional[mx.array]:
    """The codec's per-head mean ``(H, d)`` as float32 (ChannelCodec keeps it in bfloat16), or None."""
    mu = getattr(codec, "mean", None)
    return None if mu is None else mu.astype(mx.float32)


def _permute(x: mx.array, perm: mx.array) -> mx.array:
    """``x`` ``(B, H, M, d)`` with per-head channel order ``perm`` ``(H, d)``: x[..., perm[h]]."""
    return mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)


def _channel_groups(codec):
    """``(group, start, width, quantizer)`` in ChannelCodec's stored order (outliers first)."""
    out, start = [], 0
    for g in ("o", "i"):
        if g in codec.groups:
            width = codec.groups[g][0]
            out.append((g, start, width, codec.quantizers[g]))
            start += width
    return out


def _packed_ok(role: str, rows: int, packed_rows: Optional[int]) -> bool:
    """Whether ``rows`` query rows per KV head should use quantized matmuls (else dequantize + BLAS)."""
    if packed_rows is not None:
        return rows <= packed_rows
    if mx.default_device() != mx.cpu:
        return True
    return rows <= CPU_PACKED_ROWS[role]


def coded_scores(
    q: mx.array, codec, arrays: Dict[str, mx.array], packed_rows: Optional[int] = None
) -> Tuple[mx.array, Optional[mx.array]]:
    """Scores of scaled float32 queries ``(B, Hkv, M, d)`` against coded keys ``(B, Hkv, n, ...)``.

    Returns ``(s (B, Hkv, M, n), shift (B, Hkv, M, 1) or None)``: the true scores are ``s + shift``
    (``shift = q . mu``, constant over keys, so it only moves the part's max). ``packed_rows``: see
    `packed_attention`.
    """
    shift, mu = None, _mean(codec)
    if mu is not None:
        shift = q @ mx.expand_dims(mu, -1)[None]  # (1, H, d, 1) -> (B, H, M, 1)
    M = q.shape[2]
    if (_is_affine(codec) and not _packed_ok("keys", M, packed_rows)) or (
        _is_block(codec) and not _packed_ok("block_keys", M, packed_rows)
    ):
        # Many rows (prefill chunk): dequantize once in the rotated domain, score with BLAS.
        k_rot = codec.decode_rotated(arrays)  # (B, H, n, d) float32, transient
        return codec.rotation.apply(q) @ mx.swapaxes(k_rot, -1, -2), shift
    if _is_affine(codec):
        q_rot = codec.rotation.apply(q)
        s = mx.quantized_matmul(
            q_rot, arrays["w_q"], arrays["scales"], arrays["biases"],
            transpose=True, group_size=codec.group_size, bits=codec.bits,
        )
        return s.astype(mx.float32), shift
    if _is_block(codec):
        # K^T per block is (d, block) quantized along tokens: x @ W with W = K^T, the fast form.
        w_q, scales, biases = codec.blocks(arrays)  # (B, H, nb, d, block*bits/32), (B, H, nb, d, 1)
        q_rot = mx.expand_dims(codec.rotation.apply(q), 2)  # (B, H, 1, M, d)
        s = mx.quantized_matmul(
            q_rot, w_q, scales, biases, transpose=False, group_size=codec.block, bits=codec.bits
        )  # (B, H, nb, M, block)
        B, H, nb, M, blk = s.shape
        return mx.swapaxes(s, 2, 3).reshape(B, H, M, nb * blk).astype(mx.float32), shift
    perm, _ = _channel_perm(codec)
    qp = _permute(q, perm) if perm is not None else q
    s = None
    for g, start, width, quant in _channel_groups(codec):
        q_rot = quant.rotation.apply(qp[..., start : start + width])
        k_rot = quant.decode_rotated(_group_ev(codec, arrays, g))  # (B, H, n, width) float32
        part = q_rot @ mx.swapaxes(k_rot, -1, -2)
        s = part if s is None else s + part
    return s, shift


def coded_values(
    p: mx.array, l: mx.array, codec, arrays: Dict[str, mx.array], packed_rows: Optional[int] = None
) -> mx.array:
    """``sum_j p_j v_j`` for weights ``p`` ``(B, Hkv, M, n)`` (row sums ``l`` ``(B, Hkv, M, 1)``): ``(B, Hkv, M, dv)``.

    Aggregates in the rotated domain and rotates the ``(.., dv)`` result back once; adds ``l * mu``.
    """
    if _is_affine(codec) and _packed_ok("values", p.shape[2], packed_rows):
        o_rot = mx.quantized_matmul(
            p, arrays["w_q"], arrays["scales"], arrays["biases"],
            transpose=False, group_size=codec.group_size, bits=codec.bits,
        )
        o = codec.rotation.invert(o_rot.astype(mx.float32))
    elif _is_affine(codec) or _is_block(codec):
        # Many rows, or block layout (made for keys): dequantize in the rotated domain, BLAS matmul.
        o = codec.rotation.invert(p @ codec.decode_rotated(arrays))
    else:
        pieces = []
        for g, _, _, quant in _channel_groups(codec):
            v_rot = quant.decode_rotated(_group_ev(codec, arrays, g))  # (B, H, n, width)
            pieces.append(quant.rotation.invert(p @ v_rot))
        o = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
        _, inv_perm = _channel_perm(codec)
        if inv_perm is not None:
            o = _permute(o, inv_perm)
    mu = _mean(codec)
    if mu is not None:
        o = o + l * mu[None, :, None, :]
    return o


# --------------------------------------------------------------------------------------------------------
# one part -> (o, m, l); merge
# --------------------------------------------------------------------------------------------------------
def _softmax_stats(s: mx.array):
    """``s`` ``(.., n)`` -> (unnormalized weights e, max m ``(.., 1)``, sum l ``(.., 1)``)."""
    m = mx.maximum(mx.max(s, axis=-1, keepdims=True), NEG)  # finite even when a row is all -inf
    e = mx.exp(s - m)
    return e, m, mx.sum(e, axis=-1, keepdims=True)


def part_attention(q: mx.array, part: Part, mask, R: int, L: int, packed_rows: Optional[int] = None):
    """Grouped scaled float32 queries ``(B, Hkv, R*L, d)`` on one part -> ``(o, m, l)``.

    ``o`` ``(B, Hkv, R*L, dv)`` unnormalized, ``m`` and ``l`` ``(B, Hkv, R*L, 1)``.
    """
    if isinstance(part, ExactPart):
        k = part.keys.astype(mx.float32)
        s = q @ mx.swapaxes(k, -1, -2)
        e, m, l = _softmax_stats(_apply_mask(s, mask, R, L))
        return e @ part.values.astype(mx.float32), m, l
    s, shift = coded_scores(q, part.k_codec, part.k_arrays, packed_rows)
    e, m, l = _softmax_stats(_apply_mask(s, mask, R, L))
    o = coded_values(e, l, part.v_codec, part.v_arrays, packed_rows)
    if shift is not None:
        m = m + shift
    return o, m, l


def merge_partials(partials: Sequence[Tuple[mx.array, mx.array, mx.array]], sink_logits: Optional[mx.array] = None):
    """Exact log-sum-exp merge of ``(o, m, l)`` triples (+ optional sink logits ``(.., 1)``): normalized output."""
    ms = [m for _, m, _ in partials]
    if sink_logits is not None:
        ms.append(sink_logits)
    m_all = ms[0]
    for m in ms[1:]:
        m_all = mx.maximum(m_all, m)
    num, den = None, None
    for o, m, l in partials:
        a = mx.exp(m - m_all)
        num = a * o if num is None else num + a * o
        den = a * l if den is None else den + a * l
    if sink_logits is not None:
        den = den + mx.exp(sink_logits - m_all)
    return num / den


# --------------------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------------------
def _check_queries(queries) -> None:
    if not isinstance(queries, mx.array):
        raise TypeError(f"queries must be an mx.array of shape (B, Hq, L, d), got {type(queries).__name__}")
    if queries.ndim != 4:
        raise ValueError(f"queries must have shape (B, Hq, L, d), got {tuple(queries.shape)}")
    if queries.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"queries must be float32, float16 or bfloat16, got {queries.dtype}")


def _part_heads(part: Part) -> Tuple[int, int]:
    if isinstance(part, ExactPart):
        return part.keys.shape[0], part.keys.shape[1]
    a = next(iter(part.k_arrays.values()))
    return a.shape[0], a.shape[1]


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
        packed_rows: the most query rows per KV head (``R * L``) for which coded parts are used through
            quantized matmuls; with more (prefill chunks) a coded part is dequantized once in the rotated
            domain and multiplied with BLAS (same result, float32 rounding aside). None: on CPU the measured
            crossovers in ``CPU_PACKED_ROWS``, elsewhere always packed.
    """
    _check_queries(queries)
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask must be None, 'causal' or an mx.array, got {mask!r}")
    if mask is not None and not isinstance(mask, (str, mx.array)):
        raise TypeError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")
    if packed_rows is not None and (isinstance(packed_rows, bool) or not isinstance(packed_rows, int) or packed_rows < 0):
        raise ValueError(f"packed_rows must be None or an int >= 0, got {packed_rows!r}")
    if window_size is not None and mask != "causal":
        raise ValueError("window_size is only used with mask='causal' (pass array masks already windowed)")
    parts = [p for p in parts if p.length > 0]
    if not parts:
        raise ValueError("parts must hold at least one token")
    for p in parts:
        if not isinstance(p, (ExactPart, CodedPart)):
            raise TypeError(f"parts must be ExactPart or CodedPart, got {type(p).__name__}")
        if isinstance(p, CodedPart):
            _check_codec(p.k_codec, "k_codec")
            _check_codec(p.v_codec, "v_codec")
    B, Hq, L, d = queries.shape
    Bk, Hkv = _part_heads(parts[0])
    if Bk != B or Hq % Hkv:
        raise ValueError(
            f"queries (B={B}, Hq={Hq}) must have the cache's batch {Bk} and a multiple of its {Hkv} KV heads"
        )
    R = Hq // Hkv
    N = sum(p.length for p in parts)
    if L > QUERY_BLOCK and not _packed_ok("values", R * L, packed_rows):
        return _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N)
    grouped_mask = mask
    if isinstance(mask, mx.array):
        grouped_mask = _grouped_mask(mask, B, Hq, Hkv, L, N)
    # Scale once; rows ordered (head r, query l) within each KV head, as (B, Hkv, R, L, d) flattened.
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, R * L, d)
    partials, start = [], 0
    for p in parts:
        seg = _segment_mask(grouped_mask, start, start + p.length, L, N, window_size)
        partials.append(part_attention(q, p, seg, R, L, packed_rows))
        start += p.length
    sink_logits = None
    if sinks is not None:
        if sinks.size != Hq:
            raise ValueError(f"sinks must hold one logit per query head ({Hq}), got shape {tuple(sinks.shape)}")
        sink_logits = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, Hkv, R, 1), (1, Hkv, R, L)
        ).reshape(1, Hkv, R * L, 1)
    if len(partials) == 1 and sink_logits is None:
        o, _, l = partials[0]
        out = o / l
    else:
        out = merge_partials(partials, sink_logits)
    return out.reshape(B, Hq, L, out.shape[-1]).astype(queries.dtype)


def _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N: int) -> mx.array:
    """`packed_attention` for a long chunk, ``QUERY_BLOCK`` query positions at a time.

    Coded parts are decoded once (float32, ``(B, Hkv, n, d)``) and shared by every block; the mask is
    made explicit and sliced along its query axis. Same result, bounded score memory.
    """
    L = queries.shape[2]
    exact = []
    for p in parts:
        if isinstance(p, CodedPart):
            exact.append(ExactPart(p.k_codec.decode(p.k_arrays, mx.float32), p.v_codec.decode(p.v_arrays, mx.float32)))
        else:
            exact.append(p)
    if isinstance(mask, str):  # "causal": queries are the last L of the N keys
        q_pos = mx.arange(N - L, N)[:, None]
        k_pos = mx.arange(N)[None, :]
        mask = q_pos >= k_pos
        if window_size is not None:
            mask = mask & (q_pos < k_pos + window_size)
    elif isinstance(mask, mx.array):
        B, Hq = queries.shape[:2]
        _grouped_mask(mask, B, Hq, _part_heads(parts[0])[1], L, N)  # validates the shape, clear errors
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    outs = []
    for l0 in range(0, L, QUERY_BLOCK):
        l1 = min(l0 + QUERY_BLOCK, L)
        m = mask
        if isinstance(mask, mx.array) and mask.shape[-2] == L:
            m = mask[..., l0:l1, :]
        outs.append(packed_attention(queries[:, :, l0:l1], exact, scale, m, sinks=sinks, packed_rows=packed_rows))
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
    Works for either codec (affine or Lloyd-Max `ChannelCodec`); see `packed_attention` for the rest.
    """
    parts: List[Part] = []
    if sink is not None:
        parts.append(ExactPart(*sink))
    parts.append(CodedPart(k_codec, k_arrays, v_codec, v_arrays))
    if recent is not None:
        parts.append(ExactPart(*recent))
    return packed_attention(queries, parts, scale, mask, sinks=sinks, window_size=window_size, packed_rows=packed_rows)


# --------------------------------------------------------------------------------------------------------
# glue for the packed caches
# --------------------------------------------------------------------------------------------------------
def cache_parts(cache) -> List[Part]:
    """The history of a packed cache as parts, reading only these attributes:

    - ``cache.sink_store``, ``cache.tail``: TokenStores (``.length``, ``.view(start, stop)``) holding arrays
      "k", "v" ``(B, Hkv, n, d)`` — the exact first / newest tokens;
    - ``cache.recent`` (int, default: the whole tail): only the last ``recent`` tail tokens read exactly;
      older tail tokens (trim headroom) read as coded, so they are encoded here (a few tokens), exactly as
      the cache's own fetch does;
    - ``cache.codes``: TokenStore holding ``"k_<field>"`` / ``"v_<field>"`` codec arrays ``(B, Hkv, n, ...)``;
    - ``cache.k_codec``, ``cache.v_codec``: the codecs that wrote them (AffineRotatedCodec or ChannelCodec).
    Temporal order is ``[sink | codes | tail]``.
    """
    parts: List[Part] = []
    sink = getattr(cache, "sink_store", None)
    if sink is not None and sink.length:
        s = sink.view()
        parts.append(ExactPart(s["k"], s["v"]))
    if cache.codes.length:
        c = cache.codes.view()
        parts.append(
            CodedPart(
                cache.k_codec, {n[2:]: a for n, a in c.items() if n.startswith("k_")},
                cache.v_codec, {n[2:]: a for n, a in c.items() if n.startswith("v_")},
            )
        )
    tail = getattr(cache, "tail", None)
    if tail is not None and tail.length:
        recent = getattr(cache, "recent", None)
        n_old = 0 if recent is None else max(tail.length - int(recent), 0)
        if n_old:
            old = tail.view(0, n_old)
            parts.append(CodedPart(cache.k_codec, cache.k_codec.encode(old["k"]),
                                   cache.v_codec, cache.v_codec.encode(old["v"])))
        t = tail.view(n_old)
        parts.append(ExactPart(t["k"], t["v"]))
    return parts


def packed_attention_for_cache(
    cache, queries: mx.array, scale: float, mask=None, sinks: Optional[mx.array] = None,
    packed_rows: Optional[int] = None,
):
    """What a packed cache's ``attend_packed`` can return: attention over everything it stores.

    Call after the cache has stored the current step's keys/values (mlx_lm calls ``update_and_fetch``
    before SDPA). ``queries`` ``(B, Hq, L, d)`` -> ``(B, Hq, L, dv)``; ``mask`` as mlx_lm passes it;
    ``packed_rows`` as in `packed_attention`.
    """
    return packed_attention(queries, cache_parts(cache), scale, mask, sinks=sinks, packed_rows=packed_rows)
