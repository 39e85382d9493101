"""Calibrated caches against uncalibrated ones on SmolLM2-135M, on two corpora: the budgets' table and the levers.

One command: calibrate (the default calibration text: the model's own greedy answers to
`veloxquant_mlx.integration.measure_calibration.DEFAULT_PROMPTS`, never an evaluation corpus) or load
``--calibration FILE``, then run every ``--configs`` entry in lockstep with the plain cache on each corpus (KL, top-1,
perplexity, bits per coordinate from the stored bytes), and optionally passkey retrieval.

A config is ``PRESET`` (uncalibrated) or ``PRESET+LEVER``; the levers are variants of the one calibration:

- ``cal``: the calibration as `calibrate` makes it (key and value channel weights);
- ``calK`` / ``calV``: key weights only / value weights only (the other side's weights 1);
- ``calK.125``, ``cal.5``, ``cal.125``: the weights recomputed from the same statistics with another exponent
  (0.25 is the optimum for a rotated code's error model; see `veloxquant_mlx.quant.channel_weights`).

    python -m benchmarks.probes.calibration --contexts 512,2048 --windows 2,1 --out results/calibration.json
    python -m benchmarks.probes.calibration --configs tq-4b,tq-4b+cal --contexts 4096 --windows 1 --needle

``--smoke``: a tiny random llama (`benchmarks/probes/_smoke.py`) calibrated on its own 16-token answers, every lever
on ``tq-4b`` and ``tq-affine-k8v4+cal``, one 160-token window of each corpus, passkey at 256 tokens: the code runs,
the figures mean nothing::

    python -m benchmarks.probes.calibration --smoke --out /tmp/calibration.json
"""
from __future__ import annotations

import sys
import time

from veloxquant_mlx.apps.blas import ensure_openblas

from benchmarks import _common

ensure_openblas()

import mlx.core as mx  # noqa: E402

import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.integration.calibration import Calibration  # noqa: E402
from veloxquant_mlx.integration.measure_calibration import default_calibration_tokens  # noqa: E402
from veloxquant_mlx.quant.channel_weights import channel_weights  # noqa: E402
from veloxquant_mlx.apps.eval import corpus_tokens, passkey_eval, perplexity_eval  # noqa: E402
from veloxquant_mlx.apps.eval.specs import compressed_spec, with_calibration  # noqa: E402
from veloxquant_mlx.apps.models.loader import load_model  # noqa: E402
from veloxquant_mlx.cache.presets import BUDGETS, PRESETS  # noqa: E402

CORPORA = ("debian-reference", "kjv")
DEFAULT_CONFIGS = ("tq-4b,tq-4b+cal,tq-4b+calK,tq-4b+calV,tq-3b,tq-3b+cal,tq-3b+calK,tq-2b,tq-2b+cal,tq-2b+calK,"
                   "tq-affine-k8v4,tq-affine-k8v4+cal")


def levers(cal: Calibration) -> dict:
    """name -> a Calibration: the variants of ``cal`` the configs may name."""
    a = cal.arrays
    ones = mx.ones_like(a["key_weights"])

    def weights(power):
        return {"key_weights": mx.stack([channel_weights(q, k, power) for q, k in
                                         zip(a["query_power"], a["key_variance"])]),
                "value_weights": mx.stack([channel_weights(o, v, power) for o, v in
                                           zip(a["output_power"], a["value_power"])])}

    def variant(**w):
        return Calibration(arrays={**a, **w}, model=cal.model, text=cal.text, power=cal.power)

    return {"cal": cal, "calK": variant(value_weights=ones), "calV": variant(key_weights=ones),
            "calK.125": variant(key_weights=weights(0.125)["key_weights"], value_weights=ones),
            "cal.5": variant(**weights(0.5)), "cal.125": variant(**weights(0.125))}


def make_specs(names, cals):
    specs = []
    for n in names:
        base, _, lever = n.partition("+")
        if base not in PRESETS:
            raise SystemExit(f"unknown preset {base!r} in --configs; presets: {', '.join(PRESETS)}")
        if lever and lever not in cals:
            raise SystemExit(f"unknown lever {lever!r} in --configs; levers: {', '.join(cals)}")
        s = compressed_spec(base, PRESETS[base])
        specs.append(with_calibration(s, cals[lever], "+" + lever) if lever else s)
    return specs


def main() -> None:
    ap = _common.parser(__doc__, brief=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--windows", default="2,1", help="windows per context (one number per context)")
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--calibration", help="a calibration file of SmolLM2 (default: calibrate now)")
    ap.add_argument("--save-calibration", help="write the calibration made now to this file")
    ap.add_argument("--needle", action="store_true", help="also passkey retrieval (1k/2k/4k x 3 depths)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, a few hundred tokens (docstring)")
    _common.add_out(ap)
    args = ap.parse_args()
    needle_lengths = [1024, 2048, 4096]
    if args.smoke:
        levers_ = ("cal", "calK", "calV", "calK.125", "cal.5", "cal.125")  # every lever of `levers`
        args.configs = ",".join(["tq-4b"] + [f"tq-4b+{lever}" for lever in levers_] + ["tq-affine-k8v4+cal"])
        args.contexts, args.windows, args.calibration, args.needle = "160", "1", None, True
        needle_lengths = [256]
    contexts = [int(c) for c in args.contexts.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    if len(windows) != len(contexts):
        raise SystemExit("--windows needs one number per context")
    if args.smoke:
        from benchmarks.probes._smoke import tiny_model

        model, tok = tiny_model()
    else:
        model, tok = load_model("smollm2")
    t0 = time.perf_counter()
    if args.smoke:
        cal = vq.calibrate(model, default_calibration_tokens(model, tok, tokens_per_prompt=16),
                           description="--smoke: the tiny model's 16-token answers to DEFAULT_PROMPTS")
        if args.save_calibration:
            cal.save(args.save_calibration)
    elif args.calibration:
        cal = Calibration.load(args.calibration, model)
    else:
        cal = vq.calibrate(model, tokenizer=tok)
        if args.save_calibration:
            cal.save(args.save_calibration)
    print(f"{cal!r}; {time.perf_counter() - t0:.0f} s", flush=True)
    specs = make_specs(args.configs.split(","), levers(cal))
    out = {"calibration": cal.metadata(), "calibration_bytes": cal.nbytes, "results": {}}
    for corpus in args.corpora.split(","):
        tokens = corpus_tokens(tok, corpus)
        for ctx, w in zip(contexts, windows):
            res = perplexity_eval(model, tokens, specs, ctx, w, progress=False)
            out["results"][f"{corpus}@{ctx}"] = res
            for name, r in res.items():
                base = r["ppl"] - r["delta_ppl"]
                print(f"{corpus:17s} {ctx:5d}x{w} {name:20s} bits {r['memory']['bits_per_coordinate']:.2f}  "
                      f"dppl {100 * r['delta_ppl'] / base:+7.2f} %  KL {r['kl']:.4f}  top-1 {r['top1']:.3f}",
                      flush=True)
    if args.needle:
        filler = corpus_tokens(tok, "debian-reference")
        out["needle"] = passkey_eval(model, tok, filler, specs, lengths=needle_lengths, progress=False)
        for name, r in out["needle"].items():
            print(f"passkey {name:20s} {r['passed']}/{r['total']}", flush=True)
    budgets = {n: BUDGETS.get(n.partition("+")[0]) for n in args.configs.split(",")}
    out["budgets"] = budgets
    if args.out:
        _common.write_json(args.out, out, default=str)


if __name__ == "__main__":
    sys.exit(main())
