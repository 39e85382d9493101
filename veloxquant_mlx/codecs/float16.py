"""``float16``: the trivial layout — tokens stored as float16, attention by plain matmuls.

A reference for the contract (and a baseline for the others): nothing is fitted, decode is a cast, and a
cache built with ``codec="float16"`` (``k_bits=16, v_bits=16``) reads exactly like mlx_lm's float16 cache.
"""
from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs.common import PerTokenLayout, clamp_to, f32
from veloxquant_mlx.validate import check_heads, check_int


class Float16Codec(PerTokenLayout):
    """``(B, H, T, d)`` -> ``{"x": float16 (B, H, T, d)}``."""

    BITS = (16,)
    OUTLIERS = False
    GROUP_SIZES = None

    def __init__(self, d: int, bits: int = 16):
        self.d = check_int("d", d, 1)
        self.bits = 16
        if bits != 16:
            raise ValueError(f"bits must be 16 for the float16 codec, got {bits}")

    @classmethod
    def from_options(cls, options, role: str, d: int) -> "Float16Codec":
        return cls(d, options.k_bits if role == "keys" else options.v_bits)

    # Nothing is fitted: `FittedParams`' defaults (`fitted_from` gives {}, `blank_fitted` too).
    def token_fields(self):
        return {"x": ((self.d,), mx.float16)}

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        check_heads("x", x, self.d)
        return {"x": clamp_to(f32(x), mx.float16)}

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        return codes["x"].astype(dtype)

    def decoded_offset(self) -> Optional[mx.array]:
        return None

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        return q @ mx.swapaxes(f32(codes["x"]), -1, -2)

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        return p @ f32(codes["x"])
