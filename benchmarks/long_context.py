"""Long context as users run it: KV bytes, peak memory, prefill time and paired decode speed per cache, per length.

Issue 55's table (Gemma 3 270M to its 32k context; any ``--model`` works). Each ``--lengths`` entry runs in a fresh
child process (peak process memory means nothing after a longer run), which, for each ``--configs`` entry in turn:

1. builds the caches as a user gets them: ``plain`` = mlx_lm's ``make_prompt_cache(model)`` with nothing of ours
   (Gemma: a ``RotatingKVCache`` per 512-token window layer, a ``KVCache`` per global one); a preset name (``default``
   = `veloxquant_mlx.cache.presets.DEFAULT_NAME`) = ``veloxquant_mlx.enable(model, PRESET)`` then mlx_lm's
   ``make_prompt_cache(model)``; ``PRESET+option[=value]`` = the preset with those options changed
   (``tq-4b+rope_offset``, ``tq-4b+codec=kblock_vsym8_pt+center_keys``);
2. runs mlx_lm's ``generate_step`` over the L-token prompt (corpus text, repeated if shorter; chunks of
   ``--prefill-step``, mlx_lm's default 2048) and ``--decode`` greedy tokens, timing the prefill (until the first
   token is out) and the decode (tok/s over the tokens after the first: unpaired, one run);
3. reads, for that run alone: the bytes the caches store (`cache_bytes`: every array of ``state``, ours
   ``live_nbytes``) and bits per coordinate over L tokens x layers x heads x head_dim x (K, V); ``mx.get_peak_memory``
   after ``mx.reset_peak_memory`` (minus the MLX memory active when the run started: the earlier configs' caches,
   which stay alive for step 4); the process's peak resident memory (``VmHWM`` reset through ``/proc/self/clear_refs``
   before the run, minus the resident memory at its start). ``peak_process_mib`` = the loaded model's resident memory
   + that increase: what the process would peak at running this config alone.

4. then the paired decode: ``--repeats`` rounds of ``--steps`` greedy steps (``model(token, cache)`` + ``mx.eval``)
   per config, the configs taking turns step by step in a shuffled order (machine load drifts over seconds; pairing
   by step cancels it; the caches are not trimmed between rounds: a full sliding window cannot be, so every context
   grows alike); ratio = geometric mean of plain_time / time over the pairs with a
   bootstrap 95 % interval (`_e2e_paired.paired_step_ratio`). Our caches attend from their codes while alive, so the
   model is not enabled during this phase and the plain caches run mlx_lm's own path.

    python benchmarks/long_context.py --model gemma3-270m --lengths 4096,8192,32768 --out results/long_context.json

Prefill time is unpaired (one run per config, one after the other in the same process: run on a quiet machine);
``benchmarks/e2e_speed.py --gen`` gives a paired prefill ratio at lengths where three prefills fit the time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

import _common
from _e2e_enabled import cache_bytes
from _e2e_paired import paired_step_ratio

MARK = "LONG_CONTEXT_JSON "


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak resident set (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kv_coords(model, length: int) -> int:
    """Coordinates a cache holding ``length`` tokens in every layer would store: layers x (K, V) x heads x head_dim."""
    a = model.args
    heads = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    return len(model.layers) * 2 * heads * head_dim * length


def run_length(model_name: str, length: int, configs, decode: int, prefill_step: int, steps: int, repeats: int,
               seed: int) -> dict:
    """One length, every config (see the module docstring); returns the JSON record."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    import veloxquant_mlx as vq
    from veloxquant_mlx.apps.eval import corpus_tokens
    from veloxquant_mlx.apps.models.loader import load_model
    from veloxquant_mlx.cache.presets import DEFAULT_NAME

    model, tok = load_model(model_name)
    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ids = list(corpus_tokens(tok))
    while len(ids) < length:
        ids = ids + ids
    prompt = mx.array(ids[:length])
    gc.collect()
    rss_model = _status_kib("VmRSS") * 1024
    rec = {"length": length, "weights_bytes": int(weights), "model_rss_bytes": rss_model, "configs": {}}
    caches, last = {}, {}
    for name in configs:
        preset, options = _common.preset_with_options(name)
        preset = DEFAULT_NAME if preset == "default" else preset
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        active0 = mx.get_active_memory()
        rss0 = _status_kib("VmRSS") * 1024
        hwm_ok = _reset_peak_rss()
        if name != "plain":
            vq.enable(model, preset, **options)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        gen = generate_step(prompt, model, prompt_cache=cache, max_tokens=decode, prefill_step_size=prefill_step)
        first, _ = next(gen)
        t1 = time.perf_counter()
        toks, gen_steps, t_prev = [int(first)], [], t1
        for t, _ in gen:  # each next(): one generate_step step (it queues the following one itself)
            toks.append(int(t))
            now = time.perf_counter()
            gen_steps.append(now - t_prev)
            t_prev = now
        t2 = time.perf_counter()
        mx.eval([c.state for c in cache])
        peak = mx.get_peak_memory() - active0
        hwm = _status_kib("VmHWM") * 1024 - rss0 if hwm_ok else None
        if name != "plain":
            vq.disable(model)  # our caches attend from their codes while alive (step 4 runs the model plain)
        nbytes = cache_bytes(cache)
        r = {"preset": None if name == "plain" else preset, "options": options, "cache_bytes": nbytes,
             "bits": 8 * nbytes / _kv_coords(model, length + len(toks)),
             "prefill_s": t1 - t0, "prefill_tok_s": length / (t1 - t0),
             "decode_tok_s_unpaired": (len(toks) - 1) / (t2 - t1), "generate_step_seconds": gen_steps,
             "peak_mlx_bytes": int(peak),
             "peak_rss_increase_bytes": hwm,
             "peak_process_bytes": None if hwm is None else rss_model + hwm, "tokens": toks[:16],
             "cache_types": sorted({type(c).__name__ for c in cache})}
        rec["configs"][name] = r
        print(f"  L={length} {name:14s} prefill {r['prefill_s']:7.1f} s  decode {r['decode_tok_s_unpaired']:5.2f} tok/s"
              f"  KV {nbytes / 2**20:8.2f} MiB ({r['bits']:.2f} bits)  peak MLX +{peak / 2**20:7.1f} MiB"
              + ("" if hwm is None else f"  peak RSS +{hwm / 2**20:7.1f} MiB"), file=sys.stderr, flush=True)
        caches[name], last[name] = cache, mx.array([toks[-1]])
    # paired decode: configs in turn, step by step
    rng = random.Random(seed)
    times = {c: [] for c in configs}
    for _ in range(repeats):
        tokens = dict(last)
        for _ in range(steps):
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                t0 = time.perf_counter()
                nxt = mx.argmax(model(tokens[c][:, None], cache=caches[c])[:, -1], axis=-1)
                mx.eval(nxt)
                times[c].append(time.perf_counter() - t0)
                tokens[c] = nxt
    base = configs[0]
    for c in configs:
        r = rec["configs"][c]
        r["decode_tok_s"] = 1.0 / statistics.median(times[c])
        r["step_seconds"] = times[c]
        if c != base:
            g, lo, hi = paired_step_ratio(times[base], times[c])
            r[f"decode_x_{base}"] = [g, lo, hi]
    return rec


