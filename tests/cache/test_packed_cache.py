"""TurboQuantPackedCache / TurboQuantRotatingPackedCache on their own (no model)."""
from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.compat.config import KVCacheConfig
from _packed_cache_helpers import CODE_BATCH, D, cfg, kv, rel_err, assert_same_stored_tokens


# -- basics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_fetch_shapes_dtype_and_growth(dtype):
    cache = TurboQuantPackedCache(cfg())
    assert cache.empty() and not hasattr(cache, "bits")
    for i, T in enumerate([5, 1, 300]):
        k, v = kv(T=T, seed=i, dtype=dtype)
        keys, values = cache.update_and_fetch(k, v)
    assert keys.shape == (1, 2, 306, D) and values.shape == (1, 2, 306, D)
    assert keys.dtype == dtype and values.dtype == dtype
    assert cache.offset == cache.size() == 306 and not cache.empty()
    assert cache.rows.v_codes.capacity == 512  # grown in whole steps of 256


@pytest.mark.parametrize("b", [2, 3, 4, 8])
def test_error_is_the_codebooks_at_each_bit_width(b):
    # Rotated unit-vector coordinates coded with the Lloyd-Max codebook: relative error sqrt(D_mse(b)), the
    # codebook's own prediction (measured within 3 % of it here); ±10 % keeps b-1 and b+1 bits out (≥ 1.9x apart).
    from veloxquant_mlx.quant.quantizers import TurboQuantMSE

    k, v = kv(B=2, T=64, seed=1)
    predicted = TurboQuantMSE(D, b).expected_d_mse ** 0.5
    keys, values = TurboQuantPackedCache(cfg(bit_width_inlier=b)).update_and_fetch(k, v)
    for err in (rel_err(keys, k), rel_err(values, v)):
        assert 0.9 * predicted <= err <= 1.1 * predicted, (err, predicted)


def test_key_and_value_bits_are_separate():
    k, v = kv(T=64, seed=2)
    keys, values = TurboQuantPackedCache(cfg(bit_width_inlier=8, v_bits=2)).update_and_fetch(k, v)
    assert rel_err(keys, k) < rel_err(values, v) / 4


def test_centering_helps_keys_with_a_common_offset():
    k, v = kv(T=128, seed=3, offset=4.0)  # every key shares a large mean, as real keys do
    plain, _ = TurboQuantPackedCache(cfg(bit_width_inlier=3), center_keys=False).update_and_fetch(k, v)
    cache = TurboQuantPackedCache(cfg(bit_width_inlier=3))
    centered, _ = cache.update_and_fetch(k, v)
    assert rel_err(centered, k) < rel_err(plain, k)
    assert cache.k_codec.mean.shape == (2, D)
    values_only = TurboQuantPackedCache(cfg(), center_keys=False)  # values still get their mean
    values_only.update_and_fetch(k, v)
    assert values_only.k_codec.mean is None and values_only.v_codec.mean.shape == (2, D)


def test_outlier_channels_are_the_high_energy_ones():
    k, v = kv(T=64, seed=4)
    big = mx.array([1.0] * D).at[mx.array([3, 11])].add(9.0)  # channels 3 and 11 are outliers
    cache = TurboQuantPackedCache(cfg(n_outlier_channels=2, outlier_bits=8), center_keys=False)
    keys, _ = cache.update_and_fetch(k * big, v)
    assert cache.k_codec.outliers.tolist() == [[3, 11], [3, 11]]
    no_outliers, _ = TurboQuantPackedCache(cfg(), center_keys=False).update_and_fetch(k * big, v)
    assert rel_err(keys, k * big) < rel_err(no_outliers, k * big)


def test_sink_and_recent_tokens_are_exact():
    cache = TurboQuantPackedCache(cfg(bit_width_inlier=2), sink=3, recent=4)
    ks, vs = [], []
    for i, T in enumerate([2, 5, 1, 1, 7]):
        k, v = kv(T=T, seed=10 + i)
        ks.append(k)
        vs.append(v)
        keys, values = cache.update_and_fetch(k, v)
    k_all, v_all = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
    n = k_all.shape[2]
    exact = list(range(3)) + list(range(n - 4, n))
    coded = [i for i in range(n) if i not in exact]
    assert mx.array_equal(keys[:, :, exact], k_all[:, :, exact])
    assert mx.array_equal(values[:, :, exact], v_all[:, :, exact])
    assert not mx.allclose(keys[:, :, coded], k_all[:, :, coded], atol=1e-3)
    # The tail also holds trim_headroom (8) older tokens, which read as coded ones.
    assert (cache.rows.sink_n[0], cache.n_coded, cache.rows.tail_n[0]) == (3, n - 3 - 12, 12)


