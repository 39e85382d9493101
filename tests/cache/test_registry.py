"""The cache classes by name (veloxquant_mlx.cache.registry): what prompt-cache files name, classes registered later,
and the reversible context in which mlx_lm's own loader sees them."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.chunked import TurboQuantChunkedPackedCache
from veloxquant_mlx.cache.packed_cache import (TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache,
                                               TurboQuantPackedCache, TurboQuantRotatingPackedCache)
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

BUILT_IN = {TurboQuantPackedCache, TurboQuantRotatingPackedCache, TurboQuantRVQKVCache, TurboQuantBatchPackedCache,
            TurboQuantBatchRotatingPackedCache, TurboQuantChunkedPackedCache}


def test_every_cache_class_is_known_by_name():
    assert BUILT_IN <= set(registry.CACHE_CLASSES)
    names = [c.__name__ for c in registry.CACHE_CLASSES]
    assert len(names) == len(set(names))  # one class per name


def test_registering_adds_each_class_once(monkeypatch):
    monkeypatch.setattr(registry, "CACHE_CLASSES", registry.CACHE_CLASSES)  # (restored after the test)

    class MyCache(TurboQuantPackedCache):
        pass

    before = registry.CACHE_CLASSES
    registry.register_cache_classes(MyCache, TurboQuantPackedCache)
    registry.register_cache_classes(MyCache)
    assert registry.CACHE_CLASSES == before + (MyCache,)
    with pytest.raises(TypeError, match="register_cache_classes needs classes"):
        registry.register_cache_classes("MyCache")
    assert registry.CACHE_CLASSES == before + (MyCache,)


def test_mlx_lm_sees_the_classes_inside_the_block_only(tmp_path):
    namespace = vars(mlx_cache)
    assert not any(c.__name__ in namespace for c in registry.CACHE_CLASSES)
    cache = TurboQuantPackedCache(codec="affine", k_bits=4)
    k = mx.random.normal((1, 2, 10, 32), key=mx.random.key(0))
    cache.update_and_fetch(k, k)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, [cache])
    with pytest.raises(KeyError, match="TurboQuantPackedCache"):  # mlx_lm looks the name up in its own module
        mlx_cache.load_prompt_cache(path)
    with registry.mlx_lm_cache_classes():
        assert all(namespace[c.__name__] is c for c in registry.CACHE_CLASSES)
        (loaded,) = mlx_cache.load_prompt_cache(path)
    assert type(loaded) is TurboQuantPackedCache and loaded.offset == 10
    assert not any(c.__name__ in namespace for c in registry.CACHE_CLASSES)  # as it was


def test_a_different_class_of_the_same_name_is_not_shadowed(monkeypatch):
    impostor = type("TurboQuantPackedCache", (), {})
    monkeypatch.setitem(vars(mlx_cache), "TurboQuantPackedCache", impostor)
    with pytest.raises(RuntimeError, match="already defines a different TurboQuantPackedCache"):
        with registry.mlx_lm_cache_classes():
            pass
    assert vars(mlx_cache)["TurboQuantPackedCache"] is impostor


def test_a_refusal_leaves_mlx_lm_s_namespace_as_it_was(monkeypatch):
    namespace = vars(mlx_cache)
    later = registry.CACHE_CLASSES[-1].__name__  # (refused after every other class was added)
    monkeypatch.setitem(namespace, later, type(later, (), {}))
    try:
        with pytest.raises(RuntimeError, match=f"already defines a different {later}"):
            with registry.mlx_lm_cache_classes():
                pass
        leaked = [c.__name__ for c in registry.CACHE_CLASSES if c.__name__ != later and c.__name__ in namespace]
        assert leaked == []
    finally:
        for c in registry.CACHE_CLASSES:
            if c.__name__ != later and namespace.get(c.__name__) is c:
                del namespace[c.__name__]
