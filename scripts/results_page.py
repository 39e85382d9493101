"""The results page and the README's results table, generated from the benchmark JSONs under ``results/``.

    python scripts/results_page.py                 # results/*.json -> docs/results.md, docs/results-*.svg, README table
    python scripts/results_page.py --results DIR --docs DIR --readme FILE

Every figure on the page and in the README's table is read from a JSON a command wrote; a section whose JSON is
missing says which command makes it. Known inputs (`SOURCES`):

- ``results/demo.json``: ``veloxquant demo --out results/demo.json`` (every registered method against mlx_lm's
  plain and quantized caches on one perplexity slice: bits, KV memory, perplexity, KL, decode speed, an answer);
  the README's table and the KL-against-bits plot come from it;
- ``results/quality.json``: ``benchmarks/quality.py`` (perplexity / KL per corpus and context, passkey);
- ``results/e2e_speed.json``: ``benchmarks/e2e_speed.py`` (prefill and decode speed against the plain cache at a
  long prompt, peak memory); the speed plot comes from it;
- ``results/memory.json``: ``benchmarks/memory.py`` (peak memory of a long prefill + decode).

Any other JSON under ``results/`` is listed by name (present, not summarized). The plots are SVG written here by
hand (no plotting library needed). The README's table goes between ``<!-- results:begin -->`` and
``<!-- results:end -->``; without ``results/demo.json`` the README is left as it is (its table is never replaced by
nothing). Standard library only, plus `veloxquant_mlx.cache.options` for the default's and the budgets' names.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.cache.presets import BUDGETS, DEFAULT_NAME  # noqa: E402
# The SVG plots (written by hand) live in _results_plots.py.
from _results_plots import svg_bars, svg_grid, svg_scatter  # noqa: E402

COMMAND = "python scripts/results_page.py"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# file -> (what it holds, the command that writes it)
SOURCES = {
    "demo.json": ("every method on one perplexity slice of SmolLM2 (the README's table)",
                  "veloxquant demo --out results/demo.json"),
    "quality.json": ("perplexity / KL per corpus and context, passkey (the README's first table and plot)",
                     "python benchmarks/quality.py --contexts 2048,4096 --windows 1,1 --needle "
                     "--bits-lengths 512,2048,4096 --configs kv,mlx-q8,mlx-q4,tq-affine-k8v4,tq-4b,tq-3b,tq-2b "
                     "--out results/quality.json"),
    "e2e_speed.json": ("prefill / decode speed and peak memory at a long prompt",
                       "python benchmarks/e2e_speed.py --configs kv,mlx-q8,mlx-q4,tq-affine-k8v4,tq-4b,tq-3b,tq-2b "
                       "--out results/e2e_speed.json"),
    "memory.json": ("peak memory of a long prefill + decode through mlx_lm",
                    "python benchmarks/memory.py --prompt 4096 --decode 100 --out results/memory.json"),
    "quality_gemma.json": ("Gemma 3 270M: perplexity / KL per corpus at 2048 and 8192 tokens",
                           "python benchmarks/quality.py --model gemma3-270m --contexts 2048,8192 --windows 1,1 "
                           "--bits-lengths 2048,8192 --configs kv,mlx-q8,mlx-q4,tq-affine-k8v4,tq-affine-k8v8,"
                           "tq-affine-k4v4,tq-4b,tq-3b,tq-2b,tq4-sw,win:tq-4b,glob:tq-4b "
                           "--context-configs 8192=mlx-q8,tq-affine-k8v4,tq-4b --out results/quality_gemma.json"),
    "long_context.json": ("Gemma 3 270M to 32768 tokens: KV bytes, peak memory, prefill and paired decode speed",
                          "python benchmarks/long_context.py --model gemma3-270m --lengths 4096,8192,32768 "
                          "--out results/long_context.json"),
}
QUALITY_FILES = ("quality.json", "quality_gemma.json")
CORPUS_NAMES = {"debian-reference": "Debian", "kjv": "Bible"}
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}
MLX_BASELINES = ("mlx-q8", "mlx-q4")
PLAIN = "kv"


# ----------------------------------------------------------------------------------------------------- reading

def load(results: Path) -> Dict[str, dict]:
    """Every ``*.json`` directly under ``results`` that parses, by file name (a broken one is reported, skipped)."""
    found = {}
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        try:
            found[path.name] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            print(f"results_page: skipped {path}: {e}", file=sys.stderr)
    return found


def stamp(results: Path, name: str) -> str:
    """The JSON file's modification date (UTC), the only date a run leaves."""
    t = (results / name).stat().st_mtime
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d")


