"""The history's parts and what attention computes on each one: masks, scores, weighted values.

`ExactPart` / `CodedPart` (the history in temporal order, see :mod:`veloxquant_mlx.attention.packed_sdpa`), the
masks restricted to one part, a part's scores and its weighted values (a shared value offset added once), and the
short-history softmax of a decode step over them. Pure functions that name no codec; the entry points, the tunables
that route between them and the shared-max ``2**t`` softmax are in :mod:`veloxquant_mlx.attention.packed_sdpa`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from veloxquant_mlx.codecs.common import f32
from veloxquant_mlx.quant.rope import OFFSET_BLOCK, offset_keys, offset_scores, turns

# A finite "minus infinity" for masked scores: exp(NEG - m) underflows to 0 without 0 * inf NaNs.
NEG = float(mx.finfo(mx.float32).min)


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


class KeyOffset:
    """What a part's stored keys lack: ``R_t mu`` (`veloxquant_mlx.quant.rope`), ``mu`` ``(G, d)`` float32 per
    folded head, the part's slot ``j`` at position ``starts[g] + j`` (``starts`` ``(G,)`` int32). A cache keeps
    one object per part while ``mu`` and the starts stay (`veloxquant_mlx.cache.row_views`): what depends on them
    alone is computed once (the keys' offsets for up to `KEY_TABLE` more slots, the per-block tables; `table` and
    `turns`, what the compiled kernel reads to add the scores itself, shared by the parts of one ``mu``)."""

    KEY_TABLE = 256  # offsets computed ahead for a growing part (a tail gains a slot per decode step)
    KEPT_KEYS = 1024  # offsets kept for parts of at most this many slots (sinks, tails); longer ones: each call

    def __init__(self, frame, mu: mx.array, starts: mx.array, shared: Optional[dict] = None):
        self.frame, self.mu, self.starts = frame, mu, starts
        self._keys: Optional[mx.array] = None  # (1, G, m, d) for slots < m
        self._blocks: Dict[int, Tuple[mx.array, mx.array]] = {}  # blocks -> (cos, sin) of -s0 * rates
        self._shared = {} if shared is None else shared  # what depends on mu alone (the parts of one cache share it)
        self._turns: Optional[mx.array] = None  # (G, blocks, dims)

    TURN_BLOCKS = 16  # block turns computed ahead for a growing part

    def turns(self, n: int) -> mx.array:
        """The cos then sin of each pair's angle at ``-s0`` for the blocks of ``OFFSET_BLOCK`` slots covering ``n``
        slots (``s0`` a block's first position), as the compiled kernel reads them: ``(G, blocks, dims)`` float32,
        blocks ``>= ceil(n / OFFSET_BLOCK)`` (computed ahead; the same values `offset_scores` computes)."""
        nb = max(-(-n // OFFSET_BLOCK), 1)
        have = self._turns
        if have is None or have.shape[1] < nb:
            cap = nb + self.TURN_BLOCKS
            s0 = self.starts.reshape(-1, 1) + mx.arange(cap) * OFFSET_BLOCK  # (G, cap)
            c, s = turns(-s0, self.frame)
            have = self._turns = mx.concatenate([c, s], axis=-1)
        return have

    def table(self) -> mx.array:
        """``R_j mu`` for ``j < OFFSET_BLOCK`` as the compiled kernel reads it: ``(G, OFFSET_BLOCK/32, d, 32)``
        float32, channel-major tiles of 32 slots (computed once per ``mu``)."""
        if "table" not in self._shared:
            G, d = self.mu.shape
            u = offset_keys(self.mu, mx.zeros((G,), dtype=mx.int32), OFFSET_BLOCK, self.frame)  # (G, blk, d)
            self._shared["table"] = mx.contiguous(mx.swapaxes(u.reshape(G, OFFSET_BLOCK // 32, 32, d), -1, -2))
        return self._shared["table"]

    def keys(self, n: int) -> mx.array:
        """``R_t mu`` ``(1, G, n, d)`` float32."""
        if n + self.KEY_TABLE > self.KEPT_KEYS:  # (a long chunk's decoded history: no table held per layer)
            return offset_keys(self.mu, self.starts, n, self.frame)[None]
        if self._keys is None or self._keys.shape[2] < n:
            self._keys = offset_keys(self.mu, self.starts, n + self.KEY_TABLE, self.frame)[None]
        return self._keys if self._keys.shape[2] == n else self._keys[:, :, :n]

    def scores(self, q: mx.array, n: int) -> mx.array:
        """``q . R_t mu`` for grouped queries ``q`` ``(1, G, M, d)`` (or ``(B, H, M, d)``, ``B*H = G``):
        ``(.., M, n)`` float32 of ``q``'s leading shape."""
        lead = q.shape[:-2]
        return offset_scores(q.reshape(-1, q.shape[-2], q.shape[-1]).astype(mx.float32), self.mu, self.starts, n,
                             self.frame, self._blocks).reshape(lead + (q.shape[-2], n))


@dataclass
class CodedPart:
    """Tokens held as codes: ``k_arrays`` / ``v_arrays`` are what ``k_codec`` / ``v_codec`` encoded (n tokens).

    ``within``: ``(whole, lo, hi)`` when these codes are slots ``[lo, hi)`` of the coded part ``whole`` (views of
    its arrays; a sliding window's parts on either side of its evicted slots): the compiled kernel then reads all
    such parts of one ``whole`` in one pass over its codes, skipping the slots between them. ``key_offset``: what
    the coded keys lack (a `KeyOffset`: keys stored less their rotated mean before RoPE), or None."""

    k_codec: object
    k_arrays: Dict[str, mx.array]
    v_codec: object
    v_arrays: Dict[str, mx.array]
    within: Optional[Tuple["CodedPart", int, int]] = None
    key_offset: Optional[KeyOffset] = None

    @property
    def length(self) -> int:
        return self.k_codec.n_tokens(self.k_arrays)


def coded_keys(part: "CodedPart", dtype) -> mx.array:
    """A coded part's keys decoded ``(B, H, n, d)`` in ``dtype``, with its key offset."""
    k = part.k_codec.decode(part.k_arrays, mx.float32 if part.key_offset is not None else dtype)
    if part.key_offset is None:
        return k
    return (k + part.key_offset.keys(k.shape[2]).reshape(k.shape)).astype(dtype)


def coded_scores(q: mx.array, part: "CodedPart", packed_rows: Optional[int] = None) -> mx.array:
    """Scores of grouped queries ``(B, Hkv, M, d)`` on a coded part ``(B, Hkv, M, n)``, with its key offset."""
    s = part.k_codec.scores(q, part.k_arrays, packed_rows)
    if part.key_offset is None:
        return s
    return s + part.key_offset.scores(q, s.shape[-1])


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
        s = coded_scores(q, part, packed_rows)
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
    # (tests/apps/test_distributed.py) though equal in one process; not understood yet, so the sum stays explicit.
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


# --------------------------------------------------------------------------------------------------------
# the exact band of a chunk: each query reads its newest keys as the decode steps would
# --------------------------------------------------------------------------------------------------------
def band_columns(parts: Sequence[Part], band: ExactPart) -> Tuple[int, int, mx.array]:
    """``(N, M, coded)``: the history's length, how many of its last positions ``band`` copies (at most N) and which
    of those the parts hold as codes, bool ``(M,)``."""
    parts = [p for p in parts if p.length > 0]
    N = sum(p.length for p in parts)
    M = min(band.length, N)
    flags = [mx.full((p.length,), isinstance(p, CodedPart), dtype=mx.bool_) for p in parts]
    return N, M, mx.concatenate(flags)[N - M:]


def base_mask(mask, L: int, N: int, window_size: Optional[int] = None) -> mx.array:
    """``mask`` (None, "causal" with ``window_size``, or an array broadcastable to ``(.., L, N)``) as an array
    ``(.., L, N)``: bool for None / "causal", else the array's own kind."""
    if mask is None:
        return mx.ones((L, N), dtype=mx.bool_)
    if isinstance(mask, str):
        return _segment_mask("causal", 0, N, L, N, window_size) if L > 1 else mx.ones((L, N), dtype=mx.bool_)
    return mx.broadcast_to(mask, mask.shape[:-2] + (L, N))


def band_mask(base: mx.array, first_q: int, lo: int, coded: mx.array, recent: int) -> mx.array:
    """``base`` ``(.., l, N)`` (queries at positions ``first_q ..``) widened by the band copies of positions
    ``[lo, lo + len(coded))`` -> ``(.., l, N + len(coded))``: a coded position among a query's ``recent`` newest is
    read from its copy and hidden in the parts; every other copy is hidden."""
    l, N, n = base.shape[-2], base.shape[-1], coded.shape[0]
    q_pos = mx.arange(first_q, first_q + l)[:, None]
    k_pos = mx.arange(lo, lo + n)[None, :]
    in_band = (q_pos - k_pos < recent) & coded  # (l, n)
    parts_side = in_band
    if lo or lo + n < N:
        parts_side = mx.concatenate([x for x in (mx.zeros((l, lo), dtype=mx.bool_) if lo else None, in_band,
                                                 mx.zeros((l, N - lo - n), dtype=mx.bool_) if lo + n < N else None)
                                     if x is not None], axis=-1)  # (l, N)
    copies = base[..., lo:lo + n]
    if base.dtype == mx.bool_:
        return mx.concatenate([base & ~parts_side, copies & in_band], axis=-1)
    far = mx.array(NEG, dtype=base.dtype)
    return mx.concatenate([mx.where(parts_side, far, base), mx.where(in_band, copies, far)], axis=-1)


def with_exact_band(parts: Sequence[Part], band: ExactPart, recent: int, L: int, mask,
                    window_size: Optional[int] = None) -> Tuple[List[Part], object]:
    """``parts`` and ``mask`` such that each of the last ``L`` queries reads its ``recent`` newest keys exact.

    A cache keeping its newest ``recent`` tokens exact codes a chunk's older tokens before the chunk's own queries
    read them; fed one token at a time, each of those queries would have read its ``recent`` newest keys exact.
    ``band`` holds exact copies of the history's last ``M`` positions ``(B, Hkv, M, d)``: it joins the parts, and
    the mask shows a query a coded position's copy (and hides the coded original) when that position is among its
    ``recent`` newest. ``mask`` as `packed_attention` takes it (None, "causal" with ``window_size``, or a bool or
    additive array ``(.., L, N)``); returns the parts with ``band`` last and a mask ``(.., L, N + M)`` of the same
    kind (a bool array for None / "causal"). Long chunks: `veloxquant_mlx.attention.packed_sdpa.banded_attention`
    reads only the copies each block of queries needs.
    """
    parts = [p for p in parts if p.length > 0]
    N, M, coded = band_columns(parts, band)
    if M < band.length:
        band = ExactPart(band.keys[:, :, -M:], band.values[:, :, -M:])
    return parts + [band], band_mask(base_mask(mask, L, N, window_size), N - L, N - M, coded, recent)
