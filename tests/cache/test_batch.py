"""The batch caches' per-step state (veloxquant_mlx.cache._batch): each row's slots folded into the heads once per decode
step, and the sliding-window masks a batch cache makes for another window than its own. The batch caches against each
sequence alone: tests/cache/test_batch_cache.py and test_batch_cache_models.py."""
from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.cache import _batch
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantPackedCache
from veloxquant_mlx.cache.row_ops import concat_rows
from veloxquant_mlx.cache.row_policy import Rows

OPTIONS = CacheOptions(codec="affine", k_bits=4, sink=2, recent=3).layer_options()


def _rows(n, seed):
    rows = Rows(OPTIONS, 1)
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))
    rows.append(k, k)
    return rows


def test_part_masks_are_folded_per_head_and_made_once_per_step():
    batch = concat_rows([_rows(40, 0), _rows(10, 1)])
    masks = _batch._folded_part_masks(batch)
    assert masks[0] is None and [m.shape for m in masks[1:]] == [(1, 4, 1, 27), (1, 4, 1, 8), (1, 4, 1, 3)]
    per_head = masks[1].reshape(4, -1).astype(mx.int32).sum(axis=1).tolist()
    assert per_head == [27, 27, 0, 0]  # row 0's two heads hold 27 codes, row 1's none
    assert _batch._folded_part_masks(batch) is masks  # (the next layer of the same step)
    k = mx.random.normal((2, 2, 1, 32), key=mx.random.key(2))
    batch.append(k, k)
    after = _batch._folded_part_masks(batch)
    assert after is not masks and after[1].reshape(4, -1).astype(mx.int32).sum(axis=1).tolist() == [28, 28, 0, 0]


def test_a_mask_for_another_window_is_remembered_with_its_size():
    batch = TurboQuantPackedCache.merge([TurboQuantPackedCache(OPTIONS), TurboQuantPackedCache(OPTIONS)])
    assert type(batch) is TurboQuantBatchPackedCache
    assert batch.make_mask(1) is None and batch.make_mask(3) == "causal"  # (its own masks: what mlx_lm expects)
    mask = batch.make_mask(3, window_size=5)
    assert isinstance(mask, mx.array) and _batch._requested_window(mask) == 5
    assert _batch._requested_window(mx.array(mask)) is None and _batch._requested_window(None) is None
    with pytest.raises(ValueError, match="window_size"):
        batch.make_mask(3, window_size=0)


def test_only_the_latest_window_masks_are_kept():
    masks = [_batch._window_mask(mx.zeros((1,)), 10 + i) for i in range(12)]
    assert [_batch._requested_window(m) for m in masks] == [None] * 4 + list(range(14, 22))
