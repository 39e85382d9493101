"""The one alias table: every documented import path whose code moved, and the package's lazy public names.

- `SEED_MODULES`: the seed pages' module paths (``veloxquant_mlx.core.abstractions``, ``veloxquant_mlx.dsa.bit_pack``,
  ``veloxquant_mlx.quantizers.turboquant_prod``, ``veloxquant_mlx.cache.turboquant_rvq_cache``, ...). They are the
  documented API of the seed pages: importing one returns the module that holds the code now, silently, for good.
- `MOVED_MODULES`: other documented paths whose module moved (issue 57's folders in layer order). Importing one
  returns the new module and warns (DeprecationWarning naming it) until `DEPRECATED_UNTIL`. A moved package maps
  its submodules too (``veloxquant_mlx.eval.memory`` -> ``veloxquant_mlx.apps.eval.memory``): one module object per
  file, never a second copy.
- `MOVED_NAMES`: names read from a module that no longer defines them (a split module, a former re-export hub):
  ``old module -> {name: module that defines it now}``; each access warns and returns the defining module's object.
  An old module that is gone entirely (``veloxquant_mlx.options``) is rebuilt here as an empty module whose names
  resolve through this table.

`install()` (called once by ``veloxquant_mlx/__init__.py``) adds the finder that answers for these old paths and
for nothing else; `package_getattr` is the only module-level ``__getattr__`` of the package (the facade's lazy
public names, and the old names of a package that moved).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Callable, Dict, Mapping, Optional

from veloxquant_mlx._version import DEPRECATED_UNTIL

P = "veloxquant_mlx"

# The seed pages' paths (../shared/seeds): permanent, no warning. A value None is an old package kept as a namespace
# for its submodules (its names, if any, in MOVED_NAMES without a warning: `SEED_NAMES`).
SEED_MODULES: Mapping[str, Optional[str]] = {
    f"{P}.core": None,
    f"{P}.core.abstractions": f"{P}.compat.abstractions",
    f"{P}.core.constants": f"{P}.compat.constants",
    f"{P}.core.context": f"{P}.quant.encoded_vector",
    f"{P}.dsa": None,
    f"{P}.dsa.bit_pack": f"{P}.quant.bit_pack",
    f"{P}.outlier": None,
    f"{P}.outlier.detector": f"{P}.compat.outlier",
    f"{P}.quantizers": None,
    f"{P}.quantizers.turboquant_mse": f"{P}.quant.turboquant_mse",
    f"{P}.quantizers.turboquant_prod": f"{P}.quant.turboquant_prod",
    f"{P}.quantizers.turboquant_rvq": f"{P}.quant.turboquant_rvq",
    f"{P}.cache.base": f"{P}.compat.methods",
    f"{P}.cache.turboquant_cache": f"{P}.compat.turboquant_cache",
    f"{P}.cache.turboquant_rvq_cache": f"{P}.compat.turboquant_rvq_cache",
}
# Names of the seed pages' old packages (``from veloxquant_mlx.quantizers import TurboQuantProd``): no warning.
SEED_NAMES: Mapping[str, Mapping[str, str]] = {
    f"{P}.quantizers": {"QUANTIZERS": f"{P}.quant.quantizers", "TurboQuantMSE": f"{P}.quant.turboquant_mse",
                        "TurboQuantProd": f"{P}.quant.turboquant_prod", "TurboQuantRVQ": f"{P}.quant.turboquant_rvq"},
    f"{P}.dsa": {name: f"{P}.quant.bit_pack" for name in
                 ("BitPackBuffer", "pack", "packed_bytes", "packed_words", "unpack")},
    f"{P}.outlier": {"OutlierDetector": f"{P}.compat.outlier"},
}

# Documented paths that moved in 0.1 (issue 57): they warn until DEPRECATED_UNTIL. A package maps its submodules.
MOVED_MODULES: Mapping[str, Optional[str]] = {
    f"{P}.config": f"{P}.compat.config",
    f"{P}.rotation": f"{P}.quant.rotation",
    f"{P}.codebooks": f"{P}.quant.codebooks",
    f"{P}.calibration": None,
    f"{P}.calibration.file": f"{P}.integration.calibration",
    f"{P}.calibration.weights": f"{P}.quant.channel_weights",
    f"{P}.measure_calibration": f"{P}.integration.measure_calibration",
    f"{P}.model_shape": f"{P}.integration.model_shape",
    f"{P}.options": None,
    f"{P}.cli": f"{P}.apps.cli",
    f"{P}.server": f"{P}.apps.server",
    f"{P}.server_requests": f"{P}.apps.server_requests",
    f"{P}.eval": f"{P}.apps.eval",
    f"{P}.models": f"{P}.apps.models",
    f"{P}.distributed": f"{P}.apps.distributed",
    f"{P}.blas": f"{P}.apps.blas",
    f"{P}.launcher": f"{P}.apps.launcher",
}
_PACKAGES_MOVED = (f"{P}.cli", f"{P}.eval", f"{P}.models")  # their submodules map too

_OPTIONS = ("CacheOptions", "KINDS", "METHODS", "adapted_reason")
_PRESETS = ("PRESETS", "DEFAULT", "DEFAULT_NAME", "BUDGETS", "SINK_TOKENS", "SHORT_WINDOW", "preset",
            "resolve_options")
_INTEGRATION = {
    "routing": ("install", "uninstall", "use_packed_attention", "hold_while_alive", "routes_model",
                "packed_scaled_dot_product_attention"),
    "scan": ("attention_is_routable", "fetches_real_arrays", "latent_attention", "reads_fetched_arrays",
             "uniform_head_dim"),
    "builder": ("KVCacheBuilder", "make_prompt_cache", "register_cache_kind", "cache_report", "coverage_line",
                "CACHE_KINDS"),
    "enabling": ("enable", "disable", "is_enabled", "enabled_options"),
}
MOVED_NAMES: Mapping[str, Mapping[str, str]] = {
    f"{P}.options": {**{n: f"{P}.cache.options" for n in _OPTIONS}, **{n: f"{P}.cache.presets" for n in _PRESETS}},
    f"{P}.calibration": {"Calibration": f"{P}.integration.calibration"},
    # integration/__init__.py re-exported its modules' names until issue 57
    f"{P}.integration": {**{n: f"{P}.integration.{mod}" for mod, names in _INTEGRATION.items() for n in names},
                         "mlx_lm_cache_classes": f"{P}.cache.registry", "CACHE_CLASSES": f"{P}.cache.registry"},
    # cache/__init__.py's lazy exports until issue 57 (the builder's two names there were already deprecated)
    f"{P}.cache": {
        **{n: f"{P}.cache.packed_cache" for n in (
            "TurboQuantPackedCache", "TurboQuantRotatingPackedCache", "TurboQuantBatchPackedCache",
            "TurboQuantBatchRotatingPackedCache")},
        "TurboQuantChunkedPackedCache": f"{P}.cache.chunked", "CacheOptions": f"{P}.cache.options",
        "TurboQuantRVQKVCache": f"{P}.compat.turboquant_rvq_cache",
        "TurboQuantKVCache": f"{P}.compat.turboquant_cache",
        "save_prompt_cache": f"{P}.cache.prompt_cache_io", "load_prompt_cache": f"{P}.cache.prompt_cache_io",
        "mlx_lm_cache_classes": f"{P}.cache.registry",
        "SERVABLE_METHODS": f"{P}.compat.methods", "STANDALONE_METHODS": f"{P}.compat.methods",
        "KVCacheBuilder": f"{P}.integration.builder", "make_prompt_cache": f"{P}.integration.builder"},
    # the package's public names removed before issue 57 (each warned already)
    P: {"load_model": f"{P}.apps.models.loader", "CacheSpec": f"{P}.apps.eval.specs",
        "registered_specs": f"{P}.apps.eval.specs"},
}


def target_module(old: str) -> Optional[str]:
    """The module an old path imports now (None: an old package kept as a namespace), or raises KeyError."""
    for table in (SEED_MODULES, MOVED_MODULES):
        if old in table:
            return table[old]
    for package in _PACKAGES_MOVED:
        if old.startswith(package + "."):
            return MOVED_MODULES[package] + old[len(package):]
    raise KeyError(old)


def is_seed(old: str) -> bool:
    return old in SEED_MODULES or old in SEED_NAMES


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in {DEPRECATED_UNTIL}; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def resolve_name(module: str, name: str):
    """``module.name`` through the tables (AttributeError when neither has it)."""
    seed = SEED_NAMES.get(module, {}).get(name)
    if seed is not None:
        return getattr(importlib.import_module(seed), name)
    home = MOVED_NAMES.get(module, {}).get(name)
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{home}.{name}", stacklevel=4)
    return getattr(importlib.import_module(home), name)


def package_getattr(module: str, exports: Optional[Mapping[str, str]] = None) -> Callable[[str], object]:
    """The ``__getattr__`` of a package module: its lazy ``exports`` (name -> defining module, cached once read),
    then its old names (`MOVED_NAMES`, warning on every access)."""
    exports = dict(exports or {})

    def __getattr__(name: str):
        home = exports.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home), name)
            setattr(sys.modules[module], name, value)
            return value
        return resolve_name(module, name)

    return __getattr__


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, placeholder):
        old = placeholder.__name__
        new = target_module(old)
        if new is None:  # an old package: a namespace for its submodules and its old names
            placeholder.__path__ = []
            placeholder.__doc__ = f"The old package {old}: its modules moved (veloxquant_mlx._aliases)."
            placeholder.__getattr__ = package_getattr(old)
            return
        if not is_seed(old):
            _warn(old, new, stacklevel=8)
        sys.modules[old] = importlib.import_module(new)  # the import statement returns this module


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of the tables, and nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(P + "."):
            return None
        try:
            target_module(fullname)
        except KeyError:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(), is_package=True)


_FINDER = _AliasFinder()


def install() -> None:
    """Let the old paths import (once; first in ``sys.meta_path`` so that a moved package's old path never loads its
    files a second time under the old name)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


ALL_OLD_MODULES: Dict[str, Optional[str]] = {**SEED_MODULES, **MOVED_MODULES}
