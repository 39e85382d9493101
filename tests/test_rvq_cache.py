"""TurboQuantRVQKVCache: the seed's documented interface, storage and mlx_lm behaviour."""
from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
from veloxquant_mlx.config import KVCacheConfig

D = 32


def make(b=2, d=D, **kw):
    return TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=d, bit_width_inlier=b, **kw))


def kv(B=1, H=2, T=8, d=D, seed=0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((B, H, T, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, T, d)).astype(np.float32)).astype(dtype)
    return k, v


def rel_err(a, b):
    return (mx.linalg.norm((a - b).astype(mx.float32)) / mx.linalg.norm(b.astype(mx.float32))).item()


def test_interface_and_growth():
    cache = make()
    assert TurboQuantRVQKVCache.step == 256 and isinstance(cache, mlx_cache.KVCache)
    assert not hasattr(cache, "bits") and cache.assigned_bits == 2
    assert cache.empty() and cache.is_trimmable()
    for i, T in enumerate([3, 1, 260]):
        keys, values = cache.update_and_fetch(*kv(T=T, seed=i))
    assert keys.shape == values.shape == (1, 2, 264, D) and cache.offset == 264
    assert cache._store.capacity == 512


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_keys_coded_values_passed_through(dtype):
    k, v = kv(T=64, dtype=dtype)
    errs = []
    for b in (1, 2, 3):
        keys, values = make(b).update_and_fetch(k, v)
        assert keys.dtype == dtype and values.dtype == dtype
        errs.append(rel_err(keys, k))
        # Values are stored as float16 (bfloat16 for bfloat16 input): exact for these inputs' precision.
        assert rel_err(values, v) < 1e-3
    assert errs[0] > errs[1] > errs[2]


def test_bytes_match_the_documented_layout():
    b, T = 3, 10
    cache = make(b)
    cache.update_and_fetch(*kv(T=T))
    per_vector = 2 * math.ceil(D * b / 32) * 4 + 2  # two packed streams + bf16 norm
    assert cache.compressed_key_bytes == 2 * T * per_vector
    assert cache.fp16_key_bytes == 2 * T * D * 2
    held = sum(a.nbytes for a in cache._store.buffers.values())
    assert cache.nbytes == held
    saved = sum(a.nbytes for a in cache.state[:4])
    assert saved == 2 * T * (per_vector + 2 * D)  # + float16 values


def test_state_only_restore_meta_state_and_trim():
    cache = make(2)
    ref = cache.update_and_fetch(*kv(T=12))
    again = TurboQuantRVQKVCache.from_state(cache.state)  # what mlx_lm >= 0.32 does
    legacy = TurboQuantRVQKVCache.from_state(cache.state[:4], cache.meta_state)  # the seed's two-part form
    assert cache.meta_state == ("32", "2", "0", "12")
    nxt = kv(T=1, seed=3)
    outs = [c.update_and_fetch(*nxt) for c in (cache, again, legacy)]
    for k, v in outs[1:]:
        assert mx.array_equal(k, outs[0][0]) and mx.array_equal(v, outs[0][1])
    assert mx.array_equal(outs[0][0][:, :, :12], ref[0])
    assert cache.trim(5) == 5 and cache.offset == 8
    assert cache.update_and_fetch(*kv(T=2))[0].shape[2] == 10
    with pytest.raises(ValueError, match="meta_state"):
        TurboQuantRVQKVCache.from_state(cache.state[:4])


def test_deepcopy_is_independent():
    cache = make()
    cache.update_and_fetch(*kv(T=4))
    twin = copy.deepcopy(cache)
    cache.update_and_fetch(*kv(T=4, seed=1))
    assert twin.offset == 4 and twin._store.length == 4 and cache.offset == 8


def test_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=2))
    with pytest.raises(TypeError, match="KVCacheConfig"):
        TurboQuantRVQKVCache(None)
    cache = make()
    k, v = kv()
    with pytest.raises(ValueError, match="head_dim"):
        cache.update_and_fetch(k[..., :16], v)
    with pytest.raises(ValueError, match="keys and values"):
        cache.update_and_fetch(k, v[:, :1])
    with pytest.raises(ValueError, match="float"):
        cache.update_and_fetch(k.astype(mx.int8), v)
    with pytest.raises(ValueError, match="kv_bits"):
        cache.to_quantized()
    zero, _ = cache.update_and_fetch(mx.zeros_like(k), v)
    assert not mx.isnan(zero).any().item() and mx.array_equal(zero, mx.zeros_like(k))


def test_generation_through_mlx_lm_mask_and_sdpa():
    # No ``bits`` attribute: mlx_lm must use the ordinary SDPA path with the dequantized keys.
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, rms_norm_eps=1e-5))
    plain = mlx_cache.make_prompt_cache(model)
    ours = [make(3, d=16) for _ in model.layers]
    prompt = mx.array([[1, 5, 9, 2, 7, 3]])
    a, b = model(prompt, cache=plain), model(prompt, cache=ours)
    assert a.shape == b.shape and mx.allclose(a, b, atol=0.05 * a.abs().max().item())
    assert ours[0].make_mask(1) is None and ours[0].make_mask(3) == "causal"
    step = mx.array([[4]])
    assert model(step, cache=ours).shape == (1, 1, 128) and ours[0].offset == 7


