"""The tables and the plot of ``benchmarks/quality.py``: the bit budgets (`BUDGETS`) and each row's verdict, the
text table printed after a run, the markdown written by ``--markdown`` (BENCHMARKS.md section), the PNG written
by ``--plot`` and the merge of saved runs (``--from-json``).

``quality.py`` imports them (``from _quality_tables import ...``: the script's folder is first on ``sys.path``); the
names are used there. Standard library only at
module level (``plot`` imports matplotlib when called).
"""
from __future__ import annotations

import json
import os

BUDGETS = (  # (bits, max dppl %, max KL or None, needle misses allowed: 9/9 -> 0, >= 8/9 -> 1)
    (2.25, 10.0, None, 1),
    (3.25, 3.0, 0.03, 0),
    (4.25, 1.0, 0.01, 0),
)


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


def pct(r):
    """Δppl in percent of the plain cache's perplexity."""
    return 100.0 * r["delta_ppl"] / (r["ppl"] - r["delta_ppl"])


def bits_table(results) -> str:
    """Markdown: each configuration's bits (every stored byte) at the reported lengths and averaged over a KL
    window's positions."""
    bits = results.get("bits") or {}
    if not bits:
        return ""
    lengths = sorted({int(n) for b in bits.values() for n in b["bits"]})
    head = ["method"] + [f"bits @{n}" for n in lengths] + [f"KL-window average @{n}" for n in lengths]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, b in bits.items():
        out.append("| " + " | ".join([name] + [f"{b['bits'][str(n)]:.3f}" for n in lengths]
                                     + [f"{b['kl_average_bits'][str(n)]:.3f}" for n in lengths]) + " |")
    return "\n".join(out) + "\n"


def rows_of(results):
    """(corpus, config, {context: row}) in run order; row = perplexity_eval's dict of that config (the contexts
    it ran at)."""
    for corpus, per in results["corpora"].items():
        names = list(dict.fromkeys(n for c in sorted(per["ppl"], key=int) for n in per["ppl"][c]))
        for name in names:
            yield corpus, name, {int(c): per["ppl"][c][name] for c in per["ppl"] if name in per["ppl"][c]}


def needle_of(results, name):
    n = (results.get("needle") or {}).get("results", {}).get(name)
    return n


def row_verdict(results, name, by_ctx):
    """The budget a config fits (its largest bits over the 2048 / 4096 contexts measured, else all) and whether
    that budget's targets are met at every context measured."""
    judged = [c for c in by_ctx if c >= 2048] or list(by_ctx)
    bits = max(by_ctx[c]["memory"]["bits_per_coordinate"] for c in judged)
    worst_dppl = max(pct(r) for r in by_ctx.values())
    worst_kl = max(r["kl"] for r in by_ctx.values())
    return (bits,) + verdict(bits, worst_dppl, worst_kl, needle_of(results, name))


def text_table(results) -> str:
    lines = []
    for corpus, name, by_ctx in rows_of(results):
        bits, budget, met = row_verdict(results, name, by_ctx)
        cells = " ".join(f"{c}: {by_ctx[c]['memory']['bits_per_coordinate']:.2f}b {pct(by_ctx[c]):+7.2f}% "
                         f"KL {by_ctx[c]['kl']:.4f} t1 {by_ctx[c]['top1']:.3f}" for c in sorted(by_ctx))
        n = needle_of(results, name)
        shown = f"{n['passed']}/{n['total']}" if n else "-"
        lines.append(f"{corpus:16s} {name:22s} {cells}  needle {shown}  {budget} {met}")
    for name, b in (results.get("bits") or {}).items():
        lines.append(f"bits {name:22s} " + " ".join(f"@{n}: {v:.3f}" for n, v in b["bits"].items())
                     + "  KL-window average " + " ".join(f"@{n}: {v:.3f}" for n, v in b["kl_average_bits"].items()))
    return "\n".join(lines)


