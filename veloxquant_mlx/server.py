"""``veloxquant serve``: mlx_lm's OpenAI-compatible server whose KV caches are ours.

Built from :mod:`mlx_lm.server`'s public pieces, nothing of it patched: `ServedModel` gives the model the
``make_cache()`` mlx_lm's ``make_prompt_cache`` looks for, `ServedModelProvider` serves the model we loaded,
`VeloxAPIHandler` refuses bad requests with OpenAI's JSON error, and `use_packed_attention()` holds for the
server's lifetime. Requests are batched (mlx_lm's BatchGenerator) when the caches merge (`probe_batching`; ours
into `TurboQuantBatchPackedCache`). Under ``mlx.launch`` every rank holds its shard and rank 0 serves HTTP.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import math
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import (APIHandler, ModelProvider, ResponseGenerator, convert_chat, get_system_fingerprint,
                            process_message_content)

from .distributed import rank_summary, shard
from .eval.memory import measure_footprint
from .calibration.file import Calibration
from .eval.specs import method_names, resolve_spec, with_calibration
from .integration import use_packed_attention
from .models import ModelPackageMissing, load_model, max_context
from .model_shape import vocab_size as model_vocab_size
from .options import DEFAULT_NAME

logger = logging.getLogger("veloxquant_mlx.server")
DEFAULT_METHOD = DEFAULT_NAME  # the one default of every entry point (veloxquant_mlx.options)


def range_error(value: Any, kind: type, low=None, high=None) -> Optional[str]:
    """Why ``value`` is not a finite ``kind`` (int or float; a bool is neither) in [low, high], or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return f"must be {'a number' if kind is float else 'an integer'}"
    inside = (not isinstance(value, float) or math.isfinite(value)) and (low is None or value >= low) and (
        high is None or value <= high)
    return None if inside else f"must be a finite value in [{low}, {'inf' if high is None else high}]"


