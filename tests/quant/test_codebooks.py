"""Lloyd-Max codebooks: optimality conditions, known theoretical values, caching, edge cases."""
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.codebooks import (PAPER_D_MSE, lloyd_max_codebook, lower_bound_d_mse, mean_abs_residual,
                                      quantize_to_codebook)


@pytest.mark.parametrize("dist,kw", [("beta", {"d": 2}), ("beta", {"d": 3}), ("beta", {"d": 128}),
                                     ("gaussian", {"d": 64}), ("laplace", {"scale": 0.5})])
@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
def test_lloyd_max_conditions(dist, kw, bits):
    cb = lloyd_max_codebook(dist, bits, **kw)
    c, b = cb.centroids_np.astype(np.float64), cb.boundaries_np.astype(np.float64)
    assert c.shape == (2 ** bits,) and b.shape == (2 ** bits - 1,)
    assert cb.centroids.dtype == mx.float32 and cb.boundaries.dtype == mx.float32
    assert np.all(np.diff(c) > 0) and np.all(np.diff(b) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-7)  # symmetric law -> symmetric codebook
    np.testing.assert_allclose(b, 0.5 * (c[:-1] + c[1:]), rtol=1e-5, atol=1e-9)  # nearest-neighbour
    if dist == "beta":
        assert np.all(np.abs(c) < 1)


def test_beta_d128_matches_paper():
    for bits, paper in {1: 0.361, 2: 0.116, 3: 0.034, 4: 0.0093}.items():
        cb = lloyd_max_codebook("beta", bits, d=128)
        assert cb.d_mse == pytest.approx(paper, rel=0.03)
        assert cb.d_mse > lower_bound_d_mse(bits)
    assert set(PAPER_D_MSE) == {1, 2, 3, 4}


def test_d_mse_falls_with_bits_and_above_bound():
    for d in (2, 16, 64, 128, 1024):
        vals = [lloyd_max_codebook("beta", b, d=d).d_mse for b in range(1, 9)]
        assert all(x > y for x, y in zip(vals, vals[1:]))
        if d >= 64:  # the 4^-b bound is for high-dimensional vectors; a circle (d=2) beats it
            assert all(v >= lower_bound_d_mse(b) for b, v in zip(range(1, 9), vals))


def test_uniform_d3_is_exact():
    # d = 3: one coordinate of a random unit vector is uniform on [-1, 1] (Archimedes); the optimal
    # quantizer is uniform with per-coordinate MSE (2/2^b)^2 / 12, i.e. d*mse = 4^-b.
    for bits in range(1, 7):
        cb = lloyd_max_codebook("beta", bits, d=3)
        assert cb.d_mse == pytest.approx(4.0 ** -bits, rel=1e-6)
        step = 2.0 / 2 ** bits
        np.testing.assert_allclose(cb.centroids_np, -1 + step * (np.arange(2 ** bits) + 0.5), atol=1e-6)


def test_d2_arcsine_1bit():
    # d = 2: x = cos(theta), theta uniform; 1-bit centroid = E|cos| = 2/pi, mse = 1/2 - 4/pi^2
    cb = lloyd_max_codebook("beta", 1, d=2)
    assert cb.centroids_np[1] == pytest.approx(2 / math.pi, rel=1e-6)
    assert cb.mse == pytest.approx(0.5 - 4 / math.pi ** 2, rel=1e-6)


def test_gaussian_known_values_and_beta_limit():
    # classical Lloyd-Max MSE of N(0,1): 0.3634, 0.1175, 0.03455, 0.009497 (Max, 1960)
    for bits, ref in {1: 1 - 2 / math.pi, 2: 0.1175, 3: 0.03455, 4: 0.009497}.items():
        cb = lloyd_max_codebook("gaussian", bits)
        assert cb.mse == pytest.approx(ref, rel=2e-3)
        # Beta -> Gaussian as d grows
        assert lloyd_max_codebook("beta", bits, d=4096).d_mse == pytest.approx(cb.mse, rel=5e-3)


