"""Everything that touches mlx_lm's behaviour, in one module: compressed caches for a model, attention routed to
their codes, their classes visible to mlx_lm's loader. Nothing is patched at import time.

Building caches (`KVCacheBuilder`, `make_prompt_cache`)::

    import veloxquant_mlx as vq
    cache = vq.make_prompt_cache(model, method="turboquant_mse", k_bits=4, v_bits=3)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

The model's own cache layout decides what is replaced (``model.make_cache()`` when it has one, else one `KVCache`
per layer, or `RotatingKVCache(max_kv_size, keep=4)` as mlx_lm does): every `KVCache` becomes a
`TurboQuantPackedCache`, every `RotatingKVCache` a `TurboQuantRotatingPackedCache` with the same ``max_size`` /
``keep``, and anything else (SSM / `ArraysCache`, `ChunkedKVCache`, ...) is left to the model. `CacheList` entries
are converted inside.

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

`enable(model)` / `disable(model)`: mlx_lm makes its caches with ``make_prompt_cache(model)``, which returns
``model.make_cache()`` when the model has one (`generate`, `stream_generate`, `batch_generate`, `BatchGenerator`,
``mlx_lm.server`` and ``cache_prompt`` all do). `enable` gives the model object (not its class) a ``make_cache``
that builds our caches, and while any model is enabled it keeps the attention routing installed and our cache
classes visible by name in ``mlx_lm.models.cache`` (`mlx_lm_cache_classes`: mlx_lm's own ``load_prompt_cache``
then reads files holding them). `disable` removes the model's ``make_cache`` (restoring one the instance had
before) and, with the last enabled model, both changes. Enabling twice is a no-op apart from the new options; a
model never enabled is untouched.
"""
from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import dis
import functools
import inspect
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.attention import hook
from veloxquant_mlx.calibration.file import Calibration
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.model_shape import head_dim as model_head_dim
from veloxquant_mlx.options import adapted_reason, resolve_options
from veloxquant_mlx.validate import check_bool, check_int

# The cache classes this module builds and converts (the only imports of cache classes here); the classes known by
# name in prompt-cache files are `veloxquant_mlx.cache.registry.CACHE_CLASSES` (``integration.CACHE_CLASSES`` reads it).
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.packed_cache import (TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache,
                                               TurboQuantPackedCache, TurboQuantRotatingPackedCache)
from veloxquant_mlx.cache.chunked import TurboQuantChunkedPackedCache
from veloxquant_mlx.cache.registry import mlx_lm_cache_classes
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

__all__ = [
    "CACHE_CLASSES", "attention_is_routable", "cache_report", "coverage_line", "disable", "enable",
    "enabled_options", "fetches_real_arrays", "hold_while_alive", "install", "is_enabled", "KVCacheBuilder",
    "latent_attention", "make_prompt_cache", "mlx_lm_cache_classes", "packed_scaled_dot_product_attention",
    "routes_model", "uniform_head_dim", "uninstall", "use_packed_attention",
]


# -- attention routing --------------------------------------------------------------------------------------------

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


# -- which models the routing reaches -----------------------------------------------------------------------------

def _code_objects(code):
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _code_objects(const)


@functools.lru_cache(maxsize=None)
def _calls_fast_sdpa_directly(module_name: str) -> bool:
    """Whether a model module's code reads ``<x>.fast.scaled_dot_product_attention`` (the routing cannot see it).

    Reads the compiled bytecode of every function in the module (not its source text, where comments and
    docstrings would count): an attribute load of ``fast`` followed by one of ``scaled_dot_product_attention``.
    """
    module = sys.modules.get(module_name)
    if module is None:
        return True  # unknown module: assume the worst, caches then decode as usual
    codes = []
    for value in vars(module).values():
        for fn in [value] + (list(vars(value).values()) if inspect.isclass(value) else []):
            fn = getattr(fn, "__func__", fn)
            if inspect.isfunction(fn) and fn.__module__ == module_name:
                codes.extend(_code_objects(fn.__code__))
    for code in codes:
        previous = None
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                if previous == "fast" and ins.argval == _NAME:
                    return True
                previous = ins.argval
            elif ins.opname not in ("CACHE", "EXTENDED_ARG"):
                previous = None
    return False


