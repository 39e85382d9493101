"""Baseline measurements of mlx-lm's caches on the embedded SmolLM2-135M-Instruct.

One command (from the repository root):

    python -m benchmarks.probes.baselines               # full: 512/2048/4096, writes results/baselines.json

Perplexity / KL / top-1 of every baseline (KVCache, QuantizedKVCache 8/4/2 bits, group 64)
against the plain KVCache on fixed Debian Reference windows (window i starts at token i*context),
passkey retrieval (1k/2k/4k tokens, depths 10/50/90 %), stored bytes per token, bits per
coordinate, decode tok/s and peak memory. Prints a markdown table. Options shrink the run for
slow machines (``--windows``, ``--needle-lengths``); the JSON records what was run.
"""
from __future__ import annotations

import json
import os
import sys
import time

from veloxquant_mlx.blas import ensure_openblas  # (must run before mlx is imported)

from benchmarks import _common
from benchmarks._common import ints


def parse_args(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--contexts", type=ints, default=[512, 2048, 4096], help="perplexity contexts")
    p.add_argument("--windows", type=ints, default=[4, 2, 1],
                   help="windows per context (one number for all, or one per context)")
    p.add_argument("--needle-lengths", type=ints, default=[1024, 2048, 4096],
                   help="passkey prompt lengths for every method")
    p.add_argument("--needle-ref-lengths", type=ints, default=None,
                   help="passkey lengths for the plain KVCache (default: --needle-lengths)")
    p.add_argument("--speed-context", type=int, default=512, help="context for prefill/decode speed")
    p.add_argument("--decode-tokens", type=int, default=32)
    _common.add_model(p)
    p.add_argument("--methods", default="all", help="comma-separated baseline names (default: all four)")
    p.add_argument("--stages", default="speed,ppl,needle", help="which of speed,ppl,needle to run")
    p.add_argument("--merge", action="store_true",
                   help="update an existing --out file instead of starting a new one (runs split over time)")
    _common.add_out(p, "results/baselines.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def markdown_table(results: dict) -> str:
    head = ["method", "ctx", "ppl", "Δppl", "KL (nats/tok)", "top-1", "needle", "bytes/token (all layers)",
            "bits/coord", "decode tok/s"]
    rows = []
    for name, r in results["methods"].items():
        needle = r.get("needle")
        nd = f"{needle['passed']}/{needle['total']}" if needle else "-"
        sp = r.get("speed", {})
        for ctx, p in sorted(r.get("ppl", {}).items(), key=lambda kv: int(kv[0])):
            rows.append([name, ctx, f"{p['ppl']:.3f}", f"{p['delta_ppl']:+.3f}", f"{p['kl']:.4f}", f"{p['top1']:.3f}",
                         nd, f"{sp.get('bytes_per_token', float('nan')):.0f}",
                         f"{sp.get('bits_per_coordinate', float('nan')):.2f}",
                         f"{sp.get('decode_tokens_per_s', float('nan')):.1f}"])
    return _common.markdown_table(head, rows)


def main(argv=None):
    ensure_openblas()
    args = parse_args(argv)
    from veloxquant_mlx.eval import (
        baseline_specs, corpus_tokens, passkey_eval, perplexity_eval, speed_eval,
    )
    from veloxquant_mlx.models import load_model

    windows = args.windows * len(args.contexts) if len(args.windows) == 1 else args.windows
    if len(windows) != len(args.contexts):
        raise SystemExit("--windows: give one number or one per context")
    t_start = time.time()
    model, tok = load_model(args.model)
    tokens = corpus_tokens(tok)
    specs = baseline_specs()
    if args.methods != "all":
        wanted = args.methods.split(",")
        unknown = set(wanted) - {s.name for s in specs}
        if unknown:
            raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in wanted]
    stages = set(args.stages.split(","))
    progress = not args.no_progress
    res = {
        "model": args.model,
        "machine": _common.machine_info(),
        "command": "python -m benchmarks.probes.baselines " + " ".join(sys.argv[1:] if argv is None else argv),
        "corpus_tokens": len(tokens),
        "settings": {"contexts": args.contexts, "windows": windows, "chunk": 256,
                     "needle_lengths": args.needle_lengths,
                     "needle_ref_lengths": args.needle_ref_lengths or args.needle_lengths,
                     "speed_context": args.speed_context, "decode_tokens": args.decode_tokens},
        "methods": {s.name: {"description": s.description, "bits": s.bits, "ppl": {}} for s in specs},
    }

    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        for name, v in res["methods"].items():
            old["methods"].setdefault(name, v)
        old.setdefault("runs", []).append({"command": res["command"], "settings": res["settings"]})
        res = old

    def save():
        res["elapsed_s"] = time.time() - t_start
        _common.write_json(args.out, res, quiet=True)

    if "speed" in stages:
        for s in specs:
            res["methods"][s.name]["speed"] = speed_eval(
                model, tokens, s, args.speed_context, decode_tokens=args.decode_tokens, progress=progress)
            save()
    if "ppl" in stages:
        for ctx, nw in zip(args.contexts, windows):
            r = perplexity_eval(model, tokens, specs, ctx, n_windows=nw, progress=progress)
            for name, v in r.items():
                if name in res["methods"]:
                    res["methods"][name]["ppl"][str(ctx)] = v
            save()
    if "needle" in stages:
        ref = [s for s in specs if s.name == "kv"]
        if ref:
            ref_lengths = args.needle_ref_lengths or args.needle_lengths
            r = passkey_eval(model, tok, tokens, ref, lengths=ref_lengths, progress=progress)
            res["methods"]["kv"]["needle"] = r["kv"]
            save()
        for s in [s for s in specs if s.name != "kv"]:
            if args.needle_lengths:
                r = passkey_eval(model, tok, tokens, [s], lengths=args.needle_lengths, progress=progress)
                res["methods"][s.name]["needle"] = r[s.name]
                save()
    print(markdown_table(res))
    print(f"\nwrote {args.out} in {res['elapsed_s']:.0f} s; BLAS: {res['machine']['blas']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
