"""The default run of ``benchmarks/e2e_speed.py`` (no ``--shape`` / ``--gen``): its configs (`CONFIGS`, our own in
`OURS`, the decode `LOOPS`), how a config's cache is made and run (`make_cache`, `context_for`), the loops it times
(`interleaved_prefill`, `fill_from`, `decode_step`, `decode_mlx_lm`, `interleaved_steps`), and the paired ratios
against ``kv`` with their bootstrap intervals (`paired_prefill_ratio`, `paired_step_ratio`, `print_paired`), which the
``--shape`` / ``--gen`` runs (`_e2e_enabled`) report too.

Imported by ``e2e_speed.py`` the way it imports ``_common`` (the script's folder is first on ``sys.path``); no MLX at
module level (the script preloads OpenBLAS before MLX loads). The names stay importable from ``e2e_speed``.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import _common
from _common import registered

CONFIGS = ("kv", "mlx-q8", "mlx-q4", "tq-block4-hook", "tq-block84-hook", "tq-block8-hook", "tq-affine4-hook", "tq-lm4-hook",
           "tq-lm4")
# what users run: mlx_lm's plain / 8-bit / 4-bit caches, the default preset and the 4-bit tier (registered names)
DEFAULT_CONFIGS = ("kv", "mlx-q8", "mlx-q4", "tq-affine-k8v4", "tq-4b")
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
        from veloxquant_mlx.integration.routing import use_packed_attention

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
