"""`SlotStore`: named arrays that share a token axis, grown in fixed steps, laid out as a codec declares them.

Every cache here keeps its per-token data (a codec's code words and scales, norms, exact window tokens) as arrays of
``B`` rows holding ``capacity`` token slots. A store is driven by its layout, ``{field: (axis, units, block_shape,
dtype)}`` (a codec's declared ``code_layout``: the token axis, array entries per block of ``block`` tokens, one
row's arrays of one block): it grows by whole steps of slots, writes, views and slices token ranges, truncates,
deletes ranges, copies (copy-on-write) and reloads, for every field at once. Exact tokens are the plain layout: no
declared layout, every field read from its arrays as ``(B, H, n, ...)`` (tokens on axis 2, one slot each), which
is also the bookkeeping `mlx_lm.models.cache.KVCache` does for its two tensors (grow by ``step``, write a slice,
view the live prefix, drop from the end). It knows nothing about quantization.

``length`` counts the live tokens of a store written at its end (`append`, `trim`, `delete`: a tail, the seed's RVQ
cache); a store written row by row (`write_row`: one codec's codes of B rows) leaves each row's count to its owner.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional, Sequence

import mlx.core as mx

TOKEN_AXIS = 2  # the plain layout's token axis: (B, H, n, ...)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def fold(a: mx.array) -> mx.array:
    """``(B, H, ...)`` -> ``(1, B*H, ...)``: codecs then treat every (sequence, head) as a head of their own."""
    return a if a.shape[0] == 1 else a.reshape((1, a.shape[0] * a.shape[1]) + tuple(a.shape[2:]))


def plain_layout(arrays: Dict[str, mx.array]) -> dict:
    """The layout of exact ``(B, H, n, ...)`` arrays: tokens on axis 2, one slot per token."""
    return {f: (TOKEN_AXIS, 1, (1, a.shape[1], 1) + tuple(a.shape[TOKEN_AXIS + 1:]), a.dtype)
            for f, a in arrays.items()}


class SlotStore:
    """Step-grown arrays ``field -> (B, ...)`` of ``capacity`` token slots in ``layout`` (None: the plain layout)."""

    def __init__(self, step: int = 256, layout: Optional[dict] = None, block: int = 1):
        self.writes = 0  # mutations so far: what a memo of the stored tokens checks (slots are written in place)
        self.step, self.layout, self.block = int(step), layout, block
        self.arrays, self.length = {}, 0

    @property
    def arrays(self) -> Dict[str, mx.array]:
        return self._arrays

    @arrays.setter
    def arrays(self, value: Dict[str, mx.array]) -> None:
        self._arrays = value
        self._views = {}  # `folded` / `row_view` views (and `Rows._coded_part` s) of the arrays just replaced

    buffers = arrays  # (the exact tail's and the seed cache's name for them)

    # -- the layout: where each field's tokens lie --------------------------------------------------------------
    def fields(self, sample: Optional[Dict[str, mx.array]] = None) -> dict:
        """The declared layout, or the plain one of ``sample`` (default: the arrays held)."""
        return self.layout if self.layout is not None else plain_layout(self.arrays if sample is None else sample)

    def _axis(self, f: str) -> tuple:
        """``(token axis, entries per block)`` of field ``f``."""
        return (TOKEN_AXIS, 1) if self.layout is None else self.layout[f][:2]

    def _index(self, f: str, start: int, stop: int, row: Optional[int] = None) -> tuple:
        """The index of slots ``[start, stop)`` (block-aligned) of field ``f``, of every row or of row ``row``."""
        axis, units = self._axis(f)
        lo, hi = start // self.block * units, stop // self.block * units
        rows = slice(None) if row is None else slice(row, row + 1)
        return (rows,) + (slice(None),) * (axis - 1) + (slice(lo, hi),)

    def n_tokens(self, arrays: Dict[str, mx.array]) -> int:
        """Token slots ``arrays`` (of this layout) hold."""
        if not arrays:
            return 0
        f, a = next(iter(arrays.items()))
        axis, units = self._axis(f)
        return a.shape[axis] // units * self.block

    def slice_tokens(self, arrays: Dict[str, mx.array], start: int, stop: int) -> Dict[str, mx.array]:
        """Token slots ``[start, stop)`` (block-aligned) of ``arrays`` (of this layout): views, no copy."""
        return {f: a[self._index(f, start, stop)] for f, a in arrays.items()}

    def concat(self, chunks: Sequence[Dict[str, mx.array]]) -> Dict[str, mx.array]:
        """Arrays of consecutive token ranges -> one set of arrays (a single chunk: itself, no copy)."""
        chunks = [c for c in chunks if c]
        if len(chunks) <= 1:
            return dict(chunks[0]) if chunks else {}
        return {f: mx.concatenate([c[f] for c in chunks], axis=self._axis(f)[0]) for f in chunks[0]}

    def zeros(self, rows: int, tokens: int, sample: Optional[Dict[str, mx.array]] = None) -> Dict[str, mx.array]:
        """``rows`` rows of ``tokens`` zero slots (finite, never attended), of the layout (plain: ``sample``'s)."""
        out = {}
        for f, (axis, units, shape, dtype) in self.fields(sample).items():
            shape = list(shape)
            shape[0], shape[axis] = rows, units * tokens // self.block
            out[f] = mx.zeros(shape, dtype)
        return out

    # -- sizes -----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.n_tokens(self.arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays, spare step capacity included (what occupies memory)."""
        return sum(a.nbytes for a in self.arrays.values())

    # -- growing -----------------------------------------------------------------------------------------------
    def padded(self, rows: int, capacity: int) -> Dict[str, mx.array]:
        """The arrays grown to ``capacity`` slots (zeros after), ``self`` unchanged."""
        have = self.capacity
        if capacity <= have:
            return self.arrays
        extra = self.zeros(rows, capacity - have)
        return self.concat([self.arrays, extra]) if self.arrays else extra

    def reserve(self, rows: int, tokens: int) -> None:
        """At least ``tokens`` slots per row (whole steps of zeros: finite, never attended)."""
        if tokens > self.capacity:
            self.arrays = self.padded(rows, round_up(tokens, self.step))

    # -- writing at the end: a tail ------------------------------------------------------------------------------
    def append(self, chunk: Dict[str, mx.array]) -> None:
        """Append ``T`` tokens at ``length``: every array in ``chunk`` holds the same ``T`` (and the store's rows)."""
        self.writes += 1
        if not chunk:
            return
        n_new = self.n_tokens(chunk)
        if n_new == 0:
            return
        if self.arrays and chunk.keys() != self.arrays.keys():
            raise ValueError(f"chunk holds arrays {sorted(chunk)}, the store holds {sorted(self.arrays)}")
        prev, end = self.length, self.length + n_new
        if not self.arrays or end > self.capacity:
            # Grow like mlx_lm's KVCache: keep the live prefix, add whole steps of zeros (of the chunk's dtypes).
            new_cap, rows = round_up(end, self.step), next(iter(chunk.values())).shape[0]
            extra = self.zeros(rows, new_cap - prev if self.arrays and prev > 0 else new_cap, chunk)
            if self.arrays and prev > 0:
                old = self.slice_tokens(self.arrays, 0, prev)
                extra = self.concat([old, extra])
            self.arrays = extra
        for f, a in chunk.items():
            if prev == 0 and end == self.capacity:
                # A slice assignment covering the whole array would alias ``a``, and with it keep alive the whole
                # array ``a`` may be a view of (e.g. a 4-token sink of a 4096-token prompt): copy.
                self.arrays[f] = mx.contiguous(a.astype(self.arrays[f].dtype))
            else:
                self.arrays[f][self._index(f, prev, end)] = a
        self.length = end

    def trim(self, n: int) -> int:
        """Forget the last ``n`` live tokens (storage is kept for reuse); returns how many were dropped."""
        self.writes += 1
        n = max(0, min(int(n), self.length))
        self.length -= n
        return n

    def delete(self, start: int, stop: int, room: int = 1) -> None:
        """Remove live tokens ``[start, stop)``; later tokens move down (one copy of the live part). Capacity is
        kept for ``room`` more tokens (whole steps; never more than it was)."""
        self.writes += 1
        start, stop = max(0, start), min(stop, self.length)
        if stop <= start:
            return
        if start == 0 and stop == self.length:
            # Everything goes: free the arrays now. Empty slices of them would stay unevaluated (attention reads
            # no empty part) and keep every old array alive until the next append.
            self.arrays, self.length = {}, 0
            return
        # Room for the next tokens kept (whole steps, as `append` grows): a store sized exactly to its tokens
        # is copied again by the next append (a batch's tail: twice per coded block).
        length = self.length - (stop - start)
        spare = min(round_up(length + max(room, 1), self.step), self.capacity) - length
        self._splice(start, stop, self.length, spare)
        self.length = length

    # -- writing by row: one codec's codes of B rows ----------------------------------------------------------------
    def write_row(self, row: int, start: int, codes: Dict[str, mx.array], rows: int) -> None:
        """Row ``row``'s slots from ``start`` get ``codes`` (one row, whole blocks)."""
        n = self.n_tokens(codes)
        if rows == 1 and start == self.capacity and self.block > 1:
            # one sequence coding its next block: append, the arrays stay exactly full and contiguous (what the
            # scoring matmul wants), one copy of the codes per block
            self.arrays = self.concat([self.arrays, codes]) if self.arrays else dict(codes)
            return
        self.reserve(rows, start + n)
        self._views = {}
        for f, a in codes.items():
            self.arrays[f][self._index(f, start, start + n, row)] = a

    def write_rows(self, starts: Sequence[int], codes: Dict[str, mx.array], rows: int) -> None:
        """Row r's slots from ``starts[r]`` get row r of ``codes`` (every row, the same number of tokens; one
        write when the rows start together)."""
        n = self.n_tokens(codes)
        self.reserve(rows, max(starts) + n)
        self._views = {}
        if min(starts) == max(starts):
            for f, a in codes.items():
                self.arrays[f][self._index(f, starts[0], starts[0] + n)] = a
            return
        for f, a in codes.items():
            for r, start in enumerate(starts):
                self.arrays[f][self._index(f, start, start + n, r)] = a[r:r + 1]

    def _splice(self, start: int, stop: int, end: int, spare: int) -> None:
        """Slots ``[0, start)`` then ``[stop, end)``, then ``spare`` zero slots: one copy, in memory of their own."""
        pieces = [self.slice_tokens(self.arrays, 0, start)] if start else []
        pieces.append(self.slice_tokens(self.arrays, stop, end))
        if spare:
            pieces.append(self.zeros(next(iter(self.arrays.values())).shape[0], spare))
        self.arrays = {f: mx.contiguous(a) for f, a in self.concat(pieces).items()}

    def drop(self, lo: int, hi: int) -> None:
        """Forget slots ``[lo, hi)`` of every row (a sliding window's evicted tokens; one copy)."""
        self._splice(lo, hi, self.capacity, 0)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots (rounded up to a growth step): frees trimmed or taken-away slots."""
        cap = round_up(n, self.step)
        if cap < self.capacity:
            kept = self.slice_tokens(self.arrays, 0, cap) if cap else {}
            self.arrays = {f: mx.contiguous(a) for f, a in kept.items()}

    # -- reading -----------------------------------------------------------------------------------------------
    def view(self, start: int = 0, stop: Optional[int] = None) -> Dict[str, mx.array]:
        """The live tokens ``[start, stop)`` of every array (slices, no copy)."""
        stop = self.length if stop is None else min(stop, self.length)
        if start == 0 and stop == self.capacity:
            return dict(self.arrays)
        return self.slice_tokens(self.arrays, start, stop)

    def live_arrays(self) -> Dict[str, mx.array]:
        """What goes into a cache's ``state``: the live part of every array."""
        return self.view()

    def _bound_views(self) -> None:
        if len(self._views) >= 8:  # (trims move the ranges without replacing the arrays)
            self._views.clear()

    def folded(self, n: int) -> Dict[str, mx.array]:
        """The first ``n`` slots of every row, folded to ``(1, B*H, ...)`` (views kept until the arrays change)."""
        hit = self._views.get(n)
        if hit is None:
            self._bound_views()
            hit = {f: fold(a) for f, a in self.arrays.items()}
            hit = self._views[n] = hit if n == self.capacity else self.slice_tokens(hit, 0, n)
        return hit

    def row_view(self, i: int, start: int, stop: int) -> Dict[str, mx.array]:
        """Row ``i``'s slots ``[start, stop)`` ``(1, H, ...)`` (views, the same objects until the arrays change)."""
        key = (i, start, stop)
        hit = self._views.get(key)
        if hit is None:
            self._bound_views()
            arrays = self.arrays if self.arrays[next(iter(self.arrays))].shape[0] == 1 else \
                {f: a[i:i + 1] for f, a in self.arrays.items()}
            hit = self._views[key] = arrays if (start, stop) == (0, self.capacity) else \
                self.slice_tokens(arrays, start, stop)
        return hit

    def row_live(self, i: int, pin: int, gone: int, coded: int) -> Dict[str, mx.array]:
        """Row ``i``'s live codes without the evicted hole, in their own memory (what a saved state holds)."""
        if not coded or not self.arrays:
            return {}
        pieces = [self.row_view(i, 0, min(pin, coded))] if gone and pin else []
        pieces.append(self.row_view(i, pin + gone if gone else 0, coded))
        return {f: mx.contiguous(a) for f, a in self.concat([p for p in pieces if p]).items()}

    # -- copying and (re)loading ----------------------------------------------------------------------------------
    def copy(self) -> "SlotStore":
        """An independent copy: later writes to either store do not show in the other."""
        new = copy.copy(self)
        # A new array object over the same data (no copy operation): slice assignment into one rebinds that object
        # only, and MLX copies data still shared instead of writing into it.
        new.arrays = {f: copy.copy(a) for f, a in self.arrays.items()}
        return new

    def load(self, arrays: Dict[str, mx.array]) -> None:
        """Hold ``arrays`` (`live_arrays` output, or whole slots: all share the token count, every one live) in place
        of the current arrays."""
        self.writes += 1
        self.arrays, self.length = {}, 0
        if arrays:
            counts = {self.n_tokens({f: a}) for f, a in arrays.items()}
            if len(counts) != 1:
                raise ValueError(f"stored arrays disagree on the token count: {sorted(counts)}")
            self.arrays = dict(arrays)
            self.length = counts.pop()

    @classmethod
    def from_arrays(cls, arrays: Dict[str, mx.array], step: int = 256) -> "SlotStore":
        """Rebuild a plain store from ``live_arrays()`` output (all arrays share the token count)."""
        store = cls(step)
        store.load(arrays)
        return store
