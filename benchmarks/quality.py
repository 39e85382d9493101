"""Quality of our caches against mlx-lm's on SmolLM2-135M, in one run over the same windows.

For each configuration: perplexity and its change against the plain KVCache, KL (nats/token) and top-1
agreement in lockstep with it (veloxquant_mlx.apps.eval.perplexity_eval), stored bytes per token and bits per
coordinate (every stored byte — codes, norms, exact windows, fitted means/outlier indices — over the
cached K and V coordinates, taken from the caches holding one full window), and optionally the 9-case
needle (passkey) test. Each row says which bit budget it fits and whether it meets that budget's targets:

    <= 4.25 bits: dppl <= +1 %, KL <= 0.01, needle 9/9
    <= 3.25 bits: dppl <= +3 %, KL <= 0.03, needle 9/9
    <= 2.25 bits: dppl <= +10 %, needle >= 8/9

    python benchmarks/quality.py --contexts 512,2048 --windows 1,1 --needle --out results/quality.json
    python benchmarks/quality.py --configs k5v3-o8,mlx-q4 --contexts 4096 --windows 1

Issue 55's layer-kind probes, for models with sliding-window layers (Gemma 3): ``win:NAME`` / ``glob:NAME`` code
only the window (``RotatingKVCache``) / only the full-attention layers with NAME's caches, mlx_lm's own caches on
the others; ``NAME@wk8`` / ``NAME@wv8`` / ``NAME@wkv8``: NAME with 8-bit keys / values / both on the window layers
only (per-layer bits; 3 to 6 bits too: ``@wk5``, ``@wkv6``), ``NAME@gk8`` / ``@gv8`` / ``@gkv8`` the same on the
full-attention layers::

    python benchmarks/quality.py --model gemma3-270m --contexts 2048 --windows 1 --bits-lengths 2048,8192 \
        --configs kv,mlx-q8,win:tq-affine-k8v4,glob:tq-affine-k8v4,tq-affine-k8v4@wv8

Issue 47's key probes wrap one of our configurations (``benchmarks/_prerope.py``; same bytes, attention on the
decoded history, so no speed): ``pre-NAME`` stores its keys before RoPE, ``nr-NAME`` without its key rotation,
``prenr-NAME`` both (``--configs pre-tq4-ptc1,nr-tq-4b``); ``off-NAME`` codes ``k_t - R_t mu`` after RoPE (issue 54).

Issue 54's fake-code probe (``benchmarks/_fake_codes.py``; sliding windows kept; codes applied on arrival and
decoded at once, so no speed): ``fq-bB`` is ``tq-Bb``'s arithmetic, ``fq-bB-g32`` its key scales per 32 coordinates,
``fq-bB-pairs`` (needs ``--calibration``) / ``fq-bB-pairs-probe`` the same bytes with half the RoPE pairs at B + 1
bits and half at B - 1 (``--configs kv,fq-b4,fq-b4-g32,fq-b4-pairs --calibration FILE``); ``fq-bB-rd`` /
``fq-bB-pairs-rd`` those code bits at the Shannon bound (the Gaussian test channel: what no quantizer beats).

The CPU build of MLX is slow in float16: the model runs in float32 (mlx_lm's plain cache then stores
float32, and our exact windows are float32 too, which the byte counts include).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from veloxquant_mlx.apps.blas import ensure_openblas

import _common

ensure_openblas()


import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.apps.eval import (  # noqa: E402
    CacheSpec,
    baseline_specs,
    corpus_tokens,
    passkey_eval,
    perplexity_eval,
)
from veloxquant_mlx.integration.calibration import SUFFIX as CALIBRATION_SUFFIX  # noqa: E402
from veloxquant_mlx.apps.eval.corpus import CORPORA, DEFAULT_CORPUS  # noqa: E402
from veloxquant_mlx.apps.eval.memory import REPORT_LENGTHS, measure_bits, model_kv_shape  # noqa: E402
from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS, compressed_spec, with_calibration  # noqa: E402
from veloxquant_mlx.cache.options import CacheOptions  # noqa: E402
from veloxquant_mlx.cache.presets import preset  # noqa: E402
from veloxquant_mlx.apps.models.loader import load_model  # noqa: E402

# The research configurations (name -> make_prompt_cache options) live in _quality_configs.py.
from _quality_configs import OURS  # noqa: E402
from _prerope import pre_rope_caches  # noqa: E402
from _fake_codes import VARIANTS as FAKE_VARIANTS, fake_caches  # noqa: E402
# The tables and the plot written after a run live in _quality_tables.py.
from _quality_tables import markdown, merge, plot, text_table  # noqa: E402

DEFAULT = "kv,mlx-q4,mlx-q2,k4v4,k5v3,k5v3-o8,k4v3-o8,k4v2-o8,k3v2-o8,k3v1-o8,seed-rvq-b1,seed-rvq-b2,seed-rvq-b3"


def make_specs(names, calibration=None):
    """Baselines, registered configurations (``CONFIGURATIONS``: tq-4b, ...) and the research names of ``OURS``;
    ``NAME+cal``: a registered configuration with ``calibration``'s channel weights."""
    base = {s.name: s for s in baseline_specs()}
    specs = []
    for name in names:
        preset, plus, lever = name.partition("+")
        if "@" in name and name.rpartition("@")[2] in LAYER_BITS:  # issue 55: more bits on one layer kind
            inner, _, lever = name.rpartition("@")
            cal = calibration if inner.endswith("+cal") else None
            specs.append(_layer_bits_spec(name, make_specs([inner], calibration)[0], *LAYER_BITS[lever],
                                          calibration=cal))
        elif plus:
            if lever != "cal" or (preset not in CONFIGURATIONS and preset not in OURS):
                raise SystemExit(f"unknown config {name!r}: '+cal' follows a registered configuration "
                                 f"({', '.join(CONFIGURATIONS)}) or a research one")
            if calibration is None:
                raise SystemExit(f"{name!r} needs --calibration FILE")
            options = CONFIGURATIONS[preset] if preset in CONFIGURATIONS else CacheOptions(**{
                k: (tuple(v) if isinstance(v, list) else v) for k, v in OURS[preset].items()})
            specs.append(with_calibration(compressed_spec(preset, options), calibration, "+cal"))
        elif name.partition(":")[0] in LAYER_KINDS and ":" in name:  # issue 55: one layer kind coded
            kind, _, inner = name.partition(":")
            specs.append(_layer_kind_spec(name, make_specs([inner], calibration)[0], kind))
        elif name.startswith("fq-b"):  # issue 54's RoPE-pair lever, before it is built (benchmarks/_fake_codes.py)
            specs.append(_fake_spec(name, calibration))
        elif name.split("-", 1)[0] in PROBES and "-" in name:  # issue 47's key probes (benchmarks/_prerope.py)
            prefix, inner = name.split("-", 1)
            specs.append(_pre_rope_spec(name, make_specs([inner], calibration)[0], *PROBES[prefix]))
        elif name in base:
            specs.append(base[name])
        elif name in CONFIGURATIONS:
            specs.append(compressed_spec(name, CONFIGURATIONS[name]))
        elif name in OURS:
            opts = OURS[name]
            options = CacheOptions(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items()})
            specs.append(CacheSpec(name, lambda m, o=opts: vq.make_prompt_cache(m, **o),
                                   "veloxquant", None, json.dumps(opts), options=options))
        else:
            known = sorted(base) + sorted(CONFIGURATIONS) + sorted(OURS)
            raise SystemExit(f"unknown config {name!r}; choose from {known}")
    return specs