def _bounded(kind: type, low=None, high=None) -> Callable[[str], Any]:
    """An argparse ``type`` checked by `range_error` (argparse names the option in its message)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = text
        problem = range_error(value, kind, low, high)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value
    return parse


# (option, type, default, help): the mlx_lm.server options that apply here, with its names and defaults
_MLX_OPTIONS = (
    ("--host", str, "127.0.0.1", "address to listen on"),
    ("--port", _bounded(int, 1, 65535), 8080, "TCP port in 1..65535"),
    ("--allowed-origins", lambda text: text.split(","), "*", "CORS origins, comma separated"),
    ("--temp", _bounded(float, 0), 0.0, "default temperature"),
    ("--top-p", _bounded(float, 0, 1), 1.0, "default top-p"),
    ("--top-k", _bounded(int, 0), 0, "default top-k (0: off)"),
    ("--min-p", _bounded(float, 0, 1), 0.0, "default min-p"),
    ("--max-tokens", _bounded(int, 1), 512, "default completion length in tokens"),
    ("--prefill-step-size", _bounded(int, 1), 2048, "prefill chunk in tokens"),
    ("--prompt-cache-size", _bounded(int, 1), 10, "prompt caches kept for reuse"),
    ("--prompt-cache-bytes", _bounded(int, 1), None, "largest total size of the kept prompt caches"),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` options: ours, then mlx_lm.server's that apply here."""
    names = method_names()
    parser.add_argument("--model", default="smollm2", help="'smollm2' (embedded, default), a .gguf file "
                        "or an mlx_lm model directory")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=names, metavar="NAME", help="KV cache of "
                        f"every request (default {DEFAULT_METHOD}, the default of `enable(model)` too; see "
                        f"`veloxquant methods`): {', '.join(names)}")
    parser.add_argument("--bits", type=_bounded(float, 1, 16), default=None, help="bits, with a family --method")
    parser.add_argument("--calibration", metavar="FILE", help="a calibration of this model (`veloxquant "
                        "calibrate`): the caches use its channel weights")
    parser.add_argument("--no-batching", action="store_true", help="answer requests one after another")
    parser.add_argument("--pipeline", action="store_true", help="under mlx.launch: split the layers over the ranks "
                        "(default: tensor parallel, heads split)")
    parser.add_argument("--max-body-bytes", type=_bounded(int, 1), default=8 << 20,
                        help="largest request body in bytes (default 8 MiB)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    for name, kind, default, text in _MLX_OPTIONS:
        parser.add_argument(name, type=kind, default=default, help=f"{text} (default {default})")
    return parser


def _mlx_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What mlx_lm's ModelProvider / ResponseGenerator / APIHandler read, in its CLI's names; what we do not
    offer is off (adapters, draft models, its own KV quantization, templates) or at its default."""
    return argparse.Namespace(**vars(args), adapter_path=None, draft_model=None, num_draft_tokens=3,
                              trust_remote_code=False, kv_bits=None, kv_group_size=64,
                              quantized_kv_start=DEFAULT_QUANTIZED_KV_START, chat_template="", chat_template_args={},
                              decode_concurrency=32, prompt_concurrency=8)


def probe_batching(model, make_cache) -> Tuple[bool, str]:
    """(batchable, reason): mlx_lm's ``BatchGenerator`` merges per-request caches; try that on fresh ones."""
    for a, b in zip(make_cache(model), make_cache(model)):
        try:
            merged = type(a).merge([a, b])
        except Exception as e:  # no merge, or it refuses: the requests are answered one after another
            return False, f"{type(a).__name__}.merge: {str(e).split('(')[0].strip()}"
    return True, f"the caches merge into batch caches ({type(merged).__name__} for the last layer)"


class ServedModel:
    """The model as mlx_lm sees it, with ``make_cache()``: ``mlx_lm.models.cache.make_prompt_cache`` returns
    it, so the sequential path, the BatchGenerator and the prompt-cache reuse all get the served caches."""

    def __init__(self, model, make_cache: Callable[[Any], list]):
        self.model, self._make = model, make_cache

    def make_cache(self) -> list:
        return self._make(self.model)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class ServedModelProvider(ModelProvider):
    """mlx_lm's provider, serving the model we loaded (mlx_lm's ``load`` cannot open the embedded GGUF)."""

    def __init__(self, cli_args: argparse.Namespace, model: ServedModel, tokenizer, batchable: bool):
        super().__init__(cli_args)
        self._served = (model, tokenizer, batchable)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if self.model is None:  # the handler admits only this model's names: every request gets it
            self.model, self.tokenizer, self.is_batchable = self._served
            self.model_key = (self.cli_args.model, None, None)
        return self.model, self.tokenizer


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


def check_prompt_length(raw: bytes, body: dict, limits: Limits) -> None:
    """A prompt of the model's context or more is refused. A token is at least one byte, so only a body of
    half the context in bytes or more (the rest for the chat template) is tokenized here, as mlx_lm will."""
    if len(raw) * 2 < limits.max_context:
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


ENDPOINTS = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}