_SHAPE_ATTRIBUTES = ("shape", "dtype", "ndim", "size")


def _fetch_reads(func: ast.AST) -> bool:
    """Whether ``func`` (an ``ast.FunctionDef``) uses what ``... = <cache>.update_and_fetch(...)`` returned for
    anything but the keys / values of a ``scaled_dot_product_attention`` call, its shape, or its return value."""
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    for stmt in ast.walk(func):
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "update_and_fetch"):
            continue
        names = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        skip = set()  # the other branch of the ``if`` holding the fetch runs instead of it
        node = stmt
        while node in parents:
            parent = parents[node]
            if isinstance(parent, ast.If) and node in parent.body:
                skip.update(ast.walk(ast.Module(body=parent.orelse, type_ignores=[])))
            node = parent
        skip.update(ast.walk(stmt))  # (the fetch's own arguments and targets)
        for use in ast.walk(func):
            if not isinstance(use, ast.Name) or use.id not in names or use in skip or \
                    (use.lineno, use.col_offset) <= (stmt.lineno, stmt.col_offset):
                continue
            if isinstance(use.ctx, ast.Store):
                return True
            up = parents.get(use)
            while isinstance(up, ast.Tuple):
                up = parents.get(up)
            if isinstance(up, ast.keyword):
                up = parents.get(up)
            if isinstance(up, ast.Return):
                continue
            if isinstance(up, ast.Attribute) and up.attr in _SHAPE_ATTRIBUTES:
                continue
            callee = getattr(up, "func", None) if isinstance(up, ast.Call) else None
            name = getattr(callee, "attr", None) or getattr(callee, "id", None)
            if name == _NAME and use not in ast.walk(callee):
                continue
            return True
    return False


@functools.lru_cache(maxsize=None)
def reads_fetched_arrays(module_name: str) -> bool:
    """Whether a model module computes on what its caches' ``update_and_fetch`` returned before (or instead of)
    mlx_lm's ``scaled_dot_product_attention``: a dtype cast, ``mx.tile`` of the heads (plamo), an attention of its
    own (phi3small's block-sparse layers), an MLA latent. Its caches must then hand out real arrays. Read from the
    module's source (its syntax tree: comments do not count); a module without source counts as reading them."""
    module = sys.modules.get(module_name)
    try:
        tree = ast.parse(inspect.getsource(module))
    except (TypeError, OSError, SyntaxError):
        return True
    return any(_fetch_reads(f) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))


