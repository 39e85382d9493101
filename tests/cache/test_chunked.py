"""`TurboQuantChunkedPackedCache` (veloxquant_mlx.cache.chunked), the compressed ``ChunkedKVCache`` of Llama 4's
chunked-attention layers: the same tokens, offsets and start positions as mlx_lm's own cache through prefill chunks and
decode steps (float16 codes of float16 tokens: exact), its saved state, and what it refuses. A model through it:
tests/apps/eval/test_architectures.py (Llama 4)."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ChunkedKVCache

from veloxquant_mlx.cache.chunked import TurboQuantChunkedPackedCache


def _tokens(n, seed, dtype=mx.float32):
    return tuple(mx.random.normal((1, 2, n, 16), key=mx.random.key(seed + i)).astype(dtype) for i in range(2))


def test_holds_what_mlx_lm_chunked_cache_holds():
    ours = TurboQuantChunkedPackedCache(chunk_size=8, codec="float16", k_bits=16)
    ref = ChunkedKVCache(8)
    k, v = _tokens(60, 0, mx.float16)
    at = 0
    for T in (5, 1, 1, 7, 1, 1, 1, 9, 1, 3, 12, 1):  # prompt chunks and decode steps across chunk boundaries
        for c in (ours, ref):
            c.maybe_trim_front()  # (what llama4's model calls before each forward pass)
        assert (ours.start_position, ours.offset) == (ref.start_position, ref.offset), at
        got = ours.update_and_fetch(k[:, :, at:at + T], v[:, :, at:at + T])
        want = ref.update_and_fetch(k[:, :, at:at + T], v[:, :, at:at + T])
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item(), (at, T)
        at += T
    ref.maybe_trim_front()  # (ours reports where the next update starts; mlx_lm's moves when it trims)
    assert (ours.start_position, ours.offset) == (ref.start_position, ref.offset) == (35, 43)


def test_a_window_of_chunk_size_plus_one_that_keeps_nothing():
    c = TurboQuantChunkedPackedCache(chunk_size=8, codec="affine", k_bits=4)
    assert (c.max_size, c.keep, c.chunk_size) == (9, 0, 8)
    assert c.is_trimmable() and c.start_position == 0
    c.update_and_fetch(*_tokens(8, 1))
    assert c.is_trimmable()  # (up to one chunk: nothing evicted yet)
    c.update_and_fetch(*_tokens(1, 2))
    assert not c.is_trimmable() and c.start_position == 1


def test_saved_state_keeps_the_chunk_size_and_continues_exactly():
    c = TurboQuantChunkedPackedCache(chunk_size=8, codec="affine", k_bits=4)
    k, v = _tokens(21, 3)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    r = TurboQuantChunkedPackedCache.from_state(c.state)
    assert type(r) is TurboQuantChunkedPackedCache and r.chunk_size == 8
    assert (r.offset, r.start_position) == (c.offset, c.start_position) == (20, 12)
    for a, b in zip(r.update_and_fetch(k[:, :, 20:], v[:, :, 20:]), c.update_and_fetch(k[:, :, 20:], v[:, :, 20:])):
        assert mx.array_equal(a, b).item()


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
        TurboQuantChunkedPackedCache(chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        TurboQuantChunkedPackedCache(chunk_size=None)
    with pytest.raises(ValueError, match="codes keys in blocks"):  # (the default's block keys cannot slide)
        TurboQuantChunkedPackedCache(chunk_size=8)
    one = TurboQuantChunkedPackedCache(chunk_size=8, codec="affine", k_bits=4)
    with pytest.raises(ValueError, match="does not batch"):
        TurboQuantChunkedPackedCache.merge([one, one])
