"""Servable compressed KV caches for mlx_lm: keys AND values stored as packed TurboQuant codes.

`TurboQuantPackedCache` is a drop-in for `mlx_lm.models.cache.KVCache`;
`TurboQuantRotatingPackedCache` for `RotatingKVCache` (sliding-window layers, same ``max_size`` / ``keep``).

Storage, in temporal order (token axis 2, each part grown in steps):

    [ sink: first ``sink`` tokens, exact | codes: packed K and V codes | tail: newest tokens, exact ]

The tail holds the last ``recent`` tokens plus, when ``recent > 0``, up to ``trim_headroom`` older ones;
those older ones are fetched through an encode/decode round trip (so they read exactly as coded tokens
do) and are moved to the codes store when they leave the tail. The headroom is what keeps ``trim`` (which
speculative decoding calls after every rejected draft) consistent: after trimming up to
``trim_headroom`` tokens, the last ``recent`` tokens are still exact, as in an uninterrupted run. The
window is counted from the end of the stored sequence, so within a multi-token update (a prefill chunk,
a speculative verification step) early queries see fewer exact predecessors than one-token decoding
would give them. Only
codes, norms, the exact windows and the per-head fitted parameters (channel means, outlier permutation)
are stored: no full-precision copy of the coded history exists, and `nbytes` is the sum of those arrays.
`update_and_fetch` returns the dequantized history in the input dtype, like mlx_lm's own
`QuantizedKVCache` pays its dequantize-on-fetch cost — but through the ordinary SDPA path: these caches
never define ``bits`` (mlx_lm would route any cache with ``bits`` to its affine quantized SDPA).

Attention on codes: inside ``veloxquant_mlx.attention.use_packed_attention()`` mlx_lm's SDPA calls
`attend_packed`, which scores and aggregates straight from the codes (no dequantized history); then
`update_and_fetch` returns zero-cost placeholders instead of decoding (``fetch_placeholders=True``; the
builder turns it off for models whose attention bypasses mlx_lm's SDPA function). ``codec="affine"``
stores rotated MLX affine codes (`AffineRotatedCodec`: quantized-matmul attention) instead of Lloyd-Max
codes; ``codec="affine_block"`` stores the keys transposed, per channel over blocks of tokens
(`AffineBlockKeyCodec`, held in ``key_columns``), the layout whose decode attention is fastest on CPU.

``state`` holds everything needed to rebuild (a JSON ``meta`` string with the config, options and offset,
plus the arrays), because mlx_lm >= 0.32 calls ``from_state(state)`` only.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.attention import hook as _hook
from veloxquant_mlx.attention.packed_sdpa import packed_attention_for_cache
from veloxquant_mlx.cache._affine_codec import AFFINE_BITS, AffineBlockKeyCodec, AffineRotatedCodec
from veloxquant_mlx.cache._kv_codec import ChannelCodec, check_float_heads
from veloxquant_mlx.cache._token_store import TokenStore
from veloxquant_mlx.cache.base import SERVABLE_METHODS

_FORMAT = 1
CODECS = ("lloyd_max", "affine", "affine_block")
_AFFINE_CODECS = ("affine", "affine_block")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _check_config(config) -> None:
    from veloxquant_mlx.config import KVCacheConfig

    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if config.method not in SERVABLE_METHODS:
        raise ValueError(
            f"config.method must be one of {sorted(SERVABLE_METHODS)} for a servable cache, got {config.method!r}"
        )


def _check_count(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_pair(keys, values, k_dim: Optional[int], v_dim: Optional[int]) -> None:
    check_float_heads("keys", keys, k_dim)
    check_float_heads("values", values, v_dim)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, values {tuple(values.shape)}"
        )


class TurboQuantPackedCache(_BaseCache):
    """mlx_lm-compatible KV cache storing keys and values as packed TurboQuant codes.

    Args:
        config: `KVCacheConfig`. Uses ``method``, ``bit_width_inlier`` (key bits), ``v_bits`` (value bits;
            None = key bits), ``seed``, ``rotation``, ``jl_dim``, ``head_dim`` (checked against the keys
            when set), ``n_outlier_channels`` / ``outlier_bits`` (outlier channels of the keys; of the
            values too with ``value_outliers=True``).
        sink: the first ``sink`` tokens are kept exact (model dtype) and never coded.
        recent: the last ``recent`` tokens are kept exact; older ones are coded as they leave the window.
        trim_headroom: with ``recent > 0``, exact copies of this many already-coded-looking tokens are kept so
            that ``trim(n)`` for ``n <= trim_headroom`` leaves the last ``recent`` tokens exact (their bytes count).
        center_keys / center_values: subtract a per-head channel mean fitted on the first coded tokens
            (stored, added back on fetch, so the fetched tensors approximate the inputs themselves).
        value_outliers: give the values outlier channels too (keys carry most of the damage, so by
            default only keys spend bits on them).
        codec: ``"lloyd_max"`` (default: ``ChannelCodec``, the config's quantizer), ``"affine"``
            (``AffineRotatedCodec``: seeded rotation + ``mx.quantize`` per token; bits must be in 2,3,4,5,6,8; no
            outlier channels; ``config.rotation`` and ``seed`` are used, ``method`` is not) or ``"affine_block"``
            (values as ``"affine"``; keys as ``AffineBlockKeyCodec``: rotated ``K^T`` quantized per channel over
            blocks of ``group_size`` tokens — the fastest attention on codes on CPU. Keys are coded a whole
            block at a time, so up to ``block - 1`` tokens beyond ``recent + trim_headroom`` wait exact in the
            tail; not for the rotating cache).
        group_size: affine group size (None: 64, or head_dim when smaller); for ``"affine_block"`` also the
            key block length in tokens. Affine codecs only.
        fetch_placeholders: while the packed-attention hook is active, return placeholders from
            `update_and_fetch` (attention reads the codes through `attend_packed`). Set False for a model
            whose attention does not go through mlx_lm's ``scaled_dot_product_attention``.
    """

    step = 256

    def __init__(
        self,
        config,
        *,
        sink: int = 0,
        recent: int = 0,
        trim_headroom: int = 8,
        center_keys: bool = True,
        center_values: bool = True,
        value_outliers: bool = False,
        codec: str = "lloyd_max",
        group_size: Optional[int] = None,
        fetch_placeholders: bool = True,
    ):
        _check_config(config)
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        if codec in _AFFINE_CODECS:
            for name, b in (("config.bit_width_inlier (k_bits)", config.bit_width_inlier),
                            ("config.v_bits", config.value_bits)):
                if b not in AFFINE_BITS:
                    raise ValueError(f"{name} must be one of {AFFINE_BITS} with codec={codec!r}, got {b}")
            if config.n_outlier_channels or value_outliers:
                raise ValueError(
                    f"codec={codec!r} has no outlier channels: set n_outlier_channels=0 and value_outliers=False"
                )
        elif group_size is not None:
            raise ValueError("group_size applies only to codec='affine' or 'affine_block'")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
            raise TypeError(f"group_size must be None or an int, got {type(group_size).__name__}")
        if not isinstance(fetch_placeholders, bool):
            raise TypeError(f"fetch_placeholders must be a bool, got {type(fetch_placeholders).__name__}")
        self.codec, self.group_size, self.fetch_placeholders = codec, group_size, fetch_placeholders
        # Set when update_and_fetch returned placeholders; cleared by attend_packed. Still set at the next
        # update means the model's attention bypassed the hook and read the placeholders: fail loudly.
        self._awaiting_attention = False
        self.config = config
        self.sink = _check_count("sink", sink)
        self.recent = _check_count("recent", recent)
        self.trim_headroom = _check_count("trim_headroom", trim_headroom)
        flags = {"center_keys": center_keys, "center_values": center_values, "value_outliers": value_outliers}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.center_keys, self.center_values, self.value_outliers = center_keys, center_values, value_outliers
        self.offset = 0
        self.dims: Optional[tuple] = None  # (key head_dim, value head_dim), fixed by the first update
        self.k_codec: Optional[ChannelCodec] = None
        self.v_codec: Optional[ChannelCodec] = None
        self.codes = TokenStore(self.step)
        # codec="affine_block": keys as K^T codes (token axis last, exact size, grown a block at a time);
        # ``codes`` then holds the values only.
        self.key_columns: Dict[str, mx.array] = {}
        self.sink_store = TokenStore(max(1, self.sink))
        self.tail = TokenStore(max(16, self.recent + self.trim_headroom))

    # -- options that travel with the state ------------------------------------------------------
    def _options(self) -> Dict[str, Any]:
        return {
            "sink": self.sink,
            "recent": self.recent,
            "trim_headroom": self.trim_headroom,
            "center_keys": self.center_keys,
            "center_values": self.center_values,
            "value_outliers": self.value_outliers,
            "codec": self.codec,
            "group_size": self.group_size,
            "fetch_placeholders": self.fetch_placeholders,
        }

    @property
    def v_bits(self) -> int:
        return self.config.value_bits

    @property
    def k_bits(self) -> int:
        return self.config.bit_width_inlier

    def _setup(self, k_dim: int, v_dim: int) -> None:
        """Build the codecs once the head dims are known (first update, or a restore)."""
        c = self.config
        if self.codec in _AFFINE_CODECS:
            # Keys and values get different seeds so their rotations are independent.
            key_codec = AffineBlockKeyCodec if self.codec == "affine_block" else AffineRotatedCodec
            gs = self.group_size
            self.k_codec = key_codec(k_dim, self.k_bits, gs, seed=c.seed, rotation=c.rotation, center=self.center_keys)
            self.v_codec = AffineRotatedCodec(v_dim, self.v_bits, gs, seed=c.seed + 1000, rotation=c.rotation,
                                              center=self.center_values)
            if self.codec == "affine_block":
                # Values arrive a whole key block at a time: growing by one block keeps the store exactly full,
                # so attention reads whole contiguous arrays (no slice, no copy inside the quantized matmul).
                self.codes.step = self.k_codec.token_block
            self.dims = (k_dim, v_dim)
            return
        common = dict(rotation=c.rotation, jl_dim=c.jl_dim, outlier_bits=c.outlier_bits)
        # Keys and values get different seeds so their rotations are independent.
        self.k_codec = ChannelCodec(
            c.method, k_dim, self.k_bits, seed=c.seed, center=self.center_keys,
            n_outliers=c.n_outlier_channels, **common,
        )
        # The QJL sketch makes inner products unbiased, which only scores need; for values (aggregated,
        # not scored) it spends bits on a higher-variance reconstruction, so Prod values use MSE codes.
        v_method = "turboquant_mse" if c.method == "turboquant_prod" else c.method
        self.v_codec = ChannelCodec(
            v_method, v_dim, self.v_bits, seed=c.seed + 1000, center=self.center_values,
            n_outliers=c.n_outlier_channels if self.value_outliers else 0,
            **dict(common, jl_dim=c.jl_dim if v_method == "turboquant_prod" else None),
        )
        self.dims = (k_dim, v_dim)

    # -- the mlx_lm protocol ------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store ``keys``/``values`` ``(B, H, T, d)``; return the whole history ``(B, H, n, d)`` in their dtype.

        Inside ``use_packed_attention()`` (and with ``fetch_placeholders``) the history returned is a
        zero-cost placeholder of that shape: the hook sends attention to `attend_packed` instead.
        """
        self._append(keys, values)
        return self._history(keys.dtype)

    def _history(self, dtype):
        if self.fetch_placeholders and _hook.is_active():
            B, H = self._heads()
            n = self.sink_store.length + self.codes.length + self.tail.length
            self._awaiting_attention = True
            return (_hook.placeholder_history((B, H, n, self.dims[0]), dtype),
                    _hook.placeholder_history((B, H, n, self.dims[1]), dtype))
        self._awaiting_attention = False
        return self._fetch(dtype)

    def _heads(self):
        store = next(s for s in (self.codes, self.sink_store, self.tail) if s.buffers)
        return tuple(next(iter(store.buffers.values())).shape[:2])

    def attend_packed(self, queries: mx.array, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
        """SDPA of ``queries`` ``(B, Hq, L, d)`` over everything stored, read from the codes -> ``(B, Hq, L, dv)``.

        The packed-attention protocol (see :mod:`veloxquant_mlx.attention`); mask as mlx_lm passes it.
        """
        if self.empty():
            raise ValueError("attend_packed needs a cache holding tokens (call update_and_fetch first)")
        self._awaiting_attention = False
        return packed_attention_for_cache(self, queries, scale, mask, sinks)

    def _append(self, keys: mx.array, values: mx.array) -> None:
        if self._awaiting_attention and _hook.is_active():
            raise RuntimeError(
                f"{type(self).__name__} returned placeholder keys/values but attend_packed was never called: this "
                "model's attention bypasses mlx_lm's scaled_dot_product_attention, so its output is wrong. Build "
                "the caches with veloxquant_mlx.make_prompt_cache(model, ...) (it detects such models) or pass "
                "fetch_placeholders=False."
            )
        if self.dims is None:
            _check_pair(keys, values, self.config.head_dim, None)
            self._setup(keys.shape[-1], values.shape[-1])
        else:
            _check_pair(keys, values, *self.dims)
            self._check_batch(keys)
        T = keys.shape[2]
        n_sink = min(max(self.sink - self.sink_store.length, 0), T)
        if n_sink:
            self.sink_store.append({"k": keys[:, :, :n_sink], "v": values[:, :, :n_sink]})
        if T > n_sink:
            k_rest, v_rest = keys[:, :, n_sink:], values[:, :, n_sink:]
            if self._block > 1:
                self._append_blocked(k_rest, v_rest)
            elif self.recent == 0:
                self._code(k_rest, v_rest)
            else:
                self.tail.append({"k": k_rest, "v": v_rest})
                if self.tail.length > self.recent and not self._fitted:
                    # Fit on every exact non-sink token we hold: more statistics, same cost.
                    self._fit(self.tail.view())
                over = self.tail.length - self.recent - self.trim_headroom
                if over > 0:
                    old = self.tail.view(0, over)
                    self._code(old["k"], old["v"])
                    self.tail.delete(0, over)
        self.offset += T

    @property
    def _block(self) -> int:
        """Tokens per coding unit: 1, or the key block of codec="affine_block"."""
        return getattr(self.k_codec, "token_block", 1)

    def _append_blocked(self, k: mx.array, v: mx.array) -> None:
        """Block codecs: new tokens wait (exact) in the tail; whole blocks older than the exact window and the
        trim headroom are coded and leave it. So the tail holds ``recent + trim_headroom`` to that plus
        ``block - 1`` tokens, every one of them read exactly."""
        self.tail.append({"k": k, "v": v})
        blk = self._block
        n_code = (self.tail.length - self.recent - self.trim_headroom) // blk * blk
        if n_code > 0:
            if not self._fitted:
                self._fit(self.tail.view())  # every exact non-sink token held: more statistics, same cost
            old = self.tail.view(0, n_code)
            self._code(old["k"], old["v"])
            self.tail.delete(0, n_code)

    def _check_batch(self, keys: mx.array) -> None:
        for store in (self.codes, self.sink_store, self.tail):
            if store.buffers:
                shape = next(iter(store.buffers.values())).shape
                if tuple(shape[:2]) != tuple(keys.shape[:2]):
                    raise ValueError(
                        f"keys have (B, H) = {tuple(keys.shape[:2])}, but this cache holds {tuple(shape[:2])}"
                    )
                return

    @property
    def _fitted(self) -> bool:
        return self.k_codec.fitted and self.v_codec.fitted

    def _fit(self, exact: Dict[str, mx.array]) -> None:
        self.k_codec.fit(exact["k"])
        self.v_codec.fit(exact["v"])

    def _code(self, k: mx.array, v: mx.array) -> None:
        if not self._fitted:
            self._fit({"k": k, "v": v})
        chunk = {f"v_{n}": a for n, a in self.v_codec.encode(v).items()}
        if self._block > 1:
            # One concatenation per coded block range keeps K^T contiguous (what the scoring matmul wants)
            # at an amortized cost of one copy of the key codes per block of tokens.
            self.key_columns = AffineBlockKeyCodec.concat([self.key_columns, self.k_codec.encode(k)])
        else:
            chunk.update({f"k_{n}": a for n, a in self.k_codec.encode(k).items()})
        self.codes.append(chunk)

    def coded_arrays(self):
        """``(key arrays, value arrays)`` of the coded tokens, in their codecs' layouts (no copy)."""
        c = self.codes.view()
        v = {n[2:]: a for n, a in c.items() if n.startswith("v_")}
        if self._block > 1:
            return dict(self.key_columns), v
        return {n[2:]: a for n, a in c.items() if n.startswith("k_")}, v

    @property
    def exact_tail_from(self) -> int:
        """Index of the first tail token read exactly (older ones read as coded tokens would)."""
        if self._block > 1:
            return 0  # block codecs: the whole tail is exact until its blocks are coded
        return max(self.tail.length - self.recent, 0)

    def _fetch(self, dtype):
        ks, vs = [], []
        if self.sink_store.length:
            s = self.sink_store.view()
            ks.append(s["k"].astype(dtype))
            vs.append(s["v"].astype(dtype))
        if self.codes.length:
            k_arrays, v_arrays = self.coded_arrays()
            ks.append(self.k_codec.decode(k_arrays, dtype))
            vs.append(self.v_codec.decode(v_arrays, dtype))
        if self.tail.length:
            # Tail tokens older than the exact window read as they will once coded (a round trip).
            n_old = self.exact_tail_from
            if n_old:
                old = self.tail.view(0, n_old)
                ks.append(self.k_codec.decode(self.k_codec.encode(old["k"]), dtype))
                vs.append(self.v_codec.decode(self.v_codec.encode(old["v"]), dtype))
            t = self.tail.view(n_old)
            ks.append(t["k"].astype(dtype))
            vs.append(t["v"].astype(dtype))
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
        n = max(0, min(int(n), self.offset))
        left = n - self.tail.trim(n)
        if left and self.codes.length and self._block > 1:
            left = self._trim_blocks(left)
        for store in (self.codes, self.sink_store):
            left -= store.trim(left)
        self.offset -= n
        return n

    def _trim_blocks(self, n: int) -> int:
        """Drop the ``n`` newest coded tokens of a block codec (the tail is empty); returns what is left.

        Whole blocks are cut; the surviving tokens of a cut block return to the tail as their decoded values
        (they are coded again, with the same rotation, when the block refills).
        """
        blk, length = self._block, self.codes.length
        drop = min(n, length)
        cut = (length - drop) // blk * blk
        survivors = length - drop - cut
        if survivors:
            dtype = next(iter(self.tail.buffers.values())).dtype if self.tail.buffers else mx.float32
            k_arrays, v_arrays = self.coded_arrays()
            k = self.k_codec.decode(self.k_codec.slice_tokens(k_arrays, cut, cut + blk), dtype)
            v = self.v_codec.decode({f: a[:, :, cut : cut + blk] for f, a in v_arrays.items()}, dtype)
            restored = {"k": k[:, :, :survivors], "v": v[:, :, :survivors]}
        kept = self.k_codec.slice_tokens(self.key_columns, 0, cut) if cut else {}
        self.key_columns = {f: mx.contiguous(a) for f, a in kept.items()}  # scoring wants K^T contiguous
        self.codes.trim(length - cut)
        if survivors:
            self.tail.append(restored)
        return n - drop

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            f"{cls.__name__} does not support mlx_lm batch_generate with per-sequence prompt caches "
            "(merging compressed caches into a batch cache is not implemented); run generate/stream_generate "
            "per sequence, or call batch_generate without prompt_caches."
        )

    # -- bytes -------------------------------------------------------------------------------------
    def _fitted_arrays(self) -> Dict[str, mx.array]:
        out = {}
        for prefix, codec in (("kfit_", self.k_codec), ("vfit_", self.v_codec)):
            if codec is not None:
                out.update({prefix + n: a for n, a in codec.fitted_arrays().items()})
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every array this cache holds (codes, norms, exact windows, fitted parameters)."""
        stores = self.codes.nbytes + self.sink_store.nbytes + self.tail.nbytes + self._key_column_bytes
        return stores + sum(a.nbytes for a in self._fitted_arrays().values())

    @property
    def _key_column_bytes(self) -> int:
        return sum(a.nbytes for a in self.key_columns.values())

    @property
    def live_nbytes(self) -> int:
        """Like `nbytes` but without the spare capacity of the step-grown buffers (= a saved file's arrays)."""
        stores = self.codes.live_nbytes + self.sink_store.live_nbytes + self.tail.live_nbytes + self._key_column_bytes
        return stores + sum(a.nbytes for a in self._fitted_arrays().values())

    def bits_per_coordinate(self) -> float:
        """Stored bits per cached coordinate, averaged over K and V, every stored byte counted."""
        if self.dims is None or self.offset == 0:
            return 0.0
        B, H = self._heads()
        n_coords = B * H * self.offset * (self.dims[0] + self.dims[1])
        return 8.0 * self.live_nbytes / n_coords

    # -- copying and state ------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.codes, new.sink_store, new.tail = self.codes.copy(), self.sink_store.copy(), self.tail.copy()
        new.key_columns = dict(self.key_columns)  # never written in place: sharing the arrays is safe
        # Codecs share their (stateless) quantizers; a shallow copy keeps a later fit() from leaking.
        new.k_codec, new.v_codec = copy.copy(self.k_codec), copy.copy(self.v_codec)
        return new

    @property
    def state(self) -> Dict[str, Any]:
        meta = {
            "format": _FORMAT,
            "class": type(self).__name__,
            "config": self.config.to_dict(),
            "options": self._options(),
            "offset": self.offset,
            "dims": list(self.dims) if self.dims else None,
            "stores": {"codes": self.codes.length, "sink": self.sink_store.length, "tail": self.tail.length},
        }
        out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
        for prefix, store in (("c_", self.codes), ("s_", self.sink_store), ("t_", self.tail)):
            out.update({prefix + n: a for n, a in store.live_arrays().items()})
        out.update({"kc_" + n: a for n, a in self.key_columns.items()})
        out.update(self._fitted_arrays())
        return out

    @state.setter
    def state(self, value) -> None:
        restored = type(self).from_state(value)
        self.__dict__.update(restored.__dict__)

    @classmethod
    def _options_from_meta(cls, meta: Dict[str, Any]) -> Dict[str, Any]:
        # States saved before the codec option existed are Lloyd-Max.
        return dict(meta["options"])

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild from ``state`` alone (what mlx_lm's ``load_prompt_cache`` passes)."""
        from veloxquant_mlx.config import KVCacheConfig

        if not isinstance(state, dict) or not isinstance(state.get("meta"), str):
            raise ValueError(f"{cls.__name__}.from_state expects the dict written by .state (with a 'meta' string)")
        meta = json.loads(state["meta"])
        if meta.get("format") != _FORMAT:
            raise ValueError(f"unsupported {cls.__name__} state format {meta.get('format')!r} (expected {_FORMAT})")
        cache = cls(KVCacheConfig.from_dict(meta["config"]), **cls._options_from_meta(meta))
        if meta["dims"] is not None:
            cache._setup(*meta["dims"])
            for prefix, codec in (("kfit_", cache.k_codec), ("vfit_", cache.v_codec)):
                codec.load_fitted({n[len(prefix) :]: a for n, a in state.items() if n.startswith(prefix)})
        for prefix, attr in (("c_", "codes"), ("s_", "sink_store"), ("t_", "tail")):
            step = getattr(cache, attr).step
            arrays = {n[len(prefix) :]: a for n, a in state.items() if n.startswith(prefix)}
            setattr(cache, attr, TokenStore.from_arrays(arrays, step))
        cache.key_columns = {n[3:]: a for n, a in state.items() if n.startswith("kc_")}
        cache.offset = int(meta["offset"])
        return cache


class TurboQuantRotatingPackedCache(TurboQuantPackedCache):
    """Compressed counterpart of mlx_lm's `RotatingKVCache` (same ``max_size`` / ``keep`` semantics).

    Unlike mlx_lm's ring buffer, tokens stay in temporal order: the ``keep`` first tokens are never
    evicted and the oldest of the others are deleted when the window is full. The token sets, and hence the
    attention results, match `RotatingKVCache`: a multi-token update keeps ``max_size - 1`` old tokens and
    appends all new ones; a one-token update keeps ``max_size``. The exact ``sink`` must lie within
    ``keep`` (``sink <= keep``), so exact sink tokens are never evicted.
    """

    def __init__(self, config, max_size: int, keep: int = 0, **options):
        super().__init__(config, **options)
        if self.codec == "affine_block":
            raise ValueError(
                "codec='affine_block' codes keys in blocks of tokens, which a sliding window cannot evict one at a "
                "time; use codec='affine' for RotatingKVCache layers (make_prompt_cache does so itself)"
            )
        self.max_size = _check_count("max_size", max_size, 1)
        self.keep = _check_count("keep", keep)
        if self.keep > self.max_size:
            raise ValueError(f"keep must be <= max_size ({self.max_size}), got {self.keep}")
        if self.sink > self.keep:
            raise ValueError(
                f"sink must be <= keep ({self.keep}) in a rotating cache (sink tokens are never evicted), got {self.sink}"
            )

    def _options(self) -> Dict[str, Any]:
        return {**super()._options(), "max_size": self.max_size, "keep": self.keep}

    @property
    def _count(self) -> int:
        return self.sink_store.length + self.codes.length + self.tail.length

    def _evict_to(self, limit: int) -> None:
        """Delete the oldest non-``keep`` tokens until at most ``limit`` remain."""
        n = self._count - limit
        if n <= 0:
            return
        start, stop = self.keep, self.keep + n  # temporal positions to drop
        base = self.sink_store.length  # sink <= keep: the sink is never touched
        for store in (self.codes, self.tail):
            length = store.length
            store.delete(min(max(start - base, 0), length), min(max(stop - base, 0), length))
            base += length

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # Validate before evicting, so bad input leaves the cache unchanged.
        _check_pair(keys, values, *(self.dims or (self.config.head_dim, None)))
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
