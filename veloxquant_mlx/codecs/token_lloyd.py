"""``token_lloyd8``: keys and values coded per token on TurboQuant's Lloyd-Max levels, one-byte scales.

Per token vector x (one head, length d), groups of ``g`` coordinates along d (64, or d when d < 64):

    y = Pi (x - mu)                                 (centre, seeded rotation: as ``kblock_vsym8``'s values)
    s = 2 ** ((code - LOG_OFFSET) / LOG_STEPS)      one byte per group, ``kblock_vsym8``'s log grid
    q = the level interval of y / s among the 2^b Lloyd-Max levels of N(0, 1)  ->  y_hat = s * levels[q]

A rotated coordinate of a head vector is close to Gaussian (TurboQuant, arXiv 2504.19874), for which these levels
are the least-squared-error scalar code: at 4 bits ~19 % less squared error than ``kblock_vsym8``'s uniform
symmetric levels at the same bytes (``b + 8 / g`` bits: 4.125 at 4 bits, g = 64). The scale is the grid point of
least squared error among `SCALE_STEPS` around the group's RMS (the Lloyd-Max scale of a Gaussian is its standard
deviation). Every token is coded once, on arrival: no block to wait for, no second rounding, so a layout of these
codes holds its bits at every length (issue 54).

Attention reads the codes: the compiled kernel takes codebook codes with one-byte scales (``AffineCodes.levels``),
the pure-MLX path decodes the levels and multiplies. Encoding: one compiled operation where the kernel module is
built (``level_log_encode``, `csrc/affine_encode.cpp`, checked bit for bit against `reference_level_log_encode`),
else `mx.compile` for a few tokens (a decode step), else MLX operations; all give the same codes.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from veloxquant_mlx.codecs.affine_sym import pack_codes
from veloxquant_mlx.codecs.affine_sym_log import (LOG_OFFSET, LOG_STEPS, NON_FINITE, AffineSymLogScaleValueCodec,
                                                  decode_log_scales)
from veloxquant_mlx.codecs.contract import AffineCodes
from veloxquant_mlx.quant.bit_pack import unpack
from veloxquant_mlx.quant.codebooks import lloyd_max_codebook
from veloxquant_mlx.validate import check_heads

SCALE_STEPS = (-4, 4)  # grid steps tried around the RMS's grid point: [-4, 4), 9 % apart (-29 % .. +27 %)
FUSED_TOKENS = 8  # at most this many tokens per head go through mx.compile (a decode step's one token)


@functools.lru_cache(maxsize=None)
def gaussian_levels(bits: int) -> Tuple[mx.array, mx.array]:
    """``(levels (2^b,), inner boundaries (2^b - 1,))`` float32 of the Lloyd-Max code of N(0, 1), ascending."""
    cb = lloyd_max_codebook("gaussian", bits, scale=1.0)
    levels = mx.array(cb.centroids_np, dtype=mx.float32)
    bounds = mx.array(cb.boundaries_np, dtype=mx.float32)
    if bounds.shape[0] == levels.shape[0] + 1:  # (with the outer +-inf)
        bounds = bounds[1:-1]
    mx.eval(levels, bounds)
    return levels, bounds


def reference_level_log_encode(y: mx.array, levels: mx.array, inner: mx.array, bits: int, group: int):
    """float32 ``y`` ``(..., d)`` -> ``(w_q uint32 (..., d*bits/32), uint8 scale codes (..., d/group))`` in MLX
    operations. A group of zeros gets scale code 0 (decodes zeros), one holding inf or NaN `NON_FINITE` (decodes
    NaN)."""
    g = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
    rms = mx.sqrt(mx.sum(mx.square(g), axis=-1, keepdims=True) / group)  # (..., groups, 1)
    bad = ~mx.isfinite(rms)
    mid = mx.round(LOG_STEPS * mx.log2(mx.maximum(rms, 1e-30))) + LOG_OFFSET
    mid = mx.where(bad, LOG_OFFSET, mid)
    steps = mx.arange(*SCALE_STEPS, dtype=mx.float32).reshape(-1, *([1] * mid.ndim))
    cand = mx.clip(mid[None] + steps, 1, NON_FINITE - 1)
    s = mx.power(2.0, (cand - LOG_OFFSET) / LOG_STEPS)  # (C, ..., groups, 1)
    q = mx.sum(mx.expand_dims(g[None] / s, -1) > inner, axis=-1)  # (C, ..., groups, group)
    err = mx.sum(mx.square(s * levels[q] - g[None]), axis=-1, keepdims=True)
    best = mx.argmin(err, axis=0)[None]
    q = mx.take_along_axis(q, mx.broadcast_to(best, (1,) + q.shape[1:]), axis=0)[0]
    code = mx.take_along_axis(cand, best, axis=0)[0]
    code = mx.where(rms == 0, 0, mx.where(bad, NON_FINITE, code))
    return pack_codes(q.reshape(y.shape), bits), code[..., 0].astype(mx.uint8)


@functools.lru_cache(maxsize=None)
def _fused(bits: int, group: int):
    return mx.compile(functools.partial(reference_level_log_encode, bits=bits, group=group))


# The compiled operation (``level_log_encode``): a callable returning it, or None when it may not run now; set by the
# cache layer (`veloxquant_mlx.cache.row_codes`), as for `veloxquant_mlx.codecs.affine_sym_log`.
_compiled_provider: Optional[Callable[[], Optional[Callable]]] = None


def set_compiled_provider(provider: Optional[Callable[[], Optional[Callable]]]) -> None:
    global _compiled_provider
    _compiled_provider = provider


def level_log_encode(y: mx.array, bits: int, group: int):
    """`reference_level_log_encode` on the Gaussian levels of ``bits``: one compiled operation where it can run
    (4-d float32 ``y``), else fused by mx.compile for a few tokens, else plain operations."""
    levels, inner = gaussian_levels(bits)
    d = y.shape[-1]
    if _compiled_provider is not None and y.ndim == 4 and y.dtype == mx.float32 and d <= 256 and \
            group in (32, 64, 128) and d % group == 0 and (d * bits) % 32 == 0:
        fn = _compiled_provider()
        if fn is not None:
            return tuple(fn(y, levels, inner, bits, group))
    if y.size // d <= FUSED_TOKENS * (y.shape[1] if y.ndim == 4 else 1):
        return _fused(bits, group)(y, levels, inner)
    return reference_level_log_encode(y, levels, inner, bits, group)


class TokenLloydCodec(AffineSymLogScaleValueCodec):
    """Per-token Lloyd-Max codes ``{"w_q", "scales"}`` of rotated vectors, one-byte log-grid scales per group
    (keys and values of layout ``token_lloyd8``)."""

    # A model's layer whose queries read key channels that vary little (Gemma 3's full-attention layers) loses
    # those channels in a rotated per-token code: the builder gives such a layer (found by its key-rotation probe or a
    # calibration) these block keys in the model's own channels instead (codec, key block in tokens). On Gemma 3
    # 270M the full-attention layers alone took KL 0.0121 on the Debian text with these codes (issue 54).
    CHANNEL_LAYOUT = ("kblock_vsym8", 128)

    def __init__(self, d: int, bits: int, group_size: Optional[int] = None, **kwargs):
        super().__init__(d, bits, group_size, **kwargs)
        self.levels, self.inner = gaussian_levels(self.bits)
        self.zero = 0.0  # (codebook codes: no zero level; `AffineCodes.levels` carries the values)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        check_heads("x", x, self.d)
        w, code = level_log_encode(self.rotate(x), self.bits, self.group_size)
        return {"w_q": w, "scales": code}

    def decode_rotated(self, codes: Dict[str, mx.array]) -> mx.array:
        w, code = self._fields(codes)
        q = unpack(w, self.bits, self.d).astype(mx.int32)
        y = self.levels[q].reshape(*q.shape[:-1], self.d // self.group_size, self.group_size)
        return (y * decode_log_scales(code)[..., None]).reshape(q.shape)

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        s = self.rotation.apply(q) @ mx.swapaxes(self.decode_rotated(codes), -1, -2)
        if self.mean is not None:
            s = s + q @ mx.expand_dims(self.mean, -1)[None]
        return s

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        o = self.rotation.invert(p @ self.decode_rotated(codes))
        if with_offset and self.mean is not None:
            o = o + mx.sum(p, axis=-1, keepdims=True) * self.mean[None, :, None, :]
        return o

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """Codebook codes per token (``x = scale * levels[code]``) with their uint8 scale codes."""
        w, code = self._fields(codes)
        return AffineCodes(w, code, None, self.bits, self.group_size, False, self.rotation.matrix, self.mean, 0.0,
                           self.levels)


__all__ = ["FUSED_TOKENS", "SCALE_STEPS", "TokenLloydCodec", "gaussian_levels", "level_log_encode",
           "reference_level_log_encode", "set_compiled_provider"]
