"""Tokenizers rebuilt from GGUF ``tokenizer.ggml.*`` metadata: byte-level BPE (``gpt2``, SmolLM2) and
SentencePiece BPE (``llama``, Gemma 3).

Built with the HF ``tokenizers`` library (no hand-written BPE) and wrapped in transformers'
``PreTrainedTokenizerFast`` inside mlx_lm's ``TokenizerWrapper`` so ``mlx_lm.generate`` and
``apply_chat_template`` work unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_SPECIAL_TYPES = {2, 3, 4}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
SPM_SPACE = "\u2581"  # SentencePiece's visible space


def build_tokenizers_object(meta: Dict[str, Any]):
    """A ``tokenizers.Tokenizer`` from GGUF metadata: byte-level BPE ('gpt2') or SentencePiece BPE ('llama')."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_spm_tokenizers_object(meta)
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') and SentencePiece BPE "
            "('llama') are supported"
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


def spm_merges(tokens: Sequence[str], scores, types) -> List[Tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE on this vocabulary, best first.

    SentencePiece (and llama.cpp's ``llm_tokenizer_spm``) merge, again and again, the adjacent pair whose joined
    text is a normal piece of the highest score. Every split of a normal piece into two normal pieces is therefore
    a merge ranked by the joined piece's score (as transformers' SentencePiece converter does): BPE then takes the
    same pairs in the same order. Gemma 3's normal scores are all distinct (``-rank``); two splits of one piece
    share its score and never compete at one place. 513k merges for Gemma 3's 262k pieces (about 1.5 s).
    """
    scores = [float(s) for s in scores]
    normal = {p: i for i, (p, t) in enumerate(zip(tokens, types)) if int(t) == _NORMAL}
    ranked = []
    add = ranked.append
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left = piece[:k]
            if left in normal:
                right = piece[k:]
                if right in normal:
                    add((-scores[i], normal[left], left, right))
    ranked.sort()  # best score first; between the splits of one piece, the shorter left part first
    return [(m[2], m[3]) for m in ranked]


def build_spm_tokenizers_object(meta: Dict[str, Any]):
    """A ``tokenizers.Tokenizer`` reproducing a SentencePiece BPE vocabulary (GGUF ``tokenizer.ggml.model`` 'llama'
    with scores and token types): spaces shown as U+2581, no dummy prefix, no other normalization, byte fallback
    to ``<0xXX>`` pieces for characters outside the vocabulary.

    User-defined pieces (Gemma 3: runs of newlines, tabs and spaces, a few HTML tags) are always whole tokens,
    never merged with their neighbours, as in SentencePiece and llama.cpp: added tokens matched in the raw text
    (llama.cpp's converter already turned their U+2581 back into spaces). Control pieces (``<bos>``,
    ``<start_of_turn>``...) are special tokens; ``<bos>`` starts every encoding when ``add_bos_token`` says so.
    """
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError("SentencePiece GGUF vocabularies with a dummy space prefix are not supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta["tokenizer.ggml.scores"]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    if not (len(tokens) == len(scores) == len(types)):
        raise ValueError("GGUF tokenizer tokens, scores and token types differ in length")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                     unk_token=tokens[int(unk)] if unk is not None else None, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                           special_tokens=[(b, int(bos))])
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
