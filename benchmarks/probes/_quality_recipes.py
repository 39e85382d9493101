"""The recipes of ``python -m benchmarks.probes.probe_quality``: a config (`Config`) and the name that spells it
(`parse_config`), the probe's default lists (`SCREEN_DEFAULT`, `E2E_DEFAULT`), and the bits a config stores per
coordinate (`stream_bits`, `effective_bits`: the accounting the probe's docstring describes).

Pure Python, no MLX: ``probe_quality`` imports it as ``from benchmarks.probes._quality_recipes import ...`` (run from
the repository root as a module, like every probe); the names stay importable from ``probe_quality``.
"""
from __future__ import annotations

from dataclasses import dataclass

NORM_BITS = 16  # bf16 norm per vector (TurboQuantMSE default)
EXACT_BITS = 16  # exact tokens stored in float16


@dataclass(frozen=True)
class Config:
    name: str
    kb: int  # key bits (0 = keys exact)
    vb: int  # value bits (0 = values exact)
    codec: str = "lm"  # "lm" (LloydMaxCodec, Lloyd-Max) | "affine" (rotation + mx.quantize)
    group: int = 64  # affine group size
    kw: str = "none"  # key transform: none | diag | diagq | diag_df | full
    vw: str = "none"  # value transform: none | o_diag | o_full
    center: bool = True
    k_out: int = 0  # outlier channels for keys (Lloyd-Max at k_out_bits)
    k_out_bits: int = 8
    sinks: int = 0  # first tokens kept exact (fp16)
    window: int = 0  # most recent tokens kept exact (fp16)
    kb_layers: str = ""  # per-layer key bits override "layer:bits;..."
    vb_layers: str = ""  # per-layer value bits override "layer:bits;..."


def _layer_bits(base: int, spec: str, layer: int) -> int:
    for item in filter(None, spec.split(";")):
        li, lb = item.split(":")
        if "." in li:  # "a.b:bits" = layers a..b inclusive
            lo, hi = (int(t) for t in li.split("."))
            if lo <= layer <= hi:
                return int(lb)
        elif int(li) == layer:
            return int(lb)
    return base


def mean_bits(cfg: "Config", which: str, n_layers: int = 30) -> float:
    base, spec = (cfg.kb, cfg.kb_layers) if which == "k" else (cfg.vb, cfg.vb_layers)
    return sum(_layer_bits(base, spec, i) for i in range(n_layers)) / n_layers


