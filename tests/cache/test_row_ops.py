"""Rows in, rows out (veloxquant_mlx.cache.row_ops): a batch's rows taken (`take_rows`, with the compiled gather or
``mx.take``), batches joined (`concat_rows`), one row's arrays as a saved state holds them (`row_arrays`) and back
(`rows_from_arrays`). Through the batch caches: tests/cache/test_batch_cache.py."""
from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.row_ops import concat_rows, row_arrays, rows_from_arrays, take_rows
from veloxquant_mlx.cache.row_policy import Rows
from _batch_cache_helpers import CONFIGS, _run_cache_level

OPTIONS = CacheOptions(codec="affine", k_bits=4, sink=2, recent=3).layer_options()


def _rows(n, seed, d=32):
    rows = Rows(OPTIONS, 1)
    k = mx.random.normal((1, 2, n, d), key=mx.random.key(seed))
    rows.append(k, k * 0.5)
    return rows


def _same_row(a: Rows, i: int, b: Rows, j: int) -> None:
    x, y = row_arrays(a, i), row_arrays(b, j)
    assert x.keys() == y.keys()
    for part in x:
        assert x[part].keys() == y[part].keys(), part
        for f in x[part]:
            assert mx.array_equal(x[part][f], y[part][f]).item(), (part, f)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_take_rows_is_the_same_with_the_compiled_gather_or_mx_take(name):
    """`take_rows` (extract / filter) gathers every array in one compiled operation where it runs; with the kernel
    off it takes each with ``mx.take``: the same arrays, rows, dtypes and shapes."""
    from veloxquant_mlx.attention import kernel
    from veloxquant_mlx.cache.row_ops import take_rows

    _, batch, _ = _run_cache_level(CONFIGS[name], (5, 70, 33, 2), decode_steps=3)
    for idx in ([2], [3, 0], [1, 2, 3]):
        on = take_rows(batch.rows, idx)
        previous = kernel.set_enabled(False)
        try:
            off = take_rows(batch.rows, idx)
        finally:
            kernel.set_enabled(previous)
        a, b = on.arrays(), off.arrays()
        assert len(a) == len(b) > 0
        assert all(x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y, equal_nan=True).item()
                   for x, y in zip(a, b)), idx


def test_a_row_s_arrays_are_its_saved_parts_and_build_the_same_row_back():
    rows = _rows(40, 0)
    arrays = row_arrays(rows, 0)
    assert (rows.sink_n, rows.coded, rows.tail_n) == ([2], [27], [11])
    assert arrays["sink"]["k"].shape == (1, 2, 2, 32) and arrays["tail"]["k"].shape == (1, 2, 11, 32)
    assert arrays["k_codes"]["w_q"].shape[2] == 27 and arrays["k_fit"]["mean"].shape == (2, 32)
    back = rows_from_arrays(OPTIONS, None, rows.dims, arrays, rows.lengths[0])
    assert (back.lengths, back.sink_n, back.coded, back.tail_n, back.fitted) == ([40], [2], [27], [11], [True])
    _same_row(back, 0, rows, 0)
    fresh = rows_from_arrays(OPTIONS, None, None, row_arrays(Rows(OPTIONS, 1), 0), 0)  # (nothing stored yet)
    assert fresh.dims is None and fresh.lengths == [0]


def test_concat_then_take_gives_each_row_back():
    one, two = _rows(40, 1), _rows(10, 2)
    both = concat_rows([one, two])
    assert (both.B, both.lengths, both.coded, both.tail_n) == (2, [40, 10], [27, 0], [11, 8])
    _same_row(both, 0, one, 0)
    _same_row(both, 1, two, 0)
    for i, alone in ((1, two), (0, one)):
        taken = take_rows(both, [i])
        assert taken.B == 1 and taken.lengths == alone.lengths
        _same_row(taken, 0, alone, 0)
    swapped = take_rows(both, [1, 0])
    _same_row(swapped, 0, two, 0)
    _same_row(swapped, 1, one, 0)
    # a copy of its own: later writes to the batch do not show in what was taken
    before = row_arrays(swapped, 1)["tail"]["k"]
    k = mx.ones((2, 2, 1, 32))
    both.append(k, k)
    assert mx.array_equal(row_arrays(swapped, 1)["tail"]["k"], before).item() and swapped.lengths == [10, 40]


def test_rows_of_other_head_dims_do_not_join():
    with pytest.raises(ValueError, match="caches to merge must share head dims and KV heads"):
        concat_rows([_rows(10, 3), _rows(10, 4, d=64)])
