"""Attention for one layer straight from a compressed KV cache: at decode, no dequantized copy of the history.

Pure functions. The history is a sequence of *parts* in temporal order (the order of the mask's key axis):

- `ExactPart(keys, values)`: full-precision tokens ``(B, Hkv, n, d)`` (e.g. an exact sink or recent window);
- `CodedPart(k_codec, k_arrays, v_codec, v_arrays)`: tokens stored by a codec, arrays ``(B, Hkv, n, ...)``.
  Three codec layouts are understood:
  * `AffineRotatedCodec` (``kind == "affine"``): stored ``y = Pi (x - mu)`` in MLX's affine format. Keys are
    scored with ``mx.quantized_matmul(q Pi^T, codes, transpose=True)`` and values aggregated with
    ``mx.quantized_matmul(p, codes)``; the ``(.., d)`` output is rotated back once (Pi is orthogonal,
    so q.k = (Pi q).(Pi k)).
  * `AffineBlockKeyCodec` (``kind == "affine_block"``): keys stored as ``K^T`` ``(B, Hkv, d, ...)``, each
    rotated channel quantized along blocks of tokens, so scoring is one
    ``mx.quantized_matmul(q Pi^T, K^T codes, transpose=False)`` (the fastest form on CPU under GQA);
    as values it is decoded (correct, slower).
  * `ChannelCodec` (Lloyd-Max TurboQuant codes, optional outlier channel split): each channel group is
    decoded in its rotated basis (``decode_rotated``, no inverse rotation of the history) and multiplied
    with the query rotated per group. Correct, but it materializes float32 rotated codes: slower.

Centering is cheap: for keys ``q.(mu + Pi^T y) = (Pi q).y + q.mu`` and ``q.mu`` is one number per query,
added to the part's scores (block keys fold ``Pi mu`` into their biases instead: nothing to add); for values
the weights of a part sum to ``l`` so ``l mu`` is added once to the ``(.., d)`` output.

All parts are scored into one ``(B, Hkv, R*L, N)`` tensor (in log2 units: the query carries
``scale / ln 2``) and share one softmax, whose exponential is `exp2_nonpositive` (plain elementwise ops,
several times cheaper than ``mx.exp`` on CPU); each part then aggregates its own slice of the weights. Optional
per-head attention-sink logits join the denominator. Softmax math is float32.

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

from veloxquant_mlx.attention.exp2 import LOG2E, exp2_nonpositive

# A finite "minus infinity" for masked scores: exp(NEG - m) underflows to 0 without 0 * inf NaNs.
NEG = float(mx.finfo(mx.float32).min)

# On CPU `mx.quantized_matmul` costs grow linearly with the query rows per KV head (R*L: GQA group x
# queries), while dequantizing the part once (rotated domain) and using BLAS costs ~O(n d) whatever the
# rows. Measured crossovers (benchmarks/attention.py era, 8 KV heads, d=128, n=8k): per-token affine keys
# (transpose=True) ~12 rows; block keys and affine values (transpose=False) ~32 rows. On GPUs the
# quantized kernels tile large row counts, so packed matmuls are always used there.
CPU_PACKED_ROWS = {"keys": 12, "block_keys": 32, "values": 32}

# Long query chunks on the dequantize path are attended QUERY_BLOCK positions at a time, so the float32
# scores (B, Hq, block, N) and the softmax's temporaries stay small: a 256-token prefill chunk at 4k context
# would otherwise hold several 9 x 256 x 4096 float32 tensors (~38 MiB each) at once. Measured on SmolLM2 at
# 4096 tokens (benchmarks/prefill_peak.py): blocks of 32 peaked at 666.9 MiB, blocks of 16 at 618.0 MiB.
QUERY_BLOCK = 16


def _f32(x: mx.array) -> mx.array:
    """``x`` as float32, without adding a graph node when it already is (decode builds ~60 ops per layer)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


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
        n_tokens = getattr(self.k_codec, "n_tokens", None)  # affine codecs know their layout
        return n_tokens(self.k_arrays) if n_tokens else next(iter(self.k_arrays.values())).shape[2]


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
    """The per-head mean ``(H, d)`` attention must add back, as float32 (ChannelCodec keeps it in bfloat16).

    None when the codec does not centre or already folds the mean into its codes (``mean_in_codes``).
    """
    if getattr(codec, "mean_in_codes", False):
        return None
    mu = getattr(codec, "mean", None)
    return None if mu is None else _f32(mu)


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
        return _f32(s), shift
    if _is_block(codec):
        # K^T quantized along tokens: q @ K^T is x @ W with W = K^T, the fast (transpose=False) form.
        s = mx.quantized_matmul(
            codec.rotation.apply(q), arrays["w_q"], arrays["scales"], arrays["biases"],
            transpose=False, group_size=codec.block, bits=codec.bits,
        )  # (B, H, M, n)
        return s, shift
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

    Aggregates in the rotated domain and rotates the ``(.., dv)`` result back once; adds ``l * mu`` (``l`` None:
    the caller adds the mean term itself).
    """
    if _is_affine(codec) and _packed_ok("values", p.shape[2], packed_rows):
        o_rot = mx.quantized_matmul(
            p, arrays["w_q"], arrays["scales"], arrays["biases"],
            transpose=False, group_size=codec.group_size, bits=codec.bits,
        )
        o = codec.rotation.invert(_f32(o_rot))
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
    if mu is not None and l is not None:
        o = o + l * mu[None, :, None, :]
    return o


# --------------------------------------------------------------------------------------------------------
# all parts in one softmax
# --------------------------------------------------------------------------------------------------------
def part_scores(q: mx.array, part: Part, mask, R: int, L: int, packed_rows: Optional[int] = None) -> mx.array:
    """Masked scores ``(B, Hkv, R*L, n)`` of grouped queries ``(B, Hkv, R*L, d)`` on one part.

    Units are whatever the queries carry (`packed_attention` passes log2 units); a coded part's mean
    shift ``q . mu`` is added, so scores of different parts are comparable. ``mask``: a segment mask.
    """
    if isinstance(part, ExactPart):
        s = q @ mx.swapaxes(_f32(part.keys), -1, -2)
    else:
        s, shift = coded_scores(q, part.k_codec, part.k_arrays, packed_rows)
        if shift is not None:
            s = s + shift
    return _apply_mask(s, mask, R, L)


def part_values(e: mx.array, l_part: Optional[mx.array], part: Part, packed_rows: Optional[int] = None) -> mx.array:
    """``sum_j e_j v_j`` over one part: weights ``(B, Hkv, M, n)`` -> ``(B, Hkv, M, dv)`` (unnormalized).

    ``l_part`` ``(B, Hkv, M, 1)`` is the weights' row sum; only a centred value codec needs it (else None).
    """
    if isinstance(part, ExactPart):
        return e @ _f32(part.values)
    return coded_values(e, l_part, part.v_codec, part.v_arrays, packed_rows)


def _needs_row_sum(part: Part) -> bool:
    return isinstance(part, CodedPart) and _mean(part.v_codec) is not None


def _shared_value_mean(parts: Sequence[Part]) -> Optional[mx.array]:
    """The value mean ``(H, dv)`` float32 when every coded part adds back one and the same (one codec), else None."""
    codecs = {id(p.v_codec): p.v_codec for p in parts if isinstance(p, CodedPart)}
    if len(codecs) != 1:
        return None
    return _mean(next(iter(codecs.values())))


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
    a = next(iter(part.v_arrays.values()))  # (B, H, ...) in every layout
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
        if grouped_mask.dtype != mx.bool_:
            grouped_mask = grouped_mask.astype(mx.float32) * LOG2E  # additive masks join log2 scores
    if sinks is not None and sinks.size != Hq:
        raise ValueError(f"sinks must hold one logit per query head ({Hq}), got shape {tuple(sinks.shape)}")
    # Scores in log2 units (scale and 1/ln 2 folded into the query once), so the softmax is 2**(s - max).
    # Rows ordered (head r, query l) within each KV head, as (B, Hkv, R, L, d) flattened.
    q = (_f32(queries) * (scale * LOG2E)).reshape(B, Hkv, R * L, d)
    scores, start = [], 0
    for p in parts:
        seg = _segment_mask(grouped_mask, start, start + p.length, L, N, window_size)
        scores.append(part_scores(q, p, seg, R, L, packed_rows))
        start += p.length
    # One softmax over every part: a single max, exponential and sum instead of one per part plus an
    # exact log-sum-exp merge (fewer, larger ops; the parts share the max, so no rescaling is needed).
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    m = mx.max(s, axis=-1, keepdims=True)
    sink_logits = None
    if sinks is not None:  # gpt-oss style sinks: join the denominator, carry no value
        sink_logits = mx.broadcast_to(
            (sinks.astype(mx.float32) * LOG2E).reshape(1, Hkv, R, 1), (1, Hkv, R, L)
        ).reshape(1, Hkv, R * L, 1)
        m = mx.maximum(m, sink_logits)
    if mask is not None:
        m = mx.maximum(m, NEG)  # finite even when a row is fully masked
    e = exp2_nonpositive(s - m, fused=L == 1)  # fused kernel at decode only (see exp2_nonpositive)
    l = mx.sum(e, axis=-1, keepdims=True)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p.length)
    # Centred coded values read Pi^T y + mu. With one shared mu, add it once with the total weight l and
    # take it off the exact parts' values instead (sum_coded e mu = l mu - sum_exact e mu): no per-part
    # row sums, 4-6 fewer ops per layer at decode. Otherwise per-part row sums where a centred value codec
    # needs them (the largest part's is l - the rest).
    mu = _shared_value_mean(parts)
    sums: Dict[int, mx.array] = {}
    if mu is not None:
        mu = mu[None, :, None, :]  # (1, Hkv, 1, dv)
    elif any(_needs_row_sum(p) for p in parts):
        big = max(range(len(parts)), key=lambda i: parts[i].length)
        for i in range(len(parts)):
            if i != big:
                sums[i] = mx.sum(e[..., bounds[i] : bounds[i + 1]], axis=-1, keepdims=True)
        sums[big] = l
        for i, v in list(sums.items()):
            if i != big:
                sums[big] = sums[big] - v
    o = None if mu is None else l * mu
    for i, p in enumerate(parts):
        e_i = e if len(parts) == 1 else e[..., bounds[i] : bounds[i + 1]]
        if mu is not None and isinstance(p, ExactPart):
            o_i = e_i @ (_f32(p.values) - mu)
        else:  # a coded part with mu shared gets l=None: its mean is in l * mu already
            o_i = part_values(e_i, sums.get(i), p, packed_rows)
        o = o_i if o is None else o + o_i
    if sink_logits is not None:
        l = l + exp2_nonpositive(sink_logits - m)
    out = (o / l).reshape(B, Hq, L, o.shape[-1])
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def _blocked_attention(queries, parts, scale, mask, sinks, window_size, packed_rows, N: int) -> mx.array:
    """`packed_attention` for a long chunk, ``QUERY_BLOCK`` query positions at a time.

    Coded parts are decoded once (float32, ``(B, Hkv, n, d)``) and shared by every block; the mask is
    made explicit and sliced along its query axis. Same result, bounded score memory.
    """
    L = queries.shape[2]
    # One exact part for the whole history (decoded once, shared by every block): each block then scores
    # a single tensor, with no per-block concatenation or slicing of its scores.
    ks, vs = [], []
    for p in parts:
        if isinstance(p, CodedPart):
            ks.append(p.k_codec.decode(p.k_arrays, mx.float32))
            vs.append(p.v_codec.decode(p.v_arrays, mx.float32))
        else:
            ks.append(_f32(p.keys))
            vs.append(_f32(p.values))
    exact = [ExactPart(ks[0], vs[0]) if len(ks) == 1 else
             ExactPart(mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))]
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
    - ``cache.exact_tail_from`` (int, default 0): tail tokens before this index read as coded, so they are
      encoded here (a few tokens), exactly as the cache's own fetch does;
    - ``cache.codes`` (``.length``) and ``cache.coded_arrays()`` -> ``(key arrays, value arrays)`` of the
      coded tokens in their codecs' layouts;
    - ``cache.k_codec``, ``cache.v_codec``: the codecs that wrote them.
    Temporal order is ``[sink | codes | tail]``.
    """
    parts: List[Part] = []
    sink = getattr(cache, "sink_store", None)
    if sink is not None and sink.length:
        s = sink.view()
        parts.append(ExactPart(s["k"], s["v"]))
    if cache.codes.length:
        k_arrays, v_arrays = cache.coded_arrays()
        parts.append(CodedPart(cache.k_codec, k_arrays, cache.v_codec, v_arrays))
    tail = getattr(cache, "tail", None)
    if tail is not None and tail.length:
        n_old = int(getattr(cache, "exact_tail_from", 0))
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
    _check_queries(queries)  # clear errors before the shape is read below
    parts = cache_parts(cache)
    exact = [p for p in parts if isinstance(p, ExactPart)]
    if len(exact) > 1 and queries.shape[2] == 1 and (mask is None or (isinstance(mask, str) and mask == "causal")):
        # One decode query sees every key, so the order of the keys does not matter: the exact sink and
        # tail become one part (two small concatenations instead of a second matmul pair and slices).
        coded = [p for p in parts if isinstance(p, CodedPart)]
        merged = ExactPart(mx.concatenate([p.keys for p in exact], axis=2),
                           mx.concatenate([p.values for p in exact], axis=2))
        parts, mask = coded + [merged], None
    return packed_attention(queries, parts, scale, mask, sinks=sinks, packed_rows=packed_rows)
