"""A new cache kind is one module plus one registration line (ARCHITECTURE.md, "Where things go").

The module below is written to a temporary package, imported, and registered with `register_cache_kind`; the
kind then goes through everything mlx_lm does with caches: built for a model's layers, prompt and decode through
``generate_step`` attending from the codes, a prompt-cache file written and read by name, and batching (merge,
decode, extract) with each row equal to its sequence alone.
"""
from __future__ import annotations

import importlib
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

import veloxquant_mlx as vq
from veloxquant_mlx import integration
from veloxquant_mlx.integration import builder
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache

NEW_KIND = '''
"""StreamingLLM as a cache kind: the first ``sink`` tokens exact, then only the newest ``budget`` tokens, coded."""
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.cache.packed_cache import TurboQuantBatchRotatingPackedCache, TurboQuantRotatingPackedCache


class StreamingKVCache(mlx_cache.KVCache):
    """What a model's ``make_cache`` returns for a layer that keeps a token budget (the layer's cache kind)."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget


class TurboQuantStreamingCache(TurboQuantRotatingPackedCache):
    """The sink plus the newest ``budget`` tokens: a window that keeps exactly its exact sink."""

    def __init__(self, config=None, max_size=None, keep=None, budget=None, **options):
        sink = options.get("sink", getattr(config, "sink", 0))
        super().__init__(config, max_size=budget + sink if max_size is None else max_size,
                         keep=sink if keep is None else keep, **options)

    @classmethod
    def merge(cls, caches):
        return TurboQuantBatchStreamingCache.merge(caches)


class TurboQuantBatchStreamingCache(TurboQuantBatchRotatingPackedCache):
    _single = TurboQuantStreamingCache


def convert(cache, options, placeholders):
    return TurboQuantStreamingCache(options, budget=cache.budget, fetch_placeholders=placeholders)
'''


@pytest.fixture
def new_kind(tmp_path, monkeypatch):
    (tmp_path / "streaming_kind.py").write_text(textwrap.dedent(NEW_KIND))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("streaming_kind")
    monkeypatch.setattr(integration.builder, "CACHE_KINDS", dict(builder.CACHE_KINDS))  # where the builder reads it
    monkeypatch.setattr(registry, "CACHE_CLASSES", registry.CACHE_CLASSES)  # the classes files name
    # the one registration line
    builder.register_cache_kind(module.StreamingKVCache, module.convert, module.TurboQuantStreamingCache,
                                    module.TurboQuantBatchStreamingCache)
    yield module
    sys.modules.pop("streaming_kind", None)


def _model(module):
    class Model(llama.Model):
        def make_cache(self):
            return [module.StreamingKVCache(budget=40) for _ in self.layers]

    mx.random.seed(0)
    m = Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                              intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    mx.eval(m.parameters())
    return m


def _greedy(model, prompt, caches, n):
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n),
                                        range(n))]


def test_a_new_cache_kind_is_one_module_and_one_line(new_kind, tmp_path):
    model = _model(new_kind)
    options = vq.CacheOptions(codec="affine", k_bits=8, v_bits=8, sink=4)
    caches = vq.make_prompt_cache(model, options)
    assert all(type(c) is new_kind.TurboQuantStreamingCache and (c.max_size, c.keep) == (44, 4) for c in caches)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 128, 70)]
    got = _greedy(model, prompt, caches, 30)
    # the same window through the built-in sliding-window kind: the same tokens, the same stored state
    ref = [TurboQuantRotatingPackedCache(options, max_size=44, keep=4) for _ in model.layers]
    with vq.use_packed_attention():
        want = _greedy(model, prompt, ref, 30)
    assert got == want and all(c.size() == 44 for c in caches)
    for a, b in zip(caches, ref):
        sa, sb = a.state, b.state
        assert set(sa) == set(sb) and all(mx.array_equal(sa[n], sb[n]).item() for n in sa if n != "meta")
    # a prompt-cache file names the class; it is read back by name and continues exactly
    path = str(tmp_path / "streaming.safetensors")
    vq.save_prompt_cache(path, caches)
    loaded = vq.load_prompt_cache(path)
    assert all(type(c) is new_kind.TurboQuantStreamingCache for c in loaded)
    with vq.use_packed_attention():
        nxt = [model(mx.array([[5]]), cache=c)[0, -1] for c in (caches, loaded)]
    assert mx.array_equal(nxt[0], nxt[1]).item()
    # batching: per-sequence caches merge into the kind's batch, decode together, and hand each row back
    seqs = [vq.make_prompt_cache(model, options) for _ in range(2)]
    with vq.use_packed_attention():
        for s, n in zip(seqs, (60, 23)):
            model(mx.array([prompt[:n]]), cache=s)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*seqs)]
        assert all(type(c) is new_kind.TurboQuantBatchStreamingCache for c in batch)
        for t in (7, 9, 11):
            model(mx.array([[t], [t]]), cache=batch)
            for s in seqs:
                model(mx.array([[t]]), cache=s)
        for i, s in enumerate(seqs):
            for layer, (b, alone) in enumerate(zip(batch, s)):
                row = b.extract(i)
                assert type(row) is new_kind.TurboQuantStreamingCache
                sa, sb = row.state, alone.state
                assert sa["meta"] == sb["meta"] and set(sa) == set(sb)
                # every layer's inputs reach it through the model's own projections of a batch, which a BLAS may
                # round at the last bit unlike one row's (OpenBLAS does), and deeper layers' through attention,
                # whose compiled kernel agrees with itself across batch layouts to 1e-5 (tests/attention/test_kernel.py),
                # not bit for bit (its online softmax runs over tiles of tokens, which fall differently around pad
                # and evicted slots); rows of the same inputs are compared bit for bit in tests/cache/test_batch_cache.py
                for n in set(sa) - {"meta"}:
                    same = mx.allclose(sa[n], sb[n], atol=1e-5)
                    assert same.item(), (layer, n)
