"""`affine_encode`: MLX affine codes of rotated vectors as the affine codecs store them, in one compiled operation
on CPU when the kernel is built (`csrc/affine_encode.cpp`), else in MLX operations (the reference, below).

Why: a decode step codes one 64-token block of one row at a time (12k numbers per layer); there the reference's
cost is its operations, not its arithmetic (~0.3 ms per layer for a block of keys: transpose, quantize, finiteness
check, offset, clamp). The compiled operation computes the same arrays bit for bit (tests/codecs/test_affine_encode.py), so
which path ran changes nothing a cache stores.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import mlx.core as mx

from veloxquant_mlx.codecs.common import clamp_all_to

Arrays = Tuple[mx.array, mx.array, mx.array]


def reference_affine_encode(y: mx.array, bits: int, group: int, scale_dtype, tokens_last: bool = False,
                            offset: Optional[mx.array] = None, quantize: Optional[Callable] = None) -> Arrays:
    """float32 ``y`` ``(B, H, T, d)`` -> ``(w_q, scales, biases)``, scales and biases in ``scale_dtype``.

    Per token (``tokens_last`` False): ``mx.quantize`` groups along d, arrays ``(B, H, T, ...)``. Per channel over
    tokens (True, affine_block's ``K^T`` layout): groups along T, arrays ``(B, H, d, ...)``; a group holding a
    non-finite value gets a NaN bias (its block decodes NaN, visibly) and ``offset`` ``(H, d)`` is added to every
    bias of its head and channel. ``quantize(y) -> (w_q, scales, biases)`` replaces ``mx.quantize``'s grid."""
    quantize = quantize or (lambda a: mx.quantize(a, group_size=group, bits=bits))
    if not tokens_last:
        w_q, scales, biases = quantize(y)
        return (w_q, *clamp_all_to(scale_dtype, scales, biases))
    y = mx.swapaxes(y, -1, -2)  # (B, H, d, T)
    w_q, scales, biases = quantize(y)
    finite = mx.all(mx.isfinite(y.reshape(*biases.shape, group)), axis=-1)
    biases = mx.where(finite, biases, mx.nan)
    if offset is not None:
        biases = biases + offset[None, :, :, None]  # (1, H, d, 1)
    return (w_q, *clamp_all_to(scale_dtype, scales, biases))


# Where the compiled operation comes from: a callable returning it, or None when it may not run now (kernel off,
# not built, another device). The codecs import no plumbing: the cache layer, the first that sees both the codecs
# and the kernel (`veloxquant_mlx.attention.kernel.compiled_encoder`), sets it where the caches code tokens
# (`veloxquant_mlx.cache.row_codes`); without it, or when it answers None, the reference runs (the same arrays).
_compiled_provider: Optional[Callable[[], Optional[Callable]]] = None


def set_compiled_provider(provider: Optional[Callable[[], Optional[Callable]]]) -> None:
    global _compiled_provider
    _compiled_provider = provider


def affine_encode(y: mx.array, bits: int, group: int, scale_dtype, tokens_last: bool = False,
                  offset: Optional[mx.array] = None) -> Arrays:
    """`reference_affine_encode` with ``mx.quantize``'s grid, in one compiled operation where it can run."""
    if _compiled_provider is not None and y.dtype == mx.float32 and scale_dtype in (mx.float16, mx.float32):
        fn = _compiled_provider()
        if fn is not None:
            off = None if offset is None else offset.astype(mx.float32)
            return tuple(fn(y, off, bits, group, tokens_last, scale_dtype == mx.float16))
    return reference_affine_encode(y, bits, group, scale_dtype, tokens_last, offset)
