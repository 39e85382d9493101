"""Attention routing: mlx_lm's ``scaled_dot_product_attention`` sent to the caches' codes, reversibly.

Attention routing (`install` / `uninstall` / `use_packed_attention` / `hold_while_alive`): mlx_lm model files do
``from .base import scaled_dot_product_attention`` and call it with the layer's cache. `install()` replaces that
function (in ``mlx_lm.models.base`` and in every already-imported ``mlx_lm.*`` module holding it under any name) by
`packed_scaled_dot_product_attention`, which calls ``cache.attend_packed(queries, scale, mask[, sinks=...])`` when
the cache implements the protocol (:mod:`veloxquant_mlx.attention`) and the original function, unchanged,
otherwise. Modules imported while the routing is on pick the replacement up from ``base``; `uninstall()` restores
every attribute that still holds the replacement to exactly the original object. Nesting is counted (only the
outermost exit restores) and a lock guards the count, so ``with use_packed_attention():`` blocks may nest and raise
freely. While the count is positive :func:`veloxquant_mlx.attention.hook.is_active` is True, which is what lets the
caches return placeholders instead of decoding their history.

`hold_while_alive(obj)` is one more count that ends when ``obj`` is garbage collected: what `make_prompt_cache`
does for the caches it builds (``route_attention=True``, for models whose attention the routing reaches:
`attention_is_routable`), so they attend from their codes without a context manager, and the last of them to be
collected restores mlx_lm's function. Its release runs in a weakref finalizer, which may fire inside any
allocation, so it never waits for the lock: when the lock is taken it leaves the release to the thread holding it.

The routing's state (`_depth`, `_original`, `_signature`, `_patched`, `_lock`, `_pending`) lives in this module
only: the others read it here (``routing._depth``), never through a name imported into them, which would be a copy
that goes stale once this module rebinds it.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import sys
import threading
import weakref
from typing import Callable, List, Optional, Tuple

from mlx_lm.models import base as mlx_base

from veloxquant_mlx.attention import hook


_NAME = "scaled_dot_product_attention"
_lock = threading.Lock()  # not re-entrant: a finalizer on the holding thread must not get in (see `_drain`)
_depth = 0
_pending = collections.deque()  # releases of collected holders not yet applied (deque.append is atomic)
_original: Optional[Callable] = None  # mlx_lm.models.base's function when the routing went in
_signature: Optional[inspect.Signature] = None
_patched: List[Tuple[object, str]] = []  # (module, attribute) we set to the replacement
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

    While the routing is on: a packed cache's own placeholders -> ``cache.attend_packed``; another cache's
    placeholders (a layer reusing an earlier layer's keys and values, often with ``cache=None``) -> that cache's
    ``attend_packed``; placeholders changed on the way (the model computed on them) -> RuntimeError, never a silent
    wrong output; a protocol cache of another library -> its ``attend_packed``; anything else (real arrays, e.g.
    fetched decoded) -> the original.
    """
    original = _original
    if original is None:  # never installed: behave like mlx_lm itself
        original = getattr(mlx_base, _NAME)
        if original is packed_scaled_dot_product_attention:
            raise RuntimeError("packed attention routing state lost: base holds the replacement but no original")
    if hook.is_active():
        ours = getattr(type(cache), "owns_placeholders", False)
        pair = hook.placeholders_of(cache) if ours else None
        if pair is not None and pair[0] is keys and pair[1] is values:  # its own placeholders (checked first)
            owner = cache
        elif not ours and hook.implements_protocol(cache):  # a protocol cache of another library
            owner = cache
        else:
            # another layer's placeholders (a layer reusing an earlier layer's keys and values), or real arrays
            owner = hook.owner_of(keys)
            placeholders = owner is not None or hook.owner_of(values) is not None
            if owner is not None and hook.placeholders_of(owner)[1] is not values:
                owner = None  # keys and values of different origins (an MLA layer's k = v = latent): not ours
            if owner is None and (placeholders or (hook.implements_protocol(cache)
                                                   and getattr(cache, "_awaiting_attention", False))):
                raise RuntimeError(
                    "a packed cache handed out placeholder keys/values, but this model's attention got them changed "
                    "or mixed (it computes on the cache's keys/values before attention): the output would be wrong. "
                    "Build its caches with fetch_placeholders=False (veloxquant_mlx.make_prompt_cache does so for "
                    "the layer kinds it knows).")
        if owner is not None and hook.implements_protocol(owner):
            a = _fast_arguments(args, kwargs)
            if a is None:  # an unusual call: let the signature sort it out (and raise its usual errors)
                bound = _signature.bind(queries, keys, values, cache, *args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
            sinks = a.get("sinks")
            if sinks is None:
                return owner.attend_packed(queries, a["scale"], a["mask"])
            return owner.attend_packed(queries, a["scale"], a["mask"], sinks=sinks)
    return original(queries, keys, values, cache, *args, **kwargs)


def routes_model(model) -> bool:
    """Whether the routing currently reaches ``model``'s attention: its class's module holds the replacement.

    A model file that calls ``mx.fast.scaled_dot_product_attention`` itself (a few in mlx_lm 0.32) is not reached;
    `attention_is_routable` is the static check the builder uses.
    """
    mod = sys.modules.get(type(model).__module__)
    return hook.is_active() and getattr(mod, _NAME, None) is packed_scaled_dot_product_attention


def _mlx_lm_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))]


def install() -> None:
    """Turn the routing on (counted: each call needs one `uninstall`)."""
    global _depth, _original, _signature
    with _lock:
        if _depth == 0:
            original = getattr(mlx_base, _NAME)
            if original is packed_scaled_dot_product_attention:
                raise RuntimeError("mlx_lm.models.base already holds the packed attention replacement")
            _original, _signature = original, inspect.signature(original)
            _patched.clear()
            for mod in _mlx_lm_modules():
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, attr, packed_scaled_dot_product_attention)
                        _patched.append((mod, attr))
            hook.set_active(True)
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
    hook.set_active(False)
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
