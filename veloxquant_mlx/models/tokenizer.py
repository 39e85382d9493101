"""Byte-level BPE tokenizer (GPT-2 style) rebuilt from GGUF ``tokenizer.ggml.*`` metadata.

Built with the HF ``tokenizers`` library (no hand-written BPE) and wrapped in transformers'
``PreTrainedTokenizerFast`` inside mlx_lm's ``TokenizerWrapper`` so ``mlx_lm.generate`` and
``apply_chat_template`` work unchanged.
"""
from __future__ import annotations

from typing import Any, Dict

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_SPECIAL_TYPES = {2, 3, 4}


def build_tokenizers_object(meta: Dict[str, Any]):
    """A ``tokenizers.Tokenizer`` from GGUF vocab + merges (byte-level BPE, 'gpt2' model)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "llama-bpe"):
        # SmolLM2 (and these relatives) split digits one by one before the GPT-2 regex.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        specials = [tokens[i] for i, t in enumerate(list(types)) if int(t) in _SPECIAL_TYPES]
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def build_tokenizer(meta: Dict[str, Any]):
    """mlx_lm ``TokenizerWrapper`` (HF fast tokenizer + the GGUF chat template and bos/eos)."""
    tok = build_tokenizers_object(meta)
    tokens = meta["tokenizer.ggml.tokens"]

    def tok_name(key):
        i = meta.get(key)
        return tokens[int(i)] if i is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_name("tokenizer.ggml.bos_token_id"),
        eos_token=tok_name("tokenizer.ggml.eos_token_id"),
        unk_token=tok_name("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_name("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return TokenizerWrapper(hf, eos_token_ids=[int(eos)] if eos is not None else None)
