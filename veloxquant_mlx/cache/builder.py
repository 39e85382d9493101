"""`KVCacheBuilder` and `make_prompt_cache`: one line to give an mlx_lm model compressed caches.

    import veloxquant_mlx as vq
    cache = vq.make_prompt_cache(model, method="turboquant_mse", k_bits=4, v_bits=3)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

The model's own cache layout decides what is replaced (``model.make_cache()`` when it has one, else
one `KVCache` per layer, or `RotatingKVCache(max_kv_size, keep=4)` as mlx_lm does): every `KVCache`
becomes a `TurboQuantPackedCache`, every `RotatingKVCache` a `TurboQuantRotatingPackedCache` with the
same ``max_size`` / ``keep``, and anything else (SSM / `ArraysCache`, `ChunkedKVCache`, ...) is left to
the model. `CacheList` entries are converted inside.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any, List, Optional, Sequence, Union

from mlx_lm.models import cache as mlx_cache

Bits = Union[int, Sequence[int], None]
_KINDS = ("packed", "rvq")


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


@functools.lru_cache(maxsize=None)
def _calls_fast_sdpa_directly(module_name: str) -> bool:
    """Whether a model file calls ``mx.fast.scaled_dot_product_attention`` itself (the hook cannot see it)."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True  # unknown source: assume the worst, caches then decode as usual
    return "fast.scaled_dot_product_attention" in source


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


def _per_layer(name: str, bits: Bits, n_layers: int) -> Optional[List[int]]:
    if bits is None:
        return None
    if isinstance(bits, bool):
        raise TypeError(f"{name} must be an int or a list of ints, got bool")
    if isinstance(bits, int):
        return [bits] * n_layers
    bits = list(bits)
    if len(bits) != n_layers:
        raise ValueError(f"{name} has {len(bits)} entries, but the model has {n_layers} layers")
    for b in bits:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"{name} entries must be ints, got {type(b).__name__}")
    return bits


