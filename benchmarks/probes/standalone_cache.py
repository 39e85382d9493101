"""Speed of the standalone TurboQuantKVCache: block appends, row-by-row appends, attend latency.

For each method (turboquant_mse, turboquant_prod) and key bits b (3, 4), d = 128:
- append: tokens/s appending one block of ``--block`` keys then their values (one call each);
- per-row append: tokens/s appending ``--rows`` tokens one call per token through the same API
  (the cost order of the seed's documented per-row design: one Python call per token);
  the ratio block / per-row is reported;
- attend: latency of one query ``(d,)`` over n stored tokens, for each ``--n`` (default 4096, 32768);
- bytes per token (memory_bytes / n).

Every timing is mx.eval-synchronised (the cache evaluates its buffers on append; attend's output
is evaluated here) and is the best of ``--repeats`` runs. Writes ``--out`` (JSON) and prints a table.

    python -m benchmarks.probes.standalone_cache            # full run
    python -m benchmarks.probes.standalone_cache --quick    # small n, for a smoke test
"""
from __future__ import annotations

import os
import platform

from veloxquant_mlx.blas import ensure_openblas

ensure_openblas()  # before MLX loads: float32 matmul on the reference BLAS is ~50x slower

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from veloxquant_mlx.cache.turboquant_cache import TurboQuantKVCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402

from benchmarks import _common  # noqa: E402
from benchmarks._common import best_seconds as best_of  # noqa: E402


def make_cache(method: str, b: int, d: int) -> TurboQuantKVCache:
    return TurboQuantKVCache(KVCacheConfig(method=method, head_dim=d, bit_width_inlier=b))


def bench_one(method: str, b: int, args, data: np.ndarray) -> dict:
    d = args.d
    block = mx.array(data[: args.block])
    row_data = [mx.array(r) for r in data[: args.rows]]
    mx.eval(block, *row_data)

    def append_block():
        c = make_cache(method, b, d)
        c.append_key(block)
        c.append_value(block)

    def append_rows():
        c = make_cache(method, b, d)
        for r in row_data:
            c.append_key(r)
            c.append_value(r)

    make_cache(method, b, d)  # build the codebook / rotation outside the timings (cached)
    t_block = best_of(append_block, args.repeats)
    t_rows = best_of(append_rows, max(1, args.repeats // 2))
    row = {
        "method": method,
        "b": b,
        "d": d,
        "append_block_tokens": args.block,
        "append_block_tok_per_s": args.block / t_block,
        "append_rows_tokens": args.rows,
        "append_rows_tok_per_s": args.rows / t_rows,
    }
    row["block_vs_rows_speedup"] = row["append_block_tok_per_s"] / row["append_rows_tok_per_s"]

    q = mx.array(data[-1])
    row["attend_ms"] = {}
    for n in args.n:
        cache = make_cache(method, b, d)
        for start in range(0, n, args.block):  # fill in blocks, reusing the data (setup, not timed)
            chunk = mx.array(data[: min(args.block, n - start)])
            cache.append_key(chunk)
            cache.append_value(chunk)
        mx.eval(cache.attend(q))  # warm-up
        t = best_of(lambda: mx.eval(cache.attend(q)), args.repeats)
        row["attend_ms"][str(n)] = 1e3 * t
        row.setdefault("bytes_per_token", cache.memory_bytes() / n)
    return row


def main(argv=None) -> int:
    p = _common.parser(__doc__)
    p.add_argument("--d", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--bits", type=int, nargs="+", default=[3, 4], help="key bits b (default 3 4)")
    p.add_argument("--methods", nargs="+", default=["turboquant_mse", "turboquant_prod"])
    p.add_argument("--block", type=int, default=4096, help="tokens per block append (default 4096)")
    p.add_argument("--rows", type=int, default=512, help="tokens appended one call each (default 512)")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 32768], help="stored tokens for attend")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--quick", action="store_true", help="small sizes: block 512, rows 64, n 1024")
    _common.add_out(p, "results/standalone_cache.json")
    args = p.parse_args(argv)
    if args.quick:
        args.block, args.rows, args.n, args.repeats = 512, 64, [1024], 2
    for name in ("d", "block", "rows", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")

    rng = np.random.default_rng(7)
    data = rng.normal(size=(max(args.block, args.rows, 1), args.d)).astype(np.float32)
    rows = [bench_one(m, b, args, data) for m in args.methods for b in args.bits]

    # loaded_blas() lists the first OpenBLAS mapped, which can be numpy's own copy; LD_PRELOAD says
    # which one MLX's BLAS symbols resolve to.
    blas = f"{_common.blas()}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}"
    print(f"TurboQuantKVCache, d={args.d}, float32 inputs; BLAS: {blas}")
    ns = [str(n) for n in args.n]
    head = (["method", "b", "bytes/token", f"append {args.block} (tok/s)", "per-row append (tok/s)", "ratio"]
            + [f"attend n={n} (ms)" for n in ns])
    print(_common.markdown_table(head, [
        [r["method"], r["b"], f"{r['bytes_per_token']:.0f}", f"{r['append_block_tok_per_s']:,.0f}",
         f"{r['append_rows_tok_per_s']:,.0f}", f"{r['block_vs_rows_speedup']:.0f}x"]
        + [f"{r['attend_ms'][n]:.2f}" for n in ns] for r in rows]))

    out = {
        "benchmark": "standalone_cache",
        "args": vars(args),
        "blas": blas,
        "mlx_version": mx.__version__,
        "machine": platform.machine(),
        "results": rows,
    }
    _common.write_json(args.out, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
