"""`veloxquant_mlx.quant.quantizer_common`: the checks and helpers the three quantizers share -- float inputs
(numpy float64 taken as float32), norms that cannot overflow, zero rows, codes checked against the quantizer,
queries checked against the codes' batch shape, float16 norm storage, and decode clipped to the output range."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.quantizer_common import (NORM_DTYPES, StoredNorms, as_float_input, as_query, check_encoded,
                                                   safe_norm, scores, store_norms, to_output_dtype, unit_and_norm)


def test_as_float_input():
    x, name = as_float_input(np.ones((2, 4), dtype=np.float64), 4)
    assert x.dtype == mx.float32 and name == "float32"
    x, name = as_float_input(mx.ones((3, 4), dtype=mx.bfloat16), 4)
    assert x.dtype == mx.float32 and name == "bfloat16"
    with pytest.raises(TypeError, match="k must have a float dtype, got numpy int64"):
        as_float_input(np.ones((2, 4), dtype=np.int64), 4, "k")
    with pytest.raises(TypeError, match=r"x must have a float dtype \(float16, bfloat16, float32\), got mlx.core.int32"):
        as_float_input(mx.ones((2, 4), dtype=mx.int32), 4)
    with pytest.raises(TypeError, match="x must be an mx.array or numpy.ndarray, got list"):
        as_float_input([[1.0] * 4], 4)
    with pytest.raises(ValueError, match=r"x must have shape \(..., d\) with d=4, got \(2, 5\)"):
        as_float_input(mx.ones((2, 5)), 4)
    with pytest.raises(ValueError, match=r"got \(\)"):
        as_float_input(mx.array(1.0), 4)


def test_norms_do_not_overflow_and_zero_rows_stay_zero():
    x = mx.array([[3e30, 4e30], [0.0, 0.0], [3.0, -4.0]])
    n = safe_norm(x)
    assert math.isfinite(n[0].item()) and n[0].item() == pytest.approx(5e30, rel=1e-6)
    u, norms = unit_and_norm(x)
    assert norms.tolist()[1:] == [0.0, 5.0]
    np.testing.assert_allclose(np.array(u), [[0.6, 0.8], [0.0, 0.0], [0.6, -0.8]], rtol=1e-6)


def test_codes_are_checked_against_the_quantizer():
    ev = EncodedVector("turboquant_mse", 8, indices=mx.zeros((3, 8), dtype=mx.uint8), norms=mx.ones((3,)))
    check_encoded(ev, "turboquant_mse", 8)
    with pytest.raises(TypeError, match="ev must be an EncodedVector .what encode returns., got dict"):
        check_encoded({}, "turboquant_mse", 8)
    with pytest.raises(ValueError, match="ev was encoded by 'turboquant_mse', this quantizer is 'turboquant_rvq'"):
        check_encoded(ev, "turboquant_rvq", 8)
    with pytest.raises(ValueError, match="ev has dim 8, this quantizer has d=16"):
        check_encoded(ev, "turboquant_mse", 16)
    ev.norms = mx.ones((3,), dtype=mx.int32)
    with pytest.raises(ValueError, match=r"ev.norms must be a float array .* of shape \(3,\), got mlx.core.int32"):
        check_encoded(ev, "turboquant_mse", 8)


def test_queries_broadcast_with_the_codes_and_scores_have_the_documented_shapes():
    assert as_query(mx.ones((2, 1, 5, 4)), 4, (2, 3, 7)).shape == (2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"q has shape \(4, 5, 4\): its leading axes \(4,\) do not broadcast with "
                                         r"the codes' \(2, 3\)"):
        as_query(mx.ones((4, 5, 4)), 4, (2, 3, 7))
    k = mx.ones((2, 7, 4))
    assert scores(mx.ones((4,)), k).shape == (2, 7)
    assert scores(mx.ones((2, 5, 4)), k).shape == (2, 5, 7)
    assert scores(mx.ones((5, 4)), mx.ones((4,))).shape == (5,)  # one key
    assert scores(mx.array([1.0, 2.0]), mx.array([[3.0, 4.0]])).tolist() == [11.0]


def test_float16_norm_storage_and_output_clipping():
    norms = mx.array([1.0, 7e4])
    with pytest.raises(ValueError, match=r"norm_dtype='float16' cannot store these vector norms \(range \[1, 7e\+04\]"):
        store_norms(norms, mx.float16)
    with pytest.raises(ValueError, match="range"):
        store_norms(mx.array([1e-6, 1.0]), mx.float16)
    assert store_norms(mx.array([0.0, 2.0]), mx.float16).tolist() == [0.0, 2.0]  # zero is fine
    assert store_norms(norms, mx.bfloat16).dtype == mx.bfloat16
    out = to_output_dtype(mx.array([7e4, -7e4, float("nan"), 1.5]), "float16")
    vals = out.astype(mx.float32).tolist()
    assert out.dtype == mx.float16 and vals[:2] == [65504.0, -65504.0] and math.isnan(vals[2]) and vals[3] == 1.5
    assert to_output_dtype(mx.array([7e4]), "float32").tolist() == [7e4]


def test_stored_norms_reads_the_dtype_from_its_name():
    class Q(StoredNorms):
        norm_dtype_name = "float16"

    assert Q().norm_dtype == mx.float16 and set(NORM_DTYPES) == {"bfloat16", "float16", "float32"}
