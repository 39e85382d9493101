"""Helpers, fixtures and constants shared by `test_batch_cache.py` and `test_batch_cache_models.py`."""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS
from veloxquant_mlx.quant.rope import frame_of

# head_dim 32 in the tiny model: block codecs code blocks of 32 tokens
from _layouts import KBLOCK  # noqa: E402

ROPE32 = frame_of(nn.RoPE(32, base=10000), 32)[0].to_list()  # (llama.ModelArgs' default RoPE at head_dim 32)
CONFIGS = {
    "affine_block-k8v4": CONFIGURATIONS["tq-affine-k8v4"],
    "affine_block-k4v4": CONFIGURATIONS["tq-affine-k4v4"],
    "lloyd_max-k4v4": CONFIGURATIONS["tq-mse-k4v4"],
    "affine-k4v4": CacheOptions(codec="affine", k_bits=4, v_bits=4, sink=4),
    "float16-nosink": CacheOptions(codec="float16", k_bits=16, v_bits=16),
    # exact recent windows: per-token codes read the tail's older tokens through a round trip; block codes wait
    "affine-recent": CacheOptions(codec="affine", k_bits=4, v_bits=4, sink=4, recent=6, trim_headroom=3),
    "affine_block-k8v4-recent": dataclasses.replace(CONFIGURATIONS["tq-affine-k8v4"], recent=8),
    # the budget presets (issue 54): keys and values per token on Lloyd-Max levels, coded on arrival past
    # code_from tokens (here 24, so that the batches' rows cross it), with and without the key offset
    "token_lloyd8-k4v4": dataclasses.replace(CONFIGURATIONS["tq-4b"], code_from=24),
    "token_lloyd8-k4v4-ro": dataclasses.replace(CONFIGURATIONS["tq-4b"], code_from=24, rope_offset=True,
                                                key_rope=ROPE32),
    # the budget presets' block layout before issue 54: tokens waiting for their key block exact
    "kblock_vsym8-k4v4": KBLOCK,
    # issue 47's layout: tokens waiting for their key block stored as codes (provisional keys, values), the keys
    # centred on each sequence's own mean (fitted on arrival)
    "kblock_vsym8_pt-k4v4": dataclasses.replace(KBLOCK, codec="kblock_vsym8_pt"),
    "kblock_vsym8_pt-k4v4-centred": dataclasses.replace(KBLOCK, codec="kblock_vsym8_pt", center_keys=True),
    # issue 54's key offset: keys stored less their rotated mean before RoPE (the tiny model's RoPE: 32 dims)
    "kblock_vsym8-k4v4-ro": dataclasses.replace(KBLOCK, rope_offset=True, key_rope=ROPE32),
    "kblock_vsym8_pt-k4v4-centred-ro": dataclasses.replace(KBLOCK, codec="kblock_vsym8_pt", center_keys=True,
                                                           rope_offset=True, key_rope=ROPE32),
}
RNG = np.random.default_rng(5)
LENGTHS = (3, 80, 41, 150, 20, 7, 100, 1)  # around the sink (4) and 32-token blocks
PROMPTS = [[int(t) for t in RNG.integers(1, 96, n)] for n in LENGTHS]
STEPS = [int(t) for t in RNG.integers(1, 96, 40)]
H, D = 2, 32


def tiny(seed=0):
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=128))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture
def batched_attention(monkeypatch):
    """Counts calls of the batch cache's attend_packed, extend and filter (joining / leaving really happened)."""
    calls = {"attend_packed": 0, "extend": 0, "filter": 0}
    for name in calls:
        original = getattr(TurboQuantBatchPackedCache, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TurboQuantBatchPackedCache, name, counted)
    return calls


# ---------------------------------------------------------------------------------------------------------
# the cache alone: bit-for-bit against per-sequence caches
# ---------------------------------------------------------------------------------------------------------
def _stream(n, seed):
    g = np.random.default_rng(seed)
    k = g.standard_normal((1, H, n, D)).astype(np.float32) + 0.5
    v = g.standard_normal((1, H, n, D)).astype(np.float32) - 0.25
    return mx.array(k), mx.array(v)