def headline_names(methods: Sequence[str]) -> List[str]:
    """The README's rows, in order: the plain cache, mlx_lm's 8- and 4-bit caches, the default, the budget presets
    (each only when the run has it)."""
    wanted = [PLAIN, *MLX_BASELINES, DEFAULT_NAME, *BUDGETS]
    return [n for n in wanted if n in methods]


def demo_presets(demo: dict) -> dict:
    """A demo run's per-preset results: key ``presets`` (``methods`` in runs before issue 57, still read)."""
    return demo.get("presets", demo.get("methods", {}))


def demo_rows(demo: dict, names: Optional[Sequence[str]] = None) -> List[dict]:
    """One row per preset of a demo run: name, bits, KV MiB, ppl, Δppl, KL, decode tok/s, answer."""
    methods = demo_presets(demo)
    rows = []
    for name in (names if names is not None else list(methods)):
        r = methods[name]
        p = r["ppl"]
        rows.append({"name": name, "bits": p["memory"]["bits_per_coordinate"], "mib": p["memory"]["mib_total"],
                     "ppl": p["ppl"], "dppl": p["delta_ppl"], "kl": p["kl"], "tok_s": r.get("decode_tokens_per_s"),
                     "answer": r.get("answer", "")})
    return rows


def speed_rows(e2e: dict) -> List[dict]:
    """e2e_speed.json's rows: config, decode (step loop, else mlx_lm loop) and prefill ratios to the plain cache."""
    out = []
    for r in e2e.get("rows", []):
        decode = r.get("decode_step_vs_kv", r.get("decode_mlx_lm_vs_kv"))
        out.append({"name": r["config"], "decode_vs_kv": decode, "decode_tok_s": r.get(
            "decode_step_tok_s", r.get("decode_mlx_lm_tok_s")), "prefill_vs_kv": r.get("prefill_vs_kv"),
            "peak_mib": r.get("peak_mib"), "cache_mib": r.get("cache_mib")})
    return out


# ----------------------------------------------------------------------------------------------------- tables

def _f(x, fmt: str, missing: str = "not measured") -> str:
    return missing if x is None else format(x, fmt)


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


BITS_AT = 2048  # a round length, not a block boundary: the demo's 513 tokens close the budgets' 128-token blocks


def bits_at(name: str, tokens: int = BITS_AT) -> Optional[float]:
    """Bits per coordinate (every stored byte) of method ``name``'s cache holding ``tokens`` random tokens of
    SmolLM2's attention shape (3 KV heads, head_dim 64: the demo's model), or None for a name no spec resolves."""
    from veloxquant_mlx.apps.eval.memory import measure_bytes_per_token
    from veloxquant_mlx.apps.eval.specs import resolve_spec

    try:
        spec = resolve_spec(name)
    except (KeyError, ValueError):
        return None
    return measure_bytes_per_token(spec.make_cache, 3, 64, context=tokens)["bits_per_coordinate"]