@functools.lru_cache(maxsize=None)
def _reads_member_arrays(module_name: str) -> bool:
    """Whether a model module reads the raw ``keys`` / ``values`` of a `CacheList` member past the first
    (``cache[1].keys``: the sparse-attention indexers of deepseek_v32, glm_moe_dsa, minimax_m3_vl)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules.get(module_name)))
    except (TypeError, OSError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("keys", "values") and \
                isinstance(node.value, ast.Subscript) and isinstance(node.value.slice, ast.Constant) and \
                isinstance(node.value.slice.value, int) and node.value.slice.value >= 1:
            return True
    return False


def _model_modules(model) -> set:
    names = {type(model).__module__}
    if callable(getattr(model, "modules", None)):
        names.update(type(m).__module__ for m in model.modules())
    return {n for n in names if n.startswith("mlx_lm.models.") and n not in ("mlx_lm.models.base",)}


def fetches_real_arrays(model) -> bool:
    """Whether ``model``'s caches must hand out their history as real arrays (decoded), not placeholders: an MLA
    model (`latent_attention`) or one whose code computes on the fetched keys / values (`reads_fetched_arrays`)."""
    return latent_attention(model) or any(reads_fetched_arrays(n) for n in _model_modules(model))


def attention_is_routable(model) -> bool:
    """Whether ``model``'s attention goes through mlx_lm's ``scaled_dot_product_attention`` everywhere.

    Static counterpart of `routes_model` (which needs the routing on): the mlx_lm model files of ``model`` and its
    submodules must hold that function (original or the replacement) and none may call
    ``mx.fast.scaled_dot_product_attention`` directly (deepseek_v41, muse_spark, plamo2 in mlx_lm 0.32). Only then
    may caches return placeholders to it.
    """
    names = _model_modules(model)
    # Under the lock: install / uninstall patch the modules one at a time, and a view taken half-way (base patched,
    # the model's file not yet) said "not routable", so another thread's caches were built without routing.
    with _lock:
        targets = (_original if _depth else getattr(mlx_base, _NAME, None), packed_scaled_dot_product_attention)
        holders = [n for n in names if getattr(sys.modules.get(n), _NAME, None) in targets]
    _drain()  # releases a finalizer queued while this thread held the lock
    return bool(holders) and not any(_calls_fast_sdpa_directly(n) for n in names)


def uniform_head_dim(model) -> Optional[int]:
    """The model's head_dim (`veloxquant_mlx.model_shape.head_dim`) when every layer's keys and values have it; None
    for per-layer head dims (Gemma 4's global layers), MLA latents, or a model that does not say."""
    d = model_head_dim(model)
    if d is None or fetches_real_arrays(model):
        return None
    modules = model.modules() if callable(getattr(model, "modules", None)) else []
    dims = {m.head_dim for m in modules if isinstance(getattr(m, "head_dim", None), int)}
    return d if dims <= {d} else None


def latent_attention(model) -> bool:
    """Whether ``model`` has MLA layers (DeepSeek V2/V3, Kimi, GLM-4 lite, ...: an attention module with a
    ``kv_lora_rank``): their caches hold a latent and a RoPE part from which the layer builds its keys and values,
    so the caches must hand out real arrays."""
    modules = model.modules() if callable(getattr(model, "modules", None)) else []
    return any(isinstance(getattr(m, "kv_lora_rank", None), int) for m in modules)


# -- our cache classes in mlx_lm's namespace: `mlx_lm_cache_classes` and the classes, in cache/registry.py ----------

def __getattr__(name: str):
    if name == "CACHE_CLASSES":  # read live: kinds registered later included
        return registry.CACHE_CLASSES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- building caches ----------------------------------------------------------------------------------------------

def _model_layout(model, max_kv_size: Optional[int]) -> List[Any]:
    """The caches mlx_lm's ``make_prompt_cache`` gives ``model``, ignoring a ``make_cache`` that `enable` put on
    the instance (ours: it would call back here) but honouring the class's own.

    ``max_kv_size`` turns every full-attention layer into a window of that size (``keep=4``, as mlx_lm does for
    models without ``make_cache``; mlx_lm ignores it for models with one, which would drop the user's limit
    without a word).
    """
    own = getattr(type(model), "make_cache", None)
    base = own(model) if own is not None else [mlx_cache.KVCache() for _ in range(len(model.layers))]
    if max_kv_size is None:
        return base
    return [mlx_cache.RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is mlx_cache.KVCache else c
            for c in base]


def _attends_from_codes(cache) -> bool:
    """Whether ``cache`` (or a `CacheList` entry of it) offers ``attend_packed``."""
    if isinstance(cache, mlx_cache.CacheList):
        return any(_attends_from_codes(c) for c in cache.caches)
    return hook.implements_protocol(cache)


class KVCacheBuilder:
    """Makes fresh compressed caches for a model from one `CacheOptions`.

    Args:
        config / options: as `veloxquant_mlx.options.resolve_options`: a preset name, a `CacheOptions`, the seed
            pages' `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) or None; keyword options (any `CacheOptions`
            field: ``kind``, ``method``, ``codec``, ``k_bits`` / ``v_bits`` (one int, or one per layer), ``sink``,
            ``recent``, ...) override it. Nothing at all: `veloxquant_mlx.options.DEFAULT`.

    `build` enables placeholder fetches (attention on codes inside ``use_packed_attention()``) only for
    models whose attention the routing reaches (`attention_is_routable`); other models' caches decode.
    Sliding-window layers get ``codec="affine"`` where a block layout is asked for (a window evicts single tokens).
    """

    def __init__(self, config=None, *, calibration=None, **options: Any):
        self.options = resolve_options(config, **options)
        if calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a veloxquant_mlx.Calibration (Calibration.load(path)) or None, got "
                            f"{type(calibration).__name__}")
        if calibration is not None and self.options.kind != "packed":
            raise ValueError("calibration applies to kind='packed' caches only")
        self.calibration = calibration
        self._checked = None  # weakref to the model the calibration was last checked against
        self._facts = None  # (weakref to a model, what `_model_facts` read of it): once per model, not per build

    @classmethod
    def for_model(cls, model, config=None, *, max_kv_size: Optional[int] = None, route_attention: bool = True,
                  calibration=None, **options) -> List[Any]:
        """Fresh caches for ``model`` (a new list of new caches on every call)."""
        return cls(config, calibration=calibration, **options).build(model, max_kv_size=max_kv_size,
                                                                       route_attention=route_attention)

    def _calibrated(self, model, per_layer: List[Any]) -> List[Any]:
        """Each layer's options with its channel weights from the calibration (checked against ``model`` once)."""
        cal = self.calibration
        if cal is None:
            return per_layer
        if self._checked is None or self._checked() is not model:
            cal.check_model(model)
            self._checked = weakref.ref(model)
        return [dataclasses.replace(o, calibration_id=cal.id, channel_log2=cal.layer_log2(i))
                for i, o in enumerate(per_layer)]

    def _model_facts(self, model) -> tuple:
        """``(uniform_head_dim, fetches_real_arrays, reads CacheList members raw)`` of ``model``: read from its
        modules and source once (~3 ms), then kept while the builder builds for the same model (every request of
        a server)."""
        if self._facts is not None and self._facts[0]() is model:
            return self._facts[1]
        facts = (uniform_head_dim(model), fetches_real_arrays(model),
                 any(_reads_member_arrays(n) for n in _model_modules(model)))
        try:
            self._facts = (weakref.ref(model), facts)
        except TypeError:  # (a stand-in model that cannot be weakly referenced: read again next time)
            self._facts = None
        return facts

    def build(self, model, max_kv_size: Optional[int] = None, route_attention: bool = True) -> List[Any]:
        """New caches for ``model``: its own layout, with attention caches replaced by compressed ones.

        ``route_attention``: keep mlx_lm's attention routed to the caches' codes while any of them is alive
        (`hold_while_alive`); only for models whose attention the routing reaches.
        """
        if not hasattr(model, "layers"):
            raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
        check_int("max_kv_size", max_kv_size, 1, optional=True)
        check_bool("route_attention", route_attention)
        base = _model_layout(model, max_kv_size)
        head_dim, real_arrays, raw_members = self._model_facts(model)
        n_layers = len(base)
        # a model without one head_dim (per-layer head dims, MLA latents): each cache reads its own at its first update
        per_layer = [self.options.for_layer(i, n_layers, head_dim) for i in range(n_layers)]  # validates first
        per_layer = self._calibrated(model, per_layer)
        self.notes = []  # how the layout was fitted to this head_dim (said by `enable`)
        if head_dim is not None:  # options no layout can take at this head_dim say so now, not at the first update
            for opts in {o.layer_options() for o in per_layer if o.kind == "packed"}:
                note = adapted_reason(opts, opts.for_dims(head_dim, head_dim), head_dim, head_dim)
                if note is not None and note not in self.notes:
                    self.notes.append(note)
        # MLA layers compute on the fetched latent before attention: they fetch decoded arrays
        placeholders = attention_is_routable(model) and not real_arrays
        # the members a model reads raw (indexer keys) stay mlx_lm's
        self._raw_members = raw_members
        caches = [self._convert(c, per_layer[i], placeholders) for i, c in enumerate(base)]
        if route_attention and placeholders:
            for cache in caches:
                if _attends_from_codes(cache):  # one count each, released when collected
                    hold_while_alive(cache)
        return caches

    def _convert(self, cache, options, placeholders: bool = True):
        if type(cache) is mlx_cache.CacheList:
            return mlx_cache.CacheList(*(c if i and getattr(self, "_raw_members", False) else
                                         self._convert(c, options, placeholders) for i, c in enumerate(cache.caches)))
        convert = CACHE_KINDS.get(type(cache))
        return cache if convert is None else convert(cache, options, placeholders)  # SSM / arrays: the model's own


