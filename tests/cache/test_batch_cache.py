"""Batching compressed caches: `TurboQuantBatchPackedCache` against each sequence generated alone.

Two levels: the cache fed keys/values directly (bit-for-bit: the same codes, the same attention output per row,
pad tokens never coded nor attended), and tiny random mlx_lm models through mlx_lm's own batching
(``batch_generate``, ``BatchGenerator`` with sequences joining and leaving) after ``veloxquant_mlx.enable``.
Between a model run batched and alone, the model's own float32 ops may differ in the last bits (batched
matmuls), which can flip a code of a later layer: those comparisons are margin-aware.
"""
from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.attention.packed_sdpa import reference_one_query
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from _batch_cache_helpers import (
    CONFIGS,
    D,
    H,
    _stream,
    _states_equal,
    _run_cache_level,
    _join_cases,
    _arrays_reachable,
    _decode_both,
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_cache_holds_exactly_what_each_sequence_holds_alone(name):
    """Different lengths (pads at different places, rows crossing block boundaries on different steps): each row's
    codes, fitted parameters and exact windows equal its cache alone bit for bit (pad tokens never enter a block:
    the block scales see only the row's tokens), and attention per row matches."""
    options = CONFIGS[name]
    # (a coded tail is cache-wide: every row here has a block from the prompt on, see the test after this one)
    lengths = (130, 170, 140, 135, 200) if "_pt" in name else (5, 70, 33, 2, 100)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=40)
    assert max(diffs) < 1e-5, diffs
    assert batch.offset.tolist() == [c.offset for c in alone]
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


@pytest.mark.parametrize("lengths", [(60, 60, 60), (60, 31, 90)])
@pytest.mark.parametrize("name", ["token_lloyd8-k4v4", "token_lloyd8-k4v4-ro"])
def test_a_batch_codes_each_decode_token_of_every_row_in_one_call(name, lengths, monkeypatch):
    """Per-token codes coded on arrival: a batch's decode step codes every row's token in one encode and writes each
    at its row's next slot (rows at the same count: one write), holding what each row holds alone, bit for bit."""
    from veloxquant_mlx.quant.slot_store import SlotStore

    starts, original = [], SlotStore.write_rows
    monkeypatch.setattr(SlotStore, "write_rows",
                        lambda self, s, codes, rows: (starts.append(list(s)), original(self, s, codes, rows))[1])
    alone, batch, diffs = _run_cache_level(CONFIGS[name], lengths, decode_steps=12)
    assert max(diffs) < 1e-5, diffs
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    assert len(starts) == 2 * 12  # keys and values of every decode step, none through the tail
    assert all((min(s) == max(s)) == (len(set(lengths)) == 1) for s in starts)
    assert starts[-1] == [n + 11 - 1 for n in lengths]  # sink (1) out; the 12th token's slot


@pytest.mark.parametrize("name", ["kblock_vsym8_pt-k4v4", "kblock_vsym8_pt-k4v4-centred",
                                  "kblock_vsym8_pt-k4v4-centred-ro"])
def test_a_coded_tail_is_exact_until_some_row_codes_a_block(name):
    """A layout that codes the tokens waiting for their key block holds them exact while no row has coded a block
    (a short chat attends as mlx_lm's cache does), then coded for every row, the short rows included: a batch of
    short rows holds what each holds alone, exact; once a long row codes a block, the short rows' waiting tokens
    are coded too, and attention per row still reads exactly its stored tokens."""
    options = CONFIGS[name]
    alone, batch, diffs = _run_cache_level(options, (5, 20, 2), decode_steps=8)  # no row reaches a block (1 + 128)
    assert max(diffs) < 1e-5, diffs
    assert batch.rows.tail.coder is None and not any(batch.rows.coded)
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    exact = batch.rows.tail.nbytes
    alone, batch, _ = _run_cache_level(options, (5, 150, 2), decode_steps=8)
    assert batch.rows.tail.coder is not None and batch.rows.coded[1] and not batch.rows.coded[0]
    q = mx.array(np.random.default_rng(7).standard_normal((3, 2 * H, 1, D)), mx.float32)
    with use_packed_attention():
        got = batch.attend_packed(q, D ** -0.5, None)
    for i in range(3):  # each row reads exactly its own stored parts (its coded tail included)
        want = reference_one_query(q[i:i + 1], batch.rows.row_parts(i), D ** -0.5)
        assert mx.abs(got[i:i + 1] - want).max().item() < 1e-5
    assert mx.abs(got[:1] - alone[0].attend_packed(q[:1], D ** -0.5, None)).max().item() > 1e-6  # (coded, not exact)
    short = batch.extract(0)  # a short row taken out alone: no block, so its tail is exact again
    assert short.rows.tail.coder is None and short.offset == alone[0].offset
    assert batch.rows.tail.nbytes < exact  # coded: 3 rows' tails (one long) in fewer bytes than 3 short rows exact


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_nan_in_pad_positions_changes_nothing(name):
    options = CONFIGS[name]
    lengths = (9, 70, 40)
    _, clean, d_clean = _run_cache_level(options, lengths, decode_steps=5, pad_value=0.0)
    _, dirty, d_dirty = _run_cache_level(options, lengths, decode_steps=5, pad_value=float("nan"))
    assert max(d_dirty) < 1e-5 and d_dirty == d_clean
    for i in range(len(lengths)):
        _states_equal(dirty.extract(i), clean.extract(i))
    assert all(mx.all(mx.isfinite(a)).item() for a in dirty.rows.arrays() if mx.issubdtype(a.dtype, mx.floating))


