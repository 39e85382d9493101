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

``--shape NAME[,NAME...]`` (or ``all``): real models' per-layer shapes with random weights (``benchmarks/_shapes.py``:
smollm2-135m, llama-3.2-1b, qwen2.5-1.5b, qwen3-4b, mistral-7b, gemma-3-1b, phi-3-mini), built with mlx_lm's own
``Model(ModelArgs(...))``, ``--layers`` layers (default 2; gemma-3-1b keeps a sliding and a global layer), a
``--vocab``-token vocabulary (default 1024: per layer, weights against KV as in the full model; the LM head's share is
left out), weights ``--weights`` (default float32; ``bfloat16``; ``q4`` = ``nn.quantize`` group 64 on the float32
model — MLX's CPU quantized matmul measured ~35x slower than float32 prefill here (mistral-7b shape, 2 layers: 1.6
against 61 tok/s), which would make the table take hours; on Apple silicon q4 is what users run).
Configs: ``--baselines`` (mlx_lm's ``KVCache`` = ``kv``, ``QuantizedKVCache`` 8- and 4-bit = ``mlx-q8`` /
``mlx-q4``, group 64 or 32 where head_dim is not a multiple of 64; sliding windows stay mlx_lm's
``RotatingKVCache``, which mlx_lm cannot quantize) and ``vq``: the caches
``mlx_lm.models.cache.make_prompt_cache(model)`` builds after ``veloxquant_mlx.enable(model)``
(``--preset``: ``enable(model, PRESET)``). Per shape and ``--prompt`` length (comma list): a random prompt; every
config's first use warmed up untimed; every config prefills the prompt (chunks of ``--chunk``, taking turns chunk by
chunk: paired prefill ratio, bootstrap 95 % interval over the chunks); then ``--repeats`` x (``--decode`` interleaved
greedy steps, paired ratio = geometric mean of kv/ours step times with a bootstrap 95 % interval; and
``--decode`` tokens of one ``generate_step`` generator per config, the generators taking turns a token each with
``mx.synchronize()`` around each ``next()`` (paired the same way; generate_step's overlap of building the next step
while the current one computes is lost for every config alike; each ``next()`` computes the step after its token)).
The caches are not trimmed between rounds (a sliding window past its size cannot be): every context grows alike.
Bytes: the arrays each cache holds for its tokens (``state``; ours ``live_nbytes``). Kernel calls:
``kernel.calls()`` during the prefill and the decode. While ``enable`` is on, mlx_lm's caches also pass through the
routing function (one Python call per layer and step) on their way to mlx_lm's attention.

    python benchmarks/e2e_speed.py --shape all --prompt 4096 --repeats 3            # -> results/e2e_shapes.json
    python benchmarks/e2e_speed.py --shape gemma-3-1b,phi-3-mini --prompt 4096,8192 --layers 4

``--gen 16,24,48,256``: short generations through mlx_lm's ``generate_step`` (the real ``--model``, or each
``--shape``): per repeat, FRESH caches for every config, each prefilled with the ``--prompt`` tokens but the last as
``generate_step`` prefills them (steps of ``--chunk``, every layer's ``state`` evaluated after each; the configs
taking turns chunk by chunk: a paired prefill ratio), then one
``generate_step(last prompt token, max_tokens=max(gen))`` generator per config, the generators taking turns a token
each with ``mx.synchronize()`` around every ``next()`` (paired per token; `run_gen` has the details). The first n
``next()`` calls are a ``max_tokens=n`` call's work, so every length is read off the same generation: tok/s over n
tokens and the ratio kv seconds / ours (median [min, max] over the repeats); the first 8 ``next()`` calls against the
later median show what a generation pays once. ``--gen-free``: free-running ``generate_step`` calls instead (its
pipelining kept, unpaired: one config after the other).

    python benchmarks/e2e_speed.py --gen 16,24,48,256 --prompt 4096 --repeats 3 --baselines kv --chunk 2048
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import warnings

import _common
from _common import machine, prefill, registered

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


