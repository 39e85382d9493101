"""A short prompt chunk on top of a history: what a server does when a request's prefix comes from its prompt cache.

SmolLM2-135M. Per round and configuration: ``--batch`` per-sequence caches each prefill ``--history`` tokens, are
merged into a batch cache (mlx_lm's ``BatchKVCache`` for the plain cache, ours for a TurboQuant method), and one
forward pass of a ``--chunk``-token chunk per row is timed: graph building (Python) and evaluation apart. The
configurations take turns, the order reversed every other round, so the machine's drift hits both alike; medians
over ``--rounds`` and the paired per-round ratios (plain time / ours) are printed and written as JSON.

    python -m benchmarks.probes.chunk_prefill --history 170 --chunk 20 --batch 1 --rounds 8
    python -m benchmarks.probes.chunk_prefill --history 200 --chunk 20 --batch 4 --rounds 6
"""
from __future__ import annotations

import statistics
import time

from benchmarks import _common


def main(argv=None):
    from veloxquant_mlx.blas import ensure_openblas

    ensure_openblas()
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    import veloxquant_mlx as vq
    from veloxquant_mlx.integration import use_packed_attention
    from veloxquant_mlx.eval import corpus_tokens
    from veloxquant_mlx.eval.specs import CONFIGURATIONS
    from veloxquant_mlx.models.loader import load_model

    ap = _common.parser(__doc__)
    ap.add_argument("--method", default="tq-affine-k8v4", choices=sorted(CONFIGURATIONS))
    ap.add_argument("--history", type=int, default=170, help="tokens each row holds before the chunk")
    ap.add_argument("--chunk", type=int, default=20, help="tokens of the timed chunk")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--rounds", type=int, default=8)
    _common.add_out(ap, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    for name in ("history", "chunk", "batch", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")

    model, tok = load_model("smollm2")
    ids = corpus_tokens(tok)[: a.history + a.chunk]
    history, chunk = mx.array([ids[: a.history]]), mx.array([ids[a.history:]] * a.batch)

    def batch_cache(kind):
        rows = []
        for _ in range(a.batch):
            c = [KVCache() for _ in model.layers] if kind == "plain" else vq.make_prompt_cache(model, CONFIGURATIONS[a.method])
            model(history, cache=c)
            mx.eval([x.state for x in c])
            rows.append(c)
        return [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]

    times = {"plain": [], "ours": []}
    with use_packed_attention():
        for rnd in range(a.rounds):
            for kind in (["plain", "ours"] if rnd % 2 == 0 else ["ours", "plain"]):
                cache = batch_cache(kind)
                t0 = time.perf_counter()
                out = model(chunk, cache=cache)
                t1 = time.perf_counter()
                mx.eval(out, [x.state for x in cache])
                times[kind].append((t1 - t0, time.perf_counter() - t1))
    med = {k: (statistics.median(b for b, _ in v) * 1e3, statistics.median(e for _, e in v) * 1e3) for k, v in times.items()}
    paired = [(pb + pe) / (ob + oe) for (pb, pe), (ob, oe) in zip(times["plain"], times["ours"])]
    print(f"SmolLM2-135M, {a.batch} row(s) of {a.history} tokens + a {a.chunk}-token chunk, {a.rounds} interleaved rounds")
    print(_common.markdown_table(["cache", "build ms", "eval ms", "total ms"],
                                 [["plain BatchKVCache" if k == "plain" else a.method, f"{b:.1f}", f"{e:.1f}",
                                   f"{b + e:.1f}"] for k, (b, e) in med.items()]))
    print(f"plain / ours total, paired per round: median {statistics.median(paired):.3f} "
          f"[{min(paired):.3f}, {max(paired):.3f}]")
    if a.out:
        _common.write_json(a.out, {"args": {k: str(v) for k, v in vars(a).items()}, "median_ms": med,
                                   "paired_plain_over_ours": paired})


if __name__ == "__main__":
    main()
