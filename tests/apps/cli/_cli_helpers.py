"""Helpers of the command line's tests (tests/apps/cli/): one-line errors, the deprecation line the old spellings
print, commands stopped where they would load the model."""
from __future__ import annotations

from veloxquant_mlx._version import DEPRECATED_UNTIL
from veloxquant_mlx.apps import server as vs
from veloxquant_mlx.apps.cli import measure as measure_mod
from veloxquant_mlx.apps.cli import run as run_mod
from veloxquant_mlx.apps.cli.common import CLIError


def _one_line_error(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith("model ")]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _lines(err):
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()]


def _deprecation(old, new):
    return f"veloxquant: warning: {old} is deprecated and will be removed in {DEPRECATED_UNTIL}; use {new}"


def _stop_at_load(monkeypatch, seen):
    """The commands stop where they would load the model, recording what they were given."""
    def load(args):
        seen.append(args)
        raise CLIError("stopped before loading the model")

    def start_server(args, **kwargs):
        seen.append(args)
        raise ValueError("stopped before loading the model")

    for module in (run_mod, measure_mod):
        monkeypatch.setattr(module, "_load", load)
    monkeypatch.setattr(vs, "start_server", start_server)
