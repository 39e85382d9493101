"""Per-channel codes over blocks of tokens for keys and values, and the budget layouts built on them.

``affine_block_kv`` (`AffineBlockKVCodec`): the layout of :mod:`~veloxquant_mlx.codecs.affine_block` (``X^T``
codes, one scale and bias per rotated channel per block of tokens, tokens last) for values too, with blocks that
need not divide the head dim:

    w_q ``(B, H, d, n*bits/32)`` uint32, scales / biases ``(B, H, d, n/block)``      (token axis LAST)

Per-token codes pay a float16 scale and bias per 64 coordinates (0.5 bit); per channel over 128-token blocks
(``group_size=128``) 0.25 bit. Attention stays on the codes: scores ``mx.quantized_matmul(q Pi^T, K^T codes,
transpose=False)`` (as ``affine_block``), values ``mx.quantized_matmul(p, V^T codes, transpose=True)`` = ``p @ V``
in the rotated domain, rotated back once per output row. A cache codes whole blocks only (``token_block``); the
remainder waits exact in its tail. Measured on SmolLM2 (BENCHMARKS.md), values per channel lose more than values
per token (KL 0.041 against 0.025 at 4 bits), hence the pairings below.

``affine_block_kv_mse`` (`AffineBlockKVMSECodec`): the same arrays, each group's range clipped to the fraction of
its min-max range (``CLIP_RATIOS``) with the least squared error: min-max ranges waste levels on the few extreme
tokens of a block (on Gaussian data 24 % less error at 2 bits, 16 % at 3, 5 % at 4).

``kblock_vlloyd`` pairs those keys (``group_size=128``: 0.25 bit) with Lloyd-Max values per token
(`LloydMaxValueCodec`, a bfloat16 norm per vector: 0.25 bit): b-bit keys and values in b + 0.25 bits per
coordinate; its values are decoded to be aggregated (slow attention). ``kblock_vsym``
(:mod:`~veloxquant_mlx.codecs.affine_sym`) pairs them with symmetric scale-only values read by the quantized
matmul: the same bits and quality, fast attention.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from veloxquant_mlx.codecs.common import f32, packed_matmul_ok
from veloxquant_mlx.codecs.affine import AFFINE_GROUP_SIZES, AffineRotatedCodec
from veloxquant_mlx.codecs.affine_block import AffineBlockKeyCodec
from veloxquant_mlx.codecs.lloyd_max import LloydMaxCodec
from veloxquant_mlx.validate import check_int

DEFAULT_BLOCK = 64
# Query rows per KV head above which decoding once + BLAS beats the quantized matmul for values on CPU
# (the transpose=True form, as affine's scores).
CPU_PACKED_ROWS_VALUES = 12


class AffineBlockKVCodec(AffineBlockKeyCodec):
    """``X^T`` codes per rotated channel over blocks of ``block`` tokens (32, 64 or 128; default 64), for keys and
    for values; ``d`` need not be a multiple of ``block`` (but is one the rotation's affine parent accepts)."""

    def __init__(self, d: int, bits: int, block: Optional[int] = None, **kwargs):
        block = DEFAULT_BLOCK if block is None else check_int("group_size", block)
        if block not in AFFINE_GROUP_SIZES:
            raise ValueError(f"group_size (tokens per block) must be one of {AFFINE_GROUP_SIZES} (mx.quantize "
                             f"groups), got {block}")
        AffineRotatedCodec.__init__(self, d, bits, None, **kwargs)  # groups run along tokens, never along d
        self.block = self.group_size = block

    def bytes_per_token_head(self) -> float:
        """Stored bytes per token per head: codes plus a scale and a bias per channel per block."""
        itemsize = 4 if self.scale_dtype == mx.float32 else 2
        return self.d * self.bits / 8 + 2 * self.d * itemsize / self.block

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        """``p (B, H, M, n) @ decode(codes)`` -> ``(B, H, M, d)``; the mean is in the biases (no offset term)."""
        if packed_matmul_ok(p.shape[2], packed_rows, CPU_PACKED_ROWS_VALUES):
            # V^T quantized along tokens: p @ V = p @ (V^T)^T, the transpose=True form.
            o_rot = f32(mx.quantized_matmul(p, codes["w_q"], codes["scales"], codes["biases"], transpose=True,
                                            group_size=self.block, bits=self.bits))
        else:
            o_rot = p @ self.decode_rotated(codes)
        return self.rotation.invert(o_rot)


# Fractions of a group's min-max half-range tried, around its midpoint (1.0 = plain min-max).
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def clip_candidates(y: mx.array, block: int) -> mx.array:
    """``(..., n)`` -> ``(R, ..., n)``: ``y`` clipped to each of ``CLIP_RATIOS`` of its groups' min-max range."""
    g = y.reshape(*y.shape[:-1], y.shape[-1] // block, block)
    lo, hi = mx.min(g, axis=-1, keepdims=True), mx.max(g, axis=-1, keepdims=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    return mx.stack([mx.clip(g, mid - r * half, mid + r * half).reshape(y.shape) for r in CLIP_RATIOS])


def clipped_quantize(y: mx.array, block: int, bits: int) -> Tuple[mx.array, mx.array, mx.array]:
    """``mx.quantize`` of ``y`` ``(..., n)`` with each group first clipped to the candidate of `clip_candidates`
    whose ``mx.quantize`` round trip has the least squared error -> ``(w_q, scales, biases)``.

    Each candidate's error is computed on ``mx.quantize``'s own grid (its scale, the zero-representing edge and
    bias, as MLX's affine quantize sets them) in plain elementwise float ops, then only the chosen candidate is
    quantized: the same arrays as quantizing every candidate (tested bit for bit), 1.6-2.7x faster on this CPU,
    where quantizing six candidates (3-bit codes the slowest) was most of a budget preset's prefill store."""
    g = y.reshape(*y.shape[:-1], y.shape[-1] // block, block)  # (..., groups, block)
    lo, hi = mx.min(g, axis=-1, keepdims=True), mx.max(g, axis=-1, keepdims=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    ratios = mx.array(CLIP_RATIOS, dtype=mx.float32)
    r = ratios.reshape(-1, *([1] * g.ndim))  # (R, 1, ..., 1)
    lo_r, hi_r = mid[None] - r * half[None], mid[None] + r * half[None]  # (R, ..., groups, 1)
    n_bins = 2 ** bits - 1
    # mx.quantize's grid for the range [lo_r, hi_r]: the larger-magnitude end is the bias and a grid point, and
    # the scale is adjusted so that zero is one too
    scale = mx.maximum((hi_r - lo_r) / n_bins, 1e-7)
    low_edge = mx.abs(lo_r) > mx.abs(hi_r)
    scale = mx.where(low_edge, scale, -scale)
    edge = mx.where(low_edge, lo_r, hi_r)
    q0 = mx.round(edge / scale)
    scale = mx.where(q0 != 0, edge / q0, scale)
    bias = mx.where(q0 == 0, 0.0, edge)
    q = mx.clip(mx.round((mx.clip(g[None], lo_r, hi_r) - bias) / scale), 0, n_bins)
    err = mx.sum(mx.square(q * scale + bias - g[None]), axis=-1, keepdims=True)  # (R, ..., groups, 1)
    rb = ratios[mx.argmin(err, axis=0)]  # (..., groups, 1)
    clipped = mx.clip(g, mid - rb * half, mid + rb * half).reshape(y.shape)
    return mx.quantize(clipped, group_size=block, bits=bits)


class AffineBlockKVMSECodec(AffineBlockKVCodec):
    """`AffineBlockKVCodec` whose groups take the clipped range (of ``CLIP_RATIOS``) with the least squared error."""

    def quantize(self, y: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        return clipped_quantize(y, self.block, self.bits)


class LloydMaxValueCodec(LloydMaxCodec):
    """Lloyd-Max codes per token for the values of ``kblock_vlloyd``: ``group_size`` (the keys' block) is accepted
    and does not apply (a vector has one norm, no groups)."""

    GROUP_SIZES = AFFINE_GROUP_SIZES
