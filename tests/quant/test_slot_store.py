"""`veloxquant_mlx.quant.slot_store`: named arrays sharing a token axis, grown in whole steps. Appending, trimming,
deleting, dropping and truncating keep the live tokens in order (checked against a plain list of tokens), copies
are independent, a reload refuses arrays that disagree on the token count, and a declared block layout is indexed
by whole blocks."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.slot_store import TOKEN_AXIS, SlotStore, fold, plain_layout, round_up


def _tokens(start, n, rows=2, heads=3, d=4):
    """Token t of row r, head h holds the value 1000 r + 100 h + t in every channel (readable, exact)."""
    t = np.arange(start, start + n, dtype=np.float32)
    a = 1000 * np.arange(rows)[:, None, None, None] + 100 * np.arange(heads)[None, :, None, None] + t[None, None, :, None]
    return mx.array(np.broadcast_to(a, (rows, heads, n, d)).copy())


def _ids(store, field="k"):
    return np.array(store.view()[field][0, 0, :, 0]).astype(int).tolist()


def test_helpers():
    assert [round_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    a = mx.arange(2 * 3 * 5).reshape(2, 3, 5)
    one = a[:1]
    assert fold(a).shape == (1, 6, 5) and fold(one) is one  # one sequence: already folded, no reshape
    assert plain_layout({"k": mx.zeros((2, 3, 7, 4), dtype=mx.float16)}) == {
        "k": (TOKEN_AXIS, 1, (1, 3, 1, 4), mx.float16)}


def test_append_grows_in_whole_steps_and_keeps_order():
    s = SlotStore(step=4)
    s.append({"k": _tokens(0, 3), "v": _tokens(0, 3) * 2})
    assert (s.length, s.capacity) == (3, 4)
    s.append({"k": _tokens(3, 1), "v": _tokens(3, 1) * 2})
    s.append({"k": _tokens(4, 2), "v": _tokens(4, 2) * 2})
    assert (s.length, s.capacity) == (6, 8) and _ids(s) == list(range(6))
    assert bool(mx.array_equal(s.view()["v"], _tokens(0, 6) * 2)) and s.view(2, 4)["k"].shape[2] == 2
    assert s.nbytes == 2 * (2 * 3 * 8 * 4 * 4)  # spare step capacity counts
    with pytest.raises(ValueError, match=r"chunk holds arrays \['k'\], the store holds \['k', 'v'\]"):
        s.append({"k": _tokens(6, 1)})
    assert s.trim(2) == 2 and _ids(s) == list(range(4)) and s.capacity == 8
    assert s.trim(10) == 4 and s.length == 0


def test_delete_drop_and_truncate():
    s = SlotStore(step=4)
    s.append({"k": _tokens(0, 10)})
    s.delete(2, 5)
    assert _ids(s) == [0, 1, 5, 6, 7, 8, 9] and s.capacity == 8
    s.delete(0, s.length)  # everything: the arrays are freed
    assert s.arrays == {} and s.length == 0
    s.append({"k": _tokens(0, 8)})
    s.drop(1, 3)  # slots of every row, by position
    assert s.capacity == 6 and np.array(s.arrays["k"][1, 2, :, 0]).astype(int).tolist() == [1200 + t for t in (0, 3, 4, 5, 6, 7)]
    s.truncate(1)
    assert s.capacity == 4


def test_copies_are_independent_and_reloads_are_checked():
    s = SlotStore(step=4)
    s.append({"k": _tokens(0, 3)})
    c = s.copy()
    c.append({"k": _tokens(100, 1)})
    s.append({"k": _tokens(200, 1)})
    assert _ids(c) == [0, 1, 2, 100] and _ids(s) == [0, 1, 2, 200]
    again = SlotStore.from_arrays(s.live_arrays(), step=4)
    assert again.length == 4 and _ids(again) == [0, 1, 2, 200]
    with pytest.raises(ValueError, match=r"stored arrays disagree on the token count: \[2, 3\]"):
        SlotStore().load({"k": _tokens(0, 3), "v": _tokens(0, 2)})


def test_a_block_layout_is_written_and_read_by_whole_blocks():
    # a field of 2 entries per block of 4 tokens on axis 3 (a transposed layout)
    layout = {"w": (3, 2, (1, 3, 5, 2), mx.uint32)}
    s = SlotStore(step=8, layout=layout, block=4)
    assert s.zeros(2, 8)["w"].shape == (2, 3, 5, 4) and s.n_tokens({}) == 0
    block = {"w": mx.full((1, 3, 5, 2), 7, dtype=mx.uint32)}
    s.write_row(1, 4, block, rows=2)  # row 1, tokens 4..8
    assert s.capacity == 8 and s.arrays["w"].shape == (2, 3, 5, 4)
    assert np.array(s.arrays["w"][1, 0, 0]).tolist() == [0, 0, 7, 7] and not np.any(np.array(s.arrays["w"][0]))
    assert s.row_view(1, 4, 8)["w"].shape == (1, 3, 5, 2) and s.row_view(1, 4, 8) is s.row_view(1, 4, 8)
    assert s.folded(8)["w"].shape == (1, 6, 5, 4)
    assert s.slice_tokens(s.arrays, 4, 8)["w"].shape == (2, 3, 5, 2)
