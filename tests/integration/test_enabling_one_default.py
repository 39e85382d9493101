"""One configuration type, one default: every entry point given nothing resolves to `veloxquant_mlx.cache.presets.DEFAULT`.

Entry points: `enable(model)`, `make_prompt_cache(model)`, ``veloxquant generate`` and ``veloxquant serve`` (their
parsed ``--preset`` default, resolved as the commands resolve it). Models: a tiny random mlx_lm llama (no network).
"""
from __future__ import annotations

import argparse
import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import veloxquant_mlx as vq
from veloxquant_mlx import integration
from veloxquant_mlx.integration import enabling
from veloxquant_mlx.apps import cli
from veloxquant_mlx.cache import options, presets
from veloxquant_mlx.apps import server as vs
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.apps.eval import specs
from veloxquant_mlx.cache.presets import DEFAULT, DEFAULT_NAME, PRESETS, resolve_options
from veloxquant_mlx.cache.options import CacheOptions


def tiny_llama():
    """2 layers, 2 query heads / 1 KV head of head_dim 64 (the affine codecs' group), random weights."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                                        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
                                        vocab_size=64))
    mx.eval(model.parameters())
    return model


def layer_form(o: CacheOptions) -> CacheOptions:
    """Options as one layer's cache holds them, without the model's head_dim the builder fills in."""
    return dataclasses.replace(o.layer_options(), head_dim=None)


def test_the_default_is_one_named_preset():
    assert DEFAULT_NAME == "tq-affine-k8v4" and DEFAULT is PRESETS[DEFAULT_NAME]
    assert (DEFAULT.codec, DEFAULT.k_bits, DEFAULT.v_bits, DEFAULT.sink) == ("affine_block", 8, 4, 4)
    assert specs.CONFIGURATIONS is PRESETS  # the registry of named configurations is the one table
    assert specs.resolve_spec(DEFAULT_NAME).options is DEFAULT


def test_enable_uses_the_default():
    model = tiny_llama()
    vq.enable(model)
    try:
        assert enabling.enabled_options(model) == DEFAULT
    finally:
        vq.disable(model)


def test_make_prompt_cache_uses_the_default():
    # the builder (integration.KVCacheBuilder) resolves through options.resolve_options: nothing given is DEFAULT
    caches = vq.make_prompt_cache(tiny_llama(), route_attention=False)
    assert len(caches) == 2
    assert {layer_form(c.options) for c in caches} == {layer_form(DEFAULT)}
    assert all(c.options.head_dim == 64 for c in caches)  # the model's head_dim filled in, nothing else differs


def test_cli_generate_default_is_the_default():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.preset == DEFAULT_NAME
    assert specs.resolve_spec(args.preset, args.bits).options == DEFAULT  # what cmd_generate enables
    # the plain cache stays one flag away
    assert specs.resolve_spec(cli.build_parser().parse_args(["generate", "--preset", "kv"]).preset).options is None


def test_serve_default_is_the_default():
    for args in (vs.add_serve_arguments(argparse.ArgumentParser()).parse_args([]),
                 cli.build_parser().parse_args(["serve"])):
        assert args.preset == DEFAULT_NAME == vs.DEFAULT_PRESET
        assert specs.resolve_spec(args.preset, args.bits).options == DEFAULT  # what start_server builds


def test_every_entry_point_agrees():
    model = tiny_llama()
    vq.enable(model)
    try:
        enabled = enabling.enabled_options(model)
    finally:
        vq.disable(model)
    generate = specs.resolve_spec(cli.build_parser().parse_args(["generate", "--prompt", "x"]).preset).options
    serve = specs.resolve_spec(vs.add_serve_arguments(argparse.ArgumentParser()).parse_args([]).preset).options
    assert enabled == generate == serve == resolve_options() == DEFAULT


# -- the rule of resolve_options ----------------------------------------------------------------------------------
def test_resolve_options_rule():
    assert resolve_options() is DEFAULT and resolve_options(None) is DEFAULT
    # keyword options alone: on top of CacheOptions' field defaults, as always (not on top of DEFAULT)
    assert resolve_options(k_bits=3) == CacheOptions(k_bits=3)
    assert resolve_options(k_bits=[4, 3]).k_bits == (4, 3)
    # a preset name, a CacheOptions: keyword options replace their fields
    assert resolve_options(DEFAULT_NAME) is DEFAULT
    assert resolve_options(DEFAULT_NAME, sink=0) == dataclasses.replace(DEFAULT, sink=0)
    assert resolve_options("tq-4b") is PRESETS["tq-4b"]
    custom = CacheOptions(k_bits=2)
    assert resolve_options(custom) is custom and resolve_options(custom, v_bits=3).v_bits == 3
    # the seed pages' KVCacheConfig: bit_width_inlier is k_bits
    assert resolve_options(KVCacheConfig(bit_width_inlier=3), sink=2) == CacheOptions(k_bits=3, sink=2)


@pytest.mark.parametrize("config, options, err, match", [
    ("tq-nope", {}, ValueError, "presets: tq-mse-k4v4"),
    (3, {}, TypeError, "preset name, a CacheOptions"),
    (None, {"kbits": 4}, TypeError, r"unknown option\(s\) \['kbits'\]"),
    (DEFAULT, {"kbits": 4}, TypeError, "unknown option"),
    (DEFAULT_NAME, {"k_bits": 9}, ValueError, "k_bits"),
])
def test_resolve_options_refuses(config, options, err, match):
    with pytest.raises(err, match=match):
        resolve_options(config, **options)


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        PRESETS["mine"] = CacheOptions()  # type: ignore[index]
    assert set(presets.BUDGETS) <= set(PRESETS)
