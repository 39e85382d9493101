"""The tests mirror the package: a newcomer finds a module's tests by its path.

For every module ``veloxquant_mlx/<dirs>/<name>.py`` (package ``__init__`` files and ``__main__`` aside) there is a
test file ``tests/<dirs>/test_<name>.py`` or ``tests/<dirs>/test_<name>_<topic>.py`` (a leading underscore of a
private module dropped: ``cache/_face.py`` -> ``tests/cache/test_face.py``), and that file imports the module. Tests
of the project as a whole (the import graph, the README, the install, the docs pages) live in ``tests/project/``,
tests of the benchmark scripts in ``tests/benchmarks/``; nothing else sits outside the mirror. Test files have
unique names across the tree (pytest imports them by base name: the test folders are not packages).
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "veloxquant_mlx"
TESTS = ROOT / "tests"
OUTSIDE_THE_MIRROR = ("project", "benchmarks")


def library_modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def _test_files():
    return sorted(TESTS.rglob("test_*.py"))


def _imports_module(test: Path, dotted: str) -> bool:
    parent, _, leaf = dotted.rpartition(".")
    for node in ast.walk(ast.parse(test.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name == dotted or a.name.startswith(dotted + ".")
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == dotted or node.module.startswith(dotted + "."):
                return True
            if node.module == parent and any(a.name == leaf for a in node.names):
                return True
    return False


def mirrored_tests(module: Path):
    rel = module.relative_to(PACKAGE)
    stem = rel.stem.lstrip("_")
    folder = TESTS.joinpath(*rel.parts[:-1])
    return sorted(p for p in folder.glob(f"test_{stem}*.py")
                  if p.stem == f"test_{stem}" or p.stem.startswith(f"test_{stem}_"))


def test_every_library_module_has_its_tests_under_the_mirrored_path():
    missing, not_importing = [], []
    for module in library_modules():
        found = mirrored_tests(module)
        rel = module.relative_to(PACKAGE)
        want = TESTS.joinpath(*rel.parts[:-1], f"test_{rel.stem.lstrip('_')}.py").relative_to(ROOT)
        if not found:
            missing.append(f"{module.relative_to(ROOT)}: no {want}")
            continue
        dotted = ".".join(("veloxquant_mlx",) + rel.with_suffix("").parts)
        if not any(_imports_module(t, dotted) for t in found):
            not_importing.append(f"{module.relative_to(ROOT)}: {[str(t.relative_to(ROOT)) for t in found]}")
    assert not missing, "modules without tests at the mirrored path:\n" + "\n".join(missing)
    assert not not_importing, "mirrored tests that do not import their module:\n" + "\n".join(not_importing)


def test_every_test_file_mirrors_a_module_or_the_project():
    stray = []
    modules = library_modules()
    for test in _test_files():
        rel = test.relative_to(TESTS)
        if rel.parts[0] in OUTSIDE_THE_MIRROR:
            continue
        if not any(test in mirrored_tests(m) for m in modules):
            stray.append(str(test.relative_to(ROOT)))
    assert not stray, "test files that mirror no module (rename, or move to tests/project/):\n" + "\n".join(stray)


def test_test_file_names_are_unique():
    counts = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in counts.items() if c > 1], sorted(n for n, c in counts.items() if c > 1)