class KVCacheBuilder:
    """Makes fresh compressed caches for a model from one configuration.

    Args:
        config: base `KVCacheConfig` (default: ``KVCacheConfig()``); keyword arguments named like its
            fields (``method``, ``seed``, ``rotation``, ``n_outlier_channels``, ``outlier_bits``, ...) override it.
        kind: ``"packed"`` (keys and values compressed; sliding-window layers supported) or ``"rvq"``
            (the seed's `TurboQuantRVQKVCache`: RVQ keys, float16 values; full-attention layers only).
        k_bits / v_bits: key / value bits, one int or one per layer (a list as long as ``model.layers``).
        sink, recent, trim_headroom, center_keys, center_values, value_outliers, codec ("lloyd_max",
            "affine" or "affine_block"), group_size: see `TurboQuantPackedCache`. Sliding-window layers get
            ``codec="affine"`` where ``"affine_block"`` is asked for (a window evicts single tokens).

    `build` enables placeholder fetches (attention on codes inside ``use_packed_attention()``) only for
    models whose attention the hook can route (`attention_is_routable`); other models' caches decode.
    """

    def __init__(
        self,
        config=None,
        *,
        kind: str = "packed",
        k_bits: Bits = None,
        v_bits: Bits = None,
        sink: int = 0,
        recent: int = 0,
        trim_headroom: int = 8,
        center_keys: bool = True,
        center_values: bool = True,
        value_outliers: bool = False,
        codec: str = "lloyd_max",
        group_size: Optional[int] = None,
        **config_fields: Any,
    ):
        from veloxquant_mlx.config import KVCacheConfig

        if config is None:
            config = KVCacheConfig()
        elif not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig or None, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(KVCacheConfig)}
        unknown = sorted(set(config_fields) - names)
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown}; options are kind, k_bits, v_bits, sink, recent, trim_headroom, "
                f"center_keys, center_values, value_outliers, codec, group_size and the KVCacheConfig fields {sorted(names)}"
            )
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        self.config = dataclasses.replace(config, **config_fields) if config_fields else config
        self.kind = kind
        self.k_bits, self.v_bits = k_bits, v_bits
        self.cache_options = dict(
            sink=sink, recent=recent, trim_headroom=trim_headroom, center_keys=center_keys,
            center_values=center_values, value_outliers=value_outliers, codec=codec, group_size=group_size,
        )
        if kind == "rvq" and (v_bits is not None or sink or recent):
            raise ValueError("kind='rvq' keeps values in float16: v_bits, sink and recent do not apply")
        if kind == "rvq" and (codec != "lloyd_max" or group_size is not None):
            raise ValueError("kind='rvq' has its own RVQ key codec: codec and group_size do not apply")
        from veloxquant_mlx.cache.packed_cache import CODECS

        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")

    @classmethod
    def for_model(cls, model, config=None, *, max_kv_size: Optional[int] = None, **options) -> List[Any]:
        """Fresh caches for ``model`` (a new list of new caches on every call)."""
        return cls(config, **options).build(model, max_kv_size=max_kv_size)

    def layer_config(self, layer: int, n_layers: int, head_dim: Optional[int]):
        """The `KVCacheConfig` of layer ``layer`` (per-layer bits and the model's head_dim applied)."""
        changes = {}
        k_bits = _per_layer("k_bits", self.k_bits, n_layers)
        v_bits = _per_layer("v_bits", self.v_bits, n_layers)
        if k_bits is not None:
            changes["bit_width_inlier"] = k_bits[layer]
        if v_bits is not None:
            changes["v_bits"] = v_bits[layer]
        if head_dim is not None:
            if self.config.head_dim is not None and self.config.head_dim != head_dim:
                raise ValueError(
                    f"config.head_dim={self.config.head_dim}, but the model's attention head_dim is {head_dim}"
                )
            changes["head_dim"] = head_dim
        return dataclasses.replace(self.config, **changes) if changes else self.config

    def build(self, model, max_kv_size: Optional[int] = None) -> List[Any]:
        """New caches for ``model``: its own layout, with attention caches replaced by compressed ones."""
        if not hasattr(model, "layers"):
            raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
        base = mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
        n_layers, head_dim = len(base), _model_head_dim(model)
        # Validate per-layer lists once, against the model's layer count, before building anything.
        _per_layer("k_bits", self.k_bits, n_layers)
        _per_layer("v_bits", self.v_bits, n_layers)
        placeholders = attention_is_routable(model)
        return [self._convert(c, self.layer_config(i, n_layers, head_dim), placeholders) for i, c in enumerate(base)]

    def _convert(self, cache, config, placeholders: bool = True):
        from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
        from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache

        kind = type(cache)
        if kind is mlx_cache.KVCache:
            if self.kind == "rvq":
                return TurboQuantRVQKVCache(dataclasses.replace(config, method="turboquant_rvq"))
            return TurboQuantPackedCache(config, fetch_placeholders=placeholders, **self.cache_options)
        if kind is mlx_cache.RotatingKVCache:
            if self.kind == "rvq":
                raise ValueError(
                    "kind='rvq' has no sliding-window variant; this model has RotatingKVCache layers: use kind='packed'"
                )
            # Only tokens the window keeps forever (its ``keep`` prefix) can be exact sink tokens.
            options = dict(self.cache_options, sink=min(self.cache_options["sink"], cache.keep))
            if options["codec"] == "affine_block":  # block keys cannot be evicted a token at a time
                options["codec"] = "affine"
            return TurboQuantRotatingPackedCache(
                config, max_size=cache.max_size, keep=cache.keep, fetch_placeholders=placeholders, **options
            )
        if kind is mlx_cache.CacheList:
            return mlx_cache.CacheList(*(self._convert(c, config, placeholders) for c in cache.caches))
        return cache  # SSM / arrays / chunked caches stay the model's own


def make_prompt_cache(model, config=None, *, max_kv_size: Optional[int] = None, **options) -> List[Any]:
    """One line: compressed caches for ``model`` (see `KVCacheBuilder` for the options).

    ``max_kv_size`` gives every layer of a model without ``make_cache`` a sliding window of that size
    (``keep=4``), as ``mlx_lm.models.cache.make_prompt_cache`` does.
    """
    return KVCacheBuilder.for_model(model, config, max_kv_size=max_kv_size, **options)
