"""`veloxquant_mlx.enable(model)`: every mlx_lm path makes our caches and attends from their codes; `disable` undoes it."""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models import base, gemma3_text, llama
from mlx_lm.models import cache as mlx_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

import veloxquant_mlx as vq
from fake_tokenizer import FakeTokenizer
from veloxquant_mlx import integration
from veloxquant_mlx.integration import enabling
from veloxquant_mlx.attention import hook
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.cache.presets import DEFAULT

ORIGINAL = base.scaled_dot_product_attention
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 96, 80)]  # > one 64-token key block


def tiny(name="llama", seed=0):
    mx.random.seed(seed)
    common = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    if name == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, **common))
    else:
        model = gemma3_text.Model(gemma3_text.ModelArgs(model_type="gemma3_text", num_hidden_layers=3, head_dim=32,
                                                        sliding_window=16, sliding_window_pattern=3,
                                                        query_pre_attn_scalar=32, **common))
    mx.eval(model.parameters())
    return model


def teacher_forced_logits(model, caches, steps=6):
    """Prefill, then feed fixed tokens: logits of every step ``(steps + 1, vocab)`` (no free-running drift)."""
    out = [model(mx.array([PROMPT]), cache=caches)[0, -1]]
    for t in range(steps):
        out.append(model(mx.array([[PROMPT[t]]]), cache=caches)[0, -1])
    return mx.stack(out)


@pytest.fixture(autouse=True)
def nothing_left_enabled():
    yield
    assert not hook.is_active() and base.scaled_dot_product_attention is ORIGINAL, "a test left a model enabled"
    assert "TurboQuantPackedCache" not in vars(mlx_cache)


def test_generate_and_stream_generate_use_our_caches_from_codes(attention_on_codes):
    model = tiny()
    tok = TokenizerWrapper(FakeTokenizer())
    plain = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=6)]
    assert vq.enable(model) is model and vq.is_enabled(model)
    try:
        caches = mlx_cache.make_prompt_cache(model)
        assert all(type(c) is TurboQuantPackedCache for c in caches)
        assert enabling.enabled_options(model).codec == "affine_block"  # the default configuration
        ours = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=6)]
        n_stream = attention_on_codes["attend_packed"]
        text = generate(model, tok, PROMPT, max_tokens=6)
    finally:
        vq.disable(model)
    # 2 layers x (prefill chunk + 6 decode steps, generate_step runs one ahead) from the codes, and 8-bit keys give
    # the plain cache's greedy tokens on this model.
    assert n_stream >= 2 * 6 and attention_on_codes["attend_packed"] >= 2 * n_stream - 2
    assert ours == plain and text == FakeTokenizer().decode(plain)


def test_logits_with_and_without_routing_agree(attention_on_codes):
    model = tiny()
    explicit = vq.make_prompt_cache(model, DEFAULT, route_attention=False)
    decoded = teacher_forced_logits(model, explicit)  # hook off: the caches decode their history
    assert attention_on_codes["attend_packed"] == 0
    vq.enable(model)
    try:
        routed = teacher_forced_logits(model, mlx_cache.make_prompt_cache(model))
    finally:
        vq.disable(model)
    assert attention_on_codes["attend_packed"] == 2 * 7
    err = float(mx.abs(routed - decoded).max() / mx.abs(decoded).max())
    assert err < 1e-4, err


def test_disable_restores_mlx_lm_exactly_and_other_models_are_untouched():
    model, other = tiny(seed=0), tiny(seed=1)
    before = teacher_forced_logits(model, mlx_cache.make_prompt_cache(model))
    other_before = teacher_forced_logits(other, mlx_cache.make_prompt_cache(other))
    vq.enable(model)
    vq.enable(model, k_bits=8, v_bits=8, codec="affine_block", sink=4)  # twice: options change, one install
    try:
        assert hook.is_active() and enabling.enabled_options(model).v_bits == 8
        assert not vq.is_enabled(other) and all(type(c) is mlx_cache.KVCache for c in mlx_cache.make_prompt_cache(other))
        other_during = teacher_forced_logits(other, mlx_cache.make_prompt_cache(other))
    finally:
        vq.disable(model)
    vq.disable(model)  # a second disable is a no-op
    assert not vq.is_enabled(model) and "make_cache" not in vars(model)
    assert all(type(c) is mlx_cache.KVCache for c in mlx_cache.make_prompt_cache(model))
    after = teacher_forced_logits(model, mlx_cache.make_prompt_cache(model))
    assert mx.array_equal(before, after) and mx.array_equal(other_before, other_during)


def test_sliding_window_models_get_rotating_caches_and_prompt_files_load_in_mlx_lm(tmp_path):
    model = tiny("gemma3")
    vq.enable(model, k_bits=8, v_bits=8, codec="affine_block", sink=2)
    try:
        caches = mlx_cache.make_prompt_cache(model)
        kinds = [type(c) for c in caches]
        assert TurboQuantRotatingPackedCache in kinds and TurboQuantPackedCache in kinds
        teacher_forced_logits(model, caches, steps=2)
        path = str(tmp_path / "p.safetensors")
        mlx_cache.save_prompt_cache(path, caches)
        loaded = mlx_cache.load_prompt_cache(path)  # mlx_lm's own loader finds our classes while enabled
        assert [type(c) for c in loaded] == kinds and [c.offset for c in loaded] == [c.offset for c in caches]
    finally:
        vq.disable(model)


def test_batch_generate_batches_our_caches():
    from mlx_lm import batch_generate

    model = tiny()
    tok = TokenizerWrapper(FakeTokenizer())
    prompts = [PROMPT[:20], PROMPT[:70]]
    vq.enable(model)
    try:
        alone = [[r.token for r in stream_generate(model, tok, p, max_tokens=4)] for p in prompts]
        out = batch_generate(model, tok, prompts, max_tokens=4, return_token_ids=True, return_prompt_caches=True)
        assert out.token_ids == alone  # (tests/cache/test_batch_cache.py compares logits, margin-aware)
        assert all(type(c) is TurboQuantPackedCache for caches in out.caches for c in caches)
    finally:
        vq.disable(model)


def test_two_threads_one_enabled_model_one_plain():
    enabled, plain = tiny(seed=0), tiny(seed=1)
    reference = {"plain": teacher_forced_logits(plain, mlx_cache.make_prompt_cache(plain))}
    vq.enable(enabled)
    try:
        reference["enabled"] = teacher_forced_logits(enabled, mlx_cache.make_prompt_cache(enabled))
        results, errors = {}, []

        def run(name, model):
            try:
                for i in range(3):
                    # Evaluate here: MLX streams are per thread, so a lazy result cannot be read from another.
                    results[(name, i)] = np.array(teacher_forced_logits(model, mlx_cache.make_prompt_cache(model)))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=a) for a in (("enabled", enabled), ("plain", plain))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
    finally:
        vq.disable(enabled)
    assert len(results) == 6
    for (name, _), logits in results.items():
        np.testing.assert_allclose(logits, np.array(reference[name]), rtol=1e-5, atol=1e-5, err_msg=name)


def test_bad_input():
    with pytest.raises(TypeError, match="model"):
        vq.enable(object())
    model = tiny()
    with pytest.raises(ValueError, match="k_bits"):
        vq.enable(model, k_bits=9)
    assert not vq.is_enabled(model) and not hook.is_active()
    with pytest.raises(ValueError, match="not enabled"):
        enabling.enabled_options(model)
