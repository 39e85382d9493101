"""The one alias table (`veloxquant_mlx._aliases`, issues 45 and 57): names and import paths that moved.

`EVER_EXPORTED` is the union of the package's lazy export table over its history (``git log --
veloxquant_mlx/__init__.py``, every commit's ``_EXPORTS``): each of those names must still resolve, either as a
current export or as a deprecated alias that warns and returns the replacement's own object. Every old module path
imports the module that holds its code now (one module object, never a second copy); the seed pages' paths without
a warning, the others with one, until `DEPRECATED_UNTIL`.
"""
from __future__ import annotations

import importlib
import warnings

import pytest

import veloxquant_mlx as vq
from veloxquant_mlx import _aliases
from veloxquant_mlx._version import __version__

EVER_EXPORTED = frozenset({
    "BitPackBuffer", "CODECS", "CacheOptions", "CacheSpec", "Calibration", "EncodedVector", "KVCacheBuilder",
    "KVCacheConfig", "OutlierDetector", "QUANTIZERS", "STANDALONE_METHODS", "TurboQuantChunkedPackedCache",
    "TurboQuantKVCache", "TurboQuantMSE", "TurboQuantPackedCache", "TurboQuantProd", "TurboQuantRVQ",
    "TurboQuantRVQKVCache", "TurboQuantRotatingPackedCache", "calibrate", "disable", "enable", "enabled_options",
    "is_enabled", "load_model", "load_prompt_cache", "make_prompt_cache", "mlx_lm_cache_classes",
    "registered_specs", "save_prompt_cache", "use_packed_attention",
})


def _version(text: str):
    return tuple(int(part) for part in text.split("."))


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


OLD_NAMES = sorted((module, name) for module, names in _aliases.MOVED_NAMES.items() for name in names)


def test_every_name_ever_exported_still_resolves():
    removed = set(_aliases.MOVED_NAMES[vq.__name__])
    missing = sorted(EVER_EXPORTED - set(vq._EXPORTS) - removed)
    assert not missing, f"public names removed without a deprecated alias: {missing}"
    assert not removed & set(vq._EXPORTS)


@pytest.mark.parametrize("module,name", OLD_NAMES)
def test_old_name_warns_naming_the_replacement_and_works(module, name):
    home = _aliases.MOVED_NAMES[module][name]
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated .* use {home}\.{name}$"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning):  # every access warns, not only the first one
        assert getattr(importlib.import_module(module), name) is value


def test_load_model_alias_is_the_loader():
    from veloxquant_mlx.apps.models import load_model

    with pytest.warns(DeprecationWarning, match="veloxquant_mlx.apps.models.loader.load_model"):
        from veloxquant_mlx import load_model as old
    assert old is load_model


@pytest.mark.parametrize("old", sorted(_aliases.SEED_MODULES))
def test_seed_paths_import_silently_the_module_holding_the_code(old):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        module = importlib.import_module(old)
    new = _aliases.SEED_MODULES[old]
    if new is not None:
        assert module is importlib.import_module(new)


