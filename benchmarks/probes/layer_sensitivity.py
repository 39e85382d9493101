"""Where a budget configuration's KL comes from, layer by layer, and what moving bits between layers gives.

Diagnosis for issue 28 (BENCHMARKS.md, "Where issue 28's gap lies"), not a product path:

1. ``sensitivity``: for each layer, KL against the plain cache when only that layer's keys are coded at ``--bits``
   (its values at 8), or only its values (keys at 8), every other layer plain (one lockstep pass of 2 x layers + 3
   caches; three layers at 8/8 bits give the floor). On the calibration text (the model's own answers to
   `DEFAULT_PROMPTS`, what a calibration would fit on) and on any evaluation corpus named (for diagnosis only).
2. ``--screen``: each layer's key and value bits chosen by a greedy exchange on the calibration text's
   sensitivities (error model: sensitivity x 4^-(bits - --bits); the total bits unchanged), against the preset
   itself, both with the calibration's channel weights, on both corpora.

    python -m benchmarks.probes.layer_sensitivity --texts calibration,kjv --screen --out results/layer_sensitivity.json

``--model gemma3-270m`` (or any name `load_model` takes): the same on that model; its calibration file defaults to
``results/<model>_calibration.safetensors``.

``--smoke``: both steps on a tiny random llama (`benchmarks/probes/_smoke.py`), 192 tokens per text (past the
budget layouts' first 128-token block), the model's answers 16 tokens long, calibrated on them (no calibration file
read or written), the screen at one 160-token window: the code runs, the figures mean nothing::

    python -m benchmarks.probes.layer_sensitivity --smoke --out /tmp/layer_sensitivity.json
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from veloxquant_mlx.apps.blas import ensure_openblas

from benchmarks import _common

ensure_openblas()

from mlx_lm.models.cache import make_prompt_cache as plain_prompt_cache  # noqa: E402

import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.integration.measure_calibration import default_calibration_tokens  # noqa: E402
from veloxquant_mlx.apps.eval import corpus_tokens, perplexity_eval  # noqa: E402
from veloxquant_mlx.apps.eval.specs import CacheSpec, compressed_spec, with_calibration  # noqa: E402
from veloxquant_mlx.integration.builder import make_prompt_cache  # noqa: E402
from veloxquant_mlx.apps.models.loader import load_model  # noqa: E402
from veloxquant_mlx.cache.presets import PRESETS  # noqa: E402

WIDTHS = (2, 3, 4, 5, 6)  # bits a layer may get in the exchange


def allocate(sens_k, sens_v, base: int, ref: int, widths=WIDTHS):
    """Per-layer (key bits, value bits), starting from ``base`` everywhere: one bit at a time from the layer side
    whose modelled error grows least to the one whose error falls most, while that lowers the total
    (error of a side at b bits: its sensitivity at ``ref`` bits x 4^-(b - ref)); the total bits stay the same."""
    s = list(sens_k) + list(sens_v)
    b = [base] * len(s)
    err = lambda i, bits: max(s[i], 1e-12) * 4.0 ** (ref - bits)  # noqa: E731
    while True:
        ups = [(err(i, b[i]) - err(i, b[i] + 1), i) for i in range(len(s)) if b[i] + 1 in widths]
        downs = [(err(i, b[i] - 1) - err(i, b[i]), i) for i in range(len(s)) if b[i] - 1 in widths]
        if not ups or not downs:
            break
        gain, i = max(ups)
        others = [d for d in downs if d[1] != i]
        if not others:
            break
        cost, j = min(others)
        if gain <= cost:
            break
        b[i] += 1
        b[j] -= 1
    n = len(sens_k)
    return b[:n], b[n:]


def sensitivity(model, tokens, options, calibration, bits: int) -> dict:
    layers = len(model.layers)

    def one_layer(name, layer, kb, vb):
        o = dataclasses.replace(options, k_bits=kb, v_bits=vb)

        def make(m):  # every other layer the model's own plain cache (its sliding windows kept)
            ours, plain = make_prompt_cache(m, o, calibration=calibration), plain_prompt_cache(m)
            return [ours[i] if i == layer else plain[i] for i in range(layers)]
        return CacheSpec(name, make)

    specs = ([one_layer(f"k{i}", i, bits, 8) for i in range(layers)] + [one_layer(f"v{i}", i, 8, bits)
             for i in range(layers)] + [one_layer(f"floor{i}", i, 8, 8) for i in (0, layers // 2, layers - 1)])
    res = perplexity_eval(model, tokens, specs, len(tokens) - 1, 1, progress=False)
    return {"keys": [res[f"k{i}"]["kl"] for i in range(layers)], "values": [res[f"v{i}"]["kl"] for i in range(layers)],
            "floor": max(res[f"floor{i}"]["kl"] for i in (0, layers // 2, layers - 1))}


def main() -> None:
    ap = _common.parser(__doc__, brief=True)
    ap.add_argument("--preset", default="tq-4b", help="a budget preset (its layout; bits from --bits / the exchange)")
    ap.add_argument("--texts", default="calibration,kjv", help="calibration and/or evaluation corpora")
    ap.add_argument("--tokens", type=int, default=1219, help="tokens of each text measured (one window)")
    ap.add_argument("--bits", type=int, default=3, help="the one layer side's bits when measuring")
    _common.add_model(ap)
    ap.add_argument("--calibration", default=None, help="channel weights (made from the default calibration text "
                    "when missing; default results/<model>_calibration.safetensors; none: without)")
    ap.add_argument("--screen", action="store_true", help="also screen the exchanged bits on both corpora")
    ap.add_argument("--screen-presets", default="tq-4b,tq-3b")
    ap.add_argument("--context", type=int, default=513)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, a few dozen tokens (docstring)")
    _common.add_out(ap)
    args = ap.parse_args()
    if args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
    answers = {}  # default_calibration_tokens' keywords: the model's answers' length
    if args.smoke:
        from benchmarks.probes._smoke import tiny_model

        model, tok = tiny_model()
        args.texts, args.tokens, args.screen, args.context, args.windows = "calibration,kjv", 192, True, 160, 1
        answers = {"tokens_per_prompt": 16}
        cal = vq.calibrate(model, default_calibration_tokens(model, tok, **answers),
                           description="--smoke: the tiny model's 16-token answers to DEFAULT_PROMPTS")
    else:
        model, tok = load_model(args.model)
        args.calibration = args.calibration or f"results/{args.model}_calibration.safetensors"
        if args.calibration == "none":  # the layouts as shipped: no channel weights (issue 54's token_lloyd8)
            cal = None
        elif os.path.exists(args.calibration):
            cal = vq.Calibration.load(args.calibration, model)
        else:
            cal = vq.calibrate(model, tokenizer=tok)
            cal.save(args.calibration)
    out = {"model": "tiny" if args.smoke else args.model, "preset": args.preset, "bits": args.bits,
           "calibration": cal.metadata() if cal else None, "sensitivity": {}}
    for text in args.texts.split(","):
        t0 = time.time()
        if text == "calibration":
            tokens = [t for seq in default_calibration_tokens(model, tok, **answers) for t in seq][: args.tokens]
        else:
            tokens = corpus_tokens(tok, text)[: args.tokens]
        s = sensitivity(model, tokens, PRESETS[args.preset], cal, args.bits)
        out["sensitivity"][text] = s
        print(f"{text:17s} {len(tokens)} tokens, {time.time() - t0:.0f} s: keys sum {sum(s['keys']):.4f} "
              f"[{min(s['keys']):.4f}, {max(s['keys']):.4f}], values sum {sum(s['values']):.4f} "
              f"[{min(s['values']):.4f}, {max(s['values']):.4f}], floor {s['floor']:.1e}", flush=True)
    if args.screen:
        if "calibration" not in out["sensitivity"]:
            raise SystemExit("--screen allocates from the calibration text's sensitivities: add it to --texts")
        s = out["sensitivity"]["calibration"]
        specs = []
        for name in args.screen_presets.split(","):
            p = PRESETS[name]
            kb, vb = allocate(s["keys"], s["values"], p.k_bits, args.bits)
            out.setdefault("allocations", {})[name] = {"k_bits": kb, "v_bits": vb}
            moved = compressed_spec(name, dataclasses.replace(p, k_bits=kb, v_bits=vb))
            if cal is None:
                specs += [compressed_spec(name, p), dataclasses.replace(moved, name=f"{name}+moved")]
            else:
                specs += [with_calibration(compressed_spec(name, p), cal, "+cal"),
                          with_calibration(moved, cal, "+cal+moved")]
        out["screen"] = {}
        for corpus in ("debian-reference", "kjv"):
            res = perplexity_eval(model, corpus_tokens(tok, corpus), specs, args.context, args.windows, progress=False)
            out["screen"][corpus] = res
            for n, r in res.items():
                base = r["ppl"] - r["delta_ppl"]
                print(f"{corpus:17s} {args.context}x{args.windows} {n:18s} bits "
                      f"{r['memory']['bits_per_coordinate']:.3f}  dppl {100 * r['delta_ppl'] / base:+6.2f} %  "
                      f"KL {r['kl']:.4f}  top-1 {r['top1']:.3f}", flush=True)
    if args.out:
        _common.write_json(args.out, out, default=str)


if __name__ == "__main__":
    sys.exit(main())
