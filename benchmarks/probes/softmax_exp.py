"""The softmax exponential of packed attention: ``mx.exp`` vs `exp2_nonpositive` (plain ops and fused).

Decode-sized scores: ``(1, Hkv, R, n)`` = SmolLM2's layout (3 KV heads x 3 queries each) at n = 4k and 16k,
values ``s - max(s)`` (scores in log2 units for exp2, natural units for ``mx.exp``). Each cell is the best of
5 timing batches (the least disturbed one on a shared CPU), microseconds per call.

    python -m benchmarks.probes.softmax_exp --out results/softmax_exp.json
"""
from __future__ import annotations

from benchmarks import _common


def best_us(fn, arg, reps=200, batches=5):
    """Microseconds per call of ``fn(arg)``: the best of ``batches`` batches of ``reps`` calls, after 5 warm-ups."""
    import mlx.core as mx

    for _ in range(5):
        mx.eval(fn(arg))

    def batch():
        for _ in range(reps):
            mx.eval(fn(arg))
    return _common.best_seconds(batch, batches) / reps * 1e6


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()
    import mlx.core as mx

    from veloxquant_mlx.attention import exp2

    ap = _common.parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    _common.add_out(ap, "results/softmax_exp.json")
    args = ap.parse_args(argv)
    fused_ok = exp2._fused_parts() is not None
    print(f"{_common.environment()}; fused kernel available: {fused_ok}")
    rows = []
    for n in args.lengths:
        s = mx.random.normal((1, 3, 3, n)) * 4
        t = s - mx.max(s, axis=-1, keepdims=True)
        mx.eval(t)
        row = {"n": n, "elements": t.size,
               "mx_exp_us": best_us(mx.exp, t),
               "exp2_plain_us": best_us(lambda x: exp2.exp2_nonpositive(x, fused=False), t)}
        if fused_ok:
            row["exp2_fused_us"] = best_us(exp2.exp2_nonpositive, t)
        rows.append(row)
        extra = f"  fused {row['exp2_fused_us']:8.1f} us ({row['mx_exp_us'] / row['exp2_fused_us']:.1f}x)" if fused_ok else ""
        print(f"n={n:6d}: mx.exp {row['mx_exp_us']:8.1f} us  exp2 plain ops {row['exp2_plain_us']:8.1f} us "
              f"({row['mx_exp_us'] / row['exp2_plain_us']:.1f}x){extra}")
    _common.write_json(args.out, {"mlx": mx.__version__, "fused_available": fused_ok, "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
