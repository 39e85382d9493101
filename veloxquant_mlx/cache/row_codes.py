"""What the codecs store for `Rows` (:mod:`veloxquant_mlx.cache.rows`): one codec's code slots of B rows
(`RowCodes`), the tail's coder when a layout codes its waiting tokens (`TailCoder`, `CodedTail`'s coder), and what a
codec declares, read once per configuration (`_layouts`); with the small array helpers the row modules share.
"""
from __future__ import annotations

import copy
import threading
from typing import Dict, Optional, Sequence

import mlx.core as mx

from veloxquant_mlx.codecs import codec_layout


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def fold(a: mx.array) -> mx.array:
    """``(B, H, ...)`` -> ``(1, B*H, ...)``: codecs then treat every (sequence, head) as a head of their own."""
    return a if a.shape[0] == 1 else a.reshape((1, a.shape[0] * a.shape[1]) + tuple(a.shape[2:]))


def column(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32).reshape(-1, 1, 1, 1)


class TailCoder:
    """How a block layout stores the tokens waiting for their key block (`CodedTail`'s coder): keys as the key
    codec's provisional per-token codes (``tail_codec()``), values as the value codec's own codes (they move into
    the value store unchanged when their block is coded). Raw fields ``k_<field>`` / ``v_<field>``.

    Centred block keys (``center_keys``) centre the provisional codes on the same fitted mean: the coder is then
    bound to the rows' folded key codec (`bound`, ``(B*H, d)`` means: the batch is folded into the heads to code),
    and each row fits on arrival (`Rows.append`), before any of its tokens is stored."""

    def __init__(self, k_codec, v_codec, key_codec=None):
        self.k, self.v = k_codec, v_codec
        self.key_codec = key_codec  # the block key codec whose fitted mean centres the provisional keys (or None)

    @property
    def centred(self) -> bool:
        return self.k.center

    def bound(self, key_codec) -> "TailCoder":
        """This coder with the provisional keys centred on ``key_codec``'s fitted mean (folded over rows)."""
        return TailCoder(key_codec.tail_codec(), self.v, key_codec)

    @staticmethod
    def for_codecs(options, base) -> Optional["TailCoder"]:
        """The coder of a layout that declares one (a key codec with ``tail_codec``, a value codec with
        ``codes_tail``), when nothing but the keys' mean is fitted and no exact window is asked for; else None
        (an exact tail)."""
        k, v = base
        if not (hasattr(k, "tail_codec") and getattr(v, "codes_tail", False)) or options.recent:
            return None
        if set(k.blank_fitted(1)) - {"mean"} or v.blank_fitted(1):
            return None
        return TailCoder(k.tail_codec(), v)

    def fields(self, dims) -> Dict[str, tuple]:
        return {**{"k_" + f: spec for f, spec in self.k.token_fields().items()},
                **{"v_" + f: spec for f, spec in self.v.token_fields().items()}}

    def split(self, raw: Dict[str, mx.array]):
        """Raw fields -> (key codes, value codes)."""
        return ({f[2:]: a for f, a in raw.items() if f.startswith("k_")},
                {f[2:]: a for f, a in raw.items() if f.startswith("v_")})

    def _folds(self, x: mx.array) -> bool:
        """Whether ``(B, H, ...)`` arrays go through the key codec folded ``(1, B*H, ...)`` (per-row means)."""
        mean = self.k.mean if self.centred else None
        return mean is not None and x.shape[0] > 1 and mean.shape[0] == x.shape[0] * x.shape[1]

    def encode(self, chunk: Dict[str, mx.array]) -> Dict[str, mx.array]:
        k = chunk["k"]
        if self._folds(k):
            B, H = k.shape[:2]
            k_codes = {f: a.reshape((B, H) + a.shape[2:])
                       for f, a in self.k.encode(k.reshape((1, B * H) + k.shape[2:])).items()}
        else:
            k_codes = self.k.encode(k)
        return {**{"k_" + f: a for f, a in k_codes.items()},
                **{"v_" + f: a for f, a in self.v.encode(chunk["v"]).items()}}

    def decode(self, raw: Dict[str, mx.array], dtypes) -> Dict[str, mx.array]:
        k, v = self.split(raw)
        first = next(iter(k.values()))
        if self._folds(first):
            B, H = first.shape[:2]
            keys = self.k.decode({f: a.reshape((1, B * H) + a.shape[2:]) for f, a in k.items()}, dtypes["k"])
            keys = keys.reshape((B, H) + keys.shape[2:])
        else:
            keys = self.k.decode(k, dtypes["k"])
        return {"k": keys, "v": self.v.decode(v, dtypes["v"])}


# -- what a codec declares, read once per configuration ------------------------------------------------------
_LAYOUTS: Dict[tuple, tuple] = {}


def _layouts(options, dims, heads):
    """(base codecs, code layouts, blank fitted arrays) of one configuration: the same for every layer and merge."""
    # per thread: MLX arrays belong to the stream of the thread that made them (mlx_lm.server generates in its own)
    key = (options, dims, heads, threading.get_ident())
    hit = _LAYOUTS.get(key)
    if hit is None:
        base = codec_layout(options.codec).make(options, *dims)
        for c in base:
            for name, a in c.blank_fitted(heads).items():
                if a.shape[0] != heads:
                    raise ValueError(f"codec={options.codec!r}: fitted array {name!r} of shape {tuple(a.shape)} is "
                                     f"not per head ({heads} heads), so sequences cannot be batched")
        layouts = tuple({f: (c.axis, c.units, tuple(c.block_shape), c.dtype)
                         for f, c in codec.code_layout(heads).items()} for codec in base)
        hit = _LAYOUTS[key] = (base, layouts, tuple(c.blank_fitted(heads) for c in base))
    return hit


