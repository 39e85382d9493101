"""Shared by the quantizer tests (`test_quantizers.py`, `test_turboquant_mse.py`, `test_turboquant_prod.py`,
`test_turboquant_rvq.py`): random unit vectors and the measured distortion."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

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
