"""``benchmarks/e2e_speed.py --shape`` / ``--gen``: real models' per-layer shapes (or the real ``--model``), our caches
the ones ``veloxquant_mlx.enable(model)`` makes mlx_lm build, against mlx_lm's own (`BASELINES`): the caches of each
config (`baseline_cache`, `cache_bytes`), the paired ``--shape`` run and its table (`run_shape`, `print_shape_table`),
and the ``--gen`` generations through ``generate_step`` (`run_gen`, paired; `run_gen_free`, free-running), each
printing its own table. The paired ratios are `_e2e_paired`'s.

Imported by ``e2e_speed.py`` the way it imports ``_common`` (the script's folder is first on ``sys.path``); no MLX at
module level (the script preloads OpenBLAS before MLX loads). The names stay importable from ``e2e_speed``.
"""
from __future__ import annotations

import gc
import random
import statistics
import time

from _common import prefill
from _e2e_paired import decode_step, paired_prefill_ratio, paired_step_ratio

# -- --shape / --gen: real models' per-layer shapes, caches through `veloxquant_mlx.enable(model)` -------------------

BASELINES = ("kv", "mlx-q8", "mlx-q4")
OURS_LABEL = "vq"  # our config in the --shape / --gen tables: the caches `enable(model)` gives mlx_lm


def plain_layout(model):
    """The caches mlx_lm gives ``model`` without us: its class's ``make_cache`` (gemma3: sliding windows beside full
    layers) or one ``KVCache`` per layer (`enable` put its own ``make_cache`` on the instance, not the class)."""
    from mlx_lm.models.cache import KVCache

    own = getattr(type(model), "make_cache", None)
    return own(model) if own is not None else [KVCache() for _ in model.layers]


def baseline_cache(name, model, head_dim):
    """``kv``: mlx_lm's plain caches; ``mlx-q8`` / ``mlx-q4``: every ``KVCache`` layer a ``QuantizedKVCache`` of
    that many bits from the first token (group 64, or 32 when head_dim is not a multiple of 64: phi-3's 96); sliding
    windows stay ``RotatingKVCache`` (mlx_lm cannot quantize them: ``to_quantized`` raises NotImplementedError)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    layout = plain_layout(model)
    if name == "kv":
        return layout
    bits = {"mlx-q8": 8, "mlx-q4": 4}[name]
    group = 64 if head_dim % 64 == 0 else 32
    return [QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c for c in layout]


def cache_bytes(cache) -> int:
    """Bytes a cache list holds for its tokens: the arrays of each layer's ``state`` (mlx_lm's ``KVCache``: sliced to
    the tokens held, as mlx_lm 0.32's ``state`` returns its whole buffer, grown 256 slots at a time; a ring buffer
    whole; ours: codes, exact tokens and fits, as `live_nbytes`), spare capacity left out."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache

    total = 0
    for c in cache:
        if hasattr(c, "live_nbytes"):
            total += int(c.live_nbytes)
        elif type(c) is KVCache and c.keys is not None:
            total += sum(a[..., : c.offset, :].nbytes for a in (c.keys, c.values))
        elif not c.empty():
            total += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    return total


def minmax_ratio(kv_runs, runs):
    """Paired ratios (kv seconds / seconds, run i of both taken back to back): ``(median, min, max)``."""
    r = [a / b for a, b in zip(kv_runs, runs)]
    return statistics.median(r), min(r), max(r)


def kernel_delta(before):
    from veloxquant_mlx.attention import kernel as attention_kernel

    now = attention_kernel.calls()
    return {"kernel": now["kernel"] - before["kernel"], "refused": now["refused"] - before["refused"],
            "refusals": {k: v - before["refusals"].get(k, 0) for k, v in now["refusals"].items()
                         if v - before["refusals"].get(k, 0)}}


def generate_timed(model, cache, prompt_ids, n, chunk):
    """``n`` tokens through ``mlx_lm.generate.generate_step`` (prompt ``prompt_ids`` (L,), prefilled by it in steps of
    ``chunk``); seconds from the call to each yielded token (the first: prefill + its first step) and the last
    token (not yet fed to the cache)."""
    from mlx_lm.generate import generate_step

    stamps, tok = [], None
    t0 = time.perf_counter()
    for tok, _ in generate_step(prompt_ids, model, prompt_cache=cache, max_tokens=n, prefill_step_size=chunk):
        stamps.append(time.perf_counter() - t0)
    return stamps, tok


