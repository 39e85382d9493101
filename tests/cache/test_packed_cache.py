"""TurboQuantPackedCache / TurboQuantRotatingPackedCache on their own (no model)."""
from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.options import CacheOptions

CODE_BATCH = CacheOptions().code_batch  # the default

D = 16


def cfg(**kw):
    kw.setdefault("bit_width_inlier", 4)
    return KVCacheConfig(**kw)


def kv(B=1, H=2, T=8, d=D, seed=0, offset=0.0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, d)).astype(np.float32) + offset
    v = rng.standard_normal((B, H, T, d)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def assert_same_stored_tokens(a, b, rest, chunks):
    """``rest`` (keys, values) into ``a`` in one call and into ``b`` in ``chunks``: same history fetched."""
    whole = a.update_and_fetch(*rest)
    start = 0
    for T in chunks:
        got = b.update_and_fetch(rest[0][:, :, start : start + T], rest[1][:, :, start : start + T])
        start += T
    assert mx.allclose(whole[0], got[0], atol=1e-6) and mx.allclose(whole[1], got[1], atol=1e-6)


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
    from veloxquant_mlx.quantizers import TurboQuantMSE

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


# -- the rotating cache behaves like mlx_lm's RotatingKVCache ------------------------------------------
def attend(cache, q, k, v):
    """One attention call through a cache, with the mask the cache itself makes (as mlx_lm models do)."""
    mask = cache.make_mask(q.shape[2], window_size=None)
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)


@settings(max_examples=20, deadline=None)
@given(
    chunks=st.lists(st.sampled_from([1, 1, 1, 2, 3, 7]), min_size=1, max_size=12),
    max_size=st.integers(3, 9),
    keep=st.integers(0, 2),
)
def test_rotating_matches_mlx_lm_with_exact_windows(chunks, max_size, keep):
    # recent >= max_size keeps every token exact, so the outputs must match RotatingKVCache closely.
    ours = TurboQuantRotatingPackedCache(cfg(), max_size=max_size, keep=keep, recent=max_size + 8)
    ref = RotatingKVCache(max_size=max_size, keep=keep)
    for i, T in enumerate(chunks):
        k, v = kv(T=T, seed=i)
        q = kv(T=T, seed=100 + i)[0]
        out_ref = attend(ref, q, k, v)
        out = attend(ours, q, k, v)
        assert mx.allclose(out, out_ref, atol=1e-5), (i, T)
        assert ours.offset == ref.offset and ours.size() == ref.size()
        assert ours.is_trimmable() == ref.is_trimmable()


def test_rotating_keeps_its_window_coded():
    cache = TurboQuantRotatingPackedCache(
        cfg(bit_width_inlier=8), max_size=6, keep=2, sink=1, recent=2, trim_headroom=0
    )
    ks = []
    for i in range(12):
        k, v = kv(T=1, seed=i)
        ks.append(k)
        keys, _ = cache.update_and_fetch(k, v)
    expect = mx.concatenate(ks[:2] + ks[-4:], axis=2)  # keep 2 + newest 4
    assert keys.shape[2] == 6 and cache.size() == 6 and not cache.is_trimmable()
    assert mx.array_equal(keys[:, :, :1], expect[:, :, :1])  # sink: exact
    assert mx.array_equal(keys[:, :, -2:], expect[:, :, -2:])  # recent: exact
    assert rel_err(keys, expect) < 0.02  # the rest: 8-bit codes
    assert cache.n_coded == 3
    restored = TurboQuantRotatingPackedCache.from_state(cache.state)
    assert (restored.max_size, restored.keep, restored.offset) == (6, 2, 12)


# -- codec="affine_block": keys coded in whole blocks of tokens, K^T layout ----------------------------
DB = 32  # head dim for the affine codecs (their groups are 32, 64 or 128 wide); block = 32 tokens here


def block_cache(**kw):
    kw.setdefault("codec", "affine_block")
    return TurboQuantPackedCache(cfg(), **kw)


