"""Bad input never kills `veloxquant serve` nor drops a connection (issue 15).

One server for the module (SmolLM2-135M, ``tq-mse-k4v4`` caches, 127.0.0.1, a port the OS picks) gets each kind
of bad request below: every answer is a JSON ``{"error": {"message", "param"}}`` with the right status whose
message names what is wrong. Then a good request is answered and the server is alive and healthy.
"""
from __future__ import annotations

import argparse
import http.client
import json

import pytest

from veloxquant_mlx.apps import server as vs

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
OK = [{"role": "user", "content": "hi"}]
VOCAB = 49152  # SmolLM2-135M
NO_LENGTH = object()  # send a POST without a Content-Length header


def chat(**fields):
    return dict({"messages": OK}, **fields)


def user(content):
    return {"messages": [{"role": "user", "content": content}]}


def nested(depth):
    return json.loads("[" * depth + "]" * depth)


# (id, method, path, body, headers, status, param, what the message must name)
CASES = [
    ("invalid-json", "POST", CHAT, "{not json", None, 400, "body", "JSON"),
    ("not-utf8", "POST", CHAT, b'{"messages": "\xff"}', None, 400, "body", "JSON"),
    ("array-body", "POST", CHAT, "[1, 2, 3]", None, 400, "body", "object"),
    ("nested-100000-deep", "POST", CHAT, "[" * 100000 + "]" * 100000, None, 400, "body", "nests deeper"),
    ("nested-100-deep-field", "POST", CHAT, chat(metadata=nested(100)), None, 400, "body", "nests deeper"),
    ("huge-integer", "POST", CHAT, '{"seed": ' + "9" * 5000 + "}", None, 400, "body", "JSON"),
    ("no-content-length", "POST", CHAT, NO_LENGTH, None, 411, "Content-Length", "Content-Length"),
    ("content-length-text", "POST", CHAT, None, {"Content-Length": "abc"}, 400, "Content-Length", "Content-Length"),
    ("content-length-huge", "POST", CHAT, None, {"Content-Length": str(10**9)}, 413, "Content-Length",
     "--max-body-bytes"),
    ("put", "PUT", CHAT, chat(), None, 405, None, "PUT"),
    ("delete", "DELETE", CHAT, None, None, 405, None, "DELETE"),
    ("patch", "PATCH", CHAT, chat(), None, 405, None, "PATCH"),
    ("unknown-method", "BREW", CHAT, None, None, 501, None, "BREW"),
    ("post-unknown-path", "POST", "/v1/nowhere", chat(), None, 404, None, "/v1/nowhere"),
    ("get-unknown-path", "GET", "/v1/nowhere", None, None, 404, None, "/v1/nowhere"),
    ("unknown-field", "POST", CHAT, chat(bogus_field=1), None, 400, "bogus_field", "bogus_field"),
    ("draft-model-field", "POST", CHAT, chat(draft_model="x"), None, 400, "draft_model", "draft_model"),
    ("model-not-served", "POST", CHAT, chat(model="gpt-17"), None, 404, "model", "gpt-17"),
    ("model-not-string", "POST", CHAT, chat(model=5), None, 400, "model", "model"),
    ("messages-missing", "POST", CHAT, {}, None, 400, "messages", "messages"),
    ("messages-empty", "POST", CHAT, {"messages": []}, None, 400, "messages", "messages"),
    ("messages-string", "POST", CHAT, {"messages": "hi"}, None, 400, "messages", "messages"),
    ("message-not-object", "POST", CHAT, {"messages": [5]}, None, 400, "messages[0]", "messages[0]"),
    ("role-unknown", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400,
     "messages[0].role", "messages[0].role"),
    ("content-number", "POST", CHAT, user(42), None, 400, "messages[0].content", "messages[0].content"),
    ("content-null-user", "POST", CHAT, {"messages": [{"role": "user", "content": None}]}, None, 400,
     "messages[0].content", "messages[0].content"),
    ("image-part-to-text-model", "POST", CHAT,
     user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]), None, 400,
     "messages[0].content[0]", "image"),
    ("audio-part", "POST", CHAT, user([{"type": "input_audio", "input_audio": {"data": ""}}]), None, 400,
     "messages[0].content[0]", "messages[0].content[0]"),
    ("text-part-without-text", "POST", CHAT, user([{"type": "text"}]), None, 400, "messages[0].content[0]",
     "messages[0].content[0]"),
    ("tool-call-arguments-not-json", "POST", CHAT, {"messages": OK + [{"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, None, 400,
     "messages[1].tool_calls", "messages[1].tool_calls"),
    ("max-tokens-huge", "POST", CHAT, chat(max_tokens=10**9), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-bool", "POST", CHAT, chat(max_tokens=True), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-text", "POST", CHAT, chat(max_tokens="many"), None, 400, "max_tokens", "max_tokens"),
    ("max-tokens-fraction", "POST", CHAT, chat(max_tokens=5.5), None, 400, "max_tokens", "max_tokens"),
    ("max-completion-tokens-negative", "POST", CHAT, chat(max_completion_tokens=-1), None, 400,
     "max_completion_tokens", "max_completion_tokens"),
    ("temperature-nan", "POST", CHAT, chat(temperature=float("nan")), None, 400, "temperature", "temperature"),
    ("temperature-inf", "POST", CHAT, chat(temperature=float("inf")), None, 400, "temperature", "temperature"),
    ("temperature-400-digit-integer", "POST", CHAT, '{"messages": [{"role": "user", "content": "hi"}], '
     '"temperature": 1' + "0" * 400 + "}", None, 400, "temperature", "temperature"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1), None, 400, "temperature", "temperature"),
    ("temperature-text", "POST", CHAT, chat(temperature="hot"), None, 400, "temperature", "temperature"),
    ("top-p-above-one", "POST", CHAT, chat(top_p=7), None, 400, "top_p", "top_p"),
    ("top-p-nan", "POST", CHAT, chat(top_p=float("nan")), None, 400, "top_p", "top_p"),
    ("min-p-negative", "POST", CHAT, chat(min_p=-0.1), None, 400, "min_p", "min_p"),
    ("top-k-negative", "POST", CHAT, chat(top_k=-1), None, 400, "top_k", "top_k"),
    ("top-k-past-vocabulary", "POST", CHAT, chat(top_k=VOCAB + 1), None, 400, "top_k", "top_k"),
    ("seed-2**70", "POST", CHAT, chat(seed=2**70), None, 400, "seed", "seed"),
    ("seed-negative", "POST", CHAT, chat(seed=-1), None, 400, "seed", "seed"),
    ("seed-fraction", "POST", CHAT, chat(seed=1.5), None, 400, "seed", "seed"),
    ("logit-bias-past-vocabulary", "POST", CHAT, chat(logit_bias={"999999999": 5}), None, 400, "logit_bias",
     "logit_bias"),
    ("logit-bias-vocabulary-size", "POST", CHAT, chat(logit_bias={str(VOCAB): 5}), None, 400, "logit_bias",
     "logit_bias"),
    ("logit-bias-negative-id", "POST", CHAT, chat(logit_bias={"-1": 1}), None, 400, "logit_bias", "logit_bias"),
    ("logit-bias-not-an-id", "POST", CHAT, chat(logit_bias={"abc": 1}), None, 400, "logit_bias", "logit_bias"),
    ("logit-bias-5000-digit-id", "POST", CHAT, chat(logit_bias={"9" * 5000: 1}), None, 400, "logit_bias",
     "logit_bias"),
    ("logit-bias-huge-bias", "POST", CHAT, chat(logit_bias={"5": 1000}), None, 400, "logit_bias", "logit_bias"),
    ("logit-bias-nan-bias", "POST", CHAT, chat(logit_bias={"5": float("nan")}), None, 400, "logit_bias",
     "logit_bias"),
    ("logit-bias-list", "POST", CHAT, chat(logit_bias=[1, 2]), None, 400, "logit_bias", "logit_bias"),
    ("repetition-penalty-negative", "POST", CHAT, chat(repetition_penalty=-1), None, 400, "repetition_penalty",
     "repetition_penalty"),
    ("repetition-penalty-inf", "POST", CHAT, chat(repetition_penalty=float("inf")), None, 400,
     "repetition_penalty", "repetition_penalty"),
    ("repetition-context-negative", "POST", CHAT, chat(repetition_context_size=-1), None, 400,
     "repetition_context_size", "repetition_context_size"),
    ("repetition-context-10**30", "POST", CHAT, chat(repetition_context_size=10**30), None, 400,
     "repetition_context_size", "repetition_context_size"),
    ("presence-penalty-5", "POST", CHAT, chat(presence_penalty=5), None, 400, "presence_penalty", "presence_penalty"),
    ("presence-context-text", "POST", CHAT, chat(presence_context_size="x"), None, 400, "presence_context_size",
     "presence_context_size"),
    ("frequency-penalty-nan", "POST", CHAT, chat(frequency_penalty=float("nan")), None, 400, "frequency_penalty",
     "frequency_penalty"),
    ("frequency-context-bool", "POST", CHAT, chat(frequency_context_size=True), None, 400, "frequency_context_size",
     "frequency_context_size"),
    ("xtc-probability-2", "POST", CHAT, chat(xtc_probability=2), None, 400, "xtc_probability", "xtc_probability"),
    ("xtc-threshold-negative", "POST", CHAT, chat(xtc_threshold=-1), None, 400, "xtc_threshold", "xtc_threshold"),
    ("logprobs-text", "POST", CHAT, chat(logprobs="yes"), None, 400, "logprobs", "logprobs"),
    ("top-logprobs-50", "POST", CHAT, chat(top_logprobs=50), None, 400, "top_logprobs", "top_logprobs"),
    ("top-logprobs-minus-2", "POST", CHAT, chat(top_logprobs=-2), None, 400, "top_logprobs", "top_logprobs"),
    ("stream-text", "POST", CHAT, chat(stream="yes"), None, 400, "stream", "stream"),
    ("stream-options-text", "POST", CHAT, chat(stream=True, stream_options="x"), None, 400, "stream_options",
     "stream_options"),
    ("stream-options-without-include-usage", "POST", CHAT, chat(stream=True, stream_options={}), None, 400,
     "stream_options", "stream_options"),
    ("stop-number", "POST", CHAT, chat(stop=5), None, 400, "stop", "stop"),
    ("stop-empty-string", "POST", CHAT, chat(stop=[""]), None, 400, "stop", "stop"),
    ("stop-mixed-list", "POST", CHAT, chat(stop=["a", 3]), None, 400, "stop", "stop"),
    ("n-3", "POST", CHAT, chat(n=3), None, 400, "n", "n must be 1"),
    ("tools-text", "POST", CHAT, chat(tools="x"), None, 400, "tools", "tools"),
    ("tools-without-function", "POST", CHAT, chat(tools=[{"type": "function"}]), None, 400, "tools", "tools"),
    ("chat-template-kwargs-list", "POST", CHAT, chat(chat_template_kwargs=[]), None, 400, "chat_template_kwargs",
     "chat_template_kwargs"),
    ("chat-template-kwargs-tokenize", "POST", CHAT, chat(chat_template_kwargs={"tokenize": False}), None, 400,
     "chat_template_kwargs", "chat_template_kwargs"),
    ("role-mapping-number", "POST", CHAT, chat(role_mapping={"user": 5}), None, 400, "role_mapping",
     "role_mapping"),
    ("messages-past-the-context", "POST", CHAT, user("word " * 9000), None, 400, "messages", "8192"),
    ("prompt-past-the-context", "POST", TEXT, {"prompt": "word " * 9000}, None, 400, "prompt", "8192"),
    ("prompt-list", "POST", TEXT, {"prompt": ["a", "b"]}, None, 400, "prompt", "prompt"),
    ("prompt-empty", "POST", TEXT, {"prompt": ""}, None, 400, "prompt", "prompt"),
    ("prompt-missing", "POST", TEXT, {}, None, 400, "prompt", "prompt"),
    ("messages-on-completions", "POST", TEXT, {"prompt": "a", "messages": OK}, None, 400, "messages", "messages"),
]
assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    args = vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(["--preset", "tq-mse-k4v4", "--max-tokens", "7"])
    handle = vs.start_server(args, model=model, tokenizer=tokenizer, port=0)
    try:
        yield handle
    finally:
        handle.close()


def send(port, method, path, body=None, headers=None):
    """(status, Content-Type, decoded JSON or raw bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        if body is NO_LENGTH:
            conn.putrequest(method, path)
            conn.putheader("Content-Type", "application/json")
            conn.endheaders()
        else:
            data = json.dumps(body) if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, resp.getheader("Content-Type"), json.loads(raw)
        except ValueError:
            return resp.status, resp.getheader("Content-Type"), raw
    finally:
        conn.close()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_json_error_naming_the_field(server, case):
    _, method, path, body, headers, status, param, named = case
    got, content_type, payload = send(server.port, method, path, body, headers)
    assert (got, content_type) == (status, "application/json"), payload
    error = payload["error"]
    assert error["param"] == param and named in error["message"], error


def test_still_answering_and_healthy_after_every_bad_request(server):
    for name, method, path, body, headers, status, _, _ in CASES:  # all of them again, back to back
        assert send(server.port, method, path, body, headers)[0] == status, name
    status, _, payload = send(server.port, "POST", CHAT, {"messages": [
        {"role": "user", "content": "What is the capital of France?"}], "temperature": 0})
    assert status == 200 and "Paris" in payload["choices"][0]["message"]["content"], payload
    assert send(server.port, "GET", "/health")[::2] == (200, {"status": "ok"})
    assert server.thread.is_alive() and server.response_generator.is_healthy
