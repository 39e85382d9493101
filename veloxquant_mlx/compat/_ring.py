"""Storage helpers of the standalone cache (:mod:`veloxquant_mlx.compat.turboquant_cache`): token rows in a ring
of ``capacity`` slots, and the int8 absmax codes of its values and outlier channels.

Token ``t`` lives in physical row ``t % capacity`` (``capacity=None``: row ``t``, no ring). A run of at most
``capacity`` consecutive tokens covers one or two contiguous row ranges, so reads and writes are one or two slices,
never one per row.
"""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.compat.constants import INT8_MAX


def int8_absmax(x: mx.array) -> tuple[mx.array, mx.array]:
    """Symmetric per-row int8 quantization: ``x (n, c) float32 -> codes (n, c) int8, scale (n,) fp16``.

    ``x ~= codes * scale`` with ``scale = absmax / 127`` rounded to float16. Codes are computed with
    the rounded scale, so dequantization uses exactly the stored numbers. A zero row gets scale 0
    and zero codes. A scale past the float16 range comes out inf; callers check it.
    """
    scale16 = (mx.max(mx.abs(x), axis=-1) / INT8_MAX).astype(mx.float16)
    s = scale16.astype(mx.float32)[..., None]
    nonzero = s > 0
    codes = mx.clip(mx.round(x / mx.where(nonzero, s, 1.0)), -INT8_MAX, INT8_MAX)
    return mx.where(nonzero, codes, 0).astype(mx.int8), scale16


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float16 -> "float16"`` (kept as a name: ``copy.deepcopy`` cannot copy an ``mx.Dtype``)."""
    return str(dtype).rsplit(".", 1)[-1]


def slot_ranges(capacity: int | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """Physical row ranges of logical tokens ``[lo, hi)`` (``hi - lo <= capacity``), in order.

    At most two ranges: a run of tokens wraps around the ring at most once.
    """
    if capacity is None:
        return [(lo, hi)]
    a = lo % capacity
    n = hi - lo
    if a + n <= capacity:
        return [(a, a + n)]
    return [(a, capacity), (0, a + n - capacity)]


def write_slots(buf: mx.array, capacity: int | None, lo: int, hi: int, rows: mx.array) -> mx.array:
    """Write ``rows`` (``hi - lo`` rows) at the slots of tokens ``[lo, hi)``; returns the buffer."""
    off = 0
    for a, b in slot_ranges(capacity, lo, hi):  # one or two contiguous pieces, never per row
        buf[a:b] = rows[off : off + b - a]
        off += b - a
    return buf


def read_slots(buf: mx.array, capacity: int | None, lo: int, hi: int) -> mx.array:
    """Rows of tokens ``[lo, hi)`` in logical order."""
    parts = [buf[a:b] for a, b in slot_ranges(capacity, lo, hi)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