def _states_equal(a: TurboQuantPackedCache, b: TurboQuantPackedCache) -> None:
    sa, sb = a.state, b.state
    assert sa["meta"] == sb["meta"]
    assert set(sa) == set(sb)
    for name in sa:
        if name != "meta":
            assert mx.array_equal(sa[name], sb[name]).item(), name


def _run_cache_level(options, lengths, decode_steps, pad_value=0.0, make=None):
    """Per-sequence caches (``make()``, default a TurboQuantPackedCache) and one batch cache fed the same tokens (the
    batch right-padded with ``pad_value``); returns (alone caches, batch cache, max |batch - alone| attention output
    after the prompt and at each decode step)."""
    make = make or (lambda: TurboQuantPackedCache(options))
    streams = [_stream(n + decode_steps, seed=i) for i, n in enumerate(lengths)]
    # (step 0 attends after the prompt, as a model's last prompt position would)
    alone = [make() for _ in lengths]
    batch = type(alone[0]).merge([make() for _ in lengths])
    masks = [c.make_mask(n) for c, n in zip(alone, lengths)]  # what mlx_lm gives each alone for its prompt
    T = max(lengths)
    diffs = []
    with use_packed_attention():
        for c, (k, v), n in zip(alone, streams, lengths):
            c.update_and_fetch(k[:, :, :n], v[:, :, :n])
        pad = lambda x, n: mx.concatenate([x[:, :, :n], mx.full((1, H, T - n, D), pad_value)], axis=2)  # noqa: E731
        batch.prepare(lengths=list(lengths), right_padding=[T - n for n in lengths])
        batch.update_and_fetch(mx.concatenate([pad(k, n) for (k, _), n in zip(streams, lengths)]),
                               mx.concatenate([pad(v, n) for (_, v), n in zip(streams, lengths)]))
        batch.finalize()
        # the prompt's own queries (causal within it; pad positions of shorter rows are not compared)
        qp = mx.array(np.random.default_rng(99).standard_normal((len(lengths), 2 * H, T, D)), mx.float32)
        got = batch.attend_packed(qp, D ** -0.5, "causal")
        for i, (c, n) in enumerate(zip(alone, lengths)):
            want = c.attend_packed(qp[i:i + 1, :, :n], D ** -0.5, masks[i])
            diffs.append(mx.abs(got[i:i + 1, :, :n] - want).max().item())
        for step in range(decode_steps + 1):
            if step:
                ks = [k[:, :, n + step - 1: n + step] for (k, _), n in zip(streams, lengths)]
                vs = [v[:, :, n + step - 1: n + step] for (_, v), n in zip(streams, lengths)]
                for c, k, v in zip(alone, ks, vs):
                    c.update_and_fetch(k, v)
                batch.update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
            q = mx.array(np.random.default_rng(100 + step).standard_normal((len(lengths), 2 * H, 1, D)), mx.float32)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            assert mx.all(mx.isfinite(got)).item()
            diffs.append(mx.abs(got - want).max().item())
    return alone, batch, diffs


def _join_cases():
    for name in sorted(CONFIGS):
        yield pytest.param(name, None, id=name)
    for name in ("affine-k4v4", "float16-nosink"):
        yield pytest.param(name, 24, id=f"{name}-window24")


