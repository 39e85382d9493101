"""Per-rank KV bytes per token and decode speed of SmolLM2 with compressed caches on 1, 2 and 3 ranks.

    python benchmarks/distributed.py [--ranks 1,2,3] [--preset tq-affine-k8v8] [--prompt 1024] [--decode 32]

Each row is one ``mlx.launch -n N --backend ring`` on this machine (loopback): every rank loads the model, keeps
its share of the KV heads (tensor parallel, ``veloxquant_mlx.apps.distributed.shard``), `enable`s the compressed
caches, prefills ``--prompt`` tokens of the evaluation corpus and decodes ``--decode`` greedy tokens. KV bytes are
the ``nbytes`` each rank's caches hold after the run, over the tokens they hold. All ranks share this machine's
CPU cores, so the speed column shows the cost of the collectives and of sharing cores, not what separate
machines on a network would give.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _common

HERE = os.path.abspath(__file__)


def worker(args) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import veloxquant_mlx as vq
    from veloxquant_mlx.apps.distributed import local_kv_heads, shard
    from veloxquant_mlx.apps.eval import corpus_tokens
    from veloxquant_mlx.apps.eval.specs import resolve_spec
    from veloxquant_mlx.apps.models import load_model

    group = mx.distributed.init()
    model, tok = load_model("smollm2")
    shard(model, group)
    vq.enable(model, resolve_spec(args.preset).options)
    cache = make_prompt_cache(model)
    prompt = mx.array([corpus_tokens(tok)[: args.prompt]])
    t0 = time.perf_counter()
    for i in range(0, args.prompt, 256):
        logits = model(prompt[:, i: i + 256], cache=cache)
        mx.eval(logits)
    prefill_s = time.perf_counter() - t0
    token = mx.argmax(logits[:, -1], axis=-1)[:, None]
    t0 = time.perf_counter()
    for _ in range(args.decode):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(token)
    decode_s = time.perf_counter() - t0
    n = cache[0].offset
    row = {"rank": group.rank(), "ranks": group.size(), "kv_heads": local_kv_heads(model), "tokens": n,
           "kv_bytes": sum(c.nbytes for c in cache), "kv_bytes_per_token": sum(c.live_nbytes for c in cache) / n,
           "prefill_tokens_per_s": args.prompt / prefill_s, "decode_tokens_per_s": args.decode / decode_s}
    _common.write_json(os.path.join(args.out_dir, f"rank{group.rank()}.json"), row, indent=None, quiet=True)
    vq.disable(model)
    return 0


def main(argv=None) -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("--ranks", default="1,3", help="SmolLM2 has 3 KV heads: 2 ranks cannot split them")
    ap.add_argument("--preset", "--method", dest="preset", default="tq-affine-k8v8",
                    help="the preset to run (--method: its old name)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32)
    _common.add_out(ap, "results/distributed.json")
    ap.add_argument("--worker", metavar="OUT_DIR", dest="out_dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out_dir:
        return worker(args)
    import tempfile

    results = []
    for n in [int(x) for x in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [HERE, "--preset", args.preset, "--prompt", str(args.prompt), "--decode", str(args.decode),
                   "--worker", tmp]
            # one rank: a plain process (mlx.launch's ring needs two or more)
            cmd = [sys.executable, *cmd] if n == 1 else ["mlx.launch", "-n", str(n), "--backend", "ring", "--python",
                                                         sys.executable, *cmd]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, timeout=1800, capture_output=True)
            ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(n)]
            results.append({"ranks": n, "launch_s": time.perf_counter() - t0, "per_rank": ranks})
    print(f"SmolLM2-135M, {args.preset}, {args.prompt}-token prompt + {args.decode} decoded, ring backend on loopback "
          "(all ranks on this machine's cores)")
    head = ["ranks", "KV heads per rank", "KV bytes/token per rank", "KV bytes/token, all ranks", "prefill tok/s",
            "decode tok/s"]
    print(_common.markdown_table(head, [
        [r["ranks"], r["per_rank"][0]["kv_heads"], f"{r['per_rank'][0]['kv_bytes_per_token']:.0f}",
         f"{sum(p['kv_bytes_per_token'] for p in r['per_rank']):.0f}",
         f"{r['per_rank'][0]['prefill_tokens_per_s']:.1f}", f"{r['per_rank'][0]['decode_tokens_per_s']:.2f}"]
        for r in results]))
    _common.write_json(args.out, {"method": args.preset, "prompt": args.prompt, "decode": args.decode,
                                  "runs": results})
    return 0


if __name__ == "__main__":
    from veloxquant_mlx.apps.blas import ensure_openblas

    ensure_openblas()  # re-executes with Debian's OpenBLAS when it is installed (MLX's CPU wheel: a slow BLAS)
    sys.exit(main())
