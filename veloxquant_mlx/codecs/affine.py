"""``affine``: centre, rotate, then MLX's affine ``mx.quantize`` per token — codes `mx.quantized_matmul` reads.

Per token vector x (one head, length d):

    y = Pi (x - mu)                    (mu: per-head mean fitted once; Pi: seeded orthogonal rotation)
    w_q, scales, biases = mx.quantize(y, group_size, bits)     (affine, along the last axis)

After a random rotation every coordinate looks alike, so MLX's affine format loses nothing to a Lloyd-Max
codebook at 3-4 bits per stored bit (FINDINGS.md), and attention never dequantizes the history: keys are
scored with ``mx.quantized_matmul(q Pi^T, codes, transpose=True)`` (q.k = (Pi q).(Pi k)), values aggregated
with ``mx.quantized_matmul(p, codes)`` and the ``(.., d)`` output rotated back once; ``q . mu`` and
``sum(p) mu`` are the centring terms. Scales and biases are stored in float16 (float32 inputs to
`mx.quantized_matmul` with float16 scales measured no slower on CPU).
"""
from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs.affine_encode import affine_encode
from veloxquant_mlx.codecs.common import (PerTokenLayout, clamp_to, f32, finite_channel_mean,
                                           packed_matmul_ok)
from veloxquant_mlx.codecs._dequant import dequantize
from veloxquant_mlx.codecs.contract import AffineCodes
from veloxquant_mlx.quant.rotation import KEY_ROTATION_KINDS, make_rotation
from veloxquant_mlx.validate import check_bool, check_choice, check_heads, check_int

AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports
AFFINE_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
FIELDS = ("w_q", "scales", "biases")

# Measured CPU crossovers (query rows per KV head) above which decoding once + BLAS beats the quantized
# matmul (benchmarks/probes/attention.py era, 8 KV heads, d=128, n=8k): scoring (transpose=True) ~12 rows, value
# aggregation (transpose=False) ~32 rows.
CPU_PACKED_ROWS_SCORES = 12
CPU_PACKED_ROWS_VALUES = 32


def default_group_size(d: int) -> Optional[int]:
    """The first of 64, 128, 32 (mx.quantize's group sizes) that divides d (96 -> 32); None when none does."""
    return next((g for g in (64, 128, 32) if d % g == 0), None)


