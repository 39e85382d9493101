"""OutlierDetector: RMS per channel over the first n_calib rows, top n_outliers, sorted."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.compat.outlier import OutlierDetector


def _reference(rows: np.ndarray, n_outliers: int, n_calib: int) -> list[int]:
    """Top channels by RMS over the first n_calib rows (ties: lower index), sorted."""
    rms = np.sqrt(np.mean(rows[:n_calib].astype(np.float64) ** 2, axis=0))
    return sorted(int(j) for j in np.argsort(-rms, kind="stable")[:n_outliers])


def test_finds_planted_channels():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    planted = [5, 17, 40, 63]
    x[:, planted] *= 20.0
    det = OutlierDetector(n_outliers=4, n_calib=128)
    det.observe(mx.array(x))
    assert det.is_calibrated
    got = det.get_outlier_channels().tolist()
    assert got == planted
    assert all(type(j) is int for j in got)


def test_statistic_is_rms_not_mean_abs():
    # Channel 0: rare spikes (RMS 10, mean |x| 5); channel 1: constant 6 (RMS 6, mean |x| 6).
    # RMS (the channel's share of ||k||^2, which drives the quantizer's error) picks channel 0.
    x = np.zeros((4, 8), dtype=np.float32)
    x[3, 0] = 20.0
    x[:, 1] = 6.0
    det = OutlierDetector(n_outliers=1, n_calib=4)
    det.observe(x)
    assert det.get_outlier_channels().tolist() == [0]
    np.testing.assert_allclose(det.channel_rms()[:2], [10.0, 6.0], rtol=1e-6)


def test_only_first_n_calib_rows_count_and_choice_is_then_fixed():
    rng = np.random.default_rng(12)
    first = rng.normal(size=(16, 32)).astype(np.float32)
    first[:, [2, 3]] *= 10.0
    det = OutlierDetector(n_outliers=2, n_calib=16)
    det.observe(first[:5])
    assert not det.is_calibrated and det.n_observed == 5
    with pytest.raises(RuntimeError, match="not calibrated"):
        det.get_outlier_channels()
    # A block that straddles the limit: its first 11 rows complete the calibration, the rest
    # (huge on channels 7 and 9) must not count.
    tail = rng.normal(size=(30, 32)).astype(np.float32)
    tail[:11] = first[5:]
    tail[11:, [7, 9]] = 1e4
    det.observe(tail)
    assert det.is_calibrated and det.n_observed == 16
    assert det.get_outlier_channels().tolist() == [2, 3]
    det.observe(np.full((8, 32), 1e5, dtype=np.float32))
    assert det.get_outlier_channels().tolist() == [2, 3]


def test_reset_starts_over():
    det = OutlierDetector(n_outliers=1, n_calib=2)
    x = np.zeros((2, 4), dtype=np.float32)
    x[:, 1] = 3.0
    det.observe(x)
    assert det.get_outlier_channels().tolist() == [1]
    det.reset()
    assert not det.is_calibrated and det.n_observed == 0
    y = np.zeros((2, 4), dtype=np.float32)
    y[:, 2] = 3.0
    det.observe(y)
    assert det.get_outlier_channels().tolist() == [2]


def test_zero_outliers_calibrates_to_empty():
    det = OutlierDetector(n_outliers=0, n_calib=3)
    det.observe(np.ones((3, 4), dtype=np.float32))
    assert det.is_calibrated and det.get_outlier_channels().tolist() == []


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        ({"n_outliers": -1, "n_calib": 4}, ValueError, "n_outliers"),
        ({"n_outliers": True, "n_calib": 4}, TypeError, "n_outliers"),
        ({"n_outliers": 2.0, "n_calib": 4}, TypeError, "n_outliers"),
        ({"n_outliers": 1, "n_calib": 0}, ValueError, "n_calib"),
        ({"n_outliers": 1, "n_calib": "8"}, TypeError, "n_calib"),
    ],
)
def test_bad_parameters(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        OutlierDetector(**kwargs)


def test_bad_inputs():
    det = OutlierDetector(n_outliers=4, n_calib=8)
    with pytest.raises(ValueError, match="n_outliers"):
        det.observe(np.ones((2, 4), dtype=np.float32))  # n_outliers must be < d
    det = OutlierDetector(n_outliers=1, n_calib=8)
    with pytest.raises(ValueError, match="x"):
        det.observe(np.ones((2, 3, 4), dtype=np.float32))
    with pytest.raises(TypeError, match="x"):
        det.observe(np.ones((2, 4), dtype=np.int32))
    with pytest.raises(TypeError, match="x"):
        det.observe([[1.0, 2.0]])
    det.observe(np.ones((2, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="d=4"):
        det.observe(np.ones((2, 5), dtype=np.float32))


@settings(max_examples=25, deadline=None)
@given(
    d=st.integers(2, 24),
    n_calib=st.integers(1, 40),
    blocks=st.lists(st.integers(1, 17), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
)
def test_matches_reference_for_any_blocking(d, n_calib, blocks, seed):
    rng = np.random.default_rng(seed)
    n_out = int(rng.integers(0, d))
    rows = rng.normal(size=(sum(blocks), d)) * rng.uniform(0.1, 5.0, size=d)
    rows = rows.astype(np.float32)
    det = OutlierDetector(n_outliers=n_out, n_calib=n_calib)
    start = 0
    for n in blocks:
        det.observe(mx.array(rows[start : start + n]))
        start += n
    assert det.is_calibrated == (len(rows) >= n_calib)
    if det.is_calibrated:
        assert det.get_outlier_channels().tolist() == _reference(rows, n_out, n_calib)
