"""benchmarks/quality.py's merge (``--from-json``, in benchmarks/_quality_tables.py): saved runs merged (later runs win), and ``--drop`` for configurations whose
definition changed after the earlier runs (only the last run's rows of them stay)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    """benchmarks/_quality_tables.py as a module, loaded from its file (no sys.path edit; standard library only)."""
    spec = importlib.util.spec_from_file_location("benchmarks_quality_tables", ROOT / "benchmarks" / "_quality_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(configs, rows, context="2048"):
    return {"model": "gemma3-270m", "command": f"quality.py --configs {','.join(configs)}",
            "configs": {c: f"{c} then" for c in configs}, "bits": {c: {"bits": {context: 2.0}} for c in configs},
            "corpora": {"kjv": {"tokens": 100, "ppl": {context: rows}}}, "needle": None}


def _row(kl):
    return {"ppl": 3.0, "dppl": 0.1, "kl": kl, "top1": 0.9}


def test_drop_keeps_only_the_last_runs_rows_of_a_changed_config():
    old = _run(["kv", "tq-4b", "tq4-sw"], {"kv": _row(0.0), "tq-4b": _row(0.33), "tq4-sw": _row(0.04)})
    old8k = _run(["tq-4b"], {"tq-4b": _row(0.10)}, context="8192")
    new = _run(["kv", "tq-4b"], {"kv": _row(0.0), "tq-4b": _row(0.014)})
    merge = _tables().merge

    merged = merge([old, old8k, new], drop=["tq-4b"])
    assert merge([old, new])["corpora"]["kjv"]["ppl"]["2048"]["tq-4b"]["kl"] == 0.014  # later runs win anyway
    ppl = merged["corpora"]["kjv"]["ppl"]
    assert ppl["2048"]["tq-4b"]["kl"] == 0.014  # the last run's
    assert "tq-4b" not in ppl.get("8192", {})  # an earlier run's row of the changed config: gone
    assert ppl["2048"]["tq4-sw"]["kl"] == 0.04  # other configs of the earlier runs stay
    assert merged["configs"]["tq-4b"] == "tq-4b then" and merged["bits"]["tq-4b"]["bits"] == {"2048": 2.0}
    # a config's bits measured at other lengths by a later run add to the earlier lengths
    new8k = _run(["tq-4b"], {"tq-4b": _row(0.012)}, context="8192")
    new8k["bits"]["tq-4b"]["bits"] = {"8192": 1.2}
    both = merge([old, old8k, new, new8k], drop=["tq-4b"])
    assert both["bits"]["tq-4b"]["bits"] == {"8192": 1.2}  # dropped: only the last run's
    assert merge([new, new8k])["bits"]["tq-4b"]["bits"] == {"2048": 2.0, "8192": 1.2}
