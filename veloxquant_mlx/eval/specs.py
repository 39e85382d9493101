"""Cache configurations the harness compares: ``CacheSpec`` and the registry of methods.

A *cache factory* is ``make_cache(model) -> list`` with one mlx_lm-compatible cache per layer,
so any cache (mlx_lm's, ours, a user's) plugs into every evaluation function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

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
        from :func:`veloxquant_mlx.eval.metrics.cache_memory`.
    """

    name: str
    make_cache: CacheFactory
    family: str = ""
    bits: Optional[float] = None
    description: str = ""
    extra: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "bits": self.bits, "description": self.description}


def _n_layers(model) -> int:
    return len(model.layers)


def _plain(model) -> list:
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in range(_n_layers(model))]


def _mlx_quantized(bits: int) -> CacheFactory:
    def make(model) -> list:
        from mlx_lm.models.cache import QuantizedKVCache

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


# The TurboQuant configurations every tool offers (demo, generate, eval, methods, plan, serve).
# One entry per (method, nominal bits): (method, key bits, value bits, builder options).
# Every configuration keeps the first 4 tokens exact ("attention sinks"): on SmolLM2 this removed
# about a third of the KL at 4 bits (benchmarks/probe_quality.py) and fixed garbled chat answers.
SINK_TOKENS = 4
# "tq-affine": the TurboQuant rotation with MLX's affine codes instead of the Lloyd-Max codebook, keys per
# channel over 64-token blocks ("affine_block"): the configuration whose attention on codes is fastest.
COMPRESSED = (
    ("turboquant_mse", 4, 4, {}),
    ("turboquant_mse", 3, 3, {}),
    ("turboquant_mse", 2, 2, {}),
    ("turboquant_prod", 4, 4, {}),
    ("turboquant_rvq", 2, 2, {}),
    ("turboquant_mse", 4, 4, {"codec": "affine_block"}),
    # 8-bit codes: MLX's CPU quantized matmul runs faster on byte-aligned codes, and keys carry most of the
    # attention error: near-lossless, and (k8v8) decoding faster than the plain float32 cache on CPU.
    ("turboquant_mse", 8, 4, {"codec": "affine_block"}),
    ("turboquant_mse", 8, 8, {"codec": "affine_block"}),
)


def _turboquant(method: str, k_bits: int, v_bits: int, options: dict) -> CacheFactory:
    def make(model) -> list:
        from veloxquant_mlx.cache.builder import make_prompt_cache

        return make_prompt_cache(model, method=method, k_bits=k_bits, v_bits=v_bits, sink=SINK_TOKENS, **options)

    return make


def compressed_specs(head_dim: Optional[int] = None) -> List[CacheSpec]:
    """TurboQuant cache configurations (``head_dim`` is read from the model when the cache is built)."""
    specs = []
    for method, kb, vb, options in COMPRESSED:
        # RVQ codes each vector twice (two b-bit streams), so its nominal bits are 2b.
        nominal = 2 * kb if method == "turboquant_rvq" else kb
        short, family, what = method.replace("turboquant_", "tq-"), method, method
        if options.get("codec", "lloyd_max") != "lloyd_max":
            short = family = "tq-affine"
            what = f"rotation + MLX affine codes ({options['codec']})"
        specs.append(
            CacheSpec(
                f"{short}-k{kb}v{vb}",
                _turboquant(method, kb, vb, options),
                family=family,
                bits=nominal,
                description=f"{what}, keys {kb}-bit, values {vb}-bit, first {SINK_TOKENS} tokens exact",
                extra={"method": method, "k_bits": kb, "v_bits": vb, "sink": SINK_TOKENS, **options},
            )
        )
    return specs


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
    for s in family:
        if float(s.bits) == float(bits):
            return s
    raise ValueError(
        f"bits {bits:g} out of range for method {method!r}; allowed: {', '.join(f'{b:g}' for b in allowed)}"
    )
