"""TurboQuant-Prod (`veloxquant_mlx.quant.turboquant_prod`): unbiased inner products with the predicted variance,
a decode consistent with the scores, the orthogonal QJL sketch and its sign gain, and b = 1 as a pure sketch."""
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.codebooks import lloyd_max_codebook
from veloxquant_mlx.quant.turboquant_prod import TurboQuantProd, orthogonal_sketch, sign_gain
from _quantizer_helpers import N, DIMS, unit_vectors  # noqa: F401 - a fixture


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


def test_the_sketch_rows_are_orthogonal_blocks_on_the_radius_sqrt_d_sphere():
    s = orthogonal_sketch(16, 40, seed=3).astype(np.float64)
    assert s.shape == (40, 16)
    np.testing.assert_allclose(np.linalg.norm(s, axis=1), 4.0, rtol=1e-5)  # sqrt(16)
    for lo in (0, 16):  # whole blocks of d rows: orthogonal
        np.testing.assert_allclose(s[lo:lo + 16] @ s[lo:lo + 16].T, 16 * np.eye(16), atol=1e-4)
    assert np.array_equal(s, orthogonal_sketch(16, 40, seed=3)) and not np.allclose(s, orthogonal_sketch(16, 40, 4))


def test_sign_gain_tends_to_sqrt_two_over_pi():
    assert sign_gain(2) == pytest.approx(2 / math.pi * math.sqrt(2))  # sqrt(2) E|cos| = sqrt(2) 2/pi
    assert sign_gain(3) == pytest.approx(math.sqrt(3) / 2)  # E|u_1| = 1/2 on the 2-sphere
    assert sign_gain(4096) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-3)


def test_one_bit_is_a_pure_sketch():
    quant = TurboQuantProd(32, 1, m=64)
    assert quant.mse is None
    x = mx.array(np.random.default_rng(5).standard_normal((6, 32)).astype(np.float32))
    ev = quant.encode(x)
    assert ev.arrays()["indices"].shape == (6, 0) and ev.arrays()["signs"].shape == (6, 2)
    assert not np.any(np.array(quant.decode_rotated_mse(ev)))
    # the residual is the whole vector: its norm is x's
    np.testing.assert_allclose(np.array(ev.residual_norm.astype(mx.float32)), np.linalg.norm(np.array(x), axis=1),
                               rtol=1e-2)
    ev.residual_norm = None
    with pytest.raises(ValueError, match="ev.residual_norm is missing: TurboQuantProd codes need the residual norms"):
        quant.decode(ev)
