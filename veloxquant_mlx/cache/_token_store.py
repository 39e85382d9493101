"""`TokenStore`: named arrays that share a token axis, grown in fixed steps.

Every cache here keeps its per-token data (packed code words, norms, exact window tokens) as arrays of
shape ``(B, H, capacity, ...)`` with the token axis at position 2. This class owns the bookkeeping that
`mlx_lm.models.cache.KVCache` does for its two tensors (grow by ``step``, write a slice, view the live
prefix, drop from the end), for any number of arrays at once, plus deletion of a token range (used by
the sliding-window cache). It knows nothing about quantization.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional

import mlx.core as mx

TOKEN_AXIS = 2


def _round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


class TokenStore:
    """Step-grown buffers ``name -> (B, H, capacity, ...)``; ``length`` tokens are live."""

    def __init__(self, step: int = 256):
        self.writes = 0  # mutations so far: what a memo of the stored tokens checks (slots are written in place)
        self.step = int(step)
        self.buffers: Dict[str, mx.array] = {}
        self.length = 0

    # -- writing -----------------------------------------------------------------------------
    def append(self, chunk: Dict[str, mx.array]) -> None:
        """Append ``T`` tokens: every array in ``chunk`` is ``(B, H, T, ...)`` with the same ``T``."""
        self.writes += 1
        if not chunk:
            return
        n_new = next(iter(chunk.values())).shape[TOKEN_AXIS]
        if n_new == 0:
            return
        buffers = self.buffers
        if buffers and chunk.keys() != buffers.keys():
            raise ValueError(
                f"chunk holds arrays {sorted(chunk)}, the store holds {sorted(self.buffers)}"
            )
        prev, end = self.length, self.length + n_new
        if not buffers or end > self.capacity:
            # Grow like mlx_lm's KVCache: keep the live prefix, add whole steps of zeros.
            new_cap = _round_up(end, self.step)
            grown = {}
            for name, arr in chunk.items():
                shape = list(arr.shape)
                old = self.buffers.get(name)
                if old is not None and prev > 0:
                    shape[TOKEN_AXIS] = new_cap - prev
                    grown[name] = mx.concatenate(
                        [old[:, :, :prev], mx.zeros(shape, arr.dtype)], axis=TOKEN_AXIS
                    )
                else:
                    shape[TOKEN_AXIS] = new_cap
                    grown[name] = mx.zeros(shape, arr.dtype)
            self.buffers = grown
        for name, arr in chunk.items():
            if prev == 0 and end == self.buffers[name].shape[TOKEN_AXIS]:
                # A slice assignment covering the whole buffer would alias ``arr``, and with it keep alive the
                # whole array ``arr`` may be a view of (e.g. a 4-token sink of a 4096-token prompt): copy.
                self.buffers[name] = mx.contiguous(arr.astype(self.buffers[name].dtype))
            else:
                self.buffers[name][:, :, prev:end] = arr
        self.length = end

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (storage is kept for reuse); returns how many were dropped."""
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
            # Everything goes: free the buffers now. Empty slices of them would stay unevaluated (attention reads
            # no empty part) and keep every old buffer alive until the next append.
            self.buffers, self.length = {}, 0
            return
        # Room for the next tokens kept (whole steps, as `append` grows): a store sized exactly to its tokens
        # is copied again by the next append (a batch's tail: twice per coded block).
        length = self.length - (stop - start)
        spare = min(_round_up(length + max(room, 1), self.step), self.capacity) - length
        self.buffers = {
            name: mx.concatenate(
                [buf[:, :, :start], buf[:, :, stop : self.length],
                 mx.zeros(buf.shape[:TOKEN_AXIS] + (spare,) + buf.shape[TOKEN_AXIS + 1:], buf.dtype)],
                axis=TOKEN_AXIS,
            )
            for name, buf in self.buffers.items()
        }
        self.length = length

    # -- reading -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        if not self.buffers:
            return 0
        return next(iter(self.buffers.values())).shape[TOKEN_AXIS]

    def view(self, start: int = 0, stop: Optional[int] = None) -> Dict[str, mx.array]:
        """The live tokens ``[start, stop)`` of every array (slices, no copy)."""
        stop = self.length if stop is None else min(stop, self.length)
        if start == 0 and stop == self.capacity:
            return dict(self.buffers)
        return {name: buf[:, :, start:stop] for name, buf in self.buffers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers, spare step capacity included (what occupies memory)."""
        return sum(buf.nbytes for buf in self.buffers.values())

    # -- copying and (de)serialising ------------------------------------------------------------
    def copy(self) -> "TokenStore":
        """An independent copy: later writes to either store do not show in the other."""
        new = TokenStore(self.step)
        # A new array object over the same data (no copy operation): slice assignment into one rebinds that object
        # only, and MLX copies data still shared instead of writing into it.
        new.buffers = {name: copy.copy(buf) for name, buf in self.buffers.items()}
        new.length = self.length
        return new

    def live_arrays(self) -> Dict[str, mx.array]:
        """What goes into a cache's ``state``: the live part of every buffer."""
        return self.view()

    def load(self, arrays: Dict[str, mx.array]) -> None:
        """Hold ``live_arrays()`` output (all arrays share the token count) in place of the current buffers."""
        self.writes += 1
        self.buffers, self.length = {}, 0
        if arrays:
            lengths = {a.shape[TOKEN_AXIS] for a in arrays.values()}
            if len(lengths) != 1:
                raise ValueError(f"stored arrays disagree on the token count: {sorted(lengths)}")
            self.buffers = dict(arrays)
            self.length = lengths.pop()

    @classmethod
    def from_arrays(cls, arrays: Dict[str, mx.array], step: int = 256) -> "TokenStore":
        """Rebuild from ``live_arrays()`` output (all arrays share the token count)."""
        store = cls(step)
        store.load(arrays)
        return store


class CodedTail:
    """A cache's tail: exact tokens ``{"k", "v"}`` in, exact tokens out, stored as ``coder`` codes them.

    ``raw`` (a `TokenStore`) holds what is stored: the exact arrays themselves when ``coder`` is None, else the
    coder's per-token fields (``coder.encode({"k", "v"}) -> {field: (B, H, n, ...)}``, ``coder.decode(fields,
    dtypes) -> {"k", "v"}``, ``coder.fields(dims) -> {field: (trailing shape, dtype)}``). What reads tokens
    (`view`, `buffers`: attention, fitting, coding blocks) gets them decoded; what moves tokens between slots or rows
    (roll, cut, gather, concatenate, save, load) works on ``raw`` (`live_arrays`, `load_raw`), never re-coding.
    Bytes are ``raw``'s.
    """

    def __init__(self, step: int = 256, coder=None):
        self.raw = TokenStore(step)
        self.coder = coder
        self.dtypes: Dict[str, mx.Dtype] = {}  # the exact tokens' dtypes, "k" and "v" (from the first append)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.raw.length

    @property
    def capacity(self) -> int:
        return self.raw.capacity

    @property
    def step(self) -> int:
        return self.raw.step

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dtype(self, name: str = "k") -> mx.Dtype:
        return self.dtypes.get(name, mx.float32)

    def fields(self, dims) -> Dict[str, tuple]:
        """``{raw field: (trailing shape, dtype)}`` for keys / values of head dims ``dims``."""
        if self.coder is None:
            return {n: ((d,), self.dtype(n)) for n, d in zip("kv", dims)}
        return self.coder.fields(dims)

    # -- exact tokens in and out ------------------------------------------------------------------
    def _encode(self, chunk: Dict[str, mx.array]) -> Dict[str, mx.array]:
        for n, a in chunk.items():
            self.dtypes.setdefault(n, a.dtype)
        if self.coder is None or not chunk or next(iter(chunk.values())).shape[TOKEN_AXIS] == 0:
            return chunk
        return self.coder.encode(chunk)

    def decode(self, raw: Dict[str, mx.array], dtypes: Optional[Dict[str, mx.Dtype]] = None) -> Dict[str, mx.array]:
        """Raw arrays (of this store, or slices of them) -> exact ``{"k", "v"}``."""
        if self.coder is None or not raw:
            return raw
        return self.coder.decode(raw, dtypes or {n: self.dtype(n) for n in "kv"})

    def append(self, chunk: Dict[str, mx.array]) -> None:
        self.raw.append(self._encode(chunk))

    def load(self, arrays: Dict[str, mx.array]) -> None:
        """Hold exact tokens ``arrays`` (coded, when coded)."""
        self.raw.load(self._encode(arrays))

    def view(self, start: int = 0, stop: Optional[int] = None) -> Dict[str, mx.array]:
        """The live tokens ``[start, stop)``, exact (decoded when coded)."""
        return self.decode(self.raw.view(start, stop))

    @property
    def buffers(self) -> Dict[str, mx.array]:
        """The stored tokens as exact arrays: the buffers themselves (spare slots included) when exact, else the live
        tokens decoded (a transient, never held)."""
        if self.coder is None:
            return self.raw.buffers
        return self.decode(self.raw.view()) if self.raw.length else {}

    # -- stored arrays, moved as they are ---------------------------------------------------------
    def live_arrays(self) -> Dict[str, mx.array]:
        """What goes into a cache's ``state``: the live part of every stored array."""
        return self.raw.view()

    def load_raw(self, arrays: Dict[str, mx.array]) -> None:
        self.raw.load(arrays)

    def trim(self, n: int) -> int:
        return self.raw.trim(n)

    def delete(self, start: int, stop: int, room: int = 1) -> None:
        self.raw.delete(start, stop, room)

    def copy(self) -> "CodedTail":
        new = CodedTail(self.raw.step, self.coder)
        new.raw, new.dtypes = self.raw.copy(), dict(self.dtypes)
        return new
