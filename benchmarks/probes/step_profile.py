"""Where a decode step's time goes, per cache: the whole step, storing the step's token, attention, the rest.

A DIAGNOSIS, not a speed figure (the speed figures are `e2e_speed.py`'s paired ratios). Per config: a real
chunked prefill of ``--prompt`` tokens through SmolLM2, then, in rounds where the configs take turns:

- ``step``: one greedy decode step (``model(token, cache)`` + ``mx.eval``), as `e2e_speed.py` times it;
- ``build``: the part of ``step`` before ``mx.eval``: Python building the step's graph (the model's layers, the
  cache's ``update_and_fetch`` and attention calls), nothing evaluated yet;
- ``store``: every layer's ``update_and_fetch`` of one new token (random keys/values of the model's shape), then
  one ``mx.eval`` of everything the caches hold;
- ``attention``: then every layer's attention of one random query group over what it holds (ours:
  ``attend_packed``, the kernel when built; mlx_lm's ``KVCache``: ``mx.fast.scaled_dot_product_attention`` on its
  stored slots; ``QuantizedKVCache``: mlx_lm's quantized SDPA), one ``mx.eval``; the caches are trimmed back;
- ``rest`` = step - store - attention: the model's own layers and the Python around them.

The parts are timed apart, so lazy evaluation inside a real step may overlap them: ``rest`` is an estimate.
Milliseconds are medians over ``--rounds`` (each round: ``--steps`` of each part per config).

``--batch-cache``: after the prefill every layer's cache is merged into its batch class as a batch of one row
(``type(c).merge([c])``: mlx_lm's ``BatchKVCache`` for ``kv``, ours for a TurboQuant method), what a batched
server decodes with at one client. ``--baseline-tokens N``: one more row, ``kv`` at an ``N``-token prompt, so
that ``kv``'s step minus that row's is what the context costs the plain cache (the most any cache can save).

    python -m benchmarks.probes.step_profile --prompt 4096 --configs kv,tq-affine-k8v4,tq-prod-k4v4,tq-rvq-k2v2
    python -m benchmarks.probes.step_profile --prompt 430 --configs kv,tq-affine-k8v4 --batch-cache --baseline-tokens 16

``--fresh R``: what a generation pays once, in its first decode steps: R times per config (configs in turn), a fresh
cache, a chunked prefill (each chunk's ``cache.state`` evaluated, as mlx_lm's ``generate_step`` does), then
``--steps`` decode steps timed one by one; per step index the median over the R runs, the first steps against the
median of the later ones. ``--cprofile K`` adds cProfile of step 1 against step K (Python only: the evaluation is one
call), the functions whose time differs most.

    python -m benchmarks.probes.step_profile --prompt 4096 --configs kv,tq-affine-k8v4 --fresh 3 --steps 24 --cprofile 20

``--smoke`` runs the three modes above on a tiny random llama (`benchmarks/probes/_smoke.py`) at a 160-token
prompt, a few steps each: the code runs, the figures mean nothing. The JSON files go beside ``--out``
(``STEM_profile.json``, ``STEM_batch.json``, ``STEM_fresh.json``)::

    python -m benchmarks.probes.step_profile --smoke --out /tmp/step_profile.json
"""
from __future__ import annotations

import gc
import os
import random
import statistics
import time

from benchmarks import _common
from benchmarks._common import context_for, machine, make_cache, prefill, registered


def held(c) -> list:
    """The arrays a cache holds (ours: every stored array; mlx_lm's: its key/value buffers)."""
    from mlx.utils import tree_flatten

    if hasattr(c, "rows"):
        return c.rows.arrays()
    return [a for _, a in tree_flatten([c.keys, c.values])]


def attend(c, queries, scale):
    """One layer's attention of ``queries`` ``(1, Hq, 1, d)`` over everything ``c`` holds."""
    import mlx.core as mx
    import mlx_lm.models.base as mlx_base

    if hasattr(c, "attend_packed"):
        return c.attend_packed(queries, scale, None)
    if c.__class__.__name__ == "QuantizedKVCache":  # mlx_lm's quantized SDPA over its codes
        kq, vq = ([a[..., : c.offset, :] for a in x] for x in (c.keys, c.values))
        return mlx_base.quantized_scaled_dot_product_attention(queries, kq, vq, scale=scale, mask=None,
                                                               group_size=c.group_size, bits=c.bits)
    n = c.size()  # the stored slots (KVCache: its offset; BatchKVCache: its slot index, a batch's offset is per row)
    k, v = c.keys[..., :n, :], c.values[..., :n, :]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=None)


