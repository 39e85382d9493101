"""`TurboQuantRVQKVCache`: the seed's RVQ key cache in mlx_lm's cache protocol.

Keys are stored packed as two streams of b-bit RVQ codebook indices (stage 1: Gaussian codebook on the
rotated unit direction; stage 2: Laplace codebook on its residual; both uint32-packed, LSB-first, rows
padded to whole words, as `mx.quantize` packs) plus a bfloat16 norm per vector; they are dequantized on
every fetch. Values pass through unquantized, stored as float16 (as the seed did; bfloat16 inputs are
kept in bfloat16, which has the same size and no float16 overflow).

Per key vector at head_dim d and b bits: ``2 * ceil(d * b / 32) * 4 + 2`` bytes, e.g. 34 bytes for
d = 128, b = 1 (against 256 bytes in float16).

This is the seed-faithful design, kept so its quality can be measured; the servable K+V compressed cache
is :class:`veloxquant_mlx.cache.packed_cache.TurboQuantPackedCache`. Like it, this class never defines
``bits`` (mlx_lm routes caches with ``bits`` to its affine quantized attention) — see `assigned_bits`.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from veloxquant_mlx.codecs.lloyd_max import get_quantizer
from veloxquant_mlx.validate import check_heads
from veloxquant_mlx.cache._token_store import TokenStore

_FIELDS = ("indices", "indices2", "norms", "values")
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def _config_digest(config_dict: dict) -> str:
    """A short checksum of the config as saved: a state whose config was edited afterwards is refused."""
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]


def check_trim_count(n) -> int:
    """``trim``'s argument as an int >= 0, or TypeError/ValueError naming ``n``."""
    import numpy as np

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"trim(n): n must be an int >= 0 (tokens to drop), got {type(n).__name__} ({n!r})")
    if n < 0:
        raise ValueError(f"trim(n): n must be an int >= 0 (tokens to drop), got {n}")
    return int(n)


def _check_state_arrays(arrays: dict, head_dim: int, bits: int, offset: int) -> None:
    """Refuse stored arrays that do not add up to ``offset`` tokens of this config; names the array."""
    from veloxquant_mlx.dsa.bit_pack import packed_words

    present = [f for f in _FIELDS if arrays.get(f) is not None]
    if not present:
        if offset != 0:
            raise ValueError(f"TurboQuantRVQKVCache state: offset={offset} but no arrays are stored")
        return
    missing = [f for f in _FIELDS if arrays.get(f) is None]
    if missing:
        raise ValueError(f"TurboQuantRVQKVCache state: array(s) {missing} missing (a state holds {list(_FIELDS)})")
    for f in _FIELDS:
        if not isinstance(arrays[f], mx.array):
            raise TypeError(f"TurboQuantRVQKVCache state: array {f!r} must be an mx.array, got {type(arrays[f]).__name__}")
    words = packed_words(head_dim, bits)
    idx = arrays["indices"]
    if idx.ndim != 4 or idx.dtype != mx.uint32 or idx.shape[-1] != words:
        raise ValueError(
            f"TurboQuantRVQKVCache state: array 'indices' must be (B, H, T, {words}) uint32 for head_dim={head_dim}, "
            f"bits={bits}; got {tuple(idx.shape)} {idx.dtype}")
    B, H, T = idx.shape[:3]
    expect = {"indices2": ((B, H, T, words), (mx.uint32,)), "norms": ((B, H, T), _FLOATS)}
    for f, (shape, dtypes) in expect.items():
        a = arrays[f]
        if tuple(a.shape) != shape or a.dtype not in dtypes:
            raise ValueError(f"TurboQuantRVQKVCache state: array {f!r} must be {shape} {dtypes[0]}, "
                             f"got {tuple(a.shape)} {a.dtype}")
    v = arrays["values"]
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, H, T) or v.dtype not in _FLOATS:
        raise ValueError(f"TurboQuantRVQKVCache state: array 'values' must be ({B}, {H}, {T}, d_v) float, "
                         f"got {tuple(v.shape)} {v.dtype}")
    if T != offset:
        raise ValueError(f"TurboQuantRVQKVCache state: offset={offset} but the arrays hold {T} tokens")