def gemma_rows(quality: Optional[dict], lc: Optional[dict]) -> Tuple[List[str], List[List[str]]]:
    """The README's second table: a model with sliding windows (Gemma 3 270M) at 2048 / 8192 tokens (KL per corpus,
    bits) and at the longest length of long_context.json (KV bytes, paired decode and unpaired prefill ratios)."""
    names = [PLAIN, "mlx-q8", DEFAULT_NAME] + [b for b in BUDGETS if b == "tq-4b"] + ["tq-4b+cal"]
    head, rows = ["cache"], {n: [] for n in names}
    if quality:
        ctxs = sorted({c for per in quality.get("corpora", {}).values() for c in per.get("ppl", {})}, key=int)
        bits = quality.get("bits") or {}
        for c in ctxs:
            head.append(f"bits @{c}")
            for n in names:
                rows[n].append(_f((bits.get(n) or {}).get("bits", {}).get(c), ".2f", "-"))
        for corpus, per in quality.get("corpora", {}).items():
            for c in ctxs:
                head.append(f"KL {CORPUS_NAMES.get(corpus, corpus)} @{c}")
                for n in names:
                    r = per.get("ppl", {}).get(c, {}).get(n)
                    rows[n].append("-" if r is None else f"{r['kl']:.4f}")
    if lc and lc.get("runs"):
        run = max(lc["runs"], key=lambda r: r["length"])
        by = {PLAIN if c == "plain" else DEFAULT_NAME if c == "default" else c: c for c in lc.get("configs", [])}
        base = run["configs"][lc["configs"][0]]
        L = run["length"]
        head += [f"KV MiB @{L}", f"decode x plain @{L}", f"prefill x plain @{L}"]
        for n in names:
            r = run["configs"].get(by.get(n, ""))
            ratio = None if r is None else r.get(f"decode_x_{lc['configs'][0]}", [1.0] if r is base else None)
            rows[n] += (["-"] * 3 if r is None else
                        [f"{r['cache_bytes'] / 2**20:.1f}", _f(None if ratio is None else ratio[0], ".2f", "-"),
                         f"{base['prefill_s'] / r['prefill_s']:.2f}"])
    label = {PLAIN: "mlx_lm plain", "mlx-q8": "mlx_lm 8-bit", DEFAULT_NAME: f"`{DEFAULT_NAME}` (default)",
             "tq-4b+cal": "`tq-4b` calibrated"}
    return head, [[label.get(n, f"`{n}`")] + rows[n] for n in names if any(x != "-" for x in rows[n])]


def quality_headline(q: dict, e2e: Optional[dict]) -> Tuple[List[str], List[List[str]]]:
    """The README's first table from a quality.py JSON (issue 54's picture): per headline cache the bits at each
    context (`measure_bits` at that length, else the evaluated cache's), KL per corpus and context, passkey, and the
    paired decode ratio of e2e_speed.json."""
    corpora = q.get("corpora", {})
    ctxs = sorted({c for per in corpora.values() for c in per.get("ppl", {})}, key=int)
    present = [n for per in corpora.values() for c in ctxs for n in per["ppl"].get(c, {})]
    names = headline_names(list(dict.fromkeys(present)))
    needle = (q.get("needle") or {}).get("results") or {}
    speed = {r["name"]: r for r in speed_rows(e2e)} if e2e else {}
    head = ["cache"] + [f"bits @{c}" for c in ctxs]
    head += [f"KL {CORPUS_NAMES.get(corpus, corpus)} @{c}" for corpus in corpora for c in ctxs]
    if needle:
        head.append("passkey")
    if e2e:
        head.append(f"decode x plain @{e2e.get('prompt')}")
    rows = []
    for n in names:
        label = {PLAIN: "mlx_lm plain", "mlx-q8": "mlx_lm 8-bit", "mlx-q4": "mlx_lm 4-bit"}.get(
            n, f"`{n}`" + (" (default)" if n == DEFAULT_NAME else ""))
        row = [label]
        for c in ctxs:
            b = ((q.get("bits") or {}).get(n) or {}).get("bits", {}).get(c)
            if b is None:
                r = next((per["ppl"].get(c, {}).get(n) for per in corpora.values() if n in per["ppl"].get(c, {})), None)
                b = None if r is None else r["memory"]["bits_per_coordinate"]
            row.append(_f(b, ".2f", "-"))
        for per in corpora.values():
            for c in ctxs:
                r = per["ppl"].get(c, {}).get(n)
                row.append("-" if r is None else f"{r['kl']:.4f}")
        if needle:
            v = needle.get(n)
            row.append("-" if v is None else f"{v['passed']}/{v['total']}")
        if e2e:
            row.append(_f(speed.get(n, {}).get("decode_vs_kv"), ".2f") + ("x" if n in speed else ""))
        rows.append(row)
    return head, rows


def _passkey_sentence(needle: dict) -> str:
    """How the passkey column was measured (empty without results)."""
    if not needle.get("results"):
        return ""
    lengths = ", ".join(str(n) for n in needle.get("lengths", []))
    depths = " / ".join(f"{100 * x:g}" for x in needle.get("depths") or [])
    corpus = CORPUS_NAMES.get(needle.get("corpus"), needle.get("corpus", "?"))
    return (f" Passkey: retrieved / cases (prompts of {lengths} tokens, "
            + (f"the key at {depths} % depth, " if depths else "") + f"{corpus} filler).")


