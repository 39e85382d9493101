"""A packed cache's saved state (veloxquant_mlx.cache.saved_state): it restores exactly, and a cache believes nothing
a saved state cannot back up (every array needed, shapes and counts checked, tampered metadata refused, older formats
read). Saving to files: tests/cache/test_prompt_cache_io.py."""
from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS
from veloxquant_mlx.cache import saved_state
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from _token_feed_helpers import _feed

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


# -- the names and the meta ------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", list(OPTIONS))
def test_array_names_follow_the_prefixes_and_meta_reads_back(codec):
    cache = filled(codec)
    state = cache.state
    prefixes = saved_state.single_prefixes(cache.rows.block)
    assert prefixes["k_codes"] == ("kc_" if codec == "affine_block" else "c_k_")
    names = [n for n in state if n != "meta"]
    assert names and all(n.startswith(tuple(prefixes.values())) for n in names)
    assert {"s_k", "s_v"} <= set(names)  # the exact sink, by the exact windows' field names
    assert any(n.startswith(prefixes["k_codes"]) for n in names) and any(n.startswith("c_v_") for n in names)
    options, kwargs, meta = saved_state.read_meta(TurboQuantPackedCache, state)
    assert options == cache.options and kwargs == {"fetch_placeholders": True}
    assert (meta["format"], meta["class"]) == (saved_state.FORMAT, "TurboQuantPackedCache")
    assert (meta["offset"], meta["dims"]) == (100, [64, 64])
    assert meta["stores"] == {"codes": cache.n_coded, "sink": 2, "tail": 100 - 2 - cache.n_coded}
    assert saved_state.batch_prefixes() == {"sink": "s_", "tail": "t_", "k_codes": "ck_", "v_codes": "cv_",
                                            "k_fit": "kfit_", "v_fit": "vfit_"}


# -- a batch's saved state believes nothing its arrays cannot back up ------------------------------------------


def _saved_batch(name="tq-affine-k8v4", counts=(150, 40)):
    rows = []
    for i, n in enumerate(counts):
        c = TurboQuantPackedCache(CONFIGURATIONS[name])
        _feed(c, n, (64,), seed=i)
        rows.append(c)
    return TurboQuantPackedCache.merge(rows)


def _with_meta(state, **changes):
    meta = json.loads(state["meta"])
    meta.update(changes)
    return {**state, "meta": json.dumps(meta)}


@pytest.mark.parametrize("name", ["tq-affine-k8v4", "tq-mse-k4v4", "tq-4b"])
def test_batch_state_refuses_what_does_not_add_up(name):
    batch = _saved_batch(name)
    cls, state = type(batch), batch.state
    for array in [n for n in state if n != "meta"]:  # every array is needed, and a misshaped one is named
        with pytest.raises(ValueError, match="TurboQuantBatchPackedCache state"):
            cls.from_state({n: a for n, a in state.items() if n != array})
        named = {"s_": "sink", "t_": "tail"}.get(array[:2], array)
        with pytest.raises(ValueError, match=f"TurboQuantBatchPackedCache state: .*{named}"):
            cls.from_state({**state, array: state[array][:1]})
    with pytest.raises(ValueError, match="unexpected arrays \\['zz'\\]"):
        cls.from_state({**state, "zz": mx.zeros((1,))})
    rows = json.loads(state["meta"])["rows"]
    with pytest.raises(ValueError, match="exceed the stored slots"):
        cls.from_state(_with_meta(state, rows={**rows, "tail_n": [999, 0]}))
    with pytest.raises(ValueError, match="row 0: .*offset"):  # counts that fit the slots but not the row's length
        cls.from_state(_with_meta(state, rows={**rows, "lengths": [rows["lengths"][0] + 1, rows["lengths"][1]]}))
    with pytest.raises(ValueError, match="rows\\['fitted'\\]"):
        cls.from_state(_with_meta(state, rows={**rows, "fitted": [1, 0]}))
    with pytest.raises(ValueError, match="middle of a prompt"):
        cls.from_state(_with_meta(state, mid_prompt=True))
    with pytest.raises(ValueError, match="written by"):
        cls.from_state(_with_meta(state, **{"class": "TurboQuantBatchRotatingPackedCache"}))
    with pytest.raises(ValueError, match="expects the dict"):
        cls.from_state([state[n] for n in state if n != "meta"])
