"""ARCHITECTURE.md states lists the code also holds; these checks keep the page and the code from drifting apart.

- every key of `veloxquant_mlx.codecs.CODECS` is named on the page;
- the page's line "Layers, lowest first: a -> b -> ..." is the import checker's `LAYERS` (test_layers.py, found by
  glob since test files move), name for name and in order;
- every top-level folder and module of the package, and every public module of the library's folders, is named on
  the page (its layer table);
- every module path the page names exists: ``veloxquant_mlx/...`` and other relative file paths as files or folders,
  ``veloxquant_mlx.x.y`` as an importable module or attribute that resolves without a deprecation warning; an old
  path is allowed only as a key of the alias table (`_aliases.SEED_MODULES` / `MOVED_MODULES`);
- every relative link on the page resolves.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "ARCHITECTURE.md"
PACKAGE = ROOT / "veloxquant_mlx"
LIBRARY = ("quant", "codecs", "compat", "attention", "cache", "integration")
PLACEHOLDER = "NAME"  # `benchmarks/NAME.py`, `codec="NAME"`: a name the reader picks

DOTTED = re.compile(r"\bveloxquant_mlx(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SLASHED = re.compile(r"\bveloxquant_mlx/[A-Za-z0-9_./-]*")
CODE = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^[A-Za-z0-9_./-]+\.(?:py|json|md|cpp|txt)$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def layers_module():
    found = sorted(ROOT.glob("tests/**/test_layers.py"))
    assert len(found) == 1, f"expected one test_layers.py under tests/, found {found}"
    spec = importlib.util.spec_from_file_location("_layers_for_architecture_page", found[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_codec_is_named():
    from veloxquant_mlx.codecs import CODECS

    text = page()
    missing = [name for name in CODECS if f"`{name}`" not in text]
    assert not missing, f"ARCHITECTURE.md does not name these keys of CODECS: {missing}"


def test_the_stated_layer_order_is_layers():
    lines = [line for line in page().splitlines() if line.startswith("Layers, lowest first:")]
    assert len(lines) == 1, "ARCHITECTURE.md must state the order once: 'Layers, lowest first: a -> b -> ...'"
    stated = [name.strip() for name in lines[0].split(":", 1)[1].split("->")]
    assert stated == [name for name, _ in layers_module().LAYERS]


def test_every_folder_and_library_module_is_named():
    text = page()
    top = [p.name + "/" if p.is_dir() else p.name for p in sorted(PACKAGE.iterdir())
           if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")]
    public = [p.name for folder in LIBRARY for p in sorted((PACKAGE / folder).glob("*.py"))
              if not p.name.startswith("_")]
    missing = [name for name in top + public if f"`{name}`" not in text and f"`{name.rstrip('/')}`" not in text]
    assert not missing, f"ARCHITECTURE.md's layer table does not name: {missing}"


def _file_exists(path: str) -> bool:
    path = path.rstrip("./")
    if path.startswith("veloxquant_mlx"):
        return (ROOT / path).exists()
    bases = (ROOT, PACKAGE, PACKAGE / "apps")
    if "/" in path:
        return any((base / path).exists() for base in bases)
    # a bare file name: some file of the package, the benchmarks or the scripts (or the root) has it
    return (ROOT / path).exists() or any(
        any(base.rglob(path)) for base in (PACKAGE, ROOT / "benchmarks", ROOT / "scripts"))


def missing_files(text: str):
    paths = set(SLASHED.findall(text))
    paths |= {c for c in CODE.findall(text) if FILE.match(c)}
    return sorted(p for p in paths if PLACEHOLDER not in p and not _file_exists(p))


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        try:
            for name in parts[n:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def stale_dotted(text: str):
    """Dotted paths that do not resolve, or resolve only through the alias table without being one of its keys."""
    from veloxquant_mlx import _aliases

    old = set(_aliases.SEED_MODULES) | set(_aliases.MOVED_MODULES)
    bad = []
    for dotted in sorted(set(DOTTED.findall(text))):
        if PLACEHOLDER in dotted or dotted in old:
            continue
        parts = dotted.split(".")
        if any(".".join(parts[:n]) in old for n in range(2, len(parts))):
            bad.append(f"{dotted} (below an old path of the alias table)")
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = _resolves(dotted)
        moved = [str(w.message) for w in caught
                 if issubclass(w.category, DeprecationWarning) and str(w.message).startswith("veloxquant_mlx")]
        if not ok:
            bad.append(f"{dotted} (does not exist)")
        elif moved:
            bad.append(f"{dotted} (an old path: {moved[0]})")
    return bad


def test_every_path_the_page_names_exists():
    text = page()
    assert not missing_files(text), f"ARCHITECTURE.md names files that do not exist: {missing_files(text)}"
    stale = stale_dotted(text)
    assert not stale, f"ARCHITECTURE.md names module paths that are gone or moved: {stale}"


def test_the_checks_catch_stale_paths():
    """The checkers themselves: old paths issue 57 moved are refused, unless named as keys of the alias table."""
    assert missing_files("`veloxquant_mlx/cache/rows.py` `cache/options.py` `benchmarks/NAME.py`") == [
        "veloxquant_mlx/cache/rows.py"]
    assert stale_dotted("veloxquant_mlx.options veloxquant_mlx.core.abstractions veloxquant_mlx.cache.presets") == []
    stale = stale_dotted("veloxquant_mlx.eval.memory veloxquant_mlx.integration.enable veloxquant_mlx.cache.rows")
    assert [s.split()[0] for s in stale] == [
        "veloxquant_mlx.cache.rows", "veloxquant_mlx.eval.memory", "veloxquant_mlx.integration.enable"]


@pytest.mark.parametrize("target", sorted(set(LINK.findall(PAGE.read_text(encoding="utf-8")))) or ["-"])
def test_relative_links_resolve(target):
    if target == "-" or "://" in target:
        return
    assert (PAGE.parent / target).exists(), f"ARCHITECTURE.md links to a missing file: {target}"
