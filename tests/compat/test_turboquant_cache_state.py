"""TurboQuantKVCache, continued: ring buffer, pairing, reset/deepcopy, input checks, byte accounting and step growth."""
from __future__ import annotations

import collections
import copy
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.compat.methods import STANDALONE_METHODS
from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.compat.constants import CACHE_GROWTH_STEP
from _turboquant_cache_helpers import DATA_SEED, make, exact_attention, row_cosine, _outlier_keys, _per_token_formula


# ---------------------------------------------------------------- ring buffer


@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(1, 40),
    key_blocks=st.lists(st.integers(1, 57), min_size=1, max_size=6),
    lag=st.booleans(),
    method=st.sampled_from(sorted(STANDALONE_METHODS)),
    seed=st.integers(0, 1000),
)
def test_ring_order_matches_deque(capacity, key_blocks, lag, method, seed):
    """Blocks of odd sizes, wrapping around, keys interleaved with values or all keys first."""
    d = 32
    rng = np.random.default_rng(DATA_SEED + seed)
    total = sum(key_blocks)
    ks = rng.normal(size=(total, d)).astype(np.float32)
    vs = rng.normal(size=(total, d)).astype(np.float32)
    cache = make(method, d=d, b=4, capacity=capacity)
    ref_k = collections.deque(maxlen=capacity)
    ref_v = collections.deque(maxlen=capacity)
    start = 0
    for n in key_blocks:
        cache.append_key(mx.array(ks[start : start + n]))
        ref_k.extend(ks[start : start + n])
        if not lag:
            cache.append_value(mx.array(vs[start : start + n]))
        start += n
    if lag:  # values in different blocks, after every key
        cuts = sorted(set(rng.integers(0, total, size=3).tolist()) | {0, total})
        for a, b in zip(cuts[:-1], cuts[1:]):
            cache.append_value(vs[a:b])
    ref_v.extend(vs)
    assert len(cache) == len(ref_k) == min(total, capacity)
    assert cache.stored_rows() <= capacity
    want_v = np.stack(ref_v)
    got_v = np.array(cache.values())
    # int8 with an fp16 absmax/127 scale: error at most half a step per row (plus fp16 rounding).
    step = np.abs(want_v).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(got_v - want_v) <= 0.5 * step * 1.01 + 1e-6)
    want_k = np.stack(ref_k)
    got_k = np.array(cache.keys())
    sim = row_cosine(got_k[:, None, :], want_k[None, :, :])  # (n, n): each row matches its own key
    assert np.all(sim.argmax(axis=1) == np.arange(len(want_k)))
    q = rng.normal(size=(2, d)).astype(np.float32)
    s = np.array(cache.scores(q))
    assert s.shape == (2, len(ref_k))
    # Scores come out oldest-first, against the same keys keys() returns.
    np.testing.assert_allclose(s, q.astype(np.float64) @ got_k.astype(np.float64).T, rtol=1e-4, atol=1e-4)


def test_block_longer_than_capacity_keeps_its_last_rows():
    rng = np.random.default_rng(DATA_SEED + 6)
    x = rng.normal(size=(25, 16)).astype(np.float32)
    cache = make(d=16, capacity=7)
    cache.append_key(x)
    cache.append_value(x)
    assert len(cache) == 7 and cache.tokens_seen == 25
    np.testing.assert_allclose(np.array(cache.values()), x[-7:], atol=np.abs(x).max() / 127)


def test_block_append_equals_row_by_row():
    rng = np.random.default_rng(DATA_SEED + 7)
    x = rng.normal(size=(40, 32)).astype(np.float32)
    q = rng.normal(size=(3, 32)).astype(np.float32)
    block = make("turboquant_prod", d=32, b=3, capacity=29)
    block.append_key(x)
    block.append_value(x)
    rows = make("turboquant_prod", d=32, b=3, capacity=29)
    for r in x:
        rows.append_key(mx.array(r))
        rows.append_value(mx.array(r))
    np.testing.assert_allclose(np.array(block.attend(q)), np.array(rows.attend(q)), atol=1e-5)
    assert block.memory_bytes() == rows.memory_bytes()