class VeloxAPIHandler(APIHandler):
    """mlx_lm's handler behind our request checks; every refusal is OpenAI's JSON error."""

    limits: Limits  # set on the per-server subclass made by `start_server`
    timeout = 120  # seconds a connection may stall before its thread gives up (socketserver applies it)

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if getattr(self, "headers", None) is not None:  # None when the request line itself was bad
            self._set_cors_headers()  # private: mlx_lm's --allowed-origins headers have no public entry point
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, e: RequestError) -> None:
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        self._send_json(e.status, {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}})

    def send_error(self, code, message=None, explain=None):
        # http.server's own refusals (unknown method, bad request line, oversized headers): JSON too
        self.close_connection = True
        self._refuse(RequestError(code, message or explain or f"HTTP {code}"))

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            _fail("a Content-Length header is required", "Content-Length", 411)
        if not (length.isascii() and length.isdigit() and len(length) <= 15):
            _fail(f"Content-Length must be a byte count, got {_show(length)}", "Content-Length")
        if int(length) > self.limits.max_body_bytes:
            _fail(f"a body of {length} bytes exceeds --max-body-bytes {self.limits.max_body_bytes}", "Content-Length",
                  413)
        return self.rfile.read(int(length))

    def do_POST(self):
        try:
            raw = self._read_body()  # read before routing: closing on unread bytes resets the connection
            if self.path not in ENDPOINTS:
                _fail(f"no route for POST {self.path}; POST routes: {', '.join(ENDPOINTS)}", None, 404)
            body = check_request(parse_body(raw), ENDPOINTS[self.path], self.limits)
            check_prompt_length(raw, body, self.limits)
        except RequestError as e:
            return self._refuse(e)
        forwarded = json.dumps(body).encode()  # mlx_lm's do_POST reads the checked body from rfile
        self.headers.replace_header("Content-Length", str(len(forwarded)))
        rfile, self.rfile = self.rfile, io.BytesIO(forwarded)
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def do_GET(self):
        if self.path.startswith("/v1/models") or self.path == "/health":
            return super().do_GET()
        self._refuse(RequestError(404, f"no route for GET {self.path}; GET routes: /health, /v1/models"))

    def handle_models_request(self):
        self._send_json(200, {"object": "list", "data": [{"id": n, "object": "model", "created": self.created,
                                                          "owned_by": "veloxquant"} for n in self.limits.model_names]})

    def _method_not_allowed(self):
        with contextlib.suppress(RequestError):
            self._read_body()
        self._refuse(RequestError(405, f"method {self.command} is not allowed; use GET /health, GET /v1/models "
                                       f"or POST {', '.join(ENDPOINTS)}"))

    do_PUT = do_DELETE = do_PATCH = _method_not_allowed


