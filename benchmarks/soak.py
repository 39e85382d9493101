"""Soak test of a compressed KV cache: N generated tokens through ``veloxquant generate``'s code path.

What runs is what ``veloxquant generate`` runs: the model from `load_model`, the cache from the registered
spec (`resolve_spec`, e.g. ``tq-affine-k4v4``), the chat prompt, ``mlx_lm.stream_generate`` with
``prefill_step_size=256`` inside `use_packed_attention()`. Two differences, both so that exactly ``--tokens``
tokens are generated: end-of-sequence tokens are masked out (a logits processor), and the model's declared
context is not enforced (a memory soak, not a quality run: text past the trained context is not meaningful).

Every ``--every`` tokens it samples

- the KV bytes: ``nbytes`` of every layer's cache (held, spare growth steps included) and ``live_nbytes``
  where the cache has it (the live tokens only); the held bytes are read after every token, and the most
  since the previous sample is kept;
- the process's peak MLX memory since the previous sample (``mx.get_peak_memory``, then reset), minus the
  model's weights.

and checks

1. linear growth at the configuration's bytes per token: the configuration's line ``fixed + bpt * t`` is
   measured on a fresh cache with random keys/values (`measure_bytes_per_token`, times the layer count),
   together with its own ripple: some codecs keep the tokens of a not-yet-full block exact, so live bytes
   run a sawtooth around the line (measured as the largest deviation over two growth steps of single-token
   updates). Every soak sample must lie within that ripple plus ``--fit-tol`` of the line, and a
   least-squares line through the samples must have the configuration's slope within ``--slope-tol`` plus
   what the ripple can tilt it by over the sampled range. A leak (bytes beyond the codes) fails both;
2. bounded overhead: at every sample, peak minus model is at most (1 + ``--peak-tol``) times the KV bytes
   held (default 10 %), the most held at any token since the previous sample (the peak comes while the exact
   tail is full, just before its block is coded; the sample itself may fall just after).

With ``--reference-tokens N`` the same loop then runs N tokens with mlx_lm's plain ``KVCache`` and prints its
peak minus model minus KV at the same samples: the loop's own overhead, for scale (not checked).

Prints a table and writes JSON (``--out``). Exit code 1 when a check fails.

    python benchmarks/soak.py --preset tq-affine-k4v4 --tokens 10000 --out results/soak.json
"""
from __future__ import annotations

import os
import sys
import time

import _common


def _kv_bytes(cache):
    from veloxquant_mlx.apps.eval.memory import cache_nbytes

    held = sum(cache_nbytes(c) for c in cache)
    live = sum(int(getattr(c, "live_nbytes", cache_nbytes(c))) for c in cache)
    return held, live


def _fit(xs, ys):
    """Least-squares line y = a + b x -> (a, b)."""
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    b = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx_, b


def config_line(make_cache, kv_heads: int, head_dim: int, n_layers: int, start: int = 512, span: int = 512):
    """(fixed bytes, bytes per token, ripple bytes) of the configuration, all layers, live bytes.

    Measured on one fresh layer fed random tokens: ``start`` at once, then one at a time for ``span`` more.
    """
    import mlx.core as mx

    from veloxquant_mlx.apps.eval.memory import _stub_model, measure_bytes_per_token

    bpt = measure_bytes_per_token(make_cache, kv_heads, head_dim)["marginal_bytes_per_token_per_layer"]
    cache = make_cache(_stub_model(1, kv_heads, head_dim))[0]
    keys = mx.random.normal((1, kv_heads, start + span, head_dim), key=mx.random.key(1))
    mx.eval(cache.update_and_fetch(keys[..., :start, :], keys[..., :start, :]))
    points = [(start, _kv_bytes([cache])[1])]
    for t in range(start, start + span):
        mx.eval(cache.update_and_fetch(keys[..., t : t + 1, :], keys[..., t : t + 1, :]))
        points.append((t + 1, _kv_bytes([cache])[1]))
    fixed = min(b - bpt * t for t, b in points)  # the line touches the sawtooth from below
    ripple = max(b - (fixed + bpt * t) for t, b in points)
    return fixed * n_layers, bpt * n_layers, ripple * n_layers