class TurboQuantRVQKVCache(KVCache):
    """KV cache whose keys are TurboQuantRVQ codes (two packed b-bit index streams + norm); values float16.

    Args:
        config: `KVCacheConfig`; consumes ``head_dim`` (required), ``bit_width_inlier`` (b, per stream),
            ``seed`` and ``rotation``.
    """

    step = 256

    def __init__(self, config: Any):
        from veloxquant_mlx.config import KVCacheConfig

        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if config.head_dim is None:
            raise ValueError("config.head_dim must be set for TurboQuantRVQKVCache (got None)")
        super().__init__()
        self.config = config
        self._quantizer = get_quantizer(
            "turboquant_rvq", config.head_dim, config.bit_width_inlier, config.seed, config.rotation, None
        )
        self._store = TokenStore(self.step)
        self._compressed_key_bytes = 0
        self._fp16_key_bytes = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Normalize and RVQ-code the keys, store values in float16; return dequantized K and the stored V."""
        check_heads("keys", keys, self.config.head_dim)
        check_heads("values", values)
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, values {tuple(values.shape)}"
            )
        if keys.shape[2] == 0:
            raise ValueError(f"keys must hold at least one token (T >= 1), got shape {tuple(keys.shape)}")
        if self._store.buffers:
            held = self._store.buffers["values"]
            if tuple(keys.shape[:2]) != tuple(held.shape[:2]) or values.shape[-1] != held.shape[-1]:
                raise ValueError(
                    f"keys/values of shape {tuple(keys.shape)}/{tuple(values.shape)} do not continue this cache: "
                    f"it holds batch B={held.shape[0]}, heads H={held.shape[1]}, value dim {held.shape[-1]} "
                    "(a new sequence or batch needs a new cache)")
        ev = self._quantizer.encode(keys)
        v_dtype = mx.bfloat16 if values.dtype == mx.bfloat16 else mx.float16
        self._store.append({**ev.arrays(), "values": values.astype(v_dtype)})  # packed streams + norms
        self._compressed_key_bytes += ev.nbytes
        self._fp16_key_bytes += keys.size * 2
        self.offset += keys.shape[2]
        return self._fetch(keys.dtype)

    def _fetch(self, dtype):
        from veloxquant_mlx.core.context import EncodedVector

        live = self._store.view()
        ev = EncodedVector(
            quantizer_type="turboquant_rvq",
            dim=self.config.head_dim,
            indices=live["indices"],
            indices2=live["indices2"],
            norms=live["norms"],
            dtype_name="float32",
        )
        return self._quantizer.decode(ev).astype(dtype), live["values"].astype(dtype)

    # -- protocol ---------------------------------------------------------------------------------
    def keys_and_values(self):
        raise NotImplementedError("TurboQuantRVQKVCache keeps no key tensor; use update_and_fetch")

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the ``n`` most recently added tokens; returns how many were dropped."""
        n = self._store.trim(check_trim_count(n))
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def empty(self) -> bool:
        return self.offset == 0

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise ValueError(
            "TurboQuantRVQKVCache is already compressed; do not pass kv_bits to mlx_lm.generate with it"
        )

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "TurboQuantRVQKVCache does not support mlx_lm batch_generate with per-sequence prompt caches; "
            "run generate/stream_generate per sequence, or call batch_generate without prompt_caches."
        )

    # -- bytes ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """True byte count of every stored array (packed key streams, norms, values), spare steps included."""
        return self._store.nbytes

    @property
    def compressed_key_bytes(self) -> int:
        """Cumulative packed key bytes written since construction (true packed size)."""
        return self._compressed_key_bytes

    @property
    def fp16_key_bytes(self) -> int:
        """Cumulative float16-equivalent key bytes written since construction (for the compression ratio)."""
        return self._fp16_key_bytes

    @property
    def assigned_bits(self) -> int:
        """Bits per index stream. Not named ``bits``: mlx_lm sends caches with ``bits`` to quantized SDPA."""
        return self.config.bit_width_inlier

    # -- copying and state ------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new._store = self._store.copy()
        return new

    def _meta(self) -> dict:
        config = self.config.to_dict()
        return {
            "config": config,
            "config_digest": _config_digest(config),
            "offset": self.offset,
            "compressed_key_bytes": self._compressed_key_bytes,
            "fp16_key_bytes": self._fp16_key_bytes,
        }

    @property
    def state(self):
        """``(indices, indices2, norms, values, meta)``: live packed streams, values, and a JSON string
        with everything else (mlx_lm >= 0.32 passes only ``state`` to ``from_state``)."""
        live = self._store.live_arrays()
        return tuple(live.get(f) for f in _FIELDS) + (json.dumps(self._meta(), sort_keys=True),)

    @state.setter
    def state(self, value) -> None:
        self.__dict__.update(type(self).from_state(value).__dict__)

    @property
    def meta_state(self):
        """``(head_dim, bits, seed, offset)`` as strings (the seed's separate meta state)."""
        c = self.config
        return tuple(str(x) for x in (c.head_dim, c.bit_width_inlier, c.seed, self.offset))

    @classmethod
    def from_state(cls, state, meta_state: Optional[Any] = None) -> "TurboQuantRVQKVCache":
        """Rebuild from ``state`` (5 entries, as written by `state`), or from the seed's 4-entry
        ``state`` plus its ``meta_state`` ``(head_dim, bits, seed, offset)``.

        A state that does not add up is refused with ValueError/TypeError naming the array or field:
        missing or wrong-shaped arrays, word counts that do not match head_dim and bits, an offset other
        than the stored token count, an edited config (its checksum), unparsable metadata.
        """
        from veloxquant_mlx.config import KVCacheConfig

        if not isinstance(state, (tuple, list)):
            raise TypeError("TurboQuantRVQKVCache.from_state: state must be a tuple (indices, indices2, norms, "
                            f"values, meta), got {type(state).__name__}")
        state = tuple(state)
        if len(state) == 5 and isinstance(state[4], str):
            meta = cls._parse_meta(state[4])
            config = KVCacheConfig.from_dict(meta["config"])
        elif len(state) == 4 and meta_state is not None:
            config, meta = cls._parse_meta_state(meta_state)
        else:
            raise ValueError(
                "TurboQuantRVQKVCache.from_state expects state = (indices, indices2, norms, values, meta) or the "
                f"4-entry state together with meta_state; got a state of {len(state)} entries"
                + ("" if meta_state is not None or len(state) != 4 else " and no meta_state")
            )
        arrays = dict(zip(_FIELDS, state[:4]))
        _check_state_arrays(arrays, config.head_dim, config.bit_width_inlier, meta["offset"])
        cache = cls(config)
        cache._store = TokenStore.from_arrays({f: a for f, a in arrays.items() if a is not None}, cls.step)
        cache.offset = meta["offset"]
        cache._compressed_key_bytes = meta["compressed_key_bytes"]
        cache._fp16_key_bytes = meta["fp16_key_bytes"]
        return cache

    @staticmethod
    def _parse_meta(text: str) -> dict:
        """The JSON meta entry of a 5-entry state, checked field by field."""
        try:
            meta = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"TurboQuantRVQKVCache state: the meta entry is not valid JSON ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ValueError("TurboQuantRVQKVCache state: the meta entry must be a JSON object with a 'config' object")
        digest = meta.get("config_digest")
        if digest is not None and digest != _config_digest(meta["config"]):
            raise ValueError("TurboQuantRVQKVCache state: meta 'config' does not match its config_digest "
                             "(the saved configuration was changed)")
        if meta["config"].get("method") != "turboquant_rvq" or meta["config"].get("head_dim") is None:
            raise ValueError("TurboQuantRVQKVCache state: meta 'config' must have method 'turboquant_rvq' and a "
                             f"head_dim, got method={meta['config'].get('method')!r}, "
                             f"head_dim={meta['config'].get('head_dim')!r}")
        for key in ("offset", "compressed_key_bytes", "fp16_key_bytes"):
            v = meta.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TurboQuantRVQKVCache state: meta {key!r} must be an int >= 0, got {v!r}")
            meta[key] = v
        return meta

    @staticmethod
    def _parse_meta_state(meta_state):
        """The seed's ``(head_dim, bits, seed, offset)`` strings -> (config, meta)."""
        from veloxquant_mlx.config import KVCacheConfig

        names = ("head_dim", "bits", "seed", "offset")
        if not isinstance(meta_state, (tuple, list)) or len(meta_state) != 4:
            raise ValueError(f"TurboQuantRVQKVCache.from_state: meta_state must be 4 strings {names}, "
                             f"got {meta_state!r:.100}")
        vals = {}
        for name, x in zip(names, meta_state):
            try:
                vals[name] = int(x)
            except (TypeError, ValueError):
                raise ValueError(f"TurboQuantRVQKVCache.from_state: meta_state {name} must be an integer string, "
                                 f"got {x!r:.40}") from None
            if isinstance(x, float) or vals[name] < 0:
                raise ValueError(f"TurboQuantRVQKVCache.from_state: meta_state {name} must be an integer >= 0, "
                                 f"got {x!r:.40}")
        config = KVCacheConfig(method="turboquant_rvq", head_dim=vals["head_dim"], bit_width_inlier=vals["bits"],
                               seed=vals["seed"])
        return config, {"offset": vals["offset"], "compressed_key_bytes": 0, "fp16_key_bytes": 0}
