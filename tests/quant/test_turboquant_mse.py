"""TurboQuant-MSE (`veloxquant_mlx.quant.turboquant_mse`): distortion against theory and the paper, norm storage
dtypes, rotation and codebook variants, parameter and input validation, float16 norms and NaN on decode."""
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.quant.codebooks import lloyd_max_codebook, lower_bound_d_mse
from veloxquant_mlx.quant.turboquant_mse import TurboQuantMSE
from veloxquant_mlx.quant.turboquant_prod import TurboQuantProd
from veloxquant_mlx.quant.turboquant_rvq import TurboQuantRVQ
from _quantizer_helpers import DIMS, _d_mse, unit_vectors  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def mse_measured(unit_vectors):
    return {(d, b): _d_mse(unit_vectors[d], TurboQuantMSE(d, b).decode(TurboQuantMSE(d, b).encode(unit_vectors[d])))
            for d in DIMS for b in range(1, 9)}


@pytest.mark.parametrize("d", DIMS)
def test_mse_distortion_matches_theory(mse_measured, d):
    measured = [mse_measured[(d, b)] for b in range(1, 9)]
    for b, m in zip(range(1, 9), measured):
        theory = lloyd_max_codebook("beta", b, d=d).d_mse
        assert m == pytest.approx(theory, rel=0.02), (d, b, m, theory)
        assert m >= lower_bound_d_mse(b)
    assert all(x > y for x, y in zip(measured, measured[1:]))
    if d == 128:
        for b, paper in {1: 0.361, 2: 0.116, 3: 0.034, 4: 0.0093}.items():
            assert measured[b - 1] == pytest.approx(paper, rel=0.04)


def test_norm_dtypes_and_nbytes():
    d = 128
    x = mx.array(np.random.default_rng(0).standard_normal((10, d)).astype(np.float32))
    for nd, size in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        ev = TurboQuantMSE(d, 4, norm_dtype=nd).encode(x)
        assert ev.norms.dtype == getattr(mx, nd)
        assert ev.nbytes == 10 * (d * 4 // 8 + size)
    with pytest.raises(ValueError, match="norm_dtype"):
        TurboQuantMSE(d, 4, norm_dtype="float64")


def test_hadamard_and_gaussian_variants(unit_vectors):
    d = 128
    x = unit_vectors[d][:5000]
    theory = lloyd_max_codebook("beta", 3, d=d).d_mse
    for kw in ({"rotation": "hadamard"}, {"codebook": "gaussian"}):
        quant = TurboQuantMSE(d, 3, **kw)
        assert _d_mse(x, quant.decode(quant.encode(x))) == pytest.approx(theory, rel=0.05)


def test_rotation_independent_of_user_data_seed():
    # data drawn with default_rng(seed) must not coincide with the rotation's random stream
    d = 64
    x = np.random.default_rng(0).standard_normal((2000, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    quant = TurboQuantMSE(d, 4, seed=0)
    measured = _d_mse(mx.array(x), quant.decode(quant.encode(mx.array(x))))
    assert measured == pytest.approx(quant.expected_d_mse, rel=0.05)


@pytest.mark.parametrize("kwargs,err,match", [
    ({"d": 1, "b": 4}, ValueError, "d"), ({"d": 64.0, "b": 4}, TypeError, "d"), ({"d": 64, "b": 0}, ValueError, "b"),
    ({"d": 64, "b": 9}, ValueError, "b"), ({"d": 64, "b": True}, TypeError, "b"),
    ({"d": 64, "b": 4, "seed": -1}, ValueError, "seed"), ({"d": 64, "b": 4, "seed": 1.5}, TypeError, "seed"),
    ({"d": 64, "b": 4, "rotation": "x"}, ValueError, "rotation"),
    ({"d": 64, "b": 4, "codebook": "laplace"}, ValueError, "codebook")])
def test_param_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        TurboQuantMSE(**kwargs)


def test_input_validation():
    quant = TurboQuantMSE(64, 2)
    with pytest.raises(ValueError, match="d=64"):
        quant.encode(mx.zeros((3, 32)))
    with pytest.raises(TypeError, match="float"):
        quant.encode(mx.zeros((3, 64), dtype=mx.int32))
    with pytest.raises(TypeError, match="float"):
        quant.encode(np.zeros((3, 64), dtype=np.int64))
    with pytest.raises(TypeError, match="mx.array"):
        quant.encode([[0.0] * 64])
    with pytest.raises(ValueError, match="m"):
        TurboQuantProd(64, 2, m=0)
    ev = TurboQuantRVQ(64, 2).encode(mx.zeros((1, 64)))
    with pytest.raises(ValueError, match="turboquant_rvq"):
        quant.decode(ev)


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(6.2e-5, 6.0e4), seed=st.integers(0, 2 ** 31))
def test_float16_norms_in_range_are_stored(scale, seed):
    d = 16
    x = np.random.default_rng(seed).standard_normal((3, d)).astype(np.float32)
    x = x / np.linalg.norm(x, axis=-1, keepdims=True) * scale
    ev = TurboQuantMSE(d, 2, norm_dtype="float16").encode(mx.array(x))
    stored = np.array(ev.norms.astype(mx.float32))
    np.testing.assert_allclose(stored, np.linalg.norm(x, axis=-1), rtol=2e-3)


def test_float16_zero_vector_is_fine_with_float16_norms():
    ev = TurboQuantMSE(16, 2, norm_dtype="float16").encode(mx.zeros((2, 16)))
    assert np.all(np.array(ev.norms) == 0)


def test_decode_keeps_nan_visible():
    q = TurboQuantMSE(16, 2)
    x = mx.array(np.full((1, 16), np.nan, dtype=np.float32)).astype(mx.float16)
    assert np.all(np.isnan(np.array(q.decode(q.encode(x)).astype(mx.float32))))
