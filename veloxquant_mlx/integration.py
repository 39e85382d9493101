"""`enable(model)` / `disable(model)`: one line makes every mlx_lm path use compressed caches attending from codes.

mlx_lm makes its caches with ``make_prompt_cache(model)``, which returns ``model.make_cache()`` when the model has
one: `generate`, `stream_generate`, `batch_generate`, `BatchGenerator`, `mlx_lm.server` and `cache_prompt` all do.
`enable` gives the model object (not its class) a ``make_cache`` that builds our caches, and while any model is
enabled it keeps two explicit, reversible changes to mlx_lm in place:

- attention routing (:mod:`veloxquant_mlx.attention.hook`): mlx_lm's ``scaled_dot_product_attention`` sends a
  cache that offers ``attend_packed`` to it and every other cache to the original function, unchanged;
- our cache classes visible by name in ``mlx_lm.models.cache``, so mlx_lm's own ``load_prompt_cache`` reads files
  holding them.

`disable` removes the model's ``make_cache`` (restoring one the instance had before) and, with the last enabled
model, both changes. Enabling twice is a no-op apart from the new options; a model never enabled is untouched.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict

from veloxquant_mlx.attention import hook

# The configuration `enable(model)` uses without options: the best measured one so far (BENCHMARKS.md: 8-bit
# keys, 4-bit values, keys per channel over 64-token blocks, 4 exact sink tokens).
DEFAULT_CONFIGURATION = "tq-affine-k8v4"
_MISSING = object()
_lock = threading.RLock()
_enabled: Dict[int, Dict[str, Any]] = {}  # id(model) -> {"model": weakref, "previous": instance make_cache}
_mlx_lm_names = contextlib.ExitStack()


def _default_options():
    from veloxquant_mlx.eval.specs import CONFIGURATIONS

    return CONFIGURATIONS[DEFAULT_CONFIGURATION]


def enable(model, config=None, **options):
    """Make every cache mlx_lm builds for ``model`` a compressed one, attended from its codes; returns ``model``.

    ``config`` / ``options``: as `make_prompt_cache` (a `CacheOptions`, a `KVCacheConfig`, or keyword options);
    none given: the configuration named by ``DEFAULT_CONFIGURATION``.
    """
    from veloxquant_mlx.cache.builder import KVCacheBuilder
    from veloxquant_mlx.cache.prompt_cache_io import mlx_lm_cache_classes

    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
    if config is None and not options:
        config = _default_options()
    builder = KVCacheBuilder(config, **options)
    builder.build(model)  # refuse bad options now, not at the first generate

    def make_cache():
        return builder.build(model)

    make_cache.veloxquant_options = builder.options  # what `enabled_options` reports
    with _lock:
        entry = _enabled.get(id(model))
        if entry is None:
            entry = {"model": weakref.ref(model), "previous": vars(model).get("make_cache", _MISSING)}
            if not _enabled:
                hook.install()
                _mlx_lm_names.enter_context(mlx_lm_cache_classes())
            _enabled[id(model)] = entry
        model.make_cache = make_cache
    return model


def disable(model):
    """Undo `enable` for ``model`` (a no-op for a model that is not enabled); returns ``model``."""
    with _lock:
        entry = _enabled.pop(id(model), None)
        if entry is None:
            return model
        previous = entry["previous"]
        if previous is _MISSING:
            vars(model).pop("make_cache", None)
        else:
            model.make_cache = previous
        if not _enabled:
            _mlx_lm_names.close()
            hook.uninstall()
    return model


def is_enabled(model) -> bool:
    with _lock:
        entry = _enabled.get(id(model))
        return entry is not None and entry["model"]() is model


def enabled_options(model):
    """The `CacheOptions` an enabled model's caches are built with (ValueError if it is not enabled)."""
    if not is_enabled(model):
        raise ValueError("model is not enabled: call veloxquant_mlx.enable(model) first")
    return model.make_cache.veloxquant_options