def main(argv=None):
    from veloxquant_mlx.apps.blas import ensure_openblas

    ensure_openblas()
    ap = _common.parser(__doc__)
    _common.add_model(ap, default="gemma3-270m")
    ap.add_argument("--lengths", type=_common.positive_ints, default=[4096, 8192, 32768])
    ap.add_argument("--configs", default="plain,default,tq-4b",
                    help="comma list: plain, default, or preset names, each with options changed as "
                         "PRESET+option[=value] (tq-4b+rope_offset); the first is the paired reference")
    ap.add_argument("--decode", type=int, default=100, help="generate_step tokens after the prompt")
    ap.add_argument("--prefill-step", type=int, default=2048, help="mlx_lm's prefill_step_size")
    ap.add_argument("--steps", type=int, default=32, help="paired decode steps per config per round")
    ap.add_argument("--repeats", type=int, default=2, help="paired decode rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    _common.add_out(ap, "results/long_context.json")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if args.one is not None:
        rec = run_length(args.model, args.one, configs, args.decode, args.prefill_step, args.steps, args.repeats,
                         args.seed)
        print(MARK + json.dumps(rec), flush=True)
        return
    out = {"model": args.model, "machine": _common.machine(), "environment": _common.environment(),
           "command": " ".join(sys.argv), "decode": args.decode, "prefill_step": args.prefill_step,
           "configs": configs, "runs": []}
    print(_common.environment(), flush=True)
    for length in args.lengths:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--one", str(length),
               "--configs", ",".join(configs), "--decode", str(args.decode), "--prefill-step", str(args.prefill_step),
               "--steps", str(args.steps), "--repeats", str(args.repeats), "--seed", str(args.seed)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"length {length}: child exited {proc.returncode}")
        rec = json.loads(line[len(MARK):])
        rec["seconds"] = time.perf_counter() - t0
        out["runs"].append(rec)
        print_length(rec, configs)
        _common.write_json(args.out, out, quiet=True)  # after every length: a long run keeps what it measured
    print(f"wrote {args.out}")


def print_length(rec: dict, configs) -> None:
    base = rec["configs"][configs[0]]
    print(f"\n{rec['length']} tokens (model: {rec['weights_bytes'] / 2**20:.0f} MiB of weights, "
          f"{rec['model_rss_bytes'] / 2**20:.0f} MiB resident after loading; {rec['seconds']:.0f} s)")
    head = ["config", "KV MiB", "bits", f"KV / {configs[0]}", "peak MLX +MiB", "peak process MiB", "prefill s",
            f"prefill x {configs[0]}", "decode tok/s", f"decode x {configs[0]} [95%]"]
    rows = []
    for c in configs:
        r = rec["configs"][c]
        ratio = r.get(f"decode_x_{configs[0]}")
        rows.append([c, f"{r['cache_bytes'] / 2**20:.2f}", f"{r['bits']:.2f}",
                     f"{r['cache_bytes'] / base['cache_bytes']:.3f}", f"{r['peak_mlx_bytes'] / 2**20:.1f}",
                     "-" if r["peak_process_bytes"] is None else f"{r['peak_process_bytes'] / 2**20:.0f}",
                     f"{r['prefill_s']:.1f}", f"{base['prefill_s'] / r['prefill_s']:.3f}",
                     f"{r['decode_tok_s']:.2f}",
                     "-" if ratio is None else f"{ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]"])
    print(_common.aligned_table(head, rows), flush=True)


if __name__ == "__main__":
    main()
