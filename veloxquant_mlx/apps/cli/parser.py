"""The command line: `build_parser` and the argparse types that check each value (a bad value is a usage error,
exit code 2, before any work).

One word per choice (docs/usage.md, "Words"): ``--preset NAME`` / ``--presets A,B`` name presets (and mlx_lm's own
caches to compare against); ``veloxquant presets`` lists them. The old spellings ``--method``, ``--methods`` and
``veloxquant methods`` work until 0.2.0 and print one deprecation line (`DEPRECATED_FLAGS`, `DEPRECATED_COMMANDS`).
"""
from __future__ import annotations

import argparse
import math
from typing import List

from veloxquant_mlx.apps.eval.corpus import CORPORA, DEFAULT_CORPUS
from veloxquant_mlx._version import DEPRECATED_UNTIL
from veloxquant_mlx.apps.eval.specs import preset_names, registered_specs, resolve_spec
from veloxquant_mlx.apps.models.loader import DEFAULT_MODEL, MODEL_HELP
from veloxquant_mlx.cache.presets import DEFAULT_NAME
from veloxquant_mlx.apps.server import DeprecatedFlag, add_preset_argument, add_serve_arguments
from veloxquant_mlx.apps.cli.common import CLIError


DEMO_PROMPT = "What is the capital of France?"
MAX_BITS = 16
# old command name -> its name now (a subparser alias: works until DEPRECATED_UNTIL and prints one deprecation line,
# from `main`)
DEPRECATED_COMMANDS = {"methods": "presets"}


# ----------------------------------------------------------------------------- argument helpers
def _positive(convert, what: str):
    """An argparse type: ``convert(s)`` that must be > 0, else an error naming ``what`` was expected."""
    def parse(s: str):
        try:
            v = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        if not (v > 0 and math.isfinite(v)):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"expected {what} (finite), got {s!r}")
        return v

    return parse


_positive_int = _positive(int, "a positive integer")
_positive_float = _positive(float, "a positive number")


def _int_list(s: str) -> List[int]:
    return [_positive_int(x) for x in s.split(",") if x.strip()]


def _depths(s: str) -> List[float]:
    out = []
    for x in s.split(","):
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"depths must be numbers in [0, 1], got {x!r}")
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"depths must be within [0, 1], got {x!r}")
        out.append(v)
    return out


def _preset_list(text: str) -> str:
    """``--presets``: 'all', or comma-separated names `resolve_spec` takes (each checked before any work; the error
    names the presets)."""
    if text.strip() == "all":
        return text
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no preset given: comma-separated presets, or 'all'")
    for name in names:
        try:
            resolve_spec(name)
        except ValueError as e:
            if name in preset_names():  # a family: it needs --bits, which --presets does not take
                members = ", ".join(spec.name for spec in registered_specs() if spec.family == name)
                raise argparse.ArgumentTypeError(f"{name!r} is a family, not a preset: name its presets ({members})")
            raise argparse.ArgumentTypeError(str(e))
    return text


