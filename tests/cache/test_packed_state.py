"""A packed cache believes nothing a saved state cannot back up; bad calls get errors that name the argument."""
from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache

OPTIONS = {
    "lloyd_max": dict(k_bits=4, v_bits=4, sink=2, recent=3, n_outlier_channels=4),
    "affine": dict(k_bits=4, v_bits=4, sink=2, recent=3, codec="affine"),
    "affine_block": dict(k_bits=4, v_bits=4, sink=2, codec="affine_block", group_size=32),
}


def kv(T, seed=0, B=1, H=2, d=64):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((B, H, T, d)).astype(np.float32)) for _ in range(2))


def filled(codec, T=100):
    cache = TurboQuantPackedCache(**OPTIONS[codec])
    cache.update_and_fetch(*kv(T))
    return cache


def with_meta(state, **changes):
    meta = json.loads(state["meta"])
    for k, v in changes.items():
        meta[k] = v(meta[k]) if callable(v) else v
    return {**state, "meta": json.dumps(meta)}


@pytest.mark.parametrize("codec", list(OPTIONS))
def test_round_trip_continues_exactly(codec):
    cache = filled(codec)
    restored = TurboQuantPackedCache.from_state(cache.state)
    nxt = kv(40, seed=1)
    for a, b in zip(cache.update_and_fetch(*nxt), restored.update_and_fetch(*nxt)):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("codec", list(OPTIONS))
def test_every_array_is_needed(codec):
    state = filled(codec).state
    for name in [n for n in state if n != "meta"]:
        with pytest.raises(ValueError, match="TurboQuantPackedCache state"):
            TurboQuantPackedCache.from_state({k: v for k, v in state.items() if k != name})


@pytest.mark.parametrize("codec", list(OPTIONS))
def test_wrong_shapes_and_unexpected_arrays_are_named(codec):
    state = filled(codec).state
    code = next(n for n in state if n.startswith(("c_k_", "kc_")))
    with pytest.raises(ValueError, match=code.split("_", 2)[-1] if code.startswith("c_k_") else "w_q|scales|blocks"):
        TurboQuantPackedCache.from_state({**state, code: state[code][..., :-1]})
    with pytest.raises(ValueError, match="unexpected arrays.*'zz'"):
        TurboQuantPackedCache.from_state({**state, "zz": mx.zeros((1,))})
    tail = {**state, "s_k": state["s_k"][:, :1]}
    with pytest.raises(ValueError, match="disagree"):
        TurboQuantPackedCache.from_state(tail)


@pytest.mark.parametrize("codec", list(OPTIONS))
def test_tampered_metadata_is_refused(codec):
    state = filled(codec).state
    opts = json.loads(state["meta"])["options"]
    with pytest.raises(ValueError, match="offset"):
        TurboQuantPackedCache.from_state(with_meta(state, offset=lambda o: o + 100))
    with pytest.raises(ValueError, match="tokens"):
        TurboQuantPackedCache.from_state(with_meta(state, stores=lambda s: {**s, "codes": s["codes"] + 1}))
    with pytest.raises(ValueError, match="c_k_|kc_|c_v_"):  # 2 bits claimed, 4 stored: the word counts say no
        TurboQuantPackedCache.from_state(with_meta(state, options={**opts, "k_bits": 2, "v_bits": 2}))
    with pytest.raises(ValueError, match="dims"):
        TurboQuantPackedCache.from_state(with_meta(state, dims=[64, "x"]))
    with pytest.raises(ValueError, match="written by"):
        TurboQuantRotatingPackedCache.from_state(state)
    with pytest.raises(ValueError, match="not valid JSON"):
        TurboQuantPackedCache.from_state({**state, "meta": "x"})
    with pytest.raises(ValueError, match="format"):
        TurboQuantPackedCache.from_state(with_meta(state, format=9))
    with pytest.raises(ValueError, match="written by .state"):
        TurboQuantPackedCache.from_state(5)


def test_states_of_the_previous_format_still_load():
    cache = filled("lloyd_max")
    meta = json.loads(cache.state["meta"])
    opts = meta["options"]
    config = cache.config.to_dict()
    old_options = {k: opts[k] for k in ("sink", "recent", "trim_headroom", "center_keys", "center_values",
                                        "value_outliers", "codec", "group_size")}
    old_meta = {"format": 1, "class": meta["class"], "config": config,
                "options": {**old_options, "fetch_placeholders": True}, "offset": meta["offset"],
                "dims": meta["dims"], "stores": meta["stores"]}
    restored = TurboQuantPackedCache.from_state({**cache.state, "meta": json.dumps(old_meta)})
    assert restored.options == cache.options
    for a, b in zip(restored._fetch(mx.float32), cache._fetch(mx.float32)):
        assert mx.array_equal(a, b)


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


@pytest.mark.parametrize("method,readable", [("turboquant_mse", True), ("turboquant_prod", False)])
def test_format_2_states_load_except_prod_codes_of_the_old_sketch(method, readable):
    cache = TurboQuantPackedCache(**{**OPTIONS["lloyd_max"], "method": method})
    cache.update_and_fetch(*kv(100))
    old = with_meta(cache.state, format=2)
    if readable:
        restored = TurboQuantPackedCache.from_state(old)
        for a, b in zip(restored._fetch(mx.float32), cache._fetch(mx.float32)):
            assert mx.array_equal(a, b)
    else:
        with pytest.raises(ValueError, match="turboquant_prod codes of format 2"):
            TurboQuantPackedCache.from_state(old)
