"""The named presets and THE default (veloxquant_mlx.cache.presets): what each name is, the rule `resolve_options`
follows for what a caller gives, and the errors that name the choices. The budget presets' bits:
tests/cache/test_presets_budgets.py."""
from __future__ import annotations

import dataclasses

import pytest

from veloxquant_mlx.cache import presets
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.compat.config import KVCacheConfig


def test_the_default_is_the_affine_k8v4_preset():
    assert presets.DEFAULT_NAME == "tq-affine-k8v4" and presets.DEFAULT is presets.PRESETS["tq-affine-k8v4"]
    d = presets.DEFAULT
    assert (d.codec, d.k_bits, d.v_bits, d.sink, d.short_window) == ("affine_block", 8, 4, presets.SINK_TOKENS,
                                                                     presets.SHORT_WINDOW)
    assert presets.SINK_TOKENS == 4 and presets.SHORT_WINDOW == 1024


def test_every_preset_is_read_only_options_and_the_budgets_are_presets():
    assert all(isinstance(o, CacheOptions) for o in presets.PRESETS.values())
    assert list(presets.PRESETS)[:2] == ["tq-mse-k4v4", "tq-mse-k3v3"]  # (display order)
    with pytest.raises(TypeError):
        presets.PRESETS["mine"] = CacheOptions()
    assert dict(presets.BUDGETS) == {"tq-4b": 4.25, "tq-3b": 3.25, "tq-2b": 2.25}
    for name in presets.BUDGETS:
        o = presets.PRESETS[name]
        assert (o.codec, o.code_batch, o.code_from, o.sink, o.rope_offset) == ("token_lloyd8", 1, 128, 1, "auto")
        assert o.k_bits == o.v_bits == int(name[3])
    prod = presets.PRESETS["tq-prod-k4v4"]
    assert (prod.method, prod.codec, prod.k_bits, prod.v_bits, prod.sink) == ("turboquant_prod", "lloyd_max", 4, 4, 4)


def test_preset_names_the_presets_when_there_is_none():
    assert presets.preset("tq-3b") is presets.PRESETS["tq-3b"]
    with pytest.raises(ValueError, match="unknown preset 'tq-9b'; presets: tq-mse-k4v4, tq-mse-k3v3"):
        presets.preset("tq-9b")
    with pytest.raises(TypeError, match="a preset name must be a str, got int"):
        presets.preset(4)


def test_resolve_options_follows_its_rule():
    assert presets.resolve_options() is presets.DEFAULT
    # keyword options alone start from the field defaults, not from the default preset
    alone = presets.resolve_options(k_bits=3)
    assert alone == CacheOptions(k_bits=3) and alone.codec == "lloyd_max" and alone.sink == 0
    assert presets.resolve_options(presets.DEFAULT_NAME, v_bits=8) == dataclasses.replace(presets.DEFAULT, v_bits=8)
    mine = CacheOptions(codec="affine", k_bits=4)
    assert presets.resolve_options(mine) is mine
    assert presets.resolve_options(mine, sink=2) == dataclasses.replace(mine, sink=2)
    seed = presets.resolve_options(KVCacheConfig(bit_width_inlier=2), recent=4)
    assert (seed.k_bits, seed.recent) == (2, 4)


def test_resolve_options_names_what_it_cannot_use():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bitz'\]"):
        presets.resolve_options("tq-4b", bitz=3)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        presets.resolve_options("nope")
    with pytest.raises(TypeError, match="config must be a preset name, a CacheOptions, a KVCacheConfig or None, got "
                                        "dict"):
        presets.resolve_options({"k_bits": 4})
    with pytest.raises(ValueError, match="k_bits must be one of"):  # (a preset's fields are checked as replaced)
        presets.resolve_options("tq-affine-k4v4", k_bits=7)