def run_shape(model, info, args, prompt_len, rng):
    """One shape at one prompt length: every config prefills the same random prompt (chunk by chunk in turn), then
    ``--repeats`` rounds of interleaved greedy steps and one ``generate_step`` pass per config; no trimming (a
    sliding window past its size cannot be trimmed): every config's context grows alike."""
    import mlx.core as mx

    from veloxquant_mlx.attention import kernel as attention_kernel

    configs = args.baselines + list(args.makers)
    make = {c: (lambda c=c: baseline_cache(c, model, info["head_dim"])) for c in args.baselines}
    make.update(args.makers)  # each preset's model.make_cache: what generate / server build while it is enabled
    key = mx.random.key(args.seed + prompt_len)
    prompt = mx.random.randint(0, info["vocab"], (1, prompt_len), key=key)
    mx.eval(prompt)

    # warm-up: every config's first use (kernel load and check, codec set-up, compiled functions), untimed
    for c in configs:
        warm = make[c]()
        logits = prefill(model, warm, prompt[:, : 2 * args.chunk], args.chunk)
        tok = mx.argmax(logits, axis=-1)
        for _ in range(2):
            tok = decode_step(model, warm, tok)
        del warm
    gc.collect()
    mx.clear_cache()

    calls0 = attention_kernel.calls()
    caches = {c: make[c]() for c in configs}
    chunk_times, logits = interleaved_prefill_plain(model, caches, prompt, args.chunk, rng)
    calls_prefill = kernel_delta(calls0)
    first = {c: mx.argmax(logits[c], axis=-1) for c in configs}
    stored = {c: cache_bytes(caches[c]) for c in configs}
    calls1 = attention_kernel.calls()
    step_times = {c: [] for c in configs}
    gen_secs = {c: [] for c in configs}
    tokens = dict(first)
    for r in range(args.repeats):
        if "step" in args.loop_list:
            for _ in range(args.decode):
                order = list(configs)
                rng.shuffle(order)
                for c in order:
                    t0 = time.perf_counter()
                    tokens[c] = decode_step(model, caches[c], tokens[c])
                    step_times[c].append(time.perf_counter() - t0)
        if "mlx_lm" in args.loop_list:  # generate_step generators taking turns a token each (see run_gen)
            from mlx_lm.generate import generate_step

            it = {c: generate_step(tokens[c], model, prompt_cache=caches[c], max_tokens=args.decode,
                                   prefill_step_size=args.chunk) for c in configs}
            for _ in range(args.decode):
                order = list(configs)
                rng.shuffle(order)
                for c in order:
                    mx.synchronize()
                    t0 = time.perf_counter()
                    tok, _ = next(it[c])
                    mx.synchronize()
                    gen_secs[c].append(time.perf_counter() - t0)
                    tokens[c] = mx.array([tok]) if isinstance(tok, int) else tok.reshape(1)
            del it
        print(f"  [{info['shape']} @ {prompt_len}] round {r}: "
              + "  ".join(f"{c} step {1 / statistics.median(step_times[c]) if step_times[c] else 0:.2f}"
                          for c in configs),
              flush=True)
    calls_decode = kernel_delta(calls1)
    rows = []
    for c in configs:
        row = {"config": c, "cache_bytes": stored[c], "cache_vs_kv": stored[c] / stored["kv"],
               "prefill_tok_s": prompt_len / sum(chunk_times[c]), "prefill_chunk_seconds": chunk_times[c]}
        if c != "kv":
            row["prefill_vs_kv"] = paired_prefill_ratio(chunk_times["kv"], chunk_times[c])
        if step_times[c]:
            row["step_tok_s"] = 1 / statistics.median(step_times[c])
            row["step_seconds"] = step_times[c]
            if c != "kv":
                row["step_vs_kv"] = paired_step_ratio(step_times["kv"], step_times[c])
        if gen_secs[c]:
            row["mlx_lm_tok_s"] = 1 / statistics.median(gen_secs[c])
            row["mlx_lm_seconds"] = gen_secs[c]
            if c != "kv":
                row["mlx_lm_vs_kv"] = paired_step_ratio(gen_secs["kv"], gen_secs[c])
        rows.append(row)
    return {"prompt": prompt_len, "rows": rows, "kernel_calls_prefill": calls_prefill,
            "kernel_calls_decode": calls_decode}


