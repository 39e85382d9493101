"""The softmax exponential of packed attention (veloxquant_mlx.attention.exp2): ``2**t`` for ``t <= 0`` from plain
elementwise ops, fused by ``mx.compile`` where it can run, against numpy's ``exp2`` and its own unfused reference."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.attention import exp2


def test_exp2_nonpositive_matches_power_of_two():
    from veloxquant_mlx.attention.exp2 import exp2_nonpositive

    t = np.concatenate([-np.random.default_rng(0).uniform(0, 126, 200_000), [0.0, -0.5, -1.0, -64.0, -126.0]])
    want = np.exp2(t.astype(np.float32).astype(np.float64))
    for fused in (True, False):  # Estrin (fused kernel) and Horner (plain ops, prefill)
        got = np.array(exp2_nonpositive(mx.array(t.astype(np.float32)), fused=fused))
        assert got.dtype == np.float32
        assert np.max(np.abs(got / want - 1)) < 3e-6
        # Masked scores: far below the max, -inf, float32's most negative value -> exactly 0 (never NaN).
        masked = mx.array([-127.0, -500.0, -np.inf, float(np.finfo(np.float32).min)], mx.float32)
        assert np.array(exp2_nonpositive(masked, fused=fused)).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_exp2_fused_equals_plain_ops():
    from veloxquant_mlx.attention import exp2

    t = mx.array(-np.random.default_rng(1).uniform(0, 140, (3, 5, 777)).astype(np.float32))
    fused = exp2.exp2_nonpositive(t)
    # (where mx.compile cannot build CPU kernels, exp2_nonpositive is the plain ops: the same check holds)
    assert mx.array_equal(fused, exp2.exp2_nonpositive_reference(t))


def test_natural_log_scores_times_log2e_give_exp():
    """Softmax weights in log2 units: ``2**(s * LOG2E) = e**s`` for scores ``s <= 0``, for any shape, in float32."""
    s = -np.random.default_rng(2).uniform(0, 60, (2, 3, 41)).astype(np.float32)
    got = exp2.exp2_nonpositive(mx.array(s) * exp2.LOG2E)
    assert got.shape == (2, 3, 41) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.exp(s.astype(np.float64)), rtol=1e-5, atol=0)
    assert exp2.LOG2E == 1 / np.log(2)


def test_horner_and_estrin_agree_to_the_last_bits():
    """``fused=False`` (Horner's scheme, plain ops) and the fused Estrin form compute the same polynomial: equal to a
    few float32 ulps, exactly 1 at ``t = 0`` up to the fit's error and exact powers of two at integers."""
    t = mx.array(-np.random.default_rng(3).uniform(0, 120, 5000).astype(np.float32))
    a, b = np.array(exp2.exp2_nonpositive(t, fused=False)), np.array(exp2.exp2_nonpositive(t))
    np.testing.assert_allclose(a, b, rtol=4e-7, atol=0)
    ints = mx.array([0.0, -1.0, -2.0, -10.0, -126.0])
    got = np.array(exp2.exp2_nonpositive(ints, fused=False)).astype(np.float64)
    np.testing.assert_allclose(got, 2.0 ** np.array([0, -1, -2, -10, -126]), rtol=3e-6)
