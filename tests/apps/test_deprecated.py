"""Public names removed from ``veloxquant_mlx`` come back as deprecated aliases for one version (issue 45, item 9).

`EVER_EXPORTED` is the union of the package's lazy export table over its history (``git log --
veloxquant_mlx/__init__.py``, every commit's ``_EXPORTS``): each of those names must still resolve, either as a
current export or as a deprecated alias that warns and returns the replacement's own object.
"""
from __future__ import annotations

import importlib
import warnings

import pytest

import veloxquant_mlx as vq
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


def test_every_name_ever_exported_still_resolves():
    missing = sorted(EVER_EXPORTED - set(vq._EXPORTS) - set(vq._DEPRECATED))
    assert not missing, f"public names removed without a deprecated alias: {missing}"
    assert set(vq._DEPRECATED) == set(vq._REPLACEMENTS)
    assert not set(vq._DEPRECATED) & set(vq._EXPORTS)


@pytest.mark.parametrize("name", sorted(vq._DEPRECATED))
def test_alias_warns_naming_the_replacement_and_works(name):
    replacement = vq._REPLACEMENTS[name]
    with pytest.warns(DeprecationWarning, match=rf"veloxquant_mlx\.{name} is deprecated .* use {replacement}$"):
        value = getattr(vq, name)
    assert value is _resolve(replacement)
    with pytest.warns(DeprecationWarning):  # every access warns, not only the first one
        assert getattr(vq, name) is value


def test_load_model_alias_is_the_loader():
    from veloxquant_mlx.models import load_model

    with pytest.warns(DeprecationWarning, match="veloxquant_mlx.models.load_model"):
        from veloxquant_mlx import load_model as old
    assert old is load_model


def test_aliases_stay_out_of_all_and_star_import():
    assert not set(vq._DEPRECATED) & set(vq.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        namespace = {}
        exec("from veloxquant_mlx import *", namespace)
    assert "enable" in namespace and not set(vq._DEPRECATED) & set(namespace)


def test_unknown_name_still_raises():
    with pytest.raises(AttributeError, match="no_such_name"):
        vq.no_such_name  # noqa: B018


def test_aliases_expire_after_one_version():
    assert _version(__version__) < _version(vq.DEPRECATED_UNTIL) or not vq._DEPRECATED, (
        f"version {__version__} reached {vq.DEPRECATED_UNTIL}: remove the deprecated aliases {sorted(vq._DEPRECATED)}")
    assert _version(vq.DEPRECATED_UNTIL) <= _version(__version__)[:1] + (_version(__version__)[1] + 1, 0), (
        "a deprecated alias lives one minor version, no longer")


# -- the old spellings of "preset" (issue 45, item 4): CLI flags, the `methods` command, the eval helpers -------------
def test_cli_old_spellings_expire_with_the_aliases():
    from veloxquant_mlx.cli.parser import DEPRECATED_COMMANDS
    from veloxquant_mlx.server import DEPRECATED_FLAGS

    assert set(DEPRECATED_FLAGS.items()) <= {("--method", "--preset"), ("--methods", "--presets")}
    assert set(DEPRECATED_COMMANDS.items()) <= {("methods", "presets")}
    assert _version(__version__) < _version(vq.DEPRECATED_UNTIL) or not (DEPRECATED_FLAGS or DEPRECATED_COMMANDS), (
        f"version {__version__} reached {vq.DEPRECATED_UNTIL}: remove the old CLI spellings "
        f"{sorted(DEPRECATED_FLAGS) + sorted(DEPRECATED_COMMANDS)} and method_names / resolve_spec(method=)")


def test_eval_method_names_and_method_keyword_warn_and_work():
    from veloxquant_mlx.eval import specs

    with pytest.warns(DeprecationWarning, match=r"method_names is deprecated .* use .*specs\.preset_names"):
        assert specs.method_names() == specs.preset_names()
    with pytest.warns(DeprecationWarning, match=r"resolve_spec\(method=\.\.\.\) is deprecated"):
        assert specs.resolve_spec(method="tq-4b") is not None
    assert specs.resolve_spec(name="tq-4b").name == "tq-4b"
    with pytest.raises(TypeError, match="once"):
        specs.resolve_spec("tq-4b", method="tq-4b")


def test_start_server_reads_an_old_namespace_with_a_warning(monkeypatch):
    import argparse

    from veloxquant_mlx import server as vs

    with pytest.warns(DeprecationWarning, match="args.preset; args.method is deprecated"):
        assert vs._preset_of(argparse.Namespace(method="tq-4b")) == "tq-4b"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert vs._preset_of(argparse.Namespace(preset="kv")) == "kv"