def test_per_token_codes_without_exact_window_code_a_batch_at_a_time():
    # recent=0: whole CODE_BATCH batches are coded (counted from the first coded token, however the tokens came);
    # the newest ones wait exact, like a block codec's incomplete block; decode tokens join them one at a time.
    cache = TurboQuantPackedCache(cfg(), sink=2)
    k, v = kv(T=2 + 3 * CODE_BATCH + 5, seed=3)
    for lo, hi in ((0, 7), (7, 2 + CODE_BATCH + 1)) + tuple((t, t + 1) for t in range(2 + CODE_BATCH + 1, k.shape[2])):
        keys, values = cache.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
        n_after_sink = hi - 2
        assert (cache.rows.sink_n[0], cache.n_coded, cache.rows.tail_n[0]) == \
            (2, n_after_sink // CODE_BATCH * CODE_BATCH, n_after_sink % CODE_BATCH)
    n = k.shape[2]
    exact = [0, 1] + list(range(n - 5, n))
    assert mx.array_equal(keys[:, :, exact], k[:, :, exact]) and mx.array_equal(values[:, :, exact], v[:, :, exact])
    coded = slice(2, n - 5)
    assert 0.05 < rel_err(keys[:, :, coded], k[:, :, coded]) < 0.2
    # the codes equal those of the same tokens coded in one call (a per-token codec's codes do not depend on
    # which batch a token was coded in)
    whole = TurboQuantPackedCache(cfg(), sink=2)
    keys_whole, _ = whole.update_and_fetch(k[:, :, :7], v[:, :, :7])  # (the same first chunk: the same fit)
    keys_whole, _ = whole.update_and_fetch(k[:, :, 7:], v[:, :, 7:])
    assert mx.array_equal(keys_whole, keys)
    # code_batch=1: every token is coded on arrival, the same codes
    one = TurboQuantPackedCache(cfg(), sink=2, code_batch=1)
    one.update_and_fetch(k[:, :, :7], v[:, :, :7])
    for t in range(7, n):
        keys_one, _ = one.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert (one.n_coded, one.rows.tail_n[0]) == (t - 1, 0)
    assert mx.array_equal(keys_one[:, :, :n - 5], keys[:, :, :n - 5])
    assert not mx.array_equal(keys_one[:, :, n - 5:], k[:, :, n - 5:])


@settings(max_examples=15, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6), sink=st.integers(0, 4), recent=st.integers(0, 6))
def test_chunking_does_not_change_the_stored_tokens(chunks, sink, recent):
    # Once the codec is fitted (by the first chunk, longer than sink + recent), how tokens arrive (one
    # call or many) does not change what is stored.
    first = kv(T=16, seed=0)
    rest = kv(T=sum(chunks), seed=1)
    a = TurboQuantPackedCache(cfg(), sink=sink, recent=recent)
    b = copy.deepcopy(a)
    for c in (a, b):
        c.update_and_fetch(*first)
    assert_same_stored_tokens(a, b, rest, chunks)


