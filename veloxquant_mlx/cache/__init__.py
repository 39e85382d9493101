"""KV caches: servable mlx_lm caches (packed K and V), the classes prompt-cache files name (`registry`) and the
files; the seed pages' caches (in :mod:`veloxquant_mlx.compat`) re-exported.

Imports are lazy so ``import veloxquant_mlx.cache`` does not pull in mlx_lm or the quantizers. The builder lives one
layer up, in :mod:`veloxquant_mlx.integration` (``veloxquant_mlx.KVCacheBuilder`` / ``make_prompt_cache``);
its old names here are deprecated aliases (`_DEPRECATED`: they warn, and go in ``veloxquant_mlx.DEPRECATED_UNTIL``).
"""
from __future__ import annotations

import importlib
import warnings

from veloxquant_mlx._version import DEPRECATED_UNTIL

_EXPORTS = {
    "TurboQuantPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantChunkedPackedCache": "veloxquant_mlx.cache.chunked",
    "TurboQuantBatchPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantBatchRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRVQKVCache": "veloxquant_mlx.compat.turboquant_rvq_cache",
    "TurboQuantKVCache": "veloxquant_mlx.compat.turboquant_cache",
    "CacheOptions": "veloxquant_mlx.options",
    "save_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "load_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "mlx_lm_cache_classes": "veloxquant_mlx.cache.registry",
    "SERVABLE_METHODS": "veloxquant_mlx.cache.base",
    "STANDALONE_METHODS": "veloxquant_mlx.cache.base",
}

# The builder's old names here (a cache-layer package re-exporting the layer above it): deprecated aliases, resolved
# only on access, removed with the package's other aliases (veloxquant_mlx.DEPRECATED_UNTIL).
_DEPRECATED = {
    "KVCacheBuilder": "veloxquant_mlx.integration",
    "make_prompt_cache": "veloxquant_mlx.integration",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    module = _DEPRECATED.get(name)
    if module is not None:  # never cached: every access warns
        warnings.warn(f"veloxquant_mlx.cache.{name} is deprecated and will be removed in {DEPRECATED_UNTIL}; "
                      f"use veloxquant_mlx.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'veloxquant_mlx.cache' has no attribute {name!r}")
