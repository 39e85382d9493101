"""The affine codecs (AffineRotatedCodec, AffineBlockKeyCodec): round trip, bytes, state, options and validation.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.attention.packed_sdpa import CodedPart, packed_attention
from veloxquant_mlx.codecs import AffineBlockKeyCodec, AffineRotatedCodec
from _packed_attention_helpers import D, rand, assert_close


# -- AffineRotatedCodec ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_affine_codec_round_trip_and_bytes(bits, rotation):
    x = rand((2, 3, 50, D), 0, offset=2.0)
    c = AffineRotatedCodec(D, bits, seed=5, rotation=rotation)
    assert not c.fitted
    c.fit(x)
    assert c.fitted and c.mean.shape == (3, D)
    arrays = c.encode(x)
    assert set(arrays) == {"w_q", "scales", "biases"}
    for a in arrays.values():
        assert a.shape[:3] == (2, 3, 50)
    assert arrays["scales"].dtype == mx.float16
    per_token = sum(a.nbytes for a in arrays.values()) / (2 * 3 * 50)
    assert per_token == c.bytes_per_token_head()
    y = c.decode(arrays, mx.float32)
    rel = float(mx.linalg.norm(y - x) / mx.linalg.norm(x - c.mean[None, :, None, :]))
    assert rel < 2.0 ** (1 - bits)  # affine error halves with each bit (0.5 at 2 bits, ~0.008 at 8)
    # The rotation really is orthogonal and is what attention needs: stored = Pi (x - mu).
    pi = c.rotation_matrix
    np.testing.assert_allclose(np.array(pi @ pi.T), np.eye(D), atol=1e-5)
    np.testing.assert_allclose(np.array(c.rotate(x)), np.array((x - c.mean[None, :, None, :]) @ pi.T), atol=1e-4)


def test_affine_codec_state_and_options():
    x = rand((1, 2, 20, D), 1, offset=1.0)
    c = AffineRotatedCodec(D, 4, seed=2, scale_dtype="float32")
    c.fit(x)
    arrays = c.encode(x)
    assert arrays["scales"].dtype == mx.float32
    c2 = AffineRotatedCodec(D, 4, seed=2, scale_dtype="float32")
    c2.load_fitted(c.fitted_arrays())
    assert c2.fitted
    np.testing.assert_array_equal(np.array(c2.decode(arrays, mx.float32)), np.array(c.decode(arrays, mx.float32)))
    nc = AffineRotatedCodec(D, 4, center=False)
    assert nc.fitted and nc.fitted_arrays() == {}
    assert AffineRotatedCodec(32, 4).group_size == 32
    assert AffineRotatedCodec(128, 4).group_size == 64
    assert c.decode(arrays, mx.bfloat16).dtype == mx.bfloat16


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        (dict(d=64, bits=7), ValueError, "bits"),
        (dict(d=64, bits=4.0), TypeError, "bits"),
        (dict(d=64, bits=4, group_size=16), ValueError, "group_size"),
        (dict(d=96, bits=4, group_size=64), ValueError, "multiple"),
        (dict(d=64, bits=4, rotation="fourier"), ValueError, "rotation"),
        (dict(d=64, bits=4, scale_dtype="int8"), ValueError, "scale_dtype"),
        (dict(d=64, bits=4, center=1), TypeError, "center"),
    ],
)
def test_affine_codec_validation(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        AffineRotatedCodec(**kwargs)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_block_key_codec(bits):
    x = rand((2, 3, 128, D), 2, offset=1.5)
    c = AffineBlockKeyCodec(D, bits, seed=3)
    assert c.token_block == 64 and AffineRotatedCodec(D, bits).token_block == 1
    c.fit(x)
    arrays = c.encode(x)
    assert arrays["w_q"].shape == (2, 3, D, 128 * bits // 32)  # K^T layout, token axis last
    assert arrays["scales"].shape == arrays["biases"].shape == (2, 3, D, 2)
    assert c.n_tokens(arrays) == 128
    assert sum(a.nbytes for a in arrays.values()) / (2 * 3 * 128) == c.bytes_per_token_head()
    y = c.decode(arrays, mx.float32)
    rel = float(mx.linalg.norm(y - x) / mx.linalg.norm(x - mx.mean(x, axis=2, keepdims=True)))
    assert rel < 2.0 ** (1 - bits)
    # The mean is folded into the biases: the rotated codes decode to Pi x itself, and centring never
    # hurts (it helps most at 2 bits, where the zero-point of MLX's affine format costs the most).
    np.testing.assert_allclose(np.array(c.rotation.invert(c.decode_rotated(arrays))), np.array(y), atol=1e-5)
    plain = AffineBlockKeyCodec(D, bits, seed=3, center=False)
    y_plain = plain.decode(plain.encode(x), mx.float32)
    assert float(mx.linalg.norm(y - x)) <= 1.02 * float(mx.linalg.norm(y_plain - x))
    # Blocks are independent: coding the halves apart and concatenating equals coding them together,
    # and slicing whole blocks back out gives each half.
    halves = [c.encode(x[:, :, i : i + 64]) for i in (0, 64)]
    joined = c.concat(halves)
    for name in arrays:
        np.testing.assert_array_equal(np.array(joined[name]), np.array(arrays[name]))
        np.testing.assert_array_equal(np.array(c.slice_tokens(arrays, 64, 128)[name]), np.array(halves[1][name]))
    # Used as values too (decoded: correct, not the fast path).
    q = rand((2, 6, 2, D), 3)
    out = packed_attention(q, [CodedPart(c, arrays, c, arrays)], 0.1, "causal")
    ref = mx.fast.scaled_dot_product_attention(q, y, y, scale=0.1, mask=create_causal_mask(2, 126))
    assert_close(out, ref)
    with pytest.raises(ValueError, match="multiple of block"):
        c.encode(x[:, :, :100])
    with pytest.raises(ValueError, match="whole blocks"):
        c.decode({k: a[..., :3] for k, a in arrays.items()}, mx.float32)
    with pytest.raises(ValueError, match="aligned"):
        c.slice_tokens(arrays, 0, 100)


def test_affine_codec_rejects_bad_tensors():
    c = AffineRotatedCodec(D, 4)
    with pytest.raises(ValueError, match="head_dim"):
        c.encode(mx.zeros((1, 1, 2, 32)))
    with pytest.raises(ValueError, match="shape"):
        c.fit(mx.zeros((2, D)))
    with pytest.raises(ValueError, match="missing"):
        c.decode({"w_q": mx.zeros((1, 1, 1, 8), dtype=mx.uint32)}, mx.float32)
