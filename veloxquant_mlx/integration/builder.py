"""Building caches (`KVCacheBuilder`, `make_prompt_cache`)::

    import veloxquant_mlx as vq
    cache = vq.make_prompt_cache(model, method="turboquant_mse", k_bits=4, v_bits=3)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

The model's own cache layout decides what is replaced (``model.make_cache()`` when it has one, else one `KVCache`
per layer, or `RotatingKVCache(max_kv_size, keep=4)` as mlx_lm does): every `KVCache` becomes a
`TurboQuantPackedCache`, every `RotatingKVCache` a `TurboQuantRotatingPackedCache` with the same ``max_size`` /
``keep``, and anything else (SSM / `ArraysCache`, `ChunkedKVCache`, ...) is left to the model. `CacheList` entries
are converted inside.

`CACHE_KINDS` maps each mlx_lm cache class a model makes to its conversion (`register_cache_kind` adds one);
`cache_report` / `coverage_line` say what a cache list compressed and what it left plain.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx.attention import hook
from veloxquant_mlx.integration.calibration import Calibration
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.integration.measure_calibration import probe_key_rotations
from veloxquant_mlx.integration.routing import hold_while_alive
from veloxquant_mlx.integration.scan import (_model_modules, _reads_member_arrays, attention_is_routable,
                                             fetches_real_arrays, uniform_head_dim)
from veloxquant_mlx.cache.options import adapted_reason
from veloxquant_mlx.cache.presets import resolve_options
from veloxquant_mlx.quant.rope import frame_of
from veloxquant_mlx.validate import check_bool, check_int

# The cache classes this module builds and converts (the only imports of cache classes here); the classes known by
# name in prompt-cache files are `veloxquant_mlx.cache.registry.CACHE_CLASSES` (``integration.CACHE_CLASSES`` reads it).
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.cache.chunked import TurboQuantChunkedPackedCache
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache


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
        config / options: as `veloxquant_mlx.cache.presets.resolve_options`: a preset name, a `CacheOptions`, the seed
            pages' `KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) or None; keyword options (any `CacheOptions`
            field: ``kind``, ``method``, ``codec``, ``k_bits`` / ``v_bits`` (one int, or one per layer), ``sink``,
            ``recent``, ...) override it. Nothing at all: `veloxquant_mlx.cache.presets.DEFAULT`.

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

    def _calibrated(self, model, base: List[Any], per_layer: List[Any]) -> List[Any]:
        """Each layer's options with its channel weights from the calibration (checked against ``model`` once) and
        its key rotation where the options leave it open (`Calibration.key_rotation`, `_with_key_rotation`)."""
        cal = self.calibration
        if cal is None:
            return per_layer
        if self._checked is None or self._checked() is not model:
            cal.check_model(model)
            self._checked = weakref.ref(model)
        out = [dataclasses.replace(o, calibration_id=cal.id, channel_log2=cal.layer_log2(i))
               for i, o in enumerate(per_layer)]
        return [_with_key_rotation(o, cal.key_rotation(i) if _open_key_rotation(o) else None,
                                   type(base[i]) is mlx_cache.KVCache) for i, o in enumerate(out)]

    def _probed(self, model, base: List[Any], per_layer: List[Any]) -> List[Any]:
        """Without a calibration, each layer's key rotation where its options leave it open, from the model's own
        queries and keys on random token ids (`probe_key_rotations`, once per model); the layers it unrotates, or
        why it could not run, go to `notes`."""
        if self.calibration is not None or not any(_open_key_rotation(o) for o in per_layer):
            return per_layer
        choice, why = _probe(model, base)
        if choice is None:
            if why:
                self.notes.append(f"key-rotation probe failed ({why}): block keys keep the rotation")
            return per_layer
        if len(choice) != len(per_layer):
            return per_layer
        out = [_with_key_rotation(o, r, type(c) is mlx_cache.KVCache) for o, r, c in zip(per_layer, choice, base)]
        unrotated = [i for i, (o, r) in enumerate(zip(per_layer, choice)) if r is not None and _open_key_rotation(o)
                     and type(base[i]) is mlx_cache.KVCache]
        if unrotated:
            self.notes.append(f"key-rotation probe: the block keys of layer{'s' if len(unrotated) > 1 else ''} "
                              f"{', '.join(map(str, unrotated))} coded in the model's own channels, no rotation "
                              "(their queries read channels whose keys vary little)")
        return out

    def _with_rope(self, model, base: List[Any], per_layer: List[Any], head_dim: Optional[int]) -> List[Any]:
        """Layers with ``rope_offset`` get their RoPE as a `RopeFrame` (``key_rope``, read once per model); a
        sliding window (its slots are not positions) keeps post-RoPE codes, as documented; a layer whose RoPE cannot
        be read does too, and `notes` says which and why in one line."""
        if not any(o.kind == "packed" and o.rope_offset and o.key_rope is None for o in per_layer):
            return per_layer
        frames = _rope_frames(model, len(per_layer), head_dim)
        out, plain = [], {}
        for i, o in enumerate(per_layer):
            if not (o.kind == "packed" and o.rope_offset and o.key_rope is None):
                out.append(o)
                continue
            frame, why = frames[i]
            if type(base[i]) is not mlx_cache.KVCache:  # (a sliding window, a chunked layer: slots, not positions)
                out.append(dataclasses.replace(o, rope_offset=False))
                continue
            if frame is None:
                plain.setdefault(why, []).append(i)
                out.append(dataclasses.replace(o, rope_offset=False))
            else:
                out.append(dataclasses.replace(o, key_rope=(frame.dims, frame.traditional, frame.rates)))
        for why, layers in plain.items():
            self.notes.append(f"rope_offset: layer{'s' if len(layers) > 1 else ''} {_ranges(layers)} keep keys coded "
                              f"after RoPE without the offset ({why})")
        return out

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
        per_layer = self._calibrated(model, base, per_layer)
        self.notes = []  # how the layout was fitted to this head_dim (said by `enable`)
        per_layer = self._probed(model, base, per_layer)
        per_layer = self._with_rope(model, base, per_layer, head_dim)
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
        note = layer_kinds_note(caches)
        if note is not None:
            self.notes.append(note)
        if self.calibration is not None and self.options.key_rotation is None:
            unrotated = [i for i, c in enumerate(caches)
                         if getattr(getattr(c, "options", None), "key_rotation", None) == "none"]
            if unrotated:
                self.notes.append(f"calibration: the block keys of layer{'s' if len(unrotated) > 1 else ''} "
                                  f"{', '.join(map(str, unrotated))} coded in the model's own channels, no rotation "
                                  "(their queries read channels whose keys vary little)")
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


def _ranges(layers: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


# id(model) -> (weakref to it, [(RopeFrame or None, why)] per layer): RoPE read once per model (a server builds per
# request)
_ROPE_FRAMES: Dict[int, Tuple[Any, list]] = {}


def _rope_frames(model, n_layers: int, head_dim: Optional[int]) -> list:
    """Per layer ``(RopeFrame, "")`` of its attention's RoPE module (`veloxquant_mlx.quant.rope.frame_of`), or
    ``(None, why)``."""
    hit = _ROPE_FRAMES.get(id(model))
    if hit is not None and hit[0]() is model and len(hit[1]) == n_layers:
        return hit[1]
    layers = list(getattr(model, "layers", []))
    out = []
    for i in range(n_layers):
        if len(layers) != n_layers:
            out.append((None, "the model's caches do not map one to one onto its layers"))
            continue
        attn = next((getattr(layers[i], n) for n in ("self_attn", "attention", "attn") if hasattr(layers[i], n)),
                    None)
        rope = getattr(attn, "rope", None) if attn is not None else None
        dim = head_dim or getattr(attn, "head_dim", None)
        if rope is None or not isinstance(dim, int):
            out.append((None, "no RoPE module the builder can read"))
            continue
        out.append(frame_of(rope, dim))
    try:
        _ROPE_FRAMES[id(model)] = (weakref.ref(model), out)
    except TypeError:  # (a stand-in model that cannot be weakly referenced: read again next time)
        pass
    return out


def _open_key_rotation(options) -> bool:
    """Whether a layer's key rotation is left to the builder: packed, ``key_rotation`` unset, keys coded per channel
    over blocks, or per token by a layout naming the block layout its keys take in their own channels
    (``CHANNEL_LAYOUT``)."""
    if options.kind != "packed" or options.key_rotation is not None:
        return False
    keys = codec_layout(options.codec).keys
    return keys.BLOCKED or getattr(keys, "CHANNEL_LAYOUT", None) is not None


def _with_key_rotation(options, rotation: Optional[str], full_attention: bool):
    """``options`` with the key rotation chosen for its layer (None: unchanged). Block keys take it; a per-token
    layout's full-attention layer whose keys are better coded in their own channels (``"none"``: its queries read
    channels whose keys vary little, which a rotation drowns in the others) takes the layout's ``CHANNEL_LAYOUT``
    (codec, key block) with the keys unrotated; its sliding windows code per token whatever the choice."""
    if rotation is None or not _open_key_rotation(options):
        return options
    keys = codec_layout(options.codec).keys
    if keys.BLOCKED:
        return dataclasses.replace(options, key_rotation=rotation)
    if rotation != "none" or not full_attention:
        return options
    codec, block = keys.CHANNEL_LAYOUT
    return dataclasses.replace(options, codec=codec, group_size=block, key_rotation="none")


# id(model) -> (weakref to it, its probe result): one probe per model for every builder (a server builds per request)
_PROBES: Dict[int, Tuple[Any, Any]] = {}
# the layouts the probe can run on (it measures through plain caches, one per layer)
_PROBE_LAYOUTS = (mlx_cache.KVCache, mlx_cache.RotatingKVCache)


def _probe(model, base: List[Any]) -> Tuple[Optional[Tuple[Optional[str], ...]], str]:
    """``(probe_key_rotations(model), "")``, kept per model; ``(None, "")`` for a layout or attention it does not
    measure (hybrid, recurrent, unrouted: their caches keep the rotation), ``(None, why)`` where it failed."""
    entry = _PROBES.get(id(model))
    if entry is not None and entry[0]() is model:
        return entry[1]
    if not all(type(c) in _PROBE_LAYOUTS for c in base):
        result = (None, "")
    elif not attention_is_routable(model):
        result = (None, "")
    else:
        try:
            result = (probe_key_rotations(model), "")
        except Exception as e:  # a model the probe cannot run: its caches keep the rotation, and enable says why
            result = (None, f"{type(e).__name__}: {e}")
    try:
        ref = weakref.ref(model, lambda _, key=id(model): _PROBES.pop(key, None))
    except TypeError:  # (a stand-in model that cannot be weakly referenced: probe again next time)
        return result
    _PROBES[id(model)] = (ref, result)
    return result


def _full_attention(cache, options, placeholders: bool):
    """mlx_lm's ``KVCache`` -> a packed cache (or the seed's RVQ cache with ``kind="rvq"``)."""
    if options.kind == "rvq":
        return TurboQuantRVQKVCache(dataclasses.replace(options, method="turboquant_rvq").kv_config())
    return TurboQuantPackedCache(options, fetch_placeholders=placeholders)


def _window_options(options, keep: int, what: str, max_size: Optional[int] = None):
    """A window's options: a per-token layout (a window evicts single tokens), exact sink tokens only within
    ``keep`` (never evicted); a sliding window of at most ``options.short_window`` tokens (``max_size``) codes keys
    and values at no fewer than ``options.short_window_bits`` bits (its memory is bounded whatever the context); the
    newest ``options.window_recent`` tokens stay exact, and keys take at least ``options.window_k_bits`` bits."""
    if options.kind == "rvq":
        raise ValueError(f"kind='rvq' has no sliding-window variant; this model has {what} layers: use kind='packed'")
    changes = {"sink": min(options.sink, keep), "recent": max(options.recent, options.window_recent)}
    if max_size is not None and max_size <= options.short_window:
        floor = options.short_window_bits
        changes.update(k_bits=max(options.k_bits, floor), v_bits=max(options.value_bits, floor))
    if options.window_k_bits > changes.get("k_bits", options.k_bits):
        changes.update(k_bits=options.window_k_bits, v_bits=changes.get("v_bits", options.value_bits))
    if codec_layout(options.codec).keys.BLOCKED:  # block keys cannot be evicted a token at a time
        # a block codec's group_size is its key block in tokens, not a per-token group of coordinates; per-token
        # codes keep the rotation (key_rotation is the block keys')
        changes.update(codec="affine", group_size=None, key_rotation=None)
    allowed = codec_layout(changes.get("codec", options.codec)).keys.BITS
    if options.window_k_bits and changes.get("k_bits") == options.window_k_bits and options.window_k_bits not in allowed:
        raise ValueError(f"window_k_bits must be 0 or one of the {what} layers' key widths {tuple(allowed)}, got "
                         f"{options.window_k_bits}")
    return dataclasses.replace(options, **changes)


def _sliding_window(cache, options, placeholders: bool):
    """mlx_lm's ``RotatingKVCache`` -> a packed window of the same ``max_size`` / ``keep``."""
    return TurboQuantRotatingPackedCache(_window_options(options, cache.keep, "RotatingKVCache", cache.max_size),
                                         max_size=cache.max_size, keep=cache.keep, fetch_placeholders=placeholders)


