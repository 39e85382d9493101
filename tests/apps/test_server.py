"""`veloxquant serve`: mlx_lm.server with our compressed KV caches, talked to through the openai client.

Fast tests use conftest's tiny random llama model; the server tests serve the embedded SmolLM2-135M with the
registered ``tq-mse-k4v4`` caches on 127.0.0.1 (port 0: the OS picks a free one), count that attention ran on
the codes (``TurboQuantPackedCache.attend_packed``) and forbid the decoding fetch while routing is on.
"""
from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from mlx_lm import stream_generate
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import trim_prompt_cache

from veloxquant_mlx.apps import cli
from veloxquant_mlx.apps import server as vs
from veloxquant_mlx.attention import hook
import veloxquant_mlx as vq
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.apps.eval.specs import preset_names, resolve_spec
from veloxquant_mlx.cache.presets import DEFAULT_NAME

openai = pytest.importorskip("openai", reason="the `test` extra's openai client talks to the server as users do")

METHOD = "tq-mse-k4v4"
MAX_TOKENS = 7  # "The capital of France is Paris." is 7 tokens


def _parse(*argv):
    return vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture
def serve():
    """``serve(model, tokenizer, *argv)`` starts a server on a free loopback port; all are closed afterwards."""
    handles = []

    def start(model, tokenizer, *argv):
        args = _parse("--preset", METHOD, "--max-tokens", "64", *argv)
        handles.append(vs.start_server(args, model=model, tokenizer=tokenizer, port=0))
        return handles[-1]

    yield start
    for handle in handles:
        handle.close()


@pytest.fixture
def on_codes(monkeypatch):
    """Counts ``attend_packed`` calls; the decoding ``_fetch`` raises while the attention hook routes."""
    calls, fetches = [], []
    attend, fetch = TurboQuantPackedCache.attend_packed, TurboQuantPackedCache._fetch
    attend_batch = TurboQuantBatchPackedCache.attend_packed

    def counted(self, *args, **kwargs):
        calls.append(1)
        return attend(self, *args, **kwargs)

    def counted_batch(self, *args, **kwargs):
        calls.append(self.B)  # a batched forward pass attends for every sequence in it
        return attend_batch(self, *args, **kwargs)

    def forbidden(self, dtype):
        if hook.is_active():
            fetches.append(1)
            raise AssertionError("the compressed history was decoded while attention on the codes is on")
        return fetch(self, dtype)

    monkeypatch.setattr(TurboQuantPackedCache, "attend_packed", counted)
    monkeypatch.setattr(TurboQuantBatchPackedCache, "attend_packed", counted_batch)
    monkeypatch.setattr(TurboQuantPackedCache, "_fetch", forbidden)
    yield calls
    assert not fetches


def _client(handle):
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def _ask(client, messages, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0.0, **kw)


def _user(text):
    return [{"role": "user", "content": text}]


def _library_generate(model, tokenizer, prompt, cache):
    """mlx_lm's own greedy generation on ``cache``: (text, generated token ids)."""
    pieces = list(stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, prompt_cache=cache))
    return "".join(g.text for g in pieces), [g.token for g in pieces]


# ------------------------------------------------------------------------------------- arguments (no server)
def test_arguments_take_registered_presets_and_mlx_lm_defaults():
    args = _parse()
    assert (args.model, args.preset, args.host, args.port, args.max_tokens) == (
        "smollm2", DEFAULT_NAME, "127.0.0.1", 8080, 512)  # the one default (tests/integration/test_enabling_one_default.py)
    assert (args.temp, args.top_p, args.top_k, args.prompt_cache_size, args.allowed_origins) == (0.0, 1.0, 0, 10, ["*"])
    for name in preset_names():  # every registered name is offered; families need --bits
        assert _parse("--preset", name).preset == name
    for argv in (["--preset", "nope"], ["--method", "nope"], ["--kv-bits", "4"], ["--port", "70000"]):
        with pytest.raises(SystemExit):
            _parse(*argv)


