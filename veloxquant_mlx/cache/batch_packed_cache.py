"""`TurboQuantBatchPackedCache`: several sequences' `TurboQuantPackedCache` s in one batch, every one still packed.

What mlx_lm's ``BatchGenerator`` (``batch_generate``, ``mlx_lm.server``) needs of a batch cache — ``merge`` of
per-sequence caches, ``prepare`` / ``finalize`` around right-padded prompts, ``filter`` / ``extend`` as sequences
leave and join, ``extract(i)`` back to a per-sequence cache — for the full-attention packed cache, with
mlx_lm's ``BatchKVCache`` as the reference behaviour.

Each sequence (row ``i``) keeps exactly the structure it has alone, ``[sink | codes | tail]``:

- sink ``(B, H, S, d)``: row i's first ``sink_n[i]`` tokens, left-aligned;
- codes (one `RowCodes` per codec): row i's ``coded[i]`` coded tokens, left-aligned, in its codec's layout;
  blocks are counted from the row's own first coded token, so a block codec codes the same token sets (and
  fits its per-block scales on the same tokens) as the sequence alone: pad tokens are never coded;
- tail ``(B, H, L, d)``: row i's ``tail_n[i]`` newest exact tokens, right-aligned (new tokens arrive at the end for
  every row); a row codes its oldest whole blocks when they leave the tail, as alone.

The free slots after a row's codes and before its sink / tail end are padding: never attended, and never written
with anything but finite values (pad tokens of a right-padded prompt are zeroed). Fitted per-head codec
parameters (a centring mean, outlier channels) are fitted per sequence, at the same moment and on the same tokens
as alone, and the codecs see the batch folded into their head axis (``(1, B*H, ...)``): per-head parameters then
are per-sequence ones, for any codec of the contract.

Attention runs on codes only (`attend_packed`), so the cache needs the packed-attention hook. A decode step is one
call over the folded batch with a mask of each row's valid slots (built once per step, shared by the layers); a
prompt chunk is attended one sequence at a time, its real queries against its own slots, causal: exactly what the
sequence alone computes. The mask mlx_lm passes is not needed. ``recent > 0`` (exact windows read through a round
trip) is not batched (a clear error). `TurboQuantBatchRotatingPackedCache` batches sliding windows.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, dynamic_roll

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, attend_one_query, packed_attention
from veloxquant_mlx.cache._pipeline import PipelineDependency
from veloxquant_mlx.cache._token_store import TokenStore
from veloxquant_mlx.cache.packed_cache import _check_pair
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.validate import FLOAT_DTYPES

_CODE_STEP = 256  # code slots added at a time for per-token codecs (block codecs grow one block at a time)
STATE_FORMAT = 1  # of a batch cache's ``state``
_TAIL_STEP = 16  # exact tail slots added at a time (the tail holds under trim_headroom + one block per row)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _fold(a: mx.array) -> mx.array:
    """``(B, H, ...)`` -> ``(1, B*H, ...)``: codecs then treat every (sequence, head) as a head of their own."""
    return a if a.shape[0] == 1 else a.reshape((1, a.shape[0] * a.shape[1]) + tuple(a.shape[2:]))


def _column(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32).reshape(-1, 1, 1, 1)


# (options, k_dim, v_dim, heads) -> per codec (RowCodes layout, unfitted per-head arrays): probing costs two encodes
# and a fit per layer, which made merging a batch cost more than a decode step (mlx_lm merges at every join).
_PROBES: Dict[tuple, tuple] = {}

_ONE_TOKEN = (1, None, None, None)  # `_chunk` after a decode step: only its length is read

_last_masks = (None, None)  # (key, folded part masks): every layer of one decode step has the same rows


def _folded_part_masks(cache):
    """`part_masks` folded for one query per row, ``(1, B*H, 1, n)`` per part (or None), built once per decode
    step: the layers after the first find them here (one entry, replaced atomically)."""
    global _last_masks
    key = (cache.heads, cache.B, tuple(cache.sink_n), tuple(cache.start), tuple(cache.coded), tuple(cache.tail_n),
           cache._part_sizes())
    last_key, masks = _last_masks
    if last_key != key:
        masks = cache.part_masks()
        if masks is not None:
            B, H = cache.B, cache.heads
            masks = [None if m is None else mx.broadcast_to(m, (B, H, 1, m.shape[-1])).reshape(1, B * H, 1, -1)
                     for m in masks]
        _last_masks = (key, masks)
    return masks


class RowCodes:
    """One codec's codes of B rows: arrays ``(B, H, ...)`` holding ``capacity`` token slots per row.

    The token axis and the array units per coded block of each field are read off two probe encodings (the
    codec contract does not name them), so rows are written in place at their own slot.
    """

    def __init__(self, codec, heads: int, grow: int, layout: Optional[dict] = None):
        self.codec, self.grow, self.block = codec, grow, codec.token_block
        self.layout = layout or self.probe_layout(codec, heads)
        self.arrays: Dict[str, mx.array] = {}
        self.capacity = 0

    @property
    def arrays(self) -> Dict[str, mx.array]:
        return self._arrays

    @arrays.setter
    def arrays(self, value: Dict[str, mx.array]) -> None:
        self._arrays = value
        self._folded = None  # (n, views) of `folded`: views of the arrays just replaced

    @staticmethod
    def probe_layout(codec, heads: int) -> dict:
        """field -> (token axis, units per block, shape of one row's block, dtype), from two probe encodings."""
        one = codec.encode(mx.zeros((1, heads, codec.token_block, codec.d)))
        two = codec.encode(mx.zeros((1, heads, 2 * codec.token_block, codec.d)))
        layout = {}
        for f, a in one.items():
            axis = next(ax for ax in range(1, a.ndim) if two[f].shape[ax] != a.shape[ax])
            layout[f] = (axis, a.shape[axis], tuple(a.shape), a.dtype)
        return layout

    def _zeros(self, rows: int, tokens: int) -> Dict[str, mx.array]:
        out = {}
        for f, (axis, units, shape, dtype) in self.layout.items():
            shape = list(shape)
            shape[0], shape[axis] = rows, units * tokens // self.block
            out[f] = mx.zeros(shape, dtype)
        return out

    def reserve(self, rows: int, tokens: int) -> None:
        """At least ``tokens`` slots per row (zeros: finite, never attended)."""
        if tokens > self.capacity:
            new = _round_up(tokens, self.grow)
            extra = self._zeros(rows, new - self.capacity)
            self.arrays = self.codec.concat([self.arrays, extra]) if self.arrays else extra
            self.capacity = new

    def _index(self, f: str, row: int, start: int, stop: int):
        axis, units, _, _ = self.layout[f]
        lo, hi = start // self.block * units, stop // self.block * units
        return (slice(row, row + 1),) + (slice(None),) * (axis - 1) + (slice(lo, hi),)

    def write_row(self, row: int, start: int, codes: Dict[str, mx.array]) -> None:
        """Row ``row``'s slots from ``start`` get ``codes`` (one row, whole blocks)."""
        n = self.codec.n_tokens(codes)
        self._folded = None
        for f, a in codes.items():
            self.arrays[f][self._index(f, row, start, start + n)] = a

    def put_rows(self, starts: Sequence[int], codes: Dict[str, mx.array]) -> None:
        """Every row r gets its one block of ``codes`` (B rows) at slot ``starts[r]``: one scatter per field."""
        first = _column([s // self.block for s in starts])
        self._folded = None
        for f, a in codes.items():
            axis, units, _, _ = self.layout[f]
            shape = [1] * a.ndim
            shape[axis] = units
            idx = first.reshape([-1] + [1] * (a.ndim - 1)) * units + mx.arange(units, dtype=mx.int32).reshape(shape)
            self.arrays[f] = mx.put_along_axis(self.arrays[f], mx.broadcast_to(idx, a.shape), a, axis=axis)

    def folded(self, n: int) -> Dict[str, mx.array]:
        """The first ``n`` slots of every row, folded to ``(1, B*H, ...)`` (views; kept until the arrays change:
        every decode step reads them, and they change only when a block is coded)."""
        if self._folded is not None and self._folded[0] == n:
            return self._folded[1]
        arrays = {f: _fold(a) for f, a in self.arrays.items()}
        arrays = arrays if n == self.capacity else self.codec.slice_tokens(arrays, 0, n)
        self._folded = (n, arrays)
        return arrays

    def row_view(self, i: int, start: int, stop: int) -> Dict[str, mx.array]:
        """Row ``i``'s slots ``[start, stop)`` ``(1, H, ...)`` (views)."""
        return self.codec.slice_tokens({f: a[i:i + 1] for f, a in self.arrays.items()}, start, stop)

    def row(self, i: int, start: int, stop: int) -> Dict[str, mx.array]:
        """Row ``i``'s slots ``[start, stop)``, as a per-sequence cache stores them (own memory, not a view)."""
        return {f: mx.contiguous(a) for f, a in self.row_view(i, start, stop).items()} if stop > start else {}

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` slots of every row (a sliding window's evicted tokens; one copy)."""
        self.arrays = {f: mx.contiguous(a) for f, a in self.codec.slice_tokens(self.arrays, n, self.capacity).items()}
        self.capacity -= n

    def take(self, rows: mx.array, keep: int) -> None:
        """Keep rows ``rows`` (in that order) and the slots that hold their tokens (``keep``, rounded up)."""
        cap = _round_up(keep, self.grow)
        arrays = {f: a[rows] for f, a in self.arrays.items()}
        if cap < self.capacity:
            arrays = {f: mx.contiguous(a) for f, a in self.codec.slice_tokens(arrays, 0, cap).items()}
        self.arrays, self.capacity = (arrays, cap) if cap else ({}, 0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class TurboQuantBatchPackedCache(PipelineDependency, _BaseCache):
    """A batch of `TurboQuantPackedCache` s (made by ``TurboQuantPackedCache.merge``); see the module docstring.

    ``offset`` is the ``(B,)`` int32 array of each sequence's token count (RoPE positions, as mlx_lm's
    ``BatchKVCache``); ``left_padding`` the pad slots before each row's tail.
    """

    def __init__(self, options, batch_size: int, fetch_placeholders: bool = True):
        if options.recent:
            raise ValueError(f"recent must be 0 to batch packed caches (exact windows are not batched yet), got "
                             f"recent={options.recent}")
        if not fetch_placeholders:
            raise ValueError("batched packed caches attend only from their codes: fetch_placeholders must be True "
                             "(this model's attention bypasses mlx_lm's scaled_dot_product_attention)")
        self.options, self.fetch_placeholders = options, True
        self.B = batch_size
        self._set_lengths([0] * batch_size)  # tokens per sequence (real ones); offset: the same as an array
        self.sink_n, self.coded, self.tail_n = [0] * batch_size, [0] * batch_size, [0] * batch_size
        self.fitted = [False] * batch_size
        self.start = [0] * batch_size  # first live code slot per row (a sliding window evicts from there)
        self.dims: Optional[tuple] = None
        self.heads = 0
        self.sink: Optional[Dict[str, mx.array]] = None  # {"k", "v"}: (B, H, S, d)
        self._sink_views = None  # (sink k, sink v, S, folded part): `_sink_part`
        self.k_codes = self.v_codes = None  # RowCodes
        self.tail = TokenStore(_TAIL_STEP)
        self._base = None  # (key codec, value codec), unfitted, per sequence
        self.k_codec = self.v_codec = None  # the folded codecs: fitted arrays (B*H, ...)
        self._pending: Optional[List[int]] = None  # real tokens still to come per row (prepare(lengths=...))
        self._lead: Optional[List[int]] = None  # pad tokens before each row's first one (prepare(left_padding=))
        self._chunk = None  # (T, first real position, real tokens, tokens before) per row, of the last update
        self._dependency = None  # mlx_lm's pipeline writes `keys` (PipelineDependency)

    @property
    def left_padding(self) -> mx.array:
        return mx.array([self.tail.length - t for t in self.tail_n], dtype=mx.int32)

    @property
    def _block(self) -> int:
        return self._base[0].token_block

    # -- construction -------------------------------------------------------------------------------
    def _setup(self, k_dim: int, v_dim: int, heads: int) -> None:
        self.dims, self.heads = (k_dim, v_dim), heads
        self._base = codec_layout(self.options.codec).make(self.options, k_dim, v_dim)
        grow = self._block if self._block > 1 else _CODE_STEP
        key = (self.options, k_dim, v_dim, heads)
        probes = _PROBES.get(key)
        if probes is None:  # the same for every layer and every merge of this configuration: probed once
            probes = _PROBES[key] = tuple((RowCodes.probe_layout(c, heads), self._unfitted_arrays(c)) for c in self._base)
        self.k_codes, self.v_codes = (RowCodes(c, heads, grow, layout) for c, (layout, _) in zip(self._base, probes))
        # Rows not fitted yet hold the parameters a fit on a zero token gives: finite, and no coded token of
        # theirs reads them (a row is fitted before its first token is coded).
        self.k_codec, self.v_codec = (self._placeholder(c, arrays, self.B) for c, (_, arrays) in zip(self._base, probes))

    def _unfitted_arrays(self, base) -> Dict[str, mx.array]:
        """What a fit on one zero token gives (per head), checked to be per head."""
        probe = copy.copy(base)
        probe.fit(mx.zeros((1, self.heads, 1, base.d)))
        arrays = probe.fitted_arrays()
        for name, a in arrays.items():
            if a.shape[0] != self.heads:
                raise ValueError(f"codec={self.options.codec!r}: fitted array {name!r} of shape {tuple(a.shape)} is "
                                 f"not per head ({self.heads} heads), so sequences cannot be batched")
        return arrays

    @staticmethod
    def _placeholder(base, arrays: Dict[str, mx.array], rows: int):
        folded = copy.copy(base)
        folded.load_fitted({n: mx.concatenate([a] * rows, axis=0) if rows > 1 else a for n, a in arrays.items()})
        return folded

    @staticmethod
    def _single_class():
        from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

        return TurboQuantPackedCache

    def _new_single(self):
        return self._single_class()(self.options, fetch_placeholders=self.fetch_placeholders)

    @classmethod
    def _from_first(cls, first, n: int):
        return cls(first.options, n, first.fetch_placeholders)

    @classmethod
    def merge(cls, caches) -> "TurboQuantBatchPackedCache":
        """One batch cache from per-sequence caches (empty, filled, or restored from a file)."""
        caches, single = list(caches), cls._single_class()
        if not caches:
            raise ValueError(f"caches must hold at least one {single.__name__} to merge")
        for c in caches:
            if type(c) is not single:
                raise TypeError(f"caches must all be {single.__name__}, got {type(c).__name__}")
            if c.options != caches[0].options or c._cache_meta() != caches[0]._cache_meta():
                raise ValueError("caches to merge must share their options (one configuration per batch)")
        new = cls._from_first(caches[0], len(caches))
        filled = [c for c in caches if c.dims is not None and c._count]
        if filled:
            new._setup(*filled[0].dims, filled[0]._heads()[1])
            new._load_rows(caches)
        return new

    def _load_rows(self, caches) -> None:
        if any(c.dims is not None and c._count and (c.dims != self.dims or c._heads()[1] != self.heads) for c in caches):
            raise ValueError("caches to merge must share head dims and KV heads")
        S, dtype = self.options.sink, None
        for c in caches:
            for store in (c.sink_store, c.tail):
                if store.buffers and dtype is None:
                    dtype = next(iter(store.buffers.values())).dtype
        dtype = dtype or mx.float32
        if S:
            self.sink = {n: mx.zeros((self.B, self.heads, S, d), dtype) for n, d in zip("kv", self.dims)}
        L = max(c.tail.length for c in caches)
        tail = {n: mx.zeros((self.B, self.heads, L, d), dtype) for n, d in zip("kv", self.dims)} if L else {}
        most = max(c.n_coded for c in caches)
        self.k_codes.reserve(self.B, most)
        self.v_codes.reserve(self.B, most)
        fits = {"k": [], "v": []}
        for i, c in enumerate(caches):
            self.lengths[i], self.sink_n[i], self.coded[i], self.tail_n[i] = (
                c.offset, c.sink_store.length, c.n_coded, c.tail.length)
            if c.sink_store.length:
                for n, a in c.sink_store.view().items():
                    self.sink[n][i:i + 1, :, :a.shape[2]] = a
            if c.tail.length:
                for n, a in c.tail.view().items():
                    tail[n][i:i + 1, :, L - a.shape[2]:] = a
            if c.n_coded:
                self.k_codes.write_row(i, 0, c.k_codes.view())
                self.v_codes.write_row(i, 0, c.v_codes.view())
            self.fitted[i] = c.dims is not None and c._fitted
            for n, codec, mine in (("k", c.k_codec, self.k_codec), ("v", c.v_codec, self.v_codec)):
                rows = codec.fitted_arrays() if self.fitted[i] else self._row_arrays(mine, i)
                fits[n].append(rows)
        for n, codec in (("k", self.k_codec), ("v", self.v_codec)):
            names = fits[n][0].keys()
            codec.load_fitted({name: mx.concatenate([r[name] for r in fits[n]], axis=0) for name in names})
        self.tail.load(tail)
        self._set_lengths(self.lengths)
        self._sink_views = None  # the sink was written in place above

    def _row_arrays(self, folded, i: int) -> Dict[str, mx.array]:
        H = self.heads
        return {n: a[i * H:(i + 1) * H] for n, a in folded.fitted_arrays().items()}

    def _row_codec(self, which: int, i: int):
        """Row ``i``'s own codec (its fitted parameters), as its per-sequence cache holds it."""
        codec = copy.copy(self._base[which])
        if self.fitted[i]:
            codec.load_fitted(self._row_arrays((self.k_codec, self.v_codec)[which], i))
        return codec

    def _fit_row(self, i: int, k: mx.array, v: mx.array) -> None:
        """Fit row ``i``'s codecs on its tokens ``(1, H, n, d)`` (what its cache alone would fit on)."""
        H = self.heads
        for base, folded, x in ((self._base[0], self.k_codec, k), (self._base[1], self.v_codec, v)):
            own = copy.copy(base)
            own.fit(x)
            arrays = own.fitted_arrays()
            if arrays:
                folded.load_fitted({n: mx.concatenate([a[:i * H], arrays[n], a[(i + 1) * H:]], axis=0)
                                    for n, a in folded.fitted_arrays().items()})
        self.fitted[i] = True

    # -- mlx_lm's batch protocol ----------------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a prompt chunk: ``lengths`` real tokens per row (the rest right padding), or ``left_padding``
        pad tokens first (an empty cache only, as mlx_lm's ``BatchKVCache``)."""
        if left_padding is not None:
            if any(self.lengths):
                raise ValueError("left_padding can only be added to an empty batch cache")
            self._lead = [int(p) for p in left_padding]
            self.offset = mx.array([-p for p in self._lead], dtype=mx.int32)  # RoPE: a row's first token is at 0
        if lengths is not None:
            self._pending = [int(n) for n in lengths]

    def finalize(self) -> None:
        # Pad tokens were never stored as tokens (update_and_fetch placed each row's real ones): nothing to roll.
        self._pending = self._lead = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``keys``/``values`` ``(B, H, T, d)`` (pad tokens per `prepare` skipped); returns placeholders of
        the stored history's shape (attention runs in `attend_packed`)."""
        dims, B, H = self.dims, self.B, self.heads
        if (type(keys) is mx.array and type(values) is mx.array and dims is not None and B  # (no rows: checked below)
                and keys.shape == (B, H, 1, dims[0]) and values.shape == (B, H, 1, dims[1])
                and keys.dtype in FLOAT_DTYPES and values.dtype in FLOAT_DTYPES
                and self._dependency is None and _hook.is_active()):
            # A decode step (~30 per token): the checks below in one comparison of shapes.
            self._append(keys, values)
            S, C, L = self._part_sizes()
            return (_hook.placeholder_history((B, H, S + C + L, dims[0]), keys.dtype),
                    _hook.placeholder_history((B, H, S + C + L, dims[1]), values.dtype))
        if not _hook.is_active():
            raise ValueError(f"{type(self).__name__} attends only from its codes: batch (batch_generate, "
                             "BatchGenerator, mlx_lm.server) on a model after veloxquant_mlx.enable(model), or inside "
                             "veloxquant_mlx.use_packed_attention()")
        _check_pair(keys, values, *(self.dims or (self.options.head_dim, None)))
        if keys.shape[0] != self.B:
            raise ValueError(f"keys have batch size {keys.shape[0]}, but this cache holds {self.B} sequences")
        keys, values = self._after_dependency(keys, values)
        if self.dims is None:
            self._setup(keys.shape[-1], values.shape[-1], keys.shape[1])
        elif keys.shape[1] != self.heads:
            raise ValueError(f"keys have {keys.shape[1]} KV heads, but this cache holds {self.heads}")
        self._append(keys, values)
        N = sum(self._part_sizes())
        return (_hook.placeholder_history((self.B, self.heads, N, self.dims[0]), keys.dtype),
                _hook.placeholder_history((self.B, self.heads, N, self.dims[1]), values.dtype))

    def _counts(self, T: int):
        """``(lead, real)`` per row of a ``T``-token chunk: pad tokens first, then real ones (per `prepare`)."""
        lead = self._lead or [0] * self.B
        return lead, [max(min(T - a, T if self._pending is None else self._pending[i]), 0) for i, a in enumerate(lead)]

    def _append(self, keys: mx.array, values: mx.array) -> None:
        T = keys.shape[2]
        if T == 1 and self._pending is None and self._lead is None and self._block > 1 and self.B and \
                min(self.sink_n) >= self.options.sink:
            # A decode step (the common call, ~30 per token): every row's one token joins its tail. What the
            # general path below does for it, without its per-row bookkeeping lists.
            self.tail.append({"k": keys, "v": values})
            self.tail_n = [t + 1 for t in self.tail_n]
            if max(self.tail_n) >= self.options.trim_headroom + self._block:  # some row has a block to code
                self._code_tail()
            self._set_lengths([n + 1 for n in self.lengths])
            self._chunk = _ONE_TOKEN
            return
        lead, real = self._counts(T)
        if self._pending is not None:
            self._pending = [p - r for p, r in zip(self._pending, real)]
        self._lead = None  # left padding precedes the first chunk only
        S = self.options.sink
        s = [min(max(S - n, 0), r) for n, r in zip(self.sink_n, real)]
        if any(s):
            self._fill_sink(keys, values, lead, s)
        rest = [r - x for r, x in zip(real, s)]
        if self._block == 1:
            self._code_direct(keys, values, [a + x for a, x in zip(lead, s)], rest)
        else:
            self._append_tail(keys, values, lead, real, rest)
            self._code_tail()
        self._set_lengths([n + r for n, r in zip(self.lengths, real)])
        self._chunk = (T, lead, real, [n - r for n, r in zip(self.lengths, real)])

    def _set_lengths(self, lengths: List[int]) -> None:
        self.lengths = lengths
        self.offset = mx.array(lengths, dtype=mx.int32)  # what RoPE reads, once per update (not per layer)

    def _fill_sink(self, keys, values, lead, s) -> None:
        """Row r's next ``s[r]`` real tokens (chunk positions from ``lead[r]``) join its sink: one gather."""
        S = self.options.sink
        if self.sink is None:
            self.sink = {n: mx.zeros((self.B, self.heads, S, x.shape[-1]), x.dtype) for n, x in (("k", keys), ("v", values))}
        slot = mx.arange(S, dtype=mx.int32).reshape(1, 1, S, 1)
        old, lo = _column(self.sink_n), _column(lead)
        src = mx.clip(slot - old + lo, 0, keys.shape[2] - 1)
        new = (slot >= old) & (slot < old + _column(s))
        for n, x in (("k", keys), ("v", values)):
            picked = mx.take_along_axis(x, mx.broadcast_to(src, x.shape[:2] + (S, 1)), axis=2)
            self.sink[n] = mx.where(new, picked, self.sink[n])
        self.sink_n = [n + x for n, x in zip(self.sink_n, s)]

    def _reserve(self, tokens: int) -> None:
        self.k_codes.reserve(self.B, tokens)
        self.v_codes.reserve(self.B, tokens)

    def _code_direct(self, keys, values, start, count) -> None:
        """Per-token codecs: every post-sink token is coded at once (as alone), row r's ``count[r]`` from chunk
        position ``start[r]``."""
        for i in range(self.B):
            if count[i] and not self.fitted[i]:  # alone fits on the first tokens it codes
                self._fit_row(i, keys[i:i + 1, :, start[i]:start[i] + count[i]],
                              values[i:i + 1, :, start[i]:start[i] + count[i]])
        if keys.shape[2] == 1:  # decode: one scatter for all rows (rows coding nothing write a free slot)
            self._reserve(max(self.coded) + 1)
            self.k_codes.put_rows(self.coded, self._encode_folded(self.k_codec, keys))
            self.v_codes.put_rows(self.coded, self._encode_folded(self.v_codec, values))
        else:
            self._reserve(max(c + n for c, n in zip(self.coded, count)))
            for i in range(self.B):
                if count[i]:
                    sl = (slice(i, i + 1), slice(None), slice(start[i], start[i] + count[i]))
                    self.k_codes.write_row(i, self.coded[i], self._row_codec(0, i).encode(keys[sl]))
                    self.v_codes.write_row(i, self.coded[i], self._row_codec(1, i).encode(values[sl]))
        self.coded = [c + n for c, n in zip(self.coded, count)]

    def _encode_folded(self, codec, x: mx.array) -> Dict[str, mx.array]:
        codes = codec.encode(_fold(x))
        return {f: a.reshape((self.B, self.heads) + tuple(a.shape[2:])) for f, a in codes.items()}

    def _append_tail(self, keys, values, lead, real, rest) -> None:
        """The chunk joins the tail; rows whose real tokens do not end the chunk (right padding) are rolled so
        that every row's tail is its last ``tail_n`` slots, and pad slots are zeroed (NaN there changes nothing)."""
        T = keys.shape[2]
        self.tail.append({"k": keys, "v": values})
        shift = [T - a - r for a, r in zip(lead, real)]
        self.tail_n = [t + r for t, r in zip(self.tail_n, rest)]
        if any(shift) or any(lead):
            view, L = self.tail.view(), self.tail.length
            pos = mx.arange(L, dtype=mx.int32).reshape(1, 1, L, 1)
            valid = pos >= L - _column(self.tail_n)
            by = mx.array(shift, dtype=mx.int32)[:, None]
            self.tail.load({n: mx.where(valid, dynamic_roll(a, by, axis=2), 0) for n, a in view.items()})

    def _code_tail(self) -> None:
        """Rows code their oldest whole blocks beyond the trim headroom (fitting first, on their whole tail)."""
        blk, L = self._block, self.tail.length
        n_code = [max(t - self.options.trim_headroom, 0) // blk * blk for t in self.tail_n]
        if any(n_code):
            self._reserve(max(c + n for c, n in zip(self.coded, n_code)))
            view = self.tail.view()
            for i in range(self.B):
                if not n_code[i]:
                    continue
                first = L - self.tail_n[i]
                if not self.fitted[i]:
                    self._fit_row(i, view["k"][i:i + 1, :, first:], view["v"][i:i + 1, :, first:])
                sl = (slice(i, i + 1), slice(None), slice(first, first + n_code[i]))
                self.k_codes.write_row(i, self.coded[i], self._row_codec(0, i).encode(view["k"][sl]))
                self.v_codes.write_row(i, self.coded[i], self._row_codec(1, i).encode(view["v"][sl]))
            self.coded = [c + n for c, n in zip(self.coded, n_code)]
            self.tail_n = [t - n for t, n in zip(self.tail_n, n_code)]
            self._drop_tail_padding()

    def _drop_tail_padding(self, at_least: int = 1) -> None:
        """Forget tail slots that are padding in every row (one copy of the small tail)."""
        pad = min(self.tail.length - t for t in self.tail_n) if self.B else 0
        if pad >= at_least:
            self.tail.delete(0, pad)

    # -- attention ------------------------------------------------------------------------------------
    def _part_sizes(self):
        return (max(self.sink_n) if self.sink is not None else 0, max(self.coded), self.tail.length)

    def attention_parts(self) -> List[Any]:
        """The batch as attention parts ``[sink | codes | tail]``, folded ``(1, B*H, ...)`` (the folded codecs'
        per-head parameters are per sequence); row validity is `part_masks`'."""
        S, C, L = self._part_sizes()
        parts: List[Any] = []
        if S:
            parts.append(self._sink_part(S))
        if C:
            parts.append(CodedPart(self.k_codec, self.k_codes.folded(C), self.v_codec, self.v_codes.folded(C)))
        if L:
            t = {n: _fold(a) for n, a in self.tail.buffers.items()}
            if L < self.tail.capacity:
                t = {n: a[:, :, :L] for n, a in t.items()}
            parts.append(ExactPart(t["k"], t["v"]))
        return parts

    def _sink_part(self, S: int) -> ExactPart:
        """The sink's first ``S`` slots, folded; kept while the sink arrays are the same objects (they are replaced,
        never written in place, after `merge` built them)."""
        k, v = self.sink["k"], self.sink["v"]
        last = self._sink_views
        if last is not None and last[0] is k and last[1] is v and last[2] == S:
            return last[3]
        part = ExactPart(*(_fold(a if S == a.shape[2] else a[:, :, :S]) for a in (k, v)))
        self._sink_views = (k, v, S, part)
        return part

    def part_masks(self) -> Optional[List[Optional[mx.array]]]:
        """One entry per `attention_parts` part: bool ``(B, 1, 1, n)``, True on each row's stored tokens, or None
        where every row fills the part; None when no part has a pad slot."""
        B, L = self.B, self.tail.length
        ranges = (([0] * B, self.sink_n), (self.start, self.coded), ([L - t for t in self.tail_n], [L] * B))
        masks = []
        for n, (lo, hi) in zip(self._part_sizes(), ranges):
            if not n:
                continue
            if any(lo) or any(h != n for h in hi):
                slot = mx.arange(n, dtype=mx.int32).reshape(1, 1, 1, n)
                masks.append((slot >= _column(lo)) & (slot < _column(hi)))
            else:
                masks.append(None)
        return masks if any(m is not None for m in masks) else None

    def row_parts(self, i: int) -> List[Any]:
        """Row ``i``'s stored tokens alone, ``[sink | codes | tail]`` with its own codecs: exactly the attention
        parts of its per-sequence cache (views, no pad slot)."""
        parts: List[Any] = []
        if self.sink_n[i]:
            parts.append(ExactPart(self.sink["k"][i:i + 1, :, :self.sink_n[i]], self.sink["v"][i:i + 1, :, :self.sink_n[i]]))
        if self.coded[i] > self.start[i]:
            k, v = (store.row_view(i, self.start[i], self.coded[i]) for store in (self.k_codes, self.v_codes))
            parts.append(CodedPart(self._row_codec(0, i), k, self._row_codec(1, i), v))
        if self.tail_n[i]:
            t = {n: a[i:i + 1, :, self.tail.length - self.tail_n[i]:self.tail.length] for n, a in self.tail.buffers.items()}
            parts.append(ExactPart(t["k"], t["v"]))
        return parts

    def attend_packed(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """SDPA of ``queries`` ``(B, Hq, L, d)`` over every row's stored tokens, from the codes ->
        ``(B, Hq, L, dv)``: the last update's L tokens (causal) or one query that sees everything. ``mask``
        (mlx_lm's, from `make_mask`) is replaced by each row's own: pad slots and pad queries are never attended."""
        if self.dims is None or not any(self.lengths):
            raise ValueError("attend_packed needs a cache holding tokens (call update_and_fetch first)")
        B, Hq, L, d = queries.shape
        if B != self.B:
            raise ValueError(f"queries have batch size {B}, but this cache holds {self.B} sequences")
        if L > 1:
            return self._attend_chunk(queries, scale, sinks)
        if B == 1:  # one sequence: nothing to fold, and no pad slot unless its tail has some
            masks = None if self.tail.length == self.tail_n[0] and not self.start[0] else _folded_part_masks(self)
            return attend_one_query(queries, self.attention_parts(), scale, sinks, masks)
        if sinks is not None:
            sinks = mx.tile(sinks.reshape(-1), (B,))
        out = attend_one_query(queries.reshape(1, B * Hq, 1, d), self.attention_parts(), scale, sinks,
                               _folded_part_masks(self))
        return out.reshape(B, Hq, 1, out.shape[-1])

    def _attend_chunk(self, queries: mx.array, scale: float, sinks) -> mx.array:
        """A prompt chunk, one sequence at a time (prefill, not the decode step): each row's real queries against
        its own parts, causal, exactly as alone; pad queries get zeros."""
        if self._chunk is None:
            raise ValueError(f"queries of L={queries.shape[2]} > 1 tokens must be the chunk update_and_fetch just "
                             "stored, but this batch stored none since it was built, filtered or extended")
        T = self._chunk[0]
        if queries.shape[2] != T:
            raise ValueError(f"queries must be the last update's {T} tokens or a single one, got L={queries.shape[2]}")
        _, lead, real, _ = self._chunk
        B, Hq, _, _ = queries.shape
        outs = []
        for i in range(B):
            a, r = lead[i], real[i]
            o = None
            if r:
                o = packed_attention(queries[i:i + 1, :, a:a + r], self.row_parts(i), scale, self._chunk_mask(i),
                                     sinks=sinks)
            dv = self.dims[1]
            pieces = [x for x in (mx.zeros((1, Hq, a, dv), queries.dtype) if a else None, o,
                                  mx.zeros((1, Hq, T - a - r, dv), queries.dtype) if T - a - r else None) if x is not None]
            outs.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2))
        return mx.concatenate(outs, axis=0)

    def _chunk_mask(self, i: int):
        """Row ``i``'s mask for its real queries of the last chunk, as its cache alone gets it from mlx_lm."""
        return "causal" if self._chunk[2][i] > 1 else None

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        # attend_packed builds each row's mask itself; mlx_lm gets the mask it expects for the longest row.
        if window_size is not None:
            raise ValueError(f"{type(self).__name__} holds full-attention layers; window_size must be None, got "
                             f"{window_size}")
        if return_array:
            return create_causal_mask(N, max(self.lengths, default=0))
        return None if N == 1 else "causal"

    # -- leaving, joining, handing back ---------------------------------------------------------------
    def filter(self, batch_indices) -> None:
        """Keep only the sequences ``batch_indices`` (in that order)."""
        idx = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        if any(not 0 <= i < self.B for i in idx):
            raise ValueError(f"batch_indices must lie in [0, {self.B}), got {idx}")
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        lengths, self.sink_n, self.coded, self.tail_n, self.fitted, self.start = map(
            pick, (self.lengths, self.sink_n, self.coded, self.tail_n, self.fitted, self.start))
        self.B = len(idx)
        self._set_lengths(lengths)
        if self.dims is None or not idx:
            return
        rows = mx.array(idx, dtype=mx.int32)
        if self.sink is not None:
            self.sink = {n: a[rows] for n, a in self.sink.items()}
        self.k_codes.take(rows, max(self.coded))
        self.v_codes.take(rows, max(self.coded))
        self.tail.load({n: a[rows] for n, a in self.tail.view().items()})
        self._drop_tail_padding()
        H = self.heads
        fold_rows = (rows[:, None] * H + mx.arange(H, dtype=mx.int32)[None]).reshape(-1)
        for codec in (self.k_codec, self.v_codec):
            arrays = codec.fitted_arrays()
            if arrays:
                codec.load_fitted({n: a[fold_rows] for n, a in arrays.items()})

    def extract(self, idx: int):
        """Sequence ``idx`` as a per-sequence cache that continues exactly as it would in the batch."""
        if not 0 <= int(idx) < self.B:
            raise ValueError(f"idx must lie in [0, {self.B}), got {idx}")
        i = int(idx)
        cache = self._new_single()
        cache.offset = self.lengths[i]
        if self.dims is None:
            return cache
        cache._setup(*self.dims)
        if self.fitted[i]:
            cache.k_codec.load_fitted(self._row_arrays(self.k_codec, i))
            cache.v_codec.load_fitted(self._row_arrays(self.v_codec, i))
        own = lambda a, lo, hi: mx.contiguous(a[i:i + 1, :, lo:hi])  # noqa: E731
        if self.sink_n[i]:
            cache.sink_store.load({n: own(a, 0, self.sink_n[i]) for n, a in self.sink.items()})
        cache.k_codes.load(self.k_codes.row(i, self.start[i], self.coded[i]))
        cache.v_codes.load(self.v_codes.row(i, self.start[i], self.coded[i]))
        if self.tail_n[i]:
            L = self.tail.length
            cache.tail.load({n: own(a, L - self.tail_n[i], L) for n, a in self.tail.view().items()})
        return cache

    def extend(self, other: "TurboQuantBatchPackedCache") -> None:
        """Append ``other``'s sequences (in place)."""
        if not isinstance(other, TurboQuantBatchPackedCache) or other.options != self.options:
            raise ValueError("extend needs another TurboQuantBatchPackedCache with the same options")
        if not self._join_rows(other):  # a cache with no tokens yet, or mid-prompt: through per-sequence caches
            joined = type(self).merge([c.extract(i) for c in (self, other) for i in range(c.B)])
            self.__dict__.update(joined.__dict__)

    def _join_rows(self, other: "TurboQuantBatchPackedCache") -> bool:
        """`extend` by concatenating both batches' arrays along the rows (each store padded to the larger one's
        slots; tails stay right-aligned), instead of extracting and re-merging every row: mlx_lm extends at every
        join, and at 15 + 1 rows the re-merge cost ~57 ms of Python per join for 30 layers. False (nothing changed)
        when the batches are not both decoding batches of the same shape holding rows (a filter to no rows keeps
        its old arrays)."""
        if (type(other) is not type(self) or not (self.B and other.B) or self.dims is None or other.dims != self.dims
                or other.heads != self.heads
                or any(c._pending is not None or c._lead is not None or c._dependency is not None for c in (self, other))
                or (self.sink is None) != (other.sink is None)
                or getattr(self, "max_size", None) != getattr(other, "max_size", None)):
            return False
        if self.sink is not None:
            self.sink = {n: mx.concatenate([self.sink[n], other.sink[n]], axis=0) for n in self.sink}
        for name in ("k_codes", "v_codes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.reserve(self.B, theirs.capacity)
            pieces = theirs.arrays
            if theirs.capacity < mine.capacity:
                extra = theirs._zeros(other.B, mine.capacity - theirs.capacity)
                pieces = theirs.codec.concat([theirs.arrays, extra]) if theirs.arrays else extra
            mine.arrays = {f: mx.concatenate([a, pieces[f]], axis=0) for f, a in mine.arrays.items()}
        L = max(self.tail.length, other.tail.length)
        if L:
            held = (self.tail if self.tail.length else other.tail).buffers

            def right_aligned(c, n: str, d: int) -> mx.array:  # (rows, H, L, d): live tokens last, zeros before
                a = c.tail.view()[n] if c.tail.length else None
                pad = L - (0 if a is None else a.shape[2])
                if not pad:
                    return a
                z = mx.zeros((c.B, self.heads, pad, d), held[n].dtype)
                return z if a is None else mx.concatenate([z, a], axis=2)

            self.tail.load({n: mx.concatenate([right_aligned(self, n, d), right_aligned(other, n, d)], axis=0)
                            for n, d in zip("kv", self.dims)})
        for mine, theirs in ((self.k_codec, other.k_codec), (self.v_codec, other.v_codec)):
            arrays = mine.fitted_arrays()
            if arrays:
                mine.load_fitted({n: mx.concatenate([a, theirs.fitted_arrays()[n]], axis=0) for n, a in arrays.items()})
        self.sink_n, self.coded, self.tail_n, self.fitted, self.start = (
            a + b for a, b in zip((self.sink_n, self.coded, self.tail_n, self.fitted, self.start),
                                  (other.sink_n, other.coded, other.tail_n, other.fitted, other.start)))
        self.B += other.B
        self._set_lengths(self.lengths + other.lengths)
        self._chunk = None
        return True

    # -- sizes and bytes ------------------------------------------------------------------------------
    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return not any(self.lengths)

    def is_trimmable(self) -> bool:
        return False

    def _arrays(self) -> List[mx.array]:
        out = list(self.sink.values()) if self.sink is not None else []
        out += list(self.tail.buffers.values())
        for store, codec in ((self.k_codes, self.k_codec), (self.v_codes, self.v_codec)):
            if store is not None:
                out += list(store.arrays.values()) + list(codec.fitted_arrays().values())
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every array this batch holds (codes with their free slots, exact windows, fitted parameters)."""
        return sum(a.nbytes for a in self._arrays())

    _ROWS = ("lengths", "sink_n", "coded", "tail_n", "start")  # per-row token counts, saved in the meta

    @property
    def state(self) -> Dict[str, Any]:
        """Every array held, as stored (no copies: mlx_lm evaluates this between steps), and a JSON ``meta`` with
        the options and each row's token counts; `from_state` rebuilds the batch from it."""
        meta = {"format": STATE_FORMAT, "class": type(self).__name__, "options": self.options.to_dict(),
                "cache": self._cache_meta(), "dims": list(self.dims) if self.dims else None, "heads": self.heads,
                "rows": {**{n: list(getattr(self, n)) for n in self._ROWS}, "fitted": list(self.fitted)},
                "mid_prompt": self._pending is not None or self._lead is not None}
        out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
        if self.dims is None:
            return out
        for prefix, arrays in (("s_", self.sink or {}), ("t_", self.tail.view() if self.tail.length else {}),
                               ("ck_", self.k_codes.arrays), ("cv_", self.v_codes.arrays),
                               ("kfit_", self.k_codec.fitted_arrays()), ("vfit_", self.v_codec.fitted_arrays())):
            out.update({prefix + n: a for n, a in arrays.items()})
        return out

    @state.setter
    def state(self, value) -> None:
        restored = type(self).from_state(value)
        self.__dict__.update(restored.__dict__)

    def _cache_meta(self) -> Dict[str, Any]:
        return {"fetch_placeholders": self.fetch_placeholders}

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a batch from its ``state``. Each row is read out as the per-sequence cache `extract` gives and
        checked by that class's own `from_state` (so a batch believes no more than a sequence alone), then the rows
        are merged: each continues exactly as it would have. Refuses, naming the array, what does not add up."""
        from veloxquant_mlx.cache._state_check import read_batch_meta, restore_batch_arrays

        options, kwargs, meta = read_batch_meta(cls, state)
        batch = cls(options, len(meta["rows"]["lengths"]), **kwargs)
        restore_batch_arrays(batch, state, meta)
        if batch.dims is None or not batch.B:
            return batch
        single = cls._single_class()
        rows = []
        for i in range(batch.B):
            try:
                rows.append(single.from_state(batch.extract(i).state))
            except ValueError as e:
                raise ValueError(f"{cls.__name__} state: row {i}: {e}") from None
        return cls.merge(rows)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.lengths, new.sink_n, new.coded, new.tail_n, new.fitted, new.start = (
            list(x) for x in (self.lengths, self.sink_n, self.coded, self.tail_n, self.fitted, self.start))
        new.tail = self.tail.copy()
        new._sink_views = None
        if self.sink is not None:
            new.sink = {n: mx.array(a) for n, a in self.sink.items()}
        if self.dims is not None:
            new.k_codec, new.v_codec = copy.copy(self.k_codec), copy.copy(self.v_codec)
            for name in ("k_codes", "v_codes"):
                store = copy.copy(getattr(self, name))
                store.arrays = {f: mx.array(a) for f, a in store.arrays.items()}
                setattr(new, name, store)
        return new


class TurboQuantBatchRotatingPackedCache(TurboQuantBatchPackedCache):
    """A batch of `TurboQuantRotatingPackedCache` s (sliding-window layers): every row evicts its own oldest tokens.

    As alone, a row keeps its ``keep`` first tokens (its exact sink: batching needs ``sink == keep``) and its newest
    others, ``max_size - 1`` old ones before a multi-token update, ``max_size`` after a one-token update. A row's
    evicted code slots are skipped (``start``) and dropped from every row at once when all rows have evicted
    enough (one copy per ``_CODE_STEP`` tokens); the prompt chunk's mask is the row's window, as alone.
    """

    def __init__(self, options, batch_size: int, max_size: int, keep: int, fetch_placeholders: bool = True):
        super().__init__(options, batch_size, fetch_placeholders)
        if options.sink != keep:  # evicting right after the sink keeps one live range of codes per row
            raise ValueError(f"sink must equal keep ({keep}) to batch sliding-window caches, got sink={options.sink}")
        if keep >= max_size:
            raise ValueError(f"keep must be < max_size ({max_size}) to batch sliding-window caches, got {keep}")
        self.max_size, self.keep = max_size, keep

    @staticmethod
    def _single_class():
        from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache

        return TurboQuantRotatingPackedCache

    def _new_single(self):
        return self._single_class()(self.options, max_size=self.max_size, keep=self.keep,
                                    fetch_placeholders=self.fetch_placeholders)

    @classmethod
    def _from_first(cls, first, n: int):
        return cls(first.options, n, first.max_size, first.keep, first.fetch_placeholders)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        _, real = self._counts(keys.shape[2])
        self._evict([self.max_size - 1 if r > 1 else None for r in real])  # alone: before a multi-token update
        super()._append(keys, values)
        self._evict([self.max_size if r == 1 else None for r in real])  # alone: after a one-token update

    def _evict(self, limits) -> None:
        """Row r keeps at most ``limits[r]`` tokens (None: no limit): its oldest codes after the sink go."""
        for i, limit in enumerate(limits):
            if limit is not None:
                self.start[i] += max(self.sink_n[i] + self.coded[i] - self.start[i] - limit, 0)
        gone = min(self.start)
        if gone >= _CODE_STEP and self.k_codes is not None:
            for store in (self.k_codes, self.v_codes):
                store.drop_front(gone)
            self.start = [x - gone for x in self.start]
            self.coded = [x - gone for x in self.coded]

    def _chunk_mask(self, i: int):
        # TurboQuantRotatingPackedCache.make_mask for this row's chunk (window = max_size)
        _, _, real, before = self._chunk
        offset = min(self.max_size - 1, before[i])
        if real[i] > 1 and offset + real[i] > self.max_size:
            return create_causal_mask(real[i], offset, window_size=self.max_size)
        return "causal" if real[i] > 1 else None

    def _cache_meta(self) -> Dict[str, Any]:
        return {**super()._cache_meta(), "max_size": self.max_size, "keep": self.keep}

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        if window_size not in (None, self.max_size):
            raise ValueError(f"window_size must be None or this cache's max_size ({self.max_size}), got {window_size}")
        return super().make_mask(N, return_array=return_array)

    def size(self) -> int:
        return min(max(self.lengths, default=0), self.max_size)
