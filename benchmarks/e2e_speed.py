"""End-to-end speed and peak memory of SmolLM2-135M with each KV cache, attention on codes included.

Configs (all in one process; decode repeats interleaved so machine load hits every config alike):

- ``kv``: mlx_lm ``KVCache`` (float, the reference for the ratios);
- ``mlx-q4``: mlx_lm ``QuantizedKVCache(group_size=64, bits=4)``;
- ``tq-block4-hook``: ours, ``codec="affine_block"`` 4-bit K/V (keys as K^T codes in 64-token blocks,
  values per token), inside ``use_packed_attention()`` — the fast configuration;
- ``tq-block84-hook`` / ``tq-block8-hook``: the same layout with 8-bit keys and 4-bit / 8-bit values (MLX's CPU
  quantized matmul is faster on byte-aligned codes);
- ``tq-affine4-hook``: ours, ``codec="affine"`` 4-bit K/V (keys per token), inside the hook;
- ``tq-lm4-hook``: ours, Lloyd-Max 4-bit K/V, inside the hook;
- ``tq-lm4``: ours, Lloyd-Max 4-bit K/V, built with ``route_attention=False`` and run outside the hook (history
  decoded on every fetch: what attention cost before it ran on codes; not in the default list);
- any registered TurboQuant method name (``veloxquant methods``, e.g. ``tq-affine-k8v4``: 4 exact sink tokens),
  built as the CLI builds it (`make_prompt_cache(model, options)`: attends from its codes while alive, no context
  manager needed; run inside the hook as well, which changes nothing for them);
- ``--configs all``: ``kv``, ``mlx-q4`` and every registered method.

The configs above use `make_prompt_cache` defaults (no exact sink tokens).

Per config: clear MLX's buffer cache, reset the peak, make a fresh cache, prefill a ``--prompt``-token
prompt in chunks of ``--chunk`` (timed once: prefill tok/s), decode ``--decode`` greedy tokens (timed),
read ``mx.get_peak_memory()`` (weights included; minus the active memory held, when the config
started, by the caches of the configs measured before it: they stay alive for pass 2). Decode speed is
timed two ways:

- ``step``: one greedy step (``model(token, cache)`` + ``mx.eval``), the configs taking turns step by
  step in a shuffled order, ``--decode`` steps per round, ``--repeats`` rounds (each round starts again
  from the prompt): machine load drifts over seconds on the shared CPU, and this spreads it over every
  config alike. tok/s = 1 / median step time.
- ``mlx_lm``: ``mlx_lm.generate.generate_step`` for ``--decode`` tokens (what ``mlx_lm.generate`` /
  ``stream_generate`` run: the next step's graph is built while the current one computes), one pass per
  config and repeat, round-robin; tok/s = median over the passes.

Speeds are medians over the repeats; ratios are against ``kv`` in the same loop.

    python benchmarks/e2e_speed.py --out results/e2e_speed.json
    python benchmarks/e2e_speed.py --prompt 8192 --configs all --fill interleaved   # paired prefill ratios, no peak
    python benchmarks/e2e_speed.py --prompt 8192 --configs all --fill plain   # decode only: caches filled from the plain one

``--fill interleaved``: the configs prefill the prompt taking turns chunk by chunk (shuffled order per chunk), so
their prefill ratios are paired like the decode steps (total kv time / total time, bootstrap interval over the
chunks) instead of minutes apart; peak memory is not measured then (every cache is alive at once).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import statistics
import time

CONFIGS = ("kv", "mlx-q4", "tq-block4-hook", "tq-block84-hook", "tq-block8-hook", "tq-affine4-hook", "tq-lm4-hook",
           "tq-lm4")
DEFAULT_CONFIGS = CONFIGS[:-1]
# (codec, key bits, value bits) of our configs
OURS = {
    "tq-block4-hook": ("affine_block", 4, 4),
    "tq-block84-hook": ("affine_block", 8, 4),
    "tq-block8-hook": ("affine_block", 8, 8),
    "tq-affine4-hook": ("affine", 4, 4),
    "tq-lm4-hook": ("lloyd_max", 4, 4),
    "tq-lm4": ("lloyd_max", 4, 4),
}
LOOPS = ("step", "mlx_lm")


def registered(name):
    """The registered TurboQuant method called ``name``, or None."""
    from veloxquant_mlx.eval.specs import compressed_specs

    return next((s for s in compressed_specs() if s.name == name), None)


def make_cache(name, model):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    import veloxquant_mlx as vq

    spec = registered(name)
    if spec is not None:
        return spec.make_cache(model)

    if name == "kv":
        return [KVCache() for _ in model.layers]
    if name == "mlx-q4":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    codec, k_bits, v_bits = OURS[name]
    return vq.make_prompt_cache(model, k_bits=k_bits, v_bits=v_bits, codec=codec,
                                route_attention=name.endswith("-hook"))


def context_for(name):
    from veloxquant_mlx.integration import use_packed_attention

    hooked = name.endswith("-hook") or registered(name) is not None
    return use_packed_attention() if hooked else contextlib.nullcontext()


def prefill(model, cache, prompt, chunk):
    """Feed ``prompt`` (1, L) in chunks; returns the last logits (1, V), evaluated."""
    import mlx.core as mx

    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start : start + chunk], cache=cache)[:, -1]
        mx.eval(logits)
    return logits


def interleaved_prefill(model, caches, prompt, chunk, rng):
    """Every config prefills ``prompt`` (1, L), the configs taking turns chunk by chunk in a shuffled order (a
    drift of the machine's speed then hits every config alike); per-chunk seconds and the last logits (1, V)."""
    import mlx.core as mx

    times, logits = {c: [] for c in caches}, {}
    for start in range(0, prompt.shape[1], chunk):
        order = list(caches)
        rng.shuffle(order)
        for c in order:
            with context_for(c):
                t0 = time.perf_counter()
                logits[c] = model(prompt[:, start: start + chunk], cache=caches[c])[:, -1]
                mx.eval(logits[c])
                times[c].append(time.perf_counter() - t0)
    return times, logits


def paired_prefill_ratio(kv_chunks, chunks, n_boot=2000, seed=0):
    """Prefill speed vs ``kv`` from chunks taken in turn: ``(total kv time / total time, 2.5 %, 97.5 %)``, the
    interval a bootstrap over the chunk pairs (seeded)."""
    rng = random.Random(seed)
    idx = range(len(chunks))
    boots = sorted(sum(kv_chunks[i] for i in pick) / sum(chunks[i] for i in pick)
                   for pick in (rng.choices(idx, k=len(chunks)) for _ in range(n_boot)))
    return sum(kv_chunks) / sum(chunks), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def fill_from(cache, plain_cache):
    """Fill ``cache`` with the keys/values ``plain_cache`` (mlx_lm ``KVCache`` s) holds: one update per layer, no
    forward pass. For decode-speed runs at long contexts, where prefilling every config would take hours here;
    the codes are then of the plain model's keys/values, not of those the config's own prefill would produce.
    Caches that attend from their codes get one single-query attention call per layer (what a forward pass makes),
    so they see the update/attention protocol they always see."""
    import mlx.core as mx
    import mlx_lm.models.base as mlx_base

    for c, p in zip(cache, plain_cache):
        keys, values = p.keys[..., : p.offset, :], p.values[..., : p.offset, :]
        k, v = c.update_and_fetch(keys, values)
        q = mx.zeros((keys.shape[0], keys.shape[1], 1, keys.shape[-1]), keys.dtype)  # one query per KV head
        mx.eval(mlx_base.scaled_dot_product_attention(q, k, v, cache=c, scale=keys.shape[-1] ** -0.5, mask=None))
        mx.eval(c.state)


def machine() -> str:
    """The CPU model and core count (what a speed ratio depends on; say it beside every figure)."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def _num(x, width: int, digits: int, div: float = 1.0) -> str:
    return "-".rjust(width) if x is None else f"{x / div:{width}.{digits}f}"


def decode_step(model, cache, token):
    """One greedy step: ``token`` (1,) -> next token (1,), evaluated."""
    import mlx.core as mx

    nxt = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
    mx.eval(nxt)
    return nxt


def decode_mlx_lm(model, cache, first_token, n):
    """``n`` tokens through mlx_lm's own decode loop; returns tok/s and trims the cache back."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    offset = cache[0].offset
    t0 = time.perf_counter()
    for _ in generate_step(first_token, model, prompt_cache=cache, max_tokens=n):
        pass
    mx.eval([c.state for c in cache])
    dt = time.perf_counter() - t0
    grown = cache[0].offset - offset
    for c in cache:
        c.trim(grown)
    return n / dt


def interleaved_steps(model, caches, first, n, rng):
    """One round: ``n`` decode steps per config, configs taking turns; per-step seconds, caches trimmed back."""
    times = {c: [] for c in caches}
    tokens = dict(first)
    for _ in range(n):
        order = list(caches)
        rng.shuffle(order)
        for c in order:
            with context_for(c):
                t0 = time.perf_counter()
                tokens[c] = decode_step(model, caches[c], tokens[c])
                times[c].append(time.perf_counter() - t0)
    for cache in caches.values():
        for layer in cache:
            layer.trim(n)
    return times


def paired_step_ratio(kv_steps, steps, n_boot=2000, seed=0):
    """Decode speed vs ``kv`` from steps taken in turn: ``(geometric mean, 2.5 %, 97.5 %)`` of kv_time / time.

    Step ``i`` of every config ran back to back (`interleaved_steps`), so pairing by index cancels the load
    drift that both saw; the interval is a bootstrap over the pairs (seeded, reproducible).
    """
    logs = [math.log(a / b) for a, b in zip(kv_steps, steps)]
    rng = random.Random(seed)
    boots = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(n_boot))
    lo, hi = boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi)


