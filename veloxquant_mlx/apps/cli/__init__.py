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
and :mod:`~veloxquant_mlx.apps.cli.measure` (eval, presets, plan, calibrate, serve). Import each name from the module
that defines it.
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
from veloxquant_mlx.apps.cli.measure import cmd_calibrate, cmd_eval, cmd_plan, cmd_presets, cmd_serve
from veloxquant_mlx.apps.cli.parser import DEPRECATED_COMMANDS, build_parser
from veloxquant_mlx.apps.server import deprecation_line
from veloxquant_mlx.apps.cli.run import cmd_demo, cmd_generate


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
