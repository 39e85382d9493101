"""The cache classes by name: what prompt-cache files name, and mlx_lm's namespace made to see them.

A prompt-cache file stores each layer's class by ``__name__``; `load_prompt_cache`
(:mod:`veloxquant_mlx.cache.prompt_cache_io`) and mlx_lm's own loader (inside `mlx_lm_cache_classes`) look it up
among `CACHE_CLASSES`. The registry sits in the cache layer, below the integration: a new cache kind is registered
with :func:`veloxquant_mlx.integration.register_cache_kind`, which adds its conversion to the builder and its
classes here (`register_cache_classes`), so nothing under ``cache/`` imports the integration.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache.chunked import TurboQuantChunkedPackedCache
from veloxquant_mlx.cache.packed_cache import (TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache,
                                               TurboQuantPackedCache, TurboQuantRotatingPackedCache)
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

__all__ = ["CACHE_CLASSES", "mlx_lm_cache_classes", "register_cache_classes"]

# Every cache class this library builds, converts and saves (read at call time: kinds registered later included).
CACHE_CLASSES: Tuple[type, ...] = (TurboQuantPackedCache, TurboQuantRotatingPackedCache, TurboQuantRVQKVCache,
                                   TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache,
                                   TurboQuantChunkedPackedCache)


def register_cache_classes(*classes: type) -> None:
    """Know ``classes`` by name in prompt-cache files (each once; the built-in ones are already known)."""
    global CACHE_CLASSES
    if not all(isinstance(c, type) for c in classes):
        raise TypeError("register_cache_classes needs classes")
    CACHE_CLASSES = CACHE_CLASSES + tuple(c for c in classes if c not in CACHE_CLASSES)


@contextlib.contextmanager
def mlx_lm_cache_classes():
    """Make our cache classes (`CACHE_CLASSES`) visible to ``mlx_lm.models.cache`` by name, for the ``with`` block
    only (mlx_lm's ``load_prompt_cache`` and ``CacheList.from_state`` look classes up there by ``__name__``)."""
    namespace = vars(mlx_cache)
    for cls in CACHE_CLASSES:  # checked before anything is added: a refusal leaves the namespace as it was
        present = namespace.get(cls.__name__)
        if present is not None and present is not cls:
            raise RuntimeError(
                f"mlx_lm.models.cache already defines a different {cls.__name__}; refusing to shadow it"
            )
    added = [cls.__name__ for cls in CACHE_CLASSES if cls.__name__ not in namespace]
    try:
        for name in added:
            namespace[name] = next(c for c in CACHE_CLASSES if c.__name__ == name)
        yield
    finally:
        for name in added:
            namespace.pop(name, None)