def interleaved_prefill_plain(model, caches, prompt, chunk, rng):
    """`interleaved_prefill` without `context_for` (the routing is `enable`'s): per-chunk seconds, last logits."""
    import mlx.core as mx

    times, logits = {c: [] for c in caches}, {}
    for start in range(0, prompt.shape[1], chunk):
        order = list(caches)
        rng.shuffle(order)
        for c in order:
            t0 = time.perf_counter()
            logits[c] = model(prompt[:, start: start + chunk], cache=caches[c])[:, -1]
            mx.eval(logits[c])
            times[c].append(time.perf_counter() - t0)
    return times, logits


def _ratio(t, width=22):
    return "-".rjust(width) if t is None else f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]".rjust(width)


def print_shape_table(info, res, args):
    rows = res["rows"]
    kinds = ",".join(dict.fromkeys(info["layer_kinds"]))
    print(f"\n{info['shape']} ({info['module']}, {info['heads']}/{info['kv_heads']} heads, "
          f"head_dim {info['head_dim']}, "
          f"{info['layers']} layers [{kinds}], weights {info['weights']}, vocab {info['vocab']}): "
          f"{res['prompt']}-token prompt (chunks of {args.chunk}), {args.repeats} x {args.decode} decode steps/tokens")
    w = max(8, *(len(r["config"]) for r in rows))
    head = f"  {'config':{w}s} {'prefill':>8s} {'x kv [95% boot]':>22s}"
    if "step" in args.loop_list:
        head += f" {'step tok/s':>10s} {'x kv [95% boot]':>22s}"
    if "mlx_lm" in args.loop_list:
        head += f" {'mlx_lm tok/s':>12s} " + \
            (f"{'x kv [95% boot]':>22s}" if getattr(args, "mlx_lm_paired", True) else f"{'x kv [min, max]':>22s}")
    print(head + f" {'cache MiB':>9s} {'x kv':>6s}")
    for r in rows:
        line = f"  {r['config']:{w}s} {r['prefill_tok_s']:8.1f} {_ratio(r.get('prefill_vs_kv'))}"
        if "step" in args.loop_list:
            line += f" {r['step_tok_s']:10.2f} {_ratio(r.get('step_vs_kv'))}"
        if "mlx_lm" in args.loop_list:
            line += f" {r['mlx_lm_tok_s']:12.2f} {_ratio(r.get('mlx_lm_vs_kv'))}"
        print(line + f" {r['cache_bytes'] / 2**20:9.2f} {r['cache_vs_kv']:6.3f}")
    p, d = res["kernel_calls_prefill"], res["kernel_calls_decode"]
    print(f"  kernel calls (ours): prefill {p['kernel']} answered / {p['refused']} refused; decode {d['kernel']} "
          f"answered / {d['refused']} refused" + (f"; refusals: {d['refusals']}" if d["refusals"] else ""))


