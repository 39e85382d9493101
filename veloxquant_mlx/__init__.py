"""veloxquant_mlx: TurboQuant KV-cache compression for MLX and mlx-lm.

The public surface is re-exported here lazily, so ``import veloxquant_mlx`` stays cheap and a
user can write ``from veloxquant_mlx import KVCacheConfig, KVCacheBuilder``.

Names removed from the package keep working for one version as deprecated aliases (`_DEPRECATED`): each access
warns (DeprecationWarning naming the replacement) and returns the replacement's object. They are not in
``__all__`` and are resolved only when used, so they cost nothing otherwise.
"""
from __future__ import annotations

import importlib
import warnings

from veloxquant_mlx._version import DEPRECATED_UNTIL, __version__

# public name -> module that defines it
_EXPORTS = {
    "KVCacheConfig": "veloxquant_mlx.config",
    "EncodedVector": "veloxquant_mlx.core.context",
    "BitPackBuffer": "veloxquant_mlx.dsa.bit_pack",
    "TurboQuantMSE": "veloxquant_mlx.quantizers.turboquant_mse",
    "TurboQuantProd": "veloxquant_mlx.quantizers.turboquant_prod",
    "TurboQuantRVQ": "veloxquant_mlx.quantizers.turboquant_rvq",
    "OutlierDetector": "veloxquant_mlx.compat.outlier",
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
    "calibrate": "veloxquant_mlx.measure_calibration",
    "Calibration": "veloxquant_mlx.calibration.file",
}

# Removed public names -> (module that defines them now, the name to use instead). Each warns on access and goes
# away in `DEPRECATED_UNTIL` (tests/apps/test_deprecated.py fails once the version reaches it with an entry left).
# load_model, CacheSpec, registered_specs: exported from 4b31997 until 50a2bdb dropped them without a warning.
_DEPRECATED = {
    "load_model": "veloxquant_mlx.models.loader",
    "CacheSpec": "veloxquant_mlx.eval.specs",
    "registered_specs": "veloxquant_mlx.eval.specs",
}
_REPLACEMENTS = {
    "load_model": "veloxquant_mlx.models.load_model",
    "CacheSpec": "veloxquant_mlx.eval.specs.CacheSpec",
    "registered_specs": "veloxquant_mlx.eval.specs.registered_specs",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    module = _DEPRECATED.get(name)
    if module is not None:  # never cached in globals(): every access warns
        warnings.warn(f"veloxquant_mlx.{name} is deprecated and will be removed in {DEPRECATED_UNTIL}; "
                      f"use {_REPLACEMENTS[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'veloxquant_mlx' has no attribute {name!r}")