def readme_block(demo: Optional[dict], e2e: Optional[dict], when: str, gemma_quality: Optional[dict] = None,
                 long_context: Optional[dict] = None, quality: Optional[dict] = None,
                 quality_when: str = "") -> str:
    """The README's results table (and its plot), between the markers: from quality.json when it has the headline
    caches (KL on two corpora at each context), else from the demo's one slice."""
    if quality and quality_headline(quality, e2e)[1]:
        head, rows = quality_headline(quality, e2e)
        needle = quality.get("needle") or {}
        lines = [BEGIN,
                 f"`benchmarks/quality.py` ({quality_when}; the embedded SmolLM2-135M in float32, held-out text of "
                 "two corpora, one window per context, chunked prefill, every cache against mlx_lm's plain one in "
                 "lockstep), tabled by `" + COMMAND + "`. Bits: every stored byte (`measure_bits`) of the cache "
                 "holding that many tokens. KL: nats per token against the plain cache."
                 + _passkey_sentence(needle)
                 + (f" Decode: paired steps against the plain cache at a {e2e.get('prompt')}-token prompt "
                    f"(`benchmarks/e2e_speed.py`, {e2e.get('machine', 'machine not recorded')})." if e2e else
                    f" Paired decode speed: `{SOURCES['e2e_speed.json'][1]}`.")
                 + " Commands and every figure: [docs/results.md](docs/results.md).",
                 "", table(head, rows), "",
                 "![KL against bits, both corpora, each context](docs/results-kl-bits-quality.svg)"]
        return _with_gemma(lines, gemma_quality, long_context)
    names = headline_names(list(demo_presets(demo)))
    speed = {r["name"]: r for r in speed_rows(e2e)} if e2e else {}
    ctx = demo.get("context")
    head = ["cache", f"bits / coordinate @{ctx}", f"bits @{BITS_AT}", f"KV MiB @{ctx}", "KL (nats/token)", "Δppl",
            f"decode tok/s @{ctx}"]
    if e2e:
        head.append(f"decode x plain @{e2e.get('prompt')}")
    rows = []
    for r in demo_rows(demo, names):
        label = {PLAIN: "mlx_lm plain", "mlx-q8": "mlx_lm 8-bit", "mlx-q4": "mlx_lm 4-bit"}.get(
            r["name"], f"`{r['name']}`" + (" (default)" if r["name"] == DEFAULT_NAME else ""))
        row = [label, f"{r['bits']:.2f}", _f(bits_at(r["name"]), ".2f"), f"{r['mib']:.2f}", f"{r['kl']:.4f}",
               f"{r['dppl']:+.3f}", _f(r["tok_s"], ".1f")]
        if e2e:
            row.append(_f(speed.get(r["name"], {}).get("decode_vs_kv"), ".2f") + ("x" if r["name"] in speed else ""))
        rows.append(row)
    lines = [BEGIN,
             f"`veloxquant demo --out results/demo.json` ({when}; the embedded SmolLM2-135M, a {ctx}-token "
             f"perplexity slice, attention {demo.get('attention_path', 'path not recorded')})" + (f" and `benchmarks/e2e_speed.py` ({e2e.get('prompt')}-token prompt, "
                            f"{e2e.get('machine', 'machine not recorded')})" if e2e else "")
             + f", tabled by `{COMMAND}`. Bits @{BITS_AT}: the same caches holding {BITS_AT} random tokens of "
             "SmolLM2's shape (every stored byte, the exact tokens waiting for a block included). The demo's decode speed is one unpaired run at a short context; "
             + ("the paired speed against the plain cache is the last column." if e2e else
                f"paired speed against the plain cache: `{SOURCES['e2e_speed.json'][1]}`.")
             + " More: [docs/results.md](docs/results.md).",
             "", table(head, rows), "",
             "![KL against bits per coordinate](docs/results-kl-bits.svg)"]
    return _with_gemma(lines, gemma_quality, long_context)


