"""The TurboQuant quantizers through their registry (`veloxquant_mlx.quant.quantizers`): dtypes and batch shapes,
scores equal to q . decode, edge cases, seed determinism, the inner-product contract, float16 norms and range.
(Each quantizer's own behaviour: `test_turboquant_mse.py`, `test_turboquant_prod.py`, `test_turboquant_rvq.py`.)"""
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.quantizers import QUANTIZERS, TurboQuantMSE, TurboQuantProd, TurboQuantRVQ

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


def test_registry_and_seed_determinism():
    assert QUANTIZERS == {"turboquant_mse": TurboQuantMSE, "turboquant_prod": TurboQuantProd,
                          "turboquant_rvq": TurboQuantRVQ}
    x = mx.array(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    a, b = TurboQuantMSE(64, 3, seed=5).encode(x), TurboQuantMSE(64, 3, seed=5).encode(x)
    assert np.array_equal(np.array(a.indices), np.array(b.indices))
    x_np = np.array(x)
    assert np.array_equal(np.array(TurboQuantMSE(64, 3, seed=5).encode(x_np).indices), np.array(a.indices))


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