def test_attend_shapes_and_dtypes():
    rng = np.random.default_rng(DATA_SEED + 8)
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        cache = make(d=32)
        x = mx.array(rng.normal(size=(10, 32)).astype(np.float32)).astype(dtype)
        cache.append_key(x)
        cache.append_value(x)
        assert cache.storage_dtype == dtype and isinstance(cache._storage_dtype_name, str)
        q = x[:3]
        out = cache.attend(q)
        assert out.shape == (3, 32) and out.dtype == dtype
        f32 = lambda a: np.array(mx.array(a).astype(mx.float32))  # noqa: E731
        ref, _ = exact_attention(f32(q), f32(cache.keys()), f32(cache.values()))
        np.testing.assert_allclose(f32(out), ref, atol=2e-2 if dtype != mx.float32 else 2e-5, rtol=1e-2)
        one = cache.attend(q[1])
        assert one.shape == (32,)
        np.testing.assert_allclose(np.array(one.astype(mx.float32)), np.array(out[1].astype(mx.float32)), atol=1e-2)
    empty = make(d=32)
    assert empty.attend(mx.zeros((32,))).shape == (32,)
    assert float(mx.abs(empty.attend(mx.ones((2, 32)))).sum()) == 0.0


# ---------------------------------------------------------------- pairing, reset, deepcopy


def test_pairing_rule():
    cache = make(d=16)
    x = np.ones((4, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="append the keys first"):
        cache.append_value(x[0])
    cache.append_key(x)
    cache.append_value(x[:3])
    with pytest.raises(ValueError, match="4 keys but 3 values"):
        cache.attend(x[0])
    with pytest.raises(ValueError, match="only 1 appended keys"):
        cache.append_value(x[:2])
    cache.append_value(x[3])
    # all-ones keys and values: any weighting of the 4 stored values gives ones (int8 values: exact for 1.0)
    np.testing.assert_allclose(np.array(cache.attend(x[0])), np.ones(16), atol=1e-3)


def test_reset_keeps_quantizer_and_restarts_calibration():
    rng = np.random.default_rng(DATA_SEED + 9)
    kw = dict(d=32, b=3, enable_outlier_two_stream=True, n_outlier_channels=2, n_calib_tokens=8)
    cache = make(**kw)
    quantizer = cache.quantizer
    a = _outlier_keys(rng, 20, 32, [4, 9], 20.0)
    cache.append_key(a)
    cache.append_value(a)
    assert cache.outlier_channels == [4, 9]
    cache.reset()
    assert len(cache) == 0 and cache.memory_bytes() == 0 and cache.tokens_seen == 0
    assert cache.quantizer is quantizer
    assert cache.outlier_channels is None and cache.storage_dtype is None
    b = _outlier_keys(rng, 20, 32, [11, 30], 20.0)
    cache.append_key(b)
    cache.append_value(b)
    assert cache.outlier_channels == [11, 30]
    fresh = make(**kw)
    fresh.append_key(b)
    fresh.append_value(b)
    q = rng.normal(size=(4, 32)).astype(np.float32)
    np.testing.assert_array_equal(np.array(cache.attend(q)), np.array(fresh.attend(q)))


def test_deepcopy_is_independent():
    rng = np.random.default_rng(DATA_SEED + 10)
    cache = make("turboquant_prod", d=32, b=3, capacity=12, enable_outlier_two_stream=True,
                 n_outlier_channels=2, n_calib_tokens=4)
    x = rng.normal(size=(9, 32)).astype(np.float32)
    cache.append_key(x)
    cache.append_value(x)
    q = rng.normal(size=(2, 32)).astype(np.float32)
    before = np.array(cache.attend(q))
    twin = copy.deepcopy(cache)
    np.testing.assert_array_equal(np.array(twin.attend(q)), before)
    y = rng.normal(size=(7, 32)).astype(np.float32)
    twin.append_key(y)  # wraps around in the copy only
    twin.append_value(y)
    assert len(cache) == 9 and len(twin) == 12
    np.testing.assert_array_equal(np.array(cache.attend(q)), before)
    assert not np.allclose(np.array(twin.attend(q)), before)
    cache.reset()
    assert len(twin) == 12


# ---------------------------------------------------------------- bad input


def test_bad_config():
    with pytest.raises(ValueError, match="method.*STANDALONE_METHODS|STANDALONE_METHODS.*method"):
        TurboQuantKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=16))
    with pytest.raises(ValueError, match="head_dim"):
        TurboQuantKVCache(KVCacheConfig(method="turboquant_mse"))
    with pytest.raises(TypeError, match="config"):
        TurboQuantKVCache({"method": "turboquant_mse", "head_dim": 16})
    with pytest.raises(ValueError, match="v_bits"):
        TurboQuantKVCache(KVCacheConfig(method="turboquant_mse", head_dim=16, v_bits=4))


