"""`CacheOptions`: the one frozen configuration of a servable compressed cache.

Everything a user can set on a packed cache lives here, is checked here once (`__post_init__`), and is what
the builder, the caches, their saved state, the server, the CLI and the registry of named configurations
read. The seed pages' `KVCacheConfig` maps onto it at the boundary (`from_kv_config`:
``bit_width_inlier`` is ``k_bits``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from veloxquant_mlx.rotation import ROTATION_KINDS as ROTATIONS
from veloxquant_mlx.validate import check_bool, check_choice, check_int

KINDS = ("packed", "rvq")
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
    sink: first tokens kept exact. recent: last tokens kept exact. trim_headroom: exact copies kept so that
        ``trim(n <= trim_headroom)`` leaves the last ``recent`` tokens exact.
    center_keys / center_values: code ``x - mu`` with ``mu`` a per-head channel mean fitted on the first tokens.
    value_outliers: values get outlier channels too. n_outlier_channels / outlier_bits: key channels coded apart.
    group_size: affine group size (affine codecs; for affine_block also the key block in tokens).
    seed, rotation ("haar" / "hadamard"), jl_dim (QJL sketch length, turboquant_prod only).
    head_dim: checked against the model's when set (the builder fills it in).
    """

    kind: str = "packed"
    method: str = "turboquant_mse"
    codec: str = "lloyd_max"
    k_bits: Bits = 4
    v_bits: Optional[Bits] = None
    sink: int = 0
    recent: int = 0
    trim_headroom: int = 8
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

    def __post_init__(self):
        from veloxquant_mlx.codecs import codec_layout

        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen: normalize in place
        check_choice("kind", self.kind, KINDS)
        check_choice("method", self.method, METHODS)
        layout = codec_layout(self.codec)
        set_("k_bits", _check_bits("k_bits", self.k_bits, layout.keys.BITS))
        set_("v_bits", _check_bits("v_bits", self.v_bits, layout.values.BITS, optional=True))
        for name, lo in (("sink", 0), ("recent", 0), ("trim_headroom", 0), ("seed", 0), ("n_outlier_channels", 0)):
            set_(name, check_int(name, getattr(self, name), lo))
        set_("outlier_bits", check_int("outlier_bits", self.outlier_bits, 1, 8))
        set_("jl_dim", check_int("jl_dim", self.jl_dim, 1, optional=True))
        set_("head_dim", check_int("head_dim", self.head_dim, 1, optional=True))
        for name in ("center_keys", "center_values", "value_outliers"):
            set_(name, check_bool(name, getattr(self, name)))
        check_choice("rotation", self.rotation, ROTATIONS)
        self._check_codec_options(layout)
        if self.kind == "rvq" and (self.v_bits is not None or self.sink or self.recent or self.codec != "lloyd_max"
                                   or self.group_size is not None):
            raise ValueError("kind='rvq' keeps values in float16 and has its own RVQ key codec: v_bits, sink, recent, "
                             "codec and group_size do not apply")

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
            n = self.n_outlier_channels
            if n and (n < 2 or (self.head_dim is not None and n > self.head_dim - 2)):
                top = "head_dim-2" if self.head_dim is None else str(self.head_dim - 2)
                raise ValueError(f"n_outlier_channels must be 0 or in 2..{top} (each channel group needs >= 2 "
                                 f"coordinates), got {n}")
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
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if isinstance(bits, tuple):
                if len(bits) != n_layers:
                    raise ValueError(f"{name} has {len(bits)} entries, but the model has {n_layers} layers")
                changes[name] = bits[layer]
        if head_dim is not None:
            if self.head_dim is not None and self.head_dim != head_dim:
                raise ValueError(f"head_dim={self.head_dim}, but the model's attention head_dim is {head_dim}")
            changes["head_dim"] = head_dim
        return dataclasses.replace(self, **changes) if changes else self

    def layer_options(self) -> "CacheOptions":
        """These options as one layer's (v_bits resolved); ValueError if bits are still per layer."""
        if isinstance(self.k_bits, tuple) or isinstance(self.v_bits, tuple):
            raise ValueError("k_bits / v_bits hold one value per layer: build caches with make_prompt_cache(model, "
                             "...) or pick a layer with options.for_layer(i, n_layers)")
        return self if self.v_bits is not None else dataclasses.replace(self, v_bits=self.k_bits)

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

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
        from veloxquant_mlx.config import KVCacheConfig

        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        base = {name: getattr(config, name) for name in cls._KV_FIELDS}
        if config.method == "turboquant_mse" and config.jl_dim is not None:
            base["jl_dim"] = None  # the seed's cache reads jl_dim for any method; it has no effect on MSE
        base.update(k_bits=config.bit_width_inlier, v_bits=config.v_bits)
        return cls.from_dict({**base, **options})

    def kv_config(self):
        """The `KVCacheConfig` these options correspond to (what the seed's classes and saved states read)."""
        from veloxquant_mlx.config import KVCacheConfig

        if isinstance(self.k_bits, tuple) or isinstance(self.v_bits, tuple):
            raise ValueError("kv_config() describes one layer: these options hold per-layer bits")
        return KVCacheConfig(bit_width_inlier=self.k_bits, v_bits=self.v_bits,
                             **{name: getattr(self, name) for name in self._KV_FIELDS})
