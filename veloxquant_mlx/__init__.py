"""veloxquant_mlx: TurboQuant KV-cache compression for MLX and mlx-lm.

The public surface is re-exported here lazily, so ``import veloxquant_mlx`` stays cheap and a
user can write ``from veloxquant_mlx import KVCacheConfig, KVCacheBuilder``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "KVCacheConfig": "veloxquant_mlx.config",
    "EncodedVector": "veloxquant_mlx.core.context",
    "BitPackBuffer": "veloxquant_mlx.dsa.bit_pack",
    "TurboQuantMSE": "veloxquant_mlx.quantizers.turboquant_mse",
    "TurboQuantProd": "veloxquant_mlx.quantizers.turboquant_prod",
    "TurboQuantRVQ": "veloxquant_mlx.quantizers.turboquant_rvq",
    "OutlierDetector": "veloxquant_mlx.outlier.detector",
    "TurboQuantKVCache": "veloxquant_mlx.cache.turboquant_cache",
    "TurboQuantRVQKVCache": "veloxquant_mlx.cache.turboquant_rvq_cache",
    "STANDALONE_METHODS": "veloxquant_mlx.cache.base",
    "QUANTIZERS": "veloxquant_mlx.quantizers",
    "TurboQuantPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "KVCacheBuilder": "veloxquant_mlx.cache.builder",
    "CacheOptions": "veloxquant_mlx.options",
    "CODECS": "veloxquant_mlx.codecs",
    "make_prompt_cache": "veloxquant_mlx.cache.builder",
    "save_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "load_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "mlx_lm_cache_classes": "veloxquant_mlx.cache.prompt_cache_io",
    "use_packed_attention": "veloxquant_mlx.attention.hook",
    "enable": "veloxquant_mlx.integration",
    "disable": "veloxquant_mlx.integration",
    "is_enabled": "veloxquant_mlx.integration",
    "load_model": "veloxquant_mlx.models.loader",
    "CacheSpec": "veloxquant_mlx.eval.specs",
    "registered_specs": "veloxquant_mlx.eval.specs",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'veloxquant_mlx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