class AffineRotatedCodec(PerTokenLayout):
    """Codes ``(B, H, T, d)`` tensors as ``{"w_q", "scales", "biases"}`` arrays ``(B, H, T, ...)``.

    Args:
        d: head dim; a multiple of ``group_size``. bits: one of 2, 3, 4, 5, 6, 8.
        group_size: 32, 64 or 128 (default 64, or d when d < 64). seed: rotation seed (int >= 0).
        rotation: "haar" or "hadamard". center: subtract a per-head mean fitted once by `fit`.
        scale_dtype: storage dtype of scales and biases ("float16" default, "bfloat16", "float32").
    """

    BITS = AFFINE_BITS
    OUTLIERS = False
    GROUP_SIZES = AFFINE_GROUP_SIZES
    GROUPS_ALONG_D = True  # groups of coordinates (a per-token layout); block layouts group tokens instead

    def __init__(self, d: int, bits: int, group_size: Optional[int] = None, *, seed: int = 0,
                 rotation: str = "haar", center: bool = True, scale_dtype: str = "float16"):
        check_int("d", d, 1)
        check_int("seed", seed, 0)
        if check_int("bits", bits) not in AFFINE_BITS:
            raise ValueError(f"bits must be one of {AFFINE_BITS} (mx.quantize), got {bits}")
        if group_size is None:
            # (a token block: 64, or 32 for a 32-wide head, as ever; any head_dim takes it)
            group_size = default_group_size(d) if self.GROUPS_ALONG_D else (32 if d == 32 else 64)
            if group_size is None:
                raise ValueError(f"d={d} has no mx.quantize group size dividing it (one of {AFFINE_GROUP_SIZES}): "
                                 "affine codes per token need a head_dim that is a multiple of 32")
        group_size = check_int("group_size", group_size)
        if group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {AFFINE_GROUP_SIZES} (mx.quantize), got {group_size}")
        if self.GROUPS_ALONG_D and d % group_size:
            raise ValueError(f"d must be a positive multiple of group_size={group_size}, got d={d}")
        check_choice("rotation", rotation, KEY_ROTATION_KINDS)
        self.center = check_bool("center", center)
        self.scale_dtype_name = check_choice("scale_dtype", scale_dtype, SCALE_DTYPES)
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        self.d, self.bits, self.group_size = d, bits, group_size
        self.seed, self.rotation_kind = seed, rotation
        self.rotation = make_rotation(d, seed, rotation)
        self.mean: Optional[mx.array] = None  # (H, d) float32
        self.rope_mean: Optional[mx.array] = None  # (H, d) float32, carried for the cache (`carries_rope_mean`)

    @classmethod
    def from_options(cls, options, role: str, d: int):
        """The keys' or values' codec of a cache (keys and values get independent rotations; the keys' kind is
        ``options.key_rotation`` when set)."""
        if role == "keys":
            codec = cls(d, options.k_bits, options.group_size, seed=options.seed,
                        rotation=options.key_rotation or options.rotation, center=options.center_keys)
            codec.carries_rope_mean = getattr(options, "rope_frame", None) is not None
            return codec
        return cls(d, options.v_bits, options.group_size, seed=options.seed + 1000, rotation=options.rotation,
                   center=options.center_values)

    @property
    def rotation_matrix(self) -> mx.array:
        """``(d, d)`` float32 Pi: stored vectors are ``Pi (x - mu)``; rotate queries with ``q @ Pi^T``."""
        return self.rotation.matrix

    def bytes_per_token_head(self) -> float:
        """Stored bytes per token per head (codes + scales + biases), fitted mean not counted."""
        itemsize = 4 if self.scale_dtype == mx.float32 else 2
        return self.d * self.bits / 8 + 2 * (self.d // self.group_size) * itemsize

    # -- fitting: the per-head channel mean mu (H, d) float32 when centred ------------------------
    # Keys of a cache with ``rope_offset`` (`CacheOptions`) also carry ``rope_mean`` (H, d) float16: the mean before
    # RoPE the cache subtracts, rotated to each position, before coding (`veloxquant_mlx.quant.rope`). The codec
    # does not read it; it is a fitted parameter so that it travels with the codes (batch rows, saved states).
    ROPE_OFFSET = True
    carries_rope_mean = False

    def fitted_spec(self, heads: int):
        spec = {"mean": ((heads, self.d), mx.float32)} if self.center else {}
        if self.carries_rope_mean:  # (float16: any mean is exact for attention, being added back as subtracted)
            spec["rope_mean"] = ((heads, self.d), mx.float16)
        return spec

    def fitted_from(self, x: mx.array) -> Dict[str, mx.array]:
        """The channel mean of ``x`` when centred; with ``rope_mean`` carried, zeros for it (keys without their
        positions give no offset: the cache fits it, `veloxquant_mlx.quant.rope.fit_mean`)."""
        check_heads("x", x, self.d)
        out = {"mean": finite_channel_mean(f32(x))} if self.center else {}
        if self.carries_rope_mean:
            out["rope_mean"] = mx.zeros((x.shape[1], self.d), dtype=mx.float16)
        return out

    def _set_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self.mean = arrays.get("mean")
        self.rope_mean = arrays.get("rope_mean")

    def fitted_arrays(self) -> Dict[str, mx.array]:
        out = {} if self.mean is None else {"mean": self.mean}
        if self.rope_mean is not None:
            out["rope_mean"] = self.rope_mean
        return out

    # -- layout -----------------------------------------------------------------------------------
    def token_fields(self):
        scales = ((self.d // self.group_size,), self.scale_dtype)
        return {"w_q": ((self.d * self.bits // 32,), mx.uint32), "scales": scales, "biases": scales}

    # -- coding -----------------------------------------------------------------------------------
    def rotate(self, x: mx.array) -> mx.array:
        """``(B, H, T, d)`` -> float32 ``Pi (x - mu)`` (the vectors that get quantized)."""
        xf = f32(x)
        if self.mean is not None:
            xf = xf - self.mean[None, :, None, :]
        return self.rotation.apply(xf)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)`` -> ``{"w_q": uint32 (B,H,T,d*bits/32), "scales"/"biases": (B,H,T,d/group)}``."""
        check_heads("x", x, self.d)
        w_q, scales, biases = affine_encode(self.rotate(x), self.bits, self.group_size, self.scale_dtype)
        return {"w_q": w_q, "scales": scales, "biases": biases}

    def store_scale(self, s: mx.array) -> mx.array:
        """Scales / biases in their storage dtype; clamped into float16's range (rotated coordinates of inputs
        near ±65504 can exceed it), so finite inputs never store inf (a non-finite one keeps its non-finite scale:
        its token decodes non-finite, never as a finite value)."""
        return clamp_to(s, self.scale_dtype)

    def _affine(self, codes: Dict[str, mx.array]):
        """(w_q, scales, biases) as MLX's affine format reads them (a subclass may derive them from other fields)."""
        missing = [f for f in FIELDS if f not in codes]
        if missing:
            raise ValueError(f"codes must hold {FIELDS}, missing {missing}")
        return codes["w_q"], codes["scales"], codes["biases"]

    def decode_rotated(self, codes: Dict[str, mx.array]) -> mx.array:
        """Stored arrays of n tokens -> float32 ``(B, H, n, d)`` reconstruction of ``Pi (x - mu)``."""
        w, s, b = self._affine(codes)
        return dequantize(w, s, b, self.group_size, self.bits)

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        xf = self.rotation.invert(self.decode_rotated(codes))
        if self.mean is not None:
            xf = xf + self.mean[None, :, None, :]
        return clamp_to(xf, dtype)

    # -- attention on codes -----------------------------------------------------------------------
    def decoded_offset(self) -> Optional[mx.array]:
        return self.mean

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """The codes as MLX affine fields per token (what the compiled attention reads)."""
        w, s, b = codes["w_q"], codes["scales"], codes["biases"]
        return AffineCodes(w, s, b, self.bits, self.group_size, False, self.rotation.matrix, self.mean)

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        q_rot = self.rotation.apply(q)
        if packed_matmul_ok(q.shape[2], packed_rows, CPU_PACKED_ROWS_SCORES):
            s = f32(mx.quantized_matmul(q_rot, *self._affine(codes), transpose=True, group_size=self.group_size,
                                        bits=self.bits))
        else:  # many rows (prefill chunk): dequantize once in the rotated domain, score with BLAS
            s = q_rot @ mx.swapaxes(self.decode_rotated(codes), -1, -2)
        if self.mean is not None:  # q . mu: one number per query row
            s = s + q @ mx.expand_dims(self.mean, -1)[None]
        return s

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        if packed_matmul_ok(p.shape[2], packed_rows, CPU_PACKED_ROWS_VALUES):
            o_rot = f32(mx.quantized_matmul(p, *self._affine(codes), transpose=False, group_size=self.group_size,
                                            bits=self.bits))
        else:
            o_rot = p @ self.decode_rotated(codes)
        o = self.rotation.invert(o_rot)
        if with_offset and self.mean is not None:
            o = o + mx.sum(p, axis=-1, keepdims=True) * self.mean[None, :, None, :]
        return o

    def __repr__(self):
        return (f"{type(self).__name__}(d={self.d}, bits={self.bits}, group_size={self.group_size}, seed={self.seed}, "
                f"rotation={self.rotation_kind!r}, center={self.center}, scale_dtype={self.scale_dtype_name!r})")
