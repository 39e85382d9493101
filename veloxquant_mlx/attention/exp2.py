"""``2**t`` for ``t <= 0`` from plain elementwise MLX ops: the softmax exponential of packed attention.

Why: on the Linux CPU build ``mx.exp`` runs near 20 ns per float32 element (scalar), so at decode the
softmax of a 4k-token history costs about as much as both attention matmuls together. Softmax only ever
needs ``exp(s - max) <= 1``; with scores kept in log2 units (the query pre-multiplied by ``log2(e)``)
that is ``2**t`` with ``t <= 0``, which splits into an exponent written straight into the float's bits
and a degree-4 polynomial for the fraction. Measured here on decode-sized scores (benchmarks/softmax_exp.py, 9 rows
of 4k / 16k): plain ops 4.3x / 5.6x faster than ``mx.exp``, fused by ``mx.compile`` 8.0x / 8.6x (not measured on GPUs).

Accuracy: the polynomial is a relative least-squares fit of ``2**f`` on ``[-1, 0]``; its relative error is
below 3e-6 (float32 rounding of ``t`` itself dominates for ``|t| > 30``), far inside the 1e-3 parity the
attention tests ask for. ``t <= -127`` (masked scores, ``-inf``) gives exactly 0.
"""
from __future__ import annotations

import mlx.core as mx

LOG2E = 1.4426950408889634  # 1 / ln 2: natural-log scores times this are log2 scores

# 2**f ~ c0 + c1 f + ... + c4 f^4 on f in [-1, 0] (relative error < 3e-6).
_COEFFS = (0.999997337, 0.693028198, 0.239331802, 0.0530599936, 0.00676030841)


def _exp2_parts(t: mx.array):
    """The elementwise body: ``(2**f polynomial, float bits of 2**i as int32)`` for ``t``."""
    t = mx.maximum(t, -127.0)
    i = t.astype(mx.int32)  # truncation toward zero: i >= t, so f = t - i is in (-1, 0]
    f = t - i
    p = _COEFFS[4]
    for c in _COEFFS[3::-1]:
        p = p * f + c
    return p, (i + 127) << 23


def exp2_nonpositive_reference(t: mx.array) -> mx.array:
    """`exp2_nonpositive` as plain, uncompiled ops (the reference the fused version is tested against)."""
    p, bits = _exp2_parts(t)
    return p * bits.view(mx.float32)


_fused = None  # mx.compile'd _exp2_parts once it has been checked to run here; False if it cannot


def _fused_parts():
    """`_exp2_parts` fused by ``mx.compile`` (one kernel instead of ~14 ops; 1.5-1.8x faster on CPU), or None.

    MLX compiles CPU kernels with the system C++ compiler at run time; where that fails, the plain ops
    are used. Checked once per process on a tiny input.
    """
    global _fused
    if _fused is None:
        try:
            fn = mx.compile(_exp2_parts, shapeless=True)  # the view to float32 stays outside: not shapeless
            probe = mx.array([0.0, -0.5, -3.25, -200.0])
            p, bits = fn(probe)
            mx.eval(p, bits)
            ref_p, ref_bits = _exp2_parts(probe)
            _fused = fn if bool(mx.array_equal(bits, ref_bits)) and bool(mx.allclose(p, ref_p)) else False
        except Exception:  # no compiler, or a backend without compile support
            _fused = False
    return _fused or None


def exp2_nonpositive(t: mx.array, fused: bool = True) -> mx.array:
    """``2**t`` elementwise for float32 ``t <= 0`` (positive inputs are not supported: they overflow).

    ``t = i + f`` with ``i = trunc(t)`` (an int in [-127, 0]) and ``f`` in ``(-1, 0]``; ``2**i`` is built as
    the float whose exponent field is ``i + 127`` (0 for ``i = -127``, i.e. exactly zero), ``2**f`` by the
    polynomial. Same shape and dtype (float32) as ``t``. ``fused=False`` uses the plain ops even where the
    fused kernel is available: same values; prefill uses it because, with many query blocks in one graph,
    the fused kernel's buffers raised the peak (SmolLM2, 4096 tokens: 643.0 vs 618.0 MiB, benchmarks/prefill_peak.py).
    """
    kernel = _fused_parts() if fused else None
    p, bits = kernel(t) if kernel is not None else _exp2_parts(t)
    return p * bits.view(mx.float32)
