"""``veloxquant serve``: mlx_lm's OpenAI-compatible server with compressed KV caches.

Nothing here is an HTTP server of its own: the pieces of :mod:`mlx_lm.server` are reused
(``ModelProvider``, ``ResponseGenerator`` with its ``LRUPromptCache`` prefix reuse and its
``BatchGenerator`` batching, ``APIHandler``), and three of its module globals are swapped for ours
only while :func:`compressed_kv_serving` is active:

- ``mlx_lm.server.make_prompt_cache`` and ``mlx_lm.generate.make_prompt_cache``: every request
  (sequential path, batched path, the batchability check) gets our caches;
- ``mlx_lm.server.load``: the model provider receives the model object loaded by
  :func:`veloxquant_mlx.models.load_model` (the embedded ``smollm2`` GGUF has no mlx_lm path).

Concurrent requests are batched by mlx_lm's ``BatchGenerator`` only when :func:`probe_batching`
shows that it runs with the caches and gives the unbatched tokens; otherwise (today's TurboQuant
caches refuse ``merge``) they are served one after another, each on its own compressed cache.
The startup log says which, and the measured KV bytes per token.

Requests are pre-validated by :class:`VeloxAPIHandler` (unknown fields, empty messages, absurd
``max_tokens``, prompts longer than the model allows, ...) and answered with an OpenAI-style JSON
4xx; valid requests go on to mlx_lm's own handler unchanged.

Mount as a subcommand::

    serve = subparsers.add_parser("serve", help="OpenAI-compatible server with compressed KV caches")
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_main)

or run ``python -m veloxquant_mlx.server --model smollm2 --method turboquant_mse --k-bits 4``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import logging
import socket
import threading
import time
import types
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from .cache.base import SERVABLE_METHODS

# by module path: ``import mlx_lm.generate as m`` yields the *function* mlx_lm exports under that name
_mlx_generate = importlib.import_module("mlx_lm.generate")
_mlx_server = importlib.import_module("mlx_lm.server")

logger = logging.getLogger("veloxquant_mlx.server")

# mlx_lm's own caches, served through the same hook (baselines and a fallback while developing)
BASELINE_METHODS = ("kv", "mlx-q8", "mlx-q4")
SERVE_METHODS = tuple(sorted(SERVABLE_METHODS)) + BASELINE_METHODS

# mlx_lm.server options that make no sense here: --model is redefined (it also accepts "smollm2");
# mlx_lm's own KV quantization would fight ours (and disables batching); distributed serving
# (--pipeline) would load shards through a path our loader hook does not cover.
_EXCLUDED_MLX_OPTIONS = frozenset(
    {"-h", "--help", "--model", "--kv-bits", "--kv-group-size", "--quantized-kv-start", "--pipeline"}
)
# values the excluded options must carry for mlx_lm's code paths
_EXCLUDED_DEFAULTS = dict(kv_bits=None, kv_group_size=64, quantized_kv_start=0, pipeline=False)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

class _ParserCaptured(Exception):
    """Raised by the recording parser to stop ``mlx_lm.server.main`` before it parses."""


def _mlx_server_argument_specs() -> List[Tuple[tuple, dict]]:
    """The ``add_argument`` calls of ``mlx_lm.server.main``, captured without running the server.

    mlx_lm builds its parser inside ``main()``; we run ``main`` with a recording parser that
    stops at ``parse_args``. Only ``mlx_lm.server``'s own reference to ``argparse`` is swapped,
    and restored before returning, so no other module sees it.
    """
    recorded: List[Tuple[tuple, dict]] = []

    class _RecordingParser(argparse.ArgumentParser):
        def add_argument(self, *names, **kwargs):
            recorded.append((names, dict(kwargs)))
            return super().add_argument(*names, **kwargs)

        def parse_args(self, *args, **kwargs):
            raise _ParserCaptured()

    shim = types.SimpleNamespace(
        **{n: getattr(argparse, n) for n in dir(argparse) if not n.startswith("__")}
    )
    shim.ArgumentParser = _RecordingParser
    original = _mlx_server.argparse
    _mlx_server.argparse = shim
    try:
        _mlx_server.main()
    except _ParserCaptured:
        pass
    finally:
        _mlx_server.argparse = original
    if not recorded:
        raise RuntimeError("could not read mlx_lm.server's arguments (its main() changed)")
    return recorded


def _cache_option(text: str) -> Tuple[str, Any]:
    """``KEY=VALUE`` → (key, value); VALUE parsed as JSON when it is JSON, else kept as a string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--cache-option expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``serve`` options: mlx_lm.server's own (minus the excluded ones) plus ours."""
    parser.add_argument(
        "--model",
        type=str,
        default="smollm2",
        help="'smollm2' (the embedded SmolLM2-135M GGUF, default), a .gguf file, "
        "or an mlx_lm model directory / Hugging Face repo",
    )
    group = parser.add_argument_group("compressed KV cache (veloxquant)")
    group.add_argument(
        "--method",
        default="turboquant_mse",
        choices=SERVE_METHODS,
        help="KV cache for every request: a TurboQuant method, or an mlx_lm baseline "
        "('kv' plain, 'mlx-q8'/'mlx-q4' mlx_lm QuantizedKVCache) (default: turboquant_mse)",
    )
    group.add_argument("--k-bits", type=int, default=4, help="key bits per coordinate (default 4)")
    group.add_argument(
        "--v-bits", type=int, default=None, help="value bits per coordinate (default: --k-bits)"
    )
    group.add_argument(
        "--cache-option",
        type=_cache_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra option of the compressed cache: a KVCacheConfig field or a builder option "
        "(repeatable; VALUE as JSON), e.g. --cache-option recent=64; default sink=4 "
        "(--cache-option sink=0 turns it off)",
    )
    group.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="largest prompt + completion in tokens (default: the model's max_position_embeddings)",
    )
    group.add_argument(
        "--no-batching",
        action="store_true",
        help="serve requests one after another even when the caches can be batched",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="largest accepted request body in bytes (default 8 MiB)",
    )
    mlx_group = parser.add_argument_group("mlx_lm.server options (passed through)")
    for names, kwargs in _mlx_server_argument_specs():
        if any(n in _EXCLUDED_MLX_OPTIONS for n in names):
            continue
        mlx_group.add_argument(*names, **kwargs)
    return parser


