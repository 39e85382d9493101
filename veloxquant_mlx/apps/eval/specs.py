"""Cache configurations the harness compares: ``CacheSpec`` (a *spec*) for every preset and for mlx_lm's own caches.

A *preset* is a name for a `CacheOptions` (`veloxquant_mlx.cache.presets.PRESETS`); the CLI's ``--preset NAME`` and
``--presets A,B`` also take mlx_lm's own caches (``kv`` and its aliases, ``mlx-q8/q4/q2``) and a family with
``--bits`` (`preset_names`, `resolve_spec`). A *cache factory* is ``make_cache(model) -> list`` with one
mlx_lm-compatible cache per layer, so any cache (mlx_lm's, ours, a user's) plugs into every evaluation function.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx._version import DEPRECATED_UNTIL
from veloxquant_mlx.integration.builder import make_prompt_cache
from veloxquant_mlx.cache.presets import BUDGETS, PRESETS
from veloxquant_mlx.cache.options import CacheOptions

CacheFactory = Callable[[object], list]

# QuantizedKVCache group size for the mlx-lm baselines (mlx_lm's own default)
MLX_GROUP_SIZE = 64
MLX_BITS = (8, 4, 2)
# names that all mean "mlx_lm's plain KVCache at the model dtype"
PLAIN_ALIASES = ("kv", "fp16", "plain", "fp32")


@dataclass
class CacheSpec:
    """One cache configuration as the harness runs it: a preset, or one of mlx_lm's own caches.

    name: unique name shown in tables and accepted by ``--preset`` (the preset's name, or ``kv`` / ``mlx-qN``).
    make_cache: ``make_cache(model) -> list`` of per-layer caches.
    family: the family (``"kv"``, ``"mlx-q"``, ``"tq-affine"``, ``"tq-budget"``, or the quantizer ``method`` of a
        ``lloyd_max`` preset: ``"turboquant_mse"``, ...), used with ``bits`` to resolve ``--preset FAMILY --bits B``.
    bits: nominal bits per coordinate (None for the unquantized cache); the *measured* bits come
        from :func:`veloxquant_mlx.apps.eval.memory.cache_memory`.
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


# The named configurations are `veloxquant_mlx.cache.presets.PRESETS` (the one table; read-only), the budget ones
# `presets.BUDGETS` (name -> bit budget); the default of every entry point is `presets.DEFAULT_NAME`. The names
# below stay for the code that reads them here.
CONFIGURATIONS = PRESETS
BUDGET_CONFIGURATIONS = BUDGETS


def options_extra(options: CacheOptions) -> Dict[str, object]:
    """The options that differ from `CacheOptions`' defaults (what ``--preset NAME`` sets)."""
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
        family, what = "tq-budget", f"block keys and per-token values ({options.codec})"  # --preset tq-budget --bits 3
    elif options.codec == "lloyd_max":
        family, what = options.method, options.method
    else:
        family, what = "tq-affine", f"rotation + MLX affine codes ({options.codec})"
    # every option that differs from CacheOptions' defaults, so `veloxquant presets` shows the whole configuration
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
    """The registered TurboQuant configurations, `presets.PRESETS` in order (``head_dim`` is read from the model
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


def preset_names(head_dim: Optional[int] = None) -> List[str]:
    """Accepted ``--preset`` values: the registered names (mlx_lm's caches, then the presets), the plain cache's
    aliases and the families (which need ``--bits``)."""
    specs = registered_specs(head_dim)
    names = [s.name for s in specs] + [a for a in PLAIN_ALIASES if a != "kv"]
    names += sorted({s.family for s in specs if s.bits is not None and s.family not in names})
    return names


def method_names(head_dim: Optional[int] = None) -> List[str]:
    """Deprecated name of `preset_names` (until ``DEPRECATED_UNTIL``): these names are presets, not methods."""
    warnings.warn(f"veloxquant_mlx.apps.eval.specs.method_names is deprecated and will be removed in {DEPRECATED_UNTIL}; "
                  "use veloxquant_mlx.apps.eval.specs.preset_names", DeprecationWarning, stacklevel=2)
    return preset_names(head_dim)


def unknown_preset(name: str, head_dim: Optional[int] = None) -> str:
    """The message for a name `resolve_spec` does not know: every accepted value, grouped."""
    specs = registered_specs(head_dim)
    names = preset_names(head_dim)
    presets = [s.name for s in specs if s.options is not None]
    own = [s.name for s in specs if s.options is None]
    families = [n for n in names if n not in presets and n not in own and n not in PLAIN_ALIASES]
    return (f"unknown preset {name!r}; presets: {', '.join(presets)}; mlx_lm's caches: {', '.join(own)} (kv also as "
            f"{', '.join(a for a in PLAIN_ALIASES if a != 'kv')}); a family with --bits: {', '.join(families)}")


def resolve_spec(name: Optional[str] = None, bits: Optional[float] = None, head_dim: Optional[int] = None, *,
                 method: Optional[str] = None) -> CacheSpec:
    """The registered spec for ``--preset NAME`` (and optionally ``--bits``).

    ``name`` is a registered name (a preset such as "tq-4b", or mlx_lm's "kv", "mlx-q4", ...), a plain alias
    ("fp16"), or a family ("mlx-q", "tq-budget", "turboquant_mse") that needs ``bits``. Raises ValueError naming the
    allowed values. ``method=`` is the deprecated keyword spelling of ``name`` (until ``DEPRECATED_UNTIL``).
    """
    if method is not None:
        if name is not None:
            raise TypeError("resolve_spec: give the preset name once (name=; method= is its deprecated spelling)")
        warnings.warn(f"resolve_spec(method=...) is deprecated and will be removed in {DEPRECATED_UNTIL}; use "
                      "resolve_spec(name=...): it names a preset", DeprecationWarning, stacklevel=2)
        name = method
    if name is None:
        raise TypeError("resolve_spec needs a preset name")
    specs = registered_specs(head_dim)
    by_name = {s.name: s for s in specs}
    if name in PLAIN_ALIASES:
        name = "kv"
    if name in by_name:
        spec = by_name[name]
        if bits is not None and spec.bits is not None and float(bits) != float(spec.bits):
            raise ValueError(f"preset {name!r} has bits={spec.bits:g}; got --bits {bits:g}")
        if bits is not None and spec.bits is None:
            raise ValueError(f"preset {name!r} is not quantized; drop --bits")
        return spec
    family = [s for s in specs if s.family == name and s.bits is not None]
    if not family:
        raise ValueError(unknown_preset(name, head_dim))
    allowed = sorted({s.bits for s in family})
    if bits is None:
        raise ValueError(
            f"the family {name!r} needs --bits, one of: {', '.join(f'{b:g}' for b in allowed)}"
        )
    matches = [s for s in family if float(s.bits) == float(bits)]
    if len(matches) > 1:
        raise ValueError(f"the family {name!r} with --bits {bits:g} is ambiguous: choose a preset of "
                         f"{', '.join(s.name for s in matches)}")
    if matches:
        return matches[0]
    raise ValueError(
        f"bits {bits:g} out of range for the family {name!r}; allowed: {', '.join(f'{b:g}' for b in allowed)}"
    )
