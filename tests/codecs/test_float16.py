"""``float16`` (`veloxquant_mlx.codecs.float16`): the trivial layout -- a cast to float16 (finite values beyond
its range clamped, inf and NaN kept), plain matmuls for attention, nothing fitted, 16 bits only."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.codecs.float16 import Float16Codec


def test_encode_is_a_clamped_cast_and_decode_a_cast():
    c = Float16Codec(4)
    x = mx.array([[[[1.0 / 3, 1e5, float("-inf"), float("nan")]]]])
    codes = c.encode(x)
    assert list(codes) == ["x"] and codes["x"].dtype == mx.float16 and codes["x"].shape == (1, 1, 1, 4)
    got = codes["x"].astype(mx.float32).tolist()[0][0][0]
    assert got[0] == float(np.float16(1.0 / 3)) and got[1] == 65504.0 and got[2] == float("-inf")
    assert np.isnan(got[3])
    assert c.decode(codes, mx.bfloat16).dtype == mx.bfloat16


def test_attention_is_plain_matmuls_on_the_stored_halves():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 2, 6, 8)).astype(np.float32))
    c = Float16Codec(8)
    codes = c.encode(x)
    k = codes["x"].astype(mx.float32)
    q = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
    p = mx.softmax(mx.array(rng.standard_normal((1, 2, 3, 6)).astype(np.float32)), axis=-1)
    assert bool(mx.array_equal(c.scores(q, codes), q @ mx.swapaxes(k, -1, -2)))
    assert bool(mx.array_equal(c.weighted_sum(p, codes), p @ k))
    assert c.decoded_offset() is None


def test_nothing_is_fitted_and_only_16_bits_exist():
    c = Float16Codec.from_options(CacheOptions(codec="float16", k_bits=16, v_bits=16), "values", 8)
    assert c.bits == 16 and c.d == 8 and c.fitted and c.fitted_arrays() == {} and c.blank_fitted(3) == {}
    assert c.fitted_from(mx.zeros((1, 2, 3, 8))) == {}
    with pytest.raises(ValueError, match="bits must be 16 for the float16 codec, got 8"):
        Float16Codec(8, 8)
    with pytest.raises(ValueError, match="head_dim 4, but this was set up for head_dim=8"):
        c.encode(mx.zeros((1, 1, 2, 4)))
