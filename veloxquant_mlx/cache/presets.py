"""The presets: names for `CacheOptions` (`PRESETS`), the budget presets' bits (`BUDGETS`) and THE default.

`PRESETS` names every preset the tools offer (``--preset NAME``, `veloxquant_mlx.apps.eval.specs`); `DEFAULT`
(`DEFAULT_NAME`, ``tq-affine-k8v4``) is the one every entry point uses when given nothing: `enable(model)`,
`make_prompt_cache(model)`, ``veloxquant generate`` and ``veloxquant serve``. `resolve_options` turns what a caller
gave (a preset name, a `CacheOptions`, a `KVCacheConfig` or None, plus keyword options) into `CacheOptions`.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Union

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.compat.config import KVCacheConfig


# -- named presets and the default ---------------------------------------------------------------------------------
# The presets every tool offers (demo, generate, eval, presets, plan, serve): the one registry of named
# configurations, each a `CacheOptions`. Every "tq-<method>-kNvM" / "tq-affine-kNvM" configuration keeps the
# first 4 tokens exact ("attention sinks"): on SmolLM2 this removed about a third of the KL at 4 bits
# (docs/history/benchmarks-journal.md) and fixed garbled chat answers. "tq-affine": the TurboQuant rotation with MLX's
# affine codes instead of the Lloyd-Max codebook, keys per channel over 64-token blocks ("affine_block"): the fastest
# attention on codes. 8-bit codes: MLX's CPU quantized matmul runs faster on byte-aligned codes, and keys carry most
# of the attention error: near-lossless (decode speed against the plain cache: BENCHMARKS.md).
SINK_TOKENS = 4
# The default's sliding-window rule (`CacheOptions.short_window`): window layers of at most this many tokens keep
# 8-bit keys and values. On Gemma 3 270M the 4-bit values of its 512-token window layers carried ~90 % of the
# default's KL (issue 55); such a layer holds at most this many tokens whatever the context, so at 8192 tokens and
# beyond its extra bits are a small share of the cache (BENCHMARKS.md, "Issue 55"). Full-attention models: unchanged.
SHORT_WINDOW = 1024


def _tq(method: str, k_bits: int, v_bits: int, codec: str = "lloyd_max") -> CacheOptions:
    return CacheOptions(method=method, k_bits=k_bits, v_bits=v_bits, sink=SINK_TOKENS, codec=codec)


# The budget configurations (issues 16, 28, 47 and 54): the best measured configuration within each bit budget at
# every length from 512 tokens (bits per coordinate averaged over K and V, every stored byte counted:
# `veloxquant_mlx.apps.eval.memory.measure_bits`). Layout "token_lloyd8" (`veloxquant_mlx.codecs.token_lloyd`): keys
# and values coded per token on arrival, rotated, on the Lloyd-Max levels of a Gaussian (TurboQuant's codebook) with
# one one-byte log-grid scale per 64 coordinates (b + 0.125 bits); keys stored less their rotated pre-RoPE mean
# (rope_offset="auto", where the layer's RoPE is known: `CacheOptions.rope_offset`); one exact sink token (the
# first, which most heads attend to: it more than halved the KL at every budget, issue 28); rows shorter than
# `CODE_FROM` tokens stay exact. On SmolLM2 at 2048 tokens (Debian / Bible text) tq-4b went from 5.93 bits at KL
# 0.012 (keys per channel over 128-token blocks, up to 127 newest tokens waiting exact) to 4.14 bits at 0.0115 /
# 0.0395, 4.20 at 512 tokens (BENCHMARKS.md, issue 54). Full-attention layers whose queries read key channels that
# vary little (the builder's key-rotation probe or a calibration finds them: Gemma 3's) take that block layout in
# the model's own channels instead (`TokenLloydCodec.CHANNEL_LAYOUT`). Sliding-window layers (models with them only) keep their newest
# `WINDOW_RECENT` tokens exact and code keys at no fewer than `WINDOW_KEY_BITS` bits: a window's queries read
# mostly their newest keys, sharply, so its key error carries the KL. On Gemma 3 270M (Bible, 2048 tokens,
# calibrated) this took tq-4b's KL 0.173 -> 0.014, tq-3b's 0.78 -> 0.038, tq-2b's 2.27 -> 0.15, for +0.3 to +0.65
# bit at 2048 tokens (a window holds 512 tokens whatever the context: less at longer ones); BENCHMARKS.md, issue 55.
WINDOW_RECENT = 16
WINDOW_KEY_BITS = 5


# Rows shorter than this stay exact (`CacheOptions.code_from`): a short chat answers as with mlx_lm's own cache
# (every token coded, SmolLM2's answer to the demo question changed at 2 bits, issue 54); from 512 tokens on the
# bits are the names'.
CODE_FROM = 128


def _budget(bits: int) -> CacheOptions:
    return CacheOptions(codec="token_lloyd8", k_bits=bits, v_bits=bits, code_batch=1, code_from=CODE_FROM,
                        trim_headroom=0, center_keys=False, center_values=False, sink=1, rope_offset="auto",
                        window_recent=WINDOW_RECENT, window_k_bits=WINDOW_KEY_BITS)


# budget preset name -> its budget in bits per coordinate (every stored byte counted)
BUDGETS: Mapping[str, float] = MappingProxyType({"tq-4b": 4.25, "tq-3b": 3.25, "tq-2b": 2.25})

# name -> CacheOptions, read-only; display order
PRESETS: Mapping[str, CacheOptions] = MappingProxyType({
    "tq-mse-k4v4": _tq("turboquant_mse", 4, 4),
    "tq-mse-k3v3": _tq("turboquant_mse", 3, 3),
    "tq-mse-k2v2": _tq("turboquant_mse", 2, 2),
    "tq-prod-k4v4": _tq("turboquant_prod", 4, 4),
    "tq-rvq-k2v2": _tq("turboquant_rvq", 2, 2),
    "tq-affine-k4v4": _tq("turboquant_mse", 4, 4, "affine_block"),
    "tq-affine-k8v4": dataclasses.replace(_tq("turboquant_mse", 8, 4, "affine_block"), short_window=SHORT_WINDOW),
    "tq-affine-k8v8": _tq("turboquant_mse", 8, 8, "affine_block"),
    "tq-4b": _budget(4),
    "tq-3b": _budget(3),
    "tq-2b": _budget(2),
})
assert set(BUDGETS) <= set(PRESETS)

# THE default: what `enable(model)`, `make_prompt_cache(model)`, ``veloxquant generate`` and ``veloxquant serve``
# use when given no configuration. The best measured so far (BENCHMARKS.md): 8-bit keys per channel over 64-token
# blocks, 4-bit values, 4 exact sink tokens; KL 0.004 at 512 tokens on SmolLM2.
DEFAULT_NAME = "tq-affine-k8v4"
DEFAULT: CacheOptions = PRESETS[DEFAULT_NAME]


def preset(name: str) -> CacheOptions:
    """The preset called ``name`` (ValueError naming the presets when there is none)."""
    if not isinstance(name, str):
        raise TypeError(f"a preset name must be a str, got {type(name).__name__} ({name!r})")
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


def resolve_options(config: Union[None, str, CacheOptions, KVCacheConfig] = None, **options: Any) -> CacheOptions:
    """The `CacheOptions` of ``config`` plus keyword ``options`` (any `CacheOptions` field; lists of per-layer bits
    are accepted).

    The rule for defaults:

    - nothing (``config`` None, no keyword options): `DEFAULT`, the ``tq-affine-k8v4`` preset;
    - keyword options alone (``config`` None): those options on top of `CacheOptions`' *field defaults*, i.e.
      ``CacheOptions(**options)``, not on top of `DEFAULT` (so ``k_bits=3`` alone is Lloyd-Max keys and values at
      3 bits, no sink tokens, as it always was); start from the default with ``resolve_options(DEFAULT_NAME, ...)``;
    - a preset name (a key of `PRESETS`): that preset, keyword options replacing its fields;
    - a `CacheOptions`: it (the same object when no options are given), keyword options replacing its fields;
    - a seed-page `KVCacheConfig`: ``CacheOptions.from_kv_config(config, **options)``.

    Unknown option names raise TypeError naming them; an unknown preset name raises ValueError naming the presets.
    """
    unknown = sorted(set(options) - set(CacheOptions.field_names()))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; options are {list(CacheOptions.field_names())}")
    if config is None:
        return CacheOptions(**options) if options else DEFAULT
    if isinstance(config, str):
        config = preset(config)
    if isinstance(config, CacheOptions):
        return dataclasses.replace(config, **options) if options else config
    if isinstance(config, KVCacheConfig):
        return CacheOptions.from_kv_config(config, **options)
    raise TypeError(f"config must be a preset name, a CacheOptions, a KVCacheConfig or None, got "
                    f"{type(config).__name__}")