@pytest.mark.parametrize("argv, named", [
    (["--port", "70000"], "--port"), (["--port", "0"], "--port"), (["--port", "-1"], "--port"),
    (["--port", "http"], "--port"), (["--temp", "nan"], "--temp"), (["--top-p", "2"], "--top-p"),
    (["--max-tokens", "0"], "--max-tokens"), (["--preset", "zip"], "--preset"), (["--method", "zip"], "--method"),
    (["--preset", "turboquant_mse"], "--bits"), (["--preset", "turboquant_mse", "--bits", "5"], "bits"),
])
def test_bad_cli_values_fail_before_the_model_loads(argv, named, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(vs, "load_model", no_load)
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_footprint_is_what_veloxquant_methods_reports(tiny_model):
    n_layers, kv_heads, head_dim = 2, 1, 64  # conftest's tiny model
    rows = {spec.name: m for spec, m in cli.measure._measured(head_dim, kv_heads)}
    for name in ("kv", "mlx-q4", METHOD):
        fp = vs.measure_footprint(tiny_model, resolve_spec(name).make_cache)
        assert fp["layers"] == n_layers
        assert fp["bytes_per_token_per_layer"] == rows[name]["bytes_per_token_per_layer"]
        assert fp["bits_per_coordinate"] == rows[name]["bits_per_coordinate"]
        assert fp["bytes_per_token"] == n_layers * rows[name]["bytes_per_token_per_layer"]
        assert fp["plain_bytes_per_token"] == n_layers * rows["kv"]["bytes_per_token_per_layer"]
    assert rows["kv"]["bits_per_coordinate"] == 32.0  # float32 keys and values
    # 4-bit codes with one norm per vector store less than mlx_lm's 4-bit groups with a scale and a bias each
    assert rows[METHOD]["bits_per_coordinate"] < rows["mlx-q4"]["bits_per_coordinate"]


def test_batching_probe_tries_merge(tiny_model):
    ok, reason = vs.probe_batching(tiny_model, resolve_spec("kv").make_cache)
    assert ok, reason
    ok, reason = vs.probe_batching(tiny_model, resolve_spec("mlx-q4").make_cache)
    assert not ok and reason.startswith("QuantizedKVCache.merge")  # mlx_lm's quantized cache has none
    ok, reason = vs.probe_batching(tiny_model, resolve_spec(METHOD).make_cache)  # ours merge into a batch cache
    assert ok and "TurboQuantBatchPackedCache" in reason, reason
    ok, reason = vs.probe_batching(tiny_model, lambda m: vq.make_prompt_cache(m, k_bits=4, recent=4))  # windows too
    assert ok and "TurboQuantBatchPackedCache" in reason, reason
    ok, reason = vs.probe_batching(tiny_model, lambda m: vq.make_prompt_cache(m, kind="rvq", k_bits=2))
    assert not ok and reason.startswith("TurboQuantRVQKVCache.merge"), reason  # the seed page's RVQ cache


# ------------------------------------------------------------------------------------------ running servers
def test_server_lifetime_installs_then_removes_the_attention_hook(serve, tiny_model, caplog):
    original = mlx_base.scaled_dot_product_attention
    with caplog.at_level("INFO", logger="veloxquant_mlx.apps.server"):
        handle = serve(tiny_model, None)
    log = caplog.text
    assert f"KV cache: {METHOD} (" in log
    fp = handle.footprint
    assert f"{fp['bits_per_coordinate']:.2f} bits/coordinate" in log and f"{fp['bytes_per_token']:.0f} bytes/token" in log
    assert "concurrent requests: batched (the caches merge into batch caches (TurboQuantBatchPackedCache" in log
    assert handle.batching[0] is True
    assert hook.is_active() and mlx_base.scaled_dot_product_attention is not original
    handle.close()
    assert not hook.is_active() and mlx_base.scaled_dot_product_attention is original
    assert not handle.response_generator.generation_available()


def test_server_takes_a_calibration_of_its_model_only(serve, tiny_model, random_tokens, tmp_path, caplog):
    cal = vq.calibrate(tiny_model, random_tokens[:200])
    path = str(tmp_path / "cal.safetensors")
    cal.save(path)
    with caplog.at_level("INFO", logger="veloxquant_mlx.apps.server"):
        handle = serve(tiny_model, None, "--calibration", path)
    assert f"calibration {cal.id}" in caplog.text and handle.batching[0] is True
    handle.close()
    other = vq.calibrate(tiny_model, random_tokens[:200])
    object.__setattr__(other, "model", {**other.model, "digest": "0" * 32})
    bad = str(tmp_path / "other.safetensors")
    other.save(bad)
    with pytest.raises(ValueError, match="other.safetensors.*was measured on"):
        serve(tiny_model, None, "--calibration", bad)


def test_answers_and_prompt_cache_reuse_match_the_library(serve, smollm2, on_codes):
    """Greedy answers equal mlx_lm's generation on the same compressed caches: a first request and a
    follow-up turn that continues the first turn's cached compressed history."""
    model, tokenizer = smollm2
    handle = serve(model, tokenizer)
    client = _client(handle)
    first = _user("What is the capital of France?")
    prompt1 = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    ref_cache = resolve_spec(METHOD).make_cache(model)
    ref1, gen1 = _library_generate(model, tokenizer, prompt1, ref_cache)
    assert "Paris" in ref1

    before = sum(on_codes)
    r1 = _ask(client, first)
    assert r1.choices[0].message.content == ref1 and r1.model == "smollm2"
    assert (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (len(prompt1), len(gen1))
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    # attention on the codes: every layer, every forward pass (one per generated token at least)
    assert sum(on_codes) - before >= len(model.layers) * r1.usage.completion_tokens

    second = first + [{"role": "assistant", "content": ref1}, {"role": "user", "content": "And of Germany?"}]
    r2 = _ask(client, second)
    prompt2 = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert len(prompt1) <= cached < len(prompt2) == r2.usage.prompt_tokens
    trim_prompt_cache(ref_cache, ref_cache[0].offset - cached)  # the library, from the same point
    ref2, gen2 = _library_generate(model, tokenizer, prompt2[cached:], ref_cache)
    assert r2.choices[0].message.content == ref2 and "Berlin" in ref2

    # what the server keeps for reuse is our compressed cache, one per layer
    kept, rest = handle.response_generator.prompt_cache.fetch_nearest_cache(
        handle.response_generator.model_provider.model_key, prompt2 + gen2)
    assert len(kept) == len(model.layers) and all(type(c) is TurboQuantPackedCache for c in kept)
    assert len(rest) < len(gen2)


CAPITALS = {"France": "Paris", "Japan": "Tokyo"}  # SmolLM2-135M knows these (with the plain cache too)


def test_concurrent_requests_are_answered_correctly(serve, smollm2, on_codes):
    """Three requests at once, one of them streamed: each gets its own answer (batched: mlx_lm's BatchGenerator
    over `TurboQuantBatchPackedCache`).

    Served with the k8v4 block configuration: a batched forward pass differs from a single one in the last
    float bits (batched matmuls, plain caches too), and SmolLM2 with 4-bit Lloyd-Max codes amplifies that into
    another answer ("L'Étoile, la" for France, measured); tests/cache/test_batch_cache.py compares batched to alone."""
    handle = serve(*smollm2, "--preset", "tq-affine-k8v4")
    client = _client(handle)
    jobs = [(0, "France", False), (1, "Japan", False), (2, "France", True)]
    answers, errors = {}, []

    def ask(i, country, stream):
        try:
            reply = _ask(client, _user(f"What is the capital of {country}?"), stream=stream,
                         **({"stream_options": {"include_usage": True}} if stream else {}))
            if stream:
                chunks = list(reply)
                pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
                assert len(pieces) > 1 and 0 < chunks[-1].usage.completion_tokens <= MAX_TOKENS, chunks
                answers[i] = "".join(pieces)
            else:
                answers[i] = reply.choices[0].message.content
        except Exception as e:  # collected: a thread cannot fail the test itself
            errors.append((country, e))

    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(answers) == len(jobs), errors
    for i, country, _ in jobs:
        assert CAPITALS[country] in answers[i], (country, answers[i])
    assert answers[0] == answers[2]  # the streamed answer is the same greedy text
    assert sum(on_codes) >= len(jobs) * len(smollm2[0].layers)
    assert max(on_codes) >= 2  # some forward pass attended for several requests at once (batched)
    assert handle.response_generator.is_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_veloxquant_serve_command_logs_answers_and_stops_cleanly(smollm2):
    """``veloxquant serve`` in its own process: start-up log, one answer, a clean stop on SIGINT."""
    cmd = [sys.executable, "-m", "veloxquant_mlx", "serve", "--port", str(_free_port()), "--preset", METHOD,
           "--max-tokens", str(MAX_TOKENS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, url = [], None
    try:
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                url = line.split("listening on ", 1)[1].split()[0]
        log = "".join(lines)
        assert url, log
        assert f"KV cache: {METHOD} (turboquant_mse" in log and "bits/coordinate" in log and "bytes/token" in log
        assert "concurrent requests: batched" in log
        answer = _ask(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
                      _user("What is the capital of France?"))
        assert "Paris" in answer.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "veloxquant serve: stopped" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
