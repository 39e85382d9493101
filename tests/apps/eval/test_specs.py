"""Cache specs (`veloxquant_mlx.apps.eval.specs`): the registry's names and order, resolving names, families and
bits, unknown presets named with the list, and any cache factory plugging into the evaluation."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.eval.perplexity import perplexity_eval
from veloxquant_mlx.apps.eval.specs import CacheSpec, registered_specs, resolve_spec
from veloxquant_mlx.cache.presets import PRESETS, preset, resolve_options


def test_spec_registry_and_resolution():
    names = [s.name for s in registered_specs(64)]
    assert names[:4] == ["kv", "mlx-q8", "mlx-q4", "mlx-q2"]
    assert resolve_spec("fp16").name == "kv"
    assert resolve_spec("mlx-q", 4).name == "mlx-q4"
    assert resolve_spec("mlx-q4", 4).name == "mlx-q4"
    assert [resolve_spec("turboquant_mse", b).name for b in (4, 3, 2)] == ["tq-mse-k4v4", "tq-mse-k3v3", "tq-mse-k2v2"]
    assert resolve_spec("turboquant_rvq", 4).name == "tq-rvq-k2v2"  # RVQ's nominal bits: two b-bit streams
    spec = resolve_spec("tq-affine-k8v8")
    assert (spec.family, spec.bits, spec.extra["codec"], spec.extra["k_bits"], spec.extra["v_bits"]) == (
        "tq-affine", 8, "affine_block", 8, 8)
    with pytest.raises(ValueError, match="allowed: 2, 3, 4"):
        resolve_spec("turboquant_mse", 5)
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_spec("nope")
    with pytest.raises(ValueError, match="out of range"):
        resolve_spec("mlx-q", 3)
    with pytest.raises(ValueError, match="needs --bits"):
        resolve_spec("mlx-q")
    with pytest.raises(ValueError, match="not quantized"):
        resolve_spec("kv", 4)


def test_custom_cache_factory_plugs_in(tiny_model, random_tokens):
    """Any make_cache(model) -> list works, e.g. a cache converted from KVCache on the fly."""
    from mlx_lm.models.cache import KVCache

    spec = CacheSpec("my-kv", lambda m: [KVCache() for _ in m.layers], family="custom")
    r = perplexity_eval(tiny_model, random_tokens, [spec], context=64, chunk=32, progress=False)
    assert r["my-kv"]["kl"] == pytest.approx(0.0, abs=1e-6) and r["my-kv"]["top1"] == 1.0


def test_unknown_preset_value_errors_name_the_presets():
    for call in (lambda: resolve_spec("nope"), lambda: preset("nope"), lambda: resolve_options("nope")):
        with pytest.raises(ValueError, match=r"unknown preset 'nope'; presets: tq-mse-k4v4, ") as e:
            call()
        assert all(name in str(e.value) for name in PRESETS)
