"""Where a codec's arrays live in a cache: a store per code layout, all with `TokenStore`'s interface.

- `TokenStore` (:mod:`veloxquant_mlx.cache._token_store`): arrays with the token axis at 2, grown in steps;
  what per-token layouts use.
- `ColumnStore`: arrays whose token axis is the codec's own (e.g. ``K^T`` codes, tokens last), kept exactly
  full and grown one coded block at a time through the codec's ``concat`` / ``slice_tokens``, so attention
  reads whole contiguous arrays.
"""
from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx


class ColumnStore:
    """Exact-size arrays of ``codec``'s layout; appends, trims and deletes whole ``token_block`` units."""

    def __init__(self, codec):
        self.codec = codec
        self.buffers: Dict[str, mx.array] = {}

    @property
    def length(self) -> int:
        return self.codec.n_tokens(self.buffers) if self.buffers else 0

    def append(self, chunk: Dict[str, mx.array]) -> None:
        # One concatenation per coded block keeps the arrays contiguous (what the scoring matmul wants) at an
        # amortized cost of one copy of the codes per block of tokens.
        if chunk:
            self.buffers = self.codec.concat([self.buffers, chunk])

    def _keep(self, start: int, stop: int) -> Dict[str, mx.array]:
        return self.codec.slice_tokens(self.buffers, start, stop)

    def trim(self, n: int) -> int:
        n = max(0, min(int(n), self.length))
        kept = self._keep(0, self.length - n) if self.length - n else {}
        self.buffers = {f: mx.contiguous(a) for f, a in kept.items()}
        return n

    def delete(self, start: int, stop: int) -> None:
        parts = [self._keep(0, start)] if start else []
        if stop < self.length:
            parts.append(self._keep(stop, self.length))
        self.buffers = self.codec.concat(parts) if parts else {}

    def view(self, start: int = 0, stop: Optional[int] = None) -> Dict[str, mx.array]:
        stop = self.length if stop is None else min(stop, self.length)
        if start == 0 and stop == self.length:
            return dict(self.buffers)
        return self._keep(start, stop)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.buffers.values())

    live_nbytes = nbytes

    def copy(self) -> "ColumnStore":
        new = ColumnStore(self.codec)
        new.buffers = dict(self.buffers)  # never written in place: sharing the arrays is safe
        return new

    def live_arrays(self) -> Dict[str, mx.array]:
        return dict(self.buffers)

    def load(self, arrays: Dict[str, mx.array]) -> None:
        self.buffers = dict(arrays)
