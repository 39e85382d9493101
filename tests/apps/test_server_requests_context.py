"""A request's prompt and the tokens it asks for must fit the model's context (issue 57's bad input: the server
accepted a ``max_tokens`` past what the prompt leaves of the context). `check_prompt_length` refuses an explicit
budget that does not fit with a 400 naming both counts, cuts the server's default budget to what is left, and
leaves a model that declares no context alone."""
from __future__ import annotations

import json

import pytest

from veloxquant_mlx.apps.server_requests import Limits, RequestError, check_prompt_length


class WordTokenizer:
    """One token per word; no chat template (messages are joined as mlx_lm does without one)."""
    has_chat_template = False

    def encode(self, text: str):
        return text.split()


def _limits(context: int = 100, default=None, declared: bool = True) -> Limits:
    return Limits(vocab_size=1000, max_context=context, model_names=("m",), tokenizer=WordTokenizer(),
                  context_declared=declared, default_max_tokens=default)


def _check(body: dict, limits: Limits) -> dict:
    check_prompt_length(json.dumps(body).encode(), body, limits)
    return body


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_an_explicit_budget_past_what_the_prompt_leaves_is_refused_naming_both_counts(name):
    body = {"prompt": "w " * 30, name: 80}
    with pytest.raises(RequestError) as e:
        _check(body, _limits())
    assert e.value.status == 400 and e.value.param == name
    assert f"the prompt is 30 tokens and {name} asks for 80 more" in str(e.value)
    assert f"so {name} can be at most 70" in str(e.value)


def test_an_explicit_budget_that_fits_passes_unchanged():
    body = _check({"prompt": "w " * 30, "max_tokens": 70}, _limits())
    assert body["max_tokens"] == 70


def test_the_default_budget_is_cut_to_what_the_prompt_leaves():
    body = _check({"prompt": "w " * 30}, _limits(default=512))
    assert body["max_tokens"] == 70
    short = _check({"prompt": "w " * 3}, _limits(context=10_000, default=512))
    assert "max_tokens" not in short  # fits: the server's default applies as it is


def test_chat_messages_count_too():
    body = {"messages": [{"role": "user", "content": "w " * 40}], "max_tokens": 61}
    with pytest.raises(RequestError, match="the prompt is 42 tokens .* at most 58"):  # + "USER:", "ASSISTANT:"
        _check(body, _limits())


def test_a_prompt_of_the_whole_context_is_refused_before_the_budget():
    with pytest.raises(RequestError, match="the prompt is 100 tokens; this model's context is 100"):
        _check({"prompt": "w " * 100, "max_tokens": 1}, _limits())


def test_a_model_without_a_declared_context_is_not_limited_by_the_budget():
    body = _check({"prompt": "w " * 30, "max_tokens": 500}, _limits(declared=False, default=512))
    assert body["max_tokens"] == 500
