"""The ``veloxquant`` program (`veloxquant_mlx.apps.launcher`, ``python -m veloxquant_mlx``): a real process that
re-executes itself with OpenBLAS first, runs one command, and reports a bad argument on one line."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_real_subprocess(tmp_path):
    env = dict(os.environ)
    ok = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "plan", "--layers", "30", "--kv-heads", "3",
         "--head-dim", "64", "--ram-gb", "2"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    row = next(l for l in ok.stdout.splitlines() if l.startswith("kv "))
    assert int(row.split()[-1].replace(",", "")) == 2 * 2**30 // (30 * 2 * 3 * 64 * 4)  # float32 K+V, 30 layers
    bad = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "generate", "--prompt", "x", "--bits", "-1"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr and "bits" in bad.stderr


def test_run_exits_with_the_commands_code(monkeypatch):
    """`run` passes ``sys.argv[1:]`` to the commands and ends the process with their exit code. (Imported here with
    the OpenBLAS re-exec turned off: importing the launcher re-executes the process, this test process included.)"""
    monkeypatch.setenv("VELOXQUANT_NO_OPENBLAS", "1")
    from veloxquant_mlx.apps import launcher

    seen, ended = [], []
    monkeypatch.setattr(launcher, "main", lambda argv: seen.append(argv) or 3)
    monkeypatch.setattr(launcher, "exit_process", ended.append)
    monkeypatch.setattr(sys, "argv", ["veloxquant", "plan", "--layers", "2"])
    launcher.run()
    assert seen == [["plan", "--layers", "2"]] and ended == [3]