@dataclass
class ServerHandle:
    """A running server; ``close()`` stops it and then removes the attention hook."""

    url: str
    port: int
    footprint: Dict[str, float]
    batching: Tuple[bool, str]  # (batched, why)
    httpd: Optional[ThreadingHTTPServer]  # None on a rank > 0 of mlx.launch
    response_generator: ResponseGenerator
    stack: contextlib.ExitStack  # what close() undoes, last in first out
    thread: Optional[threading.Thread] = None

    def close(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
            self.thread.join()
            self.thread = None
        self.stack.close()  # server socket, then the generation thread, then the attention hook


def start_server(args: argparse.Namespace, *, model=None, tokenizer=None, port: Optional[int] = None,
                 background: bool = True) -> ServerHandle:
    """Load the model (unless given), measure its caches, serve them; ``port=0``: any free port (tests)."""
    spec = resolve_spec(args.method, args.bits)  # a bad --method fails before the model loads
    if model is None:
        model, tokenizer = load_model(args.model)
    context = max_context(model)  # max_position_embeddings or the like; None: the model does not say
    default_tokens = getattr(args, "max_tokens", None)  # what a request without max_tokens gets
    if context is not None and isinstance(default_tokens, int) and default_tokens >= context:
        raise ValueError(f"--max-tokens must be at most {context - 1}: this model's context is {context} tokens, "
                         f"prompt included; got {default_tokens}")
    group = mx.distributed.init()  # one rank unless launched with mlx.launch
    shard(model, group, pipeline=args.pipeline)
    # (bytes per token do not depend on channel weights: measured on random tokens with the uncalibrated caches)
    fp = measure_footprint(model, spec.make_cache)
    if getattr(args, "calibration", None):
        spec = with_calibration(spec, Calibration.load(args.calibration, model))  # ValueError names the file
    make_cache = spec.make_cache
    if group.size() > 1:
        logger.info(rank_summary(model, make_cache, group))
    batching = (False, "--no-batching") if args.no_batching else probe_batching(model, make_cache)
    logger.info(f"KV cache: {spec.name} ({spec.description or spec.name})")
    ratio = fp["plain_bytes_per_token"] / fp["bytes_per_token"]
    logger.info(f"KV cache size: {fp['bits_per_coordinate']:.2f} bits/coordinate, "
                f"{fp['bytes_per_token_per_layer']:.1f} bytes/token/layer, {fp['bytes_per_token']:.0f} bytes/token "
                f"over {fp['layers']} layers (plain KVCache {fp['plain_bytes_per_token']:.0f}: {ratio:.2f}x smaller), "
                "measured as `veloxquant methods` measures")
    logger.info(f"concurrent requests: {'batched' if batching[0] else 'answered one after another'} ({batching[1]})")
    # a wrapper's (qwen3_5, *_vl) vocab_size is in its text config; the tokenizer's size when no args state it
    vocab = model_vocab_size(model) or len(tokenizer.vocab)
    limits = Limits(vocab, context or 1 << 20, (str(args.model),), args.max_body_bytes,
                    copy.deepcopy(tokenizer), context_declared=context is not None)
    provider = ServedModelProvider(_mlx_namespace(args), ServedModel(model, make_cache), tokenizer, batching[0])
    with contextlib.ExitStack() as stack:  # undone at once if anything fails to start
        stack.enter_context(use_packed_attention())  # our caches attend from their codes until close()
        cache_bytes = {"max_bytes": args.prompt_cache_bytes} if args.prompt_cache_bytes else {}
        generator = ResponseGenerator(provider, LRUPromptCache(args.prompt_cache_size, **cache_bytes))
        stack.callback(generator.stop_and_join)
        if group.rank() > 0:  # rank 0 serves HTTP and shares each request; this rank generates along with it
            return ServerHandle("", 0, fp, batching, None, generator, stack.pop_all())
        handler = type("BoundVeloxAPIHandler", (VeloxAPIHandler,), {"limits": limits})
        # mlx_lm.server.run(host, port, provider, handler_class=...) is the public way, but 0.32 drops its
        # handler_class on the way to the HTTP server, blocks, and keeps the bound port and the shutdown to
        # itself: the same ThreadingHTTPServer is built here, as run() builds it.
        family, _, _, _, address = socket.getaddrinfo(args.host, args.port if port is None else port,
                                                      type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        # A listen backlog of 128, not socketserver's 5: sixteen clients connecting at once to a busy server had
        # one connection reset in benchmarks/server_load.py.
        server_class = type("VeloxServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True,
                                                                    "request_queue_size": 128})
        fingerprint = get_system_fingerprint()
        httpd = server_class(address, lambda *a, **k: handler(generator, *a, system_fingerprint=fingerprint, **k))
        stack.callback(httpd.server_close)
        stack = stack.pop_all()
    bound = httpd.server_address[1]
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{bound}"
    handle = ServerHandle(url, bound, fp, batching, httpd, generator, stack)
    if background:
        handle.thread = threading.Thread(target=httpd.serve_forever, name="veloxquant-serve", daemon=True)
        handle.thread.start()
    logger.info(f"veloxquant serve: listening on {url} (OpenAI API at {url}/v1)")
    return handle


def serve_main(args: argparse.Namespace) -> int:
    """``veloxquant serve``: serve until interrupted; 0 after a clean stop, 2 when it cannot start."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    logger.setLevel(args.log_level)
    try:
        handle = start_server(args, background=False)
    except (ValueError, TypeError, OSError, ModelPackageMissing) as e:
        print(f"veloxquant serve: error: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop cleanly on both, even if SIGINT came in ignored
        signal.signal(sig, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        if handle.httpd is None:  # a rank > 0 under mlx.launch
            handle.response_generator.join()
        else:
            handle.httpd.serve_forever()
    handle.close()
    logger.info("veloxquant serve: stopped")
    return 0