def prefill_like_generate(model, cache, ids, chunk):
    """What ``generate_step`` does with a prompt before its first step: ``ids`` (L,) through the model in steps of
    ``chunk``, every layer's ``state`` evaluated after each; seconds."""
    import mlx.core as mx

    t0 = time.perf_counter()
    for start in range(0, ids.shape[0], chunk):
        model(ids[None, start: start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def run_gen(model, prompt, configs, make, args, label):
    """--gen (paired): per repeat, fresh caches for every config, each prefilled with the prompt but its last token as
    ``generate_step`` prefills (`prefill_like_generate`; the configs in turn chunk by chunk, paired), then one
    ``generate_step(last prompt token, max_tokens=max(--gen))`` generator per config, the generators advanced IN TURN
    one token each (order shuffled per token), ``mx.synchronize()`` before and after each ``next()`` so that
    each timing holds only that config's work:
    ``next()`` i returns token i and (generate_step computes one step ahead) computes the step after it; the first
    also holds the step on the last prompt token. Paired per token like the ``step`` loop (a drift of the machine's
    speed hits both); generate_step's overlap of building the next step with computing the current one is lost for
    every config alike. The first n ``next()`` calls are exactly a ``max_tokens=n`` call's work, so every length is
    read off the same generation: ratio over n = kv's summed seconds / ours (median [min, max] over repeats)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gens = args.gen_list
    n_max = gens[-1]
    secs = {c: [] for c in configs}  # per repeat: seconds of next() 1..n_max
    pre = {c: [] for c in configs}
    rng = random.Random(args.seed)
    for r in range(args.repeats):
        gc.collect()
        mx.clear_cache()
        caches = {c: make[c]() for c in configs}
        chunk_s = {c: [] for c in configs}
        for start in range(0, prompt.shape[0] - 1, args.chunk):  # configs in turn chunk by chunk: paired prefill
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                chunk_s[c].append(prefill_like_generate(model, caches[c], prompt[start: min(start + args.chunk,
                                                                                          prompt.shape[0] - 1)],
                                                        args.chunk))
        for c in configs:
            pre[c].append(chunk_s[c])
        it = {c: generate_step(prompt[-1:], model, prompt_cache=caches[c], max_tokens=n_max,
                               prefill_step_size=args.chunk) for c in configs}
        t = {c: [] for c in configs}
        for _ in range(n_max):
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                mx.synchronize()
                t0 = time.perf_counter()
                next(it[c])
                mx.synchronize()
                t[c].append(time.perf_counter() - t0)
        for c in configs:
            secs[c].append(t[c])
        del caches, it
        print(f"  gen repeat {r}: " + "  ".join(
            f"{c} prefill {sum(pre[c][-1]):.2f}s next#1 {1e3 * t[c][0]:.1f}ms, {n_max} tokens "
            f"{n_max / sum(t[c]):.2f} tok/s"
            for c in configs), flush=True)
    out = {"gens": gens, "paired": True, "next_seconds": secs, "prefill_chunk_seconds": pre, "rows": []}
    print(f"\n{label}: {prompt.shape[0]}-token prompt prefilled as generate_step does (steps of {args.chunk}, "
          f"configs in turn chunk by chunk: prefill ratio = total kv time / time, bootstrap over the chunks), then "
          f"generate_step generators advanced in turn a token each; {args.repeats} fresh generations per config; "
          f"tok/s over the first n tokens = n / their seconds (median), ratio = kv seconds / seconds per repeat "
          f"(median [min, max]); next#1 = the first token's call (step on the last prompt token + the next step)")
    print(f"  {'config':8s} {'prefill s':>9s} {'x kv [95% boot]':>22s} {'next#1 ms':>9s} "
          + " ".join(f"{'n=' + str(n):>30s}" for n in gens))
    for c in configs:
        flat = [v for x in pre[c] for v in x]
        pr = None if c == "kv" else paired_prefill_ratio([v for x in pre["kv"] for v in x], flat)
        line = (f"  {c:8s} {statistics.median(sum(x) for x in pre[c]):9.2f} {_ratio(pr)} "
                f"{1e3 * statistics.median(x[0] for x in secs[c]):9.1f} ")
        row = {"config": c, "prefill_s": [sum(x) for x in pre[c]], "prefill_vs_kv": pr}
        for n in gens:
            tps = [n / sum(x[:n]) for x in secs[c]]
            row[f"tok_s_{n}"] = tps
            if c == "kv":
                line += f"{statistics.median(tps):30.2f} "
            else:
                rr = [sum(a[:n]) / sum(b[:n]) for a, b in zip(secs["kv"], secs[c])]
                row[f"vs_kv_{n}"] = (statistics.median(rr), min(rr), max(rr))
                cell = f"{statistics.median(tps):7.2f} x{statistics.median(rr):.3f} [{min(rr):.3f}, {max(rr):.3f}]"
                line += cell.rjust(30) + " "
        out["rows"].append(row)
        print(line)
    k = min(8, n_max - 1)
    print(f"  ms per next() (median over repeats) for tokens 1..{k}" +
          (f", and the median over tokens {k + 1}..{n_max}" if n_max > k else "") + ":")
    gaps = {}
    for c in configs:
        first = [1e3 * statistics.median(x[i] for x in secs[c]) for i in range(k)]
        later = 1e3 * statistics.median(v for x in secs[c] for v in x[k:]) if n_max > k else float("nan")
        gaps[c] = {"first": first, "later": later}
        print(f"  {c:8s} " + " ".join(f"{v:6.1f}" for v in first) + f"  | later {later:6.1f}")
    out["next_ms"] = gaps
    return out


def run_gen_free(model, prompt, configs, make, args, label):
    """--gen --gen-free: per repeat and length n (shuffled), fresh caches for every config, each prefilled with the
    prompt but its last token as ``generate_step`` prefills (`prefill_like_generate`), then, the configs back to back
    (order
    alternating by repeat), ``generate_step(last prompt token, max_tokens=n)`` on each: its first token is the step
    on the last prompt token (what a generation pays first), decode tok/s = (n - 1) / (t_n - t_1) (mlx_lm's own
    generation tok/s); ratios paired by repeat (median [min, max]). The per-token gaps of the longest length show
    the first steps against the later ones."""
    import mlx.core as mx

    gens = args.gen_list
    stamps = {c: {n: [] for n in gens} for c in configs}
    pre = {c: [] for c in configs}
    for r in range(args.repeats):
        order_n = list(gens)
        random.Random(args.seed + r).shuffle(order_n)
        for n in order_n:
            gc.collect()
            mx.clear_cache()
            caches = {c: make[c]() for c in configs}
            for c in configs:
                pre[c].append(prefill_like_generate(model, caches[c], prompt[:-1], args.chunk))
            for c in (configs if r % 2 == 0 else configs[::-1]):
                s, _ = generate_timed(model, caches[c], prompt[-1:], n, args.chunk)
                stamps[c][n].append(s)
            del caches
        print(f"  gen repeat {r}: " + "  ".join(
            f"{c} prefill {pre[c][-1]:.2f}s first step {1e3 * stamps[c][gens[-1]][-1][0]:.1f}ms decode "
            f"{(gens[-1] - 1) / (stamps[c][gens[-1]][-1][-1] - stamps[c][gens[-1]][-1][0]):.2f} tok/s"
            for c in configs), flush=True)
    out = {"gens": gens, "runs": {c: {str(n): stamps[c][n] for n in gens} for c in configs},
           "prefill_s": pre, "rows": []}
    dec = {c: {n: [(n - 1) / (s[n - 1] - s[0]) for s in stamps[c][n]] for n in gens} for c in configs}
    print(f"\n{label}: {prompt.shape[0]}-token prompt prefilled as generate_step does (steps of {args.chunk}), then "
          f"generate_step; {args.repeats} fresh generations per config and length; decode tok/s over tokens 2..n "
          f"(median; mlx_lm's generation tok/s), ratio to kv paired by repeat (median [min, max]); first = ms of "
          f"generate_step's first token (the step on the last prompt token), median over every run")
    print(f"  {'config':8s} {'prefill s':>9s} {'first ms':>8s} " + " ".join(f"{'n=' + str(n):>30s}" for n in gens))
    for c in configs:
        firsts = [1e3 * s[0] for n in gens for s in stamps[c][n]]
        line = f"  {c:8s} {statistics.median(pre[c]):9.2f} {statistics.median(firsts):8.1f} "
        row = {"config": c, "prefill_s": pre[c], "first_ms": firsts}
        for n in gens:
            med = statistics.median(dec[c][n])
            row[f"decode_tok_s_{n}"] = dec[c][n]
            if c == "kv":
                line += f"{med:30.2f} "
            else:
                rr = [b / a for a, b in zip(dec["kv"][n], dec[c][n])]
                row[f"vs_kv_{n}"] = (statistics.median(rr), min(rr), max(rr))
                line += f"{med:7.2f} x{statistics.median(rr):.3f} [{min(rr):.3f}, {max(rr):.3f}]".rjust(30) + " "
        out["rows"].append(row)
        print(line)
    n_max = gens[-1]
    k = min(8, n_max - 1)
    print(f"  per-token gap ms of the n={n_max} runs (median over repeats) for tokens 2..{k + 1}"
          + (f", and the median gap over tokens {k + 2}..{n_max}:" if n_max - 1 > k else ":"))
    gaps = {}
    for c in configs:
        g = [[1e3 * (s[i] - s[i - 1]) for s in stamps[c][n_max]] for i in range(1, n_max)]
        first = [statistics.median(x) for x in g[:k]]
        later = statistics.median([v for x in g[k:] for v in x]) if n_max - 1 > k else float("nan")
        gaps[c] = {"first": first, "later": later}
        print(f"  {c:8s} " + " ".join(f"{v:6.1f}" for v in first) + f"  | later {later:6.1f}")
    out["gaps_ms"] = gaps
    return out