def make_cache(name, model):
    """`_common.make_cache` (a registered method, ``kv``, ``mlx-q4``) and the configs of `OURS`."""
    if name in OURS and registered(name) is None:
        import veloxquant_mlx as vq

        codec, k_bits, v_bits = OURS[name]
        return vq.make_prompt_cache(model, k_bits=k_bits, v_bits=v_bits, codec=codec,
                                    route_attention=name.endswith("-hook"))
    return _common.make_cache(name, model)


def context_for(name):
    """`_common.context_for`; the ``-hook`` configs of `OURS` run inside ``use_packed_attention()`` too."""
    if name.endswith("-hook"):
        from veloxquant_mlx.integration import use_packed_attention

        return use_packed_attention()
    return _common.context_for(name)


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
    """Bytes a cache list holds for its tokens: the arrays of each layer's ``state`` (mlx_lm's caches: sliced to the
    tokens held, a ring buffer whole; ours: codes, exact tokens and fits, as `live_nbytes`), spare capacity left out."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    total = 0
    for c in cache:
        if hasattr(c, "live_nbytes"):
            total += int(c.live_nbytes)
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

    configs = args.baselines + [OURS_LABEL]
    make = {c: (lambda c=c: baseline_cache(c, model, info["head_dim"])) for c in args.baselines}
    from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
    make[OURS_LABEL] = lambda: mlx_make_prompt_cache(model)  # what generate / server build: enable's caches
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
    head = f"  {'config':8s} {'prefill':>8s} {'x kv [95% boot]':>22s}"
    if "step" in args.loop_list:
        head += f" {'step tok/s':>10s} {'x kv [95% boot]':>22s}"
    if "mlx_lm" in args.loop_list:
        head += f" {'mlx_lm tok/s':>12s} " + \
            (f"{'x kv [95% boot]':>22s}" if getattr(args, "mlx_lm_paired", True) else f"{'x kv [min, max]':>22s}")
    print(head + f" {'cache MiB':>9s} {'x kv':>6s}")
    for r in rows:
        line = f"  {r['config']:8s} {r['prefill_tok_s']:8.1f} {_ratio(r.get('prefill_vs_kv'))}"
        if "step" in args.loop_list:
            line += f" {r['step_tok_s']:10.2f} {_ratio(r.get('step_vs_kv'))}"
        if "mlx_lm" in args.loop_list:
            line += f" {r['mlx_lm_tok_s']:12.2f} {_ratio(r.get('mlx_lm_vs_kv'))}"
        print(line + f" {r['cache_bytes'] / 2**20:9.2f} {r['cache_vs_kv']:6.3f}")
    p, d = res["kernel_calls_prefill"], res["kernel_calls_decode"]
    print(f"  kernel calls (vq): prefill {p['kernel']} answered / {p['refused']} refused; decode {d['kernel']} "
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


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()  # before mlx is imported: re-executes with OpenBLAS preloaded

    import mlx.core as mx

    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.models.loader import load_model

    ap = _common.parser(__doc__)
    _common.add_model(ap)
    ap.add_argument("--prompt", type=_common.positive_ints, default=[4096],
                    help="prompt tokens (context for decode); --shape takes a comma list, e.g. 4096,8192")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    ap.add_argument("--decode", type=int, default=None, help="decode tokens per pass / steps per round (default "
                    "48; --shape: 16)")
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
    _common.add_out(ap, help="JSON written (default results/e2e_speed.json; --shape: results/e2e_shapes.json; "
                    "--gen: results/e2e_gen.json)")
    ap.add_argument("--shape", default=None,
                    help="comma list of real models' per-layer shapes with random weights (benchmarks/_shapes.py: "
                         "smollm2-135m, llama-3.2-1b, qwen2.5-1.5b, qwen3-4b, mistral-7b, gemma-3-1b, phi-3-mini) or "
                         "'all': their caches through veloxquant_mlx.enable(model) against mlx_lm's")
    ap.add_argument("--layers", type=int, default=2, help="--shape: layers of each model")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "q4"),
                    help="--shape: weight dtype (q4: nn.quantize group 64; MLX's CPU quantized matmul is ~20-40x "
                         "slower than float32 here, see the docstring)")
    ap.add_argument("--vocab", type=int, default=1024, help="--shape: vocabulary (small: per layer, weights vs KV "
                    "as in the full model)")
    ap.add_argument("--baselines", default="kv,mlx-q8,mlx-q4",
                    help="--shape / --gen: mlx_lm caches beside ours, comma list of kv (required), mlx-q8, mlx-q4")
    ap.add_argument("--preset", default=None, help="--shape / --gen: enable(model, PRESET) (default: enable's own "
                    "default, tq-affine-k8v4)")
    ap.add_argument("--gen-free", action="store_true",
                    help="--gen: free-running generate_step calls (its pipelining kept), the configs one after another "
                         "per repeat and length, each after a fresh prefill, instead of generators taking turns a "
                         "token each (unpaired: on a busy machine the spread is large)")
    ap.add_argument("--gen", type=_common.positive_ints, default=None,
                    help="comma list of generation lengths, e.g. 16,24,48,256: per repeat, fresh caches prefilled "
                         "as generate_step does, then generate_step generators of every config taking turns a token "
                         "each; ratio over the first n tokens (the real --model, or each --shape)")
    ap.add_argument("--summarize", metavar="JSON", help="print the paired step ratios of a saved run and exit")
    args = ap.parse_args(argv)
    if args.shape or args.gen:
        args.decode = 16 if args.decode is None else args.decode
        return main_enabled(args)
    args.decode = 48 if args.decode is None else args.decode
    if len(args.prompt) != 1:
        raise ValueError("--prompt takes one length without --shape")
    args.prompt = args.prompt[0]
    args.out = args.out or "results/e2e_speed.json"
    if args.summarize:
        with open(args.summarize) as f:
            saved = json.load(f)
        if saved.get("mode") == "shape":  # a --shape run: its tables again
            ns = argparse.Namespace(chunk=saved["chunk"], repeats=saved["repeats"], decode=saved["decode"],
                                    loop_list=saved["loops"],
                                    # (earlier runs: one mlx_lm time per repeat; paired ones: one per token)
                                    mlx_lm_paired=all(len(r.get("mlx_lm_seconds", ())) != saved["repeats"]
                                                      for e in saved["shapes"] for x in e["runs"] for r in x["rows"]))
            if not ns.mlx_lm_paired:
                print("(an earlier version's run: its mlx_lm column is one generate_step pass per config and repeat, "
                      "the ratio the median of the per-repeat ratios [min, max])")
            print(f"{saved['command']}\n{saved['machine']}; {saved['attention_path']}; ours: {saved['ours']}")
            for entry in saved["shapes"]:
                for res in entry["runs"]:
                    print_shape_table(entry["info"], res, ns)
            return
        print_paired(saved["rows"])
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
    print(f"{_common.environment()}; attention on codes: {attention_kernel.status()[1]}", flush=True)
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
          f"peak over prefill + first mlx_lm pass; BLAS {_common.blas()}; {machine()}")
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
           "repeats": args.repeats, "loops": loops, "blas": _common.blas(), "machine": machine(),
           "attention_path": attention_kernel.status()[1], "kernel_calls": attention_kernel.calls(), "rows": rows}
    c = attention_kernel.calls()
    print(f"decode calls on the compiled kernel: {c['kernel']}; refused by it (run on the reference): {c['refused']}")
    _common.write_json(args.out, out, indent=2)


def main_enabled(args):
    """``--shape`` / ``--gen``: our caches are what ``veloxquant_mlx.enable(model)`` makes mlx_lm build."""
    import mlx.core as mx

    import veloxquant_mlx as vq
    from veloxquant_mlx.attention import kernel as attention_kernel

    from _shapes import build_shape_model, shape_names

    args.baselines = [c for c in args.baselines.split(",") if c]
    if "kv" not in args.baselines or set(args.baselines) - set(BASELINES):
        raise ValueError(f"--baselines: a comma list of {BASELINES} including kv, got {args.baselines}")
    args.baselines = ["kv"] + [c for c in args.baselines if c != "kv"]
    args.loop_list = [c for c in args.loops.split(",") if c]
    if set(args.loop_list) - set(LOOPS) or not args.loop_list:
        raise ValueError(f"--loops: entries of {LOOPS}")
    for name in ("chunk", "decode", "repeats", "layers", "vocab"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.gen_list = sorted(set(args.gen)) if args.gen else None
    if args.gen_list and min(args.gen_list) < 2:
        raise ValueError("--gen lengths must be >= 2 (decode speed is read between token 1 and token n)")
    mode = "gen" if args.gen_list else "shape"
    out_path = args.out or f"results/e2e_{'gen' if mode == 'gen' else 'shapes'}.json"
    options = () if args.preset is None else (args.preset,)
    from veloxquant_mlx.options import DEFAULT_NAME

    preset_name = args.preset or DEFAULT_NAME
    print(f"{_common.environment()}; attention on codes: {attention_kernel.status()[1]}; "
          f"ours ('{OURS_LABEL}'): veloxquant_mlx.enable(model{', ' + repr(args.preset) if args.preset else ''}) = "
          f"{preset_name}", flush=True)
    if not attention_kernel.status()[0]:
        print("WARNING: attention on codes runs on the pure-MLX reference, not the compiled kernel users get (kernel "
              "calls are then not counted): these figures are not the product's", flush=True)
    print(f"veloxquant_mlx from {os.path.dirname(vq.__file__)}", flush=True)
    result = {"mode": mode, "machine": machine(), "blas": _common.blas(),
              "attention_path": attention_kernel.status()[1],
              "ours": preset_name, "baselines": args.baselines, "chunk": args.chunk, "repeats": args.repeats,
              "decode": args.decode, "loops": args.loop_list, "seed": args.seed, "gen": args.gen_list,
              "command": " ".join(sys.argv), "shapes": [],
              "mlx_lm_loop": "paired"}  # generate_step generators taking turns a token each (bootstrap interval)
    targets = shape_names(args.shape) if args.shape else [None]
    t_start = time.perf_counter()
    for name in targets:
        gc.collect()
        mx.clear_cache()
        if name is None:
            from veloxquant_mlx.eval import corpus_tokens
            from veloxquant_mlx.models.loader import load_model

            model, tok = load_model(args.model)
            info = {"shape": f"real model {args.model}", "vocab": None}
            a = model.args
            info["head_dim"] = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
            ids = corpus_tokens(tok)
        else:
            model, info = build_shape_model(name, args.layers, args.weights, args.vocab, args.seed)
            ids = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vq.enable(model, *options)
        info["enable_warnings"] = [str(w.message) for w in caught]
        entry = {"info": info, "runs": []}
        for prompt_len in args.prompt:
            rng = random.Random(args.seed)
            t0 = time.perf_counter()
            if mode == "shape":
                res = run_shape(model, info, args, prompt_len, rng)
                print_shape_table(info, res, args)
            else:
                if ids is not None:
                    while len(ids) < prompt_len:
                        ids = ids + ids
                    prompt = mx.array(ids[:prompt_len])
                else:
                    prompt = mx.random.randint(0, info["vocab"], (prompt_len,), key=mx.random.key(args.seed))
                from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
                configs = args.baselines + [OURS_LABEL]
                make = {c: (lambda c=c: baseline_cache(c, model, info["head_dim"])) for c in args.baselines}
                make[OURS_LABEL] = lambda: mlx_make_prompt_cache(model)
                calls0 = attention_kernel.calls()
                # warm-up: first use of every config (kernel check, codec set-up), untimed
                for c in configs:
                    warm = make[c]()
                    prefill_like_generate(model, warm, prompt[: min(2 * args.chunk, prompt_len - 1)], args.chunk)
                    generate_timed(model, warm, prompt[-1:], 4, args.chunk)
                res = (run_gen_free if args.gen_free else run_gen)(model, prompt, configs, make, args, info["shape"])
                res["prompt"] = prompt_len
                res["kernel_calls"] = kernel_delta(calls0)
                k = res["kernel_calls"]
                print(f"  kernel calls (vq, warm-up included): {k['kernel']} answered / {k['refused']} refused"
                      + (f"; refusals: {k['refusals']}" if k["refusals"] else ""))
            res["seconds"] = time.perf_counter() - t0
            entry["runs"].append(res)
            print(f"  ({res['seconds']:.0f} s)", flush=True)
        vq.disable(model)
        result["shapes"].append(entry)
        del model
        _common.write_json(out_path, result, quiet=True)  # after every shape: a long run keeps what it measured
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; BLAS {_common.blas()}; {machine()}; wrote {out_path}")


if __name__ == "__main__":
    main()
