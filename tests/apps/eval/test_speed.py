"""Prefill and decode speed (`veloxquant_mlx.apps.eval.speed`) on the tiny random model, with the cache's bytes and
the peak memory it reports."""
from __future__ import annotations

from veloxquant_mlx.apps.eval.memory import model_kv_shape
from veloxquant_mlx.apps.eval.specs import baseline_specs
from veloxquant_mlx.apps.eval.speed import speed_eval


def test_speed_and_memory_on_tiny_model(tiny_model, random_tokens):
    spec = baseline_specs()[0]
    r = speed_eval(tiny_model, random_tokens, spec, context=256, decode_tokens=4, progress=False)
    n_layers, kv_heads, head_dim = model_kv_shape(tiny_model)
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert r["decode_tokens"] == 4
    assert r["bytes_per_token"] == n_layers * 2 * kv_heads * head_dim * 4  # float32 keys + values
    assert r["peak_memory_bytes"] >= 256 * r["bytes_per_token"]  # the filled cache was live at the peak
