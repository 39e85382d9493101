"""`AffineRotatedCodec`: centre, rotate, then MLX's affine ``mx.quantize`` — codes that attention can use directly.

Same interface as :class:`veloxquant_mlx.cache._kv_codec.ChannelCodec` (``encode``/``decode``/``fit``/
``fitted``/``fitted_arrays``/``load_fitted``), so a cache's `TokenStore` can hold its arrays.

Per token vector x (one head, length d):

    y = Pi (x - mu)                    (mu: per-head mean fitted once; Pi: seeded orthogonal rotation)
    w_q, scales, biases = mx.quantize(y, group_size, bits)     (affine, along the last axis)

Why this layout: after a random rotation every coordinate looks alike, so MLX's affine format loses
nothing to a Lloyd-Max codebook at 3-4 bits per stored bit, and `mx.quantized_matmul` can score keys
(q Pi^T against the codes) and aggregate values without ever dequantizing the history
(see :mod:`veloxquant_mlx.attention.packed_sdpa`).

Scales and biases are stored in float16 by default: a quarter of the bytes of the codes at 4 bits /
group 64 in float32 would be halved, and `mx.quantized_matmul` with float16 scales and float32 inputs
measured no slower on CPU (benchmarks/attention.py, see the report). ``scale_dtype="float32"`` keeps them exact.
"""
from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.cache._kv_codec import check_float_heads
from veloxquant_mlx.rotation import ROTATION_KINDS, make_rotation

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
FIELDS = ("w_q", "scales", "biases")


def default_group_size(d: int) -> int:
    """64, or d itself when the head is narrower (32); the group must divide d."""
    return 64 if d >= 64 else d


