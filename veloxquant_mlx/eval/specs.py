"""Cache configurations the harness compares: ``CacheSpec`` and the registry of methods.

A *cache factory* is ``make_cache(model) -> list`` with one mlx_lm-compatible cache per layer,
so any cache (mlx_lm's, ours, a user's) plugs into every evaluation function.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx.integration import make_prompt_cache
from veloxquant_mlx.options import BUDGETS, PRESETS, SINK_TOKENS, CacheOptions  # noqa: F401 (SINK_TOKENS: re-exported)

CacheFactory = Callable[[object], list]

# QuantizedKVCache group size for the mlx-lm baselines (mlx_lm's own default)
MLX_GROUP_SIZE = 64
MLX_BITS = (8, 4, 2)
# names that all mean "mlx_lm's plain KVCache at the model dtype"
PLAIN_ALIASES = ("kv", "fp16", "plain", "fp32")


@dataclass
class CacheSpec:
    """One cache configuration.

    name: unique method name shown in tables and accepted by ``--method``.
    make_cache: ``make_cache(model) -> list`` of per-layer caches.
    family: method family (``"kv"``, ``"mlx-q"``, ``"turboquant_mse"``, ...), used with ``bits``
        to resolve ``--method FAMILY --bits B``.
    bits: nominal bits per coordinate (None for the unquantized cache); the *measured* bits come
        from :func:`veloxquant_mlx.eval.memory.cache_memory`.
    """

    name: str
    make_cache: CacheFactory
    family: str = ""
    bits: Optional[float] = None
    description: str = ""
    extra: Dict[str, object] = field(default_factory=dict)
    options: Optional[CacheOptions] = None  # compressed configurations: the options the caches are built from

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "bits": self.bits, "description": self.description}


def _n_layers(model) -> int:
    return len(model.layers)


def _plain(model) -> list:
    return [KVCache() for _ in range(_n_layers(model))]


def _mlx_quantized(bits: int) -> CacheFactory:
    def make(model) -> list:
        return [QuantizedKVCache(group_size=MLX_GROUP_SIZE, bits=bits) for _ in range(_n_layers(model))]

    return make


def baseline_specs() -> List[CacheSpec]:
    """mlx-lm's KVCache (model dtype: float32 on CPU) and QuantizedKVCache at 8/4/2 bits (group 64)."""
    specs = [CacheSpec("kv", _plain, family="kv", bits=None, description="mlx_lm KVCache (model dtype)")]
    for b in MLX_BITS:
        specs.append(
            CacheSpec(
                f"mlx-q{b}",
                _mlx_quantized(b),
                family="mlx-q",
                bits=b,
                description=f"mlx_lm QuantizedKVCache(group_size={MLX_GROUP_SIZE}, bits={b})",
            )
        )
    return specs


# The named configurations are `veloxquant_mlx.options.PRESETS` (the one table; read-only), the budget ones
# `options.BUDGETS` (name -> bit budget); the default of every entry point is `options.DEFAULT_NAME`. The names
# below stay for the code that reads them here.
CONFIGURATIONS = PRESETS
BUDGET_CONFIGURATIONS = BUDGETS


def options_extra(options: CacheOptions) -> Dict[str, object]:
    """The options that differ from `CacheOptions`' defaults (what ``--method NAME`` sets)."""
    default = CacheOptions()
    return {k: v for k, v in options.to_dict().items() if v != getattr(default, k) or k in ("method", "k_bits")}


def _compressed_factory(options: CacheOptions) -> CacheFactory:
    def make(model) -> list:
        return make_prompt_cache(model, options)

    return make


