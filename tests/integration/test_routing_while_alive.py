"""Attention on the codes without a context manager (`veloxquant_mlx.integration.routing`): mlx_lm's attention is
routed while caches built by `make_prompt_cache` live, and given back when the last of them is collected; the
routed logits equal the decoded path's, plain caches are untouched bit for bit, the count of holders is thread
safe, and a release while the routing lock is held is deferred, never deadlocked."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

import veloxquant_mlx as vq
from veloxquant_mlx.integration import routing

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)


# -- attention on codes without a context manager: routing held while our caches live ------------------------
ROUTED_STEPS = 6


def routed_model(layers=2):
    """llama with head_dim 32 (the affine layouts need a group of 32 or more)."""
    model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5, head_dim=32,
                                        **COMMON))
    mx.eval(model.parameters())
    return model


def teacher_forced(model, caches, steps=ROUTED_STEPS):
    """Logits (steps + 1, V) float32 of a 24-token prefill then ``steps`` fixed tokens, one at a time."""
    tokens = [(5 * i + 3) % 61 for i in range(24 + steps)]
    out = [model(mx.array([tokens[:24]]), cache=caches)[0, -1]]
    for t in tokens[24:]:
        out.append(model(mx.array([[t]]), cache=caches)[0, -1])
    return mx.stack(out).astype(mx.float32)


def routed_state():
    from mlx_lm.models import base

    from veloxquant_mlx.attention import hook
    from veloxquant_mlx.integration import routing

    replaced = routing.packed_scaled_dot_product_attention
    return hook.is_active(), base.scaled_dot_product_attention is replaced, llama.scaled_dot_product_attention is replaced


@pytest.mark.parametrize("name", ["tq-mse-k4v4", "tq-prod-k4v4", "tq-affine-k8v4"])
def test_caches_attend_from_codes_while_alive_and_match_the_decoded_path(name, attention_on_codes):
    import gc

    from veloxquant_mlx.cache.presets import PRESETS

    model, options = routed_model(), PRESETS[name]
    decoded_caches = vq.make_prompt_cache(model, options, route_attention=False)
    assert routed_state() == (False, False, False)  # nothing routed: these caches decode their history
    decoded = teacher_forced(model, decoded_caches)
    assert attention_on_codes["attend_packed"] == 0
    del decoded_caches

    caches = vq.make_prompt_cache(model, options)  # no context manager
    assert routed_state() == (True, True, True)
    routed = teacher_forced(model, caches)
    # every layer, every forward pass, attended from its codes (the fixture fails any decoding fetch)
    assert attention_on_codes["attend_packed"] == 2 * (ROUTED_STEPS + 1)
    err = float(mx.abs(routed - decoded).max() / mx.abs(decoded).max())
    assert err < 1e-4, err
    del caches
    gc.collect()
    assert routed_state() == (False, False, False)  # the last cache gone: mlx_lm's own function everywhere


def test_plain_caches_are_bit_identical_before_during_and_after():
    import gc

    import numpy as np

    model = routed_model()
    plain = lambda: np.array(teacher_forced(model, mlx_cache.make_prompt_cache(model)))  # noqa: E731
    before = plain()
    ours = [vq.make_prompt_cache(model, k_bits=4, v_bits=4), vq.make_prompt_cache(model, codec="affine_block")]
    assert routed_state() == (True, True, True)
    during = plain()  # mlx_lm's function, reached through the routing, for caches that are not ours
    ours.pop()
    assert routed_state()[0]  # one list still alive: still routed
    ours.clear()
    gc.collect()
    assert routed_state() == (False, False, False)
    after = plain()
    assert np.array_equal(before, during) and np.array_equal(before, after)


def test_route_attention_is_checked_and_models_the_hook_cannot_route_are_left_alone(monkeypatch):
    from veloxquant_mlx.integration import builder

    model = routed_model(1)
    with pytest.raises(TypeError, match="route_attention must be a bool"):
        vq.make_prompt_cache(model, route_attention="yes")
    monkeypatch.setattr(builder, "attention_is_routable", lambda m: False)  # a model calling mx.fast SDPA
    caches = vq.make_prompt_cache(model)
    assert routed_state() == (False, False, False) and not any(c.fetch_placeholders for c in caches)


def test_routing_count_is_thread_safe():
    """Threads building and dropping cache lists while others enter and leave use_packed_attention(): the
    count never goes wrong (no error, no negative count) and the routing is gone once every cache is."""
    import gc
    import threading

    from veloxquant_mlx.integration.routing import use_packed_attention

    model = routed_model()
    errors, start = [], threading.Barrier(6)

    def builder_thread():
        try:
            start.wait()
            for _ in range(25):
                caches = vq.make_prompt_cache(model, k_bits=4, v_bits=4)
                assert routed_state()[0]
                del caches
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def scoped_thread():
        try:
            start.wait()
            for _ in range(50):
                with use_packed_attention():
                    assert routed_state()[0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=builder_thread) for _ in range(4)]
    threads += [threading.Thread(target=scoped_thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    gc.collect()
    assert routed_state() == (False, False, False)


def test_a_release_while_the_routing_lock_is_held_is_deferred_not_deadlocked():
    """A cache collected while the hook's lock is taken (a gc inside `install` on the same thread) must not wait
    for the lock: its release is queued and applied by the next holder."""
    import gc

    from veloxquant_mlx import integration
    from veloxquant_mlx.integration import routing
    from veloxquant_mlx.attention import hook

    model = routed_model(1)
    caches = vq.make_prompt_cache(model)
    with routing._lock:
        del caches
        gc.collect()  # the finalizer ran here, on the thread holding the lock
        assert hook.is_active() and len(routing._pending) == 1
    with routing.use_packed_attention():  # the next holder applies it
        pass
    assert routed_state() == (False, False, False) and not routing._pending


def test_routes_model_and_hold_while_alive():
    """`routes_model` tells which models the routing reaches (mlx_lm's modules); `hold_while_alive` keeps it
    installed exactly as long as the object it was given."""
    import gc

    model = routed_model(1)
    assert not routing.routes_model(model)  # nothing installed
    with routing.use_packed_attention():
        assert routing.routes_model(model) and not routing.routes_model(object())
    assert not routing.routes_model(model) and routed_state() == (False, False, False)
    with pytest.raises(TypeError):
        routing.hold_while_alive(3)  # not weakly referenceable: refused before anything is counted
    assert routed_state() == (False, False, False)

    class Holder:
        pass

    holder = Holder()
    routing.hold_while_alive(holder)
    assert routed_state() == (True, True, True)
    del holder
    gc.collect()
    assert routed_state() == (False, False, False)
