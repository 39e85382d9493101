"""Passkey retrieval: a seeded random 5-digit key hidden at a depth of corpus filler, asked at the end.

The prompt goes through the model's chat template (plain text for a model without one) and starts with the
tokenizer's prefix (its BOS, when it adds one and the template did not already put it there); the assistant turn is primed with
``ANSWER_PREFIX`` so a small model answers with the key right away. The wording below was
checked to give 9/9 with mlx_lm's plain KVCache on SmolLM2-135M-Instruct; keep it fixed so
results stay comparable.
"""
from __future__ import annotations

import random
from typing import Dict, List, Sequence

from tqdm.auto import tqdm

from veloxquant_mlx.apps.eval.corpus import text_prefix
from veloxquant_mlx.apps.eval.forward import DEFAULT_CHUNK, greedy_decode, prefill
from veloxquant_mlx.apps.eval.specs import CacheSpec

INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
_MARK = "\x00FILLER\x00"


def passkey_key(seed: int, trial: int) -> str:
    """The 5-digit key of one trial (deterministic in seed and trial index)."""
    return str(random.Random(seed * 1_000_003 + trial).randint(10000, 99999))


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def passkey_prompt(tokenizer, filler: Sequence[int], length: int, depth: float, key: str) -> List[int]:
    """Token ids of a passkey prompt of exactly ``length`` tokens (filler cut to fit).

    ``filler`` is a token stream (the corpus); the needle goes at ``depth`` (0..1) of the filler
    part. Pieces are encoded separately and concatenated, so the total length is exact.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    messages = [{"role": "user", "content": INTRO + _MARK + QUESTION}]
    if getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:  # a model without a chat template (e.g. the tiny test model): plain text
        text = messages[0]["content"] + "\n"
    head, tail = text.split(_MARK)
    head_ids = _encode(tokenizer, head)
    start = list(text_prefix(tokenizer))  # the BOS a base model's text starts with (Gemma's <bos>)
    if start and head_ids[: len(start)] != start:
        head_ids = start + head_ids
    tail_ids = _encode(tokenizer, tail + ANSWER_PREFIX)
    needle_ids = _encode(tokenizer, NEEDLE.format(key=key))
    budget = length - len(head_ids) - len(tail_ids) - len(needle_ids)
    if budget <= 0:
        raise ValueError(f"length {length} is too short for the passkey prompt")
    if len(filler) < budget:
        raise ValueError(f"filler has {len(filler)} tokens; length {length} needs {budget}")
    body = list(filler[:budget])
    at = int(round(depth * budget))
    return head_ids + body[:at] + needle_ids + body[at:] + tail_ids


def passkey_eval(
    model,
    tokenizer,
    filler: Sequence[int],
    specs: Sequence[CacheSpec],
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
    max_new_tokens: int = 8,
    chunk: int = DEFAULT_CHUNK,
    progress: bool = True,
) -> Dict[str, dict]:
    """Per spec: ``passed``/``total`` and one record per (length, depth) with key and answer."""
    eos = getattr(tokenizer, "eos_token_ids", None) or []
    trials = [(L, d) for L in lengths for d in depths]
    out = {s.name: {"passed": 0, "total": len(trials), "trials": []} for s in specs}
    bar = tqdm(total=len(trials) * len(specs), desc="passkey", unit="prompt", disable=not progress, leave=False)
    for i, (length, depth) in enumerate(trials):
        key = passkey_key(seed, i)
        ids = passkey_prompt(tokenizer, filler, length, depth, key)
        for s in specs:
            cache = s.make_cache(model)
            logits = prefill(model, ids, cache, chunk=chunk)
            gen = greedy_decode(model, logits, cache, max_new_tokens, eos_ids=eos)
            answer = tokenizer.decode(gen)
            ok = key in answer.replace(" ", "")
            out[s.name]["passed"] += int(ok)
            out[s.name]["trials"].append(
                {"length": length, "depth": depth, "key": key, "answer": answer, "passed": ok}
            )
            bar.update(1)
    bar.close()
    return out
