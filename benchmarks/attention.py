"""Decode-step attention for one layer: packed codes vs uncompressed SDPA vs mlx-lm's quantized SDPA.

Batch 1, one query, history of n tokens, two head shapes: d=64 (9 q / 3 KV heads, SmolLM2) and d=128
(32 q / 8 KV heads). Candidates, all timed in one run, interleaved per repeat (the CPU is shared, so
noise hits every candidate alike); the table shows the median and the minimum of the repeats (the
minimum is the least disturbed run when other processes share the cores):

- ``sdpa_f32`` / ``sdpa_f16``: ``mx.fast.scaled_dot_product_attention`` on uncompressed K/V;
- ``mlxlm_q4`` / ``mlxlm_q8``: ``mlx_lm.models.base.quantized_scaled_dot_product_attention``, group 64
  (float32 scales, as mlx-lm's QuantizedKVCache stores them for float32 activations);
- ``ours_aff{4,3,2}``: `coded_attention` on `AffineRotatedCodec` codes (centred, Haar-rotated, group 64,
  float16 scales) for keys and values; ``ours_aff4_f32s``: float32 scales;
- ``ours_blk{4,2}``: keys as `AffineBlockKeyCodec` (rotated ``K^T`` quantized per channel over 64-token
  blocks: one transpose=False quantized matmul scores the whole history), values `AffineRotatedCodec`, same
  bits; ``ours_blk4v2``: 4-bit keys, 2-bit values; ``ours_blk8v4`` / ``ours_blk8``: 8-bit keys, 4-bit / 8-bit
  values (MLX's CPU quantized matmul is faster on byte-aligned codes); ``ours_blk4_win``: ``ours_blk4`` plus an exact window
  (4 sink + 128 recent tokens) in the same softmax;
- ``ours_lloyd{4,3,2}``: the Lloyd-Max `LloydMaxCodec` layout (turboquant_mse, K and V at 4 / 3 / 2 bits: what
  tq-mse-k4v4 / k3v3 / k2v2 store), levels read by the fused kernel of `codecs._levels` and BLAS;
  ``ours_prod4``: turboquant_prod 4-bit keys (3-bit levels + QJL signs), MSE 4-bit values (tq-prod-k4v4);
  ``ours_rvq2``: turboquant_rvq keys and values, two 2-bit codebooks each (tq-rvq-k2v2);
  ``ours_lloyd4_gather``: the same codes as ``ours_lloyd4`` through MLX's gather (the codec's path for codes it
  has no exact level polynomial for, and the only path before; slow, so only up to ``--lloyd-max-n``).

``bytes/tok/head`` counts K and V together, per token per KV head, every stored array included (not the
per-head means or the exact window). Activations are float32 (float16 matmul is slow on CPU).

    python benchmarks/attention.py [--quick] [--repeats 5] [--compile] [--out results/attention.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from veloxquant_mlx.blas import ensure_openblas, loaded_blas  # noqa: E402

SHAPES = {"d64": (9, 3, 64), "d128": (32, 8, 128)}


def build_candidates(Hq: int, Hkv: int, d: int, n: int, seed: int, skip_f16_above: int, lloyd_max_n: int,
                     compiled: bool = False, only=None):
    """name -> (zero-arg function returning the output, bytes per token per KV head for K+V); ``only``: keep
    the candidates whose name contains one of these strings (and ``sdpa_f32``, the reference)."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from veloxquant_mlx.attention.packed_sdpa import coded_attention
    from veloxquant_mlx.codecs import AffineBlockKeyCodec, AffineRotatedCodec, LloydMaxCodec

    GatherLloydMax = _gather_codec()

    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    # Keys with a per-channel offset, like real keys (what centering is for); values plain.
    K = mx.random.normal((1, Hkv, n, d), key=k1) + 0.5 * mx.random.normal((1, Hkv, 1, d), key=k3)
    V = mx.random.normal((1, Hkv, n, d), key=k2)
    q = mx.random.normal((1, Hq, 1, d), key=k4)
    scale = d ** -0.5
    mx.eval(K, V, q)
    cands = {}

    cands["sdpa_f32"] = (lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale), 2 * 4 * d)
    if n <= skip_f16_above:
        K16, V16, q16 = K.astype(mx.float16), V.astype(mx.float16), q.astype(mx.float16)
        mx.eval(K16, V16, q16)
        cands["sdpa_f16"] = (
            lambda: mx.fast.scaled_dot_product_attention(q16, K16, V16, scale=scale), 2 * 2 * d)

    for bits in (4, 8):
        qk, qv = mx.quantize(K, 64, bits), mx.quantize(V, 64, bits)
        mx.eval(*qk, *qv)
        nb = 2 * sum(a.nbytes for a in qk) // (Hkv * n)

        def f(qk=qk, qv=qv, bits=bits):
            # mlx-lm scales its queries in place (queries *= scale): hand it its own array object.
            return quantized_scaled_dot_product_attention(
                mx.array(q), qk, qv, scale=scale, mask=None, group_size=64, bits=bits)
        cands[f"mlxlm_q{bits}"] = (f, nb)

    def ours(name, kc, vc, window=False, with_compiled=False):
        kc.fit(K)
        vc.fit(V)
        ka, va = kc.encode(K), vc.encode(V)
        mx.eval(*ka.values(), *va.values())
        nb = (sum(a.nbytes for a in ka.values()) + sum(a.nbytes for a in va.values())) // (Hkv * n)
        sink = recent = None
        if window:
            sink = (K[:, :, :4], V[:, :, :4])
            recent = (K[:, :, -128:], V[:, :, -128:])
            mx.eval(*sink, *recent)

        def f():
            return coded_attention(q, kc, ka, vc, va, scale, None, sink=sink, recent=recent)
        cands[name] = (f, nb)
        if with_compiled:
            # mx.compile over the whole decode step (codes as inputs; recompiles when n changes).
            kn, vn = sorted(ka), sorted(va)

            def step(q_, *arrs):
                return coded_attention(q_, kc, dict(zip(kn, arrs[: len(kn)])), vc, dict(zip(vn, arrs[len(kn):])), scale)
            cstep = mx.compile(step)
            args = [ka[k] for k in kn] + [va[k] for k in vn]
            cands[name + "_c"] = (lambda: cstep(q, *args), nb)

    for bits in (4, 3, 2):
        ours(f"ours_aff{bits}", AffineRotatedCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2),
             with_compiled=compiled and bits == 4)
    ours("ours_aff4_f32s", AffineRotatedCodec(d, 4, seed=1, scale_dtype="float32"),
         AffineRotatedCodec(d, 4, seed=2, scale_dtype="float32"))
    for bits in (4, 2):
        ours(f"ours_blk{bits}", AffineBlockKeyCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2),
             with_compiled=compiled and bits == 4)
    ours("ours_blk4v2", AffineBlockKeyCodec(d, 4, seed=1), AffineRotatedCodec(d, 2, seed=2))
    ours("ours_blk8v4", AffineBlockKeyCodec(d, 8, seed=1), AffineRotatedCodec(d, 4, seed=2))
    ours("ours_blk8", AffineBlockKeyCodec(d, 8, seed=1), AffineRotatedCodec(d, 8, seed=2))
    ours("ours_blk4_win", AffineBlockKeyCodec(d, 4, seed=1), AffineRotatedCodec(d, 4, seed=2), window=True)
    for bits in (4, 3, 2):
        ours(f"ours_lloyd{bits}", LloydMaxCodec("turboquant_mse", d, bits, seed=1),
             LloydMaxCodec("turboquant_mse", d, bits, seed=1001))
    ours("ours_prod4", LloydMaxCodec("turboquant_prod", d, 4, seed=1), LloydMaxCodec("turboquant_mse", d, 4, seed=1001))
    ours("ours_rvq2", LloydMaxCodec("turboquant_rvq", d, 2, seed=1), LloydMaxCodec("turboquant_rvq", d, 2, seed=1001))
    if n <= lloyd_max_n:  # the gather path: ~10x float32 SDPA, kept to a reference size by default
        ours("ours_lloyd4_gather", GatherLloydMax("turboquant_mse", d, 4, seed=1),
             GatherLloydMax("turboquant_mse", d, 4, seed=1001))
    return {k: v for k, v in cands.items() if k == "sdpa_f32" or not only or any(o in k for o in only)}