def _full_attention(cache, options, placeholders: bool):
    """mlx_lm's ``KVCache`` -> a packed cache (or the seed's RVQ cache with ``kind="rvq"``)."""
    if options.kind == "rvq":
        return TurboQuantRVQKVCache(dataclasses.replace(options, method="turboquant_rvq").kv_config())
    return TurboQuantPackedCache(options, fetch_placeholders=placeholders)


def _window_options(options, keep: int, what: str):
    """A window's options: a per-token layout (a window evicts single tokens), exact sink tokens only within
    ``keep`` (never evicted)."""
    if options.kind == "rvq":
        raise ValueError(f"kind='rvq' has no sliding-window variant; this model has {what} layers: use kind='packed'")
    changes = {"sink": min(options.sink, keep)}
    if codec_layout(options.codec).keys.BLOCKED:  # block keys cannot be evicted a token at a time
        # a block codec's group_size is its key block in tokens, not a per-token group of coordinates
        changes.update(codec="affine", group_size=None)
    return dataclasses.replace(options, **changes)


def _sliding_window(cache, options, placeholders: bool):
    """mlx_lm's ``RotatingKVCache`` -> a packed window of the same ``max_size`` / ``keep``."""
    return TurboQuantRotatingPackedCache(_window_options(options, cache.keep, "RotatingKVCache"),
                                         max_size=cache.max_size, keep=cache.keep, fetch_placeholders=placeholders)


