"""`CacheOptions`: the one frozen configuration of a servable compressed cache (its presets and THE default:
:mod:`veloxquant_mlx.cache.presets`).

Everything a user can set on a packed cache lives here, is checked here once (`__post_init__`), and is what
the builder, the caches, their saved state, the server, the CLI and the registry of named configurations
read. The seed pages' `KVCacheConfig` maps onto it at one edge, `CacheOptions.from_kv_config` (``bit_width_inlier``
is ``k_bits``), which `resolve_options` and the reader of old saved states call.

The words (docs/usage.md, "Words"): a *preset* is a name for a `CacheOptions`; ``kind`` is the cache class (packed /
rvq), ``codec`` the code layout, ``method`` the TurboQuant quantizer of the ``lloyd_max`` codec.

"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from veloxquant_mlx.quant.channel_weights import MAX_LOG2
from veloxquant_mlx.codecs import CODECS, codec_layout
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.quant.rope import RopeFrame
from veloxquant_mlx.quant.rotation import KEY_ROTATION_KINDS, ROTATION_KINDS as ROTATIONS
from veloxquant_mlx.validate import check_bool, check_choice, check_int, check_outlier_channels

KINDS = ("packed", "rvq")
# Each group of key channels (the outliers, the others) is rotated and coded as a vector: >= 2 channels each.
MIN_ROTATED_GROUP = 2
METHODS = ("turboquant_mse", "turboquant_prod", "turboquant_rvq")
Bits = Union[int, Tuple[int, ...]]


def _check_bits(name: str, value, allowed, optional: bool = False) -> Optional[Bits]:
    """One int, or one per layer (a tuple), each in ``allowed``."""
    if value is None and optional:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{name} must be an int or a non-empty list of ints (one per layer), got []")
        return tuple(_check_bits(f"{name}[{i}]", b, allowed) for i, b in enumerate(value))
    if isinstance(value, str) or not hasattr(value, "__index__") or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a list of ints (one per layer), got {type(value).__name__} "
                        f"({value!r})")
    b = check_int(name, value)
    if b not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)} with this codec, got {b}")
    return b


@dataclass(frozen=True)
class CacheOptions:
    """Options of a compressed cache (validated on construction; `dataclasses.replace` to change one).

    kind: "packed" (keys and values coded; sliding windows too) or "rvq" (the seed's `TurboQuantRVQKVCache`).
    method: the TurboQuant quantizer of the ``lloyd_max`` codec: turboquant_mse / turboquant_prod / turboquant_rvq.
    codec: a layout of `veloxquant_mlx.codecs.CODECS` (lloyd_max, affine, affine_block, float16).
    k_bits / v_bits: key / value bits (v_bits None = k_bits); an int, or a tuple with one per layer.
    sink: first tokens kept exact. recent: last tokens kept exact (a prompt chunk's queries each read their ``recent``
        newest keys exact: prefill attends as one-token decode steps would). trim_headroom: exact copies kept so that
        ``trim(n <= trim_headroom)`` leaves the last ``recent`` tokens exact.
    code_batch: per-token codecs without an exact window code their tokens this many at a time, counted from the
        first coded token (the newest up to ``code_batch - 1`` wait exact, as a block codec's incomplete block
        does); 1 codes every token on arrival. Coding a decode token costs a fixed ~0.6-0.8 ms per layer here
        whatever the batch (BENCHMARKS.md). Block codecs code whole blocks; exact windows code tokens as they leave.
    code_from: a row (sequence) codes nothing until it holds this many tokens, then codes them as it would have (0:
        from its first): a short chat attends exactly as mlx_lm's own cache, and the bits a layout promises hold from
        that length on. The budget presets: 128 (their block layouts kept a row exact until its first key block).
    center_keys / center_values: code ``x - mu`` with ``mu`` a per-head channel mean fitted on the first tokens.
    value_outliers: values get outlier channels too. n_outlier_channels / outlier_bits: key channels coded apart.
    group_size: affine group size (affine codecs; for affine_block also the key block in tokens).
    seed, rotation ("haar" / "hadamard"), jl_dim (QJL sketch length, turboquant_prod only).
    key_rotation: the keys' rotation where they are coded per channel over blocks of tokens (the block key codecs:
        affine_block, kblock_*), instead of ``rotation``: "haar", "hadamard" or "none" (the model's own channels);
        one value, or a tuple with one per layer; None = ``rotation``, except that the cache builder sets "none"
        on the layers a calibration (or, without one, its key-rotation probe on random token ids:
        `veloxquant_mlx.integration.measure_calibration.probe_key_rotations`) finds better unrotated; set it to
        skip both. A sliding window codes per token and keeps ``rotation``. Without a rotation each channel is
        coded within its own range over a block: better where the model's key channels differ in scale (Gemma 3's
        full-attention layers: uncalibrated tq-4b's KL on the Bible 0.0587 -> 0.0267 at 2048 tokens), worse where
        they do not (SmolLM2, where the probe flags no layer); see BENCHMARKS.md, issue 55.
    rope_offset: code each key minus its head's mean key before RoPE, rotated to the key's position (``k_t - R_t
        mu``), and add ``q . R_t mu`` back in attention: the mean a rotating RoPE pair carries is not spread into
        every token's codes (issue 54: most of what coding keys before RoPE gains, with the codes still after RoPE).
        ``mu`` is fitted per sequence on its first tokens after the sink. Full-attention layers of the block key
        layouts, without an exact window (``recent`` 0); needs the layer's RoPE (``key_rope``). True: required
        (a cache without ``key_rope`` refuses its first update); "auto": where the layer's RoPE is known (a cache
        built for a model), post-RoPE codes elsewhere (a cache built alone, a sliding window, an exact ``recent``
        window); False: never.
    key_rope: one layer's RoPE as a per-pair rotation, ``(dims, traditional, rates)``
        (`veloxquant_mlx.quant.rope.RopeFrame`): the builder reads it from the layer's RoPE module when
        ``rope_offset`` is set (a layer whose RoPE it cannot read keeps post-RoPE codes, and `enable` says so).
    head_dim: checked against the model's when set (the builder fills it in).
    short_window / short_window_bits: a sliding-window layer (mlx_lm's ``RotatingKVCache``) of at most
        ``short_window`` tokens codes its keys and values at no fewer than ``short_window_bits`` bits (0: no such
        rule). Such a layer holds that many tokens whatever the context, so its bits cost a bounded amount of memory
        while its error counts at every position (Gemma 3's 512-token window layers: BENCHMARKS.md, issue 55);
        full-attention layers are untouched.
    window_recent: a sliding-window (or chunked) layer keeps its newest ``window_recent`` tokens exact (at least
        ``recent``): local attention reads mostly its newest keys, so their error weighs most (Gemma 3's windows,
        BENCHMARKS.md, issue 55). Full-attention layers keep ``recent``.
    window_k_bits: a sliding-window (or chunked) layer codes its keys at no fewer than this many bits (0: ``k_bits``).
        A window's queries attend sharply to a few near keys, so its key error, not its values', carries its share
        of the KL (Gemma 3 at tq-4b: 8-bit window keys cut the KL 5x, 8-bit window values 1.2x); a window holds a
        bounded number of tokens, so the extra bits cost a bounded amount of memory.
    calibration_id / channel_log2: one layer's static channel weights from a `veloxquant_mlx.Calibration` (the
        builder fills them in from ``calibration=``): ``channel_log2`` = (keys, values), each ``heads`` tuples of
        ``head_dim`` ints in [-3, 3]; keys and values are stored times ``2**channel_log2`` (exact in floating point),
        queries divided by the key weights and outputs by the value weights (`veloxquant_mlx.quant.channel_weights`).
    """

    kind: str = "packed"
    method: str = "turboquant_mse"
    codec: str = "lloyd_max"
    k_bits: Bits = 4
    v_bits: Optional[Bits] = None
    sink: int = 0
    recent: int = 0
    trim_headroom: int = 8
    code_batch: int = 16
    code_from: int = 0
    center_keys: bool = True
    center_values: bool = True
    value_outliers: bool = False
    group_size: Optional[int] = None
    seed: int = 0
    rotation: str = "haar"
    jl_dim: Optional[int] = None
    n_outlier_channels: int = 0
    outlier_bits: int = 8
    head_dim: Optional[int] = None
    short_window: int = 0
    short_window_bits: int = 8
    window_recent: int = 0
    window_k_bits: int = 0
    key_rotation: Union[None, str, Tuple[str, ...]] = None
    rope_offset: Union[bool, str] = False
    key_rope: Optional[tuple] = dataclasses.field(default=None, repr=False)
    calibration_id: Optional[str] = None
    channel_log2: Optional[Tuple[Tuple[Tuple[int, ...], ...], Tuple[Tuple[int, ...], ...]]] = \
        dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen: normalize in place
        check_choice("kind", self.kind, KINDS)
        check_choice("method", self.method, METHODS)
        layout = codec_layout(self.codec)
        set_("k_bits", _check_bits("k_bits", self.k_bits, layout.keys.BITS))
        set_("v_bits", _check_bits("v_bits", self.v_bits, layout.values.BITS, optional=True))
        for name, lo in (("sink", 0), ("recent", 0), ("trim_headroom", 0), ("seed", 0), ("n_outlier_channels", 0),
                         ("short_window", 0), ("window_recent", 0)):
            set_(name, check_int(name, getattr(self, name), lo))
        set_("outlier_bits", check_int("outlier_bits", self.outlier_bits, 1, 8))
        set_("short_window_bits", check_int("short_window_bits", self.short_window_bits, 1, 8))
        set_("window_k_bits", check_int("window_k_bits", self.window_k_bits, 0, 8))
        set_("code_batch", check_int("code_batch", self.code_batch, 1, 4096))
        set_("code_from", check_int("code_from", self.code_from, 0))
        set_("jl_dim", check_int("jl_dim", self.jl_dim, 1, optional=True))
        set_("head_dim", check_int("head_dim", self.head_dim, 1, optional=True))
        for name in ("center_keys", "center_values", "value_outliers"):
            set_(name, check_bool(name, getattr(self, name)))
        if not (isinstance(self.rope_offset, bool) or self.rope_offset == "auto"):
            raise ValueError(f"rope_offset must be True, False or 'auto', got {self.rope_offset!r}")
        check_choice("rotation", self.rotation, ROTATIONS)
        set_("key_rotation", self._checked_key_rotation(layout))
        self._check_codec_options(layout)
        self._check_rope_offset(layout)
        self._check_channel_weights()
        if self.kind == "rvq" and (self.v_bits is not None or self.sink or self.recent or self.codec != "lloyd_max"
                                   or self.group_size is not None):
            raise ValueError("kind='rvq' keeps values in float16 and has its own RVQ key codec: v_bits, sink, recent, "
                             "codec and group_size do not apply")

    def _checked_key_rotation(self, layout):
        """``key_rotation``: None, one of `KEY_ROTATION_KINDS`, or one per layer (a tuple, normalised from a list);
        only for a layout whose keys are coded per channel over blocks."""
        value = self.key_rotation
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("key_rotation must be a str or a non-empty list of str (one per layer), got []")
            value = tuple(check_choice(f"key_rotation[{i}]", v, KEY_ROTATION_KINDS) for i, v in enumerate(value))
        else:
            check_choice("key_rotation", value, KEY_ROTATION_KINDS)
        if not layout.keys.BLOCKED:
            blocked = tuple(n for n, lay in CODECS.items() if lay.keys.BLOCKED)
            raise ValueError(f"key_rotation applies to the codecs that code keys per channel over blocks {blocked}, "
                             f"not codec={self.codec!r}: set key_rotation=None (rotation= sets both)")
        return value

    def _check_channel_weights(self) -> None:
        """``calibration_id`` (a str) and ``channel_log2`` (nested tuples, normalised from lists) come together."""
        if (self.calibration_id is None) != (self.channel_log2 is None):
            raise ValueError("calibration_id and channel_log2 come together (the builder sets both from "
                             "calibration=...): set both or neither")
        if self.channel_log2 is None:
            return
        if not isinstance(self.calibration_id, str) or not self.calibration_id:
            raise TypeError(f"calibration_id must be a non-empty str, got {self.calibration_id!r}")
        if self.kind != "packed":
            raise ValueError("channel weights (calibration=...) apply to kind='packed' only")
        w = self.channel_log2
        try:
            norm = tuple(tuple(tuple(int(e) for e in head) for head in side) for side in w)
            ok = (len(norm) == 2 and all(norm[i] for i in (0, 1)) and len(norm[0]) == len(norm[1])
                  and len({len(h) for side in norm for h in side}) == 1
                  and all(isinstance(e, int) and not isinstance(e, bool) and abs(e) <= MAX_LOG2
                          for side in w for head in side for e in head))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"channel_log2 must be (keys, values): each a tuple of heads, each a tuple of head_dim "
                             f"ints in [-{MAX_LOG2}, {MAX_LOG2}], as veloxquant_mlx.Calibration makes them")
        d = len(norm[0][0])
        if self.head_dim is not None and d != self.head_dim:
            raise ValueError(f"channel_log2 holds {d} channels per head, but head_dim={self.head_dim}")
        object.__setattr__(self, "channel_log2", norm)

    def _check_rope_offset(self, layout) -> None:
        """``rope_offset`` on a layout whose key codec carries the fitted mean, without an exact window; ``key_rope``
        None or a `RopeFrame` (normalised to a tuple ``(dims, traditional, rates)``)."""
        if self.key_rope is not None:
            try:
                frame = RopeFrame.from_list(self.key_rope)
            except (TypeError, ValueError) as e:
                raise ValueError(f"key_rope: {e}") from None
            if self.head_dim is not None and frame.dims > self.head_dim:
                raise ValueError(f"key_rope rotates {frame.dims} dims, more than head_dim={self.head_dim}")
            object.__setattr__(self, "key_rope", (frame.dims, frame.traditional, frame.rates))
        if not self.rope_offset:
            return
        if self.kind != "packed" or not getattr(layout.keys, "ROPE_OFFSET", False):
            able = sorted(n for n, lay in CODECS.items() if getattr(lay.keys, "ROPE_OFFSET", False))
            raise ValueError(f"rope_offset applies to kind='packed' with a codec of {able}, not kind={self.kind!r} "
                             f"codec={self.codec!r}")
        if self.recent and self.rope_offset is True:  # ("auto": not where an exact window is asked for)
            raise ValueError("rope_offset keeps no exact window: set recent=0 (or rope_offset=False)")

    def _check_codec_options(self, layout) -> None:
        classes = (layout.keys, layout.values)
        if self.group_size is not None:
            gs = check_int("group_size", self.group_size)
            if any(c.GROUP_SIZES is None for c in classes):
                raise ValueError(f"group_size applies only to the affine codecs, not codec={self.codec!r}")
            if gs not in layout.keys.GROUP_SIZES:
                raise ValueError(f"group_size must be None or one of {layout.keys.GROUP_SIZES}, got {gs}")
        if self.n_outlier_channels or self.value_outliers:
            if not layout.keys.OUTLIERS:
                raise ValueError(f"codec={self.codec!r} has no outlier channels: set n_outlier_channels=0 and "
                                 "value_outliers=False")
            check_outlier_channels("n_outlier_channels", self.n_outlier_channels, self.head_dim,
                                   min_group=MIN_ROTATED_GROUP)
        if self.jl_dim is not None and self.method != "turboquant_prod":
            raise ValueError(f"jl_dim (the QJL sketch length) applies only to method='turboquant_prod', got "
                             f"method={self.method!r}")

    # -- views --------------------------------------------------------------------------------------
    @property
    def value_bits(self) -> Bits:
        return self.k_bits if self.v_bits is None else self.v_bits

    def for_layer(self, layer: int, n_layers: int, head_dim: Optional[int] = None) -> "CacheOptions":
        """The options of layer ``layer``: per-layer bits picked, the model's head_dim filled in."""
        changes: Dict[str, Any] = {}
        for name in ("k_bits", "v_bits", "key_rotation"):
            per = getattr(self, name)  # (key_rope is one layer's: the builder sets it per layer)
            if isinstance(per, tuple):
                if len(per) != n_layers:
                    raise ValueError(f"{name} has {len(per)} entries, but the model has {n_layers} layers")
                changes[name] = per[layer]
        if head_dim is not None:
            if self.head_dim is not None and self.head_dim != head_dim:
                raise ValueError(f"head_dim={self.head_dim}, but the model's attention head_dim is {head_dim}")
            changes["head_dim"] = head_dim
        return dataclasses.replace(self, **changes) if changes else self

    def for_dims(self, k_dim: int, v_dim: int) -> "CacheOptions":
        """These (one layer's) options for keys / values of head dims ``k_dim`` / ``v_dim``: unchanged when the
        codec's layout takes them; else the layout's default group size; else Lloyd-Max codes at the same bits,
        which take any head_dim (`adapted_reason` says why). ValueError when nothing fits."""
        return _for_dims(self.layer_options(), int(k_dim), int(v_dim))

    def layer_options(self) -> "CacheOptions":
        """These options as one layer's (v_bits resolved); ValueError if bits are still per layer."""
        if any(isinstance(getattr(self, n), tuple) for n in ("k_bits", "v_bits", "key_rotation")):
            raise ValueError("k_bits / v_bits / key_rotation hold one value per layer: build caches with "
                             "make_prompt_cache(model, ...) or pick a layer with options.for_layer(i, n_layers)")
        return self if self.v_bits is not None else dataclasses.replace(self, v_bits=self.k_bits)

    def to_dict(self) -> Dict[str, Any]:
        out = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
               for f in dataclasses.fields(self)}
        if self.key_rope is not None:
            out["key_rope"] = RopeFrame.from_list(self.key_rope).to_list()
        return out

    @property
    def rope_frame(self) -> Optional[RopeFrame]:
        """The `RopeFrame` of ``key_rope`` when ``rope_offset`` is set, else None."""
        on = self.rope_offset is True or (self.rope_offset == "auto" and not self.recent)
        return RopeFrame.from_list(self.key_rope) if on and self.key_rope is not None else None

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "CacheOptions":
        if not isinstance(data, dict):
            raise TypeError(f"options must be a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; options are {list(cls.field_names())}")
        return cls(**data)

    @staticmethod
    def field_names() -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(CacheOptions))

    # -- the seed pages' KVCacheConfig ------------------------------------------------------------
    _KV_FIELDS = ("method", "head_dim", "seed", "rotation", "jl_dim", "n_outlier_channels", "outlier_bits")

    @classmethod
    def from_kv_config(cls, config, **options) -> "CacheOptions":
        """`KVCacheConfig` (``bit_width_inlier`` = ``k_bits``) plus cache options -> `CacheOptions`."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        base = {name: getattr(config, name) for name in cls._KV_FIELDS}
        if config.method == "turboquant_mse" and config.jl_dim is not None:
            base["jl_dim"] = None  # the seed's cache reads jl_dim for any method; it has no effect on MSE
        base.update(k_bits=config.bit_width_inlier, v_bits=config.v_bits)
        return cls.from_dict({**base, **options})

    def kv_config(self):
        """The `KVCacheConfig` these options correspond to (what the seed's classes and saved states read)."""
        if isinstance(self.k_bits, tuple) or isinstance(self.v_bits, tuple):
            raise ValueError("kv_config() describes one layer: these options hold per-layer bits")
        return KVCacheConfig(bit_width_inlier=self.k_bits, v_bits=self.v_bits,
                             **{name: getattr(self, name) for name in self._KV_FIELDS})


def _fits(options: "CacheOptions", k_dim: int, v_dim: int) -> Optional[str]:
    """None when ``options``' layout codes keys of ``k_dim`` and values of ``v_dim`` coordinates, else why not."""
    layout = codec_layout(options.codec)
    try:
        layout.keys.from_options(options, "keys", k_dim)
        layout.values.from_options(options, "values", v_dim)
    except ValueError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=512)