# -- bits accounting ----------------------------------------------------------------------------------
def stream_bits(cfg: Config, which: str, T: int, d: int = 64) -> float:
    """Stored bits per coordinate of one stream (keys 'k' or values 'v') holding T tokens."""
    b = mean_bits(cfg, which)
    if b == 0:
        return 32.0  # float32 in the probe's reference cache (mlx_lm on CPU)
    if cfg.codec == "affine":
        per_tok = d * b + 2 * 16 * (d // cfg.group)
    else:
        n_out = cfg.k_out if which == "k" else 0
        per_tok = (d - n_out) * b + NORM_BITS + (n_out * cfg.k_out_bits + NORM_BITS if n_out else 0)
    fixed = 32 * d if cfg.center else 0  # fp32 mean per head
    if which == "k" and cfg.k_out:
        fixed += 8 * d  # permutation (uint8 per channel)
    tw = cfg.kw if which == "k" else cfg.vw
    if tw in ("diag", "diagq"):
        fixed += 16 * d // 2  # calibrated fp16 weight per RoPE pair
    elif tw in ("diagu", "diagu8") or tw.startswith("calu_"):
        fixed += 16 * d  # calibrated fp16 weight per channel (untied)
    elif tw == "full":
        fixed += 16 * d * d
    # diag_df / o_diag / o_full: from model weights (+ online stats counted as fp16 per channel)
    elif tw in ("diag_df", "o_diag", "diag_dfu") or tw.startswith("dfu_"):
        fixed += 16 * d
    elif tw == "o_full":
        fixed += 16 * d * d
    n_exact = min(T, cfg.sinks + cfg.window)
    total = (T - n_exact) * per_tok + n_exact * EXACT_BITS * d + fixed
    return total / (T * d)


def effective_bits(cfg: Config, T: int) -> float:
    return 0.5 * (stream_bits(cfg, "k", T) + stream_bits(cfg, "v", T))


# -- configurations ---------------------------------------------------------------------------------------------
D4 = "dfu_0.25_0.25"  # the recommended key weighting: data-free query moments, online key moments, untied
# layer-local screen (keys alone at 3 bits, values alone): which transform / extra helps, seconds per config
SCREEN_DEFAULT = [
    "K3V0", "K3V0-kw=diag", "K3V0-kw=diag_df", "K3V0-kw=diagq", "K3V0-kw=full", "K3V0-kw=calu_0.25_0.25",
    f"K3V0-kw={D4}", "K3V0-kw=dfu_0.5_0.5", "K3V0-kw=dfu_0.125_0.125", "K3V0-s=1", "K3V0-s=4", f"K3V0-kw={D4}-s=1",
    "K3V0-o=8x6", f"K3V0-kw={D4}-s=1-o=8x6", "K3V0-c=affine-g=32", f"K3V0-c=affine-g=32-kw={D4}",
    "K3V0-kw=calu_0.25_0.25-s=1", "K4V0-s=1", f"K4V0-kw={D4}-s=1", "K4V0-kw=calu_0.25_0.25-s=1", f"K4V0-kw={D4}-s=1-o=16x6", f"K5V0-kw={D4}-s=1",
    "K0V3-s=1", "K0V3-vw=o_diag-s=1", "K0V2-s=1", "K0V2-vw=o_diag-s=1",
]
# end-to-end (lockstep KL / top-1 / ppl): baselines and the per-budget recipes
C4 = "calu_0.25_0.25"  # calibrated (post-RoPE query and key moments from CAL text), untied: the winner
E2E_DEFAULT = [
    "K4V4", "K4V4-s=1", f"K4V4-kw={D4}", f"K4V4-kw={D4}-s=1", f"K4V4-kw={C4}-s=1", f"K5V3-kw={C4}-s=1",
    "K0V3-s=1", "K0V4-s=1", f"K5V0-kw={D4}-s=1",
    # strict per-budget recipes (V one bit lower in layers 23..29 to pay for means, weights and the sink)
    f"K4V4-kw={C4}-s=1-vl=23.29:3", f"K3V3-kw={C4}-s=1-vl=23.29:2", f"K2V2-kw={C4}-s=1-vl=23.29:1",
]


_KEYS = {"kw": ("kw", str), "vw": ("vw", str), "s": ("sinks", int), "w": ("window", int), "c": ("codec", str),
         "g": ("group", int), "nc": ("center", lambda v: False), "kl": ("kb_layers", str), "vl": ("vb_layers", str)}


def parse_config(name: str) -> Config:
    """Config from a name like ``K3V2-kw=diag_dfu-s=4-o=8x6-w=64-c=affine-g=32-kl=1:5;2:4``."""
    parts = name.split("-")
    head = parts[0]
    if not (head.startswith("K") and "V" in head):
        raise ValueError(f"config name must start with K<bits>V<bits>, got {name!r}")
    kb, vb = head[1:].split("V")
    kwargs = {}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k == "o":
            n, b = v.split("x")
            kwargs["k_out"], kwargs["k_out_bits"] = int(n), int(b)
        elif k in _KEYS:
            field, conv = _KEYS[k]
            kwargs[field] = conv(v)
        else:
            raise ValueError(f"unknown config option {k!r} in {name!r}; known: o, {', '.join(_KEYS)}")
    return Config(name, int(kb), int(vb), **kwargs)
