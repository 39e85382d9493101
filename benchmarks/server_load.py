"""Load test of ``veloxquant serve``: requests/s and memory, compressed vs plain KV caches.

For each configuration a server is started in this process on 127.0.0.1 (a free port; loopback
only), ``--requests`` chat completions are sent by ``--concurrency`` client threads, and the server
is stopped. Bounded: every request has a timeout and the whole run stops at ``--max-seconds``.

    python benchmarks/server_load.py                         # 100 requests per configuration
    python benchmarks/server_load.py --requests 20 --out server_load.json

Each prompt is a shared context paragraph (about ``--context-tokens`` tokens) plus one of several
questions, so the prompt cache has a common prefix to reuse and the KV cache is large enough for
its size to show. Memory: ``mx.get_peak_memory()`` (reset after startup, weights included), the
bytes held by mlx_lm's LRU prompt cache at the end, and the process RSS.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = [f"What is the capital of {c}?" for c in ("France", "Germany", "Japan", "Egypt", "Russia")] + [
    "Name a primary color.", "What is two plus two?", "Say hello in French.",
    "What is the largest planet?", "Name a fruit that is yellow.",
]
CONTEXT = (
    "The following notes describe a small office network. The router hands out addresses by DHCP, "
    "the file server exports home directories over NFS, printers are shared through CUPS, and every "
    "workstation runs an unattended upgrade job each night. Backups are written to an external disk "
    "on Sundays and copied off site once a month. Users authenticate against a central directory, "
    "and the wireless network is separated from the wired one by a firewall. "
)

# (label, serve arguments): registered methods (`veloxquant methods`)
DEFAULT_CONFIGS = [
    ("kv (plain, batched)", ["--method", "kv"]),
    ("kv (plain, one at a time)", ["--method", "kv", "--no-batching"]),
    ("tq-mse-k4v4", ["--method", "tq-mse-k4v4"]),
]


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _post(port: int, body: dict, timeout: float):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body)
        conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def run_config(label, serve_args, model, tokenizer, n_requests, concurrency, max_tokens, context, deadline,
               timeout):
    import mlx.core as mx

    from veloxquant_mlx import server as vs

    args = vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--host", "127.0.0.1", "--log-level", "WARNING", "--max-tokens", str(max_tokens)] + serve_args
    )
    handle = vs.start_server(args, model=model, tokenizer=tokenizer, port=0)  # port 0: a free one
    results, errors = [], []
    lock = threading.Lock()
    counter = iter(range(n_requests))
    try:
        mx.reset_peak_memory()
        rss_before = _rss_mib()

        def worker():
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = {"model": "smollm2", "temperature": 0.0, "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": context + QUESTIONS[i % len(QUESTIONS)]}]}
                t0 = time.perf_counter()
                try:
                    status, payload = _post(handle.port, body, timeout)
                except Exception as e:  # counted, the run goes on
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    if status == 200:
                        results.append((dt, payload["usage"]))
                    else:
                        errors.append(f"HTTP {status}: {payload}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + timeout)
        wall = time.perf_counter() - t0
        lat = sorted(r[0] for r in results)
        completion = sum(r[1]["completion_tokens"] for r in results)
        prompt = sum(r[1]["prompt_tokens"] for r in results)
        cached = sum((r[1].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
        fp = handle.footprint
        return {
            "config": label,
            "batching": handle.batching[0],
            "requests_ok": len(results),
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "wall_s": wall,
            "requests_per_s": len(results) / wall if wall > 0 else 0.0,
            "completion_tokens_per_s": completion / wall if wall > 0 else 0.0,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "kv_bytes_per_token": fp["bytes_per_token"],
            "kv_bits_per_coordinate": fp["bits_per_coordinate"],
            "prompt_cache_mib": handle.response_generator.prompt_cache.nbytes / 2**20,
            "peak_mlx_mib": mx.get_peak_memory() / 2**20,
            "rss_mib_before": rss_before,
            "rss_mib_after": _rss_mib(),
        }
    finally:
        handle.close()


def _table(rows):
    head = ("| config | batched | ok/err | req/s | tok/s | p50 s | p95 s | cached/prompt tok | KV B/token "
            "| bits/coord | prompt cache MiB | peak MLX MiB | RSS MiB |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['config']} | {'yes' if r['batching'] else 'no'} | {r['requests_ok']}/{r['errors']} "
            f"| {r['requests_per_s']:.2f} | {r['completion_tokens_per_s']:.1f} "
            f"| {r['latency_p50_s'] or float('nan'):.2f} | {r['latency_p95_s'] or float('nan'):.2f} "
            f"| {r['cached_prompt_tokens']}/{r['prompt_tokens']} | {r['kv_bytes_per_token']:.0f} "
            f"| {r['kv_bits_per_coordinate']:.2f} | {r['prompt_cache_mib']:.1f} | {r['peak_mlx_mib']:.0f} "
            f"| {r['rss_mib_after']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    try:
        from veloxquant_mlx.blas import ensure_openblas

        ensure_openblas()
    except ImportError:
        pass
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=100, help="requests per configuration (default 100)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (default 16)")
    p.add_argument("--context-tokens", type=int, default=400,
                   help="approximate length of the shared context paragraph (default 400)")
    p.add_argument("--only", action="append", default=None,
                   help="run only configurations whose label contains this text (repeatable)")
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long in all")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(a.model)
    reps = max(1, round(a.context_tokens / max(1, len(tokenizer.encode(CONTEXT)))))
    context = CONTEXT * reps + "\n\n"
    configs = [c for c in DEFAULT_CONFIGS if not a.only or any(o in c[0] for o in a.only)]
    deadline = time.monotonic() + a.max_seconds
    rows = []
    for label, serve_args in configs:
        if time.monotonic() >= deadline:
            print(f"skipped {label}: --max-seconds reached", file=sys.stderr)
            continue
        print(f"running {label} ...", file=sys.stderr, flush=True)
        rows.append(run_config(label, serve_args, model, tokenizer, a.requests, a.concurrency, a.max_tokens,
                               context, deadline, a.timeout))
    print(f"{a.requests} requests per configuration, {a.concurrency} client threads, {a.max_tokens} "
          f"completion tokens max, shared context ~{len(tokenizer.encode(context))} tokens, model {a.model}")
    print(_table(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