def _chunked(cache, options, placeholders: bool):
    """mlx_lm's ``ChunkedKVCache`` (Llama 4's chunked attention) -> a packed one of the same ``chunk_size``."""
    return TurboQuantChunkedPackedCache(_window_options(options, 0, "ChunkedKVCache"), chunk_size=cache.chunk_size,
                                        fetch_placeholders=placeholders)


# The cache kinds: mlx_lm's cache class a model makes -> ``convert(cache, options, placeholders)`` giving ours.
# A new kind is one module (its cache class, a face over `veloxquant_mlx.cache.rows.Rows`, and its conversion)
# plus `register_cache_kind` (tests/mlx_lm/test_new_cache_kind.py does exactly that).
CACHE_KINDS: Dict[type, Callable] = {mlx_cache.KVCache: _full_attention, mlx_cache.RotatingKVCache: _sliding_window,
                                     mlx_cache.ChunkedKVCache: _chunked}


def register_cache_kind(mlx_class: type, convert: Callable, *classes: type) -> None:
    """Build ``convert(cache, options, placeholders)`` for every ``mlx_class`` layer of a model, and know
    ``classes`` by name in prompt-cache files (`mlx_lm_cache_classes`, `load_prompt_cache`: the registry,
    `veloxquant_mlx.cache.registry`)."""
    if not isinstance(mlx_class, type) or not callable(convert):
        raise TypeError("register_cache_kind needs an mlx_lm cache class and a conversion function")
    CACHE_KINDS[mlx_class] = convert
    registry.register_cache_classes(*classes)


def make_prompt_cache(model, config=None, *, max_kv_size: Optional[int] = None, route_attention: bool = True,
                      calibration=None, **options) -> List[Any]:
    """One line: compressed caches for ``model`` (see `KVCacheBuilder` for the options) that attend from their
    codes for as long as they live (``route_attention``: `hold_while_alive`).

    ``max_kv_size`` gives every layer of a model without ``make_cache`` a sliding window of that size
    (``keep=4``), as ``mlx_lm.models.cache.make_prompt_cache`` does. ``route_attention=False`` builds caches that
    do not keep the routing on (they decode their history when fetched, unless something else routes attention
    meanwhile: `use_packed_attention`, `enable`, or other live caches built with routing).
    """
    return KVCacheBuilder.for_model(model, config, max_kv_size=max_kv_size, route_attention=route_attention,
                                    calibration=calibration, **options)


# -- what was compressed -----------------------------------------------------------------------------------------

# mlx_lm's caches that hold attention keys and values but no conversion exists for, and why
_PLAIN_REASONS: Dict[type, str] = {
    mlx_cache.ConcatenateKVCache: "a concatenating cache (ConcatenateKVCache) is not compressed",
    mlx_cache.QuantizedKVCache: "already mlx_lm's quantized cache",
    # (the only KVCache the builder leaves: a CacheList member the model reads raw, `_reads_member_arrays`)
    mlx_cache.KVCache: "a sparse-attention indexer's keys, which the model reads as raw arrays",
}


