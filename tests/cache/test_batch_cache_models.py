"""Batching compressed caches through tiny mlx_lm models: batched by hand as mlx_lm's BatchGenerator does, through
mlx_lm's own entry points (``batch_generate``, ``BatchGenerator``) and `veloxquant generate` with several prompts.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import TokenizerWrapper

import veloxquant_mlx as vq
from fake_tokenizer import FakeTokenizer
from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from _batch_cache_helpers import (
    CONFIGS,
    PROMPTS,
    STEPS,
    D,
    H,
    model,
    batched_attention,
    _stream,
    _states_equal,
    _run_cache_level,
    _alone_logits,
    _batched_logits,
    _assert_same_greedy,
    _alone_tokens,
    _windowed_model,
)


# (a coded tail is cache-wide: a batch holding a row with a key block codes the short rows' waiting tokens too, which
# alone stay exact until their own first block; the 8 prompts mix both, tests/cache/test_batch_cache.py covers it)
@pytest.mark.parametrize("name,size", [(n, s) for n in sorted(CONFIGS) for s in (1, 3, 8)
                                       if not ("_pt" in n and s == 8)])
def test_batched_greedy_equals_each_prompt_alone(model, name, size, batched_attention):
    vq.enable(model, CONFIGS[name])
    try:
        prompts = PROMPTS[:size]
        got, caches = _batched_logits(model, prompts, STEPS)
        assert all(type(c) is TurboQuantBatchPackedCache for c in caches)
        for i, p in enumerate(prompts):
            want, _ = _alone_logits(model, p, STEPS)
            _assert_same_greedy(want, got[i], tol=1e-2)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_sliding_window_model_batched_equals_each_prompt_alone(batched_attention, tiny_gemma3):
    """gemma3 (sliding-window layers of 16 tokens between full-attention ones): windows fill and evict per row.

    This tiny gemma3 is touchy: with OpenBLAS a batched matmul differs from a single one by ~1e-5 (plain caches
    too), enough to flip an 8-bit key code of the first layer (measured: logits 0.05 apart for one row, 2e-6 with
    MLX's own BLAS); the cache-level tests above show the rows are exact."""
    model = tiny_gemma3
    vq.enable(model)
    try:
        prompts = [PROMPTS[i] for i in (0, 2, 4, 5, 6)]
        got, caches = _batched_logits(model, prompts, STEPS[:30])
        assert {type(c).__name__ for c in caches} == {"TurboQuantBatchPackedCache",
                                                      "TurboQuantBatchRotatingPackedCache"}
        for i, p in enumerate(prompts):
            want, _ = _alone_logits(model, p, STEPS[:30])
            _assert_same_greedy(want, got[i], tol=0.1)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_extract_then_continue_alone_equals_batched_continuation(model):
    vq.enable(model, CONFIGS["affine_block-k8v4"])
    try:
        prompts = PROMPTS[:4]
        _, caches = _batched_logits(model, prompts, STEPS[:10])
        extracted = [[c.extract(i) for c in caches] for i in range(len(prompts))]
        assert all(type(c) is TurboQuantPackedCache for row in extracted for c in row)
        more = STEPS[10:20]
        batched = np.array(mx.stack([model(mx.array([[t]] * len(prompts)), cache=caches)[:, -1] for t in more], 1))
        for i, row in enumerate(extracted):
            alone = np.array(mx.stack([model(mx.array([[t]]), cache=row)[0, -1] for t in more]))
            np.testing.assert_allclose(alone, batched[i], atol=1e-4, rtol=1e-4)
            assert [c.offset for c in row] == [len(prompts[i]) + 20] * len(row)
    finally:
        vq.disable(model)


@pytest.mark.parametrize("case", ["default", "affine-recent", "window-sink2-keep4"])
def test_batch_generator_with_sequences_joining_and_leaving(model, batched_attention, case):
    """mlx_lm's own BatchGenerator (prefill in chunks of two, joins while others decode, finished rows leave):
    every sequence gets the tokens it gets alone, with the default configuration, exact recent windows, and
    sliding windows whose sink (2) differs from keep (4)."""
    tok = TokenizerWrapper(FakeTokenizer())
    config = {"default": None, "affine-recent": CONFIGS["affine-recent"],
              "window-sink2-keep4": dataclasses.replace(CONFIGS["affine-k4v4"], sink=2)}[case]
    single = TurboQuantRotatingPackedCache if case.startswith("window") else TurboQuantPackedCache
    if case.startswith("window"):
        model = _windowed_model()
    vq.enable(model, config)
    try:
        first, later = [(PROMPTS[1], 12), (PROMPTS[4], 30)], [(PROMPTS[3], 20), (PROMPTS[0], 6), (PROMPTS[6], 9)]
        gen = BatchGenerator(model, max_tokens=30, completion_batch_size=8, prefill_batch_size=2)
        uids = gen.insert([p for p, _ in first], [m for _, m in first])
        got, logprobs, finished = {}, {}, {}
        rounds = 0
        while responses := gen.next_generated():
            for r in responses:
                got.setdefault(r.uid, []).append(r.token)
                logprobs.setdefault(r.uid, []).append(np.array(r.logprobs))
                if r.finish_reason is not None:
                    finished[r.uid] = r.prompt_cache
            rounds += 1
            if rounds == 4:  # join while the first two are decoding
                uids += gen.insert([p for p, _ in later], [m for _, m in later])
        gen.close()
        for uid, (p, m) in zip(uids, first + later):
            tokens, lp = _alone_tokens(model, tok, p, m)
            assert len(got[uid]) == m
            _assert_same_greedy(lp, np.stack(logprobs[uid]), tol=1e-2)
            assert got[uid] == tokens
            assert all(type(c) is single for c in finished[uid]), finished[uid]
            # the last token was fed (the next step runs ahead)
            assert [c.offset for c in finished[uid]] == [len(p) + m] * 2, (len(p), m)
            if case.startswith("window"):
                assert all((c.sink, c.keep) == (2, 4) for c in finished[uid])
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] and batched_attention["extend"] and batched_attention["filter"]


