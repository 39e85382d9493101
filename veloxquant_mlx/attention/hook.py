"""The low-level state the packed caches read: is attention routed to their codes, and the placeholders they
return meanwhile. Nothing here patches anything: the routing itself (``install`` / ``uninstall`` /
``use_packed_attention`` / ``hold_while_alive``, the replacement of mlx_lm's ``scaled_dot_product_attention``) is
:mod:`veloxquant_mlx.integration`, which sets the flag here (`set_active`) when it routes and when it stops.

This module sits below the caches: it imports neither :mod:`veloxquant_mlx.cache` nor the integration.
"""
from __future__ import annotations

import weakref

import mlx.core as mx

_active = False  # set by veloxquant_mlx.integration while the routing is installed


def implements_protocol(cache) -> bool:
    """Whether ``cache`` offers packed attention (a callable ``attend_packed``)."""
    return cache is not None and callable(getattr(cache, "attend_packed", None))


def is_active() -> bool:
    """True while mlx_lm's attention is routed to ``attend_packed`` (inside ``use_packed_attention`` / between
    ``install`` and the matching ``uninstall`` of :mod:`veloxquant_mlx.integration`).

    A packed cache's ``update_and_fetch`` may return placeholder tensors while this is True (ours return
    `owned_placeholders`; `placeholder_history` is the shared kind, for a protocol cache of another library).
    """
    return _active


def set_active(active: bool) -> None:
    """For :mod:`veloxquant_mlx.integration` only: the routing went in (True) or came out (False)."""
    global _active
    _active = bool(active)


_zeros = {}  # (ndim, dtype) -> a one-element zero array, shared by every placeholder (never written)
_last_placeholders = {}  # (ndim, dtype) -> (shape, placeholder): every layer of one decode step asks the same


def placeholder_history(shape, dtype) -> mx.array:
    """A stand-in ``(B, H, n, d)`` tensor that costs no memory (a broadcast scalar zero).

    For ``update_and_fetch`` while the routing is active: mlx_lm passes it on to SDPA, which the routing
    sends to ``cache.attend_packed`` instead, so the history is never dequantized. Consecutive calls with one
    shape get the same array (read-only, nothing depends on it: safe to share).
    """
    shape = tuple(shape)
    key = (len(shape), dtype)
    last = _last_placeholders.get(key)
    if last is not None and last[0] == shape:
        return last[1]
    zero = _zeros.get(key)
    if zero is None:
        zero = _zeros[key] = mx.zeros((1,) * len(shape), dtype=dtype)
        mx.eval(zero)  # shared by every thread (a lazy array belongs to the stream of the thread that made it)
    out = mx.broadcast_to(zero, shape)
    _last_placeholders[key] = (shape, out)
    return out


# id(placeholder) -> the cache that handed it out. A model may pass a cache's fetched keys/values to attention under
# another layer (gemma4's and afm7's layers that reuse an earlier layer's keys and values, with cache=None): the
# routing finds the owner here and attends from its codes. Weak values: an entry goes with its cache. The pairs
# themselves are kept here (weak keys), not on the caches, so that a cache's own arrays are only what it stores.
_owners: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_pairs: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()


def owned_placeholders(owner, k_shape, v_shape, k_dtype, v_dtype):
    """`placeholder_history` pair ``(keys, values)`` that belongs to ``owner`` (a packed cache), so that
    `owner_of` tells which cache a placeholder stands for (the latest pair of each cache only)."""
    old = _pairs.get(owner)
    if old is not None:
        if old[0].shape == tuple(k_shape) and old[1].shape == tuple(v_shape) and old[0].dtype == k_dtype \
                and old[1].dtype == v_dtype:
            return old
        for a in old:
            if _owners.get(id(a)) is owner:
                del _owners[id(a)]
    pair = tuple(mx.broadcast_to(_zero(len(s), dt), tuple(s)) for s, dt in ((k_shape, k_dtype), (v_shape, v_dtype)))
    _pairs[owner] = pair
    _owners[id(pair[0])] = owner
    _owners[id(pair[1])] = owner
    return pair


def placeholders_of(owner):
    """The placeholder pair ``owner`` handed out last (`owned_placeholders`), or None."""
    return _pairs.get(owner)


def _zero(ndim, dtype) -> mx.array:
    key = (ndim, dtype)
    zero = _zeros.get(key)
    if zero is None:
        zero = _zeros[key] = mx.zeros((1,) * ndim, dtype=dtype)
        mx.eval(zero)
    return zero


def owner_of(x):
    """The cache whose latest placeholder pair holds ``x`` (`owned_placeholders`), or None."""
    owner = _owners.get(id(x))
    if owner is None:
        return None
    pair = _pairs.get(owner)
    return owner if pair is not None and (pair[0] is x or pair[1] is x) else None