def print_paired(rows):
    kv = next(r for r in rows if r["config"] == "kv")
    if kv.get("prefill_chunk_seconds"):
        print("prefill paired with kv chunk by chunk: total kv time / total time, 95 % bootstrap interval")
        for r in rows:
            if r["config"] != "kv":
                g, lo, hi = paired_prefill_ratio(kv["prefill_chunk_seconds"], r["prefill_chunk_seconds"])
                print(f"  {r['config']:16s} {g:.3f}x  [{lo:.3f}, {hi:.3f}]  ({len(r['prefill_chunk_seconds'])} chunks)")
    if not kv.get("step_seconds"):
        return
    print("decode[step] paired with kv step by step: geometric mean of kv_time / time, 95 % bootstrap interval")
    for r in rows:
        if r["config"] != "kv" and r.get("step_seconds"):
            g, lo, hi = paired_step_ratio(kv["step_seconds"], r["step_seconds"])
            print(f"  {r['config']:16s} {g:.3f}x  [{lo:.3f}, {hi:.3f}]  ({len(r['step_seconds'])} pairs)")


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas, loaded_blas as blas_name

    ensure_openblas()  # before mlx is imported: re-executes with OpenBLAS preloaded

    import mlx.core as mx

    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (context for decode)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    ap.add_argument("--decode", type=int, default=48, help="decode tokens per pass / steps per round")
    ap.add_argument("--repeats", type=int, default=3, help="mlx_lm passes and interleaved rounds per config")
    ap.add_argument("--seed", type=int, default=0, help="turn order of the interleaved steps")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {CONFIGS} or registered methods, or 'all'")
    ap.add_argument("--loops", default=",".join(LOOPS), help=f"comma list of {LOOPS}")
    ap.add_argument("--fill", choices=("prefill", "interleaved", "plain"), default="prefill",
                    help="prefill: every config prefills the prompt itself, one after another (timed, peak "
                         "measured); interleaved: every config prefills it, the configs taking turns chunk by chunk "
                         "(paired prefill ratios that a drift of the machine's speed does not bias; no peak); "
                         "plain: only kv prefills, every other cache is filled with its keys/values (decode speed "
                         "only)")
    ap.add_argument("--out", default="results/e2e_speed.json")
    ap.add_argument("--summarize", metavar="JSON", help="print the paired step ratios of a saved run and exit")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print_paired(json.load(f)["rows"])
        return
    configs = [c for c in args.configs.split(",") if c]
    if configs == ["all"]:
        from veloxquant_mlx.eval.specs import CONFIGURATIONS

        configs = ["kv", "mlx-q4", *CONFIGURATIONS]
    loops = [c for c in args.loops.split(",") if c]
    bad = sorted(c for c in configs if c not in CONFIGS and registered(c) is None) + sorted(set(loops) - set(LOOPS))
    if bad:
        raise ValueError(f"--configs must name entries of {CONFIGS} or registered TurboQuant methods, and --loops "
                         f"entries of {LOOPS}; got {bad}")
    if "kv" not in configs:
        raise ValueError("--configs must include 'kv' (the ratios are relative to it)")
    for name in ("prompt", "chunk", "decode", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    from veloxquant_mlx.attention import kernel as attention_kernel
    print(f"BLAS: {blas_name()}; machine: {machine()}; attention on codes: {attention_kernel.status()[1]}", flush=True)
    if args.fill == "plain":
        print("--fill plain is a DIAGNOSTIC mode (caches filled from the plain cache's keys, no real prefill): its "
              "ratios are not what users run; quote the default --fill prefill", flush=True)

    model, tok = load_model(args.model)
    ids = corpus_tokens(tok)
    while len(ids) < args.prompt:
        ids = ids + ids
    prompt = mx.array([ids[: args.prompt]])

    warm = make_cache("kv", model)  # warm-up (kernels, allocator)
    prefill(model, warm, prompt[:, : args.chunk], args.chunk)
    del warm
    gc.collect()
    mx.clear_cache()
    held_at_start = mx.get_active_memory()  # weights (and nothing else alive)

    caches, first, prefill_tps, peak, stored = {}, {}, {}, {}, {}
    decode_tps = {(c, lp): [] for c in configs for lp in loops}
    configs = ["kv"] + [c for c in configs if c != "kv"]  # kv first: --fill plain copies its keys/values
    rng = random.Random(args.seed)
    chunk_times = {}
    if args.fill == "interleaved":  # pass 0: every config prefills, chunk by chunk in turn
        caches = {c: make_cache(c, model) for c in configs}
        chunk_times, logits = interleaved_prefill(model, caches, prompt, args.chunk, rng)
        for c in configs:
            prefill_tps[c], first[c] = prompt.shape[1] / sum(chunk_times[c]), mx.argmax(logits[c], axis=-1)
        print("prefill (interleaved): " + "  ".join(f"{c} {prefill_tps[c]:.1f}" for c in configs), flush=True)
    for c in configs:  # pass 1: prefill, one mlx_lm decode pass, peak memory (this config's cache the only new one)
        gc.collect()
        mx.clear_cache()
        others = mx.get_active_memory() - held_at_start  # earlier configs' caches, kept for pass 2
        mx.reset_peak_memory()
        cache = caches[c] if args.fill == "interleaved" else make_cache(c, model)
        with context_for(c):
            if args.fill == "interleaved":
                pass
            elif args.fill == "plain" and c != "kv":
                fill_from(cache, caches["kv"])
                prefill_tps[c], first[c] = None, first["kv"]
            else:
                t0 = time.perf_counter()
                logits = prefill(model, cache, prompt, args.chunk)
                prefill_tps[c] = prompt.shape[1] / (time.perf_counter() - t0)
                first[c] = mx.argmax(logits, axis=-1)
            if "mlx_lm" in loops:
                decode_tps[(c, "mlx_lm")].append(decode_mlx_lm(model, cache, first[c], args.decode))
        peak[c] = None if args.fill == "interleaved" or (args.fill == "plain" and c != "kv") else \
            mx.get_peak_memory() - others
        stored[c] = sum(int(getattr(x, "live_nbytes", x.nbytes)) for x in cache)
        caches[c] = cache
        print(f"{c:16s} prefill {_num(prefill_tps[c], 7, 1)} tok/s  peak {_num(peak[c], 7, 1, 2**20)} MiB  "
              + "  ".join(f"decode[{lp}] {v[-1]:6.2f}" for (cc, lp), v in decode_tps.items() if cc == c and v),
              flush=True)
    step_times = {c: [] for c in configs}
    for r in range(args.repeats):  # pass 2
        if "step" in loops:
            for c, t in interleaved_steps(model, caches, first, args.decode, rng).items():
                step_times[c].extend(t)
            print(f"round {r}: " + "  ".join(f"{c} {1 / statistics.median(step_times[c]):.2f}" for c in configs),
                  flush=True)
        if "mlx_lm" in loops and r > 0:
            for c in configs:
                with context_for(c):
                    decode_tps[(c, "mlx_lm")].append(decode_mlx_lm(model, caches[c], first[c], args.decode))
            print(f"repeat {r}: mlx_lm " + "  ".join(f"{c} {decode_tps[(c, 'mlx_lm')][-1]:.2f}" for c in configs),
                  flush=True)
    if "step" in loops:
        for c in configs:
            decode_tps[(c, "step")] = [1 / statistics.median(step_times[c])]

    rows = []
    for c in configs:
        row = {"config": c, "prefill_tok_s": prefill_tps[c],
               "prefill_vs_kv": None if prefill_tps[c] is None else prefill_tps[c] / prefill_tps["kv"],
               "peak_mib": None if peak[c] is None else peak[c] / 2**20, "cache_mib": stored[c] / 2**20}
        for lp in loops:
            d, d_kv = statistics.median(decode_tps[(c, lp)]), statistics.median(decode_tps[("kv", lp)])
            row.update({f"decode_{lp}_tok_s": d, f"decode_{lp}_vs_kv": d / d_kv, f"decode_{lp}_runs": decode_tps[(c, lp)]})
        if "step" in loops:
            row["step_seconds"] = step_times[c]
        if chunk_times:
            row["prefill_chunk_seconds"] = chunk_times[c]
        rows.append(row)
    if args.fill == "plain":
        print("\n--fill plain: only kv prefilled the prompt; every other cache holds its keys/values (no prefill speed "
              "or peak for them)", end="")
    print(f"\nSmolLM2-135M, {args.prompt}-token prompt (chunks of {args.chunk}), decode {args.decode} tokens, "
          f"step: {args.repeats} x {args.decode} interleaved steps (1 / median); mlx_lm: median of {args.repeats} passes; "
          f"peak over prefill + first mlx_lm pass; BLAS {blas_name()}; {machine()}")
    head = f"{'config':16s} {'prefill tok/s':>13s} {'x kv':>6s}"
    for lp in loops:
        head += f" {'decode[' + lp + ']':>14s} {'x kv':>6s}"
    print(head + f" {'peak MiB':>9s} {'cache MiB':>9s}")
    for row in rows:
        line = f"{row['config']:16s} {_num(row['prefill_tok_s'], 13, 1)} {_num(row['prefill_vs_kv'], 6, 2)}"
        for lp in loops:
            line += f" {row[f'decode_{lp}_tok_s']:14.2f} {row[f'decode_{lp}_vs_kv']:6.2f}"
        print(line + f" {_num(row['peak_mib'], 9, 1)} {row['cache_mib']:9.2f}")
    if "step" in loops or chunk_times:
        print_paired(rows)
    out = {"model": args.model, "prompt": args.prompt, "chunk": args.chunk, "decode": args.decode, "fill": args.fill,
           "repeats": args.repeats, "loops": loops, "blas": blas_name(), "machine": machine(),
           "attention_path": attention_kernel.status()[1], "kernel_calls": attention_kernel.calls(), "rows": rows}
    c = attention_kernel.calls()
    print(f"decode calls on the compiled kernel: {c['kernel']}; refused by it (run on the reference): {c['refused']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
