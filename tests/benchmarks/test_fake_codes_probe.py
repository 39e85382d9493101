"""benchmarks/_fake_codes.py, issue 54's RoPE-pair lever measured before it is built: its codes must be the library's
codes, its split must give each chosen pair the high bits, and its caches must be the preset's math on arrival."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.codecs.token_lloyd import TokenLloydCodec
from veloxquant_mlx.quant.rope import RopeFrame, frame_of, offset_keys

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_fake_codes.py"
_spec = importlib.util.spec_from_file_location("_fake_codes", _PATH)
fake = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_fake_codes", fake)
_spec.loader.exec_module(fake)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_token_code_is_the_budget_codec_decoded(bits):
    x = mx.random.normal((1, 3, 20, 64), key=mx.random.key(bits))
    codec = TokenLloydCodec(64, bits, seed=0, center=False)
    want = codec.decode(codec.encode(x), mx.float32)
    assert mx.array_equal(fake.token_code(x, bits, 64, 0), want)


def test_pair_channels_puts_the_largest_query_times_key_pairs_first():
    frame = RopeFrame(8, False, (1.0, 0.1, 0.01, 0.001))  # pairs (j, j + 4)
    q = mx.array([[1, 1, 9, 1, 1, 1, 9, 1], [5, 1, 1, 1, 5, 1, 1, 1]], dtype=mx.float32)
    k = mx.ones((2, 8))
    perm = np.array(fake.pair_channels(q, k, frame, 1))
    assert list(perm[0, :2]) == [2, 6] and list(perm[1, :2]) == [0, 4]
    assert all(sorted(p) == list(range(8)) for p in perm)
    trad = RopeFrame(8, True, (1.0, 0.1, 0.01, 0.001))  # pairs (2j, 2j + 1)
    q2 = mx.array([[1, 1, 1, 1, 7, 7, 1, 1]], dtype=mx.float32)
    assert list(np.array(fake.pair_channels(q2, mx.ones((1, 8)), trad, 1))[0, :2]) == [4, 5]


def test_split_codes_the_chosen_channels_finer():
    x = mx.random.normal((1, 2, 200, 64), key=mx.random.key(7))
    perm = mx.array(np.stack([np.random.default_rng(h).permutation(64) for h in range(2)]).astype(np.int32))
    y = fake.split_code(x, perm, 5, 2, 0)
    err = np.array(mx.mean(mx.square(y - x), axis=(0, 2)))  # (heads, d)
    for h in range(2):
        p = np.array(perm[h])
        assert err[h, p[:32]].mean() < err[h, p[32:]].mean() / 4  # 5 bits against 2 on Gaussian coordinates


def _held(model, bits, variant, n, seed, layer):
    """``n`` random tokens through the probe's caches and through plain ones: ``layer``'s (keys, values) of each."""
    toks = mx.random.randint(0, 128, (1, n), key=mx.random.key(seed))
    caches, plain = fake.fake_caches(model, bits, variant), [KVCache() for _ in model.layers]
    model(toks, cache=caches)
    model(toks, cache=plain)
    return caches[layer], [tuple(x[:, :, :c.offset] for x in (c.keys, c.values)) for c in (caches[layer], plain[layer])]


def test_fake_caches_hold_the_offset_codes_and_an_exact_first_token(tiny_model):
    cache, ((k, v), (k0, v0)) = _held(tiny_model, 4, "", 40, 2, 0)
    assert mx.array_equal(k[:, :, :1], k0[:, :, :1]) and mx.array_equal(v[:, :, :1], v0[:, :, :1])
    attn = tiny_model.layers[0].self_attn
    d = k0.shape[-1]
    frame, _ = frame_of(attn.rope, d)
    off = offset_keys(cache.mu, mx.zeros((k0.shape[1],), dtype=mx.int32), k0.shape[2], frame)[None]
    want = fake.token_code(k0.astype(mx.float32) - off, 4, min(64, d), 0) + off
    assert float(mx.abs(k[:, :, 1:] - want[:, :, 1:].astype(k.dtype)).max()) < 1e-4
    assert float(mx.abs(k - k0).max()) > 1e-3  # coded, not passed through


def test_pairs_need_a_calibration_and_variants_are_checked(tiny_model):
    with pytest.raises(ValueError, match="calibration"):
        fake.fake_caches(tiny_model, 3, "-pairs")
    with pytest.raises(ValueError, match="variant"):
        fake.fake_caches(tiny_model, 3, "-nope")


def test_pairs_probe_chooses_pairs_without_text_and_codes(tiny_model):
    _, ((k, _), (k0, _)) = _held(tiny_model, 3, "-pairs-probe", 30, 6, 1)
    k, k0 = k[:, :, 1:], k0[:, :, 1:]
    rel = float(mx.mean(mx.square(k - k0)) / mx.mean(mx.square(k0)))
    assert 1e-5 < rel < 0.2  # coded (4 / 2 bits), not passed through, not garbage


@pytest.mark.parametrize("bits", [2, 4])
def test_shannon_channel_has_the_bound_error_independent_of_its_output(bits):
    y = mx.random.normal((4000, 64), key=mx.random.key(3)) * mx.random.uniform(0.5, 3, (4000, 1), key=mx.random.key(4))
    r = fake.shannon_roundtrip(y, bits, mx.random.key(5))
    rel = float(mx.mean(mx.sum(mx.square(r - y), -1) / mx.sum(mx.square(y), -1)))
    assert abs(rel / 2.0 ** (-2 * bits) - 1) < 0.03  # D(R) = s^2 2^(-2R) per row
    e = y - r  # uncorrelated with the output (Lloyd-Max's centroids share this; the bound's error is also Gaussian)
    assert abs(float(mx.mean(e * r))) < 0.01 * float(mx.sqrt(mx.mean(e * e) * mx.mean(r * r)))
    assert rel < 0.6 * float(mx.mean(mx.square(fake.lloyd_roundtrip(y, bits, 64) - y) / mx.mean(y * y)))


def test_bound_variant_draws_the_same_noise_on_every_run(tiny_model):
    (_, a), (_, b) = _held(tiny_model, 3, "-rd", 24, 8, 0), _held(tiny_model, 3, "-rd", 24, 8, 0)
    assert mx.array_equal(a[0][0], b[0][0]) and mx.array_equal(a[0][1], b[0][1])
    k, k0 = a[0][0][:, :, 1:], a[1][0][:, :, 1:]
    rel = float(mx.mean(mx.square(k - k0)) / mx.mean(mx.square(k0)))
    assert 1e-5 < rel < 0.1


def test_window_layers_keep_their_window_and_code_without_the_offset(tiny_gemma3):
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_gemma3
    caches = fake.fake_caches(model, 4, "")
    assert [type(c).__name__ for c in caches] == ["FakeCodedRotatingKV", "FakeCodedRotatingKV", "FakeCodedKV"]
    plain = make_prompt_cache(model)
    toks = mx.random.randint(0, 128, (1, 40), key=mx.random.key(1))
    for chunk in (toks[:, :24], toks[:, 24:]):  # a chunk past the window, then more
        model(chunk, cache=caches)
        model(chunk, cache=plain)
    for i, (c, p) in enumerate(zip(caches, plain)):
        n = min(c.offset, c.keys.shape[2])
        k, k0 = c.keys[:, :, :n], p.keys[:, :, :n]
        assert c.keys.shape == p.keys.shape and c.offset == p.offset == 40  # the window as the plain cache keeps it
        rel = float(mx.mean(mx.square(k - k0)) / mx.mean(mx.square(k0)))
        # coded at 4 bits (Lloyd-Max: 0.007 of the mean square), not passed through; later layers add upstream error
        assert 1e-3 < rel < (0.012 if i == 0 else 0.2)
    assert not mx.any(caches[0].mu).item() and mx.any(caches[2].mu).item()  # the offset on full attention only


def test_layers_of_another_layout_keep_the_presets_cache(tiny_model, monkeypatch):
    import veloxquant_mlx as vq

    built, other = vq.make_prompt_cache(tiny_model, "tq-4b"), vq.make_prompt_cache(tiny_model, "tq-affine-k8v4")
    assert {c.options.codec for c in built} == {"token_lloyd8"} and other[0].options.codec != "token_lloyd8"
    monkeypatch.setattr(vq, "make_prompt_cache", lambda model, config: [other[0]] + built[1:])
    caches = fake.fake_caches(tiny_model, 4, "")
    assert caches[0] is other[0] and all(type(c) is fake.FakeCodedKV for c in caches[1:])
