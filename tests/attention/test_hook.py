"""The routing state the packed caches read (veloxquant_mlx.attention.hook): the flag, the protocol check and the
placeholders a cache returns while attention is routed to its codes. The routing itself (which sets the flag):
tests/integration/test_routing.py."""
from __future__ import annotations

import gc
import importlib

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

import veloxquant_mlx.attention as attention
from veloxquant_mlx.attention import hook

ORIGINAL = base.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def hook_is_off_around_each_test():
    assert not hook.is_active() and base.scaled_dot_product_attention is ORIGINAL
    yield
    assert not hook.is_active(), "a test left the hook installed"
    assert base.scaled_dot_product_attention is ORIGINAL


class _Owner:
    """Stands for a packed cache: hashable and weakly referable, as the owners of placeholders are."""


def test_nothing_patched_at_import():
    importlib.reload(attention)
    assert base.scaled_dot_product_attention is ORIGINAL and not hook.is_active()
    # the routing lives in the integration, not in the attention package (which sits below the caches)
    assert not hasattr(attention, "use_packed_attention") and not hasattr(hook, "install")


def test_placeholder_history_is_cheap_and_shaped():
    before = mx.get_active_memory()
    p = hook.placeholder_history((2, 3, 1000, 64), mx.float16)
    mx.eval(p)
    assert p.shape == (2, 3, 1000, 64) and p.dtype == mx.float16
    # A broadcast scalar: evaluating it allocates a few bytes, not the 768,000 a real tensor would take.
    assert mx.get_active_memory() - before < 1024 and float(mx.max(mx.abs(p))) == 0.0


def test_placeholder_history_is_shared_for_one_shape_and_new_for_another():
    a = hook.placeholder_history([1, 2, 7, 16], mx.float32)
    assert hook.placeholder_history((1, 2, 7, 16), mx.float32) is a  # every layer of one step asks the same
    b = hook.placeholder_history((1, 2, 8, 16), mx.float32)
    assert b is not a and b.shape == (1, 2, 8, 16)
    c = hook.placeholder_history((1, 2, 8, 16), mx.bfloat16)
    assert c.dtype == mx.bfloat16 and c is not b


def test_set_active_is_what_is_active_reports():
    try:
        hook.set_active(1)  # (normalised to a bool)
        assert hook.is_active() is True
        hook.set_active(False)
        assert hook.is_active() is False
    finally:
        hook.set_active(False)


def test_implements_protocol_needs_a_callable_attend_packed():
    class Protocol:
        def attend_packed(self, queries, scale, mask, sinks=None):
            return queries

    class NotCallable:
        attend_packed = 3

    assert hook.implements_protocol(Protocol())
    assert not hook.implements_protocol(NotCallable())
    assert not hook.implements_protocol(KVCache()) and not hook.implements_protocol(None)


def test_owned_placeholders_name_their_cache_until_it_hands_out_others():
    one, two = _Owner(), _Owner()
    k, v = hook.owned_placeholders(one, (1, 2, 5, 8), (1, 2, 5, 4), mx.float16, mx.float32)
    assert (k.shape, v.shape, k.dtype, v.dtype) == ((1, 2, 5, 8), (1, 2, 5, 4), mx.float16, mx.float32)
    assert float(mx.max(mx.abs(k))) == 0.0 and float(mx.max(mx.abs(v))) == 0.0
    assert hook.owner_of(k) is one and hook.owner_of(v) is one
    assert all(a is b for a, b in zip(hook.placeholders_of(one), (k, v)))
    # the same shapes again: the very same pair; another cache's pair is its own
    again = hook.owned_placeholders(one, (1, 2, 5, 8), (1, 2, 5, 4), mx.float16, mx.float32)
    assert again[0] is k and again[1] is v
    k2, v2 = hook.owned_placeholders(two, (1, 2, 5, 8), (1, 2, 5, 4), mx.float16, mx.float32)
    assert k2 is not k and hook.owner_of(k2) is two and hook.owner_of(k) is one
    # the next step's pair replaces the cache's last one: the old placeholders name no cache any more
    k3, _ = hook.owned_placeholders(one, (1, 2, 6, 8), (1, 2, 6, 4), mx.float16, mx.float32)
    assert hook.owner_of(k3) is one and hook.owner_of(k) is None and hook.owner_of(v) is None
    assert hook.placeholders_of(one)[0] is k3
    # an array no cache handed out, and a cache that handed out nothing
    assert hook.owner_of(mx.zeros((1, 2, 6, 8))) is None and hook.placeholders_of(_Owner()) is None


def test_an_owner_is_held_weakly():
    owner = _Owner()
    k, _ = hook.owned_placeholders(owner, (1, 1, 3, 4), (1, 1, 3, 4), mx.float32, mx.float32)
    assert hook.owner_of(k) is owner
    del owner
    gc.collect()
    assert hook.owner_of(k) is None  # the entry went with its cache
