"""The batch caches' behaviour (:mod:`veloxquant_mlx.cache.packed_cache` defines the classes,
`TurboQuantBatchPackedCache` / `TurboQuantBatchRotatingPackedCache`, each naming its per-sequence class ``_single``):
`_BatchFace` holds their methods, what mlx_lm's ``BatchGenerator`` calls: ``merge``, ``prepare`` / ``finalize``
around padded prompts, ``update_and_fetch``, attention from the codes (a decode step over the folded batch, a prompt
chunk one sequence at a time), ``filter`` / ``extend`` / ``extract`` / ``trim``, and the saved ``state`` /
``from_state`` (each row checked as its sequence alone). The per-step caches of masks (`_last_masks`,
`_window_masks`) live here only.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import ExactPart, attend_one_query, banded_attention, packed_attention
from veloxquant_mlx.cache import saved_state
from veloxquant_mlx.cache._face import _PackedFace, _check_pair, _trim_rows
from veloxquant_mlx.cache.row_policy import Rows
from veloxquant_mlx.cache.row_ops import concat_rows, take_rows
from veloxquant_mlx.validate import FLOAT_DTYPES, check_int


_last_masks = (None, None)  # (key, folded part masks): every layer of one decode step has the same rows


def _folded_part_masks(rows: Rows):
    """`Rows.part_masks` folded for one query per row, ``(1, B*H, 1, n)`` per part (or None), built once per
    decode step: the layers after the first find them here (one entry, replaced atomically)."""
    global _last_masks
    key = (rows.heads, rows.B, rows.pin, rows.options.recent, rows.block, tuple(rows.sink_n), tuple(rows.gone),
           tuple(rows.coded), tuple(rows.tail_n), rows.part_sizes())
    last_key, masks = _last_masks
    if last_key != key:
        masks = rows.part_masks()
        if masks is not None:
            B, H = rows.B, rows.heads
            masks = [None if m is None else mx.broadcast_to(m, (B, H, 1, m.shape[-1])).reshape(1, B * H, 1, -1)
                     for m in masks]
        _last_masks = (key, masks)
    return masks


_ONE_TOKEN = (1, None, None, None)  # `_chunk` after a decode step: only its length is read

# Masks a batch cache's `make_mask` made for a sliding window of another size than its own (a full-attention cache
# under a window mask: mistral3; a window mask one wider than the cache: plamo3): id -> (mask, window). The model
# hands the same mask object to every layer of that kind; their caches look the window up here. A few entries:
# one forward pass makes one per window size.
_window_masks: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()


def _window_mask(mask, window: int):
    _window_masks[id(mask)] = (mask, window)
    while len(_window_masks) > 8:
        _window_masks.popitem(last=False)
    return mask


def _requested_window(mask) -> Optional[int]:
    hit = _window_masks.get(id(mask)) if mask is not None else None
    return hit[1] if hit is not None and hit[0] is mask else None


class _BatchFace(_PackedFace):
    """The methods of `TurboQuantBatchPackedCache` (defined, with its docstring, in
    :mod:`veloxquant_mlx.cache.packed_cache`); ``_single`` is the batch class's per-sequence class."""

    def __init__(self, options, batch_size: int, fetch_placeholders: bool = True, window=None):
        if not fetch_placeholders:
            raise ValueError("batched packed caches attend only from their codes: fetch_placeholders must be True "
                             "(this model's attention bypasses mlx_lm's scaled_dot_product_attention)")
        self.options, self.fetch_placeholders = options, True
        self.window = window
        self.rows = Rows(options, batch_size, window)
        self._set_offset()
        self._pending: Optional[List[int]] = None  # real tokens still to come per row (prepare(lengths=...))
        self._lead: Optional[List[int]] = None  # pad tokens before each row's first one (prepare(left_padding=))
        self._chunk = None  # (T, first real position, real tokens, tokens before) per row, of the last update
        self._band = None  # the last chunk's exact copies per row (`Rows.band_before`)
        self._dependency = None  # mlx_lm's pipeline writes `keys` (PipelineDependency)

    B = property(lambda self: self.rows.B)
    lengths = property(lambda self: self.rows.lengths)

    def _set_offset(self) -> None:
        self.offset = mx.array(self.rows.lengths, dtype=mx.int32)  # what RoPE reads, once per update (not per layer)

    @property
    def left_padding(self) -> mx.array:
        r = self.rows
        return mx.array([r.tail.length - t for t in r.tail_n], dtype=mx.int32)

    @classmethod
    def merge(cls, caches) -> "TurboQuantBatchPackedCache":
        """One batch cache from per-sequence caches (empty, filled, or restored from a file)."""
        caches, single = list(caches), cls._single
        if not caches:
            raise ValueError(f"caches must hold at least one {single.__name__} to merge")
        for c in caches:
            if type(c) is not single:
                raise TypeError(f"caches must all be {single.__name__}, got {type(c).__name__}")
            if c.options != caches[0].options or c._cache_meta() != caches[0]._cache_meta():
                raise ValueError("caches to merge must share their options (one configuration per batch)")
        new = cls(caches[0].options, 0, caches[0].fetch_placeholders, window=caches[0].window)
        new.rows = concat_rows([c.rows for c in caches])
        new._set_offset()
        return new

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
        r = self.rows
        dims, B, H = r.dims, r.B, r.heads
        if (type(keys) is mx.array and type(values) is mx.array and dims is not None and B  # (no rows: checked below)
                and keys.shape == (B, H, 1, dims[0]) and values.shape == (B, H, 1, dims[1])
                and keys.dtype in FLOAT_DTYPES and values.dtype in FLOAT_DTYPES
                and self._dependency is None and self._pending is None and self._lead is None and _hook.is_active()):
            # A decode step (~30 per token): the checks below in one comparison of shapes.
            if self.options.channel_log2 is not None:
                keys, values = self._weigh(keys, values)
            r.append(keys, values, None, None if self.window is None else [1] * B)
            self._set_offset()
            self._chunk, self._band = _ONE_TOKEN, None
            return self._placeholders(keys.dtype, values.dtype)
        if not _hook.is_active():
            raise ValueError(f"{type(self).__name__} attends only from its codes: batch (batch_generate, "
                             "BatchGenerator, mlx_lm.server) on a model after veloxquant_mlx.enable(model), or inside "
                             "veloxquant_mlx.use_packed_attention()")
        _check_pair(keys, values, *(dims or (self.options.head_dim, None)))
        if keys.shape[0] != B:
            raise ValueError(f"keys have batch size {keys.shape[0]}, but this cache holds {B} sequences")
        if dims is not None and keys.shape[1] != H:
            raise ValueError(f"keys have {keys.shape[1]} KV heads, but this cache holds {H}")
        keys, values = self._weigh(*self._after_dependency(keys, values))
        T = keys.shape[2]
        lead = self._lead or [0] * B
        real = [max(min(T - a, T if self._pending is None else self._pending[i]), 0) for i, a in enumerate(lead)]
        if self._pending is not None:
            self._pending = [p - x for p, x in zip(self._pending, real)]
        self._lead = None  # left padding precedes the first chunk only
        self._band = r.band_before(keys, values, lead, real)  # (read by this chunk's attention)
        r.append(keys, values, lead, real)
        self._chunk = (T, lead, real, [n - x for n, x in zip(r.lengths, real)])
        self._set_offset()
        return self._placeholders(keys.dtype, values.dtype)

    def keys_and_values(self):
        """Placeholders of the stored history (as `update_and_fetch` returned them): attention reads the codes."""
        if self.rows.dims is None:
            raise ValueError("keys_and_values needs a cache holding tokens (call update_and_fetch first)")
        return self._placeholders(*getattr(self, "_dtypes", (mx.float32, mx.float32)))

    def _placeholders(self, k_dtype, v_dtype):
        r = self.rows
        self._dtypes = (k_dtype, v_dtype)
        N = sum(r.part_sizes())
        return _hook.owned_placeholders(self, (r.B, r.heads, N, r.dims[0]), (r.B, r.heads, N, r.dims[1]), k_dtype,
                                        v_dtype)

    # -- attention ------------------------------------------------------------------------------------
    def attention_parts(self) -> List[Any]:
        return self.rows.attention_parts()

    def _attend(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """SDPA of ``queries`` ``(B, Hq, L, d)`` over every row's stored tokens, from the codes ->
        ``(B, Hq, L, dv)``: the last update's L tokens (causal) or one query that sees everything. ``mask``
        (mlx_lm's, from `make_mask`) is replaced by each row's own: pad slots and pad queries are never attended."""
        r = self.rows
        if r.dims is None or not any(r.lengths):
            raise ValueError("attend_packed needs a cache holding tokens (call update_and_fetch first)")
        B, Hq, L, d = queries.shape
        if B != r.B:
            raise ValueError(f"queries have batch size {B}, but this cache holds {r.B} sequences")
        window = _requested_window(mask)
        if L > 1:
            return self._attend_chunk(queries, scale, sinks, window)
        if window is not None and any(n > window for n in self._stored_counts()):
            # a window narrower than what some row stores: each row alone, its newest `window` tokens
            outs = []
            for i, n in enumerate(self._stored_counts()):
                m = mx.arange(n) >= n - window if n > window else None
                outs.append(packed_attention(queries[i:i + 1], self.rows.row_parts(i), scale, m, sinks=sinks))
            return mx.concatenate(outs, axis=0)
        if B == 1:  # one sequence: nothing to fold, and no pad slot unless its tail has some or it evicted
            return attend_one_query(queries, r.row_parts(0), scale, sinks)
        if sinks is not None:
            sinks = mx.tile(sinks.reshape(-1), (B,))
        out = attend_one_query(queries.reshape(1, B * Hq, 1, d), r.attention_parts(), scale, sinks,
                               _folded_part_masks(r))
        return out.reshape(B, Hq, 1, out.shape[-1])

    def _stored_counts(self) -> List[int]:
        r = self.rows
        return [r.sink_n[i] + r.coded[i] - r.gone[i] + r.tail_n[i] for i in range(r.B)]

    def _attend_chunk(self, queries: mx.array, scale: float, sinks, window: Optional[int] = None) -> mx.array:
        """A prompt chunk, one sequence at a time (prefill, not the decode step): each row's real queries against
        its own parts, causal, exactly as alone; pad queries get zeros."""
        if self._chunk is None:
            raise ValueError(f"queries of L={queries.shape[2]} > 1 tokens must be the chunk update_and_fetch just "
                             "stored, but this batch stored none since it was built, filtered or extended")
        T, lead, real, before = self._chunk
        if queries.shape[2] != T:
            raise ValueError(f"queries must be the last update's {T} tokens or a single one, got L={queries.shape[2]}")
        B, Hq, _, _ = queries.shape
        dv, outs = self.rows.dims[1], []
        for i in range(B):
            a, n = lead[i], real[i]
            o = None
            if n:
                q, parts, mask = queries[i:i + 1, :, a:a + n], self.rows.row_parts(i), self._chunk_mask(n, before[i], window)
                band = getattr(self, "_band", None)
                if band is not None and band[i] is not None and n > 1 and self.rows.band_applies():
                    # each query reads its `recent` newest keys exact, as decoding them one at a time would
                    o = banded_attention(q, parts, ExactPart(*band[i]), self.rows.options.recent, scale, mask, sinks)
                else:
                    o = packed_attention(q, parts, scale, mask, sinks=sinks)
            pad = T - a - n
            pieces = [x for x in (mx.zeros((1, Hq, a, dv), queries.dtype) if a else None, o,
                                  mx.zeros((1, Hq, pad, dv), queries.dtype) if pad else None) if x is not None]
            outs.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2))
        return mx.concatenate(outs, axis=0)

    def _chunk_mask(self, n: int, before: int, window: Optional[int] = None):
        """The mask of a row's ``n`` real queries after ``before`` tokens, as its cache alone gets it from mlx_lm
        (``window``: a window mask the model asked for, else the cache's own)."""
        offset = before if self.window is None else min(self.window[0] - 1, before)
        window = window or (self.window[0] if self.window is not None else None)
        if window is not None and n > 1 and offset + n > window:
            return create_causal_mask(n, offset, window_size=window)
        return "causal" if n > 1 else None

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        # attend_packed builds each row's mask itself; mlx_lm gets the mask it expects for the longest row. A
        # window of another size than the cache's own is remembered with the mask (`_requested_window`).
        if window_size is not None:
            check_int("window_size", window_size, 1)
        n = max(self.lengths, default=0)
        if window_size not in (None, *(self.window or ())[:1]):
            return _window_mask(create_causal_mask(N, n, window_size=window_size), window_size)
        if return_array:
            return create_causal_mask(N, n)
        return None if N == 1 else "causal"

    # -- leaving, joining, handing back, trimming ------------------------------------------------------
    def filter(self, batch_indices) -> None:
        """Keep only the sequences ``batch_indices`` (in that order)."""
        idx = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        if any(not 0 <= i < self.B for i in idx):
            raise ValueError(f"batch_indices must lie in [0, {self.B}), got {idx}")
        self.rows = take_rows(self.rows, idx)
        self._set_offset()
        self._chunk = self._band = None

    def extract(self, idx: int):
        """Sequence ``idx`` as a per-sequence cache that continues exactly as it would in the batch."""
        if not 0 <= int(idx) < self.B:
            raise ValueError(f"idx must lie in [0, {self.B}), got {idx}")
        cache = self._single(self.options, fetch_placeholders=self.fetch_placeholders,
                             **({"max_size": self.window[0], "keep": self.window[1]} if self.window else {}))
        cache.rows = take_rows(self.rows, [int(idx)])
        return cache

    def extend(self, other: "TurboQuantBatchPackedCache") -> None:
        """Append ``other``'s sequences (in place)."""
        if type(other) is not type(self) or other.options != self.options or other.window != self.window:
            raise ValueError(f"extend needs another {type(self).__name__} with the same options")
        if any(c._pending is not None or c._lead is not None for c in (self, other)):
            raise ValueError("extend needs both batches between prompts (after finalize)")
        self.rows = concat_rows([self.rows, other.rows]) if other.B else self.rows
        self._set_offset()
        self._chunk = self._band = None

    def is_trimmable(self) -> bool:
        return self.window is None or max(self.lengths, default=0) < self.window[0]

    def trim(self, n: int) -> int:
        """Drop every row's ``n`` newest tokens (fewer where a row holds fewer); returns ``n``."""
        n = min(check_int("n", n, 0), max(self.lengths, default=0))
        if n:
            self.rows = _trim_rows(self.rows, [n] * self.B)
            self._set_offset()
            self._chunk = self._band = None
        return n

    # -- sizes and state ------------------------------------------------------------------------------
    def size(self) -> int:
        return min(max(self.lengths, default=0), self.window[0] if self.window else 1 << 62)

    def empty(self) -> bool:
        return not any(self.lengths)

    def _state(self) -> Dict[str, Any]:
        """Every array held, as stored (no copies: mlx_lm evaluates this between steps), and a JSON ``meta`` with
        the options and each row's token counts (`saved_state.batch_state`); `from_state` rebuilds the batch."""
        return saved_state.batch_state(self)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a batch from its ``state``. Each row is read out as the per-sequence cache `extract` gives and
        checked by that class's own `from_state` (so a batch believes no more than a sequence alone); the batch
        then holds the arrays as saved: each row continues exactly as it would have. Refuses, naming the array,
        what does not add up (`saved_state.restore_batch`)."""
        return saved_state.restore_batch(cls, state)
