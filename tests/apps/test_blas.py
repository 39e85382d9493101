"""Debian's OpenBLAS for MLX (`veloxquant_mlx.apps.blas`): where it is looked for, when the process re-executes itself
with it preloaded (and every case where it must not: opted out, not installed, already preloaded, already the
re-executed child), the in-process load the tests use, and which BLAS a process reports."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from veloxquant_mlx.apps import blas


class Exec(Exception):
    pass


@pytest.fixture
def execve(monkeypatch):
    """Records the re-exec instead of doing it; a clean environment (no opt-out, no mark, nothing preloaded)."""
    calls = []

    def record(path, argv, env):
        calls.append((path, argv, env))
        raise Exec()

    monkeypatch.setattr(blas.os, "execve", record)
    for name in (blas.OPT_OUT_ENV, blas._REEXEC_MARK, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(blas, "openblas_path", lambda: "/usr/lib/x/openblas-pthread/libopenblas.so.0")
    return calls


def test_reexec_preloads_openblas_before_what_was_preloaded(execve, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/a/libx.so:/b/liby.so")
    with pytest.raises(Exec):
        blas.ensure_openblas(["-m", "veloxquant_mlx", "plan"])
    ((path, argv, env),) = execve
    assert path == sys.executable and argv == [sys.executable, "-m", "veloxquant_mlx", "plan"]
    assert env["LD_PRELOAD"] == "/usr/lib/x/openblas-pthread/libopenblas.so.0 /a/libx.so /b/liby.so"
    assert env[blas._REEXEC_MARK] == "1"


@pytest.mark.parametrize("case", ["opted-out", "re-executed-child", "already-preloaded", "not-installed"])
def test_no_reexec_where_it_would_change_nothing_or_loop(execve, monkeypatch, case):
    if case == "opted-out":
        monkeypatch.setenv(blas.OPT_OUT_ENV, "1")
    elif case == "re-executed-child":
        monkeypatch.setenv(blas._REEXEC_MARK, "1")
    elif case == "already-preloaded":
        monkeypatch.setenv("LD_PRELOAD", "/other.so /usr/lib/x/openblas-pthread/libopenblas.so.0")
    else:
        monkeypatch.setattr(blas, "openblas_path", lambda: None)
    assert blas.ensure_openblas(["x"]) is None and execve == []


def test_preloaded_reads_spaces_and_colons():
    assert blas._preloaded({"LD_PRELOAD": " /a.so:/b.so  /c.so:"}) == ["/a.so", "/b.so", "/c.so"]
    assert blas._preloaded({}) == []


def test_openblas_path_is_debians_pthread_build_or_none(monkeypatch):
    found = blas.openblas_path()
    assert found is None or (os.path.exists(found) and found.endswith("/openblas-pthread/libopenblas.so.0"))
    monkeypatch.setattr(blas.os.path, "exists", lambda p: False)
    assert blas.openblas_path() is None


def test_in_process_load_only_before_mlx(monkeypatch):
    import mlx.core  # noqa: F401 - (conftest loaded OpenBLAS before MLX; once MLX is loaded it is too late)

    assert blas.load_openblas_global() is False
    monkeypatch.setenv(blas.OPT_OUT_ENV, "1")
    assert blas.load_openblas_global() is False


def test_a_real_process_reexecutes_with_openblas_and_reports_it():
    code = ("import os; from veloxquant_mlx.apps.blas import ensure_openblas, loaded_blas; ensure_openblas(); "
            "import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); "
            "print(os.environ.get('VELOXQUANT_OPENBLAS_REEXEC', '-')); print(loaded_blas())")
    env = {k: v for k, v in os.environ.items() if k not in (blas.OPT_OUT_ENV, blas._REEXEC_MARK, "LD_PRELOAD")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    mark, which = run.stdout.splitlines()
    lib = blas.openblas_path()
    if lib is None:
        assert mark == "-" and not which.startswith("OpenBLAS")
    else:
        assert mark == "1" and which == f"OpenBLAS ({os.path.realpath(lib)})"  # (the file the link names)
    opted = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(env, **{blas.OPT_OUT_ENV: "1"}), timeout=120)
    assert opted.returncode == 0 and opted.stdout.splitlines()[0] == "-"
