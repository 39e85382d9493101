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

    python -m benchmarks.probes.attention [--quick] [--repeats 5] [--compile] [--out results/attention.json]

``--shape NAME [NAME ...]`` (or ``all``) times instead one model's attention layer (`MODEL_SHAPES`: query heads / KV
heads, head_dim) at ``--lengths`` (default 4k 16k 32k): ``ours``, a decode step through the real cache class
(`TurboQuantPackedCache` with the default options, filled with random keys / values, attended through
``attend_packed``: the routed path, the compiled kernel where it is built) against ``sdpa_f32``
(``mx.fast.scaled_dot_product_attention`` on the plain float32 history), interleaved, median and spread (min, max)
of the repeats, written to ``results/attention_shapes.json`` unless ``--out`` says otherwise::

    python -m benchmarks.probes.attention --shape all --repeats 15

``--compare-kernel SO`` (with ``--shape``) also times the same decode step through another build of the compiled
module (``ours_compared``; the JSON gets its median and our speedup over it, paired per repeat).

``--rotating`` (with ``--shape``) times a sliding-window layer past eviction instead, windows of ``--lengths``
tokens: the default options as enable() gives a RotatingKVCache (per-token codes), ``keep=8`` (so kept codes, evicted
slots, live codes: two coded spans), filled with WINDOW tokens then 300 decode steps; ``ours`` (the kernel) against
``reference`` (the same step with the kernel off) and ``sdpa_f32`` on the window's float32 tokens.

``--row-plans`` measures how the compiled kernel should read the default's codes for R query heads per KV head
(`set_row_plan`: 4 or 2 vectors per row block straight from the codes, or 0: each tile decoded once), every
combination for keys and values interleaved, at ``--lengths`` (default 16k), ``--heads`` KV heads, ``--dims``::

    python -m benchmarks.probes.attention --row-plans --rs 1 2 3 4 6 8 16 --dims 64 128 --repeats 9

``--smoke`` runs every mode above once at 256 tokens, one repeat (the table on d=64, ``--shape smollm2-135m``, with
``--rotating``, ``--row-plans`` for R=3, d=64 where the kernel is built): the code runs, the figures mean nothing.
The JSON files go beside ``--out`` (``STEM_table.json``, ``STEM_shapes.json``, ...; default a temporary folder)::

    python -m benchmarks.probes.attention --smoke --out /tmp/attention.json
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

from veloxquant_mlx.apps.blas import ensure_openblas

from benchmarks import _common
from benchmarks._shapes import SHAPES as _MODELS
# The table mode's candidates live in _attention_candidates.py; imported here so that
# attention.build_candidates stays where it was.
from benchmarks.probes._attention_candidates import _gather_codec, build_candidates  # noqa: F401

SHAPES = {"d64": (9, 3, 64), "d128": (32, 8, 128)}

# --shape: (query heads, KV heads, head_dim) of one attention layer of the models of e2e_speed.py --shape
MODEL_SHAPES = {name: (f["num_attention_heads"], f["num_key_value_heads"],
                       f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"])
                for name, (_, f) in _MODELS.items()}


def load_other_kernel(path: str):
    """Another build of the compiled module (``--compare-kernel``: e.g. the sources before a change), loaded under
    a name of its own beside the package's."""
    import importlib.machinery
    import importlib.util

    name = "_vq_compared_kernel._coded_attention"  # (the last part names the module's init function)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def with_kernel_module(mod, f):
    """``f`` run with ``mod`` as the checked kernel module (the same decode step through another build)."""
    from veloxquant_mlx.attention import kernel

    def g():
        saved, kernel._module = kernel._module, mod
        try:
            return f()
        finally:
            kernel._module = saved
    return g


def build_shape_candidates(Hq: int, Hkv: int, d: int, n: int, seed: int):
    """``--shape``: name -> (zero-arg function, bytes per token per KV head for K+V): ``ours`` (a decode step of the
    default cache over ``n`` random tokens, through ``attend_packed``) and ``sdpa_f32`` (the plain float32 cache)."""
    import mlx.core as mx

    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.integration.routing import use_packed_attention
    from veloxquant_mlx.cache.presets import DEFAULT_NAME

    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    K = mx.random.normal((1, Hkv, n, d), key=k1) + 0.5 * mx.random.normal((1, Hkv, 1, d), key=k3)
    V = mx.random.normal((1, Hkv, n, d), key=k2)
    q = mx.random.normal((1, Hq, 1, d), key=mx.random.key(seed + 1))
    scale = d ** -0.5
    mx.eval(K, V, q)
    cache = TurboQuantPackedCache(DEFAULT_NAME)
    with use_packed_attention():
        cache.update_and_fetch(K, V)
        mx.eval(cache.attend_packed(q, scale, None))  # (the cache's first attention after its update)
    nb = cache.nbytes // (Hkv * n)

    return {"sdpa_f32": (lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale), 2 * 4 * d),
            "ours": (lambda: cache.attend_packed(q, scale, None), nb)}


