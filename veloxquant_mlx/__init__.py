"""veloxquant_mlx: TurboQuant KV-cache compression for MLX and mlx-lm.

The public surface is re-exported here lazily, so ``import veloxquant_mlx`` stays cheap and a
user can write ``from veloxquant_mlx import KVCacheConfig, KVCacheBuilder``.

Import paths and names that moved are kept by one alias table, `veloxquant_mlx._aliases` (the seed pages' paths
for good, others with a DeprecationWarning until `DEPRECATED_UNTIL`); `install()` below lets the old paths import.
"""
from __future__ import annotations

from veloxquant_mlx import _aliases
from veloxquant_mlx._version import DEPRECATED_UNTIL, __version__

# public name -> module that defines it
_EXPORTS = {
    "KVCacheConfig": "veloxquant_mlx.compat.config",
    "EncodedVector": "veloxquant_mlx.quant.encoded_vector",
    "BitPackBuffer": "veloxquant_mlx.quant.bit_pack",
    "TurboQuantMSE": "veloxquant_mlx.quant.turboquant_mse",
    "TurboQuantProd": "veloxquant_mlx.quant.turboquant_prod",
    "TurboQuantRVQ": "veloxquant_mlx.quant.turboquant_rvq",
    "OutlierDetector": "veloxquant_mlx.compat.outlier",
    "TurboQuantKVCache": "veloxquant_mlx.compat.turboquant_cache",
    "TurboQuantRVQKVCache": "veloxquant_mlx.compat.turboquant_rvq_cache",
    "STANDALONE_METHODS": "veloxquant_mlx.compat.methods",
    "QUANTIZERS": "veloxquant_mlx.quant.quantizers",
    "TurboQuantPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantRotatingPackedCache": "veloxquant_mlx.cache.packed_cache",
    "TurboQuantChunkedPackedCache": "veloxquant_mlx.cache.chunked",
    "KVCacheBuilder": "veloxquant_mlx.integration.builder",
    "CacheOptions": "veloxquant_mlx.cache.options",
    "CODECS": "veloxquant_mlx.codecs",
    "make_prompt_cache": "veloxquant_mlx.integration.builder",
    "save_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "load_prompt_cache": "veloxquant_mlx.cache.prompt_cache_io",
    "mlx_lm_cache_classes": "veloxquant_mlx.cache.registry",
    "use_packed_attention": "veloxquant_mlx.integration.routing",
    "enable": "veloxquant_mlx.integration.enabling",
    "disable": "veloxquant_mlx.integration.enabling",
    "is_enabled": "veloxquant_mlx.integration.enabling",
    "enabled_options": "veloxquant_mlx.integration.enabling",
    "calibrate": "veloxquant_mlx.integration.measure_calibration",
    "Calibration": "veloxquant_mlx.integration.calibration",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = _aliases.package_getattr(__name__, _EXPORTS)
_aliases.install()