# Issue 55's probes of models with sliding-window layers: which layers a configuration codes, and 8 bits on the
# window layers. A layer is a window layer when the model's own cache for it is mlx_lm's RotatingKVCache.
LAYER_KINDS = ("win", "glob")
# lever -> (layer kind, key bits, value bits): 3 to 8 bits on the window (w) or full-attention (g) layers only
LAYER_BITS = {f"{w}{s}{b}": ("win" if w == "w" else "glob", b if "k" in s else None, b if "v" in s else None)
              for w in "wg" for s in ("k", "v", "kv") for b in (3, 4, 5, 6, 8)}


def _window_layers(model):
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache as mlx_make

    return [isinstance(c, RotatingKVCache) for c in mlx_make(model)]


def _layer_kind_spec(name, spec, kind):
    """``spec``'s caches on the window layers (``win``) or the full-attention ones (``glob``) only; mlx_lm's own
    caches (the model's ``make_cache``) on the others."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    def make(model, inner=spec.make_cache):
        ours, own = inner(model), mlx_make(model)
        return [o if w == (kind == "win") else m for o, m, w in zip(ours, own, _window_layers(model))]

    what = "window" if kind == "win" else "full-attention"
    return CacheSpec(name, make, spec.family, None, f"{spec.description}; on the {what} layers only (probe)")


def _layer_bits_spec(name, spec, kind, k_bits=None, v_bits=None, calibration=None):
    """``spec`` (one of ours, bits not per layer) with ``k_bits`` / ``v_bits`` on the window (``kind`` "win") or
    the full-attention ("glob") layers only (``NAME+cal@wk8``: with ``calibration``)."""
    o = spec.options
    if o is None or isinstance(o.k_bits, tuple) or isinstance(o.v_bits, tuple):
        raise SystemExit(f"{name!r}: @{'/@'.join(LAYER_BITS)} take one of our configurations with one bit width")

    def make(model):
        chosen = [w == (kind == "win") for w in _window_layers(model)]
        per = {}
        for field, bits, own in (("k_bits", k_bits, o.k_bits), ("v_bits", v_bits, o.value_bits)):
            per[field] = tuple(bits if (c and bits is not None) else own for c in chosen)
        return vq.make_prompt_cache(model, dataclasses.replace(o, **per), calibration=calibration)

    what = "window" if kind == "win" else "full-attention"
    return CacheSpec(name, make, spec.family, None,
                     f"{spec.description}; {what} layers at k{k_bits or '='}/v{v_bits or '='} bits (probe)")


# Issue 47's key probes: prefix -> (keys before RoPE, the key codec's rotation taken out, the static offset R_t mu
# taken out: issue 54)
PROBES = {"pre": (True, False, False), "nr": (False, True, False), "prenr": (True, True, False),
          "off": (False, False, True)}


def _pre_rope_spec(name, spec, pre_rope=True, unrotated=False, offset=False):
    """``spec`` (one of ours, not calibrated) storing keys before RoPE and/or without its key rotation
    (`_prerope.PreRopeKeys`): the same codecs and bytes (bits measured from the same options), attention on the
    decoded history."""
    if spec.family != "veloxquant" and (spec.options is None or spec.options.kind != "packed") \
            or "calibration" in spec.extra:
        raise SystemExit(f"{name!r}: the pre-RoPE probe wraps one of our uncalibrated configurations")

    def make(model, inner=spec.make_cache):
        caches = inner(model)
        for c in caches:
            c.fetch_placeholders = False  # the decoded history, to which the probe re-applies RoPE
        return pre_rope_caches(model, caches, pre_rope, unrotated, offset)

    what = " and ".join(w for w, on in (("keys stored before RoPE", pre_rope), ("key rotation out", unrotated),
                                        ("the keys' RoPE'd pre-RoPE mean out", offset)) if on)
    return CacheSpec(name, make, "veloxquant", None, f"{spec.description}; {what} (probe)", options=spec.options)


def _fake_spec(name, calibration):
    """``fq-bB`` / ``fq-bB-g32`` / ``fq-bB-pairs`` / ``fq-bB-pairs-probe``: the budget preset's codes decoded on
    arrival, its key scales per 32 coordinates, or the RoPE-pair split, pairs chosen on calibration text or on the
    key-rotation probe's ids (`_fake_codes`); bits from the real layout of the same bytes."""
    bits, _, variant = name[len("fq-b"):].partition("-")
    variant = f"-{variant}" if variant else ""
    if bits not in ("2", "3", "4") or variant not in FAKE_VARIANTS:
        raise SystemExit(f"unknown config {name!r}: fq-bB[{'|'.join(v for v in FAKE_VARIANTS if v)}], B in 2, 3, 4")
    same_bytes = preset(f"tq-{bits}b") if variant in ("", "-rd") else CacheOptions(**{
        k: (tuple(v) if isinstance(v, list) else v) for k, v in OURS[f"tq{bits}-kl32-ro"].items()})
    cal = calibration if variant in ("-pairs", "-pairs-rd") else None
    what = {"": "codes as tq-{b}b's", "-g32": "key scales per 32 coordinates",
            "-pairs": "the half of the RoPE pairs with the largest E[q^2] Var[k] at {b1} bits, the rest at {b0}",
            "-pairs-probe": "the RoPE-pair split, pairs chosen on the key-rotation probe's random ids",
            "-rd": "tq-{b}b's code bits at the Shannon bound (the Gaussian test channel)",
            "-pairs-rd": "the calibrated RoPE-pair split at the Shannon bound (the Gaussian test channel)"}
    return CacheSpec(name, lambda m, b=int(bits), v=variant: fake_caches(m, b, v, cal), "veloxquant", None,
                     what[variant].format(b=bits, b1=int(bits) + 1, b0=int(bits) - 1) + " (decoded on arrival: probe)",
                     options=same_bytes, extra={"bytes_of": lambda m, o=same_bytes: vq.make_prompt_cache(m, o)})