# --- issue 15: states that do not add up, bad trims, shape changes ------------------------------------
import json  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _filled(T=7, b=2):
    cache = make(b)
    cache.update_and_fetch(*kv(T=T))
    return cache


def test_seed_meta_state_offset_must_match_the_arrays():
    cache = _filled(7)
    meta = cache.meta_state
    for bad in ("999", "6", "8"):
        with pytest.raises(ValueError, match="offset"):
            TurboQuantRVQKVCache.from_state(cache.state[:4], meta[:3] + (bad,))
    for bad in ("-1", "x", "2.5", None):
        with pytest.raises(ValueError, match="offset"):
            TurboQuantRVQKVCache.from_state(cache.state[:4], meta[:3] + (bad,))
    with pytest.raises(ValueError, match="meta_state"):
        TurboQuantRVQKVCache.from_state(cache.state[:4], meta[:3])


def test_tampered_bits_refused_by_the_word_count():
    cache = _filled(7, b=4)  # d=32, 4 bits: 4 words per stream; 2 bits would be 2 words
    meta = cache.meta_state
    with pytest.raises(ValueError, match="indices"):
        TurboQuantRVQKVCache.from_state(cache.state[:4], (meta[0], "2", meta[2], meta[3]))
    m = json.loads(cache.state[4])
    m["config"]["bit_width_inlier"] = 2
    with pytest.raises(ValueError, match="config_digest"):
        TurboQuantRVQKVCache.from_state(cache.state[:4] + (json.dumps(m),))
    del m["config_digest"]  # without the checksum the word count still catches it
    with pytest.raises(ValueError, match="indices"):
        TurboQuantRVQKVCache.from_state(cache.state[:4] + (json.dumps(m),))


def test_tampered_offset_in_the_json_meta():
    cache = _filled(7)
    m = json.loads(cache.state[4])
    for bad in (107, -1, "7", 7.0):
        m["offset"] = bad
        with pytest.raises(ValueError, match="offset"):
            TurboQuantRVQKVCache.from_state(cache.state[:4] + (json.dumps(m),))


@pytest.mark.parametrize("i,field", list(enumerate(("indices", "indices2", "norms", "values"))))
def test_missing_or_wrong_shaped_array_named(i, field):
    cache = _filled(7)
    st_ = list(cache.state)
    missing = st_[:i] + [None] + st_[i + 1:]
    with pytest.raises(ValueError, match=field):
        TurboQuantRVQKVCache.from_state(tuple(missing))
    a = st_[i]
    for bad in (a[:, :, :5], a[:1, :1], a.astype(mx.int32)):
        shaped = st_[:i] + [bad] + st_[i + 1:]
        with pytest.raises(ValueError, match=field):
            TurboQuantRVQKVCache.from_state(tuple(shaped))
    with pytest.raises(TypeError, match=field):
        TurboQuantRVQKVCache.from_state(tuple(st_[:i] + [[1, 2, 3]] + st_[i + 1:]))


@pytest.mark.parametrize("state,err,word", [
    (5, TypeError, "state"), ("abc", TypeError, "state"), ((1, 2), ValueError, "state"),
    ((None, None, None, None, "x"), ValueError, "JSON"),
    ((None, None, None, None, '{"meta": "x"}'), ValueError, "config"),
    ((None, None, None, None, '[1]'), ValueError, "config"),
])
def test_from_state_garbage_named(state, err, word):
    with pytest.raises(err, match=word):
        TurboQuantRVQKVCache.from_state(state)


def test_empty_state_round_trips_and_claims_no_tokens():
    cache = make()
    again = TurboQuantRVQKVCache.from_state(cache.state)
    assert again.offset == 0 and again.empty()
    m = json.loads(cache.state[4])
    m["offset"] = 3
    with pytest.raises(ValueError, match="offset"):
        TurboQuantRVQKVCache.from_state(cache.state[:4] + (json.dumps(m),))


@pytest.mark.parametrize("n,err", [(-1, ValueError), (2.5, TypeError), ("2", TypeError), (None, TypeError),
                                   (True, TypeError)])
def test_trim_refuses_non_counts(n, err):
    cache = _filled(7)
    with pytest.raises(err, match="n must be an int"):
        cache.trim(n)
    assert cache.offset == 7 and cache._store.length == 7


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 20))
def test_trim_valid_counts(n):
    cache = _filled(7)
    assert cache.trim(n) == min(n, 7) and cache.offset == 7 - min(n, 7)
    assert cache.trim(np.int64(0)) == 0


def test_batch_or_head_change_between_updates_is_a_clear_error():
    cache = _filled(4)
    for B, H in ((2, 2), (1, 1)):
        with pytest.raises(ValueError, match="batch"):
            cache.update_and_fetch(*kv(B=B, H=H, T=1))
    k, v = kv(T=1)
    with pytest.raises(ValueError, match="value dim"):
        cache.update_and_fetch(k, mx.concatenate([v, v], axis=-1))
    assert cache.offset == 4
    assert cache.update_and_fetch(*kv(T=1))[0].shape == (1, 2, 5, D)


def test_first_update_with_zero_tokens_is_a_clear_error():
    cache = make()
    with pytest.raises(ValueError, match="keys must hold at least one token"):
        cache.update_and_fetch(*kv(T=0))
    assert cache.empty()
