"""TurboQuant quantizers: distortion vs theory, unbiased inner products, dtypes, edge cases, shapes."""
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codebooks import lloyd_max_codebook, lower_bound_d_mse
from veloxquant_mlx.core.context import EncodedVector
from veloxquant_mlx.quantizers import QUANTIZERS, TurboQuantMSE, TurboQuantProd, TurboQuantRVQ

N = 20_000
DIMS = (64, 128)


@pytest.fixture(scope="module")
def unit_vectors():
    """20,000 uniformly random unit vectors per d (float32 mx arrays), built once."""
    out = {}
    for d in DIMS:
        x = np.random.default_rng(1000 + d).standard_normal((N, d))
        out[d] = mx.array((x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))
    return out


def _d_mse(x, x_hat):
    return float(mx.mean(mx.sum(mx.square(x - x_hat.astype(mx.float32)), axis=-1)))


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


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_prod_unbiased_and_variance(unit_vectors, d, b):
    x = unit_vectors[d]
    q = mx.array(np.random.default_rng(7 * b + d).standard_normal((32, d)).astype(np.float32))
    quant = TurboQuantProd(d, b)
    est = quant.estimate_inner_product(q, quant.encode(x))  # (32, N)
    err = np.array(est - q @ x.T, dtype=np.float64)
    # unbiased: mean over queries per vector gives N independent samples
    per_vec = err.mean(axis=0)
    assert abs(per_vec.mean()) < 3 * per_vec.std(ddof=1) / math.sqrt(N)
    # variance ~ (pi/2 - 1)/m * D_mse(b-1) * ||q||^2 (the QJL term; E||r||^2 = D_mse(b-1), = 1 for b = 1): the
    # sketch's m = d rows are orthogonal, so the squared projections of q add up exactly (i.i.d. Gaussian rows
    # give pi/(2m)). 15 % tolerance covers the ~1/d terms plus sampling noise.
    d_prev = 1.0 if b == 1 else lloyd_max_codebook("beta", b - 1, d=d).d_mse
    predicted = (math.pi / 2 - 1) / quant.m * d_prev * float(mx.mean(mx.sum(q * q, axis=-1)))
    assert err.var() == pytest.approx(predicted, rel=0.15)


def test_prod_decode_consistent_and_unbiased_vector(unit_vectors):
    d = 64
    x = unit_vectors[d][:2000]
    quant = TurboQuantProd(d, 3)
    ev = quant.encode(x)
    q = mx.array(np.random.default_rng(0).standard_normal((4, d)).astype(np.float32))
    np.testing.assert_allclose(np.array(quant.estimate_inner_product(q, ev)), np.array(q @ quant.decode(ev).T),
                               atol=2e-4)
    assert quant.qjl_matrix.shape == (quant.m, d)
    assert TurboQuantProd.m_default(d, 3) == d == quant.m
    assert ev.arrays()["signs"].shape == (2000, 2) and ev.residual_norm.shape == (2000,)  # packed words
    assert ev.signs.shape == (2000, d)  # the seed's view: m = d values


def test_rvq_beats_mse(unit_vectors):
    d = 128
    x = unit_vectors[d][:5000]
    for b in (1, 2, 3, 4):
        rvq = TurboQuantRVQ(d, b)
        ev = rvq.encode(x)
        assert ev.indices2 is not None and ev.indices.shape == ev.indices2.shape
        mse = TurboQuantMSE(d, b)
        assert _d_mse(x, rvq.decode(ev)) < _d_mse(x, mse.decode(mse.encode(x)))
    assert TurboQuantRVQ(d, 2).laplace_scale > 0


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantProd, TurboQuantRVQ])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dtype_kept_and_batch_shapes(cls, dtype):
    d = 64
    quant = cls(d, 3)
    x = mx.array(np.random.default_rng(0).standard_normal((2, 3, 5, d)).astype(np.float32)).astype(dtype)
    ev = quant.encode(x)
    assert isinstance(ev, EncodedVector) and ev.batch_shape == (2, 3, 5) and ev.dim == d
    out = quant.decode(ev)
    assert out.dtype == dtype and out.shape == x.shape
    rot = quant.decode_rotated(ev)
    assert rot.dtype == mx.float32 and rot.shape == x.shape
    # estimate_inner_product: q (..., m, d) with ev (..., n) -> (..., m, n); q (d,) with ev (n,) -> (n,)
    q = mx.array(np.random.default_rng(1).standard_normal((2, 3, 4, d)).astype(np.float32))
    s = quant.estimate_inner_product(q, ev)
    assert s.shape == (2, 3, 4, 5)
    # decode rounds to the input dtype (bfloat16: 8-bit mantissa), scores stay float32
    tol = 0.15 if dtype == mx.bfloat16 else 3e-2
    np.testing.assert_allclose(np.array(s), np.array(q @ mx.swapaxes(quant.decode(ev).astype(mx.float32), -1, -2)),
                               rtol=tol, atol=tol)
    ev1 = quant.encode(x[0, 0])
    assert quant.estimate_inner_product(q[0, 0, 0], ev1).shape == (5,)


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantRVQ])
def test_estimate_equals_dot_with_decode(cls):
    d = 128
    quant = cls(d, 4)
    x = mx.array(np.random.default_rng(3).standard_normal((50, d)).astype(np.float32))
    q = mx.array(np.random.default_rng(4).standard_normal((6, d)).astype(np.float32))
    ev = quant.encode(x)
    np.testing.assert_allclose(np.array(quant.estimate_inner_product(q, ev)), np.array(q @ quant.decode(ev).T),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantProd, TurboQuantRVQ])
