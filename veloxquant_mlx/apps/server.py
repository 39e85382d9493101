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
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint

from veloxquant_mlx._version import DEPRECATED_UNTIL
from veloxquant_mlx.apps.distributed import rank_summary, shard
from veloxquant_mlx.apps.eval.memory import measure_footprint
from veloxquant_mlx.integration.calibration import Calibration
from veloxquant_mlx.apps.eval.specs import preset_names, resolve_spec, unknown_preset, with_calibration
from veloxquant_mlx.integration.routing import use_packed_attention
from veloxquant_mlx.apps.models import DEFAULT_MODEL, MODEL_HELP, ModelPackageMissing, load_model, max_context
from veloxquant_mlx.integration.model_shape import vocab_size as model_vocab_size
from veloxquant_mlx.cache.presets import DEFAULT_NAME
# (CHAT_FIELDS and numeric_rules: read through this module by its tests and users)
from veloxquant_mlx.apps.server_requests import (Limits, RequestError, _fail, _show, check_prompt_length, check_request,
                                                 parse_body, range_error)

logger = logging.getLogger("veloxquant_mlx.apps.server")
DEFAULT_PRESET = DEFAULT_NAME  # the one default of every entry point (veloxquant_mlx.cache.options)
DEFAULT_METHOD = DEFAULT_PRESET  # its old name (the --method it was the default of is now --preset)

# The command line's old spellings -> their replacements (`veloxquant` and `veloxquant serve`): each still works
# until DEPRECATED_UNTIL, with the package's other deprecated aliases (tests/test_aliases.py), and prints one
# line on stderr naming its replacement. ``--method`` took a preset name, while `CacheOptions.method` is the
# quantizer: one word per choice.
DEPRECATED_FLAGS = {"--method": "--preset", "--methods": "--presets"}


def deprecation_line(old: str, new: str) -> str:
    """The one stderr line an old spelling prints."""
    return f"veloxquant: warning: {old} is deprecated and will be removed in {DEPRECATED_UNTIL}; use {new}"


class DeprecatedFlag(argparse.Action):
    """An old option spelling (`DEPRECATED_FLAGS`): stores into its replacement's ``dest`` and prints one line on
    stderr naming the replacement."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(deprecation_line(option_string, DEPRECATED_FLAGS[option_string]), file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def preset_argument(text: str) -> str:
    """argparse ``type`` of ``--preset``: a name `resolve_spec` knows (argparse names the option in its error,
    which lists the presets); a family's ``--bits`` is checked when the spec is resolved."""
    if text not in preset_names():
        raise argparse.ArgumentTypeError(unknown_preset(text))
    return text


def add_preset_argument(parser: argparse.ArgumentParser, help: str, **kwargs) -> argparse.ArgumentParser:
    """``--preset NAME`` (dest ``preset``, default `DEFAULT_PRESET`) and its deprecated spelling ``--method``."""
    kwargs.setdefault("default", DEFAULT_PRESET)
    parser.add_argument("--preset", type=preset_argument, metavar="NAME", help=help, **kwargs)
    parser.add_argument("--method", dest="preset", type=preset_argument, metavar="NAME", action=DeprecatedFlag,
                        default=argparse.SUPPRESS, help=f"deprecated spelling of --preset (until {DEPRECATED_UNTIL})")
    return parser


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
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    add_preset_argument(parser, help=f"KV cache of every request: a preset (default {DEFAULT_PRESET}, the default of "
                        f"`enable(model)` too; `veloxquant presets` lists them), mlx_lm's kv / mlx-q8 / mlx-q4 / "
                        f"mlx-q2, or a family with --bits: {', '.join(preset_names())}")
    parser.add_argument("--bits", type=_bounded(float, 1, 16), default=None,
                        help="bits, with a family --preset (--preset tq-budget --bits 3 is tq-3b)")
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


def _preset_of(args: argparse.Namespace) -> str:
    """``args.preset``; a namespace made by hand with the old ``method`` attribute still works until
    DEPRECATED_UNTIL (a DeprecationWarning)."""
    if hasattr(args, "preset"):
        return args.preset
    if hasattr(args, "method"):
        warnings.warn(f"start_server(args) reads args.preset; args.method is deprecated and will be removed in "
                      f"{DEPRECATED_UNTIL}", DeprecationWarning, stacklevel=3)
        return args.method
    return DEFAULT_PRESET


def start_server(args: argparse.Namespace, *, model=None, tokenizer=None, port: Optional[int] = None,
                 background: bool = True) -> ServerHandle:
    """Load the model (unless given), measure its caches, serve them; ``port=0``: any free port (tests)."""
    spec = resolve_spec(_preset_of(args), args.bits)  # a bad --preset / --bits fails before the model loads
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
                "measured as `veloxquant presets` measures")
    logger.info(f"concurrent requests: {'batched' if batching[0] else 'answered one after another'} ({batching[1]})")
    # a wrapper's (qwen3_5, *_vl) vocab_size is in its text config; the tokenizer's size when no args state it
    vocab = model_vocab_size(model) or len(tokenizer.vocab)
    limits = Limits(vocab, context or 1 << 20, (str(args.model),), args.max_body_bytes,
                    copy.deepcopy(tokenizer), context_declared=context is not None,
                    default_max_tokens=default_tokens if isinstance(default_tokens, int) else None)
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
