"""Attention views of `Rows` (:mod:`veloxquant_mlx.cache.row_policy`): the parts attention reads, every row folded
(`attention_parts`, with `part_masks`) or one row alone (`row_parts`), as a mixin the `Rows` class inherits.
"""
from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, KeyOffset
from veloxquant_mlx.cache.row_codes import column
from veloxquant_mlx.quant.slot_store import fold


class RowViews:
    """`Rows`' attention parts (a mixin: it reads the rows' counts, stores and codecs)."""

    # -- attention parts ------------------------------------------------------------------------------
    def part_sizes(self):
        return (max(self.sink_n) if self.sink is not None else 0, max(self.coded, default=0), self.tail.length)

    def _old_tail(self, L: int) -> int:
        """Tail slots read through a round trip (per-token codecs with an exact window: all but the last
        ``recent``); block codecs keep their whole tail exact until its blocks are coded."""
        r = self.options.recent
        return L - r if self.block == 1 and r and L > r else 0

    def attention_parts(self, lockstep: bool = False) -> list:
        """Every row's tokens as attention parts ``[sink | codes | tail]``, folded ``(1, B*H, ...)`` (the folded
        codecs' per-head parameters are per sequence); which slots each row holds is `part_masks`'. ``lockstep``:
        every row holds the same slots (sequences stored together, as mlx_lm's KVCache holds them): the codes skip
        a window's evicted slots instead of leaving them to a mask."""
        S, C, L = self.part_sizes()
        parts: list = []
        mu = self.rope_mu()  # (keys stored less R_t mu: each part gets it back, `_exact_offset` / `_key_offset`)
        if S:
            parts.append(self._sink_part(S))
            if mu is not None:
                parts[-1] = self._exact_offset(parts[-1], mu, [0] * self.B)
        if C:
            k, v, g = self.k_codes.folded(C), self.v_codes.folded(C), self.gone[0]
            spans = [(0, min(self.pin, C)), (self.pin + g, C)] if lockstep and g else [(0, C)]
            spans = [(lo, hi) for lo, hi in spans if hi > lo]
            whole = self._coded_part(self.k_codec, k, self.v_codec, v) if len(spans) > 1 else None
            for lo, hi in spans:
                kk, vv = (k, v) if (lo, hi) == (0, C) else (self.k_codec.slice_tokens(k, lo, hi),
                                                            self.v_codec.slice_tokens(v, lo, hi))
                parts.append(self._coded_part(self.k_codec, kk, self.v_codec, vv))
                parts[-1].within = None if whole is None else (whole, lo, hi)  # (the kernel: one pass)
                if mu is not None:
                    parts[-1].key_offset = self._key_offset(mu, [S] * self.B)
        if L:
            t = {n: fold(a) for n, a in self.tail.buffers.items()}
            if L < self.tail.capacity:
                t = {n: a[:, :, :L] for n, a in t.items()}
            old = self._old_tail(L)
            if old:
                parts.append(CodedPart(self.k_codec, self.k_codec.encode(t["k"][:, :, :old]),
                                       self.v_codec, self.v_codec.encode(t["v"][:, :, :old])))
                t = {n: a[:, :, old:] for n, a in t.items()}
            parts.append(ExactPart(t["k"], t["v"]))
            if mu is not None:
                parts[-1] = self._exact_offset(parts[-1], mu, [n - L for n in self.lengths])
        return parts

    # -- keys stored less their rotated mean before RoPE (``rope_offset``) ----------------------------
    def _key_offset(self, mu: mx.array, starts) -> KeyOffset:
        """The `KeyOffset` of a part whose slot 0 is at position ``starts[r]`` in row r (``mu`` ``(r*H, d)``): the
        same object while ``mu`` and the starts stay (its tables are computed once, not every decode step)."""
        memo = getattr(self, "_offsets", None)
        if memo is None or memo[0] is not mu:
            memo = self._offsets = (mu, {}, {})
        key = tuple(starts)
        if key not in memo[1]:
            if len(memo[1]) > 8:  # (a tail's start moves on with each coded block)
                memo[1].clear()
            memo[1][key] = KeyOffset(self.rope, mu, mx.repeat(mx.array(starts, dtype=mx.int32), self.heads),
                                     memo[2])
        return memo[1][key]

    def _exact_offset(self, part: ExactPart, mu: mx.array, starts) -> ExactPart:
        """An exact part's keys with ``R_t mu`` added back (float32)."""
        k = part.keys
        back = self._key_offset(mu, starts).keys(k.shape[2]).reshape(k.shape)
        return ExactPart(k.astype(mx.float32) + back, part.values)

    def band_before(self, keys: mx.array, values: mx.array, lead=None, real=None) -> Optional[list]:
        """Exact copies of what a chunk's queries read as their newest keys (`with_exact_band`), taken before the
        chunk ``(B, H, T, d)`` is stored: per row, its tail's newest ``recent - 1`` tokens and its real new ones,
        ``(keys, values)`` ``(1, H, M, d)``, or None. None for one token (a decode step reads its window exact)
        or without an exact window."""
        r = self.options.recent
        if keys.shape[2] < 2 or not r:
            return None
        lead = lead or [0] * keys.shape[0]
        real = real or [keys.shape[2]] * keys.shape[0]
        L, out = self.tail.length, []
        raw = self.tail.view() if L and self.tail.coder is None else None
        for i in range(keys.shape[0]):
            if not real[i]:
                out.append(None)
                continue
            new = [x[i:i + 1, :, lead[i]:lead[i] + real[i]] for x in (keys, values)]
            old = min(r - 1, self.tail_n[i]) if raw is not None else 0
            if old:
                new = [mx.concatenate([raw[n][i:i + 1, :, L - old:L].astype(x.dtype), x], axis=2)
                       for n, x in zip(("k", "v"), new)]
            out.append(tuple(new))
        return out

    def band_applies(self) -> bool:
        """Whether a chunk's queries read `band_before`'s copies: behind an exact window (``recent``)."""
        return bool(self.options.recent)

    def _coded_part(self, k_codec, k_arrays, v_codec, v_arrays) -> CodedPart:
        """The same `CodedPart` object while its codecs and code views are the same objects: decode steps between
        two coded blocks reuse it, and what the compiled attention derives from it (`kernel.decode_step`). Kept
        with the views, so it goes when the codes change (never holding superseded arrays alive)."""
        key = ("part", id(k_arrays), id(v_arrays))
        part = self.k_codes._views.get(key)
        if part is None or part.k_arrays is not k_arrays or part.v_arrays is not v_arrays or \
                part.k_codec is not k_codec or part.v_codec is not v_codec or self.v_codes._views.get(key) is not part:
            part = CodedPart(k_codec, k_arrays, v_codec, v_arrays)
            for store in (self.k_codes, self.v_codes):
                store._bound_views()
                store._views[key] = part
        return part

    def _sink_part(self, S: int) -> ExactPart:
        """The sink's first ``S`` slots, folded; kept while the sink arrays are the same objects."""
        k, v = self.sink["k"], self.sink["v"]
        last = self._sink_views
        if last is not None and last[0] is k and last[1] is v and last[2] == S:
            return last[3]
        part = ExactPart(*(fold(a if S == a.shape[2] else a[:, :, :S]) for a in (k, v)))
        self._sink_views = (k, v, S, part)
        return part

    def part_masks(self) -> Optional[List[Optional[mx.array]]]:
        """One entry per `attention_parts` part: bool ``(B, 1, 1, n)``, True on each row's stored tokens, or None
        where every row fills the part; None when no part has a pad slot."""
        S, C, L = self.part_sizes()
        old = self._old_tail(L)
        lo_tail = [L - t for t in self.tail_n]
        spans = [(S, [0] * self.B, self.sink_n, None), (C, [0] * self.B, self.coded, self.gone),
                 (old, lo_tail, [old] * self.B, None), (L - old, [x - old for x in lo_tail], [L - old] * self.B, None)]
        masks = []
        for n, lo, hi, hole in spans:
            if not n:
                continue
            if any(lo) or any(h != n for h in hi) or (hole and any(hole)):
                slot = mx.arange(n, dtype=mx.int32).reshape(1, 1, 1, n)
                m = (slot >= column(lo)) & (slot < column(hi))
                if hole and any(hole):
                    m &= (slot < self.pin) | (slot >= self.pin + column(hole))
                masks.append(m)
            else:
                masks.append(None)
        return masks if any(m is not None for m in masks) else None

    def row_parts(self, i: int) -> list:
        """Row ``i``'s stored tokens alone, ``[sink | codes | tail]`` with its own codecs: exactly the parts the
        sequence alone attends (views, no pad slot, no evicted slot)."""
        parts: list = []
        one = self.B == 1
        mu = self.rope_mu(i)
        if self.sink_n[i]:
            n = self.sink_n[i]
            parts.append(ExactPart(*((a if n == a.shape[2] else a[:, :, :n]) if one else a[i:i + 1, :, :n]
                                     for a in (self.sink["k"], self.sink["v"]))))
            if mu is not None:
                parts[-1] = self._exact_offset(parts[-1], mu, [0])
        coded, gone = self.coded[i], self.gone[i]
        spans = [(lo, hi) for lo, hi in ([(0, min(self.pin, coded)), (self.pin + gone, coded)] if gone else
                                         [(0, coded)]) if hi > lo]
        whole = self._coded_part(self.row_codec(0, i), self.k_codes.row_view(i, 0, coded), self.row_codec(1, i),
                                 self.v_codes.row_view(i, 0, coded)) if len(spans) > 1 else None
        for lo, hi in spans:
            parts.append(self._coded_part(self.row_codec(0, i), self.k_codes.row_view(i, lo, hi),
                                          self.row_codec(1, i), self.v_codes.row_view(i, lo, hi)))
            parts[-1].within = None if whole is None else (whole, lo, hi)  # (the kernel: one pass)
            if mu is not None:
                parts[-1].key_offset = self._key_offset(mu, [self.sink_n[i]])
        if self.tail_n[i] and self.tail.coder is not None:
            # a coded tail is one more coded part (provisional keys, values as coded): the kernel reads it from its
            # codes in the same call as the blocks (`kernel._tail_arguments`), the reference like any codes
            L, coder = self.tail.length, self.tail.coder
            store = self.tail.raw
            memo = getattr(self, "_tail_parts", {}).get(i)
            # the same part while the tail is unchanged (attention asks for the parts more than once a step)
            if memo is None or memo[0] != (L, self.tail_n[i], store.writes) or memo[1] is not store or \
                    (mu is not None and memo[2].key_offset is not None and
                     memo[2].key_offset.mu is not mu):
                raw = {n: a[:, :, L - self.tail_n[i]:L] if one else a[i:i + 1, :, L - self.tail_n[i]:L]
                       for n, a in self.tail.raw.buffers.items()}
                ks, vs = coder.split(raw)
                memo = ((L, self.tail_n[i], store.writes), store,
                        CodedPart(self._tail_key_codec(i), ks, coder.v, vs))
                if mu is not None:
                    memo[2].key_offset = self._key_offset(mu, [self.lengths[i] - self.tail_n[i]])
                self._tail_parts = {**getattr(self, "_tail_parts", {}), i: memo}
            parts.append(memo[2])
        elif self.tail_n[i]:
            L = self.tail.length
            t = {n: a[:, :, L - self.tail_n[i]:L] if one else a[i:i + 1, :, L - self.tail_n[i]:L]
                 for n, a in self.tail.buffers.items()}
            old = max(self.tail_n[i] - self.options.recent, 0) if self.block == 1 and self.options.recent else 0
            if old:
                kc, vc = self.row_codec(0, i), self.row_codec(1, i)
                parts.append(CodedPart(kc, kc.encode(t["k"][:, :, :old]), vc, vc.encode(t["v"][:, :, :old])))
            parts.append(ExactPart(t["k"][:, :, old:], t["v"][:, :, old:]) if old else ExactPart(t["k"], t["v"]))
            if mu is not None:
                parts[-1] = self._exact_offset(parts[-1], mu, [self.lengths[i] - self.tail_n[i] + old])
        return parts
