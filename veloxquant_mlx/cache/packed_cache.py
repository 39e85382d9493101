"""Servable compressed KV caches for mlx_lm: keys AND values stored as codes of a registered layout.

`TurboQuantPackedCache` is a drop-in for `mlx_lm.models.cache.KVCache`; `TurboQuantRotatingPackedCache` for
`RotatingKVCache` (sliding-window layers, same ``max_size`` / ``keep``).

Storage, in temporal order (token axis 2 for the exact parts; the codes in their codec's layout):

    [ sink: first ``sink`` tokens, exact | codes: K and V codes | tail: newest tokens, exact ]

The tail holds the last ``recent`` tokens plus, when ``recent > 0``, up to ``trim_headroom`` older ones, read
through an encode/decode round trip (exactly as coded tokens read) and coded when they leave the tail: after
``trim(n <= trim_headroom)`` (speculative decoding) the last ``recent`` tokens are still exact. A codec that
codes blocks of tokens (``token_block > 1``) codes whole blocks only; up to ``block - 1`` more tokens wait
exact in the tail. No full-precision copy of the coded history exists; `nbytes` sums the stored arrays.

Attention: mlx_lm calls ``update_and_fetch`` then its SDPA. Inside ``use_packed_attention()`` the hook sends
SDPA to `attend_packed`, which reads `attention_parts()` (codes and exact windows) and never decodes the
history; ``update_and_fetch`` then returns zero-cost placeholders (``fetch_placeholders``; the builder turns it
off for models whose attention bypasses mlx_lm's function). Elsewhere ``update_and_fetch`` decodes. These
caches never define ``bits`` (mlx_lm would send any cache with ``bits`` to its affine quantized SDPA).

``state`` holds everything needed to rebuild (a JSON ``meta`` string with the options and offset, plus the
arrays), because mlx_lm >= 0.32 calls ``from_state(state)`` only; `from_state` refuses a state whose arrays do
not add up, naming the array.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, packed_attention
from veloxquant_mlx.cache._pipeline import PipelineDependency
from veloxquant_mlx.cache._token_store import TokenStore
from veloxquant_mlx.options import CacheOptions
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.codecs._common import check_codable
from veloxquant_mlx.validate import check_bool, check_heads, check_int

# of ``state``; formats 1 (config + options, before CacheOptions) and 2 are still read, except turboquant_prod codes:
# format 3 changed their QJL sketch (orthogonal rows), so older prod codes would decode wrongly
FORMAT = 3
_CACHE_FIELDS = ("fetch_placeholders",)


def resolve_options(config=None, **options) -> CacheOptions:
    """`CacheOptions` from a `CacheOptions`, a seed-page `KVCacheConfig` or None, plus keyword options."""
    if config is None:
        return CacheOptions.from_dict(options)
    if isinstance(config, CacheOptions):
        return dataclasses.replace(config, **options) if options else config
    from veloxquant_mlx.config import KVCacheConfig

    if isinstance(config, KVCacheConfig):
        return CacheOptions.from_kv_config(config, **options)
    raise TypeError(f"config must be a CacheOptions, a KVCacheConfig or None, got {type(config).__name__}")


def _check_pair(keys, values, k_dim: Optional[int], v_dim: Optional[int]) -> None:
    check_heads("keys", keys, k_dim)
    check_heads("values", values, v_dim)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if keys.shape[2] == 0:
        raise ValueError("keys and values must hold at least one token (T >= 1), got T = 0")


class TurboQuantPackedCache(PipelineDependency, _BaseCache):
    """mlx_lm-compatible KV cache storing keys and values as codes.

    Args:
        config: `CacheOptions`, a `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) or None; keyword options
            (`CacheOptions` fields: ``k_bits``, ``v_bits``, ``sink``, ``recent``, ``codec``, ...) override it.
        fetch_placeholders: while the packed-attention hook is active, `update_and_fetch` returns placeholders
            (attention reads the codes through `attend_packed`). False for a model whose attention does not go
            through mlx_lm's ``scaled_dot_product_attention``.
    """

    step = 256

    def __init__(self, config=None, *, fetch_placeholders: bool = True, **options):
        opts = resolve_options(config, **options).layer_options()
        if opts.kind != "packed":
            raise ValueError(f"{type(self).__name__} needs kind='packed', got kind={opts.kind!r}")
        self.options = opts
        self.fetch_placeholders = check_bool("fetch_placeholders", fetch_placeholders)
        # Set when update_and_fetch returned placeholders; cleared by attend_packed. Still set at the next update
        # means the model's attention bypassed the hook and read the placeholders: fail loudly.
        self._awaiting_attention = False
        self.offset = 0
        self.dims: Optional[tuple] = None  # (key head_dim, value head_dim), fixed by the first update
        self.k_codec = self.v_codec = None
        self.k_codes = self.v_codes = None  # the codecs' stores, made with the codecs
        self.sink_store = TokenStore(max(1, opts.sink))
        self.tail = TokenStore(max(16, opts.recent + opts.trim_headroom))
        self._dependency = None  # mlx_lm's pipeline writes `keys` (PipelineDependency)

    # -- the options, read-only -------------------------------------------------------------------
    k_bits = property(lambda self: self.options.k_bits)
    v_bits = property(lambda self: self.options.v_bits)
    sink = property(lambda self: self.options.sink)
    recent = property(lambda self: self.options.recent)
    trim_headroom = property(lambda self: self.options.trim_headroom)
    codec = property(lambda self: self.options.codec)

    @property
    def config(self):
        """The options as the seed pages' `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``)."""
        return self.options.kv_config()

    def _setup(self, k_dim: int, v_dim: int) -> None:
        """Make the codecs and their stores once the head dims are known (first update, or a restore)."""
        if self.options.head_dim is not None and self.options.head_dim != k_dim:
            raise ValueError(f"keys have head_dim {k_dim}, but the cache was set up for head_dim={self.options.head_dim}")
        self.k_codec, self.v_codec = codec_layout(self.options.codec).make(self.options, k_dim, v_dim)
        block = self.k_codec.token_block
        self.k_codes = self.k_codec.new_store(self.step)
        # With block keys, values arrive a whole block at a time: growing by one block keeps their store exactly
        # full, so attention reads whole contiguous arrays (no slice, no copy inside the quantized matmul).
        self.v_codes = self.v_codec.new_store(block if block > 1 else self.step)
        self.dims = (k_dim, v_dim)

    @property
    def _block(self) -> int:
        return self.k_codec.token_block if self.k_codec is not None else 1

    @property
    def n_coded(self) -> int:
        """Tokens held as codes (the rest are in the exact sink and tail)."""
        return self.v_codes.length if self.v_codes is not None else 0

    @property
    def _count(self) -> int:
        return self.sink_store.length + self.n_coded + self.tail.length

    # -- the mlx_lm protocol ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``keys``/``values`` ``(B, H, T, d)``; return the whole history ``(B, H, n, d)`` in their dtype
        (a zero-cost placeholder of that shape while attention is routed to `attend_packed`)."""
        _check_pair(keys, values, *(self.dims or (self.options.head_dim, None)))
        self._check_codable(keys, values)
        self._append(keys, values)
        return self._history(keys.dtype)

    def _check_codable(self, keys: mx.array, values: mx.array) -> None:
        """Refuse an update that would code a non-finite token with a layout coding keys (or values) per channel
        over blocks of tokens (`check_codable`: ValueError naming the argument; the cache is unchanged). Exact
        tokens (sink, tail) keep one to itself, as mlx_lm's KVCache; per-token layouts code it as such. One host
        sync per update that codes a block, none otherwise."""
        T = keys.shape[2]
        n_sink = min(max(self.sink - self.sink_store.length, 0), T)
        n_code = self.tail.length + T - n_sink - self.recent - self.trim_headroom  # as `_append_to_tail`
        if n_code <= 0:  # (the cheap exits first: this runs for every layer at every decode step)
            return
        layout = codec_layout(self.codec)
        if not (layout.keys.BLOCKED or layout.values.BLOCKED):
            return
        block = self._block if self.k_codec is not None else \
            layout.keys.from_options(self.options, "keys", keys.shape[-1]).token_block
        n_code = n_code // block * block
        sides = {n: x for n, x, cls in (("keys", keys, layout.keys), ("values", values, layout.values)) if cls.BLOCKED}
        if n_code:  # the oldest tail tokens, then the new ones
            if self._dependency is not None:  # (mlx_lm's pipeline: the check, too, waits for the pending send)
                sides = dict(zip(sides, mx.depends(list(sides.values()), [self._dependency])))
            old = min(n_code, self.tail.length)
            tail = self.tail.view(0, old) if old else {}
            parts = {n: ([tail[n[0]]] if old else []) + [x[:, :, n_sink: n_sink + n_code - old]]
                     for n, x in sides.items()}  # (the tail's arrays: "k", "v")
            # (a sink still filling means no codes nor tail yet: the coded tokens follow the new sink ones)
            check_codable(parts, self.sink_store.length + n_sink + self.n_coded, self.codec, block)

    def _history(self, dtype):
        if self.fetch_placeholders and _hook.is_active():
            B, H = self._heads()
            n = self._count
            self._awaiting_attention = True
            return (_hook.placeholder_history((B, H, n, self.dims[0]), dtype),
                    _hook.placeholder_history((B, H, n, self.dims[1]), dtype))
        self._awaiting_attention = False
        return self._fetch(dtype)

    def _heads(self):
        store = next(s for s in (self.v_codes, self.sink_store, self.tail) if s is not None and s.buffers)
        return tuple(next(iter(store.buffers.values())).shape[:2])

    def attend_packed(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """SDPA of ``queries`` ``(B, Hq, L, d)`` over everything stored, from the codes -> ``(B, Hq, L, dv)``.

        The packed-attention protocol (see :mod:`veloxquant_mlx.attention`); mask as mlx_lm passes it.
        """
        if self.empty():
            raise ValueError("attend_packed needs a cache holding tokens (call update_and_fetch first)")
        self._awaiting_attention = False
        return packed_attention(queries, self.attention_parts(), scale, mask, sinks=sinks)

    def attention_parts(self) -> List[Any]:
        """The stored history as attention parts in temporal order: ``[sink | codes | tail]``.

        Tail tokens older than the exact window read as they will once coded (a round trip of a few tokens).
        """
        parts: List[Any] = []
        if self.sink_store.length:
            s = self.sink_store.view()
            parts.append(ExactPart(s["k"], s["v"]))
        if self.n_coded:
            parts.append(CodedPart(self.k_codec, self.k_codes.view(), self.v_codec, self.v_codes.view()))
        if self.tail.length:
            n_old = self._exact_tail_from
            if n_old:
                old = self.tail.view(0, n_old)
                parts.append(CodedPart(self.k_codec, self.k_codec.encode(old["k"]),
                                       self.v_codec, self.v_codec.encode(old["v"])))
            t = self.tail.view(n_old)
            parts.append(ExactPart(t["k"], t["v"]))
        return parts

    @property
    def _exact_tail_from(self) -> int:
        """Index of the first tail token read exactly (older ones read as coded tokens would)."""
        if self._block > 1:
            return 0  # block codecs: the whole tail is exact until its blocks are coded
        return max(self.tail.length - self.recent, 0)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        if self._awaiting_attention and _hook.is_active():
            raise RuntimeError(
                f"{type(self).__name__} returned placeholder keys/values but attend_packed was never called: this "
                "model's attention bypasses mlx_lm's scaled_dot_product_attention, so its output is wrong. Build "
                "the caches with veloxquant_mlx.make_prompt_cache(model, ...) (it detects such models) or pass "
                "fetch_placeholders=False.")
        _check_pair(keys, values, *(self.dims or (self.options.head_dim, None)))
        keys, values = self._after_dependency(keys, values)
        if self.dims is None:
            self._setup(keys.shape[-1], values.shape[-1])
        elif tuple(keys.shape[:2]) != self._heads():
            raise ValueError(f"keys have (B, H) = {tuple(keys.shape[:2])}, but this cache holds {self._heads()}")
        T = keys.shape[2]
        n_sink = min(max(self.sink - self.sink_store.length, 0), T)
        if n_sink:
            self.sink_store.append({"k": keys[:, :, :n_sink], "v": values[:, :, :n_sink]})
        if T > n_sink:
            k_rest, v_rest = keys[:, :, n_sink:], values[:, :, n_sink:]
            if self._block == 1 and self.recent == 0:
                self._code(k_rest, v_rest)
            else:
                self._append_to_tail(k_rest, v_rest)
        self.offset += T

    def _append_to_tail(self, k: mx.array, v: mx.array) -> None:
        """New tokens wait exact in the tail; the oldest, beyond the exact window and the trim headroom, are coded
        (in whole blocks for block codecs) and leave it."""
        self.tail.append({"k": k, "v": v})
        blk = self._block
        n_code = self.tail.length - self.recent - self.trim_headroom
        if blk > 1:
            n_code = n_code // blk * blk
        if not self._fitted and (n_code > 0 or (blk == 1 and self.tail.length > self.recent)):
            self._fit(self.tail.view())  # every exact non-sink token held: more statistics, same cost
        if n_code > 0:
            old = self.tail.view(0, n_code)
            self._code(old["k"], old["v"])
            self.tail.delete(0, n_code)

    @property
    def _fitted(self) -> bool:
        return self.k_codec.fitted and self.v_codec.fitted

    def _fit(self, exact: Dict[str, mx.array]) -> None:
        self.k_codec.fit(exact["k"])
        self.v_codec.fit(exact["v"])

    def _code(self, k: mx.array, v: mx.array) -> None:
        if not self._fitted:
            self._fit({"k": k, "v": v})
        self.k_codes.append(self.k_codec.encode(k))
        self.v_codes.append(self.v_codec.encode(v))

    def _fetch(self, dtype):
        """The whole history decoded, ``(B, H, n, d)`` in ``dtype`` (the path outside attention on codes)."""
        ks, vs = [], []
        for part in self.attention_parts():
            if isinstance(part, ExactPart):
                ks.append(part.keys.astype(dtype))
                vs.append(part.values.astype(dtype))
            else:
                ks.append(part.k_codec.decode(part.k_arrays, dtype))
                vs.append(part.v_codec.decode(part.v_arrays, dtype))
        if len(ks) == 1:
            return ks[0], vs[0]
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens (tail first, then codes, then sink); returns how many were dropped."""
        n = min(check_int("n", n, 0), self.offset)
        left = n - self.tail.trim(n)
        if left and self.n_coded and self._block > 1:
            left = self._trim_blocks(left)
        elif left and self.n_coded:
            dropped = min(left, self.n_coded)
            self.k_codes.trim(dropped)
            left -= self.v_codes.trim(dropped)
        left -= self.sink_store.trim(left)
        self.offset -= n
        return n

    def _trim_blocks(self, n: int) -> int:
        """Drop the ``n`` newest coded tokens of a block codec (the tail is empty); returns what is left.

        Whole blocks are cut; the surviving tokens of a cut block return to the tail as their decoded values
        (they are coded again, with the same rotation, when the block refills).
        """
        blk, length = self._block, self.n_coded
        drop = min(n, length)
        cut = (length - drop) // blk * blk
        survivors = length - drop - cut
        if survivors:
            dtype = next(iter(self.tail.buffers.values())).dtype if self.tail.buffers else mx.float32
            k = self.k_codec.decode(self.k_codes.view(cut, cut + blk), dtype)
            v = self.v_codec.decode(self.v_codes.view(cut, cut + blk), dtype)
        self.k_codes.trim(length - cut)
        self.v_codes.trim(length - cut)
        if survivors:
            self.tail.append({"k": k[:, :, :survivors], "v": v[:, :, :survivors]})
        return n - drop

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    @classmethod
    def merge(cls, caches):
        """mlx_lm's batching: per-sequence caches -> one `TurboQuantBatchPackedCache` (every sequence stays packed)."""
        from veloxquant_mlx.cache.batch_packed_cache import TurboQuantBatchPackedCache

        return TurboQuantBatchPackedCache.merge(caches)

    # -- bytes ------------------------------------------------------------------------------------
    def _stores(self):
        return [s for s in (self.sink_store, self.k_codes, self.v_codes, self.tail) if s is not None]

    def _fitted_arrays(self) -> Dict[str, mx.array]:
        out = {}
        for prefix, codec in (("kfit_", self.k_codec), ("vfit_", self.v_codec)):
            if codec is not None:
                out.update({prefix + n: a for n, a in codec.fitted_arrays().items()})
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every array this cache holds (codes, exact windows, fitted parameters, spare step capacity)."""
        return sum(s.nbytes for s in self._stores()) + sum(a.nbytes for a in self._fitted_arrays().values())

    @property
    def live_nbytes(self) -> int:
        """Like `nbytes` but without the spare capacity of the step-grown buffers (= a saved file's arrays)."""
        return sum(s.live_nbytes for s in self._stores()) + sum(a.nbytes for a in self._fitted_arrays().values())

    def bits_per_coordinate(self) -> float:
        """Stored bits per cached coordinate, averaged over K and V, every stored byte counted."""
        if self.dims is None or self.offset == 0:
            return 0.0
        B, H = self._heads()
        return 8.0 * self.live_nbytes / (B * H * self._count * (self.dims[0] + self.dims[1]))

    # -- copying and state ------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.sink_store, new.tail = self.sink_store.copy(), self.tail.copy()
        if self.k_codec is not None:
            # Codecs share their (stateless) quantizers; a shallow copy keeps a later fit() from leaking.
            new.k_codec, new.v_codec = copy.copy(self.k_codec), copy.copy(self.v_codec)
            new.k_codes, new.v_codes = self.k_codes.copy(), self.v_codes.copy()
        return new

    def _store_prefixes(self):
        # Format-1 names: per-token codes as "c_k_*" / "c_v_*", transposed block keys as "kc_*".
        k_prefix = "kc_" if self._block > 1 else "c_k_"
        return {"s_": self.sink_store, "t_": self.tail, k_prefix: self.k_codes, "c_v_": self.v_codes}

    def _cache_meta(self) -> Dict[str, Any]:
        return {"fetch_placeholders": self.fetch_placeholders}

    @property
    def state(self) -> Dict[str, Any]:
        meta = {
            "format": FORMAT, "class": type(self).__name__, "options": self.options.to_dict(),
            "cache": self._cache_meta(), "offset": self.offset, "dims": list(self.dims) if self.dims else None,
            "stores": {"codes": self.n_coded, "sink": self.sink_store.length, "tail": self.tail.length},
        }
        out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
        if self.dims is not None:  # before the first update nothing is stored
            for prefix, store in self._store_prefixes().items():
                out.update({prefix + n: a for n, a in store.live_arrays().items()})
        out.update(self._fitted_arrays())
        return out

    @state.setter
    def state(self, value) -> None:
        restored = type(self).from_state(value)
        self.__dict__.update(restored.__dict__)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild from ``state`` alone (what mlx_lm's ``load_prompt_cache`` passes); refuses, naming the array,
        a state whose arrays do not match its options, dims and token counts."""
        from veloxquant_mlx.cache._state_check import read_meta, restore_arrays

        options, cache_kwargs, meta = read_meta(cls, state)
        cache = cls(options, **cache_kwargs)
        restore_arrays(cache, state, meta)
        return cache


class TurboQuantRotatingPackedCache(TurboQuantPackedCache):
    """Compressed counterpart of mlx_lm's `RotatingKVCache` (same ``max_size`` / ``keep`` semantics).

    Unlike mlx_lm's ring buffer, tokens stay in temporal order: the ``keep`` first tokens are never evicted and the
    oldest of the others are deleted when the window is full. The token sets, and hence the attention results,
    match `RotatingKVCache`: a multi-token update keeps ``max_size - 1`` old tokens and appends all new ones; a
    one-token update keeps ``max_size``. The exact ``sink`` must lie within ``keep`` (never evicted).
    """

    def __init__(self, config=None, max_size: int = None, keep: int = 0, **options):
        super().__init__(config, **options)
        if self._block_layout():
            raise ValueError(
                f"codec={self.codec!r} codes keys in blocks of tokens, which a sliding window cannot evict one at a "
                "time; use codec='affine' for RotatingKVCache layers (make_prompt_cache does so itself)")
        self.max_size = check_int("max_size", max_size, 1)
        self.keep = check_int("keep", keep, 0)
        if self.keep > self.max_size:
            raise ValueError(f"keep must be <= max_size ({self.max_size}), got {self.keep}")
        if self.sink > self.keep:
            raise ValueError(f"sink must be <= keep ({self.keep}) in a rotating cache (sink tokens are never "
                             f"evicted), got {self.sink}")

    @classmethod
    def merge(cls, caches):
        """mlx_lm's batching: per-sequence windows -> one `TurboQuantBatchRotatingPackedCache` (each evicts its own)."""
        from veloxquant_mlx.cache.batch_packed_cache import TurboQuantBatchRotatingPackedCache

        return TurboQuantBatchRotatingPackedCache.merge(caches)

    def _block_layout(self) -> bool:
        return codec_layout(self.codec).keys.BLOCKED

    def _cache_meta(self) -> Dict[str, Any]:
        return {**super()._cache_meta(), "max_size": self.max_size, "keep": self.keep}

    def _evict_to(self, limit: int) -> None:
        """Delete the oldest non-``keep`` tokens until at most ``limit`` remain."""
        n = self._count - limit
        if n <= 0:
            return
        start, stop = self.keep, self.keep + n  # temporal positions to drop
        base = self.sink_store.length  # sink <= keep: the sink is never touched
        for stores, length in (((self.k_codes, self.v_codes), self.n_coded), ((self.tail,), self.tail.length)):
            lo, hi = min(max(start - base, 0), length), min(max(stop - base, 0), length)
            for store in stores:
                store.delete(lo, hi)
            base += length

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # Validate before evicting, so bad input leaves the cache unchanged.
        _check_pair(keys, values, *(self.dims or (self.options.head_dim, None)))
        if keys.shape[2] > 1:
            self._evict_to(self.max_size - 1)
            self._append(keys, values)
        else:
            self._append(keys, values)
            self._evict_to(self.max_size)
        return self._history(keys.dtype)

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
