"""The bit budgets (veloxquant_mlx.cache.presets.BUDGETS, issues 16, 47 and 54): tq-4b / tq-3b / tq-2b stay within
4.25 / 3.25 / 2.25 bits per coordinate at every length from 512 tokens (every stored byte: codes, scales, the exact
sink token, the key offset's mean; measured nbytes of caches holding random keys/values in SmolLM2's shape, built
for a model with a RoPE as `make_prompt_cache` builds them), and rows shorter than the presets' ``code_from`` stay
exact."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import veloxquant_mlx as vq
from veloxquant_mlx.apps.eval.memory import _stub_model, measure_bits
from veloxquant_mlx.cache.presets import BUDGETS, CODE_FROM, PRESETS


# every length from 512 to 4096 in steps that are no multiple of a power of two, and the round lengths
LENGTHS = tuple(range(512, 4097, 97)) + (512, 2048, 3000, 4096, 8192)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_budget_names_hold_at_every_length_from_512_tokens(name):
    budget = BUDGETS[name]
    m = measure_bits(lambda model: vq.make_prompt_cache(model, name), 3, 64, lengths=LENGTHS)
    over = {n: b for n, b in m["bits"].items() if b > budget}
    assert not over, (name, over)
    # the figure is every stored byte: more than the codes alone (scales, the sink, the fitted mean are stored too)
    assert min(m["bits"].values()) > PRESETS[name].k_bits
    # averaged over a KL window's positions (its first chunks are exact: rows shorter than code_from), reported
    assert m["bits"][2048] < m["kl_average_bits"][2048] <= budget + 0.08, m["kl_average_bits"]


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_budget_presets_hold_their_budget_in_decode_steps_and_odd_chunks(name):
    """Filled in chunks of 100 (no block boundary anywhere), then one token at a time: within the budget after every
    update past 512 tokens."""
    budget = BUDGETS[name]
    m = measure_bits(lambda model: vq.make_prompt_cache(model, name), 3, 64, lengths=(520, 700, 1201), chunk=100)
    assert all(b <= budget for b in m["bits"].values()), m["bits"]
    caches = vq.make_prompt_cache(_stub_model(1, 3, 64), name)
    c = caches[0]
    k = mx.random.normal((1, 3, 600, 64), key=mx.random.key(1))
    c.update_and_fetch(k[..., :511, :], k[..., :511, :])
    for t in range(511, 600):
        mx.eval(c.update_and_fetch(k[..., t:t + 1, :], k[..., t:t + 1, :]))
        bits = c.live_nbytes * 8 / ((t + 1) * 2 * 3 * 64)
        assert bits <= budget, (name, t + 1, bits)


def attend(cache, q, k, v):
    """Attention of ``q`` through ``cache`` after storing ``k`` / ``v`` (a first chunk causal, then one token)."""
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=64 ** -0.5,
                                                mask="causal" if q.shape[2] > 1 else None)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_rows_shorter_than_code_from_attend_exactly(name):
    """A short chat: attention through the preset's cache is mlx_lm's own (nothing coded) until the row holds
    ``code_from`` tokens; from there the tokens are coded (the answers differ, the bytes drop)."""
    assert PRESETS[name].code_from == CODE_FROM
    c = vq.make_prompt_cache(_stub_model(1, 3, 64), name)[0]
    ref = KVCache()
    k = mx.random.normal((1, 3, CODE_FROM + 8, 64), key=mx.random.key(2))
    v = mx.random.normal((1, 3, CODE_FROM + 8, 64), key=mx.random.key(3))
    q = mx.random.normal((1, 3, CODE_FROM + 8, 64), key=mx.random.key(4))
    assert mx.allclose(attend(c, q[..., :40, :], k[..., :40, :], v[..., :40, :]),
                       attend(ref, q[..., :40, :], k[..., :40, :], v[..., :40, :]), atol=1e-6)
    for t in range(40, CODE_FROM - 1):
        one = (q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :])
        assert mx.allclose(attend(c, *one), attend(ref, *one), atol=1e-6), t
    short = c.live_nbytes
    diff = []
    for t in range(CODE_FROM - 1, CODE_FROM + 8):
        one = (q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :])
        diff.append(mx.max(mx.abs(attend(c, *one) - attend(ref, *one))).item())
    assert c.live_nbytes < short / 3 and max(diff) > 1e-4, (c.live_nbytes, short, diff)