class RowCodes:
    """One codec's codes of B rows: arrays ``(B, H, ...)`` holding ``capacity`` token slots per row."""

    def __init__(self, codec, layout: dict, grow: int):
        self.codec, self.layout, self.grow, self.block = codec, layout, grow, codec.token_block
        self.arrays: Dict[str, mx.array] = {}
        self.capacity = 0

    @property
    def arrays(self) -> Dict[str, mx.array]:
        return self._arrays

    @arrays.setter
    def arrays(self, value: Dict[str, mx.array]) -> None:
        self._arrays = value
        self._views = {}  # `folded` / `row_view` views (and `Rows._coded_part` s) of the arrays just replaced

    def zeros(self, rows: int, tokens: int) -> Dict[str, mx.array]:
        out = {}
        for f, (axis, units, shape, dtype) in self.layout.items():
            shape = list(shape)
            shape[0], shape[axis] = rows, units * tokens // self.block
            out[f] = mx.zeros(shape, dtype)
        return out

    def padded(self, rows: int, capacity: int) -> Dict[str, mx.array]:
        """The arrays grown to ``capacity`` slots (zeros after), ``self`` unchanged."""
        if capacity <= self.capacity:
            return self.arrays
        extra = self.zeros(rows, capacity - self.capacity)
        return self.codec.concat([self.arrays, extra]) if self.arrays else extra

    def reserve(self, rows: int, tokens: int) -> None:
        """At least ``tokens`` slots per row (zeros: finite, never attended)."""
        if tokens > self.capacity:
            new = _round_up(tokens, self.grow)
            self.arrays, self.capacity = self.padded(rows, new), new

    def _index(self, f: str, row: int, start: int, stop: int):
        axis, units, _, _ = self.layout[f]
        lo, hi = start // self.block * units, stop // self.block * units
        return (slice(row, row + 1),) + (slice(None),) * (axis - 1) + (slice(lo, hi),)

    def write_row(self, row: int, start: int, codes: Dict[str, mx.array], rows: int) -> None:
        """Row ``row``'s slots from ``start`` get ``codes`` (one row, whole blocks)."""
        n = self.codec.n_tokens(codes)
        if rows == 1 and start == self.capacity and self.block > 1:
            # one sequence coding its next block: append, the arrays stay exactly full and contiguous (what the
            # scoring matmul wants), one copy of the codes per block
            self.arrays = self.codec.concat([self.arrays, codes]) if self.arrays else dict(codes)
            self.capacity += n
            return
        self.reserve(rows, start + n)
        self._views = {}
        for f, a in codes.items():
            self.arrays[f][self._index(f, row, start, start + n)] = a

    def folded(self, n: int) -> Dict[str, mx.array]:
        """The first ``n`` slots of every row, folded to ``(1, B*H, ...)`` (views kept until the arrays change)."""
        hit = self._views.get(n)
        if hit is None:
            self._bound_views()
            hit = {f: fold(a) for f, a in self.arrays.items()}
            hit = self._views[n] = hit if n == self.capacity else self.codec.slice_tokens(hit, 0, n)
        return hit

    def _bound_views(self) -> None:
        if len(self._views) >= 8:  # (trims move the ranges without replacing the arrays)
            self._views.clear()

    def row_view(self, i: int, start: int, stop: int) -> Dict[str, mx.array]:
        """Row ``i``'s slots ``[start, stop)`` ``(1, H, ...)`` (views, the same objects until the arrays change)."""
        key = (i, start, stop)
        hit = self._views.get(key)
        if hit is None:
            self._bound_views()
            arrays = self.arrays if self.arrays[next(iter(self.arrays))].shape[0] == 1 else \
                {f: a[i:i + 1] for f, a in self.arrays.items()}
            hit = self._views[key] = arrays if (start, stop) == (0, self.capacity) else \
                self.codec.slice_tokens(arrays, start, stop)
        return hit

    def row_live(self, i: int, pin: int, gone: int, coded: int) -> Dict[str, mx.array]:
        """Row ``i``'s live codes without the evicted hole, in their own memory (what a saved state holds)."""
        if not coded or not self.arrays:
            return {}
        pieces = [self.row_view(i, 0, min(pin, coded))] if gone and pin else []
        pieces.append(self.row_view(i, pin + gone if gone else 0, coded))
        return {f: mx.contiguous(a) for f, a in self.codec.concat([p for p in pieces if p]).items()}

    def drop(self, lo: int, hi: int) -> None:
        """Forget slots ``[lo, hi)`` of every row (a sliding window's evicted tokens; one copy)."""
        pieces = [self.codec.slice_tokens(self.arrays, 0, lo)] if lo else []
        pieces.append(self.codec.slice_tokens(self.arrays, hi, self.capacity))
        self.arrays = {f: mx.contiguous(a) for f, a in self.codec.concat(pieces).items()}
        self.capacity -= hi - lo

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots (rounded up to a growth step): frees trimmed or taken-away slots."""
        cap = _round_up(n, self.grow)
        if cap < self.capacity:
            kept = self.codec.slice_tokens(self.arrays, 0, cap) if cap else {}
            self.arrays, self.capacity = {f: mx.contiguous(a) for f, a in kept.items()}, cap

    def copy(self) -> "RowCodes":
        new = copy.copy(self)
        new.arrays = {f: copy.copy(a) for f, a in self.arrays.items()}  # new objects, shared data (as TokenStore.copy)
        return new

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

