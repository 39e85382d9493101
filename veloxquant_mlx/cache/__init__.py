"""KV caches: servable mlx_lm caches (packed K and V) and prompt-cache files; the builder (in
:mod:`veloxquant_mlx.integration`) and the seed pages' caches (in :mod:`veloxquant_mlx.compat`) re-exported.

Imports are lazy so ``import veloxquant_mlx.cache`` does not pull in mlx_lm or the quantizers.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TurboQuantPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantChunkedPackedCache": "veloxquant_mlx.cache.chunked",
    "TurboQuantBatchPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantBatchRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRVQKVCache": "veloxquant_mlx.compat.turboquant_rvq_cache",
    "TurboQuantKVCache": "veloxquant_mlx.compat.turboquant_cache",
    "KVCacheBuilder": "veloxquant_mlx.integration",
    "CacheOptions": "veloxquant_mlx.options",
    "make_prompt_cache": "veloxquant_mlx.integration",
    "save_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "load_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "mlx_lm_cache_classes": "veloxquant_mlx.integration",
    "SERVABLE_METHODS": "veloxquant_mlx.cache.base",
    "STANDALONE_METHODS": "veloxquant_mlx.cache.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'veloxquant_mlx.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