def main(argv=None):
    ap = _common.parser(__doc__)
    _common.add_model(ap)
    ap.add_argument("--configs", default=DEFAULT, help="comma list of baseline, registered and OURS names")
    ap.add_argument("--corpora", default=",".join(CORPORA), help=f"comma list of {', '.join(CORPORA)}")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--windows", default="1,1", help="windows per context (one number, or one per context)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--bits-lengths", default=",".join(map(str, REPORT_LENGTHS)),
                    help="lengths the bits (measure_bits, random tokens) are reported at, besides --contexts")
    ap.add_argument("--needle", action="store_true", help="also run the passkey test (9 cases by default)")
    ap.add_argument("--needle-lengths", default="1024,2048,4096", help="passkey prompt lengths (x --needle-depths)")
    ap.add_argument("--needle-depths", default="0.1,0.5,0.9",
                    help="where the passkey sits in each prompt (fractions of the filler, each in [0, 1])")
    ap.add_argument("--needle-configs", default=None, help="configs for the passkey test (default: all)")
    ap.add_argument("--needle-corpus", default=DEFAULT_CORPUS, help="the passkey prompts' filler text")
    ap.add_argument("--calibration", default=None,
                    help="calibration file for the NAME+cal configs; made (the default calibration text) and saved "
                         "there when it does not exist")
    _common.add_out(ap, "results/quality.json")
    ap.add_argument("--markdown", default=None, help="also write the tables as markdown (BENCHMARKS.md section)")
    ap.add_argument("--plot", default=None, help="also write a PNG: Δppl and KL against bits per coordinate")
    ap.add_argument("--context-configs", default="", help="a subset of --configs at some contexts, e.g. "
                    "'4096=kv,tq-4b' (the rest run at every context)")
    ap.add_argument("--from-json", default=None,
                    help="no run: write --markdown / --plot from saved --out files (comma list, merged in order); "
                         "with --merged-out, the merged JSON too")
    ap.add_argument("--merged-out", default=None, help="--from-json: write the merged runs as one JSON here")
    ap.add_argument("--drop", default="",
                    help="--from-json: configs whose definition changed since (comma list): their rows in every file "
                         "but the last are left out")
    args = ap.parse_args(argv)

    if args.from_json:
        runs = [json.load(open(path)) for path in args.from_json.split(",")]
        results = merge(runs, drop=[n for n in args.drop.split(",") if n])
        if args.merged_out:
            save(args.merged_out, results)
            print(f"wrote {args.merged_out}", file=sys.stderr)
    else:
        results = run(args)
        save(args.out, results)
        print(f"wrote {args.out}", file=sys.stderr)
    print(text_table(results))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, args))
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def run(args) -> dict:
    names = [n for n in args.configs.split(",") if n]
    if "kv" not in names:
        names.insert(0, "kv")
    corpora = [c for c in args.corpora.split(",") if c]
    contexts = [int(c) for c in args.contexts.split(",") if c]  # none: the passkey test only
    windows = [int(w) for w in args.windows.split(",")]
    windows = windows * len(contexts) if len(windows) == 1 else windows
    if contexts and len(windows) != len(contexts):
        raise SystemExit("--windows needs one value or one per context")

    subsets = {int(c): set(n.split(",")) | {"kv"}
               for c, n in (x.split("=") for x in args.context_configs.split(";") if x)}
    model, tokenizer = load_model(args.model)
    calibration = _calibration(args.calibration, model, tokenizer) if args.calibration else None
    specs = make_specs(names, calibration)
    results = {"model": args.model, "command": " ".join(sys.argv), "configs": {s.name: s.description for s in specs},
               "corpora": {}, "needle": None}
    if calibration is not None:
        results["calibration"] = {**calibration.metadata(), "file": args.calibration, "bytes": calibration.nbytes}
    tokens = {c: corpus_tokens(tokenizer, c, min_tokens=max([x * w for x, w in zip(contexts, windows)] + [0]) + 1)
              for c in corpora if contexts}
    for corpus in tokens:
        results["corpora"][corpus] = {"tokens": len(tokens[corpus]), "ppl": {}}
    bits_lengths = [int(n) for n in args.bits_lengths.split(",") if n]
    results["bits"] = spec_bits(model, specs, sorted(set(bits_lengths) | set(contexts)))
    for ctx, nw in zip(contexts, windows):  # every corpus at one context before the next (longer) context
        chosen = [s for s in specs if ctx not in subsets or s.name in subsets[ctx]]
        for corpus in corpora:
            t0 = time.time()
            reference = next(s for s in chosen if s.name == "kv")
            r = perplexity_eval(model, tokens[corpus], chosen, context=ctx, n_windows=nw, chunk=args.chunk,
                                reference=reference, progress=False)
            # r[name]["memory"]: every stored byte after the window (veloxquant_mlx.apps.eval.memory.cache_memory)
            results["corpora"][corpus]["ppl"][str(ctx)] = r
            print(f"[{corpus}, context {ctx}, {nw} window(s): {time.time() - t0:.0f} s]", file=sys.stderr)
            save(args.out, results)  # keep what is measured even if a later stage is interrupted

    if args.needle:
        filler = corpus_tokens(tokenizer, args.needle_corpus)
        chosen = set(args.needle_configs.split(",")) if args.needle_configs else {s.name for s in specs}
        lengths = [int(x) for x in args.needle_lengths.split(",")]
        try:
            depths = [float(x) for x in args.needle_depths.split(",")]
        except ValueError:
            depths = []
        if not depths or not all(0.0 <= d <= 1.0 for d in depths):
            raise SystemExit(f"--needle-depths: fractions in [0, 1], got {args.needle_depths!r}")
        out = passkey_eval(model, tokenizer, filler, [s for s in specs if s.name in chosen], lengths=lengths,
                           depths=depths, progress=False)
        results["needle"] = {"corpus": args.needle_corpus, "lengths": lengths, "depths": depths,
                             "results": {k: {"passed": v["passed"], "total": v["total"]} for k, v in out.items()}}
    return results


