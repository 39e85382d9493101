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
import json
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from veloxquant_mlx.cache._kv_codec import check_float_heads, get_quantizer
from veloxquant_mlx.cache._token_store import TokenStore

_FIELDS = ("indices", "indices2", "norms", "values")


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
        check_float_heads("keys", keys, self.config.head_dim)
        check_float_heads("values", values)
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, values {tuple(values.shape)}"
            )
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
        n = self._store.trim(n)
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
        return {
            "config": self.config.to_dict(),
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
        ``state`` plus its ``meta_state`` ``(head_dim, bits, seed, offset)``."""
        from veloxquant_mlx.config import KVCacheConfig

        state = tuple(state)
        if len(state) == 5 and isinstance(state[4], str):
            meta = json.loads(state[4])
            config = KVCacheConfig.from_dict(meta["config"])
        elif len(state) == 4 and meta_state is not None:
            head_dim, bits, seed, offset = (int(x) for x in meta_state)
            config = KVCacheConfig(method="turboquant_rvq", head_dim=head_dim, bit_width_inlier=bits, seed=seed)
            meta = {"offset": offset}
        else:
            raise ValueError(
                "TurboQuantRVQKVCache.from_state expects (indices, indices2, norms, values, meta) or the "
                "4-entry state together with meta_state"
            )
        cache = cls(config)
        arrays = {f: a for f, a in zip(_FIELDS, state[:4]) if a is not None}
        cache._store = TokenStore.from_arrays(arrays, cls.step)
        cache.offset = int(meta["offset"])
        cache._compressed_key_bytes = int(meta.get("compressed_key_bytes", 0))
        cache._fp16_key_bytes = int(meta.get("fp16_key_bytes", 0))
        return cache
