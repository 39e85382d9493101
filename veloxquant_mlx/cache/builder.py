"""`KVCacheBuilder` and `make_prompt_cache`: one line to give an mlx_lm model compressed caches.

    import veloxquant_mlx as vq
    cache = vq.make_prompt_cache(model, method="turboquant_mse", k_bits=4, v_bits=3)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

The model's own cache layout decides what is replaced (``model.make_cache()`` when it has one, else
one `KVCache` per layer, or `RotatingKVCache(max_kv_size, keep=4)` as mlx_lm does): every `KVCache`
becomes a `TurboQuantPackedCache`, every `RotatingKVCache` a `TurboQuantRotatingPackedCache` with the
same ``max_size`` / ``keep``, and anything else (SSM / `ArraysCache`, `ChunkedKVCache`, ...) is left to
the model. `CacheList` entries are converted inside.

Attention on codes without a context manager: while any cache built here for a model whose attention the hook
can route is alive, mlx_lm's ``scaled_dot_product_attention`` is routed (:mod:`veloxquant_mlx.attention.hook`,
`hook.hold_while_alive`): our caches attend from their codes, every other cache gets mlx_lm's function
unchanged, and the last of our caches to be garbage collected restores it. ``route_attention=False`` builds
caches that do not keep the routing in place (they decode their history when fetched, unless something else
routes attention meanwhile: ``use_packed_attention()``, `enable`, or other live caches built with routing).
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import sys
from typing import Any, List, Optional

from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.validate import check_bool, check_int


def _model_head_dim(model) -> Optional[int]:
    """head_dim from ``model.args`` (explicit ``head_dim``, else hidden_size // num_attention_heads)."""
    args = getattr(model, "args", None)
    if args is None:
        return None
    head_dim = getattr(args, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _code_objects(const)


@functools.lru_cache(maxsize=None)
def _calls_fast_sdpa_directly(module_name: str) -> bool:
    """Whether a model module's code reads ``<x>.fast.scaled_dot_product_attention`` (the hook cannot see it).

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
                if previous == "fast" and ins.argval == "scaled_dot_product_attention":
                    return True
                previous = ins.argval
            elif ins.opname not in ("CACHE", "EXTENDED_ARG"):
                previous = None
    return False


def attention_is_routable(model) -> bool:
    """Whether ``model``'s attention goes through mlx_lm's ``scaled_dot_product_attention`` everywhere.

    Static counterpart of `veloxquant_mlx.attention.routes_model` (which needs the hook active): the
    mlx_lm model files of ``model`` and its submodules must hold that function (original or the hook's
    replacement) and none may call ``mx.fast.scaled_dot_product_attention`` directly (deepseek_v41,
    muse_spark, plamo2 in mlx_lm 0.32). Only then may caches return placeholders to it.
    """
    from mlx_lm.models import base

    from veloxquant_mlx.attention import hook

    targets = (getattr(base, "scaled_dot_product_attention", None), hook.packed_scaled_dot_product_attention)
    names = {type(model).__module__}
    if callable(getattr(model, "modules", None)):
        names.update(type(m).__module__ for m in model.modules())
    names = {n for n in names if n.startswith("mlx_lm.models.") and n not in ("mlx_lm.models.base",)}
    holders = [n for n in names if getattr(sys.modules.get(n), "scaled_dot_product_attention", None) in targets]
    return bool(holders) and not any(_calls_fast_sdpa_directly(n) for n in names)


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
    """Whether ``cache`` (or a `CacheList` entry of it) offers the hook's ``attend_packed``."""
    from veloxquant_mlx.attention import hook

    if isinstance(cache, mlx_cache.CacheList):
        return any(_attends_from_codes(c) for c in cache.caches)
    return hook.implements_protocol(cache)


class KVCacheBuilder:
    """Makes fresh compressed caches for a model from one `CacheOptions`.

    Args:
        config: a `CacheOptions`, the seed pages' `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) or None;
            keyword options (any `CacheOptions` field: ``kind``, ``method``, ``codec``, ``k_bits`` / ``v_bits``
            (one int, or one per layer), ``sink``, ``recent``, ...) override it.

    `build` enables placeholder fetches (attention on codes inside ``use_packed_attention()``) only for
    models whose attention the hook can route (`attention_is_routable`); other models' caches decode.
    Sliding-window layers get ``codec="affine"`` where a block layout is asked for (a window evicts single tokens).
    """

    def __init__(self, config=None, **options: Any):
        from veloxquant_mlx.cache.packed_cache import resolve_options

        if isinstance(options.get("k_bits"), list) or isinstance(options.get("v_bits"), list):
            options = {k: tuple(v) if k in ("k_bits", "v_bits") and isinstance(v, list) else v
                       for k, v in options.items()}
        self.options = resolve_options(config, **options)

    @classmethod
    def for_model(cls, model, config=None, *, max_kv_size: Optional[int] = None, route_attention: bool = True,
                  **options) -> List[Any]:
        """Fresh caches for ``model`` (a new list of new caches on every call)."""
        return cls(config, **options).build(model, max_kv_size=max_kv_size, route_attention=route_attention)

    def build(self, model, max_kv_size: Optional[int] = None, route_attention: bool = True) -> List[Any]:
        """New caches for ``model``: its own layout, with attention caches replaced by compressed ones.

        ``route_attention``: keep mlx_lm's attention routed to the caches' codes while any of them is alive (see
        the module docstring); only for models whose attention the hook can route.
        """
        if not hasattr(model, "layers"):
            raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
        check_int("max_kv_size", max_kv_size, 1, optional=True)
        check_bool("route_attention", route_attention)
        base = _model_layout(model, max_kv_size)
        n_layers, head_dim = len(base), _model_head_dim(model)
        per_layer = [self.options.for_layer(i, n_layers, head_dim) for i in range(n_layers)]  # validates first
        if head_dim is not None:  # a codec that cannot take this head_dim says so now, not at the first update
            from veloxquant_mlx.codecs import codec_layout

            for opts in {o.layer_options() for o in per_layer if o.kind == "packed"}:
                codec_layout(opts.codec).keys.from_options(opts, "keys", head_dim)
        placeholders = attention_is_routable(model)
        caches = [self._convert(c, per_layer[i], placeholders) for i, c in enumerate(base)]
        if route_attention and placeholders:
            from veloxquant_mlx.attention import hook

            for cache in caches:
                if _attends_from_codes(cache):  # one count each, released when collected
                    hook.hold_while_alive(cache)
        return caches

    def _convert(self, cache, options, placeholders: bool = True):
        from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
        from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
        from veloxquant_mlx.codecs import codec_layout

        kind = type(cache)
        if kind is mlx_cache.KVCache:
            if options.kind == "rvq":
                return TurboQuantRVQKVCache(dataclasses.replace(options, method="turboquant_rvq").kv_config())
            return TurboQuantPackedCache(options, fetch_placeholders=placeholders)
        if kind is mlx_cache.RotatingKVCache:
            if options.kind == "rvq":
                raise ValueError(
                    "kind='rvq' has no sliding-window variant; this model has RotatingKVCache layers: use kind='packed'")
            # Only tokens the window keeps forever (its ``keep`` prefix) can be exact sink tokens.
            changes = {"sink": min(options.sink, cache.keep)}
            if codec_layout(options.codec).keys.BLOCKED:  # block keys cannot be evicted a token at a time
                # a block codec's group_size is its key block in tokens, not a per-token group of coordinates
                changes.update(codec="affine", group_size=None)
            return TurboQuantRotatingPackedCache(dataclasses.replace(options, **changes), max_size=cache.max_size,
                                                 keep=cache.keep, fetch_placeholders=placeholders)
        if kind is mlx_cache.CacheList:
            return mlx_cache.CacheList(*(self._convert(c, options, placeholders) for c in cache.caches))
        return cache  # SSM / arrays / chunked caches stay the model's own


def make_prompt_cache(model, config=None, *, max_kv_size: Optional[int] = None, route_attention: bool = True,
                      **options) -> List[Any]:
    """One line: compressed caches for ``model`` (see `KVCacheBuilder` for the options) that attend from their
    codes for as long as they live (``route_attention``, the module docstring).

    ``max_kv_size`` gives every layer of a model without ``make_cache`` a sliding window of that size
    (``keep=4``), as ``mlx_lm.models.cache.make_prompt_cache`` does.
    """
    return KVCacheBuilder.for_model(model, config, max_kv_size=max_kv_size, route_attention=route_attention,
                                    **options)