def spec_bits(model, specs, lengths) -> dict:
    """name -> `measure_bits` of its caches (random tokens, the model's attention shape): every stored byte at each
    of ``lengths`` and averaged over a window's positions (what its KL averages over). Calibration does not change
    the bytes (the same arrays, weighted), so a ``+cal`` configuration is measured by its options alone; one layer
    stands for all unless bits are set per layer or the model has layers of other kinds than full attention
    (sliding windows: Gemma 3), which are then measured in the model's own layout."""
    n_layers, kv_heads, head_dim = model_kv_shape(model)
    from mlx_lm.models.cache import KVCache, make_prompt_cache as mlx_make
    uniform = all(type(c) is KVCache for c in mlx_make(model))
    out = {}
    for s in specs:
        o = s.options
        if o is None or not uniform:  # (a probe's caches may store otherwise: its layout's own, `bytes_of`)
            make, layers = s.extra.get("bytes_of", s.make_cache), n_layers
        else:
            make = lambda m, o=o: vq.make_prompt_cache(m, o)  # noqa: E731
            layers = n_layers if isinstance(o.k_bits, tuple) or isinstance(o.v_bits, tuple) else 1
        m = measure_bits(make, kv_heads, head_dim, model=model if o is None or not uniform else None, lengths=lengths,
                         n_layers=layers)
        out[s.name] = {k: {str(n): v for n, v in m[k].items()} for k in ("bits", "kl_average_bits", "max_bits")}
    return out


def _calibration(path, model, tokenizer):
    """The calibration in ``path``, or one made now on the default calibration text and saved there."""
    if os.path.exists(path):
        return vq.Calibration.load(path, model)
    if not path.endswith(CALIBRATION_SUFFIX):  # (before minutes of calibrating, not after)
        raise SystemExit(f"--calibration: a new calibration file's name must end in {CALIBRATION_SUFFIX}, got {path!r}")
    t0 = time.time()
    cal = vq.calibrate(model, tokenizer=tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cal.save(path)
    print(f"[calibrated on {cal.text['tokens']} tokens ({cal.text['description']}) in {time.time() - t0:.0f} s: "
          f"{path}]", file=sys.stderr)
    return cal


def save(path, results):
    _common.write_json(path, results, quiet=True)


if __name__ == "__main__":
    main()