def test_zero_constant_huge(cls):
    d = 64
    quant = cls(d, 4)
    zero = mx.zeros((3, d))
    out = np.array(quant.decode(quant.encode(zero)))
    assert np.all(out == 0)
    const = mx.full((2, d), 0.5)
    huge = mx.array(np.random.default_rng(0).standard_normal((200, d)).astype(np.float32) * 1e6)
    for x in (const, huge):
        ev = quant.encode(x)
        assert np.all(np.isfinite(np.array(ev.norms.astype(mx.float32))))
        xh = np.array(quant.decode(ev), dtype=np.float64)
        assert np.all(np.isfinite(xh))
        xn = np.array(x, dtype=np.float64)
        rel = np.sum((xh - xn) ** 2, axis=-1) / np.sum(xn ** 2, axis=-1)
        # MSE/RVQ: ~D_mse(4) = 0.009. Prod decodes the unbiased QJL reconstruction: expected relative
        # error ~ D_mse(3) * (1 + (pi/2 - 1) d/m) ~ 0.05, and one vector (const) can be a few times that.
        limit = 0.25 if cls is TurboQuantProd else 0.03
        assert np.mean(rel) < limit
    # a float16 input whose norm exceeds 65504 still gets a finite norm
    big16 = mx.full((1, d), 60000.0).astype(mx.float16)
    ev = quant.encode(big16)
    assert math.isfinite(float(ev.norms.astype(mx.float32)[0])) and float(ev.norms.astype(mx.float32)[0]) > 4e5


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


def test_registry_and_seed_determinism():
    assert QUANTIZERS == {"turboquant_mse": TurboQuantMSE, "turboquant_prod": TurboQuantProd,
                          "turboquant_rvq": TurboQuantRVQ}
    x = mx.array(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    a, b = TurboQuantMSE(64, 3, seed=5).encode(x), TurboQuantMSE(64, 3, seed=5).encode(x)
    assert np.array_equal(np.array(a.indices), np.array(b.indices))
    x_np = np.array(x)
    assert np.array_equal(np.array(TurboQuantMSE(64, 3, seed=5).encode(x_np).indices), np.array(a.indices))


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


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(QUANTIZERS)), d=st.sampled_from([2, 3, 17, 80]), b=st.integers(1, 8),
       lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), n=st.integers(1, 5), m=st.integers(1, 3))
def test_inner_product_contract(name, d, b, lead, n, m):
    quant = QUANTIZERS[name](d, b, seed=3)
    rng = np.random.default_rng(d * 100 + b)
    x = mx.array(rng.standard_normal((*lead, n, d)).astype(np.float32))
    q = mx.array(rng.standard_normal((*lead, m, d)).astype(np.float32))
    ev = quant.encode(x)
    assert ev.batch_shape == (*lead, n)
    s = quant.estimate_inner_product(q, ev)
    assert s.shape == (*lead, m, n)
    # every quantizer's score is q . decode(ev) (for Prod, decode is the unbiased reconstruction)
    ref = q @ mx.swapaxes(quant.decode(ev), -1, -2)
    np.testing.assert_allclose(np.array(s), np.array(ref), rtol=1e-3, atol=1e-3 * (1 + float(mx.max(mx.abs(ref)))))
    assert np.all(np.isfinite(np.array(s)))


# --- issue 15: float16 norms and the float16 range on decode -----------------------------------------
@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantProd, TurboQuantRVQ])
@pytest.mark.parametrize("scale", [1e5, 1e-9])
def test_float16_norms_refuse_what_float16_cannot_hold(cls, scale):
    d = 32
    x = mx.array(np.random.default_rng(0).standard_normal((4, d)).astype(np.float32))
    x = x / mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True)) * scale
    with pytest.raises(ValueError, match="norm_dtype"):
        cls(d, 3, norm_dtype="float16").encode(x)
    # the default (bfloat16) stores both safely and decodes to the right scale
    q = cls(d, 3)
    ev = q.encode(x)
    got = np.linalg.norm(np.array(q.decode(ev), dtype=np.float64), axis=-1)
    assert np.all(np.isfinite(got)) and np.all(got > 0.5 * scale) and np.all(got < 1.5 * scale)


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


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantProd, TurboQuantRVQ])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_decode_near_float16_max_stays_finite(cls, dtype):
    d = 64
    rng = np.random.default_rng(7)
    # coordinates at +-65504 (float16's max): any reconstruction overshoot would round to inf
    x = (np.sign(rng.standard_normal((50, d))) * 65504.0).astype(np.float32)
    x[:, :3] = rng.uniform(-65504, 65504, size=(50, 3))
    xin = mx.array(x).astype(dtype)
    q = cls(d, 2)
    out = q.decode(q.encode(xin))
    assert out.dtype == dtype
    o = np.array(out.astype(mx.float32))
    assert np.all(np.isfinite(o))
    if dtype == mx.float16:
        assert np.max(np.abs(o)) <= 65504.0


def test_decode_keeps_nan_visible():
    q = TurboQuantMSE(16, 2)
    x = mx.array(np.full((1, 16), np.nan, dtype=np.float32)).astype(mx.float16)
    assert np.all(np.isnan(np.array(q.decode(q.encode(x)).astype(mx.float32))))