def _with_gemma(lines: List[str], gemma_quality: Optional[dict], long_context: Optional[dict]) -> str:
    if gemma_quality or long_context:
        g_head, g_rows = gemma_rows(gemma_quality, long_context)
        lines += ["", "Gemma 3 270M (the embedded GGUF in float32; 15 of its 18 layers a 512-token sliding window): KL "
                  "from `benchmarks/quality.py` (one window per length and corpus), bits by `measure_bits` in the "
                  "model's own layout (a window layer counted as holding every position; mlx_lm's rows as the "
                  "evaluation builds them, a `KVCache` / `QuantizedKVCache` in every layer: mlx_lm cannot quantize "
                  "a `RotatingKVCache`, and its own plain layout, float32 windows of 512, is the long-context "
                  "columns' plain), the longest context from `benchmarks/long_context.py` "
                  f"({(long_context or {}).get('machine', 'not run')}; decode paired, prefill one run each). "
                  "Commands and every figure: [docs/results.md](docs/results.md).", "", table(g_head, g_rows)]
    return "\n".join(lines + [END])


def quality_section(q: dict, name: str, when: str) -> List[str]:
    """A quality.py JSON's tables: bits, Δppl and KL per method, context and corpus; passkey if run."""
    out = [f"## Quality per corpus and context, {MODEL_NAMES.get(q.get('model'), q.get('model', 'model not recorded'))} "
           f"(`results/{name}`, {when})", "", f"`{q.get('command') or SOURCES[name][1]}`", ""]
    for corpus, per in q.get("corpora", {}).items():
        ctxs = sorted(per.get("ppl", {}), key=int)
        names = list(dict.fromkeys(n for c in ctxs for n in per["ppl"][c]))
        head = ["method"] + [f"{k} @{c}" for c in ctxs for k in ("bits", "Δppl", "KL")]
        rows = []
        for method in names:
            cells = [method]
            for c in ctxs:
                r = per["ppl"][c].get(method)
                cells += ([f"{r['memory']['bits_per_coordinate']:.2f}", f"{r['delta_ppl']:+.3f}",
                           f"{r['kl']:.4f}"] if r else ["not run", "", ""])
            rows.append(cells)
        out += [f"**{corpus}** ({per.get('tokens', '?')} tokens)", "", table(head, rows), ""]
    needle = (q.get("needle") or {}).get("results")
    if needle:
        lengths = (q.get("needle") or {}).get("lengths")
        out += [f"Passkey retrieval (prompt lengths {lengths}): "
                + ", ".join(f"{n} {v['passed']}/{v['total']}" for n, v in needle.items()), ""]
    return out


