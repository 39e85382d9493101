"""Tokenizers rebuilt from GGUF metadata (`veloxquant_mlx.apps.models.tokenizer`) on small hand-made vocabularies:
byte-level BPE applies the file's merges in order (digits one by one for SmolLM2's pre-tokenizer), SentencePiece
BPE merges the highest-scored piece first, falls back to bytes, keeps user-defined pieces whole and starts with the
BOS the file asks for; the wrapper carries the file's BOS, EOS and chat template. (Gemma 3's own vocabulary against
llama.cpp's algorithm: test_gemma3.py.)"""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.models.tokenizer import (SPM_SPACE, build_spm_tokenizers_object, build_tokenizer,
                                                 build_tokenizers_object, spm_merges)

# byte-level BPE ('gpt2'): GPT-2's byte alphabet shows a space as "Ġ"
BPE_TOKENS = ["<|endoftext|>", "h", "e", "l", "o", "w", "r", "d", "Ġ", "2", "0", "he", "ll", "hell", "hello",
              "Ġw", "Ġwo", "or", "20"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "o r", "2 0"]


def bpe_meta(**changes):
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": BPE_TOKENS, "tokenizer.ggml.merges": BPE_MERGES,
            "tokenizer.ggml.token_type": [3] + [1] * (len(BPE_TOKENS) - 1), "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.bos_token_id": 0, **changes}


def test_byte_level_bpe_applies_the_merges_in_order():
    tok = build_tokenizers_object(bpe_meta())
    ids = tok.encode("hello world").ids
    assert [BPE_TOKENS[i] for i in ids] == ["hello", "Ġwo", "r", "l", "d"]  # "o r" ranks below "Ġw o"
    assert tok.decode(ids) == "hello world"
    assert tok.encode("<|endoftext|>hello").ids == [0, BPE_TOKENS.index("hello")]  # the control token is whole
    assert [BPE_TOKENS[i] for i in tok.encode("2020").ids] == ["20", "20"]
    smollm = build_tokenizers_object(bpe_meta(**{"tokenizer.ggml.pre": "smollm"}))  # digits one by one first
    assert [BPE_TOKENS[i] for i in smollm.encode("2020").ids] == ["2", "0", "2", "0"]


def test_unsupported_tokenizer_models_are_named():
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert': only byte-level BPE \('gpt2'\)"):
        build_tokenizers_object(bpe_meta(**{"tokenizer.ggml.model": "bert"}))


# SentencePiece BPE ('llama'): <unk> <bos> <eos>, a user-defined piece, byte pieces, normal pieces with scores
SPM_TOKENS = ["<unk>", "<bos>", "<eos>", "<br>", "<0x21>", "<0xC3>", "<0xA9>", SPM_SPACE, "a", "b", "c", "ab", "bc",
              "abc", SPM_SPACE + "a", SPM_SPACE + "ab"]
SPM_TYPES = [2, 3, 3, 4, 6, 6, 6] + [1] * 9
# normal pieces: higher score merges first ("bc" before "ab": "abc" is built as a + bc)
SPM_SCORES = [0.0] * 7 + [-1.0, -2.0, -3.0, -4.0, -9.0, -6.0, -7.0, -5.0, -8.0]


def spm_meta(**changes):
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": SPM_TOKENS, "tokenizer.ggml.scores": SPM_SCORES,
            "tokenizer.ggml.token_type": SPM_TYPES, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **changes}


def test_spm_merges_are_every_split_of_a_normal_piece_best_first():
    merges = spm_merges(SPM_TOKENS, SPM_SCORES, SPM_TYPES)
    # by the joined piece's score: ▁a (-5), bc (-6), abc (-7; split a|bc before ab|c), ▁ab (-8; ▁|ab, ▁a|b), ab (-9)
    assert merges == [(SPM_SPACE, "a"), ("b", "c"), ("a", "bc"), ("ab", "c"), (SPM_SPACE, "ab"), (SPM_SPACE + "a", "b"),
                      ("a", "b")]


def test_sentencepiece_bpe_encodes_as_sentencepiece():
    tok = build_spm_tokenizers_object(spm_meta())
    pieces = lambda text: [SPM_TOKENS[i] for i in tok.encode(text).ids]  # noqa: E731
    assert pieces("abc") == ["abc"] and pieces("ab c") == ["ab", SPM_SPACE, "c"]  # no dummy space prefix
    assert pieces("ab ab") == ["ab", SPM_SPACE + "ab"]
    assert pieces("a<br>b") == ["a", "<br>", "b"]  # a user-defined piece stays whole
    assert pieces("é!") == ["<0xC3>", "<0xA9>", "<0x21>"]  # outside the vocabulary: its UTF-8 bytes
    assert tok.decode(tok.encode("ab c é!").ids) == "ab c é!"
    with_bos = build_spm_tokenizers_object(spm_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("abc").ids == [1, SPM_TOKENS.index("abc")]


def test_sentencepiece_vocabularies_it_cannot_reproduce_are_refused():
    with pytest.raises(ValueError, match="dummy space prefix are not supported"):
        build_spm_tokenizers_object(spm_meta(**{"tokenizer.ggml.add_space_prefix": True}))
    with pytest.raises(ValueError, match="tokens, scores and token types differ in length"):
        build_spm_tokenizers_object(spm_meta(**{"tokenizer.ggml.scores": SPM_SCORES[:-1]}))


def test_the_wrapper_carries_the_files_special_tokens_and_template():
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok = build_tokenizer(spm_meta(**{"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": True}))
    assert tok.bos_token == "<bos>" and tok.eos_token_id == 2 and tok.eos_token_ids == {2}
    assert tok.encode("abc") == [1, SPM_TOKENS.index("abc")]
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<user>ab"
    plain = build_tokenizer(bpe_meta())
    assert plain.eos_token_ids == {0} and plain.decode(plain.encode("hello world")) == "hello world"
