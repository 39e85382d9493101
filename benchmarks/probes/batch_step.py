"""What coding a batch's decode tokens in one call gives (issue 54's batch shortcut), against the per-row path.

Diagnosis, not a product figure: one model, ``--rows`` rows of a ``--tokens``-token random prompt (chunked prefill of
``--chunk``), then ``--steps`` greedy decode steps taken in turn (shuffled each step) by three caches:

- ``plain``: mlx_lm's own caches (``make_prompt_cache`` of the model before `veloxquant_mlx.enable`);
- ``one-call``: ``--preset``'s caches as shipped: a step's new token of every row coded in one call
  (`veloxquant_mlx.cache.row_policy.Rows.append`, where the codes need no per-row fitted arrays);
- ``per-row``: the same caches with that shortcut switched off for their calls (each row's token through its own
  tail, as before it): the same codes, so the same tokens.

Per cache: the median step time and the geometric mean of the paired ratios ``plain time / time`` with a 95 %
bootstrap interval (steps after the first two).

    python -m benchmarks.probes.batch_step --rows 4 --tokens 1024 --steps 24 --out results/batch_step.json
    python -m benchmarks.probes.batch_step --smoke --out /tmp/batch_step.json   # a tiny random model: the code runs
"""
from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time

from veloxquant_mlx.apps.blas import ensure_openblas

from benchmarks import _common

ensure_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache  # noqa: E402

import veloxquant_mlx as vq  # noqa: E402
from veloxquant_mlx.cache.row_policy import Rows  # noqa: E402

MODES = ("plain", "one-call", "per-row")


@contextlib.contextmanager
def shortcut(on: bool):
    """The batch shortcut as shipped (``on``), or switched off for the calls inside."""
    if on:
        yield
        return
    saved = Rows._codes_need_no_row
    Rows._codes_need_no_row = lambda self: False
    try:
        yield
    finally:
        Rows._codes_need_no_row = saved


def bootstrap(ratios, n: int = 2000, seed: int = 0):
    """The geometric mean of ``ratios`` and its 95 % bootstrap interval."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    rng = np.random.default_rng(seed)
    means = np.exp(logs[rng.integers(0, len(logs), (n, len(logs)))].mean(axis=1))
    return float(np.exp(logs.mean())), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def run(model, args) -> dict:
    vocab = int(model.args.vocab_size) if hasattr(model, "args") else 128
    prompt = mx.random.randint(0, vocab, (args.rows, args.tokens), key=mx.random.key(args.seed))
    caches = {"plain": mlx_make_prompt_cache(model)}
    vq.enable(model, args.preset)
    try:
        caches["one-call"], caches["per-row"] = model.make_cache(), model.make_cache()
        last = {}
        for m in MODES:
            with shortcut(m != "per-row"):
                for s in range(0, args.tokens, args.chunk):
                    out = model(prompt[:, s:s + args.chunk], cache=caches[m])
                    mx.eval(out)
            last[m] = mx.argmax(out[:, -1:], axis=-1)
        times = {m: [] for m in MODES}
        same = True
        order, rng = list(MODES), random.Random(args.seed)
        for _ in range(args.steps):
            rng.shuffle(order)
            for m in order:
                with shortcut(m != "per-row"):
                    t0 = time.perf_counter()
                    out = model(last[m], cache=caches[m])
                    mx.eval(out)
                    times[m].append(time.perf_counter() - t0)
                last[m] = mx.argmax(out[:, -1:], axis=-1)
            same = same and bool(mx.array_equal(last["one-call"], last["per-row"]))
    finally:
        vq.disable(model)
    rows = []
    for m in MODES:
        kept = times[m][2:] or times[m]
        ratio = bootstrap([p / t for p, t in zip((times["plain"][2:] or times["plain"]), kept)])
        rows.append({"cache": m, "step_ms": 1e3 * statistics.median(kept), "x_plain": ratio[0],
                     "x_plain_95": [ratio[1], ratio[2]]})
    return {"rows": rows, "same_tokens": same}


def main(argv=None) -> None:
    ap = _common.parser(__doc__, brief=True)
    _common.add_model(ap)
    ap.add_argument("--preset", default="tq-4b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens per row")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 2 rows of 160 tokens, 4 steps")
    _common.add_out(ap, "results/batch_step.json")
    args = ap.parse_args(argv)
    if args.smoke:
        from benchmarks.probes._smoke import tiny_model

        model, _ = tiny_model()
        args.rows, args.tokens, args.chunk, args.steps = 2, 160, 64, 4
    else:
        from veloxquant_mlx.apps.models.loader import load_model

        model, _ = load_model(args.model)
    print(_common.environment())
    res = run(model, args)
    print(f"{args.model if not args.smoke else 'smoke'}: {args.rows} rows x {args.tokens} tokens, {args.preset}, "
          f"{args.steps} paired steps")
    print(f"{'cache':10s} {'step ms':>8s}  x plain [95 %]")
    for r in res["rows"]:
        print(f"{r['cache']:10s} {r['step_ms']:8.1f}  {r['x_plain']:.3f} [{r['x_plain_95'][0]:.3f}, "
              f"{r['x_plain_95'][1]:.3f}]")
    print(f"one-call and per-row chose the same tokens: {res['same_tokens']}")
    if args.out:
        _common.write_json(args.out, {"model": "smoke" if args.smoke else args.model, "preset": args.preset,
                                      "rows_per_batch": args.rows, "tokens": args.tokens, "steps": args.steps,
                                      "machine": _common.environment(), **res})


if __name__ == "__main__":
    sys.exit(main())
