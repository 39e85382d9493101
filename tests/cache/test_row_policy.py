"""`Rows`, the storage engine behind every packed cache (veloxquant_mlx.cache.row_policy): when tokens are coded
(the step of each layout, the exact window and trim headroom), a sliding window's eviction, trims back through tail,
codes and sink, copies and bytes. Through the caches: tests/cache/test_packed_cache*.py."""
from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.row_policy import CODE_STEP, Rows


def _kv(n, seed, d=32, B=1):
    return mx.random.normal((B, 2, n, d), key=mx.random.key(seed))


def _stored(rows, i=0):
    return rows.sink_n[i] + rows.coded[i] - rows.gone[i] + rows.tail_n[i]


@pytest.mark.parametrize("options,d,code_step,exact_keep,counts", [
    # per-token codes, exact window: coded as they leave the window and the trim headroom (3 + 8)
    (dict(codec="affine", k_bits=4, sink=2, recent=3), 32, 1, 11, ([2], [27], [11])),
    # per-token codes, no window: code_batch (16) at a time, nothing kept exact for trims
    (dict(codec="affine", k_bits=4, sink=2), 32, 16, 0, ([2], [32], [6])),
    # block keys: whole 64-token blocks beyond the trim headroom
    (dict(codec="affine_block", k_bits=8, v_bits=4, sink=4), 64, 64, 8, ([4], [128], [68])),
])
def test_what_is_coded_and_what_waits_exact(options, d, code_step, exact_keep, counts):
    rows = Rows(CacheOptions(**options).layer_options(), 1)
    n = 40 if d == 32 else 200
    k = _kv(n, 0, d)
    rows.append(k, k)
    assert (rows.code_step, rows.exact_keep) == (code_step, exact_keep)
    assert (rows.sink_n, rows.coded, rows.tail_n) == counts and rows.lengths == [n] and rows.fitted == [True]
    assert rows.dims == (d, d) and rows.heads == 2


def test_the_stored_tokens_do_not_depend_on_the_chunking():
    """Once the codecs are fitted (on the tokens before the first block is coded), blocks are counted from the
    first coded token: tokens arriving at once or in pieces are stored the same."""
    options = CacheOptions(codec="affine_block", k_bits=8, v_bits=4, sink=4).layer_options()
    k, v = _kv(230, 1, 64), _kv(230, 2, 64)
    whole, pieces = Rows(options, 1), Rows(options, 1)
    for rows in (whole, pieces):
        rows.append(k[:, :, :80], v[:, :, :80])  # (fitted here: 76 tokens after the sink, a block to code)
    assert whole.fitted == [True] and whole.coded == [64]
    whole.append(k[:, :, 80:], v[:, :, 80:])
    at = 80
    for size in (3, 61, 1, 1, 40, 44):
        pieces.append(k[:, :, at:at + size], v[:, :, at:at + size])
        at += size
    assert whole.coded == [192]
    assert (whole.sink_n, whole.coded, whole.tail_n) == (pieces.sink_n, pieces.coded, pieces.tail_n)
    parts = [whole.attention_parts(), pieces.attention_parts()]
    assert [type(p).__name__ for p in parts[0]] == [type(p).__name__ for p in parts[1]] == \
        ["ExactPart", "CodedPart", "ExactPart"]
    for a, b in zip(*parts):
        x, y = ({**p.k_arrays, **{"v_" + f: t for f, t in p.v_arrays.items()}} if hasattr(p, "k_arrays") else
                {"k": p.keys, "v": p.values} for p in (a, b))
        assert x.keys() == y.keys() and all(mx.array_equal(x[f], y[f]).item() for f in x)


def test_trim_walks_back_through_tail_codes_and_sink():
    rows = Rows(CacheOptions(codec="affine_block", k_bits=8, v_bits=4, sink=4).layer_options(), 1)
    k = _kv(203, 3, 64)
    rows.append(k, k)
    assert (rows.coded, rows.tail_n) == ([128], [71])
    rows.trim(75)  # the tail, then into the codes: a cut block's survivors return to the tail, decoded
    assert (rows.lengths, rows.sink_n, rows.coded, rows.tail_n) == ([128], [4], [64], [60])
    rows.trim(126)
    assert (rows.lengths, rows.sink_n, rows.coded, rows.tail_n) == ([2], [2], [0], [0])


def test_a_sliding_window_keeps_max_size_tokens_and_its_prefix():
    rows = Rows(CacheOptions(codec="affine", k_bits=4, sink=2).layer_options(), 1, window=(16, 4))
    assert rows.pin == 2  # code slots kept forever: keep - sink
    rows.append(_kv(30, 4), _kv(30, 5))  # a multi-token update keeps max_size - 1 old tokens, then adds its own
    assert rows.lengths == [30] and _stored(rows) == 30
    for t in range(5):
        rows.append(_kv(1, 10 + t), _kv(1, 20 + t))
        assert _stored(rows) == 16 and rows.lengths == [31 + t]
    assert rows.sink_n == [2] and rows.gone[0] > 0  # evicted codes are a hole after the kept prefix
    with pytest.raises(ValueError, match="cannot trim into the kept prefix of a sliding window"):
        rows.trim(20)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="keys have head_dim 32, but the cache was set up for head_dim=64"):
        Rows(CacheOptions(codec="affine", k_bits=4, head_dim=64).layer_options(), 1).append(_kv(3, 0), _kv(3, 1))
    batch = Rows(CacheOptions(codec="affine", k_bits=4).layer_options(), 2)
    batch.append(_kv(5, 0, B=2), _kv(5, 1, B=2))
    with pytest.raises(ValueError, match="Rows.trim trims one sequence"):
        batch.trim(1)


def test_a_copy_goes_on_alone_and_bytes_count_every_array():
    rows = Rows(CacheOptions(codec="affine", k_bits=4, sink=2, recent=3).layer_options(), 1)
    k = _kv(40, 6)
    rows.append(k, k)
    twin = rows.copy()
    twin.append(_kv(2, 7), _kv(2, 8))
    assert (rows.lengths, twin.lengths) == ([40], [42])
    assert rows.nbytes == sum(a.nbytes for a in rows.arrays()) > 0
    assert rows.k_codes.capacity == CODE_STEP  # (per-token codes grow CODE_STEP slots at a time)