# --------------------------------------------------------------------------------------------
# Cache recipe
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheRecipe:
    """Which KV cache each request gets; ``make(model)`` returns fresh per-layer caches."""

    method: str = "turboquant_mse"
    k_bits: int = 4
    v_bits: Optional[int] = None
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in SERVE_METHODS:
            raise ValueError(f"method must be one of {list(SERVE_METHODS)}, got {self.method!r}")
        for name in ("k_bits", "v_bits"):
            value = getattr(self, name)
            if value is None and name == "v_bits":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int in 1..8, got {value!r}")
            if not 1 <= value <= 8:
                raise ValueError(f"{name} must be in 1..8, got {value}")
        if not isinstance(self.options, dict):
            raise TypeError(f"options must be a dict of KVCacheConfig fields, got {self.options!r}")
        if self.options and self.method in BASELINE_METHODS:
            raise ValueError(f"options (--cache-option) apply to {sorted(SERVABLE_METHODS)}, "
                             f"not to the mlx_lm baseline {self.method!r}")

    @property
    def compressed(self) -> bool:
        return self.method in SERVABLE_METHODS

    def describe(self) -> str:
        if self.method == "kv":
            return "kv (mlx_lm KVCache, uncompressed)"
        if self.method.startswith("mlx-q"):
            return f"{self.method} (mlx_lm QuantizedKVCache, {self.method[5:]}-bit, group 64)"
        v = self.v_bits if self.v_bits is not None else self.k_bits
        extra = "".join(f", {k}={v_!r}" for k, v_ in sorted(self.options.items()))
        return f"{self.method} K{self.k_bits}/V{v}{extra}"

    def make(self, model, max_kv_size: Optional[int] = None) -> List[Any]:
        """Fresh caches for ``model`` (one per layer); signature of mlx_lm's ``make_prompt_cache``."""
        if self.method == "kv":
            return _MLX_MAKE_PROMPT_CACHE(model, max_kv_size)
        if self.method.startswith("mlx-q"):
            if max_kv_size is not None:
                raise ValueError(f"max_kv_size is not supported by {self.method}, got {max_kv_size}")
            bits = int(self.method[5:])
            plain = _MLX_MAKE_PROMPT_CACHE(model)
            return [c.to_quantized(group_size=64, bits=bits) if isinstance(c, _mlx_cache.KVCache) else c
                    for c in plain]
        try:
            from .cache.builder import make_prompt_cache as velox_make_prompt_cache
        except ImportError as e:  # the cache helper's module is not there
            raise RuntimeError(
                f"method {self.method!r} needs veloxquant_mlx.cache.builder.make_prompt_cache: {e}"
            ) from e
        options = dict(self.options)
        options.setdefault("method", self.method)
        options.setdefault("k_bits", self.k_bits)
        options.setdefault("v_bits", self.v_bits)
        return velox_make_prompt_cache(model, max_kv_size=max_kv_size, **options)


