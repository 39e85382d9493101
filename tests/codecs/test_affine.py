"""``affine`` (`veloxquant_mlx.codecs.affine`): centre, rotate, MLX affine codes per token. The codes are
``mx.quantize`` of ``Pi (x - mu)`` (read back by ``mx.dequantize``), the decode undoes the rotation and adds the
mean, both attention paths (quantized matmul and decode-once) give the decoded math, the stored bytes are what
``bytes_per_token_head`` says, and keys and values of one cache get independent rotations."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.codecs.affine import AffineRotatedCodec, default_group_size


def _x(shape, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    return mx.array(x + offset * rng.standard_normal((1, shape[1], 1, shape[3])).astype(np.float32))


def test_default_group_size_is_the_first_of_64_128_32_dividing_d():
    assert [default_group_size(d) for d in (64, 128, 96, 32, 160, 40)] == [64, 64, 32, 32, 32, None]
    with pytest.raises(ValueError, match=r"d=40 has no mx.quantize group size dividing it"):
        AffineRotatedCodec(40, 4)
    assert AffineRotatedCodec(96, 4).group_size == 32


@pytest.mark.parametrize("bits", [3, 4])
def test_codes_are_mx_quantize_of_the_centred_rotated_vectors(bits):
    x = _x((1, 2, 9, 64), 1, offset=2.0)
    c = AffineRotatedCodec(64, bits, seed=4, scale_dtype="float32")
    c.fit(x)
    np.testing.assert_allclose(np.array(c.mean), np.array(mx.mean(x, axis=(0, 2))), rtol=1e-6, atol=1e-6)
    y = c.rotation.apply(x - c.mean[None, :, None, :])
    w, s, b = mx.quantize(y, group_size=64, bits=bits)
    codes = c.encode(x)
    assert bool(mx.array_equal(codes["w_q"], w))
    np.testing.assert_allclose(np.array(codes["scales"]), np.array(s), rtol=1e-6)
    np.testing.assert_allclose(np.array(codes["biases"]), np.array(b), rtol=1e-6, atol=1e-7)
    # decode: Pi^T dequantize(...) + mu
    want = c.rotation.invert(mx.dequantize(w, s, b, group_size=64, bits=bits)) + c.mean[None, :, None, :]
    np.testing.assert_allclose(np.array(c.decode(codes, mx.float32)), np.array(want), rtol=1e-5, atol=1e-5)


def test_centring_pays_off_on_an_offset_stream():
    x = _x((1, 2, 64, 64), 2, offset=6.0)
    err = {}
    for center in (True, False):
        c = AffineRotatedCodec(64, 3, center=center)
        c.fit(x)
        err[center] = float(mx.linalg.norm(c.decode(c.encode(x), mx.float32) - x))
    assert err[True] < 0.5 * err[False], err


@pytest.mark.parametrize("scale_dtype,itemsize", [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_bytes_per_token_head_counts_every_stored_byte(scale_dtype, itemsize):
    c = AffineRotatedCodec(128, 4, 32, scale_dtype=scale_dtype)
    codes = c.encode(_x((2, 3, 5, 128)))
    assert codes["scales"].dtype == getattr(mx, scale_dtype)
    assert c.bytes_per_token_head() == 128 * 4 / 8 + 2 * (128 // 32) * itemsize
    assert sum(a.nbytes for a in codes.values()) == 2 * 3 * 5 * c.bytes_per_token_head()


@pytest.mark.parametrize("rows", [1, 40])
def test_both_attention_paths_give_the_decoded_math(rows):
    x = _x((1, 2, 24, 64), 3, offset=1.0)
    c = AffineRotatedCodec(64, 4)
    c.fit(x)
    codes = c.encode(x)
    k = c.decode(codes, mx.float32)
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((1, 2, rows, 64)).astype(np.float32))
    p = mx.softmax(mx.array(rng.standard_normal((1, 2, rows, 24)).astype(np.float32)), axis=-1)
    for packed_rows in (0, 1000):  # decode once + BLAS, then the quantized matmul
        np.testing.assert_allclose(np.array(c.scores(q, codes, packed_rows)), np.array(q @ mx.swapaxes(k, -1, -2)),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(c.weighted_sum(p, codes, packed_rows)), np.array(p @ k),
                                   rtol=1e-4, atol=1e-4)


def test_from_options_gives_keys_and_values_independent_rotations():
    opts = CacheOptions(codec="affine", k_bits=4, v_bits=3, seed=7, center_keys=False)
    k, v = AffineRotatedCodec.from_options(opts, "keys", 64), AffineRotatedCodec.from_options(opts, "values", 64)
    assert (k.bits, k.seed, k.center) == (4, 7, False) and (v.bits, v.seed, v.center) == (3, 1007, True)
    assert not np.allclose(np.array(k.rotation_matrix), np.array(v.rotation_matrix))
    assert "AffineRotatedCodec(d=64, bits=4, group_size=64, seed=7" in repr(k)
    ac = v.affine_codes(v.encode(_x((1, 2, 3, 64))))
    assert (ac.bits, ac.group, ac.tokens_last, ac.biases is not None) == (3, 64, False, True)