def _chunked(cache, options, placeholders: bool):
    """mlx_lm's ``ChunkedKVCache`` (Llama 4's chunked attention) -> a packed one of the same ``chunk_size``."""
    return TurboQuantChunkedPackedCache(_window_options(options, 0, "ChunkedKVCache"), chunk_size=cache.chunk_size,
                                        fetch_placeholders=placeholders)


# The cache kinds: mlx_lm's cache class a model makes -> ``convert(cache, options, placeholders)`` giving ours.
# A new kind is one module (its cache class, a face over `veloxquant_mlx.cache.row_policy.Rows`, and its conversion)
# plus `register_cache_kind` (tests/integration/test_builder_new_cache_kind.py does exactly that).
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


def _layer_summary(cache) -> Optional[str]:
    """What one compressed layer does: its kind (window of N tokens / full attention), codec and bits."""
    o = getattr(cache, "options", None)
    if o is None or getattr(o, "kind", None) != "packed":
        return None
    size = getattr(cache, "max_size", None)
    kind = f"sliding window of {size} tokens" if size is not None else "full attention"
    codec = o.codec
    if o.head_dim is not None:  # the layout the codes take at this head_dim (`CacheOptions.for_dims`)
        try:
            codec = o.for_dims(o.head_dim, o.head_dim).codec
        except ValueError:
            pass
    recent = f", newest {o.recent} exact" if o.recent else ""
    return f"{kind}: codec {codec!r}, keys {o.k_bits} / values {o.value_bits} bits, sink {o.sink}{recent}"


def layer_kinds_note(caches) -> Optional[str]:
    """One line saying, per kind of layer, which layers do what, when not every layer does the same (a model with
    sliding-window layers: they code per token, and short windows at `CacheOptions.short_window_bits`); None
    when every compressed layer does the same."""
    groups: Dict[str, List[int]] = {}
    for i, c in enumerate(caches):
        what = _layer_summary(c)
        if what is not None:
            groups.setdefault(what, []).append(i)
    if len(groups) < 2:
        return None

    def layers(ix):
        return f"layer {ix[0]}" if len(ix) == 1 else f"{len(ix)} layers ({', '.join(map(str, ix))})"

    return "layers by kind: " + "; ".join(f"{layers(ix)}: {what}" for what, ix in groups.items())


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