def run_row_plans(args) -> None:
    """``--row-plans``: a decode step of the default cache per (key plan, value plan), interleaved, per R and d."""
    import itertools

    import mlx.core as mx

    from veloxquant_mlx.attention import kernel

    mod = kernel.compiled_module()
    if mod is None or not hasattr(mod, "set_row_plan"):
        raise SystemExit(f"--row-plans needs the compiled kernel with set_row_plan: {kernel.status()[1]}")
    lengths, repeats, rows = args.lengths or [16384], args.repeats or 9, []
    plans = list(itertools.product((4, 2, 0), repeat=2))
    print(f"{'R':>3}{'d':>5}{'n':>7}  " + "".join(f"{f'k{k}v{v}':>9}" for k, v in plans) + "   best  (median ms)")
    for d, R, n in itertools.product(args.dims, args.rs, lengths):
        cands = build_shape_candidates(R * args.heads, args.heads, d, n, args.seed)
        ours = cands["ours"][0]

        def planned(k, v):
            def f():
                mod.set_row_plan(k, v)
                return ours()
            return f
        try:
            times = time_interleaved({(k, v): (planned(k, v), 0) for k, v in plans}, repeats, args.seed + n)
        finally:
            mod.set_row_plan(-1, -1)
        med = {p: statistics.median(ts) * 1e3 for p, ts in times.items()}
        best = min(med, key=med.get)
        rows.append({"R": R, "d": d, "n": n, "Hkv": args.heads, "repeats": repeats,
                     "median_ms": {f"k{k}v{v}": m for (k, v), m in med.items()},
                     "all_ms": {f"k{k}v{v}": [t * 1e3 for t in ts] for (k, v), ts in times.items()}})
        print(f"{R:>3}{d:>5}{n:>7}  " + "".join(f"{med[p]:>9.2f}" for p in plans) + f"   k{best[0]}v{best[1]}",
              flush=True)
    _common.write_json(args.out or "results/attention_row_plans.json",
                       {"mlx": mx.__version__, "cpus": os.cpu_count(), "rows": rows})


def build_rotating_candidates(Hq: int, Hkv: int, d: int, window: int, seed: int):
    """``--rotating``: a sliding-window cache past eviction; ``ours``, ``reference`` (kernel off), ``sdpa_f32``."""
    import mlx.core as mx

    from veloxquant_mlx.attention import kernel
    from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache
    from veloxquant_mlx.integration.builder import _window_options
    from veloxquant_mlx.integration.routing import use_packed_attention
    from veloxquant_mlx.cache.presets import DEFAULT_NAME, resolve_options

    keep, extra = 8, 300
    options = _window_options(resolve_options(DEFAULT_NAME), keep, "RotatingKVCache")
    cache = TurboQuantRotatingPackedCache(options, max_size=window, keep=keep)
    ks = mx.random.split(mx.random.key(seed), 4)
    K = mx.random.normal((1, Hkv, window + extra, d), key=ks[0]) + 0.5 * mx.random.normal((1, Hkv, 1, d), key=ks[2])
    V = mx.random.normal((1, Hkv, window + extra, d), key=ks[1])
    q = mx.random.normal((1, Hq, 1, d), key=ks[3])
    scale = d ** -0.5
    with use_packed_attention():
        cache.update_and_fetch(K[:, :, :window], V[:, :, :window])
        cache.attend_packed(mx.zeros((1, Hq, window, d)), scale, "causal")
        for t in range(window, window + extra):
            cache.update_and_fetch(K[:, :, t:t + 1], V[:, :, t:t + 1])
            mx.eval(cache.attend_packed(q, scale, None))
    # the window's tokens as mlx_lm's RotatingKVCache holds them: the kept first ones and the newest
    Kw = mx.concatenate([K[:, :, :keep], K[:, :, extra + keep:]], axis=2)
    Vw = mx.concatenate([V[:, :, :keep], V[:, :, extra + keep:]], axis=2)
    mx.eval(Kw, Vw)

    def reference():
        previous = kernel.set_enabled(False)
        try:
            out = cache.attend_packed(q, scale, None)
            mx.eval(out)  # (evaluated with the kernel off)
            return out
        finally:
            kernel.set_enabled(previous)
    nb = cache.nbytes // (Hkv * window)
    return {"sdpa_f32": (lambda: mx.fast.scaled_dot_product_attention(q, Kw, Vw, scale=scale), 2 * 4 * d),
            "ours": (lambda: cache.attend_packed(q, scale, None), nb), "reference": (reference, nb)}


