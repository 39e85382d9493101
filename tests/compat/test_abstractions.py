"""The standalone caches' interface (`veloxquant_mlx.compat.abstractions`): the seed's abstract `KVCache` (not
mlx_lm's) and the one input check of its caches and of the outlier detector, `as_float_rows`."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.compat.abstractions import KVCache, as_float_rows
from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache


def test_kv_cache_is_abstract_and_the_standalone_cache_implements_it():
    with pytest.raises(TypeError, match="abstract"):
        KVCache()
    assert {"append_key", "append_value", "attend", "memory_bytes", "reset", "__len__"} <= KVCache.__abstractmethods__
    assert issubclass(TurboQuantKVCache, KVCache) and not TurboQuantKVCache.__abstractmethods__

    class Partial(KVCache):
        def append_key(self, k):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_as_float_rows_accepts_vectors_and_blocks():
    v = as_float_rows(np.ones(4, dtype=np.float16), "k", 4)
    assert isinstance(v, mx.array) and v.dtype == mx.float16 and v.shape == (4,)
    b = mx.ones((3, 4), dtype=mx.bfloat16)
    assert as_float_rows(b, "v") is b


@pytest.mark.parametrize("x,exc,match", [
    (np.ones(4, dtype=np.int32), TypeError, r"k must have a floating dtype \(float16/bfloat16/float32\), got int32"),
    (mx.ones((4,), dtype=mx.int8), TypeError, "k must have a floating dtype"),
    ([1.0, 2.0, 3.0, 4.0], TypeError, "k must be an mx.array or np.ndarray, got list"),
    (mx.ones((1, 2, 4)), ValueError, r"k must have shape \(d,\) or \(n, d\), got shape \(1, 2, 4\)"),
    (mx.ones((2, 5)), ValueError, r"k must have last dimension d=4, got shape \(2, 5\)"),
])
def test_as_float_rows_names_the_argument(x, exc, match):
    with pytest.raises(exc, match=match):
        as_float_rows(x, "k", 4)
