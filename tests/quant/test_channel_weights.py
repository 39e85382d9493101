"""Static channel weights (`veloxquant_mlx.quant.channel_weights`): powers of two, a geometric mean of 1 per head,
the fourth-root rule ``w^4 = Q / K`` before rounding, clipping at ``2**MAX_LOG2``, and the exactness that makes
them free: ``(q / w) . (w * k) == q . k`` bit for bit."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.channel_weights import MAX_LOG2, channel_weights, is_power_of_two


def test_weights_follow_the_fourth_root_rule_rounded_to_powers_of_two():
    # log2(Q/K) = 4 * (-2, -1, 0, 1, 2) -> log2 w = (-2, -1, 0, 1, 2): geometric mean 1 already
    importance = mx.array([[2.0 ** -8, 2.0 ** -4, 1.0, 2.0 ** 4, 2.0 ** 8]])
    w = channel_weights(importance, mx.ones((1, 5)))
    assert w.dtype == mx.float32 and w.tolist() == [[0.25, 0.5, 1.0, 2.0, 4.0]]
    # a common factor cancels (only the ratios between channels matter), and power=0.5 squares the weights
    assert channel_weights(importance * 1000, mx.ones((1, 5)) * 1000).tolist() == w.tolist()
    assert channel_weights(importance, mx.ones((1, 5)), power=0.5).tolist() == [[0.125, 0.25, 1.0, 4.0, 8.0]]


def test_weights_are_centred_clipped_and_finite():
    rng = np.random.default_rng(0)
    imp = mx.array(np.exp(rng.uniform(-30, 30, (3, 64))).astype(np.float32))
    en = mx.array(np.exp(rng.uniform(-30, 30, (3, 64))).astype(np.float32))
    en[0, 0] = 0.0  # a dead channel
    w = channel_weights(imp, en)
    assert w.shape == (3, 64) and is_power_of_two(w)
    lw = np.log2(np.array(w))
    assert lw.max() == MAX_LOG2 and lw.min() == -MAX_LOG2  # this spread needs the clip on both sides
    assert np.all(np.abs(lw.mean(axis=-1)) <= 1.0)  # centred before rounding and clipping


def test_weighting_is_exact_for_scores():
    rng = np.random.default_rng(1)
    w = channel_weights(mx.array(rng.uniform(0.1, 10, (2, 32)).astype(np.float32)),
                        mx.array(rng.uniform(0.1, 10, (2, 32)).astype(np.float32)))
    q = mx.array(rng.standard_normal((2, 5, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 7, 32)).astype(np.float32))
    wq, wk = q / w[:, None, :], k * w[:, None, :]
    assert bool(mx.array_equal(wk / w[:, None, :], k)) and bool(mx.array_equal(wq * w[:, None, :], q))
    np.testing.assert_allclose(np.array(wq @ mx.swapaxes(wk, -1, -2)), np.array(q @ mx.swapaxes(k, -1, -2)),
                               rtol=1e-5, atol=1e-5)


def test_is_power_of_two_and_shape_errors():
    assert is_power_of_two(mx.array([0.125, 1.0, 8.0]))
    assert not is_power_of_two(mx.array([16.0]))  # beyond the clipping range
    assert not is_power_of_two(mx.array([3.0])) and not is_power_of_two(mx.array([0.0]))
    with pytest.raises(ValueError, match=r"importance and energy must both be \(heads, d\), got \(2, 4\) and \(2, 5\)"):
        channel_weights(mx.ones((2, 4)), mx.ones((2, 5)))
    with pytest.raises(ValueError, match=r"got \(4,\) and \(4,\)"):
        channel_weights(mx.ones((4,)), mx.ones((4,)))


def test_unrotated_score_error_compares_the_two_bases():
    """1 where every channel is alike; below 1 where the queries read the channels whose keys vary little, above
    where they read the loud ones; (heads, d) both, else ValueError naming them."""
    import mlx.core as mx
    import pytest

    from veloxquant_mlx.quant.channel_weights import unrotated_score_error

    flat = unrotated_score_error(mx.ones((2, 8)), mx.full((2, 8), 3.0))
    assert flat.shape == (2,) and mx.allclose(flat, mx.ones(2)).item()
    var = mx.array([[4.0] * 4 + [0.01] * 4])
    quiet, loud = mx.array([[0.01] * 4 + [4.0] * 4]), mx.array([[4.0] * 4 + [0.01] * 4])
    assert unrotated_score_error(quiet, var).item() < 0.05 < 1.5 < unrotated_score_error(loud, var).item()
    with pytest.raises(ValueError, match="query_power and key_variance"):
        unrotated_score_error(mx.ones((2, 8)), mx.ones((2, 4)))
