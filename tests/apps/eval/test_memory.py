"""Bytes and bits a cache stores (`veloxquant_mlx.apps.eval.memory`): measured from the layout, the longest context
that fits in a budget, refusals."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.apps.eval.memory import cache_memory, measure_bytes_per_token, plan_context
from veloxquant_mlx.apps.eval.specs import baseline_specs, resolve_spec


@settings(max_examples=8, deadline=None)
@given(kv_heads=st.integers(1, 4), head_dim=st.sampled_from([64, 128]), bits=st.sampled_from([2, 4, 8]))
def test_measured_bytes_match_storage_format(kv_heads, head_dim, bits):
    plain = measure_bytes_per_token(baseline_specs()[0].make_cache, kv_heads, head_dim)
    assert plain["bytes_per_token_per_layer"] == 2 * kv_heads * head_dim * 4
    assert plain["fixed_bytes"] == pytest.approx(0.0)
    q = measure_bytes_per_token(resolve_spec(f"mlx-q{bits}").make_cache, kv_heads, head_dim)
    # random data is float32: codes + float32 scale and bias per group of 64
    assert q["bits_per_coordinate"] == pytest.approx(bits + 64 / 64)


@settings(max_examples=30, deadline=None)
@given(bpt=st.floats(1.0, 1e5), layers=st.integers(1, 100), ram=st.floats(1e3, 1e12))
def test_plan_context_is_the_longest_that_fits(bpt, layers, ram):
    n = plan_context(bpt, layers, ram)
    assert n * bpt * layers <= ram * (1 + 1e-12)
    assert (n + 1) * bpt * layers > ram * (1 - 1e-12)


def test_cache_memory_rejects_empty():
    with pytest.raises(ValueError, match="n_tokens"):
        cache_memory([], 0, 1, 64)
