"""What ``veloxquant serve`` accepts: a request body checked field by field before mlx_lm's server reads it, so
that a bad request gets OpenAI's JSON error naming the field instead of a crash in a handler thread or a dead
server (`check_request`, `check_prompt_length`), and the range rule its command-line options share."""
from __future__ import annotations

import copy
import json
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from mlx_lm.server import convert_chat, process_message_content

def range_error(value: Any, kind: type, low=None, high=None) -> Optional[str]:
    """Why ``value`` is not a finite ``kind`` (int or float; a bool is neither) in [low, high], or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return f"must be {'a number' if kind is float else 'an integer'}"
    inside = (not isinstance(value, float) or math.isfinite(value)) and (low is None or value >= low) and (
        high is None or value <= high)
    return None if inside else f"must be a finite value in [{low}, {'inf' if high is None else high}]"


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _fail(message: str, param: Optional[str] = None, status: int = 400):
    raise RequestError(status, message, param)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    model_names: Tuple[str, ...]
    max_body_bytes: int = 8 << 20
    tokenizer: Any = None  # a private copy: handler threads count long prompts with it, under the lock
    lock: Any = field(default_factory=threading.Lock)
    context_declared: bool = True  # False: max_context is only a sanity bound (the model states no context)
    default_max_tokens: Optional[int] = None  # what a request without max_tokens gets (the server's --max-tokens)


MAX_DEPTH = 64  # JSON nesting; deeper bodies are refused before anything recurses over them
ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PARTS = ("image_url", "input_image", "image")  # the part types mlx_lm.server reads as images
# apply_chat_template's own parameters: one of them among chat_template_kwargs breaks mlx_lm's call
TEMPLATE_PARAMETERS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors"})
_COMMON_FIELDS = frozenset({  # mlx_lm's, and (last line) OpenAI fields that change nothing here
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "stop", "seed", "logprobs", "top_logprobs", "logit_bias", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size", "xtc_probability",
    "xtc_threshold", "n", "user", "metadata", "store", "service_tier"})
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "role_mapping",
                                "chat_template_kwargs"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}


def _is_function(x) -> bool:
    return isinstance(x, dict) and isinstance(x.get("function"), dict) and isinstance(x["function"].get("name"), str)


# field -> (test, what the field must be): structure mlx_lm reads without checking
_SHAPES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    **dict.fromkeys(("stream", "logprobs"), (lambda v: isinstance(v, bool), "true or false")),
    "n": (lambda v: v == 1 and not isinstance(v, bool), "1 (one choice per request)"),
    "stop": (lambda v: isinstance(v, str) and v != "" or isinstance(v, list) and all(
        isinstance(s, str) and s for s in v), "a non-empty string or a list of them"),
    "stream_options": (lambda v: isinstance(v, dict) and isinstance(v.get("include_usage"), bool),  # mlx_lm reads it
                       "{'include_usage': true|false}"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object of token id -> bias"),
    "tools": (lambda v: isinstance(v, list) and all(_is_function(t) for t in v),
              "a list of {'type': 'function', 'function': {'name': <string>, ...}}"),
    "role_mapping": (lambda v: isinstance(v, dict) and all(isinstance(s, str) for s in v.values()),
                     "an object of strings"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict) and not set(v) & TEMPLATE_PARAMETERS,
                             f"an object of template variables, none of {sorted(TEMPLATE_PARAMETERS)}"),
    "prompt": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "messages": (lambda v: isinstance(v, list) and v != [], "a non-empty list of {role, content} objects"),
}


def numeric_rules(limits: Limits) -> Dict[str, Tuple[type, Any, Any]]:
    """field -> (kind, low, high) of what reaches mlx_lm's sampler, logits processors and ``mx.random``: mlx_lm
    lets NaN, inf, bools, huge counts through to native code and answers ``{"error": text}`` (no param)."""
    ctx, vocab = limits.max_context, limits.vocab_size
    rules = {("max_tokens", "max_completion_tokens"): (int, 1, ctx - 1), ("top_k",): (int, 0, vocab),
             ("repetition_context_size", "presence_context_size", "frequency_context_size"): (int, 0, ctx),
             ("temperature", "repetition_penalty"): (float, 0, sys.float_info.max),  # a larger int is no float
             ("top_p", "min_p", "xtc_probability", "xtc_threshold"): (float, 0, 1),
             ("presence_penalty", "frequency_penalty"): (float, -2, 2),  # OpenAI's range
             ("top_logprobs",): (int, -1, 11),  # mlx_lm's range, -1: off
             ("seed",): (int, 0, 2**64 - 1)}  # mx.random.seed takes a uint64
    return {name: rule for names, rule in rules.items() for name in names}


def _number(name: str, value: Any, kind: type, low, high):
    """``value`` as ``kind`` (float as float: mlx_lm's xtc checks take no int), or a RequestError naming ``name``."""
    problem = range_error(value, kind, low, high)
    if problem:
        _fail(f"{name} {problem}, got {_show(value)}", name)
    return float(value) if kind is float else value


def parse_body(raw: bytes) -> Any:
    too_deep = f"the request body nests deeper than {MAX_DEPTH} levels"
    try:
        body = json.loads(raw)
    except RecursionError:
        _fail(too_deep, "body")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        _fail(f"the request body is not valid JSON: {str(e)[:200]}", "body")
    level = [body] if isinstance(body, (dict, list)) else []
    for _ in range(MAX_DEPTH):  # breadth first: nothing recurses over what the client sent
        level = [v for o in level for v in (o.values() if isinstance(o, dict) else o) if isinstance(v, (dict, list))]
    if level:
        _fail(too_deep, "body")
    return body


def _check_message(where: str, message: Any) -> None:
    """One chat message: what mlx_lm's chat-template step and its tool-call parsing would fail on."""
    if not isinstance(message, dict):
        _fail(f"{where} must be an object with 'role' and 'content', got {_show(message)}", where)
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    if role not in ROLES:
        _fail(f"{where}.role must be one of {', '.join(ROLES)}; got {_show(role)}", f"{where}.role")
    if calls is not None and not (isinstance(calls, list) and all(_is_function(c) for c in calls)):
        _fail(f"{where}.tool_calls must be a list of {{'function': {{'name': <string>, ...}}}}", f"{where}.tool_calls")
    for call in calls or ():
        arguments = call["function"].get("arguments")
        try:  # mlx_lm parses string arguments in its generation thread
            parse_body(arguments.encode()) if isinstance(arguments, str) else None
        except RequestError:
            _fail(f"{where}.tool_calls: function.arguments must be JSON, got {_show(arguments)}", f"{where}.tool_calls")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                problem = f"is an image part ({kind}); this model reads text only" if kind in IMAGE_PARTS else \
                    f"must be {{'type': 'text', 'text': <string>}}, got {_show(part)}"
                _fail(f"{where}.content[{j}] {problem}", f"{where}.content[{j}]")
    elif not isinstance(content, str) and not (content is None and role == "assistant" and calls):
        _fail(f"{where}.content must be a string or a list of text parts (null only with an assistant's "
              f"tool_calls), got {_show(content)}", f"{where}.content")


def check_request(body: Any, endpoint: str, limits: Limits) -> dict:
    """The body to hand to mlx_lm (null fields dropped: it then uses its defaults), or a RequestError; unknown
    fields are refused (a typo would be ignored). ``endpoint``: ``"chat"`` or ``"text"``."""
    if not isinstance(body, dict):
        _fail(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    body = {k: v for k, v in body.items() if v is not None}
    allowed = CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        _fail(f"unknown field {unknown[0]!r}; accepted: {', '.join(sorted(allowed))}", unknown[0])
    for name, (test, what) in _SHAPES.items():
        if name in body and not test(body[name]):
            _fail(f"{name} must be {what}, got {_show(body[name])}", name)
    if body.get("model", "default_model") not in limits.model_names + ("default_model",):
        _fail(f"model {_show(body['model'])} is not served here; served: {', '.join(limits.model_names)}", "model", 404)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        # past the model's context: said as such (the prompt takes at least one of its positions)
        if limits.context_declared and not isinstance(value, bool) and isinstance(value, int) and \
                value >= limits.max_context:
            _fail(f"{name} must be at most {limits.max_context - 1}: this model's context is {limits.max_context} "
                  f"tokens, prompt included; got {value}", name)
    for name, (kind, low, high) in numeric_rules(limits).items():
        if name in body:
            body[name] = _number(name, body[name], kind, low, high)
    for key, value in body.get("logit_bias", {}).items():  # an id past the vocabulary crashes mlx_lm
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < limits.vocab_size):
            _fail(f"logit_bias keys must be token ids in [0, {limits.vocab_size}), got {_show(key)}", "logit_bias")
        _number("logit_bias", value, float, -100, 100)
    required = "messages" if endpoint == "chat" else "prompt"
    if required not in body:
        _fail(f"{required} is required", required)
    for i, message in enumerate(body.get("messages", ())):
        _check_message(f"messages[{i}]", message)
    return body


def _requested_tokens(body: dict) -> Tuple[Optional[str], Optional[int]]:
    """The request's own completion budget: (field name, tokens), or (None, None) when it sets none."""
    for name in ("max_completion_tokens", "max_tokens"):
        if name in body:
            return name, body[name]
    return None, None


def check_prompt_length(raw: bytes, body: dict, limits: Limits) -> None:
    """The prompt and the tokens asked for must fit the model's context: a prompt of the context or more is
    refused; so is an explicit ``max_tokens`` (or ``max_completion_tokens``) past what the prompt leaves, naming
    both counts; a request without one gets the server's default cut to what the prompt leaves. A token is at least
    one byte, so only a body whose bytes, twice over (the rest for the chat template), plus the tokens asked for
    reach the context is tokenized here, as mlx_lm will."""
    name, asked = _requested_tokens(body)
    budget = asked if asked is not None else (limits.default_max_tokens or 0)
    if len(raw) * 2 + (budget if limits.context_declared else 0) < limits.max_context:
        return
    field_name, tok = ("prompt" if "prompt" in body else "messages"), limits.tokenizer
    try:
        with limits.lock:
            if field_name == "prompt" or not tok.has_chat_template:
                n = len(tok.encode(body["prompt"] if field_name == "prompt" else convert_chat(
                    body["messages"], body.get("role_mapping"))))
            else:
                messages = copy.deepcopy(body["messages"])  # mlx_lm edits them in place
                process_message_content(messages)
                n = len(tok.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"),
                                                **body.get("chat_template_kwargs", {})))
    except Exception as e:  # the chat template refuses these messages
        _fail(f"the {field_name} cannot be rendered by the chat template: {type(e).__name__}: {e}", field_name)
    if n >= limits.max_context:
        _fail(f"{field_name}: the prompt is {n} tokens; this model's context is {limits.max_context}", field_name)
    if not limits.context_declared:
        return
    room = limits.max_context - n
    if asked is not None and asked > room:
        _fail(f"{name}: the prompt is {n} tokens and {name} asks for {asked} more; this model's context is "
              f"{limits.max_context} tokens, so {name} can be at most {room}", name)
    if asked is None and limits.default_max_tokens is not None and limits.default_max_tokens > room:
        body["max_tokens"] = room  # the default, cut to what the prompt leaves
