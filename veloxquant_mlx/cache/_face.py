"""What every packed cache face shares (:mod:`veloxquant_mlx.cache.packed_cache` defines the faces): the base class
`_PackedFace` (options, rows, bytes, copies, channel weights, `attend_packed`) and the checks and helpers both the
per-sequence caches and the batch ones (:mod:`veloxquant_mlx.cache._batch`) use.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from veloxquant_mlx.attention.parts import ExactPart, coded_keys
from veloxquant_mlx.cache._pipeline import PipelineDependency
from veloxquant_mlx.cache.row_policy import Rows
from veloxquant_mlx.cache.row_ops import concat_rows, take_rows
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.validate import check_heads, check_int


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
    ks = [p.keys.astype(dtype) if isinstance(p, ExactPart) else coded_keys(p, dtype) for p in parts]
    vs = [p.values.astype(dtype) if isinstance(p, ExactPart) else p.v_codec.decode(p.v_arrays, dtype) for p in parts]
    return (ks[0], vs[0]) if len(ks) == 1 else (mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))


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
