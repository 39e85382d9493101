"""The research probes (benchmarks/probes/) in their ``--smoke`` mode, run as users run them
(``python -m benchmarks.probes.NAME`` from the repository root, one child process each): nothing else runs them, so
this is what keeps them from rotting unseen. Each must exit 0, print its table and write its JSON; the figures of a
smoke run (a tiny random model, a few hundred tokens, one repeat) mean nothing and are not checked.

Every probe in benchmarks/probes/ has an entry here (`test_every_probe_has_a_smoke_test`): a new one comes with its
``--smoke``."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBES_DIR = ROOT / "benchmarks" / "probes"


def run_probe(name: str, *args: str) -> str:
    """``python -m benchmarks.probes.NAME --smoke ARGS`` from the repository root; its stdout (exit 0 asserted)."""
    env = dict(os.environ)  # this checkout's package and its ``benchmarks``, whatever the interpreter has installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", f"benchmarks.probes.{name}", "--smoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, \
        f"{name} --smoke exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def read_json(path: Path):
    assert path.is_file(), f"{path.name} not written"
    return json.loads(path.read_text())


NUMBER = r"-?\d+\.\d+"


def test_prerope_scoring(tmp_path):
    out = run_probe("prerope_scoring", "--out", str(tmp_path / "p.json"))
    assert "| tokens | plain q K^T (ms) | scores from codes (ms) |" in out
    assert re.search(rf"^\| 256 \| {NUMBER} \| {NUMBER} \| {NUMBER} \|$", out, re.M), out
    rows = read_json(tmp_path / "p.json")
    assert [r["tokens"] for r in rows] == [256] and all(r[k] > 0 for r in rows for k in r if k.endswith("_ms"))


def test_distortion(tmp_path):
    out = run_probe("distortion", "--out", str(tmp_path / "d.json"))
    assert "D_mse meas" in out and "D_prod meas" in out
    for b in (1, 2, 3):  # d=64, 1..3 bits: a row each
        assert re.search(rf"^\s+64\s+{b} \|\s+{NUMBER}", out, re.M), out
    assert "throughput on (1, 2, 256, 128)" in out and "turboquant_rvq   b=4: encode" in out
    data = read_json(tmp_path / "d.json")
    assert [(r["d"], r["b"]) for r in data["distortion"]] == [(64, 1), (64, 2), (64, 3)]
    assert all(0 < r["mse_d_mse"] < 1 and 0 < r["prod_d_prod"] for r in data["distortion"])
    assert len(data["throughput"]) == 6


def test_attention(tmp_path):
    from veloxquant_mlx.attention import kernel

    out = run_probe("attention", "--out", str(tmp_path / "a.json"))
    assert "candidate" in out and "median ms" in out and "B/tok/head" in out
    assert re.search(rf"^ours_blk4\s+{NUMBER}", out, re.M) and re.search(rf"^ours_lloyd4_gather\s+{NUMBER}", out, re.M)
    assert re.search(rf"^smollm2-135m\s+9/3,64\s+256\s+{NUMBER}", out, re.M), out
    assert "vs ref" in out  # --rotating's column
    table = read_json(tmp_path / "a_table.json")
    candidates = {r["candidate"] for r in table["rows"]}
    assert {"sdpa_f32", "mlxlm_q4", "ours_aff4", "ours_blk4_win", "ours_prod4"} <= candidates, candidates
    for mode in ("shapes", "rotating"):
        rows = read_json(tmp_path / f"a_{mode}.json")["rows"]
        assert [r["n"] for r in rows] == [256] and math.isfinite(rows[0]["max_rel_err_vs_f32"])
    mod = kernel.compiled_module()
    if mod is not None and hasattr(mod, "set_row_plan"):  # --row-plans needs the compiled kernel
        assert re.search(r"^\s+3\s+64\s+256\s+", out, re.M), out
        assert len(read_json(tmp_path / "a_row_plans.json")["rows"]) == 1


def test_step_profile(tmp_path):
    out = run_probe("step_profile", "--out", str(tmp_path / "s.json"))
    assert re.search(r"^config\s+step\s+build\s+store\s+attention\s+rest$", out, re.M), out
    for label in ("kv", "mlx-q4", "tq-affine-k8v4", "tq-4b", "kv@16"):
        assert re.search(rf"^{re.escape(label)}\s+{NUMBER}", out, re.M), label
    assert "batch caches of one row" in out and "later" in out and "cProfile, step 1 against step 10" in out
    assert [r["config"] for r in read_json(tmp_path / "s_profile.json")["rows"]] == \
        ["kv", "mlx-q4", "tq-affine-k8v4", "tq-4b", "kv@16"]
    assert read_json(tmp_path / "s_batch.json")["batch_cache"] is True
    fresh = read_json(tmp_path / "s_fresh.json")
    assert fresh["mode"] == "fresh" and all(len(r["step_ms"]) == 10 for r in fresh["rows"])


def test_coded_tail(tmp_path):
    out = run_probe("coded_tail", "--out", str(tmp_path / "c.json"))
    assert re.search(rf"^layer  0 5 bits: uncentred {NUMBER}  centred {NUMBER}  ratio {NUMBER}$", out, re.M), out
    assert "first-step KL" in out and "tq4-ptc4 (8-bit provisional keys)" in out
    assert "largest logit difference" in out
    result = read_json(tmp_path / "c.json")["result"]
    assert set(result) == {"centring", "chat", "kernel"}
    assert math.isfinite(result["kernel"]["max_logit_diff"])


def test_layer_sensitivity(tmp_path):
    out = run_probe("layer_sensitivity", "--out", str(tmp_path / "l.json"))
    assert re.search(rf"^calibration\s+192 tokens.*keys sum {NUMBER}", out, re.M), out
    assert re.search(rf"^kjv\s+160x1 tq-3b\+cal\+moved\s+bits {NUMBER}\s+dppl", out, re.M), out
    data = read_json(tmp_path / "l.json")
    assert set(data["sensitivity"]) == {"calibration", "kjv"}
    assert all(len(s["keys"]) == len(s["values"]) == 3 for s in data["sensitivity"].values())
    assert set(data["allocations"]) == {"tq-4b", "tq-3b"} and set(data["screen"]) == {"debian-reference", "kjv"}


def test_calibration(tmp_path):
    out = run_probe("calibration", "--out", str(tmp_path / "c.json"))
    assert out.startswith("Calibration(")
    assert re.search(rf"^kjv\s+160x1 tq-4b\+calK\.125\s+bits {NUMBER}\s+dppl\s+[-+]{NUMBER} %\s+KL", out, re.M), out
    assert re.search(r"^passkey tq-affine-k8v4\+cal\s+\d+/3$", out, re.M), out
    data = read_json(tmp_path / "c.json")
    assert set(data["results"]) == {"debian-reference@160", "kjv@160"} and len(data["needle"]) == 8


def test_block_ranges(tmp_path):
    out = run_probe("block_ranges", "--out", str(tmp_path / "b.json"))
    assert "| variant | relative squared error | blocks |" in out
    rows = {r["variant"]: r for r in read_json(tmp_path / "b.json")["rows"]}
    assert {"own", "own-mse", "pred 1.1", "pred-run", "pt0-wait", "pt1-final"} <= set(rows), sorted(rows)
    assert all(0 < r["relative_squared_error"] < 1 and r["blocks"] > 0 for r in rows.values())
    assert rows["own-mse"]["relative_squared_error"] <= rows["own"]["relative_squared_error"]  # (clipping can only help)


def test_batch_step(tmp_path):
    out = run_probe("batch_step", "--out", str(tmp_path / "b.json"))
    for label in ("plain", "one-call", "per-row"):
        assert re.search(rf"^{label}\s+{NUMBER}\s+{NUMBER} \[", out, re.M), label
    data = read_json(tmp_path / "b.json")
    assert [r["cache"] for r in data["rows"]] == ["plain", "one-call", "per-row"]
    assert data["same_tokens"] is True  # the shortcut changes the calls, never the codes


def test_every_probe_has_a_smoke_test():
    """Every probe in benchmarks/probes/ has its test above, and its docstring (``--help``) says how to smoke it."""
    probes = {p.stem for p in PROBES_DIR.glob("*.py") if not p.name.startswith("_")}
    tested = {name[len("test_"):] for name, f in globals().items() if name.startswith("test_") and callable(f)}
    tested.discard("every_probe_has_a_smoke_test")
    assert probes == tested, f"untested: {sorted(probes - tested)}; tests of no probe: {sorted(tested - probes)}"
    for name in probes:
        assert f"python -m benchmarks.probes.{name} --smoke" in (PROBES_DIR / f"{name}.py").read_text(), name
