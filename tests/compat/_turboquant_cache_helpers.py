"""Helpers, fixtures and constants shared by `test_turboquant_cache.py` and `test_turboquant_cache_state.py`."""
from __future__ import annotations

import math

import numpy as np
import pytest

from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache
from veloxquant_mlx.compat.config import KVCacheConfig

# Data seeds stay far from the quantizers' seeds (0..15): a rotation drawn from the same
# generator state as the data would be correlated with it.
DATA_SEED = 20_240_501


def make(method="turboquant_mse", d=64, b=4, **kw) -> TurboQuantKVCache:
    return TurboQuantKVCache(KVCacheConfig(method=method, head_dim=d, bit_width_inlier=b, **kw))


def exact_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax(q k^T / sqrt(d)) v in float64: q (m, d), k/v (n, d) -> (m, d)."""
    s = q.astype(np.float64) @ k.astype(np.float64).T / math.sqrt(k.shape[1])
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return w @ v.astype(np.float64), w


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def correlated_queries(keys: np.ndarray, m: int, rng) -> np.ndarray:
    """Queries q = 0.5 * k_j + 0.5 * g (k_j a random stored key, g ~ N(0, I)).

    With keys ~ N(0, I), d = 128, the matching key scores about 0.5 * d / sqrt(d) = 5.7 logits
    above the others (spread ~0.7), so each query puts a few percent to tens of percent of its
    weight on its key and the rest spread out: neither uniform nor one-hot.
    """
    j = rng.integers(0, len(keys), size=m)
    return (0.5 * keys[j] + 0.5 * rng.normal(size=(m, keys.shape[1]))).astype(np.float32)


@pytest.fixture(scope="module")
def gaussian_kv():
    rng = np.random.default_rng(DATA_SEED)
    k = rng.normal(size=(2048, 128)).astype(np.float32)
    v = rng.normal(size=(2048, 128)).astype(np.float32)
    q = correlated_queries(k, 32, rng)
    return q, k, v


# ---------------------------------------------------------------- accuracy


# Output cosine vs exact attention on `gaussian_kv` (values are int8 in every case, so the keys' bits decide),
# measured (mean / min over the 32 queries):
#   mse  b=2 0.9647 / 0.8600   b=3 0.9963 / 0.9830   b=4 0.9994 / 0.9973
#   prod b=2 0.9604 / 0.6745   b=3 0.9889 / 0.8924   b=4 0.9959 / 0.9760
# Bound = 1 - 2 x the measured error (1 - cos) at b: a 2x margin on the error, and each bound still lies
# above the measured value one bit lower, so a cache coding one bit fewer than configured fails.
COSINE_BOUNDS = {  # (method, b): (mean bound, min bound)
    ("turboquant_mse", 4): (1 - 2 * 0.0006, 1 - 2 * 0.0027),
    ("turboquant_mse", 3): (1 - 2 * 0.0037, 1 - 2 * 0.0170),
    ("turboquant_prod", 4): (1 - 2 * 0.0041, 1 - 2 * 0.0240),
    ("turboquant_prod", 3): (1 - 2 * 0.0111, 1 - 2 * 0.1076),
}
MEASURED_COSINE = {  # (method, b): (mean, min), the table above
    ("turboquant_mse", 2): (0.9647, 0.8600), ("turboquant_mse", 3): (0.9963, 0.9830),
    ("turboquant_prod", 2): (0.9604, 0.6745), ("turboquant_prod", 3): (0.9889, 0.8924),
}


def _outlier_keys(rng, n, d, channels, factor):
    k = rng.normal(size=(n, d)).astype(np.float32)
    k[:, channels] *= factor
    return k


# ---------------------------------------------------------------- bytes and growth


def _per_token_formula(d, b_mse, m, n_out):
    """The documented accounting: idx ceil(d b_mse / 8) + signs ceil(m / 8) + rnorm 2 (Prod)
    + the key norm (2 bytes, bfloat16) + value d + 2 + outliers n_out + 2."""
    idx = math.ceil(d * b_mse / 8)
    prod = math.ceil(m / 8) + 2 if m else 0
    return idx + prod + 2 + (d + 2) + (n_out + 2 if n_out else 0)
