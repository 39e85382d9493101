"""Peak memory of what users run: mlx_lm's ``generate_step`` on SmolLM2-135M after ``veloxquant_mlx.enable(model)``.

mlx_lm's prefill evaluates only the caches (never the whole chunk's logits), so this is the peak a user sees; the
peak of ``benchmarks/e2e_speed.py`` also holds its harness's full-chunk logits. Per method: a fresh process state
(buffer cache cleared, peak reset), a ``--prompt``-token corpus prompt, ``--decode`` tokens;
``mx.get_peak_memory()`` includes the float32 weights.

    python -m benchmarks.probes.generate_peak --methods kv,tq-affine-k8v4 --out results/generate_peak.json
"""
from __future__ import annotations

import gc

from benchmarks import _common


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()  # before mlx is imported: re-executes with OpenBLAS preloaded
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import veloxquant_mlx as vq
    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.eval.specs import CONFIGURATIONS
    from veloxquant_mlx.models.loader import load_model

    ap = _common.parser(__doc__)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--methods", default="kv,tq-affine-k8v4", help=f"comma list of 'kv' and {list(CONFIGURATIONS)}")
    _common.add_out(ap, "results/generate_peak.json")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m != "kv" and m not in CONFIGURATIONS]
    if bad or not methods:
        ap.error(f"--methods must name 'kv' or registered configurations {list(CONFIGURATIONS)}, got {bad or methods}")
    if args.prompt < 1 or args.decode < 1:
        ap.error("--prompt and --decode must be >= 1")

    model, tok = load_model("smollm2")
    ids = corpus_tokens(tok)
    while len(ids) < args.prompt:
        ids = ids + ids
    prompt = mx.array(ids[: args.prompt])
    rows = []
    for m in methods:
        if m != "kv":
            vq.enable(model, CONFIGURATIONS[m])
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        for _, _ in zip(range(args.decode), generate_step(prompt, model, max_tokens=args.decode)):
            pass
        rows.append({"method": m, "peak_mib": mx.get_peak_memory() / 2**20})
        vq.disable(model)
        print(f"{m:16s} peak {rows[-1]['peak_mib']:8.2f} MiB", flush=True)
    _common.write_json(args.out, {"prompt": args.prompt, "decode": args.decode, "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
