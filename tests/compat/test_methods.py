"""Which methods each kind of cache offers (`veloxquant_mlx.compat.methods`, the seed pages'
``veloxquant_mlx.cache.base``): every quantizer is servable, the standalone cache takes the two it implements and
refuses the others by name."""
from __future__ import annotations

import pytest

from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.compat.methods import SERVABLE_METHODS, STANDALONE_METHODS
from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache
from veloxquant_mlx.quant.quantizers import QUANTIZERS


def test_the_method_sets():
    assert SERVABLE_METHODS == frozenset(QUANTIZERS) == {"turboquant_mse", "turboquant_prod", "turboquant_rvq"}
    assert STANDALONE_METHODS == {"turboquant_mse", "turboquant_prod"} and STANDALONE_METHODS < SERVABLE_METHODS


def test_the_standalone_cache_takes_exactly_its_methods():
    for method in STANDALONE_METHODS:
        assert len(TurboQuantKVCache(KVCacheConfig(method=method, head_dim=16, bit_width_inlier=3))) == 0
    for method in SERVABLE_METHODS - STANDALONE_METHODS:
        with pytest.raises(ValueError, match=rf"STANDALONE_METHODS=\['turboquant_mse', 'turboquant_prod'\], "
                                             rf"got method='{method}'"):
            TurboQuantKVCache(KVCacheConfig(method=method, head_dim=16, bit_width_inlier=3))


def test_the_seed_path_is_this_module():
    import importlib

    assert importlib.import_module("veloxquant_mlx.cache.base") is importlib.import_module("veloxquant_mlx.compat.methods")
