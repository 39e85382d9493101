"""``rope_offset`` (issue 54): keys stored less their rotated mean before RoPE, ``R_t mu`` added back on reading.

The math (`veloxquant_mlx.quant.rope`) is checked in tests/quant/test_rope.py; here, the caches: keys come back,
the offset cuts the key error where keys carry a rotating mean, the kernel reads the offset in the same call as its
reference, states and trims keep it, bad options are refused, and the builder reads each layer's RoPE (the batch
rows' equality with each sequence alone: tests/cache/test_batch_cache.py, configurations ``*-ro``).
"""
from __future__ import annotations

import dataclasses
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

import veloxquant_mlx as vq
from veloxquant_mlx.attention import kernel
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantPackedCache, \
    TurboQuantRotatingPackedCache
from veloxquant_mlx.cache.presets import preset
from veloxquant_mlx.quant.rope import frame_of

ROPE = nn.RoPE(64, base=10000)
FRAME = frame_of(ROPE, 64)[0]
H, D = 2, 64


def _options(codec="kblock_vsym8", offset=True, **changes):
    extra = {"center_keys": True} if codec == "kblock_vsym8_pt" else {}
    return dataclasses.replace(preset("tq-4b"), **{"codec": codec, "rope_offset": offset,
                                                  "key_rope": FRAME.to_list(), **extra, **changes})


def _window_options(rope_offset):
    return CacheOptions(codec="affine", k_bits=4, rope_offset=rope_offset, key_rope=FRAME.to_list())


def _keys(T, seed=0, B=1):
    """Keys after RoPE of pre-RoPE keys with a strong per-head mean (what the offset is for), values."""
    g = np.random.default_rng(seed)
    mu = mx.array(g.normal(size=(1, H, 1, D)) * 3, dtype=mx.float32)
    pre = mu + mx.array(g.normal(size=(B, H, T, D)) * 0.5, dtype=mx.float32)
    return ROPE(pre), mx.array(g.normal(size=(B, H, T, D)), dtype=mx.float32)


def _feed(cache, k, v, chunk=200):
    for s in range(0, k.shape[2], chunk):
        cache.update_and_fetch(k[:, :, s:s + chunk], v[:, :, s:s + chunk])
    return cache


def _rel(a, b):
    return float(mx.linalg.norm(a - b) / mx.linalg.norm(b))


@pytest.mark.parametrize("codec", ["kblock_vsym8", "kblock_vsym8_pt"])
def test_keys_come_back_and_the_offset_cuts_their_error(codec):
    k, v = _keys(700)
    with_off = _feed(TurboQuantPackedCache(_options(codec)), k, v)
    without = _feed(TurboQuantPackedCache(_options(codec, offset=False)), k, v)
    assert with_off.n_coded == without.n_coded == 640
    err_on, err_off = (_rel(c.keys_and_values()[0], k) for c in (with_off, without))
    assert err_on < err_off / 2.5, (err_on, err_off)
    assert mx.allclose(with_off.keys_and_values()[1], without.keys_and_values()[1]).item()  # values untouched
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(3))
    ref = mx.fast.scaled_dot_product_attention(q, mx.repeat(k, 2, axis=1), mx.repeat(v, 2, axis=1), scale=0.125)
    out_on, out_off = (c.attend_packed(q, 0.125, None) for c in (with_off, without))
    assert _rel(out_on, ref) < _rel(out_off, ref)
    # the fitted mean is stored, and counted
    assert with_off.rows.k_codec.rope_mean.shape == (H, D)
    assert with_off.nbytes - without.nbytes == H * D * 2  # (float16)


def test_a_short_chat_reads_its_keys_as_they_came():
    """Before any block is coded, every key is stored less its offset and read with it back: float32 rounding."""
    k, v = _keys(60)
    cache = _feed(TurboQuantPackedCache(_options()), k, v, chunk=7)
    assert cache.n_coded == 0 and cache.rows.fitted == [True]
    assert mx.allclose(cache.keys_and_values()[0], k, atol=1e-5).item()
    plain = _feed(TurboQuantPackedCache(_options(offset=False)), k, v, chunk=7)
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(4))
    assert mx.allclose(cache.attend_packed(q, 0.125, None), plain.attend_packed(q, 0.125, None), atol=1e-5).item()