class AffineRotatedCodec:
    """Codes ``(B, H, T, d)`` tensors as ``{"w_q", "scales", "biases"}`` arrays ``(B, H, T, ...)``.

    Args:
        d: head dim (int); must be a multiple of ``group_size``.
        bits: one of 2, 3, 4, 5, 6, 8 (what ``mx.quantize`` supports).
        group_size: 32, 64 or 128 (default: 64, or d when d < 64).
        seed: rotation seed (int >= 0).
        rotation: "haar" or "hadamard" (``veloxquant_mlx.rotation``).
        center: subtract a per-head mean ``(H, d)`` fitted once by :meth:`fit`.
        scale_dtype: storage dtype of scales and biases: "float16" (default), "bfloat16", "float32".
    """

    kind = "affine"

    def __init__(
        self,
        d: int,
        bits: int,
        group_size: Optional[int] = None,
        *,
        seed: int = 0,
        rotation: str = "haar",
        center: bool = True,
        scale_dtype: str = "float16",
    ):
        for name, v in (("d", d), ("bits", bits), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if bits not in AFFINE_BITS:
            raise ValueError(f"bits must be one of {AFFINE_BITS} (mx.quantize), got {bits}")
        if group_size is None:
            group_size = default_group_size(d)
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {AFFINE_GROUP_SIZES} (mx.quantize), got {group_size}")
        if d < 1 or d % group_size:
            raise ValueError(f"d must be a positive multiple of group_size={group_size}, got d={d}")
        if rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {rotation!r}")
        if not isinstance(center, bool):
            raise TypeError(f"center must be a bool, got {type(center).__name__}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {tuple(SCALE_DTYPES)}, got {scale_dtype!r}")
        self.d, self.bits, self.group_size = d, bits, group_size
        self.seed, self.rotation_kind, self.center = seed, rotation, center
        self.scale_dtype_name, self.scale_dtype = scale_dtype, SCALE_DTYPES[scale_dtype]
        self.rotation = make_rotation(d, seed, rotation)
        self.mean: Optional[mx.array] = None  # (H, d) float32

    # Tokens are coded independently: a cache may code any number at a time.
    token_block = 1

    # -- what attention needs ----------------------------------------------------------------------
    @property
    def rotation_matrix(self) -> mx.array:
        """``(d, d)`` float32 Pi: stored vectors are ``Pi (x - mu)``; rotate queries with ``q @ Pi^T``."""
        return self.rotation.matrix

    def bytes_per_token_head(self) -> float:
        """Stored bytes per token per head (codes + scales + biases), fitted mean not counted."""
        itemsize = 4 if self.scale_dtype == mx.float32 else 2
        return self.d * self.bits / 8 + 2 * (self.d // self.group_size) * itemsize

    # -- fitting ------------------------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.mean is not None or not self.center

    def fit(self, x: mx.array) -> None:
        """Fix the per-head mean ``mu`` ``(H, d)`` from ``x`` ``(B, H, T, d)``; later tokens reuse it."""
        check_float_heads("x", x, self.d)
        if self.center:
            self.mean = mx.mean(x.astype(mx.float32), axis=(0, 2))

    # -- coding -------------------------------------------------------------------------------------
    def rotate(self, x: mx.array) -> mx.array:
        """``(B, H, T, d)`` -> float32 ``Pi (x - mu)`` (the vectors that get quantized)."""
        xf = x.astype(mx.float32)
        if self.mean is not None:
            xf = xf - self.mean[None, :, None, :]
        return self.rotation.apply(xf)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)`` -> ``{"w_q": uint32 (B,H,T,d*bits/32), "scales"/"biases": (B,H,T,d/group)}``."""
        check_float_heads("x", x, self.d)
        w_q, scales, biases = mx.quantize(self.rotate(x), group_size=self.group_size, bits=self.bits)
        return {"w_q": w_q, "scales": scales.astype(self.scale_dtype), "biases": biases.astype(self.scale_dtype)}

    def decode_rotated(self, arrays: Dict[str, mx.array]) -> mx.array:
        """Stored arrays for n tokens -> float32 ``(B, H, n, d)`` reconstruction of ``Pi (x - mu)``."""
        missing = [f for f in FIELDS if f not in arrays]
        if missing:
            raise ValueError(f"arrays must hold {FIELDS}, missing {missing}")
        return mx.dequantize(
            arrays["w_q"],
            arrays["scales"].astype(mx.float32),
            arrays["biases"].astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
        )

    def decode(self, arrays: Dict[str, mx.array], dtype) -> mx.array:
        """Inverse of :meth:`encode` for n stored tokens: ``(B, H, n, d)`` in ``dtype``."""
        xf = self.rotation.invert(self.decode_rotated(arrays))
        if self.mean is not None:
            xf = xf + self.mean[None, :, None, :]
        return xf.astype(dtype)

    # -- state --------------------------------------------------------------------------------------
    def fitted_arrays(self) -> Dict[str, mx.array]:
        """Per-head parameters that travel with the codes (counted in a cache's bytes)."""
        return {} if self.mean is None else {"mean": self.mean}

    def load_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self.mean = arrays.get("mean")

    def __repr__(self):
        return (
            f"AffineRotatedCodec(d={self.d}, bits={self.bits}, group_size={self.group_size}, seed={self.seed}, "
            f"rotation={self.rotation_kind!r}, center={self.center}, scale_dtype={self.scale_dtype_name!r})"
        )


class AffineBlockKeyCodec(AffineRotatedCodec):
    """Keys in blocks of ``block`` tokens, each rotated channel quantized along the block's tokens.

    Same centring and rotation as `AffineRotatedCodec`, but the affine groups run along tokens (one scale
    and bias per channel per block, KIVI-style) instead of along channels. Why: scoring then is
    ``q @ K^T`` with ``K^T`` quantized along its output axis, i.e. ``mx.quantized_matmul(...,
    transpose=False)``, which on CPU costs about a third of the ``transpose=True`` form once several
    query heads share a KV head (GQA); see benchmarks/attention.py.

    Storage per token is the same as the per-token codec with ``group_size=block`` (``d*bits/32`` words,
    ``d/block`` scales and biases), and the arrays keep the token axis at 2 so a `TokenStore` holds them,
    but a block's rows only make sense together: ``encode`` takes whole blocks (T a multiple of
    ``block``; a cache keeps the remainder exact) and a cache must append, trim and delete whole blocks.
    ``token_block`` tells a cache this multiple (1 for per-token codecs).

    Args: as `AffineRotatedCodec`, with ``block`` (32, 64 or 128, dividing d; default 64, or d when d < 64)
    in place of ``group_size``.
    """

    kind = "affine_block"

    def __init__(self, d: int, bits: int, block: Optional[int] = None, **kwargs):
        super().__init__(d, bits, block, **kwargs)
        self.block = self.group_size

    @property
    def token_block(self) -> int:
        return self.block

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)``, T a multiple of ``block`` -> arrays ``(B, H, T, ...)`` (block-major inside)."""
        check_float_heads("x", x, self.d)
        B, H, T, d = x.shape
        if T % self.block:
            raise ValueError(f"x must hold whole blocks: T={T} is not a multiple of block={self.block}")
        nb = T // self.block
        # (B, H, nb, block, d) -> (B, H, nb, d, block): each row is one channel over the block's tokens.
        y = mx.swapaxes(self.rotate(x).reshape(B, H, nb, self.block, d), -1, -2)
        w_q, scales, biases = mx.quantize(y, group_size=self.block, bits=self.bits)
        # Reinterpret each block's (d, ...) rows as (block, ...) token rows: same bytes, token axis 2.
        return {
            "w_q": w_q.reshape(B, H, T, -1),
            "scales": scales.astype(self.scale_dtype).reshape(B, H, T, -1),
            "biases": biases.astype(self.scale_dtype).reshape(B, H, T, -1),
        }

    def blocks(self, arrays: Dict[str, mx.array]):
        """Stored arrays for n tokens -> ``(w_q (B,H,nb,d,block*bits/32), scales, biases (B,H,nb,d,1))``."""
        missing = [f for f in FIELDS if f not in arrays]
        if missing:
            raise ValueError(f"arrays must hold {FIELDS}, missing {missing}")
        B, H, n, _ = arrays["w_q"].shape
        if n % self.block:
            raise ValueError(f"stored token count {n} is not a multiple of block={self.block}")
        nb = n // self.block
        return (
            arrays["w_q"].reshape(B, H, nb, self.d, -1),
            arrays["scales"].reshape(B, H, nb, self.d, 1),
            arrays["biases"].reshape(B, H, nb, self.d, 1),
        )

    def decode_rotated(self, arrays: Dict[str, mx.array]) -> mx.array:
        w_q, scales, biases = self.blocks(arrays)
        y = mx.dequantize(w_q, scales.astype(mx.float32), biases.astype(mx.float32),
                          group_size=self.block, bits=self.bits)  # (B, H, nb, d, block)
        B, H, nb = y.shape[:3]
        return mx.swapaxes(y, -1, -2).reshape(B, H, nb * self.block, self.d)

    def __repr__(self):
        return super().__repr__().replace("AffineRotatedCodec(", "AffineBlockKeyCodec(").replace("group_size", "block")
