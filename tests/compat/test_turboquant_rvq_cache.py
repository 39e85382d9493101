"""TurboQuantRVQKVCache: the seed's documented interface, storage and mlx_lm behaviour."""
from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache
from veloxquant_mlx.compat.config import KVCacheConfig

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
        cache = make(b)
        keys, values = cache.update_and_fetch(k, v)
        assert keys.dtype == dtype and values.dtype == dtype  # fetched in the keys' dtype, for mlx_lm's SDPA
        assert cache.state[3].dtype == mx.float16  # stored as plain float16, whatever came in
        errs.append(rel_err(keys, k))
        # float16 keeps 11 significant bits: exact for float16 and bfloat16 input, 2^-11 relative for float32.
        assert rel_err(values, v) < (1e-3 if dtype == mx.float32 else 1e-7)
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_values_stored_as_float16_below_half_a_float32_kvcache(dtype):
    """The documented storage: values "pass through as plain fp16" (2 bytes each, bfloat16 input too) and keys
    packed, so the whole cache holds less than half of what mlx_lm's float32 KVCache holds for the same tokens
    (same step growth: 300 tokens fill 512 rows in both)."""
    d, T = 64, 300
    k, v = kv(T=T, d=d, dtype=dtype)
    cache, plain = make(2, d=d), mlx_cache.KVCache()
    cache.update_and_fetch(k, v)
    plain.update_and_fetch(k.astype(mx.float32), v.astype(mx.float32))
    assert cache._store.buffers["values"].dtype == mx.float16
    values_bytes = cache._store.buffers["values"].nbytes
    assert values_bytes == plain.values.nbytes // 2  # float16 against float32, same rows
    assert cache.nbytes < plain.nbytes / 2, (cache.nbytes, plain.nbytes)


@pytest.mark.parametrize("dtype,bad", [(mx.float32, 7e4), (mx.float32, -65505.0), (mx.bfloat16, 7e4),
                                       (mx.float32, float("inf")), (mx.float16, float("-inf")),
                                       (mx.float32, float("nan")), (mx.bfloat16, float("nan"))])
def test_values_beyond_float16_range_refused(dtype, bad):
    """A value float16 cannot hold would be stored as inf (or NaN): refused, naming values and the range,
    before anything is stored."""
    cache = make()
    cache.update_and_fetch(*kv(T=3))
    k, v = kv(T=2, seed=1)
    v = mx.where(mx.arange(D) == 5, mx.array(bad, dtype=mx.float32), v).astype(dtype)
    with pytest.raises(ValueError, match=r"values must be finite and within float16's range \[-65504, 65504\]"):
        cache.update_and_fetch(k.astype(dtype), v)
    assert cache.offset == 3 and cache._store.length == 3
    top = 65280.0 if dtype == mx.bfloat16 else 65504.0  # the largest value <= 65504 the input dtype holds
    _, values = cache.update_and_fetch(k.astype(dtype), mx.full(v.shape, -top, dtype=dtype))
    assert values[:, :, 3:].min().item() == -top  # float16's range edge is stored as is


def test_bytes_match_the_documented_layout():
    b, T = 3, 10
    cache = make(b)
    cache.update_and_fetch(*kv(T=T))
    per_vector = 2 * math.ceil(D * b / 32) * 4 + 2  # two packed streams + bf16 norm
    assert cache.compressed_key_bytes == 2 * T * per_vector
    assert cache.fp16_key_bytes == 2 * T * D * 2
    held = sum(a.nbytes for a in cache._store.buffers.values())
    assert cache.nbytes == held
    saved = sum(a.nbytes for a in cache.state)
    assert saved == 2 * T * (per_vector + 2 * D)  # + float16 values


def test_state_is_four_arrays_and_meta_state_four_strings():
    """The documented layout: state (packed1, packed2, norms, values), meta_state (head_dim, bits, seed,
    offset) as strings; nothing else rides along."""
    cache = make(3, seed=7)
    cache.update_and_fetch(*kv(T=5))
    st_ = cache.state
    assert isinstance(st_, tuple) and len(st_) == 4 and all(isinstance(a, mx.array) for a in st_)
    words = math.ceil(D * 3 / 32)
    assert [tuple(a.shape) for a in st_] == [(1, 2, 5, words), (1, 2, 5, words), (1, 2, 5), (1, 2, 5, D)]
    assert [a.dtype for a in st_] == [mx.uint32, mx.uint32, mx.bfloat16, mx.float16]
    assert cache.meta_state == ("32", "3", "7", "5")
    assert make().state == (None, None, None, None)  # as mlx_lm's empty KVCache: no arrays yet


