"""The bit budgets of issues 16 and 47 (veloxquant_mlx.cache.presets.BUDGETS): tq-4b / tq-3b / tq-2b on the strict
layout (waiting tokens coded) stay within 4.25 / 3.25 / 2.25 bits per coordinate at every reported length, the presets
(waiting tokens exact) at 1 + a multiple of 128 tokens (measured nbytes of caches holding random keys/values, SmolLM2's
shape)."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.eval.memory import measure_bits, measure_bytes_per_token
from veloxquant_mlx.apps.eval.specs import BUDGET_CONFIGURATIONS, CONFIGURATIONS
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.cache.presets import BUDGETS

SMOLLM2_LAYERS = 30


def _strict(name):
    """The budget preset on issue 47's layout: tokens waiting for their key block stored as codes too, the keys
    centred on the sequence's mean."""
    import dataclasses

    return dataclasses.replace(CONFIGURATIONS[name], codec="kblock_vsym8_pt", center_keys=True)


@pytest.mark.parametrize("context", [2048, 3000, 4096])
@pytest.mark.parametrize("name,budget", sorted(BUDGET_CONFIGURATIONS.items()))
def test_budget_configurations_stay_within_their_bits(name, budget, context):
    """On the strict layout (the presets' own exact tail is measured in the test below)."""
    options = _strict(name)
    # SmolLM2's attention shape; its 30 layers only where bits are set per layer (otherwise layers are alike)
    per_layer = isinstance(options.k_bits, tuple) or isinstance(options.v_bits, tuple)
    m = measure_bytes_per_token(lambda model: [TurboQuantPackedCache(options)], 3, 64, context=context,
                                n_layers=SMOLLM2_LAYERS if per_layer else 1)
    assert m["bits_per_coordinate"] <= budget + 1e-9, (name, context, m["bits_per_coordinate"])
    # the figure is every stored byte: more than the codes alone (scales, norms or exact tokens are stored too)
    code_bits = (_mean(CONFIGURATIONS[name].k_bits) + _mean(CONFIGURATIONS[name].value_bits)) / 2
    assert m["bits_per_coordinate"] > code_bits


def _mean(bits):
    return sum(bits) / len(bits) if isinstance(bits, tuple) else bits


@pytest.mark.parametrize("name", ["tq-4b", "tq-3b", "tq-2b"])
def test_budget_names_hold_at_every_reported_length_and_on_average(name):
    """Issue 47's layout holds the names (every stored byte, the tokens waiting for their key block and the fitted
    key means included) at 2048, 3000 (no block boundary) and 4096 tokens; the presets' layout (waiting tokens exact)
    does not at 2048 and 3000, so the figure sees the tail. Averaged over a KL window's
    positions the early chunks (a 1-token float32 sink, the float32 key means and up to 127 provisional keys over a
    few hundred tokens) cost more: reported, within 0.08 bit at 2048 and 0.025 at 4096, where the exact tail averaged
    over 2.5 bits above."""
    import dataclasses

    budget = BUDGETS[name]
    strict = _strict(name)
    m = measure_bits(lambda model: [TurboQuantPackedCache(strict)], 3, 64, lengths=(2048, 3000, 4096))
    for n in (2048, 3000, 4096):
        assert m["bits"][n] <= budget, (name, n, m["bits"][n])
        assert m["bits"][n] < m["kl_average_bits"][n] <= m["max_bits"][n], (name, n, m)
    assert m["kl_average_bits"][2048] <= budget + 0.08 and m["kl_average_bits"][4096] <= budget + 0.025, m
    exact = dataclasses.replace(CONFIGURATIONS[name], codec="kblock_vsym8", center_keys=False)
    old = measure_bits(lambda model: [TurboQuantPackedCache(exact)], 3, 64, lengths=(2048, 3000, 4096))
    assert all(old["bits"][n] > budget + 0.2 for n in (2048, 3000)), old["bits"]
    assert old["kl_average_bits"][4096] > budget + 2.5, old
    # 1 + a multiple of 128 tokens: only the sink waits outside the blocks in both layouts (the old figure)
    at_block = measure_bits(lambda model: [TurboQuantPackedCache(exact)], 3, 64, lengths=(2049,))
    assert at_block["bits"][2049] <= budget
