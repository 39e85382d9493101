"""Peak memory of a long prefill + decode through mlx_lm with each cache, in one process.

For each cache: clear MLX's buffer cache, reset the peak counter, then run ``mlx_lm``'s
``generate_step`` (what ``mlx_lm.generate`` uses) over a ``--prompt``-token prompt and ``--decode``
greedy tokens; report ``mx.get_peak_memory()`` (model weights included) and the cache's stored bytes.

    python benchmarks/memory.py --prompt 4096 --decode 100 --out results/memory.json

``--bits``: no model run; the one rule for bits (`veloxquant_mlx.apps.eval.memory.measure_bits`: every stored byte of
caches holding random tokens in SmolLM2's attention shape, 3 KV heads of 64) for each registered configuration at
512, 2048, 3000 and 4096 tokens, averaged over a KL window's positions, and the most held after any chunk; the
budget presets also in the layout before issue 47 (``-exact-tail``: tokens waiting for their key block held
exact), for comparison:

    python benchmarks/memory.py --bits --out results/bits.json
"""
from __future__ import annotations

import gc
import time

from veloxquant_mlx.apps.blas import ensure_openblas

import _common

ensure_openblas()

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.apps.eval import corpus_tokens  # noqa: E402
from veloxquant_mlx.apps.models.loader import load_model  # noqa: E402

# The caches users run: mlx_lm's own (plain, 8-bit, 4-bit) and this library's default and 4-bit budget presets.
CACHES = {
    "kv": lambda m: [KVCache() for _ in m.layers],
    "mlx-q8": lambda m: [QuantizedKVCache(group_size=64, bits=8) for _ in m.layers],
    "mlx-q4": lambda m: [QuantizedKVCache(group_size=64, bits=4) for _ in m.layers],
    "tq-affine-k8v4": lambda m: vq.make_prompt_cache(m, "tq-affine-k8v4"),
    "tq-4b": lambda m: vq.make_prompt_cache(m, "tq-4b"),
}


def run_one(model, prompt, make, n_decode, prefill_step):
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = make(model)
    t0 = time.time()
    tokens = []
    for tok, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n_decode,
                                prefill_step_size=prefill_step):
        tokens.append(int(tok))
    seconds = time.time() - t0
    peak = mx.get_peak_memory()
    stored = sum(int(getattr(c, "live_nbytes", c.nbytes)) for c in cache)
    del cache
    return {"peak_bytes": int(peak), "peak_mib": peak / 2**20, "cache_bytes": stored,
            "cache_mib": stored / 2**20, "seconds": seconds, "tokens": tokens}


def bits_table(kv_heads: int = 3, head_dim: int = 64, lengths=None) -> dict:
    """name -> `measure_bits` of every registered configuration (and the budget presets with an exact tail)."""
    import dataclasses

    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.apps.eval.memory import REPORT_LENGTHS, measure_bits
    from veloxquant_mlx.apps.eval.specs import registered_specs
    from veloxquant_mlx.cache.presets import BUDGETS, PRESETS

    lengths = tuple(lengths or REPORT_LENGTHS)
    makes = {s.name: s.make_cache for s in registered_specs()}
    for name in BUDGETS:
        exact = dataclasses.replace(PRESETS[name], codec="kblock_vsym8")
        makes[f"{name}-exact-tail"] = lambda model, o=exact: [TurboQuantPackedCache(o) for _ in model.layers]
    out = {}
    for name, make in makes.items():
        per_layer = name in PRESETS and (isinstance(PRESETS[name].k_bits, tuple) or
                                         isinstance(PRESETS[name].v_bits, tuple))
        out[name] = measure_bits(make, kv_heads, head_dim, lengths=lengths, n_layers=30 if per_layer else 1)
    return out


def print_bits(table: dict) -> None:
    lengths = sorted(next(iter(table.values()))["bits"])
    cols = [f"@{n}" for n in lengths] + [f"KL-avg @{n}" for n in lengths] + ["max"]
    print(f"{'method':22s} " + " ".join(f"{c:>12s}" for c in cols))
    for name, m in table.items():
        cells = [m["bits"][n] for n in lengths] + [m["kl_average_bits"][n] for n in lengths] + \
            [max(m["max_bits"].values())]
        print(f"{name:22s} " + " ".join(f"{c:12.3f}" for c in cells))


def main(argv=None):
    ap = _common.parser(__doc__)
    ap.add_argument("--bits", action="store_true", help="only the bits table (no model run; see above)")
    _common.add_model(ap)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=100)
    ap.add_argument("--prefill-step", type=int, default=2048, help="mlx_lm's prefill_step_size")
    ap.add_argument("--caches", default=",".join(CACHES))
    _common.add_out(ap, "results/memory.json")
    args = ap.parse_args(argv)

    if args.bits:
        table = bits_table()
        print("bits per coordinate, every stored byte (random tokens, 3 KV heads of 64; the sink's tokens counted)")
        print_bits(table)
        _common.write_json(args.out, {n: {k: {str(x): y for x, y in v.items()} if isinstance(v, dict) else v
                                           for k, v in m.items()} for n, m in table.items()})
        return

    model, tokenizer = load_model(args.model)
    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = mx.array(corpus_tokens(tokenizer, min_tokens=args.prompt)[: args.prompt])
    out = {"model": args.model, "prompt": args.prompt, "decode": args.decode, "weights_bytes": int(weights),
           "caches": {}}
    names = [n for n in args.caches.split(",") if n]
    for name in names:
        if name not in CACHES:
            raise SystemExit(f"unknown cache {name!r}; choose from {sorted(CACHES)}")
        r = run_one(model, prompt, CACHES[name], args.decode, args.prefill_step)
        out["caches"][name] = r
        print(f"{name:12s} peak {r['peak_mib']:8.1f} MiB  cache {r['cache_mib']:7.2f} MiB  {r['seconds']:6.1f} s",
              flush=True)
    if "mlx-q4" in out["caches"]:
        ref = out["caches"]["mlx-q4"]["peak_bytes"]
        out["not_above_mlx_q4"] = {n: r["peak_bytes"] <= ref for n, r in out["caches"].items()}
        print("peak <= mlx-q4's:", out["not_above_mlx_q4"])
    _common.write_json(args.out, out)


if __name__ == "__main__":
    main()
