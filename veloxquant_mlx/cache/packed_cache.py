"""The mlx_lm-facing packed caches: thin faces over one storage engine (:mod:`veloxquant_mlx.cache.rows`).

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
"""
from __future__ import annotations

import collections
import json
import warnings
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import ExactPart, attend_one_query, packed_attention
from veloxquant_mlx.cache import _state_check as _state
from veloxquant_mlx.cache._pipeline import PipelineDependency
from veloxquant_mlx.cache.rows import Rows, concat_rows, row_arrays, take_rows
from veloxquant_mlx.codecs import check_codable, codec_layout
from veloxquant_mlx.options import resolve_options
from veloxquant_mlx.validate import FLOAT_DTYPES, check_bool, check_heads, check_int

# of a single cache's ``state``; formats 1 (config + options) and 2 are still read, except turboquant_prod codes:
# format 3 changed their QJL sketch (orthogonal rows), so older prod codes would decode wrongly
FORMAT = 3
BATCH_FORMAT = 1  # of a batch cache's ``state``


def _check_pair(keys, values, k_dim: Optional[int], v_dim: Optional[int]) -> None:
    check_heads("keys", keys, k_dim)
    check_heads("values", values, v_dim)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}")
    if keys.shape[2] == 0:
        raise ValueError("keys and values must hold at least one token (T >= 1), got T = 0")


def _check_window(options, max_size, keep) -> tuple:
    """``(max_size, keep)`` of a sliding window, checked against the options."""
    if codec_layout(options.codec).keys.BLOCKED:
        raise ValueError(f"codec={options.codec!r} codes keys in blocks of tokens, which a sliding window cannot evict "
                         "one at a time; use codec='affine' for RotatingKVCache layers (make_prompt_cache does so)")
    max_size, keep = check_int("max_size", max_size, 1), check_int("keep", keep, 0)
    if keep > max_size:
        raise ValueError(f"keep must be <= max_size ({max_size}), got {keep}")
    if options.sink > keep:
        raise ValueError(f"sink must be <= keep ({keep}) in a rotating cache (sink tokens are never evicted), got "
                         f"{options.sink}")
    return max_size, keep


@lru_cache(maxsize=512)
def _weight_arrays(channel_log2) -> Optional[Tuple[mx.array, mx.array]]:
    """``options.channel_log2`` as ``(key weights, value weights)`` float32 arrays (shared by every cache of a
    layer), or None."""
    if channel_log2 is None:
        return None
    out = tuple(mx.power(2.0, mx.array(side, dtype=mx.float32)) for side in channel_log2)
    mx.eval(out)
    return out


def _decode(parts, dtype):
    """Parts decoded and concatenated along the tokens ``(B, H, n, d)`` (the path outside attention on codes)."""
    ks = [p.keys.astype(dtype) if isinstance(p, ExactPart) else p.k_codec.decode(p.k_arrays, dtype) for p in parts]
    vs = [p.values.astype(dtype) if isinstance(p, ExactPart) else p.v_codec.decode(p.v_arrays, dtype) for p in parts]
    return (ks[0], vs[0]) if len(ks) == 1 else (mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))


