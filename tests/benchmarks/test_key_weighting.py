"""Tests of the query-aware key weighting (research code: pure functions in benchmarks/_key_weighting.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _load_script(path: Path):
    """The benchmark script as a module, loaded from its file (no sys.path edit)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{path.stem.lstrip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kw = _load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "_key_weighting.py")


def _rand(shape, seed, scale=None):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if scale is not None:
        x = x * scale
    return mx.array(x)


def _moments(h, d, seed):
    """Positive per-channel moments with a wide dynamic range (like real queries/keys)."""
    rng = np.random.default_rng(seed)
    return mx.array(np.exp(rng.uniform(-4, 4, size=(h, d))).astype(np.float32))


# -- weights -----------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), half=st.integers(1, 16), traditional=st.booleans())
def test_weights_positive_pair_tied_unit_geomean(seed, half, traditional):
    d = 2 * half
    w = kw.channel_weights(_moments(3, d, seed), _moments(3, d, seed + 1), traditional=traditional)
    wn = np.array(w)
    assert wn.shape == (3, d)
    assert np.all(np.isfinite(wn)) and np.all(wn > 0)
    if traditional:
        np.testing.assert_allclose(wn[:, 0::2], wn[:, 1::2], rtol=1e-6)
    else:
        np.testing.assert_allclose(wn[:, :half], wn[:, half:], rtol=1e-6)
    np.testing.assert_allclose(np.exp(np.mean(np.log(wn), axis=-1)), 1.0, rtol=1e-4)


def test_weights_follow_the_fourth_root_rule():
    # untied: w_i^4 ∝ E[q_i^2] / E[k_i^2]
    q2, k2 = _moments(2, 8, 1), _moments(2, 8, 2)
    w = np.array(kw.channel_weights(q2, k2, tie=False))
    ratio = w ** 4 / (np.array(q2) / np.array(k2))
    np.testing.assert_allclose(ratio / ratio[:, :1], 1.0, rtol=1e-3)


def test_untied_weights_differ_within_a_pair():
    q2 = mx.array([[1.0, 16.0, 1.0, 1.0]])
    w = np.array(kw.channel_weights(q2, None, q_power=0.25, k_power=0.0, tie=False))
    assert w[0, 1] == pytest.approx(2.0 * w[0, 0], rel=1e-5)


def test_dead_channel_gets_finite_weight():
    q2 = mx.array([[0.0, 0.0, 1.0, 1.0]])
    k2 = mx.array([[1.0, 1.0, 0.0, 0.0]])
    w = np.array(kw.channel_weights(q2, k2))
    # the dead moments are floored at floor (1e-6) x the row mean (0.5): w_dead = (floor_q / 1)^(1/4) = (1 / floor_k)^(-1/4)
    r = (1e-6 * 0.5) ** 0.25
    np.testing.assert_allclose(w, [[r, r, 1 / r, 1 / r]], rtol=1e-4)


def test_tie_rope_pairs_layouts():
    m = mx.array([[1.0, 3.0, 5.0, 7.0]])
    np.testing.assert_allclose(np.array(kw.tie_rope_pairs(m, True)), [[2, 2, 6, 6]])
    np.testing.assert_allclose(np.array(kw.tie_rope_pairs(m, False)), [[3, 5, 3, 5]])


def test_tied_weights_commute_with_rope():
    # a pair-tied weight is a multiple of the identity on each RoPE plane: rope(w*k) == w*rope(k)
    d, T = 16, 5
    w = kw.channel_weights(_moments(1, d, 3), _moments(1, d, 4))
    k = _rand((1, 1, T, d), 5)
    lhs = mx.fast.rope(kw.apply_channel_weights(k, w), d, traditional=True, base=10000.0, scale=1.0, offset=7)
    rhs = kw.apply_channel_weights(mx.fast.rope(k, d, traditional=True, base=10000.0, scale=1.0, offset=7), w)
    np.testing.assert_allclose(np.array(lhs), np.array(rhs), rtol=1e-4, atol=1e-5)


# -- apply / unapply / scores ---------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), h=st.integers(1, 4), t=st.integers(1, 6))
def test_apply_unapply_identity_and_score_exactness(seed, h, t):
    d, rep = 8, 3
    w = kw.channel_weights(_moments(h, d, seed), _moments(h, d, seed + 1), tie=bool(seed % 2))
    k = _rand((2, h, t, d), seed + 2)
    q = _rand((2, h * rep, 4, d), seed + 3)
    kp = kw.apply_channel_weights(k, w)
    np.testing.assert_allclose(np.array(kw.unapply_channel_weights(kp, w)), np.array(k), rtol=1e-5, atol=1e-5)
    ref = q @ mx.swapaxes(mx.repeat(k, rep, axis=1), -1, -2)
    got = kw.weight_queries(q, w) @ mx.swapaxes(mx.repeat(kp, rep, axis=1), -1, -2)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)


