"""The low-level state the packed caches read: is attention routed to their codes, and the placeholders they
return meanwhile. Nothing here patches anything: the routing itself (``install`` / ``uninstall`` /
``use_packed_attention`` / ``hold_while_alive``, the replacement of mlx_lm's ``scaled_dot_product_attention``) is
:mod:`veloxquant_mlx.integration`, which sets the flag here (`set_active`) when it routes and when it stops.

This module sits below the caches: it imports neither :mod:`veloxquant_mlx.cache` nor the integration.
"""
from __future__ import annotations

import mlx.core as mx

_active = False  # set by veloxquant_mlx.integration while the routing is installed


def implements_protocol(cache) -> bool:
    """Whether ``cache`` offers packed attention (a callable ``attend_packed``)."""
    return cache is not None and callable(getattr(cache, "attend_packed", None))


def is_active() -> bool:
    """True while mlx_lm's attention is routed to ``attend_packed`` (inside ``use_packed_attention`` / between
    ``install`` and the matching ``uninstall`` of :mod:`veloxquant_mlx.integration`).

    A packed cache's ``update_and_fetch`` may return `placeholder_history` tensors while this is True.
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