@pytest.mark.parametrize("codec", ["kblock_vsym8", "kblock_vsym8_pt"])
def test_the_kernel_reads_the_offset_as_its_reference_does(codec):
    ok, why = kernel.status()
    assert ok, why  # (CI builds the kernel: a missing kernel is a failure here, not a skip)
    k, v = _keys(650, seed=1)
    cache = _feed(TurboQuantPackedCache(_options(codec)), k, v)
    for t in range(3):  # decode steps: the coded tail (or exact tail) grows
        kk, vv = _keys(1, seed=10 + t)
        cache.update_and_fetch(kk, vv)
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(5))
    before = kernel.calls()["kernel"]
    out = cache.attend_packed(q, 0.125, None)
    assert kernel.calls()["kernel"] == before + 1
    kernel.set_enabled(False)
    try:
        ref = cache.attend_packed(q, 0.125, None)
    finally:
        kernel.set_enabled(True)
    assert mx.allclose(out, ref, atol=2e-5).item(), float(mx.abs(out - ref).max())


def test_a_batch_with_the_offset_attends_on_the_kernel_as_on_the_reference():
    k, v = _keys(600, seed=2, B=3)
    lengths = [600, 450, 300]
    batch = TurboQuantBatchPackedCache(_options("kblock_vsym8_pt"), 3)
    batch.prepare(left_padding=[600 - n for n in lengths])
    kp = mx.concatenate([mx.concatenate([mx.zeros((1, H, 600 - n, D)), k[i:i + 1, :, :n]], axis=2)
                         for i, n in enumerate(lengths)], axis=0)
    vp = mx.concatenate([mx.concatenate([mx.zeros((1, H, 600 - n, D)), v[i:i + 1, :, :n]], axis=2)
                         for i, n in enumerate(lengths)], axis=0)
    with vq.use_packed_attention():
        batch.update_and_fetch(kp, vp)
        batch.finalize()
        kk, vv = _keys(1, seed=20, B=3)
        batch.update_and_fetch(kk, vv)
    q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(6))
    with vq.use_packed_attention():
        out = batch.attend_packed(q, 0.125, None)
        kernel.set_enabled(False)
        try:
            ref = batch.attend_packed(q, 0.125, None)
        finally:
            kernel.set_enabled(True)
    assert mx.allclose(out, ref, atol=2e-5).item(), float(mx.abs(out - ref).max())
    for i, n in enumerate(lengths):  # each row's keys come back at its own positions
        got = batch.extract(i).keys_and_values()[0]
        want = mx.concatenate([k[i:i + 1, :, :n], kk[i:i + 1]], axis=2)
        assert _rel(got, want) < 0.03


@pytest.mark.parametrize("codec", ["kblock_vsym8", "kblock_vsym8_pt"])
def test_states_and_trims_keep_the_offset(codec):
    k, v = _keys(500, seed=3)
    cache = _feed(TurboQuantPackedCache(_options(codec)), k, v)
    state = cache.state
    assert [n for n in state if "rope_mean" in n]
    back = TurboQuantPackedCache.from_state(state)
    assert back.options.key_rope == cache.options.key_rope and back.options.rope_offset
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys_and_values(), back.keys_and_values()))
    before = cache.keys_and_values()[0]
    assert cache.trim(150) == 150  # into the coded blocks: survivors back in the tail (provisional codes: re-coded)
    assert mx.allclose(cache.keys_and_values()[0], before[:, :, :350], atol=1e-5 if codec == "kblock_vsym8" else 0.2)
    _feed(cache, k[:, :, 350:], v[:, :, 350:])  # the same tokens again, at their positions: coded as well as before
    whole = _feed(TurboQuantPackedCache(_options(codec)), k, v)
    assert _rel(cache.keys_and_values()[0], k) < 1.2 * _rel(whole.keys_and_values()[0], k)
    bad = dict(state)
    name = next(n for n in state if n.endswith("rope_mean"))
    bad[name] = mx.zeros((H + 1, D))
    with pytest.raises(ValueError, match="rope_mean"):
        TurboQuantPackedCache.from_state(bad)