def _gather_codec():
    from veloxquant_mlx.codecs import LloydMaxCodec

    class GatherLloydMax(LloydMaxCodec):
        """`LloydMaxCodec` without its fused level kernels: every group read through MLX's gather."""

        def _fast(self, g, quant, codes):
            return None

        def affine_codes(self, codes):  # not the compiled attention either
            return None

    return GatherLloydMax


def time_interleaved(cands, repeats: int, seed: int):
    """Seconds per call of every candidate, one list each; a repeat runs every candidate once, in a fresh
    random order."""
    import mlx.core as mx

    for f, _ in cands.values():  # warm-up (first-call allocations, lazy graph setup)
        mx.eval(f())
    times = {name: [] for name in cands}
    order = list(cands)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            f = cands[name][0]
            t0 = time.perf_counter()
            mx.eval(f())
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n up to 4k only")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="history lengths (default 1k 4k 16k 32k)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per candidate (default 5)")
    ap.add_argument("--skip-f16-above", type=int, default=1 << 30,
                    help="skip the (slow on CPU) float16 SDPA baseline above this n")
    ap.add_argument("--lloyd-max-n", type=int, default=16384,
                    help="run the (slow) Lloyd-Max gather candidate only up to this n")
    ap.add_argument("--only", nargs="+", default=None,
                    help="time only the candidates whose name contains one of these (plus sdpa_f32)")
    ap.add_argument("--compile", action="store_true", help="also time mx.compile'd ours_aff4 / ours_blk4 (suffix _c)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/attention.json")
    args = ap.parse_args(argv)
    lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 4096, 16384, 32768])
    repeats = args.repeats or 5
    if repeats < 1 or any(n < 256 or n % 64 for n in lengths):
        ap.error("--repeats must be >= 1 and every length a multiple of 64, >= 256 (block keys; the window keeps 132)")

    import mlx.core as mx

    blas = loaded_blas()
    print(f"MLX {mx.__version__}, device {mx.default_device()}, BLAS: {blas}")
    rows = []
    for shape in args.shapes:
        Hq, Hkv, d = SHAPES[shape]
        for n in lengths:
            cands = build_candidates(Hq, Hkv, d, n, args.seed, args.skip_f16_above, args.lloyd_max_n, args.compile,
                                     args.only)
            times = time_interleaved(cands, repeats, args.seed + n)
            med = {k: statistics.median(ts) for k, ts in times.items()}
            low = {k: min(ts) for k, ts in times.items()}
            ref = cands["sdpa_f32"][0]()
            for name, (f, nb) in cands.items():
                err = float(mx.max(mx.abs(f().astype(mx.float32) - ref)) / mx.max(mx.abs(ref)))
                rows.append({
                    "shape": shape, "Hq": Hq, "Hkv": Hkv, "d": d, "n": n, "candidate": name,
                    "ms": med[name] * 1e3, "vs_sdpa_f32": med[name] / med["sdpa_f32"],
                    "min_ms": low[name] * 1e3, "min_vs_sdpa_f32": low[name] / low["sdpa_f32"],
                    "all_ms": [t * 1e3 for t in times[name]],
                    "bytes_per_token_head": nb, "compression_vs_f16": (4 * d) / nb,
                    "max_rel_err_vs_f32": err,
                })
            del cands
            print(f"\n{shape} (Hq={Hq}, Hkv={Hkv}, d={d}), n={n}, median of {repeats}")
            print(f"{'candidate':<16}{'median ms':>10}{'x f32':>8}{'min ms':>10}{'x f32':>8}"
                  f"{'B/tok/head':>12}{'x<f16':>8}{'max rel err':>13}")
            for r in rows:
                if r["shape"] == shape and r["n"] == n:
                    print(f"{r['candidate']:<16}{r['ms']:>10.2f}{r['vs_sdpa_f32']:>8.2f}"
                          f"{r['min_ms']:>10.2f}{r['min_vs_sdpa_f32']:>8.2f}"
                          f"{r['bytes_per_token_head']:>12d}{r['compression_vs_f16']:>8.2f}{r['max_rel_err_vs_f32']:>13.2e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas,
                   "repeats": repeats, "rows": rows}, fh, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    ensure_openblas()
    main()