def _bits(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be a number in (0, {MAX_BITS}], got {s!r}")
    if not 0 < v <= MAX_BITS:
        raise argparse.ArgumentTypeError(f"bits out of range: {s} (allowed: 0 < bits <= {MAX_BITS})")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` controls output and exit codes."""

    def error(self, message):
        raise CLIError(f"{self.prog}: {message}", code=2)


def build_parser() -> argparse.ArgumentParser:

    p = _Parser(prog="veloxquant", description="TurboQuant KV-cache compression for MLX: demo and evaluation")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def model_opt(q):
        q.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
        q.add_argument("--quantized-weights", action="store_true",
                       help="keep a llama GGUF's weights 4/8-bit quantized (slower on CPU) instead of float32 "
                            "(not for gemma3-270m, which loads float32 only)")
        q.add_argument("--no-progress", action="store_true", help="hide progress bars")

    def calibration_opt(q, what="the compressed caches use its channel weights"):
        q.add_argument("--calibration", metavar="FILE", help=f"a calibration of this model (`veloxquant calibrate`): "
                                                             f"{what}")

    def presets_opt(q):
        q.add_argument("--presets", default="all", type=_preset_list, metavar="NAMES",
                       help="comma-separated presets (`veloxquant presets`; kv, mlx-q8/q4/q2: mlx_lm's own caches), "
                            "or 'all' (default)")
        q.add_argument("--methods", dest="presets", default=argparse.SUPPRESS, type=_preset_list, metavar="NAMES",
                       action=DeprecatedFlag, help=f"deprecated spelling of --presets (until {DEPRECATED_UNTIL})")

    d = sub.add_parser("demo", help="the plain cache against every preset on an embedded model (--model)")
    model_opt(d)
    presets_opt(d)
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--context", type=_positive_int, default=513,
                   help="perplexity slice length (tokens; 513: the budget presets' exact first token and 4 whole blocks)")
    d.add_argument("--max-tokens", type=_positive_int, default=24)
    d.add_argument("--out", help="also write the results as JSON")

    g = sub.add_parser("generate", help="stream a chat answer through one preset (several prompts: batched)")
    model_opt(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several (generated batched)")
    g.add_argument("--prompts-file", help="a text file with one prompt per line (added to any --prompt)")
    add_preset_argument(g, default=DEFAULT_NAME,
                        help=f"the KV cache: a preset (`veloxquant presets`; default {DEFAULT_NAME}, the default of "
                             "`enable(model)` and `serve` too), kv (or fp16) for mlx_lm's plain cache, mlx-q8/q4/q2, "
                             "or a family with --bits")
    g.add_argument("--bits", type=_bits, default=None,
                   help="with a family --preset: its preset of these bits (--preset tq-budget --bits 3 is tq-3b)")
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text (always so for a "
                   "model without one, such as the base model gemma3-270m)")
    g.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (default: tensor parallel, split heads)")
    calibration_opt(g)

    e = sub.add_parser("eval", help="perplexity/KL, passkey retrieval or speed; JSON output")
    esub = e.add_subparsers(dest="eval_kind", metavar="MEASURE", parser_class=_Parser)
    esub.required = True
    ep = esub.add_parser("ppl", help="perplexity, Δ vs plain cache, KL, top-1 agreement")
    ep.add_argument("--contexts", type=_int_list, default=[512])
    ep.add_argument("--windows", type=_positive_int, default=1, help="windows per context (window i at token i*context)")
    ep.add_argument("--plot", help="PNG: Δ perplexity against bits per coordinate (needs matplotlib)")
    en = esub.add_parser("needle", help="passkey retrieval at several lengths and depths")
    en.add_argument("--lengths", type=_int_list, default=[1024, 2048, 4096])
    en.add_argument("--depths", type=_depths, default=[0.1, 0.5, 0.9])
    en.add_argument("--seed", type=int, default=0)
    es = esub.add_parser("speed", help="prefill/decode tokens per second, cache bytes, peak memory")
    es.add_argument("--context", type=_positive_int, default=512)
    es.add_argument("--decode-tokens", type=_positive_int, default=32)
    for q in (ep, en, es):
        model_opt(q)
        presets_opt(q)
        q.add_argument("--out", help="write the results as JSON")
        q.add_argument("--corpus", default=DEFAULT_CORPUS, choices=tuple(CORPORA),
                       help=f"evaluation text (default {DEFAULT_CORPUS}; each installed by scripts/setup.sh)")
        if q is not ep:
            q.set_defaults(plot=None)
        calibration_opt(q, "every compressed preset is also run with it (a '+cal' row each)")

    m = sub.add_parser("presets", aliases=[old for old, new in DEPRECATED_COMMANDS.items() if new == "presets"],
                       help="the presets (and mlx_lm's caches) with measured bytes per token per layer, the default "
                            f"marked ('methods': its deprecated name, until {DEPRECATED_UNTIL})")
    m.add_argument("--head-dim", type=_positive_int, default=64)
    m.add_argument("--kv-heads", type=_positive_int, default=1)

    pl = sub.add_parser("plan", help="longest context whose KV cache fits in RAM, per preset")
    pl.add_argument("--layers", type=_positive_int, required=True)
    pl.add_argument("--kv-heads", type=_positive_int, required=True)
    pl.add_argument("--head-dim", type=_positive_int, required=True)
    pl.add_argument("--ram-gb", type=_positive_float, required=True, help="memory for the KV cache, GiB")
    c = sub.add_parser("calibrate", help="measure a model once for calibrated caches (--calibration FILE)")
    model_opt(c)
    c.add_argument("--out", required=True, help="the calibration file to write (.safetensors)")
    c.add_argument("--text-file", help="calibration text (UTF-8); default: the model's own answers to fixed prompts")
    c.add_argument("--max-tokens", type=_positive_int, default=4096, help="tokens of --text-file used (default 4096)")

    sv = sub.add_parser("serve", help="OpenAI-compatible server (mlx_lm.server) with compressed KV caches")
    add_serve_arguments(sv)
    return p
