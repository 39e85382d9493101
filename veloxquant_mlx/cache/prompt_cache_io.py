"""Prompt-cache files holding veloxquant caches, in mlx_lm's own ``.safetensors`` format.

The file layout is exactly mlx_lm's (``save_prompt_cache`` writes it): each cache's ``state`` flattened
into arrays, its class name in the metadata. Our caches put their config and options in ``state`` (a JSON
string), so a file is self-describing.

mlx_lm's ``load_prompt_cache`` looks class names up in its own module's globals, where ours are not.
`mlx_lm_cache_classes()` is an explicit, reversible context in which they are: inside the ``with``
block, ``mlx_lm.models.cache.load_prompt_cache`` (and ``CacheList`` restores) can rebuild our caches;
on exit the module is as it was. Nothing is patched at import time. `load_prompt_cache` here simply
calls mlx_lm's inside that context, so both loaders read the same files.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

from mlx_lm.models import cache as mlx_cache

VERSION_KEY = "veloxquant_mlx_version"


def _our_classes():
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
    from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache

    return (TurboQuantPackedCache, TurboQuantRotatingPackedCache, TurboQuantRVQKVCache)


@contextlib.contextmanager
def mlx_lm_cache_classes():
    """Make our cache classes visible to ``mlx_lm.models.cache`` by name, for the ``with`` block only."""
    namespace = vars(mlx_cache)
    added = []
    for cls in _our_classes():
        present = namespace.get(cls.__name__)
        if present is None:
            namespace[cls.__name__] = cls
            added.append(cls.__name__)
        elif present is not cls:
            raise RuntimeError(
                f"mlx_lm.models.cache already defines a different {cls.__name__}; refusing to shadow it"
            )
    try:
        yield
    finally:
        for name in added:
            namespace.pop(name, None)


def save_prompt_cache(file_name: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None) -> None:
    """Save ``cache`` (any mix of our and mlx_lm's caches) to ``file_name`` in mlx_lm's format."""
    import veloxquant_mlx

    if not isinstance(cache, (list, tuple)) or not cache:
        raise ValueError("cache must be a non-empty list of per-layer caches")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")
    meta = dict(metadata or {})
    meta.setdefault(VERSION_KEY, veloxquant_mlx.__version__)
    mlx_cache.save_prompt_cache(file_name, list(cache), meta)


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load a prompt-cache file written by `save_prompt_cache` (or by mlx_lm itself)."""
    with mlx_lm_cache_classes():
        return mlx_cache.load_prompt_cache(file_name, return_metadata=return_metadata)
