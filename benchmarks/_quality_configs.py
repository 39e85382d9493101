"""The research configurations of ``benchmarks/quality.py`` (``--configs NAME``): `OURS`, name -> make_prompt_cache
options, beside the baselines and the registered configurations (``veloxquant_mlx.apps.eval.specs.CONFIGURATIONS``), and
the two helpers that build issue 47's entries (`_tail_layout`, `_budget_variant`).

``quality.py`` imports it (``from _quality_configs import OURS, ...``: the script's folder is first on ``sys.path``)
after OpenBLAS is preloaded, since this module imports veloxquant_mlx, so MLX, at module level; the names stay
importable from ``quality`` (``quality.OURS``).
"""
from __future__ import annotations

from veloxquant_mlx.codecs import CODECS, CodecLayout
from veloxquant_mlx.codecs.affine_sym_log import AffineSymLogScaleValueCodec
from veloxquant_mlx.codecs.token_lloyd import TokenLloydCodec
from veloxquant_mlx.codecs.kblock_tail import TailedBlockKeyCodec, TailedSymValueCodec
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.presets import preset


# Issue 47's research layouts: the budget layout with its waiting keys' provisional codes at b + E bits (the
# registered "kblock_vsym8_pt" is E = TAIL_EXTRA_BITS). Registered for this process only.
def _tail_layout(extra: int) -> str:
    name = f"kblock_vsym8_pt{extra}"
    if name not in CODECS:
        cls = type(f"TailedBlockKeyCodec{extra}", (TailedBlockKeyCodec,), {"TAIL_EXTRA_BITS": extra})
        CODECS[name] = CodecLayout(cls, TailedSymValueCodec)
    return name


def _with_key_group(cls, key_group: int):
    """``cls`` whose keys' scales cover ``key_group`` coordinates (the values keep their 64)."""
    def __init__(self, d, bits, group_size=None, **kwargs):
        cls.__init__(self, d, bits, group_size, **kwargs)
        self.group_size = min(key_group, d)
    return type(f"{cls.__name__}Keys{key_group}", (cls,), {"__init__": __init__})


# Issue 54's per-token layouts, keys coded once on arrival as the values are, never re-coded into blocks: uniform
# symmetric levels ("ksym8_vsym8"), or the Gaussian's Lloyd-Max levels (`token_lloyd8`, the budget presets' layout
# since issue 54); ``key_group`` 32: finer key scales. Registered for this process only.
def _token_layout(key_group: int = 64) -> str:
    name = "ksym8_vsym8" if key_group == 64 else f"ksym8g{key_group}_vsym8"
    if name not in CODECS:
        keys = AffineSymLogScaleValueCodec if key_group == 64 else _with_key_group(AffineSymLogScaleValueCodec, key_group)
        CODECS[name] = CodecLayout(keys, AffineSymLogScaleValueCodec)
    return name


def _level_layout(key_group: int = 64) -> str:
    if key_group == 64:
        return "token_lloyd8"
    name = f"token_lloyd8_k{key_group}"
    if name not in CODECS:
        CODECS[name] = CodecLayout(_with_key_group(TokenLloydCodec, key_group), TokenLloydCodec)
    return name


def _budget_variant(bits: int, **changes) -> dict:
    """tq-{bits}b's options with ``changes`` (as make_prompt_cache keywords), on the budget as issue 55's variants
    were measured: windows without the presets' later window rule (``window_recent`` / ``window_k_bits`` 0)."""
    return _preset_variant(f"tq-{bits}b", **{"window_recent": 0, "window_k_bits": 0, **changes})


# The budget presets as issues 47-55 measured them (until issue 54 switched them to per-token codes): keys per channel
# over 128-token blocks, the waiting tokens exact. The research names built on "tq-Nb" keep meaning these.
BLOCK_BUDGETS = {f"tq-{b}b": CacheOptions(codec="kblock_vsym8", k_bits=b, v_bits=b, group_size=128, trim_headroom=0,
                                          center_keys=False, center_values=False, sink=1, window_recent=16,
                                          window_k_bits=5) for b in (4, 3, 2)}


def _options_dict(options: CacheOptions, **changes) -> dict:
    return {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in options.to_dict().items()
               if k not in ("calibration_id", "channel_log2", "head_dim")}, **changes}


def _preset_variant(name: str, **changes) -> dict:
    """The preset ``name``'s options with ``changes`` (as make_prompt_cache keywords); a budget preset's name means
    its block layout before issue 54 (`BLOCK_BUDGETS`)."""
    return _options_dict(BLOCK_BUDGETS[name] if name in BLOCK_BUDGETS else preset(name), **changes)


