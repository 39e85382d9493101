"""``affine_block_kv`` and ``affine_block_kv_mse`` (`veloxquant_mlx.codecs.affine_block_kv`): per-channel block
codes for values too. Blocks need not divide the head dim, bytes match the formula, the transposed value path
equals ``p @ decode``, and the clipped (MSE) variant picks, per group, the clip candidate of least squared error
(never worse than min-max)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.affine_block_kv import (CLIP_RATIOS, DEFAULT_BLOCK, AffineBlockKVCodec,
                                                   AffineBlockKVMSECodec, LloydMaxValueCodec, clip_candidates,
                                                   clipped_quantize)


def _x(shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_blocks_need_not_divide_the_head_dim_and_are_checked():
    c = AffineBlockKVCodec(40, 4, 128)
    assert (c.block, c.group_size, c.token_block) == (128, 128, 128)
    assert AffineBlockKVCodec(64, 4).block == DEFAULT_BLOCK
    codes = c.encode(_x((1, 2, 128, 40)))
    assert codes["w_q"].shape == (1, 2, 40, 16) and codes["scales"].shape == (1, 2, 40, 1)
    with pytest.raises(ValueError, match=r"group_size \(tokens per block\) must be one of \(32, 64, 128\) \(mx.quantize groups\), got 48"):
        AffineBlockKVCodec(64, 4, 48)


@pytest.mark.parametrize("block", [32, 128])
def test_bytes_per_token_head_counts_every_stored_byte(block):
    c = AffineBlockKVCodec(64, 3, block)
    codes = c.encode(_x((2, 2, 2 * block, 64)))
    assert c.bytes_per_token_head() == 64 * 3 / 8 + 2 * 64 * 2 / block
    assert sum(a.nbytes for a in codes.values()) == 2 * 2 * 2 * block * c.bytes_per_token_head()


@pytest.mark.parametrize("rows", [1, 20])
def test_values_on_the_codes_equal_p_at_decode(rows):
    x = _x((1, 2, 128, 64), 1) + 0.5
    c = AffineBlockKVCodec(64, 4)
    c.fit(x)
    codes = c.encode(x)
    v = c.decode(codes, mx.float32)
    p = mx.softmax(_x((1, 2, rows, 128), 2), axis=-1)
    for packed_rows in (0, 1000):
        np.testing.assert_allclose(np.array(c.weighted_sum(p, codes, packed_rows)), np.array(p @ v),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3])
def test_clipped_quantize_has_the_least_error_of_its_candidates(bits):
    block = 32
    y = _x((1, 2, 8, 128), bits) * mx.array(np.random.default_rng(9).uniform(0.5, 3, (1, 2, 8, 1)).astype(np.float32))
    cands = clip_candidates(y, block)
    assert cands.shape == (len(CLIP_RATIOS),) + tuple(y.shape)
    np.testing.assert_allclose(np.array(cands[0]), np.array(y), rtol=1e-6, atol=1e-6)  # ratio 1.0: min-max

    def group_err(w, s, b):
        back = mx.dequantize(w, s, b, group_size=block, bits=bits)
        return np.array(mx.sum(mx.square(back - y).reshape(*s.shape, block), axis=-1))

    got = group_err(*clipped_quantize(y, block, bits))
    each = np.stack([group_err(*mx.quantize(cands[r], group_size=block, bits=bits)) for r in range(len(CLIP_RATIOS))])
    np.testing.assert_allclose(got, each.min(axis=0), rtol=1e-5, atol=1e-7)
    assert np.all(got <= each[0] * (1 + 1e-6)) and got.sum() < 0.95 * each[0].sum()


def test_the_mse_codec_codes_with_clipping_and_loses_less():
    x = _x((1, 2, 256, 64), 5)
    err = {}
    for cls in (AffineBlockKVCodec, AffineBlockKVMSECodec):
        c = cls(64, 2, 64, center=False)
        err[cls] = float(mx.mean(mx.square(c.decode(c.encode(x), mx.float32) - x)))
    assert err[AffineBlockKVMSECodec] < 0.9 * err[AffineBlockKVCodec], err
    c = AffineBlockKVMSECodec(64, 2, 64, center=False)
    y = mx.swapaxes(c.rotate(x), -1, -2)
    w, s, b = clipped_quantize(y, 64, 2)
    codes = c.encode(x)
    assert bool(mx.array_equal(codes["w_q"], w))


def test_lloyd_max_values_accept_the_keys_block_as_group_size():
    assert LloydMaxValueCodec.GROUP_SIZES == (32, 64, 128)
    from veloxquant_mlx.codecs import CODECS

    assert CODECS["kblock_vlloyd"].values is LloydMaxValueCodec
    assert CODECS["kblock_vlloyd"].keys is AffineBlockKVMSECodec
