"""Passkey retrieval (`veloxquant_mlx.apps.eval.passkey`): prompts of an exact length with the key at a depth (after
the tokenizer's BOS when it adds one), the trials' bookkeeping on a tiny random model, retrieval on SmolLM2."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.apps.eval.passkey import passkey_eval, passkey_prompt
from veloxquant_mlx.apps.eval.specs import baseline_specs, resolve_spec
from _eval_helpers import BOS, TINY_VOCAB, BosTokenizer, ByteTokenizer


def test_passkey_on_tiny_model(tiny_model, tiny_tokenizer, random_tokens):
    # The random model cannot retrieve a key; what is checked here is the bookkeeping and that the
    # compressed caches answer as the plain cache does (the real retrieval: `test_passkey_on_smollm2`).
    specs = [resolve_spec(n) for n in ("kv", "mlx-q8", "tq-affine-k8v8")]
    r = passkey_eval(tiny_model, tiny_tokenizer, random_tokens, specs, lengths=(300, 400), depths=(0.1, 0.9),
                     max_new_tokens=3, progress=False)
    keys = [t["key"] for t in r["kv"]["trials"]]
    assert len(set(keys)) == 4 and all(len(k) == 5 and k.isdigit() for k in keys)
    for s in specs:
        trials = r[s.name]["trials"]
        assert r[s.name]["total"] == 4 and [t["key"] for t in trials] == keys  # same seeded keys for every method
        assert [(t["length"], t["depth"]) for t in trials] == [(300, 0.1), (300, 0.9), (400, 0.1), (400, 0.9)]
        assert all(t["passed"] == (t["key"] in t["answer"].replace(" ", "")) for t in trials)
        assert r[s.name]["passed"] == sum(t["passed"] for t in trials)
        assert [t["answer"] for t in trials] == [t["answer"] for t in r["kv"]["trials"]]


def test_passkey_counts_the_answers_that_hold_the_key(tiny_model, tiny_tokenizer, random_tokens, monkeypatch):
    import veloxquant_mlx.apps.eval.passkey as passkey_mod

    # A decoder that "answers" the key of the trials at depth 0.1 only: exactly those must count as passed.
    def decode(model, logits, cache, n, eos_ids=()):
        text = passkey_mod.passkey_key(0, decode.trial) if decode.trial % 2 == 0 else "nope"
        decode.trial += 1
        return tiny_tokenizer.encode(" " + text)

    decode.trial = 0
    monkeypatch.setattr(passkey_mod, "greedy_decode", decode)
    r = passkey_eval(tiny_model, tiny_tokenizer, random_tokens, baseline_specs()[:1], lengths=(300, 400),
                     depths=(0.1, 0.9), progress=False)
    assert r["kv"]["passed"] == 2 and [t["passed"] for t in r["kv"]["trials"]] == [True, False, True, False]


@pytest.mark.model
def test_passkey_on_smollm2(smollm2, corpus_ids, attention_on_codes):
    # Measured: the plain cache and tq-mse-k4v4 (attention on its codes) both answer the key at 160 tokens,
    # depth 0.5, and at 300 tokens, depths 0.2 and 0.8 (where tq-mse-k2v2 and mlx-q2 fail). One trial keeps it cheap.
    from veloxquant_mlx.integration.routing import use_packed_attention

    model, tok = smollm2
    specs = [resolve_spec("tq-mse-k4v4")]  # (the plain cache's pass is measured above, not rerun: 3 s)
    with use_packed_attention():
        r = passkey_eval(model, tok, corpus_ids, specs, lengths=(160,), depths=(0.5,), max_new_tokens=6,
                         progress=False)
    for s in specs:
        assert r[s.name]["passed"] == 1, r[s.name]["trials"]
    assert attention_on_codes["attend_packed"] >= len(model.layers) * 6  # prefill + decode steps, every layer


@settings(max_examples=10, deadline=None)
@given(length=st.integers(260, 900), depth=st.floats(0.0, 1.0))
def test_passkey_prompt_exact_length_and_contains_key(tiny_tokenizer, random_tokens, length, depth):
    ids = passkey_prompt(tiny_tokenizer, random_tokens, length, depth, "12345")
    assert len(ids) == length
    needle = tiny_tokenizer.encode("The pass key is 12345.")
    s = ",".join(map(str, ids))
    assert ",".join(map(str, needle)) in s


def test_passkey_prompt_too_short_is_an_error(tiny_tokenizer, random_tokens):
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tiny_tokenizer, random_tokens, 50, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tiny_tokenizer, random_tokens, 500, 1.5, "12345")


def test_passkey_prompt_starts_with_the_bos(random_tokens):
    ids = passkey_prompt(BosTokenizer(TINY_VOCAB), random_tokens, 300, 0.5, "12345")
    plain = passkey_prompt(ByteTokenizer(TINY_VOCAB), random_tokens, 300, 0.5, "12345")
    assert len(ids) == len(plain) == 300
    assert ids[0] == BOS and plain[0] != BOS
    assert ids[1:40] == plain[:39]  # the same text after it
