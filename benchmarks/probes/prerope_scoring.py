"""What scoring keys stored before RoPE would cost a decode step, in pure MLX (issue 47's follow-up question).

    python -m benchmarks.probes.prerope_scoring [--tokens 2048,4096] [--repeats 50]
    python -m benchmarks.probes.prerope_scoring --smoke   # 256 tokens, 3 repeats: the code runs (seconds)

One layer of SmolLM2's shape (3 KV heads, 3 query rows each, head_dim 64), ``tq-4b``'s key codes (4-bit, per rotated
channel over 128-token blocks), one query per row. Per step, the median time of:

- ``plain``: ``q @ K^T`` on float32 keys (mlx_lm's cache);
- ``codes``: today's scores straight from the codes (``codec.scores``: one quantized matmul);
- ``pre-RoPE, decoded``: what keys stored before RoPE need without a kernel: decode them, apply RoPE at every
  position (``mx.fast.rope``), then ``q @ K^T``.

The compiled kernel is faster than ``codes`` on CPU; this compares the pure-MLX paths that would run on any device.
"""
from __future__ import annotations

import argparse
import json
import time

from veloxquant_mlx.apps.blas import ensure_openblas

ensure_openblas()

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.codecs.affine_block_kv import AffineBlockKVMSECodec  # noqa: E402

H, R, D = 3, 3, 64  # SmolLM2: KV heads, query heads per KV head, head dim
ROPE = dict(traditional=False, base=100000.0, scale=1.0)  # SmolLM2's RoPE (plain, theta 1e5)


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def measure(n: int, repeats: int) -> dict:
    keys = mx.random.normal((1, H, n, D), key=mx.random.key(0))
    q = mx.random.normal((1, H, R, D), key=mx.random.key(1))
    codec = AffineBlockKVMSECodec(D, 4, 128)
    codes = codec.encode(keys)
    mx.eval(keys, q, codes)

    def pre_rope_decoded():
        k = mx.fast.rope(codec.decode(codes, mx.float32), D, offset=0, **ROPE)
        return q @ mx.swapaxes(k, -1, -2)

    return {"tokens": n,
            "plain_ms": _median_ms(lambda: q @ mx.swapaxes(keys, -1, -2), repeats),
            "codes_ms": _median_ms(lambda: codec.scores(q, codes), repeats),
            "pre_rope_decoded_ms": _median_ms(pre_rope_decoded, repeats)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="256 tokens, 3 repeats: the code runs, figures meaningless")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeats = "256", 3
    rows = [measure(int(n), args.repeats) for n in args.tokens.split(",")]
    print("| tokens | plain q K^T (ms) | scores from codes (ms) | pre-RoPE: decode + RoPE + q K^T (ms) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['plain_ms']:.3f} | {r['codes_ms']:.3f} | {r['pre_rope_decoded_ms']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