# Our configurations: name -> make_prompt_cache options. Bits in the names are K/V code bits;
# "o8" = 8 key outlier channels at 8 bits; "r16" = last 16 tokens exact; "s4" = 4 sink tokens exact.
OURS = {
    "k4v4": dict(k_bits=4, v_bits=4),
    "k4v4-nc": dict(k_bits=4, v_bits=4, center_keys=False, center_values=False),
    "k5v3": dict(k_bits=5, v_bits=3),
    "k5v3-o8": dict(k_bits=5, v_bits=3, n_outlier_channels=8, outlier_bits=8),
    "k4v3-o8": dict(k_bits=4, v_bits=3, n_outlier_channels=8, outlier_bits=8),
    "k4v4-o8": dict(k_bits=4, v_bits=4, n_outlier_channels=8, outlier_bits=8),
    "k5v4": dict(k_bits=5, v_bits=4),
    "k4v4-s4r16": dict(k_bits=4, v_bits=4, sink=4, recent=16, trim_headroom=0),
    # layer 1 (the most sensitive in FINDINGS.md) gets 6-bit keys; SmolLM2 has 30 layers
    "k4v4-L1k6": dict(k_bits=[4, 6] + [4] * 28, v_bits=4),
    "k4v2": dict(k_bits=4, v_bits=2),
    "k4v2-o8": dict(k_bits=4, v_bits=2, n_outlier_channels=8, outlier_bits=8),
    "k3v2-o8": dict(k_bits=3, v_bits=2, n_outlier_channels=8, outlier_bits=8),
    "k3v1-o8": dict(k_bits=3, v_bits=1, n_outlier_channels=8, outlier_bits=8),
    "k2v2": dict(k_bits=2, v_bits=2),
    "k3v1": dict(k_bits=3, v_bits=1),
    "k5v3-o8-s4r16": dict(k_bits=5, v_bits=3, n_outlier_channels=8, outlier_bits=8, sink=4, recent=16,
                          trim_headroom=0),
    "prod-k5v3": dict(method="turboquant_prod", k_bits=5, v_bits=3),
    "rvq-k2v2": dict(method="turboquant_rvq", k_bits=2, v_bits=2),
    # The registered configurations (veloxquant_mlx.apps.eval.specs): first 4 tokens exact.
    "k4v4-s4": dict(k_bits=4, v_bits=4, sink=4),
    "k3v3-s4": dict(k_bits=3, v_bits=3, sink=4),
    "k2v2-s4": dict(k_bits=2, v_bits=2, sink=4),
    "k4v4-o8-s4": dict(k_bits=4, v_bits=4, n_outlier_channels=8, outlier_bits=8, sink=4),
    "k3v3-o8-s4": dict(k_bits=3, v_bits=3, n_outlier_channels=8, outlier_bits=8, sink=4),
    "rvq-k2v2-s4": dict(method="turboquant_rvq", k_bits=2, v_bits=2, sink=4),
    # The affine codecs made for attention on codes (veloxquant_mlx.attention): rotated MLX affine codes,
    # keys per token ("aff") or per channel over 64-token blocks ("blk", up to 71 newest tokens exact).
    "aff-k4v4": dict(k_bits=4, v_bits=4, codec="affine"),
    "aff-k4v4-s4": dict(k_bits=4, v_bits=4, codec="affine", sink=4),
    "blk-k4v4": dict(k_bits=4, v_bits=4, codec="affine_block"),
    "blk-k4v4-s4": dict(k_bits=4, v_bits=4, codec="affine_block", sink=4),
    "blk-k3v3-s4": dict(k_bits=3, v_bits=3, codec="affine_block", sink=4),
    "blk-k8v4-s4": dict(k_bits=8, v_bits=4, codec="affine_block", sink=4),
    # Budget research (issue 16). "-a" = block-aligned: no sink and trim_headroom=0, so at a multiple of the
    # 64-token key block nothing is held exact (a sink of 4 would leave 60 float32 tokens at 2048: +0.94 bit).
    # "Lv4" = 4-bit values in the first and last two layers; "Lk6" = 6-bit keys in layers 0 and 1 (the most
    # sensitive in FINDINGS.md).
    "blk-k4v4-a": dict(k_bits=4, v_bits=4, codec="affine_block", trim_headroom=0),
    "blk-k4v3-a": dict(k_bits=4, v_bits=3, codec="affine_block", trim_headroom=0),
    "blk-k4v3-a-Lv4": dict(k_bits=4, v_bits=[4, 4] + [3] * 26 + [4, 4], codec="affine_block", trim_headroom=0),
    "blk-k4v3-a-Lk6v4": dict(k_bits=[6, 6] + [4] * 28, v_bits=[4, 4] + [3] * 26 + [4, 4], codec="affine_block",
                             trim_headroom=0),
    "blk-k3v3-a": dict(k_bits=3, v_bits=3, codec="affine_block", trim_headroom=0),
    "blk-k4v2-a": dict(k_bits=4, v_bits=2, codec="affine_block", trim_headroom=0),
    "blk-k3v2-a": dict(k_bits=3, v_bits=2, codec="affine_block", trim_headroom=0),
    "blk-k2v2-a": dict(k_bits=2, v_bits=2, codec="affine_block", trim_headroom=0),
    "lm-k4v3-s4": dict(k_bits=4, v_bits=3, sink=4),
    "lm-k3v3-nc": dict(k_bits=3, v_bits=3, center_keys=False, center_values=False),
    "lm-k2v2-nc": dict(k_bits=2, v_bits=2, center_keys=False, center_values=False),
    "lm-k3v1-cv0": dict(k_bits=3, v_bits=1, center_values=False),
    # affine_block_kv: keys and values per rotated channel over token blocks; "g128" = 128-token blocks (0.25 bit
    # of scales), "nc" = no centring (per-channel biases absorb the means; saves the fitted means' bytes).
    "bkv-k4v4-g128": dict(k_bits=4, v_bits=4, codec="affine_block_kv", group_size=128, trim_headroom=0,
                          center_keys=False, center_values=False),
    "bkv-k4v4-g128-c": dict(k_bits=4, v_bits=4, codec="affine_block_kv", group_size=128, trim_headroom=0),
    "bkv-k4v4-g64": dict(k_bits=4, v_bits=4, codec="affine_block_kv", group_size=64, trim_headroom=0,
                         center_keys=False, center_values=False),
    "bkv-k4v4-g128-s4": dict(k_bits=4, v_bits=4, codec="affine_block_kv", group_size=128, trim_headroom=0,
                             center_keys=False, center_values=False, sink=4),
    **{f"bkv-k{kb}v{vb}-g128": dict(k_bits=kb, v_bits=vb, codec="affine_block_kv", group_size=128, trim_headroom=0,
                                    center_keys=False, center_values=False) for kb, vb in ((3, 3), (4, 2), (2, 2))},
    # "mse" = affine_block_kv_mse: each group's range clipped to the least-squared-error fraction of its min-max.
    **{f"mse-k{kb}v{vb}-g128": dict(k_bits=kb, v_bits=vb, codec="affine_block_kv_mse", group_size=128,
                                    trim_headroom=0, center_keys=False, center_values=False)
       for kb, vb in ((4, 4), (3, 3), (2, 2))},
    # "kbl" = kblock_vlloyd: clipped per-channel keys over 128-token blocks, Lloyd-Max values per token.
    **{f"kbl-k{kb}v{vb}": dict(k_bits=kb, v_bits=vb, codec="kblock_vlloyd", group_size=128, trim_headroom=0,
                               center_keys=False, center_values=False) for kb, vb in ((4, 4), (3, 3), (2, 2), (3, 1))},
    # "kbs" = kblock_vsym: the same keys, symmetric scale-only values per token (attention on codes throughout).
    **{f"kbs-k{kb}v{vb}": dict(k_bits=kb, v_bits=vb, codec="kblock_vsym", group_size=128, trim_headroom=0,
                               center_keys=False, center_values=False) for kb, vb in ((4, 4), (3, 3), (2, 2))},
    # Issue 28's screens of the exact first token: "-s1" = 1 sink token, "kbs8" = kblock_vsym8 (one-byte value scales,
    # what tq-Nb are with -s1), "-L5k..." = 5-bit keys in those layers.
    **{f"kbs-k{b}v{b}-s1": dict(k_bits=b, v_bits=b, codec="kblock_vsym", group_size=128, trim_headroom=0,
                                center_keys=False, center_values=False, sink=1) for b in (4, 3, 2)},
    **{f"kbs8-k{kb}v{vb}-s{s}": dict(k_bits=kb, v_bits=vb, codec="kblock_vsym8", group_size=128, trim_headroom=0,
                                     center_keys=False, center_values=False, sink=s)
       for kb, vb, s in ((4, 4, 0), (4, 4, 1), (8, 4, 1), (4, 8, 1))},
    "kbs-k4v4-s4": dict(k_bits=4, v_bits=4, codec="kblock_vsym", group_size=128, trim_headroom=0, center_keys=False,
                        center_values=False, sink=4),
    **{f"kbs8-k4v4-s1-L5k{'-'.join(map(str, layers))}": dict(
        k_bits=[5 if i in layers else 4 for i in range(30)], v_bits=4, codec="kblock_vsym8", group_size=128,
        trim_headroom=0, center_keys=False, center_values=False, sink=1) for layers in ((1, 16), (0, 1, 16, 19))},
    # Issue 47's tail levers on the budget presets (tq-Nb = "-exact"): "-exact" = waiting tokens exact (float32 here,
    # the layout before issue 47); "-ptE" = waiting keys provisionally coded at b + E bits, values coded on arrival.
    **{f"tq{b}-exact": _budget_variant(b, codec="kblock_vsym8", center_keys=False) for b in (4, 3, 2)},
    **{f"tq{b}-pt{e}": _budget_variant(b, codec=_tail_layout(e), center_keys=False) for b in (4, 3, 2)
       for e in (0, 1, 2)},
    # "-ptcE": the same, the provisional keys centred on each sequence's key mean (fitted on its first tokens).
    **{f"tq{b}-ptc{e}": _budget_variant(b, codec=_tail_layout(e), center_keys=True) for b in (4, 3, 2)
       for e in (0, 1, 2)},
    # A recent window inside the budget, its best case: values one bit coarser than the keys, the waiting tokens
    # exact (an 8-bit window costs ~0.5 bit at 2048: K4/V3 + 8-bit window = 3.96 bits, K3/V2 = 3.02); or keys one
    # bit coarser.
    **{f"tq{b}-exact-v{b - 1}": _budget_variant(b, codec="kblock_vsym8", center_keys=False, v_bits=b - 1)
       for b in (4, 3)},
    **{f"tq{b}-exact-k{b - 1}": _budget_variant(b, codec="kblock_vsym8", center_keys=False, k_bits=b - 1)
       for b in (4, 3)},
    # "-c": the waiting tokens exact, block keys centred on each sequence's key mean (with "pre-": before RoPE,
    # where a channel's mean does not move with the position); "-k8" / "-v8": 8-bit keys or values (what the other
    # half costs alone at tq-4b's codes).
    **{f"tq{b}-exact-c": _budget_variant(b, codec="kblock_vsym8", center_keys=True) for b in (4, 3, 2)},
    "tq4-exact-k8": _budget_variant(4, codec="kblock_vsym8", center_keys=False, k_bits=8),
    "tq4-exact-v8": _budget_variant(4, codec="kblock_vsym8", center_keys=False, v_bits=8),
    # Issue 55's sliding-window rule (CacheOptions.short_window): "-sw0" the default without it (as before issue 55),
    # "tq{b}-sw" a budget preset with it (window layers of <= 1024 tokens at 8-bit keys and values).
    "tq-affine-k8v4-sw0": _preset_variant("tq-affine-k8v4", short_window=0),
    **{f"tq{b}-sw": _budget_variant(b, short_window=1024) for b in (4, 3, 2)},
    # With the rule, the full-attention layers' levers (Gemma 3): 4 exact sink tokens; keys centred on the sequence's
    # key mean; key blocks of 64 tokens (finer per-channel ranges, +0.25 bit).
    "tq4-sw-s4": _budget_variant(4, short_window=1024, sink=4),
    "tq4-sw-c": _budget_variant(4, short_window=1024, center_keys=True),
    "tq4-sw-g64": _budget_variant(4, short_window=1024, group_size=64),
    # Block keys coded in the model's own channels (CacheOptions.key_rotation="none"; the windows code per token
    # and keep the rotation): "-kr0".
    **{f"tq{b}-kr0": _budget_variant(b, key_rotation="none") for b in (4, 3, 2)},
    **{f"tq{b}-sw-kr0": _budget_variant(b, short_window=1024, key_rotation="none") for b in (4, 3, 2)},
    "tq-affine-k8v4-kr0": _preset_variant("tq-affine-k8v4", key_rotation="none"),
    # The newest tokens kept exact: every layer (CacheOptions.recent, "-r"), the sliding-window layers only
    # (CacheOptions.window_recent, "-wr"): local attention reads mostly its newest keys.
    **{f"tq4-r{r}": _budget_variant(4, recent=r) for r in (8, 16)},
    **{f"tq{b}-wr{r}": _budget_variant(b, window_recent=r) for b in (4, 3, 2) for r in (8, 16, 32)},
    # Issue 54: the budget presets as they are (window rule included) with the coded tail ("-ct": issue 47's layout,
    # its keys centred; exact until the first coded block, read by the kernel in the same call as the blocks).
    **{f"tq{b}-ct": _preset_variant(f"tq-{b}b", codec="kblock_vsym8_pt", center_keys=True) for b in (4, 3, 2)},
    # ... with the key offset in the library ("-ro": rope_offset, keys stored less their rotated pre-RoPE mean),
    # on the coded tail and on the presets as they are (exact tail)
    **{f"tq{b}-ct-ro": _preset_variant(f"tq-{b}b", codec="kblock_vsym8_pt", center_keys=True, rope_offset=True)
       for b in (4, 3, 2)},
    **{f"tq{b}-ro": _preset_variant(f"tq-{b}b", rope_offset=True) for b in (4, 3, 2)},
    # ... the coded tail's provisional keys at the block bits (E = 0: the budget holds from 512 tokens on)
    **{f"tq{b}-ct0-ro": _preset_variant(f"tq-{b}b", codec=_tail_layout(0), center_keys=True, rope_offset=True)
       for b in (4, 3, 2)},
    # ... uncentred: the offset takes out the keys' static mean (what centring did) without a second fitted mean
    **{f"tq{b}-pt0-ro": _preset_variant(f"tq-{b}b", codec=_tail_layout(0), rope_offset=True) for b in (4, 3, 2)},
    **{f"tq{b}-pt1-ro": _preset_variant(f"tq-{b}b", codec=_tail_layout(1), rope_offset=True) for b in (4, 3, 2)},
    # ... keys per token, coded once on arrival (no block, no provisional code, no second rounding), with the offset
    **{f"tq{b}-ks-ro": _preset_variant(f"tq-{b}b", codec=_token_layout(), group_size=None, code_batch=1,
                                       rope_offset=True) for b in (4, 3, 2)},
    **{f"tq{b}-ks32-ro": _preset_variant(f"tq-{b}b", codec=_token_layout(32), group_size=None, code_batch=1,
                                         rope_offset=True) for b in (4, 3, 2)},
    # ... on Lloyd-Max levels for the Gaussian (keys and values; same bytes)
    **{f"tq{b}-kl{g}-ro": _preset_variant(f"tq-{b}b", codec=_level_layout(g), group_size=None, code_batch=1,
                                          rope_offset=True) for b in (4, 3, 2) for g in (32, 64)},
    # issue 54's default question: the budget layout at 5-bit keys, 4-bit values (<= 5.0 bits from 512 tokens)
    "tq-k5v4": _options_dict(preset("tq-4b"), k_bits=5),
    # issue 54's item 3, inside each budget as shipped (token_lloyd8): no exact sink token ("-s0"); the same bytes
    # split otherwise between keys and values ("-kKvV")
    **{f"tq{b}-s0": _options_dict(preset(f"tq-{b}b"), sink=0) for b in (4, 3, 2)},
    **{f"tq{b}-k{k}v{v}": _options_dict(preset(f"tq-{b}b"), k_bits=k, v_bits=v)
       for b, k, v in ((4, 5, 3), (4, 3, 5), (3, 4, 2), (3, 2, 4))},
    # ... where its KL comes from: values or keys at 8 bits (over the budget: a diagnosis)
    "tq4-ks32-ro-v8": _preset_variant("tq-4b", codec=_token_layout(32), group_size=None, code_batch=1,
                                      rope_offset=True, v_bits=8),
    "tq4-ks32-ro-k8": _preset_variant("tq-4b", codec=_token_layout(32), group_size=None, code_batch=1,
                                      rope_offset=True, k_bits=8),
    **{f"tq{b}-ks": _preset_variant(f"tq-{b}b", codec=_token_layout(), group_size=None, code_batch=1)
       for b in (4, 3, 2)},
    # The seed's cache: two b-bit RVQ key streams, float16 values.
    "seed-rvq-b1": dict(kind="rvq", k_bits=1),
    "seed-rvq-b2": dict(kind="rvq", k_bits=2),
    "seed-rvq-b3": dict(kind="rvq", k_bits=3),
}