def test_restore_with_meta_state_continues_identically_and_trims():
    cache = make(2)
    ref = cache.update_and_fetch(*kv(T=12))
    again = TurboQuantRVQKVCache.from_state(cache.state, cache.meta_state)
    assert cache.meta_state == again.meta_state == ("32", "2", "0", "12")
    assert again.compressed_key_bytes == cache.compressed_key_bytes and again.fp16_key_bytes == cache.fp16_key_bytes
    nxt = kv(T=1, seed=3)
    outs = [c.update_and_fetch(*nxt) for c in (cache, again)]
    assert mx.array_equal(outs[1][0], outs[0][0]) and mx.array_equal(outs[1][1], outs[0][1])
    assert mx.array_equal(outs[0][0][:, :, :12], ref[0])
    assert cache.trim(5) == 5 and cache.offset == 8
    assert cache.update_and_fetch(*kv(T=2))[0].shape[2] == 10
    # mlx_lm >= 0.32 calls from_state(state) alone: the arrays do not say how they were coded.
    with pytest.raises(ValueError, match="meta_state"):
        TurboQuantRVQKVCache.from_state(cache.state)


def test_restored_cache_and_its_source_stay_independent():
    """A full store (256 of 256 rows) hands out its buffers; a restore from them must not share them: trim and
    refill either cache, and neither the other nor the saved state moves."""
    cache = make(2)
    cache.update_and_fetch(*kv(T=256))
    snapshot = cache.state
    saved = [mx.array(a) for a in snapshot]
    again = TurboQuantRVQKVCache.from_state(snapshot, cache.meta_state)
    for changed, other in ((again, cache), (cache, again)):
        before = other._fetch(mx.float32)
        mx.eval(before)
        changed.trim(3)
        changed.update_and_fetch(*(5 * a for a in kv(T=1, seed=9)))
        after = other._fetch(mx.float32)
        assert mx.array_equal(after[0], before[0]) and mx.array_equal(after[1], before[1])
    assert all(mx.array_equal(a, b) for a, b in zip(snapshot, saved))


def test_setter_path_of_mlx_lm_loaders():
    """Older mlx_lm loaders rebuild a bare instance: obj = cls.__new__(cls); obj.state = ...; obj.meta_state
    = ... . Either order restores the same cache; on a built cache each setter keeps the other half."""
    cache = make(2, seed=3)
    cache.update_and_fetch(*kv(T=6))
    nxt = kv(T=2, seed=4)
    want = copy.deepcopy(cache).update_and_fetch(*nxt)
    for order in (("state", "meta_state"), ("meta_state", "state")):
        bare = TurboQuantRVQKVCache.__new__(TurboQuantRVQKVCache)
        for name in order:
            setattr(bare, name, getattr(cache, name))
        assert bare.meta_state == cache.meta_state and not hasattr(bare, "_pending")
        got = bare.update_and_fetch(*nxt)
        assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
    built = make(2, seed=3)
    built.state = cache.state  # config kept, offset taken from the arrays
    assert built.offset == 6 and mx.array_equal(built.update_and_fetch(*nxt)[0], want[0])
    with pytest.raises(ValueError, match="offset"):
        built.meta_state = ("32", "2", "3", "99")  # arrays kept: 8 tokens, not 99
    built.meta_state = ("32", "2", "3", "8")
    assert built.offset == 8


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
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _filled(T=7, b=2):
    cache = make(b)
    cache.update_and_fetch(*kv(T=T))
    return cache


def test_seed_meta_state_offset_must_match_the_arrays():
    cache = _filled(7)
    meta = cache.meta_state
    for bad in ("999", "6", "8", "0"):
        with pytest.raises(ValueError, match="offset"):
            TurboQuantRVQKVCache.from_state(cache.state, meta[:3] + (bad,))
    for bad in ("-1", "x", "2.5", None, 7, ""):
        with pytest.raises(ValueError, match="offset"):
            TurboQuantRVQKVCache.from_state(cache.state, meta[:3] + (bad,))
    with pytest.raises(ValueError, match="meta_state"):
        TurboQuantRVQKVCache.from_state(cache.state, meta[:3])


def test_tampered_bits_refused_by_the_word_count():
    cache = _filled(7, b=4)  # d=32, 4 bits: 4 words per stream; 2 bits would be 2 words
    meta = cache.meta_state
    for bits in ("2", "3", "5"):
        with pytest.raises(ValueError, match="'indices' must be"):
            TurboQuantRVQKVCache.from_state(cache.state, (meta[0], bits, meta[2], meta[3]))
    for bits in ("0", "9", "x", "-4"):
        with pytest.raises(ValueError, match="bit"):
            TurboQuantRVQKVCache.from_state(cache.state, (meta[0], bits, meta[2], meta[3]))