def test_batch_generate_after_enable(model, batched_attention):
    tok = TokenizerWrapper(FakeTokenizer())
    prompts = PROMPTS[:6]
    vq.enable(model)
    try:
        out = batch_generate(model, tok, prompts, max_tokens=8, return_token_ids=True, return_prompt_caches=True)
        for p, ids, caches in zip(prompts, out.token_ids, out.caches):
            tokens, _ = _alone_tokens(model, tok, p, 8)
            assert ids == tokens
            assert all(type(c) is TurboQuantPackedCache for c in caches)
        # the returned per-sequence caches merge back (prompt-cache reuse): continuing them batched works
        again = batch_generate(model, tok, [[5]] * len(prompts), prompt_caches=out.caches, max_tokens=2,
                               return_token_ids=True)
        assert all(len(ids) == 2 for ids in again.token_ids)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_left_padded_prompt_equals_each_sequence_alone():
    """``prepare(left_padding=...)`` (mlx_lm's BatchKVCache protocol for an empty batch): pad tokens first."""
    options, lengths = CONFIGS["affine_block-k8v4"], (7, 70, 36)
    T = max(lengths)
    streams = [_stream(n, seed=i) for i, n in enumerate(lengths)]
    alone = [TurboQuantPackedCache(options) for _ in lengths]
    batch = TurboQuantPackedCache.merge([TurboQuantPackedCache(options) for _ in lengths])
    batch.prepare(left_padding=[T - n for n in lengths])
    assert batch.offset.tolist() == [n - T for n in lengths]  # RoPE puts each row's first real token at 0
    pad = lambda x: mx.concatenate([mx.full((1, H, T - x.shape[2], D), float("nan")), x], axis=2)  # noqa: E731
    with use_packed_attention():
        for c, (k, v) in zip(alone, streams):
            c.update_and_fetch(k, v)
        batch.update_and_fetch(mx.concatenate([pad(k) for k, _ in streams]), mx.concatenate([pad(v) for _, v in streams]))
        batch.finalize()
        q = mx.array(np.random.default_rng(0).standard_normal((3, 2 * H, T, D)), mx.float32)
        got = batch.attend_packed(q, D ** -0.5, "causal")
        for i, (c, n) in enumerate(zip(alone, lengths)):
            assert mx.array_equal(got[i:i + 1, :, T - n:], c.attend_packed(q[i:i + 1, :, T - n:], D ** -0.5, "causal")).item()
            assert not mx.any(got[i, :, :T - n]).item()  # pad queries: zeros, not NaN
            _states_equal(batch.extract(i), c)
    assert batch.offset.tolist() == list(lengths)