def test_zero_keys_give_no_nan():
    cache = TurboQuantPackedCache(cfg(n_outlier_channels=2))
    z = mx.zeros((1, 2, 4, D))
    keys, values = cache.update_and_fetch(z, z)
    keys2, _ = cache.update_and_fetch(*kv(T=3))
    for x in (keys, values, keys2):
        assert not mx.isnan(x).any().item() and not mx.isinf(x).any().item()
    assert mx.array_equal(keys, z)


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_raises_value_errors_naming_the_problem():
    cache = TurboQuantPackedCache(cfg(head_dim=D))
    k, v = kv()
    with pytest.raises(ValueError, match="head_dim"):
        cache.update_and_fetch(k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="keys and values"):
        cache.update_and_fetch(k, v[:, :, :3])
    with pytest.raises(ValueError, match="float"):
        cache.update_and_fetch(k.astype(mx.int32), v)
    with pytest.raises(ValueError, match=r"\(B, H, T, d\)"):
        cache.update_and_fetch(k[0], v[0])
    with pytest.raises(TypeError, match="mx.array"):
        cache.update_and_fetch(np.zeros((1, 2, 3, D)), v)
    assert cache.empty()  # nothing was stored by the failed calls
    cache.update_and_fetch(k, v)
    with pytest.raises(ValueError, match="head_dim"):
        cache.update_and_fetch(k, v[..., :8])
    with pytest.raises(ValueError, match=r"\(B, H\)"):
        cache.update_and_fetch(*kv(B=2))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="bit_width_inlier"):
        KVCacheConfig(bit_width_inlier=9)
    with pytest.raises(ValueError, match="v_bits"):
        KVCacheConfig(v_bits=0)
    with pytest.raises(TypeError, match="KVCacheConfig"):
        TurboQuantPackedCache({"bit_width_inlier": 4})
    with pytest.raises(ValueError, match="recent"):
        TurboQuantPackedCache(cfg(), recent=-1)
    # Refused at construction, not at the first update.
    with pytest.raises(ValueError, match="n_outlier_channels"):
        TurboQuantPackedCache(cfg(n_outlier_channels=1))
    with pytest.raises(ValueError, match="n_outlier_channels"):
        TurboQuantPackedCache(cfg(head_dim=64, n_outlier_channels=63))
    with pytest.raises(ValueError, match="group_size"):
        TurboQuantPackedCache(cfg(), codec="affine", group_size=48)
    with pytest.raises(ValueError, match="k_bits"):
        TurboQuantPackedCache(k_bits=9)
    with pytest.raises(TypeError, match="k_bits"):
        TurboQuantPackedCache(k_bits=2.5)
    with pytest.raises(TypeError, match="k_bits"):
        TurboQuantPackedCache(k_bits="4")
    with pytest.raises(ValueError, match="sink"):
        TurboQuantRotatingPackedCache(cfg(), max_size=8, keep=2, sink=3)
    with pytest.raises(ValueError, match="keep"):
        TurboQuantRotatingPackedCache(cfg(), max_size=4, keep=5)


# -- trim, copy, state ------------------------------------------------------------------------------
def test_trim_walks_back_through_tail_codes_and_sink():
    cache = TurboQuantPackedCache(cfg(), sink=2, recent=3, trim_headroom=0)
    cache.update_and_fetch(*kv(T=10))
    assert cache.trim(4) == 4 and cache.offset == 6
    assert (cache.rows.sink_n[0], cache.n_coded, cache.rows.tail_n[0]) == (2, 4, 0)
    assert cache.trim(100) == 6 and cache.offset == 0 and cache.empty()
    keys, _ = cache.update_and_fetch(*kv(T=3))
    assert keys.shape[2] == 3 and cache.rows.sink_n[0] == 2


@pytest.mark.parametrize("n", [1, 3, 5])
def test_trim_within_headroom_restores_the_uninterrupted_state(n):
    # What speculative decoding does: append draft tokens, trim the rejected ones, append again.
    first, extra = kv(T=12), kv(T=n, seed=7)
    a = TurboQuantPackedCache(cfg(bit_width_inlier=2), sink=1, recent=3, trim_headroom=5)
    b = copy.deepcopy(a)
    a.update_and_fetch(*first)
    b.update_and_fetch(*first)
    b.update_and_fetch(*extra)
    assert b.trim(n) == n
    nxt = kv(T=2, seed=8)
    ka, va = a.update_and_fetch(*nxt)
    kb, vb = b.update_and_fetch(*nxt)
    assert mx.allclose(ka, kb, atol=1e-6) and mx.allclose(va, vb, atol=1e-6)
    assert mx.array_equal(ka[:, :, -3:], kb[:, :, -3:])  # the recent window is exact in both


def test_state_round_trip_and_deepcopy():
    cache = TurboQuantPackedCache(cfg(n_outlier_channels=4, v_bits=3), sink=1, recent=2)
    k, v = kv(B=2, T=9)
    ref = cache.update_and_fetch(k, v)
    restored = TurboQuantPackedCache.from_state(cache.state)
    twin = copy.deepcopy(cache)
    nxt = kv(B=2, T=1, seed=5)
    a, b, c = cache.update_and_fetch(*nxt), restored.update_and_fetch(*nxt), twin.update_and_fetch(*nxt)
    for x in (b, c):
        assert mx.array_equal(a[0], x[0]) and mx.array_equal(a[1], x[1])
    cache.update_and_fetch(*nxt)
    assert twin.offset == restored.offset == 10 and cache.offset == 11
    assert a[0].shape[2] == 10 and mx.array_equal(a[0][:, :, :9][:, :, :1], ref[0][:, :, :1])
    with pytest.raises(ValueError, match="meta"):
        TurboQuantPackedCache.from_state((k, v))


def test_state_of_an_empty_cache_round_trips():
    cache = TurboQuantPackedCache(cfg(), recent=2)
    restored = TurboQuantPackedCache.from_state(cache.state)
    assert restored.empty() and restored.recent == 2
    assert restored.update_and_fetch(*kv(T=3))[0].shape[2] == 3