def _arrays_reachable(obj, seen=None) -> int:
    """Bytes of every distinct mx.array reachable from ``obj``'s attributes (an independent count)."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_arrays_reachable(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_arrays_reachable(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and id(obj) not in seen:
        seen.add(id(obj))
        # shared, stateless rotations (the same for every row); the (B,) offset array is bookkeeping, as in
        # mlx_lm's BatchKVCache, whose nbytes counts keys and values only; "_views" (with the attention parts
        # made of them) / "_sink_views" are views of counted arrays kept for the next decode step (reset whenever
        # those arrays change: a stale one would attend old codes, which tests/attention/test_kernel.py and the
        # equality tests here would see; holding superseded arrays, tests/cache/test_packed_cache_memory.py)
        # "levels" / "inner": token_lloyd8's codebook, one per bit width, shared by every cache
        skip = ("rotation", "quantizers", "_base", "offset", "_views", "_sink_views", "levels", "inner")
        return sum(_arrays_reachable(v, seen) for k, v in vars(obj).items() if k not in skip)
    return 0


# -- everything a single cache accepts, a batch accepts: sink != keep, trim, exact recent windows -------------------
def _decode_both(alone, batch, steps: int, seed: int) -> float:
    """Both go on decoding the same tokens; the largest attention difference per row."""
    g, worst = np.random.default_rng(seed), 0.0
    with use_packed_attention():
        for _ in range(steps):
            k, v = (mx.array(g.standard_normal((len(alone), H, 1, D)), mx.float32) for _ in range(2))
            q = mx.array(g.standard_normal((len(alone), 2 * H, 1, D)), mx.float32)
            for i, c in enumerate(alone):
                c.update_and_fetch(k[i:i + 1], v[i:i + 1])
            batch.update_and_fetch(k, v)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            worst = max(worst, mx.abs(got - want).max().item())
    return worst


# ---------------------------------------------------------------------------------------------------------
# a tiny model, batched by hand as mlx_lm's BatchGenerator does, and through mlx_lm's own entry points
# ---------------------------------------------------------------------------------------------------------
def _alone_logits(model, prompt, steps):
    caches = mlx_cache.make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=caches)
    out = [model(mx.array([prompt[-1:]]), cache=caches)[0, -1]]
    out += [model(mx.array([[t]]), cache=caches)[0, -1] for t in steps]
    return np.array(mx.stack(out)), caches


def _batched_logits(model, prompts, steps):
    """What ``BatchGenerator`` does: merge fresh caches, right-padded prompt with prepare / finalize, then decode."""
    per_sequence = [mlx_cache.make_prompt_cache(model) for _ in prompts]
    caches = [type(layer[0]).merge(list(layer)) for layer in zip(*per_sequence)]
    n = [len(p) - 1 for p in prompts]
    T = max(n)
    if T:
        for c in caches:
            c.prepare(lengths=n, right_padding=[T - x for x in n])
        model(mx.array([p[:-1] + [0] * (T - len(p) + 1) for p in prompts]), cache=caches)
        for c in caches:
            c.finalize()
    out = [model(mx.array([p[-1:] for p in prompts]), cache=caches)[:, -1]]
    out += [model(mx.array([[t]] * len(prompts)), cache=caches)[:, -1] for t in steps]
    return np.array(mx.stack(out, axis=1)), caches


def _assert_same_greedy(alone, batched, tol):
    """Logits within ``tol``; the greedy token equal wherever alone's top-2 margin exceeds twice the difference."""
    diff = np.abs(alone - batched).max(axis=-1)
    assert diff.max() < tol, diff.max()
    top2 = np.sort(alone, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * diff + 1e-6
    assert clear.mean() > 0.9
    assert (alone.argmax(-1) == batched.argmax(-1))[clear].all()


def _alone_tokens(model, tok, prompt, max_tokens):
    out = list(stream_generate(model, tok, prompt, max_tokens=max_tokens))
    return [r.token for r in out], np.array(mx.stack([r.logprobs for r in out]))


class _WindowedLlama(llama.Model):
    """A tiny llama whose layers are 24-token windows keeping their first 4 tokens (mlx_lm's ``max_kv_size``
    layout), so a configuration with ``sink`` < 4 gives windows whose sink differs from keep."""

    def make_cache(self):
        return [mlx_cache.RotatingKVCache(max_size=24, keep=4) for _ in self.layers]


def _windowed_model():
    mx.random.seed(0)
    m = _WindowedLlama(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=128))
    mx.eval(m.parameters())
    return m
