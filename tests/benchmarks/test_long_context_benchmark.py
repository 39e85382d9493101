"""benchmarks/long_context.py end to end on the embedded SmolLM2 at a short length (the script that writes the
long-context figures of the README and docs/results.md): one child process per length, every config's bytes, peak
memory and speed recorded, the paired decode ratios against the first config, and a JSON the results page reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_long_context_writes_every_config_per_length(tmp_path):
    out = tmp_path / "lc.json"
    env = dict(os.environ)  # this checkout's package, whatever the interpreter has installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "benchmarks/long_context.py", "--model", "smollm2", "--lengths", "300",
                           "--configs", "plain,default,tq-4b+rope_offset", "--decode", "4", "--steps", "3", "--repeats", "1",
                           "--prefill-step", "128", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["configs"] == ["plain", "default", "tq-4b+rope_offset"] and [r["length"] for r in data["runs"]] == [300]
    run = data["runs"][0]
    plain, default, tq4 = (run["configs"][c] for c in data["configs"])
    # SmolLM2 runs in float32: plain stores 32 bits a coordinate; ours a fraction of that, the budget less again
    assert abs(plain["bits"] - 32.0) < 0.5, plain["bits"]
    assert tq4["cache_bytes"] < default["cache_bytes"] < plain["cache_bytes"] / 3
    assert plain["cache_types"] == ["KVCache"] and default["preset"] and tq4["preset"] == "tq-4b"
    assert tq4["options"] == {"rope_offset": True} and default["options"] == {}
    for r in (plain, default, tq4):
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and len(r["step_seconds"]) == 3
        assert r["peak_mlx_bytes"] > 0 and len(r["tokens"]) == 4
    assert "decode_x_plain" not in plain
    for r in (default, tq4):
        g, lo, hi = r["decode_x_plain"]
        assert 0 < lo <= g <= hi
    assert "300 tokens" in done.stdout and "decode x plain [95%]" in done.stdout


def test_a_config_names_a_preset_with_options_changed():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import preset_with_options
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert preset_with_options("tq-4b") == ("tq-4b", {})
    assert preset_with_options("tq-4b+rope_offset+codec=kblock_vsym8_pt+sink=4+center_keys=false") == (
        "tq-4b", {"rope_offset": True, "codec": "kblock_vsym8_pt", "sink": 4, "center_keys": False})
