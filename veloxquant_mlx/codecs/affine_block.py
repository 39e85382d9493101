"""``affine_block``: keys stored transposed, each rotated channel quantized along blocks of tokens (KIVI-style).

Same rotation as :mod:`~veloxquant_mlx.codecs.affine`, but the affine groups run along tokens (one scale and
bias per channel per block) and the arrays hold ``K^T``:

    w_q ``(B, H, d, n*bits/32)`` uint32, scales / biases ``(B, H, d, n/block)``   (token axis LAST)

Scoring is then one ``mx.quantized_matmul(q Pi^T, w_q, transpose=False)`` per layer over the whole history,
the fastest quantized form on CPU once several query heads share a KV head (GQA; benchmarks/probes/attention.py).
Centring quantizes ``Pi (x - mu)`` (better codes at 2-3 bits) and folds ``Pi mu`` back into each channel's
biases, so the codes decode to ``Pi x`` directly: no ``q . mu`` term at attention time.

A block's tokens only make sense together: ``encode`` takes whole blocks, and a cache appends, trims and
deletes whole blocks (``token_block``; the remainder waits exact). For the same reason a non-finite token cannot
be coded on its own: its block decodes NaN (caches refuse to code one, naming the argument). Made for keys: as
values it is decoded.
The registered layout ``affine_block`` pairs it with ``affine`` values.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from veloxquant_mlx.codecs.affine_encode import affine_encode, reference_affine_encode
from veloxquant_mlx.codecs.common import clamp_to, packed_matmul_ok
from veloxquant_mlx.codecs._dequant import dequantize
from veloxquant_mlx.codecs.affine import FIELDS, AffineRotatedCodec
from veloxquant_mlx.codecs.contract import AffineCodes, CodeField
from veloxquant_mlx.validate import check_heads

# Query rows per KV head above which decoding once + BLAS beats the transpose=False quantized matmul on CPU.
CPU_PACKED_ROWS_SCORES = 32


class AffineBlockKeyCodec(AffineRotatedCodec):
    """``K^T`` codes per channel over blocks of ``block`` tokens (32, 64 or 128; default 64; any head_dim)."""

    BLOCKED = True  # codes whole blocks of tokens: a sliding window cannot evict one token
    GROUPS_ALONG_D = False  # groups run along tokens: any head_dim

    def __init__(self, d: int, bits: int, block: Optional[int] = None, **kwargs):
        super().__init__(d, bits, block, **kwargs)
        self.block = self.group_size

    @property
    def token_block(self) -> int:
        return self.block


    def n_tokens(self, codes: Dict[str, mx.array]) -> int:
        return codes["scales"].shape[-1] * self.block if codes else 0

    def code_layout(self, heads: int) -> Dict[str, CodeField]:
        """Tokens last (axis 3): a block is ``block * bits / 32`` words and one scale and bias per channel."""
        scales = CodeField(3, 1, (1, heads, self.d, 1), self.scale_dtype)
        wpb = self.block * self.bits // 32
        return {"w_q": CodeField(3, wpb, (1, heads, self.d, wpb), mx.uint32), "scales": scales, "biases": scales}

    def token_fields(self):
        raise TypeError(f"{type(self).__name__} codes blocks of tokens: see code_layout")

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)``, T a multiple of ``block`` -> ``K^T`` arrays ``(B, H, d, ...)``."""
        check_heads("x", x, self.d)
        if x.shape[2] % self.block:
            raise ValueError(f"x must hold whole blocks: T={x.shape[2]} is not a multiple of block={self.block}")
        # Centring folds Pi mu back into the biases: per channel c, every token of the group shares (Pi mu)_c. A
        # block's shared scale and bias per channel cannot code a non-finite token alone (mx.quantize spreads inf
        # over the block's channel and codes NaN as a finite value): such a channel block gets a NaN bias and
        # decodes NaN, visibly; the caches refuse to code one (`check_codable`).
        y = self.rotate(x)
        offset = None if self.mean is None else self.rotation.apply(self.mean)  # (H, d)
        if type(self).quantize is AffineBlockKeyCodec.quantize:  # mx.quantize's grid: one compiled op when built
            w_q, scales, biases = affine_encode(y, self.bits, self.block, self.scale_dtype, True, offset)
        else:
            w_q, scales, biases = reference_affine_encode(y, self.bits, self.block, self.scale_dtype, True, offset,
                                                          self.quantize)
        return {"w_q": w_q, "scales": scales, "biases": biases}

    def quantize(self, y: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """``(B, H, d, n)`` rotated channels -> MLX affine ``(w_q, scales, biases)``, groups along tokens."""
        return mx.quantize(y, group_size=self.block, bits=self.bits)

    def check_codes(self, codes: Dict[str, mx.array], name: str) -> None:
        missing = [f for f in FIELDS if f not in codes]
        if missing or set(codes) - set(FIELDS):
            raise ValueError(f"{name}: stored code arrays {sorted(codes)} must be exactly {FIELDS}")
        w, s, b = codes["w_q"], codes["scales"], codes["biases"]
        if (w.ndim != 4 or w.shape[2] != self.d or s.shape != b.shape or s.shape[:3] != w.shape[:3]
                or w.shape[3] * 32 != s.shape[3] * self.block * self.bits or w.dtype != mx.uint32):
            raise ValueError(f"{name}: arrays do not hold whole blocks of block={self.block} tokens in the "
                             f"(B, H, d={self.d}, ...) layout: w_q {tuple(w.shape)}, scales {tuple(s.shape)}")

    def decode_rotated(self, codes: Dict[str, mx.array]) -> mx.array:
        """Stored arrays -> float32 ``(B, H, n, d)`` reconstruction of ``Pi x`` (the mean is in the biases)."""
        self.check_codes(codes, "codes")
        y = dequantize(codes["w_q"], codes["scales"], codes["biases"], self.block, self.bits)  # (B, H, d, n)
        return mx.swapaxes(y, -1, -2)

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        return clamp_to(self.rotation.invert(self.decode_rotated(codes)), dtype)

    def slice_tokens(self, codes: Dict[str, mx.array], start: int, stop: int) -> Dict[str, mx.array]:
        """Tokens ``[start, stop)`` (block-aligned)."""
        if start % self.block or stop % self.block:
            raise ValueError(f"token range [{start}, {stop}) must be aligned to block={self.block}")
        wpb = self.block * self.bits // 32  # uint32 words per block and channel (code_layout's w_q units)
        b0, b1 = start // self.block, stop // self.block
        return {"w_q": codes["w_q"][..., b0 * wpb: b1 * wpb], "scales": codes["scales"][..., b0:b1],
                "biases": codes["biases"][..., b0:b1]}

    def concat(self, chunks: Sequence[Dict[str, mx.array]]) -> Dict[str, mx.array]:
        chunks = [c for c in chunks if c]
        if len(chunks) == 1:
            return dict(chunks[0])
        return {f: mx.concatenate([c[f] for c in chunks], axis=-1) for f in FIELDS} if chunks else {}

    # -- attention on codes -----------------------------------------------------------------------
    def decoded_offset(self) -> Optional[mx.array]:
        return None  # Pi mu is folded into the biases

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """``X^T`` fields, groups along tokens; the mean is in the biases."""
        return AffineCodes(codes["w_q"], codes["scales"], codes["biases"], self.bits, self.block, True,
                           self.rotation.matrix)

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        q_rot = self.rotation.apply(q)
        if packed_matmul_ok(q.shape[2], packed_rows, CPU_PACKED_ROWS_SCORES):
            # K^T quantized along tokens: q @ K^T is x @ W with W = K^T, the fast (transpose=False) form.
            return mx.quantized_matmul(q_rot, codes["w_q"], codes["scales"], codes["biases"], transpose=False,
                                       group_size=self.block, bits=self.bits)
        return q_rot @ mx.swapaxes(self.decode_rotated(codes), -1, -2)

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        return self.rotation.invert(p @ self.decode_rotated(codes))
