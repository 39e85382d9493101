"""``token_lloyd8`` (`veloxquant_mlx.codecs.token_lloyd`): per-token Lloyd-Max codes with one-byte log-grid scales.
The levels, the scale chosen among its candidates, the compiled encoding against the operations (bit for bit), the
three encoding paths of a codec, what it saves against uniform levels at the same bytes, non-finite groups."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.affine_sym_log import LOG_OFFSET, LOG_STEPS, NON_FINITE, AffineSymLogScaleValueCodec
from veloxquant_mlx.codecs.token_lloyd import (SCALE_STEPS, TokenLloydCodec, gaussian_levels,
                                               reference_level_log_encode)
from veloxquant_mlx.quant.bit_pack import unpack


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_levels_are_the_gaussian_lloyd_max_code(bits):
    levels, inner = (np.array(a, dtype=np.float64) for a in gaussian_levels(bits))
    assert levels.shape == (2 ** bits,) and inner.shape == (2 ** bits - 1,)
    assert np.all(np.diff(levels) > 0) and np.allclose(levels, -levels[::-1], atol=1e-5)
    np.testing.assert_allclose(inner, (levels[1:] + levels[:-1]) / 2, rtol=1e-4, atol=1e-5)  # (nearest level)
    # each level is the mean of a standard normal over its interval (Lloyd's condition), checked by sampling
    x = np.random.default_rng(bits).standard_normal(400_000)
    q = np.searchsorted(inner, x)
    for i in range(2 ** bits):
        if (q == i).sum() > 2000:
            assert abs(x[q == i].mean() - levels[i]) < 0.02 * max(1.0, abs(levels[i])), (i, levels[i])


@pytest.mark.parametrize("bits", [3, 4])
def test_the_chosen_scale_is_the_best_of_its_candidates(bits):
    rng = np.random.default_rng(bits)
    y = mx.array((rng.standard_normal((1, 1, 6, 64)) * rng.uniform(0.01, 50, (1, 1, 6, 1))).astype(np.float32))
    levels, inner = gaussian_levels(bits)
    w, code = reference_level_log_encode(y, levels, inner, bits, 64)
    q = np.array(unpack(w, bits, 64))[0, 0]
    yn, lv = np.array(y, dtype=np.float64)[0, 0], np.array(levels, dtype=np.float64)
    cn = np.array(code).astype(np.int64)[0, 0, :, 0]
    s = 2.0 ** ((cn - LOG_OFFSET) / LOG_STEPS)
    err = ((s[:, None] * lv[q] - yn) ** 2).sum(-1)
    mid = np.round(LOG_STEPS * np.log2(np.sqrt((yn ** 2).mean(-1)))) + LOG_OFFSET
    assert np.all((cn >= mid + SCALE_STEPS[0]) & (cn < mid + SCALE_STEPS[1]))
    for k in range(*SCALE_STEPS):
        sk = 2.0 ** ((mid + k - LOG_OFFSET) / LOG_STEPS)
        qk = np.searchsorted(np.array(inner, dtype=np.float64), yn / sk[:, None])
        assert np.all(err <= ((sk[:, None] * lv[qk] - yn) ** 2).sum(-1) * (1 + 1e-4) + 1e-9)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_the_compiled_encoding_is_the_operations_bit_for_bit(bits, group):
    """``level_log_encode`` (the kernel module's one operation) stores what `reference_level_log_encode` stores at
    small, unit and large magnitudes, with a group of zeros, through a strided view; NaN groups get the non-finite
    scale code either way."""
    from veloxquant_mlx.attention import kernel

    mod = kernel.compiled_module()
    assert mod is not None and hasattr(mod, "level_log_encode"), kernel.status()[1]  # (CI builds the kernel)
    levels, inner = gaussian_levels(bits)
    for scale in (1e-3, 1.0, 300.0):
        y = mx.random.normal((2, 3, 21, 128), key=mx.random.key(bits * 7 + group)) * scale * mx.linspace(0.1, 3, 128)
        y = mx.concatenate([y, mx.zeros((2, 3, 1, 128))], axis=2)
        for got, want in zip(mod.level_log_encode(y, levels, inner, bits, group),
                             reference_level_log_encode(y, levels, inner, bits, group)):
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    yt = mx.swapaxes(mx.random.normal((1, 2, 128, 64), key=mx.random.key(1)), -1, -2)
    for got, want in zip(mod.level_log_encode(yt, levels, inner, bits, group),
                         reference_level_log_encode(yt, levels, inner, bits, group)):
        assert mx.array_equal(got, want).item()
    nan = mx.where(mx.arange(64) == 5, mx.array(float("nan")), mx.random.normal((1, 1, 2, 64)))
    got = mod.level_log_encode(nan, levels, inner, bits, 32)[1]
    want = reference_level_log_encode(nan, levels, inner, bits, 32)[1]
    assert got[..., 0].tolist() == want[..., 0].tolist() == [[[NON_FINITE, NON_FINITE]]]
    assert mx.array_equal(got[..., 1], want[..., 1]).item()
    with pytest.raises(ValueError, match="levels must be float32"):
        mod.level_log_encode(y, levels[:-1], inner, bits, group)


@pytest.mark.parametrize("module", ["affine_sym_log", "token_lloyd"])
def test_the_codecs_encode_through_the_compiled_operation_and_without_it(module):
    """A cache's codec (`kblock_vsym8`'s symmetric values, `token_lloyd8`'s codes) gives the same codes whether its
    compiled operation runs, a few tokens are fused by mx.compile, or a chunk runs the plain operations."""
    import importlib

    from veloxquant_mlx.cache import row_codes  # noqa: F401  (sets the compiled providers, as the caches do)

    m = importlib.import_module(f"veloxquant_mlx.codecs.{module}")
    codec = (TokenLloydCodec if module == "token_lloyd" else AffineSymLogScaleValueCodec)(64, 4, seed=3)
    x = mx.random.normal((1, 2, 3, 64), key=mx.random.key(2))
    long = mx.random.normal((1, 2, 40, 64), key=mx.random.key(4))
    with_op = [codec.encode(a) for a in (x, long)]
    provider = m._compiled_provider
    assert provider is not None and provider() is not None
    m.set_compiled_provider(None)
    try:
        without = [codec.encode(a) for a in (x, long)]
    finally:
        m.set_compiled_provider(provider)
    for a, b in zip(with_op, without):
        assert all(mx.array_equal(a[n], b[n]).item() for n in ("w_q", "scales"))


@pytest.mark.parametrize("bits,gain", [(2, 0.05), (3, 0.08), (4, 0.12)])
def test_less_squared_error_than_uniform_levels_at_the_same_bytes(bits, gain):
    """On head vectors with unequal channels (rotated: close to Gaussian) the Lloyd-Max levels lose less than
    ``kblock_vsym8``'s uniform symmetric levels with the same one-byte scales (measured ~8 / 11 / 19 %)."""
    x = mx.random.normal((1, 3, 400, 64), key=mx.random.key(bits)) * mx.linspace(0.2, 3, 64)
    lloyd, uniform = TokenLloydCodec(64, bits, center=False), AffineSymLogScaleValueCodec(64, bits, center=False)
    e = [mx.mean(mx.square(c.decode(c.encode(x), mx.float32) - x)).item() for c in (lloyd, uniform)]
    assert e[0] < (1 - gain) * e[1], e
    assert lloyd.bytes_per_token_head() == uniform.bytes_per_token_head() == 64 * bits / 8 + 1


def test_codec_decodes_its_levels_and_keeps_non_finite_visible():
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32))
    c = TokenLloydCodec(64, 4, center=False)
    codes = c.encode(x)
    assert codes["scales"].dtype == mx.uint8 and codes["w_q"].shape == (1, 2, 5, 8)
    ac = c.affine_codes(codes)
    assert ac.levels is c.levels and ac.biases is None and ac.zero == 0.0 and not ac.tokens_last
    q = np.array(unpack(codes["w_q"], 4, 64))
    s = 2.0 ** ((np.array(codes["scales"]).astype(np.float64) - LOG_OFFSET) / LOG_STEPS)
    want = c.rotation.invert(mx.array((np.array(c.levels)[q] * s).astype(np.float32)))
    np.testing.assert_allclose(np.array(c.decode(codes, mx.float32)), np.array(want), rtol=1e-5, atol=1e-5)
    bad = mx.concatenate([x[:, :, :1] * float("nan"), x[:, :, 1:]], axis=2)
    y = np.array(c.decode(c.encode(bad), mx.float32))
    assert np.all(np.isnan(y[:, :, 0])) and np.all(np.isfinite(y[:, :, 1:]))
    zero = np.array(c.decode(c.encode(mx.zeros((1, 1, 2, 64))), mx.float32))
    assert np.all(zero == 0)
    with pytest.raises(ValueError, match=r"missing \['w_q'\]"):
        c.decode({"scales": codes["scales"]}, mx.float32)
