"""Forward passes with a cache (`veloxquant_mlx.apps.eval.forward`): the last position's logits (llama's shortcut
through the tied embedding and any other model sliced), a chunked prefill equal to one pass over the whole prompt,
greedy decoding equal to the argmax of each step, stopping at an end-of-sequence token."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.apps.eval.forward import greedy_decode, last_logits, prefill

TOKENS = [(7 * i + 3) % 128 for i in range(30)]


def _tiny_qwen3():
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                                        tie_word_embeddings=False))
    mx.eval(model.parameters())
    return model


def _close(a, b):
    return float(mx.abs(a - b).max()) <= 1e-4 * max(float(mx.abs(b).max()), 1.0)


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_last_logits_are_the_models_last_position(tiny_model, which):
    model = tiny_model if which == "llama" else _tiny_qwen3()  # llama: the projection of the last state only
    x = mx.array([TOKENS[:12], TOKENS[5:17]], dtype=mx.int32)
    got = last_logits(model, x, make_prompt_cache(model))
    want = model(x, cache=make_prompt_cache(model))[:, -1, :].astype(mx.float32)
    assert got.shape == (2, 128) and got.dtype == mx.float32
    assert _close(got, want)


@pytest.mark.parametrize("chunk", [1, 7, 30, 256])
def test_chunked_prefill_gives_the_whole_prompts_last_logits(tiny_model, chunk):
    class Progress:
        n = 0

        def update(self, k):
            self.n += k

    progress, cache = Progress(), [KVCache() for _ in tiny_model.layers]
    got = prefill(tiny_model, TOKENS, cache, chunk=chunk, progress=progress)
    want = tiny_model(mx.array([TOKENS]))[0, -1].astype(mx.float32)
    assert got.shape == (128,) and _close(got, want)
    assert progress.n == len(TOKENS) and all(c.offset == len(TOKENS) for c in cache)


def test_prefill_refuses_an_empty_prompt_and_a_chunk_of_nothing(tiny_model):
    with pytest.raises(ValueError, match="chunk must be > 0, got 0"):
        prefill(tiny_model, TOKENS, [KVCache() for _ in tiny_model.layers], chunk=0)
    with pytest.raises(ValueError, match="tokens must not be empty"):
        prefill(tiny_model, [], [KVCache() for _ in tiny_model.layers])


def test_greedy_decode_is_the_argmax_of_every_step(tiny_model):
    cache = [KVCache() for _ in tiny_model.layers]
    got = greedy_decode(tiny_model, prefill(tiny_model, TOKENS, cache), cache, 6)
    # the same steps written out: the whole sequence so far through the model, its last position's argmax
    seq, want = list(TOKENS), []
    for _ in range(6):
        want.append(int(mx.argmax(tiny_model(mx.array([seq]))[0, -1]).item()))
        seq.append(want[-1])
    assert got == want and len(got) == 6
    assert cache[0].offset == len(TOKENS) + 6  # every token it picked went through the cache, the last one too


def test_greedy_decode_stops_at_an_end_of_sequence_token(tiny_model):
    cache = [KVCache() for _ in tiny_model.layers]
    first = prefill(tiny_model, TOKENS, cache)
    whole = greedy_decode(tiny_model, first, [KVCache() for _ in tiny_model.layers], 0)
    assert whole == []
    eos = int(mx.argmax(first).item())
    assert greedy_decode(tiny_model, first, cache, 6, eos_ids=[eos]) == [eos]  # kept, then stopped
    assert cache[0].offset == len(TOKENS)