# mlx_lm's own factory, captured at import (before any patch) so baselines never recurse into ours
_MLX_MAKE_PROMPT_CACHE = _mlx_cache.make_prompt_cache


# Served compressed caches keep the first tokens exact unless told otherwise: measured on
# SmolLM2-135M, K4/V4 without them garbles short chat answers ("What is the capital of France?"),
# with 4 exact "sink" tokens the greedy answers match the plain cache's.
SERVE_DEFAULT_OPTIONS = {"sink": 4}


def recipe_from_args(args: argparse.Namespace) -> CacheRecipe:
    options = dict(args.cache_option or [])
    if args.method in SERVABLE_METHODS:
        options = {**SERVE_DEFAULT_OPTIONS, **options}
    return CacheRecipe(method=args.method, k_bits=args.k_bits, v_bits=args.v_bits, options=options)


@dataclass
class CacheFootprint:
    """KV bytes per token measured from caches the model filled (all layers together).

    ``bytes_per_token``: what the caches store (``live_nbytes`` where a cache offers it, i.e. its
    ``nbytes`` without the spare room of step-grown buffers; else ``nbytes``, exact for mlx_lm's
    caches at a multiple of their 256-token step). ``allocated_bytes_per_token``: ``nbytes``.
    """

    n_tokens: int
    bytes_per_token: float
    allocated_bytes_per_token: float
    plain_bytes_per_token: float
    coordinates_per_token: int  # K and V coordinates stored per token, all layers

    @property
    def bits_per_coordinate(self) -> float:
        return 8.0 * self.bytes_per_token / max(1, self.coordinates_per_token)

    @property
    def ratio(self) -> float:
        return self.plain_bytes_per_token / max(1e-9, self.bytes_per_token)


def _stored_nbytes(cache) -> int:
    live = getattr(cache, "live_nbytes", None)
    return int(live) if isinstance(live, int) else int(cache.nbytes)


def measure_footprint(model, recipe: CacheRecipe, n_tokens: int = 256, seed: int = 0) -> CacheFootprint:
    """Run ``n_tokens`` random tokens through the model with the recipe's caches and with plain
    ``KVCache``; read their bytes. Keep ``n_tokens`` a multiple of 256 (mlx_lm's buffer step) so
    mlx_lm's own caches hold no spare room."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be at least 1, got {n_tokens}")
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 1000)
    tokens = mx.random.randint(0, vocab, (1, n_tokens), key=mx.random.key(seed))
    caches = recipe.make(model)
    plain = _MLX_MAKE_PROMPT_CACHE(model)
    for c in (caches, plain):
        model(tokens, cache=c)
        mx.eval([x.state for x in c])
    coords = 0
    for c in plain:
        if isinstance(c, _mlx_cache.KVCache) and c.keys is not None:
            # (B, H, T, d): K and V coordinates per token of this layer
            coords += c.keys.shape[1] * c.keys.shape[3] + c.values.shape[1] * c.values.shape[3]
    return CacheFootprint(
        n_tokens=n_tokens,
        bytes_per_token=sum(_stored_nbytes(c) for c in caches) / n_tokens,
        allocated_bytes_per_token=sum(c.nbytes for c in caches) / n_tokens,
        plain_bytes_per_token=sum(_stored_nbytes(c) for c in plain) / n_tokens,
        coordinates_per_token=coords,
    )


# --------------------------------------------------------------------------------------------
# The reversible hook
# --------------------------------------------------------------------------------------------

_HOOK_LOCK = threading.Lock()
_HOOK_ACTIVE = False

# Names the package loader serves itself (mlx_lm.load cannot open them)
_OWN_MODEL_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")


def _is_own_model(path: Any) -> bool:
    name = str(path)
    return name.lower() in _OWN_MODEL_NAMES or name.lower().endswith(".gguf")


def _model_config(model) -> dict:
    """What mlx_lm's ``load(..., return_config=True)`` would give (used for the vision processor)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    try:
        return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    except TypeError:
        return {}


