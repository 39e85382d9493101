"""Helpers of the evaluation harness's tests (tests/apps/eval/): tokenizers that add a BOS or none."""
from __future__ import annotations

import mlx.core as mx

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
