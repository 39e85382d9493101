"""What ``veloxquant serve`` accepts (`veloxquant_mlx.apps.server_requests`), checked without a server: unknown fields
refused by name, numeric fields refused exactly outside their range, long prompts counted as mlx_lm will tokenize
them, a context the model does not state is no limit, bodies that are not JSON or nest too deep refused. (Each kind
of bad request sent to a running server: test_server_bad_input.py.)"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from veloxquant_mlx.apps import server as vs
from veloxquant_mlx.apps import server_requests


def _user(text):
    return [{"role": "user", "content": text}]


LIMITS = vs.Limits(vocab_size=128, max_context=1024, model_names=("smollm2",))


VALID_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20).filter(
    lambda n: n not in server_requests.CHAT_FIELDS))
def test_unknown_fields_are_refused_by_name(name):
    with pytest.raises(vs.RequestError, match=f"unknown field '{name}'") as err:
        vs.check_request(dict(VALID_CHAT, **{name: 1}), "chat", LIMITS)
    assert err.value.status == 400 and err.value.param == name


@pytest.mark.parametrize("name", sorted(server_requests.CHAT_FIELDS - {"messages"}))
def test_known_fields_are_never_unknown(name):
    """The value 1 fits some known fields and not others; either way the refusal names the field's rule."""
    try:
        vs.check_request(dict(VALID_CHAT, **{name: 1}), "chat", LIMITS)
        refused = None
    except vs.RequestError as e:
        refused = e
    assert refused is None or (refused.param == name and "unknown" not in refused.message), refused


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(server_requests.numeric_rules(LIMITS))),
       st.one_of(st.integers(-10**30, 10**30), st.booleans(), st.floats(), st.text(max_size=4)))
def test_numeric_fields_are_refused_exactly_outside_their_range(name, value):
    kind, low, high = server_requests.numeric_rules(LIMITS)[name]
    inside = not isinstance(value, (bool, str)) and (kind is float or isinstance(value, int)) and (
        value == value and abs(value) != float("inf") and value >= low and (high is None or value <= high))
    if inside:
        checked = vs.check_request(dict(VALID_CHAT, **{name: value}), "chat", LIMITS)[name]
        assert checked == (float(value) if kind is float else value) and type(checked) is kind
    else:
        with pytest.raises(vs.RequestError, match=name) as err:
            vs.check_request(dict(VALID_CHAT, **{name: value}), "chat", LIMITS)
        assert err.value.status == 400 and err.value.param == name


def test_long_prompts_are_counted_as_mlx_lm_will_tokenize_them(smollm2):
    model, tokenizer = smollm2
    limits = vs.Limits(int(model.args.vocab_size), 8192, ("smollm2",), tokenizer=tokenizer)
    fits = {"messages": _user("word " * 2000)}
    raw = json.dumps(fits).encode()
    assert len(raw) * 2 >= limits.max_context  # long enough to be tokenized by the check
    vs.check_prompt_length(raw, fits, limits)  # about 2000 tokens: accepted
    too_long = {"messages": _user("word " * 9000)}
    n = len(tokenizer.apply_chat_template(too_long["messages"], add_generation_prompt=True))
    with pytest.raises(vs.RequestError, match=f"messages: the prompt is {n} tokens; this model's context is 8192") as err:
        vs.check_prompt_length(json.dumps(too_long).encode(), too_long, limits)
    assert (err.value.status, err.value.param) == (400, "messages")
    text = {"prompt": "word " * 9000}
    with pytest.raises(vs.RequestError, match=f"prompt: the prompt is {len(tokenizer.encode(text['prompt']))} tokens"):
        vs.check_prompt_length(json.dumps(text).encode(), text, limits)


def test_undeclared_context_is_not_a_limit():
    from veloxquant_mlx.apps import server as vs

    limits = vs.Limits(vocab_size=128, max_context=1 << 20, model_names=("m",), context_declared=False)
    body = vs.check_request({"prompt": "hi", "max_tokens": 100_000}, "text", limits)
    assert body["max_tokens"] == 100_000


def test_bodies_that_are_not_json_or_nest_too_deep_are_refused_naming_the_body():
    assert server_requests.parse_body(b'{"messages": [{"role": "user", "content": "hi"}]}') == {
        "messages": [{"role": "user", "content": "hi"}]}
    deep_ok = "[" * server_requests.MAX_DEPTH + "]" * server_requests.MAX_DEPTH
    assert server_requests.parse_body(deep_ok.encode()) == json.loads(deep_ok)
    for raw, words in ((b"{not json", "is not valid JSON"), (b'{"a": "\xff"}', "is not valid JSON"),
                       (("[" * (server_requests.MAX_DEPTH + 1) + "]" * (server_requests.MAX_DEPTH + 1)).encode(),
                        f"nests deeper than {server_requests.MAX_DEPTH} levels"),
                       (b"[" * 100000 + b"]" * 100000, "nests deeper")):
        with pytest.raises(server_requests.RequestError) as e:
            server_requests.parse_body(raw)
        assert (e.value.status, e.value.param) == (400, "body") and words in e.value.message, e.value.message


@pytest.mark.parametrize("value, kind, low, high, problem", [
    (3, int, 1, None, None), (3.5, float, 0, 2, "must be a finite value in [0, 2]"), (True, int, 0, 9, "an integer"),
    (2.0, int, 0, 9, "must be an integer"), ("1", float, 0, 1, "must be a number"), (float("nan"), float, 0, None,
    "must be a finite value in [0, inf]"), (float("inf"), float, None, None, "finite"), (-1, int, 0, None, "[0, inf]"),
])
def test_range_error_says_why_a_value_is_out(value, kind, low, high, problem):
    got = server_requests.range_error(value, kind, low, high)
    assert got is None if problem is None else problem in got, got