@pytest.mark.parametrize(
    "bad, exc, word",
    [
        (np.ones((3, 17), np.float32), ValueError, "d=16"),
        (np.ones((2, 3, 16), np.float32), ValueError, "shape"),
        (np.ones((3, 16), np.int32), TypeError, "floating"),
        (mx.ones((3, 16), dtype=mx.int8), TypeError, "floating"),
        ([[1.0] * 16], TypeError, "mx.array or np.ndarray"),
        (np.full((2, 16), np.nan, np.float32), ValueError, "NaN"),
    ],
)
def test_bad_inputs_name_the_argument(bad, exc, word):
    cache = make(d=16)
    ok = np.ones((1, 16), np.float32)
    for name, call in (("k", cache.append_key), ("v", cache.append_value), ("q", cache.attend)):
        with pytest.raises(exc) as info:
            call(bad)
        assert str(info.value).startswith(name + " ") and word in str(info.value), str(info.value)
        if name == "k":
            cache.append_key(ok)  # so that v and q get past the pairing rule
        if name == "v":
            cache.append_value(ok)
    assert len(cache) == 1  # nothing was stored by the failed calls
    assert cache._n_values == 1


def test_value_too_large_for_fp16_scale_raises():
    cache = make(d=16)
    cache.append_key(np.ones((1, 16), np.float32))
    with pytest.raises(ValueError, match="v is too large"):
        cache.append_value(np.full((1, 16), 1e7, np.float32))


@pytest.mark.parametrize("method", sorted(STANDALONE_METHODS))
@pytest.mark.parametrize("b", [2, 3, 4])
@pytest.mark.parametrize("n_out", [0, 4])
def test_memory_bytes_formula(method, b, n_out):
    d, capacity = 128, 300
    cache = make(method, d=d, b=b, capacity=capacity, enable_outlier_two_stream=n_out > 0,
                 n_outlier_channels=n_out, n_calib_tokens=16)
    prod = method == "turboquant_prod"
    m = d if prod else 0  # m_default(d, b) = d in the contract; jl_dim not set
    b_mse = b - 1 if prod else b
    per_token = _per_token_formula(d, b_mse, m, n_out)
    rng = np.random.default_rng(DATA_SEED + 11)
    assert cache.memory_bytes() == 0
    total = 0
    for n in (1, 100, 257):  # 358 tokens: wraps around capacity 300
        x = rng.normal(size=(n, d)).astype(np.float32)
        cache.append_key(x)
        # The new keys' values are not there yet; older values still live are counted.
        live_values = max(0, total - (total + n - len(cache)))
        assert cache.memory_bytes() == len(cache) * (per_token - d - 2) + live_values * (d + 2)
        total += n
        cache.append_value(x)
        assert cache.memory_bytes() == len(cache) * per_token
        assert cache.memory_bytes() <= cache.allocated_bytes()
    assert len(cache) == capacity and cache.allocated_bytes() == cache.memory_bytes()


def test_memory_bytes_word_padding_when_not_multiple_of_32():
    # d * b = 100 * 3 = 300 bits -> 10 uint32 words = 40 bytes (the formula's ceil(300/8) = 38).
    cache = make("turboquant_mse", d=100, b=3)
    x = np.ones((5, 100), np.float32)
    cache.append_key(x)
    cache.append_value(x)
    assert cache.memory_bytes() == 5 * (4 * math.ceil(100 * 3 / 32) + 2 + 100 + 2)


def test_storage_grows_in_steps_and_never_preallocates_capacity():
    cache = make("turboquant_prod", d=64, b=3, capacity=10**6)
    assert cache.stored_rows() == 0 and cache.allocated_bytes() == 0
    rng = np.random.default_rng(DATA_SEED + 12)
    cache.append_key(rng.normal(size=(1, 64)).astype(np.float32))
    cache.append_value(rng.normal(size=(1, 64)).astype(np.float32))
    assert cache.stored_rows() == CACHE_GROWTH_STEP
    per_token = cache.memory_bytes()
    assert cache.allocated_bytes() == CACHE_GROWTH_STEP * per_token
    arrays = [*cache._k.values(), *cache._v.values()]
    assert arrays and all(a.shape[0] == CACHE_GROWTH_STEP for a in arrays)
    x = rng.normal(size=(300, 64)).astype(np.float32)
    cache.append_key(x)
    cache.append_value(x)
    assert cache.stored_rows() == 2 * CACHE_GROWTH_STEP
    assert all(a.shape[0] == 2 * CACHE_GROWTH_STEP for a in [*cache._k.values(), *cache._v.values()])
    small = make(d=64, capacity=300)
    small.append_key(np.ones((1000, 64), np.float32))
    assert small.stored_rows() == 300
