"""veloxquant_mlx: TurboQuant KV-cache compression for MLX and mlx-lm.

The public surface is re-exported here lazily, so ``import veloxquant_mlx`` stays cheap and a
user can write ``from veloxquant_mlx import KVCacheConfig, KVCacheBuilder``.
"""
from __future__ import annotations

import importlib

from veloxquant_mlx._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "KVCacheConfig": "veloxquant_mlx.config",
    "EncodedVector": "veloxquant_mlx.core.context",
    "BitPackBuffer": "veloxquant_mlx.dsa.bit_pack",
    "TurboQuantMSE": "veloxquant_mlx.quantizers.turboquant_mse",
    "TurboQuantProd": "veloxquant_mlx.quantizers.turboquant_prod",
    "TurboQuantRVQ": "veloxquant_mlx.quantizers.turboquant_rvq",
    "OutlierDetector": "veloxquant_mlx.outlier.detector",
    "TurboQuantKVCache": "veloxquant_mlx.compat.turboquant_cache",
    "TurboQuantRVQKVCache": "veloxquant_mlx.compat.turboquant_rvq_cache",
    "STANDALONE_METHODS": "veloxquant_mlx.cache.base",
    "QUANTIZERS": "veloxquant_mlx.quantizers",
    "TurboQuantPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantChunkedPackedCache": "veloxquant_mlx.cache.chunked",
    "KVCacheBuilder": "veloxquant_mlx.integration",
    "CacheOptions": "veloxquant_mlx.options",
    "CODECS": "veloxquant_mlx.codecs",
    "make_prompt_cache": "veloxquant_mlx.integration",
    "save_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "load_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "mlx_lm_cache_classes": "veloxquant_mlx.integration",
    "use_packed_attention": "veloxquant_mlx.integration",
    "enable": "veloxquant_mlx.integration",
    "disable": "veloxquant_mlx.integration",
    "is_enabled": "veloxquant_mlx.integration",
    "enabled_options": "veloxquant_mlx.integration",
    "calibrate": "veloxquant_mlx.calibration.measure",
    "Calibration": "veloxquant_mlx.calibration.file",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'veloxquant_mlx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
