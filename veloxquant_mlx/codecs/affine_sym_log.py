"""``kblock_vsym8``: the symmetric per-token values of ``kblock_vsym`` with each scale stored in one byte.

A value token's scale is a magnitude (no sign, no bias), so it keeps its relative precision on a logarithmic grid:

    scale = 2 ** ((code - LOG_OFFSET) / LOG_STEPS)      code in 1..254;  code 0 = scale 0 (an all-zero group)
                                                        code 255 = NaN (a group holding inf or NaN)

with ``LOG_STEPS = 8`` grid points per octave (9 % apart) over 31.625 octaves (2^-17.625 .. 2^14, clamped there).
A non-finite input keeps a non-finite token (it decodes NaN), never a finite one in its place. Coding searches the
grid points at and just below each group's max-abs scale (``CLIP_STEPS`` of them, the same clip ratios 1.0 .. 0.59
as ``kblock_vsym``'s search) for the least squared error, so the coarse grid costs little: measured on SmolLM2
(BENCHMARKS.md) the same KL as float16 scales. A token costs ``b + 8 / g`` bits
(4.125 at 4 bits, g = 64) instead of ``b + 16 / g``: with ``kblock_vsym``'s block keys (``b + 0.25``) the layout
takes ``b + 0.1875`` bits per coordinate, which leaves room in a ``b + 0.25`` budget for an exact first token
(the attention sink; see `veloxquant_mlx.cache.options`).

Attention is ``kblock_vsym``'s: the compiled kernel reads the one-byte scales through a 256-entry table (the same
grid, its constants checked when the module loads); the pure-MLX path decodes them to float32 (one small
``(B, H, n, 1)`` array per call) for `mx.quantized_matmul`.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs.affine_sym import SYM_FIELDS, AffineSymValueCodec, pack_codes
from veloxquant_mlx.codecs.contract import AffineCodes
from veloxquant_mlx.validate import check_heads

LOG_STEPS = 8  # grid points per octave
LOG_OFFSET = 142  # code of scale 1.0: codes 1..254 span 2^-17.625 .. 2^14
NON_FINITE = 255  # the scale code of a group holding inf or NaN
CLIP_STEPS = 7  # grid points tried per group, from the first at or above max|y| / c downwards (ratios 1 .. 0.59)


def decode_log_scales(codes: mx.array) -> mx.array:
    """uint8 scale codes ``(...)`` -> float32 scales (code 0 -> 0, code 255 -> NaN)."""
    s = mx.where(codes == 0, 0.0, mx.power(2.0, (codes.astype(mx.float32) - LOG_OFFSET) / LOG_STEPS))
    return mx.where(codes == NON_FINITE, float("nan"), s)


def log_scale_codes(y: mx.array, bits: int, group: int):
    """``(..., d)`` -> (integer level codes ``(..., d)``, uint8 scale codes ``(..., d/group)``): per group, the grid
    scale of the least squared error among the ``CLIP_STEPS`` grid points at and below ``max|y| / c``. A group of
    zeros gets scale code 0 (decodes to zeros); a group holding inf or NaN code ``NON_FINITE`` (decodes NaN)."""
    c = (2 ** bits - 1) / 2
    g = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
    amax = mx.max(mx.abs(g), axis=-1, keepdims=True)  # (..., groups, 1)
    top = mx.ceil(LOG_STEPS * mx.log2(mx.maximum(amax, 1e-30) / c)) + LOG_OFFSET
    bad = ~mx.isfinite(amax)
    top = mx.where(bad, LOG_OFFSET, top)
    cand = mx.clip(top[None] - mx.arange(CLIP_STEPS, dtype=mx.float32).reshape(-1, *([1] * top.ndim)), 1,
                   NON_FINITE - 1)
    s = mx.power(2.0, (cand - LOG_OFFSET) / LOG_STEPS)  # (R, ..., groups, 1)
    q = mx.clip(mx.round(g[None] / s + c), 0, 2 ** bits - 1)
    err = mx.sum(mx.square(s * (q - c) - g[None]), axis=-1, keepdims=True)
    best = mx.argmin(err, axis=0)[None]
    q = mx.take_along_axis(q, mx.broadcast_to(best, (1,) + q.shape[1:]), axis=0)[0]
    code = mx.take_along_axis(cand, best, axis=0)[0]
    code = mx.where(amax == 0, 0, mx.where(bad, NON_FINITE, code))
    q = mx.where(amax == 0, c, q)  # (the zero level: x = s * (q - c) = 0 whatever s)
    return q.reshape(y.shape), code[..., 0].astype(mx.uint8)


def reference_sym_log_encode(y: mx.array, bits: int, group: int):
    """`sym_log_encode` in MLX operations: `log_scale_codes`, the levels packed."""
    q, code = log_scale_codes(y, bits, group)
    return pack_codes(q, bits), code


# A decode step codes one token per row: there `log_scale_codes` and the packing (~40 small operations) cost ~0.3 ms
# per codec and layer in their dispatch, not their arithmetic; fused by mx.compile ~0.14 ms, compiled (below) one
# operation (a codec's whole encode of a token, its rotation included, ~40 us), the same codes bit for bit (tests/codecs/test_affine_sym_log.py). Without the compiled operation,
# longer chunks keep the plain operations (a 512-token chunk ran 15 % slower fused). mx.compile runs the operations
# unfused where it cannot build its kernels (no C++ compiler).
FUSED_TOKENS = 8


@functools.lru_cache(maxsize=None)
def _fused_sym_log_encode(bits: int, group: int):
    return mx.compile(functools.partial(reference_sym_log_encode, bits=bits, group=group))


# The compiled operation (`csrc/affine_encode.cpp`'s ``sym_log_encode``: the same arrays bit for bit, one operation):
# a callable returning it, or None when it may not run now; set by the cache layer as for `affine_encode`.
_compiled_provider: Optional[Callable[[], Optional[Callable]]] = None


def set_compiled_provider(provider: Optional[Callable[[], Optional[Callable]]]) -> None:
    global _compiled_provider
    _compiled_provider = provider


def sym_log_encode(y: mx.array, bits: int, group: int):
    """float32 ``y`` ``(..., d)`` -> ``(w_q uint32 (..., d*bits/32), uint8 scale codes (..., d/group))``:
    `log_scale_codes` packed, in one compiled operation where it can run (4-d float32 ``y``), else fused by
    mx.compile for a few tokens, else in plain operations."""
    d = y.shape[-1]
    if _compiled_provider is not None and y.ndim == 4 and y.dtype == mx.float32 and d <= 256 and \
            group in (32, 64, 128) and d % group == 0 and (d * bits) % 32 == 0 and bits in (2, 3, 4, 5, 6, 8):
        fn = _compiled_provider()
        if fn is not None:
            return tuple(fn(y, bits, group))
    few = y.size // d <= FUSED_TOKENS * (y.shape[1] if y.ndim == 4 else 1)  # (tokens per head)
    if few:
        return _fused_sym_log_encode(bits, group)(y)
    return reference_sym_log_encode(y, bits, group)


class AffineSymLogScaleValueCodec(AffineSymValueCodec):
    """`AffineSymValueCodec` whose per-group scales are one-byte log-grid codes ``{"w_q", "scales"}`` (uint8)."""

    def bytes_per_token_head(self) -> float:
        return self.d * self.bits / 8 + self.d // self.group_size

    def token_fields(self):
        return {"w_q": ((self.d * self.bits // 32,), mx.uint32), "scales": ((self.d // self.group_size,), mx.uint8)}

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        check_heads("x", x, self.d)
        w, code = sym_log_encode(self.rotate(x), self.bits, self.group_size)
        return {"w_q": w, "scales": code}

    @staticmethod
    def _fields(codes: Dict[str, mx.array]):
        """(w_q, uint8 scale codes); ValueError naming a missing field."""
        missing = [f for f in SYM_FIELDS if f not in codes]
        if missing:
            raise ValueError(f"codes must hold {SYM_FIELDS}, missing {missing}")
        return codes["w_q"], codes["scales"]

    def _affine(self, codes: Dict[str, mx.array]):
        w, code = self._fields(codes)
        s = decode_log_scales(code)
        return w, s, -self.zero * s

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """Symmetric fields per token with the scales as their uint8 codes (the compiled kernel reads the grid
        itself; `veloxquant_mlx.attention.kernel` decodes them with `decode_log_scales` for a kernel without it)."""
        w, code = self._fields(codes)
        return AffineCodes(w, code, None, self.bits, self.group_size, False, self.rotation.matrix, self.mean,
                           self.zero)


__all__ = ["AffineSymLogScaleValueCodec", "LOG_OFFSET", "LOG_STEPS", "NON_FINITE", "decode_log_scales",
           "log_scale_codes", "reference_sym_log_encode", "set_compiled_provider", "sym_log_encode"]