def run_shapes(args) -> None:
    """``--shape``: our decode step on the default layout's codes against SDPA on float32, per model shape."""
    import mlx.core as mx

    from veloxquant_mlx.attention import kernel

    names = list(MODEL_SHAPES) if "all" in args.shape else args.shape
    other = load_other_kernel(args.compare_kernel) if args.compare_kernel else None
    lengths = args.lengths or [4096, 16384, 32768]
    repeats = args.repeats or 11
    ok, path = kernel.status()
    print(f"{_common.environment()}; ours: {path}")
    rows = []
    print(f"{'shape':<14}{'Hq/Hkv,d':>12}{'n':>7}{'sdpa ms':>9}{'ours ms':>9}{'ours min-max':>15}{'speedup':>9}"
          f"{'kernel':>8}{'rel err':>10}" + (f"{'cmp ms':>10}{'vs cmp':>10}" if other else "")
          + (f"{'ref ms':>10}{'vs ref':>10}" if args.rotating else ""))
    for name in names:
        Hq, Hkv, d = MODEL_SHAPES[name]
        for n in lengths:
            cands = build_rotating_candidates(Hq, Hkv, d, n, args.seed) if args.rotating else \
                build_shape_candidates(Hq, Hkv, d, n, args.seed)
            if other is not None:
                cands["ours_compared"] = (with_kernel_module(other, cands["ours"][0]), cands["ours"][1])
            before = kernel.calls()["kernel"]
            times = time_interleaved(cands, repeats, args.seed + n)
            answered = kernel.calls()["kernel"] - before  # (warm-up included: every call of ours)
            ref, got = cands["sdpa_f32"][0](), cands["ours"][0]()
            err = float(mx.max(mx.abs(got.astype(mx.float32) - ref)) / mx.max(mx.abs(ref)))
            med = {k: statistics.median(ts) * 1e3 for k, ts in times.items()}
            ratios = [a / b for a, b in zip(times["sdpa_f32"], times["ours"])]  # (paired: the same repeat)
            row = {"shape": name, "Hq": Hq, "Hkv": Hkv, "d": d, "n": n, "repeats": repeats,
                   "sdpa_f32_ms": med["sdpa_f32"], "ours_ms": med["ours"],
                   "speedup_median_of_pairs": statistics.median(ratios), "speedup_min": min(ratios),
                   "speedup_max": max(ratios),
                   "all_ms": {k: [t * 1e3 for t in ts] for k, ts in times.items()},
                   "ours_bytes_per_token_head": cands["ours"][1], "kernel_calls": answered,
                   "max_rel_err_vs_f32": err}
            if other is not None:  # this build against the other one, paired per repeat
                row["compared_kernel"] = args.compare_kernel
                row["compared_ms"] = med["ours_compared"]
                row["ours_speedup_vs_compared"] = statistics.median(
                    [a / b for a, b in zip(times["ours_compared"], times["ours"])])
            if "reference" in times:  # --rotating: the kernel against the same step on the reference
                row["rotating_keep"] = 8
                row["reference_ms"] = med["reference"]
                row["ours_speedup_vs_reference"] = statistics.median(
                    [a / b for a, b in zip(times["reference"], times["ours"])])
            rows.append(row)
            lo, hi = min(times["ours"]) * 1e3, max(times["ours"]) * 1e3
            print(f"{name:<14}{f'{Hq}/{Hkv},{d}':>12}{n:>7}{med['sdpa_f32']:>9.2f}{med['ours']:>9.2f}"
                  f"{f'{lo:.2f}-{hi:.2f}':>15}{row['speedup_median_of_pairs']:>8.2f}x{answered:>8}{err:>10.2e}"
                  + (f"{med['ours_compared']:>10.2f}{row['ours_speedup_vs_compared']:>9.2f}x" if other else "")
                  + (f"{med['reference']:>10.2f}{row['ours_speedup_vs_reference']:>9.2f}x" if args.rotating else ""),
                  flush=True)
            del cands
    _common.write_json(args.out or "results/attention_shapes.json",
                       {"mlx": mx.__version__, "device": str(mx.default_device()), "blas": _common.blas(), "path": path,
                        "cpus": os.cpu_count(), "rows": rows})


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


