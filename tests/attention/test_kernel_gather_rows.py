"""The batch caches' row gather (veloxquant_mlx.attention.kernel.gather_rows): one compiled operation for every
array where the kernel runs, one ``mx.take`` each otherwise, the same rows either way. How `take_rows` uses it:
tests/cache/test_row_ops.py."""
from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.attention import kernel


def test_gather_rows_against_mx_take():
    """The compiled gather of rows (strided views, folded items, any dtype, empty axes, a broadcast array) equals
    ``mx.take``; a row out of range or a fold that does not divide the rows is a ValueError naming the array."""
    from veloxquant_mlx.attention import kernel

    mod = kernel.compiled_module()
    assert mod is not None and hasattr(mod, "gather_rows"), kernel.status()[1]
    a = mx.random.normal((5, 3, 40, 8), key=mx.random.key(1))
    words = (mx.random.uniform(shape=(5, 3, 8, 20), key=mx.random.key(2)) * 4e9).astype(mx.uint32)
    folded = mx.random.normal((15, 8), key=mx.random.key(3)).astype(mx.float16)
    arrays = [a, a[:, :, 10:30], mx.swapaxes(a, 2, 3), words[..., :12], folded, mx.arange(5), a[:, :, :0],
              mx.broadcast_to(folded[:1], (15, 8)), (a > 0)]
    folds = [1, 1, 1, 1, 3, 1, 1, 3, 1]
    for rows in ([3], [0, 4, 2], [1, 1], []):
        got = kernel.gather_rows(arrays, rows, folds)
        previous = kernel.set_enabled(False)
        try:
            want = kernel.gather_rows(arrays, rows, folds)
        finally:
            kernel.set_enabled(previous)
        for arr, f, g, w in zip(arrays, folds, got, want):
            ref = mx.take(arr, mx.array([r * f + j for r in rows for j in range(f)], dtype=mx.int32), axis=0)
            for out in (g, w):
                assert out.shape == ref.shape and out.dtype == ref.dtype and mx.array_equal(out, ref).item(), (rows, f)
    with pytest.raises(ValueError, match="out of range for array 0"):
        mod.gather_rows([a], [5], [1])
    with pytest.raises(ValueError, match="array 0 does not hold whole items"):
        mod.gather_rows([a], [0], [2])


def test_the_fallback_gathers_folded_items_in_row_order():
    """With the kernel off: item ``r`` of an array folded ``f`` times is its rows ``r*f .. r*f+f-1``, in the order
    the rows are asked for, each array its own copy."""
    folded = mx.arange(12).reshape(6, 2)  # 3 items of 2 rows each
    plain = mx.arange(3) * 10
    previous = kernel.set_enabled(False)
    try:
        got = kernel.gather_rows([folded, plain], [2, 0], [2, 1])
    finally:
        kernel.set_enabled(previous)
    assert got[0].tolist() == [[8, 9], [10, 11], [0, 1], [2, 3]]
    assert got[1].tolist() == [20, 0]
