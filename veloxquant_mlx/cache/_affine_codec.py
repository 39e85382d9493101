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

    def n_tokens(self, arrays: Dict[str, mx.array]) -> int:
        """How many tokens stored ``arrays`` hold."""
        return arrays["w_q"].shape[2]

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
    """Keys stored transposed: each rotated channel quantized along blocks of ``block`` tokens.

    Same rotation as `AffineRotatedCodec`, but the affine groups run along tokens (one scale and bias per
    channel per block, KIVI-style) and the arrays hold ``K^T``:

        w_q ``(B, H, d, n*bits/32)`` uint32, scales / biases ``(B, H, d, n/block)``   (token axis LAST)

    Why: scoring is then ``q @ K^T`` with ``K^T`` quantized along its output axis, one
    ``mx.quantized_matmul(q Pi^T, w_q, transpose=False)`` per layer over the whole history, the fastest
    quantized form on CPU once several query heads share a KV head (GQA; see benchmarks/attention.py).
    Centring (default on) quantizes ``Pi (x - mu)``, which gives better codes at 2-3 bits, and then adds the
    rotated mean ``Pi mu`` back into each channel's biases: the stored codes decode to ``Pi x`` directly, so
    attention needs no ``q . mu`` correction (``mean_in_codes``).

    A block's tokens only make sense together: ``encode`` takes whole blocks (T a multiple of ``block``),
    and a cache appends, trims and deletes whole blocks (``token_block``; the remainder stays exact).
    Arrays of consecutive blocks concatenate along the last axis (see `concat`).

    Args: as `AffineRotatedCodec`, with ``block`` (32, 64 or 128, dividing d; default 64, or d when d < 64)
    in place of ``group_size``.
    """

    kind = "affine_block"
    mean_in_codes = True  # decode_rotated already includes Pi mu: attention must not add the mean again

    def __init__(self, d: int, bits: int, block: Optional[int] = None, **kwargs):
        super().__init__(d, bits, block, **kwargs)
        self.block = self.group_size

    @property
    def token_block(self) -> int:
        return self.block

    def n_tokens(self, arrays: Dict[str, mx.array]) -> int:
        """How many tokens stored ``arrays`` hold."""
        return arrays["scales"].shape[-1] * self.block

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)``, T a multiple of ``block`` -> ``K^T`` arrays ``(B, H, d, ...)`` (see the class)."""
        check_float_heads("x", x, self.d)
        T = x.shape[2]
        if T % self.block:
            raise ValueError(f"x must hold whole blocks: T={T} is not a multiple of block={self.block}")
        w_q, scales, biases = mx.quantize(mx.swapaxes(self.rotate(x), -1, -2), group_size=self.block, bits=self.bits)
        if self.mean is not None:
            # Fold Pi mu back in: per channel c, every token of the group shares the offset (Pi mu)_c.
            biases = biases + self.rotation.apply(self.mean)[None, :, :, None]  # (1, H, d, 1)
        return {"w_q": w_q, "scales": scales.astype(self.scale_dtype), "biases": biases.astype(self.scale_dtype)}

    def _check(self, arrays: Dict[str, mx.array]) -> None:
        missing = [f for f in FIELDS if f not in arrays]
        if missing:
            raise ValueError(f"arrays must hold {FIELDS}, missing {missing}")
        w = arrays["w_q"]
        if w.ndim != 4 or w.shape[2] != self.d or w.shape[3] * 32 != self.n_tokens(arrays) * self.bits:
            raise ValueError(
                f"arrays do not hold whole blocks of block={self.block} tokens in the (B, H, d={self.d}, ...) "
                f"layout: w_q {tuple(w.shape)}, scales {tuple(arrays['scales'].shape)}"
            )

    def decode_rotated(self, arrays: Dict[str, mx.array]) -> mx.array:
        """Stored arrays -> float32 ``(B, H, n, d)`` reconstruction of ``Pi x`` (the mean is in the biases)."""
        self._check(arrays)
        y = mx.dequantize(arrays["w_q"], arrays["scales"].astype(mx.float32), arrays["biases"].astype(mx.float32),
                          group_size=self.block, bits=self.bits)  # (B, H, d, n)
        return mx.swapaxes(y, -1, -2)

    def slice_tokens(self, arrays: Dict[str, mx.array], start: int, stop: int) -> Dict[str, mx.array]:
        """Tokens ``[start, stop)`` (block-aligned) of stored arrays."""
        if start % self.block or stop % self.block:
            raise ValueError(f"token range [{start}, {stop}) must be aligned to block={self.block}")
        wpb = self.block * self.bits // 32  # uint32 words per block and channel
        b0, b1 = start // self.block, stop // self.block
        return {
            "w_q": arrays["w_q"][..., b0 * wpb : b1 * wpb],
            "scales": arrays["scales"][..., b0:b1],
            "biases": arrays["biases"][..., b0:b1],
        }

    def decode(self, arrays: Dict[str, mx.array], dtype) -> mx.array:
        """Inverse of :meth:`encode`: ``(B, H, n, d)`` in ``dtype``."""
        return self.rotation.invert(self.decode_rotated(arrays)).astype(dtype)

    @staticmethod
    def concat(chunks) -> Dict[str, mx.array]:
        """Arrays of consecutive token ranges -> one set of arrays (along the token axis, the last)."""
        chunks = [c for c in chunks if c]
        if len(chunks) == 1:
            return dict(chunks[0])
        return {f: mx.concatenate([c[f] for c in chunks], axis=-1) for f in FIELDS}

    def __repr__(self):
        return super().__repr__().replace("AffineRotatedCodec(", "AffineBlockKeyCodec(").replace("group_size", "block")