def markdown(results, args) -> str:
    """The BENCHMARKS.md tables: one per corpus (every context), then the passkey results."""
    out = []
    needle = results.get("needle")
    for corpus, per in results["corpora"].items():
        ctxs = sorted(int(c) for c in per["ppl"])
        out.append(f"**{corpus}** ({per['tokens']:,} tokens; windows per context: "
                   + ", ".join(f"{c}: {per['ppl'][str(c)]['kv']['windows']}" for c in ctxs) + ")\n")
        head = ["method"] + [f"{k} @{c}" for c in ctxs for k in ("bits", "ppl", "Δppl", "KL", "top-1")]
        head += ["passkey", "budget", "targets met"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for c_name, name, by_ctx in rows_of(results):
            if c_name != corpus:
                continue
            bits, budget, met = row_verdict(results, name, by_ctx)
            cells = [name]
            for c in ctxs:
                r = by_ctx.get(c)
                cells += ([f"{r['memory']['bits_per_coordinate']:.2f}", f"{r['ppl']:.3f}", f"{pct(r):+.2f} %",
                           f"{r['kl']:.4f}", f"{r['top1']:.3f}"] if r else ["not run"] + [""] * 4)
            n = needle_of(results, name)
            cells += [f"{n['passed']}/{n['total']}" if n else "not run", budget,
                      "-" if met is None else ("yes" if met else "no")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if results.get("bits"):
        out.append("Bits per coordinate, every stored byte (`veloxquant_mlx.apps.eval.memory.measure_bits`, random tokens "
                   "in the model's attention shape), at each length and averaged over a KL window's positions:\n")
        out.append(bits_table(results))
    if needle:
        out.append(f"Passkey: filler from {needle['corpus']}, lengths {needle['lengths']} x depths "
                   f"{'/'.join(f'{100 * d:g}' for d in needle.get('depths', (0.1, 0.5, 0.9)))} %.\n")
    cal = results.get("calibration")
    if cal:
        out.append(f"`+cal`: calibration {cal['id']} ({cal['file']}, {cal['bytes']:,} bytes of arrays, per model), "
                   f"measured on {cal['text']['tokens']} tokens of {cal['text']['description']}.\n")
    return "\n".join(out) + "\n"


def plot(results, path):
    """Δppl (%) and KL against measured bits per coordinate (at the largest context run), a marker per
    method, a panel pair per corpus; log scales (mlx-q2 is off by orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(results["corpora"])
    fig, axes = plt.subplots(len(corpora), 2, figsize=(11, 4.2 * len(corpora)), squeeze=False)
    for i, corpus in enumerate(corpora):
        per = results["corpora"][corpus]["ppl"]
        ctx = max(per, key=int)
        for name, r in per[ctx].items():
            if name == "kv":
                continue
            bits = r["memory"]["bits_per_coordinate"]
            for ax, y in ((axes[i][0], max(pct(r), 1e-3)), (axes[i][1], max(r["kl"], 1e-5))):
                ax.scatter(bits, y, marker="s" if name.startswith("mlx") else "o")
                ax.annotate(name, (bits, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for ax, label, goals in ((axes[i][0], "Δppl vs plain cache (%)", (1, 3, 10)), (axes[i][1], "KL (nats/token)",
                                                                                   (0.01, 0.03))):
            ax.set_yscale("log")
            ax.set_xlabel("bits per coordinate (measured, every stored byte)")
            ax.set_ylabel(label)
            ax.set_title(f"{corpus}, context {ctx}", fontsize=9)
            for x in (2.25, 3.25, 4.25):
                ax.axvline(x, color="grey", lw=0.5, ls=":")
            for g in goals:
                ax.axhline(g, color="red", lw=0.5, ls=":")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _without(run, names):
    """``run`` without the configs ``names`` (their rows, bits, descriptions and passkey results)."""
    names = set(names)
    run = json.loads(json.dumps(run))
    for key in ("configs", "bits"):
        for n in names & set(run.get(key) or {}):
            del run[key][n]
    for per in run["corpora"].values():
        for rows in per["ppl"].values():
            for n in names & set(rows):
                del rows[n]
    for n in names & set((run.get("needle") or {}).get("results", {})):
        del run["needle"]["results"][n]
    return run


def merge(runs, drop=()):
    """Several saved runs as one: their contexts, bits per length and passkey results side by side (later runs
    win). ``drop``:
    configs whose definition changed after the earlier runs: only the last run's rows of them are kept."""
    runs = [_without(r, drop) for r in runs[:-1]] + runs[-1:] if drop else runs
    out = {"model": runs[0]["model"], "command": " ; ".join(r.get("command", "") for r in runs), "configs": {},
           "corpora": {}, "needle": None}
    for r in runs:
        out["configs"].update(r["configs"])
        for name, per in (r.get("bits") or {}).items():  # per length: a run at other lengths adds to them
            dst = out.setdefault("bits", {}).setdefault(name, {})
            for key, value in per.items():
                if isinstance(value, dict):
                    dst.setdefault(key, {}).update(value)
                else:
                    dst[key] = value
        for corpus, per in r["corpora"].items():
            dst = out["corpora"].setdefault(corpus, {"tokens": per["tokens"], "ppl": {}})
            for ctx, rows in per["ppl"].items():
                dst["ppl"].setdefault(ctx, {}).update(rows)
        if r.get("calibration"):
            if out.get("calibration", r["calibration"])["id"] != r["calibration"]["id"]:
                raise SystemExit("--from-json: the runs used different calibrations; merge runs of one calibration")
            out["calibration"] = r["calibration"]
        if r.get("needle"):
            if out["needle"] is None:
                out["needle"] = {"corpus": r["needle"]["corpus"], "lengths": [], "results": {}}
            out["needle"]["lengths"] = sorted(set(out["needle"]["lengths"]) | set(r["needle"]["lengths"]))
            if r["needle"].get("depths"):
                out["needle"]["depths"] = sorted(set(out["needle"].get("depths", [])) | set(r["needle"]["depths"]))
            for name, n in r["needle"]["results"].items():  # the same config at other lengths: add the cases up
                acc = out["needle"]["results"].setdefault(name, {"passed": 0, "total": 0})
                acc["passed"] += n["passed"]
                acc["total"] += n["total"]
    return out