def compressed_spec(name: str, options: CacheOptions) -> CacheSpec:
    """A `CacheSpec` for compressed caches built from ``options``."""
    # RVQ codes each vector twice (two b-bit streams), so its nominal bits are 2b.
    nominal = 2 * options.k_bits if options.method == "turboquant_rvq" else options.k_bits
    if name in BUDGETS:
        family, what = "tq-budget", f"block keys and per-token values ({options.codec})"  # --method tq-budget --bits 3
    elif options.codec == "lloyd_max":
        family, what = options.method, options.method
    else:
        family, what = "tq-affine", f"rotation + MLX affine codes ({options.codec})"
    # every option that differs from CacheOptions' defaults, so `veloxquant methods` shows the whole configuration
    shown = ", ".join(f"{k}={v}" for k, v in options_extra(options).items())
    return CacheSpec(name, _compressed_factory(options), family=family, bits=nominal, description=f"{what}; {shown}",
                     extra=options_extra(options), options=options)


def with_calibration(spec: CacheSpec, calibration, suffix: str = "") -> CacheSpec:
    """``spec`` with its caches built with ``calibration``'s channel weights (name + ``suffix``); ValueError for
    mlx_lm's own caches, which have none."""
    if spec.options is None or spec.options.kind != "packed":
        raise ValueError(f"a calibration applies to the compressed (kind='packed') caches, not {spec.name!r}")
    options = spec.options

    def make(model) -> list:
        return make_prompt_cache(model, options, calibration=calibration)

    return dataclasses.replace(spec, name=spec.name + suffix, make_cache=make,
                               description=f"{spec.description}; calibration {calibration.id}",
                               extra={**spec.extra, "calibration": calibration.id})


def compressed_specs(head_dim: Optional[int] = None) -> List[CacheSpec]:
    """The registered TurboQuant configurations, `options.PRESETS` in order (``head_dim`` is read from the model
    when the cache is built)."""
    return [compressed_spec(name, options) for name, options in PRESETS.items()]


def registered_specs(head_dim: Optional[int] = None) -> List[CacheSpec]:
    """Baselines plus the compressed configurations, in display order, names unique."""
    specs = baseline_specs() + list(compressed_specs(head_dim))
    seen = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate cache spec name {s.name!r}")
        seen.add(s.name)
    return specs


def method_names(head_dim: Optional[int] = None) -> List[str]:
    """Accepted ``--method`` values: registered names, plain aliases and families."""
    specs = registered_specs(head_dim)
    names = [s.name for s in specs] + [a for a in PLAIN_ALIASES if a != "kv"]
    names += sorted({s.family for s in specs if s.bits is not None and s.family not in names})
    return names


def resolve_spec(method: str, bits: Optional[float] = None, head_dim: Optional[int] = None) -> CacheSpec:
    """The registered spec for ``--method`` (and optionally ``--bits``).

    ``method`` is a spec name ("kv", "mlx-q4", ...), a plain alias ("fp16"), or a family
    ("mlx-q", "turboquant_mse") that needs ``bits``. Raises ValueError naming the allowed values.
    """
    specs = registered_specs(head_dim)
    by_name = {s.name: s for s in specs}
    if method in PLAIN_ALIASES:
        method = "kv"
    if method in by_name:
        spec = by_name[method]
        if bits is not None and spec.bits is not None and float(bits) != float(spec.bits):
            raise ValueError(f"method {method!r} has bits={spec.bits:g}; got --bits {bits:g}")
        if bits is not None and spec.bits is None:
            raise ValueError(f"method {method!r} is not quantized; drop --bits")
        return spec
    family = [s for s in specs if s.family == method and s.bits is not None]
    if not family:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(method_names(head_dim))}")
    allowed = sorted({s.bits for s in family})
    if bits is None:
        raise ValueError(
            f"method {method!r} needs --bits, one of: {', '.join(f'{b:g}' for b in allowed)}"
        )
    matches = [s for s in family if float(s.bits) == float(bits)]
    if len(matches) > 1:
        raise ValueError(f"method {method!r} with --bits {bits:g} is ambiguous: choose one of "
                         f"{', '.join(s.name for s in matches)}")
    if matches:
        return matches[0]
    raise ValueError(
        f"bits {bits:g} out of range for method {method!r}; allowed: {', '.join(f'{b:g}' for b in allowed)}"
    )
