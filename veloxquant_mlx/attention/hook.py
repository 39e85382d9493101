"""Reversible mlx_lm integration: route attention of packed caches to their own ``attend_packed``.

mlx_lm model files do ``from .base import scaled_dot_product_attention`` and call it with the layer's
cache. `install()` replaces that function (in ``mlx_lm.models.base`` and in every already-imported
``mlx_lm.*`` module holding it under any name) by `packed_scaled_dot_product_attention`, which calls
``cache.attend_packed(queries, scale, mask[, sinks=...])`` when the cache implements the protocol
(see :mod:`veloxquant_mlx.attention`) and the original function, unchanged, otherwise. Modules imported
while the hook is active pick the replacement up from ``base``; `uninstall()` restores every attribute
that still holds the replacement to exactly the original object. Nothing is patched at import time.

Nesting is counted (only the outermost exit restores) and a lock guards the counter, so
``with use_packed_attention():`` blocks may nest and raise freely. `hold_while_alive(obj)` is one more count
that ends when ``obj`` is garbage collected (what `make_prompt_cache` does for the caches it builds, so they
attend from their codes without a context manager); its release runs in a weakref finalizer, which may fire
inside any allocation, so it never waits for the lock: when the lock is taken it leaves the release to the
thread holding it.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import sys
import threading
import weakref
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

_NAME = "scaled_dot_product_attention"
_lock = threading.Lock()  # not re-entrant: a finalizer on the holding thread must not get in (see `_drain`)
_depth = 0
_pending = collections.deque()  # releases of collected holders not yet applied (deque.append is atomic)
_original: Optional[Callable] = None  # mlx_lm.models.base's function when the hook went in
_signature: Optional[inspect.Signature] = None
_patched: List[Tuple[object, str]] = []  # (module, attribute) we set to the replacement


def implements_protocol(cache) -> bool:
    """Whether ``cache`` offers packed attention (a callable ``attend_packed``)."""
    return cache is not None and callable(getattr(cache, "attend_packed", None))


def is_active() -> bool:
    """True inside `use_packed_attention` / between `install` and the matching `uninstall`.

    A packed cache's ``update_and_fetch`` may return `placeholder_history` tensors while this is True.
    """
    return _depth > 0


def routes_model(model) -> bool:
    """Whether the hook currently routes ``model``'s attention: its class's module holds the replacement.

    A cache builder can check this before letting caches return placeholders: a model file that calls
    ``mx.fast.scaled_dot_product_attention`` itself (a few in mlx_lm 0.32) would get wrong results.
    """
    mod = sys.modules.get(type(model).__module__)
    return is_active() and getattr(mod, _NAME, None) is packed_scaled_dot_product_attention


_zeros = {}  # (ndim, dtype) -> a one-element zero array, shared by every placeholder (never written)
_last_placeholders = {}  # (ndim, dtype) -> (shape, placeholder): every layer of one decode step asks the same


def placeholder_history(shape, dtype) -> mx.array:
    """A stand-in ``(B, H, n, d)`` tensor that costs no memory (a broadcast scalar zero).

    For ``update_and_fetch`` while the hook is active: mlx_lm passes it on to SDPA, which the hook
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
    out = mx.broadcast_to(zero, shape)
    _last_placeholders[key] = (shape, out)
    return out


_TRAILING = ("scale", "mask", "sinks")  # mlx_lm's parameters after ``cache``, in order


def _fast_arguments(args, kwargs):
    """``{scale, mask, sinks}`` of the call mlx_lm models make, without ``inspect`` (~30 us per layer).

    None when the call does not have exactly that shape; the caller then binds the full signature.
    """
    if len(args) > 3:
        return None
    a = dict(zip(_TRAILING, args))
    for name, value in kwargs.items():
        if name not in _TRAILING or name in a:
            return None
        a[name] = value
    if "scale" not in a or "mask" not in a:
        return None
    a.setdefault("sinks", None)
    return a


def packed_scaled_dot_product_attention(queries, keys, values, cache, *args, **kwargs):
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention`` (same signature).

    Protocol caches (while the hook is active) -> ``cache.attend_packed``; anything else -> the original.
    """
    original = _original
    if original is None:  # never installed: behave like mlx_lm itself
        from mlx_lm.models import base

        original = getattr(base, _NAME)
        if original is packed_scaled_dot_product_attention:
            raise RuntimeError("packed attention hook state lost: base holds the replacement but no original")
    if _depth > 0 and implements_protocol(cache):
        a = _fast_arguments(args, kwargs)
        if a is None:  # an unusual call: let the signature sort it out (and raise its usual errors)
            bound = _signature.bind(queries, keys, values, cache, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
        sinks = a.get("sinks")
        if sinks is None:
            return cache.attend_packed(queries, a["scale"], a["mask"])
        return cache.attend_packed(queries, a["scale"], a["mask"], sinks=sinks)
    return original(queries, keys, values, cache, *args, **kwargs)


def _mlx_lm_modules():
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))]


def install() -> None:
    """Activate the hook (counted: each call needs one `uninstall`)."""
    global _depth, _original, _signature
    with _lock:
        if _depth == 0:
            from mlx_lm.models import base

            original = getattr(base, _NAME)
            if original is packed_scaled_dot_product_attention:
                raise RuntimeError("mlx_lm.models.base already holds the packed attention replacement")
            _original, _signature = original, inspect.signature(original)
            _patched.clear()
            for mod in _mlx_lm_modules():
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, attr, packed_scaled_dot_product_attention)
                        _patched.append((mod, attr))
        _depth += 1
    _drain()


def uninstall() -> None:
    """Undo one `install`; the last one restores every patched attribute to the original function."""
    with _lock:
        if _depth == 0:
            raise RuntimeError("uninstall() called without a matching install()")
        _uninstall_locked()
    _drain()


def _uninstall_locked() -> None:
    global _depth, _original
    _depth -= 1
    if _depth > 0:
        return
    original = _original
    # Modules imported while active hold the replacement too: restore every holder, and leave alone
    # any attribute someone else has changed since (it no longer holds our function).
    holders = {(id(m), a): (m, a) for m, a in _patched}
    for mod in _mlx_lm_modules():
        for attr, value in list(vars(mod).items()):
            if value is packed_scaled_dot_product_attention:
                holders[(id(mod), attr)] = (mod, attr)
    for mod, attr in holders.values():
        if getattr(mod, attr, None) is packed_scaled_dot_product_attention:
            setattr(mod, attr, original)
    _patched.clear()
    _original = None


def _drain() -> None:
    """Apply the releases finalizers queued; whoever gets the lock does (never blocks: finalizers call this)."""
    while _pending and _lock.acquire(blocking=False):
        try:
            while _pending:
                _pending.popleft()
                if _depth > 0:  # an extra explicit uninstall() may already have taken this count back
                    _uninstall_locked()
        finally:
            _lock.release()


def _release() -> None:
    _pending.append(None)
    _drain()


def hold_while_alive(obj) -> None:
    """`install` now and the matching `uninstall` when ``obj`` is garbage collected (``obj``: weakly referenceable).

    Explicit and reversible like `use_packed_attention`, scoped to an object's life instead of a block.
    """
    weakref.ref(obj)  # TypeError now, before counting, for an object that cannot be weakly referenced
    install()
    finalizer = weakref.finalize(obj, _release)
    finalizer.atexit = False  # nothing to restore in a process that is ending


@contextlib.contextmanager
def use_packed_attention():
    """``with use_packed_attention(): ...`` — `install` on entry, `uninstall` on exit (also on error)."""
    install()
    try:
        yield
    finally:
        uninstall()
