"""Distortion, storage and throughput of the TurboQuant quantizers.

Measures, on random unit vectors, D_mse = E||x - x_hat||^2 (MSE, RVQ) and D_prod = E(<q,x> - est)^2
(Prod, unit-norm q), next to the codebook's theoretical d*mse, the paper's approximate figures and the
4^-b lower bound; true bytes per vector (EncodedVector.nbytes / n); and encode / decode throughput on a
(1, 8, 4096, 128) tensor in one call.

    python -m benchmarks.probes.distortion [--n 20000] [--dims 64 128] [--out results/distortion.json]
    python -m benchmarks.probes.distortion --smoke --out /tmp/distortion.json   # the code runs (seconds)

``--smoke``: 256 vectors of d=64, 1..3 bits, throughput on a (1, 2, 256, 128) tensor once: figures meaningless.
"""
from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from veloxquant_mlx.quant.codebooks import PAPER_D_MSE, lloyd_max_codebook, lower_bound_d_mse
from veloxquant_mlx.quant.quantizers import TurboQuantMSE, TurboQuantProd, TurboQuantRVQ

from benchmarks import _common


def unit_vectors(n: int, d: int, seed: int) -> mx.array:
    x = np.random.default_rng(seed).standard_normal((n, d))
    return mx.array((x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))


def d_mse(quant, x: mx.array) -> tuple[float, int]:
    ev = quant.encode(x)
    err = mx.mean(mx.sum(mx.square(x - quant.decode(ev)), axis=-1))
    return float(err), ev.nbytes // x.shape[0]


def d_prod(quant, x: mx.array, q: mx.array) -> tuple[float, float, int]:
    ev = quant.encode(x)
    err = np.array(quant.estimate_inner_product(q, ev) - q @ x.T, dtype=np.float64)
    return float(np.mean(err ** 2)), float(np.mean(err)), ev.nbytes // x.shape[0]


def throughput(quant, shape, repeats: int) -> tuple[float, float]:
    x = mx.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    n = math.prod(shape[:-1])
    ev = quant.encode(x)
    mx.eval(*ev.arrays().values())
    enc, dec = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ev = quant.encode(x)
        mx.eval(*ev.arrays().values())
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        mx.eval(quant.decode(ev))
        dec.append(time.perf_counter() - t)
    return n / min(enc), n / min(dec)


def main(argv=None):
    ap = _common.parser(__doc__, brief=True)
    ap.add_argument("--n", type=int, default=20000, help="random unit vectors per (d, b)")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--max-bits", type=int, default=8, help="MSE/RVQ bit widths 1..max (Prod: 1..4)")
    ap.add_argument("--queries", type=int, default=16, help="unit queries for D_prod")
    ap.add_argument("--repeats", type=int, default=3, help="throughput repeats (best is reported)")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few hundred vectors, d=64, 1..3 bits, a small "
                    "throughput tensor: the code runs, figures meaningless")
    _common.add_out(ap, "results/distortion.json")
    args = ap.parse_args(argv)
    shape = (1, 8, 4096, 128)  # the throughput tensor
    if args.smoke:
        args.n, args.dims, args.max_bits, args.queries, args.repeats = 256, [64], 3, 4, 1
        shape = (1, 2, 256, 128)
    blas = _common.blas()  # (which BLAS, for interpreting throughput)
    print(_common.environment())
    rows = []
    for d in args.dims:
        x = unit_vectors(args.n, d, seed=12345 + d)
        q = unit_vectors(args.queries, d, seed=777 + d)
        for b in range(1, args.max_bits + 1):
            theory = lloyd_max_codebook("beta", b, d=d).d_mse
            row = {"d": d, "b": b, "theory_d_mse": theory, "paper_d_mse": PAPER_D_MSE.get(b),
                   "lower_bound": lower_bound_d_mse(b)}
            row["mse_d_mse"], row["mse_bytes"] = d_mse(TurboQuantMSE(d, b), x)
            row["rvq_d_mse"], row["rvq_bytes"] = d_mse(TurboQuantRVQ(d, b), x)
            if b <= 4:
                prev = 1.0 if b == 1 else lloyd_max_codebook("beta", b - 1, d=d).d_mse
                row["prod_theory_d_prod"] = math.pi / (2 * d) * prev  # m = d, ||q|| = 1
                row["prod_d_prod"], row["prod_mean_err"], row["prod_bytes"] = d_prod(TurboQuantProd(d, b), x, q)
            rows.append(row)
    hdr = (f"{'d':>4} {'b':>2} | {'D_mse meas':>10} {'theory':>9} {'paper':>6} {'4^-b':>8} | {'RVQ':>9} | "
           f"{'D_prod meas':>11} {'theory':>9} | bytes/vec mse/prod/rvq")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        paper = f"{r['paper_d_mse']:.4f}" if r["paper_d_mse"] else "-"
        prod = (f"{r['prod_d_prod']:11.3e} {r['prod_theory_d_prod']:9.3e}" if "prod_d_prod" in r else f"{'-':>11} {'-':>9}")
        print(f"{r['d']:>4} {r['b']:>2} | {r['mse_d_mse']:10.5f} {r['theory_d_mse']:9.5f} {paper:>6} "
              f"{r['lower_bound']:8.5f} | {r['rvq_d_mse']:9.2e} | {prod} | "
              f"{r['mse_bytes']}/{r.get('prod_bytes', '-')}/{r['rvq_bytes']}")
    tput = []
    if not args.no_throughput:
        print(f"\nthroughput on {shape} float32, one call, best of {args.repeats} (vectors/s):")
        for name, quant in (("turboquant_mse", lambda b: TurboQuantMSE(128, b)),
                            ("turboquant_prod", lambda b: TurboQuantProd(128, b)),
                            ("turboquant_rvq", lambda b: TurboQuantRVQ(128, b))):
            for b in (2, 4):
                enc, dec = throughput(quant(b), shape, args.repeats)
                tput.append({"quantizer": name, "b": b, "encode_vps": enc, "decode_vps": dec})
                print(f"  {name:16s} b={b}: encode {enc:12,.0f}  decode {dec:12,.0f}")
    _common.write_json(args.out, {"blas": blas, "n": args.n, "distortion": rows, "throughput": tput})


if __name__ == "__main__":
    main()