def _generate(model, tok, ids, cache, tokens: int, every: int, model_bytes: int) -> list:
    """``tokens`` tokens through ``stream_generate`` (end of sequence masked) with ``cache``; a sample every ``every``."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from veloxquant_mlx.integration.routing import use_packed_attention

    eos = sorted(set(getattr(tok, "eos_token_ids", None) or []))
    eos_idx = mx.array(eos, dtype=mx.int32) if eos else None

    def no_eos(tokens, logits):  # exactly --tokens tokens: the model may not stop early
        if eos_idx is None:
            return logits
        logits[..., eos_idx] = -float("inf")
        return logits

    mx.clear_cache()
    samples = []
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    n = 0
    held_max = 0  # the most KV bytes held at any token of the current window (before a block is coded)
    with use_packed_attention():
        for resp in stream_generate(model, tok, ids, max_tokens=tokens, prompt_cache=cache,
                                    prefill_step_size=256, logits_processors=[no_eos]):
            n += 1
            held, live = _kv_bytes(cache)
            held_max = max(held_max, held)
            if n % every == 0 or n == tokens:
                peak = mx.get_peak_memory()
                mx.reset_peak_memory()
                samples.append({
                    "generated": n, "tokens_in_cache": int(cache[0].offset), "kv_bytes": held,
                    "kv_window_max_bytes": held_max,
                    "kv_live_bytes": live, "peak_bytes": int(peak), "peak_minus_model": int(peak - model_bytes),
                    "elapsed_s": round(time.perf_counter() - t0, 2),
                })
                held_max = held
    return samples


def run(args) -> dict:
    from mlx.utils import tree_flatten

    from veloxquant_mlx.apps.cli.common import _chat_ids
    from veloxquant_mlx.apps.eval.memory import model_kv_shape
    from veloxquant_mlx.apps.eval.specs import resolve_spec
    from veloxquant_mlx.apps.models import load_model

    model, tok = load_model(args.model)
    n_layers, kv_heads, head_dim = model_kv_shape(model)
    spec = resolve_spec(args.preset, args.bits, head_dim)
    if spec.bits is None:
        raise SystemExit(f"--preset {args.preset!r} is not a compressed cache; choose a tq-* preset")
    fixed, bytes_per_token, ripple = config_line(spec.make_cache, kv_heads, head_dim, n_layers)
    model_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ids = _chat_ids(tok, args.prompt)
    samples = _generate(model, tok, ids, spec.make_cache(model), args.tokens, args.every, model_bytes)
    reference = []
    if args.reference_tokens:  # the same loop with mlx_lm's plain cache: what the loop itself needs
        from mlx_lm.models.cache import KVCache

        reference = _generate(model, tok, ids, [KVCache() for _ in model.layers], min(args.reference_tokens, args.tokens),
                              args.every, model_bytes)
        for s in reference:
            s["transient_bytes"] = s["peak_minus_model"] - s["kv_window_max_bytes"]
    xs = [s["tokens_in_cache"] for s in samples]
    ys = [s["kv_live_bytes"] for s in samples]
    for s_ in samples:
        line = fixed + bytes_per_token * s_["tokens_in_cache"]
        s_["config_line_bytes"] = line
        s_["off_line_bytes"] = s_["kv_live_bytes"] - line  # in [0, ripple] when the cache holds only codes
        s_["on_line"] = -args.fit_tol * line <= s_["off_line_bytes"] <= ripple + args.fit_tol * line
    a, b = _fit(xs, ys) if len(samples) >= 2 else (float("nan"), float("nan"))
    x_range = max(xs) - min(xs)
    tilt = 2 * ripple / x_range if x_range else float("inf")  # the most the ripple can tilt a fitted line
    slope_ok = len(samples) >= 2 and abs(b - bytes_per_token) <= args.slope_tol * bytes_per_token + tilt
    fit_ok = all(s_["on_line"] for s_ in samples)
    for s in samples:
        # The peak of a window is reached while the cache holds the most (its exact tail full, just before a block
        # is coded), so it is compared with the most KV bytes held in that window, not with the sample's.
        kv = s["kv_window_max_bytes"]
        s["peak_over_kv"] = s["peak_minus_model"] / kv if kv else float("inf")
        s["transient_bytes"] = s["peak_minus_model"] - kv  # activations, logits, attention scratch
        s["peak_ok"] = s["peak_over_kv"] <= 1.0 + args.peak_tol
    return {
        "method": spec.name, "model": args.model, "tokens": args.tokens, "every": args.every,
        "prompt_tokens": len(ids), "n_layers": n_layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "model_bytes": int(model_bytes), "config_bytes_per_token": bytes_per_token,
        "config_fixed_bytes": fixed, "config_ripple_bytes": ripple,
        "fit": {"intercept_bytes": a, "slope_bytes_per_token": b, "slope_allowance_from_ripple": tilt},
        "checks": {
            "slope_matches_config": slope_ok, "linear": fit_ok,
            "peak_within_tolerance_every_sample": all(s["peak_ok"] for s in samples),
            "slope_tol": args.slope_tol, "fit_tol": args.fit_tol, "peak_tol": args.peak_tol,
        },
        "decode_tokens_per_s": samples[-1]["generated"] / max(samples[-1]["elapsed_s"], 1e-9),
        "samples": samples,
        "reference_plain_kvcache": reference,
    }


def _print(r: dict) -> None:
    mib = 2.0 ** 20
    print(f"soak: {r['method']} on {r['model']}, {r['tokens']} generated tokens, prompt {r['prompt_tokens']} tokens; "
          f"model {r['model_bytes'] / mib:.1f} MiB; configuration {r['config_bytes_per_token']:.1f} B/token "
          f"({r['n_layers']} layers x {r['kv_heads']} kv heads x head_dim {r['head_dim']})")
    head = ["generated", "in cache", "KV MiB (held)", "KV MiB (live)", "KV MiB (window max)", "line MiB", "on line",
            "peak-model MiB", "transient MiB", "peak-model / KV max", "peak ok"]
    rows = [[s["generated"], s["tokens_in_cache"], f"{s['kv_bytes'] / mib:.2f}", f"{s['kv_live_bytes'] / mib:.2f}",
             f"{s['kv_window_max_bytes'] / mib:.2f}", f"{s['config_line_bytes'] / mib:.2f}",
             "yes" if s["on_line"] else "NO", f"{s['peak_minus_model'] / mib:.2f}", f"{s['transient_bytes'] / mib:.2f}",
             f"{s['peak_over_kv']:.3f}", "yes" if s["peak_ok"] else "NO"]
            for s in r["samples"]]
    print(_common.aligned_table(head, rows))
    f, c = r["fit"], r["checks"]
    print(f"configuration line: {r['config_fixed_bytes'] / mib:.3f} MiB + {r['config_bytes_per_token']:.1f} B/token, "
          f"ripple {r['config_ripple_bytes'] / mib:.3f} MiB; every sample on it: {'yes' if c['linear'] else 'NO'}")
    print(f"fitted slope {f['slope_bytes_per_token']:.1f} B/token: {'ok' if c['slope_matches_config'] else 'MISMATCH'} "
          f"(allowed {c['slope_tol']:.0%} + {f['slope_allowance_from_ripple']:.1f} B/token from the ripple)")
    print(f"peak minus model within {c['peak_tol']:.0%} of the KV bytes at every sample: "
          f"{'yes' if c['peak_within_tolerance_every_sample'] else 'NO'}; decode {r['decode_tokens_per_s']:.1f} tok/s")
    if r["reference_plain_kvcache"]:
        ours = {s["generated"]: s for s in r["samples"]}
        print("the same loop with mlx_lm's plain KVCache (model dtype): peak - model - most KV held in the window")
        print("generated  plain KV MiB (window max)  plain transient MiB  ours transient MiB  ours KV MiB (window max)  "
              "plain transient / ours KV")
        for s in r["reference_plain_kvcache"]:
            o = ours.get(s["generated"])
            if o is None:
                continue
            print(f"{s['generated']:9d}  {s['kv_window_max_bytes'] / mib:24.2f}  {s['transient_bytes'] / mib:19.2f}  "
                  f"{o['transient_bytes'] / mib:18.2f}  {o['kv_window_max_bytes'] / mib:24.2f}  "
                  f"{s['transient_bytes'] / o['kv_window_max_bytes']:25.3f}")


def main(argv=None) -> int:
    if argv is None:  # as `veloxquant generate` does: re-exec with OpenBLAS preloaded before MLX loads
        from veloxquant_mlx.apps.blas import ensure_openblas

        ensure_openblas()
    p = _common.parser(__doc__, brief=True)
    _common.add_model(p)
    p.add_argument("--preset", "--method", dest="preset", default="tq-affine-k4v4",
                   help="a compressed preset (veloxquant presets; --method: its old name)")
    p.add_argument("--bits", type=float, default=None)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--prompt", default="Write a very long story about a lighthouse keeper.")
    p.add_argument("--slope-tol", type=float, default=0.01)
    p.add_argument("--fit-tol", type=float, default=0.01)
    p.add_argument("--peak-tol", type=float, default=0.10)
    p.add_argument("--reference-tokens", type=int, default=0,
                   help="also run this many tokens with mlx_lm's plain KVCache in the same loop (its own overhead)")
    _common.add_out(p, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.every < 1 or args.reference_tokens < 0:
        p.error("--tokens and --every must be >= 1, --reference-tokens >= 0")
    if args.out:  # fail before the run, not after it
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        if not os.access(d, os.W_OK):
            p.error(f"--out {args.out!r}: directory not writable")
    r = run(args)
    _print(r)
    if args.out:
        _common.write_json(args.out, r)
    c = r["checks"]
    return 0 if c["slope_matches_config"] and c["linear"] and c["peak_within_tolerance_every_sample"] else 1


if __name__ == "__main__":
    sys.exit(main())