def test_bad_options_are_refused_clearly():
    with pytest.raises(ValueError, match="recent=0"):
        _options(recent=4)
    # "auto" leaves out a layer with an exact window (the budget presets with recent=N), True refuses it
    assert _options(offset="auto", recent=4).rope_frame is None and _options(offset="auto").rope_frame is not None
    with pytest.raises(ValueError, match="rope_offset applies to"):
        CacheOptions(codec="lloyd_max", rope_offset=True)
    with pytest.raises(ValueError, match="key_rope"):
        _options(key_rope=[64, False, [0.1]])
    with pytest.raises(ValueError, match="key_rope"):
        _options(key_rope="rope")
    k, v = _keys(4)
    with pytest.raises(ValueError, match="needs the layer's RoPE"):
        TurboQuantPackedCache(_options(key_rope=None)).update_and_fetch(k, v)
    with pytest.raises(ValueError, match="rope_offset applies to full-attention caches"):
        TurboQuantRotatingPackedCache(_window_options(True), max_size=32, keep=0).update_and_fetch(k, v)
    assert CacheOptions.from_dict(_options().to_dict()) == _options()  # (JSON round trip of the frame)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        _options(rope_offset="yes")


def test_auto_offsets_where_the_rope_is_known():
    """``rope_offset="auto"``: a cache given its layer's RoPE stores keys less their offset; one built alone (no
    model to read a RoPE from) or a sliding window codes post-RoPE, as ``rope_offset=False``, byte for byte."""
    k, v = _keys(300)
    auto = _feed(TurboQuantPackedCache(_options(rope_offset="auto")), k, v)
    assert auto.rows.k_codec.rope_mean is not None
    on = _feed(TurboQuantPackedCache(_options(rope_offset=True)), k, v)
    assert all(mx.array_equal(a, b).item() for a, b in zip(auto.keys_and_values(), on.keys_and_values()))
    alone = _feed(TurboQuantPackedCache(_options(rope_offset="auto", key_rope=None)), k, v)
    off = _feed(TurboQuantPackedCache(_options(offset=False, key_rope=None)), k, v)
    assert alone.rows.rope is None and alone.nbytes == off.nbytes
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone.keys_and_values(), off.keys_and_values()))
    window = TurboQuantRotatingPackedCache(_window_options("auto"), max_size=32, keep=0)
    _feed(window, k[:, :, :40], v[:, :, :40], chunk=1)
    assert window.rows.rope is None


def _tiny_llama():
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=128))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_builder_reads_each_layers_rope(dtype):
    model = _tiny_llama()
    model.set_dtype(dtype)
    caches = vq.make_prompt_cache(model, "tq-4b", rope_offset=True)
    want = frame_of(model.layers[0].self_attn.rope, 32)[0]
    assert all(c.options.rope_offset and c.options.key_rope == (want.dims, want.traditional, want.rates)
               for c in caches)
    tokens = mx.array([[int(t) for t in np.random.default_rng(0).integers(1, 128, 300)]])
    logits = model(tokens[:, :250], cache=caches)
    for t in range(250, 300):  # decode steps after a prompt with coded blocks
        logits = mx.concatenate([logits, model(tokens[:, t:t + 1], cache=caches)], axis=1)
    plain = model(tokens)
    assert logits.dtype == plain.dtype and bool(mx.all(mx.isfinite(logits)).item())
    assert float(mx.abs(logits - plain).max()) < 0.5 * float(mx.abs(plain).max())
    assert caches[0].rows.k_codec.rope_mean is not None and caches[0].n_coded > 0


def test_sliding_windows_stay_post_rope_and_an_unreadable_rope_too_with_one_line(tiny_gemma3):
    model = tiny_gemma3
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        vq.enable(model, "tq-4b", rope_offset=True)
    try:
        assert not [w for w in said if "rope_offset" in str(w.message)], [str(w.message) for w in said]
        caches = model.make_cache()
        assert [c.options.rope_offset for c in caches] == [False, False, True]
    finally:
        vq.disable(model)
    # a RoPE that scales its input (YaRN's mscale) is not a rotation: left post-RoPE, enable says so in one line
    mx.random.seed(0)
    yarn = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=128, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 64}))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        vq.enable(yarn, "tq-4b", rope_offset=True)
    try:
        lines = [str(w.message) for w in said if "rope_offset" in str(w.message)]
        assert len(lines) == 1 and lines[0].startswith("veloxquant_mlx: rope_offset: layers 0-1 keep keys coded "
                                                       "after RoPE without the offset (YarnRoPE is not a per-pair "
                                                       "rotation"), lines
        assert not any(c.options.rope_offset for c in yarn.make_cache())
    finally:
        vq.disable(yarn)
