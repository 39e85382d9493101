"""Quality of our caches against mlx-lm's on SmolLM2-135M, in one run over the same windows.

For each configuration: perplexity and its change against the plain KVCache, KL (nats/token) and top-1
agreement in lockstep with it (veloxquant_mlx.eval.perplexity_eval), stored bytes per token and bits per
coordinate (every stored byte — codes, norms, exact windows, fitted means/outlier indices — over the
cached K and V coordinates, taken from the caches holding one full window), and optionally the 9-case
needle (passkey) test. Each row says which bit budget it fits and whether it meets that budget's targets:

    <= 4.25 bits: dppl <= +1 %, KL <= 0.01, needle 9/9
    <= 3.25 bits: dppl <= +3 %, needle 9/9
    <= 2.25 bits: dppl <= +10 %, needle >= 8/9

    python benchmarks/quality.py --contexts 512,2048 --windows 1,1 --needle --out results/quality.json
    python benchmarks/quality.py --configs k5v3-o8,mlx-q4 --contexts 4096 --windows 1

The CPU build of MLX is slow in float16: the model runs in float32 (mlx_lm's plain cache then stores
float32, and our exact windows are float32 too, which the byte counts include).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from veloxquant_mlx.blas import ensure_openblas

ensure_openblas()


import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.eval import (  # noqa: E402
    CacheSpec,
    baseline_specs,
    corpus_tokens,
    model_kv_shape,
    passkey_eval,
    perplexity_eval,
)
from veloxquant_mlx.models.loader import load_model  # noqa: E402

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
    # The registered configurations (veloxquant_mlx.eval.specs): first 4 tokens exact.
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
    # The seed's cache: two b-bit RVQ key streams, float16 values.
    "seed-rvq-b1": dict(kind="rvq", k_bits=1),
    "seed-rvq-b2": dict(kind="rvq", k_bits=2),
    "seed-rvq-b3": dict(kind="rvq", k_bits=3),
}
DEFAULT = "kv,mlx-q4,mlx-q2,k4v4,k5v3,k5v3-o8,k4v3-o8,k4v2-o8,k3v2-o8,k3v1-o8,seed-rvq-b1,seed-rvq-b2,seed-rvq-b3"
BUDGETS = (  # (bits, max dppl %, max KL or None, needle misses allowed: 9/9 -> 0, >= 8/9 -> 1)
    (2.25, 10.0, None, 1),
    (3.25, 3.0, None, 0),
    (4.25, 1.0, 0.01, 0),
)


class Recorder:
    """Cache factory that remembers the caches it made last (to count their bytes after a run)."""

    def __init__(self, factory):
        self.factory, self.last = factory, None

    def __call__(self, model):
        self.last = self.factory(model)
        return self.last


def stored_bytes(caches) -> int:
    """Bytes of the live data: our caches' ``live_nbytes``; mlx_lm's ``nbytes`` (exact at multiples of 256)."""
    return sum(int(getattr(c, "live_nbytes", c.nbytes)) for c in caches)


def make_specs(names):
    base = {s.name: s for s in baseline_specs()}
    specs = []
    for name in names:
        if name in base:
            s = base[name]
            specs.append(CacheSpec(s.name, Recorder(s.make_cache), s.family, s.bits, s.description))
        elif name in OURS:
            opts = OURS[name]
            specs.append(CacheSpec(name, Recorder(lambda m, o=opts: vq.make_prompt_cache(m, **o)),
                                   "veloxquant", None, json.dumps(opts)))
        else:
            raise SystemExit(f"unknown config {name!r}; choose from {sorted(base) + sorted(OURS)}")
    return specs


def verdict(bits, dppl_pct, kl, needle):
    """The tightest budget the bits fit, and whether its targets are met (None where not measured)."""
    for budget, max_dppl, max_kl, misses in BUDGETS:
        if bits <= budget + 1e-9:
            checks = [dppl_pct <= max_dppl]
            if max_kl is not None:
                checks.append(kl <= max_kl)
            if needle is not None:
                checks.append(needle["total"] - needle["passed"] <= misses)
            return f"<={budget:g}", all(checks)
    return ">4.25", None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--configs", default=DEFAULT, help="comma list of baseline and OURS names")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--windows", default="1,1", help="windows per context (one number, or one per context)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--needle", action="store_true", help="also run the passkey test (9 cases by default)")
    ap.add_argument("--needle-lengths", default="1024,2048,4096", help="passkey prompt lengths (x 3 depths)")
    ap.add_argument("--needle-configs", default=None, help="configs for the passkey test (default: all)")
    ap.add_argument("--out", default="results/quality.json")
    args = ap.parse_args(argv)

    names = [n for n in args.configs.split(",") if n]
    if "kv" not in names:
        names.insert(0, "kv")
    contexts = [int(c) for c in args.contexts.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    windows = windows * len(contexts) if len(windows) == 1 else windows
    if len(windows) != len(contexts):
        raise SystemExit("--windows needs one value or one per context")

    model, tokenizer = load_model(args.model)
    n_layers, kv_heads, head_dim = model_kv_shape(model)
    tokens = corpus_tokens(tokenizer, min_tokens=max(c * w for c, w in zip(contexts, windows)) + 1)
    specs = make_specs(names)
    results = {"model": args.model, "configs": {s.name: s.description for s in specs}, "ppl": {}, "needle": None}

    for ctx, nw in zip(contexts, windows):
        t0 = time.time()
        reference = next(s for s in specs if s.name == "kv")
        r = perplexity_eval(model, tokens, specs, context=ctx, n_windows=nw, chunk=args.chunk, reference=reference)
        for s in specs:
            b = stored_bytes(s.make_cache.last)
            r[s.name]["bytes_per_token"] = b / ctx
            r[s.name]["bits_per_coordinate"] = 8.0 * b / (ctx * n_layers * 2 * kv_heads * head_dim)
            r[s.name].pop("memory", None)
        results["ppl"][str(ctx)] = r
        print(f"[context {ctx}, {nw} window(s): {time.time() - t0:.0f} s]", file=sys.stderr)
        save(args.out, results)  # keep what is measured even if a later stage is interrupted

    if args.needle:
        filler = corpus_tokens(tokenizer)
        chosen = set(args.needle_configs.split(",")) if args.needle_configs else {s.name for s in specs}
        lengths = [int(x) for x in args.needle_lengths.split(",")]
        out = passkey_eval(model, tokenizer, filler, [s for s in specs if s.name in chosen], lengths=lengths)
        results["needle"] = {k: {"passed": v["passed"], "total": v["total"]} for k, v in out.items()}

    # table
    print(f"{'config':16s} {'bits':>5s} " + " ".join(f"{'dppl@' + str(c):>10s} {'KL@' + str(c):>8s} {'top1':>6s}"
                                               for c in contexts) + "  needle  budget  met")
    for s in specs:
        rows = [results["ppl"][str(c)][s.name] for c in contexts]
        bits = max(r["bits_per_coordinate"] for r in rows)
        cells = " ".join(f"{100 * r['delta_ppl'] / (r['ppl'] - r['delta_ppl']):+9.2f}% {r['kl']:8.4f} {r['top1']:6.3f}"
                         for r in rows)
        needle = (results["needle"] or {}).get(s.name)
        worst_dppl = max(100 * r["delta_ppl"] / (r["ppl"] - r["delta_ppl"]) for r in rows)
        budget, met = verdict(bits, worst_dppl, max(r["kl"] for r in rows), needle)
        for r in rows:
            r["budget"], r["targets_met"] = budget, met
        shown = f"{needle['passed']}/{needle['total']}" if needle else "-"
        print(f"{s.name:16s} {bits:5.2f} {cells}  {shown:>6}  {budget:>6s}  {met}")

    save(args.out, results)
    print(f"wrote {args.out}", file=sys.stderr)


def save(path, results):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