class _PackedFace(PipelineDependency, _BaseCache):
    """What every packed cache shares: the options, the rows, bytes, copies."""

    window = None  # (max_size, keep) of a sliding window
    # Its placeholders are its own (`hook.owned_placeholders`): the routing attends from the codes only when attention
    # gets them (real arrays, e.g. fetched decoded, go to mlx_lm's own attention).
    owns_placeholders = True

    k_bits = property(lambda self: self.options.k_bits)
    v_bits = property(lambda self: self.options.v_bits)
    sink = property(lambda self: self.options.sink)
    recent = property(lambda self: self.options.recent)
    trim_headroom = property(lambda self: self.options.trim_headroom)
    codec = property(lambda self: self.options.codec)
    dims = property(lambda self: self.rows.dims)
    k_codec = property(lambda self: self.rows.k_codec)
    v_codec = property(lambda self: self.rows.v_codec)

    @property
    def config(self):
        """The options as the seed pages' `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``)."""
        return self.options.kv_config()

    @property
    def nbytes(self) -> int:
        """Bytes of every array this cache holds (codes with their free slots, exact windows, fitted parameters)."""
        return self.rows.nbytes

    def _cache_meta(self) -> Dict[str, Any]:
        meta = {"fetch_placeholders": self.fetch_placeholders}
        return {**meta, "max_size": self.window[0], "keep": self.window[1]} if self.window else meta

    @property
    def state(self) -> Dict[str, Any]:
        return self._state()

    @state.setter
    def state(self, value) -> None:
        self.__dict__.update(type(self).from_state(value).__dict__)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.rows = self.rows.copy()
        return new

    # -- static channel weights (calibration): stored = x * w; queries / w_k; outputs / w_v ------------------------
    @property
    def channel_weights(self) -> Optional[Tuple[mx.array, mx.array]]:
        """``(key weights, value weights)``, each ``(heads, d)`` float32 powers of two (``options.channel_log2``),
        or None. Everything stored (codes and exact tokens, `attention_parts`) is in the weighted domain."""
        return _weight_arrays(self.options.channel_log2)

    def _weigh(self, keys: mx.array, values: mx.array):
        """``keys`` / ``values`` ``(B, H, T, d)`` times their channel weights (exact: powers of two)."""
        cw = self.channel_weights
        if cw is None:
            return keys, values
        wk, wv = cw
        if keys.shape[1] != wk.shape[0] or keys.shape[-1] != wk.shape[1] or values.shape[-1] != wv.shape[1]:
            raise ValueError(f"this cache's channel weights (calibration {self.options.calibration_id}) are for "
                             f"{wk.shape[0]} KV heads of dims {wk.shape[1]}/{wv.shape[1]}, but keys/values have "
                             f"shapes {tuple(keys.shape)} / {tuple(values.shape)} (a sharded model needs a "
                             "calibration of its own shard)")
        return keys * wk[:, None, :].astype(keys.dtype), values * wv[:, None, :].astype(values.dtype)

    def attend_packed(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """SDPA of ``queries`` ``(B, Hq, L, d)`` over everything stored, from the codes -> ``(B, Hq, L, dv)``.

        The packed-attention protocol (see :mod:`veloxquant_mlx.attention`); mask as mlx_lm passes it. With channel
        weights: ``(q / w_k) . (w_k k) = q . k``, and the output ``sum p (w_v v)`` divided by ``w_v``.
        """
        cw = self.channel_weights
        if cw is None or not isinstance(queries, mx.array) or queries.ndim != 4 or queries.shape[1] % cw[0].shape[0]:
            return self._attend(queries, scale, mask, sinks)  # (bad queries: the attention names them)
        g = queries.shape[1] // cw[0].shape[0]
        wk, wv = (mx.repeat(w, g, axis=0)[:, None, :] if g > 1 else w[:, None, :] for w in cw)
        out = self._attend(queries / wk.astype(queries.dtype), scale, mask, sinks)
        return out / wv.astype(out.dtype)


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
            return packed_attention(queries, self.attention_parts(), scale, mask, sinks=sinks)
        B, Hq, L, d = queries.shape
        if isinstance(mask, mx.array):  # sequences in lockstep: fold them into the heads
            mask = mx.broadcast_to(mask, (B, Hq) + mask.shape[-2:]).reshape(1, B * Hq, *mask.shape[-2:])
        out = packed_attention(queries.reshape(1, B * Hq, L, d), self.attention_parts(), scale, mask,
                               sinks=None if sinks is None else mx.tile(sinks.reshape(-1), (B,)))
        return out.reshape(B, Hq, L, out.shape[-1])

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
        r = self.rows
        meta = {"format": FORMAT, "class": type(self).__name__, "options": self.options.to_dict(),
                "cache": self._cache_meta(), "offset": self.offset, "dims": list(r.dims) if r.dims else None,
                "stores": {"codes": self.n_coded, "sink": r.sink_n[0], "tail": r.tail_n[0]}}
        out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
        per_row = [row_arrays(r, i) for i in range(r.B)]
        arrays = per_row[0] if r.B == 1 else {  # sequences in lockstep: their arrays share every shape
            name: {f: mx.concatenate([p[name][f] for p in per_row], axis=0) for f in per_row[0][name]}
            for name in per_row[0]}
        names = ("sink", "tail", "k_codes", "v_codes", "k_fit", "v_fit")
        for prefix, name in zip(_state.single_prefixes(r.block), names):
            out.update({prefix + f: a for f, a in arrays[name].items()})
        return out

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild from ``state`` alone (what mlx_lm's ``load_prompt_cache`` passes); refuses, naming the array,
        a state whose arrays do not match its options, dims and token counts."""
        options, kwargs, meta = _state.read_meta(cls, state)
        cache = cls(options, **kwargs)
        cache.rows = _state.restore_rows(cls, state, meta, options, cache.window)
        return cache


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


def _trim_rows(rows: Rows, counts: List[int]) -> Rows:
    """Each row ``i`` without its ``counts[i]`` newest tokens (a batch trims its rows one at a time)."""
    if rows.B == 1:
        rows.trim(min(counts[0], rows.lengths[0]))
        return rows
    parts = []
    for i, n in enumerate(counts):
        one = take_rows(rows, [i])
        one.trim(min(n, one.lengths[0]))
        parts.append(one)
    return concat_rows(parts)


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


class TurboQuantBatchPackedCache(_PackedFace):
    """A batch of `TurboQuantPackedCache` s (made by ``TurboQuantPackedCache.merge``); see the module docstring.

    ``offset`` is the ``(B,)`` int32 array of each sequence's token count (RoPE positions, as mlx_lm's
    ``BatchKVCache``); ``left_padding`` the pad slots before each row's tail. Attention runs on codes only: a
    decode step is one call over the folded batch with a mask of each row's valid slots; a prompt chunk is
    attended one sequence at a time, its real queries against its own tokens, exactly as alone.
    """

    _single = TurboQuantPackedCache

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
            self._chunk = _ONE_TOKEN
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
                o = packed_attention(queries[i:i + 1, :, a:a + n], self.rows.row_parts(i), scale,
                                     self._chunk_mask(n, before[i], window), sinks=sinks)
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
        self._chunk = None

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
        self._chunk = None

    def is_trimmable(self) -> bool:
        return self.window is None or max(self.lengths, default=0) < self.window[0]

    def trim(self, n: int) -> int:
        """Drop every row's ``n`` newest tokens (fewer where a row holds fewer); returns ``n``."""
        n = min(check_int("n", n, 0), max(self.lengths, default=0))
        if n:
            self.rows = _trim_rows(self.rows, [n] * self.B)
            self._set_offset()
            self._chunk = None
        return n

    # -- sizes and state ------------------------------------------------------------------------------
    def size(self) -> int:
        return min(max(self.lengths, default=0), self.window[0] if self.window else 1 << 62)

    def empty(self) -> bool:
        return not any(self.lengths)

    def _state(self) -> Dict[str, Any]:
        """Every array held, as stored (no copies: mlx_lm evaluates this between steps), and a JSON ``meta`` with
        the options and each row's token counts; `from_state` rebuilds the batch from it."""
        r = self.rows
        meta = {"format": BATCH_FORMAT, "class": type(self).__name__, "options": self.options.to_dict(),
                "cache": self._cache_meta(), "dims": list(r.dims) if r.dims else None, "heads": r.heads,
                "rows": {**{n: list(getattr(r, n)) for n in _state.BATCH_ROWS}, "start": list(r.gone),
                         "fitted": list(r.fitted)},
                "mid_prompt": self._pending is not None or self._lead is not None}
        out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
        if r.dims is None:
            return out
        for prefix, arrays in (("s_", r.sink or {}), ("t_", r.tail.live_arrays() if r.tail.length else {}),
                               ("ck_", r.k_codes.arrays), ("cv_", r.v_codes.arrays),
                               ("kfit_", r.fitted_rows(0)), ("vfit_", r.fitted_rows(1))):
            out.update({prefix + n: a for n, a in arrays.items()})
        return out

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a batch from its ``state``. Each row is read out as the per-sequence cache `extract` gives and
        checked by that class's own `from_state` (so a batch believes no more than a sequence alone); the batch
        then holds the arrays as saved: each row continues exactly as it would have. Refuses, naming the array,
        what does not add up."""
        options, kwargs, meta = _state.read_batch_meta(cls, state)
        window = (kwargs.pop("max_size"), kwargs.pop("keep")) if "max_size" in kwargs else None
        if window is not None:
            window = _check_window(options, *window)
        batch = cls(options, len(meta["rows"]["lengths"]), window=window, **kwargs)
        batch.rows = _state.restore_batch_rows(cls, state, meta, batch.rows)
        if batch.rows.dims is None or not batch.B:
            batch._set_offset()
            return batch
        for i in range(batch.B):
            try:
                cls._single.from_state(batch.extract(i).state)
            except ValueError as e:
                raise ValueError(f"{cls.__name__} state: row {i}: {e}") from None
        batch._set_offset()
        return batch


class TurboQuantBatchRotatingPackedCache(TurboQuantBatchPackedCache):
    """A batch of `TurboQuantRotatingPackedCache` s (sliding-window layers): every row evicts its own oldest
    tokens, as alone (its ``keep`` first ones are never evicted)."""

    _single = TurboQuantRotatingPackedCache

    def __init__(self, options, batch_size: int, max_size: int = None, keep: int = 0, fetch_placeholders: bool = True,
                 window=None):
        super().__init__(options, batch_size, fetch_placeholders, window or _check_window(options, max_size, keep))

    max_size = property(lambda self: self.window[0])
    keep = property(lambda self: self.window[1])