def test_block_codec_codes_whole_blocks_and_reads_the_rest_exactly():
    cache = block_cache(sink=1, trim_headroom=2)
    k, v = kv(T=100, d=DB, offset=0.5)
    keys, values = cache.update_and_fetch(k, v)
    # 99 non-sink tokens: 3 blocks of 32 coded once 2 (headroom) newer ones exist; 3 stay exact.
    assert (cache.rows.sink_n[0], cache.n_coded, cache.rows.tail_n[0]) == (1, 96, 3)
    assert cache.rows.k_codes.arrays["w_q"].shape == (1, 2, DB, 96 * 4 // 32)
    assert cache.rows.k_codes.arrays["scales"].shape == (1, 2, DB, 3)
    exact = [0, 97, 98, 99]
    assert mx.array_equal(keys[:, :, exact], k[:, :, exact]) and mx.array_equal(values[:, :, exact], v[:, :, exact])
    # 4-bit codes: measured 0.071 (keys) / 0.081 (values); 3 bits give 0.151 / 0.169, 5 bits 0.035 / 0.038.
    assert 0.05 < rel_err(keys[:, :, 1:97], k[:, :, 1:97]) < 0.1 and 0.05 < rel_err(values[:, :, 1:97], v[:, :, 1:97]) < 0.1
    arrays = [a for n, a in cache.state.items() if n != "meta"]
    assert cache.live_nbytes == sum(a.nbytes for a in arrays)


@settings(max_examples=10, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_block_codec_chunking_does_not_change_the_stored_tokens(chunks):
    # The codecs are fitted when the first block is coded (here by the first 60 tokens); after that, how
    # tokens arrive does not change what is stored.
    first, rest = kv(T=60, d=DB, seed=0), kv(T=sum(chunks), d=DB, seed=1)
    a, b = block_cache(sink=2), block_cache(sink=2)
    for c in (a, b):
        c.update_and_fetch(*first)
    assert_same_stored_tokens(a, b, rest, chunks)


@pytest.mark.parametrize("n", [1, 3, 20, 45, 200])
def test_block_codec_trim_into_the_codes_keeps_every_surviving_token(n):
    cache = block_cache(sink=2, trim_headroom=2)
    keys, values = cache.update_and_fetch(*kv(T=110, d=DB))
    assert cache.trim(n) == min(n, 110)
    left = 110 - min(n, 110)
    assert cache.offset == left == cache.rows.sink_n[0] + cache.n_coded + cache.rows.tail_n[0]
    assert cache.n_coded % 32 == 0 and cache.n_coded == cache.rows.k_codes.capacity == cache.k_codec.n_tokens(cache.rows.k_codes.arrays)
    if left:
        k2, v2 = cache._fetch(mx.float32)
        # Survivors of a cut block come back as their decoded values: the history reads as before.
        assert mx.allclose(k2, keys[:, :, :left], atol=1e-5) and mx.allclose(v2, values[:, :, :left], atol=1e-5)
    k3, _ = cache.update_and_fetch(*kv(T=70, d=DB, seed=3))
    assert k3.shape[2] == left + 70 and cache.n_coded % 32 == 0


def test_block_codec_state_round_trip_and_rotating_refusal():
    cache = block_cache(sink=1, recent=2)
    cache.update_and_fetch(*kv(B=2, T=75, d=DB))
    restored, twin = TurboQuantPackedCache.from_state(cache.state), copy.deepcopy(cache)
    nxt = kv(B=2, T=40, d=DB, seed=5)
    a, b, c = cache.update_and_fetch(*nxt), restored.update_and_fetch(*nxt), twin.update_and_fetch(*nxt)
    for x in (b, c):
        assert mx.array_equal(a[0], x[0]) and mx.array_equal(a[1], x[1])
    # Value codes grow a whole block at a time, so attention reads whole arrays (no slices): also after a restore.
    for x in (cache, restored, twin):
        assert x.n_coded == x.rows.v_codes.capacity == 96
        whole = x.rows.v_codes.folded(96)  # (two sequences folded into the heads: a reshape of each whole array)
        assert all(whole[n].shape == (1, 2 * a.shape[1]) + a.shape[2:] and whole[n].size == a.size
                   for n, a in x.rows.v_codes.arrays.items())
    with pytest.raises(ValueError, match="affine_block"):
        TurboQuantRotatingPackedCache(cfg(), max_size=64, codec="affine_block")


# ----------------------------------------------------------------------------- issue 47: a coded tail
def _budget(bits=4, codec="kblock_vsym8_pt"):
    from veloxquant_mlx.options import preset
    import dataclasses

    return dataclasses.replace(preset(f"tq-{bits}b"), codec=codec)


def test_budget_layout_stores_its_waiting_tokens_as_codes():
    """tq-4b's tokens waiting for their 128-token key block: keys as provisional per-token codes, values as the value
    codec's codes, which move unchanged into the value store when the block completes (no second rounding); the
    completed block's keys are coded from the provisional codes. Only the sink is held as floats."""
    from veloxquant_mlx.codecs.kblock_tail import provisional_bits

    k, v = kv(H=2, T=300, d=64, seed=3)
    cache = TurboQuantPackedCache(_budget(4), fetch_placeholders=False)
    cache.update_and_fetch(k[:, :, :200], v[:, :, :200])
    r = cache.rows
    assert (r.sink_n[0], cache.n_coded, r.tail_n[0]) == (1, 128, 71)
    assert r.tail.coder is not None and set(r.tail.raw.buffers) == {"k_w_q", "k_scales", "v_w_q", "v_scales"}
    assert all(a.dtype in (mx.uint32, mx.uint8) for a in r.tail.raw.buffers.values())
    assert r.tail.coder.k.bits == provisional_bits(4, type(r.k_codec).TAIL_EXTRA_BITS) > 4
    # the waiting values are the value codec's codes of the tokens, exactly
    want_v = r.v_codec.encode(v[:, :, 129:200])
    got = r.tail.live_arrays()
    assert all(mx.array_equal(got["v_" + f], a).item() for f, a in want_v.items())
    cache.update_and_fetch(k[:, :, 200:300], v[:, :, 200:300])
    assert (cache.n_coded, r.tail_n[0]) == (256, 43)
    # block 2 (tokens 129..256): values as coded on arrival; keys from the provisional codes' reconstruction
    blk_v = r.v_codec.encode(v[:, :, 129:257])
    stored_v = r.v_codec.slice_tokens(r.v_codes.arrays, 128, 256)
    assert all(mx.array_equal(stored_v[f], a).item() for f, a in blk_v.items())
    prov = r.tail.coder.k.decode(r.tail.coder.k.encode(k[:, :, 129:257]), mx.float32)
    blk_k = r.k_codec.encode(prov)
    stored_k = r.k_codec.slice_tokens(r.k_codes.arrays, 128, 256)
    assert all(mx.array_equal(stored_k[f], a).item() for f, a in blk_k.items())
    # attention on the stored form (codes and provisional codes) = attention over the decoded history
    hk, hv = cache.keys_and_values()
    assert rel_err(hk, k) < 0.12 and rel_err(hv, v) < 0.12  # (4-bit codes of Gaussian data: ~0.1)
    assert mx.array_equal(hk[:, :, :1], k[:, :, :1]).item()  # the sink is exact
    q = kv(H=2, T=1, d=64, seed=9)[0]
    ref = mx.fast.scaled_dot_product_attention(q, hk, hv, scale=0.125)
    assert rel_err(cache.attend_packed(q, 0.125, None), ref) < 1e-4


def test_coded_tail_costs_its_codes_not_floats():
    """At 2048 tokens (127 waiting) tq-Nb store at most their budget; the exact tail of the old layout did not."""
    from veloxquant_mlx.options import BUDGETS

    k, v = kv(H=3, T=2048, d=64, seed=1)
    for bits in (4, 3, 2):
        coded, exact = (TurboQuantPackedCache(_budget(bits, c)) for c in ("kblock_vsym8_pt", "kblock_vsym8"))
        for c in (coded, exact):
            for s in range(0, 2048, 256):
                c.update_and_fetch(k[:, :, s:s + 256], v[:, :, s:s + 256])
            assert c.rows.tail_n[0] == 127
        assert coded.bits_per_coordinate() <= BUDGETS[f"tq-{bits}b"] < exact.bits_per_coordinate() - 1.5
        tail_bytes = coded.rows.tail.nbytes
        assert tail_bytes < exact.rows.tail.nbytes / 4


def test_coded_tail_state_round_trip_trim_and_refusal():
    """A coded tail saves as codes (``t_k_*``, ``t_v_*``) and restores bit for bit; a trim into a coded block
    returns its survivors to the tail as provisional codes; a state holding an exact tail for this layout (or a coded
    one for the exact layout) is refused, naming what was expected."""
    k, v = kv(H=2, T=300, d=64, seed=4)
    cache = TurboQuantPackedCache(_budget(3))
    cache.update_and_fetch(k, v)
    state = cache.state
    assert {n for n in state if n.startswith("t_")} == {"t_k_w_q", "t_k_scales", "t_v_w_q", "t_v_scales"}
    back = TurboQuantPackedCache.from_state(state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys_and_values(), back.keys_and_values()))
    assert back.live_nbytes == cache.live_nbytes
    # an exact tail where codes are expected: refused clearly
    bad = {n: a for n, a in state.items() if not n.startswith("t_")}
    hk, hv = cache.keys_and_values()
    bad.update({"t_k": hk[:, :, -43:], "t_v": hv[:, :, -43:]})
    with pytest.raises(ValueError, match="stores the tokens waiting for their key block as codes"):
        TurboQuantPackedCache.from_state(bad)
    # trim 50: 43 tail tokens, then 7 of the last coded block; its 121 survivors wait again as provisional codes
    before = cache.keys_and_values()[0]
    assert cache.trim(50) == 50
    assert (cache.n_coded, cache.rows.tail_n[0]) == (128, 121)
    assert cache.rows.tail.coder is not None and set(cache.rows.tail.raw.buffers) >= {"k_w_q", "v_w_q"}
    after = cache.keys_and_values()[0]
    assert after.shape[2] == 250 and rel_err(after, before[:, :, :250]) < 0.12
    cache.update_and_fetch(k[:, :, 250:260], v[:, :, 250:260])
    assert (cache.n_coded, cache.rows.tail_n[0]) == (256, 3)
