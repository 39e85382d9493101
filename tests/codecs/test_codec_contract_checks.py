"""The codec contract, continued: Lloyd-Max levels through the fused level planes (codecs._levels), the declared
contract of every registered layout over several bit widths and options (`check_layout`, `check_blank_fitted`,
`check_pure_fitting`), and a codec written as one file outside the package and registered with one line.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs import Codec
from _codec_contract_helpers import (
    H,
    CASES,
    make,
    data,
    fitted,
    rel,
    FUSED,
    LLOYD_CASES,
    _quantizer_decode,
    CONTRACT_CASES,
    check_layout,
    check_blank_fitted,
    check_pure_fitting,
    absmax8,
    _exact_attention,
)


@pytest.mark.parametrize("method,bits,n_outliers", LLOYD_CASES)
def test_lloyd_max_fused_levels_equal_the_quantizers_decode(method, bits, n_outliers):
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(300)  # not a multiple of the kernels' token bucket (256)
    c.fit(x)
    codes = c.encode(x)
    fused = {g: c._fast(g, quant, codes) is not None for g, _, _, quant in c._groups()}
    if (method, bits) in FUSED:
        assert fused["i"], "a registered configuration's codes must be read by the fused kernels"
    if n_outliers:
        assert not fused["o"], "8-bit outlier codes have no exact level polynomial: gather path"
    ref = _quantizer_decode(c, codes)
    assert rel(c.decode(codes, mx.float32), ref) < 1e-6
    rng = np.random.default_rng(2)
    for rows in (1, 7):
        q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
        p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, 300)).astype(np.float32)), axis=-1)
        assert rel(c.scores(q, codes), q @ mx.swapaxes(ref, -1, -2)) < 1e-5
        assert rel(c.weighted_sum(p, codes), p @ ref) < 1e-5


def test_level_polynomials_are_exact_or_refused():
    from veloxquant_mlx.codebooks import lloyd_max_codebook
    from veloxquant_mlx.codecs._levels import LevelDecoder, level_polynomial
    from veloxquant_mlx.dsa.bit_pack import pack

    for bits in (1, 2, 3, 4):
        cb = lloyd_max_codebook("beta", bits, d=64)
        assert level_polynomial(cb.centroids_np, bits) is not None
        for d in (8, 56, 64):  # whole units only: one byte / 3 bytes hold 2, 4, 8 codes
            idx = mx.array(np.random.default_rng(bits).integers(0, 1 << bits, (1, 2, 5, d)).astype(np.uint8))
            dec = LevelDecoder([(cb.centroids_np, bits)], d)
            planes = dec(pack(idx, bits))
            step = len(planes)
            want = np.array(mx.take(cb.centroids, idx.astype(mx.int32)))
            for j, pl in enumerate(planes):
                np.testing.assert_allclose(np.array(pl), want[..., j::step], rtol=0, atol=1e-6 * np.abs(want).max())
    assert level_polynomial(lloyd_max_codebook("beta", 5, d=64).centroids_np, 5) is None  # beyond MAX_POLY_BITS
    assert level_polynomial(np.array([-1.0, 0.1, 0.5, 1.0]), 2) is None  # not symmetric
    assert not LevelDecoder([(lloyd_max_codebook("beta", 3, d=64).centroids_np, 3)], 60).exact  # 60 % 8 != 0


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fused_dequantize_is_mx_dequantize_bit_for_bit(bits, group_size):
    """`codecs._dequant.dequantize` (a few fused ops instead of MLX's ~30-50 on CPU) against its reference,
    ``mx.dequantize``, on whole arrays, on slices along either axis (the views a cache attends) and with float16
    and float32 scales; the fused path must be the one taken for 2, 4 and 8 bits."""
    from veloxquant_mlx.codecs import _dequant

    x = mx.array(np.random.default_rng(bits).standard_normal((2, H, 40, 512)).astype(np.float32) * 4.0)
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    words = group_size * bits // 32
    views = [(w, s16, b16), (w, s, b), (w[1:, :, 3:29], s16[1:, :, 3:29], b16[1:, :, 3:29]),
             (w[..., words:3 * words], s16[..., 1:3], b16[..., 1:3])]
    for wv, sv, bv in views:
        want = mx.dequantize(wv, sv.astype(mx.float32), bv.astype(mx.float32), group_size=group_size, bits=bits)
        got = _dequant.dequantize(wv, sv, bv, group_size, bits)
        assert got.dtype == mx.float32 and got.shape == want.shape
        assert bool(mx.array_equal(got, want))
    assert (_dequant._kernel(bits) is not None) == (bits in _dequant.FUSED_BITS)


def test_fused_float16_clamp_is_clip_then_cast():
    from veloxquant_mlx.codecs._common import clamp_all_to, clamp_to

    x = mx.array([1e6, -1e6, 65504.0, -3.25, 0.0, 1e-9, float("nan")])
    want = mx.clip(x, -65504.0, 65504.0).astype(mx.float16)
    a, b = clamp_all_to(mx.float16, x, 2 * x.reshape(7, 1))
    assert bool(mx.array_equal(a, want, equal_nan=True)) and a.dtype == mx.float16
    assert b.shape == (7, 1) and bool(mx.array_equal(b.reshape(-1), mx.clip(2 * x, -65504.0, 65504.0).astype(mx.float16),
                                                     equal_nan=True))
    assert bool(mx.array_equal(clamp_to(x, mx.float16), want, equal_nan=True))
    assert clamp_to(x, mx.bfloat16).dtype == mx.bfloat16 and float(clamp_to(x, mx.float32)[0]) == 1e6


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n_outliers", [0, 8])
def test_lloyd_max_fused_encode_writes_the_quantizers_codes(bits, n_outliers):
    """TurboQuant-MSE codes come from one compiled compare-and-pack kernel (codecs._levels.CodePacker): they must
    be the quantizer's own arrays bit for bit (a zero token and large values included)."""
    from veloxquant_mlx.codecs import LloydMaxCodec
    from veloxquant_mlx.codecs.lloyd_max import _packer, _permute

    c = LloydMaxCodec("turboquant_mse", 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(37) * 3.0
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x)
    codes = c.encode(x)
    assert (_packer(c.quantizers["i"]) is not None) == (bits <= 4)
    xf = x - c.mean.astype(mx.float32)[None, :, None, :]
    if c.perm is not None:
        xf = _permute(xf, c.perm)
    want = {}
    for g, start, width, quant in c._groups():
        want.update({f"{g}_{k}": v for k, v in quant.encode(xf[..., start: start + width]).arrays().items()})
    assert sorted(codes) == sorted(want)
    for f in want:
        assert codes[f].dtype == want[f].dtype and codes[f].shape == want[f].shape, f
        assert mx.array_equal(codes[f], want[f]).item(), f


@pytest.mark.parametrize("method,bits,n_outliers", [("turboquant_mse", 4, 0), ("turboquant_mse", 2, 8),
                                                     ("turboquant_prod", 4, 0), ("turboquant_prod", 3, 8),
                                                     ("turboquant_rvq", 2, 0), ("turboquant_mse", 8, 0)])
def test_lloyd_max_one_token_encode_is_the_chunk_encode_bit_for_bit(method, bits, n_outliers):
    """A decode token is coded by one compiled graph (`lloyd_max._token_encoder`), a chunk eagerly: the same
    arrays for the same token, a zero token and large values included, in a batch of rows."""
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = mx.concatenate([data(40) * 3.0, data(40) * -0.5], axis=0)  # (2, H, 40, 64)
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x[:1])
    whole = c.encode(x)
    for t in (0, 1, 39):
        one = c.encode(x[:, :, t:t + 1])
        assert sorted(one) == sorted(whole)
        for f in whole:
            assert one[f].dtype == whole[f].dtype, f
            assert mx.array_equal(one[f], whole[f][:, :, t:t + 1]).item(), (f, t)


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_code_layout_is_what_encode_returns(name, role, variant):
    check_layout(make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_blank_fitted_matches_a_real_fit(name, role, variant):
    check_blank_fitted(lambda: make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_fitting_without_mutation_equals_fit(name, role, variant):
    check_pure_fitting(lambda: make(name, role, **variant))


def test_every_fitted_array_is_per_head():
    """What batching rows needs: axis 0 of every fitted array is the heads (batch rows concatenate along it)."""
    for name, role in CASES:
        c = make(name, role)
        for heads in (1, 4):
            x = data(2 * max(c.token_block, 32))[:1, :1] * mx.ones((1, heads, 1, 1))
            assert all(a.shape[0] == heads for a in c.fitted_from(x).values()), (name, role)


def test_a_new_codec_is_one_file_and_one_registry_line(absmax8):
    for role in ("keys", "values"):
        c = make("absmax8", role, bits=8)
        assert type(c) is absmax8 and isinstance(c, Codec)
        check_layout(c)
        check_blank_fitted(lambda: make("absmax8", role, bits=8))
        check_pure_fitting(lambda: make("absmax8", role, bits=8))
        c, x, codes = fitted("absmax8", role, bits=8)
        y = c.decode(codes, mx.float32)
        assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x)) < 0.01
        c.check_codes(codes, "restored")
        with pytest.raises(ValueError, match="restored"):
            c.check_codes({"q": codes["q"]}, "restored")
        rng = np.random.default_rng(1)
        for rows in (1, 64):
            q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
            p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, x.shape[2])).astype(np.float32)), axis=-1)
            assert rel(c.scores(q, codes), q @ mx.swapaxes(y, -1, -2)) < 1e-5
            assert rel(c.weighted_sum(p, codes), p @ y) < 1e-5


