"""Perplexity, KL and top-1 against the plain cache (`veloxquant_mlx.apps.eval.perplexity`), on a tiny random model
(no packages needed) and on the real model; evaluation windows start as the model expects a text to: with the
tokenizer's BOS when it adds one (Gemma 3's ``<bos>``), unscored; unchanged for a tokenizer that adds none."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.apps.eval.corpus import CorpusTokens
from veloxquant_mlx.apps.eval.perplexity import perplexity_eval, perplexity_full_forward, window_starts, window_tokens
from veloxquant_mlx.apps.eval.specs import baseline_specs, registered_specs
from veloxquant_mlx.cache.options import CacheOptions
from _eval_helpers import BOS, _nll


# ----------------------------------------------------------------------------- tiny model
# KL to the plain cache on the tiny model (context 256, 2 windows, inside use_packed_attention), measured:
#   mlx-q8 8.0e-6, mlx-q4 1.68e-3, mlx-q2 5.00e-2; tq-mse-k4v4 1.42e-3, tq-mse-k3v3 4.63e-3, tq-mse-k2v2 1.22e-2,
#   tq-prod-k4v4 1.62e-3, tq-rvq-k2v2 3.53e-3, tq-affine-k4v4 3.9e-4, tq-affine-k8v4 3.8e-4, tq-affine-k8v8 2e-6,
#   tq-4b 8.46e-4, tq-3b 4.10e-3, tq-2b 1.21e-2.
# Bound: 2x the measured KL (each tq-mse bound still below the measured KL one bit lower).
TINY_KL = {"mlx-q8": 8.0e-6, "mlx-q4": 1.68e-3, "mlx-q2": 5.00e-2, "tq-mse-k4v4": 1.42e-3, "tq-mse-k3v3": 4.63e-3,
           "tq-mse-k2v2": 1.22e-2, "tq-prod-k4v4": 1.62e-3, "tq-rvq-k2v2": 3.53e-3, "tq-affine-k4v4": 3.9e-4,
           "tq-affine-k8v4": 3.8e-4, "tq-affine-k8v8": 2e-6, "tq-4b": 8.46e-4, "tq-3b": 4.10e-3, "tq-2b": 1.21e-2}


def test_lockstep_registered_specs_on_tiny_model(tiny_model, random_tokens, attention_on_codes):
    from veloxquant_mlx.integration.routing import use_packed_attention

    specs = registered_specs()
    assert set(TINY_KL) == {s.name for s in specs} - {"kv"}  # every registered configuration is run
    # context a multiple of mlx_lm's 256-token allocation step, so nbytes holds no unused tail
    with use_packed_attention():
        r = perplexity_eval(tiny_model, random_tokens, specs, context=256, n_windows=2, chunk=64, progress=False)
    assert list(r) == [s.name for s in specs]
    # attention ran on the codes: at least once per layer and chunk for each compressed spec
    ours = sum(not name.startswith("mlx-") for name in TINY_KL)
    assert attention_on_codes["attend_packed"] >= ours * len(tiny_model.layers) * 2 * (256 // 64)
    kv = r["kv"]
    assert kv["kl"] == 0.0 and kv["top1"] == 1.0 and kv["tokens"] == 512
    assert math.isfinite(kv["ppl"]) and kv["ppl"] > 1.0
    for name, measured in TINY_KL.items():
        q = r[name]
        assert 0.0 <= q["kl"] < 2 * measured, (name, q["kl"], measured)
        assert math.isclose(q["delta_ppl"], q["ppl"] - kv["ppl"], rel_tol=1e-9)
    for b in (8, 4, 2):
        # stored format: b-bit codes + a float32 scale and bias per 64 coordinates
        assert r[f"mlx-q{b}"]["memory"]["bits_per_coordinate"] == pytest.approx(b + 2 * 32 / 64)
    assert kv["memory"]["bits_per_coordinate"] == pytest.approx(32.0)
    # tq-mse, per layer and head (1 kv head, d = 64), K and V alike: the 4 sink tokens in float32, the other 252
    # coded code_batch at a time: whole batches as b-bit indices in uint32 words + a bfloat16 norm (the live tokens:
    # a store's spare step capacity is not counted), the rest waiting in float32; and a fitted bfloat16 channel mean.
    d, n = 64, 256
    waiting = 252 % CacheOptions().code_batch
    assert waiting  # (the layout this counts: some tokens wait exact)
    for b in (4, 3, 2):
        per_stream = (4 + waiting) * d * 4 + (252 - waiting) * (4 * math.ceil(d * b / 32) + 2) + d * 2  # bytes
        assert r[f"tq-mse-k{b}v{b}"]["memory"]["bits_per_coordinate"] == pytest.approx(8 * per_stream / (n * d))
    # top-1 agreement: the plain cache's greedy token is kept at least as often as the coarser method keeps it
    assert r["tq-affine-k8v8"]["top1"] >= r["tq-mse-k4v4"]["top1"] >= r["tq-mse-k2v2"]["top1"]


@settings(max_examples=6, deadline=None)
@given(chunk=st.sampled_from([1, 7, 32, 64, 100, 256]), context=st.integers(8, 160))
def test_chunked_cache_equals_full_forward_tiny(tiny_model, random_tokens, chunk, context):
    r = perplexity_eval(tiny_model, random_tokens, baseline_specs()[:1], context, chunk=chunk, progress=False)
    full = perplexity_full_forward(tiny_model, random_tokens, context)
    assert r["kv"]["ppl"] == pytest.approx(full, rel=1e-4)


def test_window_starts_and_errors():
    assert window_starts(1000, 100, 3) == [0, 100, 200]
    with pytest.raises(ValueError, match="need"):
        window_starts(300, 100, 3)
    with pytest.raises(ValueError, match="n_windows"):
        window_starts(300, 100, 0)


@pytest.mark.model
def test_chunked_kvcache_ppl_equals_full_forward_smollm2(smollm2, corpus_ids):
    model, _ = smollm2
    r = perplexity_eval(model, corpus_ids, baseline_specs()[:1], context=128, chunk=32, progress=False)
    full = perplexity_full_forward(model, corpus_ids, 128)
    assert r["kv"]["ppl"] == pytest.approx(full, rel=1e-3)
    assert 1.0 < full < 100.0  # coherent model on English prose (garbage RoPE gives thousands)


# ----------------------------------------------------------------------------- windows after a BOS
def test_windows_without_prefix_are_the_old_ones(random_tokens):
    inp, tgt, skip = window_tokens(random_tokens, 64, 32)
    assert inp.tolist()[0] == random_tokens[64:96] and tgt.tolist() == random_tokens[65:97] and skip == 0


def test_windows_start_with_the_prefix_unscored(random_tokens):
    tokens = CorpusTokens(random_tokens, (BOS,))
    inp, tgt, skip = window_tokens(tokens, 64, 32)
    assert inp.tolist()[0] == [BOS] + random_tokens[64:95] and tgt.tolist() == random_tokens[64:96] and skip == 0
    inp, tgt, skip = window_tokens(random_tokens, 64, 32, prefix=(5, 6))  # a two-token prefix: one position unscored
    assert inp.tolist()[0] == [5, 6] + random_tokens[64:94] and tgt.tolist()[1:] == random_tokens[64:95]
    assert skip == 1
    with pytest.raises(ValueError, match="no room"):
        window_tokens(tokens, 0, 1)


@pytest.mark.parametrize("prefix", [(), (BOS,), (5, 6)])
def test_perplexity_scores_the_window_after_its_prefix(tiny_model, random_tokens, prefix):
    context, chunk = 48, 16
    tokens = CorpusTokens(random_tokens[:200], prefix)
    r = perplexity_eval(tiny_model, tokens, baseline_specs()[:1], context, n_windows=2, chunk=chunk, progress=False)
    nll, n = 0.0, 0
    for start in (0, context):
        p = len(prefix)
        body = random_tokens[start : start + context - p + 1]
        inputs = list(prefix) + body[:-1]
        targets = [0] * max(p - 1, 0) + (body if p else body[1:])
        a, b = _nll(tiny_model, inputs, targets, first=max(p - 1, 0))
        nll, n = nll + a, n + b
    assert r["kv"]["tokens"] == n == 2 * (context - max(len(prefix) - 1, 0))
    assert r["kv"]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert perplexity_full_forward(tiny_model, tokens, context, 2) == pytest.approx(r["kv"]["ppl"], rel=1e-4)
