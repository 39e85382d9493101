"""The tests have teeth: `scripts/sabotage.py --fast` breaks the library six ways (attention routing off, random
keys stored, codes with fewer bits, a failing model loader, `nbytes` halved, the server's request checks off), one
at a time inside a pytest run of one quick test each, and every sabotage must make its test fail. The whole table
(`python scripts/sabotage.py`) runs more tests per sabotage; this is the part CI runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_sabotage_of_the_fast_subset_is_caught():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # a fresh pytest, not this one's
    done = subprocess.run([sys.executable, "scripts/sabotage.py", "--fast"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert "6 of 6 sabotages caught" in out, out[-3000:]
    assert done.returncode == 0, out[-3000:]
    assert "fails without sabotage" not in out, out[-3000:]  # the selected tests pass on the library as it is
