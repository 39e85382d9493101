"""Nothing saved is lost: every registered configuration and every cache kind, saved after any number of tokens,
loads back and continues exactly as the cache that was never saved (issue 26).

A cache is filled in random chunks, written to a prompt-cache file, read back, and both it and the original are fed
the same next tokens (a prompt chunk, then decode steps). They must then hold the identical history (every stored
array, bit for bit) and give identical outputs. Token counts: a hypothesis draw over 0..300 plus the edges where a
cache changes shape (sink, key blocks of 64 and 128 tokens, the exact tail before a block is coded, a window).
The model-level tests do the same through mlx_lm's own ``save_prompt_cache`` / ``load_prompt_cache`` on a model
after `veloxquant_mlx.enable`, comparing the next logits.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache

import veloxquant_mlx as vq
from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS as REGISTERED
from veloxquant_mlx.cache import prompt_cache_io
from _token_feed_helpers import D, H, _feed, _tokens

# every registered configuration, plus exact recent windows (no registered one keeps them)
CONFIGURATIONS = {**REGISTERED,
                  "recent-affine": CacheOptions(k_bits=4, v_bits=4, sink=4, recent=6, codec="affine"),
                  "recent-lloyd": CacheOptions(k_bits=3, v_bits=3, sink=2, recent=5, n_outlier_channels=4)}
WINDOW, KEEP = 100, 4
# sink (4), key blocks (64 / 128 tokens), a block plus the exact tail it waits in (~71), the window (100)
EDGES = (0, 1, 3, 4, 5, 63, 64, 65, 71, 72, 73, 99, 100, 101, 127, 128, 129, 200, 256, 300)
CONTINUE = (7, 1, 1)  # after loading: a prompt chunk, then two decode steps


def _through_file(caches: list) -> list:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cache.safetensors")
        vq.save_prompt_cache(path, caches)
        return vq.load_prompt_cache(path)


def _assert_same_state(a, b) -> None:
    sa, sb = a.state, b.state
    if isinstance(sa, dict):
        assert sa.keys() == sb.keys()
        pairs = [(n, sa[n], sb[n]) for n in sa]
    else:
        assert len(sa) == len(sb)
        pairs = list(zip(range(len(sa)), sa, sb))
    for name, x, y in pairs:
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y, equal_nan=True).item(), name
        else:
            assert x == y, name
    assert getattr(a, "meta_state", None) == getattr(b, "meta_state", None)


def _rotating(options):
    # what make_prompt_cache builds for a sliding-window layer (block keys cannot be evicted a token at a time)
    changes = {"sink": min(options.sink, KEEP)}
    if codec_layout(options.codec).keys.BLOCKED:
        changes.update(codec="affine", group_size=None)
    return TurboQuantRotatingPackedCache(dataclasses.replace(options, **changes), max_size=WINDOW, keep=KEEP)


KINDS = {"packed": TurboQuantPackedCache, "rotating": _rotating}


def _check_single(kind: str, name: str, n: int, sizes, seed: int) -> None:
    cache = KINDS[kind](CONFIGURATIONS[name])
    _feed(cache, n, sizes, seed)
    (loaded,) = _through_file([cache])
    assert type(loaded) is type(cache) and loaded.offset == cache.offset
    _assert_same_state(loaded, cache)
    k, v = _tokens(sum(CONTINUE), seed + 1)
    at = 0
    for c in CONTINUE:  # the decoded history each update returns, then what is stored
        got = loaded.update_and_fetch(k[:, :, at:at + c], v[:, :, at:at + c])
        want = cache.update_and_fetch(k[:, :, at:at + c], v[:, :, at:at + c])
        for x, y in zip(got, want):
            assert mx.array_equal(x, y).item(), (kind, name, n, c)
        at += c
    _assert_same_state(loaded, cache)
    q = mx.array(np.random.default_rng(seed + 2).standard_normal((1, 2 * H, 1, D)).astype(np.float32))
    with use_packed_attention():
        got, want = loaded.attend_packed(q, D ** -0.5, None), cache.attend_packed(q, D ** -0.5, None)
    if kind == "rotating":
        # the live window still holds its evicted slots (skipped inside the kernel's 32-token tiles) where the
        # loaded one starts compact: the same codes summed in other tiles, so equal to float32 rounding only
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item(), (kind, name, n)
    else:
        assert mx.array_equal(got, want).item(), (kind, name, n)


def _check_batch(kind: str, name: str, n: int, sizes, seed: int) -> None:
    rows = []
    for i, count in enumerate((n, n // 3 + 1)):  # two sequences of different lengths
        c = KINDS[kind](CONFIGURATIONS[name])
        _feed(c, count, sizes, seed + 10 * i)
        rows.append(c)
    batch = type(rows[0]).merge(rows)
    (loaded,) = _through_file([batch])
    assert type(loaded) is type(batch) and loaded.lengths == batch.lengths
    k, v = _tokens(2, seed + 1, B=2)
    q = mx.array(np.random.default_rng(seed + 2).standard_normal((2, 2 * H, 1, D)).astype(np.float32))
    with use_packed_attention():
        for t in range(2):  # decode steps: the batch path users run
            outs = []
            for c in (loaded, batch):
                c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
                outs.append(c.attend_packed(q, D ** -0.5, None))
            assert mx.array_equal(*outs).item(), (kind, name, n, t)
    for i in range(2):
        _assert_same_state(loaded.extract(i), batch.extract(i))


CHECKS = {"single": _check_single, "batch": _check_batch}
# Every configuration and cache kind batches (exact recent windows, sliding windows whose sink differs from keep).
CASES = [(check, kind, name) for check in CHECKS for kind in KINDS for name in CONFIGURATIONS]


@pytest.mark.parametrize("check,kind,name", CASES)
def test_saved_at_every_edge_continues_exactly(check, kind, name):
    for i, n in enumerate(EDGES):
        CHECKS[check](kind, name, n, (37, 1, 64), seed=i)


@pytest.mark.parametrize("check,kind,name", CASES)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(n=st.integers(0, 300), sizes=st.lists(st.integers(1, 90), min_size=1, max_size=4), seed=st.integers(0, 999))
def test_saved_at_any_count_continues_exactly(check, kind, name, n, sizes, seed):
    CHECKS[check](kind, name, n, sizes, seed)


@pytest.mark.parametrize("n", [0, 1, 5, 40, 130])
def test_rvq_cache_saved_continues_exactly(n):
    cache = TurboQuantRVQKVCache(KVCacheConfig(head_dim=D, bit_width_inlier=2, method="turboquant_rvq"))
    if n:
        _feed(cache, n, (33,), seed=n)
    (loaded,) = _through_file([cache])
    _assert_same_state(loaded, cache)
    k, v = _tokens(sum(CONTINUE), seed=n + 1)
    at = 0
    for c in CONTINUE:
        for x, y in zip(loaded.update_and_fetch(k[:, :, at:at + c], v[:, :, at:at + c]),
                        cache.update_and_fetch(k[:, :, at:at + c], v[:, :, at:at + c])):
            assert mx.array_equal(x, y).item()
        at += c
    _assert_same_state(loaded, cache)


@pytest.mark.parametrize("method", ["turboquant_mse", "turboquant_prod"])
@pytest.mark.parametrize("n", [0, 1, 20])
def test_standalone_cache_pickles_and_continues_exactly(method, n):
    """The standalone research cache is not an mlx_lm cache (no prompt-cache file): it is saved by pickling."""
    config = KVCacheConfig(head_dim=D, bit_width_inlier=3, method=method, enable_outlier_two_stream=True,
                           n_outlier_channels=4, n_calib_tokens=8, capacity=16)
    cache = vq.TurboQuantKVCache(config)
    k, v = _tokens(n + 3, seed=n)

    def append(c, i):
        c.append_key(k[0, 0, i])
        c.append_value(v[0, 0, i])

    for i in range(n):
        append(cache, i)
    loaded = pickle.loads(pickle.dumps(cache))
    copied = copy.deepcopy(cache)
    for i in range(n, n + 3):
        for c in (cache, loaded, copied):
            append(c, i)
    q = k[0, 1, 0]
    assert len(loaded) == len(cache) and loaded.memory_bytes() == cache.memory_bytes()
    assert mx.array_equal(loaded.attend(q), cache.attend(q)).item()
    assert mx.array_equal(copied.attend(q), cache.attend(q)).item()


# -- through mlx_lm's own prompt-cache files, on an enabled model -------------------------------------------
def _run(model, cache, tokens) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("name", list(REGISTERED) + ["rvq"])
def test_mlx_lm_files_of_an_enabled_model_continue_exactly(tiny_model, random_tokens, tmp_path, name):
    options = REGISTERED[name] if name in REGISTERED else dict(kind="rvq", k_bits=2)
    vq.enable(tiny_model, **options) if isinstance(options, dict) else vq.enable(tiny_model, options)
    try:
        for n in (0, 3, 40, 71, 150):
            cache = mlx_cache.make_prompt_cache(tiny_model)
            for at in range(0, n, 64):  # a chunked prefill
                _run(tiny_model, cache, random_tokens[at:min(at + 64, n)])
            path = str(tmp_path / f"{name}-{n}.safetensors")
            if name == "rvq":
                # The seed page's TurboQuantRVQKVCache keeps its configuration in meta_state, which mlx_lm's own
                # files do not hold: its loader gets a clear error, and veloxquant's files carry meta_state.
                mlx_cache.save_prompt_cache(path, cache)
                with pytest.raises(ValueError, match="meta_state"):
                    mlx_cache.load_prompt_cache(path)
                vq.save_prompt_cache(path, cache)
                loaded = vq.load_prompt_cache(path)
            else:
                mlx_cache.save_prompt_cache(path, cache)
                loaded = mlx_cache.load_prompt_cache(path)
            assert [type(c) for c in loaded] == [type(c) for c in cache]
            for chunk in (random_tokens[n:n + 5], random_tokens[n + 5:n + 6], random_tokens[n + 6:n + 7]):
                assert mx.array_equal(_run(tiny_model, loaded, chunk), _run(tiny_model, cache, chunk)).item(), (n, chunk)
            for a, b in zip(loaded, cache):
                _assert_same_state(a, b)
    finally:
        vq.disable(tiny_model)


def test_a_batch_saved_mid_prompt_is_refused_at_load():
    batch = TurboQuantPackedCache.merge([TurboQuantPackedCache(CONFIGURATIONS["tq-affine-k8v4"]) for _ in range(2)])
    batch.prepare(lengths=[5, 3], right_padding=[0, 2])
    k, v = _tokens(5, seed=0, B=2)
    with use_packed_attention():
        batch.update_and_fetch(k, v)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mid.safetensors")
        vq.save_prompt_cache(path, [batch])
        with pytest.raises(ValueError, match="mid.safetensors.*middle of a prompt"):
            vq.load_prompt_cache(path)


def test_a_file_of_mixed_layers_keeps_each_class_and_only_the_rvq_layer_s_meta_state(tmp_path):
    """Our caches, the seed's RVQ cache and mlx_lm's own in one file: each layer comes back as its class; only the
    RVQ layer needs its ``meta_state``, written per layer under the reserved key beside the writer's version."""
    packed = TurboQuantPackedCache(codec="affine", k_bits=4, v_bits=4, sink=2)
    rvq = TurboQuantRVQKVCache(KVCacheConfig(head_dim=D, bit_width_inlier=2, method="turboquant_rvq"))
    plain = mlx_cache.KVCache()
    for i, c in enumerate((packed, rvq, plain)):
        _feed(c, 20, (20,), seed=i)
    path = str(tmp_path / "mixed.safetensors")
    prompt_cache_io.save_prompt_cache(path, [packed, rvq, plain], {"note": "three kinds"})
    raw = mx.load(path, return_metadata=True)[1]
    meta_states = [json.loads(v) for k, v in raw.items() if k.endswith(prompt_cache_io.META_STATE_KEY)]
    assert meta_states == [[None, list(rvq.meta_state), None]]
    assert [v for k, v in raw.items() if k.endswith(prompt_cache_io.VERSION_KEY)] == [vq.__version__]
    loaded, metadata = prompt_cache_io.load_prompt_cache(path, return_metadata=True)
    assert [type(c) for c in loaded] == [TurboQuantPackedCache, TurboQuantRVQKVCache, mlx_cache.KVCache]
    assert metadata == {"note": "three kinds"}
    for a, b in zip(loaded[:2], (packed, rvq)):
        _assert_same_state(a, b)
