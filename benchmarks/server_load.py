"""Load test of ``veloxquant serve``: requests/s and latency, batched and not, compressed vs plain KV caches.

Every configuration gets a ``veloxquant serve`` process of its own on 127.0.0.1 (a free port; loopback only), as
it is deployed (``--in-process``: threads of this process sharing one model instead; in-process runs at 1 client
measured the compressed batched server at 0.84x of plain with three servers and the memory probe in the process,
0.98x with two servers, same code, minutes apart: they disturb each other unevenly); all of them start first and
get one warm-up request, then, for each ``--concurrency`` level (default 1, 4, 8, 16), each
server in turn answers ``max(--min-requests, level * --requests-per-client)`` chat completions sent by that many
client threads (interleaved, so a change in the machine's load hits every configuration alike). ``--rounds R``
repeats that R times per level, the order of the servers reversed every other round; each round's ratio to the
plain batched server is reported (median and range over rounds) beside the pooled figures, because one cell at one
client moves by ±15 % between runs on an idle 2-core machine. Bounded: every request has a timeout and the whole
run stops at ``--max-seconds``.

    python benchmarks/server_load.py --min-requests 4 --max-tokens 8 --context-tokens 200 --out load.json

``--presets tq-affine-k8v4,tq-4b``: the compressed presets served (default the default alone), each batched beside
the plain batched server and in the memory table.

Each prompt is a shared context paragraph (about ``--context-tokens`` tokens) plus one of several questions, so the
prompt cache has a common prefix to reuse; with ``--distinct-contexts`` each request has its own context of that
many tokens (conversations that each hold a long cache: issue 55's 4 x 8192 tokens), and each server process's peak
resident memory (VmHWM) is reported beside its throughput.

    python benchmarks/server_load.py --model gemma3-270m --concurrency 4 --min-requests 4 --context-tokens 8192 \
        --distinct-contexts --max-tokens 32 --only batched --timeout 3000 --max-seconds 5400 --out load_4x8192.json Then the KV memory: how many ``--capacity-tokens``-token sequences
(4096) fit in ``--budget-gib`` (1 GiB) of KV cache, from the measured ``nbytes`` (`veloxquant_mlx.apps.eval.memory`)
of the caches the batch holds (two sequences merged into mlx_lm's ``BatchKVCache`` / our batch cache; mlx-lm's
4-bit cache cannot be batched, so its own per-sequence cache).
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import _common

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

# (label, serve arguments): registered methods (`veloxquant methods`); tq-affine-k8v4 is what `enable` uses
COMPRESSED = "tq-affine-k8v4"
DEFAULT_CONFIGS = [
    ("plain kv, batched", ["--preset", "kv"]),
    (f"{COMPRESSED}, batched", ["--preset", COMPRESSED]),
    (f"{COMPRESSED}, one at a time", ["--preset", COMPRESSED, "--no-batching"]),
]
CAPACITY_CACHES = [("plain KVCache (model dtype)", "kv"), ("mlx-lm QuantizedKVCache 4-bit", "mlx-q4"),
                   (f"ours {COMPRESSED}", COMPRESSED), ("ours tq-affine-k4v4", "tq-affine-k4v4")]


def server_configs(presets):
    """(label, serve arguments) per server: the plain batched one first (every ratio's denominator), then each of
    ``presets`` batched, and the default one at a time where it is among them (`DEFAULT_CONFIGS` for the default)."""
    from veloxquant_mlx.apps.eval.specs import preset_names

    known = preset_names()
    bad = [p for p in presets if p not in known or p == "kv"]
    if bad or not presets:
        raise SystemExit(f"--presets: compressed presets from {', '.join(n for n in known if n != 'kv')}; "
                         f"got {','.join(presets)!r}")
    configs = [DEFAULT_CONFIGS[0]] + [(f"{p}, batched", ["--preset", p]) for p in presets]
    if COMPRESSED in presets:
        configs.append(DEFAULT_CONFIGS[2])
    return configs


def capacity_caches(presets):
    """`CAPACITY_CACHES` and any of ``presets`` not among them."""
    have = {m for _, m in CAPACITY_CACHES}
    return CAPACITY_CACHES + [(f"ours {p}", p) for p in presets if p not in have]


def _post(port: int, body: dict, timeout: float):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body)
        conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _serve(serve_args, model, tokenizer, max_tokens):
    from veloxquant_mlx.apps import server as vs

    args = vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--host", "127.0.0.1", "--log-level", "WARNING", "--max-tokens", str(max_tokens)] + serve_args
    )
    return vs.start_server(args, model=model, tokenizer=tokenizer, port=0)  # port 0: a free one


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``veloxquant serve`` in a process of its own (how it is deployed), on a free loopback port.

    What the in-process `ServerHandle` tells the rows (footprint, batching) is measured here the same way, on this
    process's copy of the model; the server's prompt-cache bytes are not visible from outside (None).
    """

    def __init__(self, serve_args, model, model_name: str, max_tokens: int, timeout: float = 300.0):
        from veloxquant_mlx.apps.eval.memory import measure_footprint
        from veloxquant_mlx.apps.eval.specs import resolve_spec
        from veloxquant_mlx.apps.server import probe_batching

        method = serve_args[serve_args.index("--preset") + 1]
        make_cache = resolve_spec(method).make_cache
        self.footprint = measure_footprint(model, make_cache)
        self.batching = (False, "--no-batching") if "--no-batching" in serve_args else probe_batching(model, make_cache)
        self.port = _free_port()
        cmd = [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", model_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "WARNING", "--max-tokens", str(max_tokens)] + list(serve_args)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(serve_args, time.monotonic() + timeout)
        except BaseException:  # not ready, or interrupted: no server process is left behind
            self.close()
            raise

    def _wait_ready(self, serve_args, deadline: float) -> None:
        while True:  # ready once /health answers
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {' '.join(serve_args)} exited with {self.proc.returncode} before serving")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {' '.join(serve_args)} did not answer /health in time")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: veloxquant serve stops cleanly
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _body(i: int, context, max_tokens: int, model: str = "smollm2") -> dict:
    """Request ``i`` to the server of ``model``: its context (one shared string, or request ``i``'s own from a list)
    and a question."""
    text = context if isinstance(context, str) else context[i % len(context)]
    return {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text + QUESTIONS[i % len(QUESTIONS)]}]}