def store_and_attend(cache, keys, values, queries, scale):
    """Every layer stores one token ``(1, Hkv, 1, d)`` (evaluated: seconds ``store``), then attends ``queries``
    over what it holds (evaluated: seconds ``attention``); the caches are trimmed back."""
    import mlx.core as mx

    t0 = time.perf_counter()
    for c in cache:
        c.update_and_fetch(keys, values)
    mx.eval([held(c) for c in cache])
    t1 = time.perf_counter()
    mx.eval([attend(c, queries, scale) for c in cache])
    t2 = time.perf_counter()
    for c in cache:
        c.trim(1)
    return t1 - t0, t2 - t1


def run_smoke(args) -> None:
    """``--smoke``: the profile (with a baseline row), the batch caches and ``--fresh`` with ``--cprofile``, each on a
    tiny random llama at a 160-token prompt; each mode's JSON beside ``--out``."""
    from benchmarks.probes._smoke import tiny_model

    loaded = tiny_model()
    stem = os.path.splitext(args.out)[0]
    small = ["--prompt", "160", "--chunk", "64", "--steps", "2", "--rounds", "1"]
    modes = {"profile": ["--configs", "kv,mlx-q4,tq-affine-k8v4,tq-4b", "--baseline-tokens", "16"],
             "batch": ["--configs", "kv,tq-affine-k8v4", "--batch-cache"],
             "fresh": ["--configs", "kv,tq-affine-k8v4", "--fresh", "1", "--steps", "10", "--cprofile", "10"]}
    for name, extra in modes.items():
        print(f"\n== smoke: {name}", flush=True)
        main(small + extra + ["--out", f"{stem}_{name}.json"], loaded=loaded)


