"""``kblock_vsym8`` values (`veloxquant_mlx.codecs.affine_sym_log`): symmetric codes whose group scales are
one-byte codes on a log grid of 8 points per octave. The grid, the scale chosen among the candidates at and below
``max|y| / c`` (least squared error), and the codec's decode through the grid."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.affine_sym import pack_codes
from veloxquant_mlx.codecs.affine_sym_log import (CLIP_STEPS, LOG_OFFSET, LOG_STEPS, NON_FINITE,
                                                  AffineSymLogScaleValueCodec, decode_log_scales, log_scale_codes,
                                                  reference_sym_log_encode)


def test_the_grid_is_eight_points_per_octave():
    codes = mx.arange(1, 255).astype(mx.uint8)
    s = np.array(decode_log_scales(codes), dtype=np.float64)
    np.testing.assert_allclose(s[1:] / s[:-1], 2 ** (1 / LOG_STEPS), rtol=1e-6)
    assert s[LOG_OFFSET - 1] == 1.0 and decode_log_scales(mx.array([0], dtype=mx.uint8)).item() == 0.0
    assert np.isnan(decode_log_scales(mx.array([NON_FINITE], dtype=mx.uint8)).item())


@pytest.mark.parametrize("bits", [3, 4])
def test_the_chosen_scale_is_the_best_of_its_candidates(bits):
    rng = np.random.default_rng(bits)
    y = mx.array((rng.standard_normal((6, 64)) * rng.uniform(0.01, 50, (6, 1))).astype(np.float32))
    q, code = log_scale_codes(y, bits, 64)
    c = (2 ** bits - 1) / 2
    yn, qn, cn = np.array(y, dtype=np.float64), np.array(q), np.array(code).astype(np.int64)[:, 0]
    s = 2.0 ** ((cn - LOG_OFFSET) / LOG_STEPS)
    err = ((s[:, None] * (qn - c) - yn) ** 2).sum(-1)
    top = np.ceil(LOG_STEPS * np.log2(np.abs(yn).max(-1) / c)) + LOG_OFFSET  # the first grid point >= max|y| / c
    assert np.all((cn <= top) & (cn > top - CLIP_STEPS))
    for k in range(CLIP_STEPS):
        sk = 2.0 ** ((top - k - LOG_OFFSET) / LOG_STEPS)
        qk = np.clip(np.round(yn / sk[:, None] + c), 0, 2 ** bits - 1)
        assert np.all(err <= ((sk[:, None] * (qk - c) - yn) ** 2).sum(-1) * (1 + 1e-4) + 1e-9)


def test_codec_decodes_through_the_grid_and_keeps_non_finite_visible():
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32))
    c = AffineSymLogScaleValueCodec(64, 4, center=False)
    codes = c.encode(x)
    assert codes["scales"].dtype == mx.uint8 and codes["scales"].shape == (1, 2, 5, 1)
    assert sum(a.nbytes for a in codes.values()) == 2 * 5 * c.bytes_per_token_head() == 2 * 5 * (32 + 1)
    q, code = log_scale_codes(c.rotate(x), 4, 64)
    assert bool(mx.array_equal(codes["w_q"], pack_codes(q, 4))) and bool(mx.array_equal(codes["scales"], code))
    want = c.rotation.invert(decode_log_scales(code) * (q - 7.5))
    np.testing.assert_allclose(np.array(c.decode(codes, mx.float32)), np.array(want), rtol=1e-5, atol=1e-5)
    ac = c.affine_codes(codes)
    assert ac.scales.dtype == mx.uint8 and ac.biases is None and ac.zero == 7.5
    bad = mx.concatenate([x[:, :, :1] * float("nan"), x[:, :, 1:]], axis=2)
    y = np.array(c.decode(c.encode(bad), mx.float32))
    assert np.all(np.isnan(y[:, :, 0])) and np.all(np.isfinite(y[:, :, 1:]))
    with pytest.raises(ValueError, match=r"missing \['w_q'\]"):
        c.decode({"scales": codes["scales"]}, mx.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_the_compiled_encoding_is_the_operations_bit_for_bit(bits, group):
    """`sym_log_encode` (the kernel module's one operation) stores what `reference_sym_log_encode` stores: every
    word and scale code, at small, unit and large magnitudes, a group of zeros, through a strided view; a group
    holding NaN gets the non-finite scale code either way."""
    from veloxquant_mlx.attention import kernel

    mod = kernel.compiled_module()
    assert mod is not None and hasattr(mod, "sym_log_encode"), kernel.status()[1]  # (CI builds the kernel)
    for scale in (1e-3, 1.0, 300.0):
        y = mx.random.normal((2, 3, 21, 128), key=mx.random.key(bits * 7 + group)) * scale
        y = mx.concatenate([y, mx.zeros((2, 3, 1, 128))], axis=2)
        for got, want in zip(mod.sym_log_encode(y, bits, group), reference_sym_log_encode(y, bits, group)):
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    yt = mx.swapaxes(mx.random.normal((1, 2, 128, 64), key=mx.random.key(1)), -1, -2)  # (strided: d is axis 2's)
    for got, want in zip(mod.sym_log_encode(yt, bits, group), reference_sym_log_encode(yt, bits, group)):
        assert mx.array_equal(got, want).item()
    nan = mx.where(mx.arange(64) == 5, mx.array(float("nan")), mx.random.normal((1, 1, 2, 64)))
    got, want = mod.sym_log_encode(nan, bits, 32)[1], reference_sym_log_encode(nan, bits, 32)[1]  # (1, 1, 2, 2)
    assert got[..., 0].tolist() == want[..., 0].tolist() == [[[NON_FINITE, NON_FINITE]]]
    assert mx.array_equal(got[..., 1], want[..., 1]).item()  # (the finite groups: as ever)