def cache_report(caches) -> List[Tuple[str, str]]:
    """What each entry of a cache list holds (`CacheList` entries flattened): ``("compressed", class name)``,
    ``("state", class name)`` for SSM / linear-attention state (nothing to compress), or ``("plain", reason)``
    for attention keys and values left uncompressed."""
    out: List[Tuple[str, str]] = []
    for c in caches:
        if isinstance(c, mlx_cache.CacheList):
            out.extend(cache_report(c.caches))
        elif isinstance(c, registry.CACHE_CLASSES):
            out.append(("compressed", type(c).__name__))
        elif isinstance(c, mlx_cache.ArraysCache):
            out.append(("state", type(c).__name__))
        else:
            reason = next((r for cls, r in _PLAIN_REASONS.items() if type(c) is cls), None)
            out.append(("plain", reason or f"{type(c).__name__} is a cache kind veloxquant does not know"))
    return out


def coverage_line(model, caches) -> Optional[str]:
    """One line when ``caches`` leave attention keys and values plain (or compress nothing); None when every
    attention cache is compressed."""
    report = cache_report(caches)
    plain = [what for kind, what in report if kind == "plain"]
    n = sum(kind == "compressed" for kind, _ in report)
    name = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None) or \
        type(model).__module__.rsplit(".", 1)[-1]
    if not plain and n:
        return None
    if not plain:
        return (f"veloxquant_mlx: {name} has no attention keys and values to compress (its {len(report)} caches "
                "hold recurrent state): its caches are mlx_lm's own")
    reasons = "; ".join(f"{plain.count(r)} x {r}" for r in dict.fromkeys(plain))
    return f"veloxquant_mlx: {name}: {n} attention caches compressed, {len(plain)} left plain ({reasons})"


# -- enable / disable ---------------------------------------------------------------------------------------------

_MISSING = object()
_enable_lock = threading.RLock()
_enabled: Dict[int, Dict[str, Any]] = {}  # id(model) -> {"model": weakref, "previous": instance make_cache}
_mlx_lm_names = contextlib.ExitStack()


def enable(model, config=None, *, calibration=None, **options):
    """Make every cache mlx_lm builds for ``model`` a compressed one, attended from its codes; returns ``model``.

    ``config`` / ``options``: as `make_prompt_cache` (a preset name, a `CacheOptions`, a `KVCacheConfig`, or
    keyword options); none given: `veloxquant_mlx.options.DEFAULT`. ``calibration``: a `Calibration` of this
    model (`veloxquant_mlx.calibrate`, `Calibration.load`): its channel weights in every layer's cache.
    """
    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
    builder = KVCacheBuilder(config, calibration=calibration, **options)
    line = coverage_line(model, builder.build(model))  # refuse bad options now, not at the first generate
    for text in ([line] if line is not None else []) + [f"veloxquant_mlx: {n}" for n in builder.notes]:
        warnings.warn(text, stacklevel=2)

    def make_cache():
        return builder.build(model)

    make_cache.veloxquant_options = builder.options  # what `enabled_options` reports
    with _enable_lock:
        entry = _enabled.get(id(model))
        if entry is None:
            entry = {"model": weakref.ref(model), "previous": vars(model).get("make_cache", _MISSING)}
            if not _enabled:
                install()
                _mlx_lm_names.enter_context(mlx_lm_cache_classes())
            _enabled[id(model)] = entry
        model.make_cache = make_cache
    return model


def disable(model):
    """Undo `enable` for ``model`` (a no-op for a model that is not enabled); returns ``model``."""
    with _enable_lock:
        entry = _enabled.pop(id(model), None)
        if entry is None:
            return model
        previous = entry["previous"]
        if previous is _MISSING:
            vars(model).pop("make_cache", None)
        else:
            model.make_cache = previous
        if not _enabled:
            _mlx_lm_names.close()
            uninstall()
    return model


def is_enabled(model) -> bool:
    with _enable_lock:
        entry = _enabled.get(id(model))
        return entry is not None and entry["model"]() is model


def enabled_options(model):
    """The `CacheOptions` an enabled model's caches are built with (ValueError if it is not enabled)."""
    if not is_enabled(model):
        raise ValueError("model is not enabled: call veloxquant_mlx.enable(model) first")
    return model.make_cache.veloxquant_options