def main(argv=None, loaded=None):
    """``loaded``: ``(model, tokenizer)`` to profile instead of loading ``--model`` (``--smoke``'s tiny model)."""
    from veloxquant_mlx.apps.blas import ensure_openblas

    ensure_openblas()

    import mlx.core as mx

    from veloxquant_mlx.attention import kernel as attention_kernel
    from veloxquant_mlx.apps.eval import corpus_tokens
    from veloxquant_mlx.apps.models.loader import load_model

    ap = _common.parser(__doc__)
    _common.add_model(ap)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="timings of each part per config and round "
                    "(--fresh: decode steps per fresh run)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="kv,tq-affine-k8v4,tq-mse-k4v4,tq-prod-k4v4,tq-rvq-k2v2")
    ap.add_argument("--batch-cache", action="store_true",
                    help="decode with each layer's cache merged into its batch class, one row (a batched server)")
    ap.add_argument("--baseline-tokens", type=int, default=0,
                    help="also profile kv at a prompt of this many tokens (0: not)")
    ap.add_argument("--fresh", type=int, default=0, metavar="R",
                    help="first steps against later ones: R times per config (configs in turn), a fresh cache, a "
                         "chunked prefill of --prompt tokens, then --steps decode steps timed one by one (build / "
                         "eval); per step index the median over the R runs (0: the usual profile)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="K",
                    help="with --fresh: in the last run of each config, cProfile decode step 1 and step K (the "
                         "Python that builds the step's graph and its evaluation call) and print the functions "
                         "whose time differs most")
    ap.add_argument("--smoke", action="store_true", help="every mode on a tiny random model, a few steps (docstring)")
    _common.add_out(ap, "results/step_profile.json")
    args = ap.parse_args(argv)
    if args.smoke:
        return run_smoke(args)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in ("kv", "mlx-q4") and registered(c) is None]
    if bad:
        raise ValueError(f"--configs must name kv, mlx-q4 or registered TurboQuant methods; got {bad}")
    for name in ("prompt", "chunk", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch_cache and "mlx-q4" in configs:
        raise ValueError("--batch-cache: mlx-q4 (mlx_lm's QuantizedKVCache) has no batch class; leave it out")
    if not 0 <= args.baseline_tokens < args.prompt:
        raise ValueError(f"--baseline-tokens must lie in [0, --prompt), got {args.baseline_tokens}")
    print(f"{_common.environment()}; attention on codes: {attention_kernel.status()[1]}")
    print("DIAGNOSIS: parts timed apart (see the docstring); speed figures come from e2e_speed.py", flush=True)

    model, tok = loaded or load_model(args.model)
    ids = corpus_tokens(tok)
    while len(ids) < args.prompt:
        ids = ids + ids
    prompt = mx.array([ids[: args.prompt]])
    args_model = model.args
    n_kv = args_model.num_key_value_heads
    n_q = args_model.num_attention_heads
    d = getattr(args_model, "head_dim", None) or args_model.hidden_size // n_q

    if args.fresh:
        return fresh_profile(model, prompt, configs, args, attention_kernel)
    runs = [(c, c, args.prompt) for c in configs]  # (row label, config, prompt tokens)
    if args.baseline_tokens:
        runs.append((f"kv@{args.baseline_tokens}", "kv", args.baseline_tokens))
    caches, tokens = {}, {}
    for label, c, n in runs:
        gc.collect()
        mx.clear_cache()
        cache = make_cache(c, model)
        with context_for(c):
            logits = prefill(model, cache, prompt[:, :n], args.chunk)
            if args.batch_cache:
                cache = [type(layer).merge([layer]) for layer in cache]
        caches[label], tokens[label] = cache, mx.argmax(logits, axis=-1)
        print(f"{label}: prefilled {n} tokens{', merged into batch caches of one row' if args.batch_cache else ''}",
              flush=True)

    labels = [r[0] for r in runs]
    config_of = {label: c for label, c, _ in runs}
    rng = random.Random(0)
    times = {c: {"step": [], "build": [], "store": [], "attention": []} for c in labels}
    key = mx.random.key(0)
    for _ in range(args.rounds):
        for _ in range(args.steps):
            order = list(labels)
            rng.shuffle(order)
            key, k1, k2, k3 = mx.random.split(key, 4)
            k, v, q = (mx.random.normal(s, key=r) for s, r in (((1, n_kv, 1, d), k1), ((1, n_kv, 1, d), k2),
                                                               ((1, n_q, 1, d), k3)))
            mx.eval(k, v, q)
            for c in order:
                with context_for(config_of[c]):
                    t0 = time.perf_counter()
                    logits = model(tokens[c][:, None], cache=caches[c])  # what e2e_speed's decode_step does
                    t1 = time.perf_counter()
                    tokens[c] = mx.argmax(logits[:, -1], axis=-1)
                    mx.eval(tokens[c])
                    times[c]["step"].append(time.perf_counter() - t0)
                    times[c]["build"].append(t1 - t0)
                    for layer in caches[c]:
                        layer.trim(1)
                    store, attention = store_and_attend(caches[c], k, v, q, d ** -0.5)
                    times[c]["store"].append(store)
                    times[c]["attention"].append(attention)

    rows = []
    kind = "batch caches of one row" if args.batch_cache else "per-sequence caches"
    print(f"\nmilliseconds per decode step at {args.prompt} tokens, {len(caches[labels[0]])} layers, {kind} (medians; "
          "build = the step's Python before evaluation, part of step)")
    print(f"{'config':16s} {'step':>8s} {'build':>8s} {'store':>8s} {'attention':>10s} {'rest':>8s}")
    for c in labels:
        med = {p: 1e3 * statistics.median(v) for p, v in times[c].items()}
        med["rest"] = med["step"] - med["store"] - med["attention"]
        rows.append({"config": c, **{p + "_ms": round(x, 3) for p, x in med.items()}})
        print(f"{c:16s} {med['step']:8.1f} {med['build']:8.1f} {med['store']:8.1f} {med['attention']:10.1f} "
              f"{med['rest']:8.1f}")
    _common.write_json(args.out, {"machine": machine(), "blas": _common.blas(), "prompt": args.prompt,
                                  "steps": args.steps, "rounds": args.rounds, "batch_cache": args.batch_cache,
                                  "baseline_tokens": args.baseline_tokens, "kernel": attention_kernel.status()[1],
                                  "rows": rows})


def _profiled(fn):
    """``(result, pstats.Stats)`` of ``fn()`` under cProfile."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    return out, pstats.Stats(prof)


def _by_function(stats) -> dict:
    """``{"file:line(name)": (calls, total seconds inside)}`` of a pstats.Stats."""
    return {f"{os.path.basename(k[0])}:{k[1]}({k[2]})": (v[1], v[2]) for k, v in stats.stats.items()}


def fresh_profile(model, prompt, configs, args, attention_kernel):
    """``--fresh R``: what a generation's first decode steps cost against its later ones, per config."""
    import mlx.core as mx

    K = args.steps
    times = {c: {"prefill": [], "build": [[] for _ in range(K)], "step": [[] for _ in range(K)]} for c in configs}
    profiles = {}
    for r in range(args.fresh):
        order = list(configs)
        random.Random(r).shuffle(order)
        for c in order:
            gc.collect()
            mx.clear_cache()
            with context_for(c):
                cache = make_cache(c, model)
                t0 = time.perf_counter()
                logits = prefill(model, cache, prompt, args.chunk)
                mx.eval([layer.state for layer in cache])  # (what mlx_lm's generate_step evaluates per chunk)
                times[c]["prefill"].append(time.perf_counter() - t0)
                token = mx.argmax(logits, axis=-1)
                mx.eval(token)
                for i in range(K):
                    def step(token=token):
                        t0 = time.perf_counter()
                        logits = model(token[:, None], cache=cache)
                        t1 = time.perf_counter()
                        nxt = mx.argmax(logits[:, -1], axis=-1)
                        mx.eval(nxt)
                        return nxt, t1 - t0, time.perf_counter() - t0
                    if args.cprofile and r == args.fresh - 1 and i in (0, args.cprofile - 1):
                        (token, b, t), st = _profiled(step)
                        profiles[(c, i + 1)] = st
                    else:
                        token, b, t = step()
                    times[c]["build"][i].append(b)
                    times[c]["step"][i].append(t)
            del cache
        print(f"fresh run {r}: " + "  ".join(f"{c} prefill {times[c]['prefill'][-1]:.1f}s step1 "
                                             f"{1e3 * times[c]['step'][0][-1]:.1f}ms" for c in configs), flush=True)
    head = min(8, K)
    print(f"\nms per decode step after a fresh {args.prompt}-token prefill (chunks of {args.chunk}), {args.fresh} "
          f"fresh runs per config (median per step index; 'later' = median over steps {head + 1}..{K}); build = the "
          "step's Python before evaluation")
    print(f"{'config':16s} " + " ".join(f"{'s' + str(i + 1):>7s}" for i in range(head)) + f" {'later':>7s}"
          f" {'extra ms in s1..s' + str(head):>18s}")
    rows = []
    for c in configs:
        med = [1e3 * statistics.median(x) for x in times[c]["step"]]
        bmed = [1e3 * statistics.median(x) for x in times[c]["build"]]
        later = 1e3 * statistics.median([v for x in times[c]["step"][head:] for v in x]) if K > head else float("nan")
        blater = 1e3 * statistics.median([v for x in times[c]["build"][head:] for v in x]) if K > head else float("nan")
        extra = sum(m - later for m in med[:head])
        print(f"{c:16s} " + " ".join(f"{m:7.1f}" for m in med[:head]) + f" {later:7.1f} {extra:18.1f}")
        print(f"{'  build':16s} " + " ".join(f"{m:7.1f}" for m in bmed[:head]) + f" {blater:7.1f}")
        rows.append({"config": c, "step_ms": med, "build_ms": bmed, "later_ms": later, "later_build_ms": blater,
                     "extra_first_ms": extra, "prefill_s": times[c]["prefill"],
                     "step_runs_ms": [[1e3 * v for v in x] for x in times[c]["step"]]})
    for c in configs:
        if (c, 1) in profiles and (c, args.cprofile) in profiles:
            a, b = _by_function(profiles[(c, 1)]), _by_function(profiles[(c, args.cprofile)])
            diff = sorted(((a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1], k) for k in set(a) | set(b)), reverse=True)
            print(f"\n{c}: cProfile, step 1 against step {args.cprofile}: functions by time inside (ms) step 1 - step "
                  f"{args.cprofile} (calls in step 1 / step {args.cprofile})")
            for d, k in diff[:12]:
                print(f"  {1e3 * d:8.2f}  {a.get(k, (0, 0))[0]:5d}/{b.get(k, (0, 0))[0]:<5d} {k}")
    _common.write_json(args.out, {"mode": "fresh", "machine": machine(), "blas": _common.blas(), "prompt": args.prompt,
                                  "chunk": args.chunk, "steps": K, "fresh": args.fresh,
                                  "kernel": attention_kernel.status()[1], "kernel_calls": attention_kernel.calls(),
                                  "rows": rows})


if __name__ == "__main__":
    main()