# ---------------------------------------------------------------------------------------------------------
# `veloxquant generate` with several prompts (batched through mlx_lm's BatchGenerator)
# ---------------------------------------------------------------------------------------------------------
def test_generate_command_needs_a_prompt_and_a_readable_prompts_file(capsys, tmp_path):
    from veloxquant_mlx.apps.cli import main

    assert main(["generate"]) != 0 and "--prompt" in capsys.readouterr().err
    assert main(["generate", "--prompts-file", str(tmp_path / "none.txt")]) != 0
    assert "--prompts-file" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["generate", "--prompts-file", str(tmp_path / "empty.txt")]) != 0
    assert "holds no prompt" in capsys.readouterr().err


@pytest.mark.model
def test_generate_command_batches_several_prompts(smollm2, capsys, tmp_path, batched_attention):
    from veloxquant_mlx.apps.cli import main

    (tmp_path / "prompts.txt").write_text("What is the capital of Japan?\n\nWhat is the capital of France?\n")
    rc = main(["generate", "--prompt", "What is the capital of France?", "--prompts-file", str(tmp_path / "prompts.txt"),
               "--method", "tq-affine-k8v4", "--max-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    answers = dict(line.split("] ", 1) for line in out.out.splitlines() if line.startswith("["))
    assert "Paris" in answers["[1"] and "Tokyo" in answers["[2"] and answers["[3"] == answers["[1"], answers
    assert "3 prompts batched" in out.err
    assert batched_attention["attend_packed"] >= len(smollm2[0].layers) * 7
    rc = main(["generate", "--prompt", "a", "--prompt", "b", "--method", "mlx-q4"])  # mlx_lm's 4-bit cannot batch
    assert rc != 0 and "cannot batch several prompts" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_a_configuration_first_used_in_one_thread_works_in_another(name):
    """mlx_lm.server generates in its own thread, after the main thread built (and used) caches of the same
    configuration: MLX arrays belong to the stream of the thread that made them, so nothing made in one thread may
    be handed to another (it failed: "There is no Stream(cpu, 0) in current thread", the server's generation died)."""
    import threading

    options = CONFIGS[name]
    here = TurboQuantPackedCache.merge([TurboQuantPackedCache(options), TurboQuantPackedCache(options)])
    with use_packed_attention():
        here.update_and_fetch(*(mx.zeros((2, H, 3, D)) for _ in range(2)))
    errors = []

    def generation_thread():
        try:
            with use_packed_attention():
                rows = [TurboQuantPackedCache(options) for _ in range(2)]
                rows[0].update_and_fetch(*_stream(70, seed=1))
                batch = TurboQuantPackedCache.merge(rows)
                batch.update_and_fetch(*(mx.zeros((2, H, 1, D)) for _ in range(2)))
                mx.eval([v for v in batch.state.values() if isinstance(v, mx.array)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=generation_thread)
    t.start()
    t.join()
    assert not errors, errors


def test_a_decoding_batch_keeps_its_exact_tail_bounded():
    """Rows code their blocks on different steps; the tail slots that are padding in every row are dropped a code
    step at a time (not at every coded block: one copy of the whole tail each), so the tail never holds more
    than each row's waiting tokens plus less than one step of padding, and attention is unchanged by it."""
    from veloxquant_mlx.cache.row_policy import TAIL_STEP

    options = CONFIGS["affine_block-k8v4"]
    alone, batch, diffs = _run_cache_level(options, (5, 61, 30), decode_steps=0)
    rows = batch.rows
    bound = rows.exact_keep + 2 * rows.code_step + TAIL_STEP  # (waiting < keep + step, padding < step, growth)
    rng = np.random.default_rng(3)
    with use_packed_attention():
        for t in range(200):
            k = mx.array(rng.standard_normal((3, H, 1, D)), mx.float32)
            batch.update_and_fetch(k, k)
            for c, i in zip(alone, range(3)):
                c.update_and_fetch(k[i:i + 1], k[i:i + 1])
            q = mx.array(rng.standard_normal((3, 2 * H, 1, D)), mx.float32)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            assert mx.abs(got - want).max().item() < 1e-5, t
            assert rows.tail.capacity <= bound, (t, rows.tail.length, rows.tail_n)
