"""Issue 47's coded tail (`codec="kblock_vsym8_pt"`, waiting keys as per-token codes): three one-question probes.

    python -m benchmarks.probes.coded_tail centring   # squared error of provisional keys, uncentred vs centred
    python -m benchmarks.probes.coded_tail chat       # greedy answers and first-step KL on the demo's chat question
    python -m benchmarks.probes.coded_tail kernel     # the compiled kernel against the pure-MLX path, same cache

``centring``: real SmolLM2 keys (the Bible text's first 600 tokens, plain cache), coded per token at 5 and 6 bits
with and without the mean of the first 37 tokens subtracted; error relative to the keys' variance over tokens.
``chat``: the demo's question with the chat template, the plain cache's greedy answer against the budget layouts
(exact tail, coded tail, coded tail with 8-bit provisional keys). ``kernel``: 690 tokens of the Bible text
prefilled in chunks of 256, then 10 decode steps, with the kernel on and off; the largest logit difference and the
kernel's call counts.

``--smoke`` runs the three on a tiny random llama (`benchmarks/probes/_smoke.py`) at a few hundred tokens and a
few steps: the code runs, the figures mean nothing::

    python -m benchmarks.probes.coded_tail --smoke --out /tmp/coded_tail.json
"""
from __future__ import annotations

from benchmarks import _common

from veloxquant_mlx.apps.blas import ensure_openblas

ensure_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.attention import kernel  # noqa: E402
from veloxquant_mlx.codecs.kblock_tail import ProvisionalKeyCodec  # noqa: E402
from veloxquant_mlx.apps.eval.corpus import CORPORA  # noqa: E402
from veloxquant_mlx.apps.models.loader import load_model  # noqa: E402

from benchmarks._quality_configs import _budget_variant, _tail_layout  # noqa: E402

QUESTION = "What is the capital of France?"


def centring(model, tok, tokens: int = 600) -> dict:
    ids = tok.encode(CORPORA["kjv"]())[:tokens]
    cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    out = {}
    for layer in (i for i in (0, 1, 5, 15, 29) if i < len(cache)):
        k = cache[layer].keys[..., :tokens, :]
        var = mx.mean((k - mx.mean(k, axis=2, keepdims=True)) ** 2)
        for bits in (5, 6):
            row = {}
            for center in (False, True):
                c = ProvisionalKeyCodec(k.shape[-1], bits, seed=0, center=center)
                if center:
                    c = c.with_fitted(c.fitted_from(k[:, :, :37]))
                r = c.decode(c.encode(k), mx.float32)
                row["centred" if center else "uncentred"] = (mx.mean((r - k) ** 2) / var).item()
            out[f"layer {layer}, {bits} bits"] = row
            print(f"layer {layer:2d} {bits} bits: uncentred {row['uncentred']:.5f}  centred {row['centred']:.5f}  "
                  f"ratio {row['uncentred'] / row['centred']:.2f}")
    return out


def _greedy(model, ids, opts, n=12):
    cache = make_prompt_cache(model) if opts is None else vq.make_prompt_cache(model, **opts)
    with vq.use_packed_attention():
        logits = model(mx.array([ids]), cache=cache)[:, -1]
        first, toks = None, []
        for _ in range(n):
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            first = lp if first is None else first
            toks.append(int(mx.argmax(lp).item()))
            logits = model(mx.array([[toks[-1]]]), cache=cache)[:, -1]
    return toks, first


def chat(model, tok, n: int = 12) -> dict:
    configs = {
        "tq4-exact": _budget_variant(4, codec="kblock_vsym8", center_keys=False),
        "tq4-ptc1": _budget_variant(4, codec=_tail_layout(1), center_keys=True),
        "tq3-ptc1": _budget_variant(3, codec=_tail_layout(1), center_keys=True),
        "tq4-ptc4 (8-bit provisional keys)": _budget_variant(4, codec=_tail_layout(4), center_keys=True),
    }
    out = {}
    for question in (QUESTION, QUESTION + " Answer in one sentence."):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ref, ref_lp = _greedy(model, ids, None, n)
        print(f"{question!r} ({len(ids)} tokens); plain: {tok.decode(ref)!r}")
        rows = {"plain": tok.decode(ref)}
        for name, opts in configs.items():
            toks, lp = _greedy(model, ids, opts, n)
            kl = mx.sum(mx.exp(ref_lp) * (ref_lp - lp)).item()
            rows[name] = {"answer": tok.decode(toks), "first_step_kl": kl}
            print(f"  {name:34s} first-step KL {kl:.4f}  {tok.decode(toks)!r}")
        out[question] = rows
    return out


def kernel_parity(model, tok, prompt: int = 690, steps: int = 10, chunk: int = 256) -> dict:
    ids = tok.encode(CORPORA["kjv"]())[:prompt + steps]
    opts = _budget_variant(4, codec=_tail_layout(1), center_keys=True)
    logits, counts = {}, {}
    for use in (True, False):
        kernel.set_enabled(use)
        before = kernel.calls()
        cache = vq.make_prompt_cache(model, **opts)
        with vq.use_packed_attention():
            for s in range(0, prompt, chunk):
                model(mx.array([ids[s:min(s + chunk, prompt)]]), cache=cache)
            logits[use] = mx.stack([model(mx.array([[t]]), cache=cache)[0, -1] for t in ids[prompt:prompt + steps]])
        after = kernel.calls()
        counts[use] = {k: after[k] - before[k] for k in ("kernel", "refused")}
    kernel.set_enabled(True)
    diff = mx.max(mx.abs(logits[True] - logits[False])).item()
    print(f"kernel calls {counts[True]} (kernel off: {counts[False]}); largest logit difference {diff:.3g}")
    return {"calls": counts[True], "calls_kernel_off": counts[False], "max_logit_diff": diff}


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("probe", nargs="?", choices=["centring", "chat", "kernel"], help="(with --smoke: all three)")
    _common.add_model(ap)
    _common.add_out(ap)
    ap.add_argument("--smoke", action="store_true", help="all three on a tiny random model, a few hundred tokens "
                    "(the code runs, figures meaningless)")
    args = ap.parse_args()
    if args.smoke:
        from benchmarks.probes._smoke import tiny_model

        model, tok = tiny_model()
        result = {}
        for name, probe in (("centring", lambda: centring(model, tok, tokens=160)),
                            ("chat", lambda: chat(model, tok, n=3)),
                            ("kernel", lambda: kernel_parity(model, tok, prompt=300, steps=4, chunk=128))):
            print(f"\n== smoke: {name}", flush=True)
            result[name] = probe()
        if args.out:
            _common.write_json(args.out, {"probe": "smoke", "result": result})
        return
    if args.probe is None:
        ap.error("name a probe: centring, chat or kernel (or --smoke)")
    model, tok = load_model(args.model)
    result = {"centring": centring, "chat": chat, "kernel": kernel_parity}[args.probe](model, tok)
    if args.out:
        _common.write_json(args.out, {"probe": args.probe, "result": result})


if __name__ == "__main__":
    main()