def test_weighting_lowers_score_error_of_a_rotated_quantizer():
    # keys with a few large channels where queries are tiny: weighting must move error off the queried channels
    from veloxquant_mlx.quant.quantizers import TurboQuantMSE

    d, n = 32, 4000
    kscale = np.ones(d, np.float32)
    kscale[:4] = 10.0
    qscale = np.ones(d, np.float32)
    qscale[:4] = 0.05
    k = _rand((1, 1, n, d), 11, kscale)
    q = _rand((1, 1, 256, d), 12, qscale)
    w = kw.channel_weights(kw.query_second_moments(q, 1), mx.mean(k * k, axis=(0, 2)), tie=False)
    quant = TurboQuantMSE(d, 3, seed=0)

    def score_err(kh):
        e = q @ mx.swapaxes(kh - k, -1, -2)
        return float(mx.mean(e * e).item())

    plain = score_err(quant.decode(quant.encode(k)))
    weighted = score_err(kw.unapply_channel_weights(quant.decode(quant.encode(kw.apply_channel_weights(k, w))), w))
    assert weighted < 0.5 * plain


# -- statistics ----------------------------------------------------------------------------------------------
def test_query_second_moments_group_average():
    q = _rand((1, 6, 50, 4), 7)
    m = np.array(kw.query_second_moments(q, 2))
    qn = np.array(q)
    expect = (qn ** 2).mean(axis=(0, 2)).reshape(2, 3, 4).mean(axis=1)
    np.testing.assert_allclose(m, expect, rtol=1e-5)


def test_query_moments_from_weights_match_sampling():
    hidden, hq, d = 48, 4, 8
    wq = _rand((hq * d, hidden), 8)
    g = mx.abs(_rand((hidden,), 9)) + 0.5
    m = np.array(kw.query_second_moments_from_weights(wq, 2, d, g))
    x = _rand((1, 20000, hidden), 10) * g
    q = (x @ wq.T).reshape(1, 20000, hq, d).transpose(0, 2, 1, 3)
    sampled = np.array(kw.query_second_moments(q, 2))
    np.testing.assert_allclose(m, sampled, rtol=0.06)


# -- full transform -------------------------------------------------------------------------------------------
def test_geometric_mean_transform_inverse_and_optimality_condition():
    d = 6
    a_ = _rand((2, d, 40), 13)
    b_ = _rand((2, d, 40), 14)
    sq = a_ @ mx.swapaxes(a_, -1, -2) / 40
    sk = b_ @ mx.swapaxes(b_, -1, -2) / 40
    a, a_inv = kw.geometric_mean_transform(sq, sk)
    an, ain = np.array(a), np.array(a_inv)
    np.testing.assert_allclose(an @ ain, np.broadcast_to(np.eye(d), (2, d, d)), atol=1e-3)
    # optimum: the transformed covariances are proportional (A Sk A^T ∝ A^-T Sq A^-1)
    ks = an @ np.array(sk) @ an.transpose(0, 2, 1)
    qs = ain.transpose(0, 2, 1) @ np.array(sq) @ ain
    for i in range(2):
        r = np.trace(ks[i]) / np.trace(qs[i])
        np.testing.assert_allclose(ks[i], r * qs[i], rtol=2e-2, atol=2e-3 * np.abs(ks[i]).max())
    k = _rand((1, 2, 5, d), 15)
    q = _rand((1, 2, 3, d), 16)
    ref = q @ mx.swapaxes(k, -1, -2)
    got = kw.apply_transform(q, a_inv) @ mx.swapaxes(kw.apply_transform(k, a), -1, -2)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-3, atol=1e-3)


# -- validation -----------------------------------------------------------------------------------------------
def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="even head_dim"):
        kw.tie_rope_pairs(mx.ones((2, 5)))
    with pytest.raises(TypeError, match="m must be an mx.array"):
        kw.tie_rope_pairs(np.ones((2, 4)))
    with pytest.raises(TypeError, match="traditional"):
        kw.tie_rope_pairs(mx.ones((2, 4)), traditional=1)
    with pytest.raises(ValueError, match="q_power"):
        kw.channel_weights(mx.ones((1, 4)), q_power=2.0)
    with pytest.raises(ValueError, match="floor"):
        kw.channel_weights(mx.ones((1, 4)), floor=0.0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        kw.query_second_moments(mx.ones((1, 9, 2, 4)), 2)
    with pytest.raises(TypeError, match="x must be float32"):
        kw.apply_channel_weights(mx.ones((1, 1, 2, 4), dtype=mx.int32), mx.ones((1, 4)))
    with pytest.raises(ValueError, match="heads"):
        kw.apply_channel_weights(mx.ones((1, 3, 2, 4)), mx.ones((2, 4)))
    with pytest.raises(ValueError, match="d="):
        kw.unapply_channel_weights(mx.ones((1, 1, 2, 4)), mx.ones((1, 6)))
    with pytest.raises(ValueError, match="head_dim"):
        kw.query_second_moments_from_weights(mx.ones((10, 4)), 1, 3)
    with pytest.raises(ValueError, match="input_scale"):
        kw.query_second_moments_from_weights(mx.ones((8, 4)), 1, 4, mx.ones((3,)))
    with pytest.raises(ValueError, match="sigma_q and sigma_k"):
        kw.geometric_mean_transform(mx.ones((2, 3, 3)), mx.ones((2, 4, 4)))
    with pytest.raises(ValueError, match="a must have shape"):
        kw.apply_transform(mx.ones((1, 2, 3, 4)), mx.ones((1, 4, 4)))