def test_tampered_bits_with_the_same_word_count_refused_by_the_padding():
    """head_dim 16: 1 and 2 bits both fill one word per stream; codes written at 2 bits set the high half of
    the word, which 1-bit codes leave zero."""
    cache = make(2, d=16)
    cache.update_and_fetch(*kv(T=9, d=16))
    with pytest.raises(ValueError, match="'indices' has bits set beyond head_dim=16 codes of bits=1"):
        TurboQuantRVQKVCache.from_state(cache.state, ("16", "1", "0", "9"))


def test_tampered_head_dim_refused():
    cache = _filled(7, b=2)  # d=32 at 2 bits: 2 words
    for head_dim in ("64", "16", "1", "0"):
        with pytest.raises(ValueError, match="head_dim|indices"):
            TurboQuantRVQKVCache.from_state(cache.state, (head_dim, "2", "0", "7"))


def test_rotation_other_than_the_seeds_refused():
    """meta_state (head_dim, bits, seed, offset) cannot restore another rotation: refused at construction."""
    with pytest.raises(ValueError, match="config.rotation must be 'haar', got 'hadamard'"):
        make(2, rotation="hadamard")


@pytest.mark.parametrize("i,field", list(enumerate(("indices", "indices2", "norms", "values"))))
def test_missing_or_wrong_shaped_array_named(i, field):
    cache = _filled(7)
    meta = cache.meta_state
    st_ = list(cache.state)
    named = rf"\b{field}\b"  # 'indices', not 'indices2'
    missing = st_[:i] + [None] + st_[i + 1:]
    with pytest.raises(ValueError, match=named):
        TurboQuantRVQKVCache.from_state(tuple(missing), meta)
    a = st_[i]
    other = mx.float16 if a.dtype != mx.float16 else mx.float32  # norms must be bfloat16, values float16
    cut = a[..., :1] if field != "values" else a[..., :0]  # word count; values: a d_v of 0 (any d_v >= 1 is fine)
    for bad in (a[:, :, :5], a[:1, :1], a.astype(mx.int32), a.astype(other), a[None], cut):
        shaped = st_[:i] + [bad] + st_[i + 1:]
        with pytest.raises(ValueError, match=named):
            TurboQuantRVQKVCache.from_state(tuple(shaped), meta)
    with pytest.raises(TypeError, match=named):
        TurboQuantRVQKVCache.from_state(tuple(st_[:i] + [[1, 2, 3]] + st_[i + 1:]), meta)


@pytest.mark.parametrize("state,meta,err,word", [
    (5, None, TypeError, "state"), ("abc", None, TypeError, "state"), ((1, 2), None, ValueError, "4 entries"),
    ((None,) * 5, ("32", "2", "0", "0"), ValueError, "4 entries"),  # the earlier layout: arrays + a JSON entry
    ((None,) * 4, None, ValueError, "meta_state"),
    ((None,) * 4, ("32", "2", "0"), ValueError, "meta_state"),
    ((None,) * 4, "32,2,0,0", ValueError, "meta_state"),
    ((None,) * 4, ("32", "2", "x", "0"), ValueError, "meta_state seed"),
    ((None,) * 4, ("32", "2", "-1", "0"), ValueError, "meta_state seed"),
    ((None,) * 4, ("32", "2", 0, "0"), ValueError, "meta_state seed"),
    ((None,) * 4, ("32", "2", "0", "2.5"), ValueError, "meta_state offset"),
])
def test_from_state_garbage_named(state, meta, err, word):
    with pytest.raises(err, match=word):
        TurboQuantRVQKVCache.from_state(state, meta)


def test_empty_state_round_trips_and_claims_no_tokens():
    cache = make()
    again = TurboQuantRVQKVCache.from_state(cache.state, cache.meta_state)
    assert again.offset == 0 and again.empty() and again.state == (None,) * 4
    with pytest.raises(ValueError, match="offset=3 but no arrays"):
        TurboQuantRVQKVCache.from_state(cache.state, ("32", "2", "0", "3"))
    trimmed = _filled(4)  # emptied by trim: zero-token arrays, offset 0
    trimmed.trim(4)
    again = TurboQuantRVQKVCache.from_state(trimmed.state, trimmed.meta_state)
    assert again.offset == 0 and again.update_and_fetch(*kv(T=1))[0].shape == (1, 2, 1, D)


def test_merge_refuses_batching_clearly():
    """mlx_lm's batch_generate merges per-sequence prompt caches; this cache has no batched form."""
    with pytest.raises(ValueError, match="does not support mlx_lm batch_generate"):
        TurboQuantRVQKVCache.merge([_filled(3), _filled(4)])


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
