"""Evaluation windows start as the model expects a text to: with the tokenizer's BOS when it adds one (Gemma 3's
``<bos>``), unscored; unchanged for a tokenizer that adds none (SmolLM2's). Tiny model, a few hundred tokens."""
from __future__ import annotations

import math

import mlx.core as mx
import pytest

from veloxquant_mlx.eval import (CorpusTokens, baseline_specs, passkey_prompt, perplexity_eval,
                                 perplexity_full_forward, text_prefix, window_tokens)
from veloxquant_mlx.eval.corpus import tokenize_text

BOS = 2
TINY_VOCAB = 128


class ByteTokenizer:
    """conftest's tiny-model tokenizer (one id per UTF-8 byte), which adds no special tokens (as SmolLM2's)."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=True):
        return [b % self.vocab_size for b in text.encode("utf-8")]


class BosTokenizer(ByteTokenizer):
    """The byte tokenizer, with a BOS first when special tokens are added (as Gemma's)."""

    def encode(self, text, add_special_tokens=True):
        return ([BOS] if add_special_tokens else []) + super().encode(text)


class BosEosTokenizer(BosTokenizer):
    def encode(self, text, add_special_tokens=True):
        return super().encode(text, add_special_tokens) + ([1] if add_special_tokens else [])


def _nll(model, inputs, targets, first=0):
    logits = model(mx.array([inputs], dtype=mx.int32))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(targets, dtype=mx.int32)[:, None], axis=-1)[first:]
    return -picked.sum().item(), picked.shape[0]


def test_text_prefix_reads_the_tokenizer():
    assert text_prefix(ByteTokenizer(TINY_VOCAB)) == ()
    assert text_prefix(BosTokenizer(TINY_VOCAB)) == (BOS,)
    assert text_prefix(BosEosTokenizer(TINY_VOCAB)) == (BOS,)  # an EOS after the text is no prefix
    ids = tokenize_text(BosTokenizer(TINY_VOCAB), "hello world")
    assert isinstance(ids, CorpusTokens) and ids.prefix == (BOS,) and BOS not in ids[:5]
    assert ids[2:7].prefix == (BOS,) and list(ids[2:7]) == list(ids)[2:7]  # a slice keeps the prefix
    assert tokenize_text(ByteTokenizer(TINY_VOCAB), "hello").prefix == ()


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


def test_passkey_prompt_starts_with_the_bos(random_tokens):
    ids = passkey_prompt(BosTokenizer(TINY_VOCAB), random_tokens, 300, 0.5, "12345")
    plain = passkey_prompt(ByteTokenizer(TINY_VOCAB), random_tokens, 300, 0.5, "12345")
    assert len(ids) == len(plain) == 300
    assert ids[0] == BOS and plain[0] != BOS
    assert ids[1:40] == plain[:39]  # the same text after it