def _for_dims(options: "CacheOptions", k_dim: int, v_dim: int) -> "CacheOptions":
    why = _fits(options, k_dim, v_dim)
    if why is None:
        return options
    candidates = []
    if options.group_size is not None:
        candidates.append(dataclasses.replace(options, group_size=None))
    bits = codec_layout("lloyd_max").keys.BITS
    if options.k_bits in bits and options.value_bits in bits:
        method = options.method if options.method in ("turboquant_mse", "turboquant_prod") else "turboquant_mse"
        try:
            candidates.append(dataclasses.replace(options, codec="lloyd_max", method=method, group_size=None,
                                                  jl_dim=options.jl_dim if method == "turboquant_prod" else None,
                                                  key_rotation=None, rope_offset=False, key_rope=None))
        except ValueError:
            pass
    for candidate in candidates:
        if _fits(candidate, k_dim, v_dim) is None:
            return candidate
    raise ValueError(f"codec={options.codec!r} cannot code keys / values of head dims {k_dim} / {v_dim} ({why}), "
                     "and no other layout at the same bits can")


def adapted_reason(options: "CacheOptions", adapted: "CacheOptions", k_dim: int, v_dim: int) -> Optional[str]:
    """One line saying how `CacheOptions.for_dims` changed ``options`` for these head dims (None: unchanged)."""
    if adapted == options:
        return None
    dims = f"head_dim {k_dim}" if k_dim == v_dim else f"key / value dims {k_dim} / {v_dim}"
    if adapted.codec != options.codec:
        return f"{dims}: codec {options.codec!r} cannot take it, coded with 'lloyd_max' at the same bits"
    return f"{dims}: group_size {options.group_size} does not divide it, the layout's default used"
