"""The standalone cache's storage helpers (`veloxquant_mlx.compat._ring`): int8 absmax codes that dequantize with
exactly the stored float16 scale, and ring slots -- token ``t`` in row ``t % capacity``, a run of tokens as one or
two contiguous ranges -- checked against a row-by-row ring."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.compat._ring import dtype_name, int8_absmax, read_slots, slot_ranges, write_slots
from veloxquant_mlx.compat.constants import INT8_MAX


def test_int8_absmax_codes_use_the_stored_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 12)).astype(np.float32) * rng.uniform(0.01, 100, (5, 1)).astype(np.float32)
    x[2] = 0.0
    codes, scale = int8_absmax(mx.array(x))
    assert codes.dtype == mx.int8 and scale.dtype == mx.float16 and scale.shape == (5,)
    c, s = np.array(codes).astype(np.float64), np.array(scale.astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(c) <= INT8_MAX) and s[2] == 0 and not np.any(c[2])
    s16 = np.float16(np.abs(x).max(axis=1) / INT8_MAX).astype(np.float64)
    np.testing.assert_array_equal(s, s16)
    nz = s > 0
    # codes are round(x / stored scale): each within half a step of x
    assert np.all(np.abs(c[nz] * s[nz, None] - x[nz]) <= 0.5 * s[nz, None] * (1 + 1e-6))
    _, big = int8_absmax(mx.array([[1e7, 0.0]]))  # past float16's range: inf, for the caller to refuse
    assert np.isinf(big.astype(mx.float32).item())


def test_dtype_name():
    assert [dtype_name(d) for d in (mx.float16, mx.bfloat16, mx.float32, mx.int8)] == \
        ["float16", "bfloat16", "float32", "int8"]


@pytest.mark.parametrize("capacity,lo,hi,want", [
    (None, 3, 9, [(3, 9)]), (8, 0, 8, [(0, 8)]), (8, 5, 8, [(5, 8)]), (8, 6, 11, [(6, 8), (0, 3)]),
    (8, 16, 20, [(0, 4)]), (8, 13, 21, [(5, 8), (0, 5)]), (4, 7, 7, [(3, 3)])])
def test_slot_ranges(capacity, lo, hi, want):
    assert slot_ranges(capacity, lo, hi) == want


@pytest.mark.parametrize("capacity", [None, 5])
def test_writes_and_reads_match_a_row_by_row_ring(capacity):
    rows = 5 if capacity else 40
    buf = mx.zeros((rows, 3))
    ref = np.zeros((rows, 3), dtype=np.float32)
    t = 0
    for n in (2, 4, 1, 5, 3):  # runs of at most `capacity` tokens
        block = np.arange(t, t + n, dtype=np.float32)[:, None] * np.ones((1, 3), dtype=np.float32)
        buf = write_slots(buf, capacity, t, t + n, mx.array(block))
        for i in range(n):
            ref[(t + i) % capacity if capacity else t + i] = block[i]
        t += n
        np.testing.assert_array_equal(np.array(buf), ref)
    lo = max(0, t - (capacity or t))
    got = np.array(read_slots(buf, capacity, lo, t))[:, 0]
    assert got.tolist() == list(range(lo, t))  # logical order, across the wrap
