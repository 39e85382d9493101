"""``2**t`` for ``t <= 0`` from plain elementwise MLX ops: the softmax exponential of packed attention.

Why: on the Linux CPU build ``mx.exp`` runs near 20 ns per float32 element (scalar), so at decode the
softmax of a 4k-token history costs about as much as both attention matmuls together. Softmax only ever
needs ``exp(s - max) <= 1``; with scores kept in log2 units (the query pre-multiplied by ``log2(e)``)
that is ``2**t`` with ``t <= 0``, which splits into an exponent written straight into the float's bits
and a degree-4 polynomial for the fraction. Measured on decode-sized scores (docs/history/benchmarks-journal.md, 9 rows
of 4k / 16k): plain ops 4.3x / 5.7x faster than ``mx.exp``, fused by ``mx.compile`` 10.3x / 11.6x (not measured on GPUs).

Accuracy: the polynomial is a relative least-squares fit of ``2**f`` on ``[-1, 0]``; its relative error is
below 3e-6 (float32 rounding of ``t`` itself dominates for ``|t| > 30``), far inside the 1e-3 parity the
attention tests ask for. ``t <= -127`` (masked scores, ``-inf``) gives exactly 0.
"""
from __future__ import annotations

import mlx.core as mx

LOG2E = 1.4426950408889634  # 1 / ln 2: natural-log scores times this are log2 scores

# 2**f ~ c0 + c1 f + ... + c4 f^4 on f in [-1, 0] (relative error < 3e-6).
_COEFFS = (0.999997337, 0.693028198, 0.239331802, 0.0530599936, 0.00676030841)


def _exp2_parts(t: mx.array, estrin: bool = True):
    """The elementwise body: ``(2**f polynomial, float bits of 2**i as int32)`` for ``t``.

    ``estrin``: evaluate the polynomial by Estrin's scheme (a shallower chain, so ``mx.compile`` fuses it
    into fewer kernels: MLX caps a fused kernel's depth; fused, the journal's softmax probe at 4k went from
    8.0x to 10.3x faster than ``mx.exp``) rather than Horner's (fewer temporaries alive at once as plain
    ops: Estrin's raised the SmolLM2 4096-token prefill peak from 617.7 to 648.7 MiB,
    the prefill-peak probe's ``--estrin-prefill-exp`` in docs/history/benchmarks-journal.md).
    """
    t = mx.maximum(t, -127.0)
    i = t.astype(mx.int32)  # truncation toward zero: i >= t, so f = t - i is in (-1, 0]
    f = t - i
    if estrin:
        c0, c1, c2, c3, c4 = _COEFFS
        f2 = f * f
        p = (c0 + c1 * f) + f2 * ((c2 + c3 * f) + c4 * f2)
    else:
        p = _COEFFS[4]
        for c in _COEFFS[3::-1]:
            p = p * f + c
    return p, (i + 127) << 23


def exp2_nonpositive_reference(t: mx.array) -> mx.array:
    """The fused `exp2_nonpositive` as plain, uncompiled ops (the reference it is tested against)."""
    p, bits = _exp2_parts(t, estrin=True)
    return p * bits.view(mx.float32)


_fused = None  # mx.compile'd _exp2_parts once it has been checked to run here; False if it cannot


def _fused_parts():
    """`_exp2_parts` (Estrin) fused by ``mx.compile`` (a few kernels instead of ~14 ops), or None.

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
    polynomial. Same shape and dtype (float32) as ``t``. ``fused=False`` uses plain ops with Horner's scheme
    even where the fused kernel is available (same accuracy, values may differ in the last bit); a prefill chunk
    attended in several query blocks uses it because, with many blocks in one graph, the fused kernel's buffers
    raised the peak (SmolLM2, 4096 tokens: 643.0 vs 618.0 MiB, docs/history/benchmarks-journal.md).
    """
    if not fused:
        p, bits = _exp2_parts(t, estrin=False)
    else:
        kernel = _fused_parts()
        p, bits = kernel(t) if kernel is not None else _exp2_parts(t, estrin=True)
    return p * bits.view(mx.float32)