def run_smoke(args) -> None:
    """``--smoke``: every mode once, 256 tokens, one repeat; each mode's JSON beside ``--out``."""
    from veloxquant_mlx.attention import kernel

    stem = os.path.splitext(args.out or os.path.join(tempfile.mkdtemp(prefix="attention_smoke_"), "attention"))[0]
    small = ["--lengths", "256", "--repeats", "1", "--seed", str(args.seed)]
    modes = {"table": ["--shapes", "d64", "--lloyd-max-n", "256"],
             "shapes": ["--shape", "smollm2-135m"],
             "rotating": ["--shape", "smollm2-135m", "--rotating"]}
    mod = kernel.compiled_module()
    if mod is not None and hasattr(mod, "set_row_plan"):
        modes["row_plans"] = ["--row-plans", "--rs", "3", "--dims", "64", "--heads", "1"]
    else:
        print(f"--row-plans left out: {kernel.status()[1]}")
    for name, extra in modes.items():
        print(f"\n== smoke: {name}", flush=True)
        main(small + extra + ["--out", f"{stem}_{name}.json"])


def main(argv=None):
    ap = _common.parser(__doc__)
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
    _common.add_out(ap, help="JSON written (default results/attention.json, with --shape "
                    "results/attention_shapes.json, with --row-plans results/attention_row_plans.json)")
    ap.add_argument("--shape", nargs="+", default=None, choices=list(MODEL_SHAPES) + ["all"],
                    help="time one model's attention layer instead (see the module docstring)")
    ap.add_argument("--compare-kernel", default=None, metavar="SO", help="--shape: also time our decode step through "
                    "this other build of _coded_attention (e.g. one of the sources before a change), interleaved")
    ap.add_argument("--rotating", action="store_true", help="--shape: a sliding-window layer past eviction, "
                    "--lengths its windows (docstring)")
    ap.add_argument("--row-plans", action="store_true", help="measure the kernel's row plans per R (docstring)")
    ap.add_argument("--rs", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16], help="--row-plans: query heads per "
                    "KV head")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="--row-plans: head dims")
    ap.add_argument("--heads", type=int, default=4, help="--row-plans: KV heads")
    ap.add_argument("--smoke", action="store_true", help="every mode once at 256 tokens, one repeat (docstring)")
    args = ap.parse_args(argv)
    if args.smoke:
        return run_smoke(args)
    if args.row_plans:
        return run_row_plans(args)
    if args.shape:
        return run_shapes(args)
    args.out = args.out or "results/attention.json"
    lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 4096, 16384, 32768])
    repeats = args.repeats or 5
    if repeats < 1 or any(n < 256 or n % 64 for n in lengths):
        ap.error("--repeats must be >= 1 and every length a multiple of 64, >= 256 (block keys; the window keeps 132)")

    import mlx.core as mx

    blas = _common.blas()
    print(_common.environment())
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
    print()
    _common.write_json(args.out, {"mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas,
                                  "repeats": repeats, "rows": rows})


if __name__ == "__main__":
    ensure_openblas()
    main()
