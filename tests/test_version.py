"""The package version (`veloxquant_mlx._version`): one number for the package, its metadata and the deprecation
horizon of the aliases."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import veloxquant_mlx
from veloxquant_mlx._version import DEPRECATED_UNTIL, __version__

ROOT = Path(__file__).resolve().parents[1]


def _v(text: str):
    return tuple(int(p) for p in text.split("."))


def test_the_package_and_pyproject_carry_the_same_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert veloxquant_mlx.__version__ == __version__
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_aliases_are_removed_in_a_later_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", DEPRECATED_UNTIL) and _v(DEPRECATED_UNTIL) > _v(__version__)


def test_reading_the_version_imports_nothing_heavy():
    """Its own module so that library code reads it without the package's export table (or MLX)."""
    code = ("import sys; from veloxquant_mlx._version import __version__; "
            "print(sorted(m for m in sys.modules if m.startswith(('mlx', 'mlx_lm', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