def distinct_contexts(tokenizer, n: int, tokens: int, corpus: str = "debian-reference"):
    """``n`` contexts of ``tokens`` tokens each, consecutive slices of an offline corpus (no shared prefix: each
    conversation holds its own cache), each ending in a blank line."""
    from veloxquant_mlx.apps.eval.corpus import CORPORA

    ids = tokenizer.encode(CORPORA[corpus]())
    if len(ids) < n * tokens:
        raise ValueError(f"--distinct-contexts: the {corpus} text has {len(ids)} tokens, fewer than {n} x {tokens}")
    return [tokenizer.decode(ids[i * tokens: (i + 1) * tokens]) + "\n\n" for i in range(n)]


def peak_rss_mib(pid: int):
    """The process's peak resident memory (VmHWM, Linux), MiB; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_cell(label, handle, n_requests, concurrency, max_tokens, context, deadline, timeout, model="smollm2"):
    """``n_requests`` requests to one running server from ``concurrency`` client threads."""
    results, errors = [], []
    lock = threading.Lock()
    counter = iter(range(n_requests))

    def worker():
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                status, payload = _post(handle.port, _body(i, context, max_tokens, model), timeout)
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
        "concurrency": concurrency,
        "batching": handle.batching[0],
        "requests_ok": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "requests_per_s": len(results) / wall if wall > 0 else 0.0,
        "completion_tokens_per_s": completion / wall if wall > 0 else 0.0,
        "latencies_s": lat,
        "latency_p50_s": statistics.median(lat) if lat else None,
        "latency_p95_s": _p95(lat),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "kv_bytes_per_token": fp["bytes_per_token"],
        "kv_bits_per_coordinate": fp["bits_per_coordinate"],
        "prompt_cache_mib": _prompt_cache_mib(handle),
        "server_peak_rss_mib": peak_rss_mib(handle.proc.pid) if isinstance(handle, ServerProcess) else None,
    }


def _p95(sorted_latencies):
    lat = sorted_latencies
    return lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None


def _prompt_cache_mib(handle):
    if isinstance(handle, ServerProcess):
        return None
    return handle.response_generator.prompt_cache.nbytes / 2**20


def pool(cells):
    """One row per (config, clients) from its cells (one per round): requests and wall time summed, latencies
    pooled, and each round's requests/s over the plain batched server's in the same round (``round_ratios``)."""
    plain = DEFAULT_CONFIGS[0][0]
    by_key = {}
    for c in cells:
        by_key.setdefault((c["config"], c["concurrency"]), []).append(c)
    rows = []
    for (config, level), group in by_key.items():
        wall = sum(c["wall_s"] for c in group)
        ok = sum(c["requests_ok"] for c in group)
        lat = sorted(x for c in group for x in c["latencies_s"])
        base = {c["round"]: c for c in by_key.get((plain, level), [])}
        ratios = [c["requests_per_s"] / base[c["round"]]["requests_per_s"] for c in group
                  if c["round"] in base and base[c["round"]]["requests_per_s"] > 0]
        row = {k: group[0][k] for k in ("config", "concurrency", "batching", "kv_bytes_per_token",
                                         "kv_bits_per_coordinate")}
        row.update({
            "rounds": len(group),
            "requests_ok": ok,
            "errors": sum(c["errors"] for c in group),
            "first_error": next((c["first_error"] for c in group if c["first_error"]), None),
            "wall_s": wall,
            "requests_per_s": ok / wall if wall > 0 else 0.0,
            "completion_tokens_per_s": sum(c["completion_tokens_per_s"] * c["wall_s"] for c in group) / wall
            if wall > 0 else 0.0,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": _p95(lat),
            "prompt_tokens": sum(c["prompt_tokens"] for c in group),
            "cached_prompt_tokens": sum(c["cached_prompt_tokens"] for c in group),
            "prompt_cache_mib": group[-1]["prompt_cache_mib"],
            "server_peak_rss_mib": group[-1].get("server_peak_rss_mib"),
            "round_ratios": ratios,
        })
        rows.append(row)
    return rows


def capacity(model, tokens: int, budget_bytes: float, seed: int = 0, caches=CAPACITY_CACHES):
    """Concurrent ``tokens``-token sequences whose KV caches fit in ``budget_bytes``, per cache kind.

    One layer of two sequences is filled with random keys/values of the model's KV shape, merged the way mlx_lm's
    BatchGenerator merges them, and its ``nbytes`` read (`cache_nbytes`); every layer has that shape.
    """
    import mlx.core as mx

    from veloxquant_mlx.integration.routing import use_packed_attention
    from veloxquant_mlx.apps.eval.memory import cache_nbytes, model_kv_shape
    from veloxquant_mlx.apps.eval.specs import resolve_spec

    n_layers, kv_heads, head_dim = model_kv_shape(model)
    dtype = model.model.embed_tokens.weight.dtype
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, kv_heads, tokens, head_dim), key=k1).astype(dtype)
    values = mx.random.normal((1, kv_heads, tokens, head_dim), key=k2).astype(dtype)
    rows = []
    with use_packed_attention():  # our caches store without decoding (what serving does)
        for label, method in caches:
            layers = [resolve_spec(method).make_cache(model)[0] for _ in range(2)]
            for c in layers:
                mx.eval(c.update_and_fetch(keys, values))
            batchable = hasattr(type(layers[0]), "merge")
            held = type(layers[0]).merge(layers) if batchable else layers
            per_sequence = (cache_nbytes(held) if batchable else sum(cache_nbytes(c) for c in held)) / 2 * n_layers
            rows.append({"cache": label, "batched": batchable, "bytes_per_sequence": per_sequence,
                         "sequences": int(budget_bytes // per_sequence)})
    return rows


def _ratio_range(ratios) -> str:
    if len(ratios) < 2:
        return "-"
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def _table(rows):
    head = ["config", "clients", "batched", "ok/err", "req/s", "vs plain batched", "per round: median [min, max]",
            "tok/s", "p50 s", "p95 s", "cached/prompt tok", "server peak RSS MiB"]
    plain = {r["concurrency"]: r["requests_per_s"] for r in rows if r["config"] == DEFAULT_CONFIGS[0][0]}
    lines = []
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["config"])):
        ratio = r["requests_per_s"] / plain[r["concurrency"]] if plain.get(r["concurrency"]) else float("nan")
        lines.append([r["config"], r["concurrency"], "yes" if r["batching"] else "no",
                      f"{r['requests_ok']}/{r['errors']}", f"{r['requests_per_s']:.2f}", f"{ratio:.2f}x",
                      _ratio_range(r["round_ratios"]), f"{r['completion_tokens_per_s']:.1f}",
                      f"{r['latency_p50_s'] or float('nan'):.2f}", f"{r['latency_p95_s'] or float('nan'):.2f}",
                      f"{r['cached_prompt_tokens']}/{r['prompt_tokens']}",
                      "-" if r.get("server_peak_rss_mib") is None else f"{r['server_peak_rss_mib']:.0f}"])
    return _common.markdown_table(head, lines)


def _capacity_table(rows, tokens: int, budget_gib: float):
    plain = rows[0]
    head = ["KV cache", "batched", f"MiB per {tokens}-token sequence", f"sequences in {budget_gib:g} GiB",
            "sequences vs plain", "bytes vs plain"]
    return _common.markdown_table(head, [
        [r["cache"], "yes" if r["batched"] else "no", f"{r['bytes_per_sequence'] / 2**20:.1f}", r["sequences"],
         f"{r['sequences'] / plain['sequences']:.2f}x",
         f"{plain['bytes_per_sequence'] / r['bytes_per_sequence']:.2f}x smaller"] for r in rows])


def main(argv=None) -> int:
    try:
        from veloxquant_mlx.apps.blas import ensure_openblas

        ensure_openblas()
    except ImportError:
        pass
    p = _common.parser(__doc__, brief=True)
    _common.add_model(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16], help="client threads (levels)")
    p.add_argument("--min-requests", type=int, default=4, help="requests per cell at least (default 4)")
    p.add_argument("--requests-per-client", type=int, default=1, help="requests per client thread (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (default 16)")
    p.add_argument("--context-tokens", type=int, default=400,
                   help="approximate length of the shared context paragraph (default 400)")
    p.add_argument("--distinct-contexts", action="store_true",
                   help="each request its own context of --context-tokens tokens (slices of Debian's reference text: "
                        "no shared prefix, every conversation holds its own cache) instead of one shared paragraph")
    p.add_argument("--only", action="append", default=None,
                   help="run only configurations whose label contains this text (repeatable)")
    p.add_argument("--presets", type=lambda t: [x for x in t.split(",") if x], default=[COMPRESSED],
                   help=f"compressed presets served beside plain batched serving (default {COMPRESSED}, the default; "
                        "e.g. tq-affine-k8v4,tq-4b)")
    p.add_argument("--capacity-tokens", type=int, default=4096, help="sequence length of the memory table")
    p.add_argument("--budget-gib", type=float, default=1.0, help="KV budget of the memory table (GiB)")
    p.add_argument("--rounds", type=int, default=1,
                   help="cells per configuration and level, the servers' order reversed every other round (default 1)")
    p.add_argument("--in-process", action="store_true",
                   help="serve every configuration from threads of this process (sharing one model) instead of one "
                        "`veloxquant serve` process each; measured: servers sharing a process slow each other unevenly")
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long in all")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    _common.add_out(p, help="write the rows as JSON here")
    a = p.parse_args(argv)
    for name in ("min_requests", "requests_per_client", "max_tokens", "capacity_tokens", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(c < 1 for c in a.concurrency) or not a.budget_gib > 0:
        p.error("--concurrency levels must be at least 1 and --budget-gib positive")

    from veloxquant_mlx.apps.models import load_model

    model, tokenizer = load_model(a.model)
    reps = max(1, round(a.context_tokens / max(1, len(tokenizer.encode(CONTEXT)))))
    context = CONTEXT * reps + "\n\n"
    warm_context = context  # (shared: the warm-up leaves the prefix in the prompt cache, as a running server would)
    if a.distinct_contexts:  # one per request of the largest cell (a warm-up shares no prefix with them)
        n_max = max(max(a.min_requests, level * a.requests_per_client) for level in a.concurrency)
        context = distinct_contexts(tokenizer, n_max, a.context_tokens)
        warm_context = CONTEXT  # short: the warm-up leaves no long cache behind
    configs = [c for c in server_configs(a.presets) if not a.only or any(o in c[0] for o in a.only)]
    cap = capacity(model, a.capacity_tokens, a.budget_gib * 2**30,  # first: serving threads own MLX streams
                   caches=capacity_caches(a.presets))
    deadline = time.monotonic() + a.max_seconds
    cells, handles = [], {}
    try:
        for label, serve_args in configs:
            print(f"starting {label} ...", file=sys.stderr, flush=True)
            handles[label] = (_serve(serve_args, model, tokenizer, a.max_tokens) if a.in_process
                              else ServerProcess(serve_args, model, a.model, a.max_tokens))
            run_cell(label, handles[label], 1, 1, a.max_tokens, warm_context, deadline, a.timeout, a.model)  # warm-up
        for level in a.concurrency:
            n = max(a.min_requests, level * a.requests_per_client)
            for r in range(a.rounds):
                for label, _ in (configs if r % 2 == 0 else configs[::-1]):
                    if time.monotonic() >= deadline:
                        print(f"skipped {label} at {level} clients, round {r + 1}: --max-seconds reached",
                              file=sys.stderr)
                        continue
                    print(f"{label}: {n} requests from {level} clients (round {r + 1}/{a.rounds}) ...",
                          file=sys.stderr, flush=True)
                    cell = run_cell(label, handles[label], n, level, a.max_tokens, context, deadline, a.timeout, a.model)
                    cells.append(dict(cell, round=r))
    finally:
        for handle in handles.values():
            handle.close()
    rows = pool(cells)
    print(f"concurrency levels {a.concurrency}, {a.rounds} round(s) of max({a.min_requests}, {a.requests_per_client} "
          f"x clients) requests per cell, {a.max_tokens} completion tokens max, "
          + (f"{len(context)} distinct contexts of ~{a.context_tokens} tokens" if a.distinct_contexts else
             f"shared context ~{len(tokenizer.encode(context))} tokens") + f", model {a.model}")
    print(_table(rows))
    print()
    print(_capacity_table(cap, a.capacity_tokens, a.budget_gib))
    if a.out:
        _common.write_json(a.out, {"load": rows, "cells": cells, "capacity": cap}, indent=2)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
