"""The seed API's numeric constants (`veloxquant_mlx.compat.constants`) and where they show: the symmetric int8
grid of the value codes, the calibration length of the outlier detector, and the standalone cache's growth step."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.compat import constants
from veloxquant_mlx.compat._ring import int8_absmax
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.compat.outlier import OutlierDetector
from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache


def test_the_values():
    assert (constants.INT8_MAX, constants.DEFAULT_N_CALIB_TOKENS, constants.CACHE_GROWTH_STEP) == (127, 128, 256)


def test_int8_codes_are_symmetric_and_never_minus_128():
    codes, _ = int8_absmax(mx.array([[-5.0, 5.0, 2.5, -0.0]]))
    assert np.array(codes).tolist() == [[-constants.INT8_MAX, constants.INT8_MAX, 64, 0]]


def test_the_detector_calibrates_on_the_default_number_of_rows():
    det = OutlierDetector(n_outliers=1)
    assert det.n_calib == constants.DEFAULT_N_CALIB_TOKENS
    det.observe(np.ones((constants.DEFAULT_N_CALIB_TOKENS - 1, 8), dtype=np.float32))
    assert not det.is_calibrated
    det.observe(np.ones((1, 8), dtype=np.float32))
    assert det.is_calibrated


def test_the_cache_grows_by_the_step():
    cache = TurboQuantKVCache(KVCacheConfig(method="turboquant_mse", head_dim=16, bit_width_inlier=2))
    x = mx.array(np.random.default_rng(0).standard_normal((constants.CACHE_GROWTH_STEP + 1, 16)).astype(np.float32))
    cache.append_key(x[:3])
    assert cache.stored_rows() == constants.CACHE_GROWTH_STEP
    cache.append_key(x[3:])
    assert cache.stored_rows() == 2 * constants.CACHE_GROWTH_STEP
