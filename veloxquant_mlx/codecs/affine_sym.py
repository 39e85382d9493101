"""``kblock_vsym``: symmetric per-token value codes that store one float16 scale per group and no bias.

Values, per token vector x (one head, length d), groups of ``g`` coordinates along d:

    y = Pi (x - mu)                                   (as ``affine``: centre, seeded rotation)
    s = r * max|y_group| / c,  c = (2^b - 1) / 2       (r: the clip ratio of ``CLIP_RATIOS`` with least error)
    q = clip(round(y / s + c), 0, 2^b - 1)  ->  y_hat = s * (q - c)

The levels are symmetric about 0 (a rotated coordinate is), so the bias MLX's affine format wants is ``-c * s``,
derived from the scale when attention runs: ``mx.quantized_matmul`` reads the codes directly (scores with
``transpose=True``, values ``transpose=False``, as ``affine``), and a token costs ``b + 16 / g`` bits (4.25 at
4 bits, g = 64) instead of ``b + 32 / g``. The codes are packed in MLX's layout (a little-endian bit stream of
``b``-bit fields in uint32 words), so `mx.dequantize` and `mx.quantized_matmul` read them as their own.

The layout pairs these values with the clipped per-channel block keys of ``affine_block_kv_mse``
(``group_size=128``: 0.25 bit of key scales), so b-bit keys and values take b + 0.25 bits per coordinate with
attention on the codes throughout.
"""
from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs.common import f32
from veloxquant_mlx.codecs.affine import AFFINE_GROUP_SIZES, AffineRotatedCodec
from veloxquant_mlx.codecs.contract import AffineCodes
from veloxquant_mlx.validate import check_heads

SYM_FIELDS = ("w_q", "scales")
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6)


def pack_codes(q: mx.array, bits: int) -> mx.array:
    """Integer codes ``(..., n)`` (each < 2**bits, n * bits a multiple of 32) -> MLX's packed uint32 words
    ``(..., n * bits / 32)``: field i at bits ``[i * bits, (i + 1) * bits)`` of the little-endian stream."""
    q = q.astype(mx.uint32)
    stream = (q[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1  # (..., n, bits)
    stream = stream.reshape(*q.shape[:-1], -1, 32)  # (..., words, 32)
    return mx.sum(stream << mx.arange(32, dtype=mx.uint32), axis=-1).astype(mx.uint32)


def symmetric_codes(y: mx.array, bits: int, group: int):
    """``(..., d)`` -> (integer codes ``(..., d)``, float32 scales ``(..., d/group)``) with the least squared
    error over ``CLIP_RATIOS`` per group."""
    c = (2 ** bits - 1) / 2
    g = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
    amax = mx.maximum(mx.max(mx.abs(g), axis=-1, keepdims=True), 1e-30)
    s = mx.stack([r * amax / c for r in CLIP_RATIOS])  # (R, ..., groups, 1)
    q = mx.clip(mx.round(g[None] / s + c), 0, 2 ** bits - 1)
    err = mx.sum(mx.square(s * (q - c) - g[None]), axis=-1, keepdims=True)  # (R, ..., groups, 1)
    best = mx.argmin(err, axis=0)[None]
    q = mx.take_along_axis(q, mx.broadcast_to(best, (1,) + q.shape[1:]), axis=0)[0]
    s = mx.take_along_axis(s, best, axis=0)[0]
    return q.reshape(y.shape), s[..., 0]


class AffineSymValueCodec(AffineRotatedCodec):
    """Symmetric per-token codes ``{"w_q", "scales"}`` ``(B, H, T, ...)`` of centred rotated vectors (bits 2, 3,
    4, 5, 6, 8; groups of ``group_size`` along d, default 64); ``group_size`` is the keys' block in the layout and
    these groups stay 64 (or d when d < 64)."""

    def __init__(self, d: int, bits: int, group_size: Optional[int] = None, **kwargs):
        super().__init__(d, bits, None, **kwargs)  # groups along d: the default; group_size is the keys' block
        self.zero = (2 ** bits - 1) / 2

    GROUP_SIZES = AFFINE_GROUP_SIZES

    def bytes_per_token_head(self) -> float:
        return self.d * self.bits / 8 + (self.d // self.group_size) * 2

    def token_fields(self):
        return {"w_q": ((self.d * self.bits // 32,), mx.uint32),
                "scales": ((self.d // self.group_size,), self.scale_dtype)}

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        check_heads("x", x, self.d)
        q, s = symmetric_codes(self.rotate(x), self.bits, self.group_size)
        return {"w_q": pack_codes(q, self.bits), "scales": self.store_scale(s)}

    def _affine(self, codes: Dict[str, mx.array]):
        """(w_q, float32 scales, biases) as MLX's affine format reads them."""
        missing = [f for f in SYM_FIELDS if f not in codes]
        if missing:
            raise ValueError(f"codes must hold {SYM_FIELDS}, missing {missing}")
        s = f32(codes["scales"])
        return codes["w_q"], s, -self.zero * s

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """Symmetric fields per token: no biases, ``x = scale * (code - zero)``."""
        return AffineCodes(codes["w_q"], codes["scales"], None, self.bits, self.group_size, False,
                           self.rotation.matrix, self.mean, self.zero)
