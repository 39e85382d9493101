"""The mlx_lm-facing packed caches: thin faces over one storage engine (:mod:`veloxquant_mlx.cache.row_policy`).

- `TurboQuantPackedCache`: a drop-in for ``mlx_lm.models.cache.KVCache`` (one sequence, or several in lockstep
  as mlx_lm's KVCache holds them); `TurboQuantRotatingPackedCache` for ``RotatingKVCache`` (sliding windows, same
  ``max_size`` / ``keep``).
- `TurboQuantBatchPackedCache` / `TurboQuantBatchRotatingPackedCache`: what mlx_lm's ``BatchGenerator``
  (``batch_generate``, ``mlx_lm.server``) merges them into: ``prepare`` / ``finalize`` around padded prompts,
  ``filter`` / ``extend`` as sequences leave and join, ``extract(i)`` back to a single cache. Every row behaves
  exactly as its sequence alone (same tokens coded, same fits, same attention), whatever the options.

Keys AND values are stored as codes of a registered layout (``options.codec``) between an exact sink and an exact
tail. Inside ``use_packed_attention()`` (or after ``enable(model)``) mlx_lm's SDPA is sent to `attend_packed`,
which reads the codes (never a decoded history) and ``update_and_fetch`` returns zero-cost placeholders; elsewhere
a single cache decodes its history. These caches never define ``bits`` (mlx_lm would send any cache with ``bits``
to its affine quantized SDPA). ``state`` holds everything needed to rebuild (a JSON ``meta`` string plus the
arrays; mlx_lm >= 0.32 calls ``from_state(state)`` only) and `from_state` refuses a state that does not add up.

The faces share `_PackedFace` (:mod:`veloxquant_mlx.cache._face`); the batch faces' methods are `_BatchFace`'s
(:mod:`veloxquant_mlx.cache._batch`). Every class stays defined here (saved states and mlx_lm name them); the names
that lived here before that split are still importable from here.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import ExactPart, attend_one_query, banded_attention, packed_attention
from veloxquant_mlx.cache import saved_state
from veloxquant_mlx.cache._batch import _BatchFace
from veloxquant_mlx.cache._face import _PackedFace, _check_pair, _check_window, _decode, _trim_rows
from veloxquant_mlx.cache.row_policy import Rows
from veloxquant_mlx.codecs import check_codable, codec_layout
from veloxquant_mlx.cache.presets import resolve_options
from veloxquant_mlx.validate import FLOAT_DTYPES, check_bool, check_int



class TurboQuantPackedCache(_PackedFace):
    """mlx_lm-compatible KV cache storing keys and values as codes.

    Args:
        config: a `CacheOptions`, a preset name, a `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) or None;
            keyword options (`CacheOptions` fields: ``k_bits``, ``v_bits``, ``sink``, ``recent``, ``codec``, ...)
            override it.
        fetch_placeholders: while the packed-attention hook is active, `update_and_fetch` returns placeholders
            (attention reads the codes through `attend_packed`). False for a model whose attention does not go
            through mlx_lm's ``scaled_dot_product_attention``.
    """

    def __init__(self, config=None, *, fetch_placeholders: bool = True, **options):
        opts = resolve_options(config, **options).layer_options()
        if opts.kind != "packed":
            raise ValueError(f"{type(self).__name__} needs kind='packed', got kind={opts.kind!r}")
        self.options = opts
        self.fetch_placeholders = check_bool("fetch_placeholders", fetch_placeholders)
        # Set when update_and_fetch returned placeholders; cleared by attend_packed. Still set at the next update
        # means the model's attention bypassed the hook and read the placeholders: fail loudly.
        self._awaiting_attention = False
        self.rows = Rows(opts, 1, self.window)
        self._dependency = None

    @property
    def offset(self) -> int:
        return self.rows.lengths[0]

    @property
    def n_coded(self) -> int:
        """Tokens held as codes (the rest are in the exact sink and tail)."""
        return self.rows.coded[0] - self.rows.gone[0]

    def _stored(self) -> int:
        r = self.rows
        return r.sink_n[0] + r.coded[0] - r.gone[0] + r.tail_n[0]

    # -- the mlx_lm protocol ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``keys``/``values`` ``(B, H, T, d)``; return the whole history ``(B, H, n, d)`` in their dtype
        (a zero-cost placeholder of that shape while attention is routed to `attend_packed`)."""
        _check_pair(keys, values, *(self.dims or (self.options.head_dim, None)))
        rows = self.rows
        if rows.dims is None:
            if keys.shape[0] != rows.B:  # several sequences in lockstep, as mlx_lm's KVCache holds them
                self.rows = rows = Rows(self.options, keys.shape[0], self.window)
            if self.options.head_dim is not None and self.options.head_dim != keys.shape[-1]:
                raise ValueError(f"keys have head_dim {keys.shape[-1]}, but the cache was set up for "
                                 f"head_dim={self.options.head_dim}")
            # a layout that takes these head dims (the codec's own where it can): decided once, kept in the state
            self.options = rows.options = self.options.for_dims(keys.shape[-1], values.shape[-1])
        elif tuple(keys.shape[:2]) != (rows.B, rows.heads):
            raise ValueError(f"keys have (B, H) = {tuple(keys.shape[:2])}, but this cache holds {(rows.B, rows.heads)}")
        self._check_codable(keys, values)
        if self._awaiting_attention and _hook.is_active():
            raise RuntimeError(
                f"{type(self).__name__} returned placeholder keys/values but attend_packed was never called: this "
                "model's attention bypasses mlx_lm's scaled_dot_product_attention, so its output is wrong. Build "
                "the caches with veloxquant_mlx.make_prompt_cache(model, ...) (it detects such models) or pass "
                "fetch_placeholders=False.")
        keys, values = self._weigh(*self._after_dependency(keys, values))
        self._band = rows.band_before(keys, values)  # (read by this chunk's attention, `_banded`)
        rows.append(keys, values)
        self._dtypes = (keys.dtype, values.dtype)
        if self.fetch_placeholders and _hook.is_active():
            n = self._stored()
            self._awaiting_attention = True
            return _hook.owned_placeholders(self, (rows.B, rows.heads, n, rows.dims[0]),
                                            (rows.B, rows.heads, n, rows.dims[1]), keys.dtype, values.dtype)
        self._awaiting_attention = False
        return self._fetch(keys.dtype)

    def keys_and_values(self):
        """The stored history ``(B, H, n, d)``, as `update_and_fetch` last returned it: placeholders while attention is
        routed to the codes (a layer reading another layer's keys and values, gemma3n's, then attends from them),
        else decoded."""
        if self.empty():
            raise ValueError("keys_and_values needs a cache holding tokens (call update_and_fetch first)")
        k_dtype, v_dtype = getattr(self, "_dtypes", (mx.float32, mx.float32))
        if self.fetch_placeholders and _hook.is_active():
            r, n = self.rows, self._stored()
            return _hook.owned_placeholders(self, (r.B, r.heads, n, r.dims[0]), (r.B, r.heads, n, r.dims[1]),
                                            k_dtype, v_dtype)
        k, v = self._fetch(k_dtype)
        return k, (v if v.dtype == v_dtype else v.astype(v_dtype))

    def _check_codable(self, keys: mx.array, values: mx.array) -> None:
        """Refuse an update that would code a non-finite token with a layout coding keys (or values) per channel
        over blocks of tokens (`check_codable`: ValueError naming the argument; the cache is unchanged). Exact
        tokens (sink, tail) keep one to itself, as mlx_lm's KVCache; per-token layouts code it as such. One host
        sync per update that codes a block, none otherwise."""
        r, o, T = self.rows, self.options, keys.shape[2]
        n_sink = min(max(o.sink - r.sink_n[0], 0), T)
        n_code = r.tail_n[0] + T - n_sink - o.recent - o.trim_headroom
        if n_code <= 0:  # (the cheap exits first: this runs for every layer at every decode step)
            return
        layout = codec_layout(o.codec)
        if not (layout.keys.BLOCKED or layout.values.BLOCKED):
            return
        block = r.block if r.base is not None else layout.keys.from_options(o, "keys", keys.shape[-1]).token_block
        n_code = n_code // block * block
        if not n_code:
            return
        sides = {n: x for n, x, cls in (("keys", keys, layout.keys), ("values", values, layout.values)) if cls.BLOCKED}
        if self._dependency is not None:  # (mlx_lm's pipeline: the check, too, waits for the pending send)
            sides = dict(zip(sides, mx.depends(list(sides.values()), [self._dependency])))
        old = min(n_code, r.tail_n[0])
        tail = {n: a[:, :, r.tail.length - r.tail_n[0]:][:, :, :old] for n, a in r.tail.view().items()} if old else {}
        parts = {n: ([tail[n[0]]] if old else []) + [x[:, :, n_sink: n_sink + n_code - old]] for n, x in sides.items()}
        # (a sink still filling means no codes nor tail yet: the coded tokens follow the new sink ones)
        check_codable(parts, r.sink_n[0] + n_sink + self.n_coded, o.codec, block)

    def attention_parts(self) -> List[Any]:
        """The stored history as attention parts in temporal order ``[sink | codes | tail]`` (several sequences:
        folded ``(1, B*H, ...)``). Tail tokens older than the exact window read as they will once coded."""
        return self.rows.row_parts(0) if self.rows.B == 1 else self.rows.attention_parts(lockstep=True)

    def _attend(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """`attend_packed` in the stored (weighted) domain."""
        if self.empty():
            raise ValueError("attend_packed needs a cache holding tokens (call update_and_fetch first)")
        self._awaiting_attention = False
        r = self.rows
        if r.B == 1 and mask is None and type(queries) is mx.array and queries.ndim == 4 and \
                queries.dtype in FLOAT_DTYPES and queries.shape[0] == 1 and queries.shape[2] == 1 and \
                queries.shape[3] == r.dims[0] and queries.shape[1] % r.heads == 0 and \
                (sinks is None or sinks.size == queries.shape[1]):
            # A decode step of one sequence (~30 per token): packed_attention's checks and bookkeeping skipped
            return attend_one_query(queries, r.row_parts(0), scale, sinks)
        if not isinstance(queries, mx.array) or queries.ndim != 4 or queries.shape[0] == 1 or \
                queries.shape[0] != r.B:  # (one sequence; bad queries: packed_attention names them)
            band = self._chunk_band(queries)
            if band is not None:
                return banded_attention(queries, self.attention_parts(), band, r.options.recent, scale, mask, sinks)
            return packed_attention(queries, self.attention_parts(), scale, mask, sinks=sinks)
        B, Hq, L, d = queries.shape
        if isinstance(mask, mx.array):  # sequences in lockstep: fold them into the heads
            mask = mx.broadcast_to(mask, (B, Hq) + mask.shape[-2:]).reshape(1, B * Hq, *mask.shape[-2:])
        band, sinks = self._chunk_band(queries, folded=True), None if sinks is None else mx.tile(sinks.reshape(-1), (B,))
        q = queries.reshape(1, B * Hq, L, d)
        out = packed_attention(q, self.attention_parts(), scale, mask, sinks=sinks) if band is None else \
            banded_attention(q, self.attention_parts(), band, r.options.recent, scale, mask, sinks)
        return out.reshape(B, Hq, L, out.shape[-1])

    def _chunk_band(self, queries, folded: bool = False) -> Optional[ExactPart]:
        """The exact copies the last chunk's queries read as their newest keys (`Rows.band_before`; rows in lockstep
        concatenated, ``folded`` into the heads), or None where they read what is stored."""
        band = getattr(self, "_band", None)
        if band is None or not 1 < queries.shape[2] <= band[0][0].shape[2] or not self.rows.band_applies():
            return None
        k, v = (mx.concatenate([b[j] for b in band], axis=0) if len(band) > 1 else band[0][j] for j in (0, 1))
        if folded:
            k, v = (x.reshape(1, -1, *x.shape[2:]) for x in (k, v))
        return ExactPart(k, v)

    def _fetch(self, dtype):
        """The whole history decoded, ``(B, H, n, d)`` in ``dtype`` (the path outside attention on codes)."""
        k, v = _decode(self.attention_parts(), dtype)
        cw = self.channel_weights
        if cw is not None:  # back from the weighted domain (exact: powers of two)
            k, v = k / cw[0][:, None, :].astype(dtype), v / cw[1][:, None, :].astype(dtype)
        B, H = self.rows.B, self.rows.heads
        return (k, v) if B == 1 else (k.reshape(B, H, *k.shape[2:]), v.reshape(B, H, *v.shape[2:]))

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens (tail first, then codes, then sink); returns how many were dropped."""
        n = min(check_int("n", n, 0), self.offset)
        if n:
            self.rows = _trim_rows(self.rows, [n] * self.rows.B)
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    @classmethod
    def merge(cls, caches):
        """mlx_lm's batching: per-sequence caches -> one `TurboQuantBatchPackedCache` (every sequence stays packed);
        caches that hand out real arrays (`_merge_decoded`) -> mlx_lm's own batch cache."""
        caches = list(caches)
        if any(isinstance(c, TurboQuantPackedCache) and not c.fetch_placeholders for c in caches):
            return _merge_decoded(caches, mlx_cache.KVCache, mlx_cache.BatchKVCache)
        return TurboQuantBatchPackedCache.merge(caches)

    # -- bytes and state --------------------------------------------------------------------------
    @property
    def live_nbytes(self) -> int:
        """Like `nbytes` but without the spare capacity of the step-grown buffers (= a saved file's arrays)."""
        return sum(a.nbytes for n, a in self.state.items() if n != "meta")

    def bits_per_coordinate(self) -> float:
        """Stored bits per cached coordinate, averaged over K and V, every stored byte counted."""
        if self.dims is None or self.offset == 0:
            return 0.0
        return 8.0 * self.live_nbytes / (self.rows.B * self.rows.heads * self._stored() * sum(self.dims))

    def _state(self) -> Dict[str, Any]:
        return saved_state.single_state(self)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild from ``state`` alone (what mlx_lm's ``load_prompt_cache`` passes); refuses, naming the array,
        a state whose arrays do not match its options, dims and token counts (`saved_state.restore_single`)."""
        return saved_state.restore_single(cls, state)


class TurboQuantRotatingPackedCache(TurboQuantPackedCache):
    """Compressed counterpart of mlx_lm's `RotatingKVCache` (same ``max_size`` / ``keep`` semantics).

    Unlike mlx_lm's ring buffer, tokens stay in temporal order: the ``keep`` first tokens are never evicted and the
    oldest of the others are dropped when the window is full. The token sets, and hence the attention results,
    match `RotatingKVCache`: a multi-token update keeps ``max_size - 1`` old tokens and appends all new ones; a
    one-token update keeps ``max_size``. The exact ``sink`` must lie within ``keep`` (never evicted).
    """

    def __init__(self, config=None, max_size: int = None, keep: int = 0, **options):
        opts = resolve_options(config, **{k: v for k, v in options.items() if k != "fetch_placeholders"})
        self.window = _check_window(opts.layer_options(), max_size, keep)
        super().__init__(config, **options)

    max_size = property(lambda self: self.window[0])
    keep = property(lambda self: self.window[1])

    @classmethod
    def merge(cls, caches):
        """mlx_lm's batching: per-sequence windows -> one `TurboQuantBatchRotatingPackedCache` (each evicts its own);
        windows that hand out real arrays -> mlx_lm's own (`_merge_decoded`)."""
        caches = list(caches)
        if any(isinstance(c, TurboQuantPackedCache) and not c.fetch_placeholders for c in caches):
            window = caches[0].window
            return _merge_decoded(caches, lambda: mlx_cache.RotatingKVCache(max_size=window[0], keep=window[1]),
                                  mlx_cache.BatchRotatingKVCache)
        return TurboQuantBatchRotatingPackedCache.merge(caches)

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        # mlx_lm's RotatingKVCache.make_mask, for a cache kept in temporal order (no roll needed).
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        if self.offset >= window_size and self.max_size > window_size:
            size = self.offset + 1 if self.offset < self.max_size else self.max_size
            return mx.arange(size) >= (size - window_size)
        return None


def _merge_decoded(caches, make_single, batch_class):
    """Caches built to hand out real arrays (a model that computes on its fetched keys / values: MLA latents,
    `veloxquant_mlx.integration.fetches_real_arrays`) cannot batch from their codes (a batch attends from them only):
    their decoded histories go into mlx_lm's own batch cache, plain while batched (a warning says so)."""
    plain = []
    for c in caches:
        single = make_single()
        if isinstance(c, TurboQuantPackedCache) and not c.empty():
            single.update_and_fetch(*c._fetch(getattr(c, "_dtypes", (mx.float32,))[0]))
        elif not isinstance(c, TurboQuantPackedCache):
            single = c
        plain.append(single)
    warnings.warn("veloxquant_mlx: this model computes on its caches' keys / values (an MLA latent, say), so its "
                  f"caches batch as mlx_lm's {batch_class.__name__}: uncompressed while batched", stacklevel=3)
    return batch_class.merge(plain)


class TurboQuantBatchPackedCache(_BatchFace):
    """A batch of `TurboQuantPackedCache` s (made by ``TurboQuantPackedCache.merge``); see the module docstring.

    ``offset`` is the ``(B,)`` int32 array of each sequence's token count (RoPE positions, as mlx_lm's
    ``BatchKVCache``); ``left_padding`` the pad slots before each row's tail. Attention runs on codes only: a
    decode step is one call over the folded batch with a mask of each row's valid slots; a prompt chunk is
    attended one sequence at a time, its real queries against its own tokens, exactly as alone.
    """

    _single = TurboQuantPackedCache


class TurboQuantBatchRotatingPackedCache(TurboQuantBatchPackedCache):
    """A batch of `TurboQuantRotatingPackedCache` s (sliding-window layers): every row evicts its own oldest
    tokens, as alone (its ``keep`` first ones are never evicted)."""

    _single = TurboQuantRotatingPackedCache

    def __init__(self, options, batch_size: int, max_size: int = None, keep: int = 0, fetch_placeholders: bool = True,
                 window=None):
        super().__init__(options, batch_size, fetch_placeholders, window or _check_window(options, max_size, keep))

    max_size = property(lambda self: self.window[0])
    keep = property(lambda self: self.window[1])