def test_laplace_scales_linearly():
    a, b = lloyd_max_codebook("laplace", 3, scale=1.0), lloyd_max_codebook("laplace", 3, scale=0.25)
    np.testing.assert_allclose(b.centroids_np, 0.25 * a.centroids_np, rtol=1e-5)
    assert b.mse == pytest.approx(a.mse * 0.0625, rel=1e-6)
    # 1-bit Laplace: centroids at ±(scale) (E|x| = scale), mse = 2 s^2 - s^2 = s^2
    one = lloyd_max_codebook("laplace", 1, scale=2.0)
    np.testing.assert_allclose(one.centroids_np, [-2.0, 2.0], rtol=1e-6)


def test_mean_abs_residual_monte_carlo():
    cb = lloyd_max_codebook("gaussian", 2, d=64)
    x = np.random.default_rng(0).standard_normal(400_000) / 8.0
    q = cb.centroids_np[np.searchsorted(cb.boundaries_np, x)]
    mc = np.mean(np.abs(x - q))
    assert mean_abs_residual(cb) == pytest.approx(mc, rel=0.01)


def test_cached():
    assert lloyd_max_codebook("beta", 4, d=96) is lloyd_max_codebook("beta", 4, d=96)


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_quantize_to_codebook_is_nearest(bits):
    cb = lloyd_max_codebook("beta", bits, d=64)
    x = np.random.default_rng(bits).standard_normal((7, 64)).astype(np.float32) / 8
    idx = np.array(quantize_to_codebook(mx.array(x), cb))
    assert idx.dtype == np.uint8 and idx.shape == x.shape
    nearest = np.argmin(np.abs(x[..., None] - cb.centroids_np), axis=-1)
    np.testing.assert_array_equal(idx, nearest)


@pytest.mark.parametrize("args,err,match", [
    (("beta", 4), ValueError, r"needs d >= 2.*got d=None"), (("beta", 4, 1), ValueError, r"needs d >= 2.*got d=1"),
    (("cauchy", 4, 8), ValueError, r"dist must be one of"), (("beta", 0, 8), ValueError, r"bits must be an int in 1\.\.8"),
    (("beta", 9, 8), ValueError, r"bits must be an int in 1\.\.8"), (("laplace", 2), ValueError, r"needs scale"),
    (("beta", 2, 8.0), TypeError, r"d must be an int"), (("laplace", 2, None, -1.0), ValueError, r"scale must be")])
def test_bad_args(args, err, match):
    with pytest.raises(err, match=match):
        lloyd_max_codebook(*args)


def test_unpickled_codebooks_read_their_own_levels_when_ids_are_reused(monkeypatch):
    """The mx levels are cached by content: an unpickled (or copied) Codebook is a new object, and once freed its id
    is reused by the next one; an id-keyed cache then handed the next codebook the freed one's levels (a pickled
    standalone cache continued with another bit width's codes in ~8 % of runs). Whether CPython reuses an address
    in a given run is up to its allocator, so the reuse is also forced: every object gets the same id."""
    import gc
    import pickle

    from veloxquant_mlx.quant import codebooks

    books = [lloyd_max_codebook("beta", b, d=64) for b in (2, 3, 4)]

    def read_in_turn(n):
        for i in range(n):
            cb = pickle.loads(pickle.dumps(books[i % 3]))
            assert np.array_equal(np.array(cb.boundaries), cb.boundaries_np), i
            assert np.array_equal(np.array(cb.centroids), cb.centroids_np), i
            del cb
            gc.collect()

    read_in_turn(15)  # addresses as CPython reuses them (each turn a full gc: ~0.25 s)
    monkeypatch.setattr(codebooks, "id", lambda obj: 0, raising=False)  # every address the same
    read_in_turn(6)
