"""``veloxquant``: demo, generate, eval (ppl | needle | speed), presets, plan, serve, calibrate.

Every compressed default is `veloxquant_mlx.cache.presets.DEFAULT_NAME` (``generate``, ``serve``; ``presets`` marks it).
A preset is a name for a `CacheOptions` (``--preset NAME``); the old spellings ``--method`` / ``--methods`` /
``veloxquant methods`` still work until 0.2.0 and print one deprecation line (`DEPRECATED_FLAGS`,
`DEPRECATED_COMMANDS`).

The program itself starts in :mod:`veloxquant_mlx.apps.launcher`, which re-executes the process with Debian's OpenBLAS
preloaded before this module (and MLX with it) is imported. Optional extras (matplotlib) are imported by the
functions that need them.

The package: `main` and the command table here; the parser in :mod:`~veloxquant_mlx.apps.cli.parser`, the pieces the
commands share in :mod:`~veloxquant_mlx.apps.cli.common`, the commands in :mod:`~veloxquant_mlx.apps.cli.run` (demo, generate)
and :mod:`~veloxquant_mlx.apps.cli.measure` (eval, presets, plan, calibrate, serve). Every name the single module
``cli.py`` had is importable from here as before; to patch one, patch it in the module that uses it (a name
imported here is a second reference, and the commands do not read it).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from veloxquant_mlx.apps.eval.corpus import CorpusMissing
from veloxquant_mlx.integration.routing import use_packed_attention
from veloxquant_mlx.apps.models import ModelPackageMissing
from veloxquant_mlx.apps.cli.common import CLIError
from veloxquant_mlx.apps.cli.measure import cmd_calibrate, cmd_eval, cmd_methods, cmd_plan, cmd_presets, cmd_serve  # noqa: F401
from veloxquant_mlx.apps.cli.parser import DEPRECATED_COMMANDS, build_parser
from veloxquant_mlx.apps.cli.run import cmd_demo, cmd_generate

# Re-exported: every other name `veloxquant_mlx.apps.cli` held as one module stays importable from it (tests, benchmarks
# and scripts import some of them). The commands do not read these: patch a name in the module that uses it.
import argparse, json, math, time  # noqa: E401, E402, F401, I001
import mlx.core as mx  # noqa: E402, F401
from mlx_lm import stream_generate  # noqa: E402, F401
from mlx_lm.generate import BatchGenerator  # noqa: E402, F401
from tqdm.auto import tqdm  # noqa: E402, F401

from veloxquant_mlx.attention import kernel as attention_kernel  # noqa: E402, F401
from veloxquant_mlx.apps.blas import loaded_blas  # noqa: E402, F401
from veloxquant_mlx.integration.calibration import Calibration  # noqa: E402, F401
from veloxquant_mlx.apps.distributed import rank_summary, shard  # noqa: E402, F401
from veloxquant_mlx.apps.eval import corpus_tokens, passkey_eval, perplexity_eval, speed_eval  # noqa: E402, F401
from veloxquant_mlx.apps.eval.corpus import CORPORA, DEFAULT_CORPUS  # noqa: E402, F401
from veloxquant_mlx.apps.eval.forward import greedy_decode, prefill  # noqa: E402, F401
from veloxquant_mlx.apps.eval.memory import DEFAULT_CONTEXT, measure_bytes_per_token, model_kv_shape, plan_context  # noqa: E402, F401
from veloxquant_mlx.apps.eval.specs import (MLX_GROUP_SIZE, baseline_specs, registered_specs, resolve_spec,  # noqa: E402, F401
                          with_calibration)
from veloxquant_mlx.integration.enabling import disable, enable
from veloxquant_mlx.integration.measure_calibration import calibrate  # noqa: E402, F401
from veloxquant_mlx.apps.models import load_model, max_context  # noqa: E402, F401
from veloxquant_mlx.cache.presets import DEFAULT_NAME
from veloxquant_mlx.apps.server import (DEPRECATED_FLAGS, add_serve_arguments, deprecation_line, probe_batching,  # noqa: E402, F401
                      serve_main)
from veloxquant_mlx.apps.cli.common import (_chat_ids, _check_context, _check_writable, _load, _load_calibration,  # noqa: E402, F401
                     _require_matplotlib, _say, _select_specs, _table, _with_reference, _write_json, plot_ppl)
from veloxquant_mlx.apps.cli.measure import DEFAULT_MARK, _inapplicable, _measure_all, _measured, _reasons  # noqa: E402, F401
from veloxquant_mlx.apps.cli.parser import (DEMO_PROMPT, MAX_BITS, _bits, _depths, _int_list, _Parser, _positive,  # noqa: E402, F401
                     _positive_float, _positive_int)
from veloxquant_mlx.apps.cli.run import _generate_batched, _read_prompts  # noqa: E402, F401


# Commands that run models: inside use_packed_attention() (serve installs it in its own serving context).
ATTENTION_ON_CODES = ("demo", "generate", "eval")
COMMANDS = {"demo": cmd_demo, "generate": cmd_generate, "eval": cmd_eval, "presets": cmd_presets, "plan": cmd_plan,
            "serve": cmd_serve, "calibrate": cmd_calibrate}
COMMANDS.update({old: COMMANDS[new] for old, new in DEPRECATED_COMMANDS.items()})  # (parsed as aliases)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. ``argv=None`` means a real process: re-exec with OpenBLAS first if useful."""
    if argv is None:
        argv = sys.argv[1:]

    try:
        args = build_parser().parse_args(argv)
        if args.command in DEPRECATED_COMMANDS:  # an old command name, parsed as an alias of its new one
            new = DEPRECATED_COMMANDS[args.command]
            print(deprecation_line(f"`veloxquant {args.command}`", f"`veloxquant {new}`"), file=sys.stderr, flush=True)
            args.command = new
        if args.command in ATTENTION_ON_CODES:
            # Our caches attend straight from their codes (same results up to float32 rounding, faster);
            # other caches are untouched. Undone when the command returns.
            with use_packed_attention():
                return COMMANDS[args.command](args)
        return COMMANDS[args.command](args)
    except (CLIError, ValueError, TypeError, OSError, ModelPackageMissing, CorpusMissing) as e:
        msg = str(e)
        print(msg if msg.startswith("veloxquant") else f"veloxquant: error: {msg}", file=sys.stderr)
        return e.code if isinstance(e, CLIError) else 1
    except SystemExit as e:  # argparse --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("veloxquant: interrupted", file=sys.stderr)
        return 130


def exit_process(code: int) -> None:
    """End a real process after a command: flush, then ``os._exit``.

    After ``veloxquant serve`` has stopped every thread it started, mlx_lm's generation thread leaves a
    thread-local MLX stream behind whose C++ worker is destroyed at interpreter exit, which aborts the process
    ("terminate called without an active exception") about one run in three; everything is closed by then, so
    the process ends without running those destructors.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