def test_seed_pages_imports_run_as_written():
    """The import lines of the seed pages (../shared/seeds), verbatim."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from veloxquant_mlx.cache.base import STANDALONE_METHODS
        from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
        from veloxquant_mlx.core.abstractions import KVCache
        from veloxquant_mlx.core.constants import DEFAULT_N_CALIB_TOKENS, INT8_MAX
        from veloxquant_mlx.core.context import EncodedVector
        from veloxquant_mlx.dsa.bit_pack import BitPackBuffer
        from veloxquant_mlx.outlier.detector import OutlierDetector
        from veloxquant_mlx.quantizers.turboquant_mse import TurboQuantMSE
        from veloxquant_mlx.quantizers.turboquant_prod import TurboQuantProd
    assert TurboQuantRVQKVCache is vq.TurboQuantRVQKVCache and TurboQuantProd is vq.TurboQuantProd
    assert TurboQuantMSE is vq.TurboQuantMSE and BitPackBuffer is vq.BitPackBuffer
    assert EncodedVector is vq.EncodedVector and OutlierDetector is vq.OutlierDetector
    assert STANDALONE_METHODS is vq.STANDALONE_METHODS and issubclass(vq.TurboQuantKVCache, KVCache)
    assert isinstance(DEFAULT_N_CALIB_TOKENS, int) and INT8_MAX == 127


# (launcher: importing it re-executes the process, its job; an old console script still finds it)
@pytest.mark.parametrize("old", sorted(o for o, n in _aliases.MOVED_MODULES.items()
                                       if n is not None and not o.endswith(".launcher")))
def test_moved_paths_warn_and_give_the_same_module(old):
    import sys

    sys.modules.pop(old, None)  # a fresh import warns again
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .* use {_aliases.MOVED_MODULES[old]}$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(_aliases.MOVED_MODULES[old])


def test_a_moved_packages_submodule_is_one_module_object():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from veloxquant_mlx.eval import memory as old_memory
        from veloxquant_mlx.eval.memory import measure_bits as old_measure_bits
    from veloxquant_mlx.apps.eval import memory

    assert old_memory is memory and old_measure_bits is memory.measure_bits


def test_a_split_module_resolves_each_name_where_it_lives():
    from veloxquant_mlx.cache.options import CacheOptions
    from veloxquant_mlx.cache.presets import DEFAULT

    with pytest.warns(DeprecationWarning, match="veloxquant_mlx.cache.presets.DEFAULT"):
        from veloxquant_mlx.options import DEFAULT as old_default
    with pytest.warns(DeprecationWarning, match="veloxquant_mlx.cache.options.CacheOptions"):
        from veloxquant_mlx.options import CacheOptions as old_options
    assert old_default is DEFAULT and old_options is CacheOptions


def test_aliases_stay_out_of_all_and_star_import():
    removed = set(_aliases.MOVED_NAMES[vq.__name__])
    assert not removed & set(vq.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        namespace = {}
        exec("from veloxquant_mlx import *", namespace)
    assert "enable" in namespace and not removed & set(namespace)


def test_unknown_name_and_path_still_raise():
    with pytest.raises(AttributeError, match="no_such_name"):
        vq.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_name"):
        importlib.import_module("veloxquant_mlx.cache").no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("veloxquant_mlx.no_such_module")


def test_aliases_expire_after_one_version():
    moved = sorted(_aliases.MOVED_MODULES) + [f"{m}.{n}" for m, n in OLD_NAMES]
    assert _version(__version__) < _version(vq.DEPRECATED_UNTIL) or not moved, (
        f"version {__version__} reached {vq.DEPRECATED_UNTIL}: remove the deprecated aliases {moved}")
    assert _version(vq.DEPRECATED_UNTIL) <= _version(__version__)[:1] + (_version(__version__)[1] + 1, 0), (
        "a deprecated alias lives one minor version, no longer")


# -- the old spellings of "preset" (issue 45, item 4): CLI flags, the `methods` command, the eval helpers -------------
def test_cli_old_spellings_expire_with_the_aliases():
    from veloxquant_mlx.apps.cli.parser import DEPRECATED_COMMANDS
    from veloxquant_mlx.apps.server import DEPRECATED_FLAGS

    assert set(DEPRECATED_FLAGS.items()) <= {("--method", "--preset"), ("--methods", "--presets")}
    assert set(DEPRECATED_COMMANDS.items()) <= {("methods", "presets")}
    assert _version(__version__) < _version(vq.DEPRECATED_UNTIL) or not (DEPRECATED_FLAGS or DEPRECATED_COMMANDS), (
        f"version {__version__} reached {vq.DEPRECATED_UNTIL}: remove the old CLI spellings "
        f"{sorted(DEPRECATED_FLAGS) + sorted(DEPRECATED_COMMANDS)} and method_names / resolve_spec(method=)")


def test_eval_method_names_and_method_keyword_warn_and_work():
    from veloxquant_mlx.apps.eval import specs

    with pytest.warns(DeprecationWarning, match=r"method_names is deprecated .* use .*specs\.preset_names"):
        assert specs.method_names() == specs.preset_names()
    with pytest.warns(DeprecationWarning, match=r"resolve_spec\(method=\.\.\.\) is deprecated"):
        assert specs.resolve_spec(method="tq-4b") is not None
    assert specs.resolve_spec(name="tq-4b").name == "tq-4b"
    with pytest.raises(TypeError, match="once"):
        specs.resolve_spec("tq-4b", method="tq-4b")


def test_start_server_reads_an_old_namespace_with_a_warning(monkeypatch):
    import argparse

    from veloxquant_mlx.apps import server as vs

    with pytest.warns(DeprecationWarning, match="args.preset; args.method is deprecated"):
        assert vs._preset_of(argparse.Namespace(method="tq-4b")) == "tq-4b"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert vs._preset_of(argparse.Namespace(preset="kv")) == "kv"