@contextlib.contextmanager
def compressed_kv_serving(
    recipe: CacheRecipe, preloaded: Optional[Dict[str, Tuple[Any, Any]]] = None
) -> Iterator[None]:
    """Route mlx_lm's server through our caches and model loader; restore mlx_lm on exit.

    Inside the context: packed attention is on (`veloxquant_mlx.attention.install`: our caches attend
    from their codes), ``mlx_lm.server.make_prompt_cache`` and ``mlx_lm.generate.make_prompt_cache``
    (which ``BatchGenerator`` calls) build ``recipe``'s caches; ``mlx_lm.server.load`` returns
    ``preloaded[path]`` (model, tokenizer) when given, loads "smollm2"/.gguf through
    :func:`veloxquant_mlx.models.load_model`, and defers to mlx_lm otherwise. Not reentrant.
    """
    global _HOOK_ACTIVE
    preloaded = dict(preloaded or {})
    with _HOOK_LOCK:
        if _HOOK_ACTIVE:
            raise RuntimeError("compressed_kv_serving is already active (it is not reentrant)")
        _HOOK_ACTIVE = True
    original_load = _mlx_server.load
    saved = [
        (_mlx_server, "make_prompt_cache", _mlx_server.make_prompt_cache),
        (_mlx_generate, "make_prompt_cache", _mlx_generate.make_prompt_cache),
        (_mlx_server, "load", original_load),
    ]

    def make_prompt_cache(model, max_kv_size=None):
        return recipe.make(model, max_kv_size)

    def load(path_or_hf_repo, *args, return_config: bool = False, **kwargs):
        key = str(path_or_hf_repo)
        if key in preloaded:
            model, tokenizer = preloaded[key]
        elif _is_own_model(key):
            from .models import load_model

            if kwargs.get("adapter_path"):
                raise ValueError("adapters are not supported for GGUF / embedded models")
            model, tokenizer = load_model(key)
        else:
            return original_load(path_or_hf_repo, *args, return_config=return_config, **kwargs)
        if return_config:
            return model, tokenizer, _model_config(model)
        return model, tokenizer

    from .attention import hook as attention_hook

    attention_hook.install()  # our caches attend from their codes; undone below
    try:
        _mlx_server.make_prompt_cache = make_prompt_cache
        _mlx_generate.make_prompt_cache = make_prompt_cache
        _mlx_server.load = load
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        attention_hook.uninstall()
        with _HOOK_LOCK:
            _HOOK_ACTIVE = False


# --------------------------------------------------------------------------------------------
# Batching check
# --------------------------------------------------------------------------------------------

def probe_batching(model, recipe: CacheRecipe, n_tokens: int = 4) -> Tuple[bool, str]:
    """Whether mlx_lm's ``BatchGenerator`` runs with our caches: two prompts of different lengths
    (so left padding, ``merge``, ``prepare``/``finalize``, ``filter`` and ``extract`` are all used)
    are generated batched and each must match its own unbatched greedy run.

    Returns (batchable, reason). Run inside :func:`compressed_kv_serving` is not needed: the
    caches are passed explicitly.
    """
    probe = recipe.make(model)
    missing = [type(c).__name__ for c in probe if not hasattr(c, "merge")]
    if missing:
        return False, f"{sorted(set(missing))[0]} has no merge()"
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 1000)
    prompts = [
        [int(t) for t in mx.random.randint(0, vocab, (n,), key=mx.random.key(7 + n)).tolist()]
        for n in (5, 11)
    ]
    try:
        gen = _mlx_generate.BatchGenerator(model, completion_batch_size=2, prefill_batch_size=2)
        # different lengths and budgets: left padding, then filter() when the first one finishes
        budgets = [n_tokens, n_tokens + 2]
        uids = gen.insert(prompts, max_tokens=budgets, caches=[recipe.make(model) for _ in prompts])
        batched: Dict[int, List[int]] = {u: [] for u in uids}
        finished = set()
        while len(finished) < len(uids):
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                batched[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finished.add(r.uid)
        gen.close()
    except Exception as e:  # any failure means: serve one after another
        first = str(e).split("(")[0].split(";")[0].strip()
        return False, f"mlx_lm's BatchGenerator fails with these caches: {type(e).__name__}: {first}"
    for uid, prompt, budget in zip(uids, prompts, budgets):
        single = []
        for token, _ in _mlx_generate.generate_step(
            mx.array(prompt), model, max_tokens=budget, prompt_cache=recipe.make(model)
        ):
            single.append(int(token))
        if single != batched[uid]:
            return False, f"batched tokens {batched[uid]} differ from unbatched {single}"
    return True, "caches merge into mlx_lm batches"


# --------------------------------------------------------------------------------------------
# Request validation
# --------------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses: HTTP status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


# Fields mlx_lm's handler honours, common to both endpoints
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "stop", "seed", "logprobs", "top_logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
    "presence_context_size", "frequency_context_size", "xtc_probability", "xtc_threshold",
    "num_draft_tokens",
})
# OpenAI fields that change nothing here and are accepted as no-ops (clients send them)
_NOOP_FIELDS = frozenset({"user", "n", "metadata", "store", "service_tier", "prompt_cache_key",
                          "safety_identifier"})
