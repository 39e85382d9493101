"""`KVCacheConfig`: the validated settings every veloxquant cache takes."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass
from typing import Any, Optional

from veloxquant_mlx.quant.quantizers import QUANTIZERS
from veloxquant_mlx.quant.rotation import ROTATION_KINDS as ROTATIONS
from veloxquant_mlx.quant.rotation import hadamard_supported
from veloxquant_mlx.validate import check_bool, check_choice, check_int, check_outlier_channels

# Options of the seed implementation that are no-ops here (everything is always vectorized).
DEPRECATED_OPTIONS = ("enable_vectorized_attend", "enable_fused_query_dot", "store")
# Outlier channels of the seed's standalone cache are int8 columns; the others are quantized over the whole head:
# one channel on either side is enough (`check_outlier_channels`; the packed caches' `CacheOptions` need 2).
OUTLIER_MIN_GROUP = 1


def _int_field(obj, name: str, lo: Optional[int] = None, hi: Optional[int] = None, optional: bool = False):
    v = check_int(f"KVCacheConfig.{name}", getattr(obj, name), lo, hi, optional=optional)
    object.__setattr__(obj, name, v)  # numpy ints become plain ints (JSON-safe)


def _choice_field(obj, name: str, choices) -> None:
    value = getattr(obj, name)
    if not isinstance(value, str):
        raise TypeError(f"KVCacheConfig.{name} must be a str, got {type(value).__name__}")
    check_choice(f"KVCacheConfig.{name}", value, choices)


@dataclass
class KVCacheConfig:
    """Settings of a TurboQuant KV cache (validated on construction).

    Attributes:
        method: quantizer name, a key of ``veloxquant_mlx.quant.quantizers.QUANTIZERS``.
        head_dim: per-head dimension d (> 0); caches that need it raise when it is None.
        bit_width_inlier: key bits per coordinate, 1..8.
        v_bits: value bits 1..8 for caches that compress values; None = bit_width_inlier.
        jl_dim: QJL sketch length m (>= 1), read only by method "turboquant_prod"; None = its default (d).
            Accepted and without effect for the other methods (the seed's standalone cache took it for
            any method and ignored it for MSE).
        seed: rotation / sketch seed (int >= 0).
        rotation: "haar" or "hadamard".
        capacity: ring-buffer size of the standalone cache (> 0); None = unbounded.
        n_outlier_channels: channels kept apart as outliers: 0, or 1..head_dim-1 when head_dim is set (the rule
            of `veloxquant_mlx.validate.check_outlier_channels`; the packed caches need 2..head_dim-2).
        outlier_bits: bits of the outlier stream, 1..8.
        n_calib_tokens: tokens used to calibrate outlier channels (> 0).
        enable_outlier_two_stream: keep outlier channels in a separate stream.

    ``enable_vectorized_attend``, ``enable_fused_query_dot`` and ``store`` are accepted for old code,
    do nothing and emit a DeprecationWarning.
    """

    method: str = "turboquant_mse"
    head_dim: Optional[int] = None
    bit_width_inlier: int = 4
    v_bits: Optional[int] = None
    jl_dim: Optional[int] = None
    seed: int = 0
    rotation: str = "haar"
    capacity: Optional[int] = None
    n_outlier_channels: int = 0
    outlier_bits: int = 8
    n_calib_tokens: int = 128
    enable_outlier_two_stream: bool = False
    enable_vectorized_attend: InitVar[Any] = None
    enable_fused_query_dot: InitVar[Any] = None
    store: InitVar[Any] = None

    def __post_init__(self, enable_vectorized_attend=None, enable_fused_query_dot=None, store=None):
        given = {"enable_vectorized_attend": enable_vectorized_attend,
                 "enable_fused_query_dot": enable_fused_query_dot, "store": store}
        for name, value in given.items():
            if value is not None:
                warnings.warn(f"KVCacheConfig({name}=...) is deprecated and ignored: attention is always "
                              "vectorized", DeprecationWarning, stacklevel=3)
        _choice_field(self, "method", tuple(QUANTIZERS))
        _choice_field(self, "rotation", ROTATIONS)
        _int_field(self, "head_dim", lo=1, optional=True)
        _int_field(self, "bit_width_inlier", 1, 8)
        _int_field(self, "v_bits", 1, 8, optional=True)
        _int_field(self, "jl_dim", lo=1, optional=True)
        _int_field(self, "seed", lo=0)
        _int_field(self, "capacity", lo=1, optional=True)
        _int_field(self, "outlier_bits", 1, 8)
        _int_field(self, "n_calib_tokens", lo=1)
        self.n_outlier_channels = check_outlier_channels("KVCacheConfig.n_outlier_channels", self.n_outlier_channels,
                                                         self.head_dim, min_group=OUTLIER_MIN_GROUP)
        self.enable_outlier_two_stream = check_bool("KVCacheConfig.enable_outlier_two_stream",
                                                    self.enable_outlier_two_stream)
        if self.head_dim is not None:
            if self.method in ("turboquant_mse", "turboquant_prod", "turboquant_rvq") and self.head_dim < 2:
                raise ValueError(f"KVCacheConfig.head_dim must be >= 2 for {self.method!r}, got {self.head_dim}")
            if self.rotation == "hadamard":
                inlier = self.head_dim - self.n_outlier_channels
                if not hadamard_supported(self.head_dim) and not hadamard_supported(inlier):
                    raise ValueError(
                        "KVCacheConfig.rotation='hadamard' needs head_dim = m * 2^k with m in (1, 12, 20, 28); "
                        f"got head_dim={self.head_dim}; use rotation='haar'")

    @property
    def value_bits(self) -> int:
        """Bits for values: ``v_bits``, or ``bit_width_inlier`` when None."""
        return self.bit_width_inlier if self.v_bits is None else self.v_bits

    def to_dict(self) -> dict:
        """JSON-safe dict of the stored fields (no deprecated options)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "KVCacheConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"KVCacheConfig.from_dict needs a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | set(DEPRECATED_OPTIONS)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"KVCacheConfig.from_dict: unknown keys {unknown}")
        return cls(**data)
