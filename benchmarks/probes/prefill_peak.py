"""Peak memory of a chunked prefill with a packed cache inside ``use_packed_attention()``, by attention setting.

SmolLM2-135M, ``--prompt`` tokens of the corpus in chunks of 256, one fresh cache; prints
``mx.get_peak_memory()`` (float32 weights included) for the chosen query block of the prefill path and
with or without the fused exponential. What it checks: the settings of
``veloxquant_mlx.attention.packed_sdpa`` (``QUERY_BLOCK``, ``exp2_nonpositive(fused=...)``) for prefill.

    python -m benchmarks.probes.prefill_peak --codec affine_block --query-block 16
    python -m benchmarks.probes.prefill_peak --codec affine_block --query-block 32
    python -m benchmarks.probes.prefill_peak --codec affine_block --fused-prefill-exp
    python -m benchmarks.probes.prefill_peak --codec affine_block --estrin-prefill-exp
"""
from __future__ import annotations

import gc
import json

from benchmarks import _common


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()
    import mlx.core as mx

    import veloxquant_mlx as vq
    from veloxquant_mlx.attention import packed_sdpa
    from veloxquant_mlx.integration import use_packed_attention
    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.models.loader import load_model

    ap = _common.parser(__doc__)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--codec", default="affine_block", choices=["lloyd_max", "affine", "affine_block"])
    ap.add_argument("--query-block", type=int, default=packed_sdpa.QUERY_BLOCK)
    ap.add_argument("--fused-prefill-exp", action="store_true", help="use the fused exponential in prefill too")
    ap.add_argument("--estrin-prefill-exp", action="store_true",
                    help="prefill's plain-op exponential by Estrin's scheme (the fused kernel's) instead of Horner's")
    args = ap.parse_args(argv)
    if args.query_block < 1 or args.prompt < 1:
        ap.error("--query-block and --prompt must be >= 1")

    packed_sdpa.QUERY_BLOCK = args.query_block
    if args.fused_prefill_exp:
        plain = packed_sdpa.exp2_nonpositive
        packed_sdpa.exp2_nonpositive = lambda t, fused=True: plain(t, fused=True)
    elif args.estrin_prefill_exp:
        from veloxquant_mlx.attention.exp2 import exp2_nonpositive_reference  # Estrin, plain ops

        plain = packed_sdpa.exp2_nonpositive
        packed_sdpa.exp2_nonpositive = lambda t, fused=True: plain(t) if fused else exp2_nonpositive_reference(t)

    model, tok = load_model("smollm2")
    prompt = mx.array([corpus_tokens(tok)[: args.prompt]])
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = vq.make_prompt_cache(model, k_bits=4, v_bits=4, codec=args.codec)
    with use_packed_attention():
        for s in range(0, prompt.shape[1], 256):
            mx.eval(model(prompt[:, s : s + 256], cache=cache)[:, -1])
    out = {"codec": args.codec, "prompt": args.prompt, "query_block": args.query_block,
           "fused_prefill_exp": args.fused_prefill_exp, "estrin_prefill_exp": args.estrin_prefill_exp, "peak_mib": mx.get_peak_memory() / 2**20}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
