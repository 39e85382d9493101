"""Everything that touches mlx_lm's behaviour, in one package: compressed caches for a model, attention routed to
their codes, their classes visible to mlx_lm's loader. Nothing is patched at import time.

One module per job, each importing only the ones listed before it:

- `routing`: attention routing (`install` / `uninstall` / `use_packed_attention` / `hold_while_alive`, the
  replacement `packed_scaled_dot_product_attention`, `routes_model`) and the routing's state (its count and lock);
- `scan`: which models the routing reaches (`attention_is_routable`, `fetches_real_arrays`, `uniform_head_dim`,
  `latent_attention`: read from the model's modules, their bytecode and syntax trees);
- `builder`: building caches (`KVCacheBuilder`, `make_prompt_cache`, `CACHE_KINDS`, `register_cache_kind`) and
  what a cache list compressed (`cache_report`, `coverage_line`);
- `enabling`: `enable` / `disable` / `is_enabled` / `enabled_options` (mlx_lm's own paths then build our caches).

Every name the single module ``integration.py`` had stays importable from here. Module-level state (the routing's
``_depth`` / ``_original`` / ``_lock`` / ``_pending`` ..., `CACHE_KINDS`, the enabled models) lives in its one
module and is read through it (`__getattr__` below), never copied here: a name bound here would keep the old value
once its module rebinds it. Patch state, and a function, on the module that uses it
(``monkeypatch.setattr(integration.routing, "_original", ...)``, ``integration.builder.attention_is_routable``):
a patch of this package's name does not reach the submodules.
"""
from __future__ import annotations

# The names the single module had at its top (its imports) stay reachable here.
import ast  # noqa: F401
import collections  # noqa: F401
import contextlib  # noqa: F401
import dataclasses  # noqa: F401
import dis  # noqa: F401
import functools  # noqa: F401
import inspect  # noqa: F401
import sys  # noqa: F401
import threading  # noqa: F401
import warnings  # noqa: F401
import weakref  # noqa: F401
from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: F401

from mlx_lm.models import base as mlx_base  # noqa: F401
from mlx_lm.models import cache as mlx_cache  # noqa: F401

from veloxquant_mlx.attention import hook  # noqa: F401
from veloxquant_mlx.calibration.file import Calibration  # noqa: F401
from veloxquant_mlx.codecs import codec_layout  # noqa: F401
from veloxquant_mlx.model_shape import head_dim as model_head_dim  # noqa: F401
from veloxquant_mlx.options import adapted_reason, resolve_options  # noqa: F401
from veloxquant_mlx.validate import check_bool, check_int  # noqa: F401
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.registry import mlx_lm_cache_classes  # noqa: F401

# The submodules, and their names (functions and constants: the same objects, nothing to go stale).
from veloxquant_mlx.integration import builder, enabling, routing, scan
from veloxquant_mlx.integration.routing import (  # noqa: F401
    _NAME, _TRAILING, _drain, _fast_arguments, _mlx_lm_modules, _release, _uninstall_locked, hold_while_alive, install,
    packed_scaled_dot_product_attention, routes_model, uninstall, use_packed_attention)
from veloxquant_mlx.integration.scan import (  # noqa: F401
    _SHAPE_ATTRIBUTES, _calls_fast_sdpa_directly, _code_objects, _fetch_reads, _model_modules, _reads_member_arrays,
    attention_is_routable, fetches_real_arrays, latent_attention, reads_fetched_arrays, uniform_head_dim)
from veloxquant_mlx.integration.builder import (  # noqa: F401
    _PLAIN_REASONS, KVCacheBuilder, TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache,
    TurboQuantChunkedPackedCache, TurboQuantPackedCache, TurboQuantRotatingPackedCache, TurboQuantRVQKVCache,
    _attends_from_codes, _chunked, _full_attention, _model_layout, _sliding_window, _window_options, cache_report,
    coverage_line, make_prompt_cache, register_cache_kind)
from veloxquant_mlx.integration.enabling import _MISSING, disable, enable, enabled_options, is_enabled  # noqa: F401

__all__ = [
    "CACHE_CLASSES", "attention_is_routable", "cache_report", "coverage_line", "disable", "enable",
    "enabled_options", "fetches_real_arrays", "hold_while_alive", "install", "is_enabled", "KVCacheBuilder",
    "latent_attention", "make_prompt_cache", "mlx_lm_cache_classes", "packed_scaled_dot_product_attention",
    "routes_model", "uniform_head_dim", "uninstall", "use_packed_attention",
]

# Module-level state -> the one module holding it (read there on every access, see the docstring).
_STATE = {
    **dict.fromkeys(("_lock", "_depth", "_pending", "_original", "_signature", "_patched"), routing),
    "CACHE_KINDS": builder,
    **dict.fromkeys(("_enable_lock", "_enabled", "_mlx_lm_names"), enabling),
}


# -- our cache classes in mlx_lm's namespace: `mlx_lm_cache_classes` and the classes, in cache/registry.py ----------

def __getattr__(name: str):
    if name == "CACHE_CLASSES":  # read live: kinds registered later included
        return registry.CACHE_CLASSES
    if name in _STATE:  # read live: the state of the routing, the builder and enable
        return getattr(_STATE[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_STATE))
