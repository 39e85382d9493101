"""`dequantize`: MLX's affine dequantization (``mx.dequantize``'s format and result) in a few fused ops on CPU.

Why: on the CPU build ``mx.dequantize`` is composed of graph operations, ~30 for 8-bit codes and ~50 for 4-bit
(shifts, masks and broadcasts per bit field), and every operation costs ~10 us there whatever its size; a prompt
chunk decodes each layer's keys and values once, so a 20-token chunk of SmolLM2 ran ~80 of its ~290 operations
per layer in dequantization. Here: the words viewed as bytes, the ``8 / bits`` fields of each byte cut by one
``mx.compile``'d elementwise function (shapeless: one trace per number of dimensions) that also scales and
offsets them: six operations whatever the width.

Layout read (MLX's affine format): ``w`` ``(..., W)`` uint32 holds ``n = 32 W / bits`` fields, field i at bits
``[i * bits, (i + 1) * bits)`` of the little-endian stream; ``scales`` / ``biases`` ``(..., n / group_size)``;
result ``(..., n)`` float32 ``field * scale + bias``. Widths that do not divide a byte (3, 5, 6 bits), other
devices (where ``mx.dequantize`` is one kernel) and a platform where the compiled function does not reproduce
``mx.dequantize`` on a probe take ``mx.dequantize`` itself.
"""
from __future__ import annotations

import threading

import mlx.core as mx

from veloxquant_mlx.codecs.common import f32

FUSED_BITS = (2, 4, 8)


def _fields(q: mx.array, s: mx.array, b: mx.array, bits: int) -> mx.array:
    """Bytes ``(..., G, m, 1)`` uint8 -> their fields ``(..., G, m, 8 / bits)`` float32, scaled and offset by
    ``s`` / ``b`` ``(..., G, 1, 1)`` (any float dtype)."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    if per_byte == 1:
        f = q
    else:
        f = mx.concatenate([(q >> (bits * j)) & mask if j else q & mask for j in range(per_byte)], axis=-1)
    return f.astype(mx.float32) * s.astype(mx.float32) + b.astype(mx.float32)


_compiled = {}  # bits -> compiled `_fields`, or False where it failed its probe
_lock = threading.Lock()  # tracing fills a compiled function's cache


def _kernel(bits: int):
    fn = _compiled.get(bits)
    if fn is None:
        fn = False
        try:
            cand = mx.compile(lambda q, s, b: _fields(q, s, b, bits), shapeless=True)
            w, s, b = mx.quantize(mx.linspace(-3.0, 2.0, 2 * 64).reshape(2, 64), group_size=32, bits=bits)
            if bool(mx.array_equal(_run(cand, w, s, b, 32, bits), mx.dequantize(w, s, b, group_size=32, bits=bits))):
                fn = cand
        except Exception:  # no compiler at run time, or a backend without compile support
            fn = False
        _compiled[bits] = fn
    return fn or None


def _run(fn, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    lead, n = tuple(w.shape[:-1]), w.shape[-1] * 32 // bits
    groups = n // group_size
    q = w.view(mx.uint8).reshape(lead + (groups, group_size * bits // 8, 1))
    s, b = (a.reshape(lead + (groups, 1, 1)) for a in (scales, biases))
    return fn(q, s, b).reshape(lead + (n,))


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize(w, scales, biases, group_size, bits)`` as float32 (scales / biases of any float dtype)."""
    if bits in FUSED_BITS and w.dtype == mx.uint32 and mx.default_device() == mx.cpu:
        with _lock:
            fn = _kernel(bits)
            if fn is not None:
                return _run(fn, w, scales, biases, group_size, bits)
    return mx.dequantize(w, f32(scales), f32(biases), group_size=group_size, bits=bits)
