"""Issue 55's sliding-window rule: a window layer of at most ``short_window`` tokens codes keys and values at no fewer
than ``short_window_bits`` (the default: 1024 tokens, 8 bits); full-attention layers are untouched. Builds caches on
the tiny model only (no forward pass)."""
from __future__ import annotations

import warnings

import pytest

import veloxquant_mlx as vq
from veloxquant_mlx.integration.builder import layer_kinds_note
from veloxquant_mlx.cache.presets import DEFAULT, SHORT_WINDOW, WINDOW_KEY_BITS, WINDOW_RECENT, preset
from veloxquant_mlx.cache.options import CacheOptions


def _bits(caches):
    return [(type(c).__name__, c.options.codec, c.options.k_bits, c.options.value_bits) for c in caches]


def test_full_attention_layers_keep_the_default(tiny_model):
    assert DEFAULT.short_window == SHORT_WINDOW == 1024 and DEFAULT.short_window_bits == 8
    assert set(_bits(vq.make_prompt_cache(tiny_model))) == {("TurboQuantPackedCache", "affine_block", 8, 4)}


@pytest.mark.parametrize("window, values", [(512, 8), (SHORT_WINDOW, 8), (SHORT_WINDOW + 1, 4)])
def test_short_windows_code_at_8_bits(tiny_model, window, values):
    caches = vq.make_prompt_cache(tiny_model, max_kv_size=window)  # every layer a window of `window` tokens
    assert set(_bits(caches)) == {("TurboQuantRotatingPackedCache", "affine", 8, values)}


def test_the_rule_is_an_option(tiny_model):
    off = vq.make_prompt_cache(tiny_model, dataclasses_replace(DEFAULT, short_window=0), max_kv_size=512)
    assert {c.options.value_bits for c in off} == {4}
    budget = vq.make_prompt_cache(tiny_model, dataclasses_replace(preset("tq-4b"), short_window=512), max_kv_size=512)
    assert {(c.options.k_bits, c.options.value_bits) for c in budget} == {(8, 8)}
    assert preset("tq-4b").short_window == 0  # the budget presets keep their bits
    higher = vq.make_prompt_cache(tiny_model, k_bits=8, v_bits=8, codec="affine", short_window=512,
                                  short_window_bits=4, max_kv_size=512)
    assert {(c.options.k_bits, c.options.value_bits) for c in higher} == {(8, 8)}  # a floor, never lower
    with pytest.raises(ValueError):
        CacheOptions(short_window=-1)
    with pytest.raises(ValueError):
        CacheOptions(short_window_bits=9)


def test_enable_says_what_each_kind_of_layer_does(tiny_model):
    mixed = vq.make_prompt_cache(tiny_model)[:1] + vq.make_prompt_cache(tiny_model, max_kv_size=512)[1:]
    note = layer_kinds_note(mixed)
    assert note == ("layers by kind: layer 0: full attention: codec 'affine_block', keys 8 / values 4 bits, sink 4; "
                    "layer 1: sliding window of 512 tokens: codec 'affine', keys 8 / values 8 bits, sink 4")
    assert layer_kinds_note(vq.make_prompt_cache(tiny_model)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full-attention model: enable says nothing
        vq.enable(tiny_model)
    vq.disable(tiny_model)


def dataclasses_replace(options, **changes):
    import dataclasses

    return dataclasses.replace(options, **changes)


def test_windows_keep_their_newest_tokens_exact(tiny_model):
    """`CacheOptions.window_recent`: window layers keep that many newest tokens exact (at least ``recent``), the
    full-attention layers keep ``recent``; what attention reads of a window ends with those tokens as they came."""
    import mlx.core as mx

    mixed = (vq.make_prompt_cache(tiny_model, "tq-4b", window_recent=6)[:1]
             + vq.make_prompt_cache(tiny_model, "tq-4b", window_recent=6, max_kv_size=64)[1:])
    assert [c.options.recent for c in mixed] == [0] + [6] * (len(mixed) - 1)
    assert "sliding window of 64 tokens: codec 'token_lloyd8', keys 5 / values 4 bits, sink 1, newest 6 exact" \
        in layer_kinds_note(mixed)  # (tq-4b's windows: keys at 5 bits, WINDOW_KEY_BITS)
    both = vq.make_prompt_cache(tiny_model, "tq-4b", recent=8, window_recent=6, max_kv_size=64)
    assert {c.options.recent for c in both} == {8}  # never fewer than `recent`
    window = mixed[1]
    k = mx.random.normal((1, 1, 100, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 1, 100, 64), key=mx.random.key(2))
    from veloxquant_mlx.attention import hook

    active = hook.is_active()
    hook.set_active(False)  # fed directly, not through a model's attention
    try:
        window.update_and_fetch(k[:, :, :90], v[:, :, :90])
        for t in range(90, 100):  # decode steps
            window.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    finally:
        hook.set_active(active)
    last = window.rows.attention_parts()[-1]
    assert last.keys.shape[2] >= 6
    assert mx.array_equal(last.keys[..., -6:, :], k[:, :, -6:].astype(last.keys.dtype)).item()
    assert mx.array_equal(last.values[..., -6:, :], v[:, :, -6:].astype(last.values.dtype)).item()
    with pytest.raises(ValueError, match="window_recent"):
        CacheOptions(window_recent=-1)


def test_window_keys_take_window_k_bits(tiny_model):
    """`CacheOptions.window_k_bits`: window layers code keys at no fewer bits (values and full-attention layers keep
    theirs); a width the window's per-token codec lacks is a ValueError naming the option."""
    mixed = (vq.make_prompt_cache(tiny_model, "tq-3b", window_k_bits=5)[:1]
             + vq.make_prompt_cache(tiny_model, "tq-3b", window_k_bits=5, max_kv_size=64)[1:])
    assert [(c.options.k_bits, c.options.value_bits) for c in mixed] == [(3, 3)] + [(5, 3)] * (len(mixed) - 1)
    assert "sliding window of 64 tokens: codec 'token_lloyd8', keys 5 / values 3 bits" in layer_kinds_note(mixed)
    lower = vq.make_prompt_cache(tiny_model, "tq-4b", window_k_bits=3, max_kv_size=64)
    assert {(c.options.k_bits, c.options.value_bits) for c in lower} == {(4, 4)}  # a floor, never lower
    budget = vq.make_prompt_cache(tiny_model, "tq-2b", max_kv_size=64)  # the budget presets' windows
    assert {(c.options.k_bits, c.options.value_bits, c.options.recent) for c in budget} == \
        {(WINDOW_KEY_BITS, 2, WINDOW_RECENT)}
    assert {(c.options.k_bits, c.options.recent) for c in vq.make_prompt_cache(tiny_model, "tq-2b")} == {(2, 0)}
    with pytest.raises(ValueError, match=r"window_k_bits must be 0 or one of .*\(2, 3, 4, 5, 6, 8\), got 7"):
        vq.make_prompt_cache(tiny_model, "tq-4b", window_k_bits=7, max_kv_size=64)
    with pytest.raises(ValueError, match="window_k_bits"):
        CacheOptions(window_k_bits=9)