def long_context_rows(run: dict, configs: Sequence[str]) -> List[List[str]]:
    """One length of long_context.json: per config KV bytes and their share of the first config's, bits, peak
    memory, prefill and decode (paired against the first config)."""
    base = run["configs"][configs[0]]
    rows = []
    for c in configs:
        r = run["configs"].get(c)
        if r is None:
            continue
        ratio = r.get(f"decode_x_{configs[0]}")
        peak = r.get("peak_process_bytes")
        rows.append([c, f"{r['cache_bytes'] / 2**20:.2f}", f"{r['cache_bytes'] / base['cache_bytes']:.3f}",
                     f"{r['bits']:.2f}", _f(None if peak is None else peak / 2**20, ".0f"),
                     f"{r['peak_mlx_bytes'] / 2**20:.1f}", f"{r['prefill_s']:.1f}",
                     f"{base['prefill_s'] / r['prefill_s']:.2f}", f"{r['decode_tok_s']:.2f}",
                     "-" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"])
    return rows


LONG_HEAD = ["cache", "KV MiB", "KV / plain", "bits", "peak process MiB", "peak MLX +MiB", "prefill s",
             "prefill x plain", "decode tok/s", "decode x plain [95%]"]


def long_context_section(lc: dict, when: str) -> List[str]:
    configs = lc.get("configs", [])
    out = [f"## Long context, {MODEL_NAMES.get(lc.get('model'), lc.get('model'))} (`results/long_context.json`, "
           f"{when})", "", f"`{lc.get('command') or SOURCES['long_context.json'][1]}`; {lc.get('environment', '')}.",
           "", "Per length, one fresh process; each cache as users get it (plain: mlx_lm's own layout; a preset: "
           "`enable(model, PRESET)`), mlx_lm's `generate_step` over the prompt (chunks of "
           f"{lc.get('prefill_step')}) and {lc.get('decode')} tokens: KV bytes (every stored array), peak process "
           "memory (the loaded model's resident memory + the run's peak increase) and `mx.get_peak_memory` above "
           "the run's start, prefill time (unpaired, one run each); then decode steps taken in turn by every cache "
           "(paired ratio, bootstrap 95 % interval).", ""]
    for run in lc.get("runs", []):
        out += [f"**{run['length']} tokens** (weights {run['weights_bytes'] / 2**20:.0f} MiB, resident after "
                f"loading {run['model_rss_bytes'] / 2**20:.0f} MiB)", "", table(LONG_HEAD, long_context_rows(run, configs)),
                ""]
    return out


def page(found: Dict[str, dict], results: Path, plots: Dict[str, str]) -> str:
    out = ["# Results", "",
           f"Generated by `{COMMAND}` from the JSONs under `results/` (each section names the command that wrote its "
           "JSON). Do not edit by hand: rerun the benchmark, then the generator.", ""]
    missing = [n for n in SOURCES if n not in found]
    if missing:
        out += ["## Not measured here yet", ""]
        out += [f"- `results/{n}` ({SOURCES[n][0]}): `{SOURCES[n][1]}`" for n in missing]
        out.append("")
    if "demo.json" in found:
        demo = found["demo.json"]
        out += [f"## Every method on one slice (`results/demo.json`, {stamp(results, 'demo.json')})", "",
                f"`{SOURCES['demo.json'][1]}`: a {demo.get('context')}-token perplexity slice in lockstep with the "
                f"plain cache; attention {demo.get('attention_path', 'path not recorded')}; prompt "
                f"{demo.get('prompt', '')!r}.", ""]
        rows = demo_rows(demo)
        out.append(table(["method", "bits/coord", f"KV MiB @{demo.get('context')}", "ppl", "Δppl", "KL",
                          "decode tok/s", "answer"],
                         [[r["name"], f"{r['bits']:.2f}", f"{r['mib']:.2f}", f"{r['ppl']:.3f}", f"{r['dppl']:+.3f}",
                           f"{r['kl']:.4f}", _f(r["tok_s"], ".1f"), _short(r["answer"])] for r in rows]))
        if "kl-bits" in plots:
            out += ["", f"![KL against bits per coordinate]({plots['kl-bits']})"]
        out.append("")
    for name in QUALITY_FILES:
        if name in found:
            out += quality_section(found[name], name, stamp(results, name))
            if name in plots:
                out += [f"![KL against bits per corpus and context]({plots[name]})", ""]
    if "e2e_speed.json" in found:
        e = found["e2e_speed.json"]
        out += [f"## Speed at a long prompt (`results/e2e_speed.json`, {stamp(results, 'e2e_speed.json')})", "",
                f"{e.get('prompt')}-token prompt in chunks of {e.get('chunk')}, {e.get('decode')} decode tokens, "
                f"{e.get('repeats')} repeats, fill {e.get('fill')}; {e.get('machine', 'machine not recorded')}; BLAS "
                f"{e.get('blas', '?')}; attention {e.get('attention_path', '?')}.", ""]
        out.append(table(["config", "decode tok/s", "decode x plain", "prefill x plain", "peak MiB", "cache MiB"],
                         [[r["name"], _f(r["decode_tok_s"], ".2f"), _f(r["decode_vs_kv"], ".2f"),
                           _f(r["prefill_vs_kv"], ".2f"), _f(r["peak_mib"], ".1f"), _f(r["cache_mib"], ".2f")]
                          for r in speed_rows(e)]))
        if "speed" in plots:
            out += ["", f"![decode speed against the plain cache]({plots['speed']})"]
        out.append("")
    if "memory.json" in found:
        m = found["memory.json"]
        out += [f"## Peak memory (`results/memory.json`, {stamp(results, 'memory.json')})", "",
                f"`{SOURCES['memory.json'][1]}` with a {m.get('prompt')}-token prompt and {m.get('decode')} decode "
                f"tokens; weights {m.get('weights_bytes', 0) / 2**20:.1f} MiB (in every peak).", "",
                table(["cache", "peak MiB", "cache MiB", "seconds"],
                      [[n, _f(r.get("peak_mib"), ".1f"), _f(r.get("cache_mib"), ".2f"), _f(r.get("seconds"), ".1f")]
                       for n, r in m.get("caches", {}).items()]), ""]
    if "long_context.json" in found:
        out += long_context_section(found["long_context.json"], stamp(results, "long_context.json"))
    others = sorted(set(found) - set(SOURCES))
    if others:
        out += ["## Other JSONs present (not summarized here)", "",
                "\n".join(f"- `results/{n}`" for n in others), ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------------- plots

def quality_panels(q: dict) -> List[str]:
    """A quality.py JSON's KL against bits (every stored byte, as that run measured them), one scatter per corpus and
    context: our configurations as circles, mlx_lm's caches as squares, the plain cache (the KL reference) left out."""
    model = MODEL_NAMES.get(q.get("model"), q.get("model", "model"))
    panels = []
    for corpus, per in q.get("corpora", {}).items():
        for ctx in sorted(per.get("ppl", {}), key=int):
            pts = [(n, r["memory"]["bits_per_coordinate"], r["kl"], n.startswith("mlx-"))
                   for n, r in per["ppl"][ctx].items() if n != PLAIN and r.get("memory")]
            if pts:
                panels.append(svg_scatter(pts, "bits per coordinate (every stored byte)", "KL (nats/token, log)",
                                          f"{model}, {CORPUS_NAMES.get(corpus, corpus)}, {ctx} tokens", width=560,
                                          height=360))
    return panels


def plots_of(found: Dict[str, dict]) -> Dict[str, Tuple[str, str]]:
    """plot key -> (file name, SVG text), for the JSONs present."""
    out = {}
    if "demo.json" in found:
        demo = found["demo.json"]
        pts = [(r["name"], r["bits"], r["kl"], r["name"] == PLAIN or r["name"].startswith("mlx-"))
               for r in demo_rows(demo) if r["name"] != PLAIN]
        out["kl-bits"] = ("results-kl-bits.svg", svg_scatter(
            pts, "bits per coordinate (every stored byte)", "KL to the plain cache (nats/token, log)",
            f"veloxquant demo, {demo.get('context')}-token slice: KL against bits (squares: mlx_lm's caches)"))
    for name in QUALITY_FILES:  # KL against bits per corpus and context, every config the run measured
        if name in found:
            panels = quality_panels(found[name])
            if panels:
                out[name] = (f"results-kl-bits-{name[:-len('.json')]}.svg", svg_grid(panels))
    if "e2e_speed.json" in found:
        e = found["e2e_speed.json"]
        bars = [(r["name"], r["decode_vs_kv"]) for r in speed_rows(e) if r["name"] != PLAIN]
        out["speed"] = ("results-speed.svg", svg_bars(
            bars, "decode speed / plain cache's (dashed: 1x)", f"Decode at a {e.get('prompt')}-token prompt"))
    return out


# ----------------------------------------------------------------------------------------------------- writing

def update_readme(readme: Path, block: str) -> bool:
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + block + text[stop:]
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text


def generate(results: Path, docs: Path, readme: Optional[Path]) -> List[Path]:
    """Write the page, its plots and (with demo.json) the README's table; the paths written."""
    found = load(results)
    docs.mkdir(parents=True, exist_ok=True)
    written, links = [], {}
    for key, (name, svg) in plots_of(found).items():
        (docs / name).write_text(svg, encoding="utf-8")
        written.append(docs / name)
        links[key] = name
    (docs / "results.md").write_text(page(found, results, links), encoding="utf-8")
    written.append(docs / "results.md")
    if readme is not None:
        quality = found.get("quality.json")
        if quality is not None and not quality_headline(quality, None)[1]:
            quality = None  # a run without the headline caches: the demo's table
        if "demo.json" in found or quality is not None:
            block = readme_block(found.get("demo.json"), found.get("e2e_speed.json"),
                                 stamp(results, "demo.json") if "demo.json" in found else "",
                                 found.get("quality_gemma.json"), found.get("long_context.json"), quality,
                                 stamp(results, "quality.json") if quality is not None else "")
            if update_readme(readme, block):
                written.append(readme)
        else:
            print(f"results_page: no {results / 'demo.json'} nor {results / 'quality.json'}: {readme} left as it "
                  f"is (make them: {SOURCES['demo.json'][1]}; {SOURCES['quality.json'][1]})", file=sys.stderr)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "results"), help="folder of benchmark JSONs")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="where results.md and the SVG plots go")
    ap.add_argument("--readme", default=str(ROOT / "README.md"), help="README whose results table is replaced")
    ap.add_argument("--no-readme", action="store_true", help="leave the README alone")
    args = ap.parse_args(argv)
    for path in generate(Path(args.results), Path(args.docs), None if args.no_readme else Path(args.readme)):
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
