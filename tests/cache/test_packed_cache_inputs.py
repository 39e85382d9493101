"""Bad calls on a packed cache (veloxquant_mlx.cache.packed_cache) get errors that name the argument and change
nothing; a non-finite token stays in its token; ``max_kv_size`` gives compressed rotating caches."""
from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache


def kv(T, seed=0, B=1, H=2, d=64):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((B, H, T, d)).astype(np.float32)) for _ in range(2))


OPTIONS = {"affine": dict(k_bits=4, v_bits=4, sink=2, recent=3, codec="affine")}


def filled(codec, T=100):
    cache = TurboQuantPackedCache(**OPTIONS[codec])
    cache.update_and_fetch(*kv(T))
    return cache


@pytest.mark.parametrize("n,exc", [(-1, ValueError), (2.5, TypeError), ("2", TypeError), (None, TypeError),
                                   (True, TypeError)])
def test_trim_takes_a_non_negative_int(n, exc):
    for cache in (filled("affine"), TurboQuantRotatingPackedCache(k_bits=4, max_size=64, keep=4)):
        before = cache.offset
        with pytest.raises(exc, match="n must be"):
            cache.trim(n)
        assert cache.offset == before


def test_bad_updates_and_queries_are_named():
    cache = filled("affine")
    k, v = kv(1)
    with pytest.raises(ValueError, match="at least one token"):
        TurboQuantPackedCache(k_bits=4).update_and_fetch(k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match=r"\(B, H\)"):
        cache.update_and_fetch(*kv(1, B=2))
    with pytest.raises(ValueError, match="head_dim"):
        cache.update_and_fetch(*kv(1, d=32))
    with pytest.raises(ValueError, match="head_dim"):
        cache.attend_packed(kv(1, H=4, d=32)[0], 0.1, None)
    with pytest.raises(TypeError, match="queries"):
        cache.attend_packed(np.zeros((1, 4, 1, 64)), 0.1, None)
    # nothing above changed the cache
    twin = filled("affine")
    for a, b in zip(cache._fetch(mx.float32), twin._fetch(mx.float32)):
        assert mx.array_equal(a, b)


def test_max_kv_size_gives_compressed_rotating_caches():
    from mlx_lm.models import llama

    import veloxquant_mlx as vq

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64)
    model = llama.Model(args)
    caches = vq.make_prompt_cache(model, max_kv_size=8, k_bits=4)
    assert all(type(c) is TurboQuantRotatingPackedCache and (c.max_size, c.keep) == (8, 4) for c in caches)
    for bad, exc in ((-5, ValueError), (0, ValueError), (2.5, TypeError)):
        with pytest.raises(exc, match="max_kv_size"):
            vq.make_prompt_cache(model, max_kv_size=bad)


def test_nan_in_one_token_stays_in_that_token():
    cache = TurboQuantPackedCache(k_bits=4, v_bits=4, codec="affine")
    k, v = kv(64)
    k = mx.concatenate([k[:, :, :1] * float("nan"), k[:, :, 1:]], axis=2)
    keys, _ = cache.update_and_fetch(k, v)
    later, _ = cache.update_and_fetch(*kv(8, seed=3))
    finite = mx.isfinite(later).all(axis=(0, 1, 3))
    assert not bool(finite[0]) and bool(mx.all(finite[1:]))  # the NaN token only
    assert copy.deepcopy(cache).offset == 72
