"""`enable(model)` / `disable(model)`: mlx_lm makes its caches with ``make_prompt_cache(model)``, which returns
``model.make_cache()`` when the model has one (`generate`, `stream_generate`, `batch_generate`, `BatchGenerator`,
``mlx_lm.server`` and ``cache_prompt`` all do). `enable` gives the model object (not its class) a ``make_cache``
that builds our caches, and while any model is enabled it keeps the attention routing installed and our cache
classes visible by name in ``mlx_lm.models.cache`` (`mlx_lm_cache_classes`: mlx_lm's own ``load_prompt_cache``
then reads files holding them). `disable` removes the model's ``make_cache`` (restoring one the instance had
before) and, with the last enabled model, both changes. Enabling twice is a no-op apart from the new options; a
model never enabled is untouched.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Dict

from veloxquant_mlx.cache.registry import mlx_lm_cache_classes
from veloxquant_mlx.integration.builder import KVCacheBuilder, coverage_line
from veloxquant_mlx.integration.routing import install, uninstall

_MISSING = object()
_enable_lock = threading.RLock()
_enabled: Dict[int, Dict[str, Any]] = {}  # id(model) -> {"model": weakref, "previous": instance make_cache}
_mlx_lm_names = contextlib.ExitStack()


def enable(model, config=None, *, calibration=None, **options):
    """Make every cache mlx_lm builds for ``model`` a compressed one, attended from its codes; returns ``model``.

    ``config`` / ``options``: as `make_prompt_cache` (a preset name, a `CacheOptions`, a `KVCacheConfig`, or
    keyword options); none given: `veloxquant_mlx.cache.presets.DEFAULT`. ``calibration``: a `Calibration` of this
    model (`veloxquant_mlx.calibrate`, `Calibration.load`): its channel weights in every layer's cache.
    """
    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
    builder = KVCacheBuilder(config, calibration=calibration, **options)
    line = coverage_line(model, builder.build(model))  # refuse bad options now, not at the first generate
    for text in ([line] if line is not None else []) + [f"veloxquant_mlx: {n}" for n in builder.notes]:
        warnings.warn(text, stacklevel=2)

    def make_cache():
        return builder.build(model)

    make_cache.veloxquant_options = builder.options  # what `enabled_options` reports
    with _enable_lock:
        entry = _enabled.get(id(model))
        if entry is None:
            entry = {"model": weakref.ref(model), "previous": vars(model).get("make_cache", _MISSING)}
            if not _enabled:
                install()
                _mlx_lm_names.enter_context(mlx_lm_cache_classes())
            _enabled[id(model)] = entry
        model.make_cache = make_cache
    return model


def disable(model):
    """Undo `enable` for ``model`` (a no-op for a model that is not enabled); returns ``model``."""
    with _enable_lock:
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
            uninstall()
    return model


def is_enabled(model) -> bool:
    with _enable_lock:
        entry = _enabled.get(id(model))
        return entry is not None and entry["model"]() is model


def enabled_options(model):
    """The `CacheOptions` an enabled model's caches are built with (ValueError if it is not enabled)."""
    if not is_enabled(model):
        raise ValueError("model is not enabled: call veloxquant_mlx.enable(model) first")
    return model.make_cache.veloxquant_options
