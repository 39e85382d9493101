"""The reversible attention routing (veloxquant_mlx.integration.routing; its flag in veloxquant_mlx.attention.hook) on
a tiny random llama model. The flag and the placeholders themselves: tests/attention/test_hook.py."""
from __future__ import annotations

import importlib
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import integration
from veloxquant_mlx.integration import routing
from veloxquant_mlx.attention import hook

ORIGINAL = base.scaled_dot_product_attention
ARGS = llama.ModelArgs(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    m = llama.Model(ARGS)
    mx.eval(m.parameters())
    return m


@pytest.fixture(autouse=True)
def hook_is_off_around_each_test():
    assert not hook.is_active() and base.scaled_dot_product_attention is ORIGINAL
    yield
    assert not hook.is_active(), "a test left the hook installed"
    assert base.scaled_dot_product_attention is ORIGINAL and llama.scaled_dot_product_attention is ORIGINAL


class CountingCache(KVCache):
    """A plain KVCache that implements the protocol by calling fast SDPA on its own buffers."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def attend_packed(self, queries, scale, mask, sinks=None):
        self.calls += 1
        k, v = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def run(model, caches, prompt=(1, 5, 9, 2, 7, 3, 11, 4), steps=3):
    """Prefill + greedy decode; returns the list of last-position logits (float32 numpy)."""
    out = []
    logits = model(mx.array([list(prompt)]), cache=caches)
    out.append(np.array(logits[:, -1].astype(mx.float32)))
    for _ in range(steps):
        tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
        logits = model(tok, cache=caches)
        out.append(np.array(logits[:, -1].astype(mx.float32)))
    return out


def test_protocol_cache_routed_inside_original_back_outside(model):
    ref = run(model, [KVCache() for _ in range(2)])
    caches = [CountingCache() for _ in range(2)]
    with routing.use_packed_attention():
        assert hook.is_active()
        assert base.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
        assert llama.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
        got = run(model, caches)
    assert [c.calls for c in caches] == [4, 4]  # prefill + 3 decode steps, per layer
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Outside: the very same function objects are back and the protocol is ignored.
    assert base.scaled_dot_product_attention is ORIGINAL and llama.scaled_dot_product_attention is ORIGINAL
    c = [CountingCache() for _ in range(2)]
    run(model, c)
    assert [x.calls for x in c] == [0, 0]


def test_cache_without_protocol_takes_original_path(model, monkeypatch):
    ref = run(model, [KVCache() for _ in range(2)])
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cache", args[3] if len(args) > 3 else None))
        return ORIGINAL(*args, **kwargs)

    with routing.use_packed_attention():
        monkeypatch.setattr(integration.routing, "_original", spy)  # the hook calls whatever it saved as the original
        got = run(model, [KVCache() for _ in range(2)])
        monkeypatch.undo()
    assert len(seen) == 8 and all(isinstance(c, KVCache) for c in seen)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_routes_model(model):
    assert not routing.routes_model(model)
    with routing.use_packed_attention():
        assert routing.routes_model(model)
        assert not routing.routes_model(object())  # a class whose module never imported the function
    assert not routing.routes_model(model)


def test_exception_inside_restores():
    with pytest.raises(ZeroDivisionError):
        with routing.use_packed_attention():
            assert llama.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
            1 / 0
    assert llama.scaled_dot_product_attention is ORIGINAL and not hook.is_active()


def test_nesting_and_explicit_pair():
    with routing.use_packed_attention():
        with routing.use_packed_attention():
            assert hook.is_active()
        # the inner exit must not restore while the outer block is still active
        assert base.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
        routing.install()
        routing.uninstall()
        assert llama.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
    assert base.scaled_dot_product_attention is ORIGINAL
    with pytest.raises(RuntimeError, match="install"):
        routing.uninstall()


def test_module_imported_while_active_is_restored():
    # Import a fresh copy of an mlx_lm model module inside the context (the process's own copy, if any,
    # is put back afterwards), as happens when a model is loaded while the hook is active.
    name = "mlx_lm.models.qwen2"
    saved = sys.modules.pop(name, None)
    try:
        with routing.use_packed_attention():
            mod = importlib.import_module(name)
            assert mod is not saved
            assert mod.scaled_dot_product_attention is routing.packed_scaled_dot_product_attention
        assert mod.scaled_dot_product_attention is ORIGINAL
    finally:
        if saved is not None:
            sys.modules[name] = saved
            setattr(sys.modules["mlx_lm.models"], "qwen2", saved)


def test_foreign_patch_is_left_alone():
    """An attribute someone else replaced while the hook was active is not clobbered on exit."""
    def other(*a, **k):
        return ORIGINAL(*a, **k)

    try:
        with routing.use_packed_attention():
            llama.scaled_dot_product_attention = other
        assert llama.scaled_dot_product_attention is other
        assert base.scaled_dot_product_attention is ORIGINAL
    finally:
        llama.scaled_dot_product_attention = ORIGINAL


def test_sinks_and_arguments_forwarded():
    class Recorder:
        def attend_packed(self, queries, scale, mask, sinks=None):
            self.got = (scale, mask, sinks)
            return queries

    q = mx.zeros((1, 2, 1, 4))
    r = Recorder()
    sinks = mx.ones((2,))
    with routing.use_packed_attention():
        out = base.scaled_dot_product_attention(q, None, None, cache=r, scale=0.5, mask="causal", sinks=sinks)
        assert out is q and r.got[0] == 0.5 and r.got[1] == "causal" and r.got[2] is sinks
        base.scaled_dot_product_attention(q, None, None, r, 0.25, None)
        assert r.got == (0.25, None, None)
        base.scaled_dot_product_attention(q, None, None, r, 0.75, mask=None, sinks=sinks)
        assert r.got[0] == 0.75 and r.got[1] is None and r.got[2] is sinks
        base.scaled_dot_product_attention(q, None, None, cache=r, mask="causal", scale=2.0)
        assert r.got == (2.0, "causal", None)
        # Calls the fast argument path does not recognise get the signature's own errors.
        with pytest.raises(TypeError):
            base.scaled_dot_product_attention(q, None, None, r, 0.5, None, scale=0.5)
        with pytest.raises(TypeError):
            base.scaled_dot_product_attention(q, None, None, r, scale=0.5, mask=None, window=3)
        with pytest.raises(TypeError):
            base.scaled_dot_product_attention(q, None, None, r, scale=0.5)
    assert hook.implements_protocol(r) and not hook.implements_protocol(KVCache()) and not hook.implements_protocol(None)


# -- end to end: the shipped packed cache through the hook ---------------------------------------
@pytest.mark.parametrize("codec", ["lloyd_max", "affine", "affine_block"])
def test_packed_cache_end_to_end(model, codec, monkeypatch):
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    calls = {"attend": 0, "fetch": 0}
    attend, fetch = TurboQuantPackedCache.attend_packed, TurboQuantPackedCache._fetch

    def counted_attend(self, *a, **k):
        calls["attend"] += 1
        return attend(self, *a, **k)

    def guarded_fetch(self, dtype):
        if hook.is_active():
            raise AssertionError("the history was decoded while attention on codes was on")
        calls["fetch"] += 1
        return fetch(self, dtype)

    monkeypatch.setattr(TurboQuantPackedCache, "attend_packed", counted_attend)
    monkeypatch.setattr(TurboQuantPackedCache, "_fetch", guarded_fetch)
    # (no exact window: with one, prompt chunks read their newest keys exact from codes only, which the decoded
    # history cannot show; tests/cache/test_packed_cache_attention.py checks that path against its own reference)
    options = dict(k_bits=4, v_bits=4, sink=2, codec=codec, group_size=32 if codec != "lloyd_max" else None)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, ARGS.vocab_size, 80)]
    ref = run(model, [TurboQuantPackedCache(**options) for _ in range(2)], prompt, steps=4)  # decode + SDPA
    assert calls == {"attend": 0, "fetch": 2 * 5}
    caches = [TurboQuantPackedCache(**options) for _ in range(2)]
    with routing.use_packed_attention():
        got = run(model, caches, prompt, steps=4)
    assert calls == {"attend": 2 * 5, "fetch": 2 * 5}  # every layer and step attended from its codes
    assert all(c.n_coded > 0 for c in caches)  # the coded path really ran
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.abs(b).max()))


def test_hold_while_alive_routes_until_the_object_is_collected():
    import gc

    class Holder:
        pass

    a, b = Holder(), Holder()
    routing.hold_while_alive(a)
    routing.hold_while_alive(b)
    assert hook.is_active() and llama.scaled_dot_product_attention is not ORIGINAL
    del a
    gc.collect()
    assert hook.is_active()  # b still holds it
    del b
    gc.collect()
    assert not hook.is_active() and llama.scaled_dot_product_attention is ORIGINAL
    with pytest.raises(TypeError):  # a list cannot be weakly referenced: refused before anything is counted
        routing.hold_while_alive([])
    assert not hook.is_active()


def test_a_hold_whose_count_was_taken_back_releases_nothing():
    import gc

    class Holder:
        pass

    a = Holder()
    routing.hold_while_alive(a)
    routing.uninstall()  # an unbalanced explicit uninstall takes the hold's count
    assert not hook.is_active()
    del a
    gc.collect()  # its release finds nothing to undo: no negative count, mlx_lm's function stays in place
    assert not hook.is_active() and routing._depth == 0 and llama.scaled_dot_product_attention is ORIGINAL