def test_filter_extend_and_extract_keep_every_row_exact():
    options = CONFIGS["affine_block-k8v4"]
    alone, batch, _ = _run_cache_level(options, (5, 70, 33, 2), decode_steps=3)
    _, other, _ = _run_cache_level(options, (40, 90), decode_steps=3)
    batch.filter([3, 1])
    batch.extend(other)
    assert batch.offset.tolist() == [alone[3].offset, alone[1].offset, 43, 93]
    _states_equal(batch.extract(0), alone[3])
    _states_equal(batch.extract(1), alone[1])
    _states_equal(batch.extract(3), other.extract(1))


@pytest.mark.parametrize("name, window", list(_join_cases()))
def test_extend_concatenates_rows_as_a_re_merge_would(name, window):
    """`extend` joins two decoding batches by concatenating their arrays (stores padded to the larger one's slots,
    tails right-aligned): every row then holds what merging all rows' per-sequence caches gives, and attention
    over the next decode steps is the same."""

    options = CONFIGS[name]
    make = None if window is None else (lambda: TurboQuantRotatingPackedCache(options, max_size=window,
                                                                             keep=options.sink))
    _, a, _ = _run_cache_level(options, (5, 70, 2), decode_steps=3, make=make)
    _, b, _ = _run_cache_level(options, (90, 33), decode_steps=1, make=make)
    merged = type(a).merge([c.extract(i) for c in (a, b) for i in range(c.B)])
    joined = copy.deepcopy(a)
    joined.extend(copy.deepcopy(b))
    assert joined.B == merged.B == 5 and joined.offset.tolist() == merged.offset.tolist()
    for i in range(5):
        _states_equal(joined.extract(i), merged.extract(i))
    assert joined.nbytes == _arrays_reachable(joined)
    g = np.random.default_rng(3)
    with use_packed_attention():
        for step in range(70):  # crosses a 64-token block for every row
            k, v = (mx.array(g.standard_normal((5, H, 1, D)), mx.float32) for _ in range(2))
            q = mx.array(g.standard_normal((5, 2 * H, 1, D)), mx.float32)
            outs = []
            for c in (joined, merged):
                c.update_and_fetch(k, v)
                outs.append(c.attend_packed(q, D ** -0.5, None))
            assert mx.abs(outs[0] - outs[1]).max().item() < 1e-5, step
    for i in range(5):
        _states_equal(joined.extract(i), merged.extract(i))
    emptied = copy.deepcopy(a)
    emptied.filter([])  # every sequence finished: no rows, old arrays still held
    emptied.extend(copy.deepcopy(b))
    assert emptied.B == 2
    for i in range(2):
        _states_equal(emptied.extract(i), b.extract(i))


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_nbytes_counts_every_stored_array(name):
    lengths = (50, 300, 180)
    _, batch, _ = _run_cache_level(CONFIGS[name], lengths, decode_steps=3)
    assert batch.nbytes == _arrays_reachable(batch) > 0
    plain = 2 * len(lengths) * H * (max(lengths) + 3) * D * 4  # mlx_lm's BatchKVCache, float32, left-padded
    assert batch.nbytes < plain / 2.5


@pytest.mark.parametrize("name", ["affine-k4v4", "float16-nosink"])
def test_sliding_window_batch_evicts_per_sequence(name):
    """Windows of 24 tokens: rows of different lengths fill and evict on different steps; every row's window
    (codes, fitted parameters, sink) and attention equal its TurboQuantRotatingPackedCache alone."""
    options = CONFIGS[name]
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=24, keep=options.sink)  # noqa: E731
    lengths = (5, 40, 20, 2, 23)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=30, make=make)
    assert type(batch).__name__ == "TurboQuantBatchRotatingPackedCache"
    assert max(diffs) < 1e-5, diffs
    assert [c.size() for c in alone] == [24] * len(lengths)  # every row's window is full and has evicted
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    assert batch.nbytes == _arrays_reachable(batch)