CHAT_FIELDS = _COMMON_FIELDS | _NOOP_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls",
                                              "role_mapping", "chat_template_kwargs"}
COMPLETION_FIELDS = _COMMON_FIELDS | _NOOP_FIELDS | {"prompt"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# models that declare no context length still get a bound (``--max-context`` sets the real one)
_MAX_TOKENS_WITHOUT_CONTEXT = 1 << 20

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "seed", "top_logprobs",
               "repetition_context_size", "presence_context_size", "frequency_context_size",
               "num_draft_tokens")


def _check_message(i: int, message: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(400, f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(400, f"{where}.role must be one of {list(CHAT_ROLES)}, got {role!r}", f"{where}.role")
    if "content" not in message and not message.get("tool_calls"):
        raise RequestError(400, f"{where} has no 'content'", f"{where}.content")
    content = message.get("content")
    if content is None:
        if role != "assistant" or not message.get("tool_calls"):
            raise RequestError(400, f"{where}.content may be null only for an assistant tool call",
                               f"{where}.content")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(400, f"{where}.content[{j}] must be an object with a 'type'",
                                   f"{where}.content")
    elif not isinstance(content, str):
        raise RequestError(400, f"{where}.content must be a string or a list of parts, "
                                f"got {type(content).__name__}", f"{where}.content")


def check_request_body(body: Any, endpoint: str, max_context: Optional[int]) -> dict:
    """Structural checks mlx_lm does not make (it ignores unknown fields, accepts bool as int,
    empty message lists and unbounded ``max_tokens``). ``endpoint``: "chat" or "text".
    Returns the body to forward; raises :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; accepted: {sorted(allowed)}", unknown[0])
    for name in _INT_FIELDS:
        if name in body and body[name] is not None and (
            isinstance(body[name], bool) or not isinstance(body[name], int)
        ):
            raise RequestError(400, f"{name} must be an integer, got {body[name]!r}", name)
    if "n" in body and body["n"] not in (None, 1):
        raise RequestError(400, f"n must be 1 (one choice per request), got {body['n']!r}", "n")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise RequestError(400, "stop must be a string or a list of strings", "stop")
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(
            body["stream_options"], dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")

    if endpoint == "chat":
        if "messages" not in body:
            raise RequestError(400, "'messages' is required", "messages")
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            _check_message(i, m)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError(400, "tools must be a list", "tools")
        ctk = body.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise RequestError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    else:
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required", "prompt")
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise RequestError(400, "prompt must be a non-empty string", "prompt")

    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = body.get(name)
    if requested is not None:
        if requested < 1:
            raise RequestError(400, f"{name} must be at least 1, got {requested}", name)
        limit = max_context if max_context is not None else _MAX_TOKENS_WITHOUT_CONTEXT
        if requested >= limit:
            raise RequestError(400, f"{name} must be below {limit} (the model's context in tokens), "
                                    f"got {requested}", name)
    return body


# --------------------------------------------------------------------------------------------
# Handler
# --------------------------------------------------------------------------------------------

@dataclass
class ServeState:
    """What the handlers need besides mlx_lm's response generator."""

    model_names: Tuple[str, ...]
    max_context: Optional[int]
    default_max_tokens: int
    max_body_bytes: int
    tokenizer: Any  # a private copy: handler threads count prompt tokens with it
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)


class VeloxAPIHandler(_mlx_server.APIHandler):
    """mlx_lm's handler with strict request validation in front and JSON errors everywhere."""

    velox: ServeState  # set on the per-server subclass made by :func:`start_server`

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send_error_json(self, status: int, message: str, param: Optional[str] = None,
                         code: Optional[str] = None) -> None:
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        payload = json.dumps({"error": {"message": message, "type": kind, "param": param,
                                        "code": code or str(status)}}).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def do_GET(self):
        if self.path.startswith("/v1/models") or self.path == "/health":
            return super().do_GET()
        self._send_error_json(404, f"no route for GET {self.path}", code="not_found")

    def handle_models_request(self):
        data = [{"id": n, "object": "model", "created": self.created, "owned_by": "veloxquant"}
                for n in self.velox.model_names]
        payload = json.dumps({"object": "list", "data": data}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def do_POST(self):
        endpoints = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}
        try:
            endpoint = endpoints.get(self.path)
            if endpoint is None:
                raise RequestError(404, f"no route for POST {self.path}", code="not_found")
            raw = self._read_body()
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(400, f"invalid JSON in request body: {e}") from None
            body = check_request_body(body, endpoint, self.velox.max_context)
            self._check_model(body)
            self._check_prompt_length(body, endpoint)
        except RequestError as e:
            self._send_error_json(e.status, e.message, e.param, e.code)
            return
        # hand the (possibly amended) body to mlx_lm's handler, which reads it from rfile
        forwarded = json.dumps(body).encode()
        self.headers.replace_header("Content-Length", str(len(forwarded)))
        original_rfile = self.rfile
        self.rfile = io.BytesIO(forwarded)
        try:
            super().do_POST()
        finally:
            self.rfile = original_rfile

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "Content-Length header is required")
        try:
            n = int(length)
        except ValueError:
            raise RequestError(400, f"invalid Content-Length {length!r}") from None
        if n < 0:
            raise RequestError(400, f"invalid Content-Length {length!r}")
        if n > self.velox.max_body_bytes:
            raise RequestError(413, f"request body of {n} bytes exceeds {self.velox.max_body_bytes}")
        return self.rfile.read(n)

    def _check_model(self, body: dict) -> None:
        name = body.get("model", "default_model")
        if not isinstance(name, str):
            raise RequestError(400, "model must be a string", "model")
        if name not in self.velox.model_names and name != "default_model":
            raise RequestError(404, f"model {name!r} is not served here; available: "
                                    f"{list(self.velox.model_names)}", "model", "model_not_found")

    def _count_prompt_tokens(self, body: dict, endpoint: str) -> Optional[int]:
        """Tokenize exactly as mlx_lm's generation thread will (its own ``_tokenize``); None for
        prompts with images (counting them would fetch and process the images twice)."""
        velox = self.velox
        if endpoint == "chat":
            messages = copy.deepcopy(body["messages"])
            if any(True for _ in _mlx_server._image_parts(messages)):
                return None
            request = _mlx_server.CompletionRequest("chat", "", messages, body.get("tools") or None,
                                                    body.get("role_mapping"))
        else:
            request = _mlx_server.CompletionRequest("text", body["prompt"], [], None, None)
        args = types.SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
        with velox.tokenizer_lock:
            prompt = _mlx_server.ResponseGenerator._tokenize(
                self.response_generator, velox.tokenizer, request, args
            )[0]
        return len(prompt)

    def _check_prompt_length(self, body: dict, endpoint: str) -> None:
        limit = self.velox.max_context
        try:
            n_prompt = self._count_prompt_tokens(body, endpoint)
        except RequestError:
            raise
        except Exception as e:  # the chat template or tokenizer refused these messages
            raise RequestError(400, f"could not build the prompt: {type(e).__name__}: {e}",
                               "messages" if endpoint == "chat" else "prompt") from None
        if n_prompt is None:
            return
        if n_prompt == 0:
            raise RequestError(400, "the prompt is empty after tokenization",
                               "messages" if endpoint == "chat" else "prompt")
        if limit is None:
            return
        if n_prompt >= limit:
            raise RequestError(400, f"the prompt is {n_prompt} tokens; this model allows at most {limit} "
                                    "tokens of prompt and completion", "messages" if endpoint == "chat"
                               else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        requested = body.get(name)
        if requested is None:
            # the server default is trimmed to fit instead of refusing a request that named no limit
            body["max_tokens"] = min(self.velox.default_max_tokens, limit - n_prompt)
        elif n_prompt + requested > limit:
            raise RequestError(400, f"prompt ({n_prompt} tokens) + {name} ({requested}) exceeds this model's "
                                    f"context of {limit} tokens", name, "context_length_exceeded")


# --------------------------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------------------------

class _VeloxModelProvider(_mlx_server.ModelProvider):
    """mlx_lm's provider; ``force_sequential`` overrides its batchability after each load."""

    force_sequential = False

    def _load(self, *args, **kwargs):
        super()._load(*args, **kwargs)
        if self.force_sequential:
            self.is_batchable = False


def _server_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace mlx_lm's ModelProvider/ResponseGenerator read (excluded options filled in)."""
    ns = argparse.Namespace(**vars(args))
    for k, v in _EXCLUDED_DEFAULTS.items():
        setattr(ns, k, v)
    if isinstance(ns.chat_template_args, str):
        ns.chat_template_args = json.loads(ns.chat_template_args)
    return ns


@dataclass
class ServerHandle:
    """A running server: ``url`` (http://host:port), ``close()`` (also on ``with`` exit)."""

    host: str
    port: int
    recipe: CacheRecipe
    footprint: Optional[CacheFootprint]
    batching: bool
    batching_reason: str
    httpd: Any
    response_generator: Any
    _exit_stack: contextlib.ExitStack
    _thread: Optional[threading.Thread] = None
    _closed: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def prompt_cache(self):
        return self.response_generator.prompt_cache

    def prompt_cache_entries(self) -> List[Dict[str, Any]]:
        """What mlx_lm's LRU prompt cache holds now: per entry the token count, the cache classes,
        ``nbytes`` and the segment type (a snapshot; for tests and logs)."""
        out = []
        # iterative walk: a trie path is as deep as a prompt is long
        stack = [(root, 0) for root in list(self.prompt_cache._trie._trie.values())]
        while stack:
            node, depth = stack.pop()
            for key, child in list(node.items()):
                if key == "__value__":
                    out.append({
                        "n_tokens": depth,
                        "cache_classes": sorted({type(c).__name__ for c in child.prompt_cache}),
                        "nbytes": child.nbytes,
                        "cache_type": child.cache_type,
                    })
                else:
                    stack.append((child, depth + 1))
        return out

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()
        self.response_generator.stop_and_join()
        self._exit_stack.close()  # restores mlx_lm after the generation thread has stopped

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _startup_lines(recipe: CacheRecipe, fp: Optional[CacheFootprint], batching: bool, reason: str) -> List[str]:
    lines = [f"KV cache: {recipe.describe()}"]
    if fp is not None:
        lines.append(
            f"KV cache size: {fp.bytes_per_token:.1f} bytes/token over all layers "
            f"({fp.bits_per_coordinate:.2f} bits/coordinate; plain KVCache {fp.plain_bytes_per_token:.1f} "
            f"bytes/token, {fp.ratio:.2f}x smaller); measured on caches filled with {fp.n_tokens} tokens "
            f"(nbytes with the step-grown buffers' spare room: {fp.allocated_bytes_per_token:.1f} bytes/token)"
        )
    if batching:
        lines.append(f"concurrent requests: batched by mlx_lm's BatchGenerator ({reason})")
    else:
        lines.append(f"concurrent requests: served one after another ({reason})")
    return lines


def start_server(args: argparse.Namespace, *, model=None, tokenizer=None, background: bool = True,
                 measure: bool = True) -> ServerHandle:
    """Load the model, measure the cache, apply the hook and start serving.

    ``args``: a namespace from a parser given :func:`add_serve_arguments`. ``model``/``tokenizer``
    override loading (tests, benchmarks). With ``background`` the HTTP loop runs in a daemon thread;
    otherwise call ``handle.serve_forever()``. ``--port 0`` picks a free port (see ``handle.port``).
    """
    recipe = recipe_from_args(args)
    adapter = getattr(args, "adapter_path", None)
    if model is None and adapter:
        if _is_own_model(args.model):
            raise ValueError(f"--adapter-path is not supported for {args.model!r} (GGUF / embedded models)")
        model, tokenizer = _mlx_server.load(args.model, adapter_path=adapter)
    elif model is None:
        from .models import load_model

        model, tokenizer = load_model(args.model)
    elif tokenizer is None:
        raise TypeError("tokenizer is required when model is given")
    if getattr(args, "use_default_chat_template", False) and tokenizer.chat_template is None:
        tokenizer.chat_template = tokenizer.default_chat_template
    if getattr(args, "chat_template", ""):
        # mlx_lm passes it at load time; our models are loaded already
        tokenizer.chat_template = args.chat_template
        tokenizer.has_chat_template = True

    max_context = args.max_context
    if max_context is None:
        n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        max_context = int(n) if n else None
    elif max_context < 2:
        raise ValueError(f"max_context must be at least 2, got {max_context}")

    try:  # a bad --cache-option or bit width shows here, before anything starts
        recipe.make(model)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot build the {recipe.method} caches for this model: {e}") from e
    footprint = measure_footprint(model, recipe) if measure else None
    if args.no_batching:
        batching, reason = False, "--no-batching"
    elif getattr(args, "draft_model", None):
        batching, reason = False, "speculative decoding is not batched by mlx_lm"
    else:
        batching, reason = probe_batching(model, recipe)
    for line in _startup_lines(recipe, footprint, batching, reason):
        logger.info(line)

    ns = _server_namespace(args)
    names = [str(args.model)]
    if Path(str(args.model)).exists():
        names.append(str(Path(str(args.model)).resolve()))
    try:
        private_tokenizer = copy.deepcopy(tokenizer)
    except Exception:  # not copyable: share it (the handler lock still serializes our own use)
        private_tokenizer = tokenizer
    state = ServeState(
        model_names=tuple(dict.fromkeys(names)),
        max_context=max_context,
        default_max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_bytes,
        tokenizer=private_tokenizer,
    )

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(compressed_kv_serving(recipe, preloaded={str(args.model): (model, tokenizer)}))
        provider = _VeloxModelProvider(ns)
        provider.force_sequential = not batching
        for name in state.model_names:  # every accepted name is the loaded model: no reload
            provider._model_map[name] = ns.model
            provider._adapter_map[name] = ns.adapter_path
        prompt_cache = _mlx_cache.LRUPromptCache(
            ns.prompt_cache_size, **({"max_bytes": ns.prompt_cache_bytes} if ns.prompt_cache_bytes else {})
        )
        response_generator = _mlx_server.ResponseGenerator(provider, prompt_cache)
        stack.callback(lambda: response_generator.stop_and_join() if response_generator.generation_available()
                       else None)
        handler_class = type("BoundVeloxAPIHandler", (VeloxAPIHandler,), {"velox": state})
        fingerprint = _mlx_server.get_system_fingerprint()

        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        server_class = type("VeloxHTTPServer", (ThreadingHTTPServer,), {"address_family": family,
                                                                       "daemon_threads": True})
        httpd = server_class(
            address,
            lambda *a, **k: handler_class(response_generator, *a, system_fingerprint=fingerprint, **k),
        )
    except BaseException:
        stack.close()
        raise
    handle = ServerHandle(
        host=args.host, port=httpd.server_address[1], recipe=recipe, footprint=footprint,
        batching=batching, batching_reason=reason, httpd=httpd, response_generator=response_generator,
        _exit_stack=stack,
    )
    _wait_until_loaded(handle)
    if background:
        handle._thread = threading.Thread(target=httpd.serve_forever, name="veloxquant-serve", daemon=True)
        handle._thread.start()
    logger.info(f"serving on {handle.url} (OpenAI API at {handle.url}/v1)")
    return handle


def _wait_until_loaded(handle: ServerHandle, timeout: float = 120.0) -> None:
    """The generation thread loads the model first (through our hook); wait for it so the first
    request is not timed with a load, and fail early if it died."""
    provider = handle.response_generator.model_provider
    deadline = time.monotonic() + timeout
    while provider.model is None:
        if not handle.response_generator.generation_available():
            handle.close()
            raise RuntimeError("the mlx_lm generation thread died while loading the model")
        if time.monotonic() > deadline:
            handle.close()
            raise RuntimeError(f"the model was not loaded after {timeout:.0f} s")
        time.sleep(0.02)


def serve_main(args: argparse.Namespace) -> int:
    """Entry point of ``veloxquant serve`` (blocks until interrupted). Returns an exit status."""
    level = getattr(logging, str(getattr(args, "log_level", "INFO")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s - %(levelname)s - %(message)s")
    logger.setLevel(level)
    try:
        handle = start_server(args, background=False)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, OSError) as e:
        logger.error(f"veloxquant serve: {e}")
        return 2
    print(f"veloxquant serve: listening on {handle.url}", flush=True)
    handle.serve_forever()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veloxquant serve",
        description="OpenAI-compatible server (mlx_lm.server) with compressed KV caches",
    )
    return add_serve_arguments(parser)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        from .blas import ensure_openblas

        ensure_openblas()
    except ImportError:
        pass
    return serve_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
