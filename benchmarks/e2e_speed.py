"""End-to-end speed and peak memory of SmolLM2-135M with each KV cache, attention on codes included.

Configs (all in one process, interleaved per repeat so machine load hits every config alike):

- ``kv``: mlx_lm ``KVCache`` (float, the reference for the ratios);
- ``mlx-q4``: mlx_lm ``QuantizedKVCache(group_size=64, bits=4)``;
- ``tq-affine4-hook``: ours, ``codec="affine"`` 4-bit K/V, inside ``use_packed_attention()``;
- ``tq-lm4-hook``: ours, Lloyd-Max 4-bit K/V, inside ``use_packed_attention()``;
- ``tq-lm4``: ours, Lloyd-Max 4-bit K/V, no hook (history decoded on every fetch).

One pass per config and repeat (the 2-core machine has no time for separate speed and memory passes):
clear MLX's buffer cache, reset the peak, make a fresh cache, prefill a ``--prompt``-token prompt in
chunks of ``--chunk`` (timed: prefill tok/s), decode ``--decode`` greedy tokens at that context (timed:
decode tok/s), then read ``mx.get_peak_memory()`` (weights included). Speeds are medians over
``--repeats``, the peak the largest seen. A plain loop (``model(tokens, cache=...)`` + ``mx.eval``).

    python benchmarks/e2e_speed.py --out results/e2e_speed.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

CONFIGS = ("kv", "mlx-q4", "tq-affine4-hook", "tq-lm4-hook", "tq-lm4")


def make_cache(name, model):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    import veloxquant_mlx as vq

    if name == "kv":
        return [KVCache() for _ in model.layers]
    if name == "mlx-q4":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    if name == "tq-affine4-hook":
        return vq.make_prompt_cache(model, k_bits=4, v_bits=4, codec="affine")
    return vq.make_prompt_cache(model, k_bits=4, v_bits=4)


def context_for(name):
    from veloxquant_mlx.attention import use_packed_attention

    return use_packed_attention() if name.endswith("-hook") else contextlib.nullcontext()


def prefill(model, cache, prompt, chunk):
    """Feed ``prompt`` (1, L) in chunks; returns the last logits (1, V), evaluated."""
    import mlx.core as mx

    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start : start + chunk], cache=cache)[:, -1]
        mx.eval(logits)
    return logits


def decode(model, cache, logits, n):
    import mlx.core as mx

    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        logits = model(tok[:, None], cache=cache)[:, -1]
        mx.eval(logits)
    return logits


def run_once(name, model, prompt, chunk, n_decode):
    """One fresh cache: (prefill tok/s, decode tok/s, peak bytes, stored cache bytes)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = make_cache(name, model)
    with context_for(name):
        t0 = time.perf_counter()
        logits = prefill(model, cache, prompt, chunk)
        t1 = time.perf_counter()
        decode(model, cache, logits, n_decode)
        t2 = time.perf_counter()
    peak = mx.get_peak_memory()
    stored = sum(int(getattr(c, "live_nbytes", c.nbytes)) for c in cache)
    del cache
    return prompt.shape[1] / (t1 - t0), n_decode / (t2 - t1), int(peak), stored


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()  # before mlx is imported: re-executes with OpenBLAS preloaded

    import mlx.core as mx

    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (context for decode)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    ap.add_argument("--decode", type=int, default=100, help="decode tokens per run (timed, and in the peak)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS}")
    ap.add_argument("--out", default="results/e2e_speed.json")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = sorted(set(configs) - set(CONFIGS))
    if bad:
        raise ValueError(f"--configs must name entries of {CONFIGS}, got {bad}")
    if "kv" not in configs:
        raise ValueError("--configs must include 'kv' (the ratios are relative to it)")
    for name in ("prompt", "chunk", "decode", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")

    model, tok = load_model(args.model)
    ids = corpus_tokens(tok)
    while len(ids) < args.prompt:
        ids = ids + ids
    prompt = mx.array([ids[: args.prompt]])

    speed = {c: {"prefill": [], "decode": []} for c in configs}
    memory = {c: (0, 0) for c in configs}
    run_once("kv", model, prompt[:, : args.chunk], args.chunk, 2)  # warm-up (kernels, allocator)
    for r in range(args.repeats):
        for c in configs:
            p, d, peak, stored = run_once(c, model, prompt, args.chunk, args.decode)
            speed[c]["prefill"].append(p)
            speed[c]["decode"].append(d)
            memory[c] = (max(memory[c][0], peak), stored)
            print(f"repeat {r}: {c:16s} prefill {p:8.1f} tok/s  decode {d:7.2f} tok/s  peak {peak / 2**20:8.1f} MiB",
                  flush=True)

    rows = []
    kv_p, kv_d = (statistics.median(speed["kv"][k]) for k in ("prefill", "decode"))
    for c in configs:
        p, d = statistics.median(speed[c]["prefill"]), statistics.median(speed[c]["decode"])
        rows.append({
            "config": c, "prefill_tok_s": p, "decode_tok_s": d,
            "prefill_vs_kv": p / kv_p, "decode_vs_kv": d / kv_d,
            "prefill_runs": speed[c]["prefill"], "decode_runs": speed[c]["decode"],
            "peak_mib": memory[c][0] / 2**20, "cache_mib": memory[c][1] / 2**20,
        })
    print(f"\nSmolLM2-135M, {args.prompt}-token prompt (chunks of {args.chunk}), decode {args.decode} tokens, "
          f"median of {args.repeats}; peak over the prefill + decode")
    print(f"{'config':16s} {'prefill tok/s':>13s} {'x kv':>6s} {'decode tok/s':>12s} {'x kv':>6s} "
          f"{'peak MiB':>9s} {'cache MiB':>9s}")
    for row in rows:
        print(f"{row['config']:16s} {row['prefill_tok_s']:13.1f} {row['prefill_vs_kv']:6.2f} "
              f"{row['decode_tok_s']:12.2f} {row['decode_vs_kv']:6.2f} {row['peak_mib']:9.1f} {row['cache_mib']:9.2f}")
    out = {"model": args.model, "prompt": args.prompt, "chunk": args.chunk, "decode": args.decode,
           "repeats": args.repeats, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