def test_sliding_window_batch_drops_evicted_slots():
    options = CONFIGS["affine-k4v4"]
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=16, keep=4)  # noqa: E731
    alone, batch, diffs = _run_cache_level(options, (3, 30), decode_steps=600, make=make)
    assert max(diffs) < 1e-5
    # 633 tokens seen; evicted slots are dropped a step (256) at a time, so at most the window + 255 slots are held
    # (kept, they would need 768): for the batch and for each sequence alone
    assert batch.rows.k_codes.capacity <= 2 * 256
    assert all(c.rows.k_codes.capacity <= 2 * 256 for c in alone)
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


@pytest.mark.parametrize("sink, keep, recent", [(2, 4, 0), (0, 3, 0), (1, 4, 5)])
def test_sliding_window_batch_with_sink_other_than_keep(sink, keep, recent):
    """A window keeps its ``keep`` first tokens, of which only ``sink`` are exact: the others are codes the window
    never evicts (each row skips its own evicted codes after them). Rows equal their caches alone, bit for bit."""
    options = dataclasses.replace(CONFIGS["affine-k4v4"], sink=sink, recent=recent)
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=24, keep=keep)  # noqa: E731
    lengths = (5, 40, 20, 2, 23)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=30, make=make)
    assert max(diffs) < 1e-5, diffs
    assert [c.size() for c in alone] == [24] * len(lengths)  # every row's window is full and has evicted
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    assert batch.nbytes == _arrays_reachable(batch)
    assert _decode_both(alone, batch, 300, seed=7) < 1e-5  # past a dropped step of evicted slots
    assert batch.rows.k_codes.capacity <= 24 + 2 * 256
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4", "affine-recent", "affine_block-k8v4-recent",
                                  "kblock_vsym8-k4v4-ro", "kblock_vsym8_pt-k4v4-centred-ro", "token_lloyd8-k4v4-ro"])
def test_batch_trim_equals_each_sequence_trimmed(name):
    """``trim(n)`` (speculative decoding's rejected drafts) drops every row's ``n`` newest tokens exactly as each
    sequence alone does (a cut block's survivors back in the tail), and the rows go on decoding as alone."""
    options = CONFIGS[name]
    alone, batch, _ = _run_cache_level(options, (5, 70, 33, 2), decode_steps=3)
    for n in (1, 5, 40):
        assert batch.is_trimmable() and batch.trim(n) == n
        for c in alone:
            c.trim(n)
        assert batch.offset.tolist() == [c.offset for c in alone]
        for i, c in enumerate(alone):
            _states_equal(batch.extract(i), c)
        assert _decode_both(alone, batch, 3, seed=n) < 1e-5
    assert _decode_both(alone, batch, 70, seed=1) < 1e-5  # codes whole blocks again after the trims
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


def test_a_chunk_query_without_a_stored_chunk_is_refused_clearly():
    """Queries of several tokens attend the chunk just stored; a freshly merged batch (holding restored tokens) has
    none: a ValueError naming the queries, not a TypeError from unpacking nothing."""
    options = CONFIGS["affine_block-k8v4"]
    alone = []
    with use_packed_attention():
        for i, n in enumerate((30, 90)):
            c = TurboQuantPackedCache(options)
            c.update_and_fetch(*_stream(n, seed=i))
            alone.append(c)
        batch = TurboQuantPackedCache.merge(alone)
        q = mx.zeros((2, 2 * H, 3, D))
        with pytest.raises(ValueError, match="queries of L=3"):
            batch.attend_packed(q, D ** -0.5, "causal")
        assert batch.attend_packed(q[:, :, :1], D ** -0.5, None).shape == (2, 2 * H, 1, D)


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="options"):
        TurboQuantPackedCache.merge([TurboQuantPackedCache(k_bits=4), TurboQuantPackedCache(k_bits=3)])
    with pytest.warns(UserWarning, match="uncompressed while batched"):  # caches built to decode (MLA models)
        assert type(TurboQuantPackedCache.merge([TurboQuantPackedCache(fetch_placeholders=False)])).__name__ == \
            "BatchKVCache"
    with pytest.raises(ValueError, match="caches"):
        TurboQuantBatchPackedCache.merge([])
    _, batch, _ = _run_cache_level(CONFIGS["affine-k4v4"], (3, 9), decode_steps=1)
    with pytest.raises(ValueError, match="batch_indices"):
        batch.filter([0, 2])
    with pytest.raises(ValueError, match="idx"):
        batch.extract(5)
    with pytest.raises(ValueError, match="window_size"):
        batch.make_mask(1, window_size=0)
    with pytest.raises(ValueError, match="enable"):  # attention on codes only
        batch.update_and_fetch(mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D)))
    with use_packed_attention(), pytest.raises(ValueError, match="batch size"):
        batch.update_and_fetch(mx.zeros((3, H, 1, D)), mx.zeros((3, H, 1, D)))
