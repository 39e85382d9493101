"""End-to-end speed and peak memory of SmolLM2-135M with each KV cache, attention on codes included.

Configs (all in one process; decode repeats interleaved so machine load hits every config alike). The default
run is the caches users run: ``kv``, ``mlx-q8``, ``mlx-q4``, the default preset ``tq-affine-k8v4`` and ``tq-4b``
(``DEFAULT_CONFIGS``); the others are kept for diagnosis:

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
    python benchmarks/e2e_speed.py --shape all --prompt 4096,8192 --baselines kv --preset tq-4b,tq-3b,tq-2b

``--preset A,B,...``: each preset's caches in the same loop (the model enabled with each in turn, its
``make_cache`` kept: what mlx_lm builds while that preset is on), labelled by name; one preset is labelled ``vq``.

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
import os
import random
import statistics
import sys
import time
import warnings

import _common
from _common import machine, prefill, registered
# The default run's configs, loops and paired ratios, and the --shape / --gen runs: moved out of this file, imported
# here so that e2e_speed.NAME stays what it was.
from _e2e_paired import (  # noqa: F401
    CONFIGS, DEFAULT_CONFIGS, LOOPS, OURS, _num, context_for, decode_mlx_lm, decode_step, fill_from,
    interleaved_prefill, interleaved_steps, make_cache, paired_prefill_ratio, paired_step_ratio, print_paired,
)
from _e2e_enabled import (  # noqa: F401
    BASELINES, OURS_LABEL, _ratio, baseline_cache, cache_bytes, generate_timed, interleaved_prefill_plain, kernel_delta,
    minmax_ratio, plain_layout, prefill_like_generate, print_shape_table, run_gen, run_gen_free, run_shape,
)


def main(argv=None):
    from veloxquant_mlx.apps.blas import ensure_openblas

    ensure_openblas()  # before mlx is imported: re-executes with OpenBLAS preloaded

    import mlx.core as mx

    from veloxquant_mlx.apps.eval import corpus_tokens
    from veloxquant_mlx.apps.models.loader import load_model

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
                    "default, tq-affine-k8v4); a comma list measures each preset's caches in the same loop, "
                    "labelled by name (one preset: 'vq')")
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
        from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS

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
    from veloxquant_mlx.cache.presets import DEFAULT_NAME

    presets = [p for p in (args.preset or "").split(",") if p] or [None]
    if len(set(presets)) != len(presets):
        raise ValueError(f"--preset: each preset once, got {args.preset!r}")
    # one preset: its caches are 'vq' in the tables; several: each preset's caches under its own name
    args.ours = {OURS_LABEL: presets[0]} if len(presets) == 1 else {p: p for p in presets}
    bad = [c for c in args.ours if c in args.baselines]
    if bad:
        raise ValueError(f"--preset: {bad} clash with --baselines {args.baselines}")
    preset_name = ",".join(p or DEFAULT_NAME for p in presets)
    print(f"{_common.environment()}; attention on codes: {attention_kernel.status()[1]}; "
          f"ours: " + ", ".join(f"'{c}' = veloxquant_mlx.enable(model{', ' + repr(p) if p else ''})"
                               for c, p in args.ours.items()) + f" = {preset_name}", flush=True)
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
            from veloxquant_mlx.apps.eval import corpus_tokens
            from veloxquant_mlx.apps.models.loader import load_model

            model, tok = load_model(args.model)
            info = {"shape": f"real model {args.model}", "vocab": None}
            a = model.args
            info["head_dim"] = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
            ids = corpus_tokens(tok)
        else:
            model, info = build_shape_model(name, args.layers, args.weights, args.vocab, args.seed)
            ids = None
        # enabling again only changes the options: each preset's make_cache, kept, builds that preset's caches
        # (what mlx_lm's make_prompt_cache(model) calls while the preset is on)
        args.makers = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for label, preset in args.ours.items():
                vq.enable(model, *(() if preset is None else (preset,)))
                args.makers[label] = model.make_cache
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
                configs = args.baselines + list(args.makers)
                make = {c: (lambda c=c: baseline_cache(c, model, info["head_dim"])) for c in args.baselines}
                make.update(args.makers)
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
                print(f"  kernel calls (ours, warm-up included): {k['kernel']} answered / {k['refused']} refused"
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
