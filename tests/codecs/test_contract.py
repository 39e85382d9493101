"""One contract test for every registered code layout (FAISS-style): each codec of `CODECS` passes by being listed.

What every codec must satisfy (float32 throughout): decode(encode(x)) approximates x; ``scores(q, codes)`` equals
``q . decode(codes)^T`` and ``weighted_sum(p, codes)`` equals ``p @ decode(codes)`` (1e-5 relative) on both the
packed and the decode-once paths; token slicing and concatenation commute with decoding; fitted state round
trips; zero and constant vectors stay finite; stored arrays that are not the layout's are refused by name.

The declared contract, over several bit widths and options per codec (`check_layout`, `check_blank_fitted`,
`check_pure_fitting`): ``code_layout(heads)`` is exactly what ``encode`` returns for 1, 2 and 3 token blocks (token
axis, units per block, shapes, dtypes, and where each block's entries lie); ``blank_fitted(heads)`` has the names,
shapes and dtypes of a real fit's arrays (per head, finite); ``with_fitted(fitted_from(x))`` codes bit for bit as a
codec after ``fit(x)``, and neither call changes the codec it is called on. The same checks then run a codec that
is written as one file outside the package and registered with one line (`test_a_new_codec_is_one_file_...`).
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.codecs import CODECS, CodecLayout
from veloxquant_mlx.codecs.contract import Codec
from _codec_contract_helpers import H, _bits, CASES, make, data, fitted, rel, BFloat16Codec


@pytest.mark.parametrize("name,role", CASES)
def test_implements_the_contract(name, role):
    c = make(name, role)
    assert isinstance(c, Codec)
    assert c.d == 64 and c.bits in type(c).BITS and c.token_block >= 1


@pytest.mark.parametrize("name,role", CASES)
def test_round_trip(name, role):
    c, x, codes = fitted(name, role)
    y = c.decode(codes, mx.float32)
    assert y.shape == x.shape and y.dtype == mx.float32 and c.n_tokens(codes) == x.shape[2]
    err = float(mx.linalg.norm(y - x) / mx.linalg.norm(x))
    # 16-bit floats: rounding only; 4-bit codes of rotated coordinates: ~0.1 (Lloyd-Max 0.097, affine 0.09).
    assert err < (1e-3 if c.bits == 16 else 0.13 if c.bits == 4 else 0.6), err
    if 8 in type(c).BITS and c.bits != 8:  # more bits, less error
        c8, _, codes8 = fitted(name, role, bits=8)
        assert float(mx.linalg.norm(c8.decode(codes8, mx.float32) - x)) < 0.2 * float(mx.linalg.norm(y - x))


@pytest.mark.parametrize("rows", [1, 64])  # the packed path (decode) and the decode-once path (prefill)
@pytest.mark.parametrize("name,role", CASES)
def test_scores_and_weighted_sum_equal_the_decoded_math(name, role, rows):
    c, x, codes = fitted(name, role)
    k = c.decode(codes, mx.float32)
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
    p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, x.shape[2])).astype(np.float32)), axis=-1)
    assert rel(c.scores(q, codes), q @ mx.swapaxes(k, -1, -2)) < 1e-5
    assert rel(c.weighted_sum(p, codes), p @ k) < 1e-5
    # Without the offset, the caller adds sum(p) * decoded_offset() itself.
    mu = c.decoded_offset()
    partial = c.weighted_sum(p, codes, with_offset=False)
    if mu is not None:
        partial = partial + mx.sum(p, axis=-1, keepdims=True) * mu[None, :, None, :]
    assert rel(partial, p @ k) < 1e-5


@pytest.mark.parametrize("name,role", CASES)
def test_slices_and_concatenation_commute_with_decode(name, role):
    c, x, codes = fitted(name, role)
    n, blk = c.n_tokens(codes), c.token_block
    cut = (n // 2) // blk * blk or blk
    head, tail = c.slice_tokens(codes, 0, cut), c.slice_tokens(codes, cut, n)
    assert (c.n_tokens(head), c.n_tokens(tail)) == (cut, n - cut)
    full = np.array(c.decode(codes, mx.float32))
    np.testing.assert_array_equal(np.array(c.decode(head, mx.float32)), full[:, :, :cut])
    np.testing.assert_array_equal(np.array(c.decode(tail, mx.float32)), full[:, :, cut:])
    joined = c.concat([head, tail])
    assert sorted(joined) == sorted(codes)
    assert all(mx.array_equal(joined[f], codes[f]) for f in codes)
    # Coding the halves apart gives the same codes as coding them together (tokens are coded independently).
    halves = c.concat([c.encode(x[:, :, :cut]), c.encode(x[:, :, cut:])])
    assert all(mx.array_equal(halves[f], codes[f]) for f in codes)


@pytest.mark.parametrize("name,role", CASES)
def test_fitted_state_and_code_checks_round_trip(name, role):
    c, x, codes = fitted(name, role)
    twin = make(name, role)
    twin.load_fitted(dict(c.fitted_arrays()))
    assert twin.fitted
    np.testing.assert_array_equal(np.array(twin.decode(codes, mx.float32)), np.array(c.decode(codes, mx.float32)))
    twin.check_codes(codes, "restored")  # its own codes pass
    f = sorted(codes)[0]
    bad = dict(codes)
    bad[f] = codes[f][..., :-1] if codes[f].shape[-1] > 1 else mx.concatenate([codes[f]] * 2, axis=-1)
    with pytest.raises(ValueError, match="restored"):
        twin.check_codes(bad, "restored")
    with pytest.raises(ValueError, match="restored"):
        twin.check_codes({k: v for k, v in codes.items() if k != f}, "restored")


@pytest.mark.parametrize("name,role", CASES)
@pytest.mark.parametrize("fill", [0.0, 3.0])
def test_zero_and_constant_vectors(name, role, fill):
    c = make(name, role)
    T = 2 * max(c.token_block, 32)
    x = mx.full((1, H, T, 64), fill, dtype=mx.float32)
    c.fit(x)
    y = c.decode(c.encode(x), mx.float32)
    assert bool(mx.all(mx.isfinite(y)))
    assert float(mx.abs(y - x).max()) <= 0.05 * max(fill, 1.0)


@pytest.mark.parametrize("name,role", CASES)
@pytest.mark.parametrize("d", [48, 96, 63])
def test_other_head_dims_work_or_are_refused_clearly(name, role, d):
    try:
        c = make(name, role, d)
    except ValueError as e:
        assert "d" in str(e) or "group_size" in str(e)
        return
    x = data(2 * max(c.token_block, 32), d)
    c.fit(x)
    y = c.decode(c.encode(x), mx.float32)
    assert y.shape == x.shape
    assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x)) < (1e-3 if c.bits == 16 else 0.15)


def test_float16_nan_inf_and_range():
    # One non-finite token does not change how the others are coded (the fitted statistics skip it).
    checked = 0
    for name in CODECS:
        x = data(128)
        poisoned = mx.concatenate([x[:, :, :1] * float("nan"), x[:, :, 1:]], axis=2)
        clean, bad = make(name, "keys"), make(name, "keys")
        clean.fit(x[:, :, 1:])
        bad.fit(poisoned)
        for arr_clean, arr_bad in zip(clean.fitted_arrays().values(), bad.fitted_arrays().values()):
            assert bool(mx.all(mx.isfinite(arr_bad))) and bool(mx.allclose(arr_clean, arr_bad, atol=1e-6))
            checked += 1
    assert checked >= 3  # every centring layout was compared
    # Inputs near float16's limit decode to finite float16 (the reconstruction is clamped to the range).
    for name in CODECS:
        c = make(name, "values")
        T = 2 * max(c.token_block, 32)
        x = mx.clip(data(T) * 40000.0, -65504, 65504).astype(mx.float16)
        c.fit(x)
        assert bool(mx.all(mx.isfinite(c.decode(c.encode(x), mx.float16))))


def test_every_registered_layout_builds_a_cache_and_attends_from_codes():
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    for name, layout in CODECS.items():
        opts = CacheOptions(codec=name, k_bits=_bits(layout.keys), v_bits=_bits(layout.values), sink=2)
        cache = TurboQuantPackedCache(opts)
        x = data(130)
        hist = cache.update_and_fetch(x, x * 0.5)
        assert cache.n_coded > 0
        q = data(1, seed=5)
        ref = mx.fast.scaled_dot_product_attention(q, hist[0], hist[1], scale=0.125)
        assert rel(cache.attend_packed(q, 0.125, None), ref) < 1e-4
        assert dataclasses.asdict(cache.options)["codec"] == name


@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
def test_a_new_layout_runs_a_model_from_its_codes(codec, monkeypatch, attention_on_codes):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.integration.builder import make_prompt_cache

    from veloxquant_mlx.integration.routing import use_packed_attention

    monkeypatch.setitem(CODECS, "bfloat16", CodecLayout(BFloat16Codec, BFloat16Codec))  # the one registry line
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=61)
    mx.random.seed(0)
    model = llama.Model(args)
    prompt = mx.array([[int(t) for t in np.random.default_rng(0).integers(0, 61, 40)]])

    def logits(caches):
        out = [model(prompt, cache=caches)[:, -1]]
        for _ in range(3):
            out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=caches)[:, -1])
        return mx.stack(out)

    ref = logits([KVCache() for _ in range(2)])
    caches = make_prompt_cache(model, codec=codec, k_bits=16, v_bits=16)
    with use_packed_attention():
        got = logits(caches)
    assert attention_on_codes["attend_packed"] == 2 * 4 and all(type(c.k_codec).__name__ == type(CODECS[codec].keys(16)).__name__ for c in caches)
    tol = 2e-3 if codec == "float16" else 1.5e-2  # 16-bit rounding of K and V only
    assert float(mx.abs(got - ref).max()) <= tol * float(mx.abs(ref).max())


def test_check_codec_names_what_is_not_a_codec():
    from veloxquant_mlx.codecs.contract import CodeField, check_codec

    check_codec(make("float16", "keys"), "k_codec")
    with pytest.raises(TypeError, match="k_codec must implement veloxquant_mlx.codecs.Codec, got dict"):
        check_codec({}, "k_codec")
    field = CodeField(3, 2, (1, 4, 8, 2), mx.uint32)
    assert field.shape(5) == (1, 4, 8, 10) and field.shape(1, rows=3) == (3, 4, 8, 2)
