"""The attention views of `Rows` (veloxquant_mlx.cache.row_views): the parts attention reads in temporal order, every
row folded with each row's slots masked (`attention_parts`, `part_masks`), one row alone (`row_parts`), and the same
part objects while the codes do not change."""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.row_ops import concat_rows
from veloxquant_mlx.cache.row_policy import Rows
from veloxquant_mlx.cache.row_views import RowViews

OPTIONS = CacheOptions(codec="affine", k_bits=4, sink=2, recent=3).layer_options()


def _rows(n, seed):
    rows = Rows(OPTIONS, 1)
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))
    rows.append(k, k * 0.5)
    return rows


def _decoded(parts):
    """Each part's keys and values, decoded to float32."""
    return [(p.keys, p.values) if isinstance(p, ExactPart) else
            (p.k_codec.decode(p.k_arrays, mx.float32), p.v_codec.decode(p.v_arrays, mx.float32)) for p in parts]


def test_a_sequence_s_parts_are_sink_codes_old_tail_and_recent_window():
    rows = _rows(40, 0)
    assert isinstance(rows, RowViews)
    parts = rows.attention_parts()
    # sink 2 exact | 27 coded | 8 tail tokens of the trim headroom, read through a round trip | the 3 recent exact
    assert [(type(p), p.length) for p in parts] == [(ExactPart, 2), (CodedPart, 27), (CodedPart, 8), (ExactPart, 3)]
    assert rows.part_sizes() == (2, 27, 11) and sum(p.length for p in parts) == rows.lengths[0]
    assert parts[1] is rows.attention_parts()[1]  # (the same coded part until the codes change)
    assert all(a.shape[:2] == (1, 2) for pair in _decoded(parts) for a in pair)


def test_a_batch_folds_its_rows_and_masks_each_row_s_slots():
    one, two = _rows(40, 1), _rows(10, 2)
    batch = concat_rows([one, two])
    parts = batch.attention_parts()
    assert [p.length for p in parts] == [2, 27, 8, 3]
    assert all(a.shape[:2] == (1, 4) for pair in _decoded(parts) for a in pair)  # (B*H heads of one row)
    masks = batch.part_masks()
    assert masks[0] is None  # both rows fill their sinks
    seen = [m.reshape(2, -1).astype(mx.int32).sum(axis=1).tolist() for m in masks[1:]]
    assert seen == [[27, 0], [8, 5], [3, 3]]  # codes, old tail, recent window: each row's own tokens
    same = concat_rows([one, _rows(40, 3)]).part_masks()  # rows of one length: no pad slot in sink, codes, old tail
    assert same is None or same[:3] == [None] * 3


def test_row_parts_are_the_sequence_alone():
    one, two = _rows(40, 4), _rows(10, 5)
    batch = concat_rows([one, two])
    for i, alone in enumerate((one, two)):
        got, want = batch.row_parts(i), alone.row_parts(0)
        assert [(type(p), p.length) for p in got] == [(type(p), p.length) for p in want]
        for (gk, gv), (wk, wv) in zip(_decoded(got), _decoded(want)):
            assert mx.array_equal(gk, wk).item() and mx.array_equal(gv, wv).item()