def test_a_new_codec_runs_in_a_real_cache(absmax8):
    """The registered name builds a cache whose attention on the codes is softmax attention on its history."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    cache = TurboQuantPackedCache(codec="absmax8", k_bits=8)
    rng = np.random.default_rng(3)
    rand = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    seen = {"k": [], "v": []}
    for T in (70, 1, 1):  # a prompt, then two decode steps
        keys, values = rand(2, H, T, 64), rand(2, H, T, 64)
        seen["k"].append(keys)
        seen["v"].append(values)
        hist = cache.update_and_fetch(keys, values)
        assert hist[0].shape[2] == cache.offset == sum(a.shape[2] for a in seen["k"])
        for heads in (H, 2 * H):  # one query head per KV head, and grouped (GQA)
            q = rand(2, heads, 1, 64)
            assert rel(cache.attend_packed(q, 0.125, None), _exact_attention(q, hist[0], hist[1], 0.125)) < 1e-4
    assert type(cache.k_codec) is absmax8 and type(cache.v_codec) is absmax8
    assert cache.k_codec.fitted and sorted(cache.k_codec.fitted_arrays()) == ["mean"]
    # The history really went through the codes: coded tokens decode with 8-bit absmax error (~0.5 %), not exactly.
    n = cache.n_coded
    exact = mx.concatenate(seen["k"], axis=2)[:, :, :n]
    assert n > 0 and 0 < rel(hist[0][:, :, :n], exact) < 0.02
